/*
 * dsv4_dev — the DeepSeek V4 forward with activations, KV and compressor state resident in the
 * memory of one backend, or of a few as pipeline stages ("Pipeline stages" below)
 * (backend/backend.h), written once against the backend vtable: on the CUDA
 * backend it is the GPU forward; on the CPU backend (the oracle twin) it must reproduce the
 * model's own CPU forward (di_session_forward), which tests its orchestration without a GPU
 * (tests/model/test_dev_forward.c).
 *
 * Scope: DeepSeek V4 (V4.1: model/dsv41_dev.h), the main layers, the head and the MTP block ("MTP"
 * below), in both precision recipes: FP32 and the official one (R-OFF, spec §2.0), where every
 * rounding point of the CPU forward (BF16 roundings, A8 before FP8/FP4 linears, the KV rows' Q8,
 * the indexer's Hadamard + Q4, BF16 scores and attention probabilities, the MoE's order) is an op
 * of its own, in the same order. KV rows are FP32 in the FP32 recipe; in R-OFF they hold Q8-exact
 * values and are stored as the FP8 KV rows of backend.h kv_quant (584 bytes at V4's head_dim 512,
 * lossless), attention reading them with attn_kv. Likewise the CSA indexer's compressed keys: FP32
 * rows in the FP32 recipe; in R-OFF Q4-rounded (spec §2.5, e = Q4(WHT(e), 32)) and stored as their
 * Q4 codes (backend.h pack_rows: e2m1 pairs and a UE8M0 scale per DI_BACKEND_KEY_BLOCK dims, 68
 * bytes at V4's index_head_dim 128 instead of 512, lossless; the spec's §3.3 layout, V4.1's index
 * key format), scored by index_scores_q4, which decodes each key exactly and scores it as
 * index_scores scores the FP32 key (the same bits).
 *
 * State layout (backend memory). Compressed entries live in entry blocks of block_tokens
 * positions (a multiple of every compress ratio; the serving engine's KV blocks: their ids are the
 * engine's kv_manager block ids, so admission, preemption, reference counts and the prefix cache
 * govern them directly); in a compressing layer of ratio m, block b holds E = block_tokens / m
 * entries, and entry w of a sequence is entry w % E of block blocks[w / E]. Per layer:
 *   - one KV pool of Dh-float rows (R-OFF: kv_row_bytes-byte KV rows): [max_rows rows of this call
 * | slot 0's W window ring rows | slot 1's | ... | block 0's E entries | block 1's | ...], so one
 * attention call addresses this call's kv rows, every slot's window ring (row = pos mod W) and
 * every entry by row index;
 *   - CSA layers: the indexer's keys [n_blocks * E] (FP32 rows of DI floats, or R-OFF's Q4 codes
 * of di_dsv4_dev_state_index_key_bytes), block b's from b * E;
 *   - compressing layers: per compressor a token ring per slot, R = c*m rows (c = 2 with overlap,
 *     1 for HCA) of c*d floats for C and for Z (Z with its position bias), row = pos mod R.
 * The window rings, the token rings and the call rows are the fixed "tail" of each slot (sized at
 * create for n_slots); only the entries are paged. Each slot has a page table on the backend (its
 * blocks in position order, max_blocks = ceil(n_ctx / block_tokens) of them) and a host mirror:
 * each call lists every sequence's blocks, the entries that differ from the mirror go into the
 * call's one upload and one scatter_rows of 1-word rows applies them; offset_list (key lists) and
 * index_scores (indexer keys) translate entries to rows through it. A state created with private
 * blocks (n_blocks 0: sessions) owns n_slots * max_blocks blocks, slot s's i-th being
 * s * max_blocks + i, fixed at create (no updates).
 * Prefix reuse (docs/kv-cache.md): a sequence may start at win_lo > 0 on blocks whose first
 * n_cached positions' entries another sequence computed (the prefix cache): it replays positions
 * win_lo.., takes no window key before win_lo, and a window closing with entry index
 * < n_cached / m is pooled but not stored (destination -1), so a cached block's device contents
 * are never written again (nothing else writes a full block's entries).
 * The compressor has no sequential state machine: for every window closing in a call the host
 * lists the token row of each slot (this call's rows, or the ring for earlier positions; the
 * overlap of window 0 is absent), compress_pool pools them, the entries are normalised, rotated
 * and scattered into their pool, and only then the call's last tokens go into the ring. Key lists:
 * the host lists each row's window rows (O(rows x W) integers); the backend appends the HCA
 * entries (a range) or the indexer's top-k for CSA (offset_list). Every per-call list, the tokens
 * and the positions are packed into one staging buffer and go to the backend in one upload; each
 * ring update (window, compressor C and Z) is one scatter_rows for all sequences, so a step's ops
 * do not depend on the number of sequences.
 *
 * Graphs: a decode step (every sequence feeds r tokens, r = 1, or r = 2: a verify of one MTP
 * draft, and takes the logits of every row; at most 64 rows; with shared blocks, at most as many
 * page table entries changed as sequences) runs as a backend graph (backend.h graph_*; CUDA graphs
 * on the GPU) keyed by its number of sequences and r: the first step of a shape runs directly (a
 * shape seen once never pays for a capture), the second is captured and launched, every later one
 * launches the cached graph, whatever its slots and positions. A state keeps one graph per shape up
 * to min(n_slots, 64) sequences, never evicted; di_dsv4_dev_prepare_decode (r = 1) and
 * di_dsv4_dev_prepare_verify (r = 2) capture them up front (the serving engine does, so that no
 * step captures or allocates). A step mixing shapes (a verify beside a plain decode or a prefill
 * chunk) runs directly. This works because every host scalar
 * an op gets is a function of the call's shape (rows per sequence, logit rows), never of its
 * positions: everything that moves with the positions is backend data the host rewrites before the
 * launch (tokens, positions, key lists and counts, compressor sources, entry positions, scatter
 * sources and destinations, the page table updates: one per sequence, padded with destination
 * -1; packed at offsets that are functions of the shape too);
 * position-dependent bounds are capacities (attention's max_keys = the key list stride, the
 * indexer's max_vis = the entries a sequence can have) and the compressor pools the most windows
 * the shape can close, the others being padding (no rows: entry 0, destination -1: not scattered).
 * Prefill and mixed calls run directly, through the same ops, with any number of page table
 * updates; so does a decode step needing more than one per sequence (e.g. a replay's first token
 * after a prefix hit, on blocks its slot never listed; counted: n_direct_pages). A capture that
 * fails (nothing ran) logs a WARN, runs the step directly and turns graphs off for the state.
 * DI_DEV_GRAPHS=0 (read at state create) runs every call directly: the debug switch to compare.
 *
 * MTP (spec §2.10; di_dsv4_dev_mtp_enable uploads the block; the states made afterwards with it):
 * the MTP block is one more layer (index n_layer) with its own KV pool of this call's rows and a
 * window ring per slot (ratio 0: no entries), its own lists (a ratio-0 class) and position per
 * slot. A main call's residual streams stay in the state's x scratch after it (the head only reads
 * them); di_dsv4_dev_mtp_forward then runs the block on any of those rows (the engine: the kept
 * ones, after sampling, each with the token after it): the rows gathered (scatter_rows), the input
 * e_proj . RMSNorm(embed) + h_proj . RMSNorm(stream) through existing ops (the stream add is
 * mhc_post over NC * T one-stream rows with post = comb = 1: x + e exactly), the block, the head
 * with the MTP's mHC and norm. A state made with kept streams (di_dsv4_dev_state_create_spec: a
 * session's, whose MTP position waits for the next call's first token, dsv4.c "sessions on the
 * device-resident forward") also keeps each slot's last back_max + 1 positions' main streams in x
 * after the call rows (one scatter_rows after every main call, outside its graph), which an MTP
 * call reads by position (x_rows DI_DSV4_DEV_X_KEPT): the pending position of an earlier call, or
 * the one a rollback leaves pending. MTP calls run directly (no graph); a step in which every
 * sequence verifies is decode-shaped (r = 2, "Graphs").
 *
 * Rollback (di_dsv4_dev_rollback, di_dsv4_dev_rollback_mtp): a state takes back up to back_max
 * rows (di_dsv4_dev_state_create_spec; 1 for di_dsv4_dev_state_create: the engine's rejected
 * verify row), below the highest position the slot's rings were written at since its start, not
 * per call (the rows fed again after a rollback do not give back the ones the taken-back rows
 * overwrote). Every ring of such a state is back_max - 1 rows longer per slot than it reads (the
 * window rings W + back_max - 1 rows, the compressor token rings c m + back_max - 1; row =
 * position mod its rows), and a call writes the last min(n_tok, rows) of them; the argument that a
 * rollback leaves no trace in the rings and entries is at stage_rollback. With back_max 1 the
 * layout is the one above (W-row window rings, c m-row token rings).
 *
 * Tail snapshots (docs/kv-cache.md): at a position pos that is a multiple of every compress ratio
 * (a block boundary) a slot's future reads only the entries (in blocks), the last W - 1 rows of
 * its window rings (the MTP block's included, when enabled) and, for a compressor with overlapping
 * windows, the last m rows of its token rings (the next window's overlap). di_dsv4_dev_tail_save
 * gathers those rows on the backend (copy) into a staging block and downloads them once;
 * di_dsv4_dev_tail_restore uploads them and copies them into another (or the same) slot's rings at
 * the same ring rows (row = position mod ring size), then sets the slot's host bookkeeping to a
 * slot that consumed pos tokens: n_past pos, win_lo 0; its page table stays (the next call lists
 * the blocks and writes the entries that differ, like any call; a decode-shaped first call that
 * changes more than one runs directly, counted in n_direct_pages). Nothing else is per slot: decode
 * graphs read positions, key lists and page tables from the per-call upload, so a restored slot
 * decodes through the same cached graphs.
 *
 * Entry block I/O (di_dsv4_dev_state_read_block / _write_block): one entry block's contents to and
 * from host memory, exactly (the layout at the functions); the serving engine's disk tier writes
 * evicted blocks back and reads cached ones in through them, between forward calls
 * (docs/kv-cache.md, "Disk tier", "On the device-resident forward").
 *
 * Pipeline stages (di_dsv4_dev_create_stages; --device cuda:0,1,...): for a model larger than one
 * device the layers are split into n contiguous ranges, chosen when the stages are created (the
 * weights go up once): where every backend reports its memory (backend.h mem_info), the split
 * that holds the most entry blocks on every stage for the state m->opt's dev_* fields plan, then
 * the smallest largest stage (di_dsv4_dev_split_mem, docs/cuda.md "The split"); else the one of
 * about equal weight bytes (di_dsv4_dev_split), stage k on backend k. Each stage is what the
 * forward is on one backend for its layers: their weights (the embedding on the first stage, and on
 * the last when the MTP block is enabled; the head, final norm and head mHC, and the MTP block, on
 * the last) and, in every state, their pools, rings, page tables, scratch, staging and decode
 * graphs (keyed as above, one set per stage). A call checks every stage first (nothing runs if one
 * refuses), then runs stage 0 from the tokens, hands the streams after its last layer ([T, NC, D]
 * floats) to the next stage, which copies them from the previous stage's memory before its layers
 * (di_backend_hand_over: a device-to-device peer copy where the two backends can peer, i.e. two
 * CPU backends, one GPU listed twice or two GPUs with peer access, ordered by events between the
 * two streams; else downloaded into the state's page-locked host buffer and uploaded, two PCIe
 * trips; allocated only when some boundary needs it), and so on; the last stage runs the head and
 * downloads the logits. The hand-overs sit between the stages' launches, outside the decode graphs
 * (a capture holds no peer copy), and are counted by kind in the graph stats. Stages run one after
 * another (no overlap, no micro-batches: each stage's step ends with its sync), so a token's
 * latency is that of one device reading all the weights, plus one hand-over per stage boundary.
 * Every other function dispatches over the stages: sizes and bytes are sums (each stage has its own
 * page tables), an entry block's host bytes are the stages' parts in stage order, i.e. the layers'
 * in layer order, the same bytes as one stage (the disk tier and the KV transfer do not see the
 * split), a tail snapshot is the header once and then the stages' parts (the same bytes as one
 * stage too), rollback and the slots' bookkeeping apply on every stage, the MTP block runs on the
 * last stage only, and graph stats count a call once (its ops and uploads summed over the stages).
 * A failed call restarts its slots on every stage.
 *
 * Owns: a di_dsv4_dev owns its backend blocks (small vectors, expert arrays; weights are the
 * backend's, freed with it); the backends and model are borrowed and must outlive it. A state owns
 * its pools, scratch and host metadata, all sized at create (nothing is allocated per step; the
 * CPU backend grows its own op scratch on first use of a size). Thread-safety: one thread at a
 * time per backend (all states of one dev share the backends' streams).
 */
