// Every committed fixture (tests/data/fixtures/<name>/, made by python/gen_golden.py from
// Hugging Face transformers' DeepseekV4ForCausalLM in FP32) against the C forward pass:
//   - logits and MTP logits of one prefill within 1e-4 x max|ref| (spec §6.3 acceptance);
//   - every decoder layer's output streams and attention output, and the indexer's selections;
//   - chunked and token-by-token feeding equal to the single prefill within 1e-5 relative;
//   - state save -> restore in a fresh session continues identically;
//   - the official-layout FP8/FP4 variant against its dequantised reference;
//   - greedy generation against transformers' greedy generate, where the fixture has one.
#include "harness.h"
#include "trace_ref.h"

#include <dirent.h>
#include <stdint.h>

#include "io/safetensors.h"
#include "model/dsv4.h"

// Tolerances. FP32 engines that sum in different orders differ by ~1e-6 relative per op; the
// spec's acceptance bound for logits against transformers is 1e-4 of the largest logit.
#define TOL_REF 1e-4
// Chunked vs one prefill: the same kernels on the same rows; only the attention's key order
// (ring vs this call's rows) can differ, so the bound is tighter.
#define TOL_CHUNK 1e-5
// The optimised CPU matmul (backend/cpu/gemm.h) against the reference arithmetic (its scalar
// level, bit-identical to di_ref_matmul): they differ by FMA rounding only (~1e-7 relative per
// matmul, tests/backend/test_ops.c); the acceptance bound for whole-model logits is 1e-3.
#define TOL_FAST 1e-3

typedef struct capture {
    const di_st_file *ref;
    int n_layer;
    double worst_layer, worst_attn;
    int worst_layer_il, worst_attn_il;
    int sel_mismatch, sel_checked;
} capture;

static void trace_cb(void *user, const char *name, int il, const void *data, bool is_int,
                     int64_t n_rows, int64_t row_len) {
    capture *c = user;
    double e = trace_compare(c->ref, name, il, data, is_int, n_rows, row_len, &c->sel_checked,
                             &c->sel_mismatch);
    if (is_int || e < 0) return;
    if (strcmp(name, "layer_out") == 0 && e > c->worst_layer)
        c->worst_layer = e, c->worst_layer_il = il;
    if (strcmp(name, "attn_out") == 0 && e > c->worst_attn)
        c->worst_attn = e, c->worst_attn_il = il;
}

static const float *ref_f32(const di_st_file *ref, const char *name, int64_t n_expect) {
    const di_st_tensor *t = di_st_file_find(ref, name);
    if (!t) return NULL;
    if (t->dtype != DI_DTYPE_F32 || (n_expect >= 0 && t->n_elements != n_expect)) {
        fprintf(stderr, "ref tensor %s has the wrong dtype or size\n", name);
        return NULL;
    }
    return t->data;
}

// Feeds tokens in the given chunks; writes all logits [T, V] (and MTP logits [T-1, V]).
static bool run_chunks(di_model *m, bool mtp, const int32_t *ids, int32_t T, const int32_t *chunks,
                       int n_chunks, float *logits, float *mtp_logits, di_session **keep) {
    di_session_options so = di_session_options_default();
    so.mtp = mtp;
    di_session *s = NULL;
    if (di_session_create(m, &so, &s) != DI_OK) return false;
    int64_t V = m->hp.n_vocab;
    int32_t done = 0, done_mtp = 0;
    for (int c = 0; c < n_chunks && done < T; c++) {
        int32_t n = chunks[c] < T - done ? chunks[c] : T - done, n_mtp = 0;
        di_forward_out fo = {.logits = logits + done * V,
                             .mtp_logits = mtp_logits ? mtp_logits + done_mtp * V : NULL,
                             .n_mtp_out = &n_mtp};
        if (di_session_forward(s, ids + done, n, &fo) != DI_OK) {
            di_session_destroy(s);
            return false;
        }
        done += n;
        done_mtp += n_mtp;
    }
    if (keep)
        *keep = s;
    else
        di_session_destroy(s);
    return done == T && (!mtp || done_mtp == T - 1);
}

