/*
 * dsv4 — the DeepSeek V4 (Flash / Pro) model: weights bound from a checkpoint, the per-sequence
 * incremental state (di_session), and the forward pass read top to bottom:
 *   dsv4.c        load, the layer loop, mHC, final head
 *   dsv4_attn.c   attention: q/kv paths, compressors (CSA/HCA), lightning indexer, sink softmax
 *   dsv4_moe.c    router (hash / score), routed experts, shared expert
 *   dsv4_mtp.c    multi-token-prediction block
 *   dsv4_state.c  session state: rings, compressed pools, compressor buffers, save/restore
 *   weights.c     tensor names (official and Hugging Face) -> this struct, every shape checked
 * Spec: ../shared/spec/deepseek-v4.md (section numbers below refer to it).
 *
 * Owns: di_model owns its checkpoint mapping, thread pool and the small FP32 copies of vectors;
 * big matrices are di_tensor views into the mapping. di_session owns its state and scratch.
 * Thread-safety: a model is immutable after load (sessions share it, one forward at a time since
 * they share the pool); a session is used by one thread.
 */
#pragma once

#include <stdbool.h>
#include <stdint.h>

#include "backend/cpu/gemm.h"    // di_cpu_matmul
#include "backend/cpu/ref_ops.h" // di_cpu
#include "backend/device.h"      // di_accel
#include "base/thread.h"         // di_pool
#include "deepinfer.h"
#include "io/gguf.h"        // di_gguf_file
#include "io/safetensors.h" // di_st_set
#include "model/hparams.h"  // di_hparams
#include "tensor/tensor.h"  // di_tensor

// ---- weights ----

typedef struct di_dsv4_hc_w { // one mHC site (spec §2.3)
    di_tensor fn;             // [(2+NC)*NC, NC*D] (or [NC, NC*D] for a head)
    float *base;              // owned [(2+NC)*NC] (head: [NC])
    float *scale;             // owned [3] (head: [1])
} di_dsv4_hc_w;

typedef struct di_dsv4_compressor_w { // spec §2.5
    di_tensor wkv, wgate;             // [c*d, D]
    float *ape;                       // owned [m, c*d]
    float *norm;                      // owned [d]
    int32_t m, c, d;                  // ratio, 2 if overlapping else 1, entry width
} di_dsv4_compressor_w;

typedef struct di_dsv4_layer_w {
    int32_t il;
    int32_t ratio; // compress ratio m
    bool hash_routed;
    float *attn_norm, *ffn_norm; // owned [D]
    di_dsv4_hc_w hc_attn, hc_ffn;
    // attention
    di_tensor wq_a, wq_b, wkv, wo_a, wo_b;
    float *q_norm, *kv_norm, *attn_sink;  // owned [Rq], [Dh], [H]
    di_dsv4_compressor_w cmp;             // ratio > 0
    di_dsv4_compressor_w idx_cmp;         // CSA: the indexer's compressor (d = DI)
    di_tensor idx_wq_b, idx_weights_proj; // CSA: [HI*DI, Rq], [HI, D]
    // MoE
    di_tensor gate;          // [E, D]
    float *gate_bias;        // owned [E]; score-routed layers
    int32_t *tid2eid;        // owned [V, K]; hash-routed layers
    di_tensor *w1, *w2, *w3; // owned arrays of E views: [F, D], [D, F], [F, D]
    di_tensor sh_w1, sh_w2, sh_w3;
    int32_t n_expert, n_expert_used; // E, K of this layer (DSpark blocks differ from the backbone)
    // ---- DeepSeek V4.1 only (spec deepseek-v41.md §2.3-§2.6) ----
    bool kv_source, index_source; // owns a compressor (cmp: c = 1, no ape) / runs an indexer
    di_tensor idx_wk;             // kv sources: [DI, Dh] index-key projection of the latent
    float *idx_k_norm;            // owned [DI]
    float *gate_bias_vl;          // owned [E]; image-span bias (loaded, unused: text only)
    int32_t engram;               // index of this layer's Engram module, -1 if none
    di_tensor eg_table;           // [rows, engram_head_dim] (FP8 with per-32 scales, or float)
    di_tensor eg_wkv;             // [(NC + 1) D, n_col · engram_head_dim]
    float *eg_qk;                 // owned [NC, D]: q_weight ⊙ k_weight (only the product is used)
} di_dsv4_layer_w;

