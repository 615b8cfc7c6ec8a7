// The engine on the V4.1 device-resident forward (model/dsv41_dev.h), run on the CPU backend (its
// oracle twin: bit-identical logits to the V4.1 CPU forward, tests/model/test_dev41_forward.c)
// through the test hook of engine/engine_internal.h, against the engine's CPU V4.1 forward on the
// V4.1 tiny model (di_synth_v41_write, official layout with DSpark: W = 16, 6 layers, blocks of 16
// positions, replay bound 6 x 15 = 90). Every output (tokens, logprobs, top logprobs, the logits
// that chose the first token) must be the CPU engine's bit for bit:
//   (a) six concurrent requests (prompts 5..150 tokens, greedy and seeded) with max_seqs 3 (slots
//       reused), 32 rows per step (chunked prefill) and the smallest device KV memory that admits
//       three sequences (preemption, readmission with prefix hits), then with a roomy one, twice
//       each (the second pass hits the prefix cache: n_cached and n_replayed as on the CPU
//       engine); nothing is allocated inside a step; every block comes back; decode steps run
//       from the graphs prepared at create; the same in the official precision recipe;
//   (b) a forward failure injected mid-run ends exactly the requests of that step with
//       DI_FINISH_ERROR / DI_ERR_CUDA; the others, and requests submitted afterwards into the
//       failed slots, give the CPU engine's tokens (engine_dev_common.h, shared with V4);
//   (c) requests sharing a 300-token prefix after a first one: without tail snapshots each hits
//       288 positions and replays the bound (90), as the CPU engine; with them the first
//       request's tail at 288 is restored by every later one (the Engram history rebuilt from the
//       tokens): nothing replayed, the same tokens;
//   (d) the prefix cache's disk tier: a restart (the blocks and the tail snapshot a destroyed
//       engine wrote come back from disk into device blocks: nothing replayed), and eviction
//       inside one engine whose pool holds one max_ctx sequence (evicted blocks downloaded and
//       written back, then read back and uploaded), each against the CPU V4.1 engine doing the
//       same (same hits, same replays, same tokens); a record of one forward's layout is never
//       taken by the other's disk tier;
//   (e) sizing: kv_memory_bytes pays for max_seqs slot tails and then entry blocks
//       (di_dsv41_dev_sizes); one byte less than a max_ctx sequence needs is refused; the device
//       state grows by exactly the blocks more memory buys; 0 on a backend that cannot say its
//       memory: 256 MiB;
//   (f) with spec_tokens > 0 the engine runs DSpark on the device-resident forward (drafts,
//       verifies, rollback on the dev state): against the CPU V4.1 engine with the same options
//       (greedy and seeded requests) the same tokens and logprobs, and on a roomy pool the same
//       verifies, drafts and acceptances, cache hits and replays; the second pass with oracle
//       drafts (2, 1 and 0 accepted: rollbacks of 0, 1, 2 rows) and prefix hits; a tiny pool
//       preempts and readmits; the tokens those of the engine without speculation; nothing
//       allocated in a step;
//   (g) KV transfer between V4.1 device-resident engines (through the block I/O, the tail
//       snapshot along: nothing replayed after the import); a transfer of the CPU V4.1 forward is
//       taken by the device-resident one and the other way round (their blocks are the same
//       packed pages, model/dsv41_dev.h), without the other forward's tail snapshot: the request
//       on the imported blocks reuses them, runs the bounded replay and gives the cold tokens;
//   (h) pipeline stages (model/dsv41_dev.h "Pipeline stages"): (a), (c), (d), (f), (e) and (g)
//   again
//       with the twin attached as 2 stages on two CPU backends at a cut inside kv source 3's range
//       (layers [0, 4) and [4, 6): the second stage keeps a mirror of source 3's entries and index
//       keys, the top-k and the candidate pool cross each call): the CPU engine's tokens, hits
//       and replays (prefix hits on mirrored blocks), tail snapshots, disk blocks and KV transfers
//       (written into the owner and the mirror; not under ASan: STAGES_TRANSFER), a block's
//       memory counting its mirror;
//   (i) the engine's blocks from its stages' memory (di_cpu_backend_set_mem: unequal devices):
//       the weight split's bottleneck stage bounds them, the KV-aware split
//       (di_dsv41_dev_split_mem, chosen at attach) holds more, with the CPU engine's tokens;
//       kv_memory_bytes 0 takes every block the memory holds; a stage without room for one
//       sequence refused.
// --deferred: the disk tier, greedy rows and the stages on CPU backends in deferred mode (backend.h
// di_cpu_backend_set_deferred): the same tokens.
#include "harness.h"

#include <stdatomic.h>
#include <stdlib.h>
#include <sys/stat.h>

#include "backend/backend.h"
#include "engine/engine_internal.h"
#include "kv/kv_manager.h"
#include "model/dsv41.h" // di_dsv41_page_bytes
#include "model/dsv41_dev.h"
#include "model/synth.h"

enum { V = 512, N_REQ = 6, MAX_GEN = 24, MAX_CTX = 256, N_TOP = 3 };

static char g_dir[256];
#include "engine_requests.h" // g_prompt, g_len, result, on_event, request, same

// ---- engines ----

// (h) pipeline stages: g_stages > 1 attaches the twin as that many stages, stage 0 on the test's
// backend, the others on g_stage_b (CPU backends of their own).
static int32_t g_stages = 1;
static di_backend *g_stage_b[DI_DSV41_DEV_MAX_STAGES];
// (h) the split: {0, 4, 6}, a cut inside kv source 3's range (layers 4 and 5 read its entries and
// index keys from a mirror; the top-k and the candidate pool handed over each call).
static const int32_t g_split[3] = {0, 4, 6};

// The twin on g_stages stages at g_split (NULL b: on CPU backends of its own) into *out.
static di_status create_twin(di_model *m, di_backend *b0, di_dsv41_dev **out) {
    if (g_stages == 1) return di_dsv41_dev_create(m, b0, out);
    di_backend *bs[DI_DSV41_DEV_MAX_STAGES] = {b0};
    for (int32_t k = 1; k < g_stages; k++) bs[k] = g_stage_b[k];
    return di_dsv41_dev_create_split(m, bs, g_stages, g_split, out);
}

