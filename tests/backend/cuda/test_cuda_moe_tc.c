// The routed experts' grouped GEMM on tensor cores (backend/cuda/moe_tc.cuh) against
// di_ref_matmul (backend/cpu/ref_ops.h) on the same A8 activations: FP4 (per-32 UE8M0) and FP8
// (128x128 UE8M0) experts; experts with 0, 1, 63, 64, 65, 129, 130 rows (tile of 16 or 64 rows,
// both kernels); output counts that are not multiples of the 128-feature tile; gathered (x_rows)
// and plain inputs; strided outputs; a whole layer's 256 experts; an expert outside the contract
// (NaN); shapes it refuses. Then the dispatch (di_cuda_moe_grouped_a8): decode-sized calls stay
// on the SIMT kernel, the first prefill call's check passes and turns the path on (counted), a
// corrupted first result (cu->moe_tc_fault) turns it off with the SIMT result in y, and
// DI_CUDA_MOE_TC=0 keeps it off. The whole layer in the official recipe with the path on and off
// is test_cuda_ops' test_moe_tc.
#include "backend/cuda/cuda_test.h"

#include <string.h>

#include "backend/cpu/ref_ops.h"
#include "backend/cuda/gemm.cuh"
#include "backend/cuda/moe_tc.cuh"
#include "base/thread.h"
#include "tensor/quant_ref.h"

// Tolerance per output: the reference's FP32 sum in di_ref_dot's order is within
// gamma(n/8 + 4) * sum|w_i x_i| of the exact value; the tensor cores' products are exact and
// their sums FP32, possibly truncating (not rounding to nearest) inside an MMA: within
// 2 gamma(n) * sum|w_i x_i|. A wrong element, scale, fragment or row moves an output by about
// one term (sum / n) or more, far above this for n <= 512.
#define TOL_TC_TERMS(n) (2 * gamma_k((double)(n)) + gamma_k((double)(n) / 8 + 4))

static di_pool *g_pool;
static di_cpu g_cpu;

typedef struct mat {
    di_tensor t;
    uint8_t *data, *scale; // owned
} mat;

// A random FP4 or FP8 expert [n_out, n_in] (scales 2^-9 .. 2^7, no NaN codes); pad adds bytes to
// each row (a row stride outside the tensor-core contract when not a multiple of 16).
static mat make_expert(di_tensor_kind kind, int64_t n_in, int64_t n_out, size_t pad) {
    mat m = {0};
    di_tensor *t = &m.t;
    t->name = "expert";
    t->kind = kind;
    t->ne[0] = n_in, t->ne[1] = n_out;
    if (kind == DI_TENSOR_KIND_FP8)
        t->nb1 = (size_t)n_in, t->block_out = 128, t->block_in = 128;
    else
        t->nb1 = (size_t)n_in / 2, t->block_out = 1, t->block_in = 32;
    t->nb1 += pad;
    m.data = calloc(t->nb1 * (size_t)n_out, 1);
    for (size_t i = 0; i < t->nb1 * (size_t)n_out; i++) {
        uint8_t c = (uint8_t)rnd();
        if (kind == DI_TENSOR_KIND_FP8 && (c & 0x7F) == 0x7F) c ^= 1;
        m.data[i] = c;
    }
    t->data = m.data;
    const int64_t srows = (n_out + t->block_out - 1) / t->block_out;
    const int64_t scols = (n_in + t->block_in - 1) / t->block_in;
    t->scale_nb1 = (size_t)scols + 1;
    m.scale = malloc(t->scale_nb1 * (size_t)srows);
    for (size_t i = 0; i < t->scale_nb1 * (size_t)srows; i++)
        m.scale[i] = (uint8_t)(118 + (int)(rnd() % 17));
    t->scale = m.scale;
    return m;
}

// Random A8 activations (Q8 in blocks of 128, or 32 when n_in is not a multiple of 128: e4m3
// codes times powers of two either way), n_rows rows of n_in, magnitudes spread by row.
static float *make_a8(int64_t n_rows, int64_t n_in) {
    float *x = malloc(sizeof(float) * (size_t)(n_rows * n_in));
    for (int64_t r = 0; r < n_rows; r++) {
        fill_rand(x + r * n_in, n_in, powf(2.0f, (float)(r % 7) - 3.0f));
        di_fake_quant_q8(x + r * n_in, n_in, n_in % 128 == 0 ? 128 : 32);
    }
    return x;
}

typedef struct grouped {
    int32_t E, n_rows;
    int64_t n_in, n_out, n_src, ys;
    mat *ms;
    int32_t *offsets, *x_rows; // host; x_rows NULL: src(i) = i
    float *x, *yr;
    double *tol;
    // device
    di_tensor *wdd;
    int32_t *offd, *rowsd;
    float *xd, *yd;
} grouped;

