/*
 * cp — context parallelism across processes (docs/context-parallel.md): a long prefill call of a
 * V4 or V4.1 session is split into R pieces over R ranks, the prefill workers (ranks 0 .. R - 2,
 * `deepinfer cp-worker`) and this process, the front, which computes the last piece and keeps the
 * request. The pieces run as a wavefront: rank r needs layer l's state after pieces 0 .. r - 1,
 * which rank r - 1 has right after its own layer-l attention (the only cross-token dependency of
 * the forward), so every rank sends each layer's state on as soon as its attention is done and
 * installs its predecessor's just before its own (model/dsv4.h, di_dsv4_cp_hook; V4.1: a kv
 * source's entries, index keys and (C, Z) slots travel with the source layer's message, the DSpark
 * rings around the DSpark context rows, the Engram history ids in the job). The state a rank
 * installs is exactly what a chunked prefill would hold there, so logits and the final state are
 * bit-identical to one process. The front relays the messages between workers (one persistent
 * TCP connection per worker; a relay thread when R >= 3) and receives the last worker's itself.
 * A failure (worker down, timeout, error reply) fails the call with DI_ERR_IO and puts the session
 * back where it was (rings, compressor rings or (C, Z) slots, entry counts, MTP input, position,
 * DSpark position), so the call can be retried, with or without the workers.
 * Owns: the connections. Thread-safety: one forward at a time per model (a lock); stats from any
 * thread.
 */
#pragma once

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "cp/wire.h"
#include "deepinfer.h"
#include "model/dsv4.h"  // di_dsv4_layer_state
#include "model/dsv41.h" // di_dsv41_state

typedef struct di_cp di_cp;

// The prefill length from which a session's call runs over the workers when the model's options
// leave cp_min_tokens at 0.
#define DI_CP_MIN_TOKENS_DEFAULT 1024
// The shortest piece: fewer ranks are used when a call is shorter than this many tokens a rank
// (the front's piece also holds the MTP block's rollback rows, DI_DSV4_ROLLBACK_MAX + 1).
#define DI_CP_MIN_PIECE 16

// Connects model m to its prefill workers ("HOST:PORT" each; rank i = workers[i]) and handshakes
// (model identity); sets m->cp. DI_ERR_UNSUPPORTED: a model whose forward runs on a device
// (refused, logged); DI_ERR_INVALID: a malformed address or a worker running another model
// (logged with both sides); DI_ERR_IO: a worker unreachable; DI_ERR_NOMEM.
di_status di_cp_attach(di_model *m, const char *const *workers, int32_t n_workers,
                       int32_t min_tokens, di_cp **out);
// Closes the connections and clears m->cp. NULL does nothing.
void di_cp_detach(di_cp *cp);
int32_t di_cp_min_tokens(const di_cp *cp);
// Changes the threshold (tests, benchmarks): calls of at least n tokens (n >= 1) use the workers.
void di_cp_set_min_tokens(di_cp *cp, int32_t n);
void di_cp_get_stats(di_cp *cp, di_cp_stats *out);

// di_session_forward of a V4 or V4.1 session (validated input, CPU forward) over the workers: out
// as di_session_forward's (a V4.1 session: no MTP logits; a DSpark session's rings follow its
// context rows, so drafts after the call are as one process's). Runs locally when the call is too
// short for two pieces. DI_ERR_IO (a worker failed; the session is as before the call),
// DI_ERR_NOMEM.
di_status di_cp_session_forward(di_cp *cp, di_session *s, const int32_t *tokens, int32_t n_tok,
                                const di_forward_out *out);

// One V4.1 sequence of the serving engine's step (a slot's session, its pages bound to the
// sequence's KV blocks) over the workers: tokens [n_tok] at its position, the logits of its last
// row to logits [V] (NULL: none). Runs locally (the V4.1 forward of that one sequence) when the
// chunk is too short for two pieces or the session is in a bounded replay after a prefix hit
// (entries kept ahead of its position). DI_ERR_IO (a worker failed; the session is garbage, as
// after any failed engine step), DI_ERR_NOMEM, or what the forward returns.
di_status di_cp_v41_seq_forward(di_cp *cp, di_session *s, const int32_t *tokens, int32_t n_tok,
                                float *logits);

