// Context parallelism for DeepSeek V4.1 (cp/cp.h, cp/worker.h; model/dsv41.h di_dsv41_forward_cp)
// with in-process prefill workers on 127.0.0.1, on the V4.1 tiny model (window 16; kv sources:
// layer 1 CSA2 m = 2, layer 3 m = 1, read by the layers after them; Engram on layers 0 and 1, a
// look-back of 3 positions; the DSpark block). A session's long prefill split over R = 2, 3, 4
// ranks gives logits, DSpark drafts (tokens, confidences, logits) and a saved state bit-identical
// to one process, then decode steps (each with its draft) equal too, at position 0 and after a
// prefix, piece boundaries odd and even (m = 2 groups split or not) and on and off the window, the
// FP32 and the official recipes, with and without DSpark, all logits or the last row only. A
// flipped code in the message of any one state layer (main or DSpark) changes the result. A worker
// stopped: DI_ERR_IO with the session's saved bytes unchanged; the same call without the workers is
// exact. The V4.1 decoders check every length and count against the model's shapes. The serving
// engine (one V4.1 session per slot, bound to its KV blocks) with 1 and 2 workers gives the tokens
// and logprobs of an engine without, with a prefix-cache hit before a long chunk (restored from a
// tail snapshot, or replayed: that chunk runs here, the next over the workers), with DSpark
// speculation; a worker down ends the step's requests with DI_ERR_IO and the engine goes on.
#include "harness.h"

#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "base/mem.h"
#include "cp/cp.h"
#include "cp/wire.h"
#include "cp/worker.h"
#include "engine/engine_internal.h" // di_engine_create_prepared: the engine's model
#include "model/dsv41.h"
#include "model/synth.h"

enum { V = 512 }; // before cp_common.h

static char g_root[256], g_v41[300];

#include "cp_common.h" // the workers, the engine scenario

enum { MAX_W = CP_MAX_W, N_DECODE = 3, CTX = 640, B = 2 };

static di_model *load(di_precision prec, const char *addrs, int32_t min_tok) {
    return cp_load(g_v41, prec, addrs, min_tok);
}

// One run: a prefix of n_pre tokens (one call), the prompt of n tokens (the call split over the
// ranks), then N_DECODE greedy steps; with DSpark a draft after the prompt and after every step.
// Logits of the prompt's rows (or its last) and the steps in lg; the drafts in dr and their logits
// in dl; the final state's bytes.
typedef struct run_out {
    float *lg, *dl;
    di_draft dr[N_DECODE + 1];
    void *state;
    size_t n_state;
} run_out;

#define N_LG ((size_t)(CTX + N_DECODE) * V)
#define N_DL ((size_t)(N_DECODE + 1) * B * V)

static void run_alloc(run_out *r) {
    memset(r, 0, sizeof *r);
    r->lg = calloc(N_LG, 4), r->dl = calloc(N_DL, 4);
}

static void run_free(run_out *r) {
    free(r->lg), free(r->dl), di_free_buffer(r->state);
    memset(r, 0, sizeof *r);
}

static int32_t argmax(const float *x) {
    int32_t b = 0;
    for (int v = 1; v < V; v++)
        if (x[v] > x[b]) b = v;
    return b;
}

static di_status session_run(di_model *m, bool dspark, int n_pre, int n, bool last_only,
                             run_out *ro) {
    di_session_options so = di_session_options_default();
    so.mtp = dspark;
    so.n_ctx_max = CTX;
    di_session *s = NULL;
    di_status st = di_session_create(m, &so, &s);
    if (st != DI_OK) return st;
    int32_t ids[CTX];
    for (int t = 0; t < n_pre + n; t++) ids[t] = tok(t);
    float *scratch = malloc(sizeof(float) * (size_t)(n_pre + 1) * V);
    di_forward_out fo = {.logits = scratch};
    if (n_pre > 0) st = di_session_forward(s, ids, n_pre, &fo);
    free(scratch);
    fo = (di_forward_out){.logits = ro->lg, .last_only = last_only};
    if (st == DI_OK) st = di_session_forward(s, ids + n_pre, n, &fo);
    const int rows = last_only ? 1 : n;
    for (int d = 0; st == DI_OK && d <= N_DECODE; d++) {
        const int32_t next = argmax(ro->lg + (int64_t)(rows + d - 1) * V);
        if (dspark) st = di_session_draft(s, next, &ro->dr[d], ro->dl + (size_t)d * B * V);
        if (st != DI_OK || d == N_DECODE) break;
        fo = (di_forward_out){.logits = ro->lg + (int64_t)(rows + d) * V};
        st = di_session_forward(s, &next, 1, &fo);
    }
    if (st == DI_OK) st = di_session_save(s, &ro->state, &ro->n_state);
    di_session_destroy(s);
    return st;
}

