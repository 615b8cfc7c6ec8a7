// The product path to the GPU: di_model_options.device / di_engine_options.device = cuda:0 (what
// `deepinfer logits|generate|bench|serve --device cuda` pass), through di_model_load, which opens
// the device and attaches the offload as the model's matmul hook (backend/device.h), against the
// same model on the CPU, on the committed tiny fixture (official FP8/FP4 layout, and the HF BF16
// one for the logits):
//   - logits of a 64-token prefill and 3 decode steps within 1e-3 of the largest logit (the FP32
//     recipe; the official recipe has its own, looser bound: TOL_LOGITS_OFFICIAL);
//   - greedy generation through a session: the same tokens;
//   - the serving engine (ragged batched forward on its forward thread, 4 requests of different
//     lengths at once): the same greedy tokens as the engine on the CPU, and again with MTP
//     speculation (spec_tokens 1: the device-resident forward's MTP block, verify rows and
//     rollback on the GPU);
//   - DeepSeek V4.1 (the tiny synthesized model): its sessions on the device-resident V4.1
//     forward, logits in range in both recipes; the serving engine on it (the V4.1 device-resident
//     engine: resident, no failed step, no CPU weight matmul) against the CPU V4.1 engine: the
//     same greedy tokens where the CPU's top-two margin exceeds twice the V4.1 logits bound
//     (TOL_LOGITS_OFFICIAL of the largest logit: a closer race may go either way there);
//   - the device's stats (matmuls run, none declined, weights uploaded) and a device index that
//     does not exist refused with DI_ERR_UNSUPPORTED by di_model_load and di_engine_create;
//   - pipeline stages (docs/cuda.md "Several GPUs: pipeline stages"): the logits, session and
//     engine checks again with the device list cuda:0,0 (two stages on one GPU) and, with two
//     GPUs, cuda:0,1, against the CPU; the stages in di_model_describe; the V4.1 checks (sessions
//     in both recipes, the serving engine) on the same lists, its stages described (layers [0, 3)
//     and [3, 6): the byte-optimal cut); a V4.1 list of 7 stages (more than its 6 layers)
//     refused with DI_ERR_INVALID, a list naming a missing device with
//     DI_ERR_UNSUPPORTED.
// Greedy tokens are compared up to the first step whose CPU top-two margin is within twice the
// logits bound (2e-3 of the largest logit): a closer race may legitimately go either way.
// Needs the full library (config and checkpoint loading): built by CMake with DI_CUDA, run by
// scripts/gpu-check where jansson/PCRE2/zlib exist.
#include "backend/cuda/cuda_test.h"

#include <stdlib.h> // mkdtemp
#include <string.h>

#include "deepinfer.h"
#include "model/synth.h" // di_synth_v41_write

#define TOL_LOGITS 1e-3
// The official recipe (R-OFF) rounds to BF16 and quantises to e4m3 / e2m1 between the ops, so a
// value whose FP32 sum differs from the CPU's in the last bits (the GPU sums in another order)
// can round to the neighbouring grid point, and this tiny random-weight model amplifies such
// flips from layer to layer and position to position. Measured on the CPU twin (the dev forward
// on the CPU backend, tests/model/test_dev_forward.c) with every matmul output perturbed by -1..2
// FP32 ulps, this file's prefill + decodes on the tiny fixture: FP32 recipe 1.2e-6 of
// max|logit|, R-OFF 0.22 (0.115 RMS, top-1 token equal on 52 of 67 rows); without perturbation
// both are bit-identical. So no logits bound separates a correct R-OFF GPU forward from one that
// drops a rounding point (that mutation measured 0.39 on the CPU twin); this bound only checks
// that the path runs and stays in range. The R-OFF arithmetic is checked where it is exact: each
// rounding point bit-for-bit against tensor/quant_ref.c (test_cuda_ops), and the orchestration
// bit-for-bit on the CPU twin (test_dev_forward (h)).
#define TOL_LOGITS_OFFICIAL 0.5
enum { T_PRE = 64, N_DEC = 3, N_GEN = 16, N_REQ = 4, ENGINE_GEN = 12 };

