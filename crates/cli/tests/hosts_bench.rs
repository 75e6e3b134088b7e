//! Generation speed across hosts: not a test (it asserts nothing about time), a
//! benchmark that prints a table. Run it by hand:
//!
//!   cargo test --release -p shoal-cli --test hosts_bench -- --ignored --nocapture
//!
//! Two network namespaces; host 2's cable adds 0, 1 or 5 ms each way at 1 Gbit/s (so
//! the one-way latency between the hosts is that much more than the relay's own); one
//! runner thread per node (two one-core machines). For each model: a one-process
//! instance on host 1, then pipeline and tensor over both hosts. Speed is measured at
//! the client (curl-like, on host 1): text pieces per second after the first one, over
//! a 128-token answer, after a warm-up request.
//!
//! SHOAL_BENCH_MODELS picks the models (default "smollm2-135m qwen2.5-coder-0.5b").

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::path::Path;
use std::time::{Duration, Instant};

use serde_json::Value;
use shoal_testbed::{Cluster, Node, Shape, Testbed, eventually, install_from_store, succeed};

const PROMPT: &str = "Write a long story about a lighthouse keeper and a storm.";
const TOKENS: usize = 128;

fn bin() -> &'static Path {
    Path::new(env!("CARGO_BIN_EXE_shoal"))
}

/// Tokens and seconds of one answer through `node`'s HTTP API, read inside its host.
fn generate(c: &Cluster, node: &Node, model: &str, tokens: usize) -> (usize, f64) {
    let body = serde_json::json!({
        "model": model, "prompt": PROMPT, "max_tokens": tokens, "temperature": 0,
    })
    .to_string();
    let mut stream = c
        .bed
        .within(node.host, || {
            TcpStream::connect("127.0.0.1:52415").map_err(|e| shoal_testbed::Error::Io {
                what: "connect to the node".into(),
                source: e,
            })
        })
        .expect("connect");
    stream
        .set_read_timeout(Some(Duration::from_secs(60)))
        .expect("timeout");
    write!(
        stream,
        "POST /v1/run HTTP/1.1\r\nHost: node\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
    .expect("send");
    // Chunked JSON lines; the chunk framing is skipped by looking only at lines that
    // parse as JSON objects.
    let mut reader = BufReader::new(stream);
    let (mut pieces, mut first, mut last) = (0usize, None, Instant::now());
    let mut line = String::new();
    loop {
        line.clear();
        if reader.read_line(&mut line).expect("read") == 0 {
            panic!("the stream ended before done");
        }
        let Ok(v) = serde_json::from_str::<Value>(line.trim()) else {
            continue;
        };
        if v.get("text").is_some() {
            pieces += 1;
            last = Instant::now();
            first.get_or_insert(last);
        } else if v.get("done").is_some() {
            break;
        } else if let Some(e) = v.get("error") {
            panic!("the answer failed: {e}");
        }
    }
    let _ = reader.read_to_end(&mut Vec::new());
    let secs = first.map_or(0.0, |f| (last - f).as_secs_f64());
    (pieces.saturating_sub(1), secs)
}

fn wait_ready(node: &Node, id: &str) {
    eventually(Duration::from_secs(300), "the instance ready", || {
        node.status().is_some_and(|s| {
            s["instances"].as_array().into_iter().flatten().any(|i| {
                if i["id"] == id && i["status"]["state"] == "failed" {
                    panic!("instance failed: {i}");
                }
                i["id"] == id && i["status"]["state"] == "ready"
            })
        })
    });
}

fn place(node: &Node, model: &str, strategy: &str, nodes: usize) -> String {
    let out = node.cli(&[
        "place",
        model,
        "--json",
        "--ctx",
        "1024",
        "--strategy",
        strategy,
        "--nodes",
        &nodes.to_string(),
    ]);
    let v: Value = serde_json::from_str(&succeed(out, "shoal place")).expect("json");
    v["id"].as_str().expect("id").to_string()
}

/// Client-side tokens/s of `model` placed with `strategy` over `hosts` hosts, host 2's
/// cable adding `delay_ms` each way. Each setup gets a cluster of its own, so that one
/// instance at a time holds the cores.
fn measure(model: &str, strategy: &str, hosts: usize, delay_ms: u64) -> f64 {
    let bed = Testbed::for_test(2).expect("namespaces");
    let mut c = Cluster::new(bed, bin());
    for n in &c.nodes {
        install_from_store(bin(), model, &n.dir);
    }
    c.start();
    let everyone: Vec<usize> = (0..2).collect();
    eventually(Duration::from_secs(30), "two nodes, one master", || {
        c.agree(&everyone).is_some()
    });
    c.bed.shape(
        2,
        Shape {
            delay: Duration::from_millis(delay_ms),
            rate: Some(1_000_000_000),
        },
    );
    let id = place(&c.nodes[0], model, strategy, hosts);
    wait_ready(&c.nodes[0], &id);
    // One-process instances may land on either host; ask host 1 (forwarded if needed,
    // which is what a user on host 1 would see).
    generate(&c, &c.nodes[0], model, 8);
    let (tokens, secs) = generate(&c, &c.nodes[0], model, TOKENS);
    tokens as f64 / secs.max(1e-9)
}

#[test]
#[ignore = "a benchmark: run by hand with --ignored --nocapture"]
fn generation_speed_across_hosts() {
    let models = std::env::var("SHOAL_BENCH_MODELS")
        .unwrap_or_else(|_| "smollm2-135m qwen2.5-coder-0.5b".into());
    println!("| model | setup | 0 ms | 1 ms | 5 ms |");
    println!("|---|---|---|---|---|");
    for model in models.split_whitespace() {
        let one = measure(model, "pipeline", 1, 0);
        println!("| {model} | one process | {one:.1} | | |");
        for strategy in ["pipeline", "tensor"] {
            let row: Vec<String> = [0, 1, 5]
                .iter()
                .map(|&d| format!("{:.1}", measure(model, strategy, 2, d)))
                .collect();
            println!("| {model} | {strategy} over 2 | {} |", row.join(" | "));
        }
    }
}
