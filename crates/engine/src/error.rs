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
    Candle(String),
}

impl From<candle_core::Error> for EngineError {
    fn from(e: candle_core::Error) -> Self {
        Self::Candle(shoal_model::candle_message(&e))
    }
}

pub type Result<T, E = EngineError> = std::result::Result<T, E>;
