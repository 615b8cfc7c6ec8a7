// ep — the front side of expert parallelism (ep/ep.h).
#include "ep/ep.h"

#include <pthread.h>
#include <stdio.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "base/buf.h"
#include "base/log.h"
#include "base/mem.h"
#include "ep/wire.h"
#include "model/dsv4.h"

// Returns a failing status to the caller.
#define RET_IF(expr)                                                                               \
    do {                                                                                           \
        di_status s_ = (expr);                                                                     \
        if (s_ != DI_OK) return s_;                                                                \
    } while (0)

typedef struct ep_conn {
    char addr[128], host[128];
    int port;
    int fd;            // -1: not connected
    bool need_assign;  // the worker has not got the current placement's assignment
    di_buf req;        // this call's request (header, then groups)
    int32_t n_groups;  // groups in req
    int32_t n_pending; // results not read yet
    di_ep_worker_stats st;
} ep_conn;

struct di_ep {
    di_model *m; // borrowed
    int32_t n_workers;
    ep_conn *w;                  // [n_workers]
    di_ep_placement p;           // current placement
    int32_t *rep_off, *rep_rank; // CSR over (layer, expert): ranks in slot order
    bool *layer_remote;          // [n_layers]: a replica of the layer on a worker
    float *scratch;              // di_ep_scratch
    int64_t scratch_n;
    int32_t layer, D;    // the call in progress
    pthread_mutex_t mu;  // held by a MoE call and placement changes
    pthread_mutex_t smu; // counters
    uint64_t id;
    char desc[512];
};

static int64_t now_us(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000 + ts.tv_nsec / 1000;
}

int32_t di_ep_moe_layers(const di_model *m) {
    return m->hp.n_layer + m->n_mtp_loaded;
}

// Rebuilds the replica index of placement p into ep (replacing the old one).
static di_status index_placement(di_ep *ep, const di_ep_placement *p) {
    const int64_t LE = (int64_t)p->n_layers * p->n_expert, LS = (int64_t)p->n_layers * p->n_slots;
    int32_t *off = di_calloc((size_t)LE + 1, sizeof(int32_t));
    int32_t *rk = di_malloc(sizeof(int32_t) * (size_t)LS);
    bool *lr = di_calloc((size_t)p->n_layers, sizeof(bool));
    if (!off || !rk || !lr) {
        di_free(off), di_free(rk), di_free(lr);
        return DI_ERR_NOMEM;
    }
    for (int64_t i = 0; i < LS; i++) off[(i / p->n_slots) * p->n_expert + p->expert[i] + 1]++;
    for (int64_t i = 0; i < LE; i++) off[i + 1] += off[i];
    int32_t *fill = di_calloc((size_t)LE, sizeof(int32_t));
    if (!fill) {
        di_free(off), di_free(rk), di_free(lr);
        return DI_ERR_NOMEM;
    }
    for (int64_t i = 0; i < LS; i++) {
        const int64_t l = i / p->n_slots, k = l * p->n_expert + p->expert[i];
        rk[off[k] + fill[k]++] = p->rank[i];
        if (p->rank[i] != 0) lr[l] = true;
    }
    di_free(fill);
    di_free(ep->rep_off), di_free(ep->rep_rank), di_free(ep->layer_remote);
    ep->rep_off = off, ep->rep_rank = rk, ep->layer_remote = lr;
    return DI_OK;
}

static void conn_close(ep_conn *c) {
    if (c->fd >= 0) close(c->fd);
    c->fd = -1;
    c->n_pending = 0;
}

static void count_error(di_ep *ep, ep_conn *c) {
    pthread_mutex_lock(&ep->smu);
    c->st.errors++;
    pthread_mutex_unlock(&ep->smu);
}

// Reads a reply that must be OK; an ERROR's text is logged. DI_ERR_INVALID when refused.
static di_status expect_ok(di_ep *ep, ep_conn *c, const char *what) {
    di_ep_hdr h;
    char why[DI_EP_MAX_TEXT + 1];
    di_status st = di_ep_recv_hdr(c->fd, &h, why, sizeof why);
    if (st == DI_OK && h.type == DI_EP_ERROR) {
        st = di_sock_recv_all(c->fd, why, (size_t)h.len);
        why[st == DI_OK ? h.len : 0] = 0;
        DI_LOG_ERROR("ep: worker %s refused the %s: %s", c->addr, what, why);
        return DI_ERR_INVALID;
    }
    if (st == DI_OK && (h.type != DI_EP_OK || h.len != 0)) {
        snprintf(why, sizeof why, "unexpected frame type %u", (unsigned)h.type);
        st = DI_ERR_FORMAT;
    }
    if (st != DI_OK) DI_LOG_ERROR("ep: worker %s: %s reply: %s", c->addr, what, why);
    (void)ep;
    return st == DI_OK ? DI_OK : DI_ERR_IO;
}

