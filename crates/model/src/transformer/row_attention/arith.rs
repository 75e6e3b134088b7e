//! The per-query arithmetic of [`super::row_attention`]: scores against blocks of keys,
//! the exponentials, the values weighed by them. Each is written so that a query's result
//! is the same whatever is computed beside it (the vectorized forms do the plain loops'
//! fused multiply-adds in the same order; the tests check them bit for bit).
//!
//! Keys and values are read as the cache keeps them, f32, f16 or 8-bit rows ([`Elem`]): an
//! f16 is widened to the f32 it stands for exactly, so the arithmetic after the load is the
//! same for both; an 8-bit row's scale is folded into its key's score and its value's
//! weight by the caller.

use half::f16;

use super::View;

/// An element type the cache may keep keys and values in.
pub(super) trait Elem: candle_core::WithDType {
    /// Whether a row's elements stand for themselves times the row's scale (8-bit rows).
    const SCALED: bool = false;

    fn to_f32(self) -> f32;

    /// The factor row `j` of KV head `i` of `view` stands for times its elements.
    fn row_scale(_view: &View<Self>, _i: usize, _j: usize) -> f32 {
        1.0
    }

    /// Eight elements from `p` widened to f32.
    ///
    /// # Safety
    /// `p..p + 8` must be readable.
    #[cfg(all(
        target_arch = "x86_64",
        target_feature = "avx2",
        target_feature = "fma"
    ))]
    unsafe fn load8(p: *const Self) -> std::arch::x86_64::__m256;
}

impl Elem for f32 {
    fn to_f32(self) -> f32 {
        self
    }

    #[cfg(all(
        target_arch = "x86_64",
        target_feature = "avx2",
        target_feature = "fma"
    ))]
    unsafe fn load8(p: *const f32) -> std::arch::x86_64::__m256 {
        // SAFETY: the caller's.
        unsafe { std::arch::x86_64::_mm256_loadu_ps(p) }
    }
}

impl Elem for f16 {
    fn to_f32(self) -> f32 {
        f16::to_f32(self)
    }

    #[cfg(all(
        target_arch = "x86_64",
        target_feature = "avx2",
        target_feature = "fma"
    ))]
    unsafe fn load8(p: *const f16) -> std::arch::x86_64::__m256 {
        use std::arch::x86_64::*;
        #[cfg(target_feature = "f16c")]
        // SAFETY: the caller's; the build targets F16C.
        unsafe {
            _mm256_cvtph_ps(_mm_loadu_si128(p.cast()))
        }
        #[cfg(not(target_feature = "f16c"))]
        // SAFETY: the caller's.
        unsafe {
            let xs: [f32; 8] = std::array::from_fn(|i| (*p.add(i)).to_f32());
            _mm256_loadu_ps(xs.as_ptr())
        }
    }
}

/// The 8-bit rows of [`crate::kv8`]: candle has no i8 type, so the bytes of a `u8` tensor
/// are the two's-complement values, and the row's f32 scale follows its values.
impl Elem for u8 {
    const SCALED: bool = true;

    fn to_f32(self) -> f32 {
        f32::from(self as i8)
    }

    fn row_scale(view: &View<u8>, i: usize, j: usize) -> f32 {
        let at = view.at(i, j);
        crate::kv8::scale_of(&view.data[at..], view.dims[2])
    }

    #[cfg(all(
        target_arch = "x86_64",
        target_feature = "avx2",
        target_feature = "fma"
    ))]
    unsafe fn load8(p: *const u8) -> std::arch::x86_64::__m256 {
        use std::arch::x86_64::*;
        // SAFETY: the caller's; eight bytes are read.
        unsafe { _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(p.cast()))) }
    }
}

/// `q · keys[c]` for eight keys at once (`q.len()` a multiple of 8): per key, eight
/// lanes of fused multiply-adds over the chunks of 8, then the lanes summed as the tree
/// `((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 + l7))`. A key's score is the same
/// whichever keys share the call (callers repeat a key to fill the eight).
pub(super) fn dot8<T: Elem>(q: &[f32], keys: [&[T]; 8]) -> [f32; 8] {
    #[cfg(all(
        target_arch = "x86_64",
        target_feature = "avx2",
        target_feature = "fma"
    ))]
    {
        // SAFETY: the build targets AVX2 and FMA; `dots_avx2` checks the lengths.
        unsafe { dots_avx2::<T, 1, 8>([q], keys)[0] }
    }
    #[cfg(not(all(
        target_arch = "x86_64",
        target_feature = "avx2",
        target_feature = "fma"
    )))]
    {
        let mut out = [0f32; 8];
        for (o, key) in out.iter_mut().zip(keys) {
            let mut l = [0f32; 8];
            for (x, y) in q.chunks_exact(8).zip(key.chunks_exact(8)) {
                for i in 0..8 {
                    l[i] = x[i].mul_add(y[i].to_f32(), l[i]);
                }
            }
            *o = ((l[0] + l[1]) + (l[2] + l[3])) + ((l[4] + l[5]) + (l[6] + l[7]));
        }
        out
    }
}

