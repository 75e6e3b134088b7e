//! 512-bit single-token dot products (AVX-512 F/BW/VL, VNNI, F16C): the decode path on
//! machines that have them.
//!
//! Each `vpdpbusd` takes 64 weights: two 32-weight blocks, or 64 consecutive weights of a
//! K-quant super-block. The weight scales are not applied per block in scalar code (the
//! AVX2 loop's cost) but once per eight blocks as a vector — `scale · d_x` for every
//! 32 weights (`s`), spread over the lanes of each product by one `vpermps` — and the
//! bias terms (`bias · Σx` per 16 weights) are one FMA per eight blocks (into the same
//! accumulator, before those blocks' products: `tile` does the same, in the same order) against the
//! activation sums. Per 64 weights and row: a load, two or three integer ops to form the
//! unsigned `q`, `vpdpbusd`, a convert, a permute and an FMA.
//!
//! `Σ w·x = Σ_h scale_h·d_x·Σ_{i∈h} q_i·x_i + Σ_h bias_h·Σ_{i∈h} x_i` as in the crate
//! comment; `q` unsigned (Q8_0's signed bytes are offset by 128, its bias `-128·d`).

#![cfg(target_arch = "x86_64")]

use std::arch::x86_64::*;

use crate::BlockType;
use crate::matmul::Activations;

/// How far ahead of the block in hand the weights are prefetched when a pass's rows are
/// long, in bytes.
const AHEAD: usize = 1024;
/// Passes of rows up to this many bytes prefetch the next pass instead (the same offset
/// four rows on): short rows end before a prefetch 1 KiB ahead reaches new memory.
const NEXT_PASS_BYTES: usize = 32 << 10;

/// How far ahead of a block the decode kernels prefetch its row, for rows of
/// `row_bytes`: the next pass (the caller's passes take `fused::ROWS` consecutive rows)
/// when a pass is short, else [`AHEAD`] within the row.
pub(crate) fn prefetch_distance(row_bytes: usize) -> usize {
    let pass_bytes = crate::fused::ROWS * row_bytes;
    if pass_bytes <= NEXT_PASS_BYTES {
        pass_bytes
    } else {
        AHEAD
    }
}

/// Tokens one call takes at most: each weight block is decoded once for all of them.
pub(crate) const TOKENS: usize = 4;

