//! `shoal load --node ADDR`: streaming clients against a node for a while, through every
//! API it speaks, with a mix of prompts ([`plan`]) and clients that cancel or walk away;
//! then what became of every request. Nothing may vanish: each request ends as answered
//! (its protocol's end seen), cancelled (by the client, as planned), or failed with the
//! node's error or a stall; a stream that stops without either is counted as vanished.
//! Beside the clients a watcher reads the node's status every second and counts
//! instances that failed or were placed again. Any failure, vanished request, instance
//! failure, or sequence still held once the clients stop makes the exit code non-zero.

mod plan;
mod protocol;
mod watch;

use std::io::BufRead;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Result, bail};
use serde::Serialize;

pub use plan::Kind;
pub use protocol::Api;
use protocol::{Reader, Seen};

#[derive(clap::Args, Debug)]
pub struct LoadArgs {
    /// The node to load (HOST:PORT); `SHOAL_API_KEY` is sent when set.
    #[arg(long, default_value = "127.0.0.1:52415")]
    node: String,
    /// The model to ask, repeatable: client i asks the i-th, in turn (default: the first
    /// with a ready instance).
    #[arg(long, short = 'm')]
    model: Vec<String>,
    #[arg(long, default_value_t = 6)]
    clients: usize,
    /// Seconds the clients keep sending (each finishes the request it is in).
    #[arg(long, default_value_t = 60)]
    duration: u64,
    /// The APIs to speak, in turn: openai, anthropic, ollama, run, or all.
    #[arg(long, default_value = "all")]
    api: String,
    /// Seeds the mix of requests: the same seed sends the same requests.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Seconds a request may take before it counts as stalled.
    #[arg(long, default_value_t = 120)]
    stall: u64,
    /// Faults are being made (a chaos run): failed requests are expected; only a request
    /// that vanished or stalled, or a sequence left held, fails the run.
    #[arg(long)]
    expect_faults: bool,
    /// The report as JSON.
    #[arg(long)]
    json: bool,
}

pub fn command(a: LoadArgs) -> Result<()> {
    let o = Options {
        node: a.node,
        models: a.model,
        clients: a.clients,
        duration: Duration::from_secs(a.duration),
        apis: Api::parse(&a.api).map_err(anyhow::Error::msg)?,
        seed: a.seed,
        stall: Duration::from_secs(a.stall),
        faults_expected: a.expect_faults,
    };
    let r = run(&o)?;
    if a.json {
        println!("{}", serde_json::to_string_pretty(&r)?);
    } else {
        print(&r);
    }
    if !r.passed() {
        bail!(
            "the load run failed: {} failed, {} vanished, {} stalled, {} instance failures, {} stuck",
            r.failed,
            r.vanished,
            r.stalled,
            r.instance_failures,
            r.stuck
        );
    }
    Ok(())
}

pub struct Options {
    pub node: String,
    pub models: Vec<String>,
    pub clients: usize,
    pub duration: Duration,
    pub apis: Vec<Api>,
    pub seed: u64,
    /// A request with no end by then counts as stalled.
    pub stall: Duration,
    pub faults_expected: bool,
}

/// What became of one request.
#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(tag = "outcome", content = "why", rename_all = "snake_case")]
pub enum Outcome {
    Answered,
    Cancelled,
    Failed(String),
    /// The stream stopped with neither its end nor an error.
    Vanished(String),
    /// No end, nor an error, within the stall timeout.
    Stalled(String),
}

#[derive(Debug, Serialize)]
pub struct Record {
    pub client: usize,
    pub model: String,
    pub n: usize,
    pub kind: Kind,
    pub api: Api,
    #[serde(flatten)]
    pub outcome: Outcome,
    /// Seconds from the run's start to this request's.
    pub at_s: f64,
    pub ttft_ms: Option<f64>,
    pub tokens: usize,
    #[serde(skip)]
    gaps: Vec<Duration>,
}

fn agent(timeout: Duration) -> ureq::Agent {
    ureq::Agent::config_builder()
        .http_status_as_error(false)
        .timeout_connect(Some(Duration::from_secs(5)))
        .timeout_global(Some(timeout))
        .build()
        .into()
}

/// Whether a read failed because the request's deadline passed.
fn timed_out(e: &std::io::Error) -> bool {
    e.kind() == std::io::ErrorKind::TimedOut
        || e.get_ref()
            .and_then(|inner| inner.downcast_ref::<ureq::Error>())
            .is_some_and(|u| matches!(u, ureq::Error::Timeout(_)))
}

