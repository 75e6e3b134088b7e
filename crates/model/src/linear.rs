//! `QLinear`: the one matrix-multiply interface of the model code.
//!
//! Every projection in the transformer goes through here, so the kernels behind it can
//! change without touching the architectures. Quantized weights of the block types
//! shoal's own kernels read (Q4_0, Q4_1, Q5_0, Q8_0, Q4_K, Q6_K) run on `shoal-kernels`;
//! other block types and dense weights run on candle (its quantized dot products, its
//! f32 gemm). `SHOAL_KERNELS=candle` sends everything to candle, to compare.

use std::sync::Arc;

use candle_core::quantized::{GgmlDType, QMatMul, QStorage, QTensor};
use candle_core::{DType, Device, Tensor};
use shoal_kernels::{BlockType, QuantMatrix};

use crate::{ModelError, Result, Weight};

/// Which kernels run quantized matrix products.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KernelChoice {
    /// shoal's own kernels where the block type allows (the default).
    Shoal,
    /// candle's quantized matmul everywhere (the previous kernels).
    Candle,
    /// Weights dequantized to f32 at load and f32 activations (and keys and values kept
    /// in f32): no activation rounding,
    /// so results do not depend on how tokens are batched or summed. Four to eight times
    /// the memory and slow; for checking numerics, not for serving.
    Dense,
}

impl KernelChoice {
    /// From `SHOAL_KERNELS` (`shoal`, `candle` or `dense`), default `Shoal`.
    pub fn from_env() -> Self {
        match std::env::var("SHOAL_KERNELS").as_deref() {
            Ok("candle") => Self::Candle,
            Ok("dense") => Self::Dense,
            _ => Self::Shoal,
        }
    }
}

fn block_type(dtype: GgmlDType) -> Option<BlockType> {
    Some(match dtype {
        GgmlDType::Q4_0 => BlockType::Q4_0,
        GgmlDType::Q4_1 => BlockType::Q4_1,
        GgmlDType::Q5_0 => BlockType::Q5_0,
        GgmlDType::Q8_0 => BlockType::Q8_0,
        GgmlDType::Q4K => BlockType::Q4K,
        GgmlDType::Q6K => BlockType::Q6K,
        _ => return None,
    })
}

/// The weight of a projection in the form its kernel wants.
#[derive(Debug, Clone)]
pub(crate) enum Matrix {
    Shoal(Arc<QuantMatrix>),
    Candle(QMatMul),
}

impl Matrix {
    /// Converts a loaded weight. A quantized tensor of a block type shoal's kernels read
    /// is copied into a [`QuantMatrix`] (the candle tensor is then dropped by the caller).
    pub fn from_weight(weight: Weight, kernels: KernelChoice) -> Result<Self> {
        if kernels == KernelChoice::Dense {
            return Ok(Self::Candle(QMatMul::Tensor(weight.to_f32()?)));
        }
        match weight {
            Weight::Quantized(q) => match shoal_matrix(&q, kernels)? {
                Some(m) => Ok(Self::Shoal(Arc::new(m))),
                None => Ok(Self::Candle(QMatMul::from_arc(q)?)),
            },
            Weight::Dense(t) => Ok(Self::Candle(QMatMul::Tensor(t))),
        }
    }
}

/// The tensor as a [`QuantMatrix`] when shoal's kernels read its block type (and are
/// chosen), `None` otherwise.
pub(crate) fn shoal_matrix(q: &QTensor, kernels: KernelChoice) -> Result<Option<QuantMatrix>> {
    let Some(ty) = block_type(q.dtype()).filter(|_| kernels == KernelChoice::Shoal) else {
        return Ok(None);
    };
    let (rows, cols) = q.shape().dims2()?;
    QuantMatrix::from_bytes(ty, rows, cols, &q.data()?)
        .map(Some)
        .map_err(|e| ModelError::Invalid(e.to_string()))
}

