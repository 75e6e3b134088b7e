//! A batch of decode rows, each of its own sequence, on a CUDA device: the projections
//! and the FFN stay candle's batched matmuls (one launch each for the whole batch, on
//! the tensor cores), and rope, the KV append and attention run on the decode kernels
//! (`decode.cu`'s `*_batch` entry points), every token against its own cache, one launch
//! each for the batch — where candle's path runs ~13 operations a sequence a layer.

use candle_core::cuda_backend::cudarc::driver::{CudaSlice, DevicePtr, DeviceRepr, LaunchConfig};
use candle_core::{DType, Tensor};

use super::kernels::ATTN_WARPS;
use super::{DecodePlan, PlanState, attention_shared, cfg, gpu_err, tensor_ptr};
use crate::Result;
use crate::transformer::{BatchPart, Model};

/// `decode.cu`'s `BatchCaches`: device addresses of every (layer, token)'s key and value
/// addresses, each token's cache capacity and position.
#[repr(C)]
#[derive(Clone, Copy)]
pub(super) struct BatchCaches {
    caches: u64,
    caps: u64,
    pos: u64,
    layer: i32,
    batch: i32,
}

// SAFETY: plain `repr(C)` data of the layout the kernels declare, passed by value.
unsafe impl DeviceRepr for BatchCaches {}

/// What a batch of decode rows needs beside the single-token buffers: every token's cache
/// addresses, capacity and position (uploaded each step), and room for its attention
/// partials (grown to the largest batch seen).
pub(super) struct BatchBufs {
    /// Held until the next step replaces them (the kernels read them).
    _caches: CudaSlice<u64>,
    _caps: CudaSlice<i32>,
    _pos: CudaSlice<i32>,
    part_acc: CudaSlice<f32>,
    part_ml: CudaSlice<f32>,
    /// Tokens the partials have room for.
    room: usize,
    /// The addresses, taken once per step.
    at: BatchCaches,
    part_acc_ptr: u64,
    part_ml_ptr: u64,
}

impl DecodePlan {
    /// Readies a batched step of `pos.len()` decode rows, each of its own sequence:
    /// `caches[(layer * batch + i) * 2 ..][..2]` are token i's key and value addresses in
    /// that layer, `caps[i]` their capacity, `pos[i]` its position.
    pub(super) fn begin_batch(&mut self, caches: &[u64], caps: &[i32], pos: &[i32]) -> Result<()> {
        let b = pos.len();
        let s = &self.stream;
        let per = (self.nh as usize) * self.splits as usize;
        let (part_acc, part_ml, room) = match self.batch.take() {
            Some(old) if old.room >= b => (old.part_acc, old.part_ml, old.room),
            _ => (
                s.alloc_zeros::<f32>(b * per * self.hd as usize)
                    .map_err(gpu_err)?,
                s.alloc_zeros::<f32>(b * per * 2).map_err(gpu_err)?,
                b,
            ),
        };
        let caches = s.clone_htod(caches).map_err(gpu_err)?;
        let caps = s.clone_htod(caps).map_err(gpu_err)?;
        let pos = s.clone_htod(pos).map_err(gpu_err)?;
        let at = BatchCaches {
            caches: caches.device_ptr(s).0,
            caps: caps.device_ptr(s).0,
            pos: pos.device_ptr(s).0,
            layer: 0,
            batch: b as i32,
        };
        let part_acc_ptr = part_acc.device_ptr(s).0;
        let part_ml_ptr = part_ml.device_ptr(s).0;
        self.batch = Some(BatchBufs {
            part_acc_ptr,
            part_ml_ptr,
            _caches: caches,
            _caps: caps,
            _pos: pos,
            part_acc,
            part_ml,
            room,
            at,
        });
        self.batch_steps += 1;
        Ok(())
    }

