// proxy — the router's endpoints: /health, /ready, /metrics answered here; generation endpoints
// and /v1/models forwarded to a replica chosen by the policy (policy.h) over libcurl. A transfer
// runs on the client's connection thread through a curl multi handle of its own, so the thread
// can both wait for upstream bytes and notice the client leaving. Failover: one retry on another
// replica while nothing was sent to the client (docs/router.md, "Failover").
#include <curl/curl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "router/router.h"

// ---- endpoints ----

// K_COUNT: token counting (Anthropic count_tokens, Responses input_tokens), routed like a
// generation (its key's replica) but never prefilled.
typedef enum kind { K_GEN, K_COUNT, K_MODELS, K_HEALTH, K_READY, K_METRICS } kind;

static const struct route {
    const char *path;
    const char *method;
    kind k;
} k_routes[] = {
    {"/v1/chat/completions", "POST", K_GEN},
    {"/chat/completions", "POST", K_GEN},
    {"/v1/completions", "POST", K_GEN},
    {"/completions", "POST", K_GEN},
    {"/beta/chat/completions", "POST", K_GEN},
    {"/beta/completions", "POST", K_GEN},
    {"/v1/responses", "POST", K_GEN},
    {"/responses", "POST", K_GEN},
    {"/v1/messages", "POST", K_GEN},
    {"/anthropic/v1/messages", "POST", K_GEN},
    {"/anthropic/messages", "POST", K_GEN},
    {"/v1/messages/count_tokens", "POST", K_COUNT},
    {"/anthropic/v1/messages/count_tokens", "POST", K_COUNT},
    {"/anthropic/messages/count_tokens", "POST", K_COUNT},
    {"/v1/responses/input_tokens", "POST", K_COUNT},
    {"/responses/input_tokens", "POST", K_COUNT},
    {"/v1/models", "GET", K_MODELS},
    {"/models", "GET", K_MODELS},
    {"/health", "GET", K_HEALTH},
    {"/ready", "GET", K_READY},
    {"/metrics", "GET", K_METRICS},
};

void rt_count_status(rt *r, int status) {
    pthread_mutex_lock(&r->mu);
    int k = status / 100;
    if (k >= 1 && k <= 5) r->n_status[k]++;
    pthread_mutex_unlock(&r->mu);
}

static enum MHD_Result fail(rt *r, struct MHD_Connection *c, srv_api api, const srv_err *e) {
    rt_count_status(r, e->status);
    return srv_send_error(c, api, e);
}

// The server's rule (srv_authorized): a Bearer token, or x-api-key on Anthropic paths.
static bool authorized(const rt *r, struct MHD_Connection *c, srv_api api) {
    return srv_authorized(c, r->cfg.http.api_key, api == SRV_API_MESSAGES);
}

// ---- upstream transfer ----

typedef struct call {
    rt *r;                       // borrowed
    struct MHD_Connection *conn; // borrowed, for the disconnect check
    rt_replica *p;               // borrowed: the upstream (a serving or a prefill replica)
    int replica;                 // its index in its set
    CURLM *m;
    CURL *e;
    struct curl_slist *hdrs;
    char *url; // owned
    bool streaming_path;
    // response
    long status;
    bool headers_done, done, client_gone;
    CURLcode res;
    char ctype[128], retry_after[32];
    sb in; // body bytes received and not yet passed on
    size_t in_off;
} call;

static size_t on_header(char *p, size_t size, size_t n, void *user) {
    call *x = user;
    size_t len = size * n;
    if (len >= 5 && !strncmp(p, "HTTP/", 5)) { // a status line: a new response (after a 100)
        const char *sp = memchr(p, ' ', len);
        x->status = sp ? strtol(sp + 1, NULL, 10) : 0;
        x->ctype[0] = x->retry_after[0] = 0;
    } else if (len <= 2 && (p[0] == '\r' || p[0] == '\n')) {
        if (x->status >= 200) x->headers_done = true;
    } else {
        const char *colon = memchr(p, ':', len);
        if (colon) {
            size_t kn = (size_t)(colon - p);
            const char *v = colon + 1;
            while (v < p + len && (*v == ' ' || *v == '\t')) v++;
            size_t vn = (size_t)(p + len - v);
            while (vn && (v[vn - 1] == '\r' || v[vn - 1] == '\n' || v[vn - 1] == ' ')) vn--;
            char *dst = kn == 12 && !strncasecmp(p, "content-type", 12)  ? x->ctype
                        : kn == 11 && !strncasecmp(p, "retry-after", 11) ? x->retry_after
                                                                         : NULL;
            size_t cap = dst == x->ctype ? sizeof x->ctype : sizeof x->retry_after;
            if (dst && vn < cap) {
                memcpy(dst, v, vn);
                dst[vn] = 0;
            }
        }
    }
    return len;
}

static size_t on_body(char *p, size_t size, size_t n, void *user) {
    call *x = user;
    sb_add(&x->in, p, size * n);
    return size * n;
}

// Advances the transfer, waiting up to wait_ms for upstream activity.
static void pump(call *x, int wait_ms) {
    if (x->done) return;
    int running = 0;
    curl_multi_poll(x->m, NULL, 0, wait_ms, NULL);
    curl_multi_perform(x->m, &running);
    CURLMsg *msg;
    int q;
    while ((msg = curl_multi_info_read(x->m, &q)))
        if (msg->msg == CURLMSG_DONE) {
            x->done = true;
            x->res = msg->data.result;
        }
}

