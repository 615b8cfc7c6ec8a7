/*
 * kv_manager — the V4 decode-time state of many sequences (spec §3) on the block pool.
 *
 * Every block has the same size. A sequence holds two kinds:
 *   - tail blocks (a fixed number per sequence): the window ring of every layer and every
 *     compressor's token ring (partial window, CSA overlap), both with DI_DSV4_ROLLBACK_MAX spare
 *     rows for rollback (model/dsv4.h), packed so that no item crosses a block;
 *   - entry blocks, one per `block_tokens` positions: the compressed entries (CSA, HCA) and the
 *     indexer keys that windows inside those positions produce, for every layer. block_tokens is a
 *     multiple of every compression ratio, so every window is closed at a block boundary and a
 *     full entry block is final — the unit the prefix cache shares.
 * The manager builds each sequence's di_dsv4_layer_state views (ring and buffers into its tail
 * blocks, entries through a page table of its entry blocks), so the forward pass reads and writes
 * the pool directly. Sequences hold block ids (reference counted), never own memory.
 * See docs/kv-cache.md for the layout and the exact prefix-reuse rule (bounded replay).
 * Created for accounting (di_kv_manager_create_accounting: the device-resident forward), the
 * manager keeps block ids, counts, the prefix cache and the block tables only: no memory, no tail
 * blocks (the forward's state holds every slot's tail), no layer views; the blocks are the device
 * state's entry blocks (model/dsv4_dev.h), whose ids the engine passes with each call.
 * The V4.1 forward's manager (di_kv_manager_create_v41) has block memory but no tail blocks or
 * views: a block is a V4.1 page (model/dsv41.h: the entries and index keys of block_tokens
 * positions of every kv source), and the engine binds each slot's session to its sequence's page
 * table (di_dsv41_bind_pages), so the forward reads and writes the blocks in place and a prefix
 * hit shares them; the per-slot tail (rings, (C, Z) slots, Engram history) is the session's.
 *
 * With a disk tier (di_kv_manager_open_disk) the prefix cache queues every block it loses to
 * eviction for the disk IO thread (kv/kv_disk_io.h: a copy, with its tail snapshot, if any;
 * written off this thread), and admission continues a prefix match with blocks still queued or on
 * disk, read back beforehand by a prefetch on the disk tier's read thread (di_kv_prefetch:
 * straight into reserved pool blocks, and the deepest record's tail snapshot into a staging
 * buffer), never on this thread (docs/kv-cache.md, "Disk tier").
 * The accounting manager reaches its blocks' contents through the block I/O the forward's owner
 * gives (di_kv_manager_set_block_io: the device state's entry blocks), on the thread that may use
 * the device, never inside a forward call: an evicted block's record (identity, tokens, tail
 * snapshot) is recorded at eviction and its contents downloaded before the next forward call,
 * which is the first thing that could write the block again; a prefetch reads its records into
 * host staging of its own and the blocks are uploaded before the next forward call, the first
 * that could read them ("device transfers" below).
 *
 * Owns: the pool, the prefix cache, the disk tier (with device blocks: its transfer batches and
 * the prefetches' host staging, sized when it opens), per-slot metadata (sized at create; no
 * allocation after).
 * Thread-safety: engine thread only (the disk tier's IO thread works on copies; kv_disk_io.h),
 * except di_kv_dev_run: the forward thread runs the device transfer batch handed to it, which the
 * engine thread leaves alone until di_kv_dev_end (it records into the other batch meanwhile).
 */
#pragma once

#include <stdbool.h>
#include <stdint.h>

#include "kv/block_pool.h"   // di_block_pool
#include "kv/kv_disk.h"      // di_kv_disk: the prefix cache's disk tier
#include "kv/kv_disk_io.h"   // di_kv_disk_io: its write queue and IO thread
#include "kv/prefix_cache.h" // di_prefix_cache
#include "kv/tail_cache.h"   // di_tail_cache: tail snapshots of cached blocks
#include "model/dsv4.h"      // di_model, di_dsv4_layer_state