static bool same(const run_out *a, const run_out *b, int n, bool last_only) {
    size_t rows = (size_t)(last_only ? 1 : n) + N_DECODE;
    return memcmp(a->lg, b->lg, rows * V * 4) == 0 && memcmp(a->dl, b->dl, N_DL * 4) == 0 &&
           memcmp(a->dr, b->dr, sizeof a->dr) == 0 && a->n_state == b->n_state &&
           memcmp(a->state, b->state, a->n_state) == 0;
}

// (prefix, prompt): pieces of n / R tokens from the prefix, so boundaries fall on odd and even
// positions (an m = 2 group split between ranks or not) and on and off multiples of the window
// (16) depending on R; the prefixes leave an m = 2 group open (37, 133) or not.
static const int g_cases[][2] = {{0, 256}, {0, 301}, {37, 263}, {133, 198}, {256, 128}};

// Under AddressSanitizer (scripts/test.sh's second stage) the matrix is a memory check: the
// release stage checks exactness on all of it; here 3 workers (the relay thread) on a case without
// and one with a prefix, in the official recipe only (its messages are the FP32 recipe's plus its
// quantised rows), and the engine on 3 ranks only, run every path at a fraction of the time (the
// sanitized stage's total is what keeps CI under 20 minutes).
#if defined(__SANITIZE_ADDRESS__)
static const bool g_sanitized = true;
#else
static const bool g_sanitized = false;
#endif

static bool case_runs(int ci) {
    return !g_sanitized || ci == 1 || ci == 3;
}

static void check_exact(di_precision prec) {
    enum { N_CASES = (int)(sizeof g_cases / sizeof g_cases[0]) };
    workers ws;
    CHECK(start(&ws, g_v41, prec, MAX_W));
    run_out ref[N_CASES][2];
    memset(ref, 0, sizeof ref);
    di_model *m = load(prec, NULL, 0);
    CHECK(m != NULL);
    for (int ci = 0; ci < N_CASES; ci++)
        if (case_runs(ci))
            for (int ds = 0; ds <= 1; ds++) {
                run_alloc(&ref[ci][ds]);
                CHECK_EQ(
                    session_run(m, ds, g_cases[ci][0], g_cases[ci][1], ci == 1 && ds, &ref[ci][ds]),
                    DI_OK);
            }
    di_model_destroy(m);
    for (int nw = g_sanitized ? MAX_W : 1; nw <= MAX_W; nw++) {
        char list[256];
        snprintf(list, sizeof list, "%s", ws.addrs);
        char *cut = list;
        for (int i = 0; i < nw && cut; i++) cut = strchr(cut + (i ? 1 : 0), ',');
        if (cut) *cut = 0;
        for (int ci = 0; ci < N_CASES; ci++) {
            if (!case_runs(ci)) continue;
            const int n_pre = g_cases[ci][0], n = g_cases[ci][1];
            di_model *f = load(prec, list, n);
            CHECK(f != NULL && f->cp != NULL);
            for (int ds = 0; ds <= 1; ds++) {
                const bool last_only = ci == 1 && ds;
                run_out b;
                run_alloc(&b);
                CHECK_EQ(session_run(f, ds, n_pre, n, last_only, &b), DI_OK);
                bool ok = same(&ref[ci][ds], &b, n, last_only);
                if (!ok)
                    fprintf(stderr, "  R=%d prefix %d prompt %d dspark %d %s: differs\n", nw + 1,
                            n_pre, n, ds, prec == DI_PRECISION_OFFICIAL ? "official" : "fp32");
                CHECK(ok);
                run_free(&b);
            }
            di_cp_stats cs;
            CHECK(di_model_cp_stats(f, &cs));
            CHECK(cs.calls >= 2 && cs.errors == 0 && cs.bytes_recv > 0 && cs.n_workers == nw);
            di_model_destroy(f);
        }
    }
    for (int ci = 0; ci < N_CASES; ci++) run_free(&ref[ci][0]), run_free(&ref[ci][1]);
    stop(&ws);
}

