// gemm — FP32-accumulating matmul over every weight kind (gemm.cuh).
#include <stdlib.h>

#include "backend/cuda/common.cuh"
#include "backend/cuda/gemm.cuh"

// ---- 8-element decode ----

// True when rows decode 8 columns at a time with vector loads: n_in a multiple of 8 and, for
// block-scaled kinds, block_in a multiple of 8 (one scale per chunk); the data pointer and the row
// stride aligned to the widest load (then every row start is: row views start at row0 * nb1).
// __host__ __device__: the grouped kernel evaluates them on each expert's own descriptor (its
// array lives in device memory).
__host__ __device__ static bool vec8_ok(const di_tensor &w) {
    if (w.ne[0] % 8 != 0) return false;
    const uintptr_t a = (uintptr_t)w.data;
    if (w.kind == DI_TENSOR_KIND_FP8) return w.block_in % 8 == 0 && w.nb1 % 8 == 0 && a % 8 == 0;
    if (w.kind == DI_TENSOR_KIND_FP4) return w.block_in % 8 == 0 && w.nb1 % 8 == 0 && a % 8 == 0;
    return w.nb1 % 16 == 0 && a % 16 == 0;
}

// The 16-element path (decode GEMV): 16-byte loads of FP8 codes (8 of FP4, 32 of BF16/F16, 64 of
// F32) per lane; needs n_in and block_in multiples of 16 and 16-byte aligned rows.
__host__ __device__ static bool vec16_ok(const di_tensor &w) {
    if (w.ne[0] % 16 != 0) return false;
    const uintptr_t a = (uintptr_t)w.data;
    if (w.kind == DI_TENSOR_KIND_FP8) return w.block_in % 16 == 0 && w.nb1 % 16 == 0 && a % 16 == 0;
    if (w.kind == DI_TENSOR_KIND_FP4) return w.block_in % 16 == 0 && w.nb1 % 8 == 0 && a % 8 == 0;
    return w.nb1 % 16 == 0 && a % 16 == 0;
}

__host__ __device__ static int vec_mode(const di_tensor &w) {
    return vec16_ok(w) ? 16 : vec8_ok(w) ? 8 : 0;
}

// Columns [c, c+8) of row r, exact (equal to di_w_at element by element).
__device__ __forceinline__ void decode8(const di_tensor &w, int64_t r, int64_t c, float v[8]) {
    const uint8_t *row = (const uint8_t *)w.data + (size_t)r * w.nb1;
    switch (w.kind) {
    case DI_TENSOR_KIND_F32: {
        float4 a = *(const float4 *)(row + 4 * c), b = *(const float4 *)(row + 4 * c + 16);
        v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w, v[4] = b.x, v[5] = b.y, v[6] = b.z,
        v[7] = b.w;
        return;
    }
    case DI_TENSOR_KIND_F16: {
        uint4 q = *(const uint4 *)(row + 2 * c);
        const __half *h = (const __half *)&q;
        for (int i = 0; i < 8; i++) v[i] = __half2float(h[i]);
        return;
    }
    case DI_TENSOR_KIND_BF16: {
        uint4 q = *(const uint4 *)(row + 2 * c);
        const uint32_t u[4] = {q.x, q.y, q.z, q.w};
        for (int i = 0; i < 4; i++) {
            v[2 * i] = __uint_as_float(u[i] << 16);
            v[2 * i + 1] = __uint_as_float(u[i] & 0xFFFF0000u);
        }
        return;
    }
    case DI_TENSOR_KIND_FP8: {
        uint2 q = *(const uint2 *)(row + c);
        const float s = di_ue8m0_f32(
            w.scale[(size_t)((w.row0 + r) / w.block_out) * w.scale_nb1 + c / w.block_in]);
        for (int i = 0; i < 4; i++) v[i] = di_e4m3_f32((q.x >> (8 * i)) & 0xFFu) * s;
        for (int i = 0; i < 4; i++) v[4 + i] = di_e4m3_f32((q.y >> (8 * i)) & 0xFFu) * s;
        return;
    }
    case DI_TENSOR_KIND_FP4: {
        uint32_t q = *(const uint32_t *)(row + c / 2);
        const float s = di_ue8m0_f32(
            w.scale[(size_t)((w.row0 + r) / w.block_out) * w.scale_nb1 + c / w.block_in]);
        for (int i = 0; i < 8; i++) v[i] = di_e2m1_f32((q >> (4 * i)) & 15u) * s;
        return;
    }
    }
}

