//! shoal's model code: the transformer architectures shoal serves (`llama`, `qwen2`,
//! `qwen3`), written on candle so that a process can hold any part of a model.
//!
//! The model is split into three entry points that a shard can hold independently:
//! [`Model::embed`] (token ids to hidden states), [`Model::forward_layers`] (a contiguous
//! range of decoder layers) and [`Model::head`] (final norm and logits). The KV cache is
//! a separate value ([`KvCache`]) owned by the caller, so the engine decides what lives
//! how long. Weights come from GGUF files or Hugging Face safetensors directories through
//! one [`WeightSource`] trait, and every matrix multiply goes through [`QLinear`], the one
//! interface that shoal's own CPU kernels replace.

mod cache;
mod config;
mod error;
pub mod gguf;
mod kv8;
mod linear;
mod safetensors;
mod shard;
pub mod synthetic;
mod transformer;
mod weights;

pub use cache::KvCache;
pub use config::{Architecture, ModelConfig, RopeStyle};
pub use error::{ModelError, Result, candle_message};
pub use gguf::GgufFile;
pub use linear::{KernelChoice, QLinear, cpu_values};
pub use safetensors::SafetensorsDir;
pub use shard::{ShardLinks, TensorSlice, all_reduce_through_host, tensor_slices};
pub use transformer::{BatchPart, GpuDecode, LoadSpec, Model, device_argmax, zigzag_pieces};
pub use weights::{Weight, WeightSource};

pub use candle_core::{DType, Device, Tensor};

/// Where a model computes and in which floating-point type its activations, caches and
/// dense weights are kept.
#[derive(Clone, Debug)]
pub struct Compute {
    pub device: Device,
    pub dtype: DType,
}

impl Compute {
    /// The CPU in f32 (shoal's kernels).
    pub fn cpu() -> Self {
        Self {
            device: Device::Cpu,
            dtype: DType::F32,
        }
    }

    /// `cpu`, or `cuda:N` (bf16), as `--device` spells it.
    pub fn parse(spec: &str) -> Result<Self> {
        if spec == "cpu" {
            return Ok(Self::cpu());
        }
        let ordinal = match spec.strip_prefix("cuda") {
            Some("") => 0,
            Some(rest) => rest
                .strip_prefix(':')
                .and_then(|n| n.parse::<usize>().ok())
                .ok_or_else(|| {
                    ModelError::Invalid(format!("bad device {spec:?}: cpu or cuda:N"))
                })?,
            None => {
                return Err(ModelError::Invalid(format!(
                    "bad device {spec:?}: cpu or cuda:N"
                )));
            }
        };
        let device = Device::new_cuda(ordinal).map_err(|e| {
            ModelError::Invalid(format!(
                "cannot use {spec}: {} (a CUDA build is `scripts/build-cuda.sh`)",
                candle_message(&e)
            ))
        })?;
        Ok(Self {
            device,
            dtype: DType::BF16,
        })
    }
}
