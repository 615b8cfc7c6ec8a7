// cp — the front of context parallelism and the state messages both sides use (cp/cp.h).
#include "cp/cp.h"

#include <pthread.h>
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "base/log.h"
#include "base/mem.h"
#include "base/sock.h"
#include "ep/ep.h"            // di_ep_model_describe: the same one-line description on a mismatch
#include "tensor/quant_ref.h" // di_quant_*_row_bytes: V4.1 state rows

// ---- state messages (front and workers) ----

// The shapes of a V4.1 model's state layers (model/dsv41.h).
static void dims_init41(const di_model *m, di_cp_dims *out) {
    const di_hparams *hp = &m->hp;
    DI_ASSERT(hp->n_layer + m->n_mtp_loaded <= DI_CP_MAX_LAYERS);
    out->v41 = true;
    out->n_mtp = m->n_mtp_loaded;
    const int64_t ring_rows = hp->window + DI_DSV41_ROLLBACK_MAX;
    out->ring_bytes = ring_rows * (int64_t)di_quant_q8_row_bytes(hp->head_dim, DI_DSV41_WIN_BLOCK);
    out->cz_floats = (int64_t)DI_DSV41_CZ_SLOTS * 2 * hp->head_dim;
    out->ent_bytes = (int32_t)di_quant_q4e_row_bytes(hp->head_dim, DI_DSV41_ENT_BLOCK);
    out->key_bytes = (int32_t)di_quant_q4_row_bytes(hp->index_head_dim, DI_DSV41_KEY_BLOCK);
    out->n_hist = hp->n_engram > 0 ? hp->engram_max_ngram - 1 : 0;
    out->n_hist_ids = (int32_t)hp->engram_cvocab;
    DI_ASSERT(out->n_hist <= DI_CP_MAX_HIST);
    for (int il = 0; il < hp->n_layer; il++) {
        out->src[il] = hp->kv_source[il];
        out->ratio[il] = hp->compress_ratio[il];
    }
}

void di_cp_dims_init(const di_model *m, di_cp_dims *out) {
    const di_hparams *hp = &m->hp;
    memset(out, 0, sizeof *out);
    DI_ASSERT(hp->n_layer + 1 <= DI_CP_MAX_LAYERS);
    out->n_layers = hp->n_layer;
    out->has_mtp = m->n_mtp_loaded > 0;
    out->n_vocab = hp->n_vocab;
    out->row_floats = (int64_t)hp->hc_mult * hp->n_embd;
    out->max_pos = hp->max_pos;
    out->n_mtp = 1;
    if (hp->v41) {
        dims_init41(m, out);
        return;
    }
    out->ring_floats = (int64_t)DI_DSV4_RING_ROWS(hp->window) * hp->head_dim;
    for (int il = 0; il < hp->n_layer + (out->has_mtp ? 1 : 0); il++) {
        const di_dsv4_layer_w *lw = di_dsv4_layer(m, il);
        out->ratio[il] = lw->ratio;
        out->n_cmp[il] = lw->ratio == 4 ? 2 : lw->ratio > 0 ? 1 : 0;
        for (int k = 0; k < out->n_cmp[il]; k++) {
            const di_dsv4_compressor_w *cw = k == 0 ? &lw->cmp : &lw->idx_cmp;
            out->cmp_ring_floats[il][k] = (int64_t)di_dsv4_cmp_rows(cw) * cw->c * cw->d;
            out->cmp_d[il][k] = cw->d;
        }
    }
}

void di_cp_buf_free(di_cp_buf *b) {
    di_aligned_free(b->p);
    memset(b, 0, sizeof *b);
}

static di_status buf_reserve(di_cp_buf *b, uint64_t n) {
    if (n <= b->cap && b->p) return DI_OK;
    void *p = di_aligned_alloc(n ? (size_t)n : 64);
    if (!p) return DI_ERR_NOMEM;
    di_aligned_free(b->p);
    b->p = p;
    b->cap = (size_t)n;
    return DI_OK;
}

di_status di_cp_recv_frame(int fd, const char *who, const char *peer, uint16_t type, di_cp_buf *b,
                           uint64_t *len, int64_t *bytes) {
    di_cp_hdr h;
    char why[DI_CP_MAX_TEXT + 1];
    di_status st = di_cp_recv_hdr(fd, &h, why, sizeof why);
    if (st != DI_OK) {
        DI_LOG_ERROR("%s: %s: %s", who, peer, why);
        return DI_ERR_IO;
    }
    if (h.type != type && h.type != DI_CP_ERROR) {
        DI_LOG_ERROR("%s: %s: frame type %u where %u was due", who, peer, (unsigned)h.type,
                     (unsigned)type);
        return DI_ERR_IO;
    }
    if (buf_reserve(b, h.len) != DI_OK) {
        DI_LOG_ERROR("%s: %s: out of memory for a frame of %llu bytes", who, peer,
                     (unsigned long long)h.len);
        return DI_ERR_NOMEM;
    }
    if (h.len && di_sock_recv_all(fd, b->p, (size_t)h.len) != DI_OK) {
        DI_LOG_ERROR("%s: %s: connection closed or timed out in a frame of %llu bytes", who, peer,
                     (unsigned long long)h.len);
        return DI_ERR_IO;
    }
    if (bytes) *bytes += (int64_t)(sizeof h + h.len);
    if (h.type == DI_CP_ERROR) {
        DI_LOG_ERROR("%s: %s: %.*s", who, peer, (int)h.len, (const char *)b->p);
        return DI_ERR_IO;
    }
    *len = h.len;
    return DI_OK;
}

di_status di_cp_send_layer(int fd, const di_model *m, const di_dsv4_layer_state *ls, int32_t il,
                           int64_t pos, const int64_t from[2], int64_t *bytes) {
    const di_dsv4_layer_w *lw = di_dsv4_layer(m, il);
    const di_hparams *hp = &m->hp;
    const int32_t n_cmp = lw->ratio == 4 ? 2 : lw->ratio > 0 ? 1 : 0;
    const uint64_t ring = (uint64_t)DI_DSV4_RING_ROWS(hp->window) * hp->head_dim * 4;
    const di_dsv4_cmp_state *cs[2] = {&ls->cmp, &ls->idx};
    const di_dsv4_compressor_w *cw[2] = {&lw->cmp, &lw->idx_cmp};
    uint8_t head[16 + 32];
    int32_t h32[2] = {il, n_cmp};
    memcpy(head, h32, 8);
    memcpy(head + 8, &pos, 8);
    uint64_t len = di_cp_layer_head_bytes(n_cmp) + ring;
    for (int32_t k = 0; k < n_cmp; k++) {
        DI_ASSERT(from[k] <= cs[k]->n_entries);
        memcpy(head + 16 + 16 * k, &from[k], 8);
        memcpy(head + 24 + 16 * k, &cs[k]->n_entries, 8);
        len += 2 * (uint64_t)di_dsv4_cmp_rows(cw[k]) * cw[k]->c * cw[k]->d * 4 +
               (uint64_t)(cs[k]->n_entries - from[k]) * cw[k]->d * 4;
    }
    di_status st = di_cp_send_hdr(fd, DI_CP_LAYER, len);
    if (!st) st = di_sock_send_all(fd, head, (size_t)di_cp_layer_head_bytes(n_cmp));
    if (!st) st = di_sock_send_all(fd, ls->ring, (size_t)ring);
    for (int32_t k = 0; !st && k < n_cmp; k++) {
        const size_t rb = (size_t)di_dsv4_cmp_rows(cw[k]) * cw[k]->c * cw[k]->d * 4;
        const int32_t d = cw[k]->d;
        st = di_sock_send_all(fd, cs[k]->buf_c, rb);
        if (!st) st = di_sock_send_all(fd, cs[k]->buf_z, rb);
        // Entries [from, n): one run (a session's array) or one run per page (an engine
        // sequence's KV blocks).
        for (int64_t w = from[k]; !st && w < cs[k]->n_entries;) {
            int64_t end = cs[k]->n_entries;
            if (cs[k]->pages) {
                const int64_t page_end = (w / cs[k]->page_entries + 1) * cs[k]->page_entries;
                if (page_end < end) end = page_end;
            }
            st = di_sock_send_all(fd, di_dsv4_entry(cs[k], w, d), (size_t)(end - w) * d * 4);
            w = end;
        }
    }
    if (bytes) *bytes += (int64_t)(sizeof(di_cp_hdr) + len);
    return st;
}

