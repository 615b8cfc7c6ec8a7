// libFuzzer target: the regex converter (src/grammar/regex.c), then the EBNF compiler and the
// matcher on its output (input format and invariants: grammar_fuzz.h, fuzz_front).
#include "grammar_fuzz.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    return fuzz_front(DI_GRAMMAR_KIND_REGEX, data, size);
}
