// libFuzzer target: the regex converter (src/grammar/regex.c), then the EBNF compiler and
// the matcher on its output. The input is the source text, then optionally a NUL byte and text to
// feed (first byte of the source: bit 0 selects strict mode for schemas). Invariants: conversion
// either succeeds or fails with DI_ERR_INVALID and a message (a generated grammar the compiler
// refuses is a converter bug unless a size limit was hit); the matcher never crashes and a
// refused byte leaves its state unchanged.
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "base/log.h"
#include "deepinfer.h"
#include "grammar/grammar.h"

static void run(const di_grammar *g, const uint8_t *text, size_t n) {
    di_grammar_matcher_limits lim = di_grammar_matcher_limits_default();
    lim.max_nodes = 4096;
    lim.max_stacks = 64;
    di_grammar_matcher *m = NULL;
    if (di_grammar_matcher_create(g, NULL, &lim, &m) != DI_OK) return;
    for (size_t i = 0; i < n; i++) {
        bool end0 = di_grammar_matcher_can_end(m);
        int32_t s0 = di_grammar_matcher_n_stacks(m);
        if (!di_grammar_matcher_advance(m, text + i, 1)) {
            if (di_grammar_matcher_status(m) != DI_OK) break;
            if (di_grammar_matcher_can_end(m) != end0 || di_grammar_matcher_n_stacks(m) != s0)
                abort();
        }
    }
    di_grammar_matcher_destroy(m);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    static bool quiet;
    if (!quiet) di_set_log_level(0), quiet = true;
    const uint8_t *nul = memchr(data, 0, size);
    size_t n_src = nul ? (size_t)(nul - data) : size;
    uint32_t flags = size && (data[0] & 1) ? DI_GRAMMAR_FLAG_STRICT : 0;
    di_grammar *g = NULL;
    char err[256];
    di_status st = di_grammar_compile(DI_GRAMMAR_KIND_REGEX, (const char *)data, n_src, flags, &g,
                                      err, sizeof err);
    if (st != DI_OK) {
        if (st != DI_ERR_INVALID || !err[0]) abort();
        if (!strncmp(err, "the generated grammar", 21) && !strstr(err, "too large") &&
            !strstr(err, "over the limit"))
            abort(); // the converter wrote a grammar the compiler refuses
        return 0;
    }
    if (nul) run(g, nul + 1, size - n_src - 1);
    di_grammar_destroy(g);
    return 0;
}
