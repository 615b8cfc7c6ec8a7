// dsv4_gguf — DeepSeek V4 checkpoints as GGUF files in llama.cpp's `deepseek4` architecture (tensor
// names and metadata keys as llama.cpp's converter writes them, conversion/deepseek.py and
// src/models/deepseek4.cpp at llama.cpp 0c1e57098): loading (hyper-parameters from the metadata,
// tensors renamed to the official layout and presented to weights.c as a tensor set) and writing
// (deepinfer convert: an official-layout safetensors checkpoint to GGUF).
//
// Differences from llama.cpp's converter: MTP blocks are dropped as its conversion v0 does; the
// quantised types are written by our own quantisers (quant_ref.h), not by llama-quantize.
#include "model/dsv4_gguf.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/log.h"
#include "base/mem.h"
#include "base/status.h"
#include "tensor/quant_ref.h"
#include "tensor/tensor.h"

// ---- names ----

// Root tensors: llama.cpp name -> official name.
static const char *const k_root[][2] = {
    {"token_embd.weight", "embed.weight"},     {"output_norm.weight", "norm.weight"},
    {"output.weight", "head.weight"},          {"output_hc_fn.weight", "hc_head_fn"},
    {"output_hc_base.weight", "hc_head_base"}, {"output_hc_scale.weight", "hc_head_scale"},
};

// Per-layer tensors: "blk.N.<a>" <-> "layers.N.<b>". The stacked routed experts have no official
// single-tensor name; "ffn.experts.wK.stacked" stands for them inside deepinfer.
static const char *const k_layer[][2] = {
    {"hc_attn_fn.weight", "hc_attn_fn"},
    {"hc_attn_base.weight", "hc_attn_base"},
    {"hc_attn_scale.weight", "hc_attn_scale"},
    {"hc_ffn_fn.weight", "hc_ffn_fn"},
    {"hc_ffn_base.weight", "hc_ffn_base"},
    {"hc_ffn_scale.weight", "hc_ffn_scale"},
    {"attn_sinks.weight", "attn.attn_sink"},
    {"attn_q_a.weight", "attn.wq_a.weight"},
    {"attn_q_b.weight", "attn.wq_b.weight"},
    {"attn_q_a_norm.weight", "attn.q_norm.weight"},
    {"attn_kv.weight", "attn.wkv.weight"},
    {"attn_kv_a_norm.weight", "attn.kv_norm.weight"},
    {"attn_output_a.weight", "attn.wo_a.weight"},
    {"attn_output_b.weight", "attn.wo_b.weight"},
    {"attn_compressor_ape.weight", "attn.compressor.ape"},
    {"attn_compressor_kv.weight", "attn.compressor.wkv.weight"},
    {"attn_compressor_gate.weight", "attn.compressor.wgate.weight"},
    {"attn_compressor_norm.weight", "attn.compressor.norm.weight"},
    {"indexer.attn_q_b.weight", "attn.indexer.wq_b.weight"},
    {"indexer.proj.weight", "attn.indexer.weights_proj.weight"},
    {"indexer_compressor_ape.weight", "attn.indexer.compressor.ape"},
    {"indexer_compressor_kv.weight", "attn.indexer.compressor.wkv.weight"},
    {"indexer_compressor_gate.weight", "attn.indexer.compressor.wgate.weight"},
    {"indexer_compressor_norm.weight", "attn.indexer.compressor.norm.weight"},
    {"attn_norm.weight", "attn_norm.weight"},
    {"ffn_norm.weight", "ffn_norm.weight"},
    {"ffn_gate_inp.weight", "ffn.gate.weight"},
    {"exp_probs_b.bias", "ffn.gate.bias"},
    {"ffn_gate_tid2eid.weight", "ffn.gate.tid2eid"},
    {"ffn_gate_shexp.weight", "ffn.shared_experts.w1.weight"},
    {"ffn_down_shexp.weight", "ffn.shared_experts.w2.weight"},
    {"ffn_up_shexp.weight", "ffn.shared_experts.w3.weight"},
    {"ffn_gate_exps.weight", "ffn.experts.w1.stacked"},
    {"ffn_down_exps.weight", "ffn.experts.w2.stacked"},
    {"ffn_up_exps.weight", "ffn.experts.w3.stacked"},
};

#define N_ROOT (sizeof k_root / sizeof k_root[0])
#define N_LAYER (sizeof k_layer / sizeof k_layer[0])

// Translates a name from one naming to the other (dir 0: GGUF -> official, 1: official -> GGUF).
static bool translate(const char *name, int dir, char *out, size_t cap) {
    const int from = dir, to = 1 - dir;
    for (size_t i = 0; i < N_ROOT; i++)
        if (strcmp(name, k_root[i][from]) == 0) {
            snprintf(out, cap, "%s", k_root[i][to]);
            return true;
        }
    const char *pre_from = dir == 0 ? "blk." : "layers.", *pre_to = dir == 0 ? "layers." : "blk.";
    size_t pl = strlen(pre_from);
    if (strncmp(name, pre_from, pl) != 0) return false;
    char *end;
    long il = strtol(name + pl, &end, 10);
    if (end == name + pl || *end != '.' || il < 0 || il >= DI_MAX_LAYERS) return false;
    for (size_t i = 0; i < N_LAYER; i++)
        if (strcmp(end + 1, k_layer[i][from]) == 0) {
            snprintf(out, cap, "%s%ld.%s", pre_to, il, k_layer[i][to]);
            return true;
        }
    return false;
}

