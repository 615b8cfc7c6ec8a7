#include "tensor/dtype.h"

#include <string.h>

static const struct {
    const char *name;
    size_t size;
} k_dtypes[DI_DTYPE_COUNT] = {
    [DI_DTYPE_F32] = {"F32", 4},
    [DI_DTYPE_F16] = {"F16", 2},
    [DI_DTYPE_BF16] = {"BF16", 2},
    [DI_DTYPE_F64] = {"F64", 8},
    [DI_DTYPE_F8_E4M3] = {"F8_E4M3", 1},
    [DI_DTYPE_F8_E5M2] = {"F8_E5M2", 1},
    [DI_DTYPE_F8_E8M0] = {"F8_E8M0", 1},
    [DI_DTYPE_I8] = {"I8", 1},
    [DI_DTYPE_U8] = {"U8", 1},
    [DI_DTYPE_I16] = {"I16", 2},
    [DI_DTYPE_I32] = {"I32", 4},
    [DI_DTYPE_I64] = {"I64", 8},
    [DI_DTYPE_BOOL] = {"BOOL", 1},
    [DI_DTYPE_GGML_Q8_0] = {"GGML_Q8_0", 0},
    [DI_DTYPE_GGML_Q4_K] = {"GGML_Q4_K", 0},
    [DI_DTYPE_GGML_Q2_K] = {"GGML_Q2_K", 0},
    [DI_DTYPE_GGML_IQ2_XXS] = {"GGML_IQ2_XXS", 0},
    [DI_DTYPE_GGML_MXFP4] = {"GGML_MXFP4", 0},
};

size_t di_dtype_size(di_dtype t) {
    return (unsigned)t < DI_DTYPE_COUNT ? k_dtypes[t].size : 0;
}

const char *di_dtype_name(di_dtype t) {
    return (unsigned)t < DI_DTYPE_COUNT ? k_dtypes[t].name : "?";
}

bool di_dtype_from_name(const char *name, di_dtype *out) {
    for (int i = 0; i < DI_DTYPE_COUNT; i++) {
        if (k_dtypes[i].size && strcmp(name, k_dtypes[i].name) == 0) {
            *out = (di_dtype)i;
            return true;
        }
    }
    return false;
}

bool di_dtype_is_float(di_dtype t) {
    return t == DI_DTYPE_F32 || t == DI_DTYPE_F16 || t == DI_DTYPE_BF16 || t == DI_DTYPE_F64;
}

bool di_dtype_is_ggml_block(di_dtype t) {
    return t >= DI_DTYPE_GGML_Q8_0 && t <= DI_DTYPE_GGML_MXFP4;
}
