// kv_manager — V4 sequence state on pool blocks (see kv_manager.h and docs/kv-cache.md).
#include "kv/kv_manager.h"

#include "kv/kv_transfer.h"

#include <stdio.h>
#include <string.h>
#include <time.h> // clock_gettime: the prefetch's engine-thread time

#include "base/log.h"
#include "base/mem.h"
#include "base/status.h"
#include "kv/kv_transfer.h"
#include "model/dsv41.h" // di_dsv41_page_bytes

// ---- layout ----

typedef struct packer {
    int64_t block_floats;
    int32_t n_blk;
    int64_t used; // floats used in the current (last) block
} packer;

// Places an item of n floats: next-fit, never across a block (n <= block_floats).
static di_kv_item place(packer *p, int64_t n) {
    n = (n + 15) & ~(int64_t)15; // keep 64-byte alignment
    if (p->n_blk == 0 || p->used + n > p->block_floats) {
        p->n_blk++;
        p->used = 0;
    }
    di_kv_item it = {p->n_blk - 1, p->used};
    p->used += n;
    return it;
}

static int32_t gcd32(int32_t a, int32_t b) {
    while (b) {
        int32_t t = a % b;
        a = b, b = t;
    }
    return a;
}

static uint64_t model_id(const di_model *m) {
    // di_dsv4_model_id: hyper-parameters, precision recipe and weights fingerprint, so blocks
    // are never shared between different models, checkpoints or numerics (the disk tier's records
    // outlive the process, so "the same architecture" is not enough).
    return di_dsv4_model_id(m);
}

int32_t di_kv_block_tokens(const di_model *m) {
    // A multiple of every ratio (every window closes at a block boundary), at least the window.
    int32_t lcm = 1;
    for (int il = 0; il < m->hp.n_layer; il++) {
        int32_t r = m->hp.compress_ratio[il];
        if (r > 0) lcm = lcm / gcd32(lcm, r) * r;
    }
    return lcm * ((m->hp.window + lcm - 1) / lcm);
}

// The per-slot arrays every manager has (tails only with n_tail > 0).
static di_status alloc_seqs(di_kv_manager *kv) {
    kv->seqs = di_calloc((size_t)kv->max_seqs, sizeof *kv->seqs);
    if (!kv->seqs) return DI_ERR_NOMEM;
    for (int32_t i = 0; i < kv->max_seqs; i++) {
        di_kv_seq *s = &kv->seqs[i];
        s->tail = kv->n_tail ? di_malloc(sizeof(int32_t) * (size_t)kv->n_tail) : NULL;
        s->blocks = di_malloc(sizeof(int32_t) * (size_t)kv->max_blocks);
        s->pages = di_calloc((size_t)kv->max_blocks, sizeof(float *));
        s->layers = di_calloc((size_t)kv->n_layer, sizeof(di_dsv4_layer_state));
        if ((kv->n_tail && !s->tail) || !s->blocks || !s->pages || !s->layers) return DI_ERR_NOMEM;
    }
    return DI_OK;
}

// The managers without tail blocks or layer views: accounting only (payload_bytes 0) or the V4.1
// pages (payload_bytes: a page's bytes, the block's first ones).
static di_status create_untailed(di_model *m, int32_t n_blocks, size_t block_bytes,
                                 int32_t max_seqs, int32_t max_ctx, bool prefix_cache,
                                 size_t payload_bytes, di_kv_manager **out) {
    const bool memory = payload_bytes > 0;
    di_status st = DI_OK;
    di_kv_manager *kv = di_calloc(1, sizeof *kv);
    if (!kv) return DI_ERR_NOMEM;
    kv->model = m;
    kv->accounting = true;
    kv->n_layer = m->hp.n_layer;
    kv->max_seqs = max_seqs;
    kv->max_ctx = max_ctx;
    kv->replay_tokens = m->hp.n_layer * (m->hp.window - 1);
    kv->block_tokens = di_kv_block_tokens(m);
    kv->block_floats = (int64_t)(block_bytes / sizeof(float));
    kv->entry_floats = (int64_t)(payload_bytes / sizeof(float)); // a V4.1 page (0: accounting)
    kv->max_blocks = (max_ctx + kv->block_tokens - 1) / kv->block_tokens;
    if (n_blocks < di_kv_blocks_for(kv, max_ctx)) {
        DI_LOG_ERROR("kv: %d device blocks of %zu bytes; one sequence of %d positions needs %d",
                     n_blocks, block_bytes, max_ctx, di_kv_blocks_for(kv, max_ctx));
        st = DI_ERR_INVALID;
        goto fail;
    }
    if (memory)
        DI_TRY(di_block_pool_create(n_blocks, block_bytes, &kv->pool));
    else
        DI_TRY(di_block_pool_create_accounting(n_blocks, block_bytes, &kv->pool));
    if (prefix_cache)
        DI_TRY(di_prefix_cache_create(kv->pool, kv->block_tokens, model_id(m), &kv->cache));
    DI_TRY(alloc_seqs(kv));
    if (memory)
        DI_LOG_INFO("kv: %d V4.1 blocks of %.1f KiB (%d positions each: the packed entries and "
                    "index keys of every kv source), replay bound %d tokens, prefix cache %s",
                    n_blocks, (double)block_bytes / 1024, kv->block_tokens, kv->replay_tokens,
                    prefix_cache ? "on" : "off");
    else
        DI_LOG_INFO("kv: %d accounted blocks of %zu KiB (%d positions each; the forward's state "
                    "holds the memory), replay bound %d tokens, prefix cache %s",
                    n_blocks, block_bytes / 1024, kv->block_tokens, kv->replay_tokens,
                    prefix_cache ? "on" : "off");
    *out = kv;
    return DI_OK;
fail:
    di_kv_manager_destroy(kv);
    return st;
}

di_status di_kv_manager_create_accounting(di_model *m, int32_t n_blocks, size_t block_bytes,
                                          int32_t max_seqs, int32_t max_ctx, bool prefix_cache,
                                          di_kv_manager **out) {
    return create_untailed(m, n_blocks, block_bytes, max_seqs, max_ctx, prefix_cache, 0, out);
}

size_t di_kv_v41_block_bytes(const di_model *m) {
    return (di_dsv41_page_bytes(m, di_kv_block_tokens(m)) + 63) / 64 * 64;
}

di_status di_kv_manager_create_v41(di_model *m, int32_t n_blocks, int32_t max_seqs, int32_t max_ctx,
                                   bool prefix_cache, di_kv_manager **out) {
    return create_untailed(m, n_blocks, di_kv_v41_block_bytes(m), max_seqs, max_ctx, prefix_cache,
                           di_dsv41_page_bytes(m, di_kv_block_tokens(m)), out);
}

