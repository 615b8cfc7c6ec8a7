// CUDA lightning indexer (backend/cuda/indexer.cuh): scores against a host transcription of
// model/dsv4_attn.c indexer_task (ReLU per head, then the head weight, summed in head order), and
// the top-k against the model's own heap selection (di_dsv4_topk) on identical scores (exact: the
// same set in ascending order, -1 padded): rows with fewer visible entries than k (all selected),
// exactly k, many more (V4: 64 heads x 128, top-512 of up to 32768 entries), heavy ties (scores on
// a coarse grid: the lower index must win), negative scores, BF16-rounded scores, 1 visible entry,
// a negative count (nothing selected); scores of more than 65,535 rows (the grid-row limit); both
// score kernels (lane per entry, warp per entry).
#include "backend/cuda/cuda_test.h"

#include <stdlib.h>

#include "backend/cpu/ref_ops.h"
#include "backend/cuda/indexer.cuh"
#include "model/dsv4.h" // di_dsv4_topk
#include "tensor/quant_ref.h"

// Scores: each head's dot in another order (gamma(DI) * sum|q k|) before the ReLU, then a sum of
// HI weighted terms: bound gamma(DI) * sum_h |w_h| sum|q k| + gamma(HI) * sum_h |w_h relu(dot)|.
#define TOL_SCORE_FACTOR 2.0

// The model's selection (model/dsv4_attn.c): k = min(visible, topk) picks, -1 padded; every
// visible entry when there are no more than k.
static void ref_topk(const float *sc, int64_t vis, int32_t topk, int32_t *sel) {
    for (int32_t i = 0; i < topk; i++) sel[i] = -1;
    int32_t k = (int32_t)(vis < topk ? vis : topk);
    if (k == vis) {
        for (int32_t i = 0; i < k; i++) sel[i] = i;
        return;
    }
    di_dsv4_topk(sc, vis, k, sel);
}

static void scores_case(int32_t T, int32_t HI, int32_t DI, int32_t n_ent, bool round) {
    float *qi = malloc(sizeof(float) * (size_t)(T * HI * DI)),
          *wi = malloc(sizeof(float) * (size_t)(T * HI));
    float *keys = malloc(sizeof(float) * (size_t)(n_ent * DI));
    int32_t *vis = malloc(sizeof(int32_t) * (size_t)T);
    fill_rand(qi, (int64_t)T * HI * DI, 1.0f);
    fill_rand(wi, (int64_t)T * HI, 0.1f);
    fill_rand(keys, (int64_t)n_ent * DI, 1.0f);
    for (int32_t t = 0; t < T; t++)
        vis[t] = t == 0 ? 1 : t == 1 ? n_ent : (int32_t)(rnd() % (uint64_t)n_ent) + 1;
    float *ref = malloc(sizeof(float) * (size_t)(T * n_ent)),
          *out = malloc(sizeof(float) * (size_t)(T * n_ent));
    double *tol = malloc(sizeof(double) * (size_t)(T * n_ent));
    for (int64_t i = 0; i < (int64_t)T * n_ent; i++) ref[i] = NAN, tol[i] = 0;
    for (int32_t t = 0; t < T; t++)
        for (int32_t w = 0; w < vis[t]; w++) {
            const float *kw = keys + (int64_t)w * DI;
            float acc = 0;
            double bound = 0;
            for (int32_t h = 0; h < HI; h++) {
                const float *q = qi + ((int64_t)t * HI + h) * DI;
                float dot = di_ref_dot(q, kw, DI);
                double a = 0;
                for (int32_t d = 0; d < DI; d++) a += fabs((double)q[d] * kw[d]);
                acc += wi[t * HI + h] * (dot > 0 ? dot : 0);
                bound +=
                    fabs(wi[t * HI + h]) * (gamma_k(DI) * a + gamma_k(HI) * (dot > 0 ? dot : 0));
            }
            ref[(int64_t)t * n_ent + w] = round ? di_round_bf16(acc) : acc;
            // BF16 rounding can land one BF16 step apart (2^-8 relative) near a rounding edge.
            tol[(int64_t)t * n_ent + w] = TOL_SCORE_FACTOR * bound + (round ? fabs(acc) / 128 : 0);
        }
    float *qd = dev_from(qi, sizeof(float) * (size_t)(T * HI * DI)),
          *wd = dev_from(wi, sizeof(float) * (size_t)(T * HI));
    float *kd = dev_from(keys, sizeof(float) * (size_t)(n_ent * DI));
    int32_t *vd = dev_from(vis, sizeof(int32_t) * (size_t)T);
    float *sd = dev_alloc(sizeof(float) * (size_t)(T * n_ent));
    dev_poison(sd, sizeof(float) * (size_t)(T * n_ent));
    CK(di_cuda_indexer_scores(g_cu, qd, wd, kd, NULL, NULL, NULL, 0, vd, n_ent, T, HI, DI, round,
                              sd, n_ent));
    dev_to(out, sd, sizeof(float) * (size_t)(T * n_ent));
    char what[96];
    snprintf(what, sizeof what, "indexer scores T=%d HI=%d DI=%d n=%d%s", T, HI, DI, n_ent,
             round ? " bf16" : "");
    CHECK(check_bounds(what, out, ref, tol, (int64_t)T * n_ent) == 0);
    dev_free(qd), dev_free(wd), dev_free(kd), dev_free(vd), dev_free(sd);
    free(qi), free(wi), free(keys), free(vis), free(ref), free(out), free(tol);
}

