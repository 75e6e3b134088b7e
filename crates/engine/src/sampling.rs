//! Choosing the next token from logits: greedy, or temperature with top-k, top-p and
//! min-p, after a repetition penalty and OpenAI's presence and frequency penalties;
//! seeded so a run can be repeated.

use serde::{Deserialize, Serialize};

/// Sampling settings; the defaults are greedy decoding.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct SamplingParams {
    /// 0 picks the most likely token (greedy).
    pub temperature: f32,
    /// Keep the k most likely tokens; 0 keeps all.
    pub top_k: usize,
    /// Keep the smallest set whose probability reaches p; 1 keeps all.
    pub top_p: f32,
    /// Drop tokens less likely than `min_p` times the most likely one; 0 keeps all.
    pub min_p: f32,
    /// Divide positive (multiply negative) logits of recent tokens by this; 1 is off.
    pub repetition_penalty: f32,
    /// How many recent tokens the repetition penalty looks at.
    pub repeat_last_n: usize,
    /// Subtracted from the logit of every token the answer has used (OpenAI's, -2..2).
    #[serde(default)]
    pub presence_penalty: f32,
    /// Subtracted from a token's logit once per use in the answer (OpenAI's, -2..2).
    #[serde(default)]
    pub frequency_penalty: f32,
    pub seed: u64,
}

impl SamplingParams {
    /// Whether the next token is simply the most likely one (so it can be picked where
    /// the logits are, without copying them).
    pub fn is_greedy(&self) -> bool {
        self.temperature <= 0.0
            && (self.repetition_penalty - 1.0).abs() < f32::EPSILON
            && self.presence_penalty == 0.0
            && self.frequency_penalty == 0.0
    }
}

impl Default for SamplingParams {
    fn default() -> Self {
        Self {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            repetition_penalty: 1.0,
            repeat_last_n: 64,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            seed: 0,
        }
    }
}

/// SplitMix64: small, fast, and the same sequence on every platform and version.
#[derive(Clone, Debug)]
struct SplitMix64(u64);

impl SplitMix64 {
    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in [0, 1).
    fn next_f32(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 / (1u64 << 24) as f32
    }
}

/// A sampler for one sequence.
#[derive(Clone, Debug)]
pub struct Sampler {
    params: SamplingParams,
    rng: SplitMix64,
}

impl Sampler {
    pub fn new(params: SamplingParams) -> Self {
        let rng = SplitMix64(params.seed);
        Self { params, rng }
    }

    pub fn params(&self) -> &SamplingParams {
        &self.params
    }

    /// Picks the next token. `history` is the sequence so far (for the repetition
    /// penalty), of which the last `generated` tokens are the answer's (for the presence
    /// and frequency penalties); `logits` may be modified.
    pub fn sample(&mut self, logits: &mut [f32], history: &[u32], generated: usize) -> u32 {
        let p = &self.params;
        if p.presence_penalty != 0.0 || p.frequency_penalty != 0.0 {
            let mut used = history[history.len().saturating_sub(generated)..].to_vec();
            used.sort_unstable();
            for run in used.chunk_by(|a, b| a == b) {
                if let Some(l) = logits.get_mut(run[0] as usize) {
                    *l -= p.presence_penalty + p.frequency_penalty * run.len() as f32;
                }
            }
        }
        if p.repetition_penalty != 1.0 && p.repetition_penalty > 0.0 {
            let start = history.len().saturating_sub(p.repeat_last_n);
            let mut seen = history[start..].to_vec();
            seen.sort_unstable();
            seen.dedup();
            for id in seen {
                if let Some(l) = logits.get_mut(id as usize) {
                    *l = if *l > 0.0 {
                        *l / p.repetition_penalty
                    } else {
                        *l * p.repetition_penalty
                    };
                }
            }
        }
        if p.temperature <= 0.0 {
            return argmax(logits);
        }
        let cands = kept(logits, p);
        if cands.is_empty() {
            return argmax(logits);
        }
        let probs = softmax(&cands, p.temperature);
        let r = self.rng.next_f32();
        let mut acc = 0.0;
        for (c, pr) in cands.iter().zip(&probs) {
            acc += pr;
            if r < acc {
                return c.0;
            }
        }
        cands[cands.len() - 1].0
    }
}

