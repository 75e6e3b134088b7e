//! The decoder: embedding, a range of decoder layers, and the head, each loadable alone.

use std::ops::Range;
use std::sync::Arc;

use candle_core::{DType, Device, Tensor};
use shoal_kernels::{QuantMatrix, Rows};

use crate::linear::cpu_values;
use crate::shard::{ShardLinks, TensorSlice};
use crate::{Architecture, Compute, KvCache, ModelConfig, ModelError, QLinear, Result, RopeStyle};

mod batch;
#[cfg(feature = "cuda")]
mod gpu_decode;
#[cfg(feature = "cuda")]
pub(crate) mod gpu_prefill;
mod load;
mod ring;
mod row_attention;

pub use batch::BatchPart;
pub use ring::zigzag_pieces;

/// Which parts of a model a process holds: the embedding, a contiguous range of decoder
/// layers, the head, and, for tensor parallelism, which slice of every layer. A whole
/// model is `LoadSpec::full(n_layers)`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LoadSpec {
    pub embed: bool,
    pub layers: Range<usize>,
    pub head: bool,
    /// `None`: whole layers. `Some`: this rank's KV groups and FFN columns.
    pub tensor: Option<TensorSlice>,
}

impl LoadSpec {
    pub fn full(num_layers: usize) -> Self {
        Self {
            embed: true,
            layers: 0..num_layers,
            head: true,
            tensor: None,
        }
    }
}

/// How a projection is cut for this shard.
#[derive(Clone, Debug)]
enum Cut {
    Whole,
    Rows(Range<usize>),
    Cols(Range<usize>),
}

#[derive(Debug, Clone)]
struct RmsNorm {
    weight: Tensor,
    eps: f32,
}

impl RmsNorm {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        Ok(candle_nn::ops::rms_norm(
            &x.contiguous()?,
            &self.weight,
            self.eps,
        )?)
    }
}

#[derive(Debug, Clone)]
enum Embedding {
    /// Rows dequantized by shoal's kernels; shared with a tied output projection.
    Shoal(Arc<QuantMatrix>),
    Candle(Arc<candle_core::quantized::QTensor>),
    Dense(Tensor),
}

#[derive(Debug, Clone)]
struct Attention {
    q: QLinear,
    k: QLinear,
    v: QLinear,
    o: QLinear,
    q_norm: Option<RmsNorm>,
    k_norm: Option<RmsNorm>,
}

#[derive(Debug, Clone)]
struct DecoderLayer {
    index: usize,
    attn_norm: RmsNorm,
    attn: Attention,
    ffn_norm: RmsNorm,
    gate: QLinear,
    up: QLinear,
    down: QLinear,
}

#[derive(Debug, Clone)]
struct Head {
    norm: RmsNorm,
    output: QLinear,
}

/// Rotary position tables: `(max_len, head_dim / 2)`.
#[derive(Debug, Clone)]
struct Rope {
    cos: Tensor,
    sin: Tensor,
    style: RopeStyle,
}

impl Rope {
    fn new(config: &ModelConfig, max_len: usize, compute: &Compute) -> Result<Self> {
        let half = config.head_dim / 2;
        let inv_freq: Vec<f32> = (0..half)
            .map(|i| {
                1.0 / config
                    .rope_theta
                    .powf(2.0 * i as f32 / config.head_dim as f32)
            })
            .collect();
        let mut cos = Vec::with_capacity(max_len * half);
        let mut sin = Vec::with_capacity(max_len * half);
        for pos in 0..max_len {
            for f in &inv_freq {
                let angle = pos as f32 * f;
                cos.push(angle.cos());
                sin.push(angle.sin());
            }
        }
        Ok(Self {
            cos: Tensor::from_vec(cos, (max_len, half), &Device::Cpu)?
                .to_dtype(compute.dtype)?
                .to_device(&compute.device)?,
            sin: Tensor::from_vec(sin, (max_len, half), &Device::Cpu)?
                .to_dtype(compute.dtype)?
                .to_device(&compute.device)?,
            style: config.rope_style,
        })
    }

