//! What a shard of a model holds, and cutting weights to it.
//!
//! Tensor parallelism gives each rank whole KV groups (a KV head with the query heads
//! that read it) and a slice of the FFN's intermediate dimension. The query, key, value,
//! gate and up projections are cut by rows; the output and down projections by columns,
//! and each rank's output is a partial sum that the ranks add up (an all-reduce). Cuts
//! by rows never split a quantized block. Cuts by columns fall on block boundaries where
//! the split allows; where they cannot (a head of 64 columns inside a 256-weight K-quant
//! block), that slice is requantized to Q8_0, which is finer than every source format.
//!
//! The model never talks to other ranks itself: it calls [`ShardLinks`], which the
//! runner implements over its collectives.

use std::borrow::Cow;
use std::ops::Range;
use std::sync::Arc;

use candle_core::quantized::{GgmlDType, QStorage, QTensor};
use candle_core::{Device, Tensor};

use crate::{ModelConfig, ModelError, Result, Weight};

/// The part of every layer a tensor-parallel rank computes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorSlice {
    /// KV heads (with their query heads) of this rank.
    pub kv_heads: Range<usize>,
    /// Columns of the FFN's intermediate dimension of this rank.
    pub ffn: Range<usize>,
}

/// The communication a sharded forward pass needs; implemented by the runner.
pub trait ShardLinks {
    /// Element-wise sum over the ranks, in place (tensor parallelism).
    fn all_reduce_sum(&mut self, data: &mut [f32]) -> Result<()>;
    /// Element-wise sum over the ranks of a tensor, returned on its device in its dtype.
    /// The default goes through the host as f32 ([`ShardLinks::all_reduce_sum`]); links
    /// between GPUs (NCCL) reduce on the devices.
    fn all_reduce_tensor(&mut self, t: Tensor) -> Result<Tensor> {
        all_reduce_through_host(self, t)
    }
    /// Sends a block to the next rank of the ring (sequence parallelism).
    fn ring_send(&mut self, data: &[f32]) -> Result<()>;
    /// Receives the block the previous rank of the ring sent.
    fn ring_recv(&mut self) -> Result<Vec<f32>>;
    fn rank(&self) -> usize;
    fn world(&self) -> usize;
}

/// The sum over the ranks of `t` through [`ShardLinks::all_reduce_sum`] on the host, as
/// f32, returned on `t`'s device in its dtype.
pub fn all_reduce_through_host<L: ShardLinks + ?Sized>(links: &mut L, t: Tensor) -> Result<Tensor> {
    let dims = t.dims().to_vec();
    let (device, dtype) = (t.device().clone(), t.dtype());
    let mut v = t
        .to_dtype(candle_core::DType::F32)?
        .flatten_all()?
        .to_vec1::<f32>()?;
    links.all_reduce_sum(&mut v)?;
    Ok(Tensor::from_vec(v, dims, &Device::Cpu)?
        .to_dtype(dtype)?
        .to_device(&device)?)
}

/// Splits `total` units into parts proportional to `shares` (each part at least one
/// unit when `total` allows), with every boundary a multiple of `align` where possible.
fn split_by(total: usize, shares: &[f64], align: usize) -> Vec<Range<usize>> {
    let n = shares.len();
    let sum: f64 = shares.iter().sum();
    let mut bounds = vec![0usize];
    let mut acc = 0f64;
    for (i, s) in shares.iter().enumerate().take(n - 1) {
        acc += s;
        let ideal = total as f64 * acc / sum;
        let lo = bounds[i] + 1;
        let hi = total - (n - 1 - i);
        let aligned = ((ideal / align as f64).round() as usize) * align;
        let b = if aligned >= lo && aligned <= hi {
            aligned
        } else {
            (ideal.round() as usize).clamp(lo.min(hi), hi)
        };
        bounds.push(b);
    }
    bounds.push(total);
    bounds.windows(2).map(|w| w[0]..w[1]).collect()
}

/// Tensor slices for ranks whose speeds are `shares` (equal shares for equal machines).
/// Any rank count up to the number of KV heads works; the split may be uneven (3 KV
/// heads over 2 ranks is 2 + 1).
pub fn tensor_slices(config: &ModelConfig, shares: &[f64]) -> Result<Vec<TensorSlice>> {
    let n = shares.len();
    if n == 0 || n > config.num_kv_heads {
        return Err(ModelError::Invalid(format!(
            "tensor parallelism over {n} ranks needs 1 to {} (the number of KV heads)",
            config.num_kv_heads
        )));
    }
    if shares.iter().any(|s| !s.is_finite() || *s <= 0.0) {
        return Err(ModelError::Invalid("rank shares must be positive".into()));
    }
    let heads = split_by(config.num_kv_heads, shares, 1);
    // Boundaries on 256 keep K-quant blocks whole; 32 keeps the other formats whole.
    let align = if config.ffn_size.is_multiple_of(256) && config.ffn_size / 256 >= n {
        256
    } else {
        32
    };
    let ffn = split_by(config.ffn_size, shares, align);
    Ok(heads
        .into_iter()
        .zip(ffn)
        .map(|(kv_heads, ffn)| TensorSlice { kv_heads, ffn })
        .collect())
}

