// CUDA backend structure (backend/cuda/cuda_backend.h): context and description, the caching
// pool (reuse of a freed block, distinct live blocks), upload/download round trips, memset,
// weight upload of a row view (scale rows and row0), op names and supports_op, the CPU fallback of
// an unsupported matmul (odd-length FP4 rows) against di_cpu_matmul, error reporting (an invalid
// launch configuration returns DI_ERR_INVALID / DI_ERR_CUDA, and the context stays usable; a failed
// allocation, a failed cudaSetDevice and a failed capture leave no error for the next launch), the
// copy between two backends (one device twice, two devices: peer or host bounce, ordered between
// the streams), and a CUDA graph of a decode-like sequence replayed against the same launches run
// directly.
#include "backend/cuda/cuda_test.h"

#include "backend/cpu/gemm.h"
#include "backend/cuda/attn.cuh"
#include "backend/cuda/gemm.cuh"
#include "backend/cuda/norm.cuh"
#include "backend/cuda/rope.cuh"
#include "backend/cuda/rows.cuh"
#include "backend/backend.h"
#include "base/thread.h"

static void test_pool(void) {
    void *a = dev_alloc(1000), *b = dev_alloc(1000);
    CHECK(a != b);
    dev_free(a);
    void *c = dev_alloc(900); // same 256-byte class: the freed block comes back
    CHECK(c == a);
    void *big = dev_alloc((size_t)5 << 20);
    uint8_t *h = malloc((size_t)5 << 20), *h2 = malloc((size_t)5 << 20);
    for (size_t i = 0; i < ((size_t)5 << 20); i++) h[i] = (uint8_t)rnd();
    CK(di_cuda_upload(g_cu, big, h, (size_t)5 << 20));
    dev_to(h2, big, (size_t)5 << 20);
    CHECK(memcmp(h, h2, (size_t)5 << 20) == 0);
    CK(di_cuda_memset(g_cu, big, 0xAB, 4096));
    dev_to(h2, big, 4096);
    bool all = true;
    for (int i = 0; i < 4096; i++) all &= h2[i] == 0xAB;
    CHECK(all);
    dev_free(b), dev_free(c), dev_free(big);
    free(h), free(h2);
    CHECK(g_cu->pool_bytes >= ((size_t)5 << 20));
}

static void test_ops_table(void) {
    for (int op = 0; op < DI_CUDA_OP_COUNT; op++) CHECK(strcmp(di_cuda_op_name(op), "?") != 0);
    CHECK(strcmp(di_cuda_op_name(DI_CUDA_OP_COUNT), "?") == 0);
    di_tensor w = {.kind = DI_TENSOR_KIND_FP4, .ne = {33, 4}, .block_in = 32, .block_out = 1};
    CHECK(!di_cuda_supports_op(g_cu, DI_CUDA_OP_MATMUL, &w)); // odd packed row
    w.ne[0] = 64;
    CHECK(di_cuda_supports_op(g_cu, DI_CUDA_OP_MATMUL, &w));
    CHECK(!di_cuda_supports_op(g_cu, DI_CUDA_OP_MATMUL, NULL));
    CHECK(di_cuda_supports_op(g_cu, DI_CUDA_OP_RMSNORM, NULL));
}

