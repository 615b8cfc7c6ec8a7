// DeepSeek V4.1 fixtures (tests/data/fixtures/v41_<name>/, made by python/gen_golden_v41.py from
// transformers' DeepseekV41ForCausalLM in FP32; layout in docs/reference-tooling.md) against the
// C forward pass:
//   - logits of every position of one prefill within 1e-4 x max|ref|;
//   - every layer's output streams, attention output and carried mHC pre; the compressed entries
//     and index keys of every kv source; identical top-k sets on every index source; the Engram
//     row ids;
//   - chunked (the fixture's split, inside ratio-2 groups) and token-by-token == one prefill
//     within 1e-5 relative;
//   - the official-layout FP8/FP4 checkpoint (FP32 precision) against the float one;
//   - rollback (verify k, reject j, continue) and save/restore equal to a run that never saw the
//     rejected tokens;
//   - broken configs refused with a message.
// The fixture directories carry no Engram token map (ref.safetensors has it as engram_cmap), so
// each model directory is assembled in a temp dir: links to config.json and model.safetensors
// plus engram/token_map.safetensors written from engram_cmap.
#include "harness.h"
#include "trace_ref.h"

#include <dirent.h>
#include <stdint.h>
#include <sys/stat.h>
#include <unistd.h>

#include "base/json.h"
#include "io/safetensors.h"
#include "model/dsv41.h"
#include "tensor/quant_ref.h" // di_quant_q4e_unpack, di_quant_q4_unpack

// Against transformers: FP32 engines summing in different orders differ by ~1e-6 relative per op;
// the acceptance bound is 1e-4 of the largest value.
#define TOL_REF 1e-4
// Chunked / stepwise / rollback vs one prefill: the same kernels on the same rows.
#define TOL_CHUNK 1e-5
// Official FP8/FP4 layout vs its float dequantisation: identical weights; only the kernels'
// summation order differs (FP8/FP4 rows vs F32 rows).
#define TOL_LAYOUT 1e-5

static char g_tmp[256];

typedef struct capture {
    const di_st_file *ref;
    double worst[3]; // layer_out, attn_out, hc_pre
    int worst_il[3];
    int n_compared;
    int topk_mismatch, topk_checked;
} capture;

static void trace_cb(void *user, const char *name, int il, const void *data, bool is_int,
                     int64_t n_rows, int64_t row_len) {
    capture *c = user;
    double e = trace_compare(c->ref, name, il, data, is_int, n_rows, row_len, &c->topk_checked,
                             &c->topk_mismatch);
    if (is_int || e < 0) return;
    int w = strcmp(name, "layer_out") == 0  ? 0
            : strcmp(name, "attn_out") == 0 ? 1
            : strcmp(name, "hc_pre") == 0   ? 2
                                            : -1;
    if (w < 0) return;
    c->n_compared++;
    if (e > c->worst[w]) c->worst[w] = e, c->worst_il[w] = il;
}

static const di_st_tensor *ref_t(const di_st_file *ref, const char *name, di_dtype dt) {
    const di_st_tensor *t = di_st_file_find(ref, name);
    if (t && t->dtype != dt) {
        fprintf(stderr, "ref tensor %s has dtype %s\n", name, di_dtype_name(t->dtype));
        return NULL;
    }
    return t;
}

