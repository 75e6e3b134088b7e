//! shoal's decode kernels (`decode.cu`, compiled to PTX by the build) as the plan loads
//! them, the argument records they take, and the launch shapes chosen for a model.

use candle_core::cuda_backend::cudarc::driver::sys as cu;
use candle_core::cuda_backend::cudarc::driver::{
    CudaFunction, CudaStream, DeviceRepr, LaunchConfig, PushKernelArg,
};

use crate::Result;

pub(super) const PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/decode.ptx"));
pub(super) const MODULE: &str = "shoal_decode";
/// Warps per block of the mat-vec kernels (a team of `split_for` warps a row).
pub(super) const MATVEC_WARPS: u32 = 4;
/// Warps per block of the attention kernel (one token's: `SHOAL_GPU_ATTN_WARPS` to compare).
pub(super) const ATTN_WARPS: u32 = 8;

/// Up to three matrices stacked as one mat-vec (`decode.cu`'s `Segments`).
#[repr(C)]
#[derive(Clone, Copy)]
pub(super) struct Segments {
    pub(super) w: [u64; 3],
    pub(super) bias: [u64; 3],
    pub(super) rows: [i32; 3],
}

/// `decode.cu`'s `QSegments`.
#[repr(C)]
#[derive(Clone, Copy)]
pub(super) struct QSegments {
    pub(super) w: [u64; 3],
    pub(super) bias: [u64; 3],
    pub(super) rows: [i32; 3],
    pub(super) kind: [i32; 3],
}

// SAFETY: plain `repr(C)` data of the layout the kernels declare, passed by value.
unsafe impl DeviceRepr for Segments {}
unsafe impl DeviceRepr for QSegments {}
unsafe impl DeviceRepr for RopeInto {}
unsafe impl DeviceRepr for OInto {}

/// The output projection done by the cluster attention kernel (`decode.cu`'s `OInto`).
#[repr(C)]
#[derive(Clone, Copy)]
pub(super) struct OInto {
    pub(super) w: u64,
    pub(super) partial: u64,
    pub(super) count: u64,
    pub(super) y: u64,
    pub(super) hidden: i32,
    pub(super) ld: i32,
}

/// Rope and the KV append done by the q/k/v projection (`decode.cu`'s `RopeInto`).
#[repr(C)]
#[derive(Clone, Copy)]
pub(super) struct RopeInto {
    pub(super) inv_freq: u64,
    pub(super) pos: u64,
    pub(super) k_cache: u64,
    pub(super) v_cache: u64,
    pub(super) nh: i32,
    pub(super) nkv: i32,
    pub(super) hd: i32,
    pub(super) cap: i32,
    pub(super) interleaved: i32,
}

pub(super) struct Kernels {
    pub(super) rmsnorm: CudaFunction,
    pub(super) quantize: CudaFunction,
    pub(super) matvec_bf16: CudaFunction,
    /// Two rows a team (`decode.cu`'s `matvec2_bf16`).
    pub(super) matvec2_bf16: CudaFunction,
    pub(super) matvec_quant: CudaFunction,
    /// The output projection with its weights staged in shared memory before the wait
    /// (`decode.cu`'s `matvec_staged_bf16`), for rows of up to 2,048 and 4,096 values.
    pub(super) matvec_staged: [CudaFunction; 2],
    pub(super) gate_up_bf16: CudaFunction,
    pub(super) qkv_rope_bf16: CudaFunction,
    pub(super) gate_up_quant: CudaFunction,
    pub(super) rope_append: CudaFunction,
    pub(super) attention: CudaFunction,
    pub(super) attn_merge: CudaFunction,
    /// Attention and its merge in one kernel of thread-block clusters (short contexts).
    pub(super) attention_cluster: CudaFunction,
    /// `attention_cluster` with the output projection and its residual in it.
    pub(super) attention_o_cluster: CudaFunction,
    pub(super) rope_append_batch: CudaFunction,
    pub(super) attention_batch: CudaFunction,
    pub(super) attn_merge_batch: CudaFunction,
    /// A chained greedy step's input: the embedding of the token the step before chose.
    pub(super) embed_token: CudaFunction,
    pub(super) argmax: CudaFunction,
}

