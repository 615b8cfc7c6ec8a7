// weights — binds checkpoint tensors to di_model (see dsv4.h). Two namings are accepted for every
// tensor: DeepSeek's official one (layers.N.attn.wq_a.weight, FP8/FP4 with .scale tensors) and the
// Hugging Face module names (model.layers.N.self_attn.q_a_proj.weight, float). Each tensor is
// looked up under the official name first, then the HF name (spec §4.2, §4.5). Every shape and
// dtype is checked against the config; afterwards every tensor of the checkpoint must have been
// used, so a missing, misnamed or extra tensor is an error that names it.
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#include "base/log.h"
#include "base/status.h"
#include "base/mem.h"
#include "base/hash.h" // di_fnv1a
#include "model/dsv4.h"
#include "tensor/quant_ref.h"

// ---- binding context ----

typedef struct binder {
    di_model *m;
    const di_st_tensor **used; // owned list of bound tensors
    int64_t n_used, cap_used;
} binder;

static di_status mark_used(binder *b, const di_st_tensor *t) {
    if (b->n_used == b->cap_used) {
        int64_t cap = b->cap_used ? 2 * b->cap_used : 256;
        const di_st_tensor **p = di_realloc(b->used, sizeof *p * (size_t)cap);
        if (!p) return DI_ERR_NOMEM;
        b->used = p;
        b->cap_used = cap;
    }
    b->used[b->n_used++] = t;
    return DI_OK;
}

static void *own(di_model *m, size_t bytes) {
    if (m->n_owned == m->cap_owned) {
        int64_t cap = m->cap_owned ? 2 * m->cap_owned : 256;
        void **p = di_realloc(m->owned, sizeof *p * (size_t)cap);
        if (!p) return NULL;
        m->owned = p;
        m->cap_owned = cap;
    }
    void *mem = di_malloc(bytes);
    if (mem) m->owned[m->n_owned++] = mem;
    return mem;
}

// An official name as published ("layers.3.attn.wq_a.weight") or as transformers'
// save_pretrained writes it after reverting its conversion mapping ("model.layers.3.attn.wq_a...").
static const di_st_tensor *find_official(binder *b, const char *off) {
    if (!off) return NULL;
    const di_st_tensor *t = di_st_set_find(b->m->st, off);
    if (!t) {
        char buf[300];
        snprintf(buf, sizeof buf, "model.%s", off);
        t = di_st_set_find(b->m->st, buf);
    }
    return t;
}

// Finds the official name (either form above), else the HF module name (either may be NULL).
// *which receives the name asked for.
static const di_st_tensor *lookup(binder *b, const char *off, const char *hf, const char **which) {
    const di_st_tensor *t = find_official(b, off);
    if (t)
        *which = off;
    else if (hf && (t = di_st_set_find(b->m->st, hf)))
        *which = hf;
    return t;
}

static di_status missing(const char *off, const char *hf) {
    if (off && hf)
        DI_LOG_ERROR("checkpoint: missing tensor %s (or %s)", off, hf);
    else
        DI_LOG_ERROR("checkpoint: missing tensor %s", off ? off : hf);
    return DI_ERR_FORMAT;
}

static void fmt_shape(const di_st_tensor *t, char *buf, size_t cap) {
    size_t n = (size_t)snprintf(buf, cap, "[");
    for (int i = 0; i < t->n_dims && n < cap; i++)
        n += (size_t)snprintf(buf + n, cap - n, "%s%lld", i ? ", " : "", (long long)t->shape[i]);
    if (n < cap) snprintf(buf + n, cap - n, "]");
}

static di_status bad_shape(const di_st_tensor *t, int nd, const int64_t *want) {
    char got[128], exp[128];
    fmt_shape(t, got, sizeof got);
    size_t n = (size_t)snprintf(exp, sizeof exp, "[");
    for (int i = 0; i < nd && n < sizeof exp; i++)
        n += (size_t)snprintf(exp + n, sizeof exp - n, "%s%lld", i ? ", " : "", (long long)want[i]);
    if (n < sizeof exp) snprintf(exp + n, sizeof exp - n, "]");
    DI_LOG_ERROR("checkpoint: tensor %s has shape %s %s, expected %s from config.json", t->name,
                 di_dtype_name(t->dtype), got, exp);
    return DI_ERR_FORMAT;
}

static bool shape_is(const di_st_tensor *t, int nd, const int64_t *want) {
    if (t->n_dims != nd) return false;
    for (int i = 0; i < nd; i++)
        if (t->shape[i] != want[i]) return false;
    return true;
}

static di_tensor_kind float_kind(di_dtype d) {
    return d == DI_DTYPE_F32   ? DI_TENSOR_KIND_F32
           : d == DI_DTYPE_F16 ? DI_TENSOR_KIND_F16
                               : DI_TENSOR_KIND_BF16;
}

static bool is_plain_float(di_dtype d) {
    return d == DI_DTYPE_F32 || d == DI_DTYPE_F16 || d == DI_DTYPE_BF16;
}

// The di_tensor kind of a ggml block dtype (GGUF files).
static di_tensor_kind ggml_kind(di_dtype d) {
    switch (d) {
    case DI_DTYPE_GGML_Q8_0:
        return DI_TENSOR_KIND_Q8_0;
    case DI_DTYPE_GGML_Q4_K:
        return DI_TENSOR_KIND_Q4_K;
    case DI_DTYPE_GGML_Q2_K:
        return DI_TENSOR_KIND_Q2_K;
    case DI_DTYPE_GGML_IQ2_XXS:
        return DI_TENSOR_KIND_IQ2_XXS;
    default:
        return DI_TENSOR_KIND_MXFP4;
    }
}

