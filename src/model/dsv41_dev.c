// dsv41_dev — the device-resident V4.1 forward on a backend (dsv41_dev.h). It mirrors
// model/dsv41.c and dsv41_attn.c op for op (and dsv4_moe.c through the backend's moe), in the FP32
// recipe and the official one (every di_dsv4_round of the CPU forward is a ROUND here, in the same
// order); where those keep per-sequence state (Engram history, rings, the pending ratio-2 row) this
// file keeps rows in backend pools and lists on the host which rows each op reads. Everything up
// to "the forward over its stages" is one pipeline stage (dev_stage, stage_state: its layers
// [l0, l1)); that last section is the public API, dispatching over the stages (dsv41_dev.h
// "Pipeline stages"). Sections: weights, state, per-call metadata, the layer, checks, the call,
// the forward over its stages (with rollback and DSpark's enable and draft calls). Over 2,000
// lines: the DSpark blocks, taps and context rows are ops of the same call records (call,
// stage_state, the staging lists and their OP / ROUND macros) as the layers', and a split would
// have to export those internals.
#include "model/dsv41_dev.h"

#include <math.h>
#include <stdio.h>  // snprintf
#include <stdlib.h> // getenv
#include <string.h>

#include "base/log.h"
#include "base/mem.h"
#include "base/status.h"      // DI_TRY
#include "model/dev_common.h" // weight uploads, MoE weights, logit rows
#include "model/dsv41.h"
#include "backend/cpu/ref_ops.h" // di_ref_dot, di_sigmoid: the DSpark heads' host part, as dsv41.c

// The backend's code formats are the CPU forward's (attn_codes and index_scores_q4 decode these).
_Static_assert(DI_DSV41_WIN_BLOCK == DI_BACKEND_WIN_BLOCK &&
                   DI_DSV41_ENT_BLOCK == DI_BACKEND_ENT_BLOCK &&
                   DI_DSV41_KEY_BLOCK == DI_BACKEND_KEY_BLOCK,
               "V4.1's code blocks");

// Head rows computed at once (bounds the logits scratch [HEAD_CHUNK, V]); also the most sequences
// of a decode step run as a graph.
enum { HEAD_CHUNK = 64 };
// Graph steps: every sequence r <= GRAPH_ROWS rows with all their logits (a decode step, r = 1;
// a verify step of r - 1 drafts), at most HEAD_CHUNK rows; one graph per (r, sequences), slot
// (r - 1) * (HEAD_CHUNK + 1) + n_seq of a state's graphs.
enum { GRAPH_ROWS = DI_DSV41_ROLLBACK_MAX + 1, N_GRAPHS = GRAPH_ROWS * (HEAD_CHUNK + 1) };

// Rollback (di_dsv41_dev_rollback, dsv41_dev.h "Rollback"): a slot's window ring of every layer
// holds ring_rows = W + DI_DSV41_ROLLBACK_MAX rows (position p in row p mod ring_rows) and a
// ratio-2 source's C and Z rings CZ_ROWS rows (p mod CZ_ROWS), so the rows of rejected positions
// never overwrite rows a kept position still reads.
enum { CZ_ROWS = DI_DSV41_ROLLBACK_MAX + 2 };
static int64_t ring_rows(const di_hparams *hp) {
    return (int64_t)hp->window + DI_DSV41_ROLLBACK_MAX;
}

// ---- weights ----

typedef struct dev_hc {
    di_tensor fn;
    float *base, *scale; // backend
} dev_hc;

typedef struct dev_layer {
    int32_t ratio, src; // compress ratio; the kv source whose entries it reads (-1: none)
    bool kv_source, index_source;
    float *attn_norm, *ffn_norm; // backend [D]
    dev_hc hc_attn, hc_ffn;
    di_tensor wq_a, wq_b, wkv, wo_a, wo_b;
    float *q_norm, *kv_norm, *attn_sink; // backend
    di_tensor cmp_wkv, cmp_wgate, idx_wk;
    float *cmp_norm, *idx_k_norm; // backend [Dh], [DI]
    di_tensor idx_wq_b, idx_weights_proj;
    int32_t engram; // Engram module index, -1: none
    di_tensor eg_wkv;
    float *eg_qk; // backend [NC, D]
    di_backend_moe_w moe;
    // A kv source's roles on this stage (set for any il, inside the stage's layers or not;
    // dsv41_dev.h "Pipeline stages"): mirror, an earlier stage owns source il and a layer here
    // reads it, so the stage keeps a mirror of its entries and index keys; handed, il is one of
    // the stage's layers and a later stage mirrors it, so its finalised rows are handed over.
    bool mirror, handed;
} dev_layer;

// One pipeline stage (dsv41_dev.h "Pipeline stages"): the weights of layers [l0, l1) on its
// backend, the embedding on the first, the head and final norm on the last. Layers are indexed by
// their model index (layers[il] uploaded for il in [l0, l1) only).
typedef struct dev_stage {
    di_model *m;   // borrowed
    di_backend *b; // borrowed
    int32_t l0, l1;
    bool first, last;
    int32_t n_eg;          // Engram modules on the stage (those gather rows, keep the history)
    di_tensor embed, head; // embed: first stage; head: last stage
    float *norm;           // backend [D]
    float *omega_main, *omega_compress; // backend [n_rot / 2]
    dev_layer *layers;                  // owned [n_layer]
    // What the stage receives from the stage before it (_in) and hands to the next (_out) besides
    // the streams and pre: the published top-k, the candidate pool (dsv41_dev.h "Pipeline
    // stages"; false on one stage).
    bool topk_in, topk_out, cand_in, cand_out;
    // Engram tables by module: the model's host tensors (borrowed), never uploaded ("Engram
    // tables" in dsv41_dev.h): each call's rows are gathered into its staging.
    const di_tensor *eg_tables[DI_MAX_ENGRAM];
    di_dev_up up;  // the backend blocks it uploaded (freed at destroy)
    bool official; // the official precision recipe (R-OFF)
    // DSpark (dsv41_dev.h "DSpark"; the last stage, when the model loaded its blocks): the blocks
    // (layers without compressor, indexer or Engram), main_proj / main_norm, the final norm and the
    // Markov head's projection; the Markov embedding and the confidence head stay on the host.
    int32_t n_ds;
    dev_layer *ds; // owned [n_ds]
    di_tensor ds_main_proj, ds_markov_head;
    float *ds_main_norm, *ds_norm; // backend [D]
    bool taps_here;                // a DSpark target layer is on this stage or an earlier one
} dev_stage;

// The forward over its stages (dsv41_dev.h "Pipeline stages").
struct di_dsv41_dev {
    di_model *m; // borrowed
    int32_t n_stages;
    dev_stage *st[DI_DSV41_DEV_MAX_STAGES]; // owned, in layer order
};

static di_status up_floats(dev_stage *d, const float *host, int64_t n, float **out) {
    return di_dev_up_floats(&d->up, host, n, out);
}

static di_status up_weight(dev_stage *d, const di_tensor *w, di_tensor *out) {
    return di_dev_up_weight(&d->up, w, out);
}

static di_status up_hc(dev_stage *d, const di_dsv4_hc_w *hc, int32_t n_base, dev_hc *out) {
    di_status st = up_weight(d, &hc->fn, &out->fn);
    if (st == DI_OK) st = up_floats(d, hc->base, n_base, &out->base);
    if (st == DI_OK) st = up_floats(d, hc->scale, 3, &out->scale);
    return st;
}

// The latest kv source at or before layer il (dsv41_attn.c source_of; validated at load).
static int source_of(const di_hparams *hp, int il) {
    for (int l = il; l >= 0; l--)
        if (hp->kv_source[l]) return l;
    return -1;
}

static di_status up_layer(dev_stage *d, const di_dsv4_layer_w *lw, dev_layer *out, di_tensor *tmp) {
    const di_model *m = d->m;
    const di_hparams *hp = &m->hp;
    const int32_t nc = hp->hc_mult, D = hp->n_embd;
    di_status st = DI_OK;
    out->ratio = lw->ratio;
    out->kv_source = lw->kv_source;
    out->index_source = lw->index_source;
    out->src = lw->ratio > 0 ? source_of(hp, lw->il) : -1;
    out->engram = lw->engram;
    if (lw->hash_routed) {
        DI_LOG_ERROR("dev forward (V4.1): layer %d is hash-routed (V4.1 has no hash layers)",
                     lw->il);
        return DI_ERR_UNSUPPORTED;
    }
    DI_TRY(up_floats(d, lw->attn_norm, D, &out->attn_norm));
    DI_TRY(up_floats(d, lw->ffn_norm, D, &out->ffn_norm));
    DI_TRY(up_hc(d, &lw->hc_attn, (2 + nc) * nc, &out->hc_attn));
    DI_TRY(up_hc(d, &lw->hc_ffn, (2 + nc) * nc, &out->hc_ffn));
    DI_TRY(up_weight(d, &lw->wq_a, &out->wq_a));
    DI_TRY(up_weight(d, &lw->wq_b, &out->wq_b));
    DI_TRY(up_weight(d, &lw->wkv, &out->wkv));
    DI_TRY(up_weight(d, &lw->wo_a, &out->wo_a));
    DI_TRY(up_weight(d, &lw->wo_b, &out->wo_b));
    DI_TRY(up_floats(d, lw->q_norm, hp->q_lora_rank, &out->q_norm));
    DI_TRY(up_floats(d, lw->kv_norm, hp->head_dim, &out->kv_norm));
    DI_TRY(up_floats(d, lw->attn_sink, hp->n_head, &out->attn_sink));
    if (lw->kv_source) {
        DI_TRY(up_weight(d, &lw->cmp.wkv, &out->cmp_wkv));
        if (lw->ratio == 2) DI_TRY(up_weight(d, &lw->cmp.wgate, &out->cmp_wgate));
        DI_TRY(up_floats(d, lw->cmp.norm, hp->head_dim, &out->cmp_norm));
        DI_TRY(up_weight(d, &lw->idx_wk, &out->idx_wk));
        DI_TRY(up_floats(d, lw->idx_k_norm, hp->index_head_dim, &out->idx_k_norm));
    }
    if (lw->index_source) {
        DI_TRY(up_weight(d, &lw->idx_wq_b, &out->idx_wq_b));
        DI_TRY(up_weight(d, &lw->idx_weights_proj, &out->idx_weights_proj));
    }
    if (lw->engram >= 0) {
        d->eg_tables[lw->engram] = &lw->eg_table; // stays on the host
        DI_TRY(up_weight(d, &lw->eg_wkv, &out->eg_wkv));
        DI_TRY(up_floats(d, lw->eg_qk, (int64_t)nc * D, &out->eg_qk));
    }
    // MoE: dsv4_moe.c's fields and V4.1's rules (gate_temp, the + 1e-20 in both recipes, A8 in
    // blocks of 32).
    DI_TRY(di_dev_up_moe(&d->up, m, lw, tmp, &out->moe));
    return DI_OK;
fail:
    DI_LOG_ERROR("dev forward (V4.1): layer %d not uploaded (%s)", lw->il, di_status_str(st));
    return st;
}

static void stage_destroy(dev_stage *d);

// Whether layer il is one of stage d's.
static bool here(const dev_stage *d, int il) {
    return il >= d->l0 && il < d->l1;
}

// Whether stage d keeps kv source il's entries and index keys: its own, or a mirror.
static bool keeps(const dev_stage *d, int il) {
    return d->m->hp.kv_source[il] && (here(d, il) || d->layers[il].mirror);
}

// Stage of layers [l0, l1) on b (the model's checks done by the caller).
static di_status stage_create(di_model *m, di_backend *b, int32_t l0, int32_t l1, bool first,
                              bool last, dev_stage **out) {
    const di_hparams *hp = &m->hp;
    di_status st = DI_OK;
    di_tensor *tmp = NULL;
    dev_stage *d = di_calloc(1, sizeof *d);
    if (!d) return DI_ERR_NOMEM;
    d->m = m;
    d->b = b;
    d->l0 = l0, d->l1 = l1, d->first = first, d->last = last;
    for (int L = 0; L < hp->n_engram; L++) d->n_eg += here(d, hp->engram_layer[L]);
    d->up = (di_dev_up){.b = b, .who = "dev forward (V4.1)"};
    d->official = m->opt.precision == DI_PRECISION_OFFICIAL;
    d->layers = di_calloc((size_t)hp->n_layer, sizeof *d->layers);
    int32_t max_e = 1;
    for (int il = l0; il < l1; il++)
        if (m->layers[il].n_expert > max_e) max_e = m->layers[il].n_expert;
    for (int i = 0; last && i < m->n_mtp_loaded; i++)
        if (m->mtp[i].block.n_expert > max_e) max_e = m->mtp[i].block.n_expert;
    tmp = di_calloc((size_t)max_e, sizeof *tmp);
    if (!d->layers || !tmp) {
        st = DI_ERR_NOMEM;
        goto fail;
    }
    const int half = hp->rope_main.n_dims / 2;
    // The embedding: the first stage's, and the last one's when it drafts (DSpark's block rows).
    if (first || (last && m->n_mtp_loaded > 0)) DI_TRY(up_weight(d, &m->embed, &d->embed));
    if (last) {
        DI_TRY(up_weight(d, &m->head, &d->head));
        DI_TRY(up_floats(d, m->norm, hp->n_embd, &d->norm));
    }
    DI_TRY(up_floats(d, m->omega_main, half, &d->omega_main));
    DI_TRY(up_floats(d, m->omega_compress, half, &d->omega_compress));
    for (int il = l0; il < l1; il++) DI_TRY(up_layer(d, &m->layers[il], &d->layers[il], tmp));
    for (int k = 0; k < hp->n_dspark_target; k++) d->taps_here |= hp->dspark_target[k] < l1;
    if (last && m->n_mtp_loaded > 0) {
        d->ds = di_calloc((size_t)m->n_mtp_loaded, sizeof *d->ds);
        if (!d->ds) {
            st = DI_ERR_NOMEM;
            goto fail;
        }
        d->n_ds = m->n_mtp_loaded;
        for (int i = 0; i < d->n_ds; i++) DI_TRY(up_layer(d, &m->mtp[i].block, &d->ds[i], tmp));
        DI_TRY(up_weight(d, &m->dspark.main_proj, &d->ds_main_proj));
        DI_TRY(up_weight(d, &m->dspark.markov_head, &d->ds_markov_head));
        DI_TRY(up_floats(d, m->dspark.main_norm, hp->n_embd, &d->ds_main_norm));
        DI_TRY(up_floats(d, m->dspark.norm, hp->n_embd, &d->ds_norm));
    }
    DI_TRY(b->vt->sync(b)); // the host arrays of the uploads may be reused after this
    di_free(tmp);
    *out = d;
    return DI_OK;
fail:
    di_free(tmp);
    stage_destroy(d);
    return st;
}

static void stage_destroy(dev_stage *d) {
    if (!d) return;
    di_dev_up_free(&d->up);
    di_free(d->layers);
    di_free(d->ds);
    di_free(d);
}

static int64_t gcd64(int64_t a, int64_t b) {
    while (b) {
        int64_t t = a % b;
        a = b;
        b = t;
    }
    return a;
}

// dsv41_dev.h di_dsv41_dev_block_tokens: over every layer of the model (all stages).
static int32_t model_block_tokens(const di_model *m) {
    const di_hparams *hp = &m->hp;
    int64_t l = 1;
    for (int il = 0; il < hp->n_layer; il++)
        if (hp->compress_ratio[il] > 0)
            l = l / gcd64(l, hp->compress_ratio[il]) * hp->compress_ratio[il];
    int64_t bt = l;
    while (bt < hp->window) bt += l;
    return (int32_t)bt;
}

// ---- state ----

// A kv source's device state: its entries and index keys as packed codes (dsv41_dev.h "State
// layout"), entry w of block b at row b * per_page + w of each.
typedef struct dev_src {
    int32_t il, m, per_page; // layer, ratio, entries per block
    uint8_t *ent;            // backend [n_blocks * per_page] Q4e rows of ent_bytes
    uint8_t *ikeys;          // backend [n_blocks * per_page] Q4 rows of key_bytes
    float *ring_c, *ring_z;  // backend [n_slots * CZ_ROWS, Dh] (m = 2, the owner), else NULL
    int32_t cap_vis;         // the most entries a slot can have: n_ctx / m
    // The hand-over of a handed or mirrored source (NULL: neither): a call's n_pool finalised
    // rows before packing, [n_pool, Dh] entries then [n_pool, DI] index keys as FP32 (backend
    // [max_rows * (Dh + DI)]); the mirror packs them into the same codes the owner stored.
    float *xfer;
} dev_src;

typedef struct dev_graph {
    void *g;       // backend graph (NULL: not captured)
    int32_t n_run; // steps of this size run so far
    int64_t n_ops; // ops it captured (stats.last_ops of a launch)
} dev_graph;

// One stage's part of a state (di_dsv41_dev_state: one per stage): the pools, rings, index keys,
// scratch, staging and graphs of the stage's layers; the slots' bookkeeping (n_past, the Engram
// history, on the stages with Engram layers) is kept alike on every stage.
typedef struct stage_state stage_state;
struct stage_state {
    dev_stage *d; // borrowed
    int32_t n_slots, n_ctx, max_rows, block_tokens, max_blocks, n_eblocks;
    bool shared;        // blocks listed per call
    int64_t layer_rows; // window rows of one layer: max_rows + n_slots * ring_rows
    int32_t key_stride; // W + index_topk
    int32_t score_stride;
    dev_src *src;       // owned [n_layer]: by layer (only kv sources used)
    int32_t *n_past;    // owned [n_slots] host
    int32_t *rb_lo;     // owned [n_slots] host: the slot's last start (a rollback goes no lower)
    int32_t *hw;        // owned [n_slots] host: the highest position fed since that start
    int32_t *hist;      // owned [n_slots, n_ctx] host: compressed ids (Engram look-back); NULL
                        // on a stage without Engram layers
    uint8_t *used;      // owned [n_slots] scratch of the checks
    int32_t *blk_owner; // owned [n_eblocks] scratch of the checks
    // Backend memory (tracked).
    void **blocks;
    int32_t n_mem, cap_mem;
    int64_t n_bytes; // backend bytes allocated (st_alloc) and the host staging
    // Window rows as Q8 codes (win_bytes each): per layer of the stage its layer_rows rows (this
    // call's rows, then every slot's W ring rows).
    uint8_t *win;
    int64_t win_bytes, ent_bytes, key_bytes; // packed row bytes: Q8 of Dh, Q4e of Dh, Q4 of DI
    float *kvw; // [max_rows, Dh]: the call's window rows before packing (kept until the rings)
    float *x, *a, *out, *mix, *pre, *pre_attn, *post, *comb, *one_hot;
    float *qr, *q, *o, *u, *cc, *cz, *lat, *ik, *iq, *iw, *scores, *aq;
    float *blk; // [max_rows, score_stride / candidate_block_size + 1]: index_cand's block scores
    float *eg_in, *eg_kv, *hx, *hpre, *h, *logits;
    int32_t *sel, *cand, *n_cand;
    int32_t *stage_dev; // backend staging (the call's lists)
    // The greedy picks of a head chunk's logit rows (argmax_rows; greedy rows and DSpark drafts
    // cross as one id each): backend [HR] and host (host_alloc) [HR], HR = min(max_rows, 64).
    int32_t *pick, *pick_h;
    int32_t *stage;    // host staging (backend host_alloc)
    size_t stage_cap;  // int32 words of both
    int64_t aq_floats; // of aq
    // Graphs: one per decode size 1..min(n_slots, HEAD_CHUNK).
    dev_graph *graphs; // owned [N_GRAPHS]
    bool graphs_on;
    di_dsv41_dev_graph_stats stats;
    // DSpark (di_dsv41_dev_dspark_enable; off and NULL before): the taps of the call's rows
    // [max_rows, n_target, D] (stages with taps_here), an identity row list [max_rows], the
    // streams' mean weights [max_rows, NC] (1 / NC), and on the last stage the DSpark blocks'
    // window rows as Q8 codes (dwin: per block a region of layer_rows rows of win_bytes, as a
    // layer's: [max_rows call rows | slot 0's ring_rows | ...]),
    // the Markov head's scratch ([HEAD_CHUNK, V] Markov logits, [HEAD_CHUNK, R] embeddings, ones)
    // and host buffers (backend host_alloc) for a draft call's downloads and uploads.
    bool dspark;
    float *taps, *inv_nc, *mk, *me, *ones;
    uint8_t *dwin;
    int32_t *iota;
    float *me_h, *h_h; // host [HEAD_CHUNK, R], [max_rows, D]
    float *ci_h;       // owned [D + R]: the confidence head's input
};

