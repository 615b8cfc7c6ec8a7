// attn — FP8 KV rows, attention over index-listed keys with the sink, compressor pooling
// (attn.cuh).
#include <cuda_bf16.h>
#include <algorithm>
#include <cuda_fp8.h>

#include "backend/backend.h" // DI_BACKEND_*_BLOCK
#include "backend/cuda/attn.cuh"
#include "backend/cuda/common.cuh"

// ---- KV rows ----

// ceil(log2(x)) from the bits (di_ceil_log2_bits): x > 0 and normal.
__device__ __forceinline__ int ceil_log2_bits(float x) {
    const uint32_t u = __float_as_uint(x);
    return (int)((u >> 23) & 0xFFu) - 127 + ((u & 0x7FFFFFu) != 0);
}

// e4m3fn round to nearest even with saturation to ±448 (di_f32_to_e4m3 on finite inputs).
__device__ __forceinline__ uint8_t to_e4m3(float x) {
    return (uint8_t)__nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E4M3);
}

// One warp per row: lanes take 64-dim blocks in turn (two dims per lane per block).
__global__ void kv_quant_kernel(const float *__restrict__ kv, int64_t n, int64_t kv_stride,
                                int32_t dh, int32_t n_rot, int64_t row_bytes,
                                uint8_t *__restrict__ pool, const int32_t *__restrict__ dst_rows) {
    const int64_t i = (int64_t)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    const int lane = threadIdx.x & 31;
    if (i >= n) return;
    const int64_t r = dst_rows ? dst_rows[i] : i;
    if (r < 0) return; // padding, skipped
    const float *v = kv + i * kv_stride;
    uint8_t *row = pool + r * row_bytes;
    const int32_t nope = dh - n_rot, nb = nope / 64;
    for (int32_t b = 0; b < nb; b++) {
        const float x0 = v[b * 64 + lane], x1 = v[b * 64 + 32 + lane];
        float amax = di_warp_max(fmaxf(fabsf(x0), fabsf(x1)));
        amax = fmaxf(amax, 1e-4f);                                      // Q8's floor
        const int k = ceil_log2_bits(amax * (1.0f / 448.0f));           // one f32 rounding
        const float inv_s = __uint_as_float((uint32_t)(127 - k) << 23); // 2^-k, exact
        row[b * 64 + lane] = to_e4m3(x0 * inv_s);
        row[b * 64 + 32 + lane] = to_e4m3(x1 * inv_s);
        if (lane == 0) row[nope + 2 * n_rot + b] = (uint8_t)(127 + k);
    }
    uint16_t *rope = (uint16_t *)(row + nope);
    for (int32_t d = lane; d < n_rot; d += 32)
        rope[d] = (uint16_t)(__float_as_uint(di_round_bf16_dev(v[nope + d])) >> 16);
    for (int64_t p = nope + 2 * n_rot + nb + lane; p < row_bytes; p += 32) row[p] = 0;
}

extern "C" di_status di_cuda_kv_quant(di_cuda *cu, const float *kv, int64_t n, int64_t kv_stride,
                                      int32_t dh, int32_t n_rot, uint8_t *pool,
                                      const int32_t *dst_rows) {
    if ((dh - n_rot) % 64 != 0 || n_rot % 2 != 0 || dh > DI_CUDA_ATTN_MAX_DH) return DI_ERR_INVALID;
    if (n <= 0) return DI_OK;
    kv_quant_kernel<<<di_div_up(n, 8), 256, 0, di_stream(cu)>>>(
        kv, n, kv_stride, dh, n_rot, di_cuda_kv_row_bytes(dh, n_rot), pool, dst_rows);
    DI_CUDA_LAUNCHED("kv_quant_kernel");
    return DI_OK;
}

// Dimension d of a KV row, exact.
__device__ __forceinline__ float kv_at(const uint8_t *row, int32_t d, int32_t nope, int32_t n_rot) {
    if (d < nope) return di_e4m3_f32(row[d]) * di_ue8m0_f32(row[nope + 2 * n_rot + d / 64]);
    return di_bf16_f32(((const uint16_t *)(row + nope))[d - nope]);
}

__global__ void kv_dequant_kernel(const uint8_t *__restrict__ pool,
                                  const int32_t *__restrict__ src_rows, int64_t n, int32_t dh,
                                  int32_t n_rot, int64_t row_bytes, float *__restrict__ out) {
    const int64_t k = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (k >= n * dh) return;
    const int64_t i = k / dh;
    const int32_t d = (int32_t)(k % dh);
    const uint8_t *row = pool + (int64_t)(src_rows ? src_rows[i] : i) * row_bytes;
    out[k] = kv_at(row, d, dh - n_rot, n_rot);
}

extern "C" di_status di_cuda_kv_dequant(di_cuda *cu, const uint8_t *pool, const int32_t *src_rows,
                                        int64_t n, int32_t dh, int32_t n_rot, float *out) {
    if (n <= 0) return DI_OK;
    kv_dequant_kernel<<<di_div_up(n * dh, 256), 256, 0, di_stream(cu)>>>(
        pool, src_rows, n, dh, n_rot, di_cuda_kv_row_bytes(dh, n_rot), out);
    DI_CUDA_LAUNCHED("kv_dequant_kernel");
    return DI_OK;
}

// ---- attention ----

enum {
    ATTN_THREADS = 128,
    ATTN_WARPS = ATTN_THREADS / 32,
    ATTN_PER_LANE = DI_CUDA_ATTN_MAX_DH / 32
};

// Key row decoders of the exact SIMT kernel: at(idx, d) = dimension d of pool row idx (idx >= 0).
// Two instances of attn_kernel, one per decoder: KeyRowsFp8 (di_cuda_attn, 584-byte KV rows) and
// KeyRowsF32 (di_cuda_attn_f32, plain FP32 rows of dh floats).
struct KeyRowsFp8 {
    const uint8_t *pool;
    int64_t row_bytes;
    int32_t nope, n_rot;
    __device__ __forceinline__ float at(int32_t idx, int32_t d) const {
        return kv_at(pool + (int64_t)idx * row_bytes, d, nope, n_rot);
    }
};

struct KeyRowsF32 {
    const float *pool;
    int32_t dh;
    __device__ __forceinline__ float at(int32_t idx, int32_t d) const {
        return pool[(int64_t)idx * dh + d];
    }
};

