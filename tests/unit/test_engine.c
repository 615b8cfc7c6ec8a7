// engine (continuous batching) acceptance: 16 requests of different lengths run together give
// exactly the tokens and logprobs of each run alone (greedy and seeded sampling); a tiny KV budget
// forces preemption and still gives the same tokens; 100 requests cancelled at random moments
// return every KV block; the step path allocates nothing; a full queue is refused with
// DI_ERR_BUSY; stop strings end a request through the engine; a better priority preempts and runs
// first, equal priorities share slots between tenants by the tokens they received (virtual token
// counter), a request that aged on the engine's (skewed) clock runs before a newer one of better
// priority, and all of it, priority aging included, leaves every output equal to the request
// alone.
#include "harness.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <time.h>
#include <unistd.h>

#include "engine/engine_internal.h" // di_engine_skew_clock
#include "model/synth.h"

static char g_dir[256];
enum { V = 512, N_REQ = 16, MAX_GEN = 12, N_TOP = 3 };

static atomic_int g_first_seq; // order of first tokens across requests (test_priority)

typedef struct result {
    int first_at, done_at; // g_first_seq at the first token and at the final event
    int32_t tokens[64];
    float logprob[64], top[64][N_TOP];
    int32_t top_ids[64][N_TOP];
    int32_t n;
    atomic_int finished; // number of final events
    di_finish finish;
    int32_t n_cached, n_replayed, n_preempted;
    char text[256];
    size_t n_text;
} result;

static void on_event(void *user, const di_event *ev) {
    result *r = user;
    if (ev->token >= 0 && r->n == 0) r->first_at = atomic_fetch_add(&g_first_seq, 1);
    if (ev->token >= 0 && r->n < 64) {
        r->tokens[r->n] = ev->token;
        r->logprob[r->n] = ev->logprob;
        for (int k = 0; k < ev->n_top && k < N_TOP; k++) {
            r->top[r->n][k] = ev->top_logprobs[k];
            r->top_ids[r->n][k] = ev->top_ids[k];
        }
        r->n++;
    }
    if (ev->n_text && r->n_text + ev->n_text < sizeof r->text) {
        memcpy(r->text + r->n_text, ev->text, ev->n_text);
        r->n_text += ev->n_text;
    }
    if (ev->finish != DI_FINISH_NONE) {
        r->finish = ev->finish;
        r->n_cached = ev->n_cached;
        r->n_replayed = ev->n_replayed;
        r->n_preempted = ev->n_preempted;
        r->done_at = atomic_fetch_add(&g_first_seq, 1);
        atomic_fetch_add(&r->finished, 1);
    }
}

static int32_t g_prompt[N_REQ][200];
static int32_t g_len[N_REQ];

static di_request_params request(int i, result *res) {
    di_request_params p = di_request_params_default();
    p.prompt = g_prompt[i];
    p.n_prompt = g_len[i];
    p.max_tokens = MAX_GEN - (i % 3);
    p.ignore_eos = true;
    p.sample.n_logprobs = N_TOP;
    if (i % 2) { // seeded sampling on odd requests, greedy on even ones
        p.sample.temperature = 0.9f;
        p.sample.top_p = 0.95f;
        p.sample.top_k = 40;
        p.sample.seed = 1000 + (uint64_t)i;
    }
    if (i % 4 == 3) p.sample.repetition_penalty = 1.3f;
    p.on_event = on_event;
    p.user = res;
    return p;
}

// aging_ms: di_engine_options.priority_aging_ms.
static di_engine *engine_aging(size_t kv_bytes, int max_seqs, bool prefix, int32_t aging_ms) {
    di_engine_options o = di_engine_options_default();
    o.priority_aging_ms = aging_ms;
    o.n_threads = 2;
    o.kv_memory_bytes = kv_bytes;
    o.max_seqs = max_seqs;
    o.max_batch_tokens = 64; // forces chunked prefill
    o.max_ctx = 512;
    o.no_prefix_cache = !prefix;
    di_engine *e = NULL;
    CHECK_EQ(di_engine_create(g_dir, &o, &e), DI_OK);
    return e;
}

