// quant — BF16 rounding, Q8 / Q4 / Q4e fake quantisation and the Hadamard transform (quant.cuh).
#include <cmath>
#include <cuda_fp8.h>

#include "backend/backend.h" // DI_BACKEND_Q4E

#include "backend/cuda/common.cuh"
#include "backend/cuda/quant.cuh"

enum { QUANT_THREADS = 128 };

// ---- BF16 rounding ----

__global__ void round_bf16_kernel(float *__restrict__ x, int64_t n) {
    const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] = di_round_bf16_dev(x[i]);
}

extern "C" di_status di_cuda_round_bf16(di_cuda *cu, float *x, int64_t n) {
    if (n <= 0) return DI_OK;
    round_bf16_kernel<<<di_div_up(n, 256), 256, 0, di_stream(cu)>>>(x, n);
    DI_CUDA_LAUNCHED("round_bf16_kernel");
    return DI_OK;
}

// ---- fake quantisation ----

// ceil(log2(x)) from the bits (di_ceil_log2_bits): x > 0 and normal.
__device__ __forceinline__ int fq_ceil_log2(float x) {
    const uint32_t u = __float_as_uint(x);
    return (int)((u >> 23) & 0xFFu) - 127 + ((u & 0x7FFFFFu) != 0);
}

// e4m3fn grid value of x in [-448, 448], round to nearest even (di_f32_to_e4m3 then back).
__device__ __forceinline__ float e4m3_grid(float x) {
    const uint32_t b = (uint32_t)__nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E4M3);
    return di_e4m3_f32(b);
}

// The e2m1 code of x in [-6, 6] (di_f32_to_e2m1: ties to the even code; bit 3 the sign, kept for
// zeros).
__device__ __forceinline__ uint32_t e2m1_code(float x) {
    const float mag[8] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};
    const float a = fabsf(x);
    uint32_t c = 0;
    while (c < 7) {
        const float mid = 0.5f * (mag[c] + mag[c + 1]);
        if (a < mid) break;
        if (a == mid) {
            if (c & 1u) c++;
            break;
        }
        c++;
    }
    return (signbit(x) ? 8u : 0u) | c;
}

// e2m1 grid value of x in [-6, 6] (di_f32_to_e2m1 then back; the sign of zero kept).
__device__ __forceinline__ float e2m1_grid(float x) {
    return di_e2m1_f32(e2m1_code(x));
}

// One block per (row, quantisation block), row-major over the grid: amax (exact), the power-of-two
// scale as fake_quant_block computes it (fl32(amax * fl32(1/qmax)), ceil_log2 from the bits), then
// each value divided by it (a multiply by the exact 2^-k: the same correctly rounded quotient),
// clamped, put on the grid and scaled back (exact). y may be x (in place: di_cuda_moe's h, the
// backend's fake_quant entry), so neither pointer is __restrict__.
__global__ void __launch_bounds__(QUANT_THREADS)
    fake_quant_kernel(const float *x, int64_t n, int64_t stride, int32_t block, int32_t bits,
                      float *y) {
    __shared__ float red[32];
    const int64_t nb = n / block, r = blockIdx.x / nb;
    const int64_t off = r * stride + (blockIdx.x % nb) * block;
    const float *v = x + off;
    float *o = y + off;
    float amax = 0.0f, bad = 0.0f;
    for (int32_t j = threadIdx.x; j < block; j += blockDim.x) {
        const float a = fabsf(v[j]);
        if (!isfinite(a)) bad = 1.0f;
        amax = fmaxf(amax, isfinite(a) ? a : 0.0f);
    }
    amax = di_block_max(amax, red);
    bad = di_block_max(bad, red);
    if (bad > 0.0f) { // the PyTorch reference's NaN scale (fake_quant_block)
        for (int32_t j = threadIdx.x; j < block; j += blockDim.x) o[j] = NAN;
        return;
    }
    if (bits == DI_BACKEND_Q4E) { // an E4M3 scale of amax / 6 (floored at 2^-9), by division
        const float sc = di_e4m3_f32((uint32_t)__nv_cvt_float_to_fp8(
            __fdiv_rn(fmaxf(amax, 6.0f * 0x1p-9f), 6.0f), __NV_SATFINITE, __NV_E4M3));
        for (int32_t j = threadIdx.x; j < block; j += blockDim.x) {
            const float q = fminf(fmaxf(__fdiv_rn(v[j], sc), -6.0f), 6.0f);
            o[j] = e2m1_grid(q) * sc;
        }
        return;
    }
    const bool q8 = bits == 8;
    const float qmax = q8 ? 448.0f : 6.0f, inv_qmax = q8 ? 1.0f / 448.0f : 1.0f / 6.0f;
    amax = fmaxf(amax, q8 ? 1e-4f : 6.0f * 0x1p-126f);
    const int k = fq_ceil_log2(amax * inv_qmax); // one f32 rounding
    const float s = ldexpf(1.0f, k), inv_s = ldexpf(1.0f, -k);
    for (int32_t j = threadIdx.x; j < block; j += blockDim.x) {
        float q = v[j] * inv_s;
        q = fminf(fmaxf(q, -qmax), qmax);
        o[j] = (q8 ? e4m3_grid(q) : e2m1_grid(q)) * s;
    }
}

