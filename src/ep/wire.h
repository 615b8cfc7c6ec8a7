/*
 * wire — the expert-parallel wire protocol between a front and its expert workers
 * (docs/expert-parallel.md, "Wire format"): length-prefixed binary frames in native byte order
 * over one persistent TCP connection per front and worker, and the blocking socket helpers both
 * sides use. Every frame is a 16-byte header (magic, version, type, payload length) and a payload;
 * every length is checked against the limits below before anything is allocated, and every
 * payload is decoded into views of the received bytes (no copy) after its exact size is checked.
 * Thread-safety: the decoders are pure functions; a socket is used by one thread at a time.
 */
#pragma once

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "base/sock.h" // di_sock_*
#include "deepinfer.h"

#define DI_EP_MAGIC 0x50454944u // "DIEP" in little-endian memory order
#define DI_EP_VERSION 1
// Largest payload of any frame (a compute request of T rows x K experts x D floats): 1 GiB.
#define DI_EP_MAX_FRAME ((uint64_t)1 << 30)
// Largest hello / error payload and assignment payload.
#define DI_EP_MAX_TEXT 4096
#define DI_EP_MAX_ASSIGN ((uint64_t)64 << 20)
// Rows of one compute request, all groups together.
#define DI_EP_MAX_ROWS (1 << 22)
// Default I/O timeout of a front waiting on a worker (connect, send, each reply), milliseconds.
#define DI_EP_IO_TIMEOUT_MS 30000

enum {
    DI_EP_HELLO = 1,   // front -> worker: u64 model id, then the model's description (text)
    DI_EP_ASSIGN = 2,  // front -> worker: i32 n_layers, n_expert, count; count x {layer, expert}
    DI_EP_COMPUTE = 3, // front -> worker: i32 layer, D, n_groups, 0; groups {e, n, x[n D], w[n]}
    DI_EP_OK = 16,     // worker -> front: empty (hello, assign accepted)
    DI_EP_ERROR = 17,  // worker -> front: text (why); the request had no effect
    DI_EP_RESULT = 18, // worker -> front: i32 expert, n; y[n D] (one per group, in request order)
};

typedef struct di_ep_hdr {
    uint32_t magic;
    uint16_t version, type;
    uint64_t len; // payload bytes
} di_ep_hdr;
_Static_assert(sizeof(di_ep_hdr) == 16, "the frame header is 16 bytes");

// The payload limit of a frame type (0: a type this version does not know).
uint64_t di_ep_frame_limit(uint16_t type);
// DI_OK when h carries the magic and version and a known type whose length is within its limit;
// DI_ERR_FORMAT otherwise, with the reason in why[why_n].
di_status di_ep_hdr_check(const di_ep_hdr *h, char *why, size_t why_n);

// One group of a compute request: rows of one expert (views into the payload).
typedef struct di_ep_group {
    int32_t expert, n;
    const float *x; // [n, D]
    const float *w; // [n] routing weights
} di_ep_group;

typedef struct di_ep_compute {
    int32_t layer, D, n_groups;
    int64_t n_rows;
    di_ep_group *groups; // caller's array of cap_groups
} di_ep_compute;

// Decodes a compute payload for a model of n_layers MoE layers of n_expert experts and width D:
// every group's expert in range, n >= 1, the rows within DI_EP_MAX_ROWS and the sizes adding up
// to exactly len. The payload must be 4-byte aligned (the float views point into it).
// DI_ERR_FORMAT with the reason in why (nothing else is written), DI_ERR_INVALID when more than
// cap_groups groups.
di_status di_ep_decode_compute(const void *payload, uint64_t len, int32_t n_layers,
                               int32_t n_expert, int32_t D, di_ep_compute *out, int32_t cap_groups,
                               char *why, size_t why_n);

// Decodes an assignment payload: n_layers and n_expert must match; pairs [count] of (layer,
// expert), each in range. DI_ERR_FORMAT with the reason otherwise.
di_status di_ep_decode_assign(const void *payload, uint64_t len, int32_t n_layers, int32_t n_expert,
                              const int32_t **pairs, int32_t *count, char *why, size_t why_n);

// ---- framing over the blocking socket helpers (base/sock.h) ----

// Sends one frame: header, then the payload (may be NULL when len is 0).
di_status di_ep_send_frame(int fd, uint16_t type, const void *payload, uint64_t len);
// Receives and checks a header (di_ep_hdr_check; DI_ERR_FORMAT with the reason).
di_status di_ep_recv_hdr(int fd, di_ep_hdr *h, char *why, size_t why_n);
