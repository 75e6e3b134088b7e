//! `shoal bench --node ADDR`: a live instance under concurrent clients. For each
//! concurrency, that many clients each send `--repeat` streaming requests one after
//! another; per request the time to the first text, the gaps between texts (inter-token
//! latency) and its tokens; per run the total tokens per second over the wall time.

use std::io::BufRead;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use serde::Serialize;

/// One request's times and tokens.
struct Sample {
    ttft: Duration,
    gaps: Vec<Duration>,
    /// Generated tokens, as the runner counted them.
    tokens: usize,
    decode: Duration,
    /// Prompt tokens, all and computed (the prefix cache's left out), and the runner's
    /// time for them, from the answer's usage and timings.
    prompt_tokens: usize,
    prompt_computed: usize,
    prefill: Duration,
}

/// One concurrency's figures.
#[derive(Serialize)]
pub struct Row {
    pub clients: usize,
    /// Requests answered (the figures are theirs).
    pub requests: usize,
    /// Requests that failed, each with the node's reason in `errors`.
    pub failed: usize,
    /// Prompt tokens per request, the mean (exactly `--pp` when it is not 0).
    pub prompt_tokens: f64,
    pub total_tok_s: f64,
    pub per_request_tok_s: f64,
    /// Prompt tokens per second of prefill, the mean over requests.
    pub prompt_tok_s: f64,
    pub ttft_p50_ms: f64,
    pub ttft_p99_ms: f64,
    pub itl_p50_ms: f64,
    pub itl_p99_ms: f64,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub errors: Vec<String>,
}

pub struct Options {
    pub node: String,
    pub model: Option<String>,
    pub concurrency: Vec<usize>,
    /// Prompt length in tokens, exactly; 0 is a short chat question.
    pub pp: usize,
    pub tg: usize,
    pub repeat: usize,
    pub warmup: bool,
}

/// `n` token ids, the same for the same `(client, request)` and different otherwise, so
/// that neither the prefix cache nor a repeated word makes the prompt cheaper. The ids
/// lie in 1000..9000: ordinary words in every vocabulary shoal serves (special tokens
/// sit at either end of a vocabulary).
pub(crate) fn prompt_ids(n: usize, client: usize, request: usize) -> Vec<u32> {
    let mut x = (client as u64) << 32 ^ request as u64 ^ 0x9E37_79B9_7F4A_7C15;
    (0..n)
        .map(|_| {
            // xorshift64*
            x ^= x >> 12;
            x ^= x << 25;
            x ^= x >> 27;
            1000 + (x.wrapping_mul(0x2545_F491_4F6C_DD1D) >> 33) as u32 % 8000
        })
        .collect()
}

fn body(o: &Options, client: usize, n: usize) -> serde_json::Value {
    let mut b = serde_json::json!({
        "model": o.model, "max_tokens": o.tg, "temperature": 0,
    });
    if o.pp == 0 {
        b["prompt"] =
            format!("Tell me a long story about a lighthouse, number {client}-{n}.").into();
    } else {
        b["prompt_ids"] = prompt_ids(o.pp, client, n).into();
    }
    b
}

fn one(o: &Options, client: usize, n: usize) -> Result<Sample> {
    let agent: ureq::Agent = ureq::Agent::config_builder()
        .http_status_as_error(false)
        .timeout_connect(Some(Duration::from_secs(5)))
        .build()
        .into();
    let url = format!("http://{}/v1/run", o.node);
    let start = Instant::now();
    let resp = crate::client::keyed(agent.post(&url))
        .send_json(body(o, client, n))
        .with_context(|| format!("cannot reach the node at {}", o.node))?;
    if resp.status().as_u16() != 200 {
        let status = resp.status().as_u16();
        let text = resp.into_body().read_to_string().unwrap_or_default();
        bail!("the node answered {status}: {text}");
    }
    let reader = std::io::BufReader::new(resp.into_body().into_reader());
    let (mut first, mut last, mut gaps) = (None, start, Vec::new());
    for line in reader.lines() {
        let line = line.context("the stream broke")?;
        if line.trim().is_empty() {
            continue;
        }
        let v: serde_json::Value = serde_json::from_str(&line)?;
        if v.get("text").is_some() {
            let now = Instant::now();
            if first.is_some() {
                gaps.push(now - last);
            }
            first.get_or_insert(now);
            last = now;
        } else if v.get("done").is_some() {
            let first = first.unwrap_or(last);
            let usage = |k: &str| v["usage"][k].as_u64().unwrap_or(0) as usize;
            return Ok(Sample {
                ttft: first - start,
                gaps,
                tokens: usage("completion_tokens"),
                prompt_tokens: usage("prompt_tokens"),
                decode: last - first,
                prompt_computed: usage("prompt_tokens").saturating_sub(usage("cached_tokens")),
                prefill: Duration::from_secs_f64(
                    v["timings"]["prefill_ms"].as_f64().unwrap_or(0.0) / 1e3,
                ),
            });
        } else if let Some(e) = v.get("error") {
            bail!("the answer failed: {e}");
        }
    }
    bail!("the stream ended before the answer was done")
}

