// common — device-side helpers shared by every .cu of the CUDA backend: CUDA_CHECK (CUDA error ->
// di_status with the error string, logged once where it happens), warp and block reductions, and
// the exact element decoders (FP8 e4m3fn, FP4 e2m1, UE8M0, BF16, F16) that match
// tensor/quant_ref.c bit for bit. C++ (nvcc) only; never included from C.
#pragma once

#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <math.h>
#include <stdint.h>

#include <atomic>

#include "backend/cuda/cuda_backend.h"

// base/log.h uses C-only keywords (_Noreturn); its one function is declared here with C linkage
// (level: 0 error, 1 warn, 2 info, 3 debug as di_log_level).
extern "C" void di_log_write(int level, const char *file, int line, const char *fmt, ...);
#define DI_CUDA_LOG_ERROR(...) di_log_write(0, __FILE__, __LINE__, __VA_ARGS__)
#define DI_CUDA_LOG_WARN(...) di_log_write(1, __FILE__, __LINE__, __VA_ARGS__)

// The tensor-core paths' first-call checks (FP8 cuBLASLt, routed experts, attention): max |ref|
// into *amax and max |got - ref| into *dmax over n host values (a NaN difference makes *dmax
// NaN); true when *dmax <= tol * *amax.
static inline bool di_cuda_close(const float *got, const float *ref, size_t n, double tol,
                                 double *amax, double *dmax) {
    double a = 0.0, d = 0.0;
    for (size_t i = 0; i < n; i++) {
        const double r = ref[i], e = fabs((double)got[i] - r);
        a = fmax(a, fabs(r));
        d = e > d || e != e ? e : d;
    }
    *amax = a;
    *dmax = d;
    return d == d && d <= tol * a;
}

// The di_status of a failed CUDA call (cuda_backend.cu): DI_ERR_DEVICE_LOST for the sticky errors
// that poison the context (di_cuda_error_is_sticky: illegal address or instruction, launch
// failure or timeout, misaligned address, hardware stack error, device-side assert, uncorrectable
// ECC, a contained exception, ...; every later call would fail), which also marks the current
// device lost (di_cuda_lost: the backend's entries then refuse at once, until
// di_cuda_device_reset); DI_ERR_CUDA for every other error.
extern "C" di_status di_cuda_error(cudaError_t e);

// di_cuda_error(e) for an error this call site reports: a non-sticky one is also taken from the
// thread's last error (cudaGetLastError), so no later launch check reports it again.
static inline di_status di_cuda_error_taken(cudaError_t e) {
    const di_status st = di_cuda_error(e);
    if (st != DI_ERR_DEVICE_LOST) (void)cudaGetLastError();
    return st;
}

