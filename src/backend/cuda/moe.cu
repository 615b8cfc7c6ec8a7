// moe — router, expert grouping, SwiGLU, combine and the whole MoE layer (moe.cuh).
#include "backend/cuda/common.cuh"
#include "backend/cuda/gemm.cuh"
#include "backend/cuda/moe.cuh"
#include "backend/cuda/moe_tc.cuh" // di_cuda_moe_grouped_a8
#include "backend/cuda/quant.cuh"

enum { ROUTER_THREADS = 256, GROUP_THREADS = 1024, MAX_E = 4096, MAX_K = 16 };

// ---- router ----

// (v, e) beats (v2, e2): higher value, or equal value and lower id.
__device__ __forceinline__ bool beats(float v, int e, float v2, int e2) {
    return e2 < 0 || (e >= 0 && (v > v2 || (v == v2 && e < e2)));
}

__global__ void __launch_bounds__(ROUTER_THREADS)
    router_kernel(const float *__restrict__ logits, const float *__restrict__ bias,
                  const int32_t *__restrict__ tid2eid, const int32_t *__restrict__ ids, int32_t E,
                  int32_t K, float route_scale, bool hf_eps, int32_t *__restrict__ sel,
                  float *__restrict__ wgt) {
    extern __shared__ float s[]; // [E] scores
    __shared__ float wv[32];
    __shared__ int wi[32];
    __shared__ int se[MAX_K];
    const int64_t t = blockIdx.x;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    for (int e = threadIdx.x; e < E; e += blockDim.x) {
        const float x = logits[t * E + e];
        s[e] = sqrtf(x > 20.0f ? x : log1pf(expf(x))); // softplus with PyTorch's threshold 20
    }
    __syncthreads();
    if (tid2eid) {
        if (threadIdx.x < K) se[threadIdx.x] = tid2eid[(int64_t)ids[t] * K + threadIdx.x];
    } else {
        for (int k = 0; k < K; k++) {
            float bv = 0.0f;
            int be = -1;
            for (int e = threadIdx.x; e < E; e += blockDim.x) {
                bool taken = false;
                for (int j = 0; j < k; j++) taken |= se[j] == e;
                const float v = s[e] + (bias ? bias[e] : 0.0f);
                if (!taken && beats(v, e, bv, be)) bv = v, be = e;
            }
            for (int o = 16; o > 0; o >>= 1) {
                const float v2 = __shfl_xor_sync(0xffffffffu, bv, o);
                const int e2 = __shfl_xor_sync(0xffffffffu, be, o);
                if (beats(v2, e2, bv, be)) bv = v2, be = e2;
            }
            if (lane == 0) wv[warp] = bv, wi[warp] = be;
            __syncthreads();
            if (threadIdx.x == 0) {
                float v = wv[0];
                int e = wi[0];
                for (int w = 1; w < nw; w++)
                    if (beats(wv[w], wi[w], v, e)) v = wv[w], e = wi[w];
                se[k] = e;
            }
            __syncthreads();
        }
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        float sum = 0;
        for (int k = 0; k < K; k++) sum += s[se[k]];
        if (hf_eps) sum += 1e-20f; // R-HF's denominator epsilon
        for (int k = 0; k < K; k++) {
            sel[t * K + k] = se[k];
            wgt[t * K + k] = s[se[k]] / sum * route_scale;
        }
    }
}

extern "C" di_status di_cuda_router(di_cuda *cu, const float *logits, const float *bias,
                                    const int32_t *tid2eid, const int32_t *ids, int32_t n_tok,
                                    int32_t E, int32_t K, float route_scale, bool hf_eps,
                                    int32_t *sel, float *wgt) {
    if (E < 1 || E > MAX_E || K < 1 || K > MAX_K || K > E) return DI_ERR_INVALID;
    if (n_tok <= 0) return DI_OK;
    router_kernel<<<(unsigned)n_tok, ROUTER_THREADS, sizeof(float) * (size_t)E, di_stream(cu)>>>(
        logits, bias, tid2eid, ids, E, K, route_scale, hf_eps, sel, wgt);
    DI_CUDA_LAUNCHED("router_kernel");
    return DI_OK;
}

