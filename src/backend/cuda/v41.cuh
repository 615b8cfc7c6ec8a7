/*
 * v41 — DeepSeek V4.1's own device ops (deepseek-v41.md; backend.h engram_gate, index_cand): the
 * Engram gate (§2.3.2) and the two-level indexer's candidate pool (§2.5.3), each the arithmetic of
 * backend/cpu/ref_ops.h di_ref_engram_gate / di_ref_cand_*. The candidate pool (block maxima, then
 * the indexer's radix-select top-k), the mask and the drop are exact (comparisons and maxima); the
 * gate's three dot products are block reductions, so they match the CPU's serial sums to FP32
 * rounding, not bit for bit.
 *
 * Owns: nothing. Thread-safety: engine thread only.
 */
#pragma once

#include "backend/cuda/cuda_backend.h"

#ifdef __cplusplus
extern "C" {
#endif

// x [T, nc, D] += gate * value per stream (kv [T, (nc + 1) D]: nc keys then the value; qk [nc,
// D]): di_ref_engram_gate. DI_ERR_INVALID (nc < 1, D < 1), DI_ERR_CUDA.
di_status di_cuda_engram_gate(di_cuda *cu, const float *kv, const float *qk, int32_t nc, int64_t D,
                              int32_t n_tok, float eps, float *x);

// backend.h index_cand (mode DI_BACKEND_CAND_BUILD / _MASK / _DROP) on device arrays. BUILD: the
// block scores into work (row t at t * (score_stride / bs + 1); the newest block +inf), then
// di_cuda_topk's radix select of the min(ntb, n_blocks) best (ties to the lower block,
// ascending). DI_ERR_INVALID (bs, ntb or k < 1, an unknown mode, BUILD without work),
// DI_ERR_CUDA.
di_status di_cuda_index_cand(di_cuda *cu, int32_t mode, float *scores, int64_t score_stride,
                             const int32_t *n_vis, int32_t n_tok, int32_t bs, int32_t ntb,
                             int32_t *cand, int32_t *n_cand, int32_t *sel, int32_t k, float *work);

#ifdef __cplusplus
}
#endif