static bool ggml_to_dtype(uint32_t t, di_dtype *out) {
    switch (t) {
    case DI_GGML_TYPE_F32:
        *out = DI_DTYPE_F32;
        return true;
    case DI_GGML_TYPE_F16:
        *out = DI_DTYPE_F16;
        return true;
    case DI_GGML_TYPE_BF16:
        *out = DI_DTYPE_BF16;
        return true;
    case DI_GGML_TYPE_F64:
        *out = DI_DTYPE_F64;
        return true;
    case DI_GGML_TYPE_I8:
        *out = DI_DTYPE_I8;
        return true;
    case DI_GGML_TYPE_I16:
        *out = DI_DTYPE_I16;
        return true;
    case DI_GGML_TYPE_I32:
        *out = DI_DTYPE_I32;
        return true;
    case DI_GGML_TYPE_I64:
        *out = DI_DTYPE_I64;
        return true;
    case DI_GGML_TYPE_Q8_0:
        *out = DI_DTYPE_GGML_Q8_0;
        return true;
    case DI_GGML_TYPE_Q4_K:
        *out = DI_DTYPE_GGML_Q4_K;
        return true;
    case DI_GGML_TYPE_Q2_K:
        *out = DI_DTYPE_GGML_Q2_K;
        return true;
    case DI_GGML_TYPE_IQ2_XXS:
        *out = DI_DTYPE_GGML_IQ2_XXS;
        return true;
    case DI_GGML_TYPE_MXFP4:
        *out = DI_DTYPE_GGML_MXFP4;
        return true;
    default:
        return false;
    }
}

// ---- hyper-parameters from metadata ----

#define ARCH "deepseek4"

static di_status need(const di_gguf_file *f, const char *what, const char *key, int64_t lo,
                      int64_t hi, int32_t *out) {
    char full[128];
    snprintf(full, sizeof full, ARCH ".%s", key);
    int64_t v;
    if (!di_gguf_get_int(f, full, &v)) {
        DI_LOG_ERROR("%s: missing integer metadata %s", what, full);
        return DI_ERR_FORMAT;
    }
    if (v < lo || v > hi) {
        DI_LOG_ERROR("%s: %s = %lld is outside [%lld, %lld]", what, full, (long long)v,
                     (long long)lo, (long long)hi);
        return DI_ERR_FORMAT;
    }
    *out = (int32_t)v;
    return DI_OK;
}

static float opt_num(const di_gguf_file *f, const char *key, double def) {
    char full[128];
    snprintf(full, sizeof full, ARCH ".%s", key);
    double v;
    if (di_gguf_get_num(f, full, &v)) return (float)v;
    // Per-layer arrays (swiglu clamps): the first entry.
    int64_t n;
    if (di_gguf_get_num_arr(f, full, &v, 1, &n) && n != 0) return (float)v;
    return (float)def;
}

static int32_t opt_int(const di_gguf_file *f, const char *key, int32_t def) {
    char full[128];
    snprintf(full, sizeof full, ARCH ".%s", key);
    int64_t v;
    return di_gguf_get_int(f, full, &v) ? (int32_t)v : def;
}

#define RET(expr)                                                                                  \
    do {                                                                                           \
        di_status s_ = (expr);                                                                     \
        if (s_ != DI_OK) return s_;                                                                \
    } while (0)

