// deepinfer synth --out DIR [--preset tiny|tiny-128|flash-4l|flash-full[-<N>l]|v41-tiny|
//                                     v41-flash-4l]
//                 [--layout official|hf] [--seed N]
#include <errno.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>

#include "cli/args.h"
#include "cli/cli.h"

int di_cli_synth(int argc, char **argv) {
    const char *preset = "tiny", *out = NULL, *layout = "official";
    long seed = 1234;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (strcmp(a, "--help") == 0) {
            printf("usage: deepinfer synth --out DIR [--preset tiny|tiny-128|flash-4l|"
                   "flash-full[-<N>l]|v41-tiny|v41-flash-4l] "
                   "[--layout official|hf] [--seed N]\n"
                   "Writes a random-weight DeepSeek V4 (or V4.1: v41-tiny, v41-flash-4l) "
                   "checkpoint; its text is meaningless.\n");
            return 0;
        }
        if (i + 1 >= argc) {
            fprintf(stderr, "deepinfer synth: '%s' needs a value\n", a);
            return 2;
        }
        const char *v = argv[++i];
        if (strcmp(a, "--preset") == 0)
            preset = v;
        else if (strcmp(a, "--out") == 0)
            out = v;
        else if (strcmp(a, "--layout") == 0)
            layout = v;
        else if (strcmp(a, "--seed") == 0) {
            if (!di_args_int(v, "--seed", 0, 0x7fffffffL, &seed)) return 2;
        } else {
            fprintf(stderr, "deepinfer synth: unknown option '%s'\n", a);
            return 2;
        }
    }
    if (!out || (strcmp(layout, "official") != 0 && strcmp(layout, "hf") != 0)) {
        fprintf(stderr, "deepinfer synth: --out DIR is required; --layout is official or hf\n");
        return 2;
    }
    if (mkdir(out, 0755) != 0 && errno != EEXIST) {
        fprintf(stderr, "deepinfer synth: cannot create %s: %s\n", out, strerror(errno));
        return 1;
    }
    di_status st =
        di_synth_checkpoint(preset, out, strcmp(layout, "official") == 0, (uint64_t)seed);
    if (st != DI_OK) {
        fprintf(stderr, "deepinfer synth: %s\n", di_status_str(st));
        return st == DI_ERR_INVALID ? 2 : 1;
    }
    fprintf(stderr, "deepinfer synth: wrote %s (%s, %s layout, seed %ld)\n", out, preset, layout,
            seed);
    return 0;
}
