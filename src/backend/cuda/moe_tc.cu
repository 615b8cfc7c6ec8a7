// moe_tc — the routed experts' grouped GEMM on BF16 tensor cores for A8 activations (moe_tc.cuh).
#include <cuda_bf16.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "backend/backend.h" // DI_BACKEND_TC_MIN_ROWS
#include "backend/cuda/common.cuh"
#include "backend/cuda/gemm.cuh"
#include "backend/cuda/moe_tc.cuh"

// Block tile: TC_BM output features x BN grouped rows, K in steps of TC_BK. 8 warps. Shared rows
// of TC_LD BF16 (72: 144 bytes = 36 words, so the 8 rows x 4 words a fragment load touches land
// in 32 distinct banks; 144 is a multiple of 16 for the 16-byte stores and cp.async).
enum { TC_BM = 128, TC_BK = 64, TC_LD = TC_BK + 8, TC_THREADS = 256, TC_MAX_E = 4096 };

// ---- small pieces ----

__device__ __forceinline__ uint32_t smem_addr(const void *p) {
    return (uint32_t)__cvta_generic_to_shared(p);
}

// 16 bytes global -> shared; src_bytes 0 zero-fills the destination (rows past the expert's).
__device__ __forceinline__ void cp_async16(void *dst, const void *src, int src_bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(dst)), "l"(src),
                 "r"(src_bytes)
                 : "memory");
}
__device__ __forceinline__ void cp_async_commit() {
    asm volatile("cp.async.commit_group;\n" ::: "memory");
}
__device__ __forceinline__ void cp_async_wait_all() {
    asm volatile("cp.async.wait_group 0;\n" ::: "memory");
}

// d += a . b, BF16 inputs, FP32 accumulators (PTX ISA "mma.m16n8k16", .row.col).
__device__ __forceinline__ void mma_bf16(float d[4], const uint32_t a[4], const uint32_t b[2]) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, "
                 "{%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
    const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi); // .x = lo: the lower address
    return *(const uint32_t *)&v;
}

// e2m1 code (low 4 bits) -> its value, exact (= di_e2m1_f32): the three magnitude bits placed as
// FP32 exponent bits 24..23 and mantissa bit 22 give 2^(e-127)(1 + m/2) (e >= 1) or the subnormal
// m 2^-127 (e = 0); times 2^126 (exact: FMUL keeps subnormal inputs, no fast math) that is
// 2^(e-1)(1 + m/2), resp. m/2.
__device__ __forceinline__ float e2m1_bits(uint32_t c) {
    return __uint_as_float(((c & 7u) << 22) | ((c & 8u) << 28));
}
__device__ __forceinline__ float e2m1_fast(uint32_t c) {
    return e2m1_bits(c) * 0x1p126f;
}

// ---- activations: FP32 -> BF16 (exact for A8 values) ----

__global__ void to_bf16_kernel(const float *__restrict__ x, int64_t n_rows, int64_t x_stride,
                               int64_t K, uint32_t *__restrict__ xb) {
    const int64_t k = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; // one pair of columns
    const int64_t half = K / 2;
    if (k >= n_rows * half) return;
    const int64_t r = k / half, c = 2 * (k % half);
    const float *v = x + r * x_stride + c;
    xb[k] = pack_bf16(v[0], v[1]);
}

// ---- tile list: (expert, first grouped row) of every BN-row tile ----

// One block. tiles[j] for j < *n_tiles (at most max_tiles): expert e's tiles in ascending e.
__global__ void __launch_bounds__(1024)
    tiles_kernel(const int32_t *__restrict__ offsets, int32_t E, int32_t bn, int32_t max_tiles,
                 int2 *__restrict__ tiles, int32_t *__restrict__ n_tiles) {
    __shared__ int32_t base[TC_MAX_E + 1];
    for (int e = threadIdx.x; e < E; e += blockDim.x) {
        const int32_t c = offsets[e + 1] - offsets[e];
        base[e] = c > 0 ? (c + bn - 1) / bn : 0;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        int32_t acc = 0;
        for (int e = 0; e < E; e++) {
            const int32_t c = base[e];
            base[e] = acc;
            acc += c;
        }
        base[E] = acc;
        *n_tiles = acc < max_tiles ? acc : max_tiles;
    }
    __syncthreads();
    for (int e = threadIdx.x; e < E; e += blockDim.x) {
        const int32_t r0 = offsets[e];
        for (int32_t j = base[e]; j < base[e + 1] && j < max_tiles; j++)
            tiles[j] = make_int2(e, r0 + (j - base[e]) * bn);
    }
}

