/*
 * rows — row moves and small element-wise ops of the device-resident forward (backend/backend.h):
 * the token embedding gathered from a device weight table (every kind a checkpoint embedding can
 * have, decoded exactly as tensor/tensor.c di_tensor_row_f32), row scatters (ring updates,
 * compressed entries), the compressor's position bias, a scalar scale, and the key-list append
 * of compressed entries (CSA's selected ones, HCA's visible ones), translated through a page table.
 *
 * Owns: nothing. Thread-safety: engine thread only (enqueues on cu->stream).
 */
#pragma once

#include "backend/cuda/cuda_backend.h"

#ifdef __cplusplus
extern "C" {
#endif

// Whether di_cuda_embed decodes tables of this kind: F32, F16, BF16, FP8, FP4, Q8_0, Q4_K, Q2_K,
// MXFP4 (not IQ2_XXS: its 2 KB grid table is not on the device).
bool di_cuda_embed_supports(di_tensor_kind kind);

// x[(t * copies + k) * D + i] = table row ids[t], element i, as FP32 (D = table->ne[0]) for
// t < n, k < copies: bit-identical to di_tensor_row_f32. table: a device tensor
// (di_cuda_tensor_upload); ids: device [n], each in [0, table->ne[1]) (the caller validated the
// tokens). DI_ERR_INVALID (kind, copies < 1), DI_ERR_CUDA.
di_status di_cuda_embed(di_cuda *cu, const di_tensor *table, const int32_t *ids, int32_t n,
                        int32_t copies, float *x);

// dst + dst_rows[i] * dst_stride <- src + s_i * src_stride (`width` floats) for i < n, s_i =
// src_rows[i] (device [n]) or i when src_rows is NULL; a negative dst_rows[i] skips row i
// (padding). No two dst_rows >= 0 equal; no row written is read (src and dst may be one block).
// DI_ERR_CUDA.
di_status di_cuda_scatter_rows(di_cuda *cu, const float *src, int64_t n, int64_t src_stride,
                               int64_t width, float *dst, int64_t dst_stride,
                               const int32_t *dst_rows, const int32_t *src_rows);

// z[t * stride + i] += ape[(pos[t] mod m) * width + i] for t < n, i < width (pos >= 0 in the
// model; a negative pos takes the mathematical modulus). DI_ERR_INVALID (m < 1), DI_ERR_CUDA.
di_status di_cuda_add_ape(di_cuda *cu, float *z, int64_t n, int64_t stride, int64_t width,
                          const float *ape, const int32_t *pos, int32_t m);

// x[i] *= s for i < n. DI_ERR_CUDA.
di_status di_cuda_scale(di_cuda *cu, float *x, int64_t n, float s);

// dst[t * dst_stride + off[t] + i] = the row of entry s = sel[t*k + i] for i < k, t < n_tok, or
// -1 when s < 0; sel NULL stands for sel[t*k + i] = i. The row: base[t] + s (pages NULL), or
// base[t] + pages[page_off[t] + s / per_page] * per_page + s % per_page (-1 for a negative page):
// backend.h offset_list. DI_ERR_INVALID (k < 0; per_page < 1 with pages), DI_ERR_CUDA.
di_status di_cuda_offset_list(di_cuda *cu, const int32_t *sel, int32_t n_tok, int32_t k,
                              const int32_t *base, const int32_t *off, const int32_t *pages,
                              const int32_t *page_off, int32_t per_page, int32_t *dst,
                              int64_t dst_stride);

#ifdef __cplusplus
}
#endif