/// `y = x Wᵀ + b` with `W` stored as `(out_features, in_features)`, quantized or dense.
#[derive(Debug, Clone)]
pub struct QLinear {
    weight: Matrix,
    bias: Option<Tensor>,
    in_features: usize,
    out_features: usize,
}

impl QLinear {
    pub fn new(weight: Weight, bias: Option<Tensor>) -> Result<Self> {
        let (out_features, in_features) = match weight.dims() {
            [o, i] => (*o, *i),
            dims => {
                return Err(ModelError::Invalid(format!(
                    "a linear weight must be 2-D, got {dims:?}"
                )));
            }
        };
        let weight = Matrix::from_weight(weight, KernelChoice::from_env())?;
        Ok(Self::from_matrix(weight, bias, in_features, out_features))
    }

    /// A projection on `compute`'s device. On the CPU: [`QLinear::new`]. On a GPU:
    /// quantized weights stay quantized there (candle's CUDA kernels; activations go in
    /// as f32), dense weights are kept in `compute.dtype`.
    pub fn new_on(weight: Weight, bias: Option<Tensor>, compute: &crate::Compute) -> Result<Self> {
        if compute.device.is_cpu() {
            return Self::new(weight, bias);
        }
        let (out_features, in_features) = match weight.dims() {
            [o, i] => (*o, *i),
            dims => {
                return Err(ModelError::Invalid(format!(
                    "a linear weight must be 2-D, got {dims:?}"
                )));
            }
        };
        let matrix = match weight {
            Weight::Quantized(q)
                if !matches!(q.dtype(), GgmlDType::F32 | GgmlDType::F16 | GgmlDType::BF16) =>
            {
                let storage = QStorage::from_data(q.data()?, &compute.device, q.dtype())?;
                let on_device = QTensor::new(storage, q.shape().clone())?;
                Matrix::Candle(QMatMul::from_arc(Arc::new(on_device))?)
            }
            other => Matrix::Candle(QMatMul::Tensor(
                other
                    .to_f32()?
                    .to_dtype(compute.dtype)?
                    .to_device(&compute.device)?,
            )),
        };
        let bias = bias
            .map(|b| b.to_dtype(compute.dtype)?.to_device(&compute.device))
            .transpose()?;
        Ok(Self::from_matrix(matrix, bias, in_features, out_features))
    }

    pub(crate) fn from_matrix(
        weight: Matrix,
        bias: Option<Tensor>,
        in_features: usize,
        out_features: usize,
    ) -> Self {
        Self {
            weight,
            bias,
            in_features,
            out_features,
        }
    }

    /// The weights as loaded (the GPU decode path reads them in place).
    #[cfg(feature = "cuda")]
    pub(crate) fn matrix(&self) -> &Matrix {
        &self.weight
    }

    #[cfg(feature = "cuda")]
    pub(crate) fn bias(&self) -> Option<&Tensor> {
        self.bias.as_ref()
    }

    pub fn in_features(&self) -> usize {
        self.in_features
    }

    pub fn out_features(&self) -> usize {
        self.out_features
    }

    /// Several projections of the same input (`x`: `(.., in_features)` f32), one output
    /// each. When shoal's kernels hold them all, one `matmul_many` call (for a single
    /// token: one activation quantization, one hand-out to the threads); otherwise one
    /// [`QLinear::forward`] each.
    pub fn forward_many(linears: &[&QLinear], x: &Tensor) -> Result<Vec<Tensor>> {
        let mut dims = x.dims().to_vec();
        let k = dims.pop().unwrap_or(0);
        let t = dims.iter().product::<usize>();
        let matrices: Option<Vec<&QuantMatrix>> = linears
            .iter()
            .map(|l| match &l.weight {
                Matrix::Shoal(m) if l.in_features == k => Some(m.as_ref()),
                _ => None,
            })
            .collect();
        let Some(matrices) = matrices.filter(|_| x.dtype() == DType::F32) else {
            return linears.iter().map(|l| l.forward(x)).collect();
        };
        let mut outs: Vec<Vec<f32>> = linears
            .iter()
            .map(|l| vec![0f32; t * l.out_features])
            .collect();
        let mut views: Vec<&mut [f32]> = outs.iter_mut().map(|o| o.as_mut_slice()).collect();
        with_values(x, |xs| {
            shoal_kernels::matmul_many(&matrices, xs, t, &mut views)
        })?;
        linears
            .iter()
            .zip(outs)
            .map(|(l, out)| {
                let mut shape = dims.clone();
                shape.push(l.out_features);
                l.add_bias(Tensor::from_vec(out, shape, &Device::Cpu)?)
            })
            .collect()
    }

