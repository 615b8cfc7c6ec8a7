// Encode throughput of the C tokenizer on one thread over the golden corpus texts
// (tests/data/tok/corpus.jsonl.gz). Prints one line: "c: <bytes> bytes <ids> ids <seconds> s
// <MB/s> MB/s". Built and compared with HF tokenizers by bench/tok/run.sh.
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "base/mem.h"
#include "deepinfer.h"
#include "tok/vocab.h" // di_vocab_read_file (gunzip)

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

int main(int argc, char **argv) {
    const char *corpus = argc > 1 ? argv[1] : "tests/data/tok/corpus.jsonl.gz";
    int reps = argc > 2 ? atoi(argv[2]) : 3;
    char *data;
    size_t n;
    if (di_vocab_read_file(corpus, &data, &n) != DI_OK) return 1;
    size_t cap = 1 << 17, m = 0;
    char **texts = malloc(cap * sizeof *texts);
    size_t *lens = malloc(cap * sizeof *lens);
    size_t total = 0;
    for (char *line = data; line < data + n;) {
        char *nl = memchr(line, '\n', (size_t)(data + n - line));
        size_t ll = nl ? (size_t)(nl - line) : (size_t)(data + n - line);
        json_error_t e;
        json_t *rec = json_loadb(line, ll, JSON_ALLOW_NUL, &e);
        line += ll + 1;
        const json_t *t = json_object_get(rec, "t");
        if (json_is_string(t)) {
            if (m == cap) {
                cap *= 2;
                texts = realloc(texts, cap * sizeof *texts);
                lens = realloc(lens, cap * sizeof *lens);
            }
            lens[m] = json_string_length(t);
            texts[m] = malloc(lens[m] + 1);
            memcpy(texts[m], json_string_value(t), lens[m] + 1);
            total += lens[m];
            m++;
        }
        json_decref(rec);
    }
    di_free(data);
    di_tokenizer *tok;
    if (di_tokenizer_load_for_model(NULL, &tok) != DI_OK) return 1;
    double best = 1e30;
    size_t n_ids_total = 0;
    for (int r = 0; r < reps; r++) {
        n_ids_total = 0;
        double t0 = now();
        for (size_t i = 0; i < m; i++) {
            int32_t *ids;
            size_t k;
            if (di_tokenizer_encode(tok, texts[i], lens[i], true, &ids, &k) != DI_OK) return 1;
            n_ids_total += k;
            di_tok_free(ids);
        }
        double dt = now() - t0;
        if (dt < best) best = dt;
    }
    printf("c: %zu strings %zu bytes %zu ids %.3f s %.2f MB/s\n", m, total, n_ids_total, best,
           (double)total / best / 1e6);
    for (size_t i = 0; i < m; i++) free(texts[i]);
    free(texts);
    free(lens);
    di_tokenizer_destroy(tok);
    return 0;
}
