// deepinfer route: arguments, the consistent-hash ring, one health poller per replica, the HTTP
// front (tools/server/http.c), signals and clean shutdown. SIGTERM/SIGINT: /ready turns 503, new
// generation requests get 503, in-flight ones are drained (at most --drain-timeout seconds).
#include <curl/curl.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "cli/args.h"
#include "cli/cli.h"
#include "router/router.h"

static void usage(FILE *f) {
    fprintf(f,
            "usage: deepinfer route --replica http://HOST:PORT [--replica ...]\n"
            "                       [--host 127.0.0.1] [--port 8000] [--api-key KEY]\n"
            "                       [--replica-api-key KEY] [--health-interval 1s]\n"
            "                       [--health-fails 3] [--connect-timeout 2s]\n"
            "                       [--upstream-timeout 600s] [--prefix-bytes 1024]\n"
            "                       [--match-bytes 65536] [--max-imbalance 4] [--vnodes 64]\n"
            "                       [--no-user-pin] [--admin-key KEY]\n"
            "                       [--max-body-mib 8] [--timeout 600] [--drain-timeout 30]\n"
            "       deepinfer route --prefill URL [--prefill ...] --decode URL [--decode ...]\n"
            "                       [--pd-min-bytes 1024] [--pd-min-new-tokens 256]\n"
            "                       [--prefill-timeout 120s] [options]\n"
            "Spreads OpenAI Chat Completions / Completions / Responses and Anthropic Messages\n"
            "requests over `deepinfer serve` replicas: to the replica sent the longest prefix of\n"
            "the prompt (its first --match-bytes, in 256-byte chunks; 0: off), else by prefix\n"
            "affinity on a consistent-hash ring; least-loaded fallback, health polling, one retry\n"
            "before any byte reached the client (docs/router.md). Durations: a number with ms,\n"
            "s (default) or m.\n"
            "With --prefill replicas (`deepinfer serve --kv-transfer`), each request of at least\n"
            "--pd-min-bytes is prefilled there first and its KV moved to the decode replica\n"
            "(--decode, same as --replica), which then serves it (docs/disaggregation.md),\n"
            "unless the decode replica already holds all but fewer than --pd-min-new-tokens of\n"
            "its prompt (0: never ask).\n"
            "--admin-key turns on the admin API: GET/POST/DELETE /admin/replicas with\n"
            "Authorization: Bearer KEY lists, adds and removes replicas while the router runs.\n");
}

// "<n>[ms|s|m]" (seconds without a suffix) into milliseconds in [1, 86400 s]; false if malformed.
static bool parse_ms(const char *s, int *out) {
    char *end = NULL;
    errno = 0;
    double v = strtod(s, &end);
    if (errno || end == s || !(v > 0)) return false;
    double mul = 1000;
    if (!strcmp(end, "ms"))
        mul = 1;
    else if (!strcmp(end, "m"))
        mul = 60000;
    else if (*end && strcmp(end, "s"))
        return false;
    double ms = v * mul;
    if (ms < 1 || ms > 86400e3) return false;
    *out = (int)ms;
    return true;
}

// ---- health polling ----

typedef struct poller {
    rt *r;
    rt_replica *p;
    const char *role; // "replica" or "prefill replica" (logs)
    int i;
} poller;

static size_t collect(char *p, size_t size, size_t n, void *user) {
    sb_add(user, p, size * n);
    return size * n;
}

// GET url into body (cleared first); returns the curl result, *status the HTTP status.
static CURLcode get(CURL *e, const char *url, int timeout_ms, sb *body, long *status) {
    body->n = 0;
    curl_easy_setopt(e, CURLOPT_URL, url);
    curl_easy_setopt(e, CURLOPT_TIMEOUT_MS, (long)timeout_ms);
    curl_easy_setopt(e, CURLOPT_WRITEFUNCTION, collect);
    curl_easy_setopt(e, CURLOPT_WRITEDATA, body);
    curl_easy_setopt(e, CURLOPT_NOSIGNAL, 1L);
    CURLcode res = curl_easy_perform(e);
    *status = 0;
    if (res == CURLE_OK) curl_easy_getinfo(e, CURLINFO_RESPONSE_CODE, status);
    return res;
}

// The value of an unlabelled-or-labelled sample "name{...} v" or "name v" in Prometheus text.
static bool metric(const char *text, const char *name, double *out) {
    size_t n = strlen(name);
    for (const char *p = text; p && *p; p = strchr(p, '\n'), p = p ? p + 1 : NULL) {
        if (strncmp(p, name, n) || (p[n] != '{' && p[n] != ' ')) continue;
        const char *sp = strchr(p, ' ');
        const char *nl = strchr(p, '\n');
        if (!sp || (nl && sp > nl)) continue;
        if (p[n] == '{') { // the value follows the closing brace
            const char *cb = strchr(p, '}');
            if (!cb || (nl && cb > nl)) continue;
            sp = cb + 1;
        }
        *out = strtod(sp, NULL);
        return true;
    }
    return false;
}

