// bench_cuda — kernel benchmarks of the CUDA backend at true DeepSeek-V4-Flash shapes, with
// synthetic weights generated on the device (no checkpoint needed). Not a test: correctness is
// tests/backend/cuda (run first by scripts/gpu-check).
//
// Sections (each prints a table; `--only NAME` runs one):
//   copy     device-to-device copy bandwidth (bytes read + written): the HBM ceiling used below;
//            and a read-only stream (2 x 2 GiB): how much faster HBM reads than it copies, i.e.
//            how optimistic the roofline figures below may be for read-dominated decode
//   gemm     FP8 128x128 block-scaled GEMM/GEMV (di_cuda_matmul) at M = 1 ... 8192 tokens on the
//            V4-Flash projection shapes, against cuBLASLt FP8 (per-tensor scale, BF16 out) on the
//            same shape: TFLOP/s, weight GB/s, ratio; and the official recipe's prefill path (A8
//            activations + cuBLASLt FP8 128x128 block-scaled, timed with its A8 quantisation) vs
//            the same per-tensor cuBLASLt; both cuBLASLt results checked first ("check": BAD)
//   moe      one MoE layer (E=256, K=6, D=4096, F=2048, FP4 experts + FP8 shared) at 1 ... 4096
//            tokens: time, tokens/s, GB/s of the experts actually touched
//   attn     sink attention over FP8 584-byte KV rows at 4k ... 128k context (CSA: window + top-512
//            entries; HCA: window + every L/128 entry; dense: window + every L/4 entry), batch 1
//            and 64 sequences, the exact FP32 kernel, the BF16 tensor-core kernel (mma.sync) and
//            its wgmma instance (cc 9.0: di_cuda_attn_wg, "-" elsewhere): effective GB/s (KV rows +
//            indices + q + o), the ratios to copy and (wgmma) to the 3,000 GB/s goal, wgmma's
//            largest difference from the FP32 kernel; copies of the rows rotated per call
//            (>= 256 MB: a batch-64 CSA call's 24 MB fits L2)
//   codes    V4.1's attention over its compact codes (Q8 window rows + Q4e entries, 64 heads,
//            dh 512, round_p) at 4k ... 128k keys at batch 1 and 8k at batch 64, the FP32 kernel
//            (di_cuda_attn_codes), the BF16 tensor-core one (di_cuda_attn_codes_bf16) and its
//            wgmma instance (cc 9.0: di_cuda_attn_codes_wg): effective GB/s (code rows + indices
//            + q + o), the ratios to copy, to the FP32 kernel and (wgmma) to the 3,000 GB/s goal,
//            each tensor-core kernel's largest difference from the FP32 kernel
//   layer    one full-width V4-Flash CSA layer's decode (batch 1 and 64) as a CUDA graph: time vs
//            the HBM roofline of the bytes it must read (weights touched + KV)
//   model    43 layers (4 distinct weight sets, cycled) + head: decode tokens/s at batch 1 and 64
//
// Method (.library/device/METHOD.md): CUDA events around each repetition, warm-up first, median of
// the repetitions, rotating copies of weights, KV rows and codes so that a call never reads what
// the previous one left in L2 (H200: 60 MB), random (never zero) data. The layer section replays
// one layer's ~260 MB (batch 1) per step and the model cycles 4 weight sets; the moe section's
// shared expert and gate (29 MB) stay in L2 between its calls (its GB/s is not an HBM figure).
// --quick shortens every section (fewer repetitions and sizes) to fit scripts/gpu-check's budget.
#include <cublasLt.h>
#include <cuda_runtime.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <algorithm>
#include <vector>

#include "backend/backend.h" // DI_BACKEND_*_BLOCK, di_backend_code_row_bytes
#include "backend/cuda/attn.cuh"
#include "backend/cuda/wgmma_probe.cuh" // di_cuda_wgmma_available
#include "backend/cuda/cuda_backend.h"
#include "backend/cuda/gemm.cuh"
#include "backend/cuda/indexer.cuh"
#include "backend/cuda/mhc.cuh"
#include "backend/cuda/moe.cuh"
#include "backend/cuda/moe_tc.cuh"
#include "backend/cuda/quant.cuh"
#include "backend/cuda/norm.cuh"
#include "backend/cuda/rope.cuh"

// ---- plumbing ----

#define CK(call)                                                                                   \
    do {                                                                                           \
        cudaError_t e_ = (call);                                                                   \
        if (e_ != cudaSuccess) {                                                                   \
            fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #call, cudaGetErrorString(e_)); \
            exit(1);                                                                               \
        }                                                                                          \
    } while (0)
#define DK(call)                                                                                   \
    do {                                                                                           \
        di_status s_ = (call);                                                                     \
        if (s_ != DI_OK) {                                                                         \
            fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #call, di_status_str(s_));      \
            exit(1);                                                                               \
        }                                                                                          \
    } while (0)

static di_cuda *g_cu;
static cudaStream_t g_s;
static bool g_quick;
static double g_copy_gbs; // measured ceiling

static void *dmalloc(size_t bytes) {
    void *p = NULL;
    CK(cudaMalloc(&p, bytes ? bytes : 1));
    return p;
}

// Random bytes: mode 0 any, 1 FP8 e4m3 without NaN codes, 2 UE8M0 scales in [lo, lo+7],
// 3 FP32 in [-a, a], 4 BF16 in [-a, a].
__global__ void fill_kernel(uint8_t *p, size_t n, uint64_t seed, int mode, int lo, float a) {
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x) {
        uint64_t z = seed + i * 0x9e3779b97f4a7c15ull;
        z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
        z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
        z ^= z >> 31;
        if (mode == 0) {
            p[i] = (uint8_t)z;
        } else if (mode == 1) {
            uint8_t b = (uint8_t)z;
            p[i] = (b & 0x7F) == 0x7F ? b ^ 1 : b;
        } else if (mode == 2) {
            p[i] = (uint8_t)(lo + (int)(z & 7));
        } else if (mode == 3) {
            if (i % 4 == 0 && i + 4 <= n) {
                float f = ((float)(z >> 40) / 16777216.0f * 2.0f - 1.0f) * a;
                memcpy(p + i, &f, 4);
            }
        } else {
            if (i % 2 == 0 && i + 2 <= n) {
                float f = ((float)(z >> 40) / 16777216.0f * 2.0f - 1.0f) * a;
                uint32_t u;
                memcpy(&u, &f, 4);
                uint16_t h = (uint16_t)(u >> 16);
                memcpy(p + i, &h, 2);
            }
        }
    }
}

static uint64_t g_seed = 1;
static void fill(void *p, size_t n, int mode, int lo = 120, float a = 1.0f) {
    fill_kernel<<<1024, 256, 0, g_s>>>((uint8_t *)p, n, g_seed++ * 0x12345ull, mode, lo, a);
    CK(cudaGetLastError());
}

// A device weight [n_out, n_in] of `kind` with random contents (owned by the process).
static di_tensor dev_weight(di_tensor_kind kind, int64_t n_in, int64_t n_out) {
    di_tensor t;
    memset(&t, 0, sizeof t);
    t.name = "synthetic";
    t.kind = kind;
    t.ne[0] = n_in, t.ne[1] = n_out;
    switch (kind) {
    case DI_TENSOR_KIND_F32:
        t.nb1 = 4 * (size_t)n_in;
        break;
    case DI_TENSOR_KIND_F16:
    case DI_TENSOR_KIND_BF16:
        t.nb1 = 2 * (size_t)n_in;
        break;
    case DI_TENSOR_KIND_FP8:
        t.nb1 = (size_t)n_in, t.block_out = 128, t.block_in = 128;
        break;
    case DI_TENSOR_KIND_FP4:
        t.nb1 = (size_t)n_in / 2, t.block_out = 1, t.block_in = 32;
        break;
    default: // GGUF block kinds: CPU-only
        fprintf(stderr, "bench_cuda: %s is not a GPU kind\n", di_tensor_kind_name(kind));
        exit(2);
    }
    void *d = dmalloc(t.nb1 * (size_t)n_out);
    const float a = 1.0f / sqrtf((float)n_in);
    fill(d, t.nb1 * (size_t)n_out,
         kind == DI_TENSOR_KIND_FP8   ? 1
         : kind == DI_TENSOR_KIND_FP4 ? 0
         : kind == DI_TENSOR_KIND_F32 ? 3
                                      : 4,
         0, a);
    t.data = d;
    if (kind == DI_TENSOR_KIND_FP8 || kind == DI_TENSOR_KIND_FP4) {
        const int64_t sr = (n_out + t.block_out - 1) / t.block_out;
        const int64_t sc = (n_in + t.block_in - 1) / t.block_in;
        t.scale_nb1 = (size_t)sc;
        void *s = dmalloc((size_t)(sr * sc));
        // FP8 codes reach 448, FP4 6: scales bring weights near 1/sqrt(n_in).
        fill(s, (size_t)(sr * sc), 2, kind == DI_TENSOR_KIND_FP8 ? 127 - 18 : 127 - 11);
        t.scale = (const uint8_t *)s;
    }
    return t;
}

static size_t weight_bytes(const di_tensor &t) {
    size_t b = t.nb1 * (size_t)t.ne[1];
    if (t.scale) b += t.scale_nb1 * (size_t)((t.ne[1] + t.block_out - 1) / t.block_out);
    return b;
}

static void free_weight(di_tensor &t) {
    cudaFree((void *)t.data);
    if (t.scale) cudaFree((void *)t.scale);
}

// Median milliseconds of `reps` timed runs of fn(i) after `warm` untimed ones.
template <class F> static double time_ms(int warm, int reps, F fn) {
    for (int i = 0; i < warm; i++) fn(i);
    CK(cudaStreamSynchronize(g_s));
    std::vector<float> ms((size_t)reps);
    cudaEvent_t a, b;
    CK(cudaEventCreate(&a));
    CK(cudaEventCreate(&b));
    for (int i = 0; i < reps; i++) {
        CK(cudaEventRecord(a, g_s));
        fn(warm + i);
        CK(cudaEventRecord(b, g_s));
        CK(cudaEventSynchronize(b));
        CK(cudaEventElapsedTime(&ms[(size_t)i], a, b));
    }
    CK(cudaGetLastError());
    cudaEventDestroy(a);
    cudaEventDestroy(b);
    std::sort(ms.begin(), ms.end());
    return ms[(size_t)reps / 2];
}

