// gemm_lt — A8 activation quantisation and FP8 x FP8 block-scaled GEMM through cuBLASLt
// (gemm.cuh). Which operand carries which scale mode is not spelled out for Hopper in the
// headers: the natural formulation (A = weights, 128x128 blocks; B = activations, 1x128) is
// tried first, then the swapped one (A = activations, B = weights), whose column-major result is
// y transposed and is transposed back (results land in a padded buffer, then in y). The test
// (tests/backend/cuda/test_cuda_gemm.c) checks whichever runs against the CPU reference.
#include <cublasLt.h>
#include <cuda_fp8.h>
#include <stdlib.h>

#include <algorithm>

#include "backend/backend.h" // DI_BACKEND_TC_MIN_ROWS
#include "backend/cuda/common.cuh"
#include "backend/cuda/gemm.cuh"
#include "backend/cuda/quant.cuh" // di_cuda_fake_quant

// ---- A8 ----

__device__ __forceinline__ int ceil_log2_u(float x) {
    const uint32_t u = __float_as_uint(x);
    return (int)((u >> 23) & 0xFFu) - 127 + ((u & 0x7FFFFFu) != 0);
}

// One warp per 128-block: 4 values per lane. Scales [n_tok][n/128] (ours), or with LT
// [n/128][n_tok] (what cuBLASLt reads for a VEC128_32F operand, see lt_scales_kernel).
template <bool LT>
__global__ void act_quant_kernel(const float *__restrict__ x, int64_t n_tok, int64_t x_stride,
                                 int64_t n, uint8_t *__restrict__ codes,
                                 float *__restrict__ scales) {
    const int64_t nb = n / 128;
    const int64_t blk = (int64_t)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    const int lane = threadIdx.x & 31;
    if (blk >= n_tok * nb) return;
    const int64_t t = blk / nb, b = blk % nb;
    const float *v = x + t * x_stride + b * 128;
    float a[4], amax = 0.0f;
    for (int i = 0; i < 4; i++) a[i] = v[lane + 32 * i], amax = fmaxf(amax, fabsf(a[i]));
    amax = fmaxf(di_warp_max(amax), 1e-4f);
    const int k = ceil_log2_u(amax * (1.0f / 448.0f));              // one f32 rounding, as Q8
    const float inv_s = __uint_as_float((uint32_t)(127 - k) << 23); // 2^-k, exact
    uint8_t *c = codes + t * n + b * 128;
    for (int i = 0; i < 4; i++)
        c[lane + 32 * i] = (uint8_t)__nv_cvt_float_to_fp8(a[i] * inv_s, __NV_SATFINITE, __NV_E4M3);
    if (lane == 0)
        scales[LT ? b * n_tok + t : t * nb + b] = __uint_as_float((uint32_t)(127 + k) << 23);
}

static di_status act_quant(di_cuda *cu, const float *x, int64_t n_tok, int64_t x_stride, int64_t n,
                           uint8_t *codes, float *scales, bool lt) {
    if (n % 128 != 0) return DI_ERR_INVALID;
    const int64_t blocks = n_tok * (n / 128);
    if (blocks <= 0) return DI_OK;
    if (lt)
        act_quant_kernel<true>
            <<<di_div_up(blocks, 8), 256, 0, di_stream(cu)>>>(x, n_tok, x_stride, n, codes, scales);
    else
        act_quant_kernel<false>
            <<<di_div_up(blocks, 8), 256, 0, di_stream(cu)>>>(x, n_tok, x_stride, n, codes, scales);
    return di_cuda_check_launch("act_quant_kernel");
}

extern "C" di_status di_cuda_act_quant_a8(di_cuda *cu, const float *x, int64_t n_tok,
                                          int64_t x_stride, int64_t n, uint8_t *codes,
                                          float *scales) {
    return act_quant(cu, x, n_tok, x_stride, n, codes, scales, false);
}

__global__ void scales_f32_kernel(const uint8_t *__restrict__ s, size_t s_nb1, int64_t rows,
                                  int64_t cols, float *__restrict__ out) {
    const int64_t k = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (k >= rows * cols) return;
    out[k] = di_ue8m0_f32(s[(size_t)(k / cols) * s_nb1 + (size_t)(k % cols)]);
}

