// engine — implements the engine part of include/deepinfer.h: a thread-safe submission queue in
// front of one engine thread that owns the model, the KV manager, the scheduler and the sampler.
// Asynchronous scheduling: step N's forward runs on the forward thread (thread 0 of the model's
// pool), followed by the sampling of its logit rows spread over the pool (one sampler per pool
// thread), while the engine thread plans step N+1 (scheduler.h); then the engine thread emits
// step N, drops finished requests from the plan, fills in the sampled ids and launches
// step N+1. DI_ENGINE_SYNC=1 (debug) plans only after the forward returns; DI_ENGINE_FAIL_STEPS=N
// (debug) fails the first N steps as a device fault would; DI_ENGINE_LOSE_DEVICE=N (debug) fails
// them as a lost device would ("device loss" below).
//
// Three forwards, chosen at create:
//   - the device-resident forward, when the model has one attached: V4's (model/dsv4_dev.h, m->dev:
//     --device cuda on a V4 checkpoint, or a test's CPU twin) or V4.1's (model/dsv41_dev.h,
//     m->dev41: --device cuda on a V4.1 checkpoint, or a test's CPU twin), with or without
//     speculation (V4's MTP, V4.1's DSpark: dev41_spec_forward). Both are reached through one
//     adapter (dev_*: "the device-resident forwards" below), so what follows holds for either: one
//     dev state of max_seqs slots for max_batch_tokens rows whose compressed entries live in entry
//     blocks; the kv_manager keeps the accounting of those blocks (ids, references, the prefix
//     cache; no host memory, no tail blocks: the state holds every slot's rings), sized from
//     kv_memory_bytes (minus the slots' tails, di_dsv4_dev_sizes / di_dsv41_dev_sizes) and capped
//     by the blocks every pipeline stage's free memory holds (dev_mem_blocks; the stages' split
//     was chosen at load for these sizes, which create hands to di_model_load: di_model_options
//     dev_*, docs/cuda.md "The split"); kv_memory_bytes 0 takes that cap alone (the KV fills
//     the devices, less the reserve). A running
//     request's scheduler slot is its dev slot; each call passes its block ids, its win_lo (bounded
//     replay after a prefix hit), the positions it attached from the prefix cache and (V4.1) its
//     request's tokens (the Engram look-back before win_lo; a tail restore rebuilds the history
//     from them too), so prefix reuse works as on the CPU path.
//     A failed dev call fails the requests of that step (DI_FINISH_ERROR with its status); the
//     engine keeps serving. A lost device (DI_ERR_DEVICE_LOST: a sticky CUDA error) also has the
//     device state rebuilt, the other running requests recomputed ("device loss" below). With
//     spec_tokens > 0 (a V4 checkpoint with its MTP block) the dev state holds the MTP block too
//     (di_dsv4_dev_mtp_enable: a window ring per slot, paid from kv_memory_bytes): MTP speculation
//     as on the CPU forward below, the step's call verifying [y, d] in two rows, the rejected row
//     taken back in the dev state (di_dsv4_dev_rollback) and the MTP call run on the kept rows'
//     main streams, which the state keeps from the step's call
//     ("speculative decoding on the device-resident forward" below; V4.1's DSpark on its device
//     forward: dev41_spec_forward).
//   - the V4.1 forward, for a DeepSeek V4.1 checkpoint (hp.v41; model/dsv41.h) without the
//     device-resident one: one V4.1 session
//     per scheduler slot holding the slot's fixed tail (window and DSpark rings, (C, Z) slots,
//     the Engram history), reserved at create for max_ctx positions and max_batch_tokens rows
//     (di_dsv41_reserve_ctx), all sharing the engine's workspace (di_dsv41_share_ws), which
//     holds a step's rows. The entries and index keys of every kv source live in the
//     kv_manager's blocks (V4.1 pages, di_kv_manager_create_v41): each slot's session is bound
//     to its sequence's block table at launch (v41_bind), so kv_memory_bytes pays the tails and
//     buys blocks, sequences grow block by block, admission reserves blocks and the scheduler
//     preempts (recompute) when they run out, as on the CPU forward. A step is one batched call
//     (di_dsv41_forward_batch) over all its sequences, prefill chunks, decodes and verifies
//     mixed: a sequence planned from position 0 starts over (reset at launch); the call writes
//     the logits of each sequence's last row when the plan samples it. A session's result
//     depends on its own tokens only (any chunking, any batch and row offset give the same
//     logits, bit for bit), so a request's tokens do not depend on what shares its steps. With
//     the prefix cache (default) a block is published when the step that completes it is
//     launched, as on V4; a request admitted on a hit attaches the cached blocks (shared,
//     reference counted) and its session restarts on them (di_dsv41_restart: their entries are
//     kept, never rewritten) to replay the bounded suffix ("V4.1 pages and prefix hits" below,
//     docs/kv-cache.md). With spec_tokens > 0 the
//     sessions run DSpark (one draft call per step for every speculating sequence) and a decode
//     sequence verifies its drafts in its rows of the step's call, yielding up
//     to spec_tokens + 1 tokens per step, bit for bit those of plain decoding ("speculative
//     decoding" below); the plan built ahead is corrected for the extra tokens when they are
//     emitted (spec_settle).
//   - otherwise the CPU batched forward (di_dsv4_forward_batch) on the KV manager's blocks; with
//     a device (di_engine_options.device: the model's matmul hook, backend/device.h) every
//     matmul runs there, called from the forward thread only (the model calls its hook outside
//     pool tasks), one forward at a time. With spec_tokens > 0 (a V4 checkpoint with its MTP
//     block) the MTP block runs after each step's sampling on the step's kept rows (each slot
//     holds its MTP window ring) and drafts one token per sampled sequence, which that
//     sequence's next decode verifies ("speculative decoding" below); the V4 state takes the
//     rejected row back (di_dsv4_state_rollback).
//
// The prefix cache's disk tier (kv_disk_dir; every forward; docs/kv-cache.md, "Disk tier"): on the
// device-resident forward the kv_manager records evicted blocks' downloads and prefetched blocks'
// uploads while the engine thread plans; launch hands that batch to the forward thread, which runs
// it before its call (a device block changes only when a forward call writes it, and is read only
// by one); with nothing to launch the engine thread runs it, the forward idle ("the disk tier on
// the device-resident forward" below).
//
// Tail snapshots (every forward; "tail snapshots" below, docs/kv-cache.md): the slot's tail at a
// prompt's last block boundary is copied after the call that ended there and kept with the cached
// block ending there (kv/tail_cache.h); an admission whose hit reaches that block restores it (the
// scheduler's restore hook) and computes nothing before the hit. Without one the hit is continued
// by the bounded replay.
//
// Memory: everything a step touches is sized at create (the workspace for max_batch_tokens rows,
// or the dev state and its warm-up call, which grows the backend's op scratch; the logits of
// max_seqs rows, the sampler for the vocabulary, the scheduler's plan arrays, the
// KV pool); the thread-local allocation counter around each step proves it (n_step_allocs).
// Thread-safety: submit, cancel, wait_idle and get_stats from any thread; destroy from one.
#include <pthread.h>
#include <sched.h> // sched_yield
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h> // sysconf

#include "base/log.h"
#include "base/mem.h"
#include "base/status.h"
#include "engine/engine_internal.h" // test hooks
#include "cp/cp.h"                  // di_cp_batch_forward: long prefill chunks over workers
#include "ep/ep.h"                  // the expert workers (online EPLB applies placements)
#include "ep/eplb.h"                // di_ep_load: the model's expert routing load
#include "ep/eplb_async.h"          // di_eplb_async: the online EPLB planner thread
#include "kv/kv_manager.h"
#include "model/dsv4.h"
#include "model/dsv41.h"     // the V4.1 forward: di_dsv41_reserve_ctx, di_dsv41_state_bytes
#include "model/dsv41_dev.h" // the V4.1 device-resident forward
#include "model/dsv4_dev.h"  // the V4 device-resident forward
#include "sample/sampler.h"
#include "sched/request.h"
#include "sched/scheduler.h"

struct di_engine {
    di_model *model; // owned
    di_engine_options opt;
    di_kv_manager *kv;     // owned
    di_sched sched;        // owned
    di_sampler **samplers; // owned [n_samplers]: one per pool thread
    int32_t n_samplers;
    di_sample_result *x_res; // owned [max_seqs]: the samples of the plan being run
    di_dsv4_ws ws;           // owned (CPU forward; on V4.1 the slots' sessions share it)
    float *logits;           // owned [max_seqs * lstride, V] (lstride: spec_tokens + 1 rows)
    // The device-resident forward (dev_on: model->dev or model->dev41): one
    // state for every slot, reached through the dev_* adapter ("the device-resident forwards"
    // below), so that the engine has one path for both.
    bool kv_auto; // kv_memory_bytes was 0: the device's memory sizes the KV (dev_kv_create)
    bool dev_on;
    di_dsv4_dev_state *dstate;    // owned; V4's (NULL otherwise)
    di_dsv41_dev_state *dstate41; // owned; V4.1's (NULL otherwise)
    di_dsv4_dev_seq *x_dev;       // owned [max_seqs]: the plan being run (slot, pos, blocks, ...)
    di_dsv41_dev_seq *x_dev41;    // owned [max_seqs] (V4.1): x_dev as the V4.1 call's sequences
    const int32_t **x_prefix;     // owned [max_seqs] (V4.1): each one's request tokens (borrowed:
                                  // the Engram look-back of a replay's start)
    int32_t *x_blocks;            // owned [max_seqs, max_blocks]: the block ids x_dev points to
    int64_t dev_block_bytes;      // device bytes of one entry block
    // Tail snapshots on the dev forward ("tail snapshots" below): a restore chosen while planning
    // (the previous step's call may still run) is staged per slot and applied by the launch that
    // runs the admitting plan, the forward idle, before that plan's call.
    uint8_t *dev_snap;      // owned [max_seqs, tail_bytes]: staged snapshots
    uint64_t *dev_snap_id;  // owned [max_seqs]: the request id it is for (0: none)
    int32_t *dev_snap_pos;  // owned [max_seqs]: its position
    di_status x_restore_st; // the launch's restores (a failure fails its step)
    int32_t x_dev_bad;      // blocks whose disk-tier upload before the call failed (marked)
    di_request **x_seq_req; // owned [max_seqs]: the request of each planned sequence
    // The V4.1 forward (model->hp.v41): one session per scheduler slot.
    di_session **v41;             // owned [max_seqs]; NULL on the other forwards
    int32_t n_v41;                // sessions created
    int32_t *x_slot;              // owned [max_seqs]: the slot of each planned sequence (V4.1)
    di_dsv41_seq *x_b;            // owned [max_seqs]: the batched call's sequences (v41_forward)
    int32_t *x_bk;                // owned [max_seqs]: the logit slot of each (-1: none)
    int32_t *x_ver;               // owned [max_seqs * lstride]: logit slot k's verify tokens
    di_dsv41_draft_seq *x_d;      // owned [max_seqs]: the step's draft call (speculating sequences)
    int32_t *x_dseq;              // owned [max_seqs]: the plan sequence of each draft
    int32_t *x_dkmax;             // owned [max_seqs]: the most drafts it may verify
    di_dsv41_dev_draft_seq *x_dd; // owned [max_seqs] (V4.1 DSpark on the device): the draft call
    int64_t v41_slot_bytes;       // one slot tail: its session state without entries (shared ws)
    // Speculative decoding (V4.1 with DSpark, opt.spec_tokens > 0; "speculative decoding" below).
    // Logit slot k (a sampled sequence of the plan) owns lstride rows of logits and of sample
    // results: its verify rows. lstride is 1 when speculation is off.
    int32_t spec_k;        // drafts per verify at most (0: off)
    float spec_tau;        // the confidence cut (< 0: none)
    int32_t lstride;       // logit rows per logit slot: spec_k + 1
    int32_t *x_nrows;      // owned [max_seqs]: rows of slot k to sample (1, or drafts + 1)
    int32_t *x_emit;       // owned [max_seqs]: tokens slot k yields (1, or accepted drafts + 1)
    int32_t *x_ndraft;     // owned [max_seqs]: drafts verified for slot k (0: no verify)
    int32_t *x_nprop;      // owned [max_seqs]: drafts proposed for slot k (DSpark, MTP)
    int32_t *x_lslot;      // owned [max_seqs]: the slot (scheduler / V4.1) of logit slot k
    int32_t *x_job;        // owned [max_seqs * lstride]: the rows to sample, k * lstride + i
    int32_t x_n_job;       // (the forward thread's)
    atomic_int x_job_next; // the next of them a sampling thread takes (sample_task)
    // Greedy picks on the device-resident forward ("greedy rows on the device" below): per logit
    // row (the call's rows, then moved with the logits to the slots' rows k * lstride + i) whether
    // it crossed as its device argmax only, and that pick.
    uint8_t *x_greedy; // owned [max_seqs * lstride]
    int32_t *x_pick;   // owned [max_seqs * lstride]
    int64_t spec_n[4]; // engine thread: verifies, drafted, verified, accepted so far
    int64_t spec_hist[DI_MAX_SPEC_TOKENS + 1];
    di_engine_draft_fn draft_hook; // a test's (engine_internal.h); NULL: the model's own drafts
    void *draft_user;
    // V4 speculation with the MTP block (the CPU forward, spec_k > 0): the step's call with its
    // verify rows, the MTP call after sampling, and per slot the MTP block's state and draft.
    di_dsv4_layer_state *mtp_ls; // owned [max_seqs * (n_layer + 1)]: slot s's MTP block state is
                                 // entry s * (n_layer + 1) + n_layer (a sequence's layers[])
    float *mtp_ring;             // owned [max_seqs, W + ROLLBACK_MAX, Dh]: their window rings
    int64_t mtp_slot_bytes;      // one slot's MTP ring (paid from kv_memory_bytes)
    int32_t *mtp_draft;          // owned [max_seqs]: the slot's draft token ...
    int32_t *mtp_draft_pos;      // owned [max_seqs]: ... for this position ...
    uint64_t *mtp_draft_req;     // owned [max_seqs]: ... of this request (0: none)
    float *mtp_logits;           // owned [max_seqs, V]: the MTP call's logits
    int32_t *mtp_pick;           // owned [max_seqs]: the device MTP call's drafts (its picks)
    uint8_t *mtp_all;            // owned [max_seqs] of 1: every MTP logit row is a greedy one
    di_dsv4_seq *x_vseqs;        // owned [max_seqs]: the step's call, verify rows included
    int32_t *x_vtokens;          // owned [max_batch_tokens + max_seqs * spec_k]: its tokens
    int32_t *x_vlogit;           // owned [max_seqs * lstride]: its logit rows
    int32_t *x_cap;              // owned [max_seqs]: positions plan sequence i's blocks hold
    di_dsv4_seq *x_mseqs;        // owned [max_seqs]: the MTP call's sequences
    int32_t *x_mids;             // owned [max_batch_tokens + max_seqs * spec_k]: its next tokens
    int32_t *x_mlogit;           // owned [max_seqs]: its logit rows (sampled sequences' last)
    int32_t *x_mseq;             // owned [max_seqs]: the plan sequence of each MTP logit row
    // ... and on the device-resident forward (dstate, spec_k > 0; "speculative decoding on the
    // device-resident forward" below), with the arrays above but x_vseqs, x_mseqs:
    di_dsv4_dev_seq *x_vdev; // owned [max_seqs]: the step's call, verify rows included
    di_dsv4_dev_seq *x_mdev; // owned [max_seqs]: the MTP call's sequences
    int32_t *x_mrows;        // owned [max_batch_tokens + max_seqs * spec_k]: its rows' main rows
    uint8_t *marks;          // owned [pool blocks], zero: fail_step's scratch
    // Failure injection (di_engine_fail_forward, DI_ENGINE_FAIL_STEPS): the fail_in-th next
    // forward and the fail_n - 1 after it fail with fail_status without running (0: none).
    atomic_int fail_in, fail_n, fail_status;
    // Device loss ("device loss" below). dead: the engine gave up on the device (set by the engine
    // thread under mu; then every request is refused). loss_ms: the scheduler clock of the last
    // device_loss_max + 1 losses, a ring (n_loss of them so far).
    bool dead;
    int64_t *loss_ms; // owned [device_loss_max + 1]
    int64_t n_loss;
    // di_engine_lose_device (tests): the lose_in-th next forward arms the loss of stage
    // lose_stage's CPU backend lose_after entries on; the next lose_rebuilds rebuilds lose their
    // new backend too (lose_after entries into their warm-up).
    atomic_int lose_in, lose_rebuilds;
    int32_t lose_stage;
    int64_t lose_after;
    int32_t eos;
    di_grammar_matcher_limits glim; // of the matchers of requests with a grammar
    pthread_t thread;
    bool thread_started;
    bool sync_debug;  // DI_ENGINE_SYNC=1: plan after the forward, no masks ahead (no overlap)
    bool masks_ahead; // compute constrained rows' masks during the forward (a CPU is free for it)
    // The plan being run (a copy: the scheduler plans the next step meanwhile).
    di_dsv4_seq *x_seqs;      // owned [max_seqs]
    int32_t *x_tokens;        // owned [max_batch_tokens]
    int32_t *x_logit_rows;    // owned [max_seqs]
    di_request **x_logit_req; // owned [max_seqs]
    int32_t x_n_seq, x_n_logit;
    di_request **x_mask_req; // owned [max_seqs]: the constrained rows' requests (masks ahead)
    int32_t x_n_mask;
    // The forward thread: runs one forward at a time for the engine thread.
    pthread_t fwd_thread;
    bool fwd_started;
    pthread_mutex_t fmu;
    pthread_cond_t fcv;
    bool f_go, f_done, f_quit;         // guarded by fmu
    int64_t f_allocs;                  // allocations inside the last forward (forward thread)
    int64_t f_forward_us, f_sample_us; // the last step's forward calls and its sampling
    di_status f_status;                // the last forward's status (DI_OK on the CPU forward)
    // Guarded by mu.
    pthread_mutex_t mu;
    pthread_cond_t cv_work, cv_idle;
    di_request *in_head, *in_tail; // submitted, not yet taken by the engine thread
    di_request *all;               // every live request (for cancel by id)
    int32_t n_live, n_incoming;    // live requests; submitted but not yet taken
    int32_t n_waiting_seen;        // the scheduler's queue length after the last step
    uint64_t next_id;
    bool stop, any_cancel;
    struct kv_job *jobs; // KV exports / imports for the engine thread (di_engine_kv_*)
    pthread_cond_t cv_job;
    di_engine_stats stats;
    // EPLB: the routing load the model's MoE records (model->expert_load); read by any thread.
    di_ep_load *expert_load; // owned
    // Online EPLB (opt.eplb_interval > 0): the planner thread (it owns the window each plan reads)
    // and the step count at which the next plan is handed to it. eplb_ready (under mu): a plan is
    // done (wakes a sleeping engine thread to apply it); eplb_busy (under mu): one is in flight
    // (submitted, not yet applied; di_engine_wait_idle waits for it).
    di_eplb_async *eplb; // owned; NULL without online EPLB
    int64_t eplb_next_step;
    bool eplb_ready, eplb_busy;
    // The disk tier's read thread finished a prefetch (under mu): wakes a sleeping engine thread.
    bool disk_ready;
    // The device-resident forward's disk transfers (under mu): recorded and not run yet, so
    // di_engine_wait_idle waits for the engine thread to run them ("disk tier" below).
    bool dev_xfer_busy;
    // di_engine_probe_workers (under mu): when the workers were last probed, and the answer.
    int64_t probe_ms;
    // di_engine_skew_clock (tests): added to the scheduler's clock.
    _Atomic int64_t clock_skew_ms;
    di_status probe_st;
};

// A KV export or import, run by the engine thread between steps (no forward in flight, so every
// cached block is computed), for a caller waiting in di_engine_kv_export / _import.
typedef struct kv_job {
    bool import;
    bool probe;            // di_engine_kv_probe (tokens, n_tokens, salt in; n_a, n_b out)
    const int32_t *tokens; // export, probe
    int32_t n_tokens;
    uint64_t salt;
    const void *in; // import
    size_t n_in;
    void *out; // export's transfer
    size_t n_out;
    int32_t n_a, n_b; // export: blocks; import: inserted, present; probe: memory, disk blocks
    char *err;
    size_t cap;
    di_status st;
    bool done; // guarded by mu
    struct kv_job *next;
} kv_job;

di_engine_options di_engine_options_default(void) {
    di_engine_options o = {.n_threads = 0,
                           .precision = DI_PRECISION_FP32,
                           .device = {.kind = DI_DEVICE_CPU},
                           .priority_aging_ms = DI_ENGINE_PRIORITY_AGING_MS};
    return o;
}

static void *engine_main(void *p);
static void *forward_main(void *p);
static di_status tails_open(di_engine *e);
static void tails_take(di_engine *e);
static void tail_stats(di_engine *e, di_engine_stats *st);
static void spec_rollback(di_engine *e, int32_t k, int32_t pos_new);
static void disk_stats(di_engine *e, di_engine_stats *st);
static void disk_read_done(void *user);
static di_status dev_block_read(void *user, int32_t block, void *dst);
static di_status dev_block_write(void *user, int32_t block, const void *src);
static void disk_store_stats(di_kv_manager *kv, di_engine_stats *st);
static void eplb_done(void *user);
static int64_t sched_now_ms(di_engine *e);

// ---- the device-resident forwards (one adapter) ----

// Slots per DSpark draft call on the device (di_dsv41_dev_draft takes at most 64).
enum { DI_ENGINE_DRAFT_CHUNK = 64 };
//
// The V4 (model/dsv4_dev.h) and V4.1 (model/dsv41_dev.h) device-resident forwards have the same
// shape: a state of max_seqs slots whose entry blocks are the accounting kv_manager's blocks, calls
// listing each sequence's blocks, win_lo and n_cached, tail snapshots, entry block I/O, decode
// graphs. The engine reaches either through these few calls, so that its sizing, warm-up, launch,
// tail and block I/O code is written once. Speculation differs: V4's MTP (mtp_enable, the verify
// graphs, rollback, the MTP call after the step: e->dstate, spec_k > 0) and V4.1's DSpark (the
// state's DSpark enabled at create, a draft call before the step's call, rollback:
// dev41_spec_forward, e->dstate41, spec_k > 0).

static di_backend *dev_backend(const di_engine *e) {
    return e->model->dev ? di_dsv4_dev_backend(e->model->dev)
                         : di_dsv41_dev_backend(e->model->dev41);
}

static int32_t dev_block_tokens(const di_engine *e) {
    return e->model->dev ? di_dsv4_dev_block_tokens(e->model->dev)
                         : di_dsv41_dev_block_tokens(e->model->dev41);
}

// A slot's tail: V4.1 with DSpark adds the DSpark blocks' rings (di_dsv41_dev_dspark_enable: per
// block W + DI_DSV41_ROLLBACK_MAX Q8 rows, as a layer's window ring).
static di_status dev_sizes(const di_engine *e, int32_t n_ctx, int32_t bt, int64_t *blk,
                           int64_t *slot) {
    if (e->model->dev) return di_dsv4_dev_sizes(e->model->dev, n_ctx, bt, blk, slot);
    di_status st = di_dsv41_dev_sizes(e->model->dev41, bt, blk, slot);
    const di_hparams *hp = &e->model->hp;
    if (st == DI_OK && e->spec_k > 0)
        *slot += (int64_t)e->model->n_mtp_loaded * (hp->window + DI_DSV41_ROLLBACK_MAX) *
                 di_backend_code_row_bytes(8, hp->head_dim, DI_BACKEND_WIN_BLOCK);
    return st;
}

