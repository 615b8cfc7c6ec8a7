// DeepSeek V4.1 on the spec's tiny random-weight model (deepseek-v41.md §7.2, written by
// di_synth_v41_write) in both layouts: loading, strict refusal of broken checkpoints, streaming
// self-consistency (chunked prefill split inside a ratio-2 group, token by token, multi-token
// verify; a verify's rows bit for bit those of one-token calls), rollback of rejected tokens
// (state equal to a run that never saw them), save/restore,
// and the DSpark draft. The reference comparisons live in tests/model/test_v41_fixtures.c.
#include "harness.h"

#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "base/mem.h"
#include "io/safetensors.h"
#include "kv/kv_manager.h" // di_kv_block_tokens, di_kv_v41_block_bytes
#include "model/dsv41.h"
#include "model/hparams.h" // di_hparams_load
#include "model/synth.h"
#include "tok/engram_map.h"
#include "tok/tokenizer.h"
#include "tensor/quant_ref.h"

// Same kernels on the same rows: only the attention's key source (ring vs this call's rows) and
// the per-call batching of matmuls differ, so chunked == one call to FP32 rounding.
#define TOL_CHUNK 1e-5

static char g_root[256];

static di_model *load(const char *dir, di_precision prec) {
    di_model_options o = di_model_options_default();
    o.n_threads = 2;
    o.precision = prec;
    di_model *m = NULL;
    if (di_model_load(dir, &o, &m) != DI_OK) return NULL;
    return m;
}

// Feeds ids in the given chunks into a new session; logits of every position [T, V].
static di_session *run(di_model *m, bool mtp, const int32_t *ids, int32_t T, const int32_t *chunks,
                       int n_chunks, float *logits) {
    di_session_options so = di_session_options_default();
    so.mtp = mtp;
    di_session *s = NULL;
    if (di_session_create(m, &so, &s) != DI_OK) return NULL;
    int32_t done = 0;
    for (int c = 0; done < T; c = c + 1 < n_chunks ? c + 1 : c) {
        int32_t n = chunks[c] < T - done ? chunks[c] : T - done;
        di_forward_out fo = {.logits = logits + (int64_t)done * m->hp.n_vocab};
        if (di_session_forward(s, ids + done, n, &fo) != DI_OK) {
            di_session_destroy(s);
            return NULL;
        }
        done += n;
    }
    return s;
}

static void make_ids(int32_t *ids, int32_t T, uint32_t seed) {
    for (int32_t t = 0; t < T; t++) {
        seed = seed * 1664525u + 1013904223u;
        ids[t] = (int32_t)((seed >> 8) % 512);
    }
}

static void check_streaming(const char *dir, di_precision prec, const char *what) {
    di_model *m = load(dir, prec);
    CHECK(m != NULL);
    if (!m) return;
    enum { T = 48 };
    const int64_t V = m->hp.n_vocab;
    int32_t ids[T];
    make_ids(ids, T, 7);
    float *ref = malloc(sizeof(float) * T * V), *got = malloc(sizeof(float) * T * V);
    int32_t one[1] = {T}, split[3] = {7, 6, 13}, tok[1] = {1};
    di_session *s = run(m, false, ids, T, one, 1, ref);
    CHECK(s != NULL);
    bool finite = true;
    for (int64_t i = 0; i < T * V; i++) finite &= isfinite(ref[i]) != 0;
    CHECK(finite);
    di_session_destroy(s);
    s = run(m, false, ids, T, split, 3, got);
    double e_chunk = test_rel_err(got, ref, T * V);
    di_session_destroy(s);
    s = run(m, false, ids, T, tok, 1, got);
    double e_tok = test_rel_err(got, ref, T * V);
    di_session_destroy(s);
    fprintf(stderr, "  %s: chunked 7+6+13.. %.3g, token by token %.3g\n", what, e_chunk, e_tok);
    CHECK(e_chunk <= TOL_CHUNK);
    CHECK(e_tok <= TOL_CHUNK);
    // The logits depend on the tokens (a broken state would make later positions ignore them).
    int32_t ids2[T];
    memcpy(ids2, ids, sizeof ids);
    ids2[3] = (ids2[3] + 1) % 512;
    s = run(m, false, ids2, T, one, 1, got);
    CHECK(test_rel_err(got + (T - 1) * V, ref + (T - 1) * V, V) > 1e-3);
    di_session_destroy(s);
    free(ref);
    free(got);
    di_model_destroy(m);
}

