// The engine's recovery from a lost device (engine.c "device loss", docs/cuda.md "Device loss"),
// on the device-resident forward's CPU twin attached on backends the model owns
// (di_model_dev_open), the loss simulated by di_engine_lose_device (the CPU backend's
// di_cpu_backend_lose: from some call of a forward on, every call fails with DI_ERR_DEVICE_LOST,
// as on a GPU after a sticky CUDA error, until the backend is destroyed). The reference is the
// same device-resident engine that never fails.
//   (a) V4, one stage. Requests P0 (150 tokens), P1 (40) and P2 (121) with max_seqs 3 and 32 rows
//       per step: P0 prefills in steps 1-5 (its first entry block is published by step 4), P1
//       joins in step 5's 10 leftover rows, and the plan of step 6, built while step 5 runs,
//       admits P2. The device is lost inside step 5: P0 and P1 end with DI_ERR_DEVICE_LOST; P2,
//       running but not in the step, is preempted for recompute and gives the reference's tokens
//       bit for bit after the rebuild. P0's prompt again afterwards finds nothing cached (the lost
//       device's blocks left the prefix cache) and gives the reference's tokens. A second loss
//       (device_loss_max 2), 601 s later on the scheduler's clock, is recovered too, and so is a
//       third one (two within the 600 s window); a fourth one (three within it) leaves the engine
//       unhealthy: every request still held ends with DI_ERR_DEVICE_LOST, a new
//       one is refused with it, nothing crashes or hangs. No step allocates; every block comes
//       back; decode steps replay graphs captured by the rebuild.
//   (b) a rebuild that fails (its new backend is lost in the warm-up call): unhealthy after one
//       loss, every request ends with DI_ERR_DEVICE_LOST and new ones are refused.
//   (c) V4.1, one stage: (a)'s first loss.
//   (d) V4, two pipeline stages on two CPU backends, the second stage's backend lost: (a)'s first
//       loss (every stage rebuilt);
//   (f) V4 with MTP speculation (spec_tokens 1): (a)'s first loss; the rebuild enables the MTP
//       block again;
//   (g) the disk tier's records survive a loss: a block read from disk before it (and dropped
//       from the memory cache by it) is read from disk again afterwards, the same tokens;
//   (h) a loss found between steps (by a KV export reading a cached block): the engine rebuilds
//       at once, no step fails, the block is gone afterwards;
//   (e) a running request with computed state (and a cached block with its tail snapshot) that is
//       not in the lost step (a better-priority request took the step's rows) is preempted and
//       recomputed after the rebuild, bit for bit the reference's (test_starved).
#include "harness.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>

#include "backend/backend.h"
#include "engine/engine_internal.h"
#include "model/dsv4.h"
#include "model/synth.h"

enum { V = 512, MAX_CTX = 256, N_P = 6, LOSE_AFTER = 25 };

static char g_dir4[256], g_dir41[256];
static int32_t g_prompt[N_P][160];
static const int32_t g_len[N_P] = {150, 40, 121, 90, 60, 5};
static const int32_t g_max_tokens[N_P] = {8, 8, 8, 6, 6, 12};

typedef struct result {
    int32_t tokens[16];
    float logprob[16];
    int32_t n;
    atomic_int finished;
    di_finish finish;
    di_status status;
    int32_t n_preempted, n_cached;
    int32_t pause_at[2]; // (e): after this many tokens the engine thread pauses (0: never)
} result;

// (e): the engine thread pauses in a request's event callback until the test releases it, so the
// test submits between two known steps (a deliberately slow callback: nothing else changes).
static pthread_mutex_t g_pmu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t g_pcv = PTHREAD_COND_INITIALIZER;
static int g_paused, g_released;

static void pause_here(int k) {
    pthread_mutex_lock(&g_pmu);
    g_paused = k;
    pthread_cond_broadcast(&g_pcv);
    while (g_released < k) pthread_cond_wait(&g_pcv, &g_pmu);
    pthread_mutex_unlock(&g_pmu);
}

static void wait_paused(int k) {
    pthread_mutex_lock(&g_pmu);
    while (g_paused < k) pthread_cond_wait(&g_pcv, &g_pmu);
    pthread_mutex_unlock(&g_pmu);
}

