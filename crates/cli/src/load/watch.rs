//! The load run's watcher: the node's status every second while the clients run, to
//! count instances that fail or are placed again; then, once the clients stop, how many
//! sequences the node's rank-0 runners still hold after a grace period (stuck ones).

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use anyhow::Result;
use serde_json::Value;

/// After the clients stop, how long the node has to let go of every sequence.
const DRAIN: Duration = Duration::from_secs(10);

#[derive(Default)]
pub struct Watched {
    pub instance_failures: usize,
    pub stuck: usize,
    /// What happened to instances, for the report.
    pub events: Vec<String>,
}

fn status(node: &str) -> Result<Value> {
    crate::node_api::get(node, "/v1/status")
}

/// Per instance id: its state and attempt.
fn instances(s: &Value) -> HashMap<String, (String, u64)> {
    s["instances"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|i| {
            let id = i["id"].as_str()?.to_string();
            let state = i["status"]["state"].as_str().unwrap_or("?").to_string();
            Some((id, (state, i["attempt"].as_u64().unwrap_or(0))))
        })
        .collect()
}

/// Sequences held by this node's rank-0 runners.
fn held(s: &Value) -> usize {
    s["serving"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|l| {
            ["running", "prefilling", "waiting"]
                .iter()
                .map(|k| l[*k].as_u64().unwrap_or(0) as usize)
                .sum::<usize>()
        })
        .sum()
}

pub fn watch(node: &str, stop: &AtomicBool) -> Watched {
    let mut w = Watched::default();
    let mut before: Option<HashMap<String, (String, u64)>> = None;
    let mut unanswered = 0;
    while !stop.load(Ordering::Relaxed) {
        match status(node) {
            Ok(s) => {
                let now = instances(&s);
                if let Some(prev) = &before {
                    for (id, (state, attempt)) in prev {
                        match now.get(id) {
                            None => {
                                w.instance_failures += 1;
                                w.events.push(format!("{id} was removed"));
                            }
                            Some((s2, _)) if s2 == "failed" && state != "failed" => {
                                w.instance_failures += 1;
                                w.events.push(format!("{id} failed"));
                            }
                            Some((_, a2)) if a2 > attempt => {
                                w.instance_failures += 1;
                                w.events
                                    .push(format!("{id} was placed again (attempt {a2})"));
                            }
                            _ => {}
                        }
                    }
                }
                before = Some(now);
                unanswered = 0;
            }
            Err(e) => {
                unanswered += 1;
                if unanswered == 5 {
                    w.events
                        .push(format!("the node's status did not answer 5 times: {e}"));
                }
            }
        }
        std::thread::sleep(Duration::from_secs(1));
    }
    let deadline = Instant::now() + DRAIN;
    loop {
        let left = status(node).map(|s| held(&s)).unwrap_or(usize::MAX);
        if left == 0 {
            break;
        }
        if Instant::now() > deadline {
            w.stuck = if left == usize::MAX { 1 } else { left };
            w.events.push(format!(
                "{} sequences still held {DRAIN:?} after the clients stopped",
                w.stuck
            ));
            break;
        }
        std::thread::sleep(Duration::from_millis(250));
    }
    w
}