// ---- the GEMM ----

// FP8 = true: e4m3 experts (16-byte loads of 32 codes: 2 per thread and step), else e2m1 (one).
// Warps WM_W x WN_W over the 128 x BN tile; each warp MT x NT MMA tiles of 16 x 8.
template <bool FP8, int BN, int WM_W, int WN_W>
__global__ void __launch_bounds__(TC_THREADS)
    moe_tc_kernel(const di_tensor *__restrict__ experts, const int32_t *__restrict__ offsets,
                  const int2 *__restrict__ tiles, const int32_t *__restrict__ n_tiles,
                  const int32_t *__restrict__ x_rows, const uint16_t *__restrict__ xb,
                  int64_t n_out, int64_t K, float *__restrict__ y, int64_t y_stride) {
    static_assert(WM_W * WN_W == TC_THREADS / 32, "8 warps");
    constexpr int WM = TC_BM / WM_W, WN = BN / WN_W, MT = WM / 16, NT = WN / 8;
    static_assert(MT * 16 == WM && NT * 8 == WN, "warp tile of whole MMA tiles");
    constexpr int XCH = BN * (TC_BK / 8);                    // 16-byte activation pieces
    constexpr int XPT = (XCH + TC_THREADS - 1) / TC_THREADS; // per thread
    constexpr int WQ = FP8 ? 2 : 1;                          // 16-byte weight loads per thread
    extern __shared__ __align__(16) uint16_t smem[];
    uint16_t *ws = smem;                     // [2][TC_BM][TC_LD] decoded weights, [feature][k]
    uint16_t *xs = smem + 2 * TC_BM * TC_LD; // [2][BN][TC_LD] activations, [row][k]

    if ((int)blockIdx.y >= *n_tiles) return; // past the list: block-uniform
    const int2 td = tiles[blockIdx.y];
    const int e = td.x;
    const int32_t i0 = td.y, iend = offsets[e + 1];
    const int32_t nrow = iend - i0 < BN ? iend - i0 : BN;
    const int64_t o0 = (int64_t)blockIdx.x * TC_BM;
    const di_tensor w = experts[e];
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int g = lane >> 2, t4 = lane & 3;

    // An expert outside the contract (moe_tc.cuh) is written as NaN, never read wrongly.
    const bool ok = w.kind == (FP8 ? DI_TENSOR_KIND_FP8 : DI_TENSOR_KIND_FP4) && w.ne[0] == K &&
                    w.ne[1] == n_out && w.block_in > 0 && w.block_in % 32 == 0 && w.block_out > 0 &&
                    w.nb1 % 16 == 0 && ((uintptr_t)w.data & 15u) == 0 &&
                    w.nb1 >= (size_t)(FP8 ? K : K / 2);
    if (!ok) {
        for (int k = tid; k < nrow * TC_BM; k += TC_THREADS) {
            const int64_t o = o0 + k % TC_BM;
            if (o < n_out) y[(int64_t)(i0 + k / TC_BM) * y_stride + o] = __int_as_float(0x7FC00000);
        }
        return;
    }

    // Weight loader: feature lr, columns kh .. kh+31 of each step (one scale: block_in % 32 == 0).
    const int lr = tid >> 1, kh = (tid & 1) * 32;
    const int64_t ow = o0 + lr;
    const bool wvalid = ow < n_out;
    const uint8_t *wrow = (const uint8_t *)w.data + (size_t)(wvalid ? ow : 0) * w.nb1;
    const uint8_t *srow =
        w.scale + (size_t)((w.row0 + (wvalid ? ow : 0)) / w.block_out) * w.scale_nb1;
    // Activation loader: pieces p = tid + q*256 -> row p / 8, columns (p % 8) * 8 .. +7.
    const uint16_t *xsrc[XPT];
    int xbytes[XPT];
#pragma unroll
    for (int q = 0; q < XPT; q++) {
        const int p = tid + q * TC_THREADS, j = p >> 3;
        const bool live = p < XCH && j < nrow;
        const int32_t i = i0 + (live ? j : 0);
        const int64_t src = x_rows ? x_rows[i] : i;
        xsrc[q] = xb + src * K + (p & 7) * 8;
        xbytes[q] = live ? 16 : 0;
    }

    uint4 wq[WQ];
    uint32_t wsc = 127;
    auto load_w = [&](int64_t k0) {
        const int64_t k = k0 + kh;
        if (wvalid) {
#pragma unroll
            for (int q = 0; q < WQ; q++)
                wq[q] = *(const uint4 *)(wrow + (FP8 ? k : k / 2) + 16 * q);
            wsc = srow[k / w.block_in];
        } else {
#pragma unroll
            for (int q = 0; q < WQ; q++) wq[q] = make_uint4(0, 0, 0, 0); // codes 0 decode to 0
            wsc = 127;
        }
    };
    auto store_w = [&](int buf) {
        const float s = di_ue8m0_f32(wsc);
        uint32_t out[16]; // 32 BF16, column order
        if (FP8) {
#pragma unroll
            for (int q = 0; q < 2; q++) {
                const uint32_t u[4] = {wq[q].x, wq[q].y, wq[q].z, wq[q].w};
#pragma unroll
                for (int k = 0; k < 4; k++)
#pragma unroll
                    for (int h = 0; h < 2; h++)
                        out[q * 8 + k * 2 + h] =
                            pack_bf16(di_e4m3_f32((u[k] >> (16 * h)) & 0xFFu) * s,
                                      di_e4m3_f32((u[k] >> (16 * h + 8)) & 0xFFu) * s);
            }
        } else {
            const uint32_t u[4] = {wq[0].x, wq[0].y, wq[0].z, wq[0].w};
            if (wsc <= 128u) {
                // One multiply: 2^126 s = 2^(wsc-1) is a normal FP32 number for wsc <= 128, and
                // placed bits x 2^(wsc-1) is the exact value (one rounding of a representable
                // product), the same as e2m1_fast(c) * s. Every checkpoint scale is below 2.
                const float m = 0x1p126f * s;
#pragma unroll
                for (int k = 0; k < 4; k++)
#pragma unroll
                    for (int b = 0; b < 4; b++) { // byte b: column 2b (low nibble), 2b+1 (high)
                        const uint32_t byte = u[k] >> (8 * b);
                        out[k * 4 + b] =
                            pack_bf16(e2m1_bits(byte & 15u) * m, e2m1_bits((byte >> 4) & 15u) * m);
                    }
            } else {
#pragma unroll
                for (int k = 0; k < 4; k++)
#pragma unroll
                    for (int b = 0; b < 4; b++) {
                        const uint32_t byte = u[k] >> (8 * b);
                        out[k * 4 + b] =
                            pack_bf16(e2m1_fast(byte & 15u) * s, e2m1_fast((byte >> 4) & 15u) * s);
                    }
            }
        }
        uint4 *dst = (uint4 *)(ws + (size_t)buf * TC_BM * TC_LD + lr * TC_LD + kh);
#pragma unroll
        for (int q = 0; q < 4; q++)
            dst[q] = make_uint4(out[4 * q], out[4 * q + 1], out[4 * q + 2], out[4 * q + 3]);
    };
    auto issue_x = [&](int64_t k0, int buf) {
#pragma unroll
        for (int q = 0; q < XPT; q++) {
            const int p = tid + q * TC_THREADS;
            if (p < XCH)
                cp_async16(xs + (size_t)buf * BN * TC_LD + (p >> 3) * TC_LD + (p & 7) * 8,
                           xsrc[q] + k0, xbytes[q]);
        }
        cp_async_commit();
    };

    float acc[MT][NT][4];
#pragma unroll
    for (int a = 0; a < MT; a++)
#pragma unroll
        for (int b = 0; b < NT; b++)
#pragma unroll
            for (int c = 0; c < 4; c++) acc[a][b][c] = 0.0f;

    const int wm = warp / WN_W, wn = warp % WN_W;
    const int nk = (int)(K / TC_BK);
    issue_x(0, 0);
    load_w(0);
    store_w(0);
    cp_async_wait_all();
    __syncthreads();
    for (int kt = 0; kt < nk; kt++) {
        const int buf = kt & 1;
        const bool next = kt + 1 < nk;
        if (next) { // the next step's loads in flight during this step's MMAs
            issue_x((int64_t)(kt + 1) * TC_BK, buf ^ 1);
            load_w((int64_t)(kt + 1) * TC_BK);
        }
        const uint16_t *W = ws + (size_t)buf * TC_BM * TC_LD;
        const uint16_t *X = xs + (size_t)buf * BN * TC_LD;
#pragma unroll
        for (int kk = 0; kk < TC_BK; kk += 16) {
            // Fragments (PTX ISA, m16n8k16 .bf16): A row-major 16x16 (features x k): a0 (g, 2t),
            // a1 (g+8, 2t), a2 (g, 2t+8), a3 (g+8, 2t+8), two columns per register; B 16x8
            // (k x rows): b0 (k 2t, 2t+1; row g), b1 (k 2t+8, 2t+9; row g).
            uint32_t af[MT][4], bf[NT][2];
#pragma unroll
            for (int a = 0; a < MT; a++) {
                const uint16_t *p = W + (wm * WM + a * 16 + g) * TC_LD + kk + 2 * t4;
                af[a][0] = *(const uint32_t *)p;
                af[a][1] = *(const uint32_t *)(p + 8 * TC_LD);
                af[a][2] = *(const uint32_t *)(p + 8);
                af[a][3] = *(const uint32_t *)(p + 8 * TC_LD + 8);
            }
#pragma unroll
            for (int b = 0; b < NT; b++) {
                const uint16_t *p = X + (wn * WN + b * 8 + g) * TC_LD + kk + 2 * t4;
                bf[b][0] = *(const uint32_t *)p;
                bf[b][1] = *(const uint32_t *)(p + 8);
            }
#pragma unroll
            for (int a = 0; a < MT; a++)
#pragma unroll
                for (int b = 0; b < NT; b++) mma_bf16(acc[a][b], af[a], bf[b]);
        }
        if (next) {
            store_w(buf ^ 1); // buf ^ 1 was last read before the previous barrier
            cp_async_wait_all();
        }
        __syncthreads();
    }

    // C fragment: c0, c1 (feature g, rows 2t, 2t+1), c2, c3 (feature g+8, same rows).
#pragma unroll
    for (int a = 0; a < MT; a++)
#pragma unroll
        for (int b = 0; b < NT; b++)
#pragma unroll
            for (int c = 0; c < 4; c++) {
                const int64_t o = o0 + wm * WM + a * 16 + g + (c >> 1) * 8;
                const int j = wn * WN + b * 8 + 2 * t4 + (c & 1);
                if (o < n_out && j < nrow) y[(int64_t)(i0 + j) * y_stride + o] = acc[a][b][c];
            }
}