static char g_dir[4096];
static double g_logit_scale;   // max |logit| of the CPU prefill: the tie margins' scale
static double g_logit_scale41; // the same for the V4.1 tiny model (FP32 recipe)
// The device every GPU load and engine uses: cuda:0, or a device list (test_stages).
static di_device g_dev = {.kind = DI_DEVICE_CUDA, .index = 0};

static di_model *load(const char *dir, bool cuda, di_precision prec) {
    di_model_options mo = di_model_options_default();
    mo.n_threads = 2;
    mo.precision = prec;
    if (cuda) mo.device = g_dev;
    di_model *m = NULL;
    di_status st = di_model_load(dir, &mo, &m);
    CHECK_EQ(st, DI_OK);
    return st == DI_OK ? m : NULL;
}

// Prefill of T_PRE tokens, then N_DEC single tokens: logits [T_PRE + N_DEC, V].
static bool run_logits(di_model *m, int32_t V, float *logits) {
    int32_t ids[T_PRE + N_DEC];
    for (int32_t i = 0; i < T_PRE + N_DEC; i++) ids[i] = (int32_t)((i * 7919 + 13) % V);
    di_session *s = NULL;
    if (di_session_create(m, NULL, &s) != DI_OK) return false;
    di_forward_out fo = {.logits = logits};
    bool ok = di_session_forward(s, ids, T_PRE, &fo) == DI_OK;
    for (int32_t i = 0; i < N_DEC && ok; i++) {
        di_forward_out fd = {.logits = logits + (int64_t)(T_PRE + i) * V};
        ok = di_session_forward(s, ids + T_PRE + i, 1, &fd) == DI_OK;
    }
    di_session_destroy(s);
    return ok;
}

// The logits of the model in dir on the GPU and the CPU; v41: the tiny V4.1 model, whose sessions
// run on the device-resident V4.1 forward (model/dsv41_dev.h; asserted), its quantisers (Q8
// window rows, Q4 index keys, Q4e entries) in both recipes: TOL_LOGITS_OFFICIAL's reasoning
// applies, the bound only checks that the path runs and stays in range (the arithmetic is
// checked bit for bit on the CPU twin, tests/model/test_dev41_forward.c).
static void logits_dir(const char *dir, di_precision prec, bool v41, const char *what) {
    di_model *cpu = load(dir, false, prec), *gpu = load(dir, true, prec);
    if (!cpu || !gpu) goto done;
    di_model_info info;
    di_model_get_info(gpu, &info);
    CHECK_EQ(info.device.kind, DI_DEVICE_CUDA);
    const int32_t V = info.n_vocab;
    const int64_t n = (int64_t)(T_PRE + N_DEC) * V;
    float *ref = malloc(sizeof(float) * (size_t)n), *out = malloc(sizeof(float) * (size_t)n);
    for (int64_t i = 0; i < n; i++) out[i] = NAN;
    CHECK(run_logits(cpu, V, ref));
    CHECK(run_logits(gpu, V, out));
    const double e_pre = test_rel_err(out, ref, (int64_t)T_PRE * V);
    const double e_dec =
        test_rel_err(out + (int64_t)T_PRE * V, ref + (int64_t)T_PRE * V, (int64_t)N_DEC * V);
    di_model_get_info(gpu, &info);
    const di_device_stats *ds = &info.device_stats;
    fprintf(stderr,
            "  %s: %lld GPU matmuls (%lld declined), %lld weights (%.1f MB); prefill %.3g, "
            "decode %.3g of max|logit|\n",
            what, (long long)ds->n_matmuls, (long long)ds->n_declined, (long long)ds->n_weights,
            ds->weight_bytes / 1e6, e_pre, e_dec);
    if (v41) { // the V4.1 forward on its own backend: the offload's counters are not its
        CHECK(ds->resident);
    } else {
        CHECK(ds->n_matmuls > 0);
        CHECK_EQ(ds->n_declined, 0);
        CHECK(ds->n_weights > 0 && ds->weight_bytes > 0);
    }
    const double tol = prec == DI_PRECISION_OFFICIAL || v41 ? TOL_LOGITS_OFFICIAL : TOL_LOGITS;
    CHECK(e_pre <= tol);
    CHECK(e_dec <= tol);
    di_model_get_info(cpu, &info);
    CHECK_EQ(info.device_stats.n_matmuls, 0); // the CPU model has no device
    double *scale = v41 ? &g_logit_scale41 : &g_logit_scale;
    if (*scale == 0 && prec == DI_PRECISION_FP32)
        for (int64_t i = 0; i < (int64_t)T_PRE * V; i++)
            if (fabs(ref[i]) > *scale) *scale = fabs(ref[i]);
    free(ref), free(out);
done:
    di_model_destroy(gpu);
    di_model_destroy(cpu);
}