// <tmp>/<tag>: links to src/{config.json,model.safetensors} + engram/token_map.safetensors.
static bool assemble(const char *src, const char *tag, const di_st_tensor *cmap, char *out,
                     size_t cap) {
    snprintf(out, cap, "%s/%s", g_tmp, tag);
    mkdir(out, 0755);
    char a[2048], b[2048];
    const char *files[2] = {"config.json", "model.safetensors"};
    for (int i = 0; i < 2; i++) {
        snprintf(a, sizeof a, "%s/%s", src, files[i]);
        if (a[0] != '/') {
            char cwd[1024];
            if (!getcwd(cwd, sizeof cwd)) return false;
            snprintf(b, sizeof b, "%s/%s", cwd, a);
            snprintf(a, sizeof a, "%s", b);
        }
        snprintf(b, sizeof b, "%s/%s", out, files[i]);
        unlink(b);
        if (symlink(a, b) != 0) return false;
    }
    snprintf(b, sizeof b, "%s/engram", out);
    mkdir(b, 0755);
    snprintf(b, sizeof b, "%s/engram/token_map.safetensors", out);
    di_st_write_tensor t = {.name = "token_map",
                            .dtype = DI_DTYPE_I32,
                            .n_dims = 1,
                            .shape = {cmap->n_elements},
                            .data = cmap->data};
    return di_st_write_file(b, &t, 1) == DI_OK;
}

static di_model *load(const char *dir) {
    di_model_options o = di_model_options_default();
    di_model *m = NULL;
    return di_model_load(dir, &o, &m) == DI_OK ? m : NULL;
}

static di_session *feed(di_model *m, const int32_t *ids, int32_t T, const int32_t *chunks,
                        int n_chunks, float *logits, capture *cap) {
    di_session *s = NULL;
    if (di_session_create(m, NULL, &s) != DI_OK) return NULL;
    if (cap) s->trace = trace_cb, s->trace_user = cap;
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
    s->trace = NULL;
    return s;
}

static void check_state_vs_ref(const di_model *m, const di_session *s, const di_st_file *ref) {
    const di_hparams *hp = &m->hp;
    for (int il = 0; il < hp->n_layer; il++) {
        if (!hp->kv_source[il]) continue;
        const di_dsv41_src *src = &s->v41->src[il];
        char key[64];
        snprintf(key, sizeof key, "cmain.%d", il);
        const di_st_tensor *c = ref_t(ref, key, DI_DTYPE_F32);
        snprintf(key, sizeof key, "kidx.%d", il);
        const di_st_tensor *k = ref_t(ref, key, DI_DTYPE_F32);
        CHECK(c && k);
        if (!c || !k) continue;
        CHECK_EQ(c->n_elements, src->n_entries * hp->head_dim);
        CHECK_EQ(k->n_elements, src->n_entries * hp->index_head_dim);
        if (c->n_elements != src->n_entries * hp->head_dim) continue;
        // The entries and keys through the session's pages, gathered in entry order.
        const int32_t Dh = hp->head_dim, DI = hp->index_head_dim;
        float *cm = malloc(sizeof(float) * (size_t)(src->n_entries * Dh + 1));
        float *ki = malloc(sizeof(float) * (size_t)(src->n_entries * DI + 1));
        CHECK(cm && ki);
        if (!cm || !ki) continue;
        for (int64_t w = 0; w < src->n_entries; w++) { // packed Q4e / Q4 rows, decoded
            di_quant_q4e_unpack(di_dsv41_entry(s->v41, src, w), Dh, DI_DSV41_ENT_BLOCK,
                                cm + w * Dh);
            di_quant_q4_unpack(di_dsv41_key(s->v41, src, w), DI, DI_DSV41_KEY_BLOCK, ki + w * DI);
        }
        double ec = test_rel_err(cm, c->data, c->n_elements);
        double ek = test_rel_err(ki, k->data, k->n_elements);
        free(cm);
        free(ki);
        fprintf(stderr, "  source %d: %lld entries, Cmain %.3g, Kidx %.3g\n", il,
                (long long)src->n_entries, ec, ek);
        // Q4e / Q4 grids turn a 1e-6 difference into a full grid step when a value sits at a
        // rounding boundary; allow a few such flips relative to the largest value.
        CHECK(ec <= 0.05);
        CHECK(ek <= 0.05);
    }
}

