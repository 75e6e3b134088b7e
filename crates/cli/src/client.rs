//! The subcommands that talk to a running node over its HTTP API (`status`, `place`,
//! `delete`, `run --node`), and the keyed, time-bounded requests they share with the
//! benchmarks.

use std::io::Write;
use std::time::Duration;

use anyhow::{Context, Result, bail};

use crate::args::RunArgs;

/// A request to a node, with the API key of `SHOAL_API_KEY` when there is one.
pub(crate) fn keyed<B>(req: ureq::RequestBuilder<B>) -> ureq::RequestBuilder<B> {
    match std::env::var("SHOAL_API_KEY") {
        Ok(k) if !k.trim().is_empty() => {
            req.header("authorization", format!("Bearer {}", k.trim()))
        }
        _ => req,
    }
}

fn agent() -> ureq::Agent {
    ureq::Agent::config_builder()
        .max_redirects(0)
        .http_status_as_error(false)
        .timeout_connect(Some(Duration::from_secs(5)))
        .build()
        .into()
}

/// The error a node answered with, from its JSON body.
fn node_error(status: u16, body: &str) -> anyhow::Error {
    let msg = serde_json::from_str::<serde_json::Value>(body)
        .ok()
        .and_then(|v| {
            let e = v.get("error")?;
            e.as_str()
                .or(e.get("message")?.as_str())
                .map(str::to_string)
        })
        .unwrap_or_else(|| body.trim().to_string());
    anyhow::anyhow!("the node answered {status}: {msg}")
}

fn get_json(node: &str, path: &str) -> Result<serde_json::Value> {
    let url = format!("http://{node}{path}");
    let sent = keyed(agent().get(&url))
        .config()
        .timeout_global(Some(Duration::from_secs(30)))
        .build()
        .call();
    read_answer(node, sent)
}

/// A node's answer: its JSON body, or the error it answered with.
fn read_answer(
    node: &str,
    sent: Result<ureq::http::Response<ureq::Body>, ureq::Error>,
) -> Result<serde_json::Value> {
    let resp = sent.with_context(|| format!("cannot reach the node at {node}"))?;
    let status = resp.status().as_u16();
    let body = resp.into_body().read_to_string()?;
    if status != 200 {
        return Err(node_error(status, &body));
    }
    Ok(serde_json::from_str(&body)?)
}

fn post_json(node: &str, path: &str, body: &serde_json::Value) -> Result<serde_json::Value> {
    let url = format!("http://{node}{path}");
    let sent = keyed(agent().post(&url))
        .config()
        .timeout_global(Some(Duration::from_secs(60)))
        .build()
        .send_json(body);
    read_answer(node, sent)
}

pub(crate) fn delete(node: &str, instance: &str) -> Result<()> {
    let url = format!("http://{node}/v1/instances/{instance}");
    let sent = keyed(agent().delete(&url))
        .config()
        .timeout_global(Some(Duration::from_secs(30)))
        .build()
        .call();
    read_answer(node, sent)?;
    println!("deleted {instance}");
    Ok(())
}

pub(crate) fn status(node: &str, json: bool) -> Result<()> {
    let v = get_json(node, "/v1/status")?;
    if json {
        println!("{}", serde_json::to_string_pretty(&v)?);
        return Ok(());
    }
    let s = |v: &serde_json::Value| v.as_str().unwrap_or("-").to_string();
    println!("node   {}", s(&v["node_id"]));
    println!(
        "master {} (term {}, index {})",
        s(&v["master_id"]),
        v["term"],
        v["index"]
    );
    println!("nodes:");
    for n in v["nodes"].as_array().into_iter().flatten() {
        let r = &n["resources"];
        let b = &r["backend"];
        let gpus = match b["kind"].as_str() {
            Some("cuda") => format!(
                "  {} x {} ({}/{} MiB free each)",
                b["count"].as_u64().unwrap_or(1),
                s(&b["name"]),
                b["memory_free"].as_u64().unwrap_or(0) >> 20,
                b["memory_total"].as_u64().unwrap_or(0) >> 20,
            ),
            _ => String::new(),
        };
        println!(
            "  {}  http {}  memory {}/{} MiB free  cores {}{gpus}  models {}",
            s(&n["id"]),
            s(&n["http"]),
            r["memory_free"].as_u64().unwrap_or(0) >> 20,
            r["memory_total"].as_u64().unwrap_or(0) >> 20,
            r["cores"],
            n["models"]
        );
    }
    println!("instances:");
    for i in v["instances"].as_array().into_iter().flatten() {
        println!(
            "  {}  {}  {}  {}",
            s(&i["id"]),
            s(&i["model"]),
            s(&i["strategy"]),
            i["status"]
        );
        for (r, slot) in i["ranks"].as_array().into_iter().flatten().enumerate() {
            let on = slot["gpu"]
                .as_u64()
                .map_or(String::new(), |g| format!(" GPU {g}"));
            println!(
                "    rank {r}: {}{on}  port {}  {}",
                s(&slot["node"]),
                slot["port"].as_u64().map_or("-".into(), |p| p.to_string()),
                slot["status"]
            );
        }
    }
    Ok(())
}

