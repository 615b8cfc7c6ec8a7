/*
 * engine_prompt — one prompt at a time, for the engine tests that compare a run whose prefix comes
 * from elsewhere (disk, a transfer) with the run of an engine without any cache
 * (test_engine_disk.c, test_engine_transfer.c): a result keeps the tokens, logprobs, top logprobs
 * and the final event's n_cached; engine_options() are the options of a small chunked-prefill
 * engine with the prefix cache on; run() runs a prompt to completion, greedy or seeded. Header-only
 * (static): the includer includes harness.h and defines N_TOP, MAX_GEN and N_CTX first.
 */
#pragma once

#include <string.h>

#include "deepinfer.h"

typedef struct result {
    int32_t tokens[MAX_GEN];
    float logprob[MAX_GEN], top[MAX_GEN][N_TOP];
    int32_t n, n_cached, n_replayed;
} result;

static void on_event(void *user, const di_event *ev) {
    result *r = user;
    if (ev->token >= 0 && r->n < MAX_GEN) {
        r->tokens[r->n] = ev->token;
        r->logprob[r->n] = ev->logprob;
        for (int k = 0; k < ev->n_top && k < N_TOP; k++) r->top[r->n][k] = ev->top_logprobs[k];
        r->n++;
    }
    if (ev->finish != DI_FINISH_NONE) r->n_cached = ev->n_cached, r->n_replayed = ev->n_replayed;
}

static bool same(const result *a, const result *b) {
    return a->n == b->n && !memcmp(a->tokens, b->tokens, sizeof a->tokens) &&
           !memcmp(a->logprob, b->logprob, sizeof a->logprob) &&
           !memcmp(a->top, b->top, sizeof a->top);
}

static di_engine_options engine_options(size_t kv_bytes) {
    di_engine_options o = di_engine_options_default();
    o.n_threads = 2;
    o.kv_memory_bytes = kv_bytes;
    o.max_seqs = 4;
    o.max_batch_tokens = 64; // chunked prefill
    o.max_ctx = N_CTX;
    o.no_prefix_cache = false;
    return o;
}

// Runs prompt[0..n) to completion: greedy (seeded = false) or seeded sampling, with logprobs.
static void run(di_engine *e, const int32_t *prompt, int32_t n, bool seeded, int max_gen,
                result *r) {
    memset(r, 0, sizeof *r);
    di_request_params p = di_request_params_default();
    p.prompt = prompt;
    p.n_prompt = n;
    p.max_tokens = max_gen;
    p.ignore_eos = true;
    p.sample.n_logprobs = N_TOP;
    if (seeded) {
        p.sample.temperature = 0.9f;
        p.sample.top_k = 40;
        p.sample.seed = 4242;
    }
    p.on_event = on_event;
    p.user = r;
    uint64_t id;
    CHECK_EQ(di_engine_submit(e, &p, &id), DI_OK);
    di_engine_wait_idle(e);
    CHECK_EQ(r->n, max_gen);
}
