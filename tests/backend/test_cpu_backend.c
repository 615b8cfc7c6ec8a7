// The CPU backend's ops (backend/cpu/cpu_backend.c) on small hand-made inputs, against the
// contracts of backend/backend.h written out as plain loops: compress_pool's row sources (this
// call's rows, the ring, the absent overlap of window 0), attention's masked keys and sink, top-k
// ties and padding, offset_list and index_scores (contiguous and through a page table),
// index_scores_q4 on pack_rows' Q4 codes equal to index_scores on the decoded keys bit for bit,
// matmul_a8, scatter_rows, add_ape, embed, memory alignment; the padding of graph-stable lists
// (scatter destinations < 0, windows without rows); graphs: a replay equals the same calls run
// directly, reads the memory as it is at launch, keeps the scalars and tensors of the capture, and
// a capture refuses what a CUDA capture cannot hold; V4.1's ops (mhc_pre_carried, engram_gate,
// index_cand, Q4e); attention's key counts outside [0, max_keys] refused (directly and replayed);
// the copy between two backends, directly and through the host bounce; argmax_rows against the
// sampler's di_argmax (ties, -0/+0, -inf and NaN rows, a NaN at entry 0, strided rows, captured
// and replayed); mem_info (the test hook's numbers, else "cannot say", refused in a capture
// and on a lost backend); the deferred mode (the CUDA stream's asynchrony: queued work runs at
// the sync points, in order). The whole forward on this backend is tested against the model in
// tests/model/test_dev_forward.c.
#include "harness.h"

#include <math.h>
#include <stdlib.h>
#include <stdint.h>

#include "backend/backend.h"
#include "sample/sampler.h"   // di_argmax: what argmax_rows must equal
#include "tensor/quant_ref.h" // di_round_bf16, di_fake_quant_q8/q4, di_hadamard

// The backend runs the same float operations in the same order as these loops; only a compiler
// contracting a multiply-add differently could move a result, by an ulp or so.
#define TOL_OP 1e-6

static di_backend *g_b;

static void test_alloc(void) {
    void *p = NULL;
    CHECK_EQ(g_b->vt->alloc(g_b, 1000, &p), DI_OK);
    CHECK(p && ((uintptr_t)p % 256) == 0);
    CHECK_EQ(g_b->vt->memset(g_b, p, 0, 1000), DI_OK);
    g_b->vt->free(g_b, p);
    g_b->vt->free(g_b, NULL);
    CHECK_EQ(g_b->vt->sync(g_b), DI_OK);
    CHECK(g_b->device.kind == DI_DEVICE_CPU && strncmp(g_b->desc, "cpu", 3) == 0);
    // host_alloc: aligned, usable, refused inside a capture.
    void *h = NULL;
    CHECK_EQ(g_b->vt->host_alloc(g_b, 1000, &h), DI_OK);
    CHECK(h && ((uintptr_t)h % 256) == 0);
    memset(h, 0x5A, 1000);
    g_b->vt->host_free(g_b, h);
    g_b->vt->host_free(g_b, NULL);
    void *g = NULL, *h2 = NULL;
    CHECK_EQ(g_b->vt->graph_begin(g_b), DI_OK);
    CHECK_EQ(g_b->vt->host_alloc(g_b, 64, &h2), DI_ERR_INVALID);
    CHECK_EQ(g_b->vt->graph_end(g_b, &g), DI_ERR_INVALID);
    CHECK(h2 == NULL && g == NULL);
}

// Windows of m = 2, c = 2, d = 3: window 0 (no overlap) from call rows, window 1 with its overlap
// from the ring and its own tokens from the call.
static void test_compress_pool(void) {
    enum { M = 2, C = 2, Dd = 3, W = C * Dd };
    float call_c[4 * W], call_z[4 * W], ring_c[4 * W], ring_z[4 * W];
    for (int i = 0; i < 4 * W; i++) {
        call_c[i] = (float)sin(i * 0.7), call_z[i] = (float)cos(i * 0.3);
        ring_c[i] = (float)sin(i * 1.3 + 1), ring_z[i] = (float)cos(i * 0.9 + 2);
    }
    // window 0: overlap absent, tokens call rows 0, 1; window 1: overlap ring rows 2, 3 (encoded
    // -3, -4), tokens call rows 2, 3.
    const int32_t src[2 * C * M] = {DI_BACKEND_NO_ROW, DI_BACKEND_NO_ROW, 0, 1, -3, -4, 2, 3};
    float got[2 * Dd];
    CHECK_EQ(g_b->vt->compress_pool(g_b, call_c, call_z, W, ring_c, ring_z, src, 2, M, C, Dd, got),
             DI_OK);
    for (int w = 0; w < 2; w++) {
        for (int ch = 0; ch < Dd; ch++) {
            const float *zc[4], *cc[4];
            int n = 0;
            if (w == 1)
                for (int j = 0; j < M; j++)
                    zc[n] = ring_z + (2 + j) * W + ch, cc[n++] = ring_c + (2 + j) * W + ch;
            for (int j = 0; j < M; j++) {
                int r = 2 * w + j;
                zc[n] = call_z + r * W + Dd + ch, cc[n++] = call_c + r * W + Dd + ch;
            }
            float mx = -INFINITY, den = 0, num = 0;
            for (int j = 0; j < n; j++) mx = fmaxf(mx, *zc[j]);
            for (int j = 0; j < n; j++) {
                float p = expf(*zc[j] - mx);
                den += p, num += p * *cc[j];
            }
            CHECK_NEAR(got[w * Dd + ch], num / den, TOL_OP);
        }
    }
    // c = 1: slots are the window's own tokens, columns [0, d).
    const int32_t src1[M] = {-1, 0};
    float one[Dd];
    CHECK_EQ(g_b->vt->compress_pool(g_b, call_c, call_z, W, ring_c, ring_z, src1, 1, M, 1, Dd, one),
             DI_OK);
    for (int ch = 0; ch < Dd; ch++) {
        float z0 = ring_z[0 * Dd + ch], z1 = call_z[ch], mx = fmaxf(z0, z1);
        float p0 = expf(z0 - mx), p1 = expf(z1 - mx);
        float want = (p0 * ring_c[ch] + p1 * call_c[ch]) / (p0 + p1);
        CHECK_NEAR(one[ch], want, TOL_OP);
    }
}

// Masked keys change nothing; a row without keys gives zero (the sink takes all the mass).
static void test_attn(void) {
    enum { H = 2, DH = 8, NK = 5 };
    float q[2 * H * DH], pool[NK * DH], sink[H] = {0.5f, -1.0f}, o1[2 * H * DH], o2[2 * H * DH];
    for (int i = 0; i < 2 * H * DH; i++) q[i] = (float)sin(i * 0.37);
    for (int i = 0; i < NK * DH; i++) pool[i] = (float)cos(i * 0.11);
    const int32_t dense[2 * 4] = {0, 2, 4, 0, 0, 0, 0, 0},
                            masked[2 * 4] = {0, -1, 2, 4, 0, 0, 0, 0};
    const int32_t n_dense[2] = {3, 0}, n_masked[2] = {4, 0};
    const float scale = 1.0f / sqrtf(DH);
    CHECK_EQ(g_b->vt->attn(g_b, q, pool, dense, 4, n_dense, 4, sink, 2, H, DH, scale, false, o1),
             DI_OK);
    CHECK_EQ(g_b->vt->attn(g_b, q, pool, masked, 4, n_masked, 4, sink, 2, H, DH, scale, false, o2),
             DI_OK);
    CHECK(memcmp(o1, o2, sizeof o1) == 0);
    for (int i = H * DH; i < 2 * H * DH; i++) CHECK_EQ(o1[i], 0.0f);
    // Head 0 of row 0 by hand.
    float s[3], mx = sink[0], den, out[DH] = {0};
    for (int j = 0; j < 3; j++) {
        float acc = 0;
        for (int i = 0; i < DH; i++) acc += q[i] * pool[dense[j] * DH + i];
        s[j] = acc * scale;
        mx = fmaxf(mx, s[j]);
    }
    den = expf(sink[0] - mx);
    for (int j = 0; j < 3; j++) den += (s[j] = expf(s[j] - mx));
    for (int j = 0; j < 3; j++)
        for (int i = 0; i < DH; i++) out[i] += s[j] / den * pool[dense[j] * DH + i];
    for (int i = 0; i < DH; i++) CHECK_NEAR(o1[i], out[i], 1e-5);
    // round_p (the official recipe): p normalised, then rounded to BF16, before p.v.
    CHECK_EQ(g_b->vt->attn(g_b, q, pool, dense, 4, n_dense, 4, sink, 2, H, DH, scale, true, o2),
             DI_OK);
    float out_r[DH] = {0};
    for (int j = 0; j < 3; j++)
        for (int i = 0; i < DH; i++)
            out_r[i] += di_round_bf16(s[j] * (1.0f / den)) * pool[dense[j] * DH + i];
    for (int i = 0; i < DH; i++) CHECK_NEAR(o2[i], out_r[i], 1e-6);
    CHECK(memcmp(o1, o2, sizeof(float) * DH) != 0);
    // n_keys beyond max_keys is refused.
    const int32_t too_many[2] = {5, 0};
    CHECK_EQ(g_b->vt->attn(g_b, q, pool, dense, 4, too_many, 4, sink, 2, H, DH, scale, false, o1),
             DI_ERR_INVALID);
}