typedef struct di_kv_seq {
    int32_t *tail;   // owned [n_tail]: block ids of the ring/buffer state
    int32_t *blocks; // owned [max_blocks]: entry block ids, position order
    float **pages;   // owned [max_blocks]: their addresses (the model's page table)
    int32_t n_blocks;
    di_dsv4_layer_state *layers; // owned [n_layer]: views into the blocks
    bool open;
    // Prefix-cache chain: blocks [0, n_published) are in the cache; last_hash is block
    // n_published - 1's chain hash.
    uint64_t salt, last_hash;
    int32_t n_published;
    int32_t n_cached;           // positions attached from the prefix cache at admission (0: none)
    int32_t n_published_before; // n_published before the last di_kv_seq_publish (its step's)
} di_kv_seq;

typedef struct di_kv_item { // one tail item's place
    int32_t blk;            // index into the sequence's tail
    int64_t off;            // float offset in that block
} di_kv_item;

typedef struct di_kv_manager {
    di_model *model;        // borrowed
    di_block_pool *pool;    // owned
    di_prefix_cache *cache; // owned; NULL when prefix reuse is off
    int32_t block_tokens;   // positions per entry block
    int64_t block_floats;
    int64_t entry_floats; // the entry part of an entry block (what the disk tier stores; 0 without
                          // block memory)
    int32_t n_tail;       // tail blocks per sequence
    int32_t max_blocks;   // entry blocks per sequence (max_ctx / block_tokens, rounded up)
    int32_t max_ctx;
    int32_t n_layer;
    int32_t replay_tokens; // bounded replay R = n_layer * (W - 1) (docs/kv-cache.md)
    // Layout, per layer.
    int64_t *page_off_cmp, *page_off_idx; // owned [n_layer]
    di_kv_item *ring, *buf_c, *buf_z;     // owned [n_layer]
    di_kv_item *ibuf_c, *ibuf_z;          // owned [n_layer]
    di_kv_seq *seqs;                      // owned [max_seqs]
    int32_t max_seqs;
    bool accounting;           // no tail blocks or layer views (the accounting and V4.1 managers)
    di_kv_disk *disk;          // owned; NULL without a disk tier
    di_kv_disk_io *disk_io;    // owned: the disk tier's write queue (with disk)
    di_tail_cache *tails;      // owned; NULL without tail snapshots (di_kv_manager_open_tails)
    int64_t n_disk_hit_tokens; // prompt tokens attached from blocks read from the disk tier
    struct di_kv_prefetch *pf; // owned [n_pf] (with disk): the disk prefetches (di_kv_prefetch)
    int32_t n_pf;
    // Disk prefetches: started, done (collected); records and bytes the read thread read for
    // them and its time; this thread's time probing, starting and collecting them (no file IO).
    int64_t n_prefetch_started, n_prefetch_done, n_prefetch_blocks, prefetch_bytes;
    int64_t prefetch_read_us, prefetch_engine_us;
    // Device blocks (di_kv_manager_set_block_io; bio.read NULL: the blocks are pool memory).
    struct di_kv_block_io_s {
        void *user;
        size_t block_bytes;
        di_status (*read)(void *user, int32_t block, void *dst);
        di_status (*write)(void *user, int32_t block, const void *src);
    } bio;
    struct di_kv_dev_batch *dev; // owned [2] (device blocks with a disk tier): recorded / handed
    int32_t dev_cur;             // the batch being recorded
    bool dev_handed;             // the other one was handed over (di_kv_dev_begin) and not ended
    uint8_t *dev_buf;            // owned [bio.block_bytes]: the download staging of a write-back
    // Device transfers: blocks downloaded and uploaded, write-backs lost (no room in the batch,
    // a failed download, a failed step) since create.
    int64_t n_dev_down, n_dev_up, n_dev_lost;
} di_kv_manager;

