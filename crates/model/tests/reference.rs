//! shoal's forward pass against a plain f32 reference written here, on small models with
//! random weights that the test writes as GGUF and as safetensors, for each architecture.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use candle_core::quantized::{GgmlDType, QTensor, gguf_file};
use candle_core::{DType, Device, Tensor};
use shoal_model::{Architecture, GgufFile, LoadSpec, Model, SafetensorsDir, WeightSource};

/// Shape of the generated models: odd sizes, grouped heads.
#[derive(Clone, Copy)]
struct Dims {
    arch: Architecture,
    hidden: usize,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    ffn: usize,
    vocab: usize,
    layers: usize,
    eps: f32,
    theta: f32,
}

fn dims(arch: Architecture) -> Dims {
    Dims {
        arch,
        hidden: 64,
        heads: 4,
        kv_heads: 2,
        // qwen3 decouples head_dim from hidden / heads.
        head_dim: if arch == Architecture::Qwen3 { 32 } else { 16 },
        ffn: 96,
        vocab: 160,
        layers: 3,
        eps: 1e-5,
        theta: 10_000.0,
    }
}

struct Rng(u64);
impl Rng {
    fn next(&mut self) -> f32 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^= z >> 31;
        (z >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0
    }
    fn vec(&mut self, n: usize, scale: f32, offset: f32) -> Vec<f32> {
        (0..n).map(|_| offset + scale * self.next()).collect()
    }
}

/// Logical weights in Hugging Face layout (rows are outputs; rope on halves).
struct Weights {
    d: Dims,
    w: HashMap<String, (Vec<f32>, Vec<usize>)>,
}

impl Weights {
    fn random(d: Dims, seed: u64) -> Self {
        let mut rng = Rng(seed);
        let mut w = HashMap::new();
        let mut put = |name: &str, shape: Vec<usize>, scale: f32, offset: f32, rng: &mut Rng| {
            let n = shape.iter().product();
            w.insert(name.to_string(), (rng.vec(n, scale, offset), shape));
        };
        let (h, q, kv) = (d.hidden, d.heads * d.head_dim, d.kv_heads * d.head_dim);
        put("token_embd.weight", vec![d.vocab, h], 1.0, 0.0, &mut rng);
        put("output_norm.weight", vec![h], 0.2, 1.0, &mut rng);
        put("output.weight", vec![d.vocab, h], 0.3, 0.0, &mut rng);
        for l in 0..d.layers {
            let p = format!("blk.{l}");
            put(
                &format!("{p}.attn_norm.weight"),
                vec![h],
                0.2,
                1.0,
                &mut rng,
            );
            put(&format!("{p}.ffn_norm.weight"), vec![h], 0.2, 1.0, &mut rng);
            put(
                &format!("{p}.attn_q.weight"),
                vec![q, h],
                0.4,
                0.0,
                &mut rng,
            );
            put(
                &format!("{p}.attn_k.weight"),
                vec![kv, h],
                0.4,
                0.0,
                &mut rng,
            );
            put(
                &format!("{p}.attn_v.weight"),
                vec![kv, h],
                0.4,
                0.0,
                &mut rng,
            );
            put(
                &format!("{p}.attn_output.weight"),
                vec![h, q],
                0.2,
                0.0,
                &mut rng,
            );
            put(
                &format!("{p}.ffn_gate.weight"),
                vec![d.ffn, h],
                0.3,
                0.0,
                &mut rng,
            );
            put(
                &format!("{p}.ffn_up.weight"),
                vec![d.ffn, h],
                0.3,
                0.0,
                &mut rng,
            );
            put(
                &format!("{p}.ffn_down.weight"),
                vec![h, d.ffn],
                0.2,
                0.0,
                &mut rng,
            );
            if d.arch == Architecture::Qwen2 {
                put(&format!("{p}.attn_q.bias"), vec![q], 0.2, 0.0, &mut rng);
                put(&format!("{p}.attn_k.bias"), vec![kv], 0.2, 0.0, &mut rng);
                put(&format!("{p}.attn_v.bias"), vec![kv], 0.2, 0.0, &mut rng);
            }
            if d.arch == Architecture::Qwen3 {
                put(
                    &format!("{p}.attn_q_norm.weight"),
                    vec![d.head_dim],
                    0.2,
                    1.0,
                    &mut rng,
                );
                put(
                    &format!("{p}.attn_k_norm.weight"),
                    vec![d.head_dim],
                    0.2,
                    1.0,
                    &mut rng,
                );
            }
        }
        Self { d, w }
    }