template <bool FP8, int BN, int WM_W, int WN_W>
static di_status launch_tc(di_cuda *cu, const di_tensor *experts, const int32_t *offsets,
                           const int2 *tiles, const int32_t *n_tiles, int32_t max_tiles,
                           const int32_t *x_rows, const uint16_t *xb, int64_t n_out, int64_t K,
                           float *y, int64_t y_stride) {
    const size_t smem = sizeof(uint16_t) * 2 * (size_t)(TC_BM + BN) * TC_LD;
    auto kern = moe_tc_kernel<FP8, BN, WM_W, WN_W>;
    // 55 KB at BN 64: above the 48 KB default, within every sm_80+ opt-in (99 KB and more).
    static di_smem_kernel smem_k; // one per instance
    const di_status fit = di_cuda_smem_fit(cu, &smem_k, (const void *)kern, smem, NULL);
    if (fit == DI_ERR_INVALID) return DI_ERR_UNSUPPORTED; // not on this device: the SIMT kernel
    if (fit != DI_OK) return fit;
    dim3 grid(di_div_up(n_out, TC_BM), (unsigned)max_tiles);
    kern<<<grid, TC_THREADS, smem, di_stream(cu)>>>(experts, offsets, tiles, n_tiles, x_rows, xb,
                                                    n_out, K, y, y_stride);
    DI_CUDA_LAUNCHED("moe_tc_kernel");
    return DI_OK;
}

