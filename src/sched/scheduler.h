/*
 * scheduler — decides each step's ragged batch. Policy, in order:
 *   1. running requests in decode (one known token left to feed) get one row each, first;
 *   2. running requests still in prefill (or in a bounded replay) get chunks of what is left of
 *      the token budget, oldest first;
 *   3. waiting requests are admitted while a KV slot, budget and blocks for their first chunk are
 *      free, best first: the lowest effective priority, then the tenant with the smallest virtual
 *      token counter (fair share), then arrival (first come first served when nobody sets
 *      either); admission attaches the longest cached prefix and continues it from a tail
 *      snapshot (restored through the `restore` hook) or with a bounded replay before it
 *      (docs/kv-cache.md). A request whose prompt continues on the disk tier waits, skipped,
 *      while its prefetch reads the blocks on the disk tier's read thread (kv_manager.h,
 *      di_kv_prefetch); the others are admitted meanwhile in the same order.
 * Aging (starvation freedom): a request's effective priority is its priority minus one per
 * aging_ms it has waited since it was first enqueued (now_ms, set by the caller: the engine's
 * monotonic clock, a test's own); aging_ms 0 disables it. A request runs with the effective
 * priority it was admitted with (run_priority). A preempted request keeps its enqueue time.
 * Fair share (Virtual Token Counter, Sheng et al., OSDI 2024): every tenant has a counter of the
 * service it received, prompt positions computed (not cache hits) weight 1, generated tokens
 * weight DI_SCHED_VTC_W_OUT; a prompt is charged at admission (so one plan admitting several
 * requests sees each admission), generated tokens as their positions are computed (the ones never
 * fed back, the last one at least, when the request leaves). A tenant
 * that becomes backlogged (a running or waiting request) after being idle is lifted to the
 * smallest counter among the backlogged tenants (the last idle one's when none is), so idle time
 * banks no credit. The tenant table has max_tenants entries (sized at init): idle tenants are
 * remembered until their entry is needed (least recently idle first); when every entry is
 * backlogged, further tenants share one overflow entry. Nothing is allocated after init.
 * Running requests are kept in (run_priority, arrival) order: steps 1 and 2 serve them in that
 * order and preemption takes the last. Before planning, a waiting request that cannot be
 * admitted for want of a slot or blocks preempts running requests whose priority aged to now is
 * worse than its effective priority, last first, until it can (not while planning ahead: that
 * plan is abandoned and made again synchronously). Running requests age on for that comparison
 * (their run_priority only orders them): with frozen run priorities, in an overloaded queue of
 * equal priorities every request that waited an aging interval longer than the running ones did
 * would preempt them, a cascade of recomputation every interval.
 * With tail snapshots (the KV manager's `tails`), a prompt's prefill chunks end at its snapshot
 * points — the requested ones (di_request.snap_at, rounded down to block boundaries) and the
 * prompt's last block boundary H <= n_prompt - 1 (H > 0) — so that the engine can snapshot the
 * tail there after that call (at most DI_SCHED_MAX_SNAP extra chunk splits per request; a split
 * never changes results).
 * When a running request needs a block and none is left, the last running request (the newest
 * of the worst run priority) is preempted (its blocks are returned; it goes back to the waiting
 * queue and later recomputes its prompt and generated tokens, usually from the prefix cache), so
 * the oldest requests of the best priority always progress: no starvation among equals. Plans
 * are built in arrays sized at init.
 *
 * Owns: the running array, the waiting queue links, the tenant table and the plan arrays; requests
 * are borrowed (the engine creates and destroys them). Thread-safety: engine thread only.
 *
 * Asynchronous scheduling: the engine plans step N+1 (di_sched_step_ahead) while step N's forward
 * runs on a copy of step N's plan. di_sched_advance has already moved every request of step N
 * past its rows, and a request that samples at step N counts one pending token (n_pending) whose
 * row gets a placeholder id. Planning ahead touches nothing the running forward reads: it takes
 * free blocks and slots (di_kv_seq_reserve, open), never preempts (a plan that would need to is
 * abandoned: `aborted`, and the engine plans again with di_sched_step once step N is done), and
 * skips decodes that finish by length at step N. After step N is sampled, requests that finished
 * or were cancelled leave the plan (di_sched_remove drops their rows) and di_sched_finalize fills
 * in the sampled ids and commits the new block capacity.
 */
#pragma once

#include <stdint.h>

#include "kv/kv_manager.h" // di_kv_manager
#include "model/dsv4.h"    // di_dsv4_seq
#include "sched/request.h" // di_request

// Weight of a generated token in the virtual token counter (a prompt position weighs 1): a
// decode row costs a step's weight reads for one token where a prefill chunk shares them, and
// the VTC paper weighs output tokens 2 in its evaluation.
#define DI_SCHED_VTC_W_OUT 2

// One tenant's fair-share entry (di_sched.tenants).
typedef struct di_sched_tenant {
    uint64_t key;                 // di_request.tenant
    int64_t vtc;                  // virtual token counter: weighted tokens served
    int32_t n_live;               // its running and waiting requests; 0: idle (remembered)
    int32_t idle_prev, idle_next; // the idle list (least recently idle first), -1 ends
} di_sched_tenant;

// Restores the tail snapshot snap (taken at position pos of the same prefix) into r's slot, whose
// prefix is attached; false: it could not (the bounded replay is used instead).
typedef bool (*di_sched_restore_fn)(void *user, di_request *r, int32_t pos, const uint8_t *snap);

