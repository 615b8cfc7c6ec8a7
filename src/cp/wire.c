// wire — the context-parallel frames and their decoders (cp/wire.h).
#include "cp/wire.h"

#include <stdio.h>
#include <string.h>

#include "base/sock.h"

uint64_t di_cp_frame_limit(uint16_t type) {
    switch (type) {
    case DI_CP_HELLO:
    case DI_CP_ERROR:
        return DI_CP_MAX_TEXT;
    case DI_CP_JOB:
        return DI_CP_MAX_JOB;
    case DI_CP_LAYER:
    case DI_CP_LAYER41:
    case DI_CP_XROW:
    case DI_CP_DONE:
        return DI_CP_MAX_FRAME;
    case DI_CP_OK:
        return 0;
    default:
        return UINT64_MAX; // unknown
    }
}

di_status di_cp_hdr_check(const di_cp_hdr *h, char *why, size_t why_n) {
    return di_sock_frame_check(h->magic, h->version, h->type, h->len, DI_CP_MAGIC, DI_CP_VERSION,
                               "context-parallel", di_cp_frame_limit(h->type), why, why_n);
}

static int32_t rd_i32(const uint8_t *p) {
    int32_t v;
    memcpy(&v, p, sizeof v);
    return v;
}

static int64_t rd_i64(const uint8_t *p) {
    int64_t v;
    memcpy(&v, p, sizeof v);
    return v;
}

// ---- job ----

uint64_t di_cp_job_head_bytes(int32_t n_state) {
    return 32 + 16 * (uint64_t)n_state;
}

