// CUDA matmul (backend/cuda/gemm.cuh) against di_ref_matmul (backend/cpu/ref_ops.h): every weight
// kind (F32, F16, BF16, FP8 128x128 UE8M0, FP4 per-32 UE8M0), the gemv, tiled and dispatching
// entry points, 1 token up to more than one 64-token tile, row and column counts that are not
// multiples of the 8-row block, the 64x64 tile, the 8/16-element vectors or the scale block, packed
// rows (16-element vector path; 8-element for n_in = 200) and padded rows / strided activations
// (scalar path), row views inside the
// FP8 scale grid, the grouped expert GEMM (one launch for all experts, some without tokens; expert
// layouts the shape does not tell: column blocks of 8, padded rows; more than 65,535 experts),
// token counts past the grid-row limit (gemv, tiled), A8
// activation quantisation (bit-exact) and the cuBLASLt FP8 x FP8 block-scaled GEMM.
#include "backend/cuda/cuda_test.h"

#include <string.h>

#include "backend/cpu/ref_ops.h"
#include "backend/cuda/gemm.cuh"
#include "base/thread.h"
#include "tensor/quant_ref.h"

// Tolerance: the reference sums each output in di_ref_dot's order (within gamma(n/8 + 4) *
// sum|w_i x_i| of the exact value); the GPU's order is at worst one sequential chain of n
// roundings (tiled) (within gamma(n) * sum|w_i x_i|). Their difference is bounded by the sum.
// Shapes with n <= 1024 keep that bound below one term's size (|w x| ~ sum / n), so a wrong
// element, scale or column is caught.
#define TOL_REF_TERMS(n) (gamma_k((double)(n)) + gamma_k((double)(n) / 8 + 4))

static di_pool *g_pool;
static di_cpu g_cpu;

typedef struct mat {
    di_tensor t;
    void *data;     // owned
    uint8_t *scale; // owned
} mat;

// Random matrix of `kind`; padded rows (nb1 + 3) force the scalar decode path. block_in > 0
// replaces the block-scaled kinds' column block (FP8 128, FP4 32).
static mat make_mat_block(di_tensor_kind kind, int64_t n_in, int64_t n_out, bool padded,
                          int32_t block_in) {
    mat m = {0};
    di_tensor *t = &m.t;
    t->name = "test";
    t->kind = kind;
    t->ne[0] = n_in;
    t->ne[1] = n_out;
    switch (kind) {
    case DI_TENSOR_KIND_F32:
        t->nb1 = 4 * (size_t)n_in;
        break;
    case DI_TENSOR_KIND_F16:
    case DI_TENSOR_KIND_BF16:
        t->nb1 = 2 * (size_t)n_in;
        break;
    case DI_TENSOR_KIND_FP8:
        t->nb1 = (size_t)n_in, t->block_out = 128, t->block_in = 128;
        break;
    case DI_TENSOR_KIND_FP4:
        t->nb1 = (size_t)n_in / 2, t->block_out = 1, t->block_in = 32;
        break;
    default: // the GGUF block kinds are CPU-only (di_cuda_supports_op says no)
        fprintf(stderr, "make_mat: %s is not a GPU kind\n", di_tensor_kind_name(kind));
        abort();
    }
    if (block_in > 0 && (kind == DI_TENSOR_KIND_FP8 || kind == DI_TENSOR_KIND_FP4))
        t->block_in = block_in;
    if (padded) t->nb1 += 3;
    uint8_t *d = calloc(t->nb1 * (size_t)n_out + 16, 1);
    for (int64_t r = 0; r < n_out; r++) {
        uint8_t *row = d + (size_t)r * t->nb1;
        for (int64_t i = 0; i < n_in; i++) {
            float v = rndf() * 2.0f;
            switch (kind) {
            case DI_TENSOR_KIND_F32:
                memcpy(row + 4 * i, &v, 4);
                break;
            case DI_TENSOR_KIND_F16: { // finite binary16 with a random exponent in [-14, 1]
                uint16_t h = (uint16_t)(rnd() & 0xBFFF);
                memcpy(row + 2 * i, &h, 2);
                break;
            }
            case DI_TENSOR_KIND_BF16: {
                uint16_t h = di_f32_to_bf16(v);
                memcpy(row + 2 * i, &h, 2);
                break;
            }
            case DI_TENSOR_KIND_FP8: {
                uint8_t c = (uint8_t)rnd();
                if ((c & 0x7F) == 0x7F) c ^= 1; // no NaN codes: NaN propagation is its own case
                row[i] = c;
                break;
            }
            case DI_TENSOR_KIND_FP4:
                if (i % 2 == 0) row[i / 2] = (uint8_t)(rnd() & 0xFF);
                break;
            default: // refused above
                break;
            }
        }
    }
    m.data = d;
    t->data = d;
    if (kind == DI_TENSOR_KIND_FP8 || kind == DI_TENSOR_KIND_FP4) {
        int64_t srows = (n_out + t->block_out - 1) / t->block_out;
        int64_t scols = (n_in + t->block_in - 1) / t->block_in;
        t->scale_nb1 = (size_t)scols + 1;
        m.scale = malloc(t->scale_nb1 * (size_t)srows);
        for (size_t i = 0; i < t->scale_nb1 * (size_t)srows; i++)
            m.scale[i] = (uint8_t)(118 + (int)(rnd() % 17)); // 2^-9 .. 2^7
        t->scale = m.scale;
    }
    return m;
}

