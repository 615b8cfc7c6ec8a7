/*
 * dtype — the element types found in checkpoints and used by kernels: names as safetensors spells
 * them, element sizes, and which are floating point.
 * Thread-safety: any thread (constant tables).
 */
#pragma once

#include <stdbool.h>
#include <stddef.h>

typedef enum di_dtype {
    DI_DTYPE_F32 = 0,
    DI_DTYPE_F16,
    DI_DTYPE_BF16,
    DI_DTYPE_F64,
    DI_DTYPE_F8_E4M3, // safetensors "F8_E4M3": e4m3fn, max 448, 0x7F/0xFF NaN
    DI_DTYPE_F8_E5M2, // "F8_E5M2" (recognised; no model tensor uses it)
    DI_DTYPE_F8_E8M0, // "F8_E8M0": UE8M0 power-of-two scale, 2^(u-127)
    DI_DTYPE_I8,      // "I8"; also packed FP4 e2m1 pairs in the official expert layout
    DI_DTYPE_U8,
    DI_DTYPE_I16,
    DI_DTYPE_I32,
    DI_DTYPE_I64,
    DI_DTYPE_BOOL,
    // ggml block formats, found only in GGUF files (never in safetensors headers: they have no
    // element size, di_dtype_size is 0 and di_dtype_from_name does not accept them). Shapes still
    // count elements; the bytes follow the block (di_tensor_kind_block).
    DI_DTYPE_GGML_Q8_0,
    DI_DTYPE_GGML_Q4_K,
    DI_DTYPE_GGML_Q2_K,
    DI_DTYPE_GGML_IQ2_XXS,
    DI_DTYPE_GGML_MXFP4,
    DI_DTYPE_COUNT
} di_dtype;

// Bytes per element; 0 for the ggml block formats.
size_t di_dtype_size(di_dtype t);
// "F32", "BF16", ... as in safetensors headers.
const char *di_dtype_name(di_dtype t);
// Parses a safetensors dtype string; false if unknown (and for the ggml block formats).
bool di_dtype_from_name(const char *name, di_dtype *out);
// F32, F16, BF16, F64.
bool di_dtype_is_float(di_dtype t);
// True for the DI_DTYPE_GGML_* block formats.
bool di_dtype_is_ggml_block(di_dtype t);