// The most entry blocks of bt positions the state can index (int32 rows, halved for margin): V4
// has a pool per layer (its rows and one slot ring per slot, then E = bt / ratio rows per block),
// V4.1 one pool (every layer's call rows and rings, then every kv source's E rows per block).
static int64_t dev_block_cap(const di_engine *e, int32_t bt) {
    const di_hparams *hp = &e->model->hp;
    const int64_t fixed = (int64_t)e->opt.max_batch_tokens + (int64_t)e->opt.max_seqs * hp->window;
    int64_t cap = INT32_MAX / 2;
    if (e->model->dev) {
        for (int il = 0; il < hp->n_layer; il++) {
            const int32_t r = e->model->layers[il].ratio;
            if (r > 0 && (INT32_MAX / 2 - fixed) / (bt / r) < cap)
                cap = (INT32_MAX / 2 - fixed) / (bt / r);
        }
        return cap;
    }
    // V4.1's compact state keeps each kv source's entries and index keys in arrays of their own
    // (the window rows, call rows and rings are another array, not sized by blocks): the widest
    // source's E = bt / ratio rows per block bound the blocks.
    int64_t per_block = 0;
    for (int il = 0; il < hp->n_layer; il++)
        if (hp->kv_source[il] && bt / hp->compress_ratio[il] > per_block)
            per_block = bt / hp->compress_ratio[il];
    return per_block > 0 && cap / per_block < cap ? cap / per_block : cap;
}

// The most entry blocks every stage of the device-resident forward holds in the memory its
// backend reports free now (the weights are up) less the plan's reserve (di_model_options
// dev_reserve_bytes) and the stage's fixed state (the slots' tails, call rows, scratch:
// di_dsv4_dev_stage_cost / di_dsv41_dev_stage_cost, the split's own numbers); *stage the
// bottleneck. -1 where some backend cannot say (kv_memory_bytes alone sizes the blocks then).
static int64_t dev_mem_blocks(const di_engine *e, int32_t *stage) {
    const di_model *m = e->model;
    const int32_t n = m->dev ? di_dsv4_dev_n_stages(m->dev) : di_dsv41_dev_n_stages(m->dev41);
    di_backend *bs[DI_DEV_SPLIT_MAX_STAGES];
    int32_t l0[DI_DEV_SPLIT_MAX_STAGES], l1[DI_DEV_SPLIT_MAX_STAGES];
    int64_t budget[DI_DEV_SPLIT_MAX_STAGES];
    for (int32_t k = 0; k < n; k++)
        bs[k] = m->dev ? di_dsv4_dev_stage(m->dev, k, &l0[k], &l1[k])
                       : di_dsv41_dev_stage(m->dev41, k, &l0[k], &l1[k]);
    const size_t res =
        m->opt.dev_reserve_bytes ? m->opt.dev_reserve_bytes : DI_DEV_RESERVE_DEFAULT_BYTES;
    if (!di_dev_stage_budgets(bs, n, (int64_t)res, budget)) return -1;
    int64_t best = INT64_MAX;
    for (int32_t k = 0; k < n; k++) {
        di_dev_stage_cost c;
        if (m->dev)
            di_dsv4_dev_stage_cost(m, l0[k], l1[k], &c);
        else
            di_dsv41_dev_stage_cost(m, l0[k], l1[k], &c);
        const int64_t left = budget[k] - c.fixed_bytes;
        const int64_t v = left < 0 ? 0 : c.block_bytes > 0 ? left / c.block_bytes : INT64_MAX;
        DI_LOG_INFO("engine: device stage %d: %.1f MiB free less the reserve, %.1f MiB of fixed "
                    "state, %lld bytes per block: %lld blocks",
                    (int)k, (double)budget[k] / 1048576.0, (double)c.fixed_bytes / 1048576.0,
                    (long long)c.block_bytes, v == INT64_MAX ? -1LL : (long long)v);
        if (v < best) best = v, *stage = k;
    }
    return best;
}

// n_rows: a step's rows (its verify rows included). V4.1 with speculation: a draft call's block
// rows fit too, and the state runs DSpark.
static di_status dev_state_create(di_engine *e, int32_t n_rows, int32_t n_blocks, int32_t bt) {
    const di_engine_options *o = &e->opt;
    if (e->model->dev)
        return di_dsv4_dev_state_create(e->model->dev, o->max_seqs, o->max_ctx, n_rows, n_blocks,
                                        bt, &e->dstate);
    if (e->spec_k > 0) {
        const int32_t nd =
            o->max_seqs < DI_ENGINE_DRAFT_CHUNK ? o->max_seqs : DI_ENGINE_DRAFT_CHUNK;
        if (nd * e->model->hp.dspark_block_size > n_rows)
            n_rows = nd * e->model->hp.dspark_block_size;
    }
    di_status st = di_dsv41_dev_state_create(e->model->dev41, o->max_seqs, o->max_ctx, n_rows,
                                             n_blocks, bt, &e->dstate41);
    if (st == DI_OK && e->spec_k > 0) st = di_dsv41_dev_dspark_enable(e->dstate41);
    return st;
}

static void dev_state_destroy(di_engine *e) {
    di_dsv4_dev_state_destroy(e->dstate);
    di_dsv41_dev_state_destroy(e->dstate41);
    e->dstate = NULL;
    e->dstate41 = NULL;
}

static int64_t dev_state_bytes(const di_engine *e) {
    if (e->dstate) return di_dsv4_dev_state_bytes(e->dstate);
    return e->dstate41 ? di_dsv41_dev_state_bytes(e->dstate41) : 0;
}

// One call: seqs in V4's form; prefix[i] (V4.1; NULL: none) the tokens of sequence i's request,
// of which a replay's start reads those before its win_lo (Engram).
// greedy, picks: di_dsv4_dev_forward_picks's (NULL: every row's logits).
static di_status dev_forward(di_engine *e, const di_dsv4_dev_seq *seqs,
                             const int32_t *const *prefix, int32_t n_seq, const int32_t *tokens,
                             const int32_t *logit_rows, int32_t n_logit_rows, float *logits,
                             const uint8_t *greedy, int32_t *picks) {
    if (e->dstate)
        return di_dsv4_dev_forward_picks(e->dstate, seqs, n_seq, tokens, logit_rows, n_logit_rows,
                                         logits, greedy, picks);
    for (int32_t i = 0; i < n_seq; i++)
        e->x_dev41[i] = (di_dsv41_dev_seq){.slot = seqs[i].slot,
                                           .pos = seqs[i].pos,
                                           .n_tok = seqs[i].n_tok,
                                           .blocks = seqs[i].blocks,
                                           .n_blocks = seqs[i].n_blocks,
                                           .win_lo = seqs[i].win_lo,
                                           .n_cached = seqs[i].n_cached,
                                           .prefix = prefix ? prefix[i] : NULL};
    return di_dsv41_dev_forward_picks(e->dstate41, e->x_dev41, n_seq, tokens, logit_rows,
                                      n_logit_rows, logits, greedy, picks);
}

static di_status dev_prepare_decode(di_engine *e) {
    return e->dstate ? di_dsv4_dev_prepare_decode(e->dstate, e->opt.max_seqs)
                     : di_dsv41_dev_prepare_decode(e->dstate41, e->opt.max_seqs);
}

static size_t dev_tail_bytes(const di_engine *e) {
    return e->model->dev ? di_dsv4_dev_tail_bytes(e->model->dev)
                         : di_dsv41_dev_tail_bytes(e->model->dev41);
}

static di_status dev_tail_check(const di_engine *e, int32_t pos, const void *snap) {
    return e->model->dev ? di_dsv4_dev_tail_check(e->model->dev, pos, snap)
                         : di_dsv41_dev_tail_check(e->model->dev41, pos, snap);
}

static di_status dev_tail_save(di_engine *e, int32_t slot, void *dst) {
    return e->dstate ? di_dsv4_dev_tail_save(e->dstate, slot, dst)
                     : di_dsv41_dev_tail_save(e->dstate41, slot, dst);
}

// tokens: the request's, of which V4.1 reads [0, pos) (the Engram history).
static di_status dev_tail_restore(di_engine *e, int32_t slot, int32_t pos, const void *src,
                                  const int32_t *tokens) {
    return e->dstate ? di_dsv4_dev_tail_restore(e->dstate, slot, pos, src)
                     : di_dsv41_dev_tail_restore(e->dstate41, slot, pos, src, tokens);
}

static di_status dev_read_block(const di_engine *e, int32_t block, void *dst) {
    if (e->dstate) return di_dsv4_dev_state_read_block(e->dstate, block, dst);
    return e->dstate41 ? di_dsv41_dev_state_read_block(e->dstate41, block, dst) : DI_ERR_INVALID;
}

static di_status dev_write_block(di_engine *e, int32_t block, const void *src) {
    if (e->dstate) return di_dsv4_dev_state_write_block(e->dstate, block, src);
    return e->dstate41 ? di_dsv41_dev_state_write_block(e->dstate41, block, src) : DI_ERR_INVALID;
}

// V4.1's counts in V4's struct (no page-table changes to count there: n_direct_pages 0).
static void dev_graph_stats(const di_engine *e, di_dsv4_dev_graph_stats *out) {
    memset(out, 0, sizeof *out);
    if (e->dstate) {
        di_dsv4_dev_get_graph_stats(e->dstate, out);
    } else if (e->dstate41) {
        di_dsv41_dev_graph_stats g;
        di_dsv41_dev_get_graph_stats(e->dstate41, &g);
        *out = (di_dsv4_dev_graph_stats){.n_direct = g.n_direct,
                                         .n_captured = g.n_captured,
                                         .n_replayed = g.n_replayed,
                                         .n_cached = g.n_cached,
                                         .last_ops = g.last_ops,
                                         .last_uploads = g.last_uploads,
                                         .last_upload_bytes = g.last_upload_bytes,
                                         .n_handover_peer = g.n_handover_peer,
                                         .n_handover_host = g.n_handover_host,
                                         .last_handover_bytes = g.last_handover_bytes,
                                         .last_download_bytes = g.last_download_bytes,
                                         .n_download_bytes = g.n_download_bytes};
    }
}

// ---- create / destroy ----

// The warm-up call of the device-resident forward at create: max_rows rows (at most the context)
// of token 0 on slot 0, so that a backend growing its op scratch on the first call of a size (the
// CPU twin: matmul and MoE rows) does it here and not inside a step; it also surfaces a broken
// device at create rather than on the first request; with MTP speculation the MTP call follows
// on its rows. Then the decode graph of every batch size up to max_seqs is captured
// (di_dsv4_dev_prepare_decode, di_dsv41_dev_prepare_decode; with V4's speculation the verify
// steps' too, _prepare_verify), so that
// no step captures (a capture allocates). The slots used restart at pos 0 when first used.
static di_status dev_warm_up(di_engine *e) {
    const di_engine_options *o = &e->opt;
    // With MTP speculation: a step's rows with its verify rows, then the MTP call on them.
    const int32_t rows = o->max_batch_tokens + o->max_seqs * e->spec_k;
    int32_t n = rows < o->max_ctx ? rows : o->max_ctx;
    int32_t *tok = e->spec_k > 0 ? e->x_vtokens : e->x_tokens;
    memset(tok, 0, sizeof(int32_t) * (size_t)n);
    // Blocks 0.. of the pool: all free now (nothing is cached yet), so whatever the call writes
    // is overwritten before anything reads it.
    const int32_t nb = (n + e->kv->block_tokens - 1) / e->kv->block_tokens;
    for (int32_t i = 0; i < nb; i++) e->x_blocks[i] = i;
    di_dsv4_dev_seq sq = {.slot = 0, .pos = 0, .n_tok = n, .blocks = e->x_blocks, .n_blocks = nb};
    int32_t last = n - 1;
    di_status st = dev_forward(e, &sq, NULL, 1, tok, &last, 1, e->logits, NULL, NULL);
    if (st == DI_OK && e->spec_k > 0 && e->dstate41) { // V4.1's DSpark: a draft call on slot 0
        e->x_dd[0] = (di_dsv41_dev_draft_seq){.slot = 0, .anchor = 0};
        st = di_dsv41_dev_draft(e->dstate41, e->x_dd, 1, NULL);
    }
    if (st == DI_OK && e->spec_k > 0 && e->dstate) { // V4's MTP speculation
        for (int32_t t = 0; t < n; t++) e->x_mrows[t] = t;
        memset(e->x_mids, 0, sizeof(int32_t) * (size_t)n);
        st = di_dsv4_dev_mtp_forward(e->dstate, &sq, 1, e->x_mrows, e->x_mids, &last, 1,
                                     e->mtp_logits);
    }
    if (st == DI_OK) st = dev_prepare_decode(e);
    if (st == DI_OK && e->spec_k > 0 && e->dstate)
        st = di_dsv4_dev_prepare_verify(e->dstate, o->max_seqs);
    if (st == DI_OK && e->spec_k > 0 && e->dstate41) // verify steps of 1 .. spec_k drafts
        st = di_dsv41_dev_prepare_verify(e->dstate41, o->max_seqs, e->spec_k + 1);
    if (st != DI_OK)
        DI_LOG_ERROR("engine: the device-resident forward failed its warm-up call of %d rows: %s",
                     (int)n, di_status_str(st));
    return st;
}

// The device-resident forward's kv_manager (accounting only): kv_memory_bytes pays for the
// max_seqs slots' tails first (window and compressor rings, page tables; V4.1: window rings and
// the ratio-2 sources' C and Z rings), the rest for entry blocks, capped by the blocks every
// stage's memory holds (dev_mem_blocks); with kv_memory_bytes 0 (kv_auto) and stages that report
// their memory, that cap alone, and kv_memory_bytes becomes what the slots and blocks take. The
// dev state is created with exactly these blocks.
static di_status dev_kv_create(di_engine *e) {
    di_engine_options *o = &e->opt;
    const int32_t bt = di_kv_block_tokens(e->model);
    int64_t blk = 0, slot = 0;
    di_status st = dev_sizes(e, o->max_ctx, bt, &blk, &slot);
    if (st != DI_OK) return st;
    DI_ASSERT(bt == dev_block_tokens(e) && blk > 0);
    // A block's device memory: V4.1 stages keep mirrors of the kv sources later stages read.
    int64_t mem = blk;
    if (e->model->dev41) {
        st = di_dsv41_dev_block_mem_bytes(e->model->dev41, bt, &mem, NULL);
        if (st != DI_OK) return st;
    }
    const int64_t tails = slot * o->max_seqs;
    const int64_t need = (int64_t)((o->max_ctx + bt - 1) / bt) * mem;
    // The memory the stages have left bounds the blocks: those every stage holds.
    int32_t neck = 0;
    const int64_t fit = dev_mem_blocks(e, &neck);
    if (fit >= 0 && fit < (o->max_ctx + bt - 1) / bt) {
        DI_LOG_ERROR("engine: device stage %d has memory for %lld entry blocks, fewer than one "
                     "sequence of %d positions needs (%d)",
                     (int)neck, (long long)fit, (int)o->max_ctx, (int)((o->max_ctx + bt - 1) / bt));
        return DI_ERR_NOMEM;
    }
    if (e->kv_auto && fit >= 0) {
        // fit is at most the blocks of one stage's memory (no larger than a device): it fits
        // size_t and the int64 arithmetic below.
        o->kv_memory_bytes = (size_t)(tails + fit * mem);
        DI_LOG_INFO("engine: the KV from the devices' memory: %d slot tails of %.1f MiB and %lld "
                    "entry blocks of %.1f KiB (%.2f GiB; device stage %d bounds it)",
                    (int)o->max_seqs, (double)slot / 1048576.0, (long long)fit,
                    (double)mem / 1024.0, (double)o->kv_memory_bytes / 1073741824.0, (int)neck);
    }
    if ((int64_t)o->kv_memory_bytes < tails + need) {
        DI_LOG_ERROR("engine: --kv-memory %zu bytes cannot hold the device state of %d slots "
                     "(%lld bytes of window and compressor rings) plus one sequence of %d "
                     "positions (%lld bytes of entry blocks)",
                     o->kv_memory_bytes, (int)o->max_seqs, (long long)tails, (int)o->max_ctx,
                     (long long)need);
        return DI_ERR_INVALID;
    }
    int64_t n = ((int64_t)o->kv_memory_bytes - tails) / mem;
    if (fit >= 0 && fit < n) {
        DI_LOG_INFO("engine: --kv-memory's %lld entry blocks exceed what device stage %d has left "
                    "(%lld): using %lld",
                    (long long)n, (int)neck, (long long)fit, (long long)fit);
        n = fit;
    }
    // The dev state indexes rows of its pools with int32: cap the blocks so they fit (V4-Flash,
    // 32 CSA entries per block: about 33M blocks, far beyond any device's memory).
    const int64_t cap = dev_block_cap(e, bt);
    if (n > cap) {
        DI_LOG_WARN("engine: %lld entry blocks exceed the device state's row index; using %lld",
                    (long long)n, (long long)cap);
        n = cap;
    }
    e->dev_block_bytes = blk;
    return di_kv_manager_create_accounting(e->model, (int32_t)n, (size_t)blk, o->max_seqs,
                                           o->max_ctx, !o->no_prefix_cache, &e->kv);
}

// The V4.1 forward's sessions and kv_manager. The sessions share the engine's workspace (a step's
// one call runs them all on it, its per-row scratch sized here for a step's rows; like the CPU
// forward's, it is not part of kv_memory_bytes). A slot's session holds only the per-slot tail
// (window and DSpark rings, (C, Z) slots, the Engram history of max_ctx positions), reserved now;
// its entries and index keys live in the kv_manager's blocks (V4.1 pages), bound to the session
// through its sequence's block table (di_dsv41_bind_pages at launch). kv_memory_bytes pays the
// max_seqs tails first (max_seqs is clamped so that one max_ctx sequence's blocks still fit) and
// buys blocks with the rest: sequences grow block by block, admission reserves blocks as on V4,
// and the scheduler preempts (recompute) when they run out.
// A sequence's block table as V4.1 pages: the kv_manager keeps its block addresses as V4's float
// entry blocks; the V4.1 forward stores packed bytes in the same blocks.
static uint8_t *const *v41_pages(const di_kv_seq *ks) {
    return (uint8_t *const *)ks->pages;
}

static di_status v41_create(di_engine *e) {
    di_engine_options *o = &e->opt;
    di_status st = DI_OK;
    // With speculation the sessions run DSpark (its rings and draft scratch are part of a slot's
    // bytes), a draft reserves the Engram history dspark_block_size positions past the last one
    // fed and runs dspark_block_size rows, and a step's call feeds up to spec_k verify rows more
    // per sampled sequence than its plan: all reserved here, so that no step allocates.
    di_session_options so = {.n_ctx_max = o->max_ctx, .mtp = e->spec_k > 0};
    const int32_t B = e->model->hp.dspark_block_size;
    const int32_t n_ctx_res = o->max_ctx + (e->spec_k > 0 ? B : 0);
    int32_t n_rows_res = o->max_batch_tokens + o->max_seqs * e->spec_k;
    if (e->spec_k > 0 && n_rows_res < B + 1) n_rows_res = B + 1;
    const int32_t bt = di_kv_block_tokens(e->model);
    const int32_t max_blocks = (o->max_ctx + bt - 1) / bt;
    const int64_t blk = (int64_t)di_kv_v41_block_bytes(e->model);
    e->v41 = di_calloc((size_t)o->max_seqs, sizeof *e->v41);
    if (!e->v41) return DI_ERR_NOMEM;
    for (int32_t i = 0; i < o->max_seqs; i++) {
        DI_TRY(di_session_create(e->model, &so, &e->v41[i]));
        e->n_v41 = i + 1;
        di_dsv41_share_ws(e->v41[i], &e->ws);    // the step's call runs every slot on it
        di_dsv41_bind_pages(e->v41[i], NULL, 0); // its blocks come from the pool (at launch)
        DI_TRY(di_dsv41_reserve_ctx(e->v41[i], n_ctx_res, n_rows_res));
        if (i > 0) continue;
        // A step's draft call: a block of B rows for every slot, their head scratch.
        if (e->spec_k > 0) {
            DI_TRY(di_dsv41_ws_reserve(&e->ws, e->model, o->max_seqs * B, n_ctx_res));
            DI_TRY(di_dsv41_ws_reserve_draft(&e->ws, e->model, o->max_seqs));
        }
        e->v41_slot_bytes = di_dsv41_state_bytes(e->v41[0]);
        // The tails of the slots, and the blocks of one max_ctx sequence at least.
        const int64_t one = (int64_t)max_blocks * blk;
        const int64_t fit = ((int64_t)o->kv_memory_bytes - one) / e->v41_slot_bytes;
        if ((int64_t)o->kv_memory_bytes < one || fit < 1) {
            DI_LOG_ERROR("engine: --kv-memory %zu bytes cannot hold one V4.1 sequence of %d "
                         "positions: its slot's tail (rings, history: %lld bytes) and %d blocks "
                         "of %lld bytes",
                         o->kv_memory_bytes, (int)o->max_ctx, (long long)e->v41_slot_bytes,
                         (int)max_blocks, (long long)blk);
            return DI_ERR_INVALID;
        }
        if (fit < o->max_seqs) {
            DI_LOG_INFO("engine: --kv-memory %zu bytes holds %lld V4.1 slot tails of %lld bytes "
                        "besides one sequence's blocks: max_seqs %d -> %lld",
                        o->kv_memory_bytes, (long long)fit, (long long)e->v41_slot_bytes,
                        (int)o->max_seqs, (long long)fit);
            o->max_seqs = (int32_t)fit;
        }
    }
    const int64_t tails = (int64_t)o->max_seqs * e->v41_slot_bytes;
    int64_t n_blocks = ((int64_t)o->kv_memory_bytes - tails) / blk;
    if (n_blocks > INT32_MAX / 2) n_blocks = INT32_MAX / 2;
    DI_TRY(di_kv_manager_create_v41(e->model, (int32_t)n_blocks, o->max_seqs, o->max_ctx,
                                    !o->no_prefix_cache, &e->kv));
    DI_ASSERT(e->kv->block_tokens == bt);
    for (int32_t i = 0; i < o->max_seqs; i++)
        di_dsv41_bind_pages(e->v41[i], v41_pages(&e->kv->seqs[i]), 0);
    DI_LOG_INFO("engine: V4.1 --kv-memory %zu bytes = %d slot tails of %.2f MiB (rings, history) + "
                "%lld blocks of %.1f KiB (%d positions each; a max_ctx sequence takes %d)",
                o->kv_memory_bytes, (int)o->max_seqs, (double)e->v41_slot_bytes / (1 << 20),
                (long long)n_blocks, (double)blk / 1024, (int)bt, (int)max_blocks);
    DI_LOG_INFO("engine: the V4.1 forward: %d slots of up to %d positions, %d rows per step, "
                "%.1f MiB of workspace shared by the slots, one batched call per step, prefix "
                "cache %s",
                (int)o->max_seqs, (int)o->max_ctx, (int)o->max_batch_tokens,
                (double)di_dsv4_ws_bytes(&e->ws) / (1 << 20), o->no_prefix_cache ? "off" : "on");
    if (e->spec_k > 0)
        DI_LOG_INFO("engine: speculative decoding with DSpark: up to %d drafts per verify, "
                    "confidence cut %g",
                    (int)e->spec_k, (double)e->spec_tau);
    return DI_OK;
fail: // what was created is the engine's (di_engine_destroy frees it)
    return st;
}

