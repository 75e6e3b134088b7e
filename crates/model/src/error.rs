//! The model crate's error type.

use std::path::PathBuf;

/// Everything that can go wrong while opening or running a model.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    #[error("cannot read {path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{path} is not a GGUF file (magic {magic:?}, expected \"GGUF\")")]
    NotGguf { path: PathBuf, magic: [u8; 4] },
    #[error("{path} is truncated: tensor {tensor} ends at byte {end}, the file has {len}")]
    Truncated {
        path: PathBuf,
        tensor: String,
        end: u64,
        len: u64,
    },
    #[error("cannot parse {path}: {message}")]
    Format { path: PathBuf, message: String },
    #[error(
        "{path} uses an unsupported tensor block type (GGML type {type_id}); shoal reads F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 and Q2_K to Q6_K"
    )]
    UnsupportedBlockType { path: PathBuf, type_id: String },
    #[error("unsupported architecture {0:?} (shoal runs llama, qwen2 and qwen3)")]
    UnsupportedArchitecture(String),
    #[error("model metadata is missing {0}")]
    MissingMetadata(String),
    #[error("a peer rank failed: {0}")]
    Link(String),
    #[error("model has no tensor {0}")]
    MissingTensor(String),
    #[error("tensor {name} has shape {actual:?}, expected {expected:?}")]
    Shape {
        name: String,
        actual: Vec<usize>,
        expected: Vec<usize>,
    },
    #[error("sequence of {positions} positions exceeds the context of {context}")]
    ContextFull { positions: usize, context: usize },
    #[error("{0}")]
    Invalid(String),
    #[error("tensor operation failed: {0}")]
    Candle(String),
}

/// The first line of a candle error: candle appends a backtrace when `RUST_BACKTRACE` is
/// set, which has no place in a one-line error for the user.
pub fn candle_message(e: &candle_core::Error) -> String {
    e.to_string()
        .lines()
        .next()
        .unwrap_or("")
        .trim()
        .to_string()
}

impl From<candle_core::Error> for ModelError {
    fn from(e: candle_core::Error) -> Self {
        Self::Candle(candle_message(&e))
    }
}

pub type Result<T, E = ModelError> = std::result::Result<T, E>;