// Verify k tokens, reject the last j, continue: equal to a run that only saw the accepted ones.
static void check_rollback(const char *dir) {
    di_model *m = load(dir, DI_PRECISION_FP32);
    CHECK(m != NULL);
    if (!m) return;
    enum { T = 40 };
    const int64_t V = m->hp.n_vocab;
    int32_t ids[T], junk[8];
    make_ids(ids, T, 11);
    make_ids(junk, 8, 99);
    float *ref = malloc(sizeof(float) * T * V), *got = malloc(sizeof(float) * T * V);
    float *tmp = malloc(sizeof(float) * 8 * V);
    int32_t one[1] = {T};
    di_session *s = run(m, false, ids, T, one, 1, ref);
    di_session_destroy(s);
    // Prefixes ending at odd and even positions, so rollback lands inside and between groups.
    const int32_t cuts[3][3] = {{21, 5, 3}, {20, 6, 6}, {17, 4, 1}}; // prefix, verify k, reject j
    for (int ci = 0; ci < 3; ci++) {
        int32_t pre = cuts[ci][0], k = cuts[ci][1], j = cuts[ci][2];
        int32_t chunk[1] = {pre};
        s = run(m, false, ids, pre, chunk, 1, got);
        CHECK(s != NULL);
        if (!s) continue;
        // Verify: the accepted tokens are the real continuation, the rejected ones junk.
        int32_t ver[8];
        for (int32_t i = 0; i < k; i++) ver[i] = i < k - j ? ids[pre + i] : junk[i];
        di_forward_out fo = {.logits = tmp};
        CHECK(di_session_forward(s, ver, k, &fo) == DI_OK);
        // Accepted rows equal the reference already.
        CHECK(test_rel_err(tmp, ref + (int64_t)pre * V, (int64_t)(k - j) * V) <= TOL_CHUNK);
        CHECK(di_dsv41_rollback(s, j) == DI_OK);
        CHECK_EQ(di_session_n_past(s), pre + k - j);
        int32_t rest = T - (pre + k - j);
        fo.logits = got + (int64_t)(pre + k - j) * V;
        CHECK(di_session_forward(s, ids + pre + k - j, rest, &fo) == DI_OK);
        double e = test_rel_err(got + (int64_t)(pre + k - j) * V, ref + (int64_t)(pre + k - j) * V,
                                (int64_t)rest * V);
        fprintf(stderr, "  rollback prefix %d verify %d reject %d: continuation %.3g\n", pre, k, j,
                e);
        CHECK(e <= TOL_CHUNK);
        di_session_destroy(s);
    }
    // Successive rollbacks: the bound counts from the highest position fed (37 here). 16 junk
    // rows taken back, one real token fed and 4 more taken back would return to 18, 19 below it:
    // the window ring (W + 16 rows) lost position 18 - W + 1's row, which position 18 reads, to
    // the junk rows (this was accepted and gave other logits); 2 back is 17 below, refused too;
    // 1 back is 16 below, the edge: exact.
    {
        enum { P = 21 };
        int32_t chunk[1] = {P}, junk16[DI_DSV41_ROLLBACK_MAX];
        make_ids(junk16, DI_DSV41_ROLLBACK_MAX, 7);
        s = run(m, false, ids, P, chunk, 1, got);
        CHECK(s != NULL);
        di_forward_out fo = {.logits = tmp, .last_only = true};
        CHECK(s && di_session_forward(s, junk16, DI_DSV41_ROLLBACK_MAX, &fo) == DI_OK);
        CHECK(s && di_session_rollback(s, DI_DSV41_ROLLBACK_MAX) == DI_OK);
        CHECK(s && di_session_forward(s, ids + P, 1, &fo) == DI_OK);
        CHECK(s && di_session_rollback(s, 4) == DI_ERR_INVALID);
        CHECK(s && di_session_rollback(s, 2) == DI_ERR_INVALID);
        CHECK_EQ(s ? di_session_n_past(s) : -1, P + 1);
        CHECK(s && di_session_rollback(s, 1) == DI_OK);
        fo = (di_forward_out){.logits = got + (int64_t)P * V};
        CHECK(s && di_session_forward(s, ids + P, T - P, &fo) == DI_OK);
        double e = test_rel_err(got + (int64_t)P * V, ref + (int64_t)P * V, (int64_t)(T - P) * V);
        fprintf(stderr, "  successive rollbacks (16, 1 fed, 1) at %d: continuation %.3g\n", P, e);
        CHECK(e <= TOL_CHUNK);
        di_session_destroy(s);
    }
    // Limits.
    s = run(m, false, ids, 4, one, 1, got);
    CHECK(di_dsv41_rollback(s, 5) == DI_ERR_INVALID);
    CHECK(di_dsv41_rollback(s, -1) == DI_ERR_INVALID);
    CHECK_EQ(di_session_n_past(s), 4);
    di_session_destroy(s);
    free(ref);
    free(got);
    free(tmp);
    di_model_destroy(m);
}

static void check_save_restore(const char *dir) {
    di_model *m = load(dir, DI_PRECISION_FP32);
    CHECK(m != NULL);
    if (!m) return;
    enum { T = 36, CUT = 19 };
    const int64_t V = m->hp.n_vocab;
    int32_t ids[T];
    make_ids(ids, T, 5);
    float *ref = malloc(sizeof(float) * T * V), *got = malloc(sizeof(float) * T * V);
    int32_t one[1] = {T}, cut[1] = {CUT};
    di_session *s = run(m, false, ids, T, one, 1, ref);
    di_session_destroy(s);
    s = run(m, false, ids, CUT, cut, 1, got);
    void *bytes = NULL;
    size_t n = 0;
    CHECK(di_session_save(s, &bytes, &n) == DI_OK);
    di_session_destroy(s);
    di_session *r = NULL;
    CHECK(di_session_create(m, NULL, &r) == DI_OK);
    CHECK(di_session_restore(r, bytes, n) == DI_OK);
    CHECK_EQ(di_session_n_past(r), CUT);
    di_forward_out fo = {.logits = got + (int64_t)CUT * V};
    CHECK(di_session_forward(r, ids + CUT, T - CUT, &fo) == DI_OK);
    CHECK(test_rel_err(got + CUT * V, ref + CUT * V, (T - CUT) * V) <= TOL_CHUNK);
    // Corrupted or truncated bytes are refused and leave the session reset.
    ((unsigned char *)bytes)[n / 2] ^= 1;
    CHECK(di_session_restore(r, bytes, n) == DI_ERR_FORMAT);
    CHECK_EQ(di_session_n_past(r), 0);
    CHECK(di_session_restore(r, bytes, n - 9) == DI_ERR_FORMAT);
    di_free_buffer(bytes);
    di_session_destroy(r);
    free(ref);
    free(got);
    di_model_destroy(m);
}

