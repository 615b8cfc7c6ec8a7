// dsv4_dev — the device-resident V4 forward on a backend (dsv4_dev.h). It mirrors model/dsv4.c,
// dsv4_attn.c and dsv4_moe.c op for op in the FP32 recipe and in the official one (R-OFF: every
// BF16 rounding, A8 / Q8 / Hadamard + Q4 point of the CPU forward, in the same order, through the
// backend's round_bf16, fake_quant, hadamard, kv_quant and pack_rows (the stored rows and keys)
// and the flags of attn, index_scores and moe);
// where those keep sequential state
// (compressor buffers, rings) this file keeps rows in backend pools and lists on the host which
// rows each op reads. Everything up to the last sections is one pipeline stage (dev_stage,
// stage_state: its layers on its backend; one stage is the whole model); the last sections are
// the public API over the stages (dsv4_dev.h "Pipeline stages"). Sections: weights, state,
// per-call metadata, the layer, checks, decode graphs, the call, the MTP block, tail snapshots,
// pipeline stages, states over the stages, tail snapshots over the stages, model wiring. Over
// 2,000 lines: the stage code and the wrapper share the file-private stage structs, which a split
// would have to expose in a header of their own.
#include "model/dsv4_dev.h"

#include <math.h>
#include <stdint.h> // INT64_MAX
#include <stdio.h>
#include <stdlib.h> // getenv
#include <string.h>

#include "base/log.h"
#include "base/mem.h"
#include "base/status.h"      // DI_TRY
#include "model/dev_common.h" // weight uploads, MoE weights, logit rows
#include "model/dsv4.h"

// Head rows computed at once (bounds the logits scratch [HEAD_CHUNK, V]); also the most rows of a
// decode step run as a graph (one graph per batch size up to min(n_slots, HEAD_CHUNK) and rows per
// sequence up to GRAPH_ROWS, never evicted; 2 rows: a verify of one MTP draft).
enum { HEAD_CHUNK = 64, MAX_CLASSES = 4, GRAPH_ROWS = 2 };
// A page table entry the device may not hold (shared blocks before their first call, or after a
// failed call): never equal to a block id, so the next call that needs it writes it.
enum { PT_UNKNOWN = -2 };

// ---- weights ----

typedef struct dev_hc {
    di_tensor fn;
    float *base, *scale; // backend
} dev_hc;

typedef struct dev_cmp {
    di_tensor wkv, wgate;
    float *ape, *norm; // backend [m, c*d], [d]
    int32_t m, c, d;
} dev_cmp;

typedef struct dev_layer {
    int32_t ratio;
    float *attn_norm, *ffn_norm; // backend [D]
    dev_hc hc_attn, hc_ffn;
    di_tensor wq_a, wq_b, wkv, wo_a, wo_b;
    float *q_norm, *kv_norm, *attn_sink; // backend
    dev_cmp cmp, idx_cmp;
    di_tensor idx_wq_b, idx_weights_proj;
    di_backend_moe_w moe;
} dev_layer;

// One pipeline stage (dsv4_dev.h "Pipeline stages"): the weights of layers [l0, l1) on its
// backend; the embedding on the first stage (and on the last when the MTP block is enabled: its
// input embeds the next tokens), the head, final norm and head mHC (and the MTP block) on the
// last. Layers are indexed by their model index (layers[il] uploaded for il in [l0, l1) only).
typedef struct dev_stage {
    di_model *m;   // borrowed
    di_backend *b; // borrowed
    int32_t l0, l1;
    bool first, last;
    di_tensor embed, head; // embed: first stage (and the last with MTP); head: last stage
    float *norm;           // backend [D]
    dev_hc hc_head;
    float *omega_main, *omega_compress; // backend [n_rot / 2]
    dev_layer *layers;                  // owned [n_layer + 1]: the MTP block at n_layer
    di_dev_up up;                       // the backend blocks it uploaded (freed at destroy)
    bool official;                      // the official precision recipe (R-OFF, spec §2.0)
    // The MTP block (spec §2.10; di_dsv4_dev_mtp_enable): its block is layers[n_layer].
    bool mtp;
    di_tensor mtp_e_proj, mtp_h_proj;
    float *mtp_enorm, *mtp_hnorm, *mtp_norm; // backend [D]
    dev_hc mtp_hc_head;
    int32_t n_states; // states alive (the MTP block is enabled before the first)
} dev_stage;

static di_status up_floats(dev_stage *d, const float *host, int64_t n, float **out) {
    return di_dev_up_floats(&d->up, host, n, out);
}

static di_status up_weight(dev_stage *d, const di_tensor *w, di_tensor *out) {
    return di_dev_up_weight(&d->up, w, out);
}

static di_status up_hc(dev_stage *d, const di_dsv4_hc_w *hc, int32_t n_base, int32_t n_scale,
                       dev_hc *out) {
    di_status st = up_weight(d, &hc->fn, &out->fn);
    if (st == DI_OK) st = up_floats(d, hc->base, n_base, &out->base);
    if (st == DI_OK) st = up_floats(d, hc->scale, n_scale, &out->scale);
    return st;
}

static di_status up_cmp(dev_stage *d, const di_dsv4_compressor_w *cw, dev_cmp *out) {
    out->m = cw->m, out->c = cw->c, out->d = cw->d;
    di_status st = up_weight(d, &cw->wkv, &out->wkv);
    if (st == DI_OK) st = up_weight(d, &cw->wgate, &out->wgate);
    if (st == DI_OK) st = up_floats(d, cw->ape, (int64_t)cw->m * cw->c * cw->d, &out->ape);
    if (st == DI_OK) st = up_floats(d, cw->norm, cw->d, &out->norm);
    return st;
}

static di_status up_layer(dev_stage *d, const di_dsv4_layer_w *lw, dev_layer *out, di_tensor *tmp) {
    const di_model *m = d->m;
    const di_hparams *hp = &m->hp;
    const int32_t nc = hp->hc_mult, D = hp->n_embd;
    di_status st = DI_OK;
    out->ratio = lw->ratio;
    DI_TRY(up_floats(d, lw->attn_norm, D, &out->attn_norm));
    DI_TRY(up_floats(d, lw->ffn_norm, D, &out->ffn_norm));
    DI_TRY(up_hc(d, &lw->hc_attn, (2 + nc) * nc, 3, &out->hc_attn));
    DI_TRY(up_hc(d, &lw->hc_ffn, (2 + nc) * nc, 3, &out->hc_ffn));
    DI_TRY(up_weight(d, &lw->wq_a, &out->wq_a));
    DI_TRY(up_weight(d, &lw->wq_b, &out->wq_b));
    DI_TRY(up_weight(d, &lw->wkv, &out->wkv));
    DI_TRY(up_weight(d, &lw->wo_a, &out->wo_a));
    DI_TRY(up_weight(d, &lw->wo_b, &out->wo_b));
    DI_TRY(up_floats(d, lw->q_norm, hp->q_lora_rank, &out->q_norm));
    DI_TRY(up_floats(d, lw->kv_norm, hp->head_dim, &out->kv_norm));
    DI_TRY(up_floats(d, lw->attn_sink, hp->n_head, &out->attn_sink));
    if (lw->ratio > 0) DI_TRY(up_cmp(d, &lw->cmp, &out->cmp));
    if (lw->ratio == 4) {
        DI_TRY(up_cmp(d, &lw->idx_cmp, &out->idx_cmp));
        DI_TRY(up_weight(d, &lw->idx_wq_b, &out->idx_wq_b));
        DI_TRY(up_weight(d, &lw->idx_weights_proj, &out->idx_weights_proj));
    }
    // MoE: the CPU forward's fields, uploaded (and its recipe: dsv4_moe.c).
    DI_TRY(di_dev_up_moe(&d->up, m, lw, tmp, &out->moe));
    return DI_OK;
fail:
    DI_LOG_ERROR("dev forward: layer %d not uploaded (%s)", lw->il, di_status_str(st));
    return st;
}

static void stage_destroy(dev_stage *d);

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
    d->up = (di_dev_up){.b = b, .who = "dev forward"};
    d->official = m->opt.precision == DI_PRECISION_OFFICIAL;
    d->layers = di_calloc((size_t)hp->n_layer + 1, sizeof *d->layers);
    int32_t max_e = 1;
    for (int il = l0; il < l1; il++)
        if (m->layers[il].n_expert > max_e) max_e = m->layers[il].n_expert;
    tmp = di_calloc((size_t)max_e, sizeof *tmp);
    if (!d->layers || !tmp) {
        st = DI_ERR_NOMEM;
        goto fail;
    }
    const int half = hp->rope_main.n_dims / 2;
    if (first) DI_TRY(up_weight(d, &m->embed, &d->embed));
    if (last) {
        DI_TRY(up_weight(d, &m->head, &d->head));
        DI_TRY(up_floats(d, m->norm, hp->n_embd, &d->norm));
        DI_TRY(up_hc(d, &m->hc_head, hp->hc_mult, 1, &d->hc_head));
    }
    DI_TRY(up_floats(d, m->omega_main, half, &d->omega_main));
    DI_TRY(up_floats(d, m->omega_compress, half, &d->omega_compress));
    for (int il = l0; il < l1; il++) DI_TRY(up_layer(d, &m->layers[il], &d->layers[il], tmp));
    DI_TRY(b->vt->sync(b)); // the host arrays of the uploads may be reused after this
    di_free(tmp);
    *out = d;
    return DI_OK;
fail:
    di_free(tmp);
    stage_destroy(d);
    return st;
}

// The MTP block on the last stage d (the caller checked the model and that no state exists).
static di_status stage_mtp_enable(dev_stage *d) {
    di_model *m = d->m;
    const di_hparams *hp = &m->hp;
    const di_dsv4_mtp_w *mw = &m->mtp[0];
    di_tensor *tmp =
        di_calloc((size_t)(mw->block.n_expert > 1 ? mw->block.n_expert : 1), sizeof *tmp);
    if (!tmp) return DI_ERR_NOMEM;
    di_status st = DI_OK;
    if (!d->first) DI_TRY(up_weight(d, &m->embed, &d->embed)); // the MTP input's embedding
    DI_TRY(up_weight(d, &mw->e_proj, &d->mtp_e_proj));
    DI_TRY(up_weight(d, &mw->h_proj, &d->mtp_h_proj));
    DI_TRY(up_floats(d, mw->enorm, hp->n_embd, &d->mtp_enorm));
    DI_TRY(up_floats(d, mw->hnorm, hp->n_embd, &d->mtp_hnorm));
    DI_TRY(up_floats(d, mw->norm, hp->n_embd, &d->mtp_norm));
    DI_TRY(up_hc(d, &mw->hc_head, hp->hc_mult, 1, &d->mtp_hc_head));
    DI_TRY(up_layer(d, &mw->block, &d->layers[hp->n_layer], tmp));
    DI_TRY(d->b->vt->sync(d->b));
    d->mtp = true;
fail: // what was uploaded stays tracked (freed with d)
    di_free(tmp);
    return st;
}

static void stage_destroy(dev_stage *d) {
    if (!d) return;
    di_dev_up_free(&d->up);
    di_free(d->layers);
    di_free(d);
}

// ---- state ----

// An int array of the call's metadata: a view of the state's one host staging buffer (built per
// call) and the same bytes of its one backend copy (uploaded per call, all arrays at once).
// Placed per call (iarr_place) right after the previous array, for as many elements as the call's
// shape needs, so one upload of the used bytes covers every array; the placement depends on the
// call's shape only, so a decode graph's captured pointers stay right at every replay.
typedef struct iarr {
    void *host; // view into meta_host
    void *dev;  // view into meta_dev
    size_t elem, cap;
} iarr;

// Per distinct compress ratio: the pool layout (every layer of a ratio has the same) and this
// call's lists.
typedef struct ratio_class {
    int32_t ratio;      // 0 (window only), 4 (CSA), else HCA
    int32_t c;          // compressor copies (2: overlapping windows), 0 without compressor
    int32_t cap;        // compressed entries a sequence can have: n_ctx / ratio
    int32_t per_page;   // entries per entry block: block_tokens / ratio
    int64_t entry_base; // KV pool row of entry block 0's first entry: max_rows + n_slots * Wr
    int64_t key_stride; // key list row: W + (CSA: topk, HCA: cap)
    int32_t R;          // a window's token rows (c * ratio)
    int32_t Rr;         // compressor token ring rows per slot: R + the state's ring_extra
    int32_t win_cap;    // windows one call pools (closing ones and padding)
    // Key lists: the host builds each row's window keys (win_keys [rows, W], -1 padded); for
    // compressing ratios `keys` [max_rows, key_stride] (backend) is assembled on the backend at
    // the start of the call (key_lists: the window keys, then HCA's entries 0..cap-1 from off on,
    // through the slot's page table; CSA's top-k go there per layer), so the uploaded bytes per
    // row are W ints, not W + n_ctx / 128. Ratio 0: the window keys are the list (key_stride ==
    // W).
    iarr win_keys, n_keys, win_dst, win_src;
    int32_t *keys; // backend (state block); NULL for ratio 0
    iarr src, ent_pos, ent_dst, ent_dst_idx, ring_dst, ring_src; // compressor
    iarr base, off; // compressing: entry_base, the row's first entry key
    iarr n_vis;     // CSA
    // This call (host scalars the ops get: functions of the call's shape only, never of its
    // positions, so a decode graph replays them for any position; dsv4_dev.h "Graphs"):
    int32_t n_pool; // windows pooled: sum over sequences of (n_tok - 1) / m + 1, the most that
                    // can close; the ones that do not close are padding (no rows, dst -1)
    int32_t n_wd;   // window ring rows written: sum of min(n_tok, W) (one scatter, every sequence)
    int32_t n_rd;   // compressor token ring rows written: sum of min(n_tok, R)
} ratio_class;

typedef struct dev_lstate {
    float *kv;    // FP32 recipe: [max_rows + n_slots * Wr + n_blocks * per_page, Dh]
    uint8_t *kvb; // official: the same rows as KV rows of kv_row_bytes (kv_quant)
    // CSA: the indexer's keys, entry block b's from row b * per_page: FP32 recipe [n_blocks *
    // per_page, DI] floats (idx); official: the same rows as Q4 codes of key_bytes (idxq: e2m1
    // pairs, a UE8M0 scale per DI_BACKEND_KEY_BLOCK dims; pack_rows, index_scores_q4), lossless
    // there (the keys are Q4-rounded, spec §2.5).
    float *idx;
    uint8_t *idxq;
    float *ring_c, *ring_z;   // compressing: [n_slots * Rr, c * d]
    float *iring_c, *iring_z; // CSA indexer compressor
} dev_lstate;

// One stage's part of a state (di_dsv4_dev_state: one per stage): pools, rings, page tables,
// scratch, staging and graphs of the stage's layers; the slots' bookkeeping (n_past, win_lo, ...)
// is kept alike on every stage.
typedef struct stage_state stage_state;
struct stage_state {
    dev_stage *d; // borrowed
    int32_t n_slots, n_ctx, max_rows;
    int32_t *n_past; // owned [n_slots]; -1: must restart at 0
    int32_t *win_lo; // owned [n_slots]: the first position the slot's sequence has (bounded replay)
    // Entry blocks (dsv4_dev.h "State layout"): n_eblocks blocks of block_tokens positions; a
    // slot's page table lists the blocks of its positions, max_blocks of them.
    int32_t block_tokens, max_blocks, n_eblocks;
    bool shared;         // block ids come with each call (the engine's); else private: identity
    int32_t *pages;      // backend [n_slots * max_blocks]: every slot's page table
    int32_t *pages_host; // owned [n_slots * max_blocks]: what the device holds (PT_UNKNOWN: unsure)
    // check_call's scratch (shared blocks): blk_mark[b] == mark when this call writes block b.
    uint32_t *blk_mark; // owned [n_eblocks]
    uint32_t mark;
    iarr pg_off;         // [rows]: the row's slot's page table (slot * max_blocks)
    iarr pt_dst, pt_val; // page table updates of this call: entry index, block id (-1 dst: pad)
    int32_t n_pt;        // updates scattered this call (decode graphs: one per sequence)
    int64_t n_bytes;     // backend bytes allocated
    dev_lstate *ls;      // owned [n_layer + mtp]: the MTP block's window pool at n_layer
    ratio_class cls[MAX_CLASSES];
    int32_t n_cls;
    int8_t *layer_cls; // owned [n_layer]
    // The MTP block (the dev had it enabled at create; dsv4_dev.h "MTP"): its window class (the
    // lists of an MTP call), each slot's MTP position, the main streams kept for it.
    bool mtp;
    ratio_class mtp_cls;
    int32_t *mtp_n_past; // owned [n_slots]: positions the slot's MTP ring consumed (-1: restart)
    iarr mtp_src;        // [rows]: the MTP call's rows' rows of x (the last main call's, or kept)
    int32_t x_rows;      // rows of the last main call whose streams x still holds (0: none)
    float *xmain;        // [max_rows, NC, D]: the MTP call's main streams, gathered from x
    // Rollback (stage_rollback; dsv4_dev.h di_dsv4_dev_state_create_spec): up to back_max rows,
    // every ring ring_extra = back_max - 1 rows longer per slot than it reads (the window rings Wr
    // = W + ring_extra, the token rings Rr = R + ring_extra). Per slot: hw, the end of the highest
    // position its rings were written at since start, the position its run started at (0, win_lo,
    // a tail restore's); a rollback goes back to max(start, hw - back_max) at the lowest. The same
    // for the MTP ring (mtp_hw, mtp_start).
    int32_t back_max, ring_extra, Wr;
    int32_t *hw, *start, *mtp_hw, *mtp_start; // owned [n_slots] each
    // Kept streams (keep_streams, last stage): x holds n_keep = back_max + 1 more rows per slot
    // after its max_rows, the main streams of the slot's last positions (row max_rows + slot *
    // n_keep + pos mod n_keep), written by every main call (its last min(n_tok, n_keep) rows of
    // each sequence: keep_dst / keep_src, n_kd rows); an MTP call's x_rows -1 reads them.
    int32_t n_keep, n_kd;
    iarr keep_dst, keep_src;
    float *ones;   // [max_rows * NC] of 1.0f: post and comb of the MTP's stream add
    int32_t *iota; // [max_rows]: 0, 1, 2, ...
    // scratch (backend), sized for max_rows rows
    float *x, *a, *out, *post, *comb, *mix, *qr, *q, *o, *u, *cc, *cz, *ent, *iq, *iw, *scores;
    float *aq;  // official recipe: A8-quantised linear inputs [max_rows, max(D, Rq, G*Ro)]
    float *kvf; // official recipe: this call's FP32 kv rows [max_rows, Dh] (then kv_quant)
    int64_t kv_row_bytes; // bytes per KV pool row: 4 Dh (FP32 rows) or the KV row format's
    int64_t key_bytes;    // bytes per indexer key: 4 DI (FP32) or its Q4 codes' (official)
    float *hx, *h, *logits;
    // The greedy picks of a head chunk's logit rows (argmax_rows: greedy rows and MTP drafts cross
    // as one id each), last stage: backend [HC] and host (host_alloc, owned) [HC].
    int32_t *pick, *pick_h;
    int32_t *sel;
    int32_t *zeros; // [max_rows] of 0: key_lists' base and offset of the window keys
    int64_t score_stride;
    iarr tokens, pos;
    // Every iarr of a call packed (iarr_place): one host staging buffer and one backend block of
    // meta_cap bytes (every array at its capacity), meta_used of them this call (one upload).
    uint8_t *meta_host; // owned (backend host_alloc)
    void *meta_dev;     // backend block (in blocks)
    size_t meta_cap, meta_used;
    int32_t *row0; // owned host [n_slots]: this call's first row per sequence
    uint8_t *used; // owned host [n_slots]: slot seen in this call
    void **blocks; // owned list of backend blocks
    int32_t n_blocks, cap_blocks;
    // Decode graphs (dsv4_dev.h "Graphs"): entry (r - 1) n_graphs + n - 1 for steps of n
    // sequences of r rows each, n <= n_graphs = min(n_slots, HEAD_CHUNK), r <= GRAPH_ROWS, n r <=
    // HEAD_CHUNK; graph NULL and seen: run once directly (captured the next time).
    bool graphs_on; // DI_DEV_GRAPHS != "0" at create
    struct dev_graph {
        void *graph;   // owned backend graph
        int64_t n_ops; // ops it captured
        bool seen;
    } * graphs; // owned [GRAPH_ROWS * n_graphs]
    int32_t n_graphs;
    di_dsv4_dev_graph_stats stats;
    // Tail snapshots ("tail snapshots" below): the snapshot's bytes gathered from (or scattered
    // into) a slot's rings on the backend, so a save or restore moves one host copy.
    uint8_t
        *tail_dev; // backend block (in blocks): the stage's part of a snapshot (stage_tail_bytes)
};

