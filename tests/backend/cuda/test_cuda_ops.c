// The CUDA backend's vtable (backend/backend.h, backend/cuda/cuda_ops.cu) op by op against CPU
// oracles on the same inputs: plain reference loops here for the ops that are new with the
// vtable (embed, scatter_rows, add_ape, scale, compress_pool, attn over FP32 rows, offset_list,
// contiguous and through a page table; index_scores paged against its contiguous scores) and the
// existing CPU functions for the rest (di_ref_matmul, di_ref_rmsnorm, di_ref_rope,
// di_dsv4_hc_coeffs, di_dsv4_topk). Every launch goes through b->vt, every output is poisoned
// with NaN (0xFF bytes) first, and the edge shapes are in: 1 row, sizes that are not multiples of
// any tile, strided rows, masked keys, 0 keys, the compressor's no-row overlap slots and ring
// sources, rows past n not written, another thread calling the backend; graphs (graph_begin /
// end / launch): a replay equals the same entries run directly for new data in the same buffers,
// the padding of graph-stable lists (scatter destination -1, windows without rows), the calls a
// capture refuses, and pool blocks taken inside a capture kept out of later allocations; V4.1's
// entries (mhc_pre_carried, engram_gate, index_cand, Q4e; index_cand on more than 65,535 rows).
// The kernels behind the
// older entries have their own tests (test_cuda_gemm, _norm, _mhc, _moe, _indexer); here the
// point is that each entry passes its arguments through as backend.h says.
#include "backend/cuda/attn.cuh"    // di_cuda_attn_bf16
#include "backend/cuda/cuda_test.h" // harness, rnd, check_bounds (its g_cu is the backend's context)

#include <pthread.h>
#include <stdint.h>

#include "backend/backend.h"
#include "backend/cpu/ref_ops.h"
#include "base/thread.h"
#include "model/dsv4.h" // di_dsv4_hc_coeffs, di_dsv4_topk
#include "tensor/quant_ref.h"

#define U32 5.96e-8 // FP32 unit roundoff 2^-24

// matmul: both sides sum n_in products in some order, each within gamma(n_in) * sum|w x| of the
// exact value: their difference within twice that.
#define TOL_MATMUL_GAMMAS 2.0
// RMSNorm: sums of squares in another order (gamma(n) relative, positive terms), then a few
// roundings per element (test_cuda_norm.c).
#define TOL_NORM(n) (gamma_k((double)(n)) + 8 * U32)
// RoPE: cosf/sinf within 2 ulp on the GPU, then one product and one sum: 8u of the pair's
// magnitude times scale (test_cuda_norm.c).
#define TOL_ROPE_ULPS 8.0
// mHC: test_cuda_mhc.c's bound (RMS factor from a sum in another order, amplified by the gates).
#define TOL_MHC_REL 1e-4
#define TOL_MHC_ABS 1e-6
// MoE layer: three chained FP32 GEMMs per expert and a weighted sum over K+1 experts in another
// order (test_cuda_moe.c): 1e-4 of the row's RMS; a wrong expert or weight moves O(1) of it.
#define TOL_MOE_ROW_RMS 1e-4
// The official recipe's MoE rounds to BF16 and quantises to e4m3 (A8) in between: a value whose
// FP32 sum differs in the last bits from the host's may round the other way, one BF16 ulp (2^-8
// relative) or one e4m3 step (2^-3 relative) of one element, which moves a row of the next matmul
// by about 2^-3 / sqrt(F) of its RMS. The bound allows a few such flips per row; a wrong order
// (the weight on the output instead of h, a missing A8) moves every element by far more. The
// rounding points themselves are exact (test_official_ops).
#define TOL_MOE_OFF_ROW_RMS 5e-2
// Compressor pooling: the same operations in the same slot order on both sides; expf differs by
// up to 2 ulp per slot and the GPU may fuse p * c into num: each p moves by <= 3u, num and den
// by <= (3u + gamma(n_slots)) of their sums of |terms|, so entry by <= 2 (3u + gamma(n)) of
// sum_j p_j |c_j| / den, plus the division (u |entry|). Doubled for margin.
#define TOL_POOL(n) (4.0 * (3 * U32 + gamma_k((double)(n))))
// Attention over FP32 rows: scores within gamma(dh) * scale * sum|q k| (bound E); each p moves by
// <= e^{2E} - 1 ~ 2E relative and o_d by sum_j p_j |k_jd| times that plus the value sums' FP32
// rounding (1e-5 relative: n_keys <~ 1000), as test_cuda_attn.c.
#define TOL_ATTN_SUM_REL 1e-5
// Indexer scores: gamma(DI) per head dot, then a sum of HI weighted terms (test_cuda_indexer.c).
#define TOL_SCORE_FACTOR 2.0

static di_backend *g_b;
static di_pool *g_pool;
static di_cpu g_cpu;

// ---- backend buffers (through the vtable) ----

static void *bk_alloc(size_t bytes) {
    void *p = NULL;
    CK(g_b->vt->alloc(g_b, bytes, &p));
    return p;
}
static void *bk_from(const void *host, size_t bytes) {
    void *p = bk_alloc(bytes);
    CK(g_b->vt->upload(g_b, p, host, bytes));
    return p;
}
static void bk_poison(void *p, size_t bytes) { // every float NaN, every int32 -1
    CK(g_b->vt->memset(g_b, p, 0xFF, bytes));
}
static void bk_to(void *host, const void *p, size_t bytes) {
    CK(g_b->vt->sync(g_b)); // a kernel fault surfaces here as DI_ERR_CUDA
    CK(g_b->vt->download(g_b, host, p, bytes));
}
static void bk_free(void *p) {
    g_b->vt->free(g_b, p);
}

// Elements whose bits differ (NaN equal to NaN): exact ops.
static int64_t n_diff_f32(const float *a, const float *b, int64_t n) {
    int64_t bad = 0;
    for (int64_t i = 0; i < n; i++)
        bad += !(isnan(a[i]) && isnan(b[i])) && memcmp(&a[i], &b[i], sizeof(float)) != 0;
    return bad;
}

// ---- host weights of every kind ----

typedef struct mat {
    di_tensor t;
    uint8_t *data, *scale; // owned
} mat;

static uint16_t f16_bits(float x) {
    return di_f32_to_f16(x);
}

static void put_f16(uint8_t *p, float x) {
    const uint16_t h = f16_bits(x);
    memcpy(p, &h, 2);
}

// Random weights [n_out, n_in] of `kind` with magnitudes ~1/sqrt(n_in) (float kinds, FP8, FP4) or
// whatever random codes give (ggml kinds: embeddings only). NaN-free.
static mat make_w(di_tensor_kind kind, int64_t n_in, int64_t n_out) {
    mat m = {0};
    di_tensor *t = &m.t;
    t->name = "w";
    t->kind = kind;
    t->ne[0] = n_in, t->ne[1] = n_out;
    const float amp = 1.0f / sqrtf((float)n_in);
    int64_t blk_elems = 0;
    size_t blk_bytes = 0;
    switch (kind) {
    case DI_TENSOR_KIND_F32:
    case DI_TENSOR_KIND_F16:
    case DI_TENSOR_KIND_BF16: {
        const size_t es = kind == DI_TENSOR_KIND_F32 ? 4 : 2;
        t->nb1 = es * (size_t)n_in;
        m.data = malloc(t->nb1 * (size_t)n_out);
        for (int64_t i = 0; i < n_in * n_out; i++) {
            const float v = rndf() * amp;
            if (kind == DI_TENSOR_KIND_F32) {
                memcpy(m.data + 4 * i, &v, 4);
            } else {
                const uint16_t h = kind == DI_TENSOR_KIND_F16 ? f16_bits(v) : di_f32_to_bf16(v);
                memcpy(m.data + 2 * i, &h, 2);
            }
        }
        break;
    }
    case DI_TENSOR_KIND_FP8:
    case DI_TENSOR_KIND_FP4: {
        const bool fp8 = kind == DI_TENSOR_KIND_FP8;
        t->nb1 = fp8 ? (size_t)n_in : (size_t)n_in / 2;
        t->block_out = fp8 ? 128 : 1, t->block_in = fp8 ? 128 : 32;
        m.data = malloc(t->nb1 * (size_t)n_out);
        for (size_t i = 0; i < t->nb1 * (size_t)n_out; i++) {
            uint8_t c = (uint8_t)rnd();
            if (fp8 && (c & 0x7F) == 0x7F) c ^= 1; // no NaN codes
            m.data[i] = c;
        }
        const int64_t sr = (n_out + t->block_out - 1) / t->block_out,
                      sc = (n_in + t->block_in - 1) / t->block_in;
        t->scale_nb1 = (size_t)sc;
        m.scale = malloc((size_t)(sr * sc));
        // Codes up to 448 (FP8) or 6 (FP4): scales bring weights to ~1/sqrt(n_in).
        const int base = (fp8 ? 127 - 9 : 127 - 3) - (int)log2f(sqrtf((float)n_in));
        for (int64_t i = 0; i < sr * sc; i++) m.scale[i] = (uint8_t)(base + (int)(rnd() % 2));
        t->scale = m.scale;
        break;
    }
    default: { // ggml block kinds: random bytes, finite f16 block scales
        di_tensor_kind_block(kind, &blk_elems, &blk_bytes);
        const int64_t nb = n_in / blk_elems;
        t->nb1 = (size_t)nb * blk_bytes;
        m.data = malloc(t->nb1 * (size_t)n_out);
        for (size_t i = 0; i < t->nb1 * (size_t)n_out; i++) m.data[i] = (uint8_t)rnd();
        for (int64_t r = 0; r < n_out; r++)
            for (int64_t b = 0; b < nb; b++) {
                uint8_t *blk = m.data + (size_t)r * t->nb1 + (size_t)b * blk_bytes;
                if (kind == DI_TENSOR_KIND_Q8_0 || kind == DI_TENSOR_KIND_IQ2_XXS) {
                    put_f16(blk, rndf() * 0.01f);
                } else if (kind == DI_TENSOR_KIND_Q4_K) {
                    put_f16(blk, rndf() * 0.01f);
                    put_f16(blk + 2, rndf() * 0.01f);
                } else if (kind == DI_TENSOR_KIND_Q2_K) {
                    put_f16(blk + 80, rndf() * 0.01f);
                    put_f16(blk + 82, rndf() * 0.01f);
                } else if (kind == DI_TENSOR_KIND_MXFP4) {
                    blk[0] = (uint8_t)(118 + rnd() % 12); // 2^-10 .. 2^1
                }
            }
        break;
    }
    }
    t->data = m.data;
    return m;
}

static void free_w(mat *m) {
    free(m->data), free(m->scale);
}

// ---- memory, copies, the vtable itself ----

static void test_vtable(void) {
    const di_backend_vt *vt = g_b->vt;
    CHECK_STR_EQ(vt->name, "cuda");
    CHECK(strncmp(g_b->desc, "cuda:0, ", 8) == 0);
    CHECK(g_b->device.kind == DI_DEVICE_CUDA && g_b->device.index == 0);
    // Every entry is set (a NULL would crash the forward, not fail a test).
#define NULL_ENTRY(e) (vt->e == NULL)
    const int n_null =
        NULL_ENTRY(alloc) + NULL_ENTRY(free) + NULL_ENTRY(upload) + NULL_ENTRY(download) +
        NULL_ENTRY(memset) + NULL_ENTRY(copy) + NULL_ENTRY(sync) + NULL_ENTRY(weight_upload) +
        NULL_ENTRY(host_alloc) + NULL_ENTRY(host_free) + NULL_ENTRY(supports_matmul) +
        NULL_ENTRY(matmul) + NULL_ENTRY(matmul_a8) + NULL_ENTRY(embed) + NULL_ENTRY(rmsnorm) +
        NULL_ENTRY(rope) + NULL_ENTRY(scale) + NULL_ENTRY(mhc_pre) + NULL_ENTRY(mhc_post) +
        NULL_ENTRY(moe) + NULL_ENTRY(scatter_rows) + NULL_ENTRY(add_ape) +
        NULL_ENTRY(compress_pool) + NULL_ENTRY(attn) + NULL_ENTRY(kv_quant) + NULL_ENTRY(attn_kv) +
        NULL_ENTRY(index_scores) + NULL_ENTRY(topk) + NULL_ENTRY(offset_list) +
        NULL_ENTRY(destroy) + NULL_ENTRY(graph_begin) + NULL_ENTRY(graph_end) +
        NULL_ENTRY(graph_launch) + NULL_ENTRY(graph_destroy) + NULL_ENTRY(round_bf16) +
        NULL_ENTRY(fake_quant) + NULL_ENTRY(hadamard) + NULL_ENTRY(mhc_pre_carried) +
        NULL_ENTRY(engram_gate) + NULL_ENTRY(index_cand) + NULL_ENTRY(argmax_rows);
#undef NULL_ENTRY
    CHECK_EQ(n_null, 0);
    // A device that does not exist is refused, not crashed on.
    di_backend *none = NULL;
    CHECK_EQ(di_cuda_backend_create(di_cuda_device_count(), &none), DI_ERR_UNSUPPORTED);
    CHECK(none == NULL);
}

static void test_memory(void) {
    static const size_t sizes[] = {1, 1000, 4096, (size_t)3 << 20};
    for (size_t s = 0; s < sizeof sizes / sizeof sizes[0]; s++) {
        const size_t n = sizes[s];
        uint8_t *h = malloc(n), *back = malloc(n);
        for (size_t i = 0; i < n; i++) h[i] = (uint8_t)rnd();
        uint8_t *a = bk_alloc(n), *b = bk_alloc(n);
        CHECK((uintptr_t)a % 256 == 0 && (uintptr_t)b % 256 == 0);
        CK(g_b->vt->upload(g_b, a, h, n));
        bk_poison(b, n);
        CK(g_b->vt->copy(g_b, b, a, n));
        bk_to(back, b, n);
        CHECK(memcmp(back, h, n) == 0);
        CK(g_b->vt->memset(g_b, b, 0x5A, n / 2));
        bk_to(back, b, n);
        int64_t bad = 0;
        for (size_t i = 0; i < n; i++) bad += back[i] != (i < n / 2 ? 0x5A : h[i]);
        CHECK_EQ(bad, 0);
        // Zero bytes: no-ops.
        CK(g_b->vt->copy(g_b, b, a, 0));
        CK(g_b->vt->upload(g_b, b, h, 0));
        CK(g_b->vt->download(g_b, back, b, 0));
        CK(g_b->vt->memset(g_b, b, 0, 0));
        bk_free(a), bk_free(b);
        free(h), free(back);
    }
    void *z = bk_alloc(0); // a zero-byte block is still a valid, distinct block
    CHECK(z != NULL);
    bk_free(z);
    // host_alloc (page-locked): a round trip through it, then refused inside a capture.
    {
        const size_t n = (size_t)5 << 20;
        uint8_t *ph = NULL, *pb = NULL, *d = bk_alloc(n);
        CK(g_b->vt->host_alloc(g_b, n, (void **)&ph));
        CK(g_b->vt->host_alloc(g_b, n, (void **)&pb));
        for (size_t i = 0; i < n; i++) ph[i] = (uint8_t)(i * 7 + 1);
        CK(g_b->vt->upload(g_b, d, ph, n));
        CK(g_b->vt->download(g_b, pb, d, n));
        CHECK(memcmp(ph, pb, n) == 0);
        g_b->vt->host_free(g_b, ph);
        g_b->vt->host_free(g_b, pb);
        g_b->vt->host_free(g_b, NULL);
        bk_free(d);
        void *g = NULL, *h2 = NULL;
        CK(g_b->vt->graph_begin(g_b));
        CHECK_EQ(g_b->vt->host_alloc(g_b, 64, &h2), DI_ERR_INVALID);
        CHECK_EQ(g_b->vt->graph_end(g_b, &g), DI_ERR_INVALID);
        CHECK(h2 == NULL && g == NULL);
        // host_free is refused there too (as on the CPU twin; cudaFreeHost synchronises): the
        // capture fails and the memory stays valid (freed after it).
        CK(g_b->vt->host_alloc(g_b, 64, &h2));
        CK(g_b->vt->graph_begin(g_b));
        g_b->vt->host_free(g_b, h2);
        CHECK_EQ(g_b->vt->graph_end(g_b, &g), DI_ERR_INVALID);
        CHECK(g == NULL);
        memset(h2, 0x5A, 64); // still ours
        CHECK(((uint8_t *)h2)[63] == 0x5A);
        g_b->vt->host_free(g_b, h2);
        CHECK_EQ(di_cuda_check_launch("nothing after host_free"), DI_OK);
    }
    g_b->vt->free(g_b, NULL);
    CK(g_b->vt->sync(g_b));
}

// ---- matmul ----