// DSpark: drafts come out deterministic, in range, with confidences in (0, 1); the draft does not
// disturb the target state; a draft after a rollback equals one from a run that never saw the
// rejected tokens.
static void check_dspark(const char *dir) {
    di_model *m = load(dir, DI_PRECISION_FP32);
    CHECK(m != NULL);
    if (!m) return;
    CHECK_EQ(m->n_mtp_loaded, 1);
    enum { T = 30 };
    const int64_t V = m->hp.n_vocab;
    int32_t ids[T], one[1] = {T};
    make_ids(ids, T, 3);
    float *lg = malloc(sizeof(float) * (T + 1) * V), *dl = malloc(sizeof(float) * 4 * V);
    di_session *s = run(m, true, ids, T, one, 1, lg);
    di_dsv41_draft d1, d2;
    CHECK(di_dsv41_draft_block(s, 17, &d1, dl) == DI_OK);
    CHECK_EQ(d1.n, 2);
    for (int j = 0; j < d1.n; j++) {
        CHECK(d1.tokens[j] >= 0 && d1.tokens[j] < V);
        CHECK(d1.confidence[j] > 0 && d1.confidence[j] < 1);
    }
    CHECK(di_dsv41_draft_block(s, 17, &d2, NULL) == DI_OK);
    CHECK(memcmp(&d1, &d2, sizeof d1) == 0);
    // Verify 3 tokens, reject 2, draft: equals the draft of a session fed only the kept token.
    int32_t ver[3] = {17, 4, 9};
    di_forward_out fo = {.logits = lg};
    CHECK(di_session_forward(s, ver, 3, &fo) == DI_OK);
    CHECK(di_dsv41_rollback(s, 2) == DI_OK);
    CHECK(di_dsv41_draft_block(s, 23, &d1, NULL) == DI_OK);
    di_session_destroy(s);
    int32_t ids2[T + 1];
    memcpy(ids2, ids, sizeof ids);
    ids2[T] = 17;
    int32_t one2[1] = {T + 1};
    s = run(m, true, ids2, T + 1, one2, 1, lg);
    CHECK(di_dsv41_draft_block(s, 23, &d2, NULL) == DI_OK);
    CHECK(memcmp(d1.tokens, d2.tokens, sizeof d1.tokens) == 0);
    CHECK(fabsf(d1.conf_logit[0] - d2.conf_logit[0]) <= 1e-4f * (1 + fabsf(d2.conf_logit[0])));
    di_session_destroy(s);
    // Without DSpark the draft is refused.
    s = run(m, false, ids, T, one, 1, lg);
    CHECK(di_dsv41_draft_block(s, 17, &d1, NULL) == DI_ERR_INVALID);
    di_session_destroy(s);
    free(lg);
    free(dl);
    di_model_destroy(m);
}

// ---- broken checkpoints ----

static void copy_file(const char *from, const char *to) {
    FILE *a = fopen(from, "rb"), *b = fopen(to, "wb");
    char buf[65536];
    size_t n;
    while (a && b && (n = fread(buf, 1, sizeof buf, a)) > 0) fwrite(buf, 1, n, b);
    if (a) fclose(a);
    if (b) fclose(b);
}

typedef enum mutation { MUT_DROP, MUT_EXTRA, MUT_SHAPE } mutation;

static di_status mutated_load(const char *base, const char *tag, mutation mu, const char *name) {
    char dir[512], path[1024], to[1024];
    snprintf(dir, sizeof dir, "%s/%s", g_root, tag);
    mkdir(dir, 0755);
    snprintf(path, sizeof path, "%s/model.safetensors", base);
    di_st_file *f = NULL;
    if (di_st_file_open(path, &f) != DI_OK) return DI_ERR_IO;
    int64_t n = di_st_file_n_tensors(f), k = 0;
    di_st_write_tensor *t = calloc((size_t)n + 1, sizeof *t);
    bool found = mu == MUT_EXTRA;
    for (int64_t i = 0; i < n; i++) {
        const di_st_tensor *s = di_st_file_tensor(f, i);
        bool hit = name && strcmp(s->name, name) == 0;
        found |= hit;
        if (hit && mu == MUT_DROP) continue;
        di_st_write_tensor w = {
            .name = s->name, .dtype = s->dtype, .n_dims = s->n_dims, .data = s->data};
        memcpy(w.shape, s->shape, sizeof w.shape);
        if (hit && mu == MUT_SHAPE) {
            if (s->n_dims >= 2)
                w.n_dims = 1, w.shape[0] = s->n_elements;
            else
                w.n_dims = 2, w.shape[0] = s->shape[0] / 2, w.shape[1] = 2;
        }
        t[k++] = w;
    }
    CHECK(found);
    static const float extra[4] = {1, 2, 3, 4};
    if (mu == MUT_EXTRA)
        t[k++] = (di_st_write_tensor){
            .name = "layers.2.attn.indexer.wk.weight", // an index key owner only on kv sources
            .dtype = DI_DTYPE_F32,
            .n_dims = 2,
            .shape = {2, 2},
            .data = extra};
    snprintf(to, sizeof to, "%s/model.safetensors", dir);
    CHECK(di_st_write_file(to, t, k) == DI_OK);
    free(t);
    di_st_file_close(f);
    const char *files[2] = {"config.json", "engram/token_map.safetensors"};
    snprintf(to, sizeof to, "%s/engram", dir);
    mkdir(to, 0755);
    for (int i = 0; i < 2; i++) {
        snprintf(path, sizeof path, "%s/%s", base, files[i]);
        snprintf(to, sizeof to, "%s/%s", dir, files[i]);
        copy_file(path, to);
    }
    di_model *m = NULL;
    di_model_options o = di_model_options_default();
    o.n_threads = 1;
    di_status st = di_model_load(dir, &o, &m);
    di_model_destroy(m);
    return st;
}