static di_status attach_cpu_twin(di_model *m, void *user) {
    if (g_stages == 1) return di_dsv41_dev_attach(m, user); // the test's CPU backend, borrowed
    di_dsv41_dev *d = NULL;
    di_status st = create_twin(m, user, &d);
    if (st == DI_OK) {
        CHECK_EQ(di_dsv41_dev_n_stages(d), g_stages);
        m->dev41 = d; // attached as di_dsv41_dev_attach_stages would, at g_split
    }
    return st;
}

static result g_ref[N_REQ], g_ref2[N_REQ]; // the CPU engine's first and second pass

#include "engine_dev_common.h" // options, engine, check_clean, run_alone, run_shared, (b)

// The device memory of one entry block (di_dsv41_dev_block_mem_bytes: the mirrors of the stages
// counted) and of one slot's tail (the engine's blocks of di_kv_block_tokens positions), from a
// V4.1 dev forward on CPU backends (g_stages at g_split); g_io_bytes: a block's I/O bytes.
static size_t g_tail_bytes; // di_dsv41_dev_tail_bytes
static int64_t g_io_bytes;  // di_dsv41_dev_sizes' block_bytes
static int64_t g_ds_slot;   // the DSpark rings of a slot

static void dev_sizes(int64_t *blk, int64_t *slot, int32_t *bt) {
    di_model_options mo = di_model_options_default();
    mo.n_threads = 1;
    di_model *m = NULL;
    di_backend *b = NULL;
    di_dsv41_dev *d = NULL;
    *blk = *slot = 0;
    CHECK(di_model_load(g_dir, &mo, &m) == DI_OK);
    CHECK_EQ(di_cpu_backend_create(1, &b), DI_OK);
    if (m && b) CHECK_EQ(create_twin(m, b, &d), DI_OK);
    if (d) {
        *bt = di_kv_block_tokens(m);
        CHECK_EQ(di_dsv41_dev_block_tokens(d), *bt);
        CHECK_EQ(di_dsv41_dev_sizes(d, *bt, &g_io_bytes, slot), DI_OK);
        CHECK_EQ(di_dsv41_dev_block_mem_bytes(d, *bt, blk, NULL), DI_OK);
        // The I/O: the CPU forward's page; the memory: its codes without the page's padding
        // (1,680 of its 1,792 bytes on the tiny model), more with a mirror (g_split has one).
        CHECK_EQ(g_io_bytes, (int64_t)di_dsv41_page_bytes(m, *bt));
        CHECK(g_stages > 1 ? *blk > 1680 : *blk == 1680);
        g_tail_bytes = di_dsv41_dev_tail_bytes(d);
        // (f) a DSpark slot's rings besides (di_dsv41_dev_dspark_enable; engine.c dev_sizes)
        // (16 + DI_DSV41_ROLLBACK_MAX Q8 rows of 66 bytes per DSpark block)
        g_ds_slot = (int64_t)m->n_mtp_loaded * (m->hp.window + DI_DSV41_ROLLBACK_MAX) *
                    di_backend_code_row_bytes(8, m->hp.head_dim, DI_BACKEND_WIN_BLOCK);
        CHECK_EQ(m->hp.window, 16);
        CHECK_EQ(g_ds_slot, (int64_t)m->n_mtp_loaded * 32 * 66);
        // Every layer's 32 Q8 ring rows and source 1's C and Z rings of 18 FP32 rows.
        CHECK_EQ(*slot, 6 * 32 * 66 + 2 * 18 * 64 * 4);
    }
    di_dsv41_dev_destroy(d);
    di_backend_destroy(b);
    di_model_destroy(m);
}

// ---- (a) ----

static void test_same_tokens(void) {
    // Reference: the CPU V4.1 engine with room for everything, the prefix cache on.
    di_engine *e = engine((size_t)64 << 20, N_REQ, NULL);
    if (!e) return;
    run(e, g_ref, 0, N_REQ);
    di_engine_wait_idle(e);
    run(e, g_ref2, 0, N_REQ); // again: hits its own cached prompt blocks
    di_engine_wait_idle(e);
    int n_hits = 0;
    for (int i = 0; i < N_REQ; i++) {
        CHECK(same(&g_ref2[i], &g_ref[i]));
        n_hits += g_ref2[i].n_cached > 0;
    }
    CHECK(n_hits >= 5); // every prompt longer than a block
    check_clean(e, false);
    di_engine_destroy(e);

    int64_t blk = 0, slot = 0;
    int32_t bt = 1;
    dev_sizes(&blk, &slot, &bt);
    const size_t tiny = (size_t)(3 * slot + ((MAX_CTX + bt - 1) / bt) * blk);
    di_backend *b = NULL;
    CHECK_EQ(di_cpu_backend_create(2, &b), DI_OK);
    if (!b || blk <= 0) return;
    for (int round = 0; round < 2; round++) { // a tiny KV pool, then a roomy one
        e = engine(round == 0 ? tiny : (size_t)64 << 20, round == 0 ? 3 : N_REQ, b);
        if (!e) break;
        static result got[N_REQ];
        int n_same = 0, preempted = 0;
        for (int pass = 0; pass < 2; pass++) { // again: the prefix cache hits
            run(e, got, 0, N_REQ);
            di_engine_wait_idle(e);
            for (int i = 0; i < N_REQ; i++) {
                n_same += same(&got[i], &g_ref[i]);
                CHECK_EQ(atomic_load(&got[i].finished), 1);
                CHECK_EQ(got[i].finish, DI_FINISH_LENGTH);
                if (round == 1) { // room for every block: the CPU engine's hits exactly
                    const result *want = pass == 0 ? &g_ref[i] : &g_ref2[i];
                    CHECK_EQ(got[i].n_cached, want->n_cached);
                    CHECK_EQ(got[i].n_replayed, want->n_replayed);
                }
                preempted += got[i].n_preempted;
            }
        }
        di_engine_stats st;
        di_engine_get_stats(e, &st);
        di_dsv4_dev_graph_stats gs;
        di_engine_get_graph_stats(e, &gs);
        fprintf(stderr,
                "(a) V4.1 dev engine, %s pool (%lld blocks of %lld bytes, %lld bytes of device "
                "state), max_seqs %d, two passes: %d/%d requests identical to the CPU engine, "
                "%lld steps, %lld preemptions (%d counted by the requests), %lld positions from "
                "the prefix cache, %lld replayed; graphs %lld captured, %lld replayed\n",
                round == 0 ? "tiny" : "roomy", (long long)st.n_blocks_total,
                (long long)st.block_bytes, (long long)di_engine_dev_state_bytes(e),
                round == 0 ? 3 : N_REQ, n_same, 2 * N_REQ, (long long)st.n_steps,
                (long long)st.n_preemptions, preempted, (long long)st.n_cache_hit_tokens,
                (long long)st.n_replayed_tokens, (long long)gs.n_captured,
                (long long)gs.n_replayed);
        CHECK_EQ(st.block_bytes, g_io_bytes);
        if (round == 1) CHECK(st.n_cache_hit_tokens > 0);
        CHECK_EQ(n_same, 2 * N_REQ);
        if (round == 0) CHECK(st.n_preemptions > 0);
        CHECK_EQ(st.n_failed_steps, 0);
        check_clean(e, true);
        di_engine_destroy(e);
    }
    di_backend_destroy(b); // after the engine's model, which borrows it
}

