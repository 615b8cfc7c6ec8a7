// A lost device on the GPU (docs/cuda.md, "Device loss"):
//   (a) the backend: a kernel writing to an illegal address (scale on a bogus device pointer)
//       surfaces at the next sync as DI_ERR_DEVICE_LOST (a sticky error), the device is marked
//       lost (di_cuda_lost) and every entry of the backend refuses with DI_ERR_DEVICE_LOST at
//       once; the backend is destroyed without a crash, di_backend_reset_device (cudaDeviceReset)
//       clears the mark, and a new backend on the device computes again (an upload, scale,
//       download round trip);
//   (b) the serving engine on the device-resident forward (--device cuda, the synthesized tiny
//       V4 model): a device loss injected into its 4th step (di_engine_fail_forward with
//       DI_ERR_DEVICE_LOST: the rebuild runs for real, devices reset and weights uploaded again)
//       ends that step's requests with the loss, every other request finishes, one recovery is
//       counted, and a request run alone afterwards gives the tokens it gives alone on an engine
//       that never failed (the same shapes on the same GPU: bit for bit).
// Exit 77 without a GPU.
#include "harness.h"

#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "backend/backend.h"
#include "backend/cuda/cuda_backend.h"
#include "deepinfer.h"
#include "engine/engine_internal.h" // di_engine_fail_forward
#include "model/synth.h"

static const di_device k_dev0 = {.kind = DI_DEVICE_CUDA, .index = 0};

// An upload, scale by 2, download round trip on b; true when it computed.
static bool round_trip(di_backend *b) {
    enum { N = 4096 };
    static float h[N], back[N];
    for (int i = 0; i < N; i++) h[i] = (float)i;
    void *d = NULL;
    bool ok = b->vt->alloc(b, sizeof h, &d) == DI_OK && b->vt->upload(b, d, h, sizeof h) == DI_OK &&
              b->vt->scale(b, d, N, 2.0f) == DI_OK &&
              b->vt->download(b, back, d, sizeof h) == DI_OK;
    for (int i = 0; ok && i < N; i++) ok = back[i] == 2.0f * (float)i;
    if (d) b->vt->free(b, d);
    return ok;
}

static void test_backend(void) {
    di_backend *b = NULL;
    CHECK_EQ(di_backend_open(&k_dev0, 0, &b), DI_OK);
    if (!b) return;
    CHECK(round_trip(b));
    CHECK(!di_cuda_lost(0));
    // An illegal address: the launch is accepted, the fault surfaces at the sync, sticky.
    di_status st = b->vt->scale(b, (float *)(uintptr_t)0x100, 1 << 20, 2.0f);
    if (st == DI_OK) st = b->vt->sync(b);
    CHECK_EQ(st, DI_ERR_DEVICE_LOST);
    CHECK(di_cuda_lost(0));
    void *p = NULL;
    static float h[16];
    CHECK_EQ(b->vt->alloc(b, 64, &p), DI_ERR_DEVICE_LOST);
    CHECK_EQ(b->vt->sync(b), DI_ERR_DEVICE_LOST);
    CHECK_EQ(b->vt->upload(b, h, h, sizeof h), DI_ERR_DEVICE_LOST);
    CHECK_EQ(b->vt->scale(b, h, 16, 1.0f), DI_ERR_DEVICE_LOST);
    di_backend_destroy(b); // frees what it owns; the device's errors are ignored
    CHECK_EQ(di_backend_reset_device(&k_dev0), DI_OK);
    CHECK(!di_cuda_lost(0));
    b = NULL;
    CHECK_EQ(di_backend_open(&k_dev0, 0, &b), DI_OK);
    if (b) CHECK(round_trip(b));
    di_backend_destroy(b);
    fprintf(stderr, "(a) an illegal address: device lost, refused, reset, computing again\n");
}

// ---- (b) ----

enum { N_REQ = 3, MAX_GEN = 8 };

typedef struct result {
    int32_t tokens[MAX_GEN];
    int32_t n;
    atomic_int finished;
    di_finish finish;
    di_status status;
} result;