// The official recipe's rounding points: exactly tensor/quant_ref.c, row by row.
static void test_official_ops(void) {
    enum { R = 3, N = 64, S = 72 };
    float x[R * S], y[R * S], want[R * S];
    for (int i = 0; i < R * S; i++) x[i] = (float)(sin(i * 0.731) * exp(0.05 * (i % 37)));
    x[5] = 0.0f, x[N + 3] = -1e-7f; // a zero and a tiny value
    // round_bf16
    memcpy(y, x, sizeof x);
    CHECK_EQ(g_b->vt->round_bf16(g_b, y, R * S), DI_OK);
    for (int i = 0; i < R * S; i++) CHECK_EQ(y[i], di_round_bf16(x[i]));
    // fake_quant Q8 / Q4, out of place (y keeps its columns past n) and in place.
    for (int bits = 8; bits >= 4; bits -= 4) {
        const int block = bits == 8 ? 64 : 32;
        memcpy(want, x, sizeof x);
        for (int r = 0; r < R; r++) {
            if (bits == 8)
                di_fake_quant_q8(want + r * S, N, block);
            else
                di_fake_quant_q4(want + r * S, N, block);
        }
        for (int i = 0; i < R * S; i++) y[i] = -7.0f;
        CHECK_EQ(g_b->vt->fake_quant(g_b, x, R, N, S, block, bits, y), DI_OK);
        for (int r = 0; r < R; r++)
            for (int i = 0; i < S; i++) CHECK_EQ(y[r * S + i], i < N ? want[r * S + i] : -7.0f);
        memcpy(y, x, sizeof x);
        CHECK_EQ(g_b->vt->fake_quant(g_b, y, R, N, S, block, bits, y), DI_OK);
        for (int r = 0; r < R; r++)
            for (int i = 0; i < S; i++)
                CHECK_EQ(y[r * S + i], i < N ? want[r * S + i] : x[r * S + i]);
    }
    // A non-finite value turns its block into NaN, the other blocks are kept.
    memcpy(y, x, sizeof x);
    y[1] = INFINITY;
    CHECK_EQ(g_b->vt->fake_quant(g_b, y, 1, N, S, 32, 8, y), DI_OK);
    CHECK(isnan(y[0]) && isnan(y[31]) && !isnan(y[32]));
    // hadamard
    memcpy(y, x, sizeof x);
    memcpy(want, x, sizeof x);
    CHECK_EQ(g_b->vt->hadamard(g_b, y, 2, 64), DI_OK);
    di_hadamard(want, 64);
    di_hadamard(want + 64, 64);
    for (int i = 0; i < R * S; i++) CHECK_EQ(y[i], want[i]);
    // Refused shapes.
    CHECK_EQ(g_b->vt->fake_quant(g_b, x, 1, N, S, 48, 8, y), DI_ERR_INVALID); // 48 does not divide
    CHECK_EQ(g_b->vt->fake_quant(g_b, x, 1, N, S, 32, 6, y), DI_ERR_INVALID); // bits
    CHECK_EQ(g_b->vt->hadamard(g_b, y, 1, 48), DI_ERR_INVALID);               // not a power of 2
}

// KV rows (kv_quant, attn_kv): the layout of backend/cuda/attn.cuh, decoded by hand; rows that
// are Q8-exact (nope) and BF16 (rope) decode to themselves, so attn_kv equals attn on the FP32
// rows bit for bit; a negative destination skips its row; a graph replays both ops.
// matmul_a8 is fake_quant (Q8, blocks of 128, into aq) then matmul, bit for bit, directly and
// replayed from a graph (two commands: each entry recorded on its own).
static void test_matmul_a8(void) {
    enum { K = 256, N = 130, T = 5, XS = K + 4, YS = N + 3 };
    static uint8_t codes[N * K], scales[2 * 2];
    for (int i = 0; i < N * K; i++) {
        codes[i] = (uint8_t)(i * 37 + i / 7);
        if ((codes[i] & 0x7F) == 0x7F) codes[i] ^= 1; // no NaN codes
    }
    for (int i = 0; i < 4; i++) scales[i] = (uint8_t)(118 + i);
    di_tensor w = {.name = "w",
                   .kind = DI_TENSOR_KIND_FP8,
                   .ne = {K, N},
                   .nb1 = K,
                   .data = codes,
                   .scale = scales,
                   .scale_nb1 = 2,
                   .block_out = 128,
                   .block_in = 128};
    static float x[T * XS], aq[T * XS], xq[T * XS], want[T * YS], y[T * YS], y2[T * YS];
    for (int i = 0; i < T * XS; i++) x[i] = sinf(0.37f * (float)i) * (i % 11 == 0 ? 40.0f : 1.0f);
    memcpy(xq, x, sizeof x);
    for (int t = 0; t < T; t++) di_fake_quant_q8(xq + t * XS, K, 128);
    CHECK_EQ(g_b->vt->matmul(g_b, &w, xq, T, XS, want, YS), DI_OK);
    CHECK_EQ(g_b->vt->matmul_a8(g_b, &w, x, T, XS, aq, y, YS), DI_OK);
    for (int t = 0; t < T; t++) CHECK(memcmp(y + t * YS, want + t * YS, sizeof(float) * N) == 0);
    CHECK(memcmp(aq, xq, sizeof(float) * K) == 0); // A8 of row 0 (the CPU backend keeps it)
    void *g = NULL;
    CHECK_EQ(g_b->vt->graph_begin(g_b), DI_OK);
    CHECK_EQ(g_b->vt->matmul_a8(g_b, &w, x, T, XS, aq, y2, YS), DI_OK);
    CHECK_EQ(g_b->vt->graph_end(g_b, &g), DI_OK);
    CHECK_EQ(di_cpu_backend_graph_n_cmds(g), 2);
    CHECK_EQ(g_b->vt->graph_launch(g_b, g), DI_OK);
    g_b->vt->graph_destroy(g_b, g);
    for (int t = 0; t < T; t++) CHECK(memcmp(y2 + t * YS, want + t * YS, sizeof(float) * N) == 0);
    // A weight of another width than the blocks of 128 allow: refused.
    di_tensor w2 = w;
    w2.ne[0] = 100;
    CHECK_EQ(g_b->vt->matmul_a8(g_b, &w2, x, T, XS, aq, y, YS), DI_ERR_INVALID);
}