// Bytes of one row of n_in elements of a ggml block dtype (the GGUF parser checked that n_in is a
// multiple of the block).
static size_t ggml_row_bytes(di_dtype d, int64_t n_in) {
    int64_t be;
    size_t bb;
    di_tensor_kind_block(ggml_kind(d), &be, &bb);
    return (size_t)(n_in / be) * bb;
}

// The scale tensor of an FP8/FP4 weight: "<x>.scale" for "<x>.weight" (official), or
// "<x>.weight_scale_inv" (HF's FP8 naming; also a multiplier).
static const di_st_tensor *find_scale(binder *b, const char *wname) {
    char buf[256];
    size_t n = strlen(wname);
    if (n > 7 && strcmp(wname + n - 7, ".weight") == 0) {
        snprintf(buf, sizeof buf, "%.*s.scale", (int)(n - 7), wname);
        const di_st_tensor *t = di_st_set_find(b->m->st, buf);
        if (t) return t;
    }
    snprintf(buf, sizeof buf, "%s_scale_inv", wname);
    return di_st_set_find(b->m->st, buf);
}

enum { ALLOW_FP8 = 1, ALLOW_FP4 = 2, FP8_ROW32 = 4 }; // FP8_ROW32: one scale per row and 32 columns

// A [n_out, n_in] matrix: float, or FP8 / FP4 block-quantised where `allow` says so.
static di_status bind_matrix_t(binder *b, const di_st_tensor *t, int64_t n_out, int64_t n_in,
                               int allow, di_tensor *out) {
    const di_hparams *hp = &b->m->hp;
    int64_t want[2] = {n_out, n_in};
    di_tensor w = {.name = t->name, .ne = {n_in, n_out}, .data = t->data};
    if (is_plain_float(t->dtype)) {
        if (!shape_is(t, 2, want)) return bad_shape(t, 2, want);
        w.kind = float_kind(t->dtype);
        w.nb1 = (size_t)n_in * di_dtype_size(t->dtype);
    } else if (di_dtype_is_ggml_block(t->dtype)) { // GGUF: any matrix may be block-quantised
        if (!shape_is(t, 2, want)) return bad_shape(t, 2, want);
        w.kind = ggml_kind(t->dtype);
        w.nb1 = ggml_row_bytes(t->dtype, n_in);
    } else if (t->dtype == DI_DTYPE_F8_E4M3 && (allow & ALLOW_FP8)) {
        if (!shape_is(t, 2, want)) return bad_shape(t, 2, want);
        const di_st_tensor *s = find_scale(b, t->name);
        if (!s) {
            DI_LOG_ERROR("checkpoint: FP8 tensor %s has no .scale tensor", t->name);
            return DI_ERR_FORMAT;
        }
        int64_t bo = hp->fp8_block_out, bi = hp->fp8_block_in;
        if (allow & FP8_ROW32) bo = 1, bi = 32; // Engram tables (V4.1 §6.3)
        int64_t swant[2] = {(n_out + bo - 1) / bo, (n_in + bi - 1) / bi};
        if (s->dtype != DI_DTYPE_F8_E8M0) {
            DI_LOG_ERROR("checkpoint: scale tensor %s is %s; UE8M0 (F8_E8M0) scales are "
                         "supported",
                         s->name, di_dtype_name(s->dtype));
            return DI_ERR_FORMAT;
        }
        if (!shape_is(s, 2, swant)) return bad_shape(s, 2, swant);
        w.kind = DI_TENSOR_KIND_FP8;
        w.nb1 = (size_t)n_in;
        w.scale = s->data;
        w.scale_nb1 = (size_t)swant[1];
        w.block_out = (int32_t)bo;
        w.block_in = (int32_t)bi;
        di_status st = mark_used(b, s);
        if (st != DI_OK) return st;
    } else if ((t->dtype == DI_DTYPE_I8 || t->dtype == DI_DTYPE_U8) && (allow & ALLOW_FP4)) {
        int64_t pwant[2] = {n_out, n_in / 2};
        if (n_in % 32 != 0 || !shape_is(t, 2, pwant)) return bad_shape(t, 2, pwant);
        const di_st_tensor *s = find_scale(b, t->name);
        if (!s) {
            DI_LOG_ERROR("checkpoint: FP4 tensor %s has no .scale tensor", t->name);
            return DI_ERR_FORMAT;
        }
        int64_t swant[2] = {n_out, n_in / 32};
        if (s->dtype != DI_DTYPE_F8_E8M0) {
            DI_LOG_ERROR("checkpoint: scale tensor %s is %s, expected F8_E8M0", s->name,
                         di_dtype_name(s->dtype));
            return DI_ERR_FORMAT;
        }
        if (!shape_is(s, 2, swant)) return bad_shape(s, 2, swant);
        w.kind = DI_TENSOR_KIND_FP4;
        w.nb1 = (size_t)(n_in / 2);
        w.scale = s->data;
        w.scale_nb1 = (size_t)swant[1];
        w.block_out = 1;
        w.block_in = 32;
        di_status st = mark_used(b, s);
        if (st != DI_OK) return st;
    } else {
        DI_LOG_ERROR("checkpoint: tensor %s has dtype %s, which is not allowed here (%s)", t->name,
                     di_dtype_name(t->dtype),
                     allow & ALLOW_FP4   ? "float, FP8 or packed FP4"
                     : allow & ALLOW_FP8 ? "float or FP8"
                                         : "float");
        return DI_ERR_FORMAT;
    }
    *out = w;
    return mark_used(b, t);
}

static di_status bind_matrix(binder *b, const char *off, const char *hf, int64_t n_out,
                             int64_t n_in, int allow, di_tensor *out) {
    const char *which = NULL;
    const di_st_tensor *t = lookup(b, off, hf, &which);
    if (!t) return missing(off, hf);
    return bind_matrix_t(b, t, n_out, n_in, allow, out);
}

