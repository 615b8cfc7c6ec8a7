// Tests for src/tok/bpe + pretok + tokenizer + detok against the HF `tokenizers` golden corpus
// (tests/data/tok/corpus.jsonl.gz, written by python/gen_tok_golden.py): ids with added-token
// recognition ("s") and as plain text ("p") must be identical for every string, decode must give
// the string back, and the streaming detokenizer must produce the same text token by token.
#include "harness.h"

#include <jansson.h>
#include <pthread.h>

#include "base/mem.h"
#include "tok/tokenizer.h"
#include "tok/vocab.h"

static di_tokenizer *g_tok;

static bool ids_equal(const int32_t *a, size_t na, const json_t *b) {
    if (!json_is_array(b) || json_array_size(b) != na) return false;
    for (size_t i = 0; i < na; i++)
        if (json_integer_value(json_array_get(b, i)) != a[i]) return false;
    return true;
}

static void print_mismatch(const char *what, const char *t, size_t n, const int32_t *ids,
                           size_t n_ids, const json_t *want) {
    static int shown;
    if (shown++ > 10) return;
    fprintf(stderr, "%s mismatch on \"%.*s\" (%zu bytes)\n  got ", what, (int)(n > 200 ? 200 : n),
            t, n);
    for (size_t i = 0; i < n_ids && i < 40; i++) fprintf(stderr, "%d ", ids[i]);
    fprintf(stderr, "\n  want ");
    for (size_t i = 0; i < json_array_size(want) && i < 40; i++)
        fprintf(stderr, "%lld ", (long long)json_integer_value(json_array_get(want, i)));
    fprintf(stderr, "\n");
}

// Streams ids through a detokenizer and compares the concatenation with text; also checks that no
// chunk ends inside a UTF-8 character.
static bool stream_ok(const int32_t *ids, size_t n_ids, const char *text, size_t n) {
    di_detok *d;
    if (di_detok_create(g_tok, false, &d) != DI_OK) return false;
    char *acc = malloc(n + 64);
    size_t len = 0;
    bool ok = true;
    for (size_t i = 0; i < n_ids && ok; i++) {
        const char *t;
        size_t m;
        if (di_detok_push(d, ids[i], &t, &m) != DI_OK || len + m > n)
            ok = false;
        else {
            if (di_utf8_valid_prefix(t, m) != m) ok = false;
            memcpy(acc + len, t, m);
            len += m;
        }
    }
    const char *t;
    size_t m;
    di_detok_flush(d, &t, &m); // an incomplete character at the end comes out as U+FFFD
    if (ok && len + m <= n) {
        memcpy(acc + len, t, m);
        len += m;
    }
    ok = ok && len == n && memcmp(acc, text, n) == 0;
    free(acc);
    di_detok_destroy(d);
    return ok;
}