static di_engine *engine(size_t kv_bytes, int max_seqs, bool prefix) {
    return engine_aging(kv_bytes, max_seqs, prefix, DI_ENGINE_PRIORITY_AGING_MS);
}

static bool same(const result *a, const result *b) {
    if (a->n != b->n || memcmp(a->tokens, b->tokens, sizeof(int32_t) * (size_t)a->n)) return false;
    if (memcmp(a->logprob, b->logprob, sizeof(float) * (size_t)a->n)) return false;
    return memcmp(a->top, b->top, sizeof(a->top[0]) * (size_t)a->n) == 0 &&
           memcmp(a->top_ids, b->top_ids, sizeof(a->top_ids[0]) * (size_t)a->n) == 0;
}

static void check_clean(di_engine *e) {
    di_engine_stats st;
    di_engine_get_stats(e, &st);
    CHECK_EQ(st.n_blocks_free, st.n_blocks_total); // every block back (cached ones are idle)
    CHECK_EQ(st.n_step_allocs, 0);                 // nothing allocated on the step path
    CHECK(st.n_steps > 0);
}

static result g_alone[N_REQ];

static void test_batch_invariance(void) {
    // Alone: one request at a time, no prefix cache.
    di_engine *e = engine(64u << 20, N_REQ, false);
    if (!e) return;
    for (int i = 0; i < N_REQ; i++) {
        uint64_t id;
        di_request_params p = request(i, &g_alone[i]);
        CHECK_EQ(di_engine_submit(e, &p, &id), DI_OK);
        di_engine_wait_idle(e);
        CHECK_EQ(g_alone[i].n, p.max_tokens);
        CHECK_EQ(g_alone[i].finish, DI_FINISH_LENGTH);
    }
    check_clean(e);
    di_engine_destroy(e);
    // Together: all 16 at once (prefix cache on), twice (the second round hits the cache).
    e = engine(64u << 20, N_REQ, true);
    if (!e) return;
    for (int round = 0; round < 2; round++) {
        static result together[N_REQ];
        memset(together, 0, sizeof together);
        for (int i = 0; i < N_REQ; i++) {
            uint64_t id;
            di_request_params p = request(i, &together[i]);
            CHECK_EQ(di_engine_submit(e, &p, &id), DI_OK);
        }
        di_engine_wait_idle(e);
        int n_same = 0, cached = 0;
        for (int i = 0; i < N_REQ; i++) {
            n_same += same(&together[i], &g_alone[i]);
            CHECK_EQ(atomic_load(&together[i].finished), 1);
            cached += together[i].n_cached;
        }
        fprintf(stderr, "round %d: %d/%d requests identical to alone, %d prompt tokens cached\n",
                round, n_same, N_REQ, cached);
        CHECK_EQ(n_same, N_REQ);
        if (round == 1) CHECK(cached > 0);
    }
    di_engine_stats st;
    di_engine_get_stats(e, &st);
    fprintf(stderr,
            "steps %lld, prefill rows %lld, decode rows %lld; forward %.1f ms, sampling %.1f ms\n",
            (long long)st.n_steps, (long long)st.n_prefill_tokens, (long long)st.n_decode_tokens,
            (double)st.forward_us / 1e3, (double)st.sample_us / 1e3);
    // Both timed: every step ran a forward and sampled rows with log-probabilities (a pass over
    // the vocabulary at least).
    CHECK(st.forward_us > 0);
    CHECK(st.sample_us > 0);
    check_clean(e);
    di_engine_destroy(e);
}