// a8: matmul_a8 (backend.h), the reference on A8(x) (Q8 per 128 values, host); at
// >= DI_BACKEND_TC_MIN_ROWS rows an FP8 weight of 128x128 blocks takes the tensor cores on sm_90+
// (checked: the context's counter moves), whose FP8 products are exact like ours but whose
// accumulation may round partial sums to ~14 bits (DeepSeek-V3 report, §3.3.2, on H800): the bound
// there is test_cuda_gemm's for cuBLASLt, 2^-11 of sum |w x|, when that is larger than the FP32
// one.
static void matmul_case(di_tensor_kind kind, int64_t n_in, int64_t n_out, int64_t n_tok,
                        int64_t view0, bool a8) {
    mat m = make_w(kind, n_in, n_out + view0);
    di_tensor w = di_tensor_rows(&m.t, view0, n_out); // a row view inside the scale grid
    CHECK(g_b->vt->supports_matmul(g_b, &w));
    di_tensor wd;
    CK(g_b->vt->weight_upload(g_b, &w, &wd));
    const int64_t xs = n_in + 3, ys = n_out + 5;
    float *x = malloc(sizeof(float) * (size_t)(n_tok * xs)),
          *xq = malloc(sizeof(float) * (size_t)(n_tok * xs)),
          *ref = malloc(sizeof(float) * (size_t)(n_tok * ys)),
          *out = malloc(sizeof(float) * (size_t)(n_tok * ys));
    double *tol = malloc(sizeof(double) * (size_t)(n_tok * ys));
    fill_rand(x, n_tok * xs, 1.0f);
    memcpy(xq, x, sizeof(float) * (size_t)(n_tok * xs));
    if (a8)
        for (int64_t t = 0; t < n_tok; t++) di_fake_quant_q8(xq + t * xs, n_in, 128);
    const bool tc = a8 && kind == DI_TENSOR_KIND_FP8 && view0 == 0 &&
                    n_tok >= DI_BACKEND_TC_MIN_ROWS && g_cu->cc_major >= 9;
    for (int64_t i = 0; i < n_tok * ys; i++) ref[i] = NAN, tol[i] = 0; // gaps stay poisoned
    di_ref_matmul(&g_cpu, &w, xq, n_tok, xs, ref, ys);
    float *row = malloc(sizeof(float) * (size_t)n_in);
    for (int64_t o = 0; o < n_out; o++) {
        di_tensor_row_f32(&w, o, row);
        for (int64_t t = 0; t < n_tok; t++) {
            double a = 0;
            for (int64_t i = 0; i < n_in; i++) a += fabs((double)row[i] * xq[t * xs + i]);
            double bound = TOL_MATMUL_GAMMAS * gamma_k((double)n_in) * a;
            if (tc && a * 0x1p-11 > bound) bound = a * 0x1p-11;
            tol[t * ys + o] = bound + 1e-30;
        }
    }
    float *xd = bk_from(x, sizeof(float) * (size_t)(n_tok * xs)),
          *aq = bk_alloc(sizeof(float) * (size_t)(n_tok * xs)),
          *yd = bk_alloc(sizeof(float) * (size_t)(n_tok * ys));
    bk_poison(yd, sizeof(float) * (size_t)(n_tok * ys));
    const int64_t tc_calls = g_cu->n_fp8_tc_calls;
    if (a8)
        CK(g_b->vt->matmul_a8(g_b, &wd, xd, n_tok, xs, aq, yd, ys));
    else
        CK(g_b->vt->matmul(g_b, &wd, xd, n_tok, xs, yd, ys));
    bk_to(out, yd, sizeof(float) * (size_t)(n_tok * ys));
    char what[112];
    snprintf(what, sizeof what, "matmul%s %s %lldx%lld x %lld tok (view %lld)", a8 ? "_a8" : "",
             di_tensor_kind_name(kind), (long long)n_out, (long long)n_in, (long long)n_tok,
             (long long)view0);
    CHECK(check_bounds(what, out, ref, tol, n_tok * ys) == 0);
    // The tensor-core path ran (and passed its first-call check against the SIMT kernels).
    if (tc && g_cu->n_fp8_tc_calls == tc_calls)
        fprintf(stderr, "%s: the FP8 tensor-core path did not run (fp8_tc %d; see the log)\n", what,
                g_cu->fp8_tc);
    CHECK(g_cu->n_fp8_tc_calls == tc_calls + (tc ? 1 : 0));
    if (tc && g_cu->fp8_tc > 0) {
        // Again: the weight's upload-time scales and this shape's cuBLASLt plan are reused, and
        // the result is the same bits.
        const int64_t cached = g_cu->n_fp8_tc_cached;
        float *again = malloc(sizeof(float) * (size_t)(n_tok * ys));
        bk_poison(yd, sizeof(float) * (size_t)(n_tok * ys));
        CK(g_b->vt->matmul_a8(g_b, &wd, xd, n_tok, xs, aq, yd, ys));
        bk_to(again, yd, sizeof(float) * (size_t)(n_tok * ys));
        int64_t n_diff = 0;
        for (int64_t t = 0; t < n_tok; t++)
            n_diff += memcmp(again + t * ys, out + t * ys, sizeof(float) * (size_t)n_out) != 0;
        if (n_diff || g_cu->n_fp8_tc_cached != cached + 1)
            fprintf(stderr, "%s, cached plan: %lld rows differ, cached calls %lld -> %lld\n", what,
                    (long long)n_diff, (long long)cached, (long long)g_cu->n_fp8_tc_cached);
        CHECK(n_diff == 0);
        CHECK(g_cu->n_fp8_tc_cached == cached + 1);
        free(again);
    }
    bk_free(xd), bk_free(aq), bk_free(yd);
    free(x), free(xq), free(ref), free(out), free(tol), free(row);
    free_w(&m);
}

static void test_matmul(void) {
    matmul_case(DI_TENSOR_KIND_F32, 64, 1, 1, 0, false);
    matmul_case(DI_TENSOR_KIND_BF16, 200, 37, 3, 0, false);
    matmul_case(DI_TENSOR_KIND_F16, 96, 33, 9, 0, false); // > 8 tokens: the tiled kernel
    matmul_case(DI_TENSOR_KIND_FP8, 256, 70, 1, 130, false);
    matmul_case(DI_TENSOR_KIND_FP8, 384, 130, 17, 0, false);
    matmul_case(DI_TENSOR_KIND_FP4, 128, 65, 2, 3, false);
    // matmul_a8: decode rows (A8 + the SIMT kernels), FP4, a row view, then prefill rows of an FP8
    // weight (the tensor cores on sm_90+: the first call checks them, the second uses them).
    matmul_case(DI_TENSOR_KIND_FP8, 256, 70, 3, 0, true);
    matmul_case(DI_TENSOR_KIND_FP4, 128, 65, 2, 0, true);
    matmul_case(DI_TENSOR_KIND_FP8, 256, 70, DI_BACKEND_TC_MIN_ROWS, 130, true);
    matmul_case(DI_TENSOR_KIND_FP8, 384, 130, 200, 0, true);
    matmul_case(DI_TENSOR_KIND_FP8, 512, 256, DI_BACKEND_TC_MIN_ROWS, 0, true);
    // A kind the GPU does not multiply: reported unsupported and refused before any work.
    mat q = make_w(DI_TENSOR_KIND_Q8_0, 64, 4);
    CHECK(!g_b->vt->supports_matmul(g_b, &q.t));
    di_tensor qd;
    CK(g_b->vt->weight_upload(g_b, &q.t, &qd));
    float *xd = bk_alloc(sizeof(float) * 64), *yd = bk_alloc(sizeof(float) * 4);
    CHECK_EQ(g_b->vt->matmul(g_b, &qd, xd, 1, 64, yd, 4), DI_ERR_INVALID);
    CHECK_EQ(g_b->vt->matmul_a8(g_b, &qd, xd, 1, 64, yd, yd, 4), DI_ERR_INVALID);
    bk_free(xd), bk_free(yd);
    free_w(&q);
}

// ---- embed ----

static void embed_case(di_tensor_kind kind, int64_t D, int64_t V, int64_t view0, int32_t n,
                       int32_t copies) {
    mat m = make_w(kind, D, V + view0);
    di_tensor tab = di_tensor_rows(&m.t, view0, V);
    di_tensor td;
    CK(g_b->vt->weight_upload(g_b, &tab, &td));
    int32_t *ids = malloc(sizeof(int32_t) * (size_t)n);
    for (int32_t t = 0; t < n; t++) // first and last rows, repeats
        ids[t] = t == 0 ? (int32_t)(V - 1) : t == 1 ? 0 : (int32_t)(rnd() % (uint64_t)V);
    const int64_t nx = (int64_t)n * copies * D;
    float *ref = malloc(sizeof(float) * (size_t)nx), *out = malloc(sizeof(float) * (size_t)nx);
    for (int32_t t = 0; t < n; t++) {
        di_tensor_row_f32(&tab, ids[t], ref + (int64_t)t * copies * D);
        for (int32_t k = 1; k < copies; k++)
            memcpy(ref + ((int64_t)t * copies + k) * D, ref + (int64_t)t * copies * D,
                   sizeof(float) * (size_t)D);
    }
    int32_t *idd = bk_from(ids, sizeof(int32_t) * (size_t)n);
    float *xd = bk_alloc(sizeof(float) * (size_t)nx);
    bk_poison(xd, sizeof(float) * (size_t)nx);
    CK(g_b->vt->embed(g_b, &td, idd, n, copies, xd));
    bk_to(out, xd, sizeof(float) * (size_t)nx);
    const int64_t bad = n_diff_f32(out, ref, nx);
    int64_t n_nan = 0;
    for (int64_t i = 0; i < nx; i++) n_nan += isnan(out[i]);
    fprintf(stderr, "  embed %-8s D=%lld V=%lld view=%lld n=%d copies=%d: %lld differ, %lld NaN\n",
            di_tensor_kind_name(kind), (long long)D, (long long)V, (long long)view0, n, copies,
            (long long)bad, (long long)n_nan);
    CHECK(bad == 0);
    CHECK(n_nan == 0);
    bk_free(idd), bk_free(xd);
    free(ids), free(ref), free(out);
    free_w(&m);
}

static void test_embed(void) {
    embed_case(DI_TENSOR_KIND_F32, 300, 37, 0, 1, 1);
    embed_case(DI_TENSOR_KIND_F32, 257, 11, 0, 7, 4);
    embed_case(DI_TENSOR_KIND_F16, 300, 37, 0, 5, 4);
    embed_case(DI_TENSOR_KIND_BF16, 4096, 50, 0, 3, 4); // V4: D 4096, 4 mHC streams
    embed_case(DI_TENSOR_KIND_FP8, 300, 70, 130, 6, 2); // view inside the 128-row scale grid
    embed_case(DI_TENSOR_KIND_FP4, 96, 20, 0, 4, 1);
    embed_case(DI_TENSOR_KIND_Q8_0, 96, 20, 0, 9, 4);
    embed_case(DI_TENSOR_KIND_Q4_K, 512, 9, 0, 4, 2);
    embed_case(DI_TENSOR_KIND_Q2_K, 512, 9, 0, 4, 1);
    embed_case(DI_TENSOR_KIND_MXFP4, 64, 13, 0, 6, 3);
    // n 0: no-op; IQ2_XXS and copies 0: refused before any work.
    mat m = make_w(DI_TENSOR_KIND_F32, 8, 4);
    di_tensor td;
    CK(g_b->vt->weight_upload(g_b, &m.t, &td));
    int32_t *idd = bk_alloc(sizeof(int32_t));
    float *xd = bk_alloc(sizeof(float) * 8);
    CK(g_b->vt->embed(g_b, &td, idd, 0, 1, xd));
    CHECK_EQ(g_b->vt->embed(g_b, &td, idd, 1, 0, xd), DI_ERR_INVALID);
    mat iq = make_w(DI_TENSOR_KIND_IQ2_XXS, 256, 2);
    di_tensor iqd;
    CK(g_b->vt->weight_upload(g_b, &iq.t, &iqd));
    CHECK_EQ(g_b->vt->embed(g_b, &iqd, idd, 1, 1, xd), DI_ERR_INVALID);
    bk_free(idd), bk_free(xd);
    free_w(&m), free_w(&iq);
}

// ---- rmsnorm, rope, scale ----

static void test_rmsnorm(void) {
    static const int64_t shapes[][2] = {{1, 1}, {1, 7}, {3, 4096}, {5, 1000}};
    for (size_t s = 0; s < 4; s++)
        for (int weighted = 0; weighted < 2; weighted++) {
            const int64_t rows = shapes[s][0], n = shapes[s][1], stride = n + 3;
            const size_t b = sizeof(float) * (size_t)(rows * stride);
            float *x = malloc(b), *ref = malloc(b), *out = malloc(b),
                  *w = malloc(sizeof(float) * (size_t)n);
            double *tol = malloc(sizeof(double) * (size_t)(rows * stride));
            fill_rand(x, rows * stride, 3.0f);
            fill_rand(w, n, 2.0f);
            memcpy(ref, x, b);
            di_ref_rmsnorm(ref, rows, n, stride, weighted ? w : NULL, 1e-6f);
            for (int64_t i = 0; i < rows * stride; i++) tol[i] = fabs(ref[i]) * TOL_NORM(n);
            float *xd = bk_from(x, b), *wd = bk_from(w, sizeof(float) * (size_t)n);
            CK(g_b->vt->rmsnorm(g_b, xd, rows, n, stride, weighted ? wd : NULL, 1e-6f));
            bk_to(out, xd, b);
            char what[96];
            snprintf(what, sizeof what, "rmsnorm %lldx%lld%s", (long long)rows, (long long)n,
                     weighted ? " weighted" : "");
            CHECK(check_bounds(what, out, ref, tol, rows * stride) == 0);
            bk_free(xd), bk_free(wd);
            free(x), free(ref), free(out), free(w), free(tol);
        }
}

static void test_rope(void) {
    // (rows, rows per position, n, n_rot): q-like (heads share a position), kv-like, partial.
    static const int64_t shapes[][4] = {{3 * 5, 5, 512, 64}, {1, 1, 128, 64}, {7, 1, 72, 8}};
    for (size_t s = 0; s < 3; s++)
        for (int inv = 0; inv < 2; inv++) {
            const int64_t rows = shapes[s][0], rpp = shapes[s][1], n = shapes[s][2];
            const int32_t n_rot = (int32_t)shapes[s][3], n_pos = (int32_t)(rows / rpp);
            const int64_t stride = n + 1;
            const size_t b = sizeof(float) * (size_t)(rows * stride);
            float *x = malloc(b), *ref = malloc(b), *out = malloc(b);
            float *omega = malloc(sizeof(float) * (size_t)(n_rot / 2));
            int32_t *pos = malloc(sizeof(int32_t) * (size_t)n_pos);
            double *tol = malloc(sizeof(double) * (size_t)(rows * stride));
            fill_rand(x, rows * stride, 2.0f);
            for (int32_t i = 0; i < n_rot / 2; i++)
                omega[i] = powf(10000.0f, -2.0f * (float)i / (float)n_rot);
            for (int32_t p = 0; p < n_pos; p++)
                pos[p] = p == 0 ? 0 : p == 1 ? 65535 : (int32_t)(rnd() % 5000);
            const float scale = inv ? 1.0f : 0.75f;
            memcpy(ref, x, b);
            for (int64_t r = 0; r < rows; r++)
                di_ref_rope(ref + r * stride, n, n_rot, omega, pos[r / rpp], scale, inv);
            for (int64_t r = 0; r < rows; r++)
                for (int64_t i = 0; i < stride; i++) {
                    const int64_t k = r * stride + i;
                    if (i < n - n_rot || i >= n) {
                        tol[k] = 0; // untouched: exact
                    } else {
                        const int64_t p0 = r * stride + n - n_rot + ((i - (n - n_rot)) & ~1);
                        tol[k] = TOL_ROPE_ULPS * U32 * scale * (fabs(x[p0]) + fabs(x[p0 + 1])) * 2;
                    }
                }
            float *xd = bk_from(x, b), *od = bk_from(omega, sizeof(float) * (size_t)(n_rot / 2));
            int32_t *pd = bk_from(pos, sizeof(int32_t) * (size_t)n_pos);
            CK(g_b->vt->rope(g_b, xd, rows, stride, n, n_rot, od, pd, (int32_t)rpp, scale,
                             inv != 0));
            bk_to(out, xd, b);
            char what[96];
            snprintf(what, sizeof what, "rope rows=%lld n=%lld rot=%d%s", (long long)rows,
                     (long long)n, n_rot, inv ? " inverse" : "");
            CHECK(check_bounds(what, out, ref, tol, rows * stride) == 0);
            bk_free(xd), bk_free(od), bk_free(pd);
            free(x), free(ref), free(out), free(omega), free(pos), free(tol);
        }
}

