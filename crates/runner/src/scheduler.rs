//! Rank 0's scheduler: which sequences are admitted, and what goes into the next forward
//! step. Pure functions over typed state, so the rules are tested here without a model.
//!
//! The rules, after vLLM's: every decoding sequence adds its one token to every step
//! (nobody's stream stalls); the rest of the step's token budget goes to prompt slices,
//! oldest sequence first (chunked prefill: a long prompt neither stalls the streams nor
//! waits behind them). A sequence is admitted only when the batch has room and its whole
//! KV (prompt and answer) fits in what is free; beyond, requests wait in a bounded queue,
//! and past the queue they are refused as busy.
//!
//! Beside streams, a prompt slice is sized by what steps cost, not by tokens alone: on a
//! CPU one prompt token costs about as much as a whole decode step of a small model, so
//! a 256-token slice would stall every stream for a quarter of a second. [`StepCosts`]
//! learns the costs as the instance runs and [`prompt_budget`] keeps a step with streams
//! within a bound times a decode-only step (Sarathi-Serve's rule, in time), once a
//! stream is past its first tokens ([`gap_for`]: requests that arrive together are read
//! together).

/// How much one step and one instance may hold.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Limits {
    /// Tokens per forward step (decode tokens and prompt slices together).
    pub step_tokens: usize,
    /// Sequences admitted at once.
    pub max_batch: usize,
    /// KV positions the instance may hold over all its sequences.
    pub kv_positions: usize,
    /// Requests that may wait for admission; past it, new ones are refused.
    pub max_queue: usize,
    /// Steps in flight at once: a pipeline's stages, each on a micro-batch of its own
    /// (1: every step runs on all ranks together).
    pub stages: usize,
    /// Whether a prompt's lone row computes as its rows do together, so that a slice may
    /// be one row ([`whole_rows`] otherwise): true where the ranks' kernels compute a
    /// decode row and a prompt row alike (a CPU with AVX-512 VNNI, AVX2 in the lane
    /// layout), false on a GPU (a lone row takes the single-token kernels) and on AMX.
    pub lone_prompt_rows: bool,
}

/// A request waiting for admission.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Waiting {
    pub id: u64,
    pub prompt: usize,
    /// The most tokens it may generate (its KV is reserved for all of them).
    pub max_new: usize,
}

impl Waiting {
    fn positions(&self) -> usize {
        self.prompt + self.max_new
    }
}

/// An admitted sequence.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Running {
    pub id: u64,
    pub prompt: usize,
    pub max_new: usize,
    /// Prompt tokens already through the model (or sent into it by a step in flight).
    pub prefilled: usize,
    /// In a step in flight that will return its logits: nothing to feed it until then.
    pub in_flight: bool,
}

impl Running {
    pub fn admitted(w: &Waiting) -> Self {
        Self {
            id: w.id,
            prompt: w.prompt,
            max_new: w.max_new,
            prefilled: 0,
            in_flight: false,
        }
    }

    pub fn decoding(&self) -> bool {
        self.prefilled >= self.prompt
    }

    fn positions(&self) -> usize {
        self.prompt + self.max_new
    }
}

/// One sequence's share of the next step.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Work {
    /// Its next token.
    Decode { id: u64 },
    /// Prompt tokens `start..start + len`; `last` when they end the prompt (the step
    /// then returns its logits and the first token is sampled).
    Prefill {
        id: u64,
        start: usize,
        len: usize,
        last: bool,
    },
}

impl Work {
    /// The request it is part of.
    pub fn id(&self) -> u64 {
        match *self {
            Self::Decode { id } | Self::Prefill { id, .. } => id,
        }
    }
}

/// Whether a new request may wait for admission.
pub fn may_queue(waiting: usize, limits: &Limits) -> bool {
    waiting < limits.max_queue
}

