/*
 * attn — attention of the V4 layers on the GPU (spec §2.4–§2.7, §3): the FP8 KV row format, the
 * attention of each query over its window rows and compressed entries with the per-head sink, and
 * the compressor's window pooling.
 *
 * KV rows (spec §3.3, the FlashMLA-style `fp8_ds_mla` layout, 584 bytes for head_dim 512):
 *     [0, nope)                      e4m3 codes of the nope dims (nope = Dh - n_rot)
 *     [nope, nope + 2*n_rot)         the rope dims as BF16 (little-endian)
 *     [nope + 2*n_rot, + nope/64)    one UE8M0 scale per 64 nope dims
 *     then zero padding to a multiple of 8 bytes.
 * V4-Flash: 448 + 128 + 7 + 1 = 584. The codes and scales are exactly Q8(nope, 64) of
 * tensor/quant_ref.c (lossless for official-precision KV, which is already Q8-rounded); the rope
 * dims are rounded to BF16 (lossless in official precision).
 *
 * Keys are addressed through per-query index lists into one pool of KV rows, so window rings,
 * paged compressed entries and CSA top-k selections are all the same kernel (as FlashMLA's sparse
 * decode): the caller lists, for query row t, the rows of its n_keys[t] keys.
 *
 * Kernels per key source: the exact FP32 one (the `--precision fp32` recipe and the reference),
 * BF16 tensor cores on mma.sync (any sm_80+ device with the shared memory) and, on a cc 9.0
 * device with sm_90a code, the same on wgmma (wgmma.cuh); the official recipe's dispatch tries
 * wgmma, then mma.sync, each checked once per context against the exact kernel.
 *
 * Thread-safety: engine thread only.
 */
#pragma once

#include "backend/cuda/cuda_backend.h"