static void test_exact_fp32(void) {
    if (!g_sanitized) check_exact(DI_PRECISION_FP32);
}

static void test_exact_official(void) {
    check_exact(DI_PRECISION_OFFICIAL);
}

// A flipped code in the window ring of any one state layer's message changes the logits, the
// drafts or the state: each of the 6 main layers on a long prompt; the DSpark block's ring where
// the front's piece (20 positions) leaves rows of the earlier piece in it (the ring keeps window +
// rollback rows, which a rollback and then a draft read; the state's bytes hold them).
static void test_corrupt(void) {
    workers ws;
    CHECK(start(&ws, g_v41, DI_PRECISION_FP32, 1));
    di_model *ref = load(DI_PRECISION_FP32, NULL, 0);
    di_model *f = load(DI_PRECISION_FP32, ws.addrs, 64);
    CHECK(ref && f);
    run_out a, b, c;
    run_alloc(&a), run_alloc(&b), run_alloc(&c);
    CHECK_EQ(session_run(ref, true, 37, 263, false, &a), DI_OK);
    CHECK_EQ(session_run(ref, true, 37, 40, false, &c), DI_OK);
    for (int il = 0; il <= ref->hp.n_layer; il++) {
        const bool dspark = il == ref->hp.n_layer;
        const int n = dspark ? 40 : 263;
        di_cp_set_min_tokens(f->cp, dspark ? 32 : 64);
        di_cp_test_corrupt(f->cp, il);
        CHECK_EQ(session_run(f, true, 37, n, false, &b), DI_OK);
        if (same(dspark ? &c : &a, &b, n, false))
            fprintf(stderr, "  layer %d: corruption not seen\n", il);
        CHECK(!same(dspark ? &c : &a, &b, n, false));
        run_free(&b), run_alloc(&b);
        di_cp_test_corrupt(f->cp, -1);
        CHECK_EQ(session_run(f, true, 37, n, false, &b), DI_OK);
        CHECK(same(dspark ? &c : &a, &b, n, false));
        run_free(&b), run_alloc(&b);
    }
    run_free(&a), run_free(&b), run_free(&c);
    di_model_destroy(f);
    di_model_destroy(ref);
    stop(&ws);
}

// A worker down: DI_ERR_IO and the session's saved bytes unchanged; the same call without the
// workers is exact; the worker back on its port: the next call reconnects and is exact.
static void test_failures(void) {
    workers ws;
    CHECK(start(&ws, g_v41, DI_PRECISION_FP32, 2));
    const int port = di_cp_worker_port(ws.w[1]);
    di_model *ref = load(DI_PRECISION_FP32, NULL, 0);
    di_model *f = load(DI_PRECISION_FP32, ws.addrs, 64);
    CHECK(ref && f);
    int32_t ids[400];
    for (int t = 0; t < 400; t++) ids[t] = tok(t);
    float *la = malloc(sizeof(float) * 400 * V), *lb = malloc(sizeof(float) * 400 * V);
    di_session *sa = NULL, *sb = NULL;
    di_session_options so = di_session_options_default();
    so.mtp = true;
    so.n_ctx_max = CTX;
    CHECK_EQ(di_session_create(ref, &so, &sa), DI_OK);
    CHECK_EQ(di_session_create(f, &so, &sb), DI_OK);
    di_forward_out fa = {.logits = la}, fb = {.logits = lb};
    CHECK_EQ(di_session_forward(sa, ids, 101, &fa), DI_OK);
    CHECK_EQ(di_session_forward(sb, ids, 101, &fb), DI_OK); // over the workers
    CHECK(memcmp(la, lb, sizeof(float) * 101 * V) == 0);
    void *before = NULL, *after = NULL;
    size_t n_before = 0, n_after = 0;
    CHECK_EQ(di_session_save(sb, &before, &n_before), DI_OK);
    di_cp_worker_stop(ws.w[1]);
    di_model_destroy(ws.m[1]);
    ws.n = 1;
    CHECK_EQ(di_session_forward(sb, ids + 101, 199, &fb), DI_ERR_IO);
    CHECK_EQ(di_session_n_past(sb), 101);
    CHECK_EQ(di_session_save(sb, &after, &n_after), DI_OK);
    CHECK(n_before == n_after && memcmp(before, after, n_before) == 0);
    di_free_buffer(before), di_free_buffer(after);
    di_cp_stats cs;
    CHECK(di_model_cp_stats(f, &cs) && cs.errors == 1);
    di_cp_set_min_tokens(f->cp, 1 << 30);
    CHECK_EQ(di_session_forward(sa, ids + 101, 199, &fa), DI_OK);
    CHECK_EQ(di_session_forward(sb, ids + 101, 199, &fb), DI_OK);
    CHECK(memcmp(la, lb, sizeof(float) * 199 * V) == 0);
    di_cp_set_min_tokens(f->cp, 64);
    CHECK((ws.m[1] = load(DI_PRECISION_FP32, NULL, 0)) != NULL);
    CHECK_EQ(di_cp_worker_start(ws.m[1], "127.0.0.1", port, &ws.w[1]), DI_OK);
    ws.n = 2;
    CHECK_EQ(di_session_forward(sa, ids + 300, 100, &fa), DI_OK);
    CHECK_EQ(di_session_forward(sb, ids + 300, 100, &fb), DI_OK);
    CHECK(memcmp(la, lb, sizeof(float) * 100 * V) == 0);
    CHECK(di_model_cp_stats(f, &cs) && cs.errors == 1 && cs.calls >= 3);
    di_session_destroy(sa);
    di_session_destroy(sb);
    free(la), free(lb);
    di_model_destroy(f);
    di_model_destroy(ref);
    stop(&ws);
}

