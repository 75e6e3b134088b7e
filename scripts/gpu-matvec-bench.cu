// Read rate of bf16 mat-vec designs on the llama-8B decode shapes, standalone: which way
// of streaming weight rows comes nearest the H200's read rate (docs/GPU.md). Prints one
// line per (design, shape): microseconds a product and TB/s of weight bytes.
//   nvcc -O3 -gencode=arch=compute_90,code=sm_90 -o gpu-matvec-bench scripts/gpu-matvec-bench.cu
// Each shape cycles through enough copies of its matrix that L2 (60 MB) holds none of
// them between products, as a model's layers do.
#include <cuda_bf16.h>
#include <stdint.h>
#include <stdio.h>
#include <math.h>
#include <stdlib.h>

typedef __nv_bfloat16 bf16;

#define CHECK(e)                                                                   \
    do {                                                                           \
        cudaError_t err_ = (e);                                                    \
        if (err_ != cudaSuccess) {                                                 \
            fprintf(stderr, "%s:%d: %s\n", __FILE__, __LINE__, cudaGetErrorString(err_)); \
            exit(1);                                                               \
        }                                                                          \
    } while (0)

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffff, v, o);
    return v;
}

__device__ float block_sum(float v) {
    __shared__ float partial[32];
    __shared__ float total;
    v = warp_sum(v);
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    if (lane == 0) partial[warp] = v;
    __syncthreads();
    if (warp == 0) {
        float s = lane < (int)(blockDim.x / 32) ? partial[lane] : 0.f;
        s = warp_sum(s);
        if (lane == 0) total = s;
    }
    __syncthreads();
    return total;
}

__device__ __forceinline__ float dot8(uint4 w, const float* __restrict__ x) {
    const float4 a = *reinterpret_cast<const float4*>(x);
    const float4 b = *reinterpret_cast<const float4*>(x + 4);
    const __nv_bfloat162* p = reinterpret_cast<const __nv_bfloat162*>(&w);
    const float2 w0 = __bfloat1622float2(p[0]), w1 = __bfloat1622float2(p[1]);
    const float2 w2 = __bfloat1622float2(p[2]), w3 = __bfloat1622float2(p[3]);
    return w0.x * a.x + w0.y * a.y + w1.x * a.z + w1.y * a.w + w2.x * b.x + w2.y * b.y +
           w3.x * b.z + w3.y * b.w;
}

// The ceiling: every byte read once, consecutive threads on consecutive 16 bytes.
__global__ void read_all(const uint4* __restrict__ p, size_t n, float* out) {
    uint32_t acc = 0;
    const size_t stride = (size_t)gridDim.x * blockDim.x;
#pragma unroll 4
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += stride) {
        const uint4 v = __ldcs(p + i);
        acc ^= v.x ^ v.y ^ v.z ^ v.w;
    }
    if (acc == 0x12345678u) out[0] = 1.f;
}

// Today's design: a warp a row, 4 warps a block, each lane 16 bytes a load. ROT starts
// each row's walk at a different offset (rows 8 KB apart walked in step may fall on the
// same memory channels).
template <bool STREAM, int U, bool ROT>
__global__ void mv_warp(const bf16* __restrict__ W, const float* __restrict__ x,
                        float* __restrict__ y, int rows, int k) {
    const int lane = threadIdx.x % 32;
    const int r = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    if (r >= rows) return;
    const uint4* w = reinterpret_cast<const uint4*>(W + (size_t)r * k);
    const int n8 = k / 8;
    const int rot = ROT ? ((r * 37) % (n8 / 32)) * 32 : 0;
    float acc = 0.f;
#pragma unroll U
    for (int i = lane; i < n8; i += 32) {
        int j = i + rot;
        if (j >= n8) j -= n8;
        const uint4 v = STREAM ? __ldcs(w + j) : __ldg(w + j);
        acc += dot8(v, x + 8 * j);
    }
    acc = warp_sum(acc);
    if (lane == 0) y[r] = acc;
}

// A warp a row with U loads issued before any is used (explicit registers).
template <int U>
__global__ void mv_warp_regs(const bf16* __restrict__ W, const float* __restrict__ x,
                             float* __restrict__ y, int rows, int k) {
    const int lane = threadIdx.x % 32;
    const int r = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    if (r >= rows) return;
    const uint4* w = reinterpret_cast<const uint4*>(W + (size_t)r * k);
    const int n8 = k / 8;
    float acc = 0.f;
    for (int base = lane; base < n8; base += 32 * U) {
        uint4 v[U];
#pragma unroll
        for (int u = 0; u < U; u++) {
            const int i = base + 32 * u;
            v[u] = i < n8 ? __ldcs(w + i) : make_uint4(0, 0, 0, 0);
        }
#pragma unroll
        for (int u = 0; u < U; u++) {
            const int i = base + 32 * u;
            if (i < n8) acc += dot8(v[u], x + 8 * i);
        }
    }
    acc = warp_sum(acc);
    if (lane == 0) y[r] = acc;
}