// BN of a call: 64 rows when an expert holds about that many (prefill of thousands of tokens),
// else 16 (fewer rows computed for nothing where experts hold a few rows each).
static int32_t tile_rows(int32_t n_rows, int32_t n_expert) {
    return (int64_t)n_rows >= 40 * (int64_t)n_expert ? 64 : 16;
}

// The tile list's length bound: sum_e ceil(c_e / bn) <= n_rows / bn + (experts with rows).
static int64_t tiles_max(int32_t n_rows, int32_t n_expert) {
    const int32_t bn = tile_rows(n_rows, n_expert);
    return n_rows / bn + (n_expert < n_rows ? n_expert : n_rows);
}

// Whether the tensor-core kernel takes this shape (moe_tc.cuh: else DI_ERR_UNSUPPORTED).
static bool tc_shape_ok(const di_cuda *cu, di_tensor_kind kind, int32_t n_expert, int64_t n_out,
                        int64_t n_in, int32_t n_rows) {
    return (kind == DI_TENSOR_KIND_FP4 || kind == DI_TENSOR_KIND_FP8) && cu->cc_major >= 8 &&
           n_in > 0 && n_in % TC_BK == 0 && n_out > 0 && n_expert >= 1 && n_expert <= TC_MAX_E &&
           tiles_max(n_rows, n_expert) <= 65535; // gridDim.y
}