di_status di_cp_install_layer(const di_model *m, di_dsv4_layer_state *ls, const di_cp_layer *l,
                              char *why, size_t why_n) {
    const di_dsv4_layer_w *lw = di_dsv4_layer(m, l->il);
    const di_hparams *hp = &m->hp;
    const int32_t n_cmp = lw->ratio == 4 ? 2 : lw->ratio > 0 ? 1 : 0;
    di_dsv4_cmp_state *cs[2] = {&ls->cmp, &ls->idx};
    const di_dsv4_compressor_w *cw[2] = {&lw->cmp, &lw->idx_cmp};
    for (int32_t k = 0; k < n_cmp; k++) {
        if (l->cmp[k].from != cs[k]->n_entries || l->cmp[k].n > cs[k]->cap_entries) {
            snprintf(why, why_n,
                     "layer %d compressor %d: entries [%lld, %lld) for a state holding %lld "
                     "(room for %lld)",
                     l->il, k, (long long)l->cmp[k].from, (long long)l->cmp[k].n,
                     (long long)cs[k]->n_entries, (long long)cs[k]->cap_entries);
            return DI_ERR_FORMAT;
        }
    }
    memcpy(ls->ring, l->ring, sizeof(float) * (size_t)DI_DSV4_RING_ROWS(hp->window) * hp->head_dim);
    for (int32_t k = 0; k < n_cmp; k++) {
        const size_t rb = sizeof(float) * (size_t)di_dsv4_cmp_rows(cw[k]) * cw[k]->c * cw[k]->d;
        const int32_t d = cw[k]->d;
        memcpy(cs[k]->buf_c, l->cmp[k].buf_c, rb);
        memcpy(cs[k]->buf_z, l->cmp[k].buf_z, rb);
        for (int64_t w = l->cmp[k].from; w < l->cmp[k].n; w++)
            memcpy(di_dsv4_entry(cs[k], w, d), l->cmp[k].entries + (w - l->cmp[k].from) * d,
                   sizeof(float) * (size_t)d);
        cs[k]->n_entries = l->cmp[k].n;
    }
    return DI_OK;
}

// ---- V4.1 state messages (front and workers) ----

di_status di_cp_send_layer41(int fd, const di_model *m, const di_cp_dims *dims,
                             const di_dsv41_state *st, int32_t il, int64_t pos, int64_t from,
                             int64_t *bytes) {
    const bool src = il < dims->n_layers && dims->src[il];
    const di_dsv41_src *sc = src ? &st->src[il] : NULL;
    const int64_t n = src ? sc->n_entries : 0;
    if (!src) from = 0;
    DI_ASSERT(from <= n && (!src || n == pos / dims->ratio[il]));
    (void)m;
    int32_t h32[2] = {il, src ? 1 : 0};
    int64_t h64[3] = {pos, from, n};
    uint8_t head[DI_CP_LAYER41_HEAD];
    memcpy(head, h32, 8);
    memcpy(head + 8, h64, 24);
    const uint64_t len = di_cp_layer41_bytes(dims, il, n - from);
    di_status st_ = di_cp_send_hdr(fd, DI_CP_LAYER41, len);
    if (!st_) st_ = di_sock_send_all(fd, head, sizeof head);
    if (!st_ && src && dims->ratio[il] == 2)
        st_ = di_sock_send_all(fd, sc->cz, sizeof(float) * (size_t)dims->cz_floats);
    if (!st_) st_ = di_sock_send_all(fd, st->ring[il], (size_t)dims->ring_bytes);
    // Entries then index keys [from, n): one run per page each.
    for (int k = 0; k < 2 && src; k++)
        for (int64_t w = from; !st_ && w < n;) {
            int64_t end = (w / sc->per_page + 1) * sc->per_page;
            if (end > n) end = n;
            const uint8_t *p = k == 0 ? di_dsv41_entry(st, sc, w) : di_dsv41_key(st, sc, w);
            st_ = di_sock_send_all(
                fd, p, (size_t)(end - w) * (size_t)(k == 0 ? st->ent_bytes : st->key_bytes));
            w = end;
        }
    if (bytes) *bytes += (int64_t)(sizeof(di_cp_hdr) + len);
    return st_;
}

di_status di_cp_install_layer41(const di_cp_dims *dims, di_dsv41_state *st, const di_cp_layer41 *l,
                                char *why, size_t why_n) {
    const bool src = l->il < dims->n_layers && dims->src[l->il];
    if (l->il >= st->n_state_layers) {
        snprintf(why, why_n, "state layer %d for a session of %d (DSpark on one side only)", l->il,
                 st->n_state_layers);
        return DI_ERR_FORMAT;
    }
    di_dsv41_src *sc = src ? &st->src[l->il] : NULL;
    if (src && (l->from != sc->n_entries || l->n > (int64_t)st->n_pages * sc->per_page)) {
        snprintf(why, why_n,
                 "layer %d: entries [%lld, %lld) for a state holding %lld (room for %lld)", l->il,
                 (long long)l->from, (long long)l->n, (long long)sc->n_entries,
                 (long long)st->n_pages * sc->per_page);
        return DI_ERR_FORMAT;
    }
    memcpy(st->ring[l->il], l->ring, (size_t)dims->ring_bytes);
    if (!src) return DI_OK;
    if (l->cz) memcpy(sc->cz, l->cz, sizeof(float) * (size_t)dims->cz_floats);
    for (int64_t w = l->from; w < l->n; w++) {
        memcpy(di_dsv41_entry(st, sc, w), l->ent + (w - l->from) * st->ent_bytes,
               (size_t)st->ent_bytes);
        memcpy(di_dsv41_key(st, sc, w), l->keys + (w - l->from) * st->key_bytes,
               (size_t)st->key_bytes);
    }
    sc->n_entries = l->n;
    return DI_OK;
}

// ---- the front: connections ----

typedef struct cp_worker {
    char addr[160], host[128];
    int port;
    int fd; // -1: closed (opened again, with the handshake, by the next call that needs it)
} cp_worker;

struct di_cp {
    di_model *m;  // borrowed
    cp_worker *w; // owned [n]: rank i = w[i]
    int32_t n;
    int32_t min_tokens;
    int32_t corrupt_il; // test hook; -1: off
    uint64_t id;
    char desc[512];
    di_cp_dims dims;
    pthread_mutex_t mu; // one call at a time (the connections, rx) and the counters
    di_cp_stats stats;
    di_cp_buf rx; // the calling thread's receive buffer
    // di_cp_batch_forward's rest of a batch (owned, grown to the largest batch seen).
    di_dsv4_seq *b_seqs;
    int32_t *b_tokens, *b_rows;
    float *b_logits;
    size_t b_seqs_cap, b_tokens_cap, b_rows_cap, b_logits_cap;
};

