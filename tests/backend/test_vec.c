// The attention-side CPU kernels (backend/cpu/vec.h) on every instruction-set level this machine
// can run, against sums computed in double:
//   - di_cpu_dots (attention scores), di_cpu_weighted_sum (attention output) and
//     di_cpu_index_scores (the lightning indexer) on edge shapes: 1 value, lengths around the
//     8-lane vector and the 64-column block, V4 widths (128, 512), 1 row, row counts around the
//     8-row group, head counts around the 8-head group and V4's 64;
//   - every output written (outputs are poisoned with NaN first) and o accumulated onto, not
//     overwritten;
//   - the scalar level bit-identical to the reference arithmetic (di_ref_dot, plain loops).
#include "harness.h"

#include <float.h>
#include <stdint.h>
#include <stdlib.h>

#include "backend/cpu/gemm.h"
#include "backend/cpu/ref_ops.h"
#include "backend/cpu/vec.h"

// Tolerance: each float sum is within gamma(k) * sum|terms| of the exact value, gamma(k) ~ k u
// with u = 2^-24 and k the sequential roundings of one lane (n/8 accumulations + the product + 3
// reduction levels + the tail). Both levels are held to 2 gamma(k) against the double sum; a wrong
// or missing term is off by about one |term| (~0.25 here), far above that bound.
static double gamma_k(double k) {
    double u = FLT_EPSILON / 2;
    return k * u / (1 - k * u);
}

