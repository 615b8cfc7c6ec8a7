/*
 * dsv41 — the DeepSeek V4.1 (Flash) model on top of the V4 machinery (dsv4.h): same di_model /
 * di_session handles, same weight structs (the V4.1 parts are the "V4.1 only" fields of
 * di_dsv4_layer_w), same linear / MoE / mHC / RoPE / RMSNorm primitives. What differs is read top
 * to bottom here:
 *   dsv41.c        Engram, the single-pass mHC layer loop, the head without hc_head, DSpark
 *   dsv41_attn.c   attention: CSA2 compressors on kv sources, shared compressed KV, index keys
 *                  from the latent, the two-level indexer, top-k reuse, window Q8w / entry Q4e
 *   dsv41_state.c  per-sequence state, rollback of rejected speculative tokens, save/restore
 * Spec: ../shared/spec/deepseek-v41.md (section numbers below refer to it).
 *
 * Owns: di_dsv41_model (Engram hash constants and the compressed token map) belongs to the model;
 * di_dsv41_state to a session. Thread-safety: as dsv4.h (a session is used by one thread).
 */
#pragma once

#include <stdbool.h>
#include <stdint.h>

#include "model/dsv4.h"        // di_model, di_session, di_dsv4_ctx
#include "model/engram_hash.h" // di_engram_hash

// The state stores codes, not floats (docs/kv-cache.md, "DeepSeek V4.1"): every value it keeps is
// already fake-quantised, so the packed rows of tensor/quant_ref.h hold it exactly. Window rows
// are Q8 (e4m3, UE8M0 scale per DI_DSV41_WIN_BLOCK dims), entries Q4e (e2m1, E4M3 scale per
// DI_DSV41_ENT_BLOCK), index keys Q4 (e2m1, UE8M0 scale per DI_DSV41_KEY_BLOCK); head_dim and
// index_head_dim are multiples of 32 (validated at load, hparams.c).
#define DI_DSV41_WIN_BLOCK 32
#define DI_DSV41_ENT_BLOCK 16
#define DI_DSV41_KEY_BLOCK 32

// Index keys a thread keeps decoded while it scores the rows of one sequence (the indexer's
// per-thread cache: a prefill's rows share their keys; 1 MiB a thread for 128-dim keys). Keys
// beyond are decoded a chunk at a time for every row.
#define DI_DSV41_IKEY_CACHE 2048

// Rolled-back positions a session can take back (di_dsv41_rollback): window rings keep this many
// rows beyond the window so rejected rows never overwrite rows still needed (§5.3).
#define DI_DSV41_ROLLBACK_MAX 16

typedef struct di_dsv41_model {
    di_engram_hash hash;
    int32_t *cmap; // owned [n_cmap]: token id -> compressed id (§2.3.1 step 1), or NULL
    int32_t n_cmap;
    int32_t pad_c; // cmap[engram_pad_id]
} di_dsv41_model;

// One kv source's global state (§5.1). Its entries and index keys live in the state's pages
// (blocks of block_tokens positions, docs/kv-cache.md "DeepSeek V4.1") as packed rows: entry w at
// pages[w / per_page] + off_main + (w % per_page) * ent_bytes, its index key at ... + off_idx +
// (w % per_page) * key_bytes (di_dsv41_entry / di_dsv41_key).
typedef struct di_dsv41_src {
    int64_t off_main, off_idx; // bytes from a page's start to this source's entries / index keys
    int32_t per_page;          // entries of this source per page: block_tokens / ratio
    int64_t n_entries;         // entries [0, n_entries) exist
    float *cz; // owned [DI_DSV41_CZ_SLOTS, 2 Dh]: FP32 (C, Z) of recent even positions (m = 2)
} di_dsv41_src;

#define DI_DSV41_CZ_SLOTS (DI_DSV41_ROLLBACK_MAX / 2 + 2)

