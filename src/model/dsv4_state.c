// dsv4_state — the per-sequence state of spec §3 (window rings, compressed pools, compressor
// token rings holding the partial window and the CSA overlap, the MTP block's input rows), its
// rollback, the per-call scratch, and the byte serialisation of the state.
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/buf.h"
#include "base/hash.h"
#include "base/log.h"
#include "base/mem.h"
#include "model/dsv4.h"
#include "model/dsv41.h"     // V4.1 state (sessions dispatch on the model)
#include "model/dsv4_dev.h"  // the device-resident forward
#include "model/dsv41_dev.h" // V4.1's

// ---- debug dumps (DI_DUMP=<dir>) ----
// Each traced tensor of a call at position p is written to <dir>/<name>.<il>.p<p>.npy (float32 or
// int32), under the names of python/di_ref/dump.py, so the two outputs can be compared file by
// file. Only a debugging aid: nothing is written unless DI_DUMP is set.

static void dump_trace(void *user, const char *name, int il, const void *data, bool is_int,
                       int64_t n_rows, int64_t row_len) {
    const di_session *s = user;
    char path[4096], hdr[128];
    snprintf(path, sizeof path, "%s/%s.%d.p%d.npy", s->dump_dir, name, il, s->pos);
    FILE *f = fopen(path, "wb");
    if (!f) {
        DI_LOG_WARN("DI_DUMP: cannot write %s", path);
        return;
    }
    int n = snprintf(hdr, sizeof hdr,
                     "{'descr': '<%s', 'fortran_order': False, 'shape': (%lld, %lld), }",
                     is_int ? "i4" : "f4", (long long)n_rows, (long long)row_len);
    int pad = (64 - (10 + n + 1) % 64) % 64;
    uint16_t hl = (uint16_t)(n + pad + 1);
    unsigned char pre[10] = {
        0x93, 'N', 'U', 'M', 'P', 'Y', 1, 0, (unsigned char)(hl & 0xff), (unsigned char)(hl >> 8)};
    fwrite(pre, 1, sizeof pre, f);
    fwrite(hdr, 1, (size_t)n, f);
    for (int i = 0; i < pad; i++) fputc(' ', f);
    fputc('\n', f);
    fwrite(data, 4, (size_t)(n_rows * row_len), f);
    fclose(f);
}

// ---- create / destroy ----

di_session_options di_session_options_default(void) {
    di_session_options o = {.n_ctx_max = 0, .mtp = false};
    return o;
}

static int32_t n_state_layers(const di_session *s) {
    return s->model->hp.n_layer + (s->mtp ? s->model->n_mtp_loaded : 0);
}

// Bytes of one compressor's token ring (C or Z).
static size_t cmp_ring_bytes(const di_dsv4_compressor_w *cw) {
    return sizeof(float) * (size_t)di_dsv4_cmp_rows(cw) * (size_t)cw->c * (size_t)cw->d;
}

static di_status cmp_state_init(di_dsv4_cmp_state *cs, const di_dsv4_compressor_w *cw) {
    cs->buf_rows = di_dsv4_cmp_rows(cw);
    cs->buf_c = di_aligned_calloc(cmp_ring_bytes(cw));
    cs->buf_z = di_aligned_calloc(cmp_ring_bytes(cw));
    if (!cs->buf_c || !cs->buf_z) return DI_ERR_NOMEM;
    return DI_OK;
}

static void cmp_state_free(di_dsv4_cmp_state *cs) {
    di_aligned_free(cs->buf_c);
    di_aligned_free(cs->buf_z);
    di_free(cs->entries);
    memset(cs, 0, sizeof *cs);
}

const di_dsv4_layer_w *di_dsv4_layer(const di_model *m, int il) {
    return il < m->hp.n_layer ? &m->layers[il] : &m->mtp[il - m->hp.n_layer].block;
}

static const di_dsv4_layer_w *layer_w(const di_session *s, int il) {
    return di_dsv4_layer(s->model, il);
}

// Bytes of a window ring: DI_DSV4_RING_ROWS(W) rows of Dh.
static size_t ring_bytes(const di_hparams *hp) {
    return sizeof(float) * (size_t)DI_DSV4_RING_ROWS(hp->window) * (size_t)hp->head_dim;
}

