// Checkpoint binding: random-weight checkpoints in both layouts load; every kind of broken
// checkpoint (missing, extra, misshapen, wrong-dtype tensors, missing scales, bad expert ids,
// truncated files, config mismatches) is refused with DI_ERR_FORMAT / DI_ERR_IO, never a crash.
#include "harness.h"

#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

#include "io/safetensors.h"
#include "model/dsv4.h"
#include "model/synth.h"

static char g_root[256];

static void make_dir(char *out, const char *name) {
    snprintf(out, 512, "%s/%s", g_root, name);
    mkdir(out, 0755);
}

static void copy_file(const char *from, const char *to) {
    FILE *a = fopen(from, "rb"), *b = fopen(to, "wb");
    char buf[65536];
    size_t n;
    while (a && b && (n = fread(buf, 1, sizeof buf, a)) > 0) fwrite(buf, 1, n, b);
    if (a) fclose(a);
    if (b) fclose(b);
}

static di_status try_load(const char *dir) {
    di_model_options o = di_model_options_default();
    o.n_threads = 1;
    di_model *m = NULL;
    di_status st = di_model_load(dir, &o, &m);
    if (st == DI_OK) {
        // A loaded model must also run.
        di_session *s = NULL;
        int32_t ids[5] = {1, 2, 3, 4, 5};
        float *lg = malloc(sizeof(float) * (size_t)m->hp.n_vocab);
        di_forward_out fo = {.logits = lg, .last_only = true};
        CHECK(di_session_create(m, NULL, &s) == DI_OK);
        CHECK(di_session_forward(s, ids, 5, &fo) == DI_OK);
        CHECK(isfinite(lg[0]));
        free(lg);
        di_session_destroy(s);
    }
    di_model_destroy(m);
    return st;
}

typedef enum mutation {
    MUT_DROP,      // remove tensor `name`
    MUT_EXTRA,     // add an unknown tensor
    MUT_SHAPE,     // change the first dim of `name`
    MUT_DTYPE,     // store `name` as I32
    MUT_BAD_BYTES, // overwrite `name`'s data with 0xFF bytes
} mutation;

// Writes base/model.safetensors with one mutation into a new dir (config.json copied).
static void mutate(const char *base, const char *dir, mutation mu, const char *name) {
    char path[1024];
    snprintf(path, sizeof path, "%s/model.safetensors", base);
    di_st_file *f = NULL;
    CHECK(di_st_file_open(path, &f) == DI_OK);
    int64_t n = di_st_file_n_tensors(f);
    di_st_write_tensor *t = calloc((size_t)n + 1, sizeof *t);
    void *junk = NULL;
    int64_t k = 0;
    bool found = mu == MUT_EXTRA;
    for (int64_t i = 0; i < n; i++) {
        const di_st_tensor *s = di_st_file_tensor(f, i);
        bool hit = name && strcmp(s->name, name) == 0;
        found |= hit;
        if (hit && mu == MUT_DROP) continue;
        di_st_write_tensor w = {
            .name = s->name, .dtype = s->dtype, .n_dims = s->n_dims, .data = s->data};
        memcpy(w.shape, s->shape, sizeof w.shape);
        if (hit && mu == MUT_SHAPE) {
            // same byte count, different shape: [a, b] -> [a*b] (1-D) or [x] -> [x/2, 2]
            if (s->n_dims >= 2)
                w.n_dims = 1, w.shape[0] = s->n_elements;
            else
                w.n_dims = 2, w.shape[0] = s->shape[0] / 2, w.shape[1] = 2;
        }
        if (hit && mu == MUT_DTYPE) {
            w.dtype = DI_DTYPE_I32;
            w.n_dims = 1;
            w.shape[0] = (int64_t)(s->n_bytes / 4);
        }
        if (hit && mu == MUT_BAD_BYTES) {
            junk = malloc(s->n_bytes);
            memset(junk, 0xFF, s->n_bytes);
            w.data = junk;
        }
        t[k++] = w;
    }
    CHECK(found);
    static const float extra[4] = {1, 2, 3, 4};
    if (mu == MUT_EXTRA)
        t[k++] = (di_st_write_tensor){.name = "layers.0.attn.surprise",
                                      .dtype = DI_DTYPE_F32,
                                      .n_dims = 1,
                                      .shape = {4},
                                      .data = extra};
    char out[1024], cfg_from[1024], cfg_to[1024];
    snprintf(out, sizeof out, "%s/model.safetensors", dir);
    CHECK(di_st_write_file(out, t, k) == DI_OK);
    snprintf(cfg_from, sizeof cfg_from, "%s/config.json", base);
    snprintf(cfg_to, sizeof cfg_to, "%s/config.json", dir);
    copy_file(cfg_from, cfg_to);
    free(junk);
    free(t);
    di_st_file_close(f);
}

