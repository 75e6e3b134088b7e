// One token's decode step on an NVIDIA GPU, as few kernels as the step needs, each
// reading its dynamic inputs (the position) from device memory so that the whole step
// can be captured once as a CUDA graph and replayed (transformer/gpu_decode.rs).
//
// Activations are f32 (one row: cheap to keep exact); weights are bf16 rows or GGUF
// blocks (Q8_0, Q4_K, Q6_K) read directly; the KV cache is bf16 in the layout candle's
// path keeps, (kv_heads, capacity, head_dim) per layer, so both paths share one cache.

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

// ---------------------------------------------------------------------------------------
// Mat-vec, bf16 rows. A team of warps per output row; each lane reads 16 bytes at a time.
// `k` is a multiple of 8. Up to three matrices stacked as one (q, k, v): row r of the
// output is row r of the first, then of the second, then of the third.

// A block's warps in groups of `split` per output row: warp j of a group takes every
// split-th 8-wide piece of the row from the j-th, and the group adds its sums in shared
// memory. Long rows over few outputs (the down projection) then still fill the GPU.
struct RowSlot {
    int row;    // the output row, or -1 past the end
    int part;   // this warp's index within its row's group
};

__device__ __forceinline__ RowSlot row_slot(int split) {
    const int warp = threadIdx.x / WARP;
    const int rows_per_block = (blockDim.x / WARP) / split;
    return {(int)blockIdx.x * rows_per_block + warp / split, warp % split};
}

// Adds the partials (a, b, c) of every warp of a row's group; the group's first warp gets
// the totals. Every thread of the block must call it.
__device__ __forceinline__ float3 group_sum(float a, float b, float c, int split) {
    a = warp_sum(a);
    b = warp_sum(b);
    c = warp_sum(c);
    if (split == 1) return make_float3(a, b, c);
    __shared__ float3 parts[32];
    const int warp = threadIdx.x / WARP, lane = threadIdx.x % WARP;
    if (lane == 0) parts[warp] = make_float3(a, b, c);
    __syncthreads();
    float3 t = make_float3(0.f, 0.f, 0.f);
    if (warp % split == 0)
        for (int j = 0; j < split; j++) {
            t.x += parts[warp + j].x;
            t.y += parts[warp + j].y;
            t.z += parts[warp + j].z;
        }
    return t;
}

// x's 8 values at 16-byte piece i of a row, times the norm's weights where `norm_w` is
// given; adds their squares to `ss` (for the RMSNorm folded into the product).
__device__ __forceinline__ void x8(const float* __restrict__ x, const bf16* __restrict__ norm_w,
                                   int i, float xs[8], float* ss) {
    const float4 a = *reinterpret_cast<const float4*>(x + 8 * i);
    const float4 b = *reinterpret_cast<const float4*>(x + 8 * i + 4);
    xs[0] = a.x; xs[1] = a.y; xs[2] = a.z; xs[3] = a.w;
    xs[4] = b.x; xs[5] = b.y; xs[6] = b.z; xs[7] = b.w;
    if (norm_w == nullptr) return;
    const uint4 n = __ldg(reinterpret_cast<const uint4*>(norm_w) + i);
    const __nv_bfloat162* np = reinterpret_cast<const __nv_bfloat162*>(&n);
#pragma unroll
    for (int e = 0; e < 4; e++) {
        const float2 f = __bfloat1622float2(np[e]);
        *ss += xs[2 * e] * xs[2 * e] + xs[2 * e + 1] * xs[2 * e + 1];
        xs[2 * e] *= f.x;
        xs[2 * e + 1] *= f.y;
    }
}

__device__ __forceinline__ float dot8x(uint4 w, const float xs[8]) {
    const __nv_bfloat162* p = reinterpret_cast<const __nv_bfloat162*>(&w);
    float acc = 0.f;
#pragma unroll
    for (int e = 0; e < 4; e++) {
        const float2 f = __bfloat1622float2(p[e]);
        acc += f.x * xs[2 * e] + f.y * xs[2 * e + 1];
    }
    return acc;
}

// NR rows' dot products with norm(x) by a team of `stride` threads, this one from piece
// `first`, and the sum of squares of the x it saw. The first PRE pieces a row are loaded
// by `preload` before the kernel waits for the one ahead of it (weights do not depend on
// it): the weight stream then runs on across the kernel boundary instead of starting
// from nothing after it. The rest go U pieces at a time, all U loads issued before the
// first is used (a plain loop let the compiler sink each load to its use: one or two
// 16-byte loads in flight a lane, ~3.2-3.4 TB/s on llama-8B's matrices; held in
// registers 3.6-4.1, scripts/gpu-matvec-bench.cu).
#define PRE 4
#define STREAM_U 4

template <int NR>
struct Preloaded {
    uint4 v[NR][PRE];
};

template <int NR>
__device__ __forceinline__ void preload(const uint4* const (&w)[NR], int n8, int first,
                                        int stride, Preloaded<NR>* pre) {
#pragma unroll
    for (int p = 0; p < PRE; p++) {
        const int i = first + p * stride;
#pragma unroll
        for (int r = 0; r < NR; r++)
            pre->v[r][p] = i < n8 ? __ldcs(w[r] + i) : make_uint4(0, 0, 0, 0);
    }
}

template <int NR>
__device__ __forceinline__ void rows_dot_bf16(const uint4* const (&w)[NR],
                                              const Preloaded<NR>& pre,
                                              const float* __restrict__ x,
                                              const bf16* __restrict__ norm_w, int n8,
                                              int first, int stride, float (&dot)[NR],
                                              float* ss) {
    float sq = 0.f;
#pragma unroll
    for (int r = 0; r < NR; r++) dot[r] = 0.f;
#pragma unroll
    for (int p = 0; p < PRE; p++) {
        const int i = first + p * stride;
        if (i < n8) {
            float xs[8];
            x8(x, norm_w, i, xs, &sq);
#pragma unroll
            for (int r = 0; r < NR; r++) dot[r] += dot8x(pre.v[r][p], xs);
        }
    }
    for (int base = first + PRE * stride; base < n8; base += STREAM_U * stride) {
        uint4 v[NR][STREAM_U];
#pragma unroll
        for (int u = 0; u < STREAM_U; u++) {
            const int i = base + u * stride;
#pragma unroll
            for (int r = 0; r < NR; r++)
                v[r][u] = i < n8 ? __ldcs(w[r] + i) : make_uint4(0, 0, 0, 0);
        }
#pragma unroll
        for (int u = 0; u < STREAM_U; u++) {
            const int i = base + u * stride;
            if (i < n8) {
                float xs[8];
                x8(x, norm_w, i, xs, &sq);
#pragma unroll
                for (int r = 0; r < NR; r++) dot[r] += dot8x(v[r][u], xs);
            }
        }
    }
    *ss = sq;
}

// A team's share of the NR rows' dot products with norm(x) (and of x's sum of squares),
// the step's wait for the kernel ahead between the first loads (EARLY) and the rest.
template <bool EARLY, int NR>
__device__ __forceinline__ void team_dot(const uint4* const (&w)[NR], int n8, RowSlot slot,
                                         int split, const float* __restrict__ x,
                                         const bf16* __restrict__ norm_w, float (&dot)[NR],
                                         float* ss) {
    const int first = threadIdx.x % WARP + WARP * slot.part, stride = WARP * split;
    Preloaded<NR> pre;
    if (EARLY) preload<NR>(w, n8, first, stride, &pre);
    begin_step();
    if (!EARLY) preload<NR>(w, n8, first, stride, &pre);
    rows_dot_bf16<NR>(w, pre, x, norm_w, n8, first, stride, dot, ss);
}

struct Segments {
    const bf16* w[3];
    const bf16* bias[3];
    int rows[3];
};

// Which of up to three stacked matrices output row r falls in, and its row there.
__device__ __forceinline__ int segment(const int rows[3], int* r) {
    if (*r < rows[0]) return 0;
    *r -= rows[0];
    if (*r < rows[1]) return 1;
    *r -= rows[1];
    if (*r < rows[2]) return 2;
    return 3;
}

// Output row r of [W0; W1; W2] (made its row within its matrix): the matrix, its bias,
// which one (3: past the end) and its 16-byte pieces a row (0 past the end: no loads).
// Picked without indexing the parameter arrays (which would copy them to local memory).
struct SegRow {
    const bf16* w;
    const bf16* bias;
    int s;
    int n8;
};