// (a) again in the official precision recipe (R-OFF), roomy pool, two passes.
static void test_official(void) {
    di_backend *b = NULL;
    CHECK_EQ(di_cpu_backend_create(2, &b), DI_OK);
    if (!b) return;
    di_engine_options o = options((size_t)64 << 20, 3);
    o.precision = DI_PRECISION_OFFICIAL;
    static result ref[2][N_REQ], got[N_REQ];
    di_engine *e = engine_o(&o, NULL);
    for (int pass = 0; e && pass < 2; pass++) {
        run(e, ref[pass], 0, N_REQ);
        di_engine_wait_idle(e);
    }
    di_engine_destroy(e);
    e = engine_o(&o, b);
    int n_same = 0, n_hits = 0;
    for (int pass = 0; e && pass < 2; pass++) {
        run(e, got, 0, N_REQ);
        di_engine_wait_idle(e);
        for (int i = 0; i < N_REQ; i++) {
            n_same += same(&got[i], &ref[pass][i]);
            CHECK_EQ(got[i].n_cached, ref[pass][i].n_cached);
            CHECK_EQ(got[i].n_replayed, ref[pass][i].n_replayed);
            n_hits += got[i].n_cached > 0;
        }
    }
    fprintf(stderr,
            "(a) official recipe: %d/%d requests identical to the CPU V4.1 engine, %d prefix "
            "hits\n",
            n_same, 2 * N_REQ, n_hits);
    CHECK_EQ(n_same, 2 * N_REQ);
    CHECK(n_hits >= 5);
    if (e) check_clean(e, true);
    di_engine_destroy(e);
    di_backend_destroy(b);
}

// ---- (c) ----

enum { D_CTX = 352, D_HIT = 288 };

static void test_shared_prefix(void) {
    fill_dprompt();
    static result ref[D_REQ], ref_t[D_REQ], got[D_REQ];
    int64_t blk = 0, slot = 0;
    int32_t bt = 1;
    dev_sizes(&blk, &slot, &bt); // g_tail_bytes
    di_backend *b = NULL;
    CHECK_EQ(di_cpu_backend_create(2, &b), DI_OK);
    if (!b) return;
    for (int tails = 0; tails < 2; tails++) {
        di_engine_options o = options((size_t)64 << 20, 3);
        o.max_ctx = D_CTX;
        o.no_tail_cache = !tails;
        result *want = tails ? ref_t : ref;
        di_engine *e = engine_o(&o, NULL);
        if (!e) break;
        run_shared(e, want);
        di_engine_stats cst;
        di_engine_get_stats(e, &cst);
        check_clean(e, false);
        di_engine_destroy(e);
        e = engine_o(&o, b);
        if (!e) break;
        run_shared(e, got);
        int n_same = 0;
        for (int i = 0; i < D_REQ; i++) {
            n_same += same(&got[i], &ref[i]); // with or without snapshots: the same tokens
            CHECK(same(&want[i], &ref[i]));
            CHECK_EQ(got[i].n_cached, want[i].n_cached);
            CHECK_EQ(got[i].n_replayed, want[i].n_replayed);
            CHECK_EQ(got[i].n_cached, i == 0 ? 0 : D_HIT);             // 18 blocks of 16
            CHECK_EQ(got[i].n_replayed, i == 0 || tails ? 0 : 6 * 15); // the bound, or none
        }
        di_engine_stats st;
        di_engine_get_stats(e, &st);
        fprintf(stderr,
                "(c) %d requests sharing a %d-token prefix, tail snapshots %s (%lld bytes): %d "
                "identical to the CPU engine; request 1 reused %d positions and replayed %d; "
                "%lld snapshots taken, %lld restored\n",
                D_REQ, D_PREFIX, tails ? "on" : "off", (long long)st.tail_snap_bytes, n_same,
                got[1].n_cached, got[1].n_replayed, (long long)st.n_tail_taken,
                (long long)st.n_tail_restored);
        CHECK_EQ(n_same, D_REQ);
        CHECK_EQ(st.n_replayed_tokens, cst.n_replayed_tokens);
        CHECK_EQ(st.n_cache_hit_tokens, cst.n_cache_hit_tokens);
        if (tails) { // at 288 (request 0's), and at 304 (requests 2 and 3, each its own block)
            CHECK_EQ(st.n_tail_taken, cst.n_tail_taken);
            CHECK_EQ(st.n_tail_taken, 3);
            CHECK_EQ(st.n_tail_restored, D_REQ - 1);
            CHECK_EQ(cst.n_tail_restored, D_REQ - 1);
            CHECK_EQ(st.n_replayed_tokens, 0);
            CHECK_EQ((size_t)st.tail_snap_bytes, g_tail_bytes);
        }
        check_clean(e, true);
        di_engine_destroy(e);
    }
    di_backend_destroy(b);
}

// ---- (d) ----

enum { K_CTX = 320, K_P1 = 200, K_P2 = 280, K_Y = 290 };
static int32_t g_kp[K_P2], g_ky[K_Y]; // the prompt and its extension; an unrelated prompt

