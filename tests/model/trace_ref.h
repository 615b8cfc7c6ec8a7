// Comparing the forward pass's traced tensors (di_dsv4_trace_fn) with a fixture's reference
// tensors named "<name>.<layer>" (python/gen_golden*.py), for the model fixture tests.
#pragma once

#include "harness.h"

#include <string.h>

#include "io/safetensors.h"

// One traced tensor against ref's "<name>.<il>". Integer rows (selections) must be identical:
// each row counts in *checked, each differing row (or a shape or dtype mismatch) in *mismatch,
// and the result is 0. FP32 tensors return test_rel_err (a shape or dtype mismatch fails a CHECK
// and returns -1). Returns -1 when ref has no such tensor.
static inline double trace_compare(const di_st_file *ref, const char *name, int il,
                                   const void *data, bool is_int, int64_t n_rows, int64_t row_len,
                                   int *checked, int *mismatch) {
    char key[64];
    snprintf(key, sizeof key, "%s.%d", name, il);
    const di_st_tensor *t = di_st_file_find(ref, key);
    if (!t) return -1;
    if (is_int) {
        if (t->dtype != DI_DTYPE_I32 || t->n_elements != n_rows * row_len) {
            fprintf(stderr, "%s: reference shape or dtype differs\n", key);
            (*mismatch)++;
            return 0;
        }
        const int32_t *want = t->data, *got = data;
        for (int64_t r = 0; r < n_rows; r++) {
            (*checked)++;
            if (memcmp(want + r * row_len, got + r * row_len, sizeof(int32_t) * (size_t)row_len)) {
                if (*mismatch < 5) fprintf(stderr, "%s: row %lld differs\n", key, (long long)r);
                (*mismatch)++;
            }
        }
        return 0;
    }
    if (t->dtype != DI_DTYPE_F32 || t->n_elements != n_rows * row_len) {
        fprintf(stderr, "%s: reference has %lld elements, got %lld\n", key,
                (long long)t->n_elements, (long long)(n_rows * row_len));
        CHECK(false);
        return -1;
    }
    return test_rel_err(data, t->data, n_rows * row_len);
}
