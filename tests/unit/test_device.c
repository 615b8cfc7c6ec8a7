// device (src/backend/device.c, di_model_options.device) on the CPU: the default is the CPU and
// runs no device; malformed devices (and device lists: too long, a negative ordinal, a list on
// the CPU) are refused with DI_ERR_INVALID; in a build without the CUDA
// backend a CUDA device is refused with DI_ERR_UNSUPPORTED by di_device_check, di_model_load and
// di_engine_create (cleanly: no model or engine is returned, nothing leaks under ASan). The split
// into pipeline stages of a V4 and of a V4.1 model (di_model_stage_split: V4.1 at any cut, the
// byte-optimal split; more stages than layers refused). A CUDA build runs the device itself in
// tests/backend/cuda/test_cuda_device.c (label cuda).
#include "harness.h"

#include "deepinfer.h"

static char g_dir[4096];

static void test_defaults(void) {
    CHECK_EQ(di_model_options_default().device.kind, DI_DEVICE_CPU);
    CHECK_EQ(di_engine_options_default().device.kind, DI_DEVICE_CPU);
    di_device cpu = {.kind = DI_DEVICE_CPU};
    CHECK_EQ(di_device_check(&cpu), DI_OK);
    di_model_options mo = di_model_options_default();
    mo.n_threads = 1;
    di_model *m = NULL;
    CHECK_EQ(di_model_load(g_dir, &mo, &m), DI_OK);
    if (!m) return;
    di_model_info info;
    di_model_get_info(m, &info);
    CHECK_EQ(info.device.kind, DI_DEVICE_CPU);
    CHECK_EQ(info.device_stats.n_matmuls, 0);
    CHECK_EQ(info.device_stats.n_weights, 0);
    char desc[4096];
    di_model_describe(m, desc, sizeof desc);
    CHECK(strstr(desc, "device            cpu\n") != NULL);
    di_model_destroy(m);
}

static void test_invalid(void) {
    di_device bad_kind = {.kind = (di_device_kind)7},
              bad_index = {.kind = DI_DEVICE_CUDA, .index = -1};
    CHECK_EQ(di_device_check(&bad_kind), DI_ERR_INVALID);
    CHECK_EQ(di_device_check(&bad_index), DI_ERR_INVALID);
    di_model_options mo = di_model_options_default();
    mo.device = bad_index;
    di_model *m = NULL;
    CHECK_EQ(di_model_load(g_dir, &mo, &m), DI_ERR_INVALID);
    CHECK(m == NULL);
    // Device lists (pipeline stages): up to DI_DEVICE_MAX_MORE more non-negative ordinals, CUDA
    // only. The zero value of the new fields is one device (checked by test_defaults' loads).
    di_device too_many = {.kind = DI_DEVICE_CUDA, .n_more = DI_DEVICE_MAX_MORE + 1},
              negative = {.kind = DI_DEVICE_CUDA, .n_more = 2, .more = {1, -1}},
              below = {.kind = DI_DEVICE_CUDA, .n_more = -1},
              cpu_list = {.kind = DI_DEVICE_CPU, .n_more = 1, .more = {1}};
    CHECK_EQ(di_device_check(&too_many), DI_ERR_INVALID);
    CHECK_EQ(di_device_check(&negative), DI_ERR_INVALID);
    CHECK_EQ(di_device_check(&below), DI_ERR_INVALID);
    CHECK_EQ(di_device_check(&cpu_list), DI_ERR_INVALID);
    mo.device = negative;
    CHECK_EQ(di_model_load(g_dir, &mo, &m), DI_ERR_INVALID);
    CHECK(m == NULL);
    mo.device = cpu_list;
    CHECK_EQ(di_model_load(g_dir, &mo, &m), DI_ERR_INVALID);
    CHECK(m == NULL);
}

static void test_cuda_without_backend(void) {
    di_device cuda = {.kind = DI_DEVICE_CUDA, .index = 0};
    if (di_device_check(&cuda) == DI_OK) {
        fprintf(stderr, "  this build has the CUDA backend: see test_cuda_device\n");
        return;
    }
    CHECK_EQ(di_device_check(&cuda), DI_ERR_UNSUPPORTED);
    di_model_options mo = di_model_options_default();
    mo.device = cuda;
    di_model *m = NULL;
    CHECK_EQ(di_model_load(g_dir, &mo, &m), DI_ERR_UNSUPPORTED);
    CHECK(m == NULL);
    di_engine_options eo = di_engine_options_default();
    eo.device = cuda;
    di_engine *e = NULL;
    CHECK_EQ(di_engine_create(g_dir, &eo, &e), DI_ERR_UNSUPPORTED);
    CHECK(e == NULL);
    // A list (cuda:0,1: two pipeline stages) is refused the same way.
    di_device list = {.kind = DI_DEVICE_CUDA, .index = 0, .n_more = 1, .more = {1}};
    CHECK_EQ(di_device_check(&list), DI_ERR_UNSUPPORTED);
    mo.device = list;
    CHECK_EQ(di_model_load(g_dir, &mo, &m), DI_ERR_UNSUPPORTED);
    CHECK(m == NULL);
    eo.device = list;
    CHECK_EQ(di_engine_create(g_dir, &eo, &e), DI_ERR_UNSUPPORTED);
    CHECK(e == NULL);
}