static di_status st_track(stage_state *s, void *p) {
    if (s->n_blocks == s->cap_blocks) {
        int32_t cap = s->cap_blocks ? 2 * s->cap_blocks : 64;
        void **q = di_realloc(s->blocks, sizeof(void *) * (size_t)cap);
        if (!q) return DI_ERR_NOMEM;
        s->blocks = q;
        s->cap_blocks = cap;
    }
    s->blocks[s->n_blocks++] = p;
    return DI_OK;
}

static di_status st_alloc(stage_state *s, size_t bytes, void **out) {
    di_backend *b = s->d->b;
    void *p = NULL;
    di_status st = b->vt->alloc(b, bytes ? bytes : 1, &p);
    if (st != DI_OK) return st;
    if ((st = st_track(s, p)) != DI_OK) {
        b->vt->free(b, p);
        return st;
    }
    s->n_bytes += (int64_t)(bytes ? bytes : 1);
    *out = p;
    return DI_OK;
}

static di_status st_floats(stage_state *s, int64_t n, float **out) {
    void *p = NULL;
    di_status st = st_alloc(s, sizeof(float) * (size_t)n, &p);
    if (st == DI_OK) *out = p;
    return st;
}

// Arrays start META_ALIGN bytes apart in the packed buffers.
enum { META_ALIGN = 16 };

static size_t meta_round(size_t bytes) {
    return (bytes + META_ALIGN - 1) / META_ALIGN * META_ALIGN;
}

// Reserves an array of up to cap elements in the packed buffers (allocated after every reserve).
static di_status iarr_init(stage_state *s, iarr *a, size_t elem, size_t cap) {
    a->elem = elem;
    a->cap = cap ? cap : 1;
    s->meta_cap += meta_round(elem * a->cap);
    return DI_OK;
}

// Places a for n elements (<= its capacity) after the arrays placed so far in this call.
static void iarr_place(stage_state *s, iarr *a, size_t n) {
    DI_ASSERT(n <= a->cap);
    a->host = s->meta_host + s->meta_used;
    a->dev = (uint8_t *)s->meta_dev + s->meta_used;
    s->meta_used += meta_round(a->elem * n);
    DI_ASSERT(s->meta_used <= s->meta_cap);
}

#define I32(a) ((int32_t *)(a).host)
#define D32(a) ((int32_t *)(a).dev)

static int find_class(const stage_state *s, int32_t ratio) {
    for (int i = 0; i < s->n_cls; i++)
        if (s->cls[i].ratio == ratio) return i;
    return -1;
}

static di_status class_init(stage_state *s, ratio_class *k, const di_dsv4_layer_w *lw) {
    const di_hparams *hp = &s->d->m->hp;
    const int64_t W = hp->window, T = s->max_rows;
    k->ratio = lw->ratio;
    k->c = lw->ratio > 0 ? lw->cmp.c : 0;
    k->cap = lw->ratio > 0 ? s->n_ctx / lw->ratio : 0;
    k->per_page = lw->ratio > 0 ? s->block_tokens / lw->ratio : 0;
    k->entry_base = T + (int64_t)s->n_slots * s->Wr;
    k->key_stride = W + (lw->ratio == 4 ? hp->index_topk : k->cap);
    k->R = k->c * lw->ratio;
    k->Rr = lw->ratio > 0 ? k->R + s->ring_extra : 0;
    // A sequence closes at most n_tok / m + 1 windows in a call, and each needs one of its rows.
    int64_t wc = lw->ratio > 0 ? T / lw->ratio + s->n_slots : 0;
    k->win_cap = (int32_t)(wc < T ? wc : T);
    di_status st = DI_OK;
    DI_TRY(iarr_init(s, &k->win_keys, sizeof(int32_t), (size_t)(T * W)));
    if (lw->ratio > 0) {
        void *p = NULL;
        DI_TRY(st_alloc(s, sizeof(int32_t) * (size_t)(T * k->key_stride), &p));
        k->keys = p;
    }
    DI_TRY(iarr_init(s, &k->n_keys, sizeof(int32_t), (size_t)T));
    DI_TRY(iarr_init(s, &k->win_dst, sizeof(int32_t), (size_t)T));
    DI_TRY(iarr_init(s, &k->win_src, sizeof(int32_t), (size_t)T));
    if (lw->ratio > 0) {
        DI_TRY(iarr_init(s, &k->src, sizeof(int32_t), (size_t)k->win_cap * (size_t)k->R));
        DI_TRY(iarr_init(s, &k->ent_pos, sizeof(int32_t), (size_t)k->win_cap));
        DI_TRY(iarr_init(s, &k->ent_dst, sizeof(int32_t), (size_t)k->win_cap));
        DI_TRY(iarr_init(s, &k->ent_dst_idx, sizeof(int32_t), (size_t)k->win_cap));
        DI_TRY(iarr_init(s, &k->ring_dst, sizeof(int32_t), (size_t)T));
        DI_TRY(iarr_init(s, &k->ring_src, sizeof(int32_t), (size_t)T));
        DI_TRY(iarr_init(s, &k->base, sizeof(int32_t), (size_t)T));
        DI_TRY(iarr_init(s, &k->off, sizeof(int32_t), (size_t)T));
    }
    if (lw->ratio == 4) DI_TRY(iarr_init(s, &k->n_vis, sizeof(int32_t), (size_t)T));
    return DI_OK;
fail:
    return st;
}

// Bytes per KV pool row of d's recipe (dsv4_dev.h di_dsv4_dev_state_kv_row_bytes).
static int64_t row_bytes_of(const dev_stage *d) {
    const di_hparams *hp = &d->m->hp;
    return d->official ? di_backend_kv_row_bytes(hp->head_dim, hp->rope_main.n_dims)
                       : (int64_t)sizeof(float) * hp->head_dim;
}

// Bytes per indexer key of d's recipe (dsv4_dev.h di_dsv4_dev_state_index_key_bytes): FP32 rows,
// or (official) the Q4 codes of backend.h pack_rows (68 at V4's index_head_dim 128).
static int64_t key_bytes_of(const di_model *m) {
    const int64_t DI = m->hp.index_head_dim;
    return m->opt.precision == DI_PRECISION_OFFICIAL
               ? di_backend_code_row_bytes(4, DI, DI_BACKEND_KEY_BLOCK)
               : (int64_t)sizeof(float) * DI;
}

// dsv4_dev.h di_dsv4_dev_block_tokens: over every layer of the model (all stages).
static int32_t model_block_tokens(const di_model *m) {
    const di_hparams *hp = &m->hp;
    int64_t lcm = 1;
    for (int il = 0; il < hp->n_layer; il++) {
        int64_t r = m->layers[il].ratio, a = lcm, b = r;
        if (r <= 0) continue;
        while (b) {
            int64_t t = a % b;
            a = b, b = t;
        }
        lcm = lcm / a * r;
    }
    return (int32_t)(lcm * ((hp->window + lcm - 1) / lcm));
}

// DI_ERR_INVALID (logged) unless block_tokens >= 1 is a multiple of every compress ratio.
static di_status check_block_tokens(const di_model *m, int32_t block_tokens) {
    const di_hparams *hp = &m->hp;
    for (int il = 0; il < hp->n_layer; il++) {
        int32_t r = m->layers[il].ratio;
        if (block_tokens < 1 || (r > 0 && block_tokens % r != 0)) {
            DI_LOG_ERROR("dev state: blocks of %d positions: not a multiple of layer %d's ratio %d",
                         block_tokens, il, r);
            return DI_ERR_INVALID;
        }
    }
    return DI_OK;
}

// One stage's share of di_dsv4_dev_sizes (its layers, its page table; the caller checked the
// arguments).
static void stage_sizes(const dev_stage *d, int32_t n_ctx, int32_t block_tokens,
                        int64_t *block_bytes, int64_t *slot_bytes) {
    const di_hparams *hp = &d->m->hp;
    const int64_t rb = row_bytes_of(d), W = hp->window, f = sizeof(float);
    int64_t blk = 0, slot = (int64_t)sizeof(int32_t) * ((n_ctx + block_tokens - 1) / block_tokens);
    for (int il = d->l0; il < d->l1; il++) {
        const di_dsv4_layer_w *lw = &d->m->layers[il];
        slot += W * rb; // window ring
        if (lw->ratio <= 0) continue;
        const int64_t E = block_tokens / lw->ratio, R = (int64_t)lw->cmp.c * lw->ratio;
        blk += E * rb;
        slot += 2 * R * lw->cmp.c * lw->cmp.d * f; // compressor token rings C and Z
        if (lw->ratio == 4) {
            blk += E * key_bytes_of(d->m);
            slot += 2 * R * lw->idx_cmp.c * lw->idx_cmp.d * f;
        }
    }
    if (d->mtp) slot += W * rb; // the MTP block's window ring
    *block_bytes = blk;
    *slot_bytes = slot;
}

// Entry block `block`'s pieces in their layout order (dsv4_dev.h di_dsv4_dev_state_read_block):
// per compressing layer its E KV pool rows, then for CSA its E indexer keys (FP32 rows or Q4
// codes), each one backend range; fn copies each between the range and the host bytes at *hostp +
// its offset. The stage's layers only: *hostp is advanced past its part (the stages' parts follow
// in layer order).
typedef di_status (*block_copy_fn)(di_backend *b, uint8_t *dev, uint8_t *host, size_t n);
static di_status block_walk(const stage_state *s, int32_t block, uint8_t **hostp,
                            block_copy_fn fn) {
    di_backend *b = s->d->b;
    uint8_t *host = *hostp;
    for (int il = s->d->l0; il < s->d->l1; il++) {
        const ratio_class *k = &s->cls[s->layer_cls[il]];
        const dev_lstate *ls = &s->ls[il];
        if (k->ratio <= 0) continue;
        const int64_t E = k->per_page, row0 = k->entry_base + (int64_t)block * E;
        uint8_t *pool = s->d->official ? ls->kvb : (uint8_t *)ls->kv;
        const size_t n = (size_t)(E * s->kv_row_bytes);
        di_status st = fn(b, pool + row0 * s->kv_row_bytes, host, n);
        if (st != DI_OK) return st;
        host += n;
        if (k->ratio == 4) {
            const size_t ni = (size_t)(E * s->key_bytes);
            uint8_t *keys = s->d->official ? ls->idxq : (uint8_t *)ls->idx;
            st = fn(b, keys + (int64_t)block * E * s->key_bytes, host, ni);
            if (st != DI_OK) return st;
            host += ni;
        }
    }
    *hostp = host;
    return DI_OK;
}

static di_status block_down(di_backend *b, uint8_t *dev, uint8_t *host, size_t n) {
    return b->vt->download(b, host, dev, n);
}

static di_status block_up(di_backend *b, uint8_t *dev, uint8_t *host, size_t n) {
    return b->vt->upload(b, dev, host, n);
}

static void stage_state_destroy(stage_state *s) {
    if (!s) return;
    for (int32_t i = 0; i < GRAPH_ROWS * s->n_graphs; i++)
        s->d->b->vt->graph_destroy(s->d->b, s->graphs[i].graph);
    di_free(s->graphs);
    s->d->b->vt->host_free(s->d->b, s->meta_host); // meta_dev is in the blocks
    s->d->b->vt->host_free(s->d->b, s->pick_h);
    for (int32_t i = 0; i < s->n_blocks; i++) s->d->b->vt->free(s->d->b, s->blocks[i]);
    di_free(s->blocks);
    di_free(s->n_past);
    di_free(s->win_lo);
    di_free(s->pages_host);
    di_free(s->blk_mark);
    di_free(s->ls);
    di_free(s->layer_cls);
    di_free(s->mtp_n_past);
    di_free(s->hw);
    di_free(s->start);
    di_free(s->mtp_hw);
    di_free(s->mtp_start);
    s->d->n_states--;
    di_free(s->row0);
    di_free(s->used);
    di_free(s);
}

static size_t stage_tail_bytes(const dev_stage *d);