typedef struct di_dsv41_state {
    int32_t ring_rows;      // W + DI_DSV41_ROLLBACK_MAX; slot of position p = p mod ring_rows
    uint8_t **ring;         // owned [n_state_layers] of owned [ring_rows, ring_row_bytes]: Q8 rows
    int32_t ring_row_bytes; // a window row: di_quant_q8_row_bytes(Dh, DI_DSV41_WIN_BLOCK)
    int32_t ent_bytes, key_bytes; // an entry (Q4e of Dh) and an index key (Q4 of DI)
    int32_t n_state_layers;
    bool dspark;       // runs DSpark: rings of the DSpark blocks, taps and context rows
    di_dsv41_src *src; // owned [n_layer]; only kv sources hold entries
    // Pages of block_tokens positions (di_dsv41_page_bytes each) holding every source's entries
    // and index keys: borrowed from the engine's kv_manager (di_dsv41_bind_pages: the sequence's
    // block table, shared prefix blocks included) or, for a standalone session, owned (own_pages,
    // grown by di_dsv41_reserve_state and freed with the session).
    uint8_t *const *pages;
    int32_t n_pages;      // pages [0, n_pages) exist: entries of positions < n_pages * block_tokens
    int32_t block_tokens; // positions per page (di_kv_block_tokens)
    uint8_t **own_pages;  // owned [cap_own] of owned pages; NULL while bound
    int32_t cap_own;
    bool bound;    // pages are borrowed (di_dsv41_bind_pages)
    int32_t *hist; // owned [cap_hist]: compressed id of every position (Engram look-back)
    int64_t cap_hist;
    int32_t dspark_pos; // DSpark rings hold positions < dspark_pos
    // Views of this sequence's rows in the last call's workspace (di_dsv41_rows; valid until that
    // workspace runs another call): its DSpark taps [n_tok, n_target, D] (DSpark sessions) and
    // the candidate pool of its queries [n_tok, candidate_topk_blocks] / [n_tok]. Tests read them.
    const float *taps;
    const int32_t *cand, *n_cand;
} di_dsv41_state;

// The packed rows of entry w (Q4e of [Dh]: di_quant_q4e_unpack) and index key w (Q4 of [DI]:
// di_quant_q4_unpack) of kv source src of state st.
static inline uint8_t *di_dsv41_entry(const di_dsv41_state *st, const di_dsv41_src *src,
                                      int64_t w) {
    return st->pages[w / src->per_page] + src->off_main + (w % src->per_page) * st->ent_bytes;
}
static inline uint8_t *di_dsv41_key(const di_dsv41_state *st, const di_dsv41_src *src, int64_t w) {
    return st->pages[w / src->per_page] + src->off_idx + (w % src->per_page) * st->key_bytes;
}

// Per-row scratch of a V4.1 call over the rows of all its sequences (di_dsv4_ws.v41, owned by
// the workspace): grown by di_dsv41_ws_reserve, never on a call's path.
typedef struct di_dsv41_rows {
    int32_t cap_rows;         // calls of up to this many rows fit
    int64_t cap_ent;          // sequences of up to this many entries in one kv source fit
    int32_t *topk;            // [T, topk] published selection (ascending entry ids)
    int32_t *n_topk;          // [T] picks per query
    bool have_topk;           // an index source published in this call
    int32_t *cand;            // [T, candidate_topk_blocks] kept candidate blocks of each query
    int32_t *n_cand;          // [T]
    bool have_cand;           // the candidate source ran in this call
    float *pre;               // [T, NC] P carried between sites
    float *pre_attn;          // [T, NC] the attention site's pre
    int64_t *eg_rows;         // [T, n_engram, n_col]
    float *eg_in;             // [T, n_col * hd]
    float *eg_kv;             // [T, (NC + 1) D]
    float *taps;              // [T, n_target, D] DSpark taps (block inputs of the target layers)
    uint8_t *kv_packed;       // [T, ring_row_bytes] the call's window rows, packed for the rings
    float *scores;            // [n_threads, cap_ent] indexer scores
    float *blk;               // [n_threads, cap_ent + 1] block scores / candidate flags
    struct di_dsv4_seq *seqs; // [T] the call's sequences (one row at least each)
    int32_t *n_out;           // [T] their logit rows
    int32_t *tokens;          // [T] the call's tokens, sequence after sequence
    // Per-thread FP32 keys decoded from the packed state: the attention's key rows of one query
    // (window + DSpark block rows + top-k entries, [cap_keys, Dh]) and the indexer's index keys
    // of the sequence a thread scores (keys [0, cap_ikeys), decoded once for all its rows of a
    // call, then one chunk for keys beyond: [cap_ikeys + DI_DSV4_KEY_CHUNK, DI]).
    float *keys;       // [n_threads, cap_keys, Dh]
    int32_t cap_keys;  // key rows per thread
    float *ikeys;      // [n_threads, cap_ikeys + DI_DSV4_KEY_CHUNK, DI]
    int32_t cap_ikeys; // min(cap_ent, DI_DSV41_IKEY_CACHE)
    int64_t key_bytes; // of keys and ikeys
    float *draft;      // [cap_draft, 2 V + D + markov_rank] DSpark head scratch of a draft call
    int32_t cap_draft; // draft calls of up to this many sessions fit
    int64_t row_bytes, ent_bytes; // bytes per row / per entry of cap_ent + 1 (di_dsv41_ws_bytes)
    int64_t draft_bytes;          // of draft
} di_dsv41_rows;

