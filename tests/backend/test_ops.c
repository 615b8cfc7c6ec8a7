// Every optimised CPU kernel against cpu/ref_ops.c, on every instruction-set level this machine
// can run (di_cpu_set_isa sweeps them; DI_CPU_ISA lowers the level the engine picks):
//   - di_cpu_matmul over F32, F16, BF16, FP8 (128x128 UE8M0) and FP4 (per-32 UE8M0) weights, on
//     edge shapes: 1 token, row/column counts that are not multiples of the tile (4 rows x 3
//     tokens), the 8-lane vector, the 1024-column segment or the scale block, many tokens, strided
//     activations and outputs, row views inside the FP8 scale grid, extreme UE8M0 scales and NaN
//     codes;
//   - batch invariance (a token's outputs do not depend on the other tokens of the call) and
//     thread invariance (1, 2 and 3 threads give the same bits), which the serving engine relies
//     on;
//   - Q8_0 and MXFP4 on 8-bit activations (gemm.h): the quantiser's rounding (exhaustively), its
//     AVX2 bits, bit-identity with di_ref_matmul at every level on edge shapes (1..7 tokens, rows
//     off the tile, 32-column rows, a token-chunk boundary, zero and extreme blocks), and the
//     distance to exact f32 activations within the quantisation bound;
//   - the AVX-512 level's bits equal to the AVX2 level's in every case above (gemm_avx512.c keeps
//     the AVX2 level's arithmetic);
//   - the DI_CPU_ISA switch;
//   - under AddressSanitizer, the AVX2 kernels' region checks (gemm_avx2.c "AddressSanitizer":
//     that file is not instrumented access by access): a call given an input or an output one
//     element short is reported by ASan and aborts (in a child process), the exact size is not.
#include "harness.h"

#include <stdint.h>
#include <stdlib.h>
#if defined(__SANITIZE_ADDRESS__)
#include <sys/wait.h>
#include <unistd.h>
#endif

#include "backend/cpu/gemm.h"
#include "backend/cpu/ref_ops.h"
#include "base/mem.h"
#include "tensor/quant_ref.h"

// Tolerances.
// The AVX2 level sums each output in the reference's order (one 8-lane accumulator over the
// columns, then di_ref_dot's lane reduction) but with FMA, which rounds w*x+acc once where the
// reference rounds the product and the sum separately. Each of the two sums is within
// gamma(k) * sum|w_i x_i| of the exact value, gamma(k) = k u / (1 - k u), u = 2^-24, with k = n/8
// + 4 sequential roundings per lane (the accumulations, the product, the three reduction levels),
// so they differ by at most twice that. A wrong decode, scale or column is off by about |w x|.
#define TOL_GAMMA_FACTOR 2.0
// The scalar level is the reference arithmetic: bit-identical.
#define TOL_SCALAR 0.0
// Q8_0 and MXFP4 (the 8-bit activation contract of gemm.h) at every level: the activation codes
// are the reference's bits, the integer block sums are exact, and the f32 part (one FMA per lane
// and block, blocks in order, then reduce8) is the same operations in the same order as
// di_ref_dot_q8, so the bound on f32 summation rounding between the two is zero: bit-identical.
#define TOL_INT8 0.0
// The 8-bit path against exact f32 activations (x times the exactly dequantised weights): each
// activation is off by at most d/2 (rounding to the code) + 127 |dr - d| (d is dr rounded to f16,
// relative error <= 2^-11), so |x - q d| <= d (1/2 + 127 * 2^-11 / (1 - 2^-11)) < 0.5625 d with
// d <= amax/127 * (1 + 2^-11), and |y8 - y| <= 0.5625 sum_i |w_i| d_b(i) plus f32 summation
// rounding of both sides (TOL_GAMMA_FACTOR's bound, on sum |w x| + sum |w| d).
#define ACT_Q8_ERR 0.5625
// The same for Q4_K's activations in blocks of 256 (d = amax/127 in f32, not rounded to f16): half
// a step, plus f32 rounding of -127/mx, x * is and 1/is (a few ulp of 127 steps: < 1e-4 of a step).
#define ACT_Q8K_ERR 0.5001