di_status di_kv_manager_create(di_model *m, size_t kv_bytes, int32_t max_seqs, int32_t max_ctx,
                               bool prefix_cache, di_kv_manager **out) {
    const di_hparams *hp = &m->hp;
    di_status st = DI_OK;
    di_kv_manager *kv = di_calloc(1, sizeof *kv);
    if (!kv) return DI_ERR_NOMEM;
    kv->model = m;
    kv->n_layer = hp->n_layer;
    kv->max_seqs = max_seqs;
    kv->max_ctx = max_ctx;
    const int32_t L = hp->n_layer, W = hp->window, Dh = hp->head_dim, DI = hp->index_head_dim;
    kv->replay_tokens = L * (W - 1);

    kv->block_tokens = di_kv_block_tokens(m);
    const int32_t B = kv->block_tokens;

    size_t nl = (size_t)L;
    kv->page_off_cmp = di_calloc(nl, sizeof(int64_t));
    kv->page_off_idx = di_calloc(nl, sizeof(int64_t));
    di_kv_item **items[] = {&kv->ring, &kv->buf_c, &kv->buf_z, &kv->ibuf_c, &kv->ibuf_z};
    for (size_t i = 0; i < sizeof items / sizeof items[0]; i++)
        *items[i] = di_calloc(nl, sizeof(di_kv_item));
    if (!kv->page_off_cmp || !kv->page_off_idx || !kv->ring || !kv->buf_c || !kv->buf_z ||
        !kv->ibuf_c || !kv->ibuf_z) {
        st = DI_ERR_NOMEM;
        goto fail;
    }
    // Entry block: per compressed layer, B / ratio entries of the main compressor, and for CSA as
    // many indexer keys.
    const int64_t ring = (int64_t)DI_DSV4_RING_ROWS(W) * Dh;
    int64_t entry_floats = 0, largest = ring;
    for (int il = 0; il < L; il++) {
        const di_dsv4_layer_w *lw = &m->layers[il];
        if (lw->ratio <= 0) continue;
        kv->page_off_cmp[il] = entry_floats;
        entry_floats += (int64_t)(B / lw->ratio) * lw->cmp.d;
        int64_t buf = (int64_t)di_dsv4_cmp_rows(&lw->cmp) * lw->cmp.c * lw->cmp.d;
        if (buf > largest) largest = buf;
        if (lw->ratio == 4) {
            kv->page_off_idx[il] = entry_floats;
            entry_floats += (int64_t)(B / 4) * lw->idx_cmp.d;
            int64_t ib = (int64_t)di_dsv4_cmp_rows(&lw->idx_cmp) * lw->idx_cmp.c * lw->idx_cmp.d;
            if (ib > largest) largest = ib;
        }
    }
    kv->block_floats = ((entry_floats > largest ? entry_floats : largest) + 15) & ~(int64_t)15;
    kv->entry_floats = entry_floats;
    // Tail: window rings and compressor token rings (the partial window, the CSA overlap and
    // DI_DSV4_ROLLBACK_MAX rows for rollback: dsv4.h).
    packer pk = {.block_floats = kv->block_floats};
    for (int il = 0; il < L; il++) {
        const di_dsv4_layer_w *lw = &m->layers[il];
        kv->ring[il] = place(&pk, ring);
        if (lw->ratio <= 0) continue;
        int64_t buf = (int64_t)di_dsv4_cmp_rows(&lw->cmp) * lw->cmp.c * lw->cmp.d;
        kv->buf_c[il] = place(&pk, buf);
        kv->buf_z[il] = place(&pk, buf);
        if (lw->ratio == 4) {
            int64_t ib = (int64_t)di_dsv4_cmp_rows(&lw->idx_cmp) * lw->idx_cmp.c * DI;
            kv->ibuf_c[il] = place(&pk, ib);
            kv->ibuf_z[il] = place(&pk, ib);
        }
    }
    kv->n_tail = pk.n_blk;
    kv->max_blocks = (max_ctx + B - 1) / B;
    size_t block_bytes = sizeof(float) * (size_t)kv->block_floats;
    int64_t n_blocks = (int64_t)(kv_bytes / block_bytes);
    if (n_blocks < di_kv_blocks_for(kv, max_ctx)) {
        DI_LOG_ERROR("kv: %zu bytes hold %lld blocks of %zu bytes; one sequence of %d positions "
                     "needs %d",
                     kv_bytes, (long long)n_blocks, block_bytes, max_ctx,
                     di_kv_blocks_for(kv, max_ctx));
        st = DI_ERR_INVALID;
        goto fail;
    }
    if (n_blocks > INT32_MAX / 2) n_blocks = INT32_MAX / 2;
    DI_TRY(di_block_pool_create((int32_t)n_blocks, block_bytes, &kv->pool));
    if (prefix_cache) DI_TRY(di_prefix_cache_create(kv->pool, B, model_id(m), &kv->cache));
    DI_TRY(alloc_seqs(kv));
    DI_LOG_INFO("kv: %d blocks of %zu KiB (%d positions each), %d tail blocks per sequence, "
                "replay bound %d tokens",
                (int)n_blocks, block_bytes / 1024, B, kv->n_tail, kv->replay_tokens);
    *out = kv;
    return DI_OK;
fail:
    di_kv_manager_destroy(kv);
    return st;
}

// ---- disk prefetch: state ----

// One prefetch (kv_manager.h, di_kv_prefetch): kv->pf[0, n_pf). Arrays sized at open_disk for
// max_blocks.
struct di_kv_prefetch {
    di_kv_disk_read_job job; // the read thread's while in flight
    bool active;             // ids[0, n) are held (in flight, or done and not yet taken)
    bool collected;          // done, and its read blocks are in the prefix cache
    uint64_t req_id, salt;
    int32_t n;         // chain blocks held, from block 0 of the prompt
    int32_t *ids;      // owned [max_blocks]: held block ids (referenced)
    uint64_t *hash;    // owned [max_blocks]: their chain hashes
    int32_t *tokens;   // owned [max_blocks * block_tokens]: a copy (the request may go first)
    float **dst;       // owned [max_blocks]: where the blocks to read go, NULL: in memory
    uint8_t *snap;     // owned [snap_bytes] (with tail snapshots): the staged snapshot
    size_t snap_bytes; // 0 without tail snapshots
    size_t budget_bytes;
    // Device blocks: the records are read into this host staging (the blocks are uploaded from
    // it by a device transfer batch), and it is not reused until that batch ended.
    uint8_t *stage; // owned [stage_blocks * bio.block_bytes]
    int32_t stage_blocks;
    bool uploading; // its uploads are recorded in batch up_batch, which has not ended
    int32_t up_batch;
};
typedef struct di_kv_prefetch prefetch;

static void prefetches_free(di_kv_manager *kv) {
    for (int32_t i = 0; kv->pf && i < kv->n_pf; i++) {
        prefetch *pf = &kv->pf[i];
        di_free(pf->ids);
        di_free(pf->hash);
        di_free(pf->tokens);
        di_free(pf->dst);
        di_free(pf->snap);
        di_free(pf->stage);
    }
    di_free(kv->pf);
    kv->pf = NULL;
    kv->n_pf = 0;
}

// ---- device transfers: state (kv_manager.h, "device transfers") ----

typedef struct dev_op {
    int32_t id;   // the device block
    bool up;      // an upload from src, else a download (write-back) of the record below
    bool failed;  // an upload that failed (set by the thread that runs the batch)
    int32_t snap; // a download's tail snapshot: its staging slot (-1: none)
    const void *src;
    uint64_t h, parent, salt;
} dev_op;

struct di_kv_dev_batch {
    dev_op *ops;     // owned [cap], in recorded order
    int32_t *tokens; // owned [cap * block_tokens]: op i's record tokens
    uint8_t *snaps;  // owned [cap_snap * snap_bytes] (with tail snapshots)
    int32_t n, cap, n_snap, cap_snap;
    size_t snap_bytes;
    // Written by the thread that runs the batch, summed up by di_kv_dev_end.
    int64_t n_down, n_up, n_lost;
};
typedef struct di_kv_dev_batch dev_batch;

static void dev_free(di_kv_manager *kv) {
    for (int32_t i = 0; kv->dev && i < 2; i++) {
        di_free(kv->dev[i].ops);
        di_free(kv->dev[i].tokens);
        di_free(kv->dev[i].snaps);
    }
    di_free(kv->dev);
    kv->dev = NULL;
    di_free(kv->dev_buf);
    kv->dev_buf = NULL;
}

void di_kv_manager_destroy(di_kv_manager *kv) {
    if (!kv) return;
    if (kv->seqs) {
        for (int32_t i = 0; i < kv->max_seqs; i++) {
            di_free(kv->seqs[i].tail);
            di_free(kv->seqs[i].blocks);
            di_free(kv->seqs[i].pages);
            di_free(kv->seqs[i].layers);
        }
    }
    di_free(kv->seqs);
    // Writes what is queued (the store outlives it) and stops the read jobs before the pool their
    // blocks belong to goes.
    di_kv_disk_io_destroy(kv->disk_io);
    prefetches_free(kv);
    dev_free(kv);
    di_kv_disk_destroy(kv->disk);
    di_prefix_cache_destroy(kv->cache);
    di_tail_cache_destroy(kv->tails);
    di_block_pool_destroy(kv->pool);
    di_free(kv->page_off_cmp);
    di_free(kv->page_off_idx);
    di_kv_item *items[] = {kv->ring, kv->buf_c, kv->buf_z, kv->ibuf_c, kv->ibuf_z};
    for (size_t i = 0; i < sizeof items / sizeof items[0]; i++) di_free(items[i]);
    di_free(kv);
}

// ---- disk tier ----

// The block records' layout (disk tier and KV transfer): the entry part of an entry block. V4.1's
// device blocks hold the CPU forward's pages byte for byte (model/dsv41_dev.h), but a record also
// carries its tail snapshot, which is each forward's own format: V4.1 device records carry
// DI_KV_TRANSFER_PRECISION_DEVICE on disk too, so that neither forward's disk tier takes the
// other's records (another precision: another model's). A KV transfer between them is taken
// without its snapshot (di_kv_manager_import).
static di_kv_disk_layout record_layout(const di_kv_manager *kv) {
    uint32_t precision = (uint32_t)kv->model->opt.precision;
    if (kv->model->hp.v41 && kv->bio.read) precision |= DI_KV_TRANSFER_PRECISION_DEVICE;
    return (di_kv_disk_layout){.model_id = model_id(kv->model),
                               .precision = precision,
                               .block_tokens = kv->block_tokens,
                               .block_floats = kv->block_floats,
                               .payload_floats = kv->entry_floats};
}

