// wgmma_probe — the primitives of wgmma.cuh one at a time (wgmma_probe.cuh says what each case
// checks). Shared memory: A at 0 (up to 64 rows x 512 BF16 = 64 KB; GROUPS' second staging at
// 8 KB), B at 64 KB (up to 64 KB; GROUPS' second at 64 KB + 4 KB), 1024-byte aligned at run time.
#include "backend/cuda/common.cuh"
#include "backend/cuda/wgmma.cuh"
#include "backend/cuda/wgmma_probe.cuh"

namespace {

enum { WGP_THREADS = 256, WGP_B_OFF = 64 * 1024, WGP_SMEM = 128 * 1024 + 1024 };

const di_cuda_wgmma_probe_shape k_shapes[DI_CUDA_WGMMA_PROBE_N] = {
    {32, 64, 1, 1, 1,
     "SS: m64n32k16, A and B K-major (descriptor, 128B swizzle, SBO, k advance in the atom, "
     "scale-d, accumulator map)"},
    {64, 512, 1, 1, 1,
     "SS_K512: S = Q K^T's m64n32k16 over K = 512 (8 column blocks), two warpgroups on B rows "
     "32g.."},
    {512, 64, 0, 1, 1,
     "TNSPB: P V's m64n256k16 with B MN-major (tnspB, LBO), two warpgroups on N 256g.."},
    {32, 64, 1, 2, 1,
     "RESTAGE: operands rewritten by ordinary stores after wait_group 0 (fence.proxy.async), "
     "accumulated"},
    {32, 64, 1, 2, 2, "GROUPS: two commit groups in flight, wait_group 1 then 0"},
};

#if DI_WG_ENABLED
// Row-major global [rows][cols] BF16 -> the SW128 tile at dst (16-byte pieces), all threads.
__device__ void wgp_stage(uint8_t *dst, const uint16_t *src, int rows, int cols) {
    for (int i = threadIdx.x; i < rows * cols / 8; i += blockDim.x) {
        const int r = i / (cols / 8), c = (i % (cols / 8)) * 8;
        *(uint4 *)(dst + di_wg_tile_off(r, c, rows)) = *(const uint4 *)(src + (size_t)r * cols + c);
    }
    wg_fence_proxy_async(); // ordinary stores, read next by wgmma (the async proxy)
}

// acc (m64n32) += A B over K (K-major A at a_s, K-major B rows r0.. of a tile of b_rows rows).
__device__ __forceinline__ void wgp_ss(float (&acc)[16], uint32_t a_s, uint32_t b_s, int b_rows,
                                       int r0, int K, bool first) {
    wg_fence_regs(acc);
    wg_fence();
    for (int k0 = 0; k0 < K; k0 += 16)
        wg_m64n32k16_ss(acc, di_wg_desc_kmajor(a_s, 64, 0, k0),
                        di_wg_desc_kmajor(b_s, b_rows, r0, k0), first && k0 == 0 ? 0 : 1);
    wg_commit();
}

// The accumulators (after their wait_group) through the fragment map into d [64][ld] at column
// c0; each register fenced first (as the kernel does), so no read moves above the wait.
template <int NR>
__device__ __forceinline__ void wgp_store(float (&acc)[NR], float *d, int ld, int c0) {
    const int t = threadIdx.x % 128;
    wg_fence_regs(acc);
#pragma unroll
    for (int i = 0; i < NR; i++) d[di_wg_acc_row(t, i) * ld + c0 + di_wg_acc_col(t, i)] = acc[i];
}
#endif

__global__ void __launch_bounds__(WGP_THREADS, 1)
    wgmma_probe_kernel(int which, int n, int k, const uint16_t *__restrict__ a,
                       const uint16_t *__restrict__ b, float *__restrict__ d,
                       int *__restrict__ ran) {
#if DI_WG_ENABLED
    extern __shared__ uint8_t wgp_smem[];
    uint8_t *sm =
        wgp_smem + ((1024u - ((uint32_t)__cvta_generic_to_shared(wgp_smem) & 1023u)) & 1023u);
    const uint32_t a_s = (uint32_t)__cvta_generic_to_shared(sm), b_s = a_s + WGP_B_OFF;
    const int wg = threadIdx.x / 128;
    struct {
        int n, k;
    } sh = {n, k};
    if (threadIdx.x == 0) *ran = 1;
    if (which == DI_CUDA_WGMMA_PROBE_SS || which == DI_CUDA_WGMMA_PROBE_SS_K512) {
        wgp_stage(sm, a, 64, sh.k);
        wgp_stage(sm + WGP_B_OFF, b, sh.n, sh.k);
        __syncthreads();
        if (which == DI_CUDA_WGMMA_PROBE_SS && wg > 0) return;
        float acc[16];
#pragma unroll
        for (int i = 0; i < 16; i++) acc[i] = 0.0f;
        wgp_ss(acc, a_s, b_s, sh.n, 32 * wg, sh.k, true);
        wg_wait<0>();
        wgp_store(acc, d, sh.n, 32 * wg);
    } else if (which == DI_CUDA_WGMMA_PROBE_TNSPB) {
        wgp_stage(sm, a, 64, sh.k);
        wgp_stage(sm + WGP_B_OFF, b, sh.k, sh.n); // [K][N]: rows = K
        __syncthreads();
        float acc[128];
#pragma unroll
        for (int i = 0; i < 128; i++) acc[i] = 0.0f;
        wg_fence_regs(acc);
        wg_fence();
#pragma unroll
        for (int k0 = 0; k0 < 64; k0 += 16)
            wg_m64n256k16_ss_tb(acc, di_wg_desc_kmajor(a_s, 64, 0, k0),
                                di_wg_desc_mnmajor(b_s, sh.k, k0, 256 * wg), 1);
        wg_commit();
        wg_wait<0>();
        wgp_store(acc, d, sh.n, 256 * wg);
    } else if (which == DI_CUDA_WGMMA_PROBE_RESTAGE) {
        float acc[16];
#pragma unroll
        for (int i = 0; i < 16; i++) acc[i] = 0.0f;
        for (int s = 0; s < 2; s++) {
            if (s > 0) __syncthreads(); // every warpgroup's MMAs on staging 0 are done
            wgp_stage(sm, a + (size_t)s * 64 * sh.k, 64, sh.k);
            wgp_stage(sm + WGP_B_OFF, b + (size_t)s * sh.n * sh.k, sh.n, sh.k);
            __syncthreads();
            if (wg == 0) {
                wgp_ss(acc, a_s, b_s, sh.n, 0, sh.k, s == 0);
                wg_wait<0>();
            }
        }
        if (wg == 0) wgp_store(acc, d, sh.n, 0);
    } else if (which == DI_CUDA_WGMMA_PROBE_GROUPS) {
        wgp_stage(sm, a, 64, sh.k);
        wgp_stage(sm + 8192, a + (size_t)64 * sh.k, 64, sh.k);
        wgp_stage(sm + WGP_B_OFF, b, sh.n, sh.k);
        wgp_stage(sm + WGP_B_OFF + 4096, b + (size_t)sh.n * sh.k, sh.n, sh.k);
        __syncthreads();
        if (wg > 0) return;
        float acc0[16], acc1[16];
#pragma unroll
        for (int i = 0; i < 16; i++) acc0[i] = acc1[i] = 0.0f;
        wgp_ss(acc0, a_s, b_s, sh.n, 0, sh.k, true);
        wgp_ss(acc1, a_s + 8192, b_s + 4096, sh.n, 0, sh.k, true);
        wg_wait<1>();
        wgp_store(acc0, d, sh.n, 0);
        wg_wait<0>();
        wgp_store(acc1, d + 64 * sh.n, sh.n, 0);
    }
#else
    (void)which, (void)n, (void)k, (void)a, (void)b, (void)d;
    if (threadIdx.x == 0 && blockIdx.x == 0) *ran = 2; // no wgmma in this target's code
#endif
}

} // namespace

