// libFuzzer target: the tokenizer (src/tok vocab/pretok/bpe/tokenizer/detok) on arbitrary bytes.
// Invariants checked on every input:
//   - invalid UTF-8 is rejected with DI_ERR_INVALID, valid UTF-8 always encodes;
//   - decode(encode(s)) == s, with and without added-token recognition;
//   - plain encoding never yields an added token;
//   - the streaming detokenizer, fed the ids one by one, gives the same text and never a partial
//     UTF-8 character;
//   - decoding arbitrary ids (the input's bytes read as ids) either fails cleanly or gives valid
//     UTF-8 (U+FFFD repairs), identical through the streaming path.
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "base/log.h"
#include "deepinfer.h"
#include "tok/tokenizer.h"

static di_tokenizer *g_tok;

static void quiet(di_log_level level, const char *msg, void *user) {
    (void)level;
    (void)msg;
    (void)user;
}

int LLVMFuzzerInitialize(int *argc, char ***argv) {
    (void)argc;
    (void)argv;
    di_log_set_sink(quiet, NULL); // expected errors would flood the output
    if (di_tokenizer_load_for_model(NULL, &g_tok) != DI_OK) abort();
    return 0;
}

static void stream_equal(const int32_t *ids, size_t n, const char *want, size_t n_want) {
    di_detok *d;
    if (di_detok_create(g_tok, false, &d) != DI_OK) abort();
    char *acc = malloc(n_want + 16);
    size_t len = 0;
    for (size_t i = 0; i < n; i++) {
        const char *t;
        size_t m;
        if (di_detok_push(d, ids[i], &t, &m) != DI_OK) abort();
        if (di_utf8_valid_prefix(t, m) != m) abort(); // never a partial character
        if (len + m > n_want) abort();
        memcpy(acc + len, t, m);
        len += m;
    }
    const char *t;
    size_t m;
    di_detok_flush(d, &t, &m);
    if (len + m > n_want) abort();
    memcpy(acc + len, t, m);
    len += m;
    if (len != n_want || memcmp(acc, want, len) != 0) abort();
    free(acc);
    di_detok_destroy(d);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    const char *s = (const char *)data;
    bool valid = di_utf8_valid_prefix(s, size) == size;
    for (int special = 0; special < 2; special++) {
        int32_t *ids = NULL;
        size_t n = 0;
        di_status st = di_tokenizer_encode(g_tok, s, size, special, &ids, &n);
        if (!valid) {
            if (st != DI_ERR_INVALID) abort();
            continue;
        }
        if (st != DI_OK) abort();
        char *back;
        size_t nb;
        if (di_tokenizer_decode(g_tok, ids, n, false, &back, &nb) != DI_OK) abort();
        if (nb != size || memcmp(back, s, size) != 0) abort();
        if (!special)
            for (size_t i = 0; i < n; i++)
                if (ids[i] >= 128000) abort(); // plain text never becomes an added token
        stream_equal(ids, n, back, nb);
        di_tok_free(back);
        di_tok_free(ids);
    }
    // arbitrary ids: 3 bytes each, mostly small ids (byte tokens) to exercise UTF-8 repair
    size_t n_ids = size / 3;
    int32_t *ids = malloc((n_ids + 1) * sizeof *ids);
    for (size_t i = 0; i < n_ids; i++) {
        uint32_t v = (uint32_t)data[3 * i] | (uint32_t)data[3 * i + 1] << 8 |
                     (uint32_t)data[3 * i + 2] << 16;
        ids[i] = (v & 0x800000) ? (int32_t)(v % 130000) : (int32_t)(v % 300);
    }
    char *text;
    size_t nt;
    di_status st = di_tokenizer_decode(g_tok, ids, n_ids, false, &text, &nt);
    if (st == DI_OK) {
        if (di_utf8_valid_prefix(text, nt) != nt) abort();
        stream_equal(ids, n_ids, text, nt);
        di_tok_free(text);
    } else if (st != DI_ERR_INVALID) {
        abort();
    }
    free(ids);
    return 0;
}