static mat make_mat(di_tensor_kind kind, int64_t n_in, int64_t n_out, bool padded) {
    return make_mat_block(kind, n_in, n_out, padded, 0);
}

static void free_mat(mat *m) {
    free(m->data);
    free(m->scale);
}

// sum_i |W[o,i] x[t,i]| for every output: the scale of the rounding bound.
static void abs_terms(const di_tensor *w, const float *x, int64_t n_tok, int64_t xs, double *mag,
                      int64_t ys) {
    const int64_t n = w->ne[0];
    float *row = malloc(sizeof(float) * (size_t)n);
    for (int64_t o = 0; o < w->ne[1]; o++) {
        di_tensor_row_f32(w, o, row);
        for (int64_t t = 0; t < n_tok; t++) {
            double s = 0;
            for (int64_t i = 0; i < n; i++) s += fabs((double)row[i] * x[t * xs + i]);
            mag[t * ys + o] = s;
        }
    }
    free(row);
}

typedef di_status (*matmul_fn)(di_cuda *, const di_tensor *, const float *, int64_t, int64_t,
                               float *, int64_t);

static const char *kind_name(di_tensor_kind k) {
    return di_tensor_kind_name(k);
}

// One weight, every variant, several token counts.
static void gemm_case(const di_tensor *w, bool strided, const char *tag) {
    static const int64_t toks[] = {1, 2, 3, 8, 9, 31, 64, 65, 130};
    static const matmul_fn fns[] = {di_cuda_matmul_gemv, di_cuda_matmul_tiled, di_cuda_matmul};
    static const char *const fn_names[] = {"gemv", "tiled", "dispatch"};
    const int64_t n = w->ne[0], n_out = w->ne[1];
    const int64_t xs = strided ? n + 5 : n, ys = strided ? n_out + 3 : n_out;
    di_tensor wd;
    CK(di_cuda_tensor_upload(g_cu, w, &wd));
    for (size_t ti = 0; ti < sizeof toks / sizeof toks[0]; ti++) {
        const int64_t nt = toks[ti];
        const size_t xb = sizeof(float) * (size_t)(nt * xs), yb = sizeof(float) * (size_t)(nt * ys);
        float *x = malloc(xb), *yr = malloc(yb), *y = malloc(yb);
        double *tol = malloc(sizeof(double) * (size_t)(nt * ys));
        fill_rand(x, nt * xs, 1.0f);
        for (int64_t i = 0; i < nt * ys; i++) yr[i] = NAN, tol[i] = 0;
        di_ref_matmul(&g_cpu, w, x, nt, xs, yr, ys);
        abs_terms(w, x, nt, xs, tol, ys);
        for (int64_t i = 0; i < nt * ys; i++) tol[i] *= TOL_REF_TERMS(n);
        float *xd = dev_from(x, xb), *yd = dev_alloc(yb);
        for (int f = 0; f < 3; f++) {
            dev_poison(yd, yb);
            CK(fns[f](g_cu, &wd, xd, nt, xs, yd, ys));
            dev_to(y, yd, yb);
            // Gaps between strided output rows are never written: poison must survive there.
            int64_t gaps_bad = 0;
            for (int64_t t = 0; t < nt; t++)
                for (int64_t o = n_out; o < ys; o++) gaps_bad += !isnan(y[t * ys + o]);
            CHECK(gaps_bad == 0);
            for (int64_t t = 0; t < nt; t++)
                for (int64_t o = n_out; o < ys; o++) y[t * ys + o] = NAN;
            char what[160];
            snprintf(what, sizeof what, "%s %s %lldx%lld T=%lld %s", tag, kind_name(w->kind),
                     (long long)n_out, (long long)n, (long long)nt, fn_names[f]);
            CHECK(check_bounds(what, y, yr, tol, nt * ys) == 0);
        }
        dev_free(xd);
        dev_free(yd);
        free(x), free(yr), free(y), free(tol);
    }
}