// Speculative decoding's options against the loaded model: refused (DI_ERR_UNSUPPORTED) where
// there is nothing to draft with (no DSpark on V4.1, no MTP block on V4), rather than silently
// off: a user who asks for it on the wrong checkpoint should hear so at start. spec_tokens beyond
// what one draft step makes (the DSpark block; V4's MTP block: one token) is capped (logged). On
// the device-resident forward the MTP block is uploaded here, before the dev state.
static di_status spec_setup(di_engine *e) {
    di_engine_options *o = &e->opt;
    const di_hparams *hp = &e->model->hp;
    e->lstride = 1;
    if (o->spec_tokens == 0) return DI_OK;
    if (!hp->v41) {
        if (e->model->n_mtp_loaded == 0) {
            DI_LOG_ERROR("engine: speculative decoding (spec_tokens %d) on a V4 checkpoint drafts "
                         "with its MTP block (mtp.*); this checkpoint has none",
                         (int)o->spec_tokens);
            return DI_ERR_UNSUPPORTED;
        }
        if (e->model->mtp[0].block.ratio != 0) { // spec §2.10: the MTP block is SWA
            DI_LOG_ERROR("engine: speculative decoding needs a sliding-window MTP block; this "
                         "checkpoint's compresses (ratio %d)",
                         (int)e->model->mtp[0].block.ratio);
            return DI_ERR_UNSUPPORTED;
        }
        e->spec_tau = -1; // the MTP block has no confidence head: its draft is always verified
        e->stats.spec_drafter = "MTP";
    } else {
        if (e->model->n_mtp_loaded == 0 || hp->dspark_block_size < 1) {
            DI_LOG_ERROR("engine: speculative decoding (spec_tokens %d) needs the checkpoint's "
                         "DSpark weights (mtp.*); this V4.1 checkpoint has none",
                         (int)o->spec_tokens);
            return DI_ERR_UNSUPPORTED;
        }
        e->spec_tau =
            o->spec_min_confidence == 0 ? DI_SPEC_MIN_CONFIDENCE_DEFAULT : o->spec_min_confidence;
        e->stats.spec_drafter = "DSpark";
    }
    // One draft step makes at most: V4's MTP block one token, V4.1's DSpark block its size.
    const int32_t k_max = hp->v41 ? hp->dspark_block_size : 1;
    if (o->spec_tokens > k_max) {
        DI_LOG_INFO("engine: spec_tokens %d -> %d (%s)", (int)o->spec_tokens, (int)k_max,
                    hp->v41 ? "the DSpark block size" : "the MTP block drafts one token per step");
        o->spec_tokens = k_max;
    }
    e->spec_k = o->spec_tokens;
    e->lstride = e->spec_k + 1;
    // The device-resident forward runs the MTP block too: uploaded before its state (whose slots
    // then hold MTP window rings, paid from kv_memory_bytes through di_dsv4_dev_sizes).
    if (e->model->dev) return di_dsv4_dev_mtp_enable(e->model->dev);
    return DI_OK;
}

// The arrays both MTP speculation paths use (the CPU forward's mtp_create, the device-resident
// forward's dev_spec_create): each slot's draft, the MTP logits, and the step's call of n_rows rows
// with its verify rows and its MTP call's next tokens. False: out of memory (the engine frees
// what was made).
static bool spec_arrays_create(di_engine *e, size_t n_rows) {
    const size_t ms = (size_t)e->opt.max_seqs;
    e->mtp_draft = di_calloc(ms, sizeof(int32_t));
    e->mtp_draft_pos = di_calloc(ms, sizeof(int32_t));
    e->mtp_draft_req = di_calloc(ms, sizeof(uint64_t));
    e->mtp_logits = di_malloc(sizeof(float) * ms * (size_t)e->model->hp.n_vocab);
    e->mtp_pick = di_calloc(ms, sizeof(int32_t));
    e->mtp_all = di_malloc(ms);
    if (e->mtp_all) memset(e->mtp_all, 1, ms);
    e->x_vtokens = di_malloc(sizeof(int32_t) * n_rows);
    e->x_vlogit = di_malloc(sizeof(int32_t) * ms * (size_t)e->lstride);
    e->x_cap = di_calloc(ms, sizeof(int32_t));
    e->x_mids = di_malloc(sizeof(int32_t) * n_rows);
    e->x_mlogit = di_malloc(sizeof(int32_t) * ms);
    e->x_mseq = di_malloc(sizeof(int32_t) * ms);
    e->x_bk = di_malloc(sizeof(int32_t) * ms);
    return e->mtp_draft && e->mtp_draft_pos && e->mtp_draft_req && e->mtp_logits && e->mtp_pick &&
           e->mtp_all && e->x_vtokens && e->x_vlogit && e->x_cap && e->x_mids && e->x_mlogit &&
           e->x_mseq && e->x_bk;
}

// The CPU forward with MTP speculation (V4): every slot also holds the MTP block's window ring
// (W + ROLLBACK_MAX rows of Dh: the attention's ring layout; the MTP state never rolls back, it
// runs only on kept rows), paid from kv_memory_bytes before the KV manager buys its blocks, and a
// draft; the step's call and the MTP call have their row arrays. The slots' MTP states are bound
// once: a new sequence in a slot reads no ring row it has not written (positions below its win_lo
// are never read).
static di_status mtp_create(di_engine *e) {
    di_engine_options *o = &e->opt;
    const di_hparams *hp = &e->model->hp;
    const int32_t ring_rows = DI_DSV4_RING_ROWS(hp->window);
    const size_t nl = (size_t)hp->n_layer + 1, ms = (size_t)o->max_seqs;
    const size_t n_rows = (size_t)o->max_batch_tokens + ms * (size_t)e->spec_k;
    e->mtp_slot_bytes = (int64_t)sizeof(float) * ring_rows * hp->head_dim;
    const int64_t tails = e->mtp_slot_bytes * o->max_seqs;
    if ((int64_t)o->kv_memory_bytes <= tails) {
        DI_LOG_ERROR("engine: --kv-memory %zu bytes cannot hold the MTP rings of %d slots (%lld "
                     "bytes)",
                     o->kv_memory_bytes, (int)o->max_seqs, (long long)tails);
        return DI_ERR_INVALID;
    }
    di_status st = di_kv_manager_create(e->model, o->kv_memory_bytes - (size_t)tails, o->max_seqs,
                                        o->max_ctx, !o->no_prefix_cache, &e->kv);
    if (st != DI_OK) return st;
    e->mtp_ls = di_calloc(ms * nl, sizeof *e->mtp_ls);
    e->mtp_ring = di_aligned_calloc((size_t)tails);
    e->x_vseqs = di_calloc(ms, sizeof *e->x_vseqs);
    e->x_mseqs = di_calloc(ms, sizeof *e->x_mseqs);
    if (!spec_arrays_create(e, n_rows) || !e->mtp_ls || !e->mtp_ring || !e->x_vseqs || !e->x_mseqs)
        return DI_ERR_NOMEM;
    for (size_t i = 0; i < ms; i++)
        e->mtp_ls[i * nl + nl - 1].ring =
            e->mtp_ring + i * (size_t)ring_rows * (size_t)hp->head_dim;
    DI_LOG_INFO("engine: speculative decoding with the MTP block: one draft per verify; "
                "--kv-memory %zu bytes = %d MTP rings of %.1f KiB + the KV pool",
                o->kv_memory_bytes, (int)o->max_seqs, (double)e->mtp_slot_bytes / 1024);
    return DI_OK;
}

// MTP speculation on the device-resident forward: the drafts per slot and the arrays of the
// step's call (verify rows included) and of the MTP call; the MTP rings are the dev state's.
static di_status dev_spec_create(di_engine *e) {
    const di_engine_options *o = &e->opt;
    const size_t ms = (size_t)o->max_seqs;
    const size_t n_rows = (size_t)o->max_batch_tokens + ms * (size_t)e->spec_k;
    e->x_vdev = di_calloc(ms, sizeof *e->x_vdev);
    e->x_mdev = di_calloc(ms, sizeof *e->x_mdev);
    e->x_mrows = di_malloc(sizeof(int32_t) * n_rows);
    if (!spec_arrays_create(e, n_rows) || !e->x_vdev || !e->x_mdev || !e->x_mrows)
        return DI_ERR_NOMEM;
    if (e->dstate41) { // DSpark: the step's draft call
        e->x_dd = di_calloc(ms, sizeof *e->x_dd);
        e->x_dseq = di_malloc(sizeof(int32_t) * ms);
        e->x_dkmax = di_malloc(sizeof(int32_t) * ms);
        if (!e->x_dd || !e->x_dseq || !e->x_dkmax) return DI_ERR_NOMEM;
        DI_LOG_INFO("engine: speculative decoding with DSpark on the device-resident forward: up "
                    "to %d drafts per verify, confidence cut %g",
                    (int)e->spec_k, (double)e->spec_tau);
        return DI_OK;
    }
    DI_LOG_INFO("engine: speculative decoding with the MTP block on the device-resident forward: "
                "one draft per verify");
    return DI_OK;
}

static di_status create(const char *model_dir, const di_engine_options *opt,
                        di_engine_prepare_fn prepare, void *prepare_user, di_engine **out) {
    di_status st = DI_OK;
    di_engine *e = di_calloc(1, sizeof *e);
    if (!e) return DI_ERR_NOMEM;
    e->opt = opt ? *opt : di_engine_options_default();
    e->glim = di_grammar_matcher_limits_default();
    di_engine_options *o = &e->opt;
    e->kv_auto = !o->kv_memory_bytes;
    if (!o->kv_memory_bytes)
        o->kv_memory_bytes = (size_t)256 << 20; // unless dev_kv_create sizes it
    if (!o->max_seqs) o->max_seqs = 16;
    if (!o->max_batch_tokens) o->max_batch_tokens = 256;
    if (!o->max_ctx) o->max_ctx = 8192;
    if (!o->max_queue) o->max_queue = 1024;
    pthread_mutex_init(&e->mu, NULL);
    pthread_mutex_init(&e->fmu, NULL);
    pthread_cond_init(&e->fcv, NULL);
    pthread_cond_init(&e->cv_work, NULL);
    pthread_cond_init(&e->cv_idle, NULL);
    pthread_cond_init(&e->cv_job, NULL);
    if (o->max_seqs < 1 || o->max_batch_tokens < o->max_seqs || o->max_ctx < 2 ||
        o->max_queue < 1 || o->priority_aging_ms < 0) {
        DI_LOG_ERROR("engine: need max_seqs >= 1, max_batch_tokens >= max_seqs, max_ctx >= 2, "
                     "priority_aging_ms >= 0");
        st = DI_ERR_INVALID;
        goto fail;
    }
    if (o->device_loss_max < 0 || o->device_loss_window_s < 0) {
        DI_LOG_ERROR("engine: need device_loss_max >= 0 and device_loss_window_s >= 0");
        st = DI_ERR_INVALID;
        goto fail;
    }
    if (!o->device_loss_max) o->device_loss_max = 3;
    if (!o->device_loss_window_s) o->device_loss_window_s = 600;
    e->loss_ms = di_calloc((size_t)o->device_loss_max + 1, sizeof *e->loss_ms);
    if (!e->loss_ms) {
        st = DI_ERR_NOMEM;
        goto fail;
    }
    if (o->spec_tokens < 0 || o->spec_tokens > DI_MAX_SPEC_TOKENS ||
        !(o->spec_min_confidence >= -1.0f && o->spec_min_confidence <= 1.0f)) {
        DI_LOG_ERROR("engine: need spec_tokens in [0, %d] and spec_min_confidence in [-1, 1]",
                     DI_MAX_SPEC_TOKENS);
        st = DI_ERR_INVALID;
        goto fail;
    }
    di_model_options mo = {.n_threads = o->n_threads,
                           .precision = o->precision,
                           .device = o->device,
                           .ep_workers = o->ep_workers,
                           .ep_placement = o->ep_placement,
                           .cp_workers = o->cp_workers,
                           .cp_min_tokens = o->cp_min_tokens,
                           // The state the pipeline stages' split balances KV capacity for
                           // (dev_kv_create; spec_setup may cap spec_tokens: an upper bound).
                           .dev_slots = o->max_seqs,
                           .dev_ctx = o->max_ctx,
                           .dev_rows = o->max_batch_tokens + o->max_seqs * o->spec_tokens,
                           .dev_spec = o->spec_tokens > 0,
                           .dev_reserve_bytes = o->dev_reserve_bytes};
    DI_TRY(di_model_load(model_dir, &mo, &e->model));
    if (prepare) DI_TRY(prepare(e->model, prepare_user));
    const di_hparams *hp = &e->model->hp;
    DI_TRY(di_ep_load_create(hp->n_layer + e->model->n_mtp_loaded, hp->n_expert, &e->expert_load));
    e->model->expert_load = e->expert_load;
    if (o->eplb_interval < 0 || o->eplb_slots_per_rank < 0 || !(o->eplb_min_gain >= 0)) {
        DI_LOG_ERROR("engine: need eplb_interval >= 0, eplb_slots_per_rank >= 0 and "
                     "eplb_min_gain >= 0");
        st = DI_ERR_INVALID;
        goto fail;
    }
    if (o->eplb_interval > 0) {
        if (!e->model->ep) {
            DI_LOG_ERROR("engine: online EPLB (eplb_interval) rebalances expert workers: it needs "
                         "ep_workers");
            st = DI_ERR_INVALID;
            goto fail;
        }
        const int32_t ranks = di_ep_n_workers(e->model->ep) + 1;
        if (o->eplb_slots_per_rank && (int64_t)o->eplb_slots_per_rank * ranks < hp->n_expert) {
            DI_LOG_ERROR("engine: %d ranks x %d slots cannot hold the %d experts of a layer", ranks,
                         o->eplb_slots_per_rank, hp->n_expert);
            st = DI_ERR_INVALID;
            goto fail;
        }
        DI_TRY(di_eplb_async_create(di_ep_load_n_layers(e->expert_load), hp->n_expert, eplb_done, e,
                                    &e->eplb));
        e->eplb_next_step = o->eplb_interval;
    }
    if (o->max_ctx > hp->max_pos) o->max_ctx = (int32_t)hp->max_pos;
    e->eos = hp->eos_token;
    DI_TRY(spec_setup(e));
    // The device-resident forward when the model has one attached: V4's (with or without MTP
    // speculation), V4.1's (with or without DSpark speculation).
    e->dev_on = e->model->dev || e->model->dev41;
    if (e->dev_on)
        DI_TRY(dev_kv_create(e));
    else if (hp->v41)
        DI_TRY(v41_create(e));
    else if (e->spec_k > 0)
        DI_TRY(mtp_create(e));
    else
        DI_TRY(di_kv_manager_create(e->model, o->kv_memory_bytes, o->max_seqs, o->max_ctx,
                                    !o->no_prefix_cache, &e->kv));
    if (e->dev_on) {
        // The accounting manager's blocks are the dev state's entry blocks: the disk tier and
        // the KV transfer reach their contents through this (engine thread, no forward call in
        // flight, or the forward thread before its call: "the disk tier on the device-resident
        // forward", "KV transfer" below).
        const di_kv_block_io bio = {.user = e,
                                    .block_bytes = (size_t)e->dev_block_bytes,
                                    .read = dev_block_read,
                                    .write = dev_block_write};
        DI_TRY(di_kv_manager_set_block_io(e->kv, &bio));
    }
    if (o->kv_disk_dir) {
        di_kv_disk_options dko = {.dir = o->kv_disk_dir,
                                  .max_bytes = o->kv_disk_bytes,
                                  .ttl_s = o->kv_disk_ttl_s,
                                  .queue_bytes = o->kv_disk_queue_bytes,
                                  .read_bytes = o->kv_disk_read_bytes,
                                  .prefetches = o->kv_disk_prefetches};
        DI_TRY(di_kv_manager_open_disk(e->kv, &dko));
        // A done prefetch wakes the engine thread (it may sleep with only that request waiting).
        di_kv_disk_io_set_notify(e->kv->disk_io, disk_read_done, e);
    }
    o->kv_disk_dir = NULL; // borrowed until here
    // A tenant entry for every request the queue bound lets in (more share one entry), at most
    // 65536 (2.5 MiB).
    const int64_t max_tenants = (int64_t)o->max_seqs + o->max_queue;
    DI_TRY(di_sched_init(&e->sched, e->kv, o->max_seqs, o->max_batch_tokens,
                         max_tenants < 65536 ? (int32_t)max_tenants : 65536));
    e->sched.aging_ms = o->priority_aging_ms;
    DI_TRY(tails_open(e));
    e->n_samplers = di_pool_n_threads(e->model->pool);
    e->samplers = di_calloc((size_t)e->n_samplers, sizeof *e->samplers);
    if (!e->samplers) {
        st = DI_ERR_NOMEM;
        goto fail;
    }
    for (int32_t i = 0; i < e->n_samplers; i++)
        DI_TRY(di_sampler_create(hp->n_vocab, &e->samplers[i]));
    if (e->dev_on) {
        // The state's entry blocks are the kv_manager's blocks (same ids, same block size).
        // With MTP speculation a step's call holds its verify rows too.
        DI_TRY(dev_state_create(e, o->max_batch_tokens + o->max_seqs * e->spec_k,
                                di_block_pool_n_total(e->kv->pool), e->kv->block_tokens));
        e->x_dev = di_calloc((size_t)o->max_seqs, sizeof *e->x_dev);
        e->x_blocks = di_malloc(sizeof(int32_t) * (size_t)o->max_seqs * (size_t)e->kv->max_blocks);
        if (e->dstate41) {
            e->x_dev41 = di_calloc((size_t)o->max_seqs, sizeof *e->x_dev41);
            e->x_prefix = di_calloc((size_t)o->max_seqs, sizeof *e->x_prefix);
        }
        if (!e->x_dev || !e->x_blocks || (e->dstate41 && (!e->x_dev41 || !e->x_prefix))) {
            st = DI_ERR_NOMEM;
            goto fail;
        }
        if (e->spec_k > 0) DI_TRY(dev_spec_create(e));
    } else if (e->v41) {
        e->x_slot = di_malloc(sizeof(int32_t) * (size_t)o->max_seqs);
        e->x_b = di_malloc(sizeof *e->x_b * (size_t)o->max_seqs);
        e->x_bk = di_malloc(sizeof(int32_t) * (size_t)o->max_seqs);
        e->x_ver = di_malloc(sizeof(int32_t) * (size_t)o->max_seqs * (size_t)e->lstride);
        e->x_d = di_malloc(sizeof *e->x_d * (size_t)o->max_seqs);
        e->x_dseq = di_malloc(sizeof(int32_t) * (size_t)o->max_seqs);
        e->x_dkmax = di_malloc(sizeof(int32_t) * (size_t)o->max_seqs);
        if (!e->x_slot || !e->x_b || !e->x_bk || !e->x_ver || !e->x_d || !e->x_dseq ||
            !e->x_dkmax) {
            st = DI_ERR_NOMEM;
            goto fail;
        }
    } else {
        // With MTP speculation a step's call holds its verify rows too, and the MTP scratch.
        DI_TRY(di_dsv4_ws_reserve(&e->ws, e->model, o->max_batch_tokens + o->max_seqs * e->spec_k,
                                  o->max_ctx / 4 + 1, e->spec_k > 0));
    }
    const size_t n_lrows = (size_t)o->max_seqs * (size_t)e->lstride; // logit slots' rows
    const size_t logit_bytes = sizeof(float) * n_lrows * (size_t)hp->n_vocab;
    if (e->dev_on) { // downloaded every step: the backend's host memory (page-locked on CUDA)
        di_backend *hb = dev_backend(e);
        void *p = NULL;
        DI_TRY(hb->vt->host_alloc(hb, logit_bytes, &p));
        e->logits = p;
    } else {
        e->logits = di_malloc(logit_bytes);
    }
    e->x_seqs = di_calloc((size_t)o->max_seqs, sizeof *e->x_seqs);
    e->x_tokens = di_malloc(sizeof(int32_t) * (size_t)o->max_batch_tokens);
    e->x_logit_rows = di_malloc(sizeof(int32_t) * (size_t)o->max_seqs);
    e->x_logit_req = di_calloc((size_t)o->max_seqs, sizeof *e->x_logit_req);
    e->x_mask_req = di_calloc((size_t)o->max_seqs, sizeof *e->x_mask_req);
    e->x_res = di_calloc(n_lrows, sizeof *e->x_res);
    e->x_nrows = di_calloc((size_t)o->max_seqs, sizeof(int32_t));
    e->x_emit = di_calloc((size_t)o->max_seqs, sizeof(int32_t));
    e->x_ndraft = di_calloc((size_t)o->max_seqs, sizeof(int32_t));
    e->x_nprop = di_calloc((size_t)o->max_seqs, sizeof(int32_t));
    e->x_lslot = di_calloc((size_t)o->max_seqs, sizeof(int32_t));
    e->x_job = di_calloc(n_lrows, sizeof(int32_t));
    e->x_greedy = di_calloc(n_lrows, 1);
    e->x_pick = di_calloc(n_lrows, sizeof(int32_t));
    e->x_seq_req = di_calloc((size_t)o->max_seqs, sizeof *e->x_seq_req);
    e->marks = di_calloc((size_t)di_block_pool_n_total(e->kv->pool), 1);
    if (!e->logits || !e->x_seqs || !e->x_tokens || !e->x_logit_rows || !e->x_logit_req ||
        !e->x_res || !e->x_seq_req || !e->marks || !e->x_nrows || !e->x_emit || !e->x_ndraft ||
        !e->x_nprop || !e->x_lslot || !e->x_job || !e->x_mask_req || !e->x_greedy || !e->x_pick) {
        st = DI_ERR_NOMEM;
        goto fail;
    }
    if (e->model->cp && e->mtp_ls)
        DI_LOG_WARN("engine: MTP speculation runs its own forward, which does not split prefill "
                    "chunks over the prefill workers (--cp-workers): they run here");
    e->stats.n_blocks_total = di_block_pool_n_total(e->kv->pool);
    e->stats.n_blocks_free = e->stats.n_blocks_total;
    e->stats.block_bytes =
        e->dev_on ? e->dev_block_bytes : (int64_t)di_block_pool_block_bytes(e->kv->pool);
    e->stats.block_tokens = e->kv->block_tokens;
    e->stats.kv_memory_bytes = (int64_t)o->kv_memory_bytes;
    disk_stats(e, &e->stats); // the records found at open
    if (e->dev_on) {
        DI_TRY(dev_warm_up(e));
        e->stats.device.resident = true;
        DI_LOG_INFO("engine: the %s device-resident forward on %s: %d slots of up to %d positions, "
                    "%d entry blocks of %d positions, %d rows per step, %.1f MiB of device "
                    "state, prefix cache %s",
                    e->dstate41 ? "V4.1" : "V4",
                    e->model->dev_backend ? e->model->dev_backend->desc : "an attached backend",
                    (int)o->max_seqs, (int)o->max_ctx, di_block_pool_n_total(e->kv->pool),
                    e->kv->block_tokens, (int)o->max_batch_tokens,
                    (double)dev_state_bytes(e) / (1 << 20), o->no_prefix_cache ? "off" : "on");
    }
    e->next_id = 1;
    const char *sync_env = getenv("DI_ENGINE_SYNC");
    e->sync_debug = sync_env && sync_env[0] == '1';
    // Masks ahead need a CPU the forward leaves idle: the device-resident forward's, or one the
    // model's pool does not use (on a pool over every CPU they would only delay its threads).
    const long n_cpu = sysconf(_SC_NPROCESSORS_ONLN);
    e->masks_ahead = !e->sync_debug && (e->dev_on || di_pool_n_threads(e->model->pool) < n_cpu);
    // Debug switch (conventions §7): DI_ENGINE_FAIL_STEPS=N fails the first N steps as a device
    // fault would (their requests end with DI_ERR_CUDA): a drill of the failure path and of the
    // server's health reporting (docs/server.md) without a device.
    const char *fail_env = getenv("DI_ENGINE_FAIL_STEPS");
    const int n_fail = fail_env ? atoi(fail_env) : 0;
    if (n_fail > 0) {
        DI_LOG_WARN("engine: DI_ENGINE_FAIL_STEPS=%d: the first %d steps fail with %s (a drill)",
                    n_fail, n_fail, di_status_str(DI_ERR_CUDA));
        di_engine_fail_forward(e, 0, n_fail, DI_ERR_CUDA);
    }
    // DI_ENGINE_LOSE_DEVICE=N: the first N steps fail with DI_ERR_DEVICE_LOST without running, a
    // drill of device loss ("device loss" below; docs/server.md): on the device-resident forward
    // each one rebuilds the device state (the bound applies), elsewhere (nothing to rebuild) the
    // first leaves the engine unhealthy.
    const char *lose_env = getenv("DI_ENGINE_LOSE_DEVICE");
    const int n_lose = lose_env ? atoi(lose_env) : 0;
    if (n_lose > 0) {
        DI_LOG_WARN("engine: DI_ENGINE_LOSE_DEVICE=%d: the first %d steps fail with %s (a drill)",
                    n_lose, n_lose, di_status_str(DI_ERR_DEVICE_LOST));
        di_engine_fail_forward(e, 0, n_lose, DI_ERR_DEVICE_LOST);
    }
    if (pthread_create(&e->fwd_thread, NULL, forward_main, e) != 0) {
        st = DI_ERR_NOMEM;
        goto fail;
    }
    e->fwd_started = true;
    if (pthread_create(&e->thread, NULL, engine_main, e) != 0) {
        st = DI_ERR_NOMEM;
        goto fail;
    }
    e->thread_started = true;
    *out = e;
    return DI_OK;
fail:
    di_engine_destroy(e);
    return st;
}

