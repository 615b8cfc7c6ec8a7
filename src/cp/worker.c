// worker — a context-parallel prefill worker serving fronts over TCP (cp/worker.h).
#include "cp/worker.h"

#include <pthread.h>
#include <stdio.h>
#include <string.h>

#include "base/log.h"
#include "base/mem.h"
#include "base/sock.h" // di_sock_server: the accept thread and a thread per front
#include "cp/cp.h"
#include "cp/wire.h"
#include "ep/ep.h" // di_ep_model_describe
#include "model/dsv4.h"
#include "model/dsv41.h" // di_dsv41_forward_cp: V4.1 jobs

typedef struct conn { // one front's connection (the server's thread runs serve)
    struct di_cp_worker *w;
    int fd;
    const char *peer;
    // The session of the last job (owned): reset and reused by the next job that fits (same MTP
    // setting, context), so its buffers and scratch are not allocated again for every prefill.
    di_session *s;
} conn;

struct di_cp_worker {
    di_model *m;
    di_sock_server *srv; // owned: the accept thread and a thread per front
    pthread_mutex_t cmu; // computation (the model's pool)
    uint64_t id;
    char desc[512];
    di_cp_dims dims;
};

static void reply_error(int fd, const char *peer, const char *why) {
    DI_LOG_WARN("cp worker: %s: %s", peer, why);
    (void)di_cp_send_frame(fd, DI_CP_ERROR, why, strlen(why));
}

// ---- one job ----

typedef struct job_run {
    conn *cn;
    const di_cp_job *j;
    di_session *s;
    di_cp_buf rx;
    int64_t bytes;
} job_run;

// Receives state layer il (at position pos) from the front and installs it into the session.
static di_status recv_layer(job_run *r, int32_t il, int64_t pos) {
    const di_cp_dims *dims = &r->cn->w->dims;
    uint64_t len;
    di_status st =
        di_cp_recv_frame(r->cn->fd, "cp worker", r->cn->peer, DI_CP_LAYER, &r->rx, &len, &r->bytes);
    if (st != DI_OK) return st;
    di_cp_layer l;
    char why[256];
    st = di_cp_decode_layer(r->rx.p, len, dims, &l, why, sizeof why);
    if (st == DI_OK && (l.il != il || l.pos != pos)) {
        snprintf(why, sizeof why,
                 "state of layer %d at position %lld where layer %d at %lld was due", l.il,
                 (long long)l.pos, il, (long long)pos);
        st = DI_ERR_FORMAT;
    }
    if (st == DI_OK) st = di_cp_install_layer(r->cn->w->m, &r->s->layers[il], &l, why, sizeof why);
    if (st != DI_OK) {
        reply_error(r->cn->fd, r->cn->peer, why);
        return DI_ERR_IO;
    }
    return DI_OK;
}

// V4.1: receives state layer il (at position pos) and installs it into the session.
static di_status recv_layer41(job_run *r, int32_t il, int64_t pos) {
    const di_cp_dims *dims = &r->cn->w->dims;
    uint64_t len;
    di_status st = di_cp_recv_frame(r->cn->fd, "cp worker", r->cn->peer, DI_CP_LAYER41, &r->rx,
                                    &len, &r->bytes);
    if (st != DI_OK) return st;
    di_cp_layer41 l;
    char why[256];
    st = di_cp_decode_layer41(r->rx.p, len, dims, &l, why, sizeof why);
    if (st == DI_OK && (l.il != il || l.pos != pos)) {
        snprintf(why, sizeof why,
                 "state of layer %d at position %lld where layer %d at %lld was due", l.il,
                 (long long)l.pos, il, (long long)pos);
        st = DI_ERR_FORMAT;
    }
    if (st == DI_OK) st = di_cp_install_layer41(dims, r->s->v41, &l, why, sizeof why);
    if (st != DI_OK) {
        reply_error(r->cn->fd, r->cn->peer, why);
        return DI_ERR_IO;
    }
    return DI_OK;
}