// Level-1 candidate pool of the one-shot prefill: entry w of query t is a candidate iff its block
// was kept. Compared on the visible entries (what a later indexer can pick).
static void check_candidates(const di_model *m, const di_session *s, const di_st_file *ref,
                             int32_t T) {
    const di_hparams *hp = &m->hp;
    const int cl = hp->candidate_layer;
    if (cl < 0) return;
    char key[64];
    snprintf(key, sizeof key, "candidates.%d", cl);
    const di_st_tensor *t = ref_t(ref, key, DI_DTYPE_I32);
    if (!t) {
        fprintf(stderr, "  (no %s in the fixture)\n", key);
        return;
    }
    const int64_t n_end = s->v41->src[cl].n_entries, bs = hp->candidate_block_size;
    CHECK_EQ(t->n_elements, (int64_t)T * n_end);
    if (t->n_elements != (int64_t)T * n_end) return;
    const int32_t *r = t->data;
    int bad = 0, ratio = hp->compress_ratio[cl];
    for (int32_t q = 0; q < T; q++) {
        int64_t vis = (q + 1) / ratio;
        const int32_t *kept = s->v41->cand + (int64_t)q * hp->candidate_topk_blocks;
        for (int64_t w = 0; w < vis; w++) {
            int in = 0;
            for (int32_t i = 0; i < s->v41->n_cand[q]; i++) in |= kept[i] == w / bs;
            bad += in != (r[q * n_end + w] != 0);
        }
    }
    fprintf(stderr, "  candidate pool of layer %d: %d visible entries differ\n", cl, bad);
    CHECK_EQ(bad, 0);
}

// The RoPE tables (meta.json "rope": transformers' main / compress inv_freq) against ours.
static void check_rope(const di_model *m, const char *dir) {
    char path[4096];
    snprintf(path, sizeof path, "%s/meta.json", dir);
    json_t *j = NULL;
    if (di_json_load_file(path, &j) != DI_OK) return;
    const json_t *rope = json_object_get(j, "rope");
    const char *keys[2] = {"main_inv_freq", "compress_inv_freq"};
    const float *ours[2] = {m->omega_main, m->omega_compress};
    for (int i = 0; i < 2 && rope; i++) {
        const json_t *a = json_object_get(rope, keys[i]);
        CHECK_EQ(json_array_size(a), m->hp.rope_main.n_dims / 2);
        double worst = 0;
        for (size_t k = 0; k < json_array_size(a) && (int)k < m->hp.rope_main.n_dims / 2; k++) {
            double r = json_number_value(json_array_get(a, k));
            worst = fmax(worst, fabs(ours[i][k] - r) / fabs(r));
        }
        fprintf(stderr, "  rope %s: %.3g relative\n", keys[i], worst);
        CHECK(worst <= 1e-6);
    }
    json_decref(j);
}

static void check_engram_hash(const di_model *m, const int32_t *ids, int32_t T,
                              const di_st_file *ref, const int32_t *cmap) {
    const di_hparams *hp = &m->hp;
    const di_engram_hash *h = &m->v41->hash;
    for (int L = 0; L < hp->n_engram; L++) {
        char key[64];
        snprintf(key, sizeof key, "engram_hash.%d", hp->engram_layer[L]);
        const di_st_tensor *t = ref_t(ref, key, DI_DTYPE_I32);
        CHECK(t && t->n_elements == (int64_t)T * h->n_col);
        if (!t || t->n_elements != (int64_t)T * h->n_col) continue;
        const int32_t *r = t->data;
        int bad = 0;
        for (int32_t p = 0; p < T; p++) {
            int32_t look[8];
            for (int k = 0; k < h->max_ngram; k++)
                look[k] = p - k >= 0 ? cmap[ids[p - k]] : DI_ENGRAM_DEAD;
            int64_t rows[DI_ENGRAM_MAX_COLS];
            di_engram_hash_rows(h, L, look, m->v41->pad_c, rows);
            for (int j = 0; j < h->n_col; j++) bad += rows[j] != r[p * h->n_col + j];
        }
        CHECK_EQ(bad, 0);
    }
}

