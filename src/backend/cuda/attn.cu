// attn — FP8 KV rows, attention over index-listed keys with the sink, compressor pooling
// (attn.cuh).
#include <cuda_bf16.h>
#include <algorithm>
#include <cuda_fp8.h>

#include "backend/backend.h" // DI_BACKEND_*_BLOCK
#include "backend/cuda/attn.cuh"
#include "backend/cuda/common.cuh"
#include "backend/cuda/wgmma.cuh" // wg_* (sm_90a), di_wg_* (wgmma_layout.h)

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

// ---- attention on tensor cores (BF16 mma.sync, FlashMLA-style sparse decode) ----
//
// One kernel, two key sources (the template parameter R: TcRowsFp8, V4's 584-byte KV rows, for
// di_cuda_attn_bf16; TcRowsCodes, V4.1's Q8 window rows then Q4e entries, for
// di_cuda_attn_codes_bf16): only the copy and the decode of step 1 and 2 differ.
// Block = (query row t, group of 64 heads, key split), 8 warps. Per tile of 64 listed keys:
//   1. cp.async of the raw rows into one of two raw stages (pieces the rows allow: 8 bytes for
//      V4's 584-byte rows; 16 / 8 / 4 for the codes at dh 512 / 256 / 128); the next tile's copy
//      is issued before this tile's arithmetic, so HBM reads overlap the tensor cores;
//   2. exact decode to BF16 in shared memory (e4m3 x 2^k has 4 significant bits, e2m1 x e4m3 6:
//      exact in BF16's 8; V4's rope dims are BF16 already); masked keys (index < 0, past the
//      split) become zeros;
//   3. S = Q K^T: warp w takes heads 16*(w%4).. and keys 32*(w/4).. (4 n-tiles), k over dh;
//   4. online softmax: per-head tile maxima via shared memory, P = exp(S - m) rounded to BF16
//      into shared memory, row sums of the rounded P;
//   5. O += P V: warp w takes all 64 heads and dims w*dh/8.. (O in registers: 64 x dh/8 per warp,
//      128 floats per thread at dh 512), V = the decoded keys read transposed (ldmatrix.trans).
// Every thread keeps its own copy of the running max of the rows it touches; the copies stay
// equal because each is the same fmaxf chain over the same shared values.
// Shared memory (dh 512): Q 66.5 KB + K 66.5 KB + P 9 KB + 2 raw stages (73 KB of 584-byte rows,
// 66 KB of 528-byte code rows) + 1.5 KB = 213.5 KB (V4) / 206.5 KB (codes). ptxas (sm_90a): 220
// and 218 registers, no spills.

namespace {

enum {
    TC_THREADS = 256,
    TC_WARPS = TC_THREADS / 32,
    TC_HEADS = 64,               // heads per block (the MMA M side: 4 m-tiles)
    TC_BN = 64,                  // keys per tile
    TC_MIN_KEYS_PER_SPLIT = 128, // automatic splits keep >= 2 tiles each (load/compute overlap)
    TC_MAX_SPLITS = 4096
};

// The block's shared memory for head dim DH and raw stage rows of RS bytes (the key source's).
template <int DH, int RS> struct TcShape {
    static constexpr int LD = DH + 8;     // BF16 row stride of Q and K: 16-byte skew per row,
    static constexpr int LDP = TC_BN + 8; // so ldmatrix's 8 rows hit 8 different bank groups
    static constexpr int NT = DH / 64;    // PV n-tiles (of 8 dims) per warp: dh/8 dims per warp
    static constexpr size_t Q_OFF = 0;
    static constexpr size_t K_OFF = Q_OFF + (size_t)TC_HEADS * LD * 2;
    static constexpr size_t P_OFF = K_OFF + (size_t)TC_BN * LD * 2;
    static constexpr size_t RAW_OFF = P_OFF + (size_t)TC_HEADS * LDP * 2;
    static constexpr size_t IDX_OFF = RAW_OFF + 2 * (size_t)TC_BN * RS;
    static constexpr size_t RED_OFF = IDX_OFF + 2 * (size_t)TC_BN * 4;
    static constexpr size_t SMEM = RED_OFF + 4 * (size_t)TC_HEADS * 4;
    static_assert(DH % 128 == 0, "tile shapes: dh/8 dims per warp in pairs of 8-dim n-tiles");
    static_assert(RS % 8 == 0, "raw rows 8-byte aligned (the decode's 8-byte loads)");
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

__device__ __forceinline__ void cp_async4(void *dst, const void *src) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(smem_u32(dst)), "l"(src)
                 : "memory");
}
__device__ __forceinline__ void cp_async16(void *dst, const void *src) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(smem_u32(dst)), "l"(src)
                 : "memory");
}

// Two e2m1 codes (the low nibble first) times the block scale, as BF16x2: exact (an e2m1 value
// has 2 significant bits, the E4M3 scale 4: their FP32 product has at most 6, exact in BF16).
__device__ __forceinline__ uint32_t e2m1x2_bf16x2(uint32_t byte, float sc) {
    return bf162_bits(
        __floats2bfloat162_rn(di_e2m1_f32(byte & 15u) * sc, di_e2m1_f32((byte >> 4) & 15u) * sc));
}

// 8 dims as BF16 (exact, as above): e4m3 codes (8 bytes at p, 8-byte aligned) or e2m1 pairs
// (4 bytes at p, 4-byte aligned) times their block's scale sc.
__device__ __forceinline__ uint4 e4m3x8_bf16(const uint8_t *p, float sc) {
    const uint2 codes = *(const uint2 *)p;
    return make_uint4(e4m3x2_bf16x2(codes.x, sc), e4m3x2_bf16x2(codes.x >> 16, sc),
                      e4m3x2_bf16x2(codes.y, sc), e4m3x2_bf16x2(codes.y >> 16, sc));
}
__device__ __forceinline__ uint4 e2m1x8_bf16(const uint8_t *p, float sc) {
    const uint32_t nib = *(const uint32_t *)p;
    return make_uint4(e2m1x2_bf16x2(nib & 0xFFu, sc), e2m1x2_bf16x2((nib >> 8) & 0xFFu, sc),
                      e2m1x2_bf16x2((nib >> 16) & 0xFFu, sc), e2m1x2_bf16x2(nib >> 24, sc));
}

// Key sources of attn_tc_kernel: the raw stage's row stride RS (bytes), and for listed key j
// (its position in the row's list) with row index id: its bytes, its copy into the raw stage in
// pieces of piece() bytes, and the exact BF16 decode of 8 dims from the staged row. begin(t, nk)
// sees the block's query row before any of them.
//
// V4's KV rows (584 bytes at dh 512, 8-byte aligned: 8-byte pieces): nope dims e4m3 x the UE8M0
// scale of their 64, rope dims BF16 already.
template <int DH, int ROT> struct TcRowsFp8 {
    static constexpr int NOPE = DH - ROT;
    static constexpr int RB = (NOPE + 2 * ROT + NOPE / 64 + 7) / 8 * 8; // di_cuda_kv_row_bytes
    static constexpr int RS = RB;
    static_assert(NOPE % 64 == 0 && ROT % 8 == 0, "8-dim decode groups inside nope or rope");
    const uint8_t *pool;
    __device__ __forceinline__ void begin(int64_t, int32_t) {}
    __device__ __forceinline__ int piece() const {
        return 8;
    }
    __device__ __forceinline__ int bytes(int32_t) const {
        return RB;
    }
    __device__ __forceinline__ void copy(uint8_t *dst, int32_t id, int32_t, int off) const {
        cp_async8(dst, pool + (int64_t)id * RB + off);
    }
    __device__ __forceinline__ uint4 decode8(const uint8_t *row, int c, int32_t) const {
        uint4 v;
        if (c < NOPE) {
            v = e4m3x8_bf16(row + c, di_ue8m0_f32(row[NOPE + 2 * ROT + c / 64]));
        } else {
            const uint2 lo = *(const uint2 *)(row + NOPE + 2 * (c - NOPE));
            const uint2 hi = *(const uint2 *)(row + NOPE + 2 * (c - NOPE) + 8);
            v = make_uint4(lo.x, lo.y, hi.x, hi.y);
        }
        return v;
    }
};

// V4.1's stored codes (backend.h attn_codes): key j < n_win[t] (clamped to the row's keys) the
// Q8 window row win + id * WB (e4m3 codes, a UE8M0 scale per 32 dims), the rest the Q4e entry
// ent + id * EB (e2m1 pairs, an E4M3 scale per 16 dims); both decode exactly into BF16. vw: the
// copy piece (16, 8 or 4 bytes: attn_codes_piece, the widest dividing both row sizes and bases).
template <int DH> struct TcRowsCodes {
    static constexpr int WB = DH + DH / DI_BACKEND_WIN_BLOCK,
                         EB = DH / 2 + DH / DI_BACKEND_ENT_BLOCK;
    static constexpr int RS = (WB + 15) / 16 * 16; // 16-byte pieces land 16-byte aligned
    const uint8_t *win, *ent;
    const int32_t *n_win;
    int32_t vw, nw;
    __device__ __forceinline__ void begin(int64_t t, int32_t nk) {
        nw = min(max(n_win[t], 0), nk);
    }
    __device__ __forceinline__ int piece() const {
        return vw;
    }
    __device__ __forceinline__ int bytes(int32_t j) const {
        return j < nw ? WB : EB;
    }
    __device__ __forceinline__ void copy(uint8_t *dst, int32_t id, int32_t j, int off) const {
        const uint8_t *src = j < nw ? win + (int64_t)id * WB + off : ent + (int64_t)id * EB + off;
        if (vw == 16)
            cp_async16(dst, src);
        else if (vw == 8)
            cp_async8(dst, src);
        else
            cp_async4(dst, src);
    }
    __device__ __forceinline__ uint4 decode8(const uint8_t *row, int c, int32_t j) const {
        return j < nw
                   ? e4m3x8_bf16(row + c, di_ue8m0_f32(row[DH + c / DI_BACKEND_WIN_BLOCK]))
                   : e2m1x8_bf16(row + c / 2, di_e4m3_f32(row[DH / 2 + c / DI_BACKEND_ENT_BLOCK]));
    }
};