#pragma once

#include <stdint.h>

#include "backend/backend.h"  // di_backend
#include "deepinfer.h"        // di_model, di_status
#include "model/dev_common.h" // di_dev_split_out, di_dev_stage_cost

typedef struct di_dsv4_dev di_dsv4_dev;             // a model's weights on its stages' backends
typedef struct di_dsv4_dev_state di_dsv4_dev_state; // KV + compressor state of n_slots sequences

// The most pipeline stages ("Pipeline stages"): the devices one di_device lists.
enum { DI_DSV4_DEV_MAX_STAGES = 8 };

// Uploads every weight the main layers and the head use (once); the model's precision recipe
// (m->opt.precision) is the forward's. DI_ERR_UNSUPPORTED (logged) for V4.1 models (their
// device-resident forward is model/dsv41_dev.h) or a weight the
// backend cannot matmul;
// DI_ERR_NOMEM, DI_ERR_CUDA. m and b are borrowed. One stage: di_dsv4_dev_create_stages(m, &b, 1).
di_status di_dsv4_dev_create(di_model *m, di_backend *b, di_dsv4_dev **out);
// The forward as n_stages pipeline stages ("Pipeline stages"): stage k on backend b[k] (borrowed,
// must outlive d; the same backend may be listed more than once), its layers those of
// di_dsv4_dev_split_mem on the backends' free memory less the plan's reserve, or of
// di_dsv4_dev_split where some backend cannot say. Errors as di_dsv4_dev_create, DI_ERR_INVALID
// (logged) for n_stages < 1, > DI_DSV4_DEV_MAX_STAGES or > n_layer, DI_ERR_NOMEM (logged) as
// di_dsv4_dev_split_mem.
di_status di_dsv4_dev_create_stages(di_model *m, di_backend *const *b, int32_t n_stages,
                                    di_dsv4_dev **out);