// Experts with counts[e] rows, inputs gathered from n_src rows (n_src 0: x_rows NULL, one input
// row per grouped row), the host reference and bounds, and the device copies.
static void grouped_make(grouped *G, di_tensor_kind kind, int32_t E, const int32_t *counts,
                         int64_t n_in, int64_t n_out, int64_t n_src, int64_t ys,
                         int32_t bad_expert) {
    memset(G, 0, sizeof *G);
    G->E = E, G->n_in = n_in, G->n_out = n_out, G->ys = ys;
    G->offsets = calloc((size_t)E + 1, sizeof(int32_t));
    for (int32_t e = 0; e < E; e++) G->offsets[e + 1] = G->offsets[e] + counts[e];
    G->n_rows = G->offsets[E];
    G->n_src = n_src > 0 ? n_src : G->n_rows;
    G->ms = malloc(sizeof(mat) * (size_t)E);
    di_tensor *wd = malloc(sizeof(di_tensor) * (size_t)E);
    for (int32_t e = 0; e < E; e++) {
        G->ms[e] = make_expert(kind, n_in, n_out, e == bad_expert ? 8 : 0);
        CK(di_cuda_tensor_upload(g_cu, &G->ms[e].t, &wd[e]));
    }
    if (n_src > 0) {
        G->x_rows = malloc(sizeof(int32_t) * (size_t)G->n_rows);
        for (int32_t i = 0; i < G->n_rows; i++) G->x_rows[i] = (int32_t)(rnd() % (uint64_t)n_src);
    }
    G->x = make_a8(G->n_src, n_in);
    const int64_t ny = (int64_t)G->n_rows * ys;
    if (ny <= 0 || n_out <= 0 || n_in <= 0) abort(); // every case has rows (and a range for gcc)
    G->yr = malloc(sizeof(float) * (size_t)ny);
    G->tol = calloc((size_t)ny, sizeof(double));
    float *wf = malloc(sizeof(float) * (size_t)n_out * (size_t)n_in); // one expert, dequantised
    for (int64_t i = 0; i < ny; i++) G->yr[i] = NAN; // the stride's gaps: never written
    for (int32_t e = 0; e < E; e++) {
        if (counts[e] == 0) continue;
        for (int64_t o = 0; o < n_out; o++) di_tensor_row_f32(&G->ms[e].t, o, wf + o * n_in);
        for (int32_t i = G->offsets[e]; i < G->offsets[e + 1]; i++) {
            const float *xi = G->x + (int64_t)(G->x_rows ? G->x_rows[i] : i) * n_in;
            di_ref_matmul(&g_cpu, &G->ms[e].t, xi, 1, n_in, G->yr + (int64_t)i * ys, ys);
            for (int64_t o = 0; o < n_out; o++) {
                const float *row = wf + o * n_in;
                double s = 0;
                for (int64_t c = 0; c < n_in; c++) s += fabs((double)row[c] * xi[c]);
                G->tol[(int64_t)i * ys + o] = s * TOL_TC_TERMS(n_in);
                if (e == bad_expert) G->yr[(int64_t)i * ys + o] = NAN; // outside the contract
            }
        }
    }
    free(wf);
    G->wdd = dev_from(wd, sizeof(di_tensor) * (size_t)E);
    free(wd);
    G->offd = dev_from(G->offsets, sizeof(int32_t) * ((size_t)E + 1));
    G->rowsd = G->x_rows ? dev_from(G->x_rows, sizeof(int32_t) * (size_t)G->n_rows) : NULL;
    G->xd = dev_from(G->x, sizeof(float) * (size_t)(G->n_src * n_in));
    G->yd = dev_alloc(sizeof(float) * (size_t)(ny > 0 ? ny : 1));
}

static void grouped_free(grouped *G) {
    for (int32_t e = 0; e < G->E; e++) free(G->ms[e].data), free(G->ms[e].scale);
    free(G->ms), free(G->offsets), free(G->x_rows), free(G->x), free(G->yr), free(G->tol);
    dev_free(G->wdd), dev_free(G->offd), dev_free(G->rowsd), dev_free(G->xd), dev_free(G->yd);
}

static int64_t grouped_check(const grouped *G, const char *what) {
    const int64_t ny = (int64_t)G->n_rows * G->ys;
    float *y = malloc(sizeof(float) * (size_t)(ny > 0 ? ny : 1));
    dev_to(y, G->yd, sizeof(float) * (size_t)(ny > 0 ? ny : 1));
    const int64_t bad = check_bounds(what, y, G->yr, G->tol, ny);
    free(y);
    return bad;
}

static const char *kind_str(di_tensor_kind k) {
    return k == DI_TENSOR_KIND_FP8 ? "FP8" : "FP4";
}