// As mv_warp_regs, the loads as volatile asm so that the compiler keeps all U of them
// ahead of the first use (it otherwise sinks each load to its use: one or two in flight).
__device__ __forceinline__ uint4 ld_stream(const uint4* p) {
    uint4 v;
    asm volatile("ld.global.cs.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p));
    return v;
}
__device__ __forceinline__ uint4 ld_nc_na(const uint4* p) {
    uint4 v;
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p));
    return v;
}
template <int U, bool NC>
__global__ void mv_warp_asm(const bf16* __restrict__ W, const float* __restrict__ x,
                            float* __restrict__ y, int rows, int k) {
    const int lane = threadIdx.x % 32;
    const int r = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    if (r >= rows) return;
    const uint4* w = reinterpret_cast<const uint4*>(W + (size_t)r * k);
    const int n8 = k / 8;
    float acc = 0.f;
    int base = lane;
    for (; base + 32 * (U - 1) < n8; base += 32 * U) {
        uint4 v[U];
#pragma unroll
        for (int u = 0; u < U; u++) v[u] = NC ? ld_nc_na(w + base + 32 * u) : ld_stream(w + base + 32 * u);
#pragma unroll
        for (int u = 0; u < U; u++) acc += dot8(v[u], x + 8 * (base + 32 * u));
    }
    for (; base < n8; base += 32) acc += dot8(ld_stream(w + base), x + 8 * base);
    acc = warp_sum(acc);
    if (lane == 0) y[r] = acc;
}

// A block a few rows, its warps side by side along each row: at every step the block
// reads blockDim * 16 contiguous bytes.
__global__ void mv_block(const bf16* __restrict__ W, const float* __restrict__ x,
                         float* __restrict__ y, int rows, int k, int rows_per_block) {
    const int n8 = k / 8;
    for (int rr = 0; rr < rows_per_block; rr++) {
        const int r = blockIdx.x * rows_per_block + rr;
        if (r >= rows) return;
        const uint4* w = reinterpret_cast<const uint4*>(W + (size_t)r * k);
        float acc = 0.f;
#pragma unroll 4
        for (int i = threadIdx.x; i < n8; i += blockDim.x) acc += dot8(__ldcs(w + i), x + 8 * i);
        acc = block_sum(acc);
        if (threadIdx.x == 0) y[r] = acc;
    }
}

// Hopper bulk copies: one thread streams the block's rows (contiguous in memory) into a
// ring of `stages` shared-memory chunks, each completing on its mbarrier; all threads
// take each chunk's dot products from shared memory.
__device__ __forceinline__ uint32_t smem_addr(const void* p) {
    return (uint32_t)__cvta_generic_to_shared(p);
}
__device__ __forceinline__ void mbar_init(uint64_t* bar, int count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_addr(bar)), "r"(count));
}
__device__ __forceinline__ void mbar_expect(uint64_t* bar, uint32_t bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_addr(bar)),
                 "r"(bytes)
                 : "memory");
}
__device__ __forceinline__ void mbar_wait(uint64_t* bar, uint32_t parity) {
    asm volatile(
        "{\n"
        ".reg .pred done;\n"
        "wait:\n"
        "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
        "@!done bra wait;\n"
        "}\n" ::"r"(smem_addr(bar)),
        "r"(parity)
        : "memory");
}
__device__ __forceinline__ void bulk_copy(void* dst, const void* src, uint32_t bytes,
                                          uint64_t* bar) {
    asm volatile(
        "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
            smem_addr(dst)),
        "l"(src), "r"(bytes), "r"(smem_addr(bar))
        : "memory");
}