void di_dsv4_dev_destroy(di_dsv4_dev *d); // NULL: no-op
// The backend of the last stage (borrowed), where the logits come from: e.g. for host_alloc of
// the buffers logits go to.
di_backend *di_dsv4_dev_backend(const di_dsv4_dev *d);
int32_t di_dsv4_dev_n_stages(const di_dsv4_dev *d);
// Stage k's backend (borrowed) and its layers [*l0, *l1); NULL (nothing written) for no stage k.
di_backend *di_dsv4_dev_stage(const di_dsv4_dev *d, int32_t k, int32_t *l0, int32_t *l1);
// The split of m's layers into n_stages contiguous ranges of about equal weight bytes: of all
// splits with at least one layer per stage, the one whose largest stage is smallest (ties to
// earlier cuts), counting the host bytes of the matrices with their scales and the vectors
// a stage uploads, the embedding on the first stage, the head, final norm and head mHC on the
// last (the MTP block and its embedding copy only with m->opt.dev_spec; di_dsv4_dev_split_mem
// without budgets): stage k holds [layer0[k], layer0[k + 1]) (layer0: n_stages + 1
// entries), stage_bytes[k] its bytes (NULL: not wanted). Host only, no backend: `deepinfer info`
// and the sizing of a deployment use it. DI_ERR_INVALID (logged) as di_dsv4_dev_create_stages,
// DI_ERR_NOMEM.
di_status di_dsv4_dev_split(const di_model *m, int32_t n_stages, int32_t *layer0,
                            int64_t *stage_bytes);