// Connects and handshakes worker w unless it is connected. DI_ERR_INVALID when it refuses the
// model (logged with both sides), DI_ERR_IO when unreachable.
static di_status worker_open(di_cp *cp, cp_worker *w) {
    if (w->fd >= 0) return DI_OK;
    int fd = di_sock_connect("cp", w->host, w->port, DI_CP_IO_TIMEOUT_MS);
    if (fd < 0) return DI_ERR_IO;
    uint8_t hello[8 + sizeof cp->desc];
    const size_t dl = strlen(cp->desc);
    memcpy(hello, &cp->id, 8);
    memcpy(hello + 8, cp->desc, dl);
    di_cp_hdr h;
    char why[DI_CP_MAX_TEXT + 1];
    di_status st = di_cp_send_frame(fd, DI_CP_HELLO, hello, 8 + dl);
    if (st == DI_OK) st = di_cp_recv_hdr(fd, &h, why, sizeof why);
    if (st != DI_OK) {
        DI_LOG_ERROR("cp: worker %s: handshake failed: %s", w->addr,
                     st == DI_ERR_IO ? "connection closed or timed out" : why);
        close(fd);
        return DI_ERR_IO;
    }
    if (h.type == DI_CP_ERROR) {
        size_t n = (size_t)h.len;
        if (di_sock_recv_all(fd, why, n) != DI_OK) n = 0;
        DI_LOG_ERROR("cp: worker %s refused the handshake: %.*s", w->addr, (int)n, why);
        close(fd);
        return DI_ERR_INVALID;
    }
    if (h.type != DI_CP_OK) {
        DI_LOG_ERROR("cp: worker %s: frame type %u in reply to the handshake", w->addr,
                     (unsigned)h.type);
        close(fd);
        return DI_ERR_IO;
    }
    w->fd = fd;
    return DI_OK;
}

static void worker_close(cp_worker *w) {
    if (w->fd >= 0) close(w->fd);
    w->fd = -1;
}

di_status di_cp_attach(di_model *m, const char *const *workers, int32_t n_workers,
                       int32_t min_tokens, di_cp **out) {
    if (m->opt.device.kind != DI_DEVICE_CPU || m->dev) {
        DI_LOG_ERROR("cp: context parallelism (--cp-workers) needs the CPU forward: the "
                     "device-resident forward (--device) keeps its state on the device");
        return DI_ERR_UNSUPPORTED;
    }
    if (n_workers < 1 || n_workers >= DI_CP_MAX_RANKS) {
        DI_LOG_ERROR("cp: %d prefill workers (need 1 .. %d)", n_workers, DI_CP_MAX_RANKS - 1);
        return DI_ERR_INVALID;
    }
    di_cp *cp = di_calloc(1, sizeof *cp);
    if (!cp) return DI_ERR_NOMEM;
    cp->w = di_calloc((size_t)n_workers, sizeof *cp->w);
    if (!cp->w) {
        di_free(cp);
        return DI_ERR_NOMEM;
    }
    cp->m = m;
    cp->n = n_workers;
    cp->min_tokens = min_tokens > 0 ? min_tokens : DI_CP_MIN_TOKENS_DEFAULT;
    cp->corrupt_il = -1;
    cp->id = di_dsv4_model_id(m);
    di_ep_model_describe(m, cp->desc, sizeof cp->desc);
    di_cp_dims_init(m, &cp->dims);
    pthread_mutex_init(&cp->mu, NULL);
    cp->stats.n_workers = n_workers;
    for (int32_t i = 0; i < n_workers; i++) cp->w[i].fd = -1;
    di_status st = DI_OK;
    for (int32_t i = 0; i < n_workers && st == DI_OK; i++) {
        cp_worker *w = &cp->w[i];
        snprintf(w->addr, sizeof w->addr, "%s", workers[i]);
        if (!di_sock_split_addr(workers[i], w->host, sizeof w->host, &w->port) || !*w->host) {
            DI_LOG_ERROR("cp: prefill worker '%s' is not HOST:PORT", workers[i]);
            st = DI_ERR_INVALID;
            break;
        }
        st = worker_open(cp, w);
    }
    if (st != DI_OK) {
        di_cp_detach(cp);
        return st;
    }
    DI_LOG_INFO("cp: %d prefill worker(s); prefill calls of %d tokens or more run over %d ranks",
                n_workers, cp->min_tokens, n_workers + 1);
    m->cp = cp;
    *out = cp;
    return DI_OK;
}

void di_cp_detach(di_cp *cp) {
    if (!cp) return;
    for (int32_t i = 0; i < cp->n; i++) worker_close(&cp->w[i]);
    if (cp->m && cp->m->cp == cp) cp->m->cp = NULL;
    di_cp_buf_free(&cp->rx);
    di_free(cp->b_seqs);
    di_free(cp->b_tokens);
    di_free(cp->b_rows);
    di_free(cp->b_logits);
    pthread_mutex_destroy(&cp->mu);
    di_free(cp->w);
    di_free(cp);
}

int32_t di_cp_min_tokens(const di_cp *cp) {
    return cp->min_tokens;
}

void di_cp_set_min_tokens(di_cp *cp, int32_t n) {
    pthread_mutex_lock(&cp->mu);
    cp->min_tokens = n > 0 ? n : 1;
    pthread_mutex_unlock(&cp->mu);
}

void di_cp_test_corrupt(di_cp *cp, int32_t il) {
    pthread_mutex_lock(&cp->mu);
    cp->corrupt_il = il;
    pthread_mutex_unlock(&cp->mu);
}

void di_cp_get_stats(di_cp *cp, di_cp_stats *out) {
    pthread_mutex_lock(&cp->mu);
    *out = cp->stats;
    pthread_mutex_unlock(&cp->mu);
}

bool di_model_cp_stats(const di_model *m, di_cp_stats *out) {
    memset(out, 0, sizeof *out);
    if (!m->cp) return false;
    di_cp_get_stats(m->cp, out);
    return true;
}

// ---- the front: the session's state before a call (restored when it fails) ----

typedef struct backup {
    float *p; // owned: every used state layer's ring and compressor rings, then mtp_x
    int64_t n_ent[DI_CP_MAX_LAYERS][2];
    int32_t pos;
    bool pending;
} backup;

static size_t layer_floats(const di_model *m, int il) {
    const di_dsv4_layer_w *lw = di_dsv4_layer(m, il);
    size_t n = (size_t)DI_DSV4_RING_ROWS(m->hp.window) * (size_t)m->hp.head_dim;
    if (lw->ratio > 0) n += 2 * (size_t)di_dsv4_cmp_rows(&lw->cmp) * lw->cmp.c * lw->cmp.d;
    if (lw->ratio == 4)
        n += 2 * (size_t)di_dsv4_cmp_rows(&lw->idx_cmp) * lw->idx_cmp.c * lw->idx_cmp.d;
    return n;
}

