// deepinfer expert-worker and cp-worker: serve a model to fronts over TCP until SIGINT or SIGTERM
// (docs/expert-parallel.md: routed experts; docs/context-parallel.md: pieces of long prefills).
// Both take the same options and run the same way; only the worker they start differs.
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>

#include "base/sock.h" // di_sock_split_addr
#include "cli/args.h"
#include "cli/cli.h"
#include "cp/worker.h" // di_cp_worker
#include "ep/worker.h" // di_ep_worker

typedef struct worker_kind {
    const char *name; // the command
    const char *usage;
    di_status (*start)(di_model *m, const char *host, int port, void **out);
    int (*port)(const void *w);
    void (*stop)(void *w);
} worker_kind;

static di_status ep_start(di_model *m, const char *host, int port, void **out) {
    return di_ep_worker_start(m, host, port, (di_ep_worker **)out);
}
static int ep_port(const void *w) {
    return di_ep_worker_port(w);
}
static void ep_stop(void *w) {
    di_ep_worker_stop(w);
}
static di_status cp_start(di_model *m, const char *host, int port, void **out) {
    return di_cp_worker_start(m, host, port, (di_cp_worker **)out);
}
static int cp_port(const void *w) {
    return di_cp_worker_port(w);
}
static void cp_stop(void *w) {
    di_cp_worker_stop(w);
}

static const worker_kind k_expert = {
    "expert-worker",
    "usage: deepinfer expert-worker --listen HOST:PORT [--model DIR] [--threads N]\n"
    "                               [--precision fp32|official] [--log-level L]\n"
    "Serves the routed experts of the model to fronts started with --ep-workers\n"
    "(generate, logits, bench, serve): each front connects, checks that both sides\n"
    "run the same model (checkpoint and precision), assigns the experts this worker\n"
    "holds and sends their rows every MoE layer. Stateless: any number of fronts may\n"
    "share it. It trusts its fronts: listen on a private network only. HOST may be\n"
    "empty (':9000', every interface). Without --model, the built-in tiny model.\n"
    "Stops on SIGINT / SIGTERM.\n",
    ep_start, ep_port, ep_stop};
static const worker_kind k_cp = {
    "cp-worker",
    "usage: deepinfer cp-worker --listen HOST:PORT [--model DIR] [--threads N]\n"
    "                           [--precision fp32|official] [--log-level L]\n"
    "Computes pieces of long prefills (DeepSeek V4 and V4.1, CPU forward) for fronts\n"
    "started with --cp-workers (generate, logits, serve, bench): each front connects,\n"
    "checks that both sides run the same model (checkpoint and precision), then sends\n"
    "jobs: a piece of a prompt, and layer by layer the state of the pieces before it.\n"
    "Stateless between jobs. List each worker once per front. It trusts its fronts:\n"
    "listen on a private network only. HOST may be empty (':9000', every interface).\n"
    "Without --model, the built-in tiny model. Stops on SIGINT / SIGTERM.\n",
    cp_start, cp_port, cp_stop};

static int run(const worker_kind *k, int argc, char **argv) {
    di_model_args ma = {.opt = di_model_options_default()};
    const char *listen_s = NULL;
    for (int i = 1; i < argc; i++) {
        int r = di_args_model_option(argc, argv, &i, &ma);
        if (r < 0) return 2;
        if (r > 0) continue;
        if (strcmp(argv[i], "--help") == 0) {
            fputs(k->usage, stdout);
            return 0;
        }
        if (strcmp(argv[i], "--listen") == 0 && i + 1 < argc) {
            listen_s = argv[++i];
            continue;
        }
        fprintf(stderr, "deepinfer %s: unknown option or missing value '%s'\n", k->name, argv[i]);
        fputs(k->usage, stderr);
        return 2;
    }
    char host[256];
    int port = 0;
    if (!listen_s || !di_sock_split_addr(listen_s, host, sizeof host, &port)) {
        fprintf(stderr, "deepinfer %s: --listen HOST:PORT is required (PORT 0-65535)\n", k->name);
        return 2;
    }
    if (ma.opt.ep_workers || ma.opt.ep_placement || ma.opt.cp_workers ||
        ma.opt.device.kind != DI_DEVICE_CPU) {
        fprintf(stderr,
                "deepinfer %s: runs on the CPU and has no workers of its own "
                "(no --device, no --ep-workers, no --ep-placement, no --cp-workers)\n",
                k->name);
        return 2;
    }
    if (!ma.model && !(ma.model = di_args_default_model())) return 1;
    // Block the stop signals before any thread starts, so only sigwait sees them.
    sigset_t set;
    sigemptyset(&set);
    sigaddset(&set, SIGINT);
    sigaddset(&set, SIGTERM);
    pthread_sigmask(SIG_BLOCK, &set, NULL);
    di_model *m = NULL;
    di_status st = di_model_load(ma.model, &ma.opt, &m);
    if (st != DI_OK) {
        fprintf(stderr, "deepinfer %s: cannot load %s: %s\n", k->name, ma.model, di_status_str(st));
        return 1;
    }
    void *w = NULL;
    if (k->start(m, host, port, &w) != DI_OK) {
        di_model_destroy(m);
        return 1;
    }
    // The port on stdout (scripts started with port 0 read it), then wait for a stop signal.
    printf("listening on %s:%d\n", host, k->port(w));
    fflush(stdout);
    int sig = 0;
    sigwait(&set, &sig);
    fprintf(stderr, "deepinfer %s: %s, stopping\n", k->name, sig == SIGINT ? "SIGINT" : "SIGTERM");
    k->stop(w);
    di_model_destroy(m);
    return 0;
}

int di_cli_expert_worker(int argc, char **argv) {
    return run(&k_expert, argc, argv);
}

int di_cli_cp_worker(int argc, char **argv) {
    return run(&k_cp, argc, argv);
}