static di_status send_assign(di_ep *ep, ep_conn *c, int32_t rank) {
    const di_ep_placement *p = &ep->p;
    di_buf b;
    di_buf_init(&b);
    int32_t hdr[3] = {p->n_layers, p->n_expert, 0};
    di_status st = di_buf_append(&b, hdr, sizeof hdr);
    for (int64_t i = 0; st == DI_OK && i < (int64_t)p->n_layers * p->n_slots; i++) {
        if (p->rank[i] != rank) continue;
        int32_t pair[2] = {(int32_t)(i / p->n_slots), p->expert[i]};
        st = di_buf_append(&b, pair, sizeof pair);
        hdr[2]++;
    }
    if (st == DI_OK) {
        memcpy(b.data, hdr, sizeof hdr);
        st = di_ep_send_frame(c->fd, DI_EP_ASSIGN, b.data, b.len);
        if (st != DI_OK) DI_LOG_ERROR("ep: worker %s: sending the assignment failed", c->addr);
    }
    di_buf_deinit(&b);
    if (st == DI_OK) st = expect_ok(ep, c, "assignment");
    if (st == DI_OK) c->need_assign = false;
    return st;
}

// Connects worker i (rank i + 1) if needed: handshake, then the assignment if it changed. The
// connect and the replies wait at most timeout_ms; the connection then keeps the I/O timeout of
// calls (DI_EP_IO_TIMEOUT_MS).
static di_status ensure(di_ep *ep, int32_t i, int timeout_ms) {
    ep_conn *c = &ep->w[i];
    di_status st = DI_OK;
    if (c->fd < 0) {
        c->fd = di_sock_connect("ep", c->host, c->port, timeout_ms);
        if (c->fd < 0) {
            DI_LOG_ERROR("ep: worker %s (rank %d) is unreachable", c->addr, i + 1);
            count_error(ep, c);
            return DI_ERR_IO;
        }
        uint8_t hello[8 + sizeof ep->desc];
        size_t dl = strlen(ep->desc);
        memcpy(hello, &ep->id, 8);
        memcpy(hello + 8, ep->desc, dl);
        st = di_ep_send_frame(c->fd, DI_EP_HELLO, hello, 8 + dl);
        if (st != DI_OK) DI_LOG_ERROR("ep: worker %s: sending the handshake failed", c->addr);
        if (st == DI_OK) st = expect_ok(ep, c, "model");
        c->need_assign = true;
        pthread_mutex_lock(&ep->smu);
        c->st.connects++;
        pthread_mutex_unlock(&ep->smu);
        if (st == DI_OK) DI_LOG_INFO("ep: connected to worker %s (rank %d)", c->addr, i + 1);
    }
    if (st == DI_OK && c->need_assign) st = send_assign(ep, c, i + 1);
    if (st == DI_OK && timeout_ms != DI_EP_IO_TIMEOUT_MS) di_sock_tune(c->fd, DI_EP_IO_TIMEOUT_MS);
    if (st != DI_OK) {
        conn_close(c);
        count_error(ep, c);
    }
    return st;
}

static void describe(const di_model *m, char *buf, size_t n, uint64_t id) {
    const di_hparams *hp = &m->hp;
    snprintf(buf, n,
             "%s: %d layers (+%d MTP loaded), hidden %d, %d experts (top-%d), %s precision, "
             "weights %016llx, identity %016llx",
             hp->v41 ? "DeepSeek V4.1" : "DeepSeek V4", hp->n_layer, m->n_mtp_loaded, hp->n_embd,
             hp->n_expert, hp->n_expert_used,
             m->opt.precision == DI_PRECISION_OFFICIAL ? "official" : "fp32",
             (unsigned long long)m->weights_id, (unsigned long long)id);
}

void di_ep_model_describe(const di_model *m, char *buf, size_t n) {
    describe(m, buf, n, di_dsv4_model_id(m));
}

