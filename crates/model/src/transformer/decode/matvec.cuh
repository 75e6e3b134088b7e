// Mat-vecs over bf16 rows: the dense product, q/k/v with rope and the KV append,
// gate/up with SiLU.
// Part of decode.cu's one translation unit, included there in order: it uses what
// the parts before it define.

#pragma once

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

// The kernels' `_lb` variants: held to 64 registers a thread (ptxas gives the others 68-72), so that 8 blocks
// of 4 warps fit an SM instead of 7 and more teams have their first loads in flight
// while they wait for the kernel ahead.
#define LEAN __launch_bounds__(256, 4)

#define QKV_ROPE_BF16(NAME, EARLY, BOUNDS)                                                 \
    extern "C" __global__ void BOUNDS NAME(Segments seg, const float* __restrict__ x,            \
                                    const bf16* __restrict__ norm_w, float eps,           \
                                    float* __restrict__ qkv, int k, int split,            \
                                    RopeInto rope) {                                      \
        qkv_rope_bf16<EARLY>(seg, x, norm_w, eps, qkv, k, split, rope);                   \
    }
QKV_ROPE_BF16(shoal_qkv_rope_bf16, true, )
QKV_ROPE_BF16(shoal_qkv_rope_bf16_late, false, )
QKV_ROPE_BF16(shoal_qkv_rope_bf16_lb, true, LEAN)

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
#define MATVEC_BF16(NAME, FN, EARLY, BOUNDS)                                              \
    extern "C" __global__ void BOUNDS NAME(Segments seg, const float* __restrict__ x,           \
                                    const bf16* __restrict__ norm_w, float eps,          \
                                    const float* __restrict__ residual,                  \
                                    float* __restrict__ y, int k, int split) {           \
        FN<EARLY>(seg, x, norm_w, eps, residual, y, k, split);                           \
    }
MATVEC_BF16(shoal_matvec_bf16, matvec_bf16, true, )
MATVEC_BF16(shoal_matvec_bf16_late, matvec_bf16, false, )
MATVEC_BF16(shoal_matvec_bf16_lb, matvec_bf16, true, LEAN)
MATVEC_BF16(shoal_matvec2_bf16, matvec2_bf16, true, )
MATVEC_BF16(shoal_matvec2_bf16_late, matvec2_bf16, false, )
MATVEC_BF16(shoal_matvec2_bf16_lb, matvec2_bf16, true, LEAN)

#define GATE_UP_BF16(NAME, EARLY, BOUNDS)                                                     \
    extern "C" __global__ void BOUNDS NAME(const bf16* __restrict__ gate, const bf16* __restrict__ up, \
                                    const float* __restrict__ x,                             \
                                    const bf16* __restrict__ norm_w, float eps,              \
                                    float* __restrict__ y, int rows, int k, int split) {     \
        gate_up_bf16<EARLY>(gate, up, x, norm_w, eps, y, rows, k, split);                    \
    }
GATE_UP_BF16(shoal_gate_up_bf16, true, )
GATE_UP_BF16(shoal_gate_up_bf16_late, false, )
GATE_UP_BF16(shoal_gate_up_bf16_lb, true, LEAN)
