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
// pool + dst_rows[i] * row_bytes (dst_rows NULL: row i). DI_ERR_CUDA, DI_ERR_INVALID (shape).
di_status di_cuda_kv_quant(di_cuda *cu, const float *kv, int64_t n, int64_t kv_stride, int32_t dh,
                           int32_t n_rot, uint8_t *pool, const int32_t *dst_rows);

// Decodes n KV rows (pool rows src_rows[i], or i) to FP32 [n, dh] (tests, debugging).
di_status di_cuda_kv_dequant(di_cuda *cu, const uint8_t *pool, const int32_t *src_rows, int64_t n,
                             int32_t dh, int32_t n_rot, float *out);

// For query row t < n_tok and head h < H:  o[t,h] = sum_j p_j k_j with
// p = softmax over {scale * q[t,h] . k_j : j < n_keys[t]} ∪ {sink[h]} (the sink takes mass and
// gives no value), k_j = the KV row key_idx[t * key_stride + j] of pool. q, o: [T, H, dh] FP32;
// n_keys: device [T] (0 allowed: o = 0); max_keys bounds every n_keys[t] (shared memory).
// The inverse RoPE of o is the caller's (rope.cuh). DI_ERR_CUDA, DI_ERR_INVALID.
di_status di_cuda_attn(di_cuda *cu, const float *q, const uint8_t *pool, const int32_t *key_idx,
                       int64_t key_stride, const int32_t *n_keys, int32_t max_keys,
                       const float *sink, int32_t n_tok, int32_t H, int32_t dh, int32_t n_rot,
                       float scale, float *o);

// Compressor pooling (spec §2.5) for n_win closing windows of m tokens, width c*d per token:
// entry[w][ch] = sum over slots softmax(Z[ch]) * C[ch] where the slots are, for c == 1, the m
// tokens (buf_c/buf_z [n_win, m, d]); for c == 2, the overlap (ovl_c/ovl_z [n_win, m, d], only
// when has_ovl[w]) then the second halves of the window's tokens (buf [n_win, m, 2d], [.., d:]).
// Same order of operations as model/dsv4_attn.c compressor_step. entry: [n_win, d].
di_status di_cuda_compress_pool(di_cuda *cu, const float *buf_c, const float *buf_z,
                                const float *ovl_c, const float *ovl_z, const uint8_t *has_ovl,
                                int32_t n_win, int32_t m, int32_t c, int32_t d, float *entry);

#ifdef __cplusplus
}
#endif
