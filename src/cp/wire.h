/*
 * wire — the context-parallel wire protocol between a front and its prefill workers
 * (docs/context-parallel.md, "Wire format"): length-prefixed binary frames in native byte order
 * over one persistent TCP connection per front and worker (base/sock.h). Every frame is a 16-byte
 * header (magic, version, type, payload length) and a payload; every length is checked against
 * the limits below before anything is allocated, and every payload is decoded into views of the
 * received bytes (no copy) after its exact size is checked against the model's dimensions.
 * Thread-safety: the decoders are pure functions; a socket is read by one thread and written by
 * one thread at a time.
 */
#pragma once

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "deepinfer.h"

#define DI_CP_MAGIC 0x50434944u // "DICP" in little-endian memory order
#define DI_CP_VERSION 1
// Largest payload of a layer message (a layer's rings and compressed entries) or a worker's
// logits: 2 GiB.
#define DI_CP_MAX_FRAME ((uint64_t)1 << 31)
// Largest hello / error payload.
#define DI_CP_MAX_TEXT 4096
// Largest job payload (header, entry counts and up to DI_CP_MAX_TOKENS token ids).
#define DI_CP_MAX_TOKENS (1 << 24)
#define DI_CP_MAX_JOB ((uint64_t)DI_CP_MAX_TOKENS * 4 + 65536)
// Engram history ids a V4.1 job carries (the compressed ids of the positions before its piece).
#define DI_CP_MAX_HIST 16
// State layers a job may name (main layers and one MTP block).
#define DI_CP_MAX_LAYERS 256
// Ranks of one prefill (the front included).
#define DI_CP_MAX_RANKS 64
// Default I/O timeout of either side waiting on the other (connect, each frame), milliseconds.
#define DI_CP_IO_TIMEOUT_MS 60000

enum {
    DI_CP_HELLO = 1,   // front -> worker: u64 model id, then the model's description (text)
    DI_CP_JOB = 2,     // front -> worker: one piece of a prefill (di_cp_job)
    DI_CP_LAYER = 3,   // rank -> next rank (relayed by the front): a layer's state (di_cp_layer)
    DI_CP_XROW = 4,    // rank -> next rank: i32 pos, 0; the main streams [NC D] of position pos
    DI_CP_LAYER41 = 5, // rank -> next rank: a V4.1 state layer (di_cp_layer41)
    DI_CP_OK = 16,     // worker -> front: empty (hello accepted)
    DI_CP_ERROR = 17,  // worker -> front: text (why); the job is over, the connection closes
    DI_CP_DONE = 18,   // worker -> front: i32 n_logits, n_mtp; logits [(n_logits + n_mtp) V]
};

typedef struct di_cp_hdr {
    uint32_t magic;
    uint16_t version, type;
    uint64_t len; // payload bytes
} di_cp_hdr;
_Static_assert(sizeof(di_cp_hdr) == 16, "the frame header is 16 bytes");

// The payload limit of a frame type (UINT64_MAX: a type this version does not know).
uint64_t di_cp_frame_limit(uint16_t type);
// DI_OK when h carries the magic and version and a known type whose length is within its limit;
// DI_ERR_FORMAT otherwise, with the reason in why[why_n].
di_status di_cp_hdr_check(const di_cp_hdr *h, char *why, size_t why_n);

// The shapes of a model's state layers, against which messages are checked: per state layer
// (main layers, then the MTP block when the job runs one) the window ring's floats and its
// compressors (0: SWA, 1: HCA, 2: CSA's main and indexer) with their token rings' floats and
// entry widths.
typedef struct di_cp_dims {
    int32_t n_layers;    // main layers (the MTP block, when loaded, is state layer n_layers)
    bool has_mtp;        // the model has an MTP block
    int32_t n_vocab;     // token ids and logit rows
    int64_t row_floats;  // NC D: one position's main streams
    int64_t max_pos;     // positions a job may reach
    int64_t ring_floats; // every layer's window ring
    int8_t n_cmp[DI_CP_MAX_LAYERS];
    int64_t cmp_ring_floats[DI_CP_MAX_LAYERS][2];
    int32_t cmp_d[DI_CP_MAX_LAYERS][2];
    int32_t ratio[DI_CP_MAX_LAYERS];
    // DeepSeek V4.1 (model/dsv41.h): its state layers are the main layers then, in a DSpark
    // session, the n_mtp DSpark blocks; each has a window ring of ring_bytes (packed Q8 rows); a kv
    // source layer (src[il]) also its entries (ent_bytes each, packed Q4e), index keys (key_bytes
    // each, packed Q4) and, with ratio 2, cz_floats of FP32 (C, Z) slots. A job carries the
    // Engram history ids of the n_hist positions before its piece (min(pos, n_hist)).
    bool v41;
    int32_t
        n_mtp; // state layers after the main ones in a job with MTP (V4: 1; V4.1: DSpark blocks)
    int64_t ring_bytes, cz_floats;
    int32_t ent_bytes, key_bytes, n_hist, n_hist_ids;
    bool src[DI_CP_MAX_LAYERS];
} di_cp_dims;