static void test_scale(void) {
    static const int64_t ns[] = {1, 255, 257, 100000};
    for (size_t s = 0; s < 4; s++) {
        const int64_t n = ns[s], pad = 7;
        const size_t b = sizeof(float) * (size_t)(n + pad);
        float *x = malloc(b), *ref = malloc(b), *out = malloc(b);
        fill_rand(x, n + pad, 5.0f);
        const float sc = 0.1f * (float)(s + 1);
        memcpy(ref, x, b);
        for (int64_t i = 0; i < n; i++) ref[i] = x[i] * sc; // one rounding on both sides
        float *xd = bk_from(x, b);
        CK(g_b->vt->scale(g_b, xd, n, sc));
        bk_to(out, xd, b);
        const int64_t bad = n_diff_f32(out, ref, n + pad); // elements past n untouched
        fprintf(stderr, "  scale n=%lld: %lld differ\n", (long long)n, (long long)bad);
        CHECK(bad == 0);
        bk_free(xd);
        free(x), free(ref), free(out);
    }
}

// ---- mHC ----

static void ref_mhc_pre(const float *x, const float *mix_raw, const float *base, const float *scale,
                        int nc, int64_t D, int32_t T, int iters, float hc_eps, float norm_eps,
                        bool head, float *a, float *post, float *comb, double *mag_a) {
    const int n_mix = head ? nc : (2 + nc) * nc;
    for (int32_t t = 0; t < T; t++) {
        const float *xf = x + (int64_t)t * nc * D;
        float r = 1.0f / sqrtf(di_ref_dot(xf, xf, (int64_t)nc * D) / (float)(nc * D) + norm_eps);
        float mix[16 * 18], pre[16];
        for (int i = 0; i < n_mix; i++) mix[i] = mix_raw[t * n_mix + i] * r;
        di_dsv4_hc_coeffs(mix, base, scale, nc, iters, hc_eps, pre, head ? NULL : post + t * nc,
                          head ? NULL : comb + t * nc * nc);
        for (int64_t d = 0; d < D; d++) {
            float acc = 0;
            double mag = 0;
            for (int s = 0; s < nc; s++) {
                acc += pre[s] * xf[s * D + d];
                mag += fabs((double)pre[s] * xf[s * D + d]);
            }
            a[t * D + d] = acc;
            mag_a[t * D + d] = mag;
        }
    }
}

static void mhc_case(int nc, int64_t D, int32_t T, bool head) {
    const int n_mix = head ? nc : (2 + nc) * nc, iters = 20;
    const float hc_eps = 1e-6f, norm_eps = 1e-6f;
    const int64_t nx = (int64_t)T * nc * D;
    float *x = malloc(sizeof(float) * (size_t)nx),
          *mix = malloc(sizeof(float) * (size_t)(T * n_mix));
    float base[16 * 18], scale[3] = {0.7f, 1.3f, 0.9f};
    fill_rand(x, nx, 2.0f);
    fill_rand(mix, (int64_t)T * n_mix, 3.0f);
    fill_rand(base, n_mix, 1.0f);
    float *a = malloc(sizeof(float) * (size_t)(T * D)),
          *ga = malloc(sizeof(float) * (size_t)(T * D));
    float *post = malloc(sizeof(float) * (size_t)(T * nc)),
          *gpost = malloc(sizeof(float) * (size_t)(T * nc));
    float *comb = malloc(sizeof(float) * (size_t)(T * nc * nc)),
          *gcomb = malloc(sizeof(float) * (size_t)(T * nc * nc));
    double *tol_a = malloc(sizeof(double) * (size_t)(T * D));
    ref_mhc_pre(x, mix, base, scale, nc, D, T, iters, hc_eps, norm_eps, head, a, post, comb, tol_a);
    for (int64_t i = 0; i < (int64_t)T * D; i++) tol_a[i] = tol_a[i] * TOL_MHC_REL + TOL_MHC_ABS;
    float *xd = bk_from(x, sizeof(float) * (size_t)nx),
          *md = bk_from(mix, sizeof(float) * (size_t)(T * n_mix));
    float *bd = bk_from(base, sizeof(float) * (size_t)n_mix), *sd = bk_from(scale, sizeof scale);
    float *ad = bk_alloc(sizeof(float) * (size_t)(T * D));
    float *pd = bk_alloc(sizeof(float) * (size_t)(T * nc)),
          *cd = bk_alloc(sizeof(float) * (size_t)(T * nc * nc));
    bk_poison(ad, sizeof(float) * (size_t)(T * D));
    bk_poison(pd, sizeof(float) * (size_t)(T * nc));
    bk_poison(cd, sizeof(float) * (size_t)(T * nc * nc));
    CK(g_b->vt->mhc_pre(g_b, xd, md, bd, sd, nc, D, T, iters, hc_eps, norm_eps, head, ad,
                        head ? NULL : pd, head ? NULL : cd));
    bk_to(ga, ad, sizeof(float) * (size_t)(T * D));
    char what[96];
    snprintf(what, sizeof what, "mhc_pre a nc=%d D=%lld T=%d%s", nc, (long long)D, T,
             head ? " head" : "");
    CHECK(check_bounds(what, ga, a, tol_a, (int64_t)T * D) == 0);
    if (!head) {
        bk_to(gpost, pd, sizeof(float) * (size_t)(T * nc));
        bk_to(gcomb, cd, sizeof(float) * (size_t)(T * nc * nc));
        double *tp = malloc(sizeof(double) * (size_t)(T * nc * nc));
        for (int64_t i = 0; i < (int64_t)T * nc; i++)
            tp[i] = fabs(post[i]) * TOL_MHC_REL + TOL_MHC_ABS;
        CHECK(check_bounds("mhc_pre post", gpost, post, tp, (int64_t)T * nc) == 0);
        for (int64_t i = 0; i < (int64_t)T * nc * nc; i++)
            tp[i] = fabs(comb[i]) * TOL_MHC_REL + TOL_MHC_ABS;
        CHECK(check_bounds("mhc_pre comb", gcomb, comb, tp, (int64_t)T * nc * nc) == 0);
        free(tp);

        // mhc_post on the host's post/comb (uploaded): x'[t,k] = post_k o + sum_j C[j][k] x_j.
        float *o = malloc(sizeof(float) * (size_t)(T * D)),
              *ref = malloc(sizeof(float) * (size_t)nx);
        float *out = malloc(sizeof(float) * (size_t)nx);
        double *tol = malloc(sizeof(double) * (size_t)nx);
        fill_rand(o, (int64_t)T * D, 1.0f);
        for (int32_t t = 0; t < T; t++)
            for (int64_t d = 0; d < D; d++)
                for (int k = 0; k < nc; k++) {
                    const float *C = comb + t * nc * nc;
                    float acc = post[t * nc + k] * o[t * D + d];
                    double mg = fabs((double)post[t * nc + k] * o[t * D + d]);
                    for (int j = 0; j < nc; j++) {
                        acc += C[j * nc + k] * x[((int64_t)t * nc + j) * D + d];
                        mg += fabs((double)C[j * nc + k] * x[((int64_t)t * nc + j) * D + d]);
                    }
                    const int64_t i = ((int64_t)t * nc + k) * D + d;
                    ref[i] = acc;
                    tol[i] = mg * TOL_MHC_REL + TOL_MHC_ABS;
                }
        float *od = bk_from(o, sizeof(float) * (size_t)(T * D));
        CK(g_b->vt->upload(g_b, pd, post, sizeof(float) * (size_t)(T * nc)));
        CK(g_b->vt->upload(g_b, cd, comb, sizeof(float) * (size_t)(T * nc * nc)));
        CK(g_b->vt->mhc_post(g_b, od, xd, pd, cd, nc, D, T));
        bk_to(out, xd, sizeof(float) * (size_t)nx);
        snprintf(what, sizeof what, "mhc_post nc=%d D=%lld T=%d", nc, (long long)D, T);
        CHECK(check_bounds(what, out, ref, tol, nx) == 0);
        bk_free(od);
        free(o), free(ref), free(out), free(tol);
    }
    bk_free(xd), bk_free(md), bk_free(bd), bk_free(sd), bk_free(ad), bk_free(pd), bk_free(cd);
    free(x), free(mix), free(a), free(ga), free(post), free(gpost), free(comb), free(gcomb),
        free(tol_a);
}

static void test_mhc(void) {
    mhc_case(4, 7, 1, false);
    mhc_case(4, 300, 5, false);
    mhc_case(4, 300, 3, true);
    mhc_case(3, 129, 2, false); // NC not a power of two
}

// ---- MoE ----

// V4.1's MoE rules for the cases run with them (test_moe): the router's temperature (0: none, V4)
// and the official recipe's A8 block (128 for V4, 32 for V4.1).
static float g_gate_temp = 0.0f;
static int32_t g_a8_block = 128;

static void ref_router(const float *logits, const float *bias, const int32_t *tid2eid,
                       const int32_t *ids, int32_t T, int32_t E, int32_t K, float route_scale,
                       bool hf_eps, int32_t *sel, float *wgt) {
    float *st = malloc(sizeof(float) * (size_t)E);
    for (int32_t t = 0; t < T; t++) {
        for (int32_t e = 0; e < E; e++) {
            float x = logits[(int64_t)t * E + e];
            if (g_gate_temp > 0) x /= g_gate_temp;
            st[e] = sqrtf(di_softplus(x));
        }
        int32_t *se = sel + t * K;
        if (tid2eid) {
            memcpy(se, tid2eid + (int64_t)ids[t] * K, sizeof(int32_t) * (size_t)K);
        } else {
            for (int32_t k = 0; k < K; k++) {
                int32_t best = -1;
                float bv = -INFINITY;
                for (int32_t e = 0; e < E; e++) {
                    bool taken = false;
                    for (int32_t j = 0; j < k; j++) taken |= se[j] == e;
                    const float v = st[e] + (bias ? bias[e] : 0.0f);
                    if (!taken && (best < 0 || v > bv)) best = e, bv = v;
                }
                se[k] = best;
            }
        }
        float sum = 0;
        for (int32_t k = 0; k < K; k++) sum += st[se[k]];
        if (hf_eps) sum += 1e-20f;
        for (int32_t k = 0; k < K; k++) wgt[t * K + k] = st[se[k]] / sum * route_scale;
    }
    free(st);
}

static void swiglu_host(float *g, const float *u, int64_t F, float limit) {
    for (int64_t i = 0; i < F; i++) {
        float gt = g[i], up = u[i];
        if (limit > 0) gt = fminf(gt, limit), up = fminf(fmaxf(up, -limit), limit);
        g[i] = di_silu(gt) * up;
    }
}

static void round_host(float *x, int64_t n) {
    for (int64_t i = 0; i < n; i++) x[i] = di_round_bf16(x[i]);
}

// y = W A8(x) rounded to BF16 (official) or W x, one row.
static void linear_host(const mat *w, const float *x, int64_t n_in, int64_t n_out, float *y,
                        bool official) {
    float *xq = malloc(sizeof(float) * (size_t)n_in);
    memcpy(xq, x, sizeof(float) * (size_t)n_in);
    if (official) di_fake_quant_q8(xq, n_in, g_a8_block);
    di_ref_matmul(&g_cpu, &w->t, xq, 1, n_in, y, n_out);
    if (official) round_host(y, n_out);
    free(xq);
}

static void moe_case(int32_t T, int32_t E, int32_t K, int64_t D, int64_t F, bool hash,
                     bool shared_clamp, bool hf_eps, bool official) {
    const int32_t V = 40;
    const float limit = 0.3f, route_scale = 1.5f;
    mat gate = make_w(DI_TENSOR_KIND_F32, D, E);
    mat *w[3];
    di_tensor *dw[3];
    for (int i = 0; i < 3; i++) {
        w[i] = malloc(sizeof(mat) * (size_t)E);
        dw[i] = malloc(sizeof(di_tensor) * (size_t)E);
    }
    for (int32_t e = 0; e < E; e++) {
        w[0][e] = make_w(DI_TENSOR_KIND_FP4, D, F); // w1 [F, D]
        w[1][e] = make_w(DI_TENSOR_KIND_FP4, F, D); // w2 [D, F]
        w[2][e] = make_w(DI_TENSOR_KIND_FP4, D, F); // w3 [F, D]
        for (int i = 0; i < 3; i++) CK(g_b->vt->weight_upload(g_b, &w[i][e].t, &dw[i][e]));
    }
    mat sh[3] = {make_w(DI_TENSOR_KIND_FP8, D, F), make_w(DI_TENSOR_KIND_FP8, F, D),
                 make_w(DI_TENSOR_KIND_FP8, D, F)};
    float *bias = malloc(sizeof(float) * (size_t)E);
    fill_rand(bias, E, 0.3f);
    int32_t *tid2eid = malloc(sizeof(int32_t) * (size_t)(V * K)),
            *ids = malloc(sizeof(int32_t) * (size_t)T);
    for (int32_t i = 0; i < V * K; i++) tid2eid[i] = (int32_t)(rnd() % (uint64_t)E);
    for (int32_t t = 0; t < T; t++) ids[t] = (int32_t)(rnd() % (uint64_t)V);
    const int64_t nf = (int64_t)T * D;
    float *f = malloc(sizeof(float) * (size_t)nf), *ref = malloc(sizeof(float) * (size_t)nf),
          *out = malloc(sizeof(float) * (size_t)nf);
    fill_rand(f, nf, 1.0f);

    // Host layer (model/dsv4_moe.c on di_ref_matmul, either recipe): experts in ascending id.
    float *logits = malloc(sizeof(float) * (size_t)(T * E)),
          *wgt = malloc(sizeof(float) * (size_t)(T * K));
    int32_t *sel = malloc(sizeof(int32_t) * (size_t)(T * K));
    float *g = malloc(sizeof(float) * (size_t)F), *u = malloc(sizeof(float) * (size_t)F),
          *y = malloc(sizeof(float) * (size_t)D);
    di_ref_matmul(&g_cpu, &gate.t, f, T, D, logits, E);
    ref_router(logits, hash ? NULL : bias, hash ? tid2eid : NULL, ids, T, E, K, route_scale, hf_eps,
               sel, wgt);
    memset(ref, 0, sizeof(float) * (size_t)nf);
    for (int32_t e = 0; e < E; e++)
        for (int32_t t = 0; t < T; t++)
            for (int32_t k = 0; k < K; k++) {
                if (sel[t * K + k] != e) continue;
                linear_host(&w[0][e], f + (int64_t)t * D, D, F, g, official);
                linear_host(&w[2][e], f + (int64_t)t * D, D, F, u, official);
                swiglu_host(g, u, F, limit);
                if (official) { // the weight on h, then h in BF16
                    for (int64_t i = 0; i < F; i++) g[i] *= wgt[t * K + k];
                    round_host(g, F);
                }
                linear_host(&w[1][e], g, F, D, y, official);
                for (int64_t i = 0; i < D; i++)
                    ref[(int64_t)t * D + i] += official ? y[i] : y[i] * wgt[t * K + k];
            }
    for (int32_t t = 0; t < T; t++) {
        linear_host(&sh[0], f + (int64_t)t * D, D, F, g, official);
        linear_host(&sh[2], f + (int64_t)t * D, D, F, u, official);
        swiglu_host(g, u, F, shared_clamp ? limit : 0.0f);
        if (official) round_host(g, F);
        linear_host(&sh[1], g, F, D, y, official);
        for (int64_t i = 0; i < D; i++) ref[(int64_t)t * D + i] += y[i];
    }
    if (official) round_host(ref, nf);

    di_backend_moe_w mw;
    memset(&mw, 0, sizeof mw);
    CK(g_b->vt->weight_upload(g_b, &gate.t, &mw.gate));
    mw.gate_bias = hash ? NULL : bk_from(bias, sizeof(float) * (size_t)E);
    mw.tid2eid = hash ? bk_from(tid2eid, sizeof(int32_t) * (size_t)(V * K)) : NULL;
    mw.w1 = bk_from(dw[0], sizeof(di_tensor) * (size_t)E);
    mw.w2 = bk_from(dw[1], sizeof(di_tensor) * (size_t)E);
    mw.w3 = bk_from(dw[2], sizeof(di_tensor) * (size_t)E);
    CK(g_b->vt->weight_upload(g_b, &sh[0].t, &mw.sh_w1));
    CK(g_b->vt->weight_upload(g_b, &sh[1].t, &mw.sh_w2));
    CK(g_b->vt->weight_upload(g_b, &sh[2].t, &mw.sh_w3));
    mw.n_expert = E, mw.n_used = K, mw.D = D, mw.F = F;
    mw.route_scale = route_scale, mw.swiglu_limit = limit;
    mw.shared_clamp = shared_clamp, mw.hf_eps = hf_eps;
    mw.official = official, mw.routed_kind = DI_TENSOR_KIND_FP4;
    mw.gate_temp = g_gate_temp, mw.a8_block = g_a8_block;
    float *fd = bk_from(f, sizeof(float) * (size_t)nf), *od = bk_alloc(sizeof(float) * (size_t)nf);
    int32_t *idd = bk_from(ids, sizeof(int32_t) * (size_t)T);
    bk_poison(od, sizeof(float) * (size_t)nf);
    CK(g_b->vt->moe(g_b, &mw, fd, idd, T, od));
    bk_to(out, od, sizeof(float) * (size_t)nf);
    double *tol = malloc(sizeof(double) * (size_t)nf);
    for (int32_t t = 0; t < T; t++) {
        double ss = 0;
        for (int64_t i = 0; i < D; i++) ss += (double)ref[t * D + i] * ref[t * D + i];
        const double rel = official ? TOL_MOE_OFF_ROW_RMS : TOL_MOE_ROW_RMS;
        for (int64_t i = 0; i < D; i++) tol[t * D + i] = rel * sqrt(ss / D) + 1e-7;
    }
    char what[128];
    snprintf(what, sizeof what, "moe T=%d E=%d K=%d D=%lld F=%lld%s%s%s%s", T, E, K, (long long)D,
             (long long)F, hash ? " hash" : "", shared_clamp ? " clamp" : "", hf_eps ? " eps" : "",
             official ? " official" : "");
    CHECK(check_bounds(what, out, ref, tol, nf) == 0);
    bk_free(fd), bk_free(od), bk_free(idd);
    bk_free((void *)mw.gate_bias), bk_free((void *)mw.tid2eid);
    bk_free((void *)mw.w1), bk_free((void *)mw.w2), bk_free((void *)mw.w3);
    for (int i = 0; i < 3; i++) {
        for (int32_t e = 0; e < E; e++) free_w(&w[i][e]);
        free(w[i]), free(dw[i]);
        free_w(&sh[i]);
    }
    free_w(&gate);
    free(bias), free(tid2eid), free(ids), free(f), free(ref), free(out), free(logits), free(wgt),
        free(sel), free(g), free(u), free(y), free(tol);
}

