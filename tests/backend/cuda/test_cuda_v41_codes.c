// V4.1's stored codes on the CUDA backend (backend.h pack_rows, attn_codes, index_scores_q4;
// model/dsv41_dev.h "State layout") against the CPU backend's entries, the oracle twin:
//   - pack_rows: Q8 / Q4 / Q4e rows (blocks 32, 16, 32) byte for byte equal to the CPU's (the
//     packers of tensor/quant_ref.c), over rows of very different magnitudes, zeros and -0,
//     subnormal e4m3 steps, saturating values, a block holding inf and one holding NaN (zero codes
//     and the NaN scale byte), gathered through src_rows, scattered through dst_rows with a
//     skipped (-1) row whose bytes stay as they were;
//   - attn_codes: every list kind of test_cuda_ops' attention (0 keys, 1, masked keys, all
//     masked, repeats) plus n_win = n_keys and n_win = 0, over Q8 window rows then Q4e entries,
//     with and without round_p, 1 to 72 heads (64-head blocks, the last partial), dh 512
//     (V4.1-Flash), 64 (the tiny model: byte copies), 128 / 256 (4- / 8-byte copies) and 1024
//     (16-head blocks), 8k and 64k keys at batch 1, batch 64: within the FP32 bound of a double
//     reference on the decoded rows, and so is the CPU backend's (the reference's own check);
//     CUDA's round_p (p kept unrounded: attn.cu) within half a BF16 ulp, and the exact unrounded
//     output checked against that bound too; every case through the automatic split count and
//     forced (1 split, 7, one tile each, the 32-head block with 3); n_keys past max_keys clamped,
//     flagged and reported once at the sync, split or not, on both kernels; refused shapes. The
//     BF16 tensor-core kernel (di_cuda_attn_codes_bf16; round_p cases, whose q is BF16 as the
//     official recipe's) with 1, automatic and 3 splits at dh 512 / 256 / 128 within
//     test_cuda_attn's tensor-core bound (plus the reference's own BF16 p), and the backend entry
//     taking it there; its wgmma instance (di_cuda_attn_codes_wg, dh 512, cc 9.0 with sm_90a
//     code; refused elsewhere) on the same cases within the same bound, bad n_keys too; the
//     dispatch as test_cuda_ops' kv_rows: the checked call and the next are the kernel's bits,
//     without round_p the exact kernel, a forced mismatch leaves the exact result and the exact
//     kernel from then on; with the wgmma kernel tried first, its checked call and the next are its
//     bits, a forced mismatch the exact result and then the mma.sync kernel's. `--cpu` without a
//     device runs the attn_codes cases on the CPU op alone (then skips);
//   - index_scores_q4: contiguous (with key bases) and paged (shuffled pages, one missing: -inf)
//     keys, HI 4 and 64 (V4.1-Flash's) and 72 (two head chunks), DI 128 and 64: within the FP32
//     bound of the indexer's reference on the decoded keys, paged scores bit-identical to the
//     contiguous ones; the BF16 scores of the official recipe BF16 and within one ulp; for HI <=
//     64 (the FP32 entry's lane kernel) bit-identical to index_scores on the decoded FP32 keys,
//     FP32 and BF16 scores: V4's device forward stores its official-recipe keys as these codes
//     (model/dsv4_dev.h), so the scores must not depend on the format; HI 4 at DI 128 is the tiny
//     synthetic V4's indexer.
// Exits 77 without a device.
#include "backend/cuda/cuda_test.h" // CK, rnd, fill_rand, gamma_k, check_bounds

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "backend/backend.h"
#include "backend/cuda/attn.cuh"        // di_cuda_attn_codes_ex
#include "backend/cuda/wgmma_probe.cuh" // di_cuda_wgmma_available
#include "tensor/quant_ref.h"           // di_quant_*_unpack, di_round_bf16

// Attention: scores within gamma(dh) * scale * sum|q k| (E); p within ~2E relative; o within
// sum_j p_j |k_jd| times that plus the value sums' FP32 rounding (1e-5 relative for <~ 1000 keys),
// as test_cuda_ops' TOL_ATTN_SUM_REL; round_p adds one BF16 ulp of p (2^-7 relative).
#define TOL_ATTN_SUM_REL 1e-5
// The BF16 tensor-core kernel (di_cuda_attn_codes_bf16), as test_cuda_attn's bound of
// di_cuda_attn_bf16: q BF16 (the official recipe's; the reference gets the same q), scores in the
// MMA's FP32 (4x the RN gamma: Hopper's accumulator may truncate), each unnormalised p rounded to
// BF16 in the numerator and the denominator (2u / (1 - u) relative, u = 2^-8, plus FP32
// rescaling and sums), and the reference's own BF16 p (round_p) within half an ulp of exact.
#define TOL_TC_ACC_GAMMA 4.0
#define TOL_TC_P_REL (2.01 * 0.00390625 + 1e-4)
#define TOL_TC_REF_P_REL 0x1.02p-8
// Indexer scores: gamma(DI) per head dot, then a sum of HI weighted terms (test_cuda_indexer.c).
#define TOL_SCORE_FACTOR 2.0

static di_backend *g_b, *g_cpu;

static void *bk_from(di_backend *b, const void *host, size_t bytes) {
    void *p = NULL;
    CK(b->vt->alloc(b, bytes ? bytes : 1, &p));
    if (bytes) CK(b->vt->upload(b, p, host, bytes));
    return p;
}

static void bk_to(di_backend *b, void *host, const void *p, size_t bytes) {
    CK(b->vt->download(b, host, p, bytes));
}

// ---- pack_rows ----

static void pack_case(int32_t bits, int32_t n_dims, int32_t block, int64_t n) {
    const int64_t stride = n_dims + 5, rb = di_backend_code_row_bytes(bits, n_dims, block);
    const int64_t n_src = n + 3, n_dst = n + 2;
    float *x = malloc(sizeof(float) * (size_t)(n_src * stride));
    fill_rand(x, n_src * stride, 2.0f);
    for (int64_t r = 0; r < n_src; r++) {
        float *v = x + r * stride;
        for (int32_t j = 0; j < n_dims; j++)
            v[j] *= ldexpf(1.0f, (int)((r * 7 + j / block) % 41) - 20);
        if (r == 0) v[0] = INFINITY;                             // a non-finite block: NaN codes
        if (r == 1) v[block] = NAN;                              // another one, later in its row
        if (r == 2) memset(v, 0, sizeof(float) * (size_t)block); // an all-zero block
        if (r == 2) v[1] = -0.0f;
        if (r == 3) v[2] = 1e30f; // saturates Q8 / sets a huge scale
        if (r == 4)
            for (int32_t j = 0; j < block; j++)
                v[j] = ldexpf((float)(j % 9), -12); // e4m3 subnormals
    }
    int32_t *dst = malloc(sizeof(int32_t) * (size_t)n), *src = malloc(sizeof(int32_t) * (size_t)n);
    for (int64_t i = 0; i < n; i++) {
        dst[i] = (int32_t)((i * 5 + 1) % n_dst); // scattered
        src[i] = (int32_t)((i * 3 + 2) % n_src); // gathered
    }
    dst[n / 2] = -1; // padding: skipped
    // Both backends: the same poisoned destination, the same call.
    uint8_t *want = malloc((size_t)(n_dst * rb)), *got = malloc((size_t)(n_dst * rb));
    memset(want, 0xA5, (size_t)(n_dst * rb));
    memset(got, 0x5A, (size_t)(n_dst * rb));
    di_backend *bs[2] = {g_cpu, g_b};
    uint8_t *outs[2] = {want, got};
    for (int k = 0; k < 2; k++) {
        di_backend *b = bs[k];
        float *xd = bk_from(b, x, sizeof(float) * (size_t)(n_src * stride));
        int32_t *dd = bk_from(b, dst, sizeof(int32_t) * (size_t)n),
                *sd = bk_from(b, src, sizeof(int32_t) * (size_t)n);
        uint8_t *od = bk_from(b, outs[k], (size_t)(n_dst * rb));
        CK(b->vt->pack_rows(b, xd, n, stride, n_dims, block, bits, od, dd, sd));
        bk_to(b, outs[k], od, (size_t)(n_dst * rb));
        b->vt->free(b, xd), b->vt->free(b, dd), b->vt->free(b, sd), b->vt->free(b, od);
    }
    int64_t bad = 0, untouched_ok = 1;
    for (int64_t i = 0; i < n; i++) {
        if (dst[i] < 0) continue;
        bad += memcmp(want + dst[i] * rb, got + dst[i] * rb, (size_t)rb) != 0;
    }
    // Rows no entry wrote keep their (different) poison on each side.
    for (int64_t r = 0; r < n_dst; r++) {
        bool written = false;
        for (int64_t i = 0; i < n; i++) written |= dst[i] == r;
        if (!written)
            for (int64_t j = 0; j < rb; j++) untouched_ok &= got[r * rb + j] == 0x5A;
    }
    fprintf(stderr, "  pack_rows bits %d, %d dims, block %d, %lld rows: %lld differ\n", bits,
            n_dims, block, (long long)n, (long long)bad);
    CHECK_EQ(bad, 0);
    CHECK(untouched_ok);
    free(x), free(dst), free(src), free(want), free(got);
}