/// [`dot8`] of one, two or three queries (`qs`) against the same eight keys, in the first
/// `qs.len()` rows: each key's chunk loaded once serves them all. Every score is the one
/// [`dot8`] gives.
pub(super) fn scores_of<T: Elem>(qs: &[&[f32]], keys: [&[T]; 8]) -> [[f32; 8]; 3] {
    let mut out = [[0f32; 8]; 3];
    #[cfg(all(
        target_arch = "x86_64",
        target_feature = "avx2",
        target_feature = "fma"
    ))]
    // SAFETY: the build targets AVX2 and FMA; `dots_avx2` checks the lengths.
    unsafe {
        match qs {
            [a, b] => {
                out[..2].copy_from_slice(&dots_avx2::<T, 2, 4>([a, b], keys));
                return out;
            }
            [a, b, c] => return dots_avx2::<T, 3, 4>([a, b, c], keys),
            _ => {}
        }
    }
    for (o, q) in out.iter_mut().zip(qs) {
        *o = dot8(q, keys);
    }
    out
}

/// [`dot8`] for `Q` queries at once, `K` keys a pass (8 for one query; 4 for two or
/// three, whose accumulators for eight keys would not fit the sixteen registers): each
/// key's chunk loaded once serves every query.
#[cfg(all(
    target_arch = "x86_64",
    target_feature = "avx2",
    target_feature = "fma"
))]
unsafe fn dots_avx2<T: Elem, const Q: usize, const K: usize>(
    qs: [&[f32]; Q],
    keys: [&[T]; 8],
) -> [[f32; 8]; Q] {
    use std::arch::x86_64::*;
    const { assert!(K == 4 || K == 8) };
    let hd = qs[0].len();
    assert!(
        hd.is_multiple_of(8)
            && qs.iter().all(|r| r.len() == hd)
            && keys.iter().all(|r| r.len() == hd)
    );
    let mut out = [[0f32; 8]; Q];
    // SAFETY: the lengths are checked; the features are the build's.
    unsafe {
        for pass in 0..8 / K {
            let ks: [*const T; K] = std::array::from_fn(|c| keys[K * pass + c].as_ptr());
            let mut acc = [[_mm256_setzero_ps(); K]; Q];
            for c in (0..hd).step_by(8) {
                let x: [__m256; Q] =
                    std::array::from_fn(|a| _mm256_loadu_ps(qs[a].as_ptr().add(c)));
                for (kk, key) in ks.iter().enumerate() {
                    let y = T::load8(key.add(c));
                    for a in 0..Q {
                        acc[a][kk] = _mm256_fmadd_ps(x[a], y, acc[a][kk]);
                    }
                }
            }
            // Four keys at a time: hadd pairs lanes (l0 + l1, l2 + l3 | l4 + l5, l6 + l7)
            // per 128-bit half; twice gives each key's two half sums
            // ([k0 lo, k1 lo, k2 lo, k3 lo | k0 hi, …]), then the halves are added.
            for a in 0..Q {
                for g in (0..K).step_by(4) {
                    let h01 = _mm256_hadd_ps(acc[a][g], acc[a][g + 1]);
                    let h23 = _mm256_hadd_ps(acc[a][g + 2], acc[a][g + 3]);
                    let q = _mm256_hadd_ps(h01, h23);
                    let sum = _mm_add_ps(_mm256_castps256_ps128(q), _mm256_extractf128_ps::<1>(q));
                    _mm_storeu_ps(out[a].as_mut_ptr().add(K * pass + g), sum);
                }
            }
        }
    }
    out
}

