/*
 * eplb — expert-parallel load balancing (docs/expert-parallel.md, "EPLB"): the routing load of
 * every (MoE layer, logical expert), a planner that gives hot experts redundant replicas and packs
 * the replicas onto ranks so that every rank gets about the same number of tokens, the online
 * rebalancing decision, and the JSON files of placements and loads.
 *
 * Layers are the model's MoE layers as in ep/placement.h: the n_layer main layers, then the MTP
 * blocks. A replica's load is its expert's load divided by the expert's replica count (the
 * dispatcher splits an expert's tokens evenly over its replicas); a rank's load is the sum over
 * its replicas; a layer's balance is max / mean rank load (1.0 = perfect), and a plan's balance
 * is sum over layers of the max rank load / sum of the mean rank load (a step waits for the
 * slowest rank of every layer).
 *
 * Thread-safety: di_ep_load is written by one forward thread (di_ep_load_record, relaxed atomic
 * loads and stores, no lock, no allocation) and read by any thread at any time
 * (di_ep_load_totals, di_ep_load_window: the window's baseline is under a mutex that the writer
 * never takes). A second concurrent writer may lose counts, never corrupt memory. Everything else
 * works on plain data and is reentrant.
 */
#pragma once

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "deepinfer.h"
#include "ep/placement.h"

// ---- load statistics ----

// A matrix of loads: count[l * n_expert + e] routed (token, slot) pairs of expert e in MoE layer
// l, and rows[l] the token rows the layer's MoE processed (count of a layer sums to rows x K).
typedef struct di_ep_load_table {
    int32_t n_layers, n_expert;
    int64_t *count; // [n_layers * n_expert]
    int64_t *rows;  // [n_layers]
} di_ep_load_table;

// Allocates a zero table. DI_ERR_INVALID (a count < 1), DI_ERR_NOMEM.
di_status di_ep_load_table_alloc(int32_t n_layers, int32_t n_expert, di_ep_load_table *out);
void di_ep_load_table_free(di_ep_load_table *t);
// Routed pairs of the whole table.
int64_t di_ep_load_table_pairs(const di_ep_load_table *t);
// Mean over the layers with any load of max / mean expert load (1.0 = every expert equally
// loaded); 0 when the table is empty.
double di_ep_load_table_imbalance(const di_ep_load_table *t);

// The live counters of one model: cumulative totals since create, and a window (the counts since
// the last di_ep_load_window) that a planner consumes.
typedef struct di_ep_load di_ep_load;

di_status di_ep_load_create(int32_t n_layers, int32_t n_expert, di_ep_load **out);
void di_ep_load_destroy(di_ep_load *l); // NULL does nothing
int32_t di_ep_load_n_layers(const di_ep_load *l);
int32_t di_ep_load_n_expert(const di_ep_load *l);
// The forward thread, right after routing: sel[n_rows * k] the expert ids of the rows of `layer`.
// Ids outside [0, n_expert) and layers outside [0, n_layers) are ignored. Never allocates.
void di_ep_load_record(di_ep_load *l, int32_t layer, const int32_t *sel, int32_t n_rows, int32_t k);
// Routed pairs since create and di_ep_load_table_imbalance of the totals, without allocating.
void di_ep_load_summary(di_ep_load *l, int64_t *pairs, double *imbalance);
// Copies the totals since create into out (allocated by the caller with the load's shape).
// DI_ERR_INVALID when the shapes differ.
di_status di_ep_load_totals(di_ep_load *l, di_ep_load_table *out);
// Copies the counts since the previous call (or create) into out and starts a new window.
// DI_ERR_INVALID when the shapes differ.
di_status di_ep_load_window(di_ep_load *l, di_ep_load_table *out);

// ---- the planner ----

typedef struct di_eplb_options {
    int32_t n_ranks;        // ranks of the expert-parallel group (rank 0: the front)
    int32_t slots_per_rank; // replicas each rank holds; n_ranks * slots_per_rank >= n_expert
    // Stability: a plan that keeps the current placement's replicas where they are is taken when
    // its balance is within this fraction of the fresh plan's (0.05: 5% more max rank load).
    double keep_tolerance;
    // di_eplb_rebalance: a new placement is worth its weight copies only when it lowers the
    // plan's balance (max/mean rank load) by more than this (0.05: from 1.30 to below 1.25).
    double min_gain;
    // Rank 0 (the front) computes the shared experts of every row while the workers compute
    // their routed replicas (model/dsv4_moe.c), so its load in layer l starts at
    // front_load_per_row x rows[l] pairs (the model's shared expert count: 1 on V4 and V4.1).
    // 0: rank 0 is packed like the others.
    double front_load_per_row;
} di_eplb_options;

// n_ranks 1, slots_per_rank 0 (to be set), keep_tolerance 0.05, min_gain 0.05,
// front_load_per_row 0.
di_eplb_options di_eplb_options_default(void);

