// Expert parallelism across processes (ep/ep.h, ep/worker.h) with in-process workers on
// 127.0.0.1: session logits (main and MTP) over a prompt and decode steps bit-identical to one
// process for V4 and V4.1, FP32 and official recipes, 1 and 2 workers and a placement with every
// expert replicated on two ranks (rows split between replicas); the engine's tokens with EP equal
// to without; a worker stopped (the forward fails with DI_ERR_IO) and restarted on its port (the
// next forward reconnects and is exact again), also under the engine (the step's requests end with
// the error, the engine goes on; a probe reconnects it and ends the failure streak); two fronts
// sharing a worker at the same time; a model mismatch refused at load; malformed frames answered
// with errors while the worker keeps serving; online EPLB (the engine re-planning the placement
// every two steps, with redundant replicas) and a placement file keeping the engine's tokens exact;
// a bad placement file or one without workers refused.
#include "harness.h"

#include <netinet/in.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include "ep/ep.h"
#include "ep/eplb.h"
#include "ep/wire.h"
#include "engine/engine_internal.h" // di_engine_eplb_hold
#include "ep/worker.h"
#include "model/dsv4.h"
#include "model/synth.h"

enum { V = 512, N_REQ = 6, MAX_GEN = 24, N_TOP = 3, T_PROMPT = 40, N_DECODE = 4, MAX_W = 2 };

static char g_root[256], g_v4[300], g_v41[300];
#include "engine_requests.h" // g_prompt, g_len, result, on_event, request, same

static di_model *load(const char *dir, di_precision prec, const char *workers) {
    di_model_options o = di_model_options_default();
    o.n_threads = 1;
    o.precision = prec;
    o.ep_workers = workers;
    di_model *m = NULL;
    return di_model_load(dir, &o, &m) == DI_OK ? m : NULL;
}

// n workers, each with its own copy of the model, on free ports; their list in addrs.
typedef struct workers {
    di_model *m[MAX_W];
    di_ep_worker *w[MAX_W];
    int n;
    char addrs[256];
} workers;

static bool start(workers *ws, const char *dir, di_precision prec, int n) {
    memset(ws, 0, sizeof *ws);
    ws->n = n;
    size_t off = 0;
    for (int i = 0; i < n; i++) {
        if (!(ws->m[i] = load(dir, prec, NULL))) return false;
        if (di_ep_worker_start(ws->m[i], "127.0.0.1", 0, &ws->w[i]) != DI_OK) return false;
        off += (size_t)snprintf(ws->addrs + off, sizeof ws->addrs - off, "%s127.0.0.1:%d",
                                i ? "," : "", di_ep_worker_port(ws->w[i]));
    }
    return true;
}

static void stop(workers *ws) {
    for (int i = 0; i < ws->n; i++) {
        di_ep_worker_stop(ws->w[i]);
        di_model_destroy(ws->m[i]);
    }
}

// A prompt of T_PROMPT tokens then N_DECODE greedy steps: every main logit row into lg
// [(T_PROMPT + N_DECODE) V] and every MTP row into ml (when the session runs MTP). DI_OK or the
// first failing forward's status.
static di_status session_run(di_model *m, bool mtp, float *lg, float *ml) {
    di_session_options so = di_session_options_default();
    so.mtp = mtp;
    so.n_ctx_max = 128;
    di_session *s = NULL;
    di_status st = di_session_create(m, &so, &s);
    if (st != DI_OK) return st;
    int32_t ids[T_PROMPT], n_mtp = 0, n_ml = 0;
    for (int t = 0; t < T_PROMPT; t++) ids[t] = (int32_t)((t * 131 + 7) % V);
    di_forward_out fo = {.logits = lg, .mtp_logits = ml, .n_mtp_out = &n_mtp};
    st = di_session_forward(s, ids, T_PROMPT, &fo);
    n_ml += n_mtp;
    for (int d = 0; st == DI_OK && d < N_DECODE; d++) {
        const float *last = lg + (int64_t)(T_PROMPT + d - 1) * V;
        int32_t tok = 0;
        for (int v = 1; v < V; v++)
            if (last[v] > last[tok]) tok = v;
        fo = (di_forward_out){.logits = lg + (int64_t)(T_PROMPT + d) * V,
                              .mtp_logits = ml ? ml + (int64_t)n_ml * V : NULL,
                              .n_mtp_out = &n_mtp};
        st = di_session_forward(s, &tok, 1, &fo);
        n_ml += n_mtp;
    }
    di_session_destroy(s);
    return st;
}