__device__ __forceinline__ SegRow seg_row(Segments seg, int* r, int k) {
    const int s = segment(seg.rows, r);
    return {s == 0 ? seg.w[0] : s == 1 ? seg.w[1] : seg.w[2],
            s == 0 ? seg.bias[0] : s == 1 ? seg.bias[1] : seg.bias[2], s, s < 3 ? k / 8 : 0};
}

// y = [W0; W1; W2] norm(x) (+ bias) (+ residual), norm(x) = x / rms(x) * norm_w where
// norm_w is given, else x. A team of `split` warps a row (row_slot).
template <bool EARLY>
__device__ __forceinline__ void matvec_bf16(Segments seg, const float* __restrict__ x,
                                            const bf16* __restrict__ norm_w, float eps,
                                            const float* __restrict__ residual,
                                            float* __restrict__ y, int k, int split) {
    const RowSlot slot = row_slot(split);
    int r = slot.row;
    const auto [w, bias, s, n8] = seg_row(seg, &r, k);
    const uint4* const rows[1] = {reinterpret_cast<const uint4*>(w + (size_t)r * k)};
    float dot[1], ss;
    team_dot<EARLY, 1>(rows, n8, slot, split, x, norm_w, dot, &ss);
    const float3 t = group_sum(dot[0], ss, 0.f, split);
    if (s < 3 && slot.part == 0 && threadIdx.x % WARP == 0) {
        float v = t.x;
        if (norm_w) v *= rsqrtf(t.y / k + eps);
        if (bias) v += __bfloat162float(bias[r]);
        if (residual) v += residual[slot.row];
        y[slot.row] = v;
    }
}

// matvec_bf16 with a team two adjacent output rows (2p, 2p + 1; every segment's rows even,
// so both lie in one matrix): twice the loads in flight a lane and half the blocks, each
// row's arithmetic as matvec_bf16's (the same pieces in the same order), so the same
// results. Short rows (q/k/v, o: 4,096) gain most: a team of one row read 8 KB and left.
template <bool EARLY>
__device__ __forceinline__ void matvec2_bf16(Segments seg, const float* __restrict__ x,
                                             const bf16* __restrict__ norm_w, float eps,
                                             const float* __restrict__ residual,
                                             float* __restrict__ y, int k, int split) {
    const RowSlot slot = row_slot(split);
    const int out = 2 * slot.row;
    int r = out;
    const auto [w, bias, s, n8] = seg_row(seg, &r, k);
    const uint4* const rows[2] = {reinterpret_cast<const uint4*>(w + (size_t)r * k),
                                  reinterpret_cast<const uint4*>(w + (size_t)(r + 1) * k)};
    float dot[2], ss;
    team_dot<EARLY, 2>(rows, n8, slot, split, x, norm_w, dot, &ss);
    const float3 t = group_sum(dot[0], dot[1], ss, split);
    if (s < 3 && slot.part == 0 && threadIdx.x % WARP == 0) {
        float a = t.x, b = t.y;
        if (norm_w) {
            const float inv = rsqrtf(t.z / k + eps);
            a *= inv;
            b *= inv;
        }
        if (bias) {
            a += __bfloat162float(bias[r]);
            b += __bfloat162float(bias[r + 1]);
        }
        if (residual) {
            a += residual[out];
            b += residual[out + 1];
        }
        y[out] = a;
        y[out + 1] = b;
    }
}

// The q/k/v projection, rope and the KV append as one kernel (bf16 rows, no q/k norms):
// a team takes the two rows rope turns together, (2j, 2j+1) of a head interleaved,
// (j, j + hd/2) otherwise, and rotates its pair itself; q goes to `qkv` in place of
// shoal_rope_append's, k and v to the cache at *pos.
struct RopeInto {
    const float* inv_freq;
    const int* pos;
    bf16* k_cache;
    bf16* v_cache;
    int nh, nkv, hd, cap, interleaved;
};

template <bool EARLY>
__device__ __forceinline__ void qkv_rope_bf16(Segments seg, const float* __restrict__ x,
                                              const bf16* __restrict__ norm_w, float eps,
                                              float* __restrict__ qkv, int k, int split,
                                              RopeInto rope) {
    const RowSlot slot = row_slot(split);
    const int half = rope.hd / 2;
    const int head = slot.row / half, j = slot.row % half;
    const int ra = head * rope.hd + (rope.interleaved ? 2 * j : j);
    const int gap = rope.interleaved ? 1 : half;  // rb - ra
    int r = ra;
    const auto [w, bias, s, n8] = seg_row(seg, &r, k);
    const uint4* const rows[2] = {reinterpret_cast<const uint4*>(w + (size_t)r * k),
                                  reinterpret_cast<const uint4*>(w + (size_t)(r + gap) * k)};
    float ab[2], ss;
    team_dot<EARLY, 2>(rows, n8, slot, split, x, norm_w, ab, &ss);
    const float3 t = group_sum(ab[0], ab[1], ss, split);
    if (s == 3 || slot.part != 0 || threadIdx.x % WARP != 0) return;
    const float inv = norm_w ? rsqrtf(t.z / k + eps) : 1.f;
    float a = t.x * inv, b = t.y * inv;
    if (bias) {
        a += __bfloat162float(bias[r]);
        b += __bfloat162float(bias[r + gap]);
    }
    const int pos = *rope.pos, i = ra - head * rope.hd;  // a's index within its head
    if (head >= rope.nh + rope.nkv) {
        bf16* v = rope.v_cache + ((size_t)(head - rope.nh - rope.nkv) * rope.cap + pos) * rope.hd;
        v[i] = __float2bfloat16(a);
        v[i + gap] = __float2bfloat16(b);
        return;
    }
    float sn, c;
    sincosf((float)pos * rope.inv_freq[j], &sn, &c);
    const float oa = a * c - b * sn, ob = a * sn + b * c;
    if (head < rope.nh) {
        qkv[ra] = oa;
        qkv[ra + gap] = ob;
    } else {
        bf16* kc = rope.k_cache + ((size_t)(head - rope.nh) * rope.cap + pos) * rope.hd;
        kc[i] = __float2bfloat16(oa);
        kc[i + gap] = __float2bfloat16(ob);
    }
}

#define QKV_ROPE_BF16(NAME, EARLY)                                                         \
    extern "C" __global__ void NAME(Segments seg, const float* __restrict__ x,            \
                                    const bf16* __restrict__ norm_w, float eps,           \
                                    float* __restrict__ qkv, int k, int split,            \
                                    RopeInto rope) {                                      \
        qkv_rope_bf16<EARLY>(seg, x, norm_w, eps, qkv, k, split, rope);                   \
    }
QKV_ROPE_BF16(shoal_qkv_rope_bf16, true)
QKV_ROPE_BF16(shoal_qkv_rope_bf16_late, false)

__device__ __forceinline__ float silu(float g) { return g / (1.f + __expf(-g)); }

// y[r] = silu(gate_r . norm(x)) * (up_r . norm(x)), both rows in one pass over x.
template <bool EARLY>
__device__ __forceinline__ void gate_up_bf16(const bf16* __restrict__ gate,
                                             const bf16* __restrict__ up,
                                             const float* __restrict__ x,
                                             const bf16* __restrict__ norm_w, float eps,
                                             float* __restrict__ y, int rows, int k,
                                             int split) {
    const RowSlot slot = row_slot(split);
    const int r = slot.row;
    const int n8 = r < rows ? k / 8 : 0;
    const uint4* const w[2] = {reinterpret_cast<const uint4*>(gate + (size_t)r * k),
                               reinterpret_cast<const uint4*>(up + (size_t)r * k)};
    float gu[2], ss;
    team_dot<EARLY, 2>(w, n8, slot, split, x, norm_w, gu, &ss);
    const float3 t = group_sum(gu[0], gu[1], ss, split);
    if (r < rows && slot.part == 0 && threadIdx.x % WARP == 0) {
        const float inv = norm_w ? rsqrtf(t.z / k + eps) : 1.f;
        y[r] = silu(t.x * inv) * (t.y * inv);
    }
}