// Columns [c, c+16) of row r, exact (vec16_ok).
__device__ __forceinline__ void decode16(const di_tensor &w, int64_t r, int64_t c, float v[16]) {
    const uint8_t *row = (const uint8_t *)w.data + (size_t)r * w.nb1;
    switch (w.kind) {
    case DI_TENSOR_KIND_F32: {
        const float4 *p = (const float4 *)(row + 4 * c);
        for (int k = 0; k < 4; k++) {
            const float4 a = p[k];
            v[4 * k] = a.x, v[4 * k + 1] = a.y, v[4 * k + 2] = a.z, v[4 * k + 3] = a.w;
        }
        return;
    }
    case DI_TENSOR_KIND_F16: {
        const uint4 q0 = *(const uint4 *)(row + 2 * c), q1 = *(const uint4 *)(row + 2 * c + 16);
        const __half *h0 = (const __half *)&q0, *h1 = (const __half *)&q1;
        for (int i = 0; i < 8; i++) v[i] = __half2float(h0[i]), v[8 + i] = __half2float(h1[i]);
        return;
    }
    case DI_TENSOR_KIND_BF16: {
        const uint4 q0 = *(const uint4 *)(row + 2 * c), q1 = *(const uint4 *)(row + 2 * c + 16);
        const uint32_t u[8] = {q0.x, q0.y, q0.z, q0.w, q1.x, q1.y, q1.z, q1.w};
        for (int i = 0; i < 8; i++) {
            v[2 * i] = __uint_as_float(u[i] << 16);
            v[2 * i + 1] = __uint_as_float(u[i] & 0xFFFF0000u);
        }
        return;
    }
    case DI_TENSOR_KIND_FP8: {
        const uint4 q = *(const uint4 *)(row + c);
        const float s = di_ue8m0_f32(
            w.scale[(size_t)((w.row0 + r) / w.block_out) * w.scale_nb1 + c / w.block_in]);
        const uint32_t u[4] = {q.x, q.y, q.z, q.w};
        for (int k = 0; k < 4; k++)
            for (int i = 0; i < 4; i++) v[4 * k + i] = di_e4m3_f32((u[k] >> (8 * i)) & 0xFFu) * s;
        return;
    }
    case DI_TENSOR_KIND_FP4: {
        const uint2 q = *(const uint2 *)(row + c / 2);
        const float s = di_ue8m0_f32(
            w.scale[(size_t)((w.row0 + r) / w.block_out) * w.scale_nb1 + c / w.block_in]);
        for (int i = 0; i < 8; i++) v[i] = di_e2m1_f32((q.x >> (4 * i)) & 15u) * s;
        for (int i = 0; i < 8; i++) v[8 + i] = di_e2m1_f32((q.y >> (4 * i)) & 15u) * s;
        return;
    }
    }
}

// ---- gemv: one warp per output row, up to NT tokens ----