impl Kernels {
    /// The kernels for a model whose KV heads each serve `group` query heads.
    pub(super) fn load(device: &candle_core::CudaDevice, group: usize) -> Result<Self> {
        let f = |name: &str| -> Result<CudaFunction> {
            Ok(device
                .get_or_load_custom_func(name, MODULE, PTX)?
                .into_cuda_function())
        };
        // The bf16 mat-vecs with their first weight loads after the wait for the kernel
        // ahead, not before (`decode.cu`'s `preload`), or held to 64 registers a thread
        // (`_lb`: more blocks an SM), to compare.
        let variant = if std::env::var("SHOAL_GPU_LATE").as_deref() == Ok("1") {
            "_late"
        } else if std::env::var("SHOAL_GPU_LEAN").as_deref() == Ok("1") {
            "_lb"
        } else {
            ""
        };
        // The attention compiled for this group size; to compare, the one kernel that
        // switches on the group at run time (`SHOAL_GPU_ATTN=dispatch`), or that kernel
        // taking one key a warp at a time instead of `decode.cu`'s KEYS (`SHOAL_GPU_KEYS=1`).
        let attention = if std::env::var("SHOAL_GPU_KEYS").as_deref() == Ok("1") {
            "shoal_attention_keys1".to_string()
        } else if std::env::var("SHOAL_GPU_ATTN").as_deref() == Ok("dispatch") {
            "shoal_attention".to_string()
        } else {
            format!("shoal_attention_g{}", group.clamp(1, 8))
        };
        Ok(Self {
            rmsnorm: f("shoal_rmsnorm")?,
            quantize: f("shoal_quantize_q8")?,
            matvec_bf16: f(&format!("shoal_matvec_bf16{variant}"))?,
            matvec2_bf16: f(&format!("shoal_matvec2_bf16{variant}"))?,
            matvec_quant: f("shoal_matvec_quant")?,
            matvec_staged: [
                f("shoal_matvec_staged_bf16_j1")?,
                f("shoal_matvec_staged_bf16_j2")?,
            ],
            gate_up_bf16: f(&format!("shoal_gate_up_bf16{variant}"))?,
            qkv_rope_bf16: f(&format!("shoal_qkv_rope_bf16{variant}"))?,
            gate_up_quant: f("shoal_gate_up_quant")?,
            rope_append: f("shoal_rope_append")?,
            attention: f(&attention)?,
            attn_merge: f("shoal_attn_merge")?,
            attention_cluster: f(&format!("shoal_attention_cluster_g{}", group.clamp(1, 8)))?,
            attention_o_cluster: f(&format!("shoal_attention_o_cluster_g{}", group.clamp(1, 8)))?,
            rope_append_batch: f("shoal_rope_append_batch")?,
            attention_batch: f(&format!("shoal_attention_batch_g{}", group.clamp(1, 8)))?,
            attn_merge_batch: f("shoal_attn_merge_batch")?,
            embed_token: f("shoal_embed_token")?,
            argmax: f("shoal_argmax")?,
        })
    }
}

pub(super) fn cfg(grid: (u32, u32), block: u32, shared: u32) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (grid.0, grid.1, 1),
        block_dim: (block, 1, 1),
        shared_mem_bytes: shared,
    }
}

/// A mat-vec's launch: `teams` output rows (or pairs of rows) of `split` warps each,
/// MATVEC_WARPS a block, or one team a block where a team is wider.
pub(super) fn matvec_cfg(teams: i32, split: i32) -> LaunchConfig {
    let warps = MATVEC_WARPS.max(split as u32);
    let grid = (teams as u32).div_ceil(warps / split as u32);
    cfg((grid, 1), warps * 32, 0)
}

/// Bytes of shared memory the attention kernel's block of `warps` takes (its warps'
/// partial sums for the group's heads, then their maxima and totals).
pub(super) fn attention_shared(warps: u32, group: i32, hd: i32) -> u32 {
    let warps = warps as i32;
    (4 * (warps * group * hd + 2 * warps * group)) as u32
}

/// Bytes of shared memory `shoal_attention_cluster`'s block takes: the attention
/// kernel's, then the block's merged partial (the group's values, max and sum).
pub(super) fn attention_cluster_shared(warps: u32, group: i32, hd: i32) -> u32 {
    attention_shared(warps, group, hd) + (4 * (group * hd + 2 * group)) as u32
}

/// Bytes of shared memory `shoal_attention_o_cluster`'s block takes: the cluster
/// kernel's, then the group's values the block merged.
pub(super) fn attention_o_cluster_shared(warps: u32, group: i32, hd: i32) -> u32 {
    attention_cluster_shared(warps, group, hd) + (4 * group * hd) as u32
}