/// `q · key` by the same arithmetic as [`dot8`] (for a head size that is not a multiple of
/// eight, every score takes this).
pub(super) fn dot<T: Elem>(a: &[f32], b: &[T]) -> f32 {
    let mut acc = [0f32; 8];
    let (ac, bc) = (a.chunks_exact(8), b.chunks_exact(8));
    let tail: f32 = ac
        .remainder()
        .iter()
        .zip(bc.remainder())
        .map(|(x, y)| x * y.to_f32())
        .sum();
    for (x, y) in ac.zip(bc) {
        for l in 0..8 {
            acc[l] = x[l].mul_add(y[l].to_f32(), acc[l]);
        }
    }
    ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7])) + tail
}

/// The largest of `xs` (−∞ for none), eight lanes at a time: a maximum does not depend on
/// the order it is taken in, and the plain fold (`f32::max` one value after another) ran
/// one value a cycle, since the compiler keeps its order.
pub(super) fn max_of(xs: &[f32]) -> f32 {
    let mut lanes = [f32::NEG_INFINITY; 8];
    let chunks = xs.chunks_exact(8);
    let tail = chunks.remainder();
    for c in chunks {
        for (m, &x) in lanes.iter_mut().zip(c) {
            *m = m.max(x);
        }
    }
    tail.iter()
        .chain(&lanes)
        .fold(f32::NEG_INFINITY, |m, &x| m.max(x))
}

/// One value of [`exp_minus`]'s exponential: Cephes' single-precision one (relative
/// error about 1e-7).
pub(super) fn exp(x: f32) -> f32 {
    let x = x.clamp(EXP_LOW, EXP_HIGH);
    // x = n·ln 2 + r, |r| ≤ ln 2 / 2; n rounded to nearest by the 1.5·2²³ trick.
    let n = (x * std::f32::consts::LOG2_E + ROUND) - ROUND;
    let r = x - n * LN2_HIGH - n * LN2_LOW;
    let p = EXP_POLY[1..].iter().fold(EXP_POLY[0], |p, &c| p * r + c);
    let e = p * r * r + r + 1.0;
    e * f32::from_bits(((n as i32 + 127) as u32) << 23)
}

/// [`exp`]'s arguments are clamped to these (beyond them f32 over- or underflows).
const EXP_LOW: f32 = -87.3;
const EXP_HIGH: f32 = 88.7;
/// 1.5·2²³: added and taken away, it rounds to an integer.
const ROUND: f32 = 12_582_912.0;
/// ln 2 in two parts, so `n · ln 2` is taken away without losing `r`'s low bits.
const LN2_HIGH: f32 = 0.693_359_4;
const LN2_LOW: f32 = -2.121_944_4e-4;
/// Cephes' polynomial for `(e^r − 1 − r) / r²`, highest power first.
const EXP_POLY: [f32; 6] = [
    1.987_569_1e-4,
    1.398_199_9e-3,
    8.333_452e-3,
    4.166_579_6e-2,
    0.166_666_65,
    0.5,
];

/// `x ← e^(x − max)` for every `x`, and their sum (eight lanes, then the lanes in
/// order): [`exp`] eight values at a time; libm's `expf` one value at a time was most of
/// a step's attention over a long cache.
pub(super) fn exp_minus(xs: &mut [f32], max: f32) -> f32 {
    let mut acc = [0f32; 8];
    let mut chunks = xs.chunks_exact_mut(8);
    #[cfg(all(
        target_arch = "x86_64",
        target_feature = "avx2",
        target_feature = "fma"
    ))]
    // SAFETY: the build targets AVX2; each chunk is eight floats.
    unsafe {
        // `exp` above, eight lanes by the same operations in the same order (no fused
        // multiply-adds, as the plain code has none): bit for bit its results. The
        // compiler left the plain loop scalar (the clamp and the cast), 5 cycles a value.
        use std::arch::x86_64::*;
        let c = |v: f32| _mm256_set1_ps(v);
        let (magic, m) = (c(ROUND), c(max));
        let mut sums = _mm256_setzero_ps();
        for ch in &mut chunks {
            let x = _mm256_sub_ps(_mm256_loadu_ps(ch.as_ptr()), m);
            let x = _mm256_min_ps(_mm256_max_ps(x, c(EXP_LOW)), c(EXP_HIGH));
            let n = _mm256_sub_ps(
                _mm256_add_ps(_mm256_mul_ps(x, c(std::f32::consts::LOG2_E)), magic),
                magic,
            );
            let r = _mm256_sub_ps(
                _mm256_sub_ps(x, _mm256_mul_ps(n, c(LN2_HIGH))),
                _mm256_mul_ps(n, c(LN2_LOW)),
            );
            let mut p = c(EXP_POLY[0]);
            for &k in &EXP_POLY[1..] {
                p = _mm256_add_ps(_mm256_mul_ps(p, r), c(k));
            }
            let e = _mm256_add_ps(
                _mm256_add_ps(_mm256_mul_ps(_mm256_mul_ps(p, r), r), r),
                c(1.0),
            );
            let pow = _mm256_castsi256_ps(_mm256_slli_epi32::<23>(_mm256_add_epi32(
                _mm256_cvttps_epi32(n),
                _mm256_set1_epi32(127),
            )));
            let v = _mm256_mul_ps(e, pow);
            _mm256_storeu_ps(ch.as_mut_ptr(), v);
            sums = _mm256_add_ps(sums, v);
        }
        _mm256_storeu_ps(acc.as_mut_ptr(), sums);
    }
    for c in &mut chunks {
        for (l, x) in c.iter_mut().enumerate() {
            *x = exp(*x - max);
            acc[l] += *x;
        }
    }
    let mut sum = 0f32;
    for x in chunks.into_remainder() {
        *x = exp(*x - max);
        sum += *x;
    }
    acc.iter().sum::<f32>() + sum
}

