//! The local benchmark: prompt processing and generation speed, llama-bench style.

use std::time::Instant;

use serde::{Deserialize, Serialize};

use crate::sampling::argmax;
use shoal_model::{BatchPart, KvCache, Tensor};

use crate::{Engine, Result, Session};

/// What to measure.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct BenchConfig {
    /// Prompt tokens per prefill run.
    pub pp: usize,
    /// Tokens per generation run.
    pub tg: usize,
    pub repeat: usize,
    pub prefill_chunk: usize,
    /// Tokens in the cache before each generation run (prefilled, not timed), as
    /// llama-bench's `-d`: generation's rate deep into a context.
    #[serde(default)]
    pub depth: usize,
    /// Sequences decoding together in the generation runs (continuous batching's decode
    /// step: one forward pass over a row of each); 1: a lone sequence.
    #[serde(default = "one")]
    pub batch: usize,
}

fn one() -> usize {
    1
}

/// Median, min and max of repeated measurements.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct Stats {
    pub median: f64,
    pub min: f64,
    pub max: f64,
    pub samples: Vec<f64>,
}

impl Stats {
    pub fn of(mut samples: Vec<f64>) -> Self {
        if samples.is_empty() {
            return Self::default();
        }
        samples.sort_by(f64::total_cmp);
        let n = samples.len();
        let median = if n % 2 == 1 {
            samples[n / 2]
        } else {
            (samples[n / 2 - 1] + samples[n / 2]) / 2.0
        };
        Self {
            median,
            min: samples[0],
            max: samples[n - 1],
            samples,
        }
    }
}

/// Benchmark results, tokens per second.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct BenchReport {
    pub pp: usize,
    pub tg: usize,
    pub repeat: usize,
    #[serde(default)]
    pub depth: usize,
    #[serde(default = "one")]
    pub batch: usize,
    pub prompt: Stats,
    /// Generated tokens per second, of all sequences together.
    pub generation: Stats,
    pub peak_rss_bytes: u64,
}

/// Peak resident memory of this process (VmHWM), 0 where the OS does not say.
pub fn peak_rss_bytes() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmHWM:"))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|kb| kb.parse::<u64>().ok())
        })
        .map_or(0, |kb| kb * 1024)
}

impl Engine {
    /// Measures prefill of `pp` tokens and generation of `tg` tokens from an empty cache,
    /// `repeat` times each after one warm-up. `progress` receives (runs done, runs in all).
    pub fn bench(
        &self,
        config: &BenchConfig,
        progress: &mut dyn FnMut(usize, usize),
    ) -> Result<BenchReport> {
        self.bench_in(&mut self.session(), config, progress)
    }

    /// [`Engine::bench`] on a given session (a model split across ranks).
    pub fn bench_in(
        &self,
        session: &mut dyn Session,
        config: &BenchConfig,
        progress: &mut dyn FnMut(usize, usize),
    ) -> Result<BenchReport> {
        let vocab = self.model().config().vocab_size as u64;
        // Deterministic, spread-out token ids (a real prompt's ids would do as well).
        let tokens: Vec<u32> = (0..config.pp.max(1) as u64)
            .map(|i| ((i * 2_654_435_761 + 17) % vocab) as u32)
            .collect();
        let total = 2 * (config.repeat + 1);
        let mut done = 0;
        let mut prompt = Vec::new();
        let mut generation = Vec::new();
        for run in 0..=config.repeat {
            if config.pp > 0 {
                session.reset()?;
                let t = Instant::now();
                let logits = self.prefill_in(session, &tokens, config.prefill_chunk)?;
                // On a GPU the work is only queued until something reads a result: the
                // clock stops when the logits are on the host.
                logits
                    .to_dtype(shoal_model::DType::F32)?
                    .flatten_all()?
                    .to_vec1::<f32>()?;
                let secs = t.elapsed().as_secs_f64();
                if run > 0 {
                    prompt.push(config.pp as f64 / secs);
                }
            }
            done += 1;
            progress(done, total);
            if config.tg > 0 && config.batch > 1 {
                let rate = self.batched_generation(config)?;
                if run > 0 {
                    generation.push(rate);
                }
            } else if config.tg > 0 {
                session.reset()?;
                if config.depth > 0 {
                    let context: Vec<u32> = (0..config.depth as u64)
                        .map(|i| ((i * 40_503 + 7) % vocab) as u32)
                        .collect();
                    self.prefill_in(session, &context, config.prefill_chunk)?;
                }
                let mut next = tokens[0];
                let t = Instant::now();
                // Where the model has a greedy path (a GPU's chained steps) each step's
                // choice feeds the next there; else a step at a time, the arg-max on the
                // GPU where the logits lie (one id back).
                if session.greedy(next, config.tg, &mut |_| true)?.is_none() {
                    for _ in 0..config.tg {
                        let logits = session.forward(&[next], false)?.squeeze(0)?;
                        next = argmax_rows(&logits)?[0];
                    }
                }
                let secs = t.elapsed().as_secs_f64();
                if run > 0 {
                    generation.push(config.tg as f64 / secs);
                }
            }
            done += 1;
            progress(done, total);
        }
        Ok(BenchReport {
            pp: config.pp,
            tg: config.tg,
            repeat: config.repeat,
            depth: config.depth,
            batch: config.batch,
            prompt: Stats::of(prompt),
            generation: Stats::of(generation),
            peak_rss_bytes: peak_rss_bytes(),
        })
    }

    /// `config.batch` sequences generating `config.tg` tokens each, every step one
    /// batched forward pass over a token of each (the model's continuous batching, as a
    /// runner's step of streams runs it), after a prompt of `depth` tokens (at least 16)
    /// of their own, not timed: total generated tokens per second. This process's whole
    /// model only.
    fn batched_generation(&self, config: &BenchConfig) -> Result<f64> {
        let model = self.model();
        let vocab = model.config().vocab_size as u64;
        let mut caches: Vec<KvCache> = (0..config.batch).map(|_| model.new_cache()).collect();
        let mut next = Vec::with_capacity(config.batch);
        for (i, cache) in caches.iter_mut().enumerate() {
            let prompt: Vec<u32> = (0..config.depth.max(16) as u64)
                .map(|p| ((i as u64 * 7_919 + p * 104_729 + 3) % vocab) as u32)
                .collect();
            let logits = model.forward(&prompt, cache, false)?;
            next.extend(argmax_rows(&logits)?);
        }
        let t = Instant::now();
        for _ in 0..config.tg {
            let h = model.embed(&next)?;
            let mut parts: Vec<BatchPart<'_>> = caches
                .iter_mut()
                .map(|cache| BatchPart { cache, rows: 1 })
                .collect();
            let h = model.forward_layers_batch(h, &mut parts, None)?;
            next = argmax_rows(&model.head_each(&h)?)?;
        }
        Ok((config.batch * config.tg) as f64 / t.elapsed().as_secs_f64())
    }
}

/// Each row's arg-max of logits of one or two dimensions (on a GPU computed there: only
/// the ids come back).
fn argmax_rows(logits: &Tensor) -> Result<Vec<u32>> {
    let logits = logits.to_dtype(shoal_model::DType::F32)?;
    if let Some(ids) = shoal_model::device_argmax(&logits)? {
        return Ok(ids);
    }
    let logits = if logits.rank() == 1 {
        logits.unsqueeze(0)?
    } else {
        logits
    };
    if logits.device().is_cpu() {
        return Ok(logits.to_vec2::<f32>()?.iter().map(|r| argmax(r)).collect());
    }
    Ok(logits.contiguous()?.argmax(1)?.to_vec1::<u32>()?)
}