static void check_refusals(const char *off, const char *hf) {
    CHECK_EQ(mutated_load(off, "drop_wgate", MUT_DROP, "layers.1.attn.compressor.wgate.weight"),
             DI_ERR_FORMAT);
    CHECK_EQ(mutated_load(off, "drop_scale", MUT_DROP, "layers.3.attn.indexer.wq_b.scale"),
             DI_ERR_FORMAT);
    CHECK_EQ(mutated_load(off, "drop_engram", MUT_DROP, "layers.1.engram.embed.scale"),
             DI_ERR_FORMAT);
    CHECK_EQ(mutated_load(off, "drop_markov", MUT_DROP, "mtp.0.markov_head.head.weight"),
             DI_ERR_FORMAT);
    CHECK_EQ(mutated_load(off, "extra", MUT_EXTRA, NULL), DI_ERR_FORMAT);
    CHECK_EQ(mutated_load(hf, "shape_kidx", MUT_SHAPE, "layers.3.attn.indexer.wk.weight"),
             DI_ERR_FORMAT);
    CHECK_EQ(mutated_load(hf, "shape_table", MUT_SHAPE, "layers.0.engram.embed.weight"),
             DI_ERR_FORMAT);
    CHECK_EQ(mutated_load(hf, "drop_kn", MUT_DROP, "layers.1.attn.indexer.k_norm.weight"),
             DI_ERR_FORMAT);
    // No token map: refused with an I/O error naming the file.
    char dir[512], path[1024], to[1024];
    snprintf(dir, sizeof dir, "%s/nomap", g_root);
    mkdir(dir, 0755);
    const char *files[2] = {"config.json", "model.safetensors"};
    for (int i = 0; i < 2; i++) {
        snprintf(path, sizeof path, "%s/%s", hf, files[i]);
        snprintf(to, sizeof to, "%s/%s", dir, files[i]);
        copy_file(path, to);
    }
    di_model *m = NULL;
    CHECK_EQ(di_model_load(dir, NULL, &m), DI_OK); // loads (deepinfer info works) ...
    di_session *s = NULL;
    CHECK_EQ(di_session_create(m, NULL, &s), DI_ERR_INVALID); // ... but cannot run
    CHECK(s == NULL);
    di_model_destroy(m);
    // The serving engine runs V4.1 on sessions (tests/unit/test_engine_v41.c): without the token
    // map it is refused as the session is, not crashed on; with it, it starts.
    di_engine_options eo = di_engine_options_default();
    eo.n_threads = 1;
    eo.max_seqs = 2;
    eo.max_ctx = 256;
    di_engine *e = NULL;
    CHECK_EQ(di_engine_create(dir, &eo, &e), DI_ERR_INVALID);
    CHECK(e == NULL);
    CHECK_EQ(di_engine_create(hf, &eo, &e), DI_OK);
    di_engine_destroy(e);
}

// ---- the compressed token map made from tokenizer.json (no engram/token_map.safetensors) ----

// Copies hf's config.json (compressed size replaced by cvocab when > 0), model.safetensors and
// the committed V4 tokenizer.json into g_root/tag, then loads it.
static di_status load_with_tokenizer(const char *hf, const char *tag, int32_t cvocab,
                                     di_model **m) {
    char dir[512], path[1024], to[1024];
    snprintf(dir, sizeof dir, "%s/%s", g_root, tag);
    mkdir(dir, 0755);
    snprintf(path, sizeof path, "%s/model.safetensors", hf);
    snprintf(to, sizeof to, "%s/model.safetensors", dir);
    copy_file(path, to);
    snprintf(to, sizeof to, "%s/tokenizer.json", dir);
    copy_file(test_src_path(DI_TOKENIZER_DEFAULT_REL, path, sizeof path), to);
    snprintf(path, sizeof path, "%s/config.json", hf);
    FILE *f = fopen(path, "rb");
    static char cfg[1 << 16], out[1 << 16];
    size_t n = f ? fread(cfg, 1, sizeof cfg - 1, f) : 0;
    if (f) fclose(f);
    cfg[n] = 0;
    const char *key = "\"engram_compressed_vocab_size\": 256";
    char *at = strstr(cfg, key);
    CHECK(at != NULL);
    if (at && cvocab > 0) {
        snprintf(out, sizeof out, "%.*s\"engram_compressed_vocab_size\": %d%s", (int)(at - cfg),
                 cfg, cvocab, at + strlen(key));
    } else {
        memcpy(out, cfg, n + 1);
    }
    snprintf(to, sizeof to, "%s/config.json", dir);
    f = fopen(to, "wb");
    if (f) {
        fputs(out, f);
        fclose(f);
    }
    di_model_options o = di_model_options_default();
    o.n_threads = 1;
    return di_model_load(dir, &o, m);
}

static void check_map_from_tokenizer(const char *hf) {
    // The synthetic config's compressed size (256) is not the tokenizer's: refused, clearly.
    di_model *m = NULL;
    CHECK_EQ(load_with_tokenizer(hf, "tok_wrong", 0, &m), DI_ERR_FORMAT);
    CHECK(m == NULL);
    di_model_destroy(m);
    // With the tokenizer's size the map is built at load and sessions run.
    di_tokenizer *tok = NULL;
    int32_t *want = NULL, n_want = 0, n_keys = 0;
    CHECK(di_tokenizer_load_for_model(NULL, &tok) == DI_OK);
    CHECK(tok && di_engram_map_build(tok, &want, &n_want, &n_keys) == DI_OK);
    di_tokenizer_destroy(tok);
    CHECK_EQ(load_with_tokenizer(hf, "tok_ok", n_keys, &m), DI_OK);
    if (m && want) {
        CHECK(m->v41->cmap != NULL);
        CHECK_EQ(m->v41->n_cmap, n_want);
        if (m->v41->cmap) CHECK(memcmp(m->v41->cmap, want, sizeof(int32_t) * (size_t)n_want) == 0);
        di_session *s = NULL;
        CHECK_EQ(di_session_create(m, NULL, &s), DI_OK);
        if (s) {
            int32_t ids[4] = {3, 17, 200, 5};
            float *lg = malloc(sizeof(float) * 512);
            di_forward_out fo = {.logits = lg, .last_only = true};
            CHECK_EQ(di_session_forward(s, ids, 4, &fo), DI_OK);
            free(lg);
        }
        di_session_destroy(s);
    }
    di_model_destroy(m);
    di_free(want);
}

// ---- R-HF runtime names (spec §6.4) ----

