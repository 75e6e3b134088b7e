//! Q4_K in the lane layout ([`crate::lanes`], groups of 16 only).
//!
//! A Q4_K super-block is eight 32-weight sub-blocks `w = d·sc_j·q − dmin·m_j`, each a
//! Q4_1 block but for its scale and offset, which come from the super-block's f16 `d`
//! and `dmin` and 6-bit `sc_j`, `m_j`. So the quants are repacked as Q4_1's (one
//! sub-block a lane, the same products and inner loop), and beside them each row keeps
//! its sub-blocks' 6-bit values as bytes and its super-blocks' `d`, `dmin`: a group of 16
//! lanes is exactly two super-blocks, whose lane scales `d·sc_j` and offsets `−dmin·m_j`
//! the kernel makes in f32 (exact: an f16 times a 6-bit integer) from 16 + 16 bytes and 4
//! halves — 4.6 bits a weight, where Q4_K takes 4.5, and Q4_1's f16 pair a block 5.
//! Without this, a batch's tokens each decoded every Q4_K block again (`fused`,
//! `wide`): 0.79 ns per 32 weights and token at 8 tokens against Q4_1's 0.31.

use std::arch::x86_64::*;

use crate::blocks::scale_min_k4;

/// Bytes of a Q4_K super-block and of a Q4_1 block.
const K_BYTES: usize = 144;
const Q41_BYTES: usize = 20;

/// Q4_K's per-sub-block and per-super-block values, row after row.
#[derive(Clone, Debug)]
pub(crate) struct KScales {
    /// Per row, per 32-weight block: the 6-bit scale `sc_j`.
    pub(crate) sc: Vec<u8>,
    /// Per row, per block: the 6-bit min `m_j`.
    pub(crate) mn: Vec<u8>,
    /// Per row, per super-block: `d` then `dmin` (f16 bits).
    pub(crate) dd: Vec<u16>,
}

impl KScales {
    pub(crate) fn size_in_bytes(&self) -> usize {
        self.sc.len() + self.mn.len() + 2 * self.dd.len()
    }
}

/// `rows` rows of Q4_K data as Q4_1 blocks whose scale and offset are zero (the quants
/// only, in Q4_1's nibble order), and the values those lack.
pub(crate) fn split(rows: usize, cols: usize, data: &[u8]) -> (Vec<u8>, KScales) {
    let supers = cols / 256;
    let blocks = supers * 8;
    let mut q41 = vec![0u8; rows * blocks * Q41_BYTES];
    let mut k = KScales {
        sc: vec![0; rows * blocks],
        mn: vec![0; rows * blocks],
        dd: vec![0; rows * supers * 2],
    };
    for (s, blk) in data.chunks_exact(K_BYTES).enumerate() {
        k.dd[2 * s] = u16::from_le_bytes([blk[0], blk[1]]);
        k.dd[2 * s + 1] = u16::from_le_bytes([blk[2], blk[3]]);
        let (scales, qs) = (&blk[4..16], &blk[16..144]);
        for j in 0..8 {
            let b = s * 8 + j;
            (k.sc[b], k.mn[b]) = scale_min_k4(j, scales);
            // Sub-block j: the low (even j) or high nibbles of bytes 32·(j/2)... .
            let nib = |l: usize| (qs[32 * (j / 2) + l] >> (4 * (j % 2))) & 0x0F;
            let out = &mut q41[b * Q41_BYTES + 4..(b + 1) * Q41_BYTES];
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
        let at = r * supers + s;
        blk[0..2].copy_from_slice(&k.dd[2 * at].to_le_bytes());
        blk[2..4].copy_from_slice(&k.dd[2 * at + 1].to_le_bytes());
        let (sc, mn) = (&k.sc[at * 8..at * 8 + 8], &k.mn[at * 8..at * 8 + 8]);
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

/// Group `g` of row `r`'s lane scales `d·sc_j` and offsets `−dmin·m_j` (`n` blocks, the
/// rest zero), for a matrix of `blocks` blocks a row.
///
/// # Safety
/// AVX-512 F/BW/VL; `r`, `g` and `n` within the matrix `k` describes.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl")]
pub(crate) unsafe fn lane_scales(
    k: &KScales,
    blocks: usize,
    r: usize,
    g: usize,
    n: usize,
) -> (__m512, __m512) {
    let mask16 = ((1u32 << n) - 1) as u16;
    // Two super-blocks a full group, one for a last group of 8.
    let halves: u8 = if n > 8 { 0x0F } else { 0x03 };
    // SAFETY: the masks keep every load inside row r's values for group g.
    unsafe {
        let at = r * blocks + g * 16;
        let bytes = |v: &[u8]| {
            let b = _mm_maskz_loadu_epi8(mask16, v.as_ptr().add(at) as *const i8);
            _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(b))
        };
        let (sc, mn) = (bytes(&k.sc), bytes(&k.mn));
        let dd = k.dd.as_ptr().add((r * blocks / 8 + g * 2) * 2);
        // [d_A, dmin_A, d_B, dmin_B] → lanes 0..8 from A, 8..16 from B.
        let four = _mm_cvtph_ps(_mm_maskz_loadu_epi16(halves, dd as *const i16));
        let four = _mm512_castps128_ps512(four);
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
}
