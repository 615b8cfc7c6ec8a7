// CUDA MoE (backend/cuda/moe.cuh) against a host transcription of model/dsv4_moe.c (FP32 recipe)
// built on di_ref_matmul: the router alone on identical logits (score-routed with bias, exact ties
// broken to the lower id, hash-routed with duplicate experts in a row), the grouping, and whole
// layers (FP8-free F32 gate, FP4 routed experts, FP8 shared expert) at the tiny fixture's shape
// (E=8, K=2), a V4-like routing shape (E=256, K=6) and 1 to 70 tokens; the combine alone on more
// rows than gridDim.y allows.
#include "backend/cuda/cuda_test.h"

#include <string.h>

#include "backend/cpu/ref_ops.h"
#include "backend/cuda/gemm.cuh"
#include "backend/cuda/moe.cuh"
#include "base/thread.h"
#include "tensor/quant_ref.h"

// Router weights: the same FP32 operations in the same order (sqrt, softplus, a K-term sum in
// slot order, one division, one product); only log1pf/expf/sqrtf may differ by a couple of ulp
// between glibc and CUDA: 16u relative.
#define TOL_ROUTER_REL (16 * 5.96e-8)
// A whole layer: three chained FP32 GEMMs (K up to 512) per expert plus SwiGLU, summed over K+1
// experts, each in another order than the CPU: realistic differences ~1e-6 of the row's RMS.
// 1e-4 of the row's RMS catches a wrong expert, weight or row (O(1) of the RMS).
#define TOL_MOE_ROW_RMS 1e-4

static di_pool *g_pool;
static di_cpu g_cpu;

static void ref_router(const float *logits, const float *bias, const int32_t *tid2eid,
                       const int32_t *ids, int32_t T, int32_t E, int32_t K, float route_scale,
                       int32_t *sel, float *wgt) {
    float *st = malloc(sizeof(float) * (size_t)E);
    for (int32_t t = 0; t < T; t++) {
        for (int32_t e = 0; e < E; e++) st[e] = sqrtf(di_softplus(logits[(int64_t)t * E + e]));
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
                    float v = st[e] + (bias ? bias[e] : 0.0f);
                    if (!taken && (best < 0 || v > bv)) best = e, bv = v;
                }
                se[k] = best;
            }
        }
        float sum = 0;
        for (int32_t k = 0; k < K; k++) sum += st[se[k]];
        sum += 1e-20f;
        for (int32_t k = 0; k < K; k++) wgt[t * K + k] = st[se[k]] / sum * route_scale;
    }
    free(st);
}