static void release(int k) {
    pthread_mutex_lock(&g_pmu);
    g_released = k;
    pthread_cond_broadcast(&g_pcv);
    pthread_mutex_unlock(&g_pmu);
}

static void on_event(void *user, const di_event *ev) {
    result *r = user;
    if (ev->token >= 0 && r->n < 16) {
        r->tokens[r->n] = ev->token;
        r->logprob[r->n] = ev->logprob;
        r->n++;
        for (int k = 0; k < 2; k++)
            if (r->pause_at[k] && r->n == r->pause_at[k]) pause_here(k + 1);
    }
    if (ev->finish != DI_FINISH_NONE) {
        r->finish = ev->finish;
        r->status = ev->status;
        r->n_preempted = ev->n_preempted;
        r->n_cached = ev->n_cached;
        atomic_fetch_add(&r->finished, 1);
    }
}

// Request i (prompt P_i); odd ones sample with a seed (keyed by position: the same after a
// recompute). With a priority (lower runs first) and pause points (res->pause_at, kept).
static di_status submit_p(di_engine *e, int i, result *res, int32_t priority) {
    const int32_t p0 = res->pause_at[0], p1 = res->pause_at[1];
    memset(res, 0, sizeof *res);
    res->pause_at[0] = p0, res->pause_at[1] = p1;
    di_request_params p = di_request_params_default();
    p.priority = priority;
    p.prompt = g_prompt[i];
    p.n_prompt = g_len[i];
    p.max_tokens = g_max_tokens[i];
    p.ignore_eos = true;
    if (i % 2) {
        p.sample.temperature = 0.8f;
        p.sample.top_k = 40;
        p.sample.seed = 91 + (uint64_t)i;
    }
    p.on_event = on_event;
    p.user = res;
    uint64_t id;
    return di_engine_submit(e, &p, &id);
}

static di_status submit(di_engine *e, int i, result *res) {
    res->pause_at[0] = res->pause_at[1] = 0;
    return submit_p(e, i, res, 0);
}

static bool same(const result *a, const result *b) {
    return a->n == b->n && !memcmp(a->tokens, b->tokens, sizeof(int32_t) * (size_t)a->n) &&
           !memcmp(a->logprob, b->logprob, sizeof(float) * (size_t)a->n);
}

// ---- engines ----

static int32_t g_stages = 1;

static di_status open_twin(di_model *m, void *user) {
    (void)user;
    di_device devs[2] = {{.kind = DI_DEVICE_CPU}, {.kind = DI_DEVICE_CPU}};
    return di_model_dev_open(m, devs, g_stages); // owned by the model: rebuildable
}

// rows: rows per step; tails: tail snapshots on (else hits are continued by the bounded replay);
// spec: MTP speculation (V4: one draft per verify); disk: the prefix cache's disk tier there
// (NULL: none).
static const char *g_disk;

static di_engine *engine_o(const char *dir, int32_t loss_max, int32_t rows, bool tails,
                           int32_t spec) {
    di_engine_options o = di_engine_options_default();
    o.n_threads = 2;
    o.kv_memory_bytes = (size_t)64 << 20;
    o.max_seqs = 3;
    o.max_batch_tokens = rows; // chunked prefill
    o.max_ctx = MAX_CTX;
    o.no_tail_cache = !tails; // the prefix cache on
    o.device_loss_max = loss_max;
    o.spec_tokens = spec;
    o.kv_disk_dir = g_disk;
    di_engine *e = NULL;
    CHECK_EQ(di_engine_create_prepared(dir, &o, open_twin, NULL, &e), DI_OK);
    return e;
}

static di_engine *engine(const char *dir, int32_t loss_max) {
    return engine_o(dir, loss_max, 32, false, 0);
}

static result g_ref[N_P];

// The reference: the engine that never fails, every request once.
static void reference(const char *dir) {
    di_engine *e = engine(dir, 0);
    if (!e) return;
    for (int i = 0; i < N_P; i++) CHECK_EQ(submit(e, i, &g_ref[i]), DI_OK);
    di_engine_wait_idle(e);
    for (int i = 0; i < N_P; i++) {
        CHECK_EQ(g_ref[i].finish, DI_FINISH_LENGTH);
        CHECK_EQ(g_ref[i].n, g_max_tokens[i]);
    }
    di_engine_destroy(e);
}

