// deepinfer info --model DIR: the checkpoint's configuration, layer schedule and dtypes.
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli/args.h"
#include "cli/cli.h"

int di_cli_info(int argc, char **argv) {
    di_model_args ma = {.opt = di_model_options_default()};
    ma.opt.n_threads = 1;
    for (int i = 1; i < argc; i++) {
        int r = di_args_model_option(argc, argv, &i, &ma);
        if (r < 0) return 2;
        if (r == 0) {
            if (strcmp(argv[i], "--help") == 0) {
                printf("usage: deepinfer info --model DIR [--device cpu|cuda[:N]]\n");
                return 0;
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
    di_model_destroy(m);
    return 0;
}
