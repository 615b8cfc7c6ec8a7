// sample — the greedy pick of device logit rows (sample.cuh).
#include <stdint.h>

#include "backend/cuda/common.cuh"
#include "backend/cuda/sample.cuh"

// 512 threads: a 129,280-entry row is ~63 float4 loads a thread, enough in flight to stream the
// row at the SM's share of HBM; a decode step has few rows, so a row must not be a small block.
enum { ARGMAX_THREADS = 512 };

// The running pick (v, i) of a thread; i == INT32_MAX: none yet (every value seen was NaN).
// (ov, oi) replaces it when larger, or equal (== : -0 and +0 too) at a lower index: the first
// index of the maximum, whatever order the candidates come in. NaN candidates are never offered.
__device__ __forceinline__ void pick(float &v, int32_t &i, float ov, int32_t oi) {
    if (ov > v || (ov == v && oi < i)) v = ov, i = oi;
}

__device__ __forceinline__ void offer(float &v, int32_t &i, float x, int32_t xi) {
    if (x == x) pick(v, i, x, xi); // NaNs never win
}

__global__ void __launch_bounds__(ARGMAX_THREADS)
    argmax_rows_kernel(const float *__restrict__ x, int32_t V, int64_t stride,
                       int32_t *__restrict__ ids) {
    const float *row = x + (int64_t)blockIdx.x * stride;
    // Entries before the first 16-byte boundary, then float4s, then the tail: every entry is
    // offered once, by one thread.
    int32_t head = (int32_t)((16 - ((uintptr_t)row & 15)) & 15) / 4;
    // Not even float-aligned (never for backend memory; kept correct anyway): scalar loads only.
    if ((uintptr_t)row & 3) head = V;
    if (head > V) head = V;
    const int32_t n4 = (V - head) / 4, tail0 = head + 4 * n4;
    float v = -INFINITY;
    int32_t i = INT32_MAX;
    for (int32_t k = threadIdx.x; k < head; k += blockDim.x) offer(v, i, row[k], k);
    const float4 *r4 = (const float4 *)(row + head);
    for (int32_t k = threadIdx.x; k < n4; k += blockDim.x) {
        const float4 q = __ldg(r4 + k);
        const int32_t b = head + 4 * k;
        offer(v, i, q.x, b);
        offer(v, i, q.y, b + 1);
        offer(v, i, q.z, b + 2);
        offer(v, i, q.w, b + 3);
    }
    for (int32_t k = tail0 + threadIdx.x; k < V; k += blockDim.x) offer(v, i, row[k], k);
    // A thread's -inf start with no index loses to any offered value, -inf included (equal, lower
    // index), so a row of -inf picks its index 0.
    for (int o = 16; o > 0; o >>= 1)
        pick(v, i, __shfl_xor_sync(0xffffffffu, v, o), __shfl_xor_sync(0xffffffffu, i, o));
    __shared__ float sv[ARGMAX_THREADS / 32];
    __shared__ int32_t si[ARGMAX_THREADS / 32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    if (lane == 0) sv[warp] = v, si[warp] = i;
    __syncthreads();
    if (warp != 0) return;
    v = lane < nw ? sv[lane] : -INFINITY;
    i = lane < nw ? si[lane] : INT32_MAX;
    for (int o = 16; o > 0; o >>= 1)
        pick(v, i, __shfl_xor_sync(0xffffffffu, v, o), __shfl_xor_sync(0xffffffffu, i, o));
    if (lane == 0) {
        // The host's scan starts at entry 0: a NaN there is never beaten (NaN comparisons are
        // false), and a row of NaNs keeps 0 too.
        const float x0 = row[0];
        ids[blockIdx.x] = (x0 != x0 || i == INT32_MAX) ? 0 : i;
    }
}

extern "C" di_status di_cuda_argmax_rows(di_cuda *cu, const float *x, int64_t n_rows, int64_t V,
                                         int64_t stride, int32_t *ids) {
    if (V < 1 || V > INT32_MAX || stride < V || n_rows < 0 || n_rows > INT32_MAX) {
        DI_CUDA_LOG_ERROR("cuda argmax_rows: %lld rows of %lld values %lld apart",
                          (long long)n_rows, (long long)V, (long long)stride);
        return DI_ERR_INVALID;
    }
    if (n_rows == 0) return DI_OK;
    argmax_rows_kernel<<<(unsigned)n_rows, ARGMAX_THREADS, 0, di_stream(cu)>>>(x, (int32_t)V,
                                                                               stride, ids);
    DI_CUDA_LAUNCHED("argmax_rows_kernel");
    return DI_OK;
}