// Asynchronous scheduling: the plan of step N+1 is built while step N's forward runs (counted by
// the engine), and the outputs equal those of the synchronous debug mode (DI_ENGINE_SYNC=1) and
// of each request alone. Half the requests stop on a token id they produce mid-generation, so
// rows planned ahead for a request that then finishes must be dropped.
static void run_16(bool sync, result *res, di_engine_stats *st) {
    static int32_t stop_id[N_REQ];
    if (sync) setenv("DI_ENGINE_SYNC", "1", 1);
    di_engine *e = engine(64u << 20, N_REQ, true);
    unsetenv("DI_ENGINE_SYNC");
    if (!e) return;
    memset(res, 0, sizeof(result) * N_REQ);
    for (int i = 0; i < N_REQ; i++) {
        uint64_t id;
        di_request_params p = request(i, &res[i]);
        if (i % 2 == 0) { // greedy: stops at the first occurrence of its 4th token
            stop_id[i] = g_alone[i].tokens[3];
            p.stop_ids = &stop_id[i];
            p.n_stop_ids = 1;
        }
        CHECK_EQ(di_engine_submit(e, &p, &id), DI_OK);
    }
    di_engine_wait_idle(e);
    di_engine_get_stats(e, st);
    check_clean(e);
    di_engine_destroy(e);
}

static void test_async_overlap(void) {
    static result r_sync[N_REQ], r_async[N_REQ];
    di_engine_stats st_sync, st_async;
    run_16(true, r_sync, &st_sync);
    run_16(false, r_async, &st_async);
    fprintf(stderr,
            "sync: %lld steps, %lld planned ahead; async: %lld steps, %lld planned ahead, "
            "%lld complete before the forward returned\n",
            (long long)st_sync.n_steps, (long long)st_sync.n_plans_ahead,
            (long long)st_async.n_steps, (long long)st_async.n_plans_ahead,
            (long long)st_async.n_plans_overlapped);
    CHECK_EQ(st_sync.n_plans_ahead, 0);
    CHECK_EQ(st_sync.n_plans_overlapped, 0);
    // Every step after the first is planned during its predecessor's forward, except steps
    // whose plan ahead had to wait (a preemption, or nothing plannable until sampling).
    CHECK(st_async.n_plans_ahead * 4 >= st_async.n_steps * 3);
    CHECK(st_async.n_plans_overlapped * 2 >= st_async.n_plans_ahead);
    int n_stopped = 0;
    for (int i = 0; i < N_REQ; i++) {
        CHECK(same(&r_sync[i], &r_async[i]));
        CHECK_EQ(atomic_load(&r_async[i].finished), 1);
        CHECK(r_async[i].n > 0);
        // Identical to alone up to the stop.
        CHECK_EQ(
            memcmp(r_async[i].tokens, g_alone[i].tokens, sizeof(int32_t) * (size_t)r_async[i].n),
            0);
        if (i % 2 == 0) {
            CHECK(r_async[i].n <= 4);
            CHECK_EQ(r_async[i].tokens[r_async[i].n - 1], g_alone[i].tokens[3]);
            n_stopped += r_async[i].finish == DI_FINISH_STOP;
        }
    }
    CHECK_EQ(n_stopped, N_REQ / 2);
}

// Runs the 16 requests (long generations) on one engine; returns its stats.
enum { N_LONG = 6 };
static void run_long(di_engine *e, result *res, di_engine_stats *st) {
    memset(res, 0, sizeof(result) * N_LONG);
    for (int i = 0; i < N_LONG; i++) {
        uint64_t id;
        di_request_params p = request(i, &res[i]);
        p.n_prompt = 140 + i % 10; // long prompts: two such sequences overflow the tiny pool
        p.max_tokens = 30 + i % 5; // decodes cross blocks
        CHECK_EQ(di_engine_submit(e, &p, &id), DI_OK);
    }
    di_engine_wait_idle(e);
    di_engine_get_stats(e, st);
}