// This lane's V-column chunks (V = 16 or 8, 32 lanes apart) of rows o0 .. o0+nr-1 against up to
// NT tokens, added to acc: each chunk's product summed in column order, then added.
template <int NT, int NR, int V>
__device__ __forceinline__ void gemv_chunks(const di_tensor &w, int64_t o0, int nr,
                                            const float *const *xs, int nt, float acc[NR][NT]) {
    const int64_t n = w.ne[0];
    for (int64_t c = (int64_t)(threadIdx.x & 31) * V; c < n; c += 32 * V) {
        float v[NR][V];
#pragma unroll
        for (int r = 0; r < NR; r++) {
            if (r < nr) {
                if constexpr (V == 16)
                    decode16(w, o0 + r, c, v[r]);
                else
                    decode8(w, o0 + r, c, v[r]);
            }
        }
#pragma unroll
        for (int j = 0; j < NT; j++) {
            if (j < nt) {
                float xv[V];
#pragma unroll
                for (int i = 0; i < V; i++) xv[i] = xs[j][c + i];
#pragma unroll
                for (int r = 0; r < NR; r++) {
                    float s = 0.0f;
#pragma unroll
                    for (int i = 0; i < V; i++) s = fmaf(v[r][i], xv[i], s);
                    if (r < nr) acc[r][j] += s;
                }
            }
        }
    }
}

// Rows o0 .. o0+nr-1 (nr <= NR, warp-uniform) times up to NT tokens. Each lane decodes the same
// 16 (or 8) columns of the NR rows, then reads each token's matching x values once for all NR
// rows: x traffic per weight byte drops NR-fold (FP4 rows would otherwise read 8 bytes of x from
// L1 per byte of weight). Sums: per lane in column order, then across the warp.
template <int NT, int NR>
__device__ __forceinline__ void gemv_rows(const di_tensor &w, int64_t o0, int nr,
                                          const float *const *xs, int nt, int vec,
                                          float acc[NR][NT]) {
    const int lane = threadIdx.x & 31;
    const int64_t n = w.ne[0];
#pragma unroll
    for (int r = 0; r < NR; r++)
#pragma unroll
        for (int j = 0; j < NT; j++) acc[r][j] = 0.0f;
    // Fully unrolled loops with predicates (no early exits), so v, xv and acc stay in registers.
    if (vec == 16) {
        gemv_chunks<NT, NR, 16>(w, o0, nr, xs, nt, acc);
    } else if (vec == 8) {
        gemv_chunks<NT, NR, 8>(w, o0, nr, xs, nt, acc);
    } else {
        for (int64_t c = lane; c < n; c += 32) {
#pragma unroll
            for (int r = 0; r < NR; r++) {
                if (r < nr) {
                    const float v = di_w_at(w, o0 + r, c);
#pragma unroll
                    for (int j = 0; j < NT; j++)
                        if (j < nt) acc[r][j] = fmaf(v, xs[j][c], acc[r][j]);
                }
            }
        }
    }
#pragma unroll
    for (int r = 0; r < NR; r++)
#pragma unroll
        for (int j = 0; j < NT; j++) acc[r][j] = di_warp_sum(acc[r][j]);
}

enum { GEMV_WARPS = 8, GEMV_NT = 8, GEMV_ROWS = 4 };

// NT tokens per pass: 1 for single-token decode (fewer registers, more warps in flight per SM),
// GEMV_NT otherwise.
template <int NT>
__global__ void __launch_bounds__(GEMV_WARPS * 32)
    gemv_kernel(const di_tensor w, const float *__restrict__ x, int64_t n_tok, int64_t x_stride,
                float *__restrict__ y, int64_t y_stride, int vec) {
    const int64_t o0 = ((int64_t)blockIdx.x * GEMV_WARPS + (threadIdx.x >> 5)) * GEMV_ROWS;
    if (o0 >= w.ne[1]) return;
    const int nr = (int)(w.ne[1] - o0 < GEMV_ROWS ? w.ne[1] - o0 : GEMV_ROWS);
    // Grid rows loop over the token passes (di_grid_y: any n_tok).
    for (int64_t t0 = (int64_t)blockIdx.y * NT; t0 < n_tok; t0 += (int64_t)gridDim.y * NT) {
        const int nt = (int)(n_tok - t0 < NT ? n_tok - t0 : NT);
        const float *xs[NT];
#pragma unroll
        for (int j = 0; j < NT; j++) xs[j] = x + (t0 + (j < nt ? j : 0)) * x_stride;
        float acc[GEMV_ROWS][NT];
        gemv_rows<NT, GEMV_ROWS>(w, o0, nr, xs, nt, vec, acc);
        if ((threadIdx.x & 31) == 0) {
#pragma unroll
            for (int r = 0; r < GEMV_ROWS; r++)
#pragma unroll
                for (int j = 0; j < NT; j++)
                    if (r < nr && j < nt) y[(t0 + j) * y_stride + o0 + r] = acc[r][j];
        }
    }
}

