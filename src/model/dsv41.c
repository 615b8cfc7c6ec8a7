// dsv41 — DeepSeek V4.1: model extras, Engram, the single-pass mHC layer loop, the head and the
// DSpark draft module (deepseek-v41.md §2.1-§2.3, §3). Reads top to bottom as the model does;
// attention is in dsv41_attn.c, the state in dsv41_state.c, the MoE is V4's (dsv4_moe.c).
#include "model/dsv41.h"

#include <math.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h> // access

#include "base/log.h"
#include "base/mem.h"
#include "io/safetensors.h"
#include "tensor/quant_ref.h"
#include "tok/engram_map.h"

// ---- model extras ----

// Without engram/token_map.safetensors the map is built from the model directory's
// tokenizer.json, as transformers' build_compressed_token_map does (src/tok/engram_map.h); its
// compressed size must be the config's. With neither file the model loads (info works) and
// sessions are refused.
static di_status cmap_from_tokenizer(di_dsv41_model *v, const di_hparams *hp, const char *dir,
                                     const char *map_path) {
    char path[4096];
    snprintf(path, sizeof path, "%s/tokenizer.json", dir);
    if (access(path, F_OK) != 0) {
        DI_LOG_WARN("%s is missing and so is %s: the Engram layers need the compressed token map "
                    "(tensor \"token_map\", one compressed id per token id, made from the "
                    "tokenizer); this model cannot run until one of them exists",
                    map_path, path);
        return DI_OK;
    }
    di_tokenizer *tok = NULL;
    di_status st = di_tokenizer_load(path, &tok);
    if (st != DI_OK) return st;
    int32_t *map = NULL, n_map = 0, n_keys = 0;
    st = di_engram_map_build(tok, &map, &n_map, &n_keys);
    di_tokenizer_destroy(tok);
    if (st != DI_OK) return st;
    if (n_keys != hp->engram_cvocab || n_map < hp->n_vocab) {
        DI_LOG_ERROR("%s: the Engram compressed token map made from it has %d compressed ids for "
                     "%d token ids, but the config says engram_compressed_vocab_size = %lld and "
                     "vocab_size = %d; not this model's tokenizer (or give the map as %s)",
                     path, n_keys, n_map, (long long)hp->engram_cvocab, hp->n_vocab, map_path);
        di_free(map);
        return DI_ERR_FORMAT;
    }
    v->cmap = map;
    v->n_cmap = n_map;
    v->pad_c = v->cmap[hp->engram_pad_id];
    DI_LOG_INFO("engram: compressed token map built from %s (%d ids -> %d)", path, n_map, n_keys);
    return DI_OK;
}

di_status di_dsv41_model_init(di_model *m, const char *dir) {
    const di_hparams *hp = &m->hp;
    di_dsv41_model *v = di_calloc(1, sizeof *v);
    if (!v) return DI_ERR_NOMEM;
    m->v41 = v;
    di_status st = di_engram_hash_init(&v->hash, hp);
    if (st != DI_OK || hp->n_engram == 0) return st;
    // The compressed token map is data made from the tokenizer (§2.3.1 step 1).
    char path[4096];
    snprintf(path, sizeof path, "%s/engram/token_map.safetensors", dir);
    di_st_file *f = NULL;
    if (access(path, F_OK) != 0) return cmap_from_tokenizer(v, hp, dir, path);
    if ((st = di_st_file_open(path, &f)) != DI_OK) return st;
    const di_st_tensor *t = di_st_file_find(f, "token_map");
    if (!t || (t->dtype != DI_DTYPE_I32 && t->dtype != DI_DTYPE_I64) ||
        t->n_elements < hp->n_vocab) {
        DI_LOG_ERROR("%s: needs an I32/I64 tensor \"token_map\" of at least vocab_size = %d "
                     "entries",
                     path, hp->n_vocab);
        di_st_file_close(f);
        return DI_ERR_FORMAT;
    }
    v->n_cmap = (int32_t)t->n_elements;
    v->cmap = di_malloc(sizeof(int32_t) * (size_t)v->n_cmap);
    if (!v->cmap) {
        di_st_file_close(f);
        return DI_ERR_NOMEM;
    }
    for (int64_t i = 0; i < t->n_elements; i++) {
        int64_t c;
        if (t->dtype == DI_DTYPE_I64) {
            memcpy(&c, (const char *)t->data + 8 * i, 8);
        } else {
            int32_t c32;
            memcpy(&c32, (const char *)t->data + 4 * i, 4);
            c = c32;
        }
        if (c < 0 || c >= hp->engram_cvocab) {
            DI_LOG_ERROR("%s: token_map[%lld] = %lld is outside [0, "
                         "engram_compressed_vocab_size = %lld)",
                         path, (long long)i, (long long)c, (long long)hp->engram_cvocab);
            di_st_file_close(f);
            return DI_ERR_FORMAT;
        }
        v->cmap[i] = (int32_t)c;
    }
    di_st_file_close(f);
    v->pad_c = v->cmap[hp->engram_pad_id];
    return DI_OK;
}

