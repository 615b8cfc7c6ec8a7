// dsv41_attn — one DeepSeek V4.1 attention layer (deepseek-v41.md §2.4, §2.5): projections (no
// per-head q RMS), the window row with Q8w over all dims, the CSA2 compressor of kv sources
// (m = 2 non-overlapping pooling without ape, m = 1 plain projection) finalising index keys and
// Q4e entries, the indexer of index sources (no Hadamard; level-1 candidate pool on the candidate
// source, level-2 restriction after it), top-k reuse on the other layers, the sink softmax over
// window + selected entries, the grouped output. Also the DSpark block attention (§3.3).
// Order per call (R-OFF): projections -> compressor -> indexer -> attention -> ring update.
// Entries and index keys are read and written through the state's pages (di_dsv41_entry / _key).
// The state holds packed codes (dsv41.h): the rows are packed where they are fake-quantised (the
// same quantiser, so bit-exact) and decoded into per-thread FP32 scratch where they are read, so
// the attention and the indexer compute on exactly the floats an FP32 state would hold.
// Positions fed again after a prefix-cache restart (di_dsv41_restart: the bounded replay) leave
// the entries they would close untouched (w < n_entries): those are in the cache's shared pages.
#include <math.h>
#include <string.h>

#include "backend/cpu/vec.h"
#include "base/log.h"
#include "model/dsv41.h"
#include "tensor/quant_ref.h"

// ---- shared helpers ----

// The latest kv source at or before layer il (validated at load to exist when ratio > 0).
static int source_of(const di_hparams *hp, int il) {
    for (int l = il; l >= 0; l--)
        if (hp->kv_source[l]) return l;
    return -1;
}

// q [T, H, Dh] and the window row kv [T, Dh] of a normed input a (scratch DI_SCR_QR/Q/KV); with
// packed, also the window rows as packed Q8 rows [T, ring_row_bytes] for the rings.
static void project(di_dsv4_ctx *c, const di_dsv4_layer_w *lw, const float *a, const float *omega,
                    float rscale, int32_t n_tok, const int32_t *pos, uint8_t *packed) {
    di_model *m = c->model;
    const di_hparams *hp = &m->hp;
    const int64_t D = hp->n_embd, H = hp->n_head, Dh = hp->head_dim, Rq = hp->q_lora_rank;
    const int32_t n_rot = hp->rope_main.n_dims;
    float *qr = di_dsv4_scratch(c, DI_SCR_QR); // [T, Rq]
    di_dsv4_linear(c, &lw->wq_a, a, n_tok, D, qr, Rq, true);
    di_ref_rmsnorm(qr, n_tok, Rq, Rq, lw->q_norm, hp->norm_eps);
    di_dsv4_round(m, qr, n_tok * Rq);
    float *q = di_dsv4_scratch(c, DI_SCR_Q); // [T, H, Dh]; no per-head RMS in V4.1
    di_dsv4_linear(c, &lw->wq_b, qr, n_tok, Rq, q, H * Dh, true);
    for (int64_t r = 0; r < n_tok * H; r++)
        di_ref_rope(q + r * Dh, Dh, n_rot, omega, pos[r / H], rscale, false);
    di_dsv4_round(m, q, n_tok * H * Dh);
    float *kv = di_dsv4_scratch(c, DI_SCR_KV); // [T, Dh]
    di_dsv4_linear(c, &lw->wkv, a, n_tok, D, kv, Dh, true);
    di_ref_rmsnorm(kv, n_tok, Dh, Dh, lw->kv_norm, hp->norm_eps);
    di_dsv4_round(m, kv, n_tok * Dh);
    const size_t rb = di_quant_q8_row_bytes(Dh, DI_DSV41_WIN_BLOCK);
    for (int32_t t = 0; t < n_tok; t++) {
        di_ref_rope(kv + t * Dh, Dh, n_rot, omega, pos[t], rscale, false);
        di_dsv4_round(m, kv + t * Dh, Dh);
        // Q8w: e4m3 with power-of-two scales per 32 over all Dh dims, in every precision
        // (R-HF applies it in FP32 too, §7.3 item 2).
        if (packed)
            di_quant_q8_pack(kv + t * Dh, Dh, DI_DSV41_WIN_BLOCK, packed + (size_t)t * rb);
        else
            di_fake_quant_q8(kv + t * Dh, Dh, DI_DSV41_WIN_BLOCK);
    }
}