// Receives the main-stream row of position pos: the MTP block's pending input.
static di_status recv_xrow(job_run *r, int32_t pos) {
    const di_cp_dims *dims = &r->cn->w->dims;
    uint64_t len;
    di_status st =
        di_cp_recv_frame(r->cn->fd, "cp worker", r->cn->peer, DI_CP_XROW, &r->rx, &len, &r->bytes);
    if (st != DI_OK) return st;
    int32_t got;
    const float *row;
    char why[256];
    st = di_cp_decode_xrow(r->rx.p, len, dims, &got, &row, why, sizeof why);
    if (st == DI_OK && got != pos) {
        snprintf(why, sizeof why, "main-stream row of position %d where %d was due", got, pos);
        st = DI_ERR_FORMAT;
    }
    if (st != DI_OK) {
        reply_error(r->cn->fd, r->cn->peer, why);
        return DI_ERR_IO;
    }
    memcpy(r->s->mtp_x + (int64_t)(pos % (DI_DSV4_ROLLBACK_MAX + 1)) * dims->row_floats, row,
           sizeof(float) * (size_t)dims->row_floats);
    r->s->mtp_pending = true;
    return DI_OK;
}

static di_status worker_attn(void *user, di_dsv4_ctx *c, int il, bool after) {
    (void)c;
    job_run *r = user;
    const di_cp_job *j = r->j;
    const bool main_layer = il < r->cn->w->dims.n_layers;
    if (r->s->v41) { // V4.1: every state layer (DSpark blocks included) at the piece's ends
        if (!after) return j->rank == 0 ? DI_OK : recv_layer41(r, il, j->pos);
        di_status st = di_cp_send_layer41(r->cn->fd, r->cn->w->m, &r->cn->w->dims, r->s->v41, il,
                                          (int64_t)j->pos + j->n_tok, j->from[2 * il], &r->bytes);
        if (st != DI_OK) DI_LOG_WARN("cp worker: %s: sending layer %d failed", r->cn->peer, il);
        return st;
    }
    if (!after) { // rank 0 started from the job's state; the others take their predecessor's
        if (j->rank == 0) return DI_OK;
        return recv_layer(r, il, main_layer ? j->pos : j->pos - 1);
    }
    const int64_t end = (int64_t)j->pos + j->n_tok;
    di_status st = di_cp_send_layer(r->cn->fd, r->cn->w->m, &r->s->layers[il], il,
                                    main_layer ? end : end - 1, j->from + 2 * il, &r->bytes);
    if (st != DI_OK) DI_LOG_WARN("cp worker: %s: sending layer %d failed", r->cn->peer, il);
    return st;
}

static di_status worker_mtp_input(void *user, di_session *s, const float *x_last) {
    (void)s;
    job_run *r = user;
    const di_cp_job *j = r->j;
    const int64_t rf = r->cn->w->dims.row_floats;
    int32_t xh[2] = {j->pos + j->n_tok - 1, 0};
    di_status st = di_cp_send_hdr(r->cn->fd, DI_CP_XROW, 8 + 4 * (uint64_t)rf);
    if (st == DI_OK) st = di_sock_send_all(r->cn->fd, xh, sizeof xh);
    if (st == DI_OK) st = di_sock_send_all(r->cn->fd, x_last, sizeof(float) * (size_t)rf);
    r->bytes += (int64_t)(sizeof(di_cp_hdr) + 8 + 4 * rf);
    if (st != DI_OK) return st;
    return j->rank == 0 ? DI_OK : recv_xrow(r, j->pos - 1);
}

// A V4.1 job on session r->s (reset, at the job's position): the Engram history before the piece,
// the prefix state (rank 0 after a prefix), the piece with its layer messages, DONE (logits into
// out, the DONE payload's buffer).
static di_status run_job41(job_run *r, float *out) {
    conn *cn = r->cn;
    const di_cp_job *j = r->j;
    const int64_t V = cn->w->m->hp.n_vocab;
    const bool want_lg = j->flags & DI_CP_JOB_LOGITS;
    di_status st = di_dsv41_reserve(r->s, j->n_tok);
    if (st != DI_OK) {
        reply_error(cn->fd, cn->peer, "worker out of memory for the job's state");
        return st;
    }
    for (int32_t i = 0; i < j->n_hist; i++) r->s->v41->hist[j->pos - j->n_hist + i] = j->hist[i];
    if (j->flags & DI_CP_JOB_PREFIX) // the front's state at pos, layer by layer
        for (int32_t il = 0; il < j->n_state; il++)
            if ((st = recv_layer41(r, il, j->pos)) != DI_OK) return st;
    di_dsv4_cp_hook hook = {.attn = worker_attn, .user = r};
    di_dsv41_seq b = {
        .s = r->s, .tokens = j->tokens, .n_tok = j->n_tok, .n_out = want_lg ? j->n_tok : 0};
    st = di_dsv41_forward_cp(cn->w->m, di_dsv41_ws(r->s), &b, want_lg ? out + 2 : NULL, &hook);
    if (st != DI_OK) return st;
    int32_t counts[2] = {want_lg ? j->n_tok : 0, 0};
    memcpy(out, counts, sizeof counts);
    const uint64_t len = 8 + 4 * (uint64_t)counts[0] * (uint64_t)V;
    st = di_cp_send_frame(cn->fd, DI_CP_DONE, out, len);
    r->bytes += (int64_t)(sizeof(di_cp_hdr) + len);
    return st;
}

