/*
 * wgmma_probe — one small kernel per wgmma primitive the attention kernel uses (wgmma.cuh,
 * wgmma_layout.h), so a GPU session's first run says which one is wrong before the attention
 * kernel's own test or its check-once guard does: test_cuda_wgmma runs every case against a host
 * GEMM and scripts/gpu-check runs it before the op tests (its summary names the failed case).
 *
 * Each case stages its operands from global memory into shared memory with ordinary 16-byte stores
 * in the SW128 k-blocked layout (wgmma_layout.h), fences them to the async proxy, runs its MMAs
 * and writes the accumulators through the fragment map; M is 64 always:
 *   SS       m64n32k16, A and B K-major, K = 64 (4 steps): the descriptor, the 128-byte swizzle,
 *            SBO, the start-address advance inside a swizzle atom, scale-d 0 then 1, the map;
 *   SS_K512  the attention's S = Q K^T: K = 512 (32 steps across 8 column blocks), two
 *            warpgroups, warpgroup g taking B rows 32 g .. 32 g + 31 (N = 64 in all);
 *   TNSPB    the attention's O = P V: m64n256k16 with B MN-major (tnspB = 1, LBO = the next 64
 *            columns), K = 64, two warpgroups taking N columns 256 g .. (N = 512 in all);
 *   RESTAGE  the attention's per-tile pattern: SS's product, wait_group 0, the same shared
 *            buffers rewritten by ordinary stores (fence.proxy.async, barrier), a second product
 *            accumulated (scale-d 1): D = A0 B0 + A1 B1;
 *   GROUPS   two commit groups in flight (two buffers, two accumulators): wait_group 1 makes the
 *            first readable while the second may run, then wait_group 0.
 * Operands are BF16 bit patterns, row-major in global memory: A [S][64][K], B [S][N][K] (K-major
 * cases) or [S][K][N] (TNSPB), S = 2 stagings for RESTAGE and GROUPS, else 1; D FP32 [64][N]
 * ([2][64][N] for GROUPS). What a case cannot show: a missing fence.proxy.async is a race that
 * may pass; the probe has the fences the kernel has.
 *
 * Thread-safety: engine thread only (the context's stream).
 */
#pragma once

#include <stdbool.h>
#include <stdint.h>

#include "backend/cuda/cuda_backend.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef enum di_cuda_wgmma_probe_case {
    DI_CUDA_WGMMA_PROBE_SS = 0,
    DI_CUDA_WGMMA_PROBE_SS_K512,
    DI_CUDA_WGMMA_PROBE_TNSPB,
    DI_CUDA_WGMMA_PROBE_RESTAGE,
    DI_CUDA_WGMMA_PROBE_GROUPS,
    DI_CUDA_WGMMA_PROBE_N
} di_cuda_wgmma_probe_case;

// The case's shape: N and K of D = A B (M = 64), whether B is K-major ([N][K]) or MN-major
// ([K][N]), the number of operand stagings and of D matrices; and its one-line description (the
// primitive it checks). NULL / zeros for a value outside the enum.
typedef struct di_cuda_wgmma_probe_shape {
    int n, k, b_kmajor, n_stage, n_out;
    const char *what;
} di_cuda_wgmma_probe_shape;
di_cuda_wgmma_probe_shape di_cuda_wgmma_probe_shape_of(int which);

// Whether this device runs the wgmma kernels: compute capability 9.0 and sm_90a machine code for
// it in this binary (the probe kernel's binaryVersion is 90; a build without compute_90a runs
// sm_80 code there). CUDA errors count as false.
bool di_cuda_wgmma_available(di_cuda *cu);

// Runs probe case `which` on device operands a, b into d (layouts above); *ran_dev (a device int)
// gets 1 from the sm_90a kernel, 2 from the stub compiled for other targets (which writes nothing
// else). Enqueued. DI_ERR_INVALID (case), DI_ERR_UNSUPPORTED (shared memory), DI_ERR_CUDA.
di_status di_cuda_wgmma_probe(di_cuda *cu, int which, const uint16_t *a, const uint16_t *b,
                              float *d, int *ran_dev);

#ifdef __cplusplus
}
#endif