// A float tensor of exactly `nd` dims copied to an owned FP32 array.
static di_status bind_f32(binder *b, const char *off, const char *hf, int nd, int64_t d0,
                          int64_t d1, float **out) {
    const char *which = NULL;
    const di_st_tensor *t = lookup(b, off, hf, &which);
    if (!t) return missing(off, hf);
    int64_t want[2] = {d0, d1};
    bool block = di_dtype_is_ggml_block(t->dtype);
    if (!is_plain_float(t->dtype) && !block) {
        DI_LOG_ERROR("checkpoint: tensor %s has dtype %s, expected a float type", t->name,
                     di_dtype_name(t->dtype));
        return DI_ERR_FORMAT;
    }
    if (!shape_is(t, nd, want)) return bad_shape(t, nd, want);
    int64_t n = nd == 1 ? d0 : d0 * d1;
    float *v = own(b->m, sizeof(float) * (size_t)n);
    if (!v) return DI_ERR_NOMEM;
    if (block) { // a quantised GGUF vector or matrix: dequantise row by row
        int64_t n_in = nd == 1 ? d0 : d1, n_rows = nd == 1 ? 1 : d0;
        di_tensor w = {.name = t->name,
                       .kind = ggml_kind(t->dtype),
                       .ne = {n_in, n_rows},
                       .nb1 = ggml_row_bytes(t->dtype, n_in),
                       .data = t->data};
        for (int64_t r = 0; r < n_rows; r++) di_tensor_row_f32(&w, r, v + r * n_in);
    } else {
        di_dequant_row_f32(t->dtype, t->data, n, v);
    }
    *out = v;
    return mark_used(b, t);
}

// ---- names ----

typedef struct names {
    char off[256], hf[256];
} names;

static const char *fmt(char *buf, const char *prefix, const char *suffix) {
    if (!prefix) return NULL;
    snprintf(buf, 256, "%s%s", prefix, suffix);
    return buf;
}

// ---- one decoder block ----

static di_status bind_hc(binder *b, const char *po, const char *ph, const char *site,
                         di_dsv4_hc_w *hc) {
    const di_hparams *hp = &b->m->hp;
    int64_t nc = hp->hc_mult, mix = (2 + nc) * nc, w = nc * hp->n_embd;
    char o1[256], h1[256], s_off[64], s_hf[64];
    di_status st;
    snprintf(s_off, sizeof s_off, "hc_%s_fn", site);
    snprintf(s_hf, sizeof s_hf, "%s_hc.fn", site);
    st = bind_matrix(b, fmt(o1, po, s_off), fmt(h1, ph, s_hf), mix, w, 0, &hc->fn);
    if (st != DI_OK) return st;
    snprintf(s_off, sizeof s_off, "hc_%s_base", site);
    snprintf(s_hf, sizeof s_hf, "%s_hc.base", site);
    st = bind_f32(b, fmt(o1, po, s_off), fmt(h1, ph, s_hf), 1, mix, 0, &hc->base);
    if (st != DI_OK) return st;
    snprintf(s_off, sizeof s_off, "hc_%s_scale", site);
    snprintf(s_hf, sizeof s_hf, "%s_hc.scale", site);
    return bind_f32(b, fmt(o1, po, s_off), fmt(h1, ph, s_hf), 1, 3, 0, &hc->scale);
}

static di_status bind_compressor(binder *b, const char *po, const char *ph, int32_t m, int32_t d,
                                 di_dsv4_compressor_w *c) {
    const di_hparams *hp = &b->m->hp;
    char o[256], h[256];
    c->m = m;
    c->c = m == 4 ? 2 : 1;
    c->d = d;
    int64_t w = (int64_t)c->c * d;
    di_status st;
    if ((st = bind_matrix(b, fmt(o, po, "wkv.weight"), fmt(h, ph, "kv_proj.weight"), w, hp->n_embd,
                          0, &c->wkv)) != DI_OK)
        return st;
    if ((st = bind_matrix(b, fmt(o, po, "wgate.weight"), fmt(h, ph, "gate_proj.weight"), w,
                          hp->n_embd, 0, &c->wgate)) != DI_OK)
        return st;
    if ((st = bind_f32(b, fmt(o, po, "ape"), fmt(h, ph, "position_bias"), 2, m, w, &c->ape)) !=
        DI_OK)
        return st;
    return bind_f32(b, fmt(o, po, "norm.weight"), fmt(h, ph, "kv_norm.weight"), 1, d, 0, &c->norm);
}

static di_status bind_tid2eid(binder *b, const char *off, const char *hf, int32_t **out) {
    const di_hparams *hp = &b->m->hp;
    const char *which = NULL;
    const di_st_tensor *t = lookup(b, off, hf, &which);
    if (!t) return missing(off, hf);
    int64_t want[2] = {hp->n_vocab, hp->n_expert_used};
    if (t->dtype != DI_DTYPE_I64 && t->dtype != DI_DTYPE_I32) {
        DI_LOG_ERROR("checkpoint: tensor %s has dtype %s, expected I64 or I32", t->name,
                     di_dtype_name(t->dtype));
        return DI_ERR_FORMAT;
    }
    if (!shape_is(t, 2, want)) return bad_shape(t, 2, want);
    int64_t n = want[0] * want[1];
    int32_t *v = own(b->m, sizeof(int32_t) * (size_t)n);
    if (!v) return DI_ERR_NOMEM;
    for (int64_t i = 0; i < n; i++) {
        int64_t e;
        if (t->dtype == DI_DTYPE_I64)
            memcpy(&e, (const char *)t->data + 8 * i, 8);
        else {
            int32_t e32;
            memcpy(&e32, (const char *)t->data + 4 * i, 4);
            e = e32;
        }
        if (e < 0 || e >= hp->n_expert) {
            DI_LOG_ERROR("checkpoint: tensor %s holds expert id %lld at token %lld, outside "
                         "[0, %d)",
                         t->name, (long long)e, (long long)(i / want[1]), hp->n_expert);
            return DI_ERR_FORMAT;
        }
        v[i] = (int32_t)e;
    }
    *out = v;
    return mark_used(b, t);
}