extern "C" di_status di_cuda_matmul_gemv(di_cuda *cu, const di_tensor *w, const float *x,
                                         int64_t n_tok, int64_t x_stride, float *y,
                                         int64_t y_stride) {
    if (n_tok <= 0 || w->ne[1] <= 0) return DI_OK;
    const int vec = vec_mode(*w); // x is read with scalar loads: any alignment and stride
    if (n_tok == 1) {
        dim3 grid(di_div_up(w->ne[1], GEMV_WARPS * GEMV_ROWS), 1);
        gemv_kernel<1>
            <<<grid, GEMV_WARPS * 32, 0, di_stream(cu)>>>(*w, x, n_tok, x_stride, y, y_stride, vec);
    } else {
        dim3 grid(di_div_up(w->ne[1], GEMV_WARPS * GEMV_ROWS),
                  di_grid_y(di_div_up(n_tok, GEMV_NT)));
        gemv_kernel<GEMV_NT>
            <<<grid, GEMV_WARPS * 32, 0, di_stream(cu)>>>(*w, x, n_tok, x_stride, y, y_stride, vec);
    }
    DI_CUDA_LAUNCHED("gemv_kernel");
    return DI_OK;
}

// ---- tiled: 64 rows x 64 tokens x 32 columns per step ----

enum { TM = 64, TN = 64, TK = 32, TILE_THREADS = 256 };

__global__ void __launch_bounds__(TILE_THREADS)
    tiled_kernel(const di_tensor w, const float *__restrict__ x, int64_t n_tok, int64_t x_stride,
                 float *__restrict__ y, int64_t y_stride, bool vec) {
    __shared__ float ws[TK][TM + 4]; // [column][row]
    __shared__ float xs[TK][TN + 4]; // [column][token]
    const int tid = threadIdx.x;
    const int64_t o0 = (int64_t)blockIdx.x * TM;
    const int64_t n = w.ne[0], n_out = w.ne[1];
    const int lr = tid >> 2, lc = (tid & 3) * 8; // loader: row/token lr, columns lc..lc+7
    const int ty = tid >> 4, tx = tid & 15;      // compute: rows ty*4.., tokens tx*4..
    // Grid rows loop over the token tiles (di_grid_y: any n_tok); the k loop's last barrier
    // frees ws and xs for the next tile.
    for (int64_t t0 = (int64_t)blockIdx.y * TN; t0 < n_tok; t0 += (int64_t)gridDim.y * TN) {
        float acc[4][4] = {};
        for (int64_t k0 = 0; k0 < n; k0 += TK) {
            {
                const int64_t o = o0 + lr, c = k0 + lc;
                float v[8];
                if (o < n_out && vec && c + 8 <= n) {
                    decode8(w, o, c, v);
                } else {
                    for (int i = 0; i < 8; i++)
                        v[i] = (o < n_out && c + i < n) ? di_w_at(w, o, c + i) : 0.0f;
                }
                for (int i = 0; i < 8; i++) ws[lc + i][lr] = v[i];
                const int64_t t = t0 + lr;
                for (int i = 0; i < 8; i++)
                    xs[lc + i][lr] = (t < n_tok && c + i < n) ? x[t * x_stride + c + i] : 0.0f;
            }
            __syncthreads();
#pragma unroll 8
            for (int k = 0; k < TK; k++) {
                float a[4], b[4];
                for (int i = 0; i < 4; i++) a[i] = ws[k][ty * 4 + i];
                for (int j = 0; j < 4; j++) b[j] = xs[k][tx * 4 + j];
                for (int i = 0; i < 4; i++)
                    for (int j = 0; j < 4; j++) acc[i][j] = fmaf(a[i], b[j], acc[i][j]);
            }
            __syncthreads();
        }
        for (int i = 0; i < 4; i++) {
            const int64_t o = o0 + ty * 4 + i;
            if (o >= n_out) continue;
            for (int j = 0; j < 4; j++) {
                const int64_t t = t0 + tx * 4 + j;
                if (t < n_tok) y[t * y_stride + o] = acc[i][j];
            }
        }
    }
}

