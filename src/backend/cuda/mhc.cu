// mhc — hc_pre (RMS-scaled gates + Sinkhorn), V4.1's carried variant, and hc_post (mhc.cuh). One
// block per token; the NC x NC Sinkhorn runs on NC^2 threads (one element each; each row or column
// sum still serial in index order), in the order of model/dsv4.c's hc_pre_task so results match
// to FP32 rounding.
#include "backend/cuda/common.cuh"
#include "backend/cuda/mhc.cuh"

enum { MHC_THREADS = 256 };

__device__ __forceinline__ float sigmoidf_(float x) {
    return 1.0f / (1.0f + expf(-x));
}

__global__ void __launch_bounds__(MHC_THREADS)
    mhc_pre_kernel(const float *__restrict__ x, const float *__restrict__ mix_raw,
                   const float *__restrict__ base, const float *__restrict__ scale, int32_t nc,
                   int64_t D, int32_t iters, float hc_eps, float norm_eps, bool head,
                   const float *__restrict__ pre_in, float *__restrict__ pre_out,
                   float *__restrict__ a, float *__restrict__ post, float *__restrict__ comb) {
    __shared__ float red[32];
    __shared__ float pre[DI_CUDA_MHC_MAX_NC];
    __shared__ float cs[DI_CUDA_MHC_MAX_NC * DI_CUDA_MHC_MAX_NC]; // Sinkhorn's C [nc][nc]
    const int64_t t = blockIdx.x;
    const int n_mix = head ? nc : (2 + nc) * nc;
    const float *xf = x + t * nc * D;
    // The carried collapse (pre_in) without coefficients: V4.1's head.
    if (!mix_raw) {
        float *at = a + t * D;
        const float *p = pre_in + t * nc;
        for (int64_t d = threadIdx.x; d < D; d += blockDim.x) {
            float acc = 0;
            for (int s = 0; s < nc; s++) acc += p[s] * xf[s * D + d];
            at[d] = acc;
        }
        return;
    }
    float ss = 0.0f;
    for (int64_t i = threadIdx.x; i < nc * D; i += blockDim.x) ss = fmaf(xf[i], xf[i], ss);
    ss = di_block_sum(ss, red); // every thread gets it: each computes the same r
    const float r = 1.0f / sqrtf(ss / (float)(nc * D) + norm_eps);
    const float *mr = mix_raw + t * n_mix;
    const int s0 = threadIdx.x;
    if (s0 < nc) {
        pre[s0] = sigmoidf_(mr[s0] * r * scale[0] + base[s0]) + hc_eps;
        if (pre_out) pre_out[t * nc + s0] = pre[s0];
        if (!head) post[t * nc + s0] = 2.0f * sigmoidf_(mr[nc + s0] * r * scale[1] + base[nc + s0]);
    }
    if (!head) {
        // Sinkhorn on nc * nc threads, thread (j, k) owning C[j][k] in shared memory. Each sum is
        // still taken by one thread over its row or column in index order, and every element sees
        // the same operations in the same order as model/dsv4.c's loop (and this kernel's former
        // single-thread loop): the results are unchanged; only the serial chain is nc^2 shorter.
        const int j = threadIdx.x / nc, k = threadIdx.x % nc;
        const bool own = threadIdx.x < nc * nc;
        if (own)
            cs[threadIdx.x] = mr[2 * nc + j * nc + k] * r * scale[2] + base[2 * nc + j * nc + k];
        __syncthreads();
        // Row softmax + eps.
        float v = 0.0f;
        if (own) {
            float mx = cs[j * nc];
            for (int kk = 1; kk < nc; kk++) mx = fmaxf(mx, cs[j * nc + kk]);
            v = expf(cs[threadIdx.x] - mx);
        }
        __syncthreads();
        if (own) cs[threadIdx.x] = v;
        __syncthreads();
        if (own) {
            float sum = 0;
            for (int kk = 0; kk < nc; kk++) sum += cs[j * nc + kk];
            v = cs[threadIdx.x] / sum + hc_eps;
        }
        __syncthreads();
        if (own) cs[threadIdx.x] = v;
        __syncthreads();
        // Column normalisation, then (iters - 1) x (rows, columns).
        for (int it = 0; it < iters; it++) {
            if (it > 0) {
                if (own) {
                    float sum = 0;
                    for (int kk = 0; kk < nc; kk++) sum += cs[j * nc + kk];
                    v = cs[threadIdx.x] / (sum + hc_eps);
                }
                __syncthreads();
                if (own) cs[threadIdx.x] = v;
                __syncthreads();
            }
            if (own) {
                float sum = 0;
                for (int jj = 0; jj < nc; jj++) sum += cs[jj * nc + k];
                v = cs[threadIdx.x] / (sum + hc_eps);
            }
            __syncthreads();
            if (own) cs[threadIdx.x] = v;
            __syncthreads();
        }
        if (own) comb[t * nc * nc + threadIdx.x] = cs[threadIdx.x];
    }
    __syncthreads(); // pre
    float *at = a + t * D;
    const float *p = pre_in ? pre_in + t * nc : pre; // V4.1: the pre carried from the last site
    for (int64_t d = threadIdx.x; d < D; d += blockDim.x) {
        float acc = 0;
        for (int s = 0; s < nc; s++) acc += p[s] * xf[s * D + d];
        at[d] = acc;
    }
}

