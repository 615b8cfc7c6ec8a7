// attn — FP8 KV rows, attention over index-listed keys with the sink, compressor pooling
// (attn.cuh).
#include <cuda_fp8.h>

#include "backend/cuda/attn.cuh"
#include "backend/cuda/common.cuh"

// ---- KV rows ----

// ceil(log2(x)) from the bits (di_ceil_log2_bits): x > 0 and normal.
__device__ __forceinline__ int ceil_log2_bits(float x) {
    const uint32_t u = __float_as_uint(x);
    return (int)((u >> 23) & 0xFFu) - 127 + ((u & 0x7FFFFFu) != 0);
}

// e4m3fn round to nearest even with saturation to ±448 (di_f32_to_e4m3 on finite inputs).
__device__ __forceinline__ uint8_t to_e4m3(float x) {
    return (uint8_t)__nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E4M3);
}

// One warp per row: lanes take 64-dim blocks in turn (two dims per lane per block).
__global__ void kv_quant_kernel(const float *__restrict__ kv, int64_t n, int64_t kv_stride,
                                int32_t dh, int32_t n_rot, int64_t row_bytes,
                                uint8_t *__restrict__ pool, const int32_t *__restrict__ dst_rows) {
    const int64_t i = (int64_t)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    const int lane = threadIdx.x & 31;
    if (i >= n) return;
    const float *v = kv + i * kv_stride;
    uint8_t *row = pool + (int64_t)(dst_rows ? dst_rows[i] : i) * row_bytes;
    const int32_t nope = dh - n_rot, nb = nope / 64;
    for (int32_t b = 0; b < nb; b++) {
        const float x0 = v[b * 64 + lane], x1 = v[b * 64 + 32 + lane];
        float amax = di_warp_max(fmaxf(fabsf(x0), fabsf(x1)));
        amax = fmaxf(amax, 1e-4f);                                      // Q8's floor
        const int k = ceil_log2_bits(amax * (1.0f / 448.0f));           // one f32 rounding
        const float inv_s = __uint_as_float((uint32_t)(127 - k) << 23); // 2^-k, exact
        row[b * 64 + lane] = to_e4m3(x0 * inv_s);
        row[b * 64 + 32 + lane] = to_e4m3(x1 * inv_s);
        if (lane == 0) row[nope + 2 * n_rot + b] = (uint8_t)(127 + k);
    }
    uint16_t *rope = (uint16_t *)(row + nope);
    for (int32_t d = lane; d < n_rot; d += 32)
        rope[d] = (uint16_t)(__float_as_uint(di_round_bf16_dev(v[nope + d])) >> 16);
    for (int64_t p = nope + 2 * n_rot + nb + lane; p < row_bytes; p += 32) row[p] = 0;
}

extern "C" di_status di_cuda_kv_quant(di_cuda *cu, const float *kv, int64_t n, int64_t kv_stride,
                                      int32_t dh, int32_t n_rot, uint8_t *pool,
                                      const int32_t *dst_rows) {
    if ((dh - n_rot) % 64 != 0 || n_rot % 2 != 0 || dh > DI_CUDA_ATTN_MAX_DH) return DI_ERR_INVALID;
    if (n <= 0) return DI_OK;
    kv_quant_kernel<<<di_div_up(n, 8), 256, 0, di_stream(cu)>>>(
        kv, n, kv_stride, dh, n_rot, di_cuda_kv_row_bytes(dh, n_rot), pool, dst_rows);
    DI_CUDA_LAUNCHED("kv_quant_kernel");
    return DI_OK;
}

// Dimension d of a KV row, exact.
__device__ __forceinline__ float kv_at(const uint8_t *row, int32_t d, int32_t nope, int32_t n_rot) {
    if (d < nope) return di_e4m3_f32(row[d]) * di_ue8m0_f32(row[nope + 2 * n_rot + d / 64]);
    return di_bf16_f32(((const uint16_t *)(row + nope))[d - nope]);
}

__global__ void kv_dequant_kernel(const uint8_t *__restrict__ pool,
                                  const int32_t *__restrict__ src_rows, int64_t n, int32_t dh,
                                  int32_t n_rot, int64_t row_bytes, float *__restrict__ out) {
    const int64_t k = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (k >= n * dh) return;
    const int64_t i = k / dh;
    const int32_t d = (int32_t)(k % dh);
    const uint8_t *row = pool + (int64_t)(src_rows ? src_rows[i] : i) * row_bytes;
    out[k] = kv_at(row, d, dh - n_rot, n_rot);
}