static void test_pack_rows(void) {
    pack_case(8, 512, DI_BACKEND_WIN_BLOCK, 37);              // window rows (V4.1-Flash)
    pack_case(DI_BACKEND_Q4E, 512, DI_BACKEND_ENT_BLOCK, 37); // entries
    pack_case(4, 128, DI_BACKEND_KEY_BLOCK, 37);              // index keys
    pack_case(8, 64, DI_BACKEND_WIN_BLOCK, 9);                // the tiny model's widths
    pack_case(DI_BACKEND_Q4E, 64, DI_BACKEND_ENT_BLOCK, 9);
    pack_case(4, 64, DI_BACKEND_KEY_BLOCK, 9);
    float *d = NULL;
    CK(g_b->vt->alloc(g_b, 4096, (void **)&d));
    CHECK_EQ(g_b->vt->pack_rows(g_b, d, 1, 64, 64, 3, 8, (uint8_t *)d, NULL, NULL), DI_ERR_INVALID);
    CHECK_EQ(g_b->vt->pack_rows(g_b, d, 1, 64, 48, 32, 8, (uint8_t *)d, NULL, NULL),
             DI_ERR_INVALID);
    CHECK_EQ(g_b->vt->pack_rows(g_b, d, 1, 64, 64, 32, 5, (uint8_t *)d, NULL, NULL),
             DI_ERR_INVALID);
    g_b->vt->free(g_b, d);
}

// ---- attn_codes ----

// Rows of dh values as codes (CPU packers) and their decoded values.
static void make_rows(int32_t bits, int32_t dh, int32_t block, int64_t n, uint8_t *codes,
                      float *dec) {
    float *v = malloc(sizeof(float) * (size_t)dh);
    const int64_t rb = di_backend_code_row_bytes(bits, dh, block);
    for (int64_t r = 0; r < n; r++) {
        fill_rand(v, dh, 1.5f);
        for (int32_t j = 0; j < dh; j++) v[j] *= ldexpf(1.0f, (int)((r + j / block) % 5) - 2);
        uint8_t *row = codes + r * rb;
        if (bits == 8)
            di_quant_q8_pack(v, dh, block, row), di_quant_q8_unpack(row, dh, block, dec + r * dh);
        else if (bits == 4)
            di_quant_q4_pack(v, dh, block, row), di_quant_q4_unpack(row, dh, block, dec + r * dh);
        else
            di_quant_q4e_pack(v, dh, block, row), di_quant_q4e_unpack(row, dh, block, dec + r * dh);
    }
    free(v);
}

// The CUDA calls of every attn_case: the backend entry (automatic splits and heads per block),
// then di_cuda_attn_codes_ex with both forced: one split (no combine), 7 (uneven: a row with fewer
// keys than max_keys leaves later splits empty, weighing 0), more splits than tiles (clamped: one
// tile each), and the 32-head block (the A100's at dh 512) with 3 splits.
static const struct {
    int32_t n_split, hpw;
    const char *what;
} k_variants[] = {{-1, 0, "auto"},
                  {1, 0, "1 split"},
                  {7, 0, "7 splits"},
                  {1 << 20, 0, "a tile each"},
                  {3, 4, "32 heads, 3 splits"}};

// Key kinds by (t + kind0) % 7: 0 keys, 1 key (a window row), all max_keys (window rows first,
// a random count), every third masked, all masked, window rows only (n_win = n_keys), entries
// only (n_win = 0).
enum { KIND_NONE, KIND_ONE, KIND_ALL, KIND_MASKED, KIND_ALL_MASKED, KIND_WIN_ONLY, KIND_ENT_ONLY };

