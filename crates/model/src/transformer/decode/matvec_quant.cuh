// Mat-vecs over GGUF's quantized blocks (Q8_0, Q4_K, Q6_K) against the 8-bit row.
// Part of decode.cu's one translation unit, included there in order: it uses what
// the parts before it define.

#pragma once

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
