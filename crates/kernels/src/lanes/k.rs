//! The K-quants in the lane layout ([`super`]; in groups of 8, a group is one
//! super-block and reads half of a record of 16).
//!
//! A Q4_K super-block is eight 32-weight sub-blocks `w = d·sc_j·q − dmin·m_j`, each a
//! Q4_1 block but for its scale and offset, which come from the super-block's f16 `d`
//! and `dmin` and 6-bit `sc_j`, `m_j`. So the quants are repacked as Q4_1's (one
//! sub-block a lane, the same products and inner loop), and beside them each row keeps
//! its sub-blocks' 6-bit values as bytes and its super-blocks' `d`, `dmin`: a group of 16
//! lanes is exactly two super-blocks, whose lane scales `d·sc_j` and offsets `−dmin·m_j`
//! the kernel makes in f32 (exact: an f16 times a 6-bit integer) from 16 + 16 bytes and 4
//! halves — 4.6 bits a weight, where Q4_K takes 4.5, and Q4_1's f16 pair a block 5. A
//! row's values for a group lie together in one 40-byte record: one stream beside the
//! quants to fetch ahead.
//!
//! Without this, a batch's tokens each decoded every Q4_K block again (`fused`,
//! `wide`): 0.79 ns per 32 weights and token at 8 tokens against Q4_1's 0.31.
//!
//! Q6_K's sub-blocks are 16 weights, each with its own 8-bit scale, under one f16 `d`:
//! `w = d·sc_s·(q − 32)`, `q` of 6 bits. Its quants are repacked as Q4_1's nibbles with
//! the fifth and sixth bits in planes beside them (Q5_0's fifth-bit planes, twice: 6.6
//! bits a weight with the scales, Q6_K's 6.56), and since a 32-weight block's low nibbles
//! are its first 16 weights and its high nibbles its last 16 — a sub-block each — the
//! kernel keeps two integer sums a lane, each scaled by its own `d·sc` and offset by
//! `−32·d·sc` times the activations' sum over that half. (Q8_0's bytes, one a weight,
//! were as fast in a batch but 22% more bytes for a single token to read.)

use std::arch::x86_64::*;

use crate::blocks::{q6k_quants, scale_min_k4};

/// Bytes of a Q4_K and a Q6_K super-block, and of a Q4_1 block.
const K_BYTES: usize = 144;
const K6_BYTES: usize = 210;
const Q41_BYTES: usize = 20;
/// Bytes of a group's record: 16 first values, 16 second ones, 4 f16.
const META: usize = 40;

/// A K-quant's per-block and per-super-block values: per row and group of 16 blocks a
/// record of the blocks' first values, their second values, then the group's two
/// super-blocks' f16 numbers. Q4_K: the 6-bit scales `sc_j`, the 6-bit mins `m_j`, and
/// `d`, `dmin` of each super-block; Q6_K: the 8-bit scales (bytes of `i8`) of each
/// block's first 16 weights and of its last 16, and each super-block's `d`.
#[derive(Clone, Debug)]
pub(crate) struct KScales {
    pub(crate) six: bool,
    /// 32-weight blocks a row.
    blocks: usize,
    meta: Vec<u8>,
}

impl KScales {
    fn new(six: bool, rows: usize, blocks: usize) -> Self {
        Self {
            six,
            blocks,
            meta: vec![0; rows * blocks.div_ceil(16) * META],
        }
    }

    pub(crate) fn size_in_bytes(&self) -> usize {
        self.meta.len()
    }

    /// Where row `r`'s record for group `g` starts.
    fn record(&self, r: usize, g: usize) -> usize {
        (r * self.blocks.div_ceil(16) + g) * META
    }

    /// Where row `r`'s block `b`'s value `i` (0: the first, 1: the second) lies.
    fn value(&self, r: usize, b: usize, i: usize) -> usize {
        self.record(r, b / 16) + 16 * i + b % 16
    }

    /// Where row `r`'s super-block `s`'s f16 number `h` (Q4_K: 0 `d`, 1 `dmin`; Q6_K:
    /// `d`) lies: two bytes.
    fn half(&self, r: usize, s: usize, h: usize) -> std::ops::Range<usize> {
        let per = if self.six { 1 } else { 2 };
        let at = self.record(r, s / 2) + 32 + 2 * (per * (s % 2) + h);
        at..at + 2
    }

    /// The rows of `more` (of as many blocks a row) after these.
    pub(crate) fn append(&mut self, more: &KScales) {
        self.meta.extend_from_slice(&more.meta);
    }

    pub(crate) fn meta_ptr(&self) -> *const u8 {
        self.meta.as_ptr()
    }