/// `Σ w·x` of up to four packed rows (`rows[..n]`) and activation rows `first..first +
/// count` of `acts` (`count ≤` [`TOKENS`]), into `out[token][..n]`. Every (row, token)
/// pair is computed by the same operations in the same order whatever the number of rows
/// and tokens beside it, so a token's result is bit for bit the one it gets alone: the
/// weights are decoded once per block and used by every token, the arithmetic stays per
/// pair.
///
/// # Safety
/// The CPU must have the features of `Isa::Avx512Vnni`; every row has the same length,
/// `acts` rows of that many values.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
pub(crate) unsafe fn dot(
    ty: BlockType,
    rows: &[&[u8]],
    acts: &Activations,
    first: usize,
    count: usize,
    out: &mut [[f32; crate::fused::ROWS]; TOKENS],
) {
    let cols = acts.cols();
    assert!(first + count <= acts.rows() && (1..=TOKENS).contains(&count));
    assert!(rows.iter().all(|r| r.len() == ty.row_bytes(cols)));
    macro_rules! by_rows {
        ($t:literal) => {
            // SAFETY: lengths checked above; features forwarded.
            unsafe {
                match rows.len() {
                    1 => dot_n::<1, $t>(ty, rows, acts, first, out),
                    2 => dot_n::<2, $t>(ty, rows, acts, first, out),
                    3 => dot_n::<3, $t>(ty, rows, acts, first, out),
                    _ => dot_n::<4, $t>(ty, rows, acts, first, out),
                }
            }
        };
    }
    match count {
        1 => by_rows!(1),
        2 => by_rows!(2),
        3 => by_rows!(3),
        _ => by_rows!(4),
    }
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn dot_n<const R: usize, const T: usize>(
    ty: BlockType,
    rows: &[&[u8]],
    acts: &Activations,
    first: usize,
    out: &mut [[f32; crate::fused::ROWS]; TOKENS],
) {
    let mut acc = [[_mm512_setzero_ps(); T]; R];
    let cols = acts.cols();
    let mut x = [std::ptr::null(); T];
    let mut xd = [std::ptr::null(); T];
    let mut xs = [std::ptr::null(); T];
    for t in 0..T {
        let (q, d, s) = acts.row(first + t);
        (x[t], xd[t], xs[t]) = (q.as_ptr() as *const u8, d.as_ptr(), s.as_ptr());
    }
    let mut rp = [std::ptr::null(); R];
    for r in 0..R {
        rp[r] = rows[r].as_ptr();
    }
    let input = Input {
        rows: rp,
        x,
        xd,
        xs,
        ahead: prefetch_distance(ty.row_bytes(cols)),
    };
    // SAFETY: every pointer below stays inside its row or activation slice: the callers
    // checked that the rows hold `cols / block_size` whole blocks and the activations
    // `cols` values; prefetches never fault.
    unsafe {
        match ty {
            BlockType::Q4K => q4k::<R, T>(&input, cols / 256, &mut acc),
            BlockType::Q6K => q6k::<R, T>(&input, cols / 256, &mut acc),
            _ => blocks32::<R, T>(ty, &input, cols / 32, &mut acc),
        }
    }
    for r in 0..R {
        for t in 0..T {
            out[t][r] = _mm512_reduce_add_ps(acc[r][t]);
        }
    }
}

/// What every kernel reads: `R` weight rows, `T` quantized activation rows (bytes,
/// per-32 scales, per-16 sums) and the prefetch distance.
#[derive(Clone, Copy)]
struct Input<const R: usize, const T: usize> {
    rows: [*const u8; R],
    x: [*const u8; T],
    xd: [*const f32; T],
    xs: [*const f32; T],
    ahead: usize,
}

/// Shift counts for `vpsrlvw`/`vpsllvw` (one per 16-bit lane), four lanes at a time.
const BY4: i64 = 0x0004_0004_0004_0004;
const BY2: i64 = 0x0002_0002_0002_0002;

/// Lanes 0–7 hold `a`, lanes 8–15 hold `b`.
#[inline]
#[target_feature(enable = "avx512f")]
fn halves(a: i32, b: i32) -> __m512i {
    _mm512_inserti64x4::<1>(_mm512_set1_epi32(a), _mm256_set1_epi32(b))
}

/// Lane `i` holds `i / 2`: eight per-32 values spread over the 16 groups of 16.
#[inline]
#[target_feature(enable = "avx512f")]
fn per16_index() -> __m512i {
    _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0)
}

#[inline]
unsafe fn u16_at(p: *const u8) -> u16 {
    // SAFETY: the caller passes two readable bytes.
    unsafe { (p as *const u16).read_unaligned() }
}

#[inline]
unsafe fn u32_at(p: *const u8) -> u32 {
    // SAFETY: the caller passes four readable bytes.
    unsafe { (p as *const u32).read_unaligned() }
}

#[inline]
#[target_feature(enable = "sse")]
unsafe fn prefetch(p: *const u8) {
    _mm_prefetch(p as *const i8, _MM_HINT_T0);
}