#define N_LG ((size_t)(T_PROMPT + N_DECODE) * V)

// Every expert on two ranks: slot e on rank e mod R, slot E + e on rank (e + 1) mod R.
static void replicated(const di_model *m, int32_t R, di_ep_placement *p) {
    const int32_t L = di_ep_moe_layers(m), E = m->hp.n_expert;
    CHECK_EQ(di_ep_placement_alloc(L, E, R, 2 * E, p), DI_OK);
    for (int32_t l = 0; l < L; l++)
        for (int32_t e = 0; e < E; e++) {
            p->expert[l * 2 * E + e] = e, p->rank[l * 2 * E + e] = e % R;
            p->expert[l * 2 * E + E + e] = e, p->rank[l * 2 * E + E + e] = (e + 1) % R;
        }
}

static void check_exact(const char *dir, di_precision prec, bool mtp, const char *what) {
    fprintf(stderr, "  %s\n", what);
    float *ref = malloc(N_LG * 4), *got = malloc(N_LG * 4), *mref = malloc(N_LG * 4),
          *mgot = malloc(N_LG * 4);
    di_model *m = load(dir, prec, NULL);
    CHECK(m != NULL);
    memset(mref, 0, N_LG * 4);
    CHECK_EQ(session_run(m, mtp, ref, mtp ? mref : NULL), DI_OK);
    di_model_destroy(m);
    for (int n = 1; n <= MAX_W; n++) {
        workers ws;
        CHECK(start(&ws, dir, prec, n));
        di_model *f = load(dir, prec, ws.addrs);
        CHECK(f != NULL && f->ep != NULL);
        memset(got, 0xff, N_LG * 4), memset(mgot, 0, N_LG * 4);
        CHECK_EQ(session_run(f, mtp, got, mtp ? mgot : NULL), DI_OK);
        CHECK(memcmp(ref, got, N_LG * 4) == 0);
        CHECK(memcmp(mref, mgot, N_LG * 4) == 0);
        di_ep_worker_stats st[MAX_W];
        CHECK_EQ(di_model_ep_stats(f, st, MAX_W), n);
        for (int i = 0; i < n; i++) CHECK(st[i].calls > 0 && st[i].rows > 0 && !st[i].errors);
        // Every expert replicated on two ranks: rows split between replicas, still exact.
        di_ep_placement p;
        replicated(f, n + 1, &p);
        CHECK_EQ(di_ep_set_placement(f->ep, &p), DI_OK);
        memset(got, 0xff, N_LG * 4), memset(mgot, 0, N_LG * 4);
        CHECK_EQ(session_run(f, mtp, got, mtp ? mgot : NULL), DI_OK);
        CHECK(memcmp(ref, got, N_LG * 4) == 0);
        CHECK(memcmp(mref, mgot, N_LG * 4) == 0);
        // A placement of another shape is refused and changes nothing.
        p.n_ranks = n + 2;
        CHECK_EQ(di_ep_set_placement(f->ep, &p), DI_ERR_INVALID);
        di_ep_placement_free(&p);
        di_model_destroy(f);
        stop(&ws);
    }
    free(ref), free(got), free(mref), free(mgot);
}

static void test_exact(void) {
    check_exact(g_v4, DI_PRECISION_FP32, true, "V4, fp32, MTP");
    check_exact(g_v4, DI_PRECISION_OFFICIAL, true, "V4, official, MTP");
    check_exact(g_v41, DI_PRECISION_FP32, false, "V4.1, fp32");
    check_exact(g_v41, DI_PRECISION_OFFICIAL, false, "V4.1, official");
}