// A state over the stages: one part per stage and the hand-over's host buffer.
struct di_dsv41_dev_state {
    di_dsv41_dev *d; // borrowed
    int32_t n_stages;
    stage_state *ss[DI_DSV41_DEV_MAX_STAGES]; // owned, one per stage
    // The host bounce of hand-overs between stages that cannot peer (di_backend_can_peer; NULL
    // with one stage or when every pair can), host_alloc of stage 0's backend: the streams and pre
    // [max_rows, NC * D + NC] floats, then the other hand-overs' regions at these byte offsets: per
    // handed kv source its rows (max_rows * (Dh + DI) floats), the top-k [max_rows, index_topk],
    // the candidate pool [max_rows, ntb] and its counts [max_rows] (int32).
    float *xh;
    size_t xh_bytes; // of xh
    size_t h_src[DI_MAX_LAYERS], h_sel, h_cand, h_ncand;
    di_dsv41_dev_graph_stats stats; // the last call's, summed over the stages
    float *th; // DSpark with stages: host_alloc of stage 0's backend [max_rows, n_target, D], the
               // taps handed over (NULL otherwise)
};

static di_status st_alloc(stage_state *s, size_t bytes, void **out) {
    di_backend *b = s->d->b;
    if (s->n_mem == s->cap_mem) {
        int32_t cap = s->cap_mem ? 2 * s->cap_mem : 64;
        void **q = di_realloc(s->blocks, sizeof(void *) * (size_t)cap);
        if (!q) return DI_ERR_NOMEM;
        s->blocks = q;
        s->cap_mem = cap;
    }
    void *p = NULL;
    di_status st = b->vt->alloc(b, bytes ? bytes : 1, &p);
    if (st != DI_OK) return st;
    s->blocks[s->n_mem++] = p;
    s->n_bytes += (int64_t)(bytes ? bytes : 1);
    *out = p;
    return DI_OK;
}

static di_status st_floats(stage_state *s, int64_t n, float **out) {
    void *p = NULL;
    di_status st = st_alloc(s, sizeof(float) * (size_t)(n > 0 ? n : 1), &p);
    if (st == DI_OK) *out = p;
    return st;
}

static di_status st_ints(stage_state *s, int64_t n, int32_t **out) {
    void *p = NULL;
    di_status st = st_alloc(s, sizeof(int32_t) * (size_t)(n > 0 ? n : 1), &p);
    if (st == DI_OK) *out = p;
    return st;
}

static void part_destroy(stage_state *s) {
    if (!s) return;
    di_backend *b = s->d->b;
    if (s->graphs)
        for (int i = 0; i < N_GRAPHS; i++) b->vt->graph_destroy(b, s->graphs[i].g);
    for (int32_t i = 0; i < s->n_mem; i++) b->vt->free(b, s->blocks[i]);
    if (s->stage) b->vt->host_free(b, s->stage);
    if (s->pick_h) b->vt->host_free(b, s->pick_h);
    if (s->me_h) b->vt->host_free(b, s->me_h);
    if (s->h_h) b->vt->host_free(b, s->h_h);
    di_free(s->ci_h);
    di_free(s->blocks);
    di_free(s->graphs);
    di_free(s->src);
    di_free(s->n_past);
    di_free(s->rb_lo);
    di_free(s->hw);
    di_free(s->hist);
    di_free(s->used);
    di_free(s->blk_owner);
    di_free(s);
}

// Int32 words of n gathered rows of Engram table t: its data rows, then (a scaled kind) its
// scale rows, each region rounded up to whole words.
static int64_t eg_words(const di_tensor *t, int64_t n) {
    return (n * (int64_t)t->nb1 + 3) / 4 + (t->scale ? (n * (int64_t)t->scale_nb1 + 3) / 4 : 0);
}

// Int32 words of the staging of a call of up to R rows over up to S sequences (the layout of
// stage_layout, at its largest).
static size_t stage_words(const stage_state *s, int64_t R, int64_t S) {
    const di_hparams *hp = &s->d->m->hp;
    int64_t n = 8 * R + R * s->key_stride + S * s->max_blocks + (int64_t)hp->n_layer * R;
    for (int il = 0; il < hp->n_layer; il++)
        if (keeps(s->d, il)) n += 7 * R;
    const int64_t n_col = s->d->m->v41->hash.n_col;
    for (int L = 0; L < hp->n_engram; L++)
        if (here(s->d, hp->engram_layer[L]))
            n += R * n_col + 2 + eg_words(s->d->eg_tables[L], R * n_col);
    return (size_t)n + 64;
}

// Stage d's part of a state (di_dsv41_dev_state_create's arguments, block_tokens resolved).
static di_status part_create(dev_stage *d, int32_t n_slots, int32_t n_ctx, int32_t max_rows,
                             int32_t n_blocks, int32_t block_tokens, stage_state **out) {
    const di_model *m = d->m;
    const di_hparams *hp = &m->hp;
    const int64_t D = hp->n_embd, nc = hp->hc_mult, Dh = hp->head_dim, H = hp->n_head;
    const int64_t DI = hp->index_head_dim, HI = hp->n_index_head, W = hp->window;
    bool ok = n_slots >= 1 && n_ctx >= 1 && max_rows >= 1 && n_blocks >= 0 && block_tokens >= 1;
    for (int il = 0; ok && il < hp->n_layer; il++)
        if (hp->compress_ratio[il] > 0 && block_tokens % hp->compress_ratio[il] != 0) ok = false;
    const int32_t max_blocks = ok ? (n_ctx + block_tokens - 1) / block_tokens : 0;
    const int64_t n_eb = n_blocks > 0 ? n_blocks : (int64_t)n_slots * max_blocks;
    const int64_t layer_rows = (int64_t)max_rows + (int64_t)n_slots * ring_rows(hp);
    const int64_t win_rows = (int64_t)(d->l1 - d->l0) * layer_rows;
    int64_t max_ent = 0; // entry rows of the widest source (its own or a mirror)
    for (int il = 0; ok && il < hp->n_layer; il++)
        if (keeps(d, il) && n_eb * (block_tokens / hp->compress_ratio[il]) > max_ent)
            max_ent = n_eb * (block_tokens / hp->compress_ratio[il]);
    if (!ok || win_rows > INT32_MAX || max_ent > INT32_MAX || n_eb > INT32_MAX) {
        DI_LOG_ERROR("dev forward (V4.1): bad state (%d slots, n_ctx %d, %d rows, %d blocks of "
                     "%d positions)",
                     n_slots, n_ctx, max_rows, n_blocks, block_tokens);
        return DI_ERR_INVALID;
    }
    stage_state *s = di_calloc(1, sizeof *s);
    if (!s) return DI_ERR_NOMEM;
    s->d = d;
    s->n_slots = n_slots;
    s->n_ctx = n_ctx;
    s->max_rows = max_rows;
    s->block_tokens = block_tokens;
    s->max_blocks = max_blocks;
    s->n_eblocks = (int32_t)n_eb;
    s->shared = n_blocks > 0;
    s->layer_rows = layer_rows;
    s->key_stride = (int32_t)W + hp->index_topk;
    di_status st = DI_OK;
    s->src = di_calloc((size_t)hp->n_layer, sizeof *s->src);
    s->n_past = di_calloc((size_t)n_slots, sizeof *s->n_past);
    s->rb_lo = di_calloc((size_t)n_slots, sizeof *s->rb_lo);
    s->hw = di_calloc((size_t)n_slots, sizeof *s->hw);
    if (d->n_eg > 0) s->hist = di_calloc((size_t)n_slots * (size_t)n_ctx, sizeof *s->hist);
    s->used = di_calloc((size_t)n_slots, 1);
    s->blk_owner = di_calloc((size_t)n_eb, sizeof *s->blk_owner);
    s->graphs = di_calloc(N_GRAPHS, sizeof *s->graphs);
    if (!s->src || !s->n_past || !s->rb_lo || !s->hw || (d->n_eg > 0 && !s->hist) || !s->used ||
        !s->blk_owner || !s->graphs) {
        st = DI_ERR_NOMEM;
        goto fail;
    }
    const char *env = getenv("DI_DEV_GRAPHS");
    s->graphs_on = !(env && strcmp(env, "0") == 0);
    const int64_t R = max_rows;
    s->win_bytes = di_backend_code_row_bytes(8, Dh, DI_BACKEND_WIN_BLOCK);
    s->ent_bytes = di_backend_code_row_bytes(DI_BACKEND_Q4E, Dh, DI_BACKEND_ENT_BLOCK);
    s->key_bytes = di_backend_code_row_bytes(4, DI, DI_BACKEND_KEY_BLOCK);
    // Rings start as zero bytes: Q8 rows of +0 (code 0 times 2^-127), never read before written.
    DI_TRY(st_alloc(s, (size_t)(win_rows * s->win_bytes), (void **)&s->win));
    DI_TRY(d->b->vt->memset(d->b, s->win, 0, (size_t)(win_rows * s->win_bytes)));
    DI_TRY(st_floats(s, R * Dh, &s->kvw));
    int32_t max_vis = 1;
    for (int il = 0; il < hp->n_layer; il++) {
        if (!keeps(d, il)) continue;
        dev_src *k = &s->src[il];
        k->il = il;
        k->m = hp->compress_ratio[il];
        k->per_page = block_tokens / k->m;
        k->cap_vis = n_ctx / k->m;
        if (k->cap_vis > max_vis) max_vis = k->cap_vis;
        const int64_t n_ent = n_eb * k->per_page;
        DI_TRY(st_alloc(s, (size_t)(n_ent * s->ent_bytes), (void **)&k->ent));
        DI_TRY(st_alloc(s, (size_t)(n_ent * s->key_bytes), (void **)&k->ikeys));
        // Zero bytes (a block's bytes, di_dsv41_dev_state_read_block, are then a function of
        // what the calls wrote; zero codes decode to finite zeros).
        DI_TRY(d->b->vt->memset(d->b, k->ent, 0, (size_t)(n_ent * s->ent_bytes)));
        DI_TRY(d->b->vt->memset(d->b, k->ikeys, 0, (size_t)(n_ent * s->key_bytes)));
        if (k->m == 2 && here(d, il)) { // a mirror holds no rings: the owner compresses
            DI_TRY(st_floats(s, (int64_t)n_slots * CZ_ROWS * Dh, &k->ring_c));
            DI_TRY(st_floats(s, (int64_t)n_slots * CZ_ROWS * Dh, &k->ring_z));
        }
        if (d->layers[il].mirror || d->layers[il].handed)
            DI_TRY(st_floats(s, R * (Dh + DI), &k->xfer));
    }
    s->score_stride = max_vis;
    const int64_t n_mix = (2 + nc) * nc, n_col = m->v41->hash.n_col;
    const int64_t n_egin = n_col * hp->engram_head_dim, n_egkv = (nc + 1) * D;
    int64_t widest = D > Dh ? D : Dh;
    if (hp->q_lora_rank > widest) widest = hp->q_lora_rank;
    if (H * Dh > widest) widest = H * Dh;
    if ((int64_t)hp->o_groups * hp->o_lora_rank > widest)
        widest = (int64_t)hp->o_groups * hp->o_lora_rank;
    if (hp->n_engram > 0 && n_egin > widest) widest = n_egin;
    s->aq_floats = R * widest;
    DI_TRY(st_floats(s, R * nc * D, &s->x));
    DI_TRY(st_floats(s, R * D, &s->a));
    DI_TRY(st_floats(s, R * D, &s->out));
    DI_TRY(st_floats(s, R * n_mix, &s->mix));
    DI_TRY(st_floats(s, R * nc, &s->pre));
    DI_TRY(st_floats(s, R * nc, &s->pre_attn));
    DI_TRY(st_floats(s, R * nc, &s->post));
    DI_TRY(st_floats(s, R * nc * nc, &s->comb));
    DI_TRY(st_floats(s, R * nc, &s->one_hot));
    DI_TRY(st_floats(s, R * hp->q_lora_rank, &s->qr));
    DI_TRY(st_floats(s, R * H * Dh, &s->q));
    DI_TRY(st_floats(s, R * H * Dh, &s->o));
    DI_TRY(st_floats(s, R * hp->o_groups * hp->o_lora_rank, &s->u));
    DI_TRY(st_floats(s, R * Dh, &s->cc));
    DI_TRY(st_floats(s, R * Dh, &s->cz));
    DI_TRY(st_floats(s, R * Dh, &s->lat));
    DI_TRY(st_floats(s, R * DI, &s->ik));
    DI_TRY(st_floats(s, R * HI * DI, &s->iq));
    DI_TRY(st_floats(s, R * HI, &s->iw));
    DI_TRY(st_floats(s, R * s->score_stride, &s->scores));
    DI_TRY(st_floats(
        s,
        R * (s->score_stride / (hp->candidate_block_size > 0 ? hp->candidate_block_size : 1) + 1),
        &s->blk));
    DI_TRY(st_floats(s, s->aq_floats, &s->aq));
    DI_TRY(st_ints(s, R * hp->index_topk, &s->sel));
    DI_TRY(
        st_ints(s, R * (hp->candidate_topk_blocks > 0 ? hp->candidate_topk_blocks : 1), &s->cand));
    DI_TRY(st_ints(s, R, &s->n_cand));
    if (hp->n_engram > 0) {
        DI_TRY(st_floats(s, R * n_egin, &s->eg_in));
        DI_TRY(st_floats(s, R * n_egkv, &s->eg_kv));
    }
    const int64_t HR = R < HEAD_CHUNK ? R : HEAD_CHUNK;
    DI_TRY(st_floats(s, HR * nc * D, &s->hx));
    DI_TRY(st_floats(s, HR * nc, &s->hpre));
    DI_TRY(st_floats(s, HR * D, &s->h));
    DI_TRY(st_floats(s, HR * hp->n_vocab, &s->logits));
    DI_TRY(st_ints(s, HR, &s->pick));
    DI_TRY(d->b->vt->host_alloc(d->b, sizeof(int32_t) * (size_t)HR, (void **)&s->pick_h));
    s->n_bytes += (int64_t)(sizeof(int32_t) * (size_t)HR);
    s->stage_cap = stage_words(s, R, n_slots < R ? n_slots : R);
    DI_TRY(st_ints(s, (int64_t)s->stage_cap, &s->stage_dev));
    DI_TRY(d->b->vt->host_alloc(d->b, sizeof(int32_t) * s->stage_cap, (void **)&s->stage));
    s->n_bytes += (int64_t)(sizeof(int32_t) * s->stage_cap);
    {
        // pre = one-hot(stream 0) at the start of every call: a constant copied in.
        float *oh = di_calloc((size_t)(R * nc), sizeof(float));
        if (!oh) {
            st = DI_ERR_NOMEM;
            goto fail;
        }
        for (int64_t t = 0; t < R; t++) oh[t * nc] = 1.0f;
        st = d->b->vt->upload(d->b, s->one_hot, oh, sizeof(float) * (size_t)(R * nc));
        di_free(oh);
        if (st != DI_OK) goto fail;
    }
    *out = s;
    return DI_OK;
fail:
    part_destroy(s);
    return st;
}

// Packed row bytes of a window row (Q8 of Dh), an entry (Q4e of Dh) and an index key (Q4 of DI).
static int64_t win_row_bytes(const di_hparams *hp) {
    return di_backend_code_row_bytes(8, hp->head_dim, DI_BACKEND_WIN_BLOCK);
}

// Backend bytes of kv source il's part of one entry block: its E entries and E index keys, packed
// (no padding: rows of the same source follow each other across blocks).
static int64_t src_block_bytes(const di_hparams *hp, int il, int32_t block_tokens) {
    const int64_t E = block_tokens / hp->compress_ratio[il];
    return E * (di_backend_code_row_bytes(DI_BACKEND_Q4E, hp->head_dim, DI_BACKEND_ENT_BLOCK) +
                di_backend_code_row_bytes(4, hp->index_head_dim, DI_BACKEND_KEY_BLOCK));
}

di_status di_dsv41_dev_sizes(const di_dsv41_dev *d, int32_t block_tokens, int64_t *block_bytes,
                             int64_t *slot_bytes) {
    const di_hparams *hp = &d->m->hp; // every stage's layers: the sums over the stages
    bool ok = block_tokens >= 1;
    int64_t slot = (int64_t)hp->n_layer * ring_rows(hp) * win_row_bytes(hp);
    for (int il = 0; ok && il < hp->n_layer; il++) {
        const int32_t m = hp->compress_ratio[il];
        if (m > 0 && block_tokens % m != 0) ok = false;
        if (ok && hp->kv_source[il] && m == 2) // C and Z rings of CZ_ROWS FP32 rows
            slot += 2 * CZ_ROWS * (int64_t)hp->head_dim * (int64_t)sizeof(float);
    }
    if (!ok) {
        DI_LOG_ERROR("dev forward (V4.1): blocks of %d positions (a multiple of every ratio)",
                     block_tokens);
        return DI_ERR_INVALID;
    }
    *block_bytes = (int64_t)di_dsv41_page_bytes(d->m, block_tokens);
    *slot_bytes = slot;
    return DI_OK;
}

di_status di_dsv41_dev_block_mem_bytes(const di_dsv41_dev *d, int32_t block_tokens,
                                       int64_t *mem_bytes, int64_t *stage_bytes) {
    const di_hparams *hp = &d->m->hp;
    int64_t blk = 0, slot = 0;
    di_status st = di_dsv41_dev_sizes(d, block_tokens, &blk, &slot);
    if (st != DI_OK) return st;
    int64_t all = 0;
    for (int32_t k = 0; k < d->n_stages; k++) {
        int64_t n = 0;
        for (int il = 0; il < hp->n_layer; il++)
            if (keeps(d->st[k], il)) n += src_block_bytes(hp, il, block_tokens);
        if (stage_bytes) stage_bytes[k] = n;
        all += n;
    }
    *mem_bytes = all;
    return DI_OK;
}

