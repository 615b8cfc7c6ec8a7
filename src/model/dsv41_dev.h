/*
 * dsv41_dev — the DeepSeek V4.1 forward with activations, window KV, compressed entries, index
 * keys and compressor state resident in one backend's memory, or in a few as pipeline stages
 * ("Pipeline stages" below) (backend/backend.h), written once
 * against the backend vtable as model/dsv4_dev.h is for V4: on the CUDA backend it is the GPU
 * forward; on the CPU backend (the oracle twin) it reproduces the model's own V4.1 CPU forward
 * (model/dsv41.c, dsv41_attn.c: di_dsv41_forward_batch) bit for bit, which tests it without a GPU
 * (tests/model/test_dev41_forward.c).
 *
 * Scope: the main layers and the head of DeepSeek V4.1 (deepseek-v41.md §2), in both precision
 * recipes (FP32 and the official one, R-OFF: every BF16 rounding, A8 in blocks of 32 before FP8 /
 * FP4 linears, the MoE's official order, BF16 index scores and attention probabilities, as ops in
 * the CPU forward's order). In both recipes, as the CPU forward: window rows are Q8 (e4m3, scale
 * per 32 over all head_dim dims), entries Q4e (e2m1, E4M3 scale per 16), index keys and index
 * queries Q4 (e2m1, scale per 32, no Hadamard). The state stores them as those codes, exactly
 * the CPU forward's packed rows (docs/kv-cache.md "Packed codes": 528, 288 and 68 bytes at
 * V4.1-Flash's 512 / 128 dims, against 2,048, 2,048 and 512 as FP32): the backend's pack_rows
 * writes them where the rows are made, attention (attn_codes: Q8 window rows, then Q4e entries)
 * and the index scores (index_scores_q4) decode them where they are read, so the values the forward
 * computes are the FP32 layout's, bit for bit; a block's I/O bytes are the CPU forward's page
 * (di_dsv41_page_bytes, "State layout"). Plain sessions run on it once attached
 * (di_dsv41_dev_attach: --device cuda), and so does the serving engine, with DSpark speculation or
 * without (engine.c: one state of max_seqs slots whose entry blocks are its kv_manager's blocks;
 * prefix hits, tail snapshots, the disk tier and KV transfers through the calls below; decode and
 * verify graphs prepared at create, di_dsv41_dev_prepare_decode / _verify). Prefix reuse (the
 * bounded replay on another sequence's cached blocks: di_dsv41_dev_seq.win_lo / n_cached), entry
 * block I/O and tail snapshots run, and so do rollback and DSpark (below). A call's greedy rows
 * (di_dsv41_dev_forward_picks: the engine's plain greedy rows) come back as their device argmax,
 * 4 bytes instead of a row of logits. Not run here: context parallelism.
 *
 * Rollback (di_dsv41_dev_rollback) of the last DI_DSV41_ROLLBACK_MAX positions: the window rings
 * hold W + DI_DSV41_ROLLBACK_MAX Q8 rows (position p in row p mod that) and a ratio-2 source's C
 * and Z rings DI_DSV41_ROLLBACK_MAX + 2 FP32 rows, so rejected rows never overwrite rows a kept
 * position reads; entries are visible by position. Host bookkeeping only.
 *
 * DSpark (deepseek-v41.md §3; di_dsv41_dev_dspark_enable, di_dsv41_dev_draft): the last stage
 * also holds the DSpark blocks (layers without compressor, indexer or Engram, uploaded when the
 * model loaded them), main_proj / main_norm, the final norm, the Markov head's projection and the
 * embedding (the draft's block rows); the Markov embedding table and the confidence head stay on
 * the host (a row and a dot per draft token). In a DSpark state every call computes the taps of
 * the target layers' inputs (the streams' mean: the collapse with pre = 1 / NC, exact for NC a
 * power of two) into [T, n_target, D], handed to the later stages with the streams when a target
 * layer is before a cut (copied from the stage before: di_backend_hand_over, a peer copy or the
 * state's own host bounce; n_target * D floats per row), and the last stage writes the DSpark
 * context rows of every row (main_x, then per block its Q8 row, packed by pack_rows into the
 * slot's DSpark ring) after the head, inside the decode graphs. The DSpark rings are stored as the
 * layers' window rings are: per DSpark block a region of Q8 code rows (win_bytes each) [max_rows
 * rows of this call | slot 0's W + DI_DSV41_ROLLBACK_MAX ring rows | slot 1's | ...]. A draft call
 * runs directly on the last stage: the block rows of all its slots in one batch, their kv packed
 * into the call rows of the block's region (not kept), key lists: the slot's DSpark ring of
 * positions [a - W, a) then its block's rows, non-causal (every row lists all of its block's);
 * attn_codes reads them with n_win = n_keys (every key a Q8 row of that region, no entries), which
 * is exactly attn over the FP32 rows of the same Q8 values the CPU forward's DSpark attention
 * reads, since the key lists, not the op, carry "ring then block, non-causal". Then per block row
 * j the head and the Markov head over all slots, their summed logits' argmax on the device
 * (argmax_rows: the drafts, n ids downloaded instead of n rows of V floats) and the confidence on
 * the host (it reads the block's hidden row and the Markov embedding; row j + 1 needs row j's
 * token). Tail snapshots carry the DSpark rings' W rows after the layers' (zero bytes in a state
 * without DSpark); a replay's start zeroes them as di_dsv41_restart does.
 *
 * Per call (V4.1 §2.1): the host keeps each slot's compressed-id history (Engram, §2.3.1: integer
 * work on the token ids) and computes every Engram layer's row ids for the call's rows. Engram
 * tables stay in host memory (the checkpoint's mapped tensors; V4.1-Flash's two are ≈203 GB, more
 * than any one GPU holds): the host copies each call's rows, codes and scales as stored, into the
 * call's staging (n_col rows per row and Engram layer: 24 x 264 bytes on V4.1-Flash, ≈12.7 KB per
 * row for both layers), uploaded with its lists; the device decodes them (embed of that gathered
 * table, exactly the table's own rows), projects them (eg_wkv) and gates them into the streams
 * (engram_gate). The layers run the single-pass mHC (mhc_pre_carried: the collapse with the pre
 * of the previous site; the head collapses with the last F_pre, no hc_head). Attention (§2.4,
 * §2.5): q without per-head RMS, the window row (Q8) into this call's rows of the layer's pool;
 * kv sources run CSA2 (m = 2: C and Z of this call's rows and the slot's pending even row pooled
 * by compress_pool without position bias; m = 1: the projection), then the index key (idx_wk of
 * the latent, norm, RoPE, Q4) and the entry (RoPE, Q4e) of every closing group are scattered into
 * their entry blocks; index sources score their kv source's keys (index_scores), the candidate
 * source builds the pool (index_cand BUILD) that later index layers apply (MASK), the top-k picks
 * scored -inf are dropped (DROP) and the top-k is published; every compressing layer attends its
 * window plus the published picks of its kv source's entries (offset_list), a layer before any
 * index source only its window. Then the window rows go into the slot's ring.
 *
 * State layout (backend memory). Window rows: one array of Q8 rows (head_dim e4m3 codes, then a
 * UE8M0 scale per 32 dims), per layer [max_rows rows of this call | slot 0's W +
 * DI_DSV41_ROLLBACK_MAX window ring rows | slot 1's | ...] (a ring's row of position p: p mod
 * W + DI_DSV41_ROLLBACK_MAX); a call's rows are packed there from their FP32 values (kept in
 * scratch), and after the attention its sequences' last rows are packed again from those values
 * into the rings (the same codes). The DSpark blocks' rings (DSpark state, last stage) are a second
 * array of the same regions, one per DSpark block. Per kv source of ratio m its entries (Q4e rows:
 * head_dim / 2 e2m1 pairs, then an E4M3 scale per 16) and its index keys (Q4 rows: index_head_dim
 * / 2 pairs, a UE8M0 scale per 32), each an array of n_blocks * E rows (block b holds E =
 * block_tokens / m of each, entry w of a sequence is row blocks[w / E] * E + w % E), and for m = 2
 * a ring of DI_DSV41_ROLLBACK_MAX + 2 FP32 rows per slot of C and of Z (row = pos mod that; FP32 as
 * the CPU forward's (C, Z) slots). Attention of layer il reads its key list's first n_win keys as
 * layer il's window rows and the rest as its kv source's entry rows (attn_codes), so the lists
 * hold the same window rows in every layer. Block I/O converts between these arrays and the CPU
 * forward's page (per kv source in layer order its E entries then its E index keys, each run at a
 * multiple of 64 bytes: di_dsv41_page_offsets; the padding reads as zeros and is not stored): a
 * block read from the device is byte for byte the page the CPU forward holds for the same positions
 * (test_dev41_forward (a)), 113,920 bytes on V4.1-Flash (128 positions, 890 a position, no
 * padding: device memory 890 a position too; 6,400 as FP32 rows). A slot's tail on V4.1-Flash:
 * 40 layers x 144 Q8 ring rows of 528 bytes + 3 ratio-2 sources x 2 x 18 FP32 rows of 2,048 bytes
 * = 3,262,464 bytes, plus 76,032 per DSpark block in a DSpark state.
 * Entry blocks are the caller's block ids (shared blocks: the serving engine's kv_manager blocks;
 * n_blocks 0: private, slot s's i-th being s * max_blocks + i). Each call uploads one staging block
 * (tokens, positions, key lists, page lists, compressor sources and destinations, Engram row ids),
 * laid out as a function of the call's shape only (rows and sequences), and every op reads its
 * lists from there.
 *
 * Graphs: a decode step (every sequence feeds one token and takes its logits, at most 64
 * sequences) and a verify step (every sequence feeds r <= DI_DSV41_ROLLBACK_MAX + 1 rows and takes
 * all their logits, at most 64 rows) run as a backend graph keyed by r and the number of
 * sequences (a ragged step runs directly): the first step of a shape runs directly, the second is
 * captured and launched, later ones launch the cached graph. This works because every scalar an op
 * gets is a function of the shape (bounds are capacities: the key list stride, the entries a slot
 * can hold, the windows a shape can close, padded with destination -1). DI_DEV_GRAPHS=0 (read at
 * state create) runs every call directly.
 *
 * Pipeline stages (di_dsv41_dev_create_stages; --device cuda:0,1,...): as dsv4_dev.h's, the
 * layers are split into n contiguous ranges at any cut, where every backend reports its memory the
 * one holding the most entry blocks on every stage (mirrors counted) for m->opt's dev_* plan, then
 * the smallest largest stage (di_dsv41_dev_split_mem: dev_common.c's DPs, DSpark's weights and
 * embedding copy on the last stage), else the weight balance (di_dsv41_dev_split), stage k on
 * backend k,
 * each holding its layers' weights (the embedding on the first, the head and final norm on the
 * last) and, in every state, their pools, rings, index keys, scratch, staging and decode graphs.
 * A call checks every stage first, then runs stage 0 from the tokens and hands the streams after
 * its last layer with the carried pre of the single-pass mHC ([T, NC, D] then [T, NC] floats) to
 * the next stage, which copies them from the previous stage's memory before its layers (as
 * dsv4_dev.h's: di_backend_hand_over, a peer copy where the two backends can peer, else through
 * the state's page-locked host buffer, allocated only when some pair of stages needs it), and so
 * on; the last runs the head and downloads the logits. Each stage gathers the
 * Engram rows of its own Engram layers from the host tables (every stage with Engram layers keeps
 * the slots' compressed-id history, so whichever stage holds one has its look-back).
 * A V4.1 layer also reads what earlier layers made: its kv source's entries and index keys
 * (persistent state, written by the source's layer each call, read by the following layers in
 * this and every later call), the top-k the last index source published and the candidate pool
 * of the candidate source (per call). A cut may fall anywhere because these are handed over too:
 * (1) mirrors: a stage whose layers read a kv source an earlier stage owns keeps a mirror of the
 * source's entry blocks and index keys (the owner's layout and block ids; no C/Z rings: only the
 * owner compresses). Each call the owner's finalise also copies the rows it finalised (n_pool
 * entries then n_pool index keys, the shape's padded count) into the source's transfer buffer,
 * which stays in the owner's memory; every mirroring stage copies it from the owner's into its own
 * (hand-over, as the streams) before its layers and packs the rows (pack_rows: the owner's codes),
 * first thing in its layers, to the destinations of its own lists (the same edst the owner used:
 * -1 for padding and cached entries), so its blocks hold the owner's bytes before any layer reads
 * them. (2) the top-k ([T, index_topk] int32) when an index source came before the cut and the
 * first compressing layer after it is no index source, and (3) the candidate pool ([T, ntb] block
 * ids, [T] counts) when the candidate source came before the cut and an index source follows:
 * copied by the next stage from the stage before the cut (its own or one it received and passes
 * on), whose have_topk / have_cand start true. All of it is handed over outside the decode graphs
 * (between the stages' launches, like the streams; each buffer one hand-over, counted by kind in
 * the graph stats) at sizes and offsets that are functions of the shape; the finalise copies and
 * the packs are in them. On V4.1-Flash's widths a decode token moves, per boundary,
 * 80 KiB of streams + 16 bytes of pre, 2.5 KiB per mirrored source read after it (an entry of 512
 * floats and an index key of 128), 2 KiB of top-k and 8 KiB of candidate pool where they cross
 * (at most ≈92.5 KiB; the rows cross as the FP32 values the codes are packed from, which the
 * mirror packs into the same codes); a mirror of a ratio-m source costs its stage 356 / m bytes per
 * cached position (288 + 68: di_dsv41_dev_block_mem_bytes). Flash's byte-optimal 3-stage split, [0,
 * 13) [13, 27) [27, 40), holds 90.8 / 96.5 / 90.7 GiB of weights (docs/cuda.md), 3 H200s. Block
 * I/O: a block's bytes are each source's runs at their page offsets (the same bytes as one stage),
 * read from the owner, written to the owner and every mirror (prefix-cache hits, the disk tier and
 * KV transfers see the same blocks on every stage); tail snapshots are the header and each stage's
 * window rings at their layer's offset, the last stage's DSpark rings after them (C/Z rings are
 * not in a snapshot, which is taken where no group is open). Graph stats count a call once (its
 * ops and uploads summed), a failed call restarts its slots on every stage.
 *
 * Owns: a di_dsv41_dev owns its stages' backend blocks (small vectors, expert arrays; weights are
 * the backends', freed with them); the backends and model are borrowed and must outlive it. A state
 * owns its pools, scratch, staging, graphs and host metadata, all sized at create. Thread-safety:
 * one thread at a time per backend.
 */