static void test_kv_rows(void) {
    enum { DH = 128, NR = 64, NOPE = DH - NR, NK = 4, H = 3, T = 2, KS = 4 };
    const int64_t rb = di_backend_kv_row_bytes(DH, NR);
    CHECK_EQ(rb, 200);
    CHECK_EQ(di_backend_kv_row_bytes(512, 64), 584);
    float kv[NK * DH], want[NK * DH];
    for (int i = 0; i < NK * DH; i++)
        kv[i] = (float)(sin(i * 0.731) * exp(0.07 * (i % 41)) * (i % DH < 64 ? 1.0 : 1e-3));
    kv[DH + 3] = 0.0f;
    for (int r = 0; r < NK * DH; r += 64) // one block per row of very different magnitude
        if ((r / 64) % 3 == 1)
            for (int j = 0; j < 64; j++) kv[r + j] *= 37.0f;
    memcpy(want, kv, sizeof kv);
    for (int r = 0; r < NK; r++) {
        di_fake_quant_q8(want + r * DH, NOPE, 64);
        for (int d = NOPE; d < DH; d++) want[r * DH + d] = di_round_bf16(want[r * DH + d]);
    }
    uint8_t pool[(NK + 2) * 200];
    memset(pool, 0xAB, sizeof pool);
    const int32_t dst[NK] = {3, -1, 0, 5}; // row 1 skipped (padding)
    CHECK_EQ(g_b->vt->kv_quant(g_b, kv, NK, DH, DH, NR, pool, dst), DI_OK);
    for (int i = 0; i < NK; i++) {
        if (dst[i] < 0) continue;
        const uint8_t *row = pool + dst[i] * rb;
        for (int d = 0; d < NOPE; d++)
            CHECK_EQ(di_e4m3_to_f32(row[d]) * di_ue8m0_to_f32(row[NOPE + 2 * NR + d / 64]),
                     want[i * DH + d]);
        for (int d = 0; d < NR; d++) {
            const uint16_t h = (uint16_t)(row[NOPE + 2 * d] | row[NOPE + 2 * d + 1] << 8);
            CHECK_EQ(di_bf16_to_f32(h), want[i * DH + NOPE + d]);
        }
        for (int64_t p = NOPE + 2 * NR + NOPE / 64; p < rb; p++) CHECK_EQ(row[p], 0);
    }
    for (int r = 0; r < NK + 2; r++)
        if (r != 3 && r != 0 && r != 5)
            for (int64_t p = 0; p < rb; p++) CHECK_EQ(pool[r * rb + p], 0xAB);
    // Encoding the decoded rows again gives the same bytes (lossless on Q8-exact rows).
    uint8_t again[(NK + 2) * 200];
    memcpy(again, pool, sizeof pool);
    CHECK_EQ(g_b->vt->kv_quant(g_b, want, NK, DH, DH, NR, again, dst), DI_OK);
    CHECK(memcmp(again, pool, sizeof pool) == 0);
    // attn_kv on the KV rows == attn on the FP32 rows they hold (pool row r = want row src[r]).
    float fp[(NK + 2) * DH];
    memset(fp, 0, sizeof fp);
    for (int i = 0; i < NK; i++)
        if (dst[i] >= 0) memcpy(fp + dst[i] * DH, want + i * DH, sizeof(float) * DH);
    float q[T * H * DH], sink[H] = {0.3f, -2.0f, 1.0f}, o1[T * H * DH], o2[T * H * DH];
    for (int i = 0; i < T * H * DH; i++) q[i] = (float)cos(i * 0.173) * 0.3f;
    const int32_t keys[T * KS] = {3, -1, 0, 5, 5, 0, 9, 9}, n_keys[T] = {4, 2};
    for (int rp = 0; rp < 2; rp++) {
        CHECK_EQ(g_b->vt->attn(g_b, q, fp, keys, KS, n_keys, KS, sink, T, H, DH, 0.1f, rp, o1),
                 DI_OK);
        CHECK_EQ(
            g_b->vt->attn_kv(g_b, q, pool, keys, KS, n_keys, KS, sink, T, H, DH, NR, 0.1f, rp, o2),
            DI_OK);
        CHECK(memcmp(o1, o2, sizeof o1) == 0);
    }
    // A graph replays both.
    void *g = NULL;
    uint8_t pool2[(NK + 2) * 200];
    memset(pool2, 0xAB, sizeof pool2);
    float o3[T * H * DH];
    CHECK_EQ(g_b->vt->graph_begin(g_b), DI_OK);
    CHECK_EQ(g_b->vt->kv_quant(g_b, kv, NK, DH, DH, NR, pool2, dst), DI_OK);
    CHECK_EQ(
        g_b->vt->attn_kv(g_b, q, pool2, keys, KS, n_keys, KS, sink, T, H, DH, NR, 0.1f, true, o3),
        DI_OK);
    CHECK_EQ(g_b->vt->graph_end(g_b, &g), DI_OK);
    CHECK_EQ(di_cpu_backend_graph_n_cmds(g), 2);
    CHECK_EQ(g_b->vt->graph_launch(g_b, g), DI_OK);
    g_b->vt->graph_destroy(g_b, g);
    CHECK(memcmp(pool2, pool, sizeof pool) == 0);
    CHECK(memcmp(o3, o2, sizeof o3) == 0);
    // Refused shapes: nope not a multiple of 64.
    CHECK_EQ(g_b->vt->kv_quant(g_b, kv, 1, DH, DH, 32, pool, NULL), DI_ERR_INVALID);
    CHECK_EQ(
        g_b->vt->attn_kv(g_b, q, pool, keys, KS, n_keys, KS, sink, T, H, DH, 32, 0.1f, true, o2),
        DI_ERR_INVALID);
    // A key count outside [0, max_keys] (CUDA clamps it and reports DI_ERR_INVALID at the next
    // sync): refused before any work, called directly or replayed from a graph (the counts are
    // read when it runs), and the output untouched.
    const int32_t over[T] = {KS + 1, 1}, neg[T] = {1, -1};
    float o4[T * H * DH];
    memset(o4, 0x7f, sizeof o4);
    memcpy(o3, o4, sizeof o4);
    CHECK_EQ(g_b->vt->attn_kv(g_b, q, pool, keys, KS, over, KS, sink, T, H, DH, NR, 0.1f, true, o4),
             DI_ERR_INVALID);
    CHECK_EQ(g_b->vt->attn_kv(g_b, q, pool, keys, KS, neg, KS, sink, T, H, DH, NR, 0.1f, true, o4),
             DI_ERR_INVALID);
    int32_t nk_live[T] = {n_keys[0], n_keys[1]};
    CHECK_EQ(g_b->vt->graph_begin(g_b), DI_OK);
    CHECK_EQ(
        g_b->vt->attn_kv(g_b, q, pool, keys, KS, nk_live, KS, sink, T, H, DH, NR, 0.1f, true, o4),
        DI_OK);
    CHECK_EQ(g_b->vt->graph_end(g_b, &g), DI_OK);
    nk_live[0] = KS + 3;
    CHECK_EQ(g_b->vt->graph_launch(g_b, g), DI_ERR_INVALID);
    g_b->vt->graph_destroy(g_b, g);
    CHECK(memcmp(o3, o4, sizeof o4) == 0);
}

// The copy between two backends (backend.h can_peer, peer_copy; di_backend_hand_over): two CPU
// backends copy directly; with one of them set not to peer (the stages' test of a GPU pair without
// peer access) the hand-over goes through the bounce buffer instead; the same bytes either way.
// peer_copy is refused inside a capture of either backend (the capture then fails), between
// backends that cannot peer, and on a lost one.
// mem_info: the hook's numbers after di_cpu_backend_set_mem, else (by default, after 0, 0, and
// with free > total) the backend cannot say (DI_ERR_UNSUPPORTED as a backend without the entry);
// refused inside a capture and once lost; outputs untouched on failure.
static void test_mem_info(void) {
    di_backend *b = NULL;
    CHECK_EQ(di_cpu_backend_create(1, &b), DI_OK);
    if (!b) return;
    size_t fr = 7, tot = 7;
    CHECK_EQ(di_backend_mem_info(b, &fr, &tot), DI_ERR_UNSUPPORTED);
    CHECK(fr == 7 && tot == 7);
    di_cpu_backend_set_mem(b, 3000, 4000);
    CHECK_EQ(di_backend_mem_info(b, &fr, &tot), DI_OK);
    CHECK(fr == 3000 && tot == 4000);
    di_cpu_backend_set_mem(b, 1, 0);
    fr = tot = 7;
    CHECK_EQ(di_backend_mem_info(b, &fr, &tot), DI_ERR_UNSUPPORTED);
    CHECK(fr == 7 && tot == 7);
    di_cpu_backend_set_mem(b, 0, 0);
    CHECK_EQ(di_backend_mem_info(b, &fr, &tot), DI_ERR_UNSUPPORTED);
    di_cpu_backend_set_mem(b, 3000, 4000);
    void *g = NULL;
    CHECK_EQ(b->vt->graph_begin(b), DI_OK);
    CHECK_EQ(di_backend_mem_info(b, &fr, &tot), DI_ERR_INVALID);
    CHECK_EQ(b->vt->graph_end(b, &g), DI_ERR_INVALID);
    di_cpu_backend_lose(b, 0);
    CHECK(b->vt->sync(b) == DI_ERR_DEVICE_LOST);
    CHECK_EQ(di_backend_mem_info(b, &fr, &tot), DI_ERR_DEVICE_LOST);
    di_backend_destroy(b);
}

static void test_peer_copy(void) {
    di_backend *b2 = NULL;
    CHECK_EQ(di_cpu_backend_create(1, &b2), DI_OK);
    if (!b2) return;
    enum { N = 1000 };
    uint8_t *src = NULL, *dst = NULL, bounce[N], want[N];
    CHECK_EQ(g_b->vt->alloc(g_b, N, (void **)&src), DI_OK);
    CHECK_EQ(b2->vt->alloc(b2, N, (void **)&dst), DI_OK);
    for (int i = 0; i < N; i++) want[i] = (uint8_t)(i * 37 + 11);
    CHECK_EQ(g_b->vt->upload(g_b, src, want, N), DI_OK);
    CHECK(di_backend_can_peer(b2, g_b) && di_backend_can_peer(g_b, b2));
    CHECK(di_backend_can_peer(g_b, g_b));
    bool peer = false;
    memset(dst, 0, N);
    CHECK_EQ(di_backend_hand_over(b2, dst, g_b, src, N, NULL, &peer), DI_OK);
    CHECK(peer && memcmp(dst, want, N) == 0);
    di_cpu_backend_set_peer(b2, false);
    CHECK(!di_backend_can_peer(b2, g_b) && !di_backend_can_peer(g_b, b2));
    memset(dst, 0, N);
    memset(bounce, 0, N);
    CHECK_EQ(di_backend_hand_over(b2, dst, g_b, src, N, bounce, &peer), DI_OK);
    CHECK(!peer && memcmp(dst, want, N) == 0 && memcmp(bounce, want, N) == 0);
    CHECK_EQ(b2->vt->peer_copy(b2, dst, g_b, src, N), DI_ERR_UNSUPPORTED);
    di_cpu_backend_set_peer(b2, true);
    // Inside a capture of the destination or of the source: refused, the capture fails.
    void *g = NULL;
    CHECK_EQ(b2->vt->graph_begin(b2), DI_OK);
    CHECK_EQ(b2->vt->peer_copy(b2, dst, g_b, src, N), DI_ERR_INVALID);
    CHECK_EQ(b2->vt->graph_end(b2, &g), DI_ERR_INVALID);
    CHECK_EQ(g_b->vt->graph_begin(g_b), DI_OK);
    CHECK_EQ(b2->vt->peer_copy(b2, dst, g_b, src, N), DI_ERR_INVALID);
    CHECK_EQ(g_b->vt->graph_end(g_b, &g), DI_ERR_INVALID);
    // A lost source: refused.
    di_cpu_backend_lose(b2, 0);
    CHECK_EQ(g_b->vt->peer_copy(g_b, src, b2, dst, N), DI_ERR_DEVICE_LOST);
    b2->vt->free(b2, dst);
    g_b->vt->free(g_b, src);
    di_backend_destroy(b2);
}

