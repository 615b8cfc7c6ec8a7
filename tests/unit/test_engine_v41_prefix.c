// The prefix cache of the engine's V4.1 forward (engine.c, docs/kv-cache.md "DeepSeek V4.1") on
// the V4.1 tiny model (di_synth_v41_write with DSpark: W = 16, 6 layers, kv sources with m = 2
// and m = 1, Engram; blocks of 16 positions, replay bound R = 6 * 15 = 90). The oracle is the same
// engine with the prefix cache off (itself checked against plain sessions by test_engine_v41.c):
// a hit must not change a single bit of any output (tokens, logprobs, top logprobs, the logits
// that chose the first token).
//   (a) hit lengths: after a 240-token prompt, prompts sharing its first n tokens (n = 17 .. 240,
//       then 7 tokens of their own) hit n rounded down to a block (16 .. 224, limited to n_prompt -
//       1), replay max(0, hit - 90) .. hit - 1 (the cached blocks attached, their entries kept;
//       hits <= 90 replay from 0, longer ones 90 positions: across blocks, ratio-2 groups and
//       windows),
//       run 3 at a time with 32 rows per step (chunked replay), and are exact; the counters
//       (di_event n_cached / n_replayed, engine stats) add up; nothing is allocated in a step;
//   (b) two concurrent requests sharing a 200-token prefix on a fresh engine: the second attaches
//       blocks the first published while running (computed in place by its step, read at the
//       second's launch) and both are exact;
//   (c) eviction: kv_memory_bytes for one slot and its blocks only (no extra blocks): a
//       different prompt evicts the first prompt's idle cached blocks (least recently used
//       first), so the first prompt again misses, still exact; every block is available again;
//   (d) a request with a hit cancelled after 2 tokens: every block is available again (the idle
//       cached ones included), none running; the next request with the same prefix is exact;
//   (e) DSpark speculation (spec_tokens 2) on top of hits gives the outputs of the engine with
//       neither speculation nor the cache;
//   (f) another checkpoint (same shapes, other weights: another weights_id) has another model
//       identity in the prefix cache's chain hash, so its blocks never match;
//   (g) the disk tier (kv_disk_dir): blocks flushed at destroy are hits for a new engine on the
//       same directory (read from disk, exact; with tail snapshots, the prompt's snapshot comes
//       back from its disk record: no replay); an engine of another checkpoint on that directory
//       finds none of them; without the prefix cache the option is refused;
//   (h) a hit shares blocks: the second request's first blocks are the ids of the first one's
//       cached blocks, and while it runs the pool lacks exactly its blocks (shared ones once).
#include "harness.h"

#include <stdatomic.h>
#include <stdlib.h>
#include <sys/stat.h>

#include "engine/engine_internal.h"
#include "kv/kv_manager.h"
#include "model/dsv41.h"
#include "model/synth.h"

enum { V = 512, MAX_GEN = 8, MAX_CTX = 320, N_TOP = 3, ROWS = 32, N_THREADS = 2, LONG = 240 };
enum { N_HIT = 9, TAIL = 7, MAXP = LONG + TAIL };
#include "engine_v41_slot.h" // v41_slot: one engine slot's session

static char g_root[256], g_dir[300], g_dir2[300];
static int32_t g_base[LONG];  // the shared text
static int32_t g_other[LONG]; // a prompt sharing nothing with it
static const int32_t g_n[N_HIT] = {17, 40, 95, 106, 130, 161, 200, 239, 240};

typedef struct result {
    di_engine *blocks_engine; // (h): records its block ids at its first and last tokens
    int32_t blocks_first[32], blocks_last[32], n_blocks_first, n_blocks_last;
    int64_t free_first; // the pool's available blocks at its first token
    di_engine *cancel_engine;
    int32_t cancel_after;
    int32_t prompt[MAXP], n_prompt;
    int32_t tokens[MAX_GEN];
    float logprob[MAX_GEN], top[MAX_GEN][N_TOP];
    float first[V];
    int32_t n;
    atomic_int finished;
    di_finish finish;
    int32_t n_cached, n_replayed;
} result;