di_status di_engine_create(const char *model_dir, const di_engine_options *opt, di_engine **out) {
    return create(model_dir, opt, NULL, NULL, out);
}

di_status di_engine_create_prepared(const char *model_dir, const di_engine_options *opt,
                                    di_engine_prepare_fn prepare, void *user, di_engine **out) {
    return create(model_dir, opt, prepare, user, out);
}

void di_engine_get_graph_stats(const di_engine *e, di_dsv4_dev_graph_stats *out) {
    dev_graph_stats(e, out);
}

int64_t di_engine_dev_state_bytes(const di_engine *e) {
    return dev_state_bytes(e);
}

void di_engine_set_grammar_limits(di_engine *e, const di_grammar_matcher_limits *lim) {
    e->glim = *lim;
}

void di_engine_fail_forward(di_engine *e, int32_t n_ok, int32_t n_fail, di_status st) {
    atomic_store(&e->fail_in, 0); // no injection while the fields change
    atomic_store(&e->fail_status, (int)st);
    atomic_store(&e->fail_n, n_fail);
    atomic_store(&e->fail_in, n_fail > 0 ? n_ok + 1 : 0);
}

static void lose_stage_backend(di_engine *e, const char *when);

void di_engine_lose_device(di_engine *e, int32_t n_ok, int32_t stage, int64_t after_calls,
                           int32_t n_rebuilds_lost) {
    atomic_store(&e->lose_in, 0); // nothing armed while the fields change
    e->lose_stage = stage;
    e->lose_after = after_calls;
    atomic_store(&e->lose_rebuilds, n_rebuilds_lost);
    if (n_ok < 0) // now, from this thread (the engine idle)
        lose_stage_backend(e, "the next call");
    else
        atomic_store(&e->lose_in, n_ok + 1);
}

void di_engine_set_masks_ahead(di_engine *e, bool on) {
    e->masks_ahead = on;
}

int32_t di_engine_request_blocks(di_engine *e, uint64_t id, int32_t *blocks, int32_t cap,
                                 int64_t *n_free) {
    int32_t slot = -1;
    pthread_mutex_lock(&e->mu);
    for (di_request *r = e->all; r; r = r->all_next)
        if (r->id == id) slot = r->slot;
    pthread_mutex_unlock(&e->mu);
    *n_free = di_block_pool_n_available(e->kv->pool);
    if (slot < 0) return -1;
    const di_kv_seq *ks = &e->kv->seqs[slot];
    for (int32_t i = 0; i < ks->n_blocks && i < cap; i++) blocks[i] = ks->blocks[i];
    return ks->n_blocks;
}

void di_engine_set_draft_hook(di_engine *e, di_engine_draft_fn fn, void *user) {
    e->draft_hook = fn;
    e->draft_user = user;
}

void di_engine_destroy(di_engine *e) {
    if (!e) return;
    if (e->thread_started) {
        pthread_mutex_lock(&e->mu);
        for (di_request *r = e->all; r; r = r->all_next) atomic_store(&r->cancelled, true);
        e->any_cancel = true;
        e->stop = true;
        pthread_cond_broadcast(&e->cv_work);
        pthread_mutex_unlock(&e->mu);
        pthread_join(e->thread, NULL);
    }
    if (e->fwd_started) {
        pthread_mutex_lock(&e->fmu);
        e->f_quit = true;
        pthread_cond_broadcast(&e->fcv);
        pthread_mutex_unlock(&e->fmu);
        pthread_join(e->fwd_thread, NULL);
    }
    di_eplb_async_destroy(e->eplb); // joins the planner (a plan in flight is discarded)
    e->eplb = NULL;
    if (e->kv && e->kv->disk) {
        // Orderly shutdown: no step runs, so every cached block is computed; write back the ones
        // eviction has not written yet (the queued evictions first), so that a restarted engine
        // finds them.
        di_kv_disk_io_hold(e->kv->disk_io, false);
        int32_t n = di_kv_manager_flush_disk(e->kv);
        di_kv_disk_stats ds;
        di_kv_disk_get_stats(e->kv->disk, &ds);
        di_kv_disk_io_stats qs;
        di_kv_disk_io_get_stats(e->kv->disk_io, &qs);
        DI_LOG_INFO(
            "engine: kv disk: %d cached blocks written at shutdown; since start %lld "
            "blocks written (%.3f ms each on the IO thread; %.3f ms each staging on the engine "
            "thread), %lld not queued (the queue was full), %lld write errors, %lld read (%.3f ms "
            "each), %lld dropped; %lld records (%.1f MiB) on disk",
            (int)n, (long long)ds.n_written,
            ds.n_written ? (double)ds.write_us / 1000.0 / (double)ds.n_written : 0.0,
            qs.n_queued ? (double)qs.stage_us / 1000.0 / (double)qs.n_queued : 0.0,
            (long long)qs.n_dropped, (long long)ds.n_write_errors, (long long)ds.n_read,
            ds.n_read ? (double)ds.read_us / 1000.0 / (double)ds.n_read : 0.0,
            (long long)ds.n_dropped, (long long)ds.n_records, (double)ds.n_bytes / (1 << 20));
        if (e->dev_on)
            DI_LOG_INFO("engine: kv disk: device blocks: %lld downloaded for write-back before "
                        "forward calls, %lld uploaded after reads, %lld write-backs lost (no "
                        "room, a failed download or step)",
                        (long long)e->kv->n_dev_down, (long long)e->kv->n_dev_up,
                        (long long)e->kv->n_dev_lost);
    }
    di_free(e->x_seqs);
    di_free(e->x_tokens);
    di_free(e->x_logit_rows);
    di_free(e->x_logit_req);
    di_free(e->x_mask_req);
    if (e->logits && e->dev_on) {
        di_backend *hb = dev_backend(e);
        hb->vt->host_free(hb, e->logits);
    } else {
        di_free(e->logits);
    }
    di_dsv4_ws_free(&e->ws);
    dev_state_destroy(e); // before the model, which owns its dev
    di_free(e->x_dev);
    di_free(e->x_dev41);
    di_free(e->x_prefix);
    di_free(e->dev_snap);
    di_free(e->dev_snap_id);
    di_free(e->dev_snap_pos);
    di_free(e->x_seq_req);
    di_free(e->x_blocks);
    for (int32_t i = 0; i < e->n_v41; i++) di_session_destroy(e->v41[i]);
    di_free(e->v41);
    di_free(e->x_slot);
    di_free(e->x_b);
    di_free(e->x_bk);
    di_free(e->x_ver);
    di_free(e->x_d);
    di_free(e->x_dseq);
    di_free(e->x_dkmax);
    di_free(e->x_dd);
    di_free(e->mtp_ls);
    di_aligned_free(e->mtp_ring);
    di_free(e->mtp_draft);
    di_free(e->mtp_draft_pos);
    di_free(e->mtp_draft_req);
    di_free(e->mtp_logits);
    di_free(e->mtp_pick);
    di_free(e->mtp_all);
    di_free(e->x_vseqs);
    di_free(e->x_vtokens);
    di_free(e->x_vlogit);
    di_free(e->x_cap);
    di_free(e->x_mseqs);
    di_free(e->x_mids);
    di_free(e->x_vdev);
    di_free(e->x_mdev);
    di_free(e->x_mrows);
    di_free(e->x_mlogit);
    di_free(e->x_mseq);
    di_free(e->marks);
    di_free(e->loss_ms);
    for (int32_t i = 0; e->samplers && i < e->n_samplers; i++) di_sampler_destroy(e->samplers[i]);
    di_free(e->samplers);
    di_free(e->x_res);
    di_free(e->x_nrows);
    di_free(e->x_emit);
    di_free(e->x_ndraft);
    di_free(e->x_nprop);
    di_free(e->x_lslot);
    di_free(e->x_job);
    di_free(e->x_greedy);
    di_free(e->x_pick);
    di_sched_deinit(&e->sched);
    di_kv_manager_destroy(e->kv);
    di_model_destroy(e->model);
    di_ep_load_destroy(e->expert_load);
    pthread_cond_destroy(&e->cv_work);
    pthread_cond_destroy(&e->cv_idle);
    pthread_cond_destroy(&e->cv_job);
    pthread_mutex_destroy(&e->mu);
    pthread_cond_destroy(&e->fcv);
    pthread_mutex_destroy(&e->fmu);
    di_free(e);
}

// ---- any thread ----

di_status di_engine_submit(di_engine *e, const di_request_params *p, uint64_t *id) {
    di_request *r = NULL;
    di_status st =
        di_request_create(p, e->model->hp.n_vocab, e->opt.max_ctx, e->opt.token_bytes != NULL,
                          e->opt.grammar_vocab, &e->glim, &r);
    if (st != DI_OK) return st;
    pthread_mutex_lock(&e->mu);
    if (e->dead) { // the device is lost for good ("device loss" below)
        pthread_mutex_unlock(&e->mu);
        DI_LOG_WARN("engine: request refused: the device is lost and was not recovered (%s)",
                    di_status_str(DI_ERR_DEVICE_LOST));
        di_request_destroy(r);
        return DI_ERR_DEVICE_LOST;
    }
    if (e->n_incoming + e->n_waiting_seen >= e->opt.max_queue || e->stop) {
        pthread_mutex_unlock(&e->mu);
        DI_LOG_WARN("engine: request queue full (%d waiting)", e->opt.max_queue);
        di_request_destroy(r);
        return DI_ERR_BUSY;
    }
    r->id = e->next_id++;
    r->arrival = r->id;
    r->next = NULL;
    if (e->in_tail)
        e->in_tail->next = r;
    else
        e->in_head = r;
    e->in_tail = r;
    r->all_next = e->all;
    e->all = r;
    e->n_live++;
    e->n_incoming++;
    *id = r->id;
    pthread_cond_signal(&e->cv_work);
    pthread_mutex_unlock(&e->mu);
    return DI_OK;
}

void di_engine_cancel(di_engine *e, uint64_t id) {
    pthread_mutex_lock(&e->mu);
    for (di_request *r = e->all; r; r = r->all_next) {
        if (r->id == id) {
            atomic_store(&r->cancelled, true);
            e->any_cancel = true;
            pthread_cond_signal(&e->cv_work);
            break;
        }
    }
    pthread_mutex_unlock(&e->mu);
}

void di_engine_wait_idle(di_engine *e) {
    pthread_mutex_lock(&e->mu);
    while (e->n_live > 0 || e->eplb_busy || e->dev_xfer_busy)
        pthread_cond_wait(&e->cv_idle, &e->mu);
    pthread_mutex_unlock(&e->mu);
    // The disk tier's queued writes too (the queue is any thread's): a caller that waited finds
    // every evicted block on disk.
    if (e->kv && e->kv->disk_io) di_kv_disk_io_drain(e->kv->disk_io);
}

// Queues j for the engine thread and waits for it. DI_ERR_BUSY once the engine is stopping.
static di_status post_job(di_engine *e, kv_job *j) {
    pthread_mutex_lock(&e->mu);
    if (e->stop || !e->thread_started) {
        pthread_mutex_unlock(&e->mu);
        snprintf(j->err, j->cap, "the engine is shutting down");
        return DI_ERR_BUSY;
    }
    kv_job **link = &e->jobs;
    while (*link) link = &(*link)->next;
    *link = j;
    pthread_cond_signal(&e->cv_work);
    while (!j->done) pthread_cond_wait(&e->cv_job, &e->mu);
    pthread_mutex_unlock(&e->mu);
    return j->st;
}

di_status di_engine_kv_export(di_engine *e, const int32_t *tokens, int32_t n_tokens,
                              uint64_t cache_salt, void **bytes, size_t *n_bytes, int32_t *n_blocks,
                              char *err, size_t cap) {
    kv_job j = {.tokens = tokens, .n_tokens = n_tokens, .salt = cache_salt, .err = err, .cap = cap};
    di_status st = post_job(e, &j);
    if (st != DI_OK) return st;
    *bytes = j.out;
    *n_bytes = j.n_out;
    *n_blocks = j.n_a;
    return DI_OK;
}

di_status di_engine_kv_import(di_engine *e, const void *bytes, size_t n_bytes, int32_t *n_inserted,
                              int32_t *n_present, char *err, size_t cap) {
    kv_job j = {.import = true, .in = bytes, .n_in = n_bytes, .err = err, .cap = cap};
    di_status st = post_job(e, &j);
    if (st != DI_OK) return st;
    *n_inserted = j.n_a;
    *n_present = j.n_b;
    return DI_OK;
}

di_status di_engine_kv_probe(di_engine *e, const int32_t *tokens, int32_t n_tokens,
                             uint64_t cache_salt, int32_t *n_cached, int32_t *n_disk) {
    *n_cached = *n_disk = 0;
    if (n_tokens < 0 || n_tokens > e->opt.max_ctx) return DI_ERR_INVALID;
    char err[64];
    kv_job j = {.probe = true,
                .tokens = tokens,
                .n_tokens = n_tokens,
                .salt = cache_salt,
                .err = err,
                .cap = sizeof err};
    const di_status st = post_job(e, &j);
    if (st != DI_OK) return st;
    const int32_t B = e->kv->block_tokens;
    *n_cached = (j.n_a + j.n_b) * B;
    *n_disk = j.n_b * B;
    return DI_OK;
}

void di_engine_get_stats(di_engine *e, di_engine_stats *out) {
    pthread_mutex_lock(&e->mu);
    *out = e->stats;
    pthread_mutex_unlock(&e->mu);
    di_ep_load_summary(e->expert_load, &out->n_expert_pairs, &out->expert_load_imbalance);
    if (e->kv && e->kv->disk) disk_store_stats(e->kv, out); // live: the IO thread writes anytime
}

di_status di_engine_expert_load(di_engine *e, char **json, size_t *n) {
    *json = NULL;
    *n = 0;
    di_ep_load_table t;
    di_status st = di_ep_load_table_alloc(di_ep_load_n_layers(e->expert_load),
                                          di_ep_load_n_expert(e->expert_load), &t);
    if (st == DI_OK) st = di_ep_load_totals(e->expert_load, &t);
    if (st == DI_OK) st = di_eplb_load_dump(&t, json);
    di_ep_load_table_free(&t);
    if (st == DI_OK) *n = strlen(*json);
    return st;
}

// ---- engine thread ----

// The counters of the disk tier's store and write queue into st (any thread: both lock).
static void disk_store_stats(di_kv_manager *kv, di_engine_stats *st) {
    di_kv_disk_stats ds;
    di_kv_disk_get_stats(kv->disk, &ds);
    di_kv_disk_io_stats qs;
    di_kv_disk_io_get_stats(kv->disk_io, &qs);
    st->n_disk_writes_queued = qs.n_queued;
    st->n_disk_writes_dropped = qs.n_dropped;
    st->n_disk_queue_hits = qs.n_hits;
    st->n_disk_writes_pending = qs.n_pending;
    st->disk_pending_bytes = qs.pending_bytes;
    st->disk_stage_us = qs.stage_us;
    st->disk_stage_us_max = qs.stage_us_max;
    st->n_disk_write_errors = ds.n_write_errors;
    st->disk_write_us = ds.write_us;
    st->n_disk_blocks_written = ds.n_written;
    st->n_disk_blocks_read = ds.n_read + qs.n_hits;
    st->n_disk_records = ds.n_records;
    st->disk_bytes = ds.n_bytes;
    st->n_disk_dropped = ds.n_dropped;
    st->n_disk_snaps_written = ds.n_snaps_written;
    st->n_disk_snaps_read = ds.n_snaps_read + qs.n_snap_hits;
}

// The disk tier's read thread finished a prefetch: wake the engine thread (it sleeps when every
// waiting request waits for one; any thread, no lock of the queue held).
static void disk_read_done(void *user) {
    di_engine *e = user;
    pthread_mutex_lock(&e->mu);
    e->disk_ready = true;
    pthread_cond_broadcast(&e->cv_work);
    pthread_mutex_unlock(&e->mu);
}

// The disk tier's counters into st (engine thread, or after it stopped; under mu).
static void disk_stats(di_engine *e, di_engine_stats *st) {
    if (!e->kv->disk) return;
    const di_kv_manager *kv = e->kv;
    st->n_disk_hit_tokens = kv->n_disk_hit_tokens;
    st->n_disk_prefetches = kv->n_prefetch_started;
    st->n_disk_prefetches_done = kv->n_prefetch_done;
    st->n_disk_prefetch_blocks = kv->n_prefetch_blocks;
    st->disk_prefetch_bytes = kv->prefetch_bytes;
    st->disk_prefetch_read_us = kv->prefetch_read_us;
    st->disk_prefetch_engine_us = kv->prefetch_engine_us;
    st->n_disk_prefetch_waits = e->sched.n_disk_waits;
    st->disk_prefetch_wait_us = e->sched.disk_wait_us;
    st->n_disk_dev_downloads = kv->n_dev_down;
    st->n_disk_dev_uploads = kv->n_dev_up;
    st->n_disk_dev_lost = kv->n_dev_lost;
    disk_store_stats(e->kv, st);
}

// ---- tail snapshots (docs/kv-cache.md, "Tail snapshots") ----
//
// A slot's tail at a prompt's last block boundary H (the scheduler ends a chunk there) is copied,
// right after the call that ended at H, into a snapshot attached to the cached block ending at H;
// a later admission whose hit reaches that block restores it into its slot and computes from H
// (di_sched's restore hook). What a tail is: on the CPU forward the slot's tail blocks (every
// layer's window ring, every compressor's token rings) and, with MTP speculation, the slot's MTP
// window ring; on V4.1 the session's rings (DSpark blocks' included) and (C, Z) slots
// (di_dsv41_tail_save); on the device-resident forward the slot's last W - 1 window rows and its
// compressors' overlap rows, downloaded from the dev state (di_dsv4_dev_tail_save: it syncs, the
// forward idle between the step's end and the next launch) and uploaded back into the admitted
// slot by the launch of the admitting plan (staged meanwhile: the hook runs while the previous
// step may still use the backend, and a snapshot may be evicted before the launch). Compressed
// entries are in the shared blocks, the V4.1 Engram history is rebuilt from the tokens.

// With MTP the slot's MTP ring lags one position: its row H - 1 was computed with token H (the
// next block's first), so the snapshot ends with that token and restores only for a request with
// the same token at H (another falls back to the bounded replay, whose MTP rows are exact).
static size_t tail_bytes(const di_engine *e) {
    if (e->v41) return di_dsv41_tail_bytes(e->v41[0]);
    if (e->dev_on) // with MTP speculation (V4): its ring inside, the next token after it
        return dev_tail_bytes(e) + (e->spec_k > 0 ? sizeof(int32_t) : 0);
    return (size_t)e->kv->n_tail * (size_t)e->kv->block_floats * sizeof(float) +
           (e->mtp_ls ? (size_t)e->mtp_slot_bytes + sizeof(int32_t) : 0);
}

// Restores snap (the tail at position pos of r's attached prefix) into r's slot.
static bool tail_restore(void *user, di_request *r, int32_t pos, const uint8_t *snap) {
    di_engine *e = user;
    const di_kv_seq *ks = &e->kv->seqs[r->slot];
    if (e->v41) {
        // The slot is free until this admission, so no running call uses its session.
        di_session *ss = e->v41[r->slot];
        di_dsv41_bind_pages(ss, v41_pages(ks), ks->n_blocks);
        return di_dsv41_tail_load(ss, snap, ks->n_cached, pos, r->tokens) == DI_OK;
    }
    if (e->dev_on) { // staged for the launch (dev_restores); a bad one falls back to the replay
        const size_t tb = tail_bytes(e);
        if (dev_tail_check(e, pos, snap) != DI_OK) return false;
        if (e->spec_k > 0) { // the MTP ring's last row saw the token at pos: the same one here
            int32_t next;
            memcpy(&next, snap + dev_tail_bytes(e), sizeof next);
            if (r->tokens[pos] != next) return false;
        }
        memcpy(e->dev_snap + (size_t)r->slot * tb, snap, tb);
        e->dev_snap_id[r->slot] = r->id; // ids are never reused: a stale one never matches
        e->dev_snap_pos[r->slot] = pos;
        return true;
    }
    // The slot's tail blocks were taken (zeroed) when it opened: no running call reads them.
    const size_t bb = (size_t)e->kv->block_floats * sizeof(float);
    if (e->mtp_ls) {
        int32_t next;
        memcpy(&next, snap + (size_t)e->kv->n_tail * bb + (size_t)e->mtp_slot_bytes, sizeof next);
        if (r->tokens[pos] != next) return false;
    }
    for (int32_t t = 0; t < e->kv->n_tail; t++, snap += bb)
        memcpy(di_block_pool_ptr(e->kv->pool, ks->tail[t]), snap, bb);
    if (e->mtp_ls)
        memcpy(e->mtp_ring + (size_t)r->slot * ((size_t)e->mtp_slot_bytes / sizeof(float)), snap,
               (size_t)e->mtp_slot_bytes);
    return true;
}