// ---- grouping ----

// One block. The counts by shared atomics (the totals do not depend on their order), the prefix
// sums in thread 0, then the pairs placed chunk by chunk (blockDim pairs) in pair order: inside a
// warp the lanes of one expert take consecutive rows in lane order (__match_any_sync), and the
// warps take their turn in order, so each expert's rows hold its pairs in ascending pair order —
// the only order the result may have, the same as the former kernel's (which walked all pairs once
// per expert per thread: O(T*K) each).
__global__ void __launch_bounds__(GROUP_THREADS)
    group_kernel(const int32_t *__restrict__ sel, int32_t n_pairs, int32_t K, int32_t E,
                 int32_t *__restrict__ offsets, int32_t *__restrict__ rows,
                 int32_t *__restrict__ row_of_pair) {
    __shared__ int32_t cnt[MAX_E + 1]; // counts, then each expert's next free row
    for (int e = threadIdx.x; e < E; e += blockDim.x) cnt[e] = 0;
    __syncthreads();
    for (int32_t p = threadIdx.x; p < n_pairs; p += blockDim.x) {
        const int32_t e = sel[p];
        if (e >= 0 && e < E) atomicAdd(&cnt[e], 1); // an id out of range is not grouped
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        int32_t acc = 0;
        for (int e = 0; e < E; e++) {
            const int32_t c = cnt[e];
            cnt[e] = acc;
            offsets[e] = acc;
            acc += c;
        }
        offsets[E] = acc;
    }
    __syncthreads();
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    for (int32_t p0 = 0; p0 < n_pairs; p0 += blockDim.x) { // block-uniform
        const int32_t p = p0 + threadIdx.x;
        int32_t e = p < n_pairs ? sel[p] : -1;
        if (e >= E) e = -1;
        const bool valid = e >= 0;
        const unsigned peers = __match_any_sync(0xffffffffu, e);
        const int rank = __popc(peers & ((1u << lane) - 1u));
        const bool last = lane == 31 - __clz(peers); // the group's highest lane advances cnt
        for (int w = 0; w < nw; w++) {
            int32_t r = 0;
            if (warp == w && valid) r = cnt[e] + rank;
            __syncwarp(); // every lane of the group has read cnt[e] before `last` moves it
            if (warp == w && valid) {
                rows[r] = p / K;
                row_of_pair[p] = r;
                if (last) cnt[e] = r + 1;
            }
            __syncthreads(); // the next warp sees this warp's cursors
        }
    }
}

extern "C" di_status di_cuda_moe_group(di_cuda *cu, const int32_t *sel, int32_t n_pairs, int32_t K,
                                       int32_t E, int32_t *offsets, int32_t *rows,
                                       int32_t *row_of_pair) {
    if (E < 1 || E > MAX_E) return DI_ERR_INVALID;
    group_kernel<<<1, GROUP_THREADS, 0, di_stream(cu)>>>(sel, n_pairs, K, E, offsets, rows,
                                                         row_of_pair);
    DI_CUDA_LAUNCHED("group_kernel");
    return DI_OK;
}

// ---- SwiGLU and combine ----

__global__ void swiglu_kernel(float *__restrict__ g, const float *__restrict__ u, int64_t n,
                              float limit) {
    const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    float gt = g[i], up = u[i];
    if (limit > 0) {
        gt = fminf(gt, limit);
        up = fminf(fmaxf(up, -limit), limit);
    }
    g[i] = gt / (1.0f + expf(-gt)) * up;
}