static void test_topk_offsets(void) {
    // Row 0: ties to the lower index; row 1: k == n_vis selects all (scores unread: NaN);
    // row 2: nothing visible, all padding.
    const float sc[3 * 6] = {1, 3, 3, 0, 3, 2, NAN, NAN, NAN, NAN, NAN, NAN};
    const int32_t n_vis[3] = {6, 2, 0};
    int32_t sel[3 * 3];
    CHECK_EQ(g_b->vt->topk(g_b, sc, 6, n_vis, 3, 3, sel), DI_OK);
    const int32_t want[9] = {1, 2, 4, 0, 1, -1, -1, -1, -1};
    CHECK(memcmp(sel, want, sizeof want) == 0);
    int32_t dst[3 * 5];
    for (int i = 0; i < 15; i++) dst[i] = 99;
    const int32_t base[3] = {100, 200, 300}, off[3] = {2, 0, 1};
    CHECK_EQ(g_b->vt->offset_list(g_b, sel, 3, 3, base, off, NULL, NULL, 0, dst, 5), DI_OK);
    const int32_t want_dst[15] = {99, 99, 101, 102, 104, 200, 201, -1, 99, 99, 99, -1, -1, -1, 99};
    CHECK(memcmp(dst, want_dst, sizeof want_dst) == 0);
    // sel NULL: entries 0..k-1 at base + i (HCA's visible entries).
    CHECK_EQ(g_b->vt->offset_list(g_b, NULL, 3, 2, base, off, NULL, NULL, 0, dst, 5), DI_OK);
    const int32_t want_iota[15] = {99, 99, 100, 101, 104, 200, 201, -1,
                                   99, 99, 99,  300, 301, -1,  99};
    CHECK(memcmp(dst, want_iota, sizeof want_iota) == 0);
    // Paged (2 entries per page): row 0's pages from 0 on (5, 3), row 1's from 2 (7, -1: a
    // missing page), row 2's from 4 (0); entry s -> base + pages[off + s / 2] * 2 + s % 2.
    const int32_t pages[5] = {5, 3, 7, -1, 0}, pg_off[3] = {0, 2, 4};
    const int32_t psel[9] = {0, 1, 3, 1, 2, -1, 1, 0, -1};
    for (int i = 0; i < 15; i++) dst[i] = 99;
    CHECK_EQ(g_b->vt->offset_list(g_b, psel, 3, 3, base, off, pages, pg_off, 2, dst, 5), DI_OK);
    const int32_t want_pg[15] = {99, 99, 110, 111, 107, 215, -1, -1, 99, 99, 99, 301, 300, -1, 99};
    CHECK(memcmp(dst, want_pg, sizeof want_pg) == 0);
    // sel NULL, paged: HCA's entries 0..3 of row 0 through its pages.
    CHECK_EQ(g_b->vt->offset_list(g_b, NULL, 1, 4, base, off, pages, pg_off, 2, dst, 5), DI_OK);
    const int32_t want_pg_iota[4] = {110, 111, 106, 107};
    CHECK(memcmp(dst + 2, want_pg_iota, sizeof want_pg_iota) == 0);
    CHECK_EQ(g_b->vt->offset_list(g_b, NULL, 1, 4, base, off, pages, pg_off, 0, dst, 5),
             DI_ERR_INVALID);
}

// index_scores through a page table equals the contiguous keys it names: keys of 2 rows laid out
// in shuffled pages of 3 entries (one page missing: -inf), against the same keys contiguous.
static void test_index_scores_paged(void) {
    enum { HI = 3, DI = 8, PER = 3, NPG = 4, VIS = 10, T = 2 };
    float qi[T * HI * DI], wi[T * HI], cont[T * 12 * DI], paged[8 * PER * DI];
    for (int i = 0; i < T * HI * DI; i++) qi[i] = (float)((i * 37) % 17 - 8) / 8.0f;
    for (int i = 0; i < T * HI; i++) wi[i] = 0.25f + 0.125f * (float)i;
    for (int i = 0; i < T * 12 * DI; i++) cont[i] = (float)((i * 53) % 29 - 14) / 16.0f;
    // Row t's page j (entries 3j..3j+2) lives in block pages[t * NPG + j].
    const int32_t pages[T * NPG] = {6, 1, 4, 2, 0, 7, -1, 5}, pg_off[T] = {0, NPG};
    memset(paged, 0, sizeof paged);
    for (int t = 0; t < T; t++)
        for (int w = 0; w < 12; w++) {
            int32_t pg = pages[t * NPG + w / PER];
            if (pg >= 0)
                memcpy(paged + ((int64_t)pg * PER + w % PER) * DI, cont + (t * 12 + w) * DI,
                       sizeof(float) * DI);
        }
    const int64_t key_base[T] = {0, 12};
    const int32_t n_vis[T] = {VIS, VIS};
    float sc_c[T * 12], sc_p[T * 12];
    for (int i = 0; i < T * 12; i++) sc_c[i] = sc_p[i] = 42;
    for (int r = 0; r < 2; r++) { // FP32, then BF16 scores
        CHECK_EQ(g_b->vt->index_scores(g_b, qi, wi, cont, key_base, NULL, NULL, 0, n_vis, 12, T, HI,
                                       DI, r == 1, sc_c, 12),
                 DI_OK);
        CHECK_EQ(g_b->vt->index_scores(g_b, qi, wi, paged, NULL, pages, pg_off, PER, n_vis, 12, T,
                                       HI, DI, r == 1, sc_p, 12),
                 DI_OK);
        for (int t = 0; t < T; t++)
            for (int w = 0; w < 12; w++) {
                if (w >= VIS) {
                    CHECK(sc_p[t * 12 + w] == 42); // not visible: not written
                } else if (t == 1 && w / PER == 2) {
                    CHECK(isinf(sc_p[t * 12 + w]) && sc_p[t * 12 + w] < 0); // missing page
                } else {
                    CHECK(memcmp(&sc_p[t * 12 + w], &sc_c[t * 12 + w], sizeof(float)) == 0);
                }
            }
    }
    CHECK_EQ(g_b->vt->index_scores(g_b, qi, wi, paged, NULL, pages, pg_off, 0, n_vis, 12, T, HI, DI,
                                   false, sc_p, 12),
             DI_ERR_INVALID);
}

