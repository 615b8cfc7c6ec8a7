#include "model/hparams.h"

#include <math.h>
#include <stdio.h>
#include <string.h>

#include "base/json.h"
#include "base/log.h"
#include "base/status.h"

// ---- field access: first name that is present wins (HF name, then official name) ----

static bool get_int2(const json_t *j, const char *a, const char *b, int64_t *out) {
    return di_json_get_int(j, a, out) || (b && di_json_get_int(j, b, out));
}

static bool get_num2(const json_t *j, const char *a, const char *b, double *out) {
    return di_json_get_num(j, a, out) || (b && di_json_get_num(j, b, out));
}

static di_status need_int(const json_t *j, const char *path, const char *a, const char *b,
                          int64_t lo, int64_t hi, int32_t *out) {
    int64_t v;
    if (!get_int2(j, a, b, &v)) {
        DI_LOG_ERROR("%s: missing integer field \"%s\"%s%s%s", path, a, b ? " (or \"" : "",
                     b ? b : "", b ? "\")" : "");
        return DI_ERR_FORMAT;
    }
    if (v < lo || v > hi) {
        DI_LOG_ERROR("%s: \"%s\" = %lld is outside [%lld, %lld]", path, a, (long long)v,
                     (long long)lo, (long long)hi);
        return DI_ERR_FORMAT;
    }
    *out = (int32_t)v;
    return DI_OK;
}

static int32_t opt_int(const json_t *j, const char *a, const char *b, int32_t def) {
    int64_t v;
    return get_int2(j, a, b, &v) ? (int32_t)v : def;
}

static float opt_num(const json_t *j, const char *a, const char *b, double def) {
    double v;
    return (float)(get_num2(j, a, b, &v) ? v : def);
}

// ---- RoPE parameters (spec §1.1: how DeepseekV4Config builds rope_parameters) ----

static di_status parse_rope_sub(const json_t *sub, const char *path, const char *which,
                                int32_t head_dim, di_rope_params *p) {
    if (!json_is_object(sub)) {
        DI_LOG_ERROR("%s: rope_parameters.%s must be an object", path, which);
        return DI_ERR_FORMAT;
    }
    const char *type = di_json_get_str(sub, "rope_type");
    if (!type) type = di_json_get_str(sub, "type");
    if (!type) type = "default";
    p->yarn = strcmp(type, "yarn") == 0;
    if (!p->yarn && strcmp(type, "default") != 0) {
        DI_LOG_ERROR("%s: rope_parameters.%s.rope_type \"%s\" is not supported (default, yarn)",
                     path, which, type);
        return DI_ERR_UNSUPPORTED;
    }
    double v;
    if (!di_json_get_num(sub, "rope_theta", &v) || v <= 0) {
        DI_LOG_ERROR("%s: rope_parameters.%s.rope_theta missing or not positive", path, which);
        return DI_ERR_FORMAT;
    }
    p->theta = (float)v;
    // HF reads partial_rotary_factor from the sub-dict; absent means the whole head rotates.
    double prf = 1.0;
    di_json_get_num(sub, "partial_rotary_factor", &prf);
    p->n_dims = (int32_t)lround(head_dim * prf);
    p->factor = 1.0f;
    p->attention_factor = 1.0f;
    if (p->yarn) {
        int64_t l0;
        if (!di_json_get_num(sub, "factor", &v) ||
            !di_json_get_int(sub, "original_max_position_embeddings", &l0)) {
            DI_LOG_ERROR("%s: rope_parameters.%s (yarn) needs factor and "
                         "original_max_position_embeddings",
                         path, which);
            return DI_ERR_FORMAT;
        }
        p->factor = (float)v;
        p->original_max_pos = l0;
        p->beta_fast = opt_num(sub, "beta_fast", NULL, 32.0);
        p->beta_slow = opt_num(sub, "beta_slow", NULL, 1.0);
        // HF derives 0.1 ln(factor) + 1 when attention_factor is absent and scales cos and sin.
        p->attention_factor = opt_num(sub, "attention_factor", NULL, 0.1 * log(p->factor) + 1.0);
    }
    return DI_OK;
}