di_status di_dsv4_gguf_hparams(const di_gguf_file *f, const char *what, di_hparams *hp) {
    memset(hp, 0, sizeof *hp);
    const char *arch;
    size_t len;
    if (!di_gguf_get_str(f, "general.architecture", &arch, &len)) {
        DI_LOG_ERROR("%s: no general.architecture", what);
        return DI_ERR_FORMAT;
    }
    if (len != strlen(ARCH) || memcmp(arch, ARCH, len) != 0) {
        DI_LOG_ERROR("%s: architecture \"%.*s\" is not supported (" ARCH ")", what,
                     (int)(len < 64 ? len : 64), arch);
        return DI_ERR_UNSUPPORTED;
    }
    snprintf(hp->model_type, sizeof hp->model_type, "%s", "deepseek_v4");
    // llama.cpp reads the vocabulary size from the token list; ours needs only the count.
    const di_gguf_tensor *emb = di_gguf_find_tensor(f, "token_embd.weight");
    int64_t nv = 0;
    if (!di_gguf_get_int(f, ARCH ".vocab_size", &nv)) {
        const di_gguf_kv *toks = di_gguf_find_kv(f, "tokenizer.ggml.tokens");
        nv = toks && toks->type == DI_GGUF_VTYPE_ARRAY ? (int64_t)toks->n : emb ? emb->ne[1] : 0;
    }
    if (nv < 1 || nv > (1 << 24)) {
        DI_LOG_ERROR("%s: vocabulary size %lld is invalid", what, (long long)nv);
        return DI_ERR_FORMAT;
    }
    hp->n_vocab = (int32_t)nv;
    RET(need(f, what, "embedding_length", 1, 1 << 16, &hp->n_embd));
    int32_t n_blocks, n_nextn = opt_int(f, "nextn_predict_layers", 0);
    RET(need(f, what, "block_count", 1, DI_MAX_LAYERS - 8, &n_blocks));
    // A GGUF holding only MTP layers (llama.cpp's --mtp export) is not a model we can run.
    hp->n_layer = n_blocks;
    if (n_nextn > 0 && !di_gguf_find_tensor(f, "blk.0.attn_norm.weight")) {
        DI_LOG_ERROR("%s: an MTP-only GGUF (no main layers) cannot be run on its own", what);
        return DI_ERR_UNSUPPORTED;
    }
    hp->n_mtp = 0; // llama.cpp's converter (conversion v0) drops the MTP block
    RET(need(f, what, "attention.head_count", 1, 1024, &hp->n_head));
    RET(need(f, what, "attention.key_length", 2, 4096, &hp->head_dim));
    RET(need(f, what, "attention.q_lora_rank", 1, 1 << 16, &hp->q_lora_rank));
    RET(need(f, what, "attention.output_group_count", 1, 1024, &hp->o_groups));
    RET(need(f, what, "attention.output_lora_rank", 1, 1 << 16, &hp->o_lora_rank));
    RET(need(f, what, "attention.sliding_window", 1, 1 << 20, &hp->window));
    RET(need(f, what, "expert_count", 1, 1 << 16, &hp->n_expert));
    RET(need(f, what, "expert_used_count", 1, 1 << 10, &hp->n_expert_used));
    RET(need(f, what, "expert_feed_forward_length", 1, 1 << 20, &hp->expert_ff));
    RET(need(f, what, "attention.indexer.head_count", 1, 1 << 10, &hp->n_index_head));
    RET(need(f, what, "attention.indexer.key_length", 1, 1 << 12, &hp->index_head_dim));
    RET(need(f, what, "attention.indexer.top_k", 1, 1 << 20, &hp->index_topk));
    RET(need(f, what, "hyper_connection.count", 1, 16, &hp->hc_mult));
    RET(need(f, what, "hyper_connection.sinkhorn_iterations", 1, 1000, &hp->hc_iters));
    hp->hc_eps = opt_num(f, "hyper_connection.epsilon", 1e-6);
    hp->norm_eps = opt_num(f, "attention.layer_norm_rms_epsilon", 1e-6);
    hp->n_expert_shared = opt_int(f, "expert_shared_count", 1);
    hp->route_scale = opt_num(f, "expert_weights_scale", 1.0);
    hp->swiglu_limit = opt_num(f, "swiglu_clamp_exp", 0.0);
    hp->shared_expert_clamp = opt_num(f, "swiglu_clamp_shexp", hp->swiglu_limit) > 0;
    hp->max_pos = opt_int(f, "context_length", 1 << 20);
    int64_t v;
    hp->bos_token = di_gguf_get_int(f, "tokenizer.ggml.bos_token_id", &v) ? (int32_t)v : 0;
    hp->eos_token = di_gguf_get_int(f, "tokenizer.ggml.eos_token_id", &v) ? (int32_t)v : 1;
    if (hp->n_expert_shared != 1) {
        DI_LOG_ERROR("%s: expert_shared_count must be 1, got %d", what, hp->n_expert_shared);
        return DI_ERR_UNSUPPORTED;
    }
    if (opt_int(f, "attention.head_count_kv", 1) != 1) {
        DI_LOG_ERROR("%s: attention.head_count_kv must be 1 (shared-KV MQA)", what);
        return DI_ERR_FORMAT;
    }
    int32_t gating = opt_int(f, "expert_gating_func", 4);
    if (gating != 4) { // llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_SQRT_SOFTPLUS
        DI_LOG_ERROR("%s: expert_gating_func %d is not supported (4, sqrtsoftplus)", what, gating);
        return DI_ERR_UNSUPPORTED;
    }
    // Layer schedule.
    int64_t ratios[DI_MAX_LAYERS], n_r = 0;
    if (!di_gguf_get_int_arr(f, ARCH ".attention.compress_ratios", ratios, DI_MAX_LAYERS, &n_r) ||
        n_r < hp->n_layer) {
        DI_LOG_ERROR("%s: " ARCH ".attention.compress_ratios is missing or shorter than "
                     "block_count",
                     what);
        return DI_ERR_FORMAT;
    }
    int32_t n_hash = opt_int(f, "hash_layer_count", 0);
    for (int il = 0; il < hp->n_layer; il++) {
        int64_t m = ratios[il];
        if (m < 0 || m > 65536 || (m != 0 && m != 4 && m < 2)) {
            DI_LOG_ERROR("%s: compress_ratios[%d] = %lld is invalid", what, il, (long long)m);
            return DI_ERR_FORMAT;
        }
        hp->compress_ratio[il] = (int32_t)m;
        hp->hash_routed[il] = il < n_hash;
    }
    // RoPE: main theta (ratio-0 layers) and compress theta; YaRN, when present, applies to the
    // compressed layers with attention factor 1 (as the flat config.json form, hparams.c).
    di_rope_params *rm = &hp->rope_main, *rc = &hp->rope_compress;
    rm->n_dims = opt_int(f, "rope.dimension_count", 64);
    rm->theta = opt_num(f, "rope.freq_base", 10000.0);
    rm->factor = 1.0f;
    rm->attention_factor = 1.0f;
    *rc = *rm;
    rc->theta = opt_num(f, "attention.compress_rope_freq_base", 160000.0);
    const char *rt;
    size_t rtl;
    if (di_gguf_get_str(f, ARCH ".rope.scaling.type", &rt, &rtl) && rtl == 4 &&
        memcmp(rt, "yarn", 4) == 0) {
        rc->yarn = true;
        rc->factor = opt_num(f, "rope.scaling.factor", 1.0);
        rc->original_max_pos = opt_int(f, "rope.scaling.original_context_length", 0);
        rc->beta_fast = opt_num(f, "rope.scaling.yarn_beta_fast", 32.0);
        rc->beta_slow = opt_num(f, "rope.scaling.yarn_beta_slow", 1.0);
        if (rc->factor <= 0 || rc->original_max_pos <= 0) {
            DI_LOG_ERROR("%s: YaRN needs rope.scaling.factor and original_context_length", what);
            return DI_ERR_FORMAT;
        }
    }
    hp->fp8_block_out = hp->fp8_block_in = 128; // unused: GGUF carries no FP8
    hp->gate_temp = 1.0f;                       // V4 routes on the raw logits
    hp->candidate_layer = -1;                   // (V4.1 only)
    return di_hparams_check(what, hp);
}

