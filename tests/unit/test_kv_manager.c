// KV manager, block pool and prefix cache: reference counting, LRU eviction of idle cached
// blocks, no leaks; the forward pass on pool pages bit-identical to a session; prefix reuse with
// bounded replay bit-exact against a cold prefill (and wrong without the replay); the accounting
// manager of the device-resident forward (no memory, no tail blocks); the disk tier continuing a
// prefix match with evicted blocks read back (then memory again), contents intact.
#include "harness.h"

#include <stdlib.h>
#include <unistd.h> // usleep: polling the read thread

#include "kv/kv_manager.h"
#include "model/synth.h"

static char g_dir[256];
static di_model *g_m;
enum { V = 512 };

static void test_block_pool(void) {
    di_block_pool *p = NULL;
    CHECK_EQ(di_block_pool_create(4, 100, &p), DI_OK);
    CHECK_EQ(di_block_pool_block_bytes(p), 128);
    int32_t id[5];
    for (int i = 0; i < 4; i++) CHECK_EQ(di_block_pool_alloc(p, &id[i]), DI_OK);
    CHECK_EQ(di_block_pool_alloc(p, &id[4]), DI_ERR_NO_KV);
    CHECK_EQ(di_block_pool_n_available(p), 0);
    di_block_pool_ref(p, id[0]);
    di_block_pool_unref(p, id[0]);
    CHECK_EQ(di_block_pool_refs(p, id[0]), 1);
    // A cached block at zero references is idle, still available, and revivable.
    di_block_pool_set_cached(p, id[1], true);
    di_block_pool_unref(p, id[1]);
    CHECK_EQ(di_block_pool_n_available(p), 1);
    CHECK_EQ(di_block_pool_n_cached_idle(p), 1);
    di_block_pool_ref(p, id[1]);
    CHECK_EQ(di_block_pool_n_cached_idle(p), 0);
    di_block_pool_unref(p, id[1]);
    for (int i = 0; i < 4; i++)
        if (i != 1) di_block_pool_unref(p, id[i]);
    CHECK_EQ(di_block_pool_n_available(p), 4);
    di_block_pool_destroy(p);
}

static int g_evicted = -1;
static void evict_probe(void *user, int32_t id) {
    (void)user;
    g_evicted = id;
}

static void test_lru_eviction(void) {
    di_block_pool *p = NULL;
    CHECK_EQ(di_block_pool_create(2, 64, &p), DI_OK);
    di_block_pool_set_evict(p, evict_probe, NULL);
    int32_t a, b, c;
    CHECK_EQ(di_block_pool_alloc(p, &a), DI_OK);
    CHECK_EQ(di_block_pool_alloc(p, &b), DI_OK);
    di_block_pool_set_cached(p, a, true);
    di_block_pool_set_cached(p, b, true);
    di_block_pool_unref(p, b); // b idle first: least recently used
    di_block_pool_unref(p, a);
    CHECK_EQ(di_block_pool_alloc(p, &c), DI_OK);
    CHECK_EQ(g_evicted, b);
    CHECK_EQ(c, b);
    di_block_pool_unref(p, c);
    CHECK_EQ(di_block_pool_n_available(p), 2);
    di_block_pool_destroy(p);
}

static void prompt_of(int32_t *t, int32_t n, int seed) {
    for (int32_t i = 0; i < n; i++) t[i] = (int32_t)((i * 37 + seed * 11 + (i * i) % 13) % V);
}

