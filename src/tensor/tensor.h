/*
 * tensor — di_tensor, a read-only 2-D weight matrix as stored in a checkpoint: plain float rows
 * (F32/F16/BF16) or block-quantised rows (FP8 e4m3 with UE8M0 block scales, FP4 e2m1 pairs with
 * UE8M0 per-32 scales). Matrices are [n_out, n_in] with rows = output features, as in PyTorch.
 * Shapes follow the ggml-style convention: ne[0] = n_in (fastest), ne[1] = n_out; nb1 = bytes
 * between rows. Kernels dequantise row by row (exact: every dequantised value is a float).
 *
 * Owns: nothing — data and scales are views into mapped checkpoint files (or into buffers the
 * caller keeps alive). Thread-safety: immutable; read from any thread.
 */
#pragma once

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "tensor/dtype.h"

typedef enum di_tensor_kind {
    DI_TENSOR_KIND_F32 = 0,
    DI_TENSOR_KIND_F16,
    DI_TENSOR_KIND_BF16,
    DI_TENSOR_KIND_FP8, // e4m3fn bytes; scale[(row0+r)/block_out][c/block_in] UE8M0
    DI_TENSOR_KIND_FP4, // two e2m1 codes per byte (low nibble = even column); scale[row0+r][c/32]
    // ggml block formats from GGUF files (quant_ref.h): self-contained blocks along each row, no
    // separate scale tensor; nb1 = (ne[0] / block) * block bytes.
    DI_TENSOR_KIND_Q8_0,    // 32 per 34-byte block
    DI_TENSOR_KIND_Q4_K,    // 256 per 144-byte block
    DI_TENSOR_KIND_Q2_K,    // 256 per 84-byte block
    DI_TENSOR_KIND_IQ2_XXS, // 256 per 66-byte block
    DI_TENSOR_KIND_MXFP4,   // 32 per 17-byte block
    DI_TENSOR_KIND_COUNT
} di_tensor_kind;

typedef struct di_tensor {
    const char *name; // borrowed (checkpoint directory); for messages
    di_tensor_kind kind;
    int64_t ne[2];        // ne[0] = columns (n_in), ne[1] = rows (n_out)
    size_t nb1;           // bytes between consecutive rows of data
    const void *data;     // view
    const uint8_t *scale; // view; NULL for float kinds
    size_t scale_nb1;     // bytes between scale rows
    int32_t block_out;    // rows per scale row (FP8: 128; FP4: 1)
    int32_t block_in;     // columns per scale (FP8: 128; FP4: 32)
    int64_t row0;         // first row of this view inside the scale grid
} di_tensor;

// Dequantises row r (0 <= r < ne[1]) into out[ne[0]].
void di_tensor_row_f32(const di_tensor *t, int64_t r, float *out);
// A view of rows [r0, r0 + n) of t.
di_tensor di_tensor_rows(const di_tensor *t, int64_t r0, int64_t n);
// Bytes of data and scales the matrix occupies.
size_t di_tensor_bytes(const di_tensor *t);
const char *di_tensor_kind_name(di_tensor_kind k);
// For the ggml block kinds: elements and bytes per block (true); false for the other kinds.
bool di_tensor_kind_block(di_tensor_kind k, int64_t *elems, size_t *bytes);
