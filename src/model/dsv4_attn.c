// dsv4_attn — one attention layer call with state (spec §2.4–§2.7, §3.4): the q low-rank path,
// the shared K=V row with partial interleaved RoPE, the compressors of CSA/HCA layers, the
// lightning indexer of CSA layers, the sink softmax over window + compressed keys, inverse RoPE
// and the grouped output projection.
#include <float.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "backend/cpu/vec.h"
#include "base/log.h"
#include "model/dsv4.h"
#include "tensor/quant_ref.h"

// ---- linear layers ----

// y = W x for T rows; in official precision, FP8/FP4 weights see A8-quantised activations and
// every output is rounded to BF16 (spec §2.0 "Linear layers").
void di_dsv4_linear(di_dsv4_ctx *c, const di_tensor *w, const float *x, int32_t n_tok,
                    int64_t x_stride, float *y, int64_t y_stride, bool act_quant) {
    di_model *m = c->model;
    if (m->opt.precision == DI_PRECISION_OFFICIAL && act_quant &&
        (w->kind == DI_TENSOR_KIND_FP8 || w->kind == DI_TENSOR_KIND_FP4)) {
        float *xq = di_dsv4_scratch(c, DI_SCR_AQ);
        int64_t n = w->ne[0];
        for (int32_t t = 0; t < n_tok; t++) {
            memcpy(xq + t * n, x + t * x_stride, sizeof(float) * (size_t)n);
            // A8: blocks of 128 (V4) or 32 (V4.1) along K.
            di_fake_quant_q8(xq + t * n, n, m->hp.v41 ? 32 : 128);
        }
        x = xq;
        x_stride = n;
    }
    di_dsv4_matmul(m, w, x, n_tok, x_stride, y, y_stride);
    if (m->opt.precision == DI_PRECISION_OFFICIAL)
        for (int32_t t = 0; t < n_tok; t++) di_dsv4_round(m, y + t * y_stride, w->ne[1]);
}

// ---- compressor (spec §2.5, §3.2) ----

// Finishes entry w from pooled values: RMSNorm, RoPE at the window's first position, and in
// official precision Q8 of the nope dims (main) or Hadamard + Q4 (indexer).
static void finalise_entry(const di_model *m, const di_dsv4_compressor_w *cw, bool indexer,
                           float *e, int64_t w) {
    const di_hparams *hp = &m->hp;
    int32_t d = cw->d, n_rot = hp->rope_compress.n_dims;
    di_dsv4_round(m, e, d);
    di_ref_rmsnorm(e, 1, d, d, cw->norm, hp->norm_eps);
    di_dsv4_round(m, e, d);
    di_ref_rope(e, d, n_rot, m->omega_compress, w * cw->m, hp->rope_compress.attention_factor,
                false);
    di_dsv4_round(m, e, d);
    if (m->opt.precision == DI_PRECISION_OFFICIAL) {
        if (indexer) {
            di_hadamard(e, d);
            di_dsv4_round(m, e, d);
            di_fake_quant_q4(e, d, 32);
        } else {
            di_fake_quant_q8(e, d - n_rot, 64);
        }
    }
}