static void on_event(void *user, const di_event *ev) {
    result *r = user;
    if (ev->token >= 0 && r->n < MAX_GEN) {
        r->tokens[r->n] = ev->token;
        r->logprob[r->n] = ev->logprob;
        for (int k = 0; k < ev->n_top && k < N_TOP; k++) r->top[r->n][k] = ev->top_logprobs[k];
        r->n++;
        if (r->blocks_engine && r->n == 1)
            r->n_blocks_first = di_engine_request_blocks(r->blocks_engine, ev->request_id,
                                                         r->blocks_first, 32, &r->free_first);
        if (r->blocks_engine && r->n == MAX_GEN) {
            int64_t n_free;
            r->n_blocks_last = di_engine_request_blocks(r->blocks_engine, ev->request_id,
                                                        r->blocks_last, 32, &n_free);
        }
        if (r->cancel_engine && r->n == r->cancel_after)
            di_engine_cancel(r->cancel_engine, ev->request_id);
    }
    if (ev->finish != DI_FINISH_NONE) {
        r->finish = ev->finish;
        r->n_cached = ev->n_cached;
        r->n_replayed = ev->n_replayed;
        atomic_fetch_add(&r->finished, 1);
    }
}

// Prompt kind k: the first n tokens of src, then TAIL tokens of its own (tail 0: none).
static void prompt(result *r, const int32_t *src, int32_t n, int32_t tail, int k) {
    memset(r, 0, sizeof *r);
    memcpy(r->prompt, src, sizeof(int32_t) * (size_t)n);
    for (int32_t t = 0; t < tail; t++) r->prompt[n + t] = (int32_t)((t * 13 + 101 * k + 7) % V);
    r->n_prompt = n + tail;
}

static void submit(di_engine *e, result *r, int k) {
    di_request_params p = di_request_params_default();
    p.prompt = r->prompt;
    p.n_prompt = r->n_prompt;
    p.max_tokens = MAX_GEN;
    p.ignore_eos = true;
    p.sample.n_logprobs = N_TOP;
    if (k % 2) { // seeded sampling on odd ones
        p.sample.temperature = 0.8f;
        p.sample.top_k = 40;
        p.sample.seed = 5 + (uint64_t)k;
    }
    p.first_logits = r->first;
    p.on_event = on_event;
    p.user = r;
    uint64_t id;
    CHECK_EQ(di_engine_submit(e, &p, &id), DI_OK);
}

static bool same(const result *a, const result *b) {
    return a->n == b->n && a->n > 0 &&
           !memcmp(a->tokens, b->tokens, sizeof(int32_t) * (size_t)a->n) &&
           !memcmp(a->logprob, b->logprob, sizeof(float) * (size_t)a->n) &&
           !memcmp(a->top, b->top, sizeof(a->top[0]) * (size_t)a->n) &&
           !memcmp(a->first, b->first, sizeof a->first);
}

static di_engine_options options(size_t kv_bytes, int32_t max_seqs, bool cache, int32_t spec) {
    di_engine_options o = di_engine_options_default();
    o.n_threads = N_THREADS;
    o.kv_memory_bytes = kv_bytes;
    o.max_seqs = max_seqs;
    o.max_batch_tokens = ROWS;
    o.max_ctx = MAX_CTX;
    o.no_prefix_cache = !cache;
    o.no_tail_cache =
        true; // these tests check the bounded replay (tail snapshots: test_engine_tail)
    o.spec_tokens = spec;
    return o;
}

static di_engine *engine(size_t kv_bytes, int32_t max_seqs, bool cache, int32_t spec) {
    di_engine_options o = options(kv_bytes, max_seqs, cache, spec);
    di_engine *e = NULL;
    CHECK_EQ(di_engine_create(g_dir, &o, &e), DI_OK);
    return e;
}

// The oracle: each request alone on an engine without the prefix cache.
static void oracle(result *ref, const result *req, int n, int k0) {
    di_engine *e = engine((size_t)64 << 20, 1, false, 0);
    for (int i = 0; e && i < n; i++) {
        prompt(&ref[i], req[i].prompt, req[i].n_prompt, 0, 0);
        submit(e, &ref[i], k0 + i);
        di_engine_wait_idle(e);
    }
    if (e) di_engine_destroy(e);
}

static void check_clean(di_engine *e) {
    di_engine_stats st;
    di_engine_get_stats(e, &st);
    CHECK_EQ(st.n_blocks_free, st.n_blocks_total);
    CHECK_EQ(st.n_running, 0);
    CHECK_EQ(st.n_preemptions, 0);
    CHECK_EQ(st.n_step_allocs, 0);
}