extern "C" di_status di_cuda_matmul_grouped_tc(di_cuda *cu, di_tensor_kind kind,
                                               const di_tensor *experts, int32_t n_expert,
                                               int64_t n_out, int64_t n_in, const int32_t *offsets,
                                               int32_t n_rows, const int32_t *x_rows,
                                               const float *x, int64_t n_x_rows, int64_t x_stride,
                                               float *y, int64_t y_stride) {
    if (!tc_shape_ok(cu, kind, n_expert, n_out, n_in, n_rows > 0 ? n_rows : 0))
        return DI_ERR_UNSUPPORTED;
    if (n_rows <= 0 || n_x_rows <= 0) return DI_OK;
    const int32_t bn = tile_rows(n_rows, n_expert);
    const bool wide = bn == 64;
    const int64_t max_tiles = tiles_max(n_rows, n_expert);
    di_status st = DI_OK;
    void *xb = NULL, *tl = NULL, *nt = NULL;
    DI_TRY(di_cuda_alloc(cu, sizeof(uint16_t) * (size_t)(n_x_rows * n_in), &xb));
    DI_TRY(di_cuda_alloc(cu, sizeof(int2) * (size_t)max_tiles, &tl));
    DI_TRY(di_cuda_alloc(cu, sizeof(int32_t), &nt));
    {
        const int64_t pairs = n_x_rows * n_in / 2;
        to_bf16_kernel<<<di_div_up(pairs, 256), 256, 0, di_stream(cu)>>>(x, n_x_rows, x_stride,
                                                                         n_in, (uint32_t *)xb);
        DI_TRY(di_cuda_check_launch("to_bf16_kernel"));
        tiles_kernel<<<1, 1024, 0, di_stream(cu)>>>(offsets, n_expert, bn, (int32_t)max_tiles,
                                                    (int2 *)tl, (int32_t *)nt);
        DI_TRY(di_cuda_check_launch("tiles_kernel"));
        const bool fp8 = kind == DI_TENSOR_KIND_FP8;
        const int2 *tiles = (const int2 *)tl;
        const int32_t *ntp = (const int32_t *)nt, mt = (int32_t)max_tiles;
        const uint16_t *xh = (const uint16_t *)xb;
        if (fp8 && wide)
            st = launch_tc<true, 64, 4, 2>(cu, experts, offsets, tiles, ntp, mt, x_rows, xh, n_out,
                                           n_in, y, y_stride);
        else if (fp8)
            st = launch_tc<true, 16, 8, 1>(cu, experts, offsets, tiles, ntp, mt, x_rows, xh, n_out,
                                           n_in, y, y_stride);
        else if (wide)
            st = launch_tc<false, 64, 4, 2>(cu, experts, offsets, tiles, ntp, mt, x_rows, xh, n_out,
                                            n_in, y, y_stride);
        else
            st = launch_tc<false, 16, 8, 1>(cu, experts, offsets, tiles, ntp, mt, x_rows, xh, n_out,
                                            n_in, y, y_stride);
    }
fail:
    di_cuda_free(cu, nt);
    di_cuda_free(cu, tl);
    di_cuda_free(cu, xb);
    return st;
}