// The fallback path: matmul reported unsupported through the debug switch, so an ordinary BF16
// matrix runs through di_cpu_matmul; the result must be the CPU's bits.
static void test_fallback(void) {
    di_pool *pool;
    di_cpu cpu;
    CK(di_pool_create(2, &pool));
    CK(di_cpu_init(&cpu, pool, 256));
    const int64_t n = 64, n_out = 5, T = 3;
    uint16_t data[5 * 64];
    for (size_t i = 0; i < 5 * 64; i++) data[i] = (uint16_t)(0x3C00 + (rnd() & 0x1FF)); // ~1..2
    di_tensor w = {.name = "fallback",
                   .kind = DI_TENSOR_KIND_BF16,
                   .ne = {n, n_out},
                   .nb1 = 2 * (size_t)n,
                   .data = data};
    di_tensor wd;
    CK(di_cuda_tensor_upload(g_cu, &w, &wd));
    float x[3 * 64], y[3 * 5], yr[3 * 5];
    fill_rand(x, T * n, 1.0f);
    di_cpu_matmul(&cpu, &w, x, T, n, yr, n_out);
    float *xd = dev_from(x, sizeof x), *yd = dev_alloc(sizeof y);
    dev_poison(yd, sizeof y);
    g_cu->disabled_ops = 1u << DI_CUDA_OP_MATMUL;
    CHECK(!di_cuda_supports_op(g_cu, DI_CUDA_OP_MATMUL, &w));
    CK(di_cuda_matmul_or_cpu(g_cu, &cpu, &w, &wd, xd, T, n, yd, n_out));
    g_cu->disabled_ops = 0;
    dev_to(y, yd, sizeof y);
    CHECK(memcmp(y, yr, sizeof y) == 0); // the same CPU code: identical bits
    // And the GPU path of the same call agrees to rounding.
    dev_poison(yd, sizeof y);
    CK(di_cuda_matmul_or_cpu(g_cu, &cpu, &w, &wd, xd, T, n, yd, n_out));
    dev_to(y, yd, sizeof y);
    CHECK(rel_l2(y, yr, T * n_out) < 1e-5);
    dev_free(xd), dev_free(yd);
    di_cpu_deinit(&cpu);
    di_pool_destroy(pool);
}

static void test_errors(void) {
    // Refused before launch: shape outside what the kernel supports.
    CHECK(di_cuda_kv_quant(g_cu, NULL, 1, 100, 100, 64, NULL, NULL) == DI_ERR_INVALID);
    CHECK(di_cuda_attn(g_cu, NULL, NULL, NULL, 0, NULL, 1 << 28, NULL, 1, 1, 512, 64, 1.0f, NULL) ==
          DI_ERR_INVALID);
    // A launch the device rejects: more blocks in y than CUDA allows.
    float *x = dev_alloc(64);
    CHECK(di_cuda_rmsnorm(g_cu, x, 0, 16, 16, NULL, 1e-6f) == DI_OK); // zero rows: nothing
    di_status st = di_cuda_softmax(g_cu, x, (int64_t)1 << 40, 16, 16, 1.0f);
    CHECK(st == DI_ERR_CUDA);
    CK(di_cuda_sync(g_cu)); // the context is still usable
    dev_free(x);
}

// A failed cudaMalloc is reported by the allocation and leaves no error behind: the next launch
// check and launch succeed (before, the next launch was reported failed with the allocation's
// error), and the device is not lost (out of memory is not sticky).
static void test_alloc_failure(void) {
    void *p = NULL;
    CHECK_EQ(di_cuda_alloc(g_cu, (size_t)1 << 50, &p), DI_ERR_CUDA); // 1 PiB
    CHECK(p == NULL);
    CHECK_EQ(di_cuda_check_launch("nothing after a failed allocation"), DI_OK);
    CHECK(!di_cuda_lost(g_cu->device));
    float h[64], back[64];
    fill_rand(h, 64, 1.0f);
    float *x = dev_from(h, sizeof h);
    CHECK_EQ(di_cuda_scale(g_cu, x, 64, 2.0f), DI_OK);
    dev_to(back, x, sizeof back);
    for (int i = 0; i < 64; i++) CHECK_EQ(back[i], h[i] * 2.0f);
    dev_free(x);
}