#ifdef __cplusplus
extern "C" {
#endif

enum { DI_CUDA_ATTN_MAX_DH = 1024 };

// Bytes of one KV row for head_dim dh with n_rot rope dims ((dh - n_rot) a multiple of 64).
static inline int64_t di_cuda_kv_row_bytes(int32_t dh, int32_t n_rot) {
    const int64_t nope = dh - n_rot, b = nope + 2 * (int64_t)n_rot + nope / 64;
    return (b + 7) / 8 * 8;
}

// Quantises n FP32 rows (kv + i*kv_stride, dh values) into KV rows: row i goes to
// pool + dst_rows[i] * row_bytes (dst_rows NULL: row i; a negative dst_rows[i] skips row i: the
// padding of a graph-stable list). DI_ERR_CUDA, DI_ERR_INVALID (shape).
di_status di_cuda_kv_quant(di_cuda *cu, const float *kv, int64_t n, int64_t kv_stride, int32_t dh,
                           int32_t n_rot, uint8_t *pool, const int32_t *dst_rows);

// Decodes n KV rows (pool rows src_rows[i], or i) to FP32 [n, dh] (tests, debugging).
di_status di_cuda_kv_dequant(di_cuda *cu, const uint8_t *pool, const int32_t *src_rows, int64_t n,
                             int32_t dh, int32_t n_rot, float *out);

// For query row t < n_tok and head h < H:  o[t,h] = sum_j p_j k_j with
// p = softmax over {scale * q[t,h] . k_j : j < n_keys[t], key_idx[t * key_stride + j] >= 0}
// ∪ {sink[h]} (the sink takes mass and gives no value), k_j = the KV row
// key_idx[t * key_stride + j] of pool; a negative index (the top-k's -1 padding) is a masked key.
// q, o: [T, H, dh] FP32; n_keys: device [T] (0 allowed: o = 0); max_keys bounds every n_keys[t]
// (shared memory): a count outside [0, max_keys] (device data, unchecked on the host) is clamped
// to it and flagged (DI_CUDA_FLAG_ATTN_KEYS: the next di_cuda_sync returns DI_ERR_INVALID); every
// attention kernel here does the same. Exact decode, FP32 scores and sums (the `--precision fp32`
// kernel). The inverse RoPE of o is the caller's (rope.cuh). DI_ERR_CUDA, DI_ERR_INVALID.
di_status di_cuda_attn(di_cuda *cu, const float *q, const uint8_t *pool, const int32_t *key_idx,
                       int64_t key_stride, const int32_t *n_keys, int32_t max_keys,
                       const float *sink, int32_t n_tok, int32_t H, int32_t dh, int32_t n_rot,
                       float scale, float *o);

// di_cuda_attn with the official recipe's round_p (di_cuda_attn_f32's): each normalised p is
// rounded to BF16 before p.v (backend.h `attn_kv`: the device-resident forward's R-OFF KV rows).
di_status di_cuda_attn_kv(di_cuda *cu, const float *q, const uint8_t *pool, const int32_t *key_idx,
                          int64_t key_stride, const int32_t *n_keys, int32_t max_keys,
                          const float *sink, int32_t n_tok, int32_t H, int32_t dh, int32_t n_rot,
                          float scale, bool round_p, float *o);

// The same attention over plain FP32 key rows (the device-resident forward's K = V rows, dh floats
// each at pool + idx * dh; backend.h `attn`): the kernel above with another row decoder, so the
// same arithmetic (FP32 scores and sums). Any dh in [1, DI_CUDA_ATTN_MAX_DH], any H; n_keys[t]
// 0 gives o = 0; masked (negative) keys take no mass. DI_ERR_CUDA, DI_ERR_INVALID (shape, or
// max_keys needing more shared memory than the device has). round_p (the official recipe, as the
// CPU forward's di_dsv4_attend_heads): each normalised p is rounded to BF16 before p.v.
di_status di_cuda_attn_f32(di_cuda *cu, const float *q, const float *pool, const int32_t *key_idx,
                           int64_t key_stride, const int32_t *n_keys, int32_t max_keys,
                           const float *sink, int32_t n_tok, int32_t H, int32_t dh, float scale,
                           bool round_p, float *o);

// The same attention over V4.1's stored codes (backend.h attn_codes): key j of row t is the Q8
// window row win + id * (dh + dh / 32) when j < n_win[t], else the Q4e entry ent + id * (dh / 2 +
// dh / 16) (id = key_idx[t * key_stride + j], negative: masked), decoded exactly into BF16 in
// shared memory; a block per (row, group of up to 64 heads, key split) reads each key of its
// split once for its heads, the splits' partials merged by a combine kernel (attn.cu "attention
// over V4.1's stored codes"). FP32 scores, sums and p.v. round_p: the CPU's p is the normalised p
// rounded to BF16; this kernel's is the unrounded p (one pass has no final max and sum when it
// weighs a key), within half a BF16 ulp of it. dh a multiple of 32 up to DI_CUDA_ATTN_MAX_DH; any
// max_keys (shared memory does not grow with it; the split partials come from the pool). An
// n_keys[t] past max_keys is clamped and reported at the next sync as di_cuda_attn's
// (DI_CUDA_FLAG_ATTN_KEYS), n_win[t] clamped to the row's keys. DI_ERR_CUDA, DI_ERR_NOMEM (the
// partials), DI_ERR_INVALID (shape, or a dh whose smallest block does not fit the device's shared
// memory: dh 1024 on an A100).
di_status di_cuda_attn_codes(di_cuda *cu, const float *q, const uint8_t *win, const uint8_t *ent,
                             const int32_t *key_idx, int64_t key_stride, const int32_t *n_win,
                             const int32_t *n_keys, int32_t max_keys, const float *sink,
                             int32_t n_tok, int32_t H, int32_t dh, float scale, bool round_p,
                             float *o);

// di_cuda_attn_codes with its two automatic choices forced (tests, benchmarks): n_split key
// splits per row (0: automatic; clamped to the tiles of max_keys), heads_per_warp 8, 4 or 2 (0:
// automatic: 8 where its shared memory fits, else 4, up to dh 512; 2 above; another value, or one
// not built for this dh: DI_ERR_INVALID). round_p is not an argument: the arithmetic is the same.
di_status di_cuda_attn_codes_ex(di_cuda *cu, const float *q, const uint8_t *win, const uint8_t *ent,
                                const int32_t *key_idx, int64_t key_stride, const int32_t *n_win,
                                const int32_t *n_keys, int32_t max_keys, const float *sink,
                                int32_t n_tok, int32_t H, int32_t dh, float scale, int32_t n_split,
                                int32_t heads_per_warp, float *o);

// The key splits per row that di_cuda_attn_codes picks for this shape (the benchmark's column):
// 1 for an empty call or a bad shape.
int64_t di_cuda_attn_codes_splits(const di_cuda *cu, int32_t n_tok, int32_t H, int32_t dh,
                                  int32_t max_keys);

// di_cuda_attn_codes on BF16 tensor cores (the official recipe's kernel): di_cuda_attn_bf16's
// kernel (attn.cu: the same block, mma.sync fragments, online softmax with the sink, key splits
// and combine) with the codes as its key source: each 64-key tile's Q8 window rows and Q4e
// entries are copied with cp.async (16-, 8- or 4-byte pieces: what the row sizes and bases allow)
// and decoded exactly into the BF16 tile. Numerics (docs/cuda.md): q rounded to BF16 (lossless in
// the official recipe, whose q is BF16: model/dsv41_attn.c; against an FP32 q each score moves by
// <= 2^-8 * scale * sum_d |q_d k_d|), scores and p.v in the MMA's FP32, the unnormalised p rounded
// to BF16 (numerator and denominator), so each weight is within 2u / (1 - u), u = 2^-8, of the
// exact normalised p, and within ~3u of the CPU op's BF16-rounded one (test_cuda_v41_codes checks
// that bound). dh 512, 256 or 128 (else DI_ERR_INVALID: the tiny model's dh 64 stays on
// di_cuda_attn_codes), any H (groups of 64, the last padded), any max_keys; q 16-byte and o
// 8-byte aligned, win and ent 4-byte aligned, else DI_ERR_INVALID. n_split as di_cuda_attn_bf16's
// (0: automatic). Shared memory 206.5 KB at dh 512 (H100 / H200 / B200): DI_ERR_UNSUPPORTED where
// the device has less (A100). n_keys clamped and flagged, n_win clamped, as di_cuda_attn_codes.
// DI_ERR_CUDA, DI_ERR_NOMEM (the split partials), DI_ERR_INVALID, DI_ERR_UNSUPPORTED.
di_status di_cuda_attn_codes_bf16(di_cuda *cu, const float *q, const uint8_t *win,
                                  const uint8_t *ent, const int32_t *key_idx, int64_t key_stride,
                                  const int32_t *n_win, const int32_t *n_keys, int32_t max_keys,
                                  const float *sink, int32_t n_tok, int32_t H, int32_t dh,
                                  float scale, int32_t n_split, float *o);

// di_cuda_attn_codes_bf16 on Hopper's wgmma (attn.cu "attention on wgmma"): the same block, key
// source, decode, online softmax, splits and numerics (the same bound), S = Q K^T and P V on
// wgmma.mma_async (sm_90a) instead of mma.sync. dh 512 only (else DI_ERR_INVALID), alignments as
// di_cuda_attn_codes_bf16's. DI_ERR_UNSUPPORTED on a device that is not cc 9.0, in a binary
// without sm_90a code (wgmma_probe.cuh di_cuda_wgmma_available), or without the 204.5 KB of shared
// memory. Errors otherwise as di_cuda_attn_codes_bf16's.
di_status di_cuda_attn_codes_wg(di_cuda *cu, const float *q, const uint8_t *win, const uint8_t *ent,
                                const int32_t *key_idx, int64_t key_stride, const int32_t *n_win,
                                const int32_t *n_keys, int32_t max_keys, const float *sink,
                                int32_t n_tok, int32_t H, int32_t dh, float scale, int32_t n_split,
                                float *o);

// The device-resident V4.1 forward's attention (backend.h attn_codes, cuda_ops.cu): in the official
// recipe (round_p) on tensor cores (di_cuda_attn_codes_bf16, automatic splits) where the shape, the
// device's shared memory and the alignments allow, else di_cuda_attn_codes (the FP32 recipe
// always). Checked once per context exactly as di_cuda_attn_kv_dispatch (the same helper: the first
// eligible call outside a graph capture and of at most 2^24 output floats runs both and compares; a
// mismatch turns them off for the context, cu->attn_codes_tc, and returns the exact result;
// DI_CUDA_ATTN_TC=0 keeps the exact kernel; cu->n_attn_codes_tc_calls counts the calls). On a
// cc 9.0 device at dh 512 the wgmma kernel (di_cuda_attn_codes_wg) is tried first, checked the same
// way with its own state (cu->attn_codes_wg, cu->n_attn_codes_wg_calls; DI_CUDA_ATTN_WG=0 skips
// it); once it is off (a mismatch or a refusal, logged as a WARN naming the kernel) the mma.sync
// kernel and its own check serve the op. Errors as the kernels'.
di_status di_cuda_attn_codes_dispatch(di_cuda *cu, const float *q, const uint8_t *win,
                                      const uint8_t *ent, const int32_t *key_idx,
                                      int64_t key_stride, const int32_t *n_win,
                                      const int32_t *n_keys, int32_t max_keys, const float *sink,
                                      int32_t n_tok, int32_t H, int32_t dh, float scale,
                                      bool round_p, float *o);

// The same function on tensor cores (the decode-speed kernel, FlashMLA-style sparse decode): one
// block per (query row, group of 64 heads, key split) reads each listed KV row once for all its
// heads, in tiles of 64 keys (cp.async double buffering), decodes them exactly to BF16 in shared
// memory and computes q.k and p.v with BF16 mma.sync (FP32 accumulation) and an online FP32
// softmax with the sink. Numerics (docs/cuda.md): q is rounded to BF16 (lossless in the official
// recipe, where q is already BF16) and the unnormalised probabilities exp(s - running max) are
// rounded to BF16 before p.v (their FP32 sum of the rounded values is the denominator); KV decode
// is exact. Serves the official recipe (R-OFF runs attention in BF16), not `--precision fp32`.
// Shapes: (dh, n_rot) = (512, 64) (V4) or (128, 64) (tiny fixture), any H (groups of 64, the last
// padded), else DI_ERR_INVALID; q 16-byte and o 8-byte aligned. n_split: number of key splits per
// row (0: chosen from n_tok, H, max_keys and the SM count; a value > 1 adds a combine kernel and a
// pool scratch of n_tok * n_split * H * (dh + 2) floats); rounded to whole 64-key tiles.
// Needs ~214 KB of shared memory per block at dh 512 (H100/H200/B200; not A100's 163 KB):
// DI_ERR_UNSUPPORTED where the device has less. DI_ERR_CUDA, DI_ERR_NOMEM (scratch),
// DI_ERR_INVALID (shape, alignment), DI_ERR_UNSUPPORTED.
di_status di_cuda_attn_bf16(di_cuda *cu, const float *q, const uint8_t *pool,
                            const int32_t *key_idx, int64_t key_stride, const int32_t *n_keys,
                            int32_t max_keys, const float *sink, int32_t n_tok, int32_t H,
                            int32_t dh, int32_t n_rot, float scale, int32_t n_split, float *o);

// di_cuda_attn_bf16 on Hopper's wgmma (attn.cu "attention on wgmma"): the same block, decode,
// online softmax, splits and numerics (the same bound), S = Q K^T and P V on wgmma.mma_async
// (sm_90a) instead of mma.sync; 211.5 KB of shared memory. (dh, n_rot) = (512, 64) only (else
// DI_ERR_INVALID), alignments as di_cuda_attn_bf16's. DI_ERR_UNSUPPORTED on a device that is not
// cc 9.0, in a binary without sm_90a code, or without the shared memory. Errors otherwise as
// di_cuda_attn_bf16's.
di_status di_cuda_attn_wg(di_cuda *cu, const float *q, const uint8_t *pool, const int32_t *key_idx,
                          int64_t key_stride, const int32_t *n_keys, int32_t max_keys,
                          const float *sink, int32_t n_tok, int32_t H, int32_t dh, int32_t n_rot,
                          float scale, int32_t n_split, float *o);

// The device-resident forward's attention on FP8 KV rows (backend.h attn_kv, cuda_ops.cu): in the
// official recipe (round_p) on tensor cores (di_cuda_attn_bf16, automatic key splits) where the
// shape, the device's shared memory and the alignments allow, else the exact SIMT kernel
// (di_cuda_attn_kv); the FP32 recipe always on the SIMT kernel. The context's first eligible call
// runs both and compares them (cu->attn_tc, cuda_backend.h): a mismatch turns the tensor cores off
// for the context (logged) and that call returns the SIMT result. Not before that check inside a
// graph capture (the check downloads: such a call runs the SIMT kernel), nor on a call of more than
// 2^24 output floats (a long prefill: the SIMT kernel, the check left to a later call). Numerics of
// the tensor-core path: di_cuda_attn_bf16's (unnormalised p rounded to BF16, not the normalised p
// of round_p; within docs/cuda.md's bound of it). DI_CUDA_ATTN_TC=0 at context create keeps the
// SIMT kernel. On a cc 9.0 device at dh 512 the wgmma kernel (di_cuda_attn_wg) is tried first,
// checked the same way with its own state (cu->attn_wg; DI_CUDA_ATTN_WG=0 skips it); once it is
// off (logged as a WARN naming the kernel), di_cuda_attn_bf16 and its own check serve the op.
// Errors as di_cuda_attn_kv / di_cuda_attn_bf16 / di_cuda_attn_wg.
di_status di_cuda_attn_kv_dispatch(di_cuda *cu, const float *q, const uint8_t *pool,
                                   const int32_t *key_idx, int64_t key_stride,
                                   const int32_t *n_keys, int32_t max_keys, const float *sink,
                                   int32_t n_tok, int32_t H, int32_t dh, int32_t n_rot, float scale,
                                   bool round_p, float *o);

// Compressor pooling (spec §2.5) for n_win closing windows of m tokens, width c*d per token:
// entry[w][ch] = sum over slots softmax(Z[ch]) * C[ch] where the slots are, for c == 1, the m
// tokens (buf_c/buf_z [n_win, m, d]); for c == 2, the overlap (ovl_c/ovl_z [n_win, m, d], only
// when has_ovl[w]) then the second halves of the window's tokens (buf [n_win, m, 2d], [.., d:]).
// Same order of operations as model/dsv4_attn.c compressor_step. entry: [n_win, d].
di_status di_cuda_compress_pool(di_cuda *cu, const float *buf_c, const float *buf_z,
                                const float *ovl_c, const float *ovl_z, const uint8_t *has_ovl,
                                int32_t n_win, int32_t m, int32_t c, int32_t d, float *entry);

// compress_pool_list's "no token in this slot" (= backend.h DI_BACKEND_NO_ROW).
#define DI_CUDA_POOL_NO_ROW INT32_MIN

// The same pooling with the slots named by index lists (backend.h `compress_pool`): for window
// w < n_win, src[w * c*m + j] is slot j's token row: idx >= 0 is row idx of (call_c, call_z),
// call_stride floats apart; idx < 0 (not DI_CUDA_POOL_NO_ROW) is row -idx-1 of the token ring
// (ring_c, ring_z), rows of c*d floats; DI_CUDA_POOL_NO_ROW: no token (skipped). c == 1: slots
// j < m, columns [0, d); c == 2: slots j < m (the overlap) columns [0, d), slots m..2m-1 columns
// [d, 2d). Same operation order as compressor_step (max, then den and num in slot order).
// A window without any token (every slot DI_CUDA_POOL_NO_ROW: padding) gets 0. entry: [n_win, d].
// DI_ERR_INVALID (c, m), DI_ERR_CUDA.
di_status di_cuda_compress_pool_list(di_cuda *cu, const float *call_c, const float *call_z,
                                     int64_t call_stride, const float *ring_c, const float *ring_z,
                                     const int32_t *src, int32_t n_win, int32_t m, int32_t c,
                                     int32_t d, float *entry);

#ifdef __cplusplus
}
#endif
