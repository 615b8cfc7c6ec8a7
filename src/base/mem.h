/*
 * mem — checked and aligned allocation. Every allocation of the library goes through here so that
 * an out-of-memory condition becomes DI_ERR_NOMEM at the caller instead of a crash.
 * Thread-safety: any thread.
 */
#pragma once

#include <stddef.h>
#include <stdint.h>

#define DI_ALIGN 64 // cache line; also enough for AVX-512 loads

// All return NULL on failure (and on size 0 for di_aligned_alloc). Free with di_free /
// di_aligned_free respectively; both accept NULL.
void *di_malloc(size_t size);
void *di_calloc(size_t n, size_t size);
void *di_realloc(void *p, size_t size);
void di_free(void *p);
void *di_aligned_alloc(size_t size);
void *di_aligned_calloc(size_t size);
void di_aligned_free(void *p);
// Heap allocations made so far by the calling thread through this module (every di_*alloc and
// di_strdup): the engine reads it around each step to prove the per-step path allocates nothing.
int64_t di_mem_thread_allocs(void);

// Returns a heap copy of s (free with di_free), or NULL.
char *di_strdup(const char *s);
// a*b with overflow check: returns 0 on overflow (callers treat 0 as "too large").
size_t di_mul_size(size_t a, size_t b);