// Bytes of the MTP block's input rows: DI_DSV4_ROLLBACK_MAX + 1 positions of [NC, D].
static size_t mtp_x_bytes(const di_hparams *hp) {
    return sizeof(float) * (size_t)(DI_DSV4_ROLLBACK_MAX + 1) * (size_t)hp->hc_mult *
           (size_t)hp->n_embd;
}

di_status di_session_create(di_model *m, const di_session_options *opt, di_session **out) {
    di_session *s = di_calloc(1, sizeof *s);
    if (!s) return DI_ERR_NOMEM;
    s->model = m;
    s->opt = opt ? *opt : di_session_options_default();
    s->n_ctx_max = s->opt.n_ctx_max > 0 ? s->opt.n_ctx_max : (int32_t)m->hp.max_pos;
    if (s->opt.n_ctx_max < 0) {
        DI_LOG_ERROR("session: n_ctx_max must not be negative");
        di_free(s);
        return DI_ERR_INVALID;
    }
    if (s->opt.mtp && m->n_mtp_loaded == 0) {
        DI_LOG_ERROR("session: MTP requested but the checkpoint has no MTP weights");
        di_free(s);
        return DI_ERR_INVALID;
    }
    s->mtp = s->opt.mtp;
    if (s->opt.device_loss_max < 0 || s->opt.device_loss_window_s < 0) {
        DI_LOG_ERROR("session: device_loss_max and device_loss_window_s must not be negative");
        di_free(s);
        return DI_ERR_INVALID;
    }
    s->loss_max = s->opt.device_loss_max ? s->opt.device_loss_max : 3;
    s->loss_window_s = s->opt.device_loss_window_s ? s->opt.device_loss_window_s : 600;
    s->loss_ms = di_calloc((size_t)s->loss_max + 1, sizeof *s->loss_ms);
    if (!s->loss_ms) {
        di_free(s);
        return DI_ERR_NOMEM;
    }
    // Debug switch (conventions §7): DI_SESSION_LOSE_DEVICE=N, the first N calls fail as on a lost
    // device (dsv4.c "sessions on the device-resident forward"): a drill of the recovery.
    const char *lose = getenv("DI_SESSION_LOSE_DEVICE");
    s->lose_in = lose ? atoi(lose) : 0;
    if (s->lose_in > 0)
        DI_LOG_WARN("session: DI_SESSION_LOSE_DEVICE=%d: its first %d forward calls fail with %s "
                    "(a drill)",
                    (int)s->lose_in, (int)s->lose_in, di_status_str(DI_ERR_DEVICE_LOST));
    const char *dump = getenv("DI_DUMP");
    if (dump && *dump) {
        snprintf(s->dump_dir, sizeof s->dump_dir, "%s", dump);
        s->trace = dump_trace;
        s->trace_user = s;
    }
    di_status st = DI_OK;
    const di_hparams *hp = &m->hp;
    if (hp->v41) { // V4.1 keeps its own per-sequence state (dsv41_state.c)
        if ((st = di_dsv41_state_create(s)) != DI_OK) goto fail;
        *out = s;
        return DI_OK;
    }
    int32_t nl = n_state_layers(s);
    s->layers = di_calloc((size_t)nl, sizeof *s->layers);
    s->mtp_x = di_aligned_calloc(mtp_x_bytes(hp));
    if (!s->layers || !s->mtp_x) {
        st = DI_ERR_NOMEM;
        goto fail;
    }
    for (int il = 0; il < nl; il++) {
        const di_dsv4_layer_w *lw = layer_w(s, il);
        di_dsv4_layer_state *ls = &s->layers[il];
        ls->ring = di_aligned_calloc(ring_bytes(hp));
        if (!ls->ring) {
            st = DI_ERR_NOMEM;
            goto fail;
        }
        if (lw->ratio > 0 && (st = cmp_state_init(&ls->cmp, &lw->cmp)) != DI_OK) goto fail;
        if (lw->ratio == 4 && (st = cmp_state_init(&ls->idx, &lw->idx_cmp)) != DI_OK) goto fail;
    }
    if (m->dev && (!s->mtp || m->mtp[0].block.ratio == 0)) {
        // The device-resident forward: one slot of the whole context, sized once; calls longer
        // than dev_max_rows rows are fed in chunks (the same logits as one call). An MTP session
        // too, its MTP block uploaded at its first state (a block that compresses has no device
        // twin: such a session keeps the CPU forward).
        if ((st = di_dsv4_session_dev_open(s)) != DI_OK) goto fail;
        if (s->trace)
            DI_LOG_WARN("DI_DUMP: a session on the device-resident forward writes no "
                        "intermediates");
    }
    *out = s;
    return DI_OK;
fail:
    di_session_destroy(s);
    return st;
}