typedef struct di_dsv41_dspark_w { // V4.1 DSpark heads (deepseek-v41.md §3.1), on mtp.0 / mtp.2
    di_tensor main_proj;           // [D, n_target · D]
    float *main_norm, *norm;       // owned [D]
    di_tensor markov_embed, markov_head; // [V, markov_rank]
    float *confidence;                   // owned [D + markov_rank]
} di_dsv41_dspark_w;

typedef struct di_dsv4_mtp_w {   // spec §2.10
    di_tensor e_proj, h_proj;    // [D, D]
    float *enorm, *hnorm, *norm; // owned [D]
    di_dsv4_hc_w hc_head;
    di_dsv4_layer_w block;
} di_dsv4_mtp_w;

typedef bool (*di_dsv4_matmul_fn)(void *user, const di_tensor *w, const float *x, int64_t n_tok,
                                  int64_t x_stride, float *y, int64_t y_stride);

struct di_model {
    di_hparams hp;
    di_model_options opt;
    char layout[16];    // "official" or "hf"
    di_st_set *st;      // owned checkpoint mapping (a view into `gguf` for GGUF files)
    di_gguf_file *gguf; // owned GGUF file, when loaded from one; NULL otherwise
    di_pool *pool;      // owned
    di_cpu cpu;
    di_tensor embed, head; // [V, D]
    float *norm;           // owned [D]
    di_dsv4_hc_w hc_head;
    di_dsv4_layer_w *layers;    // owned [n_layer]
    di_dsv4_mtp_w *mtp;         // owned [n_mtp_loaded] (V4.1: the DSpark blocks in .block)
    di_dsv41_dspark_w dspark;   // V4.1 DSpark heads (when n_mtp_loaded > 0)
    struct di_dsv41_model *v41; // owned: V4.1 constants (Engram hash, token map); NULL for V4
    int32_t n_mtp_loaded;
    float *omega_main, *omega_compress; // owned [n_rot/2]
    int64_t n_params, n_params_mtp;
    // Forward calls run on the CPU since load (di_dsv4_forward_batch, di_dsv41_forward_batch: one
    // per call, whatever its sequences); written by the thread running them.
    int64_t n_forward_calls;
    uint64_t weights_id; // fingerprint of the checkpoint's tensors (weights.c)
    // Small FP32 vectors copied out of the checkpoint (norm weights, biases, ...), freed at
    // destroy.
    void **owned;
    int64_t n_owned, cap_owned;
    // Optional accelerator for every matmul of the forward (di_dsv4_matmul): returns true when it
    // computed y (same contract as di_cpu_matmul), false to let the CPU do it. NULL: CPU only.
    // Set before the first forward: by di_model_load from opt.device (`accel`), or by a test
    // (backend/cuda/offload.cuh; tests/backend/cuda). Called only from the thread running the
    // forward, never from pool workers.
    di_dsv4_matmul_fn accel_matmul;
    void *accel_user; // borrowed
    di_accel accel;   // owned: opened from opt.device by di_model_load (backend/device.h)
    // Expert routing load (ep/eplb.h): di_dsv4_moe records every routed (token, slot) pair of
    // its layer (main layers, then MTP blocks) right after routing. Borrowed; NULL: off. Set
    // before the first forward (the serving engine sets its own).
    struct di_ep_load *expert_load;
    // The device-resident forward (model/dsv4_dev.h): every weight of the main layers and the head
    // uploaded to a backend once; sessions created afterwards run on it (MTP ones with the MTP
    // block uploaded at their first state: di_dsv4_dev_mtp_enable). NULL: none.
    struct di_dsv4_dev *dev; // owned (di_dsv4_dev_attach)
    // DeepSeek V4.1's (model/dsv41_dev.h): sessions run on it, DSpark ones (mtp) included (their
    // device state made at their first di_session_forward). NULL: none.
    struct di_dsv41_dev *dev41; // owned (di_dsv41_dev_attach); on dev_backend when that is set
    // The sessions holding a device state on dev / dev41 (a list through di_session.dev_next):
    // a session's device-loss recovery drops all of their states before the rebuild. Borrowed.
    struct di_session *dev_sessions;
    struct di_backend *dev_backend; // owned when di_model_load opened it (CUDA); NULL when a
                                    // caller attached its own backend (borrowed by dev)
    // A device list (di_device.more): the backends of pipeline stages 1.. (stage 0's is
    // dev_backend); owned when di_model_load opened them, borrowed by dev.
    struct di_backend *dev_more[DI_DEVICE_MAX_MORE];
    int32_t n_dev_more;
    // Expert parallelism (ep/ep.h): routed experts placed on worker processes are computed there.
    // Owned when di_model_load attached it (opt.ep_workers); NULL: every expert here.
    struct di_ep *ep;
    // Context parallelism (cp/cp.h): long prefills of sessions are split over worker processes.
    // Owned when di_model_load attached it (opt.cp_workers); NULL: every prefill here.
    struct di_cp *cp;
};