static di_status check_shape(const di_ep *ep, const di_model *m, const di_ep_placement *p) {
    char why[256];
    di_status st = di_ep_placement_check(p, why, sizeof why);
    if (st != DI_OK) {
        DI_LOG_ERROR("ep: invalid placement: %s", why);
        return st;
    }
    const int32_t nl = di_ep_moe_layers(m);
    for (int64_t l = 0; l < p->n_layers; l++)
        for (int32_t e = 0; e < p->n_expert; e++) {
            int32_t r = 0;
            for (int32_t s = 0; s < p->n_slots; s++) r += p->expert[l * p->n_slots + s] == e;
            if (r > DI_EP_MAX_REPLICAS) {
                DI_LOG_ERROR("ep: layer %lld expert %d has %d replicas (at most %d)", (long long)l,
                             e, r, DI_EP_MAX_REPLICAS);
                return DI_ERR_INVALID;
            }
        }
    if (p->n_layers != nl || p->n_expert != m->hp.n_expert || p->n_ranks != ep->n_workers + 1) {
        DI_LOG_ERROR("ep: placement of %d layers x %d experts over %d ranks; the model has %d MoE "
                     "layers x %d experts and %d workers (+ the front)",
                     p->n_layers, p->n_expert, p->n_ranks, nl, m->hp.n_expert, ep->n_workers);
        return DI_ERR_INVALID;
    }
    return DI_OK;
}

di_status di_ep_attach(di_model *m, const char *const *workers, int32_t n_workers,
                       const di_ep_placement *p, di_ep **out) {
    *out = NULL;
    if (n_workers < 1) {
        DI_LOG_ERROR("ep: no expert workers given");
        return DI_ERR_INVALID;
    }
    if (m->accel_matmul || m->dev) {
        DI_LOG_ERROR("ep: expert workers need the CPU forward; this model runs on a device (the "
                     "device-resident forward has its own MoE)");
        return DI_ERR_INVALID;
    }
    di_ep *ep = di_calloc(1, sizeof *ep);
    if (!ep) return DI_ERR_NOMEM;
    ep->m = m;
    ep->n_workers = n_workers;
    pthread_mutex_init(&ep->mu, NULL);
    pthread_mutex_init(&ep->smu, NULL);
    ep->id = di_dsv4_model_id(m);
    describe(m, ep->desc, sizeof ep->desc, ep->id);
    di_status st = DI_OK;
    ep->w = di_calloc((size_t)n_workers, sizeof(ep_conn));
    if (!ep->w) {
        di_free(ep);
        return DI_ERR_NOMEM;
    }
    for (int32_t i = 0; i < n_workers; i++) {
        ep_conn *c = &ep->w[i];
        c->fd = -1;
        di_buf_init(&c->req);
        snprintf(c->addr, sizeof c->addr, "%s", workers[i]);
        snprintf(c->st.addr, sizeof c->st.addr, "%s", workers[i]);
        if (!di_sock_split_addr(workers[i], c->host, sizeof c->host, &c->port) || !c->host[0] ||
            c->port == 0) {
            DI_LOG_ERROR("ep: worker address '%s' is not HOST:PORT", workers[i]);
            st = DI_ERR_INVALID;
        }
    }
    if (st == DI_OK) {
        if (p)
            st = di_ep_placement_copy(p, &ep->p);
        else
            st = di_ep_placement_contiguous(di_ep_moe_layers(m), m->hp.n_expert, n_workers + 1,
                                            &ep->p);
    }
    if (st == DI_OK) st = check_shape(ep, m, &ep->p);
    if (st == DI_OK) st = index_placement(ep, &ep->p);
    for (int32_t i = 0; st == DI_OK && i < n_workers; i++) st = ensure(ep, i, DI_EP_IO_TIMEOUT_MS);
    if (st != DI_OK) {
        di_ep_detach(ep);
        return st;
    }
    m->ep = ep;
    DI_LOG_INFO("ep: %d expert workers attached (%d ranks with the front)", n_workers,
                n_workers + 1);
    *out = ep;
    return DI_OK;
}

void di_ep_detach(di_ep *ep) {
    if (!ep) return;
    if (ep->m->ep == ep) ep->m->ep = NULL;
    for (int32_t i = 0; ep->w && i < ep->n_workers; i++) {
        conn_close(&ep->w[i]);
        di_buf_deinit(&ep->w[i].req);
    }
    di_free(ep->w);
    di_ep_placement_free(&ep->p);
    di_free(ep->rep_off), di_free(ep->rep_rank), di_free(ep->layer_remote);
    di_free(ep->scratch);
    pthread_mutex_destroy(&ep->mu);
    pthread_mutex_destroy(&ep->smu);
    di_free(ep);
}