// ---- loading ----

di_status di_dsv4_gguf_open(const char *path, di_gguf_file **gguf, di_hparams *hp,
                            di_st_set **set) {
    di_gguf_file *f = NULL;
    di_st_tensor *ts = NULL;
    di_status st = di_gguf_open(path, &f);
    if (st != DI_OK) return st;
    if ((st = di_dsv4_gguf_hparams(f, path, hp)) != DI_OK) goto fail;
    int64_t n = di_gguf_n_tensors(f);
    ts = di_calloc((size_t)n + 1, sizeof *ts);
    char *names = di_malloc((size_t)n * 96 + 1);
    if (!ts || !names) {
        di_free(names);
        st = DI_ERR_NOMEM;
        goto fail;
    }
    for (int64_t i = 0; i < n; i++) {
        const di_gguf_tensor *g = di_gguf_tensor_at(f, i);
        di_st_tensor *t = &ts[i];
        char *nm = names + i * 96;
        // Names without an official counterpart keep their GGUF name: weights.c reports them as
        // unexpected tensors.
        if (!translate(g->name, 0, nm, 96)) snprintf(nm, 96, "%s", g->name);
        t->name = nm;
        if (!ggml_to_dtype(g->type, &t->dtype)) {
            DI_LOG_ERROR("%s: tensor %s has type %s, which has no deepinfer kernel", path, g->name,
                         di_ggml_type_name(g->type));
            di_free(names);
            st = DI_ERR_UNSUPPORTED;
            goto fail;
        }
        t->n_dims = g->n_dims;
        for (int d = 0; d < g->n_dims; d++) t->shape[d] = g->ne[g->n_dims - 1 - d]; // PyTorch order
        t->n_elements = g->n_elements;
        t->data = g->data;
        t->n_bytes = g->n_bytes;
    }
    st = di_st_set_create_view(ts, n, set);
    di_free(names);
    if (st != DI_OK) goto fail;
    di_free(ts);
    *gguf = f;
    return DI_OK;
fail:
    di_free(ts);
    di_gguf_close(f);
    return st;
}

bool di_dsv4_gguf_is_path(const char *path) {
    size_t n = strlen(path);
    return n > 5 && strcmp(path + n - 5, ".gguf") == 0;
}

// ---- writing (deepinfer convert) ----

typedef enum item_kind {
    ITEM_PLAIN = 0, // one source tensor (with its .scale for FP8/FP4)
    ITEM_EXPERTS,   // E per-expert source matrices stacked as [E, rows, cols]
    ITEM_TID2EID,   // hash routing table -> I32
} item_kind;

typedef struct item {
    item_kind kind;
    const di_st_tensor *src; // ITEM_PLAIN / ITEM_TID2EID; expert 0 for ITEM_EXPERTS
    char prefix[32];         // ITEM_EXPERTS: "layers.N."
    char wk[4];              // ITEM_EXPERTS: "w1", "w2", "w3"
    uint32_t type;
    int64_t rows, cols, n_mat; // matrices of rows x cols (n_mat = E for experts, else 1)
} item;

typedef struct conv {
    const di_st_set *st;
    const di_hparams *hp;
    item *items; // owned
    int64_t n_items;
    float *row; // owned scratch, one row
} conv;

// The scale tensor of an FP8/FP4 weight ("<x>.weight" -> "<x>.scale").
static const di_st_tensor *scale_of(const di_st_set *st, const char *wname) {
    char buf[160];
    size_t n = strlen(wname);
    if (n < 7 || strcmp(wname + n - 7, ".weight") != 0) return NULL;
    snprintf(buf, sizeof buf, "%.*s.scale", (int)(n - 7), wname);
    return di_st_set_find(st, buf);
}