// Releases a call. A transfer that completed cleanly returns its handles to the replica's pool
// (its connection stays open for the next request); any other is closed, which is what tells the
// replica that the request was abandoned.
static void call_free(call *x) {
    if (!x) return;
    if (x->m && x->e) curl_multi_remove_handle(x->m, x->e);
    bool keep = x->m && x->e && x->done && x->res == CURLE_OK;
    if (keep) {
        rt_replica *p = x->p;
        pthread_mutex_lock(&x->r->mu);
        if (p->n_pool < RT_POOL) {
            p->pool_m[p->n_pool] = x->m;
            p->pool_e[p->n_pool] = x->e;
            p->n_pool++;
            x->m = NULL;
            x->e = NULL;
        }
        pthread_mutex_unlock(&x->r->mu);
    }
    if (x->e) curl_easy_cleanup(x->e);
    if (x->m) curl_multi_cleanup(x->m); // closes the upstream socket: the replica cancels
    curl_slist_free_all(x->hdrs);
    free(x->url);
    sb_free(&x->in);
    free(x);
}

void rt_pool_free(rt *r) {
    for (int i = 0; i < r->n_rep + r->n_pre; i++) {
        rt_replica *p = i < r->n_rep ? &r->rep[i] : &r->pre[i - r->n_rep];
        for (int k = 0; k < p->n_pool; k++) {
            curl_easy_cleanup(p->pool_e[k]);
            curl_multi_cleanup(p->pool_m[k]);
        }
        p->n_pool = 0;
    }
}

static void header_from_client(call *x, struct MHD_Connection *c, const char *name) {
    const char *v = MHD_lookup_connection_value(c, MHD_HEADER_KIND, name);
    if (!v) return;
    char line[1024];
    snprintf(line, sizeof line, "%s: %s", name, v);
    x->hdrs = curl_slist_append(x->hdrs, line);
}

// Starts a transfer to p (index replica of its set): method on path with the body; ctype: the
// Content-Type to send (NULL: the client's, or JSON).
static call *call_start(rt *r, rt_replica *p, int replica, struct MHD_Connection *c,
                        const char *path, const char *method, const char *body, size_t n_body,
                        const char *ctype) {
    call *x = calloc(1, sizeof *x);
    if (!x) return NULL;
    x->r = r;
    x->conn = c;
    x->p = p;
    x->replica = replica;
    size_t nu = strlen(p->url) + strlen(path) + 1;
    x->url = malloc(nu);
    pthread_mutex_lock(&r->mu);
    if (p->n_pool) { // the most recently used: the likeliest to have a live connection
        p->n_pool--;
        x->m = p->pool_m[p->n_pool];
        x->e = p->pool_e[p->n_pool];
    }
    pthread_mutex_unlock(&r->mu);
    if (x->e) {
        curl_easy_reset(x->e); // options only: the multi handle keeps the connection
    } else {
        x->m = curl_multi_init();
        x->e = curl_easy_init();
    }
    if (!x->url || !x->m || !x->e) goto fail;
    snprintf(x->url, nu, "%s%s", p->url, path);
    x->hdrs = curl_slist_append(x->hdrs, "Expect:"); // no 100-continue round trip
    if (r->cfg.replica_api_key) {
        char a[1024];
        snprintf(a, sizeof a, "Authorization: Bearer %s", r->cfg.replica_api_key);
        x->hdrs = curl_slist_append(x->hdrs, a);
    } else {
        header_from_client(x, c, "Authorization");
        header_from_client(x, c, "x-api-key");
    }
    header_from_client(x, c, "anthropic-version");
    header_from_client(x, c, "anthropic-beta");
    if (!strcmp(method, "POST")) {
        const char *ct = MHD_lookup_connection_value(c, MHD_HEADER_KIND, "Content-Type");
        if (ctype) {
            char line[160];
            snprintf(line, sizeof line, "Content-Type: %s", ctype);
            x->hdrs = curl_slist_append(x->hdrs, line);
        } else if (!ct)
            x->hdrs = curl_slist_append(x->hdrs, "Content-Type: application/json");
        else
            header_from_client(x, c, "Content-Type");
        curl_easy_setopt(x->e, CURLOPT_POST, 1L);
        curl_easy_setopt(x->e, CURLOPT_POSTFIELDS, body);
        curl_easy_setopt(x->e, CURLOPT_POSTFIELDSIZE_LARGE, (curl_off_t)n_body);
    }
    curl_easy_setopt(x->e, CURLOPT_URL, x->url);
    curl_easy_setopt(x->e, CURLOPT_HTTPHEADER, x->hdrs);
    curl_easy_setopt(x->e, CURLOPT_HEADERFUNCTION, on_header);
    curl_easy_setopt(x->e, CURLOPT_HEADERDATA, x);
    curl_easy_setopt(x->e, CURLOPT_WRITEFUNCTION, on_body);
    curl_easy_setopt(x->e, CURLOPT_WRITEDATA, x);
    curl_easy_setopt(x->e, CURLOPT_NOSIGNAL, 1L);
    curl_easy_setopt(x->e, CURLOPT_TCP_NODELAY, 1L);
    curl_easy_setopt(x->e, CURLOPT_CONNECTTIMEOUT_MS, (long)r->cfg.connect_timeout_ms);
    // Idle timeout: no byte for upstream_timeout_s (a non-streaming answer is silent until done).
    curl_easy_setopt(x->e, CURLOPT_LOW_SPEED_LIMIT, 1L);
    curl_easy_setopt(x->e, CURLOPT_LOW_SPEED_TIME, (long)r->cfg.upstream_timeout_s);
    if (curl_multi_add_handle(x->m, x->e) != CURLM_OK) goto fail;
    int running;
    curl_multi_perform(x->m, &running);
    return x;
fail:
    call_free(x);
    return NULL;
}