static const char *const k_rename[][2] = {
    {"attn_norm.weight", "input_layernorm.weight"},
    {"ffn_norm.weight", "post_attention_layernorm.weight"},
    {"hc_attn_fn", "attn_hc.fn"},
    {"hc_attn_base", "attn_hc.base"},
    {"hc_attn_scale", "attn_hc.scale"},
    {"hc_ffn_fn", "ffn_hc.fn"},
    {"hc_ffn_base", "ffn_hc.base"},
    {"hc_ffn_scale", "ffn_hc.scale"},
    {"attn.wq_a.weight", "self_attn.q_a_proj.weight"},
    {"attn.q_norm.weight", "self_attn.q_a_norm.weight"},
    {"attn.wq_b.weight", "self_attn.q_b_proj.weight"},
    {"attn.wkv.weight", "self_attn.kv_proj.weight"},
    {"attn.kv_norm.weight", "self_attn.kv_norm.weight"},
    {"attn.wo_a.weight", "self_attn.o_a_proj.weight"},
    {"attn.wo_b.weight", "self_attn.o_b_proj.weight"},
    {"attn.attn_sink", "self_attn.sinks"},
    {"attn.compressor.wkv.weight", "self_attn.compressor.kv_proj.weight"},
    {"attn.compressor.wgate.weight", "self_attn.compressor.gate_proj.weight"},
    {"attn.compressor.norm.weight", "self_attn.compressor.kv_norm.weight"},
    {"attn.indexer.wq_b.weight", "self_attn.indexer.q_b_proj.weight"},
    {"attn.indexer.weights_proj.weight", "self_attn.indexer.weights_proj.weight"},
    {"attn.indexer.wk.weight", "self_attn.indexer.k_proj.weight"},
    {"attn.indexer.k_norm.weight", "self_attn.indexer.k_norm.weight"},
    {"ffn.gate.weight", "mlp.gate.weight"},
    {"ffn.gate.bias", "mlp.gate.e_score_correction_bias"},
    {"ffn.gate.bias_vl", "mlp.gate.e_score_correction_bias_vl"},
    {"ffn.shared_experts.w1.weight", "mlp.shared_experts.gate_proj.weight"},
    {"ffn.shared_experts.w3.weight", "mlp.shared_experts.up_proj.weight"},
    {"ffn.shared_experts.w2.weight", "mlp.shared_experts.down_proj.weight"},
    {"engram.wkv.weight", "engram.wkv.weight"},
    {"engram.q_weight", "engram.q_weight"},
    {"engram.k_weight", "engram.k_weight"},
};

// Rewrites the native-name float checkpoint `from` under transformers' runtime names (fused
// experts, model.engram_tables.* with weight_scale_inv) into `to`: the same model.
// mix: save_pretrained's default output instead (spec §6.4): model.embed_tokens / model.norm /
// model.engram_tables.* / head.weight, and model.layers.N.<native sub-name> for the rest.
static void write_runtime_names(const char *from, const char *to, bool mix) {
    char path[1024];
    snprintf(path, sizeof path, "%s/model.safetensors", from);
    di_st_file *f = NULL;
    CHECK(di_st_file_open(path, &f) == DI_OK);
    if (!f) return;
    int64_t n = di_st_file_n_tensors(f), k = 0;
    di_st_write_tensor *t = calloc((size_t)n + 32, sizeof *t);
    char **names = calloc((size_t)n + 32, sizeof *names);
    void **bufs = calloc(64, sizeof *bufs);
    int n_bufs = 0;
    const int64_t E = 4, F = 128, D = 256;
    for (int64_t i = 0; i < n; i++) {
        const di_st_tensor *s = di_st_file_tensor(f, i);
        di_st_write_tensor w = {.dtype = s->dtype, .n_dims = s->n_dims, .data = s->data};
        memcpy(w.shape, s->shape, sizeof w.shape);
        char *nm = malloc(256);
        int il = -1, e = -1, wi = -1, used = 0;
        char rest[200] = "";
        if (strcmp(s->name, "embed.weight") == 0)
            snprintf(nm, 256, "model.embed_tokens.weight");
        else if (strcmp(s->name, "head.weight") == 0)
            snprintf(nm, 256, mix ? "head.weight" : "lm_head.weight");
        else if (mix && strncmp(s->name, "layers.", 7) == 0 && !strstr(s->name, "engram.embed"))
            snprintf(nm, 256, "model.%s", s->name);
        else if (strcmp(s->name, "norm.weight") == 0)
            snprintf(nm, 256, "model.norm.weight");
        else if (sscanf(s->name, "layers.%d.ffn.experts.%d.w%d.weight%n", &il, &e, &wi, &used) ==
                 3) {
            free(nm);
            if (e != 0) continue; // fused once per layer below, at expert 0's w1
            if (wi != 1) continue;
            // gate_up_proj [E, 2F, D] and down_proj [E, D, F] from every expert of the layer
            float *gu = malloc(sizeof(float) * (size_t)(E * 2 * F * D));
            float *dn = malloc(sizeof(float) * (size_t)(E * D * F));
            for (int64_t x = 0; x < E; x++) {
                char q[128];
                snprintf(q, sizeof q, "layers.%d.ffn.experts.%lld.w1.weight", il, (long long)x);
                memcpy(gu + x * 2 * F * D, di_st_file_find(f, q)->data, sizeof(float) * F * D);
                snprintf(q, sizeof q, "layers.%d.ffn.experts.%lld.w3.weight", il, (long long)x);
                memcpy(gu + x * 2 * F * D + F * D, di_st_file_find(f, q)->data,
                       sizeof(float) * F * D);
                snprintf(q, sizeof q, "layers.%d.ffn.experts.%lld.w2.weight", il, (long long)x);
                memcpy(dn + x * D * F, di_st_file_find(f, q)->data, sizeof(float) * D * F);
            }
            bufs[n_bufs++] = gu, bufs[n_bufs++] = dn;
            char *a = malloc(256), *b = malloc(256);
            snprintf(a, 256, "model.layers.%d.mlp.experts.gate_up_proj", il);
            snprintf(b, 256, "model.layers.%d.mlp.experts.down_proj", il);
            names[k] = a;
            t[k++] = (di_st_write_tensor){
                .name = a, .dtype = DI_DTYPE_F32, .n_dims = 3, .shape = {E, 2 * F, D}, .data = gu};
            names[k] = b;
            t[k++] = (di_st_write_tensor){
                .name = b, .dtype = DI_DTYPE_F32, .n_dims = 3, .shape = {E, D, F}, .data = dn};
            continue;
        } else if (sscanf(s->name, "layers.%d.engram.embed.weight%n", &il, &used) == 1 &&
                   s->name[used] == 0) {
            snprintf(nm, 256, "model.engram_tables.%d.weight", il);
            // R-HF's weight_scale_inv: ones, unused in a float model.
            float *ones = malloc(sizeof(float) * (size_t)(s->shape[0] * (s->shape[1] / 32)));
            for (int64_t x = 0; x < s->shape[0] * (s->shape[1] / 32); x++) ones[x] = 1;
            bufs[n_bufs++] = ones;
            char *sn = malloc(256);
            snprintf(sn, 256, "model.engram_tables.%d.weight_scale_inv", il);
            names[k] = sn;
            t[k++] = (di_st_write_tensor){.name = sn,
                                          .dtype = DI_DTYPE_F32,
                                          .n_dims = 2,
                                          .shape = {s->shape[0], s->shape[1] / 32},
                                          .data = ones};
        } else if (sscanf(s->name, "layers.%d.%199s", &il, rest) == 2) {
            const char *hf = NULL;
            for (size_t r = 0; r < sizeof k_rename / sizeof k_rename[0] && !hf; r++)
                if (strcmp(rest, k_rename[r][0]) == 0) hf = k_rename[r][1];
            CHECK(hf != NULL);
            if (!hf) fprintf(stderr, "no runtime name for %s\n", s->name);
            snprintf(nm, 256, "model.layers.%d.%s", il, hf ? hf : rest);
        } else {
            snprintf(nm, 256, "%s", s->name);
        }
        names[k] = nm;
        w.name = nm;
        t[k++] = w;
    }
    snprintf(path, sizeof path, "%s/model.safetensors", to);
    CHECK(di_st_write_file(path, t, k) == DI_OK);
    char a[1024], b[1024];
    snprintf(a, sizeof a, "%s/config.json", from);
    snprintf(b, sizeof b, "%s/config.json", to);
    copy_file(a, b);
    snprintf(b, sizeof b, "%s/engram", to);
    mkdir(b, 0755);
    snprintf(a, sizeof a, "%s/engram/token_map.safetensors", from);
    snprintf(b, sizeof b, "%s/engram/token_map.safetensors", to);
    copy_file(a, b);
    for (int64_t i = 0; i < k; i++) free(names[i]);
    for (int i = 0; i < n_bufs; i++) free(bufs[i]);
    free(names);
    free(bufs);
    free(t);
    di_st_file_close(f);
}