static di_status parse_rope(const json_t *j, const char *path, di_hparams *hp) {
    int32_t rope_dims = opt_int(j, "qk_rope_head_dim", "rope_head_dim", 64);
    const json_t *nested = json_object_get(j, "rope_parameters");
    if (json_is_object(nested) && json_object_get(nested, "main") &&
        json_object_get(nested, "compress")) {
        di_status st = parse_rope_sub(json_object_get(nested, "main"), path, "main", hp->head_dim,
                                      &hp->rope_main);
        if (st == DI_OK)
            st = parse_rope_sub(json_object_get(nested, "compress"), path, "compress", hp->head_dim,
                                &hp->rope_compress);
        return st;
    }
    // Flat form: main = rope_theta, compress = compress_rope_theta (+ YaRN from rope_scaling,
    // with attention_factor forced to 1.0 on this path).
    double prf;
    if (di_json_get_num(j, "partial_rotary_factor", &prf))
        rope_dims = (int32_t)lround(hp->head_dim * prf);
    di_rope_params *m = &hp->rope_main, *c = &hp->rope_compress;
    memset(m, 0, sizeof *m);
    m->theta = opt_num(j, "rope_theta", NULL, 10000.0);
    m->factor = 1.0f;
    m->attention_factor = 1.0f;
    m->n_dims = rope_dims;
    *c = *m;
    c->theta = opt_num(j, "compress_rope_theta", NULL, 160000.0);
    const json_t *rs = json_object_get(j, "rope_scaling");
    const char *rtype = NULL;
    if (json_is_object(rs)) {
        rtype = di_json_get_str(rs, "type");
        if (!rtype) rtype = di_json_get_str(rs, "rope_type");
    }
    // Official inference config: rope_factor / original_seq_len / beta_* at top level.
    double f;
    if (rtype && strcmp(rtype, "yarn") == 0) {
        c->yarn = true;
        c->factor = opt_num(rs, "factor", NULL, 1.0);
        int64_t l0 = 0;
        di_json_get_int(rs, "original_max_position_embeddings", &l0);
        c->original_max_pos = l0;
        c->beta_fast = opt_num(rs, "beta_fast", NULL, 32.0);
        c->beta_slow = opt_num(rs, "beta_slow", NULL, 1.0);
    } else if (!rs && di_json_get_num(j, "rope_factor", &f) && f > 1.0) {
        c->yarn = true;
        c->factor = (float)f;
        c->original_max_pos = opt_int(j, "original_seq_len", NULL, 0);
        c->beta_fast = opt_num(j, "beta_fast", NULL, 32.0);
        c->beta_slow = opt_num(j, "beta_slow", NULL, 1.0);
    } else if (rtype && strcmp(rtype, "default") != 0) {
        DI_LOG_ERROR("%s: rope_scaling type \"%s\" is not supported", path, rtype);
        return DI_ERR_UNSUPPORTED;
    }
    if (c->yarn && (c->factor <= 0 || c->original_max_pos <= 0)) {
        DI_LOG_ERROR("%s: YaRN rope scaling needs factor and original_max_position_embeddings",
                     path);
        return DI_ERR_FORMAT;
    }
    return DI_OK;
}

void di_rope_freqs(const di_rope_params *p, float *omega) {
    int n = p->n_dims;
    int half = n / 2;
    float low = 0, high = 0;
    if (p->yarn) {
        // corr(r) = n ln(L0 / (2 pi r)) / (2 ln theta); HF truncates (floor / ceil).
        double lt = log((double)p->theta);
        double cf = n * log((double)p->original_max_pos / (p->beta_fast * 2 * M_PI)) / (2 * lt);
        double cs = n * log((double)p->original_max_pos / (p->beta_slow * 2 * M_PI)) / (2 * lt);
        low = (float)fmax(floor(cf), 0);
        high = (float)fmin(ceil(cs), n - 1);
        if (low == high) high += 0.001f;
    }
    for (int i = 0; i < half; i++) {
        // base_i = theta^(-2i/n), in FP32 as torch computes 1 / theta^(arange(0,n,2)/n).
        float expo = (float)(2 * i) / (float)n;
        float base = 1.0f / powf(p->theta, expo);
        if (!p->yarn) {
            omega[i] = base;
            continue;
        }
        float ramp = ((float)i - low) / (high - low);
        ramp = ramp < 0 ? 0 : ramp > 1 ? 1 : ramp;
        // As HF forms it: extrapolation factor ef = 1 - ramp, then
        // interp * (1 - ef) + base * ef with interp = 1 / (factor * theta^x).
        float ef = 1.0f - ramp;
        float interp = 1.0f / (p->factor * powf(p->theta, expo));
        omega[i] = interp * (1.0f - ef) + base * ef;
    }
}

// ---- layer schedule ----

