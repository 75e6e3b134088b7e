//! GPU against CPU on generated models of every architecture: logits within f32 and bf16
//! tolerance, and the same 32 greedy tokens. Runs where a CUDA device is (a build with
//! `--features cuda`, see scripts/build-cuda.sh); elsewhere it says so and passes.

use candle_core::quantized::GgmlDType;
use candle_core::{DType, Tensor};
use shoal_model::synthetic::{SyntheticShape, write_synthetic_gguf};
use shoal_model::{Architecture, BatchPart, Compute, GgufFile, GpuDecode, LoadSpec, Model};
use std::path::Path;

fn gpu(dtype: DType) -> Option<Compute> {
    match Compute::parse("cuda:0") {
        Ok(mut c) => {
            c.dtype = dtype;
            Some(c)
        }
        Err(e) => {
            eprintln!("skipped: no CUDA device here ({e})");
            None
        }
    }
}

fn rows(t: &Tensor) -> Vec<Vec<f32>> {
    t.to_dtype(DType::F32)
        .and_then(|t| t.to_vec2::<f32>())
        .expect("logits")
}

fn max_err(a: &[Vec<f32>], b: &[Vec<f32>]) -> (f32, f32) {
    let scale = a
        .iter()
        .flatten()
        .fold(0f32, |m, v| m.max(v.abs()))
        .max(1.0);
    let err = a
        .iter()
        .flatten()
        .zip(b.iter().flatten())
        .fold(0f32, |m, (x, y)| m.max((x - y).abs()));
    (err, scale)
}

fn greedy(model: &Model, prompt: &[u32], steps: usize) -> Vec<u32> {
    let mut cache = model.new_cache();
    let mut logits = model.forward(prompt, &mut cache, false).expect("prefill");
    let mut out = Vec::new();
    for _ in 0..steps {
        let next = logits
            .squeeze(0)
            .and_then(|l| l.argmax(0))
            .and_then(|a| a.to_scalar::<u32>())
            .expect("argmax");
        out.push(next);
        logits = model.forward(&[next], &mut cache, false).expect("decode");
    }
    out
}