// Runs a decoded job to its DONE frame. DI_OK, or a failure after which the connection closes
// (an error was answered where the front can still read it).
static di_status run_job(conn *cn, const di_cp_job *j) {
    di_cp_worker *w = cn->w;
    di_model *m = w->m;
    const int64_t V = m->hp.n_vocab;
    const bool mtp = j->flags & DI_CP_JOB_MTP;
    const bool want_lg = j->flags & DI_CP_JOB_LOGITS, want_ml = j->flags & DI_CP_JOB_MTP_LOGITS;
    job_run r = {.cn = cn, .j = j};
    float *out = NULL; // [2 + rows V]: the DONE payload (two int32 counts, then the rows)
    di_status st = DI_OK;
    pthread_mutex_lock(&w->cmu);
    const int64_t rows = (want_lg ? j->n_tok : 0) + (want_ml ? j->n_tok : 0);
    if (cn->s && (cn->s->mtp != mtp || cn->s->n_ctx_max < j->pos + j->n_tok)) {
        di_session_destroy(cn->s);
        cn->s = NULL;
    }
    if (cn->s) {
        // Positions below pos are never read unless installed (rank 0 at 0 reads no ring row and
        // no overlap before its first window), so the last job's rows may stay.
        di_session_reset(cn->s);
    } else {
        di_session_options so = di_session_options_default();
        so.n_ctx_max = j->pos + j->n_tok;
        so.mtp = mtp;
        st = di_session_create(m, &so, &cn->s);
    }
    r.s = cn->s;
    if (st != DI_OK || !(out = di_malloc(sizeof(float) * (size_t)(2 + rows * V)))) {
        reply_error(cn->fd, cn->peer, "worker out of memory for the job");
        st = DI_ERR_NOMEM;
        goto out;
    }
    r.s->pos = j->pos;
    if (r.s->v41) { // V4.1: its own job (run_job41)
        st = run_job41(&r, out);
        goto out;
    }
    if ((st = di_dsv4_session_reserve(r.s, j->n_tok)) != DI_OK) {
        reply_error(cn->fd, cn->peer, "worker out of memory for the job's state");
        goto out;
    }
    if (j->flags & DI_CP_JOB_PREFIX) { // the front's state at pos, layer by layer
        const bool pending = j->flags & DI_CP_JOB_PENDING;
        for (int32_t il = 0; il < j->n_state && st == DI_OK; il++)
            st = recv_layer(&r, il, il < w->dims.n_layers || !pending ? j->pos : j->pos - 1);
        if (st == DI_OK && pending) st = recv_xrow(&r, j->pos - 1);
        if (st != DI_OK) goto out;
    }
    di_dsv4_cp_hook hook = {.attn = worker_attn, .mtp_input = worker_mtp_input, .user = &r};
    int32_t n_mtp = 0;
    float *lg = out + 2, *ml = lg + (want_lg ? j->n_tok * V : 0);
    di_forward_out fo = {
        .logits = want_lg ? lg : NULL, .mtp_logits = want_ml ? ml : NULL, .n_mtp_out = &n_mtp};
    st = di_dsv4_session_forward(r.s, j->tokens, j->n_tok, &fo, &hook);
    if (st != DI_OK) goto out;
    int32_t counts[2] = {want_lg ? j->n_tok : 0, want_ml ? n_mtp : 0};
    memcpy(out, counts, sizeof counts);
    // The MTP rows follow the main ones directly (ml = lg + counts[0] V).
    const uint64_t len = 8 + 4 * (uint64_t)(counts[0] + counts[1]) * (uint64_t)V;
    st = di_cp_send_frame(cn->fd, DI_CP_DONE, out, len);
    r.bytes += (int64_t)(sizeof(di_cp_hdr) + len);
out:
    pthread_mutex_unlock(&w->cmu);
    DI_LOG_INFO("cp worker: %s: rank %d of %d, positions [%d, %d): %s, %lld bytes exchanged",
                cn->peer, j->rank, j->n_ranks, j->pos, j->pos + j->n_tok,
                st == DI_OK ? "done" : di_status_str(st), (long long)r.bytes);
    if (st != DI_OK) { // a failed job's session goes (the connection closes after it)
        di_session_destroy(cn->s);
        cn->s = NULL;
    }
    di_cp_buf_free(&r.rx);
    di_free(out);
    return st;
}