// The model's identity: FNV-1a over the hyper-parameters, the precision recipe, the parameter
// count and the weights' fingerprint. The prefix cache, the disk tier and expert parallelism's
// handshake share it (blocks and experts are never mixed between models, checkpoints or numerics).
uint64_t di_dsv4_model_id(const di_model *m);

// The device-resident forward on backends the model owns (what --device cuda:0,1,... does at
// load): one backend per entry of devs[0, n_devs) (di_backend_open with the model's n_threads),
// the forward attached on them as n_devs pipeline stages (V4: di_dsv4_dev_attach_stages; V4.1:
// di_dsv41_dev_attach_stages). Tests attach the CPU twin this way (DI_DEVICE_CPU entries) when it
// must be rebuildable. DI_ERR_INVALID (a forward or backend attached already, n_devs out of
// [1, DI_DEVICE_MAX_MORE + 1]), the open's and the attach's errors (nothing is left attached).
di_status di_model_dev_open(di_model *m, const di_device *devs, int32_t n_devs);
// Device loss (docs/cuda.md, "Device loss"): destroys the device-resident forward (m->dev or
// m->dev41) and the backends it runs on, resets their devices (di_backend_reset_device, each
// once: stages may share one; the offload context, m->accel, is closed before and reopened
// after), then opens the same devices again and attaches the forward with the same stages, its
// weights uploaded again from the still-mapped checkpoint. The device states of the model's
// sessions on it (di_session_*) are dropped first (each replays its tokens at its next call);
// everything else made on the old forward (dev states, MTP enabled with di_dsv4_dev_mtp_enable,
// graphs, host memory from its backends) must be destroyed before, and remade by the caller after.
// DI_ERR_UNSUPPORTED (the backends are the caller's, not the model's: it cannot reopen them),
// DI_ERR_INVALID (no device-resident forward), a reset's, the open's or the attach's error: then m
// has no device-resident forward (logged). Not while a forward runs.
di_status di_model_dev_rebuild(di_model *m);

// The matmul of every layer: the accelerator's when one is attached and takes it, else
// di_cpu_matmul. y[t*y_stride + o] = sum_i W[o, i] x[t*x_stride + i].
static inline void di_dsv4_matmul(di_model *m, const di_tensor *w, const float *x, int64_t n_tok,
                                  int64_t x_stride, float *y, int64_t y_stride) {
    if (m->accel_matmul && m->accel_matmul(m->accel_user, w, x, n_tok, x_stride, y, y_stride))
        return;
    di_cpu_matmul(&m->cpu, w, x, n_tok, x_stride, y, y_stride);
}

// Binds every tensor of the checkpoint to m (weights.c). Needs m->hp and m->st.
di_status di_dsv4_weights_bind(di_model *m);
void di_dsv4_weights_free(di_model *m);

// ---- per-sequence state (spec §3) ----

// Positions a V4 state can take back (di_dsv4_rollback, di_session_rollback): window rings keep
// this many rows beyond W and the compressors' token rings as many beyond what a window needs, so
// the rows of rejected positions land in slots no kept position reads, and a rollback only moves
// counters: at most this many below the highest position written (not per call: rows fed again
// after a rollback do not give back the rows the taken-back ones overwrote; di_dsv4_rollback
// checks it). 8: the engine's MTP verify takes back at most one row (one draft per step), and 8
// leaves room for chained drafts through the public API while the extra rows stay small
// (V4-Flash: 8 * 512 floats a layer's window ring, 8 * c * d a compressor's ring).
#define DI_DSV4_ROLLBACK_MAX 8

// Rows of a layer's window ring: slot of position p = p mod DI_DSV4_RING_ROWS(W).
#define DI_DSV4_RING_ROWS(W) ((W) + DI_DSV4_ROLLBACK_MAX)

