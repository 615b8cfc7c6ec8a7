// Context parallelism across processes (cp/cp.h, cp/worker.h) with in-process prefill workers on
// 127.0.0.1: a session's long prefill split over R = 2, 3, 4 ranks gives logits, MTP logits and a
// saved state bit-identical to one process, then decode steps equal too, for prompts at position 0
// and after a prefix, piece boundaries on and off the compression windows (CSA m = 4, HCA m = 128,
// window W = 16), the FP32 and the official recipes, with and without MTP, all logits or the last
// row only. A flipped float in one layer message changes the logits (the comparison sees a broken
// message). A worker stopped: the call fails with DI_ERR_IO and leaves the session as it was (the
// same call without the workers is exact); restarted on its port, the next call reconnects. A
// model mismatch (a V4.1 front on a V4 worker too) is refused at load; malformed frames are
// answered with errors. The serving engine with 1 and 2 workers gives the tokens and logprobs of an
// engine without, with a prefix-cache hit before a long chunk; a worker down ends the step's
// requests with DI_ERR_IO and the engine goes on.
#include "harness.h"

#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "base/mem.h"
#include "base/sock.h"
#include "cp/cp.h"
#include "cp/wire.h"
#include "cp/worker.h"
#include "engine/engine_internal.h" // di_engine_create_prepared: the engine's model
#include "model/dsv4.h"
#include "model/synth.h"

enum { V = 512 }; // before cp_common.h

static char g_root[256], g_v4[300], g_v41[300];

#include "cp_common.h" // the workers, the engine scenario

enum { MAX_W = CP_MAX_W, N_DECODE = 3, CTX = 640 };
// One run: a prefix of n_pre tokens (one call), the prompt of n tokens (one call: the one split
// over the ranks), then N_DECODE greedy steps. Main logits of every row of the prompt and the
// steps go to lg [(n + N_DECODE) V] (last_only: only the prompt's last row, then the steps), MTP
// rows to ml; the final state's bytes to *state. DI_OK or the first failing call's status.
typedef struct run_out {
    float *lg, *ml;
    int32_t n_ml;
    void *state;
    size_t n_state;
} run_out;

static di_status session_run(di_model *m, bool mtp, int n_pre, int n, bool last_only, run_out *ro) {
    di_session_options so = di_session_options_default();
    so.mtp = mtp;
    so.n_ctx_max = CTX;
    di_session *s = NULL;
    di_status st = di_session_create(m, &so, &s);
    if (st != DI_OK) return st;
    int32_t ids[CTX], n_mtp = 0;
    for (int t = 0; t < n_pre + n; t++) ids[t] = tok(t);
    float *scratch = malloc(sizeof(float) * (size_t)(n_pre + 1) * V * 2);
    di_forward_out fo = {
        .logits = scratch, .mtp_logits = mtp ? scratch + n_pre * V : NULL, .n_mtp_out = &n_mtp};
    if (n_pre > 0) st = di_session_forward(s, ids, n_pre, &fo);
    free(scratch);
    ro->n_ml = 0;
    fo = (di_forward_out){
        .logits = ro->lg, .last_only = last_only, .mtp_logits = ro->ml, .n_mtp_out = &n_mtp};
    if (st == DI_OK) st = di_session_forward(s, ids + n_pre, n, &fo);
    ro->n_ml += n_mtp;
    int rows = last_only ? 1 : n;
    for (int d = 0; st == DI_OK && d < N_DECODE; d++) {
        const float *last = ro->lg + (int64_t)(rows + d - 1) * V;
        int32_t next = 0;
        for (int v = 1; v < V; v++)
            if (last[v] > last[next]) next = v;
        fo = (di_forward_out){.logits = ro->lg + (int64_t)(rows + d) * V,
                              .mtp_logits = ro->ml ? ro->ml + (int64_t)ro->n_ml * V : NULL,
                              .n_mtp_out = &n_mtp};
        st = di_session_forward(s, &next, 1, &fo);
        ro->n_ml += n_mtp;
    }
    if (st == DI_OK) st = di_session_save(s, &ro->state, &ro->n_state);
    di_session_destroy(s);
    return st;
}

#define N_LG ((size_t)(CTX + N_DECODE) * V)