// ---- the tile steps both tensor-core kernels share (attn_tc_kernel, attn_wg_kernel) ----
// A block of TC_THREADS threads walks its split's listed keys in tiles of TC_BN through two raw
// stages: the list entries of a tile into idx_s[st] (-1 = masked or past the split), their raw
// rows copied into raw stage st, decoded exactly into the BF16 K tile; after S = Q K^T, each
// thread's two S rows masked, scaled and reduced to the tile's maxima per key half.

// idx_s[st] <- the list entries of tile it (-1 past the split's end k_end).
__device__ __forceinline__ void tc_load_idx(int32_t *idx_s, const int32_t *idx_row, int32_t k_beg,
                                            int32_t k_end, int32_t it, int st, int tid) {
    if (tid < TC_BN) {
        const int32_t j = k_beg + it * TC_BN + tid;
        idx_s[st * TC_BN + tid] = j < k_end ? idx_row[j] : -1;
    }
}

// Raw rows of tile it (listed in idx_s[st]) -> raw stage st, one cp.async group; masked rows are
// skipped, a row shorter than RS (an entry) copies its own bytes only.
template <class R>
__device__ __forceinline__ void tc_issue(const R &rows, uint8_t *raw, const int32_t *idx_s,
                                         int32_t k_beg, int32_t it, int st, int tid) {
    const int pc = rows.piece(), ch = R::RS / pc;
    uint8_t *dst = raw + (size_t)st * TC_BN * R::RS;
    for (int c = tid; c < TC_BN * ch; c += TC_THREADS) {
        const int r = c / ch, off = (c - r * ch) * pc;
        const int32_t id = idx_s[st * TC_BN + r], j = k_beg + it * TC_BN + r;
        if (id >= 0 && off < rows.bytes(j)) rows.copy(dst + r * R::RS + off, id, j, off);
    }
    cp_async_commit();
}

// Raw stage st -> the BF16 K tile, 8 dims (16 bytes) a step: dims c .. c + 7 of key r stored at
// at(r, c) (the kernel's tile layout); masked keys become zeros.
template <int DH, class R, class At>
__device__ __forceinline__ void tc_decode(const R &rows, const uint8_t *raw, const int32_t *idx_s,
                                          int32_t k_beg, int32_t it, int st, int tid, At at) {
    constexpr int G = DH / 8;
    const uint8_t *src = raw + (size_t)st * TC_BN * R::RS;
    for (int g = tid; g < TC_BN * G; g += TC_THREADS) {
        const int r = g / G, c = (g % G) * 8;
        uint4 v = make_uint4(0u, 0u, 0u, 0u);
        if (idx_s[st * TC_BN + r] >= 0)
            v = rows.decode8(src + r * R::RS, c, k_beg + it * TC_BN + r);
        *(uint4 *)at(r, c) = v;
    }
}

// This thread's S fragment of 32 keys (s[4 nt + e]: row rq + 8 (e / 2), key 8 nt + c4 + e % 2 of
// the key half whose mask entries are msk[0..32)): masked keys -inf, the rest times scale; the
// rows' maxima over the half (the 4 lanes of a row by shuffles) into red_max[rq], [rq + 8].
__device__ __forceinline__ void tc_tile_max(float *s, const int32_t *msk, int c4, int lane, int rq,
                                            float scale, float *red_max) {
    float mx0 = -INFINITY, mx1 = -INFINITY;
#pragma unroll
    for (int nt = 0; nt < 4; nt++)
#pragma unroll
        for (int e = 0; e < 2; e++) {
            const bool ok = msk[nt * 8 + c4 + e] >= 0;
            s[4 * nt + e] = ok ? s[4 * nt + e] * scale : -INFINITY;
            s[4 * nt + 2 + e] = ok ? s[4 * nt + 2 + e] * scale : -INFINITY;
            mx0 = fmaxf(mx0, s[4 * nt + e]);
            mx1 = fmaxf(mx1, s[4 * nt + 2 + e]);
        }
    mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 1));
    mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 2));
    mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 1));
    mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 2));
    if ((lane & 3) == 0) {
        red_max[rq] = mx0;
        red_max[rq + 8] = mx1;
    }
}