// The V4.1 decoders against the model's shapes: a layer message of a kv source with a byte too
// many, a wrong entry count or source flag; a job with a wrong number of history ids or an id
// outside the compressed vocabulary.
static void test_decode(void) {
    di_model *m = load(DI_PRECISION_FP32, NULL, 0);
    CHECK(m != NULL);
    di_cp_dims d;
    di_cp_dims_init(m, &d);
    CHECK(d.v41 && d.src[1] && d.ratio[1] == 2 && d.src[3] && d.ratio[3] == 1 && !d.src[2]);
    CHECK_EQ(d.n_hist, 3);
    char why[256];
    di_cp_layer41 l;
    const int64_t pos = 301, n_ent = pos / 2;
    const uint64_t len = di_cp_layer41_bytes(&d, 1, n_ent);
    CHECK_EQ(len, DI_CP_LAYER41_HEAD + 4 * (uint64_t)d.cz_floats + (uint64_t)d.ring_bytes +
                      (uint64_t)n_ent * (uint64_t)(d.ent_bytes + d.key_bytes));
    uint8_t *p = di_aligned_calloc(len + 64);
    int32_t h[2] = {1, 1};
    int64_t hh[3] = {pos, 0, n_ent};
    memcpy(p, h, 8), memcpy(p + 8, hh, 24);
    CHECK_EQ(di_cp_decode_layer41(p, len, &d, &l, why, sizeof why), DI_OK);
    CHECK(l.il == 1 && l.n == n_ent && l.from == 0 && l.cz != NULL);
    CHECK_EQ(di_cp_decode_layer41(p, len + 1, &d, &l, why, sizeof why), DI_ERR_FORMAT);
    CHECK_EQ(di_cp_decode_layer41(p, len - 1, &d, &l, why, sizeof why), DI_ERR_FORMAT);
    hh[2] = n_ent + 1;
    memcpy(p + 8, hh, 24);
    CHECK_EQ(di_cp_decode_layer41(p, len, &d, &l, why, sizeof why), DI_ERR_FORMAT);
    hh[2] = n_ent;
    memcpy(p + 8, hh, 24);
    h[1] = 0; // layer 1 is a kv source
    memcpy(p, h, 8);
    CHECK_EQ(di_cp_decode_layer41(p, len, &d, &l, why, sizeof why), DI_ERR_FORMAT);
    // Layer 2 (no source): the ring only, entries 0.
    h[0] = 2, hh[1] = hh[2] = 0;
    memcpy(p, h, 8), memcpy(p + 8, hh, 24);
    CHECK_EQ(di_cp_decode_layer41(p, di_cp_layer41_bytes(&d, 2, 0), &d, &l, why, sizeof why),
             DI_OK);
    CHECK(l.cz == NULL && l.n == 0);
    di_aligned_free(p);
    // A job of rank 1 at position 10: 3 history ids after its 2 tokens.
    const int n_state = m->hp.n_layer;
    uint8_t jb[32 + 16 * 6 + 4 * 5] = {0};
    int32_t jh[8] = {1, 3, 10, 2, 0, n_state, 3, 0}, tail[5] = {1, 2, 5, 6, 7};
    memcpy(jb, jh, sizeof jh), memcpy(jb + 32 + 16 * n_state, tail, sizeof tail);
    di_cp_job j;
    CHECK_EQ(di_cp_decode_job(jb, sizeof jb, &d, &j, why, sizeof why), DI_OK);
    CHECK(j.n_hist == 3 && j.hist[2] == 7 && j.tokens[1] == 2);
    tail[4] = d.n_hist_ids;
    memcpy(jb + 32 + 16 * n_state, tail, sizeof tail);
    CHECK_EQ(di_cp_decode_job(jb, sizeof jb, &d, &j, why, sizeof why), DI_ERR_FORMAT);
    tail[4] = 7, jh[6] = 2;
    memcpy(jb, jh, sizeof jh), memcpy(jb + 32 + 16 * n_state, tail, sizeof tail);
    CHECK_EQ(di_cp_decode_job(jb, sizeof jb, &d, &j, why, sizeof why), DI_ERR_FORMAT);
    di_model_destroy(m);
}