static di_status parse_layer_types(const json_t *j, const char *path, di_hparams *hp) {
    int n_total = hp->n_layer + hp->n_mtp;
    const json_t *lt = json_object_get(j, "layer_types");
    const json_t *cr = json_object_get(j, "compress_ratios");
    if (json_is_array(lt)) {
        int64_t rate_csa = 4, rate_hca = 128;
        const json_t *rates = json_object_get(j, "compress_rates");
        if (json_is_object(rates)) {
            di_json_get_int(rates, "compressed_sparse_attention", &rate_csa);
            di_json_get_int(rates, "heavily_compressed_attention", &rate_hca);
        }
        if (rate_csa != 4) {
            DI_LOG_ERROR("%s: compress_rates.compressed_sparse_attention must be 4 (got %lld)",
                         path, (long long)rate_csa);
            return DI_ERR_UNSUPPORTED;
        }
        if (rate_hca < 1 || rate_hca == 4 || rate_hca > 65536) {
            DI_LOG_ERROR("%s: compress_rates.heavily_compressed_attention = %lld is invalid", path,
                         (long long)rate_hca);
            return DI_ERR_FORMAT;
        }
        if ((int)json_array_size(lt) < hp->n_layer) {
            DI_LOG_ERROR("%s: layer_types has %zu entries, need %d", path, json_array_size(lt),
                         hp->n_layer);
            return DI_ERR_FORMAT;
        }
        for (int il = 0; il < n_total; il++) {
            // MTP layers beyond layer_types are sliding-window layers (spec §1.2).
            const char *s = il < (int)json_array_size(lt)
                                ? json_string_value(json_array_get(lt, il))
                                : "sliding_attention";
            if (!s) {
                DI_LOG_ERROR("%s: layer_types[%d] is not a string", path, il);
                return DI_ERR_FORMAT;
            }
            if (strcmp(s, "sliding_attention") == 0)
                hp->compress_ratio[il] = 0;
            else if (strcmp(s, "compressed_sparse_attention") == 0)
                hp->compress_ratio[il] = 4;
            else if (strcmp(s, "heavily_compressed_attention") == 0)
                hp->compress_ratio[il] = (int32_t)rate_hca;
            else {
                DI_LOG_ERROR("%s: layer_types[%d] = \"%s\" is unknown", path, il, s);
                return DI_ERR_FORMAT;
            }
        }
        return DI_OK;
    }
    if (json_is_array(cr)) {
        if ((int)json_array_size(cr) < hp->n_layer) {
            DI_LOG_ERROR("%s: compress_ratios has %zu entries, need %d", path, json_array_size(cr),
                         hp->n_layer);
            return DI_ERR_FORMAT;
        }
        for (int il = 0; il < n_total; il++) {
            const json_t *v = json_array_get(cr, il);
            int64_t m = 0;
            if (v && !json_is_integer(v)) {
                DI_LOG_ERROR("%s: compress_ratios[%d] is not an integer", path, il);
                return DI_ERR_FORMAT;
            }
            if (v) m = json_integer_value(v);
            if (m < 0 || m > 65536 || (m != 0 && m != 4 && m < 2)) {
                DI_LOG_ERROR("%s: compress_ratios[%d] = %lld is invalid", path, il, (long long)m);
                return DI_ERR_FORMAT;
            }
            hp->compress_ratio[il] = (int32_t)m;
        }
        return DI_OK;
    }
    DI_LOG_ERROR("%s: neither layer_types nor compress_ratios is given; the layer schedule "
                 "must be explicit",
                 path);
    return DI_ERR_FORMAT;
}

static di_status parse_mlp_types(const json_t *j, const char *path, di_hparams *hp) {
    const json_t *mt = json_object_get(j, "mlp_layer_types");
    int n_hash = opt_int(j, "num_hash_layers", "n_hash_layers", 3);
    for (int il = 0; il < hp->n_layer + hp->n_mtp; il++) {
        bool hash = il < hp->n_layer && il < n_hash;
        if (json_is_array(mt) && il < hp->n_layer) {
            const char *s = json_string_value(json_array_get(mt, il));
            if (!s || (strcmp(s, "hash_moe") != 0 && strcmp(s, "moe") != 0)) {
                DI_LOG_ERROR("%s: mlp_layer_types[%d] must be \"hash_moe\" or \"moe\"", path, il);
                return DI_ERR_FORMAT;
            }
            hash = strcmp(s, "hash_moe") == 0;
        }
        hp->hash_routed[il] = hash; // MTP layers are never hash-routed (spec §2.10)
    }
    return DI_OK;
}

// ---- DeepSeek V4.1 (spec deepseek-v41.md §1.1) ----

