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
pub use linear::{KernelChoice, QLinear};
pub use safetensors::SafetensorsDir;
pub use shard::{ShardLinks, TensorSlice, tensor_slices};
pub use transformer::{LoadSpec, Model, zigzag_pieces};
pub use weights::{Weight, WeightSource};

pub use candle_core::{Device, Tensor};
