// config.json parsing: the released V4-Flash configs (HF and official inference names), the
// RoPE frequency tables of spec §6.5, and clear errors for malformed configs.
#include "harness.h"

#include <stdlib.h>
#include <fcntl.h>
#include <unistd.h>

#include "deepinfer.h"
#include "model/hparams.h"

static void check_flash(const di_hparams *hp) {
    CHECK_EQ(hp->n_vocab, 129280);
    CHECK_EQ(hp->n_embd, 4096);
    CHECK_EQ(hp->n_layer, 43);
    CHECK_EQ(hp->n_mtp, 1);
    CHECK_EQ(hp->n_head, 64);
    CHECK_EQ(hp->head_dim, 512);
    CHECK_EQ(hp->q_lora_rank, 1024);
    CHECK_EQ(hp->o_groups, 8);
    CHECK_EQ(hp->o_lora_rank, 1024);
    CHECK_EQ(hp->window, 128);
    CHECK_EQ(hp->n_expert, 256);
    CHECK_EQ(hp->n_expert_used, 6);
    CHECK_EQ(hp->expert_ff, 2048);
    CHECK_EQ(hp->index_topk, 512);
    CHECK_NEAR(hp->route_scale, 1.5, 0);
    CHECK_NEAR(hp->swiglu_limit, 10.0, 0);
    // schedule: 0,1 SWA; even >= 2 CSA; odd >= 3 HCA(128); MTP (43) SWA
    CHECK_EQ(hp->compress_ratio[0], 0);
    CHECK_EQ(hp->compress_ratio[1], 0);
    CHECK_EQ(hp->compress_ratio[2], 4);
    CHECK_EQ(hp->compress_ratio[3], 128);
    CHECK_EQ(hp->compress_ratio[42], 4);
    CHECK_EQ(hp->compress_ratio[43], 0);
    int csa = 0, hca = 0;
    for (int il = 0; il < 43; il++)
        csa += hp->compress_ratio[il] == 4, hca += hp->compress_ratio[il] == 128;
    CHECK_EQ(csa, 21);
    CHECK_EQ(hca, 20);
    CHECK(hp->hash_routed[0] && hp->hash_routed[2] && !hp->hash_routed[3] && !hp->hash_routed[43]);
    CHECK(!hp->rope_main.yarn);
    CHECK(hp->rope_compress.yarn);
    CHECK_NEAR(hp->rope_compress.factor, 16, 0);
    CHECK_EQ(hp->rope_compress.original_max_pos, 65536);
    CHECK_NEAR(hp->rope_compress.attention_factor, 1.0, 0); // flat path: forced to 1
    CHECK_EQ(hp->rope_main.n_dims, 64);
    CHECK_EQ(hp->fp8_block_out, 128);
}

static void test_released_configs(void) {
    char p[1024];
    di_hparams hp;
    CHECK(di_hparams_load(test_src_path("tests/data/configs/deepseek-v4-flash.json", p, sizeof p),
                          &hp) == DI_OK);
    check_flash(&hp);
    // The official inference config uses dim / n_layers / rope_factor / original_seq_len ...
    CHECK(di_hparams_load(
              test_src_path("tests/data/configs/deepseek-v4-flash-inference.json", p, sizeof p),
              &hp) == DI_OK);
    check_flash(&hp);
}

