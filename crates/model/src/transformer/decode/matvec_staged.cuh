// A dense mat-vec whose weights land in shared memory before the kernel waits for the
// one ahead: the output projection after the attention.
// Part of decode.cu's one translation unit, included there in order: it uses what
// the parts before it define.
//
// Why: the attention is latency, not bytes, so the DRAM idles while it runs, and the
// output projection that follows streamed its 32 MB (llama-8B) only after it, at 2.2
// TB/s inside the graph against gate/up's 3.0 (ramp and drain a layer). Here one block
// an SM owns a contiguous run of rows; its first thread asks the copy engine (Hopper's
// cp.async.bulk, no registers held) for as many whole rows as its shared memory takes,
// and every thread loads its pieces of the rest into registers, all before
// `begin_step`: the weights stream while the attention runs, and what is left after it
// is the dot products out of shared memory.

#pragma once

#define STAGED_THREADS 256
#define STAGED_WARPS (STAGED_THREADS / WARP)
// Rows a block reads into registers (the rest of its run is staged in shared memory).
#define STAGED_MAX_LOADED 8
// Rows a block owns at most (its per-warp sums are kept in shared memory).
#define STAGED_MAX_ROWS 64

// One mbarrier: thread 0 sets it to expect `bytes` and asks for `rows` rows of `row_bytes`
// from `src` (rows consecutive in global memory) into `dst`.
__device__ __forceinline__ void stage_rows(unsigned long long* bar, uint4* dst,
                                           const uint4* src, int rows, unsigned row_bytes) {
#if __CUDA_ARCH__ >= 900
    const unsigned b = smem_addr(bar);
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(b) : "memory");
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(b),
                 "r"(rows * row_bytes)
                 : "memory");
    const int n16 = row_bytes / 16;
    for (int r = 0; r < rows; r++)
        asm volatile(
            "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, "
            "[%3];" ::"r"(smem_addr(dst + (size_t)r * n16)),
            "l"(src + (size_t)r * n16), "r"(row_bytes), "r"(b)
            : "memory");
#endif
}

// Waits until the copies stage_rows asked for have landed (the barrier's first phase).
__device__ __forceinline__ void staged_wait(unsigned long long* bar) {
#if __CUDA_ARCH__ >= 900
    asm volatile(
        "{\n\t.reg .pred p;\n\t"
        "WAIT:\n\t"
        "mbarrier.try_wait.parity.shared::cta.b64 p, [%0], 0;\n\t"
        "@!p bra WAIT;\n\t}" ::"r"(smem_addr(bar))
        : "memory");
#endif
}

// y = W x + residual for block b's rows [b * rows / blocks, (b + 1) * rows / blocks) of a
// bf16 W (rows of k, k / 8 <= J * STAGED_THREADS): the first `staged_max` of them through
// shared memory, the rest (at most STAGED_MAX_LOADED) through registers. Thread t takes
// pieces t, t + STAGED_THREADS, ... of every row; each row's sum is its warps' sums added
// in warp order, so a replay and an eager run agree bit for bit.
template <int J>
__device__ __forceinline__ void matvec_staged_bf16(const bf16* __restrict__ w,
                                                   const float* __restrict__ x,
                                                   const float* __restrict__ residual,
                                                   float* __restrict__ y, int rows, int k,
                                                   int staged_max) {
    extern __shared__ __align__(128) uint4 staged[];
    __shared__ __align__(8) unsigned long long bar;
    __shared__ float sums[STAGED_WARPS][STAGED_MAX_ROWS];
    const int n8 = k / 8;
    const int row0 = (int)((long long)blockIdx.x * rows / gridDim.x);
    const int own = (int)((long long)(blockIdx.x + 1) * rows / gridDim.x) - row0;
    const int ns = min(own, staged_max);
    const uint4* wr = reinterpret_cast<const uint4*>(w + (size_t)row0 * k);
    if (threadIdx.x == 0 && ns > 0) stage_rows(&bar, staged, wr, ns, (unsigned)n8 * 16);
    uint4 v[STAGED_MAX_LOADED][J];
#pragma unroll
    for (int s = 0; s < STAGED_MAX_LOADED; s++)
#pragma unroll
        for (int j = 0; j < J; j++) {
            const int p = threadIdx.x + j * STAGED_THREADS;
            v[s][j] = ns + s < own && p < n8 ? __ldcs(wr + (size_t)(ns + s) * n8 + p)
                                             : make_uint4(0, 0, 0, 0);
        }
    // Every thread waits on the barrier below only after thread 0 has set it up.
    __syncthreads();
    begin_step();
    float xs[J][8];
#pragma unroll
    for (int j = 0; j < J; j++) {
        const int p = threadIdx.x + j * STAGED_THREADS;
#pragma unroll
        for (int e = 0; e < 8; e++) xs[j][e] = p < n8 ? x[8 * p + e] : 0.f;
    }
    const int warp = threadIdx.x / WARP, lane = threadIdx.x % WARP;
#pragma unroll
    for (int s = 0; s < STAGED_MAX_LOADED; s++) {
        if (ns + s >= own) break;
        float d = 0.f;
#pragma unroll
        for (int j = 0; j < J; j++) d += dot8x(v[s][j], xs[j]);
        d = warp_sum(d);
        if (lane == 0) sums[warp][ns + s] = d;
    }
    if (ns > 0) staged_wait(&bar);
#pragma unroll 4
    for (int r = 0; r < ns; r++) {
        float d = 0.f;
#pragma unroll
        for (int j = 0; j < J; j++) {
            const int p = threadIdx.x + j * STAGED_THREADS;
            if (p < n8) d += dot8x(staged[(size_t)r * n8 + p], xs[j]);
        }
        d = warp_sum(d);
        if (lane == 0) sums[warp][r] = d;
    }
    __syncthreads();
    for (int r = threadIdx.x; r < own; r += STAGED_THREADS) {
        float t = 0.f;
#pragma unroll
        for (int q = 0; q < STAGED_WARPS; q++) t += sums[q][r];
        if (residual) t += residual[row0 + r];
        y[row0 + r] = t;
    }
}

#define MATVEC_STAGED_BF16(J)                                                                \
    extern "C" __global__ void __launch_bounds__(STAGED_THREADS, 2) shoal_matvec_staged_bf16_j##J( \
        const bf16* __restrict__ w, const float* __restrict__ x,                             \
        const float* __restrict__ residual, float* __restrict__ y, int rows, int k,          \
        int staged_max) {                                                                    \
        matvec_staged_bf16<J>(w, x, residual, y, rows, k, staged_max);                       \
    }
MATVEC_STAGED_BF16(1)
MATVEC_STAGED_BF16(2)
#undef MATVEC_STAGED_BF16
