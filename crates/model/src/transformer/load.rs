//! Loading: which tensors a [`LoadSpec`] names, checked against the configuration's
//! shapes, into the layers' matrices on the compute device.

use std::sync::Arc;

use super::{
    Attention, Cut, DecoderLayer, Embedding, GpuDecode, Head, LoadSpec, Model, RmsNorm, Rope,
};
use crate::linear::{KernelChoice, Matrix, shoal_matrix};
use crate::shard::{slice_bias, slice_cols, slice_rows};
use crate::{Compute, ModelError, QLinear, Result, Weight, WeightSource};

fn require(source: &dyn WeightSource, name: &str) -> Result<Weight> {
    source
        .load(name)?
        .ok_or_else(|| ModelError::MissingTensor(name.to_string()))
}

fn check_shape(name: &str, w: &Weight, expected: &[usize]) -> Result<()> {
    if w.dims() != expected {
        return Err(ModelError::Shape {
            name: name.to_string(),
            actual: w.dims().to_vec(),
            expected: expected.to_vec(),
        });
    }
    Ok(())
}

fn linear(
    source: &dyn WeightSource,
    prefix: &str,
    out_features: usize,
    in_features: usize,
    bias: bool,
    cut: Cut,
    compute: &Compute,
) -> Result<QLinear> {
    let name = format!("{prefix}.weight");
    let w = require(source, &name)?;
    check_shape(&name, &w, &[out_features, in_features])?;
    let b = if bias {
        Some(require(source, &format!("{prefix}.bias"))?.to_f32()?)
    } else {
        None
    };
    let (w, b) = match cut {
        Cut::Whole => (w, b),
        Cut::Rows(r) => {
            let b = b.map(|b| slice_bias(&b, r.clone())).transpose()?;
            (slice_rows(&w, r)?, b)
        }
        Cut::Cols(r) => {
            if b.is_some() {
                // Every rank would add it to its partial sum.
                return Err(ModelError::Invalid(format!(
                    "{prefix} has a bias and cannot be split by columns"
                )));
            }
            (slice_cols(&w, r)?, None)
        }
    };
    QLinear::new_on(w, b, compute)
}

fn norm(
    source: &dyn WeightSource,
    name: &str,
    size: usize,
    eps: f32,
    compute: &Compute,
) -> Result<RmsNorm> {
    let w = require(source, name)?;
    check_shape(name, &w, &[size])?;
    Ok(RmsNorm {
        weight: w
            .to_f32()?
            .to_dtype(compute.dtype)?
            .to_device(&compute.device)?,
        eps,
    })
}

impl Model {
    /// Loads the parts of the model that `spec` names, reading only their tensors.
    /// `max_len` bounds the positions this instance will serve (its context length).
    pub fn load(source: &dyn WeightSource, spec: LoadSpec, max_len: usize) -> Result<Self> {
        Self::load_on(source, spec, max_len, &Compute::cpu())
    }

