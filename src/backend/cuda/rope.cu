// rope — interleaved partial RoPE (rope.cuh).
#include "backend/cuda/common.cuh"
#include "backend/cuda/rope.cuh"

__global__ void rope_kernel(float *__restrict__ x, int64_t n_rows, int64_t row_stride, int64_t n,
                            int32_t n_rot, const float *__restrict__ omega,
                            const int32_t *__restrict__ pos, int32_t rows_per_pos, float scale,
                            bool inverse) {
    const int32_t half = n_rot / 2;
    const int64_t k = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (k >= n_rows * half) return;
    const int64_t r = k / half;
    const int32_t i = (int32_t)(k % half);
    float *v = x + r * row_stride + (n - n_rot);
    const float ang = (float)pos[r / rows_per_pos] * omega[i]; // one FP32 rounding
    // Full-accuracy cosf/sinf (no fast math): positions reach 1M, angles far beyond 2*pi.
    float c = cosf(ang) * scale, s = sinf(ang) * scale;
    if (inverse) s = -s;
    const float a = v[2 * i], b = v[2 * i + 1];
    v[2 * i] = a * c - b * s;
    v[2 * i + 1] = b * c + a * s;
}

extern "C" di_status di_cuda_rope(di_cuda *cu, float *x, int64_t n_rows, int64_t row_stride,
                                  int64_t n, int32_t n_rot, const float *omega, const int32_t *pos,
                                  int32_t rows_per_pos, float scale, bool inverse) {
    const int64_t total = n_rows * (n_rot / 2);
    if (total <= 0) return DI_OK;
    rope_kernel<<<di_div_up(total, 256), 256, 0, di_stream(cu)>>>(
        x, n_rows, row_stride, n, n_rot, omega, pos, rows_per_pos, scale, inverse);
    DI_CUDA_LAUNCHED("rope_kernel");
    return DI_OK;
}