#pragma once

#include <stdbool.h>
#include <stdint.h>

#include "backend/backend.h"  // di_backend
#include "deepinfer.h"        // di_model, di_status
#include "model/dev_common.h" // di_dev_split_out
#include "model/dsv41.h"      // di_dsv41_draft, DI_DSV41_ROLLBACK_MAX

typedef struct di_dsv41_dev di_dsv41_dev;             // a V4.1 model's weights on its stages
typedef struct di_dsv41_dev_state di_dsv41_dev_state; // the device state of n_slots sequences

// Uploads every weight the main layers, the Engram modules (but their tables, which stay on the
// host) and the head use (once); the model's precision recipe is the forward's.
// DI_ERR_UNSUPPORTED (logged) for a V4 model, hash-routed layers or a weight the backend cannot
// matmul;
// DI_ERR_INVALID (no Engram token map), DI_ERR_NOMEM, DI_ERR_CUDA. m and b are borrowed.
// One stage: di_dsv41_dev_create_stages(m, &b, 1).
di_status di_dsv41_dev_create(di_model *m, di_backend *b, di_dsv41_dev **out);
void di_dsv41_dev_destroy(di_dsv41_dev *d); // NULL: no-op

// The most pipeline stages ("Pipeline stages"): the devices one di_device lists.
enum { DI_DSV41_DEV_MAX_STAGES = 8 };

