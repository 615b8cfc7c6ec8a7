// dsv41_state — the per-sequence state of DeepSeek V4.1 (deepseek-v41.md §5.1): window rings of
// every backbone layer and DSpark block (W + DI_DSV41_ROLLBACK_MAX rows, so rejected speculative
// rows never overwrite rows still needed), the compressed entries and index keys of the kv
// sources in pages of block_tokens positions (owned, or the engine's pool blocks bound to the
// session), all three stored as packed Q8 / Q4e / Q4 codes (dsv41.h), the FP32 (C, Z) of recent
// even positions (pending groups, kept for rollback), the Engram history; rollback (§5.3), prefix
// restarts and the byte serialisation.
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/buf.h"
#include "base/hash.h"
#include "base/log.h"
#include "base/mem.h"
#include "model/dsv41.h"
#include "tensor/quant_ref.h" // di_quant_*_row_bytes

// ---- create / destroy ----

// Positions per page: the kv_manager's rule (di_kv_block_tokens): the lcm of the compression
// ratios (every group closes at a page boundary), rounded up to at least the window.
static int32_t block_tokens(const di_hparams *hp) {
    int32_t lcm = 1;
    for (int il = 0; il < hp->n_layer; il++) {
        int32_t r = hp->compress_ratio[il], a = lcm, b = r;
        if (r <= 0) continue;
        while (b) {
            int32_t t = a % b;
            a = b, b = t;
        }
        lcm = lcm / a * r;
    }
    return lcm * ((hp->window + lcm - 1) / lcm);
}

// The page layout: per kv source its per_page packed entries, then as many packed index keys, each
// run at a multiple of 64 bytes (cache lines; no padding at all on V4.1-Flash, whose runs are
// multiples of 64 already). Fills src[il].per_page / off_main / off_idx when src is given; returns
// the page's bytes.
static size_t page_layout(const di_hparams *hp, int32_t bt, di_dsv41_src *src) {
    const size_t ent = di_quant_q4e_row_bytes(hp->head_dim, DI_DSV41_ENT_BLOCK);
    const size_t key = di_quant_q4_row_bytes(hp->index_head_dim, DI_DSV41_KEY_BLOCK);
    size_t off = 0;
    for (int il = 0; il < hp->n_layer; il++) {
        if (!hp->kv_source[il]) continue;
        const size_t per = (size_t)(bt / hp->compress_ratio[il]);
        if (src) {
            src[il].per_page = (int32_t)per;
            src[il].off_main = (int64_t)off;
        }
        off += (per * ent + 63) / 64 * 64;
        if (src) src[il].off_idx = (int64_t)off;
        off += (per * key + 63) / 64 * 64;
    }
    return off;
}

static int32_t n_state(const di_session *s) {
    return s->model->hp.n_layer + (s->mtp ? s->model->n_mtp_loaded : 0);
}

di_status di_dsv41_state_create(di_session *s) {
    const di_model *m = s->model;
    const di_hparams *hp = &m->hp;
    if (hp->n_engram > 0 && !m->v41->cmap) {
        DI_LOG_ERROR("session: the checkpoint's Engram layers need the compressed token map: "
                     "tokenizer.json (the map is built from it) or engram/token_map.safetensors "
                     "in the model directory");
        return DI_ERR_INVALID;
    }
    di_dsv41_state *st = di_calloc(1, sizeof *st);
    if (!st) return DI_ERR_NOMEM;
    s->v41 = st;
    st->ring_rows = hp->window + DI_DSV41_ROLLBACK_MAX;
    st->dspark = s->mtp;
    st->n_state_layers = n_state(s);
    st->ring_row_bytes = (int32_t)di_quant_q8_row_bytes(hp->head_dim, DI_DSV41_WIN_BLOCK);
    st->ent_bytes = (int32_t)di_quant_q4e_row_bytes(hp->head_dim, DI_DSV41_ENT_BLOCK);
    st->key_bytes = (int32_t)di_quant_q4_row_bytes(hp->index_head_dim, DI_DSV41_KEY_BLOCK);
    st->ring = di_calloc((size_t)st->n_state_layers, sizeof *st->ring);
    st->src = di_calloc((size_t)hp->n_layer, sizeof *st->src);
    if (!st->ring || !st->src) return DI_ERR_NOMEM;
    // Zeroed Q8 rows decode to +0 (code 0 times 2^-127), as the FP32 rings were.
    for (int il = 0; il < st->n_state_layers; il++) {
        st->ring[il] = di_aligned_calloc((size_t)st->ring_rows * (size_t)st->ring_row_bytes);
        if (!st->ring[il]) return DI_ERR_NOMEM;
    }
    st->block_tokens = block_tokens(hp);
    page_layout(hp, st->block_tokens, st->src);
    for (int il = 0; il < hp->n_layer; il++) {
        if (!hp->kv_source[il] || hp->compress_ratio[il] != 2) continue;
        st->src[il].cz =
            di_calloc((size_t)DI_DSV41_CZ_SLOTS * 2 * (size_t)hp->head_dim, sizeof(float));
        if (!st->src[il].cz) return DI_ERR_NOMEM;
    }
    return DI_OK;
}

