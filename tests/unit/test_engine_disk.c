// engine + the prefix cache's disk tier (docs/kv-cache.md, "Disk tier"), on the tiny synthesised
// model: (a) a restart: an engine runs a long prompt and is destroyed (its cached blocks are
// flushed to disk), a new engine on the same directory runs the prompt plus a continuation and
// takes the prefix from disk: its tokens and logprobs equal those of an engine without any cache;
// the probe (di_engine_kv_probe) counts the blocks on disk, then in memory, reads nothing;
// (b) the same after one record is corrupted: the chain stops there, the rest is recomputed, the
// output is still identical and the record is dropped; (c) write-back on eviction inside one
// engine with the smallest pool: the evicted blocks come back from disk, identical output, no
// allocation in any step, the prompt's tail snapshot written back and restored with its block;
// (e) a restart whose record carries the prompt's tail snapshot: no replay (with no_tail_cache:
// the replay), a damaged snapshot section dropping its record; (d) options: a disk tier without the
// prefix cache, and two engines on one directory, are refused; (f) the IO thread: held (its
// writes blocked), steps still complete with the evicted blocks queued, a rerun is served from
// the queue with identical output, a full queue drops records (counted) and the output is still
// identical, and destroy, still held, drains the queue so that a restart finds every record;
// (g) the read thread (admission prefetch): held, a request whose prompt is on disk waits while
// another one is admitted, steps and finishes; released, it is admitted with its cached tokens
// counted, no replay (its snapshot came back) and the output of an engine without any cache; a
// request cancelled while its prefetch is held returns every block; a read budget of three blocks
// reads three blocks at most (the rest is computed, the output still identical); several
// prefetches at once (two chains read, a request over a chain being read waits for that read),
// one at a time with kv_disk_prefetches 1, and a pool so small that what prefetches hold would
// keep the next request out for good (they yield): every output identical.
#include "harness.h"

#include <fcntl.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

#include "engine/engine_internal.h" // di_engine_kv_disk_hold(_reads)
#include "kv/kv_manager.h"
#include "model/synth.h"

enum { V = 512, N_TOP = 3, MAX_GEN = 8, N_P = 200, N_P2 = 300, N_OTHER = 480, N_CTX = 512 };

static char g_dir[256], g_disk[300];
static int32_t g_p2[N_P2]; // the prompt plus a continuation; its first N_P tokens are the prompt
static int32_t g_other[N_OTHER]; // an unrelated long prompt (fills the pool in (c))
#include "engine_prompt.h"       // result, on_event, same, engine_options, run

static di_engine_options options(size_t kv_bytes, const char *disk) {
    di_engine_options o = engine_options(kv_bytes);
    o.kv_disk_dir = disk;
    return o;
}

static di_engine *engine(size_t kv_bytes, const char *disk, bool prefix) {
    di_engine_options o = options(kv_bytes, disk);
    o.no_prefix_cache = !prefix;
    di_engine *e = NULL;
    CHECK_EQ(di_engine_create(g_dir, &o, &e), DI_OK);
    return e;
}

static void check_clean(di_engine *e, di_engine_stats *st) {
    di_engine_get_stats(e, st);
    CHECK_EQ(st->n_blocks_free, st->n_blocks_total);
    CHECK_EQ(st->n_step_allocs, 0); // disk writes and reads inside steps allocate nothing
}

static result g_ref[2]; // g_p2 on an engine without any cache: greedy, seeded

// The path of the record of block `blk` of g_p2 (salt 0), through a kv_manager of the same model
// that holds the directory's lock meanwhile (no engine may run on it then).
static void record_path(const char *disk, int blk, char *buf, size_t cap) {
    di_model_options mo = di_model_options_default();
    mo.n_threads = 1;
    di_model *m = NULL;
    di_kv_manager *kv = NULL;
    CHECK_EQ(di_model_load(g_dir, &mo, &m), DI_OK);
    if (m) CHECK_EQ(di_kv_manager_create(m, 8u << 20, 1, N_CTX, true, &kv), DI_OK);
    di_kv_disk_options o = {.dir = disk};
    if (kv) CHECK_EQ(di_kv_manager_open_disk(kv, &o), DI_OK);
    if (kv && kv->disk) {
        uint64_t h = 0;
        for (int i = 0; i <= blk; i++)
            h = di_prefix_cache_hash(kv->cache, h, g_p2 + i * kv->block_tokens, 0);
        CHECK(di_kv_disk_has(kv->disk, h));
        di_kv_disk_path(kv->disk, h, buf, cap);
    }
    di_kv_manager_destroy(kv);
    di_model_destroy(m);
}