static void test_kinds(void) {
    static const di_tensor_kind kinds[] = {DI_TENSOR_KIND_F32, DI_TENSOR_KIND_F16,
                                           DI_TENSOR_KIND_BF16, DI_TENSOR_KIND_FP8,
                                           DI_TENSOR_KIND_FP4};
    static const int64_t shapes[][2] = {{32, 1},   {128, 128}, {256, 130},
                                        {196, 67}, {200, 33},  {1024, 257}};
    for (size_t k = 0; k < 5; k++) {
        for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; s++) {
            for (int variant = 0; variant < 2; variant++) {
                mat m = make_mat(kinds[k], shapes[s][0], shapes[s][1], variant == 1);
                gemm_case(&m.t, variant == 1, variant ? "padded+strided" : "packed");
                free_mat(&m);
            }
        }
    }
}

// A row view starting inside the FP8 scale grid (rows 70..269 of 300): the upload keeps only the
// covering scale rows and row0 mod 128.
static void test_row_view(void) {
    mat m = make_mat(DI_TENSOR_KIND_FP8, 256, 300, false);
    di_tensor v = di_tensor_rows(&m.t, 70, 200);
    gemm_case(&v, false, "view");
    free_mat(&m);
}

// Grouped experts: E experts, rows grouped per expert (some experts empty, one with > 8 rows so
// the per-expert loop runs twice), inputs gathered through x_rows.
static void test_grouped(void) {
    const int32_t E = 7;
    const int64_t n_in = 256, n_out = 136, n_src = 40;
    const int32_t counts[7] = {3, 0, 17, 1, 0, 9, 8};
    int32_t offsets[8] = {0};
    for (int e = 0; e < E; e++) offsets[e + 1] = offsets[e] + counts[e];
    const int32_t n_rows = offsets[E];
    for (int kind = 0; kind < 2; kind++) {
        const di_tensor_kind k = kind ? DI_TENSOR_KIND_FP4 : DI_TENSOR_KIND_FP8;
        mat ms[7];
        di_tensor wd[7];
        for (int e = 0; e < E; e++) {
            ms[e] = make_mat(k, n_in, n_out, false);
            CK(di_cuda_tensor_upload(g_cu, &ms[e].t, &wd[e]));
        }
        int32_t *x_rows = malloc(sizeof(int32_t) * (size_t)n_rows);
        for (int32_t i = 0; i < n_rows; i++) x_rows[i] = (int32_t)(rnd() % (uint64_t)n_src);
        float *x = malloc(sizeof(float) * (size_t)(n_src * n_in));
        fill_rand(x, n_src * n_in, 1.0f);
        float *yr = malloc(sizeof(float) * (size_t)(n_rows * n_out));
        float *y = malloc(sizeof(float) * (size_t)(n_rows * n_out));
        double *tol = malloc(sizeof(double) * (size_t)(n_rows * n_out));
        for (int e = 0; e < E; e++)
            for (int32_t i = offsets[e]; i < offsets[e + 1]; i++) {
                di_ref_matmul(&g_cpu, &ms[e].t, x + (int64_t)x_rows[i] * n_in, 1, n_in,
                              yr + (int64_t)i * n_out, n_out);
                abs_terms(&ms[e].t, x + (int64_t)x_rows[i] * n_in, 1, n_in,
                          tol + (int64_t)i * n_out, n_out);
            }
        for (int64_t i = 0; i < n_rows * n_out; i++) tol[i] *= TOL_REF_TERMS(n_in);
        di_tensor *wdd = dev_from(wd, sizeof wd);
        int32_t *offd = dev_from(offsets, sizeof offsets);
        int32_t *rowsd = dev_from(x_rows, sizeof(int32_t) * (size_t)n_rows);
        float *xd = dev_from(x, sizeof(float) * (size_t)(n_src * n_in));
        float *yd = dev_alloc(sizeof(float) * (size_t)(n_rows * n_out));
        // Both kernels: rows_hint 1 (one-token passes; experts with 17 rows take 17 passes) and 0.
        for (int hint = 0; hint < 2; hint++) {
            dev_poison(yd, sizeof(float) * (size_t)(n_rows * n_out));
            CK(di_cuda_matmul_grouped(g_cu, wdd, E, n_out, n_in, offd, rowsd, xd, n_in, yd, n_out,
                                      hint));
            dev_to(y, yd, sizeof(float) * (size_t)(n_rows * n_out));
            char what[64];
            snprintf(what, sizeof what, "grouped %s rows_hint %d", kind ? "FP4" : "FP8", hint);
            CHECK(check_bounds(what, y, yr, tol, n_rows * n_out) == 0);
        }
        for (int e = 0; e < E; e++) free_mat(&ms[e]);
        dev_free(wdd), dev_free(offd), dev_free(rowsd), dev_free(xd), dev_free(yd);
        free(x_rows), free(x), free(yr), free(y), free(tol);
    }
}

