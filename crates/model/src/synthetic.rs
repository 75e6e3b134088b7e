//! Models with generated weights: any architecture and shape, written as a GGUF file.
//!
//! For tests of sharding on small shapes, and for benchmarks on the shapes of real
//! models where the real file cannot travel (a GPU machine reached through a narrow
//! pipe). The weights are random but scaled like a trained model's (rows of norm about
//! one), so activations stay finite through any number of layers.

use std::path::Path;

use candle_core::quantized::{GgmlDType, QTensor, gguf_file};
use candle_core::{Device, Tensor};

use crate::{Architecture, ModelError, Result};

/// The shape of a generated model.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SyntheticShape {
    pub architecture: Architecture,
    pub hidden: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub ffn: usize,
    pub vocab: usize,
    pub layers: usize,
    pub context: usize,
}

impl SyntheticShape {
    /// The shapes of real models, by name: `qwen2.5-1.5b`, `llama-8b`, `llama-70b`.
    pub fn preset(name: &str) -> Option<Self> {
        let (architecture, hidden, heads, kv_heads, head_dim, ffn, vocab, layers) = match name {
            "qwen2.5-1.5b" => (Architecture::Qwen2, 1536, 12, 2, 128, 8960, 151_936, 28),
            "llama-8b" => (Architecture::Llama, 4096, 32, 8, 128, 14_336, 128_256, 32),
            "llama-70b" => (Architecture::Llama, 8192, 64, 8, 128, 28_672, 128_256, 80),
            _ => return None,
        };
        Some(Self {
            architecture,
            hidden,
            heads,
            kv_heads,
            head_dim,
            ffn,
            vocab,
            layers,
            context: 8192,
        })
    }