// Logits `fast` (computed at the model's own instruction-set level) against the same forward
// pass at the scalar level, i.e. through the reference matmul arithmetic.
static void check_fast_vs_ref(di_model *m, bool mtp, const int32_t *ids, int32_t T,
                              const float *fast, float *buf, float *mtp_buf, const char *what) {
    int keep = m->cpu.isa;
    CHECK(di_cpu_set_isa(&m->cpu, DI_CPU_ISA_SCALAR));
    int32_t one[1] = {T};
    CHECK(run_chunks(m, mtp, ids, T, one, 1, buf, mtp ? mtp_buf : NULL, NULL));
    CHECK(di_cpu_set_isa(&m->cpu, (di_cpu_isa)keep));
    double e = test_rel_err(fast, buf, T * m->hp.n_vocab);
    fprintf(stderr, "  %s: %s level vs reference matmul: logits %.3g\n", what,
            di_cpu_isa_name((di_cpu_isa)keep), e);
    CHECK(e <= TOL_FAST);
}

static void check_fixture(const char *dir, const char *name) {
    char path[4096];
    fprintf(stderr, "--- fixture %s\n", name);
    snprintf(path, sizeof path, "%s/ref.safetensors", dir);
    di_st_file *ref = NULL;
    CHECK(di_st_file_open(path, &ref) == DI_OK);
    if (!ref) return;
    const di_st_tensor *ids_t = di_st_file_find(ref, "input_ids");
    CHECK(ids_t && ids_t->dtype == DI_DTYPE_I32);
    if (!ids_t) {
        di_st_file_close(ref);
        return;
    }
    const int32_t *ids = ids_t->data;
    int32_t T = (int32_t)ids_t->n_elements;

    di_model_options mo = di_model_options_default();
    mo.n_threads = 2;
    di_model *m = NULL;
    snprintf(path, sizeof path, "%s/hf", dir);
    CHECK(di_model_load(path, &mo, &m) == DI_OK);
    if (!m) {
        di_st_file_close(ref);
        return;
    }
    int64_t V = m->hp.n_vocab;
    bool mtp = m->n_mtp_loaded > 0;
    float *full = malloc(sizeof(float) * (size_t)(T * V));
    float *chunked = malloc(sizeof(float) * (size_t)(T * V));
    float *mtp_full = malloc(sizeof(float) * (size_t)(T * V));
    float *mtp_chunked = malloc(sizeof(float) * (size_t)(T * V));

    // One prefill with the trace hook.
    capture cap = {.ref = ref, .n_layer = m->hp.n_layer};
    {
        di_session_options so = di_session_options_default();
        so.mtp = mtp;
        di_session *s = NULL;
        CHECK(di_session_create(m, &so, &s) == DI_OK);
        s->trace = trace_cb;
        s->trace_user = &cap;
        int32_t n_mtp = -1;
        di_forward_out fo = {.logits = full, .mtp_logits = mtp_full, .n_mtp_out = &n_mtp};
        CHECK(di_session_forward(s, ids, T, &fo) == DI_OK);
        CHECK_EQ(n_mtp, mtp ? T - 1 : 0);
        di_session_destroy(s);
    }
    const float *ref_logits = ref_f32(ref, "logits", T * V);
    CHECK(ref_logits != NULL);
    if (ref_logits) {
        double e = test_rel_err(full, ref_logits, T * V);
        fprintf(stderr, "  logits: max|d|/max|ref| = %.3g\n", e);
        CHECK(e <= TOL_REF);
    }
    check_fast_vs_ref(m, mtp, ids, T, full, chunked, mtp_chunked, "hf layout");
    fprintf(stderr, "  worst layer_out %.3g (layer %d), attn_out %.3g (layer %d)\n",
            cap.worst_layer, cap.worst_layer_il, cap.worst_attn, cap.worst_attn_il);
    CHECK(cap.worst_layer <= TOL_REF);
    CHECK(cap.worst_attn <= TOL_REF);
    fprintf(stderr, "  indexer selections: %d queries, %d differ\n", cap.sel_checked,
            cap.sel_mismatch);
    CHECK_EQ(cap.sel_mismatch, 0);
    const float *ref_mtp = ref_f32(ref, "mtp_logits", (T - 1) * V);
    if (mtp && ref_mtp) {
        double e = test_rel_err(mtp_full, ref_mtp, (T - 1) * V);
        fprintf(stderr, "  mtp logits: %.3g\n", e);
        CHECK(e <= TOL_REF);
    } else {
        CHECK(!mtp == !ref_mtp); // both present or both absent
    }

    // Chunked (cutting compression windows) and token-by-token feeding.
    static const int32_t chunk_sets[][12] = {
        {21, 1, 1, 1, 1, 1, 1, 13, 3, 5, 7, 1 << 20}, // the spec's §6.3 step 6 shape, then more
        {1, 2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 1 << 20},
        {127, 1, 2, 130, 1 << 20},
    };
    for (size_t cs = 0; cs < sizeof chunk_sets / sizeof chunk_sets[0]; cs++) {
        int n_chunks = 0;
        while (n_chunks < 12 && chunk_sets[cs][n_chunks]) n_chunks++;
        CHECK(run_chunks(m, mtp, ids, T, chunk_sets[cs], n_chunks, chunked,
                         mtp ? mtp_chunked : NULL, NULL));
        double e = test_rel_err(chunked, full, T * V);
        double em = mtp ? test_rel_err(mtp_chunked, mtp_full, (T - 1) * V) : 0;
        fprintf(stderr, "  chunk set %zu: logits %.3g, mtp %.3g\n", cs, e, em);
        CHECK(e <= TOL_CHUNK);
        CHECK(em <= TOL_CHUNK);
    }
    {
        int32_t *ones = malloc(sizeof(int32_t) * (size_t)T);
        for (int32_t i = 0; i < T; i++) ones[i] = 1;
        CHECK(run_chunks(m, mtp, ids, T, ones, T, chunked, mtp ? mtp_chunked : NULL, NULL));
        double e = test_rel_err(chunked, full, T * V);
        double em = mtp ? test_rel_err(mtp_chunked, mtp_full, (T - 1) * V) : 0;
        fprintf(stderr, "  token by token: logits %.3g, mtp %.3g\n", e, em);
        CHECK(e <= TOL_CHUNK);
        CHECK(em <= TOL_CHUNK);
        free(ones);
    }

    // Save after a prefix that leaves every compressor mid-window, restore into a fresh session
    // and continue: the continuation's logits must equal the one-prefill logits.
    {
        int32_t cut = T / 2 + 3;
        int32_t first[1] = {cut};
        di_session *s = NULL;
        CHECK(run_chunks(m, mtp, ids, cut, first, 1, chunked, mtp ? mtp_chunked : NULL, &s));
        void *bytes = NULL;
        size_t n_bytes = 0;
        CHECK(s && di_session_save(s, &bytes, &n_bytes) == DI_OK);
        di_session_destroy(s);
        di_session_options so = di_session_options_default();
        so.mtp = mtp;
        di_session *r = NULL;
        CHECK(di_session_create(m, &so, &r) == DI_OK);
        // Corrupted and truncated states are refused and leave the session usable.
        if (bytes && n_bytes > 16) {
            ((unsigned char *)bytes)[n_bytes / 2] ^= 0x40;
            CHECK(di_session_restore(r, bytes, n_bytes) == DI_ERR_FORMAT);
            ((unsigned char *)bytes)[n_bytes / 2] ^= 0x40;
            CHECK(di_session_restore(r, bytes, n_bytes - 9) == DI_ERR_FORMAT);
            CHECK_EQ(di_session_n_past(r), 0);
        }
        CHECK(di_session_restore(r, bytes, n_bytes) == DI_OK);
        CHECK_EQ(di_session_n_past(r), cut);
        int32_t n_mtp = 0;
        di_forward_out fo = {.logits = chunked + cut * V,
                             .mtp_logits = mtp ? mtp_chunked : NULL,
                             .n_mtp_out = &n_mtp};
        CHECK(di_session_forward(r, ids + cut, T - cut, &fo) == DI_OK);
        double e = test_rel_err(chunked + cut * V, full + cut * V, (T - cut) * V);
        fprintf(stderr, "  restore at %d (%zu bytes): %.3g\n", cut, n_bytes, e);
        CHECK(e <= TOL_CHUNK);
        if (mtp)
            CHECK(test_rel_err(mtp_chunked, mtp_full + (cut - 1) * V, (T - cut) * V) <= TOL_CHUNK);
        di_free_buffer(bytes);
        di_session_destroy(r);
    }

    // Greedy generation against transformers' generate.
    const di_st_tensor *gp = di_st_file_find(ref, "gen_prompt");
    const di_st_tensor *gt = di_st_file_find(ref, "gen_tokens");
    if (gp && gt) {
        di_session *s = NULL;
        CHECK(di_session_create(m, NULL, &s) == DI_OK);
        float *lg = malloc(sizeof(float) * (size_t)V);
        di_forward_out fo = {.logits = lg, .last_only = true};
        CHECK(di_session_forward(s, gp->data, (int32_t)gp->n_elements, &fo) == DI_OK);
        const int32_t *want = gt->data;
        int matched = 0;
        for (int64_t i = 0; i < gt->n_elements; i++) {
            int32_t best = 0;
            for (int32_t v = 1; v < V; v++)
                if (lg[v] > lg[best]) best = v;
            if (best != want[i]) break;
            matched++;
            if (di_session_forward(s, &best, 1, &fo) != DI_OK) break;
        }
        fprintf(stderr, "  greedy generate: %d / %lld tokens match\n", matched,
                (long long)gt->n_elements);
        CHECK_EQ(matched, gt->n_elements);
        free(lg);
        di_session_destroy(s);
    }
    di_model_destroy(m);

    // The official-layout FP8/FP4 variant against its dequantised reference.
    const float *ref_off = ref_f32(ref, "official_logits", T * V);
    snprintf(path, sizeof path, "%s/official", dir);
    m = NULL;
    if (ref_off && di_model_load(path, &mo, &m) == DI_OK) {
        bool off_mtp = m->n_mtp_loaded > 0;
        int32_t one[1] = {T};
        CHECK(run_chunks(m, off_mtp, ids, T, one, 1, full, off_mtp ? mtp_full : NULL, NULL));
        double e = test_rel_err(full, ref_off, T * V);
        fprintf(stderr, "  official layout: logits %.3g\n", e);
        CHECK(e <= TOL_REF);
        check_fast_vs_ref(m, off_mtp, ids, T, full, chunked, mtp_chunked, "official layout");
        const float *ref_off_mtp = ref_f32(ref, "official_mtp_logits", (T - 1) * V);
        if (off_mtp && ref_off_mtp) {
            double em = test_rel_err(mtp_full, ref_off_mtp, (T - 1) * V);
            fprintf(stderr, "  official layout: mtp logits %.3g\n", em);
            CHECK(em <= TOL_REF);
        }
        di_model_destroy(m);
    } else {
        CHECK(ref_off == NULL); // a fixture with an official reference must load
    }
    free(full);
    free(chunked);
    free(mtp_full);
    free(mtp_chunked);
    di_st_file_close(ref);
}

int main(void) {
    char root[1024];
    test_src_path("tests/data/fixtures", root, sizeof root);
    DIR *d = opendir(root);
    if (!d) DI_TEST_SKIP("no fixtures directory");
    char *names[64];
    int n = 0;
    struct dirent *e;
    while ((e = readdir(d)) && n < 64)
        // v41_* are DeepSeek V4.1 fixtures (tests/model/test_v41_fixtures.c).
        if (e->d_name[0] != '.' && strncmp(e->d_name, "v41_", 4) != 0)
            names[n++] = strdup(e->d_name);
    closedir(d);
    // deterministic order
    for (int i = 1; i < n; i++)
        for (int j = i; j > 0 && strcmp(names[j - 1], names[j]) > 0; j--) {
            char *t = names[j];
            names[j] = names[j - 1];
            names[j - 1] = t;
        }
    const char *only = getenv("DI_FIXTURE");
    int checked = 0;
    for (int i = 0; i < n; i++) {
        if (!only || strcmp(only, names[i]) == 0) {
            char dir[2048];
            snprintf(dir, sizeof dir, "%s/%s", root, names[i]);
            check_fixture(dir, names[i]);
            checked++;
        }
        free(names[i]);
    }
    CHECK(checked > 0);
    return test_finish();
}