/// Splits of the context for the attention kernel (`decode.cu`'s `attn_chunk`: at least
/// 32 positions each, so a short context uses only the first few): as many as the GPU
/// holds blocks of it at once over the KV heads, so that a long context is one wave of
/// blocks each walking a longer run, not several waves each paying the block's start and
/// its partial's write, and the merge reads fewer partials (64 splits of an 8B model's 8
/// KV heads were two waves, and 64 partials a query head to merge). At most the model's
/// context / 64 and `decode.cu`'s MAX_SPLITS; `SHOAL_GPU_ATTN_SPLITS` sets it, to compare.
pub(super) fn attention_splits(
    attention: &CudaFunction,
    stream: &CudaStream,
    max_len: usize,
    nkv: usize,
    group: usize,
    hd: usize,
    warps: u32,
) -> std::result::Result<usize, String> {
    let most = max_len.div_ceil(64).clamp(1, 64);
    if let Some(n) = std::env::var("SHOAL_GPU_ATTN_SPLITS")
        .ok()
        .and_then(|v| v.parse::<usize>().ok())
        .filter(|n| (1..=64).contains(n))
    {
        return Ok(n);
    }
    let shared = attention_shared(warps, group as i32, hd as i32) as usize;
    let per_sm = attention
        .occupancy_max_active_blocks_per_multiprocessor(warps * 32, shared, None)
        .map_err(|e| e.to_string())?;
    let sms = stream
        .context()
        .attribute(cu::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
        .map_err(|e| e.to_string())?;
    let resident = (per_sm as usize * sms.max(1) as usize / nkv.max(1)).max(1);
    Ok(most.min(resident))
}

/// Threads a block of `shoal_matvec_staged_bf16` (`decode.cu`'s STAGED_THREADS), rows it
/// reads into registers and rows it owns at most.
pub(super) const STAGED_THREADS: i32 = 256;
const STAGED_MAX_LOADED: i32 = 8;
const STAGED_MAX_ROWS: i32 = 64;

/// How `shoal_matvec_staged_bf16` runs a matrix: one block an SM, the rows of each it
/// stages in shared memory, and the kernel (by pieces a thread a row).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct StagedShape {
    pub(super) blocks: u32,
    pub(super) staged: i32,
    /// Index into `Kernels::matvec_staged`.
    pub(super) kernel: usize,
}

impl StagedShape {
    pub(super) fn shared_bytes(&self, k: i32) -> u32 {
        (self.staged * k * 2) as u32
    }
}

/// The staged shape for a bf16 matrix of `rows` rows of `k` on a GPU of `sms` SMs whose
/// SM holds `sm_shared` bytes of shared memory (a block at most `block_shared`), beside
/// a block of the attention kernel taking `beside` bytes: as many rows a block staged
/// as fit there (so the projection's blocks are resident, and their copies streaming,
/// while the attention runs), the rest of its run in registers. None where the rows
/// are too long or a block's run too long for the kernel.
pub(super) fn staged_shape(
    rows: i32,
    k: i32,
    sms: i32,
    sm_shared: i32,
    block_shared: i32,
    beside: i32,
) -> Option<StagedShape> {
    let kernel = match k / 8 {
        n if k % 8 != 0 || n == 0 => return None,
        n if n <= STAGED_THREADS => 0,
        n if n <= 2 * STAGED_THREADS => 1,
        _ => return None,
    };
    let blocks = sms.max(1);
    let most = (rows + blocks - 1) / blocks;
    // Each block also keeps 1 KB for the system and ~2 KB of its own sums.
    let room = (sm_shared - beside - 8192).min(block_shared - 4096);
    let staged = most.min(room.max(0) / (2 * k));
    (most <= STAGED_MAX_ROWS && most - staged <= STAGED_MAX_LOADED).then_some(StagedShape {
        blocks: blocks as u32,
        staged,
        kernel,
    })
}

/// `staged_shape` for a matrix of `rows` rows of `k` on this GPU, beside an attention
/// block of `beside` bytes of shared memory, with the kernel's shared memory allowed;
/// None where the kernel does not take it or the GPU refuses the size.
pub(super) fn staged_for(
    kernels: &[CudaFunction; 2],
    stream: &CudaStream,
    rows: i32,
    k: i32,
    beside: u32,
) -> Option<StagedShape> {
    use cu::CUdevice_attribute as A;
    let ctx = stream.context();
    let attr = |a| ctx.attribute(a).ok();
    let shape = staged_shape(
        rows,
        k,
        attr(A::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)?,
        attr(A::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_MULTIPROCESSOR)?,
        attr(A::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)?,
        beside as i32,
    )?;
    set_attribute(
        &kernels[shape.kernel],
        cu::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
        shape.shared_bytes(k) as i32,
    )
    .then_some(shape)
}

