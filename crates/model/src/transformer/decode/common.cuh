// decode.cu's shared pieces: types, warp and block sums, 8-bit rows, programmatic
// dependent launch, L2 prefetches.
// Part of decode.cu's one translation unit, included there in order: it uses what
// the parts before it define.

#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

typedef __nv_bfloat16 bf16;

#define WARP 32
#define MAX_GROUP 8   // query heads per KV head the attention kernel holds in registers
#define MAX_LANE 4    // head_dim / 32 values per lane (head_dim <= 128)
#define KEYS 4        // keys a warp of the attention kernel loads at a time (by default)

// F(g) with g the compile-time constant equal to `group` (1..MAX_GROUP).
#define BY_GROUP(group, F)    \
    switch (group) {          \
        case 1: F(1); break;  \
        case 2: F(2); break;  \
        case 3: F(3); break;  \
        case 4: F(4); break;  \
        case 5: F(5); break;  \
        case 6: F(6); break;  \
        case 7: F(7); break;  \
        default: F(8); break; \
    }

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffff, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffff, v, o));
    return v;
}

// Sum over a block of up to 1024 threads; every thread gets the total.
__device__ float block_sum(float v) {
    __shared__ float partial[32];
    __shared__ float total;
    v = warp_sum(v);
    const int lane = threadIdx.x % WARP, warp = threadIdx.x / WARP;
    if (lane == 0) partial[warp] = v;
    __syncthreads();
    if (warp == 0) {
        const int warps = (blockDim.x + WARP - 1) / WARP;
        float s = lane < warps ? partial[lane] : 0.f;
        s = warp_sum(s);
        if (lane == 0) total = s;
    }
    __syncthreads();
    return total;
}

// Lane i of a warp holds value i of 8-bit block b (32 values): writes the block's int8
// values to q and (scale, scale * sum of the int8 values) to qd[b].
__device__ __forceinline__ void quantize_warp(float v, int b, int8_t* __restrict__ q,
                                              float2* __restrict__ qd) {
    const int lane = threadIdx.x % WARP;
    const float amax = warp_max(fabsf(v));
    const float d = amax / 127.f;
    const int8_t qi = d == 0.f ? 0 : (int8_t)__float2int_rn(v / d);
    q[b * 32 + lane] = qi;
    const float s = warp_sum((float)qi);
    if (lane == 0) qd[b] = make_float2(d, s * d);
}

// Programmatic dependent launch (Hopper): gpu_decode.rs launches every kernel of a step
// but the first so that its blocks may become resident while the kernel ahead of it
// finishes, which hides the launch gap between the ~10 kernels a layer (the small models'
// fixed cost). `begin_step` holds a kernel until the one ahead has finished and its writes
// are visible, then lets the kernel behind it start its blocks. Everything a kernel reads or
// writes of the step's buffers comes after it; only weights are touched before (prefetched
// into L2). Without such a launch both instructions return at once.
__device__ __forceinline__ void begin_step() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;" :::);
#endif
}

// The shared-memory address (as PTX's shared-state spaces take it) of `p`, a pointer into
// this block's shared memory.
__device__ __forceinline__ unsigned smem_addr(const void* p) {
    return static_cast<unsigned>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void prefetch_l2(const void* p) {
    asm volatile("prefetch.global.L2 [%0];" ::"l"(p));
}

// The first lines of a row the warp's group reads (up to 8 KB a warp), into L2 before
// `begin_step`: the weights' DRAM latency overlaps the kernel ahead.
__device__ __forceinline__ void prefetch_row(const void* row, size_t bytes, int part, int split) {
    const uint8_t* p = static_cast<const uint8_t*>(row);
    const int lane = threadIdx.x % WARP;
#pragma unroll
    for (int t = 0; t < 2; t++) {
        const size_t line = (size_t)(part * WARP + lane) + (size_t)t * WARP * split;
        if (line * 128 < bytes) prefetch_l2(p + line * 128);
    }
}