// One block per (query row, head). Pass 1: a warp per key computes its score (lane l takes dims
// l, l+32, ...: consecutive lanes read consecutive bytes); pass 2: max and sum with the sink;
// pass 3: warps accumulate p_j k_j over their keys in registers, then sum across warps.
// TODO(cuda): a block per (row, group of heads) reading each key once for all heads (MQA), with
// 16-byte loads and the sink softmax done online: the decode-speed version (docs/cuda.md).
template <class Rows>
__global__ void __launch_bounds__(ATTN_THREADS)
    attn_kernel(const float *__restrict__ q, Rows rows, const int32_t *__restrict__ key_idx,
                int64_t key_stride, const int32_t *__restrict__ n_keys, int32_t max_keys,
                const float *__restrict__ sink, int32_t H, int32_t dh, float scale, bool round_p,
                float *__restrict__ o, int *__restrict__ flags) {
    extern __shared__ float sm[]; // q [dh] | red [ATTN_WARPS * dh] | scores [max_keys]
    __shared__ float red32[32];
    float *qs = sm, *part = sm + dh, *sc = part + ATTN_WARPS * dh;
    const int64_t t = blockIdx.x / H;
    const int32_t h = blockIdx.x % H;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    // n_keys is device data: a count past max_keys would overrun the scores in shared memory.
    // Clamped, and flagged for the next sync (DI_ERR_INVALID there).
    const int32_t nk = di_cuda_attn_clamp_keys(n_keys[t], max_keys, flags, h == 0);
    const float *qrow = q + (t * H + h) * dh;
    for (int32_t d = threadIdx.x; d < dh; d += blockDim.x) qs[d] = qrow[d];
    __syncthreads();
    const int32_t *idx = key_idx + t * key_stride;
    for (int32_t j = warp; j < nk; j += ATTN_WARPS) {
        const int32_t id = idx[j];
        if (id < 0) { // masked (top-k padding): no mass
            if (lane == 0) sc[j] = -INFINITY;
            continue;
        }
        float s = 0.0f;
        for (int32_t d = lane; d < dh; d += 32) s = fmaf(qs[d], rows.at(id, d), s);
        s = di_warp_sum(s);
        if (lane == 0) sc[j] = s * scale;
    }
    __syncthreads();
    float mx = sink[h];
    for (int32_t j = threadIdx.x; j < nk; j += blockDim.x) mx = fmaxf(mx, sc[j]);
    mx = di_block_max(mx, red32);
    float den = 0.0f;
    for (int32_t j = threadIdx.x; j < nk; j += blockDim.x) den += (sc[j] = expf(sc[j] - mx));
    den = di_block_sum(den, red32) + expf(sink[h] - mx);
    const float inv = 1.0f / den;
    float acc[ATTN_PER_LANE];
    for (int i = 0; i < ATTN_PER_LANE; i++) acc[i] = 0.0f;
    for (int32_t j = warp; j < nk; j += ATTN_WARPS) {
        const int32_t id = idx[j];
        if (id < 0) continue;
        float p = sc[j] * inv;
        if (round_p) p = di_round_bf16_dev(p); // the official recipe: BF16 p, normalised first
#pragma unroll
        for (int i = 0; i < ATTN_PER_LANE; i++) {
            const int32_t d = lane + 32 * i;
            if (d < dh) acc[i] = fmaf(p, rows.at(id, d), acc[i]);
        }
    }
#pragma unroll
    for (int i = 0; i < ATTN_PER_LANE; i++) {
        const int32_t d = lane + 32 * i;
        if (d < dh) part[warp * dh + d] = acc[i];
    }
    __syncthreads();
    float *orow = o + (t * H + h) * dh;
    for (int32_t d = threadIdx.x; d < dh; d += blockDim.x) {
        float s = 0.0f;
        for (int w = 0; w < ATTN_WARPS; w++) s += part[w * dh + d];
        orow[d] = s;
    }
}

// The launch shared by both decoders: shared memory q + per-warp partial outputs + scores.
template <class Rows>
static di_status attn_launch(di_cuda *cu, const float *q, Rows rows, const int32_t *key_idx,
                             int64_t key_stride, const int32_t *n_keys, int32_t max_keys,
                             const float *sink, int32_t n_tok, int32_t H, int32_t dh, float scale,
                             bool round_p, float *o) {
    static di_smem_kernel smem_k; // one per instance (decoder)
    if (n_tok <= 0 || H <= 0) return DI_OK;
    if ((int64_t)n_tok * H > INT32_MAX) return DI_ERR_INVALID; // gridDim.x: one block per (t, h)
    // The kernel's static shared memory (red32: 128 bytes) counts against the limit too.
    const size_t smem = sizeof(float) * ((size_t)dh * (1 + ATTN_WARPS) + (size_t)max_keys);
    size_t st_smem = 0;
    const di_status st =
        di_cuda_smem_fit(cu, &smem_k, (const void *)attn_kernel<Rows>, smem, &st_smem);
    if (st == DI_ERR_INVALID)
        DI_CUDA_LOG_ERROR("attention: %d keys need %zu + %zu (static) bytes of shared memory "
                          "(limit %zu)",
                          max_keys, smem, st_smem, cu->smem_optin);
    if (st != DI_OK) return st;
    attn_kernel<Rows><<<(unsigned)((int64_t)n_tok * H), ATTN_THREADS, smem, di_stream(cu)>>>(
        q, rows, key_idx, key_stride, n_keys, max_keys, sink, H, dh, scale, round_p, o,
        cu->flags_dev);
    DI_CUDA_LAUNCHED("attn_kernel");
    return DI_OK;
}

extern "C" di_status di_cuda_attn(di_cuda *cu, const float *q, const uint8_t *pool,
                                  const int32_t *key_idx, int64_t key_stride, const int32_t *n_keys,
                                  int32_t max_keys, const float *sink, int32_t n_tok, int32_t H,
                                  int32_t dh, int32_t n_rot, float scale, float *o) {
    return di_cuda_attn_kv(cu, q, pool, key_idx, key_stride, n_keys, max_keys, sink, n_tok, H, dh,
                           n_rot, scale, false, o);
}

extern "C" di_status di_cuda_attn_kv(di_cuda *cu, const float *q, const uint8_t *pool,
                                     const int32_t *key_idx, int64_t key_stride,
                                     const int32_t *n_keys, int32_t max_keys, const float *sink,
                                     int32_t n_tok, int32_t H, int32_t dh, int32_t n_rot,
                                     float scale, bool round_p, float *o) {
    if (n_rot < 0 || n_rot % 2 != 0 || dh <= n_rot || (dh - n_rot) % 64 != 0 ||
        dh > DI_CUDA_ATTN_MAX_DH || max_keys < 0 || H < 0)
        return DI_ERR_INVALID;
    const KeyRowsFp8 rows = {pool, di_cuda_kv_row_bytes(dh, n_rot), dh - n_rot, n_rot};
    return attn_launch(cu, q, rows, key_idx, key_stride, n_keys, max_keys, sink, n_tok, H, dh,
                       scale, round_p, o);
}

extern "C" di_status di_cuda_attn_f32(di_cuda *cu, const float *q, const float *pool,
                                      const int32_t *key_idx, int64_t key_stride,
                                      const int32_t *n_keys, int32_t max_keys, const float *sink,
                                      int32_t n_tok, int32_t H, int32_t dh, float scale,
                                      bool round_p, float *o) {
    if (dh < 1 || dh > DI_CUDA_ATTN_MAX_DH || max_keys < 0 || H < 0) return DI_ERR_INVALID;
    const KeyRowsF32 rows = {pool, dh};
    return attn_launch(cu, q, rows, key_idx, key_stride, n_keys, max_keys, sink, n_tok, H, dh,
                       scale, round_p, o);
}

// ---- attention over V4.1's stored codes (backend.h attn_codes) ----
//
// Block = (query row t, group of AC_HEADS heads): the keys are shared by all heads (K = V, MQA),
// so a block reads each listed key once for its AC_HEADS heads (a per-head block would read it H
// times: 64 on V4.1-Flash), straight from the compact codes (528-byte Q8 window rows, 288-byte Q4e
// entries instead of 2,048-byte FP32 rows): tiles of AC_TILE keys are decoded exactly into shared
// memory (FP32), consecutive threads taking consecutive bytes of a row (coalesced). Pass 1: the
// scores of the tile, thread (head, key) over dh (rows padded by one float: no bank conflicts);
// then per head (a warp per head pair) the max with the sink, the sum of exp, the normalised p
// (BF16 with round_p, as the CPU's attn); pass 2 decodes the tiles again (from L2 mostly: a row's
// keys are a few hundred KB) and accumulates p k in registers, warp w taking heads 2w, 2w + 1 and
// lane l dims l, l + 32, ... Two passes because round_p rounds the normalised p, which needs the
// final max and sum before any p.v. FP32 scores and sums, in another order than the CPU's (within
// test_cuda_ops' bound).

enum { AC_THREADS = 256, AC_WARPS = AC_THREADS / 32, AC_HEADS = 2 * AC_WARPS, AC_TILE = 16 };
static_assert(AC_HEADS * AC_TILE == AC_THREADS, "pass 1: a thread per (head, key) of a tile");