static void test_restart_and_corruption(void) {
    di_engine_stats st;
    di_engine *e = engine(64u << 20, NULL, false);
    if (!e) return;
    run(e, g_p2, N_P2, false, MAX_GEN, &g_ref[0]);
    run(e, g_p2, N_P2, true, MAX_GEN, &g_ref[1]);
    check_clean(e, &st);
    CHECK_EQ(st.n_cache_hit_tokens, 0);
    int32_t n_cached = -1, n_disk = -1;
    CHECK_EQ(di_engine_kv_probe(e, g_p2, N_P2, 0, &n_cached, &n_disk), DI_OK); // no cache: 0
    CHECK_EQ(n_cached, 0);
    CHECK_EQ(n_disk, 0);
    di_engine_destroy(e);

    // The first server life: the prompt alone; destroy flushes its cached blocks.
    e = engine(64u << 20, g_disk, true);
    if (!e) return;
    result r;
    run(e, g_p2, N_P, false, 4, &r);
    check_clean(e, &st);
    CHECK_EQ(st.n_disk_blocks_written, 0); // nothing evicted: the pool is large
    CHECK_EQ(st.n_disk_hit_tokens, 0);
    di_engine_destroy(e);

    // A restart: prompt + continuation take the 12 full blocks of the first 200 + 3 computed
    // positions from disk (then bounded replay), and give the no-cache output exactly.
    e = engine(64u << 20, g_disk, true);
    if (!e) return;
    di_engine_get_stats(e, &st);
    CHECK_EQ(st.n_disk_records, 12);
    // The probe (di_engine_kv_probe: the PD router's question) sees the 12 blocks on disk, reads
    // nothing, and is refused past the context.
    CHECK_EQ(di_engine_kv_probe(e, g_p2, N_P2, 0, &n_cached, &n_disk), DI_OK);
    CHECK_EQ(n_cached, 192);
    CHECK_EQ(n_disk, 192);
    CHECK_EQ(di_engine_kv_probe(e, g_p2, N_P2, 7, &n_cached, &n_disk), DI_OK); // another salt
    CHECK_EQ(n_cached, 0);
    CHECK_EQ(di_engine_kv_probe(e, g_p2, N_CTX + 1, 0, &n_cached, &n_disk), DI_ERR_INVALID);
    di_engine_get_stats(e, &st);
    CHECK_EQ(st.n_disk_blocks_read, 0);
    for (int k = 0; k < 2; k++) {
        run(e, g_p2, N_P2, k == 1, MAX_GEN, &r);
        CHECK(same(&r, &g_ref[k]));
        CHECK_EQ(r.n_cached, k == 0 ? 192 : 288); // the second one hits memory, 18 blocks
    }
    CHECK_EQ(di_engine_kv_probe(e, g_p2, N_P2, 0, &n_cached, &n_disk), DI_OK);
    CHECK_EQ(n_cached, 288); // all in memory now
    CHECK_EQ(n_disk, 0);
    check_clean(e, &st);
    CHECK_EQ(st.n_disk_hit_tokens, 192);
    CHECK_EQ(st.n_disk_blocks_read, 12);
    CHECK_EQ(st.n_disk_dropped, 0);
    fprintf(stderr, "restart: %lld prompt tokens from disk (%lld blocks), output identical\n",
            (long long)st.n_disk_hit_tokens, (long long)st.n_disk_blocks_read);
    di_engine_destroy(e); // flushes the continuation's blocks too

    // Corrupt block 6's record (one payload byte): blocks 0..5 come from disk, the rest is
    // recomputed, the record is dropped, the output is still exact.
    char p[4200];
    record_path(g_disk, 6, p, sizeof p);
    struct stat sb;
    CHECK_EQ(stat(p, &sb), 0);
    int fd = open(p, O_RDWR);
    CHECK(fd >= 0);
    unsigned char c = 0;
    CHECK_EQ(pread(fd, &c, 1, sb.st_size - 100), 1);
    c ^= 0x01;
    CHECK_EQ(pwrite(fd, &c, 1, sb.st_size - 100), 1);
    close(fd);
    e = engine(64u << 20, g_disk, true);
    if (!e) return;
    run(e, g_p2, N_P2, false, MAX_GEN, &r);
    CHECK(same(&r, &g_ref[0]));
    CHECK_EQ(r.n_cached, 96);
    check_clean(e, &st);
    CHECK_EQ(st.n_disk_hit_tokens, 96);
    CHECK_EQ(st.n_disk_dropped, 1);
    CHECK(access(p, F_OK) != 0); // deleted
    di_engine_destroy(e);
}