/// The waiting requests to admit now, in order: first come first served, each only if
/// the batch has room and its KV fits beside what is admitted; the first that does not
/// fit stops the line (a big request is not overtaken forever by small ones).
pub fn admit(waiting: &[Waiting], running: &[Running], limits: &Limits) -> Vec<u64> {
    let mut used = reserved(running);
    let mut out = Vec::new();
    for (batch, w) in (running.len()..).zip(waiting) {
        if batch >= limits.max_batch || used + w.positions() > limits.kv_positions {
            break;
        }
        used += w.positions();
        out.push(w.id);
    }
    out
}

/// KV positions the running sequences hold or may come to hold (prompt and answer each).
pub fn reserved(running: &[Running]) -> usize {
    running.iter().map(Running::positions).sum()
}

/// Positions that prompts kept for reuse (`kept` of them, in the same pool) must give up
/// for the first waiting request to be admitted: 0 when it fits beside them, or when the
/// batch has no room for it anyway.
pub fn kept_to_free(
    waiting: &[Waiting],
    running: &[Running],
    kept: usize,
    limits: &Limits,
) -> usize {
    match waiting.first() {
        Some(w) if running.len() < limits.max_batch => {
            (reserved(running) + w.positions() + kept).saturating_sub(limits.kv_positions)
        }
        _ => 0,
    }
}

/// Whether a request can ever be admitted (its KV alone fits the instance).
pub fn fits_at_all(w: &Waiting, limits: &Limits) -> bool {
    w.positions() <= limits.kv_positions
}

/// The next step, by three rules in order:
/// 1. every decoding sequence's token (over a pipeline, its share: see below);
/// 2. when the oldest prompt is longer than what is left of the token budget, half of
///    it to the prompts that came after, shortest first: a short question is read
///    within a step or two however long the prompt before it (vLLM's chunked prefill,
///    oldest first, would keep it behind the whole of it). Prompts that all end within
///    the step keep their order, and their slices stay whole where they fit;
/// 3. the rest to the oldest prompt, then to the others in that order (else in the
///    order they came) — so the oldest keeps at least half of the budget and short ones
///    never starve it.
///
/// All within the token budget and at most `prompt_tokens` prompt tokens (see
/// [`prompt_budget`]). Empty when nothing is ready.
///
/// Sequences in flight wait for their logits. Over a pipeline of k stages a step takes
/// at most a k-th of the streams (rounded up), so that k micro-batches of about equal
/// size keep every stage busy; a prompt's slices need no logits until the last, so they
/// may follow each other through the stages.
pub fn next_step(running: &[Running], limits: &Limits, prompt_tokens: usize) -> Vec<Work> {
    let streams = running.iter().filter(|r| r.decoding()).count();
    let share = streams.div_ceil(limits.stages.max(1));
    let mut work: Vec<Work> = running
        .iter()
        .filter(|r| r.decoding() && !r.in_flight)
        .take(share)
        .map(|r| Work::Decode { id: r.id })
        .collect();
    let mut left = limits
        .step_tokens
        .saturating_sub(work.len())
        .min(prompt_tokens);
    let pending: Vec<&Running> = running
        .iter()
        .filter(|r| !r.decoding() && !r.in_flight)
        .collect();
    let Some((&oldest, later)) = pending.split_first() else {
        return work;
    };
    let rest = |r: &Running| r.prompt - r.prefilled;
    let jump = rest(oldest) > left;
    let mut later = later.to_vec();
    if jump {
        later.sort_by_key(|r| rest(r));
    }
    // Tokens each prompt gets: `later`'s in their order, then the oldest's.
    let mut lens = vec![0; later.len() + 1];
    let mut half = if jump { left / 2 } else { 0 };
    for (i, r) in later.iter().enumerate() {
        left -= give(&mut lens[i], rest(r), &mut half);
    }
    give(&mut lens[later.len()], rest(oldest), &mut left);
    for (i, r) in later.iter().enumerate() {
        let want = rest(r) - lens[i];
        give(&mut lens[i], want, &mut left);
    }
    let oldest_len = lens[later.len()];
    let lone = limits.lone_prompt_rows;
    if oldest_len > 0 {
        work.push(slice(oldest, oldest_len, lone));
    }
    work.extend(
        later
            .iter()
            .zip(&lens)
            .filter(|(_, len)| **len > 0)
            .map(|(r, len)| slice(r, *len, lone)),
    );
    work
}