// A di_tensor over a source matrix (1-D tensors as one row), for row dequantisation.
static di_status src_tensor(const conv *c, const di_st_tensor *t, di_tensor *w) {
    memset(w, 0, sizeof *w);
    w->name = t->name;
    w->data = t->data;
    int64_t rows = t->n_dims == 2 ? t->shape[0] : 1, cols = t->shape[t->n_dims - 1];
    if (t->n_dims < 1 || t->n_dims > 2) goto bad;
    w->ne[1] = rows;
    switch (t->dtype) {
    case DI_DTYPE_F32:
    case DI_DTYPE_F16:
    case DI_DTYPE_BF16:
        w->kind = t->dtype == DI_DTYPE_F32   ? DI_TENSOR_KIND_F32
                  : t->dtype == DI_DTYPE_F16 ? DI_TENSOR_KIND_F16
                                             : DI_TENSOR_KIND_BF16;
        w->ne[0] = cols;
        w->nb1 = (size_t)cols * di_dtype_size(t->dtype);
        return DI_OK;
    case DI_DTYPE_F8_E4M3:
    case DI_DTYPE_I8:
    case DI_DTYPE_U8: {
        const di_st_tensor *s = scale_of(c->st, t->name);
        if (!s || s->dtype != DI_DTYPE_F8_E8M0 || t->n_dims != 2) goto bad;
        w->scale = s->data;
        w->scale_nb1 = (size_t)s->shape[s->n_dims - 1];
        if (t->dtype == DI_DTYPE_F8_E4M3) {
            w->kind = DI_TENSOR_KIND_FP8;
            w->ne[0] = cols;
            w->nb1 = (size_t)cols;
            w->block_out = c->hp->fp8_block_out;
            w->block_in = c->hp->fp8_block_in;
        } else {
            w->kind = DI_TENSOR_KIND_FP4;
            w->ne[0] = 2 * cols;
            w->nb1 = (size_t)cols;
            w->block_out = 1;
            w->block_in = 32;
        }
        return DI_OK;
    }
    default:
        break;
    }
bad:
    DI_LOG_ERROR("convert: tensor %s (%s) cannot be converted", t->name, di_dtype_name(t->dtype));
    return DI_ERR_FORMAT;
}

static bool name_has(const char *name, const char *part) {
    return strstr(name, part) != NULL;
}

// The output type of a 2-D weight under `mode` (see di_dsv4_gguf_convert), for rows of `cols`.
static uint32_t pick_type(const char *mode, const char *name, di_dtype src, int64_t cols) {
    // Kept in F32 whatever the mode: small tensors the graph adds or mixes in float.
    if (name_has(name, "hc_") || name_has(name, ".ape") || name_has(name, "ffn.gate.weight"))
        return DI_GGML_TYPE_F32;
    uint32_t t;
    if (strcmp(mode, "q8_0") == 0) // llama.cpp's converter: FP8 -> Q8_0, float kept
        t = src == DI_DTYPE_F8_E4M3 ? DI_GGML_TYPE_Q8_0
            : src == DI_DTYPE_F32   ? DI_GGML_TYPE_F32
            : src == DI_DTYPE_F16   ? DI_GGML_TYPE_F16
                                    : DI_GGML_TYPE_BF16;
    else if (strcmp(mode, "q4_k") == 0)
        t = DI_GGML_TYPE_Q4_K;
    else if (strcmp(mode, "bf16") == 0)
        t = DI_GGML_TYPE_BF16;
    else if (strcmp(mode, "f16") == 0)
        t = DI_GGML_TYPE_F16;
    else
        t = DI_GGML_TYPE_F32;
    int64_t blck;
    di_ggml_type_info(t, &blck, NULL);
    if (cols % blck == 0) return t;
    return cols % 32 == 0 ? DI_GGML_TYPE_Q8_0 : DI_GGML_TYPE_F32;
}

static di_status encode_row(uint32_t type, const float *x, int64_t n, uint8_t *dst) {
    switch (type) {
    case DI_GGML_TYPE_F32:
        memcpy(dst, x, sizeof(float) * (size_t)n);
        return DI_OK;
    case DI_GGML_TYPE_F16:
    case DI_GGML_TYPE_BF16:
        for (int64_t i = 0; i < n; i++) {
            uint16_t h = type == DI_GGML_TYPE_F16 ? di_f32_to_f16(x[i]) : di_f32_to_bf16(x[i]);
            memcpy(dst + 2 * i, &h, 2);
        }
        return DI_OK;
    case DI_GGML_TYPE_Q8_0:
        di_quant_row_q8_0(x, n, dst);
        return DI_OK;
    case DI_GGML_TYPE_Q4_K:
        di_quant_row_q4_k(x, n, dst);
        return DI_OK;
    default:
        return DI_ERR_INVALID;
    }
}

static size_t row_bytes(uint32_t type, int64_t cols) {
    int64_t blck;
    size_t bb;
    di_ggml_type_info(type, &blck, &bb);
    return (size_t)(cols / blck) * bb;
}

// Writes one source matrix (rows x cols) into dst in the item's type.
static di_status fill_matrix(conv *c, const item *it, const di_st_tensor *t, uint8_t *dst) {
    di_tensor w;
    di_status st = src_tensor(c, t, &w);
    if (st != DI_OK) return st;
    const size_t rb = row_bytes(it->type, it->cols);
    for (int64_t r = 0; r < it->rows; r++) {
        uint8_t *out = dst + (size_t)r * rb;
        if (it->type == DI_GGML_TYPE_MXFP4) { // exact repack of FP4 e2m1 + UE8M0
            const uint8_t *row = (const uint8_t *)w.data + (size_t)r * w.nb1;
            di_repack_row_fp4_mxfp4(row, w.scale + (size_t)r * w.scale_nb1, it->cols, out);
            continue;
        }
        di_tensor_row_f32(&w, r, c->row);
        if ((st = encode_row(it->type, c->row, it->cols, out)) != DI_OK) return st;
    }
    return DI_OK;
}

