//! One token's decode step on a CUDA device without the host in the way.
//!
//! candle's path launches ~28 small operations a layer, each costing host time larger than
//! the weight reads it waits for. Here a whole step — every layer and the head — is a fixed
//! sequence of shoal's own kernels (`decode.cu`: norm, stacked q/k/v mat-vec, rope with the
//! KV append in place, flash-decoding attention, the output projection with its residual,
//! gate/up with SiLU, the down projection), all of whose varying inputs (the position, the
//! token's embedding row) sit in buffers the step owns. It is captured once per KV cache
//! as a CUDA graph and replayed: one launch a token.
//!
//! Weights are read where candle's path keeps them (bf16 rows, or GGUF Q8_0 / Q4_K / Q6_K
//! blocks against activations quantized to 8 bits on the GPU), and the KV cache is the
//! same [`KvCache`] in the same layout, so prefill (candle) and decode (here) share it.
//! A model this path does not cover (a tensor slice, a pipeline stage, another weight
//! type, heads wider than 128) keeps candle's path; `SHOAL_GPU_DECODE=candle` forces it,
//! and `SHOAL_CUDA_GRAPHS=0` launches the same kernels one by one (to compare).

use std::cell::Cell;
use std::sync::Arc;

use candle_core::cuda_backend::cudarc::driver::sys::{
    self as cu, CUgraphInstantiate_flags, CUstreamCaptureMode,
};
use candle_core::cuda_backend::cudarc::driver::{
    CudaFunction, CudaGraph, CudaSlice, CudaStream, DevicePtr, LaunchConfig,
};
use candle_core::{DType, Device, Tensor};

use crate::{KvCache, ModelError, QLinear, Result, RopeStyle};

use super::{GpuDecode, Model, RmsNorm};

mod argmax;
mod batch;
mod chain;
mod kernels;
mod launches;
mod variants;
mod weights;

pub(crate) use argmax::argmax_rows;
use batch::BatchBufs;
pub(super) use kernels::Arg;
use kernels::{
    Kernels, NORM_MAX, StagedShape, attention_cluster_blocks, attention_cluster_shared,
    attention_o_cluster_shared, attention_shared, attention_splits, cfg, cluster_attr, staged_for,
};

use variants::{Stage, Variants};
use weights::{Linear, linear, norm_ptr, tensor_ptr};

/// Graphs kept, one per KV cache the model decoded into lately, the least recently used
/// dropped first: a serving rank replays a graph per sequence when that is cheaper than
/// the batched pass, so this many concurrent sequences keep theirs (a graph is a few
/// hundred kernel nodes; capturing one again costs milliseconds).
const GRAPHS_KEPT: usize = 64;

fn gpu_err(e: impl std::fmt::Display) -> ModelError {
    ModelError::Invalid(format!("GPU decode: {e}"))
}

struct Layer {
    attn_norm: u64,
    ffn_norm: u64,
    q_norm: u64,
    k_norm: u64,
    q: Linear,
    k: Linear,
    v: Linear,
    o: Linear,
    gate: Linear,
    up: Linear,
    down: Linear,
}

/// The buffers a step reads and writes; their addresses are baked into the graphs.
struct Buffers {
    /// The residual stream; the step's input (the token's embedding row) is copied here.
    x: CudaSlice<f32>,
    h: CudaSlice<f32>,
    qkv: CudaSlice<f32>,
    attn: CudaSlice<f32>,
    ff: CudaSlice<f32>,
    xq: CudaSlice<i8>,
    /// Per 32 values of `xq`: (scale, scale * sum of the 8-bit values).
    xd: CudaSlice<f32>,
    part_acc: CudaSlice<f32>,
    part_ml: CudaSlice<f32>,
    /// The output projection's partials a KV head (where the attention kernel does it),
    /// and a counter a slice of its rows.
    o_partial: CudaSlice<f32>,
    o_count: CudaSlice<u32>,
    pos: CudaSlice<i32>,
    inv_freq: CudaSlice<f32>,
    logits: Tensor,
}

/// The buffers' addresses, taken once: asking cudarc for an address while capturing
/// would record its event bookkeeping into the graph.
#[derive(Clone, Copy)]
struct Ptrs {
    x: u64,
    h: u64,
    qkv: u64,
    attn: u64,
    ff: u64,
    xq: u64,
    xd: u64,
    part_acc: u64,
    part_ml: u64,
    o_partial: u64,
    o_count: u64,
    pos: u64,
    inv_freq: u64,
    logits: u64,
}