extern "C" di_status di_cuda_fp8_scales_f32(di_cuda *cu, const di_tensor *w, float *out) {
    if (w->kind != DI_TENSOR_KIND_FP8 || w->block_in != 128 || w->block_out != 128 || w->row0 != 0)
        return DI_ERR_INVALID;
    const int64_t rows = (w->ne[1] + 127) / 128, cols = (w->ne[0] + 127) / 128;
    scales_f32_kernel<<<di_div_up(rows * cols, 256), 256, 0, di_stream(cu)>>>(
        w->scale, w->scale_nb1, rows, cols, out);
    DI_CUDA_LAUNCHED("scales_f32_kernel");
    return DI_OK;
}

// ---- cuBLASLt ----

// y[t * y_stride + o] = in[o * s_o + t * s_t]: cuBLASLt's column-major result (either
// formulation, leading dimension padded to 16 bytes) into the caller's rows.
__global__ void scatter_kernel(const float *__restrict__ in, int64_t n_out, int64_t T, int64_t s_o,
                               int64_t s_t, float *__restrict__ y, int64_t y_stride) {
    const int64_t k = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (k >= n_out * T) return;
    const int64_t t = k / n_out, o = k % n_out;
    y[t * y_stride + o] = in[o * s_o + t * s_t];
}

// The scale layouts cuBLASLt reads (they are not our storage orders): a VEC128_32F operand's
// scales outer-dimension-major, [K/128][outer] (scale of row r, K-block b at b * outer + r); a
// BLK128x128_32F operand's scales [outer/128][round_up(K/128, 4)] (per 128-row block its K-blocks,
// padded to 4 floats). Source: the stride checks PyTorch applies before handing these modes to
// cuBLASLt (aten/src/ATen/native/cuda/ScaledBlas.cpp, _scaled_block1x128_block128x128: As
// stride (1, M), Bs [round_up(K/128, 4), N/128] stride (1, round_up(K/128, 4))). Ours:
// x_scales [T][K/128] (di_cuda_act_quant_a8) and w_scales [n_out/128][K/128]
// (di_cuda_fp8_scales_f32).
__global__ void lt_scales_kernel(const float *__restrict__ xs, int64_t T,
                                 const float *__restrict__ ws, int64_t n_ob, int64_t nkb,
                                 int64_t ldk, float *__restrict__ xs_lt,
                                 float *__restrict__ ws_lt) {
    const int64_t k = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (k < T * nkb) {
        const int64_t t = k / nkb, b = k % nkb;
        xs_lt[b * T + t] = xs[k];
    }
    if (k < n_ob * ldk) {
        const int64_t o = k / ldk, b = k % ldk;
        ws_lt[k] = b < nkb ? ws[o * nkb + b] : 1.0f; // padding: never applied to data
    }
}

static const size_t k_ws_bytes = (size_t)32 << 20;

// ---- what the tensor-core path reuses between calls (di_cuda.lt_cache) ----

// An uploaded FP8 weight's scales in cuBLASLt's layout (BLK128x128_32F: [n_ob][ldk], above).
typedef struct lt_weight {
    const void *data; // the weight's device data: the key (uploaded weights live until destroy)
    int64_t n_in, n_ob;
    float *scales; // pool memory of cu
} lt_weight;

// What cuBLASLt offered for one shape: the formulation that has an algorithm, and the algorithm.
enum { LT_EMPTY, LT_NATURAL, LT_SWAPPED, LT_NONE };
typedef struct lt_plan {
    int64_t K, n_out, T;
    int kind; // LT_*
    cublasLtMatmulAlgo_t algo;
} lt_plan;

enum { LT_PLANS = 512 }; // direct-mapped: a prefill sees a few dozen shapes

struct di_cuda_lt_cache {
    lt_weight *w; // open addressing on data; cap_w a power of two >= 2 n_w (or 0)
    int64_t n_w, cap_w;
    lt_plan plans[LT_PLANS];
};

static uint64_t mix64(uint64_t h) {
    h ^= h >> 33, h *= 0xff51afd7ed558ccdull, h ^= h >> 33, h *= 0xc4ceb9fe1a85ec53ull;
    return h ^ (h >> 33);
}

// The entry of w's data in the weight table (an empty slot when absent).
static lt_weight *weight_slot(lt_weight *tab, int64_t cap, const void *data) {
    for (uint64_t i = mix64((uint64_t)(uintptr_t)data) & (uint64_t)(cap - 1);;
         i = (i + 1) & (uint64_t)(cap - 1))
        if (!tab[i].data || tab[i].data == data) return &tab[i];
}