static void poll_once(rt *r, rt_replica *p, const char *role, int i, CURL *e, sb *body) {
    pthread_mutex_lock(&r->mu);
    const bool removed = p->removed;
    pthread_mutex_unlock(&r->mu);
    if (removed) return; // out by the admin API: nothing to learn until it is added back
    char url[300];
    snprintf(url, sizeof url, "%s/ready", p->url);
    int timeout_ms = r->cfg.health_interval_ms > r->cfg.connect_timeout_ms
                         ? r->cfg.health_interval_ms
                         : r->cfg.connect_timeout_ms;
    long status;
    CURLcode res = get(e, url, timeout_ms, body, &status);
    bool ready = res == CURLE_OK && status == 200;
    bool unreachable = res == CURLE_COULDNT_CONNECT || res == CURLE_COULDNT_RESOLVE_HOST;
    double waiting = 0, running = 0, kv = 0;
    bool have_load = false;
    if (ready) {
        snprintf(url, sizeof url, "%s/metrics", p->url);
        if (get(e, url, timeout_ms, body, &status) == CURLE_OK && status == 200 && body->p) {
            have_load = metric(body->p, "deepinfer:num_requests_waiting", &waiting);
            metric(body->p, "deepinfer:num_requests_running", &running);
            metric(body->p, "deepinfer:kv_cache_usage_perc", &kv);
        }
    }
    pthread_mutex_lock(&r->mu);
    if (p->removed) { // removed while this poll ran
        pthread_mutex_unlock(&r->mu);
        return;
    }
    bool was = p->healthy;
    if (ready) {
        p->healthy = true;
        p->n_fails_in_a_row = 0;
    } else {
        p->n_fails_in_a_row++;
        if (unreachable || p->n_fails_in_a_row >= r->cfg.health_fails) p->healthy = false;
        if (was && !p->healthy) rt_seen_clear(&p->seen); // it may come back empty
    }
    if (have_load) {
        p->n_waiting = (int64_t)waiting;
        p->n_running = (int64_t)running;
        p->kv_usage = kv;
    }
    bool now = p->healthy;
    int fails = p->n_fails_in_a_row;
    pthread_mutex_unlock(&r->mu);
    if (now && !was) fprintf(stderr, "INFO  route: %s %d (%s) is ready\n", role, i, p->url);
    if (!now && was)
        fprintf(stderr, "WARN  route: %s %d (%s) out of rotation: %s (%d failed poll(s))\n", role,
                i, p->url, res != CURLE_OK ? curl_easy_strerror(res) : "/ready not 200", fails);
}

static void *poll_main(void *arg) {
    poller *pl = arg;
    rt *r = pl->r;
    CURL *e = curl_easy_init(); // one per poller: its connection is kept alive between polls
    sb body = {0};
    while (e && !atomic_load(&r->stop)) {
        poll_once(r, pl->p, pl->role, pl->i, e, &body);
        struct timespec until;
        clock_gettime(CLOCK_REALTIME, &until);
        long ns = until.tv_nsec + (long)(r->cfg.health_interval_ms % 1000) * 1000000L;
        until.tv_sec += r->cfg.health_interval_ms / 1000 + ns / 1000000000L;
        until.tv_nsec = ns % 1000000000L;
        pthread_mutex_lock(&r->mu);
        while (!atomic_load(&r->stop))
            if (pthread_cond_timedwait(&r->cv, &r->mu, &until) == ETIMEDOUT) break;
        pthread_mutex_unlock(&r->mu);
    }
    if (!e) fprintf(stderr, "ERROR route: cannot create a curl handle for %s\n", pl->p->url);
    sb_free(&body);
    curl_easy_cleanup(e);
    free(pl);
    return NULL;
}

// ---- arguments and wiring ----

bool rt_poller_start(rt *r, bool pre, int k) {
    rt_replica *p = pre ? &r->pre[k] : &r->rep[k];
    poller *pl = malloc(sizeof *pl);
    if (!pl) return false;
    *pl = (poller){r, p, pre ? "prefill replica" : "replica", k};
    if (pthread_create(&p->poller, NULL, poll_main, pl)) {
        free(pl);
        fprintf(stderr, "ERROR route: cannot start a health poller for %s\n", p->url);
        return false;
    }
    p->poller_started = true;
    return true;
}

