/*
 * norm — row-wise RMSNorm (the model's every norm, backend/cpu/ref_ops.h di_ref_rmsnorm) and the
 * sampling-side softmax, on device FP32 rows. One block per row; FP32 sums (tree order, so results
 * differ from the CPU's fixed order only by FP32 rounding).
 * Thread-safety: engine thread only.
 */
#pragma once

#include "backend/cuda/cuda_backend.h"

#ifdef __cplusplus
extern "C" {
#endif

// In place over n_rows rows of n values, stride floats apart: x = x * rsqrt(mean(x^2) + eps) [* w].
// w: device [n] or NULL (unweighted). DI_ERR_CUDA.
di_status di_cuda_rmsnorm(di_cuda *cu, float *x, int64_t n_rows, int64_t n, int64_t stride,
                          const float *w, float eps);

// In place: row = softmax(row / temperature) over n values (temperature > 0). DI_ERR_CUDA.
di_status di_cuda_softmax(di_cuda *cu, float *x, int64_t n_rows, int64_t n, int64_t stride,
                          float temperature);

#ifdef __cplusplus
}
#endif