extern "C" di_status di_cuda_swiglu(di_cuda *cu, float *g, const float *u, int64_t n_rows,
                                    int64_t F, float limit) {
    const int64_t n = n_rows * F;
    if (n <= 0) return DI_OK;
    swiglu_kernel<<<di_div_up(n, 256), 256, 0, di_stream(cu)>>>(g, u, n, limit);
    DI_CUDA_LAUNCHED("swiglu_kernel");
    return DI_OK;
}

__global__ void combine_kernel(const float *__restrict__ y, const int32_t *__restrict__ row_of_pair,
                               const int32_t *__restrict__ sel, const float *__restrict__ wgt,
                               const float *__restrict__ shared, int32_t n_tok, int32_t K,
                               int64_t D, float *__restrict__ out) {
    const int64_t d = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (d >= D) return;
    for (int64_t t = blockIdx.y; t < n_tok; t += gridDim.y) { // di_grid_y: any n_tok
        // The token's slots sorted by (expert, slot): the CPU adds experts in ascending id.
        int order[MAX_K];
        for (int k = 0; k < K; k++) order[k] = k;
        for (int i = 1; i < K; i++)
            for (int j = i; j > 0 && sel[t * K + order[j]] < sel[t * K + order[j - 1]]; j--) {
                const int tmp = order[j];
                order[j] = order[j - 1];
                order[j - 1] = tmp;
            }
        float acc = 0.0f;
        for (int i = 0; i < K; i++) {
            const int k = order[i];
            // Separate product and sum roundings, as the CPU's y *= w; o += y.
            const float yv = y[(int64_t)row_of_pair[t * K + k] * D + d];
            acc = __fadd_rn(acc, wgt ? __fmul_rn(yv, wgt[t * K + k]) : yv);
        }
        if (shared) acc = __fadd_rn(acc, shared[t * D + d]);
        out[t * D + d] = acc;
    }
}

extern "C" di_status di_cuda_moe_combine(di_cuda *cu, const float *y, const int32_t *row_of_pair,
                                         const int32_t *sel, const float *wgt, const float *shared,
                                         int32_t n_tok, int32_t K, int64_t D, float *out) {
    if (K < 1 || K > MAX_K) return DI_ERR_INVALID;
    if (n_tok <= 0) return DI_OK;
    if (D <= 0) return DI_OK;
    dim3 grid(di_div_up(D, 256), di_grid_y(n_tok));
    combine_kernel<<<grid, 256, 0, di_stream(cu)>>>(y, row_of_pair, sel, wgt, shared, n_tok, K, D,
                                                    out);
    DI_CUDA_LAUNCHED("combine_kernel");
    return DI_OK;
}

// g[row_of_pair[p], :] *= wgt[p] for every pair p (official recipe: the routing weight scales h
// before w2; each grouped row is one pair's).
__global__ void scale_pairs_kernel(float *__restrict__ g, const int32_t *__restrict__ row_of_pair,
                                   const float *__restrict__ wgt, int64_t n, int64_t F) {
    const int64_t k = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (k >= n) return;
    const int64_t p = k / F;
    float *v = g + (int64_t)row_of_pair[p] * F + k % F;
    *v = __fmul_rn(*v, wgt[p]);
}

static di_status scale_pairs(di_cuda *cu, float *g, const int32_t *row_of_pair, const float *wgt,
                             int32_t n_pairs, int64_t F) {
    const int64_t n = (int64_t)n_pairs * F;
    if (n <= 0) return DI_OK;
    scale_pairs_kernel<<<di_div_up(n, 256), 256, 0, di_stream(cu)>>>(g, row_of_pair, wgt, n, F);
    DI_CUDA_LAUNCHED("scale_pairs_kernel");
    return DI_OK;
}

static bool quantised(di_tensor_kind k) {
    return k == DI_TENSOR_KIND_FP8 || k == DI_TENSOR_KIND_FP4;
}

// ---- the whole layer ----

