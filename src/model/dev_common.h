/*
 * dev_common — what the device-resident forwards (model/dsv4_dev.h for V4, model/dsv41_dev.h for
 * V4.1) share: the upload of a model's weights and small vectors into a backend (every block
 * tracked and freed together), a layer's MoE weights as di_backend_moe_w, the capture of a decode
 * step into a backend graph, the check of a call's logit rows, and the split of the layers into
 * pipeline stages (di_dev_split_mem: the KV-aware split, and the weight balance without budgets).
 * Internal to src/model.
 *
 * Owns: a di_dev_up owns the backend blocks it allocated (di_dev_up_free); the backend is
 * borrowed. Thread-safety: as the backend (one thread at a time).
 */
#pragma once

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "backend/backend.h" // di_backend, di_backend_moe_w
#include "model/dsv4.h"      // di_model, di_dsv4_layer_w

// The most pipeline stages of either forward (DI_DSV4_DEV_MAX_STAGES, DI_DSV41_DEV_MAX_STAGES).
enum { DI_DEV_SPLIT_MAX_STAGES = 8 };

typedef struct di_dev_up {
    di_backend *b;   // borrowed
    const char *who; // for the log: "dev forward", "dev forward (V4.1)"
    void **blocks;   // owned list of backend blocks (freed by di_dev_up_free)
    int32_t n_blocks, cap_blocks;
} di_dev_up;

// A host array copied into a new backend block (tracked). DI_ERR_NOMEM, the backend's errors.
di_status di_dev_up_bytes(di_dev_up *u, const void *host, size_t bytes, void **out);
di_status di_dev_up_floats(di_dev_up *u, const float *host, int64_t n, float **out);
// A weight uploaded by the backend (weight_upload; owned by the backend): DI_ERR_UNSUPPORTED
// (logged) for a kind it cannot multiply.
di_status di_dev_up_weight(di_dev_up *u, const di_tensor *w, di_tensor *out);
// Host bytes of w's data and scales (0 for an absent tensor): what its upload costs, for the stage
// splits of both forwards.
int64_t di_dev_tensor_bytes(const di_tensor *t);
// A layer's MoE weights (dsv4_moe.c's fields, its experts' tensors uploaded and their array copied
// into backend memory) in the model's recipe, with the model's rules: V4 (hash routing allowed;
// the official recipe without the + 1e-20) or V4.1 (gate_temp, the + 1e-20 in both recipes, A8 in
// blocks of 32). tmp: host scratch of n_expert tensors. DI_ERR_UNSUPPORTED (mixed expert kinds, a
// weight the backend cannot multiply; logged).
di_status di_dev_up_moe(di_dev_up *u, const di_model *m, const di_dsv4_layer_w *lw, di_tensor *tmp,
                        di_backend_moe_w *mw);
// Frees every block of u. NULL blocks: no-op.
void di_dev_up_free(di_dev_up *u);

// Captures what run(ctx) enqueues on b into a backend graph (not launched): *out on success. The
// capture is closed on every path and a graph of a failed run destroyed. run's status, else
// graph_end's.
di_status di_dev_capture(di_backend *b, di_status (*run)(const void *ctx), const void *ctx,
                         void **out);

// A call's logit rows: ascending rows of its n_rows, with somewhere to write their logits (who:
// the call, for the log).
bool di_dev_logit_rows_ok(const char *who, const int32_t *logit_rows, int32_t n_logit_rows,
                          int64_t n_rows, const float *logits);

// ---- a call's logits to the host, greedy rows as their picks ----

// The logits of n head rows (backend dev [n, V], contiguous) to the host. Rows whose greedy[k] is
// set (greedy NULL: none) cross as their argmax only (argmax_rows into pick_dev [n], n ids down
// into pick_host [n]: picks[k] written, sample/sampler.h di_argmax's pick of that row; its row of
// logits left as it was); the other rows' logits go to logits + k * V, one download per run of
// consecutive such rows (all rows: one download, as without greedy rows). *n_ops += the argmax op
// (0 or 1), *n_bytes += the bytes downloaded. Synchronous like download. Backend errors.
di_status di_dev_logits_down(di_backend *b, const float *dev, int32_t n, int64_t V,
                             const uint8_t *greedy, int32_t *pick_dev, int32_t *pick_host,
                             float *logits, int32_t *picks, int64_t *n_ops, int64_t *n_bytes);

