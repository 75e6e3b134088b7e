//! Many rows at once on a CUDA device (a prompt, a batch) with fewer passes over memory.
//!
//! candle's path runs a prompt as cuBLAS products joined by candle's element-wise kernels;
//! on an H200 those kernels took half a 512-token prefill of the llama-8B shape (the mask
//! add alone, a broadcast, 164 µs a layer against 91 µs for the gate product). Here,
//! from `prefill.cu`: attention probabilities in one pass, causal by position (scale,
//! mask and softmax together; no mask tensor), SiLU(gate)·up in one, the projections'
//! rows to heads with bias and rotary embedding in one, heads back to rows in one; and
//! GGUF blocks dequantized to bf16 for cuBLAS where a product has many rows (candle's
//! 8-bit tile kernels, with f32 activations cast both ways, were slower than the bf16
//! product plus the dequantization). Everything else stays candle's.

use candle_core::cuda_backend::cudarc::driver::{CudaFunction, DevicePtr, LaunchConfig};
use candle_core::cuda_backend::{CudaDevice, CudaStorage};
use candle_core::op::BackpropOp;
use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{DType, Device, Storage, Tensor};
use half::bf16;

use super::gpu_decode::Arg;
use crate::{ModelError, Result};

const PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/prefill.ptx"));
const MODULE: &str = "shoal_prefill";
/// Rows of a product from which quantized weights are dequantized for cuBLAS; below it
/// candle's 8-bit kernels run (a decode batch reads the blocks once, a prompt reuses
/// the dequantized matrix over its rows).
pub(crate) const DEQUANT_MIN_ROWS: usize = 128;
/// The largest matrix dequantized at once (bf16 bytes); a larger one (a big vocabulary's
/// head over many rows) keeps candle's kernels rather than a transient copy of this size.
const DEQUANT_MAX_BYTES: usize = 1 << 29;
/// Rows of scores a block of the softmax kernel takes (a warp each).
const SOFTMAX_ROWS_A_BLOCK: usize = 4;

fn gpu_err(e: impl std::fmt::Display) -> ModelError {
    ModelError::Invalid(format!("GPU prefill: {e}"))
}

/// Whether these kernels serve tensors of `device` and `dtype` (bf16 on a CUDA device).
pub(crate) fn applies(device: &Device, dtype: DType) -> bool {
    matches!(device, Device::Cuda(_)) && dtype == DType::BF16
}

fn cuda(device: &Device) -> Result<&CudaDevice> {
    match device {
        Device::Cuda(d) => Ok(d),
        _ => Err(gpu_err("not a CUDA device")),
    }
}

fn function(device: &CudaDevice, name: &str) -> Result<CudaFunction> {
    Ok(device
        .get_or_load_custom_func(name, MODULE, PTX)?
        .into_cuda_function())
}

/// Device address of a contiguous bf16 tensor's first element.
fn ptr(t: &Tensor, device: &CudaDevice) -> Result<u64> {
    if !t.is_contiguous() || t.dtype() != DType::BF16 {
        return Err(gpu_err(format!(
            "expected a contiguous bf16 tensor, got {:?} {:?}",
            t.dtype(),
            t.layout()
        )));
    }
    let (storage, layout) = t.storage_and_layout();
    let Storage::Cuda(cs) = &*storage else {
        return Err(gpu_err("tensor is not on a CUDA device"));
    };
    let base = cs
        .as_cuda_slice::<bf16>()?
        .device_ptr(device.cuda_stream().as_ref())
        .0;
    Ok(base + (layout.start_offset() * 2) as u64)
}

