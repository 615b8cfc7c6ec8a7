// The CUDA backend's argmax_rows (backend/backend.h; backend/cuda/sample.cu) against the CPU
// backend's (di_ref_argmax per row, itself checked against the sampler's di_argmax in
// tests/backend/test_cpu_backend.c) on the same rows, bit for bit, through both vtables: random
// rows of the vocabulary's width and of widths that are not multiples of the float4 loads (1, 3,
// 5, 1,027); rows at an offset of 1..3 floats and strides that are not multiples of 4 (every row
// start misaligned differently, so the head, float4 and tail paths all carry the maximum); ties
// (the maximum repeated in one float4, across threads, across warps; -0 before +0); rows of -inf;
// rows of NaN; a NaN at entry 0 before a larger value; NaNs around the maximum; the maximum in
// the first and last entry; the rows past n not written; the argument checks; and a captured
// graph replayed on new rows in the same buffers. Exits 77 without a GPU.
#include "backend/cuda/cuda_test.h" // harness, rnd, CK (its g_cu is the backend's context)

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "backend/backend.h"

static di_backend *g_b;  // CUDA
static di_backend *g_cb; // the CPU backend: the oracle

// Both backends' picks of n rows of V values (`stride` apart) laid out in host rows from float
// `off` on; the CUDA ids must equal the CPU ids, and (want != NULL) the expected ones.
static void check_rows(const float *host, int64_t off, int64_t n, int64_t V, int64_t stride,
                       const int32_t *want, const char *what) {
    const size_t fl = sizeof(float) * (size_t)(off + (n - 1) * stride + V);
    float *xd = NULL;
    int32_t *idd = NULL;
    CK(g_b->vt->alloc(g_b, fl, (void **)&xd));
    CK(g_b->vt->alloc(g_b, sizeof(int32_t) * (size_t)(n + 1), (void **)&idd));
    CK(g_b->vt->upload(g_b, xd, host, fl));
    CK(g_b->vt->memset(g_b, idd, 0xFF, sizeof(int32_t) * (size_t)(n + 1))); // -1: unwritten
    CK(g_b->vt->argmax_rows(g_b, xd + off, n, V, stride, idd));
    CK(g_b->vt->sync(g_b));
    int32_t *got = calloc((size_t)n + 1, sizeof(int32_t)),
            *ref = calloc((size_t)n, sizeof(int32_t));
    CK(g_b->vt->download(g_b, got, idd, sizeof(int32_t) * (size_t)(n + 1)));
    CK(g_cb->vt->argmax_rows(g_cb, host + off, n, V, stride, ref));
    int64_t bad = 0, bad_want = 0;
    for (int64_t r = 0; r < n; r++) {
        bad += got[r] != ref[r];
        if (want) bad_want += ref[r] != want[r];
        if (got[r] != ref[r] && bad <= 3)
            fprintf(stderr, "  %s: row %lld: cuda %d, cpu %d\n", what, (long long)r, got[r],
                    ref[r]);
    }
    fprintf(stderr, "  %s: %lld rows of %lld (stride %lld, offset %lld): %lld differ\n", what,
            (long long)n, (long long)V, (long long)stride, (long long)off, (long long)bad);
    CHECK_EQ(bad, 0);
    CHECK_EQ(bad_want, 0);
    CHECK_EQ(got[n], -1); // the row past n is not written
    free(got);
    free(ref);
    g_b->vt->free(g_b, xd);
    g_b->vt->free(g_b, idd);
}