// The forward as n_stages pipeline stages: stage k on backend b[k] (borrowed, must outlive d; the
// same backend may be listed more than once), its layers those of di_dsv41_dev_split_mem on the
// backends' free memory less the plan's reserve (di_dev_stage_budgets), or of di_dsv41_dev_split
// where some backend cannot say. Errors as di_dsv41_dev_create, and DI_ERR_INVALID (logged) as
// di_dsv41_dev_split, DI_ERR_NOMEM (logged) as di_dsv41_dev_split_mem.
di_status di_dsv41_dev_create_stages(di_model *m, di_backend *const *b, int32_t n_stages,
                                     di_dsv41_dev **out);
// The same on a given split: stage k holds [layer0[k], layer0[k + 1]) (layer0[0] = 0,
// layer0[n_stages] = n_layer, increasing: any cut, "Pipeline stages"). DI_ERR_INVALID (logged)
// otherwise. Tests use it to place a cut.
di_status di_dsv41_dev_create_split(di_model *m, di_backend *const *b, int32_t n_stages,
                                    const int32_t *layer0, di_dsv41_dev **out);
// The split of m's layers into n_stages contiguous ranges, the one whose largest stage is smallest
// (ties to earlier cuts), counting the bytes of the matrices with their scales and the vectors a
// stage uploads (Engram tables stay on the host: not counted), the embedding on the first stage,
// the head and final norm on the last, with DSpark loaded its blocks, heads and the embedding copy
// there too (di_dsv41_dev_split_mem without budgets): stage k holds [layer0[k], layer0[k + 1])
// (n_stages + 1 entries), stage_bytes[k] its bytes (NULL: not wanted). Host only, no backend.
// DI_ERR_INVALID (logged) for n_stages < 1, > DI_DSV41_DEV_MAX_STAGES or > n_layer; DI_ERR_NOMEM.
di_status di_dsv41_dev_split(const di_model *m, int32_t n_stages, int32_t *layer0,
                             int64_t *stage_bytes);