extern "C" di_status di_cuda_kv_dequant(di_cuda *cu, const uint8_t *pool, const int32_t *src_rows,
                                        int64_t n, int32_t dh, int32_t n_rot, float *out) {
    if (n <= 0) return DI_OK;
    kv_dequant_kernel<<<di_div_up(n * dh, 256), 256, 0, di_stream(cu)>>>(
        pool, src_rows, n, dh, n_rot, di_cuda_kv_row_bytes(dh, n_rot), out);
    DI_CUDA_LAUNCHED("kv_dequant_kernel");
    return DI_OK;
}

// ---- attention ----

enum {
    ATTN_THREADS = 128,
    ATTN_WARPS = ATTN_THREADS / 32,
    ATTN_PER_LANE = DI_CUDA_ATTN_MAX_DH / 32
};

// One block per (query row, head). Pass 1: a warp per key computes its score (lane l takes dims
// l, l+32, ...: consecutive lanes read consecutive bytes); pass 2: max and sum with the sink;
// pass 3: warps accumulate p_j k_j over their keys in registers, then sum across warps.
// TODO(cuda): a block per (row, group of heads) reading each key once for all heads (MQA), with
// 16-byte loads and the sink softmax done online: the decode-speed version (docs/cuda.md).
__global__ void __launch_bounds__(ATTN_THREADS)
    attn_kernel(const float *__restrict__ q, const uint8_t *__restrict__ pool,
                const int32_t *__restrict__ key_idx, int64_t key_stride,
                const int32_t *__restrict__ n_keys, const float *__restrict__ sink, int32_t H,
                int32_t dh, int32_t n_rot, int64_t row_bytes, float scale, float *__restrict__ o) {
    extern __shared__ float sm[]; // q [dh] | red [ATTN_WARPS * dh] | scores [max_keys]
    __shared__ float red32[32];
    float *qs = sm, *part = sm + dh, *sc = part + ATTN_WARPS * dh;
    const int64_t t = blockIdx.x / H;
    const int32_t h = blockIdx.x % H;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int32_t nope = dh - n_rot, nk = n_keys[t];
    const float *qrow = q + (t * H + h) * dh;
    for (int32_t d = threadIdx.x; d < dh; d += blockDim.x) qs[d] = qrow[d];
    __syncthreads();
    const int32_t *idx = key_idx + t * key_stride;
    for (int32_t j = warp; j < nk; j += ATTN_WARPS) {
        const uint8_t *row = pool + (int64_t)idx[j] * row_bytes;
        float s = 0.0f;
        for (int32_t d = lane; d < dh; d += 32) s = fmaf(qs[d], kv_at(row, d, nope, n_rot), s);
        s = di_warp_sum(s);
        if (lane == 0) sc[j] = s * scale;
    }
    __syncthreads();
    float mx = sink[h];
    for (int32_t j = threadIdx.x; j < nk; j += blockDim.x) mx = fmaxf(mx, sc[j]);
    mx = di_block_max(mx, red32);
    float den = 0.0f;
    for (int32_t j = threadIdx.x; j < nk; j += blockDim.x) den += (sc[j] = expf(sc[j] - mx));
    den = di_block_sum(den, red32) + expf(sink[h] - mx);
    const float inv = 1.0f / den;
    float acc[ATTN_PER_LANE];
    for (int i = 0; i < ATTN_PER_LANE; i++) acc[i] = 0.0f;
    for (int32_t j = warp; j < nk; j += ATTN_WARPS) {
        const uint8_t *row = pool + (int64_t)idx[j] * row_bytes;
        const float p = sc[j] * inv;
#pragma unroll
        for (int i = 0; i < ATTN_PER_LANE; i++) {
            const int32_t d = lane + 32 * i;
            if (d < dh) acc[i] = fmaf(p, kv_at(row, d, nope, n_rot), acc[i]);
        }
    }
#pragma unroll
    for (int i = 0; i < ATTN_PER_LANE; i++) {
        const int32_t d = lane + 32 * i;
        if (d < dh) part[warp * dh + d] = acc[i];
    }
    __syncthreads();
    float *orow = o + (t * H + h) * dh;
    for (int32_t d = threadIdx.x; d < dh; d += blockDim.x) {
        float s = 0.0f;
        for (int w = 0; w < ATTN_WARPS; w++) s += part[w * dh + d];
        orow[d] = s;
    }
}