static void free_own_pages(di_dsv41_state *st) {
    for (int32_t i = 0; i < st->n_pages && st->own_pages; i++) di_aligned_free(st->own_pages[i]);
    di_free(st->own_pages);
    st->own_pages = NULL;
    st->cap_own = 0;
}

void di_dsv41_state_destroy(di_session *s) {
    di_dsv41_state *st = s->v41;
    if (!st) return;
    for (int il = 0; st->ring && il < st->n_state_layers; il++) di_aligned_free(st->ring[il]);
    di_free(st->ring);
    for (int il = 0; st->src && il < s->model->hp.n_layer; il++) di_free(st->src[il].cz);
    free_own_pages(st);
    di_free(st->src);
    di_free(st->hist);
    di_free(st);
    s->v41 = NULL;
}

// ---- capacity ----

static bool grow(void **p, size_t bytes) {
    void *q = di_realloc(*p, bytes ? bytes : 1);
    if (!q) return false;
    *p = q;
    return true;
}

// Entries one kv source holds for positions < end, at most (the indexer's per-thread scratch).
static int64_t max_entries(const di_hparams *hp, int64_t end) {
    int64_t max_ent = 0;
    for (int il = 0; il < hp->n_layer; il++)
        if (hp->kv_source[il] && end / hp->compress_ratio[il] > max_ent)
            max_ent = end / hp->compress_ratio[il];
    return max_ent;
}

size_t di_dsv41_page_bytes(const di_model *m, int32_t block_tokens) {
    return page_layout(&m->hp, block_tokens, NULL);
}

void di_dsv41_page_offsets(const di_model *m, int32_t block_tokens, int il, int64_t *off_main,
                           int64_t *off_idx) {
    const di_hparams *hp = &m->hp;
    DI_ASSERT(il >= 0 && il < hp->n_layer && hp->kv_source[il]);
    di_dsv41_src src[DI_MAX_LAYERS];
    page_layout(hp, block_tokens, src);
    *off_main = src[il].off_main;
    *off_idx = src[il].off_idx;
}

// Pages for the entries of positions < end, history for positions < end_hist.
di_status di_dsv41_reserve_state(di_session *s, int64_t end, int64_t end_hist) {
    di_dsv41_state *st = s->v41;
    const int64_t need = (end + st->block_tokens - 1) / st->block_tokens;
    if (need > st->n_pages) {
        if (st->bound) {
            DI_LOG_ERROR("forward: the V4.1 sequence's blocks hold %lld positions; the call needs "
                         "%lld",
                         (long long)st->n_pages * st->block_tokens, (long long)end);
            return DI_ERR_NO_KV;
        }
        if (need > st->cap_own) {
            int32_t cap = st->cap_own ? st->cap_own : 4;
            while (cap < need) cap *= 2;
            if (!grow((void **)&st->own_pages, sizeof(uint8_t *) * (size_t)cap))
                return DI_ERR_NOMEM;
            st->cap_own = cap;
            st->pages = st->own_pages;
        }
        const size_t pb = di_dsv41_page_bytes(s->model, st->block_tokens);
        while (st->n_pages < need) {
            uint8_t *pg = di_aligned_calloc(pb ? pb : 1);
            if (!pg) return DI_ERR_NOMEM;
            st->own_pages[st->n_pages++] = pg;
        }
    }
    if (end_hist < end) end_hist = end;
    if (end_hist > st->cap_hist) {
        int64_t cap = st->cap_hist ? st->cap_hist : 256;
        while (cap < end_hist) cap *= 2;
        if (!grow((void **)&st->hist, sizeof(int32_t) * (size_t)cap)) return DI_ERR_NOMEM;
        st->cap_hist = cap;
    }
    return DI_OK;
}