/// Sets one of kernel `f`'s attributes; false where the driver refuses it.
fn set_attribute(f: &CudaFunction, attribute: cu::CUfunction_attribute, value: i32) -> bool {
    // SAFETY: `f` is a loaded kernel of this context; the attributes it is given are plain
    // ints.
    unsafe { cu::cuFuncSetAttribute(f.cu_function(), attribute, value) }
        .result()
        .is_ok()
}

impl Kernels {
    /// Asks every kernel of the single-token step to run with the SM's shared memory at
    /// its largest (`CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT`): an SM changes
    /// its split of L1 and shared memory only once drained, so a kernel that needs most
    /// of it (the staged output projection) could not otherwise start its blocks beside
    /// the attention that runs under a smaller split.
    pub(super) fn prefer_shared(&self) {
        let all = [
            &self.rmsnorm,
            &self.quantize,
            &self.matvec_bf16,
            &self.matvec2_bf16,
            &self.matvec_quant,
            &self.matvec_staged[0],
            &self.matvec_staged[1],
            &self.gate_up_bf16,
            &self.qkv_rope_bf16,
            &self.gate_up_quant,
            &self.rope_append,
            &self.attention,
            &self.attn_merge,
            &self.attention_cluster,
            &self.attention_o_cluster,
            &self.embed_token,
            &self.argmax,
        ];
        for f in all {
            // A percentage; a refusal only leaves the driver's choice.
            set_attribute(
                f,
                cu::CUfunction_attribute::CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT,
                100,
            );
        }
    }
}

/// Values of a row each thread of the RMSNorm kernel holds at most (`decode.cu`'s
/// NORM_MAX).
pub(super) const NORM_MAX: i32 = 8;

/// Threads of the RMSNorm kernel's one block for a row of `n`: four values each (whole
/// warps), at most 1024.
pub(super) fn norm_threads(n: i32) -> u32 {
    ((n.max(1) as u32).div_ceil(4).div_ceil(32)).clamp(1, 32) * 32
}

/// Warps that share one output row. A team of four warps a row reads each row as the
/// block's contiguous run: on the llama-8B shape's matrices alone 3.3-4.1 TB/s against
/// 2.6-3.9 for a warp a row (scripts/gpu-matvec-bench.cu, one H200). Rows shorter than 2,048
/// keep the rule measured before on the 1.5b shape (1536-2048 rows: 496 -> 552 tok/s
/// with 4 warps a row below 2,048 rows, 2 below 4,096).
/// Quantized rows keep that rule at every length. Long dense rows in a matrix of many
/// (llama-8B's down projection: 2,048 teams of two rows of 14,336) take 8 warps: inside
/// the replayed graph on one H100 183.8 tok/s against 181.2 with 4 (`SHOAL_GPU_SPLIT=
/// down:8`), where 8 for q/k/v or o, or 2 for any of them, was slower; the 1.5b shape's
/// down (768 teams of rows of 8,960) was slower with 8 (612 against 619), hence the
/// teams bound.
pub(super) fn split_for(rows: i32, k: i32, quant: bool) -> i32 {
    match rows {
        r if k >= 8192 && r >= 2048 && !quant => 8,
        _ if k >= 2048 && !quant => 4,
        r if r < 2048 => 4,
        r if r < 4096 => 2,
        _ => 1,
    }
}

/// A kernel argument of any of the types the kernels take (`decode.cu`'s and
/// `prefill.cu`'s).
pub(in crate::transformer) trait Arg {
    fn push<'a>(&'a self, builder: &mut candle_core::cuda_backend::cudarc::driver::LaunchArgs<'a>);
    /// The argument's address, as `cuLaunchKernelEx` takes it.
    fn param(&self) -> *mut std::ffi::c_void;
}

impl<T: DeviceRepr> Arg for T {
    fn push<'a>(&'a self, builder: &mut candle_core::cuda_backend::cudarc::driver::LaunchArgs<'a>) {
        builder.arg(self);
    }

    fn param(&self) -> *mut std::ffi::c_void {
        self as *const T as *mut std::ffi::c_void
    }
}

