// queue — token events from the engine thread to a request's connection thread. The engine
// callback copies each event into the generation's ring under its mutex and signals; the
// connection thread pops them. Never blocks the engine thread beyond the mutex.
#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "server/server.h"

void srv_queue_init(srv_gen *g) {
    pthread_mutex_init(&g->mu, NULL);
    pthread_condattr_t a;
    pthread_condattr_init(&a);
    pthread_condattr_setclock(&a, CLOCK_MONOTONIC);
    pthread_cond_init(&g->cv, &a);
    pthread_condattr_destroy(&a);
}

void srv_queue_deinit(srv_gen *g) {
    pthread_cond_destroy(&g->cv);
    pthread_mutex_destroy(&g->mu);
    free(g->q);
}

void srv_queue_on_event(void *user, const di_event *ev) {
    srv_choice *c = user;
    srv_gen *g = c->g;
    srv_tok_ev e = {.choice = c->idx,
                    .token = ev->token,
                    .logprob = ev->logprob,
                    .n_top = ev->n_top < DI_MAX_LOGPROBS ? ev->n_top : DI_MAX_LOGPROBS,
                    .finish = ev->finish,
                    .status = ev->status,
                    .n_cached = ev->n_cached,
                    .n_replayed = ev->n_replayed};
    for (int i = 0; i < e.n_top; i++) {
        e.top_ids[i] = ev->top_ids[i];
        e.top_lp[i] = ev->top_logprobs[i];
    }
    pthread_mutex_lock(&g->mu);
    if (g->q_len == g->q_cap) {
        size_t cap = g->q_cap ? g->q_cap * 2 : 64;
        srv_tok_ev *q = malloc(cap * sizeof *q);
        if (!q) {
            // out of memory: keep final events (in place of the oldest token) so streams end
            g->q_oom = true;
            if (ev->finish != DI_FINISH_NONE) {
                g->q[(g->q_head + g->q_len - 1) % g->q_cap] = e;
                g->n_final++;
            }
            pthread_cond_broadcast(&g->cv);
            pthread_mutex_unlock(&g->mu);
            return;
        }
        for (size_t i = 0; i < g->q_len; i++) q[i] = g->q[(g->q_head + i) % g->q_cap];
        free(g->q);
        g->q = q;
        g->q_cap = cap;
        g->q_head = 0;
    }
    g->q[(g->q_head + g->q_len) % g->q_cap] = e;
    g->q_len++;
    if (ev->finish != DI_FINISH_NONE) g->n_final++;
    pthread_cond_broadcast(&g->cv);
    pthread_mutex_unlock(&g->mu);
}

static void deadline(struct timespec *ts, int ms) {
    clock_gettime(CLOCK_MONOTONIC, ts);
    ts->tv_sec += ms / 1000;
    ts->tv_nsec += (long)(ms % 1000) * 1000000L;
    if (ts->tv_nsec >= 1000000000L) {
        ts->tv_sec++;
        ts->tv_nsec -= 1000000000L;
    }
}

bool srv_queue_pop(srv_gen *g, srv_tok_ev *ev, int wait_ms) {
    pthread_mutex_lock(&g->mu);
    if (!g->q_len && wait_ms > 0) {
        struct timespec ts;
        deadline(&ts, wait_ms);
        while (!g->q_len)
            if (pthread_cond_timedwait(&g->cv, &g->mu, &ts) == ETIMEDOUT) break;
    }
    bool got = g->q_len > 0;
    if (got) {
        *ev = g->q[g->q_head];
        g->q_head = (g->q_head + 1) % g->q_cap;
        g->q_len--;
    }
    pthread_mutex_unlock(&g->mu);
    return got;
}

void srv_queue_wait_finals(srv_gen *g, int n) {
    pthread_mutex_lock(&g->mu);
    while (g->n_final < n) pthread_cond_wait(&g->cv, &g->mu);
    pthread_mutex_unlock(&g->mu);
}