// Ends a call's accounting on its replica (once per attempt).
static void call_account(call *x, bool failed) {
    rt *r = x->r;
    pthread_mutex_lock(&r->mu);
    x->p->n_inflight--;
    if (failed) x->p->n_errors++;
    pthread_mutex_unlock(&r->mu);
}

// A transport failure that says the replica is not there (as opposed to a slow answer).
static bool replica_unreachable(CURLcode res) {
    return res == CURLE_COULDNT_CONNECT || res == CURLE_COULDNT_RESOLVE_HOST ||
           res == CURLE_GOT_NOTHING || res == CURLE_RECV_ERROR || res == CURLE_SEND_ERROR;
}

// Statuses a second replica may answer better; nothing has reached the client when they are seen.
static bool retryable_status(long st) {
    return st == 429 || st == 502 || st == 503 || st == 504;
}

// ---- streaming pass-through ----

static ssize_t stream_reader(void *cls, uint64_t pos, char *buf, size_t max) {
    (void)pos;
    call *x = cls;
    for (;;) {
        if (x->in_off < x->in.n) {
            size_t k = x->in.n - x->in_off;
            if (k > max) k = max;
            memcpy(buf, x->in.p + x->in_off, k);
            x->in_off += k;
            if (x->in_off == x->in.n) x->in_off = x->in.n = 0;
            return (ssize_t)k;
        }
        if (x->done) // a transfer cut short ends the client's stream with an error too
            return x->res == CURLE_OK ? MHD_CONTENT_READER_END_OF_STREAM
                                      : MHD_CONTENT_READER_END_WITH_ERROR;
        if (srv_client_gone(x->conn)) {
            x->client_gone = true;
            return MHD_CONTENT_READER_END_WITH_ERROR;
        }
        pump(x, 100);
    }
}

static void stream_free(void *cls) {
    call *x = cls;
    rt *r = x->r;
    // Only a transfer the replica cut is its error; one dropped because the client left is not.
    bool failed = x->done && x->res != CURLE_OK;
    if (failed)
        fprintf(stderr, "WARN  route: %s: stream cut: %s\n", x->url, curl_easy_strerror(x->res));
    call_account(x, failed);
    call_free(x); // an unfinished transfer is dropped here: the replica sees the disconnect
    atomic_fetch_sub(&r->inflight, 1);
}

// ---- forwarding one request ----

// Sends a kept upstream answer (status, content type, body) to the client.
static enum MHD_Result relay(rt *r, struct MHD_Connection *c, const call *x) {
    struct MHD_Response *resp =
        MHD_create_response_from_buffer(x->in.n, x->in.p ? x->in.p : "", MHD_RESPMEM_MUST_COPY);
    if (!resp) return MHD_NO;
    MHD_add_response_header(resp, MHD_HTTP_HEADER_CONTENT_TYPE,
                            x->ctype[0] ? x->ctype : "application/json");
    if (x->retry_after[0]) MHD_add_response_header(resp, "Retry-After", x->retry_after);
    char v[16];
    snprintf(v, sizeof v, "%d", x->replica);
    MHD_add_response_header(resp, "X-Deepinfer-Replica", v);
    rt_count_status(r, (int)x->status);
    enum MHD_Result ret = MHD_queue_response(c, (unsigned)x->status, resp);
    MHD_destroy_response(resp);
    return ret;
}

// Picks one of the serving (pre false) or prefill replicas for q on their ring (rt_policy_pick
// with each replica's match of q's prefix chain, unless q is pinned to its user; exclude: the one
// that failed a first try, or -1), takes its in-flight count, records q's chain as sent to it and
// counts the decision; -1 if none is healthy. Locks rt.mu (the admin API may grow the set and
// rebuild its ring).
static int pick_in(rt *r, bool pre, const rt_route *q, int exclude) {
    rt_replica_load loads[RT_MAX_REPLICAS];
    int match[RT_MAX_REPLICAS];
    rt_pick how;
    pthread_mutex_lock(&r->mu);
    rt_replica *set = pre ? r->pre : r->rep;
    const int n = pre ? r->n_pre : r->n_rep;
    const rt_ring *ring = pre ? r->pre_ring : r->ring;
    if (!ring) { // no prefill replica yet
        pthread_mutex_unlock(&r->mu);
        return -1;
    }
    for (int i = 0; i < n; i++) {
        loads[i] = (rt_replica_load){set[i].healthy, set[i].n_inflight, set[i].n_waiting};
        match[i] = q->pinned ? 0 : rt_seen_match(&set[i].seen, q->chain, q->n_chain);
    }
    const int i = rt_policy_pick(ring, q->has_key, q->key, match, loads, n, exclude,
                                 r->cfg.max_imbalance, &how);
    if (i >= 0) {
        rt_replica *p = &set[i];
        p->n_inflight++;
        p->n_requests++;
        rt_seen_add(&p->seen, q->chain, q->n_chain);
        if (how == RT_PICK_MATCH)
            p->n_match++;
        else if (how == RT_PICK_AFFINE)
            p->n_affine++;
        else if (how == RT_PICK_FALLBACK)
            p->n_fallback++;
        else
            p->n_least++;
    }
    pthread_mutex_unlock(&r->mu);
    return i;
}

