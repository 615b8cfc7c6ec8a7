/*
 * mhc — manifold-constrained hyper-connections on the GPU (spec §2.3, the C forward's hc_pre /
 * hc_post in model/dsv4.c): the collapse of NC residual streams into one input row with the
 * pre-gates, the post-gates and the Sinkhorn-normalised NC x NC combination matrix, and the
 * expansion back. The raw mix projections (fn . x) come from di_cuda_matmul (F32 weights).
 * FP32 precision recipe (no BF16 rounding). Thread-safety: engine thread only.
 */
#pragma once

#include "backend/cuda/cuda_backend.h"

#ifdef __cplusplus
extern "C" {
#endif

enum { DI_CUDA_MHC_MAX_NC = 16 };

// Per token t < n_tok: r = 1/sqrt(mean(x_t^2) + norm_eps) over its NC*D values; mix = mix_raw * r;
// pre_s = sigmoid(mix_s*scale[0] + base_s) + hc_eps; a_t = sum_s pre_s * x_t[s]. Unless head:
// post_s = 2 sigmoid(mix_{NC+s} scale[1] + base_{NC+s}); comb = Sinkhorn(mix_{2NC..} scale[2] +
// base_{2NC..}, iters, hc_eps) exactly as dsv4.c. x: [T, NC, D]; mix_raw: [T, n_mix] with n_mix =
// NC (head) or (2+NC)*NC; base, scale: device; a: [T, D]; post: [T, NC]; comb: [T, NC, NC]
// (post/comb unused for head, may be NULL). nc <= DI_CUDA_MHC_MAX_NC. DI_ERR_CUDA.
di_status di_cuda_mhc_pre(di_cuda *cu, const float *x, const float *mix_raw, const float *base,
                          const float *scale, int32_t nc, int64_t D, int32_t n_tok, int32_t iters,
                          float hc_eps, float norm_eps, bool head, float *a, float *post,
                          float *comb);

// V4.1's single-pass site (backend.h mhc_pre_carried): unless mix_raw is NULL, the coefficients
// of di_cuda_mhc_pre (non-head) with pre written to pre_out [T, nc] (may be NULL), post and comb;
// then a_t = sum_s pre_in[t, s] * x_t[s] (the pre carried from the previous site, in stream
// order). DI_ERR_INVALID (nc out of range, pre_in NULL), DI_ERR_CUDA.
di_status di_cuda_mhc_pre_carried(di_cuda *cu, const float *x, const float *mix_raw,
                                  const float *base, const float *scale, int32_t nc, int64_t D,
                                  int32_t n_tok, int32_t iters, float hc_eps, float norm_eps,
                                  const float *pre_in, float *a, float *pre_out, float *post,
                                  float *comb);

// In place: x[t, k] = post[t, k] * o[t] + sum_j comb[t, j, k] * x[t, j]. DI_ERR_CUDA.
di_status di_cuda_mhc_post(di_cuda *cu, const float *o, float *x, const float *post,
                           const float *comb, int32_t nc, int64_t D, int32_t n_tok);

#ifdef __cplusplus
}
#endif