// One compressor's state. A session keeps its entries in one heap array (`entries`); an engine
// sequence keeps them in KV pool blocks reached through a page table (`pages`), so the forward
// pass reads and writes entries only through di_dsv4_entry().
// The token ring holds the FP32 (C, Z) of the last buf_rows positions, slot = position mod
// buf_rows: the partial window, for CSA the window before it (its (Ca, Za) overlap the next entry,
// spec §2.5), and DI_DSV4_ROLLBACK_MAX more, so a rollback that re-opens a window finds its rows
// and the previous window's still there (di_dsv4_cmp_rows).
typedef struct di_dsv4_cmp_state {
    float *buf_c, *buf_z; // owned (session) or view (pool block) [buf_rows, c*d]: C and Z (ape
                          // added) of the last buf_rows positions
    int32_t buf_rows;
    float *entries; // owned [cap, d] (sessions); NULL when paged
    // Entries [0, n_entries) exist. A window that closes with an index below n_entries already
    // has its entry (a prefix-cache hit being replayed): the entry is left as it is and only the
    // overlap is updated (docs/kv-cache.md, "bounded replay").
    int64_t n_entries, cap_entries;
    // Paged storage: entry w lives at pages[w / page_entries] + page_off + (w % page_entries) * d.
    float *const *pages;  // borrowed page table (engine sequences); NULL = contiguous `entries`
    int64_t page_off;     // floats from the start of a page to this compressor's entries
    int32_t page_entries; // entries of this compressor per page
} di_dsv4_cmp_state;

static inline float *di_dsv4_entry(const di_dsv4_cmp_state *cs, int64_t w, int32_t d) {
    if (!cs->pages) return cs->entries + w * d;
    return cs->pages[w / cs->page_entries] + cs->page_off + (w % cs->page_entries) * (int64_t)d;
}

// Token ring rows of a compressor (c * m + DI_DSV4_ROLLBACK_MAX; see di_dsv4_cmp_state).
static inline int32_t di_dsv4_cmp_rows(const di_dsv4_compressor_w *cw) {
    return cw->c * cw->m + DI_DSV4_ROLLBACK_MAX;
}

typedef struct di_dsv4_layer_state {
    float *ring; // owned (session) or view (pool block) [DI_DSV4_RING_ROWS(W), Dh]: kv rows
    di_dsv4_cmp_state cmp, idx;
} di_dsv4_layer_state;

// Takes the state of layers [il0, il1) back from position pos to pos_new (pos - pos_new <=
// DI_DSV4_ROLLBACK_MAX, pos_new >= 0): entries of windows closed by the taken-back positions go
// (their rows stay in the token rings, so the re-opened window and the overlap before it are
// intact); window ring rows need nothing. The MTP block's state lags the main model's by one
// position: callers pass its own positions.
void di_dsv4_state_rollback(const di_model *m, di_dsv4_layer_state *layers, int il0, int il1,
                            int32_t pos_new);
// di_session_rollback of a V4 session: its main layers, its MTP block (one position behind) and
// the MTP block's pending input; a session on the device-resident forward through
// di_dsv4_session_dev_rollback (dsv41.h). DI_ERR_INVALID (nothing changes) for n < 0, n > pos, n
// > DI_DSV4_ROLLBACK_MAX, or a new position above 0 more than DI_DSV4_ROLLBACK_MAX below hw (the
// highest position fed since the reset; after a CPU state's restore its position + the maximum:
// what the saved session fed past it is unknown).
di_status di_dsv4_rollback(di_session *s, int32_t n);
// What di_dsv4_rollback and di_dsv41_rollback share (max: their DI_*_ROLLBACK_MAX): the bound
// above (DI_ERR_INVALID, logged, nothing changed), and a session on the device-resident forward
// rolled back there (*done set: its status); otherwise DI_OK for the caller's CPU state. s->hw
// goes back to 0 with a rollback to 0.
di_status di_session_rollback_begin(di_session *s, int32_t n, int32_t max, bool *done);

// Debug/test hook: called with named intermediate tensors (FP32 rows, or int32 when is_int).
typedef void (*di_dsv4_trace_fn)(void *user, const char *name, int il, const void *data,
                                 bool is_int, int64_t n_rows, int64_t row_len);

// ---- ragged batches ----
//
// One forward call runs any number of sequences, each with its own state and its own absolute
// positions; their rows are concatenated (sequence after sequence) into one batch. Every op is
// either per row (matmuls: di_cpu_matmul computes y[t, o] in the same order whatever the other
// rows; norms; RoPE; mHC; MoE experts, which gather rows but compute each row alone and sum a
// row's experts in ascending id) or per sequence (compressors, indexer, attention, ring update),
// so a sequence's results are bit-identical whatever else shares its batch. A session's forward
// is the batch of one sequence.

