// deepinfer serve: arguments, wiring (tokenizer, engine, HTTP), signals and clean shutdown.
// SIGTERM/SIGINT: /ready turns 503 and new generation requests get 503; in-flight requests are
// drained (at most --drain-timeout seconds), then the HTTP daemon, engine and tokenizer are freed.
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "cli/args.h"
#include "cli/cli.h"
#include "server/server.h"

static void usage(FILE *f) {
    fprintf(
        f,
        "usage: deepinfer serve [--model DIR] [--host 127.0.0.1] [--port 8000] [--api-key KEY]\n"
        "                       [--served-model-name NAME] [--threads N] [--kv-memory MiB]\n"
        "                       [--precision fp32|official] [--device cpu|cuda[:N,...]]\n"
        "                       [--ep-workers HOST:PORT,...] [--ep-placement FILE]\n"
        "                       [--cp-workers HOST:PORT,...] [--cp-min-tokens N]\n"
        "                       [--eplb-interval STEPS] [--eplb-slots-per-rank S]\n"
        "                       [--eplb-min-gain G]\n"
        "                       [--max-ctx 8192] [--max-seqs 16] [--max-inflight 256]\n"
        "                       [--max-batch-tokens 256] [--priority-aging-ms 10000]\n"
        "                       [--kv-disk-dir DIR] [--kv-disk-bytes 16G] [--kv-disk-ttl 72h]\n"
        "                       [--kv-disk-queue 256M] [--kv-disk-read 1G] [--kv-disk-prefetches "
        "4]\n"
        "                       [--tail-cache-mib 256]\n"
        "                       [--cache-isolation none|user] [--fim]\n"
        "                       [--max-body-mib 8] [--timeout 600] [--keepalive 15]\n"
        "                       [--drain-timeout 30] [--log-level 0..3]\n"
        "                       [--spec-tokens N] [--spec-min-confidence X]\n"
        "                       [--kv-transfer] [--kv-transfer-max-bytes 1G]\n"
        "                       [--device-loss-max 3] [--device-loss-window 600]\n"
        "OpenAI Chat Completions / Completions / Responses and Anthropic Messages over HTTP.\n"
        "Without --model it serves the built-in tiny random-weight model (meaningless text).\n"
        "--spec-tokens N (default 0 = off): speculative decoding, up to N drafts verified\n"
        "per step, drafted by DSpark (DeepSeek V4.1) or by the MTP block (V4: one draft per\n"
        "step), on the CPU and the device forward; outputs are identical without it.\n"
        "--spec-min-confidence X: verify DSpark drafts while their estimated survival is >= X\n"
        "(default %g; negative: always N).\n"
        "--tail-cache-mib N: memory for tail snapshots (the window state at a prompt's last\n"
        "block boundary, kept with its cached block: a prefix hit there replays nothing;\n"
        "0: off, every hit replays n_layers * (window - 1) positions). Every forward, --device\n"
        "cuda included.\n"
        "--cache-isolation user: requests share cached prompts only with the same user id\n"
        "(user_id / user; Messages metadata.user_id); default none: every request shares.\n"
        "--fim: POST /beta/completions takes 'suffix' (fill-in-the-middle; its prompt layout\n"
        "is DeepSeek's V3-era one, unverified on V4). POST /beta/chat/completions serves Chat\n"
        "prefix completion (the last assistant message with \"prefix\": true) always.\n"
        "--kv-transfer: serve POST /internal/prefill and /internal/kv, the KV transfer of\n"
        "prefill/decode disaggregation (deepinfer route --prefill/--decode; every V4 / V4.1\n"
        "forward, --device cuda included).\n"
        "Cluster-internal: they let a caller fill the prefix cache; keep them off public\n"
        "networks (with --api-key they take the key).\n"
        "--ep-workers: expert workers (deepinfer expert-worker) computing the routed experts\n"
        "placed on them (--ep-placement: a file of deepinfer eplb -o; default contiguous).\n"
        "--cp-workers: prefill workers (deepinfer cp-worker): a prefill chunk of at least\n"
        "--cp-min-tokens rows (default 1024; chunks are at most the step's token budget) runs\n"
        "split over them and this process (context parallelism, V4 / V4.1 CPU forward; V4 without\n"
        "MTP speculation).\n"
        "--max-batch-tokens (default 256): forward rows per step; a prefill chunk is at most\n"
        "this long.\n"

        "--priority-aging-ms N (default %d; 0: off): a waiting request's priority improves by\n"
        "one level per N ms waited, so a steady stream of better-priority requests cannot\n"
        "starve it (equal priorities are shared between users by tokens received).\n"
        "--eplb-interval STEPS (default 0 = off): every STEPS steps plan a placement from\n"
        "the routing load since the last plan (EPLB, --eplb-slots-per-rank replicas per\n"
        "rank) and apply it when max/mean rank load drops by more than --eplb-min-gain\n"
        "(default 0.05).\n"
        "--device-loss-max N, --device-loss-window S (defaults 3, 600): a lost device (a sticky\n"
        "CUDA error) is rebuilt at most N times within S seconds; beyond that, or when a rebuild\n"
        "fails, /ready and /health answer 503 device_lost and every request gets 503.\n",
        (double)DI_SPEC_MIN_CONFIDENCE_DEFAULT, DI_ENGINE_PRIORITY_AGING_MS);
    fputs("--precision fp32|official: the numerics recipe; default fp32 (the reference's) on the\n"
          "CPU, official (DeepSeek's: FP8 KV and GEMMs, the GPU's fast paths) with --device cuda.\n"
          "--kv-memory MiB: the KV pool. Default: on --device cuda every KV block the GPUs'\n"
          "memory holds after the weights, the slots' state and --dev-reserve (servers sharing a\n"
          "GPU: give each its --kv-memory); elsewhere 256.\n"
          "--dev-reserve MiB (default 1024): device memory every pipeline stage (--device\n"
          "cuda:N,M,...) leaves free; the split holds the most KV blocks on every stage for\n"
          "--max-seqs, --max-ctx and --max-batch-tokens, and --kv-memory's blocks are capped by\n"
          "what the stages have left (docs/cuda.md \"The split\").\n",
          f);
}