extern "C" di_status di_cuda_attn(di_cuda *cu, const float *q, const uint8_t *pool,
                                  const int32_t *key_idx, int64_t key_stride, const int32_t *n_keys,
                                  int32_t max_keys, const float *sink, int32_t n_tok, int32_t H,
                                  int32_t dh, int32_t n_rot, float scale, float *o) {
    if ((dh - n_rot) % 64 != 0 || dh > DI_CUDA_ATTN_MAX_DH || max_keys < 0) return DI_ERR_INVALID;
    if (n_tok <= 0 || H <= 0) return DI_OK;
    const size_t smem = sizeof(float) * ((size_t)dh * (1 + ATTN_WARPS) + (size_t)max_keys);
    if (smem > cu->smem_optin) {
        DI_CUDA_LOG_ERROR("attention: %d keys need %zu bytes of shared memory (limit %zu)",
                          max_keys, smem, cu->smem_optin);
        return DI_ERR_INVALID;
    }
    CUDA_CHECK(
        cudaFuncSetAttribute(attn_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
    attn_kernel<<<(unsigned)((int64_t)n_tok * H), ATTN_THREADS, smem, di_stream(cu)>>>(
        q, pool, key_idx, key_stride, n_keys, sink, H, dh, n_rot, di_cuda_kv_row_bytes(dh, n_rot),
        scale, o);
    DI_CUDA_LAUNCHED("attn_kernel");
    return DI_OK;
}

// ---- compressor pooling ----

__global__ void compress_pool_kernel(const float *__restrict__ buf_c,
                                     const float *__restrict__ buf_z,
                                     const float *__restrict__ ovl_c,
                                     const float *__restrict__ ovl_z,
                                     const uint8_t *__restrict__ has_ovl, int32_t n_win, int32_t m,
                                     int32_t c, int32_t d, float *__restrict__ entry) {
    const int64_t k = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (k >= (int64_t)n_win * d) return;
    const int64_t w = k / d;
    const int32_t ch = (int32_t)(k % d), width = c * d;
    const float *bc = buf_c + w * m * width, *bz = buf_z + w * m * width;
    const bool ovl = c == 2 && has_ovl && has_ovl[w];
    const float *oc = ovl ? ovl_c + w * m * d : NULL, *oz = ovl ? ovl_z + w * m * d : NULL;
    const int32_t off = c == 2 ? d : 0; // CSA: this window's slots are the second halves
    float mx = -INFINITY;
    if (ovl)
        for (int32_t j = 0; j < m; j++) mx = fmaxf(mx, oz[j * d + ch]);
    for (int32_t j = 0; j < m; j++) mx = fmaxf(mx, bz[j * width + off + ch]);
    float den = 0, num = 0;
    if (ovl)
        for (int32_t j = 0; j < m; j++) {
            const float p = expf(oz[j * d + ch] - mx);
            den += p;
            num += p * oc[j * d + ch];
        }
    for (int32_t j = 0; j < m; j++) {
        const float p = expf(bz[j * width + off + ch] - mx);
        den += p;
        num += p * bc[j * width + off + ch];
    }
    entry[w * d + ch] = num / den;
}

extern "C" di_status di_cuda_compress_pool(di_cuda *cu, const float *buf_c, const float *buf_z,
                                           const float *ovl_c, const float *ovl_z,
                                           const uint8_t *has_ovl, int32_t n_win, int32_t m,
                                           int32_t c, int32_t d, float *entry) {
    if (c != 1 && c != 2) return DI_ERR_INVALID;
    const int64_t n = (int64_t)n_win * d;
    if (n <= 0) return DI_OK;
    compress_pool_kernel<<<di_div_up(n, 256), 256, 0, di_stream(cu)>>>(
        buf_c, buf_z, ovl_c, ovl_z, has_ovl, n_win, m, c, d, entry);
    DI_CUDA_LAUNCHED("compress_pool_kernel");
    return DI_OK;
}