// Grouped experts whose layout the shape alone does not tell: n_in a multiple of 16, but FP8 /
// FP4 column blocks of 8 (one scale per 8 columns: a 16-wide decode would apply one scale to two
// blocks) and padded rows (nb1 + 3: 16-byte loads would be misaligned). The grouped kernel must
// take each expert's vector width from its kind, block_in and row stride, as gemv does (before:
// from n_in alone, wrong values or a misaligned-address fault).
static void test_grouped_layouts(void) {
    const int32_t E = 3;
    const int64_t n_in = 256, n_out = 40, n_src = 9;
    const int32_t offsets[4] = {0, 5, 5, 14};
    const int32_t n_rows = offsets[E];
    static const struct {
        di_tensor_kind kind;
        bool padded;
        int32_t block_in;
    } cases[] = {
        {DI_TENSOR_KIND_FP8, false, 8}, {DI_TENSOR_KIND_FP4, false, 8},
        {DI_TENSOR_KIND_FP8, true, 0},  {DI_TENSOR_KIND_FP4, true, 0},
        {DI_TENSOR_KIND_BF16, true, 0}, {DI_TENSOR_KIND_F32, true, 0},
    };
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        mat ms[3];
        di_tensor wd[3];
        for (int e = 0; e < E; e++) {
            ms[e] = make_mat_block(cases[c].kind, n_in, n_out, cases[c].padded, cases[c].block_in);
            CK(di_cuda_tensor_upload(g_cu, &ms[e].t, &wd[e]));
        }
        int32_t x_rows[14];
        for (int32_t i = 0; i < n_rows; i++) x_rows[i] = (int32_t)(rnd() % (uint64_t)n_src);
        float x[9 * 256], yr[14 * 40], y[14 * 40];
        double tol[14 * 40];
        fill_rand(x, n_src * n_in, 1.0f);
        for (int e = 0; e < E; e++)
            for (int32_t i = offsets[e]; i < offsets[e + 1]; i++) {
                di_ref_matmul(&g_cpu, &ms[e].t, x + (int64_t)x_rows[i] * n_in, 1, n_in,
                              yr + (int64_t)i * n_out, n_out);
                abs_terms(&ms[e].t, x + (int64_t)x_rows[i] * n_in, 1, n_in,
                          tol + (int64_t)i * n_out, n_out);
            }
        for (int64_t i = 0; i < n_rows * n_out; i++) tol[i] *= TOL_REF_TERMS(n_in);
        di_tensor *wdd = dev_from(wd, sizeof wd);
        int32_t *offd = dev_from(offsets, sizeof offsets), *rowsd = dev_from(x_rows, sizeof x_rows);
        float *xd = dev_from(x, sizeof x), *yd = dev_alloc(sizeof y);
        for (int hint = 0; hint < 2; hint++) {
            dev_poison(yd, sizeof y);
            CK(di_cuda_matmul_grouped(g_cu, wdd, E, n_out, n_in, offd, rowsd, xd, n_in, yd, n_out,
                                      hint));
            dev_to(y, yd, sizeof y);
            char what[96];
            snprintf(what, sizeof what, "grouped %s%s block_in %d rows_hint %d",
                     kind_name(cases[c].kind), cases[c].padded ? " padded" : "",
                     (int)ms[0].t.block_in, hint);
            CHECK(check_bounds(what, y, yr, tol, n_rows * n_out) == 0);
        }
        for (int e = 0; e < E; e++) free_mat(&ms[e]);
        dev_free(wdd), dev_free(offd), dev_free(rowsd), dev_free(xd), dev_free(yd);
    }
}