/// The candidates top-k, top-p and min-p keep (finite logits only), most likely first
/// where a cut needed the order. Nothing here sorts the whole vocabulary: a row of
/// 151,936 logits took milliseconds to sort at every token, with the engine's other
/// sequences waiting. Top-p grows the head it orders (64, 512, 4096, … candidates,
/// each chosen by one linear selection) until the head's probability reaches p; with
/// neither top-p nor min-p nor top-k every candidate stays, in the vocabulary's order.
fn kept(logits: &[f32], p: &SamplingParams) -> Vec<(u32, f32)> {
    let mut cands: Vec<(u32, f32)> = logits
        .iter()
        .enumerate()
        .filter(|(_, l)| l.is_finite())
        .map(|(i, &l)| (i as u32, l))
        .collect();
    if cands.is_empty() {
        return cands;
    }
    let by_logit_desc = |a: &(u32, f32), b: &(u32, f32)| b.1.total_cmp(&a.1);
    if p.top_k > 0 && p.top_k < cands.len() {
        cands.select_nth_unstable_by(p.top_k - 1, by_logit_desc);
        cands.truncate(p.top_k);
    }
    let top_p = p.top_p < 1.0;
    if !top_p && p.min_p <= 0.0 {
        return cands;
    }
    // Probabilities at temperature 1 decide top-p and min-p, as llama.cpp does.
    let max = cands.iter().map(|c| c.1).fold(f32::NEG_INFINITY, f32::max);
    // Sums over up to the whole vocabulary in f64: an f32 running sum of 10^5 terms is
    // off by enough to move the top-p cut.
    let weight = |c: &(u32, f32)| f64::from((c.1 - max).exp());
    let total: f64 = if top_p {
        cands.iter().map(weight).sum()
    } else {
        1.0
    };
    if top_p {
        let mut head = 64;
        while head < cands.len() {
            cands.select_nth_unstable_by(head - 1, by_logit_desc);
            let mass = cands[..head].iter().map(weight).sum::<f64>() / total;
            if mass >= f64::from(p.top_p) {
                cands.truncate(head);
                break;
            }
            head *= 8;
        }
    } else {
        // min-p alone: p_i ≥ min_p · p_max is l_i − max ≥ ln min_p (no exponential).
        let floor = p.min_p.ln();
        cands.retain(|c| c.1 - max >= floor);
    }
    cands.sort_unstable_by(by_logit_desc);
    let mut keep = cands.len();
    if top_p {
        let mut acc = 0.0;
        for (i, c) in cands.iter().enumerate() {
            acc += weight(c) / total;
            if acc >= f64::from(p.top_p) {
                keep = i + 1;
                break;
            }
        }
    }
    if p.min_p > 0.0 {
        let floor = f64::from(p.min_p) * weight(&cands[0]);
        keep = keep.min(
            cands
                .iter()
                .take_while(|c| weight(c) >= floor)
                .count()
                .max(1),
        );
    }
    cands.truncate(keep.max(1));
    cands
}

/// Index of the largest logit (the first one on ties).
pub fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &l) in logits.iter().enumerate() {
        if l > logits[best] {
            best = i;
        }
    }
    best as u32
}