static di_status bind_experts(binder *b, const char *po, const char *ph, di_dsv4_layer_w *lw) {
    const di_hparams *hp = &b->m->hp;
    int64_t E = lw->n_expert, F = hp->expert_ff, D = hp->n_embd;
    lw->w1 = own(b->m, sizeof(di_tensor) * (size_t)E);
    lw->w2 = own(b->m, sizeof(di_tensor) * (size_t)E);
    lw->w3 = own(b->m, sizeof(di_tensor) * (size_t)E);
    if (!lw->w1 || !lw->w2 || !lw->w3) return DI_ERR_NOMEM;
    char o[256], h[256];
    di_status st;
    // HF stacks experts: gate_up_proj [E, 2F, D] (rows 0..F-1 = w1), down_proj [E, D, F].
    const di_st_tensor *gu =
        ph ? di_st_set_find(b->m->st, fmt(h, ph, "mlp.experts.gate_up_proj")) : NULL;
    if (gu) {
        const di_st_tensor *dn = di_st_set_find(b->m->st, fmt(h, ph, "mlp.experts.down_proj"));
        if (!dn) return missing(h, NULL);
        int64_t wgu[3] = {E, 2 * F, D}, wdn[3] = {E, D, F};
        if (!shape_is(gu, 3, wgu) || !is_plain_float(gu->dtype)) return bad_shape(gu, 3, wgu);
        if (!shape_is(dn, 3, wdn) || !is_plain_float(dn->dtype)) return bad_shape(dn, 3, wdn);
        size_t es = di_dtype_size(gu->dtype), ed = di_dtype_size(dn->dtype);
        di_tensor all_gu = {.name = gu->name,
                            .kind = float_kind(gu->dtype),
                            .ne = {D, E * 2 * F},
                            .nb1 = (size_t)D * es,
                            .data = gu->data};
        di_tensor all_dn = {.name = dn->name,
                            .kind = float_kind(dn->dtype),
                            .ne = {F, E * D},
                            .nb1 = (size_t)F * ed,
                            .data = dn->data};
        for (int64_t e = 0; e < E; e++) {
            lw->w1[e] = di_tensor_rows(&all_gu, e * 2 * F, F);
            lw->w3[e] = di_tensor_rows(&all_gu, e * 2 * F + F, F);
            lw->w2[e] = di_tensor_rows(&all_dn, e * D, D);
        }
        if ((st = mark_used(b, gu)) != DI_OK) return st;
        return mark_used(b, dn);
    }
    // GGUF (llama.cpp deepseek4): three stacked tensors [E, F, D], [E, D, F], [E, F, D] of any
    // type, renamed to layers.N.ffn.experts.wK.stacked by dsv4_gguf.c.
    const di_st_tensor *s1 = po ? find_official(b, fmt(o, po, "ffn.experts.w1.stacked")) : NULL;
    if (s1) {
        const char *const stacked[3] = {"ffn.experts.w1.stacked", "ffn.experts.w2.stacked",
                                        "ffn.experts.w3.stacked"};
        di_tensor *dst[3] = {lw->w1, lw->w2, lw->w3};
        for (int k = 0; k < 3; k++) {
            const di_st_tensor *t = find_official(b, fmt(o, po, stacked[k]));
            if (!t) return missing(o, NULL);
            int64_t rows = k == 1 ? D : F, cols = k == 1 ? F : D;
            int64_t want[3] = {E, rows, cols};
            bool block = di_dtype_is_ggml_block(t->dtype);
            if (!shape_is(t, 3, want) || (!block && !is_plain_float(t->dtype)))
                return bad_shape(t, 3, want);
            di_tensor all = {.name = t->name,
                             .kind = block ? ggml_kind(t->dtype) : float_kind(t->dtype),
                             .ne = {cols, E * rows},
                             .nb1 = block ? ggml_row_bytes(t->dtype, cols)
                                          : (size_t)cols * di_dtype_size(t->dtype),
                             .data = t->data};
            for (int64_t e = 0; e < E; e++) dst[k][e] = di_tensor_rows(&all, e * rows, rows);
            if ((st = mark_used(b, t)) != DI_OK) return st;
        }
        return DI_OK;
    }
    if (!po) return missing(NULL, fmt(h, ph, "mlp.experts.gate_up_proj"));
    if (ph && !find_official(b, fmt(o, po, "ffn.experts.0.w1.weight")))
        return missing(o, fmt(h, ph, "mlp.experts.gate_up_proj"));
    for (int64_t e = 0; e < E; e++) {
        char sfx[96];
        snprintf(sfx, sizeof sfx, "ffn.experts.%lld.w1.weight", (long long)e);
        if ((st = bind_matrix(b, fmt(o, po, sfx), NULL, F, D, ALLOW_FP8 | ALLOW_FP4, &lw->w1[e])) !=
            DI_OK)
            return st;
        snprintf(sfx, sizeof sfx, "ffn.experts.%lld.w3.weight", (long long)e);
        if ((st = bind_matrix(b, fmt(o, po, sfx), NULL, F, D, ALLOW_FP8 | ALLOW_FP4, &lw->w3[e])) !=
            DI_OK)
            return st;
        snprintf(sfx, sizeof sfx, "ffn.experts.%lld.w2.weight", (long long)e);
        if ((st = bind_matrix(b, fmt(o, po, sfx), NULL, D, F, ALLOW_FP8 | ALLOW_FP4, &lw->w2[e])) !=
            DI_OK)
            return st;
    }
    return DI_OK;
}