// Dimension d of key j of the list (id >= 0): a Q8 window row (j < nw) or a Q4e entry.
__device__ __forceinline__ float code_at(const uint8_t *__restrict__ win,
                                         const uint8_t *__restrict__ ent, int32_t id, bool is_win,
                                         int32_t d, int32_t dh) {
    if (is_win) {
        const uint8_t *row = win + (int64_t)id * (dh + dh / DI_BACKEND_WIN_BLOCK);
        return di_e4m3_f32(row[d]) * di_ue8m0_f32(row[dh + d / DI_BACKEND_WIN_BLOCK]);
    }
    const uint8_t *row = ent + (int64_t)id * (dh / 2 + dh / DI_BACKEND_ENT_BLOCK);
    const uint32_t byte = row[d >> 1], code = (d & 1) ? byte >> 4 : byte & 15u;
    return di_e2m1_f32(code) * di_e4m3_f32(row[dh / 2 + d / DI_BACKEND_ENT_BLOCK]);
}

// Keys [j0, j0 + AC_TILE) of the list decoded into ks [AC_TILE][dh + 1] (masked or past nk: 0).
__device__ __forceinline__ void decode_tile(const uint8_t *__restrict__ win,
                                            const uint8_t *__restrict__ ent,
                                            const int32_t *__restrict__ idx, int32_t j0, int32_t nk,
                                            int32_t nw, int32_t dh, float *ks) {
    for (int32_t e = threadIdx.x; e < AC_TILE * dh; e += blockDim.x) {
        const int32_t jj = e / dh, d = e - jj * dh, j = j0 + jj;
        const int32_t id = j < nk ? idx[j] : -1;
        ks[jj * (dh + 1) + d] = id < 0 ? 0.0f : code_at(win, ent, id, j < nw, d, dh);
    }
}

__global__ void __launch_bounds__(AC_THREADS)
    attn_codes_kernel(const float *__restrict__ q, const uint8_t *__restrict__ win,
                      const uint8_t *__restrict__ ent, const int32_t *__restrict__ key_idx,
                      int64_t key_stride, const int32_t *__restrict__ n_win,
                      const int32_t *__restrict__ n_keys, int32_t max_keys, int32_t ps_stride,
                      const float *__restrict__ sink, int32_t H, int32_t dh, float scale,
                      bool round_p, float *__restrict__ o, int *__restrict__ flags) {
    // qs [AC_HEADS][dh] | ks [AC_TILE][dh + 1] | p [AC_HEADS][ps_stride >= max_keys]
    extern __shared__ float sm[];
    float *qs = sm, *ks = qs + AC_HEADS * dh, *ps = ks + AC_TILE * (dh + 1);
    const int32_t n_grp = (H + AC_HEADS - 1) / AC_HEADS;
    const int64_t t = blockIdx.x / n_grp;
    const int32_t h0 = (int32_t)(blockIdx.x % n_grp) * AC_HEADS;
    const int32_t nh = H - h0 < AC_HEADS ? H - h0 : AC_HEADS;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    // As attn_kernel: a count past max_keys (device data) clamped and flagged; n_win within it.
    const int32_t nk = di_cuda_attn_clamp_keys(n_keys[t], max_keys, flags, h0 == 0);
    const int32_t nw = n_win[t] < 0 ? 0 : n_win[t] > nk ? nk : n_win[t];
    const int32_t *idx = key_idx + t * key_stride;
    for (int32_t e = threadIdx.x; e < AC_HEADS * dh; e += blockDim.x) {
        const int32_t hh = e / dh;
        qs[e] = hh < nh ? q[(t * H + h0 + hh) * dh + (e - hh * dh)] : 0.0f;
    }
    // Pass 1: scale * q . k of every (head, key).
    const int32_t sh = threadIdx.x / AC_TILE, sj = threadIdx.x % AC_TILE;
    for (int32_t j0 = 0; j0 < nk; j0 += AC_TILE) {
        __syncthreads(); // qs written / the previous tile's scores done
        decode_tile(win, ent, idx, j0, nk, nw, dh, ks);
        __syncthreads();
        const int32_t j = j0 + sj;
        if (sh < nh && j < nk) {
            float s = -INFINITY; // masked (top-k padding): no mass
            if (idx[j] >= 0) {
                const float *qh = qs + sh * dh, *kj = ks + sj * (dh + 1);
                s = 0.0f;
                for (int32_t d = 0; d < dh; d++) s = fmaf(qh[d], kj[d], s);
                s *= scale;
            }
            ps[sh * ps_stride + j] = s;
        }
    }
    __syncthreads();
    // The softmax with the sink, per head: a warp per head, its lanes over the keys.
    for (int32_t hh = warp; hh < nh; hh += AC_WARPS) {
        float *p = ps + hh * ps_stride;
        const float sk = sink[h0 + hh];
        float mx = sk;
        for (int32_t j = lane; j < nk; j += 32) mx = fmaxf(mx, p[j]);
        mx = di_warp_max(mx);
        float den = 0.0f;
        for (int32_t j = lane; j < nk; j += 32) den += (p[j] = expf(p[j] - mx));
        den = di_warp_sum(den) + expf(sk - mx); // the sink takes mass, gives no value
        const float inv = 1.0f / den;
        for (int32_t j = lane; j < nk; j += 32) {
            const float v = p[j] * inv;
            p[j] = round_p ? di_round_bf16_dev(v) : v; // official: BF16 p, normalised first
        }
    }
    // Pass 2: o = sum_j p_j k_j, warp w: heads 2w and 2w + 1, lane: dims lane + 32 i.
    float acc[2][ATTN_PER_LANE];
#pragma unroll
    for (int a = 0; a < 2; a++)
#pragma unroll
        for (int i = 0; i < ATTN_PER_LANE; i++) acc[a][i] = 0.0f;
    const int32_t ha = 2 * warp, hb = 2 * warp + 1;
    for (int32_t j0 = 0; j0 < nk; j0 += AC_TILE) {
        __syncthreads(); // the softmax done / the previous tile's sums done
        decode_tile(win, ent, idx, j0, nk, nw, dh, ks);
        __syncthreads();
        const int32_t n_j = nk - j0 < AC_TILE ? nk - j0 : AC_TILE;
        for (int32_t jj = 0; jj < n_j; jj++) {
            if (idx[j0 + jj] < 0) continue; // masked: p 0 (and the decoded row zeros)
            const float pa = ha < nh ? ps[ha * ps_stride + j0 + jj] : 0.0f;
            const float pb = hb < nh ? ps[hb * ps_stride + j0 + jj] : 0.0f;
            const float *kj = ks + jj * (dh + 1);
#pragma unroll
            for (int i = 0; i < ATTN_PER_LANE; i++) {
                const int32_t d = lane + 32 * i;
                if (d < dh) {
                    acc[0][i] = fmaf(pa, kj[d], acc[0][i]);
                    acc[1][i] = fmaf(pb, kj[d], acc[1][i]);
                }
            }
        }
    }
#pragma unroll
    for (int a = 0; a < 2; a++) {
        const int32_t hh = a ? hb : ha;
        if (hh >= nh) continue;
        float *orow = o + (t * H + h0 + hh) * dh;
#pragma unroll
        for (int i = 0; i < ATTN_PER_LANE; i++) {
            const int32_t d = lane + 32 * i;
            if (d < dh) orow[d] = acc[a][i];
        }
    }
}