extern "C" di_status di_cuda_matmul_tiled(di_cuda *cu, const di_tensor *w, const float *x,
                                          int64_t n_tok, int64_t x_stride, float *y,
                                          int64_t y_stride) {
    if (n_tok <= 0 || w->ne[1] <= 0) return DI_OK;
    dim3 grid(di_div_up(w->ne[1], TM), di_grid_y(di_div_up(n_tok, TN)));
    tiled_kernel<<<grid, TILE_THREADS, 0, di_stream(cu)>>>(*w, x, n_tok, x_stride, y, y_stride,
                                                           vec8_ok(*w));
    DI_CUDA_LAUNCHED("tiled_kernel");
    return DI_OK;
}

extern "C" di_status di_cuda_matmul(di_cuda *cu, const di_tensor *w, const float *x, int64_t n_tok,
                                    int64_t x_stride, float *y, int64_t y_stride) {
    if (n_tok <= DI_CUDA_GEMV_MAX_TOKENS)
        return di_cuda_matmul_gemv(cu, w, x, n_tok, x_stride, y, y_stride);
    return di_cuda_matmul_tiled(cu, w, x, n_tok, x_stride, y, y_stride);
}

// ---- grouped experts: one launch, blockIdx.y = expert ----

// The vector width comes from each expert's own descriptor (vec_mode on the device: kind, block_in,
// row stride and data alignment, as the non-grouped kernels decide on the host), not from the
// shape alone: block-uniform, so no divergence.
template <int NT>
__device__ __forceinline__ void grouped_expert(const di_tensor &w, int32_t r0, int32_t r1,
                                               const int32_t *__restrict__ x_rows,
                                               const float *__restrict__ x, int64_t x_stride,
                                               float *__restrict__ y, int64_t y_stride) {
    const int64_t o0 = ((int64_t)blockIdx.x * GEMV_WARPS + (threadIdx.x >> 5)) * GEMV_ROWS;
    if (o0 >= w.ne[1]) return;
    const int vec = vec_mode(w);
    const int nr = (int)(w.ne[1] - o0 < GEMV_ROWS ? w.ne[1] - o0 : GEMV_ROWS);
    // Each pass reads the expert's rows once for up to NT of its tokens.
    for (int32_t i0 = r0; i0 < r1; i0 += NT) {
        const int nt = r1 - i0 < NT ? r1 - i0 : NT;
        const float *xs[NT];
#pragma unroll
        for (int j = 0; j < NT; j++) {
            const int32_t i = i0 + (j < nt ? j : 0);
            xs[j] = x + (int64_t)(x_rows ? x_rows[i] : i) * x_stride;
        }
        float acc[GEMV_ROWS][NT];
        gemv_rows<NT, GEMV_ROWS>(w, o0, nr, xs, nt, vec, acc);
        if ((threadIdx.x & 31) == 0) {
#pragma unroll
            for (int r = 0; r < GEMV_ROWS; r++)
#pragma unroll
                for (int j = 0; j < NT; j++)
                    if (r < nr && j < nt) y[(int64_t)(i0 + j) * y_stride + o0 + r] = acc[r][j];
        }
    }
}

