// v41 — the Engram gate and the indexer's candidate pool of DeepSeek V4.1 (v41.cuh).
#include <cmath>

#include "backend/backend.h" // di_backend_cand_mode
#include "backend/cuda/common.cuh"
#include "backend/cuda/v41.cuh"

enum { V41_THREADS = 256, MAX_NTB = 1024 };

// ---- Engram gate ----

// One block per (row, stream): the sums of squares of h and key and the dot h * qk * key, then
// g = sigmoid(sign(dot) sqrt(max(|dot|, 1e-6))) and h += g * value.
__global__ void __launch_bounds__(V41_THREADS)
    engram_gate_kernel(const float *__restrict__ kv, const float *__restrict__ qk, int32_t nc,
                       int64_t D, float eps, float *__restrict__ x) {
    __shared__ float red[32];
    const int64_t t = blockIdx.x / nc;
    const int s = (int)(blockIdx.x % nc);
    const float *kvt = kv + t * (nc + 1) * D, *key = kvt + s * D, *val = kvt + nc * D;
    const float *w = qk + s * D;
    float *h = x + (t * nc + s) * D;
    float ss_h = 0, ss_k = 0, dot = 0;
    for (int64_t d = threadIdx.x; d < D; d += blockDim.x) {
        ss_h += h[d] * h[d];
        ss_k += key[d] * key[d];
        dot += h[d] * w[d] * key[d];
    }
    ss_h = di_block_sum(ss_h, red);
    ss_k = di_block_sum(ss_k, red);
    dot = di_block_sum(dot, red);
    dot *= 1.0f / sqrtf(ss_h / (float)D + eps) * (1.0f / sqrtf(ss_k / (float)D + eps)) *
           (1.0f / sqrtf((float)D));
    const float sgn = dot > 0 ? 1.0f : dot < 0 ? -1.0f : 0.0f;
    const float g = 1.0f / (1.0f + expf(-(sgn * sqrtf(fmaxf(fabsf(dot), 1e-6f)))));
    // (di_block_sum synchronised the block: every thread has read h before any writes it.)
    for (int64_t d = threadIdx.x; d < D; d += blockDim.x) h[d] = h[d] + g * val[d];
}

extern "C" di_status di_cuda_engram_gate(di_cuda *cu, const float *kv, const float *qk, int32_t nc,
                                         int64_t D, int32_t n_tok, float eps, float *x) {
    if (nc < 1 || D < 1) return DI_ERR_INVALID;
    if (n_tok <= 0) return DI_OK;
    const int64_t n_blocks = (int64_t)n_tok * nc;
    if (n_blocks > INT32_MAX) return DI_ERR_INVALID;
    engram_gate_kernel<<<(unsigned)n_blocks, V41_THREADS, 0, di_stream(cu)>>>(kv, qk, nc, D, eps,
                                                                              x);
    DI_CUDA_LAUNCHED("engram_gate_kernel");
    return DI_OK;
}

// ---- candidate pool ----

// (v, i) beats (v2, i2): higher value, or equal value and lower index (di_ref_topk's order).
__device__ __forceinline__ bool cand_beats(float v, int64_t i, float v2, int64_t i2) {
    return i2 < 0 || (i >= 0 && (v > v2 || (v == v2 && i < i2)));
}

