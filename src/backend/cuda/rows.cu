// rows — embedding gather, row scatter, position bias, scale, key-list append (rows.cuh).
#include "backend/cuda/common.cuh"
#include "backend/cuda/rows.cuh"

// Grid rows (blockIdx.y) are capped (di_grid_y) and the kernels loop over the rest.
enum { ROWS_THREADS = 256 };

// ---- embedding ----

// Little-endian IEEE half at p (any alignment), exact.
__device__ __forceinline__ float ld_f16(const uint8_t *p) {
    const unsigned short h = (unsigned short)(p[0] | (p[1] << 8));
    return __half2float(__ushort_as_half(h));
}

// Q4_K's 6-bit scale and min of sub-block j (tensor/quant_ref.h di_q4_k_scale_min).
__device__ __forceinline__ void q4_k_scale_min(int j, const uint8_t *q, uint32_t *sc, uint32_t *m) {
    if (j < 4) {
        *sc = q[j] & 63u;
        *m = q[j + 4] & 63u;
    } else {
        *sc = (q[j + 4] & 0xFu) | ((uint32_t)(q[j - 4] >> 6) << 4);
        *m = (uint32_t)(q[j + 4] >> 4) | ((uint32_t)(q[j] >> 6) << 4);
    }
}

// ggml's MXFP4 scale 2^(e - 128) from the bits (di_mxfp4_scale), exact.
__device__ __forceinline__ float mxfp4_scale(uint32_t e) {
    return __uint_as_float(e < 2 ? 0x00200000u << e : (e - 1u) << 23);
}

// Element c of row r of a device table, bit-identical to di_tensor_row_f32 (quant_ref.c): the
// ggml kinds' products and differences are rounded one by one (__fmul_rn / __fsub_rn: no fused
// multiply-add, as the CPU code, which is compiled without contraction).
__device__ float table_at(const di_tensor &w, int64_t r, int64_t c) {
    const uint8_t *row = (const uint8_t *)w.data + (size_t)r * w.nb1;
    switch (w.kind) {
    case DI_TENSOR_KIND_Q8_0: {
        const uint8_t *blk = row + 34 * (c / 32);
        return __fmul_rn((float)(int8_t)blk[2 + c % 32], ld_f16(blk));
    }
    case DI_TENSOR_KIND_Q4_K: {
        const uint8_t *blk = row + 144 * (c / 256);
        const int i = (int)(c % 256), pair = i / 64, l = i % 64, j = 2 * pair + (l >= 32);
        uint32_t sc, m;
        q4_k_scale_min(j, blk + 4, &sc, &m);
        const uint8_t q = blk[16 + 32 * pair + l % 32];
        const float d1 = __fmul_rn(ld_f16(blk), (float)sc),
                    m1 = __fmul_rn(ld_f16(blk + 2), (float)m);
        const float t = __fmul_rn(d1, (float)(l < 32 ? q & 0xFu : q >> 4));
        return __fsub_rn(t, m1);
    }
    case DI_TENSOR_KIND_Q2_K: {
        // Output order of the CPU loop: half h (128 values), shift s (32), part (16), l.
        const uint8_t *blk = row + 84 * (c / 256);
        const int i = (int)(c % 256), h = i / 128, s = (i % 128) / 32, part = (i % 32) / 16,
                  l = i % 16;
        const uint8_t sc = blk[h * 8 + s * 2 + part];
        const float dl = __fmul_rn(ld_f16(blk + 80), (float)(sc & 0xFu));
        const float ml = __fmul_rn(ld_f16(blk + 82), (float)(sc >> 4));
        const uint8_t q = blk[16 + 32 * h + 16 * part + l];
        return __fsub_rn(__fmul_rn(dl, (float)((q >> (2 * s)) & 3u)), ml);
    }
    case DI_TENSOR_KIND_MXFP4: {
        // ggml's kvalues_mxfp4: the e2m1 values doubled.
        const int8_t k_vals[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};
        const uint8_t *blk = row + 17 * (c / 32);
        const int i = (int)(c % 32);
        const uint8_t b = blk[1 + i % 16];
        return __fmul_rn((float)k_vals[i < 16 ? b & 0xFu : b >> 4], mxfp4_scale(blk[0]));
    }
    default: // F32, F16, BF16, FP8, FP4
        return di_w_at(w, r, c);
    }
}