static int32_t expect_hit(int32_t n_shared, int32_t n_prompt) {
    int32_t lim = n_shared < n_prompt - 1 ? n_shared : n_prompt - 1;
    return lim / 16 * 16;
}

// ---- (a) ----

static void test_hit_lengths(void) {
    static result req[N_HIT + 1], ref[N_HIT + 1];
    prompt(&req[0], g_base, LONG, 0, 0);
    for (int i = 0; i < N_HIT; i++)
        prompt(&req[i + 1], g_base, g_n[i], g_n[i] == LONG ? 0 : TAIL, i);
    oracle(ref, req, N_HIT + 1, 0);
    di_engine *e = engine((size_t)64 << 20, 3, true, 0);
    if (!e) return;
    submit(e, &req[0], 0);
    di_engine_wait_idle(e);
    CHECK(same(&req[0], &ref[0]));
    CHECK_EQ(req[0].n_cached, 0);
    for (int i = 1; i <= N_HIT; i++) submit(e, &req[i], i);
    di_engine_wait_idle(e);
    int64_t hit_sum = 0, replay_sum = 0;
    int n_same = 0;
    for (int i = 1; i <= N_HIT; i++) {
        const int32_t n = g_n[i - 1], hit = expect_hit(n, req[i].n_prompt);
        const int32_t q = hit > 90 ? hit - 90 : 0;
        n_same += same(&req[i], &ref[i]);
        CHECK(same(&req[i], &ref[i]));
        CHECK_EQ(req[i].n_cached, hit);
        CHECK_EQ(req[i].n_replayed, hit - q);
        hit_sum += hit;
        replay_sum += hit - q;
        fprintf(stderr, "(a) shared %3d of %3d prompt tokens: hit %3d, replay %3d..%3d: %s\n", n,
                req[i].n_prompt, req[i].n_cached, q, hit - 1,
                same(&req[i], &ref[i]) ? "exact" : "DIFFERENT");
    }
    CHECK_EQ(n_same, N_HIT);
    di_engine_stats st;
    di_engine_get_stats(e, &st);
    CHECK_EQ(st.n_cache_hit_tokens, hit_sum);
    CHECK_EQ(st.n_replayed_tokens, replay_sum);
    CHECK(st.n_blocks_cached > 0);
    check_clean(e);
    di_engine_destroy(e);
}

// ---- (b) ----

static void test_concurrent(void) {
    static result req[2], ref[2];
    prompt(&req[0], g_base, 200, TAIL, 0);
    prompt(&req[1], g_base, 200, TAIL, 1);
    oracle(ref, req, 2, 0);
    di_engine *e = engine((size_t)64 << 20, 2, true, 0);
    if (!e) return;
    submit(e, &req[0], 0);
    submit(e, &req[1], 1);
    di_engine_wait_idle(e);
    CHECK(same(&req[0], &ref[0]));
    CHECK(same(&req[1], &ref[1]));
    CHECK_EQ(req[0].n_cached, 0);
    CHECK(req[1].n_cached > 90); // attached while the first ran, replayed from hit - 90
    fprintf(stderr, "(b) concurrent: the second attached %d cached positions (replayed %d): %s\n",
            req[1].n_cached, req[1].n_replayed,
            same(&req[0], &ref[0]) && same(&req[1], &ref[1]) ? "both exact" : "DIFFERENT");
    check_clean(e);
    di_engine_destroy(e);
}

// ---- (c) ----

