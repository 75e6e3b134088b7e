//! Rank 0's serving loop: the node's requests in, answers out, many at once. Each turn
//! it reads every message waiting (a cancel is seen within one step, whatever state its
//! sequence is in), admits what fits, asks the scheduler for the next step, runs it as
//! one batched forward on every rank, and hands each sequence its row of the logits.

use std::collections::VecDeque;
use std::sync::mpsc::{Receiver, TryRecvError};
use std::time::Instant;

use shoal_collectives::Transport;
use shoal_engine::{Decoder, Engine, EngineError, FinishReason};
use shoal_tokenizer::{ChatMessage, ToolCallStream, ToolCallSyntax, ToolEvent};

use crate::SplitModel;
use crate::control::{ErrorKind, FromRunner, GenerateRequest, Timings, ToRunner, Usage};
use crate::scheduler::{
    Limits, Running, SETTLED, StepBounds, StepCosts, Waiting, Work, admit, fits_at_all, gap_for,
    kept_to_free, may_queue, next_step, prompt_budget, reserved,
};
use crate::step::{Logits, Part};

/// How much the loop lets in.
#[derive(Clone, Copy, Debug)]
pub struct ServeConfig {
    pub limits: Limits,
    /// Prompt positions kept after their answers for later requests that share them.
    pub prefix_positions: usize,
    /// A step beside streams lasts at most this many decode-only steps (0: no bound).
    pub gap_bound: f64,
    /// Any step lasts about this many milliseconds at most (0: no bound): a cancel, a
    /// new request or a stop waits at most one step, also in a long prompt.
    pub step_ms: f64,
}

impl ServeConfig {
    /// The KV pool placement counted for the instance (at least one context): running
    /// sequences and kept prefixes together stay within it.
    pub fn with_kv_positions(mut self, pool: usize, context: usize) -> Self {
        self.limits.kv_positions = pool.max(context);
        self
    }

    /// `max_batch` sequences at once, each up to the context; 256 tokens a step.
    pub fn new(context: usize, max_batch: usize) -> Self {
        let max_batch = max_batch.max(1);
        Self {
            limits: Limits {
                step_tokens: 256,
                max_batch,
                kv_positions: context.saturating_mul(max_batch),
                max_queue: 4 * max_batch.max(16),
                stages: 1,
                lone_prompt_rows: false,
            },
            prefix_positions: 4 * context,
            gap_bound: 2.0,
            step_ms: 500.0,
        }
    }
}

/// A step of only prompt tokens, this many or more, is bulk work.
const BULK_PREFILL: usize = 128;

/// Whether a step is bulk prefill, which runs at idle CPU priority: another runner's
/// decode steps and short prompts on the same cores go first, and it takes what they
/// leave (all of it when they are idle).
fn bulk(decoding: usize, prompt_tokens: usize) -> bool {
    decoding == 0 && prompt_tokens >= BULK_PREFILL
}

/// A shared prefix shorter than this is computed again rather than copied.
const MIN_PREFIX: usize = 32;

/// Prompts kept on every rank after their answers: a request whose prompt starts the
/// same way (an agent resending its conversation) starts from a copy of their keys and
/// values. Least recently used first out, within a bound of positions.
#[derive(Default)]
struct Prefixes {
    kept: Vec<Kept>,
    clock: u64,
}

struct Kept {
    seq: u64,
    tokens: Vec<u32>,
    used: u64,
}

impl Prefixes {
    /// The kept sequence sharing the longest prefix with `prompt`, and how long.
    fn longest(&mut self, prompt: &[u32]) -> Option<(u64, usize)> {
        self.clock += 1;
        let best = self
            .kept
            .iter_mut()
            .map(|k| {
                let n = k
                    .tokens
                    .iter()
                    .zip(prompt)
                    .take_while(|(a, b)| a == b)
                    .count();
                (n, k)
            })
            .max_by_key(|(n, _)| *n)?;
        best.1.used = self.clock;
        Some((best.1.seq, best.0))
    }

