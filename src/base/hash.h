/*
 * hash — FNV-1a 64 over bytes: name tables (io), state checksums and model fingerprints (model),
 * KV identity (kv). Not cryptographic; the prefix cache's block hashes use their own chain.
 */
#pragma once

#include <stddef.h>
#include <stdint.h>

#define DI_FNV1A_INIT 0xcbf29ce484222325ull

// Continues hash h over n bytes at p (start with DI_FNV1A_INIT).
static inline uint64_t di_fnv1a(const void *p, size_t n, uint64_t h) {
    const unsigned char *b = p;
    for (size_t i = 0; i < n; i++) h = (h ^ b[i]) * 0x100000001b3ull;
    return h;
}

// FNV-1a of a NUL-terminated string.
static inline uint64_t di_fnv1a_str(const char *s) {
    uint64_t h = DI_FNV1A_INIT;
    for (const unsigned char *p = (const unsigned char *)s; *p; p++)
        h = (h ^ *p) * 0x100000001b3ull;
    return h;
}
