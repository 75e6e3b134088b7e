//! `shoal bench --node ADDR --sweep`: the bench over strategies and rank counts, each
//! instance placed by the sweep itself (and deleted after), over prompt lengths,
//! generation lengths and client counts; per run the bench's figures, the requests that
//! failed and each node's peak memory in use. A table, JSON, and an SVG plot of total
//! tokens per second against clients, one line per instance and lengths.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use serde::Serialize;
use serde_json::{Value, json};

use crate::bench_node;

pub struct Options {
    pub node: String,
    pub model: String,
    pub strategies: Vec<String>,
    pub ranks: Vec<usize>,
    pub pp: Vec<usize>,
    pub tg: Vec<usize>,
    pub concurrency: Vec<usize>,
    pub repeat: usize,
    pub ctx: usize,
}

/// One instance's runs at one prompt and generation length.
#[derive(Serialize)]
pub struct Run {
    pub strategy: String,
    pub ranks: usize,
    pub pp: usize,
    pub tg: usize,
    pub rows: Vec<bench_node::Row>,
    /// Why the run (or the instance) failed, if it did.
    pub failed: Option<String>,
    /// Per node (host name and id's end): the most memory in use seen during the run,
    /// in the node's own 256 MiB steps.
    pub peak_memory: Vec<(String, u64)>,
}

fn call(node: &str, method: &str, path: &str, body: Option<Value>) -> Result<Value> {
    crate::node_api::call(node, method, path, body, Duration::from_secs(30))
}

fn instances(node: &str) -> Result<Vec<Value>> {
    Ok(call(node, "GET", "/v1/instances", None)?["instances"]
        .as_array()
        .cloned()
        .unwrap_or_default())
}

/// Places an instance and waits until it is ready: its id.
fn place(o: &Options, strategy: &str, ranks: usize) -> Result<String> {
    let body = json!({ "model": o.model, "strategy": strategy, "nodes": ranks, "ctx": o.ctx });
    let placed = call(&o.node, "POST", "/v1/place", Some(body))?;
    let id = placed["id"]
        .as_str()
        .context("the placed instance's id")?
        .to_string();
    let deadline = Instant::now() + Duration::from_secs(300);
    loop {
        let state = instances(&o.node)?
            .into_iter()
            .find(|i| i["id"] == id.as_str())
            .map(|i| i["status"].clone());
        match state {
            Some(s) if s["state"] == "ready" => return Ok(id),
            Some(s) if s["state"] == "failed" => bail!("instance {id} failed: {}", s["reason"]),
            None => bail!("instance {id} was removed before it was ready"),
            Some(_) if Instant::now() > deadline => bail!("instance {id} not ready in 300 s"),
            Some(_) => std::thread::sleep(Duration::from_millis(250)),
        }
    }
}

/// Polls every node's memory in use until `stop`; the largest seen per node.
fn watch_memory(node: &str, stop: &AtomicBool) -> Vec<(String, u64)> {
    let mut peak: Vec<(String, u64)> = Vec::new();
    while !stop.load(Ordering::Relaxed) {
        if let Ok(s) = call(node, "GET", "/v1/status", None) {
            for n in s["nodes"].as_array().into_iter().flatten() {
                let id = n["id"].as_str().unwrap_or_default();
                let name = format!(
                    "{} ·{}",
                    n["hostname"].as_str().unwrap_or("node"),
                    &id[id.len().saturating_sub(6)..]
                );
                let r = &n["resources"];
                let used = r["memory_total"].as_u64().unwrap_or(0)
                    - r["memory_free"].as_u64().unwrap_or(0);
                match peak.iter_mut().find(|(n, _)| *n == name) {
                    Some(p) => p.1 = p.1.max(used),
                    None => peak.push((name, used)),
                }
            }
        }
        std::thread::sleep(Duration::from_millis(500));
    }
    peak
}

fn bench(o: &Options, pp: usize, tg: usize) -> (Result<Vec<bench_node::Row>>, Vec<(String, u64)>) {
    let stop = AtomicBool::new(false);
    std::thread::scope(|s| {
        let watcher = s.spawn(|| watch_memory(&o.node, &stop));
        let rows = bench_node::run(&bench_node::Options {
            node: o.node.clone(),
            model: Some(o.model.clone()),
            concurrency: o.concurrency.clone(),
            pp,
            tg,
            repeat: o.repeat,
            warmup: true,
        });
        stop.store(true, Ordering::Relaxed);
        (rows, watcher.join().unwrap_or_default())
    })
}