// Reads an integer list (HF name a, official name b) into out[]; *n receives its length. false if
// absent; DI_ERR_FORMAT through *st if malformed or out of [lo, hi].
static bool get_int_list(const json_t *j, const char *path, const char *a, const char *b,
                         int64_t lo, int64_t hi, int64_t *out, int cap, int *n, di_status *st) {
    const char *name = a;
    const json_t *v = json_object_get(j, a);
    if (!v && b) v = json_object_get(j, name = b);
    if (!v || json_is_null(v)) return false;
    if (!json_is_array(v) || (int)json_array_size(v) > cap) {
        DI_LOG_ERROR("%s: \"%s\" must be a list of at most %d integers", path, name, cap);
        *st = DI_ERR_FORMAT;
        return false;
    }
    *n = (int)json_array_size(v);
    for (int i = 0; i < *n; i++) {
        const json_t *e = json_array_get(v, (size_t)i);
        if (!json_is_integer(e) || json_integer_value(e) < lo || json_integer_value(e) > hi) {
            DI_LOG_ERROR("%s: \"%s\"[%d] must be an integer in [%lld, %lld]", path, name, i,
                         (long long)lo, (long long)hi);
            *st = DI_ERR_FORMAT;
            return false;
        }
        out[i] = json_integer_value(e);
    }
    return true;
}

static const int32_t released_v41_ratios[40] = {0, 0, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2,
                                                2, 2, 2, 2, 2, 2, 1, 1, 1, 1, 1, 1, 1, 1,
                                                1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1};

