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

/// Writes a model of `shape` with weights from `seed` to `path`; matrices in `dtype`
/// (norms and biases stay F32, as in real files).
pub fn write_synthetic_gguf(
    shape: &SyntheticShape,
    dtype: GgmlDType,
    seed: u64,
    path: &Path,
) -> Result<()> {
    let s = shape;
    let mut rng = Rng(seed);
    let mut tensors: Vec<(String, QTensor)> = Vec::new();
    let mut put = |name: String, dims: Vec<usize>, scale: f32, offset: f32| -> Result<()> {
        let n: usize = dims.iter().product();
        let data: Vec<f32> = (0..n).map(|_| offset + scale * rng.next()).collect();
        let t = Tensor::from_vec(data, dims.as_slice(), &Device::Cpu)?;
        let dt = if dims.len() == 1 {
            GgmlDType::F32
        } else {
            dtype
        };
        tensors.push((name, QTensor::quantize(&t, dt)?));
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
    ];
    let meta_refs: Vec<(&str, &V)> = meta.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let tensor_refs: Vec<(&str, &QTensor)> = tensors.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let mut f = std::fs::File::create(path).map_err(|source| ModelError::Io {
        path: path.to_path_buf(),
        source,
    })?;
    gguf_file::write(&mut f, &meta_refs, &tensor_refs)?;
    Ok(())
}