// Copies (save) or puts back (!save) the session's state for layers [0, n_state).
static void backup_copy(backup *b, di_session *s, int32_t n_state, bool save) {
    const di_model *m = s->model;
    float *p = b->p;
#define MOVE(ptr, n)                                                                               \
    do {                                                                                           \
        if (save)                                                                                  \
            memcpy(p, (ptr), sizeof(float) * (size_t)(n));                                         \
        else                                                                                       \
            memcpy((ptr), p, sizeof(float) * (size_t)(n));                                         \
        p += (n);                                                                                  \
    } while (0)
    for (int il = 0; il < n_state; il++) {
        const di_dsv4_layer_w *lw = di_dsv4_layer(m, il);
        di_dsv4_layer_state *ls = &s->layers[il];
        MOVE(ls->ring, (size_t)DI_DSV4_RING_ROWS(m->hp.window) * (size_t)m->hp.head_dim);
        di_dsv4_cmp_state *cs[2] = {&ls->cmp, &ls->idx};
        const di_dsv4_compressor_w *cw[2] = {&lw->cmp, &lw->idx_cmp};
        for (int k = 0; k < (lw->ratio == 4 ? 2 : lw->ratio > 0 ? 1 : 0); k++) {
            size_t rf = (size_t)di_dsv4_cmp_rows(cw[k]) * cw[k]->c * cw[k]->d;
            MOVE(cs[k]->buf_c, rf);
            MOVE(cs[k]->buf_z, rf);
            if (save)
                b->n_ent[il][k] = cs[k]->n_entries;
            else
                cs[k]->n_entries = b->n_ent[il][k];
        }
    }
    if (s->mtp) MOVE(s->mtp_x, (size_t)(DI_DSV4_ROLLBACK_MAX + 1) * m->hp.hc_mult * m->hp.n_embd);
#undef MOVE
    if (save) {
        b->pos = s->pos;
        b->pending = s->mtp_pending;
    } else {
        s->pos = b->pos;
        s->mtp_pending = b->pending;
    }
}

// ---- the front: one call ----

typedef struct front_run {
    di_cp *cp;
    di_session *s;               // the session (NULL: an engine sequence, without MTP)
    di_dsv4_layer_state *layers; // the state the call advances (V4)
    di_dsv41_state *st41;        // the state the call advances (V4.1)
    int32_t R;                   // ranks of this call
    int32_t pos_last;            // first position of the front's piece
    int64_t sent, recv;
    // The relay (R >= 3): frames 0 .. n_relay - 1 of workers 0 .. R - 3 go on to their successors.
    pthread_t th;
    bool relay;
    int32_t n_relay;
    di_status relay_st;
    int64_t relay_sent, relay_recv;
    di_cp_buf relay_buf;
} front_run;

// Shuts every connection of the call down, so that a thread blocked on one returns.
static void shutdown_all(front_run *r) {
    for (int32_t i = 0; i < r->R - 1; i++)
        if (r->cp->w[i].fd >= 0) shutdown(r->cp->w[i].fd, SHUT_RDWR);
}

static di_status relay_one(front_run *r, cp_worker *src, cp_worker *dst) {
    di_cp_hdr h;
    char why[DI_CP_MAX_TEXT + 1];
    di_status st = di_cp_recv_hdr(src->fd, &h, why, sizeof why);
    if (st != DI_OK) {
        DI_LOG_ERROR("cp: worker %s: %s", src->addr, why);
        return DI_ERR_IO;
    }
    if (buf_reserve(&r->relay_buf, h.len) != DI_OK) return DI_ERR_NOMEM;
    if (h.len && di_sock_recv_all(src->fd, r->relay_buf.p, (size_t)h.len) != DI_OK) {
        DI_LOG_ERROR("cp: worker %s: connection closed or timed out", src->addr);
        return DI_ERR_IO;
    }
    r->relay_recv += (int64_t)(sizeof h + h.len);
    if (h.type == DI_CP_ERROR) {
        DI_LOG_ERROR("cp: worker %s: %.*s", src->addr, (int)h.len, (const char *)r->relay_buf.p);
        return DI_ERR_IO;
    }
    if (h.type != DI_CP_LAYER && h.type != DI_CP_LAYER41 && h.type != DI_CP_XROW) {
        DI_LOG_ERROR("cp: worker %s: frame type %u where a state message was due", src->addr,
                     (unsigned)h.type);
        return DI_ERR_IO;
    }
    st = di_cp_send_frame(dst->fd, h.type, r->relay_buf.p, h.len);
    if (st != DI_OK) DI_LOG_ERROR("cp: worker %s: sending failed", dst->addr);
    r->relay_sent += (int64_t)(sizeof h + h.len);
    return st;
}

// The relay thread: message k of worker i goes to worker i + 1, k outer, so every worker gets its
// layer-l input as soon as its predecessor has sent it (the front computes meanwhile).
static void *relay_main(void *p) {
    front_run *r = p;
    for (int32_t k = 0; k < r->n_relay && r->relay_st == DI_OK; k++)
        for (int32_t i = 0; i + 2 < r->R && r->relay_st == DI_OK; i++)
            r->relay_st = relay_one(r, &r->cp->w[i], &r->cp->w[i + 1]);
    if (r->relay_st != DI_OK) shutdown_all(r);
    return NULL;
}

// V4.1: before each layer's attention (and the DSpark context rows), the last worker's state of
// that state layer, installed.
static di_status front_attn41(front_run *r, int il) {
    di_cp *cp = r->cp;
    cp_worker *w = &cp->w[r->R - 2];
    uint64_t len;
    di_status st = di_cp_recv_frame(w->fd, "cp", w->addr, DI_CP_LAYER41, &cp->rx, &len, &r->recv);
    if (st != DI_OK) return st;
    di_cp_layer41 l;
    char why[256];
    st = di_cp_decode_layer41(cp->rx.p, len, &cp->dims, &l, why, sizeof why);
    if (st == DI_OK && (l.il != il || l.pos != r->pos_last)) {
        snprintf(why, sizeof why, "state of layer %d at position %lld where layer %d at %d was due",
                 l.il, (long long)l.pos, il, r->pos_last);
        st = DI_ERR_FORMAT;
    }
    if (st == DI_OK && cp->corrupt_il == il) { // one code of the newest window row
        const int64_t rows = r->st41->ring_rows;
        ((uint8_t *)l.ring)[((r->pos_last - 1) % rows) * r->st41->ring_row_bytes] ^= 0x11;
    }
    if (st == DI_OK) st = di_cp_install_layer41(&cp->dims, r->st41, &l, why, sizeof why);
    if (st != DI_OK) {
        DI_LOG_ERROR("cp: worker %s: %s", w->addr, why);
        return DI_ERR_IO;
    }
    return DI_OK;
}

// Before each layer's attention: the last worker's state of that layer, installed.
static di_status front_attn(void *user, di_dsv4_ctx *c, int il, bool after) {
    (void)c;
    if (after) return DI_OK;
    front_run *r = user;
    if (r->st41) return front_attn41(r, il);
    di_cp *cp = r->cp;
    const di_model *m = cp->m;
    cp_worker *w = &cp->w[r->R - 2];
    uint64_t len;
    di_status st = di_cp_recv_frame(w->fd, "cp", w->addr, DI_CP_LAYER, &cp->rx, &len, &r->recv);
    if (st != DI_OK) return st;
    di_cp_layer l;
    char why[256];
    const int64_t pos = il < m->hp.n_layer ? r->pos_last : r->pos_last - 1;
    st = di_cp_decode_layer(cp->rx.p, len, &cp->dims, &l, why, sizeof why);
    if (st == DI_OK && (l.il != il || l.pos != pos)) {
        snprintf(why, sizeof why,
                 "state of layer %d at position %lld where layer %d at %lld was due", l.il,
                 (long long)l.pos, il, (long long)pos);
        st = DI_ERR_FORMAT;
    }
    if (st == DI_OK && cp->corrupt_il == il) {
        const int64_t rows = DI_DSV4_RING_ROWS(m->hp.window);
        ((float *)l.ring)[((pos - 1) % rows) * m->hp.head_dim] += 1.0f;
    }
    if (st == DI_OK) st = di_cp_install_layer(m, &r->layers[il], &l, why, sizeof why);
    if (st != DI_OK) {
        DI_LOG_ERROR("cp: worker %s: %s", w->addr, why);
        return DI_ERR_IO;
    }
    return DI_OK;
}