static void router_case(int32_t T, int32_t E, int32_t K, bool hash, bool ties) {
    const int32_t V = 50;
    float *logits = malloc(sizeof(float) * (size_t)(T * E)),
          *bias = malloc(sizeof(float) * (size_t)E);
    int32_t *tid2eid = malloc(sizeof(int32_t) * (size_t)(V * K)),
            *ids = malloc(sizeof(int32_t) * (size_t)T);
    fill_rand(logits, (int64_t)T * E, 4.0f);
    fill_rand(bias, E, 0.5f);
    if (ties) { // several experts with the same score + bias: the lower id must win
        for (int64_t i = 0; i < (int64_t)T * E; i++) logits[i] = (float)(rnd() % 3);
        for (int32_t e = 0; e < E; e++) bias[e] = 0;
    }
    for (int32_t i = 0; i < V * K; i++) tid2eid[i] = (int32_t)(rnd() % (uint64_t)E); // dups too
    for (int32_t t = 0; t < T; t++) ids[t] = (int32_t)(rnd() % (uint64_t)V);
    int32_t *sel = malloc(sizeof(int32_t) * (size_t)(T * K)),
            *gsel = malloc(sizeof(int32_t) * (size_t)(T * K));
    float *wgt = malloc(sizeof(float) * (size_t)(T * K)),
          *gwgt = malloc(sizeof(float) * (size_t)(T * K));
    ref_router(logits, ties ? NULL : bias, hash ? tid2eid : NULL, ids, T, E, K, 1.5f, sel, wgt);
    float *ld = dev_from(logits, sizeof(float) * (size_t)(T * E)),
          *bd = dev_from(bias, sizeof(float) * (size_t)E);
    int32_t *td = dev_from(tid2eid, sizeof(int32_t) * (size_t)(V * K)),
            *idd = dev_from(ids, sizeof(int32_t) * (size_t)T);
    int32_t *sd = dev_alloc(sizeof(int32_t) * (size_t)(T * K));
    float *wd = dev_alloc(sizeof(float) * (size_t)(T * K));
    dev_poison(sd, sizeof(int32_t) * (size_t)(T * K));
    dev_poison(wd, sizeof(float) * (size_t)(T * K));
    CK(di_cuda_router(g_cu, ld, ties ? NULL : bd, hash ? td : NULL, idd, T, E, K, 1.5f, true, sd,
                      wd));
    dev_to(gsel, sd, sizeof(int32_t) * (size_t)(T * K));
    dev_to(gwgt, wd, sizeof(float) * (size_t)(T * K));
    int64_t sel_bad = 0;
    for (int32_t i = 0; i < T * K; i++) sel_bad += sel[i] != gsel[i];
    fprintf(stderr, "  router T=%d E=%d K=%d%s%s: %lld selections differ\n", T, E, K,
            hash ? " hash" : "", ties ? " ties" : "", (long long)sel_bad);
    CHECK(sel_bad == 0);
    double *tol = malloc(sizeof(double) * (size_t)(T * K));
    for (int32_t i = 0; i < T * K; i++) tol[i] = fabs(wgt[i]) * TOL_ROUTER_REL;
    CHECK(check_bounds("router weights", gwgt, wgt, tol, (int64_t)T * K) == 0);

    // Grouping of the same selection: every pair lands in its expert's range, in pair order.
    int32_t *offd = dev_alloc(sizeof(int32_t) * (size_t)(E + 1));
    int32_t *rowsd = dev_alloc(sizeof(int32_t) * (size_t)(T * K)),
            *ropd = dev_alloc(sizeof(int32_t) * (size_t)(T * K));
    CK(di_cuda_moe_group(g_cu, sd, T * K, K, E, offd, rowsd, ropd));
    int32_t *off = malloc(sizeof(int32_t) * (size_t)(E + 1)),
            *rows = malloc(sizeof(int32_t) * (size_t)(T * K));
    int32_t *rop = malloc(sizeof(int32_t) * (size_t)(T * K));
    dev_to(off, offd, sizeof(int32_t) * (size_t)(E + 1));
    dev_to(rows, rowsd, sizeof(int32_t) * (size_t)(T * K));
    dev_to(rop, ropd, sizeof(int32_t) * (size_t)(T * K));
    int64_t bad = off[0] != 0 || off[E] != T * K;
    for (int32_t e = 0, r = 0; e < E; e++) {
        bad += off[e + 1] < off[e];
        for (int32_t p = 0; p < T * K; p++) {
            if (sel[p] != e) continue;
            bad += rop[p] != off[e] + (r - off[e]) || rows[r] != p / K;
            r++;
        }
    }
    CHECK(bad == 0);
    free(tol), free(off), free(rows), free(rop);
    dev_free(offd), dev_free(rowsd), dev_free(ropd);
    dev_free(ld), dev_free(bd), dev_free(td), dev_free(idd), dev_free(sd), dev_free(wd);
    free(logits), free(bias), free(tid2eid), free(ids), free(sel), free(gsel), free(wgt),
        free(gwgt);
}

static void test_router(void) {
    router_case(1, 8, 2, false, false);
    router_case(37, 256, 6, false, false);
    router_case(64, 256, 6, false, true);
    router_case(9, 8, 2, true, false);
    router_case(300, 256, 6, true, false);
    router_case(5, 384, 6, false, false);
    // The grouping over many chunks of 1024 pairs (a prefill batch at V4's routing shape), and
    // few experts for many pairs: whole warps of one expert (ranks up to 31 inside a warp).
    router_case(4096, 256, 6, false, false);
    router_case(700, 8, 6, true, false);
}