static di_status tails_open(di_engine *e) {
    const di_engine_options *o = &e->opt;
    if (o->no_prefix_cache || o->no_tail_cache) return DI_OK;
    if (e->dev_on) { // staging (zeroed pages: a slot never restored into costs nothing)
        e->dev_snap = di_calloc((size_t)o->max_seqs, tail_bytes(e));
        e->dev_snap_id = di_calloc((size_t)o->max_seqs, sizeof *e->dev_snap_id);
        e->dev_snap_pos = di_calloc((size_t)o->max_seqs, sizeof *e->dev_snap_pos);
        if (!e->dev_snap || !e->dev_snap_id || !e->dev_snap_pos) return DI_ERR_NOMEM;
    }
    const size_t budget = o->tail_cache_bytes ? o->tail_cache_bytes : (size_t)256 << 20;
    di_status st = di_kv_manager_open_tails(e->kv, tail_bytes(e), budget);
    if (st != DI_OK) return st;
    e->sched.restore = tail_restore;
    e->sched.restore_user = e;
    e->stats.tail_snap_bytes = (int64_t)tail_bytes(e);
    return DI_OK;
}

// After a successful call: snapshots the tail of every sequence whose chunk ended at one of its
// snapshot points (its state is at that position until its next call).
static void tails_take(di_engine *e) {
    if (!e->kv->tails) return;
    for (int32_t i = 0; i < e->x_n_seq; i++) {
        const di_request *r = e->x_seq_req[i];
        const int32_t h = e->x_seqs[i].pos + e->x_seqs[i].n_tok;
        if (!di_sched_is_snap_point(&e->sched, r, h)) continue;
        // After a bounded replay from Q > 0 the window rows a continuation reads are exact (the
        // replay's proof), but the MTP rows of the replayed positions are not (they only cost
        // drafts): such an MTP tail is not kept.
        if ((e->mtp_ls || (e->dstate && e->spec_k > 0)) && r->win_lo > 0) continue;
        uint8_t *out = di_kv_tail_put(e->kv, r->slot, h);
        if (!out) continue;
        if (e->v41) {
            di_dsv41_tail_save(e->v41[r->slot], out);
            continue;
        }
        if (e->dev_on) { // a failed save (logged) leaves a snapshot no restore accepts
            if (dev_tail_save(e, r->slot, out) != DI_OK)
                memset(out, 0, tail_bytes(e));
            else if (e->spec_k > 0)
                memcpy(out + dev_tail_bytes(e), &r->tokens[h], sizeof(int32_t));
            continue;
        }
        const di_kv_seq *ks = &e->kv->seqs[r->slot];
        const size_t bb = (size_t)e->kv->block_floats * sizeof(float);
        for (int32_t t = 0; t < e->kv->n_tail; t++, out += bb)
            memcpy(out, di_block_pool_ptr(e->kv->pool, ks->tail[t]), bb);
        if (e->mtp_ls) {
            memcpy(out, e->mtp_ring + (size_t)r->slot * ((size_t)e->mtp_slot_bytes / sizeof(float)),
                   (size_t)e->mtp_slot_bytes);
            memcpy(out + e->mtp_slot_bytes, &r->tokens[h], sizeof(int32_t));
        }
    }
}

// At a launch (the forward idle): the staged snapshot of each planned sequence's slot goes into
// the dev state when it is the one its admission chose (same request, the plan's first position);
// a stale one (its request preempted before running) is dropped.
static void dev_restores(di_engine *e, const di_sched *s) {
    e->x_restore_st = DI_OK;
    if (!e->dev_snap) return;
    const size_t tb = tail_bytes(e);
    for (int32_t i = 0; i < s->n_seq; i++) {
        const di_request *r = s->seq_req[i];
        const int32_t slot = r->slot;
        if (!e->dev_snap_id[slot]) continue;
        if (e->dev_snap_id[slot] == r->id && e->dev_snap_pos[slot] == s->seqs[i].pos &&
            e->x_restore_st == DI_OK)
            e->x_restore_st = dev_tail_restore(e, slot, e->dev_snap_pos[slot],
                                               e->dev_snap + (size_t)slot * tb, r->tokens);
        e->dev_snap_id[slot] = 0;
    }
}

static void tail_stats(di_engine *e, di_engine_stats *st) {
    if (!e->kv->tails) return;
    di_tail_cache_stats ts;
    di_tail_cache_get_stats(e->kv->tails, &ts);
    st->n_tail_taken = ts.n_taken;
    st->n_tail_restored = e->sched.n_tail_restores;
    st->n_tail_stored = ts.n_stored;
    st->tail_bytes = ts.bytes;
    st->n_tail_evicted = ts.n_evicted;
    st->n_tail_dropped = ts.n_dropped;
}

// Copies the speculative-decoding counters into the stats (caller holds e->mu).
static void publish_spec_stats(di_engine *e) {
    e->stats.n_spec_verifies = e->spec_n[0];
    e->stats.n_spec_drafted = e->spec_n[1];
    e->stats.n_spec_verified = e->spec_n[2];
    e->stats.n_spec_accepted = e->spec_n[3];
    memcpy(e->stats.n_spec_accept_hist, e->spec_hist, sizeof e->spec_hist);
}

// Takes r out of the scheduler (its blocks go back) and frees it; updates the pool, request and
// speculation counts before waking di_engine_wait_idle, so a waiter sees them (its last verify
// included).
static void retire(di_engine *e, di_request *r) {
    di_sched_remove(&e->sched, r);
    pthread_mutex_lock(&e->mu);
    di_request **link = &e->all;
    while (*link != r) link = &(*link)->all_next;
    *link = r->all_next;
    e->stats.n_blocks_free = di_block_pool_n_available(e->kv->pool);
    e->stats.n_blocks_cached = di_block_pool_n_cached_idle(e->kv->pool);
    e->stats.n_running = e->sched.n_running;
    e->stats.n_waiting = e->sched.n_waiting;
    e->stats.n_tenants_backlogged = e->sched.n_tenants_live;
    publish_spec_stats(e);
    disk_stats(e, &e->stats); // a removed request's prefetch was stopped and collected just now
    e->dev_xfer_busy = di_kv_dev_pending(e->kv); // set before a waiter can see n_live 0
    e->n_live--;
    if (e->n_live == 0) pthread_cond_broadcast(&e->cv_idle);
    pthread_mutex_unlock(&e->mu);
    di_request_destroy(r);
}

// Sends r's last event (no token), then retires it.
static void finish(di_engine *e, di_request *r, di_finish why, di_status status) {
    di_event ev = {.request_id = r->id,
                   .token = -1,
                   .index = r->n_gen,
                   .finish = why,
                   .status = status,
                   .n_cached = r->n_cached,
                   .n_replayed = r->n_replayed,
                   .n_computed = r->n_computed,
                   .n_preempted = r->n_preempted};
    const char *txt;
    size_t n_txt;
    di_stop_flush(&r->stop, &txt, &n_txt);
    ev.text = n_txt ? txt : NULL;
    ev.n_text = n_txt;
    r->on_event(r->user, &ev);
    retire(e, r);
}

// Emits one sampled token of r (it becomes r's next known token) with its finish, if any.
// Returns true when r finished (it is then retired and gone).
static bool emit_token(di_engine *e, di_request *r, const di_sample_result *res,
                       int64_t *cb_allocs) {
    r->tokens[di_request_n_tokens(r)] = res->token;
    r->n_gen++;
    di_finish why = DI_FINISH_NONE;
    if (!r->ignore_eos && res->token == e->eos) why = DI_FINISH_STOP;
    for (int32_t i = 0; i < r->n_stop_ids; i++)
        if (res->token == r->stop_ids[i]) why = DI_FINISH_STOP;
    const char *txt = NULL;
    size_t n_txt = 0;
    if (e->opt.token_bytes) {
        size_t nb = 0;
        const char *b = e->opt.token_bytes(e->opt.token_bytes_user, res->token, &nb);
        if (di_stop_push(&r->stop, b ? b : "", b ? nb : 0, &txt, &n_txt)) why = DI_FINISH_STOP;
    }
    if (r->gm && r->g_active && di_grammar_matcher_is_done(r->gm))
        why = DI_FINISH_STOP; // nothing more can follow: as if EOS
    if (why == DI_FINISH_NONE &&
        (r->n_gen >= r->max_tokens || di_request_n_tokens(r) >= e->opt.max_ctx))
        why = DI_FINISH_LENGTH;
    di_event ev = {.request_id = r->id,
                   .token = res->token,
                   .index = r->n_gen - 1,
                   .logprob = res->logprob,
                   .n_top = res->n_top,
                   .top_ids = res->top_ids,
                   .top_logprobs = res->top_logprobs,
                   .text = n_txt ? txt : NULL,
                   .n_text = n_txt,
                   .status = DI_OK};
    if (why != DI_FINISH_NONE) { // the last token carries the finish: one event, then it is gone
        ev.finish = why;
        ev.n_cached = r->n_cached;
        ev.n_replayed = r->n_replayed;
        ev.n_computed = r->n_computed;
        ev.n_preempted = r->n_preempted;
    }
    int64_t a0 = di_mem_thread_allocs();
    r->on_event(r->user, &ev);
    *cb_allocs += di_mem_thread_allocs() - a0;
    if (why == DI_FINISH_NONE) return false;
    retire(e, r);
    return true;
}

// After a verify of r that emitted n_emit tokens and r goes on: the accepted drafts among them
// were fed by the verify forward (the session stands at the last emitted token, which is r's
// pending token, as after a plain decode step), so r moves past them, and the plan built ahead
// (which assumed one token, as for every decode) feeds that token at its true position. When the
// block was cut short (a cancellation mid-block: r finishes before the next step runs), the
// session takes back the accepted tokens that were not emitted too.
static void spec_settle(di_engine *e, di_request *r, int32_t k, int32_t n_emit) {
    di_sched *s = &e->sched;
    const int32_t extra = n_emit - 1;                                  // accepted drafts emitted
    if (n_emit < e->x_emit[k]) spec_rollback(e, k, r->n_done + extra); // the last one is pending
    r->n_done += extra;
    r->n_computed += e->x_ndraft[k]; // every verify row cost a forward row
    s->n_decode_rows += extra;
    DI_ASSERT(r->n_done == di_request_n_tokens(r) - 1);
    DI_ASSERT(!e->v41 || di_session_n_past(e->v41[e->x_lslot[k]]) == r->n_done);
    for (int32_t i = 0; i < s->n_seq; i++) {
        if (s->seq_req[i] != r) continue;
        DI_ASSERT(s->seqs[i].n_tok == 1); // a decode: its pending token, one row
        s->seqs[i].pos = r->n_done;       // di_sched_finalize copies tokens[pos] into the row
    }
    // Within the blocks launch took for the verify (spec_kmax): this cannot fail.
    di_status st = di_kv_seq_reserve(e->kv, r->slot, r->n_done + 1);
    DI_ASSERT(st == DI_OK);
}

// Emits what the forward thread sampled for every request whose last known token was fed this
// step: one token, or the block of a verify (accepted drafts, then the correction or bonus
// token). A finish inside a block (EOS, a stop id or string, max_tokens) drops the rest of it; so
// does a cancellation (the block stops at the token whose callback cancelled).
static void sample_and_emit(di_engine *e, int64_t *cb_allocs) {
    const int64_t V = e->model->hp.n_vocab;
    for (int32_t k = 0; k < e->x_n_logit; k++) { // the pending tokens first: none may stay
        DI_ASSERT(e->x_logit_req[k]->n_pending == 1);
        e->x_logit_req[k]->n_pending = 0;
    }
    for (int32_t k = 0; k < e->x_n_logit; k++) {
        di_request *r = e->x_logit_req[k];
        const int64_t base = (int64_t)k * e->lstride;
        if (r->n_gen == 0 && r->first_logits)
            memcpy(r->first_logits, e->logits + base * V, sizeof(float) * (size_t)V);
        if (r->g_status != DI_OK) {
            DI_LOG_ERROR("engine: request %llu: the grammar constraint failed after %d tokens (%s: "
                         "a matcher limit, or no token can continue the grammar)",
                         (unsigned long long)r->id, (int)r->n_gen, di_status_str(r->g_status));
            int64_t a0 = di_mem_thread_allocs();
            finish(e, r, DI_FINISH_ERROR, r->g_status);
            *cb_allocs += di_mem_thread_allocs() - a0;
            continue;
        }
        const int32_t nd = e->x_ndraft[k], n_tok = e->x_emit[k];
        if (nd > 0) {
            e->spec_n[0]++;
            e->spec_n[1] += e->x_nprop[k];
            e->spec_n[2] += nd;
            e->spec_n[3] += n_tok - 1;
            e->spec_hist[n_tok - 1]++;
        }
        int32_t n_emit = 0;
        bool gone = false;
        while (n_emit < n_tok && !gone) {
            if (n_emit > 0 && atomic_load(&r->cancelled)) break;
            gone = emit_token(e, r, &e->x_res[base + n_emit], cb_allocs);
            n_emit++;
        }
        if (!gone && nd > 0) spec_settle(e, r, k, n_emit);
    }
}

static void cancel_flagged(di_engine *e) {
    di_sched *s = &e->sched;
    for (int32_t i = s->n_running - 1; i >= 0; i--) {
        di_request *r = s->running[i];
        if (atomic_load(&r->cancelled)) finish(e, r, DI_FINISH_CANCELLED, DI_ERR_CANCELLED);
    }
    for (di_request *r = s->wait_head, *nx; r; r = nx) {
        nx = r->next;
        if (atomic_load(&r->cancelled)) finish(e, r, DI_FINISH_CANCELLED, DI_ERR_CANCELLED);
    }
}

// ---- forward thread ----

// Whether t ends the request when sampled (EOS unless ignored, a stop id).
static bool is_stop_token(const di_engine *e, const di_request *r, int32_t t) {
    if (t == e->eos && !r->ignore_eos) return true;
    for (int32_t i = 0; i < r->n_stop_ids; i++)
        if (t == r->stop_ids[i]) return true;
    return false;
}

static inline void mask_put(uint64_t *mask, int32_t t, bool on) {
    if (on)
        mask[t >> 6] |= 1ull << (t & 63);
    else
        mask[t >> 6] &= ~(1ull << (t & 63));
}

// ---- masks ahead ----
//
// A constrained request's mask for the token a step samples depends only on its matcher, which
// the previous step's sampling advanced: it is known when the step is launched. So while the
// forward runs, the engine thread (idle after planning the next step; on the device-resident
// forward the CPU is idle altogether) computes the masks of the step's constrained rows
// (masks_ahead), and the sampling thread finds them ready. Only where the forward leaves a CPU
// idle (e->masks_ahead: the device-resident forward, or a pool smaller than the machine): on a
// pool over every CPU the engine thread would take a core from the forward's threads. Whichever
// thread claims a mask first (DI_MASK_NONE -> DI_MASK_BUSY) computes it; the sampling thread waits
// for one the engine thread is still computing, and marks it used (the engine thread claims no mask
// of the step after that: the matcher then advances). launch() lists the step's constrained rows
// and resets their state. A mask is a pure function of the matcher, so who computes it never
// changes an output.

// r's mask for its next token: the grammar's (EOS and stop ids only when it can end), in
// r->g_mask, with the allowed count and status (a matcher limit, or no token allowed).
static void grammar_mask(const di_engine *e, di_request *r) {
    int32_t n_ok = 0;
    di_status st = di_grammar_matcher_mask(r->gm, r->g_mask, &n_ok);
    if (st == DI_OK) {
        const bool can_end = di_grammar_matcher_can_end(r->gm);
        // Stop tokens are the grammar's end: ordinary ones among them leave the mask too.
        for (int32_t i = 0; i < r->n_stop_ids; i++) {
            const int32_t t = r->stop_ids[i];
            n_ok -= (int32_t)((r->g_mask[t >> 6] >> (t & 63)) & 1);
            mask_put(r->g_mask, t, false);
        }
        if (can_end) {
            if (!r->ignore_eos) mask_put(r->g_mask, e->eos, true), n_ok++;
            for (int32_t i = 0; i < r->n_stop_ids; i++)
                mask_put(r->g_mask, r->stop_ids[i], true), n_ok++;
        }
        if (n_ok <= 0) st = DI_ERR_UNSUPPORTED; // the grammar needs text no token can start
    }
    r->g_mask_allowed = n_ok;
    r->g_mask_status = st;
}

// Engine thread, while the forward runs: the masks of the step's constrained rows that the
// sampling threads have not claimed yet. Returns how many it computed.
static int32_t masks_ahead(di_engine *e) {
    int32_t n = 0;
    for (int32_t j = 0; j < e->x_n_mask; j++) {
        di_request *r = e->x_mask_req[j];
        int expect = DI_MASK_NONE;
        if (!atomic_compare_exchange_strong(&r->g_mask_state, &expect, DI_MASK_BUSY)) continue;
        grammar_mask(e, r);
        atomic_store_explicit(&r->g_mask_state, DI_MASK_READY, memory_order_release);
        n++;
    }
    return n;
}

// ---- greedy rows on the device (the device-resident forwards) ----
//
// A logit row whose sample is the raw argmax, and which nothing else of the row is read for,
// crosses from the device as that argmax only (di_dsv4_dev_forward_picks /
// di_dsv41_dev_forward_picks: backend.h argmax_rows, 4 bytes instead of 4 V, 517 KB a row on
// V4-Flash): its request samples greedily with no logit bias and no penalties (sampler.c's plain
// greedy branch, which takes di_argmax of the raw row whatever top_k, top_p or min_p say), wants
// no logprobs or top logprobs, has no grammar (a constrained row is masked first), and does not
// want this row as its first_logits. Every other row downloads in full (one download per run of
// such rows). The pick is di_argmax's of the very row a full download brings, so tokens, finish
// reasons and stats are today's; only the bytes change (the graph stats' n_download_bytes). The
// verify rows of speculation follow the same rule row by row, and the MTP call's drafts (an
// argmax each) always cross as picks.

// Whether row i of r's logit slot (output token n_gen + i) is such a row.
static bool row_greedy(const di_request *r, int32_t i) {
    const di_sample_params *p = &r->sample;
    return p->temperature == 0 && p->n_logit_bias == 0 && p->presence_penalty == 0 &&
           p->frequency_penalty == 0 && p->repetition_penalty == 1 && !p->logprobs &&
           p->n_logprobs == 0 && !r->gm && !(r->first_logits && r->n_gen + i == 0);
}

// x_greedy of the call's n logit rows, slot after slot (slot k's x_nrows[k] rows).
static void mark_greedy(di_engine *e, int32_t n) {
    int32_t j = 0;
    for (int32_t k = 0; k < e->x_n_logit; k++)
        for (int32_t i = 0; i < e->x_nrows[k]; i++)
            e->x_greedy[j++] = row_greedy(e->x_logit_req[k], i);
    DI_ASSERT(j == n);
}

// A constrained row: r's mask (computed ahead, or here), the masked sample, then the matcher
// advanced by the token. A failure (a matcher limit, or no token allowed) is left in r->g_status
// for sample_and_emit, which ends the request.
static void sample_constrained(di_engine *e, di_sampler *smp, di_request *r, const float *logits,
                               di_sample_result *res) {
    int expect = DI_MASK_NONE;
    if (atomic_compare_exchange_strong(&r->g_mask_state, &expect, DI_MASK_BUSY))
        grammar_mask(e, r);
    else // the engine thread has it: ready, or in a moment
        while (atomic_load_explicit(&r->g_mask_state, memory_order_acquire) != DI_MASK_READY)
            sched_yield();
    atomic_store_explicit(&r->g_mask_state, DI_MASK_USED, memory_order_relaxed); // launch resets
    if (r->g_mask_status != DI_OK) {
        r->g_status = r->g_mask_status;
        res->token = -1;
        return;
    }
    di_sampler_sample_allowed(smp, logits, r->g_mask, &r->sample, r->tokens, r->n_prompt, r->n_gen,
                              di_request_n_tokens(r), res);
    if (!is_stop_token(e, r, res->token) && !di_grammar_matcher_advance_token(r->gm, res->token))
        r->g_status = DI_ERR_UNSUPPORTED; // a limit (the mask allowed the token)
}

// Samples the step's rows (pool task, one sampler per thread; each thread takes the next row not
// taken, so a few expensive rows, top-p over a flat distribution, do not wait behind one thread's
// fixed share): row i of logit slot k samples output token n_gen + i of its request at position
// n_tokens + i, with the history extended by the drafts before it (written past the known tokens
// by v41_verify); a plain slot has row 0 only. Reads only what the engine thread leaves alone
// while a step runs: the logits, the request's tokens and its sampling parameters. Each row's
// result depends on that row alone (not on the thread), so a verify row samples exactly what a
// plain decode of the same position would.
// A request with an active grammar (it never speculates: one row) samples through
// sample_constrained, which also advances its matcher (one row per request: no other thread
// touches it). A plain row that samples the token after which a request's grammar applies
// activates it; for a verify, spec_accept does (only accepted rows count).
static void sample_task(void *p, int ith, int nth) {
    di_engine *e = p;
    const int64_t V = e->model->hp.n_vocab;
    (void)nth;
    for (int32_t j;
         (j = atomic_fetch_add_explicit(&e->x_job_next, 1, memory_order_relaxed)) < e->x_n_job;) {
        const int32_t row = e->x_job[j], k = row / e->lstride, i = row % e->lstride;
        di_request *r = e->x_logit_req[k];
        if (e->dev_on && e->x_greedy[row]) { // the device's argmax: di_sampler_sample's result
            e->x_res[row].token = e->x_pick[row];
            e->x_res[row].logprob = 0;
            e->x_res[row].n_top = 0;
            continue;
        }
        if (r->gm && r->g_active && r->g_status == DI_OK) {
            DI_ASSERT(i == 0);
            sample_constrained(e, e->samplers[ith], r, e->logits + row * V, &e->x_res[row]);
            continue;
        }
        di_sampler_sample(e->samplers[ith], e->logits + row * V, &r->sample, r->tokens, r->n_prompt,
                          r->n_gen + i, di_request_n_tokens(r) + i, &e->x_res[row]);
        if (r->gm && !r->g_active && e->x_ndraft[k] == 0 && e->x_res[row].token == r->grammar_after)
            r->g_active = true;
    }
}

// Failure injection (di_engine_fail_forward, DI_ENGINE_FAIL_STEPS): the calls it names fail with
// its status without running, as a backend error would (the requests of the step fail; the slots
// they held restart at position 0 when they are next admitted, like the slots of a real failed
// call). Either forward.
static di_status inject_failure(di_engine *e) {
    if (atomic_load(&e->fail_in) <= 0) return DI_OK;
    if (atomic_fetch_sub(&e->fail_in, 1) != 1) return DI_OK;               // one of the n_ok calls
    if (atomic_fetch_sub(&e->fail_n, 1) > 1) atomic_store(&e->fail_in, 1); // more to fail
    di_status st = (di_status)atomic_load(&e->fail_status);
    DI_LOG_ERROR("engine: injected failure of the forward: %s", di_status_str(st));
    return st;
}

