// Per-head norm, rope and the KV append where the projection does not do them.
// Part of decode.cu's one translation unit, included there in order: it uses what
// the parts before it define.

#pragma once

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