static void attn_case(int32_t dh, int32_t H, int32_t T, int32_t n_w, int32_t n_e, int32_t max_keys,
                      bool round_p, int kind0) {
    const int64_t ks = max_keys + 3, n_o = (int64_t)T * H * dh;
    const int64_t wb = di_backend_code_row_bytes(8, dh, DI_BACKEND_WIN_BLOCK);
    const int64_t eb = di_backend_code_row_bytes(DI_BACKEND_Q4E, dh, DI_BACKEND_ENT_BLOCK);
    uint8_t *win = malloc((size_t)(n_w * wb)), *ent = malloc((size_t)(n_e * eb));
    float *wdec = malloc(sizeof(float) * (size_t)(n_w * dh)),
          *edec = malloc(sizeof(float) * (size_t)(n_e * dh));
    make_rows(8, dh, DI_BACKEND_WIN_BLOCK, n_w, win, wdec);
    make_rows(DI_BACKEND_Q4E, dh, DI_BACKEND_ENT_BLOCK, n_e, ent, edec);
    float *q = malloc(sizeof(float) * (size_t)n_o), *sink = malloc(sizeof(float) * (size_t)H);
    fill_rand(q, n_o, 2.0f);
    if (round_p) // the official recipe's q is BF16 (model/dsv41_attn.c rounds it)
        for (int64_t i = 0; i < n_o; i++) q[i] = di_round_bf16(q[i]);
    fill_rand(sink, H, 2.0f);
    int32_t *nk = malloc(sizeof(int32_t) * (size_t)T), *nw = malloc(sizeof(int32_t) * (size_t)T);
    int32_t *idx = malloc(sizeof(int32_t) * (size_t)(T * ks));
    for (int32_t t = 0; t < T; t++) {
        const int kind = (t + kind0) % 7;
        int32_t k = kind == KIND_NONE  ? 0
                    : kind == KIND_ONE ? 1
                    : kind == KIND_ALL || kind >= KIND_WIN_ONLY
                        ? max_keys
                        : 1 + (int32_t)(rnd() % (uint64_t)max_keys);
        nk[t] = k;
        nw[t] = kind == KIND_ONE ? 1 : (int32_t)(rnd() % (uint64_t)(k + 1)); // window keys first
        if (kind == KIND_WIN_ONLY) nw[t] = k;
        if (kind == KIND_ENT_ONLY) nw[t] = 0;
        for (int64_t j = 0; j < ks; j++) {
            int32_t v =
                j < nw[t] ? (int32_t)(rnd() % (uint64_t)n_w) : (int32_t)(rnd() % (uint64_t)n_e);
            if ((kind == KIND_MASKED && j % 3 == 1) || kind == KIND_ALL_MASKED) v = -1;
            idx[t * ks + j] = j < k ? v : -7;
        }
    }
    const float scale = 1.0f / sqrtf((float)dh);
    float *ref = malloc(sizeof(float) * (size_t)n_o);
    double *tol = malloc(sizeof(double) * (size_t)n_o),
           *tol_tc = malloc(sizeof(double) * (size_t)n_o), // the tensor-core kernel's (round_p)
               *mags = malloc(sizeof(double) * (size_t)n_o),
           *sc = malloc(sizeof(double) * (size_t)(max_keys + 1)), *pr = NULL;
    float **kr = malloc(sizeof(float *) * (size_t)(max_keys + 1));
    double *unr = calloc((size_t)n_o, sizeof(double)); // round_p: o with the unrounded p, exact
    // round_p: o with the tensor-core kernel's weights (exact otherwise): p = BF16(exp(s - m)), m
    // the keys' max, normalised by their sum and the sink's mass (attn.cu's epilogue).
    double *tcw = calloc((size_t)n_o, sizeof(double)),
           *wt = malloc(sizeof(double) * (size_t)(max_keys + 1));
    pr = malloc(sizeof(double) * (size_t)(max_keys + 1));
    for (int32_t t = 0; t < T; t++)
        for (int32_t h = 0; h < H; h++) {
            const float *qv = q + ((int64_t)t * H + h) * dh;
            const int32_t *ix = idx + t * ks;
            double mx = sink[h], maxabs = 0;
            int32_t n = 0; // present keys: their rows in kr, scores in sc
            for (int32_t j = 0; j < nk[t]; j++) {
                if (ix[j] < 0) continue;
                float *k = (j < nw[t] ? wdec : edec) + (int64_t)ix[j] * dh;
                double s = 0, a = 0;
                for (int32_t d = 0; d < dh; d++)
                    s += (double)qv[d] * k[d], a += fabs((double)qv[d] * k[d]);
                kr[n] = k;
                sc[n] = s * scale;
                if (sc[n] > mx) mx = sc[n];
                if (a > maxabs) maxabs = a;
                n++;
            }
            double mk = -INFINITY, l = 0;
            for (int32_t j = 0; j < n; j++) mk = sc[j] > mk ? sc[j] : mk;
            for (int32_t j = 0; j < n; j++) l += (wt[j] = di_round_bf16((float)exp(sc[j] - mk)));
            const double Mx = mk > sink[h] ? mk : sink[h], f = n ? exp(mk - Mx) : 0;
            for (int32_t j = 0; j < n; j++) wt[j] *= f / (l * f + exp(sink[h] - Mx));
            double den = exp(sink[h] - mx);
            for (int32_t j = 0; j < n; j++) den += (sc[j] = exp(sc[j] - mx));
            for (int32_t j = 0; j < n; j++)
                pr[j] = round_p ? di_round_bf16((float)(sc[j] / den)) : sc[j] / den;
            const double E = gamma_k(dh) * scale * maxabs;
            const int64_t o0 = ((int64_t)t * H + h) * dh;
            for (int32_t d = 0; d < dh; d++) ref[o0 + d] = 0, mags[o0 + d] = 0;
            double *o = calloc((size_t)dh, sizeof(double));
            for (int32_t j = 0; j < n; j++)
                for (int32_t d = 0; d < dh; d++) {
                    o[d] += pr[j] * kr[j][d], mags[o0 + d] += pr[j] * fabs((double)kr[j][d]);
                    if (round_p) unr[o0 + d] += sc[j] / den * kr[j][d]; // CUDA's: p unrounded
                    if (round_p) tcw[o0 + d] += wt[j] * kr[j][d];
                }
            for (int32_t d = 0; d < dh; d++) {
                ref[o0 + d] = (float)o[d];
                tol[o0 + d] = mags[o0 + d] * (4 * E + TOL_ATTN_SUM_REL) + 1e-30;
                tol_tc[o0 + d] =
                    mags[o0 + d] * (4 * TOL_TC_ACC_GAMMA * E + TOL_TC_P_REL + TOL_TC_REF_P_REL) +
                    1e-30;
            }
            free(o);
        }
    // round_p: the CPU rounds its FP32 p, which may sit on the other side of a rounding tie from
    // the reference's (one BF16 ulp: 2^-7 relative at most); CUDA keeps p unrounded, within half
    // an ulp (2^-8) of the reference's (attn.cu): allowed a hair more, no more.
    double *tol_b = malloc(sizeof(double) * (size_t)n_o);
    if (round_p) { // the argument itself: exact arithmetic on unrounded p meets CUDA's bound
        float *uf = malloc(sizeof(float) * (size_t)n_o);
        for (int64_t i = 0; i < n_o; i++)
            uf[i] = (float)unr[i], tol_b[i] = tol[i] + mags[i] * 0x1.02p-8;
        CHECK(check_bounds("  unrounded p (exact)", uf, ref, tol_b, n_o) == 0);
        for (int64_t i = 0; i < n_o; i++) uf[i] = (float)tcw[i]; // and the tensor cores' bound
        CHECK(check_bounds("  BF16 unnormalised p (exact)", uf, ref, tol_tc, n_o) == 0);
        free(uf);
    }
    di_backend *bs[2] = {g_cpu, g_b};
    const int nb = g_b ? 2 : 1; // --cpu without a device: the CPU op only
    for (int k = 0; k < nb; k++) {
        di_backend *b = bs[k];
        const double rp = round_p ? (k == 0 ? 0x1p-7 : 0x1.02p-8) : 0.0;
        for (int64_t i = 0; i < n_o; i++) tol_b[i] = tol[i] + mags[i] * rp;
        uint8_t *wd = bk_from(b, win, (size_t)(n_w * wb)),
                *ed = bk_from(b, ent, (size_t)(n_e * eb));
        float *qd = bk_from(b, q, sizeof(float) * (size_t)n_o),
              *sd = bk_from(b, sink, sizeof(float) * (size_t)H);
        int32_t *nkd = bk_from(b, nk, sizeof(int32_t) * (size_t)T),
                *nwd = bk_from(b, nw, sizeof(int32_t) * (size_t)T),
                *id = bk_from(b, idx, sizeof(int32_t) * (size_t)(T * ks));
        float *out = malloc(sizeof(float) * (size_t)n_o);
        // The tensor-core kernel (round_p: the official recipe it serves) with 1 split, automatic
        // and 3 (partials + combine); where it runs (dh 512 / 256 / 128 with the shared memory),
        // the backend entry must take it (the dispatch: checked on the first such call).
        // The same for the wgmma instance (dh 512; a cc 9.0 device with sm_90a code must run it).
        bool tc = false;
        for (int wg = 0; wg < 2 && k == 1 && round_p; wg++) {
            static const int32_t tc_splits[] = {1, 0, 3};
            for (int v = 0; v < 3; v++) {
                for (int64_t i = 0; i < n_o; i++) out[i] = NAN;
                float *od = bk_from(b, out, sizeof(float) * (size_t)n_o);
                const di_status st =
                    wg ? di_cuda_attn_codes_wg(g_cu, qd, wd, ed, id, ks, nwd, nkd, max_keys, sd, T,
                                               H, dh, scale, tc_splits[v], od)
                       : di_cuda_attn_codes_bf16(g_cu, qd, wd, ed, id, ks, nwd, nkd, max_keys, sd,
                                                 T, H, dh, scale, tc_splits[v], od);
                const bool shape = wg ? dh == 512 : dh == 512 || dh == 256 || dh == 128;
                if (!shape || st == DI_ERR_UNSUPPORTED) { // dh 64 / 1024; the A100 at dh 512
                    CHECK_EQ(st, shape ? DI_ERR_UNSUPPORTED : DI_ERR_INVALID);
                    if (wg && shape) CHECK(!di_cuda_wgmma_available(g_cu));
                    b->vt->free(b, od);
                    break;
                }
                CK(st);
                tc = true;
                bk_to(b, out, od, sizeof(float) * (size_t)n_o);
                b->vt->free(b, od);
                char what[128];
                snprintf(what, sizeof what, "attn_codes_%s %d splits dh=%d H=%d T=%d keys=%d",
                         wg ? "wg" : "bf16", tc_splits[v], dh, H, T, max_keys);
                CHECK(check_bounds(what, out, ref, tol_tc, n_o) == 0);
            }
        }
        const int n_var = k == 0 ? 1 : (int)(sizeof k_variants / sizeof k_variants[0]);
        for (int v = 0; v < n_var; v++) {
            if (k == 1 && k_variants[v].hpw == 4 && dh > 512) continue; // not built above 512
            for (int64_t i = 0; i < n_o; i++) out[i] = NAN;             // unwritten outputs fail
            float *od = bk_from(b, out, sizeof(float) * (size_t)n_o);
            bool took_tc = false;
            if (k == 0 || k_variants[v].n_split < 0) {
                const int64_t n_tc =
                    k ? g_cu->n_attn_codes_tc_calls + g_cu->n_attn_codes_wg_calls : 0;
                CK(b->vt->attn_codes(b, qd, wd, ed, id, ks, nwd, nkd, max_keys, sd, T, H, dh, scale,
                                     round_p, od));
                took_tc = k && g_cu->n_attn_codes_tc_calls + g_cu->n_attn_codes_wg_calls > n_tc;
                if (k) CHECK_EQ(took_tc, tc); // round_p and a tensor-core shape: always taken
            } else
                CK(di_cuda_attn_codes_ex(g_cu, qd, wd, ed, id, ks, nwd, nkd, max_keys, sd, T, H, dh,
                                         scale, k_variants[v].n_split, k_variants[v].hpw, od));
            bk_to(b, out, od, sizeof(float) * (size_t)n_o);
            b->vt->free(b, od);
            char what[128];
            snprintf(what, sizeof what, "attn_codes %s%s%s dh=%d H=%d T=%d keys=%d%s%s",
                     b->vt->name, k ? ", " : "", k ? k_variants[v].what : "", dh, H, T, max_keys,
                     round_p ? " round_p" : "", took_tc ? " (tensor cores)" : "");
            CHECK(check_bounds(what, out, ref, took_tc ? tol_tc : tol_b, n_o) == 0);
        }
        b->vt->free(b, wd), b->vt->free(b, ed), b->vt->free(b, qd), b->vt->free(b, sd);
        b->vt->free(b, nkd), b->vt->free(b, nwd), b->vt->free(b, id);
        free(out);
    }
    free(win), free(ent), free(wdec), free(edec), free(q), free(sink), free(nk), free(nw),
        free(idx), free(ref), free(tol), free(tol_tc), free(tol_b), free(mags), free(sc), free(pr),
        free(kr), free(unr), free(tcw), free(wt);
}