fn percentile(sorted: &[Duration], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let i = ((sorted.len() - 1) as f64 * p).round() as usize;
    sorted[i].as_secs_f64() * 1e3
}

/// The models of the node's cluster with a ready instance.
pub(crate) fn ready_models(node: &str) -> Result<Vec<String>> {
    let v = crate::node_api::get(node, "/v1/instances")?;
    Ok(v["instances"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|i| i["status"]["state"] == "ready")
        .filter_map(|i| i["model"].as_str().map(str::to_string))
        .collect())
}

/// Runs the bench against an instance that is ready: a request for a model without one
/// would have the node place it (auto-placement), and the figures would be of whatever
/// that became, not of the instance meant.
pub fn run(o: &Options) -> Result<Vec<Row>> {
    if let Some(model) = &o.model {
        let ready = ready_models(&o.node)?;
        if !ready.contains(model) {
            bail!(
                "no ready instance of {model} on the node's cluster (ready: {}); place one \
                 (`shoal place {model}`) or name another with -m: the bench places nothing",
                if ready.is_empty() {
                    "none".to_string()
                } else {
                    ready.join(", ")
                }
            );
        }
    }
    if o.warmup {
        one(o, 0, 0).context("the warm-up request")?;
    }
    let mut rows = Vec::new();
    for &clients in &o.concurrency {
        let started = Instant::now();
        let results: Vec<Result<Sample>> = std::thread::scope(|s| {
            let handles: Vec<_> = (0..clients)
                .map(|c| {
                    s.spawn(move || -> Vec<Result<Sample>> {
                        (0..o.repeat.max(1)).map(|n| one(o, c + 1, n + 1)).collect()
                    })
                })
                .collect();
            handles
                .into_iter()
                .flat_map(|h| {
                    h.join()
                        .unwrap_or_else(|_| vec![Err(anyhow::anyhow!("a client panicked"))])
                })
                .collect()
        });
        let mut errors = Vec::new();
        let mut samples = Vec::new();
        for r in results {
            match r {
                Ok(s) => samples.push(s),
                Err(e) => errors.push(format!("{e:#}")),
            }
        }
        let wall = started.elapsed().as_secs_f64();
        let tokens: usize = samples.iter().map(|s| s.tokens).sum();
        let mut ttft: Vec<Duration> = samples.iter().map(|s| s.ttft).collect();
        ttft.sort();
        let mut gaps: Vec<Duration> = samples.iter().flat_map(|s| s.gaps.clone()).collect();
        gaps.sort();
        let per: Vec<f64> = samples
            .iter()
            .filter(|s| s.tokens > 1 && !s.decode.is_zero())
            .map(|s| (s.tokens - 1) as f64 / s.decode.as_secs_f64())
            .collect();
        let prompt: Vec<f64> = samples
            .iter()
            .filter(|s| s.prompt_computed > 0 && !s.prefill.is_zero())
            .map(|s| s.prompt_computed as f64 / s.prefill.as_secs_f64())
            .collect();
        rows.push(Row {
            clients,
            requests: samples.len(),
            failed: errors.len(),
            prompt_tokens: samples.iter().map(|s| s.prompt_tokens).sum::<usize>() as f64
                / samples.len().max(1) as f64,
            total_tok_s: tokens as f64 / wall,
            per_request_tok_s: per.iter().sum::<f64>() / per.len().max(1) as f64,
            prompt_tok_s: prompt.iter().sum::<f64>() / prompt.len().max(1) as f64,
            ttft_p50_ms: percentile(&ttft, 0.5),
            ttft_p99_ms: percentile(&ttft, 0.99),
            itl_p50_ms: percentile(&gaps, 0.5),
            itl_p99_ms: percentile(&gaps, 0.99),
            errors,
        });
    }
    Ok(rows)
}

/// How many requests failed and the first one's reason, if any did.
pub fn first_failure(rows: &[Row]) -> Option<String> {
    let failed: usize = rows.iter().map(|r| r.failed).sum();
    let first = rows.iter().flat_map(|r| r.errors.first()).next()?;
    Some(format!("{failed} request(s) failed; the first: {first}"))
}

pub fn print(model: &str, rows: &[Row]) {
    println!("{model}:");
    println!(
        "| clients | requests ok | failed | total tok/s | per request tok/s | prompt tok/s | TTFT p50 ms | TTFT p99 ms | ITL p50 ms | ITL p99 ms |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|");
    for r in rows {
        println!(
            "| {} | {} | {} | {:.1} | {:.1} | {:.0} | {:.0} | {:.0} | {:.1} | {:.1} |",
            r.clients,
            r.requests,
            r.failed,
            r.total_tok_s,
            r.per_request_tok_s,
            r.prompt_tok_s,
            r.ttft_p50_ms,
            r.ttft_p99_ms,
            r.itl_p50_ms,
            r.itl_p99_ms
        );
    }
}