// Queues cached block id for the disk tier's IO thread (a copy), with its tail snapshot if it
// has one; without wait, dropped (counted) when the staging is full.
// Device blocks: downloaded into dev_buf first (no forward call in flight: the flush).
static di_status write_back(di_kv_manager *kv, uint64_t h, uint64_t parent, uint64_t salt,
                            const int32_t *tokens, int32_t id, bool wait) {
    const uint8_t *snap =
        kv->tails && di_tail_cache_has(kv->tails, id) ? di_tail_cache_get(kv->tails, id) : NULL;
    const float *payload = di_block_pool_ptr(kv->pool, id);
    if (kv->bio.read) {
        di_status st = kv->bio.read(kv->bio.user, id, kv->dev_buf);
        if (st != DI_OK) return st;
        payload = (const float *)kv->dev_buf;
    }
    return di_kv_disk_io_put(kv->disk_io, h, parent, salt, tokens, payload, snap,
                             snap ? di_tail_cache_snap_bytes(kv->tails) : 0, wait);
}

// Device blocks: the eviction's download is recorded for the next batch (kv_manager.h, "device
// transfers"), with a copy of the record's identity, tokens and tail snapshot (dropped with the
// block right after); no room: the record is lost (counted).
static void dev_spill(di_kv_manager *kv, uint64_t h, uint64_t parent, uint64_t salt,
                      const int32_t *tokens, int32_t id) {
    dev_batch *b = &kv->dev[kv->dev_cur];
    if (b->n == b->cap) {
        kv->n_dev_lost++;
        return;
    }
    dev_op *op = &b->ops[b->n];
    *op = (dev_op){.id = id, .snap = -1, .h = h, .parent = parent, .salt = salt};
    memcpy(b->tokens + (int64_t)b->n * kv->block_tokens, tokens,
           sizeof(int32_t) * (size_t)kv->block_tokens);
    if (kv->tails && di_tail_cache_has(kv->tails, id) && b->n_snap < b->cap_snap) {
        op->snap = b->n_snap++;
        memcpy(b->snaps + (size_t)op->snap * b->snap_bytes, di_tail_cache_get(kv->tails, id),
               b->snap_bytes);
    }
    b->n++;
}

// The prefix cache evicts a cached block (its memory is reused right after): queue a copy (before
// its snapshot is dropped with it). Eviction never waits for the disk: a full queue drops it.
static void spill(void *user, uint64_t h, uint64_t parent, uint64_t salt, const int32_t *tokens,
                  int32_t id) {
    di_kv_manager *kv = user;
    if (kv->bio.read)
        dev_spill(kv, h, parent, salt, tokens, id);
    else
        (void)write_back(kv, h, parent, salt, tokens, id, false);
}

// The prefetches' snapshot staging, and the device transfer batches' (disk tier and tail
// snapshots both open; once). A batch stages the snapshots of the evictions recorded in it: at most
// every snapshot held when it starts and those taken while it is recorded (a step's sequences).
static di_status prefetch_stage(di_kv_manager *kv) {
    for (int32_t i = 0; i < kv->n_pf; i++) {
        prefetch *pf = &kv->pf[i];
        pf->snap_bytes = di_tail_cache_snap_bytes(kv->tails);
        // calloc: its pages cost memory once a snapshot is first read back into it.
        pf->snap = di_calloc(pf->snap_bytes, 1);
        if (!pf->snap) return DI_ERR_NOMEM;
    }
    for (int32_t i = 0; kv->dev && i < 2; i++) {
        dev_batch *b = &kv->dev[i];
        b->snap_bytes = di_tail_cache_snap_bytes(kv->tails);
        b->cap_snap = di_tail_cache_n_slots(kv->tails) + kv->max_seqs;
        if (b->cap_snap > b->cap) b->cap_snap = b->cap;
        b->snaps = di_calloc((size_t)b->cap_snap, b->snap_bytes); // touched as used
        if (!b->snaps) return DI_ERR_NOMEM;
    }
    return DI_OK;
}

di_status di_kv_manager_set_block_io(di_kv_manager *kv, const di_kv_block_io *bio) {
    if (!kv->accounting || kv->entry_floats != 0 || kv->disk || !bio->read || !bio->write ||
        bio->block_bytes == 0 || bio->block_bytes % sizeof(float) != 0) {
        DI_LOG_ERROR("kv: block I/O of %zu bytes per block: only for the accounting manager of "
                     "the device-resident forward, once, before its disk tier, a multiple of 4 "
                     "bytes",
                     bio->block_bytes);
        return DI_ERR_INVALID;
    }
    kv->bio = *bio;
    // A record (disk tier, KV transfer) holds a block's contents as the block I/O gives them.
    kv->entry_floats = (int64_t)(bio->block_bytes / sizeof(float));
    return DI_OK;
}

// Device blocks: the transfer batches (open_disk). A batch records at most every block of the
// pool once as an eviction (a block is evicted again only after it was cached again, and within
// a batch only a prefetch caches blocks) plus, per prefetch, its blocks' uploads and their
// evictions (a prefetch uploads once per batch: its staging is busy until the batch ended).
static di_status dev_open(di_kv_manager *kv) {
    kv->dev = di_calloc(2, sizeof *kv->dev);
    kv->dev_buf = di_malloc(kv->bio.block_bytes);
    if (!kv->dev || !kv->dev_buf) return DI_ERR_NOMEM;
    const int64_t cap =
        di_block_pool_n_total(kv->pool) + 2 * (int64_t)kv->n_pf * (int64_t)kv->max_blocks;
    if (cap > INT32_MAX / 2) return DI_ERR_NOMEM;
    for (int32_t i = 0; i < 2; i++) {
        dev_batch *b = &kv->dev[i];
        b->cap = (int32_t)cap;
        b->ops = di_malloc(sizeof *b->ops * (size_t)cap);
        b->tokens = di_malloc(sizeof(int32_t) * (size_t)cap * (size_t)kv->block_tokens);
        if (!b->ops || !b->tokens) return DI_ERR_NOMEM;
    }
    // Each prefetch's staging: as many records as its budget holds, a sequence's at most
    // (calloc: touched as records are read).
    const size_t bb = kv->bio.block_bytes;
    for (int32_t i = 0; i < kv->n_pf; i++) {
        prefetch *pf = &kv->pf[i];
        size_t n = pf->budget_bytes / bb;
        if (n > (size_t)kv->max_blocks) n = (size_t)kv->max_blocks;
        if (n < 1) n = 1;
        pf->stage_blocks = (int32_t)n;
        pf->stage = di_calloc(n, bb);
        if (!pf->stage) return DI_ERR_NOMEM;
    }
    return DI_OK;
}

di_status di_kv_manager_open_disk(di_kv_manager *kv, const di_kv_disk_options *o) {
    if (kv->entry_floats == 0 && !kv->bio.read) { // an accounting manager, nothing to reach
        DI_LOG_ERROR("kv: the disk tier (--kv-disk-dir) needs the blocks' contents: this "
                     "accounting manager has no block I/O");
        return DI_ERR_UNSUPPORTED;
    }
    if (!kv->cache) {
        DI_LOG_ERROR("kv: the disk tier (--kv-disk-dir) extends the prefix cache, which is off");
        return DI_ERR_INVALID;
    }
    DI_ASSERT(!kv->disk && kv->entry_floats > 0);
    const int32_t n_pf = o->prefetches ? o->prefetches : DI_KV_DISK_PREFETCHES_DEFAULT;
    if (n_pf < 1 || n_pf > DI_KV_DISK_IO_MAX_READS) {
        DI_LOG_ERROR("kv disk: %d concurrent prefetches (--kv-disk-prefetches): 1 to %d", (int)n_pf,
                     (int)DI_KV_DISK_IO_MAX_READS);
        return DI_ERR_INVALID;
    }
    const di_kv_disk_layout l = record_layout(kv);
    di_status st = di_kv_disk_create(o, &l, &kv->disk);
    if (st != DI_OK) return st;
    st = di_kv_disk_io_create(kv->disk, o->queue_bytes, &kv->disk_io);
    if (st != DI_OK) {
        di_kv_disk_destroy(kv->disk);
        kv->disk = NULL;
        return st;
    }
    di_prefix_cache_set_spill(kv->cache, spill, kv);
    kv->pf = di_calloc((size_t)n_pf, sizeof *kv->pf);
    bool ok = kv->pf != NULL;
    const size_t nb = (size_t)kv->max_blocks;
    const size_t budget = o->read_bytes ? o->read_bytes : DI_KV_DISK_READ_BYTES_DEFAULT;
    for (int32_t i = 0; ok && i < n_pf; i++) {
        prefetch *pf = &kv->pf[i];
        kv->n_pf = i + 1;
        pf->budget_bytes = budget;
        pf->ids = di_malloc(sizeof(int32_t) * nb);
        pf->hash = di_malloc(sizeof(uint64_t) * nb);
        pf->tokens = di_malloc(sizeof(int32_t) * nb * (size_t)kv->block_tokens);
        pf->dst = di_calloc(nb, sizeof(float *));
        ok = pf->ids && pf->hash && pf->tokens && pf->dst;
    }
    if (ok && kv->bio.read) ok = dev_open(kv) == DI_OK;
    if (!ok || (kv->tails && prefetch_stage(kv) != DI_OK)) {
        di_kv_disk_io_destroy(kv->disk_io);
        kv->disk_io = NULL;
        prefetches_free(kv);
        dev_free(kv);
        di_kv_disk_destroy(kv->disk);
        kv->disk = NULL;
        return DI_ERR_NOMEM;
    }
    DI_LOG_INFO("kv disk: admission reads go through the read thread, %d prefetches at once, "
                "%.1f MiB of pool blocks at most per prefetch%s",
                (int)n_pf, (double)budget / (1 << 20),
                kv->bio.read ? "; device blocks: written back and read in around the forward calls"
                             : "");
    return DI_OK;
}

