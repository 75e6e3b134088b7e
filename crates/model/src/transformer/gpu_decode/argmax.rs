//! The arg-max of logits where they lie on a CUDA device (`decode.cu`'s `shoal_argmax`):
//! greedy decoding's one id a row back, one launch, instead of candle's generic reduction
//! (one block walking the vocabulary a dependent load at a time, after copying the tensor's
//! shape to the device).

use candle_core::cuda_backend::cudarc::driver::PushKernelArg;
use candle_core::{DType, Device, Tensor};

use crate::Result;

use super::gpu_err;
use super::kernels::{MODULE, PTX, cfg};
use super::weights::tensor_ptr;

/// Threads of `shoal_argmax`'s one block a row.
pub(super) const THREADS: u32 = 1024;

/// Each row's arg-max (the first index on ties) of a contiguous f32 tensor of one or two
/// dimensions on a CUDA device; `None` for any other tensor.
pub(crate) fn argmax_rows(logits: &Tensor) -> Result<Option<Vec<u32>>> {
    let Device::Cuda(device) = logits.device() else {
        return Ok(None);
    };
    if logits.dtype() != DType::F32 || !logits.is_contiguous() || logits.rank() > 2 {
        return Ok(None);
    }
    let (rows, n) = match logits.dims() {
        [n] => (1, *n),
        [rows, n] => (*rows, *n),
        _ => return Ok(None),
    };
    if rows == 0 || n == 0 || n > i32::MAX as usize {
        return Ok(None);
    }
    let stream = device.cuda_stream();
    let f = device
        .get_or_load_custom_func("shoal_argmax", MODULE, PTX)?
        .into_cuda_function();
    // SAFETY: `shoal_argmax` writes every row's id (block b writes out[b]) before it is
    // read back; zeroing it first would only add a memset to each greedy token.
    let mut ids = unsafe { stream.alloc::<u32>(rows) }.map_err(gpu_err)?;
    let x = tensor_ptr(logits, &stream)?;
    let (n, stride) = (n as i32, n as i64);
    let mut builder = stream.launch_builder(&f);
    builder.arg(&x).arg(&n).arg(&stride).arg(&mut ids);
    // SAFETY: the arguments match `shoal_argmax`'s parameters; `x` addresses `rows` rows of
    // `n` f32 values held by `logits`, and `ids` holds `rows` ids.
    unsafe { builder.launch(cfg((rows as u32, 1), THREADS, 0)) }.map_err(gpu_err)?;
    Ok(Some(stream.clone_dtoh(&ids).map_err(gpu_err)?))
}