static void test_eviction(void) {
    // One slot's tail and max_ctx blocks, nothing else: the bytes as the engine measures them.
    v41_slot t;
    if (!v41_slot_open(&t, g_dir)) return;
    CHECK_EQ(di_dsv41_reserve_ctx(t.s, MAX_CTX, ROWS), DI_OK);
    const int32_t bt = di_kv_block_tokens(t.m), max_blocks = (MAX_CTX + bt - 1) / bt;
    const int64_t blk = (int64_t)di_kv_v41_block_bytes(t.m);
    const int64_t slot = di_dsv41_state_bytes(t.s) + max_blocks * blk;
    v41_slot_close(&t);

    static result req[3], ref[3];
    prompt(&req[0], g_base, LONG, 0, 0);
    prompt(&req[1], g_other, LONG, 0, 1);
    prompt(&req[2], g_base, LONG, 0, 0);
    oracle(ref, req, 3, 0);
    di_engine_options o = options((size_t)slot, 2, true, 0);
    di_engine *e = NULL;
    CHECK_EQ(di_engine_create(g_dir, &o, &e), DI_OK);
    if (!e) return;
    di_engine_stats st;
    di_engine_get_stats(e, &st);
    CHECK_EQ(st.n_blocks_total, max_blocks); // one slot (max_seqs 2 -> 1), no extra blocks
    CHECK_EQ(st.block_bytes, blk);
    for (int i = 0; i < 3; i++) {
        submit(e, &req[i], i == 1);
        di_engine_wait_idle(e);
        CHECK(same(&req[i], &ref[i]));
        CHECK_EQ(req[i].n_cached, 0); // the third: its blocks were evicted by the second
    }
    di_engine_get_stats(e, &st);
    fprintf(stderr,
            "(c) eviction: %lld blocks of %lld bytes; the first prompt again after another: hit "
            "%d, exact %d; %lld blocks cached at the end\n",
            (long long)st.n_blocks_total, (long long)st.block_bytes, req[2].n_cached,
            same(&req[2], &ref[2]), (long long)st.n_blocks_cached);
    CHECK(st.n_blocks_cached > 0);
    check_clean(e);
    di_engine_destroy(e);
}

// ---- (d) ----

static void test_cancel(void) {
    static result req[3], ref[3];
    prompt(&req[0], g_base, LONG, 0, 0);
    prompt(&req[1], g_base, 161, TAIL, 1);
    prompt(&req[2], g_base, 200, TAIL, 2);
    oracle(ref, req, 3, 0);
    di_engine *e = engine((size_t)64 << 20, 2, true, 0);
    if (!e) return;
    submit(e, &req[0], 0);
    di_engine_wait_idle(e);
    req[1].cancel_engine = e;
    req[1].cancel_after = 2;
    submit(e, &req[1], 1);
    di_engine_wait_idle(e);
    CHECK_EQ(req[1].finish, DI_FINISH_CANCELLED);
    CHECK_EQ(req[1].n_cached, 160);
    CHECK(req[1].n >= 2 && !memcmp(req[1].tokens, ref[1].tokens, sizeof(int32_t) * 2));
    check_clean(e); // every block available again, the cached ones idle
    submit(e, &req[2], 2);
    di_engine_wait_idle(e);
    CHECK(same(&req[2], &ref[2]));
    CHECK_EQ(req[2].n_cached, 192);
    fprintf(stderr, "(d) cancelled with a 160-position hit after %d tokens; the next hit %d: %s\n",
            req[1].n, req[2].n_cached, same(&req[2], &ref[2]) ? "exact" : "DIFFERENT");
    check_clean(e);
    di_engine_destroy(e);
}

// ---- (e) ----

static void test_spec(void) {
    static result req[4], ref[4];
    prompt(&req[0], g_base, LONG, 0, 0);
    prompt(&req[1], g_base, 130, TAIL, 1);
    prompt(&req[2], g_base, 200, TAIL, 2);
    prompt(&req[3], g_base, 239, TAIL, 3);
    oracle(ref, req, 4, 0);
    di_engine *e = engine((size_t)64 << 20, 3, true, 2);
    if (!e) return;
    submit(e, &req[0], 0);
    di_engine_wait_idle(e);
    for (int i = 1; i < 4; i++) submit(e, &req[i], i);
    di_engine_wait_idle(e);
    di_engine_stats st;
    di_engine_get_stats(e, &st);
    int n_same = 0;
    for (int i = 0; i < 4; i++) n_same += same(&req[i], &ref[i]);
    CHECK_EQ(n_same, 4);
    CHECK_EQ(req[1].n_cached, 128);
    CHECK_EQ(req[3].n_cached, 224);
    CHECK(st.n_spec_verifies > 0);
    fprintf(stderr,
            "(e) DSpark spec_tokens 2 on hits of %d, %d, %d: %d/4 exact, %lld verifies, %lld "
            "drafts accepted\n",
            req[1].n_cached, req[2].n_cached, req[3].n_cached, n_same,
            (long long)st.n_spec_verifies, (long long)st.n_spec_accepted);
    check_clean(e);
    di_engine_destroy(e);
}

// ---- (f) ----