// Flush: queues a block not yet on disk nor queued, or whose record lacks the snapshot it has
// now (waiting for room: nothing is dropped); true if it was queued.
static bool flush_one(void *user, uint64_t h, uint64_t parent, uint64_t salt, const int32_t *tokens,
                      int32_t id) {
    di_kv_manager *kv = user;
    const bool snap = kv->tails && di_tail_cache_has(kv->tails, id);
    size_t queued_snap = 0;
    if (di_kv_disk_io_find(kv->disk_io, h, &queued_snap) && (!snap || queued_snap > 0))
        return false;
    if (di_kv_disk_has(kv->disk, h) && (!snap || di_kv_disk_snap_bytes(kv->disk, h) > 0))
        return false;
    return write_back(kv, h, parent, salt, tokens, id, true) == DI_OK;
}

int32_t di_kv_manager_flush_disk(di_kv_manager *kv) {
    if (!kv->disk) return 0;
    // Device blocks: the evictions recorded since the last forward call first (their blocks
    // still hold what was evicted), and the uploads (a cached block read in below must be there).
    if (kv->dev) (void)di_kv_dev_sync(kv);
    // Most recent first, at most what the budget holds: a pool larger than the budget does not
    // write blocks that would only evict each other.
    const int32_t n =
        di_prefix_cache_offer_recent(kv->cache, flush_one, kv, di_kv_disk_capacity(kv->disk));
    di_kv_disk_io_drain(kv->disk_io); // evicted blocks queued earlier too: a restart finds all
    return n;
}

// ---- tail snapshots ----

// A block leaves the prefix cache: its snapshot goes with it.
static void forget_tail(void *user, int32_t id) {
    di_tail_cache_drop(user, id);
}

di_status di_kv_manager_open_tails(di_kv_manager *kv, size_t snap_bytes, size_t budget_bytes) {
    DI_ASSERT(!kv->tails);
    if (!kv->cache) {
        DI_LOG_ERROR("kv: tail snapshots attach to prefix-cache blocks; the prefix cache is off");
        return DI_ERR_INVALID;
    }
    if (budget_bytes < snap_bytes) {
        DI_LOG_ERROR("kv: a tail-snapshot budget of %zu bytes holds no snapshot of %zu bytes",
                     budget_bytes, snap_bytes);
        return DI_ERR_INVALID;
    }
    di_status st =
        di_tail_cache_create(di_block_pool_n_total(kv->pool), snap_bytes, budget_bytes, &kv->tails);
    if (st != DI_OK) return st;
    di_prefix_cache_set_forget(kv->cache, forget_tail, kv->tails);
    if (kv->pf && prefetch_stage(kv) != DI_OK) return DI_ERR_NOMEM; // the tail cache stays
    DI_LOG_INFO("kv: tail snapshots of %.1f KiB, %d at most (%.1f MiB budget)",
                (double)snap_bytes / 1024, (int)di_tail_cache_n_slots(kv->tails),
                (double)budget_bytes / (1 << 20));
    return DI_OK;
}

uint8_t *di_kv_tail_put(di_kv_manager *kv, int32_t slot, int32_t h) {
    const di_kv_seq *s = &kv->seqs[slot];
    if (!kv->tails || h <= 0 || h % kv->block_tokens != 0) return NULL;
    const int32_t b = h / kv->block_tokens - 1;
    const int32_t id = b < s->n_published ? s->blocks[b] : -1;
    // The same chain's tail is already kept (an identical prompt ran before or beside this one).
    if (!di_prefix_cache_holds(kv->cache, id) || di_tail_cache_has(kv->tails, id)) return NULL;
    return di_tail_cache_put(kv->tails, id);
}

const uint8_t *di_kv_tail_best(di_kv_manager *kv, int32_t slot, int32_t hit, int32_t *s) {
    const di_kv_seq *q = &kv->seqs[slot];
    if (!kv->tails) return NULL;
    const int32_t B = kv->block_tokens;
    for (int32_t b = hit / B - 1; b >= 0 && hit - (b + 1) * B < kv->replay_tokens; b--) {
        if (!di_tail_cache_has(kv->tails, q->blocks[b])) continue;
        *s = (b + 1) * B;
        return di_tail_cache_get(kv->tails, q->blocks[b]);
    }
    return NULL;
}

void di_kv_manager_probe(di_kv_manager *kv, const int32_t *tokens, int32_t n_tokens, uint64_t salt,
                         int32_t *n_memory, int32_t *n_disk) {
    *n_memory = *n_disk = 0;
    if (!kv->cache || n_tokens < kv->block_tokens) return;
    const int32_t B = kv->block_tokens, n_max = n_tokens / B;
    uint64_t h = 0;
    for (int32_t n = 0; n < n_max; n++) {
        const int32_t *t = tokens + (int64_t)n * B;
        const uint64_t hn = di_prefix_cache_hash(kv->cache, h, t, salt);
        if (di_prefix_cache_find(kv->cache, hn, h, t) >= 0)
            ++*n_memory;
        else if (kv->disk &&
                 (di_kv_disk_io_find(kv->disk_io, hn, NULL) || di_kv_disk_has(kv->disk, hn)))
            ++*n_disk;
        else
            return;
        h = hn;
    }
}

// ---- KV transfer (prefill/decode disaggregation) ----

// Why the manager cannot export or import blocks (NULL: it can).
static const char *transfer_refusal(const di_kv_manager *kv) {
    if (kv->entry_floats == 0)
        return "KV transfer needs the blocks' contents: this accounting manager has no block I/O";
    if (!kv->cache) return "KV transfer goes through the prefix cache, which is off";
    return NULL;
}

// The transfer's identity and layout: the records' (record_layout) with block_floats the payload's
// (the pool's block size is no part of a record's contents: a CPU pool block also holds tail
// items), and on device blocks the precision carries DI_KV_TRANSFER_PRECISION_DEVICE: their tail
// snapshot is the device tail, which the CPU forward does not read, and the other way round.
// device: the layout of that forward (the other one's, to read its transfer).
static di_kv_disk_layout transfer_layout(const di_kv_manager *kv, bool device) {
    di_kv_disk_layout l = record_layout(kv);
    l.block_floats = l.payload_floats;
    if (device) l.precision |= DI_KV_TRANSFER_PRECISION_DEVICE;
    return l;
}