static void check_runtime_names(const char *hf, bool mix) {
    char rt[512];
    snprintf(rt, sizeof rt, "%s/runtime%d", g_root, (int)mix);
    mkdir(rt, 0755);
    write_runtime_names(hf, rt, mix);
    di_model *a = load(hf, DI_PRECISION_FP32), *b = load(rt, DI_PRECISION_FP32);
    CHECK(a && b);
    if (a && b) {
        enum { T = 20 };
        int32_t ids[T], one[1] = {T};
        make_ids(ids, T, 8);
        float *la = malloc(sizeof(float) * T * 512), *lb = malloc(sizeof(float) * T * 512);
        di_session_destroy(run(a, false, ids, T, one, 1, la));
        di_session_destroy(run(b, false, ids, T, one, 1, lb));
        CHECK(memcmp(la, lb, sizeof(float) * T * 512) == 0);
        free(la);
        free(lb);
    }
    di_model_destroy(a);
    di_model_destroy(b);
}

// ---- rounding points (spec §2.0, §7.3) ----

typedef struct bf16_check {
    int64_t non_bf16, total;
} bf16_check;

static void on_layer_out(void *user, const char *name, int il, const void *data, bool is_int,
                         int64_t n_rows, int64_t row_len) {
    (void)il;
    bf16_check *c = user;
    if (is_int || strcmp(name, "layer_out") != 0) return;
    const float *v = data;
    for (int64_t i = 0; i < n_rows * row_len; i++, c->total++)
        c->non_bf16 += di_round_bf16(v[i]) != v[i];
}

// Values already on a fake-quant grid are fixed points of it.
static int64_t off_grid(const float *v, int64_t n, int64_t block, int kind) {
    float *w = malloc(sizeof(float) * (size_t)n);
    memcpy(w, v, sizeof(float) * (size_t)n);
    if (kind == 0) di_fake_quant_q8(w, n, block);
    if (kind == 1) di_fake_quant_q4(w, n, block);
    if (kind == 2) di_fake_quant_q4e(w, n, block);
    int64_t bad = 0;
    for (int64_t i = 0; i < n; i++) bad += w[i] != v[i];
    free(w);
    return bad;
}

// A packed state row (kind as off_grid's) decoded and checked against its grid.
static int64_t off_grid_packed(const uint8_t *row, int64_t n, int64_t block, int kind) {
    float *v = malloc(sizeof(float) * (size_t)n);
    if (kind == 0) di_quant_q8_unpack(row, n, block, v);
    if (kind == 1) di_quant_q4_unpack(row, n, block, v);
    if (kind == 2) di_quant_q4e_unpack(row, n, block, v);
    int64_t bad = off_grid(v, n, block, kind);
    free(v);
    return bad;
}

static void check_rounding_points(const char *dir) {
    for (int prec = 0; prec < 2; prec++) {
        di_model *m = load(dir, prec ? DI_PRECISION_OFFICIAL : DI_PRECISION_FP32);
        CHECK(m != NULL);
        if (!m) continue;
        enum { T = 40 };
        int32_t ids[T];
        make_ids(ids, T, 21);
        float *lg = malloc(sizeof(float) * T * 512);
        di_session_options so = di_session_options_default();
        di_session *s = NULL;
        CHECK(di_session_create(m, &so, &s) == DI_OK);
        bf16_check bc = {0, 0};
        s->trace = on_layer_out, s->trace_user = &bc;
        di_forward_out fo = {.logits = lg};
        CHECK(di_session_forward(s, ids, T, &fo) == DI_OK);
        // Residual streams: BF16 in official precision only.
        CHECK(bc.total > 0);
        if (prec)
            CHECK_EQ(bc.non_bf16, 0);
        else
            CHECK(bc.non_bf16 > bc.total / 2);
        // KV fake-quant in both precisions (R-HF applies it in FP32 too): window rows Q8 (32-blocks
        // over all dims), entries Q4e (16), index keys Q4 (32), stored packed.
        const di_hparams *hp = &m->hp;
        int64_t bad_ring = 0, bad_e = 0, bad_k = 0;
        for (int il = 0; il < hp->n_layer; il++) {
            for (int32_t r = 0; r < s->v41->ring_rows; r++)
                bad_ring += off_grid_packed(s->v41->ring[il] + (int64_t)r * s->v41->ring_row_bytes,
                                            hp->head_dim, 32, 0);
            if (!hp->kv_source[il]) continue;
            const di_dsv41_src *src = &s->v41->src[il];
            CHECK(src->n_entries > 0);
            for (int64_t w = 0; w < src->n_entries; w++) { // through the session's pages
                bad_e += off_grid_packed(di_dsv41_entry(s->v41, src, w), hp->head_dim, 16, 2);
                bad_k += off_grid_packed(di_dsv41_key(s->v41, src, w), hp->index_head_dim, 32, 1);
            }
        }
        CHECK_EQ(bad_ring, 0);
        CHECK_EQ(bad_e, 0);
        CHECK_EQ(bad_k, 0);
        // Not every value is trivially on the grids (the check can fail): FP32 streams are not.
        float probe[32];
        for (int i = 0; i < 32; i++) probe[i] = 0.1f * (float)i + 0.013f;
        CHECK(off_grid(probe, 32, 32, 0) > 0 && off_grid(probe, 32, 16, 2) > 0);
        free(lg);
        di_session_destroy(s);
        di_model_destroy(m);
    }
}

