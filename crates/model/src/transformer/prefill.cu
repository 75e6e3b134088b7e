// Kernels for many rows at once on an NVIDIA GPU (a prompt, a batch): the element-wise
// work around candle's cuBLAS products, fused where candle's path took several passes
// over memory (transformer/gpu_prefill.rs calls them).
//
// Tensors are bf16, row-major and contiguous; arithmetic is f32, rounded once on the way
// out.

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

typedef __nv_bfloat16 bf16;

#define WARP 32

// Attention probabilities from raw scores `q·k`, causal by position: `scores` is
// (batches, rows, s) with rows = group * t, the query of row r sitting at position
// s - t + r % t (the grouped layout of transformer.rs's `attend`), keys at 0..s. Each row
// becomes softmax(scale * scores) over the keys at or before its position, 0 after them.
// One warp a row: a pass for the running maximum and sum (the sum rescaled as the maximum
// grows), a pass to write. Replaces candle's scale, mask add and softmax (three passes
// over the scores, the mask add a broadcast at a fifth of the bandwidth).
extern "C" __global__ void shoal_causal_softmax(const bf16* __restrict__ scores,
                                                bf16* __restrict__ probs, int rows, int t,
                                                int s, float scale, size_t total_rows) {
    const size_t row = (size_t)blockIdx.x * (blockDim.x / WARP) + threadIdx.x / WARP;
    if (row >= total_rows) return;
    const int lane = threadIdx.x % WARP;
    const int r = (int)(row % rows);
    const int last = s - t + r % t;  // the last key this query sees
    const bf16* in = scores + row * s;
    bf16* out = probs + row * s;
    float m = -INFINITY, sum = 0.f;
    for (int j = lane; j <= last; j += WARP) {
        const float v = __bfloat162float(in[j]) * scale;
        if (v > m) {
            sum *= __expf(m - v);
            m = v;
        }
        sum += __expf(v - m);
    }
    // Merge the lanes' (max, sum) pairs.
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const float m2 = __shfl_xor_sync(0xffffffff, m, o);
        const float s2 = __shfl_xor_sync(0xffffffff, sum, o);
        const float mm = fmaxf(m, m2);
        sum = (m == -INFINITY ? 0.f : sum * __expf(m - mm)) +
              (m2 == -INFINITY ? 0.f : s2 * __expf(m2 - mm));
        m = mm;
    }
    const float inv = 1.f / sum;
    for (int j = lane; j < s; j += WARP) {
        const float p = j <= last ? __expf(__bfloat162float(in[j]) * scale - m) * inv : 0.f;
        out[j] = __float2bfloat16(p);
    }
}

__device__ __forceinline__ float silu(float g) { return g / (1.f + __expf(-g)); }

// out = silu(gate) * up, element-wise over n values, 8 at a time (n % 8 == 0).
extern "C" __global__ void shoal_silu_mul(const bf16* __restrict__ gate,
                                          const bf16* __restrict__ up, bf16* __restrict__ out,
                                          size_t n) {
    const size_t i = ((size_t)blockIdx.x * blockDim.x + threadIdx.x) * 8;
    if (i >= n) return;
    const uint4 g = *reinterpret_cast<const uint4*>(gate + i);
    const uint4 u = *reinterpret_cast<const uint4*>(up + i);
    const bf16* gv = reinterpret_cast<const bf16*>(&g);
    const bf16* uv = reinterpret_cast<const bf16*>(&u);
    uint4 o;
    bf16* ov = reinterpret_cast<bf16*>(&o);
#pragma unroll
    for (int k = 0; k < 8; k++)
        ov[k] = __float2bfloat16(silu(__bfloat162float(gv[k])) * __bfloat162float(uv[k]));
    *reinterpret_cast<uint4*>(out + i) = o;
}