di_status di_cp_decode_job(const void *payload, uint64_t len, const di_cp_dims *dims,
                           di_cp_job *out, char *why, size_t why_n) {
    const uint8_t *p = payload;
    if (len < 32) {
        snprintf(why, why_n, "job of %llu bytes is shorter than its 32-byte header",
                 (unsigned long long)len);
        return DI_ERR_FORMAT;
    }
    di_cp_job j = {.rank = rd_i32(p),
                   .n_ranks = rd_i32(p + 4),
                   .pos = rd_i32(p + 8),
                   .n_tok = rd_i32(p + 12),
                   .flags = rd_i32(p + 16),
                   .n_state = rd_i32(p + 20),
                   .n_hist = rd_i32(p + 24)};
    if (rd_i32(p + 28) != 0) {
        snprintf(why, why_n, "nonzero reserved words in the job header");
        return DI_ERR_FORMAT;
    }
    if (j.n_ranks < 2 || j.n_ranks > DI_CP_MAX_RANKS || j.rank < 0 || j.rank >= j.n_ranks - 1) {
        snprintf(why, why_n, "rank %d of %d (a worker is one of ranks 0 .. n - 2, 2 <= n <= %d)",
                 j.rank, j.n_ranks, DI_CP_MAX_RANKS);
        return DI_ERR_FORMAT;
    }
    if (j.flags & ~(DI_CP_JOB_MTP | DI_CP_JOB_LOGITS | DI_CP_JOB_MTP_LOGITS | DI_CP_JOB_PREFIX |
                    DI_CP_JOB_PENDING)) {
        snprintf(why, why_n, "unknown job flags 0x%x", (unsigned)j.flags);
        return DI_ERR_FORMAT;
    }
    const bool mtp = j.flags & DI_CP_JOB_MTP;
    if (mtp && !dims->has_mtp) {
        snprintf(why, why_n, "a job with MTP for a model without an MTP block");
        return DI_ERR_FORMAT;
    }
    if ((j.flags & (DI_CP_JOB_MTP_LOGITS | DI_CP_JOB_PENDING)) && (!mtp || dims->v41)) {
        snprintf(why, why_n, "MTP flags on a job without MTP, or for a V4.1 model (DSpark)");
        return DI_ERR_FORMAT;
    }
    if (j.n_tok < 1 || j.n_tok > DI_CP_MAX_TOKENS || j.pos < 0 ||
        (int64_t)j.pos + j.n_tok > dims->max_pos) {
        snprintf(why, why_n, "positions [%d, %lld) outside the model's [0, %lld)", j.pos,
                 (long long)j.pos + j.n_tok, (long long)dims->max_pos);
        return DI_ERR_FORMAT;
    }
    // Rank 0 starts from the front's state at pos (a prefix) unless pos is 0; later ranks start
    // empty and take their predecessor's layer messages.
    const bool prefix = j.flags & DI_CP_JOB_PREFIX;
    if (prefix != (j.rank == 0 && j.pos > 0) || ((j.flags & DI_CP_JOB_PENDING) && !prefix)) {
        snprintf(why, why_n, "rank %d at position %d with%s a prefix state", j.rank, j.pos,
                 prefix ? "" : "out");
        return DI_ERR_FORMAT;
    }
    if (j.n_state != dims->n_layers + (mtp ? dims->n_mtp : 0)) {
        snprintf(why, why_n, "%d state layers, the model runs %d", j.n_state,
                 dims->n_layers + (mtp ? dims->n_mtp : 0));
        return DI_ERR_FORMAT;
    }
    const int32_t n_hist = dims->n_hist < j.pos ? dims->n_hist : j.pos;
    if (j.n_hist != n_hist) {
        snprintf(why, why_n, "%d Engram history ids at position %d, the model needs %d", j.n_hist,
                 j.pos, n_hist);
        return DI_ERR_FORMAT;
    }
    const uint64_t head = di_cp_job_head_bytes(j.n_state);
    if (len < head || (len - head) % 4 != 0 ||
        (len - head) / 4 != (uint64_t)j.n_tok + (uint64_t)j.n_hist) {
        snprintf(why, why_n, "job of %llu bytes for %d state layers, %d tokens and %d history ids",
                 (unsigned long long)len, j.n_state, j.n_tok, j.n_hist);
        return DI_ERR_FORMAT;
    }
    const int64_t *from = (const int64_t *)(p + 32);
    for (int32_t il = 0; il < j.n_state; il++)
        for (int k = 0; k < 2; k++) {
            int64_t f = rd_i64(p + 32 + 16 * (uint64_t)il + 8 * (uint64_t)k);
            int64_t lim = k < dims->n_cmp[il] ? dims->max_pos / dims->ratio[il] : 0;
            if (dims->v41) lim = k == 0 && dims->src[il] ? dims->max_pos / dims->ratio[il] : 0;
            if (f < 0 || f > lim) {
                snprintf(why, why_n,
                         "layer %d compressor %d: the successor holds %lld entries "
                         "(at most %lld)",
                         il, k, (long long)f, (long long)lim);
                return DI_ERR_FORMAT;
            }
        }
    const int32_t *tokens = (const int32_t *)(p + head);
    for (int32_t t = 0; t < j.n_tok; t++) {
        int32_t id = rd_i32(p + head + 4 * (uint64_t)t);
        if (id < 0 || id >= dims->n_vocab) {
            snprintf(why, why_n, "token %d at index %d is outside the vocabulary [0, %d)", id, t,
                     dims->n_vocab);
            return DI_ERR_FORMAT;
        }
    }
    const int32_t *hist = (const int32_t *)(p + head + 4 * (uint64_t)j.n_tok);
    for (int32_t i = 0; i < j.n_hist; i++) {
        int32_t id = rd_i32(p + head + 4 * ((uint64_t)j.n_tok + (uint64_t)i));
        if (id < 0 || id >= dims->n_hist_ids) {
            snprintf(why, why_n, "Engram history id %d at index %d is outside [0, %d)", id, i,
                     dims->n_hist_ids);
            return DI_ERR_FORMAT;
        }
    }
    j.from = from;
    j.tokens = tokens;
    j.hist = j.n_hist ? hist : NULL;
    *out = j;
    return DI_OK;
}

// ---- layer ----

uint64_t di_cp_layer_head_bytes(int32_t n_cmp) {
    return 16 + 16 * (uint64_t)n_cmp;
}

