//! Text in and out of a model: the tokenizer (byte-level BPE rebuilt from GGUF metadata,
//! or a Hugging Face `tokenizer.json`) and the chat template that turns a conversation
//! into the prompt the model was trained on.

mod chat;
mod tokenizer;
mod tool_calls;

pub use chat::{ChatMessage, ChatTemplate, FunctionCall, ToolCall};
pub use tokenizer::{GgufVocab, TextStream, Tokenizer};
pub use tool_calls::{ToolCallStream, ToolCallSyntax, ToolEvent};

/// Everything that can go wrong while building or using a tokenizer or a template.
#[derive(Debug, thiserror::Error)]
pub enum TokenizerError {
    #[error("unsupported tokenizer model {0:?} (shoal reads byte-level BPE, \"gpt2\")")]
    UnsupportedModel(String),
    #[error("tokenizer metadata is invalid: {0}")]
    Invalid(String),
    #[error("cannot read {path}: {message}")]
    Io { path: String, message: String },
    #[error("tokenizer failed: {0}")]
    Tokenizers(String),
    #[error("chat template failed: {0}")]
    Template(String),
}

impl From<tokenizers::Error> for TokenizerError {
    fn from(e: tokenizers::Error) -> Self {
        Self::Tokenizers(e.to_string())
    }
}

pub type Result<T, E = TokenizerError> = std::result::Result<T, E>;