    /// A tiny model for tests: 3 KV groups (so 2 ranks split them 2 + 1), odd sizes.
    pub fn tiny(architecture: Architecture) -> Self {
        Self {
            architecture,
            hidden: 96,
            heads: 6,
            kv_heads: 3,
            head_dim: if architecture == Architecture::Qwen3 {
                32
            } else {
                16
            },
            ffn: 160,
            vocab: 200,
            layers: 4,
            context: 512,
        }
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
}

/// The one merge of a generated vocabulary (two spaces' symbols into one token): other
/// readers of GGUF (llama.cpp) refuse a BPE vocabulary without a list of merges.
const MERGE: (&str, &str) = ("\u{120}", "\u{120}");

/// Whether a vocabulary of `n` tokens has room for the [`MERGE`]d token (after the 256
/// byte symbols, before the end-of-text token).
fn has_merge(n: usize) -> bool {
    n > 257
}

/// llama.cpp's `general.file_type` for a file whose matrices are `dtype` (its
/// `LLAMA_FTYPE_MOSTLY_*`; K-quants as their `_M` mixes, the nearest it names).
fn file_type(dtype: GgmlDType) -> u32 {
    match dtype {
        GgmlDType::F32 => 0,
        GgmlDType::F16 => 1,
        GgmlDType::Q4_0 => 2,
        GgmlDType::Q4_1 => 3,
        GgmlDType::Q8_0 => 7,
        GgmlDType::Q5_0 => 8,
        GgmlDType::Q5_1 => 9,
        GgmlDType::Q2K => 10,
        GgmlDType::Q3K => 12,
        GgmlDType::Q4K => 15,
        GgmlDType::Q5K => 17,
        GgmlDType::Q6K => 18,
        GgmlDType::BF16 => 32,
        // Q8_1 and Q8_K are activations' types, never a file's.
        _ => 7,
    }
}

/// A byte-level vocabulary of `n` tokens: the 256 byte symbols of GPT-2's BPE, the
/// [`MERGE`]d token when there is room, fillers, and an end-of-text token last. Text
/// tokenizes byte by byte but for double spaces, which is all a generated model needs
/// to be run and benchmarked end to end.
fn vocab(n: usize) -> Vec<String> {
    let printable =
        |b: u32| (33..=126).contains(&b) || (161..=172).contains(&b) || (174..=255).contains(&b);
    let mut extra = 0;
    let mut out: Vec<String> = (0..256u32)
        .map(|b| {
            let c = if printable(b) {
                b
            } else {
                extra += 1;
                255 + extra
            };
            char::from_u32(c).map(String::from).unwrap_or_default()
        })
        .collect();
    out.truncate(n.saturating_sub(1));
    if has_merge(n) {
        out.push(format!("{}{}", MERGE.0, MERGE.1));
    }
    while out.len() + 1 < n {
        out.push(format!("<|filler{}|>", out.len()));
    }
    out.push("<|endoftext|>".into());
    out
}

/// Writes a model of `shape` with weights from `seed` to `path`; matrices in `dtype`
/// (norms and biases stay F32, as in real files).
pub fn write_synthetic_gguf(
    shape: &SyntheticShape,
    dtype: GgmlDType,
    seed: u64,
    path: &Path,
) -> Result<()> {
    write(shape, dtype, seed, path, false)
}

/// [`write_synthetic_gguf`] for benchmarks of large shapes: quantized blocks are random
/// bytes with small scales (no quantization pass), float weights are drawn on every
/// core. As good as random for timing; for numerics use [`write_synthetic_gguf`].
pub fn write_synthetic_gguf_fast(
    shape: &SyntheticShape,
    dtype: GgmlDType,
    seed: u64,
    path: &Path,
) -> Result<()> {
    write(shape, dtype, seed, path, true)
}

/// Random values `offset + scale·u`, `u` uniform in ±1, on every core.
fn uniform(n: usize, scale: f32, offset: f32, seed: u64) -> Vec<f32> {
    let threads = std::thread::available_parallelism().map_or(1, |t| t.get());
    let per = n.div_ceil(threads).max(1 << 16);
    let mut out = vec![0f32; n];
    std::thread::scope(|sc| {
        for (i, part) in out.chunks_mut(per).enumerate() {
            sc.spawn(move || {
                let mut rng = Rng(seed ^ (i as u64).wrapping_mul(0xA24B_AED4_963E_E407));
                for v in part {
                    *v = offset + scale * rng.next();
                }
            });
        }
    });
    out
}

/// `dims` of random blocks of a quantized type whose f16 scale fields hold `scale`.
fn random_blocks(dtype: GgmlDType, dims: &[usize], scale: f32, seed: u64) -> Result<QTensor> {
    let n: usize = dims.iter().product();
    let (bs, ts) = (dtype.block_size(), dtype.type_size());
    let blocks = n / bs;
    let mut bytes = vec![0u8; blocks * ts];
    let threads = std::thread::available_parallelism().map_or(1, |t| t.get());
    let per = blocks.div_ceil(threads).max(1) * ts;
    let offsets: &[usize] = match dtype {
        GgmlDType::Q4_1 | GgmlDType::Q5_1 | GgmlDType::Q4K | GgmlDType::Q5K | GgmlDType::Q2K => {
            &[0, 2]
        }
        GgmlDType::Q6K => &[208],
        GgmlDType::Q3K => &[108],
        _ => &[0],
    };
    let d = half::f16::from_f32(scale).to_le_bytes();
    std::thread::scope(|sc| {
        for (i, part) in bytes.chunks_mut(per).enumerate() {
            sc.spawn(move || {
                let mut z = seed ^ (i as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15);
                for chunk in part.chunks_mut(8) {
                    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
                    let mut r = z;
                    r = (r ^ (r >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
                    r = (r ^ (r >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
                    r ^= r >> 31;
                    for (j, b) in chunk.iter_mut().enumerate() {
                        *b = (r >> (8 * j)) as u8;
                    }
                }
                for blk in part.chunks_exact_mut(ts) {
                    for &o in offsets {
                        blk[o..o + 2].copy_from_slice(&d);
                    }
                }
            });
        }
    });
    let storage = candle_core::quantized::QStorage::from_data(
        std::borrow::Cow::Owned(bytes),
        &Device::Cpu,
        dtype,
    )?;
    Ok(QTensor::new(storage, dims)?)
}

fn write(
    shape: &SyntheticShape,
    dtype: GgmlDType,
    seed: u64,
    path: &Path,
    fast: bool,
) -> Result<()> {
    let s = shape;
    let mut rng = Rng(seed);
    let mut tensors: Vec<(String, QTensor)> = Vec::new();
    let mut count = 0u64;
    let mut put = |name: String, dims: Vec<usize>, scale: f32, offset: f32| -> Result<()> {
        let n: usize = dims.iter().product();
        let dt = if dims.len() == 1 {
            GgmlDType::F32
        } else {
            dtype
        };
        count += 1;
        let float = matches!(dt, GgmlDType::F32 | GgmlDType::F16 | GgmlDType::BF16);
        let q = if fast && !float {
            // A block scale that gives rows roughly the wanted spread.
            random_blocks(dt, &dims, scale / 8.0, seed.wrapping_add(count))?
        } else {
            let data = if fast {
                uniform(n, scale, offset, seed.wrapping_add(count))
            } else {
                (0..n).map(|_| offset + scale * rng.next()).collect()
            };
            let t = Tensor::from_vec(data, dims.as_slice(), &Device::Cpu)?;
            QTensor::quantize(&t, dt)?
        };
        tensors.push((name, q));
        Ok(())
    };
    // Uniform in ±a has standard deviation a/√3: rows of unit norm need a = √(3/fan_in).
    let unit = |fan_in: usize| (3.0 / fan_in as f32).sqrt();
    let (h, q, kv) = (s.hidden, s.heads * s.head_dim, s.kv_heads * s.head_dim);
    put("token_embd.weight".into(), vec![s.vocab, h], 1.0, 0.0)?;
    put("output_norm.weight".into(), vec![h], 0.2, 1.0)?;
    put("output.weight".into(), vec![s.vocab, h], unit(h) * 2.0, 0.0)?;
    for l in 0..s.layers {
        let p = format!("blk.{l}");
        put(format!("{p}.attn_norm.weight"), vec![h], 0.2, 1.0)?;
        put(format!("{p}.ffn_norm.weight"), vec![h], 0.2, 1.0)?;
        put(format!("{p}.attn_q.weight"), vec![q, h], unit(h), 0.0)?;
        put(format!("{p}.attn_k.weight"), vec![kv, h], unit(h), 0.0)?;
        put(format!("{p}.attn_v.weight"), vec![kv, h], unit(h), 0.0)?;
        put(
            format!("{p}.attn_output.weight"),
            vec![h, q],
            unit(q) * 0.5,
            0.0,
        )?;
        put(format!("{p}.ffn_gate.weight"), vec![s.ffn, h], unit(h), 0.0)?;
        put(format!("{p}.ffn_up.weight"), vec![s.ffn, h], unit(h), 0.0)?;
        put(
            format!("{p}.ffn_down.weight"),
            vec![h, s.ffn],
            unit(s.ffn) * 0.5,
            0.0,
        )?;
        if s.architecture.has_qkv_bias() {
            put(format!("{p}.attn_q.bias"), vec![q], 0.2, 0.0)?;
            put(format!("{p}.attn_k.bias"), vec![kv], 0.2, 0.0)?;
            put(format!("{p}.attn_v.bias"), vec![kv], 0.2, 0.0)?;
        }
        if s.architecture.has_qk_norm() {
            put(
                format!("{p}.attn_q_norm.weight"),
                vec![s.head_dim],
                0.2,
                1.0,
            )?;
            put(
                format!("{p}.attn_k_norm.weight"),
                vec![s.head_dim],
                0.2,
                1.0,
            )?;
        }
    }
    let arch = s.architecture.name();
    use gguf_file::Value as V;
    let meta: Vec<(String, V)> = vec![
        ("general.architecture".into(), V::String(arch.into())),
        (
            "general.name".into(),
            V::String(format!("synthetic-{arch}")),
        ),
        (format!("{arch}.block_count"), V::U32(s.layers as u32)),
        (format!("{arch}.embedding_length"), V::U32(h as u32)),
        (format!("{arch}.feed_forward_length"), V::U32(s.ffn as u32)),
        (
            format!("{arch}.attention.head_count"),
            V::U32(s.heads as u32),
        ),
        (
            format!("{arch}.attention.head_count_kv"),
            V::U32(s.kv_heads as u32),
        ),
        (
            format!("{arch}.attention.key_length"),
            V::U32(s.head_dim as u32),
        ),
        (
            format!("{arch}.attention.layer_norm_rms_epsilon"),
            V::F32(1e-5),
        ),
        (format!("{arch}.rope.freq_base"), V::F32(10_000.0)),
        (format!("{arch}.context_length"), V::U32(s.context as u32)),
        ("tokenizer.ggml.model".into(), V::String("gpt2".into())),
        ("tokenizer.ggml.pre".into(), V::String("qwen2".into())),
        (
            "tokenizer.ggml.tokens".into(),
            V::Array(vocab(s.vocab).into_iter().map(V::String).collect()),
        ),
        (
            "tokenizer.ggml.token_type".into(),
            V::Array(
                (0..s.vocab)
                    .map(|i| V::I32(if i + 1 == s.vocab { 3 } else { 1 }))
                    .collect(),
            ),
        ),
        (
            "tokenizer.ggml.eos_token_id".into(),
            V::U32(s.vocab as u32 - 1),
        ),
        ("general.file_type".into(), V::U32(file_type(dtype))),
    ];
    let mut meta = meta;
    if has_merge(s.vocab) {
        let merge = format!("{} {}", MERGE.0, MERGE.1);
        meta.push((
            "tokenizer.ggml.merges".into(),
            V::Array(vec![V::String(merge)]),
        ));
    }
    let meta_refs: Vec<(&str, &V)> = meta.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let tensor_refs: Vec<(&str, &QTensor)> = tensors.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let mut f = std::fs::File::create(path).map_err(|source| ModelError::Io {
        path: path.to_path_buf(),
        source,
    })?;
    gguf_file::write(&mut f, &meta_refs, &tensor_refs)?;
    Ok(())
}