void di_dsv41_model_free(di_model *m) {
    if (!m->v41) return;
    di_free(m->v41->cmap);
    di_free(m->v41);
    m->v41 = NULL;
}

// ---- small pieces ----

// collapse(X, p) = Σ_s p[s] X[s] (FP32 sum in stream order; BF16 in official precision).
static void collapse(const di_model *m, const float *x, const float *pre, int32_t n_tok, float *a) {
    di_ref_hc_collapse(x, pre, m->hp.hc_mult, m->hp.n_embd, n_tok, a);
    di_dsv4_round(m, a, (int64_t)n_tok * m->hp.n_embd);
}

static void one_hot_pre(const di_model *m, float *pre, int32_t n_tok) {
    const int nc = m->hp.hc_mult;
    memset(pre, 0, sizeof(float) * (size_t)n_tok * (size_t)nc);
    for (int32_t t = 0; t < n_tok; t++) pre[t * nc] = 1.0f;
}

// ---- Engram (§2.3.2) ----

// X [T, NC, D] += gate · value for the Engram module of layer lw; rows [T, n_col] of its table.
static void engram(di_dsv4_ctx *c, const di_dsv4_layer_w *lw, const int64_t *rows,
                   int64_t rows_stride, float *x) {
    di_dsv41_rows *st = c->ws->v41;
    const di_model *m = c->model;
    const di_hparams *hp = &m->hp;
    const int32_t n_tok = c->n_rows, nc = hp->hc_mult;
    const int64_t D = hp->n_embd, hd = hp->engram_head_dim;
    const int64_t n_col = (int64_t)(hp->engram_max_ngram - 1) * hp->engram_n_head;
    const int64_t n_in = n_col * hd, n_out = (int64_t)(nc + 1) * D;
    // E = table rows (dequantised: exact in BF16), flattened column-major by column j, dim d.
    for (int32_t t = 0; t < n_tok; t++)
        for (int64_t j = 0; j < n_col; j++)
            di_tensor_row_f32(&lw->eg_table, rows[t * rows_stride + j],
                              st->eg_in + t * n_in + j * hd);
    di_dsv4_linear(c, &lw->eg_wkv, st->eg_in, n_tok, n_in, st->eg_kv, n_out, true);
    di_ref_engram_gate(st->eg_kv, lw->eg_qk, nc, D, n_tok, hp->norm_eps, x);
    di_dsv4_round(m, x, (int64_t)n_tok * nc * D);
}

// Row ids of every Engram layer for the call's tokens (history already holds their ids).
static void engram_rows(const di_model *m, const di_dsv41_state *st, int32_t p0, int32_t n_tok,
                        int64_t *rows) {
    const di_hparams *hp = &m->hp;
    const di_engram_hash *h = &m->v41->hash;
    for (int32_t t = 0; t < n_tok; t++) {
        int32_t look[8];
        int64_t P = (int64_t)p0 + t;
        for (int k = 0; k < h->max_ngram; k++)
            look[k] = P - k >= 0 ? st->hist[P - k] : DI_ENGRAM_DEAD;
        for (int L = 0; L < hp->n_engram; L++)
            di_engram_hash_rows(h, L, look, m->v41->pad_c,
                                rows + ((int64_t)t * hp->n_engram + L) * h->n_col);
    }
}