void di_session_destroy(di_session *s) {
    if (!s) return;
    di_dsv41_state_destroy(s);
    di_dsv4_session_dev_close(s);
    di_free(s->dev_rows);
    di_free(s->dev_mtp);
    di_free(s->dev_tokens);
    di_free(s->loss_ms);
    if (s->layers) {
        for (int il = 0; il < n_state_layers(s); il++) {
            di_aligned_free(s->layers[il].ring);
            cmp_state_free(&s->layers[il].cmp);
            cmp_state_free(&s->layers[il].idx);
        }
    }
    di_free(s->layers);
    di_aligned_free(s->mtp_x);
    di_dsv4_ws_free(&s->ws);
    di_free(s);
}

int32_t di_session_n_past(const di_session *s) {
    return s->pos;
}

void di_session_reset(di_session *s) {
    s->pos = s->hw = 0;
    s->mtp_pending = false;
    if (s->v41) {
        s->v41->dspark_pos = 0;
        for (int il = 0; il < s->model->hp.n_layer; il++) s->v41->src[il].n_entries = 0;
        return;
    }
    for (int il = 0; il < n_state_layers(s); il++)
        s->layers[il].cmp.n_entries = s->layers[il].idx.n_entries = 0;
}

// ---- rollback ----

void di_dsv4_state_rollback(const di_model *m, di_dsv4_layer_state *layers, int il0, int il1,
                            int32_t pos_new) {
    // Window w closed at position w*m + m - 1, so the windows closed before pos_new are
    // [0, pos_new / m). A window re-opened keeps its rows in the token ring (m + ROLLBACK_MAX
    // rows, CSA 2m + ROLLBACK_MAX: its previous window's overlap as well), and the window ring's
    // rows of taken-back positions sit in slots that no position up to pos_new reads (W +
    // ROLLBACK_MAX rows). min(): entries a replay kept (a prefix hit) are never taken back here,
    // as the engine rolls back only past them.
    for (int il = il0; il < il1; il++) {
        const di_dsv4_layer_w *lw = di_dsv4_layer(m, il);
        if (lw->ratio <= 0) continue;
        const int64_t n = pos_new / lw->ratio;
        di_dsv4_layer_state *ls = &layers[il];
        if (ls->cmp.n_entries > n) ls->cmp.n_entries = n;
        if (lw->ratio == 4 && ls->idx.n_entries > n) ls->idx.n_entries = n;
    }
}

di_status di_session_rollback_begin(di_session *s, int32_t n, int32_t max, bool *done) {
    // The rings keep max rows more than they read (V4's +1 on the CPU: W + MAX rows against
    // W - 1 read; the device's W + MAX - 1): a position the rollback returns to must be within
    // that of the highest one written, whatever the calls and rollbacks in between (rows fed
    // again after a rollback do not give back the rows the taken-back ones overwrote). Back to 0
    // reads no ring row: always (as new).
    *done = false;
    if (n < 0 || n > s->pos || n > max || (s->pos > n && s->hw - (s->pos - n) > max)) {
        DI_LOG_ERROR("rollback: cannot take back %d of %d positions (at most %d, and not more "
                     "than %d below the highest position fed since the reset, %d)",
                     n, s->pos, max, max, s->hw);
        return DI_ERR_INVALID;
    }
    if (s->dev_on) { // dsv4.c
        *done = true;
        di_status st = di_dsv4_session_dev_rollback(s, n);
        if (st == DI_OK && s->pos == 0) s->hw = 0;
        return st;
    }
    if (s->pos == n) s->hw = 0;
    return DI_OK;
}