void di_dsv41_bind_pages(di_session *s, uint8_t *const *pages, int32_t n_pages) {
    di_dsv41_state *st = s->v41;
    if (!st->bound) {
        free_own_pages(st);
        st->bound = true;
    }
    st->pages = pages;
    st->n_pages = n_pages;
}

int64_t di_dsv41_capacity(const di_session *s) {
    return (int64_t)s->v41->n_pages * s->v41->block_tokens;
}

di_status di_dsv41_ws_reserve(di_dsv4_ws *ws, const di_model *m, int32_t n_rows, int64_t n_pos) {
    const di_hparams *hp = &m->hp;
    if (!ws->v41 && !(ws->v41 = di_calloc(1, sizeof *ws->v41))) return DI_ERR_NOMEM;
    di_dsv41_rows *w = ws->v41;
    const int64_t max_ent = max_entries(hp, n_pos);
    if (max_ent > w->cap_ent) {
        int64_t cap = w->cap_ent ? w->cap_ent : 64;
        while (cap < max_ent) cap *= 2;
        size_t nth = (size_t)m->cpu.n_threads;
        if (!grow((void **)&w->scores, sizeof(float) * nth * (size_t)cap) ||
            !grow((void **)&w->blk, sizeof(float) * nth * (size_t)(cap + 1)))
            return DI_ERR_NOMEM;
        w->cap_ent = cap;
        w->ent_bytes = (int64_t)nth * 2 * (int64_t)sizeof(float);
    }
    // Decoded keys per thread: the attention's keys of one query (its window: W rows, or W
    // context rows + the block's rows in a DSpark block; and its top-k entries), and the
    // indexer's index keys of one sequence (up to DI_DSV41_IKEY_CACHE of them, decoded once for
    // all the rows a thread scores, then a chunk for keys beyond).
    const size_t nth = (size_t)m->cpu.n_threads;
    const size_t attn_keys = (size_t)(hp->window + hp->dspark_block_size + hp->index_topk);
    if (!w->keys) {
        w->keys = di_aligned_alloc(sizeof(float) * attn_keys * (size_t)hp->head_dim * nth);
        if (!w->keys) return DI_ERR_NOMEM;
        w->cap_keys = (int32_t)attn_keys;
    }
    const int32_t cap_ik =
        (int32_t)(w->cap_ent < DI_DSV41_IKEY_CACHE ? w->cap_ent : DI_DSV41_IKEY_CACHE);
    if (cap_ik > w->cap_ikeys) { // contents are per call: nothing to keep
        di_aligned_free(w->ikeys);
        w->ikeys = di_aligned_alloc(sizeof(float) * (size_t)(cap_ik + DI_DSV4_KEY_CHUNK) *
                                    (size_t)hp->index_head_dim * nth);
        w->cap_ikeys = w->ikeys ? cap_ik : 0;
        if (!w->ikeys) return DI_ERR_NOMEM;
    }
    w->key_bytes =
        (int64_t)(sizeof(float) * nth *
                  (attn_keys * (size_t)hp->head_dim +
                   (size_t)(w->cap_ikeys + DI_DSV4_KEY_CHUNK) * (size_t)hp->index_head_dim));
    if (n_rows > w->cap_rows) {
        size_t T = (size_t)n_rows, nc = (size_t)hp->hc_mult, D = (size_t)hp->n_embd;
        const size_t ring_bytes = di_quant_q8_row_bytes(hp->head_dim, DI_DSV41_WIN_BLOCK);
        size_t n_col = (size_t)m->v41->hash.n_col;
        if (!grow((void **)&w->topk, sizeof(int32_t) * T * (size_t)hp->index_topk) ||
            !grow((void **)&w->n_topk, sizeof(int32_t) * T) ||
            !grow((void **)&w->cand, sizeof(int32_t) * T * (size_t)hp->candidate_topk_blocks) ||
            !grow((void **)&w->n_cand, sizeof(int32_t) * T) ||
            !grow((void **)&w->pre, sizeof(float) * T * nc) ||
            !grow((void **)&w->pre_attn, sizeof(float) * T * nc) ||
            !grow((void **)&w->eg_rows, sizeof(int64_t) * T * (size_t)hp->n_engram * n_col) ||
            !grow((void **)&w->eg_in, sizeof(float) * T * n_col * (size_t)hp->engram_head_dim) ||
            !grow((void **)&w->eg_kv, sizeof(float) * T * (nc + 1) * D) ||
            !grow((void **)&w->taps, sizeof(float) * T * (size_t)hp->n_dspark_target * D) ||
            !grow((void **)&w->seqs, sizeof(di_dsv4_seq) * T) ||
            !grow((void **)&w->n_out, sizeof(int32_t) * T) ||
            !grow((void **)&w->tokens, sizeof(int32_t) * T) ||
            !grow((void **)&w->kv_packed, T * ring_bytes))
            return DI_ERR_NOMEM;
        w->cap_rows = n_rows;
        w->row_bytes = (int64_t)sizeof(di_dsv4_seq) + (int64_t)ring_bytes +
                       (int64_t)sizeof(int32_t) * (hp->index_topk + hp->candidate_topk_blocks + 4) +
                       (int64_t)sizeof(float) * (int64_t)(2 * nc + n_col * hp->engram_head_dim +
                                                          (nc + 1) * D + hp->n_dspark_target * D) +
                       (int64_t)sizeof(int64_t) * hp->n_engram * (int64_t)n_col;
    }
    // Attention scores per thread: window + top-k (+ the DSpark block rows).
    return di_dsv4_ws_reserve(ws, m, n_rows, max_ent + hp->dspark_block_size, false);
}