// The KV-aware split (dev_common.h di_dev_split_mem; docs/cuda.md "The split") of m's layers
// into n_stages for the state m->opt's dev_* fields plan (di_model_options; their zeros the
// engine's defaults) on stages of budget_bytes[k] (free memory less the plan's reserve; NULL:
// unknown, the weight balance of di_dsv4_dev_split), counting each stage's weights (with dev_spec
// and an MTP block loaded, the MTP block, its projections and the embedding copy on the last
// stage), its layers' entries and indexer keys per block, and its slots' tails (the MTP ring with
// dev_spec), call rows and scratch. di_dsv4_dev_create_stages uses it with the backends'
// mem_info. DI_ERR_INVALID (logged) as di_dsv4_dev_split; DI_ERR_NOMEM (logged: the stage and its
// bytes) when the best split leaves some stage unable to hold its weights, fixed state and one
// max-context sequence's blocks, or out of host memory.
di_status di_dsv4_dev_split_mem(const di_model *m, int32_t n_stages, const int64_t *budget_bytes,
                                di_dev_split_out *out);
// What a stage holding layers [l0, l1) (0 <= l0 < l1 <= n_layer) costs for m's plan: the table
// di_dsv4_dev_split_mem optimises over. Host only.
void di_dsv4_dev_stage_cost(const di_model *m, int32_t l0, int32_t l1, di_dev_stage_cost *out);

// The state of n_slots sequences of up to n_ctx positions each, for calls of up to max_rows rows
// in total, with n_blocks entry blocks of block_tokens positions ("State layout"). n_blocks > 0:
// shared blocks, listed by each call (di_dsv4_dev_seq.blocks: ids in [0, n_blocks)); n_blocks 0:
// private blocks (n_slots * ceil(n_ctx / block_tokens), identity). block_tokens 0: the default
// (di_dsv4_dev_block_tokens). Every slot starts empty. With the MTP block when d has it enabled,
// rollbacks of one row, no kept streams (di_dsv4_dev_state_create_spec {d's MTP, false, 1}).
// DI_ERR_INVALID (counts < 1, n_blocks < 0, block_tokens not a multiple of every ratio, index
// overflow; logged), DI_ERR_NOMEM.
di_status di_dsv4_dev_state_create(di_dsv4_dev *d, int32_t n_slots, int32_t n_ctx, int32_t max_rows,
                                   int32_t n_blocks, int32_t block_tokens, di_dsv4_dev_state **out);
