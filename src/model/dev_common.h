/*
 * dev_common — what the device-resident forwards (model/dsv4_dev.h for V4, model/dsv41_dev.h for
 * V4.1) share: the upload of a model's weights and small vectors into a backend (every block
 * tracked and freed together), a layer's MoE weights as di_backend_moe_w, the capture of a decode
 * step into a backend graph, the check of a call's logit rows, and the split of the layers into
 * pipeline stages (di_dev_split). Internal to src/model.
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

// The split of L layers into n_stages contiguous ranges (pipeline stages) whose largest is
// smallest: pre[l] (L + 1 entries) the bytes of the first stage up to layer l (pre[0]: what the
// first stage holds besides its layers), head what the last one holds besides its layers. Of the
// splits with at least one layer per stage, the one whose largest stage is smallest (ties to
// earlier cuts): stage k holds [layer0[k], layer0[k + 1]) (n_stages + 1 entries), stage_bytes[k]
// its bytes (NULL: not wanted). DI_ERR_INVALID (not logged: n_stages < 1 or > L), DI_ERR_NOMEM.
// Host only.
di_status di_dev_split(const int64_t *pre, int64_t head, int32_t L, int32_t n_stages,
                       int32_t *layer0, int64_t *stage_bytes);

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