/// Rows `range` of a 2-D weight (or of a 1-D bias).
pub(crate) fn slice_rows(w: &Weight, range: Range<usize>) -> Result<Weight> {
    match w {
        Weight::Dense(t) => Ok(Weight::Dense(t.narrow(0, range.start, range.len())?)),
        Weight::Quantized(q) => {
            let dims = q.shape().dims().to_vec();
            let cols: usize = dims[1..].iter().product();
            let dtype = q.dtype();
            let row_bytes = cols / dtype.block_size() * dtype.type_size();
            let data = q.data()?;
            let bytes = data[range.start * row_bytes..range.end * row_bytes].to_vec();
            let mut shape = dims;
            shape[0] = range.len();
            quantized(bytes, dtype, shape)
        }
    }
}

/// Columns `range` of a 2-D weight; requantized to Q8_0 where the cut splits blocks.
pub(crate) fn slice_cols(w: &Weight, range: Range<usize>) -> Result<Weight> {
    match w {
        Weight::Dense(t) => Ok(Weight::Dense(
            t.narrow(1, range.start, range.len())?.contiguous()?,
        )),
        Weight::Quantized(q) => {
            let (rows, cols) = q.shape().dims2()?;
            let dtype = q.dtype();
            let bs = dtype.block_size();
            if range.start.is_multiple_of(bs) && range.end.is_multiple_of(bs) {
                let ts = dtype.type_size();
                let row_bytes = cols / bs * ts;
                let (a, b) = (range.start / bs * ts, range.end / bs * ts);
                let data = q.data()?;
                let mut bytes = Vec::with_capacity(rows * (b - a));
                for r in 0..rows {
                    bytes.extend_from_slice(&data[r * row_bytes + a..r * row_bytes + b]);
                }
                return quantized(bytes, dtype, vec![rows, range.len()]);
            }
            if !range.len().is_multiple_of(32) {
                return Err(ModelError::Invalid(format!(
                    "cannot cut columns {range:?} of a {dtype:?} matrix: not whole blocks of 32"
                )));
            }
            tracing::debug!(
                ?range,
                ?dtype,
                "column cut inside blocks: requantizing to Q8_0"
            );
            let dense = q.dequantize(&Device::Cpu)?;
            let part = dense.narrow(1, range.start, range.len())?.contiguous()?;
            Ok(Weight::Quantized(Arc::new(QTensor::quantize(
                &part,
                GgmlDType::Q8_0,
            )?)))
        }
    }
}

fn quantized(bytes: Vec<u8>, dtype: GgmlDType, shape: Vec<usize>) -> Result<Weight> {
    let storage = QStorage::from_data(Cow::Owned(bytes), &Device::Cpu, dtype)?;
    Ok(Weight::Quantized(Arc::new(QTensor::new(storage, shape)?)))
}

/// Rows `range` of a bias vector.
pub(crate) fn slice_bias(b: &Tensor, range: Range<usize>) -> Result<Tensor> {
    Ok(b.narrow(0, range.start, range.len())?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn splits_are_proportional_aligned_and_cover_everything() {
        assert_eq!(split_by(3, &[1.0, 1.0], 1), vec![0..2, 2..3]);
        assert_eq!(split_by(1536, &[1.0, 1.0], 256), vec![0..768, 768..1536]);
        assert_eq!(
            split_by(1536, &[1.0, 1.0, 1.0], 256),
            vec![0..512, 512..1024, 1024..1536]
        );
        // 4864 = 19 blocks of 256: the boundary lands on a block edge.
        let s = split_by(4864, &[1.0, 1.0], 256);
        assert!(s[0].end.is_multiple_of(256) && s[1].end == 4864, "{s:?}");
        // A fast rank takes more.
        let s = split_by(12, &[3.0, 1.0], 1);
        assert_eq!(s, vec![0..9, 9..12]);
        // Never an empty part.
        let s = split_by(2, &[100.0, 1.0], 1);
        assert_eq!(s, vec![0..1, 1..2]);
    }
}