// The cached scales of w, if w is (a view at row 0 of) an uploaded weight of the same K.
static const lt_weight *weight_find(const di_cuda_lt_cache *c, const di_tensor *w) {
    if (c->n_w == 0) return NULL;
    const lt_weight *e = weight_slot(c->w, c->cap_w, w->data);
    return e->data && e->n_in == w->ne[0] && e->n_ob >= (w->ne[1] + 127) / 128 ? e : NULL;
}

extern "C" di_status di_cuda_lt_weight_uploaded(di_cuda *cu, const di_tensor *dev) {
    if (cu->cc_major < 9 || dev->kind != DI_TENSOR_KIND_FP8 || dev->block_in != 128 ||
        dev->block_out != 128 || dev->row0 != 0 || dev->ne[0] % 128 != 0 ||
        dev->nb1 != (size_t)dev->ne[0] || dev->ne[1] == 0)
        return DI_OK;
    di_cuda_lt_cache *c = cu->lt_cache;
    if (2 * (c->n_w + 1) > c->cap_w) { // grow (rehash) before inserting
        const int64_t cap = c->cap_w ? 2 * c->cap_w : 256;
        lt_weight *tab = (lt_weight *)calloc((size_t)cap, sizeof *tab);
        if (!tab) return DI_ERR_NOMEM;
        for (int64_t i = 0; i < c->cap_w; i++)
            if (c->w[i].data) *weight_slot(tab, cap, c->w[i].data) = c->w[i];
        free(c->w);
        c->w = tab, c->cap_w = cap;
    }
    const int64_t nkb = dev->ne[0] / 128, n_ob = (dev->ne[1] + 127) / 128, ldk = (nkb + 3) / 4 * 4;
    void *f32 = NULL, *packed = NULL;
    di_status st;
    DI_TRY(di_cuda_alloc(cu, sizeof(float) * (size_t)(n_ob * nkb), &f32));
    DI_TRY(di_cuda_alloc(cu, sizeof(float) * (size_t)(n_ob * ldk), &packed));
    DI_TRY(di_cuda_fp8_scales_f32(cu, dev, (float *)f32));
    lt_scales_kernel<<<di_div_up(n_ob * ldk, 256), 256, 0, di_stream(cu)>>>(
        NULL, 0, (const float *)f32, n_ob, nkb, ldk, NULL, (float *)packed);
    DI_TRY(di_cuda_check_launch("lt_scales_kernel"));
    *weight_slot(c->w, c->cap_w, dev->data) =
        (lt_weight){.data = dev->data, .n_in = dev->ne[0], .n_ob = n_ob, .scales = (float *)packed};
    c->n_w++;
    packed = NULL; // kept: pool memory of cu until destroy
fail:
    di_cuda_free(cu, f32); // stream-ordered: the packing kernel still reads it
    di_cuda_free(cu, packed);
    return st;
}

extern "C" di_status di_cuda_lt_cache_create(di_cuda *cu) {
    cu->lt_cache = (di_cuda_lt_cache *)calloc(1, sizeof *cu->lt_cache);
    return cu->lt_cache ? DI_OK : DI_ERR_NOMEM;
}

extern "C" void di_cuda_lt_cache_free(di_cuda *cu) {
    if (!cu->lt_cache) return;
    free(cu->lt_cache->w);
    free(cu->lt_cache);
    cu->lt_cache = NULL;
}