static di_engine *disk_engine(size_t kv_bytes, const char *disk, bool prefix, di_backend *b) {
    di_engine_options o = options(kv_bytes, 3);
    o.max_ctx = K_CTX;
    o.kv_disk_dir = disk;
    o.no_prefix_cache = !prefix;
    o.no_tail_cache = !prefix; // snapshots travel with their blocks' records
    return engine_o(&o, b);
}

// Runs prompt[0, n) alone to completion (request 0's parameters: greedy, first logits).
static void disk_run(di_engine *e, const int32_t *prompt, int32_t n, result *r) {
    run_alone(e, 0, prompt, n, r);
    CHECK_EQ(r->n, MAX_GEN);
}

// The disk-tier scenario on either forward (b NULL: the CPU V4.1 engine) in directories under
// tag: out[0] the restart's rerun, out[1] the eviction's rerun; st_out their engines' stats.
static void disk_scenario(di_backend *b, const char *tag, size_t small, result *out,
                          di_engine_stats *st_out) {
    char disk[320], evict[340];
    snprintf(disk, sizeof disk, "%s/kvdisk-%s", g_dir, tag);
    snprintf(evict, sizeof evict, "%s/kvdisk-evict-%s", g_dir, tag);
    static result r;
    // Restart: the first life runs the prompt alone; destroy writes its cached blocks.
    di_engine *e = disk_engine((size_t)64 << 20, disk, true, b);
    if (!e) return;
    disk_run(e, g_kp, K_P1, &r);
    di_engine_destroy(e);
    e = disk_engine((size_t)64 << 20, disk, true, b);
    if (!e) return;
    disk_run(e, g_kp, K_P2, &out[0]);
    di_engine_get_stats(e, &st_out[0]);
    check_clean(e, b != NULL);
    di_engine_destroy(e);
    // Eviction inside one engine: the unrelated prompt takes every block of the pool.
    e = disk_engine(small, evict, true, b);
    if (!e) return;
    disk_run(e, g_kp, K_P1, &r);
    disk_run(e, g_ky, K_Y, &r);
    disk_run(e, g_kp, K_P2, &out[1]);
    di_engine_get_stats(e, &st_out[1]);
    check_clean(e, b != NULL);
    di_engine_destroy(e);
}

static void test_disk(void) {
    for (int t = 0; t < K_P2; t++) g_kp[t] = (int32_t)((t * 29 + 11) % V);
    for (int t = 0; t < K_Y; t++) g_ky[t] = (int32_t)((t * 43 + 5) % V);
    di_backend *b = NULL;
    CHECK_EQ(di_cpu_backend_create(2, &b), DI_OK);
    if (!b) return;
    int64_t blk = 0, slot = 0;
    int32_t bt = 1;
    dev_sizes(&blk, &slot, &bt);
    static result ref, cpu[2], dev[2];
    di_engine_stats cst[2], dst[2];
    memset(cst, 0, sizeof cst);
    memset(dst, 0, sizeof dst);
    // The reference: the CPU V4.1 engine without any cache.
    di_engine *e = disk_engine((size_t)64 << 20, NULL, false, NULL);
    if (!e) goto done;
    disk_run(e, g_kp, K_P2, &ref);
    di_engine_destroy(e);
    // The CPU V4.1 engine on a roomy pool (its eviction run reruns from memory).
    disk_scenario(NULL, "cpu", (size_t)64 << 20, cpu, cst);
    disk_scenario(b, "dev", (size_t)(3 * slot + (K_CTX / bt) * blk), dev, dst);
    for (int k = 0; k < 2; k++) {
        fprintf(stderr,
                "(d) %s: V4.1 dev engine reused %d positions (%lld from disk, %lld blocks "
                "uploaded, %lld downloaded, %lld written), replayed %d; CPU engine %d, %d; "
                "identical: %d\n",
                k ? "eviction" : "restart", dev[k].n_cached, (long long)dst[k].n_disk_hit_tokens,
                (long long)dst[k].n_disk_dev_uploads, (long long)dst[k].n_disk_dev_downloads,
                (long long)dst[k].n_disk_blocks_written, dev[k].n_replayed, cpu[k].n_cached,
                cpu[k].n_replayed, (int)same(&dev[k], &ref));
        CHECK(same(&dev[k], &ref));
        CHECK(same(&cpu[k], &ref));
        CHECK(dev[k].n_cached > 0);
        CHECK(dst[k].n_disk_hit_tokens > 0);
        CHECK(dst[k].n_disk_dev_uploads > 0); // the read blocks went into device blocks
        CHECK_EQ(dst[k].n_disk_dev_lost, 0);
        CHECK_EQ(dst[k].n_disk_dropped, 0);
        CHECK_EQ(dst[k].n_failed_steps, 0);
    }
    CHECK_EQ(dev[0].n_cached, cpu[0].n_cached);
    CHECK_EQ(dev[0].n_replayed, 0); // the snapshot came back with its block's record
    CHECK_EQ(cpu[0].n_replayed, 0);
    CHECK_EQ(dst[0].n_disk_snaps_read, 1);
    CHECK(dst[1].n_disk_dev_downloads > 0); // evicted device blocks written back
    CHECK(dst[1].n_disk_blocks_written > 0);
    // A read reserves at most half of the pool's available blocks: 10 of the 12 come back, the
    // snapshot at 192 is out of reach, and the hit replays the bound (hits <= 90: from 0).
    CHECK_EQ(dev[1].n_replayed, dev[1].n_cached < 90 ? dev[1].n_cached : 90);
    // The other forward's records on a directory: never taken (another layout).
    {
        char disk[320];
        snprintf(disk, sizeof disk, "%s/kvdisk-cpu", g_dir);
        static result r;
        e = disk_engine((size_t)64 << 20, disk, true, b);
        if (e) {
            disk_run(e, g_kp, K_P2, &r);
            CHECK(same(&r, &ref));
            CHECK_EQ(r.n_cached, 0);
            di_engine_destroy(e);
        }
    }
done:
    di_backend_destroy(b);
}

// ---- (e) ----