// Copies stage s's part of block `block` between the state and host bytes in the CPU forward's
// page layout (di_dsv41_page_bytes; each kv source's entries and index keys at
// di_dsv41_page_offsets): its own sources' into dst (read), or, when dst is NULL, from src into its
// own sources and its mirrors (write: every copy of a block holds its bytes).
static di_status block_io(const stage_state *s, int32_t block, uint8_t *dst, const uint8_t *src) {
    const di_hparams *hp = &s->d->m->hp;
    di_backend *b = s->d->b;
    if (block < 0 || block >= s->n_eblocks) {
        DI_LOG_ERROR("dev forward (V4.1): no entry block %d (the state has %d)", block,
                     s->n_eblocks);
        return DI_ERR_INVALID;
    }
    for (int il = 0; il < hp->n_layer; il++) {
        if (!keeps(s->d, il) || (dst && !here(s->d, il))) continue; // read: from the owner
        const dev_src *k = &s->src[il];
        const int64_t E = k->per_page;
        uint8_t *ent = k->ent + (int64_t)block * E * s->ent_bytes;
        uint8_t *key = k->ikeys + (int64_t)block * E * s->key_bytes;
        const size_t ne = (size_t)(E * s->ent_bytes), nk = (size_t)(E * s->key_bytes);
        int64_t om = 0, oi = 0;
        di_dsv41_page_offsets(s->d->m, s->block_tokens, il, &om, &oi);
        di_status st =
            dst ? b->vt->download(b, dst + om, ent, ne) : b->vt->upload(b, ent, src + om, ne);
        if (st == DI_OK)
            st = dst ? b->vt->download(b, dst + oi, key, nk) : b->vt->upload(b, key, src + oi, nk);
        if (st != DI_OK) return st;
    }
    return DI_OK;
}

// Rings in a snapshot: every layer's, then every DSpark block's of the dev (dsv41_dev.h).
static int32_t tail_rings(const di_dsv41_dev *d) {
    return d->m->hp.n_layer + d->m->n_mtp_loaded; // the last stage uploads every DSpark block
}

size_t di_dsv41_dev_tail_bytes(const di_dsv41_dev *d) {
    const di_hparams *hp = &d->m->hp;
    return 16 + (size_t)tail_rings(d) * (size_t)hp->window * (size_t)win_row_bytes(hp);
}

// Whether pos is a multiple of every compress ratio (no ratio-2 group open).
static bool tail_pos_ok(const di_hparams *hp, int32_t pos) {
    for (int il = 0; il < hp->n_layer; il++)
        if (hp->compress_ratio[il] > 0 && pos % hp->compress_ratio[il] != 0) return false;
    return true;
}

// The slot's window ring of layer il (W Q8 rows).
static uint8_t *ring_of(const stage_state *s, int il, int32_t slot) {
    const di_hparams *hp = &s->d->m->hp;
    return s->win + ((int64_t)(il - s->d->l0) * s->layer_rows + s->max_rows +
                     (int64_t)slot * ring_rows(hp)) *
                        s->win_bytes;
}

// The window rows of positions [pos - W, pos) of slot `slot`'s ring (Q8 rows of win_bytes; row p
// mod ring_rows) to or from a snapshot's W rows of that ring (row p mod W): downloaded into dst,
// or uploaded from src, in runs of rows consecutive on both sides. Saving, the rows of positions
// below 0 are zero bytes (Q8 rows of +0; no position has them; a restore skips them).
static di_status tail_rows(stage_state *s, uint8_t *ring, int32_t pos, uint8_t *dst,
                           const uint8_t *src) {
    const di_hparams *hp = &s->d->m->hp;
    di_backend *b = s->d->b;
    const int64_t W = hp->window, RW = ring_rows(hp);
    const size_t row = (size_t)s->win_bytes;
    int64_t p = pos - W > 0 ? pos - W : 0;
    if (dst && pos < W) memset(dst + (size_t)pos * row, 0, (size_t)(W - pos) * row);
    while (p < pos) {
        int64_t n = 1;
        while (p + n < pos && (p + n) % RW != 0 && (p + n) % W != 0) n++;
        uint8_t *dr = dst ? dst + (size_t)(p % W) * row : NULL;
        uint8_t *rr = ring + (size_t)(p % RW) * row;
        di_status st = dst ? b->vt->download(b, dr, rr, (size_t)n * row)
                           : b->vt->upload(b, rr, src + (size_t)(p % W) * row, (size_t)n * row);
        if (st != DI_OK) return st;
        p += n;
    }
    return DI_OK;
}

// DSpark block i's region of Q8 rows (as a layer's: the call's rows, then every slot's ring_rows).
static uint8_t *ds_region(const stage_state *s, int i) {
    return s->dwin + (int64_t)i * s->layer_rows * s->win_bytes;
}

// Slot `slot`'s ring of DSpark block i (last stage, DSpark on).
static uint8_t *ds_ring_of(const stage_state *s, int i, int32_t slot) {
    const di_hparams *hp = &s->d->m->hp;
    return ds_region(s, i) + (s->max_rows + (int64_t)slot * ring_rows(hp)) * s->win_bytes;
}

// Stage s's rings of slot `slot`'s snapshot (the header written too: the same on every stage)
// into dst (di_dsv41_dev_tail_bytes: every stage writes its layers' rings at their offsets).
static di_status part_tail_save(stage_state *s, int32_t slot, void *dst) {
    const di_hparams *hp = &s->d->m->hp;
    if (slot < 0 || slot >= s->n_slots || s->n_past[slot] < 0 ||
        !tail_pos_ok(hp, s->n_past[slot])) {
        DI_LOG_ERROR("dev forward (V4.1): no tail snapshot of slot %d (at %d: a multiple of every "
                     "ratio)",
                     slot, slot >= 0 && slot < s->n_slots ? s->n_past[slot] : -1);
        return DI_ERR_INVALID;
    }
    const dev_stage *d = s->d;
    const int32_t head[4] = {s->n_past[slot], hp->n_layer + d->m->n_mtp_loaded, hp->window,
                             hp->head_dim};
    memcpy(dst, head, sizeof head);
    const size_t ring = (size_t)hp->window * (size_t)s->win_bytes;
    uint8_t *out = (uint8_t *)dst + sizeof head + (size_t)s->d->l0 * ring;
    for (int il = s->d->l0; il < s->d->l1; il++, out += ring) {
        di_status st = tail_rows(s, ring_of(s, il, slot), s->n_past[slot], out, NULL);
        if (st != DI_OK) return st;
    }
    // The DSpark blocks' rings after the layers' (zero rows in a state without DSpark).
    for (int i = 0; d->last && i < d->n_ds; i++, out += ring) {
        if (!s->dspark) {
            memset(out, 0, ring);
            continue;
        }
        di_status st = tail_rows(s, ds_ring_of(s, i, slot), s->n_past[slot], out, NULL);
        if (st != DI_OK) return st;
    }
    return DI_OK;
}

di_status di_dsv41_dev_tail_check(const di_dsv41_dev *d, int32_t pos, const void *src) {
    const di_hparams *hp = &d->m->hp;
    int32_t head[4];
    memcpy(head, src, sizeof head);
    return tail_pos_ok(hp, pos) && head[0] == pos && head[1] == tail_rings(d) &&
                   head[2] == hp->window && head[3] == hp->head_dim
               ? DI_OK
               : DI_ERR_INVALID;
}

// Stage s's part of a tail restore (the checks repeated on every stage: the first refuses before
// anything changes).
static di_status part_tail_restore(stage_state *s, int32_t slot, int32_t pos, const void *src,
                                   const int32_t *tokens) {
    const dev_stage *d = s->d;
    const di_hparams *hp = &d->m->hp;
    int32_t head[4];
    memcpy(head, src, sizeof head);
    const bool ok = slot >= 0 && slot < s->n_slots && pos >= 0 && pos <= s->n_ctx &&
                    tail_pos_ok(hp, pos) && head[0] == pos &&
                    head[1] == hp->n_layer + d->m->n_mtp_loaded && head[2] == hp->window &&
                    head[3] == hp->head_dim && (pos == 0 || hp->n_engram == 0 || tokens);
    if (ok)
        for (int32_t p = 0; p < pos && hp->n_engram > 0; p++)
            if (tokens[p] < 0 || tokens[p] >= hp->n_vocab) {
                DI_LOG_ERROR("dev forward (V4.1): tail restore: token %d at %d", tokens[p], p);
                return DI_ERR_INVALID;
            }
    if (!ok) {
        DI_LOG_ERROR("dev forward (V4.1): tail restore into slot %d at %d: not a snapshot of this "
                     "model there",
                     slot, pos);
        return DI_ERR_INVALID;
    }
    s->n_past[slot] = -1; // until the copies are enqueued
    const size_t ring = (size_t)hp->window * (size_t)s->win_bytes;
    const uint8_t *in = (const uint8_t *)src + sizeof head + (size_t)d->l0 * ring;
    for (int il = d->l0; il < d->l1; il++, in += ring) {
        di_status st = tail_rows(s, ring_of(s, il, slot), pos, NULL, in);
        if (st != DI_OK) return st;
    }
    for (int i = 0; d->last && s->dspark && i < d->n_ds; i++, in += ring) {
        di_status st = tail_rows(s, ds_ring_of(s, i, slot), pos, NULL, in);
        if (st != DI_OK) return st;
    }
    for (int32_t p = 0; p < pos && d->n_eg > 0; p++)
        s->hist[(int64_t)slot * s->n_ctx + p] = d->m->v41->cmap[tokens[p]];
    s->n_past[slot] = pos;
    s->rb_lo[slot] = s->hw[slot] =
        pos; // the ring rows before the snapshot's window are not restored
    return DI_OK;
}

// ---- per-call metadata ----

// The call: its sequences and rows, and where its lists are in the staging (offsets in int32
// words, the same on the host and the backend; functions of the call's shape only).
typedef struct src_meta {
    int32_t n_pool; // groups the shape can close (padded; m = 1: every row)
    int64_t n_vis, epos, edst, esrc, rdst, rsrc; // offsets
    int32_t n_rd;                                // ring rows written (m = 2)
} src_meta;

typedef struct call {
    stage_state *s;
    const di_dsv41_dev_seq *seqs;
    int32_t n_seq, T;
    int64_t tokens, pos, nk_win, nk_all, nwin, page_off, keys, win_dst, win_src, pages;
    int32_t n_wd;                 // window ring rows written
    int64_t ebase[DI_MAX_LAYERS]; // per compressing layer: each row's entry base (0)
    // Per Engram module: the T * n_col rows gathered from its host table (data rows, then scale
    // rows: the table's layout with one scale row per row) and their ids in that gather (0..).
    int64_t eg_ids[DI_MAX_ENGRAM], eg_data[DI_MAX_ENGRAM], eg_scale[DI_MAX_ENGRAM];
    src_meta sm[DI_MAX_LAYERS];
    size_t n_words;
} call;

// The staging offsets of a call (every size a function of T, n_seq and the sequences' n_tok).
static void stage_layout(call *c) {
    const stage_state *s = c->s;
    const di_hparams *hp = &s->d->m->hp;
    const int64_t T = c->T, RW = ring_rows(hp);
    size_t o = 0;
#define TAKE(field, n)                                                                             \
    do {                                                                                           \
        c->field = (int64_t)o;                                                                     \
        o += (size_t)(n);                                                                          \
    } while (0)
    TAKE(tokens, T);
    TAKE(pos, T);
    TAKE(nk_win, T);
    TAKE(nk_all, T);
    TAKE(nwin, T);
    TAKE(page_off, T);
    TAKE(keys, T * s->key_stride);
    c->n_wd = 0;
    for (int32_t i = 0; i < c->n_seq; i++)
        c->n_wd += c->seqs[i].n_tok < RW ? c->seqs[i].n_tok : (int32_t)RW;
    TAKE(win_dst, c->n_wd);
    TAKE(win_src, c->n_wd);
    TAKE(pages, (int64_t)c->n_seq * s->max_blocks);
    for (int il = s->d->l0; il < s->d->l1; il++) // the stage's layers only
        if (hp->compress_ratio[il] > 0) TAKE(ebase[il], T);
    for (int il = 0; il < hp->n_layer; il++) { // the kv sources it keeps: its own, its mirrors
        if (!keeps(s->d, il)) continue;
        src_meta *k = &c->sm[il];
        const int32_t mm = hp->compress_ratio[il];
        k->n_pool = 0;
        k->n_rd = 0;
        for (int32_t i = 0; i < c->n_seq; i++) {
            k->n_pool += (c->seqs[i].n_tok + mm - 1) / mm;
            k->n_rd += c->seqs[i].n_tok < CZ_ROWS ? c->seqs[i].n_tok : CZ_ROWS;
        }
        TAKE(sm[il].n_vis, T);
        TAKE(sm[il].epos, k->n_pool);
        TAKE(sm[il].edst, k->n_pool);
        if (mm == 2 && here(s->d, il)) { // the compressor's lists: the owner's only
            TAKE(sm[il].esrc, 2 * (int64_t)k->n_pool);
            TAKE(sm[il].rdst, k->n_rd);
            TAKE(sm[il].rsrc, k->n_rd);
        }
    }
    const int64_t n_col = s->d->m->v41->hash.n_col;
    for (int L = 0; L < hp->n_engram; L++) {
        if (!here(s->d, hp->engram_layer[L])) continue; // gathered by the stage holding it
        const di_tensor *et = s->d->eg_tables[L];
        TAKE(eg_ids[L], T * n_col);
        TAKE(eg_data[L], (T * n_col * (int64_t)et->nb1 + 3) / 4);
        if (et->scale) TAKE(eg_scale[L], (T * n_col * (int64_t)et->scale_nb1 + 3) / 4);
    }
#undef TAKE
    c->n_words = o;
}

// Entry block of position-block j of sequence i.
static int32_t block_of(const call *c, int32_t i, int64_t j) {
    const di_dsv41_dev_seq *sq = &c->seqs[i];
    return c->s->shared ? sq->blocks[j] : sq->slot * c->s->max_blocks + (int32_t)j;
}

// Fills the host staging of the call (layout done) and advances the slots' Engram histories.
static void stage_fill(call *c, const int32_t *tokens) {
    stage_state *s = c->s;
    const di_model *m = s->d->m;
    const di_hparams *hp = &m->hp;
    const int64_t W = hp->window, RW = ring_rows(hp), bt = s->block_tokens;
    int32_t *g = s->stage;
    int32_t r = 0, wd = 0;
    for (int32_t i = 0; i < c->n_seq; i++) {
        const di_dsv41_dev_seq *sq = &c->seqs[i];
        const int64_t p0 = sq->pos, ring0 = (int64_t)s->max_rows + (int64_t)sq->slot * RW;
        const int32_t r0 = r;
        for (int64_t j = 0; j < s->max_blocks; j++)
            g[c->pages + (int64_t)i * s->max_blocks + j] =
                j < (p0 + sq->n_tok + bt - 1) / bt ? block_of(c, i, j) : -1;
        for (int32_t t = 0; t < sq->n_tok; t++, r++) {
            const int64_t P = p0 + t;
            g[c->tokens + r] = tokens[r];
            g[c->pos + r] = (int32_t)P;
            const int64_t w_lo = P - W + 1 > 0 ? P - W + 1 : 0;
            const int32_t n_win = (int32_t)(P - w_lo + 1);
            g[c->nk_win + r] = n_win;
            g[c->nk_all + r] = n_win + hp->index_topk;
            g[c->nwin + r] = n_win;
            g[c->page_off + r] = i * s->max_blocks;
            int32_t *kl = g + c->keys + (int64_t)r * s->key_stride;
            for (int64_t q = w_lo; q <= P; q++)
                kl[q - w_lo] = q < p0 ? (int32_t)(ring0 + q % RW) : (int32_t)(r0 + q - p0);
        }
        for (int32_t t = sq->n_tok > RW ? sq->n_tok - (int32_t)RW : 0; t < sq->n_tok; t++, wd++) {
            g[c->win_dst + wd] = (int32_t)(ring0 + (p0 + t) % RW);
            g[c->win_src + wd] = r0 + t;
        }
        // Engram: the slot's compressed ids (a replay's start: of its prefix too; kept on every
        // stage with Engram layers), then the row ids of every module on this stage.
        if (s->d->n_eg == 0) continue;
        int32_t *hist = s->hist + (int64_t)sq->slot * s->n_ctx;
        if (sq->win_lo > 0 && p0 == sq->win_lo)
            for (int64_t p = 0; p < p0; p++) hist[p] = m->v41->cmap[sq->prefix[p]];
        for (int32_t t = 0; t < sq->n_tok; t++) hist[p0 + t] = m->v41->cmap[tokens[r0 + t]];
        const di_engram_hash *h = &m->v41->hash;
        for (int32_t t = 0; t < sq->n_tok; t++) {
            int32_t look[8];
            const int64_t P = p0 + t;
            for (int k = 0; k < h->max_ngram; k++)
                look[k] = P - k >= 0 ? hist[P - k] : DI_ENGRAM_DEAD;
            for (int L = 0; L < hp->n_engram; L++) {
                if (!here(s->d, hp->engram_layer[L])) continue;
                int64_t rows[DI_ENGRAM_MAX_COLS];
                di_engram_hash_rows(h, L, look, m->v41->pad_c, rows);
                const di_tensor *et = s->d->eg_tables[L];
                uint8_t *data = (uint8_t *)(g + c->eg_data[L]);
                uint8_t *scale = et->scale ? (uint8_t *)(g + c->eg_scale[L]) : NULL;
                for (int j = 0; j < h->n_col; j++) {
                    const int64_t k = (int64_t)(r0 + t) * h->n_col + j;
                    DI_ASSERT(rows[j] >= 0 && rows[j] < et->ne[1]);
                    g[c->eg_ids[L] + k] = (int32_t)k;
                    memcpy(data + (size_t)k * et->nb1,
                           (const uint8_t *)et->data + (size_t)rows[j] * et->nb1, et->nb1);
                    if (scale)
                        memcpy(scale + (size_t)k * et->scale_nb1,
                               et->scale +
                                   (size_t)((et->row0 + rows[j]) / et->block_out) * et->scale_nb1,
                               et->scale_nb1);
                }
            }
        }
    }
    // Compressing layers: each row's entry base, 0 (its key list names rows of the source's
    // entries, which the attention reads apart from the window rows).
    for (int il = s->d->l0; il < s->d->l1; il++) {
        if (hp->compress_ratio[il] <= 0) continue;
        DI_ASSERT(keeps(s->d, s->d->layers[il].src)); // the stage's own or a mirror
        for (int32_t t = 0; t < c->T; t++) g[c->ebase[il] + t] = 0;
    }
    // kv sources: visible entries per row; the groups closing (padded to the shape's bound).
    for (int il = 0; il < hp->n_layer; il++) {
        if (!keeps(s->d, il)) continue;
        const dev_src *k = &s->src[il];
        const src_meta *km = &c->sm[il];
        const int32_t mm = k->m;
        const bool own = here(s->d, il); // a mirror takes only n_vis, epos and edst
        int32_t n = 0, rd = 0;
        r = 0;
        for (int32_t i = 0; i < c->n_seq; i++) {
            const di_dsv41_dev_seq *sq = &c->seqs[i];
            const int64_t p0 = sq->pos;
            const int32_t r0 = r;
            int32_t n_i = 0;
            for (int32_t t = 0; t < sq->n_tok; t++, r++) {
                const int64_t P = p0 + t;
                g[km->n_vis + r] = (int32_t)((P + 1) / mm);
                if ((P + 1) % mm != 0) continue;
                const int64_t w = P / mm;
                g[km->epos + n] = (int32_t)(w * mm);
                // A cached entry (a replay on another sequence's blocks) is left as it is.
                g[km->edst + n] = w < sq->n_cached / mm
                                      ? -1
                                      : block_of(c, i, w / k->per_page) * k->per_page +
                                            (int32_t)(w % k->per_page);
                if (mm == 2 && own) {
                    const int64_t q = P - 1; // the group's even position
                    g[km->esrc + 2 * n] = q >= p0
                                              ? (int32_t)(r0 + q - p0)
                                              : -(sq->slot * CZ_ROWS + (int32_t)(q % CZ_ROWS)) - 1;
                    g[km->esrc + 2 * n + 1] = r;
                }
                n++, n_i++;
            }
            for (; n_i < (sq->n_tok + mm - 1) / mm; n_i++, n++) { // padding
                g[km->epos + n] = 0;
                g[km->edst + n] = -1;
                if (mm == 2 && own)
                    g[km->esrc + 2 * n] = g[km->esrc + 2 * n + 1] = DI_BACKEND_NO_ROW;
            }
            for (int32_t t = sq->n_tok > CZ_ROWS ? sq->n_tok - CZ_ROWS : 0;
                 t < sq->n_tok && mm == 2 && own; t++, rd++) {
                g[km->rdst + rd] = sq->slot * CZ_ROWS + (int32_t)((p0 + t) % CZ_ROWS);
                g[km->rsrc + rd] = r0 + t;
            }
        }
    }
}

