//! Fused single-token dot products: each block is decoded in registers and multiplied at
//! once, without writing the unpacked row out. Decode (one token per step) runs here;
//! batches take the unpack-once path of `matmul`, whose cost per row is shared by all
//! the tokens of the batch.

#![cfg(target_arch = "x86_64")]

use std::arch::x86_64::*;

use crate::BlockType;

/// How far ahead of the block in hand the weights are prefetched, in bytes.
const AHEAD: usize = 1024;

use crate::blocks::f16_at;

#[inline]
#[target_feature(enable = "avx2")]
pub(crate) fn load32(p: &[u8]) -> __m256i {
    assert!(p.len() >= 32);
    // SAFETY: 32 readable bytes, checked above.
    unsafe { _mm256_loadu_si256(p.as_ptr() as *const __m256i) }
}

/// 16 packed bytes to 32 nibbles: low nibbles first, then high ones (ggml's order).
#[inline]
#[target_feature(enable = "avx2")]
pub(crate) fn nibbles(p: &[u8]) -> __m256i {
    assert!(p.len() >= 16);
    // SAFETY: 16 readable bytes, checked above.
    let v = unsafe { _mm_loadu_si128(p.as_ptr() as *const __m128i) };
    let m = _mm_set1_epi8(0x0F);
    _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(v, 4), m), _mm_and_si128(v, m))
}

/// Byte j is 0x10 where bit j of `bits` is set (llama.cpp's `bytes_from_bits_32`).
#[inline]
#[target_feature(enable = "avx2")]
pub(crate) fn high_bits(bits: u32) -> __m256i {
    let shuffle = _mm256_set_epi64x(
        0x0303_0303_0303_0303,
        0x0202_0202_0202_0202,
        0x0101_0101_0101_0101,
        0x0000_0000_0000_0000,
    );
    let bytes = _mm256_shuffle_epi8(_mm256_set1_epi32(bits as i32), shuffle);
    let bytes = _mm256_or_si256(bytes, _mm256_set1_epi64x(0x7fbf_dfef_f7fb_fdfe_u64 as i64));
    let set = _mm256_cmpeq_epi8(bytes, _mm256_set1_epi64x(-1));
    _mm256_and_si256(set, _mm256_set1_epi8(0x10))
}

/// The sum of the eight lanes.
#[inline]
#[target_feature(enable = "avx2,fma")]
pub(crate) fn hsum(v: __m256) -> f32 {
    let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    let s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
    _mm_cvtss_f32(s)
}

/// Rows decoded per pass: they share each activation load and keep independent
/// accumulation chains, so the loop is not bound by one chain's FMA latency.
pub(crate) const ROWS: usize = 4;

/// Rows per decode pass: [`ROWS`], or 1 to 4 from `SHOAL_DECODE_ROWS` (to compare).
pub(crate) fn rows_per_pass() -> usize {
    static ROWS_SET: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *ROWS_SET.get_or_init(|| {
        std::env::var("SHOAL_DECODE_ROWS")
            .ok()
            .and_then(|v| v.parse().ok())
            .filter(|n| (1..=ROWS).contains(n))
            .unwrap_or(ROWS)
    })
}