static di_status parse_v41(const json_t *j, const char *path, di_hparams *hp) {
    di_status st = DI_OK;
    // The state stores window rows as Q8 codes with a scale per 32 dims, entries as Q4e per 16
    // and index keys as Q4 per 32 (docs/kv-cache.md, "DeepSeek V4.1"): whole blocks only.
    if (hp->head_dim % 32 != 0 || hp->index_head_dim % 32 != 0) {
        DI_LOG_ERROR("%s: DeepSeek V4.1 needs %s (%d) to be a multiple of 32 (its KV is quantised "
                     "in blocks of 32)",
                     path, hp->head_dim % 32 ? "head_dim" : "index_head_dim",
                     hp->head_dim % 32 ? hp->head_dim : hp->index_head_dim);
        return DI_ERR_FORMAT;
    }
    const int n = hp->n_layer, n_total = hp->n_layer + hp->n_mtp;
    int64_t buf[DI_MAX_LAYERS];
    int cnt = 0;
    // Layer schedule: given, or derived as R-HF's __post_init__ does.
    if (get_int_list(j, path, "compress_ratios", NULL, 0, 2, buf, DI_MAX_LAYERS, &cnt, &st)) {
        if (cnt < n || cnt > n_total) {
            DI_LOG_ERROR("%s: compress_ratios has %d entries, need %d to %d "
                         "(num_hidden_layers + num_nextn_predict_layers)",
                         path, cnt, n, n_total);
            return DI_ERR_FORMAT;
        }
        for (int il = 0; il < n_total; il++)
            hp->compress_ratio[il] = il < cnt ? (int32_t)buf[il] : 0;
    } else if (st != DI_OK) {
        return st;
    } else if (n == 40) {
        for (int il = 0; il < n_total; il++)
            hp->compress_ratio[il] = il < 40 ? released_v41_ratios[il] : 0;
    } else {
        int s0 = n < 2 ? n : 2, n2 = (n - s0 + 1) / 2;
        for (int il = 0; il < n_total; il++)
            hp->compress_ratio[il] = il < s0 ? 0 : il < s0 + n2 ? 2 : il < n ? 1 : 0;
    }
    for (int il = n; il < n_total; il++) {
        if (hp->compress_ratio[il] != 0) {
            DI_LOG_ERROR("%s: compress_ratios[%d] = %d: DSpark blocks are window-only (0)", path,
                         il, hp->compress_ratio[il]);
            return DI_ERR_FORMAT;
        }
    }
    bool released = n == 40;
    for (int il = 0; il < n && released; il++)
        released = hp->compress_ratio[il] == released_v41_ratios[il];
    // KV sources.
    if (get_int_list(j, path, "kv_source_layer_ids", "kv_source_layers", 0, n - 1, buf,
                     DI_MAX_LAYERS, &cnt, &st)) {
        for (int i = 0; i < cnt; i++) hp->kv_source[buf[i]] = true;
    } else if (st != DI_OK) {
        return st;
    } else {
        for (int il = 0; il < n; il++) {
            int r = hp->compress_ratio[il];
            hp->kv_source[il] = released ? (il == 2 || il == 8 || il == 14 || il == 20)
                                         : (r > 0 && (il == 0 || hp->compress_ratio[il - 1] != r));
        }
    }
    bool released_src = true;
    for (int il = 0; il < n; il++)
        released_src &= hp->kv_source[il] == (il == 2 || il == 8 || il == 14 || il == 20);
    if (get_int_list(j, path, "index_source_layer_ids", "index_source_layers", 0, n - 1, buf,
                     DI_MAX_LAYERS, &cnt, &st)) {
        for (int i = 0; i < cnt; i++) hp->index_source[buf[i]] = true;
    } else if (st != DI_OK) {
        return st;
    } else {
        for (int il = 0; il < n; il++)
            hp->index_source[il] =
                released_src ? (hp->kv_source[il] || (il >= 24 && il <= 36 && il % 4 == 0))
                             : hp->kv_source[il];
    }
    int last_src = -1;
    for (int il = 0; il < n; il++)
        if (hp->kv_source[il]) last_src = il;
    hp->candidate_layer =
        opt_int(j, "candidate_source_layer_id", "candidate_source_layer", last_src);
    if (hp->candidate_layer < 0) hp->candidate_layer = -1;
    hp->candidate_topk_blocks = opt_int(j, "candidate_topk_blocks", NULL, 2048);
    hp->candidate_block_size = opt_int(j, "candidate_block_size", NULL, 8);
    // Validation (R-HF raises ValueError on each of these; the last one is needed for sense).
    int src = -1, isrc = -1;
    for (int il = 0; il < n; il++) {
        int r = hp->compress_ratio[il];
        if (hp->kv_source[il]) src = il;
        if ((hp->kv_source[il] || hp->index_source[il]) && r == 0) {
            DI_LOG_ERROR("%s: layer %d is a %s source but its compress ratio is 0", path, il,
                         hp->kv_source[il] ? "kv" : "index");
            return DI_ERR_FORMAT;
        }
        if (r > 0 && src < 0) {
            DI_LOG_ERROR(
                "%s: layer %d has compress ratio %d but no kv_source_layer_ids entry at or "
                "before it",
                path, il, r);
            return DI_ERR_FORMAT;
        }
        if (r > 0 && hp->compress_ratio[src] != r) {
            DI_LOG_ERROR("%s: layer %d (ratio %d) would reuse kv source %d of ratio %d", path, il,
                         r, src, hp->compress_ratio[src]);
            return DI_ERR_FORMAT;
        }
        if (hp->kv_source[il] && !hp->index_source[il]) {
            DI_LOG_ERROR("%s: kv source %d must also be in index_source_layer_ids (its indexer "
                         "owns the index keys)",
                         path, il);
            return DI_ERR_FORMAT;
        }
        if (hp->index_source[il]) isrc = il;
        if (r > 0 && isrc < 0) {
            DI_LOG_ERROR("%s: layer %d has compress ratio %d but no index source at or before it",
                         path, il, r);
            return DI_ERR_FORMAT;
        }
    }
    if (hp->candidate_layer >= 0 &&
        (hp->candidate_layer >= n || !hp->index_source[hp->candidate_layer])) {
        DI_LOG_ERROR("%s: candidate_source_layer_id %d is not an index source", path,
                     hp->candidate_layer);
        return DI_ERR_FORMAT;
    }
    if (hp->candidate_topk_blocks < 1 || hp->candidate_block_size < 1) {
        DI_LOG_ERROR("%s: candidate_topk_blocks and candidate_block_size must be >= 1", path);
        return DI_ERR_FORMAT;
    }
    // Engram.
    if (get_int_list(j, path, "engram_layer_ids", NULL, 0, n - 1, buf, DI_MAX_ENGRAM, &cnt, &st)) {
        hp->n_engram = cnt;
        for (int i = 0; i < cnt; i++) {
            hp->engram_layer[i] = (int32_t)buf[i];
            if (i > 0 && buf[i] <= buf[i - 1]) {
                DI_LOG_ERROR("%s: engram_layer_ids must be strictly ascending", path);
                return DI_ERR_FORMAT;
            }
        }
    } else if (st != DI_OK) {
        return st;
    }
    if (hp->n_engram > 0) {
        int m = 0;
        if (!get_int_list(j, path, "engram_num_embeddings", NULL, 1, INT64_MAX / 2, buf,
                          DI_MAX_ENGRAM, &m, &st) ||
            m != hp->n_engram) {
            if (st == DI_OK)
                DI_LOG_ERROR("%s: engram_num_embeddings must list one row count per "
                             "engram_layer_ids entry",
                             path);
            return DI_ERR_FORMAT;
        }
        for (int i = 0; i < m; i++) hp->engram_rows[i] = buf[i];
        int64_t v;
#define NEED64(field, name, lo)                                                                    \
    if (!di_json_get_int(j, name, &v) || v < (lo)) {                                               \
        DI_LOG_ERROR("%s: Engram needs integer \"%s\" >= %lld", path, name, (long long)(lo));      \
        return DI_ERR_FORMAT;                                                                      \
    }                                                                                              \
    hp->field = v;
        NEED64(engram_vocab, "engram_vocab_size", 2);
        NEED64(engram_cvocab, "engram_compressed_vocab_size", 1);
        NEED64(engram_max_ngram, "engram_max_ngram_size", 2);
        NEED64(engram_n_head, "engram_n_heads", 1);
        NEED64(engram_head_dim, "engram_head_dim", 32);
        NEED64(engram_pad_id, "engram_pad_id", 0);
#undef NEED64
        if (hp->engram_max_ngram > 8 || hp->engram_n_head > 64 || hp->engram_head_dim % 32 != 0 ||
            hp->engram_pad_id >= hp->n_vocab) {
            DI_LOG_ERROR("%s: Engram fields out of range (engram_max_ngram_size <= 8, "
                         "engram_n_heads <= 64, engram_head_dim a multiple of 32, engram_pad_id "
                         "< vocab_size)",
                         path);
            return DI_ERR_FORMAT;
        }
    }
    // DSpark (R-OFF only; R-HF ignores these fields).
    hp->dspark_block_size = opt_int(j, "dspark_block_size", NULL, 5);
    hp->dspark_noise_token = opt_int(j, "dspark_noise_token_id", NULL, 128799);
    hp->dspark_markov_rank = opt_int(j, "dspark_markov_rank", NULL, 256);
    // 0 (R-OFF's ModelArgs default) or absent: the backbone's expert counts.
    hp->dspark_n_expert = opt_int(j, "dspark_n_routed_experts", NULL, 0);
    hp->dspark_n_expert_used =
        opt_int(j, "dspark_num_experts_per_tok", "dspark_n_activated_experts", 0);
    if (hp->dspark_n_expert <= 0) hp->dspark_n_expert = hp->n_expert;
    if (hp->dspark_n_expert_used <= 0) hp->dspark_n_expert_used = hp->n_expert_used;
    // Without DSpark blocks the dspark fields are not used (R-HF's config carries release
    // defaults such as targets [37, 38, 39] whatever the layer count): read them only with blocks.
    if (hp->n_mtp > 0 &&
        get_int_list(j, path, "dspark_target_layer_ids", NULL, 0, n - 1, buf, 8, &cnt, &st)) {
        hp->n_dspark_target = cnt;
        for (int i = 0; i < cnt; i++) hp->dspark_target[i] = (int32_t)buf[i];
    } else if (st != DI_OK) {
        return st;
    } else {
        for (int il = n - 1; il >= 0 && hp->n_dspark_target < 3; il--)
            if (!hp->kv_source[il]) hp->dspark_target[hp->n_dspark_target++] = il;
        for (int i = 0; i < hp->n_dspark_target / 2; i++) {
            int32_t t = hp->dspark_target[i];
            hp->dspark_target[i] = hp->dspark_target[hp->n_dspark_target - 1 - i];
            hp->dspark_target[hp->n_dspark_target - 1 - i] = t;
        }
    }
    if (hp->n_mtp > 0 &&
        (hp->dspark_block_size < 1 || hp->dspark_block_size > 16 || hp->dspark_noise_token < 0 ||
         hp->dspark_noise_token >= hp->n_vocab || hp->dspark_n_expert_used > hp->dspark_n_expert ||
         hp->dspark_n_expert > hp->n_expert || hp->dspark_n_expert_used > hp->n_expert_used)) {
        DI_LOG_ERROR("%s: dspark fields out of range (block size 1..16, noise token < vocab, "
                     "top-k <= experts)",
                     path);
        return DI_ERR_FORMAT;
    }
    int64_t nh = 0;
    if (get_int2(j, "num_hash_layers", "n_hash_layers", &nh) && nh != 0) {
        DI_LOG_ERROR("%s: num_hash_layers = %lld, but DeepSeek V4.1 has no hash-routed layers",
                     path, (long long)nh);
        return DI_ERR_FORMAT;
    }
    for (int il = 0; il < n_total; il++) hp->hash_routed[il] = false;
    return DI_OK;
}

