// libFuzzer target: the EBNF compiler (src/grammar/grammar.c) and the matcher. The input is
// grammar text, then optionally a NUL byte and text to feed; in that text the byte 0x01 followed by
// a byte k advances by token id k (token terminals `<[k]>`; no vocabulary, so only as terminals).
// Invariants: compile either succeeds
// or fails with DI_ERR_INVALID and a message; the matcher never crashes, a refused byte leaves
// its state unchanged (can_end / n_stacks), and a limit ends in DI_ERR_UNSUPPORTED.
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
        bool ok = text[i] == 1 && i + 1 < n ? di_grammar_matcher_advance_token(m, text[++i])
                                            : di_grammar_matcher_advance(m, text + i, 1);
        if (!ok) {
            if (di_grammar_matcher_status(m) != DI_OK) break;
            if (di_grammar_matcher_can_end(m) != end0 || di_grammar_matcher_n_stacks(m) != s0)
                abort(); // a refused byte must not move the state
        }
    }
    di_grammar_matcher_destroy(m);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    static bool quiet;
    if (!quiet) di_set_log_level(0), quiet = true;
    const uint8_t *nul = memchr(data, 0, size);
    size_t n_g = nul ? (size_t)(nul - data) : size;
    di_grammar *g = NULL;
    char err[256];
    di_status st =
        di_grammar_compile(DI_GRAMMAR_KIND_EBNF, (const char *)data, n_g, 0, &g, err, sizeof err);
    if (st != DI_OK) {
        if (st != DI_ERR_INVALID || !err[0]) abort();
        return 0;
    }
    if (nul) run(g, nul + 1, size - n_g - 1);
    di_grammar_destroy(g);
    return 0;
}