static void stats(di_engine *e, di_engine_stats *st) {
    di_engine_get_stats(e, st);
}

// Every request of ids[0, n) finished once: either with the loss, or with the reference's tokens.
// Returns how many ended with the loss.
static int check_outcomes(const result *got, const int *ids, int n) {
    int n_lost = 0;
    for (int k = 0; k < n; k++) {
        const result *g = &got[k];
        CHECK_EQ(atomic_load(&g->finished), 1);
        if (g->finish == DI_FINISH_ERROR) {
            CHECK_EQ(g->status, DI_ERR_DEVICE_LOST);
            n_lost++;
        } else {
            CHECK_EQ(g->finish, DI_FINISH_LENGTH);
            CHECK(same(g, &g_ref[ids[k]]));
        }
    }
    return n_lost;
}

// (a)'s first loss on engine e (its first forwards): P0, P1, P2 submitted together, the device of
// stage `stage` lost inside step 5. Then P0's prompt again. Returns false when something is off.
static void first_loss(di_engine *e, int32_t stage, const char *what) {
    static result got[3], again;
    di_engine_lose_device(e, 4, stage, LOSE_AFTER, 0);
    for (int i = 0; i < 3; i++) CHECK_EQ(submit(e, i, &got[i]), DI_OK);
    di_engine_wait_idle(e);
    const int ids[3] = {0, 1, 2};
    CHECK_EQ(check_outcomes(got, ids, 3), 2);
    // The step's requests end with the loss; the one admitted ahead is recomputed, unchanged.
    CHECK(got[0].finish == DI_FINISH_ERROR && got[1].finish == DI_FINISH_ERROR);
    CHECK_EQ(got[2].finish, DI_FINISH_LENGTH);
    CHECK(got[2].n_preempted >= 1);
    CHECK(same(&got[2], &g_ref[2]));
    di_engine_stats st;
    stats(e, &st);
    CHECK_EQ(st.n_device_losses, 1);
    CHECK_EQ(st.n_device_recoveries, 1);
    CHECK(st.n_device_loss_preempted >= 1);
    CHECK(!st.unhealthy);
    // P0's prompt again: its first block (published before the loss) is not reused.
    CHECK_EQ(submit(e, 0, &again), DI_OK);
    di_engine_wait_idle(e);
    CHECK_EQ(atomic_load(&again.finished), 1);
    CHECK_EQ(again.finish, DI_FINISH_LENGTH);
    CHECK_EQ(again.n_cached, 0);
    CHECK(same(&again, &g_ref[0]));
    stats(e, &st);
    CHECK_EQ(st.n_blocks_free, st.n_blocks_total);
    CHECK_EQ(st.n_step_allocs, 0);
    CHECK(st.device.resident);
    di_dsv4_dev_graph_stats gs;
    di_engine_get_graph_stats(e, &gs); // the rebuilt state's: captured by the rebuild, replayed
    CHECK(gs.n_cached >= 2);
    CHECK_EQ(gs.n_captured, gs.n_cached);
    CHECK(gs.n_replayed > 0);
    fprintf(stderr,
            "%s: the device lost inside step 5: P0, P1 ended with \"%s\"; P2 preempted %d time(s) "
            "and recomputed: identical to the reference; P0 again: %d cached positions, "
            "identical; %lld steps, %lld failed\n",
            what, di_status_str(got[0].status), (int)got[2].n_preempted, (int)again.n_cached,
            (long long)st.n_steps, (long long)st.n_failed_steps);
}

// A later loss on engine e: P1, P3, P4 submitted, the device lost in their third forward.
// Returns how many ended with the loss.
static int later_loss(di_engine *e, result *got) {
    static const int ids[3] = {1, 3, 4};
    di_engine_lose_device(e, 2, 0, LOSE_AFTER, 0);
    for (int k = 0; k < 3; k++) CHECK_EQ(submit(e, ids[k], &got[k]), DI_OK);
    di_engine_wait_idle(e);
    return check_outcomes(got, ids, 3);
}

// ---- (a) ----