extern "C" di_status di_cuda_attn_codes(di_cuda *cu, const float *q, const uint8_t *win,
                                        const uint8_t *ent, const int32_t *key_idx,
                                        int64_t key_stride, const int32_t *n_win,
                                        const int32_t *n_keys, int32_t max_keys, const float *sink,
                                        int32_t n_tok, int32_t H, int32_t dh, float scale,
                                        bool round_p, float *o) {
    static di_smem_kernel smem_k;
    if (dh < 32 || dh % 32 != 0 || dh > DI_CUDA_ATTN_MAX_DH || max_keys < 0 || H < 0 ||
        key_stride < max_keys)
        return DI_ERR_INVALID;
    if (n_tok <= 0 || H == 0) return DI_OK;
    const int64_t n_grp = (H + AC_HEADS - 1) / AC_HEADS;
    if ((int64_t)n_tok * n_grp > INT32_MAX) return DI_ERR_INVALID;
    const int32_t mk = max_keys > 0 ? max_keys : 1;
    const size_t smem = sizeof(float) * ((size_t)AC_HEADS * dh + (size_t)AC_TILE * (dh + 1) +
                                         (size_t)AC_HEADS * mk);
    size_t st_smem = 0;
    const di_status st =
        di_cuda_smem_fit(cu, &smem_k, (const void *)attn_codes_kernel, smem, &st_smem);
    if (st == DI_ERR_INVALID)
        DI_CUDA_LOG_ERROR("attention (codes): %d keys of %d dims need %zu + %zu (static) bytes of "
                          "shared memory (limit %zu)",
                          max_keys, dh, smem, st_smem, cu->smem_optin);
    if (st != DI_OK) return st;
    attn_codes_kernel<<<(unsigned)((int64_t)n_tok * n_grp), AC_THREADS, smem, di_stream(cu)>>>(
        q, win, ent, key_idx, key_stride, n_win, n_keys, max_keys, mk, sink, H, dh, scale, round_p,
        o, cu->flags_dev);
    DI_CUDA_LAUNCHED("attn_codes_kernel");
    return DI_OK;
}

// ---- attention on tensor cores (BF16 mma.sync, FlashMLA-style sparse decode) ----
//
// Block = (query row t, group of 64 heads, key split), 8 warps. Per tile of 64 listed keys:
//   1. cp.async (8-byte pieces: rows are 584 bytes, 8-aligned) of the raw rows into one of two
//      raw stages; the next tile's copy is issued before this tile's arithmetic, so HBM reads
//      overlap the tensor cores;
//   2. exact decode to BF16 in shared memory (e4m3 x 2^k has 4 significant bits: exact in BF16's
//      8; the rope dims are BF16 already); masked keys (index < 0, past the split) become zeros;
//   3. S = Q K^T: warp w takes heads 16*(w%4).. and keys 32*(w/4).. (4 n-tiles), k over dh;
//   4. online softmax: per-head tile maxima via shared memory, P = exp(S - m) rounded to BF16
//      into shared memory, row sums of the rounded P;
//   5. O += P V: warp w takes all 64 heads and dims w*dh/8.. (O in registers: 64 x dh/8 per warp,
//      128 floats per thread at dh 512), V = the decoded keys read transposed (ldmatrix.trans).
// Every thread keeps its own copy of the running max of the rows it touches; the copies stay
// equal because each is the same fmaxf chain over the same shared values.
// Shared memory (dh 512): Q 66.5 KB + K 66.5 KB + P 9 KB + 2 raw stages 73 KB + 1.5 KB = 213.5 KB.

namespace {

enum {
    TC_THREADS = 256,
    TC_WARPS = TC_THREADS / 32,
    TC_HEADS = 64,               // heads per block (the MMA M side: 4 m-tiles)
    TC_BN = 64,                  // keys per tile
    TC_MIN_KEYS_PER_SPLIT = 128, // automatic splits keep >= 2 tiles each (load/compute overlap)
    TC_MAX_SPLITS = 4096
};

template <int DH, int ROT> struct TcShape {
    static constexpr int NOPE = DH - ROT;
    static constexpr int RB = (NOPE + 2 * ROT + NOPE / 64 + 7) / 8 * 8; // di_cuda_kv_row_bytes
    static constexpr int LD = DH + 8;     // BF16 row stride of Q and K: 16-byte skew per row,
    static constexpr int LDP = TC_BN + 8; // so ldmatrix's 8 rows hit 8 different bank groups
    static constexpr int NT = DH / 64;    // PV n-tiles (of 8 dims) per warp: dh/8 dims per warp
    static constexpr size_t Q_OFF = 0;
    static constexpr size_t K_OFF = Q_OFF + (size_t)TC_HEADS * LD * 2;
    static constexpr size_t P_OFF = K_OFF + (size_t)TC_BN * LD * 2;
    static constexpr size_t RAW_OFF = P_OFF + (size_t)TC_HEADS * LDP * 2;
    static constexpr size_t IDX_OFF = RAW_OFF + 2 * (size_t)TC_BN * RB;
    static constexpr size_t RED_OFF = IDX_OFF + 2 * (size_t)TC_BN * 4;
    static constexpr size_t SMEM = RED_OFF + 4 * (size_t)TC_HEADS * 4;
    static_assert(NOPE % 64 == 0 && ROT % 8 == 0 && DH % 64 == 0, "tile shapes");
    static_assert(K_OFF % 16 == 0 && P_OFF % 16 == 0 && RAW_OFF % 16 == 0 && IDX_OFF % 16 == 0,
                  "16-byte aligned regions");
};

__device__ __forceinline__ uint32_t smem_u32(const void *p) {
    return (uint32_t)__cvta_generic_to_shared(p);
}

__device__ __forceinline__ void ldsm_x4(const void *p, uint32_t (&r)[4]) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem_u32(p)));
}

__device__ __forceinline__ void ldsm_x4_trans(const void *p, uint32_t (&r)[4]) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem_u32(p)));
}

// d += a (16x16, row) * b (16x8, col): BF16 inputs, FP32 accumulators.
__device__ __forceinline__ void mma_bf16(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                         uint32_t b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, "
                 "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ void cp_async8(void *dst, const void *src) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 8;\n" ::"r"(smem_u32(dst)), "l"(src)
                 : "memory");
}
__device__ __forceinline__ void cp_async_commit() {
    asm volatile("cp.async.commit_group;\n" ::: "memory");
}
__device__ __forceinline__ void cp_async_wait_all() {
    asm volatile("cp.async.wait_group 0;\n" ::: "memory");
}

__device__ __forceinline__ uint32_t bf162_bits(__nv_bfloat162 v) {
    return *reinterpret_cast<uint32_t *>(&v);
}

// Two e4m3 codes (low byte first) times the block scale, as BF16x2: exact (the e4m3 value goes
// through F16 exactly, the product is a power-of-two scaling, the BF16 rounding is then exact).
__device__ __forceinline__ uint32_t e4m3x2_bf16x2(uint32_t two_codes, float sc) {
    const __half2_raw h =
        __nv_cvt_fp8x2_to_halfraw2((__nv_fp8x2_storage_t)(two_codes & 0xFFFFu), __NV_E4M3);
    const float2 f = __half22float2(__half2(h));
    return bf162_bits(__floats2bfloat162_rn(f.x * sc, f.y * sc));
}

