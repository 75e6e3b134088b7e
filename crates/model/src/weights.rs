//! One way to ask for a weight, whatever file format holds it.

use std::sync::Arc;

use candle_core::quantized::QTensor;
use candle_core::{DType, Device, Tensor};

use crate::{ModelConfig, Result};

/// A weight as stored: quantized blocks (GGUF) or a dense tensor (safetensors, or a
/// GGUF F32/F16 tensor once dequantized).
#[derive(Clone, Debug)]
pub enum Weight {
    Quantized(Arc<QTensor>),
    Dense(Tensor),
}

impl Weight {
    pub fn dims(&self) -> &[usize] {
        match self {
            Self::Quantized(q) => q.shape().dims(),
            Self::Dense(t) => t.dims(),
        }
    }

    /// The weight as an f32 tensor (norms, biases, and tests).
    pub fn to_f32(&self) -> Result<Tensor> {
        Ok(match self {
            Self::Quantized(q) => q.dequantize(&Device::Cpu)?,
            Self::Dense(t) => t.to_dtype(DType::F32)?,
        })
    }
}

/// A file format that can hand out a model's weights one by one, by their GGUF names
/// (`token_embd.weight`, `blk.3.attn_q.weight`, ...), reading only what is asked for.
pub trait WeightSource {
    /// The model's architecture facts, or why the source cannot describe a model.
    fn config(&self) -> Result<&ModelConfig>;

    /// The named weight, or `None` when the model does not have it (an optional bias,
    /// the output matrix of a model with tied embeddings).
    fn load(&self, name: &str) -> Result<Option<Weight>>;
}