// ---- the layer ----

#define B (c->s->d->b)
#define D32(off) (c->s->stage_dev + (off))
// An op enqueued on the backend.
#define OP(name, ...)                                                                              \
    do {                                                                                           \
        c->s->stats.last_ops++;                                                                    \
        DI_TRY(B->vt->name(B, __VA_ARGS__));                                                       \
    } while (0)
// A rounding point of the official recipe (model/dsv4.c di_dsv4_round); nothing in FP32.
#define ROUND(x_, n_)                                                                              \
    do {                                                                                           \
        if (c->s->d->official) OP(round_bf16, (x_), (int64_t)(n_));                                \
    } while (0)

// y = W x for n rows (model/dsv4_attn.c di_dsv4_linear): official, FP8/FP4 weights with act_quant
// see A8(x) (Q8 in blocks of 32, V4.1) and the output rows (contiguous: ys == W's rows) are
// rounded to BF16.
static di_status linear(const call *c, const di_tensor *w, const float *x, int64_t n, int64_t xs,
                        float *y, int64_t ys, bool act_quant) {
    stage_state *s = c->s;
    const int64_t K = w->ne[0], N = w->ne[1];
    di_status st = DI_OK;
    if (s->d->official && act_quant &&
        (w->kind == DI_TENSOR_KIND_FP8 || w->kind == DI_TENSOR_KIND_FP4)) {
        DI_ASSERT(n * xs <= s->aq_floats);
        OP(fake_quant, x, n, K, xs, 32, 8, s->aq);
        x = s->aq;
    }
    OP(matmul, w, x, n, xs, y, ys);
    DI_ASSERT(!s->d->official || ys == N);
    ROUND(y, n * N);
    return DI_OK;
fail:
    return st;
}

// Index key (Q4) and entry (Q4e) of n finalised latents lat [n, Dh] (dsv41_attn.c finalise):
// written to the source's index keys and entry rows at edst (-1: nowhere).
static di_status finalise(const call *c, const dev_layer *lw, const dev_src *k, const src_meta *km,
                          float *lat, int32_t n) {
    stage_state *s = c->s;
    const dev_stage *d = s->d;
    const di_hparams *hp = &d->m->hp;
    const int64_t Dh = hp->head_dim, DI = hp->index_head_dim;
    const int32_t n_rot = hp->rope_main.n_dims;
    const float rs = hp->rope_compress.attention_factor;
    di_status st = DI_OK;
    DI_TRY(linear(c, &lw->idx_wk, lat, n, Dh, s->ik, DI, false));
    OP(rmsnorm, s->ik, n, DI, DI, lw->idx_k_norm, hp->norm_eps);
    ROUND(s->ik, n * DI);
    OP(rope, s->ik, n, DI, DI, n_rot, d->omega_compress, D32(km->epos), 1, rs, false);
    ROUND(s->ik, n * DI);
    // Q4 codes of the key (the fake quantisation of dsv41_attn.c finalise, packed as it rounds).
    OP(pack_rows, s->ik, n, DI, (int32_t)DI, DI_DSV41_KEY_BLOCK, 4, k->ikeys, D32(km->edst), NULL);
    OP(rope, lat, n, Dh, Dh, n_rot, d->omega_compress, D32(km->epos), 1, rs, false);
    ROUND(lat, n * Dh);
    OP(pack_rows, lat, n, Dh, (int32_t)Dh, DI_DSV41_ENT_BLOCK, DI_BACKEND_Q4E, k->ent,
       D32(km->edst), NULL);
    if (lw->handed) { // a later stage mirrors the source: the rows for its hand-over (the call's
                      // n rows at fixed offsets, so a decode graph records these copies too), the
                      // FP32 rows the codes were packed from
        OP(copy, k->xfer, lat, sizeof(float) * (size_t)(n * Dh));
        OP(copy, k->xfer + n * Dh, s->ik, sizeof(float) * (size_t)(n * DI));
    }
    return DI_OK;
fail:
    return st;
}

// The CSA2 compressor of kv source il on normed input a (dsv41_attn.c compressor).
static di_status compressor(const call *c, int il, const float *a) {
    stage_state *s = c->s;
    const dev_layer *lw = &s->d->layers[il];
    const dev_src *k = &s->src[il];
    const src_meta *km = &c->sm[il];
    const di_hparams *hp = &s->d->m->hp;
    const int64_t D = hp->n_embd, Dh = hp->head_dim;
    di_status st = DI_OK;
    if (k->m == 1) { // latent = RMSNorm(wkv a): no activation quant
        DI_TRY(linear(c, &lw->cmp_wkv, a, c->T, D, s->cc, Dh, false));
        OP(rmsnorm, s->cc, c->T, Dh, Dh, lw->cmp_norm, hp->norm_eps);
        ROUND(s->cc, c->T * Dh);
        return finalise(c, lw, k, km, s->cc, c->T);
    }
    // m = 2: C, Z in FP32; every closing group pooled from this call's rows and the ring.
    OP(matmul, &lw->cmp_wkv, a, c->T, D, s->cc, Dh);
    OP(matmul, &lw->cmp_wgate, a, c->T, D, s->cz, Dh);
    OP(compress_pool, s->cc, s->cz, Dh, k->ring_c, k->ring_z, D32(km->esrc), km->n_pool, 2, 1,
       (int32_t)Dh, s->lat);
    ROUND(s->lat, km->n_pool * Dh);
    OP(rmsnorm, s->lat, km->n_pool, Dh, Dh, lw->cmp_norm, hp->norm_eps);
    ROUND(s->lat, km->n_pool * Dh);
    DI_TRY(finalise(c, lw, k, km, s->lat, km->n_pool));
    // Every sequence's last min(n_tok, 2) rows of C and Z into its ring.
    OP(scatter_rows, s->cc, km->n_rd, Dh, Dh, k->ring_c, Dh, D32(km->rdst), D32(km->rsrc));
    OP(scatter_rows, s->cz, km->n_rd, Dh, Dh, k->ring_z, Dh, D32(km->rdst), D32(km->rsrc));
    return DI_OK;
fail:
    return st;
}

// The indexer of index source il (dsv41_attn.c indexer): scores of its kv source's keys, the
// candidate pool (level 1 on the candidate source, level 2 after it), the top-k into s->sel.
static di_status indexer(const call *c, int il, const float *a, bool *have_cand) {
    stage_state *s = c->s;
    const dev_layer *lw = &s->d->layers[il];
    const dev_src *k = &s->src[lw->src];
    const src_meta *km = &c->sm[lw->src];
    const di_hparams *hp = &s->d->m->hp;
    const int64_t D = hp->n_embd, Rq = hp->q_lora_rank, HI = hp->n_index_head;
    const int64_t DI = hp->index_head_dim, T = c->T;
    const int32_t n_rot = hp->rope_main.n_dims;
    const bool official = s->d->official;
    di_status st = DI_OK;
    DI_TRY(linear(c, &lw->idx_wq_b, s->qr, T, Rq, s->iq, HI * DI, true));
    OP(rope, s->iq, T * HI, DI, DI, n_rot, s->d->omega_compress, D32(c->pos), (int32_t)HI,
       hp->rope_compress.attention_factor, false);
    ROUND(s->iq, T * HI * DI);
    OP(fake_quant, s->iq, T * HI, DI, DI, DI_DSV41_KEY_BLOCK, 4, s->iq); // no Hadamard
    DI_TRY(linear(c, &lw->idx_weights_proj, a, T, D, s->iw, HI, false));
    OP(scale, s->iw, T * HI, 1.0f / sqrtf((float)DI) / sqrtf((float)HI));
    ROUND(s->iw, T * HI);
    OP(index_scores_q4, s->iq, s->iw, k->ikeys, NULL, D32(c->pages), D32(c->page_off), k->per_page,
       D32(km->n_vis), k->cap_vis, (int32_t)T, (int32_t)HI, (int32_t)DI, official, s->scores,
       s->score_stride);
    const int32_t bs = hp->candidate_block_size > 0 ? hp->candidate_block_size : 1;
    const int32_t ntb = hp->candidate_topk_blocks > 0 ? hp->candidate_topk_blocks : 1;
    if (il == hp->candidate_layer) {
        OP(index_cand, DI_BACKEND_CAND_BUILD, s->scores, s->score_stride, D32(km->n_vis),
           (int32_t)T, bs, ntb, s->cand, s->n_cand, NULL, hp->index_topk, s->blk);
        *have_cand = true;
    } else if (*have_cand && hp->candidate_layer >= 0 && hp->candidate_layer < il) {
        OP(index_cand, DI_BACKEND_CAND_MASK, s->scores, s->score_stride, D32(km->n_vis), (int32_t)T,
           bs, ntb, s->cand, s->n_cand, NULL, hp->index_topk, NULL);
    }
    OP(topk, s->scores, s->score_stride, D32(km->n_vis), (int32_t)T, hp->index_topk, s->sel);
    OP(index_cand, DI_BACKEND_CAND_DROP, s->scores, s->score_stride, D32(km->n_vis), (int32_t)T, bs,
       ntb, NULL, NULL, s->sel, hp->index_topk, NULL);
    return DI_OK;
fail:
    return st;
}

// The q and window rows of an attention (a layer's or a DSpark block's) from its input a: q =
// RoPE(wq_b RMSNorm(wq_a a)) (no per-head RMS in V4.1) into s->q; the window rows RoPE(RMSNorm(wkv
// a)) into s->kvw (FP32, kept for a ring update after the attention) and their Q8 codes (over all
// dims) into the call rows of win.
static di_status attn_q_kv(const call *c, const dev_layer *lw, const float *a, const float *omega,
                           float rscale, uint8_t *win) {
    stage_state *s = c->s;
    const di_hparams *hp = &s->d->m->hp;
    const int64_t D = hp->n_embd, H = hp->n_head, Dh = hp->head_dim, Rq = hp->q_lora_rank;
    const int64_t T = c->T;
    const int32_t n_rot = hp->rope_main.n_dims;
    const int32_t *pos = D32(c->pos);
    di_status st = DI_OK;
    DI_TRY(linear(c, &lw->wq_a, a, T, D, s->qr, Rq, true));
    OP(rmsnorm, s->qr, T, Rq, Rq, lw->q_norm, hp->norm_eps);
    ROUND(s->qr, T * Rq);
    DI_TRY(linear(c, &lw->wq_b, s->qr, T, Rq, s->q, H * Dh, true));
    OP(rope, s->q, T * H, Dh, Dh, n_rot, omega, pos, (int32_t)H, rscale, false);
    ROUND(s->q, T * H * Dh);
    DI_TRY(linear(c, &lw->wkv, a, T, D, s->kvw, Dh, true));
    OP(rmsnorm, s->kvw, T, Dh, Dh, lw->kv_norm, hp->norm_eps);
    ROUND(s->kvw, T * Dh);
    OP(rope, s->kvw, T, Dh, Dh, n_rot, omega, pos, 1, rscale, false);
    ROUND(s->kvw, T * Dh);
    OP(pack_rows, s->kvw, T, Dh, (int32_t)Dh, DI_DSV41_WIN_BLOCK, 8, win, NULL, NULL);
    return DI_OK;
fail:
    return st;
}

// An attention's output from s->o: the inverse RoPE, then the grouped output (V4 §2.4): u_g =
// wo_a[g] . o_g (no activation quant), out = wo_b . u.
static di_status attn_out(const call *c, const dev_layer *lw, const float *omega, float rscale,
                          float *out) {
    stage_state *s = c->s;
    const di_hparams *hp = &s->d->m->hp;
    const int64_t D = hp->n_embd, H = hp->n_head, Dh = hp->head_dim;
    const int64_t G = hp->o_groups, Ro = hp->o_lora_rank, T = c->T;
    const int32_t n_rot = hp->rope_main.n_dims;
    di_status st = DI_OK;
    ROUND(s->o, T * H * Dh);
    OP(rope, s->o, T * H, Dh, Dh, n_rot, omega, D32(c->pos), (int32_t)H, rscale, true);
    ROUND(s->o, T * H * Dh);
    const int64_t group_in = H * Dh / G;
    for (int64_t g = 0; g < G; g++) {
        di_tensor wg = di_tensor_rows(&lw->wo_a, g * Ro, Ro);
        OP(matmul, &wg, s->o + g * group_in, T, H * Dh, s->u + g * Ro, G * Ro);
    }
    ROUND(s->u, T * G * Ro);
    DI_TRY(linear(c, &lw->wo_b, s->u, T, G * Ro, out, D, true));
    return DI_OK;
fail:
    return st;
}

static di_status attention(const call *c, int il, const float *a, float *out, bool *have_topk,
                           bool *have_cand) {
    stage_state *s = c->s;
    const dev_stage *d = s->d;
    const di_hparams *hp = &d->m->hp;
    const dev_layer *lw = &d->layers[il];
    const int64_t H = hp->n_head, Dh = hp->head_dim, T = c->T;
    const bool compress = lw->ratio > 0;
    const float *omega = compress ? d->omega_compress : d->omega_main;
    const float rscale =
        compress ? hp->rope_compress.attention_factor : hp->rope_main.attention_factor;
    uint8_t *win = s->win + (int64_t)(il - d->l0) * s->layer_rows * s->win_bytes; // this layer's
    di_status st = DI_OK;
    // q, and the window rows into this call's rows of the layer's window rows.
    DI_TRY(attn_q_kv(c, lw, a, omega, rscale, win));
    if (lw->kv_source) DI_TRY(compressor(c, il, a));
    if (lw->index_source) {
        DI_TRY(indexer(c, il, a, have_cand));
        *have_topk = true;
    }
    const bool with_entries = compress && *have_topk;
    const uint8_t *ent = with_entries ? s->src[lw->src].ent : NULL;
    if (with_entries) {
        const dev_src *k = &s->src[lw->src];
        OP(offset_list, s->sel, (int32_t)T, hp->index_topk, D32(c->ebase[il]), D32(c->nwin),
           D32(c->pages), D32(c->page_off), k->per_page, D32(c->keys), s->key_stride);
    }
    // Keys j < n_win: Q8 window rows of this layer; the rest: Q4e entries of the kv source.
    OP(attn_codes, s->q, win, ent, D32(c->keys), s->key_stride, D32(c->nwin),
       D32(with_entries ? c->nk_all : c->nk_win), s->key_stride, lw->attn_sink, (int32_t)T,
       (int32_t)H, (int32_t)Dh, 1.0f / sqrtf((float)Dh), d->official, s->o);
    DI_TRY(attn_out(c, lw, omega, rscale, out));
    // Each sequence's last min(n_tok, ring_rows) window rows into its ring, after every read of
    // it: packed again from the FP32 rows (the same codes as the call rows').
    OP(pack_rows, s->kvw, c->n_wd, Dh, (int32_t)Dh, DI_DSV41_WIN_BLOCK, 8, win, D32(c->win_dst),
       D32(c->win_src));
    return DI_OK;
fail:
    return st;
}

// One mHC site (dsv41.c block): coefficients from X (pre into pre_out), the input collapsed
// with pre_in, then the norm.
static di_status site(const call *c, const dev_hc *hc, const float *norm, const float *pre_in,
                      float *pre_out) {
    stage_state *s = c->s;
    const di_hparams *hp = &s->d->m->hp;
    const int64_t nc = hp->hc_mult, D = hp->n_embd, n_mix = (2 + nc) * nc;
    di_status st = DI_OK;
    OP(matmul, &hc->fn, s->x, c->T, nc * D, s->mix, n_mix);
    OP(mhc_pre_carried, s->x, s->mix, hc->base, hc->scale, (int32_t)nc, D, c->T, hp->hc_iters,
       hp->hc_eps, hp->norm_eps, pre_in, s->a, pre_out, s->post, s->comb);
    ROUND(s->a, c->T * D);
    OP(rmsnorm, s->a, c->T, D, D, norm, hp->norm_eps);
    ROUND(s->a, c->T * D);
    return DI_OK;
fail:
    return st;
}

static di_status engram(const call *c, int il) {
    stage_state *s = c->s;
    const dev_layer *lw = &s->d->layers[il];
    const di_hparams *hp = &s->d->m->hp;
    const int64_t nc = hp->hc_mult, D = hp->n_embd, n_col = s->d->m->v41->hash.n_col;
    const int64_t n_in = n_col * hp->engram_head_dim, n_out = (nc + 1) * D;
    di_status st = DI_OK;
    // The call's rows of the table, gathered on the host into the staging (stage_fill): a table
    // of T * n_col rows with one scale row per row, decoded exactly as the table's own rows.
    const di_tensor *et = s->d->eg_tables[lw->engram];
    di_tensor gt = *et;
    gt.ne[1] = c->T * n_col;
    gt.data = D32(c->eg_data[lw->engram]);
    gt.scale = et->scale ? (const uint8_t *)D32(c->eg_scale[lw->engram]) : NULL;
    gt.block_out = 1;
    gt.row0 = 0;
    OP(embed, &gt, D32(c->eg_ids[lw->engram]), (int32_t)(c->T * n_col), 1, s->eg_in);
    DI_TRY(linear(c, &lw->eg_wkv, s->eg_in, c->T, n_in, s->eg_kv, n_out, true));
    OP(engram_gate, s->eg_kv, lw->eg_qk, (int32_t)nc, D, c->T, hp->norm_eps, s->x);
    ROUND(s->x, c->T * nc * D);
    return DI_OK;
fail:
    return st;
}