// Picks a serving replica (exclude: the one that failed a first try, or -1), counting retries
// and refusals.
static int pick(rt *r, const rt_route *q, int exclude) {
    const int i = pick_in(r, false, q, exclude);
    pthread_mutex_lock(&r->mu);
    if (i >= 0 && exclude >= 0) r->n_retries++;
    if (i < 0 && exclude < 0) r->n_no_replica++;
    pthread_mutex_unlock(&r->mu);
    return i;
}

// ---- prefill/decode disaggregation ----

// The prefill replica for a request: the serving replicas' policy on the prefill ring with the
// request's key, so requests sharing a prefix are prefilled where that prefix is cached.
static int pick_prefill(rt *r, const rt_route *q) {
    return pick_in(r, true, q, -1);
}

// Runs x to its end within deadline (seconds, srv_now) or until the client leaves; true if it
// ended cleanly with status 200.
static bool finish_call(call *x, struct MHD_Connection *c, double deadline) {
    while (!x->done && !srv_client_gone(c) && srv_now() < deadline) pump(x, 50);
    return x->done && x->res == CURLE_OK && x->status == 200;
}

// The reason of a failed step for the log: the transport error or the replica's error message.
static const char *call_why(const call *x, char *buf, size_t cap) {
    if (!x->done) return "timed out, or the client left";
    if (x->res != CURLE_OK) return curl_easy_strerror(x->res);
    snprintf(buf, cap, "status %ld: %.*s", x->status, (int)(x->in.n < 300 ? x->in.n : 300),
             x->in.p ? x->in.p : "");
    return buf;
}

// The prefill step (docs/disaggregation.md): a prefill replica (pick_prefill: the key's, unless
// overloaded) computes the request's prompt (POST /internal/prefill?route=<path>, the client's
// body) and answers its KV transfer, which goes to decode replica `decode` (POST /internal/kv). Any
// failure (no prefill replica, transport error, timeout, a refusal) is a fallback: the decode
// replica then computes the prompt itself, which gives the same output. Counted either way.
static void prefill(rt *r, struct MHD_Connection *c, const char *url, const char *body,
                    size_t n_body, const rt_route *q, int decode) {
    const double t0 = srv_now(), deadline = t0 + r->cfg.prefill_timeout_ms / 1000.0;
    char path[320], why[400];
    const char *fail_why = "no prefill replica is ready";
    bool ok = false;
    int64_t blocks = 0;
    size_t bytes = 0;
    double t_pre = 0, t_imp = 0;
    int j = pick_prefill(r, q);
    if (j >= 0) {
        snprintf(path, sizeof path, "/internal/prefill?route=%s", url);
        call *x = call_start(r, &r->pre[j], j, c, path, "POST", body, n_body, NULL);
        bool pre_ok = x && finish_call(x, c, deadline);
        t_pre = srv_now() - t0;
        if (x) call_account(x, !pre_ok);
        if (!x) {
            fail_why = "out of memory";
            pthread_mutex_lock(&r->mu);
            r->pre[j].n_inflight--;
            pthread_mutex_unlock(&r->mu);
        } else if (!pre_ok) {
            fail_why = call_why(x, why, sizeof why);
            if (x->done && replica_unreachable(x->res)) {
                pthread_mutex_lock(&r->mu);
                bool was = r->pre[j].healthy;
                r->pre[j].healthy = false; // until a poll finds it ready
                if (was) rt_seen_clear(&r->pre[j].seen);
                if (r->pre[j].n_fails_in_a_row < r->cfg.health_fails)
                    r->pre[j].n_fails_in_a_row = r->cfg.health_fails;
                pthread_mutex_unlock(&r->mu);
                if (was)
                    fprintf(stderr,
                            "WARN  route: prefill replica %d (%s) out of rotation: "
                            "unreachable\n",
                            j, r->pre[j].url);
            }
        }
        if (pre_ok) {
            bytes = x->in.n;
            pthread_mutex_lock(&r->mu);
            r->rep[decode].n_inflight++; // the import is an upstream call on it
            pthread_mutex_unlock(&r->mu);
            call *y = call_start(r, &r->rep[decode], decode, c, "/internal/kv", "POST", x->in.p,
                                 x->in.n, "application/octet-stream");
            ok = y && finish_call(y, c, deadline);
            t_imp = srv_now() - t0 - t_pre;
            if (y) call_account(y, !ok);
            if (!y) {
                fail_why = "out of memory";
                pthread_mutex_lock(&r->mu);
                r->rep[decode].n_inflight--;
                pthread_mutex_unlock(&r->mu);
            } else if (!ok) {
                fail_why = call_why(y, why, sizeof why);
            } else {
                json_t *a = json_loadb(y->in.p ? y->in.p : "", y->in.n, 0, NULL);
                blocks = json_integer_value(json_object_get(a, "inserted_blocks")) +
                         json_integer_value(json_object_get(a, "present_blocks"));
                json_decref(a);
            }
            call_free(y);
        }
        call_free(x);
    }
    pthread_mutex_lock(&r->mu);
    if (ok) {
        r->n_pd_ok++;
        r->n_pd_blocks += (uint64_t)blocks;
        r->n_pd_bytes += bytes;
        r->pd_prefill_s += t_pre;
        r->pd_import_s += t_imp;
    } else {
        r->n_pd_fallback++;
    }
    pthread_mutex_unlock(&r->mu);
    if (!ok)
        fprintf(stderr,
                "WARN  route: prefill step for %s failed (%s): decode replica %d computes "
                "the prompt itself\n",
                url, fail_why, decode);
}