/// A fresh bf16 tensor of `shape` filled by `fill(address)` (a kernel launch).
fn produce(
    device: &CudaDevice,
    shape: &[usize],
    fill: impl FnOnce(u64) -> Result<()>,
) -> Result<Tensor> {
    let n: usize = shape.iter().product();
    // SAFETY: every element is written by the kernel `fill` launches before anything
    // reads the tensor (same stream).
    let slice = unsafe { device.alloc::<bf16>(n) }?;
    let addr = slice.device_ptr(device.cuda_stream().as_ref()).0;
    fill(addr)?;
    let storage = CudaStorage::wrap_cuda_slice(slice, device.clone());
    Ok(Tensor::from_storage(
        Storage::Cuda(storage),
        shape.to_vec(),
        BackpropOp::none(),
        false,
    ))
}

/// Launches `name` with `args` (each matching `prefill.cu`'s parameter list).
fn launch(
    device: &CudaDevice,
    name: &str,
    grid: (u32, u32),
    block: (u32, u32),
    args: &[&dyn Arg],
) -> Result<()> {
    let f = function(device, name)?;
    let stream = device.cuda_stream();
    let mut builder = stream.launch_builder(&f);
    for a in args {
        a.push(&mut builder);
    }
    let cfg = LaunchConfig {
        grid_dim: (grid.0, grid.1, 1),
        block_dim: (block.0, block.1, 1),
        shared_mem_bytes: 0,
    };
    // SAFETY: the arguments match the kernel's parameters in `prefill.cu`, and every
    // address points into a tensor the caller holds for the call (same stream).
    unsafe { builder.launch(cfg) }.map_err(gpu_err)?;
    Ok(())
}

/// Attention probabilities from raw scores `(batches, rows, s)` (rows = group · t, the
/// layout of `attend`): softmax of `scale · scores` over the keys at or before each
/// query's position `s - t + row % t`, zero after it.
pub(crate) fn causal_softmax(scores: &Tensor, t: usize, scale: f32) -> Result<Tensor> {
    let scores = scores.contiguous()?;
    let (batches, rows, s) = scores.dims3()?;
    if t == 0 || !rows.is_multiple_of(t) || t > s {
        return Err(gpu_err(format!(
            "scores of {rows} rows and {s} keys for {t} queries"
        )));
    }
    let device = cuda(scores.device())?;
    let input = ptr(&scores, device)?;
    let total = batches * rows;
    produce(device, &[batches, rows, s], |out| {
        launch(
            device,
            "shoal_causal_softmax",
            (total.div_ceil(SOFTMAX_ROWS_A_BLOCK) as u32, 1),
            (32 * SOFTMAX_ROWS_A_BLOCK as u32, 1),
            &[
                &input,
                &out,
                &(rows as i32),
                &(t as i32),
                &(s as i32),
                &scale,
                &total,
            ],
        )
    })
}

/// `silu(gate) · up`, element-wise.
pub(crate) fn silu_mul(gate: &Tensor, up: &Tensor) -> Result<Tensor> {
    let (gate, up) = (gate.contiguous()?, up.contiguous()?);
    if gate.dims() != up.dims() || !gate.elem_count().is_multiple_of(8) {
        return Err(gpu_err(format!(
            "silu_mul of {:?} and {:?}",
            gate.dims(),
            up.dims()
        )));
    }
    let device = cuda(gate.device())?;
    let (g, u) = (ptr(&gate, device)?, ptr(&up, device)?);
    let n = gate.elem_count();
    produce(device, gate.dims(), |out| {
        let threads = n / 8;
        launch(
            device,
            "shoal_silu_mul",
            (threads.div_ceil(256) as u32, 1),
            (256, 1),
            &[&g, &u, &out, &n],
        )
    })
}

/// Rotary embedding as [`to_heads`] applies it: the model's tables and style, and the
/// position of the first row.
pub(crate) struct RopeAt<'a> {
    pub cos: &'a Tensor,
    pub sin: &'a Tensor,
    pub interleaved: bool,
    pub pos: usize,
}

