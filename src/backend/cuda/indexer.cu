// indexer — lightning indexer scores and the exact top-k (indexer.cuh).
#include "backend/backend.h" // DI_BACKEND_KEY_BLOCK
#include "backend/cuda/common.cuh"
#include "backend/cuda/indexer.cuh"

enum { IDX_THREADS = 256, IDX_WARPS = IDX_THREADS / 32, IDX_KEYS_PER_BLOCK = 64 };
enum { IDX_LANE_HMAX = 64 }; // the lane-per-entry kernel's widest head count
enum { TOPK_THREADS = 1024 };

// ---- scores ----

// Row t's index queries and head weights into shared memory (qs [HI * DI], ws [HI]), by the
// whole block (the callers' barriers around it).
__device__ __forceinline__ void load_query_row(const float *__restrict__ qi,
                                               const float *__restrict__ wi, int64_t t, int32_t HI,
                                               int32_t DI, float *qs, float *ws) {
    for (int64_t i = threadIdx.x; i < (int64_t)HI * DI; i += blockDim.x)
        qs[i] = qi[t * HI * DI + i];
    for (int32_t h = threadIdx.x; h < HI; h += blockDim.x) ws[h] = wi[t * HI + h];
}

// The key row of row t's entry w: contiguous from key_base[t], or through its page (-1: the page
// is negative, the entry scored -inf).
__device__ __forceinline__ int64_t entry_row(const int64_t *__restrict__ key_base,
                                             const int32_t *__restrict__ pages,
                                             const int32_t *__restrict__ page_off, int32_t per_page,
                                             int64_t t, int64_t w) {
    const int64_t kb = key_base ? key_base[t] : 0;
    if (!pages) return kb + w;
    const int32_t pg = pages[page_off[t] + w / per_page];
    return pg < 0 ? -1 : kb + (int64_t)pg * per_page + w % per_page;
}

// Block (row t, 64 entries): the row's qI [HI, DI] and wI [HI] in shared memory; a warp per entry,
// lanes over DI (coalesced key reads), ReLU then the head weight, summed in head order. Grid rows
// loop over the call's rows (di_grid_y: any n_tok).
__global__ void __launch_bounds__(IDX_THREADS)
    scores_kernel(const float *__restrict__ qi, const float *__restrict__ wi,
                  const float *__restrict__ keys, const int64_t *__restrict__ key_base,
                  const int32_t *__restrict__ pages, const int32_t *__restrict__ page_off,
                  int32_t per_page, const int32_t *__restrict__ n_vis, int32_t n_tok, int32_t HI,
                  int32_t DI, bool round_bf16, float *__restrict__ scores, int64_t score_stride) {
    extern __shared__ float qs[]; // [HI * DI] then wI [HI]
    float *ws = qs + (int64_t)HI * DI;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int64_t w0 = (int64_t)blockIdx.x * IDX_KEYS_PER_BLOCK;
    for (int64_t t = blockIdx.y; t < n_tok; t += gridDim.y) {
        const int32_t vis = n_vis[t];
        if (w0 >= vis) continue; // block-uniform
        __syncthreads();         // every warp is done with the previous row's qs
        load_query_row(qi, wi, t, HI, DI, qs, ws);
        __syncthreads();
        for (int64_t w = w0 + warp; w < w0 + IDX_KEYS_PER_BLOCK && w < vis; w += IDX_WARPS) {
            // contiguous entries, or the paged entry w (warp-uniform)
            const int64_t row = entry_row(key_base, pages, page_off, per_page, t, w);
            if (row < 0) {
                if (lane == 0) scores[t * score_stride + w] = -INFINITY;
                continue;
            }
            const float *k = keys + row * DI;
            float acc = 0.0f;
            for (int32_t h = 0; h < HI; h++) {
                float dot = 0.0f;
                for (int32_t d = lane; d < DI; d += 32) dot = fmaf(qs[h * DI + d], k[d], dot);
                dot = di_warp_sum(dot);
                acc += ws[h] * (dot > 0 ? dot : 0); // ReLU, then the head weight
            }
            if (lane == 0) scores[t * score_stride + w] = round_bf16 ? di_round_bf16_dev(acc) : acc;
        }
    }
}

