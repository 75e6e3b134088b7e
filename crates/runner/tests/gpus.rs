//! Tensor parallelism between the GPUs of one machine over NCCL computes what one GPU
//! computes, within bf16 tolerance; and the time of the all-reduce itself (ignored test,
//! a benchmark that prints numbers). Needs a build with `--features nccl` and two GPUs
//! (scripts/build-cuda.sh, scripts/gpu-check.sh); elsewhere it says so and passes.

#![cfg(feature = "nccl")]

mod common;

use std::thread;
use std::time::{Duration, Instant};

use candle_core::cuda_backend::cudarc::driver::CudaContext;
use candle_core::quantized::GgmlDType;
use candle_core::{DType, Device, Tensor};
use common::{Trace, script};
use shoal_collectives::local::local_group;
use shoal_engine::LocalSession;
use shoal_model::synthetic::{SyntheticShape, write_synthetic_gguf};
use shoal_model::{Architecture, Compute, GgufFile, LoadSpec, Model};
use shoal_runner::{Rank, SplitModel, Strategy, plan};

/// The GPUs here when there are at least two; otherwise says the test is skipped.
fn two_or_more_gpus() -> Option<usize> {
    let n = gpus();
    if n < 2 {
        eprintln!("skipped: {n} CUDA devices here, NCCL needs 2");
        return None;
    }
    Some(n)
}

fn gpus() -> usize {
    // SAFETY: set before any thread starts; NVLink multicast stays off (docs/GPU.md).
    unsafe { std::env::set_var("NCCL_NVLS_ENABLE", "0") };
    CudaContext::device_count().map_or(0, |n| n as usize)
}

fn bf16_on(ordinal: usize) -> Compute {
    let mut c = Compute::parse(&format!("cuda:{ordinal}")).expect("cuda");
    c.dtype = DType::BF16;
    c
}

/// The largest difference over all calls, and the largest logit (the scale).
fn max_err(want: &Trace, got: &Trace) -> (f32, f32) {
    let mut err = 0f32;
    let mut scale = 1f32;
    for (w, g) in want.iter().zip(got) {
        for (wr, gr) in w.iter().zip(g) {
            for (a, b) in wr.iter().zip(gr) {
                err = err.max((a - b).abs());
                scale = scale.max(a.abs());
            }
        }
    }
    (err, scale)
}

fn tensor_parallel(path: &std::path::Path, world: usize, forced: &[u32]) -> (Trace, Vec<u32>) {
    let file = GgufFile::open(path).expect("open");
    let config = file.model_config().expect("config").clone();
    let specs = plan(&config, Strategy::Tensor, world).expect("plan");
    let groups = local_group(world, Duration::from_secs(60));
    let mut handles = Vec::new();
    let mut lead = None;
    for (r, (spec, group)) in specs.into_iter().zip(groups).enumerate() {
        let path = path.to_path_buf();
        let make = move || {
            let file = GgufFile::open(&path).expect("open");
            let model = Model::load_on(&file, spec.load.clone(), 256, &bf16_on(r)).expect("load");
            let mut rank = Rank::new(spec, model, group).expect("rank");
            assert!(rank.connect_devices().expect("connect"), "NCCL is on");
            rank
        };
        if r == 0 {
            // Rank 0 joins last, on this thread, once the others are waiting for it.
            lead = Some(make);
        } else {
            handles.push(thread::spawn(move || make().follow()));
        }
    }
    let model = SplitModel::new((lead.expect("rank 0"))());
    let result = script(&mut model.session(), Some(forced));
    model.shutdown().expect("shutdown");
    for h in handles {
        h.join().expect("join").expect("rank finished cleanly");
    }
    result
}