// ---- device loss ----
//
// A lost device (backend.h DI_ERR_DEVICE_LOST: CUDA classifies the sticky errors, after which
// every call on the device fails; the CPU twin under di_cpu_backend_lose) fails the step whose
// forward found it, as any failure (fail_step: its requests end with DI_ERR_DEVICE_LOST; they may
// be the cause, so they are not retried). Then, on the engine thread with no forward in flight
// (device_lost): every other running request is preempted for recompute (back to the waiting
// queue with its tokens: it continues after the rebuild from position 0, its output unchanged,
// since a request's tokens depend on its own tokens only); the staged tail restores and MTP drafts
// are dropped; the device blocks' contents are gone, so every block leaves the prefix cache
// without a write-back (the disk tier's recorded downloads are dropped and its prefetches stopped;
// its records, queued or on disk, stay and are read back by later admissions); then the device
// state is rebuilt (dev_rebuild: the dev state, the logits' host memory and the model's
// device-resident forward are destroyed, the devices reset and everything made again as at
// create, the warm-up call and decode graphs included). At most device_loss_max losses within
// device_loss_window_s seconds are recovered; one more, or a failed rebuild, and the engine gives
// up (dead): it ends every waiting request and refuses every new one with DI_ERR_DEVICE_LOST, and
// di_engine_stats.unhealthy tells the server (503 on /health and /ready, so the router takes the
// replica out of rotation). Nothing of this runs inside a step's allocation count. A loss found
// between steps (the disk tier's idle transfers, a KV export or import) recovers the same way at
// once (lost_between_steps), before a step's requests would fail on it.

// The backend of the device-resident forward's stage k; NULL when there is none.
static di_backend *dev_stage_backend(const di_engine *e, int32_t k) {
    int32_t l0, l1;
    if (e->model->dev) {
        if (k < 0 || k >= di_dsv4_dev_n_stages(e->model->dev)) return NULL;
        return di_dsv4_dev_stage(e->model->dev, k, &l0, &l1);
    }
    if (!e->model->dev41 || k < 0 || k >= di_dsv41_dev_n_stages(e->model->dev41)) return NULL;
    return di_dsv41_dev_stage(e->model->dev41, k, &l0, &l1);
}

// di_engine_lose_device's loss of stage lose_stage's CPU backend, lose_after entries from now.
static void lose_stage_backend(di_engine *e, const char *when) {
    di_backend *b = dev_stage_backend(e, e->lose_stage);
    if (!b || strcmp(b->vt->name, "cpu") != 0) {
        DI_LOG_ERROR("engine: device loss drill: stage %d has no CPU backend to lose",
                     (int)e->lose_stage);
        return;
    }
    DI_LOG_WARN("engine: device loss drill: stage %d's backend is lost %lld calls into %s",
                (int)e->lose_stage, (long long)e->lose_after, when);
    di_cpu_backend_lose(b, e->lose_after);
}

// Forward thread, before its call: the drill's loss, when this is the forward it names.
static void arm_loss(di_engine *e) {
    if (atomic_load(&e->lose_in) <= 0) return;
    if (atomic_fetch_sub(&e->lose_in, 1) != 1) return;
    lose_stage_backend(e, "this forward");
}

// Destroys the device state and everything made on the model's device-resident forward, rebuilds
// the forward (di_model_dev_rebuild) and makes them again as create did. Engine thread, no
// forward in flight. On failure the engine has no device state (the caller gives up).
static di_status dev_rebuild(di_engine *e) {
    const di_engine_options *o = &e->opt;
    di_status st = DI_OK;
    dev_state_destroy(e);
    if (e->logits) { // the backend's host memory (page-locked on CUDA: gone with a reset)
        di_backend *hb = dev_backend(e);
        hb->vt->host_free(hb, e->logits);
        e->logits = NULL;
    }
    DI_TRY(di_model_dev_rebuild(e->model));
    if (e->spec_k > 0 && e->model->dev) DI_TRY(di_dsv4_dev_mtp_enable(e->model->dev));
    if (atomic_load(&e->lose_rebuilds) > 0) { // the drill: this rebuild fails too
        atomic_fetch_sub(&e->lose_rebuilds, 1);
        lose_stage_backend(e, "the rebuild");
    }
    const size_t n_lrows = (size_t)o->max_seqs * (size_t)e->lstride;
    di_backend *hb = dev_backend(e);
    void *p = NULL;
    DI_TRY(hb->vt->host_alloc(hb, sizeof(float) * n_lrows * (size_t)e->model->hp.n_vocab, &p));
    e->logits = p;
    DI_TRY(dev_state_create(e, o->max_batch_tokens + o->max_seqs * e->spec_k,
                            di_block_pool_n_total(e->kv->pool), e->kv->block_tokens));
    DI_TRY(dev_warm_up(e));
    return DI_OK;
fail:
    return st;
}

// Ends every request the engine holds (running or waiting) with DI_ERR_DEVICE_LOST: the engine
// gave up on the device.
static void end_all_lost(di_engine *e, int64_t *cb_allocs) {
    di_sched *s = &e->sched;
    int64_t a0 = di_mem_thread_allocs();
    while (s->n_running > 0)
        finish(e, s->running[s->n_running - 1], DI_FINISH_ERROR, DI_ERR_DEVICE_LOST);
    while (s->wait_head) finish(e, s->wait_head, DI_FINISH_ERROR, DI_ERR_DEVICE_LOST);
    *cb_allocs += di_mem_thread_allocs() - a0;
}

// The step just failed with DI_ERR_DEVICE_LOST (fail_step ended its requests): recovers the
// device state, or gives up ("device loss" above). *cb_allocs gets what this allocated (not a
// step's).
static void device_lost(di_engine *e, int64_t *cb_allocs) {
    const int64_t a0 = di_mem_thread_allocs();
    di_sched *s = &e->sched;
    const di_engine_options *o = &e->opt;
    const int64_t now = sched_now_ms(e), ring = (int64_t)o->device_loss_max + 1;
    const int64_t window_ms = o->device_loss_window_s * 1000LL;
    e->loss_ms[e->n_loss % ring] = now;
    e->n_loss++;
    int64_t n_recent = 0; // losses within the window, this one included (at most ring)
    for (int64_t k = 0; k < ring && k < e->n_loss; k++) n_recent += now - e->loss_ms[k] < window_ms;
    // More than device_loss_max within the window: the ring's every entry is in it.
    const bool too_many = n_recent == ring;
    int32_t n_pre = 0;
    for (int32_t i = s->n_running - 1; i >= 0; i--, n_pre++) di_sched_preempt(s, s->running[i]);
    if (e->dev_snap_id) memset(e->dev_snap_id, 0, sizeof *e->dev_snap_id * (size_t)o->max_seqs);
    e->x_restore_st = DI_OK;
    if (e->mtp_draft_req)
        memset(e->mtp_draft_req, 0, sizeof *e->mtp_draft_req * (size_t)o->max_seqs);
    di_kv_dev_drop_spills(e->kv); // a write-back would download what the lost device holds
    if (e->kv->disk) di_kv_prefetch_yield(e->kv, 0); // their blocks are device blocks too
    const int32_t n_dropped = di_kv_manager_drop_cached(e->kv);
    DI_LOG_WARN("engine: the device is lost (loss %lld; %lld within %d s): %d running requests "
                "preempted for recompute, %d blocks dropped from the prefix cache (the disk tier's "
                "records stay)",
                (long long)e->n_loss, (long long)n_recent, (int)o->device_loss_window_s, (int)n_pre,
                (int)n_dropped);
    di_status st = DI_ERR_DEVICE_LOST;
    if (!e->dev_on)
        DI_LOG_ERROR("engine: no device-resident forward to rebuild (an injected loss, or a "
                     "device the CPU forward uses)");
    else if (too_many)
        DI_LOG_ERROR("engine: the device was lost %d times within %d s (device_loss_max %d): not "
                     "rebuilding it again",
                     (int)ring, (int)o->device_loss_window_s, (int)o->device_loss_max);
    else
        st = dev_rebuild(e);
    pthread_mutex_lock(&e->mu);
    e->stats.n_device_losses = e->n_loss;
    e->stats.n_device_loss_preempted += n_pre;
    if (st == DI_OK) {
        e->stats.n_device_recoveries++;
        e->stats.n_failed_in_a_row = 0; // the device is new: the streak was the old one's
    } else {
        e->dead = true;
        e->stats.unhealthy = true;
    }
    pthread_mutex_unlock(&e->mu);
    if (st == DI_OK) {
        DI_LOG_WARN("engine: the device state is rebuilt (recovery %lld): %.1f MiB of device "
                    "state, decode graphs captured; the %d preempted requests continue",
                    (long long)e->stats.n_device_recoveries, (double)dev_state_bytes(e) / (1 << 20),
                    (int)n_pre);
    } else {
        if (e->dev_on && !too_many)
            DI_LOG_ERROR("engine: rebuilding the device state failed: %s", di_status_str(st));
        DI_LOG_ERROR("engine: unhealthy: every request is refused with \"%s\" from now on; "
                     "restart the process (or replace the device)",
                     di_status_str(DI_ERR_DEVICE_LOST));
        int64_t cb = 0; // counted below with the rest
        end_all_lost(e, &cb);
    }
    *cb_allocs += di_mem_thread_allocs() - a0;
}

// A device call between steps (the disk tier's transfers with the forward idle, a KV export or
// import) found the device lost: recover now, before a step's requests would fail on it.
static void lost_between_steps(di_engine *e, di_status st, const char *what) {
    if (st != DI_ERR_DEVICE_LOST || !e->dev_on || e->dead) return;
    DI_LOG_ERROR("engine: %s found the device lost, between steps", what);
    int64_t cb = 0; // not a step's
    device_lost(e, &cb);
}

// ---- speculative decoding (V4.1 with DSpark, V4 with the MTP block) ----
//
// A decode sequence of the plan (one row: its last sampled token y at position P, the anchor)
// whose request may still take more than one token gets drafts from its draft producer: V4.1's
// DSpark block (spec deepseek-v41.md §3.3: a block after its last forward, in the step's draft
// call) or V4's MTP block (spec §2.10: the MTP block's logits at P - 1 with y as its next token,
// computed after the previous step's sampling; argmax, one draft). It keeps the longest draft
// prefix d1..dk whose estimated survival (the product of the confidence head's acceptance
// probabilities, §3.4 step 1; MTP drafts have none and are always kept) stays at or above
// spec_tau (at least one draft, at most spec_k, never past max_tokens or the context), and feeds
// [y, d1..dk] in one call with logits for every row. Row i is then sampled exactly as a plain
// decode step would sample position P + 1 + i after y, d1..di: the same sampler call on the same
// logits (a forward gives a position the same logits however the tokens are split into calls and
// batched), the same history, parameters and position (the randomness is a pure function of
// (seed, position)). d(i+1) is accepted iff it equals row i's token; at the first mismatch, or
// after row k, the row's token is the correction (bonus). So the emitted tokens and logprobs are
// exactly those without speculation ("verify by resampling": for greedy requests the rule of
// §3.4 step 3; for sampled ones it replaces rejection sampling by the target's own draw, which
// needs no draft distribution and keeps outputs bitwise). The rejected rows are rolled back
// (spec_rollback: the V4.1 session's, §5.3, or the V4 sequence's state, di_dsv4_state_rollback).

_Static_assert(DI_MAX_SPEC_TOKENS <= DI_DSV41_ROLLBACK_MAX, "a verify's rejected rows roll back");
_Static_assert(DI_DSV4_ROLLBACK_MAX >= 1, "a V4 verify (one MTP draft) rolls back one row");
_Static_assert(DI_MAX_SPEC_TOKENS <= (int)(sizeof(((di_draft *)0)->tokens) / sizeof(int32_t)),
               "a draft block holds the drafts of a verify");

// Takes logit slot k's sequence back to position pos_new (rejected verify rows, or accepted ones
// a cancellation cut off): its V4.1 session, or its V4 state in the KV manager's blocks (the MTP
// block's state never saw a row that is not kept: it runs after the accept).
static void spec_rollback(di_engine *e, int32_t k, int32_t pos_new) {
    if (e->v41) {
        di_session *ss = e->v41[e->x_lslot[k]];
        // At most DI_MAX_SPEC_TOKENS <= DI_DSV41_ROLLBACK_MAX positions
        di_status st = di_session_rollback(ss, di_session_n_past(ss) - pos_new);
        DI_ASSERT(st == DI_OK);
        return;
    }
    if (e->dstate) { // the verify's last row (one draft): di_dsv4_dev_rollback's argument
        di_status st = di_dsv4_dev_rollback(e->dstate, e->x_lslot[k], pos_new);
        DI_ASSERT(st == DI_OK);
        return;
    }
    if (e->dstate41) { // at most DI_MAX_SPEC_TOKENS <= DI_DSV41_ROLLBACK_MAX positions
        const int32_t slot = e->x_lslot[k];
        di_status st = di_dsv41_dev_rollback(e->dstate41, slot,
                                             di_dsv41_dev_n_past(e->dstate41, slot) - pos_new);
        DI_ASSERT(st == DI_OK);
        return;
    }
    di_dsv4_state_rollback(e->model, e->kv->seqs[e->x_lslot[k]].layers, 0, e->model->hp.n_layer,
                           pos_new);
}

// The most drafts logit slot k's sequence may verify this step (0: it does not speculate); cap:
// the positions its blocks hold.
static int32_t spec_kmax(const di_engine *e, int32_t k, const di_dsv4_seq *sq, int64_t cap) {
    const di_request *r = e->x_logit_req[k];
    // Only the decode of a generated token: its session has fed every position before it. A
    // request whose grammar is active does not speculate (its matcher advances one sampled token
    // at a time); before the grammar's trigger token (tool_choice auto: ｜DSML｜) it does, and
    // spec_accept ends the block at the trigger.
    if (e->spec_k == 0 || sq->n_tok != 1 || r->n_gen < 1 || (r->gm && r->g_active)) return 0;
    DI_ASSERT(sq->pos == di_request_n_tokens(r) - 1);
    int32_t k_max = e->spec_k;
    if (r->max_tokens - r->n_gen - 1 < k_max) k_max = r->max_tokens - r->n_gen - 1;
    if (e->opt.max_ctx - sq->pos - 2 < k_max) k_max = e->opt.max_ctx - sq->pos - 2;
    // Within the blocks taken at launch: the verify rows, and the position after the last one it
    // may accept (spec_settle's next decode) without a new block.
    if (cap - sq->pos - 2 < k_max) k_max = (int32_t)(cap - sq->pos - 2);
    return k_max < 1 ? 0 : k_max;
}

// Which of the drafts d logit slot k's sequence verifies (at most k_max): writes them after r's
// known tokens (the sampling history of the verify rows) and ver[0..*n_ver) = [anchor, drafts]
// (ver[0] is set by the caller).
static void spec_take(di_engine *e, int32_t k, const di_dsv4_seq *sq, di_draft *d, int32_t k_max,
                      int32_t *ver, int32_t *n_ver) {
    di_request *r = e->x_logit_req[k];
    if (e->draft_hook) e->draft_hook(e->draft_user, r->id, r->n_gen, d);
    if (d->n < k_max) k_max = d->n;
    int32_t n = 1;
    float surv = d->confidence[0];
    while (n < k_max && (e->spec_tau < 0 || surv * d->confidence[n] >= e->spec_tau))
        surv *= d->confidence[n++];
    for (int32_t j = 0; j < n; j++) {
        DI_ASSERT(d->tokens[j] >= 0 && d->tokens[j] < e->model->hp.n_vocab);
        ver[1 + j] = d->tokens[j];
        r->tokens[sq->pos + 1 + j] = d->tokens[j]; // within n_prompt + max_tokens: n <= k_max
    }
    *n_ver = n + 1;
    e->x_nrows[k] = n + 1;
    e->x_ndraft[k] = n;
    e->x_nprop[k] = d->n;
}

// After the step's rows are sampled: each verify accepts its drafts up to the first one that
// differs from its row's token and rolls the rejected rows back. A request with a grammar not yet
// active keeps its block only up to the grammar's trigger token, which activates the grammar: the
// rows after it were sampled unconstrained, so they are rolled back too, and the next step
// samples the position after the trigger under the grammar, exactly as without speculation.
static void spec_accept(di_engine *e) {
    for (int32_t k = 0; k < e->x_n_logit; k++) {
        const int32_t nd = e->x_ndraft[k];
        if (nd == 0) continue;
        di_request *r = e->x_logit_req[k];
        const di_sample_result *res = e->x_res + (int64_t)k * e->lstride;
        const int32_t *draft = r->tokens + di_request_n_tokens(r);
        int32_t n = 0;
        while (n < nd && res[n].token == draft[n]) n++;
        for (int32_t j = 0; r->gm && j <= n; j++)
            if (res[j].token == r->grammar_after) {
                DI_ASSERT(!r->g_active); // it drafts only before the trigger
                r->g_active = true;
                n = j;
                break;
            }
        e->x_emit[k] = n + 1;
        // The anchor's position + 1 + accepted drafts: the verify's rows after them go.
        if (n < nd) spec_rollback(e, k, di_request_n_tokens(r) + n);
    }
}

// ---- V4.1 pages and prefix hits (docs/kv-cache.md, "DeepSeek V4.1") ----

// At launch (no forward in flight), for each sequence of the plan: with speculation, a sampled
// decode takes the blocks its verify rows may need (its anchor, spec_k drafts and the position
// after them; best effort: spec_kmax drafts no further than the blocks reach); then its slot's
// session is bound to its block table as it is now. A sequence's first call after admission on a
// prefix hit of H positions (its blocks 0 .. H / block_tokens - 1 are the cached ones, shared)
// restarts the session on them at position win_lo = Q (di_dsv41_restart: entries < H kept, so the
// replay of Q .. H - 1 never writes into a shared block; Q = 0 too); a sequence planned from
// position 0 otherwise starts over (reset).
static void v41_bind(di_engine *e) {
    const di_sched *s = &e->sched;
    for (int32_t i = 0; i < s->n_seq; i++) {
        const di_dsv4_seq *sq = &s->seqs[i];
        const di_request *r = s->seq_req[i];
        const di_kv_seq *ks = &e->kv->seqs[r->slot];
        di_session *ss = e->v41[r->slot];
        if (e->spec_k > 0 && sq->pos + sq->n_tok == di_request_n_planned(r)) {
            int32_t end = sq->pos + sq->n_tok + 1 + e->spec_k;
            if (end > e->opt.max_ctx) end = e->opt.max_ctx;
            (void)di_kv_seq_reserve(e->kv, r->slot, end);
        }
        di_dsv41_bind_pages(ss, v41_pages(ks), ks->n_blocks);
        if (ks->n_cached > 0 && sq->pos == sq->win_lo)
            (void)di_dsv41_restart(ss, ks->n_cached, sq->pos, r->tokens); // a failure: pos 0
        else if (sq->pos == 0)
            di_session_reset(ss);
    }
}

// The V4.1 forward of the plan being run: the DSpark drafts of every sequence that speculates in
// one draft call (di_dsv41_draft_batch), then one batched call (di_dsv41_forward_batch) over all
// its sequences, each on its slot's session: prefill chunks, decodes and verifies (a verify's row
// span holds its anchor and the drafts it keeps). The call writes the logit rows contiguously in
// sequence order; they then move to their logit slots (slot k owns rows k * lstride ..; the plan
// samples only a sequence's last row, a verify its k + 1 rows). A failed draft or forward call
// fails the step (fail_step) before any session moved; every slot of the step restarts at
// position 0 when reused.
static di_status v41_forward(di_engine *e) {
    const int64_t V = e->model->hp.n_vocab;
    int32_t row = 0, n_out = 0, n_draft = 0;
    for (int32_t i = 0; i < e->x_n_seq; i++) {
        const di_dsv4_seq *sq = &e->x_seqs[i];
        di_session *s = e->v41[e->x_slot[i]];
        // v41_bind reset or restarted the session at launch: it stands at the plan's position (an
        // invariant of the plan; fail rather than abort)
        if (di_session_n_past(s) != sq->pos) {
            DI_LOG_ERROR("engine: V4.1 slot %d is at position %d, the plan feeds position %d",
                         (int)e->x_slot[i], (int)di_session_n_past(s), (int)sq->pos);
            return DI_ERR_INVALID;
        }
        const int32_t last = row + sq->n_tok - 1;
        int32_t kslot = -1;
        for (int32_t k = 0; k < e->x_n_logit; k++)
            if (e->x_logit_rows[k] == last) kslot = k;
        e->x_b[i] = (di_dsv41_seq){.s = s, .tokens = e->x_tokens + row, .n_tok = sq->n_tok};
        e->x_bk[i] = kslot;
        if (kslot >= 0) {
            e->x_lslot[kslot] = e->x_slot[i];
            e->x_b[i].n_out = 1;
            e->x_ver[(int64_t)kslot * e->lstride] = e->x_tokens[last];
            const int32_t k_max = spec_kmax(e, kslot, sq, di_dsv41_capacity(s));
            if (k_max > 0) { // drafts its block in the step's draft call
                e->x_d[n_draft] = (di_dsv41_draft_seq){.s = s, .anchor = e->x_tokens[last]};
                e->x_dseq[n_draft] = i;
                e->x_dkmax[n_draft++] = k_max;
            }
            n_out++;
        }
        row += sq->n_tok;
    }
    DI_ASSERT(n_out == e->x_n_logit); // every logit row is the last row of its sequence
    if (n_draft > 0) {
        di_status st = di_dsv41_draft_batch(e->model, &e->ws, e->x_d, n_draft, NULL);
        if (st != DI_OK) return st;
        _Static_assert(sizeof(di_draft) == sizeof(di_dsv41_draft), "same layout");
        for (int32_t j = 0; j < n_draft; j++) { // a verify: [anchor, drafts], logits of every row
            const int32_t i = e->x_dseq[j], kslot = e->x_bk[i];
            int32_t *ver = e->x_ver + (int64_t)kslot * e->lstride, n_ver = 1;
            di_draft d;
            memcpy(&d, &e->x_d[j].out, sizeof d);
            spec_take(e, kslot, &e->x_seqs[i], &d, e->x_dkmax[j], ver, &n_ver);
            e->x_b[i].tokens = ver;
            e->x_b[i].n_tok = e->x_b[i].n_out = n_ver;
        }
    }
    // Context parallelism (cp/cp.h): a long prefill chunk (at least the threshold's rows, not a
    // verify) runs alone over the prefill workers after the batched call of the others, which
    // move to the front of x_b (a sequence's results do not depend on its batch or its order).
    int32_t n_batch = e->x_n_seq;
    if (e->model->cp) {
        const int32_t min_tok = di_cp_min_tokens(e->model->cp);
        n_batch = 0;
        for (int32_t i = 0, row0 = 0; i < e->x_n_seq; row0 += e->x_seqs[i].n_tok, i++) {
            const bool cp = e->x_b[i].tokens == e->x_tokens + row0 && e->x_b[i].n_tok >= min_tok;
            if (cp) continue;
            const di_dsv41_seq b = e->x_b[i];
            const int32_t bk = e->x_bk[i];
            for (int32_t j = i; j > n_batch; j--)
                e->x_b[j] = e->x_b[j - 1], e->x_bk[j] = e->x_bk[j - 1];
            e->x_b[n_batch] = b, e->x_bk[n_batch++] = bk;
        }
    }
    di_status st =
        n_batch > 0 ? di_dsv41_forward_batch(e->model, &e->ws, e->x_b, n_batch, e->logits) : DI_OK;
    if (st != DI_OK) return st;
    // Logit rows to their slots, last first (a slot's rows never start below where the call
    // wrote them, so every move goes up or stays and never clobbers a row still to move).
    int32_t off = 0;
    for (int32_t i = 0; i < n_batch; i++) off += e->x_b[i].n_out;
    for (int32_t i = n_batch - 1; i >= 0; i--) {
        off -= e->x_b[i].n_out;
        if (e->x_bk[i] < 0) continue;
        const int64_t dst = (int64_t)e->x_bk[i] * e->lstride;
        DI_ASSERT(dst >= off);
        if (dst != off)
            memmove(e->logits + dst * V, e->logits + (int64_t)off * V,
                    sizeof(float) * (size_t)(e->x_b[i].n_out * V));
    }
    // The long chunks, each alone over the workers; a logit row goes straight to its slot (a
    // slot no batched sequence owns).
    for (int32_t i = n_batch; i < e->x_n_seq && st == DI_OK; i++) {
        const di_dsv41_seq *b = &e->x_b[i];
        float *lg = e->x_bk[i] >= 0 ? e->logits + (int64_t)e->x_bk[i] * e->lstride * V : NULL;
        st = di_cp_v41_seq_forward(e->model->cp, b->s, b->tokens, b->n_tok, lg);
    }
    return st;
}