di_status di_kv_manager_export(di_kv_manager *kv, const int32_t *tokens, int32_t n_tokens,
                               uint64_t salt, void **out, size_t *n_out, int32_t *n_blocks,
                               char *err, size_t cap) {
    const char *no = transfer_refusal(kv);
    if (no) {
        snprintf(err, cap, "%s", no);
        return DI_ERR_UNSUPPORTED;
    }
    if (n_tokens < 0 || n_tokens > kv->max_ctx) {
        snprintf(err, cap, "%d tokens: out of the context (0 to %d)", (int)n_tokens,
                 (int)kv->max_ctx);
        return DI_ERR_INVALID;
    }
    // Device blocks: a block a prefetch read is uploaded by the recorded batch, which must run
    // before the block is read here (no forward call in flight: the caller's rule).
    if (kv->dev) (void)di_kv_dev_sync(kv);
    const int32_t B = kv->block_tokens, n_max = n_tokens / B;
    const di_kv_disk_layout l = transfer_layout(kv, kv->bio.read != NULL);
    int32_t *ids = di_malloc(sizeof(int32_t) * (size_t)(n_max > 0 ? n_max : 1));
    // Device blocks: each block is downloaded into this staging, then serialised.
    void *stage = kv->bio.read ? di_malloc(kv->bio.block_bytes) : NULL;
    if (!ids || (kv->bio.read && !stage)) {
        di_free(ids);
        di_free(stage);
        return DI_ERR_NOMEM;
    }
    const int32_t n = di_prefix_cache_match(kv->cache, tokens, n_max, salt, ids);
    // The tail snapshot of the deepest block of the chain that has one goes along.
    int32_t sb = n - 1;
    while (kv->tails && sb >= 0 && !di_tail_cache_has(kv->tails, ids[sb])) sb--;
    const uint8_t *snap = kv->tails && sb >= 0 ? di_tail_cache_get(kv->tails, ids[sb]) : NULL;
    const size_t snap_bytes = snap ? di_tail_cache_snap_bytes(kv->tails) : 0;
    unsigned char *buf = di_malloc(di_kv_transfer_bytes(&l, n, snap_bytes));
    if (!buf) {
        di_free(ids);
        di_free(stage);
        return DI_ERR_NOMEM;
    }
    di_kv_transfer_put_header(&l, n, snap, snap_bytes, snap ? sb : -1, buf);
    di_status st = DI_OK;
    uint64_t h = 0;
    for (int32_t i = 0; i < n && st == DI_OK; i++) {
        const int32_t *t = tokens + (int64_t)i * B;
        const uint64_t hn = di_prefix_cache_hash(kv->cache, h, t, salt);
        const float *payload = di_block_pool_ptr(kv->pool, ids[i]);
        if (kv->bio.read) {
            st = kv->bio.read(kv->bio.user, ids[i], stage);
            if (st != DI_OK)
                snprintf(err, cap, "downloading block %d of %d from the device failed (%s)", (int)i,
                         (int)n, di_status_str(st));
            payload = stage;
        }
        if (st == DI_OK)
            di_kv_disk_record_put(&l, hn, h, salt, t, payload,
                                  buf + di_kv_transfer_record_offset(&l, i));
        h = hn;
    }
    di_free(ids);
    di_free(stage);
    if (st != DI_OK) {
        di_free(buf);
        return st;
    }
    *out = buf;
    *n_out = di_kv_transfer_bytes(&l, n, snap_bytes);
    *n_blocks = n;
    return DI_OK;
}

di_status di_kv_manager_import(di_kv_manager *kv, const void *buf, size_t n, int32_t *n_inserted,
                               int32_t *n_present, char *err, size_t cap) {
    *n_inserted = *n_present = 0;
    const char *no = transfer_refusal(kv);
    if (no) {
        snprintf(err, cap, "%s", no);
        return DI_ERR_UNSUPPORTED;
    }
    di_kv_disk_layout l = transfer_layout(kv, kv->bio.read != NULL);
    di_kv_transfer t;
    const size_t snap_bytes = kv->tails ? di_tail_cache_snap_bytes(kv->tails) : 0;
    di_kv_disk_check e = di_kv_transfer_check(&l, snap_bytes, buf, n, kv->max_blocks, &t, err, cap);
    if (e == DI_KV_DISK_CHECK_OTHER_MODEL) {
        // The same checkpoint and precision on the other forward (CPU / device-resident): its
        // records hold the same entry bytes when the layouts agree (V4's FP32 recipe: the device
        // stores FP32 rows as the CPU pool does; V4.1 in both recipes: the device blocks are the
        // CPU forward's packed pages), so they are taken; its tail snapshot is the other forward's
        // format and is left out (a hit then runs the bounded replay). Other layouts (V4's
        // official recipe, FP8 device rows) are refused as another model's.
        di_kv_disk_layout other = transfer_layout(kv, kv->bio.read == NULL);
        if (kv->model->hp.v41) // record_layout's device flag, as the other forward writes it
            other.precision = (uint32_t)kv->model->opt.precision |
                              (kv->bio.read ? 0u : DI_KV_TRANSFER_PRECISION_DEVICE);
        char why[256];
        const di_kv_disk_check eo =
            di_kv_transfer_check(&other, 0, buf, n, kv->max_blocks, &t, why, sizeof why);
        if (eo == DI_KV_DISK_CHECK_OK) {
            l = other;
            e = eo;
        } else if (eo != DI_KV_DISK_CHECK_OTHER_MODEL) {
            snprintf(err, cap,
                     "the transfer was made by a replica on the %s forward and this one runs the "
                     "%s forward, whose blocks have another layout (%s): such replicas do not "
                     "exchange KV transfers",
                     kv->bio.read ? "CPU" : "device-resident",
                     kv->bio.read ? "device-resident" : "CPU", why);
        }
    }
    if (e != DI_KV_DISK_CHECK_OK)
        return e == DI_KV_DISK_CHECK_OTHER_MODEL ? DI_ERR_INVALID : DI_ERR_FORMAT;
    const int32_t B = kv->block_tokens;
    const size_t nb = (size_t)(t.n_blocks > 0 ? t.n_blocks : 1);
    int32_t *tok = di_malloc(sizeof(int32_t) * (size_t)B * nb);
    int32_t *ids = di_malloc(sizeof(int32_t) * nb);
    bool *fresh = di_malloc(sizeof(bool) * nb);
    if (!tok || !ids || !fresh) {
        di_free(tok);
        di_free(ids);
        di_free(fresh);
        return DI_ERR_NOMEM;
    }
    // Every hash must be its tokens' chain hash under this engine's hash (the links were checked):
    // verified for the whole transfer before any block is taken, so a bad one inserts nothing.
    di_status st = DI_OK;
    uint64_t h = 0;
    for (int32_t i = 0; i < t.n_blocks && st == DI_OK; i++) {
        di_kv_disk_record r;
        di_kv_transfer_record(&l, &t, i, &r);
        memcpy(tok + (int64_t)i * B, r.tokens, sizeof(int32_t) * (size_t)B);
        h = di_prefix_cache_hash(kv->cache, h, tok + (int64_t)i * B, t.salt);
        if (h != r.hash) {
            snprintf(err, cap,
                     "block record %d of %d: its hash is not the chain hash of its "
                     "tokens",
                     (int)i, (int)t.n_blocks);
            st = DI_ERR_FORMAT;
        }
    }
    // Then the chain's blocks are taken: those already cached are kept, fresh ones allocated for
    // the others. Each is referenced until the end, so taking a block never evicts one of this
    // chain; the chain stops early when the pool has no block left (the rest is recomputed).
    int32_t n_held = 0;
    h = 0;
    for (int32_t i = 0; i < t.n_blocks && st == DI_OK; i++) {
        di_kv_disk_record r;
        di_kv_transfer_record(&l, &t, i, &r);
        int32_t id = di_prefix_cache_find(kv->cache, r.hash, h, tok + (int64_t)i * B);
        fresh[i] = id < 0;
        if (id >= 0)
            di_block_pool_ref(kv->pool, id);
        else if (di_block_pool_alloc(kv->pool, &id) != DI_OK)
            break;
        ids[n_held++] = id;
        h = r.hash;
    }
    // Device blocks: a fresh block may have been evicted just now, its download (the disk tier's
    // write-back) recorded for the next batch: the batch runs first, so that it downloads what
    // was evicted, not what is written below (no forward call in flight: the caller's rule).
    if (st == DI_OK && kv->dev) (void)di_kv_dev_sync(kv);
    // Then the fresh blocks are filled and go into the cache, in chain order; a block whose
    // device write fails is not inserted and the chain stops there (the blocks before it stay).
    h = 0;
    int32_t n_ok = 0;
    for (int32_t i = 0; i < n_held && st == DI_OK; i++, n_ok++) {
        di_kv_disk_record r;
        di_kv_transfer_record(&l, &t, i, &r);
        if (fresh[i]) {
            if (kv->bio.write) {
                st = kv->bio.write(kv->bio.user, ids[i], r.payload);
                if (st != DI_OK) {
                    snprintf(err, cap,
                             "writing block %d of %d to the device failed (%s); the %d before it "
                             "were imported",
                             (int)i, (int)t.n_blocks, di_status_str(st), (int)i);
                    break;
                }
            } else {
                memcpy(di_block_pool_ptr(kv->pool, ids[i]), r.payload,
                       sizeof(float) * (size_t)kv->entry_floats);
            }
            const bool ins =
                di_prefix_cache_insert(kv->cache, r.hash, h, t.salt, tok + (int64_t)i * B, ids[i]);
            DI_ASSERT(ins); // find() missed it, and only this loop inserts
            (*n_inserted)++;
        } else {
            (*n_present)++;
        }
        h = r.hash;
    }
    // The snapshot goes with its block (unless that block already has one, or the chain stopped
    // before it).
    if (st == DI_OK && t.snap && t.snap_block < n_ok &&
        !di_tail_cache_has(kv->tails, ids[t.snap_block]))
        memcpy(di_tail_cache_put(kv->tails, ids[t.snap_block]), t.snap, t.snap_bytes);
    // Idle and cached; a fresh block never inserted (after a failed write) returns to the pool.
    for (int32_t i = 0; i < n_held; i++) di_block_pool_unref(kv->pool, ids[i]);
    di_free(tok);
    di_free(ids);
    di_free(fresh);
    return st;
}