// DSpark taps (§3.2; dsv41.c forward_rows): the input streams of a target layer il averaged,
// tap = bf16(sum_s X[s] / NC), into the call's taps [T, n_target, D]. The collapse with pre =
// 1 / NC gives exactly that sum divided by NC: NC is a power of two (checked by
// di_dsv41_dev_dspark_enable), so every product and partial sum is the CPU's scaled exactly.
static di_status taps(const call *c, int il) {
    stage_state *s = c->s;
    const di_hparams *hp = &s->d->m->hp;
    const int64_t nc = hp->hc_mult, D = hp->n_embd, nt = hp->n_dspark_target;
    di_status st = DI_OK;
    for (int k = 0; k < nt; k++) {
        if (hp->dspark_target[k] != il) continue;
        OP(mhc_pre_carried, s->x, NULL, NULL, NULL, (int32_t)nc, D, c->T, hp->hc_iters, hp->hc_eps,
           hp->norm_eps, s->inv_nc, s->a, NULL, NULL, NULL);
        ROUND(s->a, c->T * D);
        OP(scatter_rows, s->a, c->T, D, D, s->taps + k * D, nt * D, s->iota, NULL);
    }
    return DI_OK;
fail:
    return st;
}

static di_status block(const call *c, int il, bool *have_topk, bool *have_cand) {
    stage_state *s = c->s;
    const di_hparams *hp = &s->d->m->hp;
    const dev_layer *lw = &s->d->layers[il];
    const int32_t nc = hp->hc_mult;
    const int64_t n_x = (int64_t)c->T * nc * hp->n_embd;
    di_status st = DI_OK;
    if (lw->engram >= 0) DI_TRY(engram(c, il));
    if (s->dspark) DI_TRY(taps(c, il));
    DI_TRY(site(c, &lw->hc_attn, lw->attn_norm, s->pre, s->pre_attn));
    DI_TRY(attention(c, il, s->a, s->out, have_topk, have_cand));
    OP(mhc_post, s->out, s->x, s->post, s->comb, nc, hp->n_embd, c->T);
    ROUND(s->x, n_x);
    DI_TRY(site(c, &lw->hc_ffn, lw->ffn_norm, s->pre_attn, s->pre)); // pre = F_pre
    OP(moe, &lw->moe, s->a, D32(c->tokens), c->T, s->out);
    OP(mhc_post, s->out, s->x, s->post, s->comb, nc, hp->n_embd, c->T);
    ROUND(s->x, n_x);
    return DI_OK;
fail:
    return st;
}

// The stage's layers of a call (staging uploaded). The first stage embeds the tokens and starts
// pre as one-hot(stream 0); a later one's streams and pre came from the stage before it
// (stage_forward's hand-over, before the layers), and so did the top-k and the candidate pool
// when a layer here reads what an earlier stage published (have_topk / have_cand start as the
// stage's topk_in / cand_in), and the rows each mirrored source finalised this call (in its xfer),
// scattered into the mirror first: the destinations are the owner's (the same lists), so the
// mirror's blocks hold the owner's bytes before any layer here reads them.
static di_status layers(const call *c) {
    stage_state *s = c->s;
    const di_hparams *hp = &s->d->m->hp;
    const int64_t nc = hp->hc_mult, Dh = hp->head_dim, DI = hp->index_head_dim;
    di_status st = DI_OK;
    if (s->d->first) {
        OP(embed, &s->d->embed, D32(c->tokens), c->T, (int32_t)nc, s->x);
        OP(copy, s->pre, s->one_hot, sizeof(float) * (size_t)(c->T * nc));
    }
    for (int il = 0; il < s->d->l0; il++) {
        if (!s->d->layers[il].mirror) continue;
        const dev_src *k = &s->src[il];
        const src_meta *km = &c->sm[il];
        const int64_t n = km->n_pool;
        OP(pack_rows, k->xfer, n, Dh, (int32_t)Dh, DI_DSV41_ENT_BLOCK, DI_BACKEND_Q4E, k->ent,
           D32(km->edst), NULL);
        OP(pack_rows, k->xfer + n * Dh, n, DI, (int32_t)DI, DI_DSV41_KEY_BLOCK, 4, k->ikeys,
           D32(km->edst), NULL);
    }
    bool have_topk = s->d->topk_in, have_cand = s->d->cand_in;
    for (int il = s->d->l0; il < s->d->l1; il++) DI_TRY(block(c, il, &have_topk, &have_cand));
    return DI_OK;
fail:
    return st;
}

// The head (dsv41.c head) on n <= HEAD_CHUNK rows of X listed in rows: gathered with their F_pre,
// collapsed, normed, projected into s->logits [n, V].
static di_status head(const call *c, const int32_t *rows, int32_t n) {
    stage_state *s = c->s;
    const dev_stage *d = s->d;
    const di_hparams *hp = &d->m->hp;
    const int64_t nc = hp->hc_mult, D = hp->n_embd;
    di_status st = DI_OK;
    for (int32_t k = 0; k < n;) {
        int32_t j = 1; // runs of consecutive rows are copied at once
        while (k + j < n && rows[k + j] == rows[k] + j) j++;
        OP(copy, s->hx + (int64_t)k * nc * D, s->x + (int64_t)rows[k] * nc * D,
           sizeof(float) * (size_t)(nc * D * j));
        OP(copy, s->hpre + (int64_t)k * nc, s->pre + (int64_t)rows[k] * nc,
           sizeof(float) * (size_t)(nc * j));
        k += j;
    }
    OP(mhc_pre_carried, s->hx, NULL, NULL, NULL, (int32_t)nc, D, n, hp->hc_iters, hp->hc_eps,
       hp->norm_eps, s->hpre, s->h, NULL, NULL, NULL);
    ROUND(s->h, n * D);
    OP(rmsnorm, s->h, n, D, D, d->norm, hp->norm_eps);
    ROUND(s->h, n * D);
    OP(matmul, &d->head, s->h, n, D, s->logits, hp->n_vocab);
    return DI_OK;
fail:
    return st;
}

// The DSpark context rows of the call's rows (§3.2; dsv41.c dspark_context, dsv41_attn.c
// di_dsv41_dspark_ring): main_x = RMSNorm(main_proj . A8(taps)), then per DSpark block its row
// Q8w(RoPE_main(RMSNorm(wkv . main_x), pos)) into each slot's ring (the window lists of the call:
// the same ring layout as a layer's). Last stage, DSpark on, after the head.
static di_status context_rows(const call *c) {
    stage_state *s = c->s;
    const dev_stage *d = s->d;
    const di_hparams *hp = &d->m->hp;
    const int64_t D = hp->n_embd, Dh = hp->head_dim, T = c->T;
    const int32_t n_rot = hp->rope_main.n_dims;
    const float rs = hp->rope_main.attention_factor;
    di_status st = DI_OK;
    DI_TRY(linear(c, &d->ds_main_proj, s->taps, T, hp->n_dspark_target * D, s->out, D, true));
    OP(rmsnorm, s->out, T, D, D, d->ds_main_norm, hp->norm_eps);
    ROUND(s->out, T * D);
    for (int i = 0; i < d->n_ds; i++) {
        const dev_layer *lw = &d->ds[i];
        DI_TRY(linear(c, &lw->wkv, s->out, T, D, s->cc, Dh, true));
        OP(rmsnorm, s->cc, T, Dh, Dh, lw->kv_norm, hp->norm_eps);
        ROUND(s->cc, T * Dh);
        OP(rope, s->cc, T, Dh, Dh, n_rot, d->omega_main, D32(c->pos), 1, rs, false);
        ROUND(s->cc, T * Dh);
        // Q8w: the rows' Q8 codes straight into the slots' rings (the window lists of the call).
        OP(pack_rows, s->cc, c->n_wd, Dh, (int32_t)Dh, DI_DSV41_WIN_BLOCK, 8, ds_region(s, i),
           D32(c->win_dst), D32(c->win_src));
    }
    return DI_OK;
fail:
    return st;
}

// A DSpark block on the block rows of a draft call (dsv41.c block with dspark; dsv41_attn.c
// di_dsv41_dspark_attention): as a layer's block without Engram, compressor or indexer; its
// attention's keys are the slot's DSpark ring and every row of its block (the call's key lists),
// the block rows' kv go into the call rows of the block's region and are not stored.
static di_status ds_block(const call *c, int i, int32_t key_stride) {
    stage_state *s = c->s;
    const dev_stage *d = s->d;
    const di_hparams *hp = &d->m->hp;
    const dev_layer *lw = &d->ds[i];
    const int32_t nc = hp->hc_mult;
    const int64_t D = hp->n_embd, H = hp->n_head, Dh = hp->head_dim, T = c->T, n_x = T * nc * D;
    const float rs = hp->rope_main.attention_factor;
    uint8_t *win = ds_region(s, i);
    di_status st = DI_OK;
    DI_TRY(site(c, &lw->hc_attn, lw->attn_norm, s->pre, s->pre_attn));
    // q, and the block rows' kv: their Q8 codes into the call rows of the block's region (not
    // stored).
    DI_TRY(attn_q_kv(c, lw, s->a, d->omega_main, rs, win));
    // Every key a Q8 row of the region (n_win = n_keys: the ring's rows, then the block's).
    OP(attn_codes, s->q, win, NULL, D32(c->keys), key_stride, D32(c->nk_win), D32(c->nk_win),
       key_stride, lw->attn_sink, (int32_t)T, (int32_t)H, (int32_t)Dh, 1.0f / sqrtf((float)Dh),
       d->official, s->o);
    DI_TRY(attn_out(c, lw, d->omega_main, rs, s->out));
    OP(mhc_post, s->out, s->x, s->post, s->comb, nc, D, c->T);
    ROUND(s->x, n_x);
    DI_TRY(site(c, &lw->hc_ffn, lw->ffn_norm, s->pre_attn, s->pre));
    OP(moe, &lw->moe, s->a, D32(c->tokens), c->T, s->out);
    OP(mhc_post, s->out, s->x, s->post, s->comb, nc, D, c->T);
    ROUND(s->x, n_x);
    return DI_OK;
fail:
    return st;
}

// The device work of a draft call (di_dsv41_dev_draft) over T = n * B block rows, staging
// uploaded: the block rows' embedding, pre = one-hot(stream 0), the DSpark blocks, h = collapse
// (the pre-norm rows of the confidence head, into s->a) and hn = RMSNorm(h, norm) (into s->out).
static di_status draft_rows(const call *c, int32_t key_stride) {
    stage_state *s = c->s;
    const dev_stage *d = s->d;
    const di_hparams *hp = &d->m->hp;
    const int64_t nc = hp->hc_mult, D = hp->n_embd, T = c->T;
    di_status st = DI_OK;
    OP(embed, &d->embed, D32(c->tokens), c->T, (int32_t)nc, s->x);
    OP(copy, s->pre, s->one_hot, sizeof(float) * (size_t)(T * nc));
    for (int i = 0; i < d->n_ds; i++) DI_TRY(ds_block(c, i, key_stride));
    OP(mhc_pre_carried, s->x, NULL, NULL, NULL, (int32_t)nc, D, c->T, hp->hc_iters, hp->hc_eps,
       hp->norm_eps, s->pre, s->a, NULL, NULL, NULL);
    ROUND(s->a, T * D);
    OP(copy, s->out, s->a, sizeof(float) * (size_t)(T * D));
    OP(rmsnorm, s->out, T, D, D, d->ds_norm, hp->norm_eps);
    ROUND(s->out, T * D);
    return DI_OK;
fail:
    return st;
}

// Block row j of a draft call's n sequences (the embeddings of their previous tokens in s->me):
// base logits = head . hn[j] into s->logits, + the Markov head's head_markov . embed (mhc_post
// with one stream and unit weights: mk + lg, the sum the CPU takes), then each row's draft, its
// argmax (the host's scan, ties to the lower id), into s->pick.
static di_status draft_head(const call *c, int32_t j, int32_t n, int32_t bs) {
    stage_state *s = c->s;
    const dev_stage *d = s->d;
    const di_hparams *hp = &d->m->hp;
    const int64_t D = hp->n_embd, V = hp->n_vocab, R = hp->dspark_markov_rank;
    di_status st = DI_OK;
    OP(matmul, &d->head, s->out + (int64_t)j * D, n, (int64_t)bs * D, s->logits, V);
    OP(matmul, &d->ds_markov_head, s->me, n, R, s->mk, V);
    OP(mhc_post, s->mk, s->logits, s->ones, s->ones, 1, V, n);
    OP(argmax_rows, s->logits, n, V, V, s->pick);
    return DI_OK;
fail:
    return st;
}

#undef OP

// ---- checks ----

static di_status check_call(stage_state *s, const di_dsv41_dev_seq *seqs, int32_t n_seq,
                            const int32_t *tokens, const int32_t *logit_rows, int32_t n_logit_rows,
                            const float *logits, int32_t *n_rows_out) {
    const di_hparams *hp = &s->d->m->hp;
    if (n_seq < 1 || !seqs || !tokens) {
        DI_LOG_ERROR("dev forward (V4.1): need at least one sequence with tokens");
        return DI_ERR_INVALID;
    }
    memset(s->used, 0, (size_t)s->n_slots);
    int64_t n_rows = 0;
    for (int32_t i = 0; i < n_seq; i++) {
        const di_dsv41_dev_seq *sq = &seqs[i];
        if (sq->slot < 0 || sq->slot >= s->n_slots || s->used[sq->slot]) {
            DI_LOG_ERROR("dev forward (V4.1): sequence %d: slot %d is out of range [0, %d) or "
                         "repeated",
                         i, sq->slot, s->n_slots);
            return DI_ERR_INVALID;
        }
        s->used[sq->slot] = 1;
        const bool start = sq->pos == 0 || (sq->win_lo > 0 && sq->pos == sq->win_lo);
        if (sq->n_tok < 1 || (!start && sq->pos != s->n_past[sq->slot]) ||
            (int64_t)sq->pos + sq->n_tok > s->n_ctx) {
            DI_LOG_ERROR("dev forward (V4.1): sequence %d: %d tokens at %d (slot %d has consumed "
                         "%d, context %d)",
                         i, sq->n_tok, sq->pos, sq->slot, s->n_past[sq->slot], s->n_ctx);
            return DI_ERR_INVALID;
        }
        const int64_t need = ((int64_t)sq->pos + sq->n_tok + s->block_tokens - 1) / s->block_tokens;
        if (s->shared) {
            if (!sq->blocks || sq->n_blocks < need) {
                DI_LOG_ERROR("dev forward (V4.1): sequence %d lists %d entry blocks, needs %lld", i,
                             sq->n_blocks, (long long)need);
                return DI_ERR_INVALID;
            }
            for (int64_t j = 0; j < need; j++)
                if (sq->blocks[j] < 0 || sq->blocks[j] >= s->n_eblocks) {
                    DI_LOG_ERROR("dev forward (V4.1): sequence %d: entry block %d out of range", i,
                                 sq->blocks[j]);
                    return DI_ERR_INVALID;
                }
        }
        if (sq->win_lo < 0 || sq->win_lo > sq->pos || sq->n_cached < 0 ||
            sq->n_cached % s->block_tokens != 0 || (sq->n_cached > 0 && !s->shared) ||
            (sq->win_lo > 0 && (sq->win_lo > sq->n_cached ||
                                (hp->n_engram > 0 && sq->pos == sq->win_lo && !sq->prefix))) ||
            (sq->n_cached > 0 && sq->n_cached / s->block_tokens > sq->n_blocks)) {
            DI_LOG_ERROR("dev forward (V4.1): sequence %d: bad replay (win_lo %d, n_cached %d, pos "
                         "%d, %d blocks of %d%s)",
                         i, sq->win_lo, sq->n_cached, sq->pos, sq->n_blocks, s->block_tokens,
                         sq->prefix ? "" : ", no prefix tokens");
            return DI_ERR_INVALID;
        }
        n_rows += sq->n_tok;
    }
    if (n_rows > s->max_rows) {
        DI_LOG_ERROR("dev forward (V4.1): %lld rows (the state takes %d)", (long long)n_rows,
                     s->max_rows);
        return DI_ERR_INVALID;
    }
    for (int64_t t = 0; t < n_rows; t++)
        if (tokens[t] < 0 || tokens[t] >= hp->n_vocab) {
            DI_LOG_ERROR("dev forward (V4.1): token %d at row %lld outside the vocabulary",
                         tokens[t], (long long)t);
            return DI_ERR_INVALID;
        }
    // A block a sequence writes (from its first position not cached on) is listed by no other.
    if (s->shared) {
        for (int32_t b = 0; b < s->n_eblocks; b++) s->blk_owner[b] = -1;
        for (int32_t i = 0; i < n_seq; i++) {
            const di_dsv41_dev_seq *sq = &seqs[i];
            const int64_t need =
                ((int64_t)sq->pos + sq->n_tok + s->block_tokens - 1) / s->block_tokens;
            const int64_t p_w = sq->pos > sq->n_cached ? sq->pos : sq->n_cached;
            for (int64_t j = p_w / s->block_tokens; j < need; j++) {
                int32_t *o = &s->blk_owner[sq->blocks[j]];
                if (*o >= 0) {
                    DI_LOG_ERROR("dev forward (V4.1): entry block %d is written twice (sequence "
                                 "%d)",
                                 sq->blocks[j], i);
                    return DI_ERR_INVALID;
                }
                *o = i;
            }
        }
        for (int32_t i = 0; i < n_seq; i++) {
            const di_dsv41_dev_seq *sq = &seqs[i];
            const int64_t need =
                ((int64_t)sq->pos + sq->n_tok + s->block_tokens - 1) / s->block_tokens;
            for (int64_t j = 0; j < need; j++) {
                const int32_t o = s->blk_owner[sq->blocks[j]];
                if (o >= 0 && o != i) {
                    DI_LOG_ERROR("dev forward (V4.1): sequence %d reads entry block %d, which "
                                 "sequence %d writes",
                                 i, sq->blocks[j], o);
                    return DI_ERR_INVALID;
                }
            }
        }
    }
    if (!di_dev_logit_rows_ok("dev forward (V4.1)", logit_rows, n_logit_rows, n_rows, logits))
        return DI_ERR_INVALID;
    *n_rows_out = (int32_t)n_rows;
    return DI_OK;
}

// ---- the call ----