    /// The offset of row `r`'s record `ahead` groups past group `g` (past the row's end
    /// it runs on into the next rows'; it may lie past the array's end).
    pub(crate) fn meta_ahead(&self, r: usize, g: usize, ahead: usize) -> usize {
        self.record(r, g) + ahead * META
    }

    fn set(&mut self, at: usize, v: u8) {
        self.meta[at] = v;
    }
}

/// `rows` rows of Q6_K data as Q4_1 blocks whose scale and offset are zero (the quants'
/// low 4 bits, in Q4_1's nibble order), every weight's high 2 bits (a byte each, in
/// weight order), and the scales.
pub(crate) fn split6(rows: usize, cols: usize, data: &[u8]) -> (Vec<u8>, Vec<u8>, KScales) {
    let supers = cols / 256;
    let blocks = supers * 8;
    let mut q41 = vec![0u8; rows * blocks * Q41_BYTES];
    let mut high = vec![0u8; rows * blocks * 32];
    let mut k = KScales::new(true, rows, blocks);
    for (at, blk) in data.chunks_exact(K6_BYTES).enumerate() {
        let (r, s) = (at / supers, at % supers);
        let h = k.half(r, s, 0);
        k.meta[h].copy_from_slice(&blk[208..210]);
        let mut q = [0u8; 256];
        q6k_quants(blk, &mut q);
        for j in 0..8 {
            let b = s * 8 + j;
            k.set(k.value(r, b, 0), blk[192 + 2 * j]);
            k.set(k.value(r, b, 1), blk[192 + 2 * j + 1]);
            let q = &q[32 * j..32 * j + 32];
            let out = &mut q41[(at * 8 + j) * Q41_BYTES + 4..(at * 8 + j + 1) * Q41_BYTES];
            for (l, o) in out.iter_mut().enumerate() {
                *o = (q[l] & 0x0F) | ((q[l + 16] & 0x0F) << 4);
            }
            for (h, &v) in high[(at * 8 + j) * 32..(at * 8 + j + 1) * 32]
                .iter_mut()
                .zip(q)
            {
                *h = v >> 4;
            }
        }
    }
    (q41, high, k)
}

/// Row `r` in Q6_K's layout again, from its Q4_1 blocks and high bits as [`split6`] made
/// them (the row's only).
pub(crate) fn join6(k: &KScales, r: usize, q41: &[u8], high: &[u8], out: &mut Vec<u8>) {
    let supers = q41.len() / Q41_BYTES / 8;
    out.clear();
    out.resize(supers * K6_BYTES, 0);
    for (s, blk) in out.chunks_exact_mut(K6_BYTES).enumerate() {
        let q: Vec<u8> = (0..256)
            .map(|w| {
                let (b, l) = (s * 8 + w / 32, w % 32);
                let byte = q41[b * Q41_BYTES + 4 + l % 16];
                let low = if l < 16 { byte & 0x0F } else { byte >> 4 };
                low | (high[b * 32 + l] << 4)
            })
            .collect();
        for half in 0..2 {
            let q = &q[half * 128..half * 128 + 128];
            for l in 0..32 {
                blk[half * 64 + l] = (q[l] & 0x0F) | ((q[l + 64] & 0x0F) << 4);
                blk[half * 64 + l + 32] = (q[l + 32] & 0x0F) | ((q[l + 96] & 0x0F) << 4);
                blk[128 + half * 32 + l] = (q[l] >> 4)
                    | ((q[l + 32] >> 4) << 2)
                    | ((q[l + 64] >> 4) << 4)
                    | ((q[l + 96] >> 4) << 6);
            }
        }
        for j in 0..8 {
            blk[192 + 2 * j] = k.meta[k.value(r, s * 8 + j, 0)];
            blk[192 + 2 * j + 1] = k.meta[k.value(r, s * 8 + j, 1)];
        }
        blk[208..210].copy_from_slice(&k.meta[k.half(r, s, 0)]);
    }
}

