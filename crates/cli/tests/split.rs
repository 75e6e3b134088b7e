//! `--ranks N`: a model split across local processes agrees with one process, and a
//! rank that dies or freezes costs an error within seconds, never a hang or a leftover
//! process. These run the real smollm2-135m (installed by the tests' store on first
//! use); qwen2.5-coder-0.5b's agreement test is `--ignored` (476 MB).

use std::io::Read;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

fn shoal() -> Command {
    Command::new(env!("CARGO_BIN_EXE_shoal"))
}

fn prose() -> PathBuf {
    PathBuf::from(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../tests/fixtures/prose.txt"
    ))
}

struct Score {
    top1: Vec<u64>,
    margin: Vec<f64>,
    ppl: f64,
}

fn perplexity(model: &str, kernels: &str, extra: &[&str]) -> Score {
    let out = shoal()
        .env("SHOAL_KERNELS", kernels)
        .args(["perplexity", "-m", model, "--json", "--chunk", "64"])
        .arg(prose())
        .args(extra)
        .output()
        .expect("run shoal");
    assert!(
        out.status.success(),
        "{extra:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("json");
    let nums = |k: &str| -> Vec<f64> {
        v[k].as_array()
            .expect("array")
            .iter()
            .filter_map(|x| x.as_f64())
            .collect()
    };
    Score {
        top1: nums("top1").into_iter().map(|x| x as u64).collect(),
        margin: nums("margin"),
        ppl: v["ppl"].as_f64().expect("ppl"),
    }
}

/// How close a split run must come to one process.
struct Bound {
    /// Positions whose top two logits (in one process) are at least this far apart must
    /// keep their top-1 token.
    firm: f64,
    /// Largest relative perplexity difference.
    ppl: f64,
}

/// `kv_heads`: tensor parallelism splits whole KV groups, so it runs on at most that many
/// ranks (qwen2.5-coder-0.5b has 2).
fn check_agreement(model: &str, kv_heads: usize, kernels: &str, bound: impl Fn(&str) -> Bound) {
    let one = perplexity(model, kernels, &["--threads", "2"]);
    assert!(one.top1.len() > 250, "a few hundred positions");
    for strategy in ["pipeline", "tensor", "sequence"] {
        let b = bound(strategy);
        for ranks in ["2", "3"] {
            if strategy == "tensor" && ranks.parse::<usize>().unwrap_or(0) > kv_heads {
                continue;
            }
            let split = perplexity(
                model,
                kernels,
                &["--ranks", ranks, "--strategy", strategy, "--threads", "1"],
            );
            let what = format!("{model} {kernels} {strategy} {ranks} ranks");
            let mut firm = 0;
            for (i, ((a, c), m)) in one
                .top1
                .iter()
                .zip(&split.top1)
                .zip(&one.margin)
                .enumerate()
            {
                if *m >= b.firm {
                    firm += 1;
                    assert_eq!(a, c, "{what}: top-1 differs at position {i} (margin {m})");
                }
            }
            let rel = (split.ppl - one.ppl).abs() / one.ppl;
            assert!(
                rel <= b.ppl,
                "{what}: perplexity {} vs {}",
                split.ppl,
                one.ppl
            );
            eprintln!(
                "{what}: top-1 agrees at {firm} positions with margin >= {}, perplexity {:.4} vs {:.4} ({:.3}%)",
                b.firm,
                split.ppl,
                one.ppl,
                rel * 100.0
            );
        }
    }
}

/// With f32 activations every strategy computes one process's numbers up to rounding:
/// the bounds (top-1 at margins of 0.2, perplexity within 0.5%) hold with room
/// to spare. With 8-bit activations (the serving kernels) a last-bit difference can flip
/// a rounding, and one process alone moves by up to 0.7% in perplexity and flips a
/// 0.31-margin position when only its prefill chunk size changes (docs/CORRECTNESS.md):
/// pipeline runs the very same operations and must match exactly; tensor and sequence
/// (whose attention sums round differently, 1.0% measured) are held to a bound just
/// above that noise floor.
fn bounds(kernels: &'static str) -> impl Fn(&str) -> Bound {
    move |strategy| match (kernels, strategy) {
        ("dense", _) => Bound {
            firm: 0.2,
            ppl: 0.0005,
        },
        (_, "pipeline") => Bound {
            firm: 0.0,
            ppl: 0.0,
        },
        _ => Bound {
            firm: 0.5,
            ppl: 0.015,
        },
    }
}

#[test]
fn split_smollm2_scores_like_one_process() {
    check_agreement("smollm2-135m", 3, "dense", bounds("dense"));
    check_agreement("smollm2-135m", 3, "shoal", bounds("shoal"));
}

#[test]
#[ignore = "needs qwen2.5-coder-0.5b (476 MB): shoal pull qwen2.5-coder-0.5b"]
fn split_qwen_scores_like_one_process() {
    check_agreement("qwen2.5-coder-0.5b", 2, "dense", bounds("dense"));
    check_agreement("qwen2.5-coder-0.5b", 2, "shoal", bounds("shoal"));
}

/// Children of `pid` (the rank processes), from /proc.
fn children(pid: u32) -> Vec<u32> {
    let mut out = Vec::new();
    if let Ok(dir) = std::fs::read_dir("/proc") {
        for e in dir.flatten() {
            let Some(p) = e.file_name().to_str().and_then(|s| s.parse::<u32>().ok()) else {
                continue;
            };
            if let Ok(stat) = std::fs::read_to_string(format!("/proc/{p}/stat")) {
                // The command name is in parentheses and may hold spaces.
                let after = stat.rsplit_once(')').map_or("", |(_, r)| r);
                let fields: Vec<&str> = after.split_whitespace().collect();
                if fields.get(1).and_then(|f| f.parse::<u32>().ok()) == Some(pid) {
                    out.push(p);
                }
            }
        }
    }
    out
}

/// Whether `pid` still runs (a zombie has finished).
fn alive(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .map(|s| {
            let state = s.rsplit_once(')').map_or("", |(_, r)| r).trim_start();
            !state.starts_with('Z') && !state.starts_with('X')
        })
        .unwrap_or(false)
}

fn signal(sig: &str, pid: u32) {
    let ok = Command::new("kill")
        .args([sig, &pid.to_string()])
        .status()
        .map(|s| s.success())
        .unwrap_or(false);
    assert!(ok, "kill {sig} {pid}");
}

/// Waits for the ranks to start; returns their pids.
fn ranks_of(parent: &Child, n: usize) -> Vec<u32> {
    let until = Instant::now() + Duration::from_secs(30);
    loop {
        let c = children(parent.id());
        if c.len() >= n {
            return c;
        }
        assert!(Instant::now() < until, "ranks did not start");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// The parent must fail with a clear error within `within` of the fault, and every
/// process must be gone.
fn fails_within(mut parent: Child, others: &[u32], within: Duration, what: &str) {
    let until = Instant::now() + within;
    let status = loop {
        if let Some(s) = parent.try_wait().expect("wait") {
            break s;
        }
        if Instant::now() > until {
            let _ = parent.kill();
            panic!("{what}: rank 0 still running {within:?} after the fault");
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let mut stderr = String::new();
    if let Some(mut e) = parent.stderr.take() {
        let _ = e.read_to_string(&mut stderr);
    }
    assert!(!status.success(), "{what}: rank 0 succeeded");
    assert!(!stderr.contains("panicked"), "{what}: {stderr}");
    assert!(
        stderr.contains("error: ") && stderr.contains("rank"),
        "{what}: no clear error: {stderr}"
    );
    let until = Instant::now() + Duration::from_secs(10);
    while others.iter().any(|&p| alive(p)) {
        assert!(
            Instant::now() < until,
            "{what}: a rank process is left: {stderr}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    eprintln!("{what}: {}", stderr.lines().next().unwrap_or(""));
}

fn long_prompt() -> String {
    std::fs::read_to_string(prose()).expect("prose").repeat(6)
}

fn start(args: &[&str], prompt: &str) -> Child {
    shoal()
        .args([
            "run",
            "--raw",
            "--threads",
            "1",
            "--ctx",
            "8192",
            "--rank-timeout",
            "30",
        ])
        .args(args)
        .arg(prompt)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start shoal")
}

#[test]
fn a_rank_killed_during_prefill_is_an_error_within_seconds() {
    let prompt = long_prompt();
    let parent = start(
        &[
            "--ranks",
            "3",
            "--strategy",
            "tensor",
            "--prefill-chunk",
            "4",
            "-n",
            "4",
        ],
        &prompt,
    );
    let ranks = ranks_of(&parent, 2);
    // Loading takes well under this; the prefill of ~2000 positions 4 at a time, much
    // longer.
    std::thread::sleep(Duration::from_secs(3));
    signal("-KILL", ranks[0]);
    fails_within(
        parent,
        &ranks,
        Duration::from_secs(15),
        "kill -9 during prefill",
    );
}

/// Waits until rank 0 has printed some of its answer (decode is running).
fn wait_for_output(parent: &mut Child) {
    let mut out = parent.stdout.take().expect("stdout");
    let mut buf = [0u8; 8];
    let n = out.read(&mut buf).expect("read");
    assert!(n > 0, "no output");
    // Keep draining so rank 0 never blocks on a full pipe.
    std::thread::spawn(move || {
        let mut sink = Vec::new();
        let _ = out.read_to_end(&mut sink);
    });
}

#[test]
fn a_rank_killed_during_decode_is_an_error_within_seconds() {
    for strategy in ["pipeline", "tensor", "sequence"] {
        let mut parent = start(
            &[
                "--ranks",
                "3",
                "--strategy",
                strategy,
                "-n",
                "6000",
                "--temperature",
                "1",
            ],
            "Once upon a time",
        );
        let ranks = ranks_of(&parent, 2);
        wait_for_output(&mut parent);
        signal("-KILL", ranks[1]);
        fails_within(
            parent,
            &ranks,
            Duration::from_secs(15),
            &format!("kill -9 during {strategy} decode"),
        );
    }
}

#[test]
fn a_frozen_rank_is_an_error_within_seconds() {
    let mut parent = start(
        &[
            "--ranks",
            "2",
            "--strategy",
            "tensor",
            "-n",
            "6000",
            "--temperature",
            "1",
        ],
        "Once upon a time",
    );
    let ranks = ranks_of(&parent, 1);
    wait_for_output(&mut parent);
    signal("-STOP", ranks[0]);
    // Heartbeats stop: rank 0 notices within the liveness timeout (3 s), not the
    // 30 s operation deadline, and kills the frozen rank on its way out.
    fails_within(
        parent,
        &ranks,
        Duration::from_secs(12),
        "SIGSTOP during decode",
    );
}
