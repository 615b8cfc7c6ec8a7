// gemm_asan — the region checks of the SIMD GEMM kernels under AddressSanitizer (gemm_avx2.c,
// gemm_avx512.c), included by those files only.
#pragma once

#include <stddef.h>
#include <stdint.h>

#include "tensor/tensor.h"

// ---- AddressSanitizer: each entry's regions, checked once per call ----
//
// Under AddressSanitizer the kernel files are compiled without ASan's per-access instrumentation
// (CMakeLists.txt: -fno-sanitize=address and DI_ASAN_REGIONS): their SIMD loops were ~70% of the
// sanitized test run, every 32-byte load checked. Instead each kernel entry checks, once per call,
// the exact regions of caller memory it reads and writes (READS / WRITES: the shadow of [p, p + n)
// through __asan_region_is_poisoned), so an out-of-bounds extent that a caller passes is reported
// by ASan as a bad access at its first unaddressable byte, and the run aborts. What this does not
// see: an access of these kernels outside the regions their contracts (gemm.h) name, i.e. a bug
// inside the kernels themselves; test_ops checks their outputs exactly against the reference on
// edge shapes, and its ASan case checks that a region one element short is reported.
#if defined(DI_ASAN_REGIONS)
#include <sanitizer/asan_interface.h>

__attribute__((noinline, unused)) static void asan_region(const void *p, size_t n, int is_write) {
    if (n == 0) return;
    void *bad = __asan_region_is_poisoned((void *)(uintptr_t)p, n);
    if (bad)
        __asan_report_error(__builtin_return_address(0), __builtin_frame_address(0),
                            __builtin_frame_address(0), bad, is_write, 1);
}
#define READS(p, n) asan_region((p), (size_t)(n), 0)
#define WRITES(p, n) asan_region((p), (size_t)(n), 1)

// Bytes of one data row of w (its n_in columns), and of its scale row (FP8, FP4).
static inline size_t w_row_bytes(const di_tensor *w) {
    const int64_t n = w->ne[0];
    int64_t el = 0;
    size_t by = 0;
    switch (w->kind) {
    case DI_TENSOR_KIND_F32:
        return (size_t)n * 4;
    case DI_TENSOR_KIND_F16:
    case DI_TENSOR_KIND_BF16:
        return (size_t)n * 2;
    case DI_TENSOR_KIND_FP8:
        return (size_t)n;
    case DI_TENSOR_KIND_FP4:
        return (size_t)n / 2;
    default:
        return di_tensor_kind_block(w->kind, &el, &by) ? (size_t)(n / el) * by : 0;
    }
}

// Rows r0 .. r0 + nr - 1 of w: their data and, for FP8 / FP4, their scale rows.
static inline void reads_w_rows(const di_tensor *w, int64_t r0, int nr) {
    const size_t rb = w_row_bytes(w);
    const bool scaled = w->kind == DI_TENSOR_KIND_FP8 || w->kind == DI_TENSOR_KIND_FP4;
    for (int i = 0; i < nr; i++) {
        READS((const uint8_t *)w->data + (size_t)(r0 + i) * w->nb1, rb);
        if (scaled)
            READS(w->scale + (size_t)((w->row0 + r0 + i) / w->block_out) * w->scale_nb1,
                  (w->ne[0] + w->block_in - 1) / w->block_in);
    }
}

// nt token rows of n elements of `size` bytes each, from an array of pointers.
static inline void reads_each(const void *const *xs, int nt, size_t bytes) {
    for (int j = 0; j < nt; j++) READS(xs[j], bytes);
}

// The accumulators acc[i][j] (i < nr, j < nt) of a float[4][3][8]: read and written.
static inline void touches_acc(float acc[4][3][8], int nr, int nt) {
    for (int i = 0; i < nr; i++)
        for (int j = 0; j < nt; j++) WRITES(acc[i][j], 8 * sizeof(float));
}

// Sums of nr rows x nt tokens to y[j * y_stride + i].
static inline void writes_y(const float *y, int64_t y_stride, int nr, int64_t nt) {
    for (int64_t j = 0; j < nt; j++) WRITES(y + j * y_stride, (size_t)nr * sizeof(float));
}
#else
#define READS(p, n) ((void)0)
#define WRITES(p, n) ((void)0)
#define reads_w_rows(w, r0, nr) ((void)0)
#define reads_each(xs, nt, bytes) ((void)0)
#define touches_acc(acc, nr, nt) ((void)0)
#define writes_y(y, y_stride, nr, nt) ((void)0)
#endif
