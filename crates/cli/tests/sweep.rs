//! `shoal bench --sweep` on two hosts (network namespaces, nodes started as a user
//! would): the sweep places each strategy at 1 and 2 ranks itself, benches it with
//! prompts of an exact token length, deletes it, and writes JSON and an SVG plot. Also
//! `/v1/run`'s `prompt_ids`, which the bench's exact prompts ride on.

use serde_json::Value;
use shoal_testbed::{Testbed, meeting, succeed};
use std::path::Path;

const MODEL: &str = "smollm2-135m";
const NODE: &str = "127.0.0.1:52415";

fn bin() -> &'static Path {
    Path::new(env!("CARGO_BIN_EXE_shoal"))
}

#[test]
fn a_sweep_places_benches_and_deletes_each_instance_and_plots_them() {
    let Some(bed) = Testbed::for_test(2) else {
        return;
    };
    let c = meeting(bed, bin(), MODEL, &[], &[]);
    let plot = c.nodes[0].dir.join("sweep.svg");
    let out = c.nodes[0]
        .command()
        .args(["bench", "--node", NODE, "-m", MODEL, "--sweep", "--json"])
        .args(["--strategies", "pipeline,tensor", "--rank-counts", "1,2"])
        .args([
            "--pp",
            "40",
            "--tg",
            "8",
            "--concurrency",
            "1,3",
            "--repeat",
            "1",
        ])
        .args(["--ctx", "512", "--plot"])
        .arg(&plot)
        .output()
        .expect("run the sweep");
    let runs: Value = serde_json::from_str(&succeed(out, "shoal bench --sweep")).expect("JSON");
    let runs = runs.as_array().expect("a list of runs");
    let shapes: Vec<(String, u64)> = runs
        .iter()
        .map(|r| {
            (
                r["strategy"].as_str().unwrap_or("").to_string(),
                r["ranks"].as_u64().unwrap_or(0),
            )
        })
        .collect();
    assert_eq!(
        shapes,
        [("pipeline", 1), ("pipeline", 2), ("tensor", 2)].map(|(s, n)| (s.to_string(), n)),
        "one run per strategy and rank count, one rank once"
    );
    for r in runs {
        assert!(r["failed"].is_null(), "{r}");
        let rows = r["rows"].as_array().expect("rows");
        assert_eq!(
            rows.iter()
                .map(|w| w["clients"].as_u64())
                .collect::<Vec<_>>(),
            [Some(1), Some(3)]
        );
        for w in rows {
            assert_eq!(w["failed"], 0, "{w}");
            assert_eq!(w["requests"], w["clients"], "{w}");
            // Exact prompts: every request's prompt had 40 tokens, as the runner counted.
            assert_eq!(w["prompt_tokens"], 40.0, "{w}");
            assert!(w["total_tok_s"].as_f64().unwrap_or(0.0) > 0.0, "{w}");
            assert!(w["prompt_tok_s"].as_f64().unwrap_or(0.0) > 0.0, "{w}");
        }
        // Both hosts' memory was watched.
        assert_eq!(r["peak_memory"].as_array().map(Vec::len), Some(2), "{r}");
    }
    // Every instance the sweep placed is gone again.
    let status = c.nodes[0].status().expect("status");
    assert_eq!(
        status["instances"].as_array().map(Vec::len),
        Some(0),
        "{status}"
    );
    let svg = std::fs::read_to_string(&plot).expect("the plot");
    assert!(
        svg.starts_with("<svg"),
        "not an SVG: {}",
        &svg[..svg.len().min(80)]
    );
    for label in ["pipeline ×1", "pipeline ×2", "tensor ×2"] {
        assert!(svg.contains(label), "the plot lacks {label}");
    }
}

#[test]
fn prompt_ids_are_taken_as_they_are_and_checked_against_the_vocabulary() {
    let Some(bed) = Testbed::for_test(1) else {
        return;
    };
    let c = meeting(bed, bin(), MODEL, &[], &[]);
    shoal_testbed::place_ready(&c, MODEL, 512, "pipeline");
    let post = |body: Value| {
        let out = c
            .bed
            .command(c.nodes[0].host, "curl")
            .args(["-sS", "--max-time", "60", &format!("http://{NODE}/v1/run")])
            .args(["-H", "Content-Type: application/json", "-d"])
            .arg(body.to_string())
            .output()
            .expect("curl");
        String::from_utf8_lossy(&out.stdout).to_string()
    };
    let ids: Vec<u32> = (2000..2033).collect();
    let answer = post(serde_json::json!({ "model": MODEL, "prompt_ids": ids, "max_tokens": 3 }));
    let done: Value = answer
        .lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .find(|v| v["done"] == true)
        .unwrap_or_else(|| panic!("no done line: {answer}"));
    assert_eq!(done["usage"]["prompt_tokens"], 33, "{done}");
    assert_eq!(done["usage"]["completion_tokens"], 3, "{done}");
    assert_eq!(done["finish_reason"], "length", "{done}");

    let past =
        post(serde_json::json!({ "model": MODEL, "prompt_ids": [5, 49152], "max_tokens": 3 }));
    assert!(past.contains("past the vocabulary"), "{past}");
    assert!(!past.contains("\"done\""), "{past}");
}