// `_late`: the same products with the weights' first loads after the wait, to compare.
#define MATVEC_BF16(NAME, FN, EARLY)                                                      \
    extern "C" __global__ void NAME(Segments seg, const float* __restrict__ x,           \
                                    const bf16* __restrict__ norm_w, float eps,          \
                                    const float* __restrict__ residual,                  \
                                    float* __restrict__ y, int k, int split) {           \
        FN<EARLY>(seg, x, norm_w, eps, residual, y, k, split);                           \
    }
MATVEC_BF16(shoal_matvec_bf16, matvec_bf16, true)
MATVEC_BF16(shoal_matvec_bf16_late, matvec_bf16, false)
MATVEC_BF16(shoal_matvec2_bf16, matvec2_bf16, true)
MATVEC_BF16(shoal_matvec2_bf16_late, matvec2_bf16, false)

#define GATE_UP_BF16(NAME, EARLY)                                                             \
    extern "C" __global__ void NAME(const bf16* __restrict__ gate, const bf16* __restrict__ up, \
                                    const float* __restrict__ x,                             \
                                    const bf16* __restrict__ norm_w, float eps,              \
                                    float* __restrict__ y, int rows, int k, int split) {     \
        gate_up_bf16<EARLY>(gate, up, x, norm_w, eps, y, rows, k, split);                    \
    }
GATE_UP_BF16(shoal_gate_up_bf16, true)
GATE_UP_BF16(shoal_gate_up_bf16_late, false)

// ---------------------------------------------------------------------------------------
// Quantized mat-vecs against the 8-bit row (xq, per-32 (scale, scale * sum)).
// Q8_0: 34 bytes per 32 weights: f16 scale, 32 int8.

__device__ __forceinline__ int dp4a(int a, int b, int c) { return __dp4a(a, b, c); }

__device__ __forceinline__ int load_i32_unaligned(const uint8_t* p) {
    const uint16_t* h = reinterpret_cast<const uint16_t*>(p);
    return (int)h[0] | ((int)h[1] << 16);
}

__device__ __forceinline__ float dot_q8_0(const uint8_t* __restrict__ row, int blocks,
                                          const int8_t* __restrict__ xq,
                                          const float2* __restrict__ xd, int part,
                                          int split) {
    const int lane = threadIdx.x % WARP;
    float acc = 0.f;
    // Four lanes per block, 8 weights each.
    for (int b = lane / 4 + (WARP / 4) * part; b < blocks; b += (WARP / 4) * split) {
        const uint8_t* blk = row + (size_t)b * 34;
        const float d = __half2float(*reinterpret_cast<const __half*>(blk));
        const int part = lane % 4;
        const int* xi = reinterpret_cast<const int*>(xq + b * 32 + part * 8);
        int s = dp4a(load_i32_unaligned(blk + 2 + part * 8), xi[0], 0);
        s = dp4a(load_i32_unaligned(blk + 2 + part * 8 + 4), xi[1], s);
        acc += d * xd[b].x * (float)s;
    }
    return acc;
}