// Before the MTP block: the last worker's last main-stream row is the pending position.
static di_status front_mtp_input(void *user, di_session *s, const float *x_last) {
    (void)x_last;
    front_run *r = user;
    di_cp *cp = r->cp;
    cp_worker *w = &cp->w[r->R - 2];
    uint64_t len;
    di_status st = di_cp_recv_frame(w->fd, "cp", w->addr, DI_CP_XROW, &cp->rx, &len, &r->recv);
    if (st != DI_OK) return st;
    int32_t pos;
    const float *row;
    char why[256];
    st = di_cp_decode_xrow(cp->rx.p, len, &cp->dims, &pos, &row, why, sizeof why);
    if (st == DI_OK && pos != r->pos_last - 1) {
        snprintf(why, sizeof why, "main-stream row of position %d where %d was due", pos,
                 r->pos_last - 1);
        st = DI_ERR_FORMAT;
    }
    if (st != DI_OK) {
        DI_LOG_ERROR("cp: worker %s: %s", w->addr, why);
        return DI_ERR_IO;
    }
    memcpy(s->mtp_x + (int64_t)(pos % (DI_DSV4_ROLLBACK_MAX + 1)) * cp->dims.row_floats, row,
           sizeof(float) * (size_t)cp->dims.row_floats);
    s->mtp_pending = true;
    return DI_OK;
}

// Sends rank r its job (and rank 0 the state at p0 when there is one).
static di_status send_job(front_run *fr, int32_t r, const int32_t *pb, const int32_t *tokens,
                          int32_t flags, int32_t n_state) {
    di_cp *cp = fr->cp;
    const di_session *s = fr->s;
    const di_dsv4_layer_state *layers = fr->layers;
    cp_worker *w = &cp->w[r];
    const int32_t p0 = pb[0], n = pb[r + 1] - pb[r];
    // V4.1: the Engram history ids of the positions before the piece (the front's history holds
    // them: its prefix's and this call's, written before the jobs go).
    const int32_t n_hist = cp->dims.n_hist < pb[r] ? cp->dims.n_hist : pb[r];
    const uint64_t head = di_cp_job_head_bytes(n_state),
                   len = head + 4 * (uint64_t)n + 4 * (uint64_t)n_hist;
    if (buf_reserve(&cp->rx, len) != DI_OK) return DI_ERR_NOMEM;
    uint8_t *p = cp->rx.p;
    int32_t h[8] = {r, fr->R, pb[r], n, flags, n_state, n_hist, 0};
    memcpy(p, h, sizeof h);
    for (int32_t il = 0; il < n_state; il++) {
        // The last worker's successor is this process, which holds its prefix's entries.
        int64_t from[2] = {0, 0};
        if (r == fr->R - 2 && fr->st41) {
            if (il < cp->dims.n_layers && cp->dims.src[il]) from[0] = fr->st41->src[il].n_entries;
        } else if (r == fr->R - 2) {
            from[0] = layers[il].cmp.n_entries;
            from[1] = layers[il].idx.n_entries;
        }
        memcpy(p + 32 + 16 * (uint64_t)il, from, sizeof from);
    }
    memcpy(p + head, tokens + (pb[r] - p0), 4 * (size_t)n);
    if (n_hist)
        memcpy(p + head + 4 * (size_t)n, fr->st41->hist + pb[r] - n_hist, 4 * (size_t)n_hist);
    di_status st = di_cp_send_frame(w->fd, DI_CP_JOB, p, len);
    fr->sent += (int64_t)(sizeof(di_cp_hdr) + len);
    if (st == DI_OK && (flags & DI_CP_JOB_PREFIX) && fr->st41) {
        for (int32_t il = 0; il < n_state && st == DI_OK; il++)
            st = di_cp_send_layer41(w->fd, cp->m, &cp->dims, fr->st41, il, p0, 0, &fr->sent);
    } else if (st == DI_OK && (flags & DI_CP_JOB_PREFIX)) {
        const int64_t zero[2] = {0, 0};
        for (int32_t il = 0; il < n_state && st == DI_OK; il++) {
            int64_t pos = il < cp->dims.n_layers ? p0 : s->mtp_pending ? p0 - 1 : p0;
            st = di_cp_send_layer(w->fd, cp->m, &layers[il], il, pos, zero, &fr->sent);
        }
        if (st == DI_OK && (flags & DI_CP_JOB_PENDING)) {
            int32_t xh[2] = {p0 - 1, 0};
            const float *row =
                s->mtp_x + (int64_t)((p0 - 1) % (DI_DSV4_ROLLBACK_MAX + 1)) * cp->dims.row_floats;
            st = di_cp_send_hdr(w->fd, DI_CP_XROW, 8 + 4 * (uint64_t)cp->dims.row_floats);
            if (st == DI_OK) st = di_sock_send_all(w->fd, xh, sizeof xh);
            if (st == DI_OK)
                st = di_sock_send_all(w->fd, row, sizeof(float) * (size_t)cp->dims.row_floats);
            fr->sent += (int64_t)(sizeof(di_cp_hdr) + 8 + 4 * cp->dims.row_floats);
        }
    }
    if (st != DI_OK && st != DI_ERR_NOMEM) {
        DI_LOG_ERROR("cp: worker %s: sending the job failed", w->addr);
        st = DI_ERR_IO;
    }
    return st;
}

// Takes worker r's DONE: its logits rows go to lg (when asked), its MTP rows to ml.
static di_status recv_done(front_run *fr, int32_t r, int32_t n_logits, int32_t n_mtp, float *lg,
                           float *ml) {
    di_cp *cp = fr->cp;
    cp_worker *w = &cp->w[r];
    const int64_t V = cp->dims.n_vocab;
    uint64_t len;
    di_status st = di_cp_recv_frame(w->fd, "cp", w->addr, DI_CP_DONE, &cp->rx, &len, &fr->recv);
    if (st != DI_OK) return st;
    const uint8_t *p = cp->rx.p;
    int32_t nn[2] = {-1, -1};
    if (len >= 8) memcpy(nn, p, sizeof nn);
    if (nn[0] != n_logits || nn[1] != n_mtp ||
        len != 8 + 4 * (uint64_t)V * (uint64_t)(n_logits + n_mtp)) {
        DI_LOG_ERROR("cp: worker %s: %d + %d logit rows in %llu bytes where %d + %d were due",
                     w->addr, nn[0], nn[1], (unsigned long long)len, n_logits, n_mtp);
        return DI_ERR_IO;
    }
    if (n_logits) memcpy(lg, p + 8, sizeof(float) * (size_t)(n_logits * V));
    if (n_mtp) memcpy(ml, p + 8 + 4 * n_logits * V, sizeof(float) * (size_t)(n_mtp * V));
    return DI_OK;
}

static double now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e3 + ts.tv_nsec / 1e6;
}

// ---- the front: a V4.1 session ----

