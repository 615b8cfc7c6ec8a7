/*
 * quant — the official precision recipe's rounding points on device rows (spec §2.0), each the
 * exact arithmetic of tensor/quant_ref.c, so that the GPU forward rounds where and as the CPU
 * forward does: BF16 rounding (di_round_bf16), the fake quantisers Q8 (e4m3) and Q4 (e2m1) with
 * power-of-two block scales (di_fake_quant_q8 / _q4: A8 before FP8/FP4 linears, the KV rows' nope
 * dims, the indexer's Q4) and the scaled Walsh-Hadamard transform (di_hadamard, the same butterfly
 * order), and the packers of V4.1's stored codes (di_quant_*_pack's bytes). Results are
 * bit-identical to the CPU's on the same inputs (no reduction whose order matters: max is exact,
 * and each butterfly element sees the CPU's additions in the CPU's order).
 *
 * Owns: nothing. Thread-safety: engine thread only.
 */
#pragma once

#include "backend/cuda/cuda_backend.h"

#ifdef __cplusplus
extern "C" {
#endif

// x[i] = bf16(x[i]) for i < n (round to nearest even; NaN stays NaN). DI_ERR_CUDA.
di_status di_cuda_round_bf16(di_cuda *cu, float *x, int64_t n);

// Over n_rows rows `stride` floats apart: y[r, :n] = Q8 (bits 8), Q4 (bits 4) or V4.1's Q4e
// (bits DI_BACKEND_Q4E: e2m1 with an E4M3 scale of amax / 6 by division, di_fake_quant_q4e) of
// x[r, :n] per block of `block` values; y may be x; columns past n untouched. A block holding a
// non-finite value becomes NaN. DI_ERR_INVALID unless 1 <= block <= 1024 divides n <= stride and
// bits is 8, 4 or DI_BACKEND_Q4E; DI_ERR_CUDA.
di_status di_cuda_fake_quant(di_cuda *cu, const float *x, int64_t n_rows, int64_t n, int64_t stride,
                             int32_t block, int32_t bits, float *y);

// V4.1's packed codes (backend.h pack_rows): rows x + s_i * x_stride (s_i = src_rows[i] or i)
// fake-quantised per block (bits 8: Q8, 4: Q4, DI_BACKEND_Q4E: Q4e) and written as codes and scale
// bytes (di_backend_code_row_bytes) at dst + dst_rows[i] * row bytes (NULL: i; negative:
// skipped): the bytes of tensor/quant_ref.h di_quant_*_pack. DI_ERR_INVALID unless block >= 2 is
// even and divides n_dims <= 1024, bits as above; DI_ERR_CUDA.
di_status di_cuda_pack_rows(di_cuda *cu, const float *x, int64_t n, int64_t x_stride,
                            int32_t n_dims, int32_t block, int32_t bits, uint8_t *dst,
                            const int32_t *dst_rows, const int32_t *src_rows);

// In place over n_rows contiguous rows of n floats: di_hadamard. DI_ERR_INVALID unless n is a
// power of two <= 1024; DI_ERR_CUDA.
di_status di_cuda_hadamard(di_cuda *cu, float *x, int64_t n_rows, int64_t n);

#ifdef __cplusplus
}
#endif
