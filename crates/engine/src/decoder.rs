//! One sequence's decoding: from each forward step's logits to the next token and the
//! text it makes final, with sampling, end-of-turn tokens, stop strings and the token
//! budget. [`Engine::generate_in`] runs one over a session; a scheduler that batches many
//! sequences runs one per sequence and feeds each its row of the batch's logits.

use candle_core::Tensor;
use shoal_tokenizer::TextStream;

use crate::{Engine, FinishReason, GenerateParams, Result, Sampler, StopMatcher};

/// What one step of decoding produced.
#[derive(Clone, Debug, PartialEq)]
pub struct Decoded {
    /// The token to feed the model next; `None` once the sequence has finished.
    pub next: Option<u32>,
    /// Text that became final with this step (may be empty).
    pub text: String,
}

/// The decoding state of one sequence.
pub struct Decoder<'e> {
    engine: &'e Engine,
    sampler: Sampler,
    stops: StopMatcher,
    stream: TextStream<'e>,
    history: Vec<u32>,
    prompt_len: usize,
    generated: Vec<u32>,
    budget: usize,
    finished: Option<FinishReason>,
}

impl<'e> Decoder<'e> {
    /// A decoder for a continuation of `prompt` (already checked against the context).
    pub fn new(engine: &'e Engine, prompt: &[u32], params: &GenerateParams) -> Self {
        let budget = params
            .max_tokens
            .min(engine.context_length().saturating_sub(prompt.len()));
        Self {
            engine,
            sampler: Sampler::new(params.sampling.clone()),
            stops: StopMatcher::new(&params.stop),
            stream: {
                let t = engine.tokenizer();
                let shown: Vec<u32> = params
                    .shown_tokens
                    .iter()
                    .filter_map(|s| t.token_to_id(s))
                    .collect();
                t.stream_showing(&shown)
            },
            history: prompt.to_vec(),
            prompt_len: prompt.len(),
            generated: Vec::new(),
            budget,
            finished: (budget == 0).then_some(FinishReason::Length),
        }
    }

    /// Why the sequence ended, once it has.
    pub fn finished(&self) -> Option<FinishReason> {
        self.finished
    }

    /// The tokens generated so far.
    pub fn generated(&self) -> &[u32] {
        &self.generated
    }

    pub fn prompt_len(&self) -> usize {
        self.prompt_len
    }

    /// Picks the next token from `logits` (`(1, vocab)` or `(vocab,)`) and says what text
    /// it makes final.
    pub fn step(&mut self, logits: &Tensor) -> Result<Decoded> {
        if self.finished.is_some() {
            return Ok(Decoded {
                next: None,
                text: String::new(),
            });
        }
        let logits = if logits.rank() == 2 {
            logits.squeeze(0)?
        } else {
            logits.clone()
        };
        let greedy = self.sampler.params().is_greedy();
        let on_device = if greedy {
            shoal_model::device_argmax(&logits)?
        } else {
            None
        };
        let next = if let Some(ids) = on_device {
            // On a GPU: the arg-max there, one id back instead of the whole row.
            ids[0]
        } else if greedy && !logits.device().is_cpu() {
            logits.argmax(0)?.to_scalar::<u32>()?
        } else if let Some(next) = greedy.then(|| argmax_in_place(&logits)).flatten() {
            next
        } else {
            let mut row = logits.to_vec1::<f32>()?;
            self.sampler
                .sample(&mut row, &self.history, self.generated.len())
        };
        self.accept(next)
    }

    /// Whether the next token is the logits' arg-max, so that a path that chooses it
    /// itself ([`crate::Session::greedy`]) may decode this sequence.
    pub fn is_greedy(&self) -> bool {
        self.sampler.params().is_greedy()
    }

    /// Tokens still to come at most: the budget less what was generated.
    pub fn remaining(&self) -> usize {
        if self.finished.is_some() {
            return 0;
        }
        self.budget.saturating_sub(self.generated.len())
    }

    /// Takes `next`, chosen elsewhere (by [`Decoder::step`] or a greedy path), and says
    /// what text it makes final.
    pub fn accept(&mut self, next: u32) -> Result<Decoded> {
        if self.finished.is_some() {
            return Ok(Decoded {
                next: None,
                text: String::new(),
            });
        }
        if self.engine.tokenizer().stop_ids().contains(&next) {
            return Ok(self.finish(FinishReason::Stop, String::new()));
        }
        self.generated.push(next);
        self.history.push(next);
        let piece = self.stream.push(next)?;
        let (shown, stopped) = self.stops.push(&piece);
        if stopped {
            // Nothing after a stop string is shown, held-back text included.
            self.finished = Some(FinishReason::Stop);
            return Ok(Decoded {
                next: None,
                text: shown,
            });
        }
        if self.generated.len() >= self.budget {
            return Ok(self.finish(FinishReason::Length, shown));
        }
        Ok(Decoded {
            next: Some(next),
            text: shown,
        })
    }

    /// Ends the sequence early (the caller stopped listening); returns the text held back.
    pub fn cancel(&mut self) -> String {
        if self.finished.is_some() {
            return String::new();
        }
        self.finish(FinishReason::Cancelled, String::new()).text
    }

    /// Ends with `why`; text held back for a stop string that never came is final now.
    fn finish(&mut self, why: FinishReason, shown: String) -> Decoded {
        self.finished = Some(why);
        Decoded {
            next: None,
            text: shown + &self.stops.flush(),
        }
    }
}

/// The arg-max of a CPU f32 row read where it lies (a batch's logits hold a row of the
/// vocabulary's size for every sequence: copying each out cost a step ~200 KB a
/// sequence); `None` where the row is elsewhere or not contiguous.
fn argmax_in_place(logits: &Tensor) -> Option<u32> {
    let (storage, layout) = logits.storage_and_layout();
    shoal_model::cpu_values(&storage, layout).map(crate::sampling::argmax)
}