// Stage d's part of a state (the caller checked the counts, block_tokens and the spec).
static di_status stage_state_create(dev_stage *d, int32_t n_slots, int32_t n_ctx, int32_t max_rows,
                                    int32_t n_blocks, int32_t block_tokens,
                                    const di_dsv4_dev_spec *spec, stage_state **out) {
    const di_model *m = d->m;
    const di_hparams *hp = &m->hp;
    const int64_t Wr = hp->window + spec->back_max - 1, Dh = hp->head_dim, DI = hp->index_head_dim;
    const int64_t T = max_rows, nc = hp->hc_mult, D = hp->n_embd;
    const int64_t max_blocks = ((int64_t)n_ctx + block_tokens - 1) / block_tokens;
    const int64_t n_eb = n_blocks > 0 ? n_blocks : n_slots * max_blocks;
    // Every pool row index (key lists, scatter rows, page tables) is an int32.
    if (n_eb > INT32_MAX / 2 || n_slots * max_blocks > INT32_MAX / 2) {
        DI_LOG_ERROR("dev state: %lld entry blocks overflow the block index", (long long)n_eb);
        return DI_ERR_INVALID;
    }
    for (int il = 0; il < hp->n_layer; il++) {
        int32_t r = m->layers[il].ratio;
        int64_t rows = T + (int64_t)n_slots * Wr + (r > 0 ? n_eb * (block_tokens / r) : 0);
        if (rows > INT32_MAX / 2) {
            DI_LOG_ERROR("dev state: %lld KV rows per layer overflow the row index",
                         (long long)rows);
            return DI_ERR_INVALID;
        }
    }
    // Official recipe: KV rows of the FP8 format (lossless there: the rows are Q8-exact on the
    // nope dims and BF16 on the rope dims), the compressed entries' rope dims those of the rows.
    const int32_t n_rot = hp->rope_main.n_dims;
    if (d->official && (n_rot % 2 != 0 || Dh <= n_rot || (Dh - n_rot) % 64 != 0 || Dh > 1024 ||
                        hp->rope_compress.n_dims != n_rot)) {
        DI_LOG_ERROR("dev state: head_dim %lld with %d/%d rope dims: no FP8 KV rows", (long long)Dh,
                     n_rot, hp->rope_compress.n_dims);
        return DI_ERR_UNSUPPORTED;
    }
    // ... and its indexer keys Q4 codes (pack_rows: blocks of DI_BACKEND_KEY_BLOCK, <= 1024 dims).
    if (d->official && (DI % DI_BACKEND_KEY_BLOCK != 0 || DI > 1024)) {
        DI_LOG_ERROR("dev state: index_head_dim %lld: no Q4 index keys (a multiple of %d, <= 1024)",
                     (long long)DI, DI_BACKEND_KEY_BLOCK);
        return DI_ERR_UNSUPPORTED;
    }
    di_status st = DI_OK;
    stage_state *s = di_calloc(1, sizeof *s);
    if (!s) return DI_ERR_NOMEM;
    s->d = d;
    s->kv_row_bytes = row_bytes_of(d);
    s->key_bytes = key_bytes_of(m);
    s->n_slots = n_slots, s->n_ctx = n_ctx, s->max_rows = max_rows;
    s->block_tokens = block_tokens;
    s->max_blocks = (int32_t)max_blocks;
    s->n_eblocks = (int32_t)n_eb;
    s->shared = n_blocks > 0;
    // Debug switch (conventions §7): DI_DEV_GRAPHS=0 runs decode steps without graphs, to compare.
    const char *env = getenv("DI_DEV_GRAPHS");
    s->graphs_on = !(env && strcmp(env, "0") == 0);
    const size_t n_pt = (size_t)n_slots * (size_t)max_blocks;
    s->n_past = di_malloc(sizeof(int32_t) * (size_t)n_slots);
    s->win_lo = di_calloc((size_t)n_slots, sizeof(int32_t));
    s->pages_host = di_malloc(sizeof(int32_t) * n_pt);
    s->blk_mark = s->shared ? di_calloc((size_t)n_eb, sizeof(uint32_t)) : NULL;
    s->ls = di_calloc((size_t)hp->n_layer + 1, sizeof *s->ls);
    d->n_states++;                // until destroy (a failed create included)
    s->mtp = spec->mtp && d->mtp; // the last stage's (the MTP block runs there)
    s->back_max = spec->back_max;
    s->ring_extra = spec->back_max - 1;
    s->Wr = (int32_t)Wr;
    s->n_keep = s->mtp && spec->keep_streams ? spec->back_max + 1 : 0;
    s->mtp_n_past = di_calloc((size_t)n_slots, sizeof(int32_t));
    s->hw = di_calloc((size_t)n_slots, sizeof(int32_t));
    s->start = di_calloc((size_t)n_slots, sizeof(int32_t));
    s->mtp_hw = di_calloc((size_t)n_slots, sizeof(int32_t));
    s->mtp_start = di_calloc((size_t)n_slots, sizeof(int32_t));
    s->layer_cls = di_calloc((size_t)hp->n_layer, 1);
    s->row0 = di_calloc((size_t)n_slots, sizeof(int32_t));
    s->used = di_calloc((size_t)n_slots, 1);
    s->n_graphs = n_slots < HEAD_CHUNK ? n_slots : HEAD_CHUNK;
    s->graphs = di_calloc((size_t)(GRAPH_ROWS * s->n_graphs), sizeof *s->graphs);
    if (!s->n_past || !s->win_lo || !s->pages_host || (s->shared && !s->blk_mark) || !s->ls ||
        !s->mtp_n_past || !s->hw || !s->start || !s->mtp_hw || !s->mtp_start || !s->layer_cls ||
        !s->row0 || !s->used || !s->graphs) {
        st = DI_ERR_NOMEM;
        goto fail;
    }
    for (int32_t i = 0; i < n_slots; i++) s->n_past[i] = 0;
    // Page tables: private blocks map slot s's i-th block to s * max_blocks + i, once; shared ones
    // start unknown and get the blocks of each call.
    for (size_t i = 0; i < n_pt; i++) s->pages_host[i] = s->shared ? PT_UNKNOWN : (int32_t)i;
    void *pp = NULL;
    DI_TRY(st_alloc(s, sizeof(int32_t) * n_pt, &pp));
    s->pages = pp;
    DI_TRY(d->b->vt->upload(d->b, s->pages, s->pages_host, sizeof(int32_t) * n_pt));
    int32_t cap4 = 1;
    for (int il = d->l0; il < d->l1; il++) {
        const di_dsv4_layer_w *lw = &m->layers[il];
        int k = find_class(s, lw->ratio);
        if (k < 0) {
            if (s->n_cls == MAX_CLASSES) {
                DI_LOG_ERROR("dev state: more than %d distinct compress ratios", MAX_CLASSES);
                st = DI_ERR_UNSUPPORTED;
                goto fail;
            }
            k = s->n_cls++;
            DI_TRY(class_init(s, &s->cls[k], lw));
        }
        s->layer_cls[il] = (int8_t)k;
        const ratio_class *rc = &s->cls[k];
        // One pool layout per ratio: every layer of a ratio must pool the same way.
        if (lw->ratio > 0 && (lw->cmp.c != rc->c || (lw->ratio == 4 && lw->idx_cmp.c != rc->c))) {
            DI_LOG_ERROR("dev state: layer %d: ratio %d with %d-fold windows, other layers %d", il,
                         lw->ratio, lw->cmp.c, rc->c);
            st = DI_ERR_UNSUPPORTED;
            goto fail;
        }
        dev_lstate *ls = &s->ls[il];
        // Rows: this call's, every slot's window ring, every entry block's entries.
        const int64_t pool_rows = rc->entry_base + n_eb * rc->per_page;
        if (d->official) {
            void *kp = NULL;
            DI_TRY(st_alloc(s, (size_t)(pool_rows * s->kv_row_bytes), &kp));
            ls->kvb = kp;
        } else {
            DI_TRY(st_floats(s, pool_rows * Dh, &ls->kv));
        }
        if (lw->ratio > 0) {
            int64_t n = (int64_t)n_slots * rc->Rr * lw->cmp.c * lw->cmp.d;
            DI_TRY(st_floats(s, n, &ls->ring_c));
            DI_TRY(st_floats(s, n, &ls->ring_z));
        }
        if (lw->ratio == 4) {
            int64_t n = (int64_t)n_slots * rc->Rr * lw->idx_cmp.c * lw->idx_cmp.d;
            DI_TRY(st_floats(s, n, &ls->iring_c));
            DI_TRY(st_floats(s, n, &ls->iring_z));
            if (d->official) { // Q4 codes (pack_rows)
                void *kp = NULL;
                DI_TRY(st_alloc(s, (size_t)(n_eb * rc->per_page * s->key_bytes), &kp));
                ls->idxq = kp;
            } else {
                DI_TRY(st_floats(s, n_eb * rc->per_page * DI, &ls->idx));
            }
            if (rc->cap > cap4) cap4 = rc->cap;
        }
    }
    if (s->mtp) { // the MTP block's window class and pool: this call's rows, the slots' rings
        DI_TRY(class_init(s, &s->mtp_cls, &m->mtp[0].block));
        dev_lstate *ls = &s->ls[hp->n_layer];
        const int64_t pool_rows = s->mtp_cls.entry_base;
        if (d->official) {
            void *kp = NULL;
            DI_TRY(st_alloc(s, (size_t)(pool_rows * s->kv_row_bytes), &kp));
            ls->kvb = kp;
        } else {
            DI_TRY(st_floats(s, pool_rows * Dh, &ls->kv));
        }
        DI_TRY(iarr_init(s, &s->mtp_src, sizeof(int32_t), (size_t)T));
        DI_TRY(st_floats(s, T * nc * D, &s->xmain));
        DI_TRY(st_floats(s, T * nc, &s->ones));
        void *ip = NULL;
        DI_TRY(st_alloc(s, sizeof(int32_t) * (size_t)T, &ip));
        s->iota = ip;
        // Filled once from host arrays (create may allocate; nothing per step).
        float *one = di_malloc(sizeof(float) * (size_t)(T * nc));
        int32_t *io = di_malloc(sizeof(int32_t) * (size_t)T);
        if (!one || !io) st = DI_ERR_NOMEM;
        for (int64_t i = 0; one && i < T * nc; i++) one[i] = 1.0f;
        for (int64_t i = 0; io && i < T; i++) io[i] = (int32_t)i;
        if (st == DI_OK)
            st = d->b->vt->upload(d->b, s->ones, one, sizeof(float) * (size_t)(T * nc));
        if (st == DI_OK) st = d->b->vt->upload(d->b, s->iota, io, sizeof(int32_t) * (size_t)T);
        if (st == DI_OK) st = d->b->vt->sync(d->b); // the host arrays go now
        di_free(one);
        di_free(io);
        if (st != DI_OK) goto fail;
    }
    const int64_t H = hp->n_head, Rq = hp->q_lora_rank, G = hp->o_groups, Ro = hp->o_lora_rank;
    const int64_t HI = hp->n_index_head, cw = 2 * (Dh > DI ? Dh : DI);
    const int64_t HC = T < HEAD_CHUNK ? T : HEAD_CHUNK;
    int64_t n_win_max = 1;
    for (int i = 0; i < s->n_cls; i++)
        if (s->cls[i].win_cap > n_win_max) n_win_max = s->cls[i].win_cap;
    s->score_stride = cap4;
    // x: this call's rows, then (kept streams) every slot's last n_keep positions' streams.
    DI_TRY(st_floats(s, (T + (int64_t)n_slots * s->n_keep) * nc * D, &s->x));
    if (s->n_keep > 0) {
        DI_TRY(iarr_init(s, &s->keep_dst, sizeof(int32_t), (size_t)T));
        DI_TRY(iarr_init(s, &s->keep_src, sizeof(int32_t), (size_t)T));
    }
    DI_TRY(st_floats(s, T * D, &s->a));
    DI_TRY(st_floats(s, T * D, &s->out));
    DI_TRY(st_floats(s, T * nc, &s->post));
    DI_TRY(st_floats(s, T * nc * nc, &s->comb));
    DI_TRY(st_floats(s, T * (2 + nc) * nc, &s->mix));
    DI_TRY(st_floats(s, T * Rq, &s->qr));
    DI_TRY(st_floats(s, T * H * Dh, &s->q));
    DI_TRY(st_floats(s, T * H * Dh, &s->o));
    DI_TRY(st_floats(s, T * G * Ro, &s->u));
    DI_TRY(st_floats(s, T * cw, &s->cc));
    DI_TRY(st_floats(s, T * cw, &s->cz));
    DI_TRY(st_floats(s, n_win_max * (Dh > DI ? Dh : DI), &s->ent));
    DI_TRY(st_floats(s, T * HI * DI, &s->iq));
    DI_TRY(st_floats(s, T * HI, &s->iw));
    DI_TRY(st_floats(s, T * cap4, &s->scores));
    if (d->last) { // the head's
        DI_TRY(st_floats(s, HC * nc * D, &s->hx));
        DI_TRY(st_floats(s, HC * D, &s->h));
        DI_TRY(st_floats(s, HC * hp->n_vocab, &s->logits));
        void *pk = NULL;
        DI_TRY(st_alloc(s, sizeof(int32_t) * (size_t)HC, &pk));
        s->pick = pk;
        DI_TRY(d->b->vt->host_alloc(d->b, sizeof(int32_t) * (size_t)HC, &pk));
        s->pick_h = pk;
    }
    if (d->official) {
        int64_t w = D > Rq ? D : Rq;
        if (G * Ro > w) w = G * Ro;
        DI_TRY(st_floats(s, T * w, &s->aq));
        DI_TRY(st_floats(s, T * Dh, &s->kvf));
    }
    void *p = NULL;
    DI_TRY(st_alloc(s, sizeof(int32_t) * (size_t)T * (size_t)hp->index_topk, &p));
    s->sel = p;
    DI_TRY(st_alloc(s, sizeof(int32_t) * (size_t)T, &p));
    s->zeros = p;
    DI_TRY(d->b->vt->memset(d->b, s->zeros, 0, sizeof(int32_t) * (size_t)T));
    DI_TRY(iarr_init(s, &s->tokens, sizeof(int32_t), (size_t)T));
    DI_TRY(iarr_init(s, &s->pos, sizeof(int32_t), (size_t)T));
    DI_TRY(iarr_init(s, &s->pg_off, sizeof(int32_t), (size_t)T));
    DI_TRY(iarr_init(s, &s->pt_dst, sizeof(int32_t), s->shared ? n_pt : 0));
    DI_TRY(iarr_init(s, &s->pt_val, sizeof(int32_t), s->shared ? n_pt : 0));
    {
        void *tp = NULL;
        DI_TRY(st_alloc(s, stage_tail_bytes(d), &tp));
        s->tail_dev = tp;
    }
    // The packed metadata: every array reserved above, at its capacity.
    DI_TRY(st_alloc(s, s->meta_cap, &s->meta_dev));
    { // the backend's host memory: uploaded every call (page-locked on CUDA)
        void *mh = NULL;
        DI_TRY(d->b->vt->host_alloc(d->b, s->meta_cap, &mh));
        s->meta_host = mh;
    }
    *out = s;
    return DI_OK;
fail:
    if (st == DI_ERR_NOMEM)
        DI_LOG_ERROR("dev state: cannot allocate %d slots x %d positions, %d rows, %lld entry "
                     "blocks on %s",
                     n_slots, n_ctx, max_rows, (long long)n_eb, d->b->desc);
    stage_state_destroy(s);
    return st;
}

static void stage_graph_stats(const stage_state *s, di_dsv4_dev_graph_stats *out) {
    *out = s->stats;
    out->n_cached = 0;
    for (int32_t i = 0; i < GRAPH_ROWS * s->n_graphs; i++)
        out->n_cached += s->graphs[i].graph != NULL;
}

// ---- per-call metadata (host lists of rows, uploaded once per call) ----

// The KV pool row of position q of sequence i (first position p0 this call, first row r0): this
// call's row, or the slot's ring (row = q mod Wr, its Wr rows).
static inline int32_t win_row(int64_t q, int64_t p0, int32_t r0, int64_t ring0, int64_t Wr) {
    return (int32_t)(q >= p0 ? r0 + (q - p0) : ring0 + q % Wr);
}

// Compressor source of position q: this call's row (>= 0) or the slot's token ring of Rr rows
// (-(row) - 1).
static inline int32_t cmp_src(int64_t q, int64_t p0, int32_t r0, int64_t ring0, int64_t Rr) {
    if (q < 0) return DI_BACKEND_NO_ROW;
    return (int32_t)(q >= p0 ? r0 + (q - p0) : -(ring0 + q % Rr) - 1);
}

static void build_class(stage_state *s, ratio_class *k, const di_dsv4_dev_seq *seqs,
                        int32_t n_seq) {
    const di_hparams *hp = &s->d->m->hp;
    const int64_t W = hp->window, Wr = s->Wr, T = s->max_rows;
    const int32_t ratio = k->ratio, topk = hp->index_topk;
    // The lists' lengths (functions of the call's shape: n_tok per sequence), then every list
    // placed in the packed buffers for them.
    int32_t n_call = 0;
    k->n_wd = k->n_rd = k->n_pool = 0;
    for (int32_t i = 0; i < n_seq; i++) {
        const int32_t n = seqs[i].n_tok;
        n_call += n;
        k->n_wd += n < Wr ? n : (int32_t)Wr;
        if (ratio <= 0) continue;
        k->n_rd += n < k->Rr ? n : k->Rr;
        k->n_pool += (n - 1) / ratio + 1; // n positions close at most this many windows
    }
    iarr_place(s, &k->win_keys, (size_t)n_call * (size_t)W);
    iarr_place(s, &k->n_keys, (size_t)n_call);
    iarr_place(s, &k->win_dst, (size_t)k->n_wd);
    iarr_place(s, &k->win_src, (size_t)k->n_wd);
    if (ratio > 0) {
        iarr_place(s, &k->src, (size_t)k->n_pool * (size_t)k->R);
        iarr_place(s, &k->ent_pos, (size_t)k->n_pool);
        iarr_place(s, &k->ent_dst, (size_t)k->n_pool);
        iarr_place(s, &k->ent_dst_idx, (size_t)k->n_pool);
        iarr_place(s, &k->ring_dst, (size_t)k->n_rd);
        iarr_place(s, &k->ring_src, (size_t)k->n_rd);
        iarr_place(s, &k->base, (size_t)n_call);
        iarr_place(s, &k->off, (size_t)n_call);
    }
    if (ratio == 4) iarr_place(s, &k->n_vis, (size_t)n_call);
    int32_t *ki = I32(k->win_keys), *nk = I32(k->n_keys), *wd = I32(k->win_dst);
    int32_t *ws = I32(k->win_src);
    int32_t n_wd = 0, n_rd = 0, n_win = 0;
    for (int32_t i = 0; i < n_seq; i++) {
        const di_dsv4_dev_seq *sq = &seqs[i];
        const int64_t p0 = sq->pos, ring0 = T + (int64_t)sq->slot * Wr;
        const int32_t r0 = s->row0[i];
        // The slot's page table as this call leaves it (the updates are applied first).
        const int32_t *pt = s->pages_host + (int64_t)sq->slot * s->max_blocks;
        // Key lists: window positions max(P - W + 1, win_lo)..P (the host), then the entries
        // from off on, appended on the backend through the slot's page table: HCA's first
        // (P + 1) / m (key_lists), CSA's top-k of the indexer (offset_list per layer).
        for (int32_t t = 0; t < sq->n_tok; t++) {
            const int64_t P = p0 + t, w_lo = P - W + 1 > sq->win_lo ? P - W + 1 : sq->win_lo;
            int32_t *row = ki + (int64_t)(r0 + t) * W, n = 0;
            for (int64_t q = w_lo; q <= P; q++) row[n++] = win_row(q, p0, r0, ring0, Wr);
            for (int64_t j = n; j < W; j++) row[j] = -1; // past the window: copied, never read
            if (ratio > 0) {
                I32(k->base)[r0 + t] = (int32_t)k->entry_base;
                I32(k->off)[r0 + t] = n;
            }
            if (ratio == 4) {
                I32(k->n_vis)[r0 + t] = (int32_t)((P + 1) / 4);
                n += topk;
            } else if (ratio > 0) {
                n += (int32_t)((P + 1) / ratio);
            }
            nk[r0 + t] = n;
        }
        // The window ring after attention: the last min(n_tok, Wr) rows, from this call's rows
        // (all Wr: a rollback of up to back_max rows reads the ring down to its new position - W).
        for (int32_t t = sq->n_tok > Wr ? sq->n_tok - (int32_t)Wr : 0; t < sq->n_tok; t++) {
            ws[n_wd] = r0 + t;
            wd[n_wd++] = (int32_t)(ring0 + (p0 + t) % Wr);
        }
        if (ratio <= 0) continue;
        // Windows closing in this call (model/dsv4_attn.c compressor_step): slots j < m are the
        // overlap (window w - 1, c == 2) or the window itself (c == 1), slots m..2m-1 window w.
        // Entry w goes to its block's rows (entry block pt[w / per_page], w % per_page in it);
        // an entry the prefix cache holds (w < n_cached / m) stays untouched: nothing rewrites a
        // shared block, and the window is pooled for nothing (destination -1).
        const int32_t m = ratio, c = k->c, R = k->R, Rr = k->Rr, E = k->per_page;
        const int64_t cring0 = (int64_t)sq->slot * Rr, w_cached = sq->n_cached / m;
        for (int64_t P = p0; P < p0 + sq->n_tok; P++) {
            if ((P + 1) % m != 0) continue;
            const int64_t w = P / m;
            int32_t *src = I32(k->src) + (int64_t)n_win * R;
            for (int32_t j = 0; j < c * m; j++) {
                int64_t q = c == 2 ? (w - 1) * m + j : w * m + j;
                src[j] = cmp_src(q, p0, r0, cring0, Rr);
            }
            const int64_t e = w < w_cached ? -1 : (int64_t)pt[w / E] * E + w % E;
            I32(k->ent_pos)[n_win] = (int32_t)(w * m);
            I32(k->ent_dst)[n_win] = e < 0 ? -1 : (int32_t)(k->entry_base + e);
            I32(k->ent_dst_idx)[n_win] = (int32_t)e;
            n_win++;
        }
        // The compressor token ring after pooling: the last min(n_tok, Rr) rows.
        for (int32_t t = sq->n_tok > Rr ? sq->n_tok - Rr : 0; t < sq->n_tok; t++) {
            I32(k->ring_src)[n_rd] = r0 + t;
            I32(k->ring_dst)[n_rd++] = (int32_t)(cring0 + (p0 + t) % Rr);
        }
    }
    DI_ASSERT(n_wd == k->n_wd && n_rd == k->n_rd);
    // Padding up to n_pool: windows without rows (entry 0), scattered nowhere.
    DI_ASSERT(n_win <= k->n_pool && k->n_pool <= k->win_cap);
    for (int32_t w = n_win; w < k->n_pool; w++) {
        int32_t *src = I32(k->src) + (int64_t)w * k->R;
        for (int32_t j = 0; j < k->R; j++) src[j] = DI_BACKEND_NO_ROW;
        I32(k->ent_pos)[w] = 0;
        I32(k->ent_dst)[w] = -1;
        I32(k->ent_dst_idx)[w] = -1;
    }
}

// ---- the layer ----

typedef struct call {
    stage_state *s;
    const di_dsv4_dev_seq *seqs;
    int32_t n_seq, T;
} call;

#define B (c->s->d->b)
// An op enqueued on the backend (counted: stats.last_ops).
#define OP(name, ...)                                                                              \
    do {                                                                                           \
        c->s->stats.last_ops++;                                                                    \
        DI_TRY(B->vt->name(B, __VA_ARGS__));                                                       \
    } while (0)
// A rounding point of the official recipe (model/dsv4.c di_dsv4_round): n floats from x to BF16;
// nothing in the FP32 recipe.
#define ROUND(x_, n_)                                                                              \
    do {                                                                                           \
        if (c->s->d->official) OP(round_bf16, (x_), (int64_t)(n_));                                \
    } while (0)

// y = W x for the call's rows (model/dsv4_attn.c di_dsv4_linear): in the official recipe FP8/FP4
// weights with act_quant see A8(x) (Q8, blocks of 128; matmul_a8 with the state's aq scratch, rows
// xs apart like x; FP8 tensor cores for prefill on CUDA) and the output rows (contiguous: ys ==
// W's rows) are rounded to BF16.
static di_status linear(const call *c, const di_tensor *w, const float *x, int64_t xs, float *y,
                        int64_t ys, bool act_quant) {
    stage_state *s = c->s;
    const int64_t N = w->ne[1];
    di_status st = DI_OK;
    if (s->d->official && act_quant &&
        (w->kind == DI_TENSOR_KIND_FP8 || w->kind == DI_TENSOR_KIND_FP4))
        OP(matmul_a8, w, x, c->T, xs, s->aq, y, ys);
    else
        OP(matmul, w, x, c->T, xs, y, ys);
    DI_ASSERT(!s->d->official || ys == N);
    ROUND(y, (int64_t)c->T * N);
    return DI_OK;
fail:
    return st;
}

