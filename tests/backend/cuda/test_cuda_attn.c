// CUDA attention pieces (backend/cuda/attn.cuh): the FP8 KV row format against Q8 of
// tensor/quant_ref.c (bit-exact, decoded on the host with di_e4m3_to_f32 / di_ue8m0_to_f32), the
// attention over index-listed keys with the sink against a double-precision host reference on the
// same decoded keys (V4 head_dim 512 / 64 rope dims = 584-byte rows, and the tiny fixture's
// 128 / 64), queries with 0 keys, 1 key, one tile, not a multiple of the tile, -1 padding, only
// masked keys, 8300 keys; both kernels: the exact FP32 one (di_cuda_attn) and the BF16
// tensor-core one (di_cuda_attn_bf16, with 1, automatic and 3 key splits, plus an exact check of
// which keys it uses with one-hot keys) and, on a cc 9.0 device, its wgmma instance
// (di_cuda_attn_wg, dh 512: the same cases and bounds; refused elsewhere); n_keys beyond max_keys
// or negative (device data): clamped, reported by the next sync as DI_ERR_INVALID once, on every
// kernel;
// and the compressor pooling against a transcription of model/dsv4_attn.c compressor_step (HCA
// c = 1, CSA c = 2 with and without the overlap).
#include "backend/cuda/cuda_test.h"

#include "backend/cuda/attn.cuh"
#include "backend/cuda/wgmma_probe.cuh" // di_cuda_wgmma_available
#include "tensor/quant_ref.h"

// Attention: the GPU's FP32 scores differ from exact by at most gamma(dh) * scale * sum|q k| each
// (the bound E below); each probability then moves by at most ~2E relative, and o_d by
// sum_j p_j |k_jd| times that, plus FP32 rounding of the value sum (1e-5 relative covers n_keys up
// to ~1000 realistically). A wrong key, head, scale or sink moves o by O(p_j |k_j|).
#define TOL_ATTN_SUM_REL 1e-5
// Pooling: softmax over <= 8 slots in the same order with expf on both sides (2 ulp): 16u.
#define TOL_POOL_REL (16 * 5.96e-8)

// Host decode of one KV row (independent of the GPU decoder).
static void host_decode(const uint8_t *row, int32_t dh, int32_t n_rot, float *out) {
    const int32_t nope = dh - n_rot;
    for (int32_t d = 0; d < nope; d++)
        out[d] = di_e4m3_to_f32(row[d]) * di_ue8m0_to_f32(row[nope + 2 * n_rot + d / 64]);
    for (int32_t d = 0; d < n_rot; d++) {
        uint16_t h;
        memcpy(&h, row + nope + 2 * d, 2);
        out[nope + d] = di_bf16_to_f32(h);
    }
}