int32_t di_kv_blocks_for(const di_kv_manager *kv, int32_t n_positions) {
    return kv->n_tail + (n_positions + kv->block_tokens - 1) / kv->block_tokens;
}

// ---- disk prefetch ----

static int64_t mono_us(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000 + ts.tv_nsec / 1000;
}

// The done job's read blocks go into the prefix cache (a block another sequence cached meanwhile
// is used instead of the copy), its snapshot into the tail cache; the chain is cut to the blocks
// read or held (a failed read leaves the rest to compute). Once per job.
static void prefetch_collect(di_kv_manager *kv, prefetch *pf) {
    if (pf->collected) return;
    const di_kv_disk_read_job *j = &pf->job;
    const int32_t B = kv->block_tokens;
    int32_t n_ok = j->n_ok;
    // Device blocks: each read block is uploaded by the next transfer batch; the chain stops
    // where the batch has no room (not reached: dev_open's bound).
    if (pf->stage) {
        dev_batch *b = &kv->dev[kv->dev_cur];
        int32_t room = b->cap - b->n;
        for (int32_t i = 0; i < n_ok; i++)
            if (pf->dst[i] && room-- <= 0) n_ok = i;
    }
    for (int32_t i = n_ok; i < pf->n; i++) di_block_pool_unref(kv->pool, pf->ids[i]);
    pf->n = n_ok;
    for (int32_t i = 0; i < pf->n; i++) {
        if (!pf->dst[i]) continue;
        const uint64_t parent = i > 0 ? pf->hash[i - 1] : 0;
        const int32_t *t = pf->tokens + (int64_t)i * B;
        if (!di_prefix_cache_insert(kv->cache, pf->hash[i], parent, pf->salt, t, pf->ids[i])) {
            const int32_t other = di_prefix_cache_find(kv->cache, pf->hash[i], parent, t);
            DI_ASSERT(other >= 0);
            di_block_pool_ref(kv->pool, other);
            di_block_pool_unref(kv->pool, pf->ids[i]); // never cached: free again
            pf->ids[i] = other;
            pf->dst[i] = NULL;
        } else if (pf->stage) {
            dev_batch *b = &kv->dev[kv->dev_cur];
            b->ops[b->n++] = (dev_op){.id = pf->ids[i], .up = true, .snap = -1, .src = pf->dst[i]};
            pf->uploading = true;
            pf->up_batch = kv->dev_cur;
        }
    }
    if (j->snap_ok && j->snap_block < pf->n && pf->dst[j->snap_block] &&
        !di_tail_cache_has(kv->tails, pf->ids[j->snap_block]))
        memcpy(di_tail_cache_put(kv->tails, pf->ids[j->snap_block]), pf->snap, pf->snap_bytes);
    kv->n_prefetch_done++;
    kv->n_prefetch_blocks += j->n_read;
    kv->prefetch_bytes += j->bytes_read;
    kv->prefetch_read_us += j->read_us;
    pf->collected = true;
}

// Collects every prefetch whose job is done: its blocks are in the prefix cache from now on, so
// another request's prompt over the same blocks finds them in memory (they stay held for their
// own request until it is admitted or leaves).
static void prefetch_collect_done(di_kv_manager *kv) {
    for (int32_t i = 0; i < kv->n_pf; i++) {
        prefetch *pf = &kv->pf[i];
        if (pf->active && !pf->collected && di_kv_disk_io_read_done(kv->disk_io, &pf->job))
            prefetch_collect(kv, pf);
    }
}

// Returns every block the prefetch holds (cached ones stay cached, idle) and ends it.
static void prefetch_release(di_kv_manager *kv, prefetch *pf) {
    for (int32_t i = 0; i < pf->n; i++) di_block_pool_unref(kv->pool, pf->ids[i]);
    pf->n = 0;
    pf->active = false;
}

// Request id's prefetch (NULL: none).
static prefetch *prefetch_of(const di_kv_manager *kv, uint64_t id) {
    for (int32_t i = 0; i < kv->n_pf; i++)
        if (kv->pf[i].active && kv->pf[i].req_id == id) return &kv->pf[i];
    return NULL;
}

// Whether a prefetch not yet collected reads the record of chain hash h.
static bool being_read(const di_kv_manager *kv, uint64_t h) {
    for (int32_t i = 0; i < kv->n_pf; i++) {
        const prefetch *pf = &kv->pf[i];
        if (!pf->active || pf->collected) continue;
        for (int32_t k = 0; k < pf->n; k++)
            if (pf->dst[k] && pf->hash[k] == h) return true;
    }
    return false;
}

typedef enum { PF_NOTHING, PF_STARTED, PF_OTHER } pf_start;

// Starts prefetch pf (idle) of the chain of prompt (n_max blocks at most): its blocks in memory
// are referenced, fresh ones reserved for those queued or on disk, up to the budget, and so that
// all prefetches together hold at most half of the pool blocks available to them (the rest is
// room for the running requests; the blocks they reference count, whatever else holds them).
// PF_NOTHING: nothing to read, or no room to while no other prefetch holds blocks; PF_OTHER: the
// chain's next record is being read by another request's prefetch (it is in memory once that
// one is done, and the chain's probe goes on from there), or there is no room while other
// prefetches hold blocks (a request that cannot read its blocks now should not compute them all
// either: the room comes back once their requests are admitted).
static pf_start prefetch_start(di_kv_manager *kv, prefetch *pf, uint64_t id, uint64_t salt,
                               const int32_t *prompt, int32_t n_max) {
    const int32_t B = kv->block_tokens;
    const size_t bb = di_block_pool_block_bytes(kv->pool);
    size_t budget = pf->budget_bytes;
    const bool snap_fits = pf->snap_bytes && budget >= pf->snap_bytes + bb;
    if (snap_fits) budget -= pf->snap_bytes;
    int32_t cap = (int32_t)(budget / bb), held = 0;
    if (pf->stage && cap > pf->stage_blocks) cap = pf->stage_blocks;
    for (int32_t i = 0; i < kv->n_pf; i++) held += kv->pf[i].active ? kv->pf[i].n : 0;
    const int32_t half = (di_block_pool_n_available(kv->pool) + held) / 2 - held;
    if (cap > half) cap = half;
    int32_t n = 0, n_read = 0, snap_block = -1;
    bool other = false;
    uint64_t h = 0;
    while (n < n_max) {
        const int32_t *t = prompt + (int64_t)n * B;
        const uint64_t hn = di_prefix_cache_hash(kv->cache, h, t, salt);
        int32_t bid = di_prefix_cache_find(kv->cache, hn, h, t);
        float *dst = NULL;
        if (bid >= 0) {
            di_block_pool_ref(kv->pool, bid);
        } else {
            size_t qsb = 0;
            const bool queued = di_kv_disk_io_find(kv->disk_io, hn, &qsb);
            if (!queued && !di_kv_disk_has(kv->disk, hn)) break;
            // Never read twice: wait for the other read. No room: wait while another prefetch
            // holds blocks (they are its request's once it is admitted, and the room is
            // measured again), else compute.
            const bool reading = being_read(kv, hn);
            if (reading || n_read >= cap || di_block_pool_alloc(kv->pool, &bid) != DI_OK) {
                other = n_read == 0 && (reading || held > 0);
                break;
            }
            // Device blocks: into the prefetch's staging (uploaded once collected).
            dst = pf->stage ? (float *)(pf->stage + (size_t)n_read * bb)
                            : di_block_pool_ptr(kv->pool, bid);
            const size_t rsb = queued ? qsb : di_kv_disk_snap_bytes(kv->disk, hn);
            if (snap_fits && rsb == pf->snap_bytes) snap_block = n; // the deepest one wins
            n_read++;
        }
        pf->ids[n] = bid;
        pf->hash[n] = hn;
        pf->dst[n] = dst;
        memcpy(pf->tokens + (int64_t)n * B, t, sizeof(int32_t) * (size_t)B);
        n++;
        h = hn;
    }
    if (n_read == 0) { // all in memory (attach finds them), no room to read, or read by another
        for (int32_t i = 0; i < n; i++) di_block_pool_unref(kv->pool, pf->ids[i]);
        return other ? PF_OTHER : PF_NOTHING;
    }
    pf->n = n;
    pf->active = true;
    pf->collected = false;
    pf->req_id = id;
    pf->salt = salt;
    pf->job = (di_kv_disk_read_job){.salt = salt,
                                    .parent0 = 0,
                                    .n = n,
                                    .hash = pf->hash,
                                    .tokens = pf->tokens,
                                    .dst = pf->dst,
                                    .snap_block = snap_block,
                                    .snap = pf->snap,
                                    .snap_bytes = pf->snap_bytes};
    di_status st = di_kv_disk_io_read_submit(kv->disk_io, &pf->job);
    DI_ASSERT(st == DI_OK); // n_pf <= DI_KV_DISK_IO_MAX_READS jobs, each idle when started
    kv->n_prefetch_started++;
    return PF_STARTED;
}