/// Blocks of a cluster of `shoal_attention_cluster` (one cluster a KV head, one block a
/// split): 16 where the GPU schedules clusters that large (Hopper, as a non-portable
/// size), else the portable 8; 0 where it schedules none (before Hopper), so the two-kernel
/// path runs. `SHOAL_GPU_ATTN_CLUSTER` sets it (0 turns the cluster path off), to compare.
pub(super) fn attention_cluster_blocks(
    f: &CudaFunction,
    stream: &CudaStream,
    warps: u32,
    shared: u32,
) -> u32 {
    let asked = std::env::var("SHOAL_GPU_ATTN_CLUSTER")
        .ok()
        .and_then(|v| v.parse::<u32>().ok());
    if asked == Some(0) {
        return 0;
    }
    let fits = |blocks: u32| -> bool {
        use cu::CUfunction_attribute as A;
        if blocks > 8
            && !set_attribute(f, A::CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED, 1)
        {
            return false;
        }
        if !set_attribute(
            f,
            A::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
            shared as i32,
        ) {
            return false;
        }
        let func = f.cu_function();
        let mut attr = cluster_attr(blocks);
        let config = cu::CUlaunchConfig {
            gridDimX: 1,
            gridDimY: blocks,
            gridDimZ: 1,
            blockDimX: warps * 32,
            blockDimY: 1,
            blockDimZ: 1,
            sharedMemBytes: shared,
            hStream: stream.cu_stream(),
            attrs: &mut attr,
            numAttrs: 1,
        };
        let mut clusters = 0;
        // SAFETY: `config` and its one attribute outlive the call.
        let ok = unsafe { cu::cuOccupancyMaxActiveClusters(&mut clusters, func, &config) }
            .result()
            .is_ok();
        ok && clusters > 0
    };
    let wanted = asked.map_or(vec![16, 8], |n| vec![n.clamp(1, 16)]);
    wanted.into_iter().find(|&b| fits(b)).unwrap_or(0)
}

/// The launch attribute that groups a grid's y dimension into clusters of `blocks`.
pub(super) fn cluster_attr(blocks: u32) -> cu::CUlaunchAttribute {
    // SAFETY: a zeroed attribute is a valid plain C struct; the union member set is the
    // one the attribute id names.
    let mut attr: cu::CUlaunchAttribute = unsafe { std::mem::zeroed() };
    attr.id = cu::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION;
    attr.value.clusterDim.x = 1;
    attr.value.clusterDim.y = blocks;
    attr.value.clusterDim.z = 1;
    attr
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_staged_output_projection_fills_shared_memory_beside_the_attention() {
        // llama-8B's o on an H100: 132 SMs, 228 KB an SM, 227 KB a block, the cluster
        // attention's ~18.6 KB beside it: 25 of a block's 32 rows staged.
        let o = staged_shape(4096, 4096, 132, 233_472, 232_448, 19_008).unwrap();
        assert_eq!((o.blocks, o.staged, o.kernel), (132, 25, 1));
        assert!(o.shared_bytes(4096) as i32 + 19_008 + 8192 <= 233_472);
        // qwen2.5-1.5b's o: 12 rows of 3 KB a block, all staged.
        let small = staged_shape(1536, 1536, 132, 233_472, 232_448, 19_008).unwrap();
        assert_eq!((small.staged, small.kernel), (12, 0));
        // Rows past 4,096 values, or runs that leave more than 8 rows to registers: none.
        assert_eq!(
            staged_shape(4096, 14336, 132, 233_472, 232_448, 19_008),
            None
        );
        assert_eq!(
            staged_shape(8192, 4096, 132, 233_472, 232_448, 19_008),
            None
        );
        assert_eq!(
            staged_shape(4096, 4100, 132, 233_472, 232_448, 19_008),
            None
        );
    }

    #[test]
    fn warps_a_row_by_the_matrix_shape() {
        // llama-8B bf16, teams of two rows: down, o, q/k/v, gate/up.
        assert_eq!(split_for(2048, 14336, false), 8);
        assert_eq!(split_for(2048, 4096, false), 4);
        assert_eq!(split_for(3072, 4096, false), 4);
        assert_eq!(split_for(14336, 4096, false), 4);
        // qwen2.5-1.5b's down: long rows, few teams.
        assert_eq!(split_for(768, 8960, false), 4);
        // Quantized rows by row count alone.
        assert_eq!(split_for(4096, 14336, true), 1);
        assert_eq!(split_for(3000, 14336, true), 2);
        assert_eq!(split_for(1536, 8960, true), 4);
    }
}