// Random rows (values in [-4, 4), so equal values are rare: the maximum is the point).
static void test_random(void) {
    const int64_t Vs[] = {1, 3, 5, 1027, 129280};
    const int64_t ns[] = {1, 7, 64};
    for (size_t a = 0; a < sizeof Vs / sizeof Vs[0]; a++)
        for (size_t c = 0; c < sizeof ns / sizeof ns[0]; c++)
            for (int64_t off = 0; off < 4; off += 3) {
                const int64_t V = Vs[a], n = ns[c], stride = V + (off ? 3 : 0);
                if (V * n > 129280 * 8 && off) continue; // the big rows once per layout
                float *h = malloc(sizeof(float) * (size_t)(off + n * stride));
                fill_rand(h, off + n * stride, 4.0f);
                char what[64];
                snprintf(what, sizeof what, "random V=%lld", (long long)V);
                check_rows(h, off, n, V, stride, NULL, what);
                free(h);
            }
}

// Hand-made rows of V = 1027 (a head of 0..3 entries before the first float4, a tail of 3 at
// offset 0) with known answers, at every offset 0..3.
enum { HV = 1027, HN = 12 };
static void test_edges(void) {
    for (int64_t off = 0; off < 4; off++) {
        const int64_t stride = HV + 1; // odd: consecutive rows start 4 bytes apart mod 16
        float *h = malloc(sizeof(float) * (size_t)(off + HN * stride));
        fill_rand(h, off + HN * stride, 1.0f);
        int32_t want[HN];
        float *row[HN];
        for (int r = 0; r < HN; r++) row[r] = h + off + r * stride;
        // 0: ties in one float4 and far apart: the lowest index.
        row[0][600] = row[0][601] = row[0][602] = row[0][1000] = 5.0f, want[0] = 600;
        // 1: ties across warps (indices more than 32 float4s apart).
        row[1][900] = row[1][17] = 5.0f, want[1] = 17;
        // 2: -0 before +0 as the maximum (every other entry negative): the first.
        for (int i = 0; i < HV; i++) row[2][i] = -1.0f - (float)i;
        row[2][300] = -0.0f, row[2][301] = 0.0f, want[2] = 300;
        // 3: all -inf: 0.
        for (int i = 0; i < HV; i++) row[3][i] = -INFINITY;
        want[3] = 0;
        // 4: all NaN: 0.
        for (int i = 0; i < HV; i++) row[4][i] = NAN;
        want[4] = 0;
        // 5: NaN at entry 0, a larger value later: still 0 (the host's scan never leaves it).
        row[5][0] = NAN, row[5][500] = 100.0f, want[5] = 0;
        // 6: NaNs around the maximum: they never win.
        row[6][10] = NAN, row[6][11] = 9.0f, row[6][12] = NAN, row[6][HV - 1] = NAN, want[6] = 11;
        // 7: the maximum in the last entry (the tail).
        row[7][HV - 1] = 7.0f, want[7] = HV - 1;
        // 8: the maximum in the first entry (the head, or lane 0 of the first float4).
        row[8][0] = 7.0f, row[8][HV - 1] = 7.0f, want[8] = 0;
        // 9: -inf everywhere but one NaN and one finite value.
        for (int i = 0; i < HV; i++) row[9][i] = -INFINITY;
        row[9][3] = NAN, row[9][700] = -1e30f, want[9] = 700;
        // 10: +inf twice: the first.
        row[10][2] = INFINITY, row[10][1] = INFINITY, want[10] = 1;
        // 11: entry 0 the maximum only through a tie with later entries.
        row[11][0] = 2.0f, row[11][1] = 2.0f, row[11][1026] = 2.0f, want[11] = 0;
        check_rows(h, off, HN, HV, stride, want, "edges");
        free(h);
    }
    // One row of the vocabulary's width, three equal maxima far apart (other threads, warps).
    const int64_t V = 129280;
    float *h = malloc(sizeof(float) * (size_t)V);
    fill_rand(h, V, 1.0f);
    h[129279] = h[65536] = h[70001] = 3.0f;
    const int32_t w = 65536;
    check_rows(h, 0, 1, V, V, &w, "vocabulary tie");
    free(h);
}

