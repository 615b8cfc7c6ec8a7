/*
 * router — `deepinfer route`: a front process that spreads OpenAI Chat Completions / Completions /
 * Responses and Anthropic Messages requests over N `deepinfer serve` replicas (docs/router.md).
 *   main.c    arguments, wiring, signals, the per-replica health pollers (/ready, /metrics)
 *   proxy.c   the front's endpoints and the upstream transfers (libcurl): choice, failover,
 *             SSE pass-through, client-disconnect cancellation, the router's /metrics
 *   policy.c  routing key, consistent-hash ring, affine-or-least-loaded choice (no I/O)
 *   admin.c   the admin API (--admin-key): replicas added, removed and listed at run time
 * The HTTP front is tools/server's libmicrohttpd layer (srv_http_listen, one thread per
 * connection); error bodies use the server's shapes (srv_err_*).
 *
 * Threads: one per client connection (libmicrohttpd), one health poller per replica and the main
 * thread waiting for a signal. Replica state, the rings and the counters are guarded by rt.mu; the
 * configuration is immutable once the front listens. Replica slots are only ever appended (the
 * admin API; n_rep / n_pre grow after the slot is filled) and never freed before shutdown, so a
 * slot index and its url stay valid without the lock; a removed replica keeps its slot (and its
 * ring points, skipped as unusable) and may be added back.
 */
#pragma once

#include <curl/curl.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "router/policy.h"
#include "server/server.h" // sb, srv_err, srv_http, srv_send_*, srv_client_gone

#define RT_MAX_REPLICAS 64
// Idle upstream handles kept per replica: each holds a kept-alive connection, so a request does
// not pay a TCP connect and a new replica connection thread (about 2 ms on loopback).
#define RT_POOL 32
// Slots of each replica's table of prefixes sent (rt_seen: 2^17 hashes, 1 MiB) and the most
// chunks of a request's prompt matched (rt_chain; 64 KiB of canonical text at RT_CHUNK 256).
#define RT_SEEN_LOG2 17
#define RT_MAX_CHAIN 256

// What routes one request: its ring key (rt_prefix_key, hashed; pinned: its user's) and the chain
// hashes of its canonical prompt text (rt_chain, borrowed), matched against each replica's rt_seen.
typedef struct rt_route {
    bool has_key, pinned;
    uint64_t key;
    const uint64_t *chain;
    int n_chain;
} rt_route;

typedef struct rt_config {
    // The client side: host, port, api_key (NULL: clients need no key), max_body_bytes (bodies
    // over it: 413), timeout_s (idle connection), drain_s (SIGTERM: in-flight requests' wait).
    di_http_args http;
    const char *replica_api_key; // borrowed; NULL: the client's Authorization / x-api-key go up
    int health_interval_ms;      // poll period of /ready and /metrics
    int health_fails;            // failed polls in a row that take a replica out of rotation
    int connect_timeout_ms;      // upstream connect (and health poll) timeout
    int upstream_timeout_s;      // an upstream transfer receiving nothing this long is aborted
    size_t prefix_bytes;         // routing-key length (rt_prefix_key)
    size_t match_bytes;          // canonical text matched against the prefixes sent (0: off)
    int n_vnodes;                // ring points per replica
    int64_t max_imbalance;       // rt_policy_pick: overload margin, in requests
    bool pin_user;               // a request naming a user routes by it
    int max_connections;         // client connections at once
    size_t pd_min_bytes;         // PD mode: bodies shorter than this skip the prefill step
    int pd_min_new_tokens;  // PD mode: the decode replica holding all but fewer: no step (0: ask
                            // not)
    int prefill_timeout_ms; // PD mode: the prefill + KV import must finish within this
    const char *admin_key;  // borrowed; NULL: no admin API (its paths answer 404)
} rt_config;

typedef struct rt_replica {
    char url[256]; // "http://host:port", no trailing slash
    pthread_t poller;
    bool poller_started;
    // guarded by rt.mu
    bool removed;         // taken out by the admin API: never picked, not polled (re-addable)
    bool healthy;         // in rotation (never while removed)
    int n_fails_in_a_row; // failed /ready polls since the last good one
    int64_t n_inflight;   // requests the router has open on it
    int64_t n_waiting, n_running;
    double kv_usage;
    uint64_t n_requests, n_errors; // attempts sent; attempts failed (transport or 5xx)
    uint64_t n_match, n_affine, n_fallback, n_least; // decisions that chose it
    rt_seen seen;           // owned: the prefixes sent to it (cleared when it leaves rotation)
    CURLM *pool_m[RT_POOL]; // owned: idle multi handles, each with its easy one
    CURL *pool_e[RT_POOL];  // owned
    int n_pool;
} rt_replica;

typedef struct rt {
    rt_config cfg;
    rt_replica rep[RT_MAX_REPLICAS]; // the serving replicas (--replica / --decode, admin API)
    atomic_int n_rep;                // grows (under mu) once its new slot is filled
    // Prefill/decode disaggregation (docs/disaggregation.md): prefill replicas (--prefill); with
    // any, a generation request is first prefilled on one of them and its KV imported into the
    // decode replica chosen for it.
    rt_replica pre[RT_MAX_REPLICAS];
    atomic_int n_pre;
    rt_ring *ring;     // owned, guarded by mu: the serving (decode) replicas' (every slot's)
    rt_ring *pre_ring; // owned, guarded by mu: the prefill replicas' (NULL without any)
    long started_at;
    atomic_bool stop;
    atomic_int inflight; // client requests being proxied
    pthread_mutex_t mu;  // guards the rt_replica fields marked so and the counters below
    pthread_cond_t cv;   // signalled on stop (wakes the pollers)
    uint64_t n_retries, n_no_replica;
    uint64_t n_status[6]; // responses by class 1xx..5xx (index 1..5)
    // PD mode: requests that went through the prefill step (ok: the KV reached the decode
    // replica; fallback: the step failed and the decode replica computed the prompt itself),
    // that skipped it (short; cached: the decode replica held the prompt), blocks and bytes
    // moved, seconds in prefill and import calls.
    uint64_t n_pd_ok, n_pd_fallback, n_pd_short, n_pd_cached, n_pd_blocks, n_pd_bytes;
    double pd_prefill_s, pd_import_s;
} rt;

// proxy.c: the libmicrohttpd handler (srv_http_handler, cls = rt).
enum MHD_Result rt_handle(void *cls, struct MHD_Connection *c, const char *url, const char *method,
                          const char *body, size_t n_body, bool too_large);
// Prometheus text of the router's state. Caller frees with free().
char *rt_metrics_text(rt *r);
// Frees the idle upstream handles (at shutdown, no request running).
void rt_pool_free(rt *r);
// Counts a response of `status` in the router's /metrics. Locks rt.mu.
void rt_count_status(rt *r, int status);
// A replica failed at the transport level (connect error, reset): out of rotation until a poll
// finds it ready. Locks rt.mu.
void rt_replica_down(rt *r, int i, const char *why);

// main.c: starts the health poller of slot k of the serving (pre false) or prefill set. False
// (logged) if the thread cannot start. Call with rt.mu not held or held: it takes no lock.
bool rt_poller_start(rt *r, bool pre, int k);
// admin.c: GET / POST / DELETE /admin/replicas (docs/router.md, "Replicas at run time"): lists,
// adds (or restores) and removes replicas. The caller checked the path; the key is checked here.
enum MHD_Result rt_admin(rt *r, struct MHD_Connection *c, const char *method, const char *body,
                         size_t n_body, bool too_large);
