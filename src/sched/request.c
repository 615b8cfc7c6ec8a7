// request — validation and copying of a request at the engine's boundary (see request.h).
#include "sched/request.h"

#include <string.h>

#include "base/log.h"
#include "base/mem.h"
#include "sample/sampler.h" // di_sample_params_check

di_request_params di_request_params_default(void) {
    di_request_params p = {
        .sample = di_sample_params_default(), .max_tokens = 16, .grammar_after = -1};
    return p;
}

di_status di_request_create(const di_request_params *p, int32_t n_vocab, int32_t max_ctx,
                            bool have_token_bytes, const di_grammar_vocab *gvocab,
                            const di_grammar_matcher_limits *glim, di_request **out) {
    const char *why = NULL;
    if (!p->prompt || p->n_prompt < 1)
        why = "the prompt is empty";
    else if (p->max_tokens < 1)
        why = "max_tokens must be >= 1";
    else if ((int64_t)p->n_prompt + p->max_tokens > max_ctx)
        why = "prompt + max_tokens exceed the context";
    else if (!p->on_event)
        why = "on_event is required";
    else if (p->n_stop_ids < 0 || p->n_stop_ids > DI_MAX_STOP || (p->n_stop_ids && !p->stop_ids))
        why = "bad stop_ids";
    else if (p->n_stop_strings < 0 || p->n_stop_strings > DI_MAX_STOP)
        why = "too many stop strings";
    else if (p->n_stop_strings > 0 && !have_token_bytes)
        why = "stop strings need the engine's token_bytes";
    else if (p->grammar && !gvocab)
        why = "a grammar needs the engine's grammar_vocab";
    else if (p->grammar && (p->grammar_after < -1 || p->grammar_after >= n_vocab))
        why = "grammar_after must be -1 or a token id";
    else if (p->priority < DI_PRIORITY_MIN || p->priority > DI_PRIORITY_MAX)
        why = "priority is outside [DI_PRIORITY_MIN, DI_PRIORITY_MAX]";
    else if (p->n_snap_at < 0 || p->n_snap_at > DI_MAX_SNAP_AT || (p->n_snap_at && !p->snap_at))
        why = "snap_at takes at most DI_MAX_SNAP_AT (4) points";
    for (int32_t i = 0; !why && i < p->n_snap_at; i++)
        if (p->snap_at[i] < 1 || p->snap_at[i] > p->n_prompt ||
            (i > 0 && p->snap_at[i] < p->snap_at[i - 1]))
            why = "snap_at must be non-decreasing token offsets in 1 .. n_prompt";
    for (int32_t i = 0; !why && i < p->n_prompt; i++)
        if (p->prompt[i] < 0 || p->prompt[i] >= n_vocab)
            why = "a prompt token is outside the vocabulary";
    for (int32_t i = 0; !why && i < p->n_stop_ids; i++)
        if (p->stop_ids[i] < 0 || p->stop_ids[i] >= n_vocab)
            why = "a stop id is outside the vocabulary";
    if (why) {
        DI_LOG_ERROR("request: %s", why);
        return DI_ERR_INVALID;
    }
    if (di_sample_params_check(&p->sample, n_vocab) != DI_OK) return DI_ERR_INVALID;
    di_request *r = di_calloc(1, sizeof *r);
    if (!r) return DI_ERR_NOMEM;
    r->tokens = di_malloc(sizeof(int32_t) * (size_t)(p->n_prompt + p->max_tokens));
    r->bias = di_malloc(sizeof(di_logit_bias) * (size_t)(p->sample.n_logit_bias + 1));
    if (!r->tokens || !r->bias) {
        di_request_destroy(r);
        return DI_ERR_NOMEM;
    }
    di_status st = di_stop_init(&r->stop, p->stop_strings, p->n_stop_strings);
    if (st != DI_OK) {
        if (st == DI_ERR_INVALID) DI_LOG_ERROR("request: a stop string is empty or too long");
        di_request_destroy(r);
        return st;
    }
    memcpy(r->tokens, p->prompt, sizeof(int32_t) * (size_t)p->n_prompt);
    r->n_prompt = p->n_prompt;
    r->max_tokens = p->max_tokens;
    r->sample = p->sample;
    if (p->sample.n_logit_bias)
        memcpy(r->bias, p->sample.logit_bias,
               sizeof(di_logit_bias) * (size_t)p->sample.n_logit_bias);
    r->sample.logit_bias = r->bias;
    if (p->n_stop_ids) memcpy(r->stop_ids, p->stop_ids, sizeof(int32_t) * (size_t)p->n_stop_ids);
    r->n_stop_ids = p->n_stop_ids;
    if (p->n_snap_at) memcpy(r->snap_at, p->snap_at, sizeof(int32_t) * (size_t)p->n_snap_at);
    r->n_snap_at = p->n_snap_at;
    r->ignore_eos = p->ignore_eos;
    r->salt = p->cache_salt;
    r->priority = p->priority;
    r->tenant = p->tenant;
    r->first_logits = p->first_logits;
    r->on_event = p->on_event;
    r->user = p->user;
    r->slot = -1;
    atomic_init(&r->cancelled, false);
    r->grammar_after = p->grammar ? p->grammar_after : -1;
    if (p->grammar) {
        r->grammar = di_grammar_retain(p->grammar);
        const int32_t nv = n_vocab > di_grammar_vocab_n_tokens(gvocab)
                               ? n_vocab
                               : di_grammar_vocab_n_tokens(gvocab);
        const int32_t words = (nv + 63) / 64;
        r->g_mask = di_calloc((size_t)words, sizeof(uint64_t));
        st = r->g_mask ? di_grammar_matcher_create(p->grammar, gvocab, glim, &r->gm) : DI_ERR_NOMEM;
        if (st != DI_OK) {
            if (st == DI_ERR_UNSUPPORTED)
                DI_LOG_ERROR("request: the grammar's start state exceeds the matcher's limits");
            di_request_destroy(r);
            return st == DI_ERR_UNSUPPORTED ? DI_ERR_INVALID : st;
        }
        r->g_active = p->grammar_after < 0;
    }
    *out = r;
    return DI_OK;
}

void di_request_destroy(di_request *r) {
    if (!r) return;
    di_stop_deinit(&r->stop);
    di_grammar_matcher_destroy(r->gm);
    di_free(r->g_mask);
    di_grammar_destroy((di_grammar *)r->grammar); // drops the request's reference
    di_free(r->tokens);
    di_free(r->bias);
    di_free(r);
}
