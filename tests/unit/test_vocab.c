// Tests for src/tok/vocab: loading DeepSeek V4's tokenizer.json (plain and gzip), the id table of
// spec serving.md §1.1, byte tokens, merges, added-token tries, and rejection of malformed files.
#include "harness.h"

#include <zlib.h>

#include "base/mem.h"
#include "tok/tokenizer.h"
#include "tok/vocab.h"

static di_vocab *g_v;

static void load(void) {
    char p[4096];
    test_src_path("data/tokenizer/deepseek-v4/tokenizer.json", p, sizeof p);
    CHECK(di_vocab_load(p, &g_v) == DI_OK);
    if (!g_v) {
        fprintf(stderr, "cannot load %s\n", p);
        exit(1);
    }
}

static int32_t id_of(const char *s) {
    return di_vocab_find(g_v, s, strlen(s));
}

static void test_table(void) {
    CHECK_EQ(g_v->n_vocab, 129280);
    CHECK_EQ(g_v->n_model, 128000);
    CHECK_EQ(g_v->n_merges, 127741);
    // spec serving.md §1.1
    CHECK_EQ(id_of("<｜begin▁of▁sentence｜>"), 0);
    CHECK_EQ(id_of("<｜end▁of▁sentence｜>"), 1);
    CHECK_EQ(id_of("<｜▁pad▁｜>"), 2);
    CHECK_EQ(id_of("<｜fim▁hole｜>"), 128800);
    CHECK_EQ(id_of("<｜fim▁begin｜>"), 128801);
    CHECK_EQ(id_of("<｜fim▁end｜>"), 128802);
    CHECK_EQ(id_of("<｜User｜>"), 128803);
    CHECK_EQ(id_of("<｜Assistant｜>"), 128804);
    CHECK_EQ(id_of("<think>"), 128821);
    CHECK_EQ(id_of("</think>"), 128822);
    CHECK_EQ(id_of("｜DSML｜"), 128825);
    CHECK_EQ(id_of("<｜latest_reminder｜>"), 128828);
    CHECK_EQ(id_of("<｜action｜>"), 128829);
    CHECK_EQ(id_of("<｜query｜>"), 128830);
    CHECK_EQ(id_of("<｜authority｜>"), 128831);
    CHECK_EQ(id_of("<｜domain｜>"), 128832);
    CHECK_EQ(id_of("<｜title｜>"), 128836);
    CHECK_EQ(id_of("<｜extracted_url｜>"), 128844);
    CHECK_EQ(id_of("<｜read_url｜>"), 128845);
    CHECK_EQ(id_of("<｜place▁holder▁no▁799｜>"), 128799);
    CHECK_EQ(id_of("no such token \x01"), -1);
    CHECK(g_v->tok_flags[0] & DI_VOCAB_FLAG_SPECIAL);
    CHECK(g_v->tok_flags[128803] & DI_VOCAB_FLAG_ADDED);
    CHECK(!(g_v->tok_flags[1000] & DI_VOCAB_FLAG_ADDED));
}

static void test_bytes_and_merges(void) {
    for (int b = 0; b < 256; b++) {
        int32_t id = g_v->byte_id[b];
        CHECK(di_vocab_valid(g_v, id));
        CHECK_EQ(g_v->tok_off[id + 1] - g_v->tok_off[id], 1);
        CHECK_EQ((unsigned char)g_v->tok_bytes[g_v->tok_off[id]], b);
    }
    // first merge of the file is "Ġ t": " " + "t" → " t" with rank 0
    int32_t rank, id;
    CHECK(di_vocab_merge(g_v, g_v->byte_id[' '], g_v->byte_id['t'], &rank, &id));
    CHECK_EQ(rank, 0);
    CHECK_EQ(id, id_of(" t"));
    CHECK(!di_vocab_merge(g_v, g_v->byte_id[0xff], g_v->byte_id[0xfe], &rank, &id));
}