// Spec §6.5 table: omega_i for main (theta 10000) and compress (160000 + YaRN).
static void test_rope_table(void) {
    di_rope_params mainp = {.theta = 10000, .n_dims = 64, .factor = 1, .attention_factor = 1};
    di_rope_params comp = {.theta = 160000,
                           .yarn = true,
                           .factor = 16,
                           .original_max_pos = 65536,
                           .beta_fast = 32,
                           .beta_slow = 1,
                           .attention_factor = 1,
                           .n_dims = 64};
    float om[32], oc[32];
    di_rope_freqs(&mainp, om);
    di_rope_freqs(&comp, oc);
    static const struct {
        int i;
        double m, c;
    } k[] = {
        {0, 1, 1},
        {1, 0.749894202, 0.687656045},
        {15, 0.0133352149, 0.00363553851},
        {16, 0.00999999978, 0.00226562495},
        {20, 0.00316227786, 0.000296977783},
        {24, 0.00100000005, 1.95312509e-05},
        {25, 0.000749894185, 5.37231244e-06},
        {31, 0.00013335215, 5.6805294e-07},
    };
    for (size_t j = 0; j < sizeof k / sizeof k[0]; j++) {
        CHECK_NEAR(om[k[j].i], k[j].m, 2e-7 * k[j].m); // FP32: within an ulp or two
        CHECK_NEAR(oc[k[j].i], k[j].c, 2e-7 * k[j].c);
    }
}

static di_status load_text(const char *json) {
    char path[] = "/tmp/di_hparams_XXXXXX";
    int fd = mkstemp(path);
    if (fd < 0) return DI_ERR_IO;
    ssize_t n = write(fd, json, strlen(json));
    close(fd);
    di_hparams hp;
    di_status st = n < 0 ? DI_ERR_IO : di_hparams_load(path, &hp);
    unlink(path);
    return st;
}

#define BASE                                                                                       \
    "\"vocab_size\": 512, \"hidden_size\": 128, \"num_hidden_layers\": 2, "                        \
    "\"num_attention_heads\": 4, \"head_dim\": 128, \"q_lora_rank\": 128, \"o_groups\": 2, "       \
    "\"o_lora_rank\": 128, \"sliding_window\": 16, \"n_routed_experts\": 8, "                      \
    "\"num_experts_per_tok\": 2, \"moe_intermediate_size\": 128"

static void test_bad_configs(void) {
    CHECK(load_text("{" BASE ", \"compress_ratios\": [0, 4]}") == DI_OK);
    CHECK(load_text("{" BASE
                    ", \"layer_types\": [\"sliding_attention\", \"heavily_compressed_attention\"], "
                    "\"compress_rates\": {\"compressed_sparse_attention\": 4, "
                    "\"heavily_compressed_attention\": 8}}") == DI_OK);
    CHECK(load_text("not json") == DI_ERR_FORMAT);
    CHECK(load_text("[1, 2]") == DI_ERR_FORMAT);
    CHECK(load_text("{" BASE "}") == DI_ERR_FORMAT); // no schedule
    CHECK(load_text("{" BASE ", \"compress_ratios\": [0]}") == DI_ERR_FORMAT);
    CHECK(load_text("{" BASE ", \"compress_ratios\": [0, 3]}") == DI_OK); // 3: HCA-like ratio
    CHECK(load_text("{" BASE ", \"compress_ratios\": [0, 1]}") == DI_ERR_FORMAT);
    CHECK(load_text("{" BASE ", \"compress_ratios\": [0, \"x\"]}") == DI_ERR_FORMAT);
    CHECK(load_text("{" BASE ", \"compress_ratios\": [0, -4]}") == DI_ERR_FORMAT);
    CHECK(load_text("{" BASE ", \"layer_types\": [\"sliding_attention\", \"dense\"]}") ==
          DI_ERR_FORMAT);
    CHECK(load_text("{" BASE ", \"compress_ratios\": [0, 4], \"model_type\": \"llama\"}") ==
          DI_ERR_UNSUPPORTED);
    CHECK(load_text("{" BASE ", \"compress_ratios\": [0, 4], \"num_key_value_heads\": 2}") ==
          DI_ERR_FORMAT);
    CHECK(load_text("{" BASE ", \"compress_ratios\": [0, 4], \"num_experts_per_tok\": 9}") ==
          DI_ERR_FORMAT);
    CHECK(load_text("{" BASE ", \"compress_ratios\": [0, 4], \"hidden_size\": -1}") ==
          DI_ERR_FORMAT);
    CHECK(load_text("{" BASE ", \"compress_ratios\": [0, 4], \"hidden_size\": \"128\"}") ==
          DI_ERR_FORMAT);
    CHECK(load_text("{" BASE ", \"compress_ratios\": [0, 4], \"o_groups\": 3}") == DI_ERR_FORMAT);
    CHECK(load_text("{" BASE ", \"compress_ratios\": [0, 4], \"scoring_func\": \"softmax\"}") ==
          DI_ERR_UNSUPPORTED);
    CHECK(load_text("{" BASE
                    ", \"compress_ratios\": [0, 4], \"rope_scaling\": {\"type\": \"yarn\"}}") ==
          DI_ERR_FORMAT);
    CHECK(load_text("{" BASE ", \"compress_ratios\": [0, 4], \"mlp_layer_types\": [\"moe\", 3]}") ==
          DI_ERR_FORMAT);
    CHECK(load_text("{" BASE
                    ", \"compress_ratios\": [0, 4], \"vocab_size\": 1, \"vocab_size\": 2}") ==
          DI_ERR_FORMAT);
    char p[1024];
    di_hparams hp;
    CHECK(di_hparams_load(test_src_path("tests/data/configs/missing.json", p, sizeof p), &hp) ==
          DI_ERR_IO);
}