#define MAX_STAGES 8
__global__ void mv_bulk(const bf16* __restrict__ W, const float* __restrict__ x,
                        float* __restrict__ y, int rows, int k, int rows_per_block, int chunk,
                        int stages) {
    extern __shared__ __align__(128) uint8_t ring[];
    __shared__ __align__(8) uint64_t full[MAX_STAGES];
    const int r0 = blockIdx.x * rows_per_block;
    const int nrows = min(rows_per_block, rows - r0);
    if (nrows <= 0) return;
    const int per_row = (int)((size_t)k * 2 / chunk);
    const int total = nrows * per_row;
    const uint8_t* src = reinterpret_cast<const uint8_t*>(W + (size_t)r0 * k);
    if (threadIdx.x == 0) {
        for (int s = 0; s < stages; s++) mbar_init(&full[s], 1);
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
        for (int c = 0; c < stages && c < total; c++) {
            mbar_expect(&full[c], chunk);
            bulk_copy(ring + (size_t)c * chunk, src + (size_t)c * chunk, chunk, &full[c]);
        }
    }
    __syncthreads();
    float acc = 0.f;
    const int elems = chunk / 2;
    for (int c = 0; c < total; c++) {
        const int s = c % stages;
        mbar_wait(&full[s], (c / stages) & 1);
        const int row = c / per_row, col0 = (c % per_row) * elems;
        const uint4* buf = reinterpret_cast<const uint4*>(ring + (size_t)s * chunk);
        for (int i = threadIdx.x; i < chunk / 16; i += blockDim.x)
            acc += dot8(buf[i], x + col0 + 8 * i);
        if ((c + 1) % per_row == 0) {
            const float t = block_sum(acc);  // also: every thread is done with chunk s
            if (threadIdx.x == 0) y[r0 + row] = t;
            acc = 0.f;
        } else {
            __syncthreads();
        }
        if (threadIdx.x == 0 && c + stages < total) {
            mbar_expect(&full[s], chunk);
            bulk_copy(ring + (size_t)s * chunk, src + (size_t)(c + stages) * chunk, chunk,
                      &full[s]);
        }
    }
}

struct Shape {
    const char* name;
    int rows, k;
};

static float g_ms;

// Average microseconds of one product of `shape`, the launch `go(W, y)` cycling over
// copies of the matrix.
template <typename F>
static double time_us(const Shape& sh, bf16* base, size_t copies, float* y, F go) {
    const size_t bytes = (size_t)sh.rows * sh.k * 2;
    for (int i = 0; i < 3; i++) go(base + (size_t)(i % copies) * sh.rows * sh.k, y);
    CHECK(cudaGetLastError());
    cudaEvent_t a, b;
    cudaEventCreate(&a);
    cudaEventCreate(&b);
    const int n = 200;
    cudaEventRecord(a);
    for (int i = 0; i < n; i++) go(base + (size_t)(i % copies) * sh.rows * sh.k, y);
    cudaEventRecord(b);
    CHECK(cudaEventSynchronize(b));
    CHECK(cudaGetLastError());
    cudaEventElapsedTime(&g_ms, a, b);
    (void)bytes;
    return g_ms * 1000.0 / n;
}

static float* g_y;

// Prints the design's rate, or that its products are wrong (every row's must be k times
// bf16 0x3c3c).
static void report(const char* design, const Shape& sh, double us) {
    const double bytes = (double)sh.rows * sh.k * 2;
    float first, last;
    CHECK(cudaMemcpy(&first, g_y, 4, cudaMemcpyDeviceToHost));
    CHECK(cudaMemcpy(&last, g_y + sh.rows - 1, 4, cudaMemcpyDeviceToHost));
    const float want = sh.k * 0.011474609375f;
    const bool ok = fabsf(first - want) < 1e-3f * want && fabsf(last - want) < 1e-3f * want;
    printf("%-28s %-8s %6d x %5d  %8.2f us  %5.2f TB/s%s\n", design, sh.name, sh.rows, sh.k, us,
           bytes / us / 1e6, ok ? "" : "  WRONG");
    CHECK(cudaMemset(g_y, 0, (size_t)sh.rows * 4));
    fflush(stdout);
}

