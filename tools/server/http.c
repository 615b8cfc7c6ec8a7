// http — glue over libmicrohttpd, shared by `deepinfer serve` and `deepinfer route`
// (srv_http_listen takes the request handler): one thread per connection (handlers may block while
// a request generates), request bodies collected up to the size limit, JSON and SSE responses,
// client disconnect detection. Header size is bounded by MHD's per-connection memory limit (over
// it: 431), idle connections time out after the configured timeout.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "server/server.h"

struct srv_http {
    struct MHD_Daemon *d;
    srv_http_opts o;
};

typedef struct conn_ctx {
    sb body;
    size_t limit; // the body's size limit (the URL's)
    bool too_large;
} conn_ctx;

bool srv_client_gone(struct MHD_Connection *c) {
    const union MHD_ConnectionInfo *ci =
        MHD_get_connection_info(c, MHD_CONNECTION_INFO_CONNECTION_FD);
    if (!ci) return false;
    struct pollfd p = {.fd = ci->connect_fd, .events = POLLRDHUP};
    if (poll(&p, 1, 0) <= 0) return false;
    return (p.revents & (POLLRDHUP | POLLHUP | POLLERR | POLLNVAL)) != 0;
}

static enum MHD_Result queue(struct MHD_Connection *c, int status, struct MHD_Response *r,
                             const char *ctype, int retry_after_s) {
    if (!r) return MHD_NO;
    MHD_add_response_header(r, MHD_HTTP_HEADER_CONTENT_TYPE, ctype);
    if (retry_after_s > 0) {
        char v[16];
        snprintf(v, sizeof v, "%d", retry_after_s);
        MHD_add_response_header(r, "Retry-After", v);
    }
    enum MHD_Result ret = MHD_queue_response(c, (unsigned)status, r);
    MHD_destroy_response(r);
    return ret;
}

enum MHD_Result srv_send_text(struct MHD_Connection *c, int status, const char *ctype,
                              const char *text) {
    struct MHD_Response *r =
        MHD_create_response_from_buffer(strlen(text), (void *)text, MHD_RESPMEM_MUST_COPY);
    return queue(c, status, r, ctype, 0);
}

enum MHD_Result srv_send_json(struct MHD_Connection *c, int status, json_t *body,
                              int retry_after_s) {
    char *s = body ? json_dumps(body, JSON_COMPACT) : NULL;
    json_decref(body);
    if (!s) return MHD_NO;
    struct MHD_Response *r = MHD_create_response_from_buffer(strlen(s), s, MHD_RESPMEM_MUST_FREE);
    if (!r) free(s);
    return queue(c, status, r, "application/json", retry_after_s);
}

enum MHD_Result srv_send_error(struct MHD_Connection *c, srv_api api, const srv_err *e) {
    return srv_send_json(c, e->status, srv_err_body(api, e), e->retry_after_s);
}

bool srv_secret_equal(const char *given, const char *key) {
    if (!given || !key) return false;
    const size_t n = strlen(given), k = strlen(key);
    // Every byte of given is compared (with key's, cycled; an empty key against a NUL), so the
    // loop's length is the client's and no early exit tells how much of key it matched.
    volatile unsigned char diff = (unsigned char)(n != k);
    for (size_t i = 0; i < n; i++)
        diff |= (unsigned char)given[i] ^ (unsigned char)(k ? key[i % k] : 0);
    return diff == 0;
}

bool srv_authorized(struct MHD_Connection *c, const char *key, bool x_api_key_ok) {
    if (!key) return true;
    const char *a = MHD_lookup_connection_value(c, MHD_HEADER_KIND, "Authorization");
    if (a && !strncmp(a, "Bearer ", 7)) return srv_secret_equal(a + 7, key); // Bearer wins
    const char *x = MHD_lookup_connection_value(c, MHD_HEADER_KIND, "x-api-key");
    return x_api_key_ok && srv_secret_equal(x, key);
}

// ---- generation responses ----

typedef struct stream_ctx {
    srv_gen *g;
    srv *s;
} stream_ctx;