// More experts than gridDim.y's 65,535 (one grid row per expert failed to launch): two weights
// alternate over the experts (a wrong expert index picks the other), tokens on a few experts
// below the limit and on every expert past it.
static void test_grouped_many_experts(void) {
    const int32_t E = 65535 + 6;
    const int64_t n_in = 16, n_out = 5, n_src = 7;
    mat ms[2];
    di_tensor wd[2];
    for (int k = 0; k < 2; k++) {
        ms[k] = make_mat(DI_TENSOR_KIND_BF16, n_in, n_out, false);
        CK(di_cuda_tensor_upload(g_cu, &ms[k].t, &wd[k]));
    }
    di_tensor *experts = malloc(sizeof(di_tensor) * (size_t)E);
    int32_t *offsets = malloc(sizeof(int32_t) * (size_t)(E + 1));
    offsets[0] = 0;
    for (int32_t e = 0; e < E; e++) {
        experts[e] = wd[e & 1];
        offsets[e + 1] = offsets[e] + (e >= 65535 ? 1 + (e & 1) : e % 9973 == 0 ? 1 : 0);
    }
    const int32_t n_rows = offsets[E];
    int32_t *x_rows = malloc(sizeof(int32_t) * (size_t)n_rows);
    for (int32_t i = 0; i < n_rows; i++) x_rows[i] = (int32_t)(rnd() % (uint64_t)n_src);
    float x[7 * 16];
    fill_rand(x, n_src * n_in, 1.0f);
    float *yr = malloc(sizeof(float) * (size_t)(n_rows * n_out)),
          *y = malloc(sizeof(float) * (size_t)(n_rows * n_out));
    double *tol = malloc(sizeof(double) * (size_t)(n_rows * n_out));
    int64_t past = 0;
    for (int32_t e = 0; e < E; e++)
        for (int32_t i = offsets[e]; i < offsets[e + 1]; i++) {
            di_ref_matmul(&g_cpu, &ms[e & 1].t, x + (int64_t)x_rows[i] * n_in, 1, n_in,
                          yr + (int64_t)i * n_out, n_out);
            abs_terms(&ms[e & 1].t, x + (int64_t)x_rows[i] * n_in, 1, n_in,
                      tol + (int64_t)i * n_out, n_out);
            past += e >= 65535;
        }
    for (int64_t i = 0; i < n_rows * n_out; i++) tol[i] *= TOL_REF_TERMS(n_in);
    di_tensor *wdd = dev_from(experts, sizeof(di_tensor) * (size_t)E);
    int32_t *offd = dev_from(offsets, sizeof(int32_t) * (size_t)(E + 1));
    int32_t *rowsd = dev_from(x_rows, sizeof(int32_t) * (size_t)n_rows);
    float *xd = dev_from(x, sizeof x), *yd = dev_alloc(sizeof(float) * (size_t)(n_rows * n_out));
    for (int hint = 0; hint < 2; hint++) {
        dev_poison(yd, sizeof(float) * (size_t)(n_rows * n_out));
        CK(di_cuda_matmul_grouped(g_cu, wdd, E, n_out, n_in, offd, rowsd, xd, n_in, yd, n_out,
                                  hint));
        dev_to(y, yd, sizeof(float) * (size_t)(n_rows * n_out));
        char what[96];
        snprintf(what, sizeof what, "grouped E=%d (%lld rows past 65535) hint %d", E,
                 (long long)past, hint);
        CHECK(check_bounds(what, y, yr, tol, n_rows * n_out) == 0);
    }
    for (int k = 0; k < 2; k++) free_mat(&ms[k]);
    dev_free(wdd), dev_free(offd), dev_free(rowsd), dev_free(xd), dev_free(yd);
    free(experts), free(offsets), free(x_rows), free(yr), free(y), free(tol);
}

