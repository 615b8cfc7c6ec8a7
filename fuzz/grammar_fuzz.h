// Shared by the grammar engine's fuzz targets (fuzz_grammar.c, fuzz_json_schema.c,
// fuzz_regex.c): feeding a matcher, and the converter targets' whole body.
#pragma once

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "base/log.h"
#include "deepinfer.h"
#include "grammar/grammar.h"

// Feeds text to a matcher of g (small limits). With tokens, the byte 0x01 followed by a byte k
// advances by token id k (token terminals `<[k]>`; no vocabulary, so only as terminals).
// Invariants: a refused byte or token leaves the state unchanged (can_end / n_stacks); a limit
// ends in a status, never a crash.
static inline void fuzz_feed(const di_grammar *g, const uint8_t *text, size_t n, bool tokens) {
    di_grammar_matcher_limits lim = di_grammar_matcher_limits_default();
    lim.max_nodes = 4096;
    lim.max_stacks = 64;
    di_grammar_matcher *m = NULL;
    if (di_grammar_matcher_create(g, NULL, &lim, &m) != DI_OK) return;
    for (size_t i = 0; i < n; i++) {
        bool end0 = di_grammar_matcher_can_end(m);
        int32_t s0 = di_grammar_matcher_n_stacks(m);
        bool ok = tokens && text[i] == 1 && i + 1 < n
                      ? di_grammar_matcher_advance_token(m, text[++i])
                      : di_grammar_matcher_advance(m, text + i, 1);
        if (!ok) {
            if (di_grammar_matcher_status(m) != DI_OK) break;
            if (di_grammar_matcher_can_end(m) != end0 || di_grammar_matcher_n_stacks(m) != s0)
                abort(); // a refused byte must not move the state
        }
    }
    di_grammar_matcher_destroy(m);
}

// A converter target (JSON Schema, regex): the input is the source text, then optionally a NUL
// byte and text to feed (first byte of the source: bit 0 selects strict mode for schemas).
// Invariants: conversion either succeeds or fails with DI_ERR_INVALID and a message (a generated
// grammar the compiler refuses is a converter bug unless a size limit was hit); then fuzz_feed's.
static inline int fuzz_front(di_grammar_kind kind, const uint8_t *data, size_t size) {
    static bool quiet;
    if (!quiet) di_set_log_level(0), quiet = true;
    const uint8_t *nul = memchr(data, 0, size);
    size_t n_src = nul ? (size_t)(nul - data) : size;
    uint32_t flags = size && (data[0] & 1) ? DI_GRAMMAR_FLAG_STRICT : 0;
    di_grammar *g = NULL;
    char err[256];
    di_status st = di_grammar_compile(kind, (const char *)data, n_src, flags, &g, err, sizeof err);
    if (st != DI_OK) {
        if (st != DI_ERR_INVALID || !err[0]) abort();
        if (!strncmp(err, "the generated grammar", 21) && !strstr(err, "too large") &&
            !strstr(err, "over the limit"))
            abort(); // the converter wrote a grammar the compiler refuses
        return 0;
    }
    if (nul) fuzz_feed(g, nul + 1, size - n_src - 1, false);
    di_grammar_destroy(g);
    return 0;
}