    fn get(&self, name: &str) -> &[f32] {
        &self.w[name].0
    }

    /// Rounds every weight through bf16, as a bf16 checkpoint stores it.
    fn rounded_to_bf16(&self) -> Self {
        let w = self
            .w
            .iter()
            .map(|(k, (v, s))| {
                let r = v
                    .iter()
                    .map(|&x| half::bf16::from_f32(x).to_f32())
                    .collect();
                (k.clone(), (r, s.clone()))
            })
            .collect();
        Self { d: self.d, w }
    }
}

/// llama.cpp's convert permutes q/k rows of llama models so rope rotates adjacent pairs.
fn permute_for_gguf(w: &[f32], heads: usize, head_dim: usize, cols: usize) -> Vec<f32> {
    let mut out = vec![0f32; w.len()];
    let half = head_dim / 2;
    for h in 0..heads {
        for i in 0..half {
            for j in 0..2 {
                let src = h * head_dim + j * half + i;
                let dst = h * head_dim + 2 * i + j;
                out[dst * cols..(dst + 1) * cols].copy_from_slice(&w[src * cols..(src + 1) * cols]);
            }
        }
    }
    out
}

fn temp_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("shoal-test-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("temp dir");
    dir
}

fn write_gguf(w: &Weights, dtype: GgmlDType, path: &Path) {
    let d = w.d;
    let arch = d.arch.name();
    let mut tensors = Vec::new();
    for (name, (data, shape)) in &w.w {
        let is_qk = name.ends_with("attn_q.weight") || name.ends_with("attn_k.weight");
        let data = if d.arch == Architecture::Llama && is_qk {
            permute_for_gguf(data, shape[0] / d.head_dim, d.head_dim, shape[1])
        } else {
            data.clone()
        };
        let t = Tensor::from_vec(data, shape.as_slice(), &Device::Cpu).expect("tensor");
        // Norms and biases stay f32, as in real GGUF files.
        let dt = if shape.len() == 1 {
            GgmlDType::F32
        } else {
            dtype
        };
        tensors.push((name.clone(), QTensor::quantize(&t, dt).expect("quantize")));
    }
    use gguf_file::Value as V;
    let meta: Vec<(String, V)> = vec![
        ("general.architecture".into(), V::String(arch.into())),
        (format!("{arch}.block_count"), V::U32(d.layers as u32)),
        (format!("{arch}.embedding_length"), V::U32(d.hidden as u32)),
        (format!("{arch}.feed_forward_length"), V::U32(d.ffn as u32)),
        (
            format!("{arch}.attention.head_count"),
            V::U32(d.heads as u32),
        ),
        (
            format!("{arch}.attention.head_count_kv"),
            V::U32(d.kv_heads as u32),
        ),
        (
            format!("{arch}.attention.key_length"),
            V::U32(d.head_dim as u32),
        ),
        (
            format!("{arch}.attention.layer_norm_rms_epsilon"),
            V::F32(d.eps),
        ),
        (format!("{arch}.rope.freq_base"), V::F32(d.theta)),
        (format!("{arch}.context_length"), V::U32(256)),
    ];
    let meta_refs: Vec<(&str, &V)> = meta.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let tensor_refs: Vec<(&str, &QTensor)> = tensors.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let mut f = std::fs::File::create(path).expect("create gguf");
    gguf_file::write(&mut f, &meta_refs, &tensor_refs).expect("write gguf");
}

