/*
 * wgmma — the Hopper (sm_90a) warpgroup MMA instructions the wgmma kernels use, as inline-PTX
 * wrappers: wgmma.fence / commit_group / wait_group, fence.proxy.async (shared memory written by
 * ordinary stores and read next by wgmma, which reads through the async proxy: each writing thread
 * fences before the barrier that publishes the data), and the two MMA shapes of the attention
 * kernel (attn.cu "attention on wgmma"): m64n32k16 with A and B K-major in shared memory
 * (S = Q K^T) and m64n256k16 with B MN-major (tnspB = 1: P V, V = the key tile read along the
 * dims). The descriptors, the swizzled tile layout and the accumulator map are wgmma_layout.h's
 * (host-checked by tests/unit/test_wgmma_layout.c); wgmma_probe.cu runs each instruction here
 * against a host GEMM (test_cuda_wgmma, scripts/gpu-check's first step).
 *
 * DI_WG_ENABLED is 1 only in the sm_90a device pass (__CUDA_ARCH_FEAT_SM90_ALL: the "a" features;
 * plain sm_90, sm_80 and sm_100 have no wgmma of this form): everything below exists only there,
 * and a kernel using it compiles to a stub elsewhere (its callers check
 * di_cuda_wgmma_available(), wgmma_probe.cuh). C++ (nvcc) only.
 *
 * Thread-safety: device code; each MMA is issued by all 128 threads of a warpgroup (4 consecutive
 * warps from a warp index divisible by 4), converged.
 */
#pragma once

#include <stdint.h>

#include "backend/cuda/wgmma_layout.h" // di_wg_desc_*, di_wg_tile_off, di_wg_acc_*

#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define DI_WG_ENABLED 1
#else
#define DI_WG_ENABLED 0
#endif

#if DI_WG_ENABLED

// Orders this thread's register accesses to the accumulators before the next wgmma (required
// before the first MMA that reads accumulators other instructions wrote).
__device__ __forceinline__ void wg_fence() {
    asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
}
// Closes the group of MMAs issued since the last commit.
__device__ __forceinline__ void wg_commit() {
    asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}
// Waits until at most N committed groups are pending (N = 0: all of them done, their
// accumulators readable and their shared-memory operands free).
template <int N> __device__ __forceinline__ void wg_wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
// Makes this thread's ordinary (generic-proxy) shared-memory stores visible to the async proxy
// (wgmma's operand reads); a barrier after it publishes them to the other threads' MMAs.
__device__ __forceinline__ void wg_fence_proxy_async() {
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}
// Keeps the compiler from moving accesses of an accumulator register across the asm around it
// (CUTLASS's warpgroup_fence_operand).
__device__ __forceinline__ void wg_fence_reg(float &r) {
    asm volatile("" : "+f"(r)::"memory");
}
// Every register of an accumulator fenced: before wg_fence (writes to it stay above: else
// ptxas sinks them below wgmma.fence and injects a warpgroup.arrive, C7519) and after the wait
// (reads stay below).
template <int N> __device__ __forceinline__ void wg_fence_regs(float (&r)[N]) {
#pragma unroll
    for (int i = 0; i < N; i++) wg_fence_reg(r[i]);
}

// d (m64n32, 16 registers) = A (64 x 16, K-major, descriptor da) * B (16 x 32, K-major: 32 rows
// of K, descriptor db) + (scale_d ? d : 0). Asynchronous: commit and wait before reading d.
__device__ __forceinline__ void wg_m64n32k16_ss(float (&d)[16], uint64_t da, uint64_t db,
                                                int scale_d) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %18, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 {"
                 "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15"
                 "}, %16, %17, p, 1, 1, 0, 0;\n}\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]),
                   "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]),
                   "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
                 : "l"(da), "l"(db), "r"(scale_d));
}

// d (m64n256, 128 registers) = A (64 x 16, K-major, da) * B (16 x 256, MN-major: tnspB, db)
// + (scale_d ? d : 0). Asynchronous as above.
__device__ __forceinline__ void wg_m64n256k16_ss_tb(float (&d)[128], uint64_t da, uint64_t db,
                                                    int scale_d) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %130, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 {"
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
        "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
        "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, "
        "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, "
        "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, "
        "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, "
        "%111, "
        "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, "
        "%127"
        "}, %128, %129, p, 1, 1, 0, 1;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),
          "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]),
          "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]),
          "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]),
          "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]),
          "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]),
          "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]),
          "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
          "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]),
          "+f"(d[63]), "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]),
          "+f"(d[70]), "+f"(d[71]), "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]),
          "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]),
          "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), "+f"(d[88]), "+f"(d[89]), "+f"(d[90]),
          "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]), "+f"(d[96]), "+f"(d[97]),
          "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]),
          "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]),
          "+f"(d[110]), "+f"(d[111]), "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]),
          "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]), "+f"(d[120]), "+f"(d[121]),
          "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])
        : "l"(da), "l"(db), "r"(scale_d));
}

#endif // DI_WG_ENABLED