di_status di_dsv4_rollback(di_session *s, int32_t n) {
    bool done;
    di_status st = di_session_rollback_begin(s, n, DI_DSV4_ROLLBACK_MAX, &done);
    if (st != DI_OK || done) return st;
    const di_hparams *hp = &s->model->hp;
    const int32_t pos = s->pos - n;
    di_dsv4_state_rollback(s->model, s->layers, 0, hp->n_layer, pos);
    if (s->mtp) {
        // The MTP block has seen positions [0, pos - 1) (each needs the token after it) and waits
        // with position pos - 1's main streams, which stay in mtp_x.
        di_dsv4_state_rollback(s->model, s->layers, hp->n_layer, n_state_layers(s),
                               pos > 0 ? pos - 1 : 0);
        s->mtp_pending = pos > 0;
    }
    s->pos = pos;
    return DI_OK;
}

// ---- scratch ----

static size_t scratch_sizes(const di_model *m, bool mtp, int32_t T, size_t *sz) {
    const di_hparams *hp = &m->hp;
    size_t t = (size_t)T, nc = (size_t)hp->hc_mult, D = (size_t)hp->n_embd;
    size_t K = (size_t)hp->n_expert_used, F = (size_t)hp->expert_ff;
    size_t cmp_w =
        2 * (size_t)(hp->head_dim > hp->index_head_dim ? hp->head_dim : hp->index_head_dim);
    size_t widest = (size_t)m->cpu.row_cap;
    sz[DI_SCR_X] = t * nc * D;
    sz[DI_SCR_A] = t * D;
    sz[DI_SCR_OUT] = t * D;
    sz[DI_SCR_POST] = t * nc;
    sz[DI_SCR_COMB] = t * nc * nc;
    sz[DI_SCR_MIX] = t * (2 + nc) * nc;
    sz[DI_SCR_QR] = t * (size_t)hp->q_lora_rank;
    sz[DI_SCR_Q] = t * (size_t)hp->n_head * (size_t)hp->head_dim;
    sz[DI_SCR_KV] = t * (size_t)hp->head_dim;
    sz[DI_SCR_O] = sz[DI_SCR_Q];
    sz[DI_SCR_U] = t * (size_t)hp->o_groups * (size_t)hp->o_lora_rank;
    sz[DI_SCR_CC] = t * cmp_w;
    sz[DI_SCR_CZ] = t * cmp_w;
    sz[DI_SCR_IQ] = t * (size_t)hp->n_index_head * (size_t)hp->index_head_dim;
    sz[DI_SCR_IW] = t * (size_t)hp->n_index_head;
    sz[DI_SCR_MOE_IN] = t * K * D;
    sz[DI_SCR_MOE_G] = t * K * F;
    sz[DI_SCR_MOE_U] = t * K * F;
    sz[DI_SCR_MOE_OUT] = t * K * D;
    sz[DI_SCR_LOGIT] = t * (size_t)hp->n_expert;
    sz[DI_SCR_XM] = mtp ? t * nc * D : 0;
    sz[DI_SCR_XMAIN] = mtp ? t * nc * D : 0;
    sz[DI_SCR_H] = t * D;
    sz[DI_SCR_AQ] = m->opt.precision == DI_PRECISION_OFFICIAL ? t * K * widest : 0;
    sz[DI_SCR_MOE_W] = t * K;
    sz[DI_SCR_MOE_RW] = t * K;
    size_t total = 0;
    for (int i = 0; i < DI_SCR_COUNT; i++) total += (sz[i] + 15) & ~(size_t)15; // 64-byte aligned
    return total;
}

float *di_dsv4_scratch(di_dsv4_ctx *c, int which) {
    DI_ASSERT(which >= 0 && which < DI_SCR_COUNT && c->ws->scratch);
    return c->ws->scratch + c->ws->scratch_off[which];
}