static uint64_t g_rng = 0x1234567ull;
static uint64_t rnd(void) {
    uint64_t z = (g_rng += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}
static float rndf(void) { // uniform in [-1, 1)
    return (float)((double)(rnd() >> 11) / 4503599627370496.0 - 1.0);
}

// ---- test matrices ----

typedef struct mat {
    di_tensor t;
    void *data;     // owned
    uint8_t *scale; // owned
} mat;

typedef struct scale_range {
    int lo, hi;       // UE8M0 bytes drawn from [lo, hi]
    bool nan_codes;   // FP8: allow the e4m3 NaN codes 0x7F / 0xFF
    bool small_codes; // FP8: exponent fields 0..4 only (|v| < 2^-2), so that weights scaled by
                      // 2^121..2^123 and their sums stay finite
} scale_range;

static const scale_range k_normal = {118, 134, false, false};

static mat make_mat(di_tensor_kind kind, int64_t n_in, int64_t n_out, scale_range sr) {
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
    default: { // ggml block kinds
        int64_t be;
        size_t bb;
        di_tensor_kind_block(kind, &be, &bb);
        t->nb1 = (size_t)(n_in / be) * bb;
        break;
    }
    }
    t->nb1 += 3; // rows are not packed: kernels must use nb1
    uint8_t *d = malloc(t->nb1 * (size_t)n_out);
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
                if (!sr.nan_codes && (c & 0x7F) == 0x7F) c ^= 1;
                if (sr.small_codes) c = (uint8_t)((c & 0x87) | ((((c >> 3) & 0xF) % 5) << 3));
                row[i] = c;
                break;
            }
            case DI_TENSOR_KIND_FP4:
                if (i % 2 == 0) row[i / 2] = (uint8_t)(rnd() & 0xFF);
                break;
            default:
                break;
            }
        }
        int64_t be;
        size_t bb;
        if (di_tensor_kind_block(kind, &be, &bb)) { // random codes, then sane block scales
            for (size_t b = 0; b < t->nb1 - 3; b++) row[b] = (uint8_t)rnd();
            for (int64_t b = 0; b < n_in / be; b++) {
                uint8_t *blk = row + (size_t)b * bb;
                uint16_t h[2] = {
                    di_f32_to_f16(ldexpf(1.0f + rndf() * 0.5f, (int)(rnd() % 8) - 10)),
                    di_f32_to_f16(ldexpf(1.0f + rndf() * 0.5f, (int)(rnd() % 8) - 10))};
                switch (kind) {
                case DI_TENSOR_KIND_Q8_0:
                case DI_TENSOR_KIND_IQ2_XXS:
                    memcpy(blk, h, 2);
                    break;
                case DI_TENSOR_KIND_Q4_K:
                    memcpy(blk, h, 4);
                    break;
                case DI_TENSOR_KIND_Q2_K:
                    memcpy(blk + 80, h, 4);
                    break;
                case DI_TENSOR_KIND_MXFP4:
                    blk[0] = (uint8_t)(sr.lo + (int)(rnd() % (uint64_t)(sr.hi - sr.lo + 1)));
                    break;
                default:
                    break;
                }
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
            m.scale[i] = (uint8_t)(sr.lo + (int)(rnd() % (uint64_t)(sr.hi - sr.lo + 1)));
        t->scale = m.scale;
    }
    return m;
}

static void free_mat(mat *m) {
    free(m->data);
    free(m->scale);
}

// ---- comparison ----

typedef struct run_cfg {
    di_cpu *cpu;     // the level under test is set on it
    di_cpu *ref_cpu; // for di_ref_matmul
} run_cfg;

static float *make_x(int64_t n_tok, int64_t stride) {
    float *x = malloc(sizeof(float) * (size_t)(n_tok * stride));
    for (int64_t i = 0; i < n_tok * stride; i++) x[i] = rndf();
    return x;
}

// Checks y (fast) against yr (reference) for one matrix and call; returns the number of bad
// elements (and counts one CHECK).
static void compare(const di_tensor *w, const float *x, int64_t n_tok, int64_t xs, const float *y,
                    const float *yr, int64_t ys, int isa, const char *what) {
    const int64_t n = w->ne[0], n_out = w->ne[1];
    float *row = malloc(sizeof(float) * (size_t)n);
    const double u = 1.0 / 16777216.0, k = (double)(n / 8 + 4);
    const double gamma = k * u / (1 - k * u);
    int64_t bad = 0;
    double worst = 0;
    for (int64_t o = 0; o < n_out; o++) {
        di_tensor_row_f32(w, o, row);
        for (int64_t t = 0; t < n_tok; t++) {
            double a = y[t * ys + o], b = yr[t * ys + o];
            if (isnan(b) || isinf(b)) {
                bool same = isnan(b) ? isnan(a) : a == b;
                bad += !same;
                continue;
            }
            double mag = 0;
            for (int64_t i = 0; i < n; i++) mag += fabs((double)row[i] * x[t * xs + i]);
            double tol = di_ref_matmul_act(w) != DI_REF_ACT_F32 ? TOL_INT8
                         : isa == DI_CPU_ISA_SCALAR             ? TOL_SCALAR
                                                                : TOL_GAMMA_FACTOR * gamma * mag;
            double d = fabs(a - b);
            if (!(d <= tol)) {
                if (bad < 3)
                    fprintf(stderr, "  %s: y[%lld][%lld] = %.9g, ref %.9g (tol %.3g)\n", what,
                            (long long)t, (long long)o, a, b, tol);
                bad++;
            }
            if (mag > 0 && d / mag > worst) worst = d / mag;
        }
    }
    if (bad)
        fprintf(stderr, "  %s [%s]: %lld of %lld outputs out of tolerance\n", what,
                di_cpu_isa_name(isa), (long long)bad, (long long)(n_tok * n_out));
    CHECK(bad == 0);
    free(row);
}

// Bitwise equality, except that any NaN equals any NaN: which operand's payload x86 propagates
// depends on register allocation, which differs between tile shapes.
static bool same_bits(const float *a, const float *b, int64_t n) {
    for (int64_t i = 0; i < n; i++)
        if (!(isnan(a[i]) && isnan(b[i])) && memcmp(a + i, b + i, sizeof(float)) != 0) return false;
    return true;
}

