//! Generation: chunked prefill, the decode loop, and its stop conditions.

use std::sync::Arc;
use std::time::Instant;

use candle_core::Tensor;
use serde::{Deserialize, Serialize};
use shoal_model::Model;
use shoal_tokenizer::{ChatMessage, Tokenizer};

use crate::{Decoder, EngineError, LocalSession, Result, SamplingParams, Session};

/// What to generate and when to stop.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct GenerateParams {
    pub max_tokens: usize,
    pub stop: Vec<String>,
    pub sampling: SamplingParams,
    /// The most prompt tokens one forward pass takes (bounds prefill memory).
    pub prefill_chunk: usize,
    /// Special tokens written into the text rather than left out (the tags a tool-call
    /// reader looks for).
    pub shown_tokens: Vec<String>,
}

impl Default for GenerateParams {
    fn default() -> Self {
        Self {
            max_tokens: 256,
            stop: Vec::new(),
            sampling: SamplingParams::default(),
            prefill_chunk: 256,
            shown_tokens: Vec::new(),
        }
    }
}

/// Why generation ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FinishReason {
    /// An end-of-turn token or a stop string.
    Stop,
    /// `max_tokens`, or the context is full.
    Length,
    /// The caller stopped listening.
    Cancelled,
    /// The answer ends in calls of the functions the request offered (set by the server
    /// that reads the calls out of the text).
    ToolCalls,
    /// The model wrote a call that does not parse; the answer holds it as text.
    MalformedToolCall,
}

/// The outcome of one generation.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Generation {
    pub text: String,
    pub tokens: Vec<u32>,
    pub prompt_tokens: usize,
    pub finish_reason: FinishReason,
    pub prefill_secs: f64,
    pub decode_secs: f64,
}

/// A model with its tokenizer, ready to generate.
pub struct Engine {
    model: Arc<Model>,
    tokenizer: Tokenizer,
}

impl Engine {
    pub fn new(model: Model, tokenizer: Tokenizer) -> Self {
        Self {
            model: Arc::new(model),
            tokenizer,
        }
    }

    pub fn model(&self) -> &Model {
        &self.model
    }

    /// The model, shared (a split model's rank 0 computes with it while the engine
    /// tokenizes and samples).
    pub fn shared_model(&self) -> Arc<Model> {
        Arc::clone(&self.model)
    }

    pub fn tokenizer(&self) -> &Tokenizer {
        &self.tokenizer
    }

    /// The most positions (prompt and answer) a sequence may use.
    pub fn context_length(&self) -> usize {
        self.model.max_len()
    }

    /// Renders a conversation with the model's chat template and tokenizes it.
    pub fn chat_prompt(&self, messages: &[ChatMessage]) -> Result<Vec<u32>> {
        self.chat_prompt_with_tools(messages, &[])
    }

    /// Renders a conversation and the functions the model may call (OpenAI's shape).
    pub fn chat_prompt_with_tools(
        &self,
        messages: &[ChatMessage],
        tools: &[serde_json::Value],
    ) -> Result<Vec<u32>> {
        let text = self
            .tokenizer
            .chat_template()
            .render(messages, tools, true)?;
        self.text_prompt_with_template_bos(&text)
    }

    fn text_prompt_with_template_bos(&self, text: &str) -> Result<Vec<u32>> {
        let ids = self.tokenizer.encode(text, false)?;
        // Templates that write BOS themselves must not get a second one.
        let starts_with_bos = ids
            .first()
            .is_some_and(|first| Some(*first) == self.tokenizer.bos_id());
        if self.tokenizer.add_bos() && !starts_with_bos {
            let mut with = Vec::with_capacity(ids.len() + 1);
            with.extend(self.tokenizer.bos_id());
            with.extend(ids);
            return Ok(with);
        }
        Ok(ids)
    }

    /// Tokenizes raw text as a prompt (no template; the model's BOS rule).
    pub fn raw_prompt(&self, text: &str) -> Result<Vec<u32>> {
        self.text_prompt_with_template_bos(text)
    }