// Level-2 top-k with a candidate pool smaller than index_topk (UNSEEN-style configs: (candidate
// blocks - 1) * block size + 1 < index_topk). R-HF drops the picks whose score is -inf (outside
// the pool): every pick lies in the pool, the rest is -1. With one candidate block the pool is the
// block of the newest visible entry. (The engine kept min(vis, topk) picks, -inf ones included.)
typedef struct topk_capture {
    int il;
    int32_t *rows; // [T, topk]
    int64_t n_rows, row_len;
} topk_capture;

static void on_topk(void *user, const char *name, int il, const void *data, bool is_int,
                    int64_t n_rows, int64_t row_len) {
    topk_capture *c = user;
    if (!is_int || strcmp(name, "topk") != 0 || il != c->il) return;
    c->rows = malloc(sizeof(int32_t) * (size_t)(n_rows * row_len));
    memcpy(c->rows, data, sizeof(int32_t) * (size_t)(n_rows * row_len));
    c->n_rows = n_rows, c->row_len = row_len;
}

static void check_small_candidate_pool(const char *dir) {
    di_model *m = load(dir, DI_PRECISION_FP32);
    CHECK(m != NULL);
    if (!m) return;
    di_hparams *hp = &m->hp;
    int il = -1, src = -1;
    for (int l = hp->n_layer - 1; l > hp->candidate_layer && il < 0; l--)
        if (hp->index_source[l]) il = l;
    CHECK(hp->candidate_layer >= 0 && il > hp->candidate_layer);
    for (int l = il; l >= 0 && src < 0; l--)
        if (hp->kv_source[l]) src = l;
    CHECK(src >= 0 && hp->compress_ratio[src] > 0);
    if (il < 0 || src < 0 || hp->compress_ratio[src] <= 0) {
        di_model_destroy(m);
        return;
    }
    hp->candidate_topk_blocks = 1; // pool = the newest block: at most block_size < index_topk
    const int32_t bs = hp->candidate_block_size, K = hp->index_topk, r = hp->compress_ratio[src];
    CHECK(bs < K);
    enum { T = 40 };
    int32_t ids[T];
    make_ids(ids, T, 33);
    float *lg = malloc(sizeof(float) * T * (size_t)hp->n_vocab);
    di_session_options so = di_session_options_default();
    di_session *s = NULL;
    CHECK(di_session_create(m, &so, &s) == DI_OK);
    topk_capture tc = {.il = il};
    s->trace = on_topk, s->trace_user = &tc;
    di_forward_out fo = {.logits = lg};
    CHECK(di_session_forward(s, ids, T, &fo) == DI_OK);
    CHECK(tc.rows != NULL && tc.n_rows == T && tc.row_len == K);
    int64_t bad = 0, short_rows = 0;
    for (int64_t t = 0; tc.rows && t < T; t++) {
        int64_t vis = (t + 1) / r;
        if (vis == 0) continue;
        int64_t lo = (vis - 1) / bs * bs, want = vis - lo; // entries of the newest block
        int64_t n = 0;
        for (int64_t i = 0; i < K; i++) {
            int32_t e = tc.rows[t * K + i];
            if (e < 0) continue;
            n++;
            bad += e < lo || e >= vis;
        }
        bad += n != (want < K ? want : K);
        short_rows += vis > want;
    }
    CHECK_EQ(bad, 0);
    CHECK(short_rows > 0); // the pool really was smaller than the visible entries
    free(tc.rows);
    free(lg);
    di_session_destroy(s);
    di_model_destroy(m);
}