// One compressor on this call's rows (model/dsv4_attn.c run_compressor + compressor_step):
// project C and Z, add the position bias, pool every closing window from this call's rows and the
// ring, normalise and rotate the entries, scatter them into their pool, then ring the last tokens.
// Official recipe (dsv4_attn.c finalise_entry): the entries are rounded to BF16 around the norm
// and the rotation, then Q8 on the nope dims (main) or Hadamard, BF16 and Q4 (indexer); the main
// entries go into their KV rows by kv_quant (lossless: they are Q8-exact), the indexer's are
// packed as Q4 codes by pack_rows, which rounds them exactly as fake_quant's Q4 does (quant_ref.h
// di_quant_q4_pack): the codes decode to the CPU forward's keys bit for bit.
// pool: FP32 rows pool_stride floats apart, or (official) KV rows (main) / Q4 codes (indexer).
static di_status compressor(const call *c, const dev_cmp *cw, const ratio_class *k, const float *a,
                            bool indexer, float *ring_c, float *ring_z, void *pool,
                            int64_t pool_stride, const int32_t *ent_dst) {
    stage_state *s = c->s;
    const di_hparams *hp = &s->d->m->hp;
    const int64_t width = (int64_t)cw->c * cw->d, D = hp->n_embd;
    di_status st = DI_OK;
    OP(matmul, &cw->wkv, a, c->T, D, s->cc, width);   // C: [T, c*d]
    OP(matmul, &cw->wgate, a, c->T, D, s->cz, width); // Z: [T, c*d]
    OP(add_ape, s->cz, c->T, width, width, cw->ape, D32(s->pos), cw->m);
    // Every window that may close in a call of this shape (padding: entry 0, scattered nowhere).
    OP(compress_pool, s->cc, s->cz, width, ring_c, ring_z, D32(k->src), k->n_pool, cw->m, cw->c,
       cw->d, s->ent); // entries: [n_pool, d]
    const int64_t n_ent = (int64_t)k->n_pool * cw->d;
    const int32_t n_rot = hp->rope_compress.n_dims;
    ROUND(s->ent, n_ent);
    OP(rmsnorm, s->ent, k->n_pool, cw->d, cw->d, cw->norm, hp->norm_eps);
    ROUND(s->ent, n_ent);
    OP(rope, s->ent, k->n_pool, cw->d, cw->d, n_rot, s->d->omega_compress, D32(k->ent_pos), 1,
       hp->rope_compress.attention_factor, false);
    ROUND(s->ent, n_ent);
    if (s->d->official && indexer) {
        OP(hadamard, s->ent, k->n_pool, cw->d);
        ROUND(s->ent, n_ent);
        OP(pack_rows, s->ent, k->n_pool, cw->d, (int32_t)cw->d, DI_BACKEND_KEY_BLOCK, 4,
           (uint8_t *)pool, ent_dst, NULL); // Q4 in blocks of 32, as codes
    } else if (s->d->official) {
        OP(fake_quant, s->ent, k->n_pool, cw->d - n_rot, cw->d, 64, 8, s->ent);
        OP(kv_quant, s->ent, k->n_pool, cw->d, (int32_t)cw->d, n_rot, (uint8_t *)pool, ent_dst);
    } else {
        OP(scatter_rows, s->ent, k->n_pool, cw->d, cw->d, (float *)pool, pool_stride, ent_dst,
           NULL);
    }
    // Every sequence's last min(n_tok, Rr) token rows into its ring: one gather-scatter each.
    OP(scatter_rows, s->cc, k->n_rd, width, width, ring_c, width, D32(k->ring_dst),
       D32(k->ring_src));
    OP(scatter_rows, s->cz, k->n_rd, width, width, ring_z, width, D32(k->ring_dst),
       D32(k->ring_src));
    return DI_OK;
fail:
    return st;
}

static di_status attention(const call *c, int il, const float *a, float *out) {
    stage_state *s = c->s;
    const dev_stage *d = s->d;
    const di_hparams *hp = &d->m->hp;
    const dev_layer *lw = &d->layers[il];
    const dev_lstate *ls = &s->ls[il];
    const ratio_class *k = il < hp->n_layer ? &s->cls[s->layer_cls[il]] : &s->mtp_cls;
    const int64_t D = hp->n_embd, H = hp->n_head, Dh = hp->head_dim, Rq = hp->q_lora_rank;
    const int64_t G = hp->o_groups, Ro = hp->o_lora_rank;
    const int32_t n_rot = hp->rope_main.n_dims, T = c->T;
    const bool compress = lw->ratio > 0;
    const float *omega = compress ? d->omega_compress : d->omega_main;
    const float rscale =
        compress ? hp->rope_compress.attention_factor : hp->rope_main.attention_factor;
    const int32_t *pos = D32(s->pos);
    di_status st = DI_OK;

    const bool official = d->official;
    // q path: qr = RMSNorm(wq_a a); q = per-head RMS(wq_b qr); RoPE.
    DI_TRY(linear(c, &lw->wq_a, a, D, s->qr, Rq, true)); // qr: [T, Rq]
    OP(rmsnorm, s->qr, T, Rq, Rq, lw->q_norm, hp->norm_eps);
    ROUND(s->qr, T * Rq);
    DI_TRY(linear(c, &lw->wq_b, s->qr, Rq, s->q, H * Dh, true)); // q: [T, H, Dh]
    OP(rmsnorm, s->q, T * H, Dh, Dh, NULL, hp->norm_eps);
    OP(rope, s->q, T * H, Dh, Dh, n_rot, omega, pos, (int32_t)H, rscale, false);
    ROUND(s->q, T * H * Dh);
    // kv path: straight into this call's rows of the layer's KV pool (official: BF16, then Q8 of
    // the nope dims in blocks of 64, so the rows hold Q8-exact values, then encoded losslessly as
    // KV rows into the call's rows of the pool).
    float *kv = official ? s->kvf : ls->kv; // [T, Dh]
    DI_TRY(linear(c, &lw->wkv, a, D, kv, Dh, true));
    OP(rmsnorm, kv, T, Dh, Dh, lw->kv_norm, hp->norm_eps);
    ROUND(kv, T * Dh);
    OP(rope, kv, T, Dh, Dh, n_rot, omega, pos, 1, rscale, false);
    ROUND(kv, T * Dh);
    if (official) {
        OP(fake_quant, kv, T, Dh - n_rot, Dh, 64, 8, kv);
        OP(kv_quant, kv, T, Dh, (int32_t)Dh, n_rot, ls->kvb, NULL);
    }

    // CSA: the indexer (its compressor, q, weights, scores, top-k appended to the key lists).
    if (lw->ratio == 4) {
        const int64_t HI = hp->n_index_head, DI = hp->index_head_dim;
        DI_TRY(compressor(c, &lw->idx_cmp, k, a, true, ls->iring_c, ls->iring_z,
                          official ? (void *)ls->idxq : (void *)ls->idx, DI, D32(k->ent_dst_idx)));
        DI_TRY(linear(c, &lw->idx_wq_b, s->qr, Rq, s->iq, HI * DI, true)); // qi: [T, HI, DI]
        OP(rope, s->iq, T * HI, DI, DI, n_rot, d->omega_compress, pos, (int32_t)HI,
           hp->rope_compress.attention_factor, false);
        ROUND(s->iq, T * HI * DI);
        if (official) { // Hadamard, BF16, Q4 in blocks of 32
            OP(hadamard, s->iq, T * HI, DI);
            ROUND(s->iq, T * HI * DI);
            OP(fake_quant, s->iq, T * HI, DI, DI, 32, 4, s->iq);
        }
        DI_TRY(linear(c, &lw->idx_weights_proj, a, D, s->iw, HI, false)); // wi: [T, HI]
        OP(scale, s->iw, T * HI, 1.0f / sqrtf((float)DI) / sqrtf((float)HI));
        ROUND(s->iw, T * HI);
        // max_vis: the slot capacity (a bound independent of the positions). Official: the keys'
        // Q4 codes, each decoded exactly (the same scores as on the FP32 keys), BF16 scores.
        if (official)
            OP(index_scores_q4, s->iq, s->iw, ls->idxq, NULL, s->pages, D32(s->pg_off), k->per_page,
               D32(k->n_vis), k->cap, T, (int32_t)HI, (int32_t)DI, true, s->scores,
               s->score_stride);
        else
            OP(index_scores, s->iq, s->iw, ls->idx, NULL, s->pages, D32(s->pg_off), k->per_page,
               D32(k->n_vis), k->cap, T, (int32_t)HI, (int32_t)DI, false, s->scores,
               s->score_stride);
        OP(topk, s->scores, s->score_stride, D32(k->n_vis), T, hp->index_topk, s->sel);
        OP(offset_list, s->sel, T, hp->index_topk, D32(k->base), D32(k->off), s->pages,
           D32(s->pg_off), k->per_page, k->keys, k->key_stride);
    }
    // CSA and HCA: the main compressor, before the attention of the same tokens.
    if (compress)
        DI_TRY(compressor(c, &lw->cmp, k, a, false, ls->ring_c, ls->ring_z,
                          official ? (void *)ls->kvb : (void *)ls->kv, Dh, D32(k->ent_dst)));

    // max_keys: the key list capacity (a bound independent of the positions). Official: p
    // normalised, then rounded to BF16.
    const int32_t *keys = k->keys ? k->keys : D32(k->win_keys);
    if (official) // KV rows, each decoded exactly
        OP(attn_kv, s->q, ls->kvb, keys, k->key_stride, D32(k->n_keys), (int32_t)k->key_stride,
           lw->attn_sink, T, (int32_t)H, (int32_t)Dh, n_rot, 1.0f / sqrtf((float)Dh), true,
           s->o); // o: [T, H, Dh]
    else
        OP(attn, s->q, ls->kv, keys, k->key_stride, D32(k->n_keys), (int32_t)k->key_stride,
           lw->attn_sink, T, (int32_t)H, (int32_t)Dh, 1.0f / sqrtf((float)Dh), false, s->o);
    ROUND(s->o, T * H * Dh);
    OP(rope, s->o, T * H, Dh, Dh, n_rot, omega, pos, (int32_t)H, rscale, true);
    ROUND(s->o, T * H * Dh);

    // Grouped output: u_g = wo_a[g] . (o of the heads of group g); out = wo_b . u. wo_a has no
    // activation quant (spec §5.17); its rounding is done once for all groups.
    const int64_t group_in = H * Dh / G;
    for (int64_t g = 0; g < G; g++) {
        di_tensor wg = di_tensor_rows(&lw->wo_a, g * Ro, Ro);
        OP(matmul, &wg, s->o + g * group_in, T, H * Dh, s->u + g * Ro, G * Ro);
    }
    ROUND(s->u, T * G * Ro);
    DI_TRY(linear(c, &lw->wo_b, s->u, G * Ro, out, D, true));

    // Each sequence's last min(n_tok, Wr) kv rows (this call's rows of the pool) into its window
    // ring, after every read of the ring: one gather-scatter for every sequence.
    // Official: the KV rows as rows of 32-bit words (scatter_rows copies bits).
    const int64_t rw = s->kv_row_bytes / (int64_t)sizeof(float);
    float *pool = official ? (float *)ls->kvb : ls->kv;
    OP(scatter_rows, pool, k->n_wd, rw, rw, pool, rw, D32(k->win_dst), D32(k->win_src));
    return DI_OK;
fail:
    return st;
}

// mHC pre of one site (fn matmul, then coefficients and the collapse into a), then the norm.
static di_status hc_pre(const call *c, const dev_hc *hc, const float *norm) {
    stage_state *s = c->s;
    const di_hparams *hp = &s->d->m->hp;
    const int64_t nc = hp->hc_mult, D = hp->n_embd, n_mix = (2 + nc) * nc;
    di_status st = DI_OK;
    OP(matmul, &hc->fn, s->x, c->T, nc * D, s->mix, n_mix); // mix_raw: [T, (2+NC)*NC]
    OP(mhc_pre, s->x, s->mix, hc->base, hc->scale, (int32_t)nc, D, c->T, hp->hc_iters, hp->hc_eps,
       hp->norm_eps, false, s->a, s->post, s->comb);
    ROUND(s->a, c->T * D); // official: the collapsed input and the normed one are BF16
    OP(rmsnorm, s->a, c->T, D, D, norm, hp->norm_eps);
    ROUND(s->a, c->T * D);
    return DI_OK;
fail:
    return st;
}

static di_status block(const call *c, int il) {
    stage_state *s = c->s;
    const di_hparams *hp = &s->d->m->hp;
    const dev_layer *lw = &s->d->layers[il];
    const int32_t nc = hp->hc_mult;
    di_status st = DI_OK;
    DI_TRY(hc_pre(c, &lw->hc_attn, lw->attn_norm));
    const int64_t n_x = (int64_t)c->T * nc * hp->n_embd;
    DI_TRY(attention(c, il, s->a, s->out));
    OP(mhc_post, s->out, s->x, s->post, s->comb, nc, hp->n_embd, c->T);
    ROUND(s->x, n_x); // official: the residual streams are BF16
    DI_TRY(hc_pre(c, &lw->hc_ffn, lw->ffn_norm));
    OP(moe, &lw->moe, s->a, D32(s->tokens), c->T, s->out);
    OP(mhc_post, s->out, s->x, s->post, s->comb, nc, hp->n_embd, c->T);
    ROUND(s->x, n_x);
    return DI_OK;
fail:
    return st;
}

// Final head (§2.9; the MTP block's: its own mHC and norm, §2.10) on n rows of X listed in rows:
// gathered, collapsed, normed, projected by the shared lm head into s->logits [n, V] (the caller
// downloads them: not inside a graph).
static di_status head(const call *c, const dev_hc *hc, const float *norm, const int32_t *rows,
                      int32_t n) {
    stage_state *s = c->s;
    const dev_stage *d = s->d;
    const di_hparams *hp = &d->m->hp;
    const int64_t nc = hp->hc_mult, D = hp->n_embd, V = hp->n_vocab;
    const size_t row = sizeof(float) * (size_t)(nc * D);
    di_status st = DI_OK;
    for (int32_t k = 0; k < n;) {
        // Runs of consecutive rows are copied at once.
        int32_t j = 1;
        while (k + j < n && rows[k + j] == rows[k] + j) j++;
        OP(copy, s->hx + (int64_t)k * nc * D, s->x + (int64_t)rows[k] * nc * D, row * (size_t)j);
        k += j;
    }
    OP(matmul, &hc->fn, s->hx, n, nc * D, s->mix, nc); // mix_raw: [n, NC]
    OP(mhc_pre, s->hx, s->mix, hc->base, hc->scale, (int32_t)nc, D, n, hp->hc_iters, hp->hc_eps,
       hp->norm_eps, true, s->h, NULL, NULL);
    ROUND(s->h, n * D);
    OP(rmsnorm, s->h, n, D, D, norm, hp->norm_eps);
    ROUND(s->h, n * D);
    OP(matmul, &d->head, s->h, n, D, s->logits, V); // logits: [n, V]
    return DI_OK;
fail:
    return st;
}

// ---- checks ----

// The entry blocks (indices into seqs->blocks) a call may write: those of the windows closing in
// it at or after the cached entries, over every compressing ratio; *lo > *hi: none.
static void write_range(const stage_state *s, const di_dsv4_dev_seq *sq, int64_t *lo, int64_t *hi) {
    *lo = INT64_MAX, *hi = -1;
    for (int i = 0; i < s->n_cls; i++) {
        const int64_t m = s->cls[i].ratio;
        if (m <= 0) continue;
        // Window w closes at (w + 1) m - 1: in the call for w in [pos / m, (pos + n_tok) / m).
        int64_t w_lo = sq->pos / m, w_hi = ((int64_t)sq->pos + sq->n_tok) / m - 1;
        if (w_lo < sq->n_cached / m) w_lo = sq->n_cached / m;
        if (w_lo > w_hi) continue;
        const int64_t b_lo = w_lo * m / s->block_tokens, b_hi = w_hi * m / s->block_tokens;
        if (b_lo < *lo) *lo = b_lo;
        if (b_hi > *hi) *hi = b_hi;
    }
}

// Blocks, bounded replay and cached entries of sequence i (dsv4_dev.h di_dsv4_dev_seq).
static di_status check_seq_blocks(const stage_state *s, int32_t i, const di_dsv4_dev_seq *sq) {
    const int64_t need = ((int64_t)sq->pos + sq->n_tok + s->block_tokens - 1) / s->block_tokens;
    if (sq->win_lo < 0 || sq->win_lo > sq->pos || sq->n_cached < 0 || sq->n_cached > s->n_ctx ||
        sq->n_cached % s->block_tokens != 0) {
        DI_LOG_ERROR(
            "dev forward: sequence %d: win_lo %d (at most pos %d), n_cached %d (a multiple "
            "of %d, at most %d)",
            i, sq->win_lo, sq->pos, sq->n_cached, s->block_tokens, s->n_ctx);
        return DI_ERR_INVALID;
    }
    // Bounded replay: every window the call pools and keeps reads positions >= win_lo only (the
    // slot's rings hold nothing before it): the first kept window starts at n_cached (its overlap
    // one window earlier).
    for (int k = 0; k < s->n_cls && sq->win_lo > 0; k++) {
        const ratio_class *rc = &s->cls[k];
        if (rc->ratio > 0 && sq->win_lo > (int64_t)sq->n_cached - (rc->c - 1) * rc->ratio) {
            DI_LOG_ERROR("dev forward: sequence %d: replay from %d with %d cached positions: the "
                         "windows of ratio %d after them would read positions before it",
                         i, sq->win_lo, sq->n_cached, rc->ratio);
            return DI_ERR_INVALID;
        }
    }
    if (!s->shared) {
        if (sq->blocks || sq->n_blocks) {
            DI_LOG_ERROR("dev forward: sequence %d lists blocks; the state's are private", i);
            return DI_ERR_INVALID;
        }
        return DI_OK;
    }
    if (!sq->blocks || sq->n_blocks < need) {
        DI_LOG_ERROR("dev forward: sequence %d: %d entry blocks for positions up to %d (%lld "
                     "needed)",
                     i, sq->blocks ? sq->n_blocks : 0, sq->pos + sq->n_tok, (long long)need);
        return DI_ERR_INVALID;
    }
    for (int64_t j = 0; j < need; j++) {
        if (sq->blocks[j] < 0 || sq->blocks[j] >= s->n_eblocks) {
            DI_LOG_ERROR("dev forward: sequence %d: block %lld is %d, outside [0, %d)", i,
                         (long long)j, sq->blocks[j], s->n_eblocks);
            return DI_ERR_INVALID;
        }
    }
    return DI_OK;
}