static void check_rollback(di_model *m, const int32_t *ids, int32_t T, const float *one,
                           const float *hf_ref) {
    const int64_t V = m->hp.n_vocab;
    float *got = malloc(sizeof(float) * (size_t)(T * V)), *tmp = malloc(sizeof(float) * 8 * V);
    const int32_t cuts[3][3] = {{T / 2 + 1, 5, 3}, {T / 2, 6, 6}, {T / 3, 4, 1}};
    for (int ci = 0; ci < 3; ci++) {
        int32_t pre = cuts[ci][0], k = cuts[ci][1], j = cuts[ci][2];
        if (pre + k > T) continue;
        int32_t chunk[1] = {pre};
        di_session *s = feed(m, ids, pre, chunk, 1, got, NULL);
        CHECK(s != NULL);
        if (!s) continue;
        int32_t ver[8];
        for (int32_t i = 0; i < k; i++)
            ver[i] = i < k - j ? ids[pre + i] : (int32_t)((ids[pre + i] + 7) % V);
        di_forward_out fo = {.logits = tmp};
        CHECK(di_session_forward(s, ver, k, &fo) == DI_OK);
        CHECK(di_session_rollback(s, j) == DI_OK);
        // Save / restore in a fresh session half-way, then continue there.
        void *bytes = NULL;
        size_t nb = 0;
        CHECK(di_session_save(s, &bytes, &nb) == DI_OK);
        di_session_destroy(s);
        CHECK(di_session_create(m, NULL, &s) == DI_OK);
        CHECK(di_session_restore(s, bytes, nb) == DI_OK);
        di_free_buffer(bytes);
        int32_t at = pre + k - j, rest = T - at;
        fo.logits = got + (int64_t)at * V;
        CHECK(di_session_forward(s, ids + at, rest, &fo) == DI_OK);
        double e_self = test_rel_err(got + at * V, one + at * V, (int64_t)rest * V);
        double e_ref = test_rel_err(got + at * V, hf_ref + at * V, (int64_t)rest * V);
        fprintf(stderr,
                "  rollback at %d (verify %d, reject %d) + save/restore: vs one prefill "
                "%.3g, vs reference %.3g\n",
                pre, k, j, e_self, e_ref);
        CHECK(e_self <= TOL_CHUNK);
        CHECK(e_ref <= TOL_REF);
        di_session_destroy(s);
    }
    free(got);
    free(tmp);
}