static void test_corpus(void) {
    char p[4096];
    char *data;
    size_t n_data;
    test_src_path("tests/data/tok/corpus.jsonl.gz", p, sizeof p);
    if (di_vocab_read_file(p, &data, &n_data) != DI_OK) {
        CHECK(!"corpus missing: run python/gen_tok_golden.py");
        return;
    }
    size_t n_rec = 0, n_special_ok = 0, n_plain_ok = 0, n_rt_ok = 0, n_stream_ok = 0;
    int64_t n_declared = -1;
    char *line = data;
    while (line < data + n_data) {
        char *nl = memchr(line, '\n', (size_t)(data + n_data - line));
        size_t ll = nl ? (size_t)(nl - line) : (size_t)(data + n_data - line);
        json_error_t err;
        json_t *rec = json_loadb(line, ll, JSON_ALLOW_NUL, &err);
        line += ll + 1;
        if (!rec) {
            CHECK(!"corpus line does not parse");
            continue;
        }
        if (n_declared < 0) { // header
            n_declared = json_integer_value(json_object_get(rec, "n"));
            json_decref(rec);
            continue;
        }
        const json_t *jt = json_object_get(rec, "t");
        const char *t = json_string_value(jt);
        size_t n = json_string_length(jt);
        const json_t *js = json_object_get(rec, "s");
        const json_t *jp = json_object_get(rec, "p") ? json_object_get(rec, "p") : js;
        int32_t *ids = NULL;
        size_t n_ids = 0;
        n_rec++;
        if (di_tokenizer_encode(g_tok, t, n, true, &ids, &n_ids) == DI_OK) {
            if (ids_equal(ids, n_ids, js))
                n_special_ok++;
            else
                print_mismatch("special", t, n, ids, n_ids, js);
            char *back;
            size_t n_back;
            if (di_tokenizer_decode(g_tok, ids, n_ids, false, &back, &n_back) == DI_OK) {
                if (n_back == n && memcmp(back, t, n) == 0) n_rt_ok++;
                di_tok_free(back);
            }
            if (stream_ok(ids, n_ids, t, n)) n_stream_ok++;
            di_tok_free(ids);
        }
        if (di_tokenizer_encode(g_tok, t, n, false, &ids, &n_ids) == DI_OK) {
            if (ids_equal(ids, n_ids, jp))
                n_plain_ok++;
            else
                print_mismatch("plain", t, n, ids, n_ids, jp);
            di_tok_free(ids);
        }
        json_decref(rec);
    }
    di_free(data);
    fprintf(stderr,
            "corpus: %zu strings; special ids %zu/%zu, plain ids %zu/%zu, decode %zu/%zu, "
            "stream %zu/%zu identical\n",
            n_rec, n_special_ok, n_rec, n_plain_ok, n_rec, n_rt_ok, n_rec, n_stream_ok, n_rec);
    CHECK_EQ(n_rec, n_declared);
    CHECK(n_rec >= 100000);
    CHECK_EQ(n_special_ok, n_rec);
    CHECK_EQ(n_plain_ok, n_rec);
    CHECK_EQ(n_rt_ok, n_rec);
    CHECK_EQ(n_stream_ok, n_rec);
}

// tests/data/tok/decode.jsonl.gz: HF's decode of random id sequences (invalid UTF-8 from byte
// tokens, added tokens, skip_special_tokens both ways) must be reproduced exactly, and the
// streaming detokenizer must give the same text.
static void test_decode_golden(void) {
    char p[4096];
    char *data;
    size_t n_data;
    test_src_path("tests/data/tok/decode.jsonl.gz", p, sizeof p);
    if (di_vocab_read_file(p, &data, &n_data) != DI_OK) {
        CHECK(!"decode golden missing: run python/gen_tok_golden.py");
        return;
    }
    size_t n_rec = 0, n_ok = 0;
    bool header = true;
    for (char *line = data; line < data + n_data;) {
        char *nl = memchr(line, '\n', (size_t)(data + n_data - line));
        size_t ll = nl ? (size_t)(nl - line) : (size_t)(data + n_data - line);
        json_error_t err;
        json_t *rec = json_loadb(line, ll, JSON_ALLOW_NUL, &err);
        line += ll + 1;
        if (header || !rec) {
            header = false;
            json_decref(rec);
            continue;
        }
        const json_t *ja = json_object_get(rec, "ids");
        size_t n = json_array_size(ja);
        int32_t *ids = malloc((n + 1) * sizeof *ids);
        for (size_t i = 0; i < n; i++) ids[i] = (int32_t)json_integer_value(json_array_get(ja, i));
        bool ok = true;
        for (int skip = 0; skip < 2; skip++) {
            const json_t *want = json_object_get(rec, skip ? "skip" : "text");
            char *t;
            size_t nt;
            bool same = di_tokenizer_decode(g_tok, ids, n, skip, &t, &nt) == DI_OK &&
                        nt == json_string_length(want) &&
                        memcmp(t, json_string_value(want), nt) == 0;
            static int shown;
            if (!same && shown++ < 3)
                fprintf(stderr, "decode (skip=%d) differs:\n  got  \"%.*s\"\n  want \"%s\"\n", skip,
                        (int)nt, t, json_string_value(want));
            ok &= same;
            if (!skip) ok &= stream_ok(ids, n, t, nt);
            di_tok_free(t);
        }
        n_rec++;
        n_ok += ok;
        free(ids);
        json_decref(rec);
    }
    di_free(data);
    fprintf(stderr, "decode golden: %zu/%zu sequences identical to HF\n", n_ok, n_rec);
    CHECK(n_rec >= 5000);
    CHECK_EQ(n_ok, n_rec);
}