    /// `x`: `(heads, t, head_dim)` at positions `pos..pos + t`.
    fn apply(&self, x: &Tensor, pos: usize) -> Result<Tensor> {
        let t = x.dim(1)?;
        let cos = self.cos.narrow(0, pos, t)?;
        let sin = self.sin.narrow(0, pos, t)?;
        Ok(self.rotate(&x.unsqueeze(0)?, &cos, &sin)?.squeeze(0)?)
    }

    /// `x`: `(batch, heads, t, head_dim)` rotated by table rows `cos`/`sin`: `(t, hd / 2)`
    /// for every batch entry alike, or `(batch, t, hd / 2)` one set per entry.
    fn rotate(&self, x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
        let x = x.contiguous()?;
        Ok(match self.style {
            RopeStyle::Interleaved => candle_nn::rotary_emb::rope_i(&x, cos, sin)?,
            RopeStyle::Halves => candle_nn::rotary_emb::rope(&x, cos, sin)?,
        })
    }
}

/// How a CUDA model decodes one token (batch 1) of a whole model.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GpuDecode {
    /// shoal's decode kernels, captured once as a CUDA graph and replayed (the default).
    Graphs,
    /// The same kernels launched one by one (`SHOAL_CUDA_GRAPHS=0`).
    Eager,
    /// candle's operations, as a batch or a prompt runs (`SHOAL_GPU_DECODE=candle`).
    Candle,
}

impl GpuDecode {
    /// The mode the environment asks for.
    pub fn from_env() -> Self {
        if std::env::var("SHOAL_GPU_DECODE").as_deref() == Ok("candle") {
            Self::Candle
        } else if std::env::var("SHOAL_CUDA_GRAPHS").as_deref() == Ok("0") {
            Self::Eager
        } else {
            Self::Graphs
        }
    }
}

/// Each row's arg-max (the first index on ties) of f32 logits of one or two dimensions,
/// computed where they lie on a CUDA device so that only the ids come back; `None` for
/// logits elsewhere (the caller reads them: on the CPU they are already at hand).
pub fn device_argmax(logits: &Tensor) -> Result<Option<Vec<u32>>> {
    #[cfg(feature = "cuda")]
    return gpu_decode::argmax_rows(logits);
    #[cfg(not(feature = "cuda"))]
    {
        let _ = logits;
        Ok(None)
    }
}

/// A model, or the part of one that a shard holds.
#[derive(Debug, Clone)]
pub struct Model {
    config: ModelConfig,
    spec: LoadSpec,
    embedding: Option<Embedding>,
    layers: Vec<DecoderLayer>,
    head: Option<Head>,
    rope: Rope,
    max_len: usize,
    compute: Compute,
    /// The type its caches keep keys and values in (`cache::kv_dtype`), decided at load
    /// as the kernels are.
    kv_dtype: DType,
    gpu_decode: GpuDecode,
    /// Whether this machine's kernels compute prompt rows and decode rows alike
    /// (`shoal_kernels::Isa::rows_round_alike`): else a batch holding both runs them as
    /// two groups.
    rows_round_alike: bool,
    /// The GPU decode path's kernels, buffers and graphs, built on first use.
    #[cfg(feature = "cuda")]
    gpu_plan: Arc<std::sync::Mutex<gpu_decode::PlanState>>,
}

impl Model {
    pub fn config(&self) -> &ModelConfig {
        &self.config
    }

    pub fn spec(&self) -> &LoadSpec {
        &self.spec
    }

    /// The most positions a sequence may use.
    pub fn max_len(&self) -> usize {
        self.max_len
    }

    /// A fresh KV cache for the layers this model holds.
    pub fn new_cache(&self) -> KvCache {
        KvCache::new_on(
            self.spec.layers.start,
            self.spec.layers.len(),
            self.max_len,
            &self.compute.device,
            self.kv_dtype,
        )
    }

