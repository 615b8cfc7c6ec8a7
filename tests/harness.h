/*
 * harness — minimal test macros. A test is a main() that runs cases with RUN(fn); each CHECK
 * failure prints file:line and the values, and the process exits 1 if any check failed, 77 when
 * the test skips itself (ctest SKIP_RETURN_CODE), 0 otherwise. RUN prints each case's result and
 * wall time ("ok   test_x (1.2 s)": where a test's time goes, for trimming CI's sanitizer run). The
 * last line printed is "N passed, N failed" over checks.
 */
#pragma once

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static int g_checks_passed, g_checks_failed;

#define CHECK(cond)                                                                                \
    do {                                                                                           \
        if (cond) {                                                                                \
            g_checks_passed++;                                                                     \
        } else {                                                                                   \
            g_checks_failed++;                                                                     \
            fprintf(stderr, "%s:%d: CHECK failed: %s\n", __FILE__, __LINE__, #cond);               \
        }                                                                                          \
    } while (0)

#define CHECK_EQ(a, b)                                                                             \
    do {                                                                                           \
        long long a_ = (long long)(a), b_ = (long long)(b);                                        \
        if (a_ == b_) {                                                                            \
            g_checks_passed++;                                                                     \
        } else {                                                                                   \
            g_checks_failed++;                                                                     \
            fprintf(stderr, "%s:%d: CHECK_EQ failed: %s = %lld, %s = %lld\n", __FILE__, __LINE__,  \
                    #a, a_, #b, b_);                                                               \
        }                                                                                          \
    } while (0)

#define CHECK_STR_EQ(a, b)                                                                         \
    do {                                                                                           \
        const char *a_ = (a), *b_ = (b);                                                           \
        if (a_ && b_ && strcmp(a_, b_) == 0) {                                                     \
            g_checks_passed++;                                                                     \
        } else {                                                                                   \
            g_checks_failed++;                                                                     \
            fprintf(stderr, "%s:%d: CHECK_STR_EQ failed: \"%s\" vs \"%s\"\n", __FILE__, __LINE__,  \
                    a_ ? a_ : "(null)", b_ ? b_ : "(null)");                                       \
        }                                                                                          \
    } while (0)

#define CHECK_NEAR(a, b, tol)                                                                      \
    do {                                                                                           \
        double a_ = (double)(a), b_ = (double)(b);                                                 \
        if (fabs(a_ - b_) <= (tol)) {                                                              \
            g_checks_passed++;                                                                     \
        } else {                                                                                   \
            g_checks_failed++;                                                                     \
            fprintf(stderr, "%s:%d: CHECK_NEAR failed: %s = %.9g, %s = %.9g (tol %g)\n", __FILE__, \
                    __LINE__, #a, a_, #b, b_, (double)(tol));                                      \
        }                                                                                          \
    } while (0)

#define DI_TEST_SKIP(msg)                                                                          \
    do {                                                                                           \
        fprintf(stderr, "SKIP: %s\n", msg);                                                        \
        exit(77);                                                                                  \
    } while (0)

static inline double di_test_now_s(void) {
    struct timespec ts;
    timespec_get(&ts, TIME_UTC);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

#define RUN(fn)                                                                                    \
    do {                                                                                           \
        int before_ = g_checks_failed;                                                             \
        double t0_ = di_test_now_s();                                                              \
        fn();                                                                                      \
        fprintf(stderr, "%s %s (%.1f s)\n", g_checks_failed == before_ ? "ok  " : "FAIL", #fn,     \
                di_test_now_s() - t0_);                                                            \
    } while (0)

// Removes dir and everything below it (a test's temporary directory); says so if it cannot.
static inline void di_test_remove_dir(const char *dir) {
    char cmd[512];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
    if (system(cmd) != 0) fprintf(stderr, "could not remove %s\n", dir);
}

static inline int test_finish(void) {
    printf("%d passed, %d failed\n", g_checks_passed, g_checks_failed);
    return g_checks_failed ? 1 : 0;
}

// Path of a file relative to the source tree (ctest runs with DI_SOURCE_DIR set).
static inline const char *test_src_path(const char *rel, char *buf, size_t cap) {
    const char *root = getenv("DI_SOURCE_DIR");
    snprintf(buf, cap, "%s/%s", root ? root : ".", rel);
    return buf;
}

// max |a - b| / max |b| over n values (max |a - b| when b is all zeros); a NaN difference gives
// infinity, so a NaN never passes a tolerance.
static inline double test_rel_err(const float *a, const float *b, int64_t n) {
    double mx = 0, md = 0;
    for (int64_t i = 0; i < n; i++) {
        double d = fabs((double)a[i] - b[i]);
        if (d > md || d != d) md = d != d ? INFINITY : d;
        if (fabs((double)b[i]) > mx) mx = fabs((double)b[i]);
    }
    return mx > 0 ? md / mx : md;
}
