// DeepSeek V4.1 ragged batches (di_dsv41_forward_batch) on the tiny V4.1 model (di_synth_v41_write,
// official layout with DSpark): five sessions, DSpark and plain, start at different positions
// (0 .. 40) and take rounds of prefill chunks, decodes and verifies (anchor + draft, then a
// rollback) together in one call, in a different order every round, with positions crossing the
// window (16), the ratio-2 groups, the candidate blocks and the indexer's top-k (8). Each is run
// batched and, as a twin, alone (di_session_forward). Bit for bit (memcmp): every logit row, the
// DSpark taps and candidate pools of every call, the DSpark drafts (tokens, confidences, logits)
// of the DSpark sessions drafted in one call (di_dsv41_draft_batch) after every round, and the
// whole state (di_session_save) at the end and after a further stretch of batched decodes in yet
// another order. FP32 and the official precision. Also: a call that names a session twice or feeds
// a token outside the vocabulary is refused and moves no session.
#include "harness.h"

#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "base/mem.h"
#include "model/dsv41.h"
#include "model/synth.h"

enum { N_SEQ = 5, ROUNDS = 9, MAX_ROWS = 12, DECODES = 6, CTX = 512 };

static const bool k_dspark[N_SEQ] = {true, false, true, false, true};
static const int32_t k_prefix[N_SEQ] = {0, 13, 31, 40, 17};

static char g_root[256];

static int32_t next_id(uint32_t *seed) {
    *seed = *seed * 1664525u + 1013904223u;
    return (int32_t)((*seed >> 8) % 500);
}

static int32_t argmax(const float *v, int64_t n) {
    int32_t b = 0;
    for (int64_t i = 1; i < n; i++)
        if (v[i] > v[b]) b = (int32_t)i;
    return b;
}

static di_session *session(di_model *m, bool dspark) {
    di_session_options so = di_session_options_default();
    so.n_ctx_max = CTX;
    so.mtp = dspark;
    di_session *s = NULL;
    CHECK_EQ(di_session_create(m, &so, &s), DI_OK);
    return s;
}

// The same state: the serialised bytes are equal.
static bool same_state(const di_session *a, const di_session *b) {
    void *x = NULL, *y = NULL;
    size_t nx = 0, ny = 0;
    bool same = di_session_save(a, &x, &nx) == DI_OK && di_session_save(b, &y, &ny) == DI_OK &&
                nx == ny && memcmp(x, y, nx) == 0;
    di_free(x);
    di_free(y);
    return same;
}