// n_keys (device data) past max_keys or negative: clamped, flagged, DI_ERR_INVALID at the next sync
// (once); the output equals the call with the clamped counts bit for bit (split or not), on the
// FP32 kernel and (tc 1, where it runs) the tensor-core one, (tc 2) its wgmma instance.
static void bad_keys_case(int32_t n_split, int tc) {
    enum { T = 4, H = 64, DH = 512, MK = 200, NE = 300 };
    const int64_t eb = di_backend_code_row_bytes(DI_BACKEND_Q4E, DH, DI_BACKEND_ENT_BLOCK);
    uint8_t *ent = malloc((size_t)(NE * eb));
    float *edec = malloc(sizeof(float) * (size_t)NE * DH);
    make_rows(DI_BACKEND_Q4E, DH, DI_BACKEND_ENT_BLOCK, NE, ent, edec);
    int32_t n_bad[T] = {MK, MK + 1000, -5, INT32_MAX}, n_clamped[T] = {MK, MK, 0, MK};
    int32_t n_win[T] = {0, 0, 0, 0}, *idx = malloc(sizeof(int32_t) * T * MK);
    for (int32_t i = 0; i < T * MK; i++) idx[i] = (int32_t)(rnd() % NE);
    const int64_t n_o = (int64_t)T * H * DH;
    float *q = malloc(sizeof(float) * (size_t)n_o), *sink = malloc(sizeof(float) * H);
    float *want = malloc(sizeof(float) * (size_t)n_o), *got = malloc(sizeof(float) * (size_t)n_o);
    fill_rand(q, n_o, 0.1f);
    fill_rand(sink, H, 1.0f);
    float *qd = bk_from(g_b, q, sizeof(float) * (size_t)n_o), *sd = bk_from(g_b, sink, 4 * H);
    uint8_t *ed = bk_from(g_b, ent, (size_t)(NE * eb));
    int32_t *idxd = bk_from(g_b, idx, sizeof(int32_t) * T * MK), *nwd = bk_from(g_b, n_win, 4 * T);
    int32_t *nbd = bk_from(g_b, n_bad, sizeof n_bad), *ncd = bk_from(g_b, n_clamped, 4 * T);
    float *od = bk_from(g_b, want, sizeof(float) * (size_t)n_o);
    bool ran = true;
    for (int pass = 0; pass < 2 && ran; pass++) { // the clamped counts, then the bad ones
        CK(g_b->vt->memset(g_b, od, 0xFF, sizeof(float) * (size_t)n_o));
        const di_status st =
            tc == 2 ? di_cuda_attn_codes_wg(g_cu, qd, ed, ed, idxd, MK, nwd, pass ? nbd : ncd, MK,
                                            sd, T, H, DH, 0.05f, n_split, od)
            : tc    ? di_cuda_attn_codes_bf16(g_cu, qd, ed, ed, idxd, MK, nwd, pass ? nbd : ncd, MK,
                                              sd, T, H, DH, 0.05f, n_split, od)
                 : di_cuda_attn_codes_ex(g_cu, qd, ed, ed, idxd, MK, nwd, pass ? nbd : ncd, MK, sd,
                                         T, H, DH, 0.05f, n_split, 0, od);
        ran = !(tc && st == DI_ERR_UNSUPPORTED); // the A100's shared memory: nothing to check
        if (!ran) {
            if (tc == 2) CHECK(!di_cuda_wgmma_available(g_cu)); // off cc 9.0 / sm_90a only
            break;
        }
        CK(st);
        CHECK_EQ(g_b->vt->sync(g_b), pass ? DI_ERR_INVALID : DI_OK);
        CHECK_EQ(g_b->vt->sync(g_b), DI_OK); // reported once
        bk_to(g_b, pass ? got : want, od, sizeof(float) * (size_t)n_o);
    }
    if (ran) {
        int64_t nan = 0;
        for (int64_t i = 0; i < n_o; i++) nan += isnan(want[i]);
        const bool same = memcmp(got, want, sizeof(float) * (size_t)n_o) == 0;
        fprintf(stderr, "  attn_codes%s bad n_keys, %d splits: %s\n",
                tc == 2 ? "_wg"
                : tc    ? "_bf16"
                        : "",
                n_split, same ? "clamped" : "DIFFERENT");
        CHECK_EQ(nan, 0);
        CHECK(same);
    }
    g_b->vt->free(g_b, qd), g_b->vt->free(g_b, sd), g_b->vt->free(g_b, ed);
    g_b->vt->free(g_b, idxd), g_b->vt->free(g_b, nwd), g_b->vt->free(g_b, nbd);
    g_b->vt->free(g_b, ncd), g_b->vt->free(g_b, od);
    free(ent), free(edec), free(idx), free(q), free(sink), free(want), free(got);
}

