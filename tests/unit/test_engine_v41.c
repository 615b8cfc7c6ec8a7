// The engine on a DeepSeek V4.1 checkpoint (the V4.1 forward of engine.c: one V4.1 session per
// scheduler slot), on the V4.1 tiny model (di_synth_v41_write, official layout with DSpark, which
// the engine does not run), against an independent reference: a plain V4.1 session fed each
// request's whole prompt in one call, then one token per call, sampled with di_sampler.
//   (a) six concurrent requests (prompts 5..150 tokens, greedy and seeded) with max_seqs 3 (slots
//       reused) and 32 rows per step (chunked prefill), then with max_seqs 6, twice each, give the
//       reference's tokens, logprobs and first-token logits bit for bit; nothing is allocated
//       inside a step; every block comes back; with the prefix cache off (its tests are in
//       test_engine_v41_prefix.c) nothing is cached or hit, and nothing is preempted; every step
//       is one batched forward call (n_forward_calls) though steps hold several sequences;
//   (b) requests cancelled mid-decode free their slots; the requests that reuse them give the
//       reference's tokens;
//   (c) a forward failure injected mid-run ends exactly the requests of that step with
//       DI_FINISH_ERROR and its status; the others, and requests submitted afterwards into the
//       failed slots, give the reference's tokens;
//   (d) sizing: kv_memory_bytes pays max_seqs slot tails (di_dsv41_state_bytes of a session bound
//       to pool blocks, reserved for max_ctx positions and max_batch_tokens rows; the workspace
//       is shared) and buys blocks (V4.1 pages) with the rest: one byte less than one tail and
//       one max_ctx sequence's blocks is refused with DI_ERR_INVALID, exactly that clamps
//       max_seqs to 1 (and still serves three requests correctly, one after another); the disk
//       tier without the prefix cache is refused;
//   (e) memory proportional to use: in the memory where the dense layout (entries committed for
//       max_ctx per slot) fits fewer than 4 slots, 4 requests much shorter than max_ctx all run
//       at once (polled n_running), exactly, without preemption;
//   (f) preemption: 6 slots and a pool of 20 blocks for requests needing 43: V4.1 sequences are
//       preempted (recompute) and still give the reference's tokens; every block comes back.
#include "harness.h"

#include <sched.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <sys/stat.h>

#include "engine/engine_internal.h"
#include "kv/kv_manager.h"
#include "model/dsv41.h"
#include "model/synth.h"
#include "sample/sampler.h"

enum { V = 512, N_REQ = 6, MAX_GEN = 24, MAX_CTX = 256, N_TOP = 3, ROWS = 32, N_THREADS = 2 };

static char g_root[256], g_dir[300];
#include "engine_requests.h" // g_prompt, g_len, result, on_event, request, same
#include "engine_v41_slot.h" // v41_slot: one engine slot's session

// ---- the reference: one plain V4.1 session per request ----

static result g_ref[N_REQ];

static void reference(void) {
    di_model_options mo = di_model_options_default();
    mo.n_threads = N_THREADS; // as the engines below
    di_model *m = NULL;
    CHECK_EQ(di_model_load(g_dir, &mo, &m), DI_OK);
    di_sampler *smp = NULL;
    CHECK_EQ(di_sampler_create(V, &smp), DI_OK);
    static float logits[V];
    for (int i = 0; m && smp && i < N_REQ; i++) {
        result *r = &g_ref[i];
        memset(r, 0, sizeof *r);
        di_request_params p = request(i, r);
        di_session_options so = {.n_ctx_max = MAX_CTX};
        di_session *s = NULL;
        CHECK_EQ(di_session_create(m, &so, &s), DI_OK);
        if (!s) break;
        static int32_t hist[MAX_CTX];
        memcpy(hist, p.prompt, sizeof(int32_t) * (size_t)p.n_prompt);
        di_forward_out out = {.logits = logits, .last_only = true};
        CHECK_EQ(di_session_forward(s, hist, p.n_prompt, &out), DI_OK); // the whole prompt
        memcpy(r->first, logits, sizeof logits);
        for (int32_t g = 0; g < p.max_tokens; g++) {
            di_sample_result res;
            const int32_t n_known = p.n_prompt + g;
            di_sampler_sample(smp, logits, &p.sample, hist, p.n_prompt, g, n_known, &res);
            r->tokens[r->n] = res.token;
            r->logprob[r->n] = res.logprob;
            for (int k = 0; k < res.n_top && k < N_TOP; k++) r->top[r->n][k] = res.top_logprobs[k];
            r->n++;
            hist[n_known] = res.token;
            if (g + 1 < p.max_tokens)
                CHECK_EQ(di_session_forward(s, &hist[n_known], 1, &out), DI_OK);
        }
        di_session_destroy(s);
    }
    di_sampler_destroy(smp);
    di_model_destroy(m);
}