// Whether prompt's chain continues beyond memory with a record queued or on disk (no file read).
static bool on_disk(di_kv_manager *kv, uint64_t salt, const int32_t *prompt, int32_t n_max) {
    const int32_t B = kv->block_tokens;
    uint64_t h = 0;
    for (int32_t n = 0; n < n_max; n++) {
        const int32_t *t = prompt + (int64_t)n * B;
        const uint64_t hn = di_prefix_cache_hash(kv->cache, h, t, salt);
        if (di_prefix_cache_find(kv->cache, hn, h, t) < 0)
            return di_kv_disk_io_find(kv->disk_io, hn, NULL) || di_kv_disk_has(kv->disk, hn);
        h = hn;
    }
    return false;
}

di_kv_prefetch_state di_kv_prefetch(di_kv_manager *kv, uint64_t id, uint64_t salt,
                                    const int32_t *prompt, int32_t n_max_tokens) {
    if (!kv->pf || n_max_tokens < kv->block_tokens) return DI_KV_PREFETCH_READY;
    const int64_t t0 = mono_us();
    prefetch_collect_done(kv);
    di_kv_prefetch_state ps = DI_KV_PREFETCH_READY;
    const int32_t n_max = n_max_tokens / kv->block_tokens;
    prefetch *pf = prefetch_of(kv, id);
    if (pf) {
        if (!pf->collected) ps = DI_KV_PREFETCH_WAIT; // done: attach takes it
    } else if (on_disk(kv, salt, prompt, n_max)) {
        for (int32_t i = 0; i < kv->n_pf && !pf; i++) // its staging free of uploads too
            if (!kv->pf[i].active && !kv->pf[i].uploading) pf = &kv->pf[i];
        // Every prefetch busy: wait for one; else start this one (or wait for the read of its
        // next block by another request's).
        if (!pf || prefetch_start(kv, pf, id, salt, prompt, n_max) != PF_NOTHING)
            ps = DI_KV_PREFETCH_WAIT;
    }
    kv->prefetch_engine_us += mono_us() - t0;
    return ps;
}

int32_t di_kv_prefetch_held(const di_kv_manager *kv, uint64_t id) {
    const prefetch *pf = prefetch_of(kv, id);
    return pf && pf->collected ? pf->n : 0;
}

void di_kv_prefetch_drop(di_kv_manager *kv, uint64_t id) {
    prefetch *pf = prefetch_of(kv, id);
    if (!pf) return;
    const int64_t t0 = mono_us();
    // The read thread writes into the held blocks until the job is done: stop it and wait (one
    // record at most; a queued job leaves the queue at once), then keep what it read (cached,
    // idle) and return the rest.
    di_kv_disk_io_read_abort(kv->disk_io, &pf->job);
    di_kv_disk_io_read_wait(kv->disk_io, &pf->job);
    prefetch_collect(kv, pf);
    prefetch_release(kv, pf);
    kv->prefetch_engine_us += mono_us() - t0;
}

int32_t di_kv_prefetch_yield(di_kv_manager *kv, uint64_t id) {
    int32_t n = 0;
    for (int32_t i = 0; i < kv->n_pf; i++) {
        const prefetch *pf = &kv->pf[i];
        if (!pf->active || pf->req_id == id) continue;
        const int32_t before = di_block_pool_n_available(kv->pool);
        di_kv_prefetch_drop(kv, pf->req_id);
        n += di_block_pool_n_available(kv->pool) - before;
    }
    return n;
}

// ---- device transfers ----

bool di_kv_dev_begin(di_kv_manager *kv) {
    if (!kv->dev || kv->dev[kv->dev_cur].n == 0) return false;
    DI_ASSERT(!kv->dev_handed);
    kv->dev_cur = 1 - kv->dev_cur;
    kv->dev_handed = true;
    return true;
}

di_status di_kv_dev_run(di_kv_manager *kv) {
    if (!kv->dev_handed) return DI_OK;
    dev_batch *b = &kv->dev[1 - kv->dev_cur];
    const int32_t B = kv->block_tokens;
    di_status st = DI_OK;
    for (int32_t i = 0; i < b->n; i++) {
        dev_op *op = &b->ops[i];
        if (op->up) {
            di_status us = kv->bio.write(kv->bio.user, op->id, op->src);
            op->failed = us != DI_OK;
            if (us == DI_OK)
                b->n_up++;
            else if (st == DI_OK)
                st = us;
            continue;
        }
        if (kv->bio.read(kv->bio.user, op->id, kv->dev_buf) != DI_OK) {
            b->n_lost++;
            continue;
        }
        const void *snap = op->snap >= 0 ? b->snaps + (size_t)op->snap * b->snap_bytes : NULL;
        // The queue copies (a full one drops it, counted there: eviction never waits).
        (void)di_kv_disk_io_put(kv->disk_io, op->h, op->parent, op->salt,
                                b->tokens + (int64_t)i * B, (const float *)kv->dev_buf, snap,
                                snap ? b->snap_bytes : 0, false);
        b->n_down++;
    }
    return st;
}

int32_t di_kv_dev_end(di_kv_manager *kv, uint8_t *marks) {
    if (!kv->dev_handed) return 0;
    const int32_t hb = 1 - kv->dev_cur;
    dev_batch *b = &kv->dev[hb];
    int32_t n_bad = 0;
    for (int32_t i = 0; i < b->n; i++) // a block whose upload failed holds no verified record
        if (b->ops[i].up && b->ops[i].failed && di_prefix_cache_remove(kv->cache, b->ops[i].id)) {
            if (marks) marks[b->ops[i].id] = 1;
            n_bad++;
        }
    kv->n_dev_down += b->n_down;
    kv->n_dev_up += b->n_up;
    kv->n_dev_lost += b->n_lost;
    b->n = b->n_snap = 0;
    b->n_down = b->n_up = b->n_lost = 0;
    for (int32_t i = 0; i < kv->n_pf; i++) // their blocks are on the device now
        if (kv->pf[i].uploading && kv->pf[i].up_batch == hb) kv->pf[i].uploading = false;
    kv->dev_handed = false;
    return n_bad;
}

di_status di_kv_dev_sync(di_kv_manager *kv) {
    if (!di_kv_dev_begin(kv)) return DI_OK;
    di_status st = di_kv_dev_run(kv);
    const int32_t n_bad = di_kv_dev_end(kv, NULL);
    if (st != DI_OK)
        DI_LOG_ERROR("kv: uploading blocks read from the disk tier failed (%s): %d left the "
                     "prefix cache",
                     di_status_str(st), (int)n_bad);
    return st;
}

bool di_kv_dev_pending(const di_kv_manager *kv) {
    return kv->dev && kv->dev[kv->dev_cur].n > 0;
}

int32_t di_kv_manager_drop_cached(di_kv_manager *kv) {
    if (!kv->cache) return 0;
    int32_t n = 0;
    const int32_t n_ids = di_block_pool_n_total(kv->pool);
    for (int32_t id = 0; id < n_ids; id++) n += di_prefix_cache_remove(kv->cache, id);
    return n;
}

void di_kv_dev_drop_spills(di_kv_manager *kv) {
    if (!kv->dev) return;
    dev_batch *b = &kv->dev[kv->dev_cur];
    int32_t n = 0;
    for (int32_t i = 0; i < b->n; i++) // the uploads keep their order (tokens: downloads only)
        if (b->ops[i].up) b->ops[n++] = b->ops[i];
    kv->n_dev_lost += b->n - n;
    b->n = n;
    b->n_snap = 0;
}

// ---- sequences ----

static float *at(const di_kv_manager *kv, const di_kv_seq *s, di_kv_item it) {
    return (float *)di_block_pool_ptr(kv->pool, s->tail[it.blk]) + it.off;
}

static void bind_cmp(di_dsv4_cmp_state *cs, const di_dsv4_compressor_w *cw, float *bc, float *bz,
                     float *const *pages, int64_t page_off, int32_t B) {
    memset(cs, 0, sizeof *cs);
    cs->buf_c = bc, cs->buf_z = bz;
    cs->buf_rows = di_dsv4_cmp_rows(cw);
    cs->pages = pages;
    cs->page_off = page_off;
    cs->page_entries = B / cw->m;
}