// Feeds tokens[from, to) of slot through the forward in chunks; logits of rows [keep_from, to)
// go to out (row 0 = keep_from). win_lo: first position with a window row.
static void feed_kv(di_kv_manager *kv, di_dsv4_ws *ws, int slot, const int32_t *tokens,
                    int32_t from, int32_t to, int32_t win_lo, int32_t keep_from, float *out,
                    bool publish) {
    const int32_t chunk = 48;
    for (int32_t p = from; p < to; p += chunk) {
        int32_t n = to - p < chunk ? to - p : chunk;
        CHECK_EQ(di_kv_seq_grow(kv, slot, p + n), DI_OK);
        di_dsv4_seq sq = {.layers = kv->seqs[slot].layers, .pos = p, .n_tok = n, .win_lo = win_lo};
        di_dsv4_ctx c = {.model = g_m, .ws = ws, .seqs = &sq, .n_seq = 1};
        int32_t rows[48], n_rows = 0;
        for (int32_t t = 0; t < n; t++)
            if (p + t >= keep_from) rows[n_rows++] = t;
        di_dsv4_forward_batch(&c, tokens + p, rows, n_rows,
                              n_rows ? out + (int64_t)(p + rows[0] - keep_from) * V : NULL);
        if (publish) di_kv_seq_publish(kv, slot, tokens, p + n);
    }
}

static double rel_diff(const float *a, const float *b, int64_t n) {
    double md = 0, mx = 0;
    for (int64_t i = 0; i < n; i++) {
        md = fmax(md, fabs((double)a[i] - b[i]));
        mx = fmax(mx, fabs((double)b[i]));
    }
    return md / mx;
}

static void test_pages_and_prefix_replay(void) {
    enum { N1 = 420, SHARED = 400, N2 = 470 };
    di_kv_manager *kv = NULL;
    CHECK_EQ(di_kv_manager_create(g_m, 64u << 20, 4, 1024, true, &kv), DI_OK);
    if (!kv) return;
    const int32_t B = kv->block_tokens, R = kv->replay_tokens;
    fprintf(stderr, "block %d tokens, %d tail blocks, replay bound %d\n", B, kv->n_tail, R);
    const int32_t total = di_block_pool_n_total(kv->pool);
    di_dsv4_ws ws = {0};
    CHECK_EQ(di_dsv4_ws_reserve(&ws, g_m, 64, 1024, false), DI_OK);
    int32_t *p1 = malloc(sizeof(int32_t) * N1), *p2 = malloc(sizeof(int32_t) * N2);
    prompt_of(p1, N1, 1);
    memcpy(p2, p1, sizeof(int32_t) * SHARED);
    prompt_of(p2 + SHARED, N2 - SHARED, 2);
    float *cold = malloc(sizeof(float) * N2 * V), *warm = malloc(sizeof(float) * N2 * V);

    // Cold reference: a session over p2.
    di_session *s = NULL;
    CHECK_EQ(di_session_create(g_m, NULL, &s), DI_OK);
    di_forward_out fo = {.logits = cold};
    CHECK_EQ(di_session_forward(s, p2, N2, &fo), DI_OK);
    di_session_destroy(s);

    // Request 1 on pool pages: its logits equal the session's (cold for p1's first SHARED rows).
    CHECK_EQ(di_kv_seq_open(kv, 0, 0), DI_OK);
    CHECK_EQ(di_kv_seq_attach_prefix(kv, 0, 0, p1, N1 - 1), 0);
    feed_kv(kv, &ws, 0, p1, 0, N1, 0, 0, warm, true);
    CHECK(memcmp(warm, cold, sizeof(float) * SHARED * V) == 0);
    di_kv_seq_close(kv, 0);
    CHECK_EQ(di_block_pool_n_available(kv->pool), total); // nothing leaked; blocks stay cached
    CHECK_EQ(di_prefix_cache_n_blocks(kv->cache), N1 / B);

    // Control first: continuing the hit after replaying only the last window (W tokens, the
    // naive "sliding-window suffix") is not exact, so the bound is needed and this test can tell.
    // (Nothing is published from this sequence.)
    const int32_t W = g_m->hp.window;
    CHECK_EQ(di_kv_seq_open(kv, 2, 0), DI_OK);
    int32_t hit = di_kv_seq_attach_prefix(kv, 2, 0, p2, N2 - 1);
    CHECK_EQ(hit, SHARED / B * B);
    feed_kv(kv, &ws, 2, p2, hit - W, N2, hit - W, hit, warm + (int64_t)hit * V, false);
    double e_short =
        rel_diff(warm + (int64_t)hit * V, cold + (int64_t)hit * V, (int64_t)(N2 - hit) * V);
    fprintf(stderr, "replay of only the last window (%d tokens): max rel diff %.3g\n", W, e_short);
    CHECK(e_short > 1e-3);
    di_kv_seq_close(kv, 2);

    // Request 2 shares SHARED tokens: hit of whole blocks, bounded replay, then its own tokens.
    CHECK_EQ(di_kv_seq_open(kv, 1, 0), DI_OK);
    CHECK_EQ(di_kv_seq_attach_prefix(kv, 1, 0, p2, N2 - 1), hit);
    int32_t q = hit > R ? hit - R : 0;
    fprintf(stderr, "hit %d tokens, replay %d tokens (positions %d..%d)\n", hit, hit - q, q,
            hit - 1);
    CHECK(hit >= 3 * 128);
    CHECK_EQ(hit - q, R); // the replay count is exactly the bound
    feed_kv(kv, &ws, 1, p2, q, N2, q, hit, warm + (int64_t)hit * V, true);
    double e = rel_diff(warm + (int64_t)hit * V, cold + (int64_t)hit * V, (int64_t)(N2 - hit) * V);
    fprintf(stderr, "prefix hit vs cold: max rel diff %.3g\n", e);
    CHECK(e <= 1e-5);
    CHECK(memcmp(warm + (int64_t)hit * V, cold + (int64_t)hit * V,
                 sizeof(float) * (size_t)(N2 - hit) * V) == 0); // in fact bit-exact
    di_kv_seq_close(kv, 1);
    CHECK_EQ(di_prefix_cache_n_blocks(kv->cache), N1 / B + (N2 - hit) / B);

    // A different salt shares nothing.
    CHECK_EQ(di_kv_seq_open(kv, 3, 77), DI_OK);
    CHECK_EQ(di_kv_seq_attach_prefix(kv, 3, 0, p2, N2 - 1), 0);
    di_kv_seq_close(kv, 3);
    CHECK_EQ(di_block_pool_n_available(kv->pool), total);

    free(p1);
    free(p2);
    free(cold);
    free(warm);
    di_dsv4_ws_free(&ws);
    di_kv_manager_destroy(kv);
}