// ---- engines ----

static di_engine_options options(size_t kv_bytes, int32_t max_seqs) {
    di_engine_options o = di_engine_options_default();
    o.n_threads = N_THREADS;
    o.kv_memory_bytes = kv_bytes;
    o.max_seqs = max_seqs;
    o.max_batch_tokens = ROWS; // chunked prefill
    o.max_ctx = MAX_CTX;
    o.no_prefix_cache = true; // its tests: test_engine_v41_prefix.c
    return o;
}

static di_engine *engine(size_t kv_bytes, int32_t max_seqs) {
    di_engine_options o = options(kv_bytes, max_seqs);
    di_engine *e = NULL;
    CHECK_EQ(di_engine_create(g_dir, &o, &e), DI_OK);
    return e;
}

static void check_clean(di_engine *e) {
    di_engine_stats st;
    di_engine_get_stats(e, &st);
    CHECK_EQ(st.n_blocks_free, st.n_blocks_total);
    CHECK_EQ(st.n_blocks_cached, 0);
    CHECK_EQ(st.n_cache_hit_tokens, 0);
    CHECK_EQ(st.n_preemptions, 0);
    CHECK_EQ(st.n_step_allocs, 0);
    CHECK(!st.device.resident);
    // One batched V4.1 call per step that ran (a failed step runs none), whatever its sequences.
    CHECK_EQ(st.n_forward_calls, st.n_steps - st.n_failed_steps);
}

// ---- (a) ----

static void test_same_tokens(void) {
    const int32_t seqs[2] = {3, N_REQ};
    for (int round = 0; round < 2; round++) {
        di_engine *e = engine((size_t)64 << 20, seqs[round]);
        if (!e) return;
        static result got[N_REQ];
        int n_same = 0;
        for (int pass = 0; pass < 2; pass++) { // again: the same tokens
            run(e, got, 0, N_REQ);
            di_engine_wait_idle(e);
            for (int i = 0; i < N_REQ; i++) {
                n_same += same(&got[i], &g_ref[i]);
                CHECK_EQ(atomic_load(&got[i].finished), 1);
                CHECK_EQ(got[i].finish, DI_FINISH_LENGTH);
                CHECK_EQ(got[i].n_cached, 0);
                CHECK_EQ(got[i].n_preempted, 0);
            }
        }
        di_engine_stats st;
        di_engine_get_stats(e, &st);
        fprintf(stderr,
                "(a) V4.1 engine, max_seqs %d, two passes: %d/%d requests identical to a plain "
                "session; %lld steps, %lld prefill + %lld decode rows, %lld blocks of %lld bytes\n",
                seqs[round], n_same, 2 * N_REQ, (long long)st.n_steps,
                (long long)st.n_prefill_tokens, (long long)st.n_decode_tokens,
                (long long)st.n_blocks_total, (long long)st.block_bytes);
        CHECK_EQ(n_same, 2 * N_REQ);
        // Batching happened: fewer steps than running the requests one after another would take.
        int64_t alone = 0;
        for (int i = 0; i < N_REQ; i++)
            alone += (g_len[i] + ROWS - 1) / ROWS + (MAX_GEN - 2 * (i % 3)) - 1;
        CHECK(st.n_steps < 2 * alone);
        CHECK_EQ(st.n_failed_steps, 0);
        // Steps ran several sequences (fewer steps than decode rows), each in one forward call:
        // a forward per sequence would make more calls than steps.
        CHECK(st.n_steps < st.n_decode_tokens);
        CHECK_EQ(st.n_forward_calls, st.n_steps);
        check_clean(e);
        di_engine_destroy(e);
    }
}

