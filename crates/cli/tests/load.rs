//! `shoal load` on separate hosts: six streaming clients (every API, short, long and
//! shared-prefix prompts, clients that cancel or walk away) against a 2-host tensor
//! instance, and against a 2-host pipeline instance with a second model on one of its
//! hosts. Each run must end with no failed or vanished request, no instance failure and
//! nothing held once the clients stop (`shoal load` exits non-zero otherwise).
//!
//! `SHOAL_LOAD_SECONDS` sets each run's length (default 60, CI's one-minute form; the
//! figures in docs/SERVING.md come from 600).

use shoal_testbed::{Cluster, Testbed, eventually, install_from_store, succeed};
use std::path::Path;
use std::time::Duration;

const SMALL: &str = "smollm2-135m";
const SECOND: &str = "qwen2.5-coder-0.5b";

fn bin() -> &'static Path {
    Path::new(env!("CARGO_BIN_EXE_shoal"))
}

fn seconds() -> String {
    std::env::var("SHOAL_LOAD_SECONDS").unwrap_or_else(|_| "60".into())
}

fn ready(c: &Cluster, count: usize) {
    eventually(Duration::from_secs(120), "the instances ready", || {
        c.nodes[0].status().is_some_and(|s| {
            let list = s["instances"].as_array().cloned().unwrap_or_default();
            list.len() == count && list.iter().all(|i| i["status"]["state"] == "ready")
        })
    });
}

/// Two hosts with `models` installed on host 1 (and `SMALL` on both), met.
fn cluster(extra: &[&str]) -> Option<Cluster> {
    let bed = Testbed::for_test(2)?;
    let mut c = Cluster::new(bed, bin());
    for (i, node) in c.nodes.iter().enumerate() {
        install_from_store(bin(), SMALL, &node.dir);
        if i == 0 {
            for m in extra {
                install_from_store(bin(), m, &node.dir);
            }
        }
    }
    c.start();
    eventually(Duration::from_secs(30), "the nodes meet", || {
        c.nodes[0].status().is_some_and(|s| {
            s["master_id"].is_string() && s["nodes"].as_array().is_some_and(|n| n.len() == 2)
        })
    });
    Some(c)
}

fn place(c: &Cluster, model: &str, strategy: &str, nodes: &str) {
    succeed(
        c.nodes[0].cli(&[
            "place",
            model,
            "--strategy",
            strategy,
            "--nodes",
            nodes,
            "--ctx",
            "2048",
        ]),
        "shoal place",
    );
}

fn load(c: &Cluster, models: &[&str]) {
    let secs = seconds();
    let mut args = vec!["load", "--clients", "6", "--duration", &secs];
    for m in models {
        args.extend(["-m", m]);
    }
    let out = c.nodes[0].cli(&args);
    let stdout = String::from_utf8_lossy(&out.stdout);
    println!("{stdout}");
    assert!(
        out.status.success(),
        "shoal load failed:\n{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        stdout.contains(" 0 failed, 0 vanished, 0 stalled"),
        "{stdout}"
    );
}

/// One after the other, not in parallel: on two cores the runs would share them.
#[test]
fn six_clients_lose_nothing_on_a_tensor_instance_and_on_a_pipeline_beside_a_second_model() {
    {
        let Some(c) = cluster(&[]) else {
            return;
        };
        place(&c, SMALL, "tensor", "2");
        ready(&c, 1);
        load(&c, &[SMALL]);
    }
    let Some(c) = cluster(&[SECOND]) else {
        return;
    };
    place(&c, SMALL, "pipeline", "2");
    place(&c, SECOND, "pipeline", "1");
    ready(&c, 2);
    load(&c, &[SMALL, SECOND]);
}