// Lane per entry (DI % 4 == 0, 16-byte aligned keys, HI <= HMAX): block (row t, IDX_THREADS
// entries), one entry per thread; the thread runs its entry's HI dot products side by side over DI
// in 4-wide steps (HMAX accumulators in registers, qI read from shared memory as broadcast
// float4s, the key as float4s), so no warp reduction is needed (the warp-per-entry kernel spends
// 5 shuffles per head and entry: 320 at V4's 64 heads), and the row's qI is loaded once per 256
// entries instead of 64. Then ReLU and the head weight in head order. Each head's dot is summed
// in column order here, lane-strided then tree-reduced there: another FP32 order, within the same
// bound (test_cuda_indexer); paged and contiguous entries still score bit for bit the same.
template <int HMAX>
__global__ void __launch_bounds__(IDX_THREADS)
    scores_lane_kernel(const float *__restrict__ qi, const float *__restrict__ wi,
                       const float *__restrict__ keys, const int64_t *__restrict__ key_base,
                       const int32_t *__restrict__ pages, const int32_t *__restrict__ page_off,
                       int32_t per_page, const int32_t *__restrict__ n_vis, int32_t n_tok,
                       int32_t HI, int32_t DI, bool round_bf16, float *__restrict__ scores,
                       int64_t score_stride) {
    extern __shared__ __align__(16) float qs4[]; // [HI * DI] then wI [HI]
    float *ws = qs4 + (int64_t)HI * DI;
    const int64_t w0 = (int64_t)blockIdx.x * IDX_THREADS;
    for (int64_t t = blockIdx.y; t < n_tok; t += gridDim.y) {
        const int32_t vis = n_vis[t];
        if (w0 >= vis) continue; // block-uniform
        __syncthreads();         // every thread is done with the previous row's qI
        load_query_row(qi, wi, t, HI, DI, qs4, ws);
        __syncthreads();
        const int64_t w = w0 + threadIdx.x;
        if (w >= vis) continue; // no barrier below in this row
        const int64_t row = entry_row(key_base, pages, page_off, per_page, t, w);
        if (row < 0) {
            scores[t * score_stride + w] = -INFINITY;
            continue;
        }
        const float4 *k4 = (const float4 *)(keys + row * DI);
        float dot[HMAX];
#pragma unroll
        for (int h = 0; h < HMAX; h++) dot[h] = 0.0f;
        for (int32_t c = 0; c < DI / 4; c++) {
            const float4 kv = k4[c];
#pragma unroll
            for (int h = 0; h < HMAX; h++) {
                if (h < HI) {
                    const float4 qv = *(const float4 *)(qs4 + h * DI + 4 * c);
                    dot[h] = fmaf(qv.x, kv.x, dot[h]);
                    dot[h] = fmaf(qv.y, kv.y, dot[h]);
                    dot[h] = fmaf(qv.z, kv.z, dot[h]);
                    dot[h] = fmaf(qv.w, kv.w, dot[h]);
                }
            }
        }
        float acc = 0.0f;
#pragma unroll
        for (int h = 0; h < HMAX; h++)
            if (h < HI) acc += ws[h] * (dot[h] > 0 ? dot[h] : 0); // ReLU, then the head weight
        scores[t * score_stride + w] = round_bf16 ? di_round_bf16_dev(acc) : acc;
    }
}

