/*
 * cp_common — what the two context-parallel tests (test_cp.c: V4, test_cp41.c: V4.1) share:
 * in-process cp-workers on 127.0.0.1, each with its own copy of the model, and the serving-engine
 * scenario (requests with and without workers must give the same tokens and logprobs; a worker
 * down ends the step's requests with DI_ERR_IO and the engine goes on). Header-only (static): the
 * includer includes harness.h and defines V (the vocabulary) first.
 */
#pragma once

#include <stdatomic.h>
#include <stdio.h>
#include <string.h>

#include "cp/cp.h"
#include "cp/worker.h"
#include "deepinfer.h"
#include "engine/engine_internal.h" // di_engine_create_prepared: the engine's model

enum { CP_MAX_W = 3 };

static di_model *cp_load(const char *dir, di_precision prec, const char *addrs, int32_t min_tok) {
    di_model_options o = di_model_options_default();
    o.n_threads = 1;
    o.precision = prec;
    o.cp_workers = addrs;
    o.cp_min_tokens = min_tok;
    di_model *m = NULL;
    return di_model_load(dir, &o, &m) == DI_OK ? m : NULL;
}

// n workers, each with its own copy of the model in dir, on free ports; their list in addrs and
// the first one's alone in first.
typedef struct workers {
    di_model *m[CP_MAX_W];
    di_cp_worker *w[CP_MAX_W];
    int n;
    char addrs[256], first[64];
} workers;

static bool start(workers *ws, const char *dir, di_precision prec, int n) {
    memset(ws, 0, sizeof *ws);
    ws->n = n;
    size_t off = 0;
    for (int i = 0; i < n; i++) {
        if (!(ws->m[i] = cp_load(dir, prec, NULL, 0))) return false;
        if (di_cp_worker_start(ws->m[i], "127.0.0.1", 0, &ws->w[i]) != DI_OK) return false;
        off += (size_t)snprintf(ws->addrs + off, sizeof ws->addrs - off, "%s127.0.0.1:%d",
                                i ? "," : "", di_cp_worker_port(ws->w[i]));
    }
    snprintf(ws->first, sizeof ws->first, "127.0.0.1:%d", di_cp_worker_port(ws->w[0]));
    return true;
}

static void stop(workers *ws) {
    for (int i = 0; i < ws->n; i++) {
        di_cp_worker_stop(ws->w[i]);
        di_model_destroy(ws->m[i]);
    }
}

static int32_t tok(int t) {
    return (int32_t)((t * 131 + 7) % V);
}

// ---- the serving engine ----

enum { E_REQ = 4, E_GEN = 6, E_IDS = 400 };

typedef struct eres {
    int32_t tokens[E_GEN];
    float logprob[E_GEN], top[E_GEN][2];
    int32_t n, n_cached;
    atomic_int finished;
    di_status status;
} eres;

static void on_event(void *user, const di_event *ev) {
    eres *r = user;
    if (ev->token >= 0 && r->n < E_GEN) {
        r->tokens[r->n] = ev->token;
        r->logprob[r->n] = ev->logprob;
        for (int k = 0; k < ev->n_top && k < 2; k++) r->top[r->n][k] = ev->top_logprobs[k];
        r->n++;
    }
    if (ev->finish != DI_FINISH_NONE) {
        r->status = ev->status;
        r->n_cached = ev->n_cached;
        atomic_fetch_add(&r->finished, 1);
    }
}

// The request ids: tok(0 .. E_IDS).
static const int32_t *engine_ids(void) {
    static int32_t ids[E_IDS];
    for (int t = 0; t < E_IDS; t++) ids[t] = tok(t);
    return ids;
}