// A replay's start (pos == win_lo > 0): the slot's window rings in every layer become zero rows,
// as di_dsv41_restart zeroes the CPU state's (before the call's ops, outside any graph).
static di_status zero_rings(const call *c) {
    stage_state *s = c->s;
    di_backend *b = s->d->b;
    const di_hparams *hp = &s->d->m->hp;
    const int64_t RW = ring_rows(hp);
    di_status st = DI_OK;
    for (int32_t i = 0; i < c->n_seq; i++) {
        const di_dsv41_dev_seq *sq = &c->seqs[i];
        if (sq->win_lo <= 0 || sq->pos != sq->win_lo) continue;
        for (int il = s->d->l0; il < s->d->l1; il++) // zero bytes: Q8 rows of +0
            DI_TRY(b->vt->memset(b, ring_of(s, il, sq->slot), 0, (size_t)(RW * s->win_bytes)));
        for (int q = 0; s->dspark && s->d->last && q < s->d->n_ds; q++)
            DI_TRY(b->vt->memset(b, ds_ring_of(s, q, sq->slot), 0, (size_t)(RW * s->win_bytes)));
    }
    return DI_OK;
fail:
    return st;
}

// The graph of the call when it is a graph step (GRAPH_ROWS: every sequence r rows, every row's
// logits), -1 otherwise.
static int32_t graph_of(const call *c, const int32_t *logit_rows, int32_t n_logit_rows) {
    const int32_t r = c->seqs[0].n_tok;
    if (r > GRAPH_ROWS || c->T > HEAD_CHUNK || n_logit_rows != c->T) return -1;
    for (int32_t i = 1; i < c->n_seq; i++)
        if (c->seqs[i].n_tok != r) return -1;
    for (int32_t k = 0; k < n_logit_rows; k++)
        if (logit_rows[k] != k) return -1;
    return (r - 1) * (HEAD_CHUNK + 1) + c->n_seq;
}

// A decode step's layers and head (every row's logits), as one capture records them.
typedef struct step_ctx {
    const call *c;
    const int32_t *rows;
} step_ctx;

static di_status run_step(const void *ctx) {
    const step_ctx *x = ctx;
    di_status st = layers(x->c);
    if (st == DI_OK && x->c->s->d->last) st = head(x->c, x->rows, x->c->T);
    if (st == DI_OK && x->c->s->d->last && x->c->s->dspark) st = context_rows(x->c);
    return st;
}

// The layers and the head of a decode step as one backend graph (dsv4_dev.c's scheme): the
// first step of a size runs directly, the second captures, later ones replay.
static di_status run_decode(const call *c, const int32_t *logit_rows, int32_t key) {
    stage_state *s = c->s;
    di_backend *b = s->d->b;
    dev_graph *g = &s->graphs[key];
    const step_ctx x = {c, logit_rows};
    if (g->g) {
        s->stats.n_replayed++;
        s->stats.last_ops = g->n_ops;
        return b->vt->graph_launch(b, g->g);
    }
    if (g->n_run++ == 0 || !s->graphs_on) {
        s->stats.n_direct++;
        return run_step(&x);
    }
    void *graph = NULL;
    di_status st = di_dev_capture(b, run_step, &x, &graph);
    g->n_ops = s->stats.last_ops; // recorded, not run: counted at the launch
    if (st != DI_OK) { // nothing ran: the step runs directly, and so will every later one
        DI_LOG_WARN("dev forward (V4.1): decode graph capture failed (%s); graphs off",
                    di_status_str(st));
        s->graphs_on = false;
        s->stats.n_direct++;
        return run_step(&x);
    }
    g->g = graph;
    s->stats.n_captured++;
    s->stats.n_cached++;
    return b->vt->graph_launch(b, g->g);
}

// One hand-over into stage s (dsv41_dev.h "Pipeline stages"): its dst <- stage from's src, `bytes`
// (di_backend_hand_over: a peer copy, or through all's host bounce at byte offset off), counted by
// kind (a bounce is an upload of the call too).
static di_status hand_in(const di_dsv41_dev_state *all, stage_state *s, void *dst,
                         const stage_state *from, const void *src, size_t bytes, size_t off) {
    bool peer = false;
    di_status st = di_backend_hand_over(s->d->b, dst, from->d->b, src, bytes,
                                        all->xh ? (uint8_t *)all->xh + off : NULL, &peer);
    if (st != DI_OK) return st;
    s->stats.last_handover_bytes += (int64_t)bytes;
    if (peer) {
        s->stats.n_handover_peer++;
    } else {
        s->stats.n_handover_host++;
        s->stats.last_uploads++;
        s->stats.last_upload_bytes += (int64_t)bytes;
    }
    return DI_OK;
}

// The stage of `all` whose layers hold layer il.
static const stage_state *owner_of(const di_dsv41_dev_state *all, int il) {
    for (int32_t k = 0; k < all->n_stages; k++)
        if (il >= all->ss[k]->d->l0 && il < all->ss[k]->d->l1) return all->ss[k];
    DI_ASSERT(!"a layer of no stage");
    return NULL;
}

// Stage ks's part of a call checked by check_call on every stage (T rows). Before its layers it
// copies what it receives (dsv41_dev.h "Pipeline stages") from the stages before, which keep it in
// their backend memory after their step: the streams [T, NC, D] and pre [T, NC] after stage
// ks - 1's last layer, the rows the owners of the stage's mirrors finalised (their xfer), the top-k
// and candidate pool stage ks - 1 holds (its own or received). The last stage runs the head and
// downloads the logits. On success the slots advance; on failure the caller restarts them on
// every stage.
static di_status stage_forward(const di_dsv41_dev_state *all, int32_t ks,
                               const di_dsv41_dev_seq *seqs, int32_t n_seq, const int32_t *tokens,
                               const int32_t *logit_rows, int32_t n_logit_rows, float *logits,
                               const uint8_t *greedy, int32_t *picks, int32_t T) {
    stage_state *s = all->ss[ks];
    const stage_state *prev = ks > 0 ? all->ss[ks - 1] : NULL;
    const dev_stage *d = s->d;
    di_backend *b = d->b;
    const di_hparams *hp = &d->m->hp;
    const int64_t Dh = hp->head_dim, DI = hp->index_head_dim;
    const size_t ntb = (size_t)(hp->candidate_topk_blocks > 0 ? hp->candidate_topk_blocks : 1);
    const int64_t V = hp->n_vocab;
    const bool last = s->d->last;
    const size_t x_bytes = sizeof(float) * (size_t)T * (size_t)hp->hc_mult * (size_t)hp->n_embd;
    const size_t pre_bytes = sizeof(float) * (size_t)T * (size_t)hp->hc_mult;
    const size_t pre_off = sizeof(float) * (size_t)s->max_rows * (size_t)hp->hc_mult *
                           (size_t)hp->n_embd; // pre's region of the bounce
    di_status st = DI_OK;
    call cl = {.s = s, .seqs = seqs, .n_seq = n_seq, .T = T};
    call *c = &cl;
    stage_layout(c);
    DI_ASSERT(c->n_words <= s->stage_cap);
    for (int32_t i = 0; i < n_seq; i++) s->n_past[seqs[i].slot] = -1; // until the call succeeds
    stage_fill(c, tokens);
    s->stats.last_ops = 0;
    s->stats.last_uploads = 1;
    s->stats.last_upload_bytes = (int64_t)(sizeof(int32_t) * c->n_words);
    s->stats.last_handover_bytes = 0;
    s->stats.last_download_bytes = 0;
    DI_TRY(b->vt->upload(b, s->stage_dev, s->stage, sizeof(int32_t) * c->n_words));
    if (prev) { // the hand-overs (stream-ordered before the layers)
        DI_TRY(hand_in(all, s, s->x, prev, prev->x, x_bytes, 0));
        DI_TRY(hand_in(all, s, s->pre, prev, prev->pre, pre_bytes, pre_off));
    }
    // The rows the earlier owners of the stage's mirrors finalised (their n_pool: this call's
    // shape), the top-k and the candidate pool published before the stage.
    for (int il = 0; il < d->l0; il++) {
        if (!d->layers[il].mirror) continue;
        const stage_state *o = owner_of(all, il);
        const size_t n = sizeof(float) * (size_t)(c->sm[il].n_pool * (Dh + DI));
        DI_TRY(hand_in(all, s, s->src[il].xfer, o, o->src[il].xfer, n, all->h_src[il]));
    }
    // DSpark: the taps of target layers on earlier stages.
    const size_t taps_bytes =
        sizeof(float) * (size_t)T * (size_t)hp->n_dspark_target * (size_t)hp->n_embd;
    bool taps_in = false;
    for (int k = 0; k < hp->n_dspark_target && s->dspark && !d->first; k++)
        taps_in |= hp->dspark_target[k] < d->l0;
    if (taps_in) { // from the stage before (its own taps and those it received)
        DI_ASSERT(prev->d->taps_here && prev->taps);
        bool peer = false;
        DI_TRY(
            di_backend_hand_over(b, s->taps, prev->d->b, prev->taps, taps_bytes, all->th, &peer));
        s->stats.last_handover_bytes += (int64_t)taps_bytes;
        if (peer) {
            s->stats.n_handover_peer++;
        } else {
            s->stats.n_handover_host++;
            s->stats.last_uploads++;
            s->stats.last_upload_bytes += (int64_t)taps_bytes;
        }
    }
    if (d->topk_in) {
        DI_ASSERT(prev->d->topk_out);
        const size_t n = sizeof(int32_t) * (size_t)T * (size_t)hp->index_topk;
        DI_TRY(hand_in(all, s, s->sel, prev, prev->sel, n, all->h_sel));
    }
    if (d->cand_in) {
        DI_ASSERT(prev->d->cand_out);
        const size_t n = sizeof(int32_t) * (size_t)T * ntb, nn = sizeof(int32_t) * (size_t)T;
        DI_TRY(hand_in(all, s, s->cand, prev, prev->cand, n, all->h_cand));
        DI_TRY(hand_in(all, s, s->n_cand, prev, prev->n_cand, nn, all->h_ncand));
    }
    DI_TRY(zero_rings(c));
    const int32_t key = graph_of(c, logit_rows, n_logit_rows);
    if (key >= 0) {
        DI_TRY(run_decode(c, logit_rows, key));
        if (n_logit_rows > 0 && last) // after the graph: its ops are the same for any greedy rows
            DI_TRY(di_dev_logits_down(b, s->logits, T, V, greedy, s->pick, s->pick_h, logits, picks,
                                      &s->stats.last_ops, &s->stats.last_download_bytes));
    } else {
        s->stats.n_direct++;
        DI_TRY(layers(c));
        for (int32_t k = 0; k < n_logit_rows && last; k += HEAD_CHUNK) {
            const int32_t n = n_logit_rows - k < HEAD_CHUNK ? n_logit_rows - k : HEAD_CHUNK;
            DI_TRY(head(c, logit_rows + k, n));
            DI_TRY(di_dev_logits_down(b, s->logits, n, V, greedy ? greedy + k : NULL, s->pick,
                                      s->pick_h, logits + (int64_t)k * V, picks ? picks + k : NULL,
                                      &s->stats.last_ops, &s->stats.last_download_bytes));
        }
        if (last && s->dspark) DI_TRY(context_rows(c));
    }
    // What the later stages copy (the streams and pre, the rows of the stage's handed sources,
    // the top-k and candidate pool) stays in this stage's memory until its next call.
    // The end of the stage's step: every op done (and its faults surfaced) before the slots
    // advance.
    DI_TRY(b->vt->sync(b));
    for (int32_t i = 0; i < n_seq; i++) {
        const di_dsv41_dev_seq *sq = &seqs[i];
        const int32_t end = sq->pos + sq->n_tok;
        if (sq->pos == 0 || (sq->win_lo > 0 && sq->pos == sq->win_lo))
            s->rb_lo[sq->slot] = sq->pos, s->hw[sq->slot] = end;
        else if (end > s->hw[sq->slot])
            s->hw[sq->slot] = end;
        s->n_past[sq->slot] = end;
    }
    s->stats.n_download_bytes += s->stats.last_download_bytes;
    return DI_OK;
fail:
    return st;
}

// ---- the forward over its stages ----

static dev_stage *last_stage(const di_dsv41_dev *d) {
    return d->st[d->n_stages - 1];
}

// Backend bytes of layer il's weights the dev forward uploads (matrices with their scales, the
// vectors; Engram tables stay on the host and are not counted).
static int64_t layer_w_bytes(const di_model *m, const di_dsv4_layer_w *lw) {
    const di_hparams *hp = &m->hp;
    const int64_t f = sizeof(float), nc = hp->hc_mult, D = hp->n_embd;
    int64_t n = di_dev_tensor_bytes(&lw->hc_attn.fn) + di_dev_tensor_bytes(&lw->hc_ffn.fn);
    n += 2 * f * ((2 + nc) * nc + 3) + 2 * f * D;
    n += di_dev_tensor_bytes(&lw->wq_a) + di_dev_tensor_bytes(&lw->wq_b) +
         di_dev_tensor_bytes(&lw->wkv) + di_dev_tensor_bytes(&lw->wo_a) +
         di_dev_tensor_bytes(&lw->wo_b);
    n += f * (hp->q_lora_rank + hp->head_dim + hp->n_head);
    if (lw->kv_source)
        n += di_dev_tensor_bytes(&lw->cmp.wkv) + di_dev_tensor_bytes(&lw->cmp.wgate) +
             di_dev_tensor_bytes(&lw->idx_wk) + f * (hp->head_dim + hp->index_head_dim);
    if (lw->index_source)
        n += di_dev_tensor_bytes(&lw->idx_wq_b) + di_dev_tensor_bytes(&lw->idx_weights_proj);
    if (lw->engram >= 0) n += di_dev_tensor_bytes(&lw->eg_wkv) + f * nc * D;
    n += di_dev_tensor_bytes(&lw->gate) + di_dev_tensor_bytes(&lw->sh_w1) +
         di_dev_tensor_bytes(&lw->sh_w2) + di_dev_tensor_bytes(&lw->sh_w3);
    for (int32_t e = 0; e < lw->n_expert && lw->w1; e++)
        n += di_dev_tensor_bytes(&lw->w1[e]) + di_dev_tensor_bytes(&lw->w2[e]) +
             di_dev_tensor_bytes(&lw->w3[e]);
    return n;
}

static int64_t layer_bytes(const di_model *m, int32_t il) {
    return layer_w_bytes(m, &m->layers[il]);
}

// Whether the top-k published before layer l is read at or after it: an index source came before
// l and the first compressing layer at or after l is no index source (one publishes its own top-k
// before it attends, and every later layer reads that one).
static bool topk_crosses(const di_hparams *hp, int32_t l) {
    bool idx_before = false;
    for (int32_t il = 0; il < l; il++) idx_before |= hp->index_source[il];
    for (int32_t il = l; il < hp->n_layer && idx_before; il++)
        if (hp->compress_ratio[il] > 0) return !hp->index_source[il];
    return false;
}

// Whether the candidate pool is read at or after layer l: the candidate source came before l and
// an index source follows (each applies the pool).
static bool cand_crosses(const di_hparams *hp, int32_t l) {
    if (hp->candidate_layer < 0 || hp->candidate_layer >= l) return false;
    for (int32_t il = l; il < hp->n_layer; il++)
        if (hp->index_source[il]) return true;
    return false;
}

// The hand-over's roles of every stage of d (dsv41_dev.h "Pipeline stages"): the mirrors each
// keeps of the earlier stages' kv sources its layers read (and their owners' handed flags), and
// the top-k / candidate pool each receives and passes on.
static void set_handover(di_dsv41_dev *d) {
    const di_hparams *hp = &d->m->hp;
    for (int32_t k = 0; k < d->n_stages; k++) {
        dev_stage *sk = d->st[k];
        for (int il = sk->l0; il < sk->l1; il++) {
            const int src = sk->layers[il].src;
            if (src < 0 || src >= sk->l0) continue;
            sk->layers[src].mirror = true;
            for (int32_t j = 0; j < k; j++)
                if (here(d->st[j], src)) d->st[j]->layers[src].handed = true;
        }
        sk->topk_in = k > 0 && topk_crosses(hp, sk->l0);
        sk->topk_out = k < d->n_stages - 1 && topk_crosses(hp, sk->l1);
        sk->cand_in = k > 0 && cand_crosses(hp, sk->l0);
        sk->cand_out = k < d->n_stages - 1 && cand_crosses(hp, sk->l1);
    }
}

// ---- the KV-aware split (dev_common.h di_dev_split_mem) ----

typedef struct split_ctx {
    const di_model *m;
    const di_dev_plan *p;
} split_ctx;

// Bytes per call row of a stage's scratch besides its layers' window rows (part_create's buffers
// sized by max_rows: streams, projections, index queries and scores, key lists; the last stage's
// head chunk counted once, not per row): the fixed part's estimate, the backend's own op scratch
// being the reserve's.
static int64_t row_scratch_bytes(const di_hparams *hp, int32_t n_ctx) {
    const int64_t D = hp->n_embd, nc = hp->hc_mult, Dh = hp->head_dim, H = hp->n_head;
    const int64_t f = sizeof(float);
    int32_t min_ratio = 0;
    for (int il = 0; il < hp->n_layer; il++)
        if (hp->compress_ratio[il] > 0 && (!min_ratio || hp->compress_ratio[il] < min_ratio))
            min_ratio = hp->compress_ratio[il];
    const int64_t max_vis = min_ratio ? n_ctx / min_ratio : 1;
    int64_t widest = H * Dh > D ? H * Dh : D;
    if ((int64_t)hp->o_groups * hp->o_lora_rank > widest)
        widest = (int64_t)hp->o_groups * hp->o_lora_rank;
    const int64_t floats = nc * D + 2 * D + (2 + nc) * nc + 5 * nc + nc * nc + hp->q_lora_rank +
                           2 * H * Dh + (int64_t)hp->o_groups * hp->o_lora_rank + 4 * Dh +
                           hp->index_head_dim * (1 + (int64_t)hp->n_index_head) + hp->n_index_head +
                           2 * max_vis + widest + hp->index_topk + hp->window +
                           (int64_t)(nc + 1) * D;
    return f * floats;
}

