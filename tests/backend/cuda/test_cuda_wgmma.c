// The wgmma probe (backend/cuda/wgmma_probe.cuh): each primitive of the attention kernel's wgmma
// path against a host GEMM on random data, one case per primitive, each failure naming its case,
// its first wrong element and whether the data looks transposed or shifted (what a wrong
// descriptor field does). Exact: the operands are small integers (BF16-exact, FP32 sums exact),
// so any wrong address shows. Skips (77) without a GPU, and on a device without wgmma (not cc 9.0,
// or a binary without sm_90a code). scripts/gpu-check runs it first and greps the "wgmma probe:"
// summary line. Also the DI_CUDA_ATTN_WG / DI_CUDA_ATTN_TC switches read at context create (on any
// device). Seconds at most: the probe kernels and host GEMMs are tiny; the switches create four
// contexts.
#include "cuda_test.h"

#include "backend/cuda/wgmma_probe.cuh"

static uint16_t bf16_int(int v) { // BF16 bits of a small integer (exact)
    const float f = (float)v;
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return (uint16_t)(u >> 16);
}

static char g_failed[512]; // the failed cases' names, for the summary line

// One case: random operands, the device product, the host product, element by element.
static void probe_case(int which) {
    const di_cuda_wgmma_probe_shape sh = di_cuda_wgmma_probe_shape_of(which);
    const int M = 64, N = sh.n, K = sh.k, S = sh.n_stage;
    const size_t na = (size_t)S * M * K, nb = (size_t)S * N * K, nd = (size_t)sh.n_out * M * N;
    int *av = malloc(sizeof(int) * na), *bv = malloc(sizeof(int) * nb);
    uint16_t *ah = malloc(sizeof(uint16_t) * na), *bh = malloc(sizeof(uint16_t) * nb);
    float *dh = malloc(sizeof(float) * nd);
    double *ref = calloc(nd, sizeof(double));
    if (!av || !bv || !ah || !bh || !dh || !ref) {
        CHECK(!"out of host memory");
        goto out;
    }
    for (size_t i = 0; i < na; i++) ah[i] = bf16_int(av[i] = (int)(rnd() % 17) - 8);
    for (size_t i = 0; i < nb; i++) bh[i] = bf16_int(bv[i] = (int)(rnd() % 17) - 8);
    // ref[o][m][n] = sum over the stagings s that feed output o of A_s B_s.
    for (int s = 0; s < S; s++) {
        const int o = sh.n_out == 2 ? s : 0;
        for (int m = 0; m < M; m++)
            for (int n = 0; n < N; n++) {
                double acc = 0;
                for (int k = 0; k < K; k++) {
                    const int b = sh.b_kmajor ? bv[((size_t)s * N + n) * K + k]
                                              : bv[((size_t)s * K + k) * N + n];
                    acc += (double)av[((size_t)s * M + m) * K + k] * b;
                }
                ref[((size_t)o * M + m) * N + n] += acc;
            }
    }
    uint16_t *a = dev_from(ah, sizeof(uint16_t) * na), *b = dev_from(bh, sizeof(uint16_t) * nb);
    float *d = dev_alloc(sizeof(float) * nd);
    int *ran = dev_alloc(sizeof(int));
    dev_poison(d, sizeof(float) * nd);
    CK(di_cuda_memset(g_cu, ran, 0, sizeof(int)));
    CK(di_cuda_wgmma_probe(g_cu, which, a, b, d, ran));
    int ran_h = 0;
    CK(di_cuda_download(g_cu, &ran_h, ran, sizeof ran_h));
    CK(di_cuda_download(g_cu, dh, d, sizeof(float) * nd));
    int64_t n_bad = 0, first = -1, n_transposed = 0;
    for (size_t i = 0; i < nd; i++) {
        if ((double)dh[i] == ref[i]) continue;
        if (n_bad++ == 0) first = (int64_t)i;
        // The value of the transposed position (a K-major / MN-major mix-up), square blocks only.
        const size_t o = i / ((size_t)M * N), m = i / N % M, n = i % N;
        if (n < (size_t)M && m < (size_t)N && (double)dh[i] == ref[(o * M + n) * N + m])
            n_transposed++;
    }
    fprintf(stderr, "  %-8s ran %s, %lld of %zu wrong", sh.what, ran_h == 1 ? "sm_90a" : "stub",
            (long long)n_bad, nd);
    if (first >= 0)
        fprintf(stderr, " (first: out %lld row %lld col %lld: %g, want %g; %lld look transposed)",
                (long long)(first / ((int64_t)M * N)), (long long)(first / N % M),
                (long long)(first % N), (double)dh[first], ref[first], (long long)n_transposed);
    fprintf(stderr, "\n");
    CHECK_EQ(ran_h, 1);
    CHECK_EQ(n_bad, 0);
    if (ran_h != 1 || n_bad != 0) {
        const char *colon = strchr(sh.what, ':');
        const size_t len = colon ? (size_t)(colon - sh.what) : strlen(sh.what),
                     at = strlen(g_failed);
        if (at + len + 2 < sizeof g_failed)
            snprintf(g_failed + at, sizeof g_failed - at, "%s%.*s", at ? "," : "", (int)len,
                     sh.what);
    }
    di_cuda_free(g_cu, ran);
    di_cuda_free(g_cu, d);
    di_cuda_free(g_cu, b);
    di_cuda_free(g_cu, a);
out:
    free(ref);
    free(dh);
    free(bh);
    free(ah);
    free(bv);
    free(av);
}

