// deepinfer bench: offline throughput of the serving engine. Submits N requests of random
// prompts at once, measures prefill and decode tokens/s, time to first token and inter-token
// latency (mean, p50, p99), KV usage; then the decode throughput of 16 concurrent sequences
// against one sequence (the continuous-batching gain), beside the gain an engine at this
// machine's limits would get (read bandwidth and FMA peak measured in the same run). With
// --spec-tokens N (a DeepSeek V4.1 checkpoint with DSpark, or a V4 one with its MTP block), the
// speculative row: the same greedy runs (one sequence, then the batch) on a second engine with
// speculative decoding, its decode tokens/s beside the first engine's, and the drafts' acceptance.
// With --shared-prefix N, the prefix-reuse row: requests whose prompts share their first N tokens,
// on the engine without the prefix cache and on one with it (after one request has left the prefix
// cached): TTFT, prompt tokens taken from the cache and positions the bounded replay computed
// again. With --temperature T (and --top-p, --top-k), the sampling row: the batch again with
// seeded sampling, its decode tokens/s beside greedy's and the share of the steps' time the
// engine spent sampling (di_engine_stats.sample_us against forward_us).
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "backend/cpu/probe.h"
#include "cli/args.h"
#include "cli/cli.h"

static void usage(FILE *f) {
    fprintf(f,
            "usage: deepinfer bench [--model DIR] [--requests 16] [--prompt-len 128]\n"
            "                       [--gen-len 64] [--kv-memory MiB] [--max-batch-tokens 256]\n"
            "                       [--threads N] [--precision fp32|official] [--no-ratio]\n"
            "                       [--device cpu|cuda[:N,...]] [--spec-tokens N]\n"
            "                       [--ep-workers HOST:PORT,...] [--ep-placement FILE]\n"
            "                       [--cp-workers HOST:PORT,...] [--cp-min-tokens N]\n"
            "                       [--spec-min-confidence X] [--shared-prefix N]\n"
            "                       [--temperature T [--top-p P] [--top-k K]]\n"
            "Greedy generation of --gen-len tokens for --requests random prompts submitted\n"
            "together; prints throughput, TTFT and ITL statistics and KV usage, then the\n"
            "decode tokens/s of 16 concurrent sequences over 1 (skip with --no-ratio).\n"
            "--spec-tokens N (DeepSeek V4.1 with DSpark, or V4 with its MTP block: one draft):\n"
            "also runs one sequence and the batch with speculative decoding (up to N drafts\n"
            "per verify) and prints the speedup, the acceptance rate and the tokens per verify.\n"
            "--shared-prefix N (< --prompt-len): also runs the batch with prompts sharing\n"
            "their first N tokens without and with the prefix cache and prints the TTFT\n"
            "ratio, the cached and the replayed tokens per request.\n"
            "--temperature T (> 0; with --top-p P, --top-k K): also runs the batch with seeded\n"
            "sampling and prints its decode tokens/s beside greedy's and the share of the\n"
            "steps' time spent sampling.\n");
}

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

typedef struct req_times {
    double *t; // [gen_len] token arrival times
    int32_t n;
} req_times;

static void on_event(void *user, const di_event *ev) {
    req_times *r = user;
    if (ev->token >= 0) r->t[r->n++] = now_s();
}

