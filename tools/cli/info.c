// deepinfer info --model DIR: the checkpoint's configuration, layer schedule and dtypes; with
// --stages N, the split of its layers into N pipeline stages (a device list of N GPUs).
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli/args.h"
#include "cli/cli.h"

int di_cli_info(int argc, char **argv) {
    di_model_args ma = {.opt = di_model_options_default()};
    ma.opt.n_threads = 1;
    long n_stages = 0; // --stages N: the split of the layers into N pipeline stages (no device)
    for (int i = 1; i < argc; i++) {
        int r = di_args_model_option(argc, argv, &i, &ma);
        if (r < 0) return 2;
        if (r == 0) {
            if (strcmp(argv[i], "--help") == 0) {
                printf("usage: deepinfer info --model DIR [--device cpu|cuda[:N,...]] "
                       "[--stages N]\n");
                return 0;
            }
            if (strcmp(argv[i], "--stages") == 0 && i + 1 < argc) {
                if (!di_args_int(argv[++i], "--stages", 1, DI_DEVICE_MAX_MORE + 1, &n_stages))
                    return 2;
                continue;
            }
            fprintf(stderr, "deepinfer info: unknown option '%s'\n", argv[i]);
            return 2;
        }
    }
    if (!ma.model && !(ma.model = di_args_default_model())) return 1;
    di_model *m = NULL;
    di_status st = di_model_load(ma.model, &ma.opt, &m);
    if (st != DI_OK) {
        fprintf(stderr, "deepinfer info: cannot load %s: %s\n", ma.model, di_status_str(st));
        return 1;
    }
    size_t n = di_model_describe(m, NULL, 0);
    char *buf = malloc(n + 1);
    if (buf) {
        di_model_describe(m, buf, n + 1);
        fputs(buf, stdout);
        free(buf);
    }
    int rc = 0;
    if (n_stages > 0) { // what a device list of n_stages GPUs would hold (the load log's split)
        int32_t l0[DI_DEVICE_MAX_MORE + 2];
        int64_t bytes[DI_DEVICE_MAX_MORE + 1];
        st = di_model_stage_split(m, (int32_t)n_stages, l0, bytes);
        for (int32_t k = 0; st == DI_OK && k < (int32_t)n_stages; k++)
            printf("stage split %d/%d   layers [%d, %d)%s%s, %.1f MiB of weights\n", (int)k,
                   (int)n_stages, (int)l0[k], (int)l0[k + 1], k == 0 ? " + embedding" : "",
                   k == n_stages - 1 ? " + head" : "", bytes[k] / 1048576.0);
        if (st != DI_OK) {
            fprintf(stderr, "deepinfer info: no split into %ld stages: %s\n", n_stages,
                    di_status_str(st));
            rc = 1;
        }
    }
    di_model_destroy(m);
    return rc;
}