// What decode replica `decode` says of the request's prompt (POST /internal/kv/probe: the same
// rendering as the request's, a prefix-cache lookup), against pd_min_new_tokens: fewer tokens
// than that in the whole prompt (PD_SHORT) or left to compute past its cache (PD_CACHED) make the
// prefill step not worth it. Any failure of the probe (an older replica, a timeout, a bad
// answer): PD_GO, the step runs as without it.
typedef enum pd_verdict { PD_GO, PD_SHORT, PD_CACHED } pd_verdict;

static pd_verdict probe_decode(rt *r, struct MHD_Connection *c, const char *url, const char *body,
                               size_t n_body, int decode) {
    char path[320];
    snprintf(path, sizeof path, "/internal/kv/probe?route=%s", url);
    pthread_mutex_lock(&r->mu);
    r->rep[decode].n_inflight++; // the probe is an upstream call on it
    pthread_mutex_unlock(&r->mu);
    call *x = call_start(r, &r->rep[decode], decode, c, path, "POST", body, n_body, NULL);
    if (!x) {
        pthread_mutex_lock(&r->mu);
        r->rep[decode].n_inflight--;
        pthread_mutex_unlock(&r->mu);
        return PD_GO;
    }
    const bool ok = finish_call(x, c, srv_now() + r->cfg.prefill_timeout_ms / 1000.0);
    call_account(x, false); // a replica without the endpoint is not failing
    pd_verdict v = PD_GO;
    if (ok) {
        json_t *a = json_loadb(x->in.p ? x->in.p : "", x->in.n, 0, NULL);
        const json_t *np = json_object_get(a, "prompt_tokens"),
                     *nc = json_object_get(a, "cached_tokens");
        const json_int_t min = (json_int_t)r->cfg.pd_min_new_tokens;
        if (json_is_integer(np) && json_is_integer(nc))
            v = json_integer_value(np) < min                            ? PD_SHORT
                : json_integer_value(np) - json_integer_value(nc) < min ? PD_CACHED
                                                                        : PD_GO;
        json_decref(a);
    }
    call_free(x);
    return v;
}

// One client request through at most two replicas. A second one is tried when the first failed
// before anything reached the client and did not start the work: unreachable (connect error,
// connection closed or reset with no response) or it answered 429/502/503/504. A timeout or a
// transfer cut after a non-streaming answer began is not retried (the replica may have generated);
// a streaming answer is committed once its 2xx headers arrive.
static enum MHD_Result forward(rt *r, struct MHD_Connection *c, srv_api api, const char *url,
                               const char *method, const char *body, size_t n_body,
                               const rt_route *q, bool pd) {
    srv_err e;
    srv_err_set(&e, 503, NULL, "No replica is ready; retry later.");
    e.code = "no_replica";
    int exclude = -1;
    call *refused = NULL; // a first answer with a retryable status, kept for want of another
    for (int attempt = 0; attempt < 2; attempt++) {
        int i = pick(r, q, exclude);
        if (i < 0) break;
        const pd_verdict pv = attempt == 0 && pd && r->cfg.pd_min_new_tokens > 0
                                  ? probe_decode(r, c, url, body, n_body, i)
                                  : PD_GO;
        if (pv != PD_GO) {
            pthread_mutex_lock(&r->mu);
            if (pv == PD_SHORT)
                r->n_pd_short++;
            else
                r->n_pd_cached++;
            pthread_mutex_unlock(&r->mu);
            pd = false;
        }
        if (attempt == 0 && pd) {
            prefill(r, c, url, body, n_body, q, i);
            if (srv_client_gone(c)) { // it left during the prefill step: nobody to answer
                pthread_mutex_lock(&r->mu);
                r->rep[i].n_inflight--;
                pthread_mutex_unlock(&r->mu);
                return MHD_NO;
            }
        }
        call *x = call_start(r, &r->rep[i], i, c, url, method, body, n_body, NULL);
        if (!x) {
            pthread_mutex_lock(&r->mu);
            r->rep[i].n_inflight--;
            pthread_mutex_unlock(&r->mu);
            call_free(refused);
            srv_err_set(&e, 500, NULL, "Out of memory starting the upstream request.");
            return fail(r, c, api, &e);
        }
        while (!x->done && !x->headers_done && !srv_client_gone(c)) pump(x, 100);
        bool stream = x->headers_done && x->status >= 200 && x->status < 300 &&
                      !strncasecmp(x->ctype, "text/event-stream", 17);
        if (!stream) // the whole answer, watching the client meanwhile
            while (!x->done && !srv_client_gone(c)) pump(x, 100);
        if (!x->done && !stream) { // the client left: drop the transfer (the replica cancels)
            call_account(x, false);
            call_free(x);
            call_free(refused);
            return MHD_NO;
        }
        if (!stream && x->res != CURLE_OK) {
            bool unreachable = replica_unreachable(x->res);
            fprintf(stderr, "WARN  route: %s%s: %s\n", r->rep[i].url, url,
                    curl_easy_strerror(x->res));
            srv_err_set(&e, x->res == CURLE_OPERATION_TIMEDOUT ? 504 : 502, NULL,
                        "Replica %d failed: %s.", i, curl_easy_strerror(x->res));
            call_account(x, true);
            call_free(x);
            if (unreachable) rt_replica_down(r, i, "unreachable");
            if (attempt == 0 && unreachable) {
                exclude = i;
                continue;
            }
            call_free(refused);
            return fail(r, c, api, &e);
        }
        if (!stream) call_account(x, x->status >= 500); // a stream's ends in stream_free
        if (attempt == 0 && retryable_status(x->status)) {
            fprintf(stderr, "WARN  route: %s%s: status %ld, trying another replica\n",
                    r->rep[i].url, url, x->status);
            refused = x;
            exclude = i;
            continue;
        }
        call_free(refused);
        if (!stream) {
            enum MHD_Result ret = relay(r, c, x);
            call_free(x);
            return ret;
        }
        // SSE: every byte passed on as it arrives; stream_free ends the accounting.
        atomic_fetch_add(&r->inflight, 1);
        struct MHD_Response *resp = MHD_create_response_from_callback(
            MHD_SIZE_UNKNOWN, 16384, stream_reader, x, stream_free);
        if (!resp) {
            stream_free(x);
            return MHD_NO;
        }
        MHD_add_response_header(resp, MHD_HTTP_HEADER_CONTENT_TYPE, x->ctype);
        MHD_add_response_header(resp, "Cache-Control", "no-cache");
        MHD_add_response_header(resp, "X-Accel-Buffering", "no");
        char v[16];
        snprintf(v, sizeof v, "%d", i);
        MHD_add_response_header(resp, "X-Deepinfer-Replica", v);
        rt_count_status(r, (int)x->status);
        enum MHD_Result ret = MHD_queue_response(c, (unsigned)x->status, resp);
        MHD_destroy_response(resp);
        return ret;
    }
    if (refused) { // no other replica took it: the first answer stands
        enum MHD_Result ret = relay(r, c, refused);
        call_free(refused);
        return ret;
    }
    return fail(r, c, api, &e);
}

