// One token's decode step on an NVIDIA GPU, as few kernels as the step needs, each
// reading its dynamic inputs (the position) from device memory so that the whole step
// can be captured once as a CUDA graph and replayed (transformer/gpu_decode.rs).
//
// Activations are f32 (one row: cheap to keep exact); weights are bf16 rows or GGUF
// blocks (Q8_0, Q4_K, Q6_K) read directly; the KV cache is bf16 in the layout candle's
// path keeps, (kv_heads, capacity, head_dim) per layer, so both paths share one cache.
#include "decode/common.cuh"

// ---------------------------------------------------------------------------------------
// RMSNorm of one row: out = x / rms(x) * w. One block of a multiple of 32 threads, each
// holding NORM_MAX values at most (n <= NORM_MAX * blockDim.x, n a multiple of 32). Also
// writes the row quantized to 8 bits in blocks of 32 (scale, sum) for the quantized
// mat-vecs when `q` is not null. The row stays in registers from the first read to the
// last write: thread t holds elements t, t + blockDim.x, ..., so each warp holds whole
// blocks of 32 and quantizes them where they are (reading the normed row back from memory
// cost a dependent round trip per block of the warp's: 7.4 us a norm on llama-8B).
#define NORM_MAX 8
extern "C" __global__ void shoal_rmsnorm(const float* __restrict__ x, const bf16* __restrict__ w,
                                         float* __restrict__ out, int n, float eps,
                                         int8_t* __restrict__ q, float2* __restrict__ qd) {
    begin_step();
    float v[NORM_MAX], wv[NORM_MAX];
    float ss = 0.f;
#pragma unroll
    for (int j = 0; j < NORM_MAX; j++) {
        const int i = threadIdx.x + j * blockDim.x;
        v[j] = i < n ? x[i] : 0.f;
        wv[j] = i < n ? __bfloat162float(w[i]) : 0.f;
        ss += v[j] * v[j];
    }
    ss = block_sum(ss);
    const float inv = rsqrtf(ss / n + eps);
    const int lane = threadIdx.x % WARP;
#pragma unroll
    for (int j = 0; j < NORM_MAX; j++) {
        const int i = threadIdx.x + j * blockDim.x;
        // The same for the whole warp (blockDim.x and n are multiples of 32).
        if (i - lane >= n) break;
        const float o = v[j] * inv * wv[j];
        out[i] = o;
        if (q != nullptr) quantize_warp(o, i / WARP, q, qd);
    }
}

// The same 8-bit blocks of any row (the attention output, the FFN's product).
extern "C" __global__ void shoal_quantize_q8(const float* __restrict__ x, int n,
                                             int8_t* __restrict__ q, float2* __restrict__ qd) {
    begin_step();
    const int lane = threadIdx.x % WARP;
    const int b = blockIdx.x * (blockDim.x / WARP) + threadIdx.x / WARP;
    if (b >= n / 32) return;
    quantize_warp(x[b * 32 + lane], b, q, qd);
}

#include "decode/matvec.cuh"
#include "decode/matvec_staged.cuh"
#include "decode/matvec_quant.cuh"
#include "decode/rope.cuh"
#include "decode/attention.cuh"
#include "decode/attention_cluster.cuh"

// ---------------------------------------------------------------------------------------
// The arg-max of each row of logits (`n` f32 values a row, rows `stride` apart; block b
// takes row b): the first index on ties, as the host's `sampling::argmax`; NaN never wins.
// One id a row comes back. candle's generic reduction walked a 128k vocabulary with one
// dependent load at a time in one block and copied its shape to the device first, each a
// greedy token's host round trip; here each thread has 8 16-byte loads in flight.
#define ARGMAX_UNROLL 8

__device__ __forceinline__ void keep_better(float* v, int* i, float ov, int oi) {
    if (ov > *v || (ov == *v && oi < *i)) {
        *v = ov;
        *i = oi;
    }
}

__device__ __forceinline__ void warp_argmax(float* v, int* i) {
#pragma unroll
    for (int o = WARP / 2; o > 0; o >>= 1) {
        const float ov = __shfl_down_sync(0xffffffffu, *v, o);
        const int oi = __shfl_down_sync(0xffffffffu, *i, o);
        keep_better(v, i, ov, oi);
    }
}

extern "C" __global__ void shoal_argmax(const float* __restrict__ x, int n, long long stride,
                                        unsigned int* __restrict__ out) {
    const float* row = x + (size_t)blockIdx.x * stride;
    float v = -INFINITY;
    int i = 0x7fffffff;
    const int n4 = reinterpret_cast<uintptr_t>(row) % 16 == 0 ? n / 4 : 0;
    const float4* r4 = reinterpret_cast<const float4*>(row);
    for (int base = threadIdx.x; base < n4; base += ARGMAX_UNROLL * blockDim.x) {
        float4 f[ARGMAX_UNROLL];
#pragma unroll
        for (int u = 0; u < ARGMAX_UNROLL; u++) {
            const int j = base + u * blockDim.x;
            if (j < n4) f[u] = __ldg(r4 + j);
        }
#pragma unroll
        for (int u = 0; u < ARGMAX_UNROLL; u++) {
            const int j = base + u * blockDim.x;
            if (j < n4) {
                keep_better(&v, &i, f[u].x, 4 * j);
                keep_better(&v, &i, f[u].y, 4 * j + 1);
                keep_better(&v, &i, f[u].z, 4 * j + 2);
                keep_better(&v, &i, f[u].w, 4 * j + 3);
            }
        }
    }
    for (int j = 4 * n4 + threadIdx.x; j < n; j += blockDim.x) keep_better(&v, &i, row[j], j);
    warp_argmax(&v, &i);
    __shared__ float best_v[WARP];
    __shared__ int best_i[WARP];
    const int warp = threadIdx.x / WARP, lane = threadIdx.x % WARP;
    if (lane == 0) {
        best_v[warp] = v;
        best_i[warp] = i;
    }
    __syncthreads();
    if (warp != 0) return;
    const bool held = lane < (int)(blockDim.x / WARP);
    v = held ? best_v[lane] : -INFINITY;
    i = held ? best_i[lane] : 0x7fffffff;
    warp_argmax(&v, &i);
    if (lane == 0) out[blockIdx.x] = i == 0x7fffffff ? 0u : (unsigned int)i;
}

// ---------------------------------------------------------------------------------------
// Greedy decoding fed by the device (gpu_decode/chain.rs): a chained step's input row is
// the embedding of the token the step before it wrote (`shoal_argmax` into `token`), and
// its position one past that step's, so the host can queue the next step before it has
// read the last token back. `table` holds the vocabulary's rows, bf16 where `bf16_rows`,
// else f32. Thread 0 moves the position on: nothing in this kernel reads it, and the
// step's kernels after it read it only once this one has finished (`begin_step`).
extern "C" __global__ void shoal_embed_token(const void* __restrict__ table, int bf16_rows,
                                             const unsigned int* __restrict__ token,
                                             int* __restrict__ pos, float* __restrict__ x,
                                             int hidden) {
    const size_t row = (size_t)*token * hidden;
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < hidden; i += gridDim.x * blockDim.x)
        x[i] = bf16_rows ? __bfloat162float(static_cast<const bf16*>(table)[row + i])
                         : static_cast<const float*>(table)[row + i];
    if (blockIdx.x == 0 && threadIdx.x == 0) *pos += 1;
}
