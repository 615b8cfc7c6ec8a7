// Snapshot points (docs/kv-cache.md, "Snapshot points"; di_request_params.snap_at, scheduler.c
// di_sched_snap_points, engine.c tails_take): besides its last block boundary, a prompt's prefill
// chunks end at its requested points rounded down to block boundaries, and the tail is snapshot
// there, so that a later prompt sharing only that prefix (a "system prompt") continues from the
// snapshot with nothing replayed. Tiny models (blocks of 16, replay bound R = 90), 24 rows per
// step, oracle: the same engine without the prefix cache, tokens / logprobs / top logprobs bit
// for bit. On V4 FP32 and V4.1 official:
//   (a) X = S (120 shared tokens) + 20 of its own, snap_at {33, 40, 120, 139}: points 32, 112
//       (33 and 40 round to 32, once; 139 rounds to the last boundary 128, already a point) and
//       128: three snapshots;
//   (b) S + 25 other tokens: hit 112, restored at 112, n_replayed 0 (without the point: the
//       bounded replay of 90, checked in (d));
//   (c) S's first 40 tokens + 30 others: hit 32, restored at 32 (the deepest on its chain);
//   (d) a point below a replayed hit is not taken: on a fresh engine Z = S + 25 others (no
//       points: its only snapshot at 144), then Y = S + 25 others with snap_at {40}: hit 112,
//       no snapshot on its chain: the bounded replay of 90 (what (b) costs without the point),
//       and no snapshot at 32 (the state there is not exact: the replay's proof holds at 112);
//       S's first 40 tokens + 30 others then hit 32 and replay 32, exact.
// And the refusals: a point beyond the prompt, 0, descending, more than DI_MAX_SNAP_AT.
#include "harness.h"

#include <stdlib.h>
#include <sys/stat.h>

#include "model/synth.h"

enum { V = 512, GEN = 4, N_TOP = 3, ROWS = 24, MAX_CTX = 256, PS = 120, MAXP = 160 };

static char g_root[256], g_v4[300], g_v41[300];
static int32_t g_s[PS];

typedef struct result {
    int32_t prompt[MAXP], n_prompt;
    int32_t snap_at[DI_MAX_SNAP_AT], n_snap_at;
    int32_t tokens[GEN];
    float logprob[GEN], top[GEN][N_TOP];
    int32_t n;
    int32_t n_cached, n_replayed, n_computed;
} result;

static void on_event(void *user, const di_event *ev) {
    result *r = user;
    if (ev->token >= 0 && r->n < GEN) {
        r->tokens[r->n] = ev->token;
        r->logprob[r->n] = ev->logprob;
        for (int k = 0; k < ev->n_top && k < N_TOP; k++) r->top[r->n][k] = ev->top_logprobs[k];
        r->n++;
    }
    if (ev->finish != DI_FINISH_NONE) {
        r->n_cached = ev->n_cached;
        r->n_replayed = ev->n_replayed;
        r->n_computed = ev->n_computed;
    }
}

static bool same(const result *a, const result *b) {
    return a->n == b->n && a->n == GEN &&
           !memcmp(a->tokens, b->tokens, sizeof(int32_t) * (size_t)a->n) &&
           !memcmp(a->logprob, b->logprob, sizeof(float) * (size_t)a->n) &&
           !memcmp(a->top, b->top, sizeof(a->top[0]) * (size_t)a->n);
}

static di_engine *engine(const char *dir, di_precision prec, bool cache) {
    di_engine_options o = di_engine_options_default();
    o.n_threads = 2;
    o.precision = prec;
    o.kv_memory_bytes = (size_t)32 << 20;
    o.max_seqs = 3;
    o.max_batch_tokens = ROWS;
    o.max_ctx = MAX_CTX;
    o.no_prefix_cache = !cache;
    di_engine *e = NULL;
    CHECK_EQ(di_engine_create(dir, &o, &e), DI_OK);
    return e;
}

// shared tokens of S, then `own` tokens of the request's own (seeded by k).
static void set_prompt(result *r, int32_t shared, int32_t own, int k) {
    memset(r, 0, sizeof *r);
    memcpy(r->prompt, g_s, sizeof(int32_t) * (size_t)shared);
    for (int32_t t = 0; t < own; t++) r->prompt[shared + t] = (int32_t)((t * 37 + 53 * k + 7) % V);
    r->n_prompt = shared + own;
}

static di_request_params params(result *r) {
    di_request_params p = di_request_params_default();
    p.prompt = r->prompt;
    p.n_prompt = r->n_prompt;
    p.snap_at = r->snap_at;
    p.n_snap_at = r->n_snap_at;
    p.max_tokens = GEN;
    p.ignore_eos = true;
    p.sample.n_logprobs = N_TOP;
    p.on_event = on_event;
    p.user = r;
    return p;
}

static void run(di_engine *e, result *r) {
    r->n = 0;
    di_request_params p = params(r);
    uint64_t id;
    CHECK_EQ(di_engine_submit(e, &p, &id), DI_OK);
    di_engine_wait_idle(e);
}

static di_engine_stats stats(di_engine *e) {
    di_engine_stats st;
    di_engine_get_stats(e, &st);
    return st;
}

static void oracle(const char *dir, di_precision prec, result *ref, const result *req, int n) {
    di_engine *e = engine(dir, prec, false);
    for (int i = 0; e && i < n; i++) {
        ref[i] = req[i];
        run(e, &ref[i]);
    }
    if (e) di_engine_destroy(e);
}