int main() {
    const size_t pool = (size_t)8 << 30;  // 8 GiB of weights
    bf16* W;
    float *x, *y;
    CHECK(cudaMalloc(&W, pool));
    CHECK(cudaMalloc(&x, 14336 * 4 * 4));
    CHECK(cudaMalloc(&y, 128256 * 4 * 4));
    g_y = y;
    CHECK(cudaMemset(W, 0x3c, pool));
    {  // x = 1: every product is k times the one weight value
        float* ones = (float*)malloc(14336 * 4 * 4);
        for (int i = 0; i < 14336 * 4; i++) ones[i] = 1.f;
        CHECK(cudaMemcpy(x, ones, 14336 * 4 * 4, cudaMemcpyHostToDevice));
        free(ones);
    }
    cudaDeviceProp prop;
    CHECK(cudaGetDeviceProperties(&prop, 0));
    printf("%s: %d SMs, L2 %d MB\n", prop.name, prop.multiProcessorCount, prop.l2CacheSize >> 20);
    CHECK(cudaFuncSetAttribute(mv_bulk, cudaFuncAttributeMaxDynamicSharedMemorySize, 200 * 1024));

    {  // the ceiling
        const size_t n = pool / 16;
        for (int blocks : {prop.multiProcessorCount * 4, prop.multiProcessorCount * 8,
                           prop.multiProcessorCount * 16}) {
            read_all<<<blocks, 256>>>((const uint4*)W, n, y);
            cudaEvent_t a, b;
            cudaEventCreate(&a);
            cudaEventCreate(&b);
            cudaEventRecord(a);
            for (int i = 0; i < 5; i++) read_all<<<blocks, 256>>>((const uint4*)W, n, y);
            cudaEventRecord(b);
            CHECK(cudaEventSynchronize(b));
            float ms;
            cudaEventElapsedTime(&ms, a, b);
            printf("read_all %d blocks x 256: %.2f TB/s\n", blocks, 5.0 * pool / (ms * 1e9));
        }
    }

    const Shape shapes[] = {{"qkv", 6144, 4096},
                            {"o", 4096, 4096},
                            {"gate+up", 28672, 4096},
                            {"down", 4096, 14336},
                            {"lm_head", 128256, 4096}};
    for (const Shape& sh : shapes) {
        const size_t m = (size_t)sh.rows * sh.k;
        const size_t copies = pool / 2 / m;
        auto warp_grid = [&](int warps) { return (sh.rows + warps - 1) / warps; };
#define WARP_DESIGN(NAME, KERNEL, WARPS)                                              \
    report(NAME, sh, time_us(sh, W, copies, y, [&](bf16* w, float* yy) {              \
               KERNEL<<<warp_grid(WARPS), 32 * WARPS>>>(w, x, yy, sh.rows, sh.k);      \
           }))
        WARP_DESIGN("warp ldcs u4 (today)", (mv_warp<true, 4, false>), 4);
        WARP_DESIGN("warp ldg u4", (mv_warp<false, 4, false>), 4);
        WARP_DESIGN("warp ldcs u8", (mv_warp<true, 8, false>), 4);
        WARP_DESIGN("warp ldcs u4 rotated", (mv_warp<true, 4, true>), 4);
        WARP_DESIGN("warp ldcs u4 8 warps", (mv_warp<true, 4, false>), 8);
        WARP_DESIGN("warp regs 4", mv_warp_regs<4>, 4);
        WARP_DESIGN("warp regs 8", mv_warp_regs<8>, 4);
        WARP_DESIGN("warp regs 16", mv_warp_regs<16>, 4);
        WARP_DESIGN("warp asm cs 4", (mv_warp_asm<4, false>), 4);
        WARP_DESIGN("warp asm cs 8", (mv_warp_asm<8, false>), 4);
        WARP_DESIGN("warp asm cs 16", (mv_warp_asm<16, false>), 4);
        WARP_DESIGN("warp asm nc 8", (mv_warp_asm<8, true>), 4);
        WARP_DESIGN("warp asm cs 8, 8 warps", (mv_warp_asm<8, false>), 8);
        for (int threads : {128, 256}) {
            for (int rpb : {1, 4}) {
                char name[64];
                snprintf(name, sizeof name, "block %d thr %d rows", threads, rpb);
                report(name, sh, time_us(sh, W, copies, y, [&](bf16* w, float* yy) {
                           mv_block<<<(sh.rows + rpb - 1) / rpb, threads>>>(w, x, yy, sh.rows,
                                                                              sh.k, rpb);
                       }));
            }
        }
        for (int chunk : {2048, 4096, 8192}) {
            for (int stages : {4, 8}) {
                for (int rpb : {1, 2, 4, 8}) {
                    for (int threads : {128, 256}) {
                        if ((size_t)sh.k * 2 % chunk) continue;
                        if ((size_t)chunk * stages > 96 * 1024) continue;
                        char name[64];
                        snprintf(name, sizeof name, "bulk c%d s%d r%d t%d", chunk, stages, rpb,
                                 threads);
                        report(name, sh, time_us(sh, W, copies, y, [&](bf16* w, float* yy) {
                                   mv_bulk<<<(sh.rows + rpb - 1) / rpb, threads,
                                             (size_t)chunk * stages>>>(w, x, yy, sh.rows, sh.k,
                                                                       rpb, chunk, stages);
                               }));
                    }
                }
            }
        }
    }
    return 0;
}
