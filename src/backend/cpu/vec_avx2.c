// vec_avx2 — the AVX2 + FMA level of vec.h. Compiled with -mavx2 -mfma on x86-64
// (CMakeLists.txt); vec.c calls it only at DI_CPU_ISA_AVX2, which di_cpu_isa_supported() grants
// only when gemm_avx2.c's kernels were built and the CPU has the features. Elsewhere the
// functions are never called and build to traps.
#include "backend/cpu/vec.h"

#include <stdlib.h>

#if defined(__x86_64__) && defined(__AVX2__) && defined(__FMA__)

#include <immintrin.h>

#include "backend/cpu/simd.h"

// di_ref_dot's reduction: ((a0+a4)+(a1+a5)) + ((a2+a6)+(a3+a7)).
static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    __m128 h = _mm_hadd_ps(s, s);
    return _mm_cvtss_f32(_mm_add_ss(h, _mm_movehdup_ps(h)));
}

// dot(x, r[i]) for NR rows at once (NR independent FMA chains hide the FMA latency): 8-lane
// accumulators over the 8-multiples, the tail summed apart and added last, as di_ref_dot.
static inline __attribute__((always_inline)) void dots_nr(const float *x, const float *const *r,
                                                          int NR, int64_t n, float *out) {
    __m256 a[8];
    DI_UNROLL
    for (int i = 0; i < NR; i++) a[i] = _mm256_setzero_ps();
    int64_t k = 0;
    for (; k + 8 <= n; k += 8) {
        __m256 xv = _mm256_loadu_ps(x + k);
        DI_UNROLL
        for (int i = 0; i < NR; i++) a[i] = _mm256_fmadd_ps(_mm256_loadu_ps(r[i] + k), xv, a[i]);
    }
    DI_UNROLL
    for (int i = 0; i < NR; i++) {
        float tail = 0;
        for (int64_t t = k; t < n; t++) tail += x[t] * r[i][t];
        out[i] = hsum8(a[i]) + tail;
    }
}

static void dots(const float *x, const float *const *r, int64_t n_rows, int64_t n, float *out) {
    int64_t j = 0;
    for (; j + 8 <= n_rows; j += 8) dots_nr(x, r + j, 8, n, out + j);
    for (; j + 4 <= n_rows; j += 4) dots_nr(x, r + j, 4, n, out + j);
    for (; j < n_rows; j++) dots_nr(x, r + j, 1, n, out + j);
}

void di_vec_avx2_dots(const float *q, const float *const *rows, int64_t n_rows, int64_t n,
                      float scale, float *out) {
    dots(q, rows, n_rows, n, out);
    for (int64_t j = 0; j < n_rows; j++) out[j] *= scale;
}

void di_vec_avx2_weighted_sum(const float *p, const float *const *rows, int64_t n_rows, int64_t n,
                              float *o) {
    int64_t c = 0;
    for (; c + 64 <= n; c += 64) { // 64 columns in eight registers across all rows
        __m256 a[8];
        DI_UNROLL
        for (int k = 0; k < 8; k++) a[k] = _mm256_loadu_ps(o + c + 8 * k);
        for (int64_t j = 0; j < n_rows; j++) {
            __m256 pv = _mm256_broadcast_ss(p + j);
            const float *r = rows[j] + c;
            DI_UNROLL
            for (int k = 0; k < 8; k++)
                a[k] = _mm256_fmadd_ps(pv, _mm256_loadu_ps(r + 8 * k), a[k]);
        }
        DI_UNROLL
        for (int k = 0; k < 8; k++) _mm256_storeu_ps(o + c + 8 * k, a[k]);
    }
    for (; c + 8 <= n; c += 8) {
        __m256 a = _mm256_loadu_ps(o + c);
        for (int64_t j = 0; j < n_rows; j++)
            a = _mm256_fmadd_ps(_mm256_broadcast_ss(p + j), _mm256_loadu_ps(rows[j] + c), a);
        _mm256_storeu_ps(o + c, a);
    }
    for (; c < n; c++)
        for (int64_t j = 0; j < n_rows; j++) o[c] += p[j] * rows[j][c];
}

void di_vec_avx2_index_scores(const float *q, const float *w, int32_t n_head,
                              const float *const *keys, int64_t n_keys, int64_t n, float *out) {
    // Per key: the heads' dots eight at a time (the key row is the shared operand), then the
    // ReLU-weighted sum over heads in order.
    enum { HEADS = 8 };
    for (int64_t j = 0; j < n_keys; j++) {
        float acc = 0;
        for (int32_t h0 = 0; h0 < n_head; h0 += HEADS) {
            const float *qh[HEADS];
            float d[HEADS];
            int nh = n_head - h0 < HEADS ? n_head - h0 : HEADS;
            for (int i = 0; i < nh; i++) qh[i] = q + (int64_t)(h0 + i) * n;
            if (nh == HEADS)
                dots_nr(keys[j], qh, HEADS, n, d);
            else
                dots(keys[j], qh, nh, n, d);
            for (int i = 0; i < nh; i++) acc += w[h0 + i] * (d[i] > 0 ? d[i] : 0);
        }
        out[j] = acc;
    }
}

#else

void di_vec_avx2_dots(const float *q, const float *const *rows, int64_t n_rows, int64_t n,
                      float scale, float *out) {
    (void)q, (void)rows, (void)n_rows, (void)n, (void)scale, (void)out;
    abort();
}
void di_vec_avx2_weighted_sum(const float *p, const float *const *rows, int64_t n_rows, int64_t n,
                              float *o) {
    (void)p, (void)rows, (void)n_rows, (void)n, (void)o;
    abort();
}
void di_vec_avx2_index_scores(const float *q, const float *w, int32_t n_head,
                              const float *const *keys, int64_t n_keys, int64_t n, float *out) {
    (void)q, (void)w, (void)n_head, (void)keys, (void)n_keys, (void)n, (void)out;
    abort();
}

#endif
