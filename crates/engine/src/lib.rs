//! The runner engine of one model on one process: loading a model and its tokenizer,
//! chunked prefill, the decode loop, sampling, stop conditions, perplexity scoring and
//! the local benchmark.
//!
//! The engine drives [`shoal_model::Model`] through its three entry points and owns the
//! KV caches; it knows nothing of clusters.

mod bench;
mod decoder;
mod engine;
mod error;
mod loader;
mod sampling;
mod score;
mod session;
mod stop;

pub use bench::{BenchConfig, BenchReport, Stats, peak_rss_bytes};
pub use decoder::{Decoded, Decoder};
pub use engine::{Engine, FinishReason, GenerateParams, Generation};
pub use error::{EngineError, Result};
pub use loader::{LoadOptions, gguf_vocab, model_config};
pub use sampling::{Sampler, SamplingParams};
pub use score::Perplexity;
pub use session::{LocalSession, Session};
pub use stop::StopMatcher;