    /// Keeps `seq`'s prompt; returns the sequences to free (evicted, or `seq` itself
    /// when the same prompt is kept already).
    fn keep(&mut self, seq: u64, tokens: Vec<u32>, budget: usize) -> Vec<u64> {
        if tokens.len() < MIN_PREFIX || self.kept.iter().any(|k| k.tokens == tokens) {
            return vec![seq];
        }
        self.clock += 1;
        self.kept.push(Kept {
            seq,
            tokens,
            used: self.clock,
        });
        let mut freed = Vec::new();
        while self.positions() > budget {
            let Some(seq) = self.evict_oldest() else {
                break;
            };
            freed.push(seq);
        }
        freed
    }

    /// Positions the kept prompts hold.
    fn positions(&self) -> usize {
        self.kept.iter().map(|k| k.tokens.len()).sum()
    }

    /// Forgets the least recently used kept prompt; its sequence, to free.
    fn evict_oldest(&mut self) -> Option<u64> {
        let oldest = (0..self.kept.len()).min_by_key(|&i| self.kept[i].used)?;
        Some(self.kept.remove(oldest).seq)
    }
}

/// One request on its way through.
struct Seq<'e> {
    id: u64,
    /// Its sequence on the ranks.
    seq: u64,
    prompt: Vec<u32>,
    max_new: usize,
    prefilled: usize,
    /// Prompt positions copied from a kept prefix.
    cached: usize,
    decoder: Decoder<'e>,
    /// The token the next decode step feeds.
    next: Option<u32>,
    arrived: Instant,
    admitted: Option<Instant>,
    first_token: Option<Instant>,
    /// Reads the model's tool calls out of its text, when the request offered tools.
    tools: Option<Tools>,
    /// In a step in flight that returns its logits.
    in_flight: bool,
}

/// The names of the functions offered (OpenAI's shape).
fn function_names(tools: &[serde_json::Value]) -> Vec<String> {
    tools
        .iter()
        .filter_map(|t| t["function"]["name"].as_str())
        .map(str::to_string)
        .collect()
}

/// A sequence's tool calls so far.
#[derive(Default)]
struct Tools {
    stream: ToolCallStream,
    called: bool,
    malformed: bool,
}

impl Seq<'_> {
    /// Sends a piece of the answer: as it is, or through the tool-call reader.
    fn emit(&mut self, text: String, send: &dyn Fn(FromRunner) -> bool) {
        let Some(tools) = &mut self.tools else {
            if !text.is_empty() {
                send(FromRunner::Text { id: self.id, text });
            }
            return;
        };
        let events = tools.stream.push(&text);
        self.send_tool_events(events, send);
    }

    fn send_tool_events(&mut self, events: Vec<ToolEvent>, send: &dyn Fn(FromRunner) -> bool) {
        let Some(tools) = &mut self.tools else {
            return;
        };
        for e in events {
            let id = self.id;
            match e {
                ToolEvent::Text(text) => send(FromRunner::Text { id, text }),
                ToolEvent::Call(call) => {
                    tools.called = true;
                    send(FromRunner::ToolCall { id, call })
                }
                ToolEvent::Malformed(text) => {
                    tools.malformed = true;
                    send(FromRunner::Text { id, text })
                }
            };
        }
    }

    /// The answer's end: held text out, and why it ended (its calls decide, when it
    /// made any).
    fn finish(&mut self, why: FinishReason, send: &dyn Fn(FromRunner) -> bool) -> FromRunner {
        let Some(tools) = &mut self.tools else {
            return self.done(why);
        };
        let events = std::mem::take(&mut tools.stream).finish();
        self.send_tool_events(events, send);
        let tools = self.tools.as_ref().expect("checked above");
        let why = if tools.malformed {
            FinishReason::MalformedToolCall
        } else if tools.called && why == FinishReason::Stop {
            FinishReason::ToolCalls
        } else {
            why
        };
        self.done(why)
    }

    fn waiting(&self) -> Waiting {
        Waiting {
            id: self.id,
            prompt: self.prompt.len(),
            max_new: self.max_new,
        }
    }

    fn running(&self) -> Running {
        Running {
            id: self.id,
            prompt: self.prompt.len(),
            max_new: self.max_new,
            prefilled: self.prefilled,
            in_flight: self.in_flight,
        }
    }

    fn done(&self, finish_reason: FinishReason) -> FromRunner {
        let ms = |a: Instant, b: Instant| (b - a).as_secs_f64() * 1e3;
        let now = Instant::now();
        let admitted = self.admitted.unwrap_or(now);
        let first = self.first_token.unwrap_or(now);
        FromRunner::Done {
            id: self.id,
            finish_reason,
            usage: Usage {
                prompt_tokens: self.prompt.len(),
                cached_tokens: self.cached,
                completion_tokens: self.decoder.generated().len(),
            },
            timings: Timings {
                queued_ms: ms(self.arrived, admitted),
                prefill_ms: ms(admitted, first),
                decode_ms: ms(first, now),
            },
        }
    }
}