/// Sends one planned request and follows its answer to the end.
fn one(
    o: &Options,
    model: &str,
    p: &plan::Planned,
) -> (Outcome, Option<Duration>, Vec<Duration>, usize) {
    let url = format!("http://{}{}", o.node, p.api.path());
    let start = Instant::now();
    let body = p.api.body(model, &p.messages, p.max_tokens);
    let req =
        crate::client::keyed(agent(o.stall).post(&url)).header("anthropic-version", "2023-06-01");
    let resp = match req.send_json(body) {
        Ok(r) => r,
        Err(ureq::Error::Timeout(_)) => {
            return (
                Outcome::Stalled(format!("no answer within {:?}", o.stall)),
                None,
                vec![],
                0,
            );
        }
        Err(e) => return (Outcome::Failed(format!("request: {e}")), None, vec![], 0),
    };
    let status = resp.status().as_u16();
    if status != 200 {
        let text = resp.into_body().read_to_string().unwrap_or_default();
        return (
            Outcome::Failed(format!("{status}: {}", text.trim())),
            None,
            vec![],
            0,
        );
    }
    if p.cancel_after == Some(0) {
        return (Outcome::Cancelled, None, vec![], 0);
    }
    let lines = std::io::BufReader::new(resp.into_body().into_reader()).lines();
    follow(p.api, p.cancel_after, o.stall, start, lines)
}

/// Follows an answer's stream line by line to what became of it: its times and texts,
/// and how it ended.
fn follow(
    api: Api,
    cancel_after: Option<usize>,
    stall: Duration,
    start: Instant,
    lines: impl Iterator<Item = std::io::Result<String>>,
) -> (Outcome, Option<Duration>, Vec<Duration>, usize) {
    let mut reader = Reader::default();
    let (mut first, mut last, mut gaps, mut tokens) = (None, start, Vec::new(), 0);
    let outcome = 'read: {
        for line in lines {
            let line = match line {
                Ok(l) => l,
                Err(e) if timed_out(&e) => {
                    break 'read Outcome::Stalled(format!("no end within {stall:?}"));
                }
                Err(e) => {
                    break 'read Outcome::Vanished(format!(
                        "the stream broke with no error in it: {e}"
                    ));
                }
            };
            match reader.line(api, &line) {
                Seen::Text => {
                    let now = Instant::now();
                    if first.is_some() {
                        gaps.push(now - last);
                    }
                    first.get_or_insert(now);
                    last = now;
                    tokens += 1;
                    if cancel_after.is_some_and(|k| tokens >= k) {
                        break 'read Outcome::Cancelled;
                    }
                }
                Seen::End => break 'read Outcome::Answered,
                Seen::Error(e) => break 'read Outcome::Failed(e),
                Seen::Nothing => {}
            }
        }
        Outcome::Vanished("the stream ended with neither the answer's end nor an error".into())
    };
    (outcome, first.map(|f: Instant| f - start), gaps, tokens)
}

/// The whole run's figures.
#[derive(Serialize)]
pub struct Report {
    pub node: String,
    pub models: Vec<String>,
    pub clients: usize,
    pub seconds: f64,
    pub requests: usize,
    pub answered: usize,
    pub cancelled: usize,
    pub failed: usize,
    pub vanished: usize,
    pub stalled: usize,
    /// Failures were expected (a chaos run): only vanished or stalled requests and
    /// sequences left held fail the run.
    pub faults_expected: bool,
    /// Instances that failed, or were placed again, while the clients ran.
    pub instance_failures: usize,
    /// Sequences the node still held 10 s after the clients stopped.
    pub stuck: usize,
    pub tokens: usize,
    pub tok_s: f64,
    pub ttft_p50_ms: f64,
    pub ttft_p99_ms: f64,
    pub itl_p50_ms: f64,
    pub itl_p99_ms: f64,
    /// Per kind: answered, cancelled, failed, vanished or stalled.
    pub by_kind: Vec<(Kind, [usize; 4])>,
    /// What failed, first ones first (at most 20).
    pub failures: Vec<String>,
    pub events: Vec<String>,
}

impl Report {
    pub fn passed(&self) -> bool {
        let lost = self.vanished + self.stalled + self.stuck;
        lost == 0 && (self.faults_expected || self.failed + self.instance_failures == 0)
    }
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    sorted[((sorted.len() - 1) as f64 * p).round() as usize]
}