template <int DH, class R>
__global__ void __launch_bounds__(TC_THREADS, 1)
    attn_tc_kernel(const float *__restrict__ q, R rows, const int32_t *__restrict__ key_idx,
                   int64_t key_stride, const int32_t *__restrict__ n_keys, int32_t max_keys,
                   const float *__restrict__ sink, int32_t H, int32_t n_split, int32_t chunk,
                   float scale, float *__restrict__ o, float *__restrict__ o_part,
                   float *__restrict__ ml_part, int *__restrict__ flags) {
    using S = TcShape<DH, R::RS>;
    extern __shared__ __align__(16) uint8_t smem[];
    __nv_bfloat16 *Qs = (__nv_bfloat16 *)(smem + S::Q_OFF); // [64 heads][LD]
    __nv_bfloat16 *Ks = (__nv_bfloat16 *)(smem + S::K_OFF); // [64 keys][LD] decoded
    __nv_bfloat16 *Ps = (__nv_bfloat16 *)(smem + S::P_OFF); // [64 heads][LDP]
    uint8_t *raw = smem + S::RAW_OFF;                       // [2][64][RS]
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
    rows.begin(t, nk);

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
        tc_load_idx(idx_s, idx_row, k_beg, k_end, it, st, tid);
    };
    auto issue = [&](int32_t it, int st) { tc_issue(rows, raw, idx_s, k_beg, it, st, tid); };
    auto decode = [&](int32_t it, int st) { // raw stage st -> Ks (row-major, skewed rows)
        tc_decode<DH>(rows, raw, idx_s, k_beg, it, st, tid,
                      [&](int r, int c) { return Ks + r * S::LD + c; });
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
    if (n_tiles > 0) issue(0, 0);
    for (int32_t it = 0; it < n_tiles; it++) {
        const int st = it & 1;
        cp_async_wait_all();
        // (B) this tile's raw rows have landed for every thread; the previous tile's P.V (the
        // last reader of Ks, Ps and red_*) is done everywhere.
        __syncthreads();
        decode(it, st);
        if (it + 1 < n_tiles) load_idx(it + 1, st ^ 1); // stage st^1 free since tile it-1
        __syncthreads();                                // (C) Ks, idx_s[st ^ 1]
        if (it + 1 < n_tiles) issue(it + 1, st ^ 1);    // in flight during this tile's arithmetic
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
        tc_tile_max(&s[0][0], msk + kh * 32, c4, lane, rq, scale, red_max + kh * TC_HEADS);
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

// ---- attention on wgmma (sm_90a: Hopper's warpgroup MMA) ----
//
// attn_tc_kernel's block, key sources, decode, online softmax and numerics with the two products
// on wgmma (wgmma.cuh, wgmma_layout.h) instead of mma.sync, for dh 512 (V4's 584-byte rows and
// V4.1's codes). Block = (query row t, group of 64 heads, key split), 2 warpgroups (256 threads).
// Per tile of 64 listed keys:
//   1. cp.async of the next tile's raw rows (2 raw stages, as attn_tc_kernel);
//   2. exact decode of this tile into the K tile (BF16, SW128 k-blocked: 64 keys x 512 dims),
//      16-byte stores, fence.proxy.async (the tensor cores read through the async proxy);
//   3. S = Q K^T: warpgroup g computes heads 0..63 x keys 32g..32g+31 (m64n32k16, 32 k-steps
//      over the dims, A = Q and B = the K tile both K-major in shared memory), wait_group 0;
//   4. online softmax in registers: thread (warp w, lane l) holds rows rq = 16 (w % 4) + l / 4
//      and rq + 8 of both S and O (the accumulator map), so one running max and sum per row;
//      the two key halves' maxima and sums meet in shared memory; P = exp(S - m) rounded to BF16
//      into the P tile (SW128, 64 x 64), fence.proxy.async;
//   5. O = O * alpha + P V: warpgroup g computes heads 0..63 x dims 256g..256g+255 (m64n256k16,
//      4 k-steps over the keys, A = P K-major, B = the K tile MN-major: tnspB), 128 FP32
//      accumulators per thread, wait_group 0.
// Shared memory (1024-aligned): Q 64 KB + K 64 KB + P 8 KB + 2 raw stages (73 KB of 584-byte
// rows / 66 KB of 528-byte codes) + indices and reductions 1.5 KB + 1 KB alignment slack =
// 211.5 KB (V4) / 204.5 KB (codes). ptxas (sm_90a, CUDA 13.0): 183 (V4) / 180 (codes) registers,
// 0 bytes stack frame and spills; SASS: 32 HGMMA.64x32x16 + 4 HGMMA.64x256x16 per instance, no
// LDL/STL (scripts/gpu-check --build-only checks both on every CI run).
//
// The count that bounds it (V4-Flash, 64 heads, dh 512): per key QK^T + PV = 2 x 64 x 512 x 2 =
// 131k FLOP over 584 bytes, 224 FLOP/byte; the H200's dense-BF16 ridge is ~206 FLOP/byte
// (990 TFLOP/s / 4.8 TB/s). So 3,000 GB/s needs ~670 TFLOP/s of BF16 MMA, near wgmma's peak and
// out of reach of mma.sync (about half of it). This version is the first step: decode, S and PV
// of a tile run one after another (no warp specialisation, no second K tile: the shared memory
// has room for one decoded tile beside Q and the raw stages), and S's m64n32 instructions are
// narrow; its bound is the serial sum per tile, not HBM. A rough count per 64-key tile and SM
// (1.8 GHz): S ~1.5k cycles (32 m64n32k16 per warpgroup, their A and B re-read from shared memory
// at 128 B/cycle), PV ~1k (8 m64n256k16 at the MMA rate), the decode ~1.3k (4096 8-dim groups),
// softmax and barriers ~0.3k: ~4k cycles for 37 KB of rows, ~2 TB/s over 132 busy SMs (batch 64,
// or enough splits) — predicted, never measured. docs/cuda.md "Not done yet" lists what is left
// for 3,000 GB/s (a producer warpgroup with two decoded tiles so decode and MMA overlap, S on
// N = 64 in one warpgroup while the other does PV).
//
// Outside sm_90a (sm_80, sm_100, plain sm_90) the kernel compiles to a stub writing NaN to every
// output it owns, so a dispatch mistake fails the check-once comparison instead of passing stale
// memory off as a result; the host never launches it there (attn_wg_usable).

// TC_THREADS: the shared tile steps (tc_issue, tc_decode) stride by it.
enum { WG_THREADS = TC_THREADS, WG_ALIGN = 1024 };

template <int RS> struct WgShape {
    static constexpr int DH = 512;
    static constexpr size_t Q_OFF = 0;
    static constexpr size_t K_OFF = Q_OFF + (size_t)TC_HEADS * DH * 2;
    static constexpr size_t P_OFF = K_OFF + (size_t)TC_BN * DH * 2;
    static constexpr size_t RAW_OFF = P_OFF + (size_t)TC_HEADS * TC_BN * 2;
    static constexpr size_t IDX_OFF = RAW_OFF + 2 * (size_t)TC_BN * RS;
    static constexpr size_t RED_OFF = IDX_OFF + 2 * (size_t)TC_BN * 4;
    static constexpr size_t SMEM = RED_OFF + 4 * (size_t)TC_HEADS * 4 + WG_ALIGN;
    static_assert(K_OFF % 1024 == 0 && P_OFF % 1024 == 0, "SW128 tiles 1024-byte aligned");
    static_assert(RAW_OFF % 16 == 0 && IDX_OFF % 16 == 0 && RS % 8 == 0, "aligned stages");
};

template <class R>
__global__ void __launch_bounds__(WG_THREADS, 1)
    attn_wg_kernel(const float *__restrict__ q, R rows, const int32_t *__restrict__ key_idx,
                   int64_t key_stride, const int32_t *__restrict__ n_keys, int32_t max_keys,
                   const float *__restrict__ sink, int32_t H, int32_t n_split, int32_t chunk,
                   float scale, float *__restrict__ o, float *__restrict__ o_part,
                   float *__restrict__ ml_part, int *__restrict__ flags) {
    constexpr int DH = 512;
    using S = WgShape<R::RS>;
    const int tid = threadIdx.x;
    const int64_t t = blockIdx.x / n_split;
    const int32_t split = (int32_t)(blockIdx.x % n_split), h0 = (int32_t)blockIdx.y * TC_HEADS;
#if DI_WG_ENABLED
    extern __shared__ __align__(16) uint8_t wg_smem_raw[];
    uint8_t *smem =
        wg_smem_raw + ((WG_ALIGN - (smem_u32(wg_smem_raw) & (WG_ALIGN - 1))) & (WG_ALIGN - 1));
    uint8_t *Qs = smem + S::Q_OFF, *Ks = smem + S::K_OFF, *Ps = smem + S::P_OFF;
    uint8_t *raw = smem + S::RAW_OFF;                // [2][64][RS]
    int32_t *idx_s = (int32_t *)(smem + S::IDX_OFF); // [2][64], -1 = masked
    float *red_max = (float *)(smem + S::RED_OFF);   // [2 key halves][64 heads]
    float *red_sum = red_max + 2 * TC_HEADS;         // [2][64]
    const uint32_t q_sa = smem_u32(Qs), k_sa = smem_u32(Ks), p_sa = smem_u32(Ps);

    const int lane = tid & 31, warp = tid >> 5, wg = warp >> 2;
    const int32_t nk =
        di_cuda_attn_clamp_keys(n_keys[t], max_keys, flags, split == 0 && blockIdx.y == 0);
    const int32_t k_beg = split * chunk, k_end = min(nk, k_beg + chunk);
    const int32_t n_tiles = k_end > k_beg ? (k_end - k_beg + TC_BN - 1) / TC_BN : 0;
    const int32_t *idx_row = key_idx + t * key_stride;
    rows.begin(t, nk);

    // q rows h0 .. h0+63 -> BF16 Q tile (zeros past H), 8 dims (16 bytes) a step.
    for (int i = tid; i < TC_HEADS * (DH / 8); i += WG_THREADS) {
        const int r = i / (DH / 8), c = (i % (DH / 8)) * 8;
        float4 v0 = make_float4(0.0f, 0.0f, 0.0f, 0.0f), v1 = v0;
        if (h0 + r < H) {
            const float *src = q + ((t * H + h0 + r) * DH + c);
            v0 = *(const float4 *)src;
            v1 = *(const float4 *)(src + 4);
        }
        *(uint4 *)(Qs + di_wg_tile_off(r, c, TC_HEADS)) =
            make_uint4(bf162_bits(__floats2bfloat162_rn(v0.x, v0.y)),
                       bf162_bits(__floats2bfloat162_rn(v0.z, v0.w)),
                       bf162_bits(__floats2bfloat162_rn(v1.x, v1.y)),
                       bf162_bits(__floats2bfloat162_rn(v1.z, v1.w)));
    }
    wg_fence_proxy_async();
    auto load_idx = [&](int32_t it, int st) {
        tc_load_idx(idx_s, idx_row, k_beg, k_end, it, st, tid);
    };
    auto issue = [&](int32_t it, int st) { tc_issue(rows, raw, idx_s, k_beg, it, st, tid); };
    auto decode = [&](int32_t it, int st) { // raw stage st -> the K tile (SW128 k-blocked)
        tc_decode<DH>(rows, raw, idx_s, k_beg, it, st, tid,
                      [&](int r, int c) { return Ks + di_wg_tile_off(r, c, TC_BN); });
        wg_fence_proxy_async();
    };

    const int g4 = lane >> 2, c4 = (lane & 3) * 2; // accumulator: rows g4 (+8), cols c4, c4 + 1
    const int rq = (warp & 3) * 16 + g4;           // this thread's rows rq, rq + 8 (S and O)
    float m_r[2] = {-INFINITY, -INFINITY}, l_r[2] = {0.0f, 0.0f};
    float acc[128]; // O: rows rq (+8), dims 256 wg + 8 (i / 4) + c4 + i % 2
#pragma unroll
    for (int i = 0; i < 128; i++) acc[i] = 0.0f;

    if (n_tiles > 0) load_idx(0, 0);
    __syncthreads(); // Qs, idx_s[0]
    if (n_tiles > 0) issue(0, 0);
    for (int32_t it = 0; it < n_tiles; it++) {
        const int st = it & 1;
        cp_async_wait_all();
        // (B) this tile's raw rows have landed everywhere; the previous tile's MMAs (the last
        // readers of Ks and Ps, waited for by each warpgroup) and red_* readers are done.
        __syncthreads();
        decode(it, st);
        if (it + 1 < n_tiles) load_idx(it + 1, st ^ 1);
        __syncthreads();                             // (C) Ks (fenced), idx_s[st ^ 1]
        if (it + 1 < n_tiles) issue(it + 1, st ^ 1); // in flight during this tile's arithmetic
        const int32_t *msk = idx_s + st * TC_BN;

        // ---- S = Q K^T: 64 heads x keys 32 wg .. 32 wg + 31 ----
        float s[16];
#pragma unroll
        for (int i = 0; i < 16; i++) s[i] = 0.0f;
        wg_fence_regs(s);
        wg_fence();
#pragma unroll
        for (int k0 = 0; k0 < DH; k0 += 16)
            wg_m64n32k16_ss(s, di_wg_desc_kmajor(q_sa, TC_HEADS, 0, k0),
                            di_wg_desc_kmajor(k_sa, TC_BN, 32 * wg, k0), k0 > 0 ? 1 : 0);
        wg_commit();
        wg_wait<0>();
        wg_fence_regs(s);
        // s[4 nt + e]: row rq + 8 (e / 2), key 32 wg + 8 nt + c4 + e % 2 (attn_tc_kernel's
        // s[nt][e] for its warp's key half: the same arithmetic from here on).
        tc_tile_max(s, msk + wg * 32, c4, lane, rq, scale, red_max + wg * TC_HEADS);
        __syncthreads(); // (D) tile maxima of both key halves

        // ---- P = exp(S - m_new) in BF16 (the P tile), row sums of the rounded values ----
        const float mn0 = fmaxf(m_r[0], fmaxf(red_max[rq], red_max[TC_HEADS + rq]));
        const float mn1 = fmaxf(m_r[1], fmaxf(red_max[rq + 8], red_max[TC_HEADS + rq + 8]));
        {
            float sum0 = 0.0f, sum1 = 0.0f;
#pragma unroll
            for (int nt = 0; nt < 4; nt++) {
                const float p0 = mn0 == -INFINITY ? 0.0f : expf(s[4 * nt] - mn0);
                const float p1 = mn0 == -INFINITY ? 0.0f : expf(s[4 * nt + 1] - mn0);
                const float p2 = mn1 == -INFINITY ? 0.0f : expf(s[4 * nt + 2] - mn1);
                const float p3 = mn1 == -INFINITY ? 0.0f : expf(s[4 * nt + 3] - mn1);
                const __nv_bfloat162 lo = __floats2bfloat162_rn(p0, p1);
                const __nv_bfloat162 hi = __floats2bfloat162_rn(p2, p3);
                const int col = wg * 32 + nt * 8 + c4;
                *(__nv_bfloat162 *)(Ps + di_wg_tile_off(rq, col, TC_HEADS)) = lo;
                *(__nv_bfloat162 *)(Ps + di_wg_tile_off(rq + 8, col, TC_HEADS)) = hi;
                const float2 fl = __bfloat1622float2(lo), fh = __bfloat1622float2(hi);
                sum0 += fl.x + fl.y;
                sum1 += fh.x + fh.y;
            }
            wg_fence_proxy_async();
            sum0 += __shfl_xor_sync(0xffffffffu, sum0, 1);
            sum0 += __shfl_xor_sync(0xffffffffu, sum0, 2);
            sum1 += __shfl_xor_sync(0xffffffffu, sum1, 1);
            sum1 += __shfl_xor_sync(0xffffffffu, sum1, 2);
            if ((lane & 3) == 0) {
                red_sum[wg * TC_HEADS + rq] = sum0;
                red_sum[wg * TC_HEADS + rq + 8] = sum1;
            }
        }
        __syncthreads(); // (E) Ps (fenced), red_sum

        // ---- rescale O, then O += P V (64 heads x dims 256 wg ..) ----
        const float a0 = mn0 == -INFINITY ? 1.0f : expf(m_r[0] - mn0);
        const float a1 = mn1 == -INFINITY ? 1.0f : expf(m_r[1] - mn1);
        l_r[0] = l_r[0] * a0 + (red_sum[rq] + red_sum[TC_HEADS + rq]);
        l_r[1] = l_r[1] * a1 + (red_sum[rq + 8] + red_sum[TC_HEADS + rq + 8]);
        m_r[0] = mn0, m_r[1] = mn1;
#pragma unroll
        for (int i = 0; i < 128; i++) acc[i] *= (i & 2) ? a1 : a0;
        wg_fence_regs(acc); // the rescale above wgmma.fence
        wg_fence();
#pragma unroll
        for (int k0 = 0; k0 < TC_BN; k0 += 16)
            wg_m64n256k16_ss_tb(acc, di_wg_desc_kmajor(p_sa, TC_HEADS, 0, k0),
                                di_wg_desc_mnmajor(k_sa, TC_BN, k0, 256 * wg), 1);
        wg_commit();
        wg_wait<0>();
        wg_fence_regs(acc);
    }

    // ---- epilogue: the sink and 1/den (one split), or the split's (O, m, l) for the combine ----
    const int d0 = 256 * wg + c4;
#pragma unroll
    for (int hf = 0; hf < 2; hf++) {
        const int32_t h = h0 + rq + 8 * hf;
        if (h >= H) continue;
        const float m = m_r[hf], l = l_r[hf];
        if (n_split == 1) {
            const float sk = sink[h], M = fmaxf(m, sk);
            const float f = m == -INFINITY ? 0.0f : expf(m - M);
            const float mul = f / (l * f + expf(sk - M));
            float *orow = o + (t * H + h) * DH + d0;
#pragma unroll
            for (int j = 0; j < 32; j++)
                *(float2 *)(orow + 8 * j) =
                    make_float2(acc[4 * j + 2 * hf] * mul, acc[4 * j + 2 * hf + 1] * mul);
        } else {
            const int64_t pr = (t * n_split + split) * H + h;
            float *orow = o_part + pr * DH + d0;
#pragma unroll
            for (int j = 0; j < 32; j++)
                *(float2 *)(orow + 8 * j) =
                    make_float2(acc[4 * j + 2 * hf], acc[4 * j + 2 * hf + 1]);
            if (wg == 0 && (lane & 3) == 0) ml_part[2 * pr] = m, ml_part[2 * pr + 1] = l;
        }
    }
#else
    // Not sm_90a: NaN into everything this block owns (never launched: attn_wg_usable).
    (void)rows, (void)key_idx, (void)key_stride, (void)n_keys, (void)max_keys, (void)sink,
        (void)chunk, (void)scale, (void)flags;
    for (int i = tid; i < TC_HEADS * DH; i += WG_THREADS) {
        const int32_t h = h0 + i / DH;
        if (h >= H) continue;
        if (n_split == 1) {
            o[(t * H + h) * DH + i % DH] = NAN;
        } else {
            const int64_t pr = (t * n_split + split) * H + h;
            o_part[pr * DH + i % DH] = NAN;
            if (i % DH == 0) ml_part[2 * pr] = NAN, ml_part[2 * pr + 1] = NAN;
        }
    }
#endif
}

// Shared memory of one attn_tc_kernel<DH, R> block.
template <int DH, class R> constexpr size_t tc_smem() {
    return TcShape<DH, R::RS>::SMEM;
}
// ... and of one attn_wg_kernel<R> block (dh 512).
template <class R> constexpr size_t wg_smem() {
    return WgShape<R::RS>::SMEM;
}

// The kernel of one instance: attn_wg_kernel<R> (WG, dh 512 only) or attn_tc_kernel<DH, R>.
template <int DH, class R, bool WG> const void *tc_fn() {
    if constexpr (WG) {
        static_assert(DH == 512, "the wgmma kernel is dh 512 only");
        return (const void *)attn_wg_kernel<R>;
    } else {
        return (const void *)attn_tc_kernel<DH, R>;
    }
}

// Whether the wgmma kernel fn has this device's machine code: a cc 9.0 device running the sm_90a
// instance (binaryVersion 90; a binary without compute_90a runs its sm_80 code there, the stub).
// Read once per instance (*cache: 0 not read, 1 yes, -1 no; a property of the binary and the
// device, and a process drives one device kind).
bool attn_wg_usable(const di_cuda *cu, const void *fn, std::atomic<int> *cache) {
    if (cu->cc_major != 9 || cu->cc_minor != 0) return false;
    int c = cache->load(std::memory_order_relaxed);
    if (c == 0) {
        cudaFuncAttributes fa;
        const cudaError_t e = cudaFuncGetAttributes(&fa, fn);
        if (e != cudaSuccess) (void)cudaGetLastError();
        c = e == cudaSuccess && fa.binaryVersion == 90 ? 1 : -1;
        cache->store(c, std::memory_order_relaxed);
    }
    return c > 0;
}

// One instance (head dim, key source, kernel): the shared-memory fit (DI_ERR_UNSUPPORTED where the
// device has too little, or, for the wgmma kernel, no sm_90a code for it), the split plan, the
// split partials, the kernel and the combine.
template <int DH, bool WG, class R>
di_status attn_tc_launch(di_cuda *cu, const float *q, R rows, const int32_t *key_idx,
                         int64_t key_stride, const int32_t *n_keys, int32_t max_keys,
                         const float *sink, int32_t n_tok, int32_t H, float scale, int32_t n_split,
                         float *o) {
    constexpr size_t SMEM = WG ? wg_smem<R>() : tc_smem<DH, R>();
    const char *name = WG ? "attn_wg_kernel" : "attn_tc_kernel";
    const void *fn = tc_fn<DH, R, WG>();
    static di_smem_kernel smem_k; // one per instance
    if (WG) {
        static std::atomic<int> usable;
        if (!attn_wg_usable(cu, fn, &usable)) return DI_ERR_UNSUPPORTED;
    }
    {
        size_t st_smem = 0;
        const di_status fit = di_cuda_smem_fit(cu, &smem_k, fn, SMEM, &st_smem);
        if (fit == DI_ERR_INVALID) {
            DI_CUDA_LOG_ERROR("attention (%s): %zu + %zu (static) bytes of shared memory per "
                              "block needed, the device allows %zu",
                              name, SMEM, st_smem, cu->smem_optin);
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
    {
        const dim3 grid((unsigned)n_blocks, (unsigned)groups);
        const int32_t ck = (int32_t)(chunk > 0 ? chunk : TC_BN);
        if constexpr (WG)
            attn_wg_kernel<R><<<grid, WG_THREADS, SMEM, di_stream(cu)>>>(
                q, rows, key_idx, key_stride, n_keys, max_keys, sink, H, (int32_t)ns, ck, scale, o,
                o_part, ml_part, cu->flags_dev);
        else
            attn_tc_kernel<DH, R><<<grid, TC_THREADS, SMEM, di_stream(cu)>>>(
                q, rows, key_idx, key_stride, n_keys, max_keys, sink, H, (int32_t)ns, ck, scale, o,
                o_part, ml_part, cu->flags_dev);
    }
    DI_TRY(di_cuda_check_launch(name));
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
    if (v4) {
        const TcRowsFp8<512, 64> rows = {pool};
        return attn_tc_launch<512, false>(cu, q, rows, key_idx, key_stride, n_keys, max_keys, sink,
                                          n_tok, H, scale, n_split, o);
    }
    const TcRowsFp8<128, 64> rows = {pool};
    return attn_tc_launch<128, false>(cu, q, rows, key_idx, key_stride, n_keys, max_keys, sink,
                                      n_tok, H, scale, n_split, o);
}

extern "C" di_status di_cuda_attn_wg(di_cuda *cu, const float *q, const uint8_t *pool,
                                     const int32_t *key_idx, int64_t key_stride,
                                     const int32_t *n_keys, int32_t max_keys, const float *sink,
                                     int32_t n_tok, int32_t H, int32_t dh, int32_t n_rot,
                                     float scale, int32_t n_split, float *o) {
    if (max_keys < 0 || n_split < 0 || ((uintptr_t)q & 15) != 0 || ((uintptr_t)o & 7) != 0 ||
        dh != 512 || n_rot != 64)
        return DI_ERR_INVALID;
    if (n_tok <= 0 || H <= 0) return DI_OK;
    const TcRowsFp8<512, 64> rows = {pool};
    return attn_tc_launch<512, true>(cu, q, rows, key_idx, key_stride, n_keys, max_keys, sink,
                                     n_tok, H, scale, n_split, o);
}

// ---- attention over V4.1's stored codes (backend.h attn_codes) ----
//
// Flash-decoding over the compact codes (528-byte Q8 window rows, 288-byte Q4e entries at dh 512,
// instead of 2,048-byte FP32 rows). Block = (query row t, group of HB = 8 * HPW heads, key split):
// the keys are shared by all heads (K = V, MQA), so a block reads each key of its split once for
// its HB heads (HPW 8: 64 heads, one V4.1-Flash row), and the splits fill the GPU at batch 1 (a
// V4.1-Flash row alone is one head group: without splits one block for the whole GPU). Per tile of
// AC_BN = 32 listed keys, 8 warps:
//   1. the raw code rows of the next tile are copied into one of two raw stages (cp.async of the
//      widest piece the rows allow: 16 bytes where the row sizes and bases are 16-byte multiples,
//      i.e. dh a multiple of 512 (528 = 33 x 16, 288 = 18 x 16); 8 at dh 256, 4 at dh 128; plain
//      byte copies at dh 64 (66-byte window rows)), issued before this tile's arithmetic, so the
//      reads overlap it;
//   2. this tile's raw rows are decoded exactly into BF16 in shared memory (8 dims per 16-byte
//      store): e4m3 x 2^k and e2m1 x e4m3 have at most 4 and 6 significant bits, exact in BF16's 8
//      (the products are FP32-exact; only values below FP32's normal range, a block scale under
//      2^-117, can lose bits: at most 2^-133 absolute); masked keys (index < 0) and keys past the
//      split become zeros;
//   3. q.k in FP32: warp w takes heads w*HPW .. w*HPW + HPW - 1, lane l key l of the tile, each
//      over all dh (q in shared memory as FP32, read as broadcast float4s; the key row as 16-byte
//      BF16 pieces, rows skewed by 16 bytes: no bank conflicts);
//   4. online softmax with the running max and sum per head, all in the warp that owns the head
//      (shuffles only, no block barrier): p = exp(s - m) into the warp's own shared p tile;
//   5. o += p v in FP32 registers: the warp's HPW heads x lane l's dims 4(l + 32 g) .. + 3 (NG
//      groups; 128 accumulators per thread at dh 512, HPW 8).
// One split writes o = acc / (l + exp(sink - m)) (with the max rescaling); several write their
// (o, m, l) partials into pool scratch (di_cuda_alloc: graph-aware) and attn_tc_combine_kernel
// merges them (splits with no key weigh 0). The automatic split count fills the SMs (one block
// each: ~200 KB of shared memory at dh 512) with >= 2 tiles per split, as attn_tc's.
//
// Numerics against the CPU op (the oracle): FP32 scores, exps and sums in another order (within
// test_cuda_v41_codes' FP32 bound). round_p: the oracle rounds each normalised p = e_j / den to
// BF16 before p.v; a single pass has neither the final max nor den when it weighs a key, so this
// kernel keeps p unrounded (FP32) -- nearer the exact value than the rounded one. Each weight is
// then within half a BF16 ulp (2^-8 relative) plus the FP32 error of the oracle's, so o is within
// 2^-8 sum_j p_j |v_j| (plus the FP32 bound) of the oracle's; the test checks that bound (the CPU
// itself, rounding an FP32 p that may sit on the other side of a tie, is allowed one ulp: 2^-7).
// A two-pass kernel (max and den first, then p.v) would read every key twice.
//
// Predicted bound (unmeasured: docs/cuda.md): per key 2 x H x dh FMAs (65,536 at V4.1-Flash) on
// FP32 cores, 33.5 T FMA/s on an H200 -> ~0.5 G keys/s, ~150 GB/s of 288-byte entries: the kernel
// is arithmetic-bound at ~3% of the copy bandwidth. This is the FP32 recipe's kernel and the
// exact one the official recipe's tensor-core kernel (attn_tc_kernel<DH, TcRowsCodes>,
// di_cuda_attn_codes_bf16) is checked against once per context (di_cuda_attn_codes_dispatch).
// That kernel's predicted bound (unmeasured): the V4 kernel's key rate (the same arithmetic per
// key; mma.sync issue and ldmatrix traffic bound it, not HBM), ~0.5-0.75 TB/s of entries.
//
// The tensor-core kernel's numerics against the CPU op with round_p (the oracle): q rounded to
// BF16 (lossless: the official recipe's q is BF16, model/dsv41_attn.c; an FP32 q would move each
// score by <= 2^-8 scale sum_d |q_d k_d|); scores and p.v in the MMA's FP32 (Hopper may truncate
// its accumulator alignment: ~4x the RN gamma(dh)); each unnormalised p = exp(s - running max)
// rounded to BF16, the denominator the FP32 sum of the rounded values plus the sink's mass, so
// each weight is within 2u / (1 - u), u = 2^-8, of the exact normalised p, and within ~3u of the
// oracle's BF16-rounded one (itself within u of exact): o within (3u + 1e-4 + 16 gamma(dh) scale
// max_j sum_d |q_d k_jd|) sum_j p_j |v_j| of the oracle's (test_cuda_v41_codes: TOL_TC_*).

namespace {

enum {
    AC_THREADS = 256,
    AC_WARPS = AC_THREADS / 32,
    AC_BN = 32,                        // keys per tile: one per lane in q.k
    AC_MIN_KEYS_PER_SPLIT = 2 * AC_BN, // automatic splits keep >= 2 tiles each
    AC_MAX_SPLITS = 4096
};

// Shared memory of one block (bytes): q [HB][dh] FP32 | K [AC_BN][ldk] BF16 | raw [2][AC_BN][rs]
// | idx [2][AC_BN] | p [AC_WARPS][AC_BN][hpw] FP32.
struct AcLayout {
    int32_t ldk, rs;
    size_t k_off, raw_off, idx_off, p_off, total;
};

__host__ __device__ inline AcLayout ac_layout(int32_t dh, int32_t hpw) {
    AcLayout L;
    const int32_t wb = dh + dh / DI_BACKEND_WIN_BLOCK; // the window row, the longer of the two
    L.ldk = dh + 8;                                    // 16-byte skew per row
    L.rs = (wb + 15) / 16 * 16;
    L.k_off = sizeof(float) * (size_t)AC_WARPS * hpw * dh;
    L.raw_off = L.k_off + 2 * (size_t)AC_BN * L.ldk;
    L.idx_off = L.raw_off + 2 * (size_t)AC_BN * L.rs;
    L.p_off = L.idx_off + sizeof(int32_t) * 2 * AC_BN;
    L.total = L.p_off + sizeof(float) * (size_t)AC_WARPS * AC_BN * hpw;
    return L;
}

// BF16 pair (the low half first) as two floats.
__device__ __forceinline__ float bf_lo(uint32_t v) {
    return __uint_as_float(v << 16);
}
__device__ __forceinline__ float bf_hi(uint32_t v) {
    return __uint_as_float(v & 0xFFFF0000u);
}

// HPW heads per warp, NG groups of 4 dims per lane (4 * 32 * NG >= dh).
template <int HPW, int NG>
__global__ void __launch_bounds__(AC_THREADS, 1)
    attn_codes_kernel(const float *__restrict__ q, const uint8_t *__restrict__ win,
                      const uint8_t *__restrict__ ent, const int32_t *__restrict__ key_idx,
                      int64_t key_stride, const int32_t *__restrict__ n_win,
                      const int32_t *__restrict__ n_keys, int32_t max_keys,
                      const float *__restrict__ sink, int32_t H, int32_t dh, float scale,
                      int32_t n_split, int32_t chunk, int32_t vw, float *__restrict__ o,
                      float *__restrict__ o_part, float *__restrict__ ml_part,
                      int *__restrict__ flags) {
    constexpr int HB = AC_WARPS * HPW;
    extern __shared__ __align__(16) uint8_t smem[];
    const AcLayout L = ac_layout(dh, HPW);
    float *qs = (float *)smem;                             // [HB][dh]
    __nv_bfloat16 *ks = (__nv_bfloat16 *)(smem + L.k_off); // [AC_BN][ldk] decoded
    uint8_t *raw = smem + L.raw_off;                       // [2][AC_BN][rs]
    int32_t *idx_s = (int32_t *)(smem + L.idx_off);        // [2][AC_BN], -1 = masked
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    float *ps = (float *)(smem + L.p_off) + warp * AC_BN * HPW; // this warp's [AC_BN][HPW]

    const int64_t t = blockIdx.x / n_split;
    const int32_t split = (int32_t)(blockIdx.x % n_split), h0 = (int32_t)blockIdx.y * HB;
    // As attn_kernel: a count past max_keys (device data) clamped and flagged; n_win within it.
    const int32_t nk =
        di_cuda_attn_clamp_keys(n_keys[t], max_keys, flags, split == 0 && blockIdx.y == 0);
    const int32_t nw = min(max(n_win[t], 0), nk);
    const int64_t k_beg = (int64_t)split * chunk, k_end = min((int64_t)nk, k_beg + chunk);
    const int32_t n_tiles = k_end > k_beg ? (int32_t)((k_end - k_beg + AC_BN - 1) / AC_BN) : 0;
    const int32_t *idx_row = key_idx + t * key_stride;
    const int64_t wb = dh + dh / DI_BACKEND_WIN_BLOCK, eb = dh / 2 + dh / DI_BACKEND_ENT_BLOCK;

    // q rows h0 .. h0 + HB - 1 (zeros past H: their scores are 0, their outputs unwritten).
    for (int32_t e = tid; e < HB * dh; e += AC_THREADS) {
        const int32_t hh = e / dh;
        qs[e] = h0 + hh < H ? q[(t * H + h0 + hh) * dh + (e - hh * dh)] : 0.0f;
    }
    auto load_idx = [&](int32_t it, int st) {
        if (tid < AC_BN) {
            const int64_t j = k_beg + (int64_t)it * AC_BN + tid;
            idx_s[st * AC_BN + tid] = j < k_end ? idx_row[j] : -1;
        }
    };
    // Key r of tile it is a window row (Q8) or an entry (Q4e).
    auto is_win = [&](int32_t it, int r) { return k_beg + (int64_t)it * AC_BN + r < nw; };
    auto issue = [&](int32_t it, int st) { // raw rows of idx_s[st] -> raw stage st
        uint8_t *dst = raw + (size_t)st * AC_BN * L.rs;
        if (vw > 0) {
            const int ch = L.rs / vw;
            for (int c = tid; c < AC_BN * ch; c += AC_THREADS) {
                const int r = c / ch, off = (c - r * ch) * vw;
                const int32_t id = idx_s[st * AC_BN + r];
                const bool w = is_win(it, r);
                const int64_t rb = w ? wb : eb;
                if (id < 0 || off >= rb) continue; // masked, or past an entry's end
                const uint8_t *src = (w ? win : ent) + id * rb + off;
                if (vw == 16)
                    cp_async16(dst + r * L.rs + off, src);
                else if (vw == 8)
                    cp_async8(dst + r * L.rs + off, src);
                else
                    cp_async4(dst + r * L.rs + off, src);
            }
            cp_async_commit();
        } else { // rows not 4-byte multiples (dh 64): plain byte copies, published by barrier (B)
            for (int e = tid; e < AC_BN * L.rs; e += AC_THREADS) {
                const int r = e / L.rs, off = e - r * L.rs;
                const int32_t id = idx_s[st * AC_BN + r];
                const bool w = is_win(it, r);
                const int64_t rb = w ? wb : eb;
                if (id >= 0 && off < rb) dst[e] = (w ? win : ent)[id * rb + off];
            }
        }
    };
    auto decode = [&](int32_t it, int st) { // raw stage st -> ks (BF16), 8 dims per step
        const uint8_t *src = raw + (size_t)st * AC_BN * L.rs;
        const int32_t g8 = dh / 8;
        for (int32_t g = tid; g < AC_BN * g8; g += AC_THREADS) {
            const int32_t r = g / g8, c = (g - r * g8) * 8;
            uint4 v = make_uint4(0u, 0u, 0u, 0u);
            if (idx_s[st * AC_BN + r] >= 0) {
                const uint8_t *row = src + r * L.rs;
                v = is_win(it, r)
                        ? e4m3x8_bf16(row + c, di_ue8m0_f32(row[dh + c / DI_BACKEND_WIN_BLOCK]))
                        : e2m1x8_bf16(row + c / 2,
                                      di_e4m3_f32(row[dh / 2 + c / DI_BACKEND_ENT_BLOCK]));
            }
            *(uint4 *)(ks + r * L.ldk + c) = v;
        }
    };

    float acc[HPW][NG][4], m_r[HPW], l_r[HPW]; // o, running max and sum of the warp's heads
#pragma unroll
    for (int i = 0; i < HPW; i++) {
        m_r[i] = -INFINITY, l_r[i] = 0.0f;
#pragma unroll
        for (int g = 0; g < NG; g++) acc[i][g][0] = acc[i][g][1] = acc[i][g][2] = acc[i][g][3] = 0;
    }
    const int32_t hw = h0 + warp * HPW; // this warp's first head
    const float *qw = qs + warp * HPW * dh;

    if (n_tiles > 0) load_idx(0, 0);
    __syncthreads(); // qs, idx_s[0]
    if (n_tiles > 0) issue(0, 0);
    for (int32_t it = 0; it < n_tiles; it++) {
        const int st = it & 1;
        cp_async_wait_all();
        // (B) this tile's raw rows have landed for every thread; the previous tile's p.v (the last
        // reader of ks) is done everywhere.
        __syncthreads();
        decode(it, st);
        if (it + 1 < n_tiles) load_idx(it + 1, st ^ 1); // stage st^1 free since tile it-1
        __syncthreads();                                // (C) ks, idx_s[st ^ 1]
        if (it + 1 < n_tiles) issue(it + 1, st ^ 1);    // in flight during this tile's arithmetic
        if (hw >= H) continue;                          // a warp past the heads: copies only

        // ---- s = scale * q.k: this warp's heads x key `lane` ----
        float s[HPW];
#pragma unroll
        for (int i = 0; i < HPW; i++) s[i] = 0.0f;
        const __nv_bfloat16 *kr = ks + lane * L.ldk;
#pragma unroll 2
        for (int32_t d = 0; d < dh; d += 8) {
            const uint4 kv = *(const uint4 *)(kr + d);
            const float k[8] = {bf_lo(kv.x), bf_hi(kv.x), bf_lo(kv.y), bf_hi(kv.y),
                                bf_lo(kv.z), bf_hi(kv.z), bf_lo(kv.w), bf_hi(kv.w)};
#pragma unroll
            for (int i = 0; i < HPW; i++) {
                const float4 a = *(const float4 *)(qw + i * dh + d);
                const float4 b = *(const float4 *)(qw + i * dh + d + 4);
                s[i] = fmaf(a.x, k[0], s[i]);
                s[i] = fmaf(a.y, k[1], s[i]);
                s[i] = fmaf(a.z, k[2], s[i]);
                s[i] = fmaf(a.w, k[3], s[i]);
                s[i] = fmaf(b.x, k[4], s[i]);
                s[i] = fmaf(b.y, k[5], s[i]);
                s[i] = fmaf(b.z, k[6], s[i]);
                s[i] = fmaf(b.w, k[7], s[i]);
            }
        }
        // ---- online softmax (masked keys: no mass), p into the warp's tile ----
        const bool ok = idx_s[st * AC_BN + lane] >= 0;
#pragma unroll
        for (int i = 0; i < HPW; i++) {
            const float sv = ok ? s[i] * scale : -INFINITY;
            const float mn = fmaxf(m_r[i], di_warp_max(sv));
            const float alpha = mn == -INFINITY ? 1.0f : expf(m_r[i] - mn);
            const float p = sv == -INFINITY ? 0.0f : expf(sv - mn);
            l_r[i] = l_r[i] * alpha + di_warp_sum(p);
            m_r[i] = mn;
            ps[lane * HPW + i] = p;
#pragma unroll
            for (int g = 0; g < NG; g++) {
                acc[i][g][0] *= alpha, acc[i][g][1] *= alpha;
                acc[i][g][2] *= alpha, acc[i][g][3] *= alpha;
            }
        }
        __syncwarp();
        // ---- o += p v: this warp's heads x lane's dims ----
        for (int jj = 0; jj < AC_BN; jj++) {
            float p[HPW];
#pragma unroll
            for (int i = 0; i < HPW; i++) p[i] = ps[jj * HPW + i];
            const __nv_bfloat16 *vr = ks + jj * L.ldk;
#pragma unroll
            for (int g = 0; g < NG; g++) {
                const int32_t c = 4 * (lane + 32 * g);
                if (c >= dh) continue;
                const uint2 kv = *(const uint2 *)(vr + c);
                const float v0 = bf_lo(kv.x), v1 = bf_hi(kv.x), v2 = bf_lo(kv.y), v3 = bf_hi(kv.y);
#pragma unroll
                for (int i = 0; i < HPW; i++) {
                    acc[i][g][0] = fmaf(p[i], v0, acc[i][g][0]);
                    acc[i][g][1] = fmaf(p[i], v1, acc[i][g][1]);
                    acc[i][g][2] = fmaf(p[i], v2, acc[i][g][2]);
                    acc[i][g][3] = fmaf(p[i], v3, acc[i][g][3]);
                }
            }
        }
        __syncwarp(); // every lane's p read before the next tile's writes
    }

    // ---- epilogue: the sink and 1/den (one split), or the split's (o, m, l) for the combine ----
#pragma unroll
    for (int i = 0; i < HPW; i++) {
        const int32_t h = hw + i;
        if (h >= H) break;
        const float m = m_r[i], l = l_r[i];
        float mul = 1.0f, *orow;
        if (n_split == 1) {
            const float sk = sink[h], M = fmaxf(m, sk);
            const float f = m == -INFINITY ? 0.0f : expf(m - M);
            mul = f / (l * f + expf(sk - M)); // the sink takes mass, gives no value
            orow = o + (t * H + h) * dh;
        } else {
            const int64_t pr = (t * n_split + split) * H + h;
            orow = o_part + pr * dh;
            if (lane == 0) ml_part[2 * pr] = m, ml_part[2 * pr + 1] = l;
        }
#pragma unroll
        for (int g = 0; g < NG; g++) {
            const int32_t c = 4 * (lane + 32 * g);
            if (c >= dh) continue;
            orow[c] = acc[i][g][0] * mul, orow[c + 1] = acc[i][g][1] * mul;
            orow[c + 2] = acc[i][g][2] * mul, orow[c + 3] = acc[i][g][3] * mul;
        }
    }
}

// The split count ns and the keys per split (whole tiles; 0 when max_keys is 0) of n_tok rows of
// `groups` head groups: n_split > 0 forced (clamped to the tiles), else enough to fill the SMs
// (one block each: shared memory) with >= 2 tiles per split.
void attn_codes_plan(const di_cuda *cu, int64_t n_tok, int64_t groups, int32_t max_keys,
                     int32_t n_split, int64_t *ns_out, int64_t *chunk_out) {
    const int64_t max_tiles = (max_keys + AC_BN - 1) / AC_BN;
    int64_t ns = n_split;
    if (ns <= 0) {
        const int64_t base = n_tok * groups;
        ns = base >= cu->n_sm ? 1 : cu->n_sm / base;
        ns = std::min<int64_t>(ns, std::max<int64_t>(1, max_keys / AC_MIN_KEYS_PER_SPLIT));
    }
    ns = std::max<int64_t>(1, std::min<int64_t>({ns, max_tiles, (int64_t)AC_MAX_SPLITS}));
    const int64_t chunk = (max_tiles + ns - 1) / ns * AC_BN;
    if (chunk > 0) ns = (max_keys + chunk - 1) / chunk;
    *ns_out = ns, *chunk_out = chunk;
}

// Heads per warp of an automatic choice: 8 (64-head blocks) where its shared memory fits, else 4
// (the A100 at dh 512), up to dh 512 (ng <= 4); 2 above.
int attn_codes_hpw(const di_cuda *cu, int32_t dh, int ng) {
    if (ng > 4) return 2;
    return ac_layout(dh, 8).total <= cu->smem_optin ? 8 : 4;
}

int attn_codes_ng(int32_t dh) { // groups of 4 dims per lane: 128 * ng >= dh, a power of two
    int ng = 1;
    while (128 * ng < dh) ng *= 2;
    return ng;
}

// One instance: the shared-memory fit, the split partials, the kernel and the combine.
template <int HPW, int NG>
di_status attn_codes_launch(di_cuda *cu, const float *q, const uint8_t *win, const uint8_t *ent,
                            const int32_t *key_idx, int64_t key_stride, const int32_t *n_win,
                            const int32_t *n_keys, int32_t max_keys, const float *sink,
                            int32_t n_tok, int32_t H, int32_t dh, float scale, int32_t n_split,
                            int32_t vw, float *o) {
    static di_smem_kernel smem_k;
    const size_t smem = ac_layout(dh, HPW).total;
    size_t st_smem = 0;
    di_status st =
        di_cuda_smem_fit(cu, &smem_k, (const void *)attn_codes_kernel<HPW, NG>, smem, &st_smem);
    if (st == DI_ERR_INVALID)
        DI_CUDA_LOG_ERROR("attention (codes): dh %d with %d heads per block needs %zu + %zu "
                          "(static) bytes of shared memory (limit %zu)",
                          dh, AC_WARPS * HPW, smem, st_smem, cu->smem_optin);
    if (st != DI_OK) return st;
    const int64_t groups = (H + AC_WARPS * HPW - 1) / (AC_WARPS * HPW);
    int64_t ns, chunk;
    attn_codes_plan(cu, n_tok, groups, max_keys, n_split, &ns, &chunk);
    const int64_t n_blocks = (int64_t)n_tok * ns;
    // gridDim.x (rows x splits) and gridDim.y (head groups) limits; the combine's grid is one
    // block per (t, h).
    if (n_blocks > 0x7FFFFFFF || groups > DI_CUDA_MAX_GRID_Y ||
        (ns > 1 && (int64_t)n_tok * H > 0x7FFFFFFF))
        return DI_ERR_INVALID;
    float *o_part = NULL, *ml_part = NULL;
    if (ns > 1) {
        const size_t rows = (size_t)n_tok * (size_t)ns * (size_t)H;
        st = di_cuda_alloc(cu, sizeof(float) * rows * (size_t)dh, (void **)&o_part);
        if (st != DI_OK) return st;
        st = di_cuda_alloc(cu, sizeof(float) * rows * 2, (void **)&ml_part);
        if (st != DI_OK) goto fail;
    }
    attn_codes_kernel<HPW, NG>
        <<<dim3((unsigned)n_blocks, (unsigned)groups), AC_THREADS, smem, di_stream(cu)>>>(
            q, win, ent, key_idx, key_stride, n_win, n_keys, max_keys, sink, H, dh, scale,
            (int32_t)ns, (int32_t)(chunk > 0 ? chunk : AC_BN), vw, o, o_part, ml_part,
            cu->flags_dev);
    DI_TRY(di_cuda_check_launch("attn_codes_kernel"));
    if (ns > 1) {
        attn_tc_combine_kernel<<<(unsigned)((int64_t)n_tok * H), 128, sizeof(float) * (size_t)ns,
                                 di_stream(cu)>>>(o_part, ml_part, sink, H, dh, (int32_t)ns, o);
        DI_TRY(di_cuda_check_launch("attn_tc_combine_kernel (codes)"));
    }
fail: // the pool reuses the scratch only after the launches above (one stream)
    if (ml_part) di_cuda_free(cu, ml_part);
    if (o_part) di_cuda_free(cu, o_part);
    return st;
}

// The widest copy piece (16, 8 or 4 bytes; 0: bytes) that divides every row's offset: both row
// sizes and both bases.
int attn_codes_piece(const uint8_t *win, const uint8_t *ent, int32_t dh) {
    const uint64_t wb = (uint64_t)dh + (uint64_t)dh / DI_BACKEND_WIN_BLOCK,
                   eb = (uint64_t)dh / 2 + (uint64_t)dh / DI_BACKEND_ENT_BLOCK;
    const uint64_t all = wb | eb | (uint64_t)(uintptr_t)win | (uint64_t)(uintptr_t)ent | 16u;
    const int a = (int)(all & (~all + 1)); // the lowest set bit: the common power-of-two divisor
    return a >= 4 ? a : 0;
}

} // namespace

extern "C" di_status di_cuda_attn_codes_ex(di_cuda *cu, const float *q, const uint8_t *win,
                                           const uint8_t *ent, const int32_t *key_idx,
                                           int64_t key_stride, const int32_t *n_win,
                                           const int32_t *n_keys, int32_t max_keys,
                                           const float *sink, int32_t n_tok, int32_t H, int32_t dh,
                                           float scale, int32_t n_split, int32_t heads_per_warp,
                                           float *o) {
    if (dh < 32 || dh % 32 != 0 || dh > DI_CUDA_ATTN_MAX_DH || max_keys < 0 || H < 0 ||
        key_stride < max_keys || n_split < 0 ||
        (heads_per_warp != 0 && heads_per_warp != 2 && heads_per_warp != 4 && heads_per_warp != 8))
        return DI_ERR_INVALID;
    if (n_tok <= 0 || H == 0) return DI_OK;
    const int ng = attn_codes_ng(dh);
    const int hpw = heads_per_warp ? heads_per_warp : attn_codes_hpw(cu, dh, ng);
    const int32_t vw = attn_codes_piece(win, ent, dh);
#define AC_CASE(P, G)                                                                              \
    if (hpw == P && ng == G)                                                                       \
    return attn_codes_launch<P, G>(cu, q, win, ent, key_idx, key_stride, n_win, n_keys, max_keys,  \
                                   sink, n_tok, H, dh, scale, n_split, vw, o)
    AC_CASE(8, 1);
    AC_CASE(8, 2);
    AC_CASE(8, 4);
    AC_CASE(4, 1);
    AC_CASE(4, 2);
    AC_CASE(4, 4);
    AC_CASE(2, 8);
#undef AC_CASE
    return DI_ERR_INVALID; // heads_per_warp not built for this dh (8 and 4 up to 512, 2 above)
}

extern "C" int64_t di_cuda_attn_codes_splits(const di_cuda *cu, int32_t n_tok, int32_t H,
                                             int32_t dh, int32_t max_keys) {
    if (n_tok <= 0 || H <= 0 || max_keys <= 0 || dh < 32 || dh % 32 != 0 ||
        dh > DI_CUDA_ATTN_MAX_DH)
        return 1;
    const int ng = attn_codes_ng(dh), hb = AC_WARPS * attn_codes_hpw(cu, dh, ng);
    int64_t ns, chunk;
    attn_codes_plan(cu, n_tok, (H + hb - 1) / hb, max_keys, 0, &ns, &chunk);
    return ns;
}

extern "C" di_status di_cuda_attn_codes(di_cuda *cu, const float *q, const uint8_t *win,
                                        const uint8_t *ent, const int32_t *key_idx,
                                        int64_t key_stride, const int32_t *n_win,
                                        const int32_t *n_keys, int32_t max_keys, const float *sink,
                                        int32_t n_tok, int32_t H, int32_t dh, float scale,
                                        bool round_p, float *o) {
    (void)round_p; // p stays FP32: within half a BF16 ulp of the rounded one (see above)
    return di_cuda_attn_codes_ex(cu, q, win, ent, key_idx, key_stride, n_win, n_keys, max_keys,
                                 sink, n_tok, H, dh, scale, 0, 0, o);
}

// ---- attention over V4.1's stored codes on tensor cores ----

extern "C" di_status di_cuda_attn_codes_bf16(di_cuda *cu, const float *q, const uint8_t *win,
                                             const uint8_t *ent, const int32_t *key_idx,
                                             int64_t key_stride, const int32_t *n_win,
                                             const int32_t *n_keys, int32_t max_keys,
                                             const float *sink, int32_t n_tok, int32_t H,
                                             int32_t dh, float scale, int32_t n_split, float *o) {
    if (max_keys < 0 || key_stride < max_keys || H < 0 || n_split < 0 || ((uintptr_t)q & 15) != 0 ||
        ((uintptr_t)o & 7) != 0 || (dh != 512 && dh != 256 && dh != 128))
        return DI_ERR_INVALID;
    const int32_t vw = attn_codes_piece(win, ent, dh);
    if (vw < 4) return DI_ERR_INVALID; // a base not 4-byte aligned: no cp.async piece
    if (n_tok <= 0 || H == 0) return DI_OK;
#define TC_CODES_CASE(D)                                                                           \
    if (dh == D) {                                                                                 \
        const TcRowsCodes<D> rows = {win, ent, n_win, vw, 0};                                      \
        return attn_tc_launch<D, false>(cu, q, rows, key_idx, key_stride, n_keys, max_keys, sink,  \
                                        n_tok, H, scale, n_split, o);                              \
    }
    TC_CODES_CASE(512);
    TC_CODES_CASE(256);
    TC_CODES_CASE(128);
#undef TC_CODES_CASE
    return DI_ERR_INVALID;
}

extern "C" di_status di_cuda_attn_codes_wg(di_cuda *cu, const float *q, const uint8_t *win,
                                           const uint8_t *ent, const int32_t *key_idx,
                                           int64_t key_stride, const int32_t *n_win,
                                           const int32_t *n_keys, int32_t max_keys,
                                           const float *sink, int32_t n_tok, int32_t H, int32_t dh,
                                           float scale, int32_t n_split, float *o) {
    if (max_keys < 0 || key_stride < max_keys || H < 0 || n_split < 0 || ((uintptr_t)q & 15) != 0 ||
        ((uintptr_t)o & 7) != 0 || dh != 512)
        return DI_ERR_INVALID;
    const int32_t vw = attn_codes_piece(win, ent, dh);
    if (vw < 4) return DI_ERR_INVALID;
    if (n_tok <= 0 || H == 0) return DI_OK;
    const TcRowsCodes<512> rows = {win, ent, n_win, vw, 0};
    return attn_tc_launch<512, true>(cu, q, rows, key_idx, key_stride, n_keys, max_keys, sink,
                                     n_tok, H, scale, n_split, o);
}

// ---- tensor-core attention checked once per context (backend.h attn_kv, attn_codes) ----

namespace {

// A tensor-core kernel standing in for an exact one in the official recipe, checked once per
// context (docs/cuda.md Numerics; attn_kv's and attn_codes' dispatch): *state 0 not checked yet,
// 1 checked and on, -1 off (a mismatch, a refusal, DI_CUDA_ATTN_TC=0 or DI_CUDA_ATTN_WG=0 at
// create). exact(dst) and tc(dst) run the two kernels into dst (n_tok * H * dh floats); `what`
// names the op, `kernel` the tensor-core kernel, `then` what serves the op once it is off. Off, or
// not checked yet inside a graph capture (the check downloads) or on a call of more than
// ATTN_TC_CHECK_MAX_FLOATS outputs (a long prefill: its scratch would stay in the pool and its
// downloads take seconds): the exact kernel. Otherwise the first call runs the exact kernel into a
// pool scratch and the tensor cores into o and compares them on the host (max |diff| <=
// attn_tc_check_tol * max |exact|, no NaN): a match keeps the tensor cores for the context; a
// mismatch or a refusal of the kernel logs a WARN naming the kernel and the error, turns it off
// and leaves the exact result in o. *n_calls counts the calls the tensor cores served (the checked
// one included). Two kernels are chained by their callers: the wgmma kernel first (its own
// state), the mma.sync one (its own state and check) once the first is off or not checkable.
enum { ATTN_TC_CHECK_MAX_FLOATS = 1 << 24 }; // 64 MiB: 512 rows of 64 heads x 512 dims

// Whether attn_tc_checked would run the tensor-core kernel of this state on this call (checked
// and on, or checkable now).
bool attn_tc_would_run(const di_cuda *cu, int state, int32_t n_tok, int32_t H, int32_t dh) {
    const size_t n = (size_t)n_tok * (size_t)H * (size_t)dh;
    return state > 0 || (state == 0 && !cu->capturing && n <= ATTN_TC_CHECK_MAX_FLOATS);
}

template <class Exact, class Tc>
di_status attn_tc_checked(di_cuda *cu, int *state, int64_t *n_calls, const char *what,
                          const char *kernel, const char *then, int32_t n_tok, int32_t H,
                          int32_t dh, int32_t max_keys, float *o, const Exact &exact,
                          const Tc &tc) {
    const size_t n = (size_t)n_tok * (size_t)H * (size_t)dh;
    if (!attn_tc_would_run(cu, *state, n_tok, H, dh)) return exact(o);
    if (*state > 0) {
        const di_status st = tc(o);
        if (st == DI_OK) (*n_calls)++;
        return st;
    }
    float *ref = NULL, *h_tc = NULL, *h_ref = NULL;
    di_status st = di_cuda_alloc(cu, sizeof(float) * n, (void **)&ref);
    if (st != DI_OK) return st;
    if ((st = exact(ref)) != DI_OK) goto out;
    st = tc(o);
    if (st == DI_ERR_NOMEM || st == DI_ERR_CUDA || st == DI_ERR_DEVICE_LOST)
        goto out; // a fault is sticky: nothing to keep
    if (st != DI_OK) {
        DI_CUDA_LOG_WARN("%s on tensor cores (%s) refused its first call (%s): off for this "
                         "context, %s",
                         what, kernel, di_status_str(st), then);
        *state = -1;
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
        *state = ok ? 1 : -1;
        di_log_write(ok ? 2 : 1, __FILE__, __LINE__,
                     "cuda: %s on tensor cores (%s) vs the exact kernel on its first call (%d "
                     "rows, %d heads, dh %d, up to %d keys): max |diff| %.3g of max |o| %.3g: %s%s",
                     what, kernel, n_tok, H, dh, max_keys, dmax, amax,
                     ok ? "used from now on" : "MISMATCH, off for this context, ", ok ? "" : then);
        if (ok) (*n_calls)++;
    }
    if (*state < 0) st = di_cuda_copy_d2d(cu, o, ref, sizeof(float) * n);
out:
    free(h_ref);
    free(h_tc);
    di_cuda_free(cu, ref); // stream-ordered: after the copy above
    return st;
}

// Whether an attn_kv call may take the tensor-core kernel: the official recipe (round_p), a
// shape it has, the device's shared memory, the alignments it needs.
bool attn_kv_tc_eligible(const di_cuda *cu, const float *q, const float *o, int32_t dh,
                         int32_t n_rot, bool round_p) {
    if (!round_p || ((uintptr_t)q & 15) != 0 || ((uintptr_t)o & 7) != 0) return false;
    if (dh == 512 && n_rot == 64) return tc_smem<512, TcRowsFp8<512, 64>>() <= cu->smem_optin;
    if (dh == 128 && n_rot == 64) return tc_smem<128, TcRowsFp8<128, 64>>() <= cu->smem_optin;
    return false;
}

// The same for attn_codes: round_p, valid lists, dh 512 / 256 / 128, the shared memory, q and o
// aligned, both code bases 4-byte aligned (a cp.async piece).
bool attn_codes_tc_eligible(const di_cuda *cu, const float *q, const float *o, const uint8_t *win,
                            const uint8_t *ent, int64_t key_stride, int32_t max_keys, int32_t dh,
                            bool round_p) {
    if (!round_p || max_keys < 0 || key_stride < max_keys || ((uintptr_t)q & 15) != 0 ||
        ((uintptr_t)o & 7) != 0 || attn_codes_piece(win, ent, dh) < 4)
        return false;
    if (dh == 512) return tc_smem<512, TcRowsCodes<512>>() <= cu->smem_optin;
    if (dh == 256) return tc_smem<256, TcRowsCodes<256>>() <= cu->smem_optin;
    if (dh == 128) return tc_smem<128, TcRowsCodes<128>>() <= cu->smem_optin;
    return false;
}

// Whether a call the mma.sync kernel may take may also try the wgmma kernel: dh 512 (V4's rows
// with 64 rope dims, V4.1's codes), a cc 9.0 device (elsewhere it is not tried at all: no WARN),
// its shared memory; whether the binary has its sm_90a code is the launcher's check (a refusal,
// logged once by attn_tc_checked).
bool attn_wg_eligible(const di_cuda *cu, int32_t dh, int32_t n_rot, bool codes) {
    if (dh != 512 || (!codes && n_rot != 64) || cu->cc_major != 9 || cu->cc_minor != 0)
        return false;
    return (codes ? wg_smem<TcRowsCodes<512>>() : wg_smem<TcRowsFp8<512, 64>>()) <= cu->smem_optin;
}

} // namespace

extern "C" di_status di_cuda_attn_kv_dispatch(di_cuda *cu, const float *q, const uint8_t *pool,
                                              const int32_t *key_idx, int64_t key_stride,
                                              const int32_t *n_keys, int32_t max_keys,
                                              const float *sink, int32_t n_tok, int32_t H,
                                              int32_t dh, int32_t n_rot, float scale, bool round_p,
                                              float *o) {
    if (n_tok <= 0 || H <= 0 || max_keys < 0 || !attn_kv_tc_eligible(cu, q, o, dh, n_rot, round_p))
        return di_cuda_attn_kv(cu, q, pool, key_idx, key_stride, n_keys, max_keys, sink, n_tok, H,
                               dh, n_rot, scale, round_p, o);
    const auto exact = [&](float *dst) {
        return di_cuda_attn_kv(cu, q, pool, key_idx, key_stride, n_keys, max_keys, sink, n_tok, H,
                               dh, n_rot, scale, true, dst);
    };
    if (attn_wg_eligible(cu, dh, n_rot, false) && attn_tc_would_run(cu, cu->attn_wg, n_tok, H, dh))
        return attn_tc_checked(
            cu, &cu->attn_wg, &cu->n_attn_wg_calls, "attention", "attn_wg_kernel, wgmma",
            "the mma.sync kernel (its own check) from the next call", n_tok, H, dh, max_keys, o,
            exact, [&](float *dst) {
                return di_cuda_attn_wg(cu, q, pool, key_idx, key_stride, n_keys, max_keys, sink,
                                       n_tok, H, dh, n_rot, scale, 0, dst);
            });
    return attn_tc_checked(
        cu, &cu->attn_tc, &cu->n_attn_tc_calls, "attention", "attn_tc_kernel, mma.sync",
        "the exact kernel stays", n_tok, H, dh, max_keys, o, exact, [&](float *dst) {
            return di_cuda_attn_bf16(cu, q, pool, key_idx, key_stride, n_keys, max_keys, sink,
                                     n_tok, H, dh, n_rot, scale, 0, dst);
        });
}

extern "C" di_status di_cuda_attn_codes_dispatch(di_cuda *cu, const float *q, const uint8_t *win,
                                                 const uint8_t *ent, const int32_t *key_idx,
                                                 int64_t key_stride, const int32_t *n_win,
                                                 const int32_t *n_keys, int32_t max_keys,
                                                 const float *sink, int32_t n_tok, int32_t H,
                                                 int32_t dh, float scale, bool round_p, float *o) {
    if (n_tok <= 0 || H <= 0 ||
        !attn_codes_tc_eligible(cu, q, o, win, ent, key_stride, max_keys, dh, round_p))
        return di_cuda_attn_codes(cu, q, win, ent, key_idx, key_stride, n_win, n_keys, max_keys,
                                  sink, n_tok, H, dh, scale, round_p, o);
    const auto exact = [&](float *dst) {
        return di_cuda_attn_codes(cu, q, win, ent, key_idx, key_stride, n_win, n_keys, max_keys,
                                  sink, n_tok, H, dh, scale, true, dst);
    };
    if (attn_wg_eligible(cu, dh, 0, true) && attn_tc_would_run(cu, cu->attn_codes_wg, n_tok, H, dh))
        return attn_tc_checked(
            cu, &cu->attn_codes_wg, &cu->n_attn_codes_wg_calls, "attn_codes",
            "attn_wg_kernel, wgmma", "the mma.sync kernel (its own check) from the next call",
            n_tok, H, dh, max_keys, o, exact, [&](float *dst) {
                return di_cuda_attn_codes_wg(cu, q, win, ent, key_idx, key_stride, n_win, n_keys,
                                             max_keys, sink, n_tok, H, dh, scale, 0, dst);
            });
    return attn_tc_checked(cu, &cu->attn_codes_tc, &cu->n_attn_codes_tc_calls, "attn_codes",
                           "attn_tc_kernel, mma.sync", "the exact kernel stays", n_tok, H, dh,
                           max_keys, o, exact, [&](float *dst) {
                               return di_cuda_attn_codes_bf16(cu, q, win, ent, key_idx, key_stride,
                                                              n_win, n_keys, max_keys, sink, n_tok,
                                                              H, dh, scale, 0, dst);
                           });
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
