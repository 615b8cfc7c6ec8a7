/*
 * thread — the persistent thread pool every CPU kernel runs on.
 *
 * A pool of n threads (the caller counts as thread 0, so n-1 workers are created once). Work is a
 * function called on every thread with (ith, nth); each call partitions its range statically with
 * di_split_range, so results never depend on timing. di_pool_run returns when all threads are done.
 *
 * Waiting threads (workers between jobs, the submitter for the workers) poll for DI_POOL_SPIN_NS
 * before they sleep on a condition variable: a forward submits a job every few microseconds, and
 * waking a sleeping thread costs 10-100 us on a virtual machine (futex wake-up of an idle vCPU),
 * which made a 2-thread decode of a small model slower than 1 thread. Between steps or requests
 * every thread is asleep after DI_POOL_SPIN_NS. The polls yield the core now and then, so more
 * threads than cores (or other processes) still make progress.
 *
 * Owns: its worker threads. Does not: queue work, nest (a task must not call di_pool_run).
 * Thread-safety: one thread at a time submits to a pool (the engine's forward thread).
 */
#pragma once

#include <stdint.h>

#include "deepinfer.h" // di_status

// How long a waiting thread polls before it sleeps (ns).
#define DI_POOL_SPIN_NS 200000

typedef struct di_pool di_pool;
typedef void (*di_pool_fn)(void *ctx, int ith, int nth);

// Creates a pool of n_threads (>= 1; 0 means one per online CPU). Returns DI_ERR_NOMEM or
// DI_ERR_INVALID when threads cannot be created.
di_status di_pool_create(int n_threads, di_pool **out);
// Stops and joins the workers. NULL does nothing.
void di_pool_destroy(di_pool *pool);
int di_pool_n_threads(const di_pool *pool);
// Calls fn(ctx, ith, nth) for ith in [0, nth) concurrently and waits for all of them.
// pool may be NULL: then fn runs once on the caller with nth = 1.
void di_pool_run(di_pool *pool, di_pool_fn fn, void *ctx);
// Static partition of [0, n) into nth nearly equal parts; part ith is [*lo, *hi).
void di_split_range(int64_t n, int ith, int nth, int64_t *lo, int64_t *hi);