// One projection's rows (t, heads * hd) as heads (heads, t, hd), its bias added and, when
// `cos` is not null, rotary embedding applied at positions pos..pos + t (`cos`/`sin`:
// (max_len, hd / 2) tables; interleaved pairs (2i, 2i + 1), or halves (i, i + hd / 2)).
// Grid (t, ceil(heads / blockDim.y)), blockDim (hd / 2, heads a block): a thread a pair.
extern "C" __global__ void shoal_to_heads(const bf16* __restrict__ x, const bf16* __restrict__ bias,
                                          const bf16* __restrict__ cos,
                                          const bf16* __restrict__ sin, bf16* __restrict__ out,
                                          int t, int heads, int hd, int pos, int interleaved) {
    const int tok = blockIdx.x, head = blockIdx.y * blockDim.y + threadIdx.y, i = threadIdx.x;
    if (head >= heads) return;
    const int half = hd / 2;
    const int a = interleaved ? 2 * i : i, b = interleaved ? 2 * i + 1 : i + half;
    const bf16* row = x + ((size_t)tok * heads + head) * hd;
    float x0 = __bfloat162float(row[a]), x1 = __bfloat162float(row[b]);
    if (bias) {
        x0 += __bfloat162float(bias[head * hd + a]);
        x1 += __bfloat162float(bias[head * hd + b]);
    }
    if (cos) {
        const float c = __bfloat162float(cos[(size_t)(pos + tok) * half + i]);
        const float sn = __bfloat162float(sin[(size_t)(pos + tok) * half + i]);
        const float y0 = x0 * c - x1 * sn, y1 = x0 * sn + x1 * c;
        x0 = y0;
        x1 = y1;
    }
    bf16* o = out + ((size_t)head * t + tok) * hd;
    o[a] = __float2bfloat16(x0);
    o[b] = __float2bfloat16(x1);
}

// Heads (heads, t, hd) back as rows (t, heads * hd): 16 bytes a thread, a token's row a
// block (grid (t, ceil(heads * hd / 8 / blockDim.x)).
extern "C" __global__ void shoal_from_heads(const bf16* __restrict__ x, bf16* __restrict__ out,
                                            int t, int heads, int hd) {
    const int tok = blockIdx.x;
    const int piece = blockIdx.y * blockDim.x + threadIdx.x;  // 8 values of the row
    if (piece * 8 >= heads * hd) return;
    const int head = piece * 8 / hd, i = piece * 8 % hd;
    const uint4 v = *reinterpret_cast<const uint4*>(x + ((size_t)head * t + tok) * hd + i);
    *reinterpret_cast<uint4*>(out + (size_t)tok * heads * hd + piece * 8) = v;
}

// GGUF blocks to bf16 weights, the matrix taken as one run of blocks (rows are whole
// blocks). For products over many rows: one pass here, then cuBLAS, beats 8-bit products
// that redo the blocks' arithmetic for every tile of rows.

// Eight weights as bf16 in one 16-byte store (`out` 16-byte aligned).
__device__ __forceinline__ void store8(bf16* out, const float v[8]) {
    uint4 o;
    __nv_bfloat162* p = reinterpret_cast<__nv_bfloat162*>(&o);
#pragma unroll
    for (int k = 0; k < 4; k++) p[k] = __floats2bfloat162_rn(v[2 * k], v[2 * k + 1]);
    *reinterpret_cast<uint4*>(out) = o;
}

// Q8_0: 34 bytes per 32 weights: f16 d, 32 int8. A thread per 8 weights.
extern "C" __global__ void shoal_dequant_q8_0(const uint8_t* __restrict__ w,
                                              bf16* __restrict__ out, size_t blocks) {
    const size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    const size_t b = i / 4;
    if (b >= blocks) return;
    const int g = (int)(i % 4) * 8;
    const uint8_t* blk = w + b * 34;
    const float d = __half2float(*reinterpret_cast<const __half*>(blk));
    const int8_t* q = reinterpret_cast<const int8_t*>(blk + 2 + g);
    float v[8];
#pragma unroll
    for (int k = 0; k < 8; k++) v[k] = d * q[k];
    store8(out + b * 32 + g, v);
}

