/*
 * backend — the compute backend vtable (conventions §7): memory, copies (within a backend, to and
 * from the host, and between two backends: the pipeline stages' hand-over, di_backend_hand_over),
 * synchronisation, weight upload, supports_op, and one entry per op of the device-resident
 * forwards of V4 and V4.1 (model/dsv4_dev.h, model/dsv41_dev.h). Two implementations:
 *   - CPU (backend/cpu/cpu_backend.c): "device" memory is host memory and every op runs the
 *     CPU kernels on it. It is the oracle twin of the CUDA backend: a device-resident forward
 *     run on it must give the model's own CPU forward bit for bit
 *     (tests/model/test_dev_forward.c, test_dev41_forward.c), which tests the forward's
 *     orchestration (state layout, key lists, compressor windows, ring updates) without a GPU.
 *   - CUDA (backend/cuda/cuda_ops.cu): the launchers of backend/cuda/<op>.cuh on a di_cuda context.
 * Every op of one backend is tested against the CPU backend on the same inputs
 * (tests/backend/cuda/test_cuda_ops.c).
 *
 * Conventions of every entry:
 *   - Pointers named like data (x, y, q, pool, ...) and every int array are backend memory (from
 *     alloc, or inside an uploaded weight); plain scalars are host values.
 *   - Entries enqueue in order on the backend's one stream and return di_status: DI_ERR_INVALID
 *     for shapes the op cannot handle (checked before any work), DI_ERR_CUDA / DI_ERR_NOMEM,
 *     DI_ERR_DEVICE_LOST once a sticky error lost the device (from every entry but the frees
 *     and destroy, until di_backend_reset_device).
 *     Faults inside asynchronous work surface at the next sync (or download).
 *   - Activations are FP32 rows; accumulation is FP32. Weights are di_tensor with backend data
 *     and scale pointers (weight_upload), decoded exactly as tensor/quant_ref.c.
 *   - Row counts of 0 are no-ops.
 *
 * Owns: a di_backend owns its context, every block from alloc not yet freed, and every uploaded
 * weight (freed at destroy). Thread-safety: one thread at a time (the thread running the
 * forward; a copy between two backends uses both); create/destroy on any thread.
 */
#pragma once

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "deepinfer.h"     // di_status, di_device
#include "tensor/tensor.h" // di_tensor

