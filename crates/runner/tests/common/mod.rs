//! Helpers shared by the runner's tests: one script of calls, run on one process and on
//! a model split across ranks (threads joined by the in-process transport).

#![allow(dead_code)]

pub mod batching;

use std::path::{Path, PathBuf};
use std::thread;
use std::time::Duration;

use candle_core::quantized::GgmlDType;
use shoal_collectives::local::{LocalTransport, local_group};
use shoal_engine::{LocalSession, Session};
use shoal_model::synthetic::{SyntheticShape, write_synthetic_gguf};
use shoal_model::{Architecture, GgufFile, Model, Tensor};
use shoal_runner::{Rank, RankError, SplitModel, Strategy, plan};

pub fn model_file(arch: Architecture, dtype: GgmlDType) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("shoal-split-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("dir");
    let path = dir.join(format!("{}-{dtype:?}.gguf", arch.name()));
    if !path.exists() {
        // Tests run in parallel and share these files: each writes its own copy and
        // renames it into place, so no test ever opens a half-written file.
        let tmp = dir.join(format!(
            "{}-{dtype:?}.{:?}.tmp",
            arch.name(),
            std::thread::current().id()
        ));
        write_synthetic_gguf(&SyntheticShape::tiny(arch), dtype, 7, &tmp).expect("write");
        std::fs::rename(&tmp, &path).expect("rename");
    }
    path
}

/// What a run records: logits after each call.
pub type Trace = Vec<Vec<Vec<f32>>>;

/// One-token prompt; a prompt in one chunk; a prompt over several chunks with all
/// logits; then 20 greedy decode steps. A split run replays the single run's greedy
/// tokens (`forced`), so that one near-tie flipped by summation order does not send the
/// two runs down different sequences; `compare` checks the logits at every step.
pub fn script(session: &mut dyn Session, forced: Option<&[u32]>) -> (Trace, Vec<u32>) {
    let mut trace = Vec::new();
    let mut record = |t: Tensor| {
        trace.push(t.to_vec2::<f32>().expect("logits"));
    };
    session.reset().expect("reset");
    record(session.forward(&[5], false).expect("one token"));
    session.reset().expect("reset");
    record(
        session
            .forward(&[1, 9, 33, 4, 120, 7], false)
            .expect("one chunk"),
    );
    session.reset().expect("reset");
    let long: Vec<u32> = (0..45).map(|i| (i * 37 + 11) % 200).collect();
    for piece in long.chunks(16) {
        record(session.forward(piece, true).expect("chunk"));
    }
    let mut next = 3u32;
    let mut tokens = Vec::new();
    for step in 0..20 {
        let logits = session.forward(&[next], false).expect("decode");
        let row = logits.to_vec2::<f32>().expect("row").remove(0);
        next = match forced {
            Some(f) => f[step],
            None => row
                .iter()
                .enumerate()
                .max_by(|a, b| a.1.total_cmp(b.1))
                .map(|(i, _)| i as u32)
                .unwrap_or(0),
        };
        tokens.push(next);
        trace.push(vec![row]);
    }
    (trace, tokens)
}

pub fn single(path: &PathBuf) -> (Trace, Vec<u32>) {
    let file = GgufFile::open(path).expect("open");
    let n = file.model_config().expect("config").num_layers;
    let model = Model::load(&file, shoal_model::LoadSpec::full(n), 256).expect("load");
    script(&mut LocalSession::new(&model), None)
}

/// Rank 0 of `path` split `world` ways, the other ranks following on threads.
pub fn start_split(
    path: &Path,
    strategy: Strategy,
    world: usize,
) -> (
    SplitModel<LocalTransport>,
    Vec<thread::JoinHandle<Result<(), RankError>>>,
) {
    start_split_with(path, strategy, world, |_, m| m)
}

/// [`start_split`] with each rank's model passed through `adjust(rank, model)` (to
/// stand in for ranks on machines of different kinds).
pub fn start_split_with(
    path: &Path,
    strategy: Strategy,
    world: usize,
    adjust: fn(usize, Model) -> Model,
) -> (
    SplitModel<LocalTransport>,
    Vec<thread::JoinHandle<Result<(), RankError>>>,
) {
    let file = GgufFile::open(path).expect("open");
    let config = file.model_config().expect("config").clone();
    let specs = plan(&config, strategy, world).expect("plan");
    let groups = local_group(world, Duration::from_secs(20));
    let mut handles = Vec::new();
    let mut lead = None;
    for (spec, group) in specs.into_iter().zip(groups) {
        let path = path.to_path_buf();
        let make = move || {
            let file = GgufFile::open(&path).expect("open");
            let model = Model::load(&file, spec.load.clone(), 256).expect("load shard");
            Rank::new(spec.clone(), adjust(spec.rank, model), group).expect("rank")
        };
        if lead.is_none() {
            lead = Some(make());
        } else {
            handles.push(thread::spawn(move || make().follow()));
        }
    }
    (SplitModel::new(lead.expect("rank 0")), handles)
}

/// Shuts the split down and checks every rank ended cleanly.
pub fn stop_split(
    model: SplitModel<LocalTransport>,
    handles: Vec<thread::JoinHandle<Result<(), RankError>>>,
) {
    model.shutdown().expect("shutdown");
    for h in handles {
        h.join().expect("join").expect("rank finished cleanly");
    }
}

pub fn split(path: &Path, strategy: Strategy, world: usize, forced: &[u32]) -> Trace {
    let (model, handles) = start_split(path, strategy, world);
    let (trace, _) = script(&mut model.session(), Some(forced));
    stop_split(model, handles);
    trace
}

/// How a logits row `got` differs from `want`, if by more than `tolerance` times the
/// row's largest magnitude (at least 1); a `tolerance` of 0 asks for bit for bit.
pub fn row_differs(want: &[f32], got: &[f32], tolerance: f32) -> Option<String> {
    let scale = want.iter().fold(0f32, |m, v| m.max(v.abs())).max(1.0);
    let err = want
        .iter()
        .zip(got)
        .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
    let ok = if tolerance == 0.0 {
        want.iter()
            .zip(got)
            .all(|(a, b)| a.to_bits() == b.to_bits())
    } else {
        err <= tolerance * scale
    };
    (!ok).then(|| format!("differs by {err} (scale {scale})"))
}

pub fn compare(what: &str, want: &Trace, got: &Trace, tolerance: f32) {
    assert_eq!(want.len(), got.len(), "{what}: number of calls");
    for (call, (w, g)) in want.iter().zip(got).enumerate() {
        assert_eq!(w.len(), g.len(), "{what}: rows of call {call}");
        for (wr, gr) in w.iter().zip(g) {
            if let Some(why) = row_differs(wr, gr, tolerance) {
                panic!("{what}: call {call} {why}");
            }
        }
    }
}