// dev_common.h di_dev_stage_cost_fn for V4.1 stage [l0, l1): its weights (the embedding on the
// first stage; the head and final norm, and with DSpark loaded its blocks, heads, norms and the
// embedding again, on the last), the entries and index keys of the kv sources it owns or mirrors
// (set_handover's rule: a source before l0 that one of its layers reads), and the fixed part of
// the plan's state: n_slots tails (every layer's window ring, the owned ratio-2 sources' C and Z
// rings, with spec the DSpark rings on the last stage) and max_rows call rows and scratch.
static void stage_cost41(const void *ctx, int32_t l0, int32_t l1, int32_t L,
                         di_dev_stage_cost *out) {
    const split_ctx *c = ctx;
    const di_model *m = c->m;
    const di_hparams *hp = &m->hp;
    const di_dev_plan *p = c->p;
    const bool first = l0 == 0, last = l1 == L;
    const int64_t f = sizeof(float), win = win_row_bytes(hp), R = p->max_rows;
    int64_t w = 0; // (the rope tables every stage uploads, a few hundred bytes, not counted)
    if (first || (last && m->n_mtp_loaded > 0)) w += di_dev_tensor_bytes(&m->embed);
    if (last) w += di_dev_tensor_bytes(&m->head) + f * hp->n_embd;
    for (int32_t il = l0; il < l1; il++) w += layer_bytes(m, il);
    for (int i = 0; last && i < m->n_mtp_loaded; i++) w += layer_w_bytes(m, &m->mtp[i].block);
    if (last && m->n_mtp_loaded > 0)
        w += di_dev_tensor_bytes(&m->dspark.main_proj) +
             di_dev_tensor_bytes(&m->dspark.markov_head) + 2 * f * hp->n_embd;
    int64_t blk = 0, slot = (int64_t)(l1 - l0) * ring_rows(hp) * win;
    for (int32_t il = 0; il < l1; il++) {
        if (!hp->kv_source[il]) continue;
        bool kept = il >= l0;
        for (int32_t j = l0; j < l1 && !kept; j++)
            kept = hp->compress_ratio[j] > 0 && source_of(hp, j) == il;
        if (!kept) continue;
        blk += src_block_bytes(hp, il, p->block_tokens);
        if (il >= l0 && hp->compress_ratio[il] == 2) slot += 2 * CZ_ROWS * hp->head_dim * f;
    }
    int64_t fixed = (int64_t)(l1 - l0) * R * win + R * row_scratch_bytes(hp, p->n_ctx);
    if (last) {
        const int64_t HR = R < HEAD_CHUNK ? R : HEAD_CHUNK;
        fixed += HR * f * ((int64_t)hp->hc_mult * hp->n_embd + hp->n_embd + hp->n_vocab);
        // The DSpark blocks' regions: their call rows always, their rings with speculation.
        fixed += (int64_t)m->n_mtp_loaded * R * win;
        if (p->spec) slot += (int64_t)m->n_mtp_loaded * ring_rows(hp) * win;
    }
    out->weight_bytes = w;
    out->block_bytes = blk;
    out->fixed_bytes = fixed + (int64_t)p->n_slots * slot;
}

di_status di_dsv41_dev_split_mem(const di_model *m, int32_t n_stages, const int64_t *budget_bytes,
                                 di_dev_split_out *out) {
    const int32_t L = m->hp.n_layer;
    if (n_stages < 1 || n_stages > DI_DSV41_DEV_MAX_STAGES || n_stages > L) {
        DI_LOG_ERROR("dev forward (V4.1): %d pipeline stages for %d layers (1 to min(%d, layers))",
                     n_stages, L, DI_DSV41_DEV_MAX_STAGES);
        return DI_ERR_INVALID;
    }
    const di_dev_plan p = di_dev_plan_of(m, model_block_tokens(m));
    const split_ctx c = {.m = m, .p = &p};
    const int64_t one_seq = (p.n_ctx + p.block_tokens - 1) / p.block_tokens;
    return di_dev_split_mem("dev forward (V4.1)", L, n_stages, stage_cost41, &c, budget_bytes,
                            one_seq, out);
}

void di_dsv41_dev_stage_cost(const di_model *m, int32_t l0, int32_t l1, di_dev_stage_cost *out) {
    const di_dev_plan p = di_dev_plan_of(m, model_block_tokens(m));
    const split_ctx c = {.m = m, .p = &p};
    DI_ASSERT(l0 >= 0 && l0 < l1 && l1 <= m->hp.n_layer);
    stage_cost41(&c, l0, l1, m->hp.n_layer, out);
}

di_status di_dsv41_dev_split(const di_model *m, int32_t n_stages, int32_t *layer0,
                             int64_t *stage_bytes) {
    // The weight balance: the KV-aware split without budgets (every cut is legal: what crosses
    // one is handed over, dsv41_dev.h "Pipeline stages").
    di_dev_split_out sp;
    const di_status st = di_dsv41_dev_split_mem(m, n_stages, NULL, &sp);
    if (st != DI_OK) return st;
    for (int32_t k = 0; k <= n_stages; k++) layer0[k] = sp.layer0[k];
    for (int32_t k = 0; stage_bytes && k < n_stages; k++) stage_bytes[k] = sp.cost[k].weight_bytes;
    return DI_OK;
}

di_status di_dsv41_dev_create_stages(di_model *m, di_backend *const *b, int32_t n_stages,
                                     di_dsv41_dev **out) {
    const di_hparams *hp = &m->hp;
    if (!hp->v41 || !m->v41) {
        DI_LOG_ERROR("dev forward (V4.1): not a DeepSeek V4.1 model (dsv4_dev.h runs V4)");
        return DI_ERR_UNSUPPORTED;
    }
    if (hp->n_engram > 0 && !m->v41->cmap) {
        DI_LOG_ERROR("dev forward (V4.1): the model has no Engram compressed token map");
        return DI_ERR_INVALID;
    }
    if (m->opt.precision != DI_PRECISION_FP32 && m->opt.precision != DI_PRECISION_OFFICIAL) {
        DI_LOG_ERROR("dev forward (V4.1): unknown precision recipe %d", (int)m->opt.precision);
        return DI_ERR_UNSUPPORTED;
    }
    if (hp->hc_mult > 16 || hp->hc_mult < 1) {
        DI_LOG_ERROR("dev forward (V4.1): %d mHC streams (at most 16)", hp->hc_mult);
        return DI_ERR_UNSUPPORTED;
    }
    // The split for the plan's state on the memory the backends have free (dev_common.h
    // di_dev_split_mem); the weight balance where some backend cannot say.
    if (n_stages < 1 || n_stages > DI_DSV41_DEV_MAX_STAGES || n_stages > hp->n_layer) {
        DI_LOG_ERROR("dev forward (V4.1): %d pipeline stages for %d layers (1 to min(%d, layers))",
                     n_stages, hp->n_layer, DI_DSV41_DEV_MAX_STAGES);
        return DI_ERR_INVALID;
    }
    int64_t budget[DI_DSV41_DEV_MAX_STAGES];
    const di_dev_plan p = di_dev_plan_of(m, model_block_tokens(m));
    const bool known = di_dev_stage_budgets(b, n_stages, p.reserve_bytes, budget);
    di_dev_split_out sp;
    di_status st = di_dsv41_dev_split_mem(m, n_stages, known ? budget : NULL, &sp);
    if (st != DI_OK) return st;
    if (n_stages > 1) di_dev_split_log("dev forward (V4.1)", &sp, &p);
    return di_dsv41_dev_create_split(m, b, n_stages, sp.layer0, out);
}

di_status di_dsv41_dev_create_split(di_model *m, di_backend *const *b, int32_t n_stages,
                                    const int32_t *layer0, di_dsv41_dev **out) {
    const di_hparams *hp = &m->hp;
    bool ok = n_stages >= 1 && n_stages <= DI_DSV41_DEV_MAX_STAGES && layer0[0] == 0 &&
              layer0[n_stages] == hp->n_layer;
    for (int32_t k = 0; ok && k < n_stages; k++) ok = layer0[k] < layer0[k + 1];
    if (!ok) {
        DI_LOG_ERROR("dev forward (V4.1): not a split of %d layers into %d stages of at least one "
                     "layer each",
                     hp->n_layer, n_stages);
        return DI_ERR_INVALID;
    }
    di_dsv41_dev *d = di_calloc(1, sizeof *d);
    if (!d) return DI_ERR_NOMEM;
    d->m = m;
    di_status st = DI_OK;
    for (int32_t k = 0; k < n_stages; k++) {
        st = stage_create(m, b[k], layer0[k], layer0[k + 1], k == 0, k == n_stages - 1, &d->st[k]);
        if (st != DI_OK) goto fail;
        d->n_stages = k + 1;
    }
    set_handover(d);
    for (int32_t k = 0; k < n_stages && n_stages > 1; k++) {
        const dev_stage *sk = d->st[k];
        char mir[128] = "";
        for (int il = 0, n = 0; il < sk->l0 && n + 16 < (int)sizeof mir; il++)
            if (sk->layers[il].mirror)
                n += snprintf(mir + n, sizeof mir - (size_t)n, "%s%d", n ? ", " : "; mirrors of ",
                              il);
        DI_LOG_INFO("dev forward (V4.1): stage %d of %d: layers [%d, %d)%s%s, on %s%s%s%s", k,
                    n_stages, layer0[k], layer0[k + 1], k == 0 ? " + embedding" : "",
                    k == n_stages - 1 ? " + head" : "", b[k]->desc, mir,
                    sk->topk_in ? "; receives the top-k" : "",
                    sk->cand_in ? "; receives the candidate pool" : "");
    }
    if (hp->n_engram > 0) {
        double mib = 0;
        for (int L = 0; L < hp->n_engram; L++)
            mib += di_tensor_bytes(&m->layers[hp->engram_layer[L]].eg_table) / 1048576.0;
        DI_LOG_INFO("dev forward (V4.1): the %d Engram tables (%.1f MiB) stay in host memory; "
                    "each call gathers its rows there and uploads them with its lists",
                    hp->n_engram, mib);
    }
    *out = d;
    return DI_OK;
fail:
    di_dsv41_dev_destroy(d);
    return st;
}

di_status di_dsv41_dev_create(di_model *m, di_backend *b, di_dsv41_dev **out) {
    return di_dsv41_dev_create_stages(m, &b, 1, out);
}

void di_dsv41_dev_destroy(di_dsv41_dev *d) {
    if (!d) return;
    for (int32_t k = 0; k < d->n_stages; k++) stage_destroy(d->st[k]);
    di_free(d);
}

int32_t di_dsv41_dev_n_stages(const di_dsv41_dev *d) {
    return d->n_stages;
}

di_backend *di_dsv41_dev_stage(const di_dsv41_dev *d, int32_t k, int32_t *l0, int32_t *l1) {
    if (k < 0 || k >= d->n_stages) return NULL;
    *l0 = d->st[k]->l0;
    *l1 = d->st[k]->l1;
    return d->st[k]->b;
}

di_backend *di_dsv41_dev_backend(const di_dsv41_dev *d) {
    return last_stage(d)->b;
}

int32_t di_dsv41_dev_block_tokens(const di_dsv41_dev *d) {
    return model_block_tokens(d->m);
}

di_status di_dsv41_dev_attach_stages(di_model *m, di_backend *const *b, int32_t n_stages) {
    if (m->dev41) {
        DI_LOG_ERROR("dev forward (V4.1): the model already has one attached");
        return DI_ERR_INVALID;
    }
    di_dsv41_dev *d = NULL;
    di_status st = di_dsv41_dev_create_stages(m, b, n_stages, &d);
    if (st != DI_OK) return st;
    m->dev41 = d;
    DI_LOG_INFO("device-resident V4.1 forward on %s%s: sessions (DSpark ones included: their "
                "drafts and rollbacks too) and the serving engine (DSpark speculation included) "
                "run every layer, their KV and compressor state there%s",
                b[n_stages - 1]->desc, n_stages > 1 ? " (and the stages before it)" : "",
                m->accel_matmul ? "; the CPU forward's matmuls offloaded" : "");
    return DI_OK;
}

di_status di_dsv41_dev_attach(di_model *m, di_backend *b) {
    return di_dsv41_dev_attach_stages(m, &b, 1);
}

void di_dsv41_dev_state_destroy(di_dsv41_dev_state *s) {
    if (!s) return;
    for (int32_t k = 0; k < s->n_stages; k++) part_destroy(s->ss[k]);
    if (s->xh) s->d->st[0]->b->vt->host_free(s->d->st[0]->b, s->xh);
    if (s->th) s->d->st[0]->b->vt->host_free(s->d->st[0]->b, s->th);
    di_free(s);
}

di_status di_dsv41_dev_state_create(di_dsv41_dev *d, int32_t n_slots, int32_t n_ctx,
                                    int32_t max_rows, int32_t n_blocks, int32_t block_tokens,
                                    di_dsv41_dev_state **out) {
    const di_hparams *hp = &d->m->hp;
    if (block_tokens == 0) block_tokens = model_block_tokens(d->m);
    di_dsv41_dev_state *s = di_calloc(1, sizeof *s);
    if (!s) return DI_ERR_NOMEM;
    s->d = d;
    di_status st = DI_OK;
    for (int32_t k = 0; k < d->n_stages; k++) {
        DI_TRY(part_create(d->st[k], n_slots, n_ctx, max_rows, n_blocks, block_tokens, &s->ss[k]));
        s->n_stages = k + 1;
    }
    // The host bounce, only where two stages that hand over (any earlier stage to a later one:
    // a mirrored source's owner) cannot copy directly.
    bool bounce = false;
    for (int32_t k = 1; k < d->n_stages; k++)
        for (int32_t j = 0; j < k; j++) bounce |= !di_backend_can_peer(d->st[k]->b, d->st[j]->b);
    if (bounce) {
        di_backend *b = d->st[0]->b;
        const size_t R = (size_t)max_rows;
        size_t n = sizeof(float) * R * (size_t)hp->hc_mult * ((size_t)hp->n_embd + 1);
        for (int32_t k = 0; k < d->n_stages; k++)
            for (int il = d->st[k]->l0; il < d->st[k]->l1; il++)
                if (d->st[k]->layers[il].handed) {
                    s->h_src[il] = n;
                    n += sizeof(float) * R * (size_t)(hp->head_dim + hp->index_head_dim);
                }
        s->h_sel = n;
        n += sizeof(int32_t) * R * (size_t)hp->index_topk;
        s->h_cand = n;
        n += sizeof(int32_t) * R *
             (size_t)(hp->candidate_topk_blocks > 0 ? hp->candidate_topk_blocks : 1);
        s->h_ncand = n;
        n += sizeof(int32_t) * R;
        s->xh_bytes = n;
        DI_TRY(b->vt->host_alloc(b, s->xh_bytes, (void **)&s->xh));
    }
    *out = s;
    return DI_OK;
fail:
    di_dsv41_dev_state_destroy(s);
    return st;
}

int32_t di_dsv41_dev_state_n_blocks(const di_dsv41_dev_state *s) {
    return s->ss[0]->n_eblocks;
}

int64_t di_dsv41_dev_state_bytes(const di_dsv41_dev_state *s) {
    int64_t n = (int64_t)s->xh_bytes;
    for (int32_t k = 0; k < s->n_stages; k++) n += s->ss[k]->n_bytes;
    return n;
}

// Entry block I/O: each kv source's part at its offset (the same bytes as one stage), read from
// its owner, written to its owner and every mirror.
di_status di_dsv41_dev_state_read_block(const di_dsv41_dev_state *s, int32_t block, void *dst) {
    // The page's padding (runs start at multiples of 64 bytes) reads as zeros, as a CPU page's.
    memset(dst, 0, di_dsv41_page_bytes(s->d->m, s->ss[0]->block_tokens));
    for (int32_t k = 0; k < s->n_stages; k++) {
        di_status st = block_io(s->ss[k], block, dst, NULL);
        if (st != DI_OK) return st;
    }
    return DI_OK;
}

di_status di_dsv41_dev_state_write_block(di_dsv41_dev_state *s, int32_t block, const void *src) {
    for (int32_t k = 0; k < s->n_stages; k++) {
        di_status st = block_io(s->ss[k], block, NULL, src);
        if (st != DI_OK) return st;
    }
    return DI_OK;
}

// Tail snapshots: the header once and every layer's rings at their offsets, each stage writing
// (reading) its layers' (the same bytes as one stage).
di_status di_dsv41_dev_tail_save(di_dsv41_dev_state *s, int32_t slot, void *dst) {
    for (int32_t k = 0; k < s->n_stages; k++) {
        di_status st = part_tail_save(s->ss[k], slot, dst);
        if (st != DI_OK) return st;
    }
    return DI_OK;
}

di_status di_dsv41_dev_tail_restore(di_dsv41_dev_state *s, int32_t slot, int32_t pos,
                                    const void *src, const int32_t *tokens) {
    for (int32_t k = 0; k < s->n_stages; k++) {
        di_status st = part_tail_restore(s->ss[k], slot, pos, src, tokens);
        if (st != DI_OK) {
            // The first stage refuses before anything changes; a later failure leaves the slot
            // to restart at 0 on every stage.
            for (int32_t j = 0; j < k && slot >= 0 && slot < s->ss[j]->n_slots; j++)
                s->ss[j]->n_past[slot] = -1;
            return st;
        }
    }
    return DI_OK;
}

// Why a rollback of n positions is exact (the state after it is the state of a run that never fed
// them, for every later call): every read of the state is a function of the slot's position
// (n_past) and of rows written for positions below it. (1) Window rows: a query at P reads
// positions [P - W + 1, P], those before the call from ring row p mod ring_rows; a call writes
// the last min(n_tok, ring_rows) of its rows, so after the rejected positions [q, q + n) were
// written the rows of positions >= q + n - ring_rows >= q - W (n <= DI_DSV41_ROLLBACK_MAX) are
// still their own, and a kept query (P >= q) reads no older one; rows at or beyond q are
// rewritten by the calls that feed those positions again before any query reads them. (2)
// Entries and index keys: a query sees the first (P + 1) / m entries of a source (n_vis, from
// its position), so entries of groups closed by rejected positions are invisible until their
// group closes again and its finalise overwrites them at the same destination (cached entries,
// edst -1, were never written). (3) A ratio-2 group left open at q (q odd) pools the C and Z of
// position q - 1 from ring row (q - 1) mod CZ_ROWS: written when q - 1 was fed (a call writes the
// last min(n_tok, CZ_ROWS) rows, and q - 1 is within CZ_ROWS of every later call's end up to
// q + n - 1) and overwritten only by position q - 1 + CZ_ROWS > q + n - 1. (4) The Engram
// history of positions >= q is rewritten from the tokens of the calls that feed them. (5) The
// call's lists are a function of the positions only. Before rb_lo (a tail restore, a replay's
// start) the rings hold less than a rollback reads: refused. Successive rollbacks: the argument
// holds with q + n replaced by hw, the highest position fed since that start (rows fed again
// after a rollback do not give back the rows the taken-back ones overwrote), so the bound is
// q >= hw - DI_DSV41_ROLLBACK_MAX, not n <= DI_DSV41_ROLLBACK_MAX per call.
di_status di_dsv41_dev_rollback(di_dsv41_dev_state *s, int32_t slot, int32_t n) {
    const stage_state *s0 = s->ss[0];
    const bool in = slot >= 0 && slot < s0->n_slots;
    int32_t lo = in ? s0->rb_lo[slot] : 0;
    if (in && s0->hw[slot] - DI_DSV41_ROLLBACK_MAX > lo) lo = s0->hw[slot] - DI_DSV41_ROLLBACK_MAX;
    // Back to 0 reads no ring row (the next call starts the slot afresh): always.
    if (!in || s0->n_past[slot] < 0 || n < 0 || n > DI_DSV41_ROLLBACK_MAX || n > s0->n_past[slot] ||
        (s0->n_past[slot] - n > 0 && s0->n_past[slot] - n < lo)) {
        DI_LOG_ERROR("dev forward (V4.1): cannot take back %d positions of slot %d (at %d, back "
                     "to %d at the lowest: the slot's start or %d below the highest position fed "
                     "since, %d)",
                     n, slot, in ? s0->n_past[slot] : -1, lo, DI_DSV41_ROLLBACK_MAX,
                     in ? s0->hw[slot] : -1);
        return DI_ERR_INVALID;
    }
    for (int32_t k = 0; k < s->n_stages; k++) s->ss[k]->n_past[slot] -= n;
    return DI_OK;
}

// ---- DSpark ----