// Tail snapshots through the disk tier: the first life's prompt leaves a snapshot at 288 (its last
// block boundary), flushed at destroy inside block 17's record. A restart without snapshots
// (no_tail_cache) reads the blocks alone and replays; one with them restores the record's
// snapshot and replays nothing; a damaged snapshot section drops block 17's record (the chain
// stops at 272, the rest replayed and computed). Every output equals the cache-off engine's.
static void test_snapshot_restart(void) {
    char disk[320], p[4200];
    snprintf(disk, sizeof disk, "%s-snap", g_disk);
    di_engine_stats st;
    result r;
    di_engine *e = engine(64u << 20, disk, true);
    if (!e) return;
    run(e, g_p2, N_P2, false, MAX_GEN, &r);
    CHECK(same(&r, &g_ref[0]));
    di_engine_get_stats(e, &st);
    CHECK_EQ(st.n_tail_taken, 1);
    di_engine_destroy(e); // flushes 18 blocks, block 17 with its snapshot

    di_engine_options o = options(64u << 20, disk);
    o.no_tail_cache = true;
    e = NULL;
    CHECK_EQ(di_engine_create(g_dir, &o, &e), DI_OK);
    if (!e) return;
    run(e, g_p2, N_P2, false, MAX_GEN, &r);
    CHECK(same(&r, &g_ref[0]));
    CHECK_EQ(r.n_cached, 288);
    CHECK(r.n_replayed > 0); // the bounded replay
    const int32_t replay = r.n_replayed;
    check_clean(e, &st);
    CHECK_EQ(st.n_disk_hit_tokens, 288);
    CHECK_EQ(st.n_disk_snaps_read, 0);
    di_engine_destroy(e); // nothing rewritten: the records are there

    for (int k = 0; k < 2; k++) {
        e = engine(64u << 20, disk, true);
        if (!e) return;
        run(e, g_p2, N_P2, k == 1, MAX_GEN, &r);
        CHECK(same(&r, &g_ref[k]));
        CHECK_EQ(r.n_cached, 288);
        CHECK_EQ(r.n_replayed, 0); // restored from the record's snapshot
        check_clean(e, &st);
        CHECK_EQ(st.n_disk_hit_tokens, 288);
        CHECK_EQ(st.n_disk_blocks_read, 18);
        CHECK_EQ(st.n_disk_snaps_read, 1);
        CHECK_EQ(st.n_tail_restored, 1);
        CHECK_EQ(st.n_disk_dropped, 0);
        fprintf(stderr, "restart with the snapshot from disk: %d replayed (%d without it)\n",
                (int)r.n_replayed, (int)replay);
        di_engine_destroy(e);
    }

    // One flipped byte in block 17's snapshot section (the record's last byte): the record is
    // dropped, the chain ends at block 16.
    record_path(disk, 17, p, sizeof p);
    struct stat sb;
    CHECK_EQ(stat(p, &sb), 0);
    int fd = open(p, O_RDWR);
    CHECK(fd >= 0);
    unsigned char c = 0;
    CHECK_EQ(pread(fd, &c, 1, sb.st_size - 1), 1);
    c ^= 0x01;
    CHECK_EQ(pwrite(fd, &c, 1, sb.st_size - 1), 1);
    close(fd);
    e = engine(64u << 20, disk, true);
    if (!e) return;
    run(e, g_p2, N_P2, false, MAX_GEN, &r);
    CHECK(same(&r, &g_ref[0]));
    CHECK_EQ(r.n_cached, 272);
    CHECK(r.n_replayed > 0);
    check_clean(e, &st);
    CHECK_EQ(st.n_disk_dropped, 1);
    CHECK_EQ(st.n_disk_snaps_read, 0);
    CHECK(access(p, F_OK) != 0); // deleted
    di_engine_destroy(e);
}