// One attempt: swapped = false: D[n_out x T] = W^T-op . X; true: D[T x n_out] = X^T-op . W.
// Scales in cuBLASLt's layouts. algo: the algorithm to run, or NULL to ask cuBLASLt's heuristic
// for one (returned in *found; *no_algo when it has none or does not know the attributes).
static di_status lt_try(di_cuda *cu, bool swapped, const di_tensor *w, const float *w_scales,
                        const uint8_t *codes, const float *x_scales, int64_t T, float *d,
                        int64_t ldd, void *ws, const cublasLtMatmulAlgo_t *algo,
                        cublasLtMatmulAlgo_t *found, bool *no_algo) {
    const int64_t K = w->ne[0], N_out = w->ne[1];
    const cublasLtHandle_t lt = (cublasLtHandle_t)cu->cublaslt;
    cublasLtMatmulDesc_t op = NULL;
    cublasLtMatrixLayout_t la = NULL, lb = NULL, ld = NULL;
    cublasLtMatmulPreference_t pref = NULL;
    cublasLtMatmulHeuristicResult_t heur;
    int n_res = 0;
    di_status st = DI_ERR_CUDA;
    const cublasOperation_t ta = CUBLAS_OP_T, tb = CUBLAS_OP_N;
    const cublasLtMatmulMatrixScale_t blk = CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F;
    const cublasLtMatmulMatrixScale_t vec = CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F;
    const void *a = swapped ? (const void *)codes : w->data;
    const void *b = swapped ? w->data : (const void *)codes;
    const void *sa = swapped ? (const void *)x_scales : (const void *)w_scales;
    const void *sb = swapped ? (const void *)w_scales : (const void *)x_scales;
    const int64_t M = swapped ? T : N_out, N = swapped ? N_out : T;
    const float alpha = 1.0f, beta = 0.0f;
    const size_t wsb = k_ws_bytes;
    *no_algo = false;
    if (cublasLtMatmulDescCreate(&op, CUBLAS_COMPUTE_32F, CUDA_R_32F) != CUBLAS_STATUS_SUCCESS)
        goto out;
    if (cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof ta) ||
        cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof tb) ||
        cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_A_SCALE_MODE, swapped ? &vec : &blk,
                                       sizeof blk) ||
        cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_B_SCALE_MODE, swapped ? &blk : &vec,
                                       sizeof vec) ||
        cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &sa, sizeof sa) ||
        cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &sb, sizeof sb)) {
        *no_algo = true; // this cuBLASLt does not know the attributes
        st = DI_ERR_UNSUPPORTED;
        goto out;
    }
    // Both operands stored K-major (rows of K bytes): K x M and K x N column-major.
    if (cublasLtMatrixLayoutCreate(&la, CUDA_R_8F_E4M3, (uint64_t)K, (uint64_t)M, K) ||
        cublasLtMatrixLayoutCreate(&lb, CUDA_R_8F_E4M3, (uint64_t)K, (uint64_t)N, K) ||
        cublasLtMatrixLayoutCreate(&ld, CUDA_R_32F, (uint64_t)M, (uint64_t)N, ldd))
        goto out;
    if (!algo) {
        if (cublasLtMatmulPreferenceCreate(&pref) ||
            cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                                 &wsb, sizeof wsb))
            goto out;
        if (cublasLtMatmulAlgoGetHeuristic(lt, op, la, lb, ld, ld, pref, 1, &heur, &n_res) !=
                CUBLAS_STATUS_SUCCESS ||
            n_res == 0) {
            *no_algo = true;
            st = DI_ERR_UNSUPPORTED;
            goto out;
        }
        *found = heur.algo;
        algo = &heur.algo;
    }
    if (cublasLtMatmul(lt, op, &alpha, a, la, b, lb, &beta, d, ld, d, ld, algo, ws, wsb,
                       di_stream(cu)) != CUBLAS_STATUS_SUCCESS) {
        DI_CUDA_LOG_ERROR("cublasLtMatmul (FP8 block-scaled, %s) failed",
                          swapped ? "swapped" : "natural");
        goto out;
    }
    st = DI_OK;
out:
    if (pref) cublasLtMatmulPreferenceDestroy(pref);
    if (ld) cublasLtMatrixLayoutDestroy(ld);
    if (lb) cublasLtMatrixLayoutDestroy(lb);
    if (la) cublasLtMatrixLayoutDestroy(la);
    if (op) cublasLtMatmulDescDestroy(op);
    return st;
}