// The accounting manager (the device-resident forward's): no memory, no tail blocks; one
// sequence of max_ctx positions must fit; blocks come back; a prefix hit records n_cached.
static void test_accounting(void) {
    di_block_pool *p = NULL;
    CHECK_EQ(di_block_pool_create_accounting(3, 1000, &p), DI_OK);
    int32_t id;
    CHECK_EQ(di_block_pool_alloc(p, &id), DI_OK);
    CHECK(di_block_pool_ptr(p, id) == NULL);
    CHECK_EQ(di_block_pool_block_bytes(p), 1024);
    di_block_pool_unref(p, id);
    di_block_pool_destroy(p);

    const int32_t B = di_kv_block_tokens(g_m), max_ctx = 4 * B;
    di_kv_manager *kv = NULL;
    CHECK_EQ(di_kv_manager_create_accounting(g_m, 3, 4096, 2, max_ctx, true, &kv), DI_ERR_INVALID);
    CHECK(kv == NULL);
    CHECK_EQ(di_kv_manager_create_accounting(g_m, 6, 4096, 2, max_ctx, true, &kv), DI_OK);
    if (!kv) return;
    CHECK_EQ(kv->n_tail, 0);
    CHECK_EQ(kv->block_tokens, B);
    CHECK_EQ(di_kv_blocks_for(kv, max_ctx), 4);
    int32_t prompt[4 * 64];
    for (int i = 0; i < 4 * B && i < 4 * 64; i++) prompt[i] = (i * 7 + 1) % V;
    CHECK(4 * B <= 4 * 64);
    CHECK_EQ(di_kv_seq_open(kv, 0, 0), DI_OK);
    CHECK_EQ(di_kv_seq_grow(kv, 0, 2 * B + 1), DI_OK); // 3 blocks
    CHECK_EQ(kv->seqs[0].n_blocks, 3);
    di_kv_seq_publish(kv, 0, prompt, 2 * B + 1); // the first two are full
    CHECK_EQ(di_kv_seq_open(kv, 1, 0), DI_OK);
    CHECK_EQ(di_kv_seq_attach_prefix(kv, 1, 0, prompt, 3 * B), 2 * B);
    CHECK_EQ(kv->seqs[1].n_cached, 2 * B);
    CHECK_EQ(kv->seqs[1].blocks[0], kv->seqs[0].blocks[0]);
    CHECK_EQ(kv->seqs[0].n_cached, 0);
    di_kv_seq_close(kv, 0);
    di_kv_seq_close(kv, 1);
    CHECK_EQ(di_block_pool_n_available(kv->pool), 6);
    CHECK_EQ(di_block_pool_n_cached_idle(kv->pool), 2);
    di_kv_manager_destroy(kv);
}