// One matmul case on every level: fast vs reference, batch invariance (each token alone gives the
// same bits as inside the call), and the AVX-512 level's bits equal to the AVX2 level's.
static void gemm_case(run_cfg *rc, const di_tensor *w, int64_t n_tok, const char *what) {
    const int64_t n = w->ne[0], n_out = w->ne[1];
    const int64_t xs = n + 5, ys = n_out + 3; // strided rows
    float *x = make_x(n_tok, xs);
    float *yr = calloc((size_t)(n_tok * ys), sizeof(float));
    float *y = calloc((size_t)(n_tok * ys), sizeof(float));
    float *y1 = calloc((size_t)ys, sizeof(float));
    float *y2 = calloc((size_t)(n_tok * ys), sizeof(float)); // the AVX2 level's
    di_ref_matmul(rc->ref_cpu, w, x, n_tok, xs, yr, ys);
    for (int isa = 0; isa <= (int)di_cpu_isa_supported(); isa++) {
        CHECK(di_cpu_set_isa(rc->cpu, (di_cpu_isa)isa));
        for (int64_t i = 0; i < n_tok * ys; i++) y[i] = -12345.0f;
        di_cpu_matmul(rc->cpu, w, x, n_tok, xs, y, ys);
        compare(w, x, n_tok, xs, y, yr, ys, isa, what);
        // Padding between output rows is untouched.
        bool pad_ok = true;
        for (int64_t t = 0; t < n_tok; t++)
            for (int64_t o = n_out; o < ys; o++) pad_ok &= y[t * ys + o] == -12345.0f;
        CHECK(pad_ok);
        // Batch invariance: every token alone.
        bool same = true;
        for (int64_t t = 0; t < n_tok && n_tok > 1; t++) {
            di_cpu_matmul(rc->cpu, w, x + t * xs, 1, xs, y1, ys);
            same &= same_bits(y1, y + t * ys, n_out);
        }
        if (!same) fprintf(stderr, "  %s [%s]: batch variance\n", what, di_cpu_isa_name(isa));
        CHECK(same);
        if (isa == DI_CPU_ISA_AVX2) memcpy(y2, y, sizeof(float) * (size_t)(n_tok * ys));
        if (isa == DI_CPU_ISA_AVX512) {
            const bool as_avx2 = same_bits(y, y2, n_tok * ys);
            if (!as_avx2) fprintf(stderr, "  %s: avx512 differs from avx2\n", what);
            CHECK(as_avx2);
        }
    }
    free(x);
    free(y);
    free(y2);
    free(yr);
    free(y1);
}

// ---- cases ----

static di_pool *g_pool2;
static di_cpu g_cpu, g_ref;
static run_cfg g_rc;
enum { MAX_ROW = 16384 };

static const di_tensor_kind k_kinds[] = {DI_TENSOR_KIND_F32, DI_TENSOR_KIND_F16,
                                         DI_TENSOR_KIND_BF16, DI_TENSOR_KIND_FP8,
                                         DI_TENSOR_KIND_FP4};

static void test_gemm_shapes(void) {
    // (n_in, n_out): one 8-chunk; odd tails; a tail inside a scale block; more than one
    // 1024-column segment with a tail; rows crossing the 128-row FP8 scale block; full width.
    static const int64_t shapes[][2] = {{8, 1},    {32, 5},    {100, 7},   {264, 9},
                                        {2500, 6}, {384, 130}, {4096, 13}, {1026, 4}};
    static const int64_t toks[] = {1, 2, 3, 4, 7, 13, 25}; // 25: three AVX-512 tiles, 9 + 8 + 8
    for (size_t k = 0; k < sizeof k_kinds / sizeof k_kinds[0]; k++) {
        for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; s++) {
            mat m = make_mat(k_kinds[k], shapes[s][0], shapes[s][1], k_normal);
            for (size_t j = 0; j < sizeof toks / sizeof toks[0]; j++) {
                char what[96];
                snprintf(what, sizeof what, "%s %lldx%lld T=%lld", di_tensor_kind_name(k_kinds[k]),
                         (long long)shapes[s][1], (long long)shapes[s][0], (long long)toks[j]);
                gemm_case(&g_rc, &m.t, toks[j], what);
            }
            free_mat(&m);
        }
    }
}

// The ggml block kinds of GGUF files: rows are whole blocks (32 or 256 columns); shapes cross the
// 1024-column segment, leave row and token remainders of the 4 x 3 tile, and have many tokens.
static const di_tensor_kind k_ggml_kinds[] = {DI_TENSOR_KIND_Q8_0, DI_TENSOR_KIND_Q4_K,
                                              DI_TENSOR_KIND_Q2_K, DI_TENSOR_KIND_IQ2_XXS,
                                              DI_TENSOR_KIND_MXFP4};

static void test_gemm_ggml(void) {
    static const int64_t shapes[][2] = {{256, 1}, {512, 5}, {2560, 7}, {1280, 130}, {4096, 9}};
    static const int64_t toks[] = {1, 2, 3, 4, 7, 13};
    for (size_t k = 0; k < sizeof k_ggml_kinds / sizeof k_ggml_kinds[0]; k++) {
        for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; s++) {
            mat m = make_mat(k_ggml_kinds[k], shapes[s][0], shapes[s][1], k_normal);
            for (size_t j = 0; j < sizeof toks / sizeof toks[0]; j++) {
                char what[96];
                snprintf(what, sizeof what, "%s %lldx%lld T=%lld",
                         di_tensor_kind_name(k_ggml_kinds[k]), (long long)shapes[s][1],
                         (long long)shapes[s][0], (long long)toks[j]);
                gemm_case(&g_rc, &m.t, toks[j], what);
            }
            free_mat(&m);
        }
        // A row view (stacked experts are views of one 3-D tensor).
        mat m = make_mat(k_ggml_kinds[k], 512, 40, k_normal);
        di_tensor v = di_tensor_rows(&m.t, 11, 21);
        gemm_case(&g_rc, &v, 2, "ggml view rows 11..32");
        free_mat(&m);
    }
}