// ---- V4 with the MTP block (speculative decoding on the CPU forward) ----

// Plan sequence i of the step (its planned rows start at row of x_tokens) on the CPU or the
// device-resident forward with MTP drafts: its rows are copied to vrow of x_vtokens and, when it
// samples, a verify of its slot's MTP draft is appended (a draft made for this request at its
// anchor's next position; spec_take, whose hook may rewrite the draft) and its logit rows listed
// in x_vlogit (from *n_vl). Returns its rows in the call.
static int32_t mtp_plan_seq(di_engine *e, int32_t i, int32_t row, int32_t vrow, int32_t *n_vl) {
    const di_dsv4_seq *sq = &e->x_seqs[i];
    const di_request *r = e->x_seq_req[i];
    memcpy(e->x_vtokens + vrow, e->x_tokens + row, sizeof(int32_t) * (size_t)sq->n_tok);
    const int32_t last = row + sq->n_tok - 1;
    int32_t kslot = -1;
    for (int32_t k = 0; k < e->x_n_logit; k++)
        if (e->x_logit_rows[k] == last) kslot = k;
    e->x_bk[i] = kslot;
    if (kslot < 0) return sq->n_tok;
    e->x_lslot[kslot] = r->slot;
    e->x_vlogit[(*n_vl)++] = vrow + sq->n_tok - 1;
    const int32_t k_max = spec_kmax(e, kslot, sq, e->x_cap[i]);
    if (k_max <= 0 || e->mtp_draft_req[r->slot] != r->id ||
        e->mtp_draft_pos[r->slot] != sq->pos + 1)
        return sq->n_tok;
    di_draft d = {.n = 1};
    d.tokens[0] = e->mtp_draft[r->slot];
    d.confidence[0] = 1.0f;
    int32_t n_ver = 1;
    spec_take(e, kslot, sq, &d, k_max, e->x_vtokens + vrow, &n_ver);
    for (int32_t j = 1; j < n_ver; j++) e->x_vlogit[(*n_vl)++] = vrow + j;
    return n_ver;
}

// The n_vl logit rows the call wrote to the front of e->logits move to their logit slots (slot k
// owns rows k * lstride ..), last first (a slot's rows never start below where the call wrote
// them, so every move goes up or stays and never clobbers a row still to move).
static void logits_to_slots(di_engine *e, int32_t n_vl) {
    const int64_t V = e->model->hp.n_vocab;
    int32_t off = n_vl;
    for (int32_t k = e->x_n_logit - 1; k >= 0; k--) {
        off -= e->x_nrows[k];
        const int64_t dst = (int64_t)k * e->lstride;
        DI_ASSERT(dst >= off);
        if (dst != off) {
            memmove(e->logits + dst * V, e->logits + (int64_t)off * V,
                    sizeof(float) * (size_t)(e->x_nrows[k] * V));
            memmove(e->x_greedy + dst, e->x_greedy + off, (size_t)e->x_nrows[k]);
            memmove(e->x_pick + dst, e->x_pick + off, sizeof(int32_t) * (size_t)e->x_nrows[k]);
        }
    }
}

// The CPU forward of the plan being run when the MTP block drafts: a sampled decode whose slot
// holds an MTP draft for its anchor's next position (made for this request) verifies [y, d] in
// its rows of the step's one call (spec_take; the hook may rewrite the draft), every other
// sequence runs its planned rows. The call computes no logits itself: the main streams of all
// rows go to the XMAIN scratch (the MTP block's input, mtp_step) before the head runs on the
// logit rows, which then move to their logit slots (slot k owns rows k * lstride ..).
static di_status v4_spec_forward(di_engine *e) {
    int32_t row = 0, vrow = 0, n_vl = 0;
    for (int32_t i = 0; i < e->x_n_seq; i++) {
        e->x_vseqs[i] = e->x_seqs[i];
        e->x_vseqs[i].n_tok = mtp_plan_seq(e, i, row, vrow, &n_vl);
        row += e->x_seqs[i].n_tok;
        vrow += e->x_vseqs[i].n_tok;
    }
    di_dsv4_ctx c = {.model = e->model, .ws = &e->ws, .seqs = e->x_vseqs, .n_seq = e->x_n_seq};
    di_status st = di_dsv4_forward_batch(&c, e->x_vtokens, NULL, 0, NULL);
    if (st != DI_OK) return st;
    const int64_t row_floats = (int64_t)e->model->hp.hc_mult * e->model->hp.n_embd;
    memcpy(di_dsv4_scratch(&c, DI_SCR_XMAIN), di_dsv4_scratch(&c, DI_SCR_X),
           sizeof(float) * (size_t)(c.n_rows * row_floats));
    if (n_vl > 0) di_dsv4_head_rows(&c, e->x_vlogit, n_vl, e->logits);
    logits_to_slots(e, n_vl);
    return DI_OK;
}

// The MTP call's rows of plan sequence i (n_tok rows in the step's call from position pos),
// placed from row mrow of the MTP call: the rows kept (a verify's anchor and accepted drafts,
// every other sequence's rows; 0: it ends, its constrained sample failed), each's next token into
// x_mids (the next prompt token, an accepted draft, or the row's sample); when the sequence
// sampled, its last kept row (position P') is the MTP call's logit row *n_ml, drafting for
// P' + 2. Its slot's draft is void until the MTP call makes a new one.
static int32_t mtp_kept(di_engine *e, int32_t i, int32_t pos, int32_t n_tok, int32_t mrow,
                        int32_t *n_ml) {
    const di_request *r = e->x_seq_req[i];
    const int32_t kslot = e->x_bk[i];
    e->mtp_draft_req[r->slot] = 0;
    // A plain row's sample is its slot's row 0, a verify's row j samples the position after its
    // row j.
    int32_t keep = n_tok;
    const di_sample_result *next = NULL;
    if (kslot >= 0) {
        next = e->x_res + (int64_t)kslot * e->lstride;
        if (e->x_ndraft[kslot] > 0) keep = e->x_emit[kslot], next += keep - 1;
        if (next->token < 0) return 0;
    }
    int32_t *ids = e->x_mids + mrow;
    for (int32_t t = 0; t < keep; t++)
        ids[t] = next && t == keep - 1 ? next->token : r->tokens[pos + t + 1];
    if (next) {
        e->x_mlogit[*n_ml] = mrow + keep - 1;
        e->x_mseq[(*n_ml)++] = i;
        e->mtp_draft_pos[r->slot] = pos + keep + 1;
    }
    return keep;
}

// The drafts of the MTP call's n_ml logit rows (argmax, ties to the lower id: picks[j], the
// device's, or di_argmax of mtp_logits when picks is NULL), for the plan sequences x_mseq.
static void mtp_drafts(di_engine *e, int32_t n_ml, const int32_t *picks) {
    const int64_t V = e->model->hp.n_vocab;
    for (int32_t j = 0; j < n_ml; j++) {
        const di_request *r = e->x_seq_req[e->x_mseq[j]];
        e->mtp_draft[r->slot] =
            picks ? picks[j] : di_argmax(e->mtp_logits + (int64_t)j * V, (int32_t)V);
        e->mtp_draft_req[r->slot] = r->id;
    }
}

// After the step's sampling and accept: the MTP block runs on every kept row of the step (a
// verify's anchor and accepted drafts, every other sequence's rows), each with the token after
// it (the next prompt token, an accepted draft, or the row's sample), so a slot's MTP state
// holds exactly the rows of the positions its sequence has kept: it never rolls back. The MTP
// logits of each sampled sequence's last kept row (position P') predict the token at P' + 2, the
// next decode's draft (argmax, ties to the lower id). A sequence whose sampling failed (it ends)
// is left out.
static di_status mtp_step(di_engine *e) {
    const di_hparams *hp = &e->model->hp;
    const int64_t row_floats = (int64_t)hp->hc_mult * hp->n_embd;
    const size_t nl = (size_t)hp->n_layer + 1;
    di_dsv4_ctx c = {.model = e->model, .ws = &e->ws, .seqs = e->x_mseqs};
    float *xm = di_dsv4_scratch(&c, DI_SCR_XMAIN); // [rows, NC, D]: the call's main streams
    int32_t n_m = 0, mrow = 0, n_ml = 0;
    for (int32_t i = 0; i < e->x_n_seq; i++) {
        const di_dsv4_seq *vs = &e->x_vseqs[i];
        const di_request *r = e->x_seq_req[i];
        const int32_t keep = mtp_kept(e, i, vs->pos, vs->n_tok, mrow, &n_ml);
        if (keep == 0) continue;
        if (mrow != vs->row0) // kept rows move down (rows ascend)
            memmove(xm + (int64_t)mrow * row_floats, xm + (int64_t)vs->row0 * row_floats,
                    sizeof(float) * (size_t)(keep * row_floats));
        e->x_mseqs[n_m++] = (di_dsv4_seq){.layers = e->mtp_ls + (size_t)r->slot * nl,
                                          .pos = vs->pos,
                                          .n_tok = keep,
                                          .win_lo = vs->win_lo};
        mrow += keep;
    }
    if (n_m == 0) return DI_OK;
    c.n_seq = n_m;
    di_dsv4_set_rows(&c);
    di_status st = di_dsv4_mtp_forward_batch(&c, xm, e->x_mids, e->x_mlogit, n_ml, e->mtp_logits);
    if (st == DI_OK) mtp_drafts(e, n_ml, NULL);
    return st;
}

// ---- speculative decoding on the device-resident forward (V4 with the MTP block) ----
//
// As on the CPU forward (above), through the dev state (model/dsv4_dev.h "MTP"): the step's one
// call feeds a sampled decode's [y, d] when its slot holds an MTP draft for its anchor's next
// position, with logits for both rows; the rejected row is taken back in the dev state
// (di_dsv4_dev_rollback: one row, which leaves no trace in the window and compressor rings or the
// entries); the MTP call (di_dsv4_dev_mtp_forward) then runs on the kept rows, reading their main
// streams, which the state keeps from the step's call. A step in which every sequence verifies
// (all rows sampled) replays its verify graph (prepared at create, dev_warm_up); one mixing
// verifies with plain decodes or prefill chunks runs directly, and so does the MTP call.

// The step's call with its verify rows (v4_spec_forward's plan on x_vdev); the logit rows then
// move to their logit slots.
static di_status dev_spec_forward(di_engine *e) {
    int32_t row = 0, vrow = 0, n_vl = 0;
    for (int32_t i = 0; i < e->x_n_seq; i++) {
        e->x_vdev[i] = e->x_dev[i];
        e->x_vdev[i].n_tok = mtp_plan_seq(e, i, row, vrow, &n_vl);
        row += e->x_seqs[i].n_tok;
        vrow += e->x_vdev[i].n_tok;
    }
    mark_greedy(e, n_vl);
    di_status st = di_dsv4_dev_forward_picks(e->dstate, e->x_vdev, e->x_n_seq, e->x_vtokens,
                                             e->x_vlogit, n_vl, e->logits, e->x_greedy, e->x_pick);
    if (st != DI_OK) return st;
    logits_to_slots(e, n_vl);
    return DI_OK;
}

// V4.1 with DSpark on the device-resident forward (v41_forward's order on the dev state): the
// drafts of every sampled decode that speculates in one draft call (di_dsv41_dev_draft, chunks of
// DI_ENGINE_DRAFT_CHUNK slots; each slot as the previous step left it, its anchor the token it
// feeds now), then the step's one call, a verify's rows [anchor, drafts] (spec_take: the
// confidence cut, the hook) with the logits of every one, another sequence's planned rows with
// its last row's logits when it samples. A failed draft or call fails the step (fail_step) before
// any slot moved.
static di_status dev41_spec_forward(di_engine *e) {
    int32_t row = 0, n_draft = 0;
    for (int32_t i = 0; i < e->x_n_seq; row += e->x_seqs[i].n_tok, i++) {
        const di_dsv4_seq *sq = &e->x_seqs[i];
        const int32_t last = row + sq->n_tok - 1;
        int32_t kslot = -1;
        for (int32_t k = 0; k < e->x_n_logit; k++)
            if (e->x_logit_rows[k] == last) kslot = k;
        e->x_bk[i] = kslot;
        if (kslot < 0) continue;
        e->x_lslot[kslot] = e->x_seq_req[i]->slot;
        const int32_t k_max = spec_kmax(e, kslot, sq, e->x_cap[i]);
        if (k_max <= 0) continue;
        e->x_dd[n_draft] =
            (di_dsv41_dev_draft_seq){.slot = e->x_seq_req[i]->slot, .anchor = e->x_tokens[last]};
        e->x_dseq[n_draft] = i;
        e->x_dkmax[n_draft++] = k_max;
    }
    for (int32_t c0 = 0; c0 < n_draft; c0 += DI_ENGINE_DRAFT_CHUNK) {
        const int32_t n =
            n_draft - c0 < DI_ENGINE_DRAFT_CHUNK ? n_draft - c0 : DI_ENGINE_DRAFT_CHUNK;
        di_status st = di_dsv41_dev_draft(e->dstate41, e->x_dd + c0, n, NULL);
        if (st != DI_OK) return st;
    }
    int32_t vrow = 0, n_vl = 0, j = 0;
    row = 0;
    for (int32_t i = 0; i < e->x_n_seq; row += e->x_seqs[i].n_tok, i++) {
        const di_dsv4_seq *sq = &e->x_seqs[i];
        int32_t *ver = e->x_vtokens + vrow;
        memcpy(ver, e->x_tokens + row, sizeof(int32_t) * (size_t)sq->n_tok);
        e->x_vdev[i] = e->x_dev[i];
        int32_t n_rows = sq->n_tok;
        const int32_t kslot = e->x_bk[i];
        if (j < n_draft && e->x_dseq[j] == i) { // a verify: [anchor, drafts]
            _Static_assert(sizeof(di_draft) == sizeof(di_dsv41_draft), "same layout");
            di_draft d;
            memcpy(&d, &e->x_dd[j].out, sizeof d);
            spec_take(e, kslot, sq, &d, e->x_dkmax[j], ver, &n_rows);
            e->x_vdev[i].n_tok = n_rows;
            for (int32_t t = 0; t < n_rows; t++) e->x_vlogit[n_vl++] = vrow + t;
            j++;
        } else if (kslot >= 0) {
            e->x_vlogit[n_vl++] = vrow + n_rows - 1;
        }
        vrow += n_rows;
    }
    mark_greedy(e, n_vl);
    di_status st = dev_forward(e, e->x_vdev, e->x_prefix, e->x_n_seq, e->x_vtokens, e->x_vlogit,
                               n_vl, e->logits, e->x_greedy, e->x_pick);
    if (st != DI_OK) return st;
    logits_to_slots(e, n_vl);
    return DI_OK;
}

// After the step's sampling and accept: the MTP call on every kept row of the step, each with the
// token after it, and the next drafts (mtp_step's rules, on the dev state: row t of the MTP call
// reads the main streams of its row of the step's call).
static di_status dev_mtp_step(di_engine *e) {
    int32_t n_m = 0, mrow = 0, n_ml = 0, vrow = 0;
    for (int32_t i = 0; i < e->x_n_seq; vrow += e->x_vdev[i].n_tok, i++) {
        const di_dsv4_dev_seq *vs = &e->x_vdev[i];
        const di_request *r = e->x_seq_req[i];
        const int32_t keep = mtp_kept(e, i, vs->pos, vs->n_tok, mrow, &n_ml);
        if (keep == 0) continue;
        for (int32_t t = 0; t < keep; t++) e->x_mrows[mrow + t] = vrow + t;
        e->x_mdev[n_m++] =
            (di_dsv4_dev_seq){.slot = r->slot, .pos = vs->pos, .n_tok = keep, .win_lo = vs->win_lo};
        mrow += keep;
    }
    if (n_m == 0) return DI_OK;
    di_status st =
        di_dsv4_dev_mtp_forward_picks(e->dstate, e->x_mdev, n_m, e->x_mrows, e->x_mids, e->x_mlogit,
                                      n_ml, e->mtp_logits, e->mtp_all, e->mtp_pick);
    if (st == DI_OK) mtp_drafts(e, n_ml, e->mtp_pick);
    return st;
}

static int64_t mono_us(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000 + ts.tv_nsec / 1000;
}

static void *forward_main(void *p) {
    di_engine *e = p;
    pthread_mutex_lock(&e->fmu);
    for (;;) {
        while (!e->f_go && !e->f_quit) pthread_cond_wait(&e->fcv, &e->fmu);
        if (e->f_quit) break;
        e->f_go = false;
        pthread_mutex_unlock(&e->fmu);
        int64_t a0 = di_mem_thread_allocs();
        const int64_t t0 = mono_us();
        int64_t t_sample = 0;
        if (e->dev_on) arm_loss(e);
        di_status st = inject_failure(e);
        // The disk tier's device transfers handed over at launch, before any op of the call
        // (a failed upload fails the step, as a device fault).
        if (e->dev_on) {
            const di_status xs = di_kv_dev_run(e->kv);
            if (st == DI_OK) st = xs;
        }
        if (st != DI_OK) {
            // nothing ran
        } else if (e->v41) {
            st = v41_forward(e);
        } else if (e->dev_on) {
            st = e->x_restore_st; // the launch's tail restores
            if (st == DI_OK && e->spec_k > 0 && e->dstate41)
                st = dev41_spec_forward(e); // V4.1 with DSpark
            else if (st == DI_OK && e->spec_k > 0)
                st = dev_spec_forward(e); // V4 with MTP
            else if (st == DI_OK) {
                mark_greedy(e, e->x_n_logit); // one row a slot: the call's rows are the slots'
                st = dev_forward(e, e->x_dev, e->x_prefix, e->x_n_seq, e->x_tokens, e->x_logit_rows,
                                 e->x_n_logit, e->logits, e->x_greedy, e->x_pick);
            }
        } else if (e->mtp_ls) {
            st = v4_spec_forward(e);
        } else if (e->model->cp) { // long prefill chunks over the prefill workers (cp/cp.h)
            di_dsv4_ctx c = {
                .model = e->model, .ws = &e->ws, .seqs = e->x_seqs, .n_seq = e->x_n_seq};
            st = di_cp_batch_forward(e->model->cp, &c, e->x_tokens, e->x_logit_rows, e->x_n_logit,
                                     e->logits);
        } else {
            di_dsv4_ctx c = {
                .model = e->model, .ws = &e->ws, .seqs = e->x_seqs, .n_seq = e->x_n_seq};
            st = di_dsv4_forward_batch(&c, e->x_tokens, e->x_logit_rows, e->x_n_logit, e->logits);
        }
        if (st == DI_OK) {
            e->x_n_job = 0;
            for (int32_t k = 0; k < e->x_n_logit; k++)
                for (int32_t i = 0; i < e->x_nrows[k]; i++)
                    e->x_job[e->x_n_job++] = k * e->lstride + i;
            const int64_t ts = mono_us();
            atomic_store_explicit(&e->x_job_next, 0, memory_order_relaxed);
            di_pool_run(e->model->pool, sample_task, e);
            t_sample = mono_us() - ts;
            if (e->spec_k > 0) spec_accept(e);
            if (e->mtp_ls) st = mtp_step(e); // an expert worker failing here fails the step
            if (e->dstate && e->spec_k > 0) st = dev_mtp_step(e); // a device fault fails it too
        }
        int64_t allocs = di_mem_thread_allocs() - a0;
        pthread_mutex_lock(&e->fmu);
        e->f_allocs = allocs;
        e->f_sample_us = t_sample;
        e->f_forward_us = mono_us() - t0 - t_sample;
        e->f_status = st;
        e->f_done = true;
        pthread_cond_broadcast(&e->fcv);
    }
    pthread_mutex_unlock(&e->fmu);
    return NULL;
}

// Copies the scheduler's (finalised) plan, advances its requests and starts its forward.
static void launch(di_engine *e) {
    di_sched *s = &e->sched;
    e->x_n_seq = s->n_seq;
    e->x_n_logit = s->n_logit;
    memcpy(e->x_seqs, s->seqs, sizeof *s->seqs * (size_t)s->n_seq);
    memcpy(e->x_tokens, s->tokens, sizeof *s->tokens * (size_t)s->n_rows);
    memcpy(e->x_logit_rows, s->logit_rows, sizeof *s->logit_rows * (size_t)s->n_logit);
    memcpy(e->x_logit_req, s->logit_req, sizeof *s->logit_req * (size_t)s->n_logit);
    memcpy(e->x_seq_req, s->seq_req, sizeof *s->seq_req * (size_t)s->n_seq);
    e->x_n_mask = 0;
    for (int32_t k = 0; k < s->n_logit; k++) { // the rows sample_task samples constrained
        di_request *r = s->logit_req[k];
        if (!r->gm || !r->g_active || r->g_status != DI_OK) continue;
        atomic_store_explicit(&r->g_mask_state, DI_MASK_NONE, memory_order_relaxed);
        e->x_mask_req[e->x_n_mask++] = r;
    }
    if (e->dev_on) {
        // A running request's scheduler slot is its dev slot. An admission (a new request, or a
        // preempted one readmitted) starts at position 0, or after a prefix hit of H positions
        // at win_lo = Q (bounded replay), which restarts the slot; later chunks continue at the
        // slot's n_past (the forward refuses anything else with DI_ERR_INVALID, which fails the
        // step's requests). Its block ids are copied: the scheduler plans the next step
        // (appending blocks) while this one runs.
        // With speculation a sampled decode first takes the blocks its verify rows may need, as
        // on the CPU forward (below).
        const int32_t mb = e->kv->max_blocks;
        for (int32_t i = 0; i < s->n_seq; i++) {
            const di_request *r = s->seq_req[i];
            const di_kv_seq *ks = &e->kv->seqs[r->slot];
            if (e->spec_k > 0) {
                const di_dsv4_seq *sq = &s->seqs[i];
                if (sq->pos + sq->n_tok == di_request_n_planned(r)) {
                    int32_t end = sq->pos + sq->n_tok + 1 + e->spec_k;
                    if (end > e->opt.max_ctx) end = e->opt.max_ctx;
                    (void)di_kv_seq_grow(e->kv, r->slot, end);
                }
                e->x_cap[i] = ks->n_blocks * e->kv->block_tokens;
            }
            int32_t *blk = e->x_blocks + (int64_t)i * mb;
            memcpy(blk, ks->blocks, sizeof(int32_t) * (size_t)ks->n_blocks);
            e->x_dev[i] = (di_dsv4_dev_seq){.slot = r->slot,
                                            .pos = s->seqs[i].pos,
                                            .n_tok = s->seqs[i].n_tok,
                                            .blocks = blk,
                                            .n_blocks = ks->n_blocks,
                                            .win_lo = s->seqs[i].win_lo,
                                            .n_cached = ks->n_cached};
            if (e->x_prefix) e->x_prefix[i] = r->tokens; // V4.1: a replay's Engram look-back
        }
        dev_restores(e, s);
    }
    if (e->v41) {
        for (int32_t i = 0; i < s->n_seq; i++) e->x_slot[i] = s->seq_req[i]->slot;
        v41_bind(e);
    }
    if (e->mtp_ls) {
        // MTP speculation: a sampled decode takes the blocks its verify rows may need (its
        // anchor, spec_k drafts and the position after them; best effort: spec_kmax verifies no
        // further than x_cap, the positions its blocks hold).
        for (int32_t i = 0; i < s->n_seq; i++) {
            const di_dsv4_seq *sq = &s->seqs[i];
            const di_request *r = s->seq_req[i];
            if (sq->pos + sq->n_tok == di_request_n_planned(r)) {
                int32_t end = sq->pos + sq->n_tok + 1 + e->spec_k;
                if (end > e->opt.max_ctx) end = e->opt.max_ctx;
                (void)di_kv_seq_grow(e->kv, r->slot, end);
            }
            e->x_cap[i] = e->kv->seqs[r->slot].n_blocks * e->kv->block_tokens;
        }
    }
    for (int32_t k = 0; k < s->n_logit; k++) { // one token each, unless the forward verifies
        e->x_nrows[k] = e->x_emit[k] = 1;
        e->x_ndraft[k] = e->x_nprop[k] = 0;
    }
    di_sched_advance(s);
    s->n_seq = s->n_rows = s->n_logit = 0; // the plan now runs; the next one starts empty
    // The disk tier's device transfers recorded so far run on the forward thread before the call
    // (after every eviction and prefetch of this plan; the next plan's go to the next batch).
    if (e->dev_on) (void)di_kv_dev_begin(e->kv);
    pthread_mutex_lock(&e->fmu);
    e->f_done = false;
    e->f_go = true;
    pthread_cond_signal(&e->fcv);
    pthread_mutex_unlock(&e->fmu);
}