static void test_preemption_tiny_budget(void) {
    static result big[N_REQ], small[N_REQ];
    di_engine_stats st;
    di_engine *e = engine(64u << 20, N_REQ, false);
    if (!e) return;
    run_long(e, big, &st);
    CHECK_EQ(st.n_preemptions, 0);
    di_engine_destroy(e);
    // The smallest pool the engine accepts: one sequence of max_ctx positions (16 tail blocks +
    // 512 / 16 entry blocks on the tiny model). A few requests get admitted, then grow into each
    // other: preemption by recompute.
    size_t tiny = (size_t)st.block_bytes * (size_t)(16 + 512 / st.block_tokens);
    for (int prefix = 0; prefix < 2; prefix++) {
        e = engine(tiny, N_REQ, prefix);
        if (!e) return;
        run_long(e, small, &st);
        int n_same = 0;
        for (int i = 0; i < N_LONG; i++) n_same += same(&small[i], &big[i]);
        fprintf(stderr,
                "tiny budget (%lld blocks, prefix cache %s): %lld preemptions, %d/%d identical\n",
                (long long)st.n_blocks_total, prefix ? "on" : "off", (long long)st.n_preemptions,
                n_same, N_LONG);
        CHECK(st.n_preemptions > 0);
        CHECK_EQ(n_same, N_LONG);
        check_clean(e);
        di_engine_destroy(e);
    }
}

static void test_cancel_100(void) {
    di_engine *e = engine(8u << 20, 8, true);
    if (!e) return;
    enum { N = 100 };
    static result res[N];
    memset(res, 0, sizeof res);
    uint64_t ids[N];
    srand(7);
    for (int i = 0; i < N; i++) {
        di_request_params p = request(i % N_REQ, &res[i]);
        p.max_tokens = 20 + i % 7;
        CHECK_EQ(di_engine_submit(e, &p, &ids[i]), DI_OK);
    }
    // Cancel every request at a random moment (some waiting, some mid-prefill or decode, some
    // already finished), from this thread while the engine runs.
    int order[N];
    for (int i = 0; i < N; i++) order[i] = i;
    for (int i = N - 1; i > 0; i--) {
        int j = rand() % (i + 1), t = order[i];
        order[i] = order[j], order[j] = t;
    }
    for (int k = 0; k < N; k++) {
        usleep((useconds_t)(rand() % 12000));
        di_engine_cancel(e, ids[order[k]]);
    }
    di_engine_wait_idle(e);
    int cancelled = 0, one_final = 1;
    for (int i = 0; i < N; i++) {
        one_final &= atomic_load(&res[i].finished) == 1;
        cancelled += res[i].finish == DI_FINISH_CANCELLED;
    }
    fprintf(stderr, "100 requests: %d cancelled, %d finished first\n", cancelled, N - cancelled);
    CHECK(one_final);
    CHECK(cancelled > 0);
    check_clean(e);
    di_engine_destroy(e);
}

static void test_queue_limit_and_bad_requests(void) {
    di_engine_options o = di_engine_options_default();
    o.n_threads = 2;
    o.max_seqs = 1;
    o.max_queue = 3;
    o.max_ctx = 512;
    o.kv_memory_bytes = 16u << 20;
    di_engine *e = NULL;
    CHECK_EQ(o.priority_aging_ms, DI_ENGINE_PRIORITY_AGING_MS);
    o.priority_aging_ms = -1;
    CHECK_EQ(di_engine_create(g_dir, &o, &e), DI_ERR_INVALID);
    CHECK(e == NULL);
    o.priority_aging_ms = DI_ENGINE_PRIORITY_AGING_MS;
    CHECK_EQ(di_engine_create(g_dir, &o, &e), DI_OK);
    if (!e) return;
    static result res[64];
    memset(res, 0, sizeof res);
    int busy = 0, n_ok = 0;
    for (int i = 0; i < 64 && !busy; i++) {
        di_request_params p = request(0, &res[i]);
        p.max_tokens = 40;
        uint64_t id;
        di_status st = di_engine_submit(e, &p, &id);
        busy += st == DI_ERR_BUSY;
        n_ok += st == DI_OK;
    }
    CHECK(busy == 1);
    CHECK(n_ok >= 3);
    di_request_params p = request(0, &res[63]);
    uint64_t id;
    p.max_tokens = 600; // beyond max_ctx
    CHECK_EQ(di_engine_submit(e, &p, &id), DI_ERR_INVALID);
    p = request(0, &res[63]);
    const char *stop[] = {"ab"};
    p.stop_strings = stop;
    p.n_stop_strings = 1; // no token_bytes in this engine
    CHECK_EQ(di_engine_submit(e, &p, &id), DI_ERR_INVALID);
    di_engine_destroy(e); // cancels what is left; every request gets its final event
    int finals = 1;
    for (int i = 0; i < n_ok; i++) finals &= atomic_load(&res[i].finished) == 1;
    CHECK(finals);
}