typedef struct di_eplb_report {
    double balance_before;     // the current placement under the load (0 without one)
    double balance_after;      // the new placement under the load
    double balance_contiguous; // di_ep_placement_contiguous under the load
    int64_t n_moves;           // replicas the new placement puts on a rank that did not hold
                               // them (weight copies; every replica without a current placement)
    int32_t n_layers_changed;  // layers whose replicas changed rank
    bool apply;                // di_eplb_rebalance: the new placement is worth applying
} di_eplb_report;

// Max / mean rank load of `layer` of placement p under the loads of that layer (load[n_expert]),
// rank 0 carrying `front` more (pairs: front_load_per_row x the layer's rows); 1.0 when the layer
// has no load. Plan balance: di_eplb_balance.
double di_eplb_layer_balance(const di_ep_placement *p, int32_t layer, const double *load,
                             double front);
// Sum over layers of the max rank load / sum of the mean rank load, rank 0 carrying
// front_load_per_row x rows[l] more in layer l; 1.0 when there is no load. DI_ERR_INVALID (shapes
// differ) leaves *out 0.
di_status di_eplb_balance(const di_ep_placement *p, const di_ep_load_table *t,
                          double front_load_per_row, double *out);
// Replicas of `next` on a rank that did not hold a replica of that expert in `cur` (same
// n_layers and n_expert, any n_ranks and n_slots; -1 when those differ).
int64_t di_eplb_moves(const di_ep_placement *cur, const di_ep_placement *next);

// Plans every layer: replica counts (one per expert, then one more at a time to the expert with
// the largest load per replica), then packing (replicas in descending load per replica, each
// onto the least-loaded rank with a free slot that does not hold that expert yet, when one
// exists; rank 0 starting at its front load). Deterministic: ties go to the lower expert id, then
// the lower rank. With `cur` (may
// be NULL) of the same n_layers, n_expert, n_ranks and n_slots and slots_per_rank replicas on
// every rank, a layer stays as it is when its max rank load is within keep_tolerance of the fresh
// plan's; else it takes, of the plans within that tolerance that keep cur's replicas in their
// slots where they can (docs/expert-parallel.md, "Stability"), the one that moves the fewest;
// else the fresh plan, its ranks renumbered to overlap cur the most (rank 0 staying rank 0 when it
// has a front load). `report` (may be NULL) gets
// the balances and moves (apply = false).
// DI_ERR_INVALID (bad options or shapes, a placement that fails di_ep_placement_check),
// DI_ERR_NOMEM. `out` is allocated; di_ep_placement_free it.
di_status di_eplb_plan(const di_ep_load_table *t, const di_eplb_options *opt,
                       const di_ep_placement *cur, di_ep_placement *out, di_eplb_report *report);
// The online decision: plans against `cur` (required; opt->n_ranks and slots_per_rank describe
// the group) and sets report->apply when the new placement lowers the balance of `window` by more
// than opt->min_gain and moves at least one replica. `next` is always allocated (a copy of the
// plan); apply it (di_ep_set_placement) only when report->apply. An empty window never applies.
di_status di_eplb_rebalance(const di_ep_load_table *window, const di_ep_placement *cur,
                            const di_eplb_options *opt, di_ep_placement *next,
                            di_eplb_report *report);

// ---- files (JSON; docs/expert-parallel.md, "EPLB") ----

// {"format":"deepinfer-ep-placement","version":1,"n_layers":L,"n_expert":E,"n_ranks":R,
//  "n_slots":N,"layers":[{"expert":[N ints],"rank":[N ints]}, ... L of them]}
// Parses and validates (every field, di_ep_placement_check); DI_ERR_FORMAT with the reason in
// `why` (may be NULL) for anything else, DI_ERR_NOMEM.
di_status di_eplb_placement_parse(const char *text, size_t n, di_ep_placement *out, char *why,
                                  size_t why_n);
// DI_ERR_IO (cannot read), else as di_eplb_placement_parse.
di_status di_eplb_placement_read(const char *path, di_ep_placement *out, char *why, size_t why_n);
// A new JSON text (di_free). DI_ERR_INVALID (the placement fails its check), DI_ERR_NOMEM.
di_status di_eplb_placement_dump(const di_ep_placement *p, char **text);
di_status di_eplb_placement_write(const di_ep_placement *p, const char *path); // + DI_ERR_IO

// {"format":"deepinfer-expert-load","version":1,"n_layers":L,"n_expert":E,"rows":[L ints],
//  "load":[[E ints], ... L of them]} (non-negative integers; rows as di_ep_load_table).
di_status di_eplb_load_parse(const char *text, size_t n, di_ep_load_table *out, char *why,
                             size_t why_n);
di_status di_eplb_load_read(const char *path, di_ep_load_table *out, char *why, size_t why_n);
di_status di_eplb_load_dump(const di_ep_load_table *t, char **text);