// What a state is made for beyond plain calls ("MTP", "Rollback"): mtp, the MTP block's window
// ring per slot (d's block enabled first); keep_streams (with mtp), every slot's last back_max + 1
// main streams kept for MTP calls (x_rows DI_DSV4_DEV_X_KEPT); back_max, the rows a rollback may
// take back, 1 .. DI_DSV4_ROLLBACK_MAX (model/dsv4.h: 8; 0: 1), every ring back_max - 1 rows
// longer. A V4 MTP session's state: {true, true, DI_DSV4_ROLLBACK_MAX}.
typedef struct di_dsv4_dev_spec {
    bool mtp, keep_streams;
    int32_t back_max;
} di_dsv4_dev_spec;
// di_dsv4_dev_state_create for spec (borrowed for the call). DI_ERR_INVALID also for back_max
// outside [0, DI_DSV4_ROLLBACK_MAX], mtp on a dev without its MTP block, keep_streams without mtp
// (logged).
di_status di_dsv4_dev_state_create_spec(di_dsv4_dev *d, int32_t n_slots, int32_t n_ctx,
                                        int32_t max_rows, int32_t n_blocks, int32_t block_tokens,
                                        const di_dsv4_dev_spec *spec, di_dsv4_dev_state **out);
void di_dsv4_dev_state_destroy(di_dsv4_dev_state *s); // NULL: no-op

// Bytes per row of the state's KV pools: 4 * head_dim (FP32 rows, the FP32 recipe) or
// di_backend_kv_row_bytes(head_dim, rope dims) (the FP8 KV rows of the official recipe).
int64_t di_dsv4_dev_state_kv_row_bytes(const di_dsv4_dev_state *s);
// Bytes per key of the state's indexer key pools (CSA layers): 4 * index_head_dim (FP32 keys, the
// FP32 recipe) or di_backend_code_row_bytes(4, index_head_dim, DI_BACKEND_KEY_BLOCK) (the official
// recipe's Q4 codes: 68 at V4's 128 dims, lossless there).
int64_t di_dsv4_dev_state_index_key_bytes(const di_dsv4_dev_state *s);

// The least common multiple of the compress ratios rounded up to at least the window: the serving
// engine's block size (kv/kv_manager.c, the same rule) and the default of a state.
int32_t di_dsv4_dev_block_tokens(const di_dsv4_dev *d);

// Backend bytes of one entry block (every compressing layer's E entries of kv_row_bytes, CSA's E
// indexer keys of index_key_bytes: R-OFF's Q4 codes make V4-Flash's 128-position block 449,824
// bytes instead of 748,192) and of one slot's tail (window rings, the MTP block's when enabled,
// compressor token rings, its page table) for blocks of block_tokens positions and a context of
// n_ctx: the engine sizes its blocks from kv_memory_bytes with them. The call rows and scratch
// (max_rows) are not included. DI_ERR_INVALID (bad n_ctx or block_tokens).
di_status di_dsv4_dev_sizes(const di_dsv4_dev *d, int32_t n_ctx, int32_t block_tokens,
                            int64_t *block_bytes, int64_t *slot_bytes);

// Backend bytes the state allocated (pools, rings, page tables, scratch, metadata); its entry
// blocks (n_blocks, or the private ones).
int64_t di_dsv4_dev_state_bytes(const di_dsv4_dev_state *s);
int32_t di_dsv4_dev_state_n_blocks(const di_dsv4_dev_state *s);
// Entry block I/O: the prefix cache's disk tier (kv/kv_manager.h, di_kv_block_io) writes cached
// blocks back and reads them in through these; tests check that cached blocks are never
// rewritten. The host bytes (di_dsv4_dev_sizes' block_bytes) are, per compressing layer in layer
// order, its E = block_tokens / ratio entry rows (E * kv_row_bytes: FP32 rows, or the official
// recipe's FP8 KV rows) and then, for CSA (ratio 4), its E indexer keys (E *
// di_dsv4_dev_state_index_key_bytes: FP32 rows, or the official recipe's Q4 codes): the device
// bytes as they are, so a read then a write round-trips exactly (a block written by one state
// reads back identically on any state of a dev of the same model and recipe). read copies block
// `block` into dst and syncs (dst is written on return); write copies src into it (returns when
// src may be reused; stream-ordered before the next call). Not inside a call.
// DI_ERR_INVALID (no such block; logged), DI_ERR_CUDA.
di_status di_dsv4_dev_state_read_block(const di_dsv4_dev_state *s, int32_t block, void *dst);
di_status di_dsv4_dev_state_write_block(di_dsv4_dev_state *s, int32_t block, const void *src);