// Grid rows loop over the experts (di_grid_y: any n_expert).
template <int NT>
__global__ void __launch_bounds__(GEMV_WARPS * 32)
    grouped_kernel(const di_tensor *__restrict__ experts, int32_t n_expert,
                   const int32_t *__restrict__ offsets, const int32_t *__restrict__ x_rows,
                   const float *__restrict__ x, int64_t x_stride, float *__restrict__ y,
                   int64_t y_stride) {
    for (int64_t e = blockIdx.y; e < n_expert; e += gridDim.y) {
        const int32_t r0 = offsets[e], r1 = offsets[e + 1];
        if (r0 >= r1) continue; // expert without tokens: its weights are never read
        const di_tensor w = experts[e];
        grouped_expert<NT>(w, r0, r1, x_rows, x, x_stride, y, y_stride);
    }
}

extern "C" di_status di_cuda_matmul_grouped(di_cuda *cu, const di_tensor *experts, int32_t n_expert,
                                            int64_t n_out, int64_t n_in, const int32_t *offsets,
                                            const int32_t *x_rows, const float *x, int64_t x_stride,
                                            float *y, int64_t y_stride, int32_t rows_hint) {
    if (n_expert <= 0 || n_out <= 0) return DI_OK;
    (void)n_in; // each expert's descriptor carries it (and picks its vector width, above)
    dim3 grid(di_div_up(n_out, GEMV_WARPS * GEMV_ROWS), di_grid_y(n_expert));
    if (rows_hint == 1)
        grouped_kernel<1><<<grid, GEMV_WARPS * 32, 0, di_stream(cu)>>>(
            experts, n_expert, offsets, x_rows, x, x_stride, y, y_stride);
    else
        grouped_kernel<GEMV_NT><<<grid, GEMV_WARPS * 32, 0, di_stream(cu)>>>(
            experts, n_expert, offsets, x_rows, x, x_stride, y, y_stride);
    DI_CUDA_LAUNCHED("grouped_kernel");
    return DI_OK;
}

// ---- CPU fallback ----

extern "C" void di_cpu_matmul(di_cpu *cpu, const di_tensor *w, const float *x, int64_t n_tok,
                              int64_t x_stride, float *y, int64_t y_stride);

extern "C" di_status di_cuda_matmul_or_cpu(di_cuda *cu, di_cpu *cpu, const di_tensor *w_host,
                                           const di_tensor *w_dev, const float *x, int64_t n_tok,
                                           int64_t x_stride, float *y, int64_t y_stride) {
    if (di_cuda_supports_op(cu, DI_CUDA_OP_MATMUL, w_host))
        return di_cuda_matmul(cu, w_dev, x, n_tok, x_stride, y, y_stride);
    if (!cu->warned_fallback[DI_CUDA_OP_MATMUL]) {
        cu->warned_fallback[DI_CUDA_OP_MATMUL] = true;
        DI_CUDA_LOG_WARN("matmul of %s (%s) is not supported on the GPU: running on the CPU",
                         w_host->name ? w_host->name : "?", "weight kind");
    }
    if (n_tok <= 0) return DI_OK;
    di_status st = DI_OK;
    const size_t xb = sizeof(float) * (size_t)((n_tok - 1) * x_stride + w_host->ne[0]);
    const size_t yb = sizeof(float) * (size_t)((n_tok - 1) * y_stride + w_host->ne[1]);
    float *hx = (float *)malloc(xb), *hy = (float *)malloc(yb);
    if (!hx || !hy) {
        st = DI_ERR_NOMEM;
        goto out;
    }
    if ((st = di_cuda_download(cu, hx, x, xb)) != DI_OK) goto out;
    // y's gaps between rows keep their device contents.
    if ((st = di_cuda_download(cu, hy, y, yb)) != DI_OK) goto out;
    di_cpu_matmul(cpu, w_host, hx, n_tok, x_stride, hy, y_stride);
    st = di_cuda_upload(cu, y, hy, yb);
out:
    free(hx);
    free(hy);
    return st;
}