// The backend entry's dispatch (di_cuda_attn_codes_dispatch), as test_cuda_ops' kv_rows checks
// attn_kv's: in the official recipe, where the tensor-core kernel runs, the first call is checked
// against the exact kernel and keeps it (attn_codes_tc 1, counted), its result and the next
// call's di_cuda_attn_codes_bf16's bit for bit; a call of more than 2^24 outputs and a graph
// capture before the check hold the exact kernel (no check), a capture after it the tensor cores;
// without round_p the exact kernel, uncounted; a mismatch at the check (forced: a negative
// tolerance fails every comparison) turns the tensor cores off and returns the exact result, and
// later calls stay on the exact kernel. Where it does not run (the A100's shared memory): the exact
// kernel, unchecked.
static void dispatch_case(void) {
    enum { T = 3, H = 64, DH = 512, MK = 300, NW = 40, NE = 500 };
    const int64_t wb = di_backend_code_row_bytes(8, DH, DI_BACKEND_WIN_BLOCK),
                  eb = di_backend_code_row_bytes(DI_BACKEND_Q4E, DH, DI_BACKEND_ENT_BLOCK);
    uint8_t *win = malloc((size_t)(NW * wb)), *ent = malloc((size_t)(NE * eb));
    float *wdec = malloc(sizeof(float) * NW * DH), *edec = malloc(sizeof(float) * NE * DH);
    make_rows(8, DH, DI_BACKEND_WIN_BLOCK, NW, win, wdec);
    make_rows(DI_BACKEND_Q4E, DH, DI_BACKEND_ENT_BLOCK, NE, ent, edec);
    int32_t n_keys[T] = {MK, 77, 1}, n_win[T] = {32, 10, 1},
            *idx = malloc(sizeof(int32_t) * T * MK);
    for (int32_t t = 0; t < T; t++)
        for (int32_t j = 0; j < MK; j++)
            idx[t * MK + j] = j < n_win[t] ? (int32_t)(rnd() % NW) : (int32_t)(rnd() % NE);
    idx[5] = -1; // a masked key
    const int64_t n_o = (int64_t)T * H * DH;
    const size_t ob = sizeof(float) * (size_t)n_o;
    float *q = malloc(ob), *sink = malloc(sizeof(float) * H);
    fill_rand(q, n_o, 1.0f);
    for (int64_t i = 0; i < n_o; i++) q[i] = di_round_bf16(q[i]);
    fill_rand(sink, H, 1.0f);
    float *qd = bk_from(g_b, q, ob), *sd = bk_from(g_b, sink, sizeof(float) * H);
    uint8_t *wd = bk_from(g_b, win, (size_t)(NW * wb)), *ed = bk_from(g_b, ent, (size_t)(NE * eb));
    int32_t *idxd = bk_from(g_b, idx, sizeof(int32_t) * T * MK),
            *nwd = bk_from(g_b, n_win, sizeof n_win), *nkd = bk_from(g_b, n_keys, sizeof n_keys);
    float *exact = malloc(ob), *tcr = malloc(ob), *got = malloc(ob), *od = bk_from(g_b, q, ob);
    const float scale = 1.0f / sqrtf((float)DH);
    CK(di_cuda_attn_codes(g_cu, qd, wd, ed, idxd, MK, nwd, nkd, MK, sd, T, H, DH, scale, true, od));
    bk_to(g_b, exact, od, ob);
    const di_status st_tc = di_cuda_attn_codes_bf16(g_cu, qd, wd, ed, idxd, MK, nwd, nkd, MK, sd, T,
                                                    H, DH, scale, 0, od);
    CHECK(st_tc == DI_OK || st_tc == DI_ERR_UNSUPPORTED); // the latter: not the shared memory
    const bool tc = st_tc == DI_OK;
    if (tc) bk_to(g_b, tcr, od, ob);
    const int state = g_cu->attn_codes_tc, state_wg = g_cu->attn_codes_wg;
    const float tol = g_cu->attn_tc_check_tol;
    g_cu->attn_codes_tc = 0;
    g_cu->attn_codes_wg = -1; // the mma.sync kernel's dispatch first, the wgmma one's below
    // A call of more than 2^24 outputs (a long prefill) before the check: the exact kernel, the
    // check left to a later call (its scratch would stay in the pool).
    {
        enum { TB = 520 }; // 520 x 64 x 512 > 2^24
        const size_t obb = sizeof(float) * (size_t)TB * H * DH;
        float *qb = malloc(obb), *want = malloc(obb), *have = malloc(obb);
        int32_t *nkb = malloc(sizeof(int32_t) * TB), *nwb = malloc(sizeof(int32_t) * TB),
                *idxb = malloc(sizeof(int32_t) * TB * MK);
        fill_rand(qb, (int64_t)TB * H * DH, 1.0f);
        for (int32_t t = 0; t < TB; t++) {
            nkb[t] = n_keys[t % T], nwb[t] = n_win[t % T];
            memcpy(idxb + (size_t)t * MK, idx + (size_t)(t % T) * MK, sizeof(int32_t) * MK);
        }
        float *qbd = bk_from(g_b, qb, obb), *obd = bk_from(g_b, qb, obb);
        int32_t *nkbd = bk_from(g_b, nkb, sizeof(int32_t) * TB),
                *nwbd = bk_from(g_b, nwb, sizeof(int32_t) * TB),
                *idxbd = bk_from(g_b, idxb, sizeof(int32_t) * TB * MK);
        CK(di_cuda_attn_codes(g_cu, qbd, wd, ed, idxbd, MK, nwbd, nkbd, MK, sd, TB, H, DH, scale,
                              true, obd));
        bk_to(g_b, want, obd, obb);
        const int64_t n_tc = g_cu->n_attn_codes_tc_calls;
        CK(g_b->vt->memset(g_b, obd, 0xFF, obb));
        CK(g_b->vt->attn_codes(g_b, qbd, wd, ed, idxbd, MK, nwbd, nkbd, MK, sd, TB, H, DH, scale,
                               true, obd));
        bk_to(g_b, have, obd, obb);
        CHECK_EQ(g_cu->attn_codes_tc, 0);
        CHECK_EQ(g_cu->n_attn_codes_tc_calls, n_tc);
        CHECK(memcmp(have, want, obb) == 0);
        g_b->vt->free(g_b, qbd), g_b->vt->free(g_b, obd), g_b->vt->free(g_b, nkbd);
        g_b->vt->free(g_b, nwbd), g_b->vt->free(g_b, idxbd);
        free(qb), free(want), free(have), free(nkb), free(nwb), free(idxb);
    }
    // A call captured into a graph before the check (the exact kernel: the check downloads, so it
    // waits for a direct call; the state stays 0), the checked call, the next, one without
    // round_p, and a call captured after the check (the tensor cores), each replay's output equal
    // to the direct kernel's.
    for (int call = 0; call < 5; call++) {
        const bool rp = call != 3, captured = call == 0 || call == 4, on_tc = tc && rp && call > 0;
        const int64_t n_tc = g_cu->n_attn_codes_tc_calls;
        CK(g_b->vt->memset(g_b, od, 0xFF, ob));
        if (captured) {
            void *graph = NULL;
            CK(g_b->vt->graph_begin(g_b));
            const di_status st = g_b->vt->attn_codes(g_b, qd, wd, ed, idxd, MK, nwd, nkd, MK, sd, T,
                                                     H, DH, scale, rp, od);
            CK(g_b->vt->graph_end(g_b, &graph));
            CK(st);
            CK(g_b->vt->graph_launch(g_b, graph));
            bk_to(g_b, got, od, ob);
            g_b->vt->graph_destroy(g_b, graph);
        } else {
            CK(g_b->vt->attn_codes(g_b, qd, wd, ed, idxd, MK, nwd, nkd, MK, sd, T, H, DH, scale, rp,
                                   od));
            bk_to(g_b, got, od, ob);
        }
        CHECK_EQ(g_cu->attn_codes_tc, tc && call > 0 ? 1 : 0);
        CHECK_EQ(g_cu->n_attn_codes_tc_calls, n_tc + (on_tc ? 1 : 0));
        if (memcmp(got, on_tc ? tcr : exact, ob) != 0)
            fprintf(stderr, "  attn_codes dispatch call %d: not the %s kernel's bits\n", call,
                    on_tc ? "tensor-core" : "exact");
        CHECK(memcmp(got, on_tc ? tcr : exact, ob) == 0);
    }
    if (tc) {
        g_cu->attn_codes_tc = 0, g_cu->attn_tc_check_tol = -1.0f;
        for (int call = 0; call < 2; call++) {
            const int64_t n_tc = g_cu->n_attn_codes_tc_calls;
            CK(g_b->vt->memset(g_b, od, 0xFF, ob));
            CK(g_b->vt->attn_codes(g_b, qd, wd, ed, idxd, MK, nwd, nkd, MK, sd, T, H, DH, scale,
                                   true, od));
            bk_to(g_b, got, od, ob);
            CHECK_EQ(g_cu->attn_codes_tc, -1);
            CHECK_EQ(g_cu->n_attn_codes_tc_calls, n_tc);
            CHECK(memcmp(got, exact, ob) == 0);
        }
    }
    fprintf(stderr, "  attn_codes dispatch: %s\n",
            tc ? "tensor cores checked and kept; a forced mismatch falls back"
               : "tensor cores unsupported here: the exact kernel");
    // The wgmma kernel tried first (cc 9.0 with sm_90a code): its checked call and the next are
    // di_cuda_attn_codes_wg's bits (attn_codes_wg 1, counted); a forced mismatch returns the exact
    // result and turns it off, and the next call is the mma.sync kernel's (already checked here).
    const di_status st_wg =
        di_cuda_attn_codes_wg(g_cu, qd, wd, ed, idxd, MK, nwd, nkd, MK, sd, T, H, DH, scale, 0, od);
    CHECK(st_wg == DI_OK || (st_wg == DI_ERR_UNSUPPORTED && !di_cuda_wgmma_available(g_cu)));
    if (st_wg == DI_OK && tc) {
        float *wgr = malloc(ob);
        bk_to(g_b, wgr, od, ob);
        g_cu->attn_codes_tc = 1;
        for (int call = 0; call < 4; call++) {
            if (call == 0 || call == 2) g_cu->attn_codes_wg = 0;
            g_cu->attn_tc_check_tol = call < 2 ? tol : -1.0f;
            const int64_t n_wg = g_cu->n_attn_codes_wg_calls, n_tc = g_cu->n_attn_codes_tc_calls;
            CK(g_b->vt->memset(g_b, od, 0xFF, ob));
            CK(g_b->vt->attn_codes(g_b, qd, wd, ed, idxd, MK, nwd, nkd, MK, sd, T, H, DH, scale,
                                   true, od));
            bk_to(g_b, got, od, ob);
            const bool on_wg = call < 2, on_tc = call == 3;
            CHECK_EQ(g_cu->attn_codes_wg, on_wg ? 1 : -1);
            CHECK_EQ(g_cu->n_attn_codes_wg_calls, n_wg + (on_wg ? 1 : 0));
            CHECK_EQ(g_cu->n_attn_codes_tc_calls, n_tc + (on_tc ? 1 : 0));
            const float *want = on_wg ? wgr : on_tc ? tcr : exact;
            if (memcmp(got, want, ob) != 0)
                fprintf(stderr, "  attn_codes wgmma dispatch call %d: not the %s kernel's bits\n",
                        call,
                        on_wg   ? "wgmma"
                        : on_tc ? "mma.sync"
                                : "exact");
            CHECK(memcmp(got, want, ob) == 0);
        }
        fprintf(stderr, "  attn_codes dispatch: wgmma checked and kept; a forced mismatch falls "
                        "back to mma.sync\n");
        free(wgr);
    }
    g_cu->attn_codes_tc = state, g_cu->attn_codes_wg = state_wg, g_cu->attn_tc_check_tol = tol;
    g_b->vt->free(g_b, qd), g_b->vt->free(g_b, sd), g_b->vt->free(g_b, wd);
    g_b->vt->free(g_b, ed), g_b->vt->free(g_b, idxd), g_b->vt->free(g_b, nwd);
    g_b->vt->free(g_b, nkd), g_b->vt->free(g_b, od);
    free(win), free(ent), free(wdec), free(edec), free(idx), free(q), free(sink), free(exact),
        free(tcr), free(got);
}