// ---- the single-pass mHC block (§2.2) ----

// One block on streams x [T, NC, D] with the carried pre (in: P_in, out: F_pre) of the rows of c;
// dspark: a DSpark block of the draft blocks of c's sequences.
static void block(di_dsv4_ctx *c, const di_dsv4_layer_w *lw, int il_state, float *x,
                  const int32_t *ids, bool dspark) {
    const di_model *m = c->model;
    const di_hparams *hp = &m->hp;
    const int64_t D = hp->n_embd;
    const int32_t n_tok = c->n_rows;
    di_dsv41_rows *w = c->ws->v41;
    float *a = di_dsv4_scratch(c, DI_SCR_A);   // [T, D]
    float *o = di_dsv4_scratch(c, DI_SCR_OUT); // [T, D]

    // Attention site: coefficients from X, input collapsed with the previous site's pre.
    di_dsv4_hc_mix(c, &lw->hc_attn, x, n_tok, w->pre_attn, NULL, false);
    collapse(m, x, w->pre, n_tok, a);
    di_ref_rmsnorm(a, n_tok, D, D, lw->attn_norm, hp->norm_eps);
    di_dsv4_round(m, a, n_tok * D);
    // Context parallelism (cp/cp.h): the state of the pieces before this one comes in before the
    // attention (the window ring, and the kv source's entries and (C, Z) slots when this layer
    // compresses: later layers of the source read what this one installed), this piece's goes on
    // after it. A DSpark block's rings are passed with the DSpark context (forward_rows).
    const di_dsv4_cp_hook *cp = dspark ? NULL : c->cp;
    if (cp && (c->status = cp->attn(cp->user, c, il_state, false)) != DI_OK) return;
    if (dspark)
        di_dsv41_dspark_attention(c, lw, il_state, a, o);
    else
        di_dsv41_attention(c, lw, il_state, a, o);
    if (cp && (c->status = cp->attn(cp->user, c, il_state, true)) != DI_OK) return;
    if (c->trace) c->trace(c->trace_user, "attn_out", lw->il, o, false, n_tok, D);
    di_dsv4_hc_post(c, o, x, n_tok);

    // FFN site: coefficients from X1, input collapsed with the attention site's pre.
    di_dsv4_hc_mix(c, &lw->hc_ffn, x, n_tok, w->pre, NULL, false); // pre = F_pre
    collapse(m, x, w->pre_attn, n_tok, a);
    di_ref_rmsnorm(a, n_tok, D, D, lw->ffn_norm, hp->norm_eps);
    di_dsv4_round(m, a, n_tok * D);
    di_dsv4_moe(c, lw, a, ids, o);
    if (c->trace) c->trace(c->trace_user, "ffn_out", lw->il, o, false, n_tok, D);
    di_dsv4_hc_post(c, o, x, n_tok);
}

// h = RMSNorm(collapse(X, P)) for n rows; logits = head · h (FP32).
static void head(di_dsv4_ctx *c, const float *x, const float *pre, int32_t n, const float *norm,
                 float *h, float *logits) {
    di_model *m = c->model;
    const int64_t D = m->hp.n_embd;
    collapse(m, x, pre, n, h);
    di_ref_rmsnorm(h, n, D, D, norm, m->hp.norm_eps);
    di_dsv4_round(m, h, (int64_t)n * D);
    di_dsv4_matmul(m, &m->head, h, n, D, logits, m->hp.n_vocab);
}

// ---- the forward pass of one call (§2.1) ----

// Lays the rows of c's sequences out (di_dsv4_set_rows); the V4.1 row scratch holds them.
static void set_rows(di_dsv4_ctx *c) {
    di_dsv4_set_rows(c);
    DI_ASSERT(c->n_rows <= c->ws->v41->cap_rows);
}