// The smallest pool the engine accepts, one sequence of max_ctx positions (test_engine.c), in
// bytes, with the block size in *st; 0 when no engine could be made. other: g_other's output on an
// engine without any cache (NULL: not needed).
static size_t tiny_pool(di_engine_stats *st, result *other) {
    di_engine *e = engine(64u << 20, NULL, false);
    if (!e) return 0;
    if (other) run(e, g_other, N_OTHER, false, MAX_GEN, other);
    di_engine_get_stats(e, st);
    di_engine_destroy(e);
    return (size_t)st->block_bytes * (size_t)(16 + N_CTX / st->block_tokens);
}

static void test_eviction_write_back(void) {
    char disk[320];
    snprintf(disk, sizeof disk, "%s-evict", g_disk);
    di_engine_stats st;
    const size_t tiny = tiny_pool(&st, NULL);
    if (!tiny) return;
    di_engine *e = engine(tiny, disk, true);
    if (!e) return;
    result r;
    run(e, g_p2, N_P, false, 4, &r); // 12 cached blocks
    run(e, g_other, N_OTHER, false, 4, &r);
    di_engine_get_stats(e, &st);
    CHECK(st.n_disk_blocks_written > 0); // the prompt's idle blocks were evicted to disk
    const int64_t written = st.n_disk_blocks_written;
    for (int k = 0; k < 2; k++) {
        run(e, g_p2, N_P2, k == 1, MAX_GEN, &r);
        CHECK(same(&r, &g_ref[k]));
    }
    check_clean(e, &st);
    CHECK(st.n_disk_hit_tokens > 0);
    CHECK(st.n_disk_blocks_read > 0);
    CHECK_EQ(st.n_disk_dropped, 0);
    // The prompt's last block and its snapshot (at 192) outlived the evictions; the prefetch of
    // the first rerun held it while the blocks before it were read back (nothing evicted it), so
    // the first rerun restored it from memory (the second hits memory throughout).
    CHECK_EQ(st.n_disk_prefetches, 1);
    CHECK_EQ(st.n_disk_prefetches_done, 1);
    CHECK_EQ(st.n_disk_prefetch_blocks * 16, st.n_disk_hit_tokens);
    CHECK_EQ(st.n_tail_restored, 2);
    fprintf(stderr,
            "eviction: %lld blocks written while running, %lld tokens read back from disk\n",
            (long long)written, (long long)st.n_disk_hit_tokens);
    di_engine_destroy(e);
}

// Another checkpoint of the same architecture (random weights of another seed: as a fine-tune
// or another quantisation would be) finds none of the first one's records on the same directory.
static void test_other_checkpoint(void) {
    char dir2[300];
    snprintf(dir2, sizeof dir2, "%s/other", g_dir);
    CHECK_EQ(mkdir(dir2, 0700), 0);
    di_synth_config c;
    CHECK(di_synth_preset("tiny", &c) == DI_OK);
    c.n_vocab = V;
    c.seed ^= 0x5eed;
    CHECK(di_synth_write(&c, dir2) == DI_OK);
    di_engine_options o = options(64u << 20, g_disk);
    di_engine *e = NULL;
    CHECK_EQ(di_engine_create(dir2, &o, &e), DI_OK);
    if (!e) return;
    di_engine_stats st;
    di_engine_get_stats(e, &st);
    CHECK(st.n_disk_records > 0); // the first checkpoint's records are there
    result r;
    run(e, g_p2, N_P2, false, MAX_GEN, &r);
    CHECK_EQ(r.n_cached, 0);
    check_clean(e, &st);
    CHECK_EQ(st.n_disk_hit_tokens, 0);
    CHECK_EQ(st.n_disk_blocks_read, 0);
    di_engine_destroy(e);
}

static void test_options(void) {
    char disk[320];
    snprintf(disk, sizeof disk, "%s-opt", g_disk);
    di_engine *a = NULL, *b = NULL;
    di_engine_options o = options(16u << 20, disk);
    o.no_prefix_cache = true;
    CHECK_EQ(di_engine_create(g_dir, &o, &a), DI_ERR_INVALID); // the tier extends the cache
    CHECK(a == NULL);
    o.no_prefix_cache = false;
    CHECK_EQ(di_engine_create(g_dir, &o, &a), DI_OK);
    CHECK_EQ(di_engine_create(g_dir, &o, &b), DI_ERR_BUSY); // one engine per directory
    CHECK(b == NULL);
    di_engine_destroy(a);
    CHECK_EQ(di_engine_create(g_dir, &o, &b), DI_OK);
    di_engine_destroy(b);
}