// The AVX2 decoders of the block kinds multiplied in f32 are exact: every value equals the
// reference's bits (Q8_0, MXFP4 and Q4_K are never decoded to f32: they use integer dot products).
static void test_decode_ggml_exact(void) {
    if (di_cpu_isa_supported() < DI_CPU_ISA_AVX2) return; // nothing to compare
    static const di_tensor_kind kinds[] = {DI_TENSOR_KIND_Q2_K, DI_TENSOR_KIND_IQ2_XXS};
    const int64_t n = 2048;
    float *ref = malloc(sizeof(float) * n), *got = di_aligned_alloc(sizeof(float) * n);
    for (size_t k = 0; k < sizeof kinds / sizeof kinds[0]; k++) {
        mat m = make_mat(kinds[k], n, 3, (scale_range){0, 255, false, false});
        bool same = true;
        for (int64_t r = 0; r < 3; r++) {
            di_tensor_row_f32(&m.t, r, ref);
            di_gemm_avx2_decode(&m.t, r, 1, 1024, n, got + 1024, n); // not the first segment
            di_gemm_avx2_decode(&m.t, r, 1, 0, 1024, got, n);
            same &= same_bits(ref, got, n);
        }
        if (!same) fprintf(stderr, "  %s: AVX2 decode differs\n", di_tensor_kind_name(m.t.kind));
        CHECK(same);
        free_mat(&m);
    }
    free(ref);
    di_aligned_free(got);
}

// ---- 8-bit activations (Q8_0, MXFP4) ----

// The quantiser's rounding, trunc(v + copysign(0.5 - 2^-25, v)), is roundf (half away from zero)
// for every float of magnitude up to 128 (all the quantiser can see): checked on every one.
static void test_act_round_exhaustive(void) {
    int64_t bad = 0;
    for (uint32_t u = 0; u <= 0x43000000u; u++) { // +0 .. 128
        float v;
        memcpy(&v, &u, 4);
        float r = v + copysignf(0x1.fffffep-2f, v);
        bad += (float)(int)r != roundf(v);
        float nv = -v, nr = nv + copysignf(0x1.fffffep-2f, nv);
        bad += (float)(int)nr != roundf(nv);
    }
    CHECK_EQ(bad, 0);
}

// One activation row (n values) with blocks of the hard cases: all zero, one nonzero, exact ties
// (x * id landing on k + 0.5), the largest value reaching the +-127 clamp, tiny (f16-subnormal
// and zero d), large (d near the f16 maximum), and random.
static void fill_act_cases(float *x, int64_t n) {
    for (int64_t b = 0; b < n / 32; b++) {
        float *v = x + 32 * b;
        const int kind = (int)(b % 8);
        for (int j = 0; j < 32; j++) {
            switch (kind) {
            case 0:
                v[j] = 0.0f;
                break;
            case 1:
                v[j] = j == 7 ? -3.0f : (j == 9 ? -0.0f : 0.0f);
                break;
            case 2: // amax 127: id = 1, values k + 0.5 are ties
                v[j] = j == 0 ? 127.0f : (float)(j - 16) + 0.5f;
                break;
            case 3: // -127 and +127 ends
                v[j] = j == 0 ? -5.0f : (j == 1 ? 5.0f : rndf() * 5.0f);
                break;
            case 4: // d below the f16 subnormal range: rounds to 0
                v[j] = rndf() * 1e-9f;
                break;
            case 5: // f16-subnormal d
                v[j] = rndf() * 1e-4f;
                break;
            case 6: // large: d about 7.8e3 (f16 max 65504)
                v[j] = rndf() * 1e6f;
                break;
            default:
                v[j] = rndf() * ldexpf(1.0f, (int)(rnd() % 20) - 10);
                break;
            }
        }
    }
}

