/*
 * mmap — read-only file mapping. Weights are mapped, never copied, so resident memory follows
 * what the forward pass touches.
 * Owns: the mapping. Thread-safety: the mapped bytes may be read from any thread.
 */
#pragma once

#include <stddef.h>

#include "deepinfer.h" // di_status

typedef struct di_mmap {
    const unsigned char *data; // owned mapping (NULL for an empty file)
    size_t size;
} di_mmap;

// Maps path read-only. DI_ERR_IO (logged with the path and errno text) when it cannot be opened.
di_status di_mmap_open(const char *path, di_mmap *out);
void di_mmap_close(di_mmap *m);
