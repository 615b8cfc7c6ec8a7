// deepinfer info --model DIR: the checkpoint's configuration, layer schedule and dtypes; with
// --stages N, the split of its layers into N pipeline stages (a device list of N GPUs): with
// --stage-mem, the KV-aware split for devices with that much free memory (docs/cuda.md "The
// split"), for the device state --max-seqs / --max-ctx / --max-batch-tokens plan.
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli/args.h"
#include "cli/cli.h"

// "MiB[,MiB...]": one value for every stage, or one per stage; false (message printed) otherwise.
static bool parse_mem(const char *v, size_t *out, int *n_out) {
    int n = 0;
    const char *p = v;
    while (*p) {
        char *end = NULL;
        const long long mib = strtoll(p, &end, 10);
        if (end == p || mib < 1 || mib > (1ll << 24) || n == 8 || (*end && *end != ',')) {
            fprintf(stderr, "deepinfer info: --stage-mem wants MiB[,MiB...] (1 to 2^24 each, at "
                            "most 8)\n");
            return false;
        }
        out[n++] = (size_t)mib << 20;
        p = *end ? end + 1 : end;
    }
    if (n == 0) return false;
    *n_out = n;
    return true;
}

int di_cli_info(int argc, char **argv) {
    di_model_args ma = {.opt = di_model_options_default()};
    ma.opt.n_threads = 1;
    long n_stages = 0; // --stages N: the split of the layers into N pipeline stages (no device)
    size_t mem[8];     // --stage-mem: the stages' free bytes
    int n_mem = 0;
    for (int i = 1; i < argc; i++) {
        int r = di_args_model_option(argc, argv, &i, &ma);
        if (r < 0) return 2;
        if (r == 0) {
            if (strcmp(argv[i], "--help") == 0) {
                printf("usage: deepinfer info --model DIR [--device cpu|cuda[:N,...]] "
                       "[--stages N [--stage-mem MiB[,MiB...]] [--dev-reserve MiB]\n"
                       "                      [--max-seqs 16] [--max-ctx 8192] "
                       "[--max-batch-tokens 256]]\n"
                       "  --stages N         the split of the layers into N pipeline stages\n"
                       "  --stage-mem MiB,.. the stages' free device memory (one value: every "
                       "stage's): the\n"
                       "                     split that holds the most KV blocks on every stage, "
                       "its blocks\n"
                       "  --dev-reserve MiB  left free on each stage (default 1024)\n"
                       "  --max-seqs, --max-ctx, --max-batch-tokens: the engine's state the split "
                       "plans for\n");
                return 0;
            }
            if (strcmp(argv[i], "--stage-mem") == 0 && i + 1 < argc) {
                if (!parse_mem(argv[++i], mem, &n_mem)) return 2;
                continue;
            }
            if ((strcmp(argv[i], "--max-seqs") == 0 || strcmp(argv[i], "--max-ctx") == 0 ||
                 strcmp(argv[i], "--max-batch-tokens") == 0) &&
                i + 1 < argc) {
                const char *a = argv[i];
                long v = 0;
                if (!di_args_int(argv[++i], a, 1, 1 << 24, &v)) return 2;
                if (strcmp(a, "--max-seqs") == 0) ma.opt.dev_slots = (int32_t)v;
                if (strcmp(a, "--max-ctx") == 0) ma.opt.dev_ctx = (int32_t)v;
                if (strcmp(a, "--max-batch-tokens") == 0) ma.opt.dev_rows = (int32_t)v;
                continue;
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
    di_args_model_finish(&ma);
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
    if (n_mem > 1 && n_mem != n_stages) {
        fprintf(stderr, "deepinfer info: --stage-mem lists %d stages, --stages %ld\n", n_mem,
                n_stages);
        di_model_destroy(m);
        return 2;
    }
    for (int k = n_mem; n_mem == 1 && k < n_stages && k < 8; k++) mem[k] = mem[0];
    if (n_stages > 0) { // what a device list of n_stages GPUs would hold (the load log's split)
        di_stage_plan sp[DI_DEVICE_MAX_MORE + 1];
        int64_t n_blocks = -1;
        st = di_model_stage_plan(m, (int32_t)n_stages, n_mem ? mem : NULL, sp, &n_blocks);
        for (int32_t k = 0; st == DI_OK && k < (int32_t)n_stages; k++) {
            printf("stage split %d/%d   layers [%d, %d)%s%s, %.1f MiB of weights, %.1f MiB of "
                   "fixed state, %lld bytes per KV block",
                   (int)k, (int)n_stages, (int)sp[k].layer0, (int)sp[k].layer1,
                   k == 0 ? " + embedding" : "", k == n_stages - 1 ? " + head" : "",
                   sp[k].weight_bytes / 1048576.0, sp[k].fixed_bytes / 1048576.0,
                   (long long)sp[k].block_bytes);
            if (n_mem && sp[k].n_blocks == INT64_MAX)
                printf("; %.1f MiB for it: no blocks kept\n", sp[k].budget_bytes / 1048576.0);
            else if (n_mem)
                printf("; %.1f MiB for it: %lld blocks\n", sp[k].budget_bytes / 1048576.0,
                       (long long)sp[k].n_blocks);
            else
                printf("\n");
        }
        if (st == DI_OK && n_mem)
            printf("split summary       %lld KV blocks on every stage (free memory less the "
                   "reserve, after weights and fixed state)\n",
                   (long long)n_blocks);
        else if (st == DI_OK)
            printf("split summary       by weights (no --stage-mem: the devices' memory "
                   "unknown)\n");
        if (st != DI_OK) {
            fprintf(stderr, "deepinfer info: no split into %ld stages: %s\n", n_stages,
                    di_status_str(st));
            rc = 1;
        }
    }
    di_model_destroy(m);
    return rc;
}