static void test_other_checkpoint(void) {
    di_model_options mo = di_model_options_default();
    mo.n_threads = N_THREADS;
    di_model *m1 = NULL, *m2 = NULL;
    CHECK_EQ(di_model_load(g_dir, &mo, &m1), DI_OK);
    CHECK_EQ(di_model_load(g_dir2, &mo, &m2), DI_OK);
    if (!m1 || !m2) goto out;
    CHECK(m1->weights_id != m2->weights_id);
    CHECK(!memcmp(&m1->hp, &m2->hp, sizeof m1->hp)); // the same architecture
    di_kv_manager *k1 = NULL, *k2 = NULL;
    CHECK_EQ(di_kv_manager_create_v41(m1, 20, 1, MAX_CTX, true, &k1), DI_OK);
    CHECK_EQ(di_kv_manager_create_v41(m2, 20, 1, MAX_CTX, true, &k2), DI_OK);
    if (k1 && k2) {
        CHECK(di_prefix_cache_hash(k1->cache, 0, g_base, 0) !=
              di_prefix_cache_hash(k2->cache, 0, g_base, 0));
        // A block of m1's cache is not found by m2's chain: open, publish one block on k1, look
        // it up with k2's hashes in k1's cache.
        CHECK_EQ(di_kv_seq_open(k1, 0, 0), DI_OK);
        CHECK_EQ(di_kv_seq_grow(k1, 0, 16), DI_OK);
        di_kv_seq_publish(k1, 0, g_base, 16);
        CHECK_EQ(di_prefix_cache_n_blocks(k1->cache), 1);
        int32_t ids[1];
        CHECK_EQ(di_prefix_cache_match(k1->cache, g_base, 1, 0, ids), 1);
        uint64_t h2 = di_prefix_cache_hash(k2->cache, 0, g_base, 0);
        CHECK_EQ(di_prefix_cache_find(k1->cache, h2, 0, g_base), -1);
        di_kv_seq_close(k1, 0);
    }
    di_kv_manager_destroy(k1);
    di_kv_manager_destroy(k2);
    fprintf(stderr, "(f) another checkpoint: another model identity, no match\n");
out:
    di_model_destroy(m1);
    di_model_destroy(m2);
}

// ---- (g) ----

static void test_disk(void) {
    char dir[320];
    snprintf(dir, sizeof dir, "%s/kv-disk", g_root);
    static result req[2], ref[2];
    prompt(&req[0], g_base, LONG, 0, 0);
    prompt(&req[1], g_base, 200, TAIL, 1);
    oracle(ref, req, 2, 0);
    di_engine_options o = options((size_t)64 << 20, 2, true, 0);
    o.kv_disk_dir = dir;
    // With tail snapshots: req[0]'s (at 224) goes to disk in block 13's record. req[1] does not
    // reach it (its hit, 192, is continued by the bounded replay).
    o.no_tail_cache = false;
    di_engine *e = NULL;
    CHECK_EQ(di_engine_create(g_dir, &o, &e), DI_OK);
    if (!e) return;
    submit(e, &req[0], 0);
    di_engine_wait_idle(e);
    CHECK(same(&req[0], &ref[0]));
    di_engine_destroy(e); // flushes its cached blocks
    o.kv_disk_dir = dir;
    e = NULL;
    CHECK_EQ(di_engine_create(g_dir, &o, &e), DI_OK);
    if (!e) return;
    submit(e, &req[1], 1);
    di_engine_wait_idle(e);
    di_engine_stats st;
    di_engine_get_stats(e, &st);
    CHECK(same(&req[1], &ref[1]));
    CHECK_EQ(req[1].n_cached, 192);
    CHECK_EQ(st.n_disk_hit_tokens, 192);
    fprintf(stderr,
            "(g) disk tier after a restart: hit %d (%lld from disk), %lld blocks read: %s\n",
            req[1].n_cached, (long long)st.n_disk_hit_tokens, (long long)st.n_disk_blocks_read,
            same(&req[1], &ref[1]) ? "exact" : "DIFFERENT");
    CHECK(req[1].n_replayed > 0);
    CHECK_EQ(st.n_disk_snaps_read, 0);
    // req[0] again: 12 blocks from memory, 2 from disk, the last with its snapshot: nothing
    // replayed, exactly.
    prompt(&req[0], g_base, LONG, 0, 0);
    submit(e, &req[0], 0);
    di_engine_wait_idle(e);
    di_engine_get_stats(e, &st);
    CHECK(same(&req[0], &ref[0]));
    CHECK_EQ(req[0].n_cached, 224);
    CHECK_EQ(req[0].n_replayed, 0);
    CHECK_EQ(st.n_disk_hit_tokens, 224);
    CHECK_EQ(st.n_disk_snaps_read, 1);
    CHECK_EQ(st.n_tail_restored, 1);
    fprintf(stderr, "(g) the snapshot in the disk record: hit %d, %d replayed\n", req[0].n_cached,
            req[0].n_replayed);
    check_clean(e);
    di_engine_destroy(e);
    o.no_tail_cache = true;
    o.no_tail_cache = true;
    // Another checkpoint on the same directory: no record is its.
    o.kv_disk_dir = dir;
    e = NULL;
    CHECK_EQ(di_engine_create(g_dir2, &o, &e), DI_OK);
    if (!e) return;
    prompt(&req[1], g_base, 200, TAIL, 1);
    submit(e, &req[1], 1);
    di_engine_wait_idle(e);
    CHECK_EQ(req[1].n_cached, 0);
    di_engine_get_stats(e, &st);
    CHECK_EQ(st.n_disk_hit_tokens, 0);
    di_engine_destroy(e);
    o = options((size_t)64 << 20, 2, false, 0); // the disk tier extends the prefix cache: off
    o.kv_disk_dir = dir;
    e = NULL;
    CHECK_EQ(di_engine_create(g_dir, &o, &e), DI_ERR_INVALID);
    CHECK(e == NULL);
}

