//! A model split across ranks computes what one process computes: every strategy, 2 and
//! 3 ranks (uneven tensor splits included), every architecture, on generated models.
//! Ranks run as threads joined by the in-process transport here; the TCP transport has
//! its own tests, and the CLI tests run ranks as processes.

mod common;

use std::thread;
use std::time::Duration;

use candle_core::quantized::GgmlDType;
use common::{compare, model_file, single, split};
use shoal_collectives::local::local_group;
use shoal_engine::Session;
use shoal_model::synthetic::{SyntheticShape, write_synthetic_gguf};
use shoal_model::{Architecture, GgufFile, Model};
use shoal_runner::{Rank, SplitModel, Strategy, plan};

fn check(strategy: Strategy) {
    for arch in [
        Architecture::Llama,
        Architecture::Qwen2,
        Architecture::Qwen3,
    ] {
        for dtype in [GgmlDType::F32, GgmlDType::Q8_0] {
            let path = model_file(arch, dtype);
            let (want, tokens) = single(&path);
            for world in [2, 3] {
                let got = split(&path, strategy, world, &tokens);
                let what = format!("{strategy} {world} ranks {} {dtype:?}", arch.name());
                // Tensor parallelism sums partial products in another order, and the
                // sequence strategy runs other batch sizes (whose attention sums round
                // differently). With f32 weights that is rounding (1e-4). With quantized
                // weights the activations are rounded to 8 bits before each product, so
                // a last-bit difference can move a value by a whole quantization step;
                // on these random models that shows in the logits at the 1% level, with
                // candle's kernels as with shoal's (one process running the same tokens
                // as 8 + 8 instead of 16 differs as much). Pipeline runs the very same
                // operations and must match exactly.
                let tolerance = match (strategy, dtype) {
                    (Strategy::Pipeline, _) | (_, GgmlDType::F32) => 1e-4,
                    _ => 3e-2,
                };
                compare(&what, &want, &got, tolerance);
            }
        }
    }
}

#[test]
fn pipeline_matches_one_process() {
    check(Strategy::Pipeline);
}

#[test]
fn tensor_matches_one_process() {
    check(Strategy::Tensor);
}

#[test]
fn sequence_matches_one_process() {
    check(Strategy::Sequence);
}

#[test]
fn tensor_splits_are_uneven_where_heads_do_not_divide() {
    let path = model_file(Architecture::Llama, GgmlDType::F32);
    let config = GgufFile::open(&path)
        .expect("open")
        .model_config()
        .expect("config")
        .clone();
    let specs = plan(&config, Strategy::Tensor, 2).expect("plan");
    let heads: Vec<usize> = specs
        .iter()
        .map(|s| s.load.tensor.as_ref().map_or(0, |t| t.kv_heads.len()))
        .collect();
    assert_eq!(heads, vec![2, 1]);
    assert!(
        plan(&config, Strategy::Tensor, 4).is_err(),
        "more ranks than KV heads"
    );
}

#[test]
fn bad_input_is_refused_before_any_rank_starts_and_the_instance_survives() {
    let path = model_file(Architecture::Qwen2, GgmlDType::F32);
    let file = GgufFile::open(&path).expect("open");
    let config = file.model_config().expect("config").clone();
    let specs = plan(&config, Strategy::Tensor, 2).expect("plan");
    let mut groups = local_group(2, Duration::from_secs(20));
    let g1 = groups.pop().expect("g1");
    let g0 = groups.pop().expect("g0");
    let spec1 = specs[1].clone();
    let p1 = path.clone();
    let follower = thread::spawn(move || {
        let file = GgufFile::open(&p1).expect("open");
        let model = Model::load(&file, spec1.load.clone(), 64).expect("load");
        Rank::new(spec1, model, g1).expect("rank").follow()
    });
    let model = Model::load(&file, specs[0].load.clone(), 64).expect("load");
    let split = SplitModel::new(Rank::new(specs[0].clone(), model, g0).expect("rank"));
    let mut s = split.session();
    assert!(s.forward(&[], false).is_err(), "empty");
    assert!(
        s.forward(&[10_000], false).is_err(),
        "outside the vocabulary"
    );
    assert!(
        s.forward(&vec![1; 65], false).is_err(),
        "longer than the context"
    );
    // Still works.
    let logits = s
        .forward(&[1, 2, 3], false)
        .expect("forward after refusals");
    assert_eq!(logits.dims(), &[1, 200]);
    drop(s);
    assert_eq!(split.sequences(), 0, "a dropped session frees its caches");
    split.shutdown().expect("shutdown");
    follower.join().expect("join").expect("clean exit");
}