/// The loop's state: requests waiting for admission, and admitted sequences.
struct Serving<'e, 'm, T: Transport> {
    engine: &'e Engine,
    model: &'m SplitModel<T>,
    config: ServeConfig,
    waiting: VecDeque<Seq<'e>>,
    running: Vec<Seq<'e>>,
    send: &'m dyn Fn(FromRunner) -> bool,
    /// The load last reported: running, prefilling, waiting.
    reported: (usize, usize, usize),
    prefixes: Prefixes,
    /// What steps have cost: sizes prompt slices beside streams.
    costs: StepCosts,
    /// Steps started on the ranks, oldest first: one per pipeline stage at most.
    flights: VecDeque<Flight>,
}

/// A step started on the ranks and not yet back.
struct Flight {
    /// The requests whose logits rows it returns, in row order.
    sampling: Vec<u64>,
    started: Instant,
    decoding: usize,
    prompt_tokens: usize,
    budget: usize,
    /// The gap bound it was sized under (0: none).
    gap: f64,
}

/// Serves until the node closes the inbox (Ok) or the instance breaks (Err, after every
/// request in hand was told).
pub fn serve<T: Transport>(
    engine: &Engine,
    model: &SplitModel<T>,
    inbox: &Receiver<ToRunner>,
    send: &dyn Fn(FromRunner) -> bool,
    config: ServeConfig,
) -> Result<(), EngineError> {
    let mut config = config;
    config.limits.stages = model.stages();
    let mut s = Serving {
        engine,
        model,
        config,
        waiting: VecDeque::new(),
        running: Vec::new(),
        send,
        reported: (0, 0, 0),
        prefixes: Prefixes::default(),
        costs: StepCosts::default(),
        flights: VecDeque::new(),
    };
    loop {
        // Block only when there is nothing to compute.
        s.report_load();
        if s.waiting.is_empty() && s.running.is_empty() && s.flights.is_empty() {
            match inbox.recv() {
                Ok(m) => s.on_message(m),
                Err(_) => return Ok(()),
            }
        }
        loop {
            match inbox.try_recv() {
                Ok(m) => s.on_message(m),
                Err(TryRecvError::Empty) => break,
                Err(TryRecvError::Disconnected) => return Ok(()),
            }
        }
        s.admit();
        s.report_load();
        // Keep a step in flight per stage; when they all are (or nothing else is ready),
        // take the oldest one's logits.
        if !s.start_step()? {
            s.finish_step()?;
        }
        s.report_load();
    }
}

