// name_index — see name_index.h.
#include "base/name_index.h"

#include <string.h>

#include "base/hash.h"
#include "base/mem.h"

static const char *name_at(const void *entries, size_t stride, size_t name_off, int64_t k) {
    const char *name;
    memcpy(&name, (const char *)entries + (size_t)k * stride + name_off, sizeof name);
    return name;
}

di_status di_name_index_init(di_name_index *h, int64_t n) {
    size_t cap = 16;
    while (cap / 2 < (size_t)n) cap *= 2;
    size_t bytes = di_mul_size(cap, sizeof *h->slots);
    h->slots = bytes ? di_malloc(bytes) : NULL;
    if (!h->slots) return DI_ERR_NOMEM;
    memset(h->slots, 0xff, bytes); // all -1
    h->mask = cap - 1;
    return DI_OK;
}

void di_name_index_deinit(di_name_index *h) {
    di_free(h->slots);
    h->slots = NULL;
}

int64_t di_name_index_find(const di_name_index *h, const void *entries, size_t stride,
                           size_t name_off, const char *name) {
    if (!h->slots || !name) return -1;
    for (size_t i = (size_t)di_fnv1a_str(name) & h->mask;; i = (i + 1) & h->mask) {
        int64_t k = h->slots[i];
        if (k < 0) return -1;
        if (strcmp(name_at(entries, stride, name_off, k), name) == 0) return k;
    }
}

int64_t di_name_index_insert(di_name_index *h, const void *entries, size_t stride, size_t name_off,
                             int64_t k) {
    const char *name = name_at(entries, stride, name_off, k);
    for (size_t i = (size_t)di_fnv1a_str(name) & h->mask;; i = (i + 1) & h->mask) {
        int64_t j = h->slots[i];
        if (j < 0) {
            h->slots[i] = k;
            return -1;
        }
        if (strcmp(name_at(entries, stride, name_off, j), name) == 0) return j;
    }
}