// The product with both operands' scales in cuBLASLt's layouts: the shape's cached plan (or the
// natural formulation, then the swapped one, remembered for the shape), then the result into y.
// *plan_hit: the shape's plan was cached. DI_ERR_UNSUPPORTED: no algorithm for this shape.
static di_status lt_run(di_cuda *cu, const di_tensor *w, const float *ws_lt, const uint8_t *codes,
                        const float *xs_lt, int64_t n_tok, float *y, int64_t y_stride,
                        bool *plan_hit) {
    const int64_t K = w->ne[0], n_out = w->ne[1];
    // Leading dimensions padded to 4 floats (16 bytes), which cuBLASLt's kernels want.
    const int64_t ld_n = (n_out + 3) / 4 * 4, ld_t = (n_tok + 3) / 4 * 4;
    // Natural formulation straight into y: only where y is as aligned as the heuristic assumes of
    // every pointer (CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, default 256; the cached plans were
    // chosen under it). A y inside a larger buffer goes through the (pool-aligned) padded buffer.
    const bool direct = y_stride == ld_n && ((uintptr_t)y & 255) == 0;
    const uint64_t h =
        mix64((uint64_t)K * 0x9e3779b97f4a7c15ull ^ mix64((uint64_t)n_out * 31 + (uint64_t)n_tok));
    lt_plan *pl = &cu->lt_cache->plans[h % LT_PLANS];
    const bool hit = pl->kind != LT_EMPTY && pl->K == K && pl->n_out == n_out && pl->T == n_tok;
    *plan_hit = hit;
    if (hit && pl->kind == LT_NONE) return DI_ERR_UNSUPPORTED;
    di_status st;
    void *ws = NULL, *tmp = NULL;
    bool no_algo = false, swapped = hit && pl->kind == LT_SWAPPED;
    cublasLtMatmulAlgo_t found;
    const size_t tmp_bytes =
        sizeof(float) * (size_t)(ld_n * n_tok > ld_t * n_out ? ld_n * n_tok : ld_t * n_out);
    DI_TRY(di_cuda_alloc(cu, k_ws_bytes, &ws));
    DI_TRY(di_cuda_alloc(cu, tmp_bytes, &tmp));
    st = lt_try(cu, swapped, w, ws_lt, codes, xs_lt, n_tok, !swapped && direct ? y : (float *)tmp,
                swapped ? ld_t : ld_n, ws, hit ? &pl->algo : NULL, &found, &no_algo);
    if (!hit && st != DI_OK && no_algo) {
        swapped = true;
        st = lt_try(cu, true, w, ws_lt, codes, xs_lt, n_tok, (float *)tmp, ld_t, ws, NULL, &found,
                    &no_algo);
    }
    if (!hit && (st == DI_OK || no_algo)) { // remember what this shape has
        pl->K = K, pl->n_out = n_out, pl->T = n_tok;
        pl->kind = st != DI_OK ? LT_NONE : swapped ? LT_SWAPPED : LT_NATURAL;
        if (st == DI_OK) pl->algo = found;
    }
    if (st != DI_OK) goto fail;
    if (swapped || !direct) {
        scatter_kernel<<<di_div_up(n_out * n_tok, 256), 256, 0, di_stream(cu)>>>(
            (const float *)tmp, n_out, n_tok, swapped ? ld_t : 1, swapped ? 1 : ld_n, y, y_stride);
        st = di_cuda_check_launch("scatter_kernel");
    }
fail:
    di_cuda_free(cu, tmp);
    di_cuda_free(cu, ws);
    return st;
}

extern "C" di_status di_cuda_matmul_fp8_lt(di_cuda *cu, const di_tensor *w, const float *w_scales,
                                           const uint8_t *codes, const float *x_scales,
                                           int64_t n_tok, float *y, int64_t y_stride) {
    if (w->kind != DI_TENSOR_KIND_FP8 || w->block_in != 128 || w->block_out != 128 ||
        w->row0 != 0 || w->ne[0] % 128 != 0 || w->nb1 != (size_t)w->ne[0])
        return DI_ERR_INVALID;
    if (n_tok <= 0) return DI_OK;
    const int64_t n_out = w->ne[1];
    const int64_t nkb = w->ne[0] / 128, n_ob = (n_out + 127) / 128, ldk = (nkb + 3) / 4 * 4;
    const int64_t n_sc = std::max<int64_t>(n_tok * nkb, n_ob * ldk);
    di_status st;
    void *xs_lt = NULL, *ws_lt = NULL;
    bool hit;
    DI_TRY(di_cuda_alloc(cu, sizeof(float) * (size_t)(n_tok * nkb), &xs_lt));
    DI_TRY(di_cuda_alloc(cu, sizeof(float) * (size_t)(n_ob * ldk), &ws_lt));
    lt_scales_kernel<<<di_div_up(n_sc, 256), 256, 0, di_stream(cu)>>>(
        x_scales, n_tok, w_scales, n_ob, nkb, ldk, (float *)xs_lt, (float *)ws_lt);
    DI_TRY(di_cuda_check_launch("lt_scales_kernel"));
    st = lt_run(cu, w, (const float *)ws_lt, codes, (const float *)xs_lt, n_tok, y, y_stride, &hit);
fail:
    di_cuda_free(cu, ws_lt);
    di_cuda_free(cu, xs_lt);
    return st;
}