// Appends one token's (C, Z) at absolute position P; closes the window when P is its last token.
// c_row / z_row: [c*d] projections of this token (Z without the position bias). The token ring
// keeps position p in slot p mod buf_rows, so window w's tokens are slots of w*m .. w*m + m - 1
// and, for CSA, the overlap (Ca, Za) of window w - 1 the slots before them.
static void compressor_step(const di_model *m, const di_dsv4_compressor_w *cw,
                            di_dsv4_cmp_state *cs, bool indexer, const float *c_row,
                            const float *z_row, int64_t P) {
    const int32_t mm = cw->m, c = cw->c, d = cw->d, width = c * d, rows = cs->buf_rows;
    const int64_t slot = P % rows;
    float *bc = cs->buf_c + slot * width, *bz = cs->buf_z + slot * width;
    const float *ape = cw->ape + (int64_t)(P % mm) * width;
    for (int32_t i = 0; i < width; i++) {
        bc[i] = c_row[i];
        bz[i] = z_row[i] + ape[i];
    }
    if ((P + 1) % mm != 0) return;

    int64_t w = P / mm;
    // A replayed window whose entry already exists (prefix-cache hit): keep the entry.
    if (w < cs->n_entries) return;
    DI_ASSERT(w == cs->n_entries && w < cs->cap_entries);
    float *e = di_dsv4_entry(cs, w, d);
    // Window w's tokens (the second half, Cb / Zb, for CSA) and the overlap: window w - 1's tokens
    // (first half, Ca / Za), empty before the first window closes. Consecutive positions are
    // consecutive slots but for one wrap of the ring.
    const bool ovl = c == 2 && w > 0;
    const int64_t s_cur = (w * mm) % rows, s_prev = ovl ? ((w - 1) * mm) % rows : 0;
#define CUR(j) ((s_cur + (j) < rows ? s_cur + (j) : s_cur + (j)-rows) * width + (c == 2 ? d : 0))
#define PREV(j) ((s_prev + (j) < rows ? s_prev + (j) : s_prev + (j)-rows) * width)
    for (int32_t ch = 0; ch < d; ch++) {
        // Softmax over the window's slots, per channel. CSA: 4 overlap slots (Ca, Za of window
        // w-1) then 4 slots (Cb, Zb) of window w.
        float mx = -INFINITY;
        if (ovl)
            for (int32_t j = 0; j < mm; j++) mx = fmaxf(mx, cs->buf_z[PREV(j) + ch]);
        for (int32_t j = 0; j < mm; j++) mx = fmaxf(mx, cs->buf_z[CUR(j) + ch]);
        float den = 0, num = 0;
        if (ovl) {
            for (int32_t j = 0; j < mm; j++) {
                float p = expf(cs->buf_z[PREV(j) + ch] - mx);
                den += p;
                num += p * cs->buf_c[PREV(j) + ch];
            }
        }
        for (int32_t j = 0; j < mm; j++) {
            float p = expf(cs->buf_z[CUR(j) + ch] - mx);
            den += p;
            num += p * cs->buf_c[CUR(j) + ch];
        }
        e[ch] = num / den;
    }
#undef CUR
#undef PREV
    finalise_entry(m, cw, indexer, e, w);
    cs->n_entries++;
}

// Projects all rows (FP32, no activation quant), then steps each sequence's compressor through
// its own rows in position order.
static void run_compressor(di_dsv4_ctx *c, const di_dsv4_compressor_w *cw, int il, bool indexer,
                           const float *a) {
    di_model *m = c->model;
    int64_t width = (int64_t)cw->c * cw->d, D = m->hp.n_embd;
    float *cc = di_dsv4_scratch(c, DI_SCR_CC), *cz = di_dsv4_scratch(c, DI_SCR_CZ);
    di_dsv4_matmul(m, &cw->wkv, a, c->n_rows, D, cc, width);   // C: [T, c*d]
    di_dsv4_matmul(m, &cw->wgate, a, c->n_rows, D, cz, width); // Z: [T, c*d]
    for (int32_t i = 0; i < c->n_seq; i++) {
        const di_dsv4_seq *sq = &c->seqs[i];
        di_dsv4_layer_state *ls = &sq->layers[il];
        di_dsv4_cmp_state *cs = indexer ? &ls->idx : &ls->cmp;
        for (int32_t t = 0; t < sq->n_tok; t++) {
            int64_t r = sq->row0 + t;
            compressor_step(m, cw, cs, indexer, cc + r * width, cz + r * width,
                            (int64_t)sq->pos + t);
        }
    }
}

// ---- lightning indexer (spec §2.6) ----