// ---- copy ----

// Reads n 16-byte words (4 independent loads in flight per thread), XORs them and stores one word
// per thread only when the XOR is a value the data never gives: a read-only stream.
__global__ void read_kernel(const uint4 *p, size_t n, uint32_t *sink) {
    const size_t stride = (size_t)gridDim.x * blockDim.x;
    uint32_t acc = 0;
    size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    for (; i + 3 * stride < n; i += 4 * stride) {
        const uint4 a = p[i], b = p[i + stride], c = p[i + 2 * stride], d = p[i + 3 * stride];
        acc ^= a.x ^ a.y ^ a.z ^ a.w ^ b.x ^ b.y ^ b.z ^ b.w ^ c.x ^ c.y ^ c.z ^ c.w ^ d.x ^ d.y ^
               d.z ^ d.w;
    }
    for (; i < n; i += stride) acc ^= p[i].x ^ p[i].y ^ p[i].z ^ p[i].w;
    if (acc == 0x9e3779b9u) sink[threadIdx.x] = acc;
}

static double g_read_gbs; // read-only stream: printed beside the copy figure

static void bench_copy(void) {
    const size_t n = (size_t)2 << 30; // 2 GiB each way: far beyond L2
    void *a = dmalloc(n), *b = dmalloc(n);
    fill(a, n, 0);
    double ms = time_ms(2, g_quick ? 5 : 10,
                        [&](int) { CK(cudaMemcpyAsync(b, a, n, cudaMemcpyDeviceToDevice, g_s)); });
    g_copy_gbs = 2.0 * (double)n / (ms * 1e-3) / 1e9;
    printf("\n== copy\n%-28s %10.3f ms  %8.0f GB/s (read + write)\n", "d2d 2 GiB", ms, g_copy_gbs);
    // A read-only stream over both buffers (4 GiB): decode mostly reads, and HBM may read faster
    // than it copies; the roofline figures below use the copy, this says by how much they could
    // be optimistic.
    int dev = 0, n_sm = 0;
    CK(cudaGetDevice(&dev));
    CK(cudaDeviceGetAttribute(&n_sm, cudaDevAttrMultiProcessorCount, dev));
    uint32_t *sink = (uint32_t *)dmalloc(4 * 256);
    fill(b, n, 0);
    // a and b are adjacent or not: read them as two kernels in one timed run.
    const double rms = time_ms(2, g_quick ? 5 : 10, [&](int) {
        read_kernel<<<n_sm * 8, 256, 0, g_s>>>((const uint4 *)a, n / 16, sink);
        read_kernel<<<n_sm * 8, 256, 0, g_s>>>((const uint4 *)b, n / 16, sink);
    });
    g_read_gbs = 2.0 * (double)n / (rms * 1e-3) / 1e9;
    printf("%-28s %10.3f ms  %8.0f GB/s (read only; %.3f x the copy)\n", "read 2 x 2 GiB", rms,
           g_read_gbs, g_read_gbs / g_copy_gbs);
    cudaFree(sink);
    cudaFree(a);
    cudaFree(b);
}

// ---- gemm vs cuBLASLt FP8 ----

// Host decodes for the checks (spec §4.3): FP8 e4m3fn (no infinities; NaN codes are never drawn)
// and BF16.
static double h_e4m3(uint8_t c) {
    const int e = (c >> 3) & 15, m = c & 7;
    const double v = e ? ldexp(1.0 + m / 8.0, e - 7) : ldexp(m / 8.0, -6);
    return c & 0x80 ? -v : v;
}
static double h_bf16(uint16_t h) {
    const uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

typedef struct lt_gemm {
    cublasLtMatmulDesc_t op;
    cublasLtMatrixLayout_t la, lb, lc;
    cublasLtMatmulHeuristicResult_t heur;
    bool ok;
} lt_gemm;

static void *g_lt_ws;
static const size_t k_lt_ws = (size_t)64 << 20;

// D[M x N] (col-major, BF16) = A^T B with A = weights [M rows of K] FP8, B = tokens [N rows of K]
// FP8: cuBLASLt's FP8 "TN" layout.
static lt_gemm lt_plan(int64_t M, int64_t N, int64_t K, cudaDataType_t in = CUDA_R_8F_E4M3) {
    lt_gemm g;
    memset(&g, 0, sizeof g);
    cublasOperation_t ta = CUBLAS_OP_T, tb = CUBLAS_OP_N;
    if (cublasLtMatmulDescCreate(&g.op, CUBLAS_COMPUTE_32F, CUDA_R_32F) != CUBLAS_STATUS_SUCCESS)
        return g;
    cublasLtMatmulDescSetAttribute(g.op, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof ta);
    cublasLtMatmulDescSetAttribute(g.op, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof tb);
    cublasLtMatrixLayoutCreate(&g.la, in, (uint64_t)K, (uint64_t)M, K);
    cublasLtMatrixLayoutCreate(&g.lb, in, (uint64_t)K, (uint64_t)N, K);
    cublasLtMatrixLayoutCreate(&g.lc, CUDA_R_16BF, (uint64_t)M, (uint64_t)N, M);
    cublasLtMatmulPreference_t pref;
    cublasLtMatmulPreferenceCreate(&pref);
    size_t ws = k_lt_ws;
    cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws,
                                         sizeof ws);
    int n_res = 0;
    cublasStatus_t st = cublasLtMatmulAlgoGetHeuristic((cublasLtHandle_t)g_cu->cublaslt, g.op, g.la,
                                                       g.lb, g.lc, g.lc, pref, 1, &g.heur, &n_res);
    cublasLtMatmulPreferenceDestroy(pref);
    g.ok = st == CUBLAS_STATUS_SUCCESS && n_res > 0;
    return g;
}

static bool lt_run(const lt_gemm &g, const void *A, const void *B, void *D) {
    const float alpha = 1.0f, beta = 0.0f;
    return cublasLtMatmul((cublasLtHandle_t)g_cu->cublaslt, g.op, &alpha, A, g.la, B, g.lb, &beta,
                          D, g.lc, D, g.lc, &g.heur.algo, g_lt_ws, k_lt_ws,
                          g_s) == CUBLAS_STATUS_SUCCESS;
}

static void lt_free(lt_gemm &g) {
    if (g.la) cublasLtMatrixLayoutDestroy(g.la);
    if (g.lb) cublasLtMatrixLayoutDestroy(g.lb);
    if (g.lc) cublasLtMatrixLayoutDestroy(g.lc);
    if (g.op) cublasLtMatmulDescDestroy(g.op);
}