typedef struct di_sched {
    di_kv_manager *kv; // borrowed
    int32_t max_seqs, max_batch_tokens;
    di_request **running; // owned [max_seqs], (run_priority, arrival) order
    int32_t n_running;
    di_request *wait_head, *wait_tail;
    int32_t n_waiting;
    int32_t *free_slots; // owned [max_seqs]
    int32_t n_free_slots;
    // The plan of the current step.
    di_dsv4_seq *seqs;    // owned [max_seqs]
    di_request **seq_req; // owned [max_seqs]
    int32_t n_seq, n_rows;
    int32_t *tokens;        // owned [max_batch_tokens]
    int32_t *logit_rows;    // owned [max_seqs]: rows whose logits sample a token
    di_request **logit_req; // owned [max_seqs]
    int32_t n_logit;
    bool ahead;   // planning while a forward runs: no preemption
    bool aborted; // the plan ahead needed a preemption (or planned nothing)
    int64_t n_preemptions, n_prefill_rows, n_decode_rows, n_cache_hit_tokens, n_replayed_tokens;
    int64_t n_tail_restores;        // admissions continued from a tail snapshot
    int64_t n_priority_preemptions; // running requests preempted for a better-priority one
    // Disk prefetch (kv_manager.h, di_kv_prefetch): waiting requests the last plan skipped while
    // their prompt's blocks were read (or waited to be); requests admitted after such a wait, and
    // their waits' total.
    int32_t n_disk_skipped;
    int64_t n_disk_waits, disk_wait_us;
    // Clock and aging: now_ms is set by the caller before each enqueue and plan (milliseconds of
    // a monotonic clock); aging_ms: one priority level per aging_ms waited, 0: no aging.
    int64_t now_ms, aging_ms;
    // Fair share: tenants[max_tenants] entries (n_tenants used so far, live or idle) plus the
    // overflow entry tenants[max_tenants]; tenant_hash[tenant_hash_cap] maps keys to entries
    // (open addressing, -1 empty; a power of two >= 2 * max_tenants). Owned.
    di_sched_tenant *tenants;
    int32_t max_tenants, n_tenants, n_tenants_live;
    int32_t *tenant_hash;
    int32_t tenant_hash_cap;
    int32_t idle_head, idle_tail; // the idle list
    int64_t vtc_last_idle;        // counter of the last tenant that became idle
    int64_t n_tenant_overflows;   // requests whose tenant found no entry (shared the overflow)
    di_sched_restore_fn restore;  // set by the engine when the KV manager has tail snapshots
    void *restore_user;
} di_sched;

// max_tenants: entries of the tenant table (the engine: max_seqs + max_queue, its bound on
// backlogged requests, at most 65536). DI_ERR_INVALID (max_batch_tokens < max_seqs, max_tenants
// outside 1 .. 2^28), DI_ERR_NOMEM.
di_status di_sched_init(di_sched *s, di_kv_manager *kv, int32_t max_seqs, int32_t max_batch_tokens,
                        int32_t max_tenants);
void di_sched_deinit(di_sched *s);
// Appends a new request to the waiting queue (enqueued at now_ms); its tenant becomes
// backlogged (lifted if it was idle).
void di_sched_enqueue(di_sched *s, di_request *r);
// r's effective priority at now_ms: its priority less one per aging_ms since it was enqueued.
int32_t di_sched_effective_priority(const di_sched *s, const di_request *r);
// The virtual token counter of tenant key (-1 when the table does not hold it).
int64_t di_sched_tenant_vtc(const di_sched *s, uint64_t key);
// Takes a request out (finished, cancelled or failed): returns its blocks and drops its rows
// from the current plan.
void di_sched_remove(di_sched *s, di_request *r);
// Preempts running request r now (its rows leave the plan, which is marked `aborted`: the engine
// plans again): after a failed step, a request that attached blocks that step was to compute.
void di_sched_preempt(di_sched *s, di_request *r);
// Maximum number of snapshot points of a request: its requested points and its last boundary.
#define DI_SCHED_MAX_SNAP (DI_MAX_SNAP_AT + 1)
// The positions where r's tail is snapshot, ascending and distinct, into out[DI_SCHED_MAX_SNAP]:
// its requested points (di_request.snap_at) rounded down to block boundaries, then its prompt's
// last block boundary H <= n_prompt - 1; each > 0, the requested ones < H. A point below the hit
// that a bounded replay rebuilds (di_request.replay_end) is left out (the state there is not
// exact). Returns the count: 0 without tail snapshots.
int32_t di_sched_snap_points(const di_sched *s, const di_request *r, int32_t *out);
// Whether a forward call of r ending at position pos ends at one of its snapshot points.
bool di_sched_is_snap_point(const di_sched *s, const di_request *r, int32_t pos);
// Builds the plan (seqs, tokens, logit rows). n_seq == 0 when nothing can run.
void di_sched_step(di_sched *s);
// Builds the plan of the next step while the current step's forward runs (see above). Sets
// `aborted` when the plan must be rebuilt by di_sched_step after the current step.
void di_sched_step_ahead(di_sched *s);
// Before running the plan (no forward in flight, every pending token sampled): copies each
// row's token id and commits each planned sequence's block capacity.
void di_sched_finalize(di_sched *s);
// Advances every planned request past its rows (called when the forward of the plan is
// launched: the forward computes them) and publishes its full blocks; a request whose logits
// are sampled gets n_pending = 1.
void di_sched_advance(di_sched *s);
