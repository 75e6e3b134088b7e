//! The protocol between a node and its runner, over the runner's control socket: one JSON
//! object per line, typed on both ends by these enums. Requests and answers carry the
//! node's request id, so many requests are in flight at once and each can be cancelled
//! in whatever state it is.

use serde::{Deserialize, Serialize};
use shoal_cluster::RunnerStatus;
pub use shoal_engine::FinishReason;
use shoal_engine::{GenerateParams, SamplingParams};
pub use shoal_tokenizer::{ChatMessage, ToolCall};

/// Node → runner.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum ToRunner {
    Generate {
        id: u64,
        /// Boxed: a request is far bigger than the other messages.
        request: Box<GenerateRequest>,
    },
    /// The client went away or asked to stop: free the sequence, whatever its state.
    Cancel { id: u64 },
}

/// Runner → node.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum FromRunner {
    Status {
        status: RunnerStatus,
    },
    /// Every second, from a thread of its own: the node tells a frozen runner from a busy
    /// one.
    Heartbeat,
    Text {
        id: u64,
        text: String,
    },
    /// A call the model made of a function the request offered (read out of its text,
    /// which is not sent as text).
    ToolCall {
        id: u64,
        call: ToolCall,
    },
    Done {
        id: u64,
        finish_reason: FinishReason,
        usage: Usage,
        timings: Timings,
    },
    Error {
        id: u64,
        kind: ErrorKind,
        message: String,
    },
    /// Rank 0's sequences, whenever they change: admitted ones (of which `prefilling`
    /// are still reading their prompt), and requests waiting for room.
    Load {
        running: usize,
        prefilling: usize,
        waiting: usize,
    },
}

/// What a request asks for: a user message rendered with the model's chat template (or
/// raw text), and how to sample.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GenerateRequest {
    /// One user turn (with `system`), or raw text with `raw`; ignored when `messages`
    /// holds a conversation.
    #[serde(default)]
    pub prompt: String,
    /// A whole conversation (system, user, assistant turns), rendered by the model's
    /// chat template.
    #[serde(default)]
    pub messages: Vec<ChatMessage>,
    /// The prompt as raw text, without the chat template.
    #[serde(default)]
    pub raw: bool,
    /// The prompt as token ids, taken as they are (no template, no BOS added); wins over
    /// `prompt` and `messages`. Benchmarks use it for prompts of an exact length.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub prompt_ids: Vec<u32>,
    #[serde(default)]
    pub system: Option<String>,
    #[serde(default = "default_max_tokens")]
    pub max_tokens: usize,
    /// `max_tokens` is the client's own: a prompt and answer past the context are refused
    /// (as OpenAI and Anthropic do) rather than the answer cut short to fit.
    #[serde(default)]
    pub must_fit: bool,
    /// Only count the prompt's tokens (as the template renders it, tools included): the
    /// answer is a `Done` whose usage says how many, with no text and nothing computed.
    #[serde(default)]
    pub count_only: bool,
    #[serde(default)]
    pub temperature: f32,
    #[serde(default)]
    pub top_k: usize,
    #[serde(default = "one")]
    pub top_p: f32,
    #[serde(default)]
    pub min_p: f32,
    #[serde(default = "one")]
    pub repetition_penalty: f32,
    /// OpenAI's presence and frequency penalties (0: off).
    #[serde(default)]
    pub presence_penalty: f32,
    #[serde(default)]
    pub frequency_penalty: f32,
    #[serde(default)]
    pub seed: u64,
    #[serde(default)]
    pub stop: Vec<String>,
    /// Functions the model may call, in OpenAI's shape (`{"type": "function",
    /// "function": {"name", "description", "parameters"}}`), rendered by the chat
    /// template; the model's calls come back as `ToolCall`s.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tools: Vec<serde_json::Value>,
    /// Which model (the node routes by it; the runner ignores it).
    #[serde(default)]
    pub model: Option<String>,
}

fn default_max_tokens() -> usize {
    256
}

fn one() -> f32 {
    1.0
}

