#include "backend/cpu/vec.h"

#include "backend/cpu/gemm.h"
#include "backend/cpu/ref_ops.h"

void di_cpu_dots(int isa, const float *q, const float *const *rows, int64_t n_rows, int64_t n,
                 float scale, float *out) {
    if (isa >= DI_CPU_ISA_AVX2) {
        di_vec_avx2_dots(q, rows, n_rows, n, scale, out);
        return;
    }
    for (int64_t j = 0; j < n_rows; j++) out[j] = di_ref_dot(q, rows[j], n) * scale;
}

void di_cpu_weighted_sum(int isa, const float *p, const float *const *rows, int64_t n_rows,
                         int64_t n, float *o) {
    if (isa >= DI_CPU_ISA_AVX2) {
        di_vec_avx2_weighted_sum(p, rows, n_rows, n, o);
        return;
    }
    for (int64_t j = 0; j < n_rows; j++)
        for (int64_t i = 0; i < n; i++) o[i] += p[j] * rows[j][i];
}

void di_cpu_index_scores(int isa, const float *q, const float *w, int32_t n_head,
                         const float *const *keys, int64_t n_keys, int64_t n, float *out) {
    if (isa >= DI_CPU_ISA_AVX2) {
        di_vec_avx2_index_scores(q, w, n_head, keys, n_keys, n, out);
        return;
    }
    for (int64_t j = 0; j < n_keys; j++) {
        float acc = 0;
        for (int32_t h = 0; h < n_head; h++) {
            float dot = di_ref_dot(q + h * n, keys[j], n);
            acc += w[h] * (dot > 0 ? dot : 0); // ReLU per head, then the head weight
        }
        out[j] = acc;
    }
}