static void test_v4(void) {
    reference(g_dir4);
    di_engine *e = engine(g_dir4, 2);
    if (!e) return;
    first_loss(e, 0, "(a) V4");
    // The window: the first loss is 601 s ago from here on, so the third loss is the second
    // within it (recovered; without the window three losses would exceed device_loss_max 2).
    di_engine_skew_clock(e, 601 * 1000);
    static result got[3];
    int n_lost = later_loss(e, got); // the second loss: recovered
    CHECK(n_lost >= 1 && n_lost < 3);
    di_engine_stats st;
    stats(e, &st);
    CHECK_EQ(st.n_device_losses, 2);
    CHECK_EQ(st.n_device_recoveries, 2);
    CHECK(!st.unhealthy);
    n_lost = later_loss(e, got);
    CHECK(n_lost >= 1 && n_lost < 3);
    stats(e, &st);
    CHECK_EQ(st.n_device_losses, 3);
    CHECK_EQ(st.n_device_recoveries, 3);
    CHECK(!st.unhealthy);
    CHECK_EQ(st.n_step_allocs, 0);
    CHECK_EQ(st.n_blocks_free, st.n_blocks_total);
    // The fourth: three within 600 s, more than device_loss_max: unhealthy. Every request ends.
    n_lost = later_loss(e, got);
    CHECK_EQ(n_lost, 3);
    stats(e, &st);
    CHECK_EQ(st.n_device_losses, 4);
    CHECK_EQ(st.n_device_recoveries, 3);
    CHECK(st.unhealthy);
    static result refused;
    CHECK_EQ(submit(e, 1, &refused), DI_ERR_DEVICE_LOST);
    CHECK_EQ(atomic_load(&refused.finished), 0);
    di_engine_wait_idle(e); // nothing held: returns
    fprintf(stderr,
            "(a) V4: losses 2 and 3 (601 s after the 1st) recovered; the 4th (three within 600 s): "
            "unhealthy, "
            "every request ended with the loss, a new one refused (\"%s\")\n",
            di_status_str(DI_ERR_DEVICE_LOST));
    di_engine_destroy(e);
}

// ---- (b) ----

static void test_rebuild_fails(void) {
    di_engine *e = engine(g_dir4, 0);
    if (!e) return;
    static result got[3];
    di_engine_lose_device(e, 1, 0, LOSE_AFTER, 1); // the rebuild's backend is lost too
    for (int i = 0; i < 3; i++) CHECK_EQ(submit(e, i, &got[i]), DI_OK);
    di_engine_wait_idle(e);
    const int ids[3] = {0, 1, 2};
    CHECK_EQ(check_outcomes(got, ids, 3), 3);
    di_engine_stats st;
    stats(e, &st);
    CHECK_EQ(st.n_device_losses, 1);
    CHECK_EQ(st.n_device_recoveries, 0);
    CHECK(st.unhealthy);
    CHECK_EQ(submit(e, 0, &got[0]), DI_ERR_DEVICE_LOST);
    fprintf(stderr, "(b) a failed rebuild: unhealthy after one loss, every request ended with "
                    "the loss, new ones refused\n");
    di_engine_destroy(e);
}

// ---- (e) ----