// The KV-aware split (dev_common.h di_dev_split_mem; docs/cuda.md "The split") of m's layers
// into n_stages for the state m->opt's dev_* fields plan (di_model_options; their zeros the
// engine's defaults) on stages of budget_bytes[k] (free memory less the plan's reserve; NULL:
// unknown, the weight balance of di_dsv41_dev_split), counting each stage's weights (DSpark's
// blocks, heads and embedding copy on the last stage when the model loaded them), the entries and
// index keys of the kv sources it owns or mirrors per block, and its slots' tails (the DSpark
// rings with dev_spec), call rows and scratch. di_dsv41_dev_create_stages uses it with the
// backends' mem_info. DI_ERR_INVALID (logged) as di_dsv41_dev_split; DI_ERR_NOMEM (logged: the
// stage and its bytes) when the best split leaves some stage unable to hold its weights, fixed
// state and one max-context sequence's blocks, or out of host memory.
di_status di_dsv41_dev_split_mem(const di_model *m, int32_t n_stages, const int64_t *budget_bytes,
                                 di_dev_split_out *out);
// What a stage holding layers [l0, l1) (0 <= l0 < l1 <= n_layer) costs for m's plan: the table
// di_dsv41_dev_split_mem optimises over. Host only.
void di_dsv41_dev_stage_cost(const di_model *m, int32_t l0, int32_t l1, di_dev_stage_cost *out);
int32_t di_dsv41_dev_n_stages(const di_dsv41_dev *d);
// Stage k's backend (borrowed) and its layers [*l0, *l1); NULL (nothing written) for no stage k.
di_backend *di_dsv41_dev_stage(const di_dsv41_dev *d, int32_t k, int32_t *l0, int32_t *l1);

