/*
 * request — one generation request inside the engine: its tokens (prompt, then generated), its
 * sampling and stop parameters, and its progress through the KV state. Created by
 * di_engine_submit (copies everything the caller passed), owned by the engine afterwards.
 *
 * Thread-safety: fields are engine-thread only, except `cancelled` (atomic, any thread).
 */
#pragma once

#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>

#include "deepinfer.h"
#include "grammar/grammar.h" // di_grammar_matcher
#include "sample/stop.h"     // di_stop

enum { DI_MASK_NONE, DI_MASK_BUSY, DI_MASK_READY, DI_MASK_USED }; // di_request.g_mask_state

typedef struct di_request di_request;
struct di_request {
    uint64_t id;
    uint64_t arrival; // submission order: FCFS admission, newest preempted first
    int32_t priority; // lower first (di_request_params.priority)
    uint64_t tenant;  // fair-share key (di_request_params.tenant)
    // Scheduling (scheduler.h): when it first entered the waiting queue (the scheduler's now_ms;
    // kept across preemptions, so it ages from its submission), the effective priority it was
    // admitted with (its place in the running order), its tenant's entry in the scheduler's
    // table, and the positions charged to that tenant's virtual token counter so far (the
    // prompt once, each generated token once, however often it is recomputed).
    int64_t enqueue_ms;
    int32_t run_priority;
    int32_t tenant_idx;
    int32_t n_charged;
    int32_t *tokens; // owned [n_prompt + max_tokens]: prompt, then generated tokens
    int32_t n_prompt, n_gen, max_tokens;
    di_sample_params sample; // logit_bias points at `bias`
    di_logit_bias *bias;     // owned [sample.n_logit_bias]
    int32_t stop_ids[DI_MAX_STOP];
    int32_t n_stop_ids;
    bool ignore_eos;
    di_stop stop; // owned stop strings and held bytes
    uint64_t salt;
    int32_t snap_at[DI_MAX_SNAP_AT]; // requested snapshot points (token offsets, non-decreasing)
    int32_t n_snap_at;
    float *first_logits; // borrowed (caller's buffer) or NULL
    di_event_fn on_event;
    void *user;
    atomic_bool cancelled;
    // Structured output (NULL gm: none). The matcher and mask are made at submit; the step path
    // (sample_task on a pool thread, one row per request) only computes masks and advances.
    const di_grammar *grammar; // owned reference (di_grammar_retain)
    di_grammar_matcher *gm;    // owned
    uint64_t *g_mask;          // owned [(n_vocab + 63) / 64]: this step's allowed tokens
    int32_t grammar_after;     // -1: active from the first token
    bool g_active;             // the constraint applies to the next token
    di_status g_status;        // DI_OK, or why the constraint failed (set by sample_task)
    // This step's mask (engine.c, "masks ahead"): DI_MASK_NONE (set at launch) until one thread
    // claims it (DI_MASK_BUSY: the engine thread during the forward, or the sampling thread),
    // DI_MASK_READY with g_mask, g_mask_allowed and g_mask_status once computed, DI_MASK_USED
    // once sampled.
    atomic_int g_mask_state;
    int32_t g_mask_allowed; // tokens the mask allows
    di_status g_mask_status;

    // Progress (engine thread).
    int32_t slot;   // KV slot while running, -1 otherwise
    int32_t n_done; // positions whose state is computed: tokens[0, n_done)
    int32_t win_lo; // first position with a window row (bounded replay), 0 otherwise
    // The hit a bounded replay (win_lo > 0) rebuilds the state of: below it the state is not
    // exact, so no snapshot is taken there. 0 otherwise. Set at admission.
    int32_t replay_end;
    int32_t n_cached, n_replayed, n_computed, n_preempted;
    int32_t n_pending; // 1 while the step in flight samples its next token, else 0
    // Waiting for its disk-tier prefetch (docs/kv-cache.md, "Disk tier"): skipped by this plan's
    // admission; since when it waits (CLOCK_MONOTONIC microseconds; 0: it does not).
    bool disk_skip;
    int64_t disk_wait_since_us;
    di_request *next;     // waiting-queue link
    di_request *all_next; // engine's list of live requests (guarded by the engine mutex)
};

// Tokens known so far (prompt + generated).
static inline int32_t di_request_n_tokens(const di_request *r) {
    return r->n_prompt + r->n_gen;
}

// Tokens known once the step in flight is sampled: the plan of the next step counts the token
// being sampled (its id is filled in by di_sched_finalize).
static inline int32_t di_request_n_planned(const di_request *r) {
    return r->n_prompt + r->n_gen + r->n_pending;
}

// Copies p into a new request. DI_ERR_INVALID (logged), DI_ERR_NOMEM. Free with
// di_request_destroy.
// gvocab: the engine's grammar vocabulary (NULL: requests with a grammar are refused); glim: the
// matcher's limits (NULL: the defaults).
di_status di_request_create(const di_request_params *p, int32_t n_vocab, int32_t max_ctx,
                            bool have_token_bytes, const di_grammar_vocab *gvocab,
                            const di_grammar_matcher_limits *glim, di_request **out);
void di_request_destroy(di_request *r);