di_status di_kv_seq_open(di_kv_manager *kv, int32_t slot, uint64_t salt) {
    DI_ASSERT(slot >= 0 && slot < kv->max_seqs && !kv->seqs[slot].open);
    di_kv_seq *s = &kv->seqs[slot];
    for (int32_t i = 0; i < kv->n_tail; i++) {
        if (di_block_pool_alloc(kv->pool, &s->tail[i]) != DI_OK) {
            while (i-- > 0) di_block_pool_unref(kv->pool, s->tail[i]);
            return DI_ERR_NO_KV;
        }
        // Zeroed so that nothing unwritten is ever read as a float (docs/kv-cache.md).
        memset(di_block_pool_ptr(kv->pool, s->tail[i]), 0, di_block_pool_block_bytes(kv->pool));
    }
    s->n_blocks = 0;
    s->open = true;
    s->salt = salt;
    s->last_hash = 0;
    s->n_published = s->n_published_before = 0;
    s->n_cached = 0;
    if (kv->accounting) return DI_OK; // no layer views to bind (accounting or V4.1 pages)
    const di_model *m = kv->model;
    for (int il = 0; il < kv->n_layer; il++) {
        const di_dsv4_layer_w *lw = &m->layers[il];
        di_dsv4_layer_state *ls = &s->layers[il];
        memset(ls, 0, sizeof *ls);
        ls->ring = at(kv, s, kv->ring[il]);
        if (lw->ratio <= 0) continue;
        bind_cmp(&ls->cmp, &lw->cmp, at(kv, s, kv->buf_c[il]), at(kv, s, kv->buf_z[il]), s->pages,
                 kv->page_off_cmp[il], kv->block_tokens);
        if (lw->ratio == 4)
            bind_cmp(&ls->idx, &lw->idx_cmp, at(kv, s, kv->ibuf_c[il]), at(kv, s, kv->ibuf_z[il]),
                     s->pages, kv->page_off_idx[il], kv->block_tokens);
    }
    return DI_OK;
}

void di_kv_seq_close(di_kv_manager *kv, int32_t slot) {
    di_kv_seq *s = &kv->seqs[slot];
    if (!s->open) return;
    for (int32_t i = 0; i < kv->n_tail; i++) di_block_pool_unref(kv->pool, s->tail[i]);
    for (int32_t i = 0; i < s->n_blocks; i++) di_block_pool_unref(kv->pool, s->blocks[i]);
    s->n_blocks = 0;
    s->open = false;
}

static void set_capacity(di_kv_manager *kv, di_kv_seq *s) {
    for (int il = 0; il < kv->n_layer; il++) {
        di_dsv4_layer_state *ls = &s->layers[il];
        if (ls->cmp.pages) ls->cmp.cap_entries = (int64_t)s->n_blocks * ls->cmp.page_entries;
        if (ls->idx.pages) ls->idx.cap_entries = (int64_t)s->n_blocks * ls->idx.page_entries;
    }
}

di_status di_kv_seq_reserve(di_kv_manager *kv, int32_t slot, int32_t end_pos) {
    di_kv_seq *s = &kv->seqs[slot];
    DI_ASSERT(s->open && end_pos <= kv->max_ctx);
    int32_t need = (end_pos + kv->block_tokens - 1) / kv->block_tokens;
    while (s->n_blocks < need) {
        int32_t id;
        if (di_block_pool_alloc(kv->pool, &id) != DI_OK) return DI_ERR_NO_KV;
        s->blocks[s->n_blocks] = id;
        s->pages[s->n_blocks] = di_block_pool_ptr(kv->pool, id);
        s->n_blocks++;
    }
    return DI_OK;
}

void di_kv_seq_commit(di_kv_manager *kv, int32_t slot) {
    set_capacity(kv, &kv->seqs[slot]);
}

di_status di_kv_seq_grow(di_kv_manager *kv, int32_t slot, int32_t end_pos) {
    di_status st = di_kv_seq_reserve(kv, slot, end_pos);
    di_kv_seq_commit(kv, slot);
    return st;
}

int32_t di_kv_seq_attach_prefix(di_kv_manager *kv, int32_t slot, uint64_t id, const int32_t *prompt,
                                int32_t n_max_tokens) {
    di_kv_seq *s = &kv->seqs[slot];
    DI_ASSERT(s->open && s->n_blocks == 0);
    if (!kv->cache || n_max_tokens < kv->block_tokens) return 0;
    const int32_t B = kv->block_tokens, n_max = n_max_tokens / B;
    int32_t n = di_prefix_cache_match(kv->cache, prompt, n_max, s->salt, s->blocks);
    uint64_t h = 0;
    for (int32_t i = 0; i < n; i++) {
        di_block_pool_ref(kv->pool, s->blocks[i]);
        s->pages[i] = di_block_pool_ptr(kv->pool, s->blocks[i]);
        h = di_prefix_cache_hash(kv->cache, h, prompt + (int64_t)i * B, s->salt);
    }
    // The disk tier continues the chain: first with the blocks request id's done prefetch holds
    // (read off this thread; a memory block it held is taken only while still the cached block of
    // its hash: a failed step may have taken it out), then with blocks cached in memory (a later
    // block may have outlived an evicted one). The blocks matched so far are referenced, so
    // nothing here evicts them; nothing here reads a file.
    int32_t n_disk = 0;
    prefetch *pf = kv->pf ? prefetch_of(kv, id) : NULL;
    if (pf && pf->salt == s->salt && di_kv_disk_io_read_done(kv->disk_io, &pf->job)) {
        const int64_t t0 = mono_us();
        prefetch_collect(kv, pf);
        const int32_t n_pf = pf->n < n_max ? pf->n : n_max;
        for (; n < n_pf; n++) {
            const int32_t *t = prompt + (int64_t)n * B;
            if (pf->hash[n] != di_prefix_cache_hash(kv->cache, h, t, s->salt) ||
                di_prefix_cache_find(kv->cache, pf->hash[n], h, t) != pf->ids[n])
                break;
            di_block_pool_ref(kv->pool, pf->ids[n]);
            s->blocks[n] = pf->ids[n];
            s->pages[n] = di_block_pool_ptr(kv->pool, pf->ids[n]);
            h = pf->hash[n];
        }
        // The read blocks the sequence took (the memory match may have found them already: they
        // are cached since the prefetch was collected).
        for (int32_t i = 0; i < n && i < pf->n; i++)
            n_disk += pf->dst[i] != NULL && s->blocks[i] == pf->ids[i];
        prefetch_release(kv, pf); // the sequence holds its own references now
        kv->prefetch_engine_us += mono_us() - t0;
    }
    while (kv->disk && n < n_max) {
        const int32_t *t = prompt + (int64_t)n * B;
        const uint64_t hn = di_prefix_cache_hash(kv->cache, h, t, s->salt);
        const int32_t bid = di_prefix_cache_find(kv->cache, hn, h, t);
        if (bid < 0) break;
        di_block_pool_ref(kv->pool, bid);
        s->blocks[n] = bid;
        s->pages[n] = di_block_pool_ptr(kv->pool, bid);
        n++;
        h = hn;
    }
    kv->n_disk_hit_tokens += (int64_t)n_disk * B;
    s->n_blocks = n;
    s->n_published = s->n_published_before = n;
    s->last_hash = h;
    set_capacity(kv, s);
    const int32_t hit = n * B;
    s->n_cached = hit;
    for (int il = 0; il < kv->n_layer; il++) {
        const di_dsv4_layer_w *lw = &kv->model->layers[il];
        if (lw->ratio <= 0) continue;
        s->layers[il].cmp.n_entries = hit / lw->ratio;
        if (lw->ratio == 4) s->layers[il].idx.n_entries = hit / 4;
    }
    return hit;
}

void di_kv_seq_publish(di_kv_manager *kv, int32_t slot, const int32_t *tokens, int32_t n_done) {
    di_kv_seq *s = &kv->seqs[slot];
    s->n_published_before = s->n_published;
    if (!kv->cache) return;
    const int32_t B = kv->block_tokens;
    while (s->n_published < s->n_blocks && (s->n_published + 1) * B <= n_done) {
        int32_t i = s->n_published;
        uint64_t h =
            di_prefix_cache_hash(kv->cache, s->last_hash, tokens + (int64_t)i * B, s->salt);
        // Another sequence may have cached the same block first: this one then stays private.
        (void)di_prefix_cache_insert(kv->cache, h, s->last_hash, s->salt, tokens + (int64_t)i * B,
                                     s->blocks[i]);
        s->last_hash = h;
        s->n_published++;
    }
}

int32_t di_kv_seq_unpublish_last(di_kv_manager *kv, int32_t slot, uint8_t *marks) {
    di_kv_seq *s = &kv->seqs[slot];
    int32_t n = 0;
    if (!kv->cache || !s->open) return 0;
    // A block another sequence had cached first was never inserted for this one: nothing to do.
    for (int32_t i = s->n_published_before; i < s->n_published; i++)
        if (di_prefix_cache_remove(kv->cache, s->blocks[i])) {
            if (marks) marks[s->blocks[i]] = 1;
            n++;
        }
    s->n_published = s->n_published_before; // last_hash is stale from here: the slot is closed next
    return n;
}
