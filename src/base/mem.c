#include "base/mem.h"

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static _Thread_local int64_t t_allocs; // per thread: no contention, no atomics

int64_t di_mem_thread_allocs(void) {
    return t_allocs;
}

void *di_malloc(size_t size) {
    t_allocs++;
    return malloc(size ? size : 1);
}

void *di_calloc(size_t n, size_t size) {
    t_allocs++;
    return calloc(n ? n : 1, size ? size : 1);
}

void *di_realloc(void *p, size_t size) {
    t_allocs++;
    return realloc(p, size ? size : 1);
}

void di_free(void *p) {
    free(p);
}

void *di_aligned_alloc(size_t size) {
    if (size == 0) return NULL;
    t_allocs++;
    void *p = NULL;
    if (posix_memalign(&p, DI_ALIGN, size) != 0) return NULL;
    return p;
}

void *di_aligned_calloc(size_t size) {
    void *p = di_aligned_alloc(size);
    if (p) memset(p, 0, size);
    return p;
}

void di_aligned_free(void *p) {
    free(p);
}

char *di_strdup(const char *s) {
    size_t n = strlen(s) + 1;
    char *p = di_malloc(n);
    if (p) memcpy(p, s, n);
    return p;
}

size_t di_mul_size(size_t a, size_t b) {
    if (a != 0 && b > SIZE_MAX / a) return 0;
    return a * b;
}