// ---- dispatch and the first call's check ----

// The test hook's corruption (cu->moe_tc_fault): grouped row 0 negated, as a layout bug would
// misplace it.
__global__ void negate_row_kernel(float *__restrict__ y, int64_t n) {
    const int64_t k = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (k < n) y[k] = -y[k];
}

static di_status tc_check(di_cuda *cu, di_tensor_kind kind, const di_tensor *experts,
                          int32_t n_expert, int64_t n_out, int64_t n_in, const int32_t *offsets,
                          int32_t n_rows, const int32_t *x_rows, const float *x, int64_t n_x_rows,
                          int64_t x_stride, float *y, int64_t y_stride, int32_t rows_hint) {
    const int64_t n = (int64_t)n_rows * n_out;
    void *ref = NULL;
    float *h_tc = NULL, *h_ref = NULL;
    di_status st;
    DI_TRY(di_cuda_alloc(cu, sizeof(float) * (size_t)n, &ref));
    DI_TRY(di_cuda_matmul_grouped(cu, experts, n_expert, n_out, n_in, offsets, x_rows, x, x_stride,
                                  (float *)ref, n_out, rows_hint));
    st = di_cuda_matmul_grouped_tc(cu, kind, experts, n_expert, n_out, n_in, offsets, n_rows,
                                   x_rows, x, n_x_rows, x_stride, y, y_stride);
    if (st == DI_ERR_UNSUPPORTED) { // a shape it does not take: this call on the SIMT kernel
        st = DI_OK;
        CUDA_TRY(cudaMemcpy2DAsync(y, sizeof(float) * (size_t)y_stride, ref,
                                   sizeof(float) * (size_t)n_out, sizeof(float) * (size_t)n_out,
                                   (size_t)n_rows, cudaMemcpyDeviceToDevice, di_stream(cu)));
        goto fail;
    }
    if (st == DI_ERR_CUDA) {
        // A launch refused at run time (logged by the launcher; a fault inside a kernel is sticky
        // and fails the copy below and the next sync anyway): y gets the SIMT result, the tensor
        // cores are off for the context.
        DI_CUDA_LOG_WARN("cuda: the routed experts' tensor-core kernel failed on its first call: "
                         "the SIMT kernel stays");
        cu->moe_tc = -1;
        st = DI_OK;
        CUDA_TRY(cudaMemcpy2DAsync(y, sizeof(float) * (size_t)y_stride, ref,
                                   sizeof(float) * (size_t)n_out, sizeof(float) * (size_t)n_out,
                                   (size_t)n_rows, cudaMemcpyDeviceToDevice, di_stream(cu)));
        goto fail;
    }
    if (st != DI_OK) goto fail;
    if (cu->moe_tc_fault) {
        negate_row_kernel<<<di_div_up(n_out, 256), 256, 0, di_stream(cu)>>>(y, n_out);
        DI_TRY(di_cuda_check_launch("negate_row_kernel"));
    }
    {
        h_tc = (float *)malloc(sizeof(float) * (size_t)n);
        h_ref = (float *)malloc(sizeof(float) * (size_t)n);
        if (!h_tc || !h_ref) {
            st = DI_ERR_NOMEM;
            goto fail;
        }
        CUDA_TRY(cudaMemcpy2DAsync(h_tc, sizeof(float) * (size_t)n_out, y,
                                   sizeof(float) * (size_t)y_stride, sizeof(float) * (size_t)n_out,
                                   (size_t)n_rows, cudaMemcpyDeviceToHost, di_stream(cu)));
        DI_TRY(di_cuda_download(cu, h_ref, ref, sizeof(float) * (size_t)n)); // synchronises
        double amax, dmax;
        const bool ok = di_cuda_close(h_tc, h_ref, (size_t)n, 1e-2, &amax, &dmax);
        cu->moe_tc = ok ? 1 : -1;
        di_log_write(ok ? 2 : 1, __FILE__, __LINE__,
                     "cuda: routed experts on BF16 tensor cores vs the SIMT kernel on the first "
                     "prefill MoE (%d %s experts, %lld rows, %lld x %lld): max |diff| %.3g of "
                     "max |y| %.3g: %s",
                     (int)n_expert, kind == DI_TENSOR_KIND_FP8 ? "FP8" : "FP4", (long long)n_rows,
                     (long long)n_out, (long long)n_in, dmax, amax,
                     ok ? "used from now on" : "MISMATCH, the SIMT kernel stays");
        if (ok) {
            cu->n_moe_tc_calls++;
        } else {
            CUDA_TRY(cudaMemcpy2DAsync(y, sizeof(float) * (size_t)y_stride, ref,
                                       sizeof(float) * (size_t)n_out, sizeof(float) * (size_t)n_out,
                                       (size_t)n_rows, cudaMemcpyDeviceToDevice, di_stream(cu)));
        }
    }
fail:
    free(h_ref);
    free(h_tc);
    di_cuda_free(cu, ref);
    return st;
}