// Level 1, one block per row: min(ntb, n_blk) rounds, each the best block not yet taken (block
// score = max of its entries; the newest block +inf), then the picks sorted ascending.
__global__ void __launch_bounds__(V41_THREADS)
    cand_build_kernel(const float *__restrict__ scores, int64_t stride,
                      const int32_t *__restrict__ n_vis, int32_t bs, int32_t ntb,
                      int32_t *__restrict__ cand, int32_t *__restrict__ n_cand) {
    __shared__ float bv_w[32];
    __shared__ int64_t bi_w[32];
    __shared__ int32_t picks[MAX_NTB];
    const int64_t t = blockIdx.x;
    const int64_t vis = n_vis[t], n_blk = (vis + bs - 1) / bs;
    const int32_t k = (int32_t)(n_blk < ntb ? n_blk : ntb);
    const float *sc = scores + t * stride;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    for (int32_t r = 0; r < k; r++) {
        float bv = 0.0f;
        int64_t bi = -1;
        for (int64_t b = threadIdx.x; b < n_blk; b += blockDim.x) {
            bool taken = false;
            for (int32_t j = 0; j < r; j++) taken |= picks[j] == b;
            if (taken) continue;
            float mx = -INFINITY;
            for (int64_t w = b * bs; w < (b + 1) * bs && w < vis; w++) mx = fmaxf(mx, sc[w]);
            if (b == n_blk - 1) mx = INFINITY;
            if (cand_beats(mx, b, bv, bi)) bv = mx, bi = b;
        }
        for (int o = 16; o > 0; o >>= 1) {
            const float v2 = __shfl_xor_sync(0xffffffffu, bv, o);
            const int64_t i2 = __shfl_xor_sync(0xffffffffu, bi, o);
            if (cand_beats(v2, i2, bv, bi)) bv = v2, bi = i2;
        }
        if (lane == 0) bv_w[warp] = bv, bi_w[warp] = bi;
        __syncthreads();
        if (threadIdx.x == 0) {
            float v = bv_w[0];
            int64_t i = bi_w[0];
            for (int w = 1; w < nw; w++)
                if (cand_beats(bv_w[w], bi_w[w], v, i)) v = bv_w[w], i = bi_w[w];
            picks[r] = (int32_t)i;
        }
        __syncthreads();
    }
    if (threadIdx.x == 0) {
        for (int32_t i = 1; i < k; i++) { // ascending, as di_ref_topk returns them
            const int32_t p = picks[i];
            int32_t j = i - 1;
            for (; j >= 0 && picks[j] > p; j--) picks[j + 1] = picks[j];
            picks[j + 1] = p;
        }
        for (int32_t i = 0; i < k; i++) cand[t * ntb + i] = picks[i];
        n_cand[t] = k;
    }
}

// Level 2, one thread per (row, entry): -inf outside the row's pool.
__global__ void cand_mask_kernel(float *__restrict__ scores, int64_t stride,
                                 const int32_t *__restrict__ n_vis, int32_t bs, int32_t ntb,
                                 const int32_t *__restrict__ cand,
                                 const int32_t *__restrict__ n_cand) {
    const int64_t t = blockIdx.y, w = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (w >= n_vis[t]) return;
    const int32_t *c = cand + t * ntb;
    bool in = false;
    for (int32_t i = 0; i < n_cand[t] && !in; i++) in = c[i] == w / bs;
    if (!in) scores[t * stride + w] = -INFINITY;
}

// After topk, one thread per row: picks scored -inf dropped, the rest moved up, -1 after.
__global__ void cand_drop_kernel(const float *__restrict__ scores, int64_t stride, int32_t n_tok,
                                 int32_t *__restrict__ sel, int32_t k) {
    const int64_t t = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= n_tok) return;
    int32_t *s = sel + t * k;
    const float *sc = scores + t * stride;
    int32_t n = 0;
    for (int32_t i = 0; i < k; i++)
        if (s[i] >= 0 && sc[s[i]] > -INFINITY) s[n++] = s[i];
    for (int32_t i = n; i < k; i++) s[i] = -1;
}

extern "C" di_status di_cuda_index_cand(di_cuda *cu, int32_t mode, float *scores,
                                        int64_t score_stride, const int32_t *n_vis, int32_t n_tok,
                                        int32_t bs, int32_t ntb, int32_t *cand, int32_t *n_cand,
                                        int32_t *sel, int32_t k) {
    if (bs < 1 || ntb < 1 || ntb > MAX_NTB || k < 1) return DI_ERR_INVALID;
    if (n_tok <= 0) return DI_OK;
    switch (mode) {
    case DI_BACKEND_CAND_BUILD:
        cand_build_kernel<<<(unsigned)n_tok, V41_THREADS, 0, di_stream(cu)>>>(
            scores, score_stride, n_vis, bs, ntb, cand, n_cand);
        DI_CUDA_LAUNCHED("cand_build_kernel");
        return DI_OK;
    case DI_BACKEND_CAND_MASK: {
        // Every row's entries up to the stride (rows with fewer visible return at once).
        const dim3 grid(di_div_up(score_stride, V41_THREADS), (unsigned)n_tok);
        cand_mask_kernel<<<grid, V41_THREADS, 0, di_stream(cu)>>>(scores, score_stride, n_vis, bs,
                                                                  ntb, cand, n_cand);
        DI_CUDA_LAUNCHED("cand_mask_kernel");
        return DI_OK;
    }
    case DI_BACKEND_CAND_DROP:
        cand_drop_kernel<<<di_div_up(n_tok, 128), 128, 0, di_stream(cu)>>>(scores, score_stride,
                                                                           n_tok, sel, k);
        DI_CUDA_LAUNCHED("cand_drop_kernel");
        return DI_OK;
    default:
        return DI_ERR_INVALID;
    }
}
