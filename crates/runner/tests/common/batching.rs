//! Continuous batching against each sequence alone: sixteen sequences joining at
//! different steps, prompts in chunks beside other sequences' decode tokens, batches of
//! 1 to 16 parts; over a pipeline also as micro-batches in flight together.

use shoal_engine::{LocalSession, Session};
use shoal_model::{GgufFile, Model};
use shoal_runner::{Logits, Part, Strategy};

use super::{row_differs, stop_split};

const SEQS: usize = 16;
const STEPS: usize = 9;

/// Sequence `i`'s tokens at step `k` (empty: not in that step). Sequences join at steps
/// 0–3, prefill their prompt (1–13 tokens) in chunks of at most 5, then decode one token
/// a step; some leave before the end.
pub fn chunk(i: usize, k: usize) -> Vec<u32> {
    let join = i % 4;
    let prompt = 1 + (i * 5) % 13;
    let leave = if i.is_multiple_of(3) { 6 } else { STEPS };
    if k < join || k >= leave {
        return Vec::new();
    }
    let chunks: Vec<Vec<u32>> = (0..prompt)
        .map(|p| ((i * 31 + p * 17 + 3) % 200) as u32)
        .collect::<Vec<_>>()
        .chunks(5)
        .map(<[u32]>::to_vec)
        .collect();
    let at = k - join;
    match chunks.get(at) {
        Some(c) => c.clone(),
        None => vec![((i * 13 + k * 7 + 1) % 200) as u32],
    }
}

/// Which logits a part asks for: every row, none (a prompt chunk before the last), or the
/// last, in turn.
pub fn want(i: usize, k: usize) -> Logits {
    match (i + k) % 3 {
        0 => Logits::All,
        1 => Logits::Last,
        _ => Logits::None,
    }
}

/// Rows per (sequence, step), computed alone on one process.
pub fn alone(path: &std::path::Path) -> Vec<Vec<Vec<Vec<f32>>>> {
    let file = GgufFile::open(path).expect("open");
    let n = file.model_config().expect("config").num_layers;
    let model = Model::load(&file, shoal_model::LoadSpec::full(n), 256).expect("load");
    (0..SEQS)
        .map(|i| {
            let mut s = LocalSession::new(&model);
            (0..STEPS)
                .map(|k| {
                    let tokens = chunk(i, k);
                    if tokens.is_empty() {
                        return Vec::new();
                    }
                    let rows = s.forward(&tokens, true).expect("forward");
                    let rows = rows.to_vec2::<f32>().expect("rows");
                    match want(i, k) {
                        Logits::All => rows,
                        Logits::Last => vec![rows.last().expect("a row").clone()],
                        Logits::None => Vec::new(),
                    }
                })
                .collect()
        })
        .collect()
}

/// The same, as batched steps on a model split `world` ways, each step's parts as
/// `micro` micro-batches started together and collected in turn.
// `got` is indexed by sequence and step alike.
#[allow(clippy::needless_range_loop)]
pub fn batched(
    path: &std::path::Path,
    strategy: Strategy,
    world: usize,
    micro: usize,
) -> Vec<Vec<Vec<Vec<f32>>>> {
    batched_with(path, strategy, world, micro, |_, m| m)
}