// The tensor-core kernel itself on one case.
static void tc_case(di_tensor_kind kind, int32_t E, const int32_t *counts, int64_t n_in,
                    int64_t n_out, int64_t n_src, int64_t ys, int32_t bad_expert, const char *tag) {
    grouped G;
    grouped_make(&G, kind, E, counts, n_in, n_out, n_src, ys, bad_expert);
    dev_poison(G.yd, sizeof(float) * (size_t)((int64_t)G.n_rows * ys));
    CK(di_cuda_matmul_grouped_tc(g_cu, kind, G.wdd, E, n_out, n_in, G.offd, G.n_rows, G.rowsd, G.xd,
                                 G.n_src, n_in, G.yd, ys));
    char what[128];
    snprintf(what, sizeof what, "tc %s %s E=%d rows=%d %lldx%lld", kind_str(kind), tag, E, G.n_rows,
             (long long)n_out, (long long)n_in);
    CHECK(grouped_check(&G, what) == 0);
    grouped_free(&G);
}

static void test_tc_kernel(void) {
    if (g_cu->cc_major < 8) {
        fprintf(stderr, "  sm_%d%d: no BF16 mma.sync; the kernel must refuse\n", g_cu->cc_major,
                g_cu->cc_minor);
        const int32_t one[1] = {1};
        grouped G;
        grouped_make(&G, DI_TENSOR_KIND_FP4, 1, one, 128, 16, 0, 16, -1);
        CHECK(di_cuda_matmul_grouped_tc(g_cu, DI_TENSOR_KIND_FP4, G.wdd, 1, 16, 128, G.offd, 1,
                                        NULL, G.xd, 1, 128, G.yd, 16) == DI_ERR_UNSUPPORTED);
        grouped_free(&G);
        return;
    }
    // 16-row tiles (rows < 40 per expert): 0, 1, 17 rows; 64-row tiles: 63, 64, 65, 129, 130.
    static const int32_t narrow[9] = {0, 1, 17, 3, 0, 16, 2, 9, 1};
    static const int32_t wide[9] = {0, 1, 63, 64, 65, 0, 130, 129, 200};
    for (int k = 0; k < 2; k++) {
        const di_tensor_kind kind = k ? DI_TENSOR_KIND_FP8 : DI_TENSOR_KIND_FP4;
        const int64_t n_in = k ? 384 : 256; // FP8: 3 scale columns; FP4: 8
        tc_case(kind, 9, narrow, n_in, 200, 50, 200, -1, "narrow gathered");
        tc_case(kind, 9, wide, n_in, 200, 50, 203, -1, "wide gathered strided");
        tc_case(kind, 9, wide, n_in, 136, 0, 136, -1, "wide plain");
        tc_case(kind, 9, narrow, 128, 264, 0, 264, -1, "narrow plain");
        // n_out 8 (one MMA row group, the rest of the 128-feature tile masked), K of one step.
        tc_case(kind, 9, wide, 64 * (k ? 2 : 1), 8, 30, 8, -1, "8 features");
        // An expert with a row stride outside the contract: its rows NaN, the others right.
        tc_case(kind, 9, wide, n_in, 136, 50, 136, 3, "bad expert 3");
    }
    // A whole layer: 256 experts, 6 of them per token for 256 and 1024 tokens.
    for (int r = 0; r < 2; r++) {
        const int32_t T = r ? 2048 : 256, E = 256, K = 6; // 16-row tiles, then 64-row tiles
        int32_t counts[256] = {0};
        for (int32_t p = 0; p < T * K; p++) counts[rnd() % (uint64_t)E]++;
        tc_case(DI_TENSOR_KIND_FP4, E, counts, 256, 192, T, 192, -1, "layer");
    }
    {
        int32_t counts[64] = {0}; // 3072 rows over 64 experts: 64-row tiles
        for (int32_t p = 0; p < 512 * 6; p++) counts[rnd() % 64]++;
        tc_case(DI_TENSOR_KIND_FP8, 64, counts, 256, 256, 512, 256, -1, "layer");
    }
    // Refused: K not a multiple of 64, another kind; nothing written.
    const int32_t one[1] = {1};
    grouped G;
    grouped_make(&G, DI_TENSOR_KIND_FP4, 1, one, 128, 16, 0, 16, -1);
    CHECK(di_cuda_matmul_grouped_tc(g_cu, DI_TENSOR_KIND_FP4, G.wdd, 1, 16, 96, G.offd, 1, NULL,
                                    G.xd, 1, 96, G.yd, 16) == DI_ERR_UNSUPPORTED);
    CHECK(di_cuda_matmul_grouped_tc(g_cu, DI_TENSOR_KIND_BF16, G.wdd, 1, 16, 128, G.offd, 1, NULL,
                                    G.xd, 1, 128, G.yd, 16) == DI_ERR_UNSUPPORTED);
    grouped_free(&G);
}

