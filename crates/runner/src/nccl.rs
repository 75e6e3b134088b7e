//! Tensor parallelism between the GPUs of one machine over NCCL: the all-reduce of each
//! layer's partial outputs as a candle operation on the tensors' own stream.

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{CudaSlice, DeviceRepr};
use candle_core::cuda_backend::cudarc::nccl::NcclType;
use candle_core::cuda_backend::{CudaStorage, CudaStorageSlice};
use candle_core::{CpuStorage, CustomOp1, Device, Layout, Shape, Tensor};
use shoal_collectives::nccl::Communicator;
use shoal_collectives::{Group, Transport};

use crate::RankError;

/// `sum over ranks` of a tensor, as a candle op (the output is a new device buffer).
struct AllReduce<'a>(&'a Communicator);

fn reduce_slice<T>(
    comm: &Communicator,
    storage: &CudaStorage,
    src: &CudaSlice<T>,
    layout: &Layout,
) -> candle_core::Result<CudaSlice<T>>
where
    T: NcclType + DeviceRepr,
{
    let (start, end) = layout
        .contiguous_offsets()
        .ok_or_else(|| candle_core::Error::Msg("all-reduce of a non-contiguous tensor".into()))?;
    let src = src.slice(start..end);
    // SAFETY: NCCL writes every value of `dst` before anything reads it.
    let mut dst = unsafe { storage.device.alloc::<T>(end - start)? };
    comm.all_reduce_sum(&src, &mut dst)
        .map_err(|e| candle_core::Error::Msg(e.to_string()))?;
    Ok(dst)
}

impl CustomOp1 for AllReduce<'_> {
    fn name(&self) -> &'static str {
        "nccl-all-reduce"
    }

    fn cpu_fwd(&self, _: &CpuStorage, _: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        candle_core::bail!("an NCCL all-reduce needs tensors on a GPU")
    }

    fn cuda_fwd(&self, s: &CudaStorage, l: &Layout) -> candle_core::Result<(CudaStorage, Shape)> {
        let slice = match &s.slice {
            CudaStorageSlice::BF16(x) => CudaStorageSlice::BF16(reduce_slice(self.0, s, x, l)?),
            CudaStorageSlice::F16(x) => CudaStorageSlice::F16(reduce_slice(self.0, s, x, l)?),
            CudaStorageSlice::F32(x) => CudaStorageSlice::F32(reduce_slice(self.0, s, x, l)?),
            _ => candle_core::bail!("NCCL all-reduce of {:?}", s.dtype()),
        };
        Ok((
            CudaStorage {
                slice,
                device: s.device.clone(),
            },
            l.shape().clone(),
        ))
    }
}

/// Sums `t` over the ranks of `comm`, on the GPUs.
pub fn all_reduce(comm: &Communicator, t: &Tensor) -> candle_core::Result<Tensor> {
    t.contiguous()?.apply_op1_no_bwd(&AllReduce(comm))
}

/// Joins the ranks of `group`, every one of them computing on `device`, into an NCCL
/// communicator on the device's stream.
pub fn join<T: Transport>(
    group: &mut Group<T>,
    device: &Device,
) -> Result<Communicator, RankError> {
    let Device::Cuda(d) = device else {
        return Err(RankError::Plan("NCCL needs a CUDA device".into()));
    };
    Ok(Communicator::join(group, d.cuda_stream())?)
}