// Shared blocks: no block this call writes is written twice or read by another sequence (or by
// the writer at another index); returns the page table entries the call changes in *n_upd.
static di_status check_blocks(stage_state *s, const di_dsv4_dev_seq *seqs, int32_t n_seq,
                              int32_t *n_upd) {
    *n_upd = 0;
    if (!s->shared) return DI_OK;
    if (++s->mark == 0) { // wrapped: start the marks afresh
        memset(s->blk_mark, 0, sizeof(uint32_t) * (size_t)s->n_eblocks);
        s->mark = 1;
    }
    for (int32_t i = 0; i < n_seq; i++) {
        int64_t lo, hi;
        write_range(s, &seqs[i], &lo, &hi);
        for (int64_t j = lo; j <= hi; j++) {
            const int32_t blk = seqs[i].blocks[j];
            if (s->blk_mark[blk] == s->mark) {
                DI_LOG_ERROR("dev forward: entry block %d is written twice by this call (sequence "
                             "%d)",
                             blk, i);
                return DI_ERR_INVALID;
            }
            s->blk_mark[blk] = s->mark;
        }
    }
    int32_t n = 0;
    for (int32_t i = 0; i < n_seq; i++) {
        const di_dsv4_dev_seq *sq = &seqs[i];
        const int64_t need = ((int64_t)sq->pos + sq->n_tok + s->block_tokens - 1) / s->block_tokens;
        const int32_t *pt = s->pages_host + (int64_t)sq->slot * s->max_blocks;
        int64_t lo, hi;
        write_range(s, sq, &lo, &hi);
        for (int64_t j = 0; j < need; j++) {
            if ((j < lo || j > hi) && s->blk_mark[sq->blocks[j]] == s->mark) {
                DI_LOG_ERROR("dev forward: sequence %d reads entry block %d, which this call "
                             "writes",
                             i, sq->blocks[j]);
                return DI_ERR_INVALID;
            }
            n += pt[j] != sq->blocks[j];
        }
    }
    *n_upd = n;
    return DI_OK;
}

static di_status check_call(stage_state *s, const di_dsv4_dev_seq *seqs, int32_t n_seq,
                            const int32_t *tokens, const int32_t *logit_rows, int32_t n_logit_rows,
                            const float *logits, int32_t *n_rows_out, int32_t *n_upd) {
    const di_hparams *hp = &s->d->m->hp;
    if (n_seq < 1 || !seqs || !tokens) {
        DI_LOG_ERROR("dev forward: need at least one sequence with tokens");
        return DI_ERR_INVALID;
    }
    memset(s->used, 0, (size_t)s->n_slots);
    int64_t n_rows = 0;
    for (int32_t i = 0; i < n_seq; i++) {
        const di_dsv4_dev_seq *sq = &seqs[i];
        if (sq->slot < 0 || sq->slot >= s->n_slots || s->used[sq->slot]) {
            DI_LOG_ERROR("dev forward: sequence %d: slot %d is out of range [0, %d) or repeated", i,
                         sq->slot, s->n_slots);
            return DI_ERR_INVALID;
        }
        s->used[sq->slot] = 1;
        if (sq->n_tok < 1 || sq->pos < 0) {
            DI_LOG_ERROR("dev forward: sequence %d feeds %d tokens at %d", i, sq->n_tok, sq->pos);
            return DI_ERR_INVALID;
        }
        // pos 0, or pos == win_lo > 0 (a replay's first call), starts the slot afresh there;
        // anything else continues it with the same win_lo.
        const bool fresh = sq->pos == 0 || (sq->win_lo > 0 && sq->pos == sq->win_lo);
        if (!fresh && (sq->pos != s->n_past[sq->slot] || sq->win_lo != s->win_lo[sq->slot])) {
            DI_LOG_ERROR("dev forward: slot %d is at position %d (window from %d), not %d (from "
                         "%d); 0 or win_lo restarts it",
                         sq->slot, s->n_past[sq->slot], s->win_lo[sq->slot], sq->pos, sq->win_lo);
            return DI_ERR_INVALID;
        }
        if ((int64_t)sq->pos + sq->n_tok > s->n_ctx) {
            DI_LOG_ERROR("dev forward: slot %d: %d + %d tokens exceed the context of %d", sq->slot,
                         sq->pos, sq->n_tok, s->n_ctx);
            return DI_ERR_INVALID;
        }
        di_status st = check_seq_blocks(s, i, sq);
        if (st != DI_OK) return st;
        n_rows += sq->n_tok;
    }
    if (n_rows > s->max_rows) {
        DI_LOG_ERROR("dev forward: %lld rows exceed the state's %d", (long long)n_rows,
                     s->max_rows);
        return DI_ERR_INVALID;
    }
    for (int64_t t = 0; t < n_rows; t++) {
        if (tokens[t] < 0 || tokens[t] >= hp->n_vocab) {
            DI_LOG_ERROR("dev forward: token id %d at row %lld is outside [0, %d)", tokens[t],
                         (long long)t, hp->n_vocab);
            return DI_ERR_INVALID;
        }
    }
    if (!di_dev_logit_rows_ok("dev forward", logit_rows, n_logit_rows, n_rows, logits))
        return DI_ERR_INVALID;
    di_status st = check_blocks(s, seqs, n_seq, n_upd);
    if (st != DI_OK) return st;
    *n_rows_out = (int32_t)n_rows;
    return DI_OK;
}

// ---- decode graphs ----

// The embedding, copied into every stream (§2.1), and the layers.
// The key lists of a compressing class (ratio_class "Key lists"), once per call: each row's window
// keys, then (HCA) entries 0..cap-1 from its window count on; past a row's n_keys nothing is read,
// so the entries not visible yet do no harm. CSA's top-k are appended per layer.
static di_status key_lists(const call *c, const ratio_class *k) {
    stage_state *s = c->s;
    const int32_t W = s->d->m->hp.window;
    di_status st = DI_OK;
    if (k->ratio <= 0) return DI_OK;
    OP(offset_list, D32(k->win_keys), c->T, W, s->zeros, s->zeros, NULL, NULL, 0, k->keys,
       k->key_stride);
    if (k->ratio != 4)
        OP(offset_list, NULL, c->T, k->cap, D32(k->base), D32(k->off), s->pages, D32(s->pg_off),
           k->per_page, k->keys, k->key_stride);
    return DI_OK;
fail:
    return st;
}

static di_status layers(const call *c) {
    stage_state *s = c->s;
    const di_hparams *hp = &s->d->m->hp;
    di_status st = DI_OK;
    // Shared blocks: this call's page table updates (1-word rows, their bits as they are; -1
    // destinations: a decode graph's padding), before anything reads the page tables.
    if (s->shared)
        OP(scatter_rows, (const float *)s->pt_val.dev, s->n_pt, 1, 1, (float *)s->pages, 1,
           D32(s->pt_dst), NULL);
    for (int i = 0; i < s->n_cls; i++) DI_TRY(key_lists(c, &s->cls[i]));
    // The first stage embeds the tokens; a later one's streams came from the stage before it
    // (stage_forward's hand-over, before the layers).
    if (s->d->first) OP(embed, &s->d->embed, D32(s->tokens), c->T, hp->hc_mult, s->x);
    for (int il = s->d->l0; il < s->d->l1; il++) DI_TRY(block(c, il));
    return DI_OK;
fail:
    return st;
}

// The rows per sequence r of a decode step, 0 for any other call: every sequence feeds r <=
// GRAPH_ROWS tokens (2: a verify of one draft) and takes the logits of every row (ascending and
// distinct in [0, n_seq r): rows 0..n_seq r - 1), all in one head chunk. Its ops depend on
// (n_seq, r) only.
static int32_t decode_rows(const di_dsv4_dev_seq *seqs, int32_t n_seq, int32_t n_logit_rows) {
    const int32_t r = seqs[0].n_tok;
    if (r > GRAPH_ROWS || n_logit_rows != n_seq * r || n_logit_rows > HEAD_CHUNK) return 0;
    for (int32_t i = 0; i < n_seq; i++)
        if (seqs[i].n_tok != r) return 0;
    return r;
}

// The layers and the head of n rows, as one capture records them.
typedef struct step_ctx {
    const call *c;
    const int32_t *rows;
    int32_t n;
} step_ctx;

static di_status run_step(const void *ctx) {
    const step_ctx *x = ctx;
    di_status st = layers(x->c);
    if (st == DI_OK && x->c->s->d->last)
        st = head(x->c, &x->c->s->d->hc_head, x->c->s->d->norm, x->rows, x->n);
    return st;
}

// Captures the layers and the head of n rows (not launched). The capture is closed on every path.
static di_status capture(const call *c, const int32_t *rows, int32_t n, void **out) {
    const step_ctx x = {c, rows, n};
    return di_dev_capture(c->s->d->b, run_step, &x, out);
}

// ---- the call ----

// One stage's part of a call checked by check_call on every stage (T rows, n_upd page table
// entries of this stage's mirror). prev: the previous stage's part (NULL on the first stage),
// whose streams [T, NC, D] after its last layer are copied into x before the layers
// (di_backend_hand_over: a peer copy, or through bounce); this stage's stay in its x for the next
// one (the last stage runs the head and downloads the logits).
static di_status stage_forward(stage_state *s, const di_dsv4_dev_seq *seqs, int32_t n_seq,
                               const int32_t *tokens, const int32_t *logit_rows,
                               int32_t n_logit_rows, float *logits, const uint8_t *greedy,
                               int32_t *picks, int32_t T, int32_t n_upd, const stage_state *prev,
                               void *bounce) {
    const di_model *m = s->d->m;
    const di_hparams *hp = &m->hp;
    di_status st = DI_OK;
    const bool last = s->d->last;
    const size_t x_bytes = sizeof(float) * (size_t)T * (size_t)hp->hc_mult * (size_t)hp->n_embd;
    call cl = {s, seqs, n_seq, T};
    s->stats.last_ops = s->stats.last_uploads = s->stats.last_upload_bytes = 0;
    s->stats.last_handover_bytes = s->stats.last_download_bytes = 0;
    s->x_rows = 0; // until the call's streams are complete
    const call *c = &cl;
    // A decode step runs from its graph unless its page table changes more than one entry per
    // sequence (the graph's scatter count): then directly, counted.
    const int32_t rows = s->graphs_on ? decode_rows(seqs, n_seq, n_logit_rows) : 0;
    const bool decode = rows > 0;
    const bool graph = decode && n_upd <= n_seq;
    if (decode && !graph) s->stats.n_direct_pages++;

    // Rows: sequence after sequence. Tokens, positions, page table updates and every class's
    // lists are packed into the staging buffer (placed by the call's shape) and go to the backend
    // in one upload.
    s->meta_used = 0;
    iarr_place(s, &s->tokens, (size_t)T);
    iarr_place(s, &s->pos, (size_t)T);
    iarr_place(s, &s->pg_off, (size_t)T);
    s->n_pt = graph && s->shared ? n_seq : n_upd;
    iarr_place(s, &s->pt_dst, (size_t)s->n_pt);
    iarr_place(s, &s->pt_val, (size_t)s->n_pt);
    int32_t r = 0, n_pt = 0;
    for (int32_t i = 0; i < n_seq; i++) {
        const di_dsv4_dev_seq *sq = &seqs[i];
        s->row0[i] = r;
        for (int32_t t = 0; t < sq->n_tok; t++) {
            I32(s->pos)[r + t] = sq->pos + t;
            I32(s->pg_off)[r + t] = sq->slot * s->max_blocks;
        }
        r += sq->n_tok;
        if (!s->shared) continue;
        // The page table entries that change, applied to the host mirror now (the lists below
        // read it) and to the device by the call's first op.
        const int64_t need = ((int64_t)sq->pos + sq->n_tok + s->block_tokens - 1) / s->block_tokens;
        int32_t *pt = s->pages_host + (int64_t)sq->slot * s->max_blocks;
        for (int64_t j = 0; j < need; j++) {
            if (pt[j] == sq->blocks[j]) continue;
            I32(s->pt_dst)[n_pt] = (int32_t)(sq->slot * s->max_blocks + j);
            I32(s->pt_val)[n_pt++] = sq->blocks[j];
            pt[j] = sq->blocks[j];
        }
    }
    DI_ASSERT(n_pt == n_upd && n_pt <= s->n_pt);
    for (; n_pt < s->n_pt; n_pt++) { // a decode graph's padding
        I32(s->pt_dst)[n_pt] = -1;
        I32(s->pt_val)[n_pt] = 0;
    }
    memcpy(s->tokens.host, tokens, sizeof(int32_t) * (size_t)T);
    for (int i = 0; i < s->n_cls; i++) build_class(s, &s->cls[i], seqs, n_seq);
    if (s->n_keep > 0) { // kept streams: each sequence's last min(n_tok, n_keep) rows
        s->n_kd = 0;
        for (int32_t i = 0; i < n_seq; i++)
            s->n_kd += seqs[i].n_tok < s->n_keep ? seqs[i].n_tok : s->n_keep;
        iarr_place(s, &s->keep_dst, (size_t)s->n_kd);
        iarr_place(s, &s->keep_src, (size_t)s->n_kd);
        int32_t *ksrc = I32(s->keep_src), *kdst = I32(s->keep_dst), n = 0;
        for (int32_t i = 0; i < n_seq; i++) {
            const di_dsv4_dev_seq *sq = &seqs[i];
            const int32_t t0 = sq->n_tok > s->n_keep ? sq->n_tok - s->n_keep : 0;
            for (int32_t t = t0; t < sq->n_tok; t++, n++) {
                ksrc[n] = s->row0[i] + t;
                kdst[n] = s->max_rows + sq->slot * s->n_keep + (sq->pos + t) % s->n_keep;
            }
        }
    }
    for (int32_t i = 0; i < n_seq; i++) s->n_past[seqs[i].slot] = -1; // until the call succeeds
    s->stats.last_uploads = 1;
    s->stats.last_upload_bytes = (int64_t)s->meta_used;
    DI_TRY(s->d->b->vt->upload(s->d->b, s->meta_dev, s->meta_host, s->meta_used));
    if (prev) { // the hand-over from the previous stage (stream-ordered before the layers)
        bool peer = false;
        DI_TRY(di_backend_hand_over(s->d->b, s->x, prev->d->b, prev->x, x_bytes, bounce, &peer));
        s->stats.last_handover_bytes += (int64_t)x_bytes;
        if (peer) {
            s->stats.n_handover_peer++;
        } else { // downloaded from the previous stage into bounce, uploaded here
            s->stats.n_handover_host++;
            s->stats.last_uploads++;
            s->stats.last_upload_bytes += (int64_t)x_bytes;
        }
    }

    // Embedding, the layers, the head on the logit rows: a decode step through its graph (after
    // it ran once directly), every other call directly, chunk by chunk of the head.
    if (graph) {
        // n_seq <= n_slots, HEAD_CHUNK
        struct dev_graph *g = &s->graphs[(rows - 1) * s->n_graphs + n_seq - 1];
        bool direct = !g->seen;     // first seen: directly (no capture for one step)
        if (!direct && !g->graph) { // seen before: captured, then launched
            const int64_t ops0 = s->stats.last_ops;
            st = capture(c, logit_rows, n_logit_rows, &g->graph);
            g->n_ops = s->stats.last_ops - ops0; // recorded, not run: counted at the launch
            s->stats.last_ops = ops0;
            if (st == DI_OK) {
                s->stats.n_captured++;
            } else { // nothing ran: the step runs directly, and so will every later one
                DI_LOG_WARN("dev forward: capturing a decode step of %d sequences of %d rows "
                            "failed on %s (%s): decode graphs are off for this state",
                            n_seq, rows, s->d->b->desc, di_status_str(st));
                s->graphs_on = false;
                direct = true;
            }
        } else if (!direct) {
            s->stats.n_replayed++;
        }
        if (direct) {
            DI_TRY(layers(c));
            if (last) DI_TRY(head(c, &s->d->hc_head, s->d->norm, logit_rows, n_logit_rows));
            s->stats.n_direct++;
        } else {
            s->stats.last_ops += g->n_ops;
            DI_TRY(s->d->b->vt->graph_launch(s->d->b, g->graph));
        }
        g->seen = true;
        if (last) // after the graph: its ops are the same for any greedy rows
            DI_TRY(di_dev_logits_down(s->d->b, s->logits, n_logit_rows, hp->n_vocab, greedy,
                                      s->pick, s->pick_h, logits, picks, &s->stats.last_ops,
                                      &s->stats.last_download_bytes));
    } else {
        DI_TRY(layers(c));
        const int32_t HC = s->max_rows < HEAD_CHUNK ? s->max_rows : HEAD_CHUNK;
        for (int32_t k = 0; k < n_logit_rows && last; k += HC) {
            int32_t n = n_logit_rows - k < HC ? n_logit_rows - k : HC;
            DI_TRY(head(c, &s->d->hc_head, s->d->norm, logit_rows + k, n));
            DI_TRY(di_dev_logits_down(s->d->b, s->logits, n, hp->n_vocab,
                                      greedy ? greedy + k : NULL, s->pick, s->pick_h,
                                      logits + (int64_t)k * hp->n_vocab, picks ? picks + k : NULL,
                                      &s->stats.last_ops, &s->stats.last_download_bytes));
        }
        s->stats.n_direct++;
    }
    // The streams stay in s->x for the next stage, which copies them before its layers.
    // Kept streams (after the head, which only reads x; outside any graph): the call's last rows
    // into the slots' kept rows of x.
    if (s->n_keep > 0) {
        const int64_t w = (int64_t)hp->hc_mult * hp->n_embd;
        OP(scatter_rows, s->x, s->n_kd, w, w, s->x, w, D32(s->keep_dst), D32(s->keep_src));
    }
    // The end of the step: every op done (and its faults surfaced) before the slots advance.
    DI_TRY(s->d->b->vt->sync(s->d->b));
    for (int32_t i = 0; i < n_seq; i++) {
        const di_dsv4_dev_seq *sq = &seqs[i];
        const int32_t end = sq->pos + sq->n_tok;
        const bool fresh = sq->pos == 0 || (sq->win_lo > 0 && sq->pos == sq->win_lo);
        s->n_past[sq->slot] = end;
        s->win_lo[sq->slot] = sq->win_lo;
        if (fresh) s->start[sq->slot] = sq->pos;
        s->hw[sq->slot] = fresh || end > s->hw[sq->slot] ? end : s->hw[sq->slot];
    }
    s->x_rows = T; // the main streams of every row, for an MTP call (head() only reads x)
    s->stats.n_download_bytes += s->stats.last_download_bytes;
    return DI_OK;
fail:
    // Whether the page table updates reached the device is unknown: the next call of these
    // slots writes their entries again.
    for (int32_t i = 0; i < n_seq && s->shared; i++)
        for (int32_t j = 0; j < s->max_blocks; j++)
            s->pages_host[(int64_t)seqs[i].slot * s->max_blocks + j] = PT_UNKNOWN;
    DI_LOG_ERROR("dev forward: %s on %s; the call's slots must restart at position 0",
                 di_status_str(st), s->d->b->desc);
    return st;
}

// ---- the MTP block (spec §2.10; model/dsv4_mtp.c) ----