static void enc(const char *s, bool special, int32_t **ids, size_t *n) {
    *ids = NULL;
    *n = 0;
    CHECK(di_tokenizer_encode(g_tok, s, strlen(s), special, ids, n) == DI_OK);
}

static void test_special_vs_plain(void) {
    // spec serving.md §5.4: <｜User｜> typed by a user is 5 plain tokens; <think> is 3
    int32_t *ids;
    size_t n;
    enc("<｜User｜>", true, &ids, &n);
    CHECK_EQ(n, 1);
    CHECK_EQ(ids[0], 128803);
    di_tok_free(ids);
    enc("<｜User｜>", false, &ids, &n);
    CHECK_EQ(n, 5);
    for (size_t i = 0; i < n; i++) CHECK(ids[i] < 128000);
    di_tok_free(ids);
    enc("<think>", false, &ids, &n);
    CHECK_EQ(n, 3);
    di_tok_free(ids);
    enc("", true, &ids, &n);
    CHECK_EQ(n, 0);
    CHECK(ids == NULL);
}

static void test_invalid_input(void) {
    int32_t *ids = (int32_t *)1;
    size_t n = 7;
    const char bad[] = {'a', (char)0xC3, 'b'}; // truncated 2-byte sequence
    CHECK_EQ(di_tokenizer_encode(g_tok, bad, 3, true, &ids, &n), DI_ERR_INVALID);
    CHECK(ids == (int32_t *)1 && n == 7);                    // outputs untouched on failure
    const char sur[] = {(char)0xED, (char)0xA0, (char)0x80}; // a UTF-8 encoded surrogate
    CHECK_EQ(di_tokenizer_encode(g_tok, sur, 3, false, &ids, &n), DI_ERR_INVALID);
    const char nul[] = {'a', 0, 'b'}; // NUL is valid text
    CHECK_EQ(di_tokenizer_encode(g_tok, nul, 3, false, &ids, &n), DI_OK);
    di_tok_free(ids);
    int32_t bad_ids[] = {5, 129280};
    char *t;
    size_t nt;
    CHECK_EQ(di_tokenizer_decode(g_tok, bad_ids, 2, false, &t, &nt), DI_ERR_INVALID);
    bad_ids[1] = -1;
    CHECK_EQ(di_tokenizer_decode(g_tok, bad_ids, 2, false, &t, &nt), DI_ERR_INVALID);
    CHECK(di_tokenizer_token_bytes(g_tok, 129280, &nt) == NULL);
    CHECK(di_tokenizer_token_bytes(g_tok, -5, &nt) == NULL);
}

