/*
 * test_engram_map — the Engram compressed token map built from the committed V4 tokenizer equals,
 * id for id, the one made by transformers' build_compressed_token_map on HF tokenizers
 * (python/gen_engram_map.py → tests/data/tok/engram_map_v4.bin.gz), plus a few hand cases.
 */
#include "harness.h"

#include <stdio.h>
#include <string.h>
#include <zlib.h>

#include "base/mem.h"
#include "tok/engram_map.h"
#include "tok/tokenizer.h"
#include "tok/vocab.h"

static di_tokenizer *g_tok;
static int32_t *g_map;
static int32_t g_n_map, g_n_keys;

static int32_t id_of(const char *s) {
    return di_vocab_find(di_tokenizer_vocab(g_tok), s, strlen(s));
}

// Fixture: gzip of int32 LE n_ids, n_keys, then per id -1 (a new key) or the earlier key's id.
static void test_matches_reference(void) {
    char path[4096];
    gzFile f =
        gzopen(test_src_path("tests/data/tok/engram_map_v4.bin.gz", path, sizeof path), "rb");
    CHECK(f != NULL);
    if (!f) return;
    int32_t hdr[2];
    CHECK_EQ(gzread(f, hdr, sizeof hdr), (int)sizeof hdr);
    int32_t n = hdr[0], n_keys = hdr[1];
    CHECK_EQ(n, g_n_map);
    CHECK_EQ(n_keys, g_n_keys);
    int32_t *ref = di_malloc(sizeof(int32_t) * (size_t)n);
    CHECK(ref != NULL);
    CHECK_EQ(gzread(f, ref, (unsigned)(sizeof(int32_t) * (size_t)n)),
             (int)(sizeof(int32_t) * (size_t)n));
    gzclose(f);
    int32_t seen = 0, equal = 0, shown = 0;
    for (int32_t i = 0; i < n; i++) {
        int32_t r = ref[i] < 0 ? seen++ : ref[i];
        if (i < g_n_map && g_map[i] == r) {
            equal++;
        } else if (shown++ < 10) {
            fprintf(stderr, "  id %d: C %d, reference %d\n", i, i < g_n_map ? g_map[i] : -1, r);
        }
    }
    CHECK_EQ(seen, n_keys);
    CHECK_EQ(equal, n);
    fprintf(stderr, "engram map: %d/%d ids equal, %d compressed ids (reference %d)\n", equal, n,
            g_n_keys, n_keys);
    di_free(ref);
}

// Case, accents and surrounding spaces collapse; a lone space and distinct words do not.
static void test_hand_cases(void) {
    int32_t the = id_of("the"), sp_the = id_of(" the"), The = id_of("The"), sp_The = id_of(" The");
    CHECK(the >= 0 && sp_the >= 0 && The >= 0 && sp_The >= 0);
    if (the < 0 || sp_the < 0 || The < 0 || sp_The < 0) return;
    CHECK_EQ(g_map[the], g_map[sp_the]);
    CHECK_EQ(g_map[the], g_map[The]);
    CHECK_EQ(g_map[the], g_map[sp_The]);
    int32_t sp = id_of(" "), a = id_of("a");
    CHECK(sp >= 0 && a >= 0);
    if (sp >= 0 && a >= 0) CHECK(g_map[sp] != g_map[a] && g_map[sp] != g_map[the]);
    for (int32_t i = 0; i < g_n_map; i++) CHECK(g_map[i] >= 0 && g_map[i] < g_n_keys);
}

static void test_invalid(void) {
    int32_t *m = NULL, n = 0, k = 0;
    CHECK_EQ(di_engram_map_build(NULL, &m, &n, &k), DI_ERR_INVALID);
    CHECK_EQ(di_engram_map_build(g_tok, NULL, &n, &k), DI_ERR_INVALID);
}

int main(void) {
    if (di_tokenizer_load_for_model(NULL, &g_tok) != DI_OK) {
        fprintf(stderr, "cannot load the default tokenizer\n");
        return 1;
    }
    if (di_engram_map_build(g_tok, &g_map, &g_n_map, &g_n_keys) != DI_OK) {
        fprintf(stderr, "di_engram_map_build failed\n");
        return 1;
    }
    RUN(test_matches_reference);
    RUN(test_hand_cases);
    RUN(test_invalid);
    di_free(g_map);
    di_tokenizer_destroy(g_tok);
    return test_finish();
}
