// worker — an expert worker serving fronts over TCP (ep/worker.h).
#include "ep/worker.h"

#include <pthread.h>
#include <stdio.h>
#include <string.h>

#include "base/log.h"
#include "base/mem.h"
#include "base/sock.h" // di_sock_server: the accept thread and a thread per front
#include "ep/ep.h"
#include "ep/wire.h"
#include "model/dsv4.h"

// Returns a failing status to the caller.
#define RET_IF(expr)                                                                               \
    do {                                                                                           \
        di_status s_ = (expr);                                                                     \
        if (s_ != DI_OK) return s_;                                                                \
    } while (0)

// Rows one expert call computes at a time: bounds the scratch of a connection whatever the
// request (results are per row, so the chunking does not change them).
#define WORKER_CHUNK 256
// Groups of one request: a front sends at most one per replica of each expert.
#define WORKER_MAX_GROUPS 65536

typedef struct conn { // one front's connection (the server's thread runs serve)
    struct di_ep_worker *w;
    int fd;
    const char *peer;
} conn;

struct di_ep_worker {
    di_model *m;
    di_sock_server *srv; // owned: the accept thread and a thread per front
    pthread_mutex_t cmu; // computation (the model's pool)
    uint64_t id;
    char desc[512];
};

static di_status reply_error(int fd, const char *peer, const char *why) {
    DI_LOG_WARN("ep worker: %s: %s", peer, why);
    return di_ep_send_frame(fd, DI_EP_ERROR, why, strlen(why));
}

// Computes one validated request, one RESULT frame per group in order.
static di_status compute(conn *cn, di_dsv4_ctx *c, const di_ep_compute *rq) {
    di_model *m = cn->w->m;
    const di_dsv4_layer_w *lw = di_dsv4_layer(m, rq->layer);
    const int64_t D = rq->D;
    float *y = di_dsv4_scratch(c, DI_SCR_MOE_OUT);
    for (int32_t g = 0; g < rq->n_groups; g++) {
        const di_ep_group *gr = &rq->groups[g];
        di_ep_hdr h = {.magic = DI_EP_MAGIC,
                       .version = DI_EP_VERSION,
                       .type = DI_EP_RESULT,
                       .len = 8 + (uint64_t)gr->n * (uint64_t)D * sizeof(float)};
        int32_t eg[2] = {gr->expert, gr->n};
        RET_IF(di_sock_send_all(cn->fd, &h, sizeof h));
        RET_IF(di_sock_send_all(cn->fd, eg, sizeof eg));
        for (int32_t r0 = 0; r0 < gr->n; r0 += WORKER_CHUNK) {
            const int32_t n = gr->n - r0 < WORKER_CHUNK ? gr->n - r0 : WORKER_CHUNK;
            pthread_mutex_lock(&cn->w->cmu);
            di_dsv4_expert(c, &lw->w1[gr->expert], &lw->w3[gr->expert], &lw->w2[gr->expert],
                           gr->x + r0 * D, n, m->hp.swiglu_limit, gr->w + r0, y);
            pthread_mutex_unlock(&cn->w->cmu);
            RET_IF(di_sock_send_all(cn->fd, y, sizeof(float) * (size_t)(n * D)));
        }
    }
    return DI_OK;
}