di_status di_cp_decode_layer(const void *payload, uint64_t len, const di_cp_dims *dims,
                             di_cp_layer *out, char *why, size_t why_n) {
    const uint8_t *p = payload;
    if (len < 16) {
        snprintf(why, why_n, "layer message of %llu bytes is shorter than its 16-byte header",
                 (unsigned long long)len);
        return DI_ERR_FORMAT;
    }
    di_cp_layer l = {.il = rd_i32(p), .pos = rd_i64(p + 8)};
    const int32_t n_cmp = rd_i32(p + 4);
    const int32_t n_state = dims->n_layers + (dims->has_mtp ? 1 : 0);
    if (l.il < 0 || l.il >= n_state) {
        snprintf(why, why_n, "state layer %d is outside [0, %d)", l.il, n_state);
        return DI_ERR_FORMAT;
    }
    if (n_cmp != dims->n_cmp[l.il]) {
        snprintf(why, why_n, "layer %d: %d compressors, the model's has %d", l.il, n_cmp,
                 dims->n_cmp[l.il]);
        return DI_ERR_FORMAT;
    }
    if (l.pos < 0 || l.pos > dims->max_pos) {
        snprintf(why, why_n, "layer %d: position %lld outside [0, %lld]", l.il, (long long)l.pos,
                 (long long)dims->max_pos);
        return DI_ERR_FORMAT;
    }
    const uint64_t head = di_cp_layer_head_bytes(n_cmp);
    if (len < head) {
        snprintf(why, why_n, "layer %d: truncated header", l.il);
        return DI_ERR_FORMAT;
    }
    // Sizes in floats, each bounded by the model's shapes and max_pos (no overflow in 64 bits).
    uint64_t need = (uint64_t)dims->ring_floats;
    for (int32_t k = 0; k < n_cmp; k++) {
        di_cp_cmp *c = &l.cmp[k];
        c->from = rd_i64(p + 16 + 16 * (uint64_t)k);
        c->n = rd_i64(p + 24 + 16 * (uint64_t)k);
        if (c->n != l.pos / dims->ratio[l.il] || c->from < 0 || c->from > c->n) {
            snprintf(why, why_n,
                     "layer %d compressor %d: entries [%lld, %lld) at position %lld (ratio %d)",
                     l.il, k, (long long)c->from, (long long)c->n, (long long)l.pos,
                     dims->ratio[l.il]);
            return DI_ERR_FORMAT;
        }
        need += 2 * (uint64_t)dims->cmp_ring_floats[l.il][k] +
                (uint64_t)(c->n - c->from) * (uint64_t)dims->cmp_d[l.il][k];
    }
    if ((len - head) % 4 != 0 || (len - head) / 4 != need) {
        snprintf(why, why_n, "layer %d: %llu bytes of state, the message needs %llu", l.il,
                 (unsigned long long)(len - head), (unsigned long long)need * 4);
        return DI_ERR_FORMAT;
    }
    const float *f = (const float *)(p + head);
    l.ring = f;
    f += dims->ring_floats;
    for (int32_t k = 0; k < n_cmp; k++) {
        di_cp_cmp *c = &l.cmp[k];
        c->buf_c = f;
        f += dims->cmp_ring_floats[l.il][k];
        c->buf_z = f;
        f += dims->cmp_ring_floats[l.il][k];
        c->entries = f;
        f += (c->n - c->from) * dims->cmp_d[l.il][k];
    }
    *out = l;
    return DI_OK;
}

// ---- V4.1 layer ----

uint64_t di_cp_layer41_bytes(const di_cp_dims *dims, int32_t il, int64_t e) {
    uint64_t n = DI_CP_LAYER41_HEAD + (uint64_t)dims->ring_bytes;
    if (il < dims->n_layers && dims->src[il]) {
        if (dims->ratio[il] == 2) n += 4 * (uint64_t)dims->cz_floats;
        n += (uint64_t)e * (uint64_t)(dims->ent_bytes + dims->key_bytes);
    }
    return n;
}

