// CUDA RMSNorm, RoPE and softmax (backend/cuda/norm.cuh, rope.cuh) against di_ref_rmsnorm and
// di_ref_rope (backend/cpu/ref_ops.h) and a double-precision softmax: weighted and unweighted
// norms, row lengths that are not multiples of the block, strided rows, one row; RoPE at
// positions up to 2^20 (large angles), YaRN-like scaled tables, several rows per position (heads),
// inverse rotation, and the untouched leading dims.
#include "backend/cuda/cuda_test.h"

#include "backend/cpu/ref_ops.h"
#include "backend/cuda/norm.cuh"
#include "backend/cuda/rope.cuh"

// RMSNorm: the sum of squares in another order (within gamma(n) relative, as all terms are
// positive), then a few roundings per element: a relative bound of gamma(n) + 8u on every value.
#define TOL_NORM(n) (gamma_k((double)(n)) + 8 * 5.96e-8)
// RoPE: cosf/sinf differ between glibc and CUDA by at most 2 ulp (CUDA math guide, cosf/sinf
// maximum error 2 ulp; glibc's are correctly rounded or 1 ulp), then one product and one sum:
// 8u of max(|a|, |b|) * scale per output.
#define TOL_ROPE_ULPS 8.0
// Softmax: the FP32 exponent argument x/T - max (up to ~40 in magnitude here) is rounded once,
// which moves exp by up to 40u relative; expf to 2 ulp, a sum of n positives (gamma(n)), one
// division.
#define TOL_SOFTMAX_REL(n) (gamma_k((double)(n)) + 48 * 5.96e-8)

static void test_rmsnorm(void) {
    static const int64_t shapes[][2] = {{1, 1}, {1, 4096}, {3, 128}, {7, 1000}, {64, 512}};
    for (size_t s = 0; s < 5; s++) {
        for (int weighted = 0; weighted < 2; weighted++) {
            const int64_t rows = shapes[s][0], n = shapes[s][1], stride = n + 3;
            const size_t b = sizeof(float) * (size_t)(rows * stride);
            float *x = malloc(b), *ref = malloc(b), *out = malloc(b), *w = malloc(4 * n);
            double *tol = malloc(sizeof(double) * (size_t)(rows * stride));
            fill_rand(x, rows * stride, 3.0f);
            fill_rand(w, n, 2.0f);
            memcpy(ref, x, b);
            di_ref_rmsnorm(ref, rows, n, stride, weighted ? w : NULL, 1e-6f);
            for (int64_t i = 0; i < rows * stride; i++) tol[i] = fabs(ref[i]) * TOL_NORM(n);
            float *xd = dev_from(x, b), *wd = dev_from(w, 4 * (size_t)n);
            CK(di_cuda_rmsnorm(g_cu, xd, rows, n, stride, weighted ? wd : NULL, 1e-6f));
            dev_to(out, xd, b);
            char what[96];
            snprintf(what, sizeof what, "rmsnorm %lldx%lld%s", (long long)rows, (long long)n,
                     weighted ? " weighted" : "");
            CHECK(check_bounds(what, out, ref, tol, rows * stride) == 0);
            dev_free(xd), dev_free(wd);
            free(x), free(ref), free(out), free(w), free(tol);
        }
    }
}

static void test_rope(void) {
    // (rows, rows per position, n, n_rot): q-like (heads share a position), kv-like, tiny.
    static const int64_t shapes[][4] = {
        {64 * 3, 64, 512, 64}, {5, 1, 512, 64}, {1, 1, 128, 64}, {12, 4, 128, 64}, {2, 1, 8, 2}};
    for (size_t s = 0; s < 5; s++) {
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
            // theta^(-2i/n_rot) with theta = 160000, the first third scaled down as YaRN does.
            for (int32_t i = 0; i < n_rot / 2; i++)
                omega[i] =
                    powf(160000.0f, -2.0f * (float)i / (float)n_rot) / (i < n_rot / 6 ? 1 : 16);
            for (int32_t p = 0; p < n_pos; p++)
                pos[p] = p == 0 ? 0 : p == 1 ? (1 << 20) - 1 : (int32_t)(rnd() % 70000);
            const float scale = 1.0f + 0.1f * (float)s;
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
                        tol[k] =
                            TOL_ROPE_ULPS * 5.96e-8 * scale * (fabs(x[p0]) + fabs(x[p0 + 1])) * 2;
                    }
                }
            float *xd = dev_from(x, b), *od = dev_from(omega, sizeof(float) * (size_t)(n_rot / 2));
            int32_t *pd = dev_from(pos, sizeof(int32_t) * (size_t)n_pos);
            CK(di_cuda_rope(g_cu, xd, rows, stride, n, n_rot, od, pd, (int32_t)rpp, scale, inv));
            dev_to(out, xd, b);
            char what[96];
            snprintf(what, sizeof what, "rope rows=%lld n=%lld rot=%d%s", (long long)rows,
                     (long long)n, n_rot, inv ? " inverse" : "");
            CHECK(check_bounds(what, out, ref, tol, rows * stride) == 0);
            dev_free(xd), dev_free(od), dev_free(pd);
            free(x), free(ref), free(out), free(omega), free(pos), free(tol);
        }
    }
}

static void test_softmax(void) {
    static const int64_t shapes[][2] = {{1, 1}, {1, 129280}, {3, 1000}, {8, 33}};
    for (size_t s = 0; s < 4; s++) {
        const int64_t rows = shapes[s][0], n = shapes[s][1], stride = n + 2;
        const size_t b = sizeof(float) * (size_t)(rows * stride);
        float *x = malloc(b), *ref = malloc(b), *out = malloc(b);
        double *tol = malloc(sizeof(double) * (size_t)(rows * stride));
        fill_rand(x, rows * stride, 8.0f);
        const float temp = 0.7f;
        memcpy(ref, x, b);
        for (int64_t r = 0; r < rows; r++) {
            float *v = ref + r * stride;
            double mx = -INFINITY, sum = 0;
            for (int64_t i = 0; i < n; i++) mx = fmax(mx, (double)(v[i] * (1.0f / temp)));
            for (int64_t i = 0; i < n; i++) sum += exp((double)(v[i] * (1.0f / temp)) - mx);
            for (int64_t i = 0; i < n; i++) {
                double p = exp((double)(v[i] * (1.0f / temp)) - mx) / sum;
                v[i] = (float)p;
                tol[r * stride + i] = p * TOL_SOFTMAX_REL(n) + 1e-30;
            }
            for (int64_t i = n; i < stride; i++) tol[r * stride + i] = 0;
        }
        float *xd = dev_from(x, b);
        CK(di_cuda_softmax(g_cu, xd, rows, n, stride, temp));
        dev_to(out, xd, b);
        char what[64];
        snprintf(what, sizeof what, "softmax %lldx%lld", (long long)rows, (long long)n);
        CHECK(check_bounds(what, out, ref, tol, rows * stride) == 0);
        dev_free(xd);
        free(x), free(ref), free(out), free(tol);
    }
}

int main(void) {
    cuda_test_init();
    RUN(test_rmsnorm);
    RUN(test_rope);
    RUN(test_softmax);
    return cuda_test_finish();
}