static void expect_refused(const char *base, const char *tag, mutation mu, const char *name) {
    char dir[512];
    make_dir(dir, tag);
    mutate(base, dir, mu, name);
    di_status st = try_load(dir);
    if (st != DI_ERR_FORMAT) fprintf(stderr, "case %s: status %d\n", tag, st);
    CHECK_EQ(st, DI_ERR_FORMAT);
}

static void test_layouts(void) {
    char off[512], hf[512];
    di_synth_config c;
    CHECK(di_synth_preset("tiny", &c) == DI_OK);
    c.n_vocab = 512; // small and fast
    make_dir(off, "official");
    CHECK(di_synth_write(&c, off) == DI_OK);
    CHECK_EQ(try_load(off), DI_OK);
    c.official = false;
    make_dir(hf, "hf");
    CHECK(di_synth_write(&c, hf) == DI_OK);
    CHECK_EQ(try_load(hf), DI_OK);

    // official layout
    expect_refused(off, "drop_wq_a", MUT_DROP, "layers.1.attn.wq_a.weight");
    expect_refused(off, "drop_scale", MUT_DROP, "layers.1.attn.wq_a.scale");
    expect_refused(off, "drop_expert", MUT_DROP, "layers.3.ffn.experts.7.w2.weight");
    expect_refused(off, "drop_expert_scale", MUT_DROP, "layers.3.ffn.experts.7.w2.scale");
    expect_refused(off, "drop_indexer", MUT_DROP, "layers.1.attn.indexer.compressor.ape");
    expect_refused(off, "drop_tid2eid", MUT_DROP, "layers.0.ffn.gate.tid2eid");
    expect_refused(off, "drop_mtp_part", MUT_DROP, "mtp.0.hnorm.weight");
    expect_refused(off, "extra", MUT_EXTRA, NULL);
    expect_refused(off, "shape_norm", MUT_SHAPE, "layers.2.attn_norm.weight");
    expect_refused(off, "shape_wkv", MUT_SHAPE, "layers.2.attn.wkv.weight");
    expect_refused(off, "shape_scale", MUT_SHAPE, "layers.2.attn.wkv.scale");
    expect_refused(off, "shape_ape", MUT_SHAPE, "layers.2.attn.compressor.ape");
    expect_refused(off, "dtype_norm", MUT_DTYPE, "norm.weight");
    expect_refused(off, "dtype_fp8", MUT_DTYPE, "layers.0.attn.wo_b.weight");
    expect_refused(off, "dtype_scale", MUT_DTYPE, "layers.0.attn.wo_b.scale");
    expect_refused(off, "tid2eid_range", MUT_BAD_BYTES, "layers.1.ffn.gate.tid2eid");
    // hf layout
    expect_refused(hf, "hf_drop_gate_up", MUT_DROP, "model.layers.2.mlp.experts.gate_up_proj");
    expect_refused(hf, "hf_shape_down", MUT_SHAPE, "model.layers.2.mlp.experts.down_proj");
    expect_refused(hf, "hf_drop_sinks", MUT_DROP, "model.layers.4.self_attn.sinks");
    expect_refused(hf, "hf_extra", MUT_EXTRA, NULL);
    expect_refused(hf, "hf_drop_head", MUT_DROP, "lm_head.weight");
}