// ---- model (dsv41.c) ----

// Loads the V4.1 extras after the weights are bound: the Engram hash constants and, when there are
// Engram layers, the compressed token map from <dir>/engram/token_map.safetensors (tensor
// "token_map", I32 or I64, >= vocab_size entries in [0, engram_compressed_vocab_size)). A missing
// map is a warning (the model loads for info; sessions are refused with DI_ERR_INVALID).
// DI_ERR_IO, DI_ERR_FORMAT (a malformed map), DI_ERR_NOMEM.
di_status di_dsv41_model_init(di_model *m, const char *dir);
void di_dsv41_model_free(di_model *m);

// ---- ragged batches ----
//
// One V4.1 call runs any number of sessions, each at its own position with its own state; their
// rows are concatenated (sequence after sequence), as V4's di_dsv4_forward_batch does (dsv4.h,
// "ragged batches"). Token-wise work runs once over all rows (embedding, Engram, mHC, every
// projection, norms, the MoE, the head of the rows that want logits, DSpark's main_proj and
// context-row projections); each sequence's own state takes the rest (Engram history, window
// rings, CSA2 compressors, the indexer's candidate pool and top-k, attention). Every op computes a
// row alone in a fixed order, so a sequence's logits, taps and state are bit-identical whatever
// else shares its call and at whatever row offset. A session's forward is the batch of one.

typedef struct di_dsv41_seq {
    di_session *s;         // borrowed: a V4.1 session of the call's model, at position s->pos
    const int32_t *tokens; // borrowed [n_tok]
    int32_t n_tok;         // >= 1
    int32_t n_out;         // logits of its last n_out rows (0 .. n_tok)
} di_dsv41_seq;

// Runs seqs[0 .. n_seq) in one call on workspace ws (the sessions' own or a shared one): checks
// them (tokens in the vocabulary, within each session's context, n_out in range, no session
// twice), reserves what the call needs (state capacities, ws for the total rows: nothing when
// reserved before, as the engine's slots are), then feeds every sequence's rows and advances its
// position. logits [sum n_out, V]: each sequence's rows in sequence order (NULL when no sequence
// wants any). A DSpark session also writes the DSpark context rows of every position it fed.
// The model's trace hook is the first session's (rows of the whole call). DI_ERR_INVALID,
// DI_ERR_NOMEM, DI_ERR_NO_KV (a bound session's pages do not cover its rows; then nothing ran and
// no session moved).
di_status di_dsv41_forward_batch(di_model *m, di_dsv4_ws *ws, const di_dsv41_seq *seqs,
                                 int32_t n_seq, float *logits);