di_status di_dsv41_ws_reserve_draft(di_dsv4_ws *ws, const di_model *m, int32_t n) {
    const di_hparams *hp = &m->hp;
    if (!ws->v41 && !(ws->v41 = di_calloc(1, sizeof *ws->v41))) return DI_ERR_NOMEM;
    di_dsv41_rows *w = ws->v41;
    if (n <= w->cap_draft) return DI_OK;
    const size_t per = (size_t)(2 * (int64_t)hp->n_vocab + hp->n_embd + hp->dspark_markov_rank);
    if (!grow((void **)&w->draft, sizeof(float) * per * (size_t)n)) return DI_ERR_NOMEM;
    w->cap_draft = n;
    w->draft_bytes = (int64_t)(sizeof(float) * per) * n;
    return DI_OK;
}

void di_dsv41_ws_free(di_dsv4_ws *ws) {
    di_dsv41_rows *w = ws->v41;
    if (!w) return;
    di_free(w->topk);
    di_free(w->n_topk);
    di_free(w->cand);
    di_free(w->n_cand);
    di_free(w->pre);
    di_free(w->pre_attn);
    di_free(w->eg_rows);
    di_free(w->eg_in);
    di_free(w->eg_kv);
    di_free(w->taps);
    di_free(w->scores);
    di_free(w->blk);
    di_free(w->seqs);
    di_free(w->n_out);
    di_free(w->tokens);
    di_free(w->kv_packed);
    di_aligned_free(w->keys);
    di_aligned_free(w->ikeys);
    di_free(w->draft);
    di_free(w);
    ws->v41 = NULL;
}

int64_t di_dsv41_ws_bytes(const di_dsv4_ws *ws) {
    const di_dsv41_rows *w = ws->v41;
    if (!w) return 0;
    return (int64_t)sizeof *w + w->row_bytes * w->cap_rows + w->ent_bytes * (w->cap_ent + 1) +
           w->key_bytes + w->draft_bytes;
}

// Capacity for positions < end and a workspace for calls of n_tok rows.
static di_status reserve(di_session *s, int64_t end, int32_t n_tok) {
    di_status st = di_dsv41_reserve_state(s, s->v41->bound ? 0 : end, end);
    if (st != DI_OK) return st;
    return di_dsv41_ws_reserve(di_dsv41_ws(s), s->model, n_tok, end);
}