di_status di_ep_set_placement(di_ep *ep, const di_ep_placement *p) {
    pthread_mutex_lock(&ep->mu);
    di_ep_placement np;
    di_status st = check_shape(ep, ep->m, p);
    if (st == DI_OK) st = di_ep_placement_copy(p, &np);
    if (st == DI_OK) {
        st = index_placement(ep, &np);
        if (st == DI_OK) {
            di_ep_placement_free(&ep->p);
            ep->p = np;
            for (int32_t i = 0; i < ep->n_workers; i++) ep->w[i].need_assign = true;
        } else {
            di_ep_placement_free(&np);
        }
    }
    pthread_mutex_unlock(&ep->mu);
    return st;
}

di_status di_ep_get_placement(di_ep *ep, di_ep_placement *out) {
    pthread_mutex_lock(&ep->mu);
    const di_status st = di_ep_placement_copy(&ep->p, out);
    pthread_mutex_unlock(&ep->mu);
    return st;
}

di_status di_ep_probe(di_ep *ep, int timeout_ms) {
    if (pthread_mutex_trylock(&ep->mu) != 0) return DI_ERR_BUSY;
    di_status st = DI_OK;
    for (int32_t i = 0; st == DI_OK && i < ep->n_workers; i++)
        if (ep->w[i].fd < 0 || ep->w[i].need_assign) st = ensure(ep, i, timeout_ms);
    pthread_mutex_unlock(&ep->mu);
    return st == DI_OK ? DI_OK : DI_ERR_IO;
}

int32_t di_ep_n_workers(const di_ep *ep) {
    return ep->n_workers;
}

void di_ep_get_stats(di_ep *ep, int32_t i, di_ep_worker_stats *out) {
    pthread_mutex_lock(&ep->smu);
    *out = ep->w[i].st;
    pthread_mutex_unlock(&ep->smu);
}

void di_ep_begin(di_ep *ep, int32_t layer, int32_t n_expert, bool *remote) {
    pthread_mutex_lock(&ep->mu);
    ep->layer = layer;
    ep->D = ep->m->hp.n_embd;
    // A layer whose expert count differs from the placement's (V4.1 DSpark blocks) stays local.
    *remote = layer < ep->p.n_layers && n_expert == ep->p.n_expert && ep->layer_remote[layer];
    for (int32_t i = 0; i < ep->n_workers; i++) {
        ep_conn *c = &ep->w[i];
        di_buf_clear(&c->req);
        c->n_groups = 0;
        c->n_pending = 0;
    }
}

bool di_ep_remote(const di_ep *ep, int32_t e) {
    const int64_t k = (int64_t)ep->layer * ep->p.n_expert + e;
    for (int32_t i = ep->rep_off[k]; i < ep->rep_off[k + 1]; i++)
        if (ep->rep_rank[i] != 0) return true;
    return false;
}

int32_t di_ep_chunks(const di_ep *ep, int32_t e, int32_t n, di_ep_chunk *out) {
    const int64_t k = (int64_t)ep->layer * ep->p.n_expert + e;
    const int32_t r0 = ep->rep_off[k], R = ep->rep_off[k + 1] - r0;
    int32_t nc = 0;
    for (int32_t i = 0; i < R; i++) {
        const int32_t lo = (int32_t)((int64_t)n * i / R), hi = (int32_t)((int64_t)n * (i + 1) / R);
        if (hi > lo)
            out[nc++] = (di_ep_chunk){.rank = ep->rep_rank[r0 + i], .off = lo, .n = hi - lo};
    }
    return nc;
}

di_status di_ep_add(di_ep *ep, int32_t rank, int32_t e, const float *x, const float *w, int32_t n) {
    ep_conn *c = &ep->w[rank - 1];
    if (c->req.len == 0) {
        int32_t hdr[4] = {ep->layer, ep->D, 0, 0};
        RET_IF(di_buf_append(&c->req, hdr, sizeof hdr));
    }
    int32_t g[2] = {e, n};
    RET_IF(di_buf_append(&c->req, g, sizeof g));
    RET_IF(di_buf_append(&c->req, x, sizeof(float) * (size_t)n * (size_t)ep->D));
    RET_IF(di_buf_append(&c->req, w, sizeof(float) * (size_t)n));
    c->n_groups++;
    pthread_mutex_lock(&ep->smu);
    c->st.rows += n;
    pthread_mutex_unlock(&ep->smu);
    return DI_OK;
}