extern "C" di_status di_cuda_mhc_pre(di_cuda *cu, const float *x, const float *mix_raw,
                                     const float *base, const float *scale, int32_t nc, int64_t D,
                                     int32_t n_tok, int32_t iters, float hc_eps, float norm_eps,
                                     bool head, float *a, float *post, float *comb) {
    if (nc < 1 || nc > DI_CUDA_MHC_MAX_NC) return DI_ERR_INVALID;
    if (n_tok <= 0) return DI_OK;
    mhc_pre_kernel<<<(unsigned)n_tok, MHC_THREADS, 0, di_stream(cu)>>>(
        x, mix_raw, base, scale, nc, D, iters, hc_eps, norm_eps, head, NULL, NULL, a, post, comb);
    DI_CUDA_LAUNCHED("mhc_pre_kernel");
    return DI_OK;
}

extern "C" di_status di_cuda_mhc_pre_carried(di_cuda *cu, const float *x, const float *mix_raw,
                                             const float *base, const float *scale, int32_t nc,
                                             int64_t D, int32_t n_tok, int32_t iters, float hc_eps,
                                             float norm_eps, const float *pre_in, float *a,
                                             float *pre_out, float *post, float *comb) {
    if (nc < 1 || nc > DI_CUDA_MHC_MAX_NC || !pre_in) return DI_ERR_INVALID;
    if (n_tok <= 0) return DI_OK;
    mhc_pre_kernel<<<(unsigned)n_tok, MHC_THREADS, 0, di_stream(cu)>>>(
        x, mix_raw, base, scale, nc, D, iters, hc_eps, norm_eps, false, pre_in, pre_out, a, post,
        comb);
    DI_CUDA_LAUNCHED("mhc_pre_kernel");
    return DI_OK;
}

__global__ void mhc_post_kernel(const float *__restrict__ o, float *__restrict__ x,
                                const float *__restrict__ post, const float *__restrict__ comb,
                                int32_t nc, int64_t D, int64_t n) {
    const int64_t k = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (k >= n) return;
    const int64_t t = k / D, d = k % D;
    float *xt = x + t * nc * D;
    const float *C = comb + t * nc * nc, *pt = post + t * nc;
    float xin[DI_CUDA_MHC_MAX_NC], mixed[DI_CUDA_MHC_MAX_NC];
    for (int j = 0; j < nc; j++) xin[j] = xt[j * D + d];
    for (int kk = 0; kk < nc; kk++) {
        float acc = pt[kk] * o[t * D + d];
        for (int j = 0; j < nc; j++) acc += C[j * nc + kk] * xin[j];
        mixed[kk] = acc;
    }
    for (int kk = 0; kk < nc; kk++) xt[kk * D + d] = mixed[kk];
}

extern "C" di_status di_cuda_mhc_post(di_cuda *cu, const float *o, float *x, const float *post,
                                      const float *comb, int32_t nc, int64_t D, int32_t n_tok) {
    if (nc < 1 || nc > DI_CUDA_MHC_MAX_NC) return DI_ERR_INVALID;
    const int64_t n = (int64_t)n_tok * D;
    if (n <= 0) return DI_OK;
    mhc_post_kernel<<<di_div_up(n, 256), 256, 0, di_stream(cu)>>>(o, x, post, comb, nc, D, n);
    DI_CUDA_LAUNCHED("mhc_post_kernel");
    return DI_OK;
}