// index_scores_q4 on Q4 codes gives index_scores' scores on the decoded FP32 keys bit for bit
// (backend.h: each key decoded exactly, then index_scores' arithmetic), contiguous and paged (a
// page missing: -inf), FP32 and BF16 scores: what lets V4's device forward keep the official
// recipe's keys as codes and still equal the CPU forward, which scores the FP32 keys
// (model/dsv4_dev.h). The codes come from pack_rows (the same bytes as di_quant_q4_pack) of
// keys in V4's range after the Hadamard; the widths of the tiny synthetic V4 (4 heads x 128) and
// V4-Flash (64 x 128), more entries than one key chunk (64).
static void index_q4_case(int32_t HI, int32_t DI) {
    enum { T = 3, PER = 5, NPG = 30, VIS = PER * NPG, N_ENT = T * VIS };
    const int64_t kb = di_backend_code_row_bytes(4, DI, DI_BACKEND_KEY_BLOCK);
    float *qi = malloc(sizeof(float) * (size_t)(T * HI * DI)),
          *wi = malloc(sizeof(float) * (size_t)(T * HI)),
          *raw = malloc(sizeof(float) * (size_t)(N_ENT * DI)),
          *dec = malloc(sizeof(float) * (size_t)(N_ENT * DI)),
          *dec_pg = calloc((size_t)(N_ENT * DI), sizeof(float));
    uint8_t *codes = malloc((size_t)(N_ENT * kb)), *ref = malloc((size_t)kb),
            *codes_pg = calloc((size_t)N_ENT, (size_t)kb);
    float sc[2][T * VIS], back[1024];
    if (!qi || !wi || !raw || !dec || !dec_pg || !codes || !ref || !codes_pg) {
        CHECK(false);
        goto done;
    }
    for (int64_t i = 0; i < (int64_t)T * HI * DI; i++) qi[i] = (float)sin((double)i * 0.731) * 1.5f;
    for (int64_t i = 0; i < (int64_t)T * HI; i++) wi[i] = 0.02f + 0.01f * (float)(i % 7);
    for (int64_t i = 0; i < (int64_t)N_ENT * DI; i++) // scales vary by block, a few zero blocks
        raw[i] = (i / DI_BACKEND_KEY_BLOCK) % 11 == 3
                     ? 0.0f
                     : (float)(cos((double)i * 1.37) * exp(0.3 * (double)((i / 32) % 9) - 1.2));
    CHECK_EQ(
        g_b->vt->pack_rows(g_b, raw, N_ENT, DI, DI, DI_BACKEND_KEY_BLOCK, 4, codes, NULL, NULL),
        DI_OK);
    for (int64_t e = 0; e < N_ENT; e++) {
        memcpy(dec + e * DI, raw + e * DI, sizeof(float) * (size_t)DI);
        di_quant_q4_pack(dec + e * DI, DI, DI_BACKEND_KEY_BLOCK, ref); // dec: fake-quantised
        CHECK(memcmp(ref, codes + e * kb, (size_t)kb) == 0);
        di_quant_q4_unpack(codes + e * kb, DI, DI_BACKEND_KEY_BLOCK, back);
        CHECK(memcmp(back, dec + e * DI, sizeof(float) * (size_t)DI) == 0); // exact decode
    }
    // Paged: row t's page j in block pages[t * NPG + j] (a permutation; row 1's page 4 missing).
    int32_t pages[T * NPG], pg_off[T];
    for (int32_t i = 0; i < T * NPG; i++) pages[i] = (i * 37 + 11) % (T * NPG);
    for (int32_t t = 0; t < T; t++) {
        pg_off[t] = t * NPG;
        for (int32_t w = 0; w < VIS; w++) {
            const int64_t r = (int64_t)pages[t * NPG + w / PER] * PER + w % PER, e = t * VIS + w;
            memcpy(codes_pg + r * kb, codes + e * kb, (size_t)kb);
            memcpy(dec_pg + r * DI, dec + e * DI, sizeof(float) * (size_t)DI);
        }
    }
    pages[1 * NPG + 4] = -1;
    const int64_t key_base[T] = {0, VIS, 2 * VIS};
    const int32_t n_vis[T] = {VIS, VIS - 3, 1};
    int64_t differ = 0, n = 0;
    for (int paged = 0; paged < 2; paged++)
        for (int r = 0; r < 2; r++) { // FP32, then BF16 scores
            for (int i = 0; i < T * VIS; i++) sc[0][i] = sc[1][i] = 42;
            const int64_t *kbp = paged ? NULL : key_base;
            const int32_t *pg = paged ? pages : NULL, *po = paged ? pg_off : NULL;
            CHECK_EQ(g_b->vt->index_scores(g_b, qi, wi, paged ? dec_pg : dec, kbp, pg, po,
                                           paged ? PER : 0, n_vis, VIS, T, HI, DI, r == 1, sc[0],
                                           VIS),
                     DI_OK);
            CHECK_EQ(g_b->vt->index_scores_q4(g_b, qi, wi, paged ? codes_pg : codes, kbp, pg, po,
                                              paged ? PER : 0, n_vis, VIS, T, HI, DI, r == 1, sc[1],
                                              VIS),
                     DI_OK);
            differ += memcmp(sc[0], sc[1], sizeof sc[0]) != 0;
            for (int32_t t = 0; t < T; t++)
                for (int32_t w = 0; w < n_vis[t]; w++) n += sc[1][t * VIS + w] > 0;
        }
    CHECK_EQ(differ, 0);
    CHECK(n > 0);                               // the scores are not all zero (ReLU) or -inf
    for (int32_t w = 4 * PER; w < 5 * PER; w++) // the last pass (paged): the missing page
        CHECK(isinf(sc[1][1 * VIS + w]) && sc[1][1 * VIS + w] < 0);
done:
    free(qi), free(wi), free(raw), free(dec), free(dec_pg), free(codes), free(ref), free(codes_pg);
}

static void test_index_scores_q4(void) {
    index_q4_case(4, 128);  // the tiny synthetic V4's indexer
    index_q4_case(64, 128); // V4-Flash's
}

static void test_rows(void) {
    float src[3 * 4], dst[5 * 4] = {0}, z[3 * 2] = {0}, ape[3 * 2];
    for (int i = 0; i < 12; i++) src[i] = (float)i;
    for (int i = 0; i < 6; i++) ape[i] = (float)(10 * i);
    const int32_t rows[2] = {4, 1}, pos[3] = {5, 3, 0};
    // rows 0 and 1 of src (2 of 4 floats each, stride 4) into dst rows 4 and 1.
    CHECK_EQ(g_b->vt->scatter_rows(g_b, src, 2, 4, 2, dst, 4, rows, NULL), DI_OK);
    CHECK(dst[16] == 0 && dst[17] == 1 && dst[4] == 4 && dst[5] == 5 && dst[6] == 0);
    // A gather-scatter: src rows 2 and 0 into dst rows 0 and 3; dst row 2 is padding.
    const int32_t to[3] = {0, -1, 3}, from[3] = {2, 1, 0};
    CHECK_EQ(g_b->vt->scatter_rows(g_b, src, 3, 4, 2, dst, 4, to, from), DI_OK);
    CHECK(dst[0] == 8 && dst[1] == 9 && dst[12] == 0 && dst[13] == 1 && dst[8] == 0);
    CHECK(dst[16] == 0 && dst[4] == 4); // rows not listed keep their values
    CHECK_EQ(g_b->vt->add_ape(g_b, z, 3, 2, 2, ape, pos, 3), DI_OK);
    const float want[6] = {40, 50, 0, 10, 0, 10}; // pos mod 3 = 2, 0, 0
    CHECK(memcmp(z, want, sizeof want) == 0);
    // embed: row ids[t] of an F32 table into every copy.
    float table[3 * 2] = {1, 2, 3, 4, 5, 6}, x[2 * 2 * 2];
    di_tensor t = {.kind = DI_TENSOR_KIND_F32, .ne = {2, 3}, .nb1 = 8, .data = table};
    const int32_t ids[2] = {2, 0};
    CHECK_EQ(g_b->vt->embed(g_b, &t, ids, 2, 2, x), DI_OK);
    const float want_x[8] = {5, 6, 5, 6, 1, 2, 1, 2};
    CHECK(memcmp(x, want_x, sizeof want_x) == 0);
    const int32_t bad[1] = {3};
    CHECK_EQ(g_b->vt->embed(g_b, &t, bad, 1, 2, x), DI_ERR_INVALID);
}

