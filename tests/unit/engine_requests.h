/*
 * engine_requests — the request set and result capture shared by the engine tests that compare two
 * engines' outputs bit for bit (test_engine_dev.c, test_engine_v41.c): N_REQ prompts of g_len
 * tokens (the includer fills g_prompt), greedy requests and seeded sampling on odd ones, every
 * request asking N_TOP logprobs and its first-token logits; a result keeps the tokens, logprobs,
 * top logprobs, first logits and the final event, and can cancel its request after cancel_after
 * tokens; run() submits requests [from, to). Header-only (static): the includer includes harness.h
 * and defines V, N_REQ (6), MAX_GEN and N_TOP first.
 */
#pragma once

#include <stdatomic.h>
#include <string.h>

#include "deepinfer.h"

static int32_t g_prompt[N_REQ][160];
static const int32_t g_len[N_REQ] = {150, 5, 121, 40, 140, 90};

typedef struct result {
    di_engine *cancel_engine; // cancel the request after cancel_after tokens (NULL: never)
    uint64_t id;              // where a test submits it
    int32_t cancel_after;
    int32_t tokens[64];
    float logprob[64], top[64][N_TOP];
    float first[V]; // the logits that chose token 0
    int32_t n;
    atomic_int finished; // final events
    di_finish finish;
    di_status status;
    int32_t n_preempted, n_cached, n_replayed;
} result;

static void on_event(void *user, const di_event *ev) {
    result *r = user;
    if (ev->token >= 0 && r->n < 64) {
        r->tokens[r->n] = ev->token;
        r->logprob[r->n] = ev->logprob;
        for (int k = 0; k < ev->n_top && k < N_TOP; k++) r->top[r->n][k] = ev->top_logprobs[k];
        r->n++;
        if (r->cancel_engine && r->n == r->cancel_after) // allowed from a callback
            di_engine_cancel(r->cancel_engine, ev->request_id);
    }
    if (ev->finish != DI_FINISH_NONE) {
        r->finish = ev->finish;
        r->status = ev->status;
        r->n_preempted = ev->n_preempted;
        r->n_cached = ev->n_cached;
        r->n_replayed = ev->n_replayed;
        atomic_fetch_add(&r->finished, 1);
    }
}

static di_request_params request(int i, result *res) {
    di_request_params p = di_request_params_default();
    p.prompt = g_prompt[i];
    p.n_prompt = g_len[i];
    p.max_tokens = MAX_GEN - 2 * (i % 3);
    p.ignore_eos = true;
    p.sample.n_logprobs = N_TOP;
    if (i % 2) { // seeded sampling on odd requests: keyed by (seed, position), so it must match
        p.sample.temperature = 0.8f;
        p.sample.top_k = 40;
        p.sample.seed = 77 + (uint64_t)i;
    }
    p.first_logits = res->first;
    p.on_event = on_event;
    p.user = res;
    return p;
}

static bool same(const result *a, const result *b) {
    return a->n == b->n && !memcmp(a->tokens, b->tokens, sizeof(int32_t) * (size_t)a->n) &&
           !memcmp(a->logprob, b->logprob, sizeof(float) * (size_t)a->n) &&
           !memcmp(a->top, b->top, sizeof(a->top[0]) * (size_t)a->n) &&
           !memcmp(a->first, b->first, sizeof a->first);
}

// Submits requests [from, to) into res[from..to) (cleared first).
static void run(di_engine *e, result *res, int from, int to) {
    for (int i = from; i < to; i++) {
        memset(&res[i], 0, sizeof res[i]);
        uint64_t id;
        di_request_params p = request(i, &res[i]);
        CHECK_EQ(di_engine_submit(e, &p, &id), DI_OK);
    }
}
