/*
 * moe_tc — the routed experts' prefill on tensor cores: a grouped GEMM over all experts of a
 * layer in one launch (the contract of gemm.cuh di_cuda_matmul_grouped) with BF16 mma.sync
 * m16n8k16 and FP32 accumulation, for the official recipe's A8 activations (e4m3 codes times a
 * power-of-two block scale) against FP4 e2m1 (per-32 UE8M0) or FP8 e4m3 (128x128 UE8M0) experts.
 *
 * Numerics: an A8 value has 4 significant bits and a power-of-two scale, an expert weight code x
 * its UE8M0 scale 2 (e2m1) or 4 (e4m3) significant bits and a power of two; BF16 has 8
 * significant bits and FP32's exponent range, so both operands are exact in BF16 (scales folded
 * in: no per-K-block promotion is needed, unlike FP8 MMA operands, whose exponent range is too
 * narrow), every product is exact in the MMA and the sums are FP32: the SIMT kernel's numerics
 * class, only the summation order differs. (Exceptions: a weight scale below 2^-118 whose
 * products reach FP32's subnormals, where BF16 keeps fewer bits; no checkpoint has one.)
 *
 * Design (docs/cuda.md "Routed experts on tensor cores"): the activations are converted once to
 * BF16 (exact for A8 values) into pool scratch; a tile list (expert, first grouped row) is built
 * on the device from the offsets; each block computes 128 output features x BN grouped rows of
 * one expert (BN 64, or 16 when experts hold few rows), K in steps of 64: the weight codes are
 * loaded into registers one step ahead and decoded (code x scale, exact) into BF16 in shared
 * memory, the activations come by cp.async (16 bytes, zero-filled past the expert's rows), two
 * shared-memory stages, one barrier per step. Output FP32, the SIMT path's layout.
 *
 * Owns: nothing (scratch from the pool per call). Thread-safety: engine thread only.
 */
#pragma once

#include "backend/cuda/cuda_backend.h"

#ifdef __cplusplus
extern "C" {
#endif

// The tensor-core grouped GEMM alone (tests, benchmarks): for each expert e < n_expert and grouped
// row i in [offsets[e], offsets[e+1]): y[i*y_stride + o] = sum_c W_e[o, c] * x[src(i)*x_stride + c]
// with src(i) = x_rows[i] (x_rows NULL: i). x: device FP32 [n_x_rows rows, x_stride apart] whose
// values must be BF16-exact (A8 values are; others are rounded to BF16 first); n_rows =
// offsets[n_expert] (the host's count, it sizes the tile list); experts: device array of device
// FP4 or FP8 tensors of `kind` and shape [n_out, n_in] with packed 16-aligned rows and block_in a
// multiple of 32 (what the loader makes of V4 experts; an expert that is not has its outputs
// written as NaN). DI_ERR_UNSUPPORTED for shapes it does not take (n_in % 64 != 0, another kind,
// below sm_80, n_expert > 4096, a tile list past the grid limit): the caller runs the SIMT
// kernel. DI_ERR_CUDA, DI_ERR_NOMEM.
di_status di_cuda_matmul_grouped_tc(di_cuda *cu, di_tensor_kind kind, const di_tensor *experts,
                                    int32_t n_expert, int64_t n_out, int64_t n_in,
                                    const int32_t *offsets, int32_t n_rows, const int32_t *x_rows,
                                    const float *x, int64_t n_x_rows, int64_t x_stride, float *y,
                                    int64_t y_stride);

// The routed experts' linear of di_cuda_moe in the official recipe (x holds A8 values): on tensor
// cores (above) for prefill calls (n_tok >= DI_BACKEND_TC_MIN_ROWS tokens in the layer, outside
// a capture, sm_80+, cu->moe_tc >= 0, a shape it takes), else di_cuda_matmul_grouped (rows_hint
// passed on). The first tensor-core call of a context also runs the SIMT kernel and compares on
// the host (max |diff| <= 1e-2 max |y|; FP32 sums in another order agree to ~1e-6, a wrong
// fragment, scale or row is off by O(max |y|)): a mismatch logs it and turns the tensor cores
// off for the context (cu->moe_tc = -1, y gets the SIMT result), a match logs the figures and
// keeps them (cu->moe_tc = 1); a tensor-core launch refused at run time (then or later) turns
// them off too, that call on the SIMT kernel; cu->n_moe_tc_calls counts the calls they ran.
// DI_CUDA_MOE_TC=0 in the environment (read at that first call) keeps the SIMT kernel: the switch
// to compare against. DI_ERR_CUDA, DI_ERR_NOMEM, DI_ERR_INVALID (as di_cuda_matmul_grouped).
di_status di_cuda_moe_grouped_a8(di_cuda *cu, di_tensor_kind kind, const di_tensor *experts,
                                 int32_t n_expert, int64_t n_out, int64_t n_in,
                                 const int32_t *offsets, int32_t n_rows, const int32_t *x_rows,
                                 const float *x, int64_t n_x_rows, int64_t x_stride, float *y,
                                 int64_t y_stride, int32_t n_tok, int32_t rows_hint);

#ifdef __cplusplus
}
#endif