di_status di_dsv41_reserve(di_session *s, int32_t n_tok) {
    const int64_t end = (int64_t)s->pos + n_tok;
    di_status st = di_dsv41_reserve_state(s, end, end);
    if (st != DI_OK) return st;
    return di_dsv41_ws_reserve(di_dsv41_ws(s), s->model, n_tok, end);
}

di_status di_dsv41_reserve_ctx(di_session *s, int32_t n_ctx, int32_t n_tok) {
    return reserve(s, n_ctx, n_tok);
}

int64_t di_dsv41_state_bytes(const di_session *s) {
    const di_hparams *hp = &s->model->hp;
    const di_dsv41_state *st = s->v41;
    const int64_t Dh = hp->head_dim, f = sizeof(float);
    int64_t b = (int64_t)st->n_state_layers * st->ring_rows * st->ring_row_bytes;
    for (int il = 0; il < hp->n_layer; il++)
        if (st->src[il].cz) b += (int64_t)DI_DSV41_CZ_SLOTS * 2 * Dh * f;
    if (!st->bound)
        b += (int64_t)st->n_pages * (int64_t)di_dsv41_page_bytes(s->model, st->block_tokens);
    b += st->cap_hist * (int64_t)sizeof(int32_t);
    // Its own workspace (dsv4_state.c: scratch, selections, row maps, attention scores, the
    // V4.1 per-row scratch).
    if (!s->ws_shared) b += di_dsv4_ws_bytes(&s->ws);
    return b;
}

void di_dsv41_share_ws(di_session *s, di_dsv4_ws *ws) {
    di_dsv4_ws_free(&s->ws);
    s->ws_shared = ws;
}

// ---- rollback (§5.3) ----

di_status di_dsv41_rollback(di_session *s, int32_t n) {
    // The window ring keeps DI_DSV41_ROLLBACK_MAX rows more than a query reads and the (C, Z)
    // slots as many positions (di_session_rollback_begin's bound).
    if (!s->v41) {
        DI_LOG_ERROR("rollback: not a DeepSeek V4.1 session");
        return DI_ERR_INVALID;
    }
    bool done;
    di_status rs = di_session_rollback_begin(s, n, DI_DSV41_ROLLBACK_MAX, &done);
    if (rs != DI_OK || done) return rs;
    const di_hparams *hp = &s->model->hp;
    di_dsv41_state *st = s->v41;
    const int32_t pos = s->pos - n;
    // Entries of groups completed by a rejected token go; a group left half full is pending
    // again, its (C, Z) still in its slot (compressor in dsv41_attn.c). Window rows of rejected
    // positions lie in slots no kept query reads (the ring has DI_DSV41_ROLLBACK_MAX spare rows).
    for (int il = 0; il < hp->n_layer; il++)
        if (hp->kv_source[il]) st->src[il].n_entries = pos / hp->compress_ratio[il];
    if (st->dspark_pos > pos) st->dspark_pos = pos;
    s->pos = pos;
    return DI_OK;
}

// ---- prefix restarts ----

di_status di_dsv41_restart(di_session *s, int64_t hit, int32_t pos, const int32_t *tokens) {
    const di_model *m = s->model;
    const di_hparams *hp = &m->hp;
    di_dsv41_state *st = s->v41;
    di_session_reset(s);
    if (hit < 0 || hit % st->block_tokens != 0 || hit > di_dsv41_capacity(s) ||
        hit > s->n_ctx_max || pos < 0 || pos > hit) {
        DI_LOG_ERROR("session: cannot restart on a prefix of %lld positions at position %d (pages "
                     "of %d positions hold %lld; at most %d positions)",
                     (long long)hit, pos, st->block_tokens, (long long)di_dsv41_capacity(s),
                     s->n_ctx_max);
        return DI_ERR_INVALID;
    }
    di_status r = di_dsv41_reserve_state(s, hit, hit); // the history (the engine's slots have it)
    if (r != DI_OK) return r;
    for (int il = 0; il < st->n_state_layers; il++)
        memset(st->ring[il], 0, (size_t)st->ring_rows * (size_t)st->ring_row_bytes);
    if (hp->n_engram > 0)
        for (int64_t p = 0; p < hit; p++) st->hist[p] = m->v41->cmap[tokens[p]];
    for (int il = 0; il < hp->n_layer; il++)
        if (hp->kv_source[il]) st->src[il].n_entries = hit / hp->compress_ratio[il];
    s->pos = pos;
    // The rings hold no row below pos (a tail load's: what the saving session fed past it is
    // unknown): a rollback below pos is refused.
    s->hw = pos + DI_DSV41_ROLLBACK_MAX;
    st->dspark_pos = pos;
    return DI_OK;
}