typedef struct indexer_ctx {
    const di_model *m;
    const di_dsv4_ctx *c;
    int il;
    const float *qi; // [T, HI, DI]
    const float *wi; // [T, HI]
    int32_t n_tok, topk;
    int32_t *sel;  // [T, topk], ascending, -1 padded
    float *scores; // per thread [n_entries]
    int64_t scores_stride;
} indexer_ctx;

void di_dsv4_topk(const float *sc, int64_t n, int32_t k, int32_t *sel) {
    di_ref_topk(sc, n, k, sel);
}

static void indexer_task(void *p, int ith, int nth) {
    indexer_ctx *c = p;
    const di_hparams *hp = &c->m->hp;
    const int32_t HI = hp->n_index_head, DI = hp->index_head_dim;
    float *sc = c->scores + (int64_t)ith * c->scores_stride;
    int64_t lo, hi;
    di_split_range(c->n_tok, ith, nth, &lo, &hi);
    const int32_t *row_seq = c->c->ws->row_seq, *row_pos = c->c->ws->row_pos;
    for (int64_t t = lo; t < hi; t++) {
        int64_t vis = ((int64_t)row_pos[t] + 1) / 4;
        const di_dsv4_cmp_state *keys = &c->c->seqs[row_seq[t]].layers[c->il].idx;
        int32_t *sel = c->sel + t * c->topk;
        for (int32_t i = 0; i < c->topk; i++) sel[i] = -1;
        int32_t k = (int32_t)(vis < c->topk ? vis : c->topk);
        if (k == vis) { // every visible entry is selected: no scores needed
            for (int32_t i = 0; i < k; i++) sel[i] = i;
            continue;
        }
        const float *kp[DI_DSV4_KEY_CHUNK];
        for (int64_t w0 = 0; w0 < vis; w0 += DI_DSV4_KEY_CHUNK) {
            int64_t nk = vis - w0 < DI_DSV4_KEY_CHUNK ? vis - w0 : DI_DSV4_KEY_CHUNK;
            for (int64_t w = 0; w < nk; w++) kp[w] = di_dsv4_entry(keys, w0 + w, DI);
            di_cpu_index_scores(c->m->cpu.isa, c->qi + t * HI * DI, c->wi + t * HI, HI, kp, nk, DI,
                                sc + w0);
        }
        di_dsv4_round(c->m, sc, vis); // R-OFF: BF16 scores
        di_dsv4_topk(sc, vis, k, sel);
    }
}

// ---- attention core ----

static inline const float *key_row(const di_dsv4_keys *k, int64_t j, int32_t Dh) {
    if (j < k->n_win) {
        int64_t pos = k->w_lo + j;
        return pos < k->p0 ? k->ring + (pos % k->ring_rows) * Dh : k->rows + (pos - k->p0) * Dh;
    }
    int64_t e = k->sel ? k->sel[j - k->n_win] : j - k->n_win;
    return di_dsv4_entry(k->cmp, e, Dh);
}