// The least common multiple of the compress ratios rounded up to at least the window: the
// default block size of a state.
int32_t di_dsv41_dev_block_tokens(const di_dsv41_dev *d);

// The state of n_slots sequences of up to n_ctx positions each, for calls of up to max_rows rows,
// with n_blocks entry blocks of block_tokens positions (0: the default). n_blocks > 0: shared
// blocks, listed by each call (di_dsv41_dev_seq.blocks: ids in [0, n_blocks)); n_blocks 0:
// private blocks. Every slot starts empty. DI_ERR_INVALID (counts < 1, n_blocks < 0, block_tokens
// not a multiple of every ratio, index overflow; logged), DI_ERR_NOMEM.
di_status di_dsv41_dev_state_create(di_dsv41_dev *d, int32_t n_slots, int32_t n_ctx,
                                    int32_t max_rows, int32_t n_blocks, int32_t block_tokens,
                                    di_dsv41_dev_state **out);
void di_dsv41_dev_state_destroy(di_dsv41_dev_state *s); // NULL: no-op

// The bytes of one entry block's I/O (block_bytes: the CPU forward's page, di_dsv41_page_bytes:
// per kv source in layer order its E = block_tokens / m Q4e entries, then its E Q4 index keys,
// each run at a multiple of 64 bytes; V4.1-Flash 113,920 at 128 positions) and the backend bytes
// of one slot's tail (slot_bytes: the W + DI_DSV41_ROLLBACK_MAX Q8 window ring rows of every layer,
// the ratio-2 sources' C and Z rings of DI_DSV41_ROLLBACK_MAX + 2 FP32 rows each; not the DSpark
// rings of a DSpark state, which the engine adds) for blocks of block_tokens positions. A block's
// backend memory is di_dsv41_dev_block_mem_bytes (the codes without the page's padding). The call
// rows and scratch (max_rows) are not included. DI_ERR_INVALID (block_tokens not a positive
// multiple of every ratio).
di_status di_dsv41_dev_sizes(const di_dsv41_dev *d, int32_t block_tokens, int64_t *block_bytes,
                             int64_t *slot_bytes);
// Backend bytes one entry block takes over all stages (mem_bytes) and on each (stage_bytes[k],
// NULL: not wanted): every kv source's E entries and E index keys as codes (E * (Dh / 2 + Dh / 16
// + DI / 2 + DI / 32) bytes, no padding) on its owner, again on each stage mirroring it ("Pipeline
// stages"). One stage: block_bytes less the page's padding (none on V4.1-Flash). What a serving
// engine divides its KV memory by.
// DI_ERR_INVALID as di_dsv41_dev_sizes.
di_status di_dsv41_dev_block_mem_bytes(const di_dsv41_dev *d, int32_t block_tokens,
                                       int64_t *mem_bytes, int64_t *stage_bytes);
