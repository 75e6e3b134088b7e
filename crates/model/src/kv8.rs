//! Keys and values in 8 bits: how a CPU cache keeps them when asked to (`SHOAL_KV=q8`).
//!
//! Each KV head's row of a position (`head_dim` values) is kept as `head_dim` signed bytes
//! and, after them, the f32 scale they are multiplied by (the row's largest magnitude over
//! 127), so a row is `head_dim + 4` bytes against `2 · head_dim` in f16: 68 bytes against
//! 128 at head size 64. Deep in a long prompt most of a step is reading the cache, so this
//! is what the step costs less. The row attention reads the bytes as they are kept and
//! folds the scale into a key's score and a value's weight (`row_attention`), so nothing
//! is widened into memory.
//!
//! Keys are rotated before they are rounded (where the head size is a power of two): a
//! few channels of some models' keys are far larger than the rest (qwen2.5's, from its key
//! bias), and one scale a row then leaves the others few steps (qwen2.5-coder-0.5b's
//! perplexity +7.3% unrotated). The normalized Hadamard transform spreads them over the
//! row; it is orthogonal and its own inverse, so the row attention turns the queries by
//! it too and every score is what it was.
//!
//! candle has no i8 type: the rows live in a `u8` tensor `(kv_heads, positions,
//! head_dim + 4)` whose bytes are the two's-complement values.

use candle_core::{DType, Tensor};

use crate::Result;

/// Which of a layer's two caches rows belong to: keys are rotated, values are not.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Part {
    Keys,
    Values,
}

/// Whether rows of `head_dim` keys are rotated before they are rounded.
pub(crate) fn rotates(head_dim: usize) -> bool {
    head_dim.is_power_of_two() && head_dim >= 8
}

/// `x ← H·x` for `H` the normalized Hadamard matrix of `x.len()` (a power of two): the fast
/// Walsh–Hadamard transform, then `1/√n`. `H` is orthogonal and its own inverse.
pub(crate) fn hadamard(x: &mut [f32]) {
    let n = x.len();
    debug_assert!(n.is_power_of_two());
    let mut h = 1;
    while h < n {
        for i in (0..n).step_by(2 * h) {
            for j in i..i + h {
                let (a, b) = (x[j], x[j + h]);
                x[j] = a + b;
                x[j + h] = a - b;
            }
        }
        h *= 2;
    }
    let norm = 1.0 / (n as f32).sqrt();
    for v in x {
        *v *= norm;
    }
}

/// Bytes of a row's scale, after its values.
pub(crate) const SCALE_BYTES: usize = 4;

/// Bytes a row of `head_dim` values takes.
pub(crate) fn row_bytes(head_dim: usize) -> usize {
    head_dim + SCALE_BYTES
}

/// Quantizes one row into `out` (`row.len() + 4` bytes): `round(x / d)` for
/// `d = max|x| / 127`, then `d`'s bytes. A row of zeros keeps `d = 0`.
pub(crate) fn quantize_row(row: &[f32], out: &mut [u8]) {
    debug_assert_eq!(out.len(), row_bytes(row.len()));
    let amax = row.iter().fold(0f32, |m, x| m.max(x.abs()));
    let d = amax / 127.0;
    let inv = if d > 0.0 { 1.0 / d } else { 0.0 };
    let (values, scale) = out.split_at_mut(row.len());
    for (q, x) in values.iter_mut().zip(row) {
        *q = (x * inv).round().clamp(-127.0, 127.0) as i8 as u8;
    }
    scale.copy_from_slice(&d.to_le_bytes());
}

/// The scale kept after a row's `head_dim` values.
pub(crate) fn scale_of(row: &[u8], head_dim: usize) -> f32 {
    let mut bytes = [0u8; SCALE_BYTES];
    bytes.copy_from_slice(&row[head_dim..head_dim + SCALE_BYTES]);
    f32::from_le_bytes(bytes)
}

/// `(kv_heads, t, head_dim)` keys or values (any float type) as the 8-bit rows
/// `(kv_heads, t, head_dim + 4)`, keys rotated first where [`rotates`].
pub(crate) fn quantize(x: &Tensor, part: Part) -> Result<Tensor> {
    let (heads, t, hd) = x.dims3()?;
    let mut values = x.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
    if part == Part::Keys && rotates(hd) {
        values.chunks_exact_mut(hd).for_each(hadamard);
    }
    let width = row_bytes(hd);
    let mut bytes = vec![0u8; heads * t * width];
    for (row, out) in values.chunks_exact(hd).zip(bytes.chunks_exact_mut(width)) {
        quantize_row(row, out);
    }
    Ok(Tensor::from_vec(bytes, (heads, t, width), x.device())?)
}

