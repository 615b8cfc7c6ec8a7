/*
 * cuda_test — shared helpers of the CUDA op tests (tests/backend/cuda/test_cuda_*.c): one device
 * context per test program (exit 77 when there is no GPU), device buffers filled from host arrays,
 * outputs poisoned with NaN before every launch (an unwritten element then fails the
 * comparison), every di_status checked, and the comparison metrics:
 *   - rel_l2:  ||out - ref|| / ||ref||  (the METHOD.md metric; NaN anywhere fails);
 *   - per-element bounds for sums, from the reference's sum of |terms| (FP32 rounding of a
 *     k-term sum in any order is within gamma(k) * sum|terms|, gamma(k) = k u / (1 - k u)).
 * Each test prints its worst errors per case, so a device run's log shows margins, not only
 * pass/fail.
 */
#pragma once

#include "harness.h"

#include <stdint.h>
#include <stdlib.h>

#include "backend/cuda/cuda_backend.h"

static di_cuda *g_cu;

// Aborts the test program on a failing call: later checks would only repeat the failure.
#define CK(call)                                                                                   \
    do {                                                                                           \
        di_status st_ = (call);                                                                    \
        if (st_ != DI_OK) {                                                                        \
            fprintf(stderr, "%s:%d: %s returned %s\n", __FILE__, __LINE__, #call,                  \
                    di_status_str(st_));                                                           \
            g_checks_failed++;                                                                     \
            exit(test_finish());                                                                   \
        }                                                                                          \
    } while (0)

static inline void cuda_test_init(void) {
    if (di_cuda_device_count() == 0) DI_TEST_SKIP("no CUDA device");
    CK(di_cuda_create(0, &g_cu));
    char desc[256];
    di_cuda_describe(g_cu, desc, sizeof desc);
    fprintf(stderr, "device: %s\n", desc);
}

static inline int cuda_test_finish(void) {
    CK(di_cuda_sync(g_cu));
    di_cuda_destroy(g_cu);
    return test_finish();
}

// ---- random numbers (splitmix64; a fixed seed per program, printed on failure by the cases) ----

static uint64_t g_rng = 0x5eed1234abcdull;
static inline uint64_t rnd(void) {
    uint64_t z = (g_rng += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}
static inline float rndf(void) { // uniform in [-1, 1)
    return (float)((double)(rnd() >> 11) / 4503599627370496.0 - 1.0);
}
static inline void fill_rand(float *v, int64_t n, float scale) {
    for (int64_t i = 0; i < n; i++) v[i] = rndf() * scale;
}

// ---- device buffers ----

static inline void *dev_alloc(size_t bytes) {
    void *p = NULL;
    CK(di_cuda_alloc(g_cu, bytes, &p));
    return p;
}
static inline void *dev_from(const void *host, size_t bytes) {
    void *p = dev_alloc(bytes);
    CK(di_cuda_upload(g_cu, p, host, bytes));
    return p;
}
// 0xFF bytes: every float is NaN, every int32 is -1.
static inline void dev_poison(void *p, size_t bytes) {
    CK(di_cuda_memset(g_cu, p, 0xFF, bytes));
}
static inline void dev_to(void *host, const void *dev, size_t bytes) {
    CK(di_cuda_sync(g_cu)); // surfaces a kernel fault as DI_ERR_CUDA here, not later
    CK(di_cuda_download(g_cu, host, dev, bytes));
}
static inline void dev_free(void *p) {
    di_cuda_free(g_cu, p);
}

// ---- metrics ----

static inline double rel_l2(const float *out, const float *ref, int64_t n) {
    double num = 0, den = 0;
    for (int64_t i = 0; i < n; i++) {
        if (isnan(out[i]) != isnan(ref[i])) return INFINITY;
        if (isnan(ref[i])) continue;
        double d = (double)out[i] - (double)ref[i];
        num += d * d;
        den += (double)ref[i] * ref[i];
    }
    return den > 0 ? sqrt(num / den) : sqrt(num);
}

static inline double gamma_k(double k) {
    const double u = 5.960464477539063e-08; // 2^-24
    return k * u / (1.0 - k * u);
}

// Every out[i] within tol[i] of ref[i] (NaN only where ref is NaN). Returns the number of
// violations and prints the first few with `what`.
static inline int64_t check_bounds(const char *what, const float *out, const float *ref,
                                   const double *tol, int64_t n) {
    int64_t bad = 0;
    double worst = 0;
    for (int64_t i = 0; i < n; i++) {
        bool ok;
        if (isnan(ref[i]))
            ok = isnan(out[i]);
        else
            ok = !isnan(out[i]) && fabs((double)out[i] - ref[i]) <= tol[i];
        if (!isnan(ref[i]) && !isnan(out[i]) && tol[i] > 0) {
            double r = fabs((double)out[i] - ref[i]) / tol[i];
            if (r > worst) worst = r;
        }
        if (!ok && bad++ < 5)
            fprintf(stderr, "  %s[%lld]: got %.9g, want %.9g (tol %.3g)\n", what, (long long)i,
                    out[i], ref[i], tol[i]);
    }
    fprintf(stderr, "  %-40s n=%-8lld worst err/tol %.3f%s\n", what, (long long)n, worst,
            bad ? "  FAILED" : "");
    return bad;
}