static void test_engine(void) {
    workers ws;
    CHECK(start(&ws, g_v4, DI_PRECISION_FP32, 2));
    static result a[N_REQ], b[N_REQ], c[N_REQ];
    for (int pass = 0; pass < 2; pass++) {
        di_engine_options o = di_engine_options_default();
        o.n_threads = 1;
        o.max_ctx = 256;
        o.kv_memory_bytes = 32u << 20;
        o.ep_workers = pass ? ws.addrs : NULL;
        di_engine *e = NULL;
        CHECK_EQ(di_engine_create(g_v4, &o, &e), DI_OK);
        run(e, pass ? b : a, 0, N_REQ);
        di_engine_wait_idle(e);
        di_ep_worker_stats st[MAX_W];
        CHECK_EQ(di_engine_ep_stats(e, st, MAX_W), pass ? 2 : 0);
        if (pass) {
            // A worker goes away: the steps fail, their requests end with the error, the engine
            // goes on; back on its port, the same requests give the same results again.
            const int port = di_ep_worker_port(ws.w[1]);
            di_ep_worker_stop(ws.w[1]);
            run(e, c, 0, 2);
            di_engine_wait_idle(e);
            for (int i = 0; i < 2; i++) {
                CHECK_EQ(atomic_load(&c[i].finished), 1);
                CHECK_EQ(c[i].finish, DI_FINISH_ERROR);
                CHECK_EQ(c[i].status, DI_ERR_IO);
            }
            di_engine_stats es;
            di_engine_get_stats(e, &es);
            CHECK(es.n_failed_steps >= 1);
            CHECK(es.n_failed_in_a_row >= 1);
            CHECK_EQ(di_engine_probe_workers(e), DI_ERR_IO); // still down
            CHECK_EQ(di_ep_worker_start(ws.m[1], "127.0.0.1", port, &ws.w[1]), DI_OK);
            // Back: a probe (a second after the last one) reconnects it and ends the failure
            // streak without a request.
            CHECK_EQ(di_engine_probe_workers(e), DI_ERR_IO); // within the second: the last answer
            usleep(1100 * 1000);
            CHECK_EQ(di_engine_probe_workers(e), DI_OK);
            di_engine_get_stats(e, &es);
            CHECK_EQ(es.n_failed_in_a_row, 0);
            run(e, c, 0, N_REQ);
            di_engine_wait_idle(e);
            for (int i = 0; i < N_REQ; i++) CHECK(same(&a[i], &c[i]));
        }
        di_engine_destroy(e);
    }
    for (int i = 0; i < N_REQ; i++) {
        CHECK_EQ(atomic_load(&b[i].finished), 1);
        CHECK_EQ(b[i].status, DI_OK);
        CHECK(same(&a[i], &b[i]));
    }
    stop(&ws);
}

// Runs the N_REQ requests through an engine with options o (n_threads 1, max_ctx 256) into res and
// returns its stats.
static di_engine_stats engine_run(di_engine_options o, result *res) {
    o.n_threads = 1;
    o.max_ctx = 256;
    o.kv_memory_bytes = 32u << 20;
    di_engine *e = NULL;
    di_engine_stats st = {0};
    CHECK_EQ(di_engine_create(g_v4, &o, &e), DI_OK);
    if (!e) return st;
    run(e, res, 0, N_REQ);
    di_engine_wait_idle(e);
    di_engine_get_stats(e, &st);
    di_engine_destroy(e);
    for (int i = 0; i < N_REQ; i++) {
        CHECK_EQ(atomic_load(&res[i].finished), 1);
        CHECK_EQ(res[i].status, DI_OK);
    }
    return st;
}