static void on_event(void *user, const di_event *ev) {
    result *r = user;
    if (ev->token >= 0 && r->n < MAX_GEN) r->tokens[r->n++] = ev->token;
    if (ev->finish != DI_FINISH_NONE) {
        r->finish = ev->finish;
        r->status = ev->status;
        atomic_fetch_add(&r->finished, 1);
    }
}

static int32_t g_prompt[N_REQ][100];
static const int32_t g_len[N_REQ] = {100, 9, 60};

static void submit(di_engine *e, int i, result *r) {
    memset(r, 0, sizeof *r);
    di_request_params p = di_request_params_default();
    p.prompt = g_prompt[i];
    p.n_prompt = g_len[i];
    p.max_tokens = MAX_GEN;
    p.ignore_eos = true;
    p.on_event = on_event;
    p.user = r;
    uint64_t id;
    CHECK_EQ(di_engine_submit(e, &p, &id), DI_OK);
}

static di_engine *engine(const char *dir) {
    di_engine_options o = di_engine_options_default();
    o.device = k_dev0;
    o.kv_memory_bytes = (size_t)64 << 20;
    o.max_seqs = 3;
    o.max_batch_tokens = 32;
    o.max_ctx = 256;
    di_engine *e = NULL;
    CHECK_EQ(di_engine_create(dir, &o, &e), DI_OK);
    return e;
}

static char g_dir[64];

static void test_engine(void) {
    const char *dir = g_dir;
    static result ref, got[N_REQ], alone;
    di_engine *e = engine(dir); // the reference: request 0 alone
    if (!e) return;
    submit(e, 0, &ref);
    di_engine_wait_idle(e);
    CHECK_EQ(ref.finish, DI_FINISH_LENGTH);
    di_engine_stats st;
    di_engine_get_stats(e, &st);
    CHECK(st.device.resident);
    di_engine_destroy(e);

    e = engine(dir);
    if (!e) return;
    di_engine_fail_forward(e, 3, 1, DI_ERR_DEVICE_LOST);
    for (int i = 0; i < N_REQ; i++) submit(e, i, &got[i]);
    di_engine_wait_idle(e);
    int n_lost = 0;
    for (int i = 0; i < N_REQ; i++) {
        CHECK_EQ(atomic_load(&got[i].finished), 1);
        if (got[i].finish == DI_FINISH_ERROR) {
            CHECK_EQ(got[i].status, DI_ERR_DEVICE_LOST);
            n_lost++;
        } else {
            CHECK_EQ(got[i].finish, DI_FINISH_LENGTH);
        }
    }
    CHECK(n_lost >= 1);
    di_engine_get_stats(e, &st);
    CHECK_EQ(st.n_device_losses, 1);
    CHECK_EQ(st.n_device_recoveries, 1);
    CHECK(!st.unhealthy);
    submit(e, 0, &alone); // alone, as the reference ran it
    di_engine_wait_idle(e);
    CHECK_EQ(alone.finish, DI_FINISH_LENGTH);
    CHECK_EQ(alone.n, ref.n);
    CHECK(!memcmp(alone.tokens, ref.tokens, sizeof(int32_t) * (size_t)ref.n));
    di_engine_get_stats(e, &st);
    CHECK_EQ(st.n_step_allocs, 0);
    fprintf(stderr,
            "(b) engine: an injected loss in step 4 ended %d requests, the device state rebuilt "
            "on the GPU, the same tokens afterwards\n",
            n_lost);
    di_engine_destroy(e);
}

int main(void) {
    if (di_cuda_device_count() == 0) DI_TEST_SKIP("no CUDA device");
    char *dir = g_dir;
    snprintf(g_dir, sizeof g_dir, "/tmp/di_test_cuda_lost_XXXXXX");
    if (!mkdtemp(g_dir)) return 1;
    di_synth_config c;
    CHECK(di_synth_preset("tiny-128", &c) == DI_OK);
    c.n_vocab = 512;
    CHECK(di_synth_write(&c, dir) == DI_OK);
    for (int i = 0; i < N_REQ; i++)
        for (int t = 0; t < 100; t++) g_prompt[i][t] = (int32_t)((t * 37 + i * 11 + 5) % 512);
    di_set_log_level(1);
    RUN(test_backend);
    RUN(test_engine);
    di_test_remove_dir(dir);
    return test_finish();
}
