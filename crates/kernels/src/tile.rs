//! The batched product (prefill, several sequences) on AVX-512 VNNI: register tiles of
//! 4 weight rows × up to 4 tokens in 512-bit registers.
//!
//! Each step of 64 weights loads the 4 unpacked rows and their scales once and each
//! token's 64 activations once, then does 16 `vpdpbusd` products: every byte loaded is
//! used four times from registers. The per-16 weight scales and per-32 activation scales
//! are spread over the 16 lanes by one permute each, so no expanded copies are stored.
//! Q8_0 rows are made unsigned here (`q + 128` with a bias of `-128·d`) so that every block
//! type takes the same unsigned × signed product without sign tricks.
//!
//! Rows are unpacked once per block of tokens whose activations fit in the core's L2
//! cache, so long prompts on wide matrices do not stream the activations from memory for
//! every panel.

use std::cell::RefCell;

use crate::ThreadPool;
use crate::blocks::{BlockType, Unpacked, unpack_row_with};
use crate::dot::Isa;
use crate::matmul::{Activations, QuantMatrix};

/// Weight rows per tile.
const ROWS: usize = 4;
/// Tokens per tile.
const TOKENS: usize = 4;
/// Bytes of quantized activations per token block (about half of L2).
const TOKEN_BLOCK_BYTES: usize = 1 << 20;

/// Whether the tiled kernel can take this product.
pub(crate) fn applies(isa: Isa, w: &QuantMatrix, t: usize) -> bool {
    cfg!(target_arch = "x86_64")
        && matches!(isa, Isa::Avx512Vnni | Isa::Amx)
        && t > 1
        && w.cols().is_multiple_of(64)
}

thread_local! {
    static PANEL: RefCell<Vec<Unpacked>> = const { RefCell::new(Vec::new()) };
}

/// `out (t, rows) = acts · wᵀ`. Callers check [`applies`] first.
pub(crate) fn matmul(pool: &ThreadPool, w: &QuantMatrix, acts: &Activations, out: &mut [f32]) {
    let n = w.rows();
    let k = w.cols();
    let t = acts.rows();
    let panels = n.div_ceil(ROWS);
    let threads = pool.size().min(panels).max(1);
    let per = panels.div_ceil(threads);
    let token_block = (TOKEN_BLOCK_BYTES / k / TOKENS * TOKENS).max(TOKENS);
    let out_addr = out.as_mut_ptr() as usize;
    pool.run(&|i| {
        let first = (i * per).min(panels);
        let last = ((i + 1) * per).min(panels);
        PANEL.with(|cell| {
            let mut panel = cell.borrow_mut();
            if panel.len() != ROWS || panel[0].q.len() != k {
                *panel = (0..ROWS).map(|_| Unpacked::with_cols(k)).collect();
            }
            let mut tok0 = 0;
            while tok0 < t {
                let tok1 = (tok0 + token_block).min(t);
                for p in first..last {
                    let r0 = p * ROWS;
                    let used = (n - r0).min(ROWS);
                    fill_panel(w, r0, used, &mut panel);
                    let mut tok = tok0;
                    while tok < tok1 {
                        let take = (tok1 - tok).min(TOKENS);
                        let mut vals = [[0f32; TOKENS]; ROWS];
                        // SAFETY: `applies` checked the Isa (AVX-512 F/BW/VNNI available)
                        // and that k is a multiple of 64; the panel rows and activation
                        // rows all hold k values.
                        #[cfg(target_arch = "x86_64")]
                        unsafe {
                            x86::tile_dispatch(&panel, acts, tok, take, &mut vals)
                        };
                        for j in 0..take {
                            for (r, row) in vals.iter().enumerate().take(used) {
                                let v = row[j];
                                // SAFETY: each thread writes only its own panels' columns
                                // of every output row; `out` outlives `run`.
                                unsafe { *(out_addr as *mut f32).add((tok + j) * n + r0 + r) = v };
                            }
                        }
                        tok += take;
                    }
                }
                tok0 = tok1;
            }
        });
    });
}

