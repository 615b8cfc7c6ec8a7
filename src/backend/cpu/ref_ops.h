/*
 * ref_ops — the scalar reference of every op of the V4 forward pass on the CPU: plain loops,
 * FP32 accumulation, no tricks. It is the oracle every optimised kernel (CPU SIMD or CUDA) is
 * tested against, and the engine's CPU path until those exist.
 *
 * Parallel ops run on the persistent thread pool with static partitioning (di_split_range), so a
 * result never depends on the number of threads: each output element is computed by exactly one
 * thread in a fixed order.
 *
 * Owns: di_cpu owns per-thread row scratch; the pool is borrowed.
 * Thread-safety: a di_cpu is used by one submitting thread (the engine thread).
 */
#pragma once

#include <stdbool.h>
#include <stdint.h>

#include "base/thread.h"   // di_pool
#include "deepinfer.h"     // di_status
#include "tensor/tensor.h" // di_tensor

#include <math.h>

typedef struct di_cpu {
    di_pool *pool; // borrowed
    int n_threads;
    float *row_scratch; // owned; n_threads * row_cap floats (one dequantised weight row each)
    int64_t row_cap;
    // gemm.c (the optimised matmul): its level and per-thread scratch of decoded rows.
    int isa;             // di_cpu_isa; di_cpu_isa_detect() at init, di_cpu_set_isa() in tests
    float *gemm_scratch; // owned; n_threads * gemm_rows * gemm_ld floats, 64-byte aligned
    int64_t gemm_ld;     // floats between decoded rows: row_cap rounded up to 16
    int gemm_rows;       // rows per thread (di_gemm_scratch_rows: 4..32)
    // Bytes of weights (data + scales) di_cpu_matmul has read since init: the numerator of the
    // decode roofline ratio (bench/cpu). Engine thread only.
    uint64_t n_weight_bytes;
    // Multiply-adds di_cpu_matmul has done since init (n_in x n_out x tokens per call).
    uint64_t n_weight_macs;
    // gemm.c: the 8-bit activations of up to DI_CPU_ACT_TOKENS tokens (di_quant_act_q8), token t
    // at act_q + t * act_ld and act_d + t * (act_ld / 32).
    int8_t *act_q;  // owned; DI_CPU_ACT_TOKENS * act_ld bytes, 64-byte aligned
    float *act_d;   // owned; DI_CPU_ACT_TOKENS * act_ld / 32 floats
    int64_t act_ld; // row_cap rounded up to 64
    int16_t *act_s; // owned; DI_CPU_ACT_TOKENS * act_ld / 16 (Q4_K's per-16 sums, act_ld / 16 each)
} di_cpu;

// Tokens whose 8-bit activations gemm.c holds at once: longer calls run in chunks of this many
// tokens (each chunk reads the weights once more; at 64 tokens a Q8_0 weight byte already feeds
// 64 multiply-adds, so the extra reads cost little).
enum { DI_CPU_ACT_TOKENS = 64 };

// max_row: the widest weight row (n_in) any matmul will see. Returns DI_ERR_NOMEM.
di_status di_cpu_init(di_cpu *cpu, di_pool *pool, int64_t max_row);
void di_cpu_deinit(di_cpu *cpu);

// y[t*y_stride + o] = sum_i W[o, i] * x[t*x_stride + i] for t < n_tok, o < W.ne[1].
// FP32 accumulation; W dequantised row by row (exact). Q8_0 and MXFP4 weights follow the 8-bit
// contract instead (di_ref_matmul_act): each token row quantised by di_quant_act_q8, then
// di_ref_dot_q8 against the weight row's codes; Q4_K likewise with di_quant_act_q8_k and
// di_ref_dot_q4_k.
void di_ref_matmul(di_cpu *cpu, const di_tensor *w, const float *x, int64_t n_tok, int64_t x_stride,
                   float *y, int64_t y_stride);

// In place over n_rows rows of n values (stride apart): x = x * rsqrt(mean(x^2) + eps) [* w].
// w may be NULL (unweighted, as the per-head q normalisation).
void di_ref_rmsnorm(float *x, int64_t n_rows, int64_t n, int64_t stride, const float *w, float eps);