// Token counts past gridDim.y's 65,535 for the kernels with one grid row per token pass: gemv
// (8 tokens a row: > 524,280 tokens) and tiled (64 a row: > 4,194,240), tiny widths (n_in 2, one
// output row). Before, both failed to launch.
static void test_many_tokens(void) {
    static const int64_t toks[2] = {65535 * 8 + 13, 65535 * 64 + 70};
    static const matmul_fn fns[2] = {di_cuda_matmul_gemv, di_cuda_matmul_tiled};
    static const char *const names[2] = {"gemv", "tiled"};
    const int64_t n_in = 2, n_out = 1;
    mat m = make_mat(DI_TENSOR_KIND_F32, n_in, n_out, false);
    di_tensor wd;
    CK(di_cuda_tensor_upload(g_cu, &m.t, &wd));
    for (int f = 0; f < 2; f++) {
        const int64_t nt = toks[f];
        float *x = malloc(sizeof(float) * (size_t)(nt * n_in));
        float *yr = malloc(sizeof(float) * (size_t)nt), *y = malloc(sizeof(float) * (size_t)nt);
        double *tol = malloc(sizeof(double) * (size_t)nt);
        fill_rand(x, nt * n_in, 1.0f);
        di_ref_matmul(&g_cpu, &m.t, x, nt, n_in, yr, n_out);
        abs_terms(&m.t, x, nt, n_in, tol, n_out);
        for (int64_t i = 0; i < nt; i++) tol[i] *= TOL_REF_TERMS(n_in);
        float *xd = dev_from(x, sizeof(float) * (size_t)(nt * n_in));
        float *yd = dev_alloc(sizeof(float) * (size_t)nt);
        dev_poison(yd, sizeof(float) * (size_t)nt);
        CK(fns[f](g_cu, &wd, xd, nt, n_in, yd, n_out));
        dev_to(y, yd, sizeof(float) * (size_t)nt);
        char what[64];
        snprintf(what, sizeof what, "%s F32 1x2 T=%lld", names[f], (long long)nt);
        CHECK(check_bounds(what, y, yr, tol, nt) == 0);
        dev_free(xd), dev_free(yd);
        free(x), free(yr), free(y), free(tol);
    }
    free_mat(&m);
}