// The MTP call's checks (dsv4_dev.h di_dsv4_dev_mtp_forward); *n_rows_out: its rows.
static di_status check_mtp_call(stage_state *s, const di_dsv4_dev_seq *seqs, int32_t n_seq,
                                const int32_t *x_rows, const int32_t *ids_next,
                                const int32_t *logit_rows, int32_t n_logit_rows,
                                const float *logits, int32_t *n_rows_out) {
    const di_hparams *hp = &s->d->m->hp;
    if (!s->mtp) {
        DI_LOG_ERROR("dev mtp: the state has no MTP block (di_dsv4_dev_mtp_enable before it)");
        return DI_ERR_INVALID;
    }
    if (n_seq < 1 || !seqs || !x_rows || !ids_next) {
        DI_LOG_ERROR("dev mtp: need sequences, rows and tokens");
        return DI_ERR_INVALID;
    }
    memset(s->used, 0, (size_t)s->n_slots);
    int64_t n_rows = 0;
    for (int32_t i = 0; i < n_seq; i++) {
        const di_dsv4_dev_seq *sq = &seqs[i];
        if (sq->slot < 0 || sq->slot >= s->n_slots || s->used[sq->slot] || sq->n_tok < 1 ||
            sq->pos < 0) {
            DI_LOG_ERROR("dev mtp: sequence %d: slot %d (of %d, repeated?) feeds %d rows at %d", i,
                         sq->slot, s->n_slots, sq->n_tok, sq->pos);
            return DI_ERR_INVALID;
        }
        s->used[sq->slot] = 1;
        const bool fresh = sq->pos == 0 || (sq->win_lo > 0 && sq->pos == sq->win_lo);
        if ((!fresh && (sq->pos != s->mtp_n_past[sq->slot] || sq->win_lo != s->win_lo[sq->slot])) ||
            sq->win_lo < 0 || sq->win_lo > sq->pos ||
            (int64_t)sq->pos + sq->n_tok > s->n_past[sq->slot]) {
            DI_LOG_ERROR("dev mtp: slot %d: its MTP ring is at %d, the main one at %d; rows %d.. "
                         "(%d, window from %d) do not continue it",
                         sq->slot, s->mtp_n_past[sq->slot], s->n_past[sq->slot], sq->pos, sq->n_tok,
                         sq->win_lo);
            return DI_ERR_INVALID;
        }
        n_rows += sq->n_tok;
    }
    bool kept = false;
    for (int64_t t = 0; t < n_rows; t++) kept |= x_rows[t] == DI_DSV4_DEV_X_KEPT;
    if (n_rows > (kept ? s->max_rows : s->x_rows)) {
        DI_LOG_ERROR("dev mtp: %lld rows, the last main call had %d (the state takes %d)",
                     (long long)n_rows, s->x_rows, s->max_rows);
        return DI_ERR_INVALID;
    }
    for (int32_t i = 0, t = 0; i < n_seq; i++) {
        const di_dsv4_dev_seq *sq = &seqs[i];
        for (int32_t j = 0; j < sq->n_tok; j++, t++) {
            // A kept row: its position's streams among the slot's kept ones (the last n_keep
            // positions its main rings were written at, below its n_past, since its start).
            const int64_t q = (int64_t)sq->pos + j, hw = s->hw[sq->slot], st = s->start[sq->slot];
            const bool ok_kept = x_rows[t] == DI_DSV4_DEV_X_KEPT && s->n_keep > 0 &&
                                 q < s->n_past[sq->slot] && q >= st && q >= hw - s->n_keep;
            const bool ok_row = x_rows[t] >= 0 && x_rows[t] < s->x_rows;
            if ((!ok_kept && !ok_row) || ids_next[t] < 0 || ids_next[t] >= hp->n_vocab) {
                DI_LOG_ERROR("dev mtp: row %d (slot %d, position %lld): main row %d (of %d; -1: "
                             "kept streams, %d a slot), token %d",
                             (int)t, sq->slot, (long long)q, x_rows[t], s->x_rows, s->n_keep,
                             ids_next[t]);
                return DI_ERR_INVALID;
            }
        }
    }
    if (!di_dev_logit_rows_ok("dev mtp", logit_rows, n_logit_rows, n_rows, logits))
        return DI_ERR_INVALID;
    *n_rows_out = (int32_t)n_rows;
    return DI_OK;
}

// The MTP block's input (model/dsv4_mtp.c, op for op): e = e_proj . RMSNorm(embed[id_next],
// enorm); X0[t, k] = h_proj . RMSNorm(Xmain[t, k], hnorm) + e[t], with the official recipe's
// roundings. Xmain: the main call's rows gathered from x into xmain; X0 goes into x.
static di_status mtp_input(const call *c) {
    stage_state *s = c->s;
    const dev_stage *d = s->d;
    const di_hparams *hp = &d->m->hp;
    const int64_t nc = hp->hc_mult, D = hp->n_embd, T = c->T;
    di_status st = DI_OK;
    OP(scatter_rows, s->x, T, nc * D, nc * D, s->xmain, nc * D, s->iota, D32(s->mtp_src));
    OP(embed, &d->embed, D32(s->tokens), (int32_t)T, 1, s->a); // [T, D]
    OP(rmsnorm, s->a, T, D, D, d->mtp_enorm, hp->norm_eps);
    ROUND(s->a, T * D);
    DI_TRY(linear(c, &d->mtp_e_proj, s->a, D, s->out, D, true)); // e: [T, D]
    const di_tensor *hw = &d->mtp_h_proj;
    const bool a8 =
        d->official && (hw->kind == DI_TENSOR_KIND_FP8 || hw->kind == DI_TENSOR_KIND_FP4);
    for (int64_t k = 0; k < nc; k++) { // stream k: contiguous in a, normed, projected into x
        OP(scatter_rows, s->xmain + k * D, T, nc * D, D, s->a, D, s->iota, NULL);
        OP(rmsnorm, s->a, T, D, D, d->mtp_hnorm, hp->norm_eps);
        ROUND(s->a, T * D);
        if (a8)
            OP(matmul_a8, hw, s->a, T, D, s->aq, s->x + k * D, nc * D);
        else
            OP(matmul, hw, s->a, T, D, s->x + k * D, nc * D);
    }
    ROUND(s->x, T * nc * D); // each h_proj output rounded once, as linear() does per row
    // x[t, k] += e[t]: e copied into every stream of xmain, then mhc_post over the T * NC rows as
    // one stream with post = comb = 1 (1 * e + 1 * x: the CPU forward's x + e, bit for bit).
    for (int64_t k = 0; k < nc; k++)
        OP(scatter_rows, s->out, T, D, D, s->xmain + k * D, nc * D, s->iota, NULL);
    OP(mhc_post, s->xmain, s->x, s->ones, s->ones, 1, D, (int32_t)(T * nc));
    ROUND(s->x, T * nc * D);
    return DI_OK;
fail:
    return st;
}

// The MTP call on the last stage s (its main streams are the last stage's x).
static di_status stage_mtp_forward(stage_state *s, const di_dsv4_dev_seq *seqs, int32_t n_seq,
                                   const int32_t *x_rows, const int32_t *ids_next,
                                   const int32_t *logit_rows, int32_t n_logit_rows, float *logits,
                                   const uint8_t *greedy, int32_t *picks) {
    const di_hparams *hp = &s->d->m->hp;
    int32_t T = 0;
    di_status st =
        check_mtp_call(s, seqs, n_seq, x_rows, ids_next, logit_rows, n_logit_rows, logits, &T);
    if (st != DI_OK) return st;
    call cl = {s, seqs, n_seq, T};
    const call *c = &cl;
    s->stats.last_ops = s->stats.last_uploads = s->stats.last_upload_bytes = 0;
    s->stats.last_download_bytes = 0;
    s->meta_used = 0;
    iarr_place(s, &s->tokens, (size_t)T);
    iarr_place(s, &s->pos, (size_t)T);
    iarr_place(s, &s->mtp_src, (size_t)T);
    for (int32_t i = 0, r = 0; i < n_seq; r += seqs[i].n_tok, i++) {
        s->row0[i] = r;
        for (int32_t t = 0; t < seqs[i].n_tok; t++) I32(s->pos)[r + t] = seqs[i].pos + t;
    }
    memcpy(s->tokens.host, ids_next, sizeof(int32_t) * (size_t)T);
    int32_t *src = I32(s->mtp_src);
    for (int32_t i = 0, t = 0; i < n_seq; i++) { // kept rows: x's rows after max_rows
        const di_dsv4_dev_seq *sq = &seqs[i];
        for (int32_t j = 0; j < sq->n_tok; j++, t++)
            src[t] = x_rows[t] != DI_DSV4_DEV_X_KEPT // checked: then n_keep > 0
                         ? x_rows[t]
                         : s->max_rows + sq->slot * s->n_keep + (sq->pos + j) % s->n_keep;
    }
    build_class(s, &s->mtp_cls, seqs, n_seq); // window keys and ring writes in the MTP's pool
    s->x_rows = 0;                            // x becomes the MTP block's streams
    for (int32_t i = 0; i < n_seq; i++) s->mtp_n_past[seqs[i].slot] = -1; // until it succeeds
    s->stats.last_uploads = 1;
    s->stats.last_upload_bytes = (int64_t)s->meta_used;
    DI_TRY(s->d->b->vt->upload(s->d->b, s->meta_dev, s->meta_host, s->meta_used));
    DI_TRY(mtp_input(c));
    DI_TRY(block(c, hp->n_layer));
    const int32_t HC = s->max_rows < HEAD_CHUNK ? s->max_rows : HEAD_CHUNK;
    for (int32_t k = 0; k < n_logit_rows; k += HC) {
        int32_t n = n_logit_rows - k < HC ? n_logit_rows - k : HC;
        DI_TRY(head(c, &s->d->mtp_hc_head, s->d->mtp_norm, logit_rows + k, n));
        DI_TRY(di_dev_logits_down(s->d->b, s->logits, n, hp->n_vocab, greedy ? greedy + k : NULL,
                                  s->pick, s->pick_h, logits + (int64_t)k * hp->n_vocab,
                                  picks ? picks + k : NULL, &s->stats.last_ops,
                                  &s->stats.last_download_bytes));
    }
    DI_TRY(s->d->b->vt->sync(s->d->b));
    s->stats.n_download_bytes += s->stats.last_download_bytes;
    s->stats.n_direct++;
    for (int32_t i = 0; i < n_seq; i++) {
        const di_dsv4_dev_seq *sq = &seqs[i];
        const int32_t end = sq->pos + sq->n_tok;
        const bool fresh = sq->pos == 0 || (sq->win_lo > 0 && sq->pos == sq->win_lo);
        s->mtp_n_past[sq->slot] = end;
        if (fresh) s->mtp_start[sq->slot] = sq->pos;
        s->mtp_hw[sq->slot] = fresh || end > s->mtp_hw[sq->slot] ? end : s->mtp_hw[sq->slot];
    }
    return DI_OK;
fail:
    DI_LOG_ERROR("dev mtp: %s on %s; the call's slots must restart at position 0",
                 di_status_str(st), s->d->b->desc);
    return st;
}

// Taking back rows (dsv4_dev.h di_dsv4_dev_rollback, di_dsv4_dev_rollback_mtp). Why it leaves no
// trace, for a state of back_max rows (its rings ring_extra = back_max - 1 rows longer than they
// read: Wr = W + ring_extra window rows, Rr = R + ring_extra token rows, R = c m) and a slot whose
// rings were written up to hw (the end of the highest position since its start) going back to pos
// with hw - pos <= back_max: a ring row holds the highest position written at it, so position x's
// row is intact while x + Wr >= hw (x + Rr for a token ring). (1) A call at p >= pos reads window
// positions > p - W >= pos - W, and pos - W + 1 + Wr = pos + back_max >= hw. (2) The next window to
// close, the one holding pos, starts at floor(pos / m) m - (c - 1) m >= pos - R + 1, and pos - R +
// 1 + Rr = pos + back_max >= hw. Every such position below pos was last fed by a call ending at or
// below hw, which wrote its last min(n_tok, Wr) (Rr) rows into the ring, so the row is there.
// (3) A taken-back position that closed a window w wrote entry w in the block of its position:
// only rows at positions >= its closing one see it (n_vis, the HCA count: (P + 1) / m > w), and the
// call that feeds that position again closes w again and rewrites the entry in its compressor
// before its indexer or attention reads it; such a block is not a cached one (its windows were not
// stored at all otherwise), and tail snapshots at pos read only positions < pos. The bound is on
// hw, not on the rows of one call: rows fed again after a rollback do not give back the rows the
// taken-back ones overwrote, so a second rollback counts from the first one's hw. With back_max 1
// (the engine's states) that is the last row of the last call, once. The MTP ring is a window ring
// of its own positions (mtp_hw, mtp_start): di_dsv4_dev_rollback_mtp takes it back under the same
// bound (to its start it always may: a call there starts it afresh); di_dsv4_dev_rollback leaves
// it where it is when it is at or below pos, else restarts it (a kept row given up: the engine's
// cancelled block, whose request ends; fresh, or a tail restore).
static di_status check_rollback(const stage_state *s, int32_t slot, int32_t pos, int32_t mtp_pos) {
    const bool in = slot >= 0 && slot < s->n_slots;
    const int32_t np = in ? s->n_past[slot] : -1;
    const int32_t lo = in && s->hw[slot] - s->back_max > s->start[slot] ? s->hw[slot] - s->back_max
                                                                        : (in ? s->start[slot] : 0);
    if (np < 0 || pos < lo || pos > np || pos <= s->win_lo[slot]) {
        DI_LOG_ERROR("dev rollback: slot %d at %d (window from %d) cannot go back to %d: at most "
                     "%d rows below the highest position its rings hold (%d), not below %d",
                     slot, np, in ? s->win_lo[slot] : -1, pos, s->back_max, in ? s->hw[slot] : -1,
                     lo);
        return DI_ERR_INVALID;
    }
    if (mtp_pos < 0 || !s->d->last) return DI_OK; // the MTP ring is the last stage's
    const int32_t mp = s->mtp ? s->mtp_n_past[slot] : -1;
    const int32_t mlo = s->mtp_hw[slot] - s->back_max > s->mtp_start[slot]
                            ? s->mtp_hw[slot] - s->back_max
                            : s->mtp_start[slot];
    const bool fresh = mtp_pos == 0 || (s->win_lo[slot] > 0 && mtp_pos == s->win_lo[slot]);
    if (mp < 0 || mtp_pos > mp || mtp_pos > pos || (!fresh && mtp_pos < mlo)) {
        DI_LOG_ERROR("dev rollback: slot %d: its MTP ring at %d cannot go back to %d (main to %d; "
                     "at most %d rows below its highest position %d, not below %d)",
                     slot, mp, mtp_pos, pos, s->back_max, s->mtp_hw[slot], mlo);
        return DI_ERR_INVALID;
    }
    return DI_OK;
}

// Applies a rollback check_rollback accepted (on every stage).
static void stage_rollback(stage_state *s, int32_t slot, int32_t pos, int32_t mtp_pos) {
    s->n_past[slot] = pos;
    if (!s->mtp) return;
    if (mtp_pos >= 0)
        s->mtp_n_past[slot] = mtp_pos;
    else if (s->mtp_n_past[slot] > pos)
        s->mtp_n_past[slot] = -1;
}

#undef ROUND
#undef OP
#undef B

// ---- tail snapshots ----

// A snapshot (dsv4_dev.h di_dsv4_dev_tail_bytes): this header, then per layer its window ring
// (kind 0), the main compressor's C and Z token rings (1, 2) and the indexer's (3, 4), each as
// the `keep` rows of positions pos - keep .. pos - 1 in position order (rows of positions < 0 are
// zeros, never restored); with the MTP block, layer n_layer is its window ring (kind 0 only).
typedef struct tail_head {
    uint32_t magic;
    int32_t pos, n_layer, kv_row_bytes;
} tail_head;
enum { TAIL_MAGIC = 0x4c545644u, TAIL_KINDS = 5 }; // "DVTL"

// One ring of a slot's tail: n_rows rows of row_bytes (row = position mod n_rows) from base (the
// slot's row 0; NULL without a state), of which a snapshot keeps the last `keep`. At a position
// that is a multiple of every ratio a continuation reads nothing older: attention the window's
// W - 1 earlier positions, the next window of ratio m its overlap ((c - 1) m positions; none for
// c == 1: HCA's ring is not kept at all).
typedef struct tail_ring {
    int64_t row_bytes, n_rows, keep;
    uint8_t *base;
} tail_ring;

// Ring i (layer i / TAIL_KINDS, kind i % TAIL_KINDS) of slot `slot` of s (s NULL: sizes only);
// false when the layer has no such ring or the snapshot keeps none of its rows.
static bool tail_ring_at(const dev_stage *d, const stage_state *s, int32_t slot, int i,
                         tail_ring *r) {
    const di_hparams *hp = &d->m->hp;
    const int il = i / TAIL_KINDS, kind = i % TAIL_KINDS;
    const di_dsv4_layer_w *lw = il < hp->n_layer ? &d->m->layers[il] : &d->m->mtp[0].block;
    const dev_lstate *ls = s ? &s->ls[il] : NULL;
    const int64_t W = hp->window, f = sizeof(float);
    if (kind == 0) {
        r->row_bytes = row_bytes_of(d);
        r->n_rows = s ? s->Wr : W;
        r->keep = W - 1;
        r->base = NULL;
        if (s) {
            uint8_t *pool = d->official ? ls->kvb : (uint8_t *)ls->kv;
            r->base = pool + ((int64_t)s->max_rows + (int64_t)slot * s->Wr) * r->row_bytes;
        }
        return r->keep > 0;
    }
    if (lw->ratio <= 0 || (kind >= 3 && lw->ratio != 4)) return false;
    const di_dsv4_compressor_w *cw = kind < 3 ? &lw->cmp : &lw->idx_cmp;
    r->row_bytes = (int64_t)cw->c * cw->d * f;
    r->n_rows = (int64_t)cw->c * cw->m + (s ? s->ring_extra : 0);
    r->keep = (int64_t)(cw->c - 1) * cw->m;
    r->base = NULL;
    if (s) {
        float *ring = kind == 1   ? ls->ring_c
                      : kind == 2 ? ls->ring_z
                      : kind == 3 ? ls->iring_c
                                  : ls->iring_z;
        r->base = (uint8_t *)ring + (int64_t)slot * r->n_rows * r->row_bytes;
    }
    return r->keep > 0;
}

// The rings of stage d's snapshot part: indices [*i0, *i1) of tail_ring_at (its layers, then the
// MTP block's on the last stage).
static void stage_rings(const dev_stage *d, int *i0, int *i1) {
    *i0 = d->l0 * TAIL_KINDS;
    *i1 = (d->l1 + (d->mtp ? 1 : 0)) * TAIL_KINDS;
}

// Bytes of stage d's part of a snapshot (after the header; the parts follow in stage order).
static size_t stage_tail_bytes(const dev_stage *d) {
    size_t n = 0;
    tail_ring r;
    int i0, i1;
    stage_rings(d, &i0, &i1);
    for (int i = i0; i < i1; i++)
        if (tail_ring_at(d, NULL, 0, i, &r)) n += (size_t)(r.keep * r.row_bytes);
    return n;
}

// DI_ERR_INVALID (logged) unless pos is a multiple of every compress ratio of the stage.
static di_status check_tail_pos(const stage_state *s, int32_t slot, int32_t pos) {
    if (slot < 0 || slot >= s->n_slots || pos < 0 || pos > s->n_ctx) {
        DI_LOG_ERROR("dev tail: slot %d at %d: out of range (%d slots, %d positions)", slot, pos,
                     s->n_slots, s->n_ctx);
        return DI_ERR_INVALID;
    }
    for (int k = 0; k < s->n_cls; k++) {
        if (s->cls[k].ratio > 0 && pos % s->cls[k].ratio != 0) {
            DI_LOG_ERROR("dev tail: position %d is not a multiple of the ratio %d", pos,
                         s->cls[k].ratio);
            return DI_ERR_INVALID;
        }
    }
    return DI_OK;
}