    /// Token ids to hidden states `(t, hidden)`.
    pub fn embed(&self, tokens: &[u32]) -> Result<Tensor> {
        let rows = self.embed_host(tokens)?;
        if self.compute.device.is_cpu() && self.compute.dtype == DType::F32 {
            return Ok(rows);
        }
        Ok(rows
            .to_dtype(self.compute.dtype)?
            .to_device(&self.compute.device)?)
    }

    /// Every id of `tokens` within the vocabulary, else the typed error.
    fn check_vocab(&self, tokens: &[u32]) -> Result<()> {
        match tokens
            .iter()
            .find(|&&t| t as usize >= self.config.vocab_size)
        {
            Some(bad) => Err(ModelError::Invalid(format!(
                "token id {bad} is outside the vocabulary of {}",
                self.config.vocab_size
            ))),
            None => Ok(()),
        }
    }

    /// [`Model::embed`]'s rows on the host, before they go to the compute device.
    fn embed_host(&self, tokens: &[u32]) -> Result<Tensor> {
        let embedding = self
            .embedding
            .as_ref()
            .ok_or_else(|| ModelError::Invalid("this shard does not hold the embedding".into()))?;
        self.check_vocab(tokens)?;
        let rows = match embedding {
            Embedding::Shoal(m) => {
                let h = self.config.hidden_size;
                let mut out = vec![0f32; tokens.len() * h];
                for (row, &t) in out.chunks_exact_mut(h).zip(tokens) {
                    m.dequantize_row(t as usize, row);
                }
                Tensor::from_vec(out, (tokens.len(), h), &Device::Cpu)?
            }
            Embedding::Candle(q) => q.embedding(&Tensor::new(tokens, &Device::Cpu)?)?,
            Embedding::Dense(t) => t.index_select(&Tensor::new(tokens, &Device::Cpu)?, 0)?,
        };
        Ok(rows.to_dtype(DType::F32)?)
    }

    /// Batched steps whose attention ran on the GPU decode kernels: none without CUDA.
    #[cfg(not(feature = "cuda"))]
    pub fn gpu_batch_steps(&self) -> usize {
        0
    }

    /// Whether the GPU decode plan stages the output projection: never without CUDA.
    #[cfg(not(feature = "cuda"))]
    pub fn gpu_output_staged(&self) -> bool {
        false
    }

    /// How single tokens decode on a GPU (no effect on the CPU).
    pub fn set_gpu_decode(&mut self, mode: GpuDecode) {
        self.gpu_decode = mode;
    }

    /// Whether a lone row computes as it does among a prompt's rows, so that a prompt may
    /// be read in slices of one row and give what it gives read whole: on a CPU whose
    /// kernels compute prompt and decode rows alike; not on a GPU, where a lone row takes
    /// the single-token kernels.
    pub fn lone_rows_alike(&self) -> bool {
        self.rows_round_alike && !self.compute.device.is_cuda()
    }

    /// Where and in which type this model computes.
    pub fn compute(&self) -> &Compute {
        &self.compute
    }

    /// Runs this model's decoder layers over hidden states `(t, hidden)` of the positions
    /// `cache.len()..cache.len() + t`, appending their keys and values to `cache`.
    pub fn forward_layers(&self, hidden: Tensor, cache: &mut KvCache) -> Result<Tensor> {
        self.forward_layers_with(hidden, cache, None)
    }

