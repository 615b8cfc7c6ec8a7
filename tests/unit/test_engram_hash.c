// Engram n-gram hashing (spec deepseek-v41.md §2.3.1) against the known answers of App. A.1
// (released Flash constants) and App. A.2 (tiny config: primes, multipliers and row ids).
#include "harness.h"

#include "base/json.h"
#include "model/engram_hash.h"

static di_hparams flash_hp(void) {
    di_hparams hp;
    memset(&hp, 0, sizeof hp);
    hp.n_vocab = 129280;
    hp.n_engram = 2;
    hp.engram_layer[0] = 1, hp.engram_layer[1] = 14;
    hp.engram_rows[0] = 384006168, hp.engram_rows[1] = 384016682;
    hp.engram_vocab = 16000000;
    hp.engram_cvocab = 99092;
    hp.engram_max_ngram = 4;
    hp.engram_n_head = 8;
    hp.engram_head_dim = 256;
    hp.engram_pad_id = 2;
    return hp;
}

static void test_flash_constants(void) {
    di_hparams hp = flash_hp();
    di_engram_hash h;
    CHECK(di_engram_hash_init(&h, &hp) == DI_OK);
    CHECK_EQ(h.bound, 46539438283891ll);
    const int64_t p0[24] = {16000057, 16000079, 16000081, 16000097, 16000121, 16000129,
                            16000133, 16000183, 16000189, 16000207, 16000211, 16000253,
                            16000277, 16000289, 16000307, 16000321, 16000339, 16000381,
                            16000393, 16000399, 16000403, 16000409, 16000447, 16000463};
    const int64_t p1[24] = {16000477, 16000487, 16000499, 16000507, 16000511, 16000573,
                            16000609, 16000627, 16000667, 16000669, 16000693, 16000697,
                            16000711, 16000729, 16000759, 16000769, 16000781, 16000799,
                            16000813, 16000819, 16000841, 16000877, 16000879, 16000889};
    for (int c = 0; c < 24; c++) {
        CHECK_EQ(h.prime[0][c], p0[c]);
        CHECK_EQ(h.prime[1][c], p1[c]);
    }
    CHECK_EQ(h.offset[0][1], 16000057);
    CHECK_EQ(h.offset[0][2], 32000136);
    CHECK_EQ(h.offset[0][23], 368005705);
    CHECK_EQ(h.offset[1][1], 16000477);
    CHECK_EQ(h.offset[1][2], 32000964);
    CHECK_EQ(h.offset[1][23], 368015793);
    const int64_t m0[4] = {76632096046245, 4839876093313, 35959672319349, 73987337458391};
    const int64_t m1[4] = {67716810739261, 51510806800915, 30921347202721, 82619226485591};
    for (int k = 0; k < 4; k++) {
        CHECK_EQ(h.mult[0][k], m0[k]);
        CHECK_EQ(h.mult[1][k], m1[k]);
    }
    // A wrong row count is refused.
    hp.engram_rows[1]++;
    CHECK(di_engram_hash_init(&h, &hp) == DI_ERR_FORMAT);
}

static void test_tiny_rows(void) {
    di_hparams hp;
    memset(&hp, 0, sizeof hp);
    hp.n_vocab = 512;
    hp.n_engram = 2;
    hp.engram_layer[0] = 0, hp.engram_layer[1] = 1;
    hp.engram_rows[0] = 660, hp.engram_rows[1] = 864;
    hp.engram_vocab = 100;
    hp.engram_cvocab = 256;
    hp.engram_max_ngram = 4;
    hp.engram_n_head = 2;
    hp.engram_head_dim = 32;
    hp.engram_pad_id = 2;
    di_engram_hash h;
    CHECK(di_engram_hash_init(&h, &hp) == DI_OK);
    CHECK_EQ(h.bound, 18014398509481983ll);
    const int64_t pr[2][6] = {{101, 103, 107, 109, 113, 127}, {131, 137, 139, 149, 151, 157}};
    const int64_t mu[2][4] = {
        {22948963341361471, 9720090748611819, 1476226777048821, 595470825660793},
        {29662608052400909, 1873410163432121, 13919202536988139, 28638879857136817}};
    for (int L = 0; L < 2; L++) {
        for (int c = 0; c < 6; c++) CHECK_EQ(h.prime[L][c], pr[L][c]);
        for (int k = 0; k < 4; k++) CHECK_EQ(h.mult[L][k], mu[L][k]);
    }
    // Tokens [10, 14, 18, 22, 3] -> cmap = id div 2 -> [5, 7, 9, 11, 1]; pad = cmap[2] = 1.
    const int32_t c[5] = {5, 7, 9, 11, 1};
    const int32_t pad = 1;
    struct {
        int L, pos;
        int64_t rows[6];
    } want[6] = {
        {0, 0, {43, 135, 218, 388, 510, 582}}, {0, 3, {75, 182, 302, 347, 473, 640}},
        {0, 4, {22, 152, 297, 316, 532, 643}}, {1, 0, {102, 260, 371, 416, 559, 859}},
        {1, 3, {24, 214, 280, 459, 648, 821}}, {1, 4, {7, 249, 294, 529, 587, 829}},
    };
    for (int i = 0; i < 6; i++) {
        int32_t look[4];
        for (int k = 0; k < 4; k++)
            look[k] = want[i].pos - k >= 0 ? c[want[i].pos - k] : DI_ENGRAM_DEAD;
        int64_t rows[6];
        di_engram_hash_rows(&h, want[i].L, look, pad, rows);
        for (int j = 0; j < 6; j++) CHECK_EQ(rows[j], want[i].rows[j]);
    }
    // Position 2 DEAD: position 3 sees 11, then padding for every longer look-back.
    int32_t look[4] = {11, DI_ENGRAM_DEAD, 7, 5};
    const int64_t dead[6] = {52, 121, 283, 402, 448, 545};
    int64_t rows[6];
    di_engram_hash_rows(&h, 0, look, pad, rows);
    for (int j = 0; j < 6; j++) CHECK_EQ(rows[j], dead[j]);
}