// Copies ring r's kept rows between the slot's ring and the staging rows at `stage` (positions
// pos - keep .. pos - 1; those < 0 skipped): to the staging (save) or from it (restore), in runs
// of contiguous ring rows.
static di_status tail_copy(di_backend *b, const tail_ring *r, int64_t pos, uint8_t *stage,
                           bool save) {
    int64_t q = pos - r->keep > 0 ? pos - r->keep : 0;
    while (q < pos) {
        const int64_t row = q % r->n_rows;
        int64_t n = pos - q;
        if (row + n > r->n_rows) n = r->n_rows - row; // up to the ring's end, then from row 0
        uint8_t *st = stage + (q - (pos - r->keep)) * r->row_bytes,
                *rg = r->base + row * r->row_bytes;
        const size_t bytes = (size_t)(n * r->row_bytes);
        di_status s = save ? b->vt->copy(b, st, rg, bytes) : b->vt->copy(b, rg, st, bytes);
        if (s != DI_OK) return s;
        q += n;
    }
    return DI_OK;
}

// Whether slot `slot`'s rings at pos hold every row the stage's part keeps (after a bounded
// replay from lo > 0 the ring rows before lo were never computed). DI_ERR_INVALID (logged).
static di_status stage_tail_reach(const stage_state *s, int32_t slot, int32_t pos) {
    const int64_t lo = s->win_lo[slot];
    tail_ring r;
    int i0, i1;
    stage_rings(s->d, &i0, &i1);
    for (int i = i0; i < i1 && lo > 0; i++) {
        if (tail_ring_at(s->d, NULL, 0, i, &r) && pos - r.keep < lo) {
            DI_LOG_ERROR("dev tail: slot %d at %d replayed from %lld: its rings hold no rows "
                         "before that",
                         slot, pos, (long long)lo);
            return DI_ERR_INVALID;
        }
    }
    return DI_OK;
}

// Stage s's part of slot `slot`'s snapshot at pos (checked) into out (stage_tail_bytes). Syncs.
static di_status stage_tail_save(stage_state *s, int32_t slot, int32_t pos, uint8_t *out) {
    const dev_stage *d = s->d;
    di_backend *b = d->b;
    const size_t total = stage_tail_bytes(d);
    di_status st = DI_OK;
    size_t off = 0;
    tail_ring r;
    int i0, i1;
    stage_rings(d, &i0, &i1);
    for (int i = i0; i < i1; i++) {
        if (!tail_ring_at(d, s, slot, i, &r)) continue;
        DI_TRY(tail_copy(b, &r, pos, s->tail_dev + off, true));
        off += (size_t)(r.keep * r.row_bytes);
    }
    DI_ASSERT(off == total);
    DI_TRY(b->vt->download(b, out, s->tail_dev, total)); // syncs: out is read now
    // Rows of positions < 0 (a tail before the window filled): zeros, never restored.
    off = 0;
    for (int i = i0; i < i1; i++) {
        if (!tail_ring_at(d, NULL, 0, i, &r)) continue;
        if (r.keep > pos) memset(out + off, 0, (size_t)((r.keep - pos) * r.row_bytes));
        off += (size_t)(r.keep * r.row_bytes);
    }
    return DI_OK;
fail:
    DI_LOG_ERROR("dev tail: saving slot %d on %s: %s", slot, b->desc, di_status_str(st));
    return st;
}

// Stage s's part (src: stage_tail_bytes) into slot `slot`'s rings at pos (checked), then the
// slot's bookkeeping: a slot that consumed pos tokens with full windows.
static di_status stage_tail_restore(stage_state *s, int32_t slot, int32_t pos, const uint8_t *src) {
    const dev_stage *d = s->d;
    di_backend *b = d->b;
    const size_t total = stage_tail_bytes(d);
    di_status st = DI_OK;
    s->n_past[slot] = -1; // until every copy is enqueued
    DI_TRY(b->vt->upload(b, s->tail_dev, src, total));
    size_t off = 0;
    tail_ring r;
    int i0, i1;
    stage_rings(d, &i0, &i1);
    for (int i = i0; i < i1; i++) {
        if (!tail_ring_at(d, s, slot, i, &r)) continue;
        DI_TRY(tail_copy(b, &r, pos, s->tail_dev + off, false));
        off += (size_t)(r.keep * r.row_bytes);
    }
    // The slot continues at pos with every window row (no win_lo). Its page table is left as it
    // is, on the device and in the host mirror (which stays exact: the next call writes only the
    // entries that differ from the blocks it lists, e.g. the hit's).
    s->n_past[slot] = s->hw[slot] = s->start[slot] = pos;
    s->win_lo[slot] = 0;
    if (s->mtp) s->mtp_n_past[slot] = s->mtp_hw[slot] = s->mtp_start[slot] = pos;
    return DI_OK;
fail:
    DI_LOG_ERROR("dev tail: restoring slot %d on %s: %s; restart it at position 0", slot, b->desc,
                 di_status_str(st));
    return st;
}

// ---- pipeline stages: the public API (dsv4_dev.h "Pipeline stages") ----

struct di_dsv4_dev {
    di_model *m; // borrowed
    int32_t n_stages;
    dev_stage *st[DI_DSV4_DEV_MAX_STAGES]; // owned: stage k holds layers [st[k]->l0, st[k]->l1)
    bool mtp;                              // the MTP block is enabled (on the last stage)
    int32_t n_states;                      // states alive
};

struct di_dsv4_dev_state {
    di_dsv4_dev *d; // borrowed
    int32_t n_stages;
    stage_state *ss[DI_DSV4_DEV_MAX_STAGES]; // owned: stage k's part
    // The host bounce of the hand-over between stages that cannot peer (di_backend_can_peer):
    // [max_rows, NC, D] streams, the first stage's backend's host memory (page-locked on CUDA,
    // allocated portable: every GPU of the process DMAs from it). NULL with one stage, or when
    // every boundary copies directly.
    float *xfer; // owned (host_alloc of ss[0]'s backend)
};

static dev_stage *last_stage(const di_dsv4_dev *d) {
    return d->st[d->n_stages - 1];
}

static stage_state *last_part(const di_dsv4_dev_state *s) {
    return s->ss[s->n_stages - 1];
}