// Returns whether the forward in flight has returned (without waiting).
static bool forward_done(di_engine *e) {
    pthread_mutex_lock(&e->fmu);
    bool done = e->f_done;
    pthread_mutex_unlock(&e->fmu);
    return done;
}

// Waits for the forward in flight; returns its status, (*allocs) the allocations it made and its
// times (us[0] the forward calls, us[1] the sampling).
static di_status forward_wait(di_engine *e, int64_t *allocs, int64_t us[2]) {
    pthread_mutex_lock(&e->fmu);
    while (!e->f_done) pthread_cond_wait(&e->fcv, &e->fmu);
    *allocs = e->f_allocs;
    us[0] = e->f_forward_us, us[1] = e->f_sample_us;
    di_status st = e->f_status;
    pthread_mutex_unlock(&e->fmu);
    return st;
}

// Blocks marked in e->marks left the prefix cache holding nothing computed: the running requests
// (those the plan ahead admitted) that attached any of them are preempted (they attach what is
// really cached when readmitted); the marks are cleared. Returns how many.
static int32_t preempt_marked(di_engine *e) {
    di_sched *s = &e->sched;
    int32_t n = 0;
    for (int32_t i = s->n_running - 1; i >= 0; i--) {
        di_request *r = s->running[i];
        const di_kv_seq *q = &e->kv->seqs[r->slot];
        bool stale = false;
        for (int32_t b = 0; b < q->n_blocks && !stale; b++) stale = e->marks[q->blocks[b]];
        if (stale) di_sched_preempt(s, r), n++;
    }
    memset(e->marks, 0, (size_t)di_block_pool_n_total(e->kv->pool));
    return n;
}

// The forward of the step just run failed (the device-resident forward: DI_ERR_CUDA, DI_ERR_NOMEM,
// or DI_ERR_INVALID for a call it refused; either forward under failure injection): every request
// of the step ends with DI_FINISH_ERROR
// and that status; their slots return to the free list and restart at position 0 when reused.
// Requests not in the step (waiting, or admitted by the plan ahead) go on. Their rows leave the
// plan built ahead as they retire. The blocks the step published to the prefix cache when it was
// launched were never computed: they leave the cache first, and a request the plan ahead admitted
// onto any of them is preempted (it attaches what is really cached when readmitted).
static void fail_step(di_engine *e, di_status st, int64_t *cb_allocs) {
    int32_t n_unpublished = 0, n_preempted = 0;
    const unsigned long long first_id = e->x_n_seq ? e->x_seq_req[0]->id : 0; // before finish()
    for (int32_t i = 0; i < e->x_n_seq; i++)
        n_unpublished += di_kv_seq_unpublish_last(e->kv, e->x_seq_req[i]->slot, e->marks);
    // A block the step published may have been evicted while it ran: its write-back, recorded for
    // the next call's download, would store contents never computed.
    if (e->dev_on) di_kv_dev_drop_spills(e->kv);
    // Blocks whose upload failed before the call left the cache too (di_kv_dev_end marked them).
    n_unpublished += e->x_dev_bad;
    for (int32_t i = 0; i < e->x_n_seq; i++) {
        di_request *r = e->x_seq_req[i];
        r->n_pending = 0; // its token was never sampled
        int64_t a0 = di_mem_thread_allocs();
        finish(e, r, DI_FINISH_ERROR, st);
        *cb_allocs += di_mem_thread_allocs() - a0; // the user callback's, as elsewhere
    }
    if (n_unpublished > 0) n_preempted = preempt_marked(e);
    DI_LOG_ERROR("engine: step %lld failed (%s): ended its %d requests (first id %llu) with an "
                 "error; %d blocks it published left the prefix cache, %d requests that had "
                 "attached them were preempted",
                 (long long)e->stats.n_steps, di_status_str(st), (int)e->x_n_seq, first_id,
                 (int)n_unpublished, (int)n_preempted);
}

// The scheduler's clock (priority aging): milliseconds of CLOCK_MONOTONIC, plus a test's skew.
static int64_t sched_now_ms(di_engine *e) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000 + atomic_load(&e->clock_skew_ms);
}

// Takes the submitted requests into the waiting queue; returns whether cancellations arrived.
// Sleeps first while there is nothing to do and sleep is set.
static bool take_incoming(di_engine *e, bool sleep, bool *stop) {
    di_sched *s = &e->sched;
    pthread_mutex_lock(&e->mu);
    // Waiting requests that all wait for a disk prefetch leave nothing to do until it is done.
    while (sleep && !e->stop && !e->in_head && !e->any_cancel && !e->jobs && !e->eplb_ready &&
           !e->disk_ready && s->n_running == 0 && s->n_waiting == s->n_disk_skipped)
        pthread_cond_wait(&e->cv_work, &e->mu);
    e->disk_ready = false;
    di_request *in = e->in_head;
    e->in_head = e->in_tail = NULL;
    e->n_incoming = 0;
    *stop = e->stop;
    bool cancel = e->any_cancel;
    e->any_cancel = false;
    pthread_mutex_unlock(&e->mu);
    s->now_ms = sched_now_ms(e);
    for (di_request *r = in, *nx; r; r = nx) {
        nx = r->next;
        di_sched_enqueue(s, r);
    }
    return cancel;
}

// Runs the queued KV jobs (engine thread, no forward in flight) and wakes their callers.
// The device-resident forward: a job reads and writes device blocks here, on the engine thread:
// the forward thread is idle (its last call returned in forward_wait, the next launch comes
// after), so the backend has one user at a time, ordered by the hand-over's mutex. The disk
// tier's recorded transfers (the plan ahead's evictions and prefetch uploads) run first, in
// their order: an upload an export would read, a download of a block an import takes; a failed
// upload's block leaves the prefix cache and the requests the plan ahead attached to it are
// preempted, as when a step's upload fails.
static void run_jobs(di_engine *e) {
    pthread_mutex_lock(&e->mu);
    kv_job *j = e->jobs;
    e->jobs = NULL;
    pthread_mutex_unlock(&e->mu);
    if (j && e->dev_on && di_kv_dev_begin(e->kv)) {
        const di_status xs = di_kv_dev_run(e->kv);
        const int32_t n_bad = di_kv_dev_end(e->kv, e->marks);
        const int32_t n_pre = n_bad > 0 ? preempt_marked(e) : 0;
        if (xs != DI_OK)
            DI_LOG_ERROR("engine: uploading blocks read from the disk tier failed (%s): %d left "
                         "the prefix cache, %d requests that had attached them were preempted",
                         di_status_str(xs), (int)n_bad, (int)n_pre);
        lost_between_steps(e, xs, "uploading blocks read from the disk tier");
    }
    for (kv_job *nx; j; j = nx) {
        nx = j->next;
        if (j->probe) {
            di_kv_manager_probe(e->kv, j->tokens, j->n_tokens, j->salt, &j->n_a, &j->n_b);
            j->st = DI_OK;
        } else if (j->import)
            j->st = di_kv_manager_import(e->kv, j->in, j->n_in, &j->n_a, &j->n_b, j->err, j->cap);
        else
            j->st = di_kv_manager_export(e->kv, j->tokens, j->n_tokens, j->salt, &j->out, &j->n_out,
                                         &j->n_a, j->err, j->cap);
        // Recovered before its caller sees the status (it may retry on the rebuilt device).
        lost_between_steps(e, j->st, "a KV transfer");
        pthread_mutex_lock(&e->mu);
        j->done = true; // j belongs to its caller from here on
        pthread_cond_broadcast(&e->cv_job);
        if (j->import) {
            e->stats.n_blocks_free = di_block_pool_n_available(e->kv->pool);
            e->stats.n_blocks_cached = di_block_pool_n_cached_idle(e->kv->pool);
            tail_stats(e, &e->stats);
            disk_stats(e, &e->stats); // the device downloads of the blocks it evicted
        }
        pthread_mutex_unlock(&e->mu);
    }
}

// Online EPLB, on the planner thread: a plan is done; wake the engine thread (it may sleep with
// nothing to run) to apply it between steps.
static void eplb_done(void *user) {
    di_engine *e = user;
    pthread_mutex_lock(&e->mu);
    e->eplb_ready = true;
    pthread_cond_broadcast(&e->cv_work);
    pthread_mutex_unlock(&e->mu);
}

// Hands the planner the routing load since the previous plan (into w, its window) and the
// placement in force.
static void eplb_submit(di_engine *e, di_ep_load_table *w) {
    di_ep_placement cur = {0};
    di_status st = di_ep_load_window(e->expert_load, w);
    if (st == DI_OK) st = di_ep_get_placement(e->model->ep, &cur);
    if (st == DI_OK) {
        di_eplb_options opt = di_eplb_options_default();
        opt.n_ranks = cur.n_ranks;
        opt.slots_per_rank = e->opt.eplb_slots_per_rank
                                 ? e->opt.eplb_slots_per_rank
                                 : (cur.n_slots + cur.n_ranks - 1) / cur.n_ranks;
        if (e->opt.eplb_min_gain > 0) opt.min_gain = e->opt.eplb_min_gain;
        // The front computes the shared experts while the workers compute (eplb.h).
        opt.front_load_per_row = e->model->hp.n_expert_shared;
        st = di_eplb_async_submit(e->eplb, &cur, &opt);
        DI_ASSERT(st == DI_OK); // it was idle, and only this thread submits
    } else {
        DI_LOG_WARN("eplb: no plan (%s); the current placement stays", di_status_str(st));
    }
    di_ep_placement_free(&cur);
    pthread_mutex_lock(&e->mu);
    e->eplb_next_step = e->stats.n_steps + e->opt.eplb_interval;
    pthread_mutex_unlock(&e->mu);
}

// Online EPLB (engine thread, between steps: no forward in flight, so a new placement takes
// effect from the next forward on). First applies a plan the planner thread finished, when
// di_eplb_rebalance found it worth its moves; then, when a plan is due and none is in flight, hands
// the planner a copy of the routing load since the previous plan and the placement in force, and
// goes back to stepping (planning: 2-80 ms at V4-Flash shape, never on this thread). The
// placement is changed only here, so the one a plan was made against is still in force when it is
// applied. Runs outside the steps' allocation count, as the KV jobs.
static void eplb_step(di_engine *e) {
    di_eplb_async_result r;
    // Cleared before the take: a `done` call that lands after it (the planner marks a plan done,
    // then calls eplb_done) sets it again and only costs one more look; cleared after, it could
    // stay set with nothing to take and keep an idle engine thread from sleeping.
    pthread_mutex_lock(&e->mu);
    e->eplb_ready = false;
    pthread_mutex_unlock(&e->mu);
    if (di_eplb_async_take(e->eplb, &r)) {
        di_status st = r.st;
        bool applied = false;
        if (st == DI_OK && r.rep.apply) {
            st = di_ep_set_placement(e->model->ep, &r.next);
            applied = st == DI_OK;
        }
        if (st != DI_OK)
            DI_LOG_WARN("eplb: no new placement (%s); the current one stays", di_status_str(st));
        else if (applied)
            DI_LOG_INFO("eplb: new placement: max/mean rank load %.3f -> %.3f over %lld routed "
                        "pairs (contiguous %.3f), %lld replicas moved in %d layers; planned in "
                        "%.1f ms off the engine thread",
                        r.rep.balance_before, r.rep.balance_after, (long long)r.pairs,
                        r.rep.balance_contiguous, (long long)r.rep.n_moves, r.rep.n_layers_changed,
                        (double)r.plan_us / 1000.0);
        else
            DI_LOG_DEBUG("eplb: placement kept: max/mean rank load %.3f, a plan would give %.3f "
                         "(%lld routed pairs)",
                         r.rep.balance_before, r.rep.balance_after, (long long)r.pairs);
        di_ep_placement_free(&r.cur);
        di_ep_placement_free(&r.next);
        pthread_mutex_lock(&e->mu);
        e->stats.n_eplb_plans += st == DI_OK;
        e->stats.n_eplb_rebalances += applied;
        e->stats.n_eplb_moves += applied ? r.rep.n_moves : 0;
        e->stats.eplb_plan_us += r.plan_us;
        if (st == DI_OK)
            e->stats.eplb_balance = applied ? r.rep.balance_after : r.rep.balance_before;
        pthread_mutex_unlock(&e->mu);
    }
    // At most one plan in flight: a due plan waits for the previous one (its window keeps
    // growing meanwhile).
    di_ep_load_table *w = NULL;
    if (e->stats.n_steps >= e->eplb_next_step) w = di_eplb_async_window(e->eplb);
    if (w) eplb_submit(e, w);
    // Whether a plan is in flight, decided once both halves ran (a plan applied and the next one
    // handed over read as one busy stretch to di_engine_wait_idle).
    pthread_mutex_lock(&e->mu);
    e->eplb_busy = !di_eplb_async_idle(e->eplb);
    pthread_cond_broadcast(&e->cv_idle);
    pthread_mutex_unlock(&e->mu);
}

// ---- the disk tier on the device-resident forward (docs/kv-cache.md, "Disk tier") ----
//
// The kv_manager records what the disk tier does to device blocks (kv_manager.h, "device
// transfers"): an evicted block's download (its record's identity, tokens and tail snapshot are
// copied at eviction, on this thread) and a prefetched block's upload (from the prefetch's host
// staging). Launch hands the batch recorded while planning to the forward thread, which runs it
// before any op of its call: an evicted block is rewritten only by a forward call (its new
// owner's), so the download still finds what was evicted, and a read block is read only by a
// forward call. With no plan to launch (idle, waiting for a prefetch, shutting down) the engine
// thread runs the batch itself, the forward idle, so records reach the write queue (and
// di_engine_wait_idle's waiter finds them on disk) without waiting for the next step.

// The state exists from create's end on (a create that fails before has run nothing: no block
// is cached, none read).
static di_status dev_block_read(void *user, int32_t block, void *dst) {
    di_engine *e = user;
    return dev_read_block(e, block, dst);
}

static di_status dev_block_write(void *user, int32_t block, const void *src) {
    di_engine *e = user;
    return dev_write_block(e, block, src);
}

// Engine thread, no forward in flight and no plan: runs the recorded transfers. Returns their
// status (a failed upload is logged; the next call's faults surface).
static di_status dev_xfer_idle(di_engine *e) {
    const di_status st = di_kv_dev_sync(e->kv);
    pthread_mutex_lock(&e->mu);
    if (e->dev_xfer_busy) {
        e->dev_xfer_busy = false;
        pthread_cond_broadcast(&e->cv_idle);
    }
    pthread_mutex_unlock(&e->mu);
    return st;
}

static void *engine_main(void *p) {
    di_engine *e = p;
    di_sched *s = &e->sched;
    bool have_plan = false, cancel_later = false;
    for (;;) {
        // No forward is in flight here. Take new requests and cancellations (the ones that
        // arrived while the last step ran too); sleep while there is nothing to do.
        bool stop;
        if (!have_plan && e->dev_on)
            lost_between_steps(e, dev_xfer_idle(e), "the disk tier's device transfers");
        bool cancel = take_incoming(e, !have_plan, &stop) || cancel_later;
        cancel_later = false;
        run_jobs(e);
        if (e->eplb) eplb_step(e);
        if (cancel) cancel_flagged(e); // drops the cancelled requests' rows from the plan
        if (stop && s->n_running == 0 && s->n_waiting == 0) break;
        if (e->dead) { // the device is lost for good: nothing runs again ("device loss")
            int64_t cb = 0;
            end_all_lost(e, &cb);
            have_plan = false;
            continue;
        }

        int64_t a0 = di_mem_thread_allocs(), cb_allocs = 0;
        if (!have_plan || s->aborted || s->n_seq == 0) {
            s->now_ms = sched_now_ms(e);
            di_sched_step(s);
        }
        have_plan = false;
        if (s->n_seq == 0) { // nothing runs (requests may wait for a disk prefetch): show that
            pthread_mutex_lock(&e->mu);
            e->stats.n_running = s->n_running;
            e->stats.n_waiting = s->n_waiting;
            disk_stats(e, &e->stats);
            pthread_mutex_unlock(&e->mu);
            continue;
        }
        di_sched_finalize(s);
        launch(e); // step N runs from here on

        bool ahead = false, overlapped = false;
        if (!e->sync_debug) { // plan step N+1 meanwhile
            bool stop_now;
            cancel_later = take_incoming(e, false, &stop_now); // sets the scheduler's clock
            di_sched_step_ahead(s);
            ahead = !s->aborted;
            overlapped = ahead && !forward_done(e);
            have_plan = true;
        }
        const int32_t n_masks = e->masks_ahead ? masks_ahead(e) : 0;
        int64_t fwd_allocs = 0, fwd_us[2];
        di_status fst = forward_wait(e, &fwd_allocs, fwd_us);
        // The batch it ran: its prefetch staging is free; blocks whose upload failed (the step
        // failed too) leave the prefix cache, marked for fail_step.
        e->x_dev_bad = e->dev_on ? di_kv_dev_end(e->kv, e->marks) : 0;
        // The failure counters change before any request of the step retires (a waiter woken by
        // the last one sees them).
        pthread_mutex_lock(&e->mu);
        e->stats.n_failed_steps += fst != DI_OK;
        e->stats.n_failed_in_a_row = fst != DI_OK ? e->stats.n_failed_in_a_row + 1 : 0;
        pthread_mutex_unlock(&e->mu);
        if (fst == DI_OK) tails_take(e); // before any request of the step retires
        if (fst == DI_OK)
            sample_and_emit(e, &cb_allocs); // retiring drops finished requests from the plan
        else
            fail_step(e, fst, &cb_allocs);
        if (fst == DI_ERR_DEVICE_LOST) device_lost(e, &cb_allocs);
        int64_t step_allocs = di_mem_thread_allocs() - a0 - cb_allocs + fwd_allocs;

        pthread_mutex_lock(&e->mu);
        e->n_waiting_seen = s->n_waiting;
        di_engine_stats *st = &e->stats;
        st->n_steps++;
        st->n_plans_ahead += ahead;
        st->n_plans_overlapped += overlapped;
        st->n_masks_ahead += n_masks;
        st->n_step_allocs += step_allocs;
        st->forward_us += fwd_us[0];
        st->sample_us += fwd_us[1];
        st->n_prefill_tokens = s->n_prefill_rows;
        st->n_decode_tokens = s->n_decode_rows;
        st->n_preemptions = s->n_preemptions;
        st->n_priority_preemptions = s->n_priority_preemptions;
        st->n_tenants_backlogged = s->n_tenants_live;
        st->n_tenants_tracked = s->n_tenants;
        st->n_cache_hit_tokens = s->n_cache_hit_tokens;
        st->n_replayed_tokens = s->n_replayed_tokens;
        disk_stats(e, st);
        tail_stats(e, st);
        publish_spec_stats(e);
        st->n_running = s->n_running;
        st->n_waiting = s->n_waiting;
        st->n_blocks_free = di_block_pool_n_available(e->kv->pool);
        st->n_blocks_cached = di_block_pool_n_cached_idle(e->kv->pool);
        st->weight_bytes = (int64_t)e->model->cpu.n_weight_bytes; // the forward thread is idle
        st->n_forward_calls = e->model->n_forward_calls;
        st->weight_macs = (int64_t)e->model->cpu.n_weight_macs;
        di_accel_get_stats(&e->model->accel, &st->device);
        st->device.resident = e->dev_on;
        pthread_mutex_unlock(&e->mu);
    }
    run_jobs(e);                           // those queued before the stop
    if (e->dev_on) (void)dev_xfer_idle(e); // the last plan's evictions (the flush writes them next)
    // Final stats after the last cancellations.
    pthread_mutex_lock(&e->mu);
    e->stats.n_blocks_free = di_block_pool_n_available(e->kv->pool);
    e->stats.n_running = e->stats.n_waiting = 0;
    disk_stats(e, &e->stats);
    tail_stats(e, &e->stats);
    pthread_mutex_unlock(&e->mu);
    return NULL;
}

di_status di_engine_probe_workers(di_engine *e) {
    di_ep *ep = e->model->ep;
    if (!ep) return DI_OK;
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    const int64_t now = (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
    pthread_mutex_lock(&e->mu);
    const bool failing = e->stats.n_failed_in_a_row > 0;
    const bool recent = e->probe_ms && now - e->probe_ms < 1000;
    di_status st = e->probe_st;
    if (failing && !recent) e->probe_ms = now; // this caller probes
    pthread_mutex_unlock(&e->mu);
    if (!failing) return DI_OK;
    if (recent) return st;
    st = di_ep_probe(ep, 2000);
    pthread_mutex_lock(&e->mu);
    e->probe_st = st;
    if (st == DI_OK && e->stats.n_failed_in_a_row > 0) {
        DI_LOG_INFO("engine: every expert worker answers again: %lld failed steps in a row end",
                    (long long)e->stats.n_failed_in_a_row);
        e->stats.n_failed_in_a_row = 0;
    }
    pthread_mutex_unlock(&e->mu);
    return st;
}

void di_engine_kv_disk_hold(di_engine *e, bool hold) {
    if (e->kv && e->kv->disk_io) di_kv_disk_io_hold(e->kv->disk_io, hold);
}

void di_engine_kv_disk_hold_reads(di_engine *e, bool hold) {
    if (e->kv && e->kv->disk_io) di_kv_disk_io_hold_reads(e->kv->disk_io, hold);
}

void di_engine_skew_clock(di_engine *e, int64_t ms) {
    atomic_fetch_add(&e->clock_skew_ms, ms);
}

void di_engine_eplb_hold(di_engine *e, bool hold) {
    if (e->eplb) di_eplb_async_hold(e->eplb, hold);
}

int32_t di_engine_ep_stats(di_engine *e, di_ep_worker_stats *out, int32_t cap) {
    return di_model_ep_stats(e->model, out, cap);
}