    /// [`Model::forward_layers`] for a tensor-parallel shard: `links` adds up the partial
    /// outputs of the ranks (two all-reduces per layer). Every rank must call it with the
    /// same hidden states.
    pub fn forward_layers_with(
        &self,
        hidden: Tensor,
        cache: &mut KvCache,
        links: Option<&mut dyn ShardLinks>,
    ) -> Result<Tensor> {
        let mut links = links;
        if self.spec.tensor.is_some() && links.is_none() {
            return Err(ModelError::Invalid(
                "a tensor-parallel shard needs links to its peers".into(),
            ));
        }
        let t = hidden.dim(0)?;
        let pos = cache.len();
        if pos + t > self.max_len {
            return Err(ModelError::ContextFull {
                positions: pos + t,
                context: self.max_len,
            });
        }
        let mask = causal_mask(t, pos, self.config.group_size(), &self.compute)?;
        // Every prompt chunk on the bf16 tiles (where the machine has them), whatever its
        // length, a single token on the 8-bit paths: a row's arithmetic then depends only
        // on whether it is a prompt's or a decode step's, not on how a scheduler sliced
        // the prompt or what shared its batch.
        let rows = if t >= 2 { Rows::Bf16 } else { Rows::ByCount };
        let mut x = hidden;
        shoal_kernels::with_rows(rows, || -> Result<()> {
            for layer in &self.layers {
                x = self.layer_forward(layer, &x, cache, pos, mask.as_ref(), &mut links)?;
            }
            Ok(())
        })?;
        cache.advance(t);
        Ok(x)
    }

    /// Heads of this shard: (query heads, KV heads).
    fn local_heads(&self) -> (usize, usize) {
        let c = &self.config;
        let nkv = match &self.spec.tensor {
            Some(s) => s.kv_heads.len(),
            None => c.num_kv_heads,
        };
        (nkv * c.group_size(), nkv)
    }

    /// Queries, keys and values `(heads, t, head_dim)` of hidden states `x` whose rows sit
    /// at the positions of `pieces` (consecutive runs, in row order), rope applied.
    fn project_qkv(
        &self,
        layer: &DecoderLayer,
        x: &Tensor,
        pieces: &[Range<usize>],
    ) -> Result<(Tensor, Tensor, Tensor)> {
        #[cfg(feature = "cuda")]
        if let [only] = pieces
            && let Some(heads) = self.gpu_qkv_heads(layer, x, only.start)?
        {
            return Ok(heads);
        }
        let (q, k, v) = self.qkv_rows(layer, x)?;
        self.qkv_heads(layer, q, k, v, pieces)
    }