pub(crate) fn place(
    node: &str,
    model: &str,
    preview: bool,
    strategy: Option<String>,
    nodes: Option<usize>,
    ctx: Option<usize>,
    json: bool,
) -> Result<()> {
    let body = serde_json::json!({
        "model": model, "strategy": strategy, "nodes": nodes, "ctx": ctx, "preview": preview,
    });
    let v = post_json(node, "/v1/place", &body)?;
    if json {
        println!("{}", serde_json::to_string_pretty(&v)?);
        return Ok(());
    }
    if preview {
        for p in v.as_array().into_iter().flatten() {
            let mem: Vec<String> = p["memory"]
                .as_array()
                .into_iter()
                .flatten()
                .map(|m| format!("{} MiB", m.as_u64().unwrap_or(0) >> 20))
                .collect();
            let gpus: Vec<String> = p["gpus"]
                .as_array()
                .into_iter()
                .flatten()
                .map(|g| g.as_u64().map_or(String::new(), |g| format!(" GPU {g}")))
                .chain(std::iter::repeat(String::new()))
                .take(mem.len())
                .collect();
            println!(
                "{:<9} over {} rank(s): {}",
                p["strategy"].as_str().unwrap_or(""),
                p["nodes"].as_array().map_or(0, Vec::len),
                p["nodes"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .zip(&mem)
                    .zip(&gpus)
                    .map(|((n, m), g)| format!("{}{g} {m}", n.as_str().unwrap_or("")))
                    .collect::<Vec<_>>()
                    .join(", ")
            );
        }
    } else {
        println!(
            "placed {} ({} over {} node(s))",
            v["id"].as_str().unwrap_or(""),
            v["strategy"].as_str().unwrap_or(""),
            v["ranks"].as_array().map_or(0, Vec::len)
        );
    }
    Ok(())
}

/// A node that sends nothing for this long (not even its one-second keepalive) has
/// lost the connection or froze.
const NODE_SILENCE: Duration = Duration::from_secs(8);

pub(crate) fn run_remote(node: &str, args: &RunArgs) -> Result<()> {
    let model = &args.model.model;
    let body = serde_json::json!({
        "model": model,
        "prompt": args.prompt.clone().unwrap_or_default(),
        "raw": args.raw,
        "max_tokens": args.max_tokens,
        "temperature": args.temperature,
        "seed": args.seed,
    });
    let url = format!("http://{node}/v1/run");
    let resp = keyed(agent().post(&url))
        .send_json(&body)
        .with_context(|| format!("cannot reach the node at {node}"))?;
    let status = resp.status().as_u16();
    if status != 200 {
        let text = resp.into_body().read_to_string().unwrap_or_default();
        return Err(node_error(status, &text));
    }
    // Lines are read on a thread of their own so that a silent connection (a cut cable
    // sends nothing, not even an end) is noticed here with a deadline.
    let reader = std::io::BufReader::new(resp.into_body().into_reader());
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in std::io::BufRead::lines(reader) {
            let failed = line.is_err();
            if tx.send(line).is_err() || failed {
                return;
            }
        }
    });
    let mut out = std::io::stdout().lock();
    loop {
        let line = match rx.recv_timeout(NODE_SILENCE) {
            Ok(Ok(l)) => l,
            Ok(Err(e)) => {
                writeln!(out)?;
                bail!("the answer's stream from {node} broke: {e}");
            }
            Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {
                writeln!(out)?;
                bail!(
                    "no word from the node at {node} for {NODE_SILENCE:?}: the connection is cut or the node froze"
                );
            }
            Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => {
                writeln!(out)?;
                bail!("the node at {node} ended the stream before the answer was complete");
            }
        };
        if line.trim().is_empty() {
            continue; // keepalive
        }
        let v: serde_json::Value = serde_json::from_str(&line)
            .with_context(|| format!("the node sent a line that is not JSON: {line:?}"))?;
        if let Some(t) = v.get("text").and_then(|t| t.as_str()) {
            out.write_all(t.as_bytes())?;
            out.flush()?;
        } else if v.get("done").is_some() {
            writeln!(out)?;
            return Ok(());
        } else if let Some(e) = v.get("error") {
            writeln!(out)?;
            bail!("{}", e.as_str().unwrap_or("the answer failed"));
        }
    }
}