static void bench_gemm(void) {
    struct shape {
        const char *name;
        int64_t n_out, n_in;
    };
    // V4-Flash projections (spec §2.11): q up, output, q down, shared expert gate/up.
    static const shape shapes[] = {{"wq_b 32768x1024", 32768, 1024},
                                   {"wo_b 4096x8192", 4096, 8192},
                                   {"wq_a 1024x4096", 1024, 4096},
                                   {"sh_w1 2048x4096", 2048, 4096}};
    static const int64_t ms_full[] = {1, 2, 8, 64, 512, 2048, 8192};
    static const int64_t ms_quick[] = {1, 8, 512, 4096};
    const int64_t *ms = g_quick ? ms_quick : ms_full;
    const int n_ms = g_quick ? 4 : 7;
    g_lt_ws = dmalloc(k_lt_ws);
    printf("\n== gemm: di_cuda_matmul FP8 128x128 vs cuBLASLt FP8 (per-tensor scale, BF16 out)\n");
    printf("%-18s %6s %10s %9s %9s %10s %9s %7s %10s %7s %s\n", "shape", "M", "ours ms", "TFLOP/s",
           "GB/s", "cublas ms", "TFLOP/s", "ratio", "blk ms", "ratio", "check lt/blk");
    for (const shape &sh : shapes) {
        if (g_quick && sh.n_out == 2048) continue;
        di_tensor w0 = dev_weight(DI_TENSOR_KIND_FP8, sh.n_in, sh.n_out);
        const size_t wb = weight_bytes(w0);
        // Rotate copies so the set is >= 4x a 60 MB L2 (up to 64 copies of small matrices).
        const int n_rot =
            (int)std::min<size_t>(64, std::max<size_t>(1, ((size_t)240 << 20) / wb + 1));
        std::vector<di_tensor> ws((size_t)n_rot);
        ws[0] = w0;
        for (int r = 1; r < n_rot; r++)
            ws[(size_t)r] = dev_weight(DI_TENSOR_KIND_FP8, sh.n_in, sh.n_out);
        for (int mi = 0; mi < n_ms; mi++) {
            const int64_t M = ms[mi];
            float *x = (float *)dmalloc(sizeof(float) * (size_t)(M * sh.n_in));
            float *y = (float *)dmalloc(sizeof(float) * (size_t)(M * sh.n_out));
            fill(x, sizeof(float) * (size_t)(M * sh.n_in), 3, 0, 1.0f);
            const double flop = 2.0 * (double)M * sh.n_out * sh.n_in;
            const int reps = M >= 2048 ? 5 : (g_quick ? 5 : 10);
            // Small M (a GEMV of 1-30 us): `per` back-to-back calls per timed repetition, so the
            // host's launch time between the two events is not counted (as in a decode graph).
            const int per = M <= 64 ? 20 : 1;
            double ours =
                time_ms(1, reps,
                        [&](int i) {
                            for (int j = 0; j < per; j++)
                                DK(di_cuda_matmul(g_cu, &ws[(size_t)((i * per + j) % n_rot)], x, M,
                                                  sh.n_in, y, sh.n_out));
                        }) /
                per;
            // cuBLASLt on the same weight bytes (as e4m3) and FP8 activations.
            uint8_t *xb = (uint8_t *)dmalloc((size_t)(M * sh.n_in));
            void *yb = dmalloc(2 * (size_t)(M * sh.n_out));
            fill(xb, (size_t)(M * sh.n_in), 1);
            lt_gemm g = lt_plan(sh.n_out, M, sh.n_in);
            double lt = -1;
            if (g.ok && lt_run(g, ws[0].data, xb, yb)) {
                lt = time_ms(1, reps,
                             [&](int i) {
                                 for (int j = 0; j < per; j++)
                                     lt_run(g, ws[(size_t)((i * per + j) % n_rot)].data, xb, yb);
                             }) /
                     per;
            }
            lt_free(g);
            // The official-recipe path: A8 on the device + cuBLASLt FP8 block-scaled GEMM.
            float *wsc = (float *)dmalloc(sizeof(float) *
                                          (size_t)(((sh.n_out + 127) / 128) * (sh.n_in / 128)));
            float *xsc = (float *)dmalloc(sizeof(float) * (size_t)(M * sh.n_in / 128));
            DK(di_cuda_fp8_scales_f32(g_cu, &ws[0], wsc));
            double blk = -1;
            if (di_cuda_act_quant_a8(g_cu, x, M, sh.n_in, sh.n_in, xb, xsc) == DI_OK &&
                di_cuda_matmul_fp8_lt(g_cu, &ws[0], wsc, xb, xsc, M, y, sh.n_out) == DI_OK) {
                blk =
                    time_ms(1, reps,
                            [&](int i) {
                                for (int j = 0; j < per; j++) {
                                    DK(di_cuda_act_quant_a8(g_cu, x, M, sh.n_in, sh.n_in, xb, xsc));
                                    // Scales of copy 0 for every copy: the timing is the same, the
                                    // values are checked below on copy 0.
                                    DK(di_cuda_matmul_fp8_lt(g_cu,
                                                             &ws[(size_t)((i * per + j) % n_rot)],
                                                             wsc, xb, xsc, M, y, sh.n_out));
                                }
                            }) /
                    per;
            }
            // Checked before the figures are believed (on copy 0): cuBLASLt per-tensor on 8
            // outputs against the host's sum of the same FP8 bytes' products (BF16 out: 1e-2),
            // the block-scaled path against di_cuda_matmul on the first rows, both on A8 values
            // (1e-2 of the largest output). "BAD" marks a failed check.
            double lt_err = -1, blk_err = -1;
            if (lt > 0) {
                lt_gemm g2 = lt_plan(sh.n_out, M, sh.n_in);
                if (g2.ok && lt_run(g2, ws[0].data, xb, yb)) {
                    CK(cudaStreamSynchronize(g_s));
                    std::vector<uint8_t> wr((size_t)sh.n_in), xr((size_t)sh.n_in);
                    lt_err = 0;
                    for (int k = 0; k < 8; k++) {
                        const int64_t m = (M - 1) * k / 7, n = (sh.n_out - 1) * ((k * 5) % 8) / 7;
                        uint16_t d;
                        CK(cudaMemcpy(wr.data(), (const uint8_t *)ws[0].data + n * sh.n_in,
                                      (size_t)sh.n_in, cudaMemcpyDeviceToHost));
                        CK(cudaMemcpy(xr.data(), xb + m * sh.n_in, (size_t)sh.n_in,
                                      cudaMemcpyDeviceToHost));
                        CK(cudaMemcpy(&d, (const uint16_t *)yb + m * sh.n_out + n, 2,
                                      cudaMemcpyDeviceToHost));
                        double ref = 0, mag = 0;
                        for (int64_t i = 0; i < sh.n_in; i++) {
                            const double p_ = h_e4m3(wr[(size_t)i]) * h_e4m3(xr[(size_t)i]);
                            ref += p_, mag += fabs(p_);
                        }
                        const double e = fabs(h_bf16(d) - ref) / (mag + 1e-30);
                        lt_err = e > lt_err || e != e ? e : lt_err;
                    }
                }
                lt_free(g2);
            }
            if (blk > 0) {
                const int64_t mr = std::min<int64_t>(M, 16);
                const size_t nc = (size_t)(mr * sh.n_out);
                std::vector<float> y0(nc), y1(nc);
                // Both on A8 values (x fake-quantised in place: its A8 is then exact), so only
                // the summation differs: FP8 tensor-core accumulation, 2^-11 of the sum of
                // |terms| (test_cuda_gemm), ~1e-3 of max |y| here; a wrong scale or layout: ~1.
                DK(di_cuda_fake_quant(g_cu, x, M, sh.n_in, sh.n_in, 128, 8, x));
                DK(di_cuda_matmul(g_cu, &ws[0], x, M, sh.n_in, y, sh.n_out));
                CK(cudaStreamSynchronize(g_s));
                CK(cudaMemcpy(y0.data(), y, sizeof(float) * nc, cudaMemcpyDeviceToHost));
                DK(di_cuda_act_quant_a8(g_cu, x, M, sh.n_in, sh.n_in, xb, xsc));
                DK(di_cuda_matmul_fp8_lt(g_cu, &ws[0], wsc, xb, xsc, M, y, sh.n_out));
                CK(cudaStreamSynchronize(g_s));
                CK(cudaMemcpy(y1.data(), y, sizeof(float) * nc, cudaMemcpyDeviceToHost));
                double amax = 0, dmax = 0;
                for (size_t i = 0; i < nc; i++) {
                    amax = std::max(amax, (double)fabsf(y0[i]));
                    const double d = fabs((double)y1[i] - y0[i]);
                    dmax = d > dmax || d != d ? d : dmax;
                }
                blk_err = amax > 0 ? dmax / amax : dmax;
            }
            cudaFree(wsc), cudaFree(xsc);
            const double gbs = (double)wb / (ours * 1e-3) / 1e9;
            char lts[32] = "n/a", ltt[32] = "-", ltr[32] = "-", bks[32] = "n/a", bkr[32] = "-";
            char chk[48] = "-";
            if (lt > 0) {
                snprintf(lts, sizeof lts, "%.4f", lt);
                snprintf(ltt, sizeof ltt, "%.2f", flop / (lt * 1e-3) / 1e12);
                snprintf(ltr, sizeof ltr, "%.3f", lt / ours);
            }
            if (blk > 0) {
                snprintf(bks, sizeof bks, "%.4f", blk);
                if (lt > 0) snprintf(bkr, sizeof bkr, "%.3f", lt / blk);
            }
            // lt: the worst of the 8 sampled outputs (|d| / sum |products|); blk: max|d|/max|y|.
            const bool bad =
                lt_err > 1e-2 || lt_err != lt_err || blk_err > 1e-2 || blk_err != blk_err;
            if (lt_err >= 0 || blk_err >= 0)
                snprintf(chk, sizeof chk, "%.1e/%.1e%s", lt_err, blk_err, bad ? " BAD" : "");
            printf("%-18s %6lld %10.4f %9.2f %9.0f %10s %9s %7s %10s %7s %s\n", sh.name,
                   (long long)M, ours, flop / (ours * 1e-3) / 1e12, gbs, lts, ltt, ltr, bks, bkr,
                   chk);
            cudaFree(x), cudaFree(y), cudaFree(xb), cudaFree(yb);
        }
        for (di_tensor &t : ws) free_weight(t);
    }
    printf("(GB/s: weight bytes per call / time, the decode figure of merit; copy ceiling %.0f;\n"
           " ratio = cuBLASLt per-tensor time / ours; blk = A8 + cuBLASLt block-scaled FP8, the\n"
           " official-recipe prefill path, and its ratio against cuBLASLt per-tensor)\n",
           g_copy_gbs);
    cudaFree(g_lt_ws);
}

// ---- MoE ----

typedef struct moe_layer {
    di_cuda_moe_w w;
    std::vector<di_tensor> w1, w2, w3;
    di_tensor *d1, *d2, *d3;
    size_t expert_bytes; // one routed expert (w1 + w2 + w3)
    size_t shared_bytes;
} moe_layer;

