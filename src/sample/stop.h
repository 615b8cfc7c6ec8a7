/*
 * stop — stop strings over a stream of token bytes, safe across token boundaries: bytes are
 * held back while they could still be the start of a stop string, and released once they
 * cannot. When a stop string completes, the text before it is released and the match reported;
 * the stop string itself is never released.
 *
 * Owns: copies of the stop strings and the held bytes (fixed capacity chosen at init; no
 * allocation per token). Thread-safety: one request, one thread (the engine thread).
 */
#pragma once

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "deepinfer.h" // di_status, DI_MAX_STOP

#define DI_STOP_MAX_LEN 256    // bytes per stop string
#define DI_STOP_TOKEN_MAX 1024 // bytes per token (tokenizer tokens are far shorter)

typedef struct di_stop {
    char *strings;               // owned: the stop strings back to back
    size_t off[DI_MAX_STOP + 1]; // string i is strings[off[i] .. off[i+1])
    int32_t n;
    char *held; // owned [longest]: bytes not yet released
    size_t n_held;
    char *work; // owned [longest + DI_STOP_TOKEN_MAX]: held + this token
    size_t longest;
} di_stop;

// Copies n stop strings (each non-empty, at most 256 bytes). DI_ERR_INVALID, DI_ERR_NOMEM.
di_status di_stop_init(di_stop *s, const char *const *strings, int32_t n);
void di_stop_deinit(di_stop *s);

// Feeds one token's bytes. *out / *n_out receive the bytes released by this token (borrowed
// from s until the next call). Returns true when a stop string completed (the release then
// ends just before it). n <= DI_STOP_TOKEN_MAX.
bool di_stop_push(di_stop *s, const char *bytes, size_t n, const char **out, size_t *n_out);
// End of stream without a stop: releases everything held.
void di_stop_flush(di_stop *s, const char **out, size_t *n_out);