typedef struct di_dsv4_seq {
    di_dsv4_layer_state *layers; // borrowed: the sequence's state [n_layer (+ MTP)]
    int32_t pos;                 // absolute position of its first row in this call
    int32_t n_tok;               // its rows in this call (>= 1)
    int32_t row0;                // first row in the batch (set by the forward)
    // Positions below win_lo have no window row (a bounded replay starts there); keys are taken
    // from max(P - W + 1, win_lo). 0 for every ordinary call.
    int32_t win_lo;
    struct di_dsv41_state *v41; // borrowed: the sequence's V4.1 state (dsv41.h); NULL for V4
} di_dsv4_seq;

// Scratch for calls of up to `scratch_tokens` rows: grown by di_dsv4_ws_reserve (sessions, on
// demand) or sized once at create (the engine), never on the per-step path.
typedef struct di_dsv4_ws {
    float *scratch; // owned
    size_t scratch_floats;
    int32_t scratch_tokens; // calls of up to this many rows fit
    size_t scratch_off[32]; // float offset of each DI_SCR_* buffer
    float *attn_scratch;    // owned: per-thread score buffers
    size_t attn_scratch_floats;
    int32_t *sel; // owned [T, max(topk, 2K)]: indexer selections / expert routing
    size_t sel_cap;
    int32_t *row_seq, *row_pos; // owned [T]: sequence index and absolute position of each row
    bool mtp;                   // MTP scratch included
    struct di_dsv41_rows *v41;  // owned: V4.1 per-row scratch (dsv41.h); NULL until reserved
} di_dsv4_ws;

// Grows ws for calls of n_rows rows whose sequences hold at most max_entries compressed entries
// in one layer. DI_ERR_NOMEM (ws unchanged).
di_status di_dsv4_ws_reserve(di_dsv4_ws *ws, const di_model *m, int32_t n_rows, int64_t max_entries,
                             bool mtp);
void di_dsv4_ws_free(di_dsv4_ws *ws);
// Bytes of a workspace's buffers (scratch, attention scratch, selections, row maps).
int64_t di_dsv4_ws_bytes(const di_dsv4_ws *ws);

// Context parallelism (cp/cp.h): a call may compute one piece of a longer prefill whose earlier
// pieces run on other ranks. The hook runs around every layer's attention (the only cross-token
// dependency of the forward) to install the state of the pieces before this one (after = false)
// and to pass this piece's state on (after = true), and, in a session with MTP, before the MTP
// block to pass on this call's last main-stream row and take the pending row of position pos - 1
// (x_last [NC, D]: the main streams of the call's last row). A failure ends the forward with it.
struct di_dsv4_ctx;
typedef struct di_dsv4_cp_hook {
    di_status (*attn)(void *user, struct di_dsv4_ctx *c, int il_state, bool after);
    di_status (*mtp_input)(void *user, di_session *s, const float *x_last);
    void *user; // borrowed
} di_dsv4_cp_hook;

// The context of one call: who runs, on which rows.
typedef struct di_dsv4_ctx {
    di_model *model;   // borrowed
    di_dsv4_ws *ws;    // borrowed
    di_dsv4_seq *seqs; // borrowed [n_seq]
    int32_t n_seq, n_rows;
    di_dsv4_trace_fn trace;
    void *trace_user;
    // DI_OK, or the first failure of the call (an expert worker down: DI_ERR_IO). Once set, the
    // remaining MoE layers output zeros and the forward returns it; the call's results and the
    // state it advanced are garbage (callers end the sequences, sessions must be discarded).
    di_status status;
    const di_dsv4_cp_hook *cp; // borrowed; NULL: the whole sequence is here (every ordinary call)
} di_dsv4_ctx;

// Lays the rows of c's sequences out one after another (sequence after sequence): each
// sequence's row0, each row's sequence and absolute position in the workspace, c->n_rows.
void di_dsv4_set_rows(di_dsv4_ctx *c);

// Runs the main layers on a ragged batch: seqs[i] feeds tokens[seqs[i].row0 ..] (rows are
// concatenated in seqs order; row0 is set here) and advances its state (the caller then moves
// its position). Logits of the rows listed in logit_rows (ascending) go to logits [n, V]; the
// residual streams of all rows stay in the X scratch unless logits were gathered. Interior:
// tokens, positions and capacities were validated by the caller (asserted here). Returns c->status
// (DI_ERR_IO: an expert worker failed).
di_status di_dsv4_forward_batch(di_dsv4_ctx *c, const int32_t *tokens, const int32_t *logit_rows,
                                int32_t n_logit_rows, float *logits);

