/*
 * placement — where each MoE layer's routed experts live across the ranks of an expert-parallel
 * group. Rank 0 is the front (the process that runs the engine, attention, the router and the
 * shared expert); ranks 1 .. n_ranks-1 are expert workers. A logical expert has one or more
 * physical replicas (EPLB's redundant experts); a replica lives on exactly one rank.
 *
 * Layers are the model's MoE layers in checkpoint order: the n_layer main layers, then the MTP
 * blocks (index n_layer + i). A placement is plain data: it is built by
 * di_ep_placement_contiguous or by EPLB (ep/eplb.h), checked, copied and compared.
 * Thread-safety: none; a placement is immutable once published.
 */
#pragma once

#include <stdbool.h>
#include <stdint.h>

#include "deepinfer.h"

typedef struct di_ep_placement {
    int32_t n_layers; // MoE layers (main layers, then MTP blocks)
    int32_t n_expert; // logical routed experts per layer
    int32_t n_ranks;  // ranks of the group, the front included (>= 1)
    int32_t n_slots;  // physical replicas per layer (>= n_expert)
    int32_t *expert;  // [n_layers * n_slots] logical expert of each replica
    int32_t *rank;    // [n_layers * n_slots] rank holding each replica
} di_ep_placement;

// One replica per expert, experts spread over the ranks in contiguous runs: expert e of every
// layer on rank e * n_ranks / n_expert. Returns DI_ERR_INVALID (a count < 1), DI_ERR_NOMEM.
di_status di_ep_placement_contiguous(int32_t n_layers, int32_t n_expert, int32_t n_ranks,
                                     di_ep_placement *out);
// Allocates the arrays of a placement of the given shape (contents zero).
di_status di_ep_placement_alloc(int32_t n_layers, int32_t n_expert, int32_t n_ranks,
                                int32_t n_slots, di_ep_placement *out);
// DI_OK when every count is positive, every replica names an expert in [0, n_expert) and a rank
// in [0, n_ranks), and every logical expert of every layer has at least one replica;
// DI_ERR_INVALID otherwise, with the reason in `why` (may be NULL, `why_n` bytes).
di_status di_ep_placement_check(const di_ep_placement *p, char *why, size_t why_n);
di_status di_ep_placement_copy(const di_ep_placement *src, di_ep_placement *dst);
bool di_ep_placement_equal(const di_ep_placement *a, const di_ep_placement *b);
// Replicas of logical expert `e` of `layer` held by `rank` (0 when it holds none).
int32_t di_ep_placement_count(const di_ep_placement *p, int32_t layer, int32_t e, int32_t rank);
void di_ep_placement_free(di_ep_placement *p);