static void run_free(run_out *r) {
    free(r->lg), free(r->ml), di_free_buffer(r->state);
    memset(r, 0, sizeof *r);
}

static void run_alloc(run_out *r) {
    memset(r, 0, sizeof *r);
    r->lg = calloc(N_LG, 4), r->ml = calloc(N_LG, 4);
}

static bool same(const run_out *a, const run_out *b, int n, bool last_only) {
    size_t rows = (size_t)(last_only ? 1 : n) + N_DECODE;
    return memcmp(a->lg, b->lg, rows * V * 4) == 0 && a->n_ml == b->n_ml &&
           memcmp(a->ml, b->ml, (size_t)a->n_ml * V * 4) == 0 && a->n_state == b->n_state &&
           memcmp(a->state, b->state, a->n_state) == 0;
}

// (prefix, prompt) pairs: pieces of n / R tokens from p0, so boundaries fall on and off multiples
// of 4 (CSA), 128 (HCA) and 16 (the window) depending on R; the prefixes cross CSA windows, an HCA
// window and leave partial windows open.
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
    CHECK(start(&ws, g_v4, prec, MAX_W));
    // One process, once per case: the reference of every rank count.
    run_out ref[N_CASES][2];
    memset(ref, 0, sizeof ref);
    di_model *m = cp_load(g_v4, prec, NULL, 0);
    CHECK(m != NULL);
    for (int ci = 0; ci < N_CASES; ci++)
        if (case_runs(ci))
            for (int mtp = 0; mtp <= 1; mtp++) {
                run_alloc(&ref[ci][mtp]);
                CHECK_EQ(session_run(m, mtp, g_cases[ci][0], g_cases[ci][1], ci == 1 && mtp,
                                     &ref[ci][mtp]),
                         DI_OK);
            }
    di_model_destroy(m);
    for (int nw = g_sanitized ? MAX_W : 1; nw <= MAX_W; nw++) {
        // The first nw workers: R = nw + 1 ranks.
        char list[256];
        snprintf(list, sizeof list, "%s", ws.addrs);
        char *cut = list;
        for (int i = 0; i < nw && cut; i++) cut = strchr(cut + (i ? 1 : 0), ',');
        if (cut) *cut = 0;
        for (int ci = 0; ci < N_CASES; ci++) {
            if (!case_runs(ci)) continue;
            const int n_pre = g_cases[ci][0], n = g_cases[ci][1];
            // Only the prompt call is split (the prefix is shorter than the threshold or runs
            // alone); a prefix as long as the prompt goes over the workers too.
            di_model *f = cp_load(g_v4, prec, list, n);
            CHECK(f != NULL && f->cp != NULL);
            for (int mtp = 0; mtp <= 1; mtp++) {
                const bool last_only = ci == 1 && mtp;
                run_out b;
                run_alloc(&b);
                CHECK_EQ(session_run(f, mtp, n_pre, n, last_only, &b), DI_OK);
                bool ok = same(&ref[ci][mtp], &b, n, last_only);
                if (!ok)
                    fprintf(stderr, "  R=%d prefix %d prompt %d mtp %d %s: differs\n", nw + 1,
                            n_pre, n, mtp, prec == DI_PRECISION_OFFICIAL ? "official" : "fp32");
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

// A flipped float in the layer messages of one layer changes the logits: the exactness checks
// above would see a broken message.
static void test_corrupt(void) {
    workers ws;
    CHECK(start(&ws, g_v4, DI_PRECISION_FP32, 1));
    di_model *ref = cp_load(g_v4, DI_PRECISION_FP32, NULL, 0);
    di_model *f = cp_load(g_v4, DI_PRECISION_FP32, ws.addrs, 64);
    CHECK(ref && f);
    run_out a, b;
    run_alloc(&a), run_alloc(&b);
    CHECK_EQ(session_run(ref, true, 37, 263, false, &a), DI_OK);
    for (int il = 0; il <= ref->hp.n_layer; il++) { // every main layer and the MTP block
        di_cp_test_corrupt(f->cp, il);
        CHECK_EQ(session_run(f, true, 37, 263, false, &b), DI_OK);
        CHECK(!same(&a, &b, 263, false));
        run_free(&b), run_alloc(&b);
    }
    di_cp_test_corrupt(f->cp, -1);
    CHECK_EQ(session_run(f, true, 37, 263, false, &b), DI_OK);
    CHECK(same(&a, &b, 263, false));
    run_free(&a), run_free(&b);
    di_model_destroy(f);
    di_model_destroy(ref);
    stop(&ws);
}

// A worker down: DI_ERR_IO, the session as before the call; the same call without the workers is
// exact; the worker back on its port: the next call reconnects and is exact again.
static void test_failures(void) {
    workers ws;
    CHECK(start(&ws, g_v4, DI_PRECISION_FP32, 2));
    const int port = di_cp_worker_port(ws.w[1]);
    di_model *ref = cp_load(g_v4, DI_PRECISION_FP32, NULL, 0);
    di_model *f = cp_load(g_v4, DI_PRECISION_FP32, ws.addrs, 64);
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
    CHECK_EQ(di_session_forward(sa, ids, 100, &fa), DI_OK);
    CHECK_EQ(di_session_forward(sb, ids, 100, &fb), DI_OK); // over the workers
    di_cp_worker_stop(ws.w[1]);
    di_model_destroy(ws.m[1]);
    ws.n = 1;
    CHECK_EQ(di_session_forward(sb, ids + 100, 200, &fb), DI_ERR_IO);
    CHECK_EQ(di_session_n_past(sb), 100);
    di_cp_stats cs;
    CHECK(di_model_cp_stats(f, &cs) && cs.errors == 1);
    // The same call on this process alone: exact.
    di_cp_set_min_tokens(f->cp, 1 << 30);
    CHECK_EQ(di_session_forward(sa, ids + 100, 200, &fa), DI_OK);
    CHECK_EQ(di_session_forward(sb, ids + 100, 200, &fb), DI_OK);
    CHECK(memcmp(la, lb, sizeof(float) * 200 * V) == 0);
    // The worker back on its port: the next call over the workers reconnects.
    di_cp_set_min_tokens(f->cp, 64);
    CHECK((ws.m[1] = cp_load(g_v4, DI_PRECISION_FP32, NULL, 0)) != NULL);
    CHECK_EQ(di_cp_worker_start(ws.m[1], "127.0.0.1", port, &ws.w[1]), DI_OK);
    ws.n = 2;
    CHECK_EQ(di_session_forward(sa, ids + 300, 100, &fa), DI_OK);
    CHECK_EQ(di_session_forward(sb, ids + 300, 100, &fb), DI_OK);
    CHECK(memcmp(la, lb, sizeof(float) * 100 * V) == 0);
    di_session_destroy(sa);
    di_session_destroy(sb);
    free(la), free(lb);
    di_model_destroy(f);
    di_model_destroy(ref);
    stop(&ws);
}

// Refused at load: a worker running another precision recipe (model identity), a V4 front on a
// V4.1 worker (model identity).
static void test_refusals(void) {
    workers ws;
    CHECK(start(&ws, g_v4, DI_PRECISION_OFFICIAL, 1));
    CHECK(cp_load(g_v4, DI_PRECISION_FP32, ws.addrs, 0) == NULL);
    di_model_options o = di_model_options_default();
    o.n_threads = 1;
    o.cp_workers = ws.addrs;
    di_model *m = NULL;
    CHECK_EQ(di_model_load(g_v41, &o, &m), DI_ERR_INVALID);
    o.cp_workers = "no-port";
    CHECK_EQ(di_model_load(g_v4, &o, &m), DI_ERR_INVALID);
    stop(&ws);
}

// Malformed frames get an error reply and the worker goes on serving.
static void test_frames(void) {
    workers ws;
    CHECK(start(&ws, g_v4, DI_PRECISION_FP32, 1));
    const int port = di_cp_worker_port(ws.w[0]);
    di_cp_hdr h;
    char why[256];
    // Garbage instead of a header.
    int fd = di_sock_connect("test", "127.0.0.1", port, 5000);
    CHECK(fd >= 0);
    CHECK_EQ(di_sock_send_all(fd, "0123456789abcdef", 16), DI_OK);
    CHECK_EQ(di_cp_recv_hdr(fd, &h, why, sizeof why), DI_OK);
    CHECK_EQ(h.type, DI_CP_ERROR);
    close(fd);
    // A job before the handshake.
    fd = di_sock_connect("test", "127.0.0.1", port, 5000);
    int32_t job[8] = {0, 2, 0, 1, 0, 6, 0, 0};
    CHECK_EQ(di_cp_send_frame(fd, DI_CP_JOB, job, sizeof job), DI_OK);
    CHECK_EQ(di_cp_recv_hdr(fd, &h, why, sizeof why), DI_OK);
    CHECK_EQ(h.type, DI_CP_ERROR);
    close(fd);
    // A wrong model identity, then a malformed job after a good handshake.
    di_model *f = cp_load(g_v4, DI_PRECISION_FP32, NULL, 0);
    fd = di_sock_connect("test", "127.0.0.1", port, 5000);
    uint64_t bad = 1;
    CHECK_EQ(di_cp_send_frame(fd, DI_CP_HELLO, &bad, 8), DI_OK);
    CHECK_EQ(di_cp_recv_hdr(fd, &h, why, sizeof why), DI_OK);
    CHECK_EQ(h.type, DI_CP_ERROR);
    char text[DI_CP_MAX_TEXT];
    CHECK(h.len < sizeof text && di_sock_recv_all(fd, text, (size_t)h.len) == DI_OK);
    text[h.len] = 0;
    CHECK(strstr(text, "model mismatch") != NULL);
    uint64_t id = di_dsv4_model_id(f);
    CHECK_EQ(di_cp_send_frame(fd, DI_CP_HELLO, &id, 8), DI_OK);
    CHECK_EQ(di_cp_recv_hdr(fd, &h, why, sizeof why), DI_OK);
    CHECK_EQ(h.type, DI_CP_OK);
    CHECK_EQ(di_cp_send_frame(fd, DI_CP_JOB, job, sizeof job), DI_OK); // no from / tokens
    CHECK_EQ(di_cp_recv_hdr(fd, &h, why, sizeof why), DI_OK);
    CHECK_EQ(h.type, DI_CP_ERROR);
    close(fd);
    // Still serving: a split call is exact.
    di_model *ref = cp_load(g_v4, DI_PRECISION_FP32, NULL, 0);
    di_model *g = cp_load(g_v4, DI_PRECISION_FP32, ws.addrs, 64);
    run_out a, b;
    run_alloc(&a), run_alloc(&b);
    CHECK_EQ(session_run(ref, false, 0, 128, false, &a), DI_OK);
    CHECK_EQ(session_run(g, false, 0, 128, false, &b), DI_OK);
    CHECK(same(&a, &b, 128, false));
    run_free(&a), run_free(&b);
    di_model_destroy(g);
    di_model_destroy(ref);
    di_model_destroy(f);
    stop(&ws);
}

// The decoders against the model's shapes: a layer message with one float too many or a wrong
// entry count, a job with a token outside the vocabulary.
static void test_decode(void) {
    di_model *m = cp_load(g_v4, DI_PRECISION_FP32, NULL, 0);
    CHECK(m != NULL);
    di_cp_dims d;
    di_cp_dims_init(m, &d);
    const int il = 2; // an HCA layer (m = 128)
    CHECK_EQ(d.ratio[il], 128);
    const int64_t pos = 300, n_ent = pos / 128;
    const uint64_t len =
        di_cp_layer_head_bytes(1) +
        4 * (uint64_t)(d.ring_floats + 2 * d.cmp_ring_floats[il][0] + n_ent * d.cmp_d[il][0]);
    uint8_t *p = di_aligned_calloc(len + 64);
    int32_t h[2] = {il, 1};
    int64_t hh[3] = {pos, 0, n_ent};
    memcpy(p, h, 8), memcpy(p + 8, hh, 24);
    di_cp_layer l;
    char why[256];
    CHECK_EQ(di_cp_decode_layer(p, len, &d, &l, why, sizeof why), DI_OK);
    CHECK(l.il == il && l.cmp[0].n == n_ent && l.cmp[0].from == 0);
    CHECK_EQ(di_cp_decode_layer(p, len + 4, &d, &l, why, sizeof why), DI_ERR_FORMAT);
    hh[2] = n_ent + 1;
    memcpy(p + 8, hh, 24);
    CHECK_EQ(di_cp_decode_layer(p, len, &d, &l, why, sizeof why), DI_ERR_FORMAT);
    di_aligned_free(p);
    uint8_t jb[32 + 16 * 6 + 8] = {0};
    int32_t jh[8] = {0, 2, 0, 2, 0, 6, 0, 0}, toks[2] = {1, V};
    memcpy(jb, jh, sizeof jh), memcpy(jb + 32 + 96, toks, 8);
    di_cp_job j;
    CHECK_EQ(di_cp_decode_job(jb, sizeof jb, &d, &j, why, sizeof why), DI_ERR_FORMAT);
    toks[1] = V - 1;
    memcpy(jb + 32 + 96, toks, 8);
    CHECK_EQ(di_cp_decode_job(jb, sizeof jb, &d, &j, why, sizeof why), DI_OK);
    CHECK(j.n_tok == 2 && j.tokens[1] == V - 1);
    di_model_destroy(m);
}

// ---- the serving engine ----

static void test_engine(void) {
    workers ws;
    CHECK(start(&ws, g_v4, DI_PRECISION_FP32, 2));
    eres a[E_REQ], b[E_REQ], c[E_REQ];
    int64_t calls_a, calls_b, calls_c;
    engine_run(g_v4, NULL, 0, 0, false, a, &calls_a);
    engine_run(g_v4, ws.addrs, 64, 0, false, c, &calls_c); // 3 ranks
    if (g_sanitized)                                       // 3 ranks only: the relay
        memcpy(b, c, sizeof b), calls_b = calls_c;
    else
        engine_run(g_v4, ws.first, 64, 0, false, b, &calls_b); // 2 ranks
    CHECK(calls_a == 0 && calls_b >= 3 && calls_c >= 3);
    CHECK(a[1].n_cached > 0 && b[1].n_cached == a[1].n_cached); // the prefix hit
    for (int i = 0; i < E_REQ; i++) {
        CHECK(atomic_load(&a[i].finished) == 1 && a[i].status == DI_OK && a[i].n == E_GEN);
        CHECK(eres_same(&a[i], &b[i]) && eres_same(&a[i], &c[i]));
    }
    // Its worker unreachable at load: the engine is refused; back on its port, it is created, and
    // then the worker goes down under it.
    const int port = di_cp_worker_port(ws.w[0]);
    di_cp_worker_stop(ws.w[0]);
    di_engine_options o = engine_options(ws.first, 64, 0, false);
    di_engine *e = NULL;
    CHECK_EQ(di_engine_create(g_v4, &o, &e), DI_ERR_IO);
    e = NULL;
    CHECK_EQ(di_cp_worker_start(ws.m[0], "127.0.0.1", port, &ws.w[0]), DI_OK);
    CHECK_EQ(di_engine_create(g_v4, &o, &e), DI_OK);
    if (e) engine_worker_down(e, &ws, a);
    di_engine_destroy(e);
    stop(&ws);
}

int main(void) {
    snprintf(g_root, sizeof g_root, "/tmp/di_test_cp_XXXXXX");
    if (!mkdtemp(g_root)) return 1;
    snprintf(g_v4, sizeof g_v4, "%s/v4", g_root);
    snprintf(g_v41, sizeof g_v41, "%s/v41", g_root);
    mkdir(g_v4, 0755);
    mkdir(g_v41, 0755);
    di_synth_config c;
    CHECK(di_synth_preset("tiny-128", &c) == DI_OK); // V4's ratios: CSA 4, HCA 128; window 16
    c.n_vocab = V;
    c.official = true; // FP8/FP4 experts and the MTP block
    CHECK(di_synth_write(&c, g_v4) == DI_OK);
    CHECK(di_synth_v41_write(g_v41, true, false, 41) == DI_OK);
    di_set_log_level(getenv("DI_TEST_LOG") ? 2 : 0);
    RUN(test_decode);
    RUN(test_exact_fp32);
    RUN(test_exact_official);
    RUN(test_corrupt);
    RUN(test_failures);
    RUN(test_refusals);
    RUN(test_frames);
    RUN(test_engine);
    di_test_remove_dir(g_root);
    return test_finish();
}