// ---- (f) the IO thread ----

typedef struct held_result {
    result r;
    atomic_int done;
} held_result;

static void on_event_held(void *user, const di_event *ev) {
    held_result *h = user;
    on_event(&h->r, ev);
    if (ev->finish != DI_FINISH_NONE) atomic_store(&h->done, 1);
}

// As run(), without di_engine_wait_idle (which waits for the disk queue: it would wait for a held
// IO thread): polls the request's final event instead (60 s at most).
static void run_held(di_engine *e, const int32_t *prompt, int32_t n, bool seeded, int max_gen,
                     result *out) {
    static held_result h;
    memset(&h, 0, sizeof h);
    di_request_params p = di_request_params_default();
    p.prompt = prompt;
    p.n_prompt = n;
    p.max_tokens = max_gen;
    p.ignore_eos = true;
    p.sample.n_logprobs = N_TOP;
    if (seeded) {
        p.sample.temperature = 0.9f;
        p.sample.top_k = 40;
        p.sample.seed = 4242;
    }
    p.on_event = on_event_held;
    p.user = &h;
    uint64_t id;
    CHECK_EQ(di_engine_submit(e, &p, &id), DI_OK);
    for (int i = 0; i < 60000 && !atomic_load(&h.done); i++) usleep(1000);
    CHECK(atomic_load(&h.done));
    *out = h.r;
    CHECK_EQ(out->n, max_gen);
}

static void test_io_thread(void) {
    char disk[320], disk2[320];
    snprintf(disk, sizeof disk, "%s-io", g_disk);
    snprintf(disk2, sizeof disk2, "%s-io-full", g_disk);
    di_engine_stats st;
    const size_t tiny = tiny_pool(&st, NULL);
    if (!tiny) return;
    di_engine *e = engine(tiny, disk, true);
    if (!e) return;
    result r;
    run(e, g_p2, N_P, false, 4, &r); // 12 cached blocks
    // The IO thread blocked: the evictions of the next request are queued, and its steps go on.
    di_engine_kv_disk_hold(e, true);
    run_held(e, g_other, N_OTHER, false, 4, &r);
    di_engine_get_stats(e, &st);
    CHECK(st.n_disk_writes_queued > 0);
    CHECK_EQ(st.n_disk_writes_pending, st.n_disk_writes_queued);
    CHECK(st.disk_pending_bytes > 0);
    CHECK_EQ(st.n_disk_blocks_written, 0); // nothing written: no step waited for the disk
    CHECK_EQ(st.n_disk_writes_dropped, 0);
    const int64_t queued = st.n_disk_writes_queued;
    // Still held: the prompt again is served from the queue (by the read thread), and its output
    // is that of an engine without any cache.
    run_held(e, g_p2, N_P2, false, MAX_GEN, &r);
    CHECK(same(&r, &g_ref[0]));
    di_engine_get_stats(e, &st);
    CHECK(st.n_disk_queue_hits > 0);
    CHECK(st.n_disk_hit_tokens > 0);
    CHECK_EQ(st.n_disk_prefetch_blocks, st.n_disk_queue_hits);
    CHECK_EQ(st.n_disk_blocks_written, 0);
    fprintf(stderr,
            "io thread held: %lld records queued while steps ran, %lld lookups served from the "
            "queue (%lld tokens); staging %.3f ms in all on the engine thread\n",
            (long long)queued, (long long)st.n_disk_queue_hits, (long long)st.n_disk_hit_tokens,
            (double)st.disk_stage_us / 1000.0);
    // Released: the queue drains (di_engine_wait_idle waits for it).
    di_engine_kv_disk_hold(e, false);
    di_engine_wait_idle(e);
    di_engine_get_stats(e, &st);
    CHECK_EQ(st.n_disk_writes_pending, 0);
    CHECK_EQ(st.n_disk_blocks_written, st.n_disk_writes_queued);
    CHECK_EQ(st.n_disk_write_errors, 0);
    CHECK(st.disk_write_us > 0);
    CHECK_EQ(st.n_disk_records, st.n_disk_blocks_written);
    // Held again at shutdown: destroy drains the queue before the flush, so the restart finds
    // every record.
    di_engine_kv_disk_hold(e, true);
    run_held(e, g_other, N_OTHER, false, 4, &r);
    di_engine_get_stats(e, &st);
    CHECK(st.n_disk_writes_pending > 0);
    di_engine_destroy(e);
    e = engine(tiny, disk, true);
    if (!e) return;
    di_engine_get_stats(e, &st);
    CHECK(st.n_disk_records >= 12 + N_OTHER / 16); // both prompts' blocks, all of them
    run(e, g_p2, N_P2, false, MAX_GEN, &r);
    CHECK(same(&r, &g_ref[0]));
    di_engine_destroy(e);

    // A queue of one record: held, the evictions beyond the first are dropped (counted), and
    // the prompt again is still exact (the dropped blocks are recomputed).
    di_engine_options o = options(tiny, disk2);
    o.kv_disk_queue_bytes = 1; // raised to one record
    CHECK_EQ(di_engine_create(g_dir, &o, &e), DI_OK);
    if (!e) return;
    run(e, g_p2, N_P, false, 4, &r);
    di_engine_kv_disk_hold(e, true);
    run_held(e, g_other, N_OTHER, false, 4, &r);
    di_engine_get_stats(e, &st);
    CHECK_EQ(st.n_disk_writes_queued, 1);
    CHECK(st.n_disk_writes_dropped > 0);
    run_held(e, g_p2, N_P2, true, MAX_GEN, &r);
    CHECK(same(&r, &g_ref[1]));
    di_engine_kv_disk_hold(e, false);
    di_engine_wait_idle(e);
    di_engine_get_stats(e, &st);
    CHECK_EQ(st.n_disk_writes_pending, 0);
    CHECK_EQ(st.n_disk_write_errors, 0);
    fprintf(stderr, "io queue of one record: %lld queued, %lld dropped (full)\n",
            (long long)st.n_disk_writes_queued, (long long)st.n_disk_writes_dropped);
    di_engine_destroy(e);
}