template <int DH, int ROT>
__global__ void __launch_bounds__(TC_THREADS, 1)
    attn_tc_kernel(const float *__restrict__ q, const uint8_t *__restrict__ pool,
                   const int32_t *__restrict__ key_idx, int64_t key_stride,
                   const int32_t *__restrict__ n_keys, int32_t max_keys,
                   const float *__restrict__ sink, int32_t H, int32_t n_split, int32_t chunk,
                   float scale, float *__restrict__ o, float *__restrict__ o_part,
                   float *__restrict__ ml_part, int *__restrict__ flags) {
    using S = TcShape<DH, ROT>;
    extern __shared__ __align__(16) uint8_t smem[];
    __nv_bfloat16 *Qs = (__nv_bfloat16 *)(smem + S::Q_OFF); // [64 heads][LD]
    __nv_bfloat16 *Ks = (__nv_bfloat16 *)(smem + S::K_OFF); // [64 keys][LD] decoded
    __nv_bfloat16 *Ps = (__nv_bfloat16 *)(smem + S::P_OFF); // [64 heads][LDP]
    uint8_t *raw = smem + S::RAW_OFF;                       // [2][64][RB]
    int32_t *idx_s = (int32_t *)(smem + S::IDX_OFF);        // [2][64], -1 = masked
    float *red_max = (float *)(smem + S::RED_OFF);          // [2 key halves][64 heads]
    float *red_sum = red_max + 2 * TC_HEADS;                // [2][64]

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int64_t t = blockIdx.x / n_split;
    const int32_t split = (int32_t)(blockIdx.x % n_split), h0 = (int32_t)blockIdx.y * TC_HEADS;
    // As attn_kernel: a count past max_keys (device data) clamped and flagged.
    const int32_t nk =
        di_cuda_attn_clamp_keys(n_keys[t], max_keys, flags, split == 0 && blockIdx.y == 0);
    const int32_t k_beg = split * chunk, k_end = min(nk, k_beg + chunk);
    const int32_t n_tiles = k_end > k_beg ? (k_end - k_beg + TC_BN - 1) / TC_BN : 0;
    const int32_t *idx_row = key_idx + t * key_stride;

    // q rows h0 .. h0+63 -> BF16 (zeros past H: their scores are 0, their outputs unwritten).
    for (int i = tid; i < TC_HEADS * (DH / 4); i += TC_THREADS) {
        const int r = i / (DH / 4), c = (i % (DH / 4)) * 4;
        float4 v = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        if (h0 + r < H) v = *(const float4 *)(q + ((t * H + h0 + r) * DH + c));
        uint2 b;
        b.x = bf162_bits(__floats2bfloat162_rn(v.x, v.y));
        b.y = bf162_bits(__floats2bfloat162_rn(v.z, v.w));
        *(uint2 *)(Qs + r * S::LD + c) = b;
    }
    auto load_idx = [&](int32_t it, int st) {
        if (tid < TC_BN) {
            const int32_t j = k_beg + it * TC_BN + tid;
            idx_s[st * TC_BN + tid] = j < k_end ? idx_row[j] : -1;
        }
    };
    auto issue = [&](int st) { // raw rows of idx_s[st] -> raw stage st (masked rows skipped)
        constexpr int CH = S::RB / 8;
        uint8_t *dst = raw + (size_t)st * TC_BN * S::RB;
        for (int c = tid; c < TC_BN * CH; c += TC_THREADS) {
            const int r = c / CH, off = (c % CH) * 8;
            const int32_t id = idx_s[st * TC_BN + r];
            if (id >= 0) cp_async8(dst + r * S::RB + off, pool + (int64_t)id * S::RB + off);
        }
        cp_async_commit();
    };
    auto decode = [&](int st) { // raw stage st -> Ks (BF16), 8 dims (16 bytes) per step
        constexpr int G = DH / 8;
        const uint8_t *src = raw + (size_t)st * TC_BN * S::RB;
        for (int g = tid; g < TC_BN * G; g += TC_THREADS) {
            const int r = g / G, c = (g % G) * 8;
            uint4 v = make_uint4(0u, 0u, 0u, 0u);
            if (idx_s[st * TC_BN + r] >= 0) {
                const uint8_t *row = src + r * S::RB;
                if (c < S::NOPE) {
                    const uint2 codes = *(const uint2 *)(row + c);
                    const float sc = di_ue8m0_f32(row[S::NOPE + 2 * ROT + c / 64]);
                    v.x = e4m3x2_bf16x2(codes.x, sc);
                    v.y = e4m3x2_bf16x2(codes.x >> 16, sc);
                    v.z = e4m3x2_bf16x2(codes.y, sc);
                    v.w = e4m3x2_bf16x2(codes.y >> 16, sc);
                } else {
                    const uint2 lo = *(const uint2 *)(row + S::NOPE + 2 * (c - S::NOPE));
                    const uint2 hi = *(const uint2 *)(row + S::NOPE + 2 * (c - S::NOPE) + 8);
                    v = make_uint4(lo.x, lo.y, hi.x, hi.y);
                }
            }
            *(uint4 *)(Ks + r * S::LD + c) = v;
        }
    };

    const int mq = warp & 3, kh = warp >> 2;       // S = QK^T: this warp's m-tile, key half
    const int g4 = lane >> 2, c4 = (lane & 3) * 2; // C fragment: row g4 (+8), cols c4, c4+1
    const int rq = mq * 16 + g4;                   // this thread's S rows rq, rq + 8
    float m_q[2] = {-INFINITY, -INFINITY};         // running max of rows rq, rq + 8
    float m_p[4][2], l_p[4][2];                    // running max / sum of rows 16*mt + g4 (+8)
    float acc[4][S::NT][4];                        // O: rows 16*mt + g4 (+8), this warp's dims
#pragma unroll
    for (int mt = 0; mt < 4; mt++) {
        m_p[mt][0] = m_p[mt][1] = -INFINITY;
        l_p[mt][0] = l_p[mt][1] = 0.0f;
#pragma unroll
        for (int nt = 0; nt < S::NT; nt++)
            acc[mt][nt][0] = acc[mt][nt][1] = acc[mt][nt][2] = acc[mt][nt][3] = 0.0f;
    }
    const int d0 = warp * (DH / 8); // this warp's PV dims d0 .. d0 + DH/8 - 1

    if (n_tiles > 0) load_idx(0, 0);
    __syncthreads(); // Qs, idx_s[0]
    if (n_tiles > 0) issue(0);
    for (int32_t it = 0; it < n_tiles; it++) {
        const int st = it & 1;
        cp_async_wait_all();
        // (B) this tile's raw rows have landed for every thread; the previous tile's P.V (the
        // last reader of Ks, Ps and red_*) is done everywhere.
        __syncthreads();
        decode(st);
        if (it + 1 < n_tiles) load_idx(it + 1, st ^ 1); // stage st^1 free since tile it-1
        __syncthreads();                                // (C) Ks, idx_s[st ^ 1]
        if (it + 1 < n_tiles) issue(st ^ 1);            // in flight during this tile's arithmetic
        const int32_t *msk = idx_s + st * TC_BN;

        // ---- S = Q K^T (16 heads x 32 keys per warp) ----
        float s[4][4];
#pragma unroll
        for (int nt = 0; nt < 4; nt++) s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.0f;
        {
            const __nv_bfloat16 *qa = Qs + (mq * 16 + (lane & 15)) * S::LD + (lane >> 4) * 8;
            const __nv_bfloat16 *kb =
                Ks + (kh * 32 + (lane & 7) + ((lane >> 4) << 3)) * S::LD + ((lane >> 3) & 1) * 8;
#pragma unroll 4
            for (int k0 = 0; k0 < DH; k0 += 16) {
                uint32_t a[4], b0[4], b1[4];
                ldsm_x4(qa + k0, a);
                ldsm_x4(kb + k0, b0);              // keys +0..7 (b0[0..1]), +8..15 (b0[2..3])
                ldsm_x4(kb + 16 * S::LD + k0, b1); // keys +16..23, +24..31
                mma_bf16(s[0], a, b0[0], b0[1]);
                mma_bf16(s[1], a, b0[2], b0[3]);
                mma_bf16(s[2], a, b1[0], b1[1]);
                mma_bf16(s[3], a, b1[2], b1[3]);
            }
        }
        float mx0 = -INFINITY, mx1 = -INFINITY;
#pragma unroll
        for (int nt = 0; nt < 4; nt++)
#pragma unroll
            for (int e = 0; e < 2; e++) {
                const bool ok = msk[kh * 32 + nt * 8 + c4 + e] >= 0;
                s[nt][e] = ok ? s[nt][e] * scale : -INFINITY;
                s[nt][2 + e] = ok ? s[nt][2 + e] * scale : -INFINITY;
                mx0 = fmaxf(mx0, s[nt][e]);
                mx1 = fmaxf(mx1, s[nt][2 + e]);
            }
        mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 1));
        mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 2));
        mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 1));
        mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 2));
        if ((lane & 3) == 0) {
            red_max[kh * TC_HEADS + rq] = mx0;
            red_max[kh * TC_HEADS + rq + 8] = mx1;
        }
        __syncthreads(); // (D) tile maxima of both key halves

        // ---- P = exp(S - m_new) in BF16, row sums of the rounded values ----
        {
            const float mn0 = fmaxf(m_q[0], fmaxf(red_max[rq], red_max[TC_HEADS + rq]));
            const float mn1 = fmaxf(m_q[1], fmaxf(red_max[rq + 8], red_max[TC_HEADS + rq + 8]));
            m_q[0] = mn0, m_q[1] = mn1;
            float sum0 = 0.0f, sum1 = 0.0f;
#pragma unroll
            for (int nt = 0; nt < 4; nt++) {
                // mn == -inf: every key of the row so far is masked (s = -inf too): p = 0.
                const float p0 = mn0 == -INFINITY ? 0.0f : expf(s[nt][0] - mn0);
                const float p1 = mn0 == -INFINITY ? 0.0f : expf(s[nt][1] - mn0);
                const float p2 = mn1 == -INFINITY ? 0.0f : expf(s[nt][2] - mn1);
                const float p3 = mn1 == -INFINITY ? 0.0f : expf(s[nt][3] - mn1);
                const __nv_bfloat162 lo = __floats2bfloat162_rn(p0, p1);
                const __nv_bfloat162 hi = __floats2bfloat162_rn(p2, p3);
                const int col = kh * 32 + nt * 8 + c4;
                *(__nv_bfloat162 *)(Ps + rq * S::LDP + col) = lo;
                *(__nv_bfloat162 *)(Ps + (rq + 8) * S::LDP + col) = hi;
                const float2 fl = __bfloat1622float2(lo), fh = __bfloat1622float2(hi);
                sum0 += fl.x + fl.y;
                sum1 += fh.x + fh.y;
            }
            sum0 += __shfl_xor_sync(0xffffffffu, sum0, 1);
            sum0 += __shfl_xor_sync(0xffffffffu, sum0, 2);
            sum1 += __shfl_xor_sync(0xffffffffu, sum1, 1);
            sum1 += __shfl_xor_sync(0xffffffffu, sum1, 2);
            if ((lane & 3) == 0) {
                red_sum[kh * TC_HEADS + rq] = sum0;
                red_sum[kh * TC_HEADS + rq + 8] = sum1;
            }
        }
        __syncthreads(); // (E) Ps, red_sum

        // ---- rescale O, then O += P V (64 heads x DH/8 dims per warp) ----