// out [T, D] = wo_b · (grouped wo_a · o) (V4 §2.4).
static void out_proj(di_dsv4_ctx *c, const di_dsv4_layer_w *lw, const float *o, int32_t n_tok,
                     float *out) {
    const di_hparams *hp = &c->model->hp;
    const int64_t H = hp->n_head, Dh = hp->head_dim, G = hp->o_groups, Ro = hp->o_lora_rank;
    float *u = di_dsv4_scratch(c, DI_SCR_U); // [T, G*Ro]
    const int64_t group_in = H * Dh / G;
    for (int64_t g = 0; g < G; g++) {
        di_tensor wg = di_tensor_rows(&lw->wo_a, g * Ro, Ro);
        di_dsv4_linear(c, &wg, o + g * group_in, n_tok, H * Dh, u + g * Ro, G * Ro, false);
    }
    di_dsv4_linear(c, &lw->wo_b, u, n_tok, G * Ro, out, hp->n_embd, true);
}

// ---- attention core: sink softmax over a list of key rows ----

typedef struct attn_ctx {
    const di_dsv4_ctx *c; // the call: each row's sequence, position and state
    int il;               // state layer (the ring)
    int src_il;           // kv source of the selected entries (-1: none)
    const float *q;       // [T, H, Dh]
    const float *kv;      // [T, Dh] this call's rows
    const float *sink;    // [H]
    const int32_t *sel;   // [T, topk] or NULL
    const int32_t *n_sel; // [T]
    int32_t topk;
    int32_t win_keys; // W (backbone: window including the query) or W context rows (DSpark)
    bool dspark;      // keys: ring positions [p0 - W, p0) + every row of the sequence
    const float *omega;
    float rscale;
    float *o;      // [T, H, Dh]
    float *scores; // per thread
    int64_t scores_stride;
    float *keys; // per thread [cap_keys, Dh]: the keys of one query, decoded
    int32_t cap_keys;
} attn_ctx;