static uint64_t g_rng = 0x51ed2701ull;
static float rndf(void) { // uniform in [-1, 1)
    uint64_t z = (g_rng += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    z ^= z >> 31;
    return (float)((double)(z >> 11) / 4503599627370496.0 - 1.0);
}

static float *rnd_vec(int64_t n) {
    float *v = malloc(sizeof(float) * (size_t)(n > 0 ? n : 1));
    for (int64_t i = 0; i < n; i++) v[i] = rndf();
    return v;
}

static const int64_t k_lens[] = {1, 7, 8, 9, 63, 64, 65, 128, 200, 512};
static const int64_t k_rows[] = {1, 3, 4, 5, 8, 9, 17, 64};
#define N_LENS (int)(sizeof k_lens / sizeof k_lens[0])
#define N_ROWS (int)(sizeof k_rows / sizeof k_rows[0])

static void check_dots(int isa, int64_t n, int64_t n_rows) {
    float *q = rnd_vec(n), *data = rnd_vec(n * n_rows), *out = malloc(sizeof(float) * n_rows);
    const float **rows = malloc(sizeof(float *) * (size_t)n_rows);
    for (int64_t j = 0; j < n_rows; j++) rows[j] = data + ((j * 5) % n_rows) * n; // shuffled
    const float scale = 0.125f;
    for (int64_t j = 0; j < n_rows; j++) out[j] = NAN;
    di_cpu_dots(isa, q, rows, n_rows, n, scale, out);
    for (int64_t j = 0; j < n_rows; j++) {
        double exact = 0, mag = 0;
        for (int64_t i = 0; i < n; i++) {
            exact += (double)q[i] * rows[j][i];
            mag += fabs((double)q[i] * rows[j][i]);
        }
        double tol = 2 * gamma_k((double)n / 8 + 6) * mag * scale + 1e-30;
        CHECK(fabs(out[j] - exact * scale) <= tol);
        if (isa == DI_CPU_ISA_SCALAR) CHECK(out[j] == di_ref_dot(q, rows[j], n) * scale);
    }
    free(q), free(data), free(out), free(rows);
}

static void check_weighted_sum(int isa, int64_t n, int64_t n_rows) {
    float *p = rnd_vec(n_rows), *data = rnd_vec(n * n_rows), *o = rnd_vec(n);
    float *o0 = malloc(sizeof(float) * (size_t)n), *want = malloc(sizeof(float) * (size_t)n);
    const float **rows = malloc(sizeof(float *) * (size_t)n_rows);
    for (int64_t j = 0; j < n_rows; j++) rows[j] = data + ((j * 3) % n_rows) * n;
    for (int64_t i = 0; i < n; i++) o0[i] = want[i] = o[i];
    di_cpu_weighted_sum(isa, p, rows, n_rows, n, o);
    for (int64_t j = 0; j < n_rows; j++) // the reference arithmetic, for the scalar level
        for (int64_t i = 0; i < n; i++) want[i] += p[j] * rows[j][i];
    for (int64_t i = 0; i < n; i++) {
        double exact = o0[i], mag = fabs((double)o0[i]);
        for (int64_t j = 0; j < n_rows; j++) {
            exact += (double)p[j] * rows[j][i];
            mag += fabs((double)p[j] * rows[j][i]);
        }
        CHECK(fabs(o[i] - exact) <= 2 * gamma_k((double)n_rows + 2) * mag);
        if (isa == DI_CPU_ISA_SCALAR) CHECK(o[i] == want[i]);
    }
    free(p), free(data), free(o), free(o0), free(want), free(rows);
}

static void check_index_scores(int isa, int64_t n, int32_t n_head, int64_t n_keys) {
    float *q = rnd_vec(n * n_head), *w = rnd_vec(n_head), *data = rnd_vec(n * n_keys);
    float *out = malloc(sizeof(float) * (size_t)n_keys);
    const float **keys = malloc(sizeof(float *) * (size_t)n_keys);
    for (int64_t j = 0; j < n_keys; j++) keys[j] = data + ((j * 7) % n_keys) * n;
    for (int64_t j = 0; j < n_keys; j++) out[j] = NAN;
    di_cpu_index_scores(isa, q, w, n_head, keys, n_keys, n, out);
    for (int64_t j = 0; j < n_keys; j++) {
        double exact = 0, mag = 0;
        float ref = 0;
        for (int32_t h = 0; h < n_head; h++) {
            double d = 0, dm = 0;
            for (int64_t i = 0; i < n; i++) {
                d += (double)q[h * n + i] * keys[j][i];
                dm += fabs((double)q[h * n + i] * keys[j][i]);
            }
            exact += w[h] * (d > 0 ? d : 0);
            // A dot near 0 may land on either side of the ReLU: its error enters through dm.
            mag += fabs(w[h]) * ((d > 0 ? d : 0) + dm);
            float rd = di_ref_dot(q + h * n, keys[j], n);
            ref += w[h] * (rd > 0 ? rd : 0);
        }
        CHECK(fabs(out[j] - exact) <= 2 * gamma_k((double)n / 8 + n_head + 8) * mag);
        if (isa == DI_CPU_ISA_SCALAR) CHECK(out[j] == ref);
    }
    free(q), free(w), free(data), free(out), free(keys);
}

static void test_levels(void) {
    for (int isa = 0; isa <= (int)di_cpu_isa_supported(); isa++) {
        for (int a = 0; a < N_LENS; a++)
            for (int b = 0; b < N_ROWS; b++) {
                check_dots(isa, k_lens[a], k_rows[b]);
                check_weighted_sum(isa, k_lens[a], k_rows[b]);
            }
        static const int32_t heads[] = {1, 7, 8, 9, 64};
        for (int a = 0; a < N_LENS; a++)
            for (int h = 0; h < 5; h++) check_index_scores(isa, k_lens[a], heads[h], 9);
        check_index_scores(isa, 128, 64, 130); // V4: 64 index heads x 128
        fprintf(stderr, "  level %s checked\n", di_cpu_isa_name((di_cpu_isa)isa));
    }
}

// Zero rows and a long row count: o unchanged by zero weights, sums over many rows stay in bound.
static void test_zero_and_long(void) {
    for (int isa = 0; isa <= (int)di_cpu_isa_supported(); isa++) {
        float z[512] = {0}, o[512];
        const float *rows[3] = {z, z, z};
        float p[3] = {1, 2, 3};
        for (int i = 0; i < 512; i++) o[i] = (float)i;
        di_cpu_weighted_sum(isa, p, rows, 3, 512, o);
        for (int i = 0; i < 512; i++) CHECK(o[i] == (float)i);
        check_weighted_sum(isa, 512, 2048);
        check_dots(isa, 512, 640);
    }
}

int main(void) {
    RUN(test_levels);
    RUN(test_zero_and_long);
    return test_finish();
}