// The CPU forward of a V4 session (di_session_forward after validation, also on a context-parallel
// rank): tokens [n_tok] at s->pos, every layer's attention wrapped by cp (NULL: none). The state
// advances and s->pos moves to s->pos + n_tok on success; on failure the state is garbage unless
// the caller kept what it needs (cp/cp.c restores its session).
di_status di_dsv4_session_forward(di_session *s, const int32_t *tokens, int32_t n_tok,
                                  const di_forward_out *out, const di_dsv4_cp_hook *cp);

// Rows of one device-resident call of a session (its scratch is sized for this many rows).
#define DI_DSV4_DEV_SESSION_ROWS 256

struct di_session {
    di_model *model; // borrowed
    di_session_options opt;
    int32_t n_ctx_max;
    int32_t pos;                 // tokens consumed
    di_dsv4_layer_state *layers; // owned [n_layer + n_mtp]
    bool mtp;                    // MTP runs every step
    // owned [DI_DSV4_ROLLBACK_MAX + 1, NC, D]: main streams of the last positions, slot = position
    // mod (DI_DSV4_ROLLBACK_MAX + 1); the MTP block's pending input is position pos - 1's, which a
    // rollback finds here too.
    float *mtp_x;
    bool mtp_pending;
    // The highest position fed since the reset (on the CPU forward its rings' writes, on the
    // device the session's own count, a replay's lower): a rollback goes back at most
    // DI_DSV4_ROLLBACK_MAX (V4.1: DI_DSV41_ROLLBACK_MAX) below it (di_dsv4_rollback,
    // di_dsv41_rollback), since rows fed again after a rollback do not give back the ring rows the
    // taken-back ones overwrote.
    int32_t hw;
    di_dsv4_ws ws;          // owned scratch, grown (never shrunk) when a call needs more
    di_dsv4_trace_fn trace; // named intermediates (tests; DI_DUMP writes them as .npy)
    void *trace_user;
    char dump_dir[1024];
    struct di_dsv41_state *v41; // owned: the V4.1 state (dsv41.h); NULL for V4 (then layers)
    di_dsv4_ws *ws_shared;      // borrowed: V4.1 calls use it instead of ws (di_dsv41_share_ws)
    // The model's device-resident forward runs this session (1 slot of n_ctx_max positions):
    // layers are unused then, save writes a token state (dev_tokens). NULL: the CPU forward (or a
    // device session whose state a device loss dropped: dev_on).
    struct di_dsv4_dev_state *dev; // owned
    int32_t *dev_rows;             // owned [dev_max_rows]: logit rows of one dev call
    int32_t dev_max_rows;          // rows per dev call (longer feeds run in chunks)
    // V4 with MTP on dev: owned [3 * dev_max_rows], an MTP call's x_rows, ids_next, logit rows.
    int32_t *dev_mtp;
    // V4.1 on the model's dev41 (a 1-slot state, made at the first di_session_forward, so the
    // engine's slot sessions, fed by di_dsv41_forward_batch, never hold one): the CPU V4.1 state
    // is unused then; rollback and batched calls are refused, save / restore as for dev.
    // dev_rows and dev_max_rows as for dev.
    struct di_dsv41_dev_state *dev41; // owned
    // Device sessions (dev_on: V4 at create when the model has dev, V4.1 at its first call; for
    // good, dev / dev41 being NULL while the state is dropped by a device loss, remade and
    // replayed at the next call: dsv4.c "sessions on the device-resident forward"). dev_tokens
    // [n_ctx_max] (owned) holds the tokens of positions [0, pos): the replay's and the token
    // state's (di_session_save). dev_next: the model's list (m->dev_sessions) while a state is
    // held. Device loss bound: loss_ms (owned [loss_max + 1], a ring of the n_loss losses' times).
    bool dev_on;
    int32_t *dev_tokens;
    struct di_session *dev_next;
    int32_t loss_max, loss_window_s;
    int64_t *loss_ms;
    int32_t lose_in; // DI_SESSION_LOSE_DEVICE: calls left that fail as on a lost device
    di_session_stats stats;
};

// Makes the device state of a session on the device-resident forward (s->dev_on afterwards: V4
// at create, V4.1 at its first call) and lists it on the model. DI_ERR_DEVICE_LOST when the
// model's forward is gone (a failed rebuild), the state create's errors.
di_status di_dsv4_session_dev_open(di_session *s);
// Drops the session's device state (destroy) and takes it off the model's list.
void di_dsv4_session_dev_close(di_session *s);
// Whether s runs (or, a V4.1 session before its first call, will run) on the device-resident
// forward: what di_session_save and di_session_restore dispatch on.
bool di_dsv4_session_on_dev(const di_session *s);