// ---- matmul_a8: A8 then the FP8 product, on tensor cores for prefill ----

// Takes (and so clears) a pending non-sticky CUDA error, e.g. a launch error of cuBLASLt's
// kernels, which the next launcher's di_cuda_check_launch would otherwise report as its own.
static const char *last_error_str(void) {
    const cudaError_t e = cudaGetLastError();
    return e == cudaSuccess ? "a cuBLASLt status" : cudaGetErrorString(e);
}

// Whether w at n_tok rows may take the tensor-core path (gemm.cuh di_cuda_matmul_a8).
static bool tc_eligible(const di_cuda *cu, const di_tensor *w, int64_t n_tok) {
    return cu->fp8_tc >= 0 && !cu->capturing && n_tok >= DI_BACKEND_TC_MIN_ROWS &&
           cu->cc_major >= 9 && w->kind == DI_TENSOR_KIND_FP8 && w->block_in == 128 &&
           w->block_out == 128 && w->row0 == 0 && w->ne[0] % 128 == 0 && w->nb1 == (size_t)w->ne[0];
}

// A8(x) into aq, then the SIMT product (the CPU backend's two entries).
static di_status simt_a8(di_cuda *cu, const di_tensor *w, const float *x, int64_t n_tok,
                         int64_t x_stride, float *aq, float *y, int64_t y_stride) {
    di_status st = di_cuda_fake_quant(cu, x, n_tok, w->ne[0], x_stride, 128, 8, aq);
    return st == DI_OK ? di_cuda_matmul(cu, w, aq, n_tok, x_stride, y, y_stride) : st;
}

// A8(x) (codes, and scales in cuBLASLt's layout), then cuBLASLt with the scales the weight got at
// upload (di_cuda_lt_weight_uploaded); a weight that was not uploaded (tests and benchmarks that
// build device tensors by hand) has its scales converted for this call.
static di_status tc_a8(di_cuda *cu, const di_tensor *w, const float *x, int64_t n_tok,
                       int64_t x_stride, float *y, int64_t y_stride) {
    const int64_t K = w->ne[0], nkb = K / 128, n_ob = (w->ne[1] + 127) / 128;
    const lt_weight *cw = weight_find(cu->lt_cache, w);
    void *codes = NULL, *xsc = NULL, *wsc = NULL;
    bool hit = false;
    di_status st;
    DI_TRY(di_cuda_alloc(cu, (size_t)(n_tok * K), &codes));
    DI_TRY(di_cuda_alloc(cu, sizeof(float) * (size_t)(n_tok * nkb), &xsc));
    if (cw) {
        DI_TRY(act_quant(cu, x, n_tok, x_stride, K, (uint8_t *)codes, (float *)xsc, true));
        DI_TRY(lt_run(cu, w, cw->scales, (const uint8_t *)codes, (const float *)xsc, n_tok, y,
                      y_stride, &hit));
        if (hit) cu->n_fp8_tc_cached++;
    } else {
        DI_TRY(di_cuda_alloc(cu, sizeof(float) * (size_t)(n_ob * nkb), &wsc));
        DI_TRY(act_quant(cu, x, n_tok, x_stride, K, (uint8_t *)codes, (float *)xsc, false));
        DI_TRY(di_cuda_fp8_scales_f32(cu, w, (float *)wsc));
        DI_TRY(di_cuda_matmul_fp8_lt(cu, w, (const float *)wsc, (const uint8_t *)codes,
                                     (const float *)xsc, n_tok, y, y_stride));
    }
fail:
    di_cuda_free(cu, wsc);
    di_cuda_free(cu, xsc);
    di_cuda_free(cu, codes);
    return st;
}