#pragma unroll
        for (int mt = 0; mt < 4; mt++)
#pragma unroll
            for (int hf = 0; hf < 2; hf++) {
                const int r = mt * 16 + g4 + hf * 8;
                const float mn = fmaxf(m_p[mt][hf], fmaxf(red_max[r], red_max[TC_HEADS + r]));
                const float alpha = mn == -INFINITY ? 1.0f : expf(m_p[mt][hf] - mn);
                l_p[mt][hf] = l_p[mt][hf] * alpha + (red_sum[r] + red_sum[TC_HEADS + r]);
                m_p[mt][hf] = mn;
#pragma unroll
                for (int nt = 0; nt < S::NT; nt++) {
                    acc[mt][nt][2 * hf] *= alpha;
                    acc[mt][nt][2 * hf + 1] *= alpha;
                }
            }
#pragma unroll
        for (int k0 = 0; k0 < TC_BN; k0 += 16) {
            uint32_t a[4][4];
#pragma unroll
            for (int mt = 0; mt < 4; mt++)
                ldsm_x4(Ps + (mt * 16 + (lane & 15)) * S::LDP + k0 + (lane >> 4) * 8, a[mt]);
#pragma unroll
            for (int np = 0; np < S::NT / 2; np++) {
                uint32_t b[4]; // dims d0 + 16 np + 0..7 (b[0..1]), + 8..15 (b[2..3])
                ldsm_x4_trans(Ks + (k0 + (lane & 15)) * S::LD + d0 + np * 16 + (lane >> 4) * 8, b);
#pragma unroll
                for (int mt = 0; mt < 4; mt++) {
                    mma_bf16(acc[mt][2 * np], a[mt], b[0], b[1]);
                    mma_bf16(acc[mt][2 * np + 1], a[mt], b[2], b[3]);
                }
            }
        }
    }

    // ---- epilogue: the sink and 1/den (one split), or the split's (O, m, l) for the combine ----
#pragma unroll
    for (int mt = 0; mt < 4; mt++)
#pragma unroll
        for (int hf = 0; hf < 2; hf++) {
            const int32_t h = h0 + mt * 16 + g4 + hf * 8;
            if (h >= H) continue;
            const float m = m_p[mt][hf], l = l_p[mt][hf];
            if (n_split == 1) {
                const float sk = sink[h], M = fmaxf(m, sk);
                const float f = m == -INFINITY ? 0.0f : expf(m - M);
                const float mul = f / (l * f + expf(sk - M));
                float *orow = o + (t * H + h) * DH + d0 + c4;
#pragma unroll
                for (int nt = 0; nt < S::NT; nt++)
                    *(float2 *)(orow + nt * 8) =
                        make_float2(acc[mt][nt][2 * hf] * mul, acc[mt][nt][2 * hf + 1] * mul);
            } else {
                const int64_t pr = (t * n_split + split) * H + h;
                float *orow = o_part + pr * DH + d0 + c4;
#pragma unroll
                for (int nt = 0; nt < S::NT; nt++)
                    *(float2 *)(orow + nt * 8) =
                        make_float2(acc[mt][nt][2 * hf], acc[mt][nt][2 * hf + 1]);
                if (warp == 0 && (lane & 3) == 0) ml_part[2 * pr] = m, ml_part[2 * pr + 1] = l;
            }
        }
}

// o[t, h] = sum_s O_s exp(m_s - M) / (exp(sink - M) + sum_s l_s exp(m_s - M)), M the largest of
// the sink and the m_s. One block per (t, h); splits with no key (m = -inf) weigh 0.
__global__ void attn_tc_combine_kernel(const float *__restrict__ o_part,
                                       const float *__restrict__ ml_part,
                                       const float *__restrict__ sink, int32_t H, int32_t dh,
                                       int32_t n_split, float *__restrict__ o) {
    extern __shared__ float wsplit[]; // [n_split]
    __shared__ float red[32];
    const int64_t t = blockIdx.x / H;
    const int32_t h = (int32_t)(blockIdx.x % H);
    const float *ml = ml_part + 2 * (t * n_split * H + h); // split s: ml[2 * s * H], +1
    float M = sink[h];
    for (int32_t s = threadIdx.x; s < n_split; s += blockDim.x)
        M = fmaxf(M, ml[2 * (int64_t)s * H]);
    M = di_block_max(M, red);
    float den = 0.0f;
    for (int32_t s = threadIdx.x; s < n_split; s += blockDim.x) {
        const float m = ml[2 * (int64_t)s * H];
        const float w = m == -INFINITY ? 0.0f : expf(m - M);
        wsplit[s] = w;
        den += w * ml[2 * (int64_t)s * H + 1];
    }
    den = di_block_sum(den, red) + expf(sink[h] - M); // its barriers also publish wsplit
    const float inv = 1.0f / den;
    for (int32_t d = threadIdx.x; d < dh; d += blockDim.x) {
        float a = 0.0f;
        for (int32_t s = 0; s < n_split; s++)
            if (wsplit[s] != 0.0f) a += wsplit[s] * o_part[((t * n_split + s) * H + h) * dh + d];
        o[(t * H + h) * dh + d] = a * inv;
    }
}