/// The 32-weight block types, eight blocks (one activation super-block's worth) at a time.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn blocks32<const R: usize, const T: usize>(
    ty: BlockType,
    input: &Input<R, T>,
    blocks: usize,
    acc: &mut [[__m512; T]; R],
) {
    let Input {
        rows,
        x,
        xd,
        xs,
        ahead,
    } = *input;
    let bb = ty.block_bytes();
    let m4 = _mm512_set1_epi8(0x0F);
    let hi_bit = _mm512_set1_epi8(0x10);
    let flip = _mm512_set1_epi8(-128);
    // The nibble layouts (Q4_0, Q4_1, Q5_0): 128-bit lanes [lo 0, hi 0, lo 1, hi 1].
    let nibble_shift = _mm512_set_epi64(BY4, BY4, 0, 0, BY4, BY4, 0, 0);
    let pair_index: [__m512i; 4] = std::array::from_fn(|p| halves(2 * p as i32, 2 * p as i32 + 1));
    let spread = per16_index();
    // Per-block bias as a multiple of the block's scale (Q4_1 carries its own).
    let bias_of_d = match ty {
        BlockType::Q4_0 => -8.0,
        BlockType::Q5_0 => -16.0,
        BlockType::Q8_0 => -128.0,
        _ => 0.0,
    };
    let mut g = 0;
    while g < blocks {
        let n = (blocks - g).min(8);
        let mask8 = (((1u32 << n) - 1) & 0xFF) as u8;
        let mask16 = ((1u32 << (2 * n)) - 1) as u16;
        // SAFETY: the masks keep the loads inside the `blocks` blocks.
        let dx: [__m256; T] =
            std::array::from_fn(|t| unsafe { _mm256_maskz_loadu_ps(mask8, xd[t].add(g)) });
        // SAFETY: as above.
        let sums: [__m512; T] =
            std::array::from_fn(|t| unsafe { _mm512_maskz_loadu_ps(mask16, xs[t].add(2 * g)) });
        // Per row: prefetch, the eight blocks' scales (`s`, per token) and their bias
        // terms.
        let mut s = [[_mm512_setzero_ps(); T]; R];
        for r in 0..R {
            // SAFETY: block `g + b` for `b < n` lies inside the row.
            unsafe {
                let row = rows[r].add(g * bb);
                let mut at = 0;
                while at < n * bb {
                    prefetch(row.wrapping_add(ahead + at));
                    at += 64;
                }
                // The first four bytes of each block: its f16 scale (and Q4_1's f16 bias).
                // Eight scalar loads, not a gather: AMD's gathers cost several times more.
                let head = |b: usize| {
                    if b < n {
                        (row.add(b * bb) as *const i32).read_unaligned()
                    } else {
                        0
                    }
                };
                let heads = _mm256_set_epi32(
                    head(7),
                    head(6),
                    head(5),
                    head(4),
                    head(3),
                    head(2),
                    head(1),
                    head(0),
                );
                let d = _mm256_cvtph_ps(_mm256_cvtepi32_epi16(heads));
                let coeff = if ty == BlockType::Q4_1 {
                    _mm256_cvtph_ps(_mm256_cvtepi32_epi16(_mm256_srli_epi32::<16>(heads)))
                } else {
                    _mm256_mul_ps(d, _mm256_set1_ps(bias_of_d))
                };
                let coeff = _mm512_permutexvar_ps(spread, _mm512_zextps256_ps512(coeff));
                for t in 0..T {
                    acc[r][t] = _mm512_fmadd_ps(coeff, sums[t], acc[r][t]);
                    s[r][t] = _mm512_zextps256_ps512(_mm256_mul_ps(d, dx[t]));
                }
            }
        }
        let mut b = 0;
        while b < n {
            // Activations of the pair of blocks; a lone last block gets zeros above it.
            let bytes = if b + 1 < n { u64::MAX } else { u32::MAX as u64 };
            // SAFETY: masked to the blocks that exist.
            let xv: [__m512i; T] = std::array::from_fn(|t| unsafe {
                _mm512_maskz_loadu_epi8(bytes, x[t].add((g + b) * 32) as *const i8)
            });
            for r in 0..R {
                // SAFETY: blocks `g + b` (and `g + b + 1` when `b + 1 < n`) lie inside
                // the row.
                unsafe {
                    let b0 = rows[r].add((g + b) * bb);
                    // A lone last block reads itself twice; its upper activations are 0.
                    let b1 = if b + 1 < n { b0.add(bb) } else { b0 };
                    let q = match ty {
                        BlockType::Q8_0 => _mm512_xor_si512(
                            _mm512_inserti64x4::<1>(
                                _mm512_castsi256_si512(_mm256_loadu_si256(b0.add(2) as *const _)),
                                _mm256_loadu_si256(b1.add(2) as *const _),
                            ),
                            flip,
                        ),
                        _ => {
                            let o = match ty {
                                BlockType::Q4_0 => 2,
                                BlockType::Q4_1 => 4,
                                _ => 6,
                            };
                            let lo = _mm512_broadcast_i32x4(_mm_loadu_si128(b0.add(o) as *const _));
                            let both = _mm512_mask_broadcast_i32x4(
                                lo,
                                0xFF00,
                                _mm_loadu_si128(b1.add(o) as *const _),
                            );
                            let q = _mm512_and_si512(_mm512_srlv_epi16(both, nibble_shift), m4);
                            if ty == BlockType::Q5_0 {
                                let high =
                                    u32_at(b0.add(2)) as u64 | (u32_at(b1.add(2)) as u64) << 32;
                                _mm512_mask_add_epi8(q, high, q, hi_bit)
                            } else {
                                q
                            }
                        }
                    };
                    for t in 0..T {
                        let p = _mm512_dpbusd_epi32(_mm512_setzero_si512(), q, xv[t]);
                        acc[r][t] = _mm512_fmadd_ps(
                            _mm512_cvtepi32_ps(p),
                            _mm512_permutexvar_ps(pair_index[b / 2], s[r][t]),
                            acc[r][t],
                        );
                    }
                }
            }
            b += 2;
        }
        g += n;
    }
}