#[test]
fn tensor_cuts_inside_k_quant_blocks_are_requantized_and_stay_close() {
    // KV groups of 64 columns inside 256-weight Q4_K blocks: the output projection's
    // column slices are requantized to Q8_0.
    let shape = SyntheticShape {
        architecture: Architecture::Qwen2,
        hidden: 256,
        heads: 8,
        kv_heads: 4,
        head_dim: 32,
        ffn: 512,
        vocab: 200,
        layers: 2,
        context: 256,
    };
    let dir = std::env::temp_dir().join(format!("shoal-split-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("dir");
    let path = dir.join("qwen2-q4k.gguf");
    write_synthetic_gguf(&shape, GgmlDType::Q4K, 3, &path).expect("write");
    let (want, tokens) = single(&path);
    for world in [2, 3] {
        let got = split(&path, Strategy::Tensor, world, &tokens);
        compare(&format!("tensor {world} ranks Q4_K"), &want, &got, 5e-2);
    }
}

#[test]
fn cpu_ranks_keep_their_reductions_on_the_group() {
    let path = model_file(Architecture::Llama, GgmlDType::F32);
    let file = GgufFile::open(&path).expect("open");
    let config = file.model_config().expect("config").clone();
    let specs = plan(&config, Strategy::Tensor, 2).expect("plan");
    let groups = local_group(2, Duration::from_secs(20));
    let handles: Vec<_> = specs
        .into_iter()
        .zip(groups)
        .map(|(spec, group)| {
            let path = path.clone();
            thread::spawn(move || {
                let file = GgufFile::open(&path).expect("open");
                let model = Model::load(&file, spec.load.clone(), 256).expect("load");
                let mut rank = Rank::new(spec, model, group).expect("rank");
                rank.connect_devices().expect("exchange")
            })
        })
        .collect();
    for h in handles {
        assert!(!h.join().expect("join"), "no NCCL between CPU ranks");
    }
}

#[test]
fn devices_for_ranks_follow_the_device_flag() {
    use shoal_runner::launch::rank_devices;
    assert_eq!(rank_devices("cpu", 2).expect("cpu"), ["cpu", "cpu"]);
    assert_eq!(
        rank_devices("cuda", 3).expect("cuda"),
        ["cuda:0", "cuda:1", "cuda:2"]
    );
    assert_eq!(
        rank_devices("cuda:1,cuda:0", 2).expect("list"),
        ["cuda:1", "cuda:0"]
    );
    assert!(
        rank_devices("cuda:0,cuda:1", 3).is_err(),
        "a list must name every rank"
    );
}

#[test]
fn chunked_prefill_on_a_split_model_skips_the_head_and_matches_one_process() {
    use shoal_engine::{Engine, LoadOptions};
    let path = model_file(Architecture::Qwen2, GgmlDType::F32);
    let engine = Engine::load(&path, &LoadOptions::default()).expect("engine");
    let tokens: Vec<u32> = (0..45).map(|i| (i * 37 + 11) % 200).collect();
    let want = engine
        .prefill_in(&mut engine.session(), &tokens, 16)
        .and_then(|t| Ok(t.to_vec2::<f32>()?))
        .expect("one process");
    let config = engine.model().config().clone();
    for strategy in [Strategy::Pipeline, Strategy::Tensor, Strategy::Sequence] {
        let specs = plan(&config, strategy, 2).expect("plan");
        let mut groups = local_group(2, Duration::from_secs(20));
        let follower_group = groups.pop().expect("rank 1");
        let lead_group = groups.pop().expect("rank 0");
        let follower_spec = specs[1].clone();
        let follower_path = path.clone();
        let follower = thread::spawn(move || {
            let file = GgufFile::open(&follower_path).expect("open");
            let model = Model::load(&file, follower_spec.load.clone(), 256).expect("load");
            Rank::new(follower_spec, model, follower_group)
                .expect("rank")
                .follow()
        });
        let file = GgufFile::open(&path).expect("open");
        let model = Model::load(&file, specs[0].load.clone(), 256).expect("load");
        let split = SplitModel::new(Rank::new(specs[0].clone(), model, lead_group).expect("rank"));
        let mut session = split.session();
        let got = engine
            .prefill_in(&mut session, &tokens, 16)
            .and_then(|t| Ok(t.to_vec2::<f32>()?))
            .expect("split prefill");
        assert_eq!(
            session.len(),
            tokens.len(),
            "{strategy}: every chunk appended"
        );
        drop(session);
        split.shutdown().expect("shutdown");
        follower
            .join()
            .expect("join")
            .expect("rank 1 finished cleanly");
        let scale = want[0].iter().fold(1f32, |m, v| m.max(v.abs()));
        let err = want[0]
            .iter()
            .zip(&got[0])
            .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
        assert!(
            err <= 1e-4 * scale,
            "{strategy}: differs by {err} (scale {scale})"
        );
    }
}