// Nested rope_parameters as the fixture configs write them; a missing attention_factor in the
// nested YaRN form takes HF's derived value 0.1 ln(factor) + 1.
static void test_nested_rope(void) {
    const char *nested = "{" BASE ", \"compress_ratios\": [0, 4], \"rope_parameters\": {"
                         "\"main\": {\"rope_type\": \"default\", \"rope_theta\": 10000, "
                         "\"partial_rotary_factor\": 0.5},"
                         "\"compress\": {\"rope_type\": \"yarn\", \"rope_theta\": 160000, "
                         "\"partial_rotary_factor\": 0.5,"
                         "\"factor\": 16, \"original_max_position_embeddings\": 65536, "
                         "\"beta_fast\": 32, \"beta_slow\": 1%s}}}";
    char buf[2048];
    snprintf(buf, sizeof buf, nested, ", \"attention_factor\": 1.0");
    char path[] = "/tmp/di_hparams_XXXXXX";
    int fd = mkstemp(path);
    CHECK(fd >= 0);
    CHECK(write(fd, buf, strlen(buf)) > 0);
    close(fd);
    di_hparams hp;
    CHECK(di_hparams_load(path, &hp) == DI_OK);
    CHECK_EQ(hp.rope_main.n_dims, 64);
    CHECK(hp.rope_compress.yarn && hp.rope_compress.attention_factor == 1.0f);
    snprintf(buf, sizeof buf, nested, "");
    fd = open(path, O_WRONLY | O_TRUNC);
    CHECK(write(fd, buf, strlen(buf)) > 0);
    close(fd);
    CHECK(di_hparams_load(path, &hp) == DI_OK);
    CHECK_NEAR(hp.rope_compress.attention_factor, 0.1 * log(16.0) + 1.0, 1e-6);
    unlink(path);
}