static void test_scores(void) {
    scores_case(3, 4, 128, 40, false);    // tiny fixture
    scores_case(5, 64, 128, 3000, false); // V4 heads
    scores_case(4, 64, 128, 700, true);
    // Both kernels: lane per entry (DI % 4 == 0, HI <= 64; 8 or 64 accumulators) and warp per
    // entry (DI 7, HI 65), rows over more than one 256-entry block.
    scores_case(3, 8, 16, 600, false);
    scores_case(3, 9, 12, 300, true);
    scores_case(3, 3, 7, 300, false);
    scores_case(2, 65, 8, 100, false);
    // More rows than gridDim.y's 65,535 (one grid row per call row failed to launch; the rows past
    // it must be scored too), 66 entries: two key blocks per row. Tiny widths keep it cheap.
    scores_case(65535 + 9, 2, 8, 66, false);
}

// grid: 0 = continuous scores, > 0 scores drawn from `grid` values (ties), < 0 scores of every
// magnitude and sign with infinities and signed zeros.
static void topk_case(int32_t T, int32_t n_ent, int32_t topk, int grid) {
    float *sc = malloc(sizeof(float) * (size_t)(T * n_ent));
    int32_t *vis = malloc(sizeof(int32_t) * (size_t)T);
    for (int64_t i = 0; i < (int64_t)T * n_ent; i++)
        sc[i] = grid ? (float)(int)(rnd() % (uint64_t)grid) - (float)grid / 2 : rndf() * 100.0f;
    if (grid < 0) { // every byte of the ordered key in play: +-inf, huge, subnormal, +-0, ties
        static const float special[8] = {INFINITY, -INFINITY, 3e38f, -3e38f,
                                         1e-40f,   -1e-40f,   0.0f,  -0.0f};
        for (int64_t i = 0; i < (int64_t)T * n_ent; i++) {
            const uint64_t r = rnd();
            sc[i] = r % 4 == 0   ? special[(r >> 8) % 8]
                    : r % 4 == 1 ? ldexpf(rndf(), (int)((r >> 8) % 250) - 125)
                                 : rndf();
        }
    }
    // Signed zeros among the ties: -0 == +0 for the CPU (a tie, to the lower index).
    for (int64_t i = 0; grid && i < (int64_t)T * n_ent; i += 2)
        if (sc[i] == 0.0f) sc[i] = -0.0f;
    for (int32_t t = 0; t < T; t++) {
        vis[t] = t == 0   ? 1
                 : t == 1 ? n_ent
                 : t == 2 ? (topk < n_ent ? topk : n_ent)
                          : (int32_t)(rnd() % (uint64_t)n_ent) + 1;
    }
    int32_t *ref = malloc(sizeof(int32_t) * (size_t)(T * topk)),
            *out = malloc(sizeof(int32_t) * (size_t)(T * topk));
    for (int32_t t = 0; t < T; t++) ref_topk(sc + (int64_t)t * n_ent, vis[t], topk, ref + t * topk);
    float *sd = dev_from(sc, sizeof(float) * (size_t)(T * n_ent));
    int32_t *vd = dev_from(vis, sizeof(int32_t) * (size_t)T),
            *od = dev_alloc(sizeof(int32_t) * (size_t)(T * topk));
    CK(di_cuda_memset(g_cu, od, 0x55, sizeof(int32_t) * (size_t)(T * topk))); // poison (not -1)
    CK(di_cuda_topk(g_cu, sd, n_ent, vd, T, topk, od));
    dev_to(out, od, sizeof(int32_t) * (size_t)(T * topk));
    int64_t bad_rows = 0;
    for (int32_t t = 0; t < T; t++) {
        if (memcmp(ref + t * topk, out + t * topk, sizeof(int32_t) * (size_t)topk) != 0) {
            if (bad_rows++ < 3) {
                int32_t i = 0;
                while (ref[t * topk + i] == out[t * topk + i]) i++;
                fprintf(stderr, "  row %d (vis %d): first difference at %d: got %d, want %d\n", t,
                        vis[t], i, out[t * topk + i], ref[t * topk + i]);
            }
        }
    }
    fprintf(stderr, "  topk T=%d n=%d k=%d grid=%d: %lld rows differ\n", T, n_ent, topk, grid,
            (long long)bad_rows);
    CHECK(bad_rows == 0);
    dev_free(sd), dev_free(vd), dev_free(od);
    free(sc), free(vis), free(ref), free(out);
}