// The argument checks, and 0 rows (a no-op).
static void test_args(void) {
    int32_t *idd = NULL;
    float *xd = NULL;
    CK(g_b->vt->alloc(g_b, 64, (void **)&idd));
    CK(g_b->vt->alloc(g_b, 64, (void **)&xd));
    CHECK_EQ(g_b->vt->argmax_rows(g_b, xd, 1, 0, 4, idd), DI_ERR_INVALID);
    CHECK_EQ(g_b->vt->argmax_rows(g_b, xd, 2, 4, 3, idd), DI_ERR_INVALID);
    CHECK_EQ(g_b->vt->argmax_rows(g_b, xd, -1, 4, 4, idd), DI_ERR_INVALID);
    CHECK_EQ(g_b->vt->argmax_rows(g_b, xd, 1, (int64_t)INT32_MAX + 1, (int64_t)INT32_MAX + 1, idd),
             DI_ERR_INVALID);
    CHECK_EQ(g_cb->vt->argmax_rows(g_cb, NULL, 1, 0, 4, NULL), DI_ERR_INVALID);
    CHECK_EQ(g_cb->vt->argmax_rows(g_cb, NULL, 2, 4, 3, NULL), DI_ERR_INVALID);
    CK(g_b->vt->memset(g_b, idd, 0xFF, 64));
    CHECK_EQ(g_b->vt->argmax_rows(g_b, xd, 0, 4, 4, idd), DI_OK);
    int32_t got[16];
    CK(g_b->vt->sync(g_b));
    CK(g_b->vt->download(g_b, got, idd, 64));
    CHECK_EQ(got[0], -1);
    g_b->vt->free(g_b, idd);
    g_b->vt->free(g_b, xd);
}

// Captured once, replayed on new rows in the same buffers: the picks of the new rows.
static void test_graph(void) {
    enum { N = 5, W = 4099 };
    float *xd = NULL, *h = malloc(sizeof(float) * N * W);
    int32_t *idd = NULL, got[N], ref[N];
    CK(g_b->vt->alloc(g_b, sizeof(float) * N * W, (void **)&xd));
    CK(g_b->vt->alloc(g_b, sizeof got, (void **)&idd));
    void *graph = NULL;
    CK(g_b->vt->graph_begin(g_b));
    CK(g_b->vt->argmax_rows(g_b, xd, N, W, W, idd));
    CK(g_b->vt->graph_end(g_b, &graph));
    for (int it = 0; it < 3; it++) {
        fill_rand(h, N * W, 2.0f);
        h[(it + 1) * W - 1] = 9.0f; // row it's maximum in its last entry
        CK(g_b->vt->upload(g_b, xd, h, sizeof(float) * N * W));
        CK(g_b->vt->memset(g_b, idd, 0xFF, sizeof got));
        CK(g_b->vt->graph_launch(g_b, graph));
        CK(g_b->vt->sync(g_b));
        CK(g_b->vt->download(g_b, got, idd, sizeof got));
        CK(g_cb->vt->argmax_rows(g_cb, h, N, W, W, ref));
        CHECK(!memcmp(got, ref, sizeof got));
        CHECK_EQ(got[it], W - 1);
    }
    g_b->vt->graph_destroy(g_b, graph);
    g_b->vt->free(g_b, xd);
    g_b->vt->free(g_b, idd);
    free(h);
}

int main(void) {
    if (di_cuda_device_count() == 0) DI_TEST_SKIP("no CUDA device");
    CK(di_cuda_backend_create(0, &g_b));
    g_cu = (di_cuda *)g_b->impl;
    CK(di_cpu_backend_create(2, &g_cb));
    fprintf(stderr, "backend: %s\n", g_b->desc);
    RUN(test_random);
    RUN(test_edges);
    RUN(test_args);
    RUN(test_graph);
    CK(g_b->vt->sync(g_b));
    g_b->vt->destroy(g_b);
    g_cb->vt->destroy(g_cb);
    return test_finish();
}