/// `rows` rows of Q4_K data as Q4_1 blocks whose scale and offset are zero (the quants
/// only, in Q4_1's nibble order), and the values those lack.
pub(crate) fn split(rows: usize, cols: usize, data: &[u8]) -> (Vec<u8>, KScales) {
    let supers = cols / 256;
    let blocks = supers * 8;
    let mut q41 = vec![0u8; rows * blocks * Q41_BYTES];
    let mut k = KScales::new(false, rows, blocks);
    for (at, blk) in data.chunks_exact(K_BYTES).enumerate() {
        let (r, s) = (at / supers, at % supers);
        let (d, dmin) = (k.half(r, s, 0), k.half(r, s, 1));
        k.meta[d].copy_from_slice(&blk[0..2]);
        k.meta[dmin].copy_from_slice(&blk[2..4]);
        let (scales, qs) = (&blk[4..16], &blk[16..144]);
        for j in 0..8 {
            let b = s * 8 + j;
            let (sc, m) = scale_min_k4(j, scales);
            k.set(k.value(r, b, 0), sc);
            k.set(k.value(r, b, 1), m);
            // Sub-block j: the low (even j) or high nibbles of bytes 32·(j/2)... .
            let nib = |l: usize| (qs[32 * (j / 2) + l] >> (4 * (j % 2))) & 0x0F;
            let out = &mut q41[(at * 8 + j) * Q41_BYTES + 4..(at * 8 + j + 1) * Q41_BYTES];
            for (l, o) in out.iter_mut().enumerate() {
                *o = nib(l) | (nib(l + 16) << 4);
            }
        }
    }
    (q41, k)
}

/// Row `r` in Q4_K's layout again, from its Q4_1-ordered quants (`q41`, the row's
/// blocks as [`split`] made them) and `k`.
pub(crate) fn join(k: &KScales, r: usize, q41: &[u8], out: &mut Vec<u8>) {
    let supers = q41.len() / Q41_BYTES / 8;
    out.clear();
    out.resize(supers * K_BYTES, 0);
    for (s, blk) in out.chunks_exact_mut(K_BYTES).enumerate() {
        blk[0..2].copy_from_slice(&k.meta[k.half(r, s, 0)]);
        blk[2..4].copy_from_slice(&k.meta[k.half(r, s, 1)]);
        let sc: [u8; 8] = std::array::from_fn(|j| k.meta[k.value(r, s * 8 + j, 0)]);
        let mn: [u8; 8] = std::array::from_fn(|j| k.meta[k.value(r, s * 8 + j, 1)]);
        let scales = &mut blk[4..16];
        for j in 0..4 {
            scales[j] = sc[j] | ((sc[j + 4] >> 4) << 6);
            scales[j + 4] = mn[j] | ((mn[j + 4] >> 4) << 6);
            scales[j + 8] = (sc[j + 4] & 0x0F) | ((mn[j + 4] & 0x0F) << 4);
        }
        let qs = &mut blk[16..144];
        for j in 0..8 {
            let b = &q41[(s * 8 + j) * Q41_BYTES + 4..(s * 8 + j + 1) * Q41_BYTES];
            for l in 0..32 {
                let v = if l < 16 { b[l] & 0x0F } else { b[l - 16] >> 4 };
                qs[32 * (j / 2) + l] |= v << (4 * (j % 2));
            }
        }
    }
}

/// Row `r`'s record for group `g` (`n` blocks): its first and second values as f32, the
/// rest zero, and its f16 numbers (4, or 2 for a last group of 8 blocks) as f32.
///
/// # Safety
/// AVX-512 F/BW/VL; `r`, `g` and `n` within the matrix `k` describes.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl")]
unsafe fn record(k: &KScales, r: usize, g: usize, n: usize, signed: bool) -> [__m512; 3] {
    let mask16 = ((1u32 << n) - 1) as u16;
    let per = if k.six { 1 } else { 2 };
    let halves: u8 = if n > 8 {
        (1 << (2 * per)) - 1
    } else {
        (1 << per) - 1
    };
    // SAFETY: the masks keep every load inside row r's record for group g.
    unsafe {
        let at = k.meta.as_ptr().add(k.record(r, g));
        let bytes = |p: *const u8| {
            let b = _mm_maskz_loadu_epi8(mask16, p as *const i8);
            let wide = if signed {
                _mm512_cvtepi8_epi32(b)
            } else {
                _mm512_cvtepu8_epi32(b)
            };
            _mm512_cvtepi32_ps(wide)
        };
        let numbers = _mm_cvtph_ps(_mm_maskz_loadu_epi16(halves, at.add(32) as *const i16));
        [
            bytes(at),
            bytes(at.add(16)),
            _mm512_castps128_ps512(numbers),
        ]
    }
}

/// Group `g` of row `r`'s Q6_K lane scales `d·sc` for each block's first and last 16
/// weights (`n` blocks, the rest zero).
///
/// # Safety
/// As [`record`]'s.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl")]
pub(crate) unsafe fn lane_scales6(k: &KScales, r: usize, g: usize, n: usize) -> (__m512, __m512) {
    // SAFETY: forwarded.
    let [lo, hi, two] = unsafe { record(k, r, g, n, true) };
    // [d_A, d_B] → lanes 0..8 from A, 8..16 from B.
    let d = _mm512_permutexvar_ps(
        _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1),
        two,
    );
    (_mm512_mul_ps(d, lo), _mm512_mul_ps(d, hi))
}