static void test_sizing(void) {
    int64_t blk = 0, slot = 0;
    int32_t bt = 1;
    dev_sizes(&blk, &slot, &bt);
    if (blk <= 0) return;
    const int32_t max_seqs = 3, one = (MAX_CTX + bt - 1) / bt;
    const size_t least = (size_t)(max_seqs * slot + one * blk);
    di_backend *b = NULL;
    CHECK_EQ(di_cpu_backend_create(2, &b), DI_OK);
    if (!b) return;
    di_engine_options o = options(least - 1, max_seqs);
    di_engine *e = NULL;
    CHECK_EQ(di_engine_create_prepared(g_dir, &o, attach_cpu_twin, b, &e), DI_ERR_INVALID);
    CHECK(e == NULL);
    int64_t bytes[2] = {0, 0}, n_blocks[2] = {0, 0};
    for (int k = 0; k < 2; k++) { // the least memory, then 10 blocks more
        o = options(least + (size_t)(k * 10 * blk), max_seqs);
        e = NULL;
        CHECK_EQ(di_engine_create_prepared(g_dir, &o, attach_cpu_twin, b, &e), DI_OK);
        if (!e) break;
        di_engine_stats st;
        di_engine_get_stats(e, &st);
        bytes[k] = di_engine_dev_state_bytes(e);
        n_blocks[k] = st.n_blocks_total;
        CHECK_EQ(st.block_bytes, g_io_bytes); // what a block's I/O moves
        CHECK_EQ(st.block_tokens, bt);
        CHECK(st.device.resident);
        di_engine_destroy(e);
    }
    fprintf(stderr,
            "(e) entry block %lld bytes of memory (%lld of I/O), slot tail %lld bytes: %lld bytes "
            "of kv memory -> %lld blocks, %lld bytes of device state; 10 blocks more -> %lld "
            "blocks, %lld bytes\n",
            (long long)blk, (long long)g_io_bytes, (long long)slot, (long long)least,
            (long long)n_blocks[0], (long long)bytes[0], (long long)n_blocks[1],
            (long long)bytes[1]);
    CHECK_EQ(n_blocks[0], one);
    CHECK(n_blocks[0] < (int64_t)max_seqs * one);
    CHECK_EQ(n_blocks[1], one + 10);
    CHECK_EQ(bytes[1] - bytes[0], 10 * blk); // the state follows kv_memory, block by block
    // kv_memory_bytes 0 where the backend cannot say its memory (the CPU backend's default):
    // 256 MiB. (Where it can: test_mem_stages.)
    o = options(0, max_seqs);
    e = NULL;
    CHECK_EQ(di_engine_create_prepared(g_dir, &o, attach_cpu_twin, b, &e), DI_OK);
    if (e) {
        di_engine_stats st;
        di_engine_get_stats(e, &st);
        CHECK_EQ(st.kv_memory_bytes, (int64_t)256 << 20);
        CHECK_EQ(st.n_blocks_total, (((int64_t)256 << 20) - max_seqs * slot) / blk);
        di_engine_destroy(e);
    }
    di_backend_destroy(b);
}

// ---- (f) ----

// (f) DSpark speculation on the device-resident forward (di_dsv41_dev_dspark_enable, drafts by
// di_dsv41_dev_draft, rollback by di_dsv41_dev_rollback) against the CPU V4.1 engine with the
// same spec_tokens: the same tokens, logprobs and acceptance counts, with a tiny pool
// (preemption, readmission on prefix hits) and a roomy one, two passes (the prefix cache hits).
static void spec_compare(const char *tag, const di_engine_stats *ref, const result *want,
                         di_engine *e, const result *got) {
    di_engine_stats st;
    di_engine_get_stats(e, &st);
    int n_same = 0;
    for (int i = 0; i < N_REQ; i++) n_same += same(&got[i], &want[i]);
    fprintf(stderr,
            "(f) %s: resident %d, %lld verifies (CPU %lld), %lld drafted, %lld accepted (CPU "
            "%lld), %lld preemptions, %d/%d identical\n",
            tag, (int)st.device.resident, (long long)st.n_spec_verifies,
            (long long)ref->n_spec_verifies, (long long)st.n_spec_drafted,
            (long long)st.n_spec_accepted, (long long)ref->n_spec_accepted,
            (long long)st.n_preemptions, n_same, N_REQ);
    CHECK_EQ(n_same, N_REQ);
    CHECK(st.device.resident);
    CHECK_EQ(st.n_failed_steps, 0);
    CHECK_EQ(st.n_step_allocs, 0);
    CHECK_EQ(st.n_blocks_free, st.n_blocks_total);
    CHECK(st.n_spec_verifies > 0);
    // Graphs: decode and verify steps prepared at create, none captured in a step.
    di_dsv4_dev_graph_stats gs;
    di_engine_get_graph_stats(e, &gs);
    fprintf(stderr, "    graphs: %lld cached, %lld captured, %lld replayed, %lld direct\n",
            (long long)gs.n_cached, (long long)gs.n_captured, (long long)gs.n_replayed,
            (long long)gs.n_direct);
    CHECK_EQ(gs.n_captured, gs.n_cached);
    CHECK(gs.n_replayed > 0);
}

// Oracle drafts from the engine's output without speculation (g_ref; speculation never changes
// it): by the output token's position all right, the first right and the second wrong, or all
// wrong, so verifies accept 2, 1 and 0 drafts (rollback of 0, 1 and 2 rows).
static void oracle_hook(void *user, uint64_t id, int32_t n_gen, di_draft *d) {
    (void)user;
    const result *t = &g_ref[(id - 1) % N_REQ];
    for (int32_t j = 0; j < d->n; j++) {
        const int32_t g = n_gen + j, tok = g < t->n ? t->tokens[g] : 0;
        const int kind = n_gen % 3;
        d->tokens[j] = kind == 0 || (kind == 1 && j == 0) ? tok : (tok + 1) % V;
    }
}

// Under ASan the roomy round only (a memory check of the same paths).
#if defined(__SANITIZE_ADDRESS__)
enum { SPEC_ROUND0 = 1 };
#else
enum { SPEC_ROUND0 = 0 };
#endif