static di_status fill_item(void *user, int64_t i, uint8_t *dst, size_t n_bytes) {
    conv *c = user;
    const item *it = &c->items[i];
    (void)n_bytes;
    if (it->kind == ITEM_TID2EID) {
        const di_st_tensor *t = it->src;
        for (int64_t k = 0; k < t->n_elements; k++) {
            int64_t e;
            if (t->dtype == DI_DTYPE_I64)
                memcpy(&e, (const uint8_t *)t->data + 8 * k, 8);
            else {
                int32_t e32;
                memcpy(&e32, (const uint8_t *)t->data + 4 * k, 4);
                e = e32;
            }
            int32_t v = (int32_t)e;
            memcpy(dst + 4 * k, &v, 4);
        }
        return DI_OK;
    }
    if (it->kind == ITEM_PLAIN) return fill_matrix(c, it, it->src, dst);
    const size_t mat_bytes = (size_t)it->rows * row_bytes(it->type, it->cols);
    for (int64_t e = 0; e < it->n_mat; e++) {
        char name[160];
        snprintf(name, sizeof name, "%sffn.experts.%lld.%s.weight", it->prefix, (long long)e,
                 it->wk);
        const di_st_tensor *t = di_st_set_find(c->st, name);
        if (!t) {
            DI_LOG_ERROR("convert: missing %s", name);
            return DI_ERR_FORMAT;
        }
        di_status st = fill_matrix(c, it, t, dst + (size_t)e * mat_bytes);
        if (st != DI_OK) return st;
    }
    return DI_OK;
}

// llama.cpp's general.file_type: MOSTLY_MXFP4_MOE (38) as its converter sets for V4 (experts in
// MXFP4), MOSTLY_Q4_K_S (14) when everything is Q4_K, ALL_F32 (0) for f32.
static uint32_t file_type(const char *mode) {
    return strcmp(mode, "q4_k") == 0 ? 14u : strcmp(mode, "f32") == 0 ? 0u : 38u;
}