// Q4_K: 144 bytes per 256 weights: f16 d, f16 dmin, 12 bytes of 6-bit scales and mins
// for 8 sub-blocks of 32, 128 bytes of 4-bit weights (sub-blocks 2j and 2j+1 share 32
// bytes: low nibbles, then high).
__device__ __forceinline__ void q4k_scale_min(int j, const uint8_t* q, int* sc, int* m) {
    if (j < 4) {
        *sc = q[j] & 63;
        *m = q[j + 4] & 63;
    } else {
        *sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
        *m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
}

__device__ __forceinline__ float dot_q4k(const uint8_t* __restrict__ row, int blocks,
                                         const int8_t* __restrict__ xq,
                                         const float2* __restrict__ xd, int part, int split) {
    const int lane = threadIdx.x % WARP;
    float acc = 0.f;
    // 8 lanes per block of 256: lane l takes sub-block pair l/2, 16 bytes (32 weights: 16
    // of the low sub-block, 16 of the high) at byte offset (l%2)*16 within the pair's 32,
    // in one 128-bit load; a warp reads 4 blocks at a time. (Rows are whole blocks of 144
    // bytes, a multiple of 16, so every load is aligned.)
    const int l = lane % 8;
    const int pair = l / 2, off = (l % 2) * 16;
    const int lo_sub = 2 * pair, hi_sub = 2 * pair + 1;
#pragma unroll 2
    for (int b = lane / 8 + 4 * part; b < blocks; b += 4 * split) {
        const uint8_t* blk = row + (size_t)b * 144;
        const float2 dm = __half22float2(*reinterpret_cast<const __half2*>(blk));
        const uint8_t* scales = blk + 4;
        const int4 w = __ldg(reinterpret_cast<const int4*>(blk + 16 + pair * 32 + off));
        int sc_lo, m_lo, sc_hi, m_hi;
        q4k_scale_min(lo_sub, scales, &sc_lo, &m_lo);
        q4k_scale_min(hi_sub, scales, &sc_hi, &m_hi);
        const int base = b * 256;
        const int4 xl = *reinterpret_cast<const int4*>(xq + base + lo_sub * 32 + off);
        const int4 xh = *reinterpret_cast<const int4*>(xq + base + hi_sub * 32 + off);
        int s_lo = dp4a(w.x & 0x0F0F0F0F, xl.x, 0);
        s_lo = dp4a(w.y & 0x0F0F0F0F, xl.y, s_lo);
        s_lo = dp4a(w.z & 0x0F0F0F0F, xl.z, s_lo);
        s_lo = dp4a(w.w & 0x0F0F0F0F, xl.w, s_lo);
        int s_hi = dp4a((w.x >> 4) & 0x0F0F0F0F, xh.x, 0);
        s_hi = dp4a((w.y >> 4) & 0x0F0F0F0F, xh.y, s_hi);
        s_hi = dp4a((w.z >> 4) & 0x0F0F0F0F, xh.z, s_hi);
        s_hi = dp4a((w.w >> 4) & 0x0F0F0F0F, xh.w, s_hi);
        const float2 dl = xd[(base + lo_sub * 32) / 32];
        const float2 dh = xd[(base + hi_sub * 32) / 32];
        // The min term covers the whole sub-block: only one lane of the two adds it.
        float v = dm.x * (sc_lo * dl.x * s_lo + sc_hi * dh.x * s_hi);
        if (l % 2 == 0) v -= dm.y * (m_lo * dl.y + m_hi * dh.y);
        acc += v;
    }
    return acc;
}

// Q6_K: 210 bytes per 256 weights: 128 bytes of low 4 bits, 64 of high 2 bits, 16 int8
// scales (one per 16 weights), f16 d. Weight = d * scale * (q - 32).
__device__ __forceinline__ float dot_q6k(const uint8_t* __restrict__ row, int blocks,
                                         const int8_t* __restrict__ xq,
                                         const float2* __restrict__ xd, int part, int split) {
    const int lane = threadIdx.x % WARP;
    float acc = 0.f;
    // 32 lanes per block: each lane takes 8 weights (two groups of 4 adjacent bytes).
    // Layout per half (128 weights): ql[64], qh[32]; weight i of the half (0..127):
    //   l = i % 32, group = i / 32: ql byte = l + (group & 1) * 32, nibble = group >> 1,
    //   qh byte = l, bits = 2 * group.
    // Four weights at a time: their low and high bits as one 32-bit word each (blocks of
    // 210 bytes are only 2-byte aligned: two 16-bit loads), combined byte-wise.
    const int half = lane / 16;           // which 128
    const int group = (lane % 16) / 4;    // which 32 of the half
    const int l0 = (lane % 4) * 8;        // 8 weights from l0
    const int shift_l = (group >> 1) * 4, shift_h = 2 * group;
    const int wi = half * 128 + group * 32 + l0;  // index within the block
    for (int b = part; b < blocks; b += split) {
        const uint8_t* blk = row + (size_t)b * 210;
        const uint8_t* qlp = blk + half * 64 + (group & 1) * 32 + l0;
        const uint8_t* qhp = blk + 128 + half * 32 + l0;
        const int8_t* sc = reinterpret_cast<const int8_t*>(blk + 192);
        const float d = __half2float(*reinterpret_cast<const __half*>(blk + 208));
        int s = 0;
#pragma unroll
        for (int i = 0; i < 2; i++) {
            const int lo = (load_i32_unaligned(qlp + 4 * i) >> shift_l) & 0x0F0F0F0F;
            const int hi = ((load_i32_unaligned(qhp + 4 * i) >> shift_h) & 0x03030303) << 4;
            // q - 32 in every byte: q < 64, so no byte borrows from the next.
            const int w = __vsub4(lo | hi, 0x20202020);
            const int xv = *reinterpret_cast<const int*>(xq + b * 256 + wi + i * 4);
            s = dp4a(w, xv, s);
        }
        // 8 weights span one scale (16 weights share a scale).
        const int scale = sc[wi / 16];
        const float2 dx = xd[(b * 256 + wi) / 32];
        acc += d * scale * dx.x * (float)s;
    }
    return acc;
}

// Which GGUF block type a quantized matrix holds (matches gpu_decode.rs's QuantKind).
#define KIND_Q8_0 0
#define KIND_Q4K 1
#define KIND_Q6K 2

// A lane's share of the row's dot product (the group's sum is the product).
__device__ __forceinline__ float dot_quant(int kind, const uint8_t* row, int k,
                                           const int8_t* xq, const float2* xd, int part,
                                           int split) {
    switch (kind) {
        case KIND_Q8_0: return dot_q8_0(row, k / 32, xq, xd, part, split);
        case KIND_Q4K: return dot_q4k(row, k / 256, xq, xd, part, split);
        default: return dot_q6k(row, k / 256, xq, xd, part, split);
    }
}

__device__ __forceinline__ size_t row_bytes(int kind, int k) {
    switch (kind) {
        case KIND_Q8_0: return (size_t)(k / 32) * 34;
        case KIND_Q4K: return (size_t)(k / 256) * 144;
        default: return (size_t)(k / 256) * 210;
    }
}

struct QSegments {
    const uint8_t* w[3];
    const bf16* bias[3];
    int rows[3];
    int kind[3];
};

extern "C" __global__ void shoal_matvec_quant(QSegments seg, const int8_t* __restrict__ xq,
                                              const float2* __restrict__ xd,
                                              const float* __restrict__ residual,
                                              float* __restrict__ y, int k, int split) {
    const RowSlot slot = row_slot(split);
    int r = slot.row;
    const int s = segment(seg.rows, &r);
    const uint8_t* w = s == 0 ? seg.w[0] : s == 1 ? seg.w[1] : seg.w[2];
    const bf16* bias = s == 0 ? seg.bias[0] : s == 1 ? seg.bias[1] : seg.bias[2];
    const int kind = s == 0 ? seg.kind[0] : s == 1 ? seg.kind[1] : seg.kind[2];
    if (s < 3) prefetch_row(w + row_bytes(kind, k) * r, row_bytes(kind, k), slot.part, split);
    begin_step();
    float v = 0.f;
    if (s < 3) v = dot_quant(kind, w + row_bytes(kind, k) * r, k, xq, xd, slot.part, split);
    const float3 t = group_sum(v, 0.f, 0.f, split);
    if (s < 3 && slot.part == 0 && threadIdx.x % WARP == 0) {
        float out = t.x;
        if (bias) out += __bfloat162float(bias[r]);
        if (residual) out += residual[slot.row];
        y[slot.row] = out;
    }
}

extern "C" __global__ void shoal_gate_up_quant(const uint8_t* __restrict__ gate,
                                               const uint8_t* __restrict__ up, int kind_g,
                                               int kind_u, const int8_t* __restrict__ xq,
                                               const float2* __restrict__ xd,
                                               float* __restrict__ y, int rows, int k,
                                               int split) {
    const RowSlot slot = row_slot(split);
    const int r = slot.row;
    if (r < rows) {
        prefetch_row(gate + row_bytes(kind_g, k) * r, row_bytes(kind_g, k), slot.part, split);
        prefetch_row(up + row_bytes(kind_u, k) * r, row_bytes(kind_u, k), slot.part, split);
    }
    begin_step();
    float g = 0.f, u = 0.f;
    if (r < rows) {
        g = dot_quant(kind_g, gate + row_bytes(kind_g, k) * r, k, xq, xd, slot.part, split);
        u = dot_quant(kind_u, up + row_bytes(kind_u, k) * r, k, xq, xd, slot.part, split);
    }
    const float3 t = group_sum(g, u, 0.f, split);
    if (r < rows && slot.part == 0 && threadIdx.x % WARP == 0) y[r] = silu(t.x) * t.y;
}

// ---------------------------------------------------------------------------------------
// Per-head norm (qwen3), rope and the KV append, for the token at *pos. One block per
// head of q, k and v (in that order), head_dim threads. q is rotated in place; k and v
// go to the cache as bf16.
__device__ __forceinline__ void rope_append_head(float* __restrict__ qkv,
                                                 const bf16* __restrict__ q_norm,
                                                 const bf16* __restrict__ k_norm, float eps,
                                                 const float* __restrict__ inv_freq, int pos,
                                                 bf16* __restrict__ k_cache,
                                                 bf16* __restrict__ v_cache, int nh, int nkv,
                                                 int hd, int cap, int interleaved, int head) {
    __shared__ float row[256];
    const int i = threadIdx.x;
    float* src = qkv + (size_t)head * hd;
    const bool is_q = head < nh, is_k = !is_q && head < nh + nkv;
    float v = src[i];
    if (!is_q && !is_k) {
        const int h = head - nh - nkv;
        v_cache[((size_t)h * cap + pos) * hd + i] = __float2bfloat16(v);
        return;
    }
    const bf16* norm = is_q ? q_norm : k_norm;
    if (norm != nullptr) {
        const float ss = block_sum(v * v);
        v = v * rsqrtf(ss / hd + eps) * __bfloat162float(norm[i]);
    }
    row[i] = v;
    __syncthreads();
    const int half = hd / 2;
    int partner, f;
    bool first;
    if (interleaved) {
        partner = i ^ 1;
        f = i / 2;
        first = (i & 1) == 0;
    } else {
        partner = i < half ? i + half : i - half;
        f = i % half;
        first = i < half;
    }
    const float angle = (float)pos * inv_freq[f];
    float s, c;
    sincosf(angle, &s, &c);
    const float x0 = first ? v : row[partner];
    const float x1 = first ? row[partner] : v;
    const float out = first ? x0 * c - x1 * s : x0 * s + x1 * c;
    if (is_q) {
        src[i] = out;
    } else {
        const int h = head - nh;
        k_cache[((size_t)h * cap + pos) * hd + i] = __float2bfloat16(out);
    }
}

extern "C" __global__ void shoal_rope_append(float* __restrict__ qkv,
                                             const bf16* __restrict__ q_norm,
                                             const bf16* __restrict__ k_norm, float eps,
                                             const float* __restrict__ inv_freq,
                                             const int* __restrict__ pos_ptr,
                                             bf16* __restrict__ k_cache,
                                             bf16* __restrict__ v_cache, int nh, int nkv,
                                             int hd, int cap, int interleaved) {
    begin_step();
    rope_append_head(qkv, q_norm, k_norm, eps, inv_freq, *pos_ptr, k_cache, v_cache, nh, nkv,
                     hd, cap, interleaved, blockIdx.x);
}

// Where token b of a batch keeps layer `layer`'s keys and values: `caches` holds
// (key, value) addresses per (layer, token), `caps` each token's cache capacity.
struct BatchCaches {
    const unsigned long long* __restrict__ caches;
    const int* __restrict__ caps;
    const int* __restrict__ pos;
    int layer;
    int batch;
};

__device__ __forceinline__ bf16* batch_cache(BatchCaches c, int b, int which) {
    return reinterpret_cast<bf16*>(c.caches[((size_t)c.layer * c.batch + b) * 2 + which]);
}

// shoal_rope_append for a batch of decode rows, each of its own sequence (its own cache
// and position): block (head, token).
extern "C" __global__ void shoal_rope_append_batch(float* __restrict__ qkv,
                                                   const bf16* __restrict__ q_norm,
                                                   const bf16* __restrict__ k_norm, float eps,
                                                   const float* __restrict__ inv_freq,
                                                   BatchCaches c, int nh, int nkv, int hd,
                                                   int interleaved) {
    begin_step();
    const int b = blockIdx.y;
    rope_append_head(qkv + (size_t)b * (nh + 2 * nkv) * hd, q_norm, k_norm, eps, inv_freq,
                     c.pos[b], batch_cache(c, b, 0), batch_cache(c, b, 1), nh, nkv, hd,
                     c.caps[b], interleaved, blockIdx.x);
}

// Positions per attention split: the context spread over the splits, but at least 32 a
// split, so a short context uses few splits (and the merge reads few partials).
__device__ __forceinline__ int attn_chunk(int len, int splits) {
    return max(32, (len + splits - 1) / splits);
}

// Block (KV head blockIdx.x, split blockIdx.y)'s run of the cache, as attention_block
// walks it, asked of L2 before the kernel waits for the one ahead (`prefetch` set): the
// keys and values of earlier positions do not depend on that kernel, and the one it
// appends lands in L2 over the prefetched line (L2 is where the SMs' writes meet), so
// the run's DRAM latency overlaps the q/k/v projection's tail. Reads only the position,
// which the host copies in before the step.
__device__ __forceinline__ void prefetch_cache(const bf16* k_cache, const bf16* v_cache,
                                               const int* pos_ptr, int hd, int cap,
                                               int prefetch) {
    if (!prefetch) return;
    const int len = *pos_ptr + 1;
    const int chunk = attn_chunk(len, gridDim.y);
    const int start = blockIdx.y * chunk, end = min(len, start + chunk);
    if (start >= end) return;
    const size_t first = ((size_t)blockIdx.x * cap + start) * hd;
    const int lines = ((end - start) * hd * (int)sizeof(bf16) + 127) / 128;
    for (int i = threadIdx.x; i < 2 * lines; i += blockDim.x) {
        const bf16* run = (i < lines ? k_cache : v_cache) + first;
        prefetch_l2(reinterpret_cast<const uint8_t*>(run) + (size_t)(i % lines) * 128);
    }
}

// The next product's weights (the output projection's, `next`, `bytes` long) asked of L2
// by the attention kernel once the kernel ahead has finished: attention reads a few MB of
// cache while the DRAM would otherwise idle, and the product after it then streams its
// weights from L2. (Asked before the wait, they competed with the q/k/v projection's own
// stream: on an H100, llama-8B bf16 176.3 tok/s against 178.0 without.)
// Each thread of the grid takes one slice with one bulk prefetch (Hopper's
// cp.async.bulk.prefetch.L2; sizes and addresses in 16-byte units, a remainder dropped).
__device__ __forceinline__ void prefetch_next(const uint8_t* next, unsigned long long bytes) {
#if __CUDA_ARCH__ >= 900
    if (next == nullptr) return;
    const unsigned long long threads =
        (unsigned long long)gridDim.x * gridDim.y * blockDim.x;
    const unsigned long long t =
        ((unsigned long long)blockIdx.y * gridDim.x + blockIdx.x) * blockDim.x + threadIdx.x;
    const unsigned long long each = ((bytes + threads - 1) / threads + 15) & ~15ull;
    const unsigned long long from = t * each;
    if (from >= bytes) return;
    const unsigned n = (unsigned)(min(each, bytes - from) & ~15ull);
    if (n == 0) return;
    asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(next + from), "r"(n)
                 : "memory");
#endif
}

