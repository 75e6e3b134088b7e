// Attention of one token (or a batch's decode rows) over the cache, flash-decoding
// style, and the merge of its splits.
// Part of decode.cu's one translation unit, included there in order: it uses what
// the parts before it define.

#pragma once

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