__global__ void embed_kernel(di_tensor table, const int32_t *__restrict__ ids, int32_t n,
                             int32_t copies, float *__restrict__ x) {
    const int64_t D = table.ne[0];
    const int64_t c = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= D) return;
    for (int64_t t = blockIdx.y; t < n; t += gridDim.y) {
        const float v = table_at(table, ids[t], c);
        for (int32_t k = 0; k < copies; k++) x[(t * copies + k) * D + c] = v;
    }
}

extern "C" bool di_cuda_embed_supports(di_tensor_kind kind) {
    switch (kind) {
    case DI_TENSOR_KIND_F32:
    case DI_TENSOR_KIND_F16:
    case DI_TENSOR_KIND_BF16:
    case DI_TENSOR_KIND_FP8:
    case DI_TENSOR_KIND_FP4:
    case DI_TENSOR_KIND_Q8_0:
    case DI_TENSOR_KIND_Q4_K:
    case DI_TENSOR_KIND_Q2_K:
    case DI_TENSOR_KIND_MXFP4:
        return true;
    default:
        return false;
    }
}

extern "C" di_status di_cuda_embed(di_cuda *cu, const di_tensor *table, const int32_t *ids,
                                   int32_t n, int32_t copies, float *x) {
    if (!di_cuda_embed_supports(table->kind) || copies < 1) {
        DI_CUDA_LOG_ERROR("embed: table %s of kind %d, copies %d not supported",
                          table->name ? table->name : "?", (int)table->kind, copies);
        return DI_ERR_INVALID;
    }
    if (n <= 0 || table->ne[0] <= 0) return DI_OK;
    dim3 grid(di_div_up(table->ne[0], ROWS_THREADS), di_grid_y(n));
    embed_kernel<<<grid, ROWS_THREADS, 0, di_stream(cu)>>>(*table, ids, n, copies, x);
    DI_CUDA_LAUNCHED("embed_kernel");
    return DI_OK;
}

// ---- scatter, position bias, scale, key lists ----

// src and dst may be one block (a KV pool's call rows into its rings: disjoint rows), so neither
// is __restrict__.
__global__ void scatter_rows_kernel(const float *src, int64_t n, int64_t src_stride, int64_t width,
                                    float *dst, int64_t dst_stride,
                                    const int32_t *__restrict__ dst_rows,
                                    const int32_t *__restrict__ src_rows) {
    const int64_t c = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= width) return;
    for (int64_t i = blockIdx.y; i < n; i += gridDim.y) {
        const int32_t r = dst_rows[i];
        if (r < 0) continue; // padding
        const int64_t s = src_rows ? src_rows[i] : i;
        dst[(int64_t)r * dst_stride + c] = src[s * src_stride + c];
    }
}

extern "C" di_status di_cuda_scatter_rows(di_cuda *cu, const float *src, int64_t n,
                                          int64_t src_stride, int64_t width, float *dst,
                                          int64_t dst_stride, const int32_t *dst_rows,
                                          const int32_t *src_rows) {
    if (n <= 0 || width <= 0) return DI_OK;
    dim3 grid(di_div_up(width, ROWS_THREADS), di_grid_y(n));
    scatter_rows_kernel<<<grid, ROWS_THREADS, 0, di_stream(cu)>>>(src, n, src_stride, width, dst,
                                                                  dst_stride, dst_rows, src_rows);
    DI_CUDA_LAUNCHED("scatter_rows_kernel");
    return DI_OK;
}