// Runs a CUDA runtime call; on failure logs it with the CUDA error string and returns its status
// (di_cuda_error: DI_ERR_CUDA, or DI_ERR_DEVICE_LOST for a sticky error) from the enclosing
// function (which must return di_status and own nothing that needs cleanup at that point;
// otherwise use CUDA_TRY with a `fail` label). A failed runtime call also leaves its error as the
// thread's last error, which the next launch check (cudaGetLastError) would report as the failure
// of an unrelated kernel: reported here, it is taken (di_cuda_error_taken; a sticky one stays).
#define CUDA_CHECK(call)                                                                           \
    do {                                                                                           \
        cudaError_t e_ = (call);                                                                   \
        if (e_ != cudaSuccess) {                                                                   \
            DI_CUDA_LOG_ERROR("%s: %s (%s)", #call, cudaGetErrorString(e_), cudaGetErrorName(e_)); \
            return di_cuda_error_taken(e_);                                                        \
        }                                                                                          \
    } while (0)

#define CUDA_TRY(call)                                                                             \
    do {                                                                                           \
        cudaError_t e_ = (call);                                                                   \
        if (e_ != cudaSuccess) {                                                                   \
            DI_CUDA_LOG_ERROR("%s: %s (%s)", #call, cudaGetErrorString(e_), cudaGetErrorName(e_)); \
            st = di_cuda_error_taken(e_);                                                          \
            goto fail;                                                                             \
        }                                                                                          \
    } while (0)

// Propagates a failing di_status to the enclosing function's `fail` label (as base/status.h).
#define DI_TRY(expr)                                                                               \
    do {                                                                                           \
        st = (expr);                                                                               \
        if (st != DI_OK) goto fail;                                                                \
    } while (0)

// After a launch: returns the launch error (bad configuration, missing kernel image) at once.
#define DI_CUDA_LAUNCHED(what)                                                                     \
    do {                                                                                           \
        di_status s_ = di_cuda_check_launch(what);                                                 \
        if (s_ != DI_OK) return s_;                                                                \
    } while (0)

static inline cudaStream_t di_stream(const di_cuda *cu) {
    return (cudaStream_t)cu->stream;
}

// ---- device-side error flags (di_cuda.flags_dev; reported by di_cuda_sync) ----

// A kernel that finds device data outside its contract (a count it was told is bounded) clamps it
// and ors its bit in: the next di_cuda_sync (or download) logs it and returns DI_ERR_INVALID.
enum {
    DI_CUDA_FLAG_ATTN_KEYS = 1, // attention: n_keys[t] < 0 or > max_keys
};

// The attention kernels' key count of a row: n_keys[t] clamped to [0, max_keys], the violation
// flagged (by one thread of the row: `report`).
__device__ __forceinline__ int32_t di_cuda_attn_clamp_keys(int32_t nk, int32_t max_keys, int *flags,
                                                           bool report) {
    if (nk >= 0 && nk <= max_keys) return nk;
    if (report && threadIdx.x == 0) atomicOr(flags, DI_CUDA_FLAG_ATTN_KEYS);
    return nk < 0 ? 0 : max_keys;
}

static inline unsigned di_div_up(int64_t a, int64_t b) {
    return (unsigned)((a + b - 1) / b);
}

// ---- launch limits ----

// gridDim.y (and z) is at most 65,535, gridDim.x 2^31 - 1. A kernel with one grid row per call
// row (or per tile of rows) launches di_grid_y(n) rows and loops over the rest:
//     for (int64_t t = blockIdx.y; t < n; t += gridDim.y) ...
// so a call of any row count launches (before: more than 65,535 rows was a launch error).
enum { DI_CUDA_MAX_GRID_Y = 65535 };

static inline unsigned di_grid_y(int64_t n) {
    return (unsigned)(n < DI_CUDA_MAX_GRID_Y ? n : DI_CUDA_MAX_GRID_Y);
}

// One per kernel that takes dynamic shared memory (a static object at its launch site; zero
// initialised): the kernel's static shared memory, read once (a property of the binary).
struct di_smem_kernel {
    std::atomic<long long> static_plus1; // sharedSizeBytes + 1; 0: not read yet
};

// Whether `dyn` bytes of dynamic shared memory fit `func` on cu's device (current on this thread):
// its static shared memory (cudaFuncGetAttributes(...).sharedSizeBytes) plus dyn must fit the
// per-block opt-in limit (cu->smem_optin counts both). If so, the kernel's dynamic limit
// (cudaFuncAttributeMaxDynamicSharedMemorySize) is set to all that is left (optin - static), at
// every call beyond the default 48 KB (a host-side call, as before): the same value from every
// call and thread, so one call never lowers it below another's launch (pipeline stages sharing a
// device), and it holds after a context reset. *static_bytes (may be NULL) gets the static size.
// DI_ERR_INVALID (does not fit), DI_ERR_CUDA.
static inline di_status di_cuda_smem_fit(di_cuda *cu, di_smem_kernel *k, const void *func,
                                         size_t dyn, size_t *static_bytes) {
    long long s1 = k->static_plus1.load(std::memory_order_relaxed);
    if (s1 == 0) {
        cudaFuncAttributes a;
        CUDA_CHECK(cudaFuncGetAttributes(&a, func));
        s1 = (long long)a.sharedSizeBytes + 1;
        k->static_plus1.store(s1, std::memory_order_relaxed);
    }
    const size_t st = (size_t)(s1 - 1);
    if (static_bytes) *static_bytes = st;
    if (st > cu->smem_optin || dyn > cu->smem_optin - st) return DI_ERR_INVALID;
    if (st + dyn > (size_t)48 * 1024)
        CUDA_CHECK(cudaFuncSetAttribute(func, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                        (int)(cu->smem_optin - st)));
    return DI_OK;
}

// ---- reductions ----

__device__ __forceinline__ float di_warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float di_warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// Block-wide sum/max; every thread gets the result. `red` is shared scratch of 32 floats; the
// block size is a multiple of 32. Contains __syncthreads: call from all threads.
__device__ __forceinline__ float di_block_sum(float v, float *red) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    v = di_warp_sum(v);
    __syncthreads();
    if (lane == 0) red[warp] = v;
    __syncthreads();
    float r = lane < nw ? red[lane] : 0.0f;
    return di_warp_sum(r);
}

__device__ __forceinline__ float di_block_max(float v, float *red) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    v = di_warp_max(v);
    __syncthreads();
    if (lane == 0) red[warp] = v;
    __syncthreads();
    float r = lane < nw ? red[lane] : -INFINITY;
    return di_warp_max(r);
}