#[test]
fn tensor_parallel_logits_over_nccl_match_one_gpu() {
    let Some(n) = two_or_more_gpus() else {
        return;
    };
    let dir = std::env::temp_dir().join(format!("shoal-gpus-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("dir");
    for arch in [
        Architecture::Llama,
        Architecture::Qwen2,
        Architecture::Qwen3,
    ] {
        for wt in [GgmlDType::F32, GgmlDType::Q8_0] {
            let path = dir.join(format!("{}-{wt:?}.gguf", arch.name()));
            write_synthetic_gguf(&SyntheticShape::tiny(arch), wt, 5, &path).expect("write");
            let file = GgufFile::open(&path).expect("open");
            let layers = file.model_config().expect("config").num_layers;
            let one =
                Model::load_on(&file, LoadSpec::full(layers), 256, &bf16_on(0)).expect("load");
            let (want, tokens) = script(&mut LocalSession::new(&one), None);
            // KV heads of the tiny shape: 3, so 2 ranks split them 2 + 1.
            for world in (2..=n.min(3)).rev() {
                let (got, _) = tensor_parallel(&path, world, &tokens);
                let (err, scale) = max_err(&want, &got);
                eprintln!(
                    "{} {wt:?}, {world} GPUs: largest difference {err:.4} of logits up to {scale:.2} ({:.2}%)",
                    arch.name(),
                    100.0 * err / scale
                );
                // bf16 keeps 8 bits of mantissa: every rank rounds its partial sums, and
                // NCCL adds them in bf16, where one GPU rounds the whole sum once.
                assert!(
                    err <= 3e-2 * scale,
                    "{} {wt:?} on {world} GPUs differs by {err} (scale {scale})",
                    arch.name()
                );
            }
        }
    }
}

/// A peer that takes the NCCL id and then never initialises (it died between the two)
/// costs the other rank a clear error within the group's deadline, not a hang in NCCL's
/// bootstrap, which itself waits without limit.
#[test]
fn nccl_init_without_its_peer_is_an_error_within_the_deadline() {
    if two_or_more_gpus().is_none() {
        return;
    }
    let deadline = Duration::from_secs(3);
    let mut groups = local_group(2, deadline);
    let mut silent = groups.pop().expect("rank 1");
    let mut lead = groups.pop().expect("rank 0");
    let peer = thread::spawn(move || {
        // Take the id as `join` would, then never initialise.
        let mut id = Vec::new();
        silent.broadcast(0, &mut id).expect("id");
        thread::sleep(3 * deadline);
        drop(silent);
    });
    let device = Device::new_cuda(0).expect("device");
    let start = Instant::now();
    let err = shoal_runner::nccl::join(&mut lead, &device)
        .err()
        .expect("an error, not a communicator");
    let waited = start.elapsed();
    println!("NCCL init without its peer: {err} (after {waited:?})");
    assert!(
        waited < deadline + Duration::from_secs(2),
        "waited {waited:?}"
    );
    assert!(err.to_string().contains("NCCL init"), "{err}");
    peer.join().expect("peer");
}

/// The all-reduce of one layer's partial output, at the hidden sizes of an 8B and a 70B
/// Llama, for one token (decode) and 512 (prefill): microseconds per all-reduce.
#[test]
#[ignore = "a benchmark: prints numbers"]
fn nccl_all_reduce_time() {
    let Some(n) = two_or_more_gpus() else {
        return;
    };
    for world in [2, 4, 8].into_iter().filter(|&w| w <= n) {
        let groups = local_group(world, Duration::from_secs(60));
        let handles: Vec<_> = groups
            .into_iter()
            .enumerate()
            .map(|(r, mut group)| {
                thread::spawn(move || {
                    let device = Device::new_cuda(r).expect("device");
                    let comm = shoal_runner::nccl::join(&mut group, &device).expect("join");
                    let mut lines = Vec::new();
                    for hidden in [4096usize, 8192] {
                        for tokens in [1usize, 512] {
                            let t = Tensor::randn(0f32, 1f32, (tokens, hidden), &device)
                                .and_then(|t| t.to_dtype(DType::BF16))
                                .expect("tensor");
                            let iters = if tokens == 1 { 2000 } else { 200 };
                            for _ in 0..20 {
                                shoal_runner::nccl::all_reduce(&comm, &t).expect("warm-up");
                            }
                            comm.stream().synchronize().expect("sync");
                            let start = Instant::now();
                            for _ in 0..iters {
                                shoal_runner::nccl::all_reduce(&comm, &t).expect("all-reduce");
                            }
                            comm.stream().synchronize().expect("sync");
                            let us = start.elapsed().as_secs_f64() * 1e6 / iters as f64;
                            lines.push(format!(
                                "{world} GPUs, {tokens} x {hidden} bf16: {us:.1} us per all-reduce"
                            ));
                        }
                    }
                    lines
                })
            })
            .collect();
        let mut all: Vec<Vec<String>> = handles
            .into_iter()
            .map(|h| h.join().expect("join"))
            .collect();
        for line in all.remove(0) {
            println!("{line}");
        }
    }
}