pub fn run(o: &Options) -> Result<Vec<Run>> {
    let mine: Vec<String> = instances(&o.node)?
        .iter()
        .filter(|i| i["model"] == o.model.as_str())
        .filter_map(|i| i["id"].as_str().map(str::to_string))
        .collect();
    if !mine.is_empty() {
        bail!(
            "the sweep places its own instances of {}, and the cluster has some already \
             (requests could reach either): delete them first (`shoal delete {}`)",
            o.model,
            mine.join(" ")
        );
    }
    let mut runs = Vec::new();
    for (i, strategy) in o.strategies.iter().enumerate() {
        for &ranks in &o.ranks {
            // One rank is the whole model whatever the strategy: measured once.
            if ranks == 1 && i > 0 {
                continue;
            }
            eprintln!("placing {} as {strategy} over {ranks} rank(s)…", o.model);
            let placed = place(o, strategy, ranks);
            for &pp in &o.pp {
                for &tg in &o.tg {
                    let (rows, peak_memory, failed) = match &placed {
                        Err(e) => (Vec::new(), Vec::new(), Some(format!("{e:#}"))),
                        Ok(_) => {
                            eprintln!("  pp {pp}, tg {tg}, clients {:?}", o.concurrency);
                            match bench(o, pp, tg) {
                                (Ok(rows), peak) => (rows, peak, None),
                                (Err(e), peak) => (Vec::new(), peak, Some(format!("{e:#}"))),
                            }
                        }
                    };
                    runs.push(Run {
                        strategy: strategy.clone(),
                        ranks,
                        pp,
                        tg,
                        rows,
                        failed,
                        peak_memory,
                    });
                }
            }
            if let Ok(id) = placed {
                call(&o.node, "DELETE", &format!("/v1/instances/{id}"), None)
                    .with_context(|| format!("deleting instance {id}"))?;
            }
        }
    }
    Ok(runs)
}

/// The first failed run or request, said with its instance and lengths.
pub fn first_failure(runs: &[Run]) -> Option<String> {
    runs.iter().find_map(|r| {
        let why = r
            .failed
            .clone()
            .or_else(|| crate::bench_node::first_failure(&r.rows))?;
        Some(format!(
            "{} ×{} pp {} tg {}: {why}",
            r.strategy, r.ranks, r.pp, r.tg
        ))
    })
}

pub fn print(model: &str, runs: &[Run]) {
    println!("{model}:");
    println!(
        "| strategy | ranks | pp | tg | clients | ok | failed | total tok/s | per request tok/s | prompt tok/s | TTFT p50 ms | ITL p50 ms | peak memory in use |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|---|---|---|");
    for r in runs {
        let memory = r
            .peak_memory
            .iter()
            .map(|(n, b)| format!("{n} {:.1} GiB", *b as f64 / (1u64 << 30) as f64))
            .collect::<Vec<_>>()
            .join(", ");
        if let Some(why) = &r.failed {
            println!(
                "| {} | {} | {} | {} | – | – | – | failed: {why} | | | | | {memory} |",
                r.strategy, r.ranks, r.pp, r.tg
            );
        }
        for row in &r.rows {
            println!(
                "| {} | {} | {} | {} | {} | {} | {} | {:.1} | {:.1} | {:.0} | {:.0} | {:.1} | {memory} |",
                r.strategy,
                r.ranks,
                r.pp,
                r.tg,
                row.clients,
                row.requests,
                row.failed,
                row.total_tok_s,
                row.per_request_tok_s,
                row.prompt_tok_s,
                row.ttft_p50_ms,
                row.itl_p50_ms
            );
        }
    }
}

/// Total tokens per second against clients, a line per instance and lengths.
pub fn plot(model: &str, runs: &[Run], path: &std::path::Path) -> Result<()> {
    use plotters::prelude::*;
    let xmax = runs
        .iter()
        .flat_map(|r| r.rows.iter().map(|w| w.clients))
        .max()
        .unwrap_or(1) as f64;
    let ymax = runs
        .iter()
        .flat_map(|r| r.rows.iter().map(|w| w.total_tok_s))
        .fold(1.0, f64::max)
        * 1.1;
    let root = SVGBackend::new(path, (900, 520)).into_drawing_area();
    let draw = || -> Result<(), Box<dyn std::error::Error>> {
        root.fill(&WHITE)?;
        let mut chart = ChartBuilder::on(&root)
            .caption(
                format!("{model}: total generation tok/s"),
                ("sans-serif", 22),
            )
            .margin(14)
            .x_label_area_size(40)
            .y_label_area_size(60)
            .build_cartesian_2d(0f64..xmax * 1.05, 0f64..ymax)?;
        chart
            .configure_mesh()
            .x_desc("concurrent clients")
            .x_label_formatter(&|x| format!("{x:.0}"))
            .light_line_style(RGBColor(238, 238, 238))
            .y_desc("tok/s")
            .draw()?;
        for (i, r) in runs.iter().filter(|r| !r.rows.is_empty()).enumerate() {
            let color = Palette99::pick(i).to_rgba();
            let points: Vec<(f64, f64)> = r
                .rows
                .iter()
                .map(|w| (w.clients as f64, w.total_tok_s))
                .collect();
            let label = format!("{} ×{}, pp {}, tg {}", r.strategy, r.ranks, r.pp, r.tg);
            chart
                .draw_series(LineSeries::new(points.clone(), color.stroke_width(2)))?
                .label(label)
                .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], color));
            chart.draw_series(
                points
                    .into_iter()
                    .map(|p| Circle::new(p, 3, color.filled())),
            )?;
        }
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::UpperLeft)
            .background_style(WHITE.mix(0.9))
            .border_style(BLACK)
            .draw()?;
        root.present()?;
        Ok(())
    };
    draw().map_err(|e| anyhow::anyhow!("the plot {}: {e}", path.display()))
}