// A runtime call that fails without a kernel (not sticky) is reported by its entry and leaves no
// error for the next launch check: cudaSetDevice on a device that does not exist (the backend's
// entry, through a copy of its context naming device 63), then a capture invalidated by a launch
// that fails inside it and closed by graph_end after a refused entry (cudaStreamEndCapture's
// error). Before, the next launch of any kernel was reported failed with that error (and the
// tensor-core paths' first-call checks turned themselves off on it).
static void test_error_taken(void) {
    di_device dv = {.kind = DI_DEVICE_CUDA, .index = 0};
    di_backend *b = NULL;
    CK(di_backend_open(&dv, 0, &b));
    float h[64], back[64];
    fill_rand(h, 64, 1.0f);
    float *x = NULL;
    CK(b->vt->alloc(b, sizeof h, (void **)&x));
    CK(b->vt->upload(b, x, h, sizeof h));
    di_cuda fake = *(di_cuda *)b->impl;
    fake.device = 63;
    di_backend fb = *b;
    fb.impl = &fake;
    CHECK_EQ(fb.vt->scale(&fb, x, 64, 2.0f), DI_ERR_CUDA); // cudaSetDevice(63) fails
    CHECK_EQ(di_cuda_check_launch("nothing after a failed cudaSetDevice"), DI_OK);
    CHECK(!di_cuda_lost(0));
    CK(b->vt->scale(b, x, 64, 2.0f));
    // A launch the device rejects inside a capture, an entry refused there, then graph_end.
    void *g = NULL;
    CK(b->vt->graph_begin(b));
    CHECK(di_cuda_softmax((di_cuda *)b->impl, x, (int64_t)1 << 40, 16, 16, 1.0f) == DI_ERR_CUDA);
    CHECK_EQ(b->vt->sync(b), DI_ERR_INVALID); // refused: the capture fails
    CHECK_EQ(b->vt->graph_end(b, &g), DI_ERR_INVALID);
    CHECK(g == NULL);
    CHECK_EQ(di_cuda_check_launch("nothing after a failed capture"), DI_OK);
    CK(b->vt->scale(b, x, 64, 0.5f));
    CK(b->vt->download(b, back, x, sizeof back));
    for (int i = 0; i < 64; i++) CHECK_EQ(back[i], h[i]); // x 2 x 0.5: exact
    b->vt->free(b, x);
    di_backend_destroy(b);
}

// The hand-over between two backends (backend.h can_peer / peer_copy, di_backend_hand_over): two
// backends on device 0 (the same device listed twice: a device copy between their streams), and
// devices 0 and 1 when there are two (a peer copy where peer access was enabled, else the host
// bounce). The source is written by a kernel enqueued just before the copy (the copy must wait for
// it) and rewritten right after it (the rewrite must wait for the copy).
static void peer_pair(int d0, int d1) {
    di_device dv0 = {.kind = DI_DEVICE_CUDA, .index = d0},
              dv1 = {.kind = DI_DEVICE_CUDA, .index = d1};
    di_backend *a = NULL, *b = NULL;
    CK(di_backend_open(&dv0, 0, &a));
    CK(di_backend_open(&dv1, 0, &b));
    enum { N = 1 << 20 };
    float *h = malloc(sizeof(float) * N), *back = malloc(sizeof(float) * N), *bounce = NULL;
    CK(a->vt->host_alloc(a, sizeof(float) * N, (void **)&bounce));
    fill_rand(h, N, 1.0f);
    float *src = NULL, *dst = NULL;
    CK(a->vt->alloc(a, sizeof(float) * N, (void **)&src));
    CK(b->vt->alloc(b, sizeof(float) * N, (void **)&dst));
    CK(a->vt->upload(a, src, h, sizeof(float) * N));
    CK(a->vt->scale(a, src, N, 3.0f)); // enqueued, not waited for
    bool peer = false;
    CK(di_backend_hand_over(b, dst, a, src, sizeof(float) * N, bounce, &peer));
    CK(a->vt->scale(a, src, N, 0.0f)); // after the copy
    CK(b->vt->download(b, back, dst, sizeof(float) * N));
    bool same = true;
    for (int i = 0; i < N; i++) same &= back[i] == h[i] * 3.0f;
    fprintf(stderr, "  devices %d -> %d: %s copy, %s\n", d0, d1, peer ? "direct" : "host bounce",
            same ? "equal" : "DIFFERENT");
    CHECK(same);
    if (d0 == d1) CHECK(peer && di_backend_can_peer(b, a));
    CK(a->vt->sync(a));
    CK(b->vt->sync(b));
    a->vt->free(a, src);
    b->vt->free(b, dst);
    a->vt->host_free(a, bounce);
    di_backend_destroy(b);
    di_backend_destroy(a);
    free(h), free(back);
}

static void test_peer_copy(void) {
    peer_pair(0, 0);
    if (di_cuda_device_count() >= 2) {
        peer_pair(0, 1);
        peer_pair(1, 0);
    }
}