// A running request whose state is computed but which is not in the failing step: P0 (150
// tokens, priority 0) prefills [0, 47), [47, 94), [94, 128) (its chunk ends at its snapshot
// point, the block boundary 128, leaving 13 rows) beside P5's decodes, 48 rows per step; P2
// (priority -1, better) is admitted into those 13 rows, and in the next step, which runs first
// in priority order, takes the whole budget: P0 (128 positions computed) is not in that step,
// which loses the device. P5 and P2 end with the loss; P0 is preempted for recompute (its state
// and its cached first block with its tail snapshot are gone) and gives the reference's tokens.
// The schedule is pinned by pausing the engine thread in P5's callbacks: P0 is submitted after
// P5's first token (step 1), P2 after its third (step 3; the plan of step 4 is made), with the
// loss armed for the third forward from there (step 6).
static void test_starved(void) {
    di_engine *e = engine_o(g_dir4, 0, 48, true, 0);
    if (!e) return;
    static result tick, low, high;
    g_paused = g_released = 0;
    tick.pause_at[0] = 1, tick.pause_at[1] = 3;
    CHECK_EQ(submit_p(e, 5, &tick, 0), DI_OK);
    wait_paused(1);
    low.pause_at[0] = low.pause_at[1] = 0;
    CHECK_EQ(submit_p(e, 0, &low, 0), DI_OK);
    release(1);
    wait_paused(2);
    high.pause_at[0] = high.pause_at[1] = 0;
    CHECK_EQ(submit_p(e, 2, &high, -1), DI_OK);
    di_engine_lose_device(e, 2, 0, LOSE_AFTER, 0);
    release(2);
    di_engine_wait_idle(e);
    const result *got[3] = {&tick, &low, &high};
    for (int k = 0; k < 3; k++) CHECK_EQ(atomic_load(&got[k]->finished), 1);
    CHECK_EQ(tick.finish, DI_FINISH_ERROR);
    CHECK_EQ(tick.status, DI_ERR_DEVICE_LOST);
    CHECK_EQ(high.finish, DI_FINISH_ERROR);
    CHECK_EQ(high.status, DI_ERR_DEVICE_LOST);
    CHECK_EQ(tick.n, 5); // tokens 1-5 (steps 1-5) were the reference's
    CHECK(!memcmp(tick.tokens, g_ref[5].tokens, sizeof(int32_t) * 5));
    CHECK_EQ(low.finish, DI_FINISH_LENGTH);
    CHECK_EQ(low.n_preempted, 1);
    CHECK(same(&low, &g_ref[0]));
    di_engine_stats st;
    stats(e, &st);
    CHECK_EQ(st.n_device_losses, 1);
    CHECK_EQ(st.n_device_recoveries, 1);
    CHECK_EQ(st.n_device_loss_preempted, 1);
    CHECK_EQ(st.n_step_allocs, 0);
    CHECK_EQ(st.n_blocks_free, st.n_blocks_total);
    fprintf(stderr,
            "(e) P0 with 128 positions computed, starved by the better-priority P2 in the lost "
            "step: preempted, recomputed, identical to the reference; P5 and P2 ended with the "
            "loss\n");
    di_engine_destroy(e);
}

// ---- (c), (d) ----

static void test_v41(void) {
    reference(g_dir41);
    di_engine *e = engine(g_dir41, 0);
    if (!e) return;
    first_loss(e, 0, "(c) V4.1");
    di_engine_destroy(e);
}

// (f) MTP speculation on the device-resident forward: the rebuilt forward gets its MTP block
// back (di_dsv4_dev_mtp_enable) and the state its MTP rings and verify graphs.
static void test_spec(void) {
    reference(g_dir4); // speculation changes no output: the plain engine's tokens
    di_engine *e = engine_o(g_dir4, 0, 32, false, 1);
    if (!e) return;
    first_loss(e, 0, "(f) V4 with MTP speculation");
    di_engine_stats st;
    stats(e, &st);
    CHECK(st.n_spec_verifies > 0);
    di_engine_destroy(e);
}

// (g) The disk tier's records survive a loss: engine A runs P0 and is destroyed (its cached first
// block written to disk); engine B on the same directory runs P0 (128 positions read from disk,
// uploaded into a device block), then loses its device (P1, P3, P4): the block leaves the
// memory cache, its record stays, and P0 again reads it from disk into the rebuilt device: 128
// cached positions and the reference's tokens.
static void test_disk(void) {
    char disk[300];
    snprintf(disk, sizeof disk, "%s/kv-disk", g_dir4);
    g_disk = disk;
    static result r, got[3];
    di_engine *e = engine(g_dir4, 0);
    if (e) {
        CHECK_EQ(submit(e, 0, &r), DI_OK);
        di_engine_wait_idle(e);
        CHECK(same(&r, &g_ref[0]));
        di_engine_destroy(e); // writes the cached block
    }
    e = engine(g_dir4, 0);
    if (!e) {
        g_disk = NULL;
        return;
    }
    CHECK_EQ(submit(e, 0, &r), DI_OK);
    di_engine_wait_idle(e);
    CHECK_EQ(r.n_cached, 128);
    CHECK(same(&r, &g_ref[0]));
    di_engine_stats st0, st;
    stats(e, &st0);
    CHECK(st0.n_disk_dev_uploads >= 1);
    int n_lost = later_loss(e, got);
    CHECK(n_lost >= 1);
    stats(e, &st);
    CHECK_EQ(st.n_device_recoveries, 1);
    CHECK_EQ(submit(e, 0, &r), DI_OK);
    di_engine_wait_idle(e);
    CHECK_EQ(r.finish, DI_FINISH_LENGTH);
    CHECK_EQ(r.n_cached, 128); // from disk again: the memory copy was dropped, the record kept
    CHECK(same(&r, &g_ref[0]));
    stats(e, &st);
    CHECK(st.n_disk_dev_uploads > st0.n_disk_dev_uploads);
    CHECK(st.n_disk_blocks_read > st0.n_disk_blocks_read);
    CHECK_EQ(st.n_step_allocs, 0);
    fprintf(stderr,
            "(g) disk tier: P0's block read from disk before the loss and again after it (%lld "
            "uploads into device blocks), the reference's tokens\n",
            (long long)st.n_disk_dev_uploads);
    di_engine_destroy(e);
    g_disk = NULL;
}