impl Ptrs {
    fn of(b: &Buffers, stream: &CudaStream) -> Result<Self> {
        fn p<T>(s: &CudaSlice<T>, stream: &CudaStream) -> u64 {
            s.device_ptr(stream).0
        }
        Ok(Self {
            x: p(&b.x, stream),
            h: p(&b.h, stream),
            qkv: p(&b.qkv, stream),
            attn: p(&b.attn, stream),
            ff: p(&b.ff, stream),
            xq: p(&b.xq, stream),
            xd: p(&b.xd, stream),
            part_acc: p(&b.part_acc, stream),
            part_ml: p(&b.part_ml, stream),
            o_partial: p(&b.o_partial, stream),
            o_count: p(&b.o_count, stream),
            pos: p(&b.pos, stream),
            inv_freq: p(&b.inv_freq, stream),
            logits: tensor_ptr(&b.logits, stream)?,
        })
    }
}

/// One KV cache as the kernels see it: every layer's key and value addresses and the
/// positions each holds (the row stride). A graph replays against exactly one.
#[derive(Clone, PartialEq, Eq)]
struct CacheKey {
    ptrs: Vec<u64>,
    capacity: i32,
}

/// Everything a decode step needs, built once per model.
pub(crate) struct DecodePlan {
    stream: Arc<CudaStream>,
    kernels: Kernels,
    layers: Vec<Layer>,
    out_norm: u64,
    head: Linear,
    bufs: Buffers,
    at: Ptrs,
    hidden: i32,
    ffn: i32,
    nh: i32,
    nkv: i32,
    hd: i32,
    splits: u32,
    /// Blocks a KV head of `shoal_attention_cluster` (0: the two-kernel path only), and
    /// the longest cache it serves.
    cluster: u32,
    cluster_max_len: i32,
    /// The cluster attention kernel can do the output projection (the variant asks for it
    /// and the GPU schedules its clusters); a layer's bf16 projection without bias then is.
    fuse_o: bool,
    /// How the output projection runs staged in shared memory, where it does.
    staged_o: Option<StagedShape>,
    eps: f32,
    interleaved: i32,
    graphs: Vec<(CacheKey, CudaGraph)>,
    /// The environment's variants of the step (`variants.rs`), to compare designs.
    var: Variants,
    /// Inside `record`: whether the next launch follows one of the step's own kernels
    /// (`None` outside a step: the batched path's kernels follow candle's).
    chained: Cell<Option<bool>>,
    batch: Option<BatchBufs>,
    /// Batched steps run on these kernels (tests check the path was taken).
    batch_steps: usize,
    vocab: i32,
    /// Greedy decoding fed by the device (`chain.rs`), once asked for; whether building
    /// it failed (the path then steps a token at a time).
    chain: Option<chain::Chain>,
    chain_failed: bool,
    _keep: Vec<Tensor>,
}

// SAFETY: the plan's graphs and buffers belong to one CUDA context and are only used
// behind the model's mutex, one thread at a time.
unsafe impl Send for DecodePlan {}

/// The plan of a model, built on first use.
#[derive(Default)]
pub(crate) enum PlanState {
    #[default]
    Untried,
    /// The model is not one this path covers (why, for the logs).
    Unsupported(String),
    Ready(Box<DecodePlan>),
}

impl std::fmt::Debug for PlanState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Untried => write!(f, "Untried"),
            Self::Unsupported(why) => write!(f, "Unsupported({why})"),
            Self::Ready(_) => write!(f, "Ready"),
        }
    }
}