static void test_spec(void) {
    di_backend *b = NULL;
    CHECK_EQ(di_cpu_backend_create(2, &b), DI_OK);
    if (!b) return;
    int64_t blk = 0, slot = 0;
    int32_t bt = 1;
    dev_sizes(&blk, &slot, &bt);
    slot += g_ds_slot;
    const size_t tiny = (size_t)(3 * slot + ((MAX_CTX + bt - 1) / bt) * blk);
    for (int round = SPEC_ROUND0; round < 2; round++) {
        const int32_t ms = round == 0 ? 3 : N_REQ;
        di_engine_options o = options((size_t)64 << 20, ms);
        o.spec_tokens = 2;
        o.no_tail_cache = round == 0;        // roomy: tail snapshots (DSpark rings included) on
        di_engine *cpu = engine_o(&o, NULL); // the CPU V4.1 engine with DSpark
        if (round == 0) o.kv_memory_bytes = tiny;
        di_engine *dev = engine_o(&o, b);
        if (!cpu || !dev) {
            di_engine_destroy(cpu);
            di_engine_destroy(dev);
            break;
        }
        for (int pass = 0; pass < 2; pass++) {
            static result want[N_REQ], got[N_REQ];
            // Pass 1: the oracle's drafts (accepted ones, rollbacks of 0 .. 2 rows).
            di_engine_set_draft_hook(cpu, pass == 1 ? oracle_hook : NULL, NULL);
            di_engine_set_draft_hook(dev, pass == 1 ? oracle_hook : NULL, NULL);
            run(cpu, want, 0, N_REQ);
            di_engine_wait_idle(cpu);
            run(dev, got, 0, N_REQ);
            di_engine_wait_idle(dev);
            di_engine_stats ref;
            di_engine_get_stats(cpu, &ref);
            char tag[64];
            snprintf(tag, sizeof tag, "%s pool, pass %d", round == 0 ? "tiny" : "roomy", pass);
            spec_compare(tag, &ref, want, dev, got);
            for (int i = 0; i < N_REQ; i++) CHECK(same(&got[i], &g_ref[i])); // spec off's
            if (round == 1) {
                di_engine_stats st;
                di_engine_get_stats(dev, &st);
                CHECK_EQ(st.n_spec_verifies, ref.n_spec_verifies);
                CHECK_EQ(st.n_spec_drafted, ref.n_spec_drafted);
                CHECK_EQ(st.n_spec_accepted, ref.n_spec_accepted);
                CHECK_EQ(st.n_tail_restored, ref.n_tail_restored);
                if (pass == 1) CHECK(st.n_tail_restored > 0); // the DSpark rings come back too
                for (int i = 0; i < N_REQ; i++) {
                    CHECK_EQ(got[i].n_cached, want[i].n_cached);
                    CHECK_EQ(got[i].n_replayed, want[i].n_replayed);
                }
            } else {
                di_engine_stats st;
                di_engine_get_stats(dev, &st);
                CHECK(pass == 0 || st.n_preemptions > 0);
            }
            if (pass == 1) CHECK(ref.n_spec_accepted > 0);
        }
        di_engine_destroy(cpu);
        di_engine_destroy(dev);
    }
    di_backend_destroy(b);
}

// ---- (l) ----

// Greedy rows on the device (engine_dev_common.h greedy_rows_case): the plain engine with room
// for every request, with a tiny pool and 3 slots (preemption), and with DSpark (2 drafts: verify
// rows picked or downloaded row by row, the drafts always picks). Under AddressSanitizer the
// DSpark engine only (its verify rows and drafts take every path).
static void test_greedy_rows(void) {
    di_backend *b = NULL;
    CHECK_EQ(di_cpu_backend_create(2, &b), DI_OK);
    if (!b) return;
    if (g_stages == 1) greedy_refs(); // the stages' run reuses them
    di_engine_options o = options((size_t)64 << 20, N_REQ);
#if !defined(__SANITIZE_ADDRESS__)
    greedy_rows_case("plain, roomy", &o, b);
    if (g_stages == 1) { // on stages the roomy engines (the pool's accounting is (a)'s)
        int64_t blk = 0, slot = 0;
        int32_t bt = 1;
        dev_sizes(&blk, &slot, &bt);
        o = options((size_t)(3 * slot + ((MAX_CTX + bt - 1) / bt) * blk), 3);
        greedy_rows_case("plain, tiny pool", &o, b);
    }
#endif
    o = options((size_t)64 << 20, N_REQ);
    o.spec_tokens = 2;
    greedy_rows_case("DSpark, roomy", &o, b);
    di_backend_destroy(b);
}

// ---- (g) ----

// Runs g_dprompt[i] (D_PREFIX + 3 + i tokens) alone to completion.
static void xfer_run(di_engine *e, int i, result *r) {
    run_alone(e, i, g_dprompt[i], D_PREFIX + 3 + i, r);
}

static di_engine *xfer_engine(di_backend *b) {
    di_engine_options o = options((size_t)64 << 20, 3);
    o.max_ctx = D_CTX;
    o.no_tail_cache = false;
    return engine_o(&o, b);
}