static void test_lossy_decode(void) {
    // byte tokens that do not form UTF-8: one U+FFFD per maximal invalid subpart (as Rust)
    const di_vocab *v = di_tokenizer_vocab(g_tok);
    int32_t ids[] = {v->byte_id[0xE4], v->byte_id[0xB8], v->byte_id['a'], v->byte_id[0xFF],
                     v->byte_id[0xE4], v->byte_id[0xB8], v->byte_id[0xAD]};
    char *t;
    size_t n;
    CHECK(di_tokenizer_decode(g_tok, ids, 7, false, &t, &n) == DI_OK);
    CHECK_STR_EQ(t, "\xEF\xBF\xBD"
                    "a\xEF\xBF\xBD中");
    di_tok_free(t);
    // streaming: the first two bytes are held until 'a' shows they can never complete
    di_detok *d;
    CHECK(di_detok_create(g_tok, false, &d) == DI_OK);
    const char *s;
    CHECK(di_detok_push(d, ids[0], &s, &n) == DI_OK && n == 0);
    CHECK(di_detok_push(d, ids[1], &s, &n) == DI_OK && n == 0);
    CHECK(di_detok_push(d, ids[2], &s, &n) == DI_OK);
    CHECK(n == 4 && memcmp(s,
                           "\xEF\xBF\xBD"
                           "a",
                           4) == 0);
    CHECK(di_detok_push(d, ids[4], &s, &n) == DI_OK && n == 0);
    CHECK(di_detok_push(d, 129280, &s, &n) == DI_ERR_INVALID); // state unchanged
    CHECK(di_detok_push(d, ids[5], &s, &n) == DI_OK && n == 0);
    CHECK(di_detok_push(d, ids[6], &s, &n) == DI_OK && n == 3 && memcmp(s, "中", 3) == 0);
    CHECK(di_detok_push(d, ids[0], &s, &n) == DI_OK && n == 0);
    di_detok_flush(d, &s, &n); // incomplete at the end → U+FFFD
    CHECK(n == 3 && memcmp(s, "\xEF\xBF\xBD", 3) == 0);
    di_detok_flush(d, &s, &n);
    CHECK_EQ(n, 0);
    di_detok_destroy(d);
    // skip_special drops BOS/EOS but keeps non-special added tokens such as <｜User｜>
    int32_t sp[] = {0, 128803, v->byte_id['x'], 1};
    CHECK(di_tokenizer_decode(g_tok, sp, 4, true, &t, &n) == DI_OK);
    CHECK_STR_EQ(t, "<｜User｜>x");
    di_tok_free(t);
}

static void *encode_worker(void *arg) {
    const char *text = arg;
    for (int i = 0; i < 200; i++) {
        int32_t *ids;
        size_t n;
        if (di_tokenizer_encode(g_tok, text, strlen(text), true, &ids, &n) != DI_OK) return arg;
        char *back;
        size_t nb;
        bool ok = di_tokenizer_decode(g_tok, ids, n, false, &back, &nb) == DI_OK &&
                  strcmp(back, text) == 0;
        di_tok_free(back);
        di_tok_free(ids);
        if (!ok) return arg;
    }
    return NULL;
}

static void test_threads(void) {
    const char *texts[4] = {"Hello, world! 12345 你好世界", "<｜User｜>q<｜Assistant｜><think>",
                            "    indented code();\n\n", "emoji 👨‍👩‍👧‍👦 and ñ"};
    pthread_t th[4];
    for (int i = 0; i < 4; i++) pthread_create(&th[i], NULL, encode_worker, (void *)texts[i]);
    for (int i = 0; i < 4; i++) {
        void *r;
        pthread_join(th[i], &r);
        CHECK(r == NULL);
    }
}

static void test_load_for_model(void) {
    di_tokenizer *t = NULL;
    // a directory without tokenizer.json falls back to the committed copy
    CHECK(di_tokenizer_load_for_model("/nonexistent-model-dir", &t) == DI_OK);
    CHECK(t && di_tokenizer_n_vocab(t) == 129280);
    di_tokenizer_destroy(t);
    t = NULL;
    char p[4096];
    test_src_path("data/tokenizer/deepseek-v4", p, sizeof p);
    CHECK(di_tokenizer_load_for_model(p, &t) == DI_OK);
    di_tokenizer_destroy(t);
    CHECK_EQ(di_tokenizer_load("/nonexistent.json", &t), DI_ERR_IO);
}

int main(void) {
    if (di_tokenizer_load_for_model(NULL, &g_tok) != DI_OK) {
        fprintf(stderr, "cannot load the default tokenizer\n");
        return 1;
    }
    RUN(test_special_vs_plain);
    RUN(test_invalid_input);
    RUN(test_lossy_decode);
    RUN(test_threads);
    RUN(test_load_for_model);
    RUN(test_decode_golden);
    RUN(test_corpus);
    di_tokenizer_destroy(g_tok);
    return test_finish();
}