static ssize_t sse_reader(void *cls, uint64_t pos, char *buf, size_t max) {
    (void)pos;
    stream_ctx *x = cls;
    srv_gen *g = x->g;
    for (;;) {
        if (g->out_off < g->out.n) {
            size_t k = g->out.n - g->out_off;
            if (k > max) k = max;
            memcpy(buf, g->out.p + g->out_off, k);
            g->out_off += k;
            if (g->out_off == g->out.n) g->out_off = g->out.n = 0;
            g->t_last_out = srv_now();
            return (ssize_t)k;
        }
        if (g->out_done) return MHD_CONTENT_READER_END_OF_STREAM;
        if (srv_client_gone(g->conn)) {
            g->client_gone = true;
            return MHD_CONTENT_READER_END_WITH_ERROR;
        }
        srv_gen_pump(g, 100);
        if (g->out.n == 0 && !g->out_done && srv_now() - g->t_last_out > x->s->cfg.keepalive_s)
            sb_adds(&g->out, g->ops->keepalive); // SSE comment / ping while nothing is produced
    }
}

static void sse_free(void *cls) {
    stream_ctx *x = cls;
    srv *s = x->s;
    srv_gen_destroy(x->g); // cancels unfinished choices (client gone) and waits for the engine
    free(x);
    atomic_fetch_sub(&s->inflight, 1);
}

enum MHD_Result srv_run_generation(srv *s, struct MHD_Connection *c, srv_gen *g) {
    g->conn = c;
    if (g->stream) {
        stream_ctx *x = malloc(sizeof *x);
        if (!x) {
            srv_gen_destroy(g);
            atomic_fetch_sub(&s->inflight, 1);
            return MHD_NO;
        }
        x->g = g;
        x->s = s;
        if (g->ops->stream_begin) g->ops->stream_begin(g);
        struct MHD_Response *r =
            MHD_create_response_from_callback(MHD_SIZE_UNKNOWN, 16384, sse_reader, x, sse_free);
        if (!r) {
            sse_free(x);
            return MHD_NO;
        }
        MHD_add_response_header(r, "Cache-Control", "no-cache");
        MHD_add_response_header(r, "X-Accel-Buffering", "no");
        srv_metrics_status(s, 200);
        return queue(c, 200, r, "text/event-stream", 0);
    }
    bool gone = false;
    while (!srv_gen_pump(g, 100)) {
        if (!gone && srv_client_gone(c)) {
            gone = true;
            g->client_gone = true;
            for (int i = 0; i < g->n; i++)
                if (!g->ch[i].ended) di_engine_cancel(s->engine, g->ch[i].eid);
        }
    }
    enum MHD_Result ret;
    if (g->failed) {
        srv_err e;
        srv_err_set(&e, 500, NULL, "%s", srv_gen_fail_message(g));
        srv_metrics_status(s, 500);
        ret = srv_send_error(c, g->api, &e);
    } else {
        srv_metrics_status(s, 200);
        ret = srv_send_json(c, 200, g->ops->body(g), 0);
    }
    srv_gen_destroy(g);
    atomic_fetch_sub(&s->inflight, 1);
    return ret;
}

// ---- MHD callbacks ----

static enum MHD_Result on_access(void *cls, struct MHD_Connection *c, const char *url,
                                 const char *method, const char *version, const char *upload,
                                 size_t *upload_size, void **con_cls) {
    (void)version;
    srv_http *h = cls;
    conn_ctx *x = *con_cls;
    if (!x) {
        x = calloc(1, sizeof *x);
        if (!x) return MHD_NO;
        *con_cls = x;
        x->limit = h->o.bulk_path && !strcmp(url, h->o.bulk_path) ? h->o.max_bulk_bytes
                                                                  : h->o.max_body_bytes;
        const char *cl = MHD_lookup_connection_value(c, MHD_HEADER_KIND, "Content-Length");
        if (cl && strtoull(cl, NULL, 10) > x->limit) x->too_large = true;
        return MHD_YES;
    }
    if (*upload_size) {
        if (!x->too_large && x->body.n + *upload_size > x->limit) {
            x->too_large = true;
            sb_free(&x->body);
        }
        if (!x->too_large) sb_add(&x->body, upload, *upload_size);
        *upload_size = 0;
        return MHD_YES;
    }
    return h->o.handler(h->o.cls, c, url, method, x->body.p ? x->body.p : "", x->body.n,
                        x->too_large);
}