static void attn_task(void *p, int ith, int nth) {
    attn_ctx *c = p;
    const di_model *m = c->c->model;
    const di_hparams *hp = &m->hp;
    const int32_t H = hp->n_head, Dh = hp->head_dim;
    const int32_t *row_seq = c->c->ws->row_seq, *row_pos = c->c->ws->row_pos;
    float *sc = c->scores + (int64_t)ith * c->scores_stride;
    int64_t lo, hi;
    const int32_t n_grp = (H + DI_DSV4_HEAD_GROUP - 1) / DI_DSV4_HEAD_GROUP;
    di_split_range((int64_t)c->c->n_rows * n_grp, ith, nth, &lo, &hi);
    // Whose keys kb holds: a row's head groups are consecutive in this thread's range, so a row's
    // keys are decoded once per thread, not once per group (a DSpark block's rows all attend to
    // the same keys: once per sequence).
    int64_t decoded = -1;
    for (int64_t tg = lo; tg < hi; tg++) {
        int64_t t = tg / n_grp, P = row_pos[t];
        const di_dsv4_seq *sq = &c->c->seqs[row_seq[t]];
        const di_dsv41_state *st = sq->v41;
        const int64_t p0 = sq->pos;
        int32_t h0 = (int32_t)(tg % n_grp) * DI_DSV4_HEAD_GROUP;
        int32_t nh = H - h0 < DI_DSV4_HEAD_GROUP ? H - h0 : DI_DSV4_HEAD_GROUP;
        const float *q = c->q + (t * H + h0) * Dh;
        float *o = c->o + (t * H + h0) * Dh;
        // Keys: positions w_lo .. w_hi (ring below p0, this call's rows of the sequence from
        // p0), then entries.
        int64_t w_lo, w_hi;
        if (c->dspark) {
            w_lo = p0 - c->win_keys > 0 ? p0 - c->win_keys : 0;
            w_hi = p0 + sq->n_tok - 1;
        } else {
            w_lo = P - c->win_keys + 1 > 0 ? P - c->win_keys + 1 : 0;
            w_hi = P;
        }
        const int64_t n_win = w_hi - w_lo + 1;
        const int64_t n_cmp = c->sel && c->src_il >= 0 ? c->n_sel[t] : 0;
        DI_ASSERT(n_win + n_cmp <= c->cap_keys);
        // The keys in order, as FP32 rows: ring rows below p0 decoded, this call's rows copied,
        // then the selected entries decoded. The attention reads them as one contiguous run of
        // "call rows" (key_row in dsv4_attn.c), the same floats in the same order as before.
        float *kb = c->keys + (int64_t)ith * c->cap_keys * Dh;
        const float *call = c->kv + (int64_t)sq->row0 * Dh;
        const int64_t whose = c->dspark ? row_seq[t] : t;
        for (int64_t j = 0; j < n_win && whose != decoded; j++) {
            const int64_t pos = w_lo + j;
            if (pos < p0)
                di_quant_q8_unpack(st->ring[c->il] + (pos % st->ring_rows) * st->ring_row_bytes, Dh,
                                   DI_DSV41_WIN_BLOCK, kb + j * Dh);
            else
                memcpy(kb + j * Dh, call + (pos - p0) * Dh, sizeof(float) * (size_t)Dh);
        }
        if (n_cmp > 0 && whose != decoded) {
            const di_dsv41_src *src = &st->src[c->src_il];
            const int32_t *sel = c->sel + t * c->topk;
            for (int64_t i = 0; i < n_cmp; i++)
                di_quant_q4e_unpack(di_dsv41_entry(st, src, sel[i]), Dh, DI_DSV41_ENT_BLOCK,
                                    kb + (n_win + i) * Dh);
        }
        decoded = whose;
        const di_dsv4_keys keys = {.ring = NULL,
                                   .ring_rows = 1,
                                   .rows = kb,
                                   .p0 = w_lo,
                                   .w_lo = w_lo,
                                   .n_win = n_win + n_cmp,
                                   .cmp = NULL,
                                   .sel = NULL,
                                   .n_cmp = 0};
        di_dsv4_attend_heads(m, q, c->sink + h0, nh, &keys, P, c->omega, c->rscale, sc, o);
    }
}

// The packed window rows of the call's rows (packed [T, ring_row_bytes]) into each sequence's
// ring of state layer il (sequences without that layer, plain sessions in a DSpark block's call,
// are skipped).
static void ring_write(const di_dsv4_ctx *c, int il, const uint8_t *packed) {
    for (int32_t i = 0; i < c->n_seq; i++) {
        const di_dsv4_seq *sq = &c->seqs[i];
        const di_dsv41_state *st = sq->v41;
        if (il >= st->n_state_layers) continue;
        const size_t rb = (size_t)st->ring_row_bytes;
        const uint8_t *rows = packed + (size_t)sq->row0 * rb;
        for (int32_t t = sq->n_tok > st->ring_rows ? sq->n_tok - st->ring_rows : 0; t < sq->n_tok;
             t++)
            memcpy(st->ring[il] + (size_t)((sq->pos + t) % st->ring_rows) * rb,
                   rows + (size_t)t * rb, rb);
    }
}

// ---- CSA2 compressor of a kv source (§2.5.1) ----