// ---- (b) ----

static void test_cancel(void) {
    di_engine *e = engine((size_t)64 << 20, 2);
    if (!e) return;
    static result got[N_REQ];
    // 0 and 1 run first and are cancelled after 3 and 5 tokens; 2 and 3 take their slots.
    memset(got, 0, sizeof got);
    for (int i = 0; i < 4; i++) {
        uint64_t id;
        di_request_params p = request(i, &got[i]);
        if (i < 2) {
            got[i].cancel_engine = e;
            got[i].cancel_after = 3 + 2 * i;
        }
        CHECK_EQ(di_engine_submit(e, &p, &id), DI_OK);
    }
    di_engine_wait_idle(e);
    for (int i = 0; i < 2; i++) {
        CHECK_EQ(got[i].finish, DI_FINISH_CANCELLED);
        CHECK(got[i].n >= 3 + 2 * i && got[i].n < g_ref[i].n);
        CHECK(!memcmp(got[i].tokens, g_ref[i].tokens, sizeof(int32_t) * (size_t)got[i].n));
    }
    for (int i = 2; i < 4; i++) CHECK(same(&got[i], &g_ref[i]));
    run(e, got, 4, N_REQ); // into the slots the cancelled ones left
    di_engine_wait_idle(e);
    for (int i = 4; i < N_REQ; i++) CHECK(same(&got[i], &g_ref[i]));
    fprintf(stderr, "(b) cancelled after %d and %d tokens; the 4 requests after them identical\n",
            got[0].n, got[1].n);
    check_clean(e);
    di_engine_destroy(e);
}

// ---- (c) ----

static void test_failure(void) {
    di_engine *e = engine((size_t)64 << 20, 2);
    if (!e) return;
    static result got[N_REQ];
    // Two run at a time. Request 0's 150-token prompt takes steps 1-5 (32 rows each), request 1
    // (5 tokens) joins in step 5's leftover rows; the 9th forward, where both decode, fails.
    // 2 and 3 wait meanwhile.
    di_engine_fail_forward(e, 8, 1, DI_ERR_NOMEM);
    run(e, got, 0, 4);
    di_engine_wait_idle(e);
    for (int i = 0; i < 4; i++) CHECK_EQ(atomic_load(&got[i].finished), 1);
    for (int i = 0; i < 2; i++) {
        CHECK_EQ(got[i].finish, DI_FINISH_ERROR);
        CHECK_EQ(got[i].status, DI_ERR_NOMEM);
        CHECK(got[i].n > 0 && got[i].n < g_ref[i].n); // it had begun to decode
        CHECK(!memcmp(got[i].tokens, g_ref[i].tokens, sizeof(int32_t) * (size_t)got[i].n));
    }
    for (int i = 2; i < 4; i++) CHECK(same(&got[i], &g_ref[i]));
    run(e, got, 4, N_REQ); // the failed slots serve new requests from position 0
    di_engine_wait_idle(e);
    for (int i = 4; i < N_REQ; i++) CHECK(same(&got[i], &g_ref[i]));
    di_engine_stats st;
    di_engine_get_stats(e, &st);
    fprintf(stderr,
            "(c) injected failure at forward 9: requests 0 (%d tokens) and 1 (%d tokens) ended "
            "with %s, the 4 others identical; %lld failed steps\n",
            got[0].n, got[1].n, di_status_str(got[0].status), (long long)st.n_failed_steps);
    CHECK_EQ(st.n_failed_steps, 1);
    CHECK_EQ(st.n_failed_in_a_row, 0);
    check_clean(e);
    di_engine_destroy(e);
}