extern "C" di_cuda_wgmma_probe_shape di_cuda_wgmma_probe_shape_of(int which) {
    if (which < 0 || which >= DI_CUDA_WGMMA_PROBE_N) {
        const di_cuda_wgmma_probe_shape none = {0, 0, 0, 0, 0, NULL};
        return none;
    }
    return k_shapes[which];
}

extern "C" bool di_cuda_wgmma_available(di_cuda *cu) {
    if (cu->cc_major != 9 || cu->cc_minor != 0) return false;
    cudaFuncAttributes fa;
    if (cudaFuncGetAttributes(&fa, (const void *)wgmma_probe_kernel) != cudaSuccess) {
        (void)cudaGetLastError();
        return false;
    }
    return fa.binaryVersion == 90;
}

extern "C" di_status di_cuda_wgmma_probe(di_cuda *cu, int which, const uint16_t *a,
                                         const uint16_t *b, float *d, int *ran_dev) {
    if (which < 0 || which >= DI_CUDA_WGMMA_PROBE_N) return DI_ERR_INVALID;
    static di_smem_kernel smem_k;
    const di_status fit =
        di_cuda_smem_fit(cu, &smem_k, (const void *)wgmma_probe_kernel, WGP_SMEM, NULL);
    if (fit == DI_ERR_INVALID) return DI_ERR_UNSUPPORTED;
    if (fit != DI_OK) return fit;
    wgmma_probe_kernel<<<1, WGP_THREADS, WGP_SMEM, di_stream(cu)>>>(
        which, k_shapes[which].n, k_shapes[which].k, a, b, d, ran_dev);
    return di_cuda_check_launch("wgmma_probe_kernel");
}