int di_cli_route(int argc, char **argv) {
    rt *r = calloc(1, sizeof *r);
    if (!r) return 1;
    rt_config *c = &r->cfg;
    *c = (rt_config){.http = di_args_http_defaults(),
                     .health_interval_ms = 1000,
                     .health_fails = 3,
                     .connect_timeout_ms = 2000,
                     .upstream_timeout_s = 600,
                     .prefix_bytes = 1024,
                     .match_bytes = (size_t)RT_MAX_CHAIN * RT_CHUNK,
                     .n_vnodes = 64,
                     .max_imbalance = 4,
                     .pin_user = true,
                     .max_connections = 1024,
                     .pd_min_bytes = 1024,
                     .pd_min_new_tokens = 256,
                     .prefill_timeout_ms = 120000};
    int rc = 2, ms;
    long v;
    bool locks = false, curl = false;
    srv_http *h = NULL;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        int m = di_args_http_option(argc, argv, &i, &c->http);
        if (m < 0) goto out;
        if (m > 0) continue;
        bool has = i + 1 < argc;
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
            usage(stdout);
            rc = 0;
            goto out;
        } else if ((!strcmp(a, "--replica") || !strcmp(a, "--decode") || !strcmp(a, "--prefill")) &&
                   has) {
            const bool pre = !strcmp(a, "--prefill");
            rt_replica *set = pre ? r->pre : r->rep;
            atomic_int *n = pre ? &r->n_pre : &r->n_rep;
            if (*n == RT_MAX_REPLICAS) {
                fprintf(stderr, "route: at most %d replicas of each kind\n", RT_MAX_REPLICAS);
                goto out;
            }
            if (!rt_replica_url(argv[++i], set[*n].url, sizeof set[0].url)) {
                fprintf(stderr, "route: %s takes http://HOST:PORT, got '%s'\n", a, argv[i]);
                goto out;
            }
            for (int k = 0; k < *n; k++)
                if (!strcmp(set[k].url, set[*n].url)) {
                    fprintf(stderr, "route: replica %s given twice\n", argv[i]);
                    goto out;
                }
            (*n)++;
        } else if (!strcmp(a, "--pd-min-bytes") && has) {
            if (!di_args_int(argv[++i], "--pd-min-bytes", 0, 1 << 30, &v)) goto out;
            c->pd_min_bytes = (size_t)v;
        } else if (!strcmp(a, "--pd-min-new-tokens") && has) {
            if (!di_args_int(argv[++i], "--pd-min-new-tokens", 0, 1 << 30, &v)) goto out;
            c->pd_min_new_tokens = (int)v;
        } else if (!strcmp(a, "--prefill-timeout") && has) {
            if (!parse_ms(argv[++i], &c->prefill_timeout_ms)) {
                fprintf(stderr, "route: --prefill-timeout takes a duration such as 500ms, 2s or "
                                "1m\n");
                goto out;
            }
        } else if (!strcmp(a, "--replica-api-key") && has) {
            c->replica_api_key = argv[++i];
        } else if (!strcmp(a, "--admin-key") && has) {
            c->admin_key = argv[++i];
            if (!*c->admin_key) {
                fprintf(stderr, "route: --admin-key takes a non-empty key\n");
                goto out;
            }
        } else if ((!strcmp(a, "--health-interval") || !strcmp(a, "--connect-timeout") ||
                    !strcmp(a, "--upstream-timeout")) &&
                   has) {
            if (!parse_ms(argv[++i], &ms)) {
                fprintf(stderr, "route: %s takes a duration such as 500ms, 2s or 1m\n", a);
                goto out;
            }
            if (!strcmp(a, "--health-interval"))
                c->health_interval_ms = ms;
            else if (!strcmp(a, "--connect-timeout"))
                c->connect_timeout_ms = ms;
            else
                c->upstream_timeout_s = ms < 1000 ? 1 : ms / 1000;
        } else if (!strcmp(a, "--health-fails") && has) {
            if (!di_args_int(argv[++i], "--health-fails", 1, 1000, &v)) goto out;
            c->health_fails = (int)v;
        } else if (!strcmp(a, "--prefix-bytes") && has) {
            if (!di_args_int(argv[++i], "--prefix-bytes", 16, 1 << 20, &v)) goto out;
            c->prefix_bytes = (size_t)v;
        } else if (!strcmp(a, "--match-bytes") && has) {
            if (!di_args_int(argv[++i], "--match-bytes", 0, (long)RT_MAX_CHAIN * RT_CHUNK, &v))
                goto out;
            c->match_bytes = (size_t)v;
        } else if (!strcmp(a, "--max-imbalance") && has) {
            if (!di_args_int(argv[++i], "--max-imbalance", 1, 1 << 20, &v)) goto out;
            c->max_imbalance = v;
        } else if (!strcmp(a, "--vnodes") && has) {
            if (!di_args_int(argv[++i], "--vnodes", 1, 4096, &v)) goto out;
            c->n_vnodes = (int)v;
        } else if (!strcmp(a, "--no-user-pin")) {
            c->pin_user = false;
        } else {
            fprintf(stderr, "route: unknown or incomplete option '%s'\n", a);
            usage(stderr);
            goto out;
        }
    }
    if (!r->n_rep) {
        fprintf(stderr, "route: at least one --replica (or --decode) is needed\n");
        usage(stderr);
        goto out;
    }
    rc = 1;
    const char *names[RT_MAX_REPLICAS];
    for (int i = 0; i < r->n_rep; i++) names[i] = r->rep[i].url;
    if (!rt_ring_create(r->n_rep, names, c->n_vnodes, &r->ring)) {
        fprintf(stderr, "ERROR route: out of memory building the ring\n");
        goto out;
    }
    for (int i = 0; i < r->n_pre; i++) names[i] = r->pre[i].url;
    if (r->n_pre && !rt_ring_create(r->n_pre, names, c->n_vnodes, &r->pre_ring)) {
        fprintf(stderr, "ERROR route: out of memory building the prefill ring\n");
        goto out;
    }
    for (int i = 0; i < r->n_rep + r->n_pre; i++) {
        rt_replica *p = i < r->n_rep ? &r->rep[i] : &r->pre[i - r->n_rep];
        if (c->match_bytes > 0 && !rt_seen_init(&p->seen, RT_SEEN_LOG2)) {
            fprintf(stderr, "ERROR route: out of memory for the prefix tables\n");
            goto out;
        }
    }
    if (curl_global_init(CURL_GLOBAL_DEFAULT) != CURLE_OK) {
        fprintf(stderr, "ERROR route: cannot initialise libcurl\n");
        goto out;
    }
    curl = true;
    pthread_mutex_init(&r->mu, NULL);
    pthread_cond_init(&r->cv, NULL);
    locks = true;
    r->started_at = (long)time(NULL);
    srv_http_on_signals();
    for (int i = 0; i < r->n_rep + r->n_pre; i++) {
        const bool pre = i >= r->n_rep;
        if (!rt_poller_start(r, pre, pre ? i - r->n_rep : i)) goto out;
    }
    const srv_http_opts o = {.who = "route",
                             .host = c->http.host,
                             .port = c->http.port,
                             .max_body_bytes = c->http.max_body_bytes,
                             .timeout_s = c->http.timeout_s,
                             .max_connections = c->max_connections,
                             .handler = rt_handle,
                             .cls = r};
    if (!srv_http_listen(&o, &h)) goto out;
    fprintf(stderr, "INFO  route: listening on http://%s:%d, %d replica(s), health every %d ms%s\n",
            c->http.host, c->http.port, atomic_load(&r->n_rep), c->health_interval_ms,
            c->admin_key ? "; admin API on /admin/replicas" : "");
    if (r->n_pre)
        fprintf(stderr,
                "INFO  route: prefill/decode disaggregation: %d prefill replica(s), %d decode "
                "replica(s); bodies of %zu bytes or more are prefilled first\n",
                r->n_pre, r->n_rep, c->pd_min_bytes);
    srv_http_wait_signal();
    atomic_store(&r->stop, true);
    fprintf(stderr, "INFO  route: shutting down: draining %d in-flight request(s)\n",
            atomic_load(&r->inflight));
    srv_http_drain(h, &r->inflight, c->http.drain_s);
    rc = 0;
out:
    srv_http_stop(h);
    if (locks) { // wake and join the pollers
        pthread_mutex_lock(&r->mu);
        atomic_store(&r->stop, true);
        pthread_cond_broadcast(&r->cv);
        pthread_mutex_unlock(&r->mu);
    }
    for (int i = 0; i < r->n_rep; i++)
        if (r->rep[i].poller_started) pthread_join(r->rep[i].poller, NULL);
    for (int i = 0; i < r->n_pre; i++)
        if (r->pre[i].poller_started) pthread_join(r->pre[i].poller, NULL);
    if (h) fprintf(stderr, "INFO  route: stopped\n");
    if (locks) {
        pthread_cond_destroy(&r->cv);
        pthread_mutex_destroy(&r->mu);
    }
    rt_pool_free(r);
    if (curl) curl_global_cleanup();
    rt_ring_destroy(r->ring);
    rt_ring_destroy(r->pre_ring);
    for (int i = 0; i < r->n_rep; i++) rt_seen_free(&r->rep[i].seen);
    for (int i = 0; i < r->n_pre; i++) rt_seen_free(&r->pre[i].seen);
    free(r);
    return rc;
}