// Index key (Q4) and main entry (Q4e) of entry w from its latent [Dh] (pre-RoPE; modified),
// quantised straight into their packed rows in the page.
static void finalise(di_dsv4_ctx *c, const di_dsv4_layer_w *lw, const di_dsv41_state *st,
                     const di_dsv41_src *src, float *latent, int64_t w) {
    di_model *m = c->model;
    const di_hparams *hp = &m->hp;
    const int32_t Dh = hp->head_dim, DI = hp->index_head_dim, n_rot = hp->rope_main.n_dims;
    const int64_t pos = w * lw->ratio;
    const float rs = hp->rope_compress.attention_factor;
    float k[4096];
    DI_ASSERT(DI <= 4096);
    di_dsv4_linear(c, &lw->idx_wk, latent, 1, Dh, k, DI, false); // BF16 matmul in R-OFF
    di_ref_rmsnorm(k, 1, DI, DI, lw->idx_k_norm, hp->norm_eps);
    di_dsv4_round(m, k, DI);
    di_ref_rope(k, DI, n_rot, m->omega_compress, pos, rs, false);
    di_dsv4_round(m, k, DI);
    di_quant_q4_pack(k, DI, DI_DSV41_KEY_BLOCK, di_dsv41_key(st, src, w));
    di_ref_rope(latent, Dh, n_rot, m->omega_compress, pos, rs, false);
    di_dsv4_round(m, latent, Dh);
    di_quant_q4e_pack(latent, Dh, DI_DSV41_ENT_BLOCK, di_dsv41_entry(st, src, w));
}

static void compressor(di_dsv4_ctx *c, const di_dsv4_layer_w *lw, int il, const float *a) {
    di_model *m = c->model;
    const di_hparams *hp = &m->hp;
    const int64_t D = hp->n_embd, Dh = hp->head_dim;
    const int32_t n_tok = c->n_rows;
    const int32_t *row_seq = c->ws->row_seq, *row_pos = c->ws->row_pos;
    const di_dsv4_compressor_w *cw = &lw->cmp;
    float *cc = di_dsv4_scratch(c, DI_SCR_CC), *cz = di_dsv4_scratch(c, DI_SCR_CZ);
    float latent[4096];
    DI_ASSERT(Dh <= 4096);
    if (lw->ratio == 1) {
        // latent_j = RMSNorm(wkv · a_j): BF16 matmul (no activation quant) in R-OFF.
        di_dsv4_linear(c, &cw->wkv, a, n_tok, D, cc, Dh, false);
        for (int32_t t = 0; t < n_tok; t++) {
            di_dsv41_state *st = c->seqs[row_seq[t]].v41;
            di_dsv41_src *src = &st->src[il];
            int64_t w = row_pos[t];
            if (w < src->n_entries) continue; // a prefix-cache entry, fed again: kept
            memcpy(latent, cc + t * Dh, sizeof(float) * (size_t)Dh);
            di_ref_rmsnorm(latent, 1, Dh, Dh, cw->norm, hp->norm_eps);
            di_dsv4_round(m, latent, Dh);
            DI_ASSERT(w == src->n_entries && w < (int64_t)st->n_pages * src->per_page);
            finalise(c, lw, st, src, latent, w);
            src->n_entries = w + 1;
        }
        return;
    }
    // m = 2: C, Z in FP32 (FP32 weights and input); groups (2w, 2w + 1), softmax per channel.
    DI_ASSERT(lw->ratio == 2);
    di_dsv4_matmul(m, &cw->wkv, a, n_tok, D, cc, Dh);   // C: [T, Dh]
    di_dsv4_matmul(m, &cw->wgate, a, n_tok, D, cz, Dh); // Z: [T, Dh]
    for (int32_t t = 0; t < n_tok; t++) {
        di_dsv41_state *st = c->seqs[row_seq[t]].v41;
        di_dsv41_src *src = &st->src[il];
        int64_t P = row_pos[t];
        float *slot = src->cz + ((P / 2) % DI_DSV41_CZ_SLOTS) * 2 * Dh;
        if (P % 2 == 0) { // stash as the pending half of group P / 2
            memcpy(slot, cc + t * Dh, sizeof(float) * (size_t)Dh);
            memcpy(slot + Dh, cz + t * Dh, sizeof(float) * (size_t)Dh);
            continue;
        }
        if (P / 2 < src->n_entries) continue; // a prefix-cache entry, fed again: kept
        const float *c0 = slot, *z0 = slot + Dh, *c1 = cc + t * Dh, *z1 = cz + t * Dh;
        for (int64_t d = 0; d < Dh; d++) {
            float mx = fmaxf(z0[d], z1[d]);
            float e0 = expf(z0[d] - mx), e1 = expf(z1[d] - mx);
            latent[d] = (e0 * c0[d] + e1 * c1[d]) / (e0 + e1);
        }
        di_dsv4_round(m, latent, Dh);
        di_ref_rmsnorm(latent, 1, Dh, Dh, cw->norm, hp->norm_eps);
        di_dsv4_round(m, latent, Dh);
        int64_t w = P / 2;
        DI_ASSERT(w == src->n_entries && w < (int64_t)st->n_pages * src->per_page);
        finalise(c, lw, st, src, latent, w);
        src->n_entries = w + 1;
    }
}