fn report(
    o: &Options,
    models: &[String],
    records: &[Record],
    wall: Duration,
    w: watch::Watched,
) -> Report {
    let count = |f: &dyn Fn(&Outcome) -> bool| records.iter().filter(|r| f(&r.outcome)).count();
    let mut ttft: Vec<f64> = records.iter().filter_map(|r| r.ttft_ms).collect();
    ttft.sort_by(f64::total_cmp);
    let mut gaps: Vec<f64> = records
        .iter()
        .flat_map(|r| r.gaps.iter().map(|g| g.as_secs_f64() * 1e3))
        .collect();
    gaps.sort_by(f64::total_cmp);
    let mut by_kind = std::collections::BTreeMap::<Kind, [usize; 4]>::new();
    for r in records {
        let slot = match r.outcome {
            Outcome::Answered => 0,
            Outcome::Cancelled => 1,
            Outcome::Failed(_) => 2,
            Outcome::Vanished(_) | Outcome::Stalled(_) => 3,
        };
        by_kind.entry(r.kind).or_default()[slot] += 1;
    }
    let tokens = records.iter().map(|r| r.tokens).sum();
    Report {
        node: o.node.clone(),
        models: models.to_vec(),
        clients: o.clients,
        seconds: wall.as_secs_f64(),
        requests: records.len(),
        answered: count(&|o| *o == Outcome::Answered),
        cancelled: count(&|o| *o == Outcome::Cancelled),
        failed: count(&|o| matches!(o, Outcome::Failed(_))),
        vanished: count(&|o| matches!(o, Outcome::Vanished(_))),
        stalled: count(&|o| matches!(o, Outcome::Stalled(_))),
        faults_expected: o.faults_expected,
        instance_failures: w.instance_failures,
        stuck: w.stuck,
        tokens,
        tok_s: tokens as f64 / wall.as_secs_f64().max(1e-9),
        ttft_p50_ms: percentile(&ttft, 0.5),
        ttft_p99_ms: percentile(&ttft, 0.99),
        itl_p50_ms: percentile(&gaps, 0.5),
        itl_p99_ms: percentile(&gaps, 0.99),
        by_kind: by_kind.into_iter().collect(),
        failures: records
            .iter()
            .filter_map(|r| match &r.outcome {
                Outcome::Failed(w) | Outcome::Vanished(w) | Outcome::Stalled(w) => Some(format!(
                    "at {:.1} s, client {} ({}, {:?}, {:?}): {w}",
                    r.at_s, r.client, r.model, r.api, r.kind
                )),
                _ => None,
            })
            .take(20)
            .collect(),
        events: w.events,
    }
}

/// Runs the clients for the duration; every request they started is in the report.
pub fn run(o: &Options) -> Result<Report> {
    if o.clients == 0 {
        bail!("--clients must be at least 1");
    }
    let models = if o.models.is_empty() {
        match crate::bench_node::ready_models(&o.node)?.into_iter().next() {
            Some(m) => vec![m],
            None => bail!("no ready instance on the node's cluster: name one with --model"),
        }
    } else {
        o.models.clone()
    };
    let stop = AtomicBool::new(false);
    let started = Instant::now();
    let (records, watched) = std::thread::scope(|s| {
        let watcher = s.spawn(|| watch::watch(&o.node, &stop));
        let clients: Vec<_> = (0..o.clients)
            .map(|c| {
                let model = &models[c % models.len()];
                s.spawn(move || {
                    let mut out = Vec::new();
                    let mut n = 0;
                    while started.elapsed() < o.duration {
                        let p = plan::planned(o.seed, c, n, &o.apis);
                        let at_s = started.elapsed().as_secs_f64();
                        let (outcome, ttft, gaps, tokens) = one(o, model, &p);
                        let failed = matches!(outcome, Outcome::Failed(_));
                        out.push(Record {
                            client: c,
                            model: model.clone(),
                            n,
                            kind: p.kind,
                            api: p.api,
                            outcome,
                            at_s,
                            ttft_ms: ttft.map(|t| t.as_secs_f64() * 1e3),
                            tokens,
                            gaps,
                        });
                        n += 1;
                        if failed {
                            // As a real client would, before it asks again.
                            std::thread::sleep(Duration::from_millis(250));
                        }
                    }
                    out
                })
            })
            .collect();
        let records: Vec<Record> = clients
            .into_iter()
            .flat_map(|h| h.join().unwrap_or_default())
            .collect();
        stop.store(true, Ordering::Relaxed);
        let watched = watcher.join().unwrap_or_default();
        (records, watched)
    });
    let wall = started.elapsed();
    Ok(report(o, &models, &records, wall, watched))
}