// The batch of one sequence with its layers wrapped by a context-parallel hook (cp/cp.h; model/
// dsv4.h, di_dsv4_cp_hook): cp->attn(il, false / true) runs around every main layer's attention
// (state layer il: its window ring and, on a kv source, the source's entries, index keys and
// (C, Z) slots) and, in a DSpark session, around the DSpark context rows (state layers n_layer ..:
// the DSpark blocks' rings). A hook failure stops the call with it (positions unchanged, the state
// garbage unless the caller kept it). Otherwise as di_dsv41_forward_batch.
di_status di_dsv41_forward_cp(di_model *m, di_dsv4_ws *ws, const di_dsv41_seq *seq, float *logits,
                              const di_dsv4_cp_hook *cp);
// Grows ws for V4.1 calls of up to n_rows rows over sequences of up to n_pos positions.
// DI_ERR_NOMEM.
di_status di_dsv41_ws_reserve(di_dsv4_ws *ws, const di_model *m, int32_t n_rows, int64_t n_pos);
// Grows ws for DSpark draft calls of up to n sessions (the head scratch; the rows and positions
// through di_dsv41_ws_reserve). DI_ERR_NOMEM.
di_status di_dsv41_ws_reserve_draft(di_dsv4_ws *ws, const di_model *m, int32_t n);
void di_dsv41_ws_free(di_dsv4_ws *ws);           // the V4.1 part (di_dsv4_ws_free calls it)
int64_t di_dsv41_ws_bytes(const di_dsv4_ws *ws); // the V4.1 part's bytes

// ---- attention (dsv41_attn.c) ----

// One attention layer on the rows of c (a [T, D] normed input, out [T, D]); each sequence's
// state is c->seqs[i].v41.
void di_dsv41_attention(di_dsv4_ctx *c, const di_dsv4_layer_w *lw, int il, const float *a,
                        float *out);
// DSpark attention of the draft blocks of c's sequences: a sequence's queries = its block rows
// (positions pos ..), keys = its block's ring (context positions < pos) plus every row of its
// block (non-causal).
void di_dsv41_dspark_attention(di_dsv4_ctx *c, const di_dsv4_layer_w *lw, int il_state,
                               const float *a, float *out);
// Writes the DSpark ring rows of block il_state for the rows of c from the projected context
// main_x [T, D] (sequences without DSpark are skipped).
void di_dsv41_dspark_ring(di_dsv4_ctx *c, const di_dsv4_layer_w *lw, int il_state,
                          const float *main_x);

// ---- state (dsv41_state.c) ----

di_status di_dsv41_state_create(di_session *s);
void di_dsv41_state_destroy(di_session *s);
// Grows the pages (standalone sessions), the history and the session's workspace for a call of
// n_tok tokens. DI_ERR_NOMEM, DI_ERR_NO_KV (bound pages do not cover the call; logged).
di_status di_dsv41_reserve(di_session *s, int32_t n_tok);
// Makes sure the pages hold the entries of positions < end (a standalone session grows its own;
// a bound one must have them: DI_ERR_NO_KV, logged) and grows the history for positions
// < end_hist (>= end; a DSpark draft writes the history of its block past the last position fed).
// Not the workspace. DI_ERR_NOMEM.
di_status di_dsv41_reserve_state(di_session *s, int64_t end, int64_t end_hist);
// Reserves everything a call can grow for positions < n_ctx and calls of up to n_tok rows (the
// pages of a standalone session, the history and the session's workspace: its own or the shared
// one), so that no later call within those bounds allocates: the serving engine's per-slot
// sessions (engine.c), whose pages are bound (their blocks come from the engine's pool).
// DI_ERR_NOMEM.
di_status di_dsv41_reserve_ctx(di_session *s, int32_t n_ctx, int32_t n_tok);
// Bytes the session holds now: the V4.1 state (rings, (C, Z) slots, history, DSpark scratch,
// the pages it owns; bound pages are the engine's pool's) plus its own workspace (none when it
// shares one; the per-row scratch of a call lives in the workspace). After di_dsv41_reserve_ctx
// on a bound session, the fixed per-slot tail of one engine slot.
int64_t di_dsv41_state_bytes(const di_session *s);
// Makes the session's calls use ws (borrowed; it must outlive them) instead of its own workspace,
// which is freed: sessions that run in the same calls or never at the same time (the engine's
// slots, batched on the forward thread) share one. Reservations grow ws.
void di_dsv41_share_ws(di_session *s, di_dsv4_ws *ws);
// The workspace the session's calls use.
static inline di_dsv4_ws *di_dsv41_ws(di_session *s) {
    return s->ws_shared ? s->ws_shared : &s->ws;
}
di_status di_dsv41_save(const di_session *s, void **bytes, size_t *n_bytes);
di_status di_dsv41_restore(di_session *s, const void *bytes, size_t n_bytes);