// ---- cross-field validation (shared by config.json and GGUF metadata) ----

di_status di_hparams_check(const char *path, const di_hparams *hp) {
    const char *bad = NULL;
    if (hp->n_expert_used > hp->n_expert)
        bad = "num_experts_per_tok exceeds n_routed_experts";
    else if (hp->n_head % hp->o_groups)
        bad = "num_attention_heads is not a multiple of o_groups";
    else if (hp->hc_mult < 1 || hp->hc_mult > 16)
        bad = "hc_mult must be in [1, 16]";
    else if (hp->hc_iters < 1)
        bad = "hc_sinkhorn_iters must be >= 1";
    else if (hp->rope_main.n_dims != hp->rope_compress.n_dims)
        bad = "main and compress RoPE must rotate the same number of dims";
    else if (hp->rope_main.n_dims <= 0 || hp->rope_main.n_dims % 2 ||
             hp->rope_main.n_dims > hp->head_dim)
        bad = "rotary dims must be even and at most head_dim";
    else if (hp->rope_main.n_dims > hp->index_head_dim)
        bad = "rotary dims exceed index_head_dim";
    else if (hp->index_topk < 1 || hp->n_index_head < 1)
        bad = "index_topk and index_n_heads must be >= 1";
    else if (!(hp->gate_temp > 0))
        bad = "gate_temp must be > 0";
    if (bad) {
        DI_LOG_ERROR("%s: %s", path, bad);
        return DI_ERR_FORMAT;
    }
    return DI_OK;
}