static void test_moe(void) {
    moe_case(1, 8, 2, 128, 64, false, false, true, false);
    moe_case(9, 8, 2, 128, 96, true, true, false, false);
    moe_case(3, 16, 6, 256, 64, false, true, false, false);
    // The official recipe (A8 needs F, D multiples of 128): decode, a hash-routed prefill.
    moe_case(1, 8, 2, 128, 128, false, false, false, true);
    moe_case(9, 8, 2, 256, 128, true, true, false, true);
    // V4.1: the router's temperature, the + 1e-20 in both recipes, A8 in blocks of 32.
    g_gate_temp = 1.7f, g_a8_block = 32;
    moe_case(2, 8, 2, 128, 96, false, false, true, false);
    moe_case(3, 8, 2, 128, 64, false, true, true, true);
    g_gate_temp = 0.0f, g_a8_block = 128;
}

// The official recipe's prefill (>= DI_BACKEND_TC_MIN_ROWS tokens): the routed experts on BF16
// tensor cores (backend/cuda/moe_tc.cuh; sm_80+: the first call's check must pass and all three
// routed linears of every call take them), 64-row tiles (40+ rows per expert) and 16-row tiles,
// V4.1's A8 blocks of 32; then the same layers with them off (cu->moe_tc = -1: the SIMT kernel).
// Both against the host layer within TOL_MOE_OFF_ROW_RMS.
static void test_moe_tc(void) {
    const bool tc = g_cu->cc_major >= 8;
    for (int on = 1; on >= 0; on--) {
        g_cu->moe_tc = on ? 0 : -1;
        int64_t c0 = g_cu->n_moe_tc_calls;
        moe_case(160, 8, 2, 256, 128, false, true, false, true); // 40 rows per expert
        moe_case(200, 32, 3, 256, 128, true, true, false, true); // ~19 rows per expert
        g_gate_temp = 1.7f, g_a8_block = 32;
        moe_case(130, 8, 2, 128, 64, false, true, true, true); // K = 64 for w2: one step
        g_gate_temp = 0.0f, g_a8_block = 128;
        const int64_t calls = g_cu->n_moe_tc_calls - c0;
        fprintf(stderr, "  routed tensor cores %s: moe_tc %d, %lld routed linears on them\n",
                on ? "on" : "off", g_cu->moe_tc, (long long)calls);
        CHECK(calls == (on && tc ? 9 : 0));
        if (on) CHECK(g_cu->moe_tc == (tc ? 1 : 0));
    }
    g_cu->moe_tc = 0;
}

// ---- scatter_rows, add_ape, offset_list ----

static void test_scatter_rows(void) {
    // (n, width, src_stride, dst rows, dst_stride)
    static const int64_t shapes[][5] = {
        {1, 1, 1, 1, 1}, {5, 7, 9, 20, 8}, {70, 300, 300, 128, 301}};
    for (size_t s = 0; s < 3; s++) {
        const int64_t n = shapes[s][0], width = shapes[s][1], ss = shapes[s][2];
        const int64_t nd = shapes[s][3], ds = shapes[s][4];
        float *src = malloc(sizeof(float) * (size_t)(n * ss)),
              *dst = malloc(sizeof(float) * (size_t)(nd * ds));
        float *ref = malloc(sizeof(float) * (size_t)(nd * ds)),
              *out = malloc(sizeof(float) * (size_t)(nd * ds));
        int32_t *rows = malloc(sizeof(int32_t) * (size_t)nd);
        fill_rand(src, n * ss, 1.0f);
        fill_rand(dst, nd * ds, 1.0f);
        // A random permutation of the destination rows; the first n are written (a ring's rows
        // wrap around: not in order).
        for (int64_t i = 0; i < nd; i++) rows[i] = (int32_t)i;
        for (int64_t i = nd - 1; i > 0; i--) {
            const int64_t j = (int64_t)(rnd() % (uint64_t)(i + 1));
            const int32_t tmp = rows[i];
            rows[i] = rows[j], rows[j] = tmp;
        }
        memcpy(ref, dst, sizeof(float) * (size_t)(nd * ds));
        for (int64_t i = 0; i < n; i++)
            memcpy(ref + rows[i] * ds, src + i * ss, sizeof(float) * (size_t)width);
        float *sd = bk_from(src, sizeof(float) * (size_t)(n * ss)),
              *dd = bk_from(dst, sizeof(float) * (size_t)(nd * ds));
        int32_t *rd = bk_from(rows, sizeof(int32_t) * (size_t)n);
        CK(g_b->vt->scatter_rows(g_b, sd, n, ss, width, dd, ds, rd, NULL));
        CK(g_b->vt->scatter_rows(g_b, sd, 0, ss, width, dd, ds, rd, NULL)); // n 0: no-op
        bk_to(out, dd, sizeof(float) * (size_t)(nd * ds));
        int64_t bad = n_diff_f32(out, ref, nd * ds); // other rows and columns untouched
        // The gather form: source row s_i = (i * 7 + 3) mod n, every third destination padding.
        int32_t *from = malloc(sizeof(int32_t) * (size_t)n),
                *to = malloc(sizeof(int32_t) * (size_t)n);
        for (int64_t i = 0; i < n; i++) {
            from[i] = (int32_t)((i * 7 + 3) % n);
            to[i] = i % 3 == 1 ? -1 : rows[i];
            if (to[i] >= 0)
                memcpy(ref + to[i] * ds, src + from[i] * ss, sizeof(float) * (size_t)width);
        }
        int32_t *fd = bk_from(from, sizeof(int32_t) * (size_t)n),
                *td = bk_from(to, sizeof(int32_t) * (size_t)n);
        CK(g_b->vt->scatter_rows(g_b, sd, n, ss, width, dd, ds, td, fd));
        bk_to(out, dd, sizeof(float) * (size_t)(nd * ds));
        bad += n_diff_f32(out, ref, nd * ds);
        fprintf(stderr, "  scatter_rows n=%lld width=%lld (and gathered): %lld differ\n",
                (long long)n, (long long)width, (long long)bad);
        CHECK(bad == 0);
        bk_free(sd), bk_free(dd), bk_free(rd), bk_free(fd), bk_free(td);
        free(src), free(dst), free(ref), free(out), free(rows), free(from), free(to);
    }
}

static void test_add_ape(void) {
    // (n, width, stride, m)
    static const int64_t shapes[][4] = {{1, 1, 1, 1}, {6, 10, 12, 4}, {300, 1024, 1030, 128}};
    for (size_t s = 0; s < 3; s++) {
        const int64_t n = shapes[s][0], width = shapes[s][1], stride = shapes[s][2];
        const int32_t m = (int32_t)shapes[s][3];
        float *z = malloc(sizeof(float) * (size_t)(n * stride)),
              *ape = malloc(sizeof(float) * (size_t)(m * width));
        float *ref = malloc(sizeof(float) * (size_t)(n * stride)),
              *out = malloc(sizeof(float) * (size_t)(n * stride));
        int32_t *pos = malloc(sizeof(int32_t) * (size_t)n);
        fill_rand(z, n * stride, 1.0f);
        fill_rand(ape, (int64_t)m * width, 1.0f);
        for (int64_t t = 0; t < n; t++)
            pos[t] = t == 0 ? 0 : t == 1 ? m - 1 : (int32_t)(rnd() % 100000);
        memcpy(ref, z, sizeof(float) * (size_t)(n * stride));
        for (int64_t t = 0; t < n; t++)
            for (int64_t i = 0; i < width; i++)
                ref[t * stride + i] += ape[(int64_t)(pos[t] % m) * width + i];
        float *zd = bk_from(z, sizeof(float) * (size_t)(n * stride)),
              *ad = bk_from(ape, sizeof(float) * (size_t)(m * width));
        int32_t *pd = bk_from(pos, sizeof(int32_t) * (size_t)n);
        CK(g_b->vt->add_ape(g_b, zd, n, stride, width, ad, pd, m));
        bk_to(out, zd, sizeof(float) * (size_t)(n * stride));
        const int64_t bad = n_diff_f32(out, ref, n * stride);
        fprintf(stderr, "  add_ape n=%lld width=%lld m=%d: %lld differ\n", (long long)n,
                (long long)width, m, (long long)bad);
        CHECK(bad == 0);
        bk_free(zd), bk_free(ad), bk_free(pd);
        free(z), free(ape), free(ref), free(out), free(pos);
    }
}

static void test_offset_list(void) {
    // (n_tok, k, dst_stride)
    static const int64_t shapes[][3] = {{1, 1, 3}, {5, 16, 40}, {33, 512, 700}};
    for (size_t s = 0; s < 3; s++) {
        const int32_t T = (int32_t)shapes[s][0], k = (int32_t)shapes[s][1];
        const int64_t ds = shapes[s][2];
        int32_t *sel = malloc(sizeof(int32_t) * (size_t)(T * k)),
                *base = malloc(sizeof(int32_t) * (size_t)T);
        int32_t *off = malloc(sizeof(int32_t) * (size_t)T),
                *ref = malloc(sizeof(int32_t) * (size_t)(T * ds));
        int32_t *out = malloc(sizeof(int32_t) * (size_t)(T * ds));
        for (int32_t i = 0; i < T * k; i++) sel[i] = rnd() % 4 == 0 ? -1 : (int32_t)(rnd() % 5000);
        for (int32_t t = 0; t < T; t++) {
            base[t] = (int32_t)(rnd() % 100000);
            off[t] = (int32_t)(rnd() % (uint64_t)(ds - k + 1));
        }
        for (int64_t i = 0; i < T * ds; i++) ref[i] = 7777; // the window keys: untouched
        for (int32_t t = 0; t < T; t++)
            for (int32_t i = 0; i < k; i++) {
                const int32_t v = sel[t * k + i];
                ref[t * ds + off[t] + i] = v >= 0 ? base[t] + v : -1;
            }
        int32_t *sd = bk_from(sel, sizeof(int32_t) * (size_t)(T * k)),
                *bd = bk_from(base, sizeof(int32_t) * (size_t)T);
        int32_t *od = bk_from(off, sizeof(int32_t) * (size_t)T),
                *dd = bk_alloc(4 * (size_t)(T * ds));
        for (int64_t i = 0; i < T * ds; i++) out[i] = 7777;
        CK(g_b->vt->upload(g_b, dd, out, 4 * (size_t)(T * ds)));
        CK(g_b->vt->offset_list(g_b, sd, T, k, bd, od, NULL, NULL, 0, dd, ds));
        bk_to(out, dd, 4 * (size_t)(T * ds));
        int64_t bad = 0;
        for (int64_t i = 0; i < T * ds; i++) bad += out[i] != ref[i];
        // sel NULL: entries 0..k-1 (HCA's visible entries) over the same rows.
        for (int32_t t = 0; t < T; t++)
            for (int32_t i = 0; i < k; i++) ref[t * ds + off[t] + i] = base[t] + i;
        CK(g_b->vt->offset_list(g_b, NULL, T, k, bd, od, NULL, NULL, 0, dd, ds));
        bk_to(out, dd, 4 * (size_t)(T * ds));
        for (int64_t i = 0; i < T * ds; i++) bad += out[i] != ref[i];
        // Paged: pages of 13 entries, row t's pages from t * n_pg on, every 5th page missing (-1).
        const int32_t per = 13, n_pg = 5000 / per + 1;
        int32_t *pages = malloc(sizeof(int32_t) * (size_t)(T * n_pg)),
                *pg_off = malloc(sizeof(int32_t) * (size_t)T);
        for (int32_t i = 0; i < T * n_pg; i++)
            pages[i] = rnd() % 5 == 0 ? -1 : (int32_t)(rnd() % 4000);
        for (int32_t t = 0; t < T; t++) pg_off[t] = t * n_pg;
        for (int pass = 0; pass < 2; pass++) { // sel, then sel NULL
            for (int32_t t = 0; t < T; t++)
                for (int32_t i = 0; i < k; i++) {
                    const int32_t v = pass ? i : sel[t * k + i];
                    const int32_t pg = v >= 0 ? pages[pg_off[t] + v / per] : -1;
                    ref[t * ds + off[t] + i] = pg >= 0 ? base[t] + pg * per + v % per : -1;
                }
            int32_t *pd = bk_from(pages, sizeof(int32_t) * (size_t)(T * n_pg)),
                    *pod = bk_from(pg_off, sizeof(int32_t) * (size_t)T);
            CK(g_b->vt->offset_list(g_b, pass ? NULL : sd, T, k, bd, od, pd, pod, per, dd, ds));
            bk_to(out, dd, 4 * (size_t)(T * ds));
            for (int64_t i = 0; i < T * ds; i++) bad += out[i] != ref[i];
            bk_free(pd), bk_free(pod);
        }
        fprintf(stderr, "  offset_list T=%d k=%d (sel, sel NULL, both paged): %lld differ\n", T, k,
                (long long)bad);
        CHECK(bad == 0);
        CHECK_EQ(g_b->vt->offset_list(g_b, sd, T, k, bd, od, bd, od, 0, dd, ds), DI_ERR_INVALID);
        bk_free(sd), bk_free(bd), bk_free(od), bk_free(dd);
        free(sel), free(base), free(off), free(ref), free(out), free(pages), free(pg_off);
    }
}

// ---- compressor pooling ----