// Interleaved partial RoPE on the trailing n_rot entries of v[n]: pairs (n-n_rot+2i, +1) rotate
// by pos*omega[i]; inverse rotates by the negative angle. cos and sin are multiplied by scale.
void di_ref_rope(float *v, int64_t n, int32_t n_rot, const float *omega, int64_t pos, float scale,
                 bool inverse);

// Dot product with FP32 accumulation in a fixed order (the same as di_ref_matmul's).
float di_ref_dot(const float *a, const float *b, int64_t n);

// How di_ref_matmul multiplies a weight kind (gemm.h's contracts): f32 activations, 8-bit
// activations in blocks of 32 (Q8_0, MXFP4: di_quant_act_q8 and di_ref_dot_q8) or in blocks of
// 256 (Q4_K: di_quant_act_q8_k and di_ref_dot_q4_k).
typedef enum di_ref_act {
    DI_REF_ACT_F32 = 0,
    DI_REF_ACT_Q8_0,
    DI_REF_ACT_Q8_K,
} di_ref_act;
di_ref_act di_ref_matmul_act(const di_tensor *w);

// The integer codes and per-32 scales of row r of an int8-contract weight (di_codes_row_*): q gets
// ne[0] values, d ne[0] / 32.
void di_ref_row_codes(const di_tensor *w, int64_t r, int8_t *q, float *d);

// The 8-bit dot product of gemm.h: eight f32 lanes, lane l of block b adding
// fma(dw[b] * dx[b], s, acc[l]) with s = sum over k < 4 of qw[32b+4l+k] * qx[32b+4l+k] (exact
// int32), blocks in order, then di_ref_dot's lane reduction. n a multiple of 32.
float di_ref_dot_q8(const int8_t *qw, const float *dw, const int8_t *qx, const float *dx,
                    int64_t n);

// A Q4_K row (n / 256 blocks of 144 bytes) against 8-bit activations of blocks of 256 (codes qx,
// scales dx, sums of 16 bsums; di_quant_act_q8_k). Per block b, with the 6-bit sub-block scales
// sc_j and mins m_j (j < 8, sub-block j = columns 32j..32j+31) and the codes q4:
//   S_l = sum over j of sc_j * (sum over k < 4 of q4[32j+4l+k] * qx[32j+4l+k])   (l < 8, exact)
//   M_l = m_l * (bsums[2l] + bsums[2l+1])                                           (exact)
//   lane l: acc_l = fma(dx[b] * f16(d), S_l, acc_l), then acc_l = fma(-(dx[b] * f16(dmin)), M_l,
//   acc_l), over the blocks in order; y = di_ref_dot's reduction of the lanes.
float di_ref_dot_q4_k(const uint8_t *row, const int8_t *qx, const float *dx, const int16_t *bsums,
                      int64_t n);

// One token's mHC coefficients from its RMS-scaled mix row (spec §2.3): pre[s] = sigmoid gate +
// eps; unless post is NULL (a head site), post[s] = 2 sigmoid and comb [nc, nc] = Sinkhorn of the
// residual mix (row softmax + eps, then iters rounds of column / row normalisation). The one copy
// of this arithmetic: model/dsv4.c (di_dsv4_hc_coeffs) and the CPU backend's mhc_pre call it.
void di_ref_hc_coeffs(const float *mix, const float *base, const float *scale, int nc, int iters,
                      float eps, float *pre, float *post, float *comb);

// The k best of sc[0 .. n) (k <= n; score descending, ties to the lower index) into sel[k], in
// ascending index order: a min-heap, O(n log k). The one copy: model/dsv4_attn.c (di_dsv4_topk)
// and the CPU backend's topk call it.
void di_ref_topk(const float *sc, int64_t n, int32_t k, int32_t *sel);

// The first index of the largest of v[0..n), n >= 1: the scan `v[i] > v[best]` from best = 0, so
// NaNs never win (a NaN at 0 keeps 0) and equal values keep the lower index: sample/sampler.h
// di_argmax's answer (the CPU backend's argmax_rows runs it per row).
int32_t di_ref_argmax(const float *v, int64_t n);

// mHC post (spec §2.3) in place over n_tok tokens: x[t, k] = post[t, k] o[t] + sum_j comb[t, j, k]
// x[t, j], per element in that order (x: [T, nc, D], o: [T, D], post: [T, nc], comb: [T, nc, nc];
// nc <= 16). The one copy: model/dsv4.c (di_dsv4_hc_post) and the CPU backend's mhc_post.
void di_ref_hc_post(const float *o, float *x, const float *post, const float *comb, int nc,
                    int64_t D, int32_t n_tok);