// ---- the handler ----

void rt_replica_down(rt *r, int i, const char *why) {
    pthread_mutex_lock(&r->mu);
    bool was = r->rep[i].healthy;
    r->rep[i].healthy = false;
    if (was) rt_seen_clear(&r->rep[i].seen); // it may come back empty
    if (r->rep[i].n_fails_in_a_row < r->cfg.health_fails)
        r->rep[i].n_fails_in_a_row = r->cfg.health_fails;
    pthread_mutex_unlock(&r->mu);
    if (was)
        fprintf(stderr, "WARN  route: replica %d (%s) out of rotation: %s\n", i, r->rep[i].url,
                why);
}

enum MHD_Result rt_handle(void *cls, struct MHD_Connection *c, const char *url, const char *method,
                          const char *body, size_t n_body, bool too_large) {
    rt *r = cls;
    srv_err e;
    const struct route *rt_ = NULL;
    bool path_known = false;
    for (size_t i = 0; i < sizeof k_routes / sizeof k_routes[0]; i++) {
        if (strcmp(url, k_routes[i].path)) continue;
        path_known = true;
        if (!strcmp(method, k_routes[i].method)) rt_ = &k_routes[i];
    }
    srv_api api = strstr(url, "messages") ? SRV_API_MESSAGES : SRV_API_OTHER;
    if (!strcmp(url, "/admin/replicas")) return rt_admin(r, c, method, body, n_body, too_large);
    if (!rt_) {
        if (path_known) {
            srv_err_set(&e, 405, NULL, "Method %s is not allowed on %s.", method, url);
        } else {
            srv_err_set(&e, 404, NULL, "Unknown path %s.", url);
            e.code = "not_found";
        }
        return fail(r, c, api, &e);
    }
    if (rt_->k == K_HEALTH) {
        rt_count_status(r, 200);
        return srv_send_json(c, 200, json_pack("{s:s}", "status", "ok"), 0);
    }
    if (rt_->k == K_READY) {
        int n_ready = 0, n_in = 0;
        pthread_mutex_lock(&r->mu);
        for (int i = 0; i < r->n_rep; i++) {
            n_ready += r->rep[i].healthy;
            n_in += !r->rep[i].removed;
        }
        pthread_mutex_unlock(&r->mu);
        bool ok = n_ready > 0 && !atomic_load(&r->stop);
        rt_count_status(r, ok ? 200 : 503);
        return srv_send_json(c, ok ? 200 : 503,
                             json_pack("{s:s,s:i,s:i}", "status",
                                       ok                      ? "ready"
                                       : atomic_load(&r->stop) ? "draining"
                                                               : "no_replica",
                                       "replicas_ready", n_ready, "replicas", n_in),
                             ok ? 0 : 1);
    }
    if (rt_->k == K_METRICS) {
        char *t = rt_metrics_text(r);
        rt_count_status(r, 200);
        enum MHD_Result ret =
            srv_send_text(c, 200, "text/plain; version=0.0.4; charset=utf-8", t ? t : "");
        free(t);
        return ret;
    }
    if (!authorized(r, c, api)) {
        srv_err_set(&e, 401, NULL, "Invalid or missing API key.");
        return fail(r, c, api, &e);
    }
    rt_route q = {0};
    uint64_t chain[RT_MAX_CHAIN];
    q.chain = chain;
    if (rt_->k == K_GEN || rt_->k == K_COUNT) {
        if (too_large) {
            srv_err_set(&e, 413, NULL, "The request body is larger than %zu bytes.",
                        r->cfg.http.max_body_bytes);
            return fail(r, c, api, &e);
        }
        if (atomic_load(&r->stop)) {
            srv_err_set(&e, 503, NULL, "The router is shutting down.");
            return fail(r, c, api, &e);
        }
        // Parsed only for the routing key; the replica validates everything else.
        json_error_t jerr;
        json_t *req = json_loadb(body, n_body, JSON_REJECT_DUPLICATES, &jerr);
        if (!req || !json_is_object(req)) {
            if (req)
                srv_err_set(&e, 400, NULL, "The request body must be a JSON object.");
            else
                srv_err_set(&e, 400, NULL, "Invalid JSON body: %s (line %d, column %d).", jerr.text,
                            jerr.line, jerr.column);
            json_decref(req);
            return fail(r, c, api, &e);
        }
        char *kb = malloc(r->cfg.prefix_bytes);
        if (kb) {
            size_t n = rt_prefix_key(req, r->cfg.pin_user, kb, r->cfg.prefix_bytes, &q.pinned);
            q.has_key = n > 0;
            q.key = rt_hash(kb, n);
            free(kb);
        }
        // The prefix chain: the canonical prompt text (never the user) in whole chunks.
        char *mb = r->cfg.match_bytes > 0 ? malloc(r->cfg.match_bytes) : NULL;
        if (mb) {
            bool user;
            size_t n = rt_prefix_key(req, false, mb, r->cfg.match_bytes, &user);
            q.n_chain = rt_chain(mb, n, chain, RT_MAX_CHAIN);
            free(mb);
        }
        json_decref(req);
    }
    atomic_fetch_add(&r->inflight, 1);
    // PD mode: generation requests with a body of at least pd_min_bytes are prefilled first.
    bool pd = false;
    if (rt_->k == K_GEN && r->n_pre > 0) {
        pd = n_body >= r->cfg.pd_min_bytes;
        pthread_mutex_lock(&r->mu);
        if (!pd) r->n_pd_short++;
        pthread_mutex_unlock(&r->mu);
    }
    enum MHD_Result ret = forward(r, c, api, url, method, body, n_body, &q, pd);
    atomic_fetch_sub(&r->inflight, 1);
    return ret;
}