static void test_probe_cases(void) {
    for (int c = 0; c < DI_CUDA_WGMMA_PROBE_N; c++) probe_case(c);
}

static void test_shapes(void) { // the table's bounds: an unknown case is refused, not run
    CHECK(di_cuda_wgmma_probe_shape_of(-1).what == NULL);
    CHECK(di_cuda_wgmma_probe_shape_of(DI_CUDA_WGMMA_PROBE_N).what == NULL);
    CHECK(di_cuda_wgmma_probe(g_cu, DI_CUDA_WGMMA_PROBE_N, NULL, NULL, NULL, NULL) ==
          DI_ERR_INVALID);
}

// The switches read at context create (cuda_backend.h attn_wg): DI_CUDA_ATTN_WG=0 skips the
// wgmma kernels (the mma.sync ones stay), DI_CUDA_ATTN_TC=0 every tensor-core attention.
static void test_switches(void) {
    static const struct {
        const char *wg, *tc;
        int want_wg, want_tc;
    } cases[] = {{NULL, NULL, 0, 0}, {"0", NULL, -1, 0}, {"1", NULL, 0, 0}, {NULL, "0", -1, -1}};
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        if (cases[c].wg) setenv("DI_CUDA_ATTN_WG", cases[c].wg, 1);
        if (cases[c].tc) setenv("DI_CUDA_ATTN_TC", cases[c].tc, 1);
        di_cuda *cu = NULL;
        CK(di_cuda_create(0, &cu));
        unsetenv("DI_CUDA_ATTN_WG");
        unsetenv("DI_CUDA_ATTN_TC");
        CHECK_EQ(cu->attn_wg, cases[c].want_wg);
        CHECK_EQ(cu->attn_codes_wg, cases[c].want_wg);
        CHECK_EQ(cu->attn_tc, cases[c].want_tc);
        di_cuda_destroy(cu);
    }
}

int main(void) {
    cuda_test_init();
    RUN(test_switches);
    if (!di_cuda_wgmma_available(g_cu)) {
        fprintf(stderr, "wgmma probe: skipped (not a cc 9.0 device with sm_90a code)\n");
        di_cuda_destroy(g_cu);
        if (g_checks_failed) return test_finish(); // the switches' failure is not a skip
        DI_TEST_SKIP("wgmma needs a cc 9.0 device and sm_90a code");
    }
    RUN(test_shapes);
    RUN(test_probe_cases);
    // The summary line gpu-check reports.
    fprintf(stderr, "wgmma probe: %s%s\n", g_failed[0] ? "FAILED " : "all primitives ok", g_failed);
    return cuda_test_finish();
}