// Splits that hold positions of a context of `len`.
__device__ __forceinline__ int active_splits(int len, int splits) {
    return (len + attn_chunk(len, splits) - 1) / attn_chunk(len, splits);
}

// Query head h's weight for each active split's partial (coef[s]) and the reciprocal of
// their total, by one warp: its lanes take the splits side by side (at most 64), so the
// partials' maxima and sums are read in one round trip, not one a split.
#define MAX_SPLITS 64
__device__ __forceinline__ void split_weights(const float2* __restrict__ part_ml, int h,
                                              int active, int splits, float* coef,
                                              float* inv_total) {
    const int lane = threadIdx.x % WARP;
    const float2 none = make_float2(-INFINITY, 0.f);
    const float2 a = lane < active ? part_ml[h * splits + lane] : none;
    const float2 b = lane + WARP < active ? part_ml[h * splits + lane + WARP] : none;
    const float mx = warp_max(fmaxf(a.x, b.x));
    const float ca = a.x == -INFINITY ? 0.f : __expf(a.x - mx);
    const float cb = b.x == -INFINITY ? 0.f : __expf(b.x - mx);
    const float total = warp_sum(a.y * ca + b.y * cb);
    coef[lane] = ca;
    coef[lane + WARP] = cb;
    if (lane == 0) *inv_total = 1.f / total;
}

// Value d of every active split's partial of query head h, into registers: all the
// loads in flight at once, issued before the split weights are known (a loop of eight
// at a time waited an L2 round trip per eight splits).
__device__ __forceinline__ void load_partials(const float* __restrict__ part_acc, int h, int d,
                                              int active, int splits, int hd,
                                              float v[MAX_SPLITS]) {
#pragma unroll
    for (int s = 0; s < MAX_SPLITS; s++)
        v[s] = s < active ? part_acc[((size_t)h * splits + s) * hd + d] : 0.f;
}

// The partials `v` weighted by `coef`, normalized.
__device__ __forceinline__ float merged_value(const float v[MAX_SPLITS], const float* coef,
                                              float inv_total, int active) {
    float a = 0.f;
#pragma unroll
    for (int s = 0; s < MAX_SPLITS; s++)
        if (s < active) a += v[s] * coef[s];
    return a * inv_total;
}

// A lane's `n` (1, 2 or 4) consecutive bf16 values of a key or value row, in one load.
__device__ __forceinline__ void load_lane(const bf16* p, int n, float out[MAX_LANE]) {
#pragma unroll
    for (int e = 0; e < MAX_LANE; e++) out[e] = 0.f;
    if (n == 4) {
        const uint2 u = *reinterpret_cast<const uint2*>(p);
        const float2 a = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&u.x));
        const float2 b = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&u.y));
        out[0] = a.x;
        out[1] = a.y;
        out[2] = b.x;
        out[3] = b.y;
    } else if (n == 2) {
        const float2 a = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(p));
        out[0] = a.x;
        out[1] = a.y;
    } else {
        out[0] = __bfloat162float(*p);
    }
}