// Layer forward pieces; every one runs on all rows of c (il_state: index into each sequence's
// layers[]). a: [T, D] normed hidden; out: [T, D].
void di_dsv4_attention(di_dsv4_ctx *c, const di_dsv4_layer_w *lw, int il_state, const float *a,
                       float *out);
// f: [T, D] normed hidden; ids: [T] token ids (hash routing); out: [T, D]. Experts placed on
// expert workers (m->ep) are computed there; a failure sets c->status (out is then zeros).
void di_dsv4_moe(di_dsv4_ctx *c, const di_dsv4_layer_w *lw, const float *f, const int32_t *ids,
                 float *out);
// One expert (w1, w3, w2) on n rows of x [n, D] -> y [n, D] (n <= the MoE scratch's rows): SwiGLU
// with the gate clamp `limit` (0: none); `weight` (per row, may be NULL) scales h before w2 in the
// official recipe and the output otherwise. Each row's result depends on that row only (matmuls
// and the A8 quantisation are per row), so rows may be split between calls and processes.
void di_dsv4_expert(di_dsv4_ctx *c, const di_tensor *w1, const di_tensor *w3, const di_tensor *w2,
                    const float *x, int32_t n, float limit, const float *weight, float *y);
// One decoder block on streams X [T, NC, D] in place (§2.2).
void di_dsv4_block(di_dsv4_ctx *c, const di_dsv4_layer_w *lw, int il_state, float *x,
                   const int32_t *ids);
// One token's mHC coefficients from its RMS-scaled mix row (spec §2.3): pre[s] = sigmoid gate +
// eps; unless post is NULL (a head site), post[s] = 2 sigmoid and comb [nc, nc] = Sinkhorn of the
// residual mix (row softmax + eps, then iters rounds of column / row normalisation).
void di_dsv4_hc_coeffs(const float *mix, const float *base, const float *scale, int nc, int iters,
                       float eps, float *pre, float *post, float *comb);
// mHC coefficients of one site (§2.3) for the rows of c: post and comb go to the DI_SCR_POST /
// DI_SCR_COMB scratch; pre [T, NC] is written when not NULL; a [T, D] (when not NULL) receives
// the collapse with this site's own pre (V4 wiring). head: only pre (head mHC).
void di_dsv4_hc_mix(di_dsv4_ctx *c, const di_dsv4_hc_w *hc, const float *x, int32_t n_tok,
                    float *pre, float *a, bool head);
// X'[t, k] = post_k o[t] + sum_j C[j][k] X[t, j] with the last di_dsv4_hc_mix's post/comb.
void di_dsv4_hc_post(di_dsv4_ctx *c, const float *o, float *x, int32_t n_tok);
// Collapses streams to one row with a head mHC (§2.9) and normalises: h [n, D].
void di_dsv4_hc_head(di_dsv4_ctx *c, const di_dsv4_hc_w *hc, const float *norm, const float *x,
                     int32_t n_tok, float *h);
// The MTP block (spec §2.10) on the rows of c (di_dsv4_set_rows done; each sequence's layers[]
// holds its MTP state at index n_layer): x_main [T, NC, D] the main streams of each row's
// position, ids_next [T] the token after it. MTP logits of the rows in logit_rows (ascending;
// NULL: rows 0 .. n_logit_rows - 1) go to logits [n_logit_rows, V] (none when logits is NULL).
// Uses the XM, A, H scratch (x_main may be the XMAIN scratch). Returns c->status.
di_status di_dsv4_mtp_forward_batch(di_dsv4_ctx *c, const float *x_main, const int32_t *ids_next,
                                    const int32_t *logit_rows, int32_t n_logit_rows, float *logits);
// Final head (§2.9) of the rows in logit_rows (ascending) after di_dsv4_forward_batch ran without
// logits: logits [n_logit_rows, V]. Gathers the rows in place to the front of the X scratch.
void di_dsv4_head_rows(di_dsv4_ctx *c, const int32_t *logit_rows, int32_t n_logit_rows,
                       float *logits);

// y = W x for n_tok rows (x, y with row strides). In official precision, FP8/FP4 weights with
// act_quant see A8-quantised inputs and outputs are rounded to BF16 (dsv4_attn.c).
void di_dsv4_linear(di_dsv4_ctx *c, const di_tensor *w, const float *x, int32_t n_tok,
                    int64_t x_stride, float *y, int64_t y_stride, bool act_quant);

