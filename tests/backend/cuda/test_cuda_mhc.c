// CUDA mHC (backend/cuda/mhc.cuh) against the model's arithmetic (FP32 precision recipe): the
// coefficients from model/dsv4.c's di_dsv4_hc_coeffs, the RMS scale, collapse and hc_post
// transcribed beside it with the magnitudes their tolerances need: NC = 4 streams and 20 Sinkhorn
// iterations as V4 (also 3 and 16 streams: the Sinkhorn's one thread per element), the head
// variant (pre only), 1 token and several, hidden sizes that are not multiples of the block.
#include "backend/cuda/cuda_test.h"

#include "backend/cpu/ref_ops.h" // di_sigmoid, di_ref_dot
#include "backend/cuda/mhc.cuh"
#include "model/dsv4.h" // di_dsv4_hc_coeffs

// Gates and Sinkhorn see the mix through sigmoid/exp and 20 normalisation rounds in FP32 on both
// sides, in the same order; the RMS factor comes from a sum of NC*D squares in another order
// (realistically ~sqrt(NC*D) u ~ 1e-5 relative for 16384 values), which the gates amplify by
// |mix * scale| (< 10 here). 1e-4 relative (plus 1e-6 absolute for values near 0) covers that and
// stays far below any indexing or ordering error (O(1)).
#define TOL_MHC_REL 1e-4
#define TOL_MHC_ABS 1e-6

// mag_a (may be NULL): sum_s |pre_s x_s| per element of a, the scale of its rounding error.
static void ref_pre(const float *x, const float *mix_raw, const float *base, const float *scale,
                    int nc, int64_t D, int32_t T, int iters, float hc_eps, float norm_eps,
                    bool head, float *a, float *post, float *comb, double *mag_a) {
    const int n_mix = head ? nc : (2 + nc) * nc;
    for (int32_t t = 0; t < T; t++) {
        const float *xf = x + (int64_t)t * nc * D;
        float r = 1.0f / sqrtf(di_ref_dot(xf, xf, (int64_t)nc * D) / (float)(nc * D) + norm_eps);
        float mix[16 * 18];
        for (int i = 0; i < n_mix; i++) mix[i] = mix_raw[t * n_mix + i] * r;
        float pre[16];
        di_dsv4_hc_coeffs(mix, base, scale, nc, iters, hc_eps, pre, head ? NULL : post + t * nc,
                          head ? NULL : comb + t * nc * nc);
        float *at = a + t * D;
        for (int64_t d = 0; d < D; d++) {
            float acc = 0;
            double mag = 0;
            for (int s = 0; s < nc; s++) {
                acc += pre[s] * xf[s * D + d];
                mag += fabs((double)pre[s] * xf[s * D + d]);
            }
            at[d] = acc;
            if (mag_a) mag_a[t * D + d] = mag;
        }
    }
}

// mag (may be NULL): |post o| + sum_j |C x_j| per output, the scale of its rounding error.
static void ref_post(const float *o, float *x, const float *post, const float *comb, int nc,
                     int64_t D, int32_t T, double *mag) {
    float mixed[16];
    for (int32_t t = 0; t < T; t++) {
        float *xt = x + (int64_t)t * nc * D;
        const float *C = comb + t * nc * nc, *pt = post + t * nc, *ot = o + (int64_t)t * D;
        for (int64_t d = 0; d < D; d++) {
            for (int k = 0; k < nc; k++) {
                float acc = pt[k] * ot[d];
                double m = fabs((double)pt[k] * ot[d]);
                for (int j = 0; j < nc; j++) {
                    acc += C[j * nc + k] * xt[j * D + d];
                    m += fabs((double)C[j * nc + k] * xt[j * D + d]);
                }
                mixed[k] = acc;
                if (mag) mag[(int64_t)t * nc * D + k * D + d] = m;
            }
            for (int k = 0; k < nc; k++) xt[k * D + d] = mixed[k];
        }
    }
}

// Positive quantities (gates, Sinkhorn entries): relative to the value.
static double *rel_tol(const float *ref, int64_t n) {
    double *t = malloc(sizeof(double) * (size_t)n);
    for (int64_t i = 0; i < n; i++) t[i] = fabs(ref[i]) * TOL_MHC_REL + TOL_MHC_ABS;
    return t;
}

// Sums of signed terms: relative to the sum of |terms| (cancellation makes |value| meaningless).
static double *mag_tol(double *mag, int64_t n) {
    for (int64_t i = 0; i < n; i++) mag[i] = mag[i] * TOL_MHC_REL + TOL_MHC_ABS;
    return mag;
}