// ---- indexer (§2.5.3) ----

typedef struct idx_ctx {
    const di_dsv4_ctx *c; // the call: each row's sequence, position and state
    int src_il;           // the kv source whose index keys are scored
    int32_t src_ratio;
    const float *qi;     // [T, HI, DI]
    const float *wi;     // [T, HI]
    bool is_cand_source; // build the candidate pool (level 1)
    bool restrict_cand;  // apply the published pool (level 2)
} idx_ctx;

static void idx_task(void *p, int ith, int nth) {
    idx_ctx *c = p;
    const di_model *m = c->c->model;
    const di_hparams *hp = &m->hp;
    di_dsv41_rows *st = c->c->ws->v41; // the rows' selections and this thread's scratch
    const int32_t *row_seq = c->c->ws->row_seq, *row_pos = c->c->ws->row_pos;
    const int32_t HI = hp->n_index_head, DI = hp->index_head_dim, topk = hp->index_topk;
    const int32_t bs = hp->candidate_block_size, ntb = hp->candidate_topk_blocks;
    float *sc = st->scores + (int64_t)ith * st->cap_ent;
    float *blk = st->blk + (int64_t)ith * (st->cap_ent + 1);
    // Decoded index keys: [0, cap) of the sequence of the rows scored last (rows are split in
    // contiguous ranges, so a prefill's rows of one sequence follow each other; the keys do not
    // change during the indexer), then a chunk for keys from cap on.
    const int64_t cap = st->cap_ikeys;
    float *keys = st->ikeys + (int64_t)ith * (cap + DI_DSV4_KEY_CHUNK) * DI;
    const di_dsv41_state *dec_seq = NULL; // whose keys [0, n_dec) are decoded in keys
    int64_t n_dec = 0;
    int64_t lo, hi;
    di_split_range(c->c->n_rows, ith, nth, &lo, &hi);
    for (int64_t t = lo; t < hi; t++) {
        const di_dsv41_state *ss = c->c->seqs[row_seq[t]].v41;
        const di_dsv41_src *src = &ss->src[c->src_il];
        int64_t P = row_pos[t], vis = (P + 1) / c->src_ratio;
        DI_ASSERT(vis <= src->n_entries && vis <= st->cap_ent);
        if (ss != dec_seq) dec_seq = ss, n_dec = 0;
        const float *kp[DI_DSV4_KEY_CHUNK];
        for (int64_t w0 = 0; w0 < vis; w0 += DI_DSV4_KEY_CHUNK) {
            int64_t nk = vis - w0 < DI_DSV4_KEY_CHUNK ? vis - w0 : DI_DSV4_KEY_CHUNK;
            for (int64_t w = 0; w < nk; w++) {
                const int64_t e = w0 + w;
                float *k = e < cap ? keys + e * DI : keys + (cap + w) * DI;
                if (e >= n_dec || e >= cap)
                    di_quant_q4_unpack(di_dsv41_key(ss, src, e), DI, DI_DSV41_KEY_BLOCK, k);
                kp[w] = k;
            }
            if (w0 + nk > n_dec) n_dec = w0 + nk < cap ? w0 + nk : cap;
            di_cpu_index_scores(m->cpu.isa, c->qi + t * HI * DI, c->wi + t * HI, HI, kp, nk, DI,
                                sc + w0);
        }
        di_dsv4_round(m, sc, vis); // R-OFF: BF16 scores
        int32_t *cand = st->cand + t * ntb;
        if (c->is_cand_source)
            st->n_cand[t] = di_ref_cand_build(sc, vis, bs, ntb, blk, cand);
        else if (c->restrict_cand)
            di_ref_cand_mask(sc, vis, bs, cand, st->n_cand[t]);
        // Top-k over the visible entries. A pick whose score is -inf (outside the level-2
        // candidate pool, when the pool holds fewer than k visible entries) is dropped, as R-HF
        // does (its -1 = never attended; -1 padded as R-HF's dump); R-OFF would keep it. R-HF is
        // the reference.
        int32_t k = (int32_t)(vis < topk ? vis : topk), *sel = st->topk + t * topk;
        di_dsv4_topk(sc, vis, k, sel);
        for (int32_t i = k; i < topk; i++) sel[i] = -1;
        int32_t n = di_ref_cand_drop(sc, sel, topk);
        st->n_topk[t] = n;
    }
}

