// The whole V4 forward with every matmul on the GPU (backend/cuda/offload.cuh through the model's
// accelerator hook, model/dsv4.h di_dsv4_matmul) against the same forward on the CPU: the tiny
// fixture (tests/data/fixtures/tiny: all three layer kinds, hash and score MoE, MTP) in its HF
// layout (BF16) and its official layout (FP8 128x128, FP4 experts) in both precision recipes, and
// a synthesized official-layout tiny model with the real 129,280-token vocabulary; a 64-token
// prefill (tiled GEMM) then 3 single-token decode steps (gemv), logits within 1e-3 of the largest
// logit (the acceptance bound). Needs the full library (config and checkpoint loading):
// built by CMake with DI_CUDA, not by scripts/gpu-check's plain build unless the device has jansson
// (see docs/cuda.md).
#include "backend/cuda/cuda_test.h"

#include <sys/stat.h>
#include <unistd.h>

#include "backend/cuda/offload.cuh"
#include "model/dsv4.h"
#include "model/synth.h"

// The acceptance bound for whole-model logits (max |d| / max |ref|). The GPU sums every
// matmul in another order than the CPU (FP32 rounding, ~1e-6 relative per product); through 6
// layers and the head that stays orders of magnitude below 1e-3.
#define TOL_LOGITS 1e-3

// Prefill of T tokens, then n_dec single tokens: logits [T + n_dec, V] (all rows).
static bool run(di_model *m, bool mtp, const int32_t *ids, int32_t T, int32_t n_dec,
                float *logits) {
    di_session_options so = di_session_options_default();
    so.mtp = mtp;
    di_session *s = NULL;
    if (di_session_create(m, &so, &s) != DI_OK) return false;
    const int64_t V = m->hp.n_vocab;
    bool ok = true;
    di_forward_out fo = {.logits = logits};
    ok &= di_session_forward(s, ids, T, &fo) == DI_OK;
    for (int32_t i = 0; i < n_dec && ok; i++) {
        di_forward_out fd = {.logits = logits + (int64_t)(T + i) * V};
        ok &= di_session_forward(s, ids + T + i, 1, &fd) == DI_OK;
    }
    di_session_destroy(s);
    return ok;
}

static void model_case(const char *dir, di_precision prec, const char *what) {
    di_model_options mo = di_model_options_default();
    mo.n_threads = 2;
    mo.precision = prec;
    di_model *m = NULL;
    CHECK(di_model_load(dir, &mo, &m) == DI_OK);
    if (!m) return;
    const int32_t T = 64, n_dec = 3;
    const int64_t V = m->hp.n_vocab, n = (int64_t)(T + n_dec) * V;
    int32_t ids[67];
    for (int32_t i = 0; i < T + n_dec; i++) ids[i] = (int32_t)((i * 7919 + 13) % V);
    const bool mtp = m->n_mtp_loaded > 0;
    float *ref = malloc(sizeof(float) * (size_t)n), *out = malloc(sizeof(float) * (size_t)n);
    CHECK(run(m, mtp, ids, T, n_dec, ref));

    di_cuda_offload *o = NULL;
    CK(di_cuda_offload_create(g_cu, &o));
    m->accel_matmul = di_cuda_offload_matmul;
    m->accel_user = o;
    for (int64_t i = 0; i < n; i++) out[i] = NAN;
    CHECK(run(m, mtp, ids, T, n_dec, out));
    m->accel_matmul = NULL;
    di_cuda_offload_stats st;
    di_cuda_offload_get_stats(o, &st);
    const double e_pre = test_rel_err(out, ref, (int64_t)T * V);
    const double e_dec =
        test_rel_err(out + (int64_t)T * V, ref + (int64_t)T * V, (int64_t)n_dec * V);
    fprintf(stderr,
            "  %s: %lld GPU matmuls (%lld declined), %lld weights (%.1f MB) uploaded; "
            "prefill %.3g, decode %.3g of max|logit|\n",
            what, (long long)st.n_calls, (long long)st.n_declined, (long long)st.n_weights,
            st.weight_bytes / 1e6, e_pre, e_dec);
    CHECK(st.n_calls > 0);
    CHECK(st.n_declined == 0);
    CHECK(e_pre <= TOL_LOGITS);
    CHECK(e_dec <= TOL_LOGITS);
    di_cuda_offload_destroy(o);
    free(ref), free(out);
    di_model_destroy(m);
}

static void test_fixture(void) {
    char dir[4096];
    test_src_path("tests/data/fixtures/tiny/hf", dir, sizeof dir);
    model_case(dir, DI_PRECISION_FP32, "tiny fixture (HF, BF16)");
    test_src_path("tests/data/fixtures/tiny/official", dir, sizeof dir);
    model_case(dir, DI_PRECISION_FP32, "tiny fixture (official FP8/FP4), fp32 recipe");
    model_case(dir, DI_PRECISION_OFFICIAL, "tiny fixture (official FP8/FP4), official recipe");
}

static void test_synth_official(void) {
    char dir[] = "/tmp/di_cuda_model_XXXXXX";
    CHECK(mkdtemp(dir) != NULL);
    di_synth_config cfg;
    CHECK(di_synth_preset("tiny", &cfg) == DI_OK);
    cfg.official = true;
    CHECK(di_synth_write(&cfg, dir) == DI_OK);
    model_case(dir, DI_PRECISION_FP32, "synth tiny (official FP8/FP4, V=129280)");
    char path[4200];
    snprintf(path, sizeof path, "%s/config.json", dir);
    unlink(path);
    snprintf(path, sizeof path, "%s/model.safetensors", dir);
    unlink(path);
    rmdir(dir);
}

int main(void) {
    cuda_test_init();
    RUN(test_fixture);
    RUN(test_synth_official);
    return cuda_test_finish();
}
