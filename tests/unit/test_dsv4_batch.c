// Ragged batched forward (di_dsv4_forward_batch): sequences at different positions, prefill
// chunks mixed with single-token decodes in one call, must give bit-identical logits to each
// sequence run alone through di_session_forward with the same chunking — in FP32 and in the
// official precision recipe, for contiguous and gathered logit rows, across compression-window
// and ring boundaries.
#include "harness.h"

#include <stdlib.h>

#include "model/dsv4.h"
#include "model/synth.h"

static char g_dir[256];

enum { N_SEQ = 5, N_STEP = 9, V = 512 };

// chunk[i][k]: tokens fed by sequence i at step k (0 = idle this step).
static const int32_t k_chunks[N_SEQ][N_STEP] = {
    {3, 1, 1, 1, 1, 1, 1, 1, 1},  // short prompt, then decodes
    {17, 0, 1, 1, 1, 1, 1, 1, 1}, // idles one step
    {8, 8, 8, 9, 1, 1, 1, 1, 1},  // chunked prefill across CSA/HCA windows and the ring
    {1, 1, 1, 1, 1, 1, 1, 1, 1},  // pure decode from position 0
    {0, 0, 0, 40, 1, 1, 1, 1, 1}, // joins late with a long chunk
};

static int32_t token_of(int seq, int32_t pos) {
    return (int32_t)((seq * 131 + pos * 97 + 7) % V);
}

static void run_case(di_precision prec) {
    di_model_options mo = di_model_options_default();
    mo.n_threads = 2;
    mo.precision = prec;
    di_model *m = NULL;
    CHECK(di_model_load(g_dir, &mo, &m) == DI_OK);
    if (!m) return;
    di_session *alone[N_SEQ], *batched[N_SEQ];
    for (int i = 0; i < N_SEQ; i++) {
        CHECK(di_session_create(m, NULL, &alone[i]) == DI_OK);
        CHECK(di_session_create(m, NULL, &batched[i]) == DI_OK);
    }
    di_dsv4_ws ws = {0};
    CHECK(di_dsv4_ws_reserve(&ws, m, 128, 64, false) == DI_OK);
    float *ref = malloc(sizeof(float) * 64 * V), *got = malloc(sizeof(float) * 128 * V);
    int32_t tokens[128], logit_rows[128];
    int64_t rows_compared = 0, mismatches = 0;
    for (int k = 0; k < N_STEP; k++) {
        di_dsv4_seq seqs[N_SEQ];
        int n_seq = 0, n_rows = 0, n_logit = 0;
        for (int i = 0; i < N_SEQ; i++) {
            int32_t n = k_chunks[i][k];
            if (!n) continue;
            di_session *b = batched[i];
            // Entry storage for this call (the session's arrays; the engine maps pool blocks).
            CHECK(di_dsv4_session_reserve(b, n) == DI_OK);
            seqs[n_seq++] = (di_dsv4_seq){.layers = b->layers, .pos = b->pos, .n_tok = n};
            for (int32_t t = 0; t < n; t++) {
                tokens[n_rows + t] = token_of(i, b->pos + t);
                // Even steps: logits of every row (contiguous); odd steps: the last row of each
                // sequence only (gathered).
                if (k % 2 == 0 || t == n - 1) logit_rows[n_logit++] = n_rows + t;
            }
            n_rows += n;
        }
        di_dsv4_ctx c = {.model = m, .ws = &ws, .seqs = seqs, .n_seq = n_seq};
        di_dsv4_forward_batch(&c, tokens, logit_rows, n_logit, got);
        CHECK_EQ(c.n_rows, n_rows);
        // The same chunks, one sequence at a time.
        int s_idx = 0, lr = 0;
        for (int i = 0; i < N_SEQ; i++) {
            int32_t n = k_chunks[i][k];
            if (!n) continue;
            di_dsv4_seq *sq = &seqs[s_idx++];
            batched[i]->pos += n;
            di_session *a = alone[i];
            int32_t toks[64];
            for (int32_t t = 0; t < n; t++) toks[t] = token_of(i, a->pos + t);
            di_forward_out fo = {.logits = ref};
            CHECK(di_session_forward(a, toks, n, &fo) == DI_OK);
            for (; lr < n_logit && logit_rows[lr] < sq->row0 + n; lr++) {
                int32_t t = logit_rows[lr] - sq->row0;
                rows_compared++;
                if (memcmp(got + (int64_t)lr * V, ref + (int64_t)t * V, sizeof(float) * V)) {
                    if (mismatches < 5) fprintf(stderr, "step %d seq %d row %d differs\n", k, i, t);
                    mismatches++;
                }
            }
        }
        CHECK_EQ(lr, n_logit);
    }
    // Final states are identical too (rings, entries, compressor buffers).
    for (int i = 0; i < N_SEQ; i++) {
        void *a = NULL, *b = NULL;
        size_t na = 0, nb = 0;
        CHECK(di_session_save(alone[i], &a, &na) == DI_OK);
        CHECK(di_session_save(batched[i], &b, &nb) == DI_OK);
        CHECK(na == nb && a && b && memcmp(a, b, na) == 0);
        di_free_buffer(a);
        di_free_buffer(b);
    }
    fprintf(stderr, "%s: %lld logit rows compared, %lld differ\n",
            prec == DI_PRECISION_OFFICIAL ? "official" : "fp32", (long long)rows_compared,
            (long long)mismatches);
    CHECK(rows_compared >= 70); // 73 rows: every row of even steps, the last rows of odd ones
    CHECK_EQ(mismatches, 0);
    free(ref);
    free(got);
    di_dsv4_ws_free(&ws);
    for (int i = 0; i < N_SEQ; i++) {
        di_session_destroy(alone[i]);
        di_session_destroy(batched[i]);
    }
    di_model_destroy(m);
}

static void test_batch_fp32(void) {
    run_case(DI_PRECISION_FP32);
}

static void test_batch_official(void) {
    run_case(DI_PRECISION_OFFICIAL);
}

int main(void) {
    snprintf(g_dir, sizeof g_dir, "/tmp/di_test_batch_XXXXXX");
    if (!mkdtemp(g_dir)) return 1;
    di_synth_config c;
    CHECK(di_synth_preset("tiny", &c) == DI_OK);
    c.n_vocab = V;
    c.official = true;
    CHECK(di_synth_write(&c, g_dir) == DI_OK);
    RUN(test_batch_fp32);
    RUN(test_batch_official);
    di_test_remove_dir(g_dir);
    return test_finish();
}