// The first eligible call: both paths, compared on the host; y gets the SIMT result unless the
// tensor cores agree.
static di_status tc_check(di_cuda *cu, const di_tensor *w, const float *x, int64_t n_tok,
                          int64_t x_stride, float *aq, float *y, int64_t y_stride) {
    const int64_t N = w->ne[1], n = n_tok * N;
    void *ref = NULL;
    float *h_tc = NULL, *h_ref = NULL;
    di_status st;
    DI_TRY(di_cuda_alloc(cu, sizeof(float) * (size_t)n, &ref));
    DI_TRY(simt_a8(cu, w, x, n_tok, x_stride, aq, (float *)ref, N));
    st = tc_a8(cu, w, x, n_tok, x_stride, y, y_stride);
    if (st == DI_ERR_UNSUPPORTED) {
        di_log_write(2, __FILE__, __LINE__,
                     "cuda: no cuBLASLt FP8 block-scaled algorithm on this GPU: A8 matmuls stay on "
                     "the SIMT kernels");
        cu->fp8_tc = -1;
    } else if (st == DI_ERR_NOMEM) {
        goto fail;
    } else if (st != DI_OK) {
        // cuBLASLt refused the call at run time (a status, or a launch error of its kernels): the
        // SIMT result in ref stands and the tensor-core path is off for the context. A fault
        // inside a kernel is sticky and fails the copy below (and the next sync) anyway.
        DI_CUDA_LOG_WARN("cuda: FP8 tensor-core A8 matmul failed on its first call (%s): A8 "
                         "matmuls stay on the SIMT kernels",
                         last_error_str());
        cu->fp8_tc = -1;
    } else {
        h_tc = (float *)malloc(sizeof(float) * (size_t)n);
        h_ref = (float *)malloc(sizeof(float) * (size_t)n);
        if (!h_tc || !h_ref) {
            st = DI_ERR_NOMEM;
            goto fail;
        }
        CUDA_TRY(cudaMemcpy2DAsync(h_tc, sizeof(float) * (size_t)N, y,
                                   sizeof(float) * (size_t)y_stride, sizeof(float) * (size_t)N,
                                   (size_t)n_tok, cudaMemcpyDeviceToHost, di_stream(cu)));
        DI_TRY(di_cuda_download(cu, h_ref, ref, sizeof(float) * (size_t)n)); // synchronises
        double amax, dmax;
        const bool ok = di_cuda_close(h_tc, h_ref, (size_t)n, 1e-2, &amax, &dmax);
        cu->fp8_tc = ok ? 1 : -1;
        di_log_write(
            ok ? 2 : 1, __FILE__, __LINE__,
            "cuda: FP8 tensor cores (cuBLASLt block-scaled) vs the SIMT kernels on the first "
            "A8 matmul (%s, %lld x %lld x %lld): max |diff| %.3g of max |y| %.3g: %s",
            w->name ? w->name : "?", (long long)n_tok, (long long)N, (long long)w->ne[0], dmax,
            amax, ok ? "used from now on" : "MISMATCH, the SIMT kernels stay");
        if (ok) cu->n_fp8_tc_calls++;
    }
    if (cu->fp8_tc < 0)
        CUDA_TRY(cudaMemcpy2DAsync(y, sizeof(float) * (size_t)y_stride, ref,
                                   sizeof(float) * (size_t)N, sizeof(float) * (size_t)N,
                                   (size_t)n_tok, cudaMemcpyDeviceToDevice, di_stream(cu)));
    st = DI_OK;
fail:
    free(h_ref);
    free(h_tc);
    di_cuda_free(cu, ref);
    return st;
}

extern "C" di_status di_cuda_matmul_a8(di_cuda *cu, const di_tensor *w, const float *x,
                                       int64_t n_tok, int64_t x_stride, float *aq, float *y,
                                       int64_t y_stride) {
    if (n_tok <= 0) return DI_OK;
    if (!tc_eligible(cu, w, n_tok)) return simt_a8(cu, w, x, n_tok, x_stride, aq, y, y_stride);
    if (cu->fp8_tc == 0) return tc_check(cu, w, x, n_tok, x_stride, aq, y, y_stride);
    di_status st = tc_a8(cu, w, x, n_tok, x_stride, y, y_stride);
    if (st == DI_ERR_UNSUPPORTED) { // no algorithm for this shape: this call on the SIMT path
        return simt_a8(cu, w, x, n_tok, x_stride, aq, y, y_stride);
    }
    if (st != DI_OK && st != DI_ERR_NOMEM) {
        // A run-time refusal of cuBLASLt for this shape (see tc_check): this call and every later
        // one on the SIMT path, which rewrites all of y.
        DI_CUDA_LOG_WARN("cuda: FP8 tensor-core A8 matmul (%s, %lld rows) failed (%s): A8 matmuls "
                         "stay on the SIMT kernels",
                         w->name ? w->name : "?", (long long)n_tok, last_error_str());
        cu->fp8_tc = -1;
        return simt_a8(cu, w, x, n_tok, x_stride, aq, y, y_stride);
    }
    if (st == DI_OK) cu->n_fp8_tc_calls++;
    return st;
}
