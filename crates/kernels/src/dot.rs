//! The integer dot product of an unpacked weight row with one quantized activation row,
//! per instruction set.

use crate::blocks::Unpacked;

/// An instruction set the kernels can run on.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Isa {
    /// Plain Rust: any CPU.
    Scalar,
    /// AVX2 + FMA: `vpmaddubsw` products, f32 accumulation.
    Avx2,
    /// AVX-512 (F, BW, VL, VNNI) and F16C: `vpdpbusd` products, no 16-bit intermediate;
    /// 512-bit registers for single tokens (`wide`) and register tiles for batches.
    Avx512Vnni,
    /// [`Isa::Avx512Vnni`] for single tokens, AMX-BF16 tiles (`tdpbf16ps`) for batches.
    Amx,
}

impl Isa {
    /// Whether this machine can run `self`.
    pub fn is_available(self) -> bool {
        match self {
            Self::Scalar => true,
            #[cfg(target_arch = "x86_64")]
            Self::Avx2 => is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma"),
            #[cfg(target_arch = "x86_64")]
            Self::Avx512Vnni => {
                Self::Avx2.is_available()
                    && is_x86_feature_detected!("avx512f")
                    && is_x86_feature_detected!("avx512bw")
                    && is_x86_feature_detected!("avx512vnni")
                    && is_x86_feature_detected!("avx512vl")
                    && is_x86_feature_detected!("f16c")
            }
            #[cfg(target_arch = "x86_64")]
            Self::Amx => Self::Avx512Vnni.is_available() && crate::amx::supported(),
            #[cfg(not(target_arch = "x86_64"))]
            _ => false,
        }
    }

    /// Whether a product of `t` tokens rounds weights and activations to bf16 (the AMX
    /// tiles) rather than quantizing activations to 8 bits per 32.
    pub fn batches_in_bf16(self, t: usize) -> bool {
        self == Self::Amx && t >= crate::matmul::AMX_MIN_TOKENS
    }

    /// Whether prompt rows and decode rows (see [`crate::Rows`]) round alike: on AVX-512
    /// VNNI, whose register tiles and lane kernel compute every row as the single-token
    /// kernel does; on AVX2 where every block type is in its lane layout (the default),
    /// one kernel for any number of rows; and on the portable kernel, which has one path.
    /// On AVX2 in GGUF's layout (`SHOAL_LANES=0`) a batch's rows take the unpacked-row
    /// kernel and a lone token the fused one; on AMX prompt rows take the bf16 tiles:
    /// there a batch holding both must run them apart for each row to equal its
    /// computation alone.
    pub fn rows_round_alike(self) -> bool {
        match self {
            Self::Avx512Vnni | Self::Scalar => true,
            Self::Avx2 => cfg!(target_arch = "x86_64") && crate::matmul::lanes_on(),
            Self::Amx => false,
        }
    }

    /// Every instruction set this machine can run, best last.
    pub fn available() -> Vec<Isa> {
        [Self::Scalar, Self::Avx2, Self::Avx512Vnni, Self::Amx]
            .into_iter()
            .filter(|i| i.is_available())
            .collect()
    }

    /// The best instruction set of this machine; `SHOAL_KERNEL_ISA=scalar|avx2|avx512vnni`
    /// forces a lesser one.
    pub fn detect() -> Isa {
        let forced = std::env::var("SHOAL_KERNEL_ISA")
            .ok()
            .and_then(|v| match v.as_str() {
                "scalar" => Some(Self::Scalar),
                "avx2" => Some(Self::Avx2),
                "avx512vnni" => Some(Self::Avx512Vnni),
                "amx" => Some(Self::Amx),
                _ => None,
            });
        match forced {
            Some(isa) if isa.is_available() => isa,
            _ => Self::available().pop().unwrap_or(Self::Scalar),
        }
    }
}