// (h) A loss found between steps: P0 runs (its first block cached); the device is lost while
// the engine is idle, and a KV export (reading that block from the device) finds it: the export
// fails with DI_ERR_DEVICE_LOST and the engine rebuilds at once, no step failing; P0 again then
// finds nothing cached (the block was the lost device's) and gives the reference's tokens.
static void test_idle(void) {
    di_engine *e = engine(g_dir4, 0);
    if (!e) return;
    static result r;
    CHECK_EQ(submit(e, 0, &r), DI_OK);
    di_engine_wait_idle(e);
    CHECK(same(&r, &g_ref[0]));
    di_engine_lose_device(e, -1, 0, 0, 0); // lost now
    void *x = NULL;
    size_t n_x = 0;
    int32_t n_blocks = 0;
    char err[256] = "";
    CHECK_EQ(di_engine_kv_export(e, g_prompt[0], g_len[0], 0, &x, &n_x, &n_blocks, err, sizeof err),
             DI_ERR_DEVICE_LOST);
    di_free_buffer(x);
    di_engine_wait_idle(e);
    di_engine_stats st;
    stats(e, &st);
    CHECK_EQ(st.n_device_losses, 1);
    CHECK_EQ(st.n_device_recoveries, 1);
    CHECK_EQ(st.n_failed_steps, 0);
    CHECK(!st.unhealthy);
    CHECK_EQ(submit(e, 0, &r), DI_OK);
    di_engine_wait_idle(e);
    CHECK_EQ(r.finish, DI_FINISH_LENGTH);
    CHECK_EQ(r.n_cached, 0);
    CHECK(same(&r, &g_ref[0]));
    fprintf(stderr, "(h) a loss found by a KV export between steps: rebuilt at once, no step "
                    "failed, the same tokens afterwards\n");
    di_engine_destroy(e);
}

static void test_stages(void) {
    g_stages = 2;
    reference(g_dir4);
    di_engine *e = engine(g_dir4, 0);
    if (e) {
        first_loss(e, 1, "(d) V4, 2 stages, stage 1 lost");
        di_engine_destroy(e);
    }
    g_stages = 1;
}

int main(void) {
    snprintf(g_dir4, sizeof g_dir4, "/tmp/di_test_engine_recover4_XXXXXX");
    snprintf(g_dir41, sizeof g_dir41, "/tmp/di_test_engine_recover41_XXXXXX");
    if (!mkdtemp(g_dir4) || !mkdtemp(g_dir41)) return 1;
    di_synth_config c;
    CHECK(di_synth_preset("tiny-128", &c) == DI_OK); // SWA, CSA m=4, HCA m=128 layers
    c.n_vocab = V;
    CHECK(di_synth_write(&c, g_dir4) == DI_OK);
    CHECK_EQ(di_synth_v41_write(g_dir41, true, false, 43), DI_OK);
    for (int i = 0; i < N_P; i++)
        for (int t = 0; t < 160; t++)
            g_prompt[i][t] = (int32_t)((t * 31 + i * 17 + (i % 2 ? t * t : 0) + 3) % V);
    di_set_log_level(1);
    RUN(test_v4);
    RUN(test_rebuild_fails);
    RUN(test_starved);
    RUN(test_spec);
    RUN(test_disk);
    RUN(test_idle);
    RUN(test_v41);
    RUN(test_stages);
    di_test_remove_dir(g_dir4);
    di_test_remove_dir(g_dir41);
    return test_finish();
}