// Every case of tests/data/fixtures/v41_engram/engram_kat.json (row ids computed by R-HF's
// DeepseekV41NgramHashState, with DEAD positions) for the tiny and the released configs.
static void test_rhf_known_answers(void) {
    json_t *j = NULL;
    if (di_json_load_file("tests/data/fixtures/v41_engram/engram_kat.json", &j) != DI_OK) {
        fprintf(stderr, "no engram_kat.json: skipped\n");
        return;
    }
    const char *sets[2] = {"tiny", "flash"};
    int n_cases = 0;
    for (int si = 0; si < 2; si++) {
        const json_t *set = json_object_get(j, sets[si]), *cfg = json_object_get(set, "config");
        CHECK(set && cfg);
        if (!set || !cfg) continue;
        di_hparams hp;
        memset(&hp, 0, sizeof hp);
        hp.n_vocab = 1 << 20;
        const json_t *ids = json_object_get(cfg, "engram_layer_ids");
        const json_t *rows = json_object_get(cfg, "engram_num_embeddings");
        hp.n_engram = (int32_t)json_array_size(ids);
        for (int L = 0; L < hp.n_engram; L++) {
            hp.engram_layer[L] = (int32_t)json_integer_value(json_array_get(ids, (size_t)L));
            hp.engram_rows[L] = json_integer_value(json_array_get(rows, (size_t)L));
        }
        int64_t v;
        di_json_get_int(cfg, "engram_vocab_size", &v), hp.engram_vocab = v;
        di_json_get_int(cfg, "engram_compressed_vocab_size", &v), hp.engram_cvocab = v;
        di_json_get_int(cfg, "engram_max_ngram_size", &v), hp.engram_max_ngram = (int32_t)v;
        di_json_get_int(cfg, "engram_n_heads", &v), hp.engram_n_head = (int32_t)v;
        hp.engram_head_dim = 32;
        di_engram_hash h;
        CHECK(di_engram_hash_init(&h, &hp) == DI_OK);
        int64_t pad = 0;
        di_json_get_int(set, "pad_compressed_id", &pad);
        const bool div2 = strcmp(sets[si], "tiny") == 0; // cmap id div 2, else identity
        const json_t *cases = json_object_get(set, "cases");
        for (size_t ci = 0; ci < json_array_size(cases); ci++) {
            const json_t *cs = json_array_get(cases, ci);
            const json_t *tok = json_object_get(cs, "token_ids"),
                         *dead = json_object_get(cs, "dead");
            const json_t *want = json_object_get(cs, "row_ids");
            int64_t T = (int64_t)json_array_size(tok);
            int bad = 0;
            for (int64_t t = 0; t < T; t++) {
                int32_t look[8];
                for (int k = 0; k < h.max_ngram; k++) {
                    int64_t p = t - k;
                    bool is_dead = p < 0 || (json_is_array(dead) &&
                                             json_is_true(json_array_get(dead, (size_t)p)));
                    int64_t id = p >= 0 ? json_integer_value(json_array_get(tok, (size_t)p)) : 0;
                    look[k] = is_dead ? DI_ENGRAM_DEAD : (int32_t)(div2 ? id / 2 : id);
                }
                for (int L = 0; L < h.n_layer; L++) {
                    int64_t r[DI_ENGRAM_MAX_COLS];
                    di_engram_hash_rows(&h, L, look, (int32_t)pad, r);
                    const json_t *w = json_array_get(json_array_get(want, (size_t)t), (size_t)L);
                    for (int c = 0; c < h.n_col; c++)
                        bad += r[c] != json_integer_value(json_array_get(w, (size_t)c));
                }
            }
            CHECK_EQ(bad, 0);
            n_cases++;
        }
    }
    CHECK(n_cases >= 2);
    fprintf(stderr, "  %d R-HF hash cases\n", n_cases);
    json_decref(j);
}

int main(void) {
    RUN(test_flash_constants);
    RUN(test_tiny_rows);
    RUN(test_rhf_known_answers);
    return test_finish();
}
