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
//! within a bound times a decode-only step (Sarathi-Serve's rule, in time).

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
    let mut used: usize = running.iter().map(Running::positions).sum();
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

/// Whether a request can ever be admitted (its KV alone fits the instance).
pub fn fits_at_all(w: &Waiting, limits: &Limits) -> bool {
    w.positions() <= limits.kv_positions
}

/// The next step: every decoding sequence's token, then prompt slices oldest first
/// within what is left of the token budget and at most `prompt_tokens` of them (see
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
        .min(prompt_tokens.max(1));
    for r in running.iter().filter(|r| !r.decoding() && !r.in_flight) {
        if left == 0 {
            break;
        }
        let len = (r.prompt - r.prefilled).min(left);
        left -= len;
        work.push(Work::Prefill {
            id: r.id,
            start: r.prefilled,
            len,
            last: r.prefilled + len == r.prompt,
        });
    }
    work
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
/// Steps reading at least this many prompt tokens alone measure their per-token cost.
const MEASURED_SLICE: usize = 32;

fn learn(old: Option<f64>, new: f64) -> f64 {
    old.map_or(new, |o| o + LEARN * (new - o))
}

impl StepCosts {
    /// A step of `decoding` stream tokens and `prompt` prompt tokens took `ms`.
    pub fn observe(&mut self, decoding: usize, prompt: usize, ms: f64) {
        match (decoding, prompt) {
            (_, 0) => self.decode = Some(learn(self.decode, ms)),
            (0, n) if n >= MEASURED_SLICE => {
                self.per_prompt_token = Some(learn(self.per_prompt_token, ms / n as f64));
            }
            (0, _) => {}
            (_, n) => {
                if let Some(d) = self.decode {
                    let beside = (ms - d).max(0.0) / n as f64;
                    self.per_token_beside = Some(learn(self.per_token_beside, beside));
                }
            }
        }
    }
}