// A negative count selects nothing, as the CPU: the row all -1, nothing written outside the
// selection. Before, k = n_vis < 0 started the -1 padding before the row: row 0's wrote into the
// guard words before the selection (unwritten by any other row, so the overrun shows whatever the
// blocks' order), a later row's into the rows before it.
static void topk_negative_case(void) {
    enum { T = 3, N = 40, K = 8, G = 64 };
    float sc[T * N];
    for (int i = 0; i < T * N; i++) sc[i] = rndf() * 10.0f;
    const int32_t vis[T] = {-5, N, -(K + 3)};
    int32_t ref[T * K], got[G + T * K + G];
    for (int32_t t = 0; t < T; t++) ref_topk(sc + t * N, vis[t], K, ref + t * K);
    float *sd = dev_from(sc, sizeof sc);
    int32_t *vd = dev_from(vis, sizeof vis), *od = dev_alloc(sizeof got);
    CK(di_cuda_memset(g_cu, od, 0x55, sizeof got)); // poison and guards (not -1)
    CK(di_cuda_topk(g_cu, sd, N, vd, T, K, od + G));
    dev_to(got, od, sizeof got);
    bool guards = true;
    for (int i = 0; i < G; i++) guards &= got[i] == 0x55555555 && got[G + T * K + i] == 0x55555555;
    CHECK(guards);
    CHECK(memcmp(got + G, ref, sizeof ref) == 0);
    for (int i = 0; i < K; i++) CHECK(ref[i] == -1 && ref[2 * K + i] == -1);
    dev_free(sd), dev_free(vd), dev_free(od);
}

static void test_topk(void) {
    topk_negative_case();
    topk_case(6, 40, 3, 0);      // tiny fixture
    topk_case(6, 40, 3, 4);      // ties
    topk_case(8, 32768, 512, 0); // V4-Flash at 128k context
    topk_case(8, 5000, 512, 7);  // heavy ties
    topk_case(4, 20000, 1024, 0);
    topk_case(3, 600, 512, 2);
    topk_case(6, 3000, 700, -1); // scores spanning every exponent, infinities, zeros of both signs
}

int main(void) {
    cuda_test_init();
    RUN(test_scores);
    RUN(test_topk);
    return cuda_test_finish();
}