#ifdef __cplusplus
extern "C" {
#endif

typedef struct di_backend di_backend;

// Bytes of one KV row (kv_quant, attn_kv) for head_dim dh with n_rot rope dims: the nope codes,
// the BF16 rope dims, a scale per 64 nope dims, padded to 8 bytes (= di_cuda_kv_row_bytes; 584 for
// V4's 512/64).
static inline int64_t di_backend_kv_row_bytes(int32_t dh, int32_t n_rot) {
    const int64_t nope = dh - n_rot, b = nope + 2 * (int64_t)n_rot + nope / 64;
    return (b + 7) / 8 * 8;
}

// matmul_a8 rows from which the CUDA backend runs FP8 weights on tensor cores: prefill calls.
// Above the largest decode graph (64 sequences), so no captured step holds a cuBLASLt call; below
// it a step reads each weight once through the SIMT kernels, bound by HBM (bench_cuda `gemm`
// prints both paths per M, to move this from the H200's numbers).
#define DI_BACKEND_TC_MIN_ROWS 128

// compress_pool's "no such slot" source (the overlap of the first window).
#define DI_BACKEND_NO_ROW INT32_MIN

// fake_quant's `bits` for V4.1's Q4e (tensor/quant_ref.h di_fake_quant_q4e: e2m1 codes with an
// E4M3 scale per block, by division): the compressed entries of model/dsv41_attn.c.
#define DI_BACKEND_Q4E (-4)

// V4.1's stored codes (pack_rows, attn_codes, index_scores_q4; tensor/quant_ref.h
// di_quant_*_pack, docs/kv-cache.md "Packed codes"): window rows Q8 (e4m3 codes, a UE8M0 scale
// per DI_BACKEND_WIN_BLOCK dims), entries Q4e (e2m1 pairs, an E4M3 scale per DI_BACKEND_ENT_BLOCK),
// index keys Q4 (e2m1 pairs, a UE8M0 scale per DI_BACKEND_KEY_BLOCK); model/dsv41.h's
// DI_DSV41_*_BLOCK. V4's official-recipe index keys are the same Q4 codes (model/dsv4_dev.h).
#define DI_BACKEND_WIN_BLOCK 32
#define DI_BACKEND_ENT_BLOCK 16
#define DI_BACKEND_KEY_BLOCK 32

// Bytes of one packed row of n values in blocks of `block` (bits 8: Q8; 4: Q4; DI_BACKEND_Q4E:
// Q4e): the codes then a scale byte per block, unpadded (= di_quant_*_row_bytes).
static inline int64_t di_backend_code_row_bytes(int32_t bits, int64_t n, int64_t block) {
    return (bits == 8 ? n : n / 2) + n / block;
}

// index_cand's modes (V4.1's two-level indexer, model/dsv41_attn.c idx_task).
typedef enum di_backend_cand_mode {
    DI_BACKEND_CAND_BUILD = 0, // level 1: the candidate pool of each row
    DI_BACKEND_CAND_MASK = 1,  // level 2: scores outside the row's pool become -inf
    DI_BACKEND_CAND_DROP =
        2, // after topk: picks scored -inf dropped (the rest moved up, -1 padded)
} di_backend_cand_mode;

// A layer's MoE weights in backend memory (the CPU forward's di_dsv4_layer_w fields, uploaded).
typedef struct di_backend_moe_w {
    di_tensor gate;                // [E, D]
    const float *gate_bias;        // [E]; NULL for hash-routed layers
    const int32_t *tid2eid;        // [V, K]; NULL for score-routed layers
    const di_tensor *w1, *w2, *w3; // arrays [E] of tensors ([F, D], [D, F], [F, D]), the arrays
                                   // themselves in backend memory
    di_tensor sh_w1, sh_w2, sh_w3; // shared expert
    int32_t n_expert, n_used;
    int64_t D, F; // F: the routed experts' width (the shared expert's is sh_w1.ne[1])
    float route_scale, swiglu_limit;
    bool shared_clamp; // the shared expert's SwiGLU is clamped too
    bool hf_eps;       // the routing-weight denominator gets + 1e-20 (model's rule)
    float gate_temp;   // V4.1: the router logits are divided by it first; 0: not divided (V4)
    int32_t a8_block;  // the official recipe's A8 block along K: 32 (V4.1); 0: 128 (V4)
    // The official precision recipe (spec §2.0, model/dsv4_moe.c): FP8/FP4 expert weights see
    // A8-quantised inputs (Q8, blocks of 128), every expert linear's output is rounded to BF16,
    // the routing weight scales h before w2 (then h is rounded to BF16) instead of the output,
    // and the layer's output is rounded to BF16. false: the FP32 recipe.
    bool official;
    di_tensor_kind routed_kind; // w1/w2/w3[e].kind, one for every routed expert (a host copy: the
                                // arrays are backend memory)
} di_backend_moe_w;

typedef struct di_backend_vt {
    const char *name; // "cpu", "cuda"

    // ---- memory and copies ----
    // The ordering each entry gives (CUDA: cuda_backend.cu; the CPU twin's deferred mode,
    // di_cpu_backend_set_deferred, reproduces it). "Enqueued": runs after everything enqueued on
    // b before it and before everything enqueued after it, asynchronously to the host (the ops,
    // memset, copy, graph_launch). "Synchronous": returns when everything enqueued on b before it
    // and the entry itself have completed (a stream synchronisation; b's earlier faults surface
    // there). No entry orders b's work against another backend's, except peer_copy (and the
    // hand-over built on it). The host never reads or writes backend memory itself: only upload
    // and download do, which is what makes single host staging buffers (the forward's metadata,
    // the logits) safe to rewrite for the next call as soon as they return.
    // alloc: at least `bytes` (256-byte aligned), contents undefined; no device call and no
    // ordering (CUDA: a caching pool). free: no device call; the block may be handed out again by
    // the next alloc at once, which is safe because the new owner's work is enqueued on the same
    // stream after the old owner's (stream-ordered reuse): the work already enqueued on b may
    // still use the block, but another backend's stream must not (a peer_copy from it is ordered
    // by its events), the host must not, and no graph still holding the block may be launched
    // again (destroy graphs before freeing what they name).
    di_status (*alloc)(di_backend *b, size_t bytes, void **out);
    void (*free)(di_backend *b, void *p); // NULL: no-op
    // Host -> backend and backend -> host, any host memory (pageable or host_alloc): synchronous
    // (above), so they return when the host buffer may be reused (upload) or read (download), and
    // an upload never overwrites memory that earlier enqueued work (a graph replay included) still
    // reads. Callers rely on that (single-buffered staging): an asynchronous upload from
    // page-locked memory would need double-buffered staging in every caller first.
    di_status (*upload)(di_backend *b, void *dst, const void *src, size_t bytes);
    di_status (*download)(di_backend *b, void *dst, const void *src, size_t bytes);
    // Enqueued (above); copy: within b.
    di_status (*memset)(di_backend *b, void *dst, int value, size_t bytes);
    di_status (*copy)(di_backend *b, void *dst, const void *src, size_t bytes);
    // Synchronous (above): waits for b's enqueued work only (not another backend's), surfaces its
    // faults.
    di_status (*sync)(di_backend *b);
    // Host memory the backend copies to and from fastest, for buffers that cross every step (the
    // device-resident forward's metadata staging, the engine's logits): CUDA page-locked memory
    // (cudaHostAlloc: DMA at the link's speed instead of staged copies of pageable memory), the
    // CPU backend plain 256-byte aligned memory. Not inside a capture. Free with host_free (NULL:
    // no-op; CUDA's cudaFreeHost waits for the device's work first). DI_ERR_NOMEM. Host memory,
    // never an op's argument (on a GPU with unified addressing a kernel could read it, over the
    // link and late: the CPU twin cannot tell it from backend memory).
    di_status (*host_alloc)(di_backend *b, size_t bytes, void **out);
    void (*host_free)(di_backend *b, void *p);
    // Copies a host weight (a mapped checkpoint view) into backend memory once: *dev gets the same
    // kind, shape and layout with backend pointers. The CPU backend makes no copy (dev = host).
    // The host tensor's bytes are copied synchronously (as upload); CUDA may enqueue device work on
    // them after the copy (an FP8 weight's scales repacked for cuBLASLt), stream-ordered.
    di_status (*weight_upload)(di_backend *b, const di_tensor *host, di_tensor *dev);
    // Whether the backend computes matmuls with weights of this kind (host tensor).
    bool (*supports_matmul)(const di_backend *b, const di_tensor *w);
    // Copies between two backends of this kind (the pipeline stages' hand-over; callers use
    // di_backend_hand_over below, which falls back to a host bounce). can_peer: whether
    // peer_copy can copy from src_b's memory into b's directly: the CPU backend always (one
    // address space; di_cpu_backend_set_peer turns it off for tests), CUDA for the same device
    // (two backends on it: a device copy) or two devices with peer access both ways (enabled at
    // open: cudaDeviceCanAccessPeer, cudaDeviceEnablePeerAccess). peer_copy: b's dst <- src_b's
    // src, `bytes`: enqueued on b's stream after everything enqueued on src_b before it, and
    // everything enqueued later on either backend after it (CUDA: an event each way between the
    // two streams, cudaMemcpyPeerAsync); asynchronous to the host like copy. Not inside a capture
    // of either (refused: DI_ERR_INVALID, the capture fails); DI_ERR_UNSUPPORTED when !can_peer;
    // either backend lost: DI_ERR_DEVICE_LOST.
    bool (*can_peer)(const di_backend *b, const di_backend *src_b);
    di_status (*peer_copy)(di_backend *b, void *dst, di_backend *src_b, const void *src,
                           size_t bytes);

    // ---- device memory (the pipeline stages' KV-aware split, the engine's KV blocks) ----
    // The memory b's allocations come from: *free_bytes what an alloc could still get now (what
    // b and everything else on the device hold already is not free), *total_bytes the device's
    // size. CUDA: cudaMemGetInfo on b's device (shared by every backend and process on it). CPU:
    // what di_cpu_backend_set_mem set (tests model unequal devices), else it cannot say (the
    // host's free memory is no device's, and the CPU twin's splits must not follow the machine's
    // load). Host only, not inside a capture (refused: DI_ERR_INVALID).
    // DI_ERR_UNSUPPORTED when the backend cannot say (NULL entry: di_backend_mem_info says so);
    // a lost device: DI_ERR_DEVICE_LOST. Outputs written only on success.
    di_status (*mem_info)(di_backend *b, size_t *free_bytes, size_t *total_bytes);

    // ---- ops ----
    // y[t*ys + o] = sum_i W[o, i] x[t*xs + i] (backend/cpu/gemm.h contract). x, y do not overlap.
    di_status (*matmul)(di_backend *b, const di_tensor *w, const float *x, int64_t n_tok,
                        int64_t xs, float *y, int64_t ys);
    // The official recipe's FP8/FP4 linear (model/dsv4_attn.c di_dsv4_linear): y = W . A8(x),
    // A8 = Q8 in blocks of 128 (fake_quant(x, n_tok, K, xs, 128, 8, aq), K = w->ne[0]), then
    // matmul(w, aq, n_tok, xs, y, ys). aq: scratch of n_tok rows xs apart (contents afterwards
    // unspecified). The CPU backend runs exactly those two entries. CUDA: the same two launches,
    // except FP8 weights of 128x128 blocks at >= DI_BACKEND_TC_MIN_ROWS rows outside a capture
    // (prefill), which run on FP8 tensor cores (cuBLASLt block-scaled, docs/cuda.md "FP8 tensor
    // cores"): the products W[o,i] A8(x)[i] are exact in both, only the order of the FP32 sums
    // differs.
    di_status (*matmul_a8)(di_backend *b, const di_tensor *w, const float *x, int64_t n_tok,
                           int64_t xs, float *aq, float *y, int64_t ys);
    // x[t, k, :] = table row ids[t] as FP32 for every k < copies (x: [n, copies, D], D =
    // table->ne[0]); the embedding copied into every mHC stream.
    di_status (*embed)(di_backend *b, const di_tensor *table, const int32_t *ids, int32_t n,
                       int32_t copies, float *x);
    // In place over n_rows rows of n values, `stride` apart: x *= rsqrt(mean(x^2) + eps) (* w).
    di_status (*rmsnorm)(di_backend *b, float *x, int64_t n_rows, int64_t n, int64_t stride,
                         const float *w, float eps);
    // Interleaved partial RoPE (di_ref_rope) on n_rows rows of n values: row r at position
    // pos[r / rows_per_pos]; omega [n_rot / 2]; inverse de-rotates.
    di_status (*rope)(di_backend *b, float *x, int64_t n_rows, int64_t row_stride, int64_t n,
                      int32_t n_rot, const float *omega, const int32_t *pos, int32_t rows_per_pos,
                      float scale, bool inverse);
    // x[i] *= s for i < n.
    di_status (*scale)(di_backend *b, float *x, int64_t n, float s);
    // mHC pre and post: exactly backend/cuda/mhc.cuh di_cuda_mhc_pre / di_cuda_mhc_post
    // (mix_raw = fn . x from matmul; head: only a).
    di_status (*mhc_pre)(di_backend *b, const float *x, const float *mix_raw, const float *base,
                         const float *scale, int32_t nc, int64_t D, int32_t n_tok, int32_t iters,
                         float hc_eps, float norm_eps, bool head, float *a, float *post,
                         float *comb);
    di_status (*mhc_post)(di_backend *b, const float *o, float *x, const float *post,
                          const float *comb, int32_t nc, int64_t D, int32_t n_tok);
    // out [T, D] = the MoE layer on f [T, D] (router, routed experts, shared expert, combine in
    // ascending expert order; FP32 recipe: the routing weight scales each expert's output; the
    // official recipe (w->official): model/dsv4_moe.c's order). ids: token ids [T] (hash routing).
    di_status (*moe)(di_backend *b, const di_backend_moe_w *w, const float *f, const int32_t *ids,
                     int32_t n_tok, float *out);
    // dst + dst_rows[i] * dst_stride  <-  src + s_i * src_stride, `width` floats, for i < n, where
    // s_i = src_rows[i] (a gather: the ring updates of every sequence of a call in one launch) or
    // i when src_rows is NULL (compressed entries). No two dst_rows >= 0 equal, and no row written
    // is read (src and dst may be one buffer, e.g. a KV pool's call rows into its rings); a
    // negative dst_rows[i] skips row i (the padding of a graph-stable list).
    // The rows' bits are copied as they are (32-bit words), so KV rows of bytes (kv_quant; a
    // multiple of 8 bytes) go through it as rows of row_bytes / 4 words, strides likewise.
    di_status (*scatter_rows)(di_backend *b, const float *src, int64_t n, int64_t src_stride,
                              int64_t width, float *dst, int64_t dst_stride,
                              const int32_t *dst_rows, const int32_t *src_rows);
    // z[t, :] += ape[pos[t] mod m, :] over n rows of `width` floats (`stride` apart): the
    // compressor's position bias (spec §2.5).
    di_status (*add_ape)(di_backend *b, float *z, int64_t n, int64_t stride, int64_t width,
                         const float *ape, const int32_t *pos, int32_t m);
    // Compressor pooling (spec §2.5; model/dsv4_attn.c compressor_step) for n_win closing windows
    // of ratio m, token width c*d. src[w * c*m + j] names the token row of slot j of window w:
    // idx >= 0 is row idx of (call_c, call_z) (this call's projections, `call_stride` floats
    // apart); idx < 0 and != DI_BACKEND_NO_ROW is row (-idx - 1) of (ring_c, ring_z) (the
    // compressor's token ring, rows of c*d floats); DI_BACKEND_NO_ROW: no token (the overlap of
    // window 0), skipped. Z rows carry their position bias already (add_ape). c == 1: slots
    // j < m, columns [0, d). c == 2: slots j < m are the overlap (the previous window's tokens,
    // columns [0, d)), then slots m..2m-1 this window's tokens (columns [d, 2d)). Per channel:
    // max over the present slots, then den = sum exp(z - max), num = sum exp(z - max) * c in slot
    // order, entry = num / den; a window without any slot present (every src DI_BACKEND_NO_ROW:
    // the padding of a graph-stable list) gets entry 0. entry: [n_win, d] contiguous.
    di_status (*compress_pool)(di_backend *b, const float *call_c, const float *call_z,
                               int64_t call_stride, const float *ring_c, const float *ring_z,
                               const int32_t *src, int32_t n_win, int32_t m, int32_t c, int32_t d,
                               float *entry);
    // Sink attention over index-listed FP32 key rows (the shared K = V rows of V4, dh floats each,
    // at pool + idx * dh): for query row t < n_tok and head h < H, o[t,h] = sum_j p_j k_j with p =
    // softmax over {scale * q[t,h] . k_j : j < n_keys[t], key_idx[t * key_stride + j] >= 0} ∪
    // {sink[h]} (the sink takes mass, gives no value); a negative index is a masked key.
    // max_keys bounds every n_keys[t]: a count outside [0, max_keys] is DI_ERR_INVALID (logged):
    // the CPU refuses the call (or the graph launch holding it) before any work; CUDA, whose
    // kernels read the counts as device data, clamps them to [0, max_keys] (no overrun) and
    // returns it from the next sync or download (a device-side flag). q, o: [T, H, dh]. Inverse
    // RoPE of o is the caller's.
    // round_p (the official recipe): each p_j, normalised, is rounded to BF16 before p.v.
    di_status (*attn)(di_backend *b, const float *q, const float *pool, const int32_t *key_idx,
                      int64_t key_stride, const int32_t *n_keys, int32_t max_keys,
                      const float *sink, int32_t n_tok, int32_t H, int32_t dh, float scale,
                      bool round_p, float *o);
    // KV rows (di_backend_kv_row_bytes bytes each; the layout of backend/cuda/attn.cuh: e4m3
    // codes of the dh - n_rot nope dims, the n_rot rope dims as BF16, one UE8M0 scale per 64
    // nope dims, zero padding): row i of the n FP32 rows kv + i * kv_stride (dh values) is encoded
    // into pool + dst_rows[i] * row_bytes (dst_rows NULL: row i; a negative dst_rows[i] skips row
    // i). Exactly di_cuda_kv_quant: the codes and scales of Q8(nope, 64) (di_fake_quant_q8) and
    // BF16 rope dims, so rows already Q8-exact (nope) and BF16 (rope) decode to themselves.
    // DI_ERR_INVALID unless (dh - n_rot) is a multiple of 64, n_rot even, dh <= 1024.
    di_status (*kv_quant)(di_backend *b, const float *kv, int64_t n, int64_t kv_stride, int32_t dh,
                          int32_t n_rot, uint8_t *pool, const int32_t *dst_rows);
    // attn over KV rows (kv_quant's layout) instead of FP32 rows: each key row decoded exactly,
    // then the same arithmetic as attn (CUDA: di_cuda_attn's FP8-row instance).
    di_status (*attn_kv)(di_backend *b, const float *q, const uint8_t *pool, const int32_t *key_idx,
                         int64_t key_stride, const int32_t *n_keys, int32_t max_keys,
                         const float *sink, int32_t n_tok, int32_t H, int32_t dh, int32_t n_rot,
                         float scale, bool round_p, float *o);
    // Lightning-indexer scores and top-k: exactly backend/cuda/indexer.cuh di_cuda_indexer_scores
    // and di_cuda_topk (ties to the lower index, ascending, -1 padded; k == n_vis selects all
    // without reading scores). round_bf16 (the official recipe): every score is rounded to BF16.
    // The key of entry w < n_vis[t] of row t is keys + row * DI, row = key_base[t] (int64; 0 when
    // key_base is NULL) + (pages NULL: w, contiguous; else the paged entry
    // pages[page_off[t] + w / per_page] * per_page + w % per_page: entries in pages of per_page,
    // a sequence's pages listed from page_off[t] on). A negative page scores its entries -inf.
    di_status (*index_scores)(di_backend *b, const float *qi, const float *wi, const float *keys,
                              const int64_t *key_base, const int32_t *pages,
                              const int32_t *page_off, int32_t per_page, const int32_t *n_vis,
                              int32_t max_vis, int32_t n_tok, int32_t HI, int32_t DI,
                              bool round_bf16, float *scores, int64_t score_stride);
    di_status (*topk)(di_backend *b, const float *scores, int64_t score_stride,
                      const int32_t *n_vis, int32_t n_tok, int32_t topk, int32_t *sel);
    // dst[t * dst_stride + off[t] + i] = the key row of entry s = sel[t*k + i] for i < k, or -1
    // when s < 0: a CSA row's selected entries appended to its key list (off: the row's window
    // keys). The row of entry s is base[t] + s (pages NULL: entries contiguous), or, paged,
    // base[t] + pages[page_off[t] + s / per_page] * per_page + s % per_page (the entry rows of a
    // pool in pages of per_page rows; a negative page gives -1). sel NULL stands for
    // sel[t*k + i] = i: entries 0..k-1 (an HCA row's visible entries, the tail past the row's key
    // count unread); base and off 0, pages NULL, with sel a [n_tok, k] list copies it.
    // DI_ERR_INVALID: k < 0, or pages with per_page < 1.
    di_status (*offset_list)(di_backend *b, const int32_t *sel, int32_t n_tok, int32_t k,
                             const int32_t *base, const int32_t *off, const int32_t *pages,
                             const int32_t *page_off, int32_t per_page, int32_t *dst,
                             int64_t dst_stride);

    // ---- lifetime ----
    // Frees everything the backend owns (context, blocks, uploaded weights) and b itself;
    // di_backend_destroy calls it. Graphs must be destroyed before.
    void (*destroy)(di_backend *b);

    // ---- graphs (CUDA graphs; docs/cuda.md "CUDA graphs of decode steps") ----
    // graph_begin starts a capture: the entries called until graph_end are recorded, not run
    // (their scalars and pointers by value; the backend memory they point to is read when the
    // graph runs). Inside a capture alloc, free, host_alloc, host_free, upload, download,
    // peer_copy, sync and weight_upload are refused (DI_ERR_INVALID, logged; free and host_free
    // only log, the memory stays valid) and the capture fails: a CUDA stream cannot synchronise
    // while capturing, and memory taken there would stay bound to the graph. Every
    // other entry may be captured; a shape error is reported when the entry is called (CUDA) or
    // when the graph runs (CPU). DI_ERR_INVALID when a capture is open already.
    di_status (*graph_begin)(di_backend *b);
    // Ends the capture: *graph (destroy with graph_destroy) on success. The capture is closed in
    // every case; DI_ERR_INVALID when something was refused inside it, DI_ERR_CUDA, DI_ERR_NOMEM.
    di_status (*graph_end)(di_backend *b, void **graph);
    // Runs the captured entries in order on the stream, as if called again with the same
    // arguments (enqueued like them: faults surface at the next sync). Not inside a capture. The
    // memory a replay reads may be rewritten by an upload right after graph_launch returns (the
    // upload is ordered after the replay); graph_destroy may follow a launch at once (CUDA frees
    // an executing graph when it completes).
    di_status (*graph_launch)(di_backend *b, const void *graph);
    void (*graph_destroy)(di_backend *b, void *graph); // NULL: no-op

    // ---- the official precision recipe (R-OFF, spec §2.0): its rounding points ----
    // x[i] = bf16(x[i]) (tensor/quant_ref.h di_round_bf16: nearest even) for i < n.
    di_status (*round_bf16)(di_backend *b, float *x, int64_t n);
    // Over n_rows rows `stride` floats apart: y[r, :n] = the fake-quantised x[r, :n] per block of
    // `block` values, bits 8: Q8 (e4m3, di_fake_quant_q8), bits 4: Q4 (e2m1, di_fake_quant_q4),
    // DI_BACKEND_Q4E: Q4e (e2m1 with an E4M3 scale by division, di_fake_quant_q4e),
    // exactly tensor/quant_ref.c (power-of-two scales; a block with a non-finite value becomes
    // NaN). y may be x (in place); the columns past n are not touched. DI_ERR_INVALID unless
    // block >= 1 divides n and block <= 1024, bits is 8, 4 or DI_BACKEND_Q4E.
    di_status (*fake_quant)(di_backend *b, const float *x, int64_t n_rows, int64_t n,
                            int64_t stride, int32_t block, int32_t bits, float *y);
    // In place over n_rows contiguous rows of n floats: the scaled Walsh-Hadamard transform of
    // di_hadamard (the same butterfly order, then * fl32(n^-1/2)). DI_ERR_INVALID unless n is a
    // power of two <= 1024.
    di_status (*hadamard)(di_backend *b, float *x, int64_t n_rows, int64_t n);

    // ---- DeepSeek V4.1 (model/dsv41_dev.h; deepseek-v41.md) ----
    // The single-pass mHC site (§2.2, model/dsv41.c block): unless mix_raw is NULL, the
    // coefficients of mhc_pre (non-head) with pre into pre_out [T, nc] and post, comb; then
    // a[t] = sum_s pre_in[t, s] x[t, s] (FP32, in stream order: ref_ops.h di_ref_hc_collapse), the
    // collapse with the pre carried from the previous site. pre_in and pre_out do not overlap.
    di_status (*mhc_pre_carried)(di_backend *b, const float *x, const float *mix_raw,
                                 const float *base, const float *scale, int32_t nc, int64_t D,
                                 int32_t n_tok, int32_t iters, float hc_eps, float norm_eps,
                                 const float *pre_in, float *a, float *pre_out, float *post,
                                 float *comb);
    // The Engram gate (§2.3.2; ref_ops.h di_ref_engram_gate): kv [T, (nc + 1) D] holds the nc
    // keys then the value of each row, qk [nc, D]; x [T, nc, D] += gate(x, key, qk) * value.
    di_status (*engram_gate)(di_backend *b, const float *kv, const float *qk, int32_t nc, int64_t D,
                             int32_t n_tok, float eps, float *x);
    // V4.1's two-level indexer (§2.5.3; ref_ops.h di_ref_cand_*), per row t < n_tok over its
    // n_vis[t] scores (score_stride apart): BUILD writes the row's candidate pool (blocks of bs
    // entries, at most ntb) into cand [T, ntb] and n_cand [T], with work as scratch (n_tok rows of
    // score_stride / bs + 1 floats: the block scores); MASK sets the scores outside that pool to
    // -inf; DROP rewrites sel [T, k] (a topk result) keeping the picks whose score is not -inf, in
    // order, then -1. Unused arrays may be NULL. DI_ERR_INVALID (bs, ntb or k < 1, a negative
    // n_vis, an unknown mode).
    di_status (*index_cand)(di_backend *b, int32_t mode, float *scores, int64_t score_stride,
                            const int32_t *n_vis, int32_t n_tok, int32_t bs, int32_t ntb,
                            int32_t *cand, int32_t *n_cand, int32_t *sel, int32_t k, float *work);
    // V4.1's KV codes (DI_BACKEND_WIN_BLOCK above): row i of n FP32 rows x + s_i * x_stride (s_i
    // = src_rows[i], or i when src_rows is NULL) is fake-quantised (bits 8: Q8, 4: Q4,
    // DI_BACKEND_Q4E: Q4e; blocks of `block` over its n_dims values) and its codes and scales are
    // written to dst + dst_rows[i] * row_bytes (dst_rows NULL: row i; negative: row i skipped),
    // row_bytes = di_backend_code_row_bytes(bits, n_dims, block): exactly tensor/quant_ref.h
    // di_quant_*_pack of that row (the same bytes, NaN blocks included), x unchanged. No two
    // dst_rows >= 0 equal. DI_ERR_INVALID unless block >= 2 is even and divides n_dims <= 1024,
    // bits is 8, 4 or DI_BACKEND_Q4E.
    di_status (*pack_rows)(di_backend *b, const float *x, int64_t n, int64_t x_stride,
                           int32_t n_dims, int32_t block, int32_t bits, uint8_t *dst,
                           const int32_t *dst_rows, const int32_t *src_rows);
    // attn over V4.1's stored codes: key j of row t, id = key_idx[t * key_stride + j] (negative:
    // masked), is the Q8 window row win + id * di_backend_code_row_bytes(8, dh, WIN_BLOCK) when
    // j < n_win[t], else the Q4e entry row ent + id * di_backend_code_row_bytes(DI_BACKEND_Q4E,
    // dh, ENT_BLOCK); each decoded exactly (di_quant_q8_unpack / _q4e_unpack), then attn's
    // arithmetic on those rows in list order (the CPU backend runs exactly that). n_win[t] <=
    // n_keys[t]. DI_ERR_INVALID unless dh is a multiple of 32, dh <= 1024, and as attn.
    di_status (*attn_codes)(di_backend *b, const float *q, const uint8_t *win, const uint8_t *ent,
                            const int32_t *key_idx, int64_t key_stride, const int32_t *n_win,
                            const int32_t *n_keys, int32_t max_keys, const float *sink,
                            int32_t n_tok, int32_t H, int32_t dh, float scale, bool round_p,
                            float *o);
    // index_scores over Q4 index keys (rows of di_backend_code_row_bytes(4, DI, KEY_BLOCK) bytes,
    // the key of entry row r at keys + r * that, r as index_scores' row): each key decoded exactly
    // (di_quant_q4_unpack), then index_scores' arithmetic. DI_ERR_INVALID unless DI is a multiple
    // of DI_BACKEND_KEY_BLOCK, and as index_scores.
    di_status (*index_scores_q4)(di_backend *b, const float *qi, const float *wi,
                                 const uint8_t *keys, const int64_t *key_base, const int32_t *pages,
                                 const int32_t *page_off, int32_t per_page, const int32_t *n_vis,
                                 int32_t max_vis, int32_t n_tok, int32_t HI, int32_t DI,
                                 bool round_bf16, float *scores, int64_t score_stride);

    // ---- greedy picks on the device (the sampler's di_argmax; docs/cuda.md "What a step
    // costs") ----
    // ids[r] = the first index of the largest of x[r * stride + 0 .. V) for r < n_rows, exactly
    // sample/sampler.h di_argmax, so a row's pick is the host's whatever the row holds: NaNs never
    // win and a row whose entry 0 is NaN gives 0; equal values (-0 and +0 included) go to the
    // lower index; a row of -inf gives 0. The greedy rows' tokens (the engine's plain greedy
    // rows, DSpark's and MTP's drafts) then cross to the host as V times fewer bytes. The CPU
    // backend scans each row in order (rows over the pool); CUDA: a block per row, float4 loads
    // where the row is 16-byte aligned, warp-shuffle reductions under the same rule. No scratch:
    // graph-capturable. DI_ERR_INVALID (logged) unless 1 <= V <= INT32_MAX and stride >= V.
    di_status (*argmax_rows)(di_backend *b, const float *x, int64_t n_rows, int64_t V,
                             int64_t stride, int32_t *ids);
} di_backend_vt;

struct di_backend {
    const di_backend_vt *vt;
    di_device device;
    char desc[256]; // "cpu (2 threads)", "cuda:0, NVIDIA H200 (sm_90, ...)"
    void *impl;     // owned by the implementation
};

// Opens the backend of `dev`: DI_DEVICE_CPU (n_threads: the CPU kernels' pool, 0 = all cores) or
// DI_DEVICE_CUDA (DI_ERR_UNSUPPORTED without CUDA in this build or without that device).
di_status di_backend_open(const di_device *dev, int n_threads, di_backend **out);
void di_backend_destroy(di_backend *b); // NULL: no-op

// After every backend on the device is destroyed: resets the device so that new backends on it
// work again (CUDA: cudaDeviceReset, which clears a sticky error and frees what the process still
// held there; the CPU: nothing). DI_ERR_CUDA when the reset fails (logged), DI_ERR_UNSUPPORTED for
// CUDA in a build without it.
di_status di_backend_reset_device(const di_device *dev);

// Whether di_backend_hand_over copies from src_b into b directly (the same kind of backend and
// its can_peer), i.e. needs no bounce buffer.
bool di_backend_can_peer(const di_backend *b, const di_backend *src_b);
// b's dst <- src_b's src (bytes; the pipeline stages' hand-over, between the stages' launches):
// peer_copy where di_backend_can_peer (asynchronous, ordered between the two streams; *peer =
// true), else through the host: src_b downloads into `bounce` (host memory of at least `bytes`,
// page-locked for speed: host_alloc), b uploads it (both synchronous; *peer = false). bounce may
// be NULL only where di_backend_can_peer. src_b may be b (a plain copy). Errors of the entries.
di_status di_backend_hand_over(di_backend *b, void *dst, di_backend *src_b, const void *src,
                               size_t bytes, void *bounce, bool *peer);

// The two implementations' constructors (di_backend_open calls them).
di_status di_cpu_backend_create(int n_threads, di_backend **out);
// Test hook (a simulated device loss on the CPU twin): after n_ok more entries (graph commands
// count one each as they replay) the CPU backend b is lost: that entry and every later one return
// DI_ERR_DEVICE_LOST (the frees and destroy still work) until b is destroyed. n_ok 0: the next
// entry fails; n_ok < 0 disarms a pending loss (a lost backend stays lost). The thread using b.
void di_cpu_backend_lose(di_backend *b, int64_t n_ok);
// Whether the CPU backend b is lost (di_cpu_backend_lose); false for every other backend.
bool di_cpu_backend_is_lost(const di_backend *b);
// Test hook: whether the CPU backend b copies to and from other CPU backends directly (can_peer;
// true at create). false: can_peer is false both ways for b, so the pipeline stages hand over
// through the host bounce, as between GPUs without peer access.
void di_cpu_backend_set_peer(di_backend *b, bool on);

// ---- device memory ----
// b's mem_info, or DI_ERR_UNSUPPORTED (not logged) for a backend without the entry.
di_status di_backend_mem_info(di_backend *b, size_t *free_bytes, size_t *total_bytes);
// Test hook: the memory the CPU backend b reports (mem_info) from now on: free_bytes and
// total_bytes, as if b were a device of that size; both 0 (the default) or free_bytes >
// total_bytes: b cannot say (mem_info DI_ERR_UNSUPPORTED, as a backend without the entry). It
// limits nothing (allocations still come from the host, and uploads do not lower it): the stages'
// split and the engine's block count read it, so tests can model unequal or unknown devices.
void di_cpu_backend_set_mem(di_backend *b, size_t free_bytes, size_t total_bytes);
// Test hook: the CPU backend's deferred mode (cpu_backend.c; also DI_CPU_DEFERRED=1 at create): its
// ops, memset, copy, free and graph_launch are queued and run, in order, only where the CUDA
// backend's stream is synchronised (upload, download, sync, weight_upload, host_free, peer_copy of
// either backend, destroy), so host code that touches backend memory without download/upload, or
// hands an op host memory it changes before the next sync, gives different bits on the CPU twin
// too. off: the queue runs first. The thread using b.
void di_cpu_backend_set_deferred(di_backend *b, bool on);
// The commands a CPU backend graph (its graph_end) holds: the entries one launch runs (tests count
// the ops of a captured step with it).
int64_t di_cpu_backend_graph_n_cmds(const void *graph);
di_status di_cuda_backend_create(int device, di_backend **out); // only with DI_HAVE_CUDA
di_status di_cuda_device_reset(int device); // only with DI_HAVE_CUDA (cuda_backend.h)

#ifdef __cplusplus
}
#endif
