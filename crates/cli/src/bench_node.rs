//! `shoal bench --node ADDR`: a live instance under concurrent clients. For each
//! concurrency, that many clients each send `--repeat` streaming requests one after
//! another; per request the time to the first text, the gaps between texts (inter-token
//! latency) and its tokens; per run the total tokens per second over the wall time.

use std::io::BufRead;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use serde::Serialize;

/// One request's times.
struct Sample {
    ttft: Duration,
    gaps: Vec<Duration>,
    tokens: usize,
    decode: Duration,
}

/// One concurrency's figures.
#[derive(Serialize)]
pub struct Row {
    pub clients: usize,
    pub requests: usize,
    pub total_tok_s: f64,
    pub per_request_tok_s: f64,
    pub ttft_p50_ms: f64,
    pub ttft_p99_ms: f64,
    pub itl_p50_ms: f64,
    pub itl_p99_ms: f64,
}

pub struct Options {
    pub node: String,
    pub model: Option<String>,
    pub concurrency: Vec<usize>,
    /// Prompt length in (about) tokens; 0 is a short chat question.
    pub pp: usize,
    pub tg: usize,
    pub repeat: usize,
    pub warmup: bool,
}

fn body(o: &Options, client: usize, n: usize) -> serde_json::Value {
    let (prompt, raw) = if o.pp == 0 {
        (
            format!("Tell me a long story about a lighthouse, number {client}-{n}."),
            false,
        )
    } else {
        // A repeated word is about one token each; a distinct head keeps prompts apart.
        (format!("{client} {n} {}", "lighthouse ".repeat(o.pp)), true)
    };
    serde_json::json!({
        "model": o.model, "prompt": prompt, "raw": raw, "max_tokens": o.tg, "temperature": 0,
    })
}

fn one(o: &Options, client: usize, n: usize) -> Result<Sample> {
    let agent: ureq::Agent = ureq::Agent::config_builder()
        .http_status_as_error(false)
        .timeout_connect(Some(Duration::from_secs(5)))
        .build()
        .into();
    let url = format!("http://{}/v1/run", o.node);
    let start = Instant::now();
    let resp = crate::commands::keyed(agent.post(&url))
        .send_json(body(o, client, n))
        .with_context(|| format!("cannot reach the node at {}", o.node))?;
    if resp.status().as_u16() != 200 {
        let status = resp.status().as_u16();
        let text = resp.into_body().read_to_string().unwrap_or_default();
        bail!("the node answered {status}: {text}");
    }
    let reader = std::io::BufReader::new(resp.into_body().into_reader());
    let (mut first, mut last, mut gaps, mut tokens) = (None, start, Vec::new(), 0);
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
            tokens += 1;
        } else if v.get("done").is_some() {
            let first = first.unwrap_or(last);
            return Ok(Sample {
                ttft: first - start,
                gaps,
                tokens,
                decode: last - first,
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

/// Runs every concurrency in turn.
/// The models of the node's cluster with a ready instance.
pub(crate) fn ready_models(node: &str) -> Result<Vec<String>> {
    let agent: ureq::Agent = ureq::Agent::config_builder()
        .http_status_as_error(false)
        .timeout_global(Some(Duration::from_secs(10)))
        .build()
        .into();
    let url = format!("http://{node}/v1/instances");
    let resp = crate::commands::keyed(agent.get(&url))
        .call()
        .with_context(|| format!("cannot reach the node at {node}"))?;
    let status = resp.status().as_u16();
    let text = resp.into_body().read_to_string().unwrap_or_default();
    if status != 200 {
        bail!("the node answered {status} to GET /v1/instances: {text}");
    }
    let v: serde_json::Value = serde_json::from_str(&text).context("the node's instances")?;
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
        let samples: Vec<Sample> = std::thread::scope(|s| {
            let handles: Vec<_> = (0..clients)
                .map(|c| {
                    s.spawn(move || -> Result<Vec<Sample>> {
                        (0..o.repeat.max(1)).map(|n| one(o, c + 1, n + 1)).collect()
                    })
                })
                .collect();
            handles
                .into_iter()
                .map(|h| h.join().map_err(|_| anyhow::anyhow!("a client panicked"))?)
                .collect::<Result<Vec<Vec<Sample>>>>()
                .map(|v| v.into_iter().flatten().collect())
        })?;
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
        rows.push(Row {
            clients,
            requests: samples.len(),
            total_tok_s: tokens as f64 / wall,
            per_request_tok_s: per.iter().sum::<f64>() / per.len().max(1) as f64,
            ttft_p50_ms: percentile(&ttft, 0.5),
            ttft_p99_ms: percentile(&ttft, 0.99),
            itl_p50_ms: percentile(&gaps, 0.5),
            itl_p99_ms: percentile(&gaps, 0.99),
        });
    }
    Ok(rows)
}

pub fn print(model: &str, rows: &[Row]) {
    println!("{model}:");
    println!(
        "| clients | requests | total tok/s | per request tok/s | TTFT p50 ms | TTFT p99 ms | ITL p50 ms | ITL p99 ms |"
    );
    println!("|---|---|---|---|---|---|---|---|");
    for r in rows {
        println!(
            "| {} | {} | {:.1} | {:.1} | {:.0} | {:.0} | {:.1} | {:.1} |",
            r.clients,
            r.requests,
            r.total_tok_s,
            r.per_request_tok_s,
            r.ttft_p50_ms,
            r.ttft_p99_ms,
            r.itl_p50_ms,
            r.itl_p99_ms
        );
    }
}