// ---- whole layer ----

typedef struct mat {
    di_tensor t;
    uint8_t *data, *scale; // owned
} mat;

static mat make_w(di_tensor_kind kind, int64_t n_in, int64_t n_out) {
    mat m = {0};
    di_tensor *t = &m.t;
    t->name = "w";
    t->kind = kind;
    t->ne[0] = n_in, t->ne[1] = n_out;
    if (kind == DI_TENSOR_KIND_F32) {
        t->nb1 = 4 * (size_t)n_in;
        m.data = malloc(t->nb1 * (size_t)n_out);
        float *f = (float *)m.data;
        for (int64_t i = 0; i < n_in * n_out; i++) f[i] = rndf() / sqrtf((float)n_in);
    } else {
        const bool fp8 = kind == DI_TENSOR_KIND_FP8;
        t->nb1 = fp8 ? (size_t)n_in : (size_t)n_in / 2;
        t->block_out = fp8 ? 128 : 1, t->block_in = fp8 ? 128 : 32;
        m.data = malloc(t->nb1 * (size_t)n_out);
        for (size_t i = 0; i < t->nb1 * (size_t)n_out; i++) {
            uint8_t c = (uint8_t)rnd();
            if (fp8 && (c & 0x7F) == 0x7F) c ^= 1;
            m.data[i] = c;
        }
        const int64_t sr = (n_out + t->block_out - 1) / t->block_out, sc = n_in / t->block_in;
        t->scale_nb1 = (size_t)sc;
        m.scale = malloc((size_t)(sr * sc));
        // Entries up to 448 (FP8) or 6 (FP4): scales bring weights to ~1/sqrt(n_in).
        const int base = fp8 ? 127 - 14 : 127 - 6;
        for (int64_t i = 0; i < sr * sc; i++) m.scale[i] = (uint8_t)(base + (int)(rnd() % 2));
        t->scale = m.scale;
    }
    t->data = m.data;
    return m;
}

// out = MoE(f) on the host, dsv4_moe.c's FP32 path.
static void ref_moe(const di_tensor *gate, const float *bias, const int32_t *tid2eid, const mat *w1,
                    const mat *w2, const mat *w3, const mat *sh, int32_t E, int32_t K, int64_t D,
                    int64_t F, float limit, const float *f, const int32_t *ids, int32_t T,
                    float *out, int32_t *sel) {
    float *logits = malloc(sizeof(float) * (size_t)(T * E)),
          *wgt = malloc(sizeof(float) * (size_t)(T * K));
    di_ref_matmul(&g_cpu, gate, f, T, D, logits, E);
    ref_router(logits, bias, tid2eid, ids, T, E, K, 1.5f, sel, wgt);
    float *g = malloc(sizeof(float) * (size_t)F), *u = malloc(sizeof(float) * (size_t)F);
    float *y = malloc(sizeof(float) * (size_t)D);
    memset(out, 0, sizeof(float) * (size_t)(T * D));
    for (int32_t e = 0; e < E; e++)
        for (int32_t t = 0; t < T; t++)
            for (int32_t k = 0; k < K; k++) {
                if (sel[t * K + k] != e) continue;
                const float *x = f + (int64_t)t * D;
                di_ref_matmul(&g_cpu, &w1[e].t, x, 1, D, g, F);
                di_ref_matmul(&g_cpu, &w3[e].t, x, 1, D, u, F);
                for (int64_t i = 0; i < F; i++) {
                    float gt = fminf(g[i], limit), up = fminf(fmaxf(u[i], -limit), limit);
                    g[i] = di_silu(gt) * up;
                }
                di_ref_matmul(&g_cpu, &w2[e].t, g, 1, F, y, D);
                for (int64_t i = 0; i < D; i++) out[(int64_t)t * D + i] += y[i] * wgt[t * K + k];
            }
    for (int32_t t = 0; t < T; t++) {
        const float *x = f + (int64_t)t * D;
        di_ref_matmul(&g_cpu, &sh[0].t, x, 1, D, g, F);
        di_ref_matmul(&g_cpu, &sh[2].t, x, 1, D, u, F);
        for (int64_t i = 0; i < F; i++) g[i] = di_silu(g[i]) * u[i]; // shared: no clamp here
        di_ref_matmul(&g_cpu, &sh[1].t, g, 1, F, y, D);
        for (int64_t i = 0; i < D; i++) out[(int64_t)t * D + i] += y[i];
    }
    free(logits), free(wgt), free(g), free(u), free(y);
}

