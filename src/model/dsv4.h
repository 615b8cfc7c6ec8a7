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
#include "base/thread.h"         // di_pool
#include "deepinfer.h"
#include "io/safetensors.h" // di_st_set
#include "model/hparams.h"  // di_hparams
#include "tensor/tensor.h"  // di_tensor

// ---- weights ----

typedef struct di_dsv4_hc_w { // one mHC site (spec §2.3)
    di_tensor fn;  // [(2+NC)*NC, NC*D] (or [NC, NC*D] for a head)
    float *base;   // owned [(2+NC)*NC] (head: [NC])
    float *scale;  // owned [3] (head: [1])
} di_dsv4_hc_w;

typedef struct di_dsv4_compressor_w { // spec §2.5
    di_tensor wkv, wgate; // [c*d, D]
    float *ape;           // owned [m, c*d]
    float *norm;          // owned [d]
    int32_t m, c, d;      // ratio, 2 if overlapping else 1, entry width
} di_dsv4_compressor_w;

typedef struct di_dsv4_layer_w {
    int32_t il;
    int32_t ratio; // compress ratio m
    bool hash_routed;
    float *attn_norm, *ffn_norm; // owned [D]
    di_dsv4_hc_w hc_attn, hc_ffn;
    // attention
    di_tensor wq_a, wq_b, wkv, wo_a, wo_b;
    float *q_norm, *kv_norm, *attn_sink; // owned [Rq], [Dh], [H]
    di_dsv4_compressor_w cmp;            // ratio > 0
    di_dsv4_compressor_w idx_cmp;        // CSA: the indexer's compressor (d = DI)
    di_tensor idx_wq_b, idx_weights_proj; // CSA: [HI*DI, Rq], [HI, D]
    // MoE
    di_tensor gate;     // [E, D]
    float *gate_bias;   // owned [E]; score-routed layers
    int32_t *tid2eid;   // owned [V, K]; hash-routed layers
    di_tensor *w1, *w2, *w3; // owned arrays of E views: [F, D], [D, F], [F, D]
    di_tensor sh_w1, sh_w2, sh_w3;
} di_dsv4_layer_w;

typedef struct di_dsv4_mtp_w { // spec §2.10
    di_tensor e_proj, h_proj;          // [D, D]
    float *enorm, *hnorm, *norm;       // owned [D]
    di_dsv4_hc_w hc_head;
    di_dsv4_layer_w block;
} di_dsv4_mtp_w;

struct di_model {
    di_hparams hp;
    di_model_options opt;
    char layout[16]; // "official" or "hf"
    di_st_set *st;   // owned checkpoint mapping
    di_pool *pool;   // owned
    di_cpu cpu;
    di_tensor embed, head; // [V, D]
    float *norm;           // owned [D]
    di_dsv4_hc_w hc_head;
    di_dsv4_layer_w *layers; // owned [n_layer]
    di_dsv4_mtp_w *mtp;      // owned [n_mtp_loaded]
    int32_t n_mtp_loaded;
    float *omega_main, *omega_compress; // owned [n_rot/2]
    int64_t n_params, n_params_mtp;
    // Small FP32 vectors copied out of the checkpoint (norm weights, biases, ...), freed at destroy.
    void **owned;
    int64_t n_owned, cap_owned;
};

// Binds every tensor of the checkpoint to m (weights.c). Needs m->hp and m->st.
di_status di_dsv4_weights_bind(di_model *m);
void di_dsv4_weights_free(di_model *m);

// ---- per-sequence state (spec §3) ----

typedef struct di_dsv4_cmp_state {
    float *buf_c, *buf_z; // owned [m, c*d]: C_j and Z_j (ape added) of the unfinished window
    float *ovl_c, *ovl_z; // owned [m, d]: CSA overlap (Ca, Za) of the last completed window
    bool has_ovl;
    float *entries;       // owned [cap, d]: finished compressed entries
    int64_t n_entries, cap_entries;
} di_dsv4_cmp_state;

typedef struct di_dsv4_layer_state {
    float *ring;          // owned [W, Dh]: kv rows, slot = pos mod W
    di_dsv4_cmp_state cmp, idx;
} di_dsv4_layer_state;

// Debug/test hook: called with named intermediate tensors (FP32 rows, or int32 when is_int).
typedef void (*di_dsv4_trace_fn)(void *user, const char *name, int il, const void *data,
                                 bool is_int, int64_t n_rows, int64_t row_len);

struct di_session {
    di_model *model; // borrowed
    di_session_options opt;
    int32_t n_ctx_max;
    int32_t pos;                   // tokens consumed
    di_dsv4_layer_state *layers;   // owned [n_layer + n_mtp]
    bool mtp;                      // MTP runs every step
    float *mtp_pending_x;          // owned [NC, D]: main streams of position pos-1
    bool mtp_pending;
    // Scratch for one call, grown (never shrunk) when a call needs more; no per-token allocation.
    float *scratch;
    size_t scratch_floats;
    int32_t scratch_tokens;        // calls of up to this many tokens fit
    size_t scratch_off[32];        // float offset of each DI_SCR_* buffer
    float *attn_scratch;           // per-thread score buffers
    size_t attn_scratch_floats;
    int32_t *sel;                  // [T, max(topk, 2K)]: indexer selections / expert routing
    size_t sel_cap;
    di_dsv4_trace_fn trace;        // named intermediates (tests; DI_DUMP writes them as .npy)
    void *trace_user;
    char dump_dir[1024];
};

// Layer forward pieces (one sequence, T tokens at positions s->pos ...).
// a: [T, D] normed hidden; out: [T, D].
void di_dsv4_attention(di_session *s, const di_dsv4_layer_w *lw, di_dsv4_layer_state *ls,
                       const float *a, int32_t n_tok, int32_t p0, float *out);
// f: [T, D] normed hidden; ids: [T] token ids (hash routing); out: [T, D].
void di_dsv4_moe(di_session *s, const di_dsv4_layer_w *lw, const float *f, const int32_t *ids,
                 int32_t n_tok, float *out);
// One decoder block on streams X [T, NC, D] in place (§2.2).
void di_dsv4_block(di_session *s, const di_dsv4_layer_w *lw, di_dsv4_layer_state *ls, float *x,
                   const int32_t *ids, int32_t n_tok, int32_t p0);
// Collapses streams to one row with a head mHC (§2.9) and normalises: h [T, D].
void di_dsv4_hc_head(di_session *s, const di_dsv4_hc_w *hc, const float *norm, const float *x,
                     int32_t n_tok, float *h);
// MTP block for n rows: x_main [n, NC, D], ids_next [n], positions p_first..; logits [n, V] or NULL.
void di_dsv4_mtp_forward(di_session *s, const float *x_main, const int32_t *ids_next, int32_t n,
                         int32_t p_first, float *logits);

// y = W x for n_tok rows (x, y with row strides). In official precision, FP8/FP4 weights with
// act_quant see A8-quantised inputs and outputs are rounded to BF16 (dsv4_attn.c).
void di_dsv4_linear(di_session *s, const di_tensor *w, const float *x, int32_t n_tok,
                    int64_t x_stride, float *y, int64_t y_stride, bool act_quant);

// Rounds to BF16 in place when the model runs the official precision recipe (no-op in FP32).
void di_dsv4_round(const di_model *m, float *v, int64_t n);

// Scratch layout for a call of n_tok tokens (dsv4_state.c).
di_status di_dsv4_session_reserve(di_session *s, int32_t n_tok);
float *di_dsv4_scratch(di_session *s, int which);
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