    /// Layer `layer`'s attention for the batch readied by [`Self::begin_batch`]: `qkv`
    /// holds each token's f32 row of queries, keys and values (the queries rotated in
    /// place, the keys and values written to its cache), `out` gets each token's f32
    /// attention output.
    pub(super) fn batch_attention(&self, layer: usize, qkv: u64, out: u64) -> Result<()> {
        let bb = self
            .batch
            .as_ref()
            .ok_or_else(|| gpu_err("a batched layer before its step was readied"))?;
        let c = BatchCaches {
            layer: layer as i32,
            ..bb.at
        };
        let b = c.batch as u32;
        let l = &self.layers[layer];
        let inv = self.at.inv_freq;
        let heads = (self.nh + 2 * self.nkv) as u32;
        self.launch(
            &self.kernels.rope_append_batch,
            cfg((heads, b), self.hd as u32, 0),
            &[
                &qkv,
                &l.q_norm,
                &l.k_norm,
                &self.eps,
                &inv,
                &c,
                &self.nh,
                &self.nkv,
                &self.hd,
                &self.interleaved,
            ],
        )?;
        let group = self.nh / self.nkv;
        let scale = 1.0 / (self.hd as f32).sqrt();
        let shared = attention_shared(ATTN_WARPS, group, self.hd);
        let three = LaunchConfig {
            grid_dim: (self.nkv as u32, self.splits, b),
            block_dim: (ATTN_WARPS * 32, 1, 1),
            shared_mem_bytes: shared,
        };
        let (acc, ml) = (bb.part_acc_ptr, bb.part_ml_ptr);
        self.launch(
            &self.kernels.attention_batch,
            three,
            &[
                &qkv, &c, &acc, &ml, &self.nh, &self.nkv, &group, &self.hd, &scale,
            ],
        )?;
        let splits = self.splits as i32;
        let pos = c.pos;
        self.launch(
            &self.kernels.attn_merge_batch,
            cfg((self.nh as u32, b), self.hd as u32, 0),
            &[&acc, &ml, &pos, &out, &self.nh, &splits, &self.hd],
        )
    }
}

impl Model {
    /// Batched steps whose attention ran on the GPU decode kernels (0 elsewhere).
    pub fn gpu_batch_steps(&self) -> usize {
        match self.gpu_plan.lock().as_deref() {
            Ok(PlanState::Ready(plan)) => plan.batch_steps,
            _ => 0,
        }
    }

    /// Whether the decode plan runs the output projection staged in shared memory
    /// (`SHOAL_GPU_STAGED=1` where the GPU and the shape allow it and the attention
    /// kernel does not do the projection, `SHOAL_GPU_FUSE_O`); false before the plan is
    /// built.
    pub fn gpu_output_staged(&self) -> bool {
        matches!(self.gpu_plan.lock().as_deref(), Ok(PlanState::Ready(plan)) if plan.staged_o.is_some())
    }

    /// One decode row of each of several sequences through every layer (not the head):
    /// the projections and the FFN as candle's batched matmuls, one launch each for the
    /// whole batch, and rope, the KV append and attention on the decode kernels, every
    /// token against its own cache, in one launch each for the batch (candle's path
    /// runs ~13 operations a sequence a layer there). `None` where the path does not
    /// cover this model. The caches are not advanced.
    pub(in crate::transformer) fn gpu_decode_rows(
        &self,
        hidden: &Tensor,
        parts: &mut [BatchPart<'_>],
    ) -> Result<Option<Tensor>> {
        let Some(mut state) = self.gpu_plan()? else {
            return Ok(None);
        };
        let PlanState::Ready(plan) = &mut *state else {
            return Ok(None);
        };
        let c = &self.config;
        let (nkv, hd) = (c.num_kv_heads, c.head_dim);
        let (b, n_layers) = (parts.len(), self.layers.len());
        let mut caches = vec![0u64; n_layers * b * 2];
        let mut caps = Vec::with_capacity(b);
        let mut pos = Vec::with_capacity(b);
        for (i, p) in parts.iter_mut().enumerate() {
            let at = p.cache.len();
            let layers = p.cache.decode_layers(nkv, hd, at + 1)?;
            for (l, (k, v)) in layers.iter().enumerate() {
                caches[(l * b + i) * 2] = tensor_ptr(k, &plan.stream)?;
                caches[(l * b + i) * 2 + 1] = tensor_ptr(v, &plan.stream)?;
            }
            caps.push(layers.first().map_or(Ok(0), |(k, _)| k.dim(1))? as i32);
            pos.push(at as i32);
        }
        plan.begin_batch(&caches, &caps, &pos)?;
        let nh = c.num_heads;
        let mut x = hidden.clone();
        for (i, layer) in self.layers.iter().enumerate() {
            let (q, k, v) = self.qkv_rows(layer, &x)?;
            let qkv = Tensor::cat(
                &[
                    q.to_dtype(DType::F32)?,
                    k.to_dtype(DType::F32)?,
                    v.to_dtype(DType::F32)?,
                ],
                1,
            )?;
            let out = Tensor::zeros((b, nh * hd), DType::F32, &self.compute.device)?;
            plan.batch_attention(
                i,
                tensor_ptr(&qkv, &plan.stream)?,
                tensor_ptr(&out, &plan.stream)?,
            )?;
            let out = out.to_dtype(self.compute.dtype)?;
            x = self.finish_layer(layer, &x, &out, &mut None)?;
        }
        Ok(Some(x))
    }
}
