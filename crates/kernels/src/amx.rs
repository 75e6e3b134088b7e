//! The batched product (prefill) on AMX: Sapphire Rapids' tile units, `tdpbf16ps`.
//!
//! One `tdpbf16ps` multiplies a 16 × 32 bf16 tile by a 32 × 16 one into 16 × 16 f32
//! accumulators: 8 192 multiply-adds, sixteen times what a 512-bit `vpdpbusd` does. The
//! per-16 weight scales of the GGUF formats cannot be applied inside such a long sum, so
//! the weights are dequantized instead: each panel of 32 rows once per call to bf16
//! (`w = scale·q + bias`, rounded to 8 significant bits), the activations once per call
//! to bf16 pairs in the tile layout AMX wants. The panel then meets every token from the
//! L2 cache: 2 weight tiles × 2 activation tiles → 4 accumulator tiles per step of 32.
//!
//! Rounding: bf16 keeps 8 significant bits of each weight and each activation (relative
//! error ≤ 2⁻⁹ each, f32 sums), finer than the 8-bit activations per 32 of the integer
//! kernels, which single tokens still use.
//!
//! The process asks the kernel for the tile state once (`arch_prctl(ARCH_REQ_XCOMP_PERM)`);
//! without that permission the first tile instruction would kill it, so [`supported`]
//! is false and the VNNI tiles serve batches instead.

#![cfg(target_arch = "x86_64")]

use std::arch::asm;
use std::arch::x86_64::*;
use std::cell::RefCell;
use std::sync::OnceLock;

use crate::ThreadPool;
use crate::blocks::{Unpacked, unpack_row_with};
use crate::dot::Isa;
use crate::matmul::QuantMatrix;

/// Weight rows per panel (two tiles of 16).
const PANEL: usize = 32;
/// Tokens per step (two tiles of 16).
const TOKENS: usize = 32;
/// Bytes of packed activations per block of tokens: each panel is dequantized again for
/// every block, which on the machines measured cost more than streaming the tiles of a
/// long prompt's activations from L3 (the tile loads themselves are the slower part).
const ACTS_BLOCK_BYTES: usize = 1 << 24;
/// Bytes of one tile: 16 rows of 64.
const TILE: usize = 1024;

/// Whether this CPU has AMX-BF16 and AVX-512 BF16 and the kernel lets the process use
/// the tile state (asked once, on the first call).
pub(crate) fn supported() -> bool {
    static OK: OnceLock<bool> = OnceLock::new();
    *OK.get_or_init(|| {
        let leaf7 = __cpuid_count(7, 0);
        let leaf7_1 = __cpuid_count(7, 1);
        let amx_bf16 = (leaf7.edx >> 22) & 1 == 1;
        let amx_tile = (leaf7.edx >> 24) & 1 == 1;
        let avx512_bf16 = (leaf7_1.eax >> 5) & 1 == 1;
        amx_bf16 && amx_tile && avx512_bf16 && request_tile_permission()
    })
}

#[cfg(not(target_os = "linux"))]
fn request_tile_permission() -> bool {
    false // only Linux's arch_prctl is known to grant it
}

#[cfg(target_os = "linux")]
fn request_tile_permission() -> bool {
    const ARCH_REQ_XCOMP_PERM: libc::c_long = 0x1023;
    const XFEATURE_XTILEDATA: libc::c_long = 18;
    // SAFETY: arch_prctl(ARCH_REQ_XCOMP_PERM) only grants this process the right to use
    // the AMX tile state; it touches no memory of ours.
    unsafe {
        libc::syscall(
            libc::SYS_arch_prctl,
            ARCH_REQ_XCOMP_PERM,
            XFEATURE_XTILEDATA,
        ) == 0
    }
}

/// `ldtilecfg`'s 64-byte operand: palette 1, eight tiles of 16 rows × 64 bytes.
#[repr(C, align(64))]
struct TileConfig {
    palette: u8,
    start_row: u8,
    reserved: [u8; 14],
    bytes_per_row: [u16; 16],
    rows: [u8; 16],
}

impl TileConfig {
    fn eight_full_tiles() -> Self {
        let mut c = Self {
            palette: 1,
            start_row: 0,
            reserved: [0; 14],
            bytes_per_row: [0; 16],
            rows: [0; 16],
        };
        for t in 0..8 {
            c.bytes_per_row[t] = 64;
            c.rows[t] = 16;
        }
        c
    }
}

thread_local! {
    /// This thread's dequantized panel (`PANEL` rows of `k` bf16) and unpacked row.
    static SCRATCH: RefCell<(Vec<u16>, Unpacked)> = RefCell::new((Vec::new(), Unpacked::default()));
    /// The calling thread's packed activations.
    static PACKED: RefCell<Vec<u32>> = const { RefCell::new(Vec::new()) };
}