fn hf_name(gguf: &str) -> String {
    let map = [
        ("token_embd.weight", "model.embed_tokens.weight"),
        ("output_norm.weight", "model.norm.weight"),
        ("output.weight", "lm_head.weight"),
    ];
    if let Some((_, hf)) = map.iter().find(|(g, _)| *g == gguf) {
        return hf.to_string();
    }
    let rest = gguf.strip_prefix("blk.").expect("layer tensor");
    let (layer, tail) = rest.split_once('.').expect("layer index");
    let (module, kind) = tail.rsplit_once('.').expect("kind");
    let m = match module {
        "attn_norm" => "input_layernorm",
        "ffn_norm" => "post_attention_layernorm",
        "attn_q" => "self_attn.q_proj",
        "attn_k" => "self_attn.k_proj",
        "attn_v" => "self_attn.v_proj",
        "attn_output" => "self_attn.o_proj",
        "attn_q_norm" => "self_attn.q_norm",
        "attn_k_norm" => "self_attn.k_norm",
        "ffn_gate" => "mlp.gate_proj",
        "ffn_up" => "mlp.up_proj",
        "ffn_down" => "mlp.down_proj",
        other => panic!("unknown module {other}"),
    };
    format!("model.layers.{layer}.{m}.{kind}")
}

fn write_safetensors(w: &Weights, dtype: DType, dir: &Path) {
    let d = w.d;
    let tensors: HashMap<String, Tensor> =
        w.w.iter()
            .map(|(name, (data, shape))| {
                let t = Tensor::from_vec(data.clone(), shape.as_slice(), &Device::Cpu)
                    .and_then(|t| t.to_dtype(dtype))
                    .expect("tensor");
                (hf_name(name), t)
            })
            .collect();
    candle_core::safetensors::save(&tensors, dir.join("model.safetensors")).expect("save");
    let arch = match d.arch {
        Architecture::Llama => "LlamaForCausalLM",
        Architecture::Qwen2 => "Qwen2ForCausalLM",
        Architecture::Qwen3 => "Qwen3ForCausalLM",
    };
    let config = serde_json::json!({
        "architectures": [arch],
        "hidden_size": d.hidden,
        "num_hidden_layers": d.layers,
        "num_attention_heads": d.heads,
        "num_key_value_heads": d.kv_heads,
        "head_dim": d.head_dim,
        "intermediate_size": d.ffn,
        "vocab_size": d.vocab,
        "rope_theta": d.theta,
        "rms_norm_eps": d.eps,
        "max_position_embeddings": 256,
        "tie_word_embeddings": false,
    });
    std::fs::write(dir.join("config.json"), config.to_string()).expect("config");
}

// ---- the plain f32 reference -------------------------------------------------------

fn matmul_t(x: &[f32], t: usize, w: &[f32], out: usize, inp: usize) -> Vec<f32> {
    let mut y = vec![0f32; t * out];
    for r in 0..t {
        for o in 0..out {
            let mut acc = 0f64;
            for i in 0..inp {
                acc += x[r * inp + i] as f64 * w[o * inp + i] as f64;
            }
            y[r * out + o] = acc as f32;
        }
    }
    y
}

fn rms_norm(x: &[f32], w: &[f32], eps: f32) -> Vec<f32> {
    let n = w.len();
    x.chunks(n)
        .flat_map(|row| {
            let ms = row.iter().map(|v| (*v as f64).powi(2)).sum::<f64>() / n as f64;
            let s = 1.0 / (ms + eps as f64).sqrt();
            row.iter()
                .zip(w)
                .map(move |(v, g)| (*v as f64 * s) as f32 * g)
        })
        .collect()
}