int32_t di_dsv41_dev_state_n_blocks(const di_dsv41_dev_state *s);
// Backend bytes the state allocated (pools, rings, index keys, scratch, staging) with its host
// staging; its entry blocks are di_dsv41_dev_state_n_blocks.
int64_t di_dsv41_dev_state_bytes(const di_dsv41_dev_state *s);
// The backend of the last stage (borrowed), where the logits come from: e.g. for host_alloc of the
// buffers logits go to.
di_backend *di_dsv41_dev_backend(const di_dsv41_dev *d);
// Entry block I/O (the prefix cache's disk tier): one entry block's contents as the CPU forward's
// page (di_dsv41_dev_sizes' block_bytes: the stored codes at di_dsv41_page_offsets, the padding
// read as zeros and not written), to and from host memory, so a block read from one state writes
// identically into any state of a dev of the same model and recipe, and holds the bytes of the
// CPU forward's page of the same positions. read copies
// block `block` into dst and syncs; write copies src into it (returns when src may be reused).
// Not inside a call. DI_ERR_INVALID (no such block; logged), DI_ERR_CUDA.
di_status di_dsv41_dev_state_read_block(const di_dsv41_dev_state *s, int32_t block, void *dst);
di_status di_dsv41_dev_state_write_block(di_dsv41_dev_state *s, int32_t block, const void *src);

// Tail snapshots (docs/kv-cache.md "Tail snapshots"): at a position that is a multiple of every
// compress ratio (no ratio-2 group open) a slot's future reads only its entry blocks, its window
// rings and its Engram history (a function of the tokens). di_dsv41_dev_tail_bytes: a 16-byte
// header (position, rings: layers + the model's DSpark blocks, window, head_dim) then every
// layer's W window ring rows, then every DSpark block's, as Q8 codes (head_dim + head_dim / 32
// bytes each; positions pos - W .. pos - 1, zero bytes for those below 0), in ring order (row =
// position mod W; the state's rings are longer, di_dsv41_dev_rollback).
size_t di_dsv41_dev_tail_bytes(const di_dsv41_dev *d);
// Copies slot `slot`'s tail at its current position into dst and syncs. DI_ERR_INVALID (slot out
// of range or failed, a position that is no multiple of every ratio; logged), DI_ERR_CUDA.
di_status di_dsv41_dev_tail_save(di_dsv41_dev_state *s, int32_t slot, void *dst);
// Whether src (di_dsv41_dev_tail_bytes) is a snapshot of d's states at position pos (its header,
// and pos a multiple of every ratio; restore checks the same): DI_OK or DI_ERR_INVALID (not
// logged). Host only, any thread.
di_status di_dsv41_dev_tail_check(const di_dsv41_dev *d, int32_t pos, const void *src);
// Puts a snapshot taken at position pos (any slot of any state of the same dev) into slot `slot`
// with the tokens of positions [0, pos) (the Engram history): the slot then continues at pos
// exactly as the one that saved it, its next call passing pos and blocks holding the entries of
// the positions before pos. DI_ERR_INVALID (slot or position out of range, not a snapshot of this
// dev at pos; nothing changes), DI_ERR_CUDA (the slot must restart at 0).
di_status di_dsv41_dev_tail_restore(di_dsv41_dev_state *s, int32_t slot, int32_t pos,
                                    const void *src, const int32_t *tokens);

typedef struct di_dsv41_dev_seq {
    int32_t slot, pos, n_tok;
    // Shared blocks: the sequence's entry block ids in position order, n_blocks >= ceil((pos +
    // n_tok) / block_tokens) of them (borrowed for the call). Private blocks: NULL, 0.
    const int32_t *blocks;
    int32_t n_blocks;
    // Prefix reuse (the bounded replay of docs/kv-cache.md, as di_dsv41_restart): a call at pos ==
    // win_lo > 0 starts the slot afresh there, on blocks whose first n_cached positions' entries
    // and index keys another sequence computed (n_cached a multiple of block_tokens, win_lo <=
    // n_cached); prefix then holds the tokens of positions [0, win_lo) (borrowed for the call:
    // the Engram look-back). As the CPU forward after di_dsv41_restart, the window rows of
    // positions before win_lo are zero rows (attended as such), and a group closing with entry
    // index < n_cached / m leaves its entry and index key untouched, so cached blocks are never
    // written. Later calls pass the same win_lo and n_cached. 0, 0, NULL: none.
    int32_t win_lo, n_cached;
    const int32_t *prefix;
} di_dsv41_dev_seq;