extern "C" di_status di_cuda_moe_grouped_a8(di_cuda *cu, di_tensor_kind kind,
                                            const di_tensor *experts, int32_t n_expert,
                                            int64_t n_out, int64_t n_in, const int32_t *offsets,
                                            int32_t n_rows, const int32_t *x_rows, const float *x,
                                            int64_t n_x_rows, int64_t x_stride, float *y,
                                            int64_t y_stride, int32_t n_tok, int32_t rows_hint) {
    const bool eligible = cu->moe_tc >= 0 && !cu->capturing && n_tok >= DI_BACKEND_TC_MIN_ROWS &&
                          n_rows > 0 && tc_shape_ok(cu, kind, n_expert, n_out, n_in, n_rows);
    if (eligible && cu->moe_tc == 0) {
        const char *env = getenv("DI_CUDA_MOE_TC");
        if (env && strcmp(env, "0") == 0) {
            di_log_write(2, __FILE__, __LINE__,
                         "cuda: DI_CUDA_MOE_TC=0: the routed experts stay on the SIMT kernel");
            cu->moe_tc = -1;
        } else {
            return tc_check(cu, kind, experts, n_expert, n_out, n_in, offsets, n_rows, x_rows, x,
                            n_x_rows, x_stride, y, y_stride, rows_hint);
        }
    }
    if (eligible && cu->moe_tc > 0) {
        const di_status st =
            di_cuda_matmul_grouped_tc(cu, kind, experts, n_expert, n_out, n_in, offsets, n_rows,
                                      x_rows, x, n_x_rows, x_stride, y, y_stride);
        if (st == DI_OK) {
            cu->n_moe_tc_calls++;
            return st;
        }
        if (st == DI_ERR_CUDA) { // a launch refused at run time: this call and later ones SIMT
            DI_CUDA_LOG_WARN("cuda: the routed experts' tensor-core kernel failed (%d rows): the "
                             "SIMT kernel stays",
                             (int)n_rows);
            cu->moe_tc = -1;
        } else if (st != DI_ERR_UNSUPPORTED) {
            return st; // DI_ERR_NOMEM
        }
    }
    return di_cuda_matmul_grouped(cu, experts, n_expert, n_out, n_in, offsets, x_rows, x, x_stride,
                                  y, y_stride, rows_hint);
}