/// A projection's rows `(t, heads · hd)` as heads `(heads, t, hd)`, `bias` added and
/// `rope` applied (when given).
pub(crate) fn to_heads(
    x: &Tensor,
    bias: Option<&Tensor>,
    rope: Option<&RopeAt<'_>>,
    heads: usize,
    hd: usize,
) -> Result<Tensor> {
    let x = x.contiguous()?;
    let (t, width) = x.dims2()?;
    if width != heads * hd || !hd.is_multiple_of(2) || hd > 2048 {
        return Err(gpu_err(format!(
            "{width} features as {heads} heads of {hd}"
        )));
    }
    let device = cuda(x.device())?;
    let input = ptr(&x, device)?;
    let bias = bias.map(|b| b.contiguous()).transpose()?;
    let bias_ptr = bias
        .as_ref()
        .map(|b| ptr(b, device))
        .transpose()?
        .unwrap_or(0);
    let (cos, sin, interleaved, pos) = match rope {
        Some(r) => (
            ptr(r.cos, device)?,
            ptr(r.sin, device)?,
            i32::from(r.interleaved),
            r.pos as i32,
        ),
        None => (0, 0, 0, 0),
    };
    // A thread a pair, as many heads a block as make ~256 threads.
    let per_block = (512 / hd).max(1);
    produce(device, &[heads, t, hd], |out| {
        launch(
            device,
            "shoal_to_heads",
            (t as u32, heads.div_ceil(per_block) as u32),
            ((hd / 2) as u32, per_block as u32),
            &[
                &input,
                &bias_ptr,
                &cos,
                &sin,
                &out,
                &(t as i32),
                &(heads as i32),
                &(hd as i32),
                &pos,
                &interleaved,
            ],
        )
    })
}

/// Heads `(heads, t, hd)` back as rows `(t, heads · hd)`.
pub(crate) fn from_heads(x: &Tensor) -> Result<Tensor> {
    let x = x.contiguous()?;
    let (heads, t, hd) = x.dims3()?;
    if !hd.is_multiple_of(8) || hd > 8192 {
        return Err(gpu_err(format!("heads of {hd}")));
    }
    let device = cuda(x.device())?;
    let input = ptr(&x, device)?;
    let pieces = heads * hd / 8;
    produce(device, &[t, heads * hd], |out| {
        launch(
            device,
            "shoal_from_heads",
            (t as u32, pieces.div_ceil(256) as u32),
            (256, 1),
            &[&input, &out, &(t as i32), &(heads as i32), &(hd as i32)],
        )
    })
}

/// The kernel and the threads per GGUF block of the block types dequantized here.
fn dequant_kernel(dtype: GgmlDType) -> Option<(&'static str, usize)> {
    match dtype {
        GgmlDType::Q8_0 => Some(("shoal_dequant_q8_0", 4)),
        GgmlDType::Q4K => Some(("shoal_dequant_q4k", 16)),
        GgmlDType::Q6K => Some(("shoal_dequant_q6k", 8)),
        _ => None,
    }
}

/// A GGUF matrix `(rows, cols)` on the GPU as bf16, or `None` where its block type is not
/// one of these kernels' or it is too large to copy at once.
pub(crate) fn dequantize(q: &QTensor) -> Result<Option<Tensor>> {
    let Some((name, per_block)) = dequant_kernel(q.dtype()) else {
        return Ok(None);
    };
    let (rows, cols) = q.shape().dims2()?;
    if rows * cols * 2 > DEQUANT_MAX_BYTES || !cols.is_multiple_of(q.dtype().block_size()) {
        return Ok(None);
    }
    let device = cuda(&q.device())?.clone();
    let blocks = rows * cols / q.dtype().block_size();
    let input = q.device_ptr()? as u64;
    let threads = blocks * per_block;
    produce(&device, &[rows, cols], |out| {
        launch(
            &device,
            name,
            (threads.div_ceil(256) as u32, 1),
            (256, 1),
            &[&input, &out, &blocks],
        )
    })
    .map(Some)
}