di_status di_ep_send(di_ep *ep) {
    for (int32_t i = 0; i < ep->n_workers; i++) {
        ep_conn *c = &ep->w[i];
        if (c->n_groups == 0) continue;
        if (ensure(ep, i, DI_EP_IO_TIMEOUT_MS) != DI_OK)
            return DI_ERR_IO; // unreachable or refused (logged)
        memcpy((uint8_t *)c->req.data + 8, &c->n_groups, sizeof(int32_t));
        if (di_ep_send_frame(c->fd, DI_EP_COMPUTE, c->req.data, c->req.len) != DI_OK) {
            DI_LOG_ERROR("ep: worker %s: sending layer %d's request failed (down or timed out)",
                         c->addr, ep->layer);
            conn_close(c);
            count_error(ep, c);
            return DI_ERR_IO;
        }
        c->n_pending = c->n_groups;
        pthread_mutex_lock(&ep->smu);
        c->st.calls++;
        c->st.bytes_sent += (int64_t)(c->req.len + sizeof(di_ep_hdr));
        pthread_mutex_unlock(&ep->smu);
    }
    return DI_OK;
}

di_status di_ep_recv(di_ep *ep, int32_t rank, int32_t e, int32_t n, float *y) {
    ep_conn *c = &ep->w[rank - 1];
    const int64_t t0 = now_us();
    char why[DI_EP_MAX_TEXT + 1] = "";
    di_ep_hdr h;
    int32_t got[2] = {-1, -1};
    const uint64_t want = 8 + (uint64_t)n * (uint64_t)ep->D * sizeof(float);
    di_status st = c->n_pending > 0 ? di_ep_recv_hdr(c->fd, &h, why, sizeof why) : DI_ERR_IO;
    if (st == DI_OK && h.type == DI_EP_ERROR) {
        if (di_sock_recv_all(c->fd, why, (size_t)h.len) == DI_OK)
            why[h.len] = 0;
        else
            snprintf(why, sizeof why, "(its message was cut)");
        DI_LOG_ERROR("ep: worker %s answered an error for layer %d: %s", c->addr, ep->layer, why);
        st = DI_ERR_IO;
    } else if (st == DI_OK) {
        if (h.type != DI_EP_RESULT || h.len != want ||
            di_sock_recv_all(c->fd, got, sizeof got) != DI_OK || got[0] != e || got[1] != n ||
            di_sock_recv_all(c->fd, y, (size_t)(want - 8)) != DI_OK) {
            DI_LOG_ERROR("ep: worker %s: bad or missing result for layer %d expert %d (%d rows)",
                         c->addr, ep->layer, e, n);
            st = DI_ERR_IO;
        }
    } else {
        DI_LOG_ERROR("ep: worker %s: no result for layer %d expert %d: %s", c->addr, ep->layer, e,
                     why[0] ? why : "not connected");
        st = DI_ERR_IO;
    }
    pthread_mutex_lock(&ep->smu);
    c->st.wait_us += now_us() - t0;
    if (st == DI_OK) c->st.bytes_recv += (int64_t)(want + sizeof h);
    pthread_mutex_unlock(&ep->smu);
    if (st != DI_OK) {
        conn_close(c);
        count_error(ep, c);
        return st;
    }
    c->n_pending--;
    return DI_OK;
}

float *di_ep_scratch(di_ep *ep, int64_t n) {
    if (n > ep->scratch_n) {
        float *p = di_realloc(ep->scratch, sizeof(float) * (size_t)n);
        if (!p) return NULL;
        ep->scratch = p;
        ep->scratch_n = n;
    }
    return ep->scratch;
}

void di_ep_end(di_ep *ep, di_status st) {
    if (st != DI_OK)
        for (int32_t i = 0; i < ep->n_workers; i++)
            if (ep->w[i].n_pending > 0) conn_close(&ep->w[i]);
    pthread_mutex_unlock(&ep->mu);
}

int32_t di_model_ep_stats(const di_model *m, di_ep_worker_stats *out, int32_t cap) {
    di_ep *ep = m->ep;
    if (!ep) return 0;
    for (int32_t i = 0; i < ep->n_workers && i < cap; i++) di_ep_get_stats(ep, i, &out[i]);
    return ep->n_workers;
}