di_status di_dsv41_dev_dspark_enable(di_dsv41_dev_state *all) {
    const di_dsv41_dev *dv = all->d;
    const di_model *m = dv->m;
    const di_hparams *hp = &m->hp;
    stage_state *sl = all->ss[all->n_stages - 1];
    const int64_t D = hp->n_embd, nc = hp->hc_mult, V = hp->n_vocab;
    const int64_t R = sl->max_rows, BS = hp->dspark_block_size, MR = hp->dspark_markov_rank;
    const int64_t nt = hp->n_dspark_target;
    if (sl->dspark) return DI_OK;
    if (sl->d->n_ds < 1 || nt < 1 || BS < 1 || BS > 16) {
        DI_LOG_ERROR("dev forward (V4.1): no DSpark: the model was loaded without its DSpark "
                     "blocks (load it with mtp)");
        return DI_ERR_INVALID;
    }
    if ((nc & (nc - 1)) != 0) {
        DI_LOG_ERROR("dev forward (V4.1): DSpark taps need hc_mult a power of two (is %lld)",
                     (long long)nc);
        return DI_ERR_UNSUPPORTED;
    }
    if ((size_t)(3 * R + R * (hp->window + BS)) + 64 > sl->stage_cap) {
        DI_LOG_ERROR("dev forward (V4.1): DSpark: a draft call's lists do not fit the staging");
        return DI_ERR_INVALID;
    }
    di_status st = DI_OK;
    int32_t *iota = di_malloc(sizeof(int32_t) * (size_t)R);
    float *inv = di_malloc(sizeof(float) * (size_t)(R * nc));
    float *ones = di_malloc(sizeof(float) * HEAD_CHUNK);
    if (!iota || !inv || !ones) {
        st = DI_ERR_NOMEM;
        goto fail;
    }
    for (int64_t t = 0; t < R; t++) iota[t] = (int32_t)t;
    for (int64_t i = 0; i < R * nc; i++) inv[i] = 1.0f / (float)nc;
    for (int i = 0; i < HEAD_CHUNK; i++) ones[i] = 1.0f;
    for (int32_t k = 0; k < all->n_stages; k++) {
        stage_state *s = all->ss[k];
        const dev_stage *d = s->d;
        di_backend *b = d->b;
        // Graphs captured before record no taps and no context rows: captured again.
        for (int g = 0; g < N_GRAPHS; g++) {
            b->vt->graph_destroy(b, s->graphs[g].g);
            s->graphs[g] = (dev_graph){0};
        }
        s->stats.n_cached = 0;
        if (d->taps_here) {
            DI_TRY(st_floats(s, R * nt * D, &s->taps));
            DI_TRY(st_ints(s, R, &s->iota));
            DI_TRY(st_floats(s, R * nc, &s->inv_nc));
            DI_TRY(b->vt->upload(b, s->iota, iota, sizeof(int32_t) * (size_t)R));
            DI_TRY(b->vt->upload(b, s->inv_nc, inv, sizeof(float) * (size_t)(R * nc)));
        }
        if (d->last) {
            if (R * nt * D > s->aq_floats) { // main_proj's A8 input: the taps of every row
                s->aq_floats = R * nt * D;
                DI_TRY(st_floats(s, s->aq_floats, &s->aq));
            }
            const size_t n = (size_t)((int64_t)d->n_ds * s->layer_rows * s->win_bytes);
            DI_TRY(st_alloc(s, n, (void **)&s->dwin)); // zero bytes: Q8 rows of +0
            DI_TRY(b->vt->memset(b, s->dwin, 0, n));
            DI_TRY(st_floats(s, HEAD_CHUNK * V, &s->mk));
            DI_TRY(st_floats(s, HEAD_CHUNK * MR, &s->me));
            DI_TRY(st_floats(s, HEAD_CHUNK, &s->ones));
            DI_TRY(b->vt->upload(b, s->ones, ones, sizeof(float) * HEAD_CHUNK));
            DI_TRY(
                b->vt->host_alloc(b, sizeof(float) * (size_t)(HEAD_CHUNK * MR), (void **)&s->me_h));
            DI_TRY(b->vt->host_alloc(b, sizeof(float) * (size_t)(R * D), (void **)&s->h_h));
            s->ci_h = di_malloc(sizeof(float) * (size_t)(D + MR));
            if (!s->ci_h) {
                st = DI_ERR_NOMEM;
                goto fail;
            }
            s->n_bytes += (int64_t)sizeof(float) * (HEAD_CHUNK * MR + R * D);
        }
        DI_TRY(b->vt->sync(b));
    }
    if (all->n_stages > 1) {
        di_backend *b = dv->st[0]->b;
        DI_TRY(b->vt->host_alloc(b, sizeof(float) * (size_t)(R * nt * D), (void **)&all->th));
    }
    for (int32_t k = 0; k < all->n_stages; k++) all->ss[k]->dspark = true;
    di_free(iota);
    di_free(inv);
    di_free(ones);
    return DI_OK;
fail:
    di_free(iota);
    di_free(inv);
    di_free(ones);
    DI_LOG_ERROR("dev forward (V4.1): DSpark not enabled (%s)", di_status_str(st));
    return st;
}

bool di_dsv41_dev_dspark_on(const di_dsv41_dev_state *s) {
    return s->ss[s->n_stages - 1]->dspark;
}

di_status di_dsv41_dev_draft(di_dsv41_dev_state *all, di_dsv41_dev_draft_seq *seqs, int32_t n,
                             float *logits) {
    stage_state *s = all->ss[all->n_stages - 1];
    const dev_stage *d = s->d;
    const di_model *m = d->m;
    const di_hparams *hp = &m->hp;
    di_backend *b = d->b;
    const int32_t BS = hp->dspark_block_size;
    const int64_t D = hp->n_embd, V = hp->n_vocab, MR = hp->dspark_markov_rank;
    const int64_t W = hp->window, RW = ring_rows(hp), ks = W + BS;
    if (!s->dspark || n < 1 || !seqs || n > HEAD_CHUNK || (int64_t)n * BS > s->max_rows) {
        DI_LOG_ERROR("dev forward (V4.1): a draft call needs DSpark on and 1 .. %d sequences "
                     "(%d block rows each, %d rows at most)",
                     HEAD_CHUNK, BS, s->max_rows);
        return DI_ERR_INVALID;
    }
    memset(s->used, 0, (size_t)s->n_slots);
    for (int32_t i = 0; i < n; i++) {
        const int32_t sl = seqs[i].slot;
        if (sl < 0 || sl >= s->n_slots || s->used[sl] || s->n_past[sl] < 1 || seqs[i].anchor < 0 ||
            seqs[i].anchor >= hp->n_vocab) {
            DI_LOG_ERROR("dev forward (V4.1): draft %d: slot %d (out of range, repeated, or at "
                         "position 0) or anchor %d (the vocabulary has %lld)",
                         i, sl, seqs[i].anchor, (long long)V);
            return DI_ERR_INVALID;
        }
        s->used[sl] = 1;
    }
    // The lists: tokens (the anchor, then noise), positions a .. a + BS - 1, and every row's keys
    // (the slot's ring rows of positions [a - W, a), then its block's rows).
    const int32_t T = n * BS;
    call cl = {.s = s, .n_seq = n, .T = T};
    call *c = &cl;
    c->tokens = 0, c->pos = T, c->nk_win = 2 * (int64_t)T, c->keys = 3 * (int64_t)T;
    c->n_words = (size_t)(3 * (int64_t)T + (int64_t)T * ks);
    int32_t *g = s->stage;
    for (int32_t i = 0; i < n; i++) {
        const int64_t a = s->n_past[seqs[i].slot];
        const int64_t ring0 = (int64_t)s->max_rows + (int64_t)seqs[i].slot * RW;
        const int64_t lo = a - W > 0 ? a - W : 0;
        for (int32_t j = 0; j < BS; j++) {
            const int64_t r = (int64_t)i * BS + j;
            g[c->tokens + r] = j == 0 ? seqs[i].anchor : hp->dspark_noise_token;
            g[c->pos + r] = (int32_t)(a + j);
            g[c->nk_win + r] = (int32_t)(a - lo + BS);
            int32_t *kl = g + c->keys + r * ks;
            for (int64_t p = lo; p < a; p++) kl[p - lo] = (int32_t)(ring0 + p % RW);
            for (int32_t q = 0; q < BS; q++) kl[a - lo + q] = (int32_t)((int64_t)i * BS + q);
        }
        memset(&seqs[i].out, 0, sizeof seqs[i].out);
        seqs[i].out.n = BS;
    }
    di_status st = DI_OK;
    s->stats.last_ops = 0;
    s->stats.last_download_bytes = 0;
    DI_TRY(b->vt->upload(b, s->stage_dev, s->stage, sizeof(int32_t) * c->n_words));
    DI_TRY(draft_rows(c, (int32_t)ks));
    DI_TRY(b->vt->download(b, s->h_h, s->a, sizeof(float) * (size_t)((int64_t)T * D)));
    float *mi = s->ci_h;
    // Block row j of every sequence at once (row j + 1 needs row j's token): the Markov
    // embeddings of the previous tokens (host rows of the BF16 table, as dsv41.c) up, the head,
    // the Markov head and the drafts' argmax on the device, n ids down (the logits only for a
    // caller that asks: n * V floats a row otherwise, 33 MB per block row at 64 slots on
    // V4.1-Flash); the confidence head here (it reads the block's hidden row and the Markov
    // embedding, not the logits).
    for (int32_t j = 0; j < BS && st == DI_OK; j++) {
        for (int32_t i = 0; i < n; i++) {
            const int32_t prev = j == 0 ? seqs[i].anchor : seqs[i].out.tokens[j - 1];
            di_tensor_row_f32(&m->dspark.markov_embed, prev, s->me_h + i * MR);
        }
        st = b->vt->upload(b, s->me, s->me_h, sizeof(float) * (size_t)(n * MR));
        if (st == DI_OK) st = draft_head(c, j, n, BS);
        if (st == DI_OK) st = b->vt->download(b, s->pick_h, s->pick, sizeof(int32_t) * (size_t)n);
        s->stats.last_download_bytes += (int64_t)sizeof(int32_t) * n;
        for (int32_t i = 0; i < n && st == DI_OK && logits; i++) {
            st = b->vt->download(b, logits + ((int64_t)i * BS + j) * V, s->logits + i * V,
                                 sizeof(float) * (size_t)V);
            s->stats.last_download_bytes += (int64_t)sizeof(float) * V;
        }
        for (int32_t i = 0; i < n && st == DI_OK; i++) {
            const int32_t best = s->pick_h[i];
            memcpy(mi, s->h_h + ((int64_t)i * BS + j) * D, sizeof(float) * (size_t)D);
            memcpy(mi + D, s->me_h + i * MR, sizeof(float) * (size_t)MR);
            const float conf = di_ref_dot(m->dspark.confidence, mi, D + MR);
            seqs[i].out.conf_logit[j] = conf;
            seqs[i].out.confidence[j] = di_sigmoid(conf);
            seqs[i].out.tokens[j] = best;
        }
    }
    if (st != DI_OK) goto fail;
    s->stats.n_download_bytes += s->stats.last_download_bytes;
    return DI_OK;
fail:
    DI_LOG_ERROR("dev forward (V4.1): draft call failed (%s)", di_status_str(st));
    return st;
}

int32_t di_dsv41_dev_n_past(const di_dsv41_dev_state *s, int32_t slot) {
    const stage_state *p = s->ss[0];
    return slot >= 0 && slot < p->n_slots ? p->n_past[slot] : -1;
}

void di_dsv41_dev_get_graph_stats(const di_dsv41_dev_state *s, di_dsv41_dev_graph_stats *out) {
    // A call counts once (stage 0's way of running it: every stage decides alike); its costs are
    // the stages' summed.
    di_dsv41_dev_graph_stats g = s->ss[0]->stats;
    g.last_ops = g.last_uploads = g.last_upload_bytes = 0;
    g.n_handover_peer = g.n_handover_host = g.last_handover_bytes = 0;
    g.last_download_bytes = g.n_download_bytes = 0;
    for (int32_t k = 0; k < s->n_stages; k++) {
        g.last_download_bytes += s->ss[k]->stats.last_download_bytes;
        g.n_download_bytes += s->ss[k]->stats.n_download_bytes;
        g.last_ops += s->ss[k]->stats.last_ops;
        g.last_uploads += s->ss[k]->stats.last_uploads;
        g.last_upload_bytes += s->ss[k]->stats.last_upload_bytes;
        g.n_handover_peer += s->ss[k]->stats.n_handover_peer;
        g.n_handover_host += s->ss[k]->stats.n_handover_host;
        g.last_handover_bytes += s->ss[k]->stats.last_handover_bytes;
    }
    *out = g;
}

di_status di_dsv41_dev_forward(di_dsv41_dev_state *s, const di_dsv41_dev_seq *seqs, int32_t n_seq,
                               const int32_t *tokens, const int32_t *logit_rows,
                               int32_t n_logit_rows, float *logits) {
    return di_dsv41_dev_forward_picks(s, seqs, n_seq, tokens, logit_rows, n_logit_rows, logits,
                                      NULL, NULL);
}

di_status di_dsv41_dev_forward_picks(di_dsv41_dev_state *s, const di_dsv41_dev_seq *seqs,
                                     int32_t n_seq, const int32_t *tokens,
                                     const int32_t *logit_rows, int32_t n_logit_rows, float *logits,
                                     const uint8_t *greedy, int32_t *picks) {
    int32_t T = 0;
    di_status st = DI_OK;
    if (greedy && !picks) {
        DI_LOG_ERROR("dev forward (V4.1): greedy rows need somewhere to write their picks");
        return DI_ERR_INVALID;
    }
    for (int32_t k = 0; k < s->n_stages; k++) { // every stage first: nothing runs if one refuses
        st = check_call(s->ss[k], seqs, n_seq, tokens, logit_rows, n_logit_rows, logits, &T);
        if (st != DI_OK) return st;
    }
    for (int32_t k = 0; k < s->n_stages; k++) {
        st = stage_forward(s, k, seqs, n_seq, tokens, logit_rows, n_logit_rows, logits, greedy,
                           picks, T);
        if (st != DI_OK) goto fail;
    }
    return DI_OK;
fail:
    for (int32_t k = 0; k < s->n_stages; k++)
        for (int32_t i = 0; i < n_seq; i++) s->ss[k]->n_past[seqs[i].slot] = -1;
    DI_LOG_ERROR("dev forward (V4.1): call failed (%s); its slots restart at 0", di_status_str(st));
    return st;
}

// Two decode steps of token 0 at position 0 per size (the first runs directly, the second is
// captured, on every stage). Shared blocks: every slot lists block 0 as cached (n_cached =
// block_tokens), so the steps write no entry (an m = 1 source's group at position 0 would close in
// it) and block 0 is left as it was; the graphs do not depend on it (the destinations are per-call
// lists).
di_status di_dsv41_dev_prepare_verify(di_dsv41_dev_state *st_all, int32_t max_seqs,
                                      int32_t max_rows) {
    const stage_state *s = st_all->ss[0];
    if (!s->graphs_on) return DI_OK;
    if (max_rows > GRAPH_ROWS) max_rows = GRAPH_ROWS;
    if (max_rows > s->block_tokens) max_rows = s->block_tokens; // within block 0 (cached)
    int32_t n_max = max_seqs < s->n_slots ? max_seqs : s->n_slots;
    if (n_max > HEAD_CHUNK) n_max = HEAD_CHUNK;
    const int64_t V = s->d->m->hp.n_vocab;
    const int32_t cap = n_max * (max_rows > 1 ? max_rows : 1);
    di_dsv41_dev_seq *seqs = di_malloc(sizeof *seqs * (size_t)(n_max > 0 ? n_max : 1));
    int32_t *ids = di_calloc((size_t)(cap > 0 ? cap : 1), sizeof *ids); // token 0 everywhere
    int32_t *rows = di_malloc(sizeof *rows * (size_t)(cap > 0 ? cap : 1));
    float *logits = di_malloc(sizeof *logits * (size_t)HEAD_CHUNK * (size_t)V);
    di_status st = seqs && ids && rows && logits ? DI_OK : DI_ERR_NOMEM;
    static const int32_t block0 = 0;
    for (int32_t r = 2; r <= max_rows && st == DI_OK; r++)
        for (int32_t n = 1; n <= n_max && n * r <= HEAD_CHUNK && n * r <= s->max_rows &&
                            st == DI_OK && s->graphs_on;
             n++) {
            for (int32_t i = 0; i < n; i++) {
                seqs[i] = (di_dsv41_dev_seq){.slot = i, .pos = 0, .n_tok = r};
                if (s->shared) {
                    seqs[i].blocks = &block0;
                    seqs[i].n_blocks = 1;
                    seqs[i].n_cached = s->block_tokens;
                }
            }
            for (int32_t t = 0; t < n * r; t++) rows[t] = t;
            const dev_graph *g = &s->graphs[(r - 1) * (HEAD_CHUNK + 1) + n];
            for (int pass = 0; pass < 2 && st == DI_OK && !g->g; pass++)
                st = di_dsv41_dev_forward(st_all, seqs, n, ids, rows, n * r, logits);
        }
    di_free(seqs);
    di_free(ids);
    di_free(rows);
    di_free(logits);
    return st;
}

di_status di_dsv41_dev_prepare_decode(di_dsv41_dev_state *st_all, int32_t max_seqs) {
    const stage_state *s = st_all->ss[0];
    if (!s->graphs_on) return DI_OK;
    int32_t n_max = max_seqs < s->n_slots ? max_seqs : s->n_slots;
    if (n_max > HEAD_CHUNK) n_max = HEAD_CHUNK;
    if (n_max > s->max_rows) n_max = s->max_rows;
    if (n_max < 1) return DI_OK;
    const int64_t V = s->d->m->hp.n_vocab;
    di_dsv41_dev_seq *seqs = di_malloc(sizeof *seqs * (size_t)n_max);
    int32_t *ids = di_calloc((size_t)n_max, sizeof *ids); // token 0 everywhere
    int32_t *rows = di_malloc(sizeof *rows * (size_t)n_max);
    float *logits = di_malloc(sizeof *logits * (size_t)n_max * (size_t)V);
    di_status st = seqs && ids && rows && logits ? DI_OK : DI_ERR_NOMEM;
    static const int32_t block0 = 0;
    for (int32_t n = 1; n <= n_max && st == DI_OK && s->graphs_on; n++) {
        for (int32_t i = 0; i < n; i++) {
            seqs[i] = (di_dsv41_dev_seq){.slot = i, .pos = 0, .n_tok = 1};
            if (s->shared) {
                seqs[i].blocks = &block0;
                seqs[i].n_blocks = 1;
                seqs[i].n_cached = s->block_tokens;
            }
            rows[i] = i;
        }
        const dev_graph *g = &s->graphs[n];
        for (int pass = 0; pass < 2 && st == DI_OK && !g->g; pass++)
            st = di_dsv41_dev_forward(st_all, seqs, n, ids, rows, n, logits);
    }
    di_free(seqs);
    di_free(ids);
    di_free(rows);
    di_free(logits);
    return st;
}