// ---- A8 and the cuBLASLt block-scaled FP8 GEMM (official recipe) ----

// A8 on the device against di_act_quant_a8: codes times scales must give the CPU's values bit for
// bit (magnitudes spread over blocks so the scales differ, one all-tiny block for the 1e-4 floor).
static void test_act_quant(void) {
    const int64_t T = 5, n = 512, xs = n + 4;
    float *x = malloc(sizeof(float) * (size_t)(T * xs)), *want = malloc(sizeof(float) * (size_t)n);
    for (int64_t i = 0; i < T * xs; i++) {
        const int64_t b = (i % xs) / 128;
        x[i] = rndf() * (b == 1 ? 1e-6f : powf(2.0f, (float)(b * 5 % 9) - 3.0f));
    }
    uint8_t *codes = malloc((size_t)(T * n));
    float *scales = malloc(sizeof(float) * (size_t)(T * n / 128));
    float *xd = dev_from(x, sizeof(float) * (size_t)(T * xs));
    uint8_t *cd = dev_alloc((size_t)(T * n));
    float *sd = dev_alloc(sizeof(float) * (size_t)(T * n / 128));
    dev_poison(cd, (size_t)(T * n));
    dev_poison(sd, sizeof(float) * (size_t)(T * n / 128));
    CK(di_cuda_act_quant_a8(g_cu, xd, T, xs, n, cd, sd));
    dev_to(codes, cd, (size_t)(T * n));
    dev_to(scales, sd, sizeof(float) * (size_t)(T * n / 128));
    int64_t bad = 0;
    for (int64_t t = 0; t < T; t++) {
        memcpy(want, x + t * xs, sizeof(float) * (size_t)n);
        di_act_quant_a8(want, n);
        for (int64_t i = 0; i < n; i++) {
            const float got = di_e4m3_to_f32(codes[t * n + i]) * scales[t * (n / 128) + i / 128];
            bad += !(got == want[i]); // -0 == +0 is fine; any other difference is not
        }
    }
    fprintf(stderr, "  act_quant_a8 %lldx%lld: %lld values differ from di_act_quant_a8\n",
            (long long)T, (long long)n, (long long)bad);
    CHECK(bad == 0);
    CHECK(di_cuda_act_quant_a8(g_cu, xd, T, xs, 100, cd, sd) == DI_ERR_INVALID);
    dev_free(xd), dev_free(cd), dev_free(sd);
    free(x), free(want), free(codes), free(scales);
}

// Hopper's FP8 tensor cores accumulate with fewer than 24 mantissa bits between the promotions
// to FP32 that cuBLASLt does once per 128-deep block (DeepSeek-V3 report §3.3.2: ~14 bits), so
// the bound is 2^-11 of the sum of |terms| rather than gamma(K): still ~100x below one term's
// size for K <= 2048, so a wrong scale, block or transpose fails.
#define TOL_FP8_TC 4.8828125e-4

