// norm — RMSNorm and softmax rows (norm.cuh).
#include "backend/cuda/common.cuh"
#include "backend/cuda/norm.cuh"

enum { NORM_THREADS = 256, SOFTMAX_THREADS = 1024 };

__global__ void __launch_bounds__(NORM_THREADS)
    rmsnorm_kernel(float *__restrict__ x, int64_t n, int64_t stride, const float *__restrict__ w,
                   float eps) {
    __shared__ float red[32];
    float *v = x + (int64_t)blockIdx.x * stride;
    float ss = 0.0f;
    for (int64_t i = threadIdx.x; i < n; i += blockDim.x) ss = fmaf(v[i], v[i], ss);
    ss = di_block_sum(ss, red);
    // As the reference: 1 / sqrt(mean + eps), then w * (v * inv).
    const float inv = 1.0f / sqrtf(ss / (float)n + eps);
    for (int64_t i = threadIdx.x; i < n; i += blockDim.x)
        v[i] = w ? w[i] * (v[i] * inv) : v[i] * inv;
}

extern "C" di_status di_cuda_rmsnorm(di_cuda *cu, float *x, int64_t n_rows, int64_t n,
                                     int64_t stride, const float *w, float eps) {
    if (n_rows <= 0) return DI_OK;
    rmsnorm_kernel<<<(unsigned)n_rows, NORM_THREADS, 0, di_stream(cu)>>>(x, n, stride, w, eps);
    DI_CUDA_LAUNCHED("rmsnorm_kernel");
    return DI_OK;
}

__global__ void __launch_bounds__(SOFTMAX_THREADS)
    softmax_kernel(float *__restrict__ x, int64_t n, int64_t stride, float inv_temp) {
    __shared__ float red[32];
    float *v = x + (int64_t)blockIdx.x * stride;
    float mx = -INFINITY;
    for (int64_t i = threadIdx.x; i < n; i += blockDim.x) mx = fmaxf(mx, v[i] * inv_temp);
    mx = di_block_max(mx, red);
    float sum = 0.0f;
    for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
        float e = expf(v[i] * inv_temp - mx);
        v[i] = e;
        sum += e;
    }
    sum = di_block_sum(sum, red);
    const float inv = 1.0f / sum;
    for (int64_t i = threadIdx.x; i < n; i += blockDim.x) v[i] *= inv;
}

extern "C" di_status di_cuda_softmax(di_cuda *cu, float *x, int64_t n_rows, int64_t n,
                                     int64_t stride, float temperature) {
    if (n_rows <= 0) return DI_OK;
    softmax_kernel<<<(unsigned)n_rows, SOFTMAX_THREADS, 0, di_stream(cu)>>>(x, n, stride,
                                                                            1.0f / temperature);
    DI_CUDA_LAUNCHED("softmax_kernel");
    return DI_OK;
}