// Host bytes of layer il's weights the dev forward uploads (matrices with their scales, the
// vectors).
static int64_t layer_w_bytes(const di_model *m, const di_dsv4_layer_w *lw) {
    const di_hparams *hp = &m->hp;
    const int64_t f = sizeof(float), nc = hp->hc_mult, D = hp->n_embd;
    int64_t n = di_dev_tensor_bytes(&lw->hc_attn.fn) + di_dev_tensor_bytes(&lw->hc_ffn.fn);
    n += 2 * f * ((2 + nc) * nc + 3) + 2 * f * D;
    n += di_dev_tensor_bytes(&lw->wq_a) + di_dev_tensor_bytes(&lw->wq_b) +
         di_dev_tensor_bytes(&lw->wkv) + di_dev_tensor_bytes(&lw->wo_a) +
         di_dev_tensor_bytes(&lw->wo_b);
    const di_dsv4_compressor_w *cw[2] = {&lw->cmp, &lw->idx_cmp};
    for (int i = 0; i < (lw->ratio == 4 ? 2 : lw->ratio > 0 ? 1 : 0); i++)
        n += di_dev_tensor_bytes(&cw[i]->wkv) + di_dev_tensor_bytes(&cw[i]->wgate) +
             f * ((int64_t)cw[i]->m * cw[i]->c * cw[i]->d + cw[i]->d);
    n += di_dev_tensor_bytes(&lw->idx_wq_b) + di_dev_tensor_bytes(&lw->idx_weights_proj);
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

// ---- the KV-aware split (dev_common.h di_dev_split_mem) ----

typedef struct split_ctx {
    const di_model *m;
    const di_dev_plan *p;
} split_ctx;

// dev_common.h di_dev_stage_cost_fn for V4 stage [l0, l1): its weights (the embedding on the
// first; the head, final norm and head mHC on the last, with the plan's speculation also the MTP
// block, its projections, norms and head mHC and the embedding again, as di_dsv4_dev_mtp_enable
// uploads them), its layers' entries and indexer keys (FP32 or Q4 codes) per block (stage_sizes),
// and the fixed part of the plan's state: n_slots tails (window rings, compressor token rings, the
// page table, the MTP ring with speculation) and max_rows call rows of every pool, and the per-row
// scratch (state_create's buffers; the backend's own op scratch is the reserve's).
static void stage_cost4(const void *ctx, int32_t l0, int32_t l1, int32_t L,
                        di_dev_stage_cost *out) {
    const split_ctx *c = ctx;
    const di_model *m = c->m;
    const di_hparams *hp = &m->hp;
    const di_dev_plan *p = c->p;
    const bool first = l0 == 0, last = l1 == L, mtp = last && p->spec && m->n_mtp_loaded > 0;
    const int64_t f = sizeof(float), W = hp->window, R = p->max_rows, D = hp->n_embd;
    const int64_t nc = hp->hc_mult, Dh = hp->head_dim, DI = hp->index_head_dim;
    const int64_t rb = m->opt.precision == DI_PRECISION_OFFICIAL
                           ? di_backend_kv_row_bytes(hp->head_dim, hp->rope_main.n_dims)
                           : f * Dh;
    int64_t w = 0;
    if (first || mtp) w += di_dev_tensor_bytes(&m->embed);
    if (last)
        w += di_dev_tensor_bytes(&m->head) + di_dev_tensor_bytes(&m->hc_head.fn) + f * (D + nc + 1);
    if (mtp) {
        const di_dsv4_mtp_w *t = &m->mtp[0];
        w += layer_w_bytes(m, &t->block) + di_dev_tensor_bytes(&t->e_proj) +
             di_dev_tensor_bytes(&t->h_proj) + di_dev_tensor_bytes(&t->hc_head.fn) +
             f * (3 * D + nc + 1);
    }
    int64_t blk = 0, slot = f * ((p->n_ctx + p->block_tokens - 1) / p->block_tokens);
    int64_t cap4 = 1;
    for (int32_t il = l0; il < l1; il++) {
        const di_dsv4_layer_w *lw = &m->layers[il];
        w += layer_bytes(m, il);
        slot += W * rb;
        if (lw->ratio <= 0) continue;
        const int64_t E = p->block_tokens / lw->ratio, Rr = (int64_t)lw->cmp.c * lw->ratio;
        blk += E * rb;
        slot += 2 * Rr * lw->cmp.c * lw->cmp.d * f;
        if (lw->ratio == 4) {
            blk += E * key_bytes_of(m);
            slot += 2 * Rr * lw->idx_cmp.c * lw->idx_cmp.d * f;
            if (p->n_ctx / 4 > cap4) cap4 = p->n_ctx / 4;
        }
    }
    if (mtp) slot += W * rb;
    const int64_t H = hp->n_head, G = hp->o_groups, Ro = hp->o_lora_rank;
    const int64_t HI = hp->n_index_head, cw = 2 * (Dh > DI ? Dh : DI);
    int64_t widest = D > hp->q_lora_rank ? D : hp->q_lora_rank;
    if (G * Ro > widest) widest = G * Ro;
    const int64_t row_floats = nc * D + 2 * D + nc + nc * nc + (2 + nc) * nc + hp->q_lora_rank +
                               2 * H * Dh + G * Ro + 2 * cw + HI * DI + HI + cap4 + widest + Dh +
                               hp->index_topk + 4;
    int64_t fixed = (int64_t)(l1 - l0 + (mtp ? 1 : 0)) * R * rb + R * f * row_floats;
    if (last) {
        const int64_t HC = R < HEAD_CHUNK ? R : HEAD_CHUNK;
        fixed += HC * f * (nc * D + D + hp->n_vocab);
    }
    if (mtp) fixed += R * f * (nc * D + nc);
    out->weight_bytes = w;
    out->block_bytes = blk;
    out->fixed_bytes = fixed + (int64_t)p->n_slots * slot;
}

di_status di_dsv4_dev_split_mem(const di_model *m, int32_t n_stages, const int64_t *budget_bytes,
                                di_dev_split_out *out) {
    const int32_t L = m->hp.n_layer;
    if (n_stages < 1 || n_stages > DI_DSV4_DEV_MAX_STAGES || n_stages > L) {
        DI_LOG_ERROR("dev forward: %d pipeline stages for %d layers (1 to min(%d, layers))",
                     n_stages, L, DI_DSV4_DEV_MAX_STAGES);
        return DI_ERR_INVALID;
    }
    const di_dev_plan p = di_dev_plan_of(m, model_block_tokens(m));
    const split_ctx c = {.m = m, .p = &p};
    const int64_t one_seq = (p.n_ctx + p.block_tokens - 1) / p.block_tokens;
    return di_dev_split_mem("dev forward", L, n_stages, stage_cost4, &c, budget_bytes, one_seq,
                            out);
}

void di_dsv4_dev_stage_cost(const di_model *m, int32_t l0, int32_t l1, di_dev_stage_cost *out) {
    const di_dev_plan p = di_dev_plan_of(m, model_block_tokens(m));
    const split_ctx c = {.m = m, .p = &p};
    DI_ASSERT(l0 >= 0 && l0 < l1 && l1 <= m->hp.n_layer);
    stage_cost4(&c, l0, l1, m->hp.n_layer, out);
}

di_status di_dsv4_dev_split(const di_model *m, int32_t n_stages, int32_t *layer0,
                            int64_t *stage_bytes) {
    // The weight balance: the KV-aware split without budgets (the memory every device of the
    // list must hold; dev_common.c's DP over the cuts, every cut legal in V4).
    di_dev_split_out sp;
    const di_status st = di_dsv4_dev_split_mem(m, n_stages, NULL, &sp);
    if (st != DI_OK) return st;
    for (int32_t k = 0; k <= n_stages; k++) layer0[k] = sp.layer0[k];
    for (int32_t k = 0; stage_bytes && k < n_stages; k++) stage_bytes[k] = sp.cost[k].weight_bytes;
    return DI_OK;
}

di_status di_dsv4_dev_create_stages(di_model *m, di_backend *const *b, int32_t n_stages,
                                    di_dsv4_dev **out) {
    const di_hparams *hp = &m->hp;
    if (hp->v41) {
        DI_LOG_ERROR(
            "dev forward: DeepSeek V4.1 models run on model/dsv41_dev.h (this is V4 only)");
        return DI_ERR_UNSUPPORTED;
    }
    if (m->opt.precision != DI_PRECISION_FP32 && m->opt.precision != DI_PRECISION_OFFICIAL) {
        DI_LOG_ERROR("dev forward: unknown precision recipe %d", (int)m->opt.precision);
        return DI_ERR_UNSUPPORTED;
    }
    if (hp->hc_mult > 16 || hp->hc_mult < 1) {
        DI_LOG_ERROR("dev forward: %d mHC streams (at most 16)", hp->hc_mult);
        return DI_ERR_UNSUPPORTED;
    }
    if (n_stages < 1 || n_stages > DI_DSV4_DEV_MAX_STAGES || n_stages > hp->n_layer) {
        DI_LOG_ERROR("dev forward: %d pipeline stages for %d layers (1 to min(%d, layers))",
                     n_stages, hp->n_layer, DI_DSV4_DEV_MAX_STAGES);
        return DI_ERR_INVALID;
    }
    // The split for the plan's state on the memory the backends have free (dev_common.h
    // di_dev_split_mem); the weight balance where some backend cannot say.
    int64_t budget[DI_DSV4_DEV_MAX_STAGES];
    const di_dev_plan plan = di_dev_plan_of(m, model_block_tokens(m));
    const bool known = di_dev_stage_budgets(b, n_stages, plan.reserve_bytes, budget);
    di_dev_split_out sp;
    di_status st = di_dsv4_dev_split_mem(m, n_stages, known ? budget : NULL, &sp);
    if (st != DI_OK) return st;
    if (n_stages > 1) di_dev_split_log("dev forward", &sp, &plan);
    const int32_t *l0 = sp.layer0;
    di_dsv4_dev *d = di_calloc(1, sizeof *d);
    if (!d) return DI_ERR_NOMEM;
    d->m = m;
    for (int32_t k = 0; k < n_stages; k++) {
        st = stage_create(m, b[k], l0[k], l0[k + 1], k == 0, k == n_stages - 1, &d->st[k]);
        if (st != DI_OK) goto fail;
        d->n_stages = k + 1;
        if (n_stages > 1)
            DI_LOG_INFO("dev forward: stage %d of %d: layers [%d, %d)%s%s, %.1f MiB of weights, "
                        "on %s",
                        k, n_stages, l0[k], l0[k + 1], k == 0 ? " + embedding" : "",
                        k == n_stages - 1 ? " + head" : "", sp.cost[k].weight_bytes / 1048576.0,
                        b[k]->desc);
    }
    *out = d;
    return DI_OK;
fail:
    di_dsv4_dev_destroy(d);
    return st;
}

di_status di_dsv4_dev_create(di_model *m, di_backend *b, di_dsv4_dev **out) {
    return di_dsv4_dev_create_stages(m, &b, 1, out);
}

void di_dsv4_dev_destroy(di_dsv4_dev *d) {
    if (!d) return;
    for (int32_t k = 0; k < d->n_stages; k++) stage_destroy(d->st[k]);
    di_free(d);
}

di_backend *di_dsv4_dev_backend(const di_dsv4_dev *d) {
    return last_stage(d)->b;
}

int32_t di_dsv4_dev_n_stages(const di_dsv4_dev *d) {
    return d->n_stages;
}

di_backend *di_dsv4_dev_stage(const di_dsv4_dev *d, int32_t k, int32_t *l0, int32_t *l1) {
    if (k < 0 || k >= d->n_stages) return NULL;
    *l0 = d->st[k]->l0;
    *l1 = d->st[k]->l1;
    return d->st[k]->b;
}

di_status di_dsv4_dev_mtp_enable(di_dsv4_dev *d) {
    di_model *m = d->m;
    if (d->mtp) return DI_OK;
    if (m->n_mtp_loaded == 0 || m->mtp[0].block.ratio != 0) {
        DI_LOG_ERROR("dev forward: the checkpoint has no sliding-window MTP block (mtp.*)");
        return DI_ERR_UNSUPPORTED;
    }
    // States that exist keep no MTP ring (made without it; dsv4_dev.h di_dsv4_dev_mtp_enable).
    di_status st = stage_mtp_enable(last_stage(d));
    if (st == DI_OK) d->mtp = true;
    return st;
}

bool di_dsv4_dev_has_mtp(const di_dsv4_dev *d) {
    return d->mtp;
}

int32_t di_dsv4_dev_block_tokens(const di_dsv4_dev *d) {
    return model_block_tokens(d->m);
}

di_status di_dsv4_dev_sizes(const di_dsv4_dev *d, int32_t n_ctx, int32_t block_tokens,
                            int64_t *block_bytes, int64_t *slot_bytes) {
    if (n_ctx < 1 || check_block_tokens(d->m, block_tokens) != DI_OK) return DI_ERR_INVALID;
    int64_t blk = 0, slot = 0;
    for (int32_t k = 0; k < d->n_stages; k++) {
        int64_t b1, s1;
        stage_sizes(d->st[k], n_ctx, block_tokens, &b1, &s1);
        blk += b1, slot += s1;
    }
    *block_bytes = blk;
    *slot_bytes = slot;
    return DI_OK;
}

// ---- states over the stages ----

void di_dsv4_dev_state_destroy(di_dsv4_dev_state *s) {
    if (!s) return;
    for (int32_t k = 0; k < s->n_stages; k++) stage_state_destroy(s->ss[k]);
    if (s->xfer) s->d->st[0]->b->vt->host_free(s->d->st[0]->b, s->xfer);
    s->d->n_states--;
    di_free(s);
}

di_status di_dsv4_dev_state_create(di_dsv4_dev *d, int32_t n_slots, int32_t n_ctx, int32_t max_rows,
                                   int32_t n_blocks, int32_t block_tokens,
                                   di_dsv4_dev_state **out) {
    const di_dsv4_dev_spec spec = {.mtp = d->mtp, .back_max = 1};
    return di_dsv4_dev_state_create_spec(d, n_slots, n_ctx, max_rows, n_blocks, block_tokens, &spec,
                                         out);
}

di_status di_dsv4_dev_state_create_spec(di_dsv4_dev *d, int32_t n_slots, int32_t n_ctx,
                                        int32_t max_rows, int32_t n_blocks, int32_t block_tokens,
                                        const di_dsv4_dev_spec *spec_in, di_dsv4_dev_state **out) {
    const di_hparams *hp = &d->m->hp;
    di_dsv4_dev_spec spec = *spec_in;
    if (spec.back_max == 0) spec.back_max = 1;
    if (spec.back_max < 1 || spec.back_max > DI_DSV4_ROLLBACK_MAX || (spec.mtp && !d->mtp) ||
        (spec.keep_streams && !spec.mtp)) {
        DI_LOG_ERROR("dev state: rollbacks of %d rows (1 to %d), MTP %s%s, kept streams %s: "
                     "unsupported",
                     spec.back_max, DI_DSV4_ROLLBACK_MAX, spec.mtp ? "on" : "off",
                     spec.mtp && !d->mtp ? " (di_dsv4_dev_mtp_enable first)" : "",
                     spec.keep_streams ? "on (needs MTP)" : "off");
        return DI_ERR_INVALID;
    }
    if (n_slots < 1 || n_ctx < 1 || max_rows < 1 || n_blocks < 0) {
        DI_LOG_ERROR("dev state: %d slots, context %d, %d rows, %d blocks: each must be >= 1 "
                     "(blocks: >= 0)",
                     n_slots, n_ctx, max_rows, n_blocks);
        return DI_ERR_INVALID;
    }
    if (block_tokens == 0) block_tokens = model_block_tokens(d->m);
    if (check_block_tokens(d->m, block_tokens) != DI_OK) return DI_ERR_INVALID;
    di_status st = DI_OK;
    di_dsv4_dev_state *s = di_calloc(1, sizeof *s);
    if (!s) return DI_ERR_NOMEM;
    s->d = d;
    d->n_states++; // until destroy (a failed create included)
    for (int32_t k = 0; k < d->n_stages; k++) {
        st = stage_state_create(d->st[k], n_slots, n_ctx, max_rows, n_blocks, block_tokens, &spec,
                                &s->ss[k]);
        if (st != DI_OK) goto fail;
        s->n_stages = k + 1;
    }
    bool bounce = false;
    for (int32_t k = 1; k < d->n_stages; k++)
        bounce |= !di_backend_can_peer(d->st[k]->b, d->st[k - 1]->b);
    if (bounce) {
        di_backend *b = d->st[0]->b;
        void *p = NULL;
        st = b->vt->host_alloc(
            b, sizeof(float) * (size_t)max_rows * (size_t)hp->hc_mult * (size_t)hp->n_embd, &p);
        if (st != DI_OK) goto fail;
        s->xfer = p;
    }
    *out = s;
    return DI_OK;
fail:
    di_dsv4_dev_state_destroy(s);
    return st;
}

int64_t di_dsv4_dev_state_kv_row_bytes(const di_dsv4_dev_state *s) {
    return s->ss[0]->kv_row_bytes;
}

int64_t di_dsv4_dev_state_index_key_bytes(const di_dsv4_dev_state *s) {
    return s->ss[0]->key_bytes;
}

int64_t di_dsv4_dev_state_bytes(const di_dsv4_dev_state *s) {
    int64_t n = 0;
    for (int32_t k = 0; k < s->n_stages; k++) n += s->ss[k]->n_bytes;
    return n;
}

int32_t di_dsv4_dev_state_n_blocks(const di_dsv4_dev_state *s) {
    return s->ss[0]->n_eblocks;
}

// A block's bytes: the stages' parts in stage order, i.e. every layer's in layer order (the
// layout of one stage).
static di_status block_io(const di_dsv4_dev_state *s, int32_t block, uint8_t *host,
                          block_copy_fn fn) {
    if (block < 0 || block >= s->ss[0]->n_eblocks || !host) {
        DI_LOG_ERROR("dev state: no entry block %d (the state has %d)", block, s->ss[0]->n_eblocks);
        return DI_ERR_INVALID;
    }
    for (int32_t k = 0; k < s->n_stages; k++) {
        di_status st = block_walk(s->ss[k], block, &host, fn);
        if (st != DI_OK) return st;
    }
    return DI_OK;
}

di_status di_dsv4_dev_state_read_block(const di_dsv4_dev_state *s, int32_t block, void *dst) {
    return block_io(s, block, dst, block_down);
}

di_status di_dsv4_dev_state_write_block(di_dsv4_dev_state *s, int32_t block, const void *src) {
    // The walk's host side is only read by an upload.
    return block_io(s, block, (uint8_t *)(uintptr_t)src, block_up);
}

int32_t di_dsv4_dev_n_past(const di_dsv4_dev_state *s, int32_t slot) {
    return slot >= 0 && slot < s->ss[0]->n_slots ? s->ss[0]->n_past[slot] : -1;
}

int32_t di_dsv4_dev_mtp_n_past(const di_dsv4_dev_state *s, int32_t slot) {
    const stage_state *p = last_part(s);
    return p->mtp && slot >= 0 && slot < p->n_slots ? p->mtp_n_past[slot] : -1;
}

// Calls are counted once (every stage decides alike: the same shapes, the same page table
// mirrors; the largest count if a stage's capture failed), a call's costs over every stage.
void di_dsv4_dev_get_graph_stats(const di_dsv4_dev_state *s, di_dsv4_dev_graph_stats *out) {
    di_dsv4_dev_graph_stats g = {0};
    for (int32_t k = 0; k < s->n_stages; k++) {
        di_dsv4_dev_graph_stats p;
        stage_graph_stats(s->ss[k], &p);
#define MAX_OF(f) g.f = p.f > g.f ? p.f : g.f
        MAX_OF(n_direct);
        MAX_OF(n_captured);
        MAX_OF(n_replayed);
        MAX_OF(n_direct_pages);
        MAX_OF(n_cached);
#undef MAX_OF
        g.last_ops += p.last_ops;
        g.last_uploads += p.last_uploads;
        g.last_upload_bytes += p.last_upload_bytes;
        g.n_handover_peer += p.n_handover_peer;
        g.n_handover_host += p.n_handover_host;
        g.last_handover_bytes += p.last_handover_bytes;
        g.last_download_bytes += p.last_download_bytes;
        g.n_download_bytes += p.n_download_bytes;
    }
    *out = g;
}

di_status di_dsv4_dev_forward(di_dsv4_dev_state *s, const di_dsv4_dev_seq *seqs, int32_t n_seq,
                              const int32_t *tokens, const int32_t *logit_rows,
                              int32_t n_logit_rows, float *logits) {
    return di_dsv4_dev_forward_picks(s, seqs, n_seq, tokens, logit_rows, n_logit_rows, logits, NULL,
                                     NULL);
}

di_status di_dsv4_dev_forward_picks(di_dsv4_dev_state *s, const di_dsv4_dev_seq *seqs,
                                    int32_t n_seq, const int32_t *tokens, const int32_t *logit_rows,
                                    int32_t n_logit_rows, float *logits, const uint8_t *greedy,
                                    int32_t *picks) {
    int32_t T = 0, n_upd[DI_DSV4_DEV_MAX_STAGES];
    if (greedy && !picks) {
        DI_LOG_ERROR("dev forward: greedy rows need somewhere to write their picks");
        return DI_ERR_INVALID;
    }
    // Every stage's checks before any stage runs (a stage refuses only what another would).
    for (int32_t k = 0; k < s->n_stages; k++) {
        di_status st = check_call(s->ss[k], seqs, n_seq, tokens, logit_rows, n_logit_rows, logits,
                                  &T, &n_upd[k]);
        if (st != DI_OK) return st;
    }
    // Stage after stage, each copying the streams from the one before (a peer copy, or through
    // s->xfer; the stages' backends are used one after another: stage k + 1 starts when stage k's
    // step has synchronised).
    for (int32_t k = 0; k < s->n_stages; k++) {
        di_status st =
            stage_forward(s->ss[k], seqs, n_seq, tokens, logit_rows, n_logit_rows, logits, greedy,
                          picks, T, n_upd[k], k > 0 ? s->ss[k - 1] : NULL, s->xfer);
        if (st != DI_OK) { // every stage's slots restart (the earlier stages advanced theirs)
            for (int32_t j = 0; j < s->n_stages; j++) {
                s->ss[j]->x_rows = 0;
                for (int32_t i = 0; i < n_seq; i++) s->ss[j]->n_past[seqs[i].slot] = -1;
            }
            return st;
        }
    }
    return DI_OK;
}

// The graphs of steps of r rows per sequence (dsv4_dev.h di_dsv4_dev_prepare_decode, _verify):
// every stage's, captured by the same calls.
static di_status prepare_graphs(di_dsv4_dev_state *S, int32_t max_seqs, int32_t r) {
    const stage_state *s = last_part(S);
    if (!s->graphs_on) return DI_OK;
    int32_t n_max = max_seqs < s->n_graphs ? max_seqs : s->n_graphs;
    if (n_max * r > HEAD_CHUNK) n_max = HEAD_CHUNK / r;
    if (n_max * r > s->max_rows) n_max = s->max_rows / r;
    // Shared blocks: every slot gets block 0, which r tokens at position 0 leave as it was when
    // they close no window (every ratio > r); else no graph is prepared (captured when used).
    for (int32_t j = 0; j < S->n_stages; j++)
        for (int k = 0; k < S->ss[j]->n_cls; k++)
            if (S->ss[j]->cls[k].ratio > 0 && S->ss[j]->cls[k].ratio <= r) return DI_OK;
    const int64_t V = s->d->m->hp.n_vocab;
    di_dsv4_dev_seq *seqs = di_malloc(sizeof *seqs * (size_t)(n_max > 0 ? n_max : 1));
    int32_t *ids = di_calloc((size_t)(n_max * r + 1), sizeof *ids); // token 0 everywhere
    int32_t *rows = di_malloc(sizeof *rows * (size_t)(n_max * r + 1));
    float *logits = di_malloc(sizeof *logits * (size_t)(n_max * r + 1) * (size_t)V);
    di_status st = seqs && ids && rows && logits ? DI_OK : DI_ERR_NOMEM;
    // Two steps of each size at position 0: the first runs directly, the second is captured.
    static const int32_t block0 = 0;
    for (int32_t n = 1; n <= n_max && st == DI_OK && s->graphs_on; n++) {
        for (int32_t i = 0; i < n; i++)
            seqs[i] = (di_dsv4_dev_seq){.slot = i,
                                        .pos = 0,
                                        .n_tok = r,
                                        .blocks = s->shared ? &block0 : NULL,
                                        .n_blocks = s->shared ? 1 : 0};
        for (int32_t i = 0; i < n * r; i++) rows[i] = i;
        const struct dev_graph *g = &s->graphs[(r - 1) * s->n_graphs + n - 1];
        for (int pass = 0; pass < 2 && st == DI_OK && !g->graph; pass++)
            st = di_dsv4_dev_forward(S, seqs, n, ids, rows, n * r, logits);
    }
    di_free(seqs);
    di_free(ids);
    di_free(rows);
    di_free(logits);
    return st;
}

di_status di_dsv4_dev_prepare_decode(di_dsv4_dev_state *s, int32_t max_seqs) {
    return prepare_graphs(s, max_seqs, 1);
}

di_status di_dsv4_dev_prepare_verify(di_dsv4_dev_state *s, int32_t max_seqs) {
    return prepare_graphs(s, max_seqs, 2);
}

di_status di_dsv4_dev_mtp_forward(di_dsv4_dev_state *s, const di_dsv4_dev_seq *seqs, int32_t n_seq,
                                  const int32_t *x_rows, const int32_t *ids_next,
                                  const int32_t *logit_rows, int32_t n_logit_rows, float *logits) {
    return di_dsv4_dev_mtp_forward_picks(s, seqs, n_seq, x_rows, ids_next, logit_rows, n_logit_rows,
                                         logits, NULL, NULL);
}

di_status di_dsv4_dev_mtp_forward_picks(di_dsv4_dev_state *s, const di_dsv4_dev_seq *seqs,
                                        int32_t n_seq, const int32_t *x_rows,
                                        const int32_t *ids_next, const int32_t *logit_rows,
                                        int32_t n_logit_rows, float *logits, const uint8_t *greedy,
                                        int32_t *picks) {
    if (greedy && !picks) {
        DI_LOG_ERROR("dev mtp: greedy rows need somewhere to write their picks");
        return DI_ERR_INVALID;
    }
    // The MTP block runs on the last stage only (its main streams are that stage's): the other
    // stages' last-call costs are none.
    for (int32_t k = 0; k < s->n_stages - 1; k++)
        s->ss[k]->stats.last_ops = s->ss[k]->stats.last_uploads =
            s->ss[k]->stats.last_upload_bytes = s->ss[k]->stats.last_download_bytes = 0;
    return stage_mtp_forward(last_part(s), seqs, n_seq, x_rows, ids_next, logit_rows, n_logit_rows,
                             logits, greedy, picks);
}

// Checked on every stage first (the MTP ring on the last), then applied on all: nothing changes
// when one refuses.
static di_status rollback(di_dsv4_dev_state *s, int32_t slot, int32_t pos, int32_t mtp_pos) {
    for (int32_t k = 0; k < s->n_stages; k++) {
        di_status st = check_rollback(s->ss[k], slot, pos, mtp_pos);
        if (st != DI_OK) return st;
    }
    for (int32_t k = 0; k < s->n_stages; k++) stage_rollback(s->ss[k], slot, pos, mtp_pos);
    return DI_OK;
}

di_status di_dsv4_dev_rollback(di_dsv4_dev_state *s, int32_t slot, int32_t pos) {
    return rollback(s, slot, pos, -1);
}

di_status di_dsv4_dev_rollback_mtp(di_dsv4_dev_state *s, int32_t slot, int32_t pos,
                                   int32_t mtp_pos) {
    if (mtp_pos < 0 || !last_part(s)->mtp) {
        DI_LOG_ERROR("dev rollback: slot %d: MTP position %d (%s)", slot, mtp_pos,
                     last_part(s)->mtp ? "negative" : "the state has no MTP ring");
        return DI_ERR_INVALID;
    }
    return rollback(s, slot, pos, mtp_pos);
}

// ---- tail snapshots over the stages: the header once, then the stages' parts in order ----

static int32_t tail_layers(const di_dsv4_dev *d) {
    return d->m->hp.n_layer + (d->mtp ? 1 : 0);
}

di_status di_dsv4_dev_tail_check(const di_dsv4_dev *d, int32_t pos, const void *src) {
    tail_head th;
    memcpy(&th, src, sizeof th);
    return th.magic == TAIL_MAGIC && th.pos == pos && th.n_layer == tail_layers(d) &&
                   th.kv_row_bytes == (int32_t)row_bytes_of(d->st[0])
               ? DI_OK
               : DI_ERR_INVALID;
}

size_t di_dsv4_dev_tail_bytes(const di_dsv4_dev *d) {
    size_t n = sizeof(tail_head);
    for (int32_t k = 0; k < d->n_stages; k++) n += stage_tail_bytes(d->st[k]);
    return n;
}

// A state made without the MTP ring of its dev's snapshots (made before di_dsv4_dev_mtp_enable,
// or with a spec without MTP): DI_ERR_INVALID (logged).
static di_status tail_layout(const di_dsv4_dev_state *s) {
    if (last_part(s)->mtp == last_stage(s->d)->mtp) return DI_OK;
    DI_LOG_ERROR("dev tail: the state has %s MTP ring, its dev's snapshots %s one",
                 last_part(s)->mtp ? "an" : "no", last_stage(s->d)->mtp ? "hold" : "do not hold");
    return DI_ERR_INVALID;
}

di_status di_dsv4_dev_tail_save(di_dsv4_dev_state *s, int32_t slot, void *dst) {
    if (tail_layout(s) != DI_OK) return DI_ERR_INVALID;
    const int32_t pos = di_dsv4_dev_n_past(s, slot);
    for (int32_t k = 0; k < s->n_stages; k++) {
        di_status st = check_tail_pos(s->ss[k], slot, pos);
        if (st == DI_OK) st = stage_tail_reach(s->ss[k], slot, pos);
        if (st != DI_OK) return st;
    }
    uint8_t *out = dst;
    size_t off = sizeof(tail_head);
    for (int32_t k = 0; k < s->n_stages; k++) {
        di_status st = stage_tail_save(s->ss[k], slot, pos, out + off);
        if (st != DI_OK) return st;
        off += stage_tail_bytes(s->d->st[k]);
    }
    const tail_head th = {TAIL_MAGIC, pos, tail_layers(s->d), (int32_t)s->ss[0]->kv_row_bytes};
    memcpy(out, &th, sizeof th);
    return DI_OK;
}

di_status di_dsv4_dev_tail_restore(di_dsv4_dev_state *s, int32_t slot, int32_t pos,
                                   const void *src) {
    if (tail_layout(s) != DI_OK) return DI_ERR_INVALID;
    for (int32_t k = 0; k < s->n_stages; k++) {
        di_status st = check_tail_pos(s->ss[k], slot, pos);
        if (st != DI_OK) return st;
    }
    if (di_dsv4_dev_tail_check(s->d, pos, src) != DI_OK) {
        tail_head th;
        memcpy(&th, src, sizeof th);
        DI_LOG_ERROR("dev tail: not a snapshot of this state at position %d (magic %08x, position "
                     "%d, %d layers, KV rows of %d bytes)",
                     pos, th.magic, th.pos, th.n_layer, th.kv_row_bytes);
        return DI_ERR_INVALID;
    }
    const uint8_t *in = src;
    size_t off = sizeof(tail_head);
    for (int32_t k = 0; k < s->n_stages; k++) {
        di_status st = stage_tail_restore(s->ss[k], slot, pos, in + off);
        if (st != DI_OK) { // every stage's slot restarts
            for (int32_t j = 0; j < s->n_stages; j++) s->ss[j]->n_past[slot] = -1;
            return st;
        }
        off += stage_tail_bytes(s->d->st[k]);
    }
    return DI_OK;
}

// ---- model wiring ----

di_status di_dsv4_dev_attach_stages(di_model *m, di_backend *const *b, int32_t n_stages) {
    if (m->dev) {
        DI_LOG_ERROR("dev forward: the model already has one attached");
        return DI_ERR_INVALID;
    }
    di_dsv4_dev *d = NULL;
    di_status st = di_dsv4_dev_create_stages(m, b, n_stages, &d);
    if (st != DI_OK) return st;
    m->dev = d;
    DI_LOG_INFO("device-resident forward on %s%s: sessions (MTP ones too, when the MTP block is "
                "a sliding-window one) and the serving engine run every layer, their KV and "
                "compressor state there",
                b[0]->desc, n_stages > 1 ? " and the next stages' backends" : "");
    return DI_OK;
}

di_status di_dsv4_dev_attach(di_model *m, di_backend *b) {
    return di_dsv4_dev_attach_stages(m, &b, 1);
}