static void check_batches(const char *dir, di_precision prec, const char *what) {
    di_model_options mo = di_model_options_default();
    mo.n_threads = 2;
    mo.precision = prec;
    di_model *m = NULL;
    CHECK_EQ(di_model_load(dir, &mo, &m), DI_OK);
    if (!m) return;
    const di_hparams *hp = &m->hp;
    const int64_t V = hp->n_vocab, W = (int64_t)hp->n_dspark_target * hp->n_embd;
    const int32_t ntb = hp->candidate_topk_blocks;
    di_session *bat[N_SEQ], *alone[N_SEQ];
    di_dsv4_ws ws = {0}; // the batched sessions' shared workspace, as the engine's slots
    uint32_t seed[N_SEQ];
    int32_t last[N_SEQ]; // the argmax of each sequence's last logits row
    float *lb = malloc(sizeof(float) * (size_t)(N_SEQ * MAX_ROWS * V));
    float *la = malloc(sizeof(float) * (size_t)(MAX_ROWS * V));
    float *da = malloc(sizeof(float) * (size_t)(N_SEQ * 16 * V)),
          *db = malloc(sizeof(float) * 16 * V);
    float *taps = malloc(sizeof(float) * (size_t)(N_SEQ * MAX_ROWS * W));
    int32_t *cand = malloc(sizeof(int32_t) * (size_t)(N_SEQ * MAX_ROWS * (ntb + 1)));
    int32_t toks[N_SEQ][MAX_ROWS];
    int n_logit_same = 0, n_logit = 0, n_tap_bad = 0, n_cand_bad = 0, n_draft_bad = 0;
    for (int i = 0; i < N_SEQ; i++) {
        bat[i] = session(m, k_dspark[i]);
        alone[i] = session(m, k_dspark[i]);
        if (!bat[i] || !alone[i]) return;
        di_dsv41_share_ws(bat[i], &ws);
        seed[i] = 7u + 31u * (uint32_t)i;
        last[i] = 0;
        if (k_prefix[i] == 0) continue;
        int32_t pre[64];
        for (int32_t t = 0; t < k_prefix[i]; t++) pre[t] = next_id(&seed[i]);
        di_forward_out fo = {.logits = la, .last_only = true};
        CHECK_EQ(di_session_forward(bat[i], pre, k_prefix[i], &fo), DI_OK);
        CHECK_EQ(di_session_forward(alone[i], pre, k_prefix[i], NULL), DI_OK);
        last[i] = argmax(la, V);
    }
    // Rounds: sequence i takes n rows (a decode of its last argmax, a chunk of new ids, or a
    // verify [anchor, draft] with logits of both rows and the draft rolled back afterwards).
    for (int r = 0; r < ROUNDS + DECODES; r++) {
        const bool decode_only = r >= ROUNDS;
        int order[N_SEQ];
        for (int k = 0; k < N_SEQ; k++) // identity, reversed, rotations
            order[k] = r % 3 == 0 ? k : r % 3 == 1 ? N_SEQ - 1 - k : (k + r) % N_SEQ;
        di_dsv41_seq b[N_SEQ];
        int32_t verify[N_SEQ] = {0};
        for (int k = 0; k < N_SEQ; k++) {
            const int i = order[k];
            int32_t n = decode_only ? 1 : 1 + (7 * i + 5 * r) % MAX_ROWS;
            bool is_verify = !decode_only && k_dspark[i] && r % 4 == 3 && bat[i]->pos > 0;
            if (is_verify) {
                di_dsv41_draft d;
                CHECK_EQ(di_dsv41_draft_block(bat[i], last[i], &d, NULL), DI_OK);
                toks[i][0] = last[i];
                toks[i][1] = d.tokens[0];
                n = 2;
                verify[i] = 1;
            } else if (n == 1 || (i + r) % 5 == 0) {
                n = 1; // a decode of the last argmax
                toks[i][0] = last[i];
            } else {
                for (int32_t t = 0; t < n; t++) toks[i][t] = next_id(&seed[i]);
            }
            int32_t n_out = is_verify ? 2 : (i + r) % 3 == 0 ? n : (i + r) % 3 == 1 ? 1 : 0;
            if (n == 1 && !is_verify) n_out = 1;
            b[k] = (di_dsv41_seq){.s = bat[i], .tokens = toks[i], .n_tok = n, .n_out = n_out};
        }
        CHECK_EQ(di_dsv41_forward_batch(m, &ws, b, N_SEQ, lb), DI_OK);
        // Keep what the call left in the workspace's views before the twins run.
        int64_t off = 0, orow = 0;
        int64_t tap_off[N_SEQ], out_off[N_SEQ];
        for (int k = 0; k < N_SEQ; k++) {
            const int i = order[k];
            const di_dsv41_state *st = bat[i]->v41;
            tap_off[i] = off;
            out_off[i] = orow;
            if (k_dspark[i])
                memcpy(taps + off * W, st->taps, sizeof(float) * (size_t)(b[k].n_tok * W));
            memcpy(cand + off * (ntb + 1), st->cand, sizeof(int32_t) * (size_t)(b[k].n_tok * ntb));
            memcpy(cand + off * (ntb + 1) + b[k].n_tok * ntb, st->n_cand,
                   sizeof(int32_t) * (size_t)b[k].n_tok);
            off += b[k].n_tok;
            orow += b[k].n_out;
        }
        for (int k = 0; k < N_SEQ; k++) {
            const int i = order[k];
            const int32_t n = b[k].n_tok, n_out = b[k].n_out;
            di_forward_out fo = {.logits = n_out ? la : NULL, .last_only = n_out == 1};
            CHECK_EQ(di_session_forward(alone[i], toks[i], n, &fo), DI_OK);
            if (n_out > 0) {
                n_logit++;
                const float *lo = n_out == 1 || n_out == n ? la : NULL;
                n_logit_same +=
                    lo && !memcmp(lb + out_off[i] * V, lo, sizeof(float) * (size_t)(n_out * V));
                last[i] = argmax(la + (int64_t)(n_out - 1) * V, V);
            }
            const di_dsv41_state *st = alone[i]->v41;
            if (k_dspark[i])
                n_tap_bad +=
                    memcmp(taps + tap_off[i] * W, st->taps, sizeof(float) * (size_t)(n * W)) != 0;
            // Candidate pools: the kept blocks of every row (entries past n_cand are stale).
            const int32_t *kc = cand + tap_off[i] * (ntb + 1), *kn = kc + n * ntb;
            for (int32_t t = 0; t < n; t++)
                n_cand_bad +=
                    kn[t] != st->n_cand[t] ||
                    memcmp(kc + t * ntb, st->cand + t * ntb, sizeof(int32_t) * (size_t)kn[t]) != 0;
            if (verify[i]) { // reject the draft: both take it back, the anchor stays
                CHECK_EQ(di_dsv41_rollback(bat[i], 1), DI_OK);
                CHECK_EQ(di_dsv41_rollback(alone[i], 1), DI_OK);
                last[i] = argmax(la, V); // the anchor row's token
            }
            CHECK_EQ(bat[i]->pos, alone[i]->pos);
        }
        // The DSpark sessions draft in one call, in this round's order, vs each alone.
        di_dsv41_draft_seq ds[N_SEQ];
        int nd = 0, di[N_SEQ];
        for (int k = 0; k < N_SEQ; k++)
            if (k_dspark[order[k]]) {
                di[nd] = order[k];
                ds[nd++] = (di_dsv41_draft_seq){.s = bat[order[k]], .anchor = last[order[k]]};
            }
        CHECK_EQ(di_dsv41_draft_batch(m, &ws, ds, nd, da), DI_OK);
        for (int j = 0; j < nd; j++) {
            di_dsv41_draft d;
            memset(&d, 0, sizeof d);
            CHECK_EQ(di_dsv41_draft_block(alone[di[j]], last[di[j]], &d, db), DI_OK);
            n_draft_bad += memcmp(&d, &ds[j].out, sizeof d) != 0 ||
                           memcmp(da + (int64_t)j * d.n * V, db, sizeof(float) * (size_t)(d.n * V));
        }
        if (r == ROUNDS - 1)
            for (int i = 0; i < N_SEQ; i++) CHECK(same_state(bat[i], alone[i]));
    }
    int n_state_same = 0;
    for (int i = 0; i < N_SEQ; i++) n_state_same += same_state(bat[i], alone[i]);
    fprintf(stderr,
            "%s: %d/%d logit sets bit-identical batched vs alone, taps %d bad, candidate pools %d "
            "bad, drafts %d bad, %d/%d states identical (positions %d %d %d %d %d)\n",
            what, n_logit_same, n_logit, n_tap_bad, n_cand_bad, n_draft_bad, n_state_same, N_SEQ,
            bat[0]->pos, bat[1]->pos, bat[2]->pos, bat[3]->pos, bat[4]->pos);
    CHECK_EQ(n_logit_same, n_logit);
    CHECK(n_logit > 0);
    CHECK_EQ(n_tap_bad, 0);
    CHECK_EQ(n_cand_bad, 0);
    CHECK_EQ(n_draft_bad, 0);
    CHECK_EQ(n_state_same, N_SEQ);
    for (int i = 0; i < N_SEQ; i++) CHECK(bat[i]->pos > hp->window + 2 * hp->index_topk);

    // Refusals move nothing: a session twice, a token outside the vocabulary.
    int32_t ok_tok[1] = {1}, bad_tok[1] = {(int32_t)V};
    const int32_t p0 = bat[0]->pos, p1 = bat[1]->pos;
    di_dsv41_seq twice[2] = {{.s = bat[0], .tokens = ok_tok, .n_tok = 1, .n_out = 1},
                             {.s = bat[0], .tokens = ok_tok, .n_tok = 1, .n_out = 1}};
    CHECK_EQ(di_dsv41_forward_batch(m, &ws, twice, 2, lb), DI_ERR_INVALID);
    di_dsv41_seq bad[2] = {{.s = bat[0], .tokens = ok_tok, .n_tok = 1, .n_out = 1},
                           {.s = bat[1], .tokens = bad_tok, .n_tok = 1, .n_out = 1}};
    CHECK_EQ(di_dsv41_forward_batch(m, &ws, bad, 2, lb), DI_ERR_INVALID);
    CHECK_EQ(bat[0]->pos, p0);
    CHECK_EQ(bat[1]->pos, p1);
    CHECK(same_state(bat[0], alone[0]));

    for (int i = 0; i < N_SEQ; i++) {
        di_session_destroy(bat[i]);
        di_session_destroy(alone[i]);
    }
    di_dsv4_ws_free(&ws);
    free(lb);
    free(la);
    free(da);
    free(db);
    free(taps);
    free(cand);
    di_model_destroy(m);
}

int main(void) {
    snprintf(g_root, sizeof g_root, "/tmp/di_test_dsv41_batch_XXXXXX");
    if (!mkdtemp(g_root)) return 1;
    CHECK(di_synth_v41_write(g_root, true, true, 41) == DI_OK);
    check_batches(g_root, DI_PRECISION_FP32, "fp32");
    check_batches(g_root, DI_PRECISION_OFFICIAL, "official precision");
    di_test_remove_dir(g_root);
    return test_finish();
}
