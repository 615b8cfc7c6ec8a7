/*
 * gemm — y = W x on the GPU for every weight kind of tensor/tensor.h (F32, F16, BF16, FP8 e4m3 with
 * 128x128 UE8M0 block scales, FP4 e2m1 with per-32 UE8M0 scales), FP32 activations and FP32
 * accumulation; the same contract as di_cpu_matmul (backend/cpu/gemm.h):
 *     y[t*y_stride + o] = sum_i W[o, i] * x[t*x_stride + i]   for t < n_tok, o < W.ne[1].
 * W is a device tensor (di_cuda_tensor_upload); x and y are device pointers and must not overlap.
 *
 * Kernels (all decode weights exactly as quant_ref.c, then multiply in FP32):
 *   - gemv:    few tokens (decode): one warp per output row, 8-element vector decodes, up to 8
 *              tokens per pass; memory-bound, reads every weight byte once per 8 tokens.
 *   - tiled:   many tokens (prefill): 64 rows x 64 tokens x 32 columns shared-memory tiles,
 *              4x4 outputs per thread (portable: sm_80, sm_90a, sm_100). No tensor cores yet.
 *   - grouped: routed experts: one launch for all experts of a layer; expert e multiplies the rows
 *              [offsets[e], offsets[e+1]) of the grouped activations (moe.cuh builds them).
 * di_cuda_matmul picks gemv for n_tok <= DI_CUDA_GEMV_MAX_TOKENS, else tiled. Summation order
 * differs from the CPU's: results agree to FP32 rounding (tests/backend/cuda/test_cuda_gemm.c).
 *
 * Thread-safety: engine thread only (enqueues on cu->stream).
 */
#pragma once

#include "backend/cuda/cuda_backend.h"