template <int DH, int ROT>
di_status attn_tc_launch(di_cuda *cu, const float *q, const uint8_t *pool, const int32_t *key_idx,
                         int64_t key_stride, const int32_t *n_keys, int32_t max_keys,
                         const float *sink, int32_t n_tok, int32_t H, float scale, int32_t n_split,
                         float *o) {
    using S = TcShape<DH, ROT>;
    static di_smem_kernel smem_k;
    {
        size_t st_smem = 0;
        const di_status fit =
            di_cuda_smem_fit(cu, &smem_k, (const void *)attn_tc_kernel<DH, ROT>, S::SMEM, &st_smem);
        if (fit == DI_ERR_INVALID) {
            DI_CUDA_LOG_ERROR("attention (bf16): %zu + %zu (static) bytes of shared memory per "
                              "block needed, the device allows %zu",
                              S::SMEM, st_smem, cu->smem_optin);
            return DI_ERR_UNSUPPORTED; // this device (A100: 163 KB), not the shape
        }
        if (fit != DI_OK) return fit;
    }
    const int64_t groups = (H + TC_HEADS - 1) / TC_HEADS,
                  max_tiles = (max_keys + TC_BN - 1) / TC_BN;
    int64_t ns = n_split;
    if (ns <= 0) { // fill the SMs (one block each: shared memory), >= 2 tiles per split
        const int64_t base = (int64_t)n_tok * groups;
        ns = base >= cu->n_sm ? 1 : cu->n_sm / base;
        ns = std::min<int64_t>(ns, std::max<int64_t>(1, max_keys / TC_MIN_KEYS_PER_SPLIT));
    }
    ns = std::max<int64_t>(1, std::min<int64_t>({ns, max_tiles, (int64_t)TC_MAX_SPLITS}));
    const int64_t chunk = (max_tiles + ns - 1) / ns * TC_BN; // whole tiles per split
    if (chunk > 0) ns = (max_keys + chunk - 1) / chunk;
    const int64_t n_blocks = (int64_t)n_tok * ns;
    // gridDim.x (rows x splits) and gridDim.y (head groups: H up to 65,535 x 64) limits; the
    // combine's grid is one block per (t, h).
    if (n_blocks > 0x7FFFFFFF || groups > DI_CUDA_MAX_GRID_Y ||
        (ns > 1 && (int64_t)n_tok * H > 0x7FFFFFFF))
        return DI_ERR_INVALID;
    float *o_part = NULL, *ml_part = NULL;
    di_status st = DI_OK;
    if (ns > 1) {
        const size_t rows = (size_t)n_tok * (size_t)ns * (size_t)H;
        st = di_cuda_alloc(cu, sizeof(float) * rows * DH, (void **)&o_part);
        if (st != DI_OK) return st;
        st = di_cuda_alloc(cu, sizeof(float) * rows * 2, (void **)&ml_part);
        if (st != DI_OK) goto fail;
    }
    attn_tc_kernel<DH, ROT>
        <<<dim3((unsigned)n_blocks, (unsigned)groups), TC_THREADS, S::SMEM, di_stream(cu)>>>(
            q, pool, key_idx, key_stride, n_keys, max_keys, sink, H, (int32_t)ns,
            (int32_t)(chunk > 0 ? chunk : TC_BN), scale, o, o_part, ml_part, cu->flags_dev);
    DI_TRY(di_cuda_check_launch("attn_tc_kernel"));
    if (ns > 1) {
        attn_tc_combine_kernel<<<(unsigned)((int64_t)n_tok * H), 128, sizeof(float) * (size_t)ns,
                                 di_stream(cu)>>>(o_part, ml_part, sink, H, DH, (int32_t)ns, o);
        DI_TRY(di_cuda_check_launch("attn_tc_combine_kernel"));
    }
fail: // the pool reuses the scratch only after the launches above (one stream)
    if (ml_part) di_cuda_free(cu, ml_part);
    if (o_part) di_cuda_free(cu, o_part);
    return st;
}

} // namespace

extern "C" di_status di_cuda_attn_bf16(di_cuda *cu, const float *q, const uint8_t *pool,
                                       const int32_t *key_idx, int64_t key_stride,
                                       const int32_t *n_keys, int32_t max_keys, const float *sink,
                                       int32_t n_tok, int32_t H, int32_t dh, int32_t n_rot,
                                       float scale, int32_t n_split, float *o) {
    if (max_keys < 0 || ((uintptr_t)q & 15) != 0 || ((uintptr_t)o & 7) != 0) return DI_ERR_INVALID;
    const bool v4 = dh == 512 && n_rot == 64, tiny = dh == 128 && n_rot == 64;
    if (!v4 && !tiny) return DI_ERR_INVALID;
    if (n_tok <= 0 || H <= 0) return DI_OK;
    return v4 ? attn_tc_launch<512, 64>(cu, q, pool, key_idx, key_stride, n_keys, max_keys, sink,
                                        n_tok, H, scale, n_split, o)
              : attn_tc_launch<128, 64>(cu, q, pool, key_idx, key_stride, n_keys, max_keys, sink,
                                        n_tok, H, scale, n_split, o);
}

// ---- the device-resident forward's attention on FP8 KV rows (backend.h attn_kv) ----

namespace {

// Whether this call may take the tensor-core kernel: the official recipe (round_p), a shape it
// has, the device's shared memory, the alignments it needs; and, before the first check, not
// inside a graph capture (the check downloads).
bool attn_tc_eligible(const di_cuda *cu, const float *q, const float *o, int32_t dh, int32_t n_rot,
                      bool round_p) {
    if (!round_p || cu->attn_tc < 0 || (cu->attn_tc == 0 && cu->capturing)) return false;
    if (((uintptr_t)q & 15) != 0 || ((uintptr_t)o & 7) != 0) return false;
    if (dh == 512 && n_rot == 64) return TcShape<512, 64>::SMEM <= cu->smem_optin;
    if (dh == 128 && n_rot == 64) return TcShape<128, 64>::SMEM <= cu->smem_optin;
    return false;
}

// The first eligible call: the exact SIMT kernel into a scratch, the tensor cores into o, both
// compared on the host. A match keeps the tensor cores for the context; a mismatch (or a refusal
// of the kernel) logs it, turns them off and leaves the SIMT result in o.
di_status attn_tc_check(di_cuda *cu, const float *q, const uint8_t *pool, const int32_t *key_idx,
                        int64_t key_stride, const int32_t *n_keys, int32_t max_keys,
                        const float *sink, int32_t n_tok, int32_t H, int32_t dh, int32_t n_rot,
                        float scale, float *o) {
    const size_t n = (size_t)n_tok * (size_t)H * (size_t)dh;
    float *ref = NULL, *h_tc = NULL, *h_ref = NULL;
    di_status st = di_cuda_alloc(cu, sizeof(float) * n, (void **)&ref);
    if (st != DI_OK) return st;
    st = di_cuda_attn_kv(cu, q, pool, key_idx, key_stride, n_keys, max_keys, sink, n_tok, H, dh,
                         n_rot, scale, true, ref);
    if (st != DI_OK) goto out;
    st = di_cuda_attn_bf16(cu, q, pool, key_idx, key_stride, n_keys, max_keys, sink, n_tok, H, dh,
                           n_rot, scale, 0, o);
    if (st == DI_ERR_NOMEM || st == DI_ERR_CUDA) goto out; // a fault is sticky: nothing to keep
    if (st != DI_OK) {
        DI_CUDA_LOG_WARN("attention on tensor cores refused its first call (%s): attention stays "
                         "on the exact SIMT kernel",
                         di_status_str(st));
        cu->attn_tc = -1;
    } else {
        h_tc = (float *)malloc(sizeof(float) * n);
        h_ref = (float *)malloc(sizeof(float) * n);
        if (!h_tc || !h_ref) {
            st = DI_ERR_NOMEM;
            goto out;
        }
        if ((st = di_cuda_download(cu, h_tc, o, sizeof(float) * n)) != DI_OK) goto out;
        if ((st = di_cuda_download(cu, h_ref, ref, sizeof(float) * n)) != DI_OK) goto out;
        double amax, dmax;
        const bool ok =
            di_cuda_close(h_tc, h_ref, (size_t)n, (double)cu->attn_tc_check_tol, &amax, &dmax);
        cu->attn_tc = ok ? 1 : -1;
        di_log_write(ok ? 2 : 1, __FILE__, __LINE__,
                     "cuda: attention on tensor cores (BF16) vs the exact SIMT kernel on its first "
                     "call (%d rows, %d heads, dh %d, up to %d keys): max |diff| %.3g of max |o| "
                     "%.3g: %s",
                     n_tok, H, dh, max_keys, dmax, amax,
                     ok ? "used from now on" : "MISMATCH, the SIMT kernel stays");
        if (ok) cu->n_attn_tc_calls++;
    }
    if (cu->attn_tc < 0) st = di_cuda_copy_d2d(cu, o, ref, sizeof(float) * n);
out:
    free(h_ref);
    free(h_tc);
    di_cuda_free(cu, ref); // stream-ordered: after the copy above
    return st;
}

} // namespace