static void moe_make(moe_layer &L, int32_t E, int32_t K, int64_t D, int64_t F) {
    L.w1.resize((size_t)E), L.w2.resize((size_t)E), L.w3.resize((size_t)E);
    for (int32_t e = 0; e < E; e++) {
        L.w1[(size_t)e] = dev_weight(DI_TENSOR_KIND_FP4, D, F);
        L.w2[(size_t)e] = dev_weight(DI_TENSOR_KIND_FP4, F, D);
        L.w3[(size_t)e] = dev_weight(DI_TENSOR_KIND_FP4, D, F);
    }
    L.expert_bytes = weight_bytes(L.w1[0]) + weight_bytes(L.w2[0]) + weight_bytes(L.w3[0]);
    L.d1 = (di_tensor *)dmalloc(sizeof(di_tensor) * (size_t)E);
    L.d2 = (di_tensor *)dmalloc(sizeof(di_tensor) * (size_t)E);
    L.d3 = (di_tensor *)dmalloc(sizeof(di_tensor) * (size_t)E);
    CK(cudaMemcpy(L.d1, L.w1.data(), sizeof(di_tensor) * (size_t)E, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(L.d2, L.w2.data(), sizeof(di_tensor) * (size_t)E, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(L.d3, L.w3.data(), sizeof(di_tensor) * (size_t)E, cudaMemcpyHostToDevice));
    memset(&L.w, 0, sizeof L.w);
    L.w.gate = dev_weight(DI_TENSOR_KIND_F32, D, E);
    float *bias = (float *)dmalloc(sizeof(float) * (size_t)E);
    fill(bias, sizeof(float) * (size_t)E, 3, 0, 0.1f);
    L.w.gate_bias = bias;
    L.w.w1 = L.d1, L.w.w2 = L.d2, L.w.w3 = L.d3;
    L.w.sh_w1 = dev_weight(DI_TENSOR_KIND_FP8, D, F);
    L.w.sh_w2 = dev_weight(DI_TENSOR_KIND_FP8, F, D);
    L.w.sh_w3 = dev_weight(DI_TENSOR_KIND_FP8, D, F);
    L.shared_bytes = weight_bytes(L.w.sh_w1) + weight_bytes(L.w.sh_w2) + weight_bytes(L.w.sh_w3) +
                     weight_bytes(L.w.gate);
    L.w.n_expert = E, L.w.n_used = K, L.w.D = D, L.w.F = F;
    L.w.route_scale = 1.5f, L.w.swiglu_limit = 10.0f, L.w.shared_clamp = true;
    L.w.hf_eps = true;
    CK(cudaDeviceSynchronize()); // fills on the non-blocking stream vs legacy-stream copies
}

static void moe_free(moe_layer &L) {
    for (size_t e = 0; e < L.w1.size(); e++)
        free_weight(L.w1[e]), free_weight(L.w2[e]), free_weight(L.w3[e]);
    free_weight(L.w.gate), free_weight(L.w.sh_w1), free_weight(L.w.sh_w2), free_weight(L.w.sh_w3);
    cudaFree((void *)L.w.gate_bias), cudaFree(L.d1), cudaFree(L.d2), cudaFree(L.d3);
}

// The routed experts' three grouped linears of one layer (w1, w3 on T token rows, w2 on the
// T*K grouped rows) on A8 activations: the SIMT grouped kernel against the BF16 tensor-core one
// (moe_tc.cuh), with a routing drawn uniformly (K distinct experts per token). FLOPs 6 P F D
// (P = T*K). Peers: the dense BF16 rate of this run (cuBLASLt 8192^3) and a cuBLASLt BF16 GEMM
// of the same FLOPs (3 x [P x D] . [D x F]); diff: max |tc - simt| / max |simt| of w2's output
// (the first-call check's figure: ~1e-6 expected).
static void bench_moe_tc(moe_layer &L, int32_t E, int32_t K, int64_t D, int64_t F) {
    double peak = 0;
    {
        const int64_t n = 8192;
        void *a = dmalloc((size_t)(2 * n * n)), *b = dmalloc((size_t)(2 * n * n));
        void *c = dmalloc((size_t)(2 * n * n));
        fill(a, (size_t)(2 * n * n), 4, 0, 1.0f), fill(b, (size_t)(2 * n * n), 4, 0, 1.0f);
        lt_gemm g = lt_plan(n, n, n, CUDA_R_16BF);
        if (g.ok) { // a refused run leaves the peer out (0), not the section
            bool ran = true;
            const double ms = time_ms(2, 5, [&](int) { ran = lt_run(g, a, b, c) && ran; });
            if (ran) peak = 2.0 * n * n * n / (ms * 1e-3) / 1e12;
        }
        lt_free(g);
        cudaFree(a), cudaFree(b), cudaFree(c);
    }
    printf("\n== moe grouped: the routed w1 + w3 + w2 of one layer on A8 activations, SIMT vs BF16 "
           "tensor cores (E=%d K=%d D=%lld F=%lld, FP4); dense BF16 (cuBLASLt 8192^3) %.0f "
           "TFLOP/s\n",
           E, K, (long long)D, (long long)F, peak);
    printf("%-8s %6s %7s %10s %8s %10s %8s %8s %8s %10s %8s %9s\n", "", "tokens", "pairs",
           "simt ms", "TFLOP/s", "tc ms", "TFLOP/s", "x simt", "x peak", "cublas ms", "x cublas",
           "diff");
    static const int32_t ts_full[] = {64, 128, 256, 512, 1024, 2048, 4096};
    static const int32_t ts_quick[] = {64, 512, 4096};
    const int32_t *ts = g_quick ? ts_quick : ts_full;
    const int n_ts = g_quick ? 3 : 7;
    for (int it = 0; it < n_ts; it++) {
        const int32_t T = ts[it], P = T * K;
        std::vector<int32_t> sel((size_t)P), counts((size_t)E + 1, 0), offsets((size_t)E + 1, 0);
        uint64_t z = 0x9e3779b97f4a7c15ull * (uint64_t)(T + 1);
        for (int32_t t = 0; t < T; t++)
            for (int32_t k = 0; k < K; k++) {
                int32_t e;
                bool dup;
                do {
                    z = z * 6364136223846793005ull + 1442695040888963407ull;
                    e = (int32_t)((z >> 33) % (uint64_t)E);
                    dup = false;
                    for (int32_t j = 0; j < k; j++) dup |= sel[(size_t)(t * K + j)] == e;
                } while (dup);
                sel[(size_t)(t * K + k)] = e;
                counts[(size_t)e]++;
            }
        for (int32_t e = 0; e < E; e++)
            offsets[(size_t)e + 1] = offsets[(size_t)e] + counts[(size_t)e];
        std::vector<int32_t> rows((size_t)P), fillp(offsets.begin(), offsets.end() - 1);
        for (int32_t p = 0; p < P; p++) rows[(size_t)fillp[(size_t)sel[(size_t)p]]++] = p / K;
        int32_t *offd = (int32_t *)dmalloc(sizeof(int32_t) * (size_t)(E + 1));
        int32_t *rowsd = (int32_t *)dmalloc(sizeof(int32_t) * (size_t)P);
        CK(cudaMemcpy(offd, offsets.data(), sizeof(int32_t) * (size_t)(E + 1),
                      cudaMemcpyHostToDevice));
        CK(cudaMemcpy(rowsd, rows.data(), sizeof(int32_t) * (size_t)P, cudaMemcpyHostToDevice));
        float *x = (float *)dmalloc(sizeof(float) * (size_t)(T * D));
        float *h = (float *)dmalloc(sizeof(float) * (size_t)P * (size_t)F);
        float *g1 = (float *)dmalloc(sizeof(float) * (size_t)P * (size_t)F);
        float *y = (float *)dmalloc(sizeof(float) * (size_t)P * (size_t)D);
        float *yt = (float *)dmalloc(sizeof(float) * (size_t)P * (size_t)D);
        fill(x, sizeof(float) * (size_t)(T * D), 3, 0, 1.0f);
        fill(h, sizeof(float) * (size_t)P * (size_t)F, 3, 0, 1.0f);
        DK(di_cuda_fake_quant(g_cu, x, T, D, D, 128, 8, x)); // A8 values
        DK(di_cuda_fake_quant(g_cu, h, P, F, F, 128, 8, h));
        auto run = [&](bool tc, float *yo) {
            if (tc) {
                DK(di_cuda_matmul_grouped_tc(g_cu, DI_TENSOR_KIND_FP4, L.d1, E, F, D, offd, P,
                                             rowsd, x, T, D, g1, F));
                DK(di_cuda_matmul_grouped_tc(g_cu, DI_TENSOR_KIND_FP4, L.d3, E, F, D, offd, P,
                                             rowsd, x, T, D, g1, F));
                DK(di_cuda_matmul_grouped_tc(g_cu, DI_TENSOR_KIND_FP4, L.d2, E, D, F, offd, P, NULL,
                                             h, P, F, yo, D));
            } else {
                DK(di_cuda_matmul_grouped(g_cu, L.d1, E, F, D, offd, rowsd, x, D, g1, F, 0));
                DK(di_cuda_matmul_grouped(g_cu, L.d3, E, F, D, offd, rowsd, x, D, g1, F, 0));
                DK(di_cuda_matmul_grouped(g_cu, L.d2, E, D, F, offd, NULL, h, F, yo, D, 0));
            }
        };
        const int reps = T >= 1024 ? 3 : 5;
        const double simt = time_ms(1, reps, [&](int) { run(false, y); });
        const double tc = time_ms(1, reps, [&](int) { run(true, yt); });
        std::vector<float> hy((size_t)P * (size_t)D), ht((size_t)P * (size_t)D);
        CK(cudaMemcpy(hy.data(), y, sizeof(float) * hy.size(), cudaMemcpyDeviceToHost));
        CK(cudaMemcpy(ht.data(), yt, sizeof(float) * ht.size(), cudaMemcpyDeviceToHost));
        double amax = 0, dmax = 0;
        for (size_t i = 0; i < hy.size(); i++) {
            const double d = fabs((double)ht[i] - hy[i]);
            amax = fmax(amax, fabs((double)hy[i]));
            dmax = d > dmax || d != d ? d : dmax;
        }
        // The dense peer: the same FLOPs as one BF16 GEMM [P x D] . [D x F], three times.
        double lt = 0;
        {
            void *a = dmalloc(2 * (size_t)(F * D)), *b = dmalloc(2 * (size_t)P * (size_t)D);
            void *c = dmalloc(2 * (size_t)P * (size_t)F);
            fill(a, 2 * (size_t)(F * D), 4, 0, 1.0f),
                fill(b, 2 * (size_t)P * (size_t)D, 4, 0, 1.0f);
            lt_gemm g = lt_plan(F, P, D, CUDA_R_16BF);
            if (g.ok) {
                bool ran = true;
                lt = 3 * time_ms(2, reps, [&](int) { ran = lt_run(g, a, b, c) && ran; });
                if (!ran) lt = 0;
            }
            lt_free(g);
            cudaFree(a), cudaFree(b), cudaFree(c);
        }
        const double flop = 6.0 * P * (double)F * (double)D;
        const double tf_simt = flop / (simt * 1e-3) / 1e12, tf_tc = flop / (tc * 1e-3) / 1e12;
        printf("%-8s %6d %7d %10.3f %8.1f %10.3f %8.1f %8.2f %8.3f %10.3f %8.3f %9.2g\n", "grouped",
               T, P, simt, tf_simt, tc, tf_tc, simt / tc, peak > 0 ? tf_tc / peak : 0.0, lt,
               lt > 0 ? lt / tc : 0.0, amax > 0 ? dmax / amax : dmax);
        cudaFree(offd), cudaFree(rowsd), cudaFree(x), cudaFree(h), cudaFree(g1), cudaFree(y),
            cudaFree(yt);
    }
    printf("(x simt = simt ms / tc ms; x peak = tc TFLOP/s / dense BF16 TFLOP/s; x cublas = the "
           "dense peer's ms / tc ms)\n");
}

static void bench_moe(void) {
    const int32_t E = 256, K = 6;
    const int64_t D = 4096, F = 2048;
    moe_layer L;
    moe_make(L, E, K, D, F);
    static const int32_t ts_full[] = {1, 8, 64, 512, 4096};
    static const int32_t ts_quick[] = {1, 64, 1024};
    const int32_t *ts = g_quick ? ts_quick : ts_full;
    const int n_ts = g_quick ? 3 : 5;
    printf("\n== moe: E=%d K=%d D=%lld F=%lld, FP4 experts (%.1f MB each) + FP8 shared\n", E, K,
           (long long)D, (long long)F, L.expert_bytes / 1e6);
    printf("%7s %10s %12s %9s %10s\n", "tokens", "ms", "tokens/s", "experts", "GB/s");
    for (int i = 0; i < n_ts; i++) {
        const int32_t T = ts[i];
        float *f = (float *)dmalloc(sizeof(float) * (size_t)(T * D));
        float *out = (float *)dmalloc(sizeof(float) * (size_t)(T * D));
        int32_t *sel = (int32_t *)dmalloc(sizeof(int32_t) * (size_t)(T * K));
        int32_t *ids = (int32_t *)dmalloc(sizeof(int32_t) * (size_t)T);
        CK(cudaMemsetAsync(ids, 0, sizeof(int32_t) * (size_t)T, g_s));
        fill(f, sizeof(float) * (size_t)(T * D), 3, 0, 1.0f);
        double ms = time_ms(1, T >= 1024 ? 3 : (g_quick ? 5 : 10),
                            [&](int) { DK(di_cuda_moe(g_cu, &L.w, f, ids, T, out, sel, NULL)); });
        std::vector<int32_t> hs((size_t)(T * K));
        CK(cudaMemcpy(hs.data(), sel, sizeof(int32_t) * hs.size(), cudaMemcpyDeviceToHost));
        std::vector<char> used((size_t)E, 0);
        for (int32_t s : hs) used[(size_t)s] = 1;
        int n_used = 0;
        for (char u : used) n_used += u;
        const double bytes = (double)n_used * L.expert_bytes + (double)L.shared_bytes;
        printf("%7d %10.4f %12.0f %9d %10.0f\n", T, ms, T / (ms * 1e-3), n_used,
               bytes / (ms * 1e-3) / 1e9);
        cudaFree(f), cudaFree(out), cudaFree(sel), cudaFree(ids);
    }
    printf("(GB/s: bytes of the experts touched + shared + gate, read once, / time)\n");
    fflush(stdout);
    bench_moe_tc(L, E, K, D, F);
    moe_free(L);
}

// ---- attention ----

enum { ATTN_GOAL_GBS = 3000 }; // issue #7: attention decode >= 3,000 GB/s effective

// max |got - ref| / max |ref| over n values (a NaN difference gives NaN).
static double max_rel_diff(const float *got, const float *ref, size_t n) {
    double amax = 0, dmax = 0;
    for (size_t i = 0; i < n; i++) {
        const double d = fabs((double)got[i] - ref[i]);
        amax = std::max(amax, fabs((double)ref[i]));
        dmax = d > dmax || d != d ? d : dmax;
    }
    return amax > 0 ? dmax / amax : dmax;
}

// The wgmma columns of a row (ms 0: not run on this device) and the line's end.
static void print_wg(double ms, double bytes, double diff) {
    if (ms <= 0) {
        printf("%10s %9s %7s %7s %9s\n", "-", "-", "-", "-", "-");
        return;
    }
    const double gbs = bytes / (ms * 1e-3) / 1e9;
    printf("%10.4f %9.0f %7.3f %7.3f %9.2g\n", ms, gbs, gbs / ATTN_GOAL_GBS,
           g_copy_gbs > 0 ? gbs / g_copy_gbs : 0.0, diff);
}

static void bench_attn(void) {
    const int32_t H = 64, dh = 512, n_rot = 64, W = 128;
    const int64_t rb = di_cuda_kv_row_bytes(dh, n_rot);
    static const int64_t ctx_full[] = {4096, 16384, 65536, 131072};
    static const int64_t ctx_quick[] = {4096, 131072};
    const int n_ctx = g_quick ? 2 : 4;
    const int64_t *ctxs = g_quick ? ctx_quick : ctx_full;
    // Valid KV rows (finite scores, as in a model): random FP32 rows quantised by the model's own
    // kernel, one chunk of rows repeated over the pool (rows far apart: no cache reuse).
    const int64_t chunk_rows = 65536;
    float *kv_f32 = (float *)dmalloc(sizeof(float) * (size_t)(chunk_rows * dh));
    fill(kv_f32, sizeof(float) * (size_t)(chunk_rows * dh), 3, 0, 1.0f);
    printf("\n== attn: H=%d dh=%d FP8 rows of %lld bytes, decode (1 query row per sequence)\n", H,
           dh, (long long)rb);
    printf("%-6s %8s %6s %8s %10s %9s %10s %9s %7s %10s %9s %7s %7s %9s\n", "kind", "context",
           "batch", "keys", "fp32 ms", "GB/s", "bf16 ms", "GB/s", "x copy", "wg ms", "GB/s",
           "x goal", "x copy", "max|d|/o");
    for (int ci = 0; ci < n_ctx; ci++) {
        const int64_t L = ctxs[ci];
        for (int kind = 0; kind < 3; kind++) {
            const int32_t n_keys = (int32_t)(kind == 0   ? W + std::min<int64_t>(512, L / 4)
                                             : kind == 1 ? W + L / 128
                                                         : W + L / 4);
            for (int bi = 0; bi < 2; bi++) {
                const int32_t B = bi ? 64 : 1;
                // Each sequence its own rows: B * n_keys rows per copy; copies of the whole set so
                // that one call's rows are not in L2 from the last call (>= 256 MB in all: a
                // batch-64 CSA call reads 24 MB, HCA at 128k 43 MB, both inside a 60 MB L2),
                // rotated per repetition.
                const int64_t n_rows = (int64_t)B * n_keys;
                const int64_t call_rows = n_rows * (rb + 4);
                const int n_copy = (int)std::max<int64_t>(
                    1, std::min<int64_t>(1024, ((int64_t)256 << 20) / call_rows + 1));
                const int64_t n_pool = n_rows * n_copy;
                uint8_t *pool = (uint8_t *)dmalloc((size_t)(n_pool * rb));
                for (int64_t r = 0; r < n_pool; r += chunk_rows)
                    DK(di_cuda_kv_quant(g_cu, kv_f32, std::min(chunk_rows, n_pool - r), dh, dh,
                                        n_rot, pool + r * rb, NULL));
                // Copy c's lists: rows c * n_rows + b * n_keys + j.
                std::vector<int32_t> idx((size_t)n_pool), nk((size_t)B, n_keys);
                for (int64_t i = 0; i < n_pool; i++) idx[(size_t)i] = (int32_t)i;
                int32_t *idxd = (int32_t *)dmalloc(sizeof(int32_t) * (size_t)n_pool);
                int32_t *nkd = (int32_t *)dmalloc(sizeof(int32_t) * (size_t)B);
                CK(cudaMemcpy(idxd, idx.data(), sizeof(int32_t) * (size_t)n_pool,
                              cudaMemcpyHostToDevice));
                CK(cudaMemcpy(nkd, nk.data(), sizeof(int32_t) * (size_t)B, cudaMemcpyHostToDevice));
                // Pageable cudaMemcpy returns once the data is staged, its DMA on the legacy
                // stream, which g_s (non-blocking) does not wait for: the lists must have landed
                // before the first attention launch reads them.
                CK(cudaDeviceSynchronize());
                float *q = (float *)dmalloc(sizeof(float) * (size_t)(B * H * dh));
                float *o = (float *)dmalloc(sizeof(float) * (size_t)(B * H * dh));
                float *sink = (float *)dmalloc(sizeof(float) * (size_t)H);
                fill(q, sizeof(float) * (size_t)(B * H * dh), 3, 0, 1.0f);
                fill(sink, sizeof(float) * (size_t)H, 3, 0, 1.0f);
                const float scale = 1.0f / sqrtf((float)dh);
                double ms32 = time_ms(1, g_quick ? 5 : 8, [&](int rep) {
                    DK(di_cuda_attn(g_cu, q, pool, idxd + (size_t)(rep % n_copy) * n_rows, n_keys,
                                    nkd, n_keys, sink, B, H, dh, n_rot, scale, o));
                });
                double ms16 = time_ms(2, g_quick ? 5 : 20, [&](int rep) {
                    DK(di_cuda_attn_bf16(g_cu, q, pool, idxd + (size_t)(rep % n_copy) * n_rows,
                                         n_keys, nkd, n_keys, sink, B, H, dh, n_rot, scale, 0, o));
                });
                // Effective bytes: KV rows + their indices read once, q read, o written.
                const double bytes = (double)call_rows + 2.0 * 4.0 * B * H * dh;
                const double gbs16 = bytes / (ms16 * 1e-3) / 1e9;
                printf("%-6s %8lld %6d %8d %10.4f %9.0f %10.4f %9.0f %7.3f ",
                       kind == 0   ? "CSA"
                       : kind == 1 ? "HCA"
                                   : "dense",
                       (long long)L, B, n_keys, ms32, bytes / (ms32 * 1e-3) / 1e9, ms16, gbs16,
                       g_copy_gbs > 0 ? gbs16 / g_copy_gbs : 0.0);
                // The wgmma kernel (cc 9.0 with sm_90a code): its difference from the FP32
                // kernel on copy 0 first, then its time.
                double msw = 0, dw = 0;
                if (di_cuda_wgmma_available(g_cu)) {
                    const size_t n_o = (size_t)B * H * dh;
                    std::vector<float> o32(n_o), ow(n_o);
                    DK(di_cuda_attn(g_cu, q, pool, idxd, n_keys, nkd, n_keys, sink, B, H, dh, n_rot,
                                    scale, o));
                    CK(cudaStreamSynchronize(g_s));
                    CK(cudaMemcpy(o32.data(), o, sizeof(float) * n_o, cudaMemcpyDeviceToHost));
                    DK(di_cuda_attn_wg(g_cu, q, pool, idxd, n_keys, nkd, n_keys, sink, B, H, dh,
                                       n_rot, scale, 0, o));
                    CK(cudaStreamSynchronize(g_s));
                    CK(cudaMemcpy(ow.data(), o, sizeof(float) * n_o, cudaMemcpyDeviceToHost));
                    dw = max_rel_diff(ow.data(), o32.data(), n_o);
                    msw = time_ms(2, g_quick ? 5 : 20, [&](int rep) {
                        DK(di_cuda_attn_wg(g_cu, q, pool, idxd + (size_t)(rep % n_copy) * n_rows,
                                           n_keys, nkd, n_keys, sink, B, H, dh, n_rot, scale, 0,
                                           o));
                    });
                }
                print_wg(msw, bytes, dw);
                cudaFree(pool), cudaFree(idxd), cudaFree(nkd), cudaFree(q), cudaFree(o),
                    cudaFree(sink);
            }
        }
    }
    cudaFree(kv_f32);
    printf("(GB/s: (KV rows + indices + q + o bytes) / time; fp32 = di_cuda_attn (exact, SIMT), "
           "bf16 = di_cuda_attn_bf16 (tensor cores, mma.sync, automatic key splits); x copy = "
           "GB/s / the copy bandwidth above; wg = di_cuda_attn_wg (the same on wgmma, sm_90a; "
           "'-' on other devices); x goal = wg GB/s / 3000, the acceptance target; max|d|/o = "
           "max |wg - fp32| / max |o| on one call)\n");
}

// ---- attention over V4.1's codes ----

// di_cuda_attn_codes at V4.1-Flash's shapes: 64 heads, dh 512, each sequence a window of 128 Q8
// rows (528 bytes) then n_keys - 128 Q4e entries (288 bytes), round_p (the official recipe).
static void bench_codes(void) {
    const int32_t H = 64, dh = 512, W = 128;
    const int64_t wb = di_backend_code_row_bytes(8, dh, DI_BACKEND_WIN_BLOCK);
    const int64_t eb = di_backend_code_row_bytes(DI_BACKEND_Q4E, dh, DI_BACKEND_ENT_BLOCK);
    static const struct {
        int32_t B, n_keys;
    } full[] = {{1, 4096}, {1, 16384}, {1, 65536}, {1, 131072}, {64, 8192}},
      quick[] = {{1, 4096}, {1, 131072}, {64, 8192}};
    const int n_cfg = g_quick ? 3 : 5;
    // Valid codes (finite scores): random FP32 rows packed by the backend's own packer, one chunk
    // of rows repeated over the pools.
    const int64_t chunk_rows = 16384;
    float *x = (float *)dmalloc(sizeof(float) * (size_t)(chunk_rows * dh));
    fill(x, sizeof(float) * (size_t)(chunk_rows * dh), 3, 0, 1.0f);
    printf("\n== codes: attn_codes, H=%d dh=%d, %d Q8 window rows of %lld bytes + Q4e entries of "
           "%lld bytes, round_p, decode (1 query row per sequence)\n",
           H, dh, W, (long long)wb, (long long)eb);
    printf("%6s %8s %7s %10s %9s %10s %9s %7s %7s %9s %10s %9s %7s %7s %9s\n", "batch", "keys",
           "splits", "fp32 ms", "GB/s", "bf16 ms", "GB/s", "x copy", "x fp32", "max|d|/o", "wg ms",
           "GB/s", "x goal", "x copy", "max|d|/o");
    for (int ci = 0; ci < n_cfg; ci++) {
        const int32_t B = (g_quick ? quick : full)[ci].B,
                      n_keys = (g_quick ? quick : full)[ci].n_keys;
        const int32_t n_e = n_keys - W;
        // Copies of every sequence's rows so that one call's rows are not in L2 from the last
        // call (>= 256 MB in all: a batch-1 4k-key call is 1.2 MB), rotated per repetition.
        const int64_t call_bytes = (int64_t)B * (W * wb + (int64_t)n_e * eb);
        const int n_copy = (int)std::max<int64_t>(
            1, std::min<int64_t>(1024, ((int64_t)256 << 20) / call_bytes + 1));
        const int64_t n_win = (int64_t)B * W * n_copy, n_ent = (int64_t)B * n_e * n_copy;
        uint8_t *win = (uint8_t *)dmalloc((size_t)(n_win * wb));
        uint8_t *ent = (uint8_t *)dmalloc((size_t)(n_ent * eb));
        for (int64_t r = 0; r < n_win; r += chunk_rows)
            DK(di_cuda_pack_rows(g_cu, x, std::min(chunk_rows, n_win - r), dh, dh,
                                 DI_BACKEND_WIN_BLOCK, 8, win + r * wb, NULL, NULL));
        for (int64_t r = 0; r < n_ent; r += chunk_rows)
            DK(di_cuda_pack_rows(g_cu, x, std::min(chunk_rows, n_ent - r), dh, dh,
                                 DI_BACKEND_ENT_BLOCK, DI_BACKEND_Q4E, ent + r * eb, NULL, NULL));
        // Sequence b of copy c: window rows (c * B + b) * W .., entries (c * B + b) * n_e ..
        std::vector<int32_t> idx((size_t)n_copy * B * n_keys), nk((size_t)B, n_keys),
            nw((size_t)B, W);
        for (int c = 0; c < n_copy; c++)
            for (int32_t b = 0; b < B; b++)
                for (int32_t j = 0; j < n_keys; j++)
                    idx[((size_t)c * B + b) * n_keys + j] =
                        j < W ? (int32_t)(((int64_t)c * B + b) * W + j)
                              : (int32_t)(((int64_t)c * B + b) * n_e + j - W);
        int32_t *idxd = (int32_t *)dmalloc(sizeof(int32_t) * idx.size());
        int32_t *nkd = (int32_t *)dmalloc(sizeof(int32_t) * (size_t)B);
        int32_t *nwd = (int32_t *)dmalloc(sizeof(int32_t) * (size_t)B);
        CK(cudaMemcpy(idxd, idx.data(), sizeof(int32_t) * idx.size(), cudaMemcpyHostToDevice));
        CK(cudaMemcpy(nkd, nk.data(), sizeof(int32_t) * (size_t)B, cudaMemcpyHostToDevice));
        CK(cudaMemcpy(nwd, nw.data(), sizeof(int32_t) * (size_t)B, cudaMemcpyHostToDevice));
        CK(cudaDeviceSynchronize()); // the lists landed before g_s's first launch (bench_attn)
        float *q = (float *)dmalloc(sizeof(float) * (size_t)(B * H * dh));
        float *o = (float *)dmalloc(sizeof(float) * (size_t)(B * H * dh));
        float *sink = (float *)dmalloc(sizeof(float) * (size_t)H);
        fill(q, sizeof(float) * (size_t)(B * H * dh), 3, 0, 1.0f);
        fill(sink, sizeof(float) * (size_t)H, 3, 0, 1.0f);
        const float scale = 1.0f / sqrtf((float)dh);
        const double ms = time_ms(2, g_quick ? 5 : 20, [&](int rep) {
            const int c = rep % n_copy;
            DK(di_cuda_attn_codes(g_cu, q, win, ent, idxd + (size_t)c * B * n_keys, n_keys, nwd,
                                  nkd, n_keys, sink, B, H, dh, scale, true, o));
        });
        const int64_t ns = di_cuda_attn_codes_splits(g_cu, B, H, dh, n_keys);
        // Effective bytes: code rows and their indices read once, q read, o written.
        const double bytes = (double)call_bytes + 4.0 * B * n_keys + 2.0 * 4.0 * B * H * dh;
        const double gbs = bytes / (ms * 1e-3) / 1e9;
        // The BF16 tensor-core kernel (the official recipe's on H100/H200/B200; refused with
        // DI_ERR_UNSUPPORTED where the shared memory is short) on the same calls, and its largest
        // difference from the FP32 kernel (copy 0) relative to the largest |o|.
        const size_t n_o = (size_t)B * H * dh;
        std::vector<float> o32(n_o), o16(n_o);
        DK(di_cuda_attn_codes(g_cu, q, win, ent, idxd, n_keys, nwd, nkd, n_keys, sink, B, H, dh,
                              scale, true, o)); // copy 0 (the timed calls rotate the copies)
        CK(cudaStreamSynchronize(g_s));
        CK(cudaMemcpy(o32.data(), o, sizeof(float) * n_o, cudaMemcpyDeviceToHost));
        const di_status st16 = di_cuda_attn_codes_bf16(g_cu, q, win, ent, idxd, n_keys, nwd, nkd,
                                                       n_keys, sink, B, H, dh, scale, 0, o);
        double ms16 = 0, amax = 0, dmax = 0;
        if (st16 == DI_OK) {
            CK(cudaStreamSynchronize(g_s));
            CK(cudaMemcpy(o16.data(), o, sizeof(float) * n_o, cudaMemcpyDeviceToHost));
            for (size_t i = 0; i < n_o; i++) {
                amax = std::max(amax, (double)fabsf(o32[i]));
                dmax = std::max(dmax, (double)fabsf(o16[i] - o32[i]));
            }
            ms16 = time_ms(2, g_quick ? 5 : 20, [&](int rep) {
                const int c = rep % n_copy;
                DK(di_cuda_attn_codes_bf16(g_cu, q, win, ent, idxd + (size_t)c * B * n_keys, n_keys,
                                           nwd, nkd, n_keys, sink, B, H, dh, scale, 0, o));
            });
        } else if (st16 != DI_ERR_UNSUPPORTED) {
            DK(st16);
        }
        const double gbs16 = ms16 > 0 ? bytes / (ms16 * 1e-3) / 1e9 : 0.0;
        printf("%6d %8d %7lld %10.4f %9.0f ", B, n_keys, (long long)ns, ms, gbs);
        if (ms16 > 0)
            printf("%10.4f %9.0f %7.3f %7.2f %9.2g ", ms16, gbs16,
                   g_copy_gbs > 0 ? gbs16 / g_copy_gbs : 0.0, ms / ms16,
                   amax > 0 ? dmax / amax : dmax);
        else
            printf("%10s %9s %7.3f %7s %9s ", "unsupp.", "-",
                   g_copy_gbs > 0 ? gbs / g_copy_gbs : 0.0, "-", "-");
        // The wgmma kernel (cc 9.0 with sm_90a code) on the same calls.
        double msw = 0, dw = 0;
        if (di_cuda_wgmma_available(g_cu)) {
            std::vector<float> ow(n_o);
            DK(di_cuda_attn_codes_wg(g_cu, q, win, ent, idxd, n_keys, nwd, nkd, n_keys, sink, B, H,
                                     dh, scale, 0, o));
            CK(cudaStreamSynchronize(g_s));
            CK(cudaMemcpy(ow.data(), o, sizeof(float) * n_o, cudaMemcpyDeviceToHost));
            dw = max_rel_diff(ow.data(), o32.data(), n_o);
            msw = time_ms(2, g_quick ? 5 : 20, [&](int rep) {
                const int c = rep % n_copy;
                DK(di_cuda_attn_codes_wg(g_cu, q, win, ent, idxd + (size_t)c * B * n_keys, n_keys,
                                         nwd, nkd, n_keys, sink, B, H, dh, scale, 0, o));
            });
        }
        print_wg(msw, bytes, dw);
        cudaFree(win), cudaFree(ent), cudaFree(idxd), cudaFree(nkd), cudaFree(nwd), cudaFree(q),
            cudaFree(o), cudaFree(sink);
    }
    cudaFree(x);
    printf("(GB/s: (code rows + indices + q + o bytes) / time; fp32 = di_cuda_attn_codes (FP32 "
           "cores: predicted arithmetic-bound near 150 GB/s), bf16 = di_cuda_attn_codes_bf16 "
           "(tensor cores, automatic key splits: what attn_codes runs in the official recipe; "
           "predicted ~0.5-0.75 TB/s, docs/cuda.md); x copy = bf16 GB/s (fp32 where bf16 is "
           "unsupported) / the copy bandwidth above; x fp32 = the speedup; max|d|/o = max |bf16 - "
           "fp32| / max |o|; wg = di_cuda_attn_codes_wg (the same on wgmma, sm_90a; '-' on other "
           "devices), x goal = its GB/s / 3000, x copy and max|d|/o as bf16's)\n");
}

// ---- one layer and the synthetic model ----

typedef struct layer_w {
    di_tensor hc_fn_attn, hc_fn_ffn; // F32 [24, 16384]
    float *hc_base, *hc_scale, *attn_norm, *ffn_norm, *q_norm, *kv_norm, *sink, *omega;
    di_tensor wq_a, wq_b, wkv, wo_b, idx_wq_b, idx_wp;
    std::vector<di_tensor> wo_a; // G x BF16 [1024, 4096]
    moe_layer moe;
    size_t bytes_fixed; // weights every decode step reads (not the routed experts)
} layer_w;

static const int32_t kD = 4096, kNC = 4, kH = 64, kDh = 512, kRot = 64, kRq = 1024, kG = 8,
                     kRo = 1024, kHI = 64, kDI = 128, kTopk = 512, kW = 128;

static float *dev_floats(int64_t n, float a, float value = 0.0f) {
    float *p = (float *)dmalloc(sizeof(float) * (size_t)n);
    if (value != 0.0f) { // a constant (norm weights, scales): no random fill to race with
        std::vector<float> h((size_t)n, value);
        CK(cudaMemcpy(p, h.data(), sizeof(float) * (size_t)n, cudaMemcpyHostToDevice));
    } else {
        fill(p, sizeof(float) * (size_t)n, 3, 0, a);
    }
    return p;
}

static void layer_make(layer_w &L) {
    L.hc_fn_attn = dev_weight(DI_TENSOR_KIND_F32, kNC * kD, (2 + kNC) * kNC);
    L.hc_fn_ffn = dev_weight(DI_TENSOR_KIND_F32, kNC * kD, (2 + kNC) * kNC);
    L.hc_base = dev_floats(24, 0.5f);
    L.hc_scale = dev_floats(3, 0.0f, 1.0f);
    L.attn_norm = dev_floats(kD, 0.0f, 1.0f), L.ffn_norm = dev_floats(kD, 0.0f, 1.0f);
    L.q_norm = dev_floats(kRq, 0.0f, 1.0f), L.kv_norm = dev_floats(kDh, 0.0f, 1.0f);
    L.sink = dev_floats(kH, 1.0f);
    std::vector<float> om((size_t)kRot / 2);
    for (int i = 0; i < kRot / 2; i++) om[(size_t)i] = powf(160000.0f, -2.0f * i / kRot);
    L.omega = (float *)dmalloc(sizeof(float) * om.size());
    CK(cudaMemcpy(L.omega, om.data(), sizeof(float) * om.size(), cudaMemcpyHostToDevice));
    L.wq_a = dev_weight(DI_TENSOR_KIND_FP8, kD, kRq);
    L.wq_b = dev_weight(DI_TENSOR_KIND_FP8, kRq, kH * kDh);
    L.wkv = dev_weight(DI_TENSOR_KIND_FP8, kD, kDh);
    L.wo_b = dev_weight(DI_TENSOR_KIND_FP8, kG * kRo, kD);
    L.idx_wq_b = dev_weight(DI_TENSOR_KIND_FP8, kRq, kHI * kDI);
    L.idx_wp = dev_weight(DI_TENSOR_KIND_BF16, kD, kHI);
    for (int g = 0; g < kG; g++)
        L.wo_a.push_back(dev_weight(DI_TENSOR_KIND_BF16, kH * kDh / kG, kRo));
    moe_make(L.moe, 256, 6, kD, 2048);
    CK(cudaDeviceSynchronize());
    L.bytes_fixed = 2 * weight_bytes(L.hc_fn_attn) + weight_bytes(L.wq_a) + weight_bytes(L.wq_b) +
                    weight_bytes(L.wkv) + weight_bytes(L.wo_b) + weight_bytes(L.idx_wq_b) +
                    weight_bytes(L.idx_wp) + kG * weight_bytes(L.wo_a[0]) + L.moe.shared_bytes;
}

// Activations and state of a decode step for B sequences at context L (CSA layer).
typedef struct step_buf {
    int32_t B;
    int64_t ctx;
    float *x, *a, *mix, *post, *comb, *qr, *q, *kv, *o, *u, *out, *qi, *wi, *scores, *ikeys;
    int32_t *pos, *ids, *sel, *key_idx, *n_keys, *n_vis;
    int64_t *key_base; // each sequence's own indexer keys
    uint8_t *kv_pool;
} step_buf;

static void step_make(step_buf &s, int32_t B, int64_t ctx) {
    s.B = B, s.ctx = ctx;
    const int64_t n_ent = ctx / 4, n_keys = kW + kTopk;
    s.x = dev_floats((int64_t)B * kNC * kD, 1.0f);
    s.a = dev_floats((int64_t)B * kD, 1.0f), s.mix = dev_floats((int64_t)B * 24, 1.0f);
    s.post = dev_floats((int64_t)B * kNC, 1.0f), s.comb = dev_floats((int64_t)B * 16, 1.0f);
    s.qr = dev_floats((int64_t)B * kRq, 1.0f), s.q = dev_floats((int64_t)B * kH * kDh, 1.0f);
    s.kv = dev_floats((int64_t)B * kDh, 1.0f), s.o = dev_floats((int64_t)B * kH * kDh, 1.0f);
    s.u = dev_floats((int64_t)B * kG * kRo, 1.0f), s.out = dev_floats((int64_t)B * kD, 1.0f);
    s.qi = dev_floats((int64_t)B * kHI * kDI, 1.0f), s.wi = dev_floats((int64_t)B * kHI, 1.0f);
    s.scores = dev_floats((int64_t)B * n_ent, 1.0f);
    s.ikeys = dev_floats((int64_t)B * n_ent * kDI, 1.0f);
    std::vector<int32_t> pos((size_t)B, (int32_t)ctx - 1), nk((size_t)B, (int32_t)n_keys),
        nv((size_t)B, (int32_t)n_ent), idx((size_t)(B * n_keys));
    for (int64_t i = 0; i < B * n_keys; i++) idx[(size_t)i] = (int32_t)i;
    s.pos = (int32_t *)dmalloc(4 * (size_t)B), s.ids = (int32_t *)dmalloc(4 * (size_t)B);
    s.sel = (int32_t *)dmalloc(4 * (size_t)(B * kTopk));
    s.n_keys = (int32_t *)dmalloc(4 * (size_t)B), s.n_vis = (int32_t *)dmalloc(4 * (size_t)B);
    s.key_idx = (int32_t *)dmalloc(4 * (size_t)(B * n_keys));
    CK(cudaMemcpy(s.pos, pos.data(), 4 * (size_t)B, cudaMemcpyHostToDevice));
    CK(cudaMemset(s.ids, 0, 4 * (size_t)B));
    CK(cudaMemcpy(s.n_keys, nk.data(), 4 * (size_t)B, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(s.n_vis, nv.data(), 4 * (size_t)B, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(s.key_idx, idx.data(), 4 * idx.size(), cudaMemcpyHostToDevice));
    std::vector<int64_t> kb((size_t)B);
    for (int32_t b = 0; b < B; b++) kb[(size_t)b] = (int64_t)b * n_ent;
    s.key_base = (int64_t *)dmalloc(8 * (size_t)B);
    CK(cudaMemcpy(s.key_base, kb.data(), 8 * (size_t)B, cudaMemcpyHostToDevice));
    s.kv_pool = (uint8_t *)dmalloc((size_t)(B * n_keys * di_cuda_kv_row_bytes(kDh, kRot)));
    fill(s.kv_pool, (size_t)(B * n_keys * di_cuda_kv_row_bytes(kDh, kRot)), 1);
    // The stream is non-blocking: order the legacy-stream copies above and the fills on it.
    CK(cudaDeviceSynchronize());
}

static void step_free(step_buf &s) {
    void *p[] = {s.x,   s.a,   s.mix,     s.post,   s.comb,  s.qr,      s.q,       s.kv,
                 s.o,   s.u,   s.out,     s.qi,     s.wi,    s.scores,  s.ikeys,   s.pos,
                 s.ids, s.sel, s.key_idx, s.n_keys, s.n_vis, s.kv_pool, s.key_base};
    for (void *q : p) cudaFree(q);
}

// One CSA layer's decode step (spec §2.2, §3.4; the compressor's per-window work is left out: it
// runs once per 4 tokens and its projections are two [1024, 4096] F32 GEMVs).
static void layer_step(const layer_w &L, step_buf &s) {
    const int32_t B = s.B;
    // attention sub-layer
    DK(di_cuda_matmul(g_cu, &L.hc_fn_attn, s.x, B, kNC * kD, s.mix, 24));
    DK(di_cuda_mhc_pre(g_cu, s.x, s.mix, L.hc_base, L.hc_scale, kNC, kD, B, 20, 1e-6f, 1e-6f, false,
                       s.a, s.post, s.comb));
    DK(di_cuda_rmsnorm(g_cu, s.a, B, kD, kD, L.attn_norm, 1e-6f));
    DK(di_cuda_matmul(g_cu, &L.wq_a, s.a, B, kD, s.qr, kRq));
    DK(di_cuda_rmsnorm(g_cu, s.qr, B, kRq, kRq, L.q_norm, 1e-6f));
    DK(di_cuda_matmul(g_cu, &L.wq_b, s.qr, B, kRq, s.q, kH * kDh));
    DK(di_cuda_rmsnorm(g_cu, s.q, (int64_t)B * kH, kDh, kDh, NULL, 1e-6f));
    DK(di_cuda_rope(g_cu, s.q, (int64_t)B * kH, kDh, kDh, kRot, L.omega, s.pos, kH, 1.0f, false));
    DK(di_cuda_matmul(g_cu, &L.wkv, s.a, B, kD, s.kv, kDh));
    DK(di_cuda_rmsnorm(g_cu, s.kv, B, kDh, kDh, L.kv_norm, 1e-6f));
    DK(di_cuda_rope(g_cu, s.kv, B, kDh, kDh, kRot, L.omega, s.pos, 1, 1.0f, false));
    DK(di_cuda_kv_quant(g_cu, s.kv, B, kDh, kDh, kRot, s.kv_pool, NULL)); // rows 0..B-1
    // indexer over ctx/4 entries, top-512
    DK(di_cuda_matmul(g_cu, &L.idx_wq_b, s.qr, B, kRq, s.qi, kHI * kDI));
    DK(di_cuda_matmul(g_cu, &L.idx_wp, s.a, B, kD, s.wi, kHI));
    DK(di_cuda_indexer_scores(g_cu, s.qi, s.wi, s.ikeys, s.key_base, NULL, NULL, 0, s.n_vis,
                              (int32_t)(s.ctx / 4), B, kHI, kDI, false, s.scores, s.ctx / 4));
    DK(di_cuda_topk(g_cu, s.scores, s.ctx / 4, s.n_vis, B, kTopk, s.sel));
    DK(di_cuda_attn(g_cu, s.q, s.kv_pool, s.key_idx, kW + kTopk, s.n_keys, kW + kTopk, L.sink, B,
                    kH, kDh, kRot, 1.0f / sqrtf((float)kDh), s.o));
    DK(di_cuda_rope(g_cu, s.o, (int64_t)B * kH, kDh, kDh, kRot, L.omega, s.pos, kH, 1.0f, true));
    for (int g = 0; g < kG; g++)
        DK(di_cuda_matmul(g_cu, &L.wo_a[(size_t)g], s.o + (int64_t)g * (kH * kDh / kG), B, kH * kDh,
                          s.u + (int64_t)g * kRo, kG * kRo));
    DK(di_cuda_matmul(g_cu, &L.wo_b, s.u, B, kG * kRo, s.out, kD));
    DK(di_cuda_mhc_post(g_cu, s.out, s.x, s.post, s.comb, kNC, kD, B));
    // MoE sub-layer
    DK(di_cuda_matmul(g_cu, &L.hc_fn_ffn, s.x, B, kNC * kD, s.mix, 24));
    DK(di_cuda_mhc_pre(g_cu, s.x, s.mix, L.hc_base, L.hc_scale, kNC, kD, B, 20, 1e-6f, 1e-6f, false,
                       s.a, s.post, s.comb));
    DK(di_cuda_rmsnorm(g_cu, s.a, B, kD, kD, L.ffn_norm, 1e-6f));
    DK(di_cuda_moe(g_cu, &L.moe.w, s.a, s.ids, B, s.out, NULL, NULL));
    DK(di_cuda_mhc_post(g_cu, s.out, s.x, s.post, s.comb, kNC, kD, B));
}

static void bench_layer_and_model(bool model) {
    const int n_sets = model ? 4 : 1;
    std::vector<layer_w> Ls((size_t)n_sets);
    for (layer_w &L : Ls) layer_make(L);
    di_tensor head = dev_weight(DI_TENSOR_KIND_BF16, kD, 129280);
    float *hn = dev_floats(kD, 0.0f, 1.0f);
    const int64_t ctx = 4096;
    if (!model)
        printf("\n== layer: one V4-Flash CSA layer decode step at context %lld (CUDA graph)\n",
               (long long)ctx);
    else
        printf("\n== model: 43 layers (%d weight sets cycled) + head, decode at context %lld\n",
               n_sets, (long long)ctx);
    printf("%6s %10s %12s %12s %9s\n", "batch", "ms", model ? "tokens/s" : "roofline ms",
           "bytes MB", "of roof");
    for (int bi = 0; bi < 2; bi++) {
        const int32_t B = bi ? 64 : 1;
        step_buf s;
        step_make(s, B, ctx);
        float *h = dev_floats((int64_t)B * kD, 1.0f),
              *logits = (float *)dmalloc(sizeof(float) * (size_t)B * 129280);
        // Bytes one step must read: fixed weights + the experts its tokens touch (expected
        // distinct experts of B*6 uniform draws from 256) + KV and indexer keys.
        const double n_exp = 256.0 * (1.0 - pow(1.0 - 6.0 / 256.0, B));
        const double kv_bytes =
            (double)B * ((kW + kTopk) * di_cuda_kv_row_bytes(kDh, kRot) + (ctx / 4) * kDI * 4.0);
        const double layer_bytes = Ls[0].bytes_fixed + n_exp * Ls[0].moe.expert_bytes + kv_bytes;
        const int n_layers = model ? 43 : 1;
        const double bytes = n_layers * layer_bytes + (model ? (double)weight_bytes(head) : 0.0);
        // One uncaptured step first: the pool's blocks then exist before the capture.
        layer_step(Ls[0], s);
        CK(cudaStreamSynchronize(g_s));
        di_cuda_graph *g = NULL;
        DK(di_cuda_graph_begin(g_cu));
        for (int il = 0; il < n_layers; il++) layer_step(Ls[(size_t)(il % n_sets)], s);
        if (model) {
            DK(di_cuda_mhc_pre(g_cu, s.x, s.mix, Ls[0].hc_base, Ls[0].hc_scale, kNC, kD, B, 20,
                               1e-6f, 1e-6f, true, h, NULL, NULL));
            DK(di_cuda_rmsnorm(g_cu, h, B, kD, kD, hn, 1e-6f));
            DK(di_cuda_matmul(g_cu, &head, h, B, kD, logits, 129280));
        }
        DK(di_cuda_graph_end(g_cu, &g));
        double ms = time_ms(2, g_quick ? 10 : 20, [&](int) { DK(di_cuda_graph_launch(g_cu, g)); });
        const double roof_ms = bytes / (g_copy_gbs * 1e9) * 1e3;
        if (model)
            printf("%6d %10.3f %12.1f %12.0f %8.1f%%\n", B, ms, B / (ms * 1e-3), bytes / 1e6,
                   100.0 * roof_ms / ms);
        else
            printf("%6d %10.4f %12.4f %12.0f %8.1f%%\n", B, ms, roof_ms, bytes / 1e6,
                   100.0 * roof_ms / ms);
        di_cuda_graph_destroy(g);
        cudaFree(h), cudaFree(logits);
        step_free(s);
    }
    printf(
        "(roofline: bytes that must be read / measured copy bandwidth %.0f GB/s; target >= 70%%)\n",
        g_copy_gbs);
    for (layer_w &L : Ls) {
        moe_free(L.moe);
        free_weight(L.hc_fn_attn), free_weight(L.hc_fn_ffn), free_weight(L.wq_a),
            free_weight(L.wq_b), free_weight(L.wkv), free_weight(L.wo_b), free_weight(L.idx_wq_b),
            free_weight(L.idx_wp);
        for (di_tensor &t : L.wo_a) free_weight(t);
        void *p[] = {L.hc_base, L.hc_scale, L.attn_norm, L.ffn_norm,
                     L.q_norm,  L.kv_norm,  L.sink,      L.omega};
        for (void *q : p) cudaFree(q);
    }
    free_weight(head);
    cudaFree(hn);
}

int main(int argc, char **argv) {
    const char *only = NULL;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--quick")) {
            g_quick = true;
        } else if (!strcmp(argv[i], "--only") && i + 1 < argc) {
            only = argv[++i];
        } else {
            fprintf(stderr,
                    "usage: bench_cuda [--quick] [--only copy|gemm|moe|attn|codes|layer|model]\n");
            return 2;
        }
    }
    if (di_cuda_device_count() == 0) {
        fprintf(stderr, "bench_cuda: no CUDA device\n");
        return 77;
    }
    DK(di_cuda_create(0, &g_cu));
    g_s = (cudaStream_t)g_cu->stream;
    char desc[256];
    di_cuda_describe(g_cu, desc, sizeof desc);
    printf("device: %s%s\n", desc, g_quick ? " (quick)" : "");
    bench_copy(); // always: the ceiling for the other sections
#define SECTION(name, call)                                                                        \
    if (!only || !strcmp(only, name)) {                                                            \
        call;                                                                                      \
        fflush(stdout);                                                                            \
    }
    SECTION("gemm", bench_gemm());
    SECTION("moe", bench_moe());
    SECTION("attn", bench_attn());
    SECTION("codes", bench_codes());
    SECTION("layer", bench_layer_and_model(false));
    SECTION("model", bench_layer_and_model(true));
    CK(cudaStreamSynchronize(g_s));
    di_cuda_destroy(g_cu);
    return 0;
}