// ---- the whole config ----

di_status di_hparams_load(const char *path, di_hparams *hp) {
    json_t *j = NULL;
    di_status st = di_json_load_file(path, &j);
    if (st != DI_OK) return st;
    const json_t *root = j;
    memset(hp, 0, sizeof *hp);
    if (!json_is_object(j)) {
        DI_LOG_ERROR("%s: not a JSON object", path);
        st = DI_ERR_FORMAT;
        goto done;
    }
    const char *mt = di_json_get_str(j, "model_type");
    // V4.1: model_type deepseek_v41 (HF composite, text fields in text_config) or
    // deepseek_v41_text, or the official flat config (no model_type; V4.1-only fields).
    hp->v41 = (mt && (strcmp(mt, "deepseek_v41") == 0 || strcmp(mt, "deepseek_v41_text") == 0)) ||
              (!mt && (json_object_get(j, "kv_source_layers") ||
                       json_object_get(j, "kv_source_layer_ids")));
    if (mt && !hp->v41 && strcmp(mt, "deepseek_v4") != 0) {
        DI_LOG_ERROR("%s: model_type \"%s\" is not supported by this build (deepseek_v4, "
                     "deepseek_v41)",
                     path, mt);
        st = DI_ERR_UNSUPPORTED;
        goto done;
    }
    snprintf(hp->model_type, sizeof hp->model_type, "%s", hp->v41 ? "deepseek_v41" : "deepseek_v4");
    if (hp->v41 && json_is_object(json_object_get(root, "text_config"))) {
        j = json_object_get(root, "text_config");
        const char *tmt = di_json_get_str(j, "model_type");
        if (tmt && strcmp(tmt, "deepseek_v41_text") != 0) {
            DI_LOG_ERROR("%s: text_config.model_type \"%s\" is not deepseek_v41_text", path, tmt);
            st = DI_ERR_FORMAT;
            goto done;
        }
    }

#define NEED(field, a, b, lo, hi) DI_TRY(need_int(j, path, a, b, lo, hi, &hp->field))
    NEED(n_vocab, "vocab_size", NULL, 1, 1 << 24);
    NEED(n_embd, "hidden_size", "dim", 1, 1 << 16);
    NEED(n_layer, "num_hidden_layers", "n_layers", 1, DI_MAX_LAYERS - 8);
    NEED(n_head, "num_attention_heads", "n_heads", 1, 1024);
    NEED(head_dim, "head_dim", NULL, 2, 4096);
    NEED(q_lora_rank, "q_lora_rank", NULL, 1, 1 << 16);
    NEED(o_groups, "o_groups", NULL, 1, 1024);
    NEED(o_lora_rank, "o_lora_rank", NULL, 1, 1 << 16);
    NEED(window, "sliding_window", "window_size", 1, 1 << 20);
    if (hp->v41 && !json_object_get(j, "n_routed_experts") &&
        json_object_get(j, "num_local_experts")) // R-HF alias
        NEED(n_expert, "num_local_experts", NULL, 1, 1 << 16);
    else
        NEED(n_expert, "n_routed_experts", NULL, 1, 1 << 16);
    NEED(n_expert_used, "num_experts_per_tok", "n_activated_experts", 1, 1 << 10);
    if (hp->v41 && !json_object_get(j, "moe_intermediate_size") &&
        !json_object_get(j, "moe_inter_dim") && json_object_get(j, "intermediate_size"))
        NEED(expert_ff, "intermediate_size", NULL, 1, 1 << 20); // R-HF alias
    else
        NEED(expert_ff, "moe_intermediate_size", "moe_inter_dim", 1, 1 << 20);
#undef NEED
    hp->n_mtp = opt_int(j, "num_nextn_predict_layers", "n_mtp_layers", hp->v41 ? 0 : 1);
    hp->n_index_head = opt_int(j, "index_n_heads", NULL, 64);
    hp->index_head_dim = opt_int(j, "index_head_dim", NULL, 128);
    hp->index_topk = opt_int(j, "index_topk", NULL, 512);
    hp->hc_mult = opt_int(j, "hc_mult", NULL, 4);
    hp->hc_iters = opt_int(j, "hc_sinkhorn_iters", NULL, 20);
    hp->hc_eps = opt_num(j, "hc_eps", NULL, 1e-6);
    hp->norm_eps = opt_num(j, "rms_norm_eps", "norm_eps", hp->v41 ? 1e-20 : 1e-6);
    hp->gate_temp = hp->v41 ? opt_num(j, "gate_temp", NULL, 1.0) : 1.0f;
    hp->n_expert_shared = opt_int(j, "n_shared_experts", NULL, 1);
    hp->route_scale = opt_num(j, "routed_scaling_factor", "route_scale", 1.0);
    hp->swiglu_limit = opt_num(j, "swiglu_limit", NULL, 0.0);
    hp->max_pos = opt_int(j, "max_position_embeddings", NULL, 1 << 20);
    hp->bos_token = opt_int(j, "bos_token_id", NULL, opt_int(root, "bos_token_id", NULL, 0));
    hp->eos_token = opt_int(j, "eos_token_id", NULL, opt_int(root, "eos_token_id", NULL, 1));
    hp->image_token = opt_int(root, "image_token_id", NULL, -1);
    // The current official revision and current transformers clamp the shared expert too
    // (spec §2.8); "shared_expert_swiglu_clamp": false reproduces the initial release.
    bool clamp = true;
    di_json_get_bool(j, "shared_expert_swiglu_clamp", &clamp);
    hp->shared_expert_clamp = clamp;

    int n_kv = opt_int(j, "num_key_value_heads", NULL, 1);
    if (n_kv != 1) {
        DI_LOG_ERROR("%s: num_key_value_heads must be 1 (shared-KV MQA), got %d", path, n_kv);
        st = DI_ERR_FORMAT;
        goto done;
    }
    if (hp->n_mtp < 0 || hp->n_mtp > 4) {
        DI_LOG_ERROR("%s: num_nextn_predict_layers = %d is out of range", path, hp->n_mtp);
        st = DI_ERR_FORMAT;
        goto done;
    }
    if (hp->n_expert_shared != 1) {
        DI_LOG_ERROR("%s: n_shared_experts must be 1, got %d", path, hp->n_expert_shared);
        st = DI_ERR_UNSUPPORTED;
        goto done;
    }
    const char *sf = di_json_get_str(j, "scoring_func");
    if (!sf) sf = di_json_get_str(j, "score_func");
    if (sf && strcmp(sf, "sqrtsoftplus") != 0) {
        DI_LOG_ERROR("%s: scoring_func \"%s\" is not supported (sqrtsoftplus)", path, sf);
        st = DI_ERR_UNSUPPORTED;
        goto done;
    }
    if (hp->v41) {
        if (hp->n_mtp > 8 || hp->gate_temp <= 0) {
            DI_LOG_ERROR("%s: num_nextn_predict_layers must be <= 8 and gate_temp > 0", path);
            st = DI_ERR_FORMAT;
            goto done;
        }
        DI_TRY(parse_v41(j, path, hp));
    } else {
        DI_TRY(parse_layer_types(j, path, hp));
        DI_TRY(parse_mlp_types(j, path, hp));
    }
    DI_TRY(parse_rope(j, path, hp));

    // Quantisation block of FP8 weights (official layout).
    hp->fp8_block_out = hp->fp8_block_in = hp->v41 ? 32 : 128;
    const json_t *qc = json_object_get(root, "quantization_config");
    if (!qc) qc = json_object_get(j, "quantization_config");
    const json_t *wbs = json_is_object(qc) ? json_object_get(qc, "weight_block_size") : NULL;
    if (json_is_array(wbs) && json_array_size(wbs) == 2) {
        hp->fp8_block_out = (int32_t)json_integer_value(json_array_get(wbs, 0));
        hp->fp8_block_in = (int32_t)json_integer_value(json_array_get(wbs, 1));
        if (hp->fp8_block_out <= 0 || hp->fp8_block_in <= 0) {
            DI_LOG_ERROR("%s: quantization_config.weight_block_size is invalid", path);
            st = DI_ERR_FORMAT;
            goto done;
        }
    }

    st = di_hparams_check(path, hp);
done:
fail:
    json_decref((json_t *)root); // j may point into it (text_config)
    return st;
}