    fn add_bias(&self, y: Tensor) -> Result<Tensor> {
        Ok(match &self.bias {
            Some(b) => y.broadcast_add(b)?,
            None => y,
        })
    }

    /// `x`: `(.., in_features)` f32; returns `(.., out_features)`.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let y = self.forward_without_bias(x)?;
        self.add_bias(y)
    }

    /// [`QLinear::forward`] less the bias (a kernel that follows adds it).
    pub(crate) fn forward_without_bias(&self, x: &Tensor) -> Result<Tensor> {
        #[cfg(feature = "cuda")]
        if let Matrix::Candle(QMatMul::QTensor(q)) = &self.weight
            && crate::transformer::gpu_prefill::applies(x.device(), x.dtype())
            && x.elem_count() / self.in_features.max(1)
                >= crate::transformer::gpu_prefill::DEQUANT_MIN_ROWS
            && let Some(w) = crate::transformer::gpu_prefill::dequantize(q)?
        {
            return Ok(x.apply(&QMatMul::Tensor(w))?);
        }
        Ok(match &self.weight {
            // candle's quantized kernels take f32 activations.
            Matrix::Candle(m @ QMatMul::QTensor(_)) if x.dtype() != DType::F32 => {
                x.to_dtype(DType::F32)?.apply(m)?.to_dtype(x.dtype())?
            }
            Matrix::Candle(m) => x.apply(m)?,
            Matrix::Shoal(m) => {
                let mut dims = x.dims().to_vec();
                let k = dims.pop().unwrap_or(0);
                if k != self.in_features {
                    return Err(ModelError::Invalid(format!(
                        "input has {k} features, the projection takes {}",
                        self.in_features
                    )));
                }
                let t = dims.iter().product::<usize>();
                let mut out = vec![0f32; t * self.out_features];
                with_values(x, |xs| shoal_kernels::matmul(m, xs, t, &mut out))?;
                dims.push(self.out_features);
                Tensor::from_vec(out, dims, &Device::Cpu)?
            }
        })
    }
}

/// A tensor's f32 values in order where they lie contiguous in CPU memory, borrowed
/// (from `Tensor::storage_and_layout`); `None` elsewhere, for other types, or when not
/// contiguous.
pub fn cpu_values<'s>(
    storage: &'s candle_core::Storage,
    layout: &candle_core::Layout,
) -> Option<&'s [f32]> {
    let candle_core::Storage::Cpu(c) = storage else {
        return None;
    };
    let (start, end) = layout.contiguous_offsets()?;
    c.as_slice::<f32>().ok()?.get(start..end)
}

/// Runs a kernel on `x`'s f32 values: borrowed where they lie contiguous in CPU memory
/// (a batched step's activations, every projection), else copied out.
fn with_values(
    x: &Tensor,
    kernel: impl FnOnce(&[f32]) -> std::result::Result<(), shoal_kernels::KernelError>,
) -> Result<()> {
    let (storage, layout) = x.storage_and_layout();
    let done = match cpu_values(&storage, layout) {
        Some(xs) => kernel(xs),
        None => {
            drop(storage);
            kernel(&x.flatten_all()?.to_vec1::<f32>()?)
        }
    };
    done.map_err(|e| ModelError::Invalid(e.to_string()))
}