static const char *letter_bytes(void *user, int32_t id, size_t *n) {
    (void)user;
    static const char k[] = "abcdefghijklmnopqrstuvwxyz";
    *n = 1;
    return k + id % 26;
}

static void test_stop_string(void) {
    di_engine_options o = di_engine_options_default();
    o.n_threads = 2;
    o.max_ctx = 512;
    o.kv_memory_bytes = 16u << 20;
    o.token_bytes = letter_bytes;
    di_engine *e = NULL;
    CHECK_EQ(di_engine_create(g_dir, &o, &e), DI_OK);
    if (!e) return;
    // Greedy request 0 alone produced g_alone[0].tokens; stop at the text of tokens 2 and 3.
    char stop_s[3] = {(char)('a' + g_alone[0].tokens[2] % 26),
                      (char)('a' + g_alone[0].tokens[3] % 26), 0};
    const char *stops[] = {stop_s};
    result r;
    memset(&r, 0, sizeof r);
    di_request_params p = request(0, &r);
    p.stop_strings = stops;
    p.n_stop_strings = 1;
    uint64_t id;
    CHECK_EQ(di_engine_submit(e, &p, &id), DI_OK);
    di_engine_wait_idle(e);
    // The first occurrence of the two letters may come earlier than tokens 2..3.
    char all[64];
    for (int i = 0; i < g_alone[0].n; i++) all[i] = (char)('a' + g_alone[0].tokens[i] % 26);
    all[g_alone[0].n] = 0;
    char *hit = strstr(all, stop_s);
    CHECK(hit != NULL);
    if (hit) {
        int at = (int)(hit - all);
        CHECK_EQ(r.finish, DI_FINISH_STOP);
        CHECK_EQ(r.n, at + 2);          // tokens up to the one completing the stop string
        CHECK_EQ(r.n_text, (size_t)at); // text before the stop string only
        CHECK(memcmp(r.text, all, (size_t)at) == 0);
    }
    di_engine_destroy(e);
}

// Requests first .. first + n - 1 (request(i) with max_tokens gen[i], priority prio[i], tenant
// ten[i]) submitted in order to an engine of max_seqs slots and priority aging aging_ms; the
// first `lead` ones are running before the others arrive (a step takes milliseconds, a submit
// microseconds).
static void run_sched(int max_seqs, int lead, int first, int n, const int *gen, const int *prio,
                      const uint64_t *ten, int32_t aging_ms, result *res, di_engine_stats *st) {
    di_engine *e = engine_aging(64u << 20, max_seqs, false, aging_ms);
    if (!e) return;
    atomic_store(&g_first_seq, 0);
    for (int i = first; i < first + n; i++) {
        memset(&res[i], 0, sizeof res[i]);
        di_request_params p = request(i, &res[i]);
        p.max_tokens = gen[i];
        p.priority = prio[i];
        p.tenant = ten[i];
        uint64_t id;
        CHECK_EQ(di_engine_submit(e, &p, &id), DI_OK);
        for (int k = first; i == first + lead - 1 && k <= i; k++)
            while (res[k].n == 0) usleep(200);
    }
    di_engine_wait_idle(e);
    di_engine_get_stats(e, st);
    CHECK_EQ(st->n_tenants_backlogged, 0);
    check_clean(e);
    di_engine_destroy(e);
}