static void submit(di_engine *e, const int32_t *ids, int n, bool sample, eres *r) {
    memset(r, 0, sizeof *r);
    di_request_params p = di_request_params_default();
    p.prompt = ids;
    p.n_prompt = n;
    p.max_tokens = E_GEN;
    p.ignore_eos = true;
    p.sample.n_logprobs = 2;
    if (sample) {
        p.sample.temperature = 0.8f;
        p.sample.seed = 5;
    }
    p.on_event = on_event;
    p.user = r;
    uint64_t id;
    CHECK_EQ(di_engine_submit(e, &p, &id), DI_OK);
}

// b finished exactly as a did.
static bool eres_same(const eres *a, const eres *b) {
    return atomic_load(&b->finished) == 1 && b->status == DI_OK && b->n == a->n &&
           !memcmp(b->tokens, a->tokens, sizeof a->tokens) &&
           !memcmp(b->logprob, a->logprob, sizeof a->logprob) &&
           !memcmp(b->top, a->top, sizeof a->top);
}

static di_engine_options engine_options(const char *addrs, int32_t min_tokens, int spec,
                                        bool no_tail) {
    di_engine_options o = di_engine_options_default();
    o.n_threads = 1;
    o.max_ctx = 512;
    o.max_batch_tokens = 256;
    o.kv_memory_bytes = 32u << 20;
    o.cp_workers = addrs;
    o.cp_min_tokens = min_tokens;
    o.spec_tokens = spec;
    o.no_tail_cache = no_tail;
    return o;
}

static di_status grab_model(di_model *m, void *user) {
    *(di_model **)user = m;
    return DI_OK;
}

// On the checkpoint in dir: request 0 (200 tokens) alone; then request 1 (the same 200 tokens and
// 180 more: a prefix hit, then a long chunk after it), 2 (100 tokens, sampled without
// speculation) and 3 (20 tokens, below the threshold) in the same steps. With workers, chunks of
// at least min_tokens rows run over them; *cp_calls: the calls that did.
static void engine_run(const char *dir, const char *addrs, int32_t min_tokens, int spec,
                       bool no_tail, eres *out, int64_t *cp_calls) {
    const int32_t *ids = engine_ids();
    di_engine_options o = engine_options(addrs, min_tokens, spec, no_tail);
    di_engine *e = NULL;
    di_model *m = NULL;
    CHECK_EQ(di_engine_create_prepared(dir, &o, grab_model, &m, &e), DI_OK);
    submit(e, ids, 200, false, &out[0]);
    di_engine_wait_idle(e);
    submit(e, ids, 380, false, &out[1]);
    submit(e, ids + 5, 100, spec == 0, &out[2]);
    submit(e, ids + 50, 20, false, &out[3]);
    di_engine_wait_idle(e);
    di_cp_stats cs;
    *cp_calls = di_model_cp_stats(m, &cs) ? cs.calls - cs.errors : 0;
    di_engine_destroy(e);
}

// Engine e (created over ws's first worker alone, min_tokens 64) with that worker down: the step
// of a long request ends it with DI_ERR_IO, the engine goes on (a short request, below the
// threshold, is exact: a[3]), and with the worker back on its port the next long chunk reconnects
// and is exact again (a[0]). a: engine_run's requests without workers.
static void engine_worker_down(di_engine *e, workers *ws, const eres *a) {
    const int32_t *ids = engine_ids();
    const int port = di_cp_worker_port(ws->w[0]);
    di_cp_worker_stop(ws->w[0]);
    eres d[2];
    submit(e, ids, 200, false, &d[0]);
    di_engine_wait_idle(e);
    CHECK(atomic_load(&d[0].finished) == 1 && d[0].status == DI_ERR_IO);
    submit(e, ids + 50, 20, false, &d[1]);
    di_engine_wait_idle(e);
    CHECK(eres_same(&a[3], &d[1]));
    CHECK_EQ(di_cp_worker_start(ws->m[0], "127.0.0.1", port, &ws->w[0]), DI_OK);
    submit(e, ids, 200, false, &d[0]);
    di_engine_wait_idle(e);
    CHECK(eres_same(&a[0], &d[0]));
}