// A config that does not match the tensors, and files that are not there or cut short.
static void test_config_mismatch_and_truncation(void) {
    char off[512], dir[512], path[1024];
    snprintf(off, sizeof off, "%s/official", g_root);
    make_dir(dir, "mismatch");
    mutate(off, dir, MUT_EXTRA, NULL); // then fix by rewriting config with other widths
    snprintf(path, sizeof path, "%s/model.safetensors", off);
    char to[1024];
    snprintf(to, sizeof to, "%s/model.safetensors", dir);
    copy_file(path, to);
    snprintf(to, sizeof to, "%s/config.json", dir);
    FILE *f = fopen(to, "r+");
    char cfg[8192] = {0};
    size_t n = fread(cfg, 1, sizeof cfg - 1, f);
    fclose(f);
    char *p = strstr(cfg, "\"moe_intermediate_size\": 128");
    CHECK(p != NULL);
    if (p) memcpy(p, "\"moe_intermediate_size\": 256", 28);
    f = fopen(to, "w");
    fwrite(cfg, 1, n, f);
    fclose(f);
    CHECK_EQ(try_load(dir), DI_ERR_FORMAT);

    // truncated checkpoint
    make_dir(dir, "truncated");
    snprintf(to, sizeof to, "%s/config.json", dir);
    snprintf(path, sizeof path, "%s/config.json", off);
    copy_file(path, to);
    snprintf(path, sizeof path, "%s/model.safetensors", off);
    snprintf(to, sizeof to, "%s/model.safetensors", dir);
    copy_file(path, to);
    struct stat sb;
    stat(to, &sb);
    CHECK(truncate(to, sb.st_size - 1000) == 0);
    CHECK_EQ(try_load(dir), DI_ERR_FORMAT);
    CHECK(truncate(to, 5) == 0);
    CHECK_EQ(try_load(dir), DI_ERR_FORMAT);
    unlink(to);
    CHECK_EQ(try_load(dir), DI_ERR_IO); // no weights at all
    make_dir(dir, "empty");
    CHECK_EQ(try_load(dir), DI_ERR_IO); // no config.json
}

// The benchmark presets' fast random codes (di_synth_config.fast): "flash-full[-<N>l]" parses, and
// a fast-coded checkpoint loads and runs (finite logits, every layer kind, both FP8 and FP4), and
// two writes of one config are byte-identical (chunked generators, whatever the threads do).
static void test_fast_codes(void) {
    di_synth_config c;
    CHECK(di_synth_preset("flash-full", &c) == DI_OK);
    CHECK_EQ(c.n_layer, 2);
    CHECK_EQ(c.n_expert, 256);
    CHECK_EQ(c.n_mtp, 0);
    CHECK(c.fast);
    CHECK_EQ(c.ratios[0], 4);
    CHECK_EQ(c.ratios[1], 128);
    CHECK(di_synth_preset("flash-full-3l", &c) == DI_OK);
    CHECK_EQ(c.n_layer, 3);
    CHECK_EQ(c.ratios[2], 4);
    CHECK(di_synth_preset("flash-full-0l", &c) == DI_ERR_INVALID);
    CHECK(di_synth_preset("flash-full-65l", &c) == DI_ERR_INVALID);
    CHECK(di_synth_preset("flash-full-2", &c) == DI_ERR_INVALID);
    CHECK(di_synth_preset("flash-full-2lx", &c) == DI_ERR_INVALID);
    CHECK(di_synth_preset("flash-fullx", &c) == DI_ERR_INVALID);

    CHECK(di_synth_preset("tiny", &c) == DI_OK);
    c.n_vocab = 512;
    c.fast = true;
    char a[512], b[512], pa[1024], pb[1024];
    make_dir(a, "fast_a");
    make_dir(b, "fast_b");
    CHECK(di_synth_write(&c, a) == DI_OK);
    CHECK(di_synth_write(&c, b) == DI_OK);
    CHECK_EQ(try_load(a), DI_OK);
    snprintf(pa, sizeof pa, "%s/model.safetensors", a);
    snprintf(pb, sizeof pb, "%s/model.safetensors", b);
    FILE *fa = fopen(pa, "rb"), *fb = fopen(pb, "rb");
    CHECK(fa && fb);
    bool same = fa && fb;
    int ca = 0, cb = 0;
    while (same && (ca = fgetc(fa)) != EOF) same = (cb = fgetc(fb)) == ca;
    if (same && fb) same = fgetc(fb) == EOF;
    CHECK(same);
    if (fa) fclose(fa);
    if (fb) fclose(fb);
}

int main(void) {
    snprintf(g_root, sizeof g_root, "/tmp/di_test_weights_XXXXXX");
    if (!mkdtemp(g_root)) return 1;
    RUN(test_layouts);
    RUN(test_config_mismatch_and_truncation);
    RUN(test_fast_codes);
    di_test_remove_dir(g_root);
    return test_finish();
}