/// Logits `(t, vocab)` of every position of `tokens`, from scratch, with keys and values
/// rounded to `kv` as the cache keeps them (f16 where shoal computes in f32 on a CPU; `U8`
/// for 8-bit rows).
fn reference_logits(w: &Weights, tokens: &[u32], kv: DType) -> Vec<Vec<f32>> {
    // 8-bit rows: a head's row over its largest magnitude / 127, rounded; keys turned by
    // the normalized Hadamard matrix first and back after (here its entries,
    // (−1)^popcount(i & j) / √n, one product at a time).
    let hadamard = |row: &mut [f32]| {
        let n = row.len();
        let turned: Vec<f32> = (0..n)
            .map(|i| {
                let sum: f64 = (0..n)
                    .map(|j| {
                        let sign = if (i & j).count_ones() % 2 == 0 {
                            1.0
                        } else {
                            -1.0
                        };
                        sign * row[j] as f64
                    })
                    .sum();
                (sum / (n as f64).sqrt()) as f32
            })
            .collect();
        row.copy_from_slice(&turned);
    };
    let rounded_8 = |xs: &mut [f32], keys: bool| {
        let hd = w.d.head_dim;
        let turn = keys && hd.is_power_of_two() && hd >= 8;
        for row in xs.chunks_mut(hd) {
            if turn {
                hadamard(row);
            }
            let d = row.iter().fold(0f32, |m, x| m.max(x.abs())) / 127.0;
            let inv = if d > 0.0 { 1.0 / d } else { 0.0 };
            for x in row.iter_mut() {
                *x = (*x * inv).round().clamp(-127.0, 127.0) * d;
            }
            if turn {
                hadamard(row);
            }
        }
    };
    let kept = |xs: &mut [f32], keys: bool| {
        if kv == DType::U8 {
            rounded_8(xs, keys);
            return;
        }
        for x in xs {
            *x = match kv {
                DType::F16 => half::f16::from_f32(*x).to_f32(),
                DType::BF16 => half::bf16::from_f32(*x).to_f32(),
                _ => *x,
            };
        }
    };
    let d = w.d;
    let (h, hd, nh, nkv) = (d.hidden, d.head_dim, d.heads, d.kv_heads);
    let t = tokens.len();
    let emb = w.get("token_embd.weight");
    let mut x: Vec<f32> = tokens
        .iter()
        .flat_map(|&id| emb[id as usize * h..(id as usize + 1) * h].to_vec())
        .collect();
    let rope = |v: &mut [f32], pos: usize| {
        let half = hd / 2;
        for i in 0..half {
            let freq = 1.0 / (d.theta as f64).powf(2.0 * i as f64 / hd as f64);
            let (s, c) = (pos as f64 * freq).sin_cos();
            let (a, b) = (v[i] as f64, v[i + half] as f64);
            v[i] = (a * c - b * s) as f32;
            v[i + half] = (a * s + b * c) as f32;
        }
    };
    for l in 0..d.layers {
        let p = |n: &str| format!("blk.{l}.{n}");
        let xn = rms_norm(&x, w.get(&p("attn_norm.weight")), d.eps);
        let proj = |name: &str, out: usize| {
            let mut y = matmul_t(&xn, t, w.get(&p(&format!("{name}.weight"))), out, h);
            if let Some((b, _)) = w.w.get(&p(&format!("{name}.bias"))) {
                for r in 0..t {
                    for o in 0..out {
                        y[r * out + o] += b[o];
                    }
                }
            }
            y
        };
        let mut q = proj("attn_q", nh * hd);
        let mut k = proj("attn_k", nkv * hd);
        let mut v = proj("attn_v", nkv * hd);
        kept(&mut v, false);
        if d.arch == Architecture::Qwen3 {
            q = rms_norm(&q, w.get(&p("attn_q_norm.weight")), d.eps);
            k = rms_norm(&k, w.get(&p("attn_k_norm.weight")), d.eps);
        }
        for pos in 0..t {
            for head in 0..nh {
                rope(&mut q[pos * nh * hd + head * hd..][..hd], pos);
            }
            for head in 0..nkv {
                rope(&mut k[pos * nkv * hd + head * hd..][..hd], pos);
            }
        }
        kept(&mut k, true);
        let mut attn = vec![0f32; t * nh * hd];
        for head in 0..nh {
            let kvh = head / (nh / nkv);
            for i in 0..t {
                let qi = &q[i * nh * hd + head * hd..][..hd];
                let scores: Vec<f64> = (0..=i)
                    .map(|j| {
                        let kj = &k[j * nkv * hd + kvh * hd..][..hd];
                        qi.iter()
                            .zip(kj)
                            .map(|(a, b)| *a as f64 * *b as f64)
                            .sum::<f64>()
                            / (hd as f64).sqrt()
                    })
                    .collect();
                let m = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let e: Vec<f64> = scores.iter().map(|s| (s - m).exp()).collect();
                let sum: f64 = e.iter().sum();
                for c in 0..hd {
                    let mut acc = 0f64;
                    for (j, ej) in e.iter().enumerate() {
                        acc += ej / sum * v[j * nkv * hd + kvh * hd + c] as f64;
                    }
                    attn[i * nh * hd + head * hd + c] = acc as f32;
                }
            }
        }
        let o = matmul_t(&attn, t, w.get(&p("attn_output.weight")), h, nh * hd);
        for (xi, oi) in x.iter_mut().zip(&o) {
            *xi += oi;
        }
        let xn = rms_norm(&x, w.get(&p("ffn_norm.weight")), d.eps);
        let g = matmul_t(&xn, t, w.get(&p("ffn_gate.weight")), d.ffn, h);
        let u = matmul_t(&xn, t, w.get(&p("ffn_up.weight")), d.ffn, h);
        let a: Vec<f32> = g
            .iter()
            .zip(&u)
            .map(|(g, u)| (*g as f64 / (1.0 + (-*g as f64).exp()) * *u as f64) as f32)
            .collect();
        let down = matmul_t(&a, t, w.get(&p("ffn_down.weight")), h, d.ffn);
        for (xi, di) in x.iter_mut().zip(&down) {
            *xi += di;
        }
    }
    let xn = rms_norm(&x, w.get("output_norm.weight"), d.eps);
    let logits = matmul_t(&xn, t, w.get("output.weight"), d.vocab, h);
    logits.chunks(d.vocab).map(|r| r.to_vec()).collect()
}