// "<n>[k|m|g|t]" (binary multiples; bytes without a suffix) into *out; false if malformed.
static bool parse_bytes(const char *s, size_t *out) {
    char *end = NULL;
    errno = 0;
    unsigned long long v = strtoull(s, &end, 10);
    if (errno || end == s || s[0] == '-') return false;
    int shift = 0;
    switch (*end) {
    case 0:
        break;
    case 'k':
    case 'K':
        shift = 10;
        break;
    case 'm':
    case 'M':
        shift = 20;
        break;
    case 'g':
    case 'G':
        shift = 30;
        break;
    case 't':
    case 'T':
        shift = 40;
        break;
    default:
        return false;
    }
    if (*end && end[1] && strcmp(end + 1, "iB") && strcmp(end + 1, "B")) return false;
    if (v == 0 || v > (~0ull >> shift)) return false;
    *out = (size_t)(v << shift);
    return true;
}

// "<n>[s|m|h|d]" (seconds without a suffix) into *out; false if malformed.
static bool parse_seconds(const char *s, int64_t *out) {
    char *end = NULL;
    errno = 0;
    long long v = strtoll(s, &end, 10);
    if (errno || end == s || v <= 0) return false;
    long long mul = 1;
    if (*end == 'm')
        mul = 60;
    else if (*end == 'h')
        mul = 3600;
    else if (*end == 'd')
        mul = 86400;
    else if (*end && *end != 's')
        return false;
    if (*end && end[1]) return false;
    if (v > INT64_MAX / mul) return false;
    *out = (int64_t)(v * mul);
    return true;
}

static void batch_usage(FILE *f) {
    fprintf(f,
            "usage: deepinfer batch --input FILE|- [--output FILE|-] [--concurrency 64]\n"
            "                       [every model and engine option of deepinfer serve]\n"
            "Answers a file of requests in the OpenAI Batch input format (one JSON object per\n"
            "line: {\"custom_id\", \"method\": \"POST\", \"url\", \"body\"}, url one of\n"
            "/v1/chat/completions, /v1/completions, /v1/responses, /v1/messages) with the serve\n"
            "routes' validation, prompts and answers, up to --concurrency requests in the engine\n"
            "at once, and writes one line of the Batch output format per input line as it\n"
            "completes (--output, default stdout; docs/server.md, \"Offline batches\").\n");
}

