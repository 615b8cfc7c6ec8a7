// libFuzzer target: the EBNF compiler (src/grammar/grammar.c) and the matcher. The input is
// grammar text, then optionally a NUL byte and text to feed (with token ids: grammar_fuzz.h,
// fuzz_feed). Invariants: compile either succeeds or fails with DI_ERR_INVALID and a message;
// then fuzz_feed's.
#include "grammar_fuzz.h"

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
    if (nul) fuzz_feed(g, nul + 1, size - n_g - 1, true);
    di_grammar_destroy(g);
    return 0;
}
