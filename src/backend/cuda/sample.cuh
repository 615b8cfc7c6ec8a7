/*
 * sample — the sampler's greedy pick on device FP32 logit rows (backend/backend.h argmax_rows):
 * the index of each row's maximum, exactly sample/sampler.h di_argmax (the CPU backend's
 * di_ref_argmax), so that greedy rows and speculative drafts cross to the host as one int32 each
 * instead of a row of the vocabulary.
 *
 * Owns: nothing. Thread-safety: engine thread only (enqueues on cu->stream).
 */
#pragma once

#include "backend/cuda/cuda_backend.h"

#ifdef __cplusplus
extern "C" {
#endif

// ids[r] (device [n_rows]) = the first index of the largest of x[r * stride + 0 .. V) (device):
// NaNs never win, a row whose entry 0 is NaN gives 0, equal values (-0 and +0 included) go to
// the lower index, a row of -inf gives 0. One block per row, float4 loads over the row's 16-byte
// aligned middle, warp-shuffle reductions of (value, index) pairs; no scratch, no device data
// checks (nothing in the row can be out of contract): capturable. DI_ERR_INVALID (logged) unless
// 1 <= V <= INT32_MAX, stride >= V, 0 <= n_rows <= INT32_MAX; DI_ERR_CUDA.
di_status di_cuda_argmax_rows(di_cuda *cu, const float *x, int64_t n_rows, int64_t V,
                              int64_t stride, int32_t *ids);

#ifdef __cplusplus
}
#endif