// ---------------------------------------------------------------------------------------
// Attention of one token over the cache, flash-decoding style: block (kv head, split)
// takes a contiguous run of the *pos + 1 positions for all query heads of its group and
// writes an unnormalized partial (max, sum, weighted values); shoal_attn_merge merges
// them. A warp takes K keys at a time (shoal_attention: KEYS; shoal_attention_keys1: one,
// to compare at depth: `SHOAL_GPU_KEYS=1`). G, the query heads of the
// group, is a compile-time constant: every head's score is summed over the warp in the
// same shuffle stages, interleaved (a runtime count made each head's five dependent
// shuffles, exponentials and updates wait for the previous head's: 10.7 us for ~580
// positions on the qwen2.5-1.5b shape, groups of 6), and registers hold G heads, not 8.
// The block's result for query head g goes to acc + g * acc_stride (hd values) and
// ml[g * ml_stride] (max, sum): the split's slice of the partials in global memory, or
// (shoal_attention_cluster) the block's own shared memory. A block past the context's
// end returns at once unless `keep` (a cluster's blocks all reach its barriers).
template <int G, int K>
__device__ __forceinline__ void attention_block(const float* __restrict__ q,
                                                const bf16* __restrict__ k_cache,
                                                const bf16* __restrict__ v_cache, int len,
                                                float* __restrict__ acc_out, int acc_stride,
                                                float2* __restrict__ ml_out, int ml_stride,
                                                int hd, int cap, float scale, bool keep) {
    constexpr int group = G;
    const int kvh = blockIdx.x, split = blockIdx.y, splits = gridDim.y;
    const int warp = threadIdx.x / WARP, lane = threadIdx.x % WARP, warps = blockDim.x / WARP;
    const int chunk = attn_chunk(len, splits);
    const int start = split * chunk, end = min(len, start + chunk);
    if (start >= len && !keep) return;  // past the active splits: the merge does not read it
    const int per_lane = hd / WARP;

    float qr[G][MAX_LANE];
    float acc[G][MAX_LANE];
    float m[G], l[G];
#pragma unroll
    for (int g = 0; g < G; g++) {
        m[g] = -INFINITY;
        l[g] = 0.f;
#pragma unroll
        for (int e = 0; e < MAX_LANE; e++) {
            acc[g][e] = 0.f;
            qr[g][e] = e < per_lane
                           ? q[(size_t)(kvh * group + g) * hd + lane * per_lane + e] * scale
                           : 0.f;
        }
    }
    const bf16* kb = k_cache + (size_t)kvh * cap * hd + lane * per_lane;
    const bf16* vb = v_cache + (size_t)kvh * cap * hd + lane * per_lane;
    // K keys a warp at a time: their loads are all in flight before the first score
    // (one key at a time waited a cache round trip per key: 8.8 us a layer on llama-8B
    // at ~600 positions, for 2.5 MB).
    for (int j0 = start + warp; j0 < end; j0 += warps * K) {
        float kv[K][MAX_LANE], vv[K][MAX_LANE];
#pragma unroll
        for (int b = 0; b < K; b++) {
            const int j = j0 + b * warps;
            if (j < end) {
                load_lane(kb + (size_t)j * hd, per_lane, kv[b]);
                load_lane(vb + (size_t)j * hd, per_lane, vv[b]);
            } else {
#pragma unroll
                for (int e = 0; e < MAX_LANE; e++) kv[b][e] = vv[b][e] = 0.f;
            }
        }
        float s[K][G];
#pragma unroll
        for (int b = 0; b < K; b++)
#pragma unroll
            for (int g = 0; g < G; g++) {
                s[b][g] = 0.f;
#pragma unroll
                for (int e = 0; e < MAX_LANE; e++) s[b][g] += qr[g][e] * kv[b][e];
            }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1)
#pragma unroll
            for (int b = 0; b < K; b++)
#pragma unroll
                for (int g = 0; g < G; g++) s[b][g] += __shfl_xor_sync(0xffffffff, s[b][g], o);
#pragma unroll
        for (int g = 0; g < G; g++) {
            // Key 0 of the batch is always in range, so the new maximum is finite.
            float mn = m[g];
#pragma unroll
            for (int b = 0; b < K; b++)
                if (j0 + b * warps < end) mn = fmaxf(mn, s[b][g]);
            const float corr = __expf(m[g] - mn);
            l[g] *= corr;
#pragma unroll
            for (int e = 0; e < MAX_LANE; e++) acc[g][e] *= corr;
#pragma unroll
            for (int b = 0; b < K; b++) {
                if (j0 + b * warps >= end) continue;
                const float p = __expf(s[b][g] - mn);
                l[g] += p;
#pragma unroll
                for (int e = 0; e < MAX_LANE; e++) acc[g][e] += p * vv[b][e];
            }
            m[g] = mn;
        }
    }
    // Merge the warps: shared (warps, group, hd) values and (warps, group) max/sum.
    extern __shared__ float shm[];
    float* sacc = shm;                                 // warps * group * hd
    float* sm = shm + warps * group * hd;              // warps * group
    float* sl = sm + warps * group;                    // warps * group
#pragma unroll
    for (int g = 0; g < G; g++) {
#pragma unroll
        for (int e = 0; e < MAX_LANE; e++)
            if (e < per_lane) sacc[(warp * group + g) * hd + lane * per_lane + e] = acc[g][e];
        if (lane == 0) {
            sm[warp * group + g] = m[g];
            sl[warp * group + g] = l[g];
        }
    }
    __syncthreads();
    for (int idx = threadIdx.x; idx < group * hd; idx += blockDim.x) {
        const int g = idx / hd, d = idx % hd;
        float mx = -INFINITY;
        for (int w = 0; w < warps; w++) mx = fmaxf(mx, sm[w * group + g]);
        float a = 0.f, ls = 0.f;
        if (mx != -INFINITY) {
            for (int w = 0; w < warps; w++) {
                const float c = __expf(sm[w * group + g] - mx);
                a += sacc[(w * group + g) * hd + d] * c;
                ls += sl[w * group + g] * c;
            }
        }
        acc_out[(size_t)g * acc_stride + d] = a;
        if (d == 0) ml_out[g * ml_stride] = make_float2(mx, ls);
    }
}

// attention_block's result for split blockIdx.y of KV head blockIdx.x, into the partials.
template <int G, int K>
__device__ __forceinline__ void attention_split(const float* __restrict__ q,
                                                const bf16* __restrict__ k_cache,
                                                const bf16* __restrict__ v_cache, int len,
                                                float* __restrict__ part_acc,
                                                float2* __restrict__ part_ml, int hd,
                                                int cap, float scale) {
    const int qh = blockIdx.x * G, split = blockIdx.y, splits = gridDim.y;
    attention_block<G, K>(q, k_cache, v_cache, len,
                          part_acc + ((size_t)qh * splits + split) * hd, splits * hd,
                          part_ml + qh * splits + split, splits, hd, cap, scale, false);
}

// attention_block of `group` query heads a KV head, K keys a warp at a time.
template <int K>
__device__ __forceinline__ void attention_by_group(const float* __restrict__ q,
                                                   const bf16* __restrict__ k_cache,
                                                   const bf16* __restrict__ v_cache, int len,
                                                   float* __restrict__ part_acc,
                                                   float2* __restrict__ part_ml, int group,
                                                   int hd, int cap, float scale) {
#define ATTN(G) attention_split<G, K>(q, k_cache, v_cache, len, part_acc, part_ml, hd, cap, scale)
    BY_GROUP(group, ATTN);
#undef ATTN
}

#define ATTENTION(NAME, K)                                                                   \
    extern "C" __global__ void NAME(const float* __restrict__ q,                              \
                                    const bf16* __restrict__ k_cache,                         \
                                    const bf16* __restrict__ v_cache,                         \
                                    const int* __restrict__ pos_ptr,                          \
                                    float* __restrict__ part_acc,                             \
                                    float2* __restrict__ part_ml, int group, int hd, int cap, \
                                    float scale, int prefetch, const uint8_t* next,           \
                                    unsigned long long next_bytes) {                          \
        prefetch_cache(k_cache, v_cache, pos_ptr, hd, cap, prefetch);                         \
        begin_step();                                                                         \
        prefetch_next(next, next_bytes);                                                      \
        attention_by_group<K>(q, k_cache, v_cache, *pos_ptr + 1, part_acc, part_ml, group,   \
                              hd, cap, scale);                                                \
    }
ATTENTION(shoal_attention, KEYS)
ATTENTION(shoal_attention_keys1, 1)
#undef ATTENTION

// shoal_attention compiled for one group size: the kernel above switches on `group` at
// run time, so its registers are those of the widest group (8 heads' queries and sums a
// lane), which holds a narrower group's blocks to the occupancy of the widest.
#define ATTENTION_G(G)                                                                        \
    extern "C" __global__ void shoal_attention_g##G(                                          \
        const float* __restrict__ q, const bf16* __restrict__ k_cache,                        \
        const bf16* __restrict__ v_cache, const int* __restrict__ pos_ptr,                    \
        float* __restrict__ part_acc, float2* __restrict__ part_ml, int group, int hd,        \
        int cap, float scale, int prefetch, const uint8_t* next,                              \
        unsigned long long next_bytes) {                                                      \
        prefetch_cache(k_cache, v_cache, pos_ptr, hd, cap, prefetch);                         \
        begin_step();                                                                         \
        prefetch_next(next, next_bytes);                                                      \
        attention_split<G, KEYS>(q, k_cache, v_cache, *pos_ptr + 1, part_acc, part_ml, hd,   \
                                 cap, scale);                                                 \
    }
ATTENTION_G(1)
ATTENTION_G(2)
ATTENTION_G(3)
ATTENTION_G(4)
ATTENTION_G(5)
ATTENTION_G(6)
ATTENTION_G(7)
ATTENTION_G(8)
#undef ATTENTION_G

// Thread-block clusters (Hopper): the blocks of one cluster reach each other's shared
// memory, and wait at a barrier for each other.
__device__ __forceinline__ unsigned cluster_rank() {
    unsigned r = 0;
#if __CUDA_ARCH__ >= 900
    asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
#endif
    return r;
}

__device__ __forceinline__ void cluster_sync() {
#if __CUDA_ARCH__ >= 900
    asm volatile("barrier.cluster.arrive.release.aligned;" ::: "memory");
    asm volatile("barrier.cluster.wait.acquire.aligned;" ::: "memory");
#endif
}

// The address of `p` (in this block's shared memory) in the shared memory of the
// cluster's block `rank`, and a read through it.
__device__ __forceinline__ unsigned cluster_addr(const void* p, unsigned rank) {
    unsigned out = 0;
#if __CUDA_ARCH__ >= 900
    const unsigned local = static_cast<unsigned>(__cvta_generic_to_shared(p));
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(out) : "r"(local), "r"(rank));
#endif
    return out;
}