static void moe_case(int32_t T, int32_t E, int32_t K, int64_t D, int64_t F, bool hash) {
    const int32_t V = 40;
    const float limit = 0.3f;
    mat gate = make_w(DI_TENSOR_KIND_F32, D, E);
    mat *w1 = malloc(sizeof(mat) * (size_t)E), *w2 = malloc(sizeof(mat) * (size_t)E),
        *w3 = malloc(sizeof(mat) * (size_t)E);
    di_tensor *d1 = malloc(sizeof(di_tensor) * (size_t)E),
              *d2 = malloc(sizeof(di_tensor) * (size_t)E);
    di_tensor *d3 = malloc(sizeof(di_tensor) * (size_t)E);
    for (int32_t e = 0; e < E; e++) {
        w1[e] = make_w(DI_TENSOR_KIND_FP4, D, F);
        w2[e] = make_w(DI_TENSOR_KIND_FP4, F, D);
        w3[e] = make_w(DI_TENSOR_KIND_FP4, D, F);
        CK(di_cuda_tensor_upload(g_cu, &w1[e].t, &d1[e]));
        CK(di_cuda_tensor_upload(g_cu, &w2[e].t, &d2[e]));
        CK(di_cuda_tensor_upload(g_cu, &w3[e].t, &d3[e]));
    }
    mat sh[3] = {make_w(DI_TENSOR_KIND_FP8, D, F), make_w(DI_TENSOR_KIND_FP8, F, D),
                 make_w(DI_TENSOR_KIND_FP8, D, F)};
    float *bias = malloc(sizeof(float) * (size_t)E);
    fill_rand(bias, E, 0.3f);
    int32_t *tid2eid = malloc(sizeof(int32_t) * (size_t)(V * K)),
            *ids = malloc(sizeof(int32_t) * (size_t)T);
    for (int32_t i = 0; i < V * K; i++) tid2eid[i] = (int32_t)(rnd() % (uint64_t)E);
    for (int32_t t = 0; t < T; t++) ids[t] = (int32_t)(rnd() % (uint64_t)V);
    float *f = malloc(sizeof(float) * (size_t)(T * D)),
          *ref = malloc(sizeof(float) * (size_t)(T * D));
    float *out = malloc(sizeof(float) * (size_t)(T * D));
    int32_t *sel = malloc(sizeof(int32_t) * (size_t)(T * K)),
            *gsel = malloc(sizeof(int32_t) * (size_t)(T * K));
    fill_rand(f, (int64_t)T * D, 1.0f);
    ref_moe(&gate.t, hash ? NULL : bias, hash ? tid2eid : NULL, w1, w2, w3, sh, E, K, D, F, limit,
            f, ids, T, ref, sel);

    di_cuda_moe_w mw = {0};
    CK(di_cuda_tensor_upload(g_cu, &gate.t, &mw.gate));
    mw.gate_bias = hash ? NULL : dev_from(bias, sizeof(float) * (size_t)E);
    mw.tid2eid = hash ? dev_from(tid2eid, sizeof(int32_t) * (size_t)(V * K)) : NULL;
    mw.w1 = dev_from(d1, sizeof(di_tensor) * (size_t)E);
    mw.w2 = dev_from(d2, sizeof(di_tensor) * (size_t)E);
    mw.w3 = dev_from(d3, sizeof(di_tensor) * (size_t)E);
    CK(di_cuda_tensor_upload(g_cu, &sh[0].t, &mw.sh_w1));
    CK(di_cuda_tensor_upload(g_cu, &sh[1].t, &mw.sh_w2));
    CK(di_cuda_tensor_upload(g_cu, &sh[2].t, &mw.sh_w3));
    mw.n_expert = E, mw.n_used = K, mw.D = D, mw.F = F;
    mw.route_scale = 1.5f, mw.swiglu_limit = limit, mw.shared_clamp = false;
    mw.hf_eps = true; // ref_router adds 1e-20
    float *fd = dev_from(f, sizeof(float) * (size_t)(T * D)),
          *od = dev_alloc(sizeof(float) * (size_t)(T * D));
    int32_t *idd = dev_from(ids, sizeof(int32_t) * (size_t)T),
            *sd = dev_alloc(sizeof(int32_t) * (size_t)(T * K));
    dev_poison(od, sizeof(float) * (size_t)(T * D));
    CK(di_cuda_moe(g_cu, &mw, fd, idd, T, od, sd, NULL));
    dev_to(out, od, sizeof(float) * (size_t)(T * D));
    dev_to(gsel, sd, sizeof(int32_t) * (size_t)(T * K));
    int64_t sel_bad = 0;
    for (int32_t i = 0; i < T * K; i++) sel_bad += sel[i] != gsel[i];
    CHECK(sel_bad == 0);
    double *tol = malloc(sizeof(double) * (size_t)(T * D));
    for (int32_t t = 0; t < T; t++) {
        double ss = 0;
        for (int64_t i = 0; i < D; i++) ss += (double)ref[t * D + i] * ref[t * D + i];
        for (int64_t i = 0; i < D; i++) tol[t * D + i] = TOL_MOE_ROW_RMS * sqrt(ss / D) + 1e-7;
    }
    char what[96];
    snprintf(what, sizeof what, "moe T=%d E=%d K=%d D=%lld F=%lld%s (sel diff %lld)", T, E, K,
             (long long)D, (long long)F, hash ? " hash" : "", (long long)sel_bad);
    CHECK(check_bounds(what, out, ref, tol, (int64_t)T * D) == 0);
    fprintf(stderr, "  rel_l2 %.3g\n", rel_l2(out, ref, (int64_t)T * D));
    for (int32_t e = 0; e < E; e++)
        free(w1[e].data), free(w1[e].scale), free(w2[e].data), free(w2[e].scale), free(w3[e].data),
            free(w3[e].scale);
    for (int i = 0; i < 3; i++) free(sh[i].data), free(sh[i].scale);
    free(gate.data);
    free(w1), free(w2), free(w3), free(d1), free(d2), free(d3), free(bias), free(tid2eid),
        free(ids);
    free(f), free(ref), free(out), free(sel), free(gsel), free(tol);
    dev_free(fd), dev_free(od), dev_free(idd), dev_free(sd);
    dev_free((void *)mw.w1), dev_free((void *)mw.w2), dev_free((void *)mw.w3);
    dev_free((void *)mw.gate_bias), dev_free((void *)mw.tid2eid);
}