// ---- dispatch and the first call's check ----

static void dispatch_call(grouped *G, di_tensor_kind kind, int32_t n_tok, const char *what) {
    dev_poison(G->yd, sizeof(float) * (size_t)((int64_t)G->n_rows * G->ys));
    CK(di_cuda_moe_grouped_a8(g_cu, kind, G->wdd, G->E, G->n_out, G->n_in, G->offd, G->n_rows,
                              G->rowsd, G->xd, G->n_src, G->n_in, G->yd, G->ys, n_tok, 0));
    CHECK(grouped_check(G, what) == 0);
}

static void test_dispatch(void) {
    const bool tc = g_cu->cc_major >= 8;
    int32_t counts[16] = {0};
    const int32_t T = 200, K = 4;
    for (int32_t p = 0; p < T * K; p++) counts[rnd() % 16]++;
    grouped G;
    grouped_make(&G, DI_TENSOR_KIND_FP4, 16, counts, 256, 136, T, 136, -1);
    g_cu->moe_tc = 0, g_cu->n_moe_tc_calls = 0, g_cu->moe_tc_fault = false;
    // Decode-sized calls (fewer tokens than DI_BACKEND_TC_MIN_ROWS): the SIMT kernel, no check.
    dispatch_call(&G, DI_TENSOR_KIND_FP4, 64, "dispatch 64 tokens (SIMT)");
    CHECK(g_cu->moe_tc == 0 && g_cu->n_moe_tc_calls == 0);
    // A capture in progress (the flag alone: nothing is captured): the SIMT kernel, no host check.
    dev_poison(G.yd, sizeof(float) * (size_t)((int64_t)G.n_rows * G.ys));
    g_cu->capturing = true;
    const di_status st =
        di_cuda_moe_grouped_a8(g_cu, DI_TENSOR_KIND_FP4, G.wdd, G.E, G.n_out, G.n_in, G.offd,
                               G.n_rows, G.rowsd, G.xd, G.n_src, G.n_in, G.yd, G.ys, T, 0);
    g_cu->capturing = false;
    CHECK(st == DI_OK);
    CHECK(grouped_check(&G, "dispatch while capturing (SIMT)") == 0);
    CHECK(g_cu->moe_tc == 0 && g_cu->n_moe_tc_calls == 0);
    // The first prefill call: checked against the SIMT kernel, on from then on.
    dispatch_call(&G, DI_TENSOR_KIND_FP4, T, "dispatch first prefill (checked)");
    if (tc && g_cu->moe_tc != 1)
        fprintf(stderr, "the tensor-core check did not pass (moe_tc %d; see the log)\n",
                g_cu->moe_tc);
    CHECK(g_cu->moe_tc == (tc ? 1 : 0));
    CHECK(g_cu->n_moe_tc_calls == (tc ? 1 : 0));
    dispatch_call(&G, DI_TENSOR_KIND_FP4, T, "dispatch second prefill");
    CHECK(g_cu->n_moe_tc_calls == (tc ? 2 : 0));
    // A corrupted first result: mismatch, off for the context, y is the SIMT result.
    g_cu->moe_tc = 0, g_cu->n_moe_tc_calls = 0, g_cu->moe_tc_fault = true;
    dispatch_call(&G, DI_TENSOR_KIND_FP4, T, "dispatch corrupted first call");
    g_cu->moe_tc_fault = false;
    CHECK(g_cu->moe_tc == (tc ? -1 : 0));
    CHECK(g_cu->n_moe_tc_calls == 0);
    dispatch_call(&G, DI_TENSOR_KIND_FP4, T, "dispatch after the mismatch (SIMT)");
    CHECK(g_cu->n_moe_tc_calls == 0);
    // The environment switch, read at the first eligible call.
    g_cu->moe_tc = 0;
    setenv("DI_CUDA_MOE_TC", "0", 1);
    dispatch_call(&G, DI_TENSOR_KIND_FP4, T, "dispatch DI_CUDA_MOE_TC=0 (SIMT)");
    unsetenv("DI_CUDA_MOE_TC");
    CHECK(g_cu->moe_tc == (tc ? -1 : 0));
    CHECK(g_cu->n_moe_tc_calls == 0);
    g_cu->moe_tc = 0;
    grouped_free(&G);
}

int main(void) {
    cuda_test_init();
    CK(di_pool_create(2, &g_pool));
    CK(di_cpu_init(&g_cpu, g_pool, 4096));
    RUN(test_tc_kernel);
    RUN(test_dispatch);
    di_cpu_deinit(&g_cpu);
    di_pool_destroy(g_pool);
    return cuda_test_finish();
}