// Quantises n rows on the GPU and checks them; returns the device pool (n rows) and the decoded
// keys on the host ([n, dh], caller frees).
static uint8_t *kv_rows(int64_t n, int32_t dh, int32_t n_rot, float **keys_out) {
    const int64_t rb = di_cuda_kv_row_bytes(dh, n_rot);
    float *kv = malloc(sizeof(float) * (size_t)(n * dh)),
          *want = malloc(sizeof(float) * (size_t)dh);
    float *keys = malloc(sizeof(float) * (size_t)(n * dh)),
          *gdec = malloc(sizeof(float) * (size_t)(n * dh));
    for (int64_t i = 0; i < n * dh; i++) {
        // A spread of magnitudes per 64-block so scales differ; some tiny values (subnormal
        // codes) and an all-small block (the 1e-4 floor).
        const int64_t blk = (i % dh) / 64;
        float mag = blk == 1 ? 1e-6f : powf(2.0f, (float)(blk * 3 % 11) - 5.0f);
        kv[i] = rndf() * mag;
    }
    uint8_t *pool = dev_alloc((size_t)(n * rb)), *host = malloc((size_t)(n * rb));
    float *kvd = dev_from(kv, sizeof(float) * (size_t)(n * dh));
    float *gd = dev_alloc(sizeof(float) * (size_t)(n * dh));
    dev_poison(pool, (size_t)(n * rb));
    dev_poison(gd, sizeof(float) * (size_t)(n * dh));
    CK(di_cuda_kv_quant(g_cu, kvd, n, dh, dh, n_rot, pool, NULL));
    CK(di_cuda_kv_dequant(g_cu, pool, NULL, n, dh, n_rot, gd));
    dev_to(host, pool, (size_t)(n * rb));
    dev_to(gdec, gd, sizeof(float) * (size_t)(n * dh));
    int64_t bad = 0, pad_bad = 0;
    const int32_t nope = dh - n_rot;
    for (int64_t r = 0; r < n; r++) {
        memcpy(want, kv + r * dh, sizeof(float) * (size_t)dh);
        di_fake_quant_q8(want, nope, 64);
        for (int32_t d = nope; d < dh; d++) want[d] = di_round_bf16(want[d]);
        host_decode(host + r * rb, dh, n_rot, keys + r * dh);
        for (int32_t d = 0; d < dh; d++) {
            bad += memcmp(&want[d], &keys[r * dh + d], 4) != 0 &&
                   !(want[d] == 0 && keys[r * dh + d] == 0);
            bad += memcmp(&gdec[r * dh + d], &keys[r * dh + d], 4) != 0;
        }
        for (int64_t p = nope + 2 * n_rot + nope / 64; p < rb; p++)
            pad_bad += host[r * rb + p] != 0;
    }
    fprintf(stderr, "  kv rows dh=%d rot=%d (%lld bytes) x %lld: %lld values differ from Q8\n", dh,
            n_rot, (long long)rb, (long long)n, (long long)bad);
    CHECK(bad == 0);
    CHECK(pad_bad == 0);
    dev_free(kvd), dev_free(gd);
    free(kv), free(want), free(host), free(gdec);
    *keys_out = keys;
    return pool;
}

static void test_kv_row_size(void) {
    CHECK_EQ(di_cuda_kv_row_bytes(512, 64), 584); // spec §3.3
    CHECK_EQ(di_cuda_kv_row_bytes(128, 64), 200);
}

// Key lists for T query rows over a pool of n_pool rows, lengths by t % 8: 0 keys (o = 0), 1,
// one whole tile (64), max_keys (not a multiple of 64), 65, max_keys - 1 with every third entry
// -1 (top-k padding: masked), 50 entries all -1 (only the sink: o = 0), random. A window of 128
// consecutive rows (ring) first, then random rows (repeats allowed); -7 past n_keys[t] (unread).
static void make_lists(int32_t T, int32_t max_keys, int64_t n_pool, int32_t *n_keys, int32_t *idx) {
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
        n_keys[t] = nk;
        const int64_t w0 = (int64_t)(rnd() % (uint64_t)n_pool);
        for (int32_t j = 0; j < max_keys; j++) {
            int32_t v =
                j < 128 ? (int32_t)((w0 + j) % n_pool) : (int32_t)(rnd() % (uint64_t)n_pool);
            if ((kind == 5 && j % 3 == 2) || kind == 6) v = -1;
            idx[(int64_t)t * max_keys + j] = j < nk ? v : -7;
        }
    }
}