// ---- DeepSeek V4.1 layer parts (deepseek-v41.md §6.2, §6.4) ----

// A tensor that may be absent (returns DI_OK with *found = false).
static bool has_tensor(binder *b, const char *off, const char *hf) {
    const char *which;
    return lookup(b, off, hf, &which) != NULL;
}

// CSA2 compressor of a kv source (m = 2: wkv + wgate, m = 1: wkv only; no ape), the index-key
// projection of kv sources, the indexer queries of index sources, and the Engram module.
static di_status bind_v41_attn_extra(binder *b, const char *po, const char *ph, int il,
                                     di_dsv4_layer_w *lw) {
    const di_hparams *hp = &b->m->hp;
    const bool main_layer = il < hp->n_layer;
    int64_t D = hp->n_embd, Dh = hp->head_dim, Rq = hp->q_lora_rank;
    int64_t HI = hp->n_index_head, DI = hp->index_head_dim;
    char o[256], h[256];
    di_status st;
    lw->kv_source = main_layer && hp->kv_source[il];
    lw->index_source = main_layer && hp->index_source[il];
#define T(call)                                                                                    \
    do {                                                                                           \
        if ((st = (call)) != DI_OK) return st;                                                     \
    } while (0)
    if (lw->kv_source) {
        di_dsv4_compressor_w *c = &lw->cmp;
        c->m = lw->ratio;
        c->c = 1;
        c->d = (int32_t)Dh;
        T(bind_matrix(b, fmt(o, po, "attn.compressor.wkv.weight"),
                      fmt(h, ph, "self_attn.compressor.kv_proj.weight"), Dh, D, 0, &c->wkv));
        if (lw->ratio >= 2)
            T(bind_matrix(b, fmt(o, po, "attn.compressor.wgate.weight"),
                          fmt(h, ph, "self_attn.compressor.gate_proj.weight"), Dh, D, 0,
                          &c->wgate));
        T(bind_f32(b, fmt(o, po, "attn.compressor.norm.weight"),
                   fmt(h, ph, "self_attn.compressor.kv_norm.weight"), 1, Dh, 0, &c->norm));
        T(bind_matrix(b, fmt(o, po, "attn.indexer.wk.weight"),
                      fmt(h, ph, "self_attn.indexer.k_proj.weight"), DI, Dh, 0, &lw->idx_wk));
        T(bind_f32(b, fmt(o, po, "attn.indexer.k_norm.weight"),
                   fmt(h, ph, "self_attn.indexer.k_norm.weight"), 1, DI, 0, &lw->idx_k_norm));
    }
    if (lw->index_source) {
        T(bind_matrix(b, fmt(o, po, "attn.indexer.wq_b.weight"),
                      fmt(h, ph, "self_attn.indexer.q_b_proj.weight"), HI * DI, Rq, ALLOW_FP8,
                      &lw->idx_wq_b));
        T(bind_matrix(b, fmt(o, po, "attn.indexer.weights_proj.weight"),
                      fmt(h, ph, "self_attn.indexer.weights_proj.weight"), HI, D, 0,
                      &lw->idx_weights_proj));
    }
    for (int e = 0; e < hp->n_engram && main_layer; e++)
        if (hp->engram_layer[e] == il) lw->engram = e;
    if (lw->engram >= 0) {
        int64_t nc = hp->hc_mult, hd = hp->engram_head_dim;
        int64_t n_col = (int64_t)(hp->engram_max_ngram - 1) * hp->engram_n_head;
        char hf_tab[96];
        snprintf(hf_tab, sizeof hf_tab, "model.engram_tables.%d.weight", il);
        T(bind_matrix(b, fmt(o, po, "engram.embed.weight"), hf_tab, hp->engram_rows[lw->engram], hd,
                      ALLOW_FP8 | FP8_ROW32, &lw->eg_table));
        if (lw->eg_table.kind != DI_TENSOR_KIND_FP8) {
            // R-HF keeps weight_scale_inv next to a float table; it is unused there (ones).
            const di_st_tensor *sc = find_scale(b, lw->eg_table.name);
            if (sc && (st = mark_used(b, sc)) != DI_OK) return st;
        }
        T(bind_matrix(b, fmt(o, po, "engram.wkv.weight"), fmt(h, ph, "engram.wkv.weight"),
                      (nc + 1) * D, n_col * hd, ALLOW_FP8, &lw->eg_wkv));
        float *q = NULL, *k = NULL;
        T(bind_f32(b, fmt(o, po, "engram.q_weight"), fmt(h, ph, "engram.q_weight"), 2, nc, D, &q));
        T(bind_f32(b, fmt(o, po, "engram.k_weight"), fmt(h, ph, "engram.k_weight"), 2, nc, D, &k));
        for (int64_t i = 0; i < nc * D; i++) q[i] *= k[i];
        lw->eg_qk = q;
    } else if (main_layer &&
               (has_tensor(b, fmt(o, po, "engram.wkv.weight"), fmt(h, ph, "engram.wkv.weight")))) {
        DI_LOG_ERROR("checkpoint: layer %d has Engram tensors but is not in engram_layer_ids", il);
        return DI_ERR_FORMAT;
    }
#undef T
    return DI_OK;
}