static void on_completed(void *cls, struct MHD_Connection *c, void **con_cls,
                         enum MHD_RequestTerminationCode toe) {
    (void)cls;
    (void)c;
    (void)toe;
    conn_ctx *x = *con_cls;
    if (!x) return;
    sb_free(&x->body);
    free(x);
    *con_cls = NULL;
}

bool srv_http_listen(const srv_http_opts *o, srv_http **out) {
    srv_http *h = calloc(1, sizeof *h);
    if (!h) return false;
    h->o = *o;
    struct sockaddr_in addr = {0};
    addr.sin_family = AF_INET;
    addr.sin_port = htons((uint16_t)o->port);
    if (inet_pton(AF_INET, o->host, &addr.sin_addr) != 1) {
        fprintf(stderr, "ERROR %s: --host must be an IPv4 address, got '%s'\n", o->who, o->host);
        free(h);
        return false;
    }
    h->d = MHD_start_daemon(MHD_USE_THREAD_PER_CONNECTION | MHD_USE_INTERNAL_POLLING_THREAD |
                                MHD_USE_POLL | MHD_USE_ITC | MHD_USE_ERROR_LOG,
                            0, NULL, NULL, on_access, h, MHD_OPTION_SOCK_ADDR,
                            (struct sockaddr *)&addr, MHD_OPTION_NOTIFY_COMPLETED, on_completed, h,
                            MHD_OPTION_CONNECTION_TIMEOUT, (unsigned)o->timeout_s,
                            MHD_OPTION_CONNECTION_LIMIT, (unsigned)o->max_connections,
                            MHD_OPTION_CONNECTION_MEMORY_LIMIT, (size_t)(64 * 1024),
                            MHD_OPTION_LISTEN_BACKLOG_SIZE, (unsigned)256, MHD_OPTION_END);
    if (!h->d) {
        fprintf(stderr, "ERROR %s: cannot listen on %s:%d\n", o->who, o->host, o->port);
        free(h);
        return false;
    }
    *out = h;
    return true;
}

static enum MHD_Result serve_route(void *cls, struct MHD_Connection *c, const char *url,
                                   const char *method, const char *body, size_t n_body,
                                   bool too_large) {
    return srv_route(cls, c, url, method, body, n_body, too_large);
}

bool srv_http_start(srv *s, srv_http **out) {
    const srv_http_opts o = {.who = "serve",
                             .host = s->cfg.http.host,
                             .port = s->cfg.http.port,
                             .max_body_bytes = s->cfg.http.max_body_bytes,
                             .bulk_path = s->cfg.kv_transfer ? "/internal/kv" : NULL,
                             .max_bulk_bytes = s->cfg.max_kv_transfer_bytes,
                             .timeout_s = s->cfg.http.timeout_s,
                             .max_connections = s->cfg.max_inflight + 64,
                             .handler = serve_route,
                             .cls = s};
    return srv_http_listen(&o, out);
}

static void sleep_ms(int ms) {
    struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
    nanosleep(&ts, NULL);
}

void srv_http_drain(srv_http *h, atomic_int *inflight, int drain_s) {
    MHD_quiesce_daemon(h->d); // stop accepting; open connections continue
    for (int t = 0; t < drain_s * 10 && atomic_load(inflight) > 0; t++) sleep_ms(100);
}

static volatile sig_atomic_t g_stop;

static void on_signal(int sig) {
    (void)sig;
    g_stop = 1;
}

void srv_http_on_signals(void) {
    struct sigaction sa = {0};
    sa.sa_handler = on_signal;
    sigaction(SIGTERM, &sa, NULL);
    sigaction(SIGINT, &sa, NULL);
    signal(SIGPIPE, SIG_IGN);
}

void srv_http_wait_signal(void) {
    while (!g_stop) sleep_ms(100);
}

void srv_http_stop(srv_http *h) {
    if (!h) return;
    MHD_stop_daemon(h->d);
    free(h);
}