di_status di_cp_decode_layer41(const void *payload, uint64_t len, const di_cp_dims *dims,
                               di_cp_layer41 *out, char *why, size_t why_n) {
    const uint8_t *p = payload;
    if (!dims->v41) {
        snprintf(why, why_n, "a V4.1 state layer for a DeepSeek V4 model");
        return DI_ERR_FORMAT;
    }
    if (len < DI_CP_LAYER41_HEAD) {
        snprintf(why, why_n, "layer message of %llu bytes is shorter than its %d-byte header",
                 (unsigned long long)len, DI_CP_LAYER41_HEAD);
        return DI_ERR_FORMAT;
    }
    di_cp_layer41 l = {
        .il = rd_i32(p), .pos = rd_i64(p + 8), .from = rd_i64(p + 16), .n = rd_i64(p + 24)};
    const int32_t is_src = rd_i32(p + 4);
    const int32_t n_state = dims->n_layers + dims->n_mtp;
    if (l.il < 0 || l.il >= n_state) {
        snprintf(why, why_n, "state layer %d is outside [0, %d)", l.il, n_state);
        return DI_ERR_FORMAT;
    }
    const bool src = l.il < dims->n_layers && dims->src[l.il];
    if (is_src != (src ? 1 : 0)) {
        snprintf(why, why_n, "layer %d: kv source flag %d, the model's is %d", l.il, is_src,
                 src ? 1 : 0);
        return DI_ERR_FORMAT;
    }
    if (l.pos < 0 || l.pos > dims->max_pos) {
        snprintf(why, why_n, "layer %d: position %lld outside [0, %lld]", l.il, (long long)l.pos,
                 (long long)dims->max_pos);
        return DI_ERR_FORMAT;
    }
    const int64_t n = src ? l.pos / dims->ratio[l.il] : 0;
    if (l.n != n || l.from < 0 || l.from > l.n) {
        snprintf(why, why_n, "layer %d: entries [%lld, %lld) at position %lld (%lld due)", l.il,
                 (long long)l.from, (long long)l.n, (long long)l.pos, (long long)n);
        return DI_ERR_FORMAT;
    }
    // Every term is bounded by the model's shapes and max_pos: no overflow in 64 bits.
    const uint64_t need = di_cp_layer41_bytes(dims, l.il, l.n - l.from);
    if (len != need) {
        snprintf(why, why_n, "layer %d: %llu bytes, the message needs %llu", l.il,
                 (unsigned long long)len, (unsigned long long)need);
        return DI_ERR_FORMAT;
    }
    const uint8_t *q = p + DI_CP_LAYER41_HEAD;
    if (src && dims->ratio[l.il] == 2) {
        l.cz = (const float *)q;
        q += 4 * dims->cz_floats;
    }
    l.ring = q;
    q += dims->ring_bytes;
    l.ent = q;
    q += (l.n - l.from) * dims->ent_bytes;
    l.keys = q;
    *out = l;
    return DI_OK;
}

// ---- main-stream row ----

di_status di_cp_decode_xrow(const void *payload, uint64_t len, const di_cp_dims *dims, int32_t *pos,
                            const float **row, char *why, size_t why_n) {
    const uint8_t *p = payload;
    if (len != 8 + 4 * (uint64_t)dims->row_floats) {
        snprintf(why, why_n, "main-stream row of %llu bytes, the model's is %llu",
                 (unsigned long long)len, (unsigned long long)(8 + 4 * dims->row_floats));
        return DI_ERR_FORMAT;
    }
    const int32_t ps = rd_i32(p);
    if (ps < 0 || ps >= dims->max_pos || rd_i32(p + 4) != 0) {
        snprintf(why, why_n, "main-stream row of position %d (or a nonzero reserved word)", ps);
        return DI_ERR_FORMAT;
    }
    *pos = ps;
    *row = (const float *)(p + 8);
    return DI_OK;
}

// ---- framing ----

di_status di_cp_send_hdr(int fd, uint16_t type, uint64_t len) {
    di_cp_hdr h = {.magic = DI_CP_MAGIC, .version = DI_CP_VERSION, .type = type, .len = len};
    return di_sock_send_all(fd, &h, sizeof h);
}

di_status di_cp_send_frame(int fd, uint16_t type, const void *payload, uint64_t len) {
    di_status st = di_cp_send_hdr(fd, type, len);
    if (st == DI_OK && len) st = di_sock_send_all(fd, payload, (size_t)len);
    return st;
}

di_status di_cp_recv_hdr(int fd, di_cp_hdr *h, char *why, size_t why_n) {
    if (di_sock_recv_all(fd, h, sizeof *h) != DI_OK) {
        snprintf(why, why_n, "connection closed or timed out");
        return DI_ERR_IO;
    }
    return di_cp_hdr_check(h, why, why_n);
}