// po: official prefix ("layers.3." / "mtp.0."), ph: HF prefix ("model.layers.3.") or NULL.
static di_status bind_block(binder *b, const char *po, const char *ph, int il,
                            di_dsv4_layer_w *lw) {
    const di_hparams *hp = &b->m->hp;
    int64_t D = hp->n_embd, H = hp->n_head, Dh = hp->head_dim, Rq = hp->q_lora_rank;
    const bool dspark = hp->v41 && il >= hp->n_layer;
    lw->n_expert = dspark ? hp->dspark_n_expert : hp->n_expert;
    lw->n_expert_used = dspark ? hp->dspark_n_expert_used : hp->n_expert_used;
    int64_t G = hp->o_groups, Ro = hp->o_lora_rank, E = lw->n_expert, F = hp->expert_ff;
    char o[256], h[256], po2[256], ph2[256];
    di_status st;
    lw->il = il;
    lw->ratio = hp->compress_ratio[il];
    lw->hash_routed = hp->hash_routed[il];
    lw->engram = -1;
#define T(call)                                                                                    \
    do {                                                                                           \
        if ((st = (call)) != DI_OK) return st;                                                     \
    } while (0)
    T(bind_f32(b, fmt(o, po, "attn_norm.weight"), fmt(h, ph, "input_layernorm.weight"), 1, D, 0,
               &lw->attn_norm));
    T(bind_f32(b, fmt(o, po, "ffn_norm.weight"), fmt(h, ph, "post_attention_layernorm.weight"), 1,
               D, 0, &lw->ffn_norm));
    T(bind_hc(b, po, ph, "attn", &lw->hc_attn));
    T(bind_hc(b, po, ph, "ffn", &lw->hc_ffn));
    // attention
    T(bind_matrix(b, fmt(o, po, "attn.wq_a.weight"), fmt(h, ph, "self_attn.q_a_proj.weight"), Rq, D,
                  ALLOW_FP8, &lw->wq_a));
    T(bind_f32(b, fmt(o, po, "attn.q_norm.weight"), fmt(h, ph, "self_attn.q_a_norm.weight"), 1, Rq,
               0, &lw->q_norm));
    T(bind_matrix(b, fmt(o, po, "attn.wq_b.weight"), fmt(h, ph, "self_attn.q_b_proj.weight"),
                  H * Dh, Rq, ALLOW_FP8, &lw->wq_b));
    T(bind_matrix(b, fmt(o, po, "attn.wkv.weight"), fmt(h, ph, "self_attn.kv_proj.weight"), Dh, D,
                  ALLOW_FP8, &lw->wkv));
    // save_pretrained (transformers 5.x) writes the attention's kv_norm back as "attn.norm": its
    // reverted mapping renames every kv_norm to norm, the compressors' as intended.
    const char *kvn = fmt(o, po, "attn.kv_norm.weight");
    if (!find_official(b, kvn) && find_official(b, fmt(po2, po, "attn.norm.weight"))) kvn = po2;
    T(bind_f32(b, kvn, fmt(h, ph, "self_attn.kv_norm.weight"), 1, Dh, 0, &lw->kv_norm));
    T(bind_matrix(b, fmt(o, po, "attn.wo_a.weight"), fmt(h, ph, "self_attn.o_a_proj.weight"),
                  G * Ro, H * Dh / G, ALLOW_FP8, &lw->wo_a));
    T(bind_matrix(b, fmt(o, po, "attn.wo_b.weight"), fmt(h, ph, "self_attn.o_b_proj.weight"), D,
                  G * Ro, ALLOW_FP8, &lw->wo_b));
    T(bind_f32(b, fmt(o, po, "attn.attn_sink"), fmt(h, ph, "self_attn.sinks"), 1, H, 0,
               &lw->attn_sink));
    if (hp->v41) {
        T(bind_v41_attn_extra(b, po, ph, il, lw));
    } else if (lw->ratio > 0) {
        T(bind_compressor(b, fmt(po2, po, "attn.compressor."),
                          fmt(ph2, ph, "self_attn.compressor."), lw->ratio, (int32_t)Dh, &lw->cmp));
    }
    if (lw->ratio == 4 && !hp->v41) {
        int64_t HI = hp->n_index_head, DI = hp->index_head_dim;
        T(bind_compressor(b, fmt(po2, po, "attn.indexer.compressor."),
                          fmt(ph2, ph, "self_attn.compressor.indexer."), 4, (int32_t)DI,
                          &lw->idx_cmp));
        T(bind_matrix(b, fmt(o, po, "attn.indexer.wq_b.weight"),
                      fmt(h, ph, "self_attn.compressor.indexer.q_b_proj.weight"), HI * DI, Rq,
                      ALLOW_FP8, &lw->idx_wq_b));
        // Newest HF revision: indexer.scorer.weights_proj; older: indexer.weights_proj.
        const char *hf_wp = fmt(h, ph, "self_attn.compressor.indexer.scorer.weights_proj.weight");
        if (ph && !di_st_set_find(b->m->st, hf_wp))
            hf_wp = fmt(h, ph, "self_attn.compressor.indexer.weights_proj.weight");
        T(bind_matrix(b, fmt(o, po, "attn.indexer.weights_proj.weight"), hf_wp, HI, D, 0,
                      &lw->idx_weights_proj));
    }
    // MoE
    T(bind_matrix(b, fmt(o, po, "ffn.gate.weight"), fmt(h, ph, "mlp.gate.weight"), E, D, 0,
                  &lw->gate));
    if (lw->hash_routed)
        T(bind_tid2eid(b, fmt(o, po, "ffn.gate.tid2eid"), fmt(h, ph, "mlp.gate.tid2eid"),
                       &lw->tid2eid));
    else
        T(bind_f32(b, fmt(o, po, "ffn.gate.bias"), fmt(h, ph, "mlp.gate.e_score_correction_bias"),
                   1, E, 0, &lw->gate_bias));
    // V4.1 image-span routing bias: bound when present (the release has it; R-OFF test models and
    // DSpark blocks may not), unused by text.
    if (hp->v41 && has_tensor(b, fmt(o, po, "ffn.gate.bias_vl"),
                              fmt(h, ph, "mlp.gate.e_score_correction_bias_vl")))
        T(bind_f32(b, fmt(o, po, "ffn.gate.bias_vl"),
                   fmt(h, ph, "mlp.gate.e_score_correction_bias_vl"), 1, E, 0, &lw->gate_bias_vl));
    T(bind_experts(b, po, ph, lw));
    T(bind_matrix(b, fmt(o, po, "ffn.shared_experts.w1.weight"),
                  fmt(h, ph, "mlp.shared_experts.gate_proj.weight"), F, D, ALLOW_FP8, &lw->sh_w1));
    T(bind_matrix(b, fmt(o, po, "ffn.shared_experts.w3.weight"),
                  fmt(h, ph, "mlp.shared_experts.up_proj.weight"), F, D, ALLOW_FP8, &lw->sh_w3));
    T(bind_matrix(b, fmt(o, po, "ffn.shared_experts.w2.weight"),
                  fmt(h, ph, "mlp.shared_experts.down_proj.weight"), D, F, ALLOW_FP8, &lw->sh_w2));
#undef T
    return DI_OK;
}