impl<'e, T: Transport> Serving<'e, '_, T> {
    fn on_message(&mut self, m: ToRunner) {
        match m {
            ToRunner::Generate { id, request } => self.on_generate(id, &request),
            ToRunner::Cancel { id } => self.cancel(id),
        }
    }

    fn fail(&self, id: u64, kind: ErrorKind, message: String) {
        (self.send)(FromRunner::Error { id, kind, message });
    }

    fn on_generate(&mut self, id: u64, request: &GenerateRequest) {
        if request.prompt.is_empty() && request.messages.is_empty() && request.prompt_ids.is_empty()
        {
            let why = "the request has neither a prompt, prompt_ids nor messages".to_string();
            return self.fail(id, ErrorKind::Invalid, why);
        }
        let tools = if request.tools.is_empty() {
            None
        } else {
            match ToolCallSyntax::of(self.engine.tokenizer().chat_template()) {
                Some(syntax) => Some(syntax),
                None => {
                    let why = "this model's chat template takes no tools".to_string();
                    return self.fail(id, ErrorKind::Invalid, why);
                }
            }
        };
        let prompt = match self.tokenize(request) {
            Ok(p) => p,
            Err(e) => return self.fail(id, ErrorKind::Invalid, e.to_string()),
        };
        if request.count_only {
            (self.send)(FromRunner::Done {
                id,
                finish_reason: FinishReason::Stop,
                usage: Usage {
                    prompt_tokens: prompt.len(),
                    ..Usage::default()
                },
                timings: Timings::default(),
            });
            return;
        }
        let context = self.engine.context_length();
        if request.must_fit && prompt.len().saturating_add(request.max_tokens) > context {
            let why = format!(
                "max_tokens {} and the prompt's {} tokens exceed the model's context of {} tokens",
                request.max_tokens,
                prompt.len(),
                context
            );
            return self.fail(id, ErrorKind::Invalid, why);
        }
        let mut params = request.params(self.config.limits.step_tokens);
        if let Some(syntax) = tools {
            params.shown_tokens = syntax.tags().map(str::to_string).to_vec();
        }
        let decoder = Decoder::new(self.engine, &prompt, &params);
        let max_new = params
            .max_tokens
            .min(self.engine.context_length().saturating_sub(prompt.len()));
        let seq = Seq {
            id,
            seq: self.model.open(),
            prompt,
            max_new,
            prefilled: 0,
            cached: 0,
            decoder,
            next: None,
            arrived: Instant::now(),
            admitted: None,
            first_token: None,
            tools: tools.map(|_| Tools {
                stream: ToolCallStream::new(function_names(&request.tools)),
                ..Tools::default()
            }),
            in_flight: false,
        };
        let limits = &self.config.limits;
        if !fits_at_all(&seq.waiting(), limits) {
            return self.fail(
                id,
                ErrorKind::Invalid,
                format!(
                    "the request needs {} positions; the instance holds {}",
                    seq.prompt.len() + max_new,
                    limits.kv_positions
                ),
            );
        }
        if !may_queue(self.waiting.len(), limits) {
            return self.fail(
                id,
                ErrorKind::Busy,
                format!(
                    "{} requests are waiting already; try again shortly",
                    self.waiting.len()
                ),
            );
        }
        self.waiting.push_back(seq);
    }

    fn tokenize(&self, r: &GenerateRequest) -> Result<Vec<u32>, EngineError> {
        let ids = if !r.prompt_ids.is_empty() {
            let vocab = self.engine.tokenizer().vocab_size();
            if let Some(bad) = r.prompt_ids.iter().find(|&&t| t as usize >= vocab) {
                return Err(EngineError::Invalid(format!(
                    "prompt_ids holds {bad}, past the vocabulary ({vocab} tokens)"
                )));
            }
            r.prompt_ids.clone()
        } else if !r.messages.is_empty() {
            self.engine.chat_prompt_with_tools(&r.messages, &r.tools)?
        } else if r.raw {
            self.engine.raw_prompt(&r.prompt)?
        } else {
            let mut messages = Vec::new();
            if let Some(system) = &r.system {
                messages.push(ChatMessage::new("system", system));
            }
            messages.push(ChatMessage::new("user", &r.prompt));
            self.engine.chat_prompt_with_tools(&messages, &r.tools)?
        };
        if !r.count_only {
            self.engine.check_prompt(&ids)?;
        }
        Ok(ids)
    }

    /// Frees request `id` wherever it is; its client is gone, so nothing is sent but the
    /// end, for the node's accounting.
    fn cancel(&mut self, id: u64) {
        if let Some(at) = self.waiting.iter().position(|s| s.id == id) {
            if let Some(mut s) = self.waiting.remove(at) {
                s.decoder.cancel();
                (self.send)(s.done(FinishReason::Cancelled));
            }
        } else if let Some(at) = self.running.iter().position(|s| s.id == id) {
            // Steps in flight with its tokens are ahead of the release on every rank;
            // their rows for it are dropped when they come back.
            let mut s = self.running.remove(at);
            s.decoder.cancel();
            let _ = self.model.release(s.seq);
            (self.send)(s.done(FinishReason::Cancelled));
        }
    }

    /// Tells the node how many sequences run and wait, when that changed.
    fn report_load(&mut self) {
        let prefilling = self
            .running
            .iter()
            .filter(|s| s.prefilled < s.prompt.len())
            .count();
        let now = (self.running.len(), prefilling, self.waiting.len());
        if now != self.reported {
            self.reported = now;
            (self.send)(FromRunner::Load {
                running: now.0,
                prefilling: now.1,
                waiting: now.2,
            });
        }
    }

    /// Kept prompts share the KV pool with the sequences and give way to them: the least
    /// recently used are freed until the first request in line fits.
    fn make_room(&mut self, waiting: &[Waiting], running: &[Running]) {
        let kept = self.prefixes.positions();
        let lack = kept_to_free(waiting, running, kept, &self.config.limits);
        while kept - self.prefixes.positions() < lack {
            let Some(seq) = self.prefixes.evict_oldest() else {
                break;
            };
            if let Err(e) = self.model.release(seq) {
                tracing::warn!(error = %e, "cannot free a kept prefix");
            }
        }
    }

    fn admit(&mut self) {
        let waiting: Vec<Waiting> = self.waiting.iter().map(Seq::waiting).collect();
        let running: Vec<Running> = self.running.iter().map(Seq::running).collect();
        self.make_room(&waiting, &running);
        let mut limits = self.config.limits;
        limits.kv_positions = limits
            .kv_positions
            .saturating_sub(self.prefixes.positions());
        for _ in admit(&waiting, &running, &limits) {
            if let Some(mut s) = self.waiting.pop_front() {
                s.admitted = Some(Instant::now());
                self.start_from_prefix(&mut s);
                self.running.push(s);
            }
        }
    }

    /// Starts `s` from a copy of the longest kept prefix of its prompt, if long enough.
    /// Its last two tokens are always computed: the last one's logits give the first
    /// answer token, and a lone prompt row would be computed as a decode step's (see
    /// `scheduler::whole_rows`), not as the same request alone computes it.
    fn start_from_prefix(&mut self, s: &mut Seq<'_>) {
        let Some((from, shared)) = self.prefixes.longest(&s.prompt) else {
            return;
        };
        let len = shared.min(s.prompt.len().saturating_sub(2));
        if len < MIN_PREFIX {
            return;
        }
        match self.model.fork(from, len) {
            Ok(seq) => {
                s.seq = seq;
                s.prefilled = len;
                s.cached = len;
            }
            Err(e) => tracing::warn!(error = %e, "cannot copy a kept prefix; computing it"),
        }
    }

    /// Starts a step over what the scheduler picks, if a stage is free and anything is
    /// ready; returns whether it did.
    fn start_step(&mut self) -> Result<bool, EngineError> {
        if self.flights.len() >= self.config.limits.stages.max(1) {
            return Ok(false);
        }
        let running: Vec<Running> = self.running.iter().map(Seq::running).collect();
        let decoding = running.iter().filter(|r| r.decoding()).count();
        let settled = self
            .running
            .iter()
            .filter(|s| s.decoder.generated().len() >= SETTLED)
            .count();
        let limits = &self.config.limits;
        let bounds = StepBounds {
            gap: gap_for(self.config.gap_bound, settled),
            ms: self.config.step_ms,
        };
        let budget = prompt_budget(&self.costs, decoding, bounds, limits);
        let work = next_step(&running, limits, budget);
        if work.is_empty() {
            return Ok(false);
        }
        let mut flight = Flight {
            sampling: Vec::new(),
            started: Instant::now(),
            decoding: 0,
            prompt_tokens: 0,
            budget,
            gap: bounds.gap,
        };
        let mut parts = Vec::with_capacity(work.len());
        let mut prefilled = Vec::new();
        for w in &work {
            let (id, tokens, logits) = match *w {
                Work::Decode { id } => {
                    flight.decoding += 1;
                    let s = self.by_id(id);
                    (id, vec![s.next.unwrap_or(0)], Logits::Last)
                }
                Work::Prefill {
                    id,
                    start,
                    len,
                    last,
                } => {
                    flight.prompt_tokens += len;
                    prefilled.push((id, len));
                    let s = self.by_id(id);
                    let tokens = s.prompt[start..start + len].to_vec();
                    (id, tokens, if last { Logits::Last } else { Logits::None })
                }
            };
            if logits != Logits::None {
                flight.sampling.push(id);
            }
            let s = self.by_id(id);
            parts.push(Part {
                seq: s.seq,
                tokens,
                logits,
                reserve: u32::try_from(s.prompt.len() + s.max_new).unwrap_or(u32::MAX),
            });
        }
        let background = bulk(flight.decoding, flight.prompt_tokens);
        shoal_kernels::ThreadPool::global().set_background(background);
        if let Err(e) = self.model.submit(parts) {
            let ids: Vec<u64> = work.iter().map(Work::id).collect();
            self.step_failed(e, &ids)?;
            return Ok(true);
        }
        for (id, len) in prefilled {
            let i = self.index(id);
            self.running[i].prefilled += len;
        }
        for &id in &flight.sampling {
            let i = self.index(id);
            self.running[i].in_flight = true;
        }
        self.flights.push_back(flight);
        Ok(true)
    }

    /// Takes the oldest step's logits: each sequence still here samples its row and says
    /// what it made; the finished leave.
    fn finish_step(&mut self) -> Result<(), EngineError> {
        let Some(flight) = self.flights.pop_front() else {
            return Ok(());
        };
        let logits = match self.model.collect() {
            Ok(l) => l,
            Err(e) => return self.step_failed(e, &flight.sampling),
        };
        let mut finished = Vec::new();
        if let Some(logits) = logits {
            for (row, &id) in flight.sampling.iter().enumerate() {
                // Cancelled while its step was in flight.
                let Some(i) = self.running.iter().position(|s| s.id == id) else {
                    continue;
                };
                let s = &mut self.running[i];
                s.in_flight = false;
                let out = s.decoder.step(&logits.narrow(0, row, 1)?)?;
                s.first_token.get_or_insert_with(Instant::now);
                s.emit(out.text, self.send);
                s.next = out.next;
                if out.next.is_none() {
                    finished.push(id);
                }
            }
        }
        self.observe(&flight);
        for id in finished {
            let i = self.index(id);
            let mut s = self.running.remove(i);
            let why = s.decoder.finished().unwrap_or(FinishReason::Length);
            let done = s.finish(why, self.send);
            (self.send)(done);
            // Kept prompts take what the pool has beyond the running sequences.
            let running: Vec<Running> = self.running.iter().map(Seq::running).collect();
            let free = self
                .config
                .limits
                .kv_positions
                .saturating_sub(reserved(&running));
            let budget = self.config.prefix_positions.min(free);
            for seq in self.prefixes.keep(s.seq, s.prompt, budget) {
                self.model.release(seq)?;
            }
        }
        Ok(())
    }

    /// A step's time, for the costs that size the next ones' prompt slices.
    fn observe(&mut self, f: &Flight) {
        let ms = f.started.elapsed().as_secs_f64() * 1e3;
        // A big slice beside young streams costs less a token than the few tokens the
        // gap bound lets in beside settled ones; learning from it would size those too
        // large.
        if f.gap > 0.0 || f.decoding == 0 || f.prompt_tokens == 0 {
            self.costs.observe(f.decoding, f.prompt_tokens, ms);
        }
        let (decoding, prompt_tokens, budget) = (f.decoding, f.prompt_tokens, f.budget);
        tracing::debug!(decoding, prompt_tokens, budget, ms, "step");
    }

    /// A step the ranks refused (nothing ran: the requests `ids` in it fail, the rest go
    /// on) or one that broke the instance (everyone is told; the runner leaves).
    fn step_failed(&mut self, e: EngineError, ids: &[u64]) -> Result<(), EngineError> {
        if let Some(why) = self.model.broken() {
            let message = format!("the instance failed: {why}");
            for s in self.running.drain(..).chain(self.waiting.drain(..)) {
                (self.send)(FromRunner::Error {
                    id: s.id,
                    kind: ErrorKind::Broken,
                    message: message.clone(),
                });
            }
            self.flights.clear();
            return Err(e);
        }
        for &id in ids {
            if let Some(i) = self.running.iter().position(|s| s.id == id) {
                let s = self.running.remove(i);
                (self.send)(FromRunner::Error {
                    id: s.id,
                    kind: ErrorKind::Invalid,
                    message: e.to_string(),
                });
                let _ = self.model.release(s.seq);
            }
        }
        Ok(())
    }

    fn index(&self, id: u64) -> usize {
        self.running
            .iter()
            .position(|s| s.id == id)
            .expect("the scheduler names running sequences")
    }

    fn by_id(&self, id: u64) -> &Seq<'e> {
        &self.running[self.index(id)]
    }
}