// argmax_rows: each row's pick is the sampler's di_argmax of that row (its AVX2 form from 16
// entries on, its scalar scan below), on rows built to catch every rule: ties in and across
// vector lanes, -0 before +0, -inf rows, NaN rows, a NaN at entry 0 before a larger value, NaNs
// around the maximum, maxima first and last; rows `stride` apart from an odd offset; n_rows 0
// writes nothing; bad shapes refused; a captured call replays on the rows as they are at launch.
static void test_argmax_rows(void) {
    enum { W = 37, N = 10, S = 41 };
    float h[1 + N * S];
    uint64_t z = 99;
    for (int i = 0; i < 1 + N * S; i++) {
        z = z * 6364136223846793005ull + 1442695040888963407ull;
        h[i] = (float)((z >> 40) % 1000) / 250.0f - 2.0f; // [-2, 2): some equal values
    }
    float *r[N];
    for (int k = 0; k < N; k++) r[k] = h + 1 + k * S;
    r[0][20] = r[0][21] = r[0][36] = 5.0f;           // ties in a lane group and past it
    for (int i = 0; i < W; i++) r[1][i] = -INFINITY; // -inf row
    for (int i = 0; i < W; i++) r[2][i] = NAN;       // NaN row
    r[3][0] = NAN, r[3][30] = 9.0f;                  // NaN at 0 wins
    r[4][5] = NAN, r[4][6] = 9.0f, r[4][7] = NAN;    // NaNs never win
    for (int i = 0; i < W; i++) r[5][i] = -1.0f - (float)i;
    r[5][17] = -0.0f, r[5][18] = 0.0f;      // -0 before +0: the first
    r[6][0] = 7.0f, r[6][W - 1] = 7.0f;     // first of two
    r[7][W - 1] = 7.0f;                     // last
    r[8][3] = INFINITY, r[8][2] = INFINITY; // +inf twice
    int32_t ids[N + 1];
    for (int k = 0; k <= N; k++) ids[k] = -5;
    CHECK_EQ(g_b->vt->argmax_rows(g_b, h + 1, N, W, S, ids), DI_OK);
    for (int k = 0; k < N; k++) CHECK_EQ(ids[k], di_argmax(r[k], W));
    CHECK_EQ(ids[N], -5); // past n: not written
    const int32_t want[N - 1] = {20, 0, 0, 0, 6, 17, 0, W - 1, 2};
    for (int k = 0; k < N - 1; k++) CHECK_EQ(ids[k], want[k]);
    CHECK_EQ(g_b->vt->argmax_rows(g_b, h, 0, W, W, ids), DI_OK);
    CHECK_EQ(ids[N], -5);
    CHECK_EQ(g_b->vt->argmax_rows(g_b, h, 1, 0, 1, ids), DI_ERR_INVALID);
    CHECK_EQ(g_b->vt->argmax_rows(g_b, h, 2, W, W - 1, ids), DI_ERR_INVALID);
    // Captured, then replayed after the rows changed: the picks of the rows at launch.
    void *g = NULL;
    CHECK_EQ(g_b->vt->graph_begin(g_b), DI_OK);
    CHECK_EQ(g_b->vt->argmax_rows(g_b, h + 1, N, W, S, ids), DI_OK);
    CHECK_EQ(g_b->vt->graph_end(g_b, &g), DI_OK);
    CHECK_EQ(di_cpu_backend_graph_n_cmds(g), 1);
    r[0][1] = 50.0f, r[9][W - 1] = 50.0f;
    CHECK_EQ(g_b->vt->graph_launch(g_b, g), DI_OK);
    CHECK_EQ(ids[0], 1);
    CHECK_EQ(ids[9], W - 1);
    g_b->vt->graph_destroy(g_b, g);
}

// Padding entries of graph-stable lists: a negative scatter destination moves nothing, a window
// without rows pools to 0.
static void test_padding(void) {
    float src[3 * 2] = {1, 2, 3, 4, 5, 6}, dst[4 * 2] = {0};
    const int32_t rows[3] = {-1, 3, -1};
    CHECK_EQ(g_b->vt->scatter_rows(g_b, src, 3, 2, 2, dst, 2, rows, NULL), DI_OK);
    const float want[8] = {0, 0, 0, 0, 0, 0, 3, 4};
    CHECK(memcmp(dst, want, sizeof want) == 0);
    float c[2 * 4], z[2 * 4], e[2 * 2] = {7, 7, 7, 7};
    for (int i = 0; i < 8; i++) c[i] = (float)i, z[i] = (float)(i % 3);
    // window 0: rows 0 and 1 (c == 1, m == 2); window 1: padding.
    const int32_t srcs[4] = {0, 1, DI_BACKEND_NO_ROW, DI_BACKEND_NO_ROW};
    CHECK_EQ(g_b->vt->compress_pool(g_b, c, z, 4, c, z, srcs, 2, 2, 1, 2, e), DI_OK);
    CHECK(e[2] == 0.0f && e[3] == 0.0f);
    CHECK(e[0] > 0.0f && e[1] > 0.0f);
}

// A small decode-like sequence: matmul with a stack tensor, rmsnorm, rope at device positions,
// attention over a device key list, a scatter to device rows, a copy and a memset.
enum { G_D = 8, G_T = 2, G_KEYS = 6 };
typedef struct gbuf {
    float w[G_D * G_D], x[G_T * G_D], y[G_T * G_D], pool[G_KEYS * G_D], o[G_T * G_D], ring[4 * G_D],
        cp[G_D], omega[G_D / 2], sink[1];
    int32_t key_idx[G_T * G_KEYS], n_keys[G_T], pos[G_T], dst[G_T], src_rows[G_T];
} gbuf;

static di_status g_ops(gbuf *g, float eps) {
    di_backend *b = g_b;
    di_tensor w = {.kind = DI_TENSOR_KIND_F32, .ne = {G_D, G_D}, .nb1 = 4 * G_D, .data = g->w};
    di_status st = b->vt->matmul(b, &w, g->x, G_T, G_D, g->y, G_D);
    if (st == DI_OK) st = b->vt->rmsnorm(b, g->y, G_T, G_D, G_D, NULL, eps);
    if (st == DI_OK) st = b->vt->rope(b, g->y, G_T, G_D, G_D, 4, g->omega, g->pos, 1, 1.0f, false);
    if (st == DI_OK)
        st = b->vt->attn(b, g->y, g->pool, g->key_idx, G_KEYS, g->n_keys, G_KEYS, g->sink, G_T, 1,
                         G_D, 0.5f, true, g->o);
    // The official recipe's ops: recorded and replayed like the others.
    if (st == DI_OK) st = b->vt->round_bf16(b, g->o, G_T * G_D);
    if (st == DI_OK) st = b->vt->fake_quant(b, g->o, G_T, 4, G_D, 4, 8, g->y);
    if (st == DI_OK) st = b->vt->hadamard(b, g->o, G_T, G_D);
    if (st == DI_OK) st = b->vt->fake_quant(b, g->o, G_T, G_D, G_D, 4, 4, g->y);
    if (st == DI_OK)
        st = b->vt->scatter_rows(b, g->o, G_T, G_D, G_D, g->ring, G_D, g->dst, g->src_rows);
    if (st == DI_OK) st = b->vt->copy(b, g->cp, g->o, sizeof g->cp);
    if (st == DI_OK) st = b->vt->memset(b, g->x, 0, sizeof(float) * G_D); // row 0 of x
    return st;
}

// The step's varying inputs, as the host would upload them before a launch.
static void g_fill(gbuf *g, int step) {
    for (int i = 0; i < G_D * G_D; i++) g->w[i] = (float)sin(i * 0.3 + step);
    for (int i = 0; i < G_T * G_D; i++) g->x[i] = (float)cos(i * 0.7 + step);
    for (int i = 0; i < G_KEYS * G_D; i++) g->pool[i] = (float)sin(i * 0.13 - step);
    for (int i = 0; i < G_D / 2; i++) g->omega[i] = 1.0f / (float)(1 + i);
    g->sink[0] = 0.25f;
    for (int t = 0; t < G_T; t++) {
        g->pos[t] = 3 * step + t;
        g->n_keys[t] = 1 + (step + t) % G_KEYS;
        g->dst[t] = (step + t) % 4;
        g->src_rows[t] = (step + t + 1) % G_T; // a gather: rows swap every step
        for (int j = 0; j < G_KEYS; j++) g->key_idx[t * G_KEYS + j] = (j + step) % G_KEYS;
    }
    memset(g->ring, 0, sizeof g->ring);
}

static void test_graph(void) {
    const di_backend_vt *vt = g_b->vt;
    gbuf *a = calloc(1, sizeof *a), *r = calloc(1, sizeof *r); // a: replayed, r: run directly
    void *graph = NULL;
    // Capture on a's memory: nothing runs.
    g_fill(a, 0);
    gbuf before = *a;
    CHECK_EQ(vt->graph_begin(g_b), DI_OK);
    CHECK_EQ(vt->graph_begin(g_b), DI_ERR_INVALID); // one capture at a time
    CHECK_EQ(g_ops(a, 1e-6f), DI_OK);
    CHECK_EQ(vt->graph_end(g_b, &graph), DI_OK);
    CHECK(graph && memcmp(a, &before, sizeof before) == 0);
    // Each step: new data in a's memory (positions, key lists, destinations, weights), then the
    // replay must equal the same calls run directly on the same data.
    for (int step = 0; step < 4; step++) {
        g_fill(a, step);
        g_fill(r, step);
        CHECK_EQ(vt->graph_launch(g_b, graph), DI_OK);
        CHECK_EQ(g_ops(r, 1e-6f), DI_OK);
        CHECK(memcmp(a->o, r->o, sizeof a->o) == 0);
        CHECK(memcmp(a->y, r->y, sizeof a->y) == 0);
        CHECK(memcmp(a->ring, r->ring, sizeof a->ring) == 0);
        CHECK(memcmp(a->cp, r->cp, sizeof a->cp) == 0);
        CHECK(memcmp(a->x, r->x, sizeof a->x) == 0);
    }
    // The scalars are the capture's: a direct run with another eps differs from the replay.
    g_fill(a, 1);
    g_fill(r, 1);
    CHECK_EQ(vt->graph_launch(g_b, graph), DI_OK);
    CHECK_EQ(g_ops(r, 0.5f), DI_OK);
    CHECK(memcmp(a->o, r->o, sizeof a->o) != 0);
    // Device data the replay checks: n_keys beyond the captured max_keys fails the launch.
    a->n_keys[1] = G_KEYS + 1;
    CHECK_EQ(vt->graph_launch(g_b, graph), DI_ERR_INVALID);
    vt->graph_destroy(g_b, graph);
    vt->graph_destroy(g_b, NULL);

    // What a CUDA capture cannot hold is refused, and the capture fails (and is closed).
    void *p = NULL;
    CHECK_EQ(vt->alloc(g_b, 64, &p), DI_OK);
    for (int what = 0; what < 6; what++) {
        float h[4] = {0};
        void *q = NULL;
        graph = NULL;
        CHECK_EQ(vt->graph_begin(g_b), DI_OK);
        switch (what) {
        case 0:
            CHECK_EQ(vt->upload(g_b, p, h, sizeof h), DI_ERR_INVALID);
            break;
        case 1:
            CHECK_EQ(vt->download(g_b, h, p, sizeof h), DI_ERR_INVALID);
            break;
        case 2:
            CHECK_EQ(vt->sync(g_b), DI_ERR_INVALID);
            break;
        case 3:
            CHECK_EQ(vt->alloc(g_b, 64, &q), DI_ERR_INVALID);
            break;
        case 4:
            vt->free(g_b, p);
            break; // refused: p stays valid
        default:
            CHECK_EQ(vt->graph_launch(g_b, &before), DI_ERR_INVALID);
            break;
        }
        CHECK_EQ(vt->graph_end(g_b, &graph), DI_ERR_INVALID);
        CHECK(graph == NULL && q == NULL);
    }
    CHECK_EQ(vt->graph_end(g_b, &graph), DI_ERR_INVALID); // no capture open
    CHECK_EQ(vt->upload(g_b, p, &before, 64), DI_OK);     // closed: everything runs again
    vt->free(g_b, p);
    free(a);
    free(r);
}