di_status di_dsv4_ws_reserve(di_dsv4_ws *ws, const di_model *m, int32_t n_rows, int64_t max_entries,
                             bool mtp) {
    const di_hparams *hp = &m->hp;
    // Per-thread score rows: window + compressed keys for each head of a group (attention) or
    // every entry (indexer).
    size_t per_thread =
        (size_t)(hp->window + hp->index_topk + max_entries + 16) * DI_DSV4_HEAD_GROUP;
    size_t attn = per_thread * (size_t)m->cpu.n_threads;
    if (attn > ws->attn_scratch_floats) {
        float *p = di_aligned_alloc(sizeof(float) * attn);
        if (!p) return DI_ERR_NOMEM;
        di_aligned_free(ws->attn_scratch);
        ws->attn_scratch = p;
        ws->attn_scratch_floats = attn;
    }
    if (n_rows <= ws->scratch_tokens && (ws->mtp || !mtp)) return DI_OK;
    if (n_rows < ws->scratch_tokens) n_rows = ws->scratch_tokens;
    size_t sz[DI_SCR_COUNT];
    size_t total = scratch_sizes(m, mtp, n_rows, sz);
    float *p = di_aligned_alloc(sizeof(float) * total);
    size_t n_sel =
        (size_t)n_rows *
        (size_t)(hp->index_topk > 2 * hp->n_expert_used ? hp->index_topk : 2 * hp->n_expert_used);
    int32_t *sel = di_malloc(sizeof(int32_t) * n_sel);
    int32_t *rows = di_malloc(sizeof(int32_t) * 2 * (size_t)n_rows);
    if (!p || !sel || !rows) {
        di_aligned_free(p);
        di_free(sel);
        di_free(rows);
        DI_LOG_ERROR("cannot allocate %.1f MiB of scratch for %d rows",
                     sizeof(float) * total / 1048576.0, n_rows);
        return DI_ERR_NOMEM;
    }
    di_aligned_free(ws->scratch);
    di_free(ws->sel);
    di_free(ws->row_seq);
    ws->scratch = p;
    ws->scratch_floats = total;
    ws->sel = sel;
    ws->sel_cap = n_sel;
    ws->row_seq = rows;
    ws->row_pos = rows + n_rows;
    ws->scratch_tokens = n_rows;
    ws->mtp = mtp;
    size_t off = 0;
    for (int i = 0; i < DI_SCR_COUNT; i++) {
        ws->scratch_off[i] = off;
        off += (sz[i] + 15) & ~(size_t)15;
    }
    return DI_OK;
}

int64_t di_dsv4_ws_bytes(const di_dsv4_ws *ws) {
    return (int64_t)(ws->scratch_floats + ws->attn_scratch_floats) * (int64_t)sizeof(float) +
           (int64_t)ws->sel_cap * (int64_t)sizeof(int32_t) +
           2 * (int64_t)ws->scratch_tokens * (int64_t)sizeof(int32_t) + di_dsv41_ws_bytes(ws);
}

void di_dsv4_ws_free(di_dsv4_ws *ws) {
    di_dsv41_ws_free(ws);
    di_aligned_free(ws->scratch);
    di_aligned_free(ws->attn_scratch);
    di_free(ws->sel);
    di_free(ws->row_seq);
    memset(ws, 0, sizeof *ws);
}

static di_status grow_entries(di_dsv4_cmp_state *cs, int64_t need, int32_t d) {
    if (need <= cs->cap_entries) return DI_OK;
    int64_t cap = cs->cap_entries ? cs->cap_entries : 16;
    while (cap < need) cap *= 2;
    float *p = di_realloc(cs->entries, sizeof(float) * (size_t)cap * (size_t)d);
    if (!p) return DI_ERR_NOMEM;
    cs->entries = p;
    cs->cap_entries = cap;
    return DI_OK;
}