// ---- running shoal ---------------------------------------------------------------

const PROMPT: [u32; 9] = [3, 17, 42, 7, 99, 0, 55, 150, 8];

/// shoal's logits for every position of PROMPT: a chunked prefill (4 + 4 tokens) and
/// then one decode step, so the cache path and the chunk boundary are both exercised; and
/// the type the cache kept keys and values in.
fn shoal_logits(source: &dyn WeightSource) -> (Vec<Vec<f32>>, DType) {
    let cfg = source.config().expect("config").clone();
    let model = Model::load(source, LoadSpec::full(cfg.num_layers), 64).expect("load");
    let mut cache = model.new_cache();
    let mut rows = Vec::new();
    for piece in [&PROMPT[..4], &PROMPT[4..8], &PROMPT[8..]] {
        let logits = model.forward(piece, &mut cache, true).expect("forward");
        rows.extend(logits.to_vec2::<f32>().expect("logits"));
    }
    (rows, cache.dtype())
}

fn max_rel_err(a: &[Vec<f32>], b: &[Vec<f32>]) -> f32 {
    assert_eq!(a.len(), b.len());
    let scale = b.iter().flatten().fold(0f32, |m, v| m.max(v.abs()));
    let diff = a
        .iter()
        .flatten()
        .zip(b.iter().flatten())
        .fold(0f32, |m, (x, y)| m.max((x - y).abs()));
    diff / scale
}

fn check_gguf(arch: Architecture, dtype: GgmlDType, tolerance: f32) {
    let w = Weights::random(dims(arch), 42 + arch as u64);
    let dir = temp_dir(&format!("{}-{dtype:?}", arch.name()));
    let path = dir.join("model.gguf");
    write_gguf(&w, dtype, &path);
    let file = GgufFile::open(&path).expect("open gguf");
    let (got, kv) = shoal_logits(&file);
    // The reference sees the weights as the file stores them (quantized, then expanded).
    let reference_weights = if dtype == GgmlDType::F32 {
        w
    } else {
        dequantized_like(&w, dtype)
    };
    let want = reference_logits(&reference_weights, &PROMPT, kv);
    let err = max_rel_err(&got, &want);
    let _ = std::fs::remove_dir_all(&dir);
    assert!(
        err < tolerance,
        "{} {dtype:?}: max relative error {err}",
        arch.name()
    );
}

fn dequantized_like(w: &Weights, dtype: GgmlDType) -> Weights {
    let map =
        w.w.iter()
            .map(|(k, (v, s))| {
                if s.len() == 1 {
                    return (k.clone(), (v.clone(), s.clone()));
                }
                let t = Tensor::from_vec(v.clone(), s.as_slice(), &Device::Cpu).expect("tensor");
                let q = QTensor::quantize(&t, dtype).expect("quantize");
                let back = q
                    .dequantize(&Device::Cpu)
                    .and_then(|t| t.flatten_all())
                    .and_then(|t| t.to_vec1::<f32>())
                    .expect("dequantize");
                (k.clone(), (back, s.clone()))
            })
            .collect();
    Weights { d: w.d, w: map }
}