// A call of one sequence of session s: n_tok rows at positions pos ...
static void one_seq(di_session *s, di_dsv4_seq *seq, di_dsv4_ctx *c, int32_t pos, int32_t n_tok) {
    *seq = (di_dsv4_seq){.pos = pos, .n_tok = n_tok, .v41 = s->v41};
    *c = (di_dsv4_ctx){.model = s->model,
                       .ws = di_dsv41_ws(s),
                       .seqs = seq,
                       .n_seq = 1,
                       .trace = s->trace,
                       .trace_user = s->trace_user};
    set_rows(c);
}

// DSpark context rows of the rows of c from their taps [T, n_target · D] (§3.2): main_x =
// RMSNorm(main_proj · taps), then every block's ring row of the sequences that run DSpark.
static void dspark_context(di_dsv4_ctx *c, const float *taps) {
    di_model *m = c->model;
    const di_hparams *hp = &m->hp;
    const int64_t D = hp->n_embd;
    const int32_t n_tok = c->n_rows;
    float *mx = di_dsv4_scratch(c, DI_SCR_H); // [T, D]
    di_dsv4_linear(c, &m->dspark.main_proj, taps, n_tok, (int64_t)hp->n_dspark_target * D, mx, D,
                   true);
    di_ref_rmsnorm(mx, n_tok, D, D, m->dspark.main_norm, hp->norm_eps);
    di_dsv4_round(m, mx, (int64_t)n_tok * D);
    for (int i = 0; i < m->n_mtp_loaded; i++)
        di_dsv41_dspark_ring(c, &m->mtp[i].block, hp->n_layer + i, mx);
    for (int32_t i = 0; i < c->n_seq; i++) {
        di_dsv41_state *st = c->seqs[i].v41;
        int32_t end = c->seqs[i].pos + c->seqs[i].n_tok;
        if (st->dspark && end > st->dspark_pos) st->dspark_pos = end;
    }
}

