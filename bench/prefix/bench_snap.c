// bench_snap — snapshot points (docs/kv-cache.md, "Snapshot points") on the engine API: requests
// sharing a system prompt of S tokens with different user messages (U tokens each), with a
// snapshot point at the system prompt's end (di_request_params.snap_at) and without (each hit is
// then continued by the bounded replay, as before snapshot points), on the tiny V4 and V4.1
// models written by di_synth. The first request of each run primes the cache (cold); the next N
// are measured (the cold one's time printed too): positions computed (the prompt minus the cached
// tokens plus the replayed ones, from the final event) and the time to the first token (submit to
// its event; the engine is otherwise idle). Prints medians and ranges. "V4 dev" runs the V4 model
// on the device-resident forward (model/dsv4_dev.h) on its CPU twin: its snapshots are the dev
// state's rows (di_dsv4_dev_tail_save / _restore), its replay the same bounded replay. The
// "repeated prompt" runs (V4 and V4 dev) send the same S + U tokens every time: a hit of the
// prompt's full blocks, continued from the snapshot at its last block boundary, against the
// engine without snapshots (no_tail_cache: the bounded replay).
//     build/bench_snap [N=5] [S=1000] [U=24]
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>

#include "deepinfer.h"
#include "backend/backend.h" // the CPU twin of the device-resident forward
#include "base/log.h"
#include "engine/engine_internal.h" // di_engine_create_prepared
#include "model/dsv4_dev.h"         // di_dsv4_dev_attach
#include "model/synth.h"

enum { V = 512, MAXN = 64 };

typedef struct ev_state {
    double t_submit, t_first;
    int32_t n_cached, n_replayed;
    int done;
} ev_state;

static double now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec * 1e3 + (double)ts.tv_nsec / 1e6;
}

static void on_event(void *user, const di_event *ev) {
    ev_state *s = user;
    if (ev->token >= 0 && s->t_first == 0) s->t_first = now_ms();
    if (ev->finish != DI_FINISH_NONE) {
        s->n_cached = ev->n_cached;
        s->n_replayed = ev->n_replayed;
        s->done = 1;
    }
}

static int cmp_d(const void *a, const void *b) {
    const double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static double median(double *v, int n) {
    qsort(v, (size_t)n, sizeof *v, cmp_d);
    return n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

static di_status attach_cpu_twin(di_model *m, void *user) {
    return di_dsv4_dev_attach(m, user);
}

enum { MODE_POINT, MODE_REPLAY, MODE_REPEAT, MODE_REPEAT_NO_TAIL };

static int run(const char *name, const char *dir, int mode, int n, int32_t s_len, int32_t u_len,
               bool dev) {
    const bool points = mode == MODE_POINT, repeat = mode >= MODE_REPEAT;
    static const char *const what[] = {"snapshot point", "bounded replay", "repeat, snapshot",
                                       "repeat, replay"};
    di_engine_options o = di_engine_options_default();
    o.no_tail_cache = mode == MODE_REPEAT_NO_TAIL;
    o.n_threads = 2;
    o.max_seqs = 2;
    o.max_ctx = s_len + u_len + 8;
    o.kv_memory_bytes = (size_t)128 << 20;
    di_engine *e = NULL;
    di_backend *b = NULL; // dev: outlives the engine's model, which borrows it
    if (dev && di_cpu_backend_create(2, &b) != DI_OK) return 1;
    if ((dev ? di_engine_create_prepared(dir, &o, attach_cpu_twin, b, &e)
             : di_engine_create(dir, &o, &e)) != DI_OK)
        return 1;
    int32_t *prompt = malloc(sizeof(int32_t) * (size_t)(s_len + u_len));
    if (!prompt) return 1;
    for (int32_t t = 0; t < s_len; t++) prompt[t] = (t * 31 + 11) % V;
    double ttft[MAXN], comp[MAXN];
    int32_t cached = 0, replayed = 0;
    double cold = 0;
    for (int k = 0; k <= n; k++) {
        for (int32_t t = 0; t < u_len; t++)
            prompt[s_len + t] = (t * 37 + 53 * (repeat ? 0 : k) + 7) % V;
        ev_state st = {0};
        di_request_params p = di_request_params_default();
        p.prompt = prompt;
        p.n_prompt = s_len + u_len;
        p.max_tokens = 1;
        p.snap_at = points ? &s_len : NULL;
        p.n_snap_at = points ? 1 : 0;
        p.on_event = on_event;
        p.user = &st;
        uint64_t id;
        st.t_submit = now_ms();
        if (di_engine_submit(e, &p, &id) != DI_OK) return 1;
        di_engine_wait_idle(e);
        if (k == 0) { // the cold request primes the cache
            cold = st.t_first - st.t_submit;
            continue;
        }
        ttft[k - 1] = st.t_first - st.t_submit;
        comp[k - 1] = (double)(s_len + u_len - st.n_cached + st.n_replayed);
        cached = st.n_cached;
        replayed = st.n_replayed;
    }
    di_engine_stats es;
    di_engine_get_stats(e, &es);
    const double c_med = median(comp, n), c_lo = comp[0], c_hi = comp[n - 1];
    const double t_med = median(ttft, n), t_lo = ttft[0], t_hi = ttft[n - 1];
    printf("%-8s %-17s prompt %d, cached %d, replayed %d, positions computed %.0f (%.0f-%.0f), "
           "TTFT %.1f ms (%.1f-%.1f); cold %.0f ms; snapshots %lld taken, %lld restored\n",
           name, what[mode], (int)(s_len + u_len), (int)cached, (int)replayed, c_med, c_lo, c_hi,
           t_med, t_lo, t_hi, cold, (long long)es.n_tail_taken, (long long)es.n_tail_restored);
    free(prompt);
    di_engine_destroy(e);
    di_backend_destroy(b);
    return 0;
}

int main(int argc, char **argv) {
    int n = argc > 1 ? atoi(argv[1]) : 5;
    int32_t s_len = argc > 2 ? atoi(argv[2]) : 1000, u_len = argc > 3 ? atoi(argv[3]) : 24;
    if (n < 1 || n > MAXN || s_len < 1 || u_len < 1) {
        fprintf(stderr, "usage: bench_snap [N=5 (1..64)] [S=1000] [U=24]\n");
        return 2;
    }
    di_log_set_level(DI_LOG_LEVEL_WARN);
    char root[] = "/tmp/di_bench_snap_XXXXXX";
    if (!mkdtemp(root)) return 1;
    char v4[64], v41[64];
    snprintf(v4, sizeof v4, "%s/v4", root);
    snprintf(v41, sizeof v41, "%s/v41", root);
    mkdir(v4, 0755);
    mkdir(v41, 0755);
    di_synth_config sc;
    if (di_synth_preset("tiny", &sc) != DI_OK || di_synth_write(&sc, v4) != DI_OK ||
        di_synth_v41_write(v41, true, false, 41) != DI_OK)
        return 1;
    int rc = 0;
    for (int mode = MODE_POINT; mode <= MODE_REPEAT_NO_TAIL; mode++) {
        rc |= run("V4", v4, mode, n, s_len, u_len, false);
        rc |= run("V4 dev", v4, mode, n, s_len, u_len, true);
        if (mode <= MODE_REPLAY) rc |= run("V4.1", v41, mode, n, s_len, u_len, false);
    }
    char cmd[128];
    snprintf(cmd, sizeof cmd, "rm -rf %s", root);
    if (system(cmd) != 0) rc = 1;
    return rc;
}