// V4.1's state before a call (restored when it fails): every state layer's window ring, every
// ratio-2 source's (C, Z) slots (di_dsv41_tail_save's layout), the entry counts, the position and
// the DSpark position. Entries and history are only written beyond the counts and the position.
typedef struct backup41 {
    uint8_t *tail; // owned [di_dsv41_tail_bytes]
    int64_t n_ent[DI_CP_MAX_LAYERS];
    int32_t pos, dspark_pos;
} backup41;

static void backup41_restore(const backup41 *b, di_session *s) {
    const di_hparams *hp = &s->model->hp;
    di_dsv41_state *st = s->v41;
    const size_t ring = (size_t)st->ring_rows * (size_t)st->ring_row_bytes;
    const size_t cz = (size_t)DI_DSV41_CZ_SLOTS * 2 * (size_t)hp->head_dim * sizeof(float);
    const uint8_t *p = b->tail;
    for (int il = 0; il < st->n_state_layers; il++, p += ring) memcpy(st->ring[il], p, ring);
    for (int il = 0; il < hp->n_layer; il++) {
        if (st->src[il].cz) memcpy(st->src[il].cz, p, cz), p += cz;
        st->src[il].n_entries = b->n_ent[il];
    }
    s->pos = b->pos;
    st->dspark_pos = b->dspark_pos;
}

// One V4.1 sequence of session s (its whole call or one piece) with hook cp.
static di_status forward41(di_session *s, const int32_t *tokens, int32_t n_tok, float *logits,
                           bool last_only, const di_dsv4_cp_hook *cp) {
    di_dsv41_seq b = {
        .s = s, .tokens = tokens, .n_tok = n_tok, .n_out = logits ? (last_only ? 1 : n_tok) : 0};
    return di_dsv41_forward_cp(s->model, di_dsv41_ws(s), &b, logits, cp);
}

// Whether a V4.1 session's state is in its ordinary form at its position: every kv source holds
// exactly the entries of the groups closed before it (not a bounded replay after a prefix hit,
// di_dsv41_restart, whose kept entries run ahead of its position).
static bool ordinary41(const di_session *s) {
    const di_hparams *hp = &s->model->hp;
    for (int il = 0; il < hp->n_layer; il++)
        if (hp->kv_source[il] && s->v41->src[il].n_entries != s->pos / hp->compress_ratio[il])
            return false;
    return true;
}

// The end of a call over the workers (cp->mu held; released here): on failure the connections of
// the call are in an unknown place, so they are closed (the next call reconnects) and the status
// becomes DI_ERR_IO (DI_ERR_NOMEM stays); the stats and, on success, one log line ("cp: <what> of
// ..."). The caller puts its state back on failure.
static di_status call_end(di_cp *cp, front_run *fr, int32_t R, di_status st, const char *what,
                          int32_t n_tok, int32_t p0, double t0) {
    if (st != DI_OK) {
        shutdown_all(fr);
        for (int32_t r = 0; r < R - 1; r++) worker_close(&cp->w[r]);
        if (st != DI_ERR_NOMEM) st = DI_ERR_IO;
        cp->stats.errors++;
    } else {
        cp->stats.tokens += n_tok;
    }
    const int64_t b = fr->sent + fr->relay_sent + fr->recv + fr->relay_recv;
    cp->stats.bytes_sent += fr->sent + fr->relay_sent;
    cp->stats.bytes_recv += fr->recv + fr->relay_recv;
    pthread_mutex_unlock(&cp->mu);
    di_cp_buf_free(&fr->relay_buf);
    if (st == DI_OK) {
        const double ms = now_ms() - t0;
        DI_LOG_INFO("cp: %s of %d tokens at position %d over %d ranks in %.1f ms (%.0f tokens/s), "
                    "%lld bytes exchanged (%.0f per token)",
                    what, n_tok, p0, R, ms, n_tok / (ms / 1e3), (long long)b, (double)b / n_tok);
    }
    return st;
}

// A V4.1 session's call over the workers (out: as di_session_forward's). restore: put the session
// back where it was when the call fails (a session's contract; the engine's sequences end instead,
// so it saves no copy).
static di_status session_forward41(di_cp *cp, di_session *s, const int32_t *tokens, int32_t n_tok,
                                   const di_forward_out *out, bool restore) {
    di_model *m = s->model;
    const di_hparams *hp = &m->hp;
    const int64_t V = hp->n_vocab;
    if (out && out->n_mtp_out) *out->n_mtp_out = 0;
    int32_t R = cp->n + 1;
    if (R > n_tok / DI_CP_MIN_PIECE) R = n_tok / DI_CP_MIN_PIECE;
    if (R < 2 || !ordinary41(s))
        return forward41(s, tokens, n_tok, out ? out->logits : NULL, out && out->last_only, NULL);
    di_dsv41_state *s41 = s->v41;
    const double t0 = now_ms();
    pthread_mutex_lock(&cp->mu);
    cp->stats.calls++;
    const int32_t p0 = s->pos, n_state = s41->n_state_layers;
    int32_t pb[DI_CP_MAX_RANKS + 1];
    for (int32_t r = 0; r <= R; r++) pb[r] = p0 + (int32_t)((int64_t)n_tok * r / R);
    const bool want_lg = out && out->logits && !out->last_only;
    front_run fr = {.cp = cp, .st41 = s41, .R = R, .pos_last = pb[R - 1], .relay_st = DI_OK};
    backup41 bk = {.pos = p0, .dspark_pos = s41->dspark_pos};
    bool saved = false;
    // Room for every entry and history id the call writes, before anything is received.
    di_status st = di_dsv41_reserve_state(s, pb[R], pb[R]);
    if (st != DI_OK) goto out;
    if (restore && !(bk.tail = di_malloc(di_dsv41_tail_bytes(s)))) {
        st = DI_ERR_NOMEM;
        goto out;
    }
    for (int32_t r = 0; r < R - 1 && st == DI_OK; r++) {
        st = worker_open(cp, &cp->w[r]);
        if (st == DI_ERR_INVALID) st = DI_ERR_IO; // a worker restarted with another model
    }
    if (st != DI_OK) goto out;
    if (restore) {
        di_dsv41_tail_save(s, bk.tail);
        for (int il = 0; il < hp->n_layer; il++) bk.n_ent[il] = s41->src[il].n_entries;
        saved = true;
    }
    // The Engram history of the earlier pieces' positions: the front's own rows look back into
    // them, and the jobs carry the ids before each piece.
    if (hp->n_engram > 0)
        for (int32_t t = 0; t < pb[R - 1] - p0; t++) s41->hist[p0 + t] = m->v41->cmap[tokens[t]];
    for (int32_t r = 0; r < R - 1 && st == DI_OK; r++) {
        int32_t flags = (s->mtp ? DI_CP_JOB_MTP : 0) | (want_lg ? DI_CP_JOB_LOGITS : 0);
        if (r == 0 && p0 > 0) flags |= DI_CP_JOB_PREFIX;
        st = send_job(&fr, r, pb, tokens, flags, n_state);
    }
    if (st == DI_OK && R >= 3) {
        fr.n_relay = n_state;
        if (pthread_create(&fr.th, NULL, relay_main, &fr) != 0) {
            DI_LOG_ERROR("cp: cannot start the relay thread");
            st = DI_ERR_IO;
        } else {
            fr.relay = true;
        }
    }
    // The front's own piece: the last one; its logits go after the workers' rows.
    const int32_t off = pb[R - 1] - p0;
    if (st == DI_OK) {
        di_dsv4_cp_hook hook = {.attn = front_attn, .user = &fr};
        float *lg = out && out->logits ? out->logits + (out->last_only ? 0 : off * V) : NULL;
        s->pos = pb[R - 1];
        st = forward41(s, tokens + off, n_tok - off, lg, out && out->last_only, &hook);
    }
    if (st != DI_OK) shutdown_all(&fr);
    if (fr.relay) pthread_join(fr.th, NULL);
    if (st == DI_OK) st = fr.relay_st;
    for (int32_t r = 0; r < R - 1 && st == DI_OK; r++) {
        const int32_t n = pb[r + 1] - pb[r];
        st = recv_done(&fr, r, want_lg ? n : 0, 0, want_lg ? out->logits + (pb[r] - p0) * V : NULL,
                       NULL);
    }
out:
    st = call_end(cp, &fr, R, st, "V4.1 prefill", n_tok, p0, t0);
    if (st != DI_OK) { // the session put back where it was
        if (saved) backup41_restore(&bk, s);
        s->pos = p0;
    }
    di_free(bk.tail);
    return st;
}