static void submit_held(di_engine *e, const int32_t *prompt, int32_t n, held_result *h,
                        uint64_t *id) {
    memset(h, 0, sizeof *h);
    di_request_params p = di_request_params_default();
    p.prompt = prompt;
    p.n_prompt = n;
    p.max_tokens = MAX_GEN;
    p.ignore_eos = true;
    p.sample.n_logprobs = N_TOP;
    p.on_event = on_event_held;
    p.user = h;
    CHECK_EQ(di_engine_submit(e, &p, id), DI_OK);
}

// Polls h's final event (60 s at most).
static bool wait_done(held_result *h) {
    for (int i = 0; i < 60000 && !atomic_load(&h->done); i++) usleep(1000);
    return atomic_load(&h->done);
}

// Polls until the engine started n prefetches (10 s at most).
static void wait_prefetches(di_engine *e, int64_t n) {
    di_engine_stats st;
    for (int i = 0; i < 10000; i++) {
        di_engine_get_stats(e, &st);
        if (st.n_disk_prefetches >= n) break;
        usleep(1000);
    }
    CHECK_EQ(st.n_disk_prefetches, n);
}

static void test_read_thread(void) {
    enum { N_SHORT = 40 };
    static int32_t g_short[N_SHORT]; // on no disk: admitted at once
    for (int t = 0; t < N_SHORT; t++) g_short[t] = (int32_t)((t * 71 + 3) % V);
    char disk[320];
    snprintf(disk, sizeof disk, "%s-read", g_disk);
    di_engine_stats st;
    static result ref_other; // g_other on an engine without any cache
    const size_t tiny = tiny_pool(&st, &ref_other);
    if (!tiny) return;
    const int32_t bt = (int32_t)st.block_tokens, bb = (int32_t)st.block_bytes;
    di_engine *e = engine(tiny, disk, true);
    if (!e) return;
    result r;
    run(e, g_p2, N_P, false, 4, &r);        // 12 cached blocks, the snapshot at 192
    run(e, g_other, N_OTHER, false, 4, &r); // evicts the first ones to disk
    // The read thread held: g_p2's prefetch starts and waits; g_short is admitted meanwhile and
    // finishes, g_p2 has not started.
    static held_result a, b;
    uint64_t ida, idb;
    di_engine_kv_disk_hold_reads(e, true);
    submit_held(e, g_p2, N_P2, &a, &ida);
    wait_prefetches(e, 1);
    submit_held(e, g_short, N_SHORT, &b, &idb);
    CHECK(wait_done(&b));
    CHECK_EQ(b.r.n, MAX_GEN);
    CHECK(!atomic_load(&a.done));
    CHECK_EQ(a.r.n, 0);
    di_engine_get_stats(e, &st);
    CHECK_EQ(st.n_disk_prefetches_done, 0);
    CHECK_EQ(st.n_disk_prefetch_blocks, 0);
    CHECK_EQ(st.n_waiting, 1);
    // Released: admitted with the 12 blocks (read ones and the one still in memory) counted, its
    // snapshot restored (no replay), and the output of an engine without any cache.
    di_engine_kv_disk_hold_reads(e, false);
    CHECK(wait_done(&a));
    CHECK(same(&a.r, &g_ref[0]));
    CHECK_EQ(a.r.n_cached, 12 * bt);
    CHECK_EQ(a.r.n_replayed, 0);
    di_engine_wait_idle(e);
    check_clean(e, &st);
    CHECK_EQ(st.n_disk_prefetches_done, 1);
    CHECK(st.n_disk_prefetch_blocks > 0);
    CHECK_EQ(st.n_disk_hit_tokens, st.n_disk_prefetch_blocks * bt);
    CHECK(st.disk_prefetch_bytes >= st.n_disk_prefetch_blocks * (int64_t)bt);
    CHECK_EQ(st.n_disk_prefetch_waits, 1);
    CHECK(st.disk_prefetch_wait_us > 0);
    fprintf(stderr,
            "read thread: %lld blocks (%.1f KiB) read off the engine thread in %.3f ms; the "
            "engine thread's time on the prefetch %.3f ms; the request waited %.3f ms\n",
            (long long)st.n_disk_prefetch_blocks, (double)st.disk_prefetch_bytes / 1024,
            (double)st.disk_prefetch_read_us / 1000, (double)st.disk_prefetch_engine_us / 1000,
            (double)st.disk_prefetch_wait_us / 1000);
    di_engine_destroy(e); // flushes every cached block: the restart below finds them on disk

    // Cancelled while its prefetch is held: every block comes back, nothing leaks (ASan); then
    // the same prompt runs exactly.
    e = engine(tiny, disk, true);
    if (!e) return;
    di_engine_kv_disk_hold_reads(e, true);
    submit_held(e, g_p2, N_P2, &a, &ida);
    wait_prefetches(e, 1);
    di_engine_cancel(e, ida);
    CHECK(wait_done(&a));
    CHECK_EQ(a.r.n, 0);
    di_engine_wait_idle(e);
    check_clean(e, &st);
    CHECK_EQ(st.n_disk_prefetches_done, 1); // stopped before its first record
    CHECK_EQ(st.n_disk_prefetch_blocks, 0);
    di_engine_kv_disk_hold_reads(e, false);
    run(e, g_p2, N_P2, false, MAX_GEN, &r);
    CHECK(same(&r, &g_ref[0]));
    CHECK_EQ(r.n_cached, (N_P2 - 1) / bt * bt); // every block of the first engine's g_p2 run
    check_clean(e, &st);
    CHECK_EQ(st.n_disk_prefetches, 2);
    di_engine_destroy(e);

    // A read budget of three blocks: three are read, the rest is computed; output still exact.
    di_engine_options o = options(tiny, disk);
    o.kv_disk_read_bytes = (size_t)3 * (size_t)bb;
    CHECK_EQ(di_engine_create(g_dir, &o, &e), DI_OK);
    if (!e) return;
    run(e, g_p2, N_P2, true, MAX_GEN, &r);
    CHECK(same(&r, &g_ref[1]));
    check_clean(e, &st);
    CHECK(st.n_disk_prefetch_blocks >= 1 && st.n_disk_prefetch_blocks <= 3);
    CHECK(st.disk_prefetch_bytes <= (int64_t)o.kv_disk_read_bytes);
    CHECK_EQ(r.n_cached, st.n_disk_prefetch_blocks * bt);
    CHECK_EQ(st.n_disk_hit_tokens, r.n_cached);
    di_engine_destroy(e);

    // Prefetches at once, reads held. k = 0: default 4, a pool of three tiny ones: g_p2's and
    // g_other's chains (both on disk only after the restart) get one each; g_p2 again waits for
    // the first one's read (a record is read once: no third prefetch). k = 1: one prefetch at a
    // time: g_other waits for a free one. g_short, submitted last, is admitted past all three (so
    // they were all probed) and finishes. Released: every output is exact, the second g_p2
    // attached the blocks the first one's prefetch read. k = 2: as k = 0 on the tiny pool, where
    // what the prefetches hold leaves the request next in line too few blocks once g_p2 has run
    // (without di_kv_prefetch_yield nothing would ever be admitted again): every output exact.
    static held_result c, s;
    uint64_t idc, ids;
    for (int k = 0; k < 3; k++) {
        o = options(k == 2 ? tiny : 3 * tiny, disk);
        o.kv_disk_prefetches = k == 1 ? 1 : 0;
        CHECK_EQ(di_engine_create(g_dir, &o, &e), DI_OK);
        if (!e) return;
        di_engine_kv_disk_hold_reads(e, true);
        submit_held(e, g_p2, N_P2, &a, &ida);
        submit_held(e, g_other, N_OTHER, &b, &idb);
        submit_held(e, g_p2, N_P2, &c, &idc);
        wait_prefetches(e, k == 1 ? 1 : 2);
        // A short prompt on no disk (the engines before flushed g_short there).
        for (int t = 0; t < N_SHORT; t++) g_short[t] = (int32_t)((t * 71 + 3 + 101 * (k + 1)) % V);
        submit_held(e, g_short, N_SHORT, &s, &ids);
        CHECK(wait_done(&s));
        di_engine_get_stats(e, &st);
        CHECK_EQ(st.n_disk_prefetches, k == 1 ? 1 : 2);
        CHECK_EQ(st.n_disk_prefetches_done, 0);
        CHECK_EQ(st.n_waiting, 3);
        di_engine_kv_disk_hold_reads(e, false);
        CHECK(wait_done(&a) && wait_done(&b) && wait_done(&c));
        CHECK(same(&a.r, &g_ref[0]));
        CHECK(same(&c.r, &g_ref[0]));
        CHECK(same(&b.r, &ref_other));
        CHECK(a.r.n_cached > 0 && b.r.n_cached > 0);
        di_engine_wait_idle(e);
        check_clean(e, &st);
        if (k < 2) {
            CHECK_EQ(c.r.n_cached, a.r.n_cached);
            CHECK_EQ(st.n_disk_prefetches, 2);
            CHECK_EQ(st.n_disk_prefetches_done, 2);
        }
        fprintf(stderr,
                "prefetches at once %d, pool %d blocks: %lld blocks read for 3 requests over 2 "
                "chains; cached tokens %d, %d, %d\n",
                k == 1 ? 1 : 4, (int)st.n_blocks_total, (long long)st.n_disk_prefetch_blocks,
                (int)a.r.n_cached, (int)b.r.n_cached, (int)c.r.n_cached);
        di_engine_destroy(e);
    }
}

int main(void) {
    snprintf(g_dir, sizeof g_dir, "/tmp/di_test_engine_disk_XXXXXX");
    if (!mkdtemp(g_dir)) return 1;
    snprintf(g_disk, sizeof g_disk, "%s/kv", g_dir);
    di_synth_config c;
    CHECK(di_synth_preset("tiny", &c) == DI_OK);
    c.n_vocab = V;
    CHECK(di_synth_write(&c, g_dir) == DI_OK);
    for (int t = 0; t < N_P2; t++) g_p2[t] = (int32_t)((t * 37 + 11) % V);
    for (int t = 0; t < N_OTHER; t++) g_other[t] = (int32_t)((t * 53 + 5) % V);
    di_set_log_level(1);
    RUN(test_restart_and_corruption);
    RUN(test_snapshot_restart);
    RUN(test_eviction_write_back);
    RUN(test_other_checkpoint);
    RUN(test_options);
    RUN(test_io_thread);
    RUN(test_read_thread);
    di_test_remove_dir(g_dir);
    return test_finish();
}