static void test_attn_codes(void) {
    attn_case(512, 64, 7, 400, 600, 640, false, 0); // V4.1-Flash: 64 heads, W 128 + top-512
    attn_case(512, 64, 7, 400, 600, 640, true, 0);  // the official recipe: BF16 p
    attn_case(512, 20, 6, 100, 50, 77, false, 0);   // a partial head group (16 + 4)
    attn_case(64, 4, 12, 40, 30, 24, true, 0);      // the tiny model's widths (byte copies)
    attn_case(64, 1, 6, 5, 5, 1, false, 0);         // one head, one key at most
    attn_case(256, 8, 7, 50, 60, 100, true, 3);     // 8-byte pieces (264-byte window rows)
    attn_case(128, 72, 7, 50, 60, 90, false, 1);    // 4-byte pieces; two head groups (64 + 8)
    attn_case(128, 72, 5, 50, 60, 130, true, 2);    // the same with round_p (tensor cores)
    attn_case(1024, 16, 3, 20, 30, 70, true, 1);    // dh 1024: 16-head blocks, 8 groups a lane
    // Long lists at batch 1 (many splits: the combine of up to 132), V4.1-Flash's batch 64.
    attn_case(512, 64, 1, 128, 4000, 8192, true, KIND_ALL);
    attn_case(512, 64, 1, 128, 4000, 8192, false, KIND_MASKED);
    attn_case(512, 16, 1, 128, 8000, 65536, true, KIND_ALL);
    attn_case(512, 64, 64, 128, 1000, 640, true, 0);
    if (!g_b) return; // --cpu: the CPU op's side only
    bad_keys_case(1, 0);
    bad_keys_case(5, 0);
    bad_keys_case(1, 1);
    bad_keys_case(3, 1);
    bad_keys_case(1, 2);
    bad_keys_case(3, 2);
    dispatch_case();
    float *d = NULL;
    CK(g_b->vt->alloc(g_b, 4096, (void **)&d));
    const uint8_t *u = (const uint8_t *)d;
    int32_t *i = (int32_t *)d;
    CHECK_EQ(g_b->vt->attn_codes(g_b, d, u, u, i, 4, i, i, 4, d, 1, 1, 48, 1.0f, false, d),
             DI_ERR_INVALID); // dh not a multiple of 32
    CHECK_EQ(g_b->vt->attn_codes(g_b, d, u, u, i, 4, i, i, 4, d, 1, 1, 1056, 1.0f, false, d),
             DI_ERR_INVALID); // dh past 1024
    CHECK_EQ(g_b->vt->attn_codes(g_b, d, u, u, i, 4, i, i, 1 << 28, d, 1, 1, 64, 1.0f, false, d),
             DI_ERR_INVALID); // key_stride < max_keys
    CHECK_EQ(g_b->vt->attn_codes(g_b, d, u, u, i, 4, i, i, -1, d, 1, 1, 64, 1.0f, false, d),
             DI_ERR_INVALID); // negative max_keys
    CHECK_EQ(di_cuda_attn_codes_ex(g_cu, d, u, u, i, 4, i, i, 4, d, 1, 1, 64, 1.0f, 0, 3, d),
             DI_ERR_INVALID); // no 3-heads-a-warp block
    CHECK_EQ(di_cuda_attn_codes_ex(g_cu, d, u, u, i, 4, i, i, 4, d, 1, 1, 1024, 1.0f, 0, 8, d),
             DI_ERR_INVALID); // 64-head blocks are built up to dh 512
    CHECK_EQ(di_cuda_attn_codes_ex(g_cu, d, u, u, i, 4, i, i, 4, d, 1, 1, 64, 1.0f, -2, 0, d),
             DI_ERR_INVALID); // negative split count
    // The wgmma kernel: dh 512 only.
    CHECK_EQ(di_cuda_attn_codes_wg(g_cu, d, u, u, i, 4, i, i, 4, d, 1, 1, 256, 1.0f, 0, d),
             DI_ERR_INVALID);
    CHECK_EQ(di_cuda_attn_codes_wg(g_cu, d + 1, u, u, i, 4, i, i, 4, d, 1, 1, 512, 1.0f, 0, d),
             DI_ERR_INVALID);
    // The tensor-core kernel: dh 512 / 256 / 128 only, q 16- and o 8-byte aligned, the code bases
    // 4-byte aligned, a split count >= 0.
    CHECK_EQ(di_cuda_attn_codes_bf16(g_cu, d, u, u, i, 4, i, i, 4, d, 1, 1, 64, 1.0f, 0, d),
             DI_ERR_INVALID);
    CHECK_EQ(di_cuda_attn_codes_bf16(g_cu, d, u, u, i, 4, i, i, 4, d, 1, 1, 1024, 1.0f, 0, d),
             DI_ERR_INVALID);
    CHECK_EQ(di_cuda_attn_codes_bf16(g_cu, d + 1, u, u, i, 4, i, i, 4, d, 1, 1, 128, 1.0f, 0, d),
             DI_ERR_INVALID);
    CHECK_EQ(di_cuda_attn_codes_bf16(g_cu, d, u, u, i, 4, i, i, 4, d, 1, 1, 128, 1.0f, 0, d + 1),
             DI_ERR_INVALID);
    CHECK_EQ(di_cuda_attn_codes_bf16(g_cu, d, u + 2, u, i, 4, i, i, 4, d, 1, 1, 128, 1.0f, 0, d),
             DI_ERR_INVALID);
    CHECK_EQ(di_cuda_attn_codes_bf16(g_cu, d, u, u, i, 4, i, i, 4, d, 1, 1, 128, 1.0f, -1, d),
             DI_ERR_INVALID);
    CHECK_EQ(di_cuda_attn_codes_bf16(g_cu, d, u, u, i, 2, i, i, 4, d, 1, 1, 128, 1.0f, 0, d),
             DI_ERR_INVALID); // key_stride < max_keys
    g_b->vt->free(g_b, d);
}