/// [`batched`] with each rank's model adjusted as [`super::start_split_with`] does.
pub fn batched_with(
    path: &std::path::Path,
    strategy: Strategy,
    world: usize,
    micro: usize,
    adjust: fn(usize, Model) -> Model,
) -> Vec<Vec<Vec<Vec<f32>>>> {
    let (model, handles) = super::start_split_with(path, strategy, world, adjust);
    let seqs: Vec<u64> = (0..SEQS).map(|_| model.open()).collect();
    let mut got = vec![vec![Vec::new(); STEPS]; SEQS];
    let mut sizes = Vec::new();
    for k in 0..STEPS {
        let members: Vec<usize> = (0..SEQS).filter(|&i| !chunk(i, k).is_empty()).collect();
        let parts: Vec<Part> = members
            .iter()
            .map(|&i| Part {
                seq: seqs[i],
                tokens: chunk(i, k),
                logits: want(i, k),
                reserve: 0,
            })
            .collect();
        sizes.push(parts.len());
        // Micro-batch m holds the members m, m + micro, m + 2 micro, …
        let groups: Vec<Vec<usize>> = (0..micro)
            .map(|m| (m..members.len()).step_by(micro).collect())
            .filter(|g: &Vec<usize>| !g.is_empty())
            .collect();
        if micro == 1 {
            let logits = model.forward_batch(parts.clone()).expect("batch");
            take_rows(&mut got, k, &members, &parts, logits);
        } else {
            for g in &groups {
                let sub = g.iter().map(|&j| parts[j].clone()).collect();
                model.submit(sub).expect("submit");
            }
            assert_eq!(model.in_flight(), groups.len());
            for g in &groups {
                let logits = model.collect().expect("collect");
                let mine: Vec<usize> = g.iter().map(|&j| members[j]).collect();
                let sub: Vec<Part> = g.iter().map(|&j| parts[j].clone()).collect();
                take_rows(&mut got, k, &mine, &sub, logits);
            }
        }
        if k == 6 {
            for i in (0..SEQS).filter(|i| i % 3 == 0) {
                model.release(seqs[i]).expect("release");
            }
        }
    }
    assert!(
        sizes.contains(&1) || sizes.iter().any(|&s| s >= 12),
        "{sizes:?}"
    );
    stop_split(model, handles);
    got
}

/// Files a step's logits rows under their sequences.
fn take_rows(
    got: &mut [Vec<Vec<Vec<f32>>>],
    k: usize,
    members: &[usize],
    parts: &[Part],
    logits: Option<candle_core::Tensor>,
) {
    let rows = logits.map_or(Vec::new(), |l| l.to_vec2::<f32>().expect("rows"));
    let mut at = 0;
    for (&i, p) in members.iter().zip(parts) {
        let n = match p.logits {
            Logits::All => p.tokens.len(),
            Logits::Last => 1,
            Logits::None => 0,
        };
        got[i][k] = rows[at..at + n].to_vec();
        at += n;
    }
    assert_eq!(at, rows.len(), "step {k}: rows left over");
}

/// Every run of `strategy` at 1, 2 and 3 ranks (over a pipeline also with a micro-batch
/// per stage) against `want`, each logit within `tolerance` times its row's largest
/// magnitude (at least 1); 0: bit for bit.
pub fn check_runs(
    path: &std::path::Path,
    what: &str,
    strategy: Strategy,
    want: &[Vec<Vec<Vec<f32>>>],
    tolerance: f32,
) {
    let runs = [1, 2, 3].into_iter().flat_map(|world| {
        let micro = if strategy == Strategy::Pipeline && world > 1 {
            vec![1, world]
        } else {
            vec![1]
        };
        micro.into_iter().map(move |m| (world, m))
    });
    for (world, micro) in runs {
        let got = batched(path, strategy, world, micro);
        let run = format!("{what} {strategy} {world} ranks ({micro} in flight)");
        assert_same_rows(&run, want, &got, tolerance);
    }
}

/// Every (sequence, step) of `got` has `want`'s rows, each logit within `tolerance` (as
/// [`check_runs`]); `run` names the run in a failure.
pub fn assert_same_rows(
    run: &str,
    want: &[Vec<Vec<Vec<f32>>>],
    got: &[Vec<Vec<Vec<f32>>>],
    tolerance: f32,
) {
    for i in 0..SEQS {
        for k in 0..STEPS {
            let (w, g) = (&want[i][k], &got[i][k]);
            assert_eq!(w.len(), g.len(), "{run}: seq {i} step {k} rows");
            for (wr, gr) in w.iter().zip(g) {
                if let Some(why) = row_differs(wr, gr, tolerance) {
                    panic!("{run}: seq {i} step {k} {why}");
                }
            }
        }
    }
}
