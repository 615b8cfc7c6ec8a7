#include "base/thread.h"

#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <time.h>
#include <unistd.h>

#include "base/log.h"
#include "base/mem.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define cpu_relax() _mm_pause()
#elif defined(__aarch64__)
#define cpu_relax() __asm__ __volatile__("yield")
#else
#define cpu_relax() ((void)0)
#endif

// Within a spin (DI_POOL_SPIN_NS, thread.h), sched_yield every this many polls, so that a spinning
// thread gives its core to a runnable one when there are more threads than cores.
#define POOL_YIELD_POLLS 64

struct di_pool {
    int n_threads;
    pthread_t *workers; // owned; n_threads - 1 entries
    // The job: fn, ctx and n_pending are written before generation is bumped, and read after
    // a load of the new generation.
    di_pool_fn fn;
    void *ctx;
    _Atomic uint64_t generation; // bumped for each job
    _Atomic int n_pending;       // workers still running the current job
    _Atomic bool stop;
    // Sleeping. A sleeper announces itself (n_sleeping, main_sleeping) under mu before it
    // re-checks its condition, and a waker checks the announcement after publishing; both are
    // sequentially consistent, so either the sleeper sees the new state or the waker sees the
    // sleeper and takes mu, which the sleeper holds until it waits: no wake-up is lost.
    pthread_mutex_t mu;
    pthread_cond_t cv_work;
    pthread_cond_t cv_done;
    _Atomic int n_sleeping;     // workers asleep (or about to be) on cv_work
    _Atomic bool main_sleeping; // the submitter asleep (or about to be) on cv_done
};

typedef struct worker_arg {
    di_pool *pool;
    int ith;
} worker_arg;

static int64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

// Polls until done(pool, arg) holds or DI_POOL_SPIN_NS have passed; returns whether it holds.
static bool spin_until(bool (*done)(di_pool *, uint64_t), di_pool *pool, uint64_t arg) {
    int64_t deadline = 0;
    for (unsigned polls = 1;; polls++) {
        if (done(pool, arg)) return true;
        if (polls % POOL_YIELD_POLLS == 0) {
            int64_t t = now_ns(); // not before the first yield: most waits end sooner
            if (deadline == 0) deadline = t + DI_POOL_SPIN_NS;
            if (t >= deadline) return false;
            sched_yield();
        } else {
            cpu_relax();
        }
    }
}

// The predicates' loads are sequentially consistent: the sleepers' re-checks need it (di_pool).
static bool job_posted(di_pool *pool, uint64_t seen) {
    return atomic_load(&pool->generation) != seen || atomic_load(&pool->stop);
}

static bool job_done(di_pool *pool, uint64_t unused) {
    (void)unused;
    return atomic_load(&pool->n_pending) == 0;
}

static void *worker_main(void *p) {
    worker_arg *wa = p;
    di_pool *pool = wa->pool;
    int ith = wa->ith;
    di_free(wa);
    uint64_t seen = 0;
    for (;;) {
        if (!spin_until(job_posted, pool, seen)) {
            pthread_mutex_lock(&pool->mu);
            atomic_fetch_add(&pool->n_sleeping, 1);
            while (!job_posted(pool, seen)) pthread_cond_wait(&pool->cv_work, &pool->mu);
            atomic_fetch_sub(&pool->n_sleeping, 1);
            pthread_mutex_unlock(&pool->mu);
        }
        if (atomic_load(&pool->stop)) return NULL;
        seen = atomic_load(&pool->generation);

        pool->fn(pool->ctx, ith, pool->n_threads);

        if (atomic_fetch_sub(&pool->n_pending, 1) == 1 && atomic_load(&pool->main_sleeping)) {
            pthread_mutex_lock(&pool->mu);
            pthread_cond_signal(&pool->cv_done);
            pthread_mutex_unlock(&pool->mu);
        }
    }
}

di_status di_pool_create(int n_threads, di_pool **out) {
    if (n_threads < 0) return DI_ERR_INVALID;
    if (n_threads == 0) {
        long n = sysconf(_SC_NPROCESSORS_ONLN);
        n_threads = n > 0 ? (int)n : 1;
    }
    di_pool *pool = di_calloc(1, sizeof *pool);
    if (!pool) return DI_ERR_NOMEM;
    pool->n_threads = n_threads;
    pthread_mutex_init(&pool->mu, NULL);
    pthread_cond_init(&pool->cv_work, NULL);
    pthread_cond_init(&pool->cv_done, NULL);
    if (n_threads > 1) {
        pool->workers = di_calloc((size_t)n_threads - 1, sizeof *pool->workers);
        if (!pool->workers) goto fail;
        for (int i = 1; i < n_threads; i++) {
            worker_arg *wa = di_malloc(sizeof *wa);
            if (!wa) goto fail_threads;
            wa->pool = pool;
            wa->ith = i;
            if (pthread_create(&pool->workers[i - 1], NULL, worker_main, wa) != 0) {
                di_free(wa);
                DI_LOG_ERROR("thread pool: cannot create worker %d of %d", i, n_threads);
                pool->n_threads = i; // join only the ones that exist
                goto fail_threads;
            }
        }
    }
    *out = pool;
    return DI_OK;
fail_threads:
    di_pool_destroy(pool);
    return DI_ERR_INVALID;
fail:
    di_free(pool);
    return DI_ERR_NOMEM;
}

void di_pool_destroy(di_pool *pool) {
    if (!pool) return;
    atomic_store(&pool->stop, true);
    pthread_mutex_lock(&pool->mu);
    pthread_cond_broadcast(&pool->cv_work);
    pthread_mutex_unlock(&pool->mu);
    for (int i = 1; i < pool->n_threads; i++) pthread_join(pool->workers[i - 1], NULL);
    pthread_mutex_destroy(&pool->mu);
    pthread_cond_destroy(&pool->cv_work);
    pthread_cond_destroy(&pool->cv_done);
    di_free(pool->workers);
    di_free(pool);
}

int di_pool_n_threads(const di_pool *pool) {
    return pool ? pool->n_threads : 1;
}

void di_pool_run(di_pool *pool, di_pool_fn fn, void *ctx) {
    if (!pool || pool->n_threads == 1) {
        fn(ctx, 0, 1);
        return;
    }
    pool->fn = fn;
    pool->ctx = ctx;
    atomic_store_explicit(&pool->n_pending, pool->n_threads - 1, memory_order_relaxed);
    atomic_fetch_add(&pool->generation, 1); // publishes fn, ctx and n_pending
    if (atomic_load(&pool->n_sleeping) > 0) {
        pthread_mutex_lock(&pool->mu);
        pthread_cond_broadcast(&pool->cv_work);
        pthread_mutex_unlock(&pool->mu);
    }

    fn(ctx, 0, pool->n_threads);

    if (!spin_until(job_done, pool, 0)) {
        pthread_mutex_lock(&pool->mu);
        atomic_store(&pool->main_sleeping, true);
        while (!job_done(pool, 0)) pthread_cond_wait(&pool->cv_done, &pool->mu);
        atomic_store(&pool->main_sleeping, false);
        pthread_mutex_unlock(&pool->mu);
    }
}

void di_split_range(int64_t n, int ith, int nth, int64_t *lo, int64_t *hi) {
    int64_t base = n / nth, rem = n % nth;
    *lo = ith * base + (ith < rem ? ith : rem);
    *hi = *lo + base + (ith < rem ? 1 : 0);
}