static void test_online_eplb(void) {
    static result ref[N_REQ], got[N_REQ];
    engine_run(di_engine_options_default(), ref);
    workers ws;
    CHECK(start(&ws, g_v4, DI_PRECISION_FP32, 2));
    const int32_t E = ws.m[0]->hp.n_expert;
    // Every two steps a plan from the load of those steps, one spare slot per rank (redundant
    // replicas of the hottest experts), applied on any gain: placements change between steps
    // while requests run, and the tokens stay those of one process.
    di_engine_options o = di_engine_options_default();
    o.ep_workers = ws.addrs;
    o.eplb_interval = 2;
    o.eplb_slots_per_rank = (E + 2) / 3 + 1;
    o.eplb_min_gain = 1e-9;
    di_engine_stats st = engine_run(o, got);
    for (int i = 0; i < N_REQ; i++) CHECK(same(&ref[i], &got[i]));
    CHECK(st.n_eplb_plans >= 2);
    CHECK(st.n_eplb_rebalances >= 1);
    CHECK(st.n_eplb_moves > 0);
    CHECK(st.eplb_balance >= 1.0);
    CHECK(st.eplb_plan_us >= 0);
    // The planner runs on its own thread: held before it plans, the engine goes on stepping (every
    // request finishes) with the plan in flight and none applied; released, the plan is applied
    // between steps (di_engine_wait_idle waits for it) and the tokens are still those of one
    // process.
    {
        o.n_threads = 1;
        o.max_ctx = 256;
        o.kv_memory_bytes = 32u << 20;
        di_engine *eh = NULL;
        CHECK_EQ(di_engine_create(g_v4, &o, &eh), DI_OK);
        if (eh) {
            di_engine_eplb_hold(eh, true);
            memset(got, 0, sizeof got);
            run(eh, got, 0, N_REQ);
            for (int spin = 0; spin < 60000; spin++) { // at most 60 s
                int n_fin = 0;
                for (int i = 0; i < N_REQ; i++) n_fin += atomic_load(&got[i].finished);
                if (n_fin == N_REQ) break;
                usleep(1000);
            }
            di_engine_stats hs;
            di_engine_get_stats(eh, &hs);
            CHECK(hs.n_steps > 2 * o.eplb_interval); // steps went on past the plan's hand-over
            CHECK_EQ(hs.n_eplb_plans, 0);            // ... while it waited on the planner
            CHECK_EQ(hs.n_eplb_rebalances, 0);
            di_engine_eplb_hold(eh, false);
            di_engine_wait_idle(eh);
            di_engine_get_stats(eh, &hs);
            // The held plan, then one more from the steps after its hand-over (due long ago):
            // plans never queue up behind a slow planner.
            CHECK_EQ(hs.n_eplb_plans, 2);
            for (int i = 0; i < N_REQ; i++) CHECK(same(&ref[i], &got[i]));
            // More requests after it: planning resumes every interval.
            run(eh, got, 0, N_REQ);
            di_engine_wait_idle(eh);
            di_engine_get_stats(eh, &hs);
            CHECK(hs.n_eplb_plans >= 3);
            for (int i = 0; i < N_REQ; i++) CHECK(same(&ref[i], &got[i]));
            di_engine_destroy(eh);
        }
    }
    // Without workers, or with a bad slot count: refused at create.
    di_engine *e = NULL;
    di_engine_options bad = di_engine_options_default();
    bad.eplb_interval = 2;
    CHECK_EQ(di_engine_create(g_v4, &bad, &e), DI_ERR_INVALID);
    bad.ep_workers = ws.addrs;
    bad.eplb_slots_per_rank = 1; // 3 ranks x 1 slot < E experts
    CHECK_EQ(di_engine_create(g_v4, &bad, &e), DI_ERR_INVALID);

    // A placement file (as `deepinfer eplb -o` writes it): every expert on the rank after the
    // contiguous one, plus a replica of expert 0 on each rank.
    di_ep_placement p;
    const int32_t L = di_ep_moe_layers(ws.m[0]), S = E + 3;
    CHECK_EQ(di_ep_placement_alloc(L, E, 3, S, &p), DI_OK);
    for (int32_t l = 0; l < L; l++) {
        for (int32_t x = 0; x < E; x++)
            p.expert[l * S + x] = x, p.rank[l * S + x] = (int32_t)((x * 3 / E + 1) % 3);
        for (int32_t r = 0; r < 3; r++) p.expert[l * S + E + r] = 0, p.rank[l * S + E + r] = r;
    }
    char path[320];
    snprintf(path, sizeof path, "%s/placement.json", g_root);
    CHECK_EQ(di_eplb_placement_write(&p, path), DI_OK);
    o = di_engine_options_default();
    o.ep_workers = ws.addrs;
    o.ep_placement = path;
    memset(got, 0, sizeof got);
    engine_run(o, got);
    for (int i = 0; i < N_REQ; i++) CHECK(same(&ref[i], &got[i]));
    // A placement of another shape, a damaged file, a placement without workers: refused.
    di_ep_placement_free(&p);
    CHECK_EQ(di_ep_placement_contiguous(L, E, 2, &p), DI_OK); // 2 ranks, the engine has 3
    CHECK_EQ(di_eplb_placement_write(&p, path), DI_OK);
    CHECK_EQ(di_engine_create(g_v4, &o, &e), DI_ERR_INVALID);
    FILE *f = fopen(path, "w");
    fputs("{\"format\":\"deepinfer-ep-placement\",\"version\":1,", f);
    fclose(f);
    CHECK(di_engine_create(g_v4, &o, &e) != DI_OK);
    o.ep_workers = NULL;
    CHECK_EQ(di_engine_create(g_v4, &o, &e), DI_ERR_INVALID);
    di_ep_placement_free(&p);
    stop(&ws);
}

