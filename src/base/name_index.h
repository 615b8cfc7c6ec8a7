/*
 * name_index — open addressing (linear probing, load factor <= 1/2) from a name to its index in
 * the owner's array of entries. The index stores no strings: entry k's name is the `const char *`
 * field at byte offset name_off of entries[k] (entries of `stride` bytes), so one index type serves
 * the safetensors tensor table and GGUF's key/value and tensor tables.
 *
 * Owns: its slot array. Thread-safety: none (build, then read from any thread).
 */
#pragma once

#include <stddef.h>
#include <stdint.h>

#include "base/status.h"

typedef struct di_name_index {
    int64_t *slots; // owned [mask + 1]; -1 = empty
    size_t mask;
} di_name_index;

// Room for n entries. DI_ERR_NOMEM.
di_status di_name_index_init(di_name_index *h, int64_t n);
void di_name_index_deinit(di_name_index *h);
// The index of the entry called name, or -1 (also for an uninitialised index or a NULL name).
int64_t di_name_index_find(const di_name_index *h, const void *entries, size_t stride,
                           size_t name_off, const char *name);
// Inserts entry k. Returns -1, or the index of an entry that already has its name (k is then not
// inserted).
int64_t di_name_index_insert(di_name_index *h, const void *entries, size_t stride, size_t name_off,
                             int64_t k);
