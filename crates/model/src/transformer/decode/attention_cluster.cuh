// Attention and its merge as one kernel of thread-block clusters (Hopper), and the
// output projection inside it (a variant).
// Part of decode.cu's one translation unit, included there in order: it uses what
// the parts before it define.

#pragma once

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
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;"
                 : "=r"(out)
                 : "r"(smem_addr(p)), "r"(rank));
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