/// Q4_K: per super-block of 256, eight 6-bit scales and mins (`d·sc`, `dmin·m` per 32)
/// and 4-bit `q`, low nibbles of 32 bytes then their high nibbles.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn q4k<const R: usize, const T: usize>(
    input: &Input<R, T>,
    blocks: usize,
    acc: &mut [[__m512; T]; R],
) {
    let Input {
        rows,
        x,
        xd,
        xs,
        ahead,
    } = *input;
    let m4 = _mm512_set1_epi8(0x0F);
    // 256-bit halves: the low nibbles, then the high ones.
    let nibble_shift = _mm512_set_epi64(BY4, BY4, BY4, BY4, 0, 0, 0, 0);
    let pair_index: [__m512i; 4] = std::array::from_fn(|p| halves(2 * p as i32, 2 * p as i32 + 1));
    for sb in 0..blocks {
        // SAFETY: super-block `sb` lies inside the rows and the activations.
        unsafe {
            let dx: [__m256; T] = std::array::from_fn(|t| _mm256_loadu_ps(xd[t].add(sb * 8)));
            let sums: [__m512; T] = std::array::from_fn(|t| _mm512_loadu_ps(xs[t].add(sb * 16)));
            let mut s = [[_mm512_setzero_ps(); T]; R];
            for r in 0..R {
                let blk = rows[r].add(sb * 144);
                prefetch(blk.wrapping_add(ahead));
                prefetch(blk.wrapping_add(ahead + 64));
                prefetch(blk.wrapping_add(ahead + 128));
                let dm = _mm_cvtph_ps(_mm_cvtsi32_si128(u32_at(blk) as i32));
                let d = _mm256_broadcastss_ps(dm);
                let dmin = _mm512_broadcastss_ps(_mm_movehdup_ps(dm));
                // The 12 packed bytes to eight scales and eight mins (llama.cpp's masks).
                let (a, b, c) = (u32_at(blk.add(4)), u32_at(blk.add(8)), u32_at(blk.add(12)));
                let sc = (a & 0x3f3f_3f3f) as u64
                    | (((c & 0x0f0f_0f0f) | (((a >> 6) & 0x0303_0303) << 4)) as u64) << 32;
                let mn = (b & 0x3f3f_3f3f) as u64
                    | ((((c >> 4) & 0x0f0f_0f0f) | (((b >> 6) & 0x0303_0303) << 4)) as u64) << 32;
                let scales = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128(sc as i64)));
                let scales = _mm256_mul_ps(scales, d);
                let mins = _mm_cvtsi64_si128(mn as i64);
                let mins = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_unpacklo_epi8(mins, mins)));
                let mins = _mm512_mul_ps(mins, dmin);
                for t in 0..T {
                    s[r][t] = _mm512_zextps256_ps512(_mm256_mul_ps(scales, dx[t]));
                    acc[r][t] = _mm512_fnmadd_ps(mins, sums[t], acc[r][t]);
                }
            }
            for (p, pair) in pair_index.iter().enumerate() {
                let xv: [__m512i; T] = std::array::from_fn(|t| {
                    _mm512_loadu_si512(x[t].add(sb * 256 + 64 * p) as *const _)
                });
                for r in 0..R {
                    let packed = _mm512_broadcast_i64x4(_mm256_loadu_si256(
                        rows[r].add(sb * 144 + 16 + 32 * p) as *const _,
                    ));
                    let q = _mm512_and_si512(_mm512_srlv_epi16(packed, nibble_shift), m4);
                    for t in 0..T {
                        let prod = _mm512_dpbusd_epi32(_mm512_setzero_si512(), q, xv[t]);
                        acc[r][t] = _mm512_fmadd_ps(
                            _mm512_cvtepi32_ps(prod),
                            _mm512_permutexvar_ps(*pair, s[r][t]),
                            acc[r][t],
                        );
                    }
                }
            }
        }
    }
}