impl DecodePlan {
    /// The plan for `model`, or why it does not apply.
    pub(crate) fn build(model: &Model) -> std::result::Result<Self, String> {
        let Device::Cuda(device) = &model.compute.device else {
            return Err("not on a CUDA device".into());
        };
        let c = &model.config;
        if model.spec.tensor.is_some() || !model.spec.embed || !model.spec.head {
            return Err("only a whole model decodes on this path".into());
        }
        if model.spec.layers != (0..c.num_layers) {
            return Err("only a whole model decodes on this path".into());
        }
        let (nh, nkv, hd) = (c.num_heads, c.num_kv_heads, c.head_dim);
        if !hd.is_multiple_of(32) || hd > 128 || nkv == 0 || !nh.is_multiple_of(nkv) || nh / nkv > 8
        {
            return Err(format!("{nh} heads over {nkv} KV heads of {hd}"));
        }
        if model.compute.dtype != DType::BF16 {
            return Err("the cache is not bf16".into());
        }
        // The 8-bit rows come in blocks of 32.
        if !c.hidden_size.is_multiple_of(32) || !c.ffn_size.is_multiple_of(32) {
            return Err("hidden or FFN width not a multiple of 32".into());
        }
        // The RMSNorm kernel holds the row in its one block's registers.
        if c.hidden_size > (NORM_MAX * 1024) as usize {
            return Err(format!(
                "hidden width {} past the norm kernel's",
                c.hidden_size
            ));
        }
        let stream = device.cuda_stream();
        let s = stream.as_ref();
        let mut keep = Vec::new();
        let mut layers = Vec::with_capacity(model.layers.len());
        let unsupported = |what: &str| format!("{what}: a weight type the kernels do not read");
        for l in &model.layers {
            let mut lin = |q: &QLinear, what: &str| -> std::result::Result<Linear, String> {
                linear(q, s, &mut keep).ok_or_else(|| unsupported(what))
            };
            let q = lin(&l.attn.q, "attn_q")?;
            let k = lin(&l.attn.k, "attn_k")?;
            let v = lin(&l.attn.v, "attn_v")?;
            let o = lin(&l.attn.o, "attn_output")?;
            let gate = lin(&l.gate, "ffn_gate")?;
            let up = lin(&l.up, "ffn_up")?;
            let down = lin(&l.down, "ffn_down")?;
            if q.w.is_quant() != k.w.is_quant() || k.w.is_quant() != v.w.is_quant() {
                return Err("q, k and v mix dense and quantized weights".into());
            }
            if gate.w.is_quant() != up.w.is_quant() {
                return Err("gate and up mix dense and quantized weights".into());
            }
            let norm = |n: &RmsNorm| norm_ptr(n, s).ok_or_else(|| "a norm is not bf16".to_string());
            let opt_norm = |n: &Option<RmsNorm>| match n {
                Some(n) => norm(n),
                None => Ok(0),
            };
            layers.push(Layer {
                attn_norm: norm(&l.attn_norm)?,
                ffn_norm: norm(&l.ffn_norm)?,
                q_norm: opt_norm(&l.attn.q_norm)?,
                k_norm: opt_norm(&l.attn.k_norm)?,
                q,
                k,
                v,
                o,
                gate,
                up,
                down,
            });
        }
        let head = model.head.as_ref().ok_or("no head")?;
        let out_norm = norm_ptr(&head.norm, s).ok_or("the final norm is not bf16")?;
        let head_linear =
            linear(&head.output, s, &mut keep).ok_or_else(|| unsupported("output"))?;
        let alloc_err = |e: candle_core::cuda_backend::cudarc::driver::DriverError| e.to_string();
        let kernels = Kernels::load(device, nh / nkv).map_err(|e| e.to_string())?;
        let var = Variants::from_env();
        let attn_warps = var.attn_warps;
        let splits = attention_splits(
            &kernels.attention,
            &stream,
            model.max_len,
            nkv,
            nh / nkv,
            hd,
            attn_warps,
        )?;
        let cluster = attention_cluster_blocks(
            &kernels.attention_cluster,
            &stream,
            attn_warps,
            attention_cluster_shared(attn_warps, (nh / nkv) as i32, hd as i32),
        );
        // A cache up to 64 positions a block (1,024 at 16 blocks). One H100, llama-8B
        // bf16: tg128 after 512 tokens 175.6 tok/s against 174.0 for the two kernels, but
        // tg1024 after 512 (caches of 1,024 and 2,048) 170.2 against 172.9 when the cluster
        // served up to 128 positions a block; qwen2.5-1.5b Q4_K tg128 788 against 773.
        let cluster_max_len = std::env::var("SHOAL_GPU_ATTN_CLUSTER_LEN")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(cluster as i32 * 64);
        let group = (nh / nkv) as i32;
        let fuse_o = var.fuse_o
            && cluster > 0
            && c.hidden_size.is_multiple_of(cluster as usize)
            && attention_cluster_blocks(
                &kernels.attention_o_cluster,
                &stream,
                attn_warps,
                attention_o_cluster_shared(attn_warps, group, hd as i32),
            ) == cluster;
        let beside = if cluster > 0 {
            attention_cluster_shared(attn_warps, group, hd as i32)
        } else {
            attention_shared(attn_warps, group, hd as i32)
        };
        let staged_o = layers
            .first()
            // The fused projection and the staged one are two designs of the same stage.
            .filter(|_| var.staged_o && !fuse_o)
            .filter(|_| layers.iter().all(|l| !l.o.w.is_quant() && l.o.bias == 0))
            .and_then(|l| staged_for(&kernels.matvec_staged, &stream, l.o.rows, l.o.k, beside));
        if staged_o.is_some() && var.carveout {
            kernels.prefer_shared();
        }
        let widest = c.hidden_size.max(c.ffn_size).max(nh * hd);
        let inv_freq: Vec<f32> = (0..hd / 2)
            .map(|i| 1.0 / c.rope_theta.powf(2.0 * i as f32 / hd as f32))
            .collect();
        let mut inv = stream.alloc_zeros::<f32>(hd / 2).map_err(alloc_err)?;
        stream.memcpy_htod(&inv_freq, &mut inv).map_err(alloc_err)?;
        let logits = Tensor::zeros((1, c.vocab_size), DType::F32, &model.compute.device)
            .map_err(|e| e.to_string())?;
        let bufs = Buffers {
            x: stream.alloc_zeros(c.hidden_size).map_err(alloc_err)?,
            h: stream.alloc_zeros(c.hidden_size).map_err(alloc_err)?,
            qkv: stream.alloc_zeros((nh + 2 * nkv) * hd).map_err(alloc_err)?,
            attn: stream.alloc_zeros(nh * hd).map_err(alloc_err)?,
            ff: stream.alloc_zeros(c.ffn_size).map_err(alloc_err)?,
            xq: stream.alloc_zeros(widest).map_err(alloc_err)?,
            xd: stream
                .alloc_zeros(2 * widest.div_ceil(32))
                .map_err(alloc_err)?,
            part_acc: stream.alloc_zeros(nh * splits * hd).map_err(alloc_err)?,
            part_ml: stream.alloc_zeros(2 * nh * splits).map_err(alloc_err)?,
            o_partial: stream.alloc_zeros(nkv * c.hidden_size).map_err(alloc_err)?,
            o_count: stream.alloc_zeros(16).map_err(alloc_err)?,
            pos: stream.alloc_zeros(1).map_err(alloc_err)?,
            inv_freq: inv,
            logits,
        };
        let at = Ptrs::of(&bufs, s).map_err(|e| e.to_string())?;
        Ok(Self {
            stream,
            kernels,
            layers,
            out_norm,
            head: head_linear,
            bufs,
            at,
            hidden: c.hidden_size as i32,
            ffn: c.ffn_size as i32,
            nh: nh as i32,
            nkv: nkv as i32,
            hd: hd as i32,
            splits: splits as u32,
            cluster,
            cluster_max_len,
            fuse_o,
            staged_o,
            eps: c.rms_eps,
            interleaved: i32::from(c.rope_style == RopeStyle::Interleaved),
            graphs: Vec::new(),
            var,
            chained: Cell::new(None),
            batch: None,
            batch_steps: 0,
            vocab: c.vocab_size as i32,
            chain: None,
            chain_failed: false,
            _keep: keep,
        })
    }