// ---- connections ----

static void serve(void *user, int fd, const char *peer) {
    conn conn_ = {.w = user, .fd = fd, .peer = peer}, *cn = &conn_;
    di_cp_worker *w = cn->w;
    bool hello = false;
    di_cp_buf payload = {0};
    char why[DI_CP_MAX_TEXT];
    int64_t n_jobs = 0;
    for (;;) {
        di_cp_hdr h;
        di_status st = di_cp_recv_hdr(cn->fd, &h, why, sizeof why);
        if (st == DI_ERR_IO) break; // the front closed, or stop
        if (st != DI_OK) {          // unframed bytes: answer, then drop (no way to resync)
            reply_error(cn->fd, cn->peer, why);
            break;
        }
        if (h.type != DI_CP_HELLO && h.type != DI_CP_JOB) {
            snprintf(why, sizeof why, "frame type %u where a request was due", (unsigned)h.type);
            reply_error(cn->fd, cn->peer, why);
            break;
        }
        di_cp_buf_free(&payload);
        if (!(payload.p = di_aligned_alloc(h.len ? (size_t)h.len : 64))) {
            reply_error(cn->fd, cn->peer, "worker out of memory for the request");
            break;
        }
        payload.cap = (size_t)h.len;
        if (h.len && di_sock_recv_all(cn->fd, payload.p, (size_t)h.len) != DI_OK) {
            DI_LOG_WARN("cp worker: %s: truncated frame (%llu bytes announced)", cn->peer,
                        (unsigned long long)h.len);
            break;
        }
        if (h.type == DI_CP_HELLO) {
            uint64_t id = 0;
            if (h.len >= 8) memcpy(&id, payload.p, 8);
            if (h.len < 8 || id != w->id) {
                int dl = h.len > 8 ? (int)(h.len - 8) : 0;
                snprintf(why, sizeof why,
                         "model mismatch: the front runs %.*s; this worker runs %s", dl,
                         h.len > 8 ? (const char *)payload.p + 8 : "(no description)", w->desc);
                reply_error(cn->fd, cn->peer, why);
                continue;
            }
            hello = true;
            if (di_cp_send_frame(cn->fd, DI_CP_OK, NULL, 0) != DI_OK) break;
            continue;
        }
        if (!hello) { // the state frames that may follow cannot be told apart: drop
            reply_error(cn->fd, cn->peer, "a job before the model handshake");
            break;
        }
        di_cp_job j;
        if (di_cp_decode_job(payload.p, h.len, &w->dims, &j, why, sizeof why) != DI_OK) {
            reply_error(cn->fd, cn->peer, why);
            break;
        }
        if (run_job(cn, &j) != DI_OK) break;
        n_jobs++;
    }
    DI_LOG_INFO("cp worker: %s disconnected after %lld jobs", cn->peer, (long long)n_jobs);
    di_cp_buf_free(&payload);
    di_session_destroy(cn->s);
    cn->s = NULL;
}

di_status di_cp_worker_start(di_model *m, const char *host, int port, di_cp_worker **out) {
    *out = NULL;
    if (m->opt.device.kind != DI_DEVICE_CPU || m->dev) {
        DI_LOG_ERROR("cp worker: context parallelism needs the CPU forward (no --device)");
        return DI_ERR_UNSUPPORTED;
    }
    di_cp_worker *w = di_calloc(1, sizeof *w);
    if (!w) return DI_ERR_NOMEM;
    w->m = m;
    w->id = di_dsv4_model_id(m);
    di_ep_model_describe(m, w->desc, sizeof w->desc);
    di_cp_dims_init(m, &w->dims);
    pthread_mutex_init(&w->cmu, NULL);
    di_status st =
        di_sock_server_start("cp worker", host, port, DI_CP_IO_TIMEOUT_MS, serve, w, &w->srv);
    if (st != DI_OK) {
        pthread_mutex_destroy(&w->cmu);
        di_free(w);
        return st;
    }
    DI_LOG_INFO("cp worker: serving %s on port %d", w->desc, di_sock_server_port(w->srv));
    *out = w;
    return DI_OK;
}

int di_cp_worker_port(const di_cp_worker *w) {
    return di_sock_server_port(w->srv);
}

void di_cp_worker_stop(di_cp_worker *w) {
    if (!w) return;
    di_sock_server_stop(w->srv); // shuts the fronts' connections down and joins their threads
    pthread_mutex_destroy(&w->cmu);
    di_free(w);
}