di_status di_dsv4_session_reserve(di_session *s, int32_t n_tok) {
    // Compressed pools: every entry this call can close.
    int64_t end = (int64_t)s->pos + n_tok, max_entries = 0;
    for (int il = 0; il < n_state_layers(s); il++) {
        const di_dsv4_layer_w *lw = layer_w(s, il);
        if (lw->ratio <= 0) continue;
        int64_t need = end / lw->ratio;
        if (grow_entries(&s->layers[il].cmp, need, lw->cmp.d) != DI_OK) return DI_ERR_NOMEM;
        if (lw->ratio == 4 && grow_entries(&s->layers[il].idx, need, lw->idx_cmp.d) != DI_OK)
            return DI_ERR_NOMEM;
        if (need > max_entries) max_entries = need;
    }
    return di_dsv4_ws_reserve(&s->ws, s->model, n_tok, max_entries, s->mtp);
}

// ---- serialisation ----
// Layout: header {magic "DI4S", version, model fingerprint, pos, mtp, mtp_pending}, then per
// state layer: ring [W + ROLLBACK_MAX, Dh]; for each compressor: buf_c, buf_z (token rings),
// n_entries, entries; then mtp_x; then an FNV-1a 64 checksum of everything before it. Version 2:
// the rings with rollback rows (version 1 had W-row rings and separate CSA overlaps).

#define STATE_MAGIC 0x53344944u // "DI4S"
#define STATE_VERSION 2u

static uint64_t model_fingerprint(const di_model *m) {
    return di_fnv1a(&m->hp, sizeof m->hp, DI_FNV1A_INIT);
}

static di_status put_cmp(di_buf *b, const di_dsv4_cmp_state *cs, const di_dsv4_compressor_w *cw) {
    const size_t nb = cmp_ring_bytes(cw);
    di_status st = di_buf_append(b, cs->buf_c, nb);
    if (!st) st = di_buf_append(b, cs->buf_z, nb);
    if (!st) st = di_buf_append(b, &cs->n_entries, sizeof cs->n_entries);
    if (!st)
        st = di_buf_append(b, cs->entries, sizeof(float) * (size_t)cs->n_entries * (size_t)cw->d);
    return st;
}

// ---- token states (sessions on the device-resident forward) ----
// Layout: {magic "DI4T", version, di_dsv4_model_id, pos, 0}, then the pos token ids fed (int32),
// then the FNV-1a 64 checksum (di_buf_seal). Why tokens and not the device's state: the device's
// rings hold other rollback rows than the CPU format's (V4's none, V4.1's 16 as Q8 codes; the
// CPU's W + ROLLBACK_MAX FP32 rows) and can be snapshot only at a block boundary
// (di_dsv4_dev_tail_save), so a CPU state cannot be made from it at any position without new device
// code, nor put back; while replaying the tokens (the device-loss recovery's replay) rebuilds the
// state exactly on any forward of the model (device, any stage split, or CPU), at the cost of their
// prefill, and the bytes stay small. The model id covers the precision recipe: the replay
// recomputes everything with it.

#define TOKENS_MAGIC 0x54344944u // "DI4T"
#define TOKENS_VERSION 1u

static di_status save_tokens(const di_session *s, void **bytes, size_t *n_bytes) {
    di_buf b;
    di_buf_init(&b);
    const uint32_t hdr[2] = {TOKENS_MAGIC, TOKENS_VERSION};
    const uint64_t id = di_dsv4_model_id(s->model);
    const int32_t pos[2] = {s->pos, 0};
    di_status st = di_buf_append(&b, hdr, sizeof hdr);
    if (!st) st = di_buf_append(&b, &id, sizeof id);
    if (!st) st = di_buf_append(&b, pos, sizeof pos);
    if (!st && s->pos > 0) st = di_buf_append(&b, s->dev_tokens, sizeof(int32_t) * (size_t)s->pos);
    if (st) {
        di_buf_deinit(&b);
        return st;
    }
    return di_buf_seal(&b, bytes, n_bytes);
}

static bool is_token_state(const void *bytes, size_t n_bytes) {
    uint32_t magic;
    if (n_bytes < sizeof magic) return false;
    memcpy(&magic, bytes, sizeof magic);
    return magic == TOKENS_MAGIC;
}