// ---- the serving engine ----

static void test_engine(void) {
    workers ws;
    CHECK(start(&ws, g_v41, DI_PRECISION_FP32, 2));
    // (speculation, no tail snapshots): the prefix hit restored from a snapshot or replayed.
    const int modes[3][2] = {{0, 0}, {0, 1}, {2, 0}};
    for (int mi = 0; mi < 3; mi++) {
        const int spec = modes[mi][0];
        const bool no_tail = modes[mi][1];
        eres a[E_REQ], b[E_REQ], c[E_REQ];
        int64_t calls_a, calls_b, calls_c;
        engine_run(g_v41, NULL, 0, spec, no_tail, a, &calls_a);
        engine_run(g_v41, ws.addrs, 64, spec, no_tail, c, &calls_c); // 3 ranks
        if (g_sanitized)                                             // 3 ranks only: the relay
            memcpy(b, c, sizeof b), calls_b = calls_c;
        else
            engine_run(g_v41, ws.first, 64, spec, no_tail, b, &calls_b); // 2 ranks
        // Requests 0, 2 and the chunk after request 1's hit over the workers; after a replayed hit
        // that chunk replays (in the ordinary form only from the next chunk on): it runs here.
        const int64_t want = no_tail ? 2 : 3;
        if (calls_b < want || calls_c < want)
            fprintf(stderr, "  spec %d no_tail %d: %lld / %lld calls over the workers\n", spec,
                    (int)no_tail, (long long)calls_b, (long long)calls_c);
        CHECK(calls_a == 0 && calls_b >= want && calls_c >= want);
        CHECK(a[1].n_cached > 0 && b[1].n_cached == a[1].n_cached); // the prefix hit
        for (int i = 0; i < E_REQ; i++) {
            CHECK(atomic_load(&a[i].finished) == 1 && a[i].status == DI_OK && a[i].n == E_GEN);
            bool ok = eres_same(&a[i], &b[i]) && eres_same(&a[i], &c[i]);
            if (!ok)
                fprintf(stderr, "  spec %d no_tail %d request %d differs\n", spec, (int)no_tail, i);
            CHECK(ok);
        }
    }
    // A worker down under the engine (cp_common.h).
    eres a[E_REQ];
    int64_t calls;
    engine_run(g_v41, NULL, 0, 0, false, a, &calls);
    di_engine_options o = engine_options(ws.first, 64, 0, false);
    di_engine *e = NULL;
    CHECK_EQ(di_engine_create(g_v41, &o, &e), DI_OK);
    if (e) engine_worker_down(e, &ws, a);
    di_engine_destroy(e);
    stop(&ws);
}

int main(void) {
    snprintf(g_root, sizeof g_root, "/tmp/di_test_cp41_XXXXXX");
    if (!mkdtemp(g_root)) return 1;
    snprintf(g_v41, sizeof g_v41, "%s/v41", g_root);
    mkdir(g_v41, 0755);
    // Official tensors and the DSpark block; loaded in either recipe.
    CHECK(di_synth_v41_write(g_v41, true, true, 41) == DI_OK);
    di_set_log_level(getenv("DI_TEST_LOG") ? 2 : 0);
    RUN(test_decode);
    RUN(test_exact_fp32);
    RUN(test_exact_official);
    RUN(test_corrupt);
    RUN(test_failures);
    RUN(test_engine);
    di_test_remove_dir(g_root);
    return test_finish();
}