// The block I/O of an accounting manager's blocks (the device-resident forward's entry blocks):
// read copies block `block`'s contents (block_bytes, a multiple of 4) into dst, write copies src
// into it. Called on the thread that may use the device (di_kv_dev_run, di_kv_dev_sync,
// di_kv_manager_flush_disk, di_kv_manager_export / _import), never concurrently with a forward
// call.
typedef struct di_kv_block_io_s di_kv_block_io;

// kv_bytes of blocks; max_seqs slots of up to max_ctx positions each. DI_ERR_INVALID (the pool
// cannot hold one sequence of max_ctx positions), DI_ERR_NOMEM.
di_status di_kv_manager_create(di_model *m, size_t kv_bytes, int32_t max_seqs, int32_t max_ctx,
                               bool prefix_cache, di_kv_manager **out);
// The accounting manager of the device-resident forward: n_blocks blocks standing for
// block_bytes each (device entry blocks), no tail blocks, no memory; block_tokens by the same
// rule. DI_ERR_INVALID (n_blocks cannot hold one sequence of max_ctx positions; logged),
// DI_ERR_NOMEM.
di_status di_kv_manager_create_accounting(di_model *m, int32_t n_blocks, size_t block_bytes,
                                          int32_t max_seqs, int32_t max_ctx, bool prefix_cache,
                                          di_kv_manager **out);
// The V4.1 forward's manager: n_blocks blocks of di_kv_v41_block_bytes memory each, every one a
// V4.1 page of packed codes (model/dsv41.h; the disk tier stores its di_dsv41_page_bytes, a
// multiple of 64, as entry_floats = bytes / 4; pages[] holds the block addresses the engine binds
// to its sessions as byte pages), no tail blocks, no
// layer views. DI_ERR_INVALID (n_blocks cannot hold one sequence of max_ctx positions; logged),
// DI_ERR_NOMEM.
di_status di_kv_manager_create_v41(di_model *m, int32_t n_blocks, int32_t max_seqs, int32_t max_ctx,
                                   bool prefix_cache, di_kv_manager **out);
// Bytes of one block of the V4.1 manager: a page rounded up to 64.
size_t di_kv_v41_block_bytes(const di_model *m);
// Positions per entry block for model m (the lcm of the compress ratios, at least the window).
int32_t di_kv_block_tokens(const di_model *m);
void di_kv_manager_destroy(di_kv_manager *kv);
// Once, before di_kv_manager_open_disk, on an accounting manager: its blocks' contents,
// block_bytes each (the disk tier's and the KV transfer's records hold them: payload_floats =
// block_bytes / 4). DI_ERR_INVALID (not an
// accounting manager without memory, a size that is no multiple of 4, missing functions; logged).
di_status di_kv_manager_set_block_io(di_kv_manager *kv, const di_kv_block_io *bio);
// Adds the disk tier at o->dir to the prefix cache (kv/kv_disk.h): evicted cached blocks are
// queued for its IO thread (kv/kv_disk_io.h, o->queue_bytes of staging; dropped and counted when
// full) and written there (with their tail snapshots, when di_kv_manager_open_tails keeps them),
// and
// di_kv_seq_attach_prefix continues a match with the blocks found there (their snapshots of this
// manager's size back into the tail cache with them).
// Before any sequence opens. DI_ERR_UNSUPPORTED (an accounting manager without block I/O: its
// blocks' contents are not reachable), DI_ERR_INVALID (no prefix cache; a bad budget), DI_ERR_IO,
// DI_ERR_BUSY (the directory is another engine's), DI_ERR_NOMEM; all logged.
di_status di_kv_manager_open_disk(di_kv_manager *kv, const di_kv_disk_options *o);
// ---- disk prefetch (docs/kv-cache.md, "Disk tier") ----
// Up to di_kv_disk_options.prefetches at once, one per waiting request: the chain of its prompt
// that continues beyond memory with records queued for writing or on disk. Its in-memory blocks
// are referenced, fresh pool blocks are reserved for the others (at most kv_disk_read_bytes of
// them, and all prefetches together at most half of the pool blocks available to them), and the
// read thread reads the records into them (verified: the first miss or bad record ends the chain),
// with the tail snapshot of the deepest one that has one into a staging buffer; the jobs queue
// there, oldest first. A record another request's prefetch is reading is never read twice: that
// request waits for it. Once done (seen at the next probe of any request), the read blocks go into
// the prefix cache (the snapshot into the tail cache), held for the request until
// di_kv_seq_attach_prefix takes them.
typedef enum di_kv_prefetch_state {
    DI_KV_PREFETCH_READY = 0, // attach now: nothing to read (or too little room to), or read
    DI_KV_PREFETCH_WAIT,      // its prefetch runs (maybe started just now), or it waits for one
} di_kv_prefetch_state;
// Whether request id's prompt (salt; its first n_max_tokens tokens) can be attached now; starts its
// prefetch when its chain continues on disk and a prefetch is free. Probing reads no file (the
// index and the queue only). READY without a disk tier.
di_kv_prefetch_state di_kv_prefetch(di_kv_manager *kv, uint64_t id, uint64_t salt,
                                    const int32_t *prompt, int32_t n_max_tokens);