static di_status add_metadata(di_gguf_writer *w, const di_hparams *hp, const char *mode) {
    di_status st = DI_OK;
#define S(call)                                                                                    \
    do {                                                                                           \
        if (st == DI_OK) st = (call);                                                              \
    } while (0)
#define K(k) ARCH "." k
    S(di_gguf_writer_add_str(w, "general.architecture", ARCH));
    S(di_gguf_writer_add_str(w, "general.name", "deepinfer synthetic DeepSeek V4"));
    S(di_gguf_writer_add_u32(w, "general.quantization_version", 2));
    S(di_gguf_writer_add_u32(w, "general.file_type", file_type(mode)));
    S(di_gguf_writer_add_u32(w, K("vocab_size"), (uint32_t)hp->n_vocab));
    S(di_gguf_writer_add_u32(w, K("context_length"), (uint32_t)hp->max_pos));
    S(di_gguf_writer_add_u32(w, K("embedding_length"), (uint32_t)hp->n_embd));
    S(di_gguf_writer_add_u32(w, K("embedding_length_out"), (uint32_t)(hp->n_embd * hp->hc_mult)));
    S(di_gguf_writer_add_u32(w, K("feed_forward_length"), (uint32_t)hp->expert_ff));
    S(di_gguf_writer_add_u32(w, K("block_count"), (uint32_t)hp->n_layer));
    S(di_gguf_writer_add_u32(w, K("attention.head_count"), (uint32_t)hp->n_head));
    S(di_gguf_writer_add_u32(w, K("attention.head_count_kv"), 1));
    S(di_gguf_writer_add_u32(w, K("attention.key_length"), (uint32_t)hp->head_dim));
    S(di_gguf_writer_add_u32(w, K("attention.value_length"), (uint32_t)hp->head_dim));
    S(di_gguf_writer_add_f32(w, K("attention.layer_norm_rms_epsilon"), hp->norm_eps));
    S(di_gguf_writer_add_u32(w, K("attention.q_lora_rank"), (uint32_t)hp->q_lora_rank));
    S(di_gguf_writer_add_u32(w, K("attention.sliding_window"), (uint32_t)hp->window));
    S(di_gguf_writer_add_u32(w, K("attention.output_group_count"), (uint32_t)hp->o_groups));
    S(di_gguf_writer_add_u32(w, K("attention.output_lora_rank"), (uint32_t)hp->o_lora_rank));
    S(di_gguf_writer_add_u32(w, K("attention.indexer.head_count"), (uint32_t)hp->n_index_head));
    S(di_gguf_writer_add_u32(w, K("attention.indexer.key_length"), (uint32_t)hp->index_head_dim));
    S(di_gguf_writer_add_u32(w, K("attention.indexer.top_k"), (uint32_t)hp->index_topk));
    uint32_t ratios[DI_MAX_LAYERS];
    float clamp[DI_MAX_LAYERS], clamp_sh[DI_MAX_LAYERS];
    int n_hash = 0;
    for (int il = 0; il < hp->n_layer; il++) {
        ratios[il] = (uint32_t)hp->compress_ratio[il];
        clamp[il] = hp->swiglu_limit;
        clamp_sh[il] = hp->shared_expert_clamp ? hp->swiglu_limit : 0.0f;
        if (hp->hash_routed[il]) n_hash = il + 1;
    }
    S(di_gguf_writer_add_arr(w, K("attention.compress_ratios"), DI_GGUF_VTYPE_UINT32, ratios,
                             (uint64_t)hp->n_layer));
    S(di_gguf_writer_add_f32(w, K("attention.compress_rope_freq_base"), hp->rope_compress.theta));
    S(di_gguf_writer_add_u32(w, K("rope.dimension_count"), (uint32_t)hp->rope_main.n_dims));
    S(di_gguf_writer_add_f32(w, K("rope.freq_base"), hp->rope_main.theta));
    if (hp->rope_compress.yarn) {
        S(di_gguf_writer_add_str(w, K("rope.scaling.type"), "yarn"));
        S(di_gguf_writer_add_f32(w, K("rope.scaling.factor"), hp->rope_compress.factor));
        S(di_gguf_writer_add_u32(w, K("rope.scaling.original_context_length"),
                                 (uint32_t)hp->rope_compress.original_max_pos));
        S(di_gguf_writer_add_f32(w, K("rope.scaling.yarn_beta_fast"), hp->rope_compress.beta_fast));
        S(di_gguf_writer_add_f32(w, K("rope.scaling.yarn_beta_slow"), hp->rope_compress.beta_slow));
    }
    S(di_gguf_writer_add_u32(w, K("expert_count"), (uint32_t)hp->n_expert));
    S(di_gguf_writer_add_u32(w, K("expert_used_count"), (uint32_t)hp->n_expert_used));
    S(di_gguf_writer_add_u32(w, K("expert_shared_count"), (uint32_t)hp->n_expert_shared));
    S(di_gguf_writer_add_u32(w, K("expert_feed_forward_length"), (uint32_t)hp->expert_ff));
    S(di_gguf_writer_add_f32(w, K("expert_weights_scale"), hp->route_scale));
    S(di_gguf_writer_add_bool(w, K("expert_weights_norm"), true));
    S(di_gguf_writer_add_u32(w, K("expert_gating_func"), 4)); // sqrtsoftplus
    S(di_gguf_writer_add_arr(w, K("swiglu_clamp_exp"), DI_GGUF_VTYPE_FLOAT32, clamp,
                             (uint64_t)hp->n_layer));
    S(di_gguf_writer_add_arr(w, K("swiglu_clamp_shexp"), DI_GGUF_VTYPE_FLOAT32, clamp_sh,
                             (uint64_t)hp->n_layer));
    S(di_gguf_writer_add_u32(w, K("hyper_connection.count"), (uint32_t)hp->hc_mult));
    S(di_gguf_writer_add_u32(w, K("hyper_connection.sinkhorn_iterations"), (uint32_t)hp->hc_iters));
    S(di_gguf_writer_add_f32(w, K("hyper_connection.epsilon"), hp->hc_eps));
    S(di_gguf_writer_add_u32(w, K("hash_layer_count"), (uint32_t)n_hash));
    // No tokenizer travels with a synthetic checkpoint: llama.cpp then makes vocab_size dummy
    // tokens (its "none" vocabulary); deepinfer reads only the ids.
    S(di_gguf_writer_add_str(w, "tokenizer.ggml.model", "none"));
    S(di_gguf_writer_add_u32(w, "tokenizer.ggml.bos_token_id", (uint32_t)hp->bos_token));
    S(di_gguf_writer_add_u32(w, "tokenizer.ggml.eos_token_id", (uint32_t)hp->eos_token));
#undef K
#undef S
    return st;
}

static di_status add_item(conv *c, di_gguf_writer *w, const char *gname, const item *it, int n_dims,
                          const int64_t *ne) {
    if (n_dims == 0) n_dims = 1;
    di_status st = di_gguf_writer_add_tensor(w, gname, it->type, n_dims, ne, NULL);
    if (st != DI_OK) {
        DI_LOG_ERROR("convert: cannot add %s (%s)", gname, di_ggml_type_name(it->type));
        return st;
    }
    c->items[c->n_items++] = *it;
    return DI_OK;
}