static void test_transfer(void) {
    di_backend *b = NULL;
    CHECK_EQ(di_cpu_backend_create(2, &b), DI_OK);
    if (!b) return;
    static result cold, r;
    void *x_dev = NULL, *x_cpu = NULL;
    size_t n_dev = 0, n_cpu = 0;
    int32_t nb = 0, n_ins = 0, n_pres = 0;
    char err[512];
    // Cold: request 1 alone on a fresh device-resident engine.
    di_engine *e = xfer_engine(b);
    if (!e) goto done;
    xfer_run(e, 1, &cold);
    di_engine_destroy(e);
    // A exports request 0's prompt blocks (read from its device state) and its snapshot.
    e = xfer_engine(b);
    if (!e) goto done;
    xfer_run(e, 0, &r);
    CHECK_EQ(
        di_engine_kv_export(e, g_dprompt[0], D_PREFIX, 0, &x_dev, &n_dev, &nb, err, sizeof err),
        DI_OK);
    CHECK_EQ(nb, D_HIT / 16);
    di_engine_destroy(e);
    // B imports them (written into its device state) and runs request 1 on them.
    e = xfer_engine(b);
    if (e && x_dev) {
        CHECK_EQ(di_engine_kv_import(e, x_dev, n_dev, &n_ins, &n_pres, err, sizeof err), DI_OK);
        CHECK_EQ(n_ins, nb);
        CHECK_EQ(di_engine_kv_import(e, x_dev, n_dev, &n_ins, &n_pres, err, sizeof err), DI_OK);
        CHECK_EQ(n_ins, 0);
        CHECK_EQ(n_pres, nb);
        xfer_run(e, 1, &r);
        fprintf(stderr,
                "(g) KV transfer between V4.1 dev engines: %d blocks (%zu bytes), request 1 "
                "reused %d positions, replayed %d, identical to a cold engine: %d\n",
                (int)nb, n_dev, r.n_cached, r.n_replayed, (int)same(&r, &cold));
        CHECK(same(&r, &cold));
        CHECK_EQ(r.n_cached, D_HIT);
        CHECK_EQ(r.n_replayed, 0); // the snapshot came along
        check_clean(e, true);
    }
    di_engine_destroy(e);
    // The CPU V4.1 forward's transfer and the device-resident one's: each taken by the other (the
    // same packed pages), its tail snapshot left out (the other forward's format).
    e = xfer_engine(NULL);
    if (!e) goto done;
    xfer_run(e, 0, &r);
    CHECK_EQ(
        di_engine_kv_export(e, g_dprompt[0], D_PREFIX, 0, &x_cpu, &n_cpu, &nb, err, sizeof err),
        DI_OK);
    di_engine_destroy(e);
    e = xfer_engine(NULL);
    if (e && x_dev) {
        err[0] = 0;
        CHECK_EQ(di_engine_kv_import(e, x_dev, n_dev, &n_ins, &n_pres, err, sizeof err), DI_OK);
        CHECK_EQ(n_ins, nb);
        xfer_run(e, 1, &r);
        fprintf(stderr,
                "(g) the CPU V4.1 engine takes the dev transfer: request 1 reused %d positions, "
                "replayed %d, identical to a cold engine: %d\n",
                r.n_cached, r.n_replayed, (int)same(&r, &cold));
        CHECK(same(&r, &cold));
        CHECK_EQ(r.n_cached, D_HIT);
        CHECK(r.n_replayed > 0); // no snapshot: the bounded replay
    }
    di_engine_destroy(e);
    e = xfer_engine(b);
    if (e && x_cpu) {
        err[0] = 0;
        CHECK_EQ(di_engine_kv_import(e, x_cpu, n_cpu, &n_ins, &n_pres, err, sizeof err), DI_OK);
        CHECK_EQ(n_ins, nb);
        xfer_run(e, 1, &r);
        fprintf(stderr,
                "(g) the V4.1 dev engine takes the CPU transfer: request 1 reused %d positions, "
                "replayed %d, identical to a cold engine: %d\n",
                r.n_cached, r.n_replayed, (int)same(&r, &cold));
        CHECK(same(&r, &cold));
        CHECK_EQ(r.n_cached, D_HIT);
        CHECK(r.n_replayed > 0);
        check_clean(e, true);
    }
    di_engine_destroy(e);
done:
    di_free_buffer(x_dev);
    di_free_buffer(x_cpu);
    di_backend_destroy(b);
}

// ---- (i) ----

// (i) the engine's blocks from its stages' memory: two CPU backends reporting unequal memory
// (di_cpu_backend_set_mem); stage 1 has room for 3 blocks more than one max_ctx sequence on the
// weight split (di_dsv41_dev_split). Attached at that split the engine gets exactly those blocks
// (the memory bounds kv_memory_bytes' count); attached by di_dsv41_dev_create_stages the
// KV-aware split (another cut) gets its own larger count, di_dsv41_dev_split_mem's, and the CPU
// engine's tokens. Too little memory on a stage: refused. The hook does not shrink with the
// uploads, so the attach lowers it by each stage's weights, as a device's free memory would.
enum { RESERVE = 4096 };
typedef struct mem_twin {
    di_backend *b[2];
    int64_t budget[2];
    const int32_t *split; // NULL: the KV-aware split from the memory
    int32_t cut;          // the attached split's cut
} mem_twin;

static di_status attach_mem_twin(di_model *m, void *user) {
    mem_twin *t = user;
    for (int k = 0; k < 2; k++)
        di_cpu_backend_set_mem(t->b[k], (size_t)t->budget[k] + RESERVE,
                               2 * (size_t)t->budget[k] + RESERVE);
    di_dsv41_dev *d = NULL;
    di_status st = t->split ? di_dsv41_dev_create_split(m, t->b, 2, t->split, &d)
                            : di_dsv41_dev_create_stages(m, t->b, 2, &d);
    if (st != DI_OK) return st;
    m->dev41 = d;
    for (int32_t k = 0; k < 2; k++) {
        int32_t l0 = 0, l1 = 0;
        di_dsv41_dev_stage(d, k, &l0, &l1);
        di_dev_stage_cost c;
        di_dsv41_dev_stage_cost(m, l0, l1, &c);
        di_cpu_backend_set_mem(t->b[k], (size_t)(t->budget[k] - c.weight_bytes) + RESERVE,
                               2 * (size_t)t->budget[k] + RESERVE);
        if (k == 0) t->cut = l1;
    }
    return DI_OK;
}

