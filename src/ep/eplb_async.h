/*
 * eplb_async — the online EPLB planner on its own thread (docs/expert-parallel.md, "Online
 * rebalancing"): the engine thread hands over a copy of the load window and the placement in
 * force, keeps stepping, and takes the finished plan between steps to apply it (di_ep_set_placement
 * stays the engine's: no forward may be in flight).
 *
 * One plan at most is in flight: submit is refused while one is queued, planning, or done and not
 * yet taken. The planner calls di_eplb_rebalance (ep/eplb.h) on its own copies, so the engine
 * thread never waits for it (2-80 ms per plan at V4-Flash shape); the only shared state is the
 * hand-over, under one mutex held for a few stores.
 *
 * Owns: the planner thread, the window table (shaped at create), the hand-over placements.
 * Does not: read the live counters or apply anything (the caller does both).
 * Thread-safety: one caller thread (the engine thread) calls everything but the callback, which
 * runs on the planner thread; di_eplb_async_hold from any thread.
 */
#pragma once

#include <stdbool.h>
#include <stdint.h>

#include "deepinfer.h" // di_status
#include "ep/eplb.h"   // di_ep_load_table, di_eplb_options, di_eplb_report

typedef struct di_eplb_async di_eplb_async;

// Called on the planner thread when a plan is done (e.g. to wake the engine thread); must not call
// back into the planner.
typedef void (*di_eplb_async_done_fn)(void *user);

// Starts the planner thread with a window of n_layers x n_expert. done (may be NULL) is called
// after each plan. DI_ERR_INVALID (bad shape), DI_ERR_NOMEM (also: the thread cannot start).
di_status di_eplb_async_create(int32_t n_layers, int32_t n_expert, di_eplb_async_done_fn done,
                               void *user, di_eplb_async **out);
// Lets a plan in flight finish (it is discarded), joins the thread, frees everything. NULL does
// nothing. A hold is released first.
void di_eplb_async_destroy(di_eplb_async *a);

// Whether no plan is in flight (submit would be taken).
bool di_eplb_async_idle(di_eplb_async *a);
// The window to fill before submit (di_ep_load_window into it): only while idle; NULL otherwise.
di_ep_load_table *di_eplb_async_window(di_eplb_async *a);
// Hands the filled window, cur (moved in: the caller's struct is zeroed) and opt to the planner.
// DI_ERR_BUSY (a plan is in flight; cur is left to the caller).
di_status di_eplb_async_submit(di_eplb_async *a, di_ep_placement *cur, const di_eplb_options *opt);

typedef struct di_eplb_async_result {
    di_status st;         // di_eplb_rebalance's
    di_ep_placement cur;  // the placement planned against (moved out: di_ep_placement_free)
    di_ep_placement next; // the plan (moved out: di_ep_placement_free; empty unless st == DI_OK)
    di_eplb_report rep;
    int64_t pairs;   // routed pairs of the window
    int64_t plan_us; // time the planner thread spent on it
} di_eplb_async_result;

// Takes the finished plan, if one is done: true and *out (the planner is idle again); false if
// none is done (nothing written).
bool di_eplb_async_take(di_eplb_async *a, di_eplb_async_result *out);
// Blocks until the plan in flight (if any) is done and its `done` call has returned; returns at
// once when idle or done.
void di_eplb_async_wait(di_eplb_async *a);

// Test hook: while held, a submitted plan waits before planning (steps go on meanwhile).
void di_eplb_async_hold(di_eplb_async *a, bool hold);