// One sequence of a ragged batch over the workers (the serving engine's long prefill chunks):
// c holds that one sequence (its state possibly paged, in KV blocks), tokens its rows; logits of
// logit_rows (ascending, at most DI_CP_MAX_LOGIT_ROWS) go to logits as di_dsv4_forward_batch
// writes them. Runs locally (di_dsv4_forward_batch) when the chunk is too short for two pieces,
// asks for a logit row outside the last piece, or its state is not in the ordinary form (a bounded
// replay after a prefix hit: win_lo > 0 or entries kept ahead of its position). DI_ERR_IO (a
// worker failed; the sequence's state is garbage, as after any failed engine step), or what the
// forward returns.
#define DI_CP_MAX_LOGIT_ROWS 64
di_status di_cp_seq_forward(di_cp *cp, di_dsv4_ctx *c, const int32_t *tokens,
                            const int32_t *logit_rows, int32_t n_logit_rows, float *logits);

// A ragged batch (the serving engine's step; di_dsv4_forward_batch's contract): every sequence
// whose rows number at least the threshold runs alone over the workers (di_cp_seq_forward), the
// others in one batched call as ever; the logits land where one call would put them. Results are
// bit-identical to di_dsv4_forward_batch (a sequence's results do not depend on its batch).
// DI_ERR_IO (a worker failed: the step's sequences are garbage), DI_ERR_NOMEM (the rest's buffers,
// grown to the largest batch seen).
di_status di_cp_batch_forward(di_cp *cp, di_dsv4_ctx *c, const int32_t *tokens,
                              const int32_t *logit_rows, int32_t n_logit_rows, float *logits);

// Test hook: the front flips one float of the window ring in the layer message of state layer il
// that it installs (-1: off), so a test can prove that its comparison sees a broken message.
void di_cp_test_corrupt(di_cp *cp, int32_t il);

// ---- shared by the front and the workers (cp.c) ----

// The shapes of m's state layers (cp/wire.h).
void di_cp_dims_init(const di_model *m, di_cp_dims *out);

// A growable 64-byte aligned receive buffer.
typedef struct di_cp_buf {
    void *p; // owned
    size_t cap;
} di_cp_buf;
void di_cp_buf_free(di_cp_buf *b);

// Receives one frame of type `type` into b (payload in b->p, length in *len). An ERROR frame is
// logged as "<who>: <peer>: <text>" and returns DI_ERR_IO; so do a closed connection, a timeout
// and a frame of another type (logged). *bytes (may be NULL) grows by the frame's size.
di_status di_cp_recv_frame(int fd, const char *who, const char *peer, uint16_t type, di_cp_buf *b,
                           uint64_t *len, int64_t *bytes);
// Sends state layer il of ls (a session's contiguous entries) as it is at position pos: ring,
// compressor rings and entries [from[k], n_entries). *bytes grows by the frame's size.
di_status di_cp_send_layer(int fd, const di_model *m, const di_dsv4_layer_state *ls, int32_t il,
                           int64_t pos, const int64_t from[2], int64_t *bytes);
// Installs a decoded layer message into ls (which must be at the message's layer): the rings are
// replaced and entries [from, n) written. DI_ERR_FORMAT (why) when from is not the entries ls
// holds or n exceeds its capacity.
di_status di_cp_install_layer(const di_model *m, di_dsv4_layer_state *ls, const di_cp_layer *l,
                              char *why, size_t why_n);
// V4.1: sends state layer il of st (a main layer, or a DSpark block il >= n_layer) as it is at
// position pos: window ring and, on a kv source, its (C, Z) slots and entries / index keys
// [from, n_entries) (from ignored otherwise). *bytes grows by the frame's size.
di_status di_cp_send_layer41(int fd, const di_model *m, const di_cp_dims *dims,
                             const di_dsv41_state *st, int32_t il, int64_t pos, int64_t from,
                             int64_t *bytes);
// V4.1: installs a decoded layer message into st: the ring (and (C, Z) slots) replaced, entries
// and keys [from, n) written. DI_ERR_FORMAT (why) when the layer is not one of st's, from is not
// the entries st holds or n exceeds its pages.
di_status di_cp_install_layer41(const di_cp_dims *dims, di_dsv41_state *st, const di_cp_layer41 *l,
                                char *why, size_t why_n);
