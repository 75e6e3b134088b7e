//! The engine's error type.

/// What can go wrong while loading or running a model.
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    #[error(transparent)]
    Model(#[from] shoal_model::ModelError),
    #[error(transparent)]
    Tokenizer(#[from] shoal_tokenizer::TokenizerError),
    #[error("prompt is {prompt} tokens but the context holds {context}")]
    PromptTooLong { prompt: usize, context: usize },
    #[error("prompt is empty")]
    EmptyPrompt,
    #[error("{0}")]
    Invalid(String),
    #[error("tensor operation failed: {0}")]
    Candle(#[from] candle_core::Error),
}

pub type Result<T, E = EngineError> = std::result::Result<T, E>;