static void test_failures(void) {
    float *ref = malloc(N_LG * 4), *got = malloc(N_LG * 4);
    di_model *m = load(g_v4, DI_PRECISION_FP32, NULL);
    CHECK_EQ(session_run(m, false, ref, NULL), DI_OK);
    di_model_destroy(m);
    workers ws;
    CHECK(start(&ws, g_v4, DI_PRECISION_FP32, 1));
    di_model *f = load(g_v4, DI_PRECISION_FP32, ws.addrs);
    CHECK(f != NULL);
    const int port = di_ep_worker_port(ws.w[0]);
    // The worker goes away: the forward fails, and again while it is down.
    di_ep_worker_stop(ws.w[0]);
    CHECK_EQ(session_run(f, false, got, NULL), DI_ERR_IO);
    CHECK_EQ(session_run(f, false, got, NULL), DI_ERR_IO);
    // Back on the same port: the next forward reconnects and is exact.
    CHECK_EQ(di_ep_worker_start(ws.m[0], "127.0.0.1", port, &ws.w[0]), DI_OK);
    CHECK_EQ(session_run(f, false, got, NULL), DI_OK);
    CHECK(memcmp(ref, got, N_LG * 4) == 0);
    di_ep_worker_stats st;
    CHECK_EQ(di_model_ep_stats(f, &st, 1), 1);
    CHECK(st.errors >= 2 && st.connects == 2);
    di_model_destroy(f);
    // Another model (same checkpoint, other precision): refused at load, naming both sides.
    CHECK(load(g_v4, DI_PRECISION_OFFICIAL, ws.addrs) == NULL);
    // Nobody listening: the load fails too.
    char none[64];
    snprintf(none, sizeof none, "127.0.0.1:%d", port == 65535 ? 1 : port + 1);
    di_ep_worker_stop(ws.w[0]);
    CHECK(load(g_v4, DI_PRECISION_FP32, none) == NULL);
    CHECK(load(g_v4, DI_PRECISION_FP32, "no-port") == NULL);
    ws.n = 1;
    di_model_destroy(ws.m[0]);
    free(ref), free(got);
}

// Two fronts (attention data parallelism) share one worker, running at the same time.
typedef struct front_run {
    di_model *m;
    float *lg;
    di_status st;
} front_run;

static void *front_main(void *p) {
    front_run *r = p;
    r->st = session_run(r->m, false, r->lg, NULL);
    return NULL;
}

static void test_two_fronts(void) {
    float *ref = malloc(N_LG * 4);
    di_model *m = load(g_v4, DI_PRECISION_OFFICIAL, NULL);
    CHECK_EQ(session_run(m, false, ref, NULL), DI_OK);
    di_model_destroy(m);
    workers ws;
    CHECK(start(&ws, g_v4, DI_PRECISION_OFFICIAL, 1));
    front_run r[2];
    pthread_t th[2];
    for (int i = 0; i < 2; i++) {
        r[i] =
            (front_run){.m = load(g_v4, DI_PRECISION_OFFICIAL, ws.addrs), .lg = malloc(N_LG * 4)};
        CHECK(r[i].m != NULL);
    }
    for (int i = 0; i < 2; i++) CHECK(pthread_create(&th[i], NULL, front_main, &r[i]) == 0);
    for (int i = 0; i < 2; i++) {
        pthread_join(th[i], NULL);
        CHECK_EQ(r[i].st, DI_OK);
        CHECK(memcmp(ref, r[i].lg, N_LG * 4) == 0);
        di_model_destroy(r[i].m);
        free(r[i].lg);
    }
    stop(&ws);
    free(ref);
}

// ---- raw frames against a worker ----

static int dial(int port) {
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    CHECK(connect(fd, (struct sockaddr *)&a, sizeof a) == 0);
    di_sock_tune(fd, 10000);
    return fd;
}

// The next frame's type (its payload read and dropped); -1 when the worker closed.
static int reply(int fd, char *text, size_t n) {
    di_ep_hdr h;
    char why[256];
    if (di_ep_recv_hdr(fd, &h, why, sizeof why) != DI_OK) return -1;
    char *p = malloc(h.len + 1);
    CHECK(di_sock_recv_all(fd, p, h.len) == DI_OK);
    p[h.len] = 0;
    if (text) snprintf(text, n, "%s", p);
    free(p);
    return h.type;
}