// strided: output rows n_out + 3 apart (the padded-buffer path), else packed (cuBLASLt writes y
// directly when n_out is a multiple of 4).
static void lt_case(int64_t n_out, int64_t n_in, int64_t T, bool strided) {
    mat m = make_mat(DI_TENSOR_KIND_FP8, n_in, n_out, false);
    di_tensor wd;
    CK(di_cuda_tensor_upload(g_cu, &m.t, &wd));
    const int64_t ys = strided ? n_out + 3 : n_out;
    float *x = malloc(sizeof(float) * (size_t)(T * n_in)),
          *xq = malloc(sizeof(float) * (size_t)(T * n_in));
    float *yr = malloc(sizeof(float) * (size_t)(T * ys)),
          *y = malloc(sizeof(float) * (size_t)(T * ys));
    double *tol = malloc(sizeof(double) * (size_t)(T * ys));
    fill_rand(x, T * n_in, 1.0f);
    memcpy(xq, x, sizeof(float) * (size_t)(T * n_in));
    for (int64_t t = 0; t < T; t++) di_act_quant_a8(xq + t * n_in, n_in);
    for (int64_t i = 0; i < T * ys; i++) yr[i] = NAN, tol[i] = 0;
    di_ref_matmul(&g_cpu, &m.t, xq, T, n_in, yr, ys);
    abs_terms(&m.t, xq, T, n_in, tol, ys);
    for (int64_t i = 0; i < T * ys; i++) tol[i] *= TOL_FP8_TC;
    float *xd = dev_from(x, sizeof(float) * (size_t)(T * n_in)),
          *yd = dev_alloc(sizeof(float) * (size_t)(T * ys));
    uint8_t *cd = dev_alloc((size_t)(T * n_in));
    float *sd = dev_alloc(sizeof(float) * (size_t)(T * n_in / 128));
    float *wsd = dev_alloc(sizeof(float) * (size_t)(((n_out + 127) / 128) * (n_in / 128)));
    dev_poison(yd, sizeof(float) * (size_t)(T * ys));
    CK(di_cuda_fp8_scales_f32(g_cu, &wd, wsd));
    CK(di_cuda_act_quant_a8(g_cu, xd, T, n_in, n_in, cd, sd));
    di_status st = di_cuda_matmul_fp8_lt(g_cu, &wd, wsd, cd, sd, T, yd, ys);
    char what[96];
    snprintf(what, sizeof what, "fp8 cuBLASLt block-scaled %lldx%lld T=%lld", (long long)n_out,
             (long long)n_in, (long long)T);
    if (st == DI_ERR_UNSUPPORTED) {
        fprintf(stderr, "  %s: UNSUPPORTED by this cuBLASLt/GPU (no algorithm)\n", what);
    } else {
        CK(st);
        dev_to(y, yd, sizeof(float) * (size_t)(T * ys));
        for (int64_t t = 0; t < T; t++)
            for (int64_t o = n_out; o < ys; o++) y[t * ys + o] = NAN; // gaps: not ours to check
        CHECK(check_bounds(what, y, yr, tol, T * ys) == 0);
        fprintf(stderr, "  rel_l2 %.3g\n", rel_l2(y, yr, T * ys));
    }
    dev_free(xd), dev_free(yd), dev_free(cd), dev_free(sd), dev_free(wsd);
    free(x), free(xq), free(yr), free(y), free(tol);
    free_mat(&m);
}

static void test_fp8_lt(void) {
    lt_case(256, 512, 1, false);
    lt_case(256, 512, 64, false);
    lt_case(256, 512, 64, true);
    lt_case(200, 384, 7, true);
    lt_case(1024, 2048, 200, false);
}

int main(void) {
    cuda_test_init();
    CK(di_pool_create(2, &g_pool));
    CK(di_cpu_init(&g_cpu, g_pool, 4096));
    RUN(test_kinds);
    RUN(test_row_view);
    RUN(test_grouped);
    RUN(test_grouped_layouts);
    RUN(test_grouped_many_experts);
    RUN(test_many_tokens);
    RUN(test_act_quant);
    RUN(test_fp8_lt);
    di_cpu_deinit(&g_cpu);
    di_pool_destroy(g_pool);
    return cuda_test_finish();
}
