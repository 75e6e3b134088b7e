//! Where the decode kernels find a model's weights: device addresses of its bf16 rows and
//! GGUF blocks as candle's path loaded them, held alive for as long as the plan.

use std::sync::Arc;

use candle_core::cuda_backend::cudarc::driver::{CudaStream, DevicePtr};
use candle_core::quantized::{GgmlDType, QMatMul};
use candle_core::{DType, Storage, Tensor};

use crate::linear::Matrix;
use crate::{QLinear, Result};

use super::super::RmsNorm;
use super::gpu_err;

/// GGUF block types the quantized kernels read (matches `decode.cu`'s KIND_*).
fn quant_kind(dtype: GgmlDType) -> Option<i32> {
    match dtype {
        GgmlDType::Q8_0 => Some(0),
        GgmlDType::Q4K => Some(1),
        GgmlDType::Q6K => Some(2),
        _ => None,
    }
}

/// Device address of a contiguous tensor's first element.
pub(super) fn tensor_ptr(t: &Tensor, stream: &CudaStream) -> Result<u64> {
    if !t.is_contiguous() {
        return Err(gpu_err("tensor is not contiguous"));
    }
    let (storage, layout) = t.storage_and_layout();
    let Storage::Cuda(cs) = &*storage else {
        return Err(gpu_err("tensor is not on a CUDA device"));
    };
    let offset = (layout.start_offset() * t.dtype().size_in_bytes()) as u64;
    let base = match t.dtype() {
        DType::BF16 => cs.as_cuda_slice::<half::bf16>()?.device_ptr(stream).0,
        DType::F32 => cs.as_cuda_slice::<f32>()?.device_ptr(stream).0,
        other => return Err(gpu_err(format!("unexpected dtype {other:?}"))),
    };
    Ok(base + offset)
}

/// A matrix as the kernels read it. The tensor or blocks are held so the address stays
/// valid for as long as the plan.
#[derive(Clone)]
pub(super) enum Weights {
    Bf16 {
        ptr: u64,
        _keep: Tensor,
    },
    Quant {
        ptr: u64,
        kind: i32,
        blocks: Arc<candle_core::quantized::QTensor>,
    },
}

impl Weights {
    fn of(linear: &QLinear, stream: &CudaStream) -> Option<Self> {
        match linear.matrix() {
            Matrix::Candle(QMatMul::Tensor(t)) if t.dtype() == DType::BF16 => {
                let t = t.contiguous().ok()?;
                Some(Self::Bf16 {
                    ptr: tensor_ptr(&t, stream).ok()?,
                    _keep: t,
                })
            }
            Matrix::Candle(QMatMul::QTensor(q)) => {
                let kind = quant_kind(q.dtype())?;
                Some(Self::Quant {
                    ptr: q.device_ptr().ok()? as u64,
                    kind,
                    blocks: Arc::clone(q),
                })
            }
            _ => None,
        }
    }

    pub(super) fn is_quant(&self) -> bool {
        matches!(self, Self::Quant { .. })
    }

    pub(super) fn ptr(&self) -> u64 {
        match self {
            Self::Bf16 { ptr, .. } | Self::Quant { ptr, .. } => *ptr,
        }
    }

    /// Bytes of the matrix as stored (what a product streams).
    pub(super) fn bytes(&self, rows: i32, k: i32) -> u64 {
        match self {
            Self::Bf16 { .. } => rows as u64 * k as u64 * 2,
            Self::Quant { blocks, .. } => blocks.storage_size_in_bytes() as u64,
        }
    }

    pub(super) fn kind(&self) -> i32 {
        match self {
            Self::Bf16 { .. } => -1,
            Self::Quant { kind, .. } => *kind,
        }
    }
}

/// A linear layer: its weights, bias and shape.
#[derive(Clone)]
pub(super) struct Linear {
    pub(super) w: Weights,
    pub(super) bias: u64,
    pub(super) rows: i32,
    pub(super) k: i32,
}

impl Linear {
    /// The weights' address and bytes, for asking L2 for them ahead of their product.
    pub(super) fn span(&self) -> (u64, u64) {
        (self.w.ptr(), self.w.bytes(self.rows, self.k))
    }
}

pub(super) fn linear(l: &QLinear, stream: &CudaStream, keep: &mut Vec<Tensor>) -> Option<Linear> {
    let w = Weights::of(l, stream)?;
    let bias = match l.bias() {
        Some(b) => {
            let b = b.to_dtype(DType::BF16).ok()?.contiguous().ok()?;
            let p = tensor_ptr(&b, stream).ok()?;
            keep.push(b);
            p
        }
        None => 0,
    };
    Some(Linear {
        w,
        bias,
        rows: l.out_features() as i32,
        k: l.in_features() as i32,
    })
}

pub(super) fn norm_ptr(n: &RmsNorm, stream: &CudaStream) -> Option<u64> {
    (n.weight.dtype() == DType::BF16)
        .then(|| tensor_ptr(&n.weight, stream).ok())
        .flatten()
}