// Pool blocks held for request id by its done prefetch (0: none): its admission takes them.
int32_t di_kv_prefetch_held(const di_kv_manager *kv, uint64_t id);
// Request id leaves (cancelled, finished, failed): its prefetch, if any, stops (a read in flight
// is waited for: at most one record), its blocks read so far stay in the prefix cache, idle, and
// every block it held is returned.
void di_kv_prefetch_drop(di_kv_manager *kv, uint64_t id);
// Request id, next to be admitted, finds no room while nothing runs: every other request's
// prefetch is dropped (as by di_kv_prefetch_drop; their blocks read stay cached, idle, so
// available; their requests probe again later). Returns the pool blocks that became available.
// Prefetches of requests behind id must not keep id from ever being admitted.
int32_t di_kv_prefetch_yield(di_kv_manager *kv, uint64_t id);

// ---- device transfers (accounting manager with block I/O and a disk tier) ----
// What the disk tier does to device blocks is recorded on this thread into a batch (sized at
// open_disk: nothing allocated per step), in order: the download of a block the prefix cache
// evicts (its record's identity, tokens and tail snapshot are copied then; its contents are still
// those of the last forward call that wrote it, because only a forward call writes a device
// block), and the upload of a block a prefetch read (its record in the prefetch's host staging,
// which is not reused until the batch ended). The batch runs before the next forward call, the
// first that could write an evicted block (its new owner's) or read a read one, and in the
// recorded order, so a block evicted, read into and evicted again within one batch is written
// back with the right contents each time. Each download goes to the write queue
// (di_kv_disk_io_put: copied, dropped when full); a spill that finds the batch full is lost
// (counted).
// Engine thread, no batch handed over: the recorded batch is handed over (to run on the forward
// thread before its call); returns whether it holds anything. Spills are recorded into the
// other batch from here on.
bool di_kv_dev_begin(di_kv_manager *kv);
// The thread that may use the device, before the forward call (or with none in flight): runs the
// handed batch. DI_OK, or a failed upload's status (that block's contents are wrong: the step
// must fail, as for any device fault; the rest still runs). A failed download loses its record.
di_status di_kv_dev_run(di_kv_manager *kv);
// Engine thread, after the call the handed batch ran before returned: its prefetch staging may
// be reused, and the blocks whose upload failed leave the prefix cache (marked in marks[id] = 1,
// pool-sized, may be NULL: the requests that attached them must start over); returns how many.
int32_t di_kv_dev_end(di_kv_manager *kv, uint8_t *marks);
// Engine thread, no forward call in flight: begin, run, end (idle, destroy).
di_status di_kv_dev_sync(di_kv_manager *kv);
// Whether the recorded batch holds anything (engine thread).
bool di_kv_dev_pending(const di_kv_manager *kv);
// The step launched last failed: the blocks it published were never computed, and an eviction
// recorded since may have taken one of them: the recorded downloads are dropped (counted as
// lost; a lost record only costs a recompute). Uploads stay. Engine thread.
void di_kv_dev_drop_spills(di_kv_manager *kv);