    /// [`Self::project_qkv`] on the GPU's prefill kernels: the projections without their
    /// biases, then one kernel a projection for bias, heads and rotary embedding; `None`
    /// where they do not apply (the CPU, f32, a model that norms its queries and keys).
    #[cfg(feature = "cuda")]
    fn gpu_qkv_heads(
        &self,
        layer: &DecoderLayer,
        x: &Tensor,
        pos: usize,
    ) -> Result<Option<(Tensor, Tensor, Tensor)>> {
        let a = &layer.attn;
        if !gpu_prefill::applies(x.device(), x.dtype()) || a.q_norm.is_some() || a.k_norm.is_some()
        {
            return Ok(None);
        }
        let h = layer.attn_norm.forward(x)?;
        let hd = self.config.head_dim;
        let (nh, nkv) = self.local_heads();
        let rope = gpu_prefill::RopeAt {
            cos: &self.rope.cos,
            sin: &self.rope.sin,
            interleaved: self.rope.style == RopeStyle::Interleaved,
            pos,
        };
        let heads = |l: &QLinear, n: usize, rope: Option<&gpu_prefill::RopeAt<'_>>| {
            gpu_prefill::to_heads(&l.forward_without_bias(&h)?, l.bias(), rope, n, hd)
        };
        Ok(Some((
            heads(&a.q, nh, Some(&rope))?,
            heads(&a.k, nkv, Some(&rope))?,
            heads(&a.v, nkv, None)?,
        )))
    }

    /// The normed input's query, key and value projections `(t, heads * head_dim)`, as
    /// one matmul over all rows.
    fn qkv_rows(&self, layer: &DecoderLayer, x: &Tensor) -> Result<(Tensor, Tensor, Tensor)> {
        let h = layer.attn_norm.forward(x)?;
        let a = &layer.attn;
        let [q, k, v]: [Tensor; 3] = QLinear::forward_many(&[&a.q, &a.k, &a.v], &h)?
            .try_into()
            .map_err(|_| ModelError::Invalid("three projections, three outputs".into()))?;
        Ok((q, k, v))
    }

    /// Projections `(t, heads * head_dim)` as heads `(heads, t, head_dim)`, normed where the
    /// model norms them, rope applied at the positions of `pieces`.
    fn qkv_heads(
        &self,
        layer: &DecoderLayer,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        pieces: &[Range<usize>],
    ) -> Result<(Tensor, Tensor, Tensor)> {
        let t = q.dim(0)?;
        let hd = self.config.head_dim;
        let (nh, nkv) = self.local_heads();
        let a = &layer.attn;
        // (t, heads * hd) -> (heads, t, hd)
        let heads = |y: Tensor, n: usize| -> Result<Tensor> {
            Ok(y.reshape((t, n, hd))?.transpose(0, 1)?.contiguous()?)
        };
        let mut q = heads(q, nh)?;
        let mut k = heads(k, nkv)?;
        let v = heads(v, nkv)?;
        if let Some(n) = &a.q_norm {
            q = n.forward(&q)?;
        }
        if let Some(n) = &a.k_norm {
            k = n.forward(&k)?;
        }
        let rope = |x: &Tensor| -> Result<Tensor> {
            if let [only] = pieces {
                return self.rope.apply(x, only.start);
            }
            let mut parts = Vec::with_capacity(pieces.len());
            let mut row = 0;
            for p in pieces {
                parts.push(self.rope.apply(&x.narrow(1, row, p.len())?, p.start)?);
                row += p.len();
            }
            Ok(Tensor::cat(&parts, 1)?)
        };
        Ok((rope(&q)?, rope(&k)?, v))
    }

    /// The output projection, the residual and the FFN, given the attention output
    /// `(t, heads * head_dim)`.
    fn finish_layer(
        &self,
        layer: &DecoderLayer,
        x: &Tensor,
        attn: &Tensor,
        links: &mut Option<&mut dyn ShardLinks>,
    ) -> Result<Tensor> {
        let x = (x + reduce(layer.attn.o.forward(attn)?, links)?)?;
        let h = layer.ffn_norm.forward(&x)?;
        let [gate, up]: [Tensor; 2] = QLinear::forward_many(&[&layer.gate, &layer.up], &h)?
            .try_into()
            .map_err(|_| ModelError::Invalid("two projections, two outputs".into()))?;
        let ff = silu_mul(&gate, &up)?;
        Ok((x + reduce(layer.down.forward(&ff)?, links)?)?)
    }

    fn layer_forward(
        &self,
        layer: &DecoderLayer,
        x: &Tensor,
        cache: &mut KvCache,
        pos: usize,
        mask: Option<&Tensor>,
        links: &mut Option<&mut dyn ShardLinks>,
    ) -> Result<Tensor> {
        let t = x.dim(0)?;
        let whole = pos..pos + t;
        let (q, k, v) = self.project_qkv(layer, x, std::slice::from_ref(&whole))?;
        let (k_all, v_all) = cache.append(layer.index, &k, &v)?;
        let out = self.attend(&q, &k_all, &v_all, mask)?;
        self.finish_layer(layer, x, &out, links)
    }

    /// Attention of queries `(heads, t, hd)` over a sequence's keys and values so far;
    /// `(t, heads * hd)`.
    fn attend(
        &self,
        q: &Tensor,
        k_all: &Tensor,
        v_all: &Tensor,
        mask: Option<&Tensor>,
    ) -> Result<Tensor> {
        let c = &self.config;
        let t = q.dim(1)?;
        let hd = c.head_dim;
        let (nh, nkv) = self.local_heads();
        if self.compute.device.is_cpu() && q.dtype() == DType::F32 {
            // Causal by position (the rows are the last `t` of the cache): the mask is
            // not needed, and each row's arithmetic does not depend on the slicing.
            let scale = 1.0 / (hd as f32).sqrt();
            return Ok(row_attention::row_attention(q, k_all, v_all, scale)?);
        }
        // Grouped-query attention without copying K/V: the query heads of one KV group
        // are adjacent, so (nh, t, hd) is (nkv, group * t, hd).
        let g = c.group_size();
        let q = q.reshape((nkv, g * t, hd))?;
        let scale = 1.0 / (hd as f64).sqrt();
        #[cfg(feature = "cuda")]
        if gpu_prefill::applies(q.device(), q.dtype()) {
            // Causal by position inside the softmax kernel (no mask was made).
            let scores = q.matmul(&k_all.t()?)?;
            let probs = gpu_prefill::causal_softmax(&scores, t, scale as f32)?;
            let out = probs.matmul(&v_all.contiguous()?)?;
            return gpu_prefill::from_heads(&out.reshape((nh, t, hd))?);
        }
        let scores = (q.matmul(&k_all.t()?)? * scale)?;
        let scores = match mask {
            Some(m) => scores.broadcast_add(m)?,
            None => scores,
        };
        let probs = candle_nn::ops::softmax_last_dim(&scores)?;
        let out = probs.matmul(&v_all.contiguous()?)?; // (nkv, g*t, hd)
        Ok(out
            .reshape((nh, t, hd))?
            .transpose(0, 1)?
            .contiguous()?
            .reshape((t, nh * hd))?)
    }

    /// [`Self::attend`] for several sequences: on the CPU in f32 their decode rows run
    /// together (one decode row alone is too little work to share among the threads),
    /// each as it is alone.
    fn attend_each(
        &self,
        heads: &[(Tensor, Tensor, Tensor)],
        masks: &[Option<Tensor>],
    ) -> Result<Vec<Tensor>> {
        let cpu_f32 = heads
            .first()
            .is_some_and(|(q, _, _)| self.compute.device.is_cpu() && q.dtype() == DType::F32);
        if cpu_f32 && heads.len() > 1 {
            let scale = 1.0 / (self.config.head_dim as f32).sqrt();
            let items: Vec<_> = heads.iter().map(|(q, k, v)| (q, k, v)).collect();
            return Ok(row_attention::row_attention_each(&items, scale)?);
        }
        heads
            .iter()
            .zip(masks)
            .map(|((q, k, v), m)| self.attend(q, k, v, m.as_ref()))
            .collect()
    }

    /// Final norm and logits of rows of different sequences (a batch's last positions),
    /// each computed as a single row alone is (the 8-bit paths, however many rows).
    pub fn head_each(&self, hidden: &Tensor) -> Result<Tensor> {
        shoal_kernels::with_rows(Rows::Int8, || self.head(hidden))
    }

    /// Final norm and logits `(t, vocab)` for hidden states `(t, hidden)`.
    pub fn head(&self, hidden: &Tensor) -> Result<Tensor> {
        let head = self
            .head
            .as_ref()
            .ok_or_else(|| ModelError::Invalid("this shard does not hold the head".into()))?;
        let h = head.norm.forward(hidden)?;
        Ok(head.output.forward(&h)?.to_dtype(DType::F32)?)
    }

    /// Embedding, all layers and head in one call; the logits of the last position only
    /// when `all_logits` is false.
    pub fn forward(&self, tokens: &[u32], cache: &mut KvCache, all_logits: bool) -> Result<Tensor> {
        #[cfg(feature = "cuda")]
        if let [token] = tokens
            && let Some(logits) = self.gpu_decode(*token, cache)?
        {
            return Ok(logits);
        }
        let h = self.embed(tokens)?;
        let h = self.forward_layers(h, cache)?;
        let h = if all_logits {
            h
        } else {
            h.narrow(0, tokens.len() - 1, 1)?
        };
        self.head(&h)
    }

    /// Greedy decoding of up to `n` tokens after `token` (appended at the cache's end),
    /// each handed to `sink` as soon as it is known; `sink` returns false to stop. Returns
    /// how many it handed over, which is also how many positions the cache gained. On a
    /// GPU the device feeds each step's choice into the next, so the host's round trip
    /// between tokens overlaps the next token's work; `None` where there is no such path
    /// (the caller steps with [`Model::forward`]).
    pub fn greedy(
        &self,
        token: u32,
        cache: &mut KvCache,
        n: usize,
        sink: &mut dyn FnMut(u32) -> bool,
    ) -> Result<Option<usize>> {
        #[cfg(feature = "cuda")]
        return self.gpu_greedy(token, cache, n, sink);
        #[cfg(not(feature = "cuda"))]
        {
            let _ = (token, cache, n, sink);
            Ok(None)
        }
    }

    /// The architecture this model runs.
    pub fn architecture(&self) -> Architecture {
        self.config.architecture
    }
}