// The layers, the head and the DSpark context of the rows of c (set_rows done): tokens [T];
// logits of the last n_out[i] rows of every sequence i, in sequence order.
static void forward_rows(di_dsv4_ctx *c, const int32_t *tokens, const int32_t *n_out,
                         float *logits) {
    di_model *m = c->model;
    const di_hparams *hp = &m->hp;
    di_dsv41_rows *w = c->ws->v41;
    const int nc = hp->hc_mult;
    const int64_t D = hp->n_embd;
    const int32_t n_rows = c->n_rows;
    float *x = di_dsv4_scratch(c, DI_SCR_X); // [T, NC, D]
    bool any_dspark = false;
    for (int32_t i = 0; i < c->n_seq; i++) any_dspark |= c->seqs[i].v41->dspark;

    // Engram history and row ids of every sequence, once per call for every Engram layer.
    const int64_t n_col = m->v41->hash.n_col;
    if (hp->n_engram > 0) {
        for (int32_t i = 0; i < c->n_seq; i++) {
            const di_dsv4_seq *sq = &c->seqs[i];
            for (int32_t t = 0; t < sq->n_tok; t++)
                sq->v41->hist[sq->pos + t] = m->v41->cmap[tokens[sq->row0 + t]];
            engram_rows(m, sq->v41, sq->pos, sq->n_tok,
                        w->eg_rows + (int64_t)sq->row0 * hp->n_engram * n_col);
        }
    }
    // Embedding in every stream; P = one-hot(stream 0).
    for (int32_t t = 0; t < n_rows; t++) {
        float *xt = x + (int64_t)t * nc * D;
        di_tensor_row_f32(&m->embed, tokens[t], xt);
        for (int k = 1; k < nc; k++) memcpy(xt + k * D, xt, sizeof(float) * (size_t)D);
    }
    one_hot_pre(m, w->pre, n_rows);
    w->have_topk = w->have_cand = false;
    for (int il = 0; il < hp->n_layer; il++) {
        const di_dsv4_layer_w *lw = &m->layers[il];
        if (lw->engram >= 0)
            engram(c, lw, w->eg_rows + lw->engram * n_col, hp->n_engram * n_col, x);
        for (int k = 0; k < hp->n_dspark_target && any_dspark; k++) {
            if (hp->dspark_target[k] != il) continue;
            for (int32_t t = 0; t < n_rows; t++) { // tap = mean over the streams of the input
                float *tap = w->taps + ((int64_t)t * hp->n_dspark_target + k) * D;
                const float *xt = x + (int64_t)t * nc * D;
                for (int64_t d = 0; d < D; d++) {
                    float acc = 0;
                    for (int q = 0; q < nc; q++) acc += xt[q * D + d];
                    tap[d] = acc / (float)nc;
                }
                di_dsv4_round(m, tap, D);
            }
        }
        block(c, lw, il, x, tokens, false);
        if (c->cp && c->status != DI_OK) return; // a context-parallel peer failed
        if (c->trace) {
            c->trace(c->trace_user, "layer_out", il, x, false, n_rows, nc * D);
            c->trace(c->trace_user, "hc_pre", il, w->pre, false, n_rows, nc);
        }
    }
    // The head on the rows that want logits, gathered in place to the front of X and P (rows
    // ascend, so each copy moves a row down or leaves it; neither is read after this).
    int32_t n_logit = 0;
    for (int32_t i = 0; i < c->n_seq; i++) {
        const di_dsv4_seq *sq = &c->seqs[i];
        for (int32_t t = sq->n_tok - n_out[i]; t < sq->n_tok; t++, n_logit++) {
            const int32_t r = sq->row0 + t;
            if (r == n_logit) continue;
            memmove(x + (int64_t)n_logit * nc * D, x + (int64_t)r * nc * D,
                    sizeof(float) * (size_t)(nc * D));
            memmove(w->pre + n_logit * nc, w->pre + r * nc, sizeof(float) * (size_t)nc);
        }
    }
    if (n_logit > 0) head(c, x, w->pre, n_logit, m->norm, di_dsv4_scratch(c, DI_SCR_H), logits);
    if (any_dspark) {
        // Context parallelism: the DSpark rings of the earlier pieces' positions come in before
        // this piece's rows are written, and go on after (state layers n_layer ..).
        for (int i = 0; c->cp && i < m->n_mtp_loaded; i++)
            if ((c->status = c->cp->attn(c->cp->user, c, hp->n_layer + i, false)) != DI_OK) return;
        dspark_context(c, w->taps);
        for (int i = 0; c->cp && i < m->n_mtp_loaded; i++)
            if ((c->status = c->cp->attn(c->cp->user, c, hp->n_layer + i, true)) != DI_OK) return;
    }
    // Each sequence's views of its rows (tests read a call's taps and candidate pools).
    const int64_t n_tap = (int64_t)hp->n_dspark_target * D;
    for (int32_t i = 0; i < c->n_seq; i++) {
        di_dsv41_state *st = c->seqs[i].v41;
        const int32_t r0 = c->seqs[i].row0;
        st->taps = st->dspark ? w->taps + r0 * n_tap : NULL;
        st->cand = w->cand + (int64_t)r0 * hp->candidate_topk_blocks;
        st->n_cand = w->n_cand + r0;
    }
}