// ---- metrics ----

char *rt_metrics_text(rt *r) {
    sb b = {0};
    pthread_mutex_lock(&r->mu);
#define FAMILY(name, type, help) sb_addf(&b, "# HELP " name " " help "\n# TYPE " name " " type "\n")
#define PER_REPLICA(name, fmt, expr)                                                               \
    for (int i = 0; i < r->n_rep; i++)                                                             \
        sb_addf(&b, name "{replica=\"%d\",url=\"%s\"} " fmt "\n", i, r->rep[i].url, expr);
    FAMILY("deepinfer:router_replica_healthy", "gauge", "1 while the replica is in rotation.");
    PER_REPLICA("deepinfer:router_replica_healthy", "%d", r->rep[i].healthy ? 1 : 0);
    FAMILY("deepinfer:router_replica_removed", "gauge",
           "1 while the replica is taken out by the admin API (DELETE /admin/replicas).");
    PER_REPLICA("deepinfer:router_replica_removed", "%d", r->rep[i].removed ? 1 : 0);
    FAMILY("deepinfer:router_replica_failed_polls_in_a_row", "gauge",
           "Failed /ready polls since the last good one.");
    PER_REPLICA("deepinfer:router_replica_failed_polls_in_a_row", "%d", r->rep[i].n_fails_in_a_row);
    FAMILY("deepinfer:router_replica_in_flight", "gauge",
           "Requests the router has open on the replica.");
    PER_REPLICA("deepinfer:router_replica_in_flight", "%lld", (long long)r->rep[i].n_inflight);
    FAMILY("deepinfer:router_replica_waiting", "gauge",
           "The replica's num_requests_waiting at the last poll.");
    PER_REPLICA("deepinfer:router_replica_waiting", "%lld", (long long)r->rep[i].n_waiting);
    FAMILY("deepinfer:router_replica_running", "gauge",
           "The replica's num_requests_running at the last poll.");
    PER_REPLICA("deepinfer:router_replica_running", "%lld", (long long)r->rep[i].n_running);
    FAMILY("deepinfer:router_replica_kv_cache_usage_perc", "gauge",
           "The replica's kv_cache_usage_perc at the last poll.");
    PER_REPLICA("deepinfer:router_replica_kv_cache_usage_perc", "%.6f", r->rep[i].kv_usage);
    FAMILY("deepinfer:router_replica_requests_total", "counter",
           "Requests sent to the replica (retries included).");
    PER_REPLICA("deepinfer:router_replica_requests_total", "%llu",
                (unsigned long long)r->rep[i].n_requests);
    FAMILY("deepinfer:router_replica_errors_total", "counter",
           "Requests to the replica that failed: transport error or 5xx.");
    PER_REPLICA("deepinfer:router_replica_errors_total", "%llu",
                (unsigned long long)r->rep[i].n_errors);
    FAMILY("deepinfer:router_decisions_total", "counter",
           "Routing decisions by kind (match: the replica sent the longest prefix of the prompt; "
           "affine: the prefix's ring replica; fallback: the least-loaded one as the chosen one "
           "was overloaded; least: no key, or a retry).");
    for (int i = 0; i < r->n_rep; i++) {
        const char *k_kind[4] = {"match", "affine", "fallback", "least"};
        const uint64_t v[4] = {r->rep[i].n_match, r->rep[i].n_affine, r->rep[i].n_fallback,
                               r->rep[i].n_least};
        for (int k = 0; k < 4; k++)
            sb_addf(&b, "deepinfer:router_decisions_total{replica=\"%d\",decision=\"%s\"} %llu\n",
                    i, k_kind[k], (unsigned long long)v[k]);
    }
    FAMILY("deepinfer:router_retries_total", "counter",
           "Requests retried on a second replica (docs/router.md, Failover).");
    sb_addf(&b, "deepinfer:router_retries_total %llu\n", (unsigned long long)r->n_retries);
    FAMILY("deepinfer:router_no_replica_total", "counter",
           "Requests refused with 503 as no replica was ready.");
    sb_addf(&b, "deepinfer:router_no_replica_total %llu\n", (unsigned long long)r->n_no_replica);
    if (r->n_pre) {
        FAMILY("deepinfer:router_prefill_replica_healthy", "gauge",
               "1 while the prefill replica is in rotation.");
        for (int i = 0; i < r->n_pre; i++)
            sb_addf(&b, "deepinfer:router_prefill_replica_healthy{replica=\"%d\",url=\"%s\"} %d\n",
                    i, r->pre[i].url, r->pre[i].healthy ? 1 : 0);
        FAMILY("deepinfer:router_prefill_replica_requests_total", "counter",
               "Prefill steps sent to the prefill replica.");
        for (int i = 0; i < r->n_pre; i++)
            sb_addf(&b,
                    "deepinfer:router_prefill_replica_requests_total{replica=\"%d\",url=\"%s\"} "
                    "%llu\n",
                    i, r->pre[i].url, (unsigned long long)r->pre[i].n_requests);
        FAMILY("deepinfer:router_prefill_decisions_total", "counter",
               "Prefill replica choices by kind (as router_decisions_total).");
        for (int i = 0; i < r->n_pre; i++) {
            const char *k_kind[4] = {"match", "affine", "fallback", "least"};
            const uint64_t v[4] = {r->pre[i].n_match, r->pre[i].n_affine, r->pre[i].n_fallback,
                                   r->pre[i].n_least};
            for (int k = 0; k < 4; k++)
                sb_addf(&b,
                        "deepinfer:router_prefill_decisions_total{replica=\"%d\",decision=\"%s\"} "
                        "%llu\n",
                        i, k_kind[k], (unsigned long long)v[k]);
        }
        FAMILY("deepinfer:router_pd_requests_total", "counter",
               "Requests by prefill step outcome (ok: the KV reached the decode replica; "
               "fallback: the step failed, the decode replica computed the prompt; short: the "
               "body was under --pd-min-bytes or the prompt under --pd-min-new-tokens, no step; "
               "cached: the decode replica held all but fewer than --pd-min-new-tokens of the "
               "prompt, no step).");
        sb_addf(&b,
                "deepinfer:router_pd_requests_total{outcome=\"ok\"} %llu\n"
                "deepinfer:router_pd_requests_total{outcome=\"fallback\"} %llu\n"
                "deepinfer:router_pd_requests_total{outcome=\"short\"} %llu\n"
                "deepinfer:router_pd_requests_total{outcome=\"cached\"} %llu\n",
                (unsigned long long)r->n_pd_ok, (unsigned long long)r->n_pd_fallback,
                (unsigned long long)r->n_pd_short, (unsigned long long)r->n_pd_cached);
        FAMILY("deepinfer:router_pd_transfer_blocks_total", "counter",
               "KV blocks of the transfers that reached a decode replica.");
        sb_addf(&b, "deepinfer:router_pd_transfer_blocks_total %llu\n",
                (unsigned long long)r->n_pd_blocks);
        FAMILY("deepinfer:router_pd_transfer_bytes_total", "counter",
               "Bytes of the KV transfers that reached a decode replica.");
        sb_addf(&b, "deepinfer:router_pd_transfer_bytes_total %llu\n",
                (unsigned long long)r->n_pd_bytes);
        FAMILY("deepinfer:router_pd_seconds_total", "counter",
               "Time in successful prefill steps: the prefill call (prompt computed and KV "
               "exported) and the import call.");
        sb_addf(&b,
                "deepinfer:router_pd_seconds_total{phase=\"prefill\"} %.6f\n"
                "deepinfer:router_pd_seconds_total{phase=\"import\"} %.6f\n",
                r->pd_prefill_s, r->pd_import_s);
    }
    FAMILY("deepinfer:router_requests_in_flight", "gauge", "Client requests being proxied.");
    sb_addf(&b, "deepinfer:router_requests_in_flight %d\n", atomic_load(&r->inflight));
    FAMILY("deepinfer:http_responses_total", "counter", "HTTP responses by status class.");
    for (int k = 1; k <= 5; k++)
        sb_addf(&b, "deepinfer:http_responses_total{status=\"%dxx\"} %llu\n", k,
                (unsigned long long)r->n_status[k]);
#undef FAMILY
#undef PER_REPLICA
    pthread_mutex_unlock(&r->mu);
    return b.p;
}