/// The f32 values `(kv_heads, n, head_dim)` that 8-bit rows `(kv_heads, n, head_dim + 4)`
/// stand for, keys turned back (for the paths that attend through candle's operations:
/// ring attention).
pub(crate) fn dequantize(x: &Tensor, part: Part) -> Result<Tensor> {
    let (heads, n, width) = x.dims3()?;
    let hd = width.checked_sub(SCALE_BYTES).ok_or_else(|| {
        crate::ModelError::Invalid(format!("8-bit rows of {width} bytes hold no values"))
    })?;
    let bytes = x.contiguous()?.flatten_all()?.to_vec1::<u8>()?;
    let mut values = Vec::with_capacity(heads * n * hd);
    for row in bytes.chunks_exact(width) {
        let d = scale_of(row, hd);
        values.extend(row[..hd].iter().map(|&q| f32::from(q as i8) * d));
    }
    if part == Part::Keys && rotates(hd) {
        values.chunks_exact_mut(hd).for_each(hadamard);
    }
    Ok(Tensor::from_vec(values, (heads, n, hd), x.device())?)
}

#[cfg(test)]
mod tests {
    use candle_core::{Device, Tensor};

    use super::*;

    #[test]
    fn a_row_comes_back_within_half_a_step_of_its_largest_value() -> Result<()> {
        let hd = 64;
        let x = Tensor::randn(0f32, 2.0, (3, 5, hd), &Device::Cpu)?;
        let q = quantize(&x, Part::Values)?;
        assert_eq!(q.dims3()?, (3, 5, hd + 4));
        let back = dequantize(&q, Part::Values)?
            .flatten_all()?
            .to_vec1::<f32>()?;
        let want = x.flatten_all()?.to_vec1::<f32>()?;
        for (got, row) in back.chunks(hd).zip(want.chunks(hd)) {
            let amax = row.iter().fold(0f32, |m, x| m.max(x.abs()));
            let step = amax / 127.0;
            for (g, w) in got.iter().zip(row) {
                assert!((g - w).abs() <= 0.5 * step * 1.0001, "{g} against {w}");
            }
            // The largest value itself comes back exactly up to the scale's rounding.
            let at = row.iter().position(|x| x.abs() == amax).expect("max");
            assert!((got[at].abs() - amax).abs() <= 1e-5 * amax);
        }
        Ok(())
    }

    #[test]
    fn a_row_of_zeros_stays_zeros() -> Result<()> {
        let x = Tensor::zeros((1, 2, 8), DType::F32, &Device::Cpu)?;
        for part in [Part::Keys, Part::Values] {
            let back = dequantize(&quantize(&x, part)?, part)?
                .flatten_all()?
                .to_vec1::<f32>()?;
            assert!(back.iter().all(|&v| v == 0.0));
        }
        Ok(())
    }

    #[test]
    fn the_rotation_is_orthogonal_and_its_own_inverse() {
        let x: Vec<f32> = (0..64).map(|i| ((i * 7) as f32 * 0.3).sin()).collect();
        let mut y = x.clone();
        hadamard(&mut y);
        let norm = |v: &[f32]| v.iter().map(|a| a * a).sum::<f32>().sqrt();
        assert!((norm(&y) - norm(&x)).abs() < 1e-5 * norm(&x));
        let q: Vec<f32> = (0..64).map(|i| ((i * 3) as f32 * 0.7).cos()).collect();
        let mut hq = q.clone();
        hadamard(&mut hq);
        let dot = |a: &[f32], b: &[f32]| a.iter().zip(b).map(|(a, b)| a * b).sum::<f32>();
        assert!((dot(&hq, &y) - dot(&q, &x)).abs() < 1e-5);
        hadamard(&mut y);
        assert!(y.iter().zip(&x).all(|(a, b)| (a - b).abs() < 1e-6));
    }

    #[test]
    fn a_key_with_an_outlier_channel_keeps_its_small_channels_when_rotated() -> Result<()> {
        // One channel 40 times the rest: one scale a row rounds the small ones to a few
        // steps; rotated first, the error is spread and far smaller.
        let hd = 64;
        let row: Vec<f32> = (0..hd)
            .map(|i| {
                if i == 5 {
                    40.0
                } else {
                    ((i * 13) as f32 * 0.37).sin()
                }
            })
            .collect();
        let x = Tensor::from_vec(row.clone(), (1, 1, hd), &Device::Cpu)?;
        let err = |part| -> Result<f32> {
            let back = dequantize(&quantize(&x, part)?, part)?
                .flatten_all()?
                .to_vec1::<f32>()?;
            Ok(back
                .iter()
                .zip(&row)
                .map(|(a, b)| (a - b) * (a - b))
                .sum::<f32>()
                .sqrt())
        };
        let (rotated, plain) = (err(Part::Keys)?, err(Part::Values)?);
        assert!(rotated < 0.5 * plain, "rotated {rotated} against {plain}");
        Ok(())
    }
}