extern "C" di_status di_cuda_attn_kv_dispatch(di_cuda *cu, const float *q, const uint8_t *pool,
                                              const int32_t *key_idx, int64_t key_stride,
                                              const int32_t *n_keys, int32_t max_keys,
                                              const float *sink, int32_t n_tok, int32_t H,
                                              int32_t dh, int32_t n_rot, float scale, bool round_p,
                                              float *o) {
    if (n_tok <= 0 || H <= 0 || max_keys < 0 || !attn_tc_eligible(cu, q, o, dh, n_rot, round_p))
        return di_cuda_attn_kv(cu, q, pool, key_idx, key_stride, n_keys, max_keys, sink, n_tok, H,
                               dh, n_rot, scale, round_p, o);
    if (cu->attn_tc == 0)
        return attn_tc_check(cu, q, pool, key_idx, key_stride, n_keys, max_keys, sink, n_tok, H, dh,
                             n_rot, scale, o);
    const di_status st = di_cuda_attn_bf16(cu, q, pool, key_idx, key_stride, n_keys, max_keys, sink,
                                           n_tok, H, dh, n_rot, scale, 0, o);
    if (st == DI_OK) cu->n_attn_tc_calls++;
    return st;
}

// ---- compressor pooling ----

// Softmax pooling of one channel over the slots in slot order, as model/dsv4_attn.c
// compressor_step: the max over the present slots, then den and num accumulated in slot order,
// entry = num / den. slots.get(j, &c, &z) loads slot j's values and says whether it holds a token.
template <class Slots>
__device__ __forceinline__ float pool_slots(const Slots &slots, int32_t n_slots) {
    float mx = -INFINITY, cv, zv;
    for (int32_t j = 0; j < n_slots; j++)
        if (slots.get(j, &cv, &zv)) mx = fmaxf(mx, zv);
    float den = 0, num = 0;
    for (int32_t j = 0; j < n_slots; j++) {
        if (!slots.get(j, &cv, &zv)) continue;
        const float p = expf(zv - mx);
        den += p;
        num += p * cv;
    }
    return den > 0.0f ? num / den : 0.0f; // no slot present (a padding window): 0
}

// The staged layout of di_cuda_compress_pool: window w's buffer (and overlap) arrays.
struct SlotsStaged {
    const float *bc, *bz, *oc, *oz; // oc/oz NULL: no overlap
    int32_t m, width, off, ch, d;
    __device__ __forceinline__ bool get(int32_t j, float *c, float *z) const {
        if (oc) {
            if (j < m) {
                *c = oc[j * d + ch];
                *z = oz[j * d + ch];
                return true;
            }
            j -= m;
        }
        *c = bc[j * width + off + ch];
        *z = bz[j * width + off + ch];
        return true;
    }
};

__global__ void compress_pool_kernel(const float *__restrict__ buf_c,
                                     const float *__restrict__ buf_z,
                                     const float *__restrict__ ovl_c,
                                     const float *__restrict__ ovl_z,
                                     const uint8_t *__restrict__ has_ovl, int32_t n_win, int32_t m,
                                     int32_t c, int32_t d, float *__restrict__ entry) {
    const int64_t k = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (k >= (int64_t)n_win * d) return;
    const int64_t w = k / d;
    const int32_t ch = (int32_t)(k % d), width = c * d;
    const bool ovl = c == 2 && has_ovl && has_ovl[w];
    SlotsStaged s;
    s.bc = buf_c + w * m * width, s.bz = buf_z + w * m * width;
    s.oc = ovl ? ovl_c + w * m * d : NULL, s.oz = ovl ? ovl_z + w * m * d : NULL;
    s.m = m, s.width = width, s.ch = ch, s.d = d;
    s.off = c == 2 ? d : 0; // CSA: this window's slots are the second halves
    entry[w * d + ch] = pool_slots(s, ovl ? 2 * m : m);
}

extern "C" di_status di_cuda_compress_pool(di_cuda *cu, const float *buf_c, const float *buf_z,
                                           const float *ovl_c, const float *ovl_z,
                                           const uint8_t *has_ovl, int32_t n_win, int32_t m,
                                           int32_t c, int32_t d, float *entry) {
    if (c != 1 && c != 2) return DI_ERR_INVALID;
    const int64_t n = (int64_t)n_win * d;
    if (n <= 0) return DI_OK;
    compress_pool_kernel<<<di_div_up(n, 256), 256, 0, di_stream(cu)>>>(
        buf_c, buf_z, ovl_c, ovl_z, has_ovl, n_win, m, c, d, entry);
    DI_CUDA_LAUNCHED("compress_pool_kernel");
    return DI_OK;
}

// The index-listed layout of di_cuda_compress_pool_list: slot j of window w names its token row.
struct SlotsListed {
    const float *call_c, *call_z, *ring_c, *ring_z;
    const int32_t *src; // window w's c*m slot rows
    int64_t call_stride;
    int32_t m, c, d, ch;
    __device__ __forceinline__ bool get(int32_t j, float *cv, float *zv) const {
        const int32_t idx = src[j];
        if (idx == DI_CUDA_POOL_NO_ROW) return false;
        const int64_t col = (c == 2 && j >= m ? d : 0) + ch; // CSA: overlap first halves, then
                                                             // this window's second halves
        if (idx >= 0) {
            *cv = call_c[(int64_t)idx * call_stride + col];
            *zv = call_z[(int64_t)idx * call_stride + col];
        } else {
            const int64_t r = -(int64_t)idx - 1;
            *cv = ring_c[r * c * d + col];
            *zv = ring_z[r * c * d + col];
        }
        return true;
    }
};

__global__ void compress_pool_list_kernel(const float *__restrict__ call_c,
                                          const float *__restrict__ call_z, int64_t call_stride,
                                          const float *__restrict__ ring_c,
                                          const float *__restrict__ ring_z,
                                          const int32_t *__restrict__ src, int32_t n_win, int32_t m,
                                          int32_t c, int32_t d, float *__restrict__ entry) {
    const int64_t k = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (k >= (int64_t)n_win * d) return;
    const int64_t w = k / d;
    SlotsListed s;
    s.call_c = call_c, s.call_z = call_z, s.ring_c = ring_c, s.ring_z = ring_z;
    s.src = src + w * c * m;
    s.call_stride = call_stride;
    s.m = m, s.c = c, s.d = d, s.ch = (int32_t)(k % d);
    entry[k] = pool_slots(s, c * m);
}

extern "C" di_status di_cuda_compress_pool_list(di_cuda *cu, const float *call_c,
                                                const float *call_z, int64_t call_stride,
                                                const float *ring_c, const float *ring_z,
                                                const int32_t *src, int32_t n_win, int32_t m,
                                                int32_t c, int32_t d, float *entry) {
    if ((c != 1 && c != 2) || m < 1 || d < 0) return DI_ERR_INVALID;
    const int64_t n = (int64_t)n_win * d;
    if (n <= 0) return DI_OK;
    compress_pool_list_kernel<<<di_div_up(n, 256), 256, 0, di_stream(cu)>>>(
        call_c, call_z, call_stride, ring_c, ring_z, src, n_win, m, c, d, entry);
    DI_CUDA_LAUNCHED("compress_pool_list_kernel");
    return DI_OK;
}
