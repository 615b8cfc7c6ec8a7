// admin — the router's admin API (docs/router.md, "Replicas at run time"): /admin/replicas lists
// (GET), adds or restores (POST) and removes (DELETE) serving and prefill replicas while the
// router runs, behind --admin-key. A new replica gets the next slot of its set, its prefix table
// and health poller, and a ring rebuilt with its points (under rt.mu, where every pick reads the
// ring); it serves once a poll finds it ready. A removed one keeps its slot and ring points,
// skipped as unusable, so its keys fall to the next replica on the ring as if it had failed
// (consistent hashing: nothing else moves); requests already on it finish; adding its url again
// restores it (polled afresh, its prefix table empty).
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "router/router.h"

static enum MHD_Result send_err(rt *r, struct MHD_Connection *c, int status, const char *code,
                                const char *fmt, const char *arg) {
    srv_err e;
    srv_err_set(&e, status, NULL, fmt, arg);
    if (code) e.code = code;
    rt_count_status(r, status);
    return srv_send_error(c, SRV_API_OTHER, &e);
}

static enum MHD_Result send_ok(rt *r, struct MHD_Connection *c, int status, json_t *body) {
    rt_count_status(r, status);
    return srv_send_json(c, status, body, 0);
}

static bool admin_authorized(const rt *r, struct MHD_Connection *c) {
    return r->cfg.admin_key && srv_authorized(c, r->cfg.admin_key, false);
}

static json_t *replica_json(const rt_replica *p, const char *role, int i) {
    return json_pack("{s:s,s:s,s:i,s:b,s:b,s:I,s:I,s:I}", "url", p->url, "role", role, "index", i,
                     "healthy", p->healthy, "removed", p->removed, "in_flight",
                     (json_int_t)p->n_inflight, "requests", (json_int_t)p->n_requests, "errors",
                     (json_int_t)p->n_errors);
}

static enum MHD_Result list(rt *r, struct MHD_Connection *c) {
    json_t *a = json_array();
    pthread_mutex_lock(&r->mu);
    for (int i = 0; i < r->n_rep; i++)
        json_array_append_new(a, replica_json(&r->rep[i], "serve", i));
    for (int i = 0; i < r->n_pre; i++)
        json_array_append_new(a, replica_json(&r->pre[i], "prefill", i));
    pthread_mutex_unlock(&r->mu);
    return send_ok(r, c, 200, json_pack("{s:o}", "replicas", a));
}

// The set's ring with every slot's points, swapped in under rt.mu (held by the caller).
static bool rebuild_ring(rt *r, bool pre) {
    const int n = pre ? r->n_pre : r->n_rep;
    const rt_replica *set = pre ? r->pre : r->rep;
    const char *names[RT_MAX_REPLICAS];
    for (int i = 0; i < n; i++) names[i] = set[i].url;
    rt_ring *ring = NULL;
    if (!rt_ring_create(n, names, r->cfg.n_vnodes, &ring)) return false;
    rt_ring **slot = pre ? &r->pre_ring : &r->ring;
    rt_ring_destroy(*slot);
    *slot = ring;
    return true;
}

// POST: {"url": "http://host:port", "role": "serve" (default) | "prefill"}.
static enum MHD_Result add(rt *r, struct MHD_Connection *c, const char *url, bool pre) {
    rt_replica *set = pre ? r->pre : r->rep;
    atomic_int *n = pre ? &r->n_pre : &r->n_rep;
    const char *role = pre ? "prefill" : "serve";
    pthread_mutex_lock(&r->mu);
    for (int i = 0; i < *n; i++) {
        if (strcmp(set[i].url, url)) continue;
        rt_replica *p = &set[i];
        if (!p->removed) {
            pthread_mutex_unlock(&r->mu);
            return send_err(r, c, 409, "conflict", "Replica %s is already in the router.", url);
        }
        p->removed = false; // the poller brings it into rotation at its next good poll
        p->n_fails_in_a_row = 0;
        pthread_mutex_unlock(&r->mu);
        fprintf(stderr, "INFO  route: admin: %s replica %d (%s) added back\n", role, i, url);
        return send_ok(r, c, 200,
                       json_pack("{s:s,s:s,s:s,s:i}", "status", "restored", "url", url, "role",
                                 role, "index", i));
    }
    const int k = *n;
    if (k == RT_MAX_REPLICAS) {
        pthread_mutex_unlock(&r->mu);
        return send_err(r, c, 422, NULL, "The router holds at most %s replicas of each role.",
                        pre ? "64 prefill" : "64 serving");
    }
    rt_replica *p = &set[k];
    memset(p, 0, sizeof *p);
    snprintf(p->url, sizeof p->url, "%s", url);
    bool ok = r->cfg.match_bytes == 0 || rt_seen_init(&p->seen, RT_SEEN_LOG2);
    if (ok) {
        (*n)++; // the slot is whole: readers may see it from now on
        ok = rebuild_ring(r, pre);
        if (!ok) (*n)--; // the old ring stays; nobody picked the slot (the lock is held)
    }
    if (ok) ok = rt_poller_start(r, pre, k);
    // A poller that did not start leaves the slot removed: listed, never picked.
    if (!ok && *n > k) p->removed = true;
    if (!ok && *n == k) rt_seen_free(&p->seen);
    pthread_mutex_unlock(&r->mu);
    if (!ok)
        return send_err(r, c, 500, NULL, "Could not add replica %s (out of memory or threads).",
                        url);
    fprintf(stderr, "INFO  route: admin: %s replica %d (%s) added\n", role, k, url);
    return send_ok(
        r, c, 201,
        json_pack("{s:s,s:s,s:s,s:i}", "status", "added", "url", url, "role", role, "index", k));
}