/// `out[e] += Σ_j probs[j] · values[j][e]` over KV head `kvh`'s first `probs.len()`
/// values, one fused multiply-add per term in key order (so a row's sum is the same
/// whatever is computed beside it).
pub(super) fn weigh_values<T: Elem>(out: &mut [f32], probs: &[f32], v: &View<T>, kvh: usize) {
    assert!(out.len() == v.dims[2] && probs.len() <= v.dims[1]);
    #[cfg(all(
        target_arch = "x86_64",
        target_feature = "avx2",
        target_feature = "fma"
    ))]
    if out.len().is_multiple_of(8) {
        // SAFETY: the build targets AVX2 and FMA; the lengths are checked above and
        // `View::new` checked that every row lies inside its storage.
        unsafe { weigh_values_avx2(out, probs, v, kvh) };
        return;
    }
    for (j, &p) in probs.iter().enumerate() {
        for (acc, x) in out.iter_mut().zip(v.row(kvh, j)) {
            *acc = p.mul_add(x.to_f32(), *acc);
        }
    }
}

/// [`weigh_values`] with the sums held in registers, up to 64 values of a row at a time
/// (the plain loop loaded and stored every sum once per key, and the stores bound it).
#[cfg(all(
    target_arch = "x86_64",
    target_feature = "avx2",
    target_feature = "fma"
))]
unsafe fn weigh_values_avx2<T: Elem>(out: &mut [f32], probs: &[f32], v: &View<T>, kvh: usize) {
    use std::arch::x86_64::*;
    /// Values `start..start + 8·N` of the row.
    unsafe fn piece<T: Elem, const N: usize>(
        out: &mut [f32],
        start: usize,
        probs: &[f32],
        v: &View<T>,
        kvh: usize,
    ) {
        // SAFETY: the caller's: `start + 8·N ≤ head_dim`, rows `0..probs.len()` exist.
        unsafe {
            let mut acc: [__m256; N] =
                std::array::from_fn(|i| _mm256_loadu_ps(out.as_ptr().add(start + 8 * i)));
            for (j, &p) in probs.iter().enumerate() {
                let p = _mm256_set1_ps(p);
                let row = v.data.as_ptr().add(v.at(kvh, j) + start);
                for (i, a) in acc.iter_mut().enumerate() {
                    *a = _mm256_fmadd_ps(p, T::load8(row.add(8 * i)), *a);
                }
            }
            for (i, a) in acc.iter().enumerate() {
                _mm256_storeu_ps(out.as_mut_ptr().add(start + 8 * i), *a);
            }
        }
    }
    let mut start = 0;
    // SAFETY: each piece ends within the row (`out.len()` is the head size, a multiple
    // of 8).
    unsafe {
        while start < out.len() {
            let left = (out.len() - start) / 8;
            let n = match left {
                8.. => {
                    piece::<T, 8>(out, start, probs, v, kvh);
                    8
                }
                4..=7 => {
                    piece::<T, 4>(out, start, probs, v, kvh);
                    4
                }
                2..=3 => {
                    piece::<T, 2>(out, start, probs, v, kvh);
                    2
                }
                _ => {
                    piece::<T, 1>(out, start, probs, v, kvh);
                    1
                }
            };
            start += 8 * n;
        }
    }
}