__device__ __forceinline__ float cluster_load(unsigned addr) {
    float v = 0.f;
#if __CUDA_ARCH__ >= 900
    asm volatile("ld.shared::cluster.f32 %0, [%1];" : "=f"(v) : "r"(addr) : "memory");
#endif
    return v;
}

#define MAX_CLUSTER 16

// Value `idx` of the group's merged attention (of query head g of the group): every
// cluster block's partial (its values `mine`, its (max, sum) pairs `mine_ml`) weighted by
// its share of the softmax.
__device__ __forceinline__ float cluster_merged(const float* mine, const float2* mine_ml,
                                                int idx, int g, unsigned blocks) {
    float m[MAX_CLUSTER], a[MAX_CLUSTER], l[MAX_CLUSTER];
    float mx = -INFINITY;
#pragma unroll
    for (int r = 0; r < MAX_CLUSTER; r++) {
        m[r] = -INFINITY;
        a[r] = l[r] = 0.f;
        if (r < blocks) {
            const unsigned ml = cluster_addr(mine_ml + g, r);
            m[r] = cluster_load(ml);
            l[r] = cluster_load(ml + 4);
            a[r] = cluster_load(cluster_addr(mine + idx, r));
        }
        mx = fmaxf(mx, m[r]);
    }
    float acc = 0.f, total = 0.f;
#pragma unroll
    for (int r = 0; r < MAX_CLUSTER; r++) {
        if (m[r] == -INFINITY) continue;
        const float c = __expf(m[r] - mx);
        acc += a[r] * c;
        total += l[r] * c;
    }
    return acc / total;
}
// Attention and its merge in one kernel, for a context short enough that one cluster
// of blocks a KV head covers it: block (kv head, split) as shoal_attention_gG with the
// cluster's blocks as the splits (gridDim.y, at most MAX_CLUSTER), each keeping its
// partial in its own shared memory; after the cluster's barrier every block merges a
// share of the group's values from all of them and writes `out` (and, where `xq` is
// given, its 8-bit blocks). The two-kernel path's merge was a kernel boundary a layer
// and a round trip of the partials through L2.
template <int G>
__device__ __forceinline__ void attention_cluster(const float* __restrict__ q,
                                                  const bf16* __restrict__ k_cache,
                                                  const bf16* __restrict__ v_cache, int len,
                                                  float* __restrict__ out,
                                                  int8_t* __restrict__ xq,
                                                  float2* __restrict__ xd, int hd, int cap,
                                                  float scale) {
    extern __shared__ float shm[];
    const int warps = blockDim.x / WARP;
    // After attention_block's own (warps, G, hd) values and (warps, G) max/sum pairs.
    float* mine = shm + warps * G * hd + 2 * warps * G;  // G * hd values, then G pairs
    float2* mine_ml = reinterpret_cast<float2*>(mine + G * hd);
    attention_block<G, KEYS>(q, k_cache, v_cache, len, mine, hd, mine_ml, 1, hd, cap, scale,
                             true);
    cluster_sync();
    const unsigned rank = cluster_rank(), blocks = gridDim.y;
    const int n = G * hd, base = blockIdx.x * G * hd;
    // Whole warps take 32 consecutive values of one head, as quantize_warp needs: n, hd
    // and blockDim.x are multiples of 32, so a warp's lanes enter and leave together.
    for (int idx = rank * blockDim.x + threadIdx.x; idx < n; idx += blocks * blockDim.x) {
        const float v = cluster_merged(mine, mine_ml, idx, idx / hd, blocks);
        out[base + idx] = v;
        if (xq != nullptr) quantize_warp(v, (base + idx) / WARP, xq, xd);
    }
    // No block leaves while another may still read its shared memory.
    cluster_sync();
}

#define ATTENTION_CLUSTER(G)                                                                  \
    extern "C" __global__ void shoal_attention_cluster_g##G(                                  \
        const float* __restrict__ q, const bf16* __restrict__ k_cache,                        \
        const bf16* __restrict__ v_cache, const int* __restrict__ pos_ptr,                    \
        float* __restrict__ out, int8_t* __restrict__ xq, float2* __restrict__ xd, int hd,    \
        int cap, float scale, int prefetch, const uint8_t* next,                              \
        unsigned long long next_bytes) {                                                      \
        prefetch_cache(k_cache, v_cache, pos_ptr, hd, cap, prefetch);                         \
        begin_step();                                                                         \
        prefetch_next(next, next_bytes);                                                      \
        attention_cluster<G>(q, k_cache, v_cache, *pos_ptr + 1, out, xq, xd, hd, cap, scale); \
    }
ATTENTION_CLUSTER(1)
ATTENTION_CLUSTER(2)
ATTENTION_CLUSTER(3)
ATTENTION_CLUSTER(4)
ATTENTION_CLUSTER(5)
ATTENTION_CLUSTER(6)
ATTENTION_CLUSTER(7)
ATTENTION_CLUSTER(8)
#undef ATTENTION_CLUSTER

// The output projection (bf16, no bias) inside the cluster attention kernel, for a
// context the clusters serve: block (kv head, rank) multiplies rows [rank * R, rank * R +
// R) of W_o (R = hidden / cluster blocks), restricted to the group's G * hd columns, by
// the group's merged values and writes that partial; the last KV head's block to finish
// a slice of rows (a counter a slice) adds the slice's partials in KV-head order, then the
// residual, into y. The block asks L2 for its rows once the kernel ahead has finished,
// so the DRAM streams the projection's weights while the attention's latency-bound work
// runs, and the projection's own kernel boundary is gone (its ramp and drain were ~4 us
// of ~15 on llama-8B, an H100). Every sum is in a fixed order: replays and eager runs
// agree bit for bit.
struct OInto {
    const bf16* w;    // (hidden, ld) row-major, ld = query heads * hd
    float* partial;   // (KV heads, hidden)
    unsigned* count;  // a slice of rows each (cluster blocks); zero between kernels
    float* y;         // the residual stream, updated in place
    int hidden, ld;
};

__device__ __forceinline__ void prefetch_o_rows(OInto o, int n, unsigned rank,
                                                unsigned blocks) {
    const int rows = o.hidden / blocks, lines = n * (int)sizeof(bf16) / 128;
    const bf16* first = o.w + (size_t)rank * rows * o.ld + (size_t)blockIdx.x * n;
    for (int i = threadIdx.x; i < rows * lines; i += blockDim.x)
        prefetch_l2(reinterpret_cast<const uint8_t*>(first + (size_t)(i / lines) * o.ld) +
                    (size_t)(i % lines) * 128);
}

// This block's rows of W_o (PJ 16-byte pieces a lane a row) times the group's values
// `a` (in shared memory) into `partial`; ROWS rows a warp at a time, all their loads
// issued before the first is used.
template <int PJ>
__device__ __forceinline__ void project_o_slice(const float* a, OInto o, int n,
                                                unsigned rank, unsigned blocks) {
    constexpr int ROWS = 16 / PJ;
    const int rows = o.hidden / blocks, row0 = rank * rows, pieces = n / 8;
    const int lane = threadIdx.x % WARP, warp = threadIdx.x / WARP;
    const int warps = blockDim.x / WARP;
    float xs[PJ][8];
#pragma unroll
    for (int j = 0; j < PJ; j++) {
        const int p = lane + WARP * j;
#pragma unroll
        for (int e = 0; e < 8; e++) xs[j][e] = p < pieces ? a[8 * p + e] : 0.f;
    }
    const bf16* cols = o.w + (size_t)blockIdx.x * n;
    float* partial = o.partial + (size_t)blockIdx.x * o.hidden + row0;
    for (int r0 = warp * ROWS; r0 < rows; r0 += warps * ROWS) {
        uint4 v[ROWS][PJ];
#pragma unroll
        for (int rr = 0; rr < ROWS; rr++) {
            const uint4* row =
                reinterpret_cast<const uint4*>(cols + (size_t)(row0 + r0 + rr) * o.ld);
#pragma unroll
            for (int j = 0; j < PJ; j++) {
                const int p = lane + WARP * j;
                v[rr][j] = r0 + rr < rows && p < pieces ? __ldcs(row + p)
                                                        : make_uint4(0, 0, 0, 0);
            }
        }
        float mine = 0.f;
#pragma unroll
        for (int rr = 0; rr < ROWS; rr++) {
            float d = 0.f;
#pragma unroll
            for (int j = 0; j < PJ; j++) d += dot8x(v[rr][j], xs[j]);
            d = warp_sum(d);
            if (lane == rr) mine = d;
        }
        if (lane < ROWS && r0 + lane < rows) partial[r0 + lane] = mine;
    }
}