static di_status bind_head_hc(binder *b, const char *off_fn, const char *off_base,
                              const char *off_scale, const char *hf_fn, const char *hf_base,
                              const char *hf_scale, di_dsv4_hc_w *hc) {
    const di_hparams *hp = &b->m->hp;
    int64_t nc = hp->hc_mult;
    di_status st = bind_matrix(b, off_fn, hf_fn, nc, nc * hp->n_embd, 0, &hc->fn);
    if (st == DI_OK) st = bind_f32(b, off_base, hf_base, 1, nc, 0, &hc->base);
    if (st == DI_OK) st = bind_f32(b, off_scale, hf_scale, 1, 1, 0, &hc->scale);
    return st;
}

static di_status bind_mtp(binder *b, int i, di_dsv4_mtp_w *mw) {
    const di_hparams *hp = &b->m->hp;
    int64_t D = hp->n_embd;
    char po[64], o[256], o2[256], o3[256];
    snprintf(po, sizeof po, "mtp.%d.", i);
    di_status st;
    if ((st = bind_matrix(b, fmt(o, po, "e_proj.weight"), NULL, D, D, ALLOW_FP8, &mw->e_proj)))
        return st;
    if ((st = bind_matrix(b, fmt(o, po, "h_proj.weight"), NULL, D, D, ALLOW_FP8, &mw->h_proj)))
        return st;
    if ((st = bind_f32(b, fmt(o, po, "enorm.weight"), NULL, 1, D, 0, &mw->enorm))) return st;
    if ((st = bind_f32(b, fmt(o, po, "hnorm.weight"), NULL, 1, D, 0, &mw->hnorm))) return st;
    if ((st = bind_f32(b, fmt(o, po, "norm.weight"), NULL, 1, D, 0, &mw->norm))) return st;
    if ((st = bind_head_hc(b, fmt(o, po, "hc_head_fn"), fmt(o2, po, "hc_head_base"),
                           fmt(o3, po, "hc_head_scale"), NULL, NULL, NULL, &mw->hc_head)))
        return st;
    return bind_block(b, po, NULL, hp->n_layer + i, &mw->block);
}

// A fingerprint of the checkpoint's weights, for what outlives the process (the prefix cache's
// disk tier keys its records with it): every tensor's name, type and size, and 3 x 64 sampled
// bytes (start, middle, end) of every tensor but the routed experts after expert 0 (V4-Flash has
// ~66k expert tensors: sampling them all would touch pages across the whole file at load). Two
// checkpoints of one architecture (a fine-tune, another quantisation, random weights of another
// seed) differ in it.
static uint64_t weights_fingerprint(const di_st_set *st) {
    uint64_t h = DI_FNV1A_INIT;
    for (int64_t i = 0; i < di_st_set_n_tensors(st); i++) {
        const di_st_tensor *t = di_st_set_tensor(st, i);
        h = di_fnv1a(t->name, strlen(t->name) + 1, h);
        const uint64_t meta[2] = {(uint64_t)t->dtype, (uint64_t)t->n_bytes};
        h = di_fnv1a(meta, sizeof meta, h);
        const char *ex = strstr(t->name, ".experts.");
        if (ex && strncmp(ex, ".experts.0.", 11) != 0) continue;
        const size_t n = t->n_bytes, k = n < 64 ? n : 64;
        const uint8_t *d = t->data;
        h = di_fnv1a(d, k, h);
        h = di_fnv1a(d + (n - k) / 2, k, h);
        h = di_fnv1a(d + n - k, k, h);
    }
    return h;
}

static int64_t count_params(const di_st_set *st, bool mtp) {
    int64_t n = 0;
    for (int64_t i = 0; i < di_st_set_n_tensors(st); i++) {
        const di_st_tensor *t = di_st_set_tensor(st, i);
        size_t len = strlen(t->name);
        bool is_scale =
            (len > 6 && strcmp(t->name + len - 6, ".scale") == 0 && t->dtype == DI_DTYPE_F8_E8M0) ||
            strstr(t->name, "_scale_inv") != NULL;
        if (is_scale || (strncmp(t->name, "mtp.", 4) == 0) != mtp) continue;
        // Packed FP4 holds two parameters per byte.
        n += t->dtype == DI_DTYPE_I8 && strstr(t->name, ".experts.") ? 2 * t->n_elements
                                                                     : t->n_elements;
    }
    return n;
}

