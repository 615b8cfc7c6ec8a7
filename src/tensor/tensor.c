#include "tensor/tensor.h"

#include "base/log.h"
#include "tensor/quant_ref.h"

void di_tensor_row_f32(const di_tensor *t, int64_t r, float *out) {
    DI_ASSERT(r >= 0 && r < t->ne[1]);
    const uint8_t *row = (const uint8_t *)t->data + (size_t)r * t->nb1;
    int64_t n = t->ne[0];
    switch (t->kind) {
    case DI_TENSOR_KIND_F32:
        di_dequant_row_f32(DI_DTYPE_F32, row, n, out);
        return;
    case DI_TENSOR_KIND_F16:
        di_dequant_row_f32(DI_DTYPE_F16, row, n, out);
        return;
    case DI_TENSOR_KIND_BF16:
        di_dequant_row_f32(DI_DTYPE_BF16, row, n, out);
        return;
    case DI_TENSOR_KIND_FP8: {
        const uint8_t *srow = t->scale + (size_t)((t->row0 + r) / t->block_out) * t->scale_nb1;
        di_dequant_row_fp8(row, srow, n, t->block_in, out);
        return;
    }
    case DI_TENSOR_KIND_FP4: {
        const uint8_t *srow = t->scale + (size_t)((t->row0 + r) / t->block_out) * t->scale_nb1;
        di_dequant_row_fp4(row, srow, n, t->block_in, out);
        return;
    }
    case DI_TENSOR_KIND_Q8_0:
        di_dequant_row_q8_0(row, n, out);
        return;
    case DI_TENSOR_KIND_Q4_K:
        di_dequant_row_q4_k(row, n, out);
        return;
    case DI_TENSOR_KIND_Q2_K:
        di_dequant_row_q2_k(row, n, out);
        return;
    case DI_TENSOR_KIND_IQ2_XXS:
        di_dequant_row_iq2_xxs(row, n, out);
        return;
    case DI_TENSOR_KIND_MXFP4:
        di_dequant_row_mxfp4(row, n, out);
        return;
    case DI_TENSOR_KIND_COUNT:
        break;
    }
    DI_ASSERT(!"unknown tensor kind");
}

di_tensor di_tensor_rows(const di_tensor *t, int64_t r0, int64_t n) {
    DI_ASSERT(r0 >= 0 && n >= 0 && r0 + n <= t->ne[1]);
    di_tensor v = *t;
    v.data = (const uint8_t *)t->data + (size_t)r0 * t->nb1;
    v.ne[1] = n;
    v.row0 = t->row0 + r0;
    return v;
}

size_t di_tensor_bytes(const di_tensor *t) {
    size_t b = (size_t)t->ne[1] * t->nb1;
    if (t->scale) {
        int64_t srows = (t->ne[1] + t->block_out - 1) / t->block_out;
        b += (size_t)srows * t->scale_nb1;
    }
    return b;
}

const char *di_tensor_kind_name(di_tensor_kind k) {
    switch (k) {
    case DI_TENSOR_KIND_F32:
        return "F32";
    case DI_TENSOR_KIND_F16:
        return "F16";
    case DI_TENSOR_KIND_BF16:
        return "BF16";
    case DI_TENSOR_KIND_FP8:
        return "FP8-e4m3/ue8m0";
    case DI_TENSOR_KIND_FP4:
        return "FP4-e2m1/ue8m0";
    case DI_TENSOR_KIND_Q8_0:
        return "Q8_0";
    case DI_TENSOR_KIND_Q4_K:
        return "Q4_K";
    case DI_TENSOR_KIND_Q2_K:
        return "Q2_K";
    case DI_TENSOR_KIND_IQ2_XXS:
        return "IQ2_XXS";
    case DI_TENSOR_KIND_MXFP4:
        return "MXFP4";
    case DI_TENSOR_KIND_COUNT:
        break;
    }
    return "?";
}

bool di_tensor_kind_block(di_tensor_kind k, int64_t *elems, size_t *bytes) {
    int64_t e;
    size_t b;
    switch (k) {
    case DI_TENSOR_KIND_Q8_0:
        e = 32, b = 34;
        break;
    case DI_TENSOR_KIND_Q4_K:
        e = 256, b = 144;
        break;
    case DI_TENSOR_KIND_Q2_K:
        e = 256, b = 84;
        break;
    case DI_TENSOR_KIND_IQ2_XXS:
        e = 256, b = 66;
        break;
    case DI_TENSOR_KIND_MXFP4:
        e = 32, b = 17;
        break;
    default:
        return false;
    }
    if (elems) *elems = e;
    if (bytes) *bytes = b;
    return true;
}