// A ragged batch: seqs[i] feeds its n_tok tokens (host ids; rows concatenated in seqs order) at
// positions pos.. of slot `slot`; pos must be 0 or win_lo > 0 (starts the slot afresh) or the
// tokens the slot has consumed. Logits of the rows listed in logit_rows (ascending) go to host
// logits [n, V]. DI_ERR_INVALID for bad slots (out of range or repeated), positions, token ids, row
// counts, blocks (missing, out of range, a block one sequence writes listed by another), replay
// parameters or logit rows, checked before any work (logged; nothing changes). A backend error
// (DI_ERR_CUDA, DI_ERR_NOMEM) leaves the call's slots to be restarted at pos 0.
di_status di_dsv41_dev_forward(di_dsv41_dev_state *s, const di_dsv41_dev_seq *seqs, int32_t n_seq,
                               const int32_t *tokens, const int32_t *logit_rows,
                               int32_t n_logit_rows, float *logits);
// di_dsv41_dev_forward with greedy rows: logit row k with greedy[k] != 0 crosses to the host as
// its argmax only, picks[k] (host [n_logit_rows]; exactly sample/sampler.h di_argmax of the row
// the plain call downloads), its row of logits left as it was; the other rows' logits as
// di_dsv41_dev_forward (one download per run of consecutive such rows). The greedy picks cost
// one argmax_rows op per head chunk after the head (after a decode graph's launch: the graphs are
// the same) and 4 bytes a row instead of 4 V. greedy NULL: the plain call. DI_ERR_INVALID also
// for greedy without picks; errors as di_dsv41_dev_forward.
di_status di_dsv41_dev_forward_picks(di_dsv41_dev_state *s, const di_dsv41_dev_seq *seqs,
                                     int32_t n_seq, const int32_t *tokens,
                                     const int32_t *logit_rows, int32_t n_logit_rows, float *logits,
                                     const uint8_t *greedy, int32_t *picks);

// Takes back the last n positions slot `slot` consumed (rejected speculative tokens,
// deepseek-v41.md §5.3; di_dsv41_rollback's device twin): afterwards the slot is exactly the state
// of a run that never fed them (the argument is at the function, dsv41_dev.c), its next call
// passing the new position. Host only (no backend work). DI_ERR_INVALID (logged; nothing changes)
// for a slot out of range or failed, n < 0, n > DI_DSV41_ROLLBACK_MAX, a position below the
// slot's last start (pos 0, a replay's win_lo, a tail restore's pos: the rings hold nothing older)
// or more than DI_DSV41_ROLLBACK_MAX below the highest position fed since (successive rollbacks
// with calls between: the rejected rows overwrote ring rows the calls after do not give back).
di_status di_dsv41_dev_rollback(di_dsv41_dev_state *s, int32_t slot, int32_t n);

// ---- DSpark (deepseek-v41.md §3; "DSpark" above) ----

// Makes every later call of the state a DSpark one (the device twin of a session created with
// mtp): each forward writes the taps of its rows and the DSpark context rows of every position it
// feeds into its slots' DSpark rings, and di_dsv41_dev_draft drafts. Decode graphs captured
// before are dropped (captured again with the taps and context rows). Call it before the slots
// hold positions (their DSpark rings start empty). No-op when on. DI_ERR_INVALID (logged: the
// model was loaded without its DSpark blocks, or a draft call's lists cannot fit the staging),
// DI_ERR_UNSUPPORTED (hc_mult not a power of two), DI_ERR_NOMEM, DI_ERR_CUDA.
di_status di_dsv41_dev_dspark_enable(di_dsv41_dev_state *s);
bool di_dsv41_dev_dspark_on(const di_dsv41_dev_state *s);

typedef struct di_dsv41_dev_draft_seq {
    int32_t slot;       // a slot after a committed call (position a >= 1)
    int32_t anchor;     // the token for position a (the target's pick after the last call)
    di_dsv41_draft out; // its drafts (model/dsv41.h)
} di_dsv41_dev_draft_seq;

// Drafts a DSpark block for each of n slots in one call (di_dsv41_draft_batch's twin, bit for bit
// its drafts, confidences and logits): the n * dspark_block_size block rows run the DSpark blocks
// on the last stage in one batch, then block row j of every slot at once through the head, the
// Markov head and the drafts' argmax on the device (argmax_rows: n ids downloaded, not n rows of
// logits; the confidence head on the host, row j + 1 needs row j's token). Runs directly (no
// graph), changes no slot. logits: when not NULL, [n, dspark_block_size, V], downloaded too (a
// row each: tests). DI_ERR_INVALID (logged: DSpark off, n outside 1 .. 64 or more block
// rows than max_rows, a slot out of range, repeated or at position 0, an anchor outside the
// vocabulary; nothing ran), DI_ERR_CUDA, DI_ERR_NOMEM.
di_status di_dsv41_dev_draft(di_dsv41_dev_state *s, di_dsv41_dev_draft_seq *seqs, int32_t n,
                             float *logits);

