//! GGUF block layouts and their unpacking into `w = scale·q + bias` per 16 weights.

use half::f16;

/// The quantized block types shoal's kernels read.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum BlockType {
    Q4_0,
    Q4_1,
    Q5_0,
    Q8_0,
    Q4K,
    Q6K,
}

impl BlockType {
    pub const ALL: [BlockType; 6] = [
        Self::Q4_0,
        Self::Q4_1,
        Self::Q5_0,
        Self::Q8_0,
        Self::Q4K,
        Self::Q6K,
    ];

    /// Weights per block.
    pub fn block_size(self) -> usize {
        match self {
            Self::Q4_0 | Self::Q4_1 | Self::Q5_0 | Self::Q8_0 => 32,
            Self::Q4K | Self::Q6K => 256,
        }
    }

    /// Bytes per block.
    pub fn block_bytes(self) -> usize {
        match self {
            Self::Q4_0 => 18,
            Self::Q4_1 => 20,
            Self::Q5_0 => 22,
            Self::Q8_0 => 34,
            Self::Q4K => 144,
            Self::Q6K => 210,
        }
    }

    /// Bytes of one row of `cols` weights.
    pub fn row_bytes(self, cols: usize) -> usize {
        cols / self.block_size() * self.block_bytes()
    }

    /// Whether the unpacked `q` values are signed bytes (Q8_0) rather than unsigned.
    pub(crate) fn signed(self) -> bool {
        self == Self::Q8_0
    }
}

pub(crate) fn f16_at(b: &[u8], i: usize) -> f32 {
    f16::from_le_bytes([b[i], b[i + 1]]).to_f32()
}

/// A weight row unpacked to one byte per weight and a scale and bias per 16 weights.
#[derive(Clone, Debug, Default)]
pub(crate) struct Unpacked {
    pub q: Vec<u8>,
    pub scale: Vec<f32>,
    pub bias: Vec<f32>,
}

impl Unpacked {
    pub fn with_cols(cols: usize) -> Self {
        Self {
            q: vec![0; cols],
            scale: vec![0.0; cols / 16],
            bias: vec![0.0; cols / 16],
        }
    }
}

/// Unpacks one row (`row.len() == ty.row_bytes(cols)`) with the fastest code `isa` allows.
pub(crate) fn unpack_row_with(isa: crate::Isa, ty: BlockType, row: &[u8], out: &mut Unpacked) {
    #[cfg(target_arch = "x86_64")]
    if isa != crate::Isa::Scalar {
        // SAFETY: every Isa but Scalar implies AVX2, and callers pass available ones.
        unsafe { x86::unpack_row_avx2(ty, row, out) };
        return;
    }
    let _ = isa;
    unpack_row(ty, row, out);
}

/// Unpacks one row (`row.len() == ty.row_bytes(cols)`), portable code.
pub(crate) fn unpack_row(ty: BlockType, row: &[u8], out: &mut Unpacked) {
    let bb = ty.block_bytes();
    match ty {
        BlockType::Q4_0 | BlockType::Q4_1 => {
            for (b, blk) in row.chunks_exact(bb).enumerate() {
                let d = f16_at(blk, 0);
                let (bias, qs) = if ty == BlockType::Q4_0 {
                    (-8.0 * d, &blk[2..18])
                } else {
                    (f16_at(blk, 2), &blk[4..20])
                };
                let q = &mut out.q[b * 32..b * 32 + 32];
                for j in 0..16 {
                    q[j] = qs[j] & 0x0F;
                    q[j + 16] = qs[j] >> 4;
                }
                out.scale[2 * b..2 * b + 2].fill(d);
                out.bias[2 * b..2 * b + 2].fill(bias);
            }
        }
        BlockType::Q5_0 => {
            for (b, blk) in row.chunks_exact(bb).enumerate() {
                let d = f16_at(blk, 0);
                let qh = u32::from_le_bytes([blk[2], blk[3], blk[4], blk[5]]);
                let qs = &blk[6..22];
                let q = &mut out.q[b * 32..b * 32 + 32];
                for j in 0..16 {
                    let h0 = (((qh >> j) & 1) << 4) as u8;
                    let h1 = (((qh >> (j + 16)) & 1) << 4) as u8;
                    q[j] = (qs[j] & 0x0F) | h0;
                    q[j + 16] = (qs[j] >> 4) | h1;
                }
                out.scale[2 * b..2 * b + 2].fill(d);
                out.bias[2 * b..2 * b + 2].fill(-16.0 * d);
            }
        }
        BlockType::Q8_0 => {
            for (b, blk) in row.chunks_exact(bb).enumerate() {
                let d = f16_at(blk, 0);
                out.q[b * 32..b * 32 + 32].copy_from_slice(&blk[2..34]);
                out.scale[2 * b..2 * b + 2].fill(d);
                out.bias[2 * b..2 * b + 2].fill(0.0);
            }
        }
        BlockType::Q4K => {
            for (b, blk) in row.chunks_exact(bb).enumerate() {
                let d = f16_at(blk, 0);
                let dmin = f16_at(blk, 2);
                let scales = &blk[4..16];
                let qs = &blk[16..144];
                for pair in 0..4 {
                    let q32 = &qs[pair * 32..pair * 32 + 32];
                    let base = b * 256 + pair * 64;
                    let q = &mut out.q[base..base + 64];
                    for l in 0..32 {
                        q[l] = q32[l] & 0x0F;
                        q[l + 32] = q32[l] >> 4;
                    }
                    for half in 0..2 {
                        let (sc, m) = scale_min_k4(2 * pair + half, scales);
                        let h = (base + half * 32) / 16;
                        out.scale[h..h + 2].fill(d * sc as f32);
                        out.bias[h..h + 2].fill(-dmin * m as f32);
                    }
                }
            }
        }
        BlockType::Q6K => {
            for (b, blk) in row.chunks_exact(bb).enumerate() {
                let sc = &blk[192..208];
                let d = f16_at(blk, 208);
                q6k_quants(blk, &mut out.q[b * 256..b * 256 + 256]);
                for (h, &s) in sc.iter().enumerate() {
                    let s = d * (s as i8) as f32;
                    out.scale[b * 16 + h] = s;
                    out.bias[b * 16 + h] = -32.0 * s;
                }
            }
        }
    }
}