static void check_fixture(const char *dir, const char *name) {
    char path[4096];
    fprintf(stderr, "--- fixture %s\n", name);
    snprintf(path, sizeof path, "%s/ref.safetensors", dir);
    di_st_file *ref = NULL;
    CHECK(di_st_file_open(path, &ref) == DI_OK);
    if (!ref) return;
    const di_st_tensor *ids_t = ref_t(ref, "input_ids", DI_DTYPE_I32);
    const di_st_tensor *cmap_t = ref_t(ref, "engram_cmap", DI_DTYPE_I32);
    const di_st_tensor *lg_t = ref_t(ref, "logits", DI_DTYPE_F32);
    CHECK(ids_t && cmap_t && lg_t);
    if (!ids_t || !cmap_t || !lg_t) {
        di_st_file_close(ref);
        return;
    }
    const int32_t *ids = ids_t->data;
    const int32_t T = (int32_t)ids_t->n_elements;
    char hf[2048], off[2048], src[4096];
    snprintf(src, sizeof src, "%s/hf", dir);
    CHECK(assemble(src, "hf", cmap_t, hf, sizeof hf));
    snprintf(src, sizeof src, "%s/official", dir);
    bool have_off = access(src, F_OK) == 0 && assemble(src, "official", cmap_t, off, sizeof off);
    di_model *m = load(hf);
    CHECK(m != NULL);
    if (!m) {
        di_st_file_close(ref);
        return;
    }
    const int64_t V = m->hp.n_vocab;
    CHECK_EQ(lg_t->n_elements, (int64_t)T * V);
    const float *hf_ref = lg_t->data;
    float *one = malloc(sizeof(float) * (size_t)(T * V)),
          *got = malloc(sizeof(float) * (size_t)(T * V));

    // One prefill with every named intermediate compared.
    capture cap = {.ref = ref};
    int32_t all[1] = {T};
    di_session *s = feed(m, ids, T, all, 1, one, &cap);
    CHECK(s != NULL);
    double e_logits = test_rel_err(one, hf_ref, (int64_t)T * V);
    fprintf(stderr,
            "  prefill of %d: logits %.3g; worst layer_out %.3g (layer %d), attn_out %.3g "
            "(layer %d), hc_pre %.3g (layer %d); top-k %d/%d queries differ\n",
            T, e_logits, cap.worst[0], cap.worst_il[0], cap.worst[1], cap.worst_il[1], cap.worst[2],
            cap.worst_il[2], cap.topk_mismatch, cap.topk_checked);
    CHECK(e_logits <= TOL_REF);
    CHECK(cap.n_compared >= 3 * m->hp.n_layer);
    CHECK(cap.worst[0] <= TOL_REF && cap.worst[1] <= TOL_REF && cap.worst[2] <= TOL_REF);
    CHECK(cap.topk_checked > 0);
    CHECK_EQ(cap.topk_mismatch, 0);
    if (s) check_state_vs_ref(m, s, ref);
    if (s) check_candidates(m, s, ref, T);
    di_session_destroy(s);
    check_engram_hash(m, ids, T, ref, cmap_t->data);
    check_rope(m, dir);

    // Chunked (the fixture's split) and token by token.
    const di_st_tensor *cl = ref_t(ref, "chunk_lens", DI_DTYPE_I32);
    int32_t split[3] = {7, 6, 13}, *chunks = split, n_chunks = 3, tok[1] = {1};
    if (cl) chunks = (int32_t *)cl->data, n_chunks = (int32_t)cl->n_elements;
    s = feed(m, ids, T, chunks, n_chunks, got, NULL);
    double e_chunk = test_rel_err(got, one, (int64_t)T * V);
    di_session_destroy(s);
    // ... and against transformers' own streaming run over the same split (its DynamicCache).
    const di_st_tensor *rc = ref_t(ref, "logits_chunked", DI_DTYPE_F32);
    if (rc && rc->n_elements == (int64_t)T * V) {
        double e = test_rel_err(got, rc->data, (int64_t)T * V);
        fprintf(stderr, "  chunked vs reference chunked: %.3g\n", e);
        CHECK(e <= TOL_REF);
    }
    s = feed(m, ids, T, tok, 1, got, NULL);
    double e_tok = test_rel_err(got, one, (int64_t)T * V);
    di_session_destroy(s);
    const di_st_tensor *rs = ref_t(ref, "logits_stepwise", DI_DTYPE_F32);
    if (rs && rs->n_elements == (int64_t)T * V) {
        double e = test_rel_err(got, rs->data, (int64_t)T * V);
        fprintf(stderr, "  token by token vs reference stepwise: %.3g\n", e);
        CHECK(e <= TOL_REF);
    }
    fprintf(stderr, "  chunked %.3g, token by token %.3g (vs one prefill)\n", e_chunk, e_tok);
    CHECK(e_chunk <= TOL_CHUNK);
    CHECK(e_tok <= TOL_CHUNK);

    check_rollback(m, ids, T, one, hf_ref);

    // Official FP8/FP4 layout vs its dequantisation (the hf weights).
    if (have_off) {
        di_model *mo = load(off);
        CHECK(mo != NULL);
        if (mo) {
            s = feed(mo, ids, T, all, 1, got, NULL);
            double e_off = test_rel_err(got, one, (int64_t)T * V);
            fprintf(stderr, "  official layout vs float: logits %.3g\n", e_off);
            CHECK(e_off <= TOL_LAYOUT);
            di_session_destroy(s);
            di_model_destroy(mo);
        }
    } else {
        fprintf(stderr, "  (no official/ layout in this fixture)\n");
    }
    free(one);
    free(got);
    di_model_destroy(m);
    di_st_file_close(ref);
}

