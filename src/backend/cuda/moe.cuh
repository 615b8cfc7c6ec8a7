/*
 * moe — the mixture of experts on the GPU (spec §2.8, model/dsv4_moe.c): the router
 * (sqrt(softplus) scores, top-K of score + bias with ties to the lower id, or the hash table),
 * the grouping of (token, slot) pairs by expert (deterministic: ascending token, then slot, inside
 * each expert), SwiGLU with the clamps, the weighted combine in ascending expert order, and
 * di_cuda_moe which runs a whole layer: router, grouped w1/w3 (one launch each for all experts),
 * SwiGLU, grouped w2, the shared expert, combine. Both precision recipes: FP32 (routing weight
 * applied to the expert output, as R-HF) and the official one (di_cuda_moe_w.official: A8 before
 * FP8/FP4 expert linears, BF16 linear outputs, the weight applied to h before w2, BF16 h and
 * output; model/dsv4_moe.c's order). In the official recipe's prefill the routed linears run on
 * BF16 tensor cores (moe_tc.cuh di_cuda_moe_grouped_a8: the same products, FP32 sums in another
 * order; checked against the SIMT kernel on a context's first such call).
 *
 * Owns: nothing; di_cuda_moe takes its scratch from the pool for the call. Thread-safety: engine
 * thread only.
 */
#pragma once

#include "backend/cuda/cuda_backend.h"

#ifdef __cplusplus
extern "C" {
#endif

// Router on device logits [T, E] (gate . f, FP32). Score-routed (tid2eid NULL): s = sqrt(softplus
// (logit)); sel = the K best of s + bias (bias may be NULL), ties to the lower id. Hash-routed:
// sel = tid2eid[ids[t]] ([V, K] device table). wgt[t, k] = s[sel] / (sum_k s[sel] (+ 1e-20 when
// hf_eps)) * route_scale, the sum in slot order. E <= 4096. DI_ERR_CUDA, DI_ERR_INVALID.
di_status di_cuda_router(di_cuda *cu, const float *logits, const float *bias,
                         const int32_t *tid2eid, const int32_t *ids, int32_t n_tok, int32_t E,
                         int32_t K, float route_scale, bool hf_eps, int32_t *sel, float *wgt);

// Groups the n_pairs = T*K pairs of sel by expert: offsets [E+1] (prefix sums), rows [n_pairs]
// (token of each grouped row), row_of_pair [n_pairs] (grouped row of pair t*K+k). Within an
// expert, pairs keep ascending pair order. E <= 4096. DI_ERR_CUDA.
di_status di_cuda_moe_group(di_cuda *cu, const int32_t *sel, int32_t n_pairs, int32_t K, int32_t E,
                            int32_t *offsets, int32_t *rows, int32_t *row_of_pair);

// g = silu(min(g, L)) * clamp(u, -L, L) in place over n_rows rows of F (L <= 0: no clamp).
di_status di_cuda_swiglu(di_cuda *cu, float *g, const float *u, int64_t n_rows, int64_t F,
                         float limit);

// out[t] = sum over t's pairs in ascending (expert, slot) order of y[row_of_pair] * wgt (wgt NULL:
// y alone, the official recipe having weighted h already), then + shared[t] (shared may be NULL).
// y: grouped [T*K, D]. DI_ERR_CUDA.
di_status di_cuda_moe_combine(di_cuda *cu, const float *y, const int32_t *row_of_pair,
                              const int32_t *sel, const float *wgt, const float *shared,
                              int32_t n_tok, int32_t K, int64_t D, float *out);

// A layer's MoE weights on the device.
typedef struct di_cuda_moe_w {
    di_tensor gate;                // device [E, D] (F32/BF16)
    const float *gate_bias;        // device [E]; NULL for hash-routed layers
    const int32_t *tid2eid;        // device [V, K]; NULL for score-routed layers
    const di_tensor *w1, *w2, *w3; // device arrays [E] of device tensors: [F, D], [D, F], [F, D]
    di_tensor sh_w1, sh_w2, sh_w3; // device tensors
    int32_t n_expert, n_used;
    int64_t D, F;
    float route_scale, swiglu_limit;
    bool shared_clamp; // shared expert clamped too
    bool hf_eps;       // the routing-weight denominator gets + 1e-20 (di_cuda_router's hf_eps)
    bool official;     // the official precision recipe (backend.h di_backend_moe_w.official)
    float gate_temp;   // V4.1: the router logits are divided by it first; 0: not divided (V4)
    int32_t a8_block;  // the official recipe's A8 block: 32 (V4.1); 0: 128 (V4)
    di_tensor_kind routed_kind; // the routed experts' weight kind (w1/w2/w3 live on the device)
} di_cuda_moe_w;

// out [T, D] = MoE(f [T, D]) with token ids (hash routing); all device pointers. The routing
// (sel [T,K], wgt [T,K]) is written to sel_out / wgt_out when not NULL (tests). DI_ERR_CUDA.
di_status di_cuda_moe(di_cuda *cu, const di_cuda_moe_w *w, const float *f, const int32_t *ids,
                      int32_t n_tok, float *out, int32_t *sel_out, float *wgt_out);

#ifdef __cplusplus
}
#endif