static void test_moe(void) {
    moe_case(1, 8, 2, 128, 128, false);
    moe_case(5, 8, 2, 128, 128, true);
    moe_case(70, 8, 2, 256, 128, false);
    moe_case(3, 64, 6, 512, 256, false);
    moe_case(33, 64, 6, 512, 256, true);
}

// ---- combine over many rows ----

// di_cuda_moe_combine against its host transcription, bit for bit (the same roundings in the same
// order: each slot's product, then the sums in ascending (expert, slot) order, then the shared
// output), on more rows than gridDim.y's 65,535 (one grid row per token failed to launch), with
// and without weights and the shared output. Tiny widths (K 3, D 5) keep it cheap.
static void test_combine_rows(void) {
    const int32_t T = 65535 + 11, K = 3, E = 8;
    const int64_t D = 5, P = (int64_t)T * K;
    float *y = malloc(sizeof(float) * (size_t)(P * D)), *wgt = malloc(sizeof(float) * (size_t)P);
    float *sh = malloc(sizeof(float) * (size_t)(T * D));
    int32_t *sel = malloc(sizeof(int32_t) * (size_t)P), *rop = malloc(sizeof(int32_t) * (size_t)P);
    fill_rand(y, P * D, 1.0f);
    fill_rand(wgt, P, 1.0f);
    fill_rand(sh, (int64_t)T * D, 1.0f);
    for (int64_t p = 0; p < P; p++) {
        sel[p] = (int32_t)(rnd() % E); // duplicates within a token too: slot order breaks them
        rop[p] = (int32_t)(P - 1 - p); // grouped rows in reverse
    }
    float *ref = malloc(sizeof(float) * (size_t)(T * D)),
          *out = malloc(sizeof(float) * (size_t)(T * D));
    float *yd = dev_from(y, sizeof(float) * (size_t)(P * D)),
          *wd = dev_from(wgt, sizeof(float) * (size_t)P);
    float *shd = dev_from(sh, sizeof(float) * (size_t)(T * D));
    int32_t *seld = dev_from(sel, sizeof(int32_t) * (size_t)P),
            *ropd = dev_from(rop, sizeof(int32_t) * (size_t)P);
    float *od = dev_alloc(sizeof(float) * (size_t)(T * D));
    for (int variant = 0; variant < 2; variant++) {
        const bool weighted = variant == 0;
        for (int32_t t = 0; t < T; t++) {
            int order[3] = {0, 1, 2};
            for (int i = 1; i < K; i++)
                for (int j = i; j > 0 && sel[t * K + order[j]] < sel[t * K + order[j - 1]]; j--) {
                    const int tmp = order[j];
                    order[j] = order[j - 1];
                    order[j - 1] = tmp;
                }
            for (int64_t d = 0; d < D; d++) {
                volatile float acc = 0.0f; // no contraction: one rounding per operation
                for (int i = 0; i < K; i++) {
                    const int64_t p = (int64_t)t * K + order[i];
                    volatile float term = y[(int64_t)rop[p] * D + d];
                    if (weighted) term = term * wgt[p];
                    acc = acc + term;
                }
                if (weighted) acc = acc + sh[(int64_t)t * D + d];
                ref[(int64_t)t * D + d] = acc;
            }
        }
        dev_poison(od, sizeof(float) * (size_t)(T * D));
        CK(di_cuda_moe_combine(g_cu, yd, ropd, seld, weighted ? wd : NULL, weighted ? shd : NULL, T,
                               K, D, od));
        dev_to(out, od, sizeof(float) * (size_t)(T * D));
        int64_t bad = 0;
        for (int64_t i = 0; i < (int64_t)T * D; i++)
            if (memcmp(&out[i], &ref[i], sizeof(float)) != 0 && bad++ < 3)
                fprintf(stderr, "  combine[%lld]: got %.9g, want %.9g\n", (long long)i, out[i],
                        ref[i]);
        fprintf(stderr, "  combine T=%d K=%d D=%lld%s: %lld differ\n", T, K, (long long)D,
                weighted ? " weighted+shared" : "", (long long)bad);
        CHECK(bad == 0);
    }
    // D = 0: nothing to combine, no launch (before: a 0-wide grid, a launch error).
    CHECK_EQ(di_cuda_moe_combine(g_cu, yd, ropd, seld, wd, shd, T, K, 0, od), DI_OK);
    CK(di_cuda_sync(g_cu));
    dev_free(yd), dev_free(wd), dev_free(shd), dev_free(seld), dev_free(ropd), dev_free(od);
    free(y), free(wgt), free(sh), free(sel), free(rop), free(ref), free(out);
}

int main(void) {
    cuda_test_init();
    CK(di_pool_create(2, &g_pool));
    CK(di_cpu_init(&g_cpu, g_pool, 4096));
    RUN(test_router);
    RUN(test_moe);
    RUN(test_combine_rows);
    di_cpu_deinit(&g_cpu);
    di_pool_destroy(g_pool);
    return cuda_test_finish();
}