extern "C" di_status di_cuda_fake_quant(di_cuda *cu, const float *x, int64_t n_rows, int64_t n,
                                        int64_t stride, int32_t block, int32_t bits, float *y) {
    if (block < 1 || block > 1024 || n % block != 0 || n > stride ||
        (bits != 8 && bits != 4 && bits != DI_BACKEND_Q4E))
        return DI_ERR_INVALID;
    if (n_rows <= 0 || n <= 0) return DI_OK;
    const int64_t n_blocks = n_rows * (n / block);
    if (n_blocks > INT32_MAX) return DI_ERR_INVALID;
    fake_quant_kernel<<<(unsigned)n_blocks, QUANT_THREADS, 0, di_stream(cu)>>>(x, n, stride, block,
                                                                               bits, y);
    DI_CUDA_LAUNCHED("fake_quant_kernel");
    return DI_OK;
}

// ---- Hadamard ----

// One block per row, n / 2 threads (at least one): the butterflies of di_hadamard in shared
// memory, stage by stage (element j's additions in the CPU's order), then * fl32(n^-1/2).
__global__ void hadamard_kernel(float *__restrict__ x, int32_t n, float scale) {
    extern __shared__ float v[];
    float *row = x + (int64_t)blockIdx.x * n;
    for (int32_t i = threadIdx.x; i < n; i += blockDim.x) v[i] = row[i];
    __syncthreads();
    for (int32_t h = 1; h < n; h *= 2) {
        for (int32_t p = threadIdx.x; p < n / 2; p += blockDim.x) {
            const int32_t j = (p / h) * 2 * h + p % h;
            const float a = v[j], b = v[j + h];
            v[j] = a + b;
            v[j + h] = a - b;
        }
        __syncthreads();
    }
    for (int32_t i = threadIdx.x; i < n; i += blockDim.x) row[i] = v[i] * scale;
}

extern "C" di_status di_cuda_hadamard(di_cuda *cu, float *x, int64_t n_rows, int64_t n) {
    if (n < 1 || n > 1024 || (n & (n - 1)) != 0 || n_rows > INT32_MAX) return DI_ERR_INVALID;
    if (n_rows <= 0) return DI_OK;
    const float scale = (float)(1.0 / sqrt((double)n)); // fl32(n^-1/2), as di_hadamard
    const int threads = n >= 64 ? (int)(n / 2) : 32;
    hadamard_kernel<<<(unsigned)n_rows, threads, sizeof(float) * (size_t)n, di_stream(cu)>>>(
        x, (int32_t)n, scale);
    DI_CUDA_LAUNCHED("hadamard_kernel");
    return DI_OK;
}

// ---- V4.1's packed codes (backend.h pack_rows; e2m1_code above) ----