extern "C" di_status di_cuda_indexer_scores(di_cuda *cu, const float *qi, const float *wi,
                                            const float *keys, const int64_t *key_base,
                                            const int32_t *pages, const int32_t *page_off,
                                            int32_t per_page, const int32_t *n_vis, int32_t max_vis,
                                            int32_t n_tok, int32_t HI, int32_t DI, bool round_bf16,
                                            float *scores, int64_t score_stride) {
    static di_smem_kernel smem_k, smem_lane8, smem_lane64;
    const size_t smem = sizeof(float) * ((size_t)HI * DI + (size_t)HI);
    if (pages && per_page < 1) return DI_ERR_INVALID;
    if (n_tok <= 0 || max_vis <= 0) return DI_OK;
    // The lane-per-entry kernel where its float4 loads and register accumulators fit; else the
    // warp-per-entry kernel (any HI, DI).
    const bool lane =
        HI >= 1 && HI <= IDX_LANE_HMAX && DI >= 4 && DI % 4 == 0 && ((uintptr_t)keys & 15) == 0;
    if (lane) {
        const bool narrow = HI <= 8;
        const void *fn = narrow ? (const void *)scores_lane_kernel<8>
                                : (const void *)scores_lane_kernel<IDX_LANE_HMAX>;
        const di_status st =
            di_cuda_smem_fit(cu, narrow ? &smem_lane8 : &smem_lane64, fn, smem, NULL);
        if (st != DI_OK) return st;
        dim3 grid(di_div_up(max_vis, IDX_THREADS), di_grid_y(n_tok));
        if (narrow)
            scores_lane_kernel<8><<<grid, IDX_THREADS, smem, di_stream(cu)>>>(
                qi, wi, keys, key_base, pages, page_off, per_page, n_vis, n_tok, HI, DI, round_bf16,
                scores, score_stride);
        else
            scores_lane_kernel<IDX_LANE_HMAX><<<grid, IDX_THREADS, smem, di_stream(cu)>>>(
                qi, wi, keys, key_base, pages, page_off, per_page, n_vis, n_tok, HI, DI, round_bf16,
                scores, score_stride);
        DI_CUDA_LAUNCHED("scores_lane_kernel");
        return DI_OK;
    }
    const di_status st = di_cuda_smem_fit(cu, &smem_k, (const void *)scores_kernel, smem, NULL);
    if (st != DI_OK) return st;
    dim3 grid(di_div_up(max_vis, IDX_KEYS_PER_BLOCK), di_grid_y(n_tok));
    scores_kernel<<<grid, IDX_THREADS, smem, di_stream(cu)>>>(qi, wi, keys, key_base, pages,
                                                              page_off, per_page, n_vis, n_tok, HI,
                                                              DI, round_bf16, scores, score_stride);
    DI_CUDA_LAUNCHED("scores_kernel");
    return DI_OK;
}

// ---- scores over Q4 index keys (V4.1: backend.h index_scores_q4) ----

// Lane per entry, as scores_lane_kernel, on the keys' codes: a thread reads its entry's packed
// row (DI / 2 code bytes, a UE8M0 byte per 32 dims: 68 bytes at DI 128 instead of 512 as FP32)
// and decodes it in registers, 32 dims at a time (the block's scale, then two values per byte,
// exact products), into the HMAX heads' dots; heads beyond HMAX in further chunks (the key decoded
// again). Then ReLU and the head weight in head order.
template <int HMAX>
__global__ void __launch_bounds__(IDX_THREADS)
    scores_q4_kernel(const float *__restrict__ qi, const float *__restrict__ wi,
                     const uint8_t *__restrict__ keys, const int64_t *__restrict__ key_base,
                     const int32_t *__restrict__ pages, const int32_t *__restrict__ page_off,
                     int32_t per_page, const int32_t *__restrict__ n_vis, int32_t n_tok, int32_t HI,
                     int32_t DI, bool round_bf16, float *__restrict__ scores,
                     int64_t score_stride) {
    extern __shared__ __align__(16) float qsq[]; // [HI * DI] then wI [HI]
    float *ws = qsq + (int64_t)HI * DI;
    const int64_t w0 = (int64_t)blockIdx.x * IDX_THREADS;
    const int64_t kb = DI / 2 + DI / DI_BACKEND_KEY_BLOCK; // a packed key's bytes
    for (int64_t t = blockIdx.y; t < n_tok; t += gridDim.y) {
        const int32_t vis = n_vis[t];
        if (w0 >= vis) continue; // block-uniform
        __syncthreads();         // every thread is done with the previous row's qI
        load_query_row(qi, wi, t, HI, DI, qsq, ws);
        __syncthreads();
        const int64_t w = w0 + threadIdx.x;
        if (w >= vis) continue; // no barrier below in this row
        const int64_t row = entry_row(key_base, pages, page_off, per_page, t, w);
        if (row < 0) {
            scores[t * score_stride + w] = -INFINITY;
            continue;
        }
        const uint8_t *k = keys + row * kb;
        float acc = 0.0f;
        for (int32_t hc = 0; hc < HI; hc += HMAX) {
            float dot[HMAX];
#pragma unroll
            for (int h = 0; h < HMAX; h++) dot[h] = 0.0f;
            for (int32_t b = 0; b < DI / DI_BACKEND_KEY_BLOCK; b++) {
                const float sc = di_ue8m0_f32(k[DI / 2 + b]);
                for (int32_t c = 0; c < DI_BACKEND_KEY_BLOCK / 2; c++) {
                    const uint32_t byte = k[b * (DI_BACKEND_KEY_BLOCK / 2) + c];
                    const float v0 = di_e2m1_f32(byte & 15u) * sc, v1 = di_e2m1_f32(byte >> 4) * sc;
                    const int32_t d = b * DI_BACKEND_KEY_BLOCK + 2 * c;
#pragma unroll
                    for (int h = 0; h < HMAX; h++) {
                        if (hc + h < HI) {
                            const float2 qv = *(const float2 *)(qsq + (hc + h) * DI + d);
                            dot[h] = fmaf(qv.x, v0, dot[h]);
                            dot[h] = fmaf(qv.y, v1, dot[h]);
                        }
                    }
                }
            }
#pragma unroll
            for (int h = 0; h < HMAX; h++)
                if (hc + h < HI) acc += ws[hc + h] * (dot[h] > 0 ? dot[h] : 0); // ReLU, weight
        }
        scores[t * score_stride + w] = round_bf16 ? di_round_bf16_dev(acc) : acc;
    }
}