// Entry block i's payload pattern.
static float pattern(int32_t i, int64_t j) {
    return (float)i * 1000.0f + (float)(j % 977);
}

static void test_disk_tier(void) {
    enum { N_BLK = 8 };
    char disk[300];
    snprintf(disk, sizeof disk, "%s/kv-disk", g_dir);
    di_kv_manager *kv = NULL;
    // A pool of exactly one 1024-position sequence (tail + 64 entry blocks).
    CHECK_EQ(di_kv_manager_create(g_m, 64u << 20, 2, 1024, true, &kv), DI_OK);
    if (!kv) return;
    const size_t bb = di_block_pool_block_bytes(kv->pool);
    const int32_t n_pool = di_kv_blocks_for(kv, 1024);
    di_kv_manager_destroy(kv);
    kv = NULL;
    CHECK_EQ(di_kv_manager_create(g_m, bb * (size_t)n_pool, 2, 1024, true, &kv), DI_OK);
    if (!kv) return;
    di_kv_disk_options o = {.dir = disk};
    CHECK_EQ(di_kv_manager_open_disk(kv, &o), DI_OK);
    const int32_t B = kv->block_tokens;
    int32_t *p = malloc(sizeof(int32_t) * (size_t)(N_BLK * B));
    CHECK(p != NULL);
    if (!p || !kv->disk) goto out;
    prompt_of(p, N_BLK * B, 3);
    // Sequence 0 computes (here: writes a pattern into) N_BLK entry blocks and publishes them.
    CHECK_EQ(di_kv_seq_open(kv, 0, 0), DI_OK);
    CHECK_EQ(di_kv_seq_grow(kv, 0, N_BLK * B), DI_OK);
    for (int32_t i = 0; i < N_BLK; i++)
        for (int64_t j = 0; j < kv->entry_floats; j++) kv->seqs[0].pages[i][j] = pattern(i, j);
    di_kv_seq_publish(kv, 0, p, N_BLK * B);
    di_kv_seq_close(kv, 0); // blocks 0..7 idle cached, block 0 least recent
    CHECK_EQ(di_prefix_cache_n_blocks(kv->cache), N_BLK);
    // Sequence 1 takes every free block and three more: blocks 0, 1, 2 are evicted (written to
    // disk) and overwritten.
    CHECK_EQ(di_kv_seq_open(kv, 1, 0), DI_OK);
    const int32_t free_now = di_block_pool_n_available(kv->pool) - N_BLK;
    CHECK_EQ(di_kv_seq_grow(kv, 1, (free_now + 3) * B), DI_OK);
    for (int32_t i = 0; i < kv->seqs[1].n_blocks; i++)
        memset(kv->seqs[1].pages[i], 0x7f, sizeof(float) * (size_t)kv->entry_floats);
    // Queued for the IO thread (copies: their blocks were overwritten just now), then written.
    di_kv_disk_io_stats qs;
    di_kv_disk_io_get_stats(kv->disk_io, &qs);
    CHECK_EQ(qs.n_queued, 3);
    CHECK_EQ(qs.n_dropped, 0);
    di_kv_disk_io_drain(kv->disk_io);
    di_kv_disk_stats ds;
    di_kv_disk_get_stats(kv->disk, &ds);
    CHECK_EQ(ds.n_written, 3);
    CHECK_EQ(di_prefix_cache_n_blocks(kv->cache), N_BLK - 3);
    di_kv_seq_close(kv, 1); // never published: its blocks are free
    // Another salt finds nothing, on disk either.
    CHECK_EQ(di_kv_seq_open(kv, 0, 99), DI_OK);
    CHECK_EQ(di_kv_seq_attach_prefix(kv, 0, 0, p, N_BLK * B), 0);
    di_kv_seq_close(kv, 0);
    // The prompt again: without its prefetch, attaching reads nothing from disk (no hit: block
    // 0 is on disk only).
    CHECK_EQ(di_kv_seq_open(kv, 0, 0), DI_OK);
    CHECK_EQ(di_kv_seq_attach_prefix(kv, 0, 7, p, N_BLK * B), 0);
    di_kv_seq_close(kv, 0);
    CHECK_EQ(kv->n_disk_hit_tokens, 0);
    // Its prefetch reads blocks 0..2 on the read thread (the read thread held: it waits) and
    // holds 3..7 in memory. Request 8's prompt is the same chain: it waits for 7's read rather
    // than reading the records again (no second prefetch).
    di_kv_disk_io_hold_reads(kv->disk_io, true);
    CHECK_EQ(di_kv_prefetch(kv, 7, 0, p, N_BLK * B), DI_KV_PREFETCH_WAIT);
    CHECK_EQ(kv->n_prefetch_started, 1);
    CHECK_EQ(di_kv_prefetch(kv, 7, 0, p, N_BLK * B), DI_KV_PREFETCH_WAIT);
    CHECK_EQ(di_kv_prefetch(kv, 8, 0, p, N_BLK * B), DI_KV_PREFETCH_WAIT);
    CHECK_EQ(kv->n_prefetch_started, 1);
    CHECK_EQ(di_kv_prefetch_held(kv, 7), 0); // not done yet
    di_kv_disk_io_hold_reads(kv->disk_io, false);
    // Once 7's read is done, 8's probe collects it: the chain is in memory (held for 7), so 8
    // can attach it at once.
    di_kv_prefetch_state ps = DI_KV_PREFETCH_WAIT;
    for (int i = 0; i < 10000 && ps == DI_KV_PREFETCH_WAIT; i++) {
        ps = di_kv_prefetch(kv, 8, 0, p, N_BLK * B);
        if (ps == DI_KV_PREFETCH_WAIT) usleep(1000);
    }
    CHECK_EQ(ps, DI_KV_PREFETCH_READY);
    CHECK_EQ(di_kv_prefetch_held(kv, 8), 0);
    CHECK_EQ(di_kv_prefetch_held(kv, 7), N_BLK);
    CHECK_EQ(kv->n_prefetch_started, 1);
    CHECK_EQ(di_kv_prefetch(kv, 7, 0, p, N_BLK * B), DI_KV_PREFETCH_READY);
    CHECK_EQ(di_kv_prefetch_held(kv, 7), N_BLK);
    CHECK_EQ(kv->n_prefetch_done, 1);
    CHECK_EQ(kv->n_prefetch_blocks, 3);
    CHECK(kv->prefetch_bytes >= (int64_t)(3 * sizeof(float)) * kv->entry_floats);
    // Attached: blocks 0..2 as read, 3..7 from memory, all intact; the prefetch holds nothing.
    CHECK_EQ(di_kv_seq_open(kv, 0, 0), DI_OK);
    CHECK_EQ(di_kv_seq_attach_prefix(kv, 0, 7, p, N_BLK * B), N_BLK * B);
    CHECK_EQ(kv->n_disk_hit_tokens, 3 * B);
    CHECK_EQ(di_kv_prefetch_held(kv, 7), 0);
    int bad = 0;
    for (int32_t i = 0; i < N_BLK; i++)
        for (int64_t j = 0; j < kv->entry_floats; j++)
            bad += kv->seqs[0].pages[i][j] != pattern(i, j);
    CHECK_EQ(bad, 0);
    CHECK_EQ(di_prefix_cache_n_blocks(kv->cache), N_BLK); // read blocks are cached again
    di_kv_seq_close(kv, 0);
    // Shutdown flush: the 5 blocks never evicted are written too; a second flush writes nothing.
    CHECK_EQ(di_kv_manager_flush_disk(kv), N_BLK - 3);
    CHECK_EQ(di_kv_manager_flush_disk(kv), 0);
    CHECK_EQ(di_block_pool_n_available(kv->pool), di_block_pool_n_total(kv->pool));
    di_kv_manager_destroy(kv);
    kv = NULL;
    // A disk budget of two records: the flush writes the two most recently used blocks only.
    CHECK_EQ(di_kv_manager_create(g_m, bb * (size_t)n_pool, 2, 1024, true, &kv), DI_OK);
    if (!kv) goto out;
    snprintf(disk, sizeof disk, "%s/kv-disk-2", g_dir);
    o.max_bytes = 1; // below one record: refused
    CHECK_EQ(di_kv_manager_open_disk(kv, &o), DI_ERR_INVALID);
    CHECK(kv->disk == NULL);
    o.max_bytes =
        2 * (128 + sizeof(int32_t) * (size_t)B + sizeof(float) * (size_t)kv->entry_floats);
    CHECK_EQ(di_kv_manager_open_disk(kv, &o), DI_OK);
    if (!kv->disk) goto out;
    CHECK_EQ(di_kv_seq_open(kv, 0, 0), DI_OK);
    CHECK_EQ(di_kv_seq_grow(kv, 0, N_BLK * B), DI_OK);
    di_kv_seq_publish(kv, 0, p, N_BLK * B);
    di_kv_seq_close(kv, 0); // block N_BLK - 1 the most recently used
    CHECK_EQ(di_kv_manager_flush_disk(kv), 2);
    uint64_t h = 0;
    for (int32_t i = 0; i < N_BLK; i++) {
        h = di_prefix_cache_hash(kv->cache, h, p + i * B, 0);
        CHECK_EQ(di_kv_disk_has(kv->disk, h), i >= N_BLK - 2);
    }
out:
    free(p);
    di_kv_manager_destroy(kv);
}

static void test_budget_too_small(void) {
    di_kv_manager *kv = NULL;
    CHECK_EQ(di_kv_manager_create(g_m, 4096, 2, 1024, true, &kv), DI_ERR_INVALID);
    CHECK(kv == NULL);
}

int main(void) {
    snprintf(g_dir, sizeof g_dir, "/tmp/di_test_kv_XXXXXX");
    if (!mkdtemp(g_dir)) return 1;
    di_synth_config c;
    CHECK(di_synth_preset("tiny", &c) == DI_OK);
    c.n_vocab = V;
    CHECK(di_synth_write(&c, g_dir) == DI_OK);
    di_model_options mo = di_model_options_default();
    mo.n_threads = 2;
    CHECK(di_model_load(g_dir, &mo, &g_m) == DI_OK);
    RUN(test_block_pool);
    RUN(test_lru_eviction);
    if (g_m) RUN(test_pages_and_prefix_replay);
    if (g_m) RUN(test_budget_too_small);
    if (g_m) RUN(test_disk_tier);
    if (g_m) RUN(test_accounting);
    di_model_destroy(g_m);
    di_test_remove_dir(g_dir);
    return test_finish();
}