/// Up to `want` more tokens to `len`, out of `cap`; how many.
fn give(len: &mut usize, want: usize, cap: &mut usize) -> usize {
    let n = want.min(*cap);
    *len += n;
    *cap -= n;
    n
}

/// `r`'s next `len` prompt tokens, made [`whole_rows`] unless a lone row is as good.
fn slice(r: &Running, len: usize, lone_rows: bool) -> Work {
    let left = r.prompt - r.prefilled;
    let len = if lone_rows {
        len.min(left)
    } else {
        whole_rows(len, left)
    };
    Work::Prefill {
        id: r.id,
        start: r.prefilled,
        len,
        last: r.prefilled + len == r.prompt,
    }
}

/// A slice of `len` of the `left` prompt tokens, moved by one where it would be or leave
/// a lone row: the model computes a lone row as a decode step's (the single-token
/// kernels) and two or more as a prompt's, which on some machines round otherwise, so a
/// prompt sliced into lone rows would not reproduce the answer it gets read whole. A
/// prompt of one token is read as one row either way.
pub fn whole_rows(len: usize, left: usize) -> usize {
    if left <= 2 {
        return left;
    }
    let len = len.clamp(2, left);
    if left - len == 1 {
        if len > 2 { len - 1 } else { len + 1 }
    } else {
        len
    }
}

/// What steps cost on this instance, learned from the steps it runs (exponential
/// averages, so a change is followed within a few dozen steps). A step with streams and
/// `n` prompt tokens is modelled as `decode` (what a step of the streams alone costs)
/// plus `n` times the cost of a prompt token beside them: learned from such steps
/// themselves (it grows as the prompt's attention reaches further back, and it carries the
/// prompt rows' own pass through the layers), and until there are any, from steps that
/// read a prompt alone.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct StepCosts {
    /// Milliseconds of a step without prompt tokens.
    pub decode: Option<f64>,
    /// Milliseconds per prompt token in steps that read only a prompt (32+ tokens).
    pub per_prompt_token: Option<f64>,
    /// Milliseconds per prompt token beyond `decode`, in steps with streams.
    pub per_token_beside: Option<f64>,
}

/// Weight of the newest observation in the averages.
const LEARN: f64 = 0.2;
/// Weight of a prompt-alone step's per-token cost above the average. A prompt token's
/// cost grows as its attention reaches further back, so the average of what tokens cost
/// lags behind what the next slice's will: on smollm2 beside a 4,000-token prompt the
/// 500 ms step bound was overrun in 12 of 65 prompt-alone steps (up to 708 ms, ten in a
/// row as the average caught up); with dearer costs believed at half weight, 4 of 98
/// (p90 578 → 478 ms). Steps beside streams keep the plain average: their cost is mostly
/// a part that does not shrink with the slice (2 prompt tokens beside a stream took 12–17
/// ms, 8 tokens 18–20 ms, the stream alone 7 ms, deep in that prompt), which a per-token
/// figure cannot follow either way.
const LEARN_DEARER: f64 = 0.5;
/// Steps reading at least this many prompt tokens alone measure their per-token cost.
const MEASURED_SLICE: usize = 32;

/// The average `old` moved towards `new`: by `dearer` where `new` is above it, by
/// [`LEARN`] otherwise.
fn learn(old: Option<f64>, new: f64, dearer: f64) -> f64 {
    old.map_or(new, |o| {
        let weight = if new > o { dearer } else { LEARN };
        o + weight * (new - o)
    })
}

impl StepCosts {
    /// A step of `decoding` stream tokens and `prompt` prompt tokens took `ms`.
    pub fn observe(&mut self, decoding: usize, prompt: usize, ms: f64) {
        match (decoding, prompt) {
            (_, 0) => self.decode = Some(learn(self.decode, ms, LEARN)),
            (0, n) if n >= MEASURED_SLICE => {
                let per_token = ms / n as f64;
                self.per_prompt_token = Some(learn(self.per_prompt_token, per_token, LEARN_DEARER));
            }
            (0, _) => {}
            (_, n) => {
                if let Some(d) = self.decode {
                    let beside = (ms - d).max(0.0) / n as f64;
                    self.per_token_beside = Some(learn(self.per_token_beside, beside, LEARN));
                }
            }
        }
    }
}

