// probe — see probe.h.
#define _POSIX_C_SOURCE 200809L
#include "backend/cpu/probe.h"

#include <math.h>
#include <stdint.h>
#include <time.h>

#include "base/mem.h"

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

// ---- read bandwidth ----

typedef struct bw_ctx {
    const uint64_t *buf;
    int64_t n;
    volatile uint64_t sink;
} bw_ctx;

static void bw_task(void *p, int ith, int nth) {
    bw_ctx *c = p;
    int64_t lo, hi;
    di_split_range(c->n / 8, ith, nth, &lo, &hi);
    uint64_t s[8] = {0};
    for (int64_t i = lo * 8; i < hi * 8; i += 8)
        for (int k = 0; k < 8; k++) s[k] += c->buf[i + k];
    c->sink = s[0] + s[1] + s[2] + s[3] + s[4] + s[5] + s[6] + s[7];
}

double di_probe_read_bw(di_pool *pool, size_t bytes, int reps) {
    const int64_t n = (int64_t)(bytes / 64) * 8;
    uint64_t *buf = di_aligned_alloc((size_t)n * 8);
    if (!buf) return 0;
    for (int64_t i = 0; i < n; i++) buf[i] = (uint64_t)i;
    bw_ctx c = {.buf = buf, .n = n};
    double best = 1e30;
    for (int r = 0; r < reps + 1; r++) { // the first pass warms the TLB
        double t0 = now_s();
        di_pool_run(pool, bw_task, &c);
        double t = now_s() - t0;
        if (r > 0 && t < best) best = t;
    }
    di_aligned_free(buf);
    return (double)n * 8 / best;
}

// ---- multiply-add peak ----

enum { FMA_ITERS = 2000000 }; // per thread and rep: 24 M multiply-adds per lane

typedef struct fma_ctx {
    di_cpu_isa isa;
    volatile float sink;
} fma_ctx;

// Twelve independent chains hide the FMA latency; x * 0.5 + 1 stays finite and normal.
static float fma_scalar(int64_t iters) {
    float a[12];
    for (int i = 0; i < 12; i++) a[i] = (float)i;
    for (int64_t k = 0; k < iters; k++)
        for (int i = 0; i < 12; i++) a[i] = fmaf(a[i], 0.5f, 1.0f);
    float s = 0;
    for (int i = 0; i < 12; i++) s += a[i];
    return s;
}

static void fma_task(void *p, int ith, int nth) {
    (void)ith, (void)nth;
    fma_ctx *c = p;
    c->sink = c->isa >= DI_CPU_ISA_AVX512 ? di_gemm_avx512_fma_loop(FMA_ITERS)
              : c->isa >= DI_CPU_ISA_AVX2 ? di_gemm_avx2_fma_loop(FMA_ITERS)
                                          : fma_scalar(FMA_ITERS / 8);
}

double di_probe_fma_peak(di_pool *pool, di_cpu_isa isa, int reps) {
    fma_ctx c = {.isa = isa};
    const double lanes = isa >= DI_CPU_ISA_AVX512 ? 16.0 : isa >= DI_CPU_ISA_AVX2 ? 8.0 : 1.0;
    const double per_thread = 12.0 * lanes * (isa >= DI_CPU_ISA_AVX2 ? FMA_ITERS : FMA_ITERS / 8);
    double best = 1e30;
    for (int r = 0; r < reps + 1; r++) {
        double t0 = now_s();
        di_pool_run(pool, fma_task, &c);
        double t = now_s() - t0;
        if (r > 0 && t < best) best = t;
    }
    return per_thread * di_pool_n_threads(pool) / best;
}