// ---- tail snapshots ----

size_t di_dsv41_tail_bytes(const di_session *s) {
    const di_hparams *hp = &s->model->hp;
    const di_dsv41_state *st = s->v41;
    size_t b = (size_t)st->n_state_layers * (size_t)st->ring_rows * (size_t)st->ring_row_bytes;
    for (int il = 0; il < hp->n_layer; il++)
        if (st->src[il].cz)
            b += (size_t)DI_DSV41_CZ_SLOTS * 2 * (size_t)hp->head_dim * sizeof(float);
    return b;
}

void di_dsv41_tail_save(const di_session *s, uint8_t *out) {
    const di_hparams *hp = &s->model->hp;
    const di_dsv41_state *st = s->v41;
    const size_t ring = (size_t)st->ring_rows * (size_t)st->ring_row_bytes;
    const size_t cz = (size_t)DI_DSV41_CZ_SLOTS * 2 * (size_t)hp->head_dim * sizeof(float);
    for (int il = 0; il < st->n_state_layers; il++, out += ring) memcpy(out, st->ring[il], ring);
    for (int il = 0; il < hp->n_layer; il++)
        if (st->src[il].cz) memcpy(out, st->src[il].cz, cz), out += cz;
}

di_status di_dsv41_tail_load(di_session *s, const uint8_t *tail, int64_t hit, int32_t pos,
                             const int32_t *tokens) {
    di_status r = di_dsv41_restart(s, hit, pos, tokens);
    if (r != DI_OK) return r;
    const di_hparams *hp = &s->model->hp;
    di_dsv41_state *st = s->v41;
    const size_t ring = (size_t)st->ring_rows * (size_t)st->ring_row_bytes;
    const size_t cz = (size_t)DI_DSV41_CZ_SLOTS * 2 * (size_t)hp->head_dim * sizeof(float);
    for (int il = 0; il < st->n_state_layers; il++, tail += ring) memcpy(st->ring[il], tail, ring);
    for (int il = 0; il < hp->n_layer; il++)
        if (st->src[il].cz) memcpy(st->src[il].cz, tail, cz), tail += cz;
    return DI_OK;
}

// ---- serialisation ----
// Layout: {magic "D41S", version, model fingerprint, pos, dspark_pos, mtp}, rings of every state
// layer (packed Q8 rows), per kv source {n_entries, packed entries, packed index keys, (C, Z)
// slots}, Engram history [pos], then an FNV-1a 64 checksum of everything before it. Version 2:
// the packed rows (version 1 held FP32 rows and is refused).

#define STATE_MAGIC 0x53313444u // "D41S"
#define STATE_VERSION 2u

static uint64_t fingerprint(const di_model *m) {
    return di_fnv1a(&m->hp, sizeof m->hp, DI_FNV1A_INIT);
}

