// deepinfer convert --model DIR --out FILE.gguf [--to gguf] [--type q8_0|q4_k|bf16|f16|f32]
#include <stdio.h>
#include <string.h>

#include "cli/cli.h"
#include "deepinfer.h"

int di_cli_convert(int argc, char **argv) {
    const char *model = NULL, *out = NULL, *to = "gguf", *type = "q8_0";
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (strcmp(a, "--help") == 0) {
            printf("usage: deepinfer convert --model DIR --out FILE.gguf [--to gguf] "
                   "[--type q8_0|q4_k|bf16|f16|f32]\n"
                   "Converts an official-layout checkpoint (config.json + safetensors) to a GGUF "
                   "file of llama.cpp's deepseek4 architecture.\n"
                   "  q8_0  as llama.cpp's converter: FP8 -> Q8_0, FP4 experts -> MXFP4, float "
                   "kept (default)\n"
                   "  q4_k  every 2-D weight Q4_K (experts too)\n"
                   "  bf16, f16  FP8 -> that float type, FP4 experts -> MXFP4\n"
                   "  f32   every tensor F32, experts too (no quantised tensor)\n");
            return 0;
        }
        if (i + 1 >= argc) {
            fprintf(stderr, "deepinfer convert: '%s' needs a value\n", a);
            return 2;
        }
        const char *v = argv[++i];
        if (strcmp(a, "--model") == 0)
            model = v;
        else if (strcmp(a, "--out") == 0)
            out = v;
        else if (strcmp(a, "--to") == 0)
            to = v;
        else if (strcmp(a, "--type") == 0)
            type = v;
        else {
            fprintf(stderr, "deepinfer convert: unknown option '%s'\n", a);
            return 2;
        }
    }
    if (!model || !out || strcmp(to, "gguf") != 0) {
        fprintf(stderr, "deepinfer convert: --model DIR and --out FILE are required; --to gguf\n");
        return 2;
    }
    di_status st = di_convert_gguf(model, out, type);
    if (st != DI_OK) {
        fprintf(stderr, "deepinfer convert: %s\n", di_status_str(st));
        return st == DI_ERR_INVALID ? 2 : 1;
    }
    fprintf(stderr, "deepinfer convert: wrote %s (%s)\n", out, type);
    return 0;
}