static void mhc_case(int32_t T, int64_t D, bool head, int nc) {
    const int iters = 20, n_mix = head ? nc : (2 + nc) * nc;
    const float hc_eps = 1e-6f, norm_eps = 1e-6f;
    const int64_t nx = (int64_t)T * nc * D;
    float *x = malloc(sizeof(float) * (size_t)nx),
          *mix = malloc(sizeof(float) * (size_t)(T * n_mix));
    float base[16 * 18], scale[3] = {0.7f, 1.3f, 2.1f};
    fill_rand(x, nx, 2.0f);
    fill_rand(mix, (int64_t)T * n_mix, 3.0f);
    fill_rand(base, n_mix, 1.0f);
    float *a = malloc(sizeof(float) * (size_t)(T * D)),
          *post = malloc(sizeof(float) * (size_t)(T * nc));
    float *comb = malloc(sizeof(float) * (size_t)(T * nc * nc));
    double *mag_a = malloc(sizeof(double) * (size_t)(T * D));
    ref_pre(x, mix, base, scale, nc, D, T, iters, hc_eps, norm_eps, head, a, post, comb, mag_a);

    float *xd = dev_from(x, sizeof(float) * (size_t)nx);
    float *md = dev_from(mix, sizeof(float) * (size_t)(T * n_mix));
    float *bd = dev_from(base, sizeof base), *sd = dev_from(scale, sizeof scale);
    float *ad = dev_alloc(sizeof(float) * (size_t)(T * D));
    float *pd = dev_alloc(sizeof(float) * (size_t)(T * nc));
    float *cd = dev_alloc(sizeof(float) * (size_t)(T * nc * nc));
    dev_poison(ad, sizeof(float) * (size_t)(T * D));
    dev_poison(pd, sizeof(float) * (size_t)(T * nc));
    dev_poison(cd, sizeof(float) * (size_t)(T * nc * nc));
    CK(di_cuda_mhc_pre(g_cu, xd, md, bd, sd, nc, D, T, iters, hc_eps, norm_eps, head, ad, pd, cd));
    float *ga = malloc(sizeof(float) * (size_t)(T * D)),
          *gp = malloc(sizeof(float) * (size_t)(T * nc));
    float *gc = malloc(sizeof(float) * (size_t)(T * nc * nc));
    dev_to(ga, ad, sizeof(float) * (size_t)(T * D));
    char what[96];
    double *tol = mag_tol(mag_a, (int64_t)T * D);
    snprintf(what, sizeof what, "mhc_pre a nc=%d T=%d D=%lld%s", nc, T, (long long)D,
             head ? " head" : "");
    CHECK(check_bounds(what, ga, a, tol, (int64_t)T * D) == 0);
    free(mag_a);
    if (!head) {
        dev_to(gp, pd, sizeof(float) * (size_t)(T * nc));
        dev_to(gc, cd, sizeof(float) * (size_t)(T * nc * nc));
        tol = rel_tol(post, (int64_t)T * nc);
        CHECK(check_bounds("mhc_pre post", gp, post, tol, (int64_t)T * nc) == 0);
        free(tol);
        tol = rel_tol(comb, (int64_t)T * nc * nc);
        CHECK(check_bounds("mhc_pre comb (Sinkhorn)", gc, comb, tol, (int64_t)T * nc * nc) == 0);
        free(tol);
        // hc_post from the same (reference) post/comb on both sides.
        float *o = malloc(sizeof(float) * (size_t)(T * D)),
              *xr = malloc(sizeof(float) * (size_t)nx);
        float *gx = malloc(sizeof(float) * (size_t)nx);
        fill_rand(o, (int64_t)T * D, 1.0f);
        memcpy(xr, x, sizeof(float) * (size_t)nx);
        double *mag = malloc(sizeof(double) * (size_t)nx);
        ref_post(o, xr, post, comb, nc, D, T, mag);
        float *od = dev_from(o, sizeof(float) * (size_t)(T * D));
        CK(di_cuda_upload(g_cu, pd, post, sizeof(float) * (size_t)(T * nc)));
        CK(di_cuda_upload(g_cu, cd, comb, sizeof(float) * (size_t)(T * nc * nc)));
        CK(di_cuda_mhc_post(g_cu, od, xd, pd, cd, nc, D, T));
        dev_to(gx, xd, sizeof(float) * (size_t)nx);
        tol = mag_tol(mag, nx);
        snprintf(what, sizeof what, "mhc_post T=%d D=%lld", T, (long long)D);
        CHECK(check_bounds(what, gx, xr, tol, nx) == 0);
        free(tol), free(o), free(xr), free(gx);
        dev_free(od);
    }
    dev_free(xd), dev_free(md), dev_free(bd), dev_free(sd), dev_free(ad), dev_free(pd),
        dev_free(cd);
    free(x), free(mix), free(a), free(post), free(comb), free(ga), free(gp), free(gc);
}

static void test_mhc(void) {
    mhc_case(1, 128, false, 4);
    mhc_case(5, 4096, false, 4);
    mhc_case(3, 100, false, 4);
    mhc_case(1, 4096, true, 4);
    mhc_case(7, 130, true, 4);
    // Other stream counts: the Sinkhorn's nc x nc threads (one element each), up to the whole
    // block at the maximum nc (16 x 16 = 256 threads).
    mhc_case(3, 100, false, 3);
    mhc_case(2, 64, false, 16);
}

int main(void) {
    cuda_test_init();
    RUN(test_mhc);
    return cuda_test_finish();
}
