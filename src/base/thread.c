#include "base/thread.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <unistd.h>

#include "base/log.h"
#include "base/mem.h"

struct di_pool {
    int n_threads;
    pthread_t *workers; // owned; n_threads - 1 entries
    pthread_mutex_t mu;
    pthread_cond_t cv_work;
    pthread_cond_t cv_done;
    uint64_t generation; // bumped for each job; guarded by mu
    int n_pending;       // workers still running the current job; guarded by mu
    bool stop;
    di_pool_fn fn;
    void *ctx;
};

typedef struct worker_arg {
    di_pool *pool;
    int ith;
} worker_arg;

static void *worker_main(void *p) {
    worker_arg *wa = p;
    di_pool *pool = wa->pool;
    int ith = wa->ith;
    di_free(wa);
    uint64_t seen = 0;
    for (;;) {
        pthread_mutex_lock(&pool->mu);
        while (!pool->stop && pool->generation == seen)
            pthread_cond_wait(&pool->cv_work, &pool->mu);
        if (pool->stop) {
            pthread_mutex_unlock(&pool->mu);
            return NULL;
        }
        seen = pool->generation;
        di_pool_fn fn = pool->fn;
        void *ctx = pool->ctx;
        pthread_mutex_unlock(&pool->mu);

        fn(ctx, ith, pool->n_threads);

        pthread_mutex_lock(&pool->mu);
        if (--pool->n_pending == 0) pthread_cond_signal(&pool->cv_done);
        pthread_mutex_unlock(&pool->mu);
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
    pthread_mutex_lock(&pool->mu);
    pool->stop = true;
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
    pthread_mutex_lock(&pool->mu);
    pool->fn = fn;
    pool->ctx = ctx;
    pool->n_pending = pool->n_threads - 1;
    pool->generation++;
    pthread_cond_broadcast(&pool->cv_work);
    pthread_mutex_unlock(&pool->mu);

    fn(ctx, 0, pool->n_threads);

    pthread_mutex_lock(&pool->mu);
    while (pool->n_pending > 0) pthread_cond_wait(&pool->cv_done, &pool->mu);
    pthread_mutex_unlock(&pool->mu);
}

void di_split_range(int64_t n, int ith, int nth, int64_t *lo, int64_t *hi) {
    int64_t base = n / nth, rem = n % nth;
    *lo = ith * base + (ith < rem ? ith : rem);
    *hi = *lo + base + (ith < rem ? 1 : 0);
}