// The orders asserted here run without aging (a slow run must not age anyone); test_aging_order
// ages requests on the engine's skewed clock, the scheduler's own test (test_sched.c) covers aging
// on its clock, and the last run here checks that aging at 1 ms (which reorders and preempts at
// every step's whim) still leaves every output exact.
static void test_priority_and_fair_share(void) {
    enum { N = 5 };
    static result alone[N], got[N];
    const int gen[N] = {40, 10, 30, 30, 12}, prio0[N] = {0};
    const uint64_t ten0[N] = {0};
    di_engine_stats st;
    for (int i = 0; i < N; i++) run_sched(1, 1, i, 1, gen, prio0, ten0, 0, alone, &st);
    // Fair share by tokens (virtual token counter): tenant 9 runs 0 (prompt 5, 40 tokens) and
    // tenant 7 runs 1 (prompt 42, 10 tokens) in the two slots; then 2 (tenant 7), 3 (tenant 9)
    // and 4 (tenant 7) arrive. When 1 ends, tenant 7 has no request running and tenant 9 one,
    // but tenant 7 received more tokens (42 + 2 x 9 against 5 + 2 x 9): 3 goes before the older
    // 2 (fewest running requests, or first come first served, would take 2); then 2, then 4.
    const uint64_t ten[N] = {9, 7, 7, 9, 7};
    run_sched(2, 2, 0, N, gen, prio0, ten, 0, got, &st);
    fprintf(stderr, "fair share: first tokens at %d %d %d %d %d, %d tenants tracked\n",
            got[0].first_at, got[1].first_at, got[2].first_at, got[3].first_at, got[4].first_at,
            st.n_tenants_tracked);
    CHECK(got[3].first_at < got[2].first_at);
    CHECK(got[2].first_at < got[4].first_at);
    CHECK_EQ(st.n_tenants_tracked, 2);
    CHECK_EQ(st.n_preemptions, 0);
    for (int i = 0; i < N; i++) CHECK(same(&got[i], &alone[i]));
    // Priority: one slot; 0 runs, 1 and 2 wait (all priority 0), then 3 arrives with priority -5
    // and 4 with -1: 3 preempts 0 at once, then 4 runs (better than the others' 0), then 0 again
    // (recomputed: the same output), then 1 and 2 in arrival order.
    const int prio[N] = {0, 0, 0, -5, -1};
    run_sched(1, 1, 0, N, gen, prio, ten0, 0, got, &st);
    fprintf(stderr, "priority: done at %d %d %d %d %d, %lld priority preemptions\n", got[0].done_at,
            got[1].done_at, got[2].done_at, got[3].done_at, got[4].done_at,
            (long long)st.n_priority_preemptions);
    CHECK(got[3].done_at < got[4].done_at);
    CHECK(got[4].done_at < got[0].done_at);
    CHECK(got[0].done_at < got[1].done_at);
    CHECK(got[1].done_at < got[2].done_at);
    CHECK_EQ(got[0].n_preempted, 1);
    CHECK_EQ(st.n_priority_preemptions, 1);
    for (int i = 0; i < N; i++) CHECK(same(&got[i], &alone[i]));
    // Aging at 1 ms, mixed priorities and tenants: every output still equals the request alone.
    const int prio_mix[N] = {3, 0, -2, 5, -1};
    run_sched(2, 1, 0, N, gen, prio_mix, ten, 1, got, &st);
    fprintf(stderr, "aging 1 ms: %lld priority preemptions\n",
            (long long)st.n_priority_preemptions);
    for (int i = 0; i < N; i++) {
        CHECK_EQ(atomic_load(&got[i].finished), 1);
        CHECK(same(&got[i], &alone[i]));
    }
}