/// The most prompt tokens the next step may take beside `decoding` streams so that it
/// lasts at most `bound` times a decode-only step, aiming at 80% of that for noise; at
/// least one token, so a prompt always progresses. Without streams, or without a bound
/// (`bound` 0), or before the costs are known, the whole token budget.
pub fn prompt_budget(costs: &StepCosts, decoding: usize, bound: f64, limits: &Limits) -> usize {
    let all = limits.step_tokens.saturating_sub(decoding);
    let per_token = costs.per_token_beside.or(costs.per_prompt_token);
    let (Some(decode), Some(per_token)) = (costs.decode, per_token) else {
        return all;
    };
    if decoding == 0 || bound <= 0.0 || per_token <= 0.0 {
        return all;
    }
    let room = (0.8 * bound - 1.0) * decode;
    ((room / per_token).floor().max(1.0) as usize).min(all)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limits() -> Limits {
        Limits {
            step_tokens: 16,
            max_batch: 4,
            kv_positions: 1000,
            max_queue: 8,
            stages: 1,
        }
    }

    fn waiting(id: u64, prompt: usize, max_new: usize) -> Waiting {
        Waiting {
            id,
            prompt,
            max_new,
        }
    }

    fn running(id: u64, prompt: usize, prefilled: usize) -> Running {
        Running {
            id,
            prompt,
            max_new: 10,
            prefilled,
            in_flight: false,
        }
    }

    #[test]
    fn decode_tokens_come_first_then_prompt_slices_within_the_budget() {
        let r = [
            running(1, 4, 4),
            running(2, 100, 0),
            running(3, 5, 5),
            running(4, 8, 0),
        ];
        let step = next_step(&r, &limits(), usize::MAX);
        assert_eq!(
            step,
            vec![
                Work::Decode { id: 1 },
                Work::Decode { id: 3 },
                Work::Prefill {
                    id: 2,
                    start: 0,
                    len: 14,
                    last: false
                },
            ],
            "two decodes, then the oldest prompt takes the 14 tokens left"
        );
        let tokens: usize = step
            .iter()
            .map(|w| match w {
                Work::Decode { .. } => 1,
                Work::Prefill { len, .. } => *len,
            })
            .sum();
        assert!(tokens <= limits().step_tokens);
    }

    #[test]
    fn a_prompt_is_sliced_across_steps_and_its_last_slice_says_so() {
        let mut r = vec![running(1, 40, 0)];
        let mut slices = Vec::new();
        while !r[0].decoding() {
            let step = next_step(&r, &limits(), usize::MAX);
            let [
                Work::Prefill {
                    start, len, last, ..
                },
            ] = step[..]
            else {
                panic!("one prefill slice: {step:?}");
            };
            assert_eq!(start, r[0].prefilled);
            r[0].prefilled += len;
            slices.push((len, last));
        }
        assert_eq!(slices, vec![(16, false), (16, false), (8, true)]);
        assert_eq!(
            next_step(&r, &limits(), usize::MAX),
            vec![Work::Decode { id: 1 }]
        );
    }

    #[test]
    fn a_long_prompt_never_stops_the_streams() {
        // Four streams and a 4000-token prompt: every step still carries all four.
        let mut r = vec![
            running(1, 3, 3),
            running(2, 3, 3),
            running(3, 3, 3),
            running(9, 4000, 0),
        ];
        for _ in 0..300 {
            let step = next_step(&r, &limits(), usize::MAX);
            let decodes = step
                .iter()
                .filter(|w| matches!(w, Work::Decode { .. }))
                .count();
            assert_eq!(decodes, 3);
            if let Some(Work::Prefill { len, .. }) =
                step.iter().find(|w| matches!(w, Work::Prefill { .. }))
            {
                assert!(*len <= limits().step_tokens - 3);
                r[3].prefilled += len;
            }
        }
        assert!(r[3].prefilled > 0, "the prompt progressed too");
    }

    #[test]
    fn admission_is_first_come_first_served_within_batch_and_memory() {
        let l = limits();
        let w = [
            waiting(1, 100, 100),
            waiting(2, 100, 100),
            waiting(3, 10, 10),
        ];
        assert_eq!(admit(&w, &[], &l), vec![1, 2, 3]);
        // Memory: 600 in use leaves room for two of 200, not a third; the small one
        // behind the one that does not fit waits its turn.
        let busy = [Running {
            id: 7,
            prompt: 300,
            max_new: 300,
            prefilled: 300,
            in_flight: false,
        }];
        let w = [
            waiting(1, 100, 100),
            waiting(2, 100, 100),
            waiting(3, 100, 100),
            waiting(4, 1, 1),
        ];
        assert_eq!(admit(&w, &busy, &l), vec![1, 2]);
        // Batch: four at most.
        let full: Vec<Running> = (10..14).map(|i| running(i, 1, 1)).collect();
        assert!(admit(&[waiting(1, 1, 1)], &full, &l).is_empty());
    }

    #[test]
    fn a_cancelled_sequence_frees_its_room_at_once() {
        let l = Limits {
            max_batch: 1,
            ..limits()
        };
        let mut r = vec![running(1, 10, 10)];
        let w = [waiting(2, 5, 5)];
        assert!(admit(&w, &r, &l).is_empty());
        r.retain(|s| s.id != 1); // cancelled
        assert_eq!(admit(&w, &r, &l), vec![2]);
        assert!(next_step(&r, &l, usize::MAX).is_empty());
    }

    #[test]
    fn the_queue_is_bounded_and_a_request_too_big_for_the_instance_is_known_at_once() {
        let l = limits();
        assert!(may_queue(7, &l));
        assert!(!may_queue(8, &l));
        assert!(fits_at_all(&waiting(1, 500, 500), &l));
        assert!(!fits_at_all(&waiting(1, 900, 101), &l));
    }

    #[test]
    fn every_decoding_sequence_gets_a_token_every_step() {
        // Fairness between streams: no stream is skipped however many there are
        // (the batch limit keeps their number within the budget).
        let r: Vec<Running> = (0..4).map(|i| running(i, 2, 2)).collect();
        for _ in 0..10 {
            let ids: Vec<u64> = next_step(&r, &limits(), usize::MAX)
                .iter()
                .map(|w| match w {
                    Work::Decode { id } => *id,
                    Work::Prefill { id, .. } => *id,
                })
                .collect();
            assert_eq!(ids, vec![0, 1, 2, 3]);
        }
    }

    fn ids(work: &[Work]) -> Vec<u64> {
        work.iter().map(Work::id).collect()
    }

    #[test]
    fn a_pipeline_keeps_a_micro_batch_per_stage_in_flight() {
        let l = Limits {
            stages: 2,
            ..limits()
        };
        // Eight streams over two stages: two micro-batches of four.
        let mut r: Vec<Running> = (0..8).map(|i| running(i, 2, 2)).collect();
        let a = next_step(&r, &l, usize::MAX);
        assert_eq!(ids(&a), vec![0, 1, 2, 3]);
        for s in &mut r[..4] {
            s.in_flight = true;
        }
        let b = next_step(&r, &l, usize::MAX);
        assert_eq!(ids(&b), vec![4, 5, 6, 7]);
        for s in &mut r[4..] {
            s.in_flight = true;
        }
        assert!(next_step(&r, &l, usize::MAX).is_empty(), "both stages busy");
        // The first comes back: its four go again, the others still wait.
        for s in &mut r[..4] {
            s.in_flight = false;
        }
        assert_eq!(ids(&next_step(&r, &l, usize::MAX)), vec![0, 1, 2, 3]);
        // An odd count: shares of five and four; one stream alone goes alone.
        let r: Vec<Running> = (0..9).map(|i| running(i, 2, 2)).collect();
        assert_eq!(next_step(&r, &l, usize::MAX).len(), 5);
        assert_eq!(next_step(&r[..1], &l, usize::MAX).len(), 1);
        // A prompt's slices follow each other through the stages; one whose last slice
        // is in flight (it waits for its first token's logits) sits out.
        let mut r = vec![running(1, 100, 40)];
        assert_eq!(
            next_step(&r, &l, usize::MAX),
            vec![Work::Prefill {
                id: 1,
                start: 40,
                len: 16,
                last: false
            }]
        );
        r[0].prefilled = 100;
        r[0].in_flight = true;
        assert!(next_step(&r, &l, usize::MAX).is_empty());
    }

    #[test]
    fn beside_streams_a_prompt_slice_is_sized_by_time() {
        let l = Limits {
            step_tokens: 256,
            ..limits()
        };
        let mut costs = StepCosts::default();
        assert_eq!(prompt_budget(&costs, 1, 2.0, &l), 255, "nothing known yet");
        // Decode-only steps of 10 ms; a lone 256-token slice of 256 ms: 1 ms a token.
        for _ in 0..20 {
            costs.observe(1, 0, 10.0);
            costs.observe(0, 256, 256.0);
        }
        assert!((costs.decode.unwrap() - 10.0).abs() < 1e-9);
        assert!((costs.per_prompt_token.unwrap() - 1.0).abs() < 1e-9);
        // A bound of 2: (0.8 · 2 − 1) · 10 ms = 6 ms of room, six tokens.
        assert_eq!(prompt_budget(&costs, 1, 2.0, &l), 6);
        // Beside the streams a prompt token costs 2 ms (its own pass through the layers,
        // attention further back): three tokens.
        for _ in 0..40 {
            costs.observe(1, 6, 10.0 + 12.0);
        }
        assert!(
            (costs.per_token_beside.unwrap() - 2.0).abs() < 0.01,
            "{costs:?}"
        );
        assert_eq!(prompt_budget(&costs, 1, 2.0, &l), 3);
        // However tight, a prompt still progresses; without streams or a bound it takes
        // the whole budget.
        assert_eq!(prompt_budget(&costs, 1, 1.0, &l), 1);
        assert_eq!(prompt_budget(&costs, 0, 2.0, &l), 256);
        assert_eq!(prompt_budget(&costs, 3, 0.0, &l), 253);
        // And the step obeys it.
        let r = [running(1, 4, 4), running(2, 100, 0)];
        let step = next_step(&r, &l, prompt_budget(&costs, 1, 2.0, &l));
        assert_eq!(
            step[1],
            Work::Prefill {
                id: 2,
                start: 0,
                len: 3,
                last: false
            }
        );
    }
}