/// Unpacks rows `r0..r0 + used` of `w` into the panel; unused panel rows become zeros.
fn fill_panel(w: &QuantMatrix, r0: usize, used: usize, panel: &mut [Unpacked]) {
    let ty = w.block_type();
    for (i, row) in panel.iter_mut().enumerate() {
        if i >= used {
            row.q.fill(0);
            row.scale.fill(0.0);
            row.bias.fill(0.0);
            continue;
        }
        unpack_row_with(Isa::Avx2, ty, &w.row(r0 + i), row);
        if ty == BlockType::Q8_0 {
            for q in &mut row.q {
                *q ^= 0x80;
            }
            for (b, s) in row.bias.iter_mut().zip(&row.scale) {
                *b = -128.0 * s;
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use super::{ROWS, TOKENS};
    use crate::blocks::Unpacked;
    use crate::matmul::Activations;

    /// # Safety
    /// AVX-512 F, BW and VNNI must be available; `panel` holds `ROWS` rows of k values,
    /// k a multiple of 64, and tokens `tok..tok + take` exist in `acts` (`take ≤ 4`).
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
    pub(super) unsafe fn tile_dispatch(
        panel: &[Unpacked],
        acts: &Activations,
        tok: usize,
        take: usize,
        out: &mut [[f32; TOKENS]; ROWS],
    ) {
        // SAFETY: forwarded from the caller.
        unsafe {
            match take {
                1 => tile::<1>(panel, acts, tok, out),
                2 => tile::<2>(panel, acts, tok, out),
                3 => tile::<3>(panel, acts, tok, out),
                _ => tile::<4>(panel, acts, tok, out),
            }
        }
    }

    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
    unsafe fn tile<const N: usize>(
        panel: &[Unpacked],
        acts: &Activations,
        tok: usize,
        out: &mut [[f32; TOKENS]; ROWS],
    ) {
        let k = panel[0].q.len();
        let wq: [*const u8; ROWS] = std::array::from_fn(|r| panel[r].q.as_ptr());
        let wd: [*const f32; ROWS] = std::array::from_fn(|r| panel[r].scale.as_ptr());
        let xq: [*const i8; N] = std::array::from_fn(|j| acts.row(tok + j).0.as_ptr());
        let xd: [*const f32; N] = std::array::from_fn(|j| acts.row(tok + j).1.as_ptr());
        // Lane l of a 64-byte step covers bytes 4l..4l+3: weight group l/4 (16 weights),
        // activation block l/8 (32 weights).
        let spread_w = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
        let spread_x = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
        let zero = _mm512_setzero_si512();
        let mut acc = [[_mm512_setzero_ps(); N]; ROWS];
        let groups = k / 16;
        let wb: [*const f32; ROWS] = std::array::from_fn(|r| panel[r].bias.as_ptr());
        let xsum: [*const f32; N] = std::array::from_fn(|j| acts.row(tok + j).2.as_ptr());
        for s in 0..k / 64 {
            if s % 4 == 0 {
                // The bias terms of the next 256 weights, Σ_h bias_h·(d·Σ_{i∈h} x_i) over
                // their 16 groups, before their products: the single-token kernel's
                // order (`wide`), so a row's result is the same in a batch or alone.
                let g = 4 * s;
                let mask: __mmask16 = if groups - g >= 16 {
                    0xFFFF
                } else {
                    (1 << (groups - g)) - 1
                };
                // SAFETY: the mask keeps every load inside the k/16 biases and sums.
                let b: [__m512; ROWS] =
                    std::array::from_fn(|r| unsafe { _mm512_maskz_loadu_ps(mask, wb[r].add(g)) });
                for j in 0..N {
                    // SAFETY: as above.
                    let x = unsafe { _mm512_maskz_loadu_ps(mask, xsum[j].add(g)) };
                    for r in 0..ROWS {
                        acc[r][j] = _mm512_fmadd_ps(b[r], x, acc[r][j]);
                    }
                }
            }
            let mut w = [zero; ROWS];
            let mut ws = [_mm512_setzero_ps(); ROWS];
            for r in 0..ROWS {
                // SAFETY: s·64 + 64 ≤ k bytes of q; s·4 + 4 ≤ k/16 scales.
                unsafe {
                    w[r] = _mm512_loadu_si512(wq[r].add(s * 64) as *const __m512i);
                    ws[r] = _mm512_permutexvar_ps(
                        spread_w,
                        _mm512_maskz_loadu_ps(0xF, wd[r].add(s * 4)),
                    );
                }
            }
            for j in 0..N {
                // SAFETY: as above for the activation row; s·2 + 2 ≤ k/32 scales.
                let (x, xs) = unsafe {
                    (
                        _mm512_loadu_si512(xq[j].add(s * 64) as *const __m512i),
                        _mm512_permutexvar_ps(
                            spread_x,
                            _mm512_maskz_loadu_ps(0x3, xd[j].add(s * 2)),
                        ),
                    )
                };
                for r in 0..ROWS {
                    let p = _mm512_dpbusd_epi32(zero, w[r], x);
                    acc[r][j] =
                        _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), _mm512_mul_ps(ws[r], xs), acc[r][j]);
                }
            }
        }
        for r in 0..ROWS {
            for j in 0..N {
                out[r][j] = _mm512_reduce_add_ps(acc[r][j]);
            }
        }
    }
}