// Checks the whole token state before anything changes, then resets the session and feeds them.
static di_status restore_tokens(di_session *s, const void *bytes, size_t n_bytes) {
    const di_model *m = s->model;
    di_reader r;
    uint32_t hdr[2];
    uint64_t id;
    int32_t pos[2];
    if (!di_reader_open(&r, bytes, n_bytes)) {
        DI_LOG_ERROR("session restore: checksum mismatch (truncated or corrupted token state); "
                     "the session is unchanged");
        return DI_ERR_FORMAT;
    }
    if (!di_reader_get(&r, hdr, sizeof hdr) || hdr[1] != TOKENS_VERSION ||
        !di_reader_get(&r, &id, sizeof id) || !di_reader_get(&r, pos, sizeof pos) || pos[0] < 0 ||
        pos[1] != 0 || r.left != sizeof(int32_t) * (size_t)pos[0]) {
        DI_LOG_ERROR("session restore: not a token state of version %u (%zu bytes); the session "
                     "is unchanged",
                     TOKENS_VERSION, n_bytes);
        return DI_ERR_FORMAT;
    }
    if (id != di_dsv4_model_id(m)) {
        DI_LOG_ERROR("session restore: the token state is another model's (or another precision "
                     "recipe's); the session is unchanged");
        return DI_ERR_FORMAT;
    }
    if (pos[0] > s->n_ctx_max) {
        DI_LOG_ERROR("session restore: the token state holds %d positions, more than the "
                     "session's context of %d; the session is unchanged",
                     pos[0], s->n_ctx_max);
        return DI_ERR_FORMAT;
    }
    int32_t *toks = di_malloc(sizeof(int32_t) * (size_t)(pos[0] > 0 ? pos[0] : 1));
    if (!toks) return DI_ERR_NOMEM;
    di_reader_get(&r, toks, sizeof(int32_t) * (size_t)pos[0]);
    for (int32_t t = 0; t < pos[0]; t++) {
        if (toks[t] < 0 || toks[t] >= m->hp.n_vocab) {
            DI_LOG_ERROR("session restore: token %d of the token state (%d) is outside the "
                         "vocabulary; the session is unchanged",
                         t, toks[t]);
            di_free(toks);
            return DI_ERR_FORMAT;
        }
    }
    di_session_reset(s);
    di_status st = DI_OK;
    // In chunks: a CPU session's scratch is sized by its call's rows.
    for (int32_t done = 0; st == DI_OK && done < pos[0];) {
        const int32_t n =
            pos[0] - done < DI_DSV4_DEV_SESSION_ROWS ? pos[0] - done : DI_DSV4_DEV_SESSION_ROWS;
        st = di_session_forward(s, toks + done, n, NULL);
        done += n;
    }
    di_free(toks);
    if (st != DI_OK) {
        DI_LOG_ERROR("session restore: replaying the token state failed (%s); the session is "
                     "reset",
                     di_status_str(st));
        di_session_reset(s);
        return st;
    }
    s->stats.n_replayed_tokens += pos[0];
    return DI_OK;
}

di_status di_session_save(const di_session *s, void **bytes, size_t *n_bytes) {
    if (di_dsv4_session_on_dev(s)) return save_tokens(s, bytes, n_bytes);
    if (s->v41) return di_dsv41_save(s, bytes, n_bytes);
    const di_model *m = s->model;
    const di_hparams *hp = &m->hp;
    di_buf b;
    di_buf_init(&b);
    uint32_t hdr[2] = {STATE_MAGIC, STATE_VERSION};
    uint64_t fp = model_fingerprint(m);
    uint8_t flags[2] = {s->mtp, s->mtp_pending};
    di_status st = di_buf_append(&b, hdr, sizeof hdr);
    if (!st) st = di_buf_append(&b, &fp, sizeof fp);
    if (!st) st = di_buf_append(&b, &s->pos, sizeof s->pos);
    if (!st) st = di_buf_append(&b, flags, sizeof flags);
    for (int il = 0; !st && il < n_state_layers(s); il++) {
        const di_dsv4_layer_w *lw = layer_w(s, il);
        const di_dsv4_layer_state *ls = &s->layers[il];
        st = di_buf_append(&b, ls->ring, ring_bytes(hp));
        if (!st && lw->ratio > 0) st = put_cmp(&b, &ls->cmp, &lw->cmp);
        if (!st && lw->ratio == 4) st = put_cmp(&b, &ls->idx, &lw->idx_cmp);
    }
    if (!st) st = di_buf_append(&b, s->mtp_x, mtp_x_bytes(hp));
    if (st) {
        di_buf_deinit(&b);
        return st;
    }
    return di_buf_seal(&b, bytes, n_bytes);
}