static void logits_case(const char *rel, di_precision prec, const char *what) {
    char dir[4096];
    test_src_path(rel, dir, sizeof dir);
    logits_dir(dir, prec, false, what);
}

static void test_logits(void) {
    logits_case("tests/data/fixtures/tiny/official", DI_PRECISION_FP32,
                "tiny fixture (official FP8/FP4), fp32 recipe");
    logits_case("tests/data/fixtures/tiny/official", DI_PRECISION_OFFICIAL,
                "tiny fixture (official FP8/FP4), official recipe");
    logits_case("tests/data/fixtures/tiny/hf", DI_PRECISION_FP32, "tiny fixture (HF, BF16)");
}

// Greedy tokens (ties to the lower id) after a prompt; margin[i]: top-1 minus top-2 logit.
static bool greedy(di_model *m, int32_t V, const int32_t *prompt, int32_t n_prompt, int32_t *tok,
                   float *margin) {
    float *lg = malloc(sizeof(float) * (size_t)V);
    di_session *s = NULL;
    bool ok = lg && di_session_create(m, NULL, &s) == DI_OK;
    di_forward_out fo = {.logits = lg, .last_only = true};
    ok = ok && di_session_forward(s, prompt, n_prompt, &fo) == DI_OK;
    for (int32_t i = 0; i < N_GEN && ok; i++) {
        int32_t best = 0, second = -1;
        for (int32_t v = 1; v < V; v++) {
            if (lg[v] > lg[best]) {
                second = best;
                best = v;
            } else if (second < 0 || lg[v] > lg[second]) {
                second = v;
            }
        }
        tok[i] = best;
        margin[i] = lg[best] - lg[second];
        if (i + 1 < N_GEN) ok = di_session_forward(s, &best, 1, &fo) == DI_OK;
    }
    di_session_destroy(s);
    free(lg);
    return ok;
}

// Number of leading tokens that must agree: up to the first near tie on the CPU.
static int32_t decided(const float *margin, int32_t n) {
    int32_t k = 0;
    while (k < n && margin[k] > 2 * TOL_LOGITS * g_logit_scale) k++;
    return k;
}

// DeepSeek V4.1 (the tiny synthesized model, official layout) through --device cuda: its sessions
// on the device-resident V4.1 forward, both recipes.
static void engine_v41(const char *dir);

static void test_v41(void) {
    char dir[] = "/tmp/di_test_cuda_v41_XXXXXX";
    CHECK(mkdtemp(dir) != NULL);
    CHECK_EQ(di_synth_v41_write(dir, true, false, 41), DI_OK);
    logits_dir(dir, DI_PRECISION_FP32, true, "V4.1 tiny (official layout), fp32 recipe");
    logits_dir(dir, DI_PRECISION_OFFICIAL, true, "V4.1 tiny (official layout), official recipe");
    engine_v41(dir);
    di_test_remove_dir(dir);
}

static void test_generate(void) {
    di_model *cpu = load(g_dir, false, DI_PRECISION_FP32),
             *gpu = load(g_dir, true, DI_PRECISION_FP32);
    if (!cpu || !gpu) goto done;
    di_model_info info;
    di_model_get_info(cpu, &info);
    const int32_t prompt[5] = {5, 17, 300, 42, 7};
    int32_t t_cpu[N_GEN], t_gpu[N_GEN];
    float m_cpu[N_GEN], m_gpu[N_GEN];
    CHECK(greedy(cpu, info.n_vocab, prompt, 5, t_cpu, m_cpu));
    CHECK(greedy(gpu, info.n_vocab, prompt, 5, t_gpu, m_gpu));
    const int32_t k = decided(m_cpu, N_GEN);
    fprintf(stderr, "  greedy: %d of %d tokens decided (scale %.3g), first %d %d %d\n", k, N_GEN,
            g_logit_scale, t_cpu[0], t_cpu[1], t_cpu[2]);
    CHECK(k > 0);
    for (int32_t i = 0; i < k; i++) CHECK_EQ(t_gpu[i], t_cpu[i]);
done:
    di_model_destroy(gpu);
    di_model_destroy(cpu);
}