// ---- index_scores_q4 ----

static void index_case(int32_t T, int32_t HI, int32_t DI, int32_t n_ent, int32_t max_vis) {
    const int64_t ss = max_vis + 5, kb = di_backend_code_row_bytes(4, DI, DI_BACKEND_KEY_BLOCK);
    float *qi = malloc(sizeof(float) * (size_t)(T * HI * DI)),
          *wi = malloc(sizeof(float) * (size_t)(T * HI));
    uint8_t *keys = malloc((size_t)(n_ent * kb));
    float *dec = malloc(sizeof(float) * (size_t)(n_ent * DI));
    fill_rand(qi, (int64_t)T * HI * DI, 1.0f);
    fill_rand(wi, (int64_t)T * HI, 0.1f);
    make_rows(4, DI, DI_BACKEND_KEY_BLOCK, n_ent, keys, dec);
    int32_t *vis = malloc(sizeof(int32_t) * (size_t)T);
    int64_t *base = malloc(sizeof(int64_t) * (size_t)T);
    for (int32_t t = 0; t < T; t++) {
        vis[t] = t == 0 ? 1 : t == 1 ? max_vis : (int32_t)(rnd() % (uint64_t)max_vis) + 1;
        base[t] = (int64_t)(rnd() % (uint64_t)(n_ent - vis[t] + 1));
    }
    float *ref = malloc(sizeof(float) * (size_t)(T * ss));
    double *tol = malloc(sizeof(double) * (size_t)(T * ss));
    for (int64_t i = 0; i < T * ss; i++) ref[i] = NAN, tol[i] = 0; // past n_vis: not written
    for (int32_t t = 0; t < T; t++)
        for (int32_t w = 0; w < vis[t]; w++) {
            const float *kw = dec + (base[t] + w) * DI;
            double acc = 0, bound = 0;
            for (int32_t h = 0; h < HI; h++) {
                const float *qv = qi + ((int64_t)t * HI + h) * DI;
                double dot = 0, a = 0;
                for (int32_t d = 0; d < DI; d++)
                    dot += (double)qv[d] * kw[d], a += fabs((double)qv[d] * kw[d]);
                acc += wi[t * HI + h] * (dot > 0 ? dot : 0);
                bound += fabs(wi[t * HI + h]) * (gamma_k(DI) * a + gamma_k(HI) * fabs(dot));
            }
            ref[t * ss + w] = (float)acc;
            tol[t * ss + w] = TOL_SCORE_FACTOR * bound + 1e-30;
        }
    // Paged: the same keys in shuffled pages of 7 (row t's from t * n_pg on; row 1's page 2
    // missing: -inf).
    const int32_t per = 7, n_pg = (max_vis + per - 1) / per, n_all = T * n_pg;
    int32_t *pages = malloc(sizeof(int32_t) * (size_t)n_all),
            *pg_off = malloc(sizeof(int32_t) * (size_t)T);
    uint8_t *paged = calloc((size_t)n_all * per, (size_t)kb);
    for (int32_t i = 0; i < n_all; i++) pages[i] = i;
    for (int32_t i = n_all - 1; i > 0; i--) {
        int32_t j = (int32_t)(rnd() % (uint64_t)(i + 1)), x = pages[i];
        pages[i] = pages[j], pages[j] = x;
    }
    for (int32_t t = 0; t < T; t++) {
        pg_off[t] = t * n_pg;
        for (int32_t w = 0; w < vis[t]; w++)
            memcpy(paged + ((int64_t)pages[t * n_pg + w / per] * per + w % per) * kb,
                   keys + (base[t] + w) * kb, (size_t)kb);
    }
    if (n_pg > 2) pages[1 * n_pg + 2] = -1;
    di_backend *bs[2] = {g_cpu, g_b};
    float *out[2][2];
    for (int k = 0; k < 2; k++) {
        di_backend *b = bs[k];
        float *qd = bk_from(b, qi, sizeof(float) * (size_t)(T * HI * DI)),
              *wd = bk_from(b, wi, sizeof(float) * (size_t)(T * HI));
        uint8_t *kd = bk_from(b, keys, (size_t)(n_ent * kb)),
                *pkd = bk_from(b, paged, (size_t)n_all * per * (size_t)kb);
        int32_t *vd = bk_from(b, vis, sizeof(int32_t) * (size_t)T),
                *pgd = bk_from(b, pages, sizeof(int32_t) * (size_t)n_all),
                *pod = bk_from(b, pg_off, sizeof(int32_t) * (size_t)T);
        int64_t *bd = bk_from(b, base, sizeof(int64_t) * (size_t)T);
        for (int paged_k = 0; paged_k < 2; paged_k++) {
            float *o = malloc(sizeof(float) * (size_t)(T * ss));
            for (int64_t i = 0; i < T * ss; i++) o[i] = NAN;
            float *sd = bk_from(b, o, sizeof(float) * (size_t)(T * ss));
            if (paged_k)
                CK(b->vt->index_scores_q4(b, qd, wd, pkd, NULL, pgd, pod, per, vd, max_vis, T, HI,
                                          DI, false, sd, ss));
            else
                CK(b->vt->index_scores_q4(b, qd, wd, kd, bd, NULL, NULL, 0, vd, max_vis, T, HI, DI,
                                          false, sd, ss));
            bk_to(b, o, sd, sizeof(float) * (size_t)(T * ss));
            b->vt->free(b, sd);
            out[k][paged_k] = o;
        }
        char what[96];
        snprintf(what, sizeof what, "index_scores_q4 %s T=%d HI=%d DI=%d", b->vt->name, T, HI, DI);
        CHECK(check_bounds(what, out[k][0], ref, tol, T * ss) == 0);
        int64_t bad = 0;
        for (int32_t t = 0; t < T; t++)
            for (int32_t w = 0; w < vis[t]; w++) {
                const float g = out[k][1][t * ss + w];
                if (t == 1 && w / per == 2 && n_pg > 2)
                    bad += !(isinf(g) && g < 0);
                else
                    bad += memcmp(&g, &out[k][0][t * ss + w], sizeof g) != 0;
            }
        fprintf(stderr, "  %s paged (7 a page, shuffled, one missing): %lld differ\n", what,
                (long long)bad);
        CHECK_EQ(bad, 0);
        // The FP32 keys' entry on the decoded keys: the same bits (HI <= 64: its lane kernel, whose
        // per-head dot runs over the dims in the same order), FP32 and BF16 scores.
        if (k == 1 && HI <= 64) {
            float *dd = bk_from(b, dec, sizeof(float) * (size_t)(n_ent * DI));
            float *o = malloc(sizeof(float) * (size_t)(T * ss)),
                  *oq = malloc(sizeof(float) * (size_t)(T * ss));
            int64_t differ = 0;
            for (int r = 0; r < 2; r++) {
                for (int64_t i = 0; i < T * ss; i++) o[i] = oq[i] = NAN;
                float *sd = bk_from(b, o, sizeof(float) * (size_t)(T * ss)),
                      *sq = bk_from(b, oq, sizeof(float) * (size_t)(T * ss));
                CK(b->vt->index_scores(b, qd, wd, dd, bd, NULL, NULL, 0, vd, max_vis, T, HI, DI,
                                       r == 1, sd, ss));
                CK(b->vt->index_scores_q4(b, qd, wd, kd, bd, NULL, NULL, 0, vd, max_vis, T, HI, DI,
                                          r == 1, sq, ss));
                bk_to(b, o, sd, sizeof(float) * (size_t)(T * ss));
                bk_to(b, oq, sq, sizeof(float) * (size_t)(T * ss));
                for (int64_t i = 0; i < T * ss; i++)
                    differ += memcmp(&o[i], &oq[i], sizeof(float)) != 0;
                b->vt->free(b, sd), b->vt->free(b, sq);
            }
            fprintf(stderr, "  %s vs index_scores on the decoded keys: %lld differ\n", what,
                    (long long)differ);
            CHECK_EQ(differ, 0);
            b->vt->free(b, dd);
            free(o), free(oq);
        }
        // The official recipe: BF16 scores, within one BF16 ulp of the reference's.
        if (k == 1) {
            float *ro = malloc(sizeof(float) * (size_t)(T * ss)),
                  *rr = malloc(sizeof(float) * (size_t)(T * ss));
            double *rt = malloc(sizeof(double) * (size_t)(T * ss));
            float *sd = bk_from(b, ro, sizeof(float) * (size_t)(T * ss));
            CK(b->vt->index_scores_q4(b, qd, wd, kd, bd, NULL, NULL, 0, vd, max_vis, T, HI, DI,
                                      true, sd, ss));
            bk_to(b, ro, sd, sizeof(float) * (size_t)(T * ss));
            int64_t not_bf16 = 0;
            for (int64_t i = 0; i < T * ss; i++) {
                rr[i] = isnan(ref[i]) ? ref[i] : di_round_bf16(ref[i]);
                rt[i] = isnan(ref[i]) ? 0 : tol[i] + fabs(ref[i]) * 0x1p-7;
                if (!isnan(ref[i])) not_bf16 += ro[i] != di_round_bf16(ro[i]);
            }
            CHECK_EQ(not_bf16, 0);
            CHECK(check_bounds("index_scores_q4 cuda bf16", ro, rr, rt, T * ss) == 0);
            b->vt->free(b, sd);
            free(ro), free(rr), free(rt);
        }
        b->vt->free(b, qd), b->vt->free(b, wd), b->vt->free(b, kd), b->vt->free(b, pkd);
        b->vt->free(b, vd), b->vt->free(b, pgd), b->vt->free(b, pod), b->vt->free(b, bd);
    }
    for (int k = 0; k < 2; k++) free(out[k][0]), free(out[k][1]);
    free(qi), free(wi), free(keys), free(dec), free(vis), free(base), free(ref), free(tol),
        free(pages), free(pg_off), free(paged);
}