static void test_mem_stages(void) {
    di_engine_options o = options((size_t)64 << 20, N_REQ);
    o.dev_reserve_bytes = RESERVE;
    // The plan the engine hands its model (engine.c create): the same costs as the test's.
    di_model_options mo = di_model_options_default();
    mo.n_threads = 1;
    mo.dev_slots = o.max_seqs, mo.dev_ctx = o.max_ctx, mo.dev_rows = o.max_batch_tokens;
    mo.dev_reserve_bytes = RESERVE;
    di_model *m = NULL;
    CHECK_EQ(di_model_load(g_dir, &mo, &m), DI_OK);
    if (!m) return;
    const int32_t L = m->hp.n_layer, bt = di_kv_block_tokens(m), one = (MAX_CTX + bt - 1) / bt;
    int32_t wl0[3];
    CHECK_EQ(di_dsv41_dev_split(m, 2, wl0, NULL), DI_OK);
    di_dev_stage_cost w0, w1;
    di_dsv41_dev_stage_cost(m, 0, wl0[1], &w0);
    di_dsv41_dev_stage_cost(m, wl0[1], L, &w1);
    mem_twin t = {.budget = {4 * (w0.weight_bytes + w0.fixed_bytes + w1.weight_bytes +
                                  w1.fixed_bytes + 64 * one * (w0.block_bytes + w1.block_bytes)),
                             w1.weight_bytes + w1.fixed_bytes + (one + 3) * w1.block_bytes}};
    di_dev_split_out sp;
    CHECK_EQ(di_dsv41_dev_split_mem(m, 2, t.budget, &sp), DI_OK);
    di_model_destroy(m);
    CHECK(sp.layer0[1] != wl0[1]);
    CHECK(sp.n_blocks > one + 3);
    CHECK_EQ(di_cpu_backend_create(2, &t.b[0]), DI_OK);
    CHECK_EQ(di_cpu_backend_create(2, &t.b[1]), DI_OK);
    int64_t n_blocks[2] = {0, 0};
    for (int pass = 0; pass < 2 && t.b[0] && t.b[1]; pass++) { // the weight split, then the KV's
        t.split = pass == 0 ? wl0 : NULL;
        di_engine *e = NULL;
        CHECK_EQ(di_engine_create_prepared(g_dir, &o, attach_mem_twin, &t, &e), DI_OK);
        if (!e) break;
        CHECK_EQ(t.cut, pass == 0 ? wl0[1] : sp.layer0[1]);
        di_engine_stats st;
        di_engine_get_stats(e, &st);
        n_blocks[pass] = st.n_blocks_total;
        if (pass == 1) {
            static result got[N_REQ];
            run(e, got, 0, N_REQ);
            di_engine_wait_idle(e);
            for (int i = 0; i < N_REQ; i++) CHECK(same(&got[i], &g_ref[i]));
        }
        di_engine_destroy(e);
    }
    fprintf(stderr,
            "(i) weight split [0, %d) [%d, %d): %lld blocks; KV-aware split [0, %d) [%d, %d): "
            "%lld blocks\n",
            wl0[1], wl0[1], L, (long long)n_blocks[0], sp.layer0[1], sp.layer0[1], L,
            (long long)n_blocks[1]);
    CHECK_EQ(n_blocks[0], one + 3);
    CHECK_EQ(n_blocks[1], sp.n_blocks);
    // kv_memory_bytes 0: the stages' memory alone sizes the KV (every block the bottleneck stage
    // holds, not 256 MiB's), and the stats say the bytes it came to.
    {
        di_engine_options oa = o;
        oa.kv_memory_bytes = 0;
        t.split = NULL;
        di_engine *e = NULL;
        CHECK_EQ(di_engine_create_prepared(g_dir, &oa, attach_mem_twin, &t, &e), DI_OK);
        if (e) {
            di_engine_stats st;
            di_engine_get_stats(e, &st);
            CHECK_EQ(st.n_blocks_total, sp.n_blocks);
            CHECK(st.kv_memory_bytes < (int64_t)64 << 20);
            CHECK(st.kv_memory_bytes >= st.n_blocks_total * st.block_bytes);
            di_engine_destroy(e);
        }
    }
    // One block less than a sequence on the weight split's stage 1: the engine refuses.
    t.split = wl0;
    t.budget[1] -= 4 * w1.block_bytes;
    di_engine *e = NULL;
    if (t.b[0] && t.b[1])
        CHECK_EQ(di_engine_create_prepared(g_dir, &o, attach_mem_twin, &t, &e), DI_ERR_NOMEM);
    CHECK(e == NULL);
    di_backend_destroy(t.b[0]);
    di_backend_destroy(t.b[1]);
}

// ---- (h) ----

// Under AddressSanitizer (CI's sanitized stage) (h) is a memory check of the engine on stages:
// (a) and (d) (block I/O into the owner and the mirror); (c), (e) and (g) add no stage code that
// those and test_dev41_forward_cuts (the hand-over itself, under ASan too) do not run.
#if defined(__SANITIZE_ADDRESS__)
enum { STAGES_ALL = 0 };
#else
enum { STAGES_ALL = 1 };
#endif

static void test_stages(void) {
    g_stages = 2;
    CHECK_EQ(di_cpu_backend_create(2, &g_stage_b[1]), DI_OK);
    if (g_stage_b[1]) {
        test_same_tokens();
        if (STAGES_ALL) test_shared_prefix();
        const char *dirs[4] = {"kvdisk-cpu", "kvdisk-dev", "kvdisk-evict-cpu", "kvdisk-evict-dev"};
        for (int i = 0; i < 4; i++) { // (d) starts from empty disk tiers
            char path[400];
            snprintf(path, sizeof path, "%s/%s", g_dir, dirs[i]);
            di_test_remove_dir(path);
        }
        test_disk();
        if (STAGES_ALL) test_spec();
        if (STAGES_ALL) test_sizing();
        if (STAGES_ALL) test_transfer();
        if (STAGES_ALL) test_greedy_rows();
    }
    di_backend_destroy(g_stage_b[1]);
    g_stage_b[1] = NULL;
    g_stages = 1;
}

int main(int argc, char **argv) {
    snprintf(g_dir, sizeof g_dir, "/tmp/di_test_engine_dev41_XXXXXX");
    if (!mkdtemp(g_dir)) return 1;
    CHECK_EQ(di_synth_v41_write(g_dir, true, true, 41), DI_OK);
    for (int i = 0; i < N_REQ; i++)
        for (int t = 0; t < g_len[i]; t++)
            g_prompt[i][t] = (int32_t)((t * 31 + i * 17 + (i % 2 ? t * t : 0) + 3) % V);
    if (argc > 1 && strcmp(argv[1], "--deferred") == 0) {
        // The CPU backends in deferred mode (backend.h di_cpu_backend_set_deferred: work runs at
        // the CUDA stream's sync points only): the engine's device paths (the logits' download,
        // greedy rows' device argmax, the disk tier's block transfers, the stages' hand-over;
        // the KV transfers in V4's test_engine_dev --deferred) must still give the same tokens.
        setenv("DI_CPU_DEFERRED", "1", 1);
        RUN(test_disk);
        RUN(test_greedy_rows); // before the stages: their run reuses its references
        RUN(test_stages);
        di_test_remove_dir(g_dir);
        return test_finish();
    }
    RUN(test_same_tokens);
    RUN(test_official);
    RUN(test_failure);
    RUN(test_shared_prefix);
    RUN(test_disk);
    RUN(test_sizing);
    RUN(test_spec);
    RUN(test_transfer);
    RUN(test_greedy_rows);
    RUN(test_stages);
    RUN(test_mem_stages);
    di_test_remove_dir(g_dir);
    return test_finish();
}