// The AVX2 quantiser gives the reference's bits; the codes stay in [-127, 127] and reconstruct
// x within ACT_Q8_ERR * d.
static void test_act_quant(void) {
    const int64_t n = 32 * 64;
    float *x = malloc(sizeof(float) * n), *d0 = malloc(sizeof(float) * n / 32),
          *d1 = malloc(sizeof(float) * n / 32);
    int8_t *q0 = malloc((size_t)n), *q1 = malloc((size_t)n);
    fill_act_cases(x, n);
    di_quant_act_q8(x, n, q0, d0);
    bool range = true, close = true, ends = false;
    for (int64_t i = 0; i < n; i++) {
        range &= q0[i] != -128; // int8: <= 127 by type
        ends |= q0[i] == -127;
        float d = d0[i / 32];
        if (d >= 0x1p-14f && isfinite(d)) // f16-normal d: relative rounding <= 2^-11
            close &= fabsf(x[i] - (float)q0[i] * d) <= ACT_Q8_ERR * d;
    }
    CHECK(range);
    CHECK(close);
    CHECK(ends);
    CHECK_EQ(q0[64 + 0], 127); // the tie block: 127, then -14.5 -> -15, 0.5 -> 1, -0.5 -> -1
    CHECK_EQ(q0[64 + 1], -15);
    CHECK_EQ(q0[64 + 16], 1);
    CHECK_EQ(q0[64 + 15], -1);
    if (di_cpu_isa_supported() >= DI_CPU_ISA_AVX2) {
        di_gemm_avx2_quant_act(x, n, q1, d1);
        CHECK(memcmp(q0, q1, (size_t)n) == 0);
        CHECK(memcmp(d0, d1, sizeof(float) * (size_t)(n / 32)) == 0);
    }
    // Blocks of 256 (Q4_K's activations): one all-zero block, then the same hard cases; the first
    // value of largest magnitude gets -127, sums per 16 match, AVX2 gives the same bits.
    memset(x, 0, sizeof(float) * 256);
    for (int i = 256; i < 512; i++) x[i] = rndf();
    x[256 + 40] = -7.0f, x[256 + 41] = 7.0f; // a magnitude tie: the first (negative) one is mx
    int16_t s0[2048 / 16], s1[2048 / 16];
    di_quant_act_q8_k(x, n, q0, d0, s0);
    CHECK(d0[0] == 0.0f && q0[0] == 0 && s0[0] == 0);
    CHECK_EQ(q0[256 + 40], -127); // mx = -7 (the first): is = -127 / mx, d = 1 / is > 0
    CHECK_EQ(q0[256 + 41], 127);
    CHECK(d0[1] > 0);
    bool sums = true, range8 = true, close8 = true;
    for (int64_t k = 0; k < n / 16; k++) {
        int v = 0;
        for (int i = 0; i < 16; i++) v += q0[16 * k + i];
        sums &= v == s0[k];
    }
    for (int64_t i = 0; i < n; i++) {
        range8 &= q0[i] != -128;
        float d = fabsf(d0[i / 256]);
        close8 &= fabsf(x[i] - (float)q0[i] * d0[i / 256]) <= ACT_Q8K_ERR * d;
    }
    CHECK(sums);
    CHECK(range8);
    CHECK(close8);
    if (di_cpu_isa_supported() >= DI_CPU_ISA_AVX2) {
        di_gemm_avx2_quant_act_q8_k(x, n, q1, d1, s1);
        CHECK(memcmp(q0, q1, (size_t)n) == 0);
        CHECK(memcmp(d0, d1, sizeof(float) * (size_t)(n / 256)) == 0);
        CHECK(memcmp(s0, s1, sizeof s0) == 0);
    }
    free(x), free(d0), free(d1), free(q0), free(q1);
}

// Edge shapes of the kinds with 32-column blocks (rows need not be multiples of 256): 1..7 tokens
// (odd token tiles), row counts off the 4-row tile, a chunk boundary (more than
// DI_CPU_ACT_TOKENS tokens), all-zero and extreme activation blocks, zero weight blocks.
static void test_gemm_int8_edges(void) {
    static const int64_t shapes[][2] = {{32, 1}, {96, 3}, {160, 6}, {1056, 11}};
    static const di_tensor_kind kinds[] = {DI_TENSOR_KIND_Q8_0, DI_TENSOR_KIND_MXFP4,
                                           DI_TENSOR_KIND_Q4_K};
    // Per kind: columns per block, block bytes, and the bytes zeroed to make a zero block (Q8_0's
    // d, MXFP4's codes, Q4_K's d and dmin).
    static const int zero_blk[][4] = {{32, 34, 0, 2}, {32, 17, 1, 16}, {256, 144, 0, 4}};
    for (size_t k = 0; k < 3; k++) {
        const int64_t widen = zero_blk[k][0] / 32; // Q4_K: rows of whole 256-column blocks
        for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; s++) {
            mat m = make_mat(kinds[k], shapes[s][0] * widen, shapes[s][1], k_normal);
            static const int64_t toks[] = {1, 2, 3, 4, 5, 6, 7, 9, 17}; // 17 = 6 + 6 + 5 (VNNI)
            for (size_t j = 0; j < sizeof toks / sizeof toks[0]; j++) {
                const int64_t T = toks[j];
                char what[96];
                snprintf(what, sizeof what, "%s %lldx%lld T=%lld", di_tensor_kind_name(kinds[k]),
                         (long long)shapes[s][1], (long long)(shapes[s][0] * widen), (long long)T);
                gemm_case(&g_rc, &m.t, T, what);
            }
            free_mat(&m);
        }
        if (kinds[k] == DI_TENSOR_KIND_MXFP4) { // every exponent byte (the AVX2 scale table)
            mat m = make_mat(kinds[k], 8192, 6, (scale_range){0, 255, false, false});
            gemm_case(&g_rc, &m.t, 1, "MXFP4 exponents 0..255 T=1");
            gemm_case(&g_rc, &m.t, 5, "MXFP4 exponents 0..255 T=5");
            free_mat(&m);
        }
        // Zero weight blocks (Q8_0 d = 0, MXFP4 codes 0) and hard activation rows, many tokens
        // across a chunk boundary.
        const int64_t n = 512, n_out = 9, T = DI_CPU_ACT_TOKENS + 7, xs = n + 3;
        mat m = make_mat(kinds[k], n, n_out, k_normal);
        uint8_t *row0 = m.data; // row 0: every other block zero
        for (int64_t b = 0; b < n / zero_blk[k][0]; b += 2)
            memset(row0 + (size_t)b * (size_t)zero_blk[k][1] + (size_t)zero_blk[k][2], 0,
                   (size_t)zero_blk[k][3]);
        float *x = make_x(T, xs), *yr = malloc(sizeof(float) * (size_t)(T * n_out)),
              *y = malloc(sizeof(float) * (size_t)(T * n_out)), y1[9];
        for (int64_t t = 0; t < T; t += 3) fill_act_cases(x + t * xs, n);
        di_ref_matmul(g_rc.ref_cpu, &m.t, x, T, xs, yr, n_out);
        for (int isa = 0; isa <= (int)di_cpu_isa_supported(); isa++) {
            CHECK(di_cpu_set_isa(g_rc.cpu, (di_cpu_isa)isa));
            di_cpu_matmul(g_rc.cpu, &m.t, x, T, xs, y, n_out);
            CHECK(same_bits(y, yr, T * n_out));
            bool alone = true; // batch invariance across the chunk boundary
            for (int64_t t = 0; t < T; t++) {
                di_cpu_matmul(g_rc.cpu, &m.t, x + t * xs, 1, xs, y1, n_out);
                alone &= same_bits(y1, y + t * n_out, n_out);
            }
            CHECK(alone);
        }
        free(x), free(y), free(yr);
        free_mat(&m);
    }
}