// DeepSeek V4.1's ops (backend.h mhc_pre_carried, engram_gate, index_cand, fake_quant's Q4e)
// against their contracts written out as loops: the carried collapse, the coefficients (as
// mhc_pre's), the Engram gate, the candidate pool (block maxima, the newest block forced, ties to
// the lower block, ascending), the mask and the drop of -inf picks; Q4e as di_fake_quant_q4e.
static void test_v41_ops(void) {
    enum { T = 3, NC = 4, D = 40, NMIX = (2 + NC) * NC };
    static float x[T * NC * D], mix[T * NMIX], base[NMIX], pre_in[T * NC], a[T * D], a2[T * D];
    static float pre_out[T * NC], post[T * NC], comb[T * NC * NC], post2[T * NC],
        comb2[T * NC * NC];
    const float scale[3] = {0.7f, 1.1f, 0.9f};
    for (int i = 0; i < T * NC * D; i++) x[i] = (float)sin(i * 0.37) * 2.0f;
    for (int i = 0; i < T * NMIX; i++) mix[i] = (float)cos(i * 0.53);
    for (int i = 0; i < NMIX; i++) base[i] = (float)sin(i * 1.7) * 0.3f;
    for (int i = 0; i < T * NC; i++) pre_in[i] = 0.25f + 0.1f * (float)(i % 5);
    // Collapse only (mix_raw NULL): a = sum_s pre_in[s] x[s] in stream order.
    CHECK_EQ(g_b->vt->mhc_pre_carried(g_b, x, NULL, NULL, NULL, NC, D, T, 20, 1e-6f, 1e-6f, pre_in,
                                      a, NULL, NULL, NULL),
             DI_OK);
    for (int t = 0; t < T; t++)
        for (int d = 0; d < D; d++) {
            float acc = 0;
            for (int s = 0; s < NC; s++) acc += pre_in[t * NC + s] * x[(t * NC + s) * D + d];
            CHECK_EQ(a[t * D + d], acc);
        }
    // With the coefficients: post and comb as mhc_pre's, pre_out its pre (mhc_pre's collapse
    // with pre_out equals the carried collapse with pre_in = pre_out).
    CHECK_EQ(g_b->vt->mhc_pre_carried(g_b, x, mix, base, scale, NC, D, T, 20, 1e-6f, 1e-6f, pre_in,
                                      a, pre_out, post, comb),
             DI_OK);
    CHECK_EQ(g_b->vt->mhc_pre(g_b, x, mix, base, scale, NC, D, T, 20, 1e-6f, 1e-6f, false, a2,
                              post2, comb2),
             DI_OK);
    CHECK(memcmp(post, post2, sizeof post) == 0 && memcmp(comb, comb2, sizeof comb) == 0);
    CHECK_EQ(g_b->vt->mhc_pre_carried(g_b, x, NULL, NULL, NULL, NC, D, T, 20, 1e-6f, 1e-6f, pre_out,
                                      a, NULL, NULL, NULL),
             DI_OK);
    CHECK(memcmp(a, a2, sizeof a) == 0);
    for (int i = 0; i < T * NC; i++) CHECK(pre_out[i] > 0.0f && pre_out[i] < 1.1f);

    // Engram gate.
    static float kv[T * (NC + 1) * D], qk[NC * D], xg[T * NC * D], want[T * NC * D];
    for (int i = 0; i < T * (NC + 1) * D; i++) kv[i] = (float)sin(i * 0.91 + 0.3);
    for (int i = 0; i < NC * D; i++) qk[i] = 0.5f + 0.25f * (float)cos(i * 0.17);
    memcpy(xg, x, sizeof x);
    memcpy(want, x, sizeof x);
    for (int t = 0; t < T; t++)
        for (int s = 0; s < NC; s++) {
            float *h = want + (t * NC + s) * D;
            const float *key = kv + (t * (NC + 1) + s) * D, *val = kv + (t * (NC + 1) + NC) * D;
            float sh = 0, sk = 0, dot = 0;
            for (int d = 0; d < D; d++) {
                sh += h[d] * h[d];
                sk += key[d] * key[d];
                dot += h[d] * qk[s * D + d] * key[d];
            }
            dot *= 1.0f / sqrtf(sh / D + 1e-6f) * (1.0f / sqrtf(sk / D + 1e-6f)) *
                   (1.0f / sqrtf((float)D));
            const float sg = dot > 0 ? 1.0f : dot < 0 ? -1.0f : 0.0f;
            const float g = 1.0f / (1.0f + expf(-(sg * sqrtf(fmaxf(fabsf(dot), 1e-6f)))));
            for (int d = 0; d < D; d++) h[d] = h[d] + g * val[d];
        }
    CHECK_EQ(g_b->vt->engram_gate(g_b, kv, qk, NC, D, T, 1e-6f, xg), DI_OK);
    for (int i = 0; i < T * NC * D; i++) CHECK_NEAR(xg[i], want[i], TOL_OP);

    // Candidate pool: row 0 sees 10 entries in blocks of 3 (blocks 0..3, block 3 the newest),
    // row 1 sees 2 (one block), row 2 sees 9 with a tie between blocks 0 and 2.
    enum { ST = 12, NTB = 2, K = 4 };
    float sc[3 * ST] = {0.1f, 0.9f, 0.2f, 0.3f, 0.4f, 0.35f, 0.95f, 0.0f, 0.1f, 0.2f, 0, 0,
                        0.5f, 0.6f, 0,    0,    0,    0,     0,     0,    0,    0,    0, 0,
                        0.7f, 0.1f, 0.1f, 0.2f, 0.3f, 0.1f,  0.1f,  0.7f, 0.2f, 0,    0, 0};
    const int32_t vis[3] = {10, 2, 9};
    int32_t cand[3 * NTB], n_cand[3];
    float work[3 * (ST / 3 + 1)];
    CHECK_EQ(g_b->vt->index_cand(g_b, DI_BACKEND_CAND_BUILD, sc, ST, vis, 3, 3, NTB, cand, n_cand,
                                 NULL, K, work),
             DI_OK);
    // Row 0: block 3 forced, then block 2 (0.95) ahead of block 0 (0.9); ascending {2, 3}.
    CHECK(n_cand[0] == 2 && cand[0] == 2 && cand[1] == 3);
    CHECK(n_cand[1] == 1 && cand[2] == 0);
    // Row 2: block 2 forced (newest), blocks 0 and 2 tie at 0.7 -> block 0.
    CHECK(n_cand[2] == 2 && cand[4] == 0 && cand[5] == 2);
    float m[3 * ST];
    memcpy(m, sc, sizeof sc);
    CHECK_EQ(g_b->vt->index_cand(g_b, DI_BACKEND_CAND_MASK, m, ST, vis, 3, 3, NTB, cand, n_cand,
                                 NULL, K, NULL),
             DI_OK);
    for (int t = 0; t < 3; t++)
        for (int w = 0; w < ST; w++) {
            bool in = w >= vis[t];
            for (int i = 0; i < n_cand[t]; i++) in |= cand[t * NTB + i] == w / 3;
            CHECK_EQ(m[t * ST + w], in ? sc[t * ST + w] : -INFINITY);
        }
    int32_t sel[3 * K] = {0, 6, 7, 9, 0, 1, -1, -1, 1, 2, 6, 7};
    CHECK_EQ(g_b->vt->index_cand(g_b, DI_BACKEND_CAND_DROP, m, ST, vis, 3, 3, NTB, NULL, NULL, sel,
                                 K, NULL),
             DI_OK);
    const int32_t want_sel[3 * K] = {6, 7, 9, -1, 0, 1, -1, -1, 1, 2, 6, 7};
    CHECK(memcmp(sel, want_sel, sizeof sel) == 0);
    CHECK_EQ(g_b->vt->index_cand(g_b, 7, m, ST, vis, 3, 3, NTB, cand, n_cand, sel, K, work),
             DI_ERR_INVALID);
    CHECK_EQ(g_b->vt->index_cand(g_b, DI_BACKEND_CAND_BUILD, sc, ST, vis, 3, 3, NTB, cand, n_cand,
                                 NULL, K, NULL),
             DI_ERR_INVALID); // BUILD without its scratch

    // Q4e (blocks of 16), in place.
    float q[64], qw[64];
    for (int i = 0; i < 64; i++) q[i] = qw[i] = (float)(sin(i * 0.77) * exp(0.07 * (i % 19)));
    di_fake_quant_q4e(qw, 64, 16);
    CHECK_EQ(g_b->vt->fake_quant(g_b, q, 1, 64, 64, 16, DI_BACKEND_Q4E, q), DI_OK);
    CHECK(memcmp(q, qw, sizeof q) == 0);
}