// Q4_K: 144 bytes per 256 weights: f16 d, f16 dmin, 12 bytes of 6-bit scales and mins
// for 8 sub-blocks of 32, 128 bytes of 4-bit weights (sub-blocks 2j and 2j + 1 share 32
// bytes: low nibbles, then high). A thread per 8 bytes: 8 weights of each sub-block.
__device__ __forceinline__ void q4k_scale_min(int j, const uint8_t* q, int* sc, int* m) {
    if (j < 4) {
        *sc = q[j] & 63;
        *m = q[j + 4] & 63;
    } else {
        *sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
        *m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
}

extern "C" __global__ void shoal_dequant_q4k(const uint8_t* __restrict__ w,
                                             bf16* __restrict__ out, size_t blocks) {
    const size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    const size_t b = i / 16;
    if (b >= blocks) return;
    const int pair = (int)(i % 16) / 4, g = (int)(i % 4) * 8;
    const uint8_t* blk = w + b * 144;
    const float2 dm = __half22float2(*reinterpret_cast<const __half2*>(blk));
    int sc_lo, m_lo, sc_hi, m_hi;
    q4k_scale_min(2 * pair, blk + 4, &sc_lo, &m_lo);
    q4k_scale_min(2 * pair + 1, blk + 4, &sc_hi, &m_hi);
    const float d_lo = dm.x * sc_lo, min_lo = dm.y * m_lo;
    const float d_hi = dm.x * sc_hi, min_hi = dm.y * m_hi;
    const uint2 q = *reinterpret_cast<const uint2*>(blk + 16 + pair * 32 + g);
    const uint8_t* bytes = reinterpret_cast<const uint8_t*>(&q);
    float lo[8], hi[8];
#pragma unroll
    for (int k = 0; k < 8; k++) {
        lo[k] = d_lo * (bytes[k] & 0xF) - min_lo;
        hi[k] = d_hi * (bytes[k] >> 4) - min_hi;
    }
    store8(out + b * 256 + pair * 64 + g, lo);
    store8(out + b * 256 + pair * 64 + 32 + g, hi);
}

// Q6_K: 210 bytes per 256 weights: 128 bytes of low 4 bits, 64 of high 2 bits, 16 int8
// scales (one per 16 weights), f16 d; weight = d * scale * (q - 32). A thread per
// (half, 8 consecutive l): weights l, l + 32, l + 64, l + 96 of the half (ggml's order).
extern "C" __global__ void shoal_dequant_q6k(const uint8_t* __restrict__ w,
                                             bf16* __restrict__ out, size_t blocks) {
    const size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    const size_t b = i / 8;
    if (b >= blocks) return;
    const int half = (int)(i % 8) / 4, l0 = (int)(i % 4) * 8;
    const uint8_t* blk = w + b * 210;
    const uint8_t* ql = blk + half * 64 + l0;
    const uint8_t* qh = blk + 128 + half * 32 + l0;
    const int8_t* sc = reinterpret_cast<const int8_t*>(blk + 192) + half * 8 + l0 / 16;
    const float d = __half2float(*reinterpret_cast<const __half*>(blk + 208));
    const float d1 = d * sc[0], d2 = d * sc[2], d3 = d * sc[4], d4 = d * sc[6];
    float v1[8], v2[8], v3[8], v4[8];
#pragma unroll
    for (int k = 0; k < 8; k++) {
        const int lo = ql[k], lo2 = ql[k + 32], h = qh[k];
        v1[k] = d1 * (((lo & 0xF) | ((h & 3) << 4)) - 32);
        v2[k] = d2 * (((lo2 & 0xF) | (((h >> 2) & 3) << 4)) - 32);
        v3[k] = d3 * (((lo >> 4) | (((h >> 4) & 3) << 4)) - 32);
        v4[k] = d4 * (((lo2 >> 4) | (((h >> 6) & 3) << 4)) - 32);
    }
    bf16* o = out + b * 256 + half * 128 + l0;
    store8(o, v1);
    store8(o + 32, v2);
    store8(o + 64, v3);
    store8(o + 96, v4);
}