// rmsnorm -> rope -> matmul captured once and replayed: same bits as running them directly.
static void test_graph(void) {
    const int64_t n = 512, T = 4, n_out = 300;
    float x[4 * 512], w[512], omega[32], out1[4 * 300], out2[4 * 300];
    int32_t pos[4] = {0, 7, 1000, 65535};
    fill_rand(x, T * n, 1.0f), fill_rand(w, n, 1.0f);
    for (int i = 0; i < 32; i++) omega[i] = powf(10000.0f, -(float)i / 32.0f);
    float *wm = malloc(sizeof(float) * (size_t)(n * n_out));
    fill_rand(wm, n * n_out, 0.05f);
    di_tensor ht = {.name = "g",
                    .kind = DI_TENSOR_KIND_F32,
                    .ne = {n, n_out},
                    .nb1 = 4 * (size_t)n,
                    .data = wm},
              dt;
    CK(di_cuda_tensor_upload(g_cu, &ht, &dt));
    float *xd = dev_alloc(sizeof x), *x0 = dev_from(x, sizeof x), *wd = dev_from(w, sizeof w);
    float *od = dev_from(omega, sizeof omega), *yd = dev_alloc(sizeof out1);
    int32_t *pd = dev_from(pos, sizeof pos);
    for (int pass = 0; pass < 2; pass++) {
        di_cuda_graph *g = NULL;
        if (pass == 1) CK(di_cuda_graph_begin(g_cu));
        CK(di_cuda_copy_d2d(g_cu, xd, x0, sizeof x));
        CK(di_cuda_rmsnorm(g_cu, xd, T, n, n, wd, 1e-6f));
        CK(di_cuda_rope(g_cu, xd, T, n, n, 64, od, pd, 1, 1.0f, false));
        CK(di_cuda_matmul(g_cu, &dt, xd, T, n, yd, n_out));
        if (pass == 1) {
            CK(di_cuda_graph_end(g_cu, &g));
            dev_poison(yd, sizeof out2);
            for (int r = 0; r < 3; r++) CK(di_cuda_graph_launch(g_cu, g));
        }
        dev_to(pass ? out2 : out1, yd, sizeof out1);
        di_cuda_graph_destroy(g);
    }
    CHECK(memcmp(out1, out2, sizeof out1) == 0);
    bool finite = true;
    for (int i = 0; i < 4 * 300; i++) finite &= isfinite(out1[i]);
    CHECK(finite);
    dev_free(xd), dev_free(x0), dev_free(wd), dev_free(od), dev_free(yd), dev_free(pd);
    free(wm);
}

// The sticky classes (di_cuda_error_is_sticky, no device needed: checked before the device test
// skips): driver_types.h's values, so the test needs no CUDA header. Before, an exception
// contained by the GPU (226: peer memory over NVLink), a tensor-memory leak (721) and a
// terminated MPS client (810), after which every call fails, were plain DI_ERR_CUDA: the device
// was not marked lost and the engine did not rebuild.
static void test_sticky_classes(void) {
    static const int sticky[] = {700, 702, 214, 715, 716, 717, 718, 714,
                                 710, 719, 709, 911, 226, 721, 220, 810};
    static const int plain[] = {0, 1, 2, 101, 98, 209, 701, 900, 901, 904, 905, 704, 4, 3, 999};
    for (size_t i = 0; i < sizeof sticky / sizeof *sticky; i++) {
        if (!di_cuda_error_is_sticky(sticky[i])) fprintf(stderr, "  %d: not sticky\n", sticky[i]);
        CHECK(di_cuda_error_is_sticky(sticky[i]));
    }
    for (size_t i = 0; i < sizeof plain / sizeof *plain; i++) {
        if (di_cuda_error_is_sticky(plain[i])) fprintf(stderr, "  %d: sticky\n", plain[i]);
        CHECK(!di_cuda_error_is_sticky(plain[i]));
    }
}

int main(void) {
    RUN(test_sticky_classes);
    if (g_checks_failed) return test_finish();
    cuda_test_init();
    RUN(test_pool);
    RUN(test_ops_table);
    RUN(test_fallback);
    RUN(test_errors);
    RUN(test_alloc_failure);
    RUN(test_error_taken);
    RUN(test_peer_copy);
    RUN(test_graph);
    return cuda_test_finish();
}