// A routed linear over the grouped rows: A8 inputs (the official recipe) through
// di_cuda_moe_grouped_a8 (tensor cores for prefill), else the SIMT grouped kernel.
static di_status routed(di_cuda *cu, const di_cuda_moe_w *w, bool a8, const di_tensor *ex,
                        int64_t n_out, int64_t n_in, const int32_t *offsets, int32_t P,
                        const int32_t *rows, const float *x, int64_t n_x_rows, float *y,
                        int32_t n_tok, int32_t hint) {
    if (a8)
        return di_cuda_moe_grouped_a8(cu, w->routed_kind, ex, w->n_expert, n_out, n_in, offsets, P,
                                      rows, x, n_x_rows, n_in, y, n_out, n_tok, hint);
    return di_cuda_matmul_grouped(cu, ex, w->n_expert, n_out, n_in, offsets, rows, x, n_in, y,
                                  n_out, hint);
}

// x[i] /= t over n values (V4.1's router temperature: a true division, as dsv4_moe.c).
__global__ void div_kernel(float *__restrict__ x, int64_t n, float t) {
    const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] = __fdiv_rn(x[i], t);
}

extern "C" di_status di_cuda_moe(di_cuda *cu, const di_cuda_moe_w *w, const float *f,
                                 const int32_t *ids, int32_t n_tok, float *out, int32_t *sel_out,
                                 float *wgt_out) {
    if (n_tok <= 0) return DI_OK;
    di_status st = DI_OK;
    const int32_t E = w->n_expert, K = w->n_used, P = n_tok * K;
    const int64_t D = w->D, F = w->F, Fs = w->sh_w1.ne[1];
    // The official recipe (model/dsv4_moe.c): A8 of the FP8/FP4 linears' inputs (Q8, blocks of
    // 128, V4.1 32; per weight kind, as di_dsv4_linear decides), every linear's output in BF16, the
    // weight on h before w2, h and the output in BF16.
    const bool off = w->official;
    const int32_t a8 = w->a8_block > 0 ? w->a8_block : 128;
    const bool aq_r = off && quantised(w->routed_kind), aq_s1 = off && quantised(w->sh_w1.kind);
    const bool aq_s2 = off && quantised(w->sh_w2.kind), aq_s3 = off && quantised(w->sh_w3.kind);
    const int64_t gw = (int64_t)P * F > n_tok * Fs ? (int64_t)P * F : n_tok * Fs;
    void *b[11] = {0};
    const size_t sizes[11] = {
        sizeof(float) * (size_t)n_tok * E, // 0 logits
        sizeof(int32_t) * (size_t)P,       // 1 sel
        sizeof(float) * (size_t)P,         // 2 wgt
        sizeof(int32_t) * (size_t)(E + 1), // 3 offsets
        sizeof(int32_t) * (size_t)P,       // 4 rows
        sizeof(int32_t) * (size_t)P,       // 5 row_of_pair
        sizeof(float) * (size_t)gw,        // 6 g (routed; also the shared expert's g)
        sizeof(float) * (size_t)gw,        // 7 u
        sizeof(float) * (size_t)P * D,     // 8 y (routed outputs, grouped)
        sizeof(float) * (size_t)n_tok * D, // 9 shared expert output
        // 10 official: A8 of f [T, D] (the routed w1/w3 read it by token row, like f)
        (aq_r || aq_s1 || aq_s3) ? sizeof(float) * (size_t)n_tok * (size_t)D : 1,
    };
    for (int i = 0; i < 11; i++) DI_TRY(di_cuda_alloc(cu, sizes[i], &b[i]));
    {
        float *logits = (float *)b[0], *wgt = wgt_out ? wgt_out : (float *)b[2];
        int32_t *sel = sel_out ? sel_out : (int32_t *)b[1];
        int32_t *offsets = (int32_t *)b[3], *rows = (int32_t *)b[4], *rop = (int32_t *)b[5];
        float *g = (float *)b[6], *u = (float *)b[7], *y = (float *)b[8], *sh = (float *)b[9];
        float *fq = (float *)b[10];
        DI_TRY(di_cuda_matmul(cu, &w->gate, f, n_tok, D, logits, E)); // [T, E]
        if (w->gate_temp > 0) {
            const int64_t n = (int64_t)n_tok * E;
            div_kernel<<<di_div_up(n, 256), 256, 0, di_stream(cu)>>>(logits, n, w->gate_temp);
            DI_TRY(di_cuda_check_launch("div_kernel")); // via fail: the scratch goes back
        }
        DI_TRY(di_cuda_router(cu, logits, w->gate_bias, w->tid2eid, ids, n_tok, E, K,
                              w->route_scale, w->hf_eps, sel, wgt));
        DI_TRY(di_cuda_moe_group(cu, sel, P, K, E, offsets, rows, rop));
        if (aq_r || aq_s1 || aq_s3) DI_TRY(di_cuda_fake_quant(cu, f, n_tok, D, D, a8, 8, fq));
        const float *fr = aq_r ? fq : f;
        // Routed experts: gate and up read the token rows directly (rows = token of each row).
        // One token: every expert has one row (a hash duplicate makes two; still correct).
        const int32_t hint = n_tok == 1 ? 1 : 0;
        DI_TRY(
            routed(cu, w, aq_r, w->w1, F, D, offsets, P, rows, fr, n_tok, g, n_tok, hint)); // [P,F]
        DI_TRY(
            routed(cu, w, aq_r, w->w3, F, D, offsets, P, rows, fr, n_tok, u, n_tok, hint)); // [P,F]
        if (off) {
            DI_TRY(di_cuda_round_bf16(cu, g, (int64_t)P * F));
            DI_TRY(di_cuda_round_bf16(cu, u, (int64_t)P * F));
        }
        DI_TRY(di_cuda_swiglu(cu, g, u, P, F, w->swiglu_limit));
        if (off) {
            DI_TRY(scale_pairs(cu, g, rop, wgt, P, F));
            DI_TRY(di_cuda_round_bf16(cu, g, (int64_t)P * F));
            if (aq_r) DI_TRY(di_cuda_fake_quant(cu, g, P, F, F, a8, 8, g));
        }
        DI_TRY(routed(cu, w, aq_r, w->w2, D, F, offsets, P, NULL, g, P, y, n_tok, hint)); // [P,D]
        if (off) DI_TRY(di_cuda_round_bf16(cu, y, (int64_t)P * D));
        // Shared expert on every token (g, u reused: the grouped w2 above is enqueued first).
        DI_TRY(di_cuda_matmul(cu, &w->sh_w1, aq_s1 ? fq : f, n_tok, D, g, Fs));
        DI_TRY(di_cuda_matmul(cu, &w->sh_w3, aq_s3 ? fq : f, n_tok, D, u, Fs));
        if (off) {
            DI_TRY(di_cuda_round_bf16(cu, g, (int64_t)n_tok * Fs));
            DI_TRY(di_cuda_round_bf16(cu, u, (int64_t)n_tok * Fs));
        }
        DI_TRY(di_cuda_swiglu(cu, g, u, n_tok, Fs, w->shared_clamp ? w->swiglu_limit : 0.0f));
        if (off) {
            DI_TRY(di_cuda_round_bf16(cu, g, (int64_t)n_tok * Fs));
            if (aq_s2) DI_TRY(di_cuda_fake_quant(cu, g, n_tok, Fs, Fs, a8, 8, g));
        }
        DI_TRY(di_cuda_matmul(cu, &w->sh_w2, g, n_tok, Fs, sh, D));
        if (off) DI_TRY(di_cuda_round_bf16(cu, sh, (int64_t)n_tok * D));
        DI_TRY(di_cuda_moe_combine(cu, y, rop, sel, off ? NULL : wgt, sh, n_tok, K, D, out));
        if (off) DI_TRY(di_cuda_round_bf16(cu, out, (int64_t)n_tok * D));
    }
fail:
    for (int i = 10; i >= 0; i--) di_cuda_free(cu, b[i]);
    return st;
}
