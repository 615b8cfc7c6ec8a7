/*
 * rope — interleaved partial RoPE on device rows, the same arithmetic as di_ref_rope
 * (backend/cpu/ref_ops.h): the trailing n_rot values of each row rotate in pairs (n-n_rot+2i, +1)
 * by angle fl32(pos * omega[i]); cos and sin are multiplied by `scale`; inverse negates sin.
 * omega is the frequency table the model computes on the host (di_rope_freqs: plain or YaRN),
 * uploaded once. Thread-safety: engine thread only.
 */
#pragma once

#include "backend/cuda/cuda_backend.h"

#ifdef __cplusplus
extern "C" {
#endif

// Rows r < n_rows of n values (row_stride floats apart); row r takes position
// pos[r / rows_per_pos] (rows_per_pos = heads per token for q, 1 for kv). omega: device
// [n_rot / 2]; pos: device int32. DI_ERR_CUDA.
di_status di_cuda_rope(di_cuda *cu, float *x, int64_t n_rows, int64_t row_stride, int64_t n,
                       int32_t n_rot, const float *omega, const int32_t *pos, int32_t rows_per_pos,
                       float scale, bool inverse);

#ifdef __cplusplus
}
#endif
