/*
 * scheduler — decides each step's ragged batch. Policy, in order:
 *   1. running requests in decode (one known token left to feed) get one row each, first;
 *   2. running requests still in prefill (or in a bounded replay) get chunks of what is left of
 *      the token budget, oldest first;
 *   3. waiting requests are admitted first-come first-served while a KV slot, budget and blocks
 *      for their first chunk are free; admission attaches the longest cached prefix and starts a
 *      bounded replay before it (docs/kv-cache.md).
 * When a running request needs a block and none is left, the newest running request is
 * preempted (its blocks are returned; it goes back to the head of the waiting queue and later
 * recomputes its prompt and generated tokens, usually from the prefix cache), so the oldest
 * requests always progress: no starvation. Plans are built in arrays sized at init.
 *
 * Owns: the running array, the waiting queue links and the plan arrays; requests are borrowed
 * (the engine creates and destroys them). Thread-safety: engine thread only.
 */
#pragma once

#include <stdint.h>

#include "kv/kv_manager.h"  // di_kv_manager
#include "model/dsv4.h"     // di_dsv4_seq
#include "sched/request.h"  // di_request

typedef struct di_sched {
    di_kv_manager *kv;          // borrowed
    int32_t max_seqs, max_batch_tokens;
    di_request **running;       // owned [max_seqs], arrival order
    int32_t n_running;
    di_request *wait_head, *wait_tail;
    int32_t n_waiting;
    int32_t *free_slots;        // owned [max_seqs]
    int32_t n_free_slots;
    // The plan of the current step.
    di_dsv4_seq *seqs;          // owned [max_seqs]
    di_request **seq_req;       // owned [max_seqs]
    int32_t n_seq, n_rows;
    int32_t *tokens;            // owned [max_batch_tokens]
    int32_t *logit_rows;        // owned [max_seqs]: rows whose logits sample a token
    di_request **logit_req;     // owned [max_seqs]
    int32_t n_logit;
    int64_t n_preemptions, n_prefill_rows, n_decode_rows, n_cache_hit_tokens, n_replayed_tokens;
} di_sched;

// DI_ERR_INVALID (max_batch_tokens < max_seqs), DI_ERR_NOMEM.
di_status di_sched_init(di_sched *s, di_kv_manager *kv, int32_t max_seqs, int32_t max_batch_tokens);
void di_sched_deinit(di_sched *s);
// Appends a new request to the waiting queue.
void di_sched_enqueue(di_sched *s, di_request *r);
// Takes a request out (finished, cancelled or failed): returns its blocks.
void di_sched_remove(di_sched *s, di_request *r);
// Builds the plan (seqs, tokens, logit rows). n_seq == 0 when nothing can run.
void di_sched_step(di_sched *s);
// After the forward: advances every planned request and publishes its full blocks.
void di_sched_advance(di_sched *s);