    /// One token: its embedding row `x` at position `pos` through every layer (keys and
    /// values appended to `cache`'s `layers`) and the head; the logits `(1, vocab)`.
    pub(crate) fn step(
        &mut self,
        x: &[f32],
        pos: usize,
        layers: &[(Tensor, Tensor)],
        graphs: bool,
    ) -> Result<Tensor> {
        let cache = self.cache_key(layers)?;
        self.stream
            .memcpy_htod(x, &mut self.bufs.x)
            .map_err(gpu_err)?;
        self.stream
            .memcpy_htod(&[pos as i32], &mut self.bufs.pos)
            .map_err(gpu_err)?;
        if !graphs {
            for _ in 0..self.var.repeat {
                self.record(&cache)?;
            }
            return Ok(self.bufs.logits.copy()?);
        }
        let at = match self.graphs.iter().position(|(k, _)| *k == cache) {
            Some(i) => {
                let used = self.graphs.remove(i);
                self.graphs.push(used);
                self.graphs.len() - 1
            }
            None => {
                let graph = self.capture_with(|| self.record(&cache))?;
                if self.graphs.len() == GRAPHS_KEPT {
                    self.graphs.remove(0);
                }
                self.graphs.push((cache, graph));
                self.graphs.len() - 1
            }
        };
        for _ in 0..self.var.repeat {
            self.graphs[at].1.launch().map_err(gpu_err)?;
        }
        Ok(self.bufs.logits.copy()?)
    }