static int cmp_d(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static double pct(double *v, int64_t n, double p) {
    if (n == 0) return 0;
    qsort(v, (size_t)n, sizeof *v, cmp_d);
    int64_t i = (int64_t)(p * (double)(n - 1) + 0.5);
    return v[i];
}

typedef struct run_result {
    double wall_s, prefill_tps, decode_tps, ttft[3], itl[3]; // mean, p50, p99 (ms)
    int64_t kv_peak_blocks, kv_total_blocks, block_bytes, n_allocs;
    // Per step of the decode window: weight bytes read, multiply-adds, decoded tokens.
    double step_bytes, step_macs, step_tokens;
} run_result;

enum { MAX_SAMPLES = 1 << 16 }; // 2 ms apart: over two minutes

typedef struct stat_sample {
    double t;
    di_engine_stats st;
} stat_sample;

typedef struct poll_arg {
    di_engine *e;
    atomic_bool done;
    int64_t peak;
    stat_sample *s; // [MAX_SAMPLES]
    int32_t n;
} poll_arg;

// Samples the engine's stats every 2 ms: the KV peak, and the work counters the decode window's
// per-step costs are read from.
static void *poll_stats(void *p) {
    poll_arg *a = p;
    while (!atomic_load(&a->done)) {
        di_engine_stats st;
        di_engine_get_stats(a->e, &st);
        int64_t used = st.n_blocks_total - st.n_blocks_free;
        if (used > a->peak) a->peak = used;
        if (a->n < MAX_SAMPLES) a->s[a->n++] = (stat_sample){now_s(), st};
        struct timespec ts = {0, 2000000};
        nanosleep(&ts, NULL);
    }
    return NULL;
}

// Weight bytes, multiply-adds and decoded tokens per step between the first sample at or after
// t0 and the last at or before t1 (zeros when the window saw no complete step).
static void window_costs(const poll_arg *a, double t0, double t1, run_result *out) {
    int32_t i = 0, j = a->n - 1;
    while (i < a->n && a->s[i].t < t0) i++;
    while (j >= 0 && a->s[j].t > t1) j--;
    out->step_bytes = out->step_macs = out->step_tokens = 0;
    if (i >= j) return;
    const di_engine_stats *x = &a->s[i].st, *y = &a->s[j].st;
    double steps = (double)(y->n_steps - x->n_steps);
    if (steps <= 0) return;
    out->step_bytes = (double)(y->weight_bytes - x->weight_bytes) / steps;
    out->step_macs = (double)(y->weight_macs - x->weight_macs) / steps;
    out->step_tokens = (double)(y->n_decode_tokens - x->n_decode_tokens) / steps;
}

// Runs n requests at once; decode throughput counts tokens in the window where every request is
// decoding (after the last first token, before the first request ends). The first `shared`
// prompt tokens are the same in every request and every run; the rest depend on seed and request.
static int run_sampled(di_engine *e, int32_t n_vocab, int n, int prompt_len, int shared,
                       int gen_len, uint64_t seed, const di_sample_params *sp, run_result *out) {
    req_times *rt = calloc((size_t)n, sizeof *rt);
    int32_t *prompt = malloc(sizeof(int32_t) * (size_t)prompt_len);
    if (!rt || !prompt) return 1;
    poll_arg pa = {.e = e, .s = malloc(sizeof(stat_sample) * MAX_SAMPLES)};
    if (!pa.s) return 1;
    atomic_init(&pa.done, false);
    pthread_t th;
    pthread_create(&th, NULL, poll_stats, &pa);
    double t0 = now_s();
    for (int i = 0; i < n; i++) {
        rt[i].t = malloc(sizeof(double) * (size_t)gen_len);
        for (int k = 0; k < prompt_len; k++)
            prompt[k] = k < shared
                            ? (int32_t)((17u + (uint64_t)k * 104729u) % (uint64_t)n_vocab)
                            : (int32_t)((seed + (uint64_t)i * 7919u + (uint64_t)k * 104729u) %
                                        (uint64_t)n_vocab);
        di_request_params p = di_request_params_default();
        p.prompt = prompt;
        p.n_prompt = prompt_len;
        p.max_tokens = gen_len;
        p.ignore_eos = true;
        p.on_event = on_event;
        p.user = &rt[i];
        if (sp) {
            p.sample = *sp;
            p.sample.seed = seed * 1000003u + (uint64_t)i;
        }
        uint64_t id;
        di_status st = di_engine_submit(e, &p, &id);
        if (st != DI_OK) {
            fprintf(stderr, "deepinfer bench: submit: %s\n", di_status_str(st));
            return 1;
        }
    }
    di_engine_wait_idle(e);
    double t1 = now_s();
    atomic_store(&pa.done, true);
    pthread_join(th, NULL);
    double *ttft = malloc(sizeof(double) * (size_t)n);
    double *itl = malloc(sizeof(double) * (size_t)n * (size_t)gen_len);
    int64_t n_itl = 0;
    double last_first = 0, end_first = 1e300;
    for (int i = 0; i < n; i++) {
        ttft[i] = (rt[i].t[0] - t0) * 1e3;
        if (rt[i].t[0] > last_first) last_first = rt[i].t[0];
        if (rt[i].t[rt[i].n - 1] < end_first) end_first = rt[i].t[rt[i].n - 1];
        for (int k = 1; k < rt[i].n; k++) itl[n_itl++] = (rt[i].t[k] - rt[i].t[k - 1]) * 1e3;
    }
    int64_t in_window = 0;
    for (int i = 0; i < n; i++)
        for (int k = 1; k < rt[i].n; k++)
            in_window += rt[i].t[k] > last_first && rt[i].t[k] <= end_first;
    out->wall_s = t1 - t0;
    out->prefill_tps = (double)n * prompt_len / (last_first - t0);
    out->decode_tps = end_first > last_first ? (double)in_window / (end_first - last_first) : 0;
    window_costs(&pa, last_first, end_first, out);
    free(pa.s);
    double s = 0;
    for (int i = 0; i < n; i++) s += ttft[i];
    out->ttft[0] = s / n;
    out->ttft[1] = pct(ttft, n, 0.5);
    out->ttft[2] = pct(ttft, n, 0.99);
    s = 0;
    for (int64_t i = 0; i < n_itl; i++) s += itl[i];
    out->itl[0] = n_itl ? s / (double)n_itl : 0;
    out->itl[1] = pct(itl, n_itl, 0.5);
    out->itl[2] = pct(itl, n_itl, 0.99);
    di_engine_stats st;
    di_engine_get_stats(e, &st);
    out->kv_peak_blocks = pa.peak;
    out->kv_total_blocks = st.n_blocks_total;
    out->block_bytes = st.block_bytes;
    out->n_allocs = st.n_step_allocs;
    for (int i = 0; i < n; i++) free(rt[i].t);
    free(rt);
    free(prompt);
    free(ttft);
    free(itl);
    return 0;
}

// Greedy requests.
static int run(di_engine *e, int32_t n_vocab, int n, int prompt_len, int shared, int gen_len,
               uint64_t seed, run_result *out) {
    return run_sampled(e, n_vocab, n, prompt_len, shared, gen_len, seed, NULL, out);
}

// The sampling row: the batch of n requests greedy, then again with seeded sampling (sp) on e;
// the engine's sampling time of each run against its forward time.
static int sample_row(di_engine *e, int32_t n_vocab, int n, int prompt_len, int gen_len,
                      const di_sample_params *sp) {
    di_engine_stats s0, s1, s2;
    run_result g, r;
    di_engine_get_stats(e, &s0);
    if (run(e, n_vocab, n, prompt_len, 0, gen_len, 1, &g)) return 1;
    di_engine_get_stats(e, &s1);
    if (run_sampled(e, n_vocab, n, prompt_len, 0, gen_len, 1, sp, &r)) return 1;
    di_engine_get_stats(e, &s2);
    const double gf = (double)(s1.forward_us - s0.forward_us) / 1e3,
                 gs = (double)(s1.sample_us - s0.sample_us) / 1e3;
    const double rf = (double)(s2.forward_us - s1.forward_us) / 1e3,
                 rs = (double)(s2.sample_us - s1.sample_us) / 1e3;
    printf("sampling (temperature %g, top-p %g, top-k %d, seeded), %d requests:\n",
           (double)sp->temperature, (double)sp->top_p, (int)sp->top_k, n);
    printf("  decode    %10.1f tokens/s (greedy: %.1f, %.2fx)\n", r.decode_tps, g.decode_tps,
           g.decode_tps > 0 ? r.decode_tps / g.decode_tps : 0);
    printf("  steps' time sampling %.1f ms of %.1f (%.1f %%); greedy %.1f ms of %.1f (%.1f %%)\n",
           rs, rs + rf, rs + rf > 0 ? 100.0 * rs / (rs + rf) : 0, gs, gs + gf,
           gs + gf > 0 ? 100.0 * gs / (gs + gf) : 0);
    return 0;
}

static void print_run(const char *name, int n, const run_result *r) {
    printf("%s: %d requests in %.2f s\n", name, n, r->wall_s);
    printf("  prefill   %10.1f tokens/s\n", r->prefill_tps);
    printf("  decode    %10.1f tokens/s\n", r->decode_tps);
    printf("  TTFT ms   mean %8.1f  p50 %8.1f  p99 %8.1f\n", r->ttft[0], r->ttft[1], r->ttft[2]);
    printf("  ITL  ms   mean %8.2f  p50 %8.2f  p99 %8.2f\n", r->itl[0], r->itl[1], r->itl[2]);
    printf("  KV        peak %lld of %lld blocks (%.1f of %.1f MiB), step allocations %lld\n",
           (long long)r->kv_peak_blocks, (long long)r->kv_total_blocks,
           r->kv_peak_blocks * (double)r->block_bytes / 1048576.0,
           r->kv_total_blocks * (double)r->block_bytes / 1048576.0, (long long)r->n_allocs);
}

// The same decode windows against this machine's limits, measured now on a pool of the engine's
// size: a step can take no less than max(weight bytes / read bandwidth, multiply-adds / FMA
// peak), so an engine at those limits decodes step_tokens per that time. Their quotient is the
// batching gain the hardware allows for this model (attention and the rest are not counted, so
// the floor is a little low at long contexts).
static void print_limits(int n_threads, const run_result *one, const run_result *many) {
    di_pool *pool = NULL;
    if (di_pool_create(n_threads, &pool) != DI_OK) return;
    const di_cpu_isa isa = di_cpu_isa_detect();
    const double bw = di_probe_read_bw(pool, (size_t)512 << 20, 3);
    const double mac = di_probe_fma_peak(pool, isa, 3);
    printf("limits (%d threads, %s): read bandwidth %.2f GB/s, FMA peak %.2f G multiply-adds/s\n",
           di_pool_n_threads(pool), di_cpu_isa_name(isa), bw / 1e9, mac / 1e9);
    di_pool_destroy(pool);
    if (bw <= 0 || mac <= 0) return;
    double ideal[2];
    const run_result *r[2] = {one, many};
    const char *name[2] = {"1 sequence", "16 sequences"};
    for (int k = 0; k < 2; k++) {
        double tb = r[k]->step_bytes / bw, tm = r[k]->step_macs / mac;
        double floor_s = tb > tm ? tb : tm;
        ideal[k] = floor_s > 0 ? r[k]->step_tokens / floor_s : 0;
        printf("  %-12s per step %.1f MiB of weights, %.1f M multiply-adds, %.2f tokens: floor "
               "%.2f ms (%s-bound) = %.1f tokens/s; achieved %.0f %%\n",
               name[k], r[k]->step_bytes / 1048576.0, r[k]->step_macs / 1e6, r[k]->step_tokens,
               floor_s * 1e3, tb > tm ? "bandwidth" : "FMA", ideal[k],
               ideal[k] > 0 ? 100.0 * r[k]->decode_tps / ideal[k] : 0);
    }
    if (ideal[0] > 0)
        printf("decode throughput 16 vs 1 at this machine's limits: %.2fx\n", ideal[1] / ideal[0]);
}

// The speculative row: one sequence and the batch of n requests again on an engine with
// speculative decoding (options o plus spec), against the runs of the plain engine (whose forward
// was device-resident when plain_resident).
static int spec_row(const char *model, di_engine_options o, int32_t n_vocab, int n, int prompt_len,
                    int gen_len, const run_result *plain_one, const run_result *plain_batch,
                    bool plain_resident) {
    di_engine *e = NULL;
    di_status st = di_engine_create(model, &o, &e);
    if (st != DI_OK) {
        fprintf(stderr, "deepinfer bench: --spec-tokens: cannot start the engine: %s\n",
                di_status_str(st));
        return 1;
    }
    run_result one, batch;
    if (run(e, n_vocab, 1, prompt_len, 0, gen_len, 4, &one) ||
        run(e, n_vocab, n, prompt_len, 0, gen_len, 1, &batch))
        return 1;
    di_engine_stats es;
    di_engine_get_stats(e, &es);
    di_engine_destroy(e);
    const double nv = es.n_spec_verifies > 0 ? (double)es.n_spec_verifies : 1;
    if (es.spec_drafter && strcmp(es.spec_drafter, "DSpark") == 0)
        printf("speculative decoding (--spec-tokens %d, DSpark drafts, confidence cut %g), "
               "greedy:\n",
               (int)o.spec_tokens,
               (double)(o.spec_min_confidence != 0 ? o.spec_min_confidence
                                                   : DI_SPEC_MIN_CONFIDENCE_DEFAULT));
    else
        printf("speculative decoding (the MTP block's one draft per verify), greedy:\n");
    if (plain_resident && !es.device.resident) // one forward resident, the other not
        printf("  (the engine with speculation runs the CPU forward with offloaded matmuls, the "
               "one without it the device-resident forward: the ratios compare two forwards)\n");
    printf("  1 sequence    decode %10.1f tokens/s (without: %.1f, %.2fx), step allocations %lld\n",
           one.decode_tps, plain_one->decode_tps,
           plain_one->decode_tps > 0 ? one.decode_tps / plain_one->decode_tps : 0,
           (long long)one.n_allocs);
    printf("  %-3d sequences decode %10.1f tokens/s (without: %.1f, %.2fx)\n", n, batch.decode_tps,
           plain_batch->decode_tps,
           plain_batch->decode_tps > 0 ? batch.decode_tps / plain_batch->decode_tps : 0);
    printf("  %lld verifies: %.2f drafts proposed, %.2f verified, %.2f accepted per verify "
           "(acceptance %.1f %% of verified drafts); %.2f tokens per verify step\n",
           (long long)es.n_spec_verifies, (double)es.n_spec_drafted / nv,
           (double)es.n_spec_verified / nv, (double)es.n_spec_accepted / nv,
           es.n_spec_verified ? 100.0 * (double)es.n_spec_accepted / (double)es.n_spec_verified
                              : 0.0,
           (double)(es.n_spec_verifies + es.n_spec_accepted) / nv);
    return 0;
}

// The prefix-reuse row: the batch with prompts sharing their first `shared` tokens on the engine
// without the prefix cache (e), then on an engine with it (options o), after one request of the
// same prefix.
static int prefix_row(di_engine *e, const char *model, di_engine_options o, int32_t n_vocab, int n,
                      int prompt_len, int shared, int gen_len) {
    run_result cold, hit, warm;
    if (run(e, n_vocab, n, prompt_len, shared, gen_len, 5, &cold)) return 1;
    o.no_prefix_cache = false;
    di_engine *c = NULL;
    di_status st = di_engine_create(model, &o, &c);
    if (st != DI_OK) {
        fprintf(stderr, "deepinfer bench: --shared-prefix: cannot start the engine: %s\n",
                di_status_str(st));
        return 1;
    }
    if (run(c, n_vocab, 1, prompt_len, shared, gen_len, 6, &warm)) return 1;
    di_engine_stats s0, s1;
    di_engine_get_stats(c, &s0);
    if (run(c, n_vocab, n, prompt_len, shared, gen_len, 5, &hit)) return 1;
    di_engine_get_stats(c, &s1);
    di_engine_destroy(c);
    printf("prefix reuse (--shared-prefix %d of %d prompt tokens), %d requests:\n", shared,
           prompt_len, n);
    printf("  TTFT ms mean %8.1f  p50 %8.1f with the prefix cache, %8.1f  %8.1f without: %.2fx\n",
           hit.ttft[0], hit.ttft[1], cold.ttft[0], cold.ttft[1],
           hit.ttft[0] > 0 ? cold.ttft[0] / hit.ttft[0] : 0);
    printf("  per request: %.1f prompt tokens from the cache, %.1f of them computed again by the "
           "bounded replay\n",
           (double)(s1.n_cache_hit_tokens - s0.n_cache_hit_tokens) / n,
           (double)(s1.n_replayed_tokens - s0.n_replayed_tokens) / n);
    return 0;
}

// Expert parallelism: what crossed the wire, per worker and per token of the whole run.
static void print_ep(di_engine *e) {
    di_ep_worker_stats w[64];
    const int32_t n = di_engine_ep_stats(e, w, 64);
    di_engine_stats es;
    di_engine_get_stats(e, &es);
    const int64_t tokens = es.n_prefill_tokens + es.n_decode_tokens;
    int64_t bytes = 0;
    for (int32_t i = 0; i < n && i < 64; i++) {
        printf("expert worker %s: %lld requests, %lld rows, %.1f MiB sent, %.1f MiB received, "
               "%.1f ms waiting for results, %lld errors\n",
               w[i].addr, (long long)w[i].calls, (long long)w[i].rows, w[i].bytes_sent / 1048576.0,
               w[i].bytes_recv / 1048576.0, w[i].wait_us / 1e3, (long long)w[i].errors);
        bytes += w[i].bytes_sent + w[i].bytes_recv;
    }
    printf("expert parallelism: %d workers, %lld tokens computed, %.0f bytes exchanged per "
           "token\n",
           (int)n, (long long)tokens, tokens > 0 ? (double)bytes / (double)tokens : 0.0);
}

int di_cli_bench(int argc, char **argv) {
    di_model_args ma = {.opt = di_model_options_default()};
    long n_req = 16, prompt_len = 128, gen_len = 64, kv_mib = 512, batch = 256, spec = 0,
         shared = 0;
    double spec_conf = 0;
    bool ratio = true;
    di_sample_params sp = di_sample_params_default();
    for (int i = 1; i < argc; i++) {
        int r = di_args_model_option(argc, argv, &i, &ma);
        if (r < 0) return 2;
        if (r > 0) continue;
        const char *a = argv[i];
        if (strcmp(a, "--help") == 0) {
            usage(stdout);
            return 0;
        }
        if (strcmp(a, "--no-ratio") == 0) {
            ratio = false;
            continue;
        }
        if (i + 1 >= argc) {
            fprintf(stderr, "deepinfer bench: unknown option or missing value '%s'\n", a);
            return 2;
        }
        const char *v = argv[++i];
        bool ok = true;
        if (strcmp(a, "--requests") == 0)
            ok = di_args_int(v, a, 1, 4096, &n_req);
        else if (strcmp(a, "--prompt-len") == 0)
            ok = di_args_int(v, a, 1, 1 << 20, &prompt_len);
        else if (strcmp(a, "--gen-len") == 0)
            ok = di_args_int(v, a, 2, 1 << 20, &gen_len);
        else if (strcmp(a, "--kv-memory") == 0)
            ok = di_args_int(v, a, 1, 1 << 20, &kv_mib);
        else if (strcmp(a, "--max-batch-tokens") == 0)
            ok = di_args_int(v, a, 16, 1 << 16, &batch);
        else if (strcmp(a, "--shared-prefix") == 0)
            ok = di_args_int(v, a, 1, 1 << 20, &shared);
        else if (strcmp(a, "--spec-tokens") == 0)
            ok = di_args_int(v, a, 1, DI_MAX_SPEC_TOKENS, &spec);
        else if (strcmp(a, "--spec-min-confidence") == 0) {
            char *end = NULL;
            spec_conf = strtod(v, &end);
            ok = end && !*end && spec_conf >= -1 && spec_conf <= 1;
            if (!ok) fprintf(stderr, "deepinfer bench: --spec-min-confidence is in [-1, 1]\n");
        } else if (strcmp(a, "--temperature") == 0 || strcmp(a, "--top-p") == 0) {
            char *end = NULL;
            const double x = strtod(v, &end);
            const bool t = strcmp(a, "--temperature") == 0;
            ok = end && !*end && (t ? x > 0 && x <= 100 : x > 0 && x <= 1);
            if (!ok)
                fprintf(stderr, "deepinfer bench: %s is in %s\n", a, t ? "(0, 100]" : "(0, 1]");
            else if (t)
                sp.temperature = (float)x;
            else
                sp.top_p = (float)x;
        } else if (strcmp(a, "--top-k") == 0) {
            long k = 0;
            ok = di_args_int(v, a, 0, 1 << 20, &k);
            sp.top_k = (int32_t)k;
        } else {
            fprintf(stderr, "deepinfer bench: unknown option '%s'\n", a);
            usage(stderr);
            return 2;
        }
        if (!ok) return 2;
    }
    if (sp.temperature == 0 && (sp.top_p < 1 || sp.top_k > 0)) {
        fprintf(stderr, "deepinfer bench: --top-p and --top-k need --temperature\n");
        return 2;
    }
    if (shared >= prompt_len) {
        fprintf(stderr, "deepinfer bench: --shared-prefix must be below --prompt-len (%ld)\n",
                prompt_len);
        return 2;
    }
    if (!ma.model && !(ma.model = di_args_default_model())) return 1;
    di_args_model_finish(&ma);
    di_engine_options o = di_engine_options_default();
    o.n_threads = ma.opt.n_threads;
    o.precision = ma.opt.precision;
    o.device = ma.opt.device;
    o.ep_workers = ma.opt.ep_workers;
    o.ep_placement = ma.opt.ep_placement;
    o.cp_workers = ma.opt.cp_workers;
    o.cp_min_tokens = ma.opt.cp_min_tokens;
    o.dev_reserve_bytes = ma.opt.dev_reserve_bytes;
    o.kv_memory_bytes = (size_t)kv_mib << 20;
    o.max_seqs = (int32_t)(n_req > 16 ? n_req : 16);
    o.max_batch_tokens = (int32_t)batch;
    o.max_ctx = (int32_t)(prompt_len + gen_len);
    o.no_prefix_cache = true; // random prompts: measure compute, not reuse
    di_engine *e = NULL;
    di_status st = di_engine_create(ma.model, &o, &e);
    if (st != DI_OK) {
        fprintf(stderr, "deepinfer bench: cannot start the engine on %s: %s\n", ma.model,
                di_status_str(st));
        return 1;
    }
    // Prompt ids are drawn below 512, valid in any V4 vocabulary.
    const int32_t n_vocab = 512;
    run_result r;
    if (run(e, n_vocab, (int)n_req, (int)prompt_len, 0, (int)gen_len, 1, &r)) return 1;
    print_run("batch", (int)n_req, &r);
    if (spec > 0) {
        run_result one;
        if (run(e, n_vocab, 1, (int)prompt_len, 0, (int)gen_len, 4, &one)) return 1;
        di_engine_options so = o;
        so.spec_tokens = (int32_t)spec;
        so.spec_min_confidence = (float)spec_conf;
        di_engine_stats ps;
        di_engine_get_stats(e, &ps);
        if (spec_row(ma.model, so, n_vocab, (int)n_req, (int)prompt_len, (int)gen_len, &one, &r,
                     ps.device.resident))
            return 1;
    }
    if (sp.temperature > 0 &&
        sample_row(e, n_vocab, (int)n_req, (int)prompt_len, (int)gen_len, &sp))
        return 1;
    if (shared > 0 &&
        prefix_row(e, ma.model, o, n_vocab, (int)n_req, (int)prompt_len, (int)shared, (int)gen_len))
        return 1;
    if (ratio) {
        run_result one, many;
        if (run(e, n_vocab, 1, (int)prompt_len, 0, (int)gen_len, 2, &one)) return 1;
        if (run(e, n_vocab, 16, (int)prompt_len, 0, (int)gen_len, 3, &many)) return 1;
        print_run("1 sequence", 1, &one);
        print_run("16 sequences", 16, &many);
        printf("decode throughput 16 vs 1: %.2fx (%.1f vs %.1f tokens/s)\n",
               one.decode_tps > 0 ? many.decode_tps / one.decode_tps : 0, many.decode_tps,
               one.decode_tps);
        // The CPU's limits bound only a CPU run (on a device the CPU counts no weight work).
        if (o.device.kind == DI_DEVICE_CPU) print_limits(ma.opt.n_threads, &one, &many);
    }
    if (o.device.kind != DI_DEVICE_CPU) {
        di_engine_stats es;
        di_engine_get_stats(e, &es);
        if (es.device.resident) // activations and KV on the device; no offloaded matmuls
            printf("device cuda:%d: the device-resident forward, %lld steps (%lld failed)\n",
                   (int)o.device.index, (long long)es.n_steps, (long long)es.n_failed_steps);
        else
            printf("device cuda:%d: %lld matmuls (%lld declined to the CPU), %lld weights "
                   "(%.1f MiB) uploaded\n",
                   (int)o.device.index, (long long)es.device.n_matmuls,
                   (long long)es.device.n_declined, (long long)es.device.n_weights,
                   es.device.weight_bytes / 1048576.0);
    }
    if (o.ep_workers) print_ep(e);
    di_engine_destroy(e);
    return 0;
}