#[test]
fn gpu_logits_and_greedy_tokens_match_the_cpu() {
    let Some(f32_gpu) = gpu(DType::F32) else {
        return;
    };
    let bf16_gpu = gpu(DType::BF16).expect("cuda");
    let dir = std::env::temp_dir().join(format!("shoal-gpu-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("dir");
    let prompt: Vec<u32> = (0..40).map(|i| (i * 37 + 11) % 200).collect();
    for arch in [
        Architecture::Llama,
        Architecture::Qwen2,
        Architecture::Qwen3,
    ] {
        for wt in [GgmlDType::F32, GgmlDType::Q8_0] {
            let path = dir.join(format!("{}-{wt:?}.gguf", arch.name()));
            write_synthetic_gguf(&SyntheticShape::tiny(arch), wt, 3, &path).expect("write");
            let file = GgufFile::open(&path).expect("open");
            let spec = LoadSpec::full(file.model_config().expect("config").num_layers);
            // The CPU reference in f32 with dense weights: the GPU dequantizes too.
            unsafe { std::env::set_var("SHOAL_KERNELS", "dense") };
            let cpu = Model::load(&file, spec.clone(), 256).expect("cpu");
            let on_f32 = Model::load_on(&file, spec.clone(), 256, &f32_gpu).expect("gpu f32");
            let on_bf16 = Model::load_on(&file, spec, 256, &bf16_gpu).expect("gpu bf16");
            let run = |m: &Model| {
                let mut c = m.new_cache();
                let mut out = rows(&m.forward(&prompt[..17], &mut c, true).expect("chunk 1"));
                out.extend(rows(
                    &m.forward(&prompt[17..], &mut c, true).expect("chunk 2"),
                ));
                out
            };
            let want = run(&cpu);
            let (e32, scale) = max_err(&want, &run(&on_f32));
            let (e16, _) = max_err(&want, &run(&on_bf16));
            eprintln!(
                "{} {wt:?}: f32 GPU off by {e32:.2e}, bf16 GPU by {e16:.2e} (scale {scale:.2})",
                arch.name()
            );
            // Q8_0 on the GPU runs candle's quantized kernels (8-bit activations).
            let tol32 = if wt == GgmlDType::F32 { 1e-3 } else { 5e-2 };
            assert!(
                e32 <= tol32 * scale,
                "{} {wt:?} f32: {e32} (scale {scale})",
                arch.name()
            );
            assert!(
                e16 <= 8e-2 * scale,
                "{} {wt:?} bf16: {e16} (scale {scale})",
                arch.name()
            );
            if wt == GgmlDType::F32 {
                assert_eq!(
                    greedy(&cpu, &prompt[..5], 32),
                    greedy(&on_f32, &prompt[..5], 32),
                    "{} greedy tokens",
                    arch.name()
                );
            }
        }
    }
}

/// The decode path's shape: heads of 64 in groups of 4, widths that K-quant blocks divide.
fn decode_shape(arch: Architecture) -> SyntheticShape {
    SyntheticShape {
        hidden: 512,
        heads: 8,
        kv_heads: 2,
        head_dim: 64,
        ffn: 1024,
        vocab: 512,
        layers: 3,
        context: 256,
        ..SyntheticShape::tiny(arch)
    }
}

/// The decode shape of every architecture in every weight type the GPU kernels read
/// (written under a directory named by `tag`, weights from `seed`), each with its whole-
/// model spec. Sets `SHOAL_KERNELS=dense`: the CPU reference dequantizes, as the GPU does.
fn decode_models(tag: &str, seed: u64) -> Vec<(Architecture, GgmlDType, GgufFile, LoadSpec)> {
    let dir = std::env::temp_dir().join(format!("shoal-gpu-{tag}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("dir");
    unsafe { std::env::set_var("SHOAL_KERNELS", "dense") };
    let mut models = Vec::new();
    for arch in [
        Architecture::Llama,
        Architecture::Qwen2,
        Architecture::Qwen3,
    ] {
        for wt in [
            GgmlDType::F32,
            GgmlDType::Q8_0,
            GgmlDType::Q4K,
            GgmlDType::Q6K,
        ] {
            let path = dir.join(format!("{}-{wt:?}.gguf", arch.name()));
            write_synthetic_gguf(&decode_shape(arch), wt, seed, &path).expect("write");
            let file = GgufFile::open(&path).expect("open");
            let spec = LoadSpec::full(file.model_config().expect("config").num_layers);
            models.push((arch, wt, file, spec));
        }
    }
    models
}

/// Logits of every decode step after a prompt, the decoded tokens given (the CPU's
/// greedy answer), so every path sees the same sequence.
fn decode_logits(model: &Model, prompt: &[u32], tokens: &[u32]) -> Vec<Vec<f32>> {
    let mut cache = model.new_cache();
    model.forward(prompt, &mut cache, false).expect("prefill");
    tokens
        .iter()
        .map(|&t| {
            rows(&model.forward(&[t], &mut cache, false).expect("decode"))
                .pop()
                .expect("a row")
        })
        .collect()
}

fn argmax(row: &[f32]) -> u32 {
    row.iter()
        .enumerate()
        .fold((0, f32::NEG_INFINITY), |(bi, bv), (i, &v)| {
            if v > bv { (i, v) } else { (bi, bv) }
        })
        .0 as u32
}

#[test]
fn graph_replay_equals_eager_decoding_and_the_cpu() {
    let Some(bf16_gpu) = gpu(DType::BF16) else {
        return;
    };
    let prompt: Vec<u32> = (0..23).map(|i| (i * 37 + 11) % 500).collect();
    const STEPS: usize = 64;
    for (arch, wt, file, spec) in decode_models("decode", 5) {
        let cpu = Model::load(&file, spec.clone(), 256).expect("cpu");
        // The CPU's greedy answer is the sequence every path decodes.
        let mut tokens = vec![prompt[prompt.len() - 1]];
        let mut cache = cpu.new_cache();
        let mut logits = cpu
            .forward(&prompt, &mut cache, false)
            .expect("cpu prefill");
        for _ in 0..STEPS {
            let next = argmax(&rows(&logits)[0]);
            tokens.push(next);
            logits = cpu.forward(&[next], &mut cache, false).expect("cpu decode");
        }
        let tokens = &tokens[1..];
        let want = decode_logits(&cpu, &prompt, tokens);
        let load = |mode: GpuDecode| {
            let mut m = Model::load_on(&file, spec.clone(), 256, &bf16_gpu).expect("gpu");
            m.set_gpu_decode(mode);
            m
        };
        let graphs = decode_logits(&load(GpuDecode::Graphs), &prompt, tokens);
        let eager = decode_logits(&load(GpuDecode::Eager), &prompt, tokens);
        let candle = decode_logits(&load(GpuDecode::Candle), &prompt, tokens);
        let (e_cpu, scale) = max_err(&want, &graphs);
        let (e_candle, _) = max_err(&want, &candle);
        eprintln!(
            "{} {wt:?}: {STEPS} steps, graph vs CPU f32 {e_cpu:.2e}, candle's bf16 path vs CPU \
                 {e_candle:.2e} (scale {scale:.2})",
            arch.name()
        );
        assert_eq!(
            graphs,
            eager,
            "{} {wt:?}: graph replay differs from eager",
            arch.name()
        );
        let greedy = |l: &[Vec<f32>]| l.iter().map(|r| argmax(r)).collect::<Vec<_>>();
        assert_eq!(greedy(&graphs), greedy(&eager), "{} {wt:?}", arch.name());
        // bf16 weights as candle's bf16 path; quantized ones add 8-bit activations.
        let tol = if wt == GgmlDType::F32 { 8e-2 } else { 1.5e-1 };
        assert!(
            e_cpu <= tol * scale,
            "{} {wt:?}: graph decode off the CPU by {e_cpu} (scale {scale})",
            arch.name()
        );
    }
}

/// More sequences than a handful, each stepped by the single-token step in turn (as a
/// serving rank replays one graph per sequence): every graph is keyed by its sequence's
/// cache, so each sequence's logits are exactly what it makes decoding alone, whatever
/// was replayed between its tokens and however many graphs are kept.
#[test]
fn interleaved_sequences_replay_each_their_own_graph() {
    let Some(bf16_gpu) = gpu(DType::BF16) else {
        return;
    };
    const SEQUENCES: usize = 10;
    const STEPS: usize = 12;
    let prompt = |s: usize| -> Vec<u32> {
        (0..5 + 7 * s)
            .map(|i| ((i * 37 + s * 101 + 11) % 500) as u32)
            .collect()
    };
    let feed = |s: usize, k: usize| ((s * 53 + k * 29 + 7) % 500) as u32;
    for (arch, wt, file, spec) in decode_models("interleave", 9) {
        if wt != GgmlDType::Q4K && wt != GgmlDType::F32 {
            continue;
        }
        let model = Model::load_on(&file, spec.clone(), 256, &bf16_gpu).expect("gpu");
        let alone: Vec<Vec<Vec<f32>>> = (0..SEQUENCES)
            .map(|s| {
                decode_logits(
                    &model,
                    &prompt(s),
                    &(0..STEPS).map(|k| feed(s, k)).collect::<Vec<_>>(),
                )
            })
            .collect();
        let mut caches: Vec<_> = (0..SEQUENCES)
            .map(|s| {
                let mut c = model.new_cache();
                model.forward(&prompt(s), &mut c, false).expect("prefill");
                c
            })
            .collect();
        let mut together = vec![Vec::new(); SEQUENCES];
        for k in 0..STEPS {
            for (s, cache) in caches.iter_mut().enumerate() {
                let l = model.forward(&[feed(s, k)], cache, false).expect("decode");
                together[s].push(rows(&l).pop().expect("a row"));
            }
        }
        for s in 0..SEQUENCES {
            assert_eq!(
                together[s],
                alone[s],
                "{} {wt:?}: sequence {s} interleaved differs from alone",
                arch.name()
            );
        }
    }
}

/// A long prompt on the GPU's many-row kernels (attention probabilities causal by
/// position in one kernel, rows to heads with bias and rope, SiLU·up) and, from 128 rows
/// a product, GGUF blocks dequantized to bf16 for cuBLAS: a 150-token chunk then a
/// 50-token one (candle's 8-bit kernels), every position's logits within bf16 tolerance
/// of the CPU in f32.
#[test]
fn long_prompt_chunks_on_the_gpu_match_the_cpu() {
    let Some(bf16_gpu) = gpu(DType::BF16) else {
        return;
    };
    let prompt: Vec<u32> = (0..200).map(|i| (i * 37 + 11) % 500).collect();
    for (arch, wt, file, spec) in decode_models("prefill", 7) {
        let cpu = Model::load(&file, spec.clone(), 256).expect("cpu");
        let gpu = Model::load_on(&file, spec, 256, &bf16_gpu).expect("gpu");
        let run = |m: &Model| {
            let mut c = m.new_cache();
            let first = rows(&m.forward(&prompt[..150], &mut c, true).expect("chunk 1"));
            let second = rows(&m.forward(&prompt[150..], &mut c, true).expect("chunk 2"));
            (first, second)
        };
        let (want1, want2) = run(&cpu);
        let (got1, got2) = run(&gpu);
        let (e1, scale) = max_err(&want1, &got1);
        let (e2, _) = max_err(&want2, &got2);
        eprintln!(
            "{} {wt:?}: 150-token chunk off the CPU by {e1:.2e}, the 50 after it by {e2:.2e} \
                 (scale {scale:.2})",
            arch.name()
        );
        // The first chunk's products are bf16 (dequantized weights); the second's
        // quantized ones take 8-bit activations.
        assert!(
            e1 <= 8e-2 * scale,
            "{} {wt:?}: {e1} (scale {scale})",
            arch.name()
        );
        let tol2 = if wt == GgmlDType::F32 { 8e-2 } else { 1.5e-1 };
        assert!(
            e2 <= tol2 * scale,
            "{} {wt:?}: {e2} (scale {scale})",
            arch.name()
        );
    }
}

/// Decode rows of four sequences in one batched forward pass (`forward_layers_batch`, as
/// a runner's step of streams runs it): every sequence at its own position with its own
/// cache (prompts of 5 to 70 tokens, so capacities differ and one doubles mid-way), rope,
/// the KV append and attention on the decode kernels for the whole batch at once. Each
/// sequence's logits stay within bf16 tolerance of the CPU in f32 and within rounding of
/// the same sequence batched alone.
#[test]
fn batched_gpu_decode_matches_each_sequence_alone() {
    let Some(bf16_gpu) = gpu(DType::BF16) else {
        return;
    };
    let dir = std::env::temp_dir().join(format!("shoal-gpu-batch-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("dir");
    const STEPS: usize = 16;
    let prompts: Vec<Vec<u32>> = [5usize, 23, 61, 70]
        .iter()
        .enumerate()
        .map(|(s, &n)| {
            (0..n)
                .map(|i| ((i * 37 + s * 101 + 11) % 500) as u32)
                .collect()
        })
        .collect();
    let feed: Vec<Vec<u32>> = (0..prompts.len())
        .map(|s| {
            (0..STEPS)
                .map(|k| ((s * 53 + k * 29 + 7) % 500) as u32)
                .collect()
        })
        .collect();
    // Every sequence's logits after each fed token, the sequences in `members` batched.
    let batched = |model: &Model, members: &[usize]| -> Vec<Vec<Vec<f32>>> {
        let mut caches: Vec<_> = members
            .iter()
            .map(|&s| {
                let mut c = model.new_cache();
                model.forward(&prompts[s], &mut c, false).expect("prefill");
                c
            })
            .collect();
        let mut got = vec![Vec::new(); members.len()];
        let steps: Vec<Vec<u32>> = (0..STEPS)
            .map(|k| members.iter().map(|&s| feed[s][k]).collect())
            .collect();
        for tokens in steps {
            let h = model.embed(&tokens).expect("embed");
            let mut parts: Vec<BatchPart<'_>> = caches
                .iter_mut()
                .map(|cache| BatchPart { cache, rows: 1 })
                .collect();
            let h = model
                .forward_layers_batch(h, &mut parts, None)
                .expect("batched decode");
            for (i, row) in rows(&model.head_each(&h).expect("head"))
                .into_iter()
                .enumerate()
            {
                got[i].push(row);
            }
        }
        got
    };
    for arch in [
        Architecture::Llama,
        Architecture::Qwen2,
        Architecture::Qwen3,
    ] {
        let path = dir.join(format!("{}.gguf", arch.name()));
        write_synthetic_gguf(&decode_shape(arch), GgmlDType::F32, 5, &path).expect("write");
        let file = GgufFile::open(&path).expect("open");
        let spec = LoadSpec::full(file.model_config().expect("config").num_layers);
        unsafe { std::env::set_var("SHOAL_KERNELS", "dense") };
        let cpu = Model::load(&file, spec.clone(), 256).expect("cpu");
        let model = Model::load_on(&file, spec.clone(), 256, &bf16_gpu).expect("gpu");
        let all: Vec<usize> = (0..prompts.len()).collect();
        let together = batched(&model, &all);
        assert!(
            model.gpu_batch_steps() >= STEPS,
            "{}: the batch did not run on the decode kernels",
            arch.name()
        );
        for s in all {
            let want = decode_logits(&cpu, &prompts[s], &feed[s]);
            let alone = batched(&model, &[s]).remove(0);
            let (e_cpu, scale) = max_err(&want, &together[s]);
            let (e_alone, _) = max_err(&alone, &together[s]);
            eprintln!(
                "{} sequence {s} ({} prompt tokens): batched vs CPU f32 {e_cpu:.2e}, vs alone \
                 {e_alone:.2e} (scale {scale:.2})",
                arch.name(),
                prompts[s].len()
            );
            assert!(
                e_cpu <= 1e-1 * scale,
                "{} sequence {s}: batched decode off the CPU by {e_cpu} (scale {scale})",
                arch.name()
            );
            assert!(
                e_alone <= 3e-2 * scale,
                "{} sequence {s}: batched differs from alone by {e_alone} (scale {scale})",
                arch.name()
            );
        }
    }
}

/// `device_argmax` on rows of a vocabulary's size and odd ones: the first index on ties
/// (as the host's arg-max), a row whose start is not 16-byte aligned (a narrowed view's
/// copy), a length not a multiple of 4, a row of -inf, and several rows at once.
#[test]
fn device_argmax_equals_the_host_first_index_on_ties() {
    let Some(c) = gpu(DType::F32) else {
        return;
    };
    let dev = c.device.clone();
    let mut seed = 0x9e37_79b9_u32;
    let mut rand = move || {
        seed ^= seed << 13;
        seed ^= seed >> 17;
        seed ^= seed << 5;
        (seed % 1000) as f32 / 10.0
    };
    for n in [1usize, 3, 31, 1000, 4099, 128_256, 151_937] {
        let mut rows: Vec<Vec<f32>> = (0..3).map(|_| (0..n).map(|_| rand()).collect()).collect();
        // Ties: the maximum twice, the later copy must lose.
        let top = rows[1].iter().cloned().fold(f32::MIN, f32::max) + 1.0;
        rows[1][n / 2] = top;
        rows[1][n - 1] = top;
        rows[2] = vec![f32::NEG_INFINITY; n];
        let flat: Vec<f32> = rows.iter().flatten().copied().collect();
        let t = Tensor::from_vec(flat.clone(), (3, n), &dev).expect("upload");
        let want: Vec<u32> = rows.iter().map(|r| argmax(r)).collect();
        let want = [want[0], (n / 2) as u32, 0];
        let got = shoal_model::device_argmax(&t)
            .expect("argmax")
            .expect("on a GPU");
        assert_eq!(got, want, "rows of {n}");
        // One row that starts 4 bytes into its buffer (not 16-byte aligned).
        let one = Tensor::from_vec(flat, 3 * n, &dev)
            .and_then(|t| t.narrow(0, 1, n))
            .expect("narrow");
        let mut host: Vec<f32> = one.to_vec1().expect("row");
        let got = shoal_model::device_argmax(&one)
            .expect("argmax")
            .expect("on a GPU");
        assert_eq!(got, vec![argmax(&host)], "an unaligned row of {n}");
        host.iter_mut().for_each(|v| *v = -*v);
        let neg = Tensor::from_vec(host.clone(), n, &dev).expect("upload");
        let got = shoal_model::device_argmax(&neg)
            .expect("argmax")
            .expect("on a GPU");
        assert_eq!(got, vec![argmax(&host)], "negated row of {n}");
    }
}

/// Decodes `shape`'s model (f32 weights written to `dir`, loaded in bf16 on `gpu`) after a
/// 40-token prompt for 24 tokens through the replayed graph and eagerly, and on the
/// CPU: asserts replay equals eager and both lie within bf16 tolerance of the CPU.
/// Returns whether the replayed plan staged its output projection.
fn graph_eager_and_cpu_agree(
    gpu: &Compute,
    shape: &SyntheticShape,
    dir: &Path,
    what: &str,
) -> bool {
    let path = dir.join(format!("{what}.gguf").replace(' ', "-"));
    write_synthetic_gguf(shape, GgmlDType::F32, 9, &path).expect("write");
    let file = GgufFile::open(&path).expect("open");
    let spec = LoadSpec::full(shape.layers);
    let prompt: Vec<u32> = (0..40).map(|i| (i * 53 + 7) % 500).collect();
    let tokens: Vec<u32> = (0..24).map(|i| (i * 29 + 3) % 500).collect();
    let cpu = Model::load(&file, spec.clone(), 256).expect("cpu");
    let want = decode_logits(&cpu, &prompt, &tokens);
    let load = |mode: GpuDecode| {
        let mut m = Model::load_on(&file, spec.clone(), 256, gpu).expect("gpu");
        m.set_gpu_decode(mode);
        m
    };
    let graphed = load(GpuDecode::Graphs);
    let graphs = decode_logits(&graphed, &prompt, &tokens);
    let eager = decode_logits(&load(GpuDecode::Eager), &prompt, &tokens);
    let (err, scale) = max_err(&want, &graphs);
    eprintln!("{what}: graph vs CPU f32 {err:.2e} (scale {scale:.2})");
    assert_eq!(graphs, eager, "{what}: replay differs");
    assert!(err <= 8e-2 * scale, "{what}: off the CPU by {err}");
    let _ = std::fs::remove_file(&path);
    graphed.gpu_output_staged()
}

/// A llama model of heads of 128 (`heads` in groups over `kv_heads`) and small FFN and
/// vocabulary: the attention and the output projection at a real model's widths.
fn wide_shape(hidden: usize, heads: usize, kv_heads: usize, layers: usize) -> SyntheticShape {
    SyntheticShape {
        hidden,
        heads,
        kv_heads,
        head_dim: 128,
        ffn: 1024,
        vocab: 512,
        layers,
        context: 256,
        ..SyntheticShape::tiny(Architecture::Llama)
    }
}

/// The decode variants a test switches on (`SHOAL_GPU_FUSE_O`, `SHOAL_GPU_STAGED`: two
/// designs of the output projection, of which a plan takes the fused one).
const VARIANTS: [&str; 2] = ["SHOAL_GPU_FUSE_O", "SHOAL_GPU_STAGED"];

/// A directory for a test's models, with the dense CPU reference and, of the decode
/// variants, `switch` alone on for the plans built after it (an earlier test's stays on
/// otherwise). The variants are read from the environment when a plan is built, so the
/// GPU tests run one at a time (`--test-threads=1`, scripts/gpu-check.sh): a plan built by
/// another test meanwhile would see the switch.
fn variant_dir(tag: &str, switch: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("shoal-gpu-{tag}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("dir");
    unsafe { std::env::set_var("SHOAL_KERNELS", "dense") };
    for other in VARIANTS {
        unsafe { std::env::remove_var(other) };
    }
    unsafe { std::env::set_var(switch, "1") };
    dir
}

/// The attention kernel that does the output projection reads 16-byte pieces of each
/// row of W_o a lane; the decode shape's groups are 256 values wide (one piece a lane).
/// Here groups of 512 (llama-8B's) and 768 (qwen2.5-1.5b's: 6 heads of 128) as well.
#[test]
fn output_projection_in_the_attention_kernel_at_wider_groups() {
    let Some(bf16_gpu) = gpu(DType::BF16) else {
        return;
    };
    let dir = variant_dir("wide", "SHOAL_GPU_FUSE_O");
    for (hidden, heads, kv_heads) in [(1024, 8, 2), (1536, 12, 2)] {
        let what = format!("groups of {}", heads / kv_heads * 128);
        let shape = wide_shape(hidden, heads, kv_heads, 2);
        graph_eager_and_cpu_agree(&bf16_gpu, &shape, &dir, &what);
    }
}

/// The output projection with its weights staged in shared memory before the wait
/// (`SHOAL_GPU_STAGED=1`, a variant): llama-8B's o (4,096 rows of 4,096: on 132 SMs, 25
/// of a block's 32 rows staged, the rest in registers) and qwen2.5-1.5b's (1,536 rows of
/// 1,536, every row staged, one piece a thread).
#[test]
fn output_projection_staged_in_shared_memory() {
    let Some(bf16_gpu) = gpu(DType::BF16) else {
        return;
    };
    let dir = variant_dir("staged", "SHOAL_GPU_STAGED");
    for (hidden, heads, kv_heads) in [(4096, 32, 8), (1536, 12, 2)] {
        let what = format!("staged o of {hidden}");
        let shape = wide_shape(hidden, heads, kv_heads, 1);
        assert!(
            graph_eager_and_cpu_agree(&bf16_gpu, &shape, &dir, &what),
            "{what}: the plan did not stage the output projection"
        );
    }
}

/// A matrix of many long dense rows (here the down projection: 4,096 rows of 8,192, as
/// llama-8B's of 14,336) takes teams of 8 warps a row (`kernels.rs`'s `split_for`); the
/// small decode shapes never reach that rule.
#[test]
fn long_rows_in_teams_of_eight_warps() {
    let Some(bf16_gpu) = gpu(DType::BF16) else {
        return;
    };
    let dir = std::env::temp_dir().join(format!("shoal-gpu-long-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("dir");
    unsafe { std::env::set_var("SHOAL_KERNELS", "dense") };
    let shape = SyntheticShape {
        ffn: 8192,
        ..wide_shape(4096, 32, 8, 1)
    };
    graph_eager_and_cpu_agree(&bf16_gpu, &shape, &dir, "rows of 8192");
}

/// The greedy tokens of `model` after `prompt`: the first from the prompt's logits, then
/// `steps` more, each a step through the host (the arg-max on the device, its id back,
/// the next step launched).
fn stepped(model: &Model, prompt: &[u32], steps: usize) -> Vec<u32> {
    let argmax = |l: &Tensor| {
        shoal_model::device_argmax(&l.squeeze(0).expect("row"))
            .expect("argmax")
            .expect("on a GPU")[0]
    };
    let mut cache = model.new_cache();
    let mut next = argmax(&model.forward(prompt, &mut cache, false).expect("prefill"));
    let mut out = vec![next];
    for _ in 0..steps {
        next = argmax(&model.forward(&[next], &mut cache, false).expect("decode"));
        out.push(next);
    }
    out
}

/// Chained greedy steps (each step's arg-max feeding the next on the device, the host a
/// step behind) choose the tokens stepping through the host chooses, on every weight type
/// the kernels read (the embedding table kept in bf16 for bf16 weights, else f32); a stop
/// after 10 tokens leaves the cache 10 longer, and decoding on from there goes on as
/// before although one more step had already run.
#[test]
fn chained_greedy_steps_equal_stepping_through_the_host() {
    let Some(bf16_gpu) = gpu(DType::BF16) else {
        return;
    };
    // Chained steps are the default; the plans built below read the switch, set here so
    // that the test checks them whatever the environment says (no other test decodes
    // through `greedy`).
    unsafe { std::env::set_var("SHOAL_GPU_CHAIN", "1") };
    const STEPS: usize = 48;
    let prompt: Vec<u32> = (0..23).map(|i| (i * 41 + 5) % 500).collect();
    let mut models = decode_models("chain", 7);
    let dir = std::env::temp_dir().join(format!("shoal-gpu-chain-bf16-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("dir");
    let path = dir.join("llama-bf16.gguf");
    write_synthetic_gguf(
        &decode_shape(Architecture::Llama),
        GgmlDType::BF16,
        7,
        &path,
    )
    .expect("write");
    let file = GgufFile::open(&path).expect("open");
    let spec = LoadSpec::full(file.model_config().expect("config").num_layers);
    models.push((Architecture::Llama, GgmlDType::BF16, file, spec));
    for (arch, wt, file, spec) in models {
        let what = format!("{} {wt:?}", arch.name());
        let model = Model::load_on(&file, spec, 256, &bf16_gpu).expect("gpu");
        let want = stepped(&model, &prompt, STEPS);
        let mut cache = model.new_cache();
        model.forward(&prompt, &mut cache, false).expect("prefill");
        let mut got = vec![want[0]];
        let done = model
            .greedy(want[0], &mut cache, STEPS, &mut |t| {
                got.push(t);
                true
            })
            .expect("greedy")
            .expect("a chained path on a GPU");
        assert_eq!(done, STEPS, "{what}");
        assert_eq!(got, want, "{what}: chained tokens differ from stepped ones");
        assert_eq!(cache.len(), prompt.len() + STEPS, "{what}");
        // Stopped after 10: the 11th step ran ahead, and decoding on must not see it.
        let mut cache = model.new_cache();
        model.forward(&prompt, &mut cache, false).expect("prefill");
        let mut first = Vec::new();
        let done = model
            .greedy(want[0], &mut cache, STEPS, &mut |t| {
                first.push(t);
                first.len() < 10
            })
            .expect("greedy")
            .expect("chained");
        assert_eq!((done, &first[..]), (10, &want[1..11]), "{what}: stopped");
        assert_eq!(cache.len(), prompt.len() + 10, "{what}");
        let mut rest = Vec::new();
        model
            .greedy(want[10], &mut cache, 5, &mut |t| {
                rest.push(t);
                true
            })
            .expect("greedy on")
            .expect("chained");
        assert_eq!(rest, want[11..16], "{what}: decoding on after a stop");
        eprintln!("{what}: {STEPS} chained greedy tokens equal stepped ones");
    }
}