// Writes the cached blocks not yet on disk (nor queued) there, or whose record lacks the tail
// snapshot they have now (orderly shutdown, so that a restart finds them): most recently used
// first, at most as many as the disk budget holds; through the write queue (waiting for room, never
// dropping), then waits until everything queued is written. Returns the blocks queued here.
// Nothing without a disk tier. Device blocks: no forward call in flight; the recorded batch runs
// first, then each block is downloaded here.
int32_t di_kv_manager_flush_disk(di_kv_manager *kv);

// KV transfer (prefill/decode disaggregation, docs/disaggregation.md; a manager with block memory
// or block I/O and the prefix cache, else DI_ERR_UNSUPPORTED with the reason in err[cap]).
// Device blocks (block I/O): the block I/O's thread rule holds (no forward call in flight); the
// recorded device transfer batch runs first (and, on import, again after the blocks are taken,
// so that an evicted block's write-back downloads what was evicted), the records hold the block
// I/O's bytes and the transfer's precision DI_KV_TRANSFER_PRECISION_DEVICE (kv/kv_transfer.h).
// Across forwards (a CPU manager importing a device transfer, or the other way round) the blocks
// are taken when the records' layout is the same (the FP32 recipe: the same entry bytes), the tail
// snapshot (another format) is left out; another layout is refused as another model's.
// Export: the cached chain of tokens[0 .. n_tokens) under salt (whole blocks, stopping at the
// first block not cached) as a transfer (kv/kv_transfer.h) in *out (di_malloc'd; di_free), its
// size and block count; with the tail snapshot of the deepest block of the chain that has one.
// DI_ERR_INVALID (n_tokens out of the context), DI_ERR_NOMEM, a failed device read's status.
di_status di_kv_manager_export(di_kv_manager *kv, const int32_t *tokens, int32_t n_tokens,
                               uint64_t salt, void **out, size_t *n_out, int32_t *n_blocks,
                               char *err, size_t cap);
// Import: verifies the whole transfer (header, every record, chain links and chain hashes, the
// tail snapshot: its size is this manager's, its checksum), then puts its blocks into the prefix
// cache as idle cached blocks (those already cached are counted in *n_present, copies in
// *n_inserted), stopping early if the pool has no block left, and attaches the snapshot to its
// block (ignored without tail snapshots here, or when that block has one already). A transfer
// that fails any check inserts nothing: DI_ERR_INVALID (another model identity or precision, or
// the other forward's transfer of another layout), DI_ERR_FORMAT (anything else), with the reason
// in err[cap]; DI_ERR_NOMEM. Device blocks: each fresh block is written (block I/O) before it
// enters the cache; a failed write returns its status (reason in err) and leaves that block out of
// the cache and back in the pool, the chain's blocks before it imported, none after it.
di_status di_kv_manager_import(di_kv_manager *kv, const void *buf, size_t n, int32_t *n_inserted,
                               int32_t *n_present, char *err, size_t cap);

// What a request with tokens[0 .. n_tokens) under salt would find cached, in whole blocks: the
// chain from the first block, each block in memory (*n_memory) or, past memory, in the disk tier
// (queued or on disk, *n_disk: read when such a request comes), stopping at the first block that
// is neither. Reads and changes nothing (no reference, no LRU touch). 0 and 0 without the prefix
// cache. The engine thread (the cache's one writer).
void di_kv_manager_probe(di_kv_manager *kv, const int32_t *tokens, int32_t n_tokens, uint64_t salt,
                         int32_t *n_memory, int32_t *n_disk);

