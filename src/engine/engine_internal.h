/*
 * engine_internal — test hooks of the engine (engine.c), not part of the public API: tests
 * include this header (tests may include internal headers); tools never do.
 *   - di_engine_create_prepared: di_engine_create with a callback on the loaded model before the
 *     engine sizes its state, e.g. di_dsv4_dev_attach(m, cpu_backend) (V4.1:
 *     di_dsv41_dev_attach) so the engine runs the device-resident forward on the CPU backend (the
 *     oracle twin of the CUDA one) without a GPU.
 *   - di_engine_fail_forward: makes later forwards fail, as a CUDA error would.
 *   - di_engine_lose_device: loses the device of a later forward (the CPU twin's backend, as a
 *     sticky CUDA error would), so that the engine's recovery runs (docs/cuda.md, "Device loss").
 *   - di_engine_get_graph_stats: how many decode steps ran from captured graphs.
 *   - di_engine_dev_state_bytes: the device memory of the engine's dev state.
 *   - di_engine_set_draft_hook: lets a test replace the drafts of speculative decoding (DSpark's
 *     on V4.1, the MTP block's on V4; e.g. with a request's known continuation), so that the
 *     accept path runs on purpose on a random-weight model whose own drafts are almost never
 *     accepted.
 *   - di_engine_set_grammar_limits: the matcher limits of later requests with a grammar.
 *   - di_engine_set_masks_ahead: turns the engine thread's masks ahead (engine.c) on or off
 *     whatever the machine, so a test runs both paths on any number of CPUs.
 *   - di_engine_eplb_hold: holds the online EPLB planner thread before it plans, so a test sees
 *     steps go on while a plan is in flight.
 *   - di_engine_kv_disk_hold: holds the disk tier's IO thread, so a test sees steps go on with
 *     writes queued, lookups served from the queue, and a full queue drop records.
 *   - di_engine_skew_clock: moves the scheduler's clock (priority aging) forward, so a test ages
 *     requests by minutes without waiting.
 * Thread-safety: create before start; di_engine_eplb_hold, di_engine_kv_disk_hold(_reads),
 * di_engine_skew_clock from any thread; di_engine_fail_forward and di_engine_lose_device from any
 * thread;
 * di_engine_set_draft_hook and di_engine_set_masks_ahead while the engine is idle.
 */
#pragma once

#include <stdbool.h>
#include <stdint.h>

#include "deepinfer.h"       // di_engine, di_model, di_status
#include "grammar/grammar.h" // di_grammar_matcher_limits
#include "model/dsv4_dev.h"  // di_dsv4_dev_graph_stats

// Called once on the loaded model (borrowed; owned by the engine) before anything else is
// created; a status other than DI_OK fails the create with it.
typedef di_status (*di_engine_prepare_fn)(di_model *m, void *user);

// di_engine_create (same contract and return codes), calling prepare(model, user) first. Whatever
// prepare attaches must outlive the engine (e.g. a backend given to di_dsv4_dev_attach: destroy it
// after di_engine_destroy).
di_status di_engine_create_prepared(const char *model_dir, const di_engine_options *opt,
                                    di_engine_prepare_fn prepare, void *user, di_engine **out);

// After n_ok more forwards, the next n_fail ones return `st` (e.g. DI_ERR_CUDA) without running
// (either forward), so the engine fails those steps' requests. Replaces an earlier pending
// injection; n_fail 0 cancels it. DI_ENGINE_FAIL_STEPS=N in the environment calls it at create
// with (0, N, DI_ERR_CUDA).
void di_engine_fail_forward(di_engine *e, int32_t n_ok, int32_t n_fail, di_status st);