static di_status forward_batch(di_model *m, di_dsv4_ws *ws, const di_dsv41_seq *seqs, int32_t n_seq,
                               float *logits, const di_dsv4_cp_hook *cp) {
    const di_hparams *hp = &m->hp;
    if (n_seq < 1 || !seqs) {
        DI_LOG_ERROR("forward: a V4.1 call needs at least one sequence");
        return DI_ERR_INVALID;
    }
    int64_t n_rows = 0, n_pos = 0, n_logit = 0;
    for (int32_t i = 0; i < n_seq; i++) {
        const di_dsv41_seq *b = &seqs[i];
        const di_session *s = b->s;
        if (!s || s->model != m || !s->v41 || s->dev_on || b->n_tok < 1 || !b->tokens ||
            b->n_out < 0 || b->n_out > b->n_tok || (int64_t)s->pos + b->n_tok > s->n_ctx_max) {
            DI_LOG_ERROR("forward: V4.1 sequence %d: not a V4.1 session of this model (or one on "
                         "the device-resident forward), or %d tokens (%d with logits) do not fit "
                         "its context",
                         i, b->n_tok, b->n_out);
            return DI_ERR_INVALID;
        }
        for (int32_t j = 0; j < i; j++)
            if (seqs[j].s == s) {
                DI_LOG_ERROR("forward: a session appears twice in one V4.1 call");
                return DI_ERR_INVALID;
            }
        for (int32_t t = 0; t < b->n_tok; t++)
            if (b->tokens[t] < 0 || b->tokens[t] >= hp->n_vocab) {
                DI_LOG_ERROR("forward: token id %d is outside the vocabulary [0, %d)", b->tokens[t],
                             hp->n_vocab);
                return DI_ERR_INVALID;
            }
        n_rows += b->n_tok;
        n_logit += b->n_out;
        if ((int64_t)s->pos + b->n_tok > n_pos) n_pos = (int64_t)s->pos + b->n_tok;
    }
    if (n_rows > INT32_MAX / 2 || (n_logit > 0 && !logits)) {
        DI_LOG_ERROR("forward: a V4.1 call of %lld rows, %lld with logits (buffer %s)",
                     (long long)n_rows, (long long)n_logit, logits ? "given" : "missing");
        return DI_ERR_INVALID;
    }
    // Capacities (nothing to do when reserved before: the engine's slots).
    for (int32_t i = 0; i < n_seq; i++) {
        di_session *s = seqs[i].s;
        const int64_t end = (int64_t)s->pos + seqs[i].n_tok;
        di_status st = di_dsv41_reserve_state(s, end, end);
        if (st != DI_OK) return st;
    }
    di_status st = di_dsv41_ws_reserve(ws, m, (int32_t)n_rows, n_pos);
    if (st != DI_OK) return st;
    // The call: rows in sequence order (tokens gathered), in the workspace's per-call arrays
    // (a sequence has a row at least, so they hold n_rows sequences).
    di_dsv4_seq *sq = ws->v41->seqs;
    int32_t *n_out = ws->v41->n_out, *tokens = ws->v41->tokens;
    int32_t row = 0;
    for (int32_t i = 0; i < n_seq; i++) {
        sq[i] = (di_dsv4_seq){.pos = seqs[i].s->pos, .n_tok = seqs[i].n_tok, .v41 = seqs[i].s->v41};
        n_out[i] = seqs[i].n_out;
        memcpy(tokens + row, seqs[i].tokens, sizeof(int32_t) * (size_t)seqs[i].n_tok);
        row += seqs[i].n_tok;
    }
    di_dsv4_ctx c = {.model = m,
                     .ws = ws,
                     .seqs = sq,
                     .n_seq = n_seq,
                     .trace = seqs[0].s->trace,
                     .trace_user = seqs[0].s->trace_user,
                     .cp = cp};
    set_rows(&c);
    forward_rows(&c, tokens, n_out, logits);
    // An expert worker or a context-parallel peer failed (positions unchanged).
    if (c.status != DI_OK) return c.status;
    for (int32_t i = 0; i < n_seq; i++) {
        di_session *si = seqs[i].s;
        si->pos += seqs[i].n_tok;
        if (si->pos > si->hw) si->hw = si->pos; // di_dsv41_rollback's bound
    }
    m->n_forward_calls++;
    return DI_OK;
}

di_status di_dsv41_forward_batch(di_model *m, di_dsv4_ws *ws, const di_dsv41_seq *seqs,
                                 int32_t n_seq, float *logits) {
    return forward_batch(m, ws, seqs, n_seq, logits, NULL);
}

di_status di_dsv41_forward_cp(di_model *m, di_dsv4_ws *ws, const di_dsv41_seq *seq, float *logits,
                              const di_dsv4_cp_hook *cp) {
    return forward_batch(m, ws, seq, 1, logits, cp);
}

// ---- DSpark (§3) ----