// DELETE: {"url": "http://host:port"}: the replica of either role with that url.
static enum MHD_Result remove_replica(rt *r, struct MHD_Connection *c, const char *url) {
    pthread_mutex_lock(&r->mu);
    for (int pre = 0; pre < 2; pre++) {
        rt_replica *set = pre ? r->pre : r->rep;
        const int n = pre ? r->n_pre : r->n_rep;
        for (int i = 0; i < n; i++) {
            rt_replica *p = &set[i];
            if (strcmp(p->url, url) || p->removed) continue;
            p->removed = true;
            p->healthy = false;
            rt_seen_clear(&p->seen);
            const int64_t inflight = p->n_inflight;
            pthread_mutex_unlock(&r->mu);
            fprintf(stderr,
                    "INFO  route: admin: %s replica %d (%s) removed (%lld request(s) on it "
                    "finish)\n",
                    pre ? "prefill" : "serve", i, url, (long long)inflight);
            return send_ok(r, c, 200,
                           json_pack("{s:s,s:s,s:s,s:i,s:I}", "status", "removed", "url", url,
                                     "role", pre ? "prefill" : "serve", "index", i, "in_flight",
                                     (json_int_t)inflight));
        }
    }
    pthread_mutex_unlock(&r->mu);
    return send_err(r, c, 404, "not_found", "No replica %s in the router.", url);
}

enum MHD_Result rt_admin(rt *r, struct MHD_Connection *c, const char *method, const char *body,
                         size_t n_body, bool too_large) {
    if (!r->cfg.admin_key)
        return send_err(r, c, 404, "not_found", "%s",
                        "The admin API is off: start the router with --admin-key KEY.");
    if (!admin_authorized(r, c))
        return send_err(r, c, 401, NULL, "%s", "Invalid or missing admin key.");
    if (!strcmp(method, "GET")) return list(r, c);
    if (strcmp(method, "POST") && strcmp(method, "DELETE"))
        return send_err(r, c, 405, NULL, "Method %s is not allowed on /admin/replicas.", method);
    if (too_large) return send_err(r, c, 413, NULL, "%s", "The request body is too large.");
    json_error_t jerr;
    json_t *req = json_loadb(body ? body : "", n_body, JSON_REJECT_DUPLICATES, &jerr);
    const char *u = json_string_value(json_object_get(req, "url"));
    const json_t *role = json_object_get(req, "role");
    enum MHD_Result ret;
    char url[sizeof r->rep[0].url];
    if (!json_is_object(req) || !u) {
        ret = send_err(r, c, 400, NULL, "%s",
                       "The body must be a JSON object with \"url\": \"http://HOST:PORT\".");
    } else if (!rt_replica_url(u, url, sizeof url)) {
        ret = send_err(r, c, 400, NULL, "\"url\" must be http://HOST:PORT, got '%s'.", u);
    } else if (role && (!json_is_string(role) || (strcmp(json_string_value(role), "serve") &&
                                                  strcmp(json_string_value(role), "decode") &&
                                                  strcmp(json_string_value(role), "prefill")))) {
        ret = send_err(r, c, 400, NULL, "%s",
                       "\"role\" must be \"serve\" (or \"decode\") or \"prefill\".");
    } else if (!strcmp(method, "POST")) {
        ret = add(r, c, url, role && !strcmp(json_string_value(role), "prefill"));
    } else {
        ret = remove_replica(r, c, url);
    }
    json_decref(req);
    return ret;
}