// Tail snapshots (docs/kv-cache.md, "Tail snapshots"): snapshots of snap_bytes (the engine's
// per-slot tail state) attached to cached blocks, as many as budget_bytes holds, each dropped
// with its block. Before any sequence opens; needs the prefix cache. DI_ERR_INVALID (no prefix
// cache, a budget below one snapshot), DI_ERR_NOMEM; logged.
di_status di_kv_manager_open_tails(di_kv_manager *kv, size_t snap_bytes, size_t budget_bytes);
// The snapshot buffer to fill for the slot's state at position h (a block boundary > 0 whose
// block, the slot's block h / block_tokens - 1, is in the prefix cache), or NULL (no snapshots;
// the block is not cached: another sequence published the same block first and this one stays
// private; the block has a snapshot already: the first one is kept).
uint8_t *di_kv_tail_put(di_kv_manager *kv, int32_t slot, int32_t h);
// After di_kv_seq_attach_prefix of `hit` positions: the deepest snapshot at a boundary s of the
// attached blocks with hit - s < the replay bound (restoring it and computing s .. hit - 1 costs
// less than the bounded replay), its position in *s; NULL if none.
const uint8_t *di_kv_tail_best(di_kv_manager *kv, int32_t slot, int32_t hit, int32_t *s);

// Blocks a sequence of n positions holds (tail + entry blocks).
int32_t di_kv_blocks_for(const di_kv_manager *kv, int32_t n_positions);

// Opens slot (empty state, position 0): takes and zeroes its tail blocks. DI_ERR_NO_KV (nothing
// held).
di_status di_kv_seq_open(di_kv_manager *kv, int32_t slot, uint64_t salt);
// Returns every block of the slot (entry blocks that are cached stay in the cache, idle).
void di_kv_seq_close(di_kv_manager *kv, int32_t slot);
// Makes sure entry blocks cover positions [0, end_pos). DI_ERR_NO_KV (blocks taken so far stay).
di_status di_kv_seq_grow(di_kv_manager *kv, int32_t slot, int32_t end_pos);
// grow in two halves, for planning while a forward pass runs: reserve takes the blocks and
// fills the page table beyond the sequence's current blocks (nothing a running forward reads);
// commit then publishes the new capacity to the layer states (only while no forward runs).
di_status di_kv_seq_reserve(di_kv_manager *kv, int32_t slot, int32_t end_pos);
void di_kv_seq_commit(di_kv_manager *kv, int32_t slot);
// On a freshly opened slot: takes the longest cached prefix of prompt (at most n_max_tokens,
// whole blocks) and marks its entries present. With a disk tier, the chain continues with the
// blocks request id's done prefetch holds (di_kv_prefetch: they are taken, the prefetch ends), then
// with blocks cached in memory; nothing is read from disk here. Returns the hit length in tokens
// (0 if none).
int32_t di_kv_seq_attach_prefix(di_kv_manager *kv, int32_t slot, uint64_t id, const int32_t *prompt,
                                int32_t n_max_tokens);
// Publishes the slot's entry blocks that became full once positions [0, n_done) are computed
// (called when the step that computes them is launched).
void di_kv_seq_publish(di_kv_manager *kv, int32_t slot, const int32_t *tokens, int32_t n_done);
// The step of the slot's last publish failed, so the blocks it published hold nothing computed:
// takes them out of the prefix cache (the slot keeps its references). Marks each block taken out
// in marks[id] = 1 (pool-sized, may be NULL) and returns how many. Then close the slot.
int32_t di_kv_seq_unpublish_last(di_kv_manager *kv, int32_t slot, uint8_t *marks);
// The blocks' contents are gone (the device was lost; docs/cuda.md, "Device loss"): every block
// leaves the prefix cache without a write-back (their tail snapshots go with them; idle ones
// become free; a block still referenced keeps its references, uncached). The disk tier's records,
// queued or on disk, stay and are read back by later prefetches. Returns how many left. Engine
// thread, no forward call in flight.
int32_t di_kv_manager_drop_cached(di_kv_manager *kv);