typedef struct result {
    int32_t tokens[ENGINE_GEN];
    float margin[ENGINE_GEN]; // top-1 minus top-2 logprob (= their logits' difference)
    int32_t n;
    bool finished;
} result;

static void on_event(void *user, const di_event *ev) {
    result *r = user;
    if (ev->token >= 0 && r->n < ENGINE_GEN) {
        r->margin[r->n] = ev->n_top >= 2 ? ev->top_logprobs[0] - ev->top_logprobs[1] : INFINITY;
        r->tokens[r->n++] = ev->token;
    }
    if (ev->finish != DI_FINISH_NONE) r->finished = true;
}

// N_REQ greedy requests (prompts of 5, 17, 33 and 64 tokens) submitted together; spec: MTP drafts
// per verify (0: off).
static bool engine_run_dir(const char *dir, bool cuda, int32_t spec, result *res,
                           di_engine_stats *st) {
    di_engine_options o = di_engine_options_default();
    o.n_threads = 2;
    o.spec_tokens = spec;
    if (cuda) o.device = g_dev;
    di_engine *e = NULL;
    di_status s = di_engine_create(dir, &o, &e);
    CHECK_EQ(s, DI_OK);
    if (s != DI_OK) return false;
    static const int32_t lens[N_REQ] = {5, 17, 33, 64};
    int32_t prompt[N_REQ][64];
    bool ok = true;
    for (int r = 0; r < N_REQ; r++) {
        for (int32_t i = 0; i < lens[r]; i++)
            prompt[r][i] = (int32_t)((i * 131 + r * 17 + 3) % 512);
        memset(&res[r], 0, sizeof res[r]);
        di_request_params p = di_request_params_default();
        p.prompt = prompt[r];
        p.n_prompt = lens[r];
        p.max_tokens = ENGINE_GEN;
        p.ignore_eos = true;
        p.sample.n_logprobs = 2;
        p.on_event = on_event;
        p.user = &res[r];
        uint64_t id;
        ok &= di_engine_submit(e, &p, &id) == DI_OK;
    }
    di_engine_wait_idle(e);
    di_engine_get_stats(e, st);
    di_engine_destroy(e);
    return ok;
}

static bool engine_run(bool cuda, int32_t spec, result *res, di_engine_stats *st) {
    return engine_run_dir(g_dir, cuda, spec, res, st);
}

// The GPU's tokens equal the CPU's up to each request's first step whose CPU margin is within
// min_margin (a near tie); how many compared.
static int32_t compare_tokens_margin(const result *cpu, const result *gpu, double min_margin) {
    int32_t compared = 0;
    for (int r = 0; r < N_REQ; r++) {
        CHECK(cpu[r].finished && gpu[r].finished);
        CHECK_EQ(cpu[r].n, ENGINE_GEN);
        CHECK_EQ(gpu[r].n, ENGINE_GEN);
        int32_t k = 0;
        while (k < cpu[r].n && cpu[r].margin[k] > min_margin) k++;
        for (int32_t i = 0; i < k; i++) CHECK_EQ(gpu[r].tokens[i], cpu[r].tokens[i]);
        compared += k;
    }
    return compared;
}

static int32_t compare_tokens(const result *cpu, const result *gpu) {
    return compare_tokens_margin(cpu, gpu, 2 * TOL_LOGITS * g_logit_scale);
}