// ---- DSpark against R-OFF (v41_dspark: DeepSeek's official inference code on CPU; backbone
// weights = v41_tiny/official, the DSpark block in official/mtp.safetensors). Two numerics:
// fp32.* (R-OFF with FP32 kernels = R-HF's numerics) is checked end to end in FP32 precision with
// the reference tolerance; bf16.* (R-OFF as released) only for the DSpark module fed R-OFF's own
// taps: R-OFF's BF16 backbone is chaotic on random weights (docs/reference-tooling.md). ----

// bf16.*: R-OFF's BF16 arithmetic and ours round at the same points but not in the same order
// inside GEMMs and softmaxes: a few per cent of the largest draft logit (a wrong block wiring gives
// 50 %+). Measured 2-7 %.
#define TOL_DSPARK_BF16_LOGITS 0.12
#define TOL_DSPARK_BF16_CONF 0.6 // absolute, confidence logit of the first draft (measured <= 0.3)

static const float *fx(const di_st_file *ref, const char *mode, const char *name, int64_t n) {
    char key[96];
    snprintf(key, sizeof key, "%s.%s", mode, name);
    const di_st_tensor *t = di_st_file_find(ref, key);
    if (!t || t->n_elements != n) {
        fprintf(stderr, "v41_dspark: %s missing or of the wrong size\n", key);
        return NULL;
    }
    return t->data;
}