// Aging on the engine's own clock (di_engine_skew_clock moves it, so requests age by minutes
// without a slow test): one slot, aging 60 s; 0 (priority 0) runs, 1 (priority 3) waits, the clock
// moves 4 minutes, then 2 (priority 0) arrives: 1 aged to -1 runs before 2 when 0 ends, where
// without the skew 2's better priority goes first. Nothing is preempted (the running 0 aged too),
// and every output equals the request alone.
static void run_aging(bool skew, result *got, di_engine_stats *st) {
    enum { N = 3 };
    const int gen[N] = {40, 10, 10}, prio[N] = {0, 3, 0};
    di_engine *e = engine_aging(64u << 20, 1, false, 60000);
    if (!e) return;
    atomic_store(&g_first_seq, 0);
    for (int i = 0; i < N; i++) {
        memset(&got[i], 0, sizeof got[i]);
        di_request_params p = request(i, &got[i]);
        p.max_tokens = gen[i];
        p.priority = prio[i];
        uint64_t id;
        CHECK_EQ(di_engine_submit(e, &p, &id), DI_OK);
        if (i == 0)
            while (got[0].n == 0) usleep(200); // 0 runs
        if (i == 1) { // 1 is in the scheduler's queue (enqueued on the clock before the skew)
            for (di_engine_get_stats(e, st); st->n_waiting < 1; di_engine_get_stats(e, st))
                usleep(200);
            if (skew) di_engine_skew_clock(e, 4 * 60000);
        }
    }
    di_engine_wait_idle(e);
    di_engine_get_stats(e, st);
    check_clean(e);
    di_engine_destroy(e);
}

static void test_aging_order(void) {
    enum { N = 3 };
    static result alone[N], got[N];
    const int gen[N] = {40, 10, 10}, prio0[N] = {0};
    const uint64_t ten0[N] = {0};
    di_engine_stats st;
    for (int i = 0; i < N; i++) run_sched(1, 1, i, 1, gen, prio0, ten0, 0, alone, &st);
    run_aging(false, got, &st);
    CHECK(got[2].first_at < got[1].first_at);
    CHECK(got[0].done_at < got[2].first_at);
    run_aging(true, got, &st);
    fprintf(stderr, "aging: first tokens at %d %d %d, %lld priority preemptions\n", got[0].first_at,
            got[1].first_at, got[2].first_at, (long long)st.n_priority_preemptions);
    CHECK(got[1].first_at < got[2].first_at);
    CHECK(got[0].done_at < got[1].first_at);
    CHECK_EQ(st.n_priority_preemptions, 0);
    for (int i = 0; i < N; i++) CHECK(same(&got[i], &alone[i]));
}

int main(void) {
    snprintf(g_dir, sizeof g_dir, "/tmp/di_test_engine_XXXXXX");
    if (!mkdtemp(g_dir)) return 1;
    di_synth_config c;
    CHECK(di_synth_preset("tiny", &c) == DI_OK);
    c.n_vocab = V;
    CHECK(di_synth_write(&c, g_dir) == DI_OK);
    for (int i = 0; i < N_REQ; i++) {
        g_len[i] = 5 + (i * 37) % 150; // 5 .. 154 tokens
        for (int t = 0; t < 200; t++)
            g_prompt[i][t] =
                (int32_t)((t < 40 ? t * 31 + 3 : t * 17 + i * 101) % V); // shared start
    }
    di_set_log_level(1);
    RUN(test_batch_invariance);
    RUN(test_async_overlap);
    RUN(test_preemption_tiny_budget);
    RUN(test_cancel_100);
    RUN(test_queue_limit_and_bad_requests);
    RUN(test_stop_string);
    RUN(test_priority_and_fair_share);
    RUN(test_aging_order);
    di_test_remove_dir(g_dir);
    return test_finish();
}