// The serving engine on the V4.1 device-resident forward (--device cuda on a V4.1 checkpoint)
// against the CPU V4.1 engine: the requests of test_engine (FP32 recipe). V4.1's logits bound is
// TOL_LOGITS_OFFICIAL in both recipes (its window rows, entries and index keys are quantised in
// both), so only tokens decided by more than twice it must agree; the device-resident path itself
// is checked bit for bit on the CPU twin (tests/unit/test_engine_dev41.c).
static void engine_v41(const char *dir) {
    result cpu[N_REQ], gpu[N_REQ];
    di_engine_stats st_cpu, st_gpu;
    CHECK(engine_run_dir(dir, false, 0, cpu, &st_cpu));
    CHECK(engine_run_dir(dir, true, 0, gpu, &st_gpu));
    const int32_t compared =
        compare_tokens_margin(cpu, gpu, 2 * TOL_LOGITS_OFFICIAL * g_logit_scale41);
    int32_t n_equal = 0;
    for (int r = 0; r < N_REQ; r++)
        for (int32_t i = 0; i < gpu[r].n && i < cpu[r].n; i++)
            n_equal += gpu[r].tokens[i] == cpu[r].tokens[i];
    fprintf(stderr,
            "  V4.1 engine: %s; %d of %d tokens equal to the CPU V4.1 engine's (%d decided beyond "
            "the bound, all equal); %lld steps (%lld failed)\n",
            st_gpu.device.resident ? "device-resident forward" : "CPU forward with offload",
            n_equal, N_REQ * ENGINE_GEN, compared, (long long)st_gpu.n_steps,
            (long long)st_gpu.n_failed_steps);
    CHECK(st_gpu.device.resident); // the V4.1 dev forward, not the CPU forward with the offload
    CHECK(!st_cpu.device.resident);
    CHECK_EQ(st_gpu.n_failed_steps, 0);
    CHECK_EQ(st_gpu.weight_macs, 0); // no weight matmul on the CPU
}

static void test_engine(void) {
    result cpu[N_REQ], gpu[N_REQ], spec[N_REQ];
    di_engine_stats st_cpu, st_gpu, st_spec;
    CHECK(engine_run(false, 0, cpu, &st_cpu));
    CHECK(engine_run(true, 0, gpu, &st_gpu));
    const int32_t compared = compare_tokens(cpu, gpu);
    fprintf(stderr,
            "  engine: %d of %d tokens decided and equal; %lld steps (%lld failed) on the %s, "
            "%lld GPU matmuls (%lld declined), %lld weights (%.1f MB)\n",
            compared, N_REQ * ENGINE_GEN, (long long)st_gpu.n_steps,
            (long long)st_gpu.n_failed_steps,
            st_gpu.device.resident ? "device-resident forward" : "CPU forward with offload",
            (long long)st_gpu.device.n_matmuls, (long long)st_gpu.device.n_declined,
            (long long)st_gpu.device.n_weights, st_gpu.device.weight_bytes / 1e6);
    CHECK(compared > 0);
    // The FP32 V4 fixture gets the device-resident forward (di_model_load attaches it): no
    // matmul goes through the offload hook; without it, every matmul does.
    CHECK(st_gpu.device.resident || st_gpu.device.n_matmuls > 0);
    CHECK_EQ(st_gpu.n_failed_steps, 0);
    CHECK_EQ(st_gpu.device.n_declined, 0);
    CHECK_EQ(st_cpu.device.n_matmuls, 0);
    CHECK(!st_cpu.device.resident);
    // On the GPU the CPU ran no weight matmul.
    CHECK_EQ(st_gpu.weight_macs, 0);
    // MTP speculation on the GPU: the tokens of plain decoding (bit for bit on one backend: the
    // CPU twin's tests; here within the CPU's decided steps), drafts verified.
    CHECK(engine_run(true, 1, spec, &st_spec));
    const int32_t compared_spec = compare_tokens(cpu, spec);
    fprintf(stderr,
            "  engine with MTP speculation (%s): %d of %d tokens decided and equal; %lld verifies, "
            "%lld drafts accepted; %lld steps (%lld failed)\n",
            st_spec.spec_drafter ? st_spec.spec_drafter : "none", compared_spec, N_REQ * ENGINE_GEN,
            (long long)st_spec.n_spec_verifies, (long long)st_spec.n_spec_accepted,
            (long long)st_spec.n_steps, (long long)st_spec.n_failed_steps);
    CHECK(compared_spec > 0);
    CHECK(st_spec.n_spec_verifies > 0);
    CHECK_EQ(st_spec.n_failed_steps, 0);
    CHECK_EQ(st_spec.weight_macs, 0);
}