impl GenerateRequest {
    /// A request for `prompt` with the defaults.
    pub fn new(prompt: impl Into<String>) -> Self {
        Self {
            prompt: prompt.into(),
            messages: Vec::new(),
            raw: false,
            prompt_ids: Vec::new(),
            system: None,
            max_tokens: default_max_tokens(),
            must_fit: false,
            count_only: false,
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            repetition_penalty: 1.0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            seed: 0,
            stop: Vec::new(),
            tools: Vec::new(),
            model: None,
        }
    }

    /// The engine's parameters for this request.
    pub fn params(&self, prefill_chunk: usize) -> GenerateParams {
        GenerateParams {
            max_tokens: self.max_tokens,
            stop: self.stop.clone(),
            sampling: SamplingParams {
                temperature: self.temperature,
                top_k: self.top_k,
                top_p: self.top_p,
                min_p: self.min_p,
                repetition_penalty: self.repetition_penalty,
                presence_penalty: self.presence_penalty,
                frequency_penalty: self.frequency_penalty,
                seed: self.seed,
                ..SamplingParams::default()
            },
            prefill_chunk,
            shown_tokens: Vec::new(),
        }
    }
}

/// Tokens of one answer.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Usage {
    pub prompt_tokens: usize,
    /// Prompt tokens whose keys and values came from the prefix cache.
    pub cached_tokens: usize,
    pub completion_tokens: usize,
}

/// Where one answer's time went, in milliseconds.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Timings {
    /// Waiting to be admitted (the batch was full, or its memory did not fit).
    pub queued_ms: f64,
    /// From admission to the first token.
    pub prefill_ms: f64,
    /// From the first token to the last.
    pub decode_ms: f64,
}

/// Why a request failed, for the node to map onto a status code.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ErrorKind {
    /// The request itself is wrong (an empty prompt, one past the context).
    Invalid,
    /// The runner's queue is full: try again later.
    Busy,
    /// The instance failed (a rank is gone); it is placed again.
    Broken,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_round_trip_as_one_json_line_each() {
        let msgs = [
            FromRunner::Heartbeat,
            FromRunner::Text {
                id: 3,
                text: "a\nb".into(),
            },
            FromRunner::Done {
                id: 3,
                finish_reason: FinishReason::Length,
                usage: Usage {
                    prompt_tokens: 5,
                    cached_tokens: 0,
                    completion_tokens: 7,
                },
                timings: Timings::default(),
            },
            FromRunner::Error {
                id: 4,
                kind: ErrorKind::Busy,
                message: "full".into(),
            },
            FromRunner::Status {
                status: RunnerStatus::Loading(0.5),
            },
        ];
        for m in msgs {
            let line = serde_json::to_string(&m).expect("json");
            assert!(!line.contains('\n'));
            assert_eq!(serde_json::from_str::<FromRunner>(&line).expect("back"), m);
        }
        let g = ToRunner::Generate {
            id: 1,
            request: Box::new(GenerateRequest::new("hi")),
        };
        let line = serde_json::to_string(&g).expect("json");
        assert_eq!(serde_json::from_str::<ToRunner>(&line).expect("back"), g);
    }

    #[test]
    fn requests_with_wrong_types_or_unknown_fields_are_refused() {
        let ok: GenerateRequest =
            serde_json::from_str(r#"{"prompt": "hi", "max_tokens": 5}"#).expect("ok");
        assert_eq!(ok.max_tokens, 5);
        assert_eq!(ok.top_p, 1.0);
        let chat: GenerateRequest = serde_json::from_str(
            r#"{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}"#,
        )
        .expect("a conversation");
        assert_eq!(chat.messages[0].content, "hi");
        for bad in [
            r#"{"prompt": "hi", "max_tokens": "x"}"#,
            r#"{"messages": "hi"}"#,
            r#"{"prompt": "hi", "n": 2}"#,
            r#"{"prompt": 7}"#,
        ] {
            assert!(
                serde_json::from_str::<GenerateRequest>(bad).is_err(),
                "{bad}"
            );
        }
    }
}