extern "C" di_status di_cuda_indexer_scores_q4(di_cuda *cu, const float *qi, const float *wi,
                                               const uint8_t *keys, const int64_t *key_base,
                                               const int32_t *pages, const int32_t *page_off,
                                               int32_t per_page, const int32_t *n_vis,
                                               int32_t max_vis, int32_t n_tok, int32_t HI,
                                               int32_t DI, bool round_bf16, float *scores,
                                               int64_t score_stride) {
    static di_smem_kernel smem8, smem64;
    if ((pages && per_page < 1) || HI < 1 || DI < DI_BACKEND_KEY_BLOCK ||
        DI % DI_BACKEND_KEY_BLOCK != 0 || score_stride < max_vis)
        return DI_ERR_INVALID;
    if (n_tok <= 0 || max_vis <= 0) return DI_OK;
    const size_t smem = sizeof(float) * ((size_t)HI * DI + (size_t)HI);
    const bool narrow = HI <= 8;
    const void *fn =
        narrow ? (const void *)scores_q4_kernel<8> : (const void *)scores_q4_kernel<IDX_LANE_HMAX>;
    const di_status st = di_cuda_smem_fit(cu, narrow ? &smem8 : &smem64, fn, smem, NULL);
    if (st != DI_OK) return st;
    dim3 grid(di_div_up(max_vis, IDX_THREADS), di_grid_y(n_tok));
    if (narrow)
        scores_q4_kernel<8><<<grid, IDX_THREADS, smem, di_stream(cu)>>>(
            qi, wi, keys, key_base, pages, page_off, per_page, n_vis, n_tok, HI, DI, round_bf16,
            scores, score_stride);
    else
        scores_q4_kernel<IDX_LANE_HMAX><<<grid, IDX_THREADS, smem, di_stream(cu)>>>(
            qi, wi, keys, key_base, pages, page_off, per_page, n_vis, n_tok, HI, DI, round_bf16,
            scores, score_stride);
    DI_CUDA_LAUNCHED("scores_q4_kernel");
    return DI_OK;
}

// ---- top-k ----

// Order-preserving map of a float to uint32 (larger float -> larger key). -0 is mapped as +0:
// the CPU's comparisons see them equal (a tie, to the lower index), not -0 < +0.
__device__ __forceinline__ uint32_t ordered(float f) {
    const uint32_t u = f == 0.0f ? 0u : __float_as_uint(f);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

// Block-wide exclusive prefix of a 0/1 flag over the threads in order, plus the block total.
__device__ __forceinline__ int block_prefix(bool flag, int *warp_tot, int *total) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    const unsigned b = __ballot_sync(0xffffffffu, flag);
    const int in_warp = __popc(b & ((1u << lane) - 1u));
    __syncthreads();
    if (lane == 0) warp_tot[warp] = __popc(b);
    __syncthreads();
    int before = 0, tot = 0;
    for (int w = 0; w < nw; w++) {
        if (w < warp) before += warp_tot[w];
        tot += warp_tot[w];
    }
    *total = tot;
    return before + in_warp;
}