// A device that does not exist: a clear error from load and engine create, no crash.
static void test_missing_device(void) {
    di_model_options mo = di_model_options_default();
    mo.device = (di_device){.kind = DI_DEVICE_CUDA, .index = di_cuda_device_count()};
    di_model *m = NULL;
    CHECK_EQ(di_model_load(g_dir, &mo, &m), DI_ERR_UNSUPPORTED);
    CHECK(m == NULL);
    di_engine_options eo = di_engine_options_default();
    eo.device = mo.device;
    di_engine *e = NULL;
    CHECK_EQ(di_engine_create(g_dir, &eo, &e), DI_ERR_UNSUPPORTED);
    CHECK(e == NULL);
    mo.device.index = -1;
    CHECK_EQ(di_model_load(g_dir, &mo, &m), DI_ERR_INVALID);
}

// Pipeline stages: the product checks on cuda:0,0 (and cuda:0,1 with two GPUs), the stages
// described, what a list refuses.
static void test_stages(void) {
    const int32_t n_gpu = di_cuda_device_count();
    const di_device lists[2] = {{.kind = DI_DEVICE_CUDA, .index = 0, .n_more = 1, .more = {0}},
                                {.kind = DI_DEVICE_CUDA, .index = 0, .n_more = 1, .more = {1}}};
    for (int i = 0; i < (n_gpu >= 2 ? 2 : 1); i++) {
        g_dev = lists[i];
        fprintf(stderr, "  -- two pipeline stages on cuda:0,%d --\n", (int)g_dev.more[0]);
        test_logits();
        test_generate();
        test_engine();
        di_model *m = load(g_dir, true, DI_PRECISION_FP32);
        if (m) {
            char desc[8192];
            di_model_describe(m, desc, sizeof desc);
            CHECK(strstr(desc, "pipeline stage 0") != NULL);
            CHECK(strstr(desc, "pipeline stage 1") != NULL);
        }
        di_model_destroy(m);
        test_v41(); // the V4.1 device-resident forward as two stages
    }
    g_dev = lists[0];
    char dir[] = "/tmp/di_test_cuda_v41_XXXXXX";
    CHECK(mkdtemp(dir) != NULL);
    CHECK_EQ(di_synth_v41_write(dir, true, false, 41), DI_OK);
    di_model_options mo = di_model_options_default();
    mo.device = g_dev;
    di_model *m = NULL;
    CHECK_EQ(di_model_load(dir, &mo, &m), DI_OK);
    if (m) {
        char desc[8192];
        di_model_describe(m, desc, sizeof desc);
        // The split the stages' memory chose (docs/cuda.md "The split"): whatever the cut, the
        // lines name the attached stages' layers and bytes per block.
        const char *s0 = strstr(desc, "pipeline stage 0  layers [0, ");
        int a = -1;
        CHECK(s0 && sscanf(s0, "pipeline stage 0  layers [0, %d) + embedding", &a) == 1);
        char want[96];
        snprintf(want, sizeof want, "pipeline stage 1  layers [%d, 6) + head", a);
        CHECK(a > 0 && a < 6);
        CHECK(strstr(desc, want) != NULL);
        CHECK(strstr(desc, "bytes per entry block") != NULL);
    }
    di_model_destroy(m);
    m = NULL;
    mo.device =
        (di_device){.kind = DI_DEVICE_CUDA, .index = 0, .n_more = 6, .more = {0, 0, 0, 0, 0, 0}};
    CHECK_EQ(di_model_load(dir, &mo, &m), DI_ERR_INVALID); // 7 stages, 6 layers
    CHECK(m == NULL);
    mo.device = g_dev;
    di_test_remove_dir(dir);
    mo.device.more[0] = n_gpu; // a stage on a device that does not exist
    CHECK_EQ(di_model_load(g_dir, &mo, &m), DI_ERR_UNSUPPORTED);
    CHECK(m == NULL);
    g_dev = (di_device){.kind = DI_DEVICE_CUDA, .index = 0};
}

int main(void) {
    cuda_test_init();
    test_src_path("tests/data/fixtures/tiny/official", g_dir, sizeof g_dir);
    RUN(test_logits);
    RUN(test_generate);
    RUN(test_v41);
    RUN(test_engine);
    RUN(test_missing_device);
    RUN(test_stages);
    return cuda_test_finish();
}