// DeepSeek V4.1 (spec deepseek-v41.md §1): the released config in both namings, derived
// schedules and the validation errors.
static void check_v41_flash(const di_hparams *hp) {
    CHECK(hp->v41);
    CHECK_STR_EQ(hp->model_type, "deepseek_v41");
    CHECK_EQ(hp->n_embd, 5120);
    CHECK_EQ(hp->n_layer, 40);
    CHECK_EQ(hp->n_mtp, 3);
    CHECK_EQ(hp->q_lora_rank, 1280);
    CHECK_EQ(hp->n_expert, 384);
    CHECK_EQ(hp->expert_ff, 2304);
    CHECK_EQ(hp->n_index_head, 32);
    CHECK(hp->norm_eps == 1e-20f);
    CHECK_EQ(hp->compress_ratio[1], 0);
    CHECK_EQ(hp->compress_ratio[2], 2);
    CHECK_EQ(hp->compress_ratio[19], 2);
    CHECK_EQ(hp->compress_ratio[20], 1);
    CHECK_EQ(hp->compress_ratio[39], 1);
    CHECK_EQ(hp->compress_ratio[40], 0);
    int n_kv = 0, n_idx = 0;
    for (int il = 0; il < 40; il++) n_kv += hp->kv_source[il], n_idx += hp->index_source[il];
    CHECK_EQ(n_kv, 4);
    CHECK_EQ(n_idx, 8);
    CHECK(hp->kv_source[20] && hp->index_source[36] && !hp->index_source[37]);
    CHECK_EQ(hp->candidate_layer, 20);
    CHECK_EQ(hp->candidate_topk_blocks, 2048);
    CHECK_EQ(hp->n_engram, 2);
    CHECK_EQ(hp->engram_layer[1], 14);
    CHECK_EQ(hp->engram_cvocab, 99092);
    CHECK_EQ(hp->dspark_n_expert, 128);
    CHECK_EQ(hp->dspark_n_expert_used, 3);
    CHECK_EQ(hp->n_dspark_target, 3);
    CHECK_EQ(hp->dspark_target[0], 37);
    CHECK_EQ(hp->fp8_block_out, 32);
    CHECK_EQ(hp->fp8_block_in, 32);
    CHECK(hp->rope_compress.yarn);
    CHECK_EQ(hp->rope_compress.original_max_pos, 65536);
    CHECK(!hp->hash_routed[0]);
}

#define V41 "\"model_type\": \"deepseek_v41_text\", " BASE

static void test_v41_configs(void) {
    char p[1024];
    di_hparams hp;
    CHECK(di_hparams_load(test_src_path("tests/data/configs/deepseek-v41-flash.json", p, sizeof p),
                          &hp) == DI_OK);
    check_v41_flash(&hp);
    CHECK(di_hparams_load(
              test_src_path("tests/data/configs/deepseek-v41-flash-inference.json", p, sizeof p),
              &hp) == DI_OK);
    check_v41_flash(&hp);
    // Derived schedule (R-HF __post_init__): 2 layers -> [0, 0]; sources from runs.
    CHECK(load_text("{" V41 "}") == DI_OK);
    CHECK(load_text("{" V41 ", \"compress_ratios\": [0, 2]}") == DI_OK);
    CHECK(load_text("{" V41 ", \"compress_ratios\": [0, 3]}") == DI_ERR_FORMAT);
    CHECK(load_text("{" V41 ", \"compress_ratios\": [0, 2], \"kv_source_layer_ids\": [0]}") ==
          DI_ERR_FORMAT); // source with ratio 0
    CHECK(load_text("{" V41 ", \"compress_ratios\": [0, 2], \"kv_source_layer_ids\": [1], "
                    "\"index_source_layer_ids\": []}") == DI_ERR_FORMAT); // kv source not indexed
    CHECK(load_text("{" V41 ", \"compress_ratios\": [0, 2], \"kv_source_layer_ids\": []}") ==
          DI_ERR_FORMAT); // ratio > 0 without a source
    CHECK(load_text("{" V41 ", \"compress_ratios\": [0, 2], \"candidate_source_layer_id\": 0}") ==
          DI_ERR_FORMAT);
    CHECK(load_text("{" V41 ", \"compress_ratios\": [0, 2], \"kv_source_layer_ids\": [7]}") ==
          DI_ERR_FORMAT);
    CHECK(load_text("{" V41 ", \"num_hash_layers\": 3}") == DI_ERR_FORMAT);
    CHECK(load_text("{" V41 ", \"engram_layer_ids\": [1]}") == DI_ERR_FORMAT); // no sizes
    CHECK(load_text("{" V41 ", \"engram_layer_ids\": [1], \"engram_num_embeddings\": [10], "
                    "\"engram_vocab_size\": 100, \"engram_compressed_vocab_size\": 64, "
                    "\"engram_max_ngram_size\": 3, \"engram_n_heads\": 2, "
                    "\"engram_head_dim\": 32, \"engram_pad_id\": 2}") == DI_OK);
    CHECK(load_text("{" V41 ", \"engram_layer_ids\": [1], \"engram_num_embeddings\": [10], "
                    "\"engram_vocab_size\": 100, \"engram_compressed_vocab_size\": 64, "
                    "\"engram_max_ngram_size\": 3, \"engram_n_heads\": 2, "
                    "\"engram_head_dim\": 30, \"engram_pad_id\": 2}") == DI_ERR_FORMAT);
    // The state stores Q8/Q4 codes in blocks of 32 dims: head_dim and index_head_dim multiples of
    // 32 (V4 has no such rule: the same shapes load).
    CHECK(load_text("{" V41 ", \"index_head_dim\": 80}") == DI_ERR_FORMAT);
    CHECK(load_text("{" BASE ", \"compress_ratios\": [0, 4], \"index_head_dim\": 80}") == DI_OK);
#define HD80                                                                                       \
    "\"vocab_size\": 512, \"hidden_size\": 128, \"num_hidden_layers\": 2, "                        \
    "\"num_attention_heads\": 4, \"head_dim\": 80, \"q_lora_rank\": 128, \"o_groups\": 2, "        \
    "\"o_lora_rank\": 128, \"sliding_window\": 16, \"n_routed_experts\": 8, "                      \
    "\"num_experts_per_tok\": 2, \"moe_intermediate_size\": 128"
    CHECK(load_text("{\"model_type\": \"deepseek_v41_text\", " HD80 "}") == DI_ERR_FORMAT);
    CHECK(load_text("{" HD80 ", \"compress_ratios\": [0, 4]}") == DI_OK);
#undef HD80
}