// ---- (d) ----

static void test_sizing(void) {
    // One slot's tail, measured as the engine does: a session bound to pool blocks (no entries of
    // its own), reserved for MAX_CTX positions and ROWS rows on a model with the engine's thread
    // count; and the blocks of one MAX_CTX sequence.
    v41_slot t;
    if (!v41_slot_open(&t, g_dir)) return;
    const int64_t before = di_dsv41_state_bytes(t.s);
    CHECK_EQ(di_dsv41_reserve_ctx(t.s, MAX_CTX, ROWS), DI_OK);
    const int64_t tail = di_dsv41_state_bytes(t.s), ws_bytes = di_dsv4_ws_bytes(&t.ws);
    CHECK(ws_bytes > 0); // the reservation grew the shared workspace, not the session's own
    CHECK_EQ(di_dsv41_capacity(t.s), 0); // no entries in the slot: they are in the pool's blocks
    const int32_t bt = di_kv_block_tokens(t.m);
    const int32_t max_blocks = (MAX_CTX + bt - 1) / bt;
    const int64_t blk = (int64_t)di_kv_v41_block_bytes(t.m);
    const int64_t page = (int64_t)di_dsv41_page_bytes(t.m, bt), one = max_blocks * blk;
    // The dense layout before paging committed every slot's entries for MAX_CTX positions.
    const int64_t dense = tail + max_blocks * page;
    v41_slot_close(&t);
    CHECK(tail > before); // the reservation grew the history
    fprintf(stderr,
            "(d) one V4.1 slot tail (%d positions, %d rows per step): %lld bytes (%.2f MiB); a "
            "block %lld bytes (%d positions); the shared workspace %lld bytes; a dense slot was "
            "%lld bytes\n",
            MAX_CTX, ROWS, (long long)tail, (double)tail / (1 << 20), (long long)blk, (int)bt,
            (long long)ws_bytes, (long long)dense);

    di_engine_options o = options((size_t)(tail + one) - 1, 4);
    di_engine *e = NULL;
    CHECK_EQ(di_engine_create(g_dir, &o, &e), DI_ERR_INVALID);
    CHECK(e == NULL);

    // Exactly one slot's tail and one sequence's blocks: max_seqs 4 -> 1; three requests run one
    // after another, correctly.
    o = options((size_t)(tail + one), 4);
    CHECK_EQ(di_engine_create(g_dir, &o, &e), DI_OK);
    if (e) {
        di_engine_stats st;
        di_engine_get_stats(e, &st);
        CHECK_EQ(st.n_blocks_total, max_blocks);
        CHECK_EQ(st.block_bytes, blk);
        static result got[N_REQ];
        run(e, got, 0, 3);
        di_engine_wait_idle(e);
        for (int i = 0; i < 3; i++) CHECK(same(&got[i], &g_ref[i]));
        di_engine_get_stats(e, &st);
        CHECK_EQ(st.n_running, 0);
        check_clean(e);
        di_engine_destroy(e);
    }
    // The prefix cache's disk tier extends the prefix cache, which is off here: refused.
    char disk[300];
    snprintf(disk, sizeof disk, "%s/kv-disk", g_root);
    o = options((size_t)(tail + one), 4);
    o.kv_disk_dir = disk;
    e = NULL;
    CHECK_EQ(di_engine_create(g_dir, &o, &e), DI_ERR_INVALID);
    CHECK(e == NULL);

    // (e) Memory proportional to use: 4 tails and the blocks of two MAX_CTX sequences hold 4
    // slots (the dense layout: fewer), and requests 0 .. 3 (their prompts and generations need
    // 11 + 2 + 9 + 4 = 26 of the 32 blocks) all run at once, without preemption, exactly.
    const size_t kv4 = (size_t)(4 * tail + 2 * one);
    const int64_t dense_fit = (int64_t)kv4 / dense;
    CHECK(dense_fit < 4);
    o = options(kv4, 4);
    e = NULL;
    CHECK_EQ(di_engine_create(g_dir, &o, &e), DI_OK);
    if (e) {
        di_engine_stats st;
        di_engine_get_stats(e, &st);
        CHECK_EQ(st.n_blocks_total, 2 * max_blocks);
        static result got[N_REQ];
        run(e, got, 0, 4);
        int32_t peak = 0;
        for (;;) { // the most sequences running at once (polled)
            di_engine_get_stats(e, &st);
            if (st.n_running > peak) peak = st.n_running;
            int n_fin = 0;
            for (int i = 0; i < 4; i++) n_fin += atomic_load(&got[i].finished);
            if (n_fin == 4) break;
            sched_yield();
        }
        di_engine_wait_idle(e);
        for (int i = 0; i < 4; i++) CHECK(same(&got[i], &g_ref[i]));
        fprintf(stderr,
                "(e) --kv-memory %zu bytes: 4 slots and %lld blocks (the dense layout: %lld "
                "slots); 4 requests, %d running at once at most, exact\n",
                kv4, (long long)st.n_blocks_total, (long long)dense_fit, (int)peak);
        CHECK_EQ(peak, 4);
        check_clean(e);
        di_engine_destroy(e);
    }

    // (f) Preemption: 6 slots and 20 blocks for requests needing 11 + 1 + 9 + 4 + 11 + 7 = 43:
    // sequences are preempted when blocks run out and recomputed later, with the same tokens; the
    // pool is whole again at the end.
    o = options((size_t)(6 * tail + 20 * blk), 6);
    e = NULL;
    CHECK_EQ(di_engine_create(g_dir, &o, &e), DI_OK);
    if (e) {
        di_engine_stats st;
        di_engine_get_stats(e, &st);
        CHECK_EQ(st.n_blocks_total, 20);
        static result got[N_REQ];
        run(e, got, 0, N_REQ);
        di_engine_wait_idle(e);
        int n_same = 0, n_pre = 0;
        for (int i = 0; i < N_REQ; i++) {
            n_same += same(&got[i], &g_ref[i]);
            n_pre += got[i].n_preempted > 0;
        }
        di_engine_get_stats(e, &st);
        fprintf(stderr,
                "(f) 6 slots, 20 blocks: %d/%d identical; %lld preemptions (%d requests "
                "preempted), %lld prefill rows\n",
                n_same, N_REQ, (long long)st.n_preemptions, n_pre, (long long)st.n_prefill_tokens);
        CHECK_EQ(n_same, N_REQ);
        CHECK(st.n_preemptions > 0 && n_pre > 0);
        CHECK_EQ(st.n_running, 0);
        CHECK_EQ(st.n_blocks_free, st.n_blocks_total);
        CHECK_EQ(st.n_step_allocs, 0);
        di_engine_destroy(e);
    }
}

int main(void) {
    snprintf(g_root, sizeof g_root, "/tmp/di_test_engine_v41_XXXXXX");
    if (!mkdtemp(g_root)) return 1;
    snprintf(g_dir, sizeof g_dir, "%s/v41-tiny", g_root);
    mkdir(g_dir, 0755);
    CHECK_EQ(di_synth_v41_write(g_dir, true, true, 41), DI_OK);
    for (int i = 0; i < N_REQ; i++)
        for (int t = 0; t < g_len[i]; t++) g_prompt[i][t] = (int32_t)((t * 31 + i * 97 + 11) % V);
    reference();
    test_same_tokens();
    test_cancel();
    test_failure();
    test_sizing();
    di_test_remove_dir(g_root);
    return test_finish();
}