/// Group `g` of row `r`'s Q4_K lane scales `d·sc_j` and offsets `−dmin·m_j` (`n`
/// blocks, the rest zero).
///
/// # Safety
/// As [`record`]'s.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl")]
pub(crate) unsafe fn lane_scales(k: &KScales, r: usize, g: usize, n: usize) -> (__m512, __m512) {
    // SAFETY: forwarded.
    let [sc, mn, four] = unsafe { record(k, r, g, n, false) };
    // [d_A, dmin_A, d_B, dmin_B] → lanes 0..8 from A, 8..16 from B.
    let d = _mm512_permutexvar_ps(
        _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 2, 2, 2, 2, 2, 2, 2, 2),
        four,
    );
    let dmin = _mm512_permutexvar_ps(
        _mm512_setr_epi32(1, 1, 1, 1, 1, 1, 1, 1, 3, 3, 3, 3, 3, 3, 3, 3),
        four,
    );
    (
        _mm512_mul_ps(d, sc),
        _mm512_sub_ps(_mm512_setzero_ps(), _mm512_mul_ps(dmin, mn)),
    )
}

/// Group `g` (super-block `g`: 8 blocks) of row `r`'s record values in groups of 8
/// ([`super::NARROW`]): its blocks' first and second values as f32.
///
/// # Safety
/// AVX2; `r` and `g` within the matrix `k` describes.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn narrow_record(k: &KScales, r: usize, g: usize) -> [__m256; 2] {
    let signed = k.six;
    // SAFETY: 8 bytes of each value row within row r's record (the caller's contract).
    unsafe {
        let values = |i: usize| {
            let p = k.meta.as_ptr().add(k.value(r, g * 8, i));
            let b = _mm_loadl_epi64(p as *const __m128i);
            let wide = if signed {
                _mm256_cvtepi8_epi32(b)
            } else {
                _mm256_cvtepu8_epi32(b)
            };
            _mm256_cvtepi32_ps(wide)
        };
        [values(0), values(1)]
    }
}

/// Row `r`'s super-block `s`'s f16 number `h` (Q4_K: 0 `d`, 1 `dmin`; Q6_K: `d`) as f32.
pub(crate) fn number(k: &KScales, r: usize, s: usize, h: usize) -> f32 {
    let at = k.half(r, s, h);
    half::f16::from_le_bytes([k.meta[at.start], k.meta[at.start + 1]]).to_f32()
}

/// [`lane_scales`] in groups of 8: group `g` of row `r`'s Q4_K lane scales `d·sc_j` and
/// offsets `−dmin·m_j` (the same f32 values: each an exact product).
///
/// # Safety
/// As [`narrow_record`]'s.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn narrow_scales(k: &KScales, r: usize, g: usize) -> (__m256, __m256) {
    // SAFETY: forwarded.
    let [sc, mn] = unsafe { narrow_record(k, r, g) };
    let d = _mm256_set1_ps(number(k, r, g, 0));
    let dmin = _mm256_set1_ps(number(k, r, g, 1));
    (
        _mm256_mul_ps(d, sc),
        _mm256_sub_ps(_mm256_setzero_ps(), _mm256_mul_ps(dmin, mn)),
    )
}

/// [`lane_scales6`] in groups of 8: group `g` of row `r`'s Q6_K lane scales `d·sc` for
/// each block's first and last 16 weights.
///
/// # Safety
/// As [`narrow_record`]'s.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn narrow_scales6(k: &KScales, r: usize, g: usize) -> (__m256, __m256) {
    // SAFETY: forwarded.
    let [lo, hi] = unsafe { narrow_record(k, r, g) };
    let d = _mm256_set1_ps(number(k, r, g, 0));
    (_mm256_mul_ps(d, lo), _mm256_mul_ps(d, hi))
}

/// Group `g` of row `r`'s Q6_K 8-bit scales for each block's first and last 16 weights
/// as 16-bit pairs (lane `j`: block `j`'s scale twice), for `vpmaddwd` to scale the
/// products' 16-bit sums as it widens them.
///
/// # Safety
/// As [`narrow_record`]'s.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn narrow_scales6_i16(k: &KScales, r: usize, g: usize) -> (__m256i, __m256i) {
    // SAFETY: 8 bytes of each value row within row r's record (the caller's contract).
    unsafe {
        let pairs = |i: usize| {
            let p = k.meta.as_ptr().add(k.value(r, g * 8, i));
            let words = _mm_cvtepi8_epi16(_mm_loadl_epi64(p as *const __m128i));
            let low = _mm256_cvtepu16_epi32(words);
            _mm256_or_si256(low, _mm256_slli_epi32::<16>(low))
        };
        (pairs(0), pairs(1))
    }
}