fn softmax(cands: &[(u32, f32)], temperature: f32) -> Vec<f32> {
    let max = cands.iter().map(|c| c.1).fold(f32::NEG_INFINITY, f32::max);
    let exps: Vec<f32> = cands
        .iter()
        .map(|c| ((c.1 - max) / temperature).exp())
        .collect();
    let sum: f32 = exps.iter().sum();
    exps.into_iter().map(|e| e / sum).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(f: impl FnOnce(&mut SamplingParams)) -> SamplingParams {
        let mut p = SamplingParams::default();
        f(&mut p);
        p
    }

    #[test]
    fn greedy_picks_the_largest_logit() {
        let mut s = Sampler::new(SamplingParams::default());
        assert_eq!(s.sample(&mut [0.1, 3.0, -1.0, 2.9], &[], 0), 1);
    }

    #[test]
    fn repetition_penalty_can_change_the_greedy_choice() {
        let mut s = Sampler::new(params(|p| p.repetition_penalty = 2.0));
        // 3.0 / 2 = 1.5 < 2.9
        assert_eq!(s.sample(&mut [0.1, 3.0, -1.0, 2.9], &[1], 0), 3);
    }

    #[test]
    fn presence_and_frequency_penalties_count_only_the_answers_tokens() {
        let mut s = Sampler::new(params(|p| p.frequency_penalty = 0.1));
        // Token 1 used twice in the answer: 3.0 - 0.2 = 2.8 < 2.9.
        assert_eq!(s.sample(&mut [0.1, 3.0, -1.0, 2.9], &[1, 1], 2), 3);
        assert_eq!(
            s.sample(&mut [0.1, 3.0, -1.0, 2.9], &[1, 1], 0),
            1,
            "the prompt's"
        );
        let mut s = Sampler::new(params(|p| p.presence_penalty = 0.15));
        assert_eq!(s.sample(&mut [0.1, 3.0, -1.0, 2.9], &[1, 1], 2), 3);
        assert!(!params(|p| p.presence_penalty = 0.5).is_greedy());
    }

    #[test]
    fn top_k_one_is_greedy_whatever_the_temperature() {
        let mut s = Sampler::new(params(|p| {
            p.temperature = 5.0;
            p.top_k = 1;
        }));
        for seed in 0..50 {
            s.rng = SplitMix64(seed);
            assert_eq!(s.sample(&mut [0.0, 1.0, 0.5, 0.99], &[], 0), 1);
        }
    }

    #[test]
    fn min_p_removes_unlikely_tokens() {
        let mut s = Sampler::new(params(|p| {
            p.temperature = 1.0;
            p.min_p = 0.5;
        }));
        // p(0) ≈ 0.84, p(1) ≈ 0.11 < 0.5·0.84: only token 0 survives.
        for _ in 0..100 {
            assert_eq!(s.sample(&mut [4.0, 2.0, 0.0], &[], 0), 0);
        }
    }

    #[test]
    fn top_p_keeps_the_nucleus() {
        let mut s = Sampler::new(params(|p| {
            p.temperature = 1.0;
            p.top_p = 0.5;
        }));
        for _ in 0..100 {
            assert_eq!(s.sample(&mut [1.0, 3.0, 0.0], &[], 0), 1);
        }
    }

    /// The kept set by the plain rule: every finite candidate sorted, then top-k, the
    /// smallest head reaching top-p, and min-p.
    fn kept_by_full_sort(logits: &[f32], p: &SamplingParams) -> Vec<u32> {
        let mut c: Vec<(u32, f32)> = logits
            .iter()
            .enumerate()
            .filter(|(_, l)| l.is_finite())
            .map(|(i, &l)| (i as u32, l))
            .collect();
        c.sort_by(|a, b| b.1.total_cmp(&a.1));
        if p.top_k > 0 {
            c.truncate(p.top_k);
        }
        let max = c[0].1;
        let total: f64 = c.iter().map(|c| f64::from((c.1 - max).exp())).sum();
        let probs: Vec<f64> = c
            .iter()
            .map(|c| f64::from((c.1 - max).exp()) / total)
            .collect();
        let mut keep = c.len();
        let mut acc = 0.0;
        for (i, pr) in probs.iter().enumerate() {
            acc += pr;
            if p.top_p < 1.0 && acc >= f64::from(p.top_p) {
                keep = i + 1;
                break;
            }
        }
        let floor = f64::from(p.min_p) * probs[0];
        keep = keep.min(probs.iter().take_while(|&&pr| pr >= floor).count().max(1));
        c.truncate(keep);
        c.into_iter().map(|c| c.0).collect()
    }

    #[test]
    fn a_large_vocabulary_keeps_what_a_full_sort_keeps() {
        // 151,936 logits like a real row: a few strong tokens over a broad tail, some
        // masked; the nucleus spans from a handful of tokens to thousands.
        let mut rng = SplitMix64(3);
        for spread in [1.0f32, 3.0, 8.0] {
            let logits: Vec<f32> = (0..151_936)
                .map(|i| {
                    if i % 977 == 0 {
                        f32::NEG_INFINITY
                    } else {
                        let u = rng.next_f32();
                        spread * u * u * u * 4.0 + rng.next_f32()
                    }
                })
                .collect();
            for (top_k, top_p, min_p) in [
                (0, 0.9, 0.0),
                (0, 0.99, 0.0),
                (0, 1.0, 0.05),
                (0, 0.95, 0.02),
                (40, 0.9, 0.0),
                (0, 0.5, 0.0),
            ] {
                let p = params(|p| {
                    p.temperature = 0.8;
                    (p.top_k, p.top_p, p.min_p) = (top_k, top_p, min_p);
                });
                let mut fast: Vec<u32> = kept(&logits, &p).into_iter().map(|c| c.0).collect();
                let mut full = kept_by_full_sort(&logits, &p);
                // The same set; the order of equal logits may differ.
                fast.sort_unstable();
                full.sort_unstable();
                let what = format!("spread {spread}, top-k {top_k}, top-p {top_p}, min-p {min_p}");
                assert_eq!(fast.len(), full.len(), "{what}");
                assert!(fast == full, "{what}: the same number, other tokens");
            }
            let all = kept(&logits, &params(|p| p.temperature = 1.0));
            assert_eq!(all.len(), logits.iter().filter(|l| l.is_finite()).count());
        }
    }

    #[test]
    fn sampling_follows_the_distribution_and_the_seed() {
        let p = params(|p| {
            p.temperature = 1.0;
            p.seed = 7;
        });
        let logits = [0.0f32, (3.0f32).ln()]; // probabilities 1/4, 3/4
        let mut s = Sampler::new(p.clone());
        let draws: Vec<u32> = (0..4000)
            .map(|_| s.sample(&mut logits.clone(), &[], 0))
            .collect();
        let ones = draws.iter().filter(|&&d| d == 1).count() as f32 / 4000.0;
        assert!((ones - 0.75).abs() < 0.03, "share of token 1: {ones}");
        let mut again = Sampler::new(p);
        let replay: Vec<u32> = (0..4000)
            .map(|_| again.sample(&mut logits.clone(), &[], 0))
            .collect();
        assert_eq!(draws, replay, "the same seed gives the same draws");
    }
}