    /// [`Model::load`] onto `compute`'s device (the embedding lookup stays on the CPU;
    /// its rows are copied over).
    pub fn load_on(
        source: &dyn WeightSource,
        spec: LoadSpec,
        max_len: usize,
        compute: &Compute,
    ) -> Result<Self> {
        let config = source.config()?.clone();
        if spec.layers.end > config.num_layers || spec.layers.start > spec.layers.end {
            return Err(ModelError::Invalid(format!(
                "layer range {:?} is outside the model's {} layers",
                spec.layers, config.num_layers
            )));
        }
        let c = &config;
        let load_embedding = || -> Result<Embedding> {
            let w = require(source, "token_embd.weight")?;
            check_shape("token_embd.weight", &w, &[c.vocab_size, c.hidden_size])?;
            Ok(match w {
                Weight::Quantized(q) => match shoal_matrix(&q, KernelChoice::from_env())? {
                    Some(m) => Embedding::Shoal(Arc::new(m)),
                    None => Embedding::Candle(q),
                },
                Weight::Dense(t) => Embedding::Dense(t),
            })
        };
        let embedding = if spec.embed {
            Some(load_embedding()?)
        } else {
            None
        };
        let q_out = c.num_heads * c.head_dim;
        let kv_out = c.num_kv_heads * c.head_dim;
        let g = c.group_size();
        let hd = c.head_dim;
        if let Some(t) = &spec.tensor
            && (t.kv_heads.is_empty()
                || t.kv_heads.end > c.num_kv_heads
                || t.ffn.is_empty()
                || t.ffn.end > c.ffn_size)
        {
            return Err(ModelError::Invalid(format!(
                "tensor slice {t:?} does not fit {} KV heads and {} FFN columns",
                c.num_kv_heads, c.ffn_size
            )));
        }
        let (q_cut, kv_cut, o_cut, ffn_rows, ffn_cols) = match &spec.tensor {
            None => (Cut::Whole, Cut::Whole, Cut::Whole, Cut::Whole, Cut::Whole),
            Some(t) => {
                let q = t.kv_heads.start * g * hd..t.kv_heads.end * g * hd;
                (
                    Cut::Rows(q.clone()),
                    Cut::Rows(t.kv_heads.start * hd..t.kv_heads.end * hd),
                    Cut::Cols(q),
                    Cut::Rows(t.ffn.clone()),
                    Cut::Cols(t.ffn.clone()),
                )
            }
        };
        let bias = c.architecture.has_qkv_bias();
        let mut layers = Vec::with_capacity(spec.layers.len());
        for i in spec.layers.clone() {
            tracing::trace!(layer = i, "loading decoder layer");
            let p = format!("blk.{i}");
            let qk_norm = |n: &str| -> Result<Option<RmsNorm>> {
                if c.architecture.has_qk_norm() {
                    Ok(Some(norm(
                        source,
                        &format!("{p}.{n}.weight"),
                        c.head_dim,
                        c.rms_eps,
                        compute,
                    )?))
                } else {
                    Ok(None)
                }
            };
            layers.push(DecoderLayer {
                index: i,
                attn_norm: norm(
                    source,
                    &format!("{p}.attn_norm.weight"),
                    c.hidden_size,
                    c.rms_eps,
                    compute,
                )?,
                attn: Attention {
                    q: linear(
                        source,
                        &format!("{p}.attn_q"),
                        q_out,
                        c.hidden_size,
                        bias,
                        q_cut.clone(),
                        compute,
                    )?,
                    k: linear(
                        source,
                        &format!("{p}.attn_k"),
                        kv_out,
                        c.hidden_size,
                        bias,
                        kv_cut.clone(),
                        compute,
                    )?,
                    v: linear(
                        source,
                        &format!("{p}.attn_v"),
                        kv_out,
                        c.hidden_size,
                        bias,
                        kv_cut.clone(),
                        compute,
                    )?,
                    o: linear(
                        source,
                        &format!("{p}.attn_output"),
                        c.hidden_size,
                        q_out,
                        false,
                        o_cut.clone(),
                        compute,
                    )?,
                    q_norm: qk_norm("attn_q_norm")?,
                    k_norm: qk_norm("attn_k_norm")?,
                },
                ffn_norm: norm(
                    source,
                    &format!("{p}.ffn_norm.weight"),
                    c.hidden_size,
                    c.rms_eps,
                    compute,
                )?,
                gate: linear(
                    source,
                    &format!("{p}.ffn_gate"),
                    c.ffn_size,
                    c.hidden_size,
                    false,
                    ffn_rows.clone(),
                    compute,
                )?,
                up: linear(
                    source,
                    &format!("{p}.ffn_up"),
                    c.ffn_size,
                    c.hidden_size,
                    false,
                    ffn_rows.clone(),
                    compute,
                )?,
                down: linear(
                    source,
                    &format!("{p}.ffn_down"),
                    c.hidden_size,
                    c.ffn_size,
                    false,
                    ffn_cols.clone(),
                    compute,
                )?,
            });
        }
        let head = if spec.head {
            let output = match (source.load("output.weight")?, &embedding) {
                (Some(w), _) => {
                    check_shape("output.weight", &w, &[c.vocab_size, c.hidden_size])?;
                    QLinear::new_on(w, None, compute)?
                }
                // Tied embeddings: the head shares the embedding's matrix, not a copy.
                (None, Some(Embedding::Shoal(m))) if compute.device.is_cpu() => {
                    QLinear::from_matrix(
                        Matrix::Shoal(Arc::clone(m)),
                        None,
                        c.hidden_size,
                        c.vocab_size,
                    )
                }
                (None, _) => QLinear::new_on(require(source, "token_embd.weight")?, None, compute)?,
            };
            Some(Head {
                norm: norm(
                    source,
                    "output_norm.weight",
                    c.hidden_size,
                    c.rms_eps,
                    compute,
                )?,
                output,
            })
        } else {
            None
        };
        let max_len = max_len.max(1);
        Ok(Self {
            rope: Rope::new(c, max_len, compute)?,
            config,
            spec,
            embedding,
            layers,
            head,
            max_len,
            kv_dtype: crate::cache::kv_dtype(&compute.device, compute.dtype),
            compute: compute.clone(),
            gpu_decode: GpuDecode::from_env(),
            rows_round_alike: shoal_kernels::Isa::detect().rows_round_alike(),
            #[cfg(feature = "cuda")]
            gpu_plan: Default::default(),
        })
    }
}