static void dspark_mode(const char *mdir, const di_st_file *ref, bool bf16) {
    const char *mode = bf16 ? "bf16" : "fp32";
    di_model_options o = di_model_options_default();
    o.precision = bf16 ? DI_PRECISION_OFFICIAL : DI_PRECISION_FP32;
    di_model *m = NULL;
    CHECK(di_model_load(mdir, &o, &m) == DI_OK);
    const di_st_tensor *ids_t = ref_t(ref, "input_ids", DI_DTYPE_I32);
    if (!m || !ids_t) {
        di_model_destroy(m);
        return;
    }
    const int64_t V = m->hp.n_vocab, B = m->hp.dspark_block_size, D = m->hp.n_embd;
    const int64_t W = (int64_t)m->hp.n_dspark_target * D;
    const int32_t T = (int32_t)ids_t->n_elements, steps = 8;
    const float *pl = fx(ref, mode, "prefill_logits_last", V);
    const float *pmh = fx(ref, mode, "prefill_main_hidden", T * W);
    const float *dmh = fx(ref, mode, "decode_main_hidden", steps * W);
    const float *dlg = fx(ref, mode, "decode_logits", steps * V);
    const float *dl_ref = fx(ref, mode, "draft_logits", steps * B * V);
    const float *dc = fx(ref, mode, "draft_confidence", steps * B);
    const int32_t *dt = (const int32_t *)fx(ref, mode, "decode_tokens", steps);
    const int32_t *did = (const int32_t *)fx(ref, mode, "draft_ids", steps * (B + 1));
    CHECK(pl && pmh && dmh && dlg && dl_ref && dc && dt && did);
    if (!(pl && pmh && dmh && dlg && dl_ref && dc && dt && did)) {
        di_model_destroy(m);
        return;
    }
    di_session_options so = di_session_options_default();
    so.mtp = true;
    di_session *s = NULL;
    CHECK(di_session_create(m, &so, &s) == DI_OK);
    float *lg = malloc(sizeof(float) * (size_t)V), *dl = malloc(sizeof(float) * (size_t)(B * V));
    di_forward_out fo = {.logits = lg, .last_only = true};
    CHECK(di_session_forward(s, ids_t->data, T, &fo) == DI_OK);
    double e_pre = test_rel_err(lg, pl, V),
           e_taps = test_rel_err(s->v41->taps, pmh, (int64_t)T * W);
    double e_dec = 0, e_dtaps = 0, e_draft = 0, e_conf = 0;
    int same_ids = 0, same_first = 0;
    for (int32_t k = 0; k < steps; k++) {
        CHECK(di_session_forward(s, dt + k, 1, &fo) == DI_OK);
        e_dec = fmax(e_dec, test_rel_err(lg, dlg + k * V, V));
        e_dtaps = fmax(e_dtaps, test_rel_err(s->v41->taps, dmh + k * W, W));
        // The draft module alone: context rows from R-OFF's own taps (R-OFF's decode steps differ
        // from ours, see below).
        di_dsv41_dspark_context(s, pmh, 0, T);
        for (int32_t j = 0; j <= k; j++) di_dsv41_dspark_context(s, dmh + j * W, T + j, 1);
        di_dsv41_draft d;
        CHECK(di_dsv41_draft_block(s, did[k * (B + 1)], &d, dl) == DI_OK);
        bool all = true;
        for (int64_t j = 0; j < B; j++) all &= d.tokens[j] == did[k * (B + 1) + 1 + j];
        same_ids += all;
        same_first += d.tokens[0] == did[k * (B + 1) + 1];
        // Every row in FP32; the first only in BF16 (later rows follow the previous draft).
        e_draft = fmax(e_draft, test_rel_err(dl, dl_ref + k * B * V, (bf16 ? 1 : B) * V));
        for (int64_t j = 0; j < (bf16 ? 1 : B); j++)
            e_conf = fmax(e_conf, fabs(d.conf_logit[j] - dc[k * B + j]) /
                                      (bf16 ? 1 : 1 + fabs(dc[k * B + j])));
    }
    fprintf(stderr,
            "  %s: prefill logits %.3g, taps %.3g; decode logits %.3g, taps %.3g (not checked); "
            "drafts equal "
            "%d/%d (first %d/%d); draft logits %.3g; confidence logits %.3g\n",
            mode, e_pre, e_taps, e_dec, e_dtaps, same_ids, steps, same_first, steps, e_draft,
            e_conf);
    if (bf16) {
        CHECK(same_first >= steps - 1);
        CHECK(e_draft <= TOL_DSPARK_BF16_LOGITS);
        CHECK(e_conf <= TOL_DSPARK_BF16_CONF);
    } else {
        // The prefill is compared end to end. R-OFF's decode steps are not: at a decode step in
        // which a ratio-2 kv source completes no group, R-OFF's indexer reads a stale
        // shared_attn.index_k (the last one published: another source's keys), a quirk of its
        // one-token decode path that breaks its own chunking invariance; this engine (and R-HF)
        // use the source's own keys (docs/architecture.md, "Spec vs reference").
        CHECK(e_pre <= TOL_REF && e_taps <= TOL_REF);
        CHECK_EQ(same_ids, steps);
        CHECK(e_draft <= TOL_REF);
        CHECK(e_conf <= TOL_REF);
    }
    free(lg);
    free(dl);
    di_session_destroy(s);
    di_model_destroy(m);
}

static void check_dspark_roff(const char *root) {
    char path[4096], mdir[2048];
    snprintf(path, sizeof path, "%s/v41_dspark/ref.safetensors", root);
    di_st_file *ref = NULL, *tref = NULL;
    if (access(path, F_OK) != 0) return;
    CHECK(di_st_file_open(path, &ref) == DI_OK);
    fprintf(stderr, "--- fixture v41_dspark (R-OFF)\n");
    snprintf(path, sizeof path, "%s/v41_tiny/ref.safetensors", root);
    CHECK(di_st_file_open(path, &tref) == DI_OK);
    const di_st_tensor *cmap = tref ? ref_t(tref, "engram_cmap", DI_DTYPE_I32) : NULL;
    CHECK(ref && cmap);
    if (ref && cmap) {
        // Model dir: the DSpark config, the tiny official backbone, the DSpark block, the map.
        snprintf(mdir, sizeof mdir, "%s/dspark", g_tmp);
        mkdir(mdir, 0755);
        char cwd[1024], a[4096], b[4096];
        CHECK(getcwd(cwd, sizeof cwd) != NULL);
        const char *from[3] = {"v41_dspark/official/config.json",
                               "v41_tiny/official/model.safetensors",
                               "v41_dspark/official/mtp.safetensors"};
        const char *to[3] = {"config.json", "model.safetensors", "mtp.safetensors"};
        for (int i = 0; i < 3; i++) {
            snprintf(a, sizeof a, "%s/%s/%s", cwd, root, from[i]);
            snprintf(b, sizeof b, "%s/%s", mdir, to[i]);
            unlink(b);
            CHECK(symlink(a, b) == 0);
        }
        snprintf(b, sizeof b, "%s/engram", mdir);
        mkdir(b, 0755);
        snprintf(b, sizeof b, "%s/engram/token_map.safetensors", mdir);
        di_st_write_tensor t = {.name = "token_map",
                                .dtype = DI_DTYPE_I32,
                                .n_dims = 1,
                                .shape = {cmap->n_elements},
                                .data = cmap->data};
        CHECK(di_st_write_file(b, &t, 1) == DI_OK);
        dspark_mode(mdir, ref, false);
        dspark_mode(mdir, ref, true);
    }
    di_st_file_close(tref);
    di_st_file_close(ref);
}