// di_model_read_config on a checkpoint directory's config.json in each released form: the tools
// take the prompt format from it, and the official V4.1 config names no model_type.
static void test_read_config(void) {
    char dir[] = "/tmp/di_readcfg_XXXXXX";
    CHECK(mkdtemp(dir) != NULL);
    char cfg[256], src[1024];
    snprintf(cfg, sizeof cfg, "%s/config.json", dir);
    const struct {
        const char *file;
        bool v41;
    } cases[] = {{"tests/data/configs/deepseek-v4-flash.json", false},
                 {"tests/data/configs/deepseek-v4-flash-inference.json", false},
                 {"tests/data/configs/deepseek-v41-flash.json", true},
                 {"tests/data/configs/deepseek-v41-flash-inference.json", true}};
    di_model_config mc;
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        FILE *in = fopen(test_src_path(cases[i].file, src, sizeof src), "rb");
        FILE *out = fopen(cfg, "wb");
        CHECK(in && out);
        char buf[4096];
        size_t n;
        while (in && out && (n = fread(buf, 1, sizeof buf, in)) > 0)
            CHECK(fwrite(buf, 1, n, out) == n);
        if (in) fclose(in);
        if (out) fclose(out);
        memset(&mc, 0xff, sizeof mc);
        CHECK(di_model_read_config(dir, &mc) == DI_OK);
        CHECK(mc.v41 == cases[i].v41);
        CHECK_EQ(mc.n_vocab, 129280);
        CHECK_EQ(mc.max_position_embeddings, 1048576);
    }
    unlink(cfg);
    CHECK(di_model_read_config(dir, &mc) == DI_ERR_IO); // no config.json, no .gguf
    rmdir(dir);
    CHECK(di_model_read_config(NULL, &mc) == DI_ERR_INVALID);
}

int main(void) {
    RUN(test_released_configs);
    RUN(test_rope_table);
    RUN(test_bad_configs);
    RUN(test_nested_rope);
    RUN(test_v41_configs);
    RUN(test_read_config);
    return test_finish();
}