// Rounds to BF16 in place when the model runs the official precision recipe (no-op in FP32).
void di_dsv4_round(const di_model *m, float *v, int64_t n);

// Key rows handed to the attention and indexer kernels (backend/cpu/vec.h) per call: 64 rows of
// V4's 512 floats (128 KiB) stay in L2 while a head group uses them.
#define DI_DSV4_KEY_CHUNK 64
// Heads of one query row that an attention task takes together (they share the key rows).
#define DI_DSV4_HEAD_GROUP 8

// The keys of one attention row (spec §2.4): window positions [w_lo, w_lo + n_win), those below
// p0 from a ring of ring_rows rows (slot = position mod ring_rows) and the rest from this call's
// rows (row = position - p0), then n_cmp compressed entries: entry sel[i] (or i when sel is NULL)
// of cmp (through di_dsv4_entry; V4.1 passes a paged view of its kv source's entries).
typedef struct di_dsv4_keys {
    const float *ring;
    int64_t ring_rows;
    const float *rows;
    int64_t p0, w_lo, n_win;
    const di_dsv4_cmp_state *cmp;
    const int32_t *sel;
    int64_t n_cmp;
} di_dsv4_keys;

// Heads [h0, h0 + nh) of one query row at position P (q and o: nh rows of Dh, contiguous; sink:
// their sinks): o_h = sum_j p_hj key_j, with p_h the softmax of q_h.key_j / sqrt(Dh) over the
// keys and the head's sink (which takes mass and gives no value; p rounded to BF16 in the official
// recipe), then de-rotated at P (omega, rscale: the layer's RoPE). The heads share each block of
// key rows while it is in cache. sc: scratch of nh * (n_win + n_cmp) floats.
void di_dsv4_attend_heads(const di_model *m, const float *q, const float *sink, int32_t nh,
                          const di_dsv4_keys *keys, int64_t P, const float *omega, float rscale,
                          float *sc, float *o);

// The k best of sc[0 .. n) (k <= n; ties to the lower index) into sel[k], ascending index.
void di_dsv4_topk(const float *sc, int64_t n, int32_t k, int32_t *sel);

// Weights of state layer il (main layers, then MTP blocks).
const di_dsv4_layer_w *di_dsv4_layer(const di_model *m, int il);

float *di_dsv4_scratch(di_dsv4_ctx *c, int which);
// Grows a session's entry arrays and scratch for a call of n_tok tokens (dsv4_state.c).
di_status di_dsv4_session_reserve(di_session *s, int32_t n_tok);
enum {
    DI_SCR_X = 0,   // [T, NC, D] residual streams
    DI_SCR_A,       // [T, D] collapsed + normed
    DI_SCR_OUT,     // [T, D] sub-layer output
    DI_SCR_POST,    // [T, NC]
    DI_SCR_COMB,    // [T, NC, NC]
    DI_SCR_MIX,     // [T, (2+NC)*NC]
    DI_SCR_QR,      // [T, Rq]
    DI_SCR_Q,       // [T, H, Dh]
    DI_SCR_KV,      // [T, Dh]
    DI_SCR_O,       // [T, H, Dh]
    DI_SCR_U,       // [T, G*Ro]
    DI_SCR_CC,      // [T, 2*Dh] compressor C
    DI_SCR_CZ,      // [T, 2*Dh] compressor Z
    DI_SCR_IQ,      // [T, HI, DI]
    DI_SCR_IW,      // [T, HI]
    DI_SCR_MOE_IN,  // [T*K, D] gathered tokens of one expert
    DI_SCR_MOE_G,   // [T*K, F]
    DI_SCR_MOE_U,   // [T*K, F]
    DI_SCR_MOE_OUT, // [T*K, D]
    DI_SCR_LOGIT,   // [T, E] router
    DI_SCR_XM,      // [T, NC, D] MTP streams
    DI_SCR_XMAIN,   // [T, NC, D] main streams for MTP input
    DI_SCR_H,       // [T, D]
    DI_SCR_AQ,      // [T*K, widest row] A8-quantised activations (official precision)
    DI_SCR_MOE_W,   // [T, K] routing weights
    DI_SCR_MOE_RW,  // [T*K] routing weight of each gathered row
    DI_SCR_COUNT
};
_Static_assert(DI_SCR_COUNT <= 32, "scratch_off holds 32 offsets");