static void indexer(di_dsv4_ctx *c, const di_dsv4_layer_w *lw, int il, const float *a, int src_il) {
    di_model *m = c->model;
    di_dsv41_rows *st = c->ws->v41;
    const int32_t n_tok = c->n_rows, *row_pos = c->ws->row_pos;
    const di_hparams *hp = &m->hp;
    const int64_t D = hp->n_embd, Rq = hp->q_lora_rank, HI = hp->n_index_head;
    const int64_t DI = hp->index_head_dim;
    const int32_t n_rot = hp->rope_main.n_dims;
    const float *qr = di_dsv4_scratch(c, DI_SCR_QR);
    float *qi = di_dsv4_scratch(c, DI_SCR_IQ); // [T, HI, DI]
    di_dsv4_linear(c, &lw->idx_wq_b, qr, n_tok, Rq, qi, HI * DI, true);
    for (int64_t r = 0; r < n_tok * HI; r++) {
        di_ref_rope(qi + r * DI, DI, n_rot, m->omega_compress, row_pos[r / HI],
                    hp->rope_compress.attention_factor, false);
        di_dsv4_round(m, qi + r * DI, DI);
        di_fake_quant_q4(qi + r * DI, DI, DI_DSV41_KEY_BLOCK); // no Hadamard in V4.1
    }
    float *wi = di_dsv4_scratch(c, DI_SCR_IW); // [T, HI]
    di_dsv4_linear(c, &lw->idx_weights_proj, a, n_tok, D, wi, HI, false);
    const float wscale = 1.0f / sqrtf((float)DI) / sqrtf((float)HI);
    for (int64_t i = 0; i < n_tok * HI; i++) wi[i] *= wscale;
    di_dsv4_round(m, wi, n_tok * HI);
    const bool is_cand = il == hp->candidate_layer;
    idx_ctx ic = {.c = c,
                  .src_il = src_il,
                  .src_ratio = hp->compress_ratio[src_il],
                  .qi = qi,
                  .wi = wi,
                  .is_cand_source = is_cand,
                  .restrict_cand = !is_cand && st->have_cand && hp->candidate_layer >= 0 &&
                                   hp->candidate_layer < il};
    di_pool_run(m->pool, idx_task, &ic);
    st->have_topk = true;
    if (is_cand) st->have_cand = true;
    // "topk.<il>": ascending picks, -1 padded (the names of python/di_ref/v41.py).
    if (c->trace) c->trace(c->trace_user, "topk", il, st->topk, true, n_tok, hp->index_topk);
}

// ---- the layer ----

