// deepinfer tokenize / detokenize: text ↔ token ids with a HF tokenizer.json (docs/tokenizer.md).
//   deepinfer tokenize [--tokenizer FILE] [--special] "text"        ids on one line
//   deepinfer tokenize [--tokenizer FILE] [--special] --file IN.jsonl  one JSON array per line
//   deepinfer detokenize [--tokenizer FILE] [--skip-special] ID...   (or ids on stdin)
// Without --tokenizer the committed DeepSeek V4 tokenizer (or $DI_TOKENIZER) is used.
#include <jansson.h> // JSON strings of --file lines (Debian's jansson, as the library uses)
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli/cli.h"
#include "deepinfer.h"

static di_tokenizer *load_tok(const char *path, const char *cmd) {
    di_tokenizer *tok = NULL;
    di_status st = path ? di_tokenizer_load(path, &tok) : di_tokenizer_load_for_model(NULL, &tok);
    if (st != DI_OK) {
        fprintf(stderr, "deepinfer %s: cannot load tokenizer %s: %s\n", cmd,
                path ? path : "(default)", di_status_str(st));
        return NULL;
    }
    return tok;
}

static void print_ids(const int32_t *ids, size_t n, bool json) {
    if (json) putchar('[');
    for (size_t i = 0; i < n; i++)
        printf(json ? "%s%d" : "%s%d", i ? (json ? "," : " ") : "", ids[i]);
    printf(json ? "]\n" : "\n");
}

int di_cli_tokenize(int argc, char **argv) {
    const char *tok_path = NULL, *file = NULL, *text = NULL;
    bool special = false;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--tokenizer") && i + 1 < argc)
            tok_path = argv[++i];
        else if (!strcmp(argv[i], "--file") && i + 1 < argc)
            file = argv[++i];
        else if (!strcmp(argv[i], "--special"))
            special = true;
        else if (!strcmp(argv[i], "--help")) {
            printf(
                "usage: deepinfer tokenize [--tokenizer FILE] [--special] TEXT\n"
                "       deepinfer tokenize [--tokenizer FILE] [--special] --file IN.jsonl\n"
                "Text is plain BPE (special-token text becomes ordinary tokens) unless --special.\n"
                "With --file each input line is a JSON string; each output line its ids as a "
                "JSON array.\n");
            return 0;
        } else if (argv[i][0] == '-' && argv[i][1] == '-') {
            fprintf(stderr, "deepinfer tokenize: unknown option '%s'\n", argv[i]);
            return 2;
        } else if (!text)
            text = argv[i];
        else {
            fprintf(stderr, "deepinfer tokenize: give the text as one argument\n");
            return 2;
        }
    }
    if (!!text == !!file) {
        fprintf(stderr, "deepinfer tokenize: give TEXT or --file (see --help)\n");
        return 2;
    }
    di_tokenizer *tok = load_tok(tok_path, "tokenize");
    if (!tok) return 1;
    int rc = 0;
    int32_t *ids;
    size_t n;
    if (text) {
        di_status st = di_tokenizer_encode(tok, text, strlen(text), special, &ids, &n);
        if (st != DI_OK) {
            fprintf(stderr, "deepinfer tokenize: %s\n", di_status_str(st));
            rc = 1;
        } else {
            print_ids(ids, n, false);
            di_tok_free(ids);
        }
    } else {
        FILE *f = strcmp(file, "-") ? fopen(file, "rb") : stdin;
        if (!f) {
            fprintf(stderr, "deepinfer tokenize: cannot open %s\n", file);
            di_tokenizer_destroy(tok);
            return 1;
        }
        char *line = NULL;
        size_t cap = 0;
        ssize_t len;
        long lineno = 0;
        while ((len = getline(&line, &cap, f)) >= 0) {
            lineno++;
            json_error_t err;
            json_t *s = json_loadb(line, (size_t)len, JSON_DECODE_ANY | JSON_ALLOW_NUL, &err);
            if (!json_is_string(s)) {
                fprintf(stderr, "deepinfer tokenize: %s:%ld: not a JSON string\n", file, lineno);
                json_decref(s);
                rc = 1;
                break;
            }
            di_status st = di_tokenizer_encode(tok, json_string_value(s), json_string_length(s),
                                               special, &ids, &n);
            json_decref(s);
            if (st != DI_OK) {
                fprintf(stderr, "deepinfer tokenize: %s:%ld: %s\n", file, lineno,
                        di_status_str(st));
                rc = 1;
                break;
            }
            print_ids(ids, n, true);
            di_tok_free(ids);
        }
        free(line);
        if (f != stdin) fclose(f);
    }
    di_tokenizer_destroy(tok);
    return rc;
}

int di_cli_detokenize(int argc, char **argv) {
    const char *tok_path = NULL;
    bool skip = false;
    size_t n = 0, cap = 64;
    int32_t *ids = malloc(cap * sizeof *ids);
    bool from_args = false;
    int rc = 0;
    if (!ids) return 1;
    for (int i = 1; i < argc && rc == 0; i++) {
        if (!strcmp(argv[i], "--tokenizer") && i + 1 < argc)
            tok_path = argv[++i];
        else if (!strcmp(argv[i], "--skip-special"))
            skip = true;
        else if (!strcmp(argv[i], "--help")) {
            printf("usage: deepinfer detokenize [--tokenizer FILE] [--skip-special] [ID...]\n"
                   "Ids come from the arguments or, if none, from stdin (separated by spaces, "
                   "commas or brackets). Prints the decoded text.\n");
            free(ids);
            return 0;
        } else {
            char *end;
            long v = strtol(argv[i], &end, 10);
            if (*end || end == argv[i]) {
                fprintf(stderr, "deepinfer detokenize: '%s' is not a token id\n", argv[i]);
                rc = 2;
                break;
            }
            if (n == cap) ids = realloc(ids, (cap *= 2) * sizeof *ids);
            ids[n++] = (int32_t)v;
            from_args = true;
        }
    }
    if (rc == 0 && !from_args) {
        int c;
        long v = 0;
        bool in = false, neg = false;
        while ((c = getchar()) != EOF || in) {
            if (c >= '0' && c <= '9') {
                v = v * 10 + (c - '0');
                in = true;
                if (v > 1 << 30) v = 1 << 30;
            } else if (c == '-' && !in) {
                neg = true;
            } else if (c == EOF || c == ' ' || c == ',' || c == '\n' || c == '\t' || c == '[' ||
                       c == ']' || c == '\r') {
                if (in) {
                    if (n == cap) ids = realloc(ids, (cap *= 2) * sizeof *ids);
                    ids[n++] = (int32_t)(neg ? -v : v);
                }
                v = 0;
                in = neg = false;
                if (c == EOF) break;
            } else {
                fprintf(stderr, "deepinfer detokenize: unexpected character '%c' in the input\n",
                        c);
                rc = 2;
                break;
            }
        }
    }
    di_tokenizer *tok = rc == 0 ? load_tok(tok_path, "detokenize") : NULL;
    if (rc == 0 && !tok) rc = 1;
    if (rc == 0) {
        char *text;
        size_t len;
        di_status st = di_tokenizer_decode(tok, ids, n, skip, &text, &len);
        if (st != DI_OK) {
            fprintf(stderr, "deepinfer detokenize: %s\n", di_status_str(st));
            rc = 1;
        } else {
            fwrite(text, 1, len, stdout);
            putchar('\n');
            di_tok_free(text);
        }
    }
    di_tokenizer_destroy(tok);
    free(ids);
    return rc;
}
