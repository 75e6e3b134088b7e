//! `QLinear`: the one matrix-multiply interface of the model code.
//!
//! Every projection in the transformer goes through here, so that the kernels behind it
//! (today candle's quantized dot products and its f32 gemm) can be replaced by shoal's
//! own without touching the architectures.

use candle_core::Tensor;
use candle_core::quantized::QMatMul;

use crate::{Result, Weight};

/// `y = x Wᵀ + b` with `W` stored as `(out_features, in_features)`, quantized or dense.
#[derive(Debug, Clone)]
pub struct QLinear {
    weight: QMatMul,
    bias: Option<Tensor>,
    in_features: usize,
    out_features: usize,
}

impl QLinear {
    pub fn new(weight: Weight, bias: Option<Tensor>) -> Result<Self> {
        let (out_features, in_features) = match weight.dims() {
            [o, i] => (*o, *i),
            dims => {
                return Err(crate::ModelError::Invalid(format!(
                    "a linear weight must be 2-D, got {dims:?}"
                )));
            }
        };
        let weight = match weight {
            Weight::Quantized(q) => QMatMul::from_arc(q)?,
            Weight::Dense(t) => QMatMul::Tensor(t),
        };
        Ok(Self {
            weight,
            bias,
            in_features,
            out_features,
        })
    }

    pub fn in_features(&self) -> usize {
        self.in_features
    }

    pub fn out_features(&self) -> usize {
        self.out_features
    }

    /// `x`: `(.., in_features)` f32; returns `(.., out_features)`.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let y = x.apply(&self.weight)?;
        Ok(match &self.bias {
            Some(b) => y.broadcast_add(b)?,
            None => y,
        })
    }
}