/// `out (t, rows) = x (t, cols) · wᵀ`. Callers check [`supported`] first; `cols` is a
/// multiple of 32 (every block type's is).
pub(crate) fn matmul(pool: &ThreadPool, w: &QuantMatrix, x: &[f32], t: usize, out: &mut [f32]) {
    let (n, k) = (w.rows(), w.cols());
    debug_assert!(k.is_multiple_of(32) && x.len() == t * k && out.len() == t * n);
    let steps = k / 32;
    // Groups of 16 tokens, padded to whole steps of 32.
    let groups = t.div_ceil(TOKENS) * 2;
    PACKED.with(|cell| {
        let mut packed = cell.borrow_mut();
        packed.clear();
        packed.resize(groups * steps * TILE / 4, 0);
        let packed_addr = packed.as_mut_ptr() as usize;
        pool.run(&|i| {
            let mut g = i;
            while g < groups {
                // SAFETY: AVX-512 F/BF16 come with `supported`; each thread writes only
                // its own groups' tiles, inside the buffer sized above.
                unsafe { pack_group(x, t, k, g, (packed_addr as *mut u32).add(g * steps * 256)) };
                g += pool.size();
            }
        });
        let panels = n.div_ceil(PANEL);
        let per = panels.div_ceil(pool.size().min(panels).max(1));
        let out_addr = out.as_mut_ptr() as usize;
        let packed: &[u32] = &packed;
        pool.run(&|i| {
            let first = (i * per).min(panels);
            let last = ((i + 1) * per).min(panels);
            if first == last {
                return;
            }
            SCRATCH.with(|cell| {
                let mut scratch = cell.borrow_mut();
                let (panel, row) = &mut *scratch;
                panel.resize(PANEL * k, 0);
                let config = TileConfig::eight_full_tiles();
                // SAFETY: `supported` granted the tile state; the config is valid.
                unsafe { asm!("ldtilecfg [{}]", in(reg) &config as *const TileConfig) };
                // Tokens in blocks of ACTS_BLOCK_BYTES; each panel is dequantized once
                // per block.
                let block_pairs = (ACTS_BLOCK_BYTES / (2 * k * TOKENS)).max(1);
                let mut pair0 = 0;
                while pair0 < groups / 2 {
                    let pair1 = (pair0 + block_pairs).min(groups / 2);
                    for p in first..last {
                        let r0 = p * PANEL;
                        fill_panel(w, r0, panel, row);
                        for pair in pair0..pair1 {
                            let mut c = [[0f32; 256]; 4];
                            // SAFETY: the panel holds PANEL rows of k bf16; the packed tiles of
                            // groups 2·pair and 2·pair + 1 exist for every step.
                            unsafe {
                                product(
                                    panel.as_ptr(),
                                    packed.as_ptr().add(2 * pair * steps * 256),
                                    steps,
                                    &mut c,
                                )
                            };
                            // Tile 2·a + b holds rows r0 + 16a.. × tokens 32·pair + 16b..
                            for (ti, tile) in c.iter().enumerate() {
                                let (a, b) = (ti / 2, ti % 2);
                                for m in 0..16 {
                                    let r = r0 + 16 * a + m;
                                    if r >= n {
                                        break;
                                    }
                                    for j in 0..16 {
                                        let tok = TOKENS * pair + 16 * b + j;
                                        if tok >= t {
                                            break;
                                        }
                                        // SAFETY: each thread writes only its own panels'
                                        // columns of every output row; `out` outlives `run`.
                                        unsafe {
                                            *(out_addr as *mut f32).add(tok * n + r) =
                                                tile[16 * m + j]
                                        };
                                    }
                                }
                            }
                        }
                    }
                    pair0 = pair1;
                }
                // SAFETY: returns the tile state to its initial configuration.
                unsafe { asm!("tilerelease") };
            });
        });
    });
}

/// Accumulates one panel (32 rows) against 32 tokens over all `steps` into four tiles.
///
/// # Safety
/// Tiles configured by `eight_full_tiles`; `panel` holds 32 rows of `32·steps` bf16 in
/// tile order; `acts` holds two groups of `steps` packed tiles.
unsafe fn product(panel: *const u16, acts: *const u32, steps: usize, c: &mut [[f32; 256]; 4]) {
    // SAFETY: per the contract; tiles 0–3 accumulate, 4–5 weights, 6–7 activations.
    unsafe {
        asm!(
            "tilezero tmm0",
            "tilezero tmm1",
            "tilezero tmm2",
            "tilezero tmm3"
        );
        for s in 0..steps {
            let w0 = panel.add(1024 * s);
            let w1 = panel.add(1024 * s + 512);
            let x0 = acts.add(256 * s);
            let x1 = acts.add(256 * (steps + s));
            asm!(
                "tileloadd tmm4, [{w0} + {row}*1]",
                "tileloadd tmm5, [{w1} + {row}*1]",
                "tileloadd tmm6, [{x0} + {row}*1]",
                "tileloadd tmm7, [{x1} + {row}*1]",
                "tdpbf16ps tmm0, tmm4, tmm6",
                "tdpbf16ps tmm1, tmm4, tmm7",
                "tdpbf16ps tmm2, tmm5, tmm6",
                "tdpbf16ps tmm3, tmm5, tmm7",
                w0 = in(reg) w0,
                w1 = in(reg) w1,
                x0 = in(reg) x0,
                x1 = in(reg) x1,
                row = in(reg) 64usize,
                options(nostack),
            );
        }
        asm!(
            "tilestored [{c0} + {row}*1], tmm0",
            "tilestored [{c1} + {row}*1], tmm1",
            "tilestored [{c2} + {row}*1], tmm2",
            "tilestored [{c3} + {row}*1], tmm3",
            c0 = in(reg) c[0].as_mut_ptr(),
            c1 = in(reg) c[1].as_mut_ptr(),
            c2 = in(reg) c[2].as_mut_ptr(),
            c3 = in(reg) c[3].as_mut_ptr(),
            row = in(reg) 64usize,
            options(nostack),
        );
    }
}