// A fixture config made invalid in one field is refused with DI_ERR_FORMAT.
static void check_bad_config(const char *dir) {
    char path[4096];
    snprintf(path, sizeof path, "%s/hf/config.json", dir);
    FILE *f = fopen(path, "rb");
    if (!f) return;
    char *text = malloc(1 << 20);
    size_t n = fread(text, 1, (1 << 20) - 1, f);
    fclose(f);
    text[n] = 0;
    const char *keys[3] = {"\"kv_source_layer_ids\"", "\"index_source_layer_ids\"",
                           "\"compress_ratios\""};
    const char *bad[3] = {"\"kv_source_layer_ids\": [0], \"x_kv\"",
                          "\"index_source_layer_ids\": [], \"x_idx\"",
                          "\"compress_ratios\": [0, 3, 2, 1, 1, 1], \"x_cr\""};
    for (int i = 0; i < 3; i++) {
        char *at = strstr(text, keys[i]);
        if (!at) continue;
        char out[4096];
        snprintf(out, sizeof out, "%s/bad%d", g_tmp, i);
        mkdir(out, 0755);
        snprintf(path, sizeof path, "%s/config.json", out);
        FILE *g = fopen(path, "wb");
        fwrite(text, 1, (size_t)(at - text), g);
        fputs(bad[i], g);
        fputs(at + strlen(keys[i]), g);
        fclose(g);
        di_hparams hp;
        di_status st = di_hparams_load(path, &hp);
        if (st != DI_ERR_FORMAT) fprintf(stderr, "bad config %d: status %d\n", i, st);
        CHECK_EQ(st, DI_ERR_FORMAT);
    }
    free(text);
}

int main(void) {
    const char *root = "tests/data/fixtures";
    DIR *d = opendir(root);
    if (!d) DI_TEST_SKIP("no fixtures directory");
    snprintf(g_tmp, sizeof g_tmp, "/tmp/di_test_v41_fixtures_XXXXXX");
    if (!mkdtemp(g_tmp)) return 1;
    struct dirent *de;
    int n = 0;
    char names[16][256];
    while ((de = readdir(d)) != NULL && n < 16) {
        if (strncmp(de->d_name, "v41_", 4) != 0 || strcmp(de->d_name, "v41_engram") == 0 ||
            strcmp(de->d_name, "v41_dspark") == 0)
            continue;
        snprintf(names[n++], 256, "%s", de->d_name);
    }
    closedir(d);
    for (int i = 0; i < n; i++) {
        char dir[1024];
        snprintf(dir, sizeof dir, "%s/%s", root, names[i]);
        check_fixture(dir, names[i]);
        check_bad_config(dir);
    }
    check_dspark_roff(root);
    di_test_remove_dir(g_tmp);
    if (n == 0) DI_TEST_SKIP("no v41_* fixtures");
    return test_finish();
}
