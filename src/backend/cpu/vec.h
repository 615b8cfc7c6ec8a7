/*
 * vec — the CPU kernels of the attention side of the forward pass: one query against many key
 * rows (attention scores), a probability-weighted sum of key rows (attention output), and the
 * lightning indexer's score of keys (spec §2.6). Levels as gemm.h (di_cpu.isa): the scalar
 * level is the reference arithmetic itself (di_ref_dot and plain loops); the AVX2 level computes
 * the same sums in the same order with FMA, so the two differ only by FMA's single rounding per
 * product (tests/backend/test_vec.c bounds it). Every output depends only on its own inputs, so
 * results do not depend on batching or threads.
 *
 * Owns: nothing. Thread-safety: pure functions.
 */
#pragma once

#include <stdint.h>

// out[j] = dot(q, rows[j]) * scale for j < n_rows; each dot over n values in di_ref_dot's order.
void di_cpu_dots(int isa, const float *q, const float *const *rows, int64_t n_rows, int64_t n,
                 float scale, float *out);

// o[i] += sum_j p[j] * rows[j][i] for i < n, the terms added to o[i] in order of j.
void di_cpu_weighted_sum(int isa, const float *p, const float *const *rows, int64_t n_rows,
                         int64_t n, float *o);

// out[j] = sum over heads h < n_head, in order, of w[h] * max(0, dot(q + h * n, keys[j])): the
// lightning indexer's score of key j for one query (q [n_head, n], head weights w [n_head]).
void di_cpu_index_scores(int isa, const float *q, const float *w, int32_t n_head,
                         const float *const *keys, int64_t n_keys, int64_t n, float *out);

// ---- internal: the AVX2 level (vec_avx2.c, compiled with -mavx2 -mfma) ----
void di_vec_avx2_dots(const float *q, const float *const *rows, int64_t n_rows, int64_t n,
                      float scale, float *out);
void di_vec_avx2_weighted_sum(const float *p, const float *const *rows, int64_t n_rows, int64_t n,
                              float *o);
void di_vec_avx2_index_scores(const float *q, const float *w, int32_t n_head,
                              const float *const *keys, int64_t n_keys, int64_t n, float *out);