/// A Q6_K super-block's 256 quants (0..64, unsigned) into `q`, in weight order.
pub(crate) fn q6k_quants(blk: &[u8], q: &mut [u8]) {
    for half in 0..2 {
        let ql = &blk[half * 64..half * 64 + 64];
        let qh = &blk[128 + half * 32..128 + half * 32 + 32];
        let q = &mut q[half * 128..half * 128 + 128];
        for l in 0..32 {
            q[l] = (ql[l] & 0x0F) | ((qh[l] & 3) << 4);
            q[l + 32] = (ql[l + 32] & 0x0F) | (((qh[l] >> 2) & 3) << 4);
            q[l + 64] = (ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4);
            q[l + 96] = (ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4);
        }
    }
}

/// ggml's 6-bit scale and min of sub-block `j` of a Q4_K/Q5_K super-block.
pub(crate) fn scale_min_k4(j: usize, q: &[u8]) -> (u8, u8) {
    if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        (
            (q[j + 4] & 0x0F) | ((q[j - 4] >> 6) << 4),
            (q[j + 4] >> 4) | ((q[j] >> 6) << 4),
        )
    }
}

/// Dequantizes one row to f32 (embedding lookups, tests).
pub fn dequantize_row(ty: BlockType, row: &[u8], out: &mut [f32]) {
    let mut u = Unpacked::with_cols(out.len());
    unpack_row(ty, row, &mut u);
    for (i, o) in out.iter_mut().enumerate() {
        let q = if ty.signed() {
            u.q[i] as i8 as f32
        } else {
            u.q[i] as f32
        };
        *o = u.scale[i / 16] * q + u.bias[i / 16];
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use super::{BlockType, Unpacked, f16_at, unpack_row};
    use crate::fused::{high_bits, nibbles};

    #[inline]
    #[target_feature(enable = "avx2")]
    fn store(out: &mut [u8], at: usize, v: __m256i) {
        assert!(at + 32 <= out.len());
        // SAFETY: bounds checked above.
        unsafe { _mm256_storeu_si256(out.as_mut_ptr().add(at) as *mut __m256i, v) };
    }

    /// # Safety
    /// The CPU must have AVX2; `row.len() == ty.row_bytes(out.q.len())`.
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn unpack_row_avx2(ty: BlockType, row: &[u8], out: &mut Unpacked) {
        let bb = ty.block_bytes();
        match ty {
            BlockType::Q4_0 | BlockType::Q4_1 | BlockType::Q5_0 | BlockType::Q8_0 => {
                for (b, blk) in row.chunks_exact(bb).enumerate() {
                    let d = f16_at(blk, 0);
                    let (q, bias) = match ty {
                        BlockType::Q4_0 => (nibbles(&blk[2..18]), -8.0 * d),
                        BlockType::Q4_1 => (nibbles(&blk[4..20]), f16_at(blk, 2)),
                        BlockType::Q5_0 => {
                            let qh = u32::from_le_bytes([blk[2], blk[3], blk[4], blk[5]]);
                            let q = _mm256_or_si256(nibbles(&blk[6..22]), high_bits(qh));
                            (q, -16.0 * d)
                        }
                        _ => {
                            let src = &blk[2..34];
                            // SAFETY: 32 readable bytes.
                            (
                                unsafe { _mm256_loadu_si256(src.as_ptr() as *const __m256i) },
                                0.0,
                            )
                        }
                    };
                    store(&mut out.q, b * 32, q);
                    out.scale[2 * b] = d;
                    out.scale[2 * b + 1] = d;
                    out.bias[2 * b] = bias;
                    out.bias[2 * b + 1] = bias;
                }
            }
            BlockType::Q4K => {
                for (b, blk) in row.chunks_exact(bb).enumerate() {
                    // Scales and mins with the portable code (12 bytes), nibbles here.
                    for pair in 0..4 {
                        let src = &blk[16 + pair * 32..16 + pair * 32 + 32];
                        // SAFETY: 32 readable bytes.
                        let v = unsafe { _mm256_loadu_si256(src.as_ptr() as *const __m256i) };
                        let m = _mm256_set1_epi8(0x0F);
                        let lo = _mm256_and_si256(v, m);
                        let hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), m);
                        let base = b * 256 + pair * 64;
                        store(&mut out.q, base, lo);
                        store(&mut out.q, base + 32, hi);
                    }
                    let d = f16_at(blk, 0);
                    let dmin = f16_at(blk, 2);
                    for j in 0..8 {
                        let (sc, m) = super::scale_min_k4(j, &blk[4..16]);
                        let h = b * 16 + 2 * j;
                        out.scale[h] = d * sc as f32;
                        out.scale[h + 1] = d * sc as f32;
                        out.bias[h] = -dmin * m as f32;
                        out.bias[h + 1] = -dmin * m as f32;
                    }
                }
            }
            BlockType::Q6K => unpack_row(ty, row, out),
        }
    }
}