static void test_trie(void) {
    // <｜User｜> is a normalized (non-special) added token: second pass; BOS is in the first
    const char *s = "xx<｜User｜>yy";
    size_t len = 0;
    CHECK_EQ(di_vocab_trie_match(&g_v->trie_norm, s, strlen(s), 0, &len), -1);
    CHECK_EQ(di_vocab_trie_match(&g_v->trie_raw, s, strlen(s), 2, &len), -1);
    CHECK_EQ(di_vocab_trie_match(&g_v->trie_norm, s, strlen(s), 2, &len), 128803);
    CHECK_EQ(len, strlen("<｜User｜>"));
    const char *b = "<｜begin▁of▁sentence｜>";
    CHECK_EQ(di_vocab_trie_match(&g_v->trie_raw, b, strlen(b), 0, &len), 0);
    CHECK_EQ(len, strlen(b));
    // a proper prefix of a token does not match
    const char *t = "<｜Use";
    CHECK_EQ(di_vocab_trie_match(&g_v->trie_raw, t, strlen(t), 0, &len), -1);
}

static di_status load_str(const char *json) {
    di_vocab *v = NULL;
    di_status st = di_vocab_load_mem(json, strlen(json), &v);
    di_vocab_destroy(v);
    return st;
}

static void test_malformed(void) {
    CHECK_EQ(load_str(""), DI_ERR_FORMAT);
    CHECK_EQ(load_str("[]"), DI_ERR_FORMAT);
    CHECK_EQ(load_str("{\"model\": 3}"), DI_ERR_FORMAT);
    CHECK_EQ(load_str("{\"model\": {\"type\": \"BPE\", \"vocab\": {}, \"merges\": []"),
             DI_ERR_FORMAT);
    // truncated gzip
    char p[4096];
    test_src_path("data/tokenizer/deepseek-v4/tokenizer.json", p, sizeof p);
    char *data;
    size_t n;
    CHECK(di_vocab_read_file(p, &data, &n) == DI_OK);
    uLongf cap = compressBound(n) + 64;
    unsigned char *gz = malloc(cap);
    z_stream zs = {0};
    deflateInit2(&zs, 1, Z_DEFLATED, 16 + MAX_WBITS, 8, Z_DEFAULT_STRATEGY);
    zs.next_in = (unsigned char *)data;
    zs.avail_in = (uInt)n;
    zs.next_out = gz;
    zs.avail_out = (uInt)cap;
    CHECK_EQ(deflate(&zs, Z_FINISH), Z_STREAM_END);
    size_t n_gz = zs.total_out;
    deflateEnd(&zs);
    di_vocab *v = NULL;
    CHECK(di_vocab_load_mem(gz, n_gz, &v) == DI_OK); // gzip accepted
    CHECK(v && v->n_vocab == 129280);
    di_vocab_destroy(v);
    v = NULL;
    CHECK_EQ(di_vocab_load_mem(gz, n_gz / 2, &v), DI_ERR_FORMAT);
    CHECK(v == NULL);
    // damage: a merge naming an unknown token
    char *bad = strstr(data, "\"Ġ t\"");
    CHECK(bad != NULL);
    if (bad) {
        memcpy(bad, "\"Q\xe2\x82\xac\"", 6); // "Q€": € is outside the byte-level alphabet
        CHECK_EQ(di_vocab_load_mem(data, n, &v), DI_ERR_FORMAT);
    }
    // another pre-tokenizer is refused rather than silently mis-tokenized
    char *pre = strstr(data, "{1,3}");
    CHECK(pre != NULL);
    if (pre) {
        pre[3] = '4';
        CHECK_EQ(di_vocab_load_mem(data, n, &v), DI_ERR_UNSUPPORTED);
    }
    free(gz);
    di_free(data);
    CHECK_EQ(di_vocab_load("/nonexistent/tokenizer.json", &v), DI_ERR_IO);
}

int main(void) {
    load();
    RUN(test_table);
    RUN(test_bytes_and_merges);
    RUN(test_trie);
    RUN(test_malformed);
    di_vocab_destroy(g_v);
    return test_finish();
}