void di_dsv4_attend_heads(const di_model *m, const float *q, const float *sink, int32_t nh,
                          const di_dsv4_keys *keys, int64_t P, const float *omega, float rscale,
                          float *sc, float *o) {
    const int32_t Dh = m->hp.head_dim, n_rot = m->hp.rope_main.n_dims, isa = m->cpu.isa;
    const float scale = 1.0f / sqrtf((float)Dh);
    const int64_t n_keys = keys->n_win + keys->n_cmp;
    const float *kp[DI_DSV4_KEY_CHUNK];
    for (int64_t j0 = 0; j0 < n_keys; j0 += DI_DSV4_KEY_CHUNK) {
        int64_t nk = n_keys - j0 < DI_DSV4_KEY_CHUNK ? n_keys - j0 : DI_DSV4_KEY_CHUNK;
        for (int64_t j = 0; j < nk; j++) kp[j] = key_row(keys, j0 + j, Dh);
        for (int32_t h = 0; h < nh; h++)
            di_cpu_dots(isa, q + h * Dh, kp, nk, Dh, scale, sc + h * n_keys + j0);
    }
    for (int32_t h = 0; h < nh; h++) {
        float *s = sc + h * n_keys, mx = sink[h];
        for (int64_t j = 0; j < n_keys; j++) mx = fmaxf(mx, s[j]);
        float den = expf(sink[h] - mx); // the sink takes mass, gives no value
        for (int64_t j = 0; j < n_keys; j++) den += (s[j] = expf(s[j] - mx));
        float inv = 1.0f / den;
        for (int64_t j = 0; j < n_keys; j++) {
            s[j] *= inv;
            if (m->opt.precision == DI_PRECISION_OFFICIAL) s[j] = di_round_bf16(s[j]);
        }
    }
    memset(o, 0, sizeof(float) * (size_t)nh * (size_t)Dh);
    for (int64_t j0 = 0; j0 < n_keys; j0 += DI_DSV4_KEY_CHUNK) {
        int64_t nk = n_keys - j0 < DI_DSV4_KEY_CHUNK ? n_keys - j0 : DI_DSV4_KEY_CHUNK;
        for (int64_t j = 0; j < nk; j++) kp[j] = key_row(keys, j0 + j, Dh);
        for (int32_t h = 0; h < nh; h++)
            di_cpu_weighted_sum(isa, sc + h * n_keys + j0, kp, nk, Dh, o + h * Dh);
    }
    for (int32_t h = 0; h < nh; h++) {
        float *oh = o + h * Dh;
        di_dsv4_round(m, oh, Dh);
        di_ref_rope(oh, Dh, n_rot, omega, P, rscale, true); // de-rotate at the query position
        di_dsv4_round(m, oh, Dh);
    }
}

typedef struct attn_ctx {
    const di_model *m;
    const di_dsv4_ctx *c;
    const di_dsv4_layer_w *lw;
    int il;
    const float *q;     // [T, H, Dh]
    const float *kv;    // [T, Dh]
    float *o;           // [T, H, Dh]
    const int32_t *sel; // CSA: [T, topk]
    int32_t n_tok;
    float *scores; // per thread
    int64_t scores_stride;
} attn_ctx;

static void attn_task(void *p, int ith, int nth) {
    attn_ctx *c = p;
    const di_hparams *hp = &c->m->hp;
    const int32_t H = hp->n_head, Dh = hp->head_dim, W = hp->window;
    const int32_t ratio = c->lw->ratio, topk = hp->index_topk;
    const bool compress = ratio > 0;
    const float *omega = compress ? c->m->omega_compress : c->m->omega_main;
    const float rscale =
        compress ? hp->rope_compress.attention_factor : hp->rope_main.attention_factor;
    float *sc = c->scores + (int64_t)ith * c->scores_stride;
    int64_t lo, hi;
    const int32_t n_grp = (H + DI_DSV4_HEAD_GROUP - 1) / DI_DSV4_HEAD_GROUP;
    di_split_range((int64_t)c->n_tok * n_grp, ith, nth, &lo, &hi);
    const int32_t *row_seq = c->c->ws->row_seq, *row_pos = c->c->ws->row_pos;
    for (int64_t tg = lo; tg < hi; tg++) {
        int64_t t = tg / n_grp;
        int32_t h0 = (int32_t)(tg % n_grp) * DI_DSV4_HEAD_GROUP;
        int32_t nh = H - h0 < DI_DSV4_HEAD_GROUP ? H - h0 : DI_DSV4_HEAD_GROUP;
        const di_dsv4_seq *sq = &c->c->seqs[row_seq[t]];
        const di_dsv4_layer_state *ls = &sq->layers[c->il];
        // This sequence's rows of the call start at row0, position p0.
        const int64_t p0 = sq->pos;
        const float *kv_call = c->kv + (int64_t)sq->row0 * Dh;
        int64_t P = row_pos[t];
        const float *q = c->q + (t * H + h0) * Dh;
        float *o = c->o + (t * H + h0) * Dh;
        int64_t w_lo = P - W + 1 > sq->win_lo ? P - W + 1 : sq->win_lo;
        int64_t n_win = P - w_lo + 1;
        // Key rows: window positions (ring for positions before this call), then compressed.
        int64_t n_cmp = 0;
        const int32_t *sel = NULL;
        if (ratio == 4) {
            sel = c->sel + t * topk;
            while (n_cmp < topk && sel[n_cmp] >= 0) n_cmp++;
        } else if (compress) {
            n_cmp = (P + 1) / ratio;
        }
        const di_dsv4_keys keys = {.ring = ls->ring,
                                   .ring_rows = DI_DSV4_RING_ROWS(W),
                                   .rows = kv_call,
                                   .p0 = p0,
                                   .w_lo = w_lo,
                                   .n_win = n_win,
                                   .cmp = &ls->cmp,
                                   .sel = sel,
                                   .n_cmp = n_cmp};
        di_dsv4_attend_heads(c->m, q, c->lw->attn_sink + h0, nh, &keys, P, omega, rscale, sc, o);
    }
}