// ---- (h) ----

static void test_shared_blocks(void) {
    static result req[2], ref[2];
    prompt(&req[0], g_base, LONG, 0, 0);
    prompt(&req[1], g_base, 200, TAIL, 1);
    oracle(ref, req, 2, 0);
    di_engine *e = engine((size_t)64 << 20, 2, true, 0);
    if (!e) return;
    di_engine_stats st;
    di_engine_get_stats(e, &st);
    for (int i = 0; i < 2; i++) {
        req[i].blocks_engine = e;
        submit(e, &req[i], i);
        di_engine_wait_idle(e);
        CHECK(same(&req[i], &ref[i]));
    }
    // The second request's first blocks are the blocks the first one computed (published while
    // it ran, cached since): attached, not copies. The 12 shared blocks are counted once: the
    // pool lacks exactly the second's blocks while it runs.
    const int32_t n_hit = req[1].n_cached / 16;
    CHECK_EQ(req[1].n_cached, 192);
    CHECK(req[0].n_blocks_last >= n_hit && req[1].n_blocks_first > n_hit);
    int n_equal = 0;
    for (int32_t b = 0; b < n_hit; b++) n_equal += req[1].blocks_first[b] == req[0].blocks_last[b];
    CHECK_EQ(n_equal, n_hit);
    CHECK_EQ(req[1].free_first, st.n_blocks_total - req[1].n_blocks_first);
    fprintf(stderr,
            "(h) shared blocks: the second request's first %d of %d blocks are the first "
            "request's (%d equal ids); %lld of %lld blocks available while it ran\n",
            (int)n_hit, (int)req[1].n_blocks_first, n_equal, (long long)req[1].free_first,
            (long long)st.n_blocks_total);
    di_engine_get_stats(e, &st);
    CHECK_EQ(st.n_blocks_free, st.n_blocks_total);
    di_engine_destroy(e);
}

int main(void) {
    snprintf(g_root, sizeof g_root, "/tmp/di_test_engine_v41_prefix_XXXXXX");
    if (!mkdtemp(g_root)) return 1;
    snprintf(g_dir, sizeof g_dir, "%s/v41-tiny", g_root);
    snprintf(g_dir2, sizeof g_dir2, "%s/v41-tiny-2", g_root);
    mkdir(g_dir, 0755);
    mkdir(g_dir2, 0755);
    CHECK_EQ(di_synth_v41_write(g_dir, true, true, 41), DI_OK);
    CHECK_EQ(di_synth_v41_write(g_dir2, true, true, 42), DI_OK);
    for (int t = 0; t < LONG; t++) {
        g_base[t] = (int32_t)((t * 31 + 11) % V);
        g_other[t] = (int32_t)((t * 17 + 300) % V);
    }
    test_hit_lengths();
    test_concurrent();
    test_eviction();
    test_cancel();
    test_spec();
    test_other_checkpoint();
    test_disk();
    test_shared_blocks();
    di_test_remove_dir(g_root);
    return test_finish();
}