/// Packs tokens `16g..16g + 16` of `x` (zeros past `t`) into `k / 32` tiles: tile `s`, row
/// `i`, column `j` holds the bf16 pair `x[16g + j][32s + 2i ..= 32s + 2i + 1]`.
///
/// # Safety
/// AVX-512 F and BF16 available; `dst` has room for `k / 32` tiles.
#[target_feature(enable = "avx512f,avx512bf16")]
unsafe fn pack_group(x: &[f32], t: usize, k: usize, g: usize, dst: *mut u32) {
    let rows = _mm512_set_epi32(
        240, 224, 208, 192, 176, 160, 144, 128, 112, 96, 80, 64, 48, 32, 16, 0,
    );
    for j in 0..16 {
        let tok = 16 * g + j;
        if tok >= t {
            break; // the buffer was zeroed
        }
        let xr = &x[tok * k..(tok + 1) * k];
        for s in 0..k / 32 {
            // SAFETY: 32 values of the row at 32s; the scatter writes column j of tile s.
            unsafe {
                let lo = _mm512_loadu_ps(xr.as_ptr().add(32 * s));
                let hi = _mm512_loadu_ps(xr.as_ptr().add(32 * s + 16));
                let pairs: __m512i = std::mem::transmute(_mm512_cvtne2ps_pbh(hi, lo));
                _mm512_i32scatter_epi32::<4>(dst.add(256 * s + j) as *mut i32, rows, pairs);
            }
        }
    }
}

/// Dequantizes rows `r0..r0 + PANEL` of `w` to bf16 (rows past the matrix: zeros), in
/// tile order: step `s`'s tile of rows `16h..16h + 16` is 1 KiB at `(2s + h)·512`, so
/// every tile load reads one contiguous run.
fn fill_panel(w: &QuantMatrix, r0: usize, panel: &mut [u16], row: &mut Unpacked) {
    let k = w.cols();
    if row.q.len() != k {
        *row = Unpacked::with_cols(k);
    }
    for i in 0..PANEL {
        if r0 + i >= w.rows() {
            for s in 0..k / 32 {
                let at = tile_offset(s, i);
                panel[at..at + 32].fill(0);
            }
            continue;
        }
        unpack_row_with(Isa::Avx2, w.block_type(), &w.row(r0 + i), row);
        // SAFETY: AVX-512 F/BF16 come with `supported`; `row` holds k values and the
        // panel PANEL rows of k.
        unsafe { to_bf16(row, w.block_type().signed(), panel, i) };
    }
}

/// Where panel row `i`'s values `32s..32s + 32` go.
fn tile_offset(s: usize, i: usize) -> usize {
    (2 * s + i / 16) * 512 + (i % 16) * 32
}

/// `scale·q + bias` per 16 weights, rounded to bf16, into panel row `i`.
#[target_feature(enable = "avx512f,avx512bf16")]
unsafe fn to_bf16(row: &Unpacked, signed: bool, panel: &mut [u16], i: usize) {
    let k = row.q.len();
    assert!(k.is_multiple_of(32) && panel.len() >= PANEL * k && i < PANEL);
    for s in 0..k / 32 {
        // SAFETY: 32 bytes of q at 32s and 32 u16 of the panel at the tile offset, checked
        // above.
        unsafe {
            let values: [__m512; 2] = std::array::from_fn(|half| {
                let g = 2 * s + half;
                let bytes = _mm_loadu_si128(row.q.as_ptr().add(16 * g) as *const __m128i);
                let q = if signed {
                    _mm512_cvtepi8_epi32(bytes)
                } else {
                    _mm512_cvtepu8_epi32(bytes)
                };
                _mm512_fmadd_ps(
                    _mm512_cvtepi32_ps(q),
                    _mm512_set1_ps(row.scale[g]),
                    _mm512_set1_ps(row.bias[g]),
                )
            });
            let bf: __m512i = std::mem::transmute(_mm512_cvtne2ps_pbh(values[1], values[0]));
            _mm512_storeu_si512(panel.as_mut_ptr().add(tile_offset(s, i)) as *mut _, bf);
        }
    }
}