static void test_model(const char *name, const char *dir, di_precision prec) {
    enum { N = 6 };
    static result req[N], ref[N];
    set_prompt(&req[0], PS, 20, 0); // (a)
    const int32_t pts[] = {33, 40, 120, 139};
    memcpy(req[0].snap_at, pts, sizeof pts);
    req[0].n_snap_at = 4;
    set_prompt(&req[1], PS, 25, 1); // (b)
    set_prompt(&req[2], 40, 30, 2); // (c)
    set_prompt(&req[3], PS, 25, 3); // (d) Z, on a fresh engine
    set_prompt(&req[4], PS, 25, 4); // (d) Y
    req[4].snap_at[0] = 40;
    req[4].n_snap_at = 1;
    set_prompt(&req[5], 40, 30, 5); // (d) after Y
    oracle(dir, prec, ref, req, N);

    di_engine *e = engine(dir, prec, true);
    if (!e) return;
    for (int i = 0; i < 3; i++) {
        run(e, &req[i]);
        CHECK(same(&req[i], &ref[i]));
    }
    di_engine_stats st = stats(e);
    CHECK_EQ(st.n_tail_taken, 3 + 1 + 1); // (a) 32, 112, 128; (b) and (c) their last boundaries
    CHECK_EQ(st.n_tail_restored, 2);
    CHECK_EQ(req[1].n_cached, 112);
    CHECK_EQ(req[1].n_replayed, 0);
    CHECK_EQ(req[1].n_computed, PS + 25 - 112 + GEN - 1);
    CHECK_EQ(req[2].n_cached, 32);
    CHECK_EQ(req[2].n_replayed, 0);
    CHECK_EQ(st.n_replayed_tokens, 0);
    di_engine_destroy(e);

    e = engine(dir, prec, true);
    if (!e) return;
    for (int i = 3; i < N; i++) {
        run(e, &req[i]);
        CHECK(same(&req[i], &ref[i]));
    }
    CHECK_EQ(req[3].n_cached, 0);
    CHECK_EQ(req[4].n_cached, 112);
    CHECK_EQ(req[4].n_replayed, 90);
    CHECK_EQ(req[5].n_cached, 32);
    CHECK_EQ(req[5].n_replayed, 32); // no snapshot at 32: Y's chunk ending there was not taken
    st = stats(e);
    CHECK_EQ(st.n_tail_taken, 3); // Z's, Y's and the last one's last boundaries
    CHECK_EQ(st.n_tail_restored, 0);
    CHECK_EQ(st.n_blocks_free, st.n_blocks_total);
    CHECK_EQ(st.n_step_allocs, 0);
    int n_same = 0;
    for (int i = 0; i < N; i++) n_same += same(&req[i], &ref[i]);
    fprintf(stderr,
            "%s: %d/%d exact; shared 112 restored (replayed %d, computed %d); without the "
            "point replayed %d\n",
            name, n_same, N, req[1].n_replayed, req[1].n_computed, req[4].n_replayed);
    di_engine_destroy(e);
}

static void test_refused(void) {
    di_engine *e = engine(g_v4, DI_PRECISION_FP32, true);
    if (!e) return;
    result r;
    set_prompt(&r, 40, 0, 0);
    const int32_t bad[][5] = {{41}, {0}, {20, 10}, {1, 2, 3, 4, 5}, {-3}};
    const int32_t n_bad[] = {1, 1, 2, 5, 1};
    for (int i = 0; i < 5; i++) {
        di_request_params p = params(&r);
        p.snap_at = bad[i];
        p.n_snap_at = n_bad[i];
        uint64_t id;
        CHECK_EQ(di_engine_submit(e, &p, &id), DI_ERR_INVALID);
    }
    di_request_params p = params(&r);
    p.snap_at = NULL;
    p.n_snap_at = 1;
    uint64_t id;
    CHECK_EQ(di_engine_submit(e, &p, &id), DI_ERR_INVALID);
    // The edges are accepted: the prompt's end, duplicates.
    r.snap_at[0] = r.snap_at[1] = 20;
    r.snap_at[2] = 40;
    r.n_snap_at = 3;
    run(e, &r);
    CHECK_EQ(r.n, GEN);
    CHECK_EQ(stats(e).n_tail_taken, 2); // 16, and the last boundary 32
    di_engine_destroy(e);
}

int main(void) {
    snprintf(g_root, sizeof g_root, "/tmp/di_test_engine_snap_XXXXXX");
    if (!mkdtemp(g_root)) return 1;
    snprintf(g_v4, sizeof g_v4, "%s/v4-tiny", g_root);
    snprintf(g_v41, sizeof g_v41, "%s/v41-tiny", g_root);
    mkdir(g_v4, 0755);
    mkdir(g_v41, 0755);
    di_synth_config sc;
    CHECK_EQ(di_synth_preset("tiny", &sc), DI_OK);
    CHECK_EQ(di_synth_write(&sc, g_v4), DI_OK);
    CHECK_EQ(di_synth_v41_write(g_v41, true, false, 41), DI_OK);
    for (int t = 0; t < PS; t++) g_s[t] = (int32_t)((t * 31 + 11) % V);
    test_model("V4 FP32", g_v4, DI_PRECISION_FP32);
    test_model("V4.1 official", g_v41, DI_PRECISION_OFFICIAL);
    test_refused();
    di_test_remove_dir(g_root);
    return test_finish();
}