typedef struct di_dsv4_dev_seq {
    int32_t slot, pos, n_tok;
    // Shared blocks: the sequence's entry block ids in position order (blocks[i] holds positions
    // [i * block_tokens, (i + 1) * block_tokens)), n_blocks >= ceil((pos + n_tok) / block_tokens)
    // of them (borrowed for the call). Private blocks: NULL, 0.
    const int32_t *blocks;
    int32_t n_blocks;
    // Bounded replay (docs/kv-cache.md): no window key before win_lo (0: none); a call at
    // pos == win_lo > 0 starts the slot afresh there, like pos 0. Later calls pass the same win_lo.
    int32_t win_lo;
    // Positions whose entries are cached (a multiple of block_tokens): windows closing with entry
    // index < n_cached / m leave their entry untouched (their rings are still updated). With
    // win_lo > 0 the first window kept must start at or after win_lo: win_lo <= n_cached - (c - 1)
    // * m for every compressing ratio m (c = 2 with overlap).
    int32_t n_cached;
} di_dsv4_dev_seq;

// A ragged batch: seqs[i] feeds its n_tok tokens (host ids; rows concatenated in seqs order) at
// positions pos.. of slot `slot`; pos must equal the tokens the slot has consumed (pos 0, or
// pos == win_lo > 0, starts the slot afresh). Logits of the rows listed in logit_rows (ascending)
// go to host logits [n, V]. DI_ERR_INVALID for bad slots (out of range or repeated), positions,
// token ids, row counts, capacity, blocks (missing, out of range, a block the call writes listed
// twice or read by another sequence), win_lo or n_cached (checked before any work, logged). A
// backend error (DI_ERR_CUDA, DI_ERR_NOMEM) leaves the call's slots to be restarted at pos 0 (or
// their win_lo).
di_status di_dsv4_dev_forward(di_dsv4_dev_state *s, const di_dsv4_dev_seq *seqs, int32_t n_seq,
                              const int32_t *tokens, const int32_t *logit_rows,
                              int32_t n_logit_rows, float *logits);
// di_dsv4_dev_forward with greedy rows: logit row k with greedy[k] != 0 crosses to the host as
// its argmax only, picks[k] (host [n_logit_rows]; exactly sample/sampler.h di_argmax of the row
// the plain call downloads), its row of logits left as it was; the other rows' logits as
// di_dsv4_dev_forward (one download per run of consecutive such rows). The picks cost one
// argmax_rows op per head chunk after the head (after a decode graph's launch: the graphs are the
// same) and 4 bytes a row instead of 4 V. greedy NULL: the plain call. DI_ERR_INVALID also for
// greedy without picks; errors as di_dsv4_dev_forward.
di_status di_dsv4_dev_forward_picks(di_dsv4_dev_state *s, const di_dsv4_dev_seq *seqs,
                                    int32_t n_seq, const int32_t *tokens, const int32_t *logit_rows,
                                    int32_t n_logit_rows, float *logits, const uint8_t *greedy,
                                    int32_t *picks);

// Tokens slot `slot` has consumed (-1 after a failed call: restart it at pos 0).
int32_t di_dsv4_dev_n_past(const di_dsv4_dev_state *s, int32_t slot);

