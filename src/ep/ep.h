/*
 * ep — the front side of expert parallelism across processes (docs/expert-parallel.md): a model's
 * connections to its expert workers (ranks 1 .. n; rank 0 is this process), the placement of
 * every MoE layer's routed experts over the ranks, and the calls dsv4_moe.c makes around one MoE
 * layer: gather the rows of remote experts into one request per worker, send them all, compute
 * the local experts, and take each remote expert's output back in ascending expert id (so the
 * combine adds in the same order as one process: logits are bit-identical).
 * Connections are persistent (TCP_NODELAY); one that fails is closed and reopened (handshake and
 * assignment again) at the next call that needs it.
 * Thread-safety: a MoE call (di_ep_begin .. di_ep_end) holds the handle's lock, so one forward
 * uses it at a time; di_ep_set_placement and di_ep_get_stats may be called from any thread.
 */
#pragma once

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "deepinfer.h"
#include "ep/placement.h"

typedef struct di_ep di_ep;

// Replicas of one logical expert a placement may hold (the MoE keeps one chunk per replica on
// its stack).
#define DI_EP_MAX_REPLICAS 64

// Connects model m to its workers ("HOST:PORT" each; rank i + 1 = workers[i]) with placement p
// (NULL: di_ep_placement_contiguous over the model's MoE layers, the front holding the first
// share), handshakes (model identity) and sends each worker its assignment; sets m->ep.
// DI_ERR_INVALID: a malformed address, a placement whose shape does not match the model, a model
// whose matmuls run on a device, or a worker that refused the model or its assignment (logged with
// both sides); DI_ERR_IO: a worker unreachable; DI_ERR_NOMEM.
di_status di_ep_attach(di_model *m, const char *const *workers, int32_t n_workers,
                       const di_ep_placement *p, di_ep **out);
// Closes the connections and clears m->ep. NULL does nothing.
void di_ep_detach(di_ep *ep);
// Replaces the placement (checked: di_ep_placement_check, and its shape must be the current
// one's); the workers receive their new assignments before their next request. Between forwards
// (EPLB); safe from any thread. DI_ERR_INVALID (unchanged), DI_ERR_NOMEM.
di_status di_ep_set_placement(di_ep *ep, const di_ep_placement *p);
// A copy of the placement in force (di_ep_placement_free it). Any thread. DI_ERR_NOMEM.
di_status di_ep_get_placement(di_ep *ep, di_ep_placement *out);
// Reconnects every worker whose connection is closed (handshake and assignment; the connect and
// the replies wait at most timeout_ms) and leaves the connections open for the next call: how a
// front learns that its workers are back without running a forward. Any thread. DI_OK when every
// worker answers; DI_ERR_BUSY when a MoE call holds the workers (it tells by itself); DI_ERR_IO
// otherwise (logged, naming the worker).
di_status di_ep_probe(di_ep *ep, int timeout_ms);
int32_t di_ep_n_workers(const di_ep *ep);
// A snapshot of worker i's counters (0 <= i < n_workers).
void di_ep_get_stats(di_ep *ep, int32_t i, di_ep_worker_stats *out);
// The model's MoE layers: main layers, then loaded MTP blocks (placement layer index = lw->il).
int32_t di_ep_moe_layers(const di_model *m);

// ---- one MoE call (dsv4_moe.c) ----

// A contiguous run of one expert's gathered rows and the rank that computes it.
typedef struct di_ep_chunk {
    int32_t rank, off, n;
} di_ep_chunk;

// Starts the MoE call of placement layer `layer` whose experts number n_expert: *remote tells
// whether any of its experts has a replica on a worker (false: the whole layer is local; call
// di_ep_end all the same). Takes the handle's lock.
void di_ep_begin(di_ep *ep, int32_t layer, int32_t n_expert, bool *remote);
// Whether expert e of the call's layer has a replica on a worker (its rows go out).
bool di_ep_remote(const di_ep *ep, int32_t e);
// Splits the n gathered rows of expert e between its replicas in slot order: contiguous chunks,
// chunk i = [n i / R, n (i + 1) / R) (empty chunks left out). Returns the chunks written (at most
// the expert's replica count, <= the placement's n_slots).
int32_t di_ep_chunks(const di_ep *ep, int32_t e, int32_t n, di_ep_chunk *out);
// Appends rows x [n, D] with routing weights w [n] of expert e to rank's request.
di_status di_ep_add(di_ep *ep, int32_t rank, int32_t e, const float *x, const float *w, int32_t n);
// Sends every worker its request (connecting first where needed); one per worker with rows.
// DI_ERR_IO when a worker is unreachable, refuses the handshake or assignment, or the send fails
// (logged, naming the worker); DI_ERR_NOMEM.
di_status di_ep_send(di_ep *ep);
// Takes the next result from rank: it must be expert e's n rows, written to y [n, D].
di_status di_ep_recv(di_ep *ep, int32_t rank, int32_t e, int32_t n, float *y);
// A buffer of n floats owned by the handle (grown when needed, kept), valid until di_ep_end;
// NULL when out of memory.
float *di_ep_scratch(di_ep *ep, int64_t n);
// Ends the call: after a failure (st != DI_OK), closes every connection with replies still
// unread. Releases the lock.
void di_ep_end(di_ep *ep, di_status st);

// The one-line description of a model both sides log on a mismatch (kind, shape, precision,
// weights fingerprint, identity).
void di_ep_model_describe(const di_model *m, char *buf, size_t n);