// ---- pages (prefix-cache blocks; docs/kv-cache.md, "DeepSeek V4.1") ----
// A page of block_tokens positions (di_kv_block_tokens: a multiple of every compression ratio and
// even) holds, per kv source in layer order, its block_tokens / m packed entries (Q4e rows of Dh)
// then as many packed index keys (Q4 rows of DI), each run starting at a multiple of 64 bytes. It
// is the unit the engine's pool hands out and its prefix cache shares: a full page is final (every
// group closed, no pending (C, Z) group at its end). The Engram history stays per session (4 bytes
// a position; a function of the tokens, rebuilt from them on a prefix hit).

// Bytes of one page (a multiple of 64; V4.1-Flash 113,920 for 128 positions: 890 a position).
size_t di_dsv41_page_bytes(const di_model *m, int32_t block_tokens);
// Where kv source il's runs start in such a page: its entries at *off_main, its index keys at
// *off_idx (bytes; il must be a kv source, DI_ASSERT). The device-resident forward's block I/O
// (dsv41_dev.h) reads and writes blocks in this layout.
void di_dsv41_page_offsets(const di_model *m, int32_t block_tokens, int il, int64_t *off_main,
                           int64_t *off_idx);
// Makes the session read and write its entries through pages[0 .. n_pages) (borrowed: the
// engine's block table of its sequence; the array must outlive the session's calls and may grow
// in place beyond n_pages). Frees pages the session owned (the first binding). Called again
// whenever n_pages changes, while no call runs.
void di_dsv41_bind_pages(di_session *s, uint8_t *const *pages, int32_t n_pages);
// Positions whose entries the session's pages hold (n_pages * block_tokens).
int64_t di_dsv41_capacity(const di_session *s);
// Restarts a bound session on a prefix of hit positions whose entries its pages already hold
// (cached blocks attached to its block table, shared): every source has n_entries = hit / m (kept
// by the compressor, dsv41_attn.c, while positions < hit are fed again: a replayed entry is never
// written into a shared page), the Engram history of positions < hit is rebuilt from tokens
// [hit], and the session stands at position pos (0 <= pos <= hit), DSpark rings empty from there;
// window and DSpark rings are zeroed. The caller feeds pos .. hit - 1 again (the bounded replay).
// DI_ERR_INVALID (hit not a whole number of pages, beyond the pages or the context, or pos out
// of range; the session is then reset), DI_ERR_NOMEM.
di_status di_dsv41_restart(di_session *s, int64_t hit, int32_t pos, const int32_t *tokens);

// Tail snapshots (docs/kv-cache.md, "Tail snapshots"): the session's state beyond its pages and
// its Engram history, i.e. the window rings of every state layer (DSpark blocks included) and the
// (C, Z) slots of every kv source, as raw bytes. At a page boundary (every group closed) this and
// the pages are the whole state; the history is a function of the tokens.
size_t di_dsv41_tail_bytes(const di_session *s);
// Copies the tail into out[di_dsv41_tail_bytes].
void di_dsv41_tail_save(const di_session *s, uint8_t *out);
// di_dsv41_restart(s, hit, pos, tokens), then the tail saved by a session of the same model at
// position pos (a page boundary) of the same tokens: the session continues at pos exactly as the
// one that saved it, its DSpark rings holding positions < pos. Errors as di_dsv41_restart.
di_status di_dsv41_tail_load(di_session *s, const uint8_t *tail, int64_t hit, int32_t pos,
                             const int32_t *tokens);