// One block per (row, quantisation block): fake_quant_kernel's scale, then each value's code
// (4-bit codes: a thread per pair of values, one byte each, so no two threads share a byte) and
// the block's scale byte, exactly di_quant_*_pack's bytes (a non-finite block: zero codes and the
// NaN scale byte).
__global__ void __launch_bounds__(QUANT_THREADS)
    pack_rows_kernel(const float *__restrict__ x, int64_t x_stride, int32_t n_dims, int32_t block,
                     int32_t bits, int64_t row_bytes, uint8_t *__restrict__ dst,
                     const int32_t *__restrict__ dst_rows, const int32_t *__restrict__ src_rows) {
    __shared__ float red[32];
    const int32_t nb = n_dims / block, blk = (int32_t)(blockIdx.x % (unsigned)nb);
    const int64_t i = blockIdx.x / (unsigned)nb;
    const int64_t r = dst_rows ? dst_rows[i] : i;
    if (r < 0) return; // padding, skipped (block-uniform)
    const float *v = x + (src_rows ? (int64_t)src_rows[i] : i) * x_stride + (int64_t)blk * block;
    uint8_t *row = dst + r * row_bytes;
    const bool nib = bits != 8;
    uint8_t *codes = row + (nib ? (int64_t)blk * block / 2 : (int64_t)blk * block);
    uint8_t *scale = row + (nib ? n_dims / 2 : n_dims) + blk;
    float amax = 0.0f, bad = 0.0f;
    for (int32_t j = threadIdx.x; j < block; j += blockDim.x) {
        const float a = fabsf(v[j]);
        if (!isfinite(a)) bad = 1.0f;
        amax = fmaxf(amax, isfinite(a) ? a : 0.0f);
    }
    amax = di_block_max(amax, red);
    bad = di_block_max(bad, red);
    if (bad > 0.0f) {
        for (int32_t j = threadIdx.x; j < (nib ? block / 2 : block); j += blockDim.x) codes[j] = 0;
        if (threadIdx.x == 0) *scale = bits == DI_BACKEND_Q4E ? 0x7Fu : 0xFFu;
        return;
    }
    if (bits == DI_BACKEND_Q4E) { // an E4M3 scale of amax / 6 (floored at 2^-9), by division
        const uint32_t sb = (uint32_t)__nv_cvt_float_to_fp8(
            __fdiv_rn(fmaxf(amax, 6.0f * 0x1p-9f), 6.0f), __NV_SATFINITE, __NV_E4M3);
        const float sc = di_e4m3_f32(sb);
        for (int32_t j = threadIdx.x; j < block / 2; j += blockDim.x) {
            const float q0 = fminf(fmaxf(__fdiv_rn(v[2 * j], sc), -6.0f), 6.0f);
            const float q1 = fminf(fmaxf(__fdiv_rn(v[2 * j + 1], sc), -6.0f), 6.0f);
            codes[j] = (uint8_t)(e2m1_code(q0) | (e2m1_code(q1) << 4));
        }
        if (threadIdx.x == 0) *scale = (uint8_t)sb;
        return;
    }
    const bool q8 = bits == 8;
    const float qmax = q8 ? 448.0f : 6.0f, inv_qmax = q8 ? 1.0f / 448.0f : 1.0f / 6.0f;
    amax = fmaxf(amax, q8 ? 1e-4f : 6.0f * 0x1p-126f);
    const int k = fq_ceil_log2(amax * inv_qmax); // one f32 rounding
    const float inv_s = ldexpf(1.0f, -k);
    if (q8) {
        for (int32_t j = threadIdx.x; j < block; j += blockDim.x) {
            const float q = fminf(fmaxf(v[j] * inv_s, -qmax), qmax);
            codes[j] = (uint8_t)__nv_cvt_float_to_fp8(q, __NV_SATFINITE, __NV_E4M3);
        }
    } else {
        for (int32_t j = threadIdx.x; j < block / 2; j += blockDim.x) {
            const float q0 = fminf(fmaxf(v[2 * j] * inv_s, -qmax), qmax);
            const float q1 = fminf(fmaxf(v[2 * j + 1] * inv_s, -qmax), qmax);
            codes[j] = (uint8_t)(e2m1_code(q0) | (e2m1_code(q1) << 4));
        }
    }
    if (threadIdx.x == 0) *scale = (uint8_t)(127 + k);
}

extern "C" di_status di_cuda_pack_rows(di_cuda *cu, const float *x, int64_t n, int64_t x_stride,
                                       int32_t n_dims, int32_t block, int32_t bits, uint8_t *dst,
                                       const int32_t *dst_rows, const int32_t *src_rows) {
    if (block < 2 || block % 2 != 0 || n_dims < block || n_dims > 1024 || n_dims % block != 0 ||
        (bits != 8 && bits != 4 && bits != DI_BACKEND_Q4E))
        return DI_ERR_INVALID;
    if (n <= 0) return DI_OK;
    const int64_t n_blocks = n * (n_dims / block);
    if (n_blocks > INT32_MAX) return DI_ERR_INVALID;
    pack_rows_kernel<<<(unsigned)n_blocks, QUANT_THREADS, 0, di_stream(cu)>>>(
        x, x_stride, n_dims, block, bits, di_backend_code_row_bytes(bits, n_dims, block), dst,
        dst_rows, src_rows);
    DI_CUDA_LAUNCHED("pack_rows_kernel");
    return DI_OK;
}