static bool get_cmp(di_reader *r, di_dsv4_cmp_state *cs, const di_dsv4_compressor_w *cw,
                    int64_t max_entries) {
    const size_t nb = cmp_ring_bytes(cw);
    if (!di_reader_get(r, cs->buf_c, nb) || !di_reader_get(r, cs->buf_z, nb)) return false;
    int64_t n;
    if (!di_reader_get(r, &n, sizeof n) || n != max_entries) return false;
    if (grow_entries(cs, n, cw->d) != DI_OK) return false;
    cs->n_entries = n;
    return di_reader_get(r, cs->entries, sizeof(float) * (size_t)n * (size_t)cw->d);
}

di_status di_session_restore(di_session *s, const void *bytes, size_t n_bytes) {
    if (is_token_state(bytes, n_bytes)) return restore_tokens(s, bytes, n_bytes);
    if (di_dsv4_session_on_dev(s)) {
        DI_LOG_ERROR("session restore: these %zu bytes are not a token state: a session on the "
                     "device-resident forward restores only states saved on it (a CPU session's "
                     "state holds no tokens to replay; restore it into a session on the CPU "
                     "forward); the session is unchanged",
                     n_bytes);
        return DI_ERR_FORMAT;
    }
    if (s->v41) return di_dsv41_restore(s, bytes, n_bytes);
    const di_model *m = s->model;
    const di_hparams *hp = &m->hp;
    di_reader r;
    uint32_t hdr[2];
    uint64_t fp;
    int32_t pos;
    uint8_t flags[2];
    if (!di_reader_open(&r, bytes, n_bytes)) {
        DI_LOG_ERROR("session restore: checksum mismatch (truncated or corrupted state)");
        di_session_reset(s);
        return DI_ERR_FORMAT;
    }
    bool ok = di_reader_get(&r, hdr, sizeof hdr) && hdr[0] == STATE_MAGIC &&
              hdr[1] == STATE_VERSION && di_reader_get(&r, &fp, sizeof fp) &&
              fp == model_fingerprint(m) && di_reader_get(&r, &pos, sizeof pos) && pos >= 0 &&
              pos <= s->n_ctx_max && di_reader_get(&r, flags, sizeof flags) && flags[0] == s->mtp &&
              flags[1] <= 1;
    for (int il = 0; ok && il < n_state_layers(s); il++) {
        const di_dsv4_layer_w *lw = layer_w(s, il);
        di_dsv4_layer_state *ls = &s->layers[il];
        ok = di_reader_get(&r, ls->ring, ring_bytes(hp));
        int64_t n_ent = lw->ratio > 0 ? pos / lw->ratio : 0;
        // The MTP block's positions lag the main model's by one.
        if (il >= hp->n_layer && lw->ratio > 0) n_ent = (pos > 0 ? pos - 1 : 0) / lw->ratio;
        if (ok && lw->ratio > 0) ok = get_cmp(&r, &ls->cmp, &lw->cmp, n_ent);
        if (ok && lw->ratio == 4) ok = get_cmp(&r, &ls->idx, &lw->idx_cmp, n_ent);
    }
    ok = ok && di_reader_get(&r, s->mtp_x, mtp_x_bytes(hp)) && r.left == 0;
    if (!ok) {
        DI_LOG_ERROR("session restore: the bytes are not a state of this model (%zu bytes)",
                     n_bytes);
        di_session_reset(s);
        return DI_ERR_FORMAT;
    }
    s->pos = pos;
    // What the saved session fed past pos (before a rollback) is not saved: a rollback below pos
    // is refused (that session's rings may have lost rows below it), one down to pos allowed.
    s->hw = pos + DI_DSV4_ROLLBACK_MAX;
    s->mtp_pending = flags[1];
    return DI_OK;
}