// DSpark (V4.1 §3.5): mtp.{i} are window-only V4.1 blocks; mtp.0 adds main_proj/main_norm, the
// last block the final norm, the Markov head and the confidence head.
static di_status bind_dspark(binder *b) {
    di_model *m = b->m;
    const di_hparams *hp = &m->hp;
    int64_t D = hp->n_embd, V = hp->n_vocab, R = hp->dspark_markov_rank;
    char po[64], o[256];
    di_status st;
    m->mtp = own(m, sizeof(di_dsv4_mtp_w) * (size_t)hp->n_mtp);
    if (!m->mtp) return DI_ERR_NOMEM;
    memset(m->mtp, 0, sizeof(di_dsv4_mtp_w) * (size_t)hp->n_mtp);
    for (int i = 0; i < hp->n_mtp; i++) {
        snprintf(po, sizeof po, "mtp.%d.", i);
        if ((st = bind_block(b, po, NULL, hp->n_layer + i, &m->mtp[i].block)) != DI_OK) return st;
    }
    di_dsv41_dspark_w *d = &m->dspark;
    snprintf(po, sizeof po, "mtp.%d.", hp->n_mtp - 1);
    if ((st = bind_matrix(b, "mtp.0.main_proj.weight", NULL, D, (int64_t)hp->n_dspark_target * D,
                          ALLOW_FP8, &d->main_proj)) ||
        (st = bind_f32(b, "mtp.0.main_norm.weight", NULL, 1, D, 0, &d->main_norm)) ||
        (st = bind_f32(b, fmt(o, po, "norm.weight"), NULL, 1, D, 0, &d->norm)) ||
        (st = bind_matrix(b, fmt(o, po, "markov_head.embed.weight"), NULL, V, R, 0,
                          &d->markov_embed)) ||
        (st = bind_matrix(b, fmt(o, po, "markov_head.head.weight"), NULL, V, R, 0,
                          &d->markov_head)) ||
        (st = bind_f32(b, fmt(o, po, "confidence_head.proj.weight"), NULL, 2, 1, D + R,
                       &d->confidence)))
        return st;
    m->n_mtp_loaded = hp->n_mtp;
    return DI_OK;
}

di_status di_dsv4_weights_bind(di_model *m) {
    const di_hparams *hp = &m->hp;
    binder b = {.m = m};
    di_status st = DI_OK;
    int64_t V = hp->n_vocab, D = hp->n_embd;
    bool official = di_st_set_find(m->st, "embed.weight") != NULL;
    snprintf(m->layout, sizeof m->layout, "%s", official ? "official" : "hf");

    DI_TRY(bind_matrix(&b, "embed.weight", "model.embed_tokens.weight", V, D, 0, &m->embed));
    DI_TRY(bind_matrix(&b, "head.weight", "lm_head.weight", V, D, 0, &m->head));
    DI_TRY(bind_f32(&b, "norm.weight", "model.norm.weight", 1, D, 0, &m->norm));
    if (!hp->v41) // V4.1 has no hc_head: the last FFN site's pre collapses the streams
        DI_TRY(bind_head_hc(&b, "hc_head_fn", "hc_head_base", "hc_head_scale",
                            "model.hc_head.hc_fn", "model.hc_head.hc_base",
                            "model.hc_head.hc_scale", &m->hc_head));
    m->layers = own(m, sizeof(di_dsv4_layer_w) * (size_t)hp->n_layer);
    if (!m->layers) {
        st = DI_ERR_NOMEM;
        goto fail;
    }
    memset(m->layers, 0, sizeof(di_dsv4_layer_w) * (size_t)hp->n_layer);
    for (int il = 0; il < hp->n_layer; il++) {
        char po[64], ph[64];
        snprintf(po, sizeof po, "layers.%d.", il);
        snprintf(ph, sizeof ph, "model.layers.%d.", il);
        DI_TRY(bind_block(&b, po, ph, il, &m->layers[il]));
    }
    // MTP: all or nothing. Save_pretrained drops it; official checkpoints carry it.
    m->n_mtp_loaded = 0;
    if (hp->v41 && hp->n_mtp > 0 && di_st_set_find(m->st, "mtp.0.main_proj.weight")) {
        DI_TRY(bind_dspark(&b));
    } else if (!hp->v41 && hp->n_mtp > 0 && di_st_set_find(m->st, "mtp.0.e_proj.weight")) {
        m->mtp = own(m, sizeof(di_dsv4_mtp_w) * (size_t)hp->n_mtp);
        if (!m->mtp) {
            st = DI_ERR_NOMEM;
            goto fail;
        }
        memset(m->mtp, 0, sizeof(di_dsv4_mtp_w) * (size_t)hp->n_mtp);
        for (int i = 0; i < hp->n_mtp; i++) DI_TRY(bind_mtp(&b, i, &m->mtp[i]));
        m->n_mtp_loaded = hp->n_mtp;
    }
    // Every tensor must have been bound (duplicated embed/head copies under mtp.* excepted).
    for (int64_t i = 0; i < di_st_set_n_tensors(m->st); i++) {
        const di_st_tensor *t = di_st_set_tensor(m->st, i);
        bool used = false;
        for (int64_t k = 0; k < b.n_used && !used; k++) used = b.used[k] == t;
        if (used) continue;
        size_t len = strlen(t->name);
        bool dup_copy = strncmp(t->name, "mtp.", 4) == 0 &&
                        (strstr(t->name, "emb") ||
                         (len >= 11 && strcmp(t->name + len - 11, "head.weight") == 0));
        if (dup_copy) continue;
        DI_LOG_ERROR("checkpoint: unexpected tensor %s (%s) is not part of this model's "
                     "configuration",
                     t->name, di_dtype_name(t->dtype));
        st = DI_ERR_FORMAT;
        goto fail;
    }
    m->n_params = count_params(m->st, false);
    m->n_params_mtp = count_params(m->st, true);
    m->weights_id = weights_fingerprint(m->st);
    di_free(b.used);
    return DI_OK;
fail:
    di_free(b.used);
    return st;
}

void di_dsv4_weights_free(di_model *m) {
    for (int64_t i = 0; i < m->n_owned; i++) di_free(m->owned[i]);
    di_free(m->owned);
    m->owned = NULL;
    m->n_owned = m->cap_owned = 0;
}
