// deepinfer render --model DIR --request FILE.json [--api chat|responses|messages|raw]
//   [--encoding dsv4|dsv41] [--effort-table 0424|0731] [--official] [--ids-only]
// Prints the rendered prompt text, then a line "ids: ..." with its token ids. The tokenizer is
// DIR/tokenizer.json (or the committed V4 copy); the encoding is dsv41 when DIR/config.json names
// a V4.1 model, else dsv4, unless --encoding says otherwise.
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli/cli.h"
#include "deepinfer.h"

static char *slurp(const char *path, size_t *n) {
    FILE *f = strcmp(path, "-") ? fopen(path, "rb") : stdin;
    if (!f) return NULL;
    size_t cap = 1 << 16, len = 0;
    char *b = malloc(cap);
    size_t got;
    while (b && (got = fread(b + len, 1, cap - len, f)) > 0) {
        len += got;
        if (len == cap) b = realloc(b, cap *= 2);
    }
    if (f != stdin) fclose(f);
    *n = len;
    return b;
}

// dsv41 for a DeepSeek V4.1 checkpoint (di_model_read_config), else dsv4 (no DIR, or no
// configuration there: the committed V4 tokenizer's format).
static int encoding_of_model(const char *dir) {
    di_model_config mc;
    return dir && di_model_read_config(dir, &mc) == DI_OK && mc.v41 ? 1 : 0;
}

int di_cli_render(int argc, char **argv) {
    const char *model = NULL, *request = NULL, *api_s = "chat";
    di_render_options opt = di_render_options_default();
    int enc = -1;
    bool ids_only = false, points = false;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--model") && i + 1 < argc)
            model = argv[++i];
        else if (!strcmp(argv[i], "--request") && i + 1 < argc)
            request = argv[++i];
        else if (!strcmp(argv[i], "--api") && i + 1 < argc)
            api_s = argv[++i];
        else if (!strcmp(argv[i], "--encoding") && i + 1 < argc) {
            const char *e = argv[++i];
            enc = !strcmp(e, "dsv41") ? 1 : !strcmp(e, "dsv4") ? 0 : -2;
            if (enc == -2) {
                fprintf(stderr, "deepinfer render: --encoding is dsv4 or dsv41\n");
                return 2;
            }
        } else if (!strcmp(argv[i], "--effort-table") && i + 1 < argc) {
            opt.effort_table_0731 = !strcmp(argv[++i], "0731");
        } else if (!strcmp(argv[i], "--official"))
            opt.official = true;
        else if (!strcmp(argv[i], "--ids-only"))
            ids_only = true;
        else if (!strcmp(argv[i], "--points"))
            points = true;
        else if (!strcmp(argv[i], "--help")) {
            printf("usage: deepinfer render [--model DIR] --request FILE.json "
                   "[--api chat|responses|messages|raw]\n"
                   "       [--encoding dsv4|dsv41] [--effort-table 0424|0731] [--official] "
                   "[--ids-only] [--points]\n"
                   "Prints the prompt text and its token ids (a line starting \"ids:\"); "
                   "--points: then its\n"
                   "snapshot points (\"points: system_end S at: P ...\", token offsets; "
                   "docs/kv-cache.md).\n");
            return 0;
        } else {
            fprintf(stderr, "deepinfer render: unknown option '%s'\n", argv[i]);
            return 2;
        }
    }
    di_render_api api;
    if (!strcmp(api_s, "chat"))
        api = DI_RENDER_API_CHAT;
    else if (!strcmp(api_s, "responses"))
        api = DI_RENDER_API_RESPONSES;
    else if (!strcmp(api_s, "messages"))
        api = DI_RENDER_API_MESSAGES;
    else if (!strcmp(api_s, "raw"))
        api = DI_RENDER_API_RAW;
    else {
        fprintf(stderr, "deepinfer render: --api is chat, responses, messages or raw\n");
        return 2;
    }
    if (!request) {
        fprintf(stderr, "deepinfer render: --request FILE.json is required\n");
        return 2;
    }
    opt.encoding = enc >= 0 ? enc : encoding_of_model(model);
    size_t n;
    char *json = slurp(request, &n);
    if (!json) {
        fprintf(stderr, "deepinfer render: cannot read %s\n", request);
        return 1;
    }
    di_tokenizer *tok = NULL;
    di_status st = di_tokenizer_load_for_model(model, &tok);
    char *text = NULL;
    size_t n_text = 0, n_ids = 0;
    int32_t *ids = NULL;
    di_render_points pts;
    if (st == DI_OK)
        st = di_render_request_points(tok, json, n, api, &opt, &text, &n_text, &ids, &n_ids,
                                      points ? &pts : NULL);
    free(json);
    if (st != DI_OK) {
        fprintf(stderr, "deepinfer render: %s\n", di_status_str(st));
        di_tokenizer_destroy(tok);
        return 1;
    }
    if (!ids_only) {
        fwrite(text, 1, n_text, stdout);
        putchar('\n');
    }
    printf("ids:");
    for (size_t i = 0; i < n_ids; i++) printf(" %d", ids[i]);
    printf("\n");
    if (points) {
        printf("points: system_end %d at:", (int)pts.system_end);
        for (int32_t i = 0; i < pts.n; i++) printf(" %d", (int)pts.at[i]);
        printf("\n");
    }
    di_tok_free(text);
    di_tok_free(ids);
    di_tokenizer_destroy(tok);
    return 0;
}