// ---- exact element decoders (tensor/quant_ref.c) ----

// FP8 e4m3fn: exponent 0 subnormal (m/8 * 2^-6), 0x7F/0xFF NaN, no infinities.
__device__ __forceinline__ float di_e4m3_f32(uint32_t b) {
    const uint32_t sign = (b & 0x80u) << 24, e = (b >> 3) & 15u, m = b & 7u;
    if ((b & 0x7Fu) == 0x7Fu) return __int_as_float(0x7FC00000u | sign);
    if (e == 0) {
        float v = (float)m * 0.001953125f; // 2^-9
        return sign ? -v : v;
    }
    return __uint_as_float(sign | ((e + 120u) << 23) | (m << 20));
}

// FP4 e2m1 code (low 4 bits): magnitude {0, .5, 1, 1.5, 2, 3, 4, 6}.
__device__ __forceinline__ float di_e2m1_f32(uint32_t c) {
    const uint32_t e = (c >> 1) & 3u, m = c & 1u;
    float v = e == 0 ? 0.5f * (float)m : (1.0f + 0.5f * (float)m) * (float)(1u << (e - 1));
    return (c & 8u) ? -v : v;
}

// UE8M0: 2^(u-127); u = 0 is the subnormal 2^-127, u = 255 NaN.
__device__ __forceinline__ float di_ue8m0_f32(uint32_t u) {
    if (u == 255u) return __int_as_float(0x7FC00000);
    if (u == 0u) return __uint_as_float(0x00400000u);
    return __uint_as_float(u << 23);
}

__device__ __forceinline__ float di_bf16_f32(uint32_t h) {
    return __uint_as_float(h << 16);
}

// f32 -> bf16 -> f32, round to nearest even (di_round_bf16); NaN stays NaN.
__device__ __forceinline__ float di_round_bf16_dev(float x) {
    uint32_t u = __float_as_uint(x);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u) return __uint_as_float((u | 0x00400000u) & 0xFFFF0000u);
    u += 0x7FFFu + ((u >> 16) & 1u);
    return __uint_as_float(u & 0xFFFF0000u);
}

// Element (r, c) of a weight matrix (host or device layout of tensor/tensor.h), exact.
__device__ __forceinline__ float di_w_at(const di_tensor &w, int64_t r, int64_t c) {
    const uint8_t *row = (const uint8_t *)w.data + (size_t)r * w.nb1;
    switch (w.kind) {
    case DI_TENSOR_KIND_F32:
        return ((const float *)row)[c];
    case DI_TENSOR_KIND_F16:
        return __half2float(((const __half *)row)[c]);
    case DI_TENSOR_KIND_BF16:
        return di_bf16_f32(((const uint16_t *)row)[c]);
    case DI_TENSOR_KIND_FP8: {
        const uint8_t *s = w.scale + (size_t)((w.row0 + r) / w.block_out) * w.scale_nb1;
        return di_e4m3_f32(row[c]) * di_ue8m0_f32(s[c / w.block_in]);
    }
    case DI_TENSOR_KIND_FP4: {
        const uint8_t *s = w.scale + (size_t)((w.row0 + r) / w.block_out) * w.scale_nb1;
        uint32_t byte = row[c >> 1];
        return di_e2m1_f32((c & 1) ? byte >> 4 : byte & 15u) * di_ue8m0_f32(s[c / w.block_in]);
    }
    }
    return 0.0f;
}