    /// The layers' caches as a graph's key.
    fn cache_key(&self, layers: &[(Tensor, Tensor)]) -> Result<CacheKey> {
        Ok(CacheKey {
            ptrs: layers
                .iter()
                .flat_map(|(k, v)| [tensor_ptr(k, &self.stream), tensor_ptr(v, &self.stream)])
                .collect::<Result<_>>()?,
            capacity: layers.first().map_or(Ok(0), |(k, _)| k.dim(1))? as i32,
        })
    }

    /// The launches `record` makes, captured as a graph.
    fn capture_with(&self, record: impl FnOnce() -> Result<()>) -> Result<CudaGraph> {
        self.stream
            .begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED)
            .map_err(gpu_err)?;
        let recorded = record();
        let graph = self
            .stream
            .end_capture(CUgraphInstantiate_flags(0))
            .map_err(gpu_err)?;
        recorded?;
        let graph = graph.ok_or_else(|| gpu_err("the capture recorded nothing"))?;
        graph.upload().map_err(gpu_err)?;
        tracing::debug!(
            layers = self.layers.len(),
            "captured the decode step as a CUDA graph"
        );
        Ok(graph)
    }

    /// Launches (or, while capturing, records) the whole step. A dense projection folds
    /// the RMSNorm before it into its own kernel; a quantized one reads the normed row
    /// quantized to 8 bits by the norm's kernel.
    fn record(&self, cache: &CacheKey) -> Result<()> {
        // The step's first kernel follows host copies: an ordinary launch.
        self.chained.set(Some(false));
        let recorded = self.record_layers(cache);
        self.chained.set(None);
        recorded
    }

    fn record_layers(&self, cache: &CacheKey) -> Result<()> {
        let Ptrs {
            x,
            h,
            qkv,
            attn,
            ff,
            ..
        } = self.at;
        for (i, l) in self.layers.iter().enumerate() {
            let (kc, vc) = (cache.ptrs[2 * i], cache.ptrs[2 * i + 1]);
            let runs = |stage| self.var.runs(stage);
            if runs(Stage::Qkv) {
                self.project_qkv(l, (kc, vc, cache.capacity))?;
            }
            let fused =
                runs(Stage::Attention) && runs(Stage::Output) && self.fuses_o(&l.o, cache.capacity);
            if fused {
                self.attention_o(qkv, (kc, vc, cache.capacity), &l.o)?;
            } else if runs(Stage::Attention) {
                self.attention(qkv, (kc, vc, cache.capacity), attn, &l.o)?;
            }
            if runs(Stage::Output) && !fused {
                match self.staged_o {
                    Some(shape) => self.matvec_staged(shape, &l.o, attn, x, x)?,
                    None => self.matvec(Stage::Output, &[&l.o], attn, 0, x, x)?,
                }
            }
            if l.gate.w.is_quant() {
                self.rmsnorm(x, l.ffn_norm, h)?;
            }
            if runs(Stage::GateUp) {
                self.gate_up(&l.gate, &l.up, l.ffn_norm, ff)?;
            }
            if l.down.w.is_quant() {
                self.quantize(ff, self.ffn)?;
            }
            if runs(Stage::Down) {
                self.matvec(Stage::Down, &[&l.down], ff, 0, x, x)?;
            }
        }
        if !self.var.runs(Stage::Head) {
            return Ok(());
        }
        self.normed_matvec(Stage::Head, &[&self.head], self.out_norm, self.at.logits)
    }

    /// q/k/v of the normed residual, rotated; q into `qkv`, k and v into the layer's
    /// `cache` at the step's position.
    fn project_qkv(&self, l: &Layer, cache: (u64, u64, i32)) -> Result<()> {
        if self.rope_in_projection(l) {
            return self.qkv_rope(l, cache);
        }
        let qkv = self.at.qkv;
        self.normed_matvec(Stage::Qkv, &[&l.q, &l.k, &l.v], l.attn_norm, qkv)?;
        self.rope_append(qkv, l.q_norm, l.k_norm, cache)
    }

    /// `y = W norm(x)`: the norm in the mat-vec where W is dense, else before it.
    fn normed_matvec(&self, stage: Stage, ls: &[&Linear], norm: u64, y: u64) -> Result<()> {
        if ls[0].w.is_quant() {
            self.rmsnorm(self.at.x, norm, self.at.h)?;
            self.matvec(stage, ls, self.at.h, 0, 0, y)
        } else {
            self.matvec(stage, ls, self.at.x, norm, 0, y)
        }
    }

    fn launch(&self, f: &CudaFunction, cfg: LaunchConfig, args: &[&dyn Arg]) -> Result<()> {
        self.launch_with(f, cfg, args, None)
    }

    /// `launch`, with the grid's y dimension in clusters of `cluster` blocks where given.
    fn launch_with(
        &self,
        f: &CudaFunction,
        cfg: LaunchConfig,
        args: &[&dyn Arg],
        cluster: Option<u32>,
    ) -> Result<()> {
        let dependent = match self.chained.get() {
            Some(true) => self.var.pdl,
            Some(false) => {
                self.chained.set(Some(true));
                false
            }
            None => false,
        };
        if dependent || cluster.is_some() {
            return self.launch_ex(f, cfg, args, dependent, cluster);
        }
        let mut builder = self.stream.launch_builder(f);
        for a in args {
            a.push(&mut builder);
        }
        // SAFETY: every argument matches the kernel's parameter list in `decode.cu`, and
        // every address points into a buffer or tensor this plan holds.
        unsafe { builder.launch(cfg) }.map_err(gpu_err)?;
        Ok(())
    }

    /// Launches `f` through `cuLaunchKernelEx`: where `dependent`, as a programmatic
    /// dependent of the kernel ahead of it in the stream (captured as such into a graph):
    /// its blocks may start before that kernel ends and wait in `begin_step`; where
    /// `cluster` is given, in clusters of that many blocks along the grid's y dimension.
    fn launch_ex(
        &self,
        f: &CudaFunction,
        cfg: LaunchConfig,
        args: &[&dyn Arg],
        dependent: bool,
        cluster: Option<u32>,
    ) -> Result<()> {
        let mut params: Vec<*mut std::ffi::c_void> = args.iter().map(|a| a.param()).collect();
        let mut attrs = Vec::with_capacity(2);
        if dependent {
            // SAFETY: a zeroed attribute is a valid plain C struct; the union member set
            // is the one the attribute id names.
            let mut attr: cu::CUlaunchAttribute = unsafe { std::mem::zeroed() };
            attr.id =
                cu::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
            attr.value.programmaticStreamSerializationAllowed = 1;
            attrs.push(attr);
        }
        if let Some(blocks) = cluster {
            attrs.push(cluster_attr(blocks));
        }
        let config = cu::CUlaunchConfig {
            gridDimX: cfg.grid_dim.0,
            gridDimY: cfg.grid_dim.1,
            gridDimZ: cfg.grid_dim.2,
            blockDimX: cfg.block_dim.0,
            blockDimY: cfg.block_dim.1,
            blockDimZ: cfg.block_dim.2,
            sharedMemBytes: cfg.shared_mem_bytes,
            hStream: self.stream.cu_stream(),
            attrs: attrs.as_mut_ptr(),
            numAttrs: attrs.len() as u32,
        };
        self.stream.context().bind_to_thread().map_err(gpu_err)?;
        // SAFETY: as in `launch`; `params` points at the arguments, which outlive the call,
        // one per kernel parameter in order.
        unsafe {
            cu::cuLaunchKernelEx(
                &config,
                f.cu_function(),
                params.as_mut_ptr(),
                std::ptr::null_mut(),
            )
        }
        .result()
        .map_err(gpu_err)
    }
}