    /// Refuses prompts the context cannot hold.
    pub fn check_prompt(&self, prompt: &[u32]) -> Result<()> {
        if prompt.is_empty() {
            return Err(EngineError::EmptyPrompt);
        }
        if prompt.len() > self.context_length() {
            return Err(EngineError::PromptTooLong {
                prompt: prompt.len(),
                context: self.context_length(),
            });
        }
        Ok(())
    }

    /// A fresh sequence on this engine's model.
    pub fn session(&self) -> LocalSession<'_> {
        LocalSession::new(&self.model)
    }

    /// Runs `tokens` through `session` in chunks of at most `chunk` positions; returns the
    /// logits `(1, vocab)` after the last token.
    pub fn prefill_in(
        &self,
        session: &mut dyn Session,
        tokens: &[u32],
        chunk: usize,
    ) -> Result<Tensor> {
        if tokens.is_empty() {
            return Err(EngineError::EmptyPrompt);
        }
        let chunk = chunk.max(1);
        let mut logits = None;
        let pieces = tokens.len().div_ceil(chunk);
        for (i, piece) in tokens.chunks(chunk).enumerate() {
            let _span =
                tracing::debug_span!("prefill_chunk", index = i, tokens = piece.len()).entered();
            if i + 1 < pieces {
                // Only the last chunk's logits are wanted: the head is skipped before it.
                session.append(piece)?;
            } else {
                logits = Some(session.forward(piece, false)?);
            }
        }
        logits.ok_or(EngineError::EmptyPrompt)
    }

    /// Generates a continuation of `prompt`, handing each piece of text to `on_text` as
    /// soon as it is final; `on_text` returns false to cancel.
    pub fn generate(
        &self,
        prompt: &[u32],
        params: &GenerateParams,
        on_text: &mut dyn FnMut(&str) -> bool,
    ) -> Result<Generation> {
        self.generate_in(&mut self.session(), prompt, params, on_text)
    }

    /// [`Engine::generate`] on a given session (a model split across ranks); the session
    /// is reset first.
    pub fn generate_in(
        &self,
        session: &mut dyn Session,
        prompt: &[u32],
        params: &GenerateParams,
        on_text: &mut dyn FnMut(&str) -> bool,
    ) -> Result<Generation> {
        self.check_prompt(prompt)?;
        session.reset()?;
        let mut decoder = Decoder::new(self, prompt, params);
        let mut text = String::new();
        let started = Instant::now();
        let mut logits = self.prefill_in(session, prompt, params.prefill_chunk)?;
        let prefill_secs = started.elapsed().as_secs_f64();
        let decode_started = Instant::now();
        // Until the session says it has no greedy path (then stepping here throughout).
        let mut try_greedy = decoder.is_greedy();
        while decoder.finished().is_none() {
            let step = decoder.step(&logits)?;
            text.push_str(&step.text);
            if !step.text.is_empty() && !on_text(&step.text) {
                text.push_str(&decoder.cancel());
                break;
            }
            let Some(next) = step.next else { break };
            if try_greedy {
                // The rest where the model chooses each token itself (a GPU's chained
                // steps: no host round trip between tokens); the sink stops it on any end.
                let mut failed = None;
                let n = decoder.remaining();
                let chained =
                    session.greedy(next, n, &mut |token| match decoder.accept(token) {
                        Ok(step) => {
                            text.push_str(&step.text);
                            if !step.text.is_empty() && !on_text(&step.text) {
                                text.push_str(&decoder.cancel());
                                return false;
                            }
                            step.next.is_some()
                        }
                        Err(e) => {
                            failed = Some(e);
                            false
                        }
                    })?;
                if let Some(e) = failed {
                    return Err(e);
                }
                if chained.is_some() {
                    break;
                }
                try_greedy = false;
            }
            logits = session.forward(&[next], false)?;
        }
        let finish = decoder.finished().unwrap_or(FinishReason::Length);
        let generated = decoder.generated().to_vec();
        Ok(Generation {
            text,
            tokens: generated,
            prompt_tokens: prompt.len(),
            finish_reason: finish,
            prefill_secs,
            decode_secs: decode_started.elapsed().as_secs_f64(),
        })
    }
}