void di_dsv41_attention(di_dsv4_ctx *c, const di_dsv4_layer_w *lw, int il, const float *a,
                        float *out) {
    di_model *m = c->model;
    const di_hparams *hp = &m->hp;
    di_dsv41_rows *w = c->ws->v41;
    const int32_t n_tok = c->n_rows;
    const bool compress = lw->ratio > 0;
    const float *omega = compress ? m->omega_compress : m->omega_main;
    const float rscale =
        compress ? hp->rope_compress.attention_factor : hp->rope_main.attention_factor;
    project(c, lw, a, omega, rscale, n_tok, c->ws->row_pos, w->kv_packed);
    int src_il = compress ? source_of(hp, il) : -1;
    if (lw->kv_source) compressor(c, lw, il, a);
    if (lw->index_source) indexer(c, lw, il, a, src_il);

    attn_ctx ac = {
        .c = c,
        .il = il,
        .src_il = src_il,
        .q = di_dsv4_scratch(c, DI_SCR_Q),
        .kv = di_dsv4_scratch(c, DI_SCR_KV),
        .sink = lw->attn_sink,
        .sel = compress && w->have_topk ? w->topk : NULL,
        .n_sel = w->n_topk,
        .topk = hp->index_topk,
        .win_keys = hp->window,
        .dspark = false,
        .omega = omega,
        .rscale = rscale,
        .o = di_dsv4_scratch(c, DI_SCR_O),
        .scores = c->ws->attn_scratch,
        .scores_stride = (int64_t)(c->ws->attn_scratch_floats / (size_t)m->cpu.n_threads),
        .keys = w->keys,
        .cap_keys = w->cap_keys,
    };
    di_pool_run(m->pool, attn_task, &ac);
    out_proj(c, lw, ac.o, n_tok, out);
    ring_write(c, il, w->kv_packed);
}

// ---- DSpark (§3.2, §3.3) ----

void di_dsv41_dspark_attention(di_dsv4_ctx *c, const di_dsv4_layer_w *lw, int il_state,
                               const float *a, float *out) {
    di_model *m = c->model;
    const di_hparams *hp = &m->hp;
    // Block rows are not stored: fake-quantised, not packed.
    project(c, lw, a, m->omega_main, hp->rope_main.attention_factor, c->n_rows, c->ws->row_pos,
            NULL);
    attn_ctx ac = {
        .c = c,
        .il = il_state,
        .src_il = -1,
        .q = di_dsv4_scratch(c, DI_SCR_Q),
        .kv = di_dsv4_scratch(c, DI_SCR_KV),
        .sink = lw->attn_sink,
        .n_sel = c->ws->v41->n_topk,
        .topk = hp->index_topk,
        .win_keys = hp->window,
        .dspark = true,
        .omega = m->omega_main,
        .rscale = hp->rope_main.attention_factor,
        .o = di_dsv4_scratch(c, DI_SCR_O),
        .scores = c->ws->attn_scratch,
        .scores_stride = (int64_t)(c->ws->attn_scratch_floats / (size_t)m->cpu.n_threads),
        .keys = c->ws->v41->keys,
        .cap_keys = c->ws->v41->cap_keys,
    };
    di_pool_run(m->pool, attn_task, &ac);
    out_proj(c, lw, ac.o, c->n_rows, out);
}

void di_dsv41_dspark_ring(di_dsv4_ctx *c, const di_dsv4_layer_w *lw, int il_state,
                          const float *main_x) {
    di_model *m = c->model;
    const di_hparams *hp = &m->hp;
    const int64_t D = hp->n_embd, Dh = hp->head_dim;
    const int32_t n_rot = hp->rope_main.n_dims, n = c->n_rows;
    float *kv = di_dsv4_scratch(c, DI_SCR_KV); // [n, Dh]
    uint8_t *packed = c->ws->v41->kv_packed;   // [n, ring_row_bytes]
    const size_t rb = di_quant_q8_row_bytes(Dh, DI_DSV41_WIN_BLOCK);
    di_dsv4_linear(c, &lw->wkv, main_x, n, D, kv, Dh, true);
    di_ref_rmsnorm(kv, n, Dh, Dh, lw->kv_norm, hp->norm_eps);
    di_dsv4_round(m, kv, n * Dh);
    for (int32_t t = 0; t < n; t++) {
        di_ref_rope(kv + t * Dh, Dh, n_rot, m->omega_main, c->ws->row_pos[t],
                    hp->rope_main.attention_factor, false);
        di_dsv4_round(m, kv + t * Dh, Dh);
        di_quant_q8_pack(kv + t * Dh, Dh, DI_DSV41_WIN_BLOCK, packed + (size_t)t * rb);
    }
    ring_write(c, il_state, packed);
}