__global__ void __launch_bounds__(TOPK_THREADS)
    topk_kernel(const float *__restrict__ scores, int64_t score_stride,
                const int32_t *__restrict__ n_vis, int32_t topk, int32_t *__restrict__ sel) {
    __shared__ int warp_tot[32];
    __shared__ int hist[256];
    __shared__ uint32_t sel_prefix;
    __shared__ int32_t sel_want;
    const int64_t t = blockIdx.x;
    // A negative count (device data) selects nothing, as the CPU's topk: unclamped, k < 0 made the
    // -1 padding below start before the row (writes into the rows before it).
    const int32_t vis = max(n_vis[t], 0);
    const int32_t k = vis < topk ? vis : topk;
    int32_t *out = sel + t * topk;
    for (int32_t i = k + threadIdx.x; i < topk; i += blockDim.x) out[i] = -1;
    if (k == vis) { // every visible entry is selected
        for (int32_t i = threadIdx.x; i < k; i += blockDim.x) out[i] = i;
        return;
    }
    const float *s = scores + t * score_stride;
    // Radix select, 8 bits at a time from the top (4 passes over the row; the former bit-wise
    // select took 32, plus one to count the keys above): each pass builds the histogram of the
    // next byte over the keys that share the bytes chosen so far, and picks the byte at which the
    // count from the top reaches the rank still wanted. Afterwards thr is the k-th largest key
    // (the same threshold as before: a key value, so the selection is unchanged) and want the
    // number of its ties to take (the keys above it, k - want, all go in).
    uint32_t prefix = 0, pmask = 0;
    int32_t want = k;
    for (int shift = 24; shift >= 0; shift -= 8) {
        for (int i = threadIdx.x; i < 256; i += blockDim.x) hist[i] = 0;
        __syncthreads(); // also: thread 0's reads of the last pass's histogram are done
        for (int32_t base = 0; base < vis; base += blockDim.x) { // block-uniform: full warps
            const int32_t w = base + threadIdx.x;
            uint32_t d = 256; // no byte: past the row, or another prefix
            if (w < vis) {
                const uint32_t key = ordered(s[w]);
                if ((key & pmask) == prefix) d = (key >> shift) & 255u;
            }
            // One shared atomic per distinct byte in the warp (the top byte is often shared).
            const unsigned peers = __match_any_sync(0xffffffffu, d);
            if (d < 256 && (int)(threadIdx.x & 31) == __ffs(peers) - 1)
                atomicAdd(&hist[d], __popc(peers));
        }
        __syncthreads();
        if (threadIdx.x == 0) {
            int32_t above = 0;
            int b = 255;
            for (; b > 0 && above + hist[b] < want; b--) above += hist[b];
            sel_prefix = prefix | ((uint32_t)b << shift);
            sel_want = want - above;
        }
        __syncthreads();
        prefix = sel_prefix;
        want = sel_want;
        pmask |= 255u << shift;
    }
    // Entries above thr all go in; ties at thr fill the rest, lowest index first.
    const uint32_t thr = prefix;
    const int32_t need_eq = want;
    int32_t eq_seen = 0, n_out = 0;
    for (int32_t base = 0; base < vis; base += blockDim.x) {
        const int32_t w = base + threadIdx.x;
        const uint32_t key = w < vis ? ordered(s[w]) : 0u;
        const bool eq = w < vis && key == thr;
        int eq_tot, sel_tot;
        const int eq_before = block_prefix(eq, warp_tot, &eq_tot);
        const bool take = w < vis && (key > thr || (eq && eq_seen + eq_before < need_eq));
        const int pos = block_prefix(take, warp_tot, &sel_tot);
        if (take) out[n_out + pos] = w;
        eq_seen += eq_tot;
        n_out += sel_tot;
    }
}

extern "C" di_status di_cuda_topk(di_cuda *cu, const float *scores, int64_t score_stride,
                                  const int32_t *n_vis, int32_t n_tok, int32_t topk, int32_t *sel) {
    if (topk <= 0) return DI_ERR_INVALID;
    if (n_tok <= 0) return DI_OK;
    topk_kernel<<<(unsigned)n_tok, TOPK_THREADS, 0, di_stream(cu)>>>(scores, score_stride, n_vis,
                                                                     topk, sel);
    DI_CUDA_LAUNCHED("topk_kernel");
    return DI_OK;
}