static void serve(void *user, int fd, const char *peer) {
    conn conn_ = {.w = user, .fd = fd, .peer = peer}, *cn = &conn_;
    di_ep_worker *w = cn->w;
    di_model *m = w->m;
    const int32_t NL = di_ep_moe_layers(m), E = m->hp.n_expert, D = m->hp.n_embd;
    bool hello = false;
    uint8_t *assigned = di_calloc((size_t)NL * (size_t)E, 1);
    di_ep_group *groups = di_malloc(sizeof(di_ep_group) * WORKER_MAX_GROUPS);
    di_dsv4_ws ws = {0};
    di_dsv4_ctx c = {.model = m, .ws = &ws};
    void *payload = NULL;
    char why[DI_EP_MAX_TEXT];
    int64_t n_req = 0, n_rows = 0;
    if (!assigned || !groups || di_dsv4_ws_reserve(&ws, m, WORKER_CHUNK, 0, false) != DI_OK) {
        reply_error(cn->fd, cn->peer, "worker out of memory");
        goto out;
    }
    for (;;) {
        di_ep_hdr h;
        di_status st = di_ep_recv_hdr(cn->fd, &h, why, sizeof why);
        if (st == DI_ERR_IO) break; // the front closed, or stop
        if (st != DI_OK) {          // unframed bytes: answer, then drop (no way to resync)
            reply_error(cn->fd, cn->peer, why);
            break;
        }
        if (h.type == DI_EP_OK || h.type == DI_EP_ERROR || h.type == DI_EP_RESULT) {
            snprintf(why, sizeof why, "frame type %u is not a request", (unsigned)h.type);
            reply_error(cn->fd, cn->peer, why);
            break;
        }
        di_free(payload);
        payload = NULL;
        if (h.len && !(payload = di_malloc((size_t)h.len))) {
            reply_error(cn->fd, cn->peer, "worker out of memory for the request");
            break;
        }
        if (h.len && di_sock_recv_all(cn->fd, payload, (size_t)h.len) != DI_OK) {
            DI_LOG_WARN("ep worker: %s: truncated frame (%llu bytes announced)", cn->peer,
                        (unsigned long long)h.len);
            break;
        }
        if (h.type == DI_EP_HELLO) {
            uint64_t id = 0;
            if (h.len >= 8) memcpy(&id, payload, 8);
            if (h.len < 8 || id != w->id) {
                int dl = h.len > 8 ? (int)(h.len - 8) : 0;
                snprintf(why, sizeof why,
                         "model mismatch: the front runs %.*s; this worker runs %s", dl,
                         h.len > 8 ? (const char *)payload + 8 : "(no description)", w->desc);
                if (reply_error(cn->fd, cn->peer, why) != DI_OK) break;
                continue;
            }
            hello = true;
            if (di_ep_send_frame(cn->fd, DI_EP_OK, NULL, 0) != DI_OK) break;
            continue;
        }
        if (!hello) {
            if (reply_error(cn->fd, cn->peer, "a request before the model handshake") != DI_OK)
                break;
            continue;
        }
        if (h.type == DI_EP_ASSIGN) {
            const int32_t *pairs;
            int32_t n;
            if (di_ep_decode_assign(payload, h.len, NL, E, &pairs, &n, why, sizeof why) != DI_OK) {
                if (reply_error(cn->fd, cn->peer, why) != DI_OK) break;
                continue;
            }
            memset(assigned, 0, (size_t)NL * (size_t)E);
            for (int32_t i = 0; i < n; i++) {
                int32_t pr[2];
                memcpy(pr, pairs + 2 * i, sizeof pr);
                assigned[(int64_t)pr[0] * E + pr[1]] = 1;
            }
            DI_LOG_INFO("ep worker: %s: assigned %d (layer, expert) replicas", cn->peer, n);
            if (di_ep_send_frame(cn->fd, DI_EP_OK, NULL, 0) != DI_OK) break;
            continue;
        }
        // DI_EP_COMPUTE
        di_ep_compute rq = {.groups = groups};
        if (di_ep_decode_compute(payload, h.len, NL, E, D, &rq, WORKER_MAX_GROUPS, why,
                                 sizeof why) != DI_OK) {
            if (reply_error(cn->fd, cn->peer, why) != DI_OK) break;
            continue;
        }
        const di_dsv4_layer_w *lw = di_dsv4_layer(m, rq.layer);
        int32_t bad = -1;
        for (int32_t g = 0; g < rq.n_groups && bad < 0; g++)
            if (!assigned[(int64_t)rq.layer * E + groups[g].expert] ||
                groups[g].expert >= lw->n_expert)
                bad = g;
        if (bad >= 0) {
            snprintf(why, sizeof why, "layer %d expert %d is not assigned to this worker", rq.layer,
                     groups[bad].expert);
            if (reply_error(cn->fd, cn->peer, why) != DI_OK) break;
            continue;
        }
        if (compute(cn, &c, &rq) != DI_OK) {
            DI_LOG_WARN("ep worker: %s: sending results failed", cn->peer);
            break;
        }
        n_req++;
        n_rows += rq.n_rows;
    }
out:
    DI_LOG_INFO("ep worker: %s disconnected after %lld requests (%lld rows)", cn->peer,
                (long long)n_req, (long long)n_rows);
    di_free(payload);
    di_free(assigned);
    di_free(groups);
    di_dsv4_ws_free(&ws);
}

di_status di_ep_worker_start(di_model *m, const char *host, int port, di_ep_worker **out) {
    *out = NULL;
    di_ep_worker *w = di_calloc(1, sizeof *w);
    if (!w) return DI_ERR_NOMEM;
    w->m = m;
    w->id = di_dsv4_model_id(m);
    di_ep_model_describe(m, w->desc, sizeof w->desc);
    pthread_mutex_init(&w->cmu, NULL);
    di_status st =
        di_sock_server_start("ep worker", host, port, DI_EP_IO_TIMEOUT_MS, serve, w, &w->srv);
    if (st != DI_OK) {
        pthread_mutex_destroy(&w->cmu);
        di_free(w);
        return st;
    }
    DI_LOG_INFO("ep worker: serving %s on port %d", w->desc, di_sock_server_port(w->srv));
    *out = w;
    return DI_OK;
}

int di_ep_worker_port(const di_ep_worker *w) {
    return di_sock_server_port(w->srv);
}

void di_ep_worker_stop(di_ep_worker *w) {
    if (!w) return;
    di_sock_server_stop(w->srv); // shuts the fronts' connections down and joins their threads
    pthread_mutex_destroy(&w->cmu);
    di_free(w);
}