// deepinfer serve, or with `batch` deepinfer batch: the same model, engine and request handling,
// its requests read from a file instead of HTTP.
static int serve_main(int argc, char **argv, bool batch) {
    srv *s = calloc(1, sizeof *s);
    if (!s) return 1;
    srv_config *c = &s->cfg;
    *c = (srv_config){.http = di_args_http_defaults(),
                      .max_ctx = 8192,
                      .max_seqs = 16,
                      .priority_aging_ms = DI_ENGINE_PRIORITY_AGING_MS,
                      .max_kv_transfer_bytes = (size_t)1 << 30,
                      .max_inflight = 256,
                      .keepalive_s = 15};
    di_model_args ma = {0};
    ma.opt = di_model_options_default();
    long v;
    int rc = 2;
    const char *batch_in = NULL, *batch_out = "-";
    int batch_concurrency = 64;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (batch && (!strcmp(a, "--input") || !strcmp(a, "--output")) && i + 1 < argc) {
            *(!strcmp(a, "--input") ? &batch_in : &batch_out) = argv[++i];
            continue;
        }
        if (batch && !strcmp(a, "--concurrency") && i + 1 < argc) {
            if (!di_args_int(argv[++i], "--concurrency", 1, 4096, &v)) goto out;
            batch_concurrency = (int)v;
            continue;
        }
        if (batch && (!strcmp(a, "--help") || !strcmp(a, "-h"))) {
            batch_usage(stdout);
            rc = 0;
            goto out;
        }
        int m = di_args_model_option(argc, argv, &i, &ma);
        if (m < 0) goto out;
        if (m > 0) continue;
        m = di_args_http_option(argc, argv, &i, &c->http);
        if (m < 0) goto out;
        if (m > 0) continue;
        bool has = i + 1 < argc;
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
            usage(stdout);
            rc = 0;
            goto out;
        } else if (!strcmp(a, "--served-model-name") && has) {
            c->model_name = argv[++i];
        } else if (!strcmp(a, "--kv-memory") && has) {
            if (!di_args_int(argv[++i], "--kv-memory (MiB)", 1, 1 << 20, &v)) goto out;
            c->kv_memory_bytes = (size_t)v << 20;
        } else if (!strcmp(a, "--kv-disk-dir") && has) {
            c->kv_disk_dir = argv[++i];
        } else if (!strcmp(a, "--kv-disk-bytes") && has) {
            if (!parse_bytes(argv[++i], &c->kv_disk_bytes)) {
                fprintf(stderr, "serve: --kv-disk-bytes takes a size such as 16G, 512M or bytes\n");
                goto out;
            }
        } else if (!strcmp(a, "--kv-disk-queue") && has) {
            if (!parse_bytes(argv[++i], &c->kv_disk_queue_bytes)) {
                fprintf(stderr, "serve: --kv-disk-queue takes a size such as 256M, 1G or bytes\n");
                goto out;
            }
        } else if (!strcmp(a, "--kv-disk-read") && has) {
            if (!parse_bytes(argv[++i], &c->kv_disk_read_bytes)) {
                fprintf(stderr, "serve: --kv-disk-read takes a size such as 1G, 256M or bytes\n");
                goto out;
            }
        } else if (!strcmp(a, "--kv-disk-prefetches") && has) {
            if (!di_args_int(argv[++i], "--kv-disk-prefetches", 1, 64, &v)) goto out;
            c->kv_disk_prefetches = (int32_t)v;
        } else if (!strcmp(a, "--tail-cache-mib") && has) {
            if (!di_args_int(argv[++i], "--tail-cache-mib", 0, 1 << 20, &v)) goto out;
            c->tail_cache_bytes = (size_t)v << 20;
            c->no_tail_cache = v == 0;
        } else if (!strcmp(a, "--kv-disk-ttl") && has) {
            if (!parse_seconds(argv[++i], &c->kv_disk_ttl_s)) {
                fprintf(stderr, "serve: --kv-disk-ttl takes a duration such as 72h, 3d, 90m or "
                                "seconds\n");
                goto out;
            }
        } else if (!strcmp(a, "--max-ctx") && has) {
            if (!di_args_int(argv[++i], "--max-ctx", 16, 1 << 24, &v)) goto out;
            c->max_ctx = (int32_t)v;
        } else if (!strcmp(a, "--max-batch-tokens") && has) {
            if (!di_args_int(argv[++i], "--max-batch-tokens", 1, 1 << 20, &v)) goto out;
            c->max_batch_tokens = (int32_t)v;
        } else if (!strcmp(a, "--device-loss-max") && has) {
            if (!di_args_int(argv[++i], "--device-loss-max", 1, 1 << 20, &v)) goto out;
            c->device_loss_max = (int32_t)v;
        } else if (!strcmp(a, "--device-loss-window") && has) {
            if (!di_args_int(argv[++i], "--device-loss-window", 1, INT32_MAX, &v)) goto out;
            c->device_loss_window_s = (int32_t)v;
        } else if (!strcmp(a, "--priority-aging-ms") && has) {
            if (!di_args_int(argv[++i], "--priority-aging-ms", 0, INT32_MAX, &v)) goto out;
            c->priority_aging_ms = (int32_t)v;
        } else if (!strcmp(a, "--max-seqs") && has) {
            if (!di_args_int(argv[++i], "--max-seqs", 1, 4096, &v)) goto out;
            c->max_seqs = (int32_t)v;
        } else if (!strcmp(a, "--spec-tokens") && has) {
            if (!di_args_int(argv[++i], "--spec-tokens", 0, DI_MAX_SPEC_TOKENS, &v)) goto out;
            c->spec_tokens = (int32_t)v;
        } else if (!strcmp(a, "--spec-min-confidence") && has) {
            char *end = NULL;
            double x = strtod(argv[++i], &end);
            if (!end || *end || !(x >= -1 && x <= 1) || x == 0) {
                fprintf(stderr, "serve: --spec-min-confidence must be a number in [-1, 1], not 0 "
                                "(negative: no cut)\n");
                goto out;
            }
            c->spec_min_confidence = (float)x;
        } else if (!strcmp(a, "--eplb-interval") && has) {
            if (!di_args_int(argv[++i], "--eplb-interval", 0, 1 << 30, &v)) goto out;
            c->eplb_interval = (int32_t)v;
        } else if (!strcmp(a, "--eplb-slots-per-rank") && has) {
            if (!di_args_int(argv[++i], "--eplb-slots-per-rank", 1, 1 << 16, &v)) goto out;
            c->eplb_slots_per_rank = (int32_t)v;
        } else if (!strcmp(a, "--eplb-min-gain") && has) {
            char *end = NULL;
            double x = strtod(argv[++i], &end);
            if (!end || *end || !(x > 0 && x < 100)) {
                fprintf(stderr, "serve: --eplb-min-gain must be a positive number\n");
                goto out;
            }
            c->eplb_min_gain = x;
        } else if (!strcmp(a, "--cache-isolation") && has) {
            const char *mode = argv[++i];
            if (strcmp(mode, "none") && strcmp(mode, "user")) {
                fprintf(stderr, "serve: --cache-isolation takes none or user\n");
                goto out;
            }
            c->cache_isolation_user = !strcmp(mode, "user");
        } else if (!strcmp(a, "--fim")) {
            c->fim = true;
        } else if (!strcmp(a, "--kv-transfer")) {
            c->kv_transfer = true;
        } else if (!strcmp(a, "--kv-transfer-max-bytes") && has) {
            if (!parse_bytes(argv[++i], &c->max_kv_transfer_bytes) || !c->max_kv_transfer_bytes) {
                fprintf(stderr, "serve: --kv-transfer-max-bytes takes a size such as 1G or 512M\n");
                goto out;
            }
        } else if (!strcmp(a, "--max-inflight") && has) {
            if (!di_args_int(argv[++i], "--max-inflight", 1, 100000, &v)) goto out;
            c->max_inflight = (int)v;
        } else if (!strcmp(a, "--keepalive") && has) {
            // seconds, fractions allowed (the tests use 0.05 s to see keep-alives on any machine)
            char *end = NULL;
            double ka = strtod(argv[++i], &end);
            if (!end || *end || !(ka >= 0.01 && ka <= 3600)) {
                fprintf(stderr, "serve: --keepalive must be seconds in [0.01, 3600]\n");
                goto out;
            }
            c->keepalive_s = ka;
        } else {
            fprintf(stderr, "%s: unknown or incomplete option '%s'\n", batch ? "batch" : "serve",
                    a);
            if (batch)
                batch_usage(stderr);
            else
                usage(stderr);
            goto out;
        }
    }
    if (batch && !batch_in) {
        fprintf(stderr, "batch: --input FILE (or - for stdin) is needed\n");
        batch_usage(stderr);
        goto out;
    }
    rc = 1;
    bool builtin = !ma.model;
    if (builtin) {
        fprintf(stderr, "INFO  serve: no --model given: serving the built-in tiny random-weight "
                        "model (its text is meaningless)\n");
        ma.model = di_args_default_model();
        if (!ma.model) goto out;
    } else {
        fprintf(stderr, "INFO  serve: serving the model at %s\n", ma.model);
    }
    c->model_dir = ma.model;
    if (!c->model_name) {
        const char *b = strrchr(ma.model, '/');
        c->model_name = builtin ? "deepinfer-tiny" : (b && b[1] ? b + 1 : ma.model);
    }
    pthread_mutex_init(&s->metrics_mu, NULL);
    s->started_at = (long)time(NULL);
    atomic_store(&s->next_id, (uint64_t)getpid() << 20);
    if (di_tokenizer_load_for_model(ma.model, &s->tok) != DI_OK) {
        fprintf(stderr, "ERROR serve: cannot load the tokenizer for %s\n", ma.model);
        goto out;
    }
    if (di_grammar_vocab_create(s->tok, &s->gvocab) != DI_OK ||
        di_grammar_cache_create(SRV_GRAMMAR_CACHE_N, SRV_GRAMMAR_CACHE_BYTES, &s->gcache) !=
            DI_OK) {
        fprintf(stderr, "ERROR serve: out of memory building the structured-output token trie\n");
        goto out;
    }
    s->think_end = di_tokenizer_token_id(s->tok, "</think>");
    s->dsml = di_tokenizer_token_id(s->tok, "｜DSML｜");
    di_args_model_finish(&ma);
    di_engine_options eo = di_engine_options_default();
    eo.grammar_vocab = s->gvocab;
    eo.n_threads = ma.opt.n_threads;
    eo.precision = ma.opt.precision;
    eo.device = ma.opt.device;
    eo.ep_workers = ma.opt.ep_workers;
    eo.ep_placement = ma.opt.ep_placement;
    eo.cp_workers = ma.opt.cp_workers;
    eo.cp_min_tokens = ma.opt.cp_min_tokens;
    eo.dev_reserve_bytes = ma.opt.dev_reserve_bytes; // --dev-reserve (0: the default)
    eo.eplb_interval = c->eplb_interval;
    eo.eplb_slots_per_rank = c->eplb_slots_per_rank;
    eo.eplb_min_gain = c->eplb_min_gain;
    eo.kv_memory_bytes = c->kv_memory_bytes;
    eo.kv_disk_dir = c->kv_disk_dir;
    eo.kv_disk_bytes = c->kv_disk_bytes;
    eo.kv_disk_ttl_s = c->kv_disk_ttl_s;
    eo.kv_disk_queue_bytes = c->kv_disk_queue_bytes;
    eo.kv_disk_read_bytes = c->kv_disk_read_bytes;
    eo.kv_disk_prefetches = c->kv_disk_prefetches;
    eo.tail_cache_bytes = c->tail_cache_bytes;
    eo.no_tail_cache = c->no_tail_cache;
    eo.max_ctx = c->max_ctx;
    eo.max_seqs = c->max_seqs;
    eo.max_batch_tokens = c->max_batch_tokens;
    eo.priority_aging_ms = c->priority_aging_ms;
    eo.device_loss_max = c->device_loss_max;           // 0: the engine's default (3)
    eo.device_loss_window_s = c->device_loss_window_s; // 0: 600
    eo.spec_tokens = c->spec_tokens;
    eo.spec_min_confidence = c->spec_min_confidence;
    di_status st = di_engine_create(ma.model, &eo, &s->engine);
    if (st != DI_OK) {
        fprintf(stderr, "ERROR serve: cannot start the engine: %s\n", di_status_str(st));
        goto out;
    }
    if (c->kv_transfer) { // refused at start where the engine cannot export or import
        void *x = NULL;
        size_t nx = 0;
        int32_t nb = 0;
        char err[512] = "";
        st = di_engine_kv_export(s->engine, NULL, 0, 0, &x, &nx, &nb, err, sizeof err);
        di_free_buffer(x);
        if (st != DI_OK) {
            fprintf(stderr, "ERROR serve: --kv-transfer: %s\n", err);
            goto out;
        }
    }
    // The checkpoint's configuration (read as the engine's load read it): V4.1 prompts render in
    // the dsv41 format (docs/tokenizer.md); the vocabulary and the positions the model takes.
    di_model_config mc = {0};
    if (di_model_read_config(ma.model, &mc) != DI_OK) {
        fprintf(stderr, "ERROR serve: cannot read the configuration of %s\n", ma.model);
        goto out;
    }
    bool v41 = mc.v41;
    int32_t n_vocab = mc.n_vocab;
    s->encoding = v41 ? 1 : 0;
    s->n_vocab = n_vocab > 0 ? n_vocab : di_tokenizer_n_vocab(s->tok);
    if (v41)
        fprintf(stderr, "INFO  serve: a DeepSeek V4.1 checkpoint: prompts render in the V4.1 "
                        "format\n");
    if (n_vocab > 0 && di_tokenizer_n_vocab(s->tok) > n_vocab)
        fprintf(stderr,
                "WARN  serve: the tokenizer has %d ids but the model's vocabulary has %d: every "
                "prompt holding an id >= %d (special tokens, most text) is refused with 400\n",
                di_tokenizer_n_vocab(s->tok), n_vocab, n_vocab);
    int64_t mp = mc.max_position_embeddings;
    s->n_ctx = mp > 0 && mp < c->max_ctx ? (int32_t)mp : c->max_ctx;
    if (batch) {
        if (batch_concurrency > c->max_inflight) batch_concurrency = c->max_inflight;
        fprintf(stderr, "INFO  batch: model '%s', context %d, up to %d requests at once\n",
                c->model_name, s->n_ctx, batch_concurrency);
        rc = srv_run_batch(s, batch_in, batch_out, batch_concurrency);
        goto out;
    }
    srv_http_on_signals();
    srv_http *h = NULL;
    if (!srv_http_start(s, &h)) goto out;
    atomic_store(&s->ready, true);
    fprintf(stderr, "INFO  serve: listening on http://%s:%d (model '%s', context %d)\n",
            c->http.host, c->http.port, c->model_name, s->n_ctx);
    srv_http_wait_signal();
    atomic_store(&s->draining, true);
    fprintf(stderr, "INFO  serve: shutting down: draining %d in-flight request(s)\n",
            atomic_load(&s->inflight));
    srv_http_drain(h, &s->inflight, c->http.drain_s);
    srv_http_stop(h);
    fprintf(stderr, "INFO  serve: stopped\n");
    rc = 0;
out:
    di_engine_destroy(s->engine);
    di_grammar_cache_destroy(s->gcache); // (requests hold their own references)
    di_grammar_vocab_destroy(s->gvocab); // after the engine, which borrows it
    di_tokenizer_destroy(s->tok);
    if (s->started_at) pthread_mutex_destroy(&s->metrics_mu);
    free(s);
    return rc;
}

int di_cli_serve(int argc, char **argv) {
    return serve_main(argc, argv, false);
}

int di_cli_batch(int argc, char **argv) {
    return serve_main(argc, argv, true);
}