pub fn print(r: &Report) {
    println!(
        "{} clients for {:.0} s against {} ({}): {} requests: {} answered, {} cancelled, {} failed, {} vanished, {} stalled; {} instance failures, {} sequences stuck",
        r.clients,
        r.seconds,
        r.node,
        r.models.join(", "),
        r.requests,
        r.answered,
        r.cancelled,
        r.failed,
        r.vanished,
        r.stalled,
        r.instance_failures,
        r.stuck
    );
    println!(
        "{} tokens, {:.1} tok/s; time to first token p50 {:.0} ms, p99 {:.0} ms; between tokens p50 {:.1} ms, p99 {:.1} ms",
        r.tokens, r.tok_s, r.ttft_p50_ms, r.ttft_p99_ms, r.itl_p50_ms, r.itl_p99_ms
    );
    println!("| kind | answered | cancelled | failed | vanished |");
    println!("|---|---|---|---|---|");
    for (k, [a, c, f, v]) in &r.by_kind {
        println!("| {k:?} | {a} | {c} | {f} | {v} |");
    }
    for e in &r.events {
        println!("instance: {e}");
    }
    for f in &r.failures {
        println!("failed: {f}");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ended(
        api: Api,
        cancel_after: Option<usize>,
        lines: Vec<std::io::Result<&str>>,
    ) -> (Outcome, usize) {
        let lines = lines.into_iter().map(|l| l.map(str::to_string));
        let (outcome, _, _, tokens) = follow(
            api,
            cancel_after,
            Duration::from_secs(1),
            Instant::now(),
            lines,
        );
        (outcome, tokens)
    }

    #[test]
    fn a_stream_is_answered_cancelled_failed_or_vanished() {
        let text = r#"{"text":"a"}"#;
        assert_eq!(
            ended(
                Api::Run,
                None,
                vec![Ok(text), Ok(""), Ok(r#"{"done":true}"#)]
            ),
            (Outcome::Answered, 1)
        );
        assert_eq!(
            ended(Api::Run, Some(2), vec![Ok(text), Ok(text), Ok(text)]),
            (Outcome::Cancelled, 2)
        );
        assert_eq!(
            ended(
                Api::Run,
                None,
                vec![Ok(text), Ok(r#"{"error":"rank 1 died"}"#)]
            ),
            (Outcome::Failed("rank 1 died".into()), 1)
        );
        // Ended, or broken off, with neither an end nor an error: vanished.
        assert!(matches!(
            ended(Api::Run, None, vec![Ok(text)]).0,
            Outcome::Vanished(_)
        ));
        let broken = std::io::Error::new(std::io::ErrorKind::ConnectionReset, "reset");
        assert!(matches!(
            ended(Api::Run, None, vec![Ok(text), Err(broken)]).0,
            Outcome::Vanished(_)
        ));
        let late = std::io::Error::new(std::io::ErrorKind::TimedOut, "late");
        assert!(matches!(
            ended(Api::OpenAi, None, vec![Err(late)]).0,
            Outcome::Stalled(_)
        ));
    }

    fn record(kind: Kind, outcome: Outcome) -> Record {
        Record {
            client: 0,
            model: "m".into(),
            n: 0,
            kind,
            api: Api::Run,
            outcome,
            at_s: 0.0,
            ttft_ms: Some(10.0),
            tokens: 3,
            gaps: vec![Duration::from_millis(5)],
        }
    }

    #[test]
    fn the_report_counts_every_request_and_fails_on_any_loss() {
        let o = Options {
            node: "n".into(),
            models: vec![],
            clients: 1,
            duration: Duration::from_secs(1),
            apis: Api::ALL.to_vec(),
            seed: 1,
            stall: Duration::from_secs(1),
            faults_expected: false,
        };
        let models = ["m".to_string()];
        let mut records = vec![
            record(Kind::Short, Outcome::Answered),
            record(Kind::CancelMidway, Outcome::Cancelled),
        ];
        let r = report(
            &o,
            &models,
            &records,
            Duration::from_secs(1),
            Default::default(),
        );
        assert!(r.passed() && r.requests == 2 && r.answered == 1 && r.cancelled == 1);
        assert_eq!(r.tokens, 6);
        records.push(record(Kind::Long, Outcome::Vanished("cut".into())));
        let r = report(
            &o,
            &models,
            &records,
            Duration::from_secs(1),
            Default::default(),
        );
        assert!(!r.passed() && r.vanished == 1 && r.failures.len() == 1);
        let stuck = watch::Watched {
            stuck: 1,
            ..Default::default()
        };
        let r = report(&o, &models, &records[..2], Duration::from_secs(1), stuck);
        assert!(!r.passed());
    }
}