/// How long one step may last, whatever it holds; the two bounds on its prompt tokens.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct StepBounds {
    /// A step beside streams lasts at most this many decode-only steps (0: no bound).
    pub gap: f64,
    /// Any step lasts at most about this many milliseconds (0: no bound), so that a
    /// cancel, a new arrival or a stop is seen within it even in a long prompt.
    pub ms: f64,
}

/// A prompt-only step takes at least this many tokens however slow they are: fewer would
/// read the weights for too little work.
pub const MIN_SLICE: usize = 32;

/// A stream is held to the gap bound once it has this many tokens.
pub const SETTLED: usize = 4;

/// The gap bound for the next step, given how many of the decoding streams have
/// [`SETTLED`]: `bound` while any has; none (0) while every stream is in its first
/// tokens. Requests arriving together — clients started at once, an agent's parallel
/// calls — are then read together in a step or two, where the bound would let the
/// first run ahead while the others' prompts trickle in a few tokens a step (eight
/// short chat prompts on smollm2: about 25 steps, the first stream then finishing
/// alone as long after the others). A young stream may wait once for prompts that came
/// with it, within the step-time bound; one that has settled keeps its rhythm.
pub fn gap_for(bound: f64, settled: usize) -> f64 {
    if settled > 0 { bound } else { 0.0 }
}

/// The most prompt tokens the next step may take beside `decoding` streams: within the
/// token budget, within `bounds.gap` times a decode-only step when there are streams
/// (Sarathi-Serve's rule, in time), and within `bounds.ms` for any step; each aims at 80%
/// of its bound for noise. Beside streams at least one token, so a prompt always
/// progresses — once the streams' own cost is known: until then none, so that a step of
/// them alone measures it. Alone at least [`MIN_SLICE`]. What is not yet known bounds
/// nothing else, except that a step of prompt alone before any prompt cost is known
/// takes a slice of twice [`MIN_SLICE`] to learn it (a decode step's cost, when known,
/// stands in for a prompt token's: a token never costs more than a step that reads every
/// weight for it).
pub fn prompt_budget(
    costs: &StepCosts,
    decoding: usize,
    bounds: StepBounds,
    limits: &Limits,
) -> usize {
    let all = limits.step_tokens.saturating_sub(decoding);
    if decoding > 0 && bounds.gap > 0.0 && costs.decode.is_none() {
        // Streams whose step cost is not known yet (they began beside a prompt): one
        // step of them alone measures it, rather than a prompt slice stalling them.
        return 0;
    }
    let per_token = costs.per_token_beside.or(costs.per_prompt_token);
    let beside = match (costs.decode, per_token) {
        (Some(decode), Some(per_token)) if decoding > 0 && bounds.gap > 0.0 && per_token > 0.0 => {
            let room = (0.8 * bounds.gap - 1.0) * decode;
            (room / per_token).floor().max(1.0) as usize
        }
        _ => all,
    };
    let timed = if bounds.ms <= 0.0 {
        all
    } else {
        let this_step = if decoding == 0 {
            costs.per_prompt_token.or(costs.per_token_beside)
        } else {
            per_token
        };
        let floor = if decoding == 0 { MIN_SLICE } else { 1 };
        match this_step.or(costs.decode).filter(|&t| t > 0.0) {
            Some(per_token) => {
                let room = 0.8 * bounds.ms - costs.decode.filter(|_| decoding > 0).unwrap_or(0.0);
                ((room.max(0.0) / per_token).floor() as usize).max(floor)
            }
            None if decoding == 0 => 2 * MIN_SLICE,
            None => all,
        }
    };
    beside.min(timed).min(all).max(1)
}

#[cfg(test)]
mod tests;