// The 8-bit path against exact f32 activations: within the activation quantisation bound
// (ACT_Q8_ERR), and not bit-identical (the contract is really in use).
static void test_gemm_int8_vs_f32(void) {
    static const di_tensor_kind kinds[] = {DI_TENSOR_KIND_Q8_0, DI_TENSOR_KIND_MXFP4,
                                           DI_TENSOR_KIND_Q4_K};
    const int64_t n = 1024, n_out = 13, T = 5;
    const double u = 1.0 / 16777216.0, kk = (double)(n / 8 + 4), gamma = kk * u / (1 - kk * u);
    int16_t bs[1024 / 16];
    for (size_t k = 0; k < 3; k++) {
        const bool k8 = kinds[k] == DI_TENSOR_KIND_Q4_K;
        const int64_t blk = k8 ? 256 : 32;
        mat m = make_mat(kinds[k], n, n_out, k_normal);
        float *x = make_x(T, n), *y = malloc(sizeof(float) * (size_t)(T * n_out)),
              *row = malloc(sizeof(float) * (size_t)n), *d = malloc(sizeof(float) * n / 32);
        int8_t *q = malloc((size_t)n);
        di_cpu_matmul(g_rc.cpu, &m.t, x, T, n, y, n_out);
        int64_t bad = 0, differ = 0;
        double worst = 0;
        for (int64_t o = 0; o < n_out; o++) {
            di_tensor_row_f32(&m.t, o, row);
            for (int64_t t = 0; t < T; t++) {
                if (k8)
                    di_quant_act_q8_k(x + t * n, n, q, d, bs);
                else
                    di_quant_act_q8(x + t * n, n, q, d);
                double exact = 0, mag = 0, bound = 0;
                for (int64_t i = 0; i < n; i++) {
                    exact += (double)row[i] * x[t * n + i];
                    mag += fabs((double)row[i] * x[t * n + i]);
                    bound += fabs((double)row[i] * d[i / blk]);
                }
                double err = fabs(y[t * n_out + o] - exact);
                double tol = (k8 ? ACT_Q8K_ERR : ACT_Q8_ERR) * bound +
                             TOL_GAMMA_FACTOR * gamma * (mag + bound);
                bad += !(err <= tol);
                differ += (float)exact != y[t * n_out + o];
                if (mag > 0 && err / mag > worst) worst = err / mag;
            }
        }
        fprintf(stderr, "  %s: 8-bit activations vs f32, worst |dy| / sum|w x| = %.2e\n",
                di_tensor_kind_name(kinds[k]), worst);
        CHECK_EQ(bad, 0);
        CHECK(differ > 0);
        free(x), free(y), free(row), free(d), free(q);
        free_mat(&m);
    }
}

// The widest row the model multiplies (the mHC mix over 4 x 4096 streams), many tokens.
static void test_gemm_wide(void) {
    mat m = make_mat(DI_TENSOR_KIND_F32, MAX_ROW, 24, k_normal);
    gemm_case(&g_rc, &m.t, 5, "F32 24x16384 T=5");
    free_mat(&m);
    mat b = make_mat(DI_TENSOR_KIND_BF16, MAX_ROW, 6, k_normal);
    gemm_case(&g_rc, &b.t, 40, "BF16 6x16384 T=40");
    free_mat(&b);
}

// A di_cpu for rows of at most 2048 holds 32 decoded rows a thread (the many-token block of both
// SIMD levels; the shared one, for 16384, holds 8): blocks of 32 rows, a remainder of 2 groups and
// 3 rows, k-blocks of 384 with a tail, and one short row of a single k-block.
static void test_gemm_row_blocks(void) {
    di_cpu c;
    CHECK(di_cpu_init(&c, g_pool2, 2048) == DI_OK);
    CHECK_EQ(c.gemm_rows, 32);
    run_cfg rc = {&c, &g_ref};
    static const int64_t shapes[][2] = {{1500, 75}, {2048, 64}, {200, 33}};
    for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; s++) {
        for (int kind = DI_TENSOR_KIND_BF16; kind <= DI_TENSOR_KIND_FP4; kind++) {
            mat m = make_mat((di_tensor_kind)kind, shapes[s][0], shapes[s][1], k_normal);
            char what[64];
            snprintf(what, sizeof what, "%s %lldx%lld (32-row blocks)",
                     di_tensor_kind_name((di_tensor_kind)kind), (long long)shapes[s][1],
                     (long long)shapes[s][0]);
            gemm_case(&rc, &m.t, 4, what);
            gemm_case(&rc, &m.t, 29, what);
            free_mat(&m);
        }
    }
    di_cpu_deinit(&c);
}