di_status di_cp_session_forward(di_cp *cp, di_session *s, const int32_t *tokens, int32_t n_tok,
                                const di_forward_out *out) {
    if (s->v41) return session_forward41(cp, s, tokens, n_tok, out, true);
    di_model *m = s->model;
    const int64_t V = m->hp.n_vocab;
    int32_t R = cp->n + 1;
    if (R > n_tok / DI_CP_MIN_PIECE) R = n_tok / DI_CP_MIN_PIECE;
    if (R < 2) return di_dsv4_session_forward(s, tokens, n_tok, out, NULL);
    const double t0 = now_ms();
    pthread_mutex_lock(&cp->mu);
    cp->stats.calls++;
    const int32_t p0 = s->pos, n_state = m->hp.n_layer + (s->mtp ? 1 : 0);
    int32_t pb[DI_CP_MAX_RANKS + 1];
    for (int32_t r = 0; r <= R; r++) pb[r] = p0 + (int32_t)((int64_t)n_tok * r / R);
    const bool want_lg = out && out->logits && !out->last_only;
    const bool want_ml = s->mtp && out && out->mtp_logits;
    const bool pending0 = s->mtp && s->mtp_pending;
    front_run fr = {
        .cp = cp, .s = s, .layers = s->layers, .R = R, .pos_last = pb[R - 1], .relay_st = DI_OK};
    backup bk = {0};
    bool saved = false;
    size_t bk_floats = 0;
    for (int il = 0; il < n_state; il++) bk_floats += layer_floats(m, il);
    if (s->mtp) bk_floats += (size_t)(DI_DSV4_ROLLBACK_MAX + 1) * cp->dims.row_floats;
    di_status st = DI_OK;
    // Room for every entry the call closes, before anything is received into the state, and
    // scratch for the front's piece only.
    s->pos = pb[R - 1];
    st = di_dsv4_session_reserve(s, pb[R] - pb[R - 1]);
    s->pos = p0;
    if (st != DI_OK) goto out;
    if (!(bk.p = di_malloc(sizeof(float) * bk_floats))) {
        st = DI_ERR_NOMEM;
        goto out;
    }
    for (int32_t r = 0; r < R - 1 && st == DI_OK; r++) {
        st = worker_open(cp, &cp->w[r]);
        if (st == DI_ERR_INVALID) st = DI_ERR_IO; // a worker restarted with another model
    }
    if (st != DI_OK) goto out;
    backup_copy(&bk, s, n_state, true);
    saved = true;
    for (int32_t r = 0; r < R - 1 && st == DI_OK; r++) {
        int32_t flags = (s->mtp ? DI_CP_JOB_MTP : 0) | (want_lg ? DI_CP_JOB_LOGITS : 0) |
                        (want_ml ? DI_CP_JOB_MTP_LOGITS : 0);
        if (r == 0 && p0 > 0) flags |= DI_CP_JOB_PREFIX | (pending0 ? DI_CP_JOB_PENDING : 0);
        st = send_job(&fr, r, pb, tokens, flags, n_state);
    }
    if (st == DI_OK && R >= 3) {
        fr.n_relay = m->hp.n_layer + (s->mtp ? 2 : 0);
        if (pthread_create(&fr.th, NULL, relay_main, &fr) != 0) {
            DI_LOG_ERROR("cp: cannot start the relay thread");
            st = DI_ERR_IO;
        } else {
            fr.relay = true;
        }
    }
    // The front's own piece: the last one, at pb[R - 1]; its logits and MTP logits go after the
    // workers' rows.
    const int32_t off = pb[R - 1] - p0, n_last = n_tok - off;
    const int32_t mtp_off = (pending0 ? 1 : 0) + off - 1;
    int32_t n_mtp_front = 0;
    if (st == DI_OK) {
        di_forward_out fo = {
            .logits = out && out->logits ? out->logits + (out->last_only ? 0 : off * V) : NULL,
            .last_only = out && out->last_only,
            .mtp_logits = want_ml ? out->mtp_logits + (int64_t)mtp_off * V : NULL,
            .n_mtp_out = &n_mtp_front};
        di_dsv4_cp_hook hook = {.attn = front_attn, .mtp_input = front_mtp_input, .user = &fr};
        s->pos = pb[R - 1];
        st = di_dsv4_session_forward(s, tokens + off, n_last, &fo, &hook);
    }
    if (st != DI_OK) shutdown_all(&fr);
    if (fr.relay) pthread_join(fr.th, NULL);
    if (st == DI_OK) st = fr.relay_st;
    for (int32_t r = 0; r < R - 1 && st == DI_OK; r++) {
        const int32_t n = pb[r + 1] - pb[r];
        const int32_t n_ml = want_ml ? (r == 0 ? (pending0 ? 1 : 0) + n - 1 : n) : 0;
        const int32_t ml_off = r == 0 ? 0 : (pending0 ? 1 : 0) + (pb[r] - p0) - 1;
        st = recv_done(&fr, r, want_lg ? n : 0, n_ml,
                       want_lg ? out->logits + (pb[r] - p0) * V : NULL,
                       n_ml ? out->mtp_logits + (int64_t)ml_off * V : NULL);
    }
    if (st == DI_OK && out && out->n_mtp_out) *out->n_mtp_out = s->mtp ? mtp_off + n_mtp_front : 0;
out:
    st = call_end(cp, &fr, R, st, "prefill", n_tok, p0, t0);
    if (st != DI_OK) { // the session put back where it was
        if (saved) backup_copy(&bk, s, n_state, false);
        s->pos = p0;
    }
    di_free(bk.p);
    return st;
}

di_status di_cp_v41_seq_forward(di_cp *cp, di_session *s, const int32_t *tokens, int32_t n_tok,
                                float *logits) {
    di_forward_out fo = {.logits = logits, .last_only = true};
    return session_forward41(cp, s, tokens, n_tok, logits ? &fo : NULL, false);
}

// ---- the front: one sequence of a ragged batch (the serving engine) ----

// Whether seq's state is in its ordinary form at its position: every compressor holds exactly
// the entries of the windows closed before it (not a bounded replay after a prefix hit, whose
// kept entries run ahead of its position) and every window row it reads is there.
static bool ordinary_state(const di_model *m, const di_dsv4_seq *sq) {
    if (sq->win_lo != 0) return false;
    for (int il = 0; il < m->hp.n_layer; il++) {
        const di_dsv4_layer_w *lw = &m->layers[il];
        if (lw->ratio <= 0) continue;
        const int64_t n = sq->pos / lw->ratio;
        if (sq->layers[il].cmp.n_entries != n ||
            (lw->ratio == 4 && sq->layers[il].idx.n_entries != n))
            return false;
    }
    return true;
}

