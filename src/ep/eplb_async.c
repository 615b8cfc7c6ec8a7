// eplb_async — the online EPLB planner thread (see eplb_async.h).
#include "ep/eplb_async.h"

#include <pthread.h>
#include <string.h>
#include <time.h>

#include "base/log.h"
#include "base/mem.h"

typedef enum plan_state {
    PLAN_STATE_IDLE = 0, // the engine thread owns window and the hand-over fields
    PLAN_STATE_QUEUED,   // submitted; the planner owns them
    PLAN_STATE_PLANNING,
    PLAN_STATE_DONE, // the engine thread may take the result
} plan_state;

struct di_eplb_async {
    pthread_t thread;
    bool started;
    pthread_mutex_t mu;
    pthread_cond_t cv;          // the planner waits for work; di_eplb_async_wait for a result
    plan_state state;           // guarded by mu
    bool quit, hold;            // guarded by mu
    bool notifying;             // guarded by mu: DONE, its `done` call not returned yet
    di_ep_load_table window;    // owned; the owner follows state
    di_ep_placement cur, next;  // owned (moved in / out); the owner follows state
    di_eplb_options opt;        // the owner follows state
    di_eplb_report rep;         // the owner follows state
    di_status st;               // the owner follows state
    int64_t plan_us;            // the owner follows state
    di_eplb_async_done_fn done; // borrowed
    void *user;                 // borrowed
};

static int64_t mono_us(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000 + ts.tv_nsec / 1000;
}

static void *planner_main(void *p) {
    di_eplb_async *a = p;
    pthread_mutex_lock(&a->mu);
    for (;;) {
        while (!a->quit && (a->state != PLAN_STATE_QUEUED || a->hold))
            pthread_cond_wait(&a->cv, &a->mu);
        if (a->quit) break;
        a->state = PLAN_STATE_PLANNING;
        pthread_mutex_unlock(&a->mu);
        // The planner owns window, cur, opt and next from QUEUED to DONE: no lock while planning.
        const int64_t t0 = mono_us();
        memset(&a->rep, 0, sizeof a->rep);
        a->st = di_eplb_rebalance(&a->window, &a->cur, &a->opt, &a->next, &a->rep);
        a->plan_us = mono_us() - t0;
        pthread_mutex_lock(&a->mu);
        a->state = PLAN_STATE_DONE;
        a->notifying = true;
        pthread_mutex_unlock(&a->mu);
        if (a->done) a->done(a->user); // outside mu: it takes its owner's lock
        pthread_mutex_lock(&a->mu);
        a->notifying = false;
        pthread_cond_broadcast(&a->cv);
    }
    pthread_mutex_unlock(&a->mu);
    return NULL;
}

di_status di_eplb_async_create(int32_t n_layers, int32_t n_expert, di_eplb_async_done_fn done,
                               void *user, di_eplb_async **out) {
    di_eplb_async *a = di_calloc(1, sizeof *a);
    if (!a) return DI_ERR_NOMEM;
    pthread_mutex_init(&a->mu, NULL);
    pthread_cond_init(&a->cv, NULL);
    a->done = done;
    a->user = user;
    di_status st = di_ep_load_table_alloc(n_layers, n_expert, &a->window);
    if (st != DI_OK) goto fail;
    if (pthread_create(&a->thread, NULL, planner_main, a) != 0) {
        DI_LOG_ERROR("eplb: cannot start the planner thread");
        st = DI_ERR_NOMEM;
        goto fail;
    }
    a->started = true;
    *out = a;
    return DI_OK;
fail:
    di_eplb_async_destroy(a);
    return st;
}

void di_eplb_async_destroy(di_eplb_async *a) {
    if (!a) return;
    if (a->started) {
        pthread_mutex_lock(&a->mu);
        // A plan being computed finishes first (the planner checks quit between plans only).
        a->quit = true;
        a->hold = false;
        pthread_cond_broadcast(&a->cv);
        pthread_mutex_unlock(&a->mu);
        pthread_join(a->thread, NULL);
    }
    di_ep_load_table_free(&a->window);
    di_ep_placement_free(&a->cur);
    di_ep_placement_free(&a->next);
    pthread_cond_destroy(&a->cv);
    pthread_mutex_destroy(&a->mu);
    di_free(a);
}

bool di_eplb_async_idle(di_eplb_async *a) {
    pthread_mutex_lock(&a->mu);
    const bool idle = a->state == PLAN_STATE_IDLE;
    pthread_mutex_unlock(&a->mu);
    return idle;
}

di_ep_load_table *di_eplb_async_window(di_eplb_async *a) {
    return di_eplb_async_idle(a) ? &a->window : NULL;
}

di_status di_eplb_async_submit(di_eplb_async *a, di_ep_placement *cur, const di_eplb_options *opt) {
    pthread_mutex_lock(&a->mu);
    if (a->state != PLAN_STATE_IDLE) {
        pthread_mutex_unlock(&a->mu);
        return DI_ERR_BUSY;
    }
    // Idle: the caller owns the fields; the planner takes them with the state change.
    di_ep_placement_free(&a->cur);
    di_ep_placement_free(&a->next);
    a->cur = *cur;
    memset(cur, 0, sizeof *cur);
    a->opt = *opt;
    a->state = PLAN_STATE_QUEUED;
    pthread_cond_broadcast(&a->cv);
    pthread_mutex_unlock(&a->mu);
    return DI_OK;
}

bool di_eplb_async_take(di_eplb_async *a, di_eplb_async_result *out) {
    pthread_mutex_lock(&a->mu);
    const bool done = a->state == PLAN_STATE_DONE;
    pthread_mutex_unlock(&a->mu);
    if (!done) return false;
    // DONE: the planner no longer touches the fields (it waits for the next QUEUED).
    out->st = a->st;
    out->cur = a->cur;
    out->next = a->next;
    out->rep = a->rep;
    out->pairs = di_ep_load_table_pairs(&a->window);
    out->plan_us = a->plan_us;
    memset(&a->cur, 0, sizeof a->cur);
    memset(&a->next, 0, sizeof a->next);
    pthread_mutex_lock(&a->mu);
    a->state = PLAN_STATE_IDLE;
    pthread_mutex_unlock(&a->mu);
    return true;
}

void di_eplb_async_wait(di_eplb_async *a) {
    pthread_mutex_lock(&a->mu);
    while (a->state == PLAN_STATE_QUEUED || a->state == PLAN_STATE_PLANNING || a->notifying)
        pthread_cond_wait(&a->cv, &a->mu);
    pthread_mutex_unlock(&a->mu);
}

void di_eplb_async_hold(di_eplb_async *a, bool hold) {
    pthread_mutex_lock(&a->mu);
    a->hold = hold;
    pthread_cond_broadcast(&a->cv);
    pthread_mutex_unlock(&a->mu);
}