// The premise of the engine's exact speculative decoding (engine.c): a verify call of k + 1 rows
// gives every row the logits a one-token call at that position gives, bit for bit (not only to
// TOL_CHUNK), also after a rollback of rejected rows and past the window ring's wrap (positions
// beyond W + DI_DSV41_ROLLBACK_MAX), in both recipes, with DSpark running.
static void check_verify_bitwise(const char *dir, di_precision prec, const char *what) {
    di_model *m = load(dir, prec);
    CHECK(m != NULL);
    if (!m) return;
    enum { T = 230, K1 = 6 };
    const int64_t V = m->hp.n_vocab;
    int32_t ids[T];
    make_ids(ids, T, 5);
    float *one = malloc(sizeof(float) * K1 * V), *ver = malloc(sizeof(float) * K1 * V);
    float *pl = malloc(sizeof(float) * T * V); // the prefixes' logits (unused)
    int32_t n_diff = 0, n_checked = 0;
    for (int32_t pre = 33; pre + 2 * K1 <= T; pre += 47) {
        int32_t chunk[1] = {pre};
        di_session *a = run(m, true, ids, pre, chunk, 1, pl); // token by token from pre
        di_session *b = run(m, true, ids, pre, chunk, 1, pl); // verify K1 rows, reject 3
        CHECK(a && b);
        if (!a || !b) {
            di_session_destroy(a);
            di_session_destroy(b);
            continue;
        }
        for (int32_t i = 0; i < K1; i++) {
            di_forward_out fo = {.logits = one + i * V};
            CHECK(di_session_forward(a, ids + pre + i, 1, &fo) == DI_OK);
        }
        int32_t junk[K1];
        memcpy(junk, ids + pre, sizeof junk);
        for (int32_t i = K1 - 3; i < K1; i++) junk[i] = (junk[i] + 1) % 512;
        di_forward_out fo = {.logits = ver};
        CHECK(di_session_forward(b, junk, K1, &fo) == DI_OK);
        n_diff += memcmp(one, ver, sizeof(float) * (size_t)((K1 - 3) * V)) != 0; // the kept rows
        CHECK(di_session_rollback(b, 3) == DI_OK);
        // Continue both with one verify of the true tokens: equal rows again.
        fo.logits = ver;
        CHECK(di_session_forward(b, ids + pre + K1 - 3, K1, &fo) == DI_OK);
        for (int32_t i = 0; i < 3; i++) memmove(one + i * V, one + (i + 3) * V, sizeof(float) * V);
        for (int32_t i = 3; i < K1; i++) {
            fo.logits = one + i * V;
            CHECK(di_session_forward(a, ids + pre + K1 + i - 3, 1, &fo) == DI_OK);
        }
        n_diff += memcmp(one, ver, sizeof(float) * (size_t)(K1 * V)) != 0;
        n_checked += 2;
        di_session_destroy(a);
        di_session_destroy(b);
    }
    fprintf(stderr, "  verify == one token per call (%s): %d of %d blocks differ\n", what, n_diff,
            n_checked);
    CHECK(n_checked >= 8);
    CHECK_EQ(n_diff, 0);
    free(one);
    free(ver);
    free(pl);
    di_model_destroy(m);
}

// The packed state's sizes (docs/kv-cache.md, "DeepSeek V4.1"): V4.1-Flash (its released config)
// pages of 128 positions hold 3 · 64 + 128 = 320 entries of 512 dims at Q4e/16 (288 bytes) and as
// many index keys of 128 dims at Q4/32 (68 bytes): 113,920 bytes, the spec's 890 a position
// (§0.3; 6,400 as FP32); a window row is 528 bytes (2,048 as FP32). The tiny model's page: runs of
// 8 and 16 rows padded to 64 bytes.
static void check_state_sizes(const char *dir) {
    static di_model flash; // only the hyper-parameters are read
    char p[512];
    CHECK_EQ(
        di_hparams_load(test_src_path("tests/data/configs/deepseek-v41-flash.json", p, sizeof p),
                        &flash.hp),
        DI_OK);
    CHECK(flash.hp.v41 && flash.hp.head_dim == 512 && flash.hp.index_head_dim == 128);
    const int32_t bt = di_kv_block_tokens(&flash);
    CHECK_EQ(bt, 128);
    CHECK_EQ((long long)di_dsv41_page_bytes(&flash, bt), 113920);
    CHECK_EQ((long long)di_dsv41_page_bytes(&flash, bt) / bt, 890);
    CHECK_EQ((long long)di_kv_v41_block_bytes(&flash), 113920);
    CHECK_EQ((long long)di_quant_q8_row_bytes(flash.hp.head_dim, DI_DSV41_WIN_BLOCK), 528);
    fprintf(stderr,
            "V4.1-Flash: pages of %d positions %zu bytes (%zu a position), window rows %zu\n", bt,
            di_dsv41_page_bytes(&flash, bt), di_dsv41_page_bytes(&flash, bt) / (size_t)bt,
            di_quant_q8_row_bytes(flash.hp.head_dim, DI_DSV41_WIN_BLOCK));
    di_model *m = load(dir, DI_PRECISION_FP32);
    CHECK(m != NULL);
    if (!m) return;
    CHECK_EQ(di_kv_block_tokens(m), 16);
    // Two sources (ratio 2: 8 entries a page, ratio 1: 16) of 64-dim entries (36 bytes) and keys
    // (34 bytes): 288 -> 320, 272 -> 320, 576, 544 -> 576.
    CHECK_EQ((long long)di_dsv41_page_bytes(m, 16), 320 + 320 + 576 + 576);
    di_session_options so = di_session_options_default();
    di_session *s = NULL;
    CHECK(di_session_create(m, &so, &s) == DI_OK);
    if (s) {
        CHECK_EQ(s->v41->ring_row_bytes, 64 + 2);
        CHECK_EQ(s->v41->ent_bytes, 32 + 4);
        CHECK_EQ(s->v41->key_bytes, 32 + 2);
        di_session_destroy(s);
    }
    di_model_destroy(m);
}

int main(void) {
    snprintf(g_root, sizeof g_root, "/tmp/di_test_dsv41_XXXXXX");
    if (!mkdtemp(g_root)) return 1;
    char off[512], hf[512];
    snprintf(off, sizeof off, "%s/official", g_root);
    snprintf(hf, sizeof hf, "%s/hf", g_root);
    mkdir(off, 0755);
    mkdir(hf, 0755);
    CHECK(di_synth_v41_write(off, true, true, 41) == DI_OK);
    CHECK(di_synth_v41_write(hf, false, false, 41) == DI_OK);
    fprintf(stderr, "streaming:\n");
    check_streaming(hf, DI_PRECISION_FP32, "float, fp32");
    check_streaming(off, DI_PRECISION_FP32, "official layout, fp32");
    check_streaming(off, DI_PRECISION_OFFICIAL, "official layout, official precision");
    check_rollback(hf);
    check_verify_bitwise(off, DI_PRECISION_FP32, "fp32");
    check_verify_bitwise(off, DI_PRECISION_OFFICIAL, "official");
    check_save_restore(off);
    check_dspark(off);
    check_refusals(off, hf);
    check_map_from_tokenizer(hf);
    check_runtime_names(hf, false);
    check_runtime_names(hf, true);
    check_rounding_points(off);
    check_small_candidate_pool(hf);
    check_state_sizes(off);
    di_test_remove_dir(g_root);
    return test_finish();
}