// Row views: the FP8 scale row is (row0 + r) / 128, so a view starting inside a block must use
// its offset; FP4 views likewise index their own scale rows.
static void test_gemm_views(void) {
    mat m = make_mat(DI_TENSOR_KIND_FP8, 256, 300, k_normal);
    di_tensor v = di_tensor_rows(&m.t, 100, 150);
    gemm_case(&g_rc, &v, 3, "FP8 view rows 100..250");
    gemm_case(&g_rc, &v, 5, "FP8 view rows 100..250");
    free_mat(&m);
    mat f = make_mat(DI_TENSOR_KIND_FP4, 96, 40, k_normal);
    di_tensor fv = di_tensor_rows(&f.t, 7, 21);
    gemm_case(&g_rc, &fv, 4, "FP4 view rows 7..28");
    free_mat(&f);
}

// Extreme scales: u = 0 (2^-127, subnormal products), u >= 248 (where the FP8 kernel cannot fold
// its 2^8 into the scale), 255 (NaN), and the e4m3 NaN codes; results must match the reference
// including its infinities and NaNs.
static void test_gemm_extremes(void) {
    // 248..250 with small codes: s * 256 overflows, (v * 256) * s is finite, and so are the sums
    // (the other ranges' large weights give mostly infinite or NaN outputs).
    static const scale_range ranges[] = {{0, 3, false, false},
                                         {244, 254, false, false},
                                         {250, 255, true, false},
                                         {120, 130, true, false},
                                         {248, 250, false, true}};
    for (size_t r = 0; r < sizeof ranges / sizeof ranges[0]; r++) {
        for (int kind = DI_TENSOR_KIND_FP8; kind <= DI_TENSOR_KIND_FP4; kind++) {
            // Rows with a tail (staged decode), then whole 32-column blocks (the fused GEMV);
            // FP8 wide and past one 128-row block, so that each range's every byte is drawn
            // among its 24..32 scales (FP4: 63..72).
            const bool fp8 = kind == DI_TENSOR_KIND_FP8;
            for (int k = 0; k < 2; k++) {
                const int64_t n = fp8 ? (k ? 2048 : 1480) : (k ? 256 : 200);
                mat m = make_mat((di_tensor_kind)kind, n, fp8 ? 130 : 9, ranges[r]);
                char what[64];
                snprintf(what, sizeof what, "%s n=%lld scales %d..%d", di_tensor_kind_name(kind),
                         (long long)n, ranges[r].lo, ranges[r].hi);
                gemm_case(&g_rc, &m.t, 1, what);
                gemm_case(&g_rc, &m.t, 6, what);
                free_mat(&m);
            }
        }
    }
}

// 1, 2 and 3 threads (rows split or, with few rows, tokens split) give the same bits.
static void test_gemm_threads(void) {
    static const int64_t shapes[][3] = {{1024, 70, 1}, {1024, 70, 9}, {512, 5, 11}};
    static const di_tensor_kind kinds[] = {DI_TENSOR_KIND_FP8,  DI_TENSOR_KIND_Q8_0,
                                           DI_TENSOR_KIND_Q4_K, DI_TENSOR_KIND_MXFP4,
                                           DI_TENSOR_KIND_Q2_K, DI_TENSOR_KIND_IQ2_XXS};
    for (int isa = 0; isa <= (int)di_cpu_isa_supported(); isa++) {
        for (size_t s = 0; s < 3 * sizeof kinds / sizeof kinds[0]; s++) {
            mat m = make_mat(kinds[s / 3], shapes[s % 3][0], shapes[s % 3][1], k_normal);
            int64_t T = shapes[s % 3][2], n_out = shapes[s % 3][1];
            float *x = make_x(T, shapes[s % 3][0]);
            float *y[3];
            for (int nt = 1; nt <= 3; nt++) {
                di_pool *p = NULL;
                di_cpu c;
                CHECK(di_pool_create(nt, &p) == DI_OK);
                CHECK(di_cpu_init(&c, p, MAX_ROW) == DI_OK);
                CHECK(di_cpu_set_isa(&c, (di_cpu_isa)isa));
                y[nt - 1] = malloc(sizeof(float) * (size_t)(T * n_out));
                di_cpu_matmul(&c, &m.t, x, T, shapes[s % 3][0], y[nt - 1], n_out);
                di_cpu_deinit(&c);
                di_pool_destroy(p);
            }
            CHECK(memcmp(y[0], y[1], sizeof(float) * (size_t)(T * n_out)) == 0);
            CHECK(memcmp(y[0], y[2], sizeof(float) * (size_t)(T * n_out)) == 0);
            for (int i = 0; i < 3; i++) free(y[i]);
            free(x);
            free_mat(&m);
        }
    }
}

static void test_isa_switch(void) {
    di_cpu_isa best = di_cpu_isa_supported();
    fprintf(stderr, "  supported level: %s\n", di_cpu_isa_name(best));
    setenv("DI_CPU_ISA", "scalar", 1);
    CHECK_EQ(di_cpu_isa_detect(), DI_CPU_ISA_SCALAR);
    setenv("DI_CPU_ISA", "avx2", 1); // clamped to what the CPU has
    CHECK_EQ(di_cpu_isa_detect(), best >= DI_CPU_ISA_AVX2 ? DI_CPU_ISA_AVX2 : best);
    setenv("DI_CPU_ISA", "avx512", 1);
    CHECK_EQ(di_cpu_isa_detect(), best);
    setenv("DI_CPU_ISA", "no-such-level", 1);
    CHECK_EQ(di_cpu_isa_detect(), best);
    unsetenv("DI_CPU_ISA");
    CHECK_EQ(di_cpu_isa_detect(), best);
    di_cpu c;
    CHECK(di_cpu_init(&c, NULL, 64) == DI_OK);
    CHECK_EQ(c.isa, best);
    CHECK(!di_cpu_set_isa(&c, DI_CPU_ISA_COUNT));
    CHECK_EQ(c.isa, best);
    di_cpu_deinit(&c);
}