/// `Σ_h scale_h·d_x·Σ_{i∈h} q_i·x_i` over the 16-weight groups `h` of a row (the bias part
/// is added by the caller). `xd` holds one scale per 32 activations.
pub(crate) fn dot(isa: Isa, w: &Unpacked, signed: bool, xq: &[i8], xd: &[f32]) -> f32 {
    match isa {
        Isa::Scalar => dot_scalar(w, signed, xq, xd),
        #[cfg(target_arch = "x86_64")]
        // SAFETY: callers only pass an Isa that `is_available` on this machine.
        Isa::Avx2 => unsafe { x86::dot_avx2(w, signed, xq, xd) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as above.
        Isa::Avx512Vnni | Isa::Amx => unsafe { x86::dot_vnni(w, signed, xq, xd) },
        #[cfg(not(target_arch = "x86_64"))]
        _ => dot_scalar(w, signed, xq, xd),
    }
}

fn dot_scalar(w: &Unpacked, signed: bool, xq: &[i8], xd: &[f32]) -> f32 {
    let mut acc = 0f32;
    for (h, (q, x)) in w.q.chunks_exact(16).zip(xq.chunks_exact(16)).enumerate() {
        let isum: i32 = if signed {
            q.iter()
                .zip(x)
                .map(|(&a, &b)| a as i8 as i32 * b as i32)
                .sum()
        } else {
            q.iter().zip(x).map(|(&a, &b)| a as i32 * b as i32).sum()
        };
        acc += w.scale[h] * xd[h / 2] * isum as f32;
    }
    acc
}

/// `dot` for up to four activation rows at once (`xs[j]` = (q, d) of token j), writing
/// `out[j]`: the weight row is loaded once per group for all of them.
pub(crate) fn dot_many(
    isa: Isa,
    w: &Unpacked,
    signed: bool,
    xs: &[(&[i8], &[f32])],
    out: &mut [f32],
) {
    match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: callers only pass an Isa that `is_available` on this machine.
        Isa::Avx2 | Isa::Avx512Vnni | Isa::Amx if xs.len() == 4 => unsafe {
            x86::dot4_avx2(w, signed, xs, out)
        },
        _ => {
            for (o, (q, d)) in out.iter_mut().zip(xs) {
                *o = dot(isa, w, signed, q, d);
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use crate::blocks::Unpacked;
    use crate::fused::hsum;

    /// Scales of the two halves of group `g`, times the activation scale, as
    /// `[lo ×4, hi ×4]` to match the lane order of the 32-bit sums.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    fn group_scale(w: &Unpacked, xd: &[f32], g: usize) -> __m256 {
        let d = xd[g];
        _mm256_set_m128(
            _mm_set1_ps(w.scale[2 * g + 1] * d),
            _mm_set1_ps(w.scale[2 * g] * d),
        )
    }

    /// One unpacked row against one activation row; only the 8-bit product differs
    /// between instruction sets.
    macro_rules! unpacked_dot {
        ($name:ident, $features:literal, $requires:literal, $product:expr) => {
            /// # Safety
            #[doc = $requires]
            #[target_feature(enable = $features)]
            pub(super) unsafe fn $name(w: &Unpacked, signed: bool, xq: &[i8], xd: &[f32]) -> f32 {
                let mut acc = _mm256_setzero_ps();
                let groups = w.q.len() / 32;
                for g in 0..groups {
                    // SAFETY: g·32 + 32 ≤ len for both slices.
                    let (q, x) = unsafe {
                        (
                            _mm256_loadu_si256(w.q.as_ptr().add(g * 32) as *const __m256i),
                            _mm256_loadu_si256(xq.as_ptr().add(g * 32) as *const __m256i),
                        )
                    };
                    let (q, x) = if signed {
                        (_mm256_sign_epi8(q, q), _mm256_sign_epi8(x, q))
                    } else {
                        (q, x)
                    };
                    let p: __m256i = $product(q, x);
                    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), group_scale(w, xd, g), acc);
                }
                hsum(acc)
            }
        };
    }

    unpacked_dot!(
        dot_avx2,
        "avx2,fma",
        "The CPU must have AVX2 and FMA; `xq.len() == w.q.len()`, a multiple of 32.",
        |q, x| _mm256_madd_epi16(_mm256_maddubs_epi16(q, x), _mm256_set1_epi16(1))
    );
    unpacked_dot!(
        dot_vnni,
        "avx2,fma,avx512vnni,avx512vl",
        "The CPU must have AVX2, FMA, AVX-512 VNNI and VL; lengths as for `dot_avx2`.",
        |q, x| _mm256_dpbusd_epi32(_mm256_setzero_si256(), q, x)
    );

    /// Four tokens per pass over the weight row.
    ///
    /// # Safety
    /// The CPU must have AVX2 and FMA; `xs.len() == 4`, `out.len() >= 4`, lengths as for
    /// `dot_avx2`.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn dot4_avx2(
        w: &Unpacked,
        signed: bool,
        xs: &[(&[i8], &[f32])],
        out: &mut [f32],
    ) {
        let ones = _mm256_set1_epi16(1);
        let mut acc = [_mm256_setzero_ps(); 4];
        let groups = w.q.len() / 32;
        for g in 0..groups {
            // SAFETY: g·32 + 32 ≤ len.
            let q = unsafe { _mm256_loadu_si256(w.q.as_ptr().add(g * 32) as *const __m256i) };
            let aq = if signed { _mm256_sign_epi8(q, q) } else { q };
            let sc = _mm256_set_m128(_mm_set1_ps(w.scale[2 * g + 1]), _mm_set1_ps(w.scale[2 * g]));
            for j in 0..4 {
                let (xq, xd) = xs[j];
                // SAFETY: g·32 + 32 ≤ len.
                let x = unsafe { _mm256_loadu_si256(xq.as_ptr().add(g * 32) as *const __m256i) };
                let x = if signed { _mm256_sign_epi8(x, q) } else { x };
                let p = _mm256_madd_epi16(_mm256_maddubs_epi16(aq, x), ones);
                let s = _mm256_mul_ps(sc, _mm256_set1_ps(xd[g]));
                acc[j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), s, acc[j]);
            }
        }
        for j in 0..4 {
            out[j] = hsum(acc[j]);
        }
    }
}