// Deferred mode (di_cpu_backend_set_deferred, the twin of the CUDA stream's asynchrony): ops,
// memset, copy, free and graph launches wait for the next sync point; upload, download, sync,
// host_free and peer_copy (both backends) are sync points, in stream order; a queued command's
// shape error surfaces at the sync; an armed loss counts entries as they are queued; turning the
// mode off runs the queue.
static void test_deferred(void) {
    di_backend *b = NULL, *b2 = NULL;
    CHECK_EQ(di_cpu_backend_create(1, &b), DI_OK);
    CHECK_EQ(di_cpu_backend_create(1, &b2), DI_OK);
    if (!b || !b2) goto done;
    const di_backend_vt *vt = b->vt;
    di_cpu_backend_set_deferred(b, true);
    di_cpu_backend_set_deferred(b2, true);
    enum { N = 64 };
    float *x = NULL, *y = NULL, *z = NULL, h[N], out[N];
    CHECK_EQ(vt->alloc(b, sizeof h, (void **)&x), DI_OK);
    CHECK_EQ(vt->alloc(b, sizeof h, (void **)&y), DI_OK);
    CHECK_EQ(vt->alloc(b2, sizeof h, (void **)&z), DI_OK);
    if (!x || !y || !z) goto done;
    for (int i = 0; i < N; i++) h[i] = (float)i;
    CHECK_EQ(vt->upload(b, x, h, sizeof h), DI_OK);
    CHECK(memcmp(x, h, sizeof h) == 0); // an upload runs at once (the CUDA one synchronises)
    // Queued: the memory is unchanged until a sync point, which runs the commands in order.
    CHECK_EQ(vt->scale(b, x, N, 2.0f), DI_OK);
    CHECK_EQ(vt->copy(b, y, x, sizeof h), DI_OK);
    CHECK_EQ(vt->scale(b, x, N, 3.0f), DI_OK);
    CHECK(memcmp(x, h, sizeof h) == 0);
    CHECK_EQ(vt->download(b, out, y, sizeof out), DI_OK);
    for (int i = 0; i < N; i++) CHECK_EQ(out[i], 2.0f * (float)i);
    CHECK_EQ(x[5], 30.0f);
    // Host memory an op reads is read at the sync, not at the call (as a kernel reads it late).
    for (int i = 0; i < N; i++) h[i] = 1.0f;
    CHECK_EQ(vt->upload(b, x, h, sizeof h), DI_OK);
    CHECK_EQ(vt->memset(b, y, 0, sizeof h), DI_OK);
    CHECK_EQ(vt->sync(b), DI_OK);
    CHECK_EQ(y[7], 0.0f);
    // An upload is ordered after the queued work: the op reads x before the upload rewrites it.
    CHECK_EQ(vt->copy(b, y, x, sizeof h), DI_OK);
    for (int i = 0; i < N; i++) h[i] = 9.0f;
    CHECK_EQ(vt->upload(b, x, h, sizeof h), DI_OK);
    CHECK_EQ(y[3], 1.0f);
    // peer_copy: after both backends' queued work, before what either queues later.
    CHECK_EQ(vt->scale(b, x, N, 2.0f), DI_OK); // x = 18
    CHECK_EQ(b2->vt->memset(b2, z, 0, sizeof h), DI_OK);
    CHECK_EQ(b2->vt->peer_copy(b2, z, b, x, sizeof h), DI_OK);
    CHECK_EQ(z[0], 18.0f);
    CHECK_EQ(vt->scale(b, x, N, 0.5f), DI_OK);
    CHECK_EQ(z[1], 18.0f);
    CHECK_EQ(x[1], 18.0f);
    // A graph launch is queued too; a free waits for the commands before it.
    void *graph = NULL;
    CHECK_EQ(vt->graph_begin(b), DI_OK);
    CHECK_EQ(vt->scale(b, x, N, 2.0f), DI_OK);
    CHECK_EQ(vt->graph_end(b, &graph), DI_OK);
    CHECK_EQ(di_cpu_backend_graph_n_cmds(graph), 1);
    CHECK_EQ(vt->graph_launch(b, graph), DI_OK); // queued after the 0.5 scale: x = 18
    float *tmp = NULL;
    CHECK_EQ(vt->alloc(b, sizeof h, (void **)&tmp), DI_OK);
    CHECK_EQ(vt->copy(b, tmp, x, sizeof h), DI_OK);
    CHECK_EQ(vt->copy(b, y, tmp, sizeof h), DI_OK);
    vt->free(b, tmp); // after the copies read it (ASan would report a use after free otherwise)
    CHECK_EQ(y[0], 1.0f);
    CHECK_EQ(vt->sync(b), DI_OK);
    CHECK_EQ(y[0], 18.0f);
    CHECK_EQ(x[0], 18.0f);
    // host_free synchronises (cudaFreeHost) like a sync.
    float *hb = NULL;
    CHECK_EQ(vt->host_alloc(b, sizeof h, (void **)&hb), DI_OK);
    CHECK_EQ(vt->memset(b, x, 0, sizeof h), DI_OK);
    vt->host_free(b, hb);
    CHECK_EQ(x[2], 0.0f);
    // A queued command's shape error surfaces at the sync point (a fault of asynchronous work).
    CHECK_EQ(vt->fake_quant(b, x, 1, N, N, 3, 8, y), DI_OK); // block 3 does not divide 64
    CHECK_EQ(vt->sync(b), DI_ERR_INVALID);
    CHECK_EQ(vt->sync(b), DI_OK); // taken
    // Off: the queue runs first.
    CHECK_EQ(vt->memset(b, y, 0, sizeof h), DI_OK);
    di_cpu_backend_set_deferred(b, false);
    CHECK_EQ(y[4], 0.0f);
    CHECK_EQ(vt->scale(b, x, N, 2.0f), DI_OK); // runs at once again
    // An armed loss counts queued entries and graph commands as they are queued.
    di_cpu_backend_set_deferred(b, true);
    di_cpu_backend_lose(b, 2); // the launch and its one command, then lost
    CHECK_EQ(vt->graph_launch(b, graph), DI_OK);
    CHECK_EQ(vt->scale(b, x, N, 2.0f), DI_ERR_DEVICE_LOST);
    CHECK_EQ(vt->sync(b), DI_ERR_DEVICE_LOST);
    vt->graph_destroy(b, graph);
    vt->free(b, x);
    vt->free(b, y);
    b2->vt->free(b2, z);
done:
    di_backend_destroy(b); // the queued frees run
    di_backend_destroy(b2);
}

int main(void) {
    di_device cpu = {.kind = DI_DEVICE_CPU};
    CHECK_EQ(di_backend_open(&cpu, 2, &g_b), DI_OK);
    if (!g_b) return test_finish();
    RUN(test_alloc);
    RUN(test_compress_pool);
    RUN(test_attn);
    RUN(test_official_ops);
    RUN(test_matmul_a8);
    RUN(test_kv_rows);
    RUN(test_topk_offsets);
    RUN(test_index_scores_paged);
    RUN(test_index_scores_q4);
    RUN(test_rows);
    RUN(test_padding);
    RUN(test_graph);
    RUN(test_v41_ops);
    RUN(test_peer_copy);
    RUN(test_argmax_rows);
    RUN(test_mem_info);
    RUN(test_deferred);
    di_backend_destroy(g_b);
    di_backend_destroy(NULL);
    return test_finish();
}