void di_dsv41_dspark_context(di_session *s, const float *taps, int32_t p0, int32_t n_tok) {
    di_dsv4_seq seq;
    di_dsv4_ctx c;
    one_seq(s, &seq, &c, p0, n_tok);
    dspark_context(&c, taps);
}

di_status di_dsv41_draft_batch(di_model *m, di_dsv4_ws *ws, di_dsv41_draft_seq *seqs, int32_t n,
                               float *logits) {
    const di_hparams *hp = &m->hp;
    if (n < 1 || !seqs || m->n_mtp_loaded == 0) {
        DI_LOG_ERROR("dspark: no sequences, or the model has no DSpark module");
        return DI_ERR_INVALID;
    }
    const int32_t B = hp->dspark_block_size, nc = hp->hc_mult, R = hp->dspark_markov_rank;
    const int64_t D = hp->n_embd, V = hp->n_vocab;
    int64_t n_pos = 0;
    for (int32_t i = 0; i < n; i++) {
        const di_session *s = seqs[i].s;
        const int32_t anchor = seqs[i].anchor;
        if (!s || s->model != m || !s->mtp || !s->v41) {
            DI_LOG_ERROR("dspark: the session runs no DSpark module (create it with mtp)");
            return DI_ERR_INVALID;
        }
        if (anchor < 0 || anchor >= hp->n_vocab || s->pos < 1 || s->v41->dspark_pos != s->pos) {
            DI_LOG_ERROR("dspark: needs a committed forward and an anchor token id < %d",
                         hp->n_vocab);
            return DI_ERR_INVALID;
        }
        for (int32_t j = 0; j < i; j++)
            if (seqs[j].s == s) {
                DI_LOG_ERROR("dspark: a session appears twice in one draft call");
                return DI_ERR_INVALID;
            }
        if ((int64_t)s->pos + B > n_pos) n_pos = (int64_t)s->pos + B;
    }
    // Capacities (nothing to do when reserved before: the engine's slots).
    for (int32_t i = 0; i < n; i++) {
        di_status st =
            di_dsv41_reserve_state(seqs[i].s, seqs[i].s->pos, (int64_t)seqs[i].s->pos + B);
        if (st != DI_OK) return st;
    }
    di_status rs = di_dsv41_ws_reserve(ws, m, n * B, n_pos);
    if (rs == DI_OK) rs = di_dsv41_ws_reserve_draft(ws, m, n);
    if (rs != DI_OK) return rs;
    // The block rows of every session (the anchor at position a = pos, then noise tokens).
    di_dsv41_rows *w = ws->v41;
    di_dsv4_seq *sq = w->seqs;
    int32_t *ids = w->tokens;
    for (int32_t i = 0; i < n; i++) {
        sq[i] = (di_dsv4_seq){.pos = seqs[i].s->pos, .n_tok = B, .v41 = seqs[i].s->v41};
        ids[i * B] = seqs[i].anchor;
        for (int j = 1; j < B; j++) ids[i * B + j] = hp->dspark_noise_token;
    }
    di_dsv4_ctx c = {.model = m,
                     .ws = ws,
                     .seqs = sq,
                     .n_seq = n,
                     .trace = seqs[0].s->trace,
                     .trace_user = seqs[0].s->trace_user};
    set_rows(&c);
    const int32_t T = c.n_rows;
    float *x = di_dsv4_scratch(&c, DI_SCR_X);
    for (int32_t t = 0; t < T; t++) {
        float *xt = x + (int64_t)t * nc * D;
        di_tensor_row_f32(&m->embed, ids[t], xt);
        for (int k = 1; k < nc; k++) memcpy(xt + k * D, xt, sizeof(float) * (size_t)D);
    }
    one_hot_pre(m, w->pre, T);
    for (int i = 0; i < m->n_mtp_loaded; i++)
        block(&c, &m->mtp[i].block, hp->n_layer + i, x, ids, true);
    if (c.status != DI_OK) return c.status; // an expert worker failed
    // h = collapse (pre-norm, kept for the confidence head); base logits from the final norm.
    float *h = di_dsv4_scratch(&c, DI_SCR_A); // [T, D]
    collapse(m, x, w->pre, T, h);
    float *hn = di_dsv4_scratch(&c, DI_SCR_H);
    memcpy(hn, h, sizeof(float) * (size_t)(T * D));
    di_ref_rmsnorm(hn, T, D, D, m->dspark.norm, hp->norm_eps);
    di_dsv4_round(m, hn, (int64_t)T * D);
    // Block row j of every session at once: [n, V] base logits, [n, V] Markov, [n, D + R] input.
    float *lg = w->draft, *mk = lg + n * V, *me = mk + n * V;
    for (int32_t i = 0; i < n; i++) {
        memset(&seqs[i].out, 0, sizeof seqs[i].out);
        seqs[i].out.n = B;
    }
    for (int32_t j = 0; j < B; j++) {
        di_dsv4_matmul(m, &m->head, hn + j * D, n, B * D, lg, V); // base logits
        // Markov head: + head_markov · embed_markov[prev] (FP32), prev the anchor or draft j - 1.
        for (int32_t i = 0; i < n; i++) {
            float *mi = me + i * (D + R);
            int32_t prev = j == 0 ? seqs[i].anchor : seqs[i].out.tokens[j - 1];
            memcpy(mi, h + ((int64_t)i * B + j) * D, sizeof(float) * (size_t)D);
            di_tensor_row_f32(&m->dspark.markov_embed, prev, mi + D);
        }
        di_dsv4_matmul(m, &m->dspark.markov_head, me + D, n, D + R, mk, V);
        for (int32_t i = 0; i < n; i++) {
            float *li = lg + i * V;
            const float *ki = mk + i * V, *mi = me + i * (D + R);
            int32_t best = 0;
            for (int64_t v = 0; v < V; v++) {
                li[v] += ki[v];
                if (li[v] > li[best]) best = (int32_t)v;
            }
            if (logits) memcpy(logits + ((int64_t)i * B + j) * V, li, sizeof(float) * (size_t)V);
            float conf = di_ref_dot(m->dspark.confidence, mi, D + R);
            seqs[i].out.conf_logit[j] = conf;
            seqs[i].out.confidence[j] = di_sigmoid(conf);
            seqs[i].out.tokens[j] = best;
        }
    }
    return DI_OK;
}