#ifdef __cplusplus
extern "C" {
#endif

enum { DI_CUDA_GEMV_MAX_TOKENS = 8 };

// The dispatching entry point. DI_ERR_CUDA on a launch error; n_tok <= 0 or ne[1] == 0: no-op.
di_status di_cuda_matmul(di_cuda *cu, const di_tensor *w, const float *x, int64_t n_tok,
                         int64_t x_stride, float *y, int64_t y_stride);
// The two variants behind it (tests and benchmarks call them directly; any n_tok works for both).
di_status di_cuda_matmul_gemv(di_cuda *cu, const di_tensor *w, const float *x, int64_t n_tok,
                              int64_t x_stride, float *y, int64_t y_stride);
di_status di_cuda_matmul_tiled(di_cuda *cu, const di_tensor *w, const float *x, int64_t n_tok,
                               int64_t x_stride, float *y, int64_t y_stride);

// Grouped expert GEMM: for each expert e < n_expert and each grouped row i in
// [offsets[e], offsets[e+1]):  y[i*y_stride + o] = sum_c W_e[o, c] * x[src(i)*x_stride + c]
// with src(i) = x_rows[i] (x_rows may be NULL: src(i) = i). experts: device array of n_expert
// device tensors of one shape [n_out, n_in]; offsets: device [n_expert + 1]. rows_hint: the
// expected rows per expert (1 in single-token decode picks the leaner one-token kernel; any
// count stays correct, only speed depends on it; 0 = unknown). One launch. Each expert's vector
// width is decided on the device from its own descriptor (kind, block_in, row stride, alignment:
// the gemv's conditions), so experts need not share a layout and n_in alone decides nothing.
di_status di_cuda_matmul_grouped(di_cuda *cu, const di_tensor *experts, int32_t n_expert,
                                 int64_t n_out, int64_t n_in, const int32_t *offsets,
                                 const int32_t *x_rows, const float *x, int64_t x_stride, float *y,
                                 int64_t y_stride, int32_t rows_hint);

// ---- FP8 x FP8 through cuBLASLt block scaling (gemm_lt.cu): the official precision recipe ----
//
// In the official recipe (spec §2.0) activations are A8-quantised (e4m3, one power-of-two scale
// per 128 values) before every FP8 GEMM, so the product is FP8 x FP8 with DeepSeek's block scales:
// 1x128 for activations, 128x128 for weights, which cuBLASLt runs on Hopper tensor cores
// (CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F / BLK128x128_32F, no fast accumulation).

// A8 on the device, bit-exact with tensor/quant_ref.h di_act_quant_a8: for each of n_tok rows of
// n values (n % 128 == 0): amax = max(max|x|, 1e-4) per 128-block, s = 2^ceil_log2(amax / 448),
// codes[t*n + i] = e4m3(x / s), scales[t*(n/128) + b] = s. DI_ERR_INVALID, DI_ERR_CUDA.
di_status di_cuda_act_quant_a8(di_cuda *cu, const float *x, int64_t n_tok, int64_t x_stride,
                               int64_t n, uint8_t *codes, float *scales);

// The UE8M0 block scales of a device FP8 weight (block 128x128, row0 0) as FP32
// [ceil(n_out/128)][ceil(n_in/128)] (out: device, that many floats): once per weight.
di_status di_cuda_fp8_scales_f32(di_cuda *cu, const di_tensor *w, float *out);

// y[t*y_stride + o] = sum_i W[o,i] * codes[t*n_in + i] * x_scales[t][i/128] through cuBLASLt.
// w: device FP8 with packed rows (nb1 = n_in, n_in % 128 == 0); w_scales: from
// di_cuda_fp8_scales_f32. DI_ERR_UNSUPPORTED when cuBLASLt offers no algorithm for this shape on
// this GPU (callers fall back to di_cuda_matmul on dequantised activations), DI_ERR_CUDA.
di_status di_cuda_matmul_fp8_lt(di_cuda *cu, const di_tensor *w, const float *w_scales,
                                const uint8_t *codes, const float *x_scales, int64_t n_tok,
                                float *y, int64_t y_stride);

// Called by di_cuda_tensor_upload for every uploaded weight: on sm_90+, an FP8 weight the
// tensor-core path can take gets its scales in cuBLASLt's layout once, kept (device memory of cu)
// as long as the weight, so that matmul_a8 converts only the activations' scales per call.
// Other weights: no-op. DI_ERR_CUDA, DI_ERR_NOMEM.
di_status di_cuda_lt_weight_uploaded(di_cuda *cu, const di_tensor *dev);
// cu->lt_cache, empty (di_cuda_create) / its host side freed (di_cuda_destroy; the device side
// is pool memory). DI_ERR_NOMEM.
di_status di_cuda_lt_cache_create(di_cuda *cu);
void di_cuda_lt_cache_free(di_cuda *cu);

// backend.h matmul_a8: y = W . A8(x) (A8 into aq, then di_cuda_matmul) or, for FP8 weights of
// 128x128 blocks at n_tok >= DI_BACKEND_TC_MIN_ROWS outside a capture on sm_90+, the same product
// on FP8 tensor cores (A8 codes and scales, then cuBLASLt; an uploaded weight brings its scales
// in cuBLASLt's layout and each shape's algorithm is asked for once: di_cuda.n_fp8_tc_cached
// counts the calls that reused both). The scale layouts cuBLASLt
// reads are inferred (above), so the first such call also runs the SIMT path and compares (FP32
// sums in another order: max |diff| <= 1e-2 max |y|, a wrong scale or layout is off by O(max |y|));
// a mismatch, no cuBLASLt algorithm or a failing cuBLASLt call (on the first call or a later one)
// turns the tensor-core path off for the context (logged, cu->fp8_tc = -1), and every call is then
// the SIMT path. cuBLASLt has these block-scale modes (12.9+) for Hopper only (docs/cuda.md): on
// sm_100 the first call is expected to find no algorithm and turn the path off. DI_ERR_INVALID,
// DI_ERR_CUDA.
di_status di_cuda_matmul_a8(di_cuda *cu, const di_tensor *w, const float *x, int64_t n_tok,
                            int64_t x_stride, float *aq, float *y, int64_t y_stride);

// CPU fallback (conventions §7): when di_cuda_supports_op(MATMUL, w_host) is false the product
// runs on the CPU through di_cpu_matmul (x downloaded, y uploaded; one WARN per process), else on
// the GPU with w_dev. cpu is a di_cpu (backend/cpu/ref_ops.h) sized for w. DI_ERR_CUDA,
// DI_ERR_NOMEM.
typedef struct di_cpu di_cpu;
di_status di_cuda_matmul_or_cpu(di_cuda *cu, di_cpu *cpu, const di_tensor *w_host,
                                const di_tensor *w_dev, const float *x, int64_t n_tok,
                                int64_t x_stride, float *y, int64_t y_stride);

#ifdef __cplusplus
}
#endif