// Device loss drill on the device-resident forward's CPU twin (engine.c "device loss"): the
// (n_ok + 1)-th forward from now first loses the CPU backend of pipeline stage `stage`
// (di_cpu_backend_lose(b, after_calls): that forward's after_calls-th backend entry on it and
// every later one return DI_ERR_DEVICE_LOST), so that forward fails as on a lost GPU and the
// engine rebuilds its device state. The next n_rebuilds_lost rebuilds lose their new backend of
// that stage too (after_calls entries into their warm-up call): they fail, and the engine gives
// up. n_ok < 0: the stage's backend is lost now (after_calls entries from now, whatever thread
// makes them; call it while the engine is idle). A stage without a CPU backend: logged, nothing
// lost. Recovery needs the twin on backends the
// model owns (di_model_dev_open). Replaces an earlier pending drill. Any thread.
void di_engine_lose_device(di_engine *e, int32_t n_ok, int32_t stage, int64_t after_calls,
                           int32_t n_rebuilds_lost);

// Device-resident forward only: the decode-graph counts of the engine's dev state (zeroes on the
// CPU forward; on V4.1's those of di_dsv41_dev_graph_stats, n_direct_pages 0). Call while the
// engine is idle (after di_engine_wait_idle): the forward thread updates them during steps.
void di_engine_get_graph_stats(const di_engine *e, di_dsv4_dev_graph_stats *out);

// Device-resident forward only: the backend bytes its dev state allocated
// (di_dsv4_dev_state_bytes, di_dsv41_dev_state_bytes; 0 on the CPU forward). Any time after create.
int64_t di_engine_dev_state_bytes(const di_engine *e);

// Speculative decoding (di_engine_options.spec_tokens > 0): called on the forward thread with
// each draft block the DSpark module (V4.1) or the MTP block (V4: one draft, confidence 1) made
// for request `request_id`, whose next token is output token n_gen (draft j proposes output token
// n_gen + j). It may rewrite d->tokens[0, d->n) (ids
// < n_vocab) and d->confidence[0, d->n) (the confidence cut then uses them); it must not call the
// engine. Outputs stay exact whatever it writes: only acceptance and cost change.
typedef void (*di_engine_draft_fn)(void *user, uint64_t request_id, int32_t n_gen, di_draft *d);

// The kv blocks of running request id: up to cap of its block ids (position order) into blocks;
// returns how many it holds (-1: not running); *n_free: the pool's available blocks (free and
// idle cached). Engine thread only: from an event callback of a request.
int32_t di_engine_request_blocks(di_engine *e, uint64_t id, int32_t *blocks, int32_t cap,
                                 int64_t *n_free);

// Installs (fn != NULL) or removes the draft hook. Call while no request is submitted or running.
void di_engine_set_draft_hook(di_engine *e, di_engine_draft_fn fn, void *user);

// The matcher limits of requests submitted afterwards (default di_grammar_matcher_limits_default):
// tests drive a request into a limit. Before submitting (not concurrently with submit).
void di_engine_set_grammar_limits(di_engine *e, const di_grammar_matcher_limits *lim);

// Whether the engine thread computes the masks of a step's constrained rows while its forward
// runs (default: where the forward leaves a CPU idle, unless DI_ENGINE_SYNC=1). Call while no
// request is submitted or running.
void di_engine_set_masks_ahead(di_engine *e, bool on);

// Online EPLB (eplb_interval > 0; nothing otherwise): while held, a plan handed to the planner
// thread waits before planning (the engine keeps stepping; at most one plan stays in flight).
// Release before di_engine_wait_idle, which waits for a plan in flight to be applied.
void di_engine_eplb_hold(di_engine *e, bool hold);

// The disk tier (kv_disk_dir; nothing otherwise): while held, its IO thread writes nothing (evicted
// blocks stay queued, or are dropped once the queue is full). Release before di_engine_wait_idle
// or di_engine_destroy's flush, which wait for the queue.
void di_engine_kv_disk_hold(di_engine *e, bool hold);
// The disk tier's read thread (kv_disk_dir; nothing otherwise): while held, an admission prefetch
// reads nothing, so its request stays waiting while the others step. Independent of the write
// hold. Release before di_engine_wait_idle (a waiting request counts as live); a cancelled
// request's prefetch stops even while held.
void di_engine_kv_disk_hold_reads(di_engine *e, bool hold);

// Adds ms to the scheduler's clock from now on (priority aging: requests enqueued before have
// waited ms longer; enqueued after, not).
void di_engine_skew_clock(di_engine *e, int64_t ms);