// ---- the KV-aware split (docs/cuda.md "Several GPUs: pipeline stages", "The split") ----
//
// Every stage must hold every entry block's rows of its layers (a block's bytes differ per stage
// with its layers' ratio classes, and V4.1's mirrors), so the stage with the least memory left
// after its weights and fixed state bounds the blocks of the whole engine: the weight-optimal
// split can waste KV capacity. di_dev_split_mem chooses the cuts that maximise the blocks every
// stage holds (max-min over the stages of floor((budget - weights - fixed) / block bytes)) and,
// among those, the smallest largest stage in weight bytes (ties to earlier cuts): two DPs over the
// cuts, the first for the best block count B, the second minimising the largest stage over the
// splits whose every stage holds B blocks (a single DP on the pair would be wrong: a prefix with
// more blocks but heavier stages can hide one the bound B makes as good). A stage's costs are a
// function of its range only (di_dev_stage_cost_fn), tabulated once: O(L^2) cost evaluations
// (each O(L) for the forwards' functions) and O(n_stages L^2) steps per DP; L <= 61 layers and
// n_stages <= 8 take well under a millisecond.

// What holding layers [l0, l1) of L costs a stage (the embedding when l0 == 0, the head, the
// MTP / DSpark blocks when l1 == L): weight_bytes of weights; block_bytes of every entry block
// (0: its layers keep no entries); fixed_bytes of the state's fixed part (the slots' tails, the
// call rows and scratch: di_dev_plan's sizes).
typedef struct di_dev_stage_cost {
    int64_t weight_bytes, block_bytes, fixed_bytes;
} di_dev_stage_cost;
typedef void (*di_dev_stage_cost_fn)(const void *ctx, int32_t l0, int32_t l1, int32_t L,
                                     di_dev_stage_cost *out);

// The device state a split is balanced for: the serving engine's (di_model_options dev_*).
// n_slots slots of n_ctx positions, calls of max_rows rows, spec: with speculation's per-slot
// rings (V4's MTP window ring, V4.1's DSpark rings); reserve_bytes left free on every stage (the
// backend's own scratch, graphs, the MoE's buffers: what the fixed part does not count).
// block_tokens: the entry blocks' positions.
typedef struct di_dev_plan {
    int32_t n_slots, n_ctx, max_rows, block_tokens;
    bool spec;
    int64_t reserve_bytes;
} di_dev_plan;

// A plan's zeros (di_model_options dev_*): the serving engine's defaults (engine.c create).
enum {
    DI_DEV_PLAN_SLOTS_DEFAULT = 16,
    DI_DEV_PLAN_CTX_DEFAULT = 8192,
    DI_DEV_PLAN_ROWS_DEFAULT = 256
};

// m's plan (m->opt's dev_* fields, their zeros the defaults above, n_ctx capped by the model) for
// entry blocks of block_tokens positions.
di_dev_plan di_dev_plan_of(const di_model *m, int32_t block_tokens);

// The outcome: stage k holds [layer0[k], layer0[k + 1]) at cost[k], holding blocks[k] entry
// blocks (INT64_MAX: its layers keep none; -1: not even its weights and fixed state fit; with
// no budgets: -1 everywhere); n_blocks the least of blocks[] (INT64_MAX: no stage keeps entries;
// no budgets: -1), the blocks every stage holds; budget_bytes[k] what it used (free less the
// reserve; no budgets: 0); by_memory whether the memory chose it (false: the weight balance).
typedef struct di_dev_split_out {
    int32_t n_stages;
    int32_t layer0[DI_DEV_SPLIT_MAX_STAGES + 1];
    di_dev_stage_cost cost[DI_DEV_SPLIT_MAX_STAGES];
    int64_t blocks[DI_DEV_SPLIT_MAX_STAGES], budget_bytes[DI_DEV_SPLIT_MAX_STAGES];
    int64_t n_blocks;
    bool by_memory;
} di_dev_split_out;

// The KV-aware split of L layers into n_stages (1 .. min(L, DI_DEV_SPLIT_MAX_STAGES)) stages of
// at least one layer: budget_bytes[k] stage k's memory for weights, fixed state and blocks
// (NULL: unknown, then the weight balance alone); cost(ctx, ...) the stages'
// costs. min_blocks: the blocks the engine needs at least (one max-context sequence's): a best
// split whose bottleneck stage holds fewer is refused with DI_ERR_NOMEM, logged by `who` with the
// stage, its budget, weights, fixed state and the bytes the blocks need. DI_ERR_INVALID (not
// logged: bad counts), DI_ERR_NOMEM. Host only.
di_status di_dev_split_mem(const char *who, int32_t L, int32_t n_stages, di_dev_stage_cost_fn cost,
                           const void *ctx, const int64_t *budget_bytes, int64_t min_blocks,
                           di_dev_split_out *out);
// The budgets of backends b[0, n) for di_dev_split_mem: each one's free memory (mem_info) less
// reserve_bytes (at least 0). false (budget not written) when some backend cannot say; b may list
// one backend more than once, whose free memory its stages then share evenly.
bool di_dev_stage_budgets(di_backend *const *b, int32_t n, int64_t reserve_bytes, int64_t *budget);
// Logs the split (INFO, one line per stage: layers, weights, fixed state, bytes per block,
// budget, blocks; with no budgets, the weights only and that the memory is unknown).
void di_dev_split_log(const char *who, const di_dev_split_out *sp, const di_dev_plan *plan);