// Takes back the last n positions (rejected speculative tokens, §5.3): afterwards the session is
// exactly the state of a run that never saw them; a session on the device-resident forward
// through di_dsv4_session_dev_rollback. DI_ERR_INVALID if n < 0, n > s->pos,
// n > DI_DSV41_ROLLBACK_MAX, or the new position above 0 is more than DI_DSV41_ROLLBACK_MAX below
// s->hw, the highest position fed since the reset (after a restore or a restart at pos: pos + the
// maximum, nothing below pos); then nothing changes.
di_status di_dsv41_rollback(di_session *s, int32_t n);

// ---- DSpark (dsv41.c) ----

typedef struct di_dsv41_draft {
    int32_t n;            // drafts (dspark_block_size)
    int32_t tokens[16];   // greedy (argmax) draft for positions a+1 .. a+n
    float confidence[16]; // sigmoid(confidence logit): P(draft j accepted | drafts < j accepted)
    float conf_logit[16];
} di_dsv41_draft;

// Writes the DSpark context rows of positions p0 .. p0 + n_tok - 1 from taps [n_tok, n_target · D]
// (the stream means of the target layers' inputs): main_x = RMSNorm(main_proj · taps), then every
// block's ring row (§3.2). Called by every forward of a DSpark session; tests call it with a
// reference's taps. n_tok <= the scratch rows reserved; positions at most those fed (by the
// forward in progress or before).
void di_dsv41_dspark_context(di_session *s, const float *taps, int32_t p0, int32_t n_tok);

// Drafts a block after a forward whose last position is a-1 and whose argmax y_a (anchor) is the
// token for position a (§3.3). The session must have been created with mtp (DSpark) and the
// previous forward must have run with taps (DSpark sessions always do). logits: when not NULL,
// [n, V] Markov-corrected draft logits. DI_ERR_INVALID without DSpark weights. The batch of one
// (di_dsv41_draft_batch) on the session's workspace.
di_status di_dsv41_draft_block(di_session *s, int32_t anchor, di_dsv41_draft *out, float *logits);

// A session on the device-resident forward (s->dev_on; model/dsv4.c "sessions on the
// device-resident forward"): di_session_rollback's and (DSpark) di_session_draft's device twins.
// Rollback: at most DI_DSV41_ROLLBACK_MAX positions on V4.1 (di_dsv41_dev_rollback),
// DI_DSV4_ROLLBACK_MAX below the highest position fed on V4 (di_dsv4_dev_rollback, an MTP
// session's MTP ring with it: di_dsv4_dev_rollback_mtp), the session's bound checked before it
// (di_session_rollback_begin); the device states' own refusals: DI_ERR_INVALID, logged, nothing
// changed. Draft: di_dsv41_dev_draft on slot 0 (bit for bit di_dsv41_draft_block's
// drafts, confidences and logits), with the session's device-loss recovery.
di_status di_dsv4_session_dev_rollback(di_session *s, int32_t n);
di_status di_dsv4_session_dev_draft(di_session *s, int32_t anchor, di_dsv41_draft *out,
                                    float *logits);

typedef struct di_dsv41_draft_seq {
    di_session *s;      // borrowed: a DSpark session after a committed forward
    int32_t anchor;     // the token for position s->pos
    di_dsv41_draft out; // its drafts
} di_dsv41_draft_seq;

// Drafts a block for each of n sessions in one call on workspace ws, each bit for bit what
// di_dsv41_draft_block gives it alone: the block rows of all sessions form one ragged batch (the
// DSpark blocks' projections, mHC and MoE over all rows, attention per session), then block row j
// of every session at once through the head and the Markov head (row j + 1 needs row j's token).
// logits: when not NULL, [n, dspark_block_size, V]. DI_ERR_INVALID (a session without DSpark or
// not after a forward, an anchor out of range, a session twice), DI_ERR_NOMEM; then nothing ran.
di_status di_dsv41_draft_batch(di_model *m, di_dsv4_ws *ws, di_dsv41_draft_seq *seqs, int32_t n,
                               float *logits);