di_status di_dsv41_save(const di_session *s, void **bytes, size_t *n_bytes) {
    const di_hparams *hp = &s->model->hp;
    const di_dsv41_state *st = s->v41;
    const size_t Dh = (size_t)hp->head_dim;
    di_buf b;
    di_buf_init(&b);
    uint32_t hdr[2] = {STATE_MAGIC, STATE_VERSION};
    uint64_t fp = fingerprint(s->model);
    int32_t pos[2] = {s->pos, st->dspark_pos};
    uint8_t mtp = s->mtp;
    di_status r = di_buf_append(&b, hdr, sizeof hdr);
    if (!r) r = di_buf_append(&b, &fp, sizeof fp);
    if (!r) r = di_buf_append(&b, pos, sizeof pos);
    if (!r) r = di_buf_append(&b, &mtp, 1);
    for (int il = 0; !r && il < st->n_state_layers; il++)
        r = di_buf_append(&b, st->ring[il], (size_t)st->ring_rows * (size_t)st->ring_row_bytes);
    for (int il = 0; !r && il < hp->n_layer; il++) {
        if (!hp->kv_source[il]) continue;
        const di_dsv41_src *src = &st->src[il];
        size_t ne = (size_t)src->n_entries;
        r = di_buf_append(&b, &src->n_entries, sizeof src->n_entries);
        for (size_t w = 0; !r && w < ne; w++)
            r = di_buf_append(&b, di_dsv41_entry(st, src, (int64_t)w), (size_t)st->ent_bytes);
        for (size_t w = 0; !r && w < ne; w++)
            r = di_buf_append(&b, di_dsv41_key(st, src, (int64_t)w), (size_t)st->key_bytes);
        if (!r && src->cz)
            r = di_buf_append(&b, src->cz, sizeof(float) * DI_DSV41_CZ_SLOTS * 2 * Dh);
    }
    if (!r && hp->n_engram > 0 && s->pos > 0)
        r = di_buf_append(&b, st->hist, sizeof(int32_t) * (size_t)s->pos);
    if (r) {
        di_buf_deinit(&b);
        return r;
    }
    return di_buf_seal(&b, bytes, n_bytes);
}

di_status di_dsv41_restore(di_session *s, const void *bytes, size_t n_bytes) {
    const di_hparams *hp = &s->model->hp;
    di_dsv41_state *st = s->v41;
    const size_t Dh = (size_t)hp->head_dim;
    di_reader r;
    uint32_t hdr[2];
    uint64_t fp;
    int32_t pos[2];
    uint8_t mtp;
    bool ok = di_reader_open(&r, bytes, n_bytes);
    if (!ok) {
        DI_LOG_ERROR("session restore: checksum mismatch (truncated or corrupted state)");
        goto fail;
    }
    ok = di_reader_get(&r, hdr, sizeof hdr) && hdr[0] == STATE_MAGIC && hdr[1] == STATE_VERSION &&
         di_reader_get(&r, &fp, sizeof fp) && fp == fingerprint(s->model) &&
         di_reader_get(&r, pos, sizeof pos) && pos[0] >= 0 && pos[0] <= s->n_ctx_max &&
         pos[1] >= 0 && pos[1] <= pos[0] && di_reader_get(&r, &mtp, 1) && mtp == s->mtp;
    if (ok) // capacities for pos[0] positions (a bound session must have the pages)
        ok = di_dsv41_reserve_state(s, pos[0], pos[0]) == DI_OK;
    for (int il = 0; ok && il < st->n_state_layers; il++)
        ok = di_reader_get(&r, st->ring[il], (size_t)st->ring_rows * (size_t)st->ring_row_bytes);
    for (int il = 0; ok && il < hp->n_layer; il++) {
        if (!hp->kv_source[il]) continue;
        di_dsv41_src *src = &st->src[il];
        int64_t ne;
        ok = di_reader_get(&r, &ne, sizeof ne) && ne == pos[0] / hp->compress_ratio[il];
        for (int64_t w = 0; ok && w < ne; w++)
            ok = di_reader_get(&r, di_dsv41_entry(st, src, w), (size_t)st->ent_bytes);
        for (int64_t w = 0; ok && w < ne; w++)
            ok = di_reader_get(&r, di_dsv41_key(st, src, w), (size_t)st->key_bytes);
        ok = ok &&
             (!src->cz || di_reader_get(&r, src->cz, sizeof(float) * DI_DSV41_CZ_SLOTS * 2 * Dh));
        if (ok) src->n_entries = ne;
    }
    if (ok && hp->n_engram > 0 && pos[0] > 0)
        ok = di_reader_get(&r, st->hist, sizeof(int32_t) * (size_t)pos[0]);
    ok = ok && r.left == 0;
    if (!ok) {
        DI_LOG_ERROR("session restore: the bytes are not a state of this model (%zu bytes)",
                     n_bytes);
        goto fail;
    }
    s->pos = pos[0];
    s->hw = pos[0] + DI_DSV41_ROLLBACK_MAX; // as di_dsv41_restart's
    st->dspark_pos = pos[1];
    return DI_OK;
fail:
    s->pos = 0;
    st->dspark_pos = 0;
    for (int il = 0; il < hp->n_layer; il++) st->src[il].n_entries = 0;
    return DI_ERR_FORMAT;
}