impl Model {
    /// The decode plan, built on first use; `None` on the CPU, where the environment
    /// asks for candle's path, or where the path does not cover this model.
    fn gpu_plan(&self) -> Result<Option<std::sync::MutexGuard<'_, PlanState>>> {
        if self.compute.device.is_cpu() || self.gpu_decode == GpuDecode::Candle {
            return Ok(None);
        }
        let mut state = self
            .gpu_plan
            .lock()
            .map_err(|_| gpu_err("the decode plan's lock was poisoned"))?;
        if matches!(*state, PlanState::Untried) {
            *state = match DecodePlan::build(self) {
                Ok(plan) => PlanState::Ready(Box::new(plan)),
                Err(why) => {
                    tracing::info!(%why, "GPU decode path not used; candle's path decodes");
                    PlanState::Unsupported(why)
                }
            };
        }
        Ok(matches!(*state, PlanState::Ready(_)).then_some(state))
    }

    /// One token through the whole model on the GPU decode path, or `None` where the path
    /// does not cover this model (candle's path then runs).
    pub(super) fn gpu_decode(&self, token: u32, cache: &mut KvCache) -> Result<Option<Tensor>> {
        if self.compute.device.is_cpu() || self.gpu_decode == GpuDecode::Candle {
            return Ok(None);
        }
        let pos = cache.len();
        if pos + 1 > self.max_len {
            return Err(ModelError::ContextFull {
                positions: pos + 1,
                context: self.max_len,
            });
        }
        let Some(mut state) = self.gpu_plan()? else {
            return Ok(None);
        };
        let PlanState::Ready(plan) = &mut *state else {
            return Ok(None);
        };
        let row = self.embed_host(&[token])?.flatten_all()?.to_vec1::<f32>()?;
        let c = &self.config;
        // The cache grows by doubling as candle's path grows it (a new graph each time),
        // not to the whole context at once: a long context's cache would not fit beside
        // the weights on a smaller GPU.
        let layers = cache.decode_layers(c.num_kv_heads, c.head_dim, pos + 1)?;
        let logits = plan.step(&row, pos, &layers, self.gpu_decode == GpuDecode::Graphs)?;
        cache.advance(1);
        Ok(Some(logits))
    }

    /// [`Model::greedy`] on the GPU decode path's chained steps (`chain.rs`); `None`
    /// where they do not apply (no graphs, a model the path does not cover, a table that
    /// did not fit).
    pub(super) fn gpu_greedy(
        &self,
        token: u32,
        cache: &mut KvCache,
        n: usize,
        sink: &mut dyn FnMut(u32) -> bool,
    ) -> Result<Option<usize>> {
        if self.compute.device.is_cpu() || self.gpu_decode != GpuDecode::Graphs {
            return Ok(None);
        }
        let pos = cache.len();
        if n == 0 {
            return Ok(Some(0));
        }
        if pos + n > self.max_len {
            return Err(ModelError::ContextFull {
                positions: pos + n,
                context: self.max_len,
            });
        }
        self.check_vocab(&[token])?;
        let Some(mut state) = self.gpu_plan()? else {
            return Ok(None);
        };
        let PlanState::Ready(plan) = &mut *state else {
            return Ok(None);
        };
        // Replaying a step's graph more than once is a timing variant of stepping.
        if !plan.var.chain || plan.var.repeat != 1 {
            return Ok(None);
        }
        let rows = |tokens: &[u32]| -> Result<Vec<f32>> {
            Ok(self.embed_host(tokens)?.flatten_all()?.to_vec1::<f32>()?)
        };
        if !plan.chain_ready(&self.compute.device, &rows) {
            return Ok(None);
        }
        let c = &self.config;
        // A run of chained steps a cache capacity, the cache grown as stepping grows it
        // (by doubling): the same graphs and kernels (the attention's is chosen by the
        // capacity) as a step at a time, not the capacity of the whole answer at once.
        let (mut token, mut done, mut going) = (token, 0, true);
        while done < n && going {
            let pos = cache.len();
            let layers = cache.decode_layers(c.num_kv_heads, c.head_dim, pos + 1)?;
            let capacity = layers.first().map_or(Ok(0), |(k, _)| k.dim(1))?;
            let run = (n - done).min(capacity - pos);
            let mut last = token;
            let got = plan.greedy(token, pos, &layers, run, &mut |t| {
                last = t;
                going = sink(t);
                going
            })?;
            cache.advance(got);
            done += got;
            token = last;
        }
        Ok(Some(done))
    }
}