// A job: rank `rank` of n_ranks (the front is the last) computes tokens [n_tok] at positions
// [pos, pos + n_tok). from[il][k]: the compressed entries its successor already holds (the layer
// messages it sends start there). Flags: the session runs MTP; the worker sends back all its
// logits / MTP logits; the state at pos follows as LAYER frames (and an XROW when the MTP block
// has a pending position), which rank 0 needs when pos > 0.
enum {
    DI_CP_JOB_MTP = 1,
    DI_CP_JOB_LOGITS = 2,
    DI_CP_JOB_MTP_LOGITS = 4,
    DI_CP_JOB_PREFIX = 8,
    DI_CP_JOB_PENDING = 16,
};
typedef struct di_cp_job {
    int32_t rank, n_ranks, pos, n_tok, flags, n_state; // n_state: layers with messages
    int32_t n_hist;                                    // V4.1: Engram history ids
    const int64_t *from;                               // view [n_state, 2]
    const int32_t *tokens;                             // view [n_tok]
    const int32_t *hist; // view [n_hist]: compressed ids of positions [pos - n_hist, pos)
} di_cp_job;
// Job payload: i32 rank, n_ranks, pos, n_tok, flags, n_state, n_hist, 0; i64 from[n_state][2];
// i32 tokens[n_tok]; i32 hist[n_hist]. Checks every field against dims (ranks, positions within
// max_pos, token ids, n_state = n_layers (+ n_mtp with MTP), entry counts; V4: n_hist 0; V4.1:
// n_hist = min(pos, dims->n_hist), ids below n_hist_ids, no MTP logits or pending row).
// DI_ERR_FORMAT with the reason otherwise. The payload must be 8-byte aligned.
di_status di_cp_decode_job(const void *payload, uint64_t len, const di_cp_dims *dims,
                           di_cp_job *out, char *why, size_t why_n);
// Bytes of a job's payload before its tokens.
uint64_t di_cp_job_head_bytes(int32_t n_state);

// One compressor of a layer message: its token rings and its entries [from, n).
typedef struct di_cp_cmp {
    int64_t from, n;
    const float *buf_c, *buf_z; // views [cmp_ring_floats]
    const float *entries;       // view [(n - from) d]
} di_cp_cmp;
typedef struct di_cp_layer {
    int32_t il;
    int64_t pos;       // the state's position (the layer has seen positions [0, pos))
    const float *ring; // view [ring_floats]
    di_cp_cmp cmp[2];  // dims.n_cmp[il] of them
} di_cp_layer;
// Layer payload: i32 il, n_cmp; i64 pos; per compressor i64 from, n; then ring [ring_floats]; per
// compressor buf_c, buf_z [cmp_ring_floats], entries [(n - from) d]. Checks il, n_cmp, pos within
// max_pos, n = pos / ratio (the entries closed by then), 0 <= from <= n and the exact size.
// DI_ERR_FORMAT with the reason otherwise. The payload must be 8-byte aligned.
di_status di_cp_decode_layer(const void *payload, uint64_t len, const di_cp_dims *dims,
                             di_cp_layer *out, char *why, size_t why_n);
// Bytes of a layer payload's fixed part (before the ring) for a layer with n_cmp compressors.
uint64_t di_cp_layer_head_bytes(int32_t n_cmp);

// A V4.1 state layer (DI_CP_LAYER41): the window ring and, on a kv source, its (C, Z) slots and
// entries / index keys [from, n).
typedef struct di_cp_layer41 {
    int32_t il;
    int64_t pos;         // the state's position (the layer has seen positions [0, pos))
    int64_t from, n;     // entries (0, 0 unless a kv source)
    const float *cz;     // view [cz_floats] (ratio 2 sources) or NULL
    const uint8_t *ring; // view [ring_bytes]
    const uint8_t *ent;  // view [(n - from) ent_bytes]
    const uint8_t *keys; // view [(n - from) key_bytes]
} di_cp_layer41;
// Layer41 payload: i32 il, is_src; i64 pos, from, n; cz [cz_floats] (ratio-2 sources); ring
// [ring_bytes]; entries [(n - from) ent_bytes]; keys [(n - from) key_bytes]. Checks il (main
// layers then the DSpark blocks), is_src, pos within max_pos, a source's n = pos / ratio and
// 0 <= from <= n (others 0, 0), the exact size. DI_ERR_FORMAT with the reason otherwise. The
// payload must be 8-byte aligned.
#define DI_CP_LAYER41_HEAD 32
di_status di_cp_decode_layer41(const void *payload, uint64_t len, const di_cp_dims *dims,
                               di_cp_layer41 *out, char *why, size_t why_n);
// Bytes of a V4.1 layer payload with e entries (e = 0 for a layer that is not a kv source).
uint64_t di_cp_layer41_bytes(const di_cp_dims *dims, int32_t il, int64_t e);

// XROW payload: i32 pos, 0; row [row_floats]. DI_ERR_FORMAT unless exactly that and pos in range.
di_status di_cp_decode_xrow(const void *payload, uint64_t len, const di_cp_dims *dims, int32_t *pos,
                            const float **row, char *why, size_t why_n);

// ---- framing over the blocking socket helpers (base/sock.h) ----

// Sends a frame's header (its payload follows with di_sock_send_all).
di_status di_cp_send_hdr(int fd, uint16_t type, uint64_t len);
// Sends one frame: header, then the payload (may be NULL when len is 0).
di_status di_cp_send_frame(int fd, uint16_t type, const void *payload, uint64_t len);
// Receives and checks a header (di_cp_hdr_check; DI_ERR_FORMAT with the reason, DI_ERR_IO when
// the connection closed or timed out).
di_status di_cp_recv_hdr(int fd, di_cp_hdr *h, char *why, size_t why_n);