static void test_index_scores_q4(void) {
    index_case(5, 64, 128, 3000, 2600); // V4.1-Flash's indexer widths
    index_case(5, 4, 64, 300, 260);     // the tiny model's
    index_case(4, 4, 128, 400, 330);    // the tiny synthetic V4's (its official-recipe keys)
    index_case(3, 72, 128, 500, 300);   // two head chunks (64 + 8)
    float *d = NULL;
    CK(g_b->vt->alloc(g_b, 4096, (void **)&d));
    int32_t *i = (int32_t *)d;
    CHECK_EQ(g_b->vt->index_scores_q4(g_b, d, d, (const uint8_t *)d, NULL, NULL, NULL, 0, i, 4, 1,
                                      4, 48, false, d, 4),
             DI_ERR_INVALID); // DI not a multiple of 32
    g_b->vt->free(g_b, d);
}

int main(int argc, char **argv) {
    if (di_cuda_device_count() == 0) {
        // --cpu (a development aid without a GPU): the attn_codes cases against the CPU op alone,
        // so the reference and the cases are exercised where the CUDA side cannot run.
        if (argc > 1 && strcmp(argv[1], "--cpu") == 0) {
            CK(di_cpu_backend_create(2, &g_cpu));
            RUN(test_attn_codes);
            di_backend_destroy(g_cpu);
            if (test_finish() != 0) return 1;
        }
        DI_TEST_SKIP("no CUDA device");
    }
    CK(di_cuda_backend_create(0, &g_b));
    g_cu = (di_cuda *)g_b->impl;
    const char *tc_env = getenv("DI_CUDA_ATTN_TC"); // attn_kv's switch turns attn_codes' off too
    CHECK_EQ(g_cu->attn_codes_tc, tc_env && strcmp(tc_env, "0") == 0 ? -1 : 0);
    CK(di_cpu_backend_create(2, &g_cpu));
    fprintf(stderr, "backend: %s\n", g_b->desc);
    RUN(test_pack_rows);
    RUN(test_attn_codes);
    RUN(test_index_scores_q4);
    CK(g_b->vt->sync(g_b));
    di_backend_destroy(g_b);
    di_backend_destroy(g_cpu);
    return test_finish();
}