// After every block's partial: the last KV head's block of this slice of rows sums them.
__device__ __forceinline__ void reduce_o_slice(OInto o, unsigned rank, unsigned blocks) {
    __shared__ unsigned last;
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) last = atomicAdd(o.count + rank, 1u) == gridDim.x - 1;
    __syncthreads();
    if (!last) return;
    __threadfence();
    const int rows = o.hidden / blocks, row0 = rank * rows;
    for (int r = threadIdx.x; r < rows; r += blockDim.x) {
        float acc = 0.f;
        for (int kv = 0; kv < (int)gridDim.x; kv++)
            acc += __ldcg(o.partial + (size_t)kv * o.hidden + row0 + r);
        o.y[row0 + r] += acc;
    }
    if (threadIdx.x == 0) o.count[rank] = 0;
}

__device__ __forceinline__ void cluster_arrive() {
#if __CUDA_ARCH__ >= 900
    asm volatile("barrier.cluster.arrive.release.aligned;" ::: "memory");
#endif
}

__device__ __forceinline__ void cluster_wait() {
#if __CUDA_ARCH__ >= 900
    asm volatile("barrier.cluster.wait.acquire.aligned;" ::: "memory");
#endif
}

template <int G>
__device__ __forceinline__ void attention_o_cluster(const float* __restrict__ q,
                                                    const bf16* __restrict__ k_cache,
                                                    const bf16* __restrict__ v_cache,
                                                    int len, OInto o, int hd, int cap,
                                                    float scale) {
    extern __shared__ float shm[];
    const int warps = blockDim.x / WARP;
    const int n = G * hd;
    // attention_block's values (later the gathered group), this block's partial (values,
    // then pairs), then the merged values this block computed.
    float* mine = shm + warps * G * hd + 2 * warps * G;
    float2* mine_ml = reinterpret_cast<float2*>(mine + G * hd);
    float* merged = mine + G * hd + 2 * G;
    attention_block<G, KEYS>(q, k_cache, v_cache, len, mine, hd, mine_ml, 1, hd, cap, scale,
                             true);
    cluster_sync();
    const unsigned rank = cluster_rank(), blocks = gridDim.y;
    for (int idx = rank * blockDim.x + threadIdx.x; idx < n; idx += blocks * blockDim.x)
        merged[idx] = cluster_merged(mine, mine_ml, idx, idx / hd, blocks);
    cluster_sync();
    float* group = shm;
    for (int idx = threadIdx.x; idx < n; idx += blockDim.x)
        group[idx] = cluster_load(cluster_addr(merged + idx, (idx / blockDim.x) % blocks));
    // Done with the other blocks' shared memory; they may leave once this block has too.
    cluster_arrive();
    __syncthreads();
    switch ((n / 8 + WARP - 1) / WARP) {
        case 1: project_o_slice<1>(group, o, n, rank, blocks); break;
        case 2: project_o_slice<2>(group, o, n, rank, blocks); break;
        case 3: project_o_slice<3>(group, o, n, rank, blocks); break;
        default: project_o_slice<4>(group, o, n, rank, blocks); break;
    }
    reduce_o_slice(o, rank, blocks);
    cluster_wait();
}

#define ATTENTION_O_CLUSTER(G)                                                                \
    extern "C" __global__ void shoal_attention_o_cluster_g##G(                                \
        const float* __restrict__ q, const bf16* __restrict__ k_cache,                        \
        const bf16* __restrict__ v_cache, const int* __restrict__ pos_ptr, OInto o, int hd,   \
        int cap, float scale, int prefetch) {                                                 \
        prefetch_cache(k_cache, v_cache, pos_ptr, hd, cap, prefetch);                         \
        begin_step();                                                                         \
        prefetch_o_rows(o, G * hd, cluster_rank(), gridDim.y);                                \
        attention_o_cluster<G>(q, k_cache, v_cache, *pos_ptr + 1, o, hd, cap, scale);         \
    }
ATTENTION_O_CLUSTER(1)
ATTENTION_O_CLUSTER(2)
ATTENTION_O_CLUSTER(3)
ATTENTION_O_CLUSTER(4)
ATTENTION_O_CLUSTER(5)
ATTENTION_O_CLUSTER(6)
ATTENTION_O_CLUSTER(7)
ATTENTION_O_CLUSTER(8)
#undef ATTENTION_O_CLUSTER

// shoal_attention for a batch of decode rows: block (kv head, split, token); token b's
// queries are the first heads of its row of `qkv`, its partials a slice of their own.
// (One kernel a group size, as shoal_attention_gG.)
#define ATTENTION_BATCH(G)                                                                    \
    extern "C" __global__ void shoal_attention_batch_g##G(                                    \
        const float* __restrict__ qkv, BatchCaches c, float* __restrict__ part_acc,           \
        float2* __restrict__ part_ml, int nh, int nkv, int group, int hd, float scale) {      \
        begin_step();                                                                         \
        const int b = blockIdx.z, splits = gridDim.y;                                         \
        const float* q = qkv + (size_t)b * (nh + 2 * nkv) * hd;                               \
        attention_split<G, KEYS>(q, batch_cache(c, b, 0), batch_cache(c, b, 1), c.pos[b] + 1, \
                                 part_acc + (size_t)b * nh * splits * hd,                     \
                                 part_ml + (size_t)b * nh * splits, hd, c.caps[b], scale);    \
    }
ATTENTION_BATCH(1)
ATTENTION_BATCH(2)
ATTENTION_BATCH(3)
ATTENTION_BATCH(4)
ATTENTION_BATCH(5)
ATTENTION_BATCH(6)
ATTENTION_BATCH(7)
ATTENTION_BATCH(8)
#undef ATTENTION_BATCH

// out[h] = the active splits' partials of query head h merged and normalized, and, where
// `xq` is given, the same row quantized to 8 bits for a quantized output projection (a
// warp's 32 values are consecutive values of one head: hd % 32 == 0). One block per
// query head, head_dim threads.
__device__ __forceinline__ void merge_head(const float* __restrict__ part_acc,
                                           const float2* __restrict__ part_ml, int len,
                                           float* __restrict__ out, int8_t* __restrict__ xq,
                                           float2* __restrict__ xd, int splits, int hd) {
    const int h = blockIdx.x, d = threadIdx.x;
    const int active = active_splits(len, splits);
    __shared__ float coef[MAX_SPLITS];
    __shared__ float inv_total;
    float parts[MAX_SPLITS];
    load_partials(part_acc, h, d, active, splits, hd, parts);
    if (d < WARP) split_weights(part_ml, h, active, splits, coef, &inv_total);
    __syncthreads();
    const float v = merged_value(parts, coef, inv_total, active);
    const int o = h * hd + d;
    out[o] = v;
    if (xq != nullptr) quantize_warp(v, o / 32, xq, xd);
}

extern "C" __global__ void shoal_attn_merge(const float* __restrict__ part_acc,
                                            const float2* __restrict__ part_ml,
                                            const int* __restrict__ pos_ptr,
                                            float* __restrict__ out, int8_t* __restrict__ xq,
                                            float2* __restrict__ xd, int splits, int hd) {
    begin_step();
    merge_head(part_acc, part_ml, *pos_ptr + 1, out, xq, xd, splits, hd);
}

// shoal_attn_merge for a batch of decode rows: block (query head, token); f32 out only.
extern "C" __global__ void shoal_attn_merge_batch(const float* __restrict__ part_acc,
                                                  const float2* __restrict__ part_ml,
                                                  const int* __restrict__ pos,
                                                  float* __restrict__ out, int nh, int splits,
                                                  int hd) {
    begin_step();
    const int b = blockIdx.y;
    merge_head(part_acc + (size_t)b * nh * splits * hd, part_ml + (size_t)b * nh * splits,
               pos[b] + 1, out + (size_t)b * nh * hd, nullptr, nullptr, splits, hd);
}

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
