/*
 * indexer — the lightning indexer of CSA layers on the GPU (spec §2.6, model/dsv4_attn.c
 * indexer_task): scores score[t, w] = sum_h wI[t,h] * ReLU(qI[t,h] . K[w]) over the visible
 * entries, and an exact top-k with the CPU's order (score descending, ties to the lower index),
 * the selection written in ascending entry order and padded with -1.
 *
 * The top-k is a radix select: 4 histogram passes over the row (8 bits each, from the top) find
 * the k-th largest score's bit pattern exactly, and the count of the scores above it; one ordered
 * compaction pass then keeps every score above it and the lowest-index ties. No sort, no heap,
 * any number of entries (one block per query row).
 * NaN scores are not ordered as the CPU's heap orders them (not produced by finite inputs).
 * Thread-safety: engine thread only.
 */
#pragma once

#include "backend/cuda/cuda_backend.h"

#ifdef __cplusplus
extern "C" {
#endif

// scores[t * score_stride + w] for w < n_vis[t] (entries beyond are not written). qi: [T, HI, DI];
// wi: [T, HI] (already scaled by DI^-1/2 HI^-1/2); keys: [n_entries, DI] FP32: entry w of query
// t's sequence at keys + row * DI, row = (key_base ? key_base[t] : 0) + (pages NULL: w; else
// pages[page_off[t] + w / per_page] * per_page + w % per_page, a negative page scoring -inf)
// (backend.h index_scores). max_vis bounds n_vis (launch shape). round_bf16: round each score to
// BF16 (official precision). DI_ERR_CUDA, DI_ERR_INVALID (shared memory; per_page < 1 with pages).
di_status di_cuda_indexer_scores(di_cuda *cu, const float *qi, const float *wi, const float *keys,
                                 const int64_t *key_base, const int32_t *pages,
                                 const int32_t *page_off, int32_t per_page, const int32_t *n_vis,
                                 int32_t max_vis, int32_t n_tok, int32_t HI, int32_t DI,
                                 bool round_bf16, float *scores, int64_t score_stride);

// The same scores over V4.1's Q4 index keys (backend.h index_scores_q4): the key of entry row r
// is the packed row keys + r * (DI / 2 + DI / 32) (e2m1 pairs, a UE8M0 scale per 32 dims),
// decoded exactly in registers by the thread scoring it (lane per entry, any HI). DI a multiple
// of 32. DI_ERR_CUDA, DI_ERR_INVALID (shape, shared memory).
di_status di_cuda_indexer_scores_q4(di_cuda *cu, const float *qi, const float *wi,
                                    const uint8_t *keys, const int64_t *key_base,
                                    const int32_t *pages, const int32_t *page_off, int32_t per_page,
                                    const int32_t *n_vis, int32_t max_vis, int32_t n_tok,
                                    int32_t HI, int32_t DI, bool round_bf16, float *scores,
                                    int64_t score_stride);

// sel[t * topk + i]: the k = min(topk, n_vis[t]) best entries of scores row t (ascending index),
// then -1 up to topk. When k == n_vis[t] the scores are not read (every entry is selected); a
// negative n_vis[t] selects nothing (the row all -1, as the CPU backend). DI_ERR_CUDA.
di_status di_cuda_topk(di_cuda *cu, const float *scores, int64_t score_stride, const int32_t *n_vis,
                       int32_t n_tok, int32_t topk, int32_t *sel);

#ifdef __cplusplus
}
#endif