// ---- the layer ----

void di_dsv4_attention(di_dsv4_ctx *c, const di_dsv4_layer_w *lw, int il, const float *a,
                       float *out) {
    di_model *m = c->model;
    const di_hparams *hp = &m->hp;
    const int64_t D = hp->n_embd, H = hp->n_head, Dh = hp->head_dim, Rq = hp->q_lora_rank;
    const int64_t G = hp->o_groups, Ro = hp->o_lora_rank, W = hp->window;
    const int32_t n_rot = hp->rope_main.n_dims, n_tok = c->n_rows;
    const int32_t *row_pos = c->ws->row_pos;
    const bool compress = lw->ratio > 0;
    const float *omega = compress ? m->omega_compress : m->omega_main;
    const float rscale =
        compress ? hp->rope_compress.attention_factor : hp->rope_main.attention_factor;
    const bool official = m->opt.precision == DI_PRECISION_OFFICIAL;
    const int64_t scores_stride = (int64_t)(c->ws->attn_scratch_floats / (size_t)m->cpu.n_threads);

    // q path: qr = RMSNorm(wq_a a); q = per-head RMS(wq_b qr); RoPE.
    float *qr = di_dsv4_scratch(c, DI_SCR_QR); // [T, Rq]
    di_dsv4_linear(c, &lw->wq_a, a, n_tok, D, qr, Rq, true);
    di_ref_rmsnorm(qr, n_tok, Rq, Rq, lw->q_norm, hp->norm_eps);
    di_dsv4_round(m, qr, n_tok * Rq);
    float *q = di_dsv4_scratch(c, DI_SCR_Q); // [T, H, Dh]
    di_dsv4_linear(c, &lw->wq_b, qr, n_tok, Rq, q, H * Dh, true);
    di_ref_rmsnorm(q, n_tok * H, Dh, Dh, NULL, hp->norm_eps);
    for (int64_t r = 0; r < n_tok * H; r++)
        di_ref_rope(q + r * Dh, Dh, n_rot, omega, row_pos[r / H], rscale, false);
    di_dsv4_round(m, q, n_tok * H * Dh);

    // kv path: one row per token, shared by all heads as K and V.
    float *kv = di_dsv4_scratch(c, DI_SCR_KV); // [T, Dh]
    di_dsv4_linear(c, &lw->wkv, a, n_tok, D, kv, Dh, true);
    di_ref_rmsnorm(kv, n_tok, Dh, Dh, lw->kv_norm, hp->norm_eps);
    di_dsv4_round(m, kv, n_tok * Dh);
    for (int32_t t = 0; t < n_tok; t++) {
        di_ref_rope(kv + t * Dh, Dh, n_rot, omega, row_pos[t], rscale, false);
        di_dsv4_round(m, kv + t * Dh, Dh);
        if (official) di_fake_quant_q8(kv + t * Dh, Dh - n_rot, 64);
    }

    // CSA: the indexer (its compressor first, then scores and top-k).
    int32_t *sel = NULL;
    if (lw->ratio == 4) {
        const int64_t HI = hp->n_index_head, DI = hp->index_head_dim;
        run_compressor(c, &lw->idx_cmp, il, true, a);
        float *qi = di_dsv4_scratch(c, DI_SCR_IQ); // [T, HI, DI]
        di_dsv4_linear(c, &lw->idx_wq_b, qr, n_tok, Rq, qi, HI * DI, true);
        for (int64_t r = 0; r < n_tok * HI; r++) {
            di_ref_rope(qi + r * DI, DI, n_rot, m->omega_compress, row_pos[r / HI],
                        hp->rope_compress.attention_factor, false);
            di_dsv4_round(m, qi + r * DI, DI);
            if (official) {
                di_hadamard(qi + r * DI, DI);
                di_dsv4_round(m, qi + r * DI, DI);
                di_fake_quant_q4(qi + r * DI, DI, 32);
            }
        }
        float *wi = di_dsv4_scratch(c, DI_SCR_IW); // [T, HI]
        di_dsv4_linear(c, &lw->idx_weights_proj, a, n_tok, D, wi, HI, false);
        const float wscale = 1.0f / sqrtf((float)DI) / sqrtf((float)HI);
        for (int64_t i = 0; i < n_tok * HI; i++) wi[i] *= wscale;
        di_dsv4_round(m, wi, n_tok * HI);
        sel = c->ws->sel;
        indexer_ctx ic = {
            m, c, il, qi, wi, n_tok, hp->index_topk, sel, c->ws->attn_scratch, scores_stride};
        di_pool_run(m->pool, indexer_task, &ic);
        if (c->trace)
            c->trace(c->trace_user, "indexer_topk", lw->il, sel, true, n_tok, hp->index_topk);
    }
    // CSA and HCA: the main compressor, before the attention of the same tokens.
    if (compress) run_compressor(c, &lw->cmp, il, false, a);

    float *o = di_dsv4_scratch(c, DI_SCR_O); // [T, H, Dh]
    attn_ctx ac = {m, c, lw, il, q, kv, o, sel, n_tok, c->ws->attn_scratch, scores_stride};
    di_pool_run(m->pool, attn_task, &ac);

    // Grouped output: u_g = wo_a[g] . concat(o of the heads of group g); out = wo_b . u.
    float *u = di_dsv4_scratch(c, DI_SCR_U); // [T, G*Ro]
    const int64_t group_in = H * Dh / G;
    for (int64_t g = 0; g < G; g++) {
        di_tensor wg = di_tensor_rows(&lw->wo_a, g * Ro, Ro);
        // wo_a: plain BF16 GEMM without activation quant in R-OFF (spec §5.17).
        di_dsv4_linear(c, &wg, o + g * group_in, n_tok, H * Dh, u + g * Ro, G * Ro, false);
    }
    di_dsv4_linear(c, &lw->wo_b, u, n_tok, G * Ro, out, D, true);

    // State: each sequence's last kv rows go into its ring (slot = position mod ring rows), as
    // many as the ring holds: after a rollback the window of the new last position is there.
    const int32_t ring_rows = DI_DSV4_RING_ROWS((int32_t)W);
    for (int32_t i = 0; i < c->n_seq; i++) {
        const di_dsv4_seq *sq = &c->seqs[i];
        float *ring = sq->layers[il].ring;
        for (int32_t t = sq->n_tok > ring_rows ? sq->n_tok - ring_rows : 0; t < sq->n_tok; t++)
            memcpy(ring + ((sq->pos + t) % ring_rows) * Dh, kv + ((int64_t)sq->row0 + t) * Dh,
                   sizeof(float) * (size_t)Dh);
    }
}