// Tokens slot `slot` has consumed (-1 after a failed call: restart it at pos 0).
int32_t di_dsv41_dev_n_past(const di_dsv41_dev_state *s, int32_t slot);

// ---- model wiring ----

// Creates the model's V4.1 dev forward on backend b (borrowed; must outlive m) and attaches it
// (m->dev41): sessions then run di_session_forward through a 1-slot state of their n_ctx_max
// made at their first call (model/dsv4.c); they save a token state that restore replays (on the
// device or the CPU; model/dsv4_state.c "token states") and replay their tokens after a lost
// device, as V4's; their batched calls are refused. DSpark sessions (mtp) make that state with
// DSpark on (di_dsv41_dev_dspark_enable) and draft (di_session_draft: di_dsv41_dev_draft) and
// roll back (di_session_rollback: di_dsv41_dev_rollback, at most DI_DSV41_ROLLBACK_MAX) on it;
// a replay rebuilds their DSpark rings too. di_model_load
// calls it with the CUDA backend for --device cuda; tests with the CPU backend. Errors as
// di_dsv41_dev_create (nothing attached); DI_ERR_INVALID when one is attached already.
di_status di_dsv41_dev_attach(di_model *m, di_backend *b);
// The same with n_stages pipeline stages on b[0..n_stages-1] (di_dsv41_dev_create_stages; --device
// cuda:0,1,...; the split from the backends' memory). Errors as di_dsv41_dev_create_stages.
di_status di_dsv41_dev_attach_stages(di_model *m, di_backend *const *b, int32_t n_stages);

// Calls so far: run directly, captured into a graph (then launched), launched from a cached graph;
// graphs cached now. The last call's costs: the ops it enqueued (embed to the head's matmul; a
// launched graph counts the ops it captured; a replay's ring zeroing, the downloads and the sync
// not counted) and its host-to-backend uploads and their bytes (a decode step: one upload, and
// the same ops whatever its number of sequences). The pipeline stages' hand-overs as dsv4_dev.h's
// (one per buffer copied into a stage: so far by kind, peer or through the host bounce, which is
// also an upload of the last call; the last call's bytes handed over). The bytes of results
// downloaded (logits, greedy picks, a draft call's picks and logits asked for; not the hidden
// rows a draft call reads back, snapshots or KV transfers): the last call's (a forward or a draft
// call) and every call's so far.
typedef struct di_dsv41_dev_graph_stats {
    int64_t n_direct, n_captured, n_replayed;
    int32_t n_cached;
    int64_t last_ops, last_uploads, last_upload_bytes;
    int64_t n_handover_peer, n_handover_host, last_handover_bytes;
    int64_t last_download_bytes, n_download_bytes;
} di_dsv41_dev_graph_stats;
void di_dsv41_dev_get_graph_stats(const di_dsv41_dev_state *s, di_dsv41_dev_graph_stats *out);
// Runs and captures the decode graph of every size 1..min(max_seqs, n_slots, 64): two decode steps
// of token 0 at position 0 on slots 0..n-1 per size (the slots are left at position 1: restart
// them at 0). With shared blocks every slot lists block 0 as cached (n_cached = block_tokens: the
// steps write no entry, block 0 is left as it was). No-op with graphs off (DI_DEV_GRAPHS=0).
// Not inside a call. Errors as di_dsv41_dev_forward (and DI_ERR_NOMEM for its host scratch).
di_status di_dsv41_dev_prepare_decode(di_dsv41_dev_state *s, int32_t max_seqs);
// The same for verify steps (every sequence r rows, every row's logits: a speculative verify of
// r - 1 drafts, for every r in 2 .. min(max_rows, DI_DSV41_ROLLBACK_MAX + 1, block_tokens) and
// every number of sequences up to max_seqs, the slots and n * r <= 64 rows): two steps each of
// token 0 at position 0 (block 0 listed as cached, as above; the slots are left at position r:
// restart them at 0). Such steps later launch their graph. Errors as di_dsv41_dev_prepare_decode.
di_status di_dsv41_dev_prepare_verify(di_dsv41_dev_state *s, int32_t max_seqs, int32_t max_rows);