static void send_raw(int fd, const void *p, size_t n) {
    CHECK(di_sock_send_all(fd, p, n) == DI_OK);
}

static void hello(int fd, const di_model *m) {
    uint64_t id = di_dsv4_model_id(m);
    CHECK(di_ep_send_frame(fd, DI_EP_HELLO, &id, 8) == DI_OK);
    CHECK_EQ(reply(fd, NULL, 0), DI_EP_OK);
}

static void test_frames(void) {
    workers ws;
    CHECK(start(&ws, g_v4, DI_PRECISION_FP32, 1));
    di_model *m = ws.m[0];
    const int port = di_ep_worker_port(ws.w[0]);
    const int32_t D = m->hp.n_embd, E = m->hp.n_expert;
    char text[512];
    // Not our protocol: an error, then the connection is dropped.
    int fd = dial(port);
    send_raw(fd, "GET / HTTP/1.1\r\n\r\n", 18);
    CHECK_EQ(reply(fd, text, sizeof text), DI_EP_ERROR);
    CHECK(strstr(text, "magic") != NULL);
    CHECK_EQ(reply(fd, NULL, 0), -1);
    close(fd);
    // A huge length: refused before any allocation.
    fd = dial(port);
    di_ep_hdr h = {DI_EP_MAGIC, DI_EP_VERSION, DI_EP_COMPUTE, (uint64_t)1 << 40};
    send_raw(fd, &h, sizeof h);
    CHECK_EQ(reply(fd, text, sizeof text), DI_EP_ERROR);
    CHECK(strstr(text, "exceeds") != NULL);
    close(fd);
    // A request before the handshake, a wrong model identity.
    fd = dial(port);
    int32_t asg[5] = {di_ep_moe_layers(m), E, 1, 0, E - 1};
    CHECK(di_ep_send_frame(fd, DI_EP_ASSIGN, asg, sizeof asg) == DI_OK);
    CHECK_EQ(reply(fd, text, sizeof text), DI_EP_ERROR);
    uint64_t bad = 42;
    CHECK(di_ep_send_frame(fd, DI_EP_HELLO, &bad, 8) == DI_OK);
    CHECK_EQ(reply(fd, text, sizeof text), DI_EP_ERROR);
    CHECK(strstr(text, "model mismatch") != NULL);
    hello(fd, m);
    // Assignments: a wrong shape, an out-of-range pair; then (layer 0, expert E - 1).
    asg[1] = E + 1;
    CHECK(di_ep_send_frame(fd, DI_EP_ASSIGN, asg, sizeof asg) == DI_OK);
    CHECK_EQ(reply(fd, NULL, 0), DI_EP_ERROR);
    asg[1] = E, asg[4] = E;
    CHECK(di_ep_send_frame(fd, DI_EP_ASSIGN, asg, sizeof asg) == DI_OK);
    CHECK_EQ(reply(fd, NULL, 0), DI_EP_ERROR);
    asg[4] = E - 1;
    CHECK(di_ep_send_frame(fd, DI_EP_ASSIGN, asg, sizeof asg) == DI_OK);
    CHECK_EQ(reply(fd, NULL, 0), DI_EP_OK);
    // Compute requests: 3 rows of expert E - 1 (good), and broken variants of it.
    const int32_t n = 3;
    const size_t len = 16 + 8 + (size_t)n * (D + 1) * 4;
    uint8_t *rq = calloc(1, len);
    int32_t hd[6] = {0, D, 1, 0, E - 1, n};
    memcpy(rq, hd, sizeof hd);
    float *x = (float *)(rq + 24), *w = x + n * D;
    for (int i = 0; i < n * D; i++) x[i] = (float)((i * 37) % 19) / 19.0f - 0.5f;
    for (int i = 0; i < n; i++) w[i] = 0.25f * (float)(i + 1);
    struct {
        int at;
        int32_t v;
        const char *why;
    } broken[] = {{0, 99, "layer"}, {1, D + 1, "width"},    {2, 0, "groups"},
                  {4, E, "expert"}, {4, 0, "not assigned"}, {5, 4, "do not fit"},
                  {5, -1, "rows"},  {5, 2, "trailing"}};
    for (size_t k = 0; k < sizeof broken / sizeof broken[0]; k++) {
        int32_t save;
        memcpy(&save, rq + 4 * broken[k].at, 4);
        memcpy(rq + 4 * broken[k].at, &broken[k].v, 4);
        CHECK(di_ep_send_frame(fd, DI_EP_COMPUTE, rq, len) == DI_OK);
        CHECK_EQ(reply(fd, text, sizeof text), DI_EP_ERROR);
        if (!strstr(text, broken[k].why))
            fprintf(stderr, "  '%s' lacks '%s'\n", text, broken[k].why);
        CHECK(strstr(text, broken[k].why) != NULL);
        memcpy(rq + 4 * broken[k].at, &save, 4);
    }
    // The good request: one result, equal to the expert computed here.
    CHECK(di_ep_send_frame(fd, DI_EP_COMPUTE, rq, len) == DI_OK);
    CHECK(di_ep_recv_hdr(fd, &h, text, sizeof text) == DI_OK);
    CHECK_EQ(h.type, DI_EP_RESULT);
    CHECK_EQ(h.len, 8 + (uint64_t)n * D * 4);
    int32_t en[2];
    float *y = malloc((size_t)n * D * 4);
    CHECK(di_sock_recv_all(fd, en, 8) == DI_OK && en[0] == E - 1 && en[1] == n);
    CHECK(di_sock_recv_all(fd, y, (size_t)n * D * 4) == DI_OK);
    di_model *loc = load(g_v4, DI_PRECISION_FP32, NULL);
    di_dsv4_ws lws = {0};
    CHECK_EQ(di_dsv4_ws_reserve(&lws, loc, 16, 0, false), DI_OK);
    di_dsv4_ctx c = {.model = loc, .ws = &lws};
    const di_dsv4_layer_w *lw = di_dsv4_layer(loc, 0);
    float *yl = di_dsv4_scratch(&c, DI_SCR_MOE_OUT);
    di_dsv4_expert(&c, &lw->w1[E - 1], &lw->w3[E - 1], &lw->w2[E - 1], x, n, loc->hp.swiglu_limit,
                   w, yl);
    CHECK(memcmp(y, yl, (size_t)n * D * 4) == 0);
    di_dsv4_ws_free(&lws);
    di_model_destroy(loc);
    // A truncated frame: the worker drops that connection and keeps serving others.
    CHECK(di_ep_send_frame(fd, DI_EP_COMPUTE, NULL, 0) == DI_OK); // header only, len 0
    CHECK_EQ(reply(fd, NULL, 0), DI_EP_ERROR);
    h = (di_ep_hdr){DI_EP_MAGIC, DI_EP_VERSION, DI_EP_COMPUTE, len};
    send_raw(fd, &h, sizeof h);
    send_raw(fd, rq, 10);
    close(fd);
    fd = dial(port);
    hello(fd, m);
    close(fd);
    // And a front still runs through it.
    di_model *f = load(g_v4, DI_PRECISION_FP32, ws.addrs);
    CHECK(f != NULL);
    float *lg = malloc(N_LG * 4);
    CHECK_EQ(session_run(f, false, lg, NULL), DI_OK);
    free(lg);
    di_model_destroy(f);
    free(rq), free(y);
    stop(&ws);
}

int main(void) {
    snprintf(g_root, sizeof g_root, "/tmp/di_test_ep_XXXXXX");
    if (!mkdtemp(g_root)) return 1;
    snprintf(g_v4, sizeof g_v4, "%s/v4", g_root);
    snprintf(g_v41, sizeof g_v41, "%s/v41", g_root);
    mkdir(g_v4, 0755);
    mkdir(g_v41, 0755);
    di_synth_config c;
    CHECK(di_synth_preset("tiny", &c) == DI_OK);
    c.n_vocab = V;
    c.official = true; // FP8/FP4 experts and the MTP block
    CHECK(di_synth_write(&c, g_v4) == DI_OK);
    CHECK(di_synth_v41_write(g_v41, true, false, 41) == DI_OK);
    for (int i = 0; i < N_REQ; i++)
        for (int t = 0; t < g_len[i]; t++) g_prompt[i][t] = (int32_t)((i * 97 + t * 31 + 5) % V);
    RUN(test_exact);
    RUN(test_engine);
    RUN(test_two_fronts);
    RUN(test_online_eplb);
    RUN(test_failures);
    RUN(test_frames);
    di_test_remove_dir(g_root);
    return test_finish();
}