// Window w's slot j token values (c, z) at channel ch, as backend.h defines the src lists.
static bool slot_at(const float *call_c, const float *call_z, int64_t call_stride,
                    const float *ring_c, const float *ring_z, const int32_t *src, int32_t m,
                    int32_t c, int32_t d, int32_t j, int32_t ch, float *cv, float *zv) {
    const int32_t idx = src[j];
    if (idx == DI_BACKEND_NO_ROW) return false;
    const int64_t col = (c == 2 && j >= m ? d : 0) + ch;
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

// n_call rows this call, n_ring ring rows; window 0 of a CSA case has the no-row overlap (the
// first window of a sequence); the other windows mix ring rows (tokens of earlier calls) and this
// call's rows.
static void pool_case(int32_t n_win, int32_t m, int32_t c, int32_t d, bool first_window) {
    const int32_t n_slots = c * m, width = c * d;
    const int64_t n_call = (int64_t)n_win * m + 3, call_stride = width + 5, n_ring = 2 * m;
    float *cc = malloc(sizeof(float) * (size_t)(n_call * call_stride)),
          *cz = malloc(sizeof(float) * (size_t)(n_call * call_stride));
    float *rc = malloc(sizeof(float) * (size_t)(n_ring * width)),
          *rz = malloc(sizeof(float) * (size_t)(n_ring * width));
    fill_rand(cc, n_call * call_stride, 2.0f);
    fill_rand(cz, n_call * call_stride, 4.0f);
    fill_rand(rc, n_ring * width, 2.0f);
    fill_rand(rz, n_ring * width, 4.0f);
    int32_t *src = malloc(sizeof(int32_t) * (size_t)(n_win * n_slots));
    for (int32_t w = 0; w < n_win; w++)
        for (int32_t j = 0; j < n_slots; j++) {
            int32_t v;
            if (first_window && w == 0 && c == 2 && j < m)
                v = DI_BACKEND_NO_ROW; // no previous window: no overlap
            else if (rnd() % 3 == 0)
                v = -(int32_t)(rnd() % (uint64_t)n_ring) - 1; // ring row
            else
                v = (int32_t)(rnd() % (uint64_t)n_call);
            src[w * n_slots + j] = v;
        }
    const int64_t ne = (int64_t)n_win * d;
    float *ref = malloc(sizeof(float) * (size_t)ne), *out = malloc(sizeof(float) * (size_t)ne);
    double *tol = malloc(sizeof(double) * (size_t)ne);
    for (int32_t w = 0; w < n_win; w++)
        for (int32_t ch = 0; ch < d; ch++) {
            const int32_t *sw = src + w * n_slots;
            float mx = -INFINITY, cv, zv;
            int n_present = 0;
            for (int32_t j = 0; j < n_slots; j++)
                if (slot_at(cc, cz, call_stride, rc, rz, sw, m, c, d, j, ch, &cv, &zv))
                    mx = fmaxf(mx, zv), n_present++;
            float den = 0, num = 0;
            double mag = 0;
            for (int32_t j = 0; j < n_slots; j++) {
                if (!slot_at(cc, cz, call_stride, rc, rz, sw, m, c, d, j, ch, &cv, &zv)) continue;
                const float p = expf(zv - mx);
                den += p;
                num += p * cv;
                mag += (double)p * fabs(cv);
            }
            ref[w * d + ch] = num / den;
            tol[w * d + ch] = TOL_POOL(n_present) * mag / den + 2 * U32 * fabs(num / den) + 1e-30;
        }
    float *ccd = bk_from(cc, sizeof(float) * (size_t)(n_call * call_stride)),
          *czd = bk_from(cz, sizeof(float) * (size_t)(n_call * call_stride));
    float *rcd = bk_from(rc, sizeof(float) * (size_t)(n_ring * width)),
          *rzd = bk_from(rz, sizeof(float) * (size_t)(n_ring * width));
    int32_t *srcd = bk_from(src, sizeof(int32_t) * (size_t)(n_win * n_slots));
    float *ed = bk_alloc(sizeof(float) * (size_t)ne);
    bk_poison(ed, sizeof(float) * (size_t)ne);
    CK(g_b->vt->compress_pool(g_b, ccd, czd, call_stride, rcd, rzd, srcd, n_win, m, c, d, ed));
    bk_to(out, ed, sizeof(float) * (size_t)ne);
    char what[96];
    snprintf(what, sizeof what, "compress_pool n_win=%d m=%d c=%d d=%d%s", n_win, m, c, d,
             first_window ? " first" : "");
    CHECK(check_bounds(what, out, ref, tol, ne) == 0);
    bk_free(ccd), bk_free(czd), bk_free(rcd), bk_free(rzd), bk_free(srcd), bk_free(ed);
    free(cc), free(cz), free(rc), free(rz), free(src), free(ref), free(out), free(tol);
}

static void test_compress_pool(void) {
    pool_case(1, 4, 2, 7, true);      // CSA, the first window: overlap slots without rows
    pool_case(5, 4, 2, 131, true);    // CSA, first window then later ones in one call
    pool_case(3, 4, 2, 128, false);   // CSA, overlaps from the ring
    pool_case(1, 128, 1, 130, false); // HCA (m = 128)
    pool_case(4, 8, 1, 1, false);     // one channel
}

// ---- attention over FP32 rows ----

// Key lists (as test_cuda_attn.c's make_lists): by t % 8: 0 keys, 1, 64, max_keys, 65,
// max_keys - 1 with every third key masked, 50 keys all masked (only the sink), random; a window
// of consecutive pool rows first, then random rows (repeats allowed); -7 past n_keys[t] (unread).
static void make_lists(int32_t T, int32_t max_keys, int64_t stride, int64_t n_pool, int32_t *n_keys,
                       int32_t *idx) {
    for (int32_t t = 0; t < T; t++) {
        const int32_t kind = t % 8;
        int32_t nk = kind == 0   ? 0
                     : kind == 1 ? 1
                     : kind == 2 ? 64
                     : kind == 3 ? max_keys
                     : kind == 4 ? 65
                     : kind == 5 ? max_keys - 1
                     : kind == 6 ? 50
                                 : 1 + (int32_t)(rnd() % (uint64_t)max_keys);
        if (nk > max_keys) nk = max_keys;
        if (nk < 0) nk = 0;
        n_keys[t] = nk;
        const int64_t w0 = (int64_t)(rnd() % (uint64_t)n_pool);
        for (int64_t j = 0; j < stride; j++) {
            int32_t v =
                j < 128 ? (int32_t)((w0 + j) % n_pool) : (int32_t)(rnd() % (uint64_t)n_pool);
            if ((kind == 5 && j % 3 == 2) || kind == 6) v = -1;
            idx[t * stride + j] = j < nk ? v : -7;
        }
    }
}

// round_p: p normalised, then rounded to BF16 (the official recipe); the GPU's p may round to the
// neighbouring BF16 value where the host's lies near a midpoint: one ulp, 2^-7 relative at most.
static void attn_case(int32_t dh, int32_t H, int32_t T, int64_t n_pool, int32_t max_keys,
                      bool round_p) {
    const int64_t ks = max_keys + 3; // key_stride > max_keys
    const int64_t n_o = (int64_t)T * H * dh;
    float *pool = malloc(sizeof(float) * (size_t)(n_pool * dh));
    float *q = malloc(sizeof(float) * (size_t)n_o), *sink = malloc(sizeof(float) * (size_t)H);
    int32_t *n_keys = malloc(sizeof(int32_t) * (size_t)T),
            *idx = malloc(sizeof(int32_t) * (size_t)(T * ks));
    fill_rand(pool, n_pool * dh, 1.0f);
    fill_rand(q, n_o, 2.0f);
    fill_rand(sink, H, 2.0f);
    make_lists(T, max_keys, ks, n_pool, n_keys, idx);
    const float scale = 1.0f / sqrtf((float)dh);
    float *ref = malloc(sizeof(float) * (size_t)n_o), *out = malloc(sizeof(float) * (size_t)n_o);
    double *tol = malloc(sizeof(double) * (size_t)n_o),
           *sc = malloc(sizeof(double) * (size_t)(max_keys + 1));
    for (int32_t t = 0; t < T; t++)
        for (int32_t h = 0; h < H; h++) {
            const float *qv = q + ((int64_t)t * H + h) * dh;
            const int32_t *ix = idx + t * ks;
            double mx = sink[h], maxabs = 0;
            for (int32_t j = 0; j < n_keys[t]; j++) {
                if (ix[j] < 0) continue;
                const float *k = pool + (int64_t)ix[j] * dh;
                double s = 0, a = 0;
                for (int32_t d = 0; d < dh; d++)
                    s += (double)qv[d] * k[d], a += fabs((double)qv[d] * k[d]);
                sc[j] = s * scale;
                if (sc[j] > mx) mx = sc[j];
                if (a > maxabs) maxabs = a;
            }
            double den = exp(sink[h] - mx);
            for (int32_t j = 0; j < n_keys[t]; j++)
                if (ix[j] >= 0) den += (sc[j] = exp(sc[j] - mx));
            const double E = gamma_k(dh) * scale * maxabs;
            for (int32_t d = 0; d < dh; d++) {
                double o = 0, mag = 0;
                for (int32_t j = 0; j < n_keys[t]; j++) {
                    if (ix[j] < 0) continue;
                    const double kd = pool[(int64_t)ix[j] * dh + d];
                    const double p = round_p ? di_round_bf16((float)(sc[j] / den)) : sc[j] / den;
                    o += p * kd;
                    mag += p * fabs(kd);
                }
                const int64_t i = ((int64_t)t * H + h) * dh + d;
                ref[i] = (float)o;
                tol[i] = mag * (4 * E + TOL_ATTN_SUM_REL + (round_p ? 0x1p-7 : 0.0)) + 1e-30;
            }
        }
    float *pd = bk_from(pool, sizeof(float) * (size_t)(n_pool * dh)),
          *qd = bk_from(q, sizeof(float) * (size_t)n_o);
    float *sd = bk_from(sink, sizeof(float) * (size_t)H),
          *od = bk_alloc(sizeof(float) * (size_t)n_o);
    int32_t *nkd = bk_from(n_keys, sizeof(int32_t) * (size_t)T),
            *idxd = bk_from(idx, sizeof(int32_t) * (size_t)(T * ks));
    bk_poison(od, sizeof(float) * (size_t)n_o);
    CK(g_b->vt->attn(g_b, qd, pd, idxd, ks, nkd, max_keys, sd, T, H, dh, scale, round_p, od));
    bk_to(out, od, sizeof(float) * (size_t)n_o);
    char what[96];
    snprintf(what, sizeof what, "attn dh=%d H=%d T=%d pool=%lld max_keys=%d%s", dh, H, T,
             (long long)n_pool, max_keys, round_p ? " round_p" : "");
    CHECK(check_bounds(what, out, ref, tol, n_o) == 0);
    bk_free(pd), bk_free(qd), bk_free(sd), bk_free(od), bk_free(nkd), bk_free(idxd);
    free(pool), free(q), free(sink), free(n_keys), free(idx), free(ref), free(out), free(tol),
        free(sc);
}

// The shared-memory boundary: the kernel's dynamic size (q, the per-warp partials, max_keys
// scores) plus its static shared memory (a 32-float reduction buffer) must fit the device's
// opt-in limit. max_keys that fill the limit with the dynamic part alone are refused with
// DI_ERR_INVALID before any work (before: accepted by a check that ignored the static part, then
// cudaFuncSetAttribute failed: DI_ERR_CUDA); the largest accepted max_keys lies within the static
// part of the limit and gives the reference's outputs with every key listed.
static void test_attn_smem_boundary(void) {
    const int32_t dh = 8;
    const int64_t fixed = (int64_t)sizeof(float) * dh * 5; // q + 4 warps' partials
    const int32_t mk_full = (int32_t)(((int64_t)g_cu->smem_optin - fixed) / 4);
    float *d = bk_alloc(sizeof(float) * 64);
    const int32_t zero = 0;
    int32_t *nk0 = bk_from(&zero, sizeof zero);
    CHECK_EQ(g_b->vt->attn(g_b, d, d, nk0, 1, nk0, mk_full, d, 1, 1, dh, 1.0f, false, d),
             DI_ERR_INVALID);
    int32_t mk = -1;
    for (int32_t m = mk_full; m > mk_full - 256 && mk < 0; m--) {
        const di_status st = g_b->vt->attn(g_b, d, d, nk0, 1, nk0, m, d, 1, 1, dh, 1.0f, false, d);
        if (st == DI_OK)
            mk = m;
        else
            CHECK_EQ(st, DI_ERR_INVALID);
    }
    fprintf(stderr,
            "  attn smem: opt-in %zu bytes; max_keys %d refused, %d accepted (%lld bytes "
            "of dynamic shared memory)\n",
            g_cu->smem_optin, mk_full, mk, (long long)(fixed + 4 * (int64_t)mk));
    CHECK(mk > 0);
    bk_free(d), bk_free(nk0);
    if (mk > 0) attn_case(dh, 2, 8, 50, mk, false); // rows of every list kind, up to mk keys
}

static void test_attn(void) {
    attn_case(512, 3, 8, 700, 640, false);  // V4's head_dim, every list kind once
    attn_case(128, 5, 9, 300, 200, false);  // the tiny fixture's head_dim, H not a power of two
    attn_case(7, 1, 8, 50, 70, false);      // odd head_dim, one head
    attn_case(512, 64, 2, 200, 130, false); // 64 heads, 0 keys and 1 key
    attn_case(512, 3, 8, 700, 640, true);   // the official recipe: BF16 p
    attn_case(128, 5, 9, 300, 200, true);
    // max_keys beyond the shared memory of any device: refused before any work.
    float *d = bk_alloc(sizeof(float) * 64);
    int32_t *id = bk_alloc(sizeof(int32_t) * 4);
    CHECK_EQ(g_b->vt->attn(g_b, d, d, id, 1, id, 1 << 30, d, 1, 1, 64, 1.0f, false, d),
             DI_ERR_INVALID);
    CHECK_EQ(g_b->vt->attn(g_b, d, d, id, 1, id, 4, d, 1, 1, 2048, 1.0f, false, d), DI_ERR_INVALID);
    // More (row, head) blocks than gridDim.x allows (2^20 rows x 2^12 heads = 2^32): refused before
    // any work (before: the block count wrapped to 0 in the launch, a launch error).
    CHECK_EQ(g_b->vt->attn(g_b, d, d, id, 1, id, 4, d, 1 << 20, 1 << 12, 8, 1.0f, false, d),
             DI_ERR_INVALID);
    bk_free(d), bk_free(id);
    test_attn_smem_boundary();
}

// KV rows (kv_quant, attn_kv): the bytes equal the CPU backend's (a skipped row untouched), and
// attn_kv on them equals attn on the FP32 rows they hold, bit for bit (one kernel, two row
// decoders), with and without round_p.
static void kv_rows_case(int32_t dh, int32_t n_rot, int32_t H, int32_t T, int64_t n_rows,
                         int32_t max_keys) {
    const int64_t rb = di_backend_kv_row_bytes(dh, n_rot), ks = max_keys + 3;
    const int64_t n_o = (int64_t)T * H * dh, nope = dh - n_rot;
    float *kv = malloc(sizeof(float) * (size_t)(n_rows * dh));
    float *want = malloc(sizeof(float) * (size_t)(n_rows * dh));
    fill_rand(kv, n_rows * dh, 3.0f);
    for (int64_t i = 0; i < n_rows * dh; i += 64) // blocks of very different magnitudes
        for (int j = 0; j < 64 && i + j < n_rows * dh; j++)
            kv[i + j] *= ldexpf(1.0f, (int)(i % 9) - 4);
    memcpy(want, kv, sizeof(float) * (size_t)(n_rows * dh));
    for (int64_t r = 0; r < n_rows; r++) {
        di_fake_quant_q8(want + r * dh, nope, 64);
        for (int64_t d = nope; d < dh; d++) want[r * dh + d] = di_round_bf16(want[r * dh + d]);
    }
    int32_t *dst = malloc(sizeof(int32_t) * (size_t)n_rows);
    for (int64_t i = 0; i < n_rows; i++) dst[i] = (int32_t)(n_rows - 1 - i); // reversed
    dst[1] = -1;                                                             // padding: skipped
    uint8_t *cpu_pool = malloc((size_t)(n_rows * rb)), *gpu_pool = malloc((size_t)(n_rows * rb));
    memset(cpu_pool, 0xFF, (size_t)(n_rows * rb));
    di_backend *cb = NULL;
    CK(di_cpu_backend_create(1, &cb));
    CK(cb->vt->kv_quant(cb, kv, n_rows, dh, dh, n_rot, cpu_pool, dst));
    float *kvd = bk_from(kv, sizeof(float) * (size_t)(n_rows * dh));
    int32_t *dstd = bk_from(dst, sizeof(int32_t) * (size_t)n_rows);
    uint8_t *pd = bk_alloc((size_t)(n_rows * rb));
    bk_poison(pd, (size_t)(n_rows * rb));
    CK(g_b->vt->kv_quant(g_b, kvd, n_rows, dh, dh, n_rot, pd, dstd));
    bk_to(gpu_pool, pd, (size_t)(n_rows * rb));
    CHECK(memcmp(cpu_pool, gpu_pool, (size_t)(n_rows * rb)) == 0);
    // The FP32 rows the pool holds (row dst[i] = want row i; the skipped row's bytes are 0xFF,
    // never listed below).
    float *fp = calloc((size_t)(n_rows * dh), sizeof(float));
    for (int64_t i = 0; i < n_rows; i++)
        if (dst[i] >= 0)
            memcpy(fp + (int64_t)dst[i] * dh, want + i * dh, sizeof(float) * (size_t)dh);
    float *q = malloc(sizeof(float) * (size_t)n_o), *sink = malloc(sizeof(float) * (size_t)H);
    int32_t *n_keys = malloc(sizeof(int32_t) * (size_t)T),
            *idx = malloc(sizeof(int32_t) * (size_t)(T * ks));
    fill_rand(q, n_o, 0.2f);
    fill_rand(sink, H, 2.0f);
    make_lists(T, max_keys, ks, n_rows, n_keys, idx);
    const int32_t skipped = (int32_t)(n_rows - 2); // the row of dst[1]: masked wherever listed
    for (int64_t i = 0; i < T * ks; i++)
        if (idx[i] == skipped) idx[i] = -1;
    float *fpd = bk_from(fp, sizeof(float) * (size_t)(n_rows * dh)),
          *qd = bk_from(q, sizeof(float) * (size_t)n_o),
          *sd = bk_from(sink, sizeof(float) * (size_t)H);
    float *o1d = bk_alloc(sizeof(float) * (size_t)n_o),
          *o2d = bk_alloc(sizeof(float) * (size_t)n_o);
    int32_t *nkd = bk_from(n_keys, sizeof(int32_t) * (size_t)T),
            *idxd = bk_from(idx, sizeof(int32_t) * (size_t)(T * ks));
    float *o1 = malloc(sizeof(float) * (size_t)n_o), *o2 = malloc(sizeof(float) * (size_t)n_o);
    const float scale = 1.0f / sqrtf((float)dh);
    const int attn_tc = g_cu->attn_tc, attn_wg = g_cu->attn_wg;
    g_cu->attn_tc = -1; // the exact SIMT kernel for both (the tensor-core dispatch: below)
    g_cu->attn_wg = -1; // the mma.sync kernel's dispatch first; the wgmma kernel's after it
    for (int rp = 0; rp < 2; rp++) {
        CK(g_b->vt->attn(g_b, qd, fpd, idxd, ks, nkd, max_keys, sd, T, H, dh, scale, rp, o1d));
        CK(g_b->vt->attn_kv(g_b, qd, pd, idxd, ks, nkd, max_keys, sd, T, H, dh, n_rot, scale, rp,
                            o2d));
        bk_to(o1, o1d, sizeof(float) * (size_t)n_o);
        bk_to(o2, o2d, sizeof(float) * (size_t)n_o);
        CHECK_EQ(n_diff_f32(o1, o2, n_o), 0);
    }
    // The official recipe's attn_kv on tensor cores (di_cuda_attn_kv_dispatch) where the device
    // has the shared memory: the first call is checked against the SIMT kernel and keeps them
    // (attn_tc 1); its result and the next call's are di_cuda_attn_bf16's bit for bit (whose
    // accuracy test_cuda_attn bounds). o1 holds the SIMT result with round_p.
    float *o3d = bk_alloc(sizeof(float) * (size_t)n_o), *o3 = malloc(sizeof(float) * (size_t)n_o);
    const di_status st_tc = di_cuda_attn_bf16(g_cu, qd, pd, idxd, ks, nkd, max_keys, sd, T, H, dh,
                                              n_rot, scale, 0, o3d);
    CHECK(st_tc == DI_OK || st_tc == DI_ERR_UNSUPPORTED); // the latter: not the shared memory
    const bool tc = st_tc == DI_OK;
    if (tc) bk_to(o3, o3d, sizeof(float) * (size_t)n_o);
    for (int call = 0; call < 2; call++) {
        g_cu->attn_tc = call == 0 ? 0 : g_cu->attn_tc;
        const int64_t n_tc = g_cu->n_attn_tc_calls;
        bk_poison(o2d, sizeof(float) * (size_t)n_o);
        CK(g_b->vt->attn_kv(g_b, qd, pd, idxd, ks, nkd, max_keys, sd, T, H, dh, n_rot, scale, true,
                            o2d));
        bk_to(o2, o2d, sizeof(float) * (size_t)n_o);
        if (tc) {
            if (g_cu->attn_tc != 1)
                fprintf(stderr,
                        "kv_rows dh=%d: the tensor-core attention was not kept (attn_tc "
                        "%d; see the log)\n",
                        dh, g_cu->attn_tc);
            CHECK_EQ(g_cu->attn_tc, 1);
            CHECK_EQ(g_cu->n_attn_tc_calls, n_tc + 1);
            CHECK_EQ(n_diff_f32(o2, o3, n_o), 0);
        } else { // not eligible on this device: the SIMT kernel, unchecked
            CHECK_EQ(g_cu->attn_tc, 0);
            CHECK_EQ(n_diff_f32(o2, o1, n_o), 0);
        }
    }
    // A mismatch at the check (forced: a negative tolerance fails every comparison) turns the
    // tensor cores off and returns the SIMT result; later calls stay on the SIMT kernel.
    if (tc) {
        const float tol = g_cu->attn_tc_check_tol;
        g_cu->attn_tc = 0, g_cu->attn_tc_check_tol = -1.0f;
        for (int call = 0; call < 2; call++) {
            const int64_t n_tc = g_cu->n_attn_tc_calls;
            bk_poison(o2d, sizeof(float) * (size_t)n_o);
            CK(g_b->vt->attn_kv(g_b, qd, pd, idxd, ks, nkd, max_keys, sd, T, H, dh, n_rot, scale,
                                true, o2d));
            bk_to(o2, o2d, sizeof(float) * (size_t)n_o);
            CHECK_EQ(g_cu->attn_tc, -1);
            CHECK_EQ(g_cu->n_attn_tc_calls, n_tc);
            CHECK_EQ(n_diff_f32(o2, o1, n_o), 0);
        }
        g_cu->attn_tc_check_tol = tol;
    }
    // The wgmma kernel (cc 9.0 with sm_90a code, dh 512), tried before the mma.sync one: its first
    // call checked and kept (attn_wg 1), its result and the next di_cuda_attn_wg's bit for bit; a
    // forced mismatch returns the SIMT result and turns it off, and the next call is the mma.sync
    // kernel's (checked already here: attn_tc 1), bit for bit.
    float *o4d = bk_alloc(sizeof(float) * (size_t)n_o), *o4 = malloc(sizeof(float) * (size_t)n_o);
    const di_status st_wg =
        di_cuda_attn_wg(g_cu, qd, pd, idxd, ks, nkd, max_keys, sd, T, H, dh, n_rot, scale, 0, o4d);
    CHECK(st_wg == DI_OK || st_wg == DI_ERR_UNSUPPORTED || (dh != 512 && st_wg == DI_ERR_INVALID));
    if (st_wg == DI_OK && tc) {
        bk_to(o4, o4d, sizeof(float) * (size_t)n_o);
        const float tol = g_cu->attn_tc_check_tol;
        g_cu->attn_tc = 1;
        for (int call = 0; call < 4; call++) {
            if (call == 0 || call == 2) g_cu->attn_wg = 0;
            g_cu->attn_tc_check_tol = call < 2 ? tol : -1.0f;
            const int64_t n_wg = g_cu->n_attn_wg_calls, n_tc = g_cu->n_attn_tc_calls;
            bk_poison(o2d, sizeof(float) * (size_t)n_o);
            CK(g_b->vt->attn_kv(g_b, qd, pd, idxd, ks, nkd, max_keys, sd, T, H, dh, n_rot, scale,
                                true, o2d));
            bk_to(o2, o2d, sizeof(float) * (size_t)n_o);
            const bool on_wg = call < 2, on_tc = call == 3;
            CHECK_EQ(g_cu->attn_wg, on_wg ? 1 : -1);
            CHECK_EQ(g_cu->n_attn_wg_calls, n_wg + (on_wg ? 1 : 0));
            CHECK_EQ(g_cu->n_attn_tc_calls, n_tc + (on_tc ? 1 : 0));
            const int64_t nd = n_diff_f32(o2, on_wg ? o4 : on_tc ? o3 : o1, n_o);
            if (nd)
                fprintf(stderr, "kv_rows wgmma dispatch call %d: %lld outputs not the %s bits\n",
                        call, (long long)nd,
                        on_wg   ? "wgmma"
                        : on_tc ? "mma.sync"
                                : "SIMT");
            CHECK_EQ(nd, 0);
        }
        g_cu->attn_tc_check_tol = tol;
        fprintf(stderr,
                "  kv_rows dh=%d: wgmma checked and kept; a forced mismatch falls back to "
                "mma.sync\n",
                dh);
    }
    g_cu->attn_tc = attn_tc, g_cu->attn_wg = attn_wg;
    bk_free(o4d);
    free(o4);
    bk_free(o3d);
    free(o3);
    CHECK_EQ(g_b->vt->kv_quant(g_b, kvd, 1, dh, dh, n_rot + 2, pd, NULL), DI_ERR_INVALID);
    cb->vt->destroy(cb);
    bk_free(kvd), bk_free(dstd), bk_free(pd), bk_free(fpd), bk_free(qd), bk_free(sd);
    bk_free(o1d), bk_free(o2d), bk_free(nkd), bk_free(idxd);
    free(kv), free(want), free(dst), free(cpu_pool), free(gpu_pool), free(fp), free(q), free(sink);
    free(n_keys), free(idx), free(o1), free(o2);
}

static void test_kv_rows(void) {
    kv_rows_case(512, 64, 3, 8, 700, 640); // V4: 584-byte rows
    kv_rows_case(128, 64, 5, 9, 300, 200); // the tiny fixture: 200-byte rows
}

// ---- the official recipe's rounding points: exactly tensor/quant_ref.c ----

static void test_official_ops(void) {
    enum { R = 37, N = 256, S = 260 };
    float *x = malloc(sizeof(float) * R * S), *want = malloc(sizeof(float) * R * S),
          *got = malloc(sizeof(float) * R * S);
    fill_rand(x, (int64_t)R * S, 1.0f);
    for (int i = 0; i < R * S; i++) x[i] *= (float)exp((double)(i % 41) - 20.0); // wide exponents
    for (int i = 0; i < 8; i++) x[3 * S + i] = 0.0f; // a zero block start
    x[4 * S + 2] = -0.0f;
    x[5 * S + 7] = 1e-30f;   // underflows to 0 on both grids
    x[6 * S + 1] = INFINITY; // non-finite block: NaN
    float *xd = bk_from(x, sizeof(float) * R * S), *yd = bk_alloc(sizeof(float) * R * S);
    // round_bf16
    CK(g_b->vt->copy(g_b, yd, xd, sizeof(float) * R * S));
    CK(g_b->vt->round_bf16(g_b, yd, (int64_t)R * S));
    bk_to(got, yd, sizeof(float) * R * S);
    int64_t bad = 0;
    for (int i = 0; i < R * S; i++) bad += memcmp(&got[i], &(float){di_round_bf16(x[i])}, 4) != 0;
    CHECK_EQ(bad, 0);
    // fake_quant: Q8 / Q4, blocks 128, 64, 32, V4.1's Q4e (blocks of 16), out of place (y keeps its
    // columns past n) and in place; NaN blocks compared as NaN.
    static const int32_t cfg[][2] = {{8, 128}, {8, 64}, {4, 32}, {8, 32}, {DI_BACKEND_Q4E, 16}};
    for (size_t c = 0; c < sizeof cfg / sizeof cfg[0]; c++) {
        const int32_t bits = cfg[c][0], block = cfg[c][1];
        memcpy(want, x, sizeof(float) * R * S);
        for (int r = 0; r < R; r++) {
            if (bits == 8)
                di_fake_quant_q8(want + r * S, N, block);
            else if (bits == 4)
                di_fake_quant_q4(want + r * S, N, block);
            else
                di_fake_quant_q4e(want + r * S, N, block);
        }
        for (int inplace = 0; inplace < 2; inplace++) {
            CK(g_b->vt->copy(g_b, yd, xd, sizeof(float) * R * S));
            CK(g_b->vt->fake_quant(g_b, inplace ? yd : xd, R, N, S, block, bits, yd));
            bk_to(got, yd, sizeof(float) * R * S);
            bad = 0;
            for (int i = 0; i < R * S; i++) {
                const bool nan_ok = isnan(want[i]) && isnan(got[i]);
                bad += !nan_ok && memcmp(&got[i], &want[i], 4) != 0;
            }
            fprintf(stderr, "  fake_quant Q%d block %d%s: %lld differ\n", bits, block,
                    inplace ? " in place" : "", (long long)bad);
            CHECK_EQ(bad, 0);
        }
    }
    // hadamard on rows of 128 and 32 (the indexer's head_dim and a small one)
    for (int n = 32; n <= 128; n *= 4) {
        float *h = malloc(sizeof(float) * R * n);
        fill_rand(h, (int64_t)R * n, 1.0f);
        float *hd = bk_from(h, sizeof(float) * R * n);
        CK(g_b->vt->hadamard(g_b, hd, R, n));
        bk_to(got, hd, sizeof(float) * R * n);
        for (int r = 0; r < R; r++) di_hadamard(h + r * n, n);
        CHECK(memcmp(got, h, sizeof(float) * R * n) == 0);
        bk_free(hd);
        free(h);
    }
    // Refused shapes.
    CHECK_EQ(g_b->vt->fake_quant(g_b, xd, 1, N, S, 48, 8, yd), DI_ERR_INVALID);
    CHECK_EQ(g_b->vt->fake_quant(g_b, xd, 1, N, S, 32, 6, yd), DI_ERR_INVALID);
    CHECK_EQ(g_b->vt->hadamard(g_b, yd, 1, 48), DI_ERR_INVALID);
    bk_free(xd), bk_free(yd);
    free(x), free(want), free(got);
}

// ---- DeepSeek V4.1 ----

// mhc_pre_carried against ref_mhc_pre (post, comb; its collapse through pre_out) and a host
// collapse with a given pre; engram_gate against di_ref_engram_gate (the GPU's block sums in
// another order: 1e-4 of |h| + |value|, a wrong stream or gate moves O(1)); index_cand BUILD, MASK
// and DROP (after the backend's topk) against di_ref_cand_* and di_ref_topk, exactly, on scores
// with ties and rows of 0 .. stride visible entries.
#define TOL_ENGRAM_REL 1e-4
static void test_v41(void) {
    enum { T = 5, NC = 4, D = 300, NMIX = (2 + NC) * NC };
    const int iters = 20;
    const float hc_eps = 1e-6f, norm_eps = 1e-6f;
    float *x = malloc(sizeof(float) * T * NC * D), *mix = malloc(sizeof(float) * T * NMIX);
    float base[NMIX], scale[3] = {0.7f, 1.3f, 0.9f}, pre_in[T * NC];
    fill_rand(x, (int64_t)T * NC * D, 2.0f);
    fill_rand(mix, (int64_t)T * NMIX, 3.0f);
    fill_rand(base, NMIX, 1.0f);
    for (int i = 0; i < T * NC; i++) pre_in[i] = 0.2f + 0.15f * (float)(i % 7);
    float *a = malloc(sizeof(float) * T * D), *ga = malloc(sizeof(float) * T * D);
    float post[T * NC], comb[T * NC * NC], gpost[T * NC], gcomb[T * NC * NC];
    double *tol_a = malloc(sizeof(double) * T * D);
    ref_mhc_pre(x, mix, base, scale, NC, D, T, iters, hc_eps, norm_eps, false, a, post, comb,
                tol_a);
    for (int64_t i = 0; i < (int64_t)T * D; i++) tol_a[i] = tol_a[i] * TOL_MHC_REL + TOL_MHC_ABS;
    float *xd = bk_from(x, sizeof(float) * T * NC * D),
          *md = bk_from(mix, sizeof(float) * T * NMIX);
    float *bd = bk_from(base, sizeof base), *sd = bk_from(scale, sizeof scale);
    float *pid = bk_from(pre_in, sizeof pre_in), *pod = bk_alloc(sizeof pre_in);
    float *ad = bk_alloc(sizeof(float) * T * D), *pd = bk_alloc(sizeof post),
          *cd = bk_alloc(sizeof comb);
    bk_poison(pod, sizeof pre_in);
    bk_poison(pd, sizeof post);
    bk_poison(cd, sizeof comb);
    CK(g_b->vt->mhc_pre_carried(g_b, xd, md, bd, sd, NC, D, T, iters, hc_eps, norm_eps, pid, ad,
                                pod, pd, cd));
    bk_to(gpost, pd, sizeof post);
    bk_to(gcomb, cd, sizeof comb);
    double tp[T * NC * NC];
    for (int i = 0; i < T * NC; i++) tp[i] = fabs(post[i]) * TOL_MHC_REL + TOL_MHC_ABS;
    CHECK(check_bounds("mhc_pre_carried post", gpost, post, tp, T * NC) == 0);
    for (int i = 0; i < T * NC * NC; i++) tp[i] = fabs(comb[i]) * TOL_MHC_REL + TOL_MHC_ABS;
    CHECK(check_bounds("mhc_pre_carried comb", gcomb, comb, tp, T * NC * NC) == 0);
    // The collapse with pre_in (host loop), then with pre_out (= mhc_pre's collapse).
    bk_to(ga, ad, sizeof(float) * T * D);
    float *want = malloc(sizeof(float) * T * D);
    double *tol = malloc(sizeof(double) * T * D);
    for (int t = 0; t < T; t++)
        for (int d = 0; d < D; d++) {
            float acc = 0;
            double mg = 0;
            for (int c = 0; c < NC; c++) {
                acc += pre_in[t * NC + c] * x[(t * NC + c) * D + d];
                mg += fabs((double)pre_in[t * NC + c] * x[(t * NC + c) * D + d]);
            }
            want[t * D + d] = acc;
            tol[t * D + d] = mg * 4 * U32 + 1e-30;
        }
    CHECK(check_bounds("mhc_pre_carried collapse", ga, want, tol, T * D) == 0);
    bk_poison(ad, sizeof(float) * T * D);
    CK(g_b->vt->mhc_pre_carried(g_b, xd, NULL, NULL, NULL, NC, D, T, iters, hc_eps, norm_eps, pod,
                                ad, NULL, NULL, NULL));
    bk_to(ga, ad, sizeof(float) * T * D);
    CHECK(check_bounds("mhc_pre_carried pre_out", ga, a, tol_a, T * D) == 0);

    // Engram gate: kv [T, NC + 1, D] (keys then the value), qk [NC, D].
    float *kv = malloc(sizeof(float) * T * (NC + 1) * D), *qk = malloc(sizeof(float) * NC * D);
    fill_rand(kv, (int64_t)T * (NC + 1) * D, 1.5f);
    fill_rand(qk, (int64_t)NC * D, 1.0f);
    float *xg = malloc(sizeof(float) * T * NC * D), *gx = malloc(sizeof(float) * T * NC * D);
    double *tg = malloc(sizeof(double) * T * NC * D);
    memcpy(xg, x, sizeof(float) * T * NC * D);
    di_ref_engram_gate(kv, qk, NC, D, T, norm_eps, xg);
    for (int t = 0; t < T; t++)
        for (int c = 0; c < NC; c++)
            for (int d = 0; d < D; d++) {
                const int64_t i = ((int64_t)t * NC + c) * D + d;
                tg[i] =
                    TOL_ENGRAM_REL * (fabs(x[i]) + fabs(kv[((int64_t)t * (NC + 1) + NC) * D + d])) +
                    1e-7;
            }
    float *kvd = bk_from(kv, sizeof(float) * T * (NC + 1) * D),
          *qkd = bk_from(qk, sizeof(float) * NC * D);
    CK(g_b->vt->engram_gate(g_b, kvd, qkd, NC, D, T, norm_eps, xd));
    bk_to(gx, xd, sizeof(float) * T * NC * D);
    CHECK(check_bounds("engram_gate", gx, xg, tg, (int64_t)T * NC * D) == 0);

    // Candidate pool, mask, top-k, drop.
    enum { R = 7, ST = 203, BS = 4, NTB = 5, K = 16 };
    float *sc = malloc(sizeof(float) * R * ST), *gsc = malloc(sizeof(float) * R * ST);
    for (int i = 0; i < R * ST; i++) sc[i] = (float)(rand() % 9) * 0.25f; // many ties
    const int32_t vis[R] = {0, 1, 4, 5, 19, 120, ST};
    int32_t cand[R * NTB], n_cand[R], gcand[R * NTB], gn[R], sel[R * K], gsel[R * K];
    float blk[ST / BS + 2];
    float *scd = bk_from(sc, sizeof(float) * R * ST);
    int32_t *visd = bk_from(vis, sizeof vis), *cdd = bk_alloc(sizeof cand),
            *nd = bk_alloc(sizeof n_cand), *seld = bk_alloc(sizeof sel);
    float *workd = bk_alloc(sizeof(float) * R * (ST / BS + 1));
    bk_poison(workd, sizeof(float) * R * (ST / BS + 1));
    bk_poison(cdd, sizeof cand);
    CK(g_b->vt->index_cand(g_b, DI_BACKEND_CAND_BUILD, scd, ST, visd, R, BS, NTB, cdd, nd, NULL, K,
                           workd));
    CK(g_b->vt->index_cand(g_b, DI_BACKEND_CAND_MASK, scd, ST, visd, R, BS, NTB, cdd, nd, NULL, K,
                           NULL));
    CK(g_b->vt->topk(g_b, scd, ST, visd, R, K, seld));
    CK(g_b->vt->index_cand(g_b, DI_BACKEND_CAND_DROP, scd, ST, visd, R, BS, NTB, NULL, NULL, seld,
                           K, NULL));
    bk_to(gcand, cdd, sizeof cand);
    bk_to(gn, nd, sizeof n_cand);
    bk_to(gsel, seld, sizeof sel);
    bk_to(gsc, scd, sizeof(float) * R * ST);
    int bad = 0;
    for (int t = 0; t < R; t++) {
        float *st = sc + t * ST;
        n_cand[t] = di_ref_cand_build(st, vis[t], BS, NTB, blk, cand + t * NTB);
        di_ref_cand_mask(st, vis[t], BS, cand + t * NTB, n_cand[t]);
        const int32_t k = vis[t] < K ? vis[t] : K;
        int32_t *s = sel + t * K;
        for (int i = 0; i < K; i++) s[i] = -1;
        if (k == vis[t])
            for (int i = 0; i < k; i++) s[i] = i;
        else
            di_dsv4_topk(st, vis[t], k, s);
        di_ref_cand_drop(st, s, K);
        bad += gn[t] != n_cand[t];
        for (int i = 0; i < n_cand[t] && i < gn[t]; i++)
            bad += gcand[t * NTB + i] != cand[t * NTB + i];
        for (int i = 0; i < K; i++) bad += gsel[t * K + i] != s[i];
        bad += (int)n_diff_f32(gsc + t * ST, st, vis[t]);
    }
    fprintf(stderr, "  index_cand: %d differ\n", bad);
    CHECK_EQ(bad, 0);
    CHECK_EQ(g_b->vt->index_cand(g_b, 9, scd, ST, visd, R, BS, NTB, cdd, nd, seld, K, workd),
             DI_ERR_INVALID);
    bk_free(xd), bk_free(md), bk_free(bd), bk_free(sd), bk_free(pid), bk_free(pod), bk_free(ad);
    bk_free(pd), bk_free(cd), bk_free(kvd), bk_free(qkd), bk_free(scd), bk_free(visd);
    bk_free(cdd), bk_free(nd), bk_free(seld), bk_free(workd);
    free(x), free(mix), free(a), free(ga), free(tol_a), free(want), free(tol), free(kv), free(qk);
    free(xg), free(gx), free(tg), free(sc), free(gsc);
}

// V4.1's candidate pool on more rows than gridDim.y's 65,535 (BUILD's block scores and MASK had
// one grid row per call row: a launch error), exactly against di_ref_cand_*: rows of 0 to ST
// visible entries in turn, tiny widths to keep it cheap.
static void test_v41_cand_rows(void) {
    enum { ST = 13, BS = 4, NTB = 2, K = 4 };
    const int32_t R = 65535 + 13;
    const int64_t WS = ST / BS + 1;
    float *sc = malloc(sizeof(float) * (size_t)R * ST),
          *gsc = malloc(sizeof(float) * (size_t)R * ST);
    for (int64_t i = 0; i < (int64_t)R * ST; i++) sc[i] = (float)(rnd() % 7) * 0.5f; // ties
    int32_t *vis = malloc(sizeof(int32_t) * (size_t)R),
            *cand = malloc(sizeof(int32_t) * (size_t)R * NTB);
    int32_t *gcand = malloc(sizeof(int32_t) * (size_t)R * NTB),
            *n_cand = malloc(sizeof(int32_t) * (size_t)R);
    int32_t *gn = malloc(sizeof(int32_t) * (size_t)R),
            *sel = malloc(sizeof(int32_t) * (size_t)R * K);
    int32_t *gsel = malloc(sizeof(int32_t) * (size_t)R * K);
    for (int32_t t = 0; t < R; t++) vis[t] = t % (ST + 1);
    float blk[ST / BS + 2];
    float *scd = bk_from(sc, sizeof(float) * (size_t)R * ST);
    int32_t *visd = bk_from(vis, sizeof(int32_t) * (size_t)R);
    int32_t *cdd = bk_alloc(sizeof(int32_t) * (size_t)R * NTB),
            *nd = bk_alloc(sizeof(int32_t) * (size_t)R);
    int32_t *seld = bk_alloc(sizeof(int32_t) * (size_t)R * K);
    float *workd = bk_alloc(sizeof(float) * (size_t)(R * WS));
    bk_poison(workd, sizeof(float) * (size_t)(R * WS));
    bk_poison(cdd, sizeof(int32_t) * (size_t)R * NTB);
    bk_poison(nd, sizeof(int32_t) * (size_t)R);
    CK(g_b->vt->index_cand(g_b, DI_BACKEND_CAND_BUILD, scd, ST, visd, R, BS, NTB, cdd, nd, NULL, K,
                           workd));
    CK(g_b->vt->index_cand(g_b, DI_BACKEND_CAND_MASK, scd, ST, visd, R, BS, NTB, cdd, nd, NULL, K,
                           NULL));
    CK(g_b->vt->topk(g_b, scd, ST, visd, R, K, seld));
    CK(g_b->vt->index_cand(g_b, DI_BACKEND_CAND_DROP, scd, ST, visd, R, BS, NTB, NULL, NULL, seld,
                           K, NULL));
    bk_to(gcand, cdd, sizeof(int32_t) * (size_t)R * NTB);
    bk_to(gn, nd, sizeof(int32_t) * (size_t)R);
    bk_to(gsel, seld, sizeof(int32_t) * (size_t)R * K);
    bk_to(gsc, scd, sizeof(float) * (size_t)R * ST);
    int64_t bad = 0, bad_tail = 0;
    for (int32_t t = 0; t < R; t++) {
        float *st = sc + (int64_t)t * ST;
        n_cand[t] = di_ref_cand_build(st, vis[t], BS, NTB, blk, cand + (int64_t)t * NTB);
        di_ref_cand_mask(st, vis[t], BS, cand + (int64_t)t * NTB, n_cand[t]);
        const int32_t k = vis[t] < K ? vis[t] : K;
        int32_t *s = sel + (int64_t)t * K;
        for (int i = 0; i < K; i++) s[i] = -1;
        if (k == vis[t])
            for (int i = 0; i < k; i++) s[i] = i;
        else
            di_dsv4_topk(st, vis[t], k, s);
        di_ref_cand_drop(st, s, K);
        int64_t b = gn[t] != n_cand[t];
        for (int i = 0; i < n_cand[t] && i < gn[t]; i++)
            b += gcand[(int64_t)t * NTB + i] != cand[(int64_t)t * NTB + i];
        for (int i = 0; i < K; i++) b += gsel[(int64_t)t * K + i] != s[i];
        b += n_diff_f32(gsc + (int64_t)t * ST, st, vis[t]);
        bad += b;
        if (t >= 65535) bad_tail += b;
    }
    fprintf(stderr, "  index_cand %d rows: %lld differ (%lld in rows >= 65535)\n", R,
            (long long)bad, (long long)bad_tail);
    CHECK_EQ(bad, 0);
    // A score stride of 0 (no entries): MASK has nothing to do and launches nothing (before: a
    // 0-wide grid, a launch error).
    CHECK_EQ(g_b->vt->index_cand(g_b, DI_BACKEND_CAND_MASK, scd, 0, visd, R, BS, NTB, cdd, nd, NULL,
                                 K, NULL),
             DI_OK);
    CK(g_b->vt->sync(g_b));
    bk_free(scd), bk_free(visd), bk_free(cdd), bk_free(nd), bk_free(seld), bk_free(workd);
    free(sc), free(gsc), free(vis), free(cand), free(gcand), free(n_cand), free(gn), free(sel);
    free(gsel);
}

// ---- indexer scores and top-k ----

static void test_indexer(void) {
    const int32_t T = 5, HI = 4, DI = 96, n_ent = 300, max_vis = 260;
    const int64_t ss = max_vis + 5; // score_stride
    float *qi = malloc(sizeof(float) * (size_t)(T * HI * DI)),
          *wi = malloc(sizeof(float) * (size_t)(T * HI));
    float *keys = malloc(sizeof(float) * (size_t)(n_ent * DI));
    int32_t *vis = malloc(sizeof(int32_t) * (size_t)T);
    int64_t *kb = malloc(sizeof(int64_t) * (size_t)T);
    fill_rand(qi, (int64_t)T * HI * DI, 1.0f);
    fill_rand(wi, (int64_t)T * HI, 0.1f);
    fill_rand(keys, (int64_t)n_ent * DI, 1.0f);
    for (int32_t t = 0; t < T; t++) {
        vis[t] = t == 0 ? 1 : t == 1 ? max_vis : (int32_t)(rnd() % (uint64_t)max_vis) + 1;
        kb[t] = (int64_t)(rnd() % (uint64_t)(n_ent - vis[t] + 1)); // sequences' entry bases
    }
    float *ref = malloc(sizeof(float) * (size_t)(T * ss)),
          *out = malloc(sizeof(float) * (size_t)(T * ss));
    double *tol = malloc(sizeof(double) * (size_t)(T * ss));
    for (int64_t i = 0; i < T * ss; i++) ref[i] = NAN, tol[i] = 0; // past n_vis: not written
    for (int32_t t = 0; t < T; t++)
        for (int32_t w = 0; w < vis[t]; w++) {
            const float *kw = keys + (kb[t] + w) * DI;
            float acc = 0;
            double bound = 0;
            for (int32_t h = 0; h < HI; h++) {
                const float *q = qi + ((int64_t)t * HI + h) * DI;
                const float dot = di_ref_dot(q, kw, DI);
                double a = 0;
                for (int32_t d = 0; d < DI; d++) a += fabs((double)q[d] * kw[d]);
                acc += wi[t * HI + h] * (dot > 0 ? dot : 0);
                bound +=
                    fabs(wi[t * HI + h]) * (gamma_k(DI) * a + gamma_k(HI) * (dot > 0 ? dot : 0));
            }
            ref[t * ss + w] = acc;
            tol[t * ss + w] = TOL_SCORE_FACTOR * bound + 1e-30;
        }
    float *qd = bk_from(qi, sizeof(float) * (size_t)(T * HI * DI)),
          *wd = bk_from(wi, sizeof(float) * (size_t)(T * HI));
    float *kd = bk_from(keys, sizeof(float) * (size_t)(n_ent * DI)),
          *sd = bk_alloc(sizeof(float) * (size_t)(T * ss));
    int32_t *vd = bk_from(vis, sizeof(int32_t) * (size_t)T);
    int64_t *kbd = bk_from(kb, sizeof(int64_t) * (size_t)T);
    bk_poison(sd, sizeof(float) * (size_t)(T * ss));
    CK(g_b->vt->index_scores(g_b, qd, wd, kd, kbd, NULL, NULL, 0, vd, max_vis, T, HI, DI, false, sd,
                             ss));
    bk_to(out, sd, sizeof(float) * (size_t)(T * ss));
    CHECK(check_bounds("index_scores", out, ref, tol, T * ss) == 0);
    // Paged: the same keys in shuffled pages of 7 entries (row t's pages from t * n_pg on, row 3's
    // page 2 missing: -inf) give the contiguous scores bit for bit (the same arithmetic per key).
    {
        const int32_t per = 7, n_pg = (max_vis + per - 1) / per, n_all = T * n_pg;
        int32_t *pages = malloc(sizeof(int32_t) * (size_t)n_all),
                *pg_off = malloc(sizeof(int32_t) * (size_t)T);
        float *paged = calloc((size_t)n_all * per * DI, sizeof(float));
        float *po = malloc(sizeof(float) * (size_t)(T * ss));
        for (int32_t i = 0; i < n_all; i++) pages[i] = i;
        for (int32_t i = n_all - 1; i > 0; i--) { // shuffle
            int32_t j = (int32_t)(rnd() % (uint64_t)(i + 1)), x = pages[i];
            pages[i] = pages[j], pages[j] = x;
        }
        for (int32_t t = 0; t < T; t++) {
            pg_off[t] = t * n_pg;
            for (int32_t w = 0; w < vis[t]; w++)
                memcpy(paged + ((int64_t)pages[t * n_pg + w / per] * per + w % per) * DI,
                       keys + (kb[t] + w) * DI, sizeof(float) * (size_t)DI);
        }
        if (T > 3 && n_pg > 2) pages[3 * n_pg + 2] = -1;
        float *pkd = bk_from(paged, sizeof(float) * (size_t)n_all * per * DI);
        int32_t *pgd = bk_from(pages, sizeof(int32_t) * (size_t)n_all),
                *pod = bk_from(pg_off, sizeof(int32_t) * (size_t)T);
        bk_poison(sd, sizeof(float) * (size_t)(T * ss));
        CK(g_b->vt->index_scores(g_b, qd, wd, pkd, NULL, pgd, pod, per, vd, max_vis, T, HI, DI,
                                 false, sd, ss));
        bk_to(po, sd, sizeof(float) * (size_t)(T * ss));
        int64_t bad = 0;
        for (int32_t t = 0; t < T; t++)
            for (int32_t w = 0; w < vis[t]; w++) {
                const float g = po[t * ss + w];
                if (t == 3 && w / per == 2)
                    bad += !(isinf(g) && g < 0);
                else
                    bad += memcmp(&g, &out[t * ss + w], sizeof g) != 0;
            }
        fprintf(stderr, "  index_scores paged (7 per page, shuffled, one missing): %lld differ\n",
                (long long)bad);
        CHECK(bad == 0);
        CHECK_EQ(g_b->vt->index_scores(g_b, qd, wd, pkd, NULL, pgd, pod, 0, vd, max_vis, T, HI, DI,
                                       false, sd, ss),
                 DI_ERR_INVALID);
        bk_free(pkd), bk_free(pgd), bk_free(pod);
        free(pages), free(pg_off), free(paged), free(po);
    }
    // The official recipe: the same scores rounded to BF16 (one BF16 ulp apart at most).
    {
        float *rd = malloc(sizeof(float) * (size_t)(T * ss));
        double *rtol = malloc(sizeof(double) * (size_t)(T * ss));
        float *ro = malloc(sizeof(float) * (size_t)(T * ss));
        for (int64_t i = 0; i < T * ss; i++) {
            rd[i] = isnan(ref[i]) ? ref[i] : di_round_bf16(ref[i]);
            rtol[i] = isnan(ref[i]) ? 0 : tol[i] + fabs(ref[i]) * 0x1p-7;
        }
        CK(g_b->vt->index_scores(g_b, qd, wd, kd, kbd, NULL, NULL, 0, vd, max_vis, T, HI, DI, true,
                                 sd, ss));
        bk_to(ro, sd, sizeof(float) * (size_t)(T * ss));
        int64_t not_bf16 = 0;
        for (int32_t t = 0; t < T; t++)
            for (int32_t w = 0; w < vis[t]; w++)
                not_bf16 += ro[t * ss + w] != di_round_bf16(ro[t * ss + w]);
        CHECK_EQ(not_bf16, 0);
        CHECK(check_bounds("index_scores bf16", ro, rd, rtol, T * ss) == 0);
        CK(g_b->vt->index_scores(g_b, qd, wd, kd, kbd, NULL, NULL, 0, vd, max_vis, T, HI, DI, false,
                                 sd, ss));
        free(rd), free(rtol), free(ro);
    }

    // top-k on the GPU's own scores (identical inputs on both sides), with ties: every third
    // score of row 2 set equal (the lower index must win); k above, at and below n_vis.
    for (int64_t w = 0; w < vis[2]; w += 3) out[2 * ss + w] = 0.5f;
    CK(g_b->vt->upload(g_b, sd, out, sizeof(float) * (size_t)(T * ss)));
    static const int32_t ks[] = {1, 7, 64, 300};
    for (size_t s = 0; s < 4; s++) {
        const int32_t k = ks[s];
        int32_t *sel = malloc(sizeof(int32_t) * (size_t)(T * k)),
                *gsel = malloc(sizeof(int32_t) * (size_t)(T * k));
        for (int32_t t = 0; t < T; t++) {
            int32_t *st = sel + t * k;
            for (int32_t i = 0; i < k; i++) st[i] = -1;
            const int32_t kk = vis[t] < k ? vis[t] : k;
            if (kk == vis[t])
                for (int32_t i = 0; i < kk; i++) st[i] = i;
            else
                di_dsv4_topk(out + t * ss, vis[t], kk, st);
        }
        int32_t *seld = bk_alloc(sizeof(int32_t) * (size_t)(T * k));
        bk_poison(seld, sizeof(int32_t) * (size_t)(T * k));
        CK(g_b->vt->topk(g_b, sd, ss, vd, T, k, seld));
        bk_to(gsel, seld, sizeof(int32_t) * (size_t)(T * k));
        int64_t bad = 0;
        for (int32_t i = 0; i < T * k; i++) bad += sel[i] != gsel[i];
        fprintf(stderr, "  topk k=%d: %lld differ\n", k, (long long)bad);
        CHECK(bad == 0);
        bk_free(seld);
        free(sel), free(gsel);
    }
    bk_free(qd), bk_free(wd), bk_free(kd), bk_free(sd), bk_free(vd), bk_free(kbd);
    free(qi), free(wi), free(keys), free(vis), free(kb), free(ref), free(out), free(tol);
}

// ---- another thread ----

typedef struct thread_arg {
    float *xd;
    di_status st;
} thread_arg;

static void *thread_main(void *p) {
    thread_arg *a = p;
    a->st = g_b->vt->scale(g_b, a->xd, 1000, 2.0f);
    if (a->st == DI_OK) a->st = g_b->vt->sync(g_b);
    return NULL;
}

// The forward may run on a thread that did not create the backend: each entry makes the device
// current itself.
static void test_other_thread(void) {
    float x[1000], out[1000];
    fill_rand(x, 1000, 1.0f);
    thread_arg a = {bk_from(x, sizeof x), DI_OK};
    pthread_t th;
    CHECK(pthread_create(&th, NULL, thread_main, &a) == 0);
    pthread_join(th, NULL);
    CHECK_EQ(a.st, DI_OK);
    bk_to(out, a.xd, sizeof out);
    int64_t bad = 0;
    for (int i = 0; i < 1000; i++) bad += out[i] != x[i] * 2.0f;
    CHECK_EQ(bad, 0);
    bk_free(a.xd);
}

// ---- graphs ----

enum { GR_D = 64, GR_T = 3, GR_H = 2, GR_KEYS = 40, GR_RING = 8, GR_M = 4 };

// One set of buffers a step reads and writes (device), as the dev forward's state.
typedef struct gr_set {
    float *x, *y, *pool, *o, *ring, *cz, *ent, *omega, *sink;
    int32_t *pos, *key_idx, *n_keys, *dst, *src, *src_rows;
} gr_set;

static gr_set gr_alloc(void) {
    gr_set g;
    g.x = bk_alloc(sizeof(float) * GR_T * GR_D);
    g.y = bk_alloc(sizeof(float) * GR_T * GR_H * GR_D);
    g.pool = bk_alloc(sizeof(float) * GR_KEYS * GR_D);
    g.o = bk_alloc(sizeof(float) * GR_T * GR_H * GR_D);
    g.ring = bk_alloc(sizeof(float) * GR_RING * GR_H * GR_D);
    g.cz = bk_alloc(sizeof(float) * GR_T * GR_D);
    g.ent = bk_alloc(sizeof(float) * 2 * GR_D);
    g.omega = bk_alloc(sizeof(float) * GR_D / 2);
    g.sink = bk_alloc(sizeof(float) * GR_H);
    g.pos = bk_alloc(sizeof(int32_t) * GR_T);
    g.key_idx = bk_alloc(sizeof(int32_t) * GR_T * GR_KEYS);
    g.n_keys = bk_alloc(sizeof(int32_t) * GR_T);
    g.dst = bk_alloc(sizeof(int32_t) * GR_T);
    g.src = bk_alloc(sizeof(int32_t) * 2 * GR_M);
    g.src_rows = bk_alloc(sizeof(int32_t) * GR_T);
    return g;
}

static void gr_free(gr_set *g) {
    void *ps[] = {g->x,    g->y,   g->pool,    g->o,      g->ring, g->cz,  g->ent,     g->omega,
                  g->sink, g->pos, g->key_idx, g->n_keys, g->dst,  g->src, g->src_rows};
    for (size_t i = 0; i < sizeof ps / sizeof ps[0]; i++) bk_free(ps[i]);
}

// The step's inputs for `step` (what the host uploads before a launch): positions, key lists,
// destinations (one -1: padding) and gathered source rows, compressor sources (window 1:
// padding), activations.
static void gr_upload(const gr_set *g, int step) {
    float x[GR_T * GR_D], pool[GR_KEYS * GR_D], ring[GR_RING * GR_H * GR_D], cz[GR_T * GR_D];
    float omega[GR_D / 2], sink[GR_H] = {0.3f, -0.2f};
    int32_t pos[GR_T], ki[GR_T * GR_KEYS], nk[GR_T], dst[GR_T], src[2 * GR_M], from[GR_T];
    g_rng = 0x5eedull + (uint64_t)step; // the same inputs for both sets of a step
    fill_rand(x, GR_T * GR_D, 1.0f);
    fill_rand(pool, GR_KEYS * GR_D, 1.0f);
    fill_rand(ring, GR_RING * GR_H * GR_D, 1.0f);
    fill_rand(cz, GR_T * GR_D, 1.0f);
    for (int i = 0; i < GR_D / 2; i++) omega[i] = powf(10000.0f, -2.0f * (float)i / GR_D);
    for (int t = 0; t < GR_T; t++) {
        pos[t] = 7 * step + t;
        nk[t] = (step * 5 + t * 11) % (GR_KEYS + 1); // 0 keys too
        for (int j = 0; j < GR_KEYS; j++)
            ki[t * GR_KEYS + j] = (j * 3 + step + t) % 5 == 0 ? -1 : (j * 7 + step) % GR_KEYS;
        dst[t] = t == step % GR_T ? -1 : (step + 2 * t) % GR_RING;
        from[t] = (t + step) % GR_T; // gathered rows move with the step
    }
    for (int j = 0; j < GR_M; j++) src[j] = (j + step) % GR_T; // window 0: call rows
    for (int j = GR_M; j < 2 * GR_M; j++) src[j] = DI_BACKEND_NO_ROW;
    CK(g_b->vt->upload(g_b, g->x, x, sizeof x));
    CK(g_b->vt->upload(g_b, g->pool, pool, sizeof pool));
    CK(g_b->vt->upload(g_b, g->ring, ring, sizeof ring));
    CK(g_b->vt->upload(g_b, g->cz, cz, sizeof cz));
    CK(g_b->vt->upload(g_b, g->omega, omega, sizeof omega));
    CK(g_b->vt->upload(g_b, g->sink, sink, sizeof sink));
    CK(g_b->vt->upload(g_b, g->pos, pos, sizeof pos));
    CK(g_b->vt->upload(g_b, g->key_idx, ki, sizeof ki));
    CK(g_b->vt->upload(g_b, g->n_keys, nk, sizeof nk));
    CK(g_b->vt->upload(g_b, g->dst, dst, sizeof dst));
    CK(g_b->vt->upload(g_b, g->src, src, sizeof src));
    CK(g_b->vt->upload(g_b, g->src_rows, from, sizeof from));
}

// The step: q = W x (a tensor on the stack), per-head RMSNorm, RoPE at device positions,
// attention with max_keys at the list's capacity, scatter of o rows to device destinations,
// compressor pooling of one window and one padding window, a device copy.
static di_status gr_ops(const gr_set *g, const di_tensor *w_dev) {
    di_backend *b = g_b;
    di_tensor w = *w_dev;
    di_status st = b->vt->matmul(b, &w, g->x, GR_T, GR_D, g->y, GR_H * GR_D);
    if (st == DI_OK) st = b->vt->rmsnorm(b, g->y, GR_T * GR_H, GR_D, GR_D, NULL, 1e-6f);
    if (st == DI_OK)
        st = b->vt->rope(b, g->y, GR_T * GR_H, GR_D, GR_D, 16, g->omega, g->pos, GR_H, 1.0f, false);
    if (st == DI_OK)
        st = b->vt->attn(b, g->y, g->pool, g->key_idx, GR_KEYS, g->n_keys, GR_KEYS, g->sink, GR_T,
                         GR_H, GR_D, 0.125f, true, g->o);
    // The official recipe's ops (captured like the others).
    if (st == DI_OK) st = b->vt->round_bf16(b, g->o, GR_T * GR_H * GR_D);
    if (st == DI_OK) st = b->vt->hadamard(b, g->o, GR_T * GR_H, GR_D);
    if (st == DI_OK) st = b->vt->fake_quant(b, g->o, GR_T * GR_H, GR_D, GR_D, 16, 4, g->o);
    if (st == DI_OK)
        st = b->vt->scatter_rows(b, g->o, GR_T, GR_H * GR_D, GR_H * GR_D, g->ring, GR_H * GR_D,
                                 g->dst, g->src_rows);
    if (st == DI_OK)
        st = b->vt->compress_pool(b, g->x, g->cz, GR_D, g->x, g->cz, g->src, 2, GR_M, 1, GR_D,
                                  g->ent);
    if (st == DI_OK) st = b->vt->copy(b, g->x, g->o, sizeof(float) * GR_D);
    return st;
}

static void gr_compare(const gr_set *a, const gr_set *r, int step) {
    static float ha[GR_RING * GR_H * GR_D], hr[GR_RING * GR_H * GR_D];
    const struct {
        const float *pa, *pr;
        int64_t n;
    } outs[] = {{a->o, r->o, GR_T * GR_H * GR_D},
                {a->ring, r->ring, GR_RING * GR_H * GR_D},
                {a->ent, r->ent, 2 * GR_D},
                {a->x, r->x, GR_T * GR_D}};
    int64_t bad = 0;
    for (size_t k = 0; k < sizeof outs / sizeof outs[0]; k++) {
        bk_to(ha, outs[k].pa, sizeof(float) * (size_t)outs[k].n);
        bk_to(hr, outs[k].pr, sizeof(float) * (size_t)outs[k].n);
        bad += n_diff_f32(ha, hr, outs[k].n);
        if (k == 2) // the padding window pools to 0, the real one is finite
            for (int i = 0; i < GR_D; i++) bad += ha[GR_D + i] != 0.0f || !isfinite(ha[i]);
    }
    fprintf(stderr, "  graph replay, step %d: %lld values differ from direct launches\n", step,
            (long long)bad);
    CHECK_EQ(bad, 0);
}

static void test_graph(void) {
    const di_backend_vt *vt = g_b->vt;
    mat w = make_w(DI_TENSOR_KIND_BF16, GR_D, GR_H * GR_D);
    di_tensor wd;
    CK(vt->weight_upload(g_b, &w.t, &wd));
    gr_set a = gr_alloc(), r = gr_alloc(); // a: replayed, r: run directly
    // Run once directly (the pool's blocks), then capture on a's buffers.
    gr_upload(&a, 0);
    CK(gr_ops(&a, &wd));
    void *graph = NULL;
    CK(vt->graph_begin(g_b));
    CHECK_EQ(vt->graph_begin(g_b), DI_ERR_INVALID);
    di_status st = gr_ops(&a, &wd);
    CK(vt->graph_end(g_b, &graph));
    CK(st);
    for (int step = 1; step <= 4; step++) {
        gr_upload(&a, step);
        gr_upload(&r, step);
        CK(vt->graph_launch(g_b, graph));
        CK(gr_ops(&r, &wd));
        gr_compare(&a, &r, step);
    }
    vt->graph_destroy(g_b, graph);
    vt->graph_destroy(g_b, NULL);

    // Refused inside a capture, which then fails and is closed; the stream works afterwards.
    float h[4] = {0};
    for (int what = 0; what < 4; what++) {
        void *q = NULL;
        graph = NULL;
        CK(vt->graph_begin(g_b));
        if (what == 0) CHECK_EQ(vt->upload(g_b, a.x, h, sizeof h), DI_ERR_INVALID);
        if (what == 1) CHECK_EQ(vt->download(g_b, h, a.x, sizeof h), DI_ERR_INVALID);
        if (what == 2) CHECK_EQ(vt->sync(g_b), DI_ERR_INVALID);
        if (what == 3) CHECK_EQ(vt->alloc(g_b, 64, &q), DI_ERR_INVALID);
        CHECK_EQ(vt->graph_end(g_b, &graph), DI_ERR_INVALID);
        CHECK(graph == NULL && q == NULL);
    }
    CK(vt->upload(g_b, a.x, h, sizeof h));
    CK(vt->sync(g_b));

    // A launcher's scratch taken inside a capture stays bound to graphs: not handed out outside.
    void *in = NULL, *out = NULL;
    CK(vt->graph_begin(g_b));
    CK(di_cuda_alloc(g_cu, 12345, &in));
    CK(vt->memset(g_b, in, 0, 12345));
    di_cuda_free(g_cu, in);
    CK(vt->graph_end(g_b, &graph));
    CK(di_cuda_alloc(g_cu, 12345, &out));
    CHECK(out != in);
    di_cuda_free(g_cu, out);
    CK(vt->graph_launch(g_b, graph));
    CK(vt->sync(g_b));
    vt->graph_destroy(g_b, graph);
    gr_free(&a);
    gr_free(&r);
    free_w(&w);
}

int main(void) {
    if (di_cuda_device_count() == 0) DI_TEST_SKIP("no CUDA device");
    CK(di_cuda_backend_create(0, &g_b));
    g_cu = (di_cuda *)g_b->impl; // cuda_test.h's helpers (unused here) see the same context
    fprintf(stderr, "backend: %s\n", g_b->desc);
    CK(di_pool_create(2, &g_pool));
    CK(di_cpu_init(&g_cpu, g_pool, 4096));
    RUN(test_vtable);
    RUN(test_memory);
    RUN(test_matmul);
    RUN(test_embed);
    RUN(test_rmsnorm);
    RUN(test_rope);
    RUN(test_scale);
    RUN(test_mhc);
    RUN(test_moe);
    RUN(test_moe_tc);
    RUN(test_scatter_rows);
    RUN(test_add_ape);
    RUN(test_offset_list);
    RUN(test_compress_pool);
    RUN(test_attn);
    RUN(test_kv_rows);
    RUN(test_official_ops);
    RUN(test_indexer);
    RUN(test_v41);
    RUN(test_v41_cand_rows);
    RUN(test_other_thread);
    RUN(test_graph);
    CK(g_b->vt->sync(g_b));
    g_b->vt->destroy(g_b);
    di_cpu_deinit(&g_cpu);
    di_pool_destroy(g_pool);
    return test_finish();
}