fn check_safetensors(arch: Architecture, dtype: DType) {
    let w = Weights::random(dims(arch), 7 + arch as u64);
    let w = if dtype == DType::BF16 {
        w.rounded_to_bf16()
    } else {
        w
    };
    let dir = temp_dir(&format!("{}-st-{dtype:?}", arch.name()));
    write_safetensors(&w, dtype, &dir);
    let source = SafetensorsDir::open(&dir).expect("open safetensors");
    let (got, kv) = shoal_logits(&source);
    let want = reference_logits(&w, &PROMPT, kv);
    let err = max_rel_err(&got, &want);
    let _ = std::fs::remove_dir_all(&dir);
    assert!(
        err < 1e-4,
        "{} safetensors {dtype:?}: max relative error {err}",
        arch.name()
    );
}

#[test]
fn llama_gguf_f32_matches_reference() {
    check_gguf(Architecture::Llama, GgmlDType::F32, 1e-4);
}

#[test]
fn qwen2_gguf_f32_matches_reference() {
    check_gguf(Architecture::Qwen2, GgmlDType::F32, 1e-4);
}

#[test]
fn qwen3_gguf_f32_matches_reference() {
    check_gguf(Architecture::Qwen3, GgmlDType::F32, 1e-4);
}

#[test]
fn llama_safetensors_f32_and_bf16_match_reference() {
    check_safetensors(Architecture::Llama, DType::F32);
    check_safetensors(Architecture::Llama, DType::BF16);
}

#[test]
fn qwen2_safetensors_f32_matches_reference() {
    check_safetensors(Architecture::Qwen2, DType::F32);
}

#[test]
fn qwen3_safetensors_f32_matches_reference() {
    check_safetensors(Architecture::Qwen3, DType::F32);
}

/// Quantized weights: the reference uses the same dequantized values, so what remains is
/// the 8-bit quantization of activations inside the quantized dot products. Random
/// three-layer models amplify that rounding (measured: Q8_0 2.9%, Q4_0 5.2%, Q4_1 2.3%,
/// Q5_0 6.3%, F16 7e-7); a wrong dequantization or layout is off by 100% or more.
#[test]
fn quantized_gguf_blocks_match_reference_within_activation_rounding() {
    for dtype in [
        GgmlDType::Q8_0,
        GgmlDType::Q4_0,
        GgmlDType::Q4_1,
        GgmlDType::Q5_0,
        GgmlDType::F16,
    ] {
        check_gguf(Architecture::Qwen2, dtype, 0.1);
    }
}

#[test]
fn a_layer_range_shard_continues_where_the_previous_left_off() {
    let arch = Architecture::Llama;
    let w = Weights::random(dims(arch), 99);
    let dir = temp_dir("shards");
    let path = dir.join("model.gguf");
    write_gguf(&w, GgmlDType::F32, &path);
    let file = GgufFile::open(&path).expect("open");
    let n = file.model_config().expect("config").num_layers;
    let whole = Model::load(&file, LoadSpec::full(n), 64).expect("whole");
    let first = Model::load(
        &file,
        LoadSpec {
            embed: true,
            layers: 0..1,
            head: false,
            tensor: None,
        },
        64,
    )
    .expect("first");
    let second = Model::load(
        &file,
        LoadSpec {
            embed: false,
            layers: 1..n,
            head: true,
            tensor: None,
        },
        64,
    )
    .expect("second");
    let mut c0 = whole.new_cache();
    let want = whole
        .forward(&PROMPT, &mut c0, true)
        .expect("whole forward");
    let (mut c1, mut c2) = (first.new_cache(), second.new_cache());
    let h = first
        .forward_layers(first.embed(&PROMPT).expect("embed"), &mut c1)
        .expect("stage 1");
    let h = second.forward_layers(h, &mut c2).expect("stage 2");
    let got = second.head(&h).expect("head");
    let diff = (got - want)
        .and_then(|d| d.abs())
        .and_then(|d| d.max_all())
        .and_then(|d| d.to_scalar::<f32>());
    let _ = std::fs::remove_dir_all(&dir);
    assert!(diff.expect("diff") < 1e-5);
    assert!(
        first
            .head(&Tensor::zeros((1, 64), DType::F32, &Device::Cpu).expect("zeros"))
            .is_err()
    );
}