#if defined(__SANITIZE_ADDRESS__)
// Runs case k of asan_case in a child (its stderr into a pipe): true when the child died with an
// AddressSanitizer report.
static void asan_case(int k, bool short_by_one);

static bool asan_reported(int k, bool short_by_one) {
    int fd[2];
    if (pipe(fd) != 0) return false;
    fflush(NULL);
    const pid_t pid = fork();
    if (pid == 0) {
        dup2(fd[1], 2);
        close(fd[0]);
        asan_case(k, short_by_one);
        _exit(0);
    }
    close(fd[1]);
    char buf[8192];
    size_t len = 0;
    ssize_t r;
    while ((r = read(fd[0], buf + len, sizeof buf - 1 - len)) > 0) len += (size_t)r;
    buf[len] = 0;
    close(fd[0]);
    int status = 0;
    waitpid(pid, &status, 0);
    const bool died = !(WIFEXITED(status) && WEXITSTATUS(status) == 0);
    return died && strstr(buf, "AddressSanitizer") != NULL;
}

// Case k, with one of its regions a heap block one element short (or exact): 0 tile_k's tokens,
// 1 tile_k's output, 2 gemv's token (BF16 rows), 3 quant_act's codes.
static void asan_case(int k, bool short_by_one) {
    enum { N = 64, NT = 5 };
    const int64_t s = short_by_one ? 1 : 0;
    float *w = di_aligned_alloc(sizeof(float) * 4 * N);
    for (int i = 0; i < 4 * N; i++) w[i] = (float)(i % 7) - 3.0f;
    if (k == 0 || k == 1) {
        float *x = malloc(sizeof(float) * (size_t)(NT * N - (k == 0 ? s : 0)));
        float *y = malloc(sizeof(float) * (size_t)(NT * 4 - (k == 1 ? s : 0)));
        for (int64_t i = 0; i < NT * N - (k == 0 ? s : 0); i++) x[i] = 1.0f;
        _Alignas(64) unsigned char st[DI_GEMM_TILE_STATE];
        di_gemm_avx2_tile_k(w, N, 4, x, N, 3, 0, N, N, st, y, 4); // tokens 0..2, then 3..4
        di_gemm_avx2_tile_k(w, N, 4, x + 3 * N, N, NT - 3, 0, N, N, st, y + 3 * 4, 4);
        free(x);
        free(y);
    } else if (k == 2) {
        uint16_t *wb = malloc(sizeof(uint16_t) * 4 * N);
        for (int i = 0; i < 4 * N; i++) wb[i] = 0x3F80; // BF16 1.0
        di_tensor t = {
            .name = "w", .kind = DI_TENSOR_KIND_BF16, .ne = {N, 4}, .nb1 = 2 * N, .data = wb};
        float *x = malloc(sizeof(float) * (size_t)(N - s));
        for (int64_t i = 0; i < N - s; i++) x[i] = 1.0f;
        const float *xs[1] = {x};
        float acc[4][3][8] = {{{0}}};
        di_gemm_avx2_gemv(&t, 0, 4, xs, 1, acc);
        free(x);
        free(wb);
    } else {
        float x[N];
        for (int i = 0; i < N; i++) x[i] = (float)i;
        int8_t *q = malloc((size_t)(N - s));
        float d[N / 32];
        di_gemm_avx2_quant_act(x, N, q, d);
        free(q);
    }
    di_aligned_free(w);
}

static void test_asan_regions(void) {
    if (!di_gemm_avx2_built() || di_cpu_isa_supported() < DI_CPU_ISA_AVX2) {
        fprintf(stderr, "  no AVX2 kernels here: nothing to check\n");
        return;
    }
    for (int k = 0; k < 4; k++) {
        CHECK(!asan_reported(k, false));
        CHECK(asan_reported(k, true));
    }
}
#endif

int main(void) {
    if (di_pool_create(2, &g_pool2) != DI_OK) return 1;
    if (di_cpu_init(&g_cpu, g_pool2, MAX_ROW) != DI_OK) return 1;
    if (di_cpu_init(&g_ref, g_pool2, MAX_ROW) != DI_OK) return 1;
    g_rc = (run_cfg){&g_cpu, &g_ref};
    RUN(test_isa_switch);
    RUN(test_gemm_shapes);
    RUN(test_gemm_ggml);
    RUN(test_decode_ggml_exact);
    RUN(test_act_round_exhaustive);
    RUN(test_act_quant);
    RUN(test_gemm_int8_edges);
    RUN(test_gemm_int8_vs_f32);
    RUN(test_gemm_wide);
    RUN(test_gemm_row_blocks);
    RUN(test_gemm_views);
    RUN(test_gemm_extremes);
    RUN(test_gemm_threads);
#if defined(__SANITIZE_ADDRESS__)
    RUN(test_asan_regions);
#endif
    di_cpu_deinit(&g_cpu);
    di_cpu_deinit(&g_ref);
    di_pool_destroy(g_pool2);
    return test_finish();
}