/// Q6_K: per super-block of 256, 16 signed 8-bit scales (one per 16 weights), `q` in
/// 0..64 (bias `-32·d·sc`) from four low bits in `ql` and two high bits in `qh`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn q6k<const R: usize, const T: usize>(
    input: &Input<R, T>,
    blocks: usize,
    acc: &mut [[__m512; T]; R],
) {
    let Input {
        rows,
        x,
        xd,
        xs,
        ahead,
    } = *input;
    let m4 = _mm512_set1_epi8(0x0F);
    let m30 = _mm512_set1_epi8(0x30);
    // Within 64 weights, the high two bits of weights 0..32 sit at bits 0–1 (0–31) or
    // 4–5 (64–95) of `qh`, those of 32..64 at bits 2–3 or 6–7: bring them to bits 4–5.
    let up = _mm512_set_epi64(BY2, BY2, BY2, BY2, BY4, BY4, BY4, BY4);
    let down = _mm512_set_epi64(BY2, BY2, BY2, BY2, 0, 0, 0, 0);
    // Lane i of the product for weights 64j.. covers group 4j + i/4.
    let group_index: [__m512i; 4] = std::array::from_fn(|j| {
        let j = 4 * j as i32;
        _mm512_set_epi32(
            j + 3,
            j + 3,
            j + 3,
            j + 3,
            j + 2,
            j + 2,
            j + 2,
            j + 2,
            j + 1,
            j + 1,
            j + 1,
            j + 1,
            j,
            j,
            j,
            j,
        )
    });
    let spread = per16_index();
    for sb in 0..blocks {
        // SAFETY: super-block `sb` lies inside the rows and the activations.
        unsafe {
            let dx: [__m512; T] = std::array::from_fn(|t| {
                _mm512_permutexvar_ps(
                    spread,
                    _mm512_zextps256_ps512(_mm256_loadu_ps(xd[t].add(sb * 8))),
                )
            });
            let sums: [__m512; T] = std::array::from_fn(|t| _mm512_loadu_ps(xs[t].add(sb * 16)));
            let mut s = [[_mm512_setzero_ps(); T]; R];
            for r in 0..R {
                let blk = rows[r].add(sb * 210);
                prefetch(blk.wrapping_add(ahead));
                prefetch(blk.wrapping_add(ahead + 64));
                prefetch(blk.wrapping_add(ahead + 128));
                prefetch(blk.wrapping_add(ahead + 192));
                let d = _mm512_broadcastss_ps(_mm_cvtph_ps(_mm_cvtsi32_si128(
                    u16_at(blk.add(208)) as i32,
                )));
                let scales = _mm512_mul_ps(
                    _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(
                        blk.add(192) as *const _
                    ))),
                    d,
                );
                let coeff = _mm512_mul_ps(scales, _mm512_set1_ps(-32.0));
                for t in 0..T {
                    acc[r][t] = _mm512_fmadd_ps(coeff, sums[t], acc[r][t]);
                    s[r][t] = _mm512_mul_ps(scales, dx[t]);
                }
            }
            for half in 0..2 {
                let xv: [[__m512i; 2]; T] = std::array::from_fn(|t| {
                    std::array::from_fn(|i| {
                        _mm512_loadu_si512(x[t].add(sb * 256 + 64 * (2 * half + i)) as *const _)
                    })
                });
                for r in 0..R {
                    let blk = rows[r].add(sb * 210);
                    let low = _mm512_loadu_si512(blk.add(64 * half) as *const _);
                    let high = _mm512_broadcast_i64x4(_mm256_loadu_si256(
                        blk.add(128 + 32 * half) as *const _
                    ));
                    let q01 = _mm512_ternarylogic_epi32::<0xF8>(
                        _mm512_and_si512(low, m4),
                        _mm512_sllv_epi16(high, up),
                        m30,
                    );
                    let q23 = _mm512_ternarylogic_epi32::<0xF8>(
                        _mm512_and_si512(_mm512_srli_epi16::<4>(low), m4),
                        _mm512_srlv_epi16(high, down),
                        m30,
                    );
                    for (i, q) in [q01, q23].into_iter().enumerate() {
                        let j = 2 * half + i;
                        for t in 0..T {
                            let prod = _mm512_dpbusd_epi32(_mm512_setzero_si512(), q, xv[t][i]);
                            acc[r][t] = _mm512_fmadd_ps(
                                _mm512_cvtepi32_ps(prod),
                                _mm512_permutexvar_ps(group_index[j], s[r][t]),
                                acc[r][t],
                            );
                        }
                    }
                }
            }
        }
    }
}
