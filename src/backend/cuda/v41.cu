// v41 — the Engram gate and the indexer's candidate pool of DeepSeek V4.1 (v41.cuh).
#include <cmath>

#include "backend/backend.h" // di_backend_cand_mode
#include "backend/cuda/common.cuh"
#include "backend/cuda/indexer.cuh" // di_cuda_topk
#include "backend/cuda/v41.cuh"

enum { V41_THREADS = 256 };

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

// Level 1, one thread per (row, block): the block's best score (the newest block +inf) into
// work; block 0 of each row also writes its block count into n_cand (di_cuda_topk's n_vis).
__global__ void cand_blocks_kernel(const float *__restrict__ scores, int64_t stride,
                                   const int32_t *__restrict__ n_vis, int32_t bs,
                                   float *__restrict__ work, int64_t wstride, int32_t n_tok,
                                   int32_t *__restrict__ n_cand) {
    const int64_t b = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    for (int64_t t = blockIdx.y; t < n_tok; t += gridDim.y) { // di_grid_y: any n_tok
        const int64_t vis = n_vis[t], n_blk = (vis + bs - 1) / bs;
        if (b == 0) n_cand[t] = (int32_t)n_blk;
        if (b >= n_blk) continue;
        const float *sc = scores + t * stride;
        float mx = -INFINITY;
        for (int64_t w = b * bs; w < (b + 1) * bs && w < vis; w++) mx = fmaxf(mx, sc[w]);
        work[t * wstride + b] = b == n_blk - 1 ? INFINITY : mx;
    }
}

// n_cand[t] = min(ntb, blocks): the picks di_cuda_topk kept.
__global__ void cand_count_kernel(int32_t *__restrict__ n_cand, int32_t n_tok, int32_t ntb) {
    const int64_t t = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (t < n_tok && n_cand[t] > ntb) n_cand[t] = ntb;
}

// Level 2, one thread per (row, entry): -inf outside the row's pool.
__global__ void cand_mask_kernel(float *__restrict__ scores, int64_t stride,
                                 const int32_t *__restrict__ n_vis, int32_t bs, int32_t ntb,
                                 const int32_t *__restrict__ cand,
                                 const int32_t *__restrict__ n_cand, int32_t n_tok) {
    const int64_t w = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    for (int64_t t = blockIdx.y; t < n_tok; t += gridDim.y) { // di_grid_y: any n_tok
        if (w >= n_vis[t]) continue;
        const int32_t *c = cand + t * ntb;
        bool in = false;
        for (int32_t i = 0; i < n_cand[t] && !in; i++) in = c[i] == w / bs;
        if (!in) scores[t * stride + w] = -INFINITY;
    }
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
                                        int32_t *sel, int32_t k, float *work) {
    if (bs < 1 || ntb < 1 || k < 1 || (mode == DI_BACKEND_CAND_BUILD && !work))
        return DI_ERR_INVALID;
    if (n_tok <= 0) return DI_OK;
    switch (mode) {
    case DI_BACKEND_CAND_BUILD: {
        const int64_t wstride = score_stride / bs + 1;
        const dim3 grid(di_div_up(wstride, V41_THREADS), di_grid_y(n_tok));
        cand_blocks_kernel<<<grid, V41_THREADS, 0, di_stream(cu)>>>(scores, score_stride, n_vis, bs,
                                                                    work, wstride, n_tok, n_cand);
        DI_CUDA_LAUNCHED("cand_blocks_kernel");
        const di_status st = di_cuda_topk(cu, work, wstride, n_cand, n_tok, ntb, cand);
        if (st != DI_OK) return st;
        cand_count_kernel<<<di_div_up(n_tok, 128), 128, 0, di_stream(cu)>>>(n_cand, n_tok, ntb);
        DI_CUDA_LAUNCHED("cand_count_kernel");
        return DI_OK;
    }
    case DI_BACKEND_CAND_MASK: {
        // Every row's entries up to the stride (rows with fewer visible return at once).
        if (score_stride <= 0) return DI_OK; // no entries
        const dim3 grid(di_div_up(score_stride, V41_THREADS), di_grid_y(n_tok));
        cand_mask_kernel<<<grid, V41_THREADS, 0, di_stream(cu)>>>(scores, score_stride, n_vis, bs,
                                                                  ntb, cand, n_cand, n_tok);
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