// Calls of a state so far: run directly (prefill, mixed, the first decode step of a batch size,
// or every call with DI_DEV_GRAPHS=0), captured into a graph (then launched), launched from a
// cached graph (hits); graphs cached now.
// n_direct_pages: decode steps run directly because their page table changed more than one entry
// per sequence ("Graphs"; also counted in n_direct).
// The last call's costs (issue #7: what a step launches and uploads): ops it enqueued on the
// backend (the entries from embed to the head's matmul; a launched graph counts the ops it
// captured; the logits download and the sync not counted), host-to-backend uploads and their bytes.
// Pipeline stages' hand-overs ("Pipeline stages"), one per buffer copied into a stage: so far by
// kind, directly (peer_copy: two CPU backends, one GPU or two with peer access) or through the
// host bounce (then also an upload of the last call), and the last call's bytes handed over.
// The bytes of results downloaded (logits, greedy picks: di_dsv4_dev_forward_picks; not
// snapshots or KV transfers), the last call's (a main or an MTP call) and every call's so far.
typedef struct di_dsv4_dev_graph_stats {
    int64_t n_direct, n_captured, n_replayed, n_direct_pages;
    int32_t n_cached;
    int64_t last_ops, last_uploads, last_upload_bytes;
    int64_t n_handover_peer, n_handover_host, last_handover_bytes;
    int64_t last_download_bytes, n_download_bytes;
} di_dsv4_dev_graph_stats;
void di_dsv4_dev_get_graph_stats(const di_dsv4_dev_state *s, di_dsv4_dev_graph_stats *out);
// Runs and captures the decode graph of every size 1..min(max_seqs, n_slots, 64): two decode steps
// of token 0 at position 0 on slots 0..n-1 per size (the slots are left at position 1: restart
// them at 0). With shared blocks every slot lists block 0 (one token writes no entry, so block 0
// is left as it was). No-op with graphs off. Errors as di_dsv4_dev_forward.
di_status di_dsv4_dev_prepare_decode(di_dsv4_dev_state *s, int32_t max_seqs);
// The same for verify steps (2 rows per sequence, logits of both; up to 32 sequences and max_rows
// / 2): the slots are left at position 2. Prepares nothing for a model with a compress ratio <= 2
// (two tokens at position 0 would close a window in the shared block 0; such steps then capture
// when first seen twice).
di_status di_dsv4_dev_prepare_verify(di_dsv4_dev_state *s, int32_t max_seqs);

// ---- MTP (spec §2.10; "MTP" above) ----

// Uploads the model's MTP block (e_proj, h_proj, its norms, head mHC and sliding-window decoder
// block; the lm head is shared): states created afterwards by di_dsv4_dev_state_create have an MTP
// window ring per slot (di_dsv4_dev_state_create_spec: those asking for it), and tails and
// di_dsv4_dev_sizes include it. States that exist already keep none (their MTP calls and tail
// snapshots are refused). Once (no-op when enabled already), before or after states exist.
// DI_ERR_UNSUPPORTED (no MTP block, or one that compresses), DI_ERR_NOMEM, DI_ERR_CUDA; logged.
di_status di_dsv4_dev_mtp_enable(di_dsv4_dev *d);
bool di_dsv4_dev_has_mtp(const di_dsv4_dev *d);
// x_rows value of an MTP row that reads its own position's kept main streams ("MTP").
enum { DI_DSV4_DEV_X_KEPT = -1 };
// The MTP block on rows of the last di_dsv4_dev_forward call (its main streams stay in the
// state's backend memory until the next call of either kind): seqs[i] runs n_tok rows at
// positions pos.. of its slot's MTP ring (pos equals the positions the ring consumed, or starts
// it afresh: 0, or win_lo > 0; pos + n_tok at most the slot's main n_past); row t (concatenated
// in seqs order) reads the main streams of row x_rows[t] of that call, or with x_rows[t] ==
// DI_DSV4_DEV_X_KEPT (a state with kept streams) the kept streams of its position (one of the
// slot's last back_max + 1 positions below its n_past, fed since its start), and the token
// ids_next[t] (the one at its position + 1), and predicts the token two positions on. At most
// max_rows rows (without kept rows: at most the last call's). MTP logits of the rows in logit_rows
// (ascending) go to host logits [n, V]. Bit for bit the CPU forward's (di_dsv4_mtp_forward_batch).
// Runs directly (no graph). DI_ERR_INVALID (no MTP, no main call before it, bad slots, positions,
// rows, kept rows not kept, tokens; logged), DI_ERR_CUDA (the slots' MTP rings must restart).
di_status di_dsv4_dev_mtp_forward(di_dsv4_dev_state *s, const di_dsv4_dev_seq *seqs, int32_t n_seq,
                                  const int32_t *x_rows, const int32_t *ids_next,
                                  const int32_t *logit_rows, int32_t n_logit_rows, float *logits);
// di_dsv4_dev_mtp_forward with greedy rows, as di_dsv4_dev_forward_picks: the engine's drafts
// (the argmax of each MTP logit row) cross as picks[k], one id a row.
di_status di_dsv4_dev_mtp_forward_picks(di_dsv4_dev_state *s, const di_dsv4_dev_seq *seqs,
                                        int32_t n_seq, const int32_t *x_rows,
                                        const int32_t *ids_next, const int32_t *logit_rows,
                                        int32_t n_logit_rows, float *logits, const uint8_t *greedy,
                                        int32_t *picks);