macro_rules! fused_dot {
    ($name:ident, $features:literal, $product:expr) => {
        /// `Σ w·x` of up to [`ROWS`] packed rows (`rows[..n]`, the rest ignored) and one
        /// quantized activation row, into `out[..n]`.
        ///
        /// # Safety
        /// The CPU must have the features named; every row has the same length and `xq`,
        /// `xd`, `xs` cover it.
        #[target_feature(enable = $features)]
        pub(crate) unsafe fn $name(
            ty: BlockType,
            rows: &[&[u8]],
            xq: &[i8],
            xd: &[f32],
            xs: &[f32],
            out: &mut [f32],
        ) {
            // SAFETY: forwarded.
            unsafe {
                match rows.len() {
                    1 => dot_n::<1>(ty, rows, xq, xd, xs, out),
                    2 => dot_n::<2>(ty, rows, xq, xd, xs, out),
                    3 => dot_n::<3>(ty, rows, xq, xd, xs, out),
                    _ => dot_n::<ROWS>(ty, rows, xq, xd, xs, out),
                }
            }

            #[inline]
            #[target_feature(enable = $features)]
            unsafe fn dot_n<const R: usize>(
                ty: BlockType,
                rows: &[&[u8]],
                xq: &[i8],
                xd: &[f32],
                xs: &[f32],
                out: &mut [f32],
            ) {
                let xq = bytemuck_i8(xq);
                let rows: [&[u8]; R] = std::array::from_fn(|r| rows[r]);
                let mut acc = [_mm256_setzero_ps(); R];
                let mut bias = [0f32; R];
                // Stream the rows ahead of use: a decode step reads every weight once, from
                // memory, and the loop's own loads come too late to hide the latency.
                // Prefetching never faults, so the address may lie past the row.
                let prefetch = |row: &[u8], at: usize| {
                    _mm_prefetch(row.as_ptr().wrapping_add(at) as *const i8, _MM_HINT_T0);
                };
                let bb = ty.block_bytes();
                let blocks = rows[0].len() / bb;
                // The K-quants prefetch the next pass when it is short (qwen-1.5b on AVX2,
                // one thread, interleaved: 3.4–4.2 -> 4.1–5.1 tok/s); the 32-weight types
                // measured slower with it (smollm2: 38–45 -> 26–30) and keep prefetching
                // AHEAD bytes on.
                let ahead_k = crate::wide::prefetch_distance(rows[0].len());
                // A block type of 32 weights with one scale and bias: `decode(block)` gives
                // (q, scale, bias).
                macro_rules! blocks32 {
                    ($decode:expr) => {{
                        for g in 0..blocks {
                            let x = load32(&xq[g * 32..]);
                            let xsum = xs[2 * g] + xs[2 * g + 1];
                            for r in 0..R {
                                prefetch(rows[r], g * bb + AHEAD);
                                let (q, d, b) = $decode(&rows[r][g * bb..]);
                                let p: __m256i = $product(q, x);
                                acc[r] = _mm256_fmadd_ps(
                                    _mm256_cvtepi32_ps(p),
                                    _mm256_set1_ps(d * xd[g]),
                                    acc[r],
                                );
                                bias[r] += b * xsum;
                            }
                        }
                    }};
                }
                match ty {
                    BlockType::Q4_0 => blocks32!(|blk: &[u8]| {
                        let d = f16_at(blk, 0);
                        (nibbles(&blk[2..]), d, -8.0 * d)
                    }),
                    BlockType::Q4_1 => blocks32!(|blk: &[u8]| {
                        (nibbles(&blk[4..]), f16_at(blk, 0), f16_at(blk, 2))
                    }),
                    BlockType::Q5_0 => blocks32!(|blk: &[u8]| {
                        let d = f16_at(blk, 0);
                        let qh = u32::from_le_bytes([blk[2], blk[3], blk[4], blk[5]]);
                        (
                            _mm256_or_si256(nibbles(&blk[6..]), high_bits(qh)),
                            d,
                            -16.0 * d,
                        )
                    }),
                    BlockType::Q8_0 => {
                        for g in 0..blocks {
                            let x = load32(&xq[g * 32..]);
                            for r in 0..R {
                                let row = rows[r];
                                prefetch(row, g * bb + AHEAD);
                                let blk = &row[g * bb..];
                                let q = load32(&blk[2..]);
                                let p: __m256i =
                                    $product(_mm256_sign_epi8(q, q), _mm256_sign_epi8(x, q));
                                let s = f16_at(blk, 0) * xd[g];
                                acc[r] = _mm256_fmadd_ps(
                                    _mm256_cvtepi32_ps(p),
                                    _mm256_set1_ps(s),
                                    acc[r],
                                );
                            }
                        }
                    }
                    BlockType::Q4K => {
                        let m4 = _mm256_set1_epi8(0x0F);
                        for sb in 0..blocks {
                            let mut scales = [[0f32; 8]; R];
                            let mut mins = [[0f32; 8]; R];
                            for r in 0..R {
                                let blk = &rows[r][sb * 144..];
                                prefetch(rows[r], sb * 144 + ahead_k);
                                prefetch(rows[r], sb * 144 + ahead_k + 64);
                                let (d, dmin) = (f16_at(blk, 0), f16_at(blk, 2));
                                for j in 0..8 {
                                    let (sc, m) = crate::blocks::scale_min_k4(j, &blk[4..16]);
                                    scales[r][j] = d * sc as f32;
                                    mins[r][j] = dmin * m as f32;
                                }
                            }
                            for pair in 0..4 {
                                let g0 = sb * 8 + 2 * pair;
                                let x0 = load32(&xq[g0 * 32..]);
                                let x1 = load32(&xq[g0 * 32 + 32..]);
                                let (d0, d1) = (xd[g0], xd[g0 + 1]);
                                let s0 = xs[2 * g0] + xs[2 * g0 + 1];
                                let s1 = xs[2 * g0 + 2] + xs[2 * g0 + 3];
                                for r in 0..R {
                                    let v = load32(&rows[r][sb * 144 + 16 + pair * 32..]);
                                    let lo = _mm256_and_si256(v, m4);
                                    let hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
                                    let p0: __m256i = $product(lo, x0);
                                    let p1: __m256i = $product(hi, x1);
                                    let (sc0, sc1) = (scales[r][2 * pair], scales[r][2 * pair + 1]);
                                    acc[r] = _mm256_fmadd_ps(
                                        _mm256_cvtepi32_ps(p0),
                                        _mm256_set1_ps(sc0 * d0),
                                        acc[r],
                                    );
                                    acc[r] = _mm256_fmadd_ps(
                                        _mm256_cvtepi32_ps(p1),
                                        _mm256_set1_ps(sc1 * d1),
                                        acc[r],
                                    );
                                    bias[r] -= mins[r][2 * pair] * s0 + mins[r][2 * pair + 1] * s1;
                                }
                            }
                        }
                    }
                    BlockType::Q6K => {
                        let m4 = _mm256_set1_epi8(0x0F);
                        let m2 = _mm256_set1_epi8(3);
                        for sb in 0..blocks {
                            for r in 0..R {
                                prefetch(rows[r], sb * 210 + ahead_k);
                                prefetch(rows[r], sb * 210 + ahead_k + 64);
                                prefetch(rows[r], sb * 210 + ahead_k + 128);
                            }
                            for half in 0..2 {
                                let gx = sb * 8 + half * 4;
                                let xv: [__m256i; 4] =
                                    std::array::from_fn(|k| load32(&xq[(gx + k) * 32..]));
                                for r in 0..R {
                                    let blk = &rows[r][sb * 210..];
                                    let d = f16_at(blk, 208);
                                    let ql0 = load32(&blk[half * 64..]);
                                    let ql1 = load32(&blk[half * 64 + 32..]);
                                    let qh = load32(&blk[128 + half * 32..]);
                                    let qs = [
                                        _mm256_or_si256(
                                            _mm256_and_si256(ql0, m4),
                                            _mm256_slli_epi16(_mm256_and_si256(qh, m2), 4),
                                        ),
                                        _mm256_or_si256(
                                            _mm256_and_si256(ql1, m4),
                                            _mm256_slli_epi16(
                                                _mm256_and_si256(_mm256_srli_epi16(qh, 2), m2),
                                                4,
                                            ),
                                        ),
                                        _mm256_or_si256(
                                            _mm256_and_si256(_mm256_srli_epi16(ql0, 4), m4),
                                            _mm256_slli_epi16(
                                                _mm256_and_si256(_mm256_srli_epi16(qh, 4), m2),
                                                4,
                                            ),
                                        ),
                                        _mm256_or_si256(
                                            _mm256_and_si256(_mm256_srli_epi16(ql1, 4), m4),
                                            _mm256_slli_epi16(
                                                _mm256_and_si256(_mm256_srli_epi16(qh, 6), m2),
                                                4,
                                            ),
                                        ),
                                    ];
                                    for (k, q) in qs.into_iter().enumerate() {
                                        let g = gx + k;
                                        let sc = &blk[192 + half * 8 + 2 * k..];
                                        let (s0, s1) =
                                            (d * (sc[0] as i8) as f32, d * (sc[1] as i8) as f32);
                                        let p: __m256i = $product(q, xv[k]);
                                        let x = xd[g];
                                        let scale = _mm256_set_m128(
                                            _mm_set1_ps(s1 * x),
                                            _mm_set1_ps(s0 * x),
                                        );
                                        acc[r] =
                                            _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), scale, acc[r]);
                                        bias[r] -= 32.0 * (s0 * xs[2 * g] + s1 * xs[2 * g + 1]);
                                    }
                                }
                            }
                        }
                    }
                }
                for r in 0..R {
                    out[r] = hsum(acc[r]) + bias[r];
                }
            }
        }
    };
}

fn bytemuck_i8(x: &[i8]) -> &[u8] {
    // SAFETY: i8 and u8 have the same size and alignment.
    unsafe { std::slice::from_raw_parts(x.as_ptr() as *const u8, x.len()) }
}

fused_dot!(dot_avx2, "avx2,fma", |q, x| {
    _mm256_madd_epi16(_mm256_maddubs_epi16(q, x), _mm256_set1_epi16(1))
});