/// The sum of every rank's partial output `y` (tensor parallelism), or `y` itself.
fn reduce(y: Tensor, links: &mut Option<&mut dyn ShardLinks>) -> Result<Tensor> {
    match links.as_mut() {
        Some(links) => links.all_reduce_tensor(y),
        None => Ok(y),
    }
}

/// `silu(gate) · up`: one kernel on the GPU in bf16, candle's two operations elsewhere.
fn silu_mul(gate: &Tensor, up: &Tensor) -> Result<Tensor> {
    #[cfg(feature = "cuda")]
    if gpu_prefill::applies(gate.device(), gate.dtype()) {
        return gpu_prefill::silu_mul(gate, up);
    }
    if let Some(y) = silu_mul_cpu(gate, up)? {
        return Ok(y);
    }
    Ok((candle_nn::ops::silu(gate)? * up)?)
}

/// [`silu_mul`] of contiguous f32 tensors on the CPU, in one pass on the kernel threads
/// (candle's two operations run on one thread and allocate twice); `None` for others.
fn silu_mul_cpu(gate: &Tensor, up: &Tensor) -> Result<Option<Tensor>> {
    if !gate.device().is_cpu() || gate.dtype() != DType::F32 || up.dtype() != DType::F32 {
        return Ok(None);
    }
    if gate.dims() != up.dims() {
        return Err(ModelError::Invalid(format!(
            "silu_mul of {:?} and {:?}",
            gate.dims(),
            up.dims()
        )));
    }
    let ((gs, gl), (us, ul)) = (gate.storage_and_layout(), up.storage_and_layout());
    let (Some(g), Some(u)) = (cpu_values(&gs, gl), cpu_values(&us, ul)) else {
        return Ok(None);
    };
    let mut out = vec![0f32; g.len()];
    shoal_kernels::silu_mul(g, u, &mut out).map_err(|e| ModelError::Invalid(e.to_string()))?;
    Ok(Some(Tensor::from_vec(out, gate.dims(), &Device::Cpu)?))
}

/// Additive causal mask `(group * t, pos + t)` for queries at `pos..pos + t`, laid out as
/// the grouped attention sees them (row `r` is query position `pos + r % t`); `None` when
/// a single query sees everything.
fn causal_mask(t: usize, pos: usize, group: usize, compute: &Compute) -> Result<Option<Tensor>> {
    // The CPU's row attention, and the GPU's softmax kernel in bf16, are causal by
    // position and need no mask.
    #[cfg(feature = "cuda")]
    if gpu_prefill::applies(&compute.device, compute.dtype) {
        return Ok(None);
    }
    if t <= 1 || (compute.device.is_cpu() && compute.dtype == DType::F32) {
        return Ok(None);
    }
    let s = pos + t;
    let mut m = vec![0f32; group * t * s];
    for r in 0..group * t {
        let qpos = pos + r % t;
        for slot in &mut m[r * s + qpos + 1..(r + 1) * s] {
            *slot = f32::NEG_INFINITY;
        }
    }
    Ok(Some(
        Tensor::from_vec(m, (group * t, s), &Device::Cpu)?
            .to_dtype(compute.dtype)?
            .to_device(&compute.device)?,
    ))
}