// di_model_stage_split on the V4 tiny model (6 layers, every cut) and on the V4.1 tiny one
// (v41-tiny: ratios 0 2 2 1 1 1, kv sources 1 and 3, the candidate source 3: any cut, DSpark and
// the embedding copy on the last stage), di_model_stage_plan's KV-aware split on unequal
// memories; a V4.1 model with a device list takes the build's refusal as V4 does.
static void test_stage_split(void) {
    di_model_options mo = di_model_options_default();
    mo.n_threads = 1;
    di_model *m = NULL;
    int32_t l0[9];
    int64_t bytes[8];
    CHECK_EQ(di_model_load(g_dir, &mo, &m), DI_OK);
    if (!m) return;
    CHECK_EQ(di_model_stage_split(m, 6, l0, bytes), DI_OK);
    for (int k = 0; k <= 6; k++) CHECK_EQ(l0[k], k);
    CHECK_EQ(di_model_stage_split(m, 7, l0, bytes), DI_ERR_INVALID);
    di_model_destroy(m);
    char dir[256];
    snprintf(dir, sizeof dir, "/tmp/di_test_device_v41_XXXXXX");
    CHECK(mkdtemp(dir) != NULL);
    CHECK_EQ(di_synth_checkpoint("v41-tiny", dir, true, 7), DI_OK);
    m = NULL;
    mo.dev_ctx = 256; // the KV-aware split's plan: sequences of 16 blocks of 16 positions
    CHECK_EQ(di_model_load(dir, &mo, &m), DI_OK);
    if (m) {
        CHECK_EQ(di_model_stage_split(m, 1, l0, bytes), DI_OK);
        const int64_t total = bytes[0];
        // With stages the last one holds a copy of the embedding besides DSpark's blocks (its
        // drafts' rows): the same bytes more on 2 and on 3 stages.
        CHECK_EQ(di_model_stage_split(m, 2, l0, bytes), DI_OK);
        CHECK(l0[0] == 0 && l0[1] == 3 && l0[2] == 6);
        const int64_t sum2 = bytes[0] + bytes[1];
        CHECK(sum2 > total);
        CHECK_EQ(di_model_stage_split(m, 3, l0, bytes), DI_OK);
        CHECK(l0[0] == 0 && l0[1] == 2 && l0[2] == 5 && l0[3] == 6); // cuts inside both sources
        CHECK_EQ(bytes[0] + bytes[1] + bytes[2], sum2);
        // The KV-aware split (di_model_stage_plan): without memory the weight balance; a second
        // device just too small for the weight split's last stage, its state and one sequence
        // moves the cut; too little for any split is refused.
        di_stage_plan sp[3];
        int64_t n_blocks = 0;
        CHECK_EQ(di_model_stage_plan(m, 3, NULL, sp, &n_blocks), DI_OK);
        CHECK(sp[0].layer1 == 2 && sp[1].layer1 == 5 && n_blocks == -1 && sp[2].n_blocks == -1);
        CHECK_EQ(di_model_stage_plan(m, 2, NULL, sp, &n_blocks), DI_OK);
        const size_t reserve = DI_DEV_RESERVE_DEFAULT_BYTES;
        const int64_t one = 256 / 16;
        size_t fr[2] = {reserve + ((size_t)1 << 30),
                        reserve + (size_t)(sp[1].weight_bytes + sp[1].fixed_bytes +
                                           one * sp[1].block_bytes - 1)};
        CHECK_EQ(di_model_stage_plan(m, 2, fr, sp, &n_blocks), DI_OK);
        CHECK(sp[0].layer1 != 3 && n_blocks >= one &&
              sp[1].budget_bytes + (int64_t)reserve == (int64_t)fr[1]);
        CHECK(n_blocks == (sp[0].n_blocks < sp[1].n_blocks ? sp[0].n_blocks : sp[1].n_blocks));
        fr[1] = reserve + 1000;
        CHECK_EQ(di_model_stage_plan(m, 2, fr, sp, &n_blocks), DI_ERR_NOMEM);
        CHECK_EQ(di_model_stage_split(m, 6, l0, bytes), DI_OK); // once refused: 2 legal cuts
        for (int k = 0; k <= 6; k++) CHECK_EQ(l0[k], k);
        CHECK_EQ(di_model_stage_split(m, 7, l0, bytes), DI_ERR_INVALID);
        char desc[8192];
        di_model_describe(m, desc, sizeof desc);
        CHECK(strstr(desc, "pipeline stage") == NULL); // no list: no stages to describe
        di_model_destroy(m);
    }
    di_device list = {.kind = DI_DEVICE_CUDA, .index = 0, .n_more = 1, .more = {0}};
    if (di_device_check(&list) != DI_OK) {
        mo.device = list;
        m = NULL;
        CHECK_EQ(di_model_load(dir, &mo, &m), DI_ERR_UNSUPPORTED);
        CHECK(m == NULL);
    }
    di_test_remove_dir(dir);
}

int main(void) {
    test_src_path("tests/data/fixtures/tiny/official", g_dir, sizeof g_dir);
    RUN(test_defaults);
    RUN(test_invalid);
    RUN(test_cuda_without_backend);
    RUN(test_stage_split);
    return test_finish();
}