di_status di_dsv41_draft_block(di_session *s, int32_t anchor, di_dsv41_draft *out, float *logits) {
    if (!s->mtp || !s->v41 || s->model->n_mtp_loaded == 0) {
        DI_LOG_ERROR("dspark: the session runs no DSpark module (create it with mtp)");
        return DI_ERR_INVALID;
    }
    di_dsv41_draft_seq d = {.s = s, .anchor = anchor};
    di_status st = di_dsv41_draft_batch(s->model, di_dsv41_ws(s), &d, 1, logits);
    if (st == DI_OK) *out = d.out;
    return st;
}

// ---- public API (deepinfer.h) ----

di_status di_session_rollback(di_session *s, int32_t n_tokens) {
    if (!s->v41) return di_dsv4_rollback(s, n_tokens); // V4 (dsv4_state.c)
    return di_dsv41_rollback(s, n_tokens);
}

di_status di_session_draft(di_session *s, int32_t anchor, di_draft *out, float *logits) {
    if (!s->v41) {
        DI_LOG_ERROR("draft: DSpark drafting needs a DeepSeek V4.1 checkpoint");
        return DI_ERR_UNSUPPORTED;
    }
    _Static_assert(sizeof(di_draft) == sizeof(di_dsv41_draft), "same layout");
    if (!s->mtp || s->model->n_mtp_loaded == 0) {
        DI_LOG_ERROR("dspark: the session runs no DSpark module (create it with mtp)");
        return DI_ERR_INVALID;
    }
    di_dsv41_draft d;
    di_status st = s->dev_on ? di_dsv4_session_dev_draft(s, anchor, &d, logits) // dsv4.c
                             : di_dsv41_draft_block(s, anchor, &d, logits);
    if (st != DI_OK) return st;
    memcpy(out, &d, sizeof d);
    return DI_OK;
}