// ---- DeepSeek V4.1 (deepseek-v41.md): the one copy of each, called by model/dsv41*.c and by the
// CPU backend's ops (backend.h mhc_pre_carried, engram_gate, index_cand) ----

// a[t] = sum_s pre[t, s] x[t, s] over n_tok tokens (x [T, nc, D], pre [T, nc], a [T, D]): FP32,
// the sum in stream order from 0 (§2.2's collapse with a carried pre).
void di_ref_hc_collapse(const float *x, const float *pre, int nc, int64_t D, int32_t n_tok,
                        float *a);
// The Engram gate (§2.3.2) over n_tok rows: for stream s of row t, with h = x[t, s], key =
// kv[t, s] and value = kv[t, nc] (kv [T, (nc + 1) D]), dot = sum h qk[s] key (FP32 in dim order,
// with the sums of squares of h and key) * rsqrt(mean h^2 + eps) * rsqrt(mean key^2 + eps) / sqrt
// D; g = sigmoid(sign(dot) sqrt(max(|dot|, 1e-6))); x[t, s] = h + g value.
void di_ref_engram_gate(const float *kv, const float *qk, int nc, int64_t D, int32_t n_tok,
                        float eps, float *x);
// Level 1 of the indexer (§2.5.3) on one row's scores sc[0 .. vis): blocks of bs entries scored by
// their best entry, the newest visible entry's block +inf, the min(ntb, n_blocks) best into cand
// (ascending: di_ref_topk); blk: scratch of ceil(vis / bs) floats. Returns how many.
int32_t di_ref_cand_build(const float *sc, int64_t vis, int32_t bs, int32_t ntb, float *blk,
                          int32_t *cand);
// Level 2: sc[w] = -inf for every w < vis whose block w / bs is not among cand[0 .. n_cand).
void di_ref_cand_mask(float *sc, int64_t vis, int32_t bs, const int32_t *cand, int32_t n_cand);
// A row's top-k picks (sel [k], -1 padded) with the picks scored -inf dropped, the others moved
// up in order, -1 after them. Returns the picks kept.
int32_t di_ref_cand_drop(const float *sc, int32_t *sel, int32_t k);

// A score-routed token's experts (spec §2.8): the K best of s[e] + bias[e] over E experts, ties to
// the lower id, in selection order, into sel[K]; then wgt[k] = s[sel[k]] / (sum_k s[sel[k]] + eps)
// * route_scale (the sum in slot order). Hash routing passes its table row as sel and bias NULL
// (only the weights are computed). The one copy: model/dsv4_moe.c and the CPU backend's moe.
void di_ref_route(const float *s, int32_t E, int32_t K, const float *bias, float eps,
                  float route_scale, int32_t *sel, float *wgt);

// Expert e's rows of a routed batch: every (token t, slot k) with sel[t*K + k] == e, in ascending
// (t, k): f's row t copied to xin [n, D], rows[n] = t, rw[n] = wgt[t*K + k]. Returns n (a
// duplicate in a hash row counts twice).
int32_t di_ref_moe_gather(const int32_t *sel, const float *wgt, int32_t n_tok, int32_t K, int32_t e,
                          const float *f, int64_t D, float *xin, int32_t *rows, float *rw);
// SwiGLU with V4's clamps, in place into g: g = silu(min(g, L)) * clamp(u, -L, L) over n values;
// L <= 0: no clamp. The one copy: model/dsv4_moe.c and the CPU backend's moe.
void di_ref_swiglu(float *g, const float *u, int64_t n, float limit);
// out[rows[r]] += y[r] (D floats) for r < n, in order.
void di_ref_moe_add_rows(const float *y, const int32_t *rows, int32_t n, int64_t D, float *out);

static inline float di_sigmoid(float x) {
    return 1.0f / (1.0f + expf(-x));
}
static inline float di_silu(float x) {
    return x / (1.0f + expf(-x));
}
// PyTorch softplus with threshold 20 (x > 20 returns x).
static inline float di_softplus(float x) {
    return x > 20.0f ? x : log1pf(expf(x));
}