__global__ void add_ape_kernel(float *__restrict__ z, int64_t n, int64_t stride, int64_t width,
                               const float *__restrict__ ape, const int32_t *__restrict__ pos,
                               int32_t m) {
    const int64_t c = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= width) return;
    for (int64_t t = blockIdx.y; t < n; t += gridDim.y) {
        const int32_t slot = ((pos[t] % m) + m) % m;
        z[t * stride + c] += ape[(int64_t)slot * width + c];
    }
}

extern "C" di_status di_cuda_add_ape(di_cuda *cu, float *z, int64_t n, int64_t stride,
                                     int64_t width, const float *ape, const int32_t *pos,
                                     int32_t m) {
    if (m < 1) return DI_ERR_INVALID;
    if (n <= 0 || width <= 0) return DI_OK;
    dim3 grid(di_div_up(width, ROWS_THREADS), di_grid_y(n));
    add_ape_kernel<<<grid, ROWS_THREADS, 0, di_stream(cu)>>>(z, n, stride, width, ape, pos, m);
    DI_CUDA_LAUNCHED("add_ape_kernel");
    return DI_OK;
}

__global__ void scale_kernel(float *__restrict__ x, int64_t n, float s) {
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (int64_t)gridDim.x * blockDim.x)
        x[i] *= s;
}

extern "C" di_status di_cuda_scale(di_cuda *cu, float *x, int64_t n, float s) {
    if (n <= 0) return DI_OK;
    const int64_t blocks = (n + ROWS_THREADS - 1) / ROWS_THREADS;
    scale_kernel<<<(unsigned)(blocks < 65536 ? blocks : 65536), ROWS_THREADS, 0, di_stream(cu)>>>(
        x, n, s);
    DI_CUDA_LAUNCHED("scale_kernel");
    return DI_OK;
}

__global__ void offset_list_kernel(const int32_t *__restrict__ sel, int32_t n_tok, int32_t k,
                                   const int32_t *__restrict__ base,
                                   const int32_t *__restrict__ off,
                                   const int32_t *__restrict__ pages,
                                   const int32_t *__restrict__ page_off, int32_t per_page,
                                   int32_t *__restrict__ dst, int64_t dst_stride) {
    const int64_t n = (int64_t)n_tok * k;
    for (int64_t e = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; e < n;
         e += (int64_t)gridDim.x * blockDim.x) {
        const int64_t t = e / k, i = e % k;
        const int32_t s = sel ? sel[e] : (int32_t)i; // NULL: entry i
        int32_t row = -1;
        if (s >= 0 && !pages) {
            row = base[t] + s;
        } else if (s >= 0) { // the paged entry s: its page's rows, then the offset in it
            const int32_t pg = pages[page_off[t] + s / per_page];
            if (pg >= 0) row = (int32_t)(base[t] + (int64_t)pg * per_page + s % per_page);
        }
        dst[t * dst_stride + off[t] + i] = row;
    }
}

extern "C" di_status di_cuda_offset_list(di_cuda *cu, const int32_t *sel, int32_t n_tok, int32_t k,
                                         const int32_t *base, const int32_t *off,
                                         const int32_t *pages, const int32_t *page_off,
                                         int32_t per_page, int32_t *dst, int64_t dst_stride) {
    if (k < 0 || (pages && per_page < 1)) return DI_ERR_INVALID;
    const int64_t n = (int64_t)n_tok * k;
    if (n_tok <= 0 || n <= 0) return DI_OK;
    const int64_t blocks = (n + ROWS_THREADS - 1) / ROWS_THREADS;
    offset_list_kernel<<<(unsigned)(blocks < 65536 ? blocks : 65536), ROWS_THREADS, 0,
                         di_stream(cu)>>>(sel, n_tok, k, base, off, pages, page_off, per_page, dst,
                                          dst_stride);
    DI_CUDA_LAUNCHED("offset_list_kernel");
    return DI_OK;
}