// Double-precision attention with the sink over the decoded keys for queries q (as the kernel
// sees them), and per-element bounds tol = sum_j p_j |k_jd| * (4 E + rel) where
// E = acc_gamma * gamma(dh) * scale * max_j sum_d |q_d k_jd| bounds each score's accumulation
// error (a score error e moves each p_j by at most a factor e^{2e}) and rel covers the rest
// (rounding of p, the value sums). Masked keys (index < 0) take no mass.
static void ref_attn(const float *q, const float *keys, const int32_t *n_keys, const int32_t *idx,
                     int32_t max_keys, const float *sink, int32_t T, int32_t H, int32_t dh,
                     float scale, double acc_gamma, double rel, float *ref, double *tol) {
    double *sc = malloc(sizeof(double) * (size_t)(max_keys + 1));
    for (int32_t t = 0; t < T; t++)
        for (int32_t h = 0; h < H; h++) {
            const float *qv = q + ((int64_t)t * H + h) * dh;
            const int32_t *ix = idx + (int64_t)t * max_keys;
            double mx = sink[h], maxabs = 0;
            for (int32_t j = 0; j < n_keys[t]; j++) {
                if (ix[j] < 0) continue;
                const float *k = keys + (int64_t)ix[j] * dh;
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
            const double E = acc_gamma * gamma_k(dh) * scale * maxabs;
            for (int32_t d = 0; d < dh; d++) {
                double o = 0, mag = 0;
                for (int32_t j = 0; j < n_keys[t]; j++) {
                    if (ix[j] < 0) continue;
                    const double kd = keys[(int64_t)ix[j] * dh + d];
                    o += sc[j] / den * kd;
                    mag += sc[j] / den * fabs(kd);
                }
                const int64_t i = ((int64_t)t * H + h) * dh + d;
                ref[i] = (float)o;
                if (tol) tol[i] = mag * (4 * E + rel) + 1e-30;
            }
        }
    free(sc);
}

// The BF16 tensor-core kernel (di_cuda_attn_bf16): q is rounded to BF16 (the reference gets the
// same rounded q: lossless in the official recipe), scores accumulate in the MMA's FP32 (allow 4x
// the RN gamma: Hopper's accumulator alignment may truncate, ~2 ulp per addition), and each
// unnormalised p is rounded to BF16 (relative u = 2^-8) in both the numerator and the
// denominator, so each normalised weight moves by at most 2u / (1 - u) relative.
#define TOL_TC_ACC_GAMMA 4.0
#define TOL_TC_P_REL (2.01 * 0.00390625 + 1e-4) // + FP32 rescaling and sums (1e-4 >> 100 u)
// Against the unrounded q (the fp32 recipe's input), on spread softmaxes (|scale q.k| <~ 2): the
// BF16 q moves each score by <= 2^-8 * scale * sum|q k| worst case, ~10x less in the mean.
#define TOL_TC_QROUND_REL_L2 1e-2

// The tensor-core kernel at dh 512 needs more shared memory than an A100 has: it says
// DI_ERR_UNSUPPORTED there, and the case is skipped (logged), not failed. Any other status fails.
static bool tc_ran(di_status st, const char *what) {
    if (st == DI_ERR_UNSUPPORTED) {
        fprintf(stderr, "  %s: UNSUPPORTED on this device (shared memory), skipped\n", what);
        return false;
    }
    CK(st);
    return true;
}

// The tensor-core kernels under test: 0 mma.sync (di_cuda_attn_bf16), 1 wgmma (di_cuda_attn_wg,
// dh 512 with 64 rope dims only). The wgmma one says DI_ERR_UNSUPPORTED off a cc 9.0 device with
// sm_90a code (skipped, logged); on one, that answer fails the test (a build without the sm_90a
// kernel would otherwise pass untested).
enum { TC_MMA = 0, TC_WG = 1, TC_KERNELS = 2 };
static const char *const tc_name[TC_KERNELS] = {"attn_bf16", "attn_wg"};
static bool tc_has(int kernel, int32_t dh, int32_t n_rot) {
    return kernel == TC_MMA || (dh == 512 && n_rot == 64);
}
static di_status tc_attn(int kernel, const float *q, const uint8_t *pool, const int32_t *idx,
                         int64_t key_stride, const int32_t *nk, int32_t max_keys, const float *sink,
                         int32_t T, int32_t H, int32_t dh, int32_t n_rot, float scale,
                         int32_t n_split, float *o) {
    return kernel == TC_WG ? di_cuda_attn_wg(g_cu, q, pool, idx, key_stride, nk, max_keys, sink, T,
                                             H, dh, n_rot, scale, n_split, o)
                           : di_cuda_attn_bf16(g_cu, q, pool, idx, key_stride, nk, max_keys, sink,
                                               T, H, dh, n_rot, scale, n_split, o);
}
static bool tc_ran_k(int kernel, di_status st, const char *what) {
    if (kernel == TC_WG && st == DI_ERR_UNSUPPORTED) {
        const bool has = di_cuda_wgmma_available(g_cu);
        fprintf(stderr, "  %s: UNSUPPORTED %s\n", what,
                has ? "on a cc 9.0 device with sm_90a code" : "(no wgmma here), skipped");
        CHECK(!has); // the wgmma kernel must run where it has code
        return false;
    }
    return tc_ran(st, what);
}

static void attn_case(int32_t dh, int32_t n_rot, int32_t H, int32_t T, int64_t n_pool,
                      int32_t max_keys, float q_amp) {
    float *keys;
    uint8_t *pool = kv_rows(n_pool, dh, n_rot, &keys);
    int32_t *n_keys = malloc(sizeof(int32_t) * (size_t)T);
    int32_t *idx = malloc(sizeof(int32_t) * (size_t)T * (size_t)max_keys);
    make_lists(T, max_keys, n_pool, n_keys, idx);
    const int64_t n_o = (int64_t)T * H * dh;
    float *q = malloc(sizeof(float) * (size_t)n_o), *qb = malloc(sizeof(float) * (size_t)n_o),
          *sink = malloc(sizeof(float) * (size_t)H);
    fill_rand(q, n_o, q_amp);
    for (int64_t i = 0; i < n_o; i++) qb[i] = di_round_bf16(q[i]);
    fill_rand(sink, H, 2.0f);
    const float scale = 1.0f / sqrtf((float)dh);
    float *ref = malloc(sizeof(float) * (size_t)n_o), *refb = malloc(sizeof(float) * (size_t)n_o),
          *out = malloc(sizeof(float) * (size_t)n_o);
    double *tol = malloc(sizeof(double) * (size_t)n_o),
           *tolb = malloc(sizeof(double) * (size_t)n_o);
    ref_attn(q, keys, n_keys, idx, max_keys, sink, T, H, dh, scale, 1.0, TOL_ATTN_SUM_REL, ref,
             tol);
    ref_attn(qb, keys, n_keys, idx, max_keys, sink, T, H, dh, scale, TOL_TC_ACC_GAMMA, TOL_TC_P_REL,
             refb, tolb);
    float *qd = dev_from(q, sizeof(float) * (size_t)n_o),
          *sd = dev_from(sink, sizeof(float) * (size_t)H);
    int32_t *idxd = dev_from(idx, sizeof(int32_t) * (size_t)T * (size_t)max_keys);
    int32_t *nkd = dev_from(n_keys, sizeof(int32_t) * (size_t)T);
    float *od = dev_alloc(sizeof(float) * (size_t)n_o);
    char what[128];
    // The exact FP32 kernel.
    dev_poison(od, sizeof(float) * (size_t)n_o);
    CK(di_cuda_attn(g_cu, qd, pool, idxd, max_keys, nkd, max_keys, sd, T, H, dh, n_rot, scale, od));
    dev_to(out, od, sizeof(float) * (size_t)n_o);
    snprintf(what, sizeof what, "attn dh=%d H=%d T=%d keys<=%d", dh, H, T, max_keys);
    CHECK(check_bounds(what, out, ref, tol, n_o) == 0);
    fprintf(stderr, "  rel_l2 %.3g\n", rel_l2(out, ref, n_o));
    // The BF16 tensor-core kernel: one split (sink in the main kernel), automatic, and 3 splits
    // (partials + combine).
    static const int32_t splits[] = {1, 0, 3};
    for (int kernel = 0; kernel < TC_KERNELS; kernel++)
        for (int si = 0; si < 3 && tc_has(kernel, dh, n_rot); si++) {
            dev_poison(od, sizeof(float) * (size_t)n_o);
            snprintf(what, sizeof what, "%s dh=%d H=%d T=%d keys<=%d q~%g split=%d",
                     tc_name[kernel], dh, H, T, max_keys, (double)q_amp, splits[si]);
            if (!tc_ran_k(kernel,
                          tc_attn(kernel, qd, pool, idxd, max_keys, nkd, max_keys, sd, T, H, dh,
                                  n_rot, scale, splits[si], od),
                          what))
                break;
            dev_to(out, od, sizeof(float) * (size_t)n_o);
            CHECK(check_bounds(what, out, refb, tolb, n_o) == 0);
            const double e = rel_l2(out, ref, n_o);
            fprintf(stderr, "  rel_l2 vs bf16-q ref %.3g, vs fp32-q ref %.3g\n",
                    rel_l2(out, refb, n_o), e);
            if (q_amp <= 0.1f) CHECK(e <= TOL_TC_QROUND_REL_L2);
        }
    dev_free(qd), dev_free(sd), dev_free(idxd), dev_free(nkd), dev_free(od), dev_free(pool);
    free(keys), free(n_keys), free(idx), free(q), free(qb), free(sink), free(ref), free(refb),
        free(out), free(tol), free(tolb);
}

static void test_attn(void) {
    attn_case(512, 64, 8, 9, 1500, 828, 1.0f);    // V4 dims, peaked softmax, padded head group
    attn_case(512, 64, 64, 8, 900, 828, 0.05f);   // V4 shape, spread softmax, every length kind
    attn_case(512, 64, 64, 4, 3000, 8300, 0.05f); // long lists (8k+), many splits
    attn_case(128, 64, 4, 7, 300, 828, 1.0f);     // tiny fixture dims
    attn_case(128, 64, 80, 8, 300, 200, 0.1f);    // two head groups, the second padded
}

// Which keys are used, exactly: q = 0 makes every listed key's score 0, so p = 1 exactly in BF16,
// o_d = c_d / (n_valid + e^sink) where c_d counts the valid listed rows r with r % dh == d (row r
// of the pool is the one-hot e_{r % dh}: exact in the KV format). A key wrongly used, dropped or
// masked moves o_d * den by 1 (or den by 1); FP32 rounding of the final products and the split
// combine stays under 1e-6 relative.
#define TOL_ONEHOT_REL 1e-5

static void onehot_case(int kernel, int32_t dh, int32_t n_rot, int32_t H, int32_t T,
                        int32_t max_keys, int32_t n_split) {
    const int64_t n_pool = 3 * dh + 5;
    float *kv = calloc((size_t)(n_pool * dh), sizeof(float));
    for (int64_t r = 0; r < n_pool; r++) kv[r * dh + r % dh] = 1.0f;
    const int64_t rb = di_cuda_kv_row_bytes(dh, n_rot);
    float *kvd = dev_from(kv, sizeof(float) * (size_t)(n_pool * dh));
    uint8_t *pool = dev_alloc((size_t)(n_pool * rb));
    CK(di_cuda_kv_quant(g_cu, kvd, n_pool, dh, dh, n_rot, pool, NULL));
    int32_t *n_keys = malloc(sizeof(int32_t) * (size_t)T);
    int32_t *idx = malloc(sizeof(int32_t) * (size_t)T * (size_t)max_keys);
    make_lists(T, max_keys, n_pool, n_keys, idx);
    const int64_t n_o = (int64_t)T * H * dh;
    float *q = calloc((size_t)n_o, sizeof(float)), *sink = malloc(sizeof(float) * (size_t)H);
    float *out = malloc(sizeof(float) * (size_t)n_o);
    fill_rand(sink, H, 2.0f);
    float *qd = dev_from(q, sizeof(float) * (size_t)n_o),
          *sd = dev_from(sink, sizeof(float) * (size_t)H);
    int32_t *idxd = dev_from(idx, sizeof(int32_t) * (size_t)T * (size_t)max_keys);
    int32_t *nkd = dev_from(n_keys, sizeof(int32_t) * (size_t)T);
    float *od = dev_alloc(sizeof(float) * (size_t)n_o);
    dev_poison(od, sizeof(float) * (size_t)n_o);
    int32_t *cnt = malloc(sizeof(int32_t) * (size_t)dh);
    int64_t bad = 0;
    char what[96];
    snprintf(what, sizeof what, "onehot %s dh=%d H=%d T=%d keys<=%d split=%d", tc_name[kernel], dh,
             H, T, max_keys, n_split);
    if (!tc_ran_k(kernel,
                  tc_attn(kernel, qd, pool, idxd, max_keys, nkd, max_keys, sd, T, H, dh, n_rot,
                          1.0f / sqrtf((float)dh), n_split, od),
                  what))
        T = 0; // skipped: nothing to compare
    else
        dev_to(out, od, sizeof(float) * (size_t)n_o);
    for (int32_t t = 0; t < T; t++) {
        int32_t nv = 0;
        memset(cnt, 0, sizeof(int32_t) * (size_t)dh);
        for (int32_t j = 0; j < n_keys[t]; j++) {
            const int32_t r = idx[(int64_t)t * max_keys + j];
            if (r >= 0) nv++, cnt[r % dh]++;
        }
        for (int32_t h = 0; h < H; h++) {
            const double den = nv + exp((double)sink[h]);
            for (int32_t d = 0; d < dh; d++) {
                const double got = out[((int64_t)t * H + h) * dh + d] * den;
                const bool ok = !isnan(got) && fabs(got - cnt[d]) <= TOL_ONEHOT_REL * (cnt[d] + 1);
                if (!ok && bad++ < 5)
                    fprintf(stderr,
                            "  onehot t=%d (n=%d valid %d) h=%d d=%d: o*den %.7g, count %d\n", t,
                            n_keys[t], nv, h, d, got, cnt[d]);
            }
        }
    }
    fprintf(stderr, "  %s: %lld wrong\n", what, (long long)bad);
    CHECK(bad == 0);
    dev_free(kvd), dev_free(pool), dev_free(qd), dev_free(sd), dev_free(idxd), dev_free(nkd),
        dev_free(od);
    free(kv), free(n_keys), free(idx), free(q), free(sink), free(out), free(cnt);
}

static void test_attn_bf16_keys(void) {
    for (int kernel = 0; kernel < TC_KERNELS; kernel++) {
        onehot_case(kernel, 512, 64, 64, 8, 8300, 1);
        onehot_case(kernel, 512, 64, 64, 8, 8300, 0);
        onehot_case(kernel, 512, 64, 70, 3, 700, 2); // a padded second head group
    }
    onehot_case(TC_MMA, 128, 64, 4, 16, 700, 0);
    onehot_case(TC_MMA, 128, 64, 4, 16, 700, 5);
}

static void test_attn_bf16_refuses(void) {
    // Unsupported head dims are refused before any launch (the caller falls back).
    CHECK_EQ(
        di_cuda_attn_bf16(g_cu, NULL, NULL, NULL, 0, NULL, 0, NULL, 1, 1, 256, 64, 1.0f, 0, NULL),
        DI_ERR_INVALID);
    CHECK_EQ(
        di_cuda_attn_bf16(g_cu, NULL, NULL, NULL, 0, NULL, 0, NULL, 1, 1, 512, 32, 1.0f, 0, NULL),
        DI_ERR_INVALID);
    // The wgmma kernel: dh 512 with 64 rope dims only (the tiny fixture's 128 stays on mma.sync).
    CHECK_EQ(
        di_cuda_attn_wg(g_cu, NULL, NULL, NULL, 0, NULL, 0, NULL, 1, 1, 128, 64, 1.0f, 0, NULL),
        DI_ERR_INVALID);
    CHECK_EQ(
        di_cuda_attn_wg(g_cu, NULL, NULL, NULL, 0, NULL, 0, NULL, 1, 1, 512, 32, 1.0f, 0, NULL),
        DI_ERR_INVALID);
}

// n_keys is device data the kernels cannot check before they run: a count beyond max_keys (or
// negative) is clamped to [0, max_keys] and flagged, and the next di_cuda_sync returns
// DI_ERR_INVALID once (then the flag is clear). Checked on both kernels: the output equals the
// call with the clamped counts bit for bit (the same keys in the same order), every row written.
static void bad_keys_case(int32_t dh, int32_t n_rot, int32_t H, int32_t max_keys) {
    enum { T = 4 };
    const int64_t n_pool = 300;
    float *keys;
    uint8_t *pool = kv_rows(n_pool, dh, n_rot, &keys);
    int32_t n_bad[T] = {max_keys, max_keys + 1000, -5, INT32_MAX},
            n_clamped[T] = {max_keys, max_keys, 0, max_keys};
    int32_t *idx = malloc(sizeof(int32_t) * (size_t)T * (size_t)max_keys);
    for (int64_t i = 0; i < (int64_t)T * max_keys; i++) idx[i] = (int32_t)(rnd() % n_pool);
    const int64_t n_o = (int64_t)T * H * dh;
    float *q = malloc(sizeof(float) * (size_t)n_o), *sink = malloc(sizeof(float) * (size_t)H);
    float *want = malloc(sizeof(float) * (size_t)n_o), *got = malloc(sizeof(float) * (size_t)n_o);
    fill_rand(q, n_o, 0.1f);
    fill_rand(sink, H, 1.0f);
    float *qd = dev_from(q, sizeof(float) * (size_t)n_o),
          *sd = dev_from(sink, sizeof(float) * (size_t)H);
    int32_t *idxd = dev_from(idx, sizeof(int32_t) * (size_t)T * (size_t)max_keys);
    int32_t *nbd = dev_from(n_bad, sizeof n_bad), *ncd = dev_from(n_clamped, sizeof n_clamped);
    float *od = dev_alloc(sizeof(float) * (size_t)n_o);
    const float scale = 1.0f / sqrtf((float)dh);
    for (int kernel = 0; kernel < 1 + TC_KERNELS; kernel++) { // fp32, then the tensor-core ones
        if (kernel > 0 && !tc_has(kernel - 1, dh, n_rot)) continue;
        bool ran = true;
        for (int pass = 0; pass < 2; pass++) { // the clamped counts, then the bad ones
            const int32_t *nk = pass ? nbd : ncd;
            dev_poison(od, sizeof(float) * (size_t)n_o);
            di_status st = kernel == 0 ? di_cuda_attn(g_cu, qd, pool, idxd, max_keys, nk, max_keys,
                                                      sd, T, H, dh, n_rot, scale, od)
                                       : tc_attn(kernel - 1, qd, pool, idxd, max_keys, nk, max_keys,
                                                 sd, T, H, dh, n_rot, scale, 3, od);
            if (kernel > 0 && !(ran = tc_ran_k(kernel - 1, st, "bad n_keys"))) break;
            CK(st);
            CHECK_EQ(di_cuda_sync(g_cu), pass ? DI_ERR_INVALID : DI_OK);
            CHECK_EQ(di_cuda_sync(g_cu), DI_OK); // reported once
            dev_to(pass ? got : want, od, sizeof(float) * (size_t)n_o);
        }
        if (!ran) continue;
        int64_t nan = 0;
        for (int64_t i = 0; i < n_o; i++) nan += isnan(want[i]);
        fprintf(stderr, "  bad n_keys, %s kernel, dh=%d max_keys=%d: %s\n",
                kernel ? tc_name[kernel - 1] : "fp32", dh, max_keys,
                memcmp(got, want, sizeof(float) * (size_t)n_o) ? "DIFFERENT" : "clamped");
        CHECK(nan == 0);
        CHECK(memcmp(got, want, sizeof(float) * (size_t)n_o) == 0);
    }
    dev_free(qd), dev_free(sd), dev_free(idxd), dev_free(nbd), dev_free(ncd), dev_free(od),
        dev_free(pool);
    free(keys), free(idx), free(q), free(sink), free(want), free(got);
}

static void test_attn_bad_keys(void) {
    bad_keys_case(512, 64, 64, 200);
    bad_keys_case(128, 64, 4, 100);
}

// ---- compressor pooling ----

static void ref_pool(const float *bc, const float *bz, const float *oc, const float *oz, bool ovl,
                     int32_t m, int32_t c, int32_t d, float *e) {
    const int32_t width = c * d;
    for (int32_t ch = 0; ch < d; ch++) {
        float mx = -INFINITY;
        if (c == 2) {
            if (ovl)
                for (int32_t j = 0; j < m; j++) mx = fmaxf(mx, oz[j * d + ch]);
            for (int32_t j = 0; j < m; j++) mx = fmaxf(mx, bz[j * width + d + ch]);
        } else {
            for (int32_t j = 0; j < m; j++) mx = fmaxf(mx, bz[j * width + ch]);
        }
        float den = 0, num = 0;
        if (c == 2) {
            if (ovl)
                for (int32_t j = 0; j < m; j++) {
                    float p = expf(oz[j * d + ch] - mx);
                    den += p;
                    num += p * oc[j * d + ch];
                }
            for (int32_t j = 0; j < m; j++) {
                float p = expf(bz[j * width + d + ch] - mx);
                den += p;
                num += p * bc[j * width + d + ch];
            }
        } else {
            for (int32_t j = 0; j < m; j++) {
                float p = expf(bz[j * width + ch] - mx);
                den += p;
                num += p * bc[j * width + ch];
            }
        }
        e[ch] = num / den;
    }
}

static void pool_case(int32_t n_win, int32_t m, int32_t c, int32_t d) {
    const int64_t nb = (int64_t)n_win * m * c * d, no = (int64_t)n_win * m * d;
    float *bc = malloc(sizeof(float) * (size_t)nb), *bz = malloc(sizeof(float) * (size_t)nb);
    float *oc = malloc(sizeof(float) * (size_t)no), *oz = malloc(sizeof(float) * (size_t)no);
    uint8_t *has = malloc((size_t)n_win);
    fill_rand(bc, nb, 2.0f), fill_rand(bz, nb, 6.0f), fill_rand(oc, no, 2.0f),
        fill_rand(oz, no, 6.0f);
    for (int32_t w = 0; w < n_win; w++) has[w] = w % 3 != 0;
    float *ref = malloc(sizeof(float) * (size_t)(n_win * d)),
          *out = malloc(sizeof(float) * (size_t)(n_win * d));
    double *tol = malloc(sizeof(double) * (size_t)(n_win * d));
    for (int32_t w = 0; w < n_win; w++)
        ref_pool(bc + (int64_t)w * m * c * d, bz + (int64_t)w * m * c * d, oc + (int64_t)w * m * d,
                 oz + (int64_t)w * m * d, has[w], m, c, d, ref + (int64_t)w * d);
    for (int64_t i = 0; i < (int64_t)n_win * d; i++)
        tol[i] = 2.0 * TOL_POOL_REL * 8 + 1e-7; // |e| <= 2
    float *bcd = dev_from(bc, sizeof(float) * (size_t)nb),
          *bzd = dev_from(bz, sizeof(float) * (size_t)nb);
    float *ocd = dev_from(oc, sizeof(float) * (size_t)no),
          *ozd = dev_from(oz, sizeof(float) * (size_t)no);
    uint8_t *hd = dev_from(has, (size_t)n_win);
    float *ed = dev_alloc(sizeof(float) * (size_t)(n_win * d));
    dev_poison(ed, sizeof(float) * (size_t)(n_win * d));
    CK(di_cuda_compress_pool(g_cu, bcd, bzd, ocd, ozd, hd, n_win, m, c, d, ed));
    dev_to(out, ed, sizeof(float) * (size_t)(n_win * d));
    char what[96];
    snprintf(what, sizeof what, "compress_pool windows=%d m=%d c=%d d=%d", n_win, m, c, d);
    CHECK(check_bounds(what, out, ref, tol, (int64_t)n_win * d) == 0);
    dev_free(bcd), dev_free(bzd), dev_free(ocd), dev_free(ozd), dev_free(hd), dev_free(ed);
    free(bc), free(bz), free(oc), free(oz), free(has), free(ref), free(out), free(tol);
}

static void test_compress_pool(void) {
    pool_case(1, 128, 1, 512); // HCA, V4
    pool_case(3, 8, 1, 128);   // HCA, tiny fixture
    pool_case(7, 4, 2, 512);   // CSA main
    pool_case(5, 4, 2, 128);   // CSA indexer
}

int main(void) {
    cuda_test_init();
    RUN(test_kv_row_size);
    RUN(test_attn);
    RUN(test_attn_bf16_keys);
    RUN(test_attn_bf16_refuses);
    RUN(test_attn_bad_keys);
    RUN(test_compress_pool);
    return cuda_test_finish();
}