di_status di_cp_seq_forward(di_cp *cp, di_dsv4_ctx *c, const int32_t *tokens,
                            const int32_t *logit_rows, int32_t n_logit_rows, float *logits) {
    di_model *m = c->model;
    DI_ASSERT(c->n_seq == 1 && !c->cp);
    di_dsv4_seq sq = c->seqs[0];
    const int32_t n_tok = sq.n_tok, p0 = sq.pos;
    int32_t R = cp->n + 1;
    if (R > n_tok / DI_CP_MIN_PIECE) R = n_tok / DI_CP_MIN_PIECE;
    int32_t pb[DI_CP_MAX_RANKS + 1];
    for (int32_t r = 0; r <= R; r++) pb[r] = p0 + (int32_t)((int64_t)n_tok * r / R);
    // Only the front's piece gives logits (an engine asks for its chunk's last row).
    const bool local =
        R < 2 || (n_logit_rows > 0 && logit_rows[0] < pb[R - 1] - p0) || !ordinary_state(m, &sq);
    if (local) return di_dsv4_forward_batch(c, tokens, logit_rows, n_logit_rows, logits);
    const double t0 = now_ms();
    pthread_mutex_lock(&cp->mu);
    cp->stats.calls++;
    front_run fr = {
        .cp = cp, .layers = sq.layers, .R = R, .pos_last = pb[R - 1], .relay_st = DI_OK};
    di_status st = DI_OK;
    for (int32_t r = 0; r < R - 1 && st == DI_OK; r++) {
        st = worker_open(cp, &cp->w[r]);
        if (st == DI_ERR_INVALID) st = DI_ERR_IO;
    }
    for (int32_t r = 0; r < R - 1 && st == DI_OK; r++)
        st = send_job(&fr, r, pb, tokens, r == 0 && p0 > 0 ? DI_CP_JOB_PREFIX : 0, m->hp.n_layer);
    if (st == DI_OK && R >= 3) {
        fr.n_relay = m->hp.n_layer;
        if (pthread_create(&fr.th, NULL, relay_main, &fr) != 0) {
            DI_LOG_ERROR("cp: cannot start the relay thread");
            st = DI_ERR_IO;
        } else {
            fr.relay = true;
        }
    }
    const int32_t off = pb[R - 1] - p0;
    int32_t rows[DI_CP_MAX_LOGIT_ROWS];
    DI_ASSERT(n_logit_rows <= DI_CP_MAX_LOGIT_ROWS);
    for (int32_t k = 0; k < n_logit_rows; k++) rows[k] = logit_rows[k] - off;
    if (st == DI_OK) {
        di_dsv4_cp_hook hook = {.attn = front_attn, .user = &fr};
        di_dsv4_seq mine = sq;
        mine.pos = pb[R - 1];
        mine.n_tok = n_tok - off;
        di_dsv4_ctx fc = *c;
        fc.seqs = &mine;
        fc.cp = &hook;
        st = di_dsv4_forward_batch(&fc, tokens + off, rows, n_logit_rows, logits);
        c->status = fc.status;
    }
    if (st != DI_OK) shutdown_all(&fr);
    if (fr.relay) pthread_join(fr.th, NULL);
    if (st == DI_OK) st = fr.relay_st;
    for (int32_t r = 0; r < R - 1 && st == DI_OK; r++) st = recv_done(&fr, r, 0, 0, NULL, NULL);
    st = call_end(cp, &fr, R, st, "sequence chunk", n_tok, p0, t0);
    if (st != DI_OK) c->status = st;
    return st;
}

// ---- the front: a ragged batch (the serving engine's step) ----

static di_status grow(void **p, size_t *cap, size_t need) {
    if (need <= *cap) return DI_OK;
    void *q = di_realloc(*p, need);
    if (!q) return DI_ERR_NOMEM;
    *p = q;
    *cap = need;
    return DI_OK;
}

di_status di_cp_batch_forward(di_cp *cp, di_dsv4_ctx *c, const int32_t *tokens,
                              const int32_t *logit_rows, int32_t n_logit_rows, float *logits) {
    const int64_t V = cp->dims.n_vocab;
    bool any = false;
    for (int32_t i = 0; i < c->n_seq; i++) any |= c->seqs[i].n_tok >= cp->min_tokens;
    if (!any) return di_dsv4_forward_batch(c, tokens, logit_rows, n_logit_rows, logits);
    int32_t n_rows = 0;
    for (int32_t i = 0; i < c->n_seq; i++) n_rows += c->seqs[i].n_tok;
    // The rest's buffers: kept between steps, grown to the largest batch seen.
    if (grow((void **)&cp->b_seqs, &cp->b_seqs_cap, sizeof(di_dsv4_seq) * (size_t)c->n_seq) ||
        grow((void **)&cp->b_tokens, &cp->b_tokens_cap, sizeof(int32_t) * (size_t)n_rows) ||
        grow((void **)&cp->b_rows, &cp->b_rows_cap, 2 * sizeof(int32_t) * (size_t)n_logit_rows) ||
        grow((void **)&cp->b_logits, &cp->b_logits_cap,
             sizeof(float) * (size_t)n_logit_rows * (size_t)V))
        return DI_ERR_NOMEM;
    int32_t *b_k = cp->b_rows + n_logit_rows; // the rest's logit rows' places in logits
    int32_t n_rest = 0, n_rest_rows = 0, n_rest_logits = 0, k = 0;
    di_status st = DI_OK;
    for (int32_t i = 0, r0 = 0; i < c->n_seq && st == DI_OK; r0 += c->seqs[i].n_tok, i++) {
        const di_dsv4_seq *sq = &c->seqs[i];
        const int32_t k0 = k;
        while (k < n_logit_rows && logit_rows[k] < r0 + sq->n_tok) k++;
        if (sq->n_tok >= cp->min_tokens && k - k0 <= DI_CP_MAX_LOGIT_ROWS) {
            // Alone over the workers; its logit rows are contiguous in logits.
            int32_t rows[DI_CP_MAX_LOGIT_ROWS];
            for (int32_t j = k0; j < k; j++) rows[j - k0] = logit_rows[j] - r0;
            di_dsv4_ctx one = *c;
            one.seqs = &c->seqs[i];
            one.n_seq = 1;
            st = di_cp_seq_forward(cp, &one, tokens + r0, rows, k - k0, logits + k0 * V);
            continue;
        }
        cp->b_seqs[n_rest++] = *sq;
        memcpy(cp->b_tokens + n_rest_rows, tokens + r0, sizeof(int32_t) * (size_t)sq->n_tok);
        for (int32_t j = k0; j < k; j++) {
            cp->b_rows[n_rest_logits] = logit_rows[j] - r0 + n_rest_rows;
            b_k[n_rest_logits++] = j;
        }
        n_rest_rows += sq->n_tok;
    }
    if (st == DI_OK && n_rest > 0) {
        di_dsv4_ctx rest = *c;
        rest.seqs = cp->b_seqs;
        rest.n_seq = n_rest;
        st = di_dsv4_forward_batch(&rest, cp->b_tokens, cp->b_rows, n_rest_logits, cp->b_logits);
        for (int32_t j = 0; st == DI_OK && j < n_rest_logits; j++)
            memcpy(logits + b_k[j] * V, cp->b_logits + j * V, sizeof(float) * (size_t)V);
    }
    if (st != DI_OK) c->status = st;
    return st;
}