di_status di_dsv4_gguf_convert(const char *src_dir, const char *dst_path, const char *type) {
    static const char *const k_modes[] = {"q8_0", "q4_k", "bf16", "f16", "f32"};
    bool known = false;
    for (size_t i = 0; i < sizeof k_modes / sizeof k_modes[0]; i++)
        known |= strcmp(type, k_modes[i]) == 0;
    if (!known) {
        DI_LOG_ERROR("convert: unknown type \"%s\" (q8_0, q4_k, bf16, f16, f32)", type);
        return DI_ERR_INVALID;
    }
    di_hparams hp;
    di_st_set *st_set = NULL;
    di_gguf_writer *w = NULL;
    conv c = {0};
    char path[4096];
    snprintf(path, sizeof path, "%s/config.json", src_dir);
    di_status st = di_hparams_load(path, &hp);
    if (st != DI_OK) return st;
    if ((st = di_st_set_open_dir(src_dir, &st_set)) != DI_OK) return st;
    if (!di_st_set_find(st_set, "embed.weight")) {
        DI_LOG_ERROR("convert: %s is not in the official layout (embed.weight, layers.N....)",
                     src_dir);
        st = DI_ERR_INVALID;
        goto fail;
    }
    int64_t n_src = di_st_set_n_tensors(st_set);
    c.st = st_set;
    c.hp = &hp;
    c.items = di_calloc((size_t)n_src + 1, sizeof *c.items);
    int64_t widest = 1;
    for (int64_t i = 0; i < n_src; i++) {
        const di_st_tensor *t = di_st_set_tensor(st_set, i);
        int64_t cols = t->shape[t->n_dims > 0 ? t->n_dims - 1 : 0] * 2; // FP4 packs two
        if (cols > widest) widest = cols;
    }
    c.row = di_malloc(sizeof(float) * (size_t)widest);
    if (!c.items || !c.row || di_gguf_writer_create(&w) != DI_OK) {
        st = DI_ERR_NOMEM;
        goto fail;
    }
    if ((st = add_metadata(w, &hp, type)) != DI_OK) goto fail;
    for (int64_t i = 0; i < n_src; i++) {
        const di_st_tensor *t = di_st_set_tensor(st_set, i);
        const char *name = t->name;
        size_t len = strlen(name);
        if (strncmp(name, "mtp.", 4) == 0) continue; // dropped, as llama.cpp's converter does
        if (len > 6 && strcmp(name + len - 6, ".scale") == 0 && t->dtype == DI_DTYPE_F8_E8M0)
            continue; // read with its weight
        int il = -1;
        sscanf(name, "layers.%d.", &il);
        // Hash layers route by tid2eid; llama.cpp's converter drops their unused gate bias.
        if (il >= 0 && il < hp.n_layer && hp.hash_routed[il] && strstr(name, ".ffn.gate.bias"))
            continue;
        item it = {.kind = ITEM_PLAIN, .src = t, .n_mat = 1};
        char gname[96];
        const char *ex = strstr(name, ".ffn.experts.");
        if (ex) {
            long e;
            char wk[4] = {0};
            if (sscanf(ex, ".ffn.experts.%ld.%2s", &e, wk) != 2 || (wk[1] < '1' || wk[1] > '3')) {
                DI_LOG_ERROR("convert: unexpected expert tensor %s", name);
                st = DI_ERR_FORMAT;
                goto fail;
            }
            if (e != 0) continue; // the stack is written when expert 0 is met
            di_tensor src;
            if ((st = src_tensor(&c, t, &src)) != DI_OK) goto fail;
            it.kind = ITEM_EXPERTS;
            snprintf(it.prefix, sizeof it.prefix, "layers.%d.", il);
            memcpy(it.wk, wk, 3);
            it.rows = src.ne[1];
            it.cols = src.ne[0];
            it.n_mat = hp.n_expert;
            // FP4 experts repack exactly to MXFP4, except in q4_k (everything Q4_K) and f32: there
            // they are F32 (exact too), so that the file holds no quantised tensor at all and
            // llama.cpp, which multiplies MXFP4 by 8-bit-quantised activations, computes in f32.
            bool mx = src.kind == DI_TENSOR_KIND_FP4 && strcmp(type, "q4_k") != 0 &&
                      strcmp(type, "f32") != 0;
            it.type = mx ? DI_GGML_TYPE_MXFP4 : pick_type(type, name, t->dtype, it.cols);
            static const char *const gn[3] = {"ffn_gate_exps", "ffn_down_exps", "ffn_up_exps"};
            snprintf(gname, sizeof gname, "blk.%d.%s.weight", il, gn[wk[1] - '1']);
            int64_t ne[3] = {it.cols, it.rows, it.n_mat};
            if ((st = add_item(&c, w, gname, &it, 3, ne)) != DI_OK) goto fail;
            continue;
        }
        if (!translate(name, 1, gname, sizeof gname)) {
            DI_LOG_ERROR("convert: tensor %s has no llama.cpp deepseek4 name", name);
            st = DI_ERR_FORMAT;
            goto fail;
        }
        if (strstr(name, ".ffn.gate.tid2eid")) {
            it.kind = ITEM_TID2EID;
            it.type = DI_GGML_TYPE_I32;
            int64_t ne[2] = {t->shape[1], t->shape[0]};
            if ((st = add_item(&c, w, gname, &it, 2, ne)) != DI_OK) goto fail;
            continue;
        }
        di_tensor src;
        if ((st = src_tensor(&c, t, &src)) != DI_OK) goto fail;
        it.rows = src.ne[1];
        it.cols = src.ne[0];
        it.type = t->n_dims <= 1 ? DI_GGML_TYPE_F32 : pick_type(type, name, t->dtype, it.cols);
        if (t->n_dims <= 1) {
            int64_t ne[1] = {it.cols};
            st = add_item(&c, w, gname, &it, 1, ne);
        } else {
            int64_t ne[2] = {it.cols, it.rows};
            st = add_item(&c, w, gname, &it, 2, ne);
        }
        if (st != DI_OK) goto fail;
    }
    DI_LOG_INFO("convert: writing %lld tensors to %s (%s)", (long long)c.n_items, dst_path, type);
    st = di_gguf_writer_write_file(w, dst_path, fill_item, &c);
fail:
    di_gguf_writer_destroy(w);
    di_free(c.items);
    di_free(c.row);
    di_st_set_close(st_set);
    return st;
}

di_status di_convert_gguf(const char *src_dir, const char *dst_path, const char *type) {
    return di_dsv4_gguf_convert(src_dir, dst_path, type);
}
