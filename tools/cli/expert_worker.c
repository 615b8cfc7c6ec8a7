// deepinfer expert-worker: serves a model's routed experts to fronts over TCP
// (docs/expert-parallel.md) until SIGINT or SIGTERM.
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>

#include "cli/args.h"
#include "cli/cli.h"
#include "base/sock.h" // di_sock_split_addr
#include "ep/worker.h" // di_ep_worker

static void usage(FILE *f) {
    fprintf(f, "usage: deepinfer expert-worker --listen HOST:PORT [--model DIR] [--threads N]\n"
               "                               [--precision fp32|official] [--log-level L]\n"
               "Serves the routed experts of the model to fronts started with --ep-workers\n"
               "(generate, logits, bench, serve): each front connects, checks that both sides\n"
               "run the same model (checkpoint and precision), assigns the experts this worker\n"
               "holds and sends their rows every MoE layer. Stateless: any number of fronts may\n"
               "share it. It trusts its fronts: listen on a private network only. HOST may be\n"
               "empty (':9000', every interface). Without --model, the built-in tiny model.\n"
               "Stops on SIGINT / SIGTERM.\n");
}

int di_cli_expert_worker(int argc, char **argv) {
    di_model_args ma = {.opt = di_model_options_default()};
    const char *listen_s = NULL;
    for (int i = 1; i < argc; i++) {
        int r = di_args_model_option(argc, argv, &i, &ma);
        if (r < 0) return 2;
        if (r > 0) continue;
        if (strcmp(argv[i], "--help") == 0) {
            usage(stdout);
            return 0;
        }
        if (strcmp(argv[i], "--listen") == 0 && i + 1 < argc) {
            listen_s = argv[++i];
            continue;
        }
        fprintf(stderr, "deepinfer expert-worker: unknown option or missing value '%s'\n", argv[i]);
        usage(stderr);
        return 2;
    }
    char host[256];
    int port = 0;
    if (!listen_s || !di_sock_split_addr(listen_s, host, sizeof host, &port)) {
        fprintf(stderr, "deepinfer expert-worker: --listen HOST:PORT is required (PORT 0-65535)\n");
        return 2;
    }
    if (ma.opt.ep_workers || ma.opt.ep_placement || ma.opt.device.kind != DI_DEVICE_CPU) {
        fprintf(stderr, "deepinfer expert-worker: runs on the CPU and has no workers of its own "
                        "(no --device, no --ep-workers, no --ep-placement)\n");
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
        fprintf(stderr, "deepinfer expert-worker: cannot load %s: %s\n", ma.model,
                di_status_str(st));
        return 1;
    }
    di_ep_worker *w = NULL;
    if (di_ep_worker_start(m, host, port, &w) != DI_OK) {
        di_model_destroy(m);
        return 1;
    }
    // The port on stdout (scripts started with port 0 read it), then wait for a stop signal.
    printf("listening on %s:%d\n", host, di_ep_worker_port(w));
    fflush(stdout);
    int sig = 0;
    sigwait(&set, &sig);
    fprintf(stderr, "deepinfer expert-worker: %s, stopping\n",
            sig == SIGINT ? "SIGINT" : "SIGTERM");
    di_ep_worker_stop(w);
    di_model_destroy(m);
    return 0;
}