// Positions slot `slot`'s MTP ring consumed (-1: restart it; no MTP: -1).
int32_t di_dsv4_dev_mtp_n_past(const di_dsv4_dev_state *s, int32_t slot);
// Takes slot `slot` back to position pos ("Rollback"): at most back_max rows below the highest
// position its rings were written at since its start (back_max 1: the last row of its last call,
// a rejected verify row, once), never below a tail restore's position nor to or before its
// win_lo. The rows taken back leave no trace (the argument is at stage_rollback in dsv4_dev.c); a
// slot whose MTP ring had consumed past pos restarts its MTP ring. DI_ERR_INVALID (logged; nothing
// changes).
di_status di_dsv4_dev_rollback(di_dsv4_dev_state *s, int32_t slot, int32_t pos);
// The same, and the slot's MTP ring back to mtp_pos <= pos with the same bound on its own
// positions (or to its start: 0, win_lo), both checked before either moves: a V4 MTP session's
// rollback (its MTP position one below its main one). DI_ERR_INVALID (a state without MTP, or as
// di_dsv4_dev_rollback; logged; nothing changes).
di_status di_dsv4_dev_rollback_mtp(di_dsv4_dev_state *s, int32_t slot, int32_t pos,
                                   int32_t mtp_pos);

// ---- tail snapshots (docs/kv-cache.md "Tail snapshots") ----

// Host bytes of one slot's tail snapshot ("Tail snapshots" above): a 16-byte header (position,
// layers, KV row bytes), then per layer the last W - 1 rows of its window ring (the state's row
// format: FP32 rows, or the official recipe's FP8 KV rows) and, per compressor with overlapping
// windows (CSA: main and indexer), the last m rows of its C and Z token rings; HCA keeps none;
// with the MTP block enabled, then the last W - 1 rows of its window ring (the header counts it as
// a layer). The same for every state of d with d's MTP ring (rows by position: whatever the
// state's back_max); tail_save and tail_restore refuse the others (DI_ERR_INVALID, logged).
size_t di_dsv4_dev_tail_bytes(const di_dsv4_dev *d);
// Copies slot `slot`'s tail at its current position (di_dsv4_dev_n_past, a multiple of every
// compress ratio: the engine's block boundaries) into dst (di_dsv4_dev_tail_bytes). Syncs (dst is
// written on return). Not inside a call. DI_ERR_INVALID (slot out of range or failed, a position
// that is no multiple of every ratio, or a slot replayed from win_lo > 0 whose rings do not reach
// back to the rows a snapshot keeps; logged), DI_ERR_CUDA.
di_status di_dsv4_dev_tail_save(di_dsv4_dev_state *s, int32_t slot, void *dst);
// Puts a snapshot taken at position pos (by any slot of any state of the same dev) into slot
// `slot`, which then continues at pos as if it had consumed pos tokens with full windows: n_past
// pos, win_lo 0; its next call passes pos, win_lo 0 and the blocks whose entries hold the
// positions before pos (shared blocks: that call writes the page table entries that differ;
// private blocks: the slot's own, which must hold them). The copies are enqueued (stream order: the
// next call reads them; faults surface at its sync). DI_ERR_INVALID (slot or position out of range,
// not a snapshot of this dev at pos; nothing changes), DI_ERR_CUDA (the slot must restart at 0).
di_status di_dsv4_dev_tail_restore(di_dsv4_dev_state *s, int32_t slot, int32_t pos,
                                   const void *src);
// Whether src (di_dsv4_dev_tail_bytes) is a snapshot of d's states at position pos (its header;
// restore checks the same): DI_OK or DI_ERR_INVALID (not logged). Host only, any thread.
di_status di_dsv4_dev_tail_check(const di_dsv4_dev *d, int32_t pos, const void *src);

// ---- model wiring ----

// Creates the model's dev forward on backend b (borrowed; must outlive m) and attaches it:
// sessions created afterwards run di_session_forward through a 1-slot state of their n_ctx_max
// (dsv4_state.c; MTP sessions with the MTP block enabled then, dsv4.c "sessions on the
// device-resident forward"). di_model_load calls it with the CUDA backend for --device cuda; tests
// call it with the CPU backend. Errors as di_dsv4_dev_create (nothing attached);
// DI_ERR_INVALID when one is attached already.
di_status di_dsv4_dev_attach(di_model *m, di_backend *b);
// The same with n_stages pipeline stages on b[0..n_stages-1] (di_dsv4_dev_create_stages; --device
// cuda:0,1,...); errors as that and di_dsv4_dev_attach.
di_status di_dsv4_dev_attach_stages(di_model *m, di_backend *const *b, int32_t n_stages);
