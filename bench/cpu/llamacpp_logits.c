// llamacpp_logits: evaluates token ids with llama.cpp (public API of llama.h only) and writes the
// logits of every position as raw little-endian float32 [n_tok][n_vocab]. Not part of the
// deepinfer build: bench/cpu/vs_llamacpp_logits.sh compiles it against a llama.cpp tree given in
// $LLAMA_CPP, so that the two engines can be compared on the same GGUF file.
//
//   llamacpp_logits MODEL.gguf 5,17,300,... OUT.f32 [--threads N] [--kv f32|f16]
//                   [--fa auto|on|off] [--dump DIR]
//
// All tokens go through one llama_decode call (one batch, one micro-batch: n_batch = n_ubatch =
// n_tok) with an output requested at every position. --kv sets the K/V cache type (default f32, so
// that the cache does not round what the forward computes; llama.cpp's own default is f16).
// --dump DIR writes every contiguous F32 / I32 tensor the graph computes (cb_eval) as
// DIR/<name>.f32 or .i32 (raw, in ggml order: ne[0] fastest) and one line per tensor in
// DIR/index.txt: name type ne0 ne1 ne2 ne3 op. A name that occurs more than once gets a suffix
// "#k".
#include <errno.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h> // mkdir

#include "llama.h" // the llama.cpp public API (brings ggml.h, ggml-backend.h)

static void usage(FILE *f) {
    fprintf(f, "usage: llamacpp_logits MODEL.gguf TOKENS OUT.f32 [--threads N] [--kv f32|f16]\n"
               "                       [--fa auto|on|off] [--dump DIR]\n"
               "TOKENS: comma-separated token ids; OUT: raw float32 [n_tok][n_vocab]\n");
}

static int parse_tokens(const char *s, llama_token **out, int32_t *n_out) {
    int32_t n = 1;
    for (const char *p = s; *p; p++) n += *p == ',';
    llama_token *t = malloc(sizeof *t * (size_t)n);
    if (!t) return 0;
    int32_t k = 0;
    const char *p = s;
    while (*p) {
        char *end;
        errno = 0;
        long v = strtol(p, &end, 10);
        if (end == p || errno || v < 0 || v > INT32_MAX || (*end && *end != ',')) {
            free(t);
            return 0;
        }
        t[k++] = (llama_token)v;
        p = *end ? end + 1 : end;
    }
    *out = t;
    *n_out = k;
    return k > 0;
}

// ---- tensor dumps (cb_eval) ----

typedef struct dump_state {
    const char *dir; // borrowed
    FILE *index;     // owned
    char (*seen)[GGML_MAX_NAME];
    int32_t *count;
    int32_t n_seen, cap;
} dump_state;

static int32_t seen_count(dump_state *d, const char *name) {
    for (int32_t i = 0; i < d->n_seen; i++)
        if (strcmp(d->seen[i], name) == 0) return d->count[i]++;
    if (d->n_seen == d->cap) {
        int32_t cap = d->cap ? 2 * d->cap : 256;
        void *s = realloc(d->seen, sizeof *d->seen * (size_t)cap);
        if (!s) return -1;
        d->seen = s;
        void *c = realloc(d->count, sizeof *d->count * (size_t)cap);
        if (!c) return -1;
        d->count = c;
        d->cap = cap;
    }
    snprintf(d->seen[d->n_seen], GGML_MAX_NAME, "%s", name);
    d->count[d->n_seen++] = 1;
    return 0;
}

// ask: "do you want this tensor?" (yes, if F32); !ask: its data is ready (CPU backend: in host
// memory; copied with ggml_backend_tensor_get so that another backend would work too).
static bool dump_cb(struct ggml_tensor *t, bool ask, void *user) {
    dump_state *d = user;
    bool f32 = t->type == GGML_TYPE_F32, i32 = t->type == GGML_TYPE_I32;
    if (ask) return f32 || i32;
    if (!(f32 || i32) || !ggml_is_contiguous(t)) return true;
    const char *name = ggml_get_name(t);
    if (!name[0]) return true;
    int32_t k = seen_count(d, name);
    if (k < 0) return false;
    char fname[GGML_MAX_NAME + 16], path[4096];
    if (k == 0)
        snprintf(fname, sizeof fname, "%s", name);
    else
        snprintf(fname, sizeof fname, "%s#%d", name, k);
    for (char *c = fname; *c; c++)
        if (*c == '/' || *c == ' ') *c = '_';
    snprintf(path, sizeof path, "%s/%s.%s", d->dir, fname, f32 ? "f32" : "i32");
    size_t nb = ggml_nbytes(t);
    void *buf = malloc(nb);
    if (!buf) return false;
    ggml_backend_tensor_get(t, buf, 0, nb);
    FILE *f = fopen(path, "wb");
    bool ok = f && fwrite(buf, 1, nb, f) == nb;
    if (f) ok = fclose(f) == 0 && ok;
    free(buf);
    if (!ok) {
        fprintf(stderr, "llamacpp_logits: cannot write %s\n", path);
        return false;
    }
    fprintf(d->index, "%s %s %lld %lld %lld %lld %s\n", fname, f32 ? "f32" : "i32",
            (long long)t->ne[0], (long long)t->ne[1], (long long)t->ne[2], (long long)t->ne[3],
            ggml_op_desc(t));
    return true;
}

// ---- main ----

int main(int argc, char **argv) {
    if (argc < 4) {
        usage(stderr);
        return 2;
    }
    const char *model_path = argv[1], *tokens_s = argv[2], *out_path = argv[3];
    const char *kv = "f32", *fa = "auto", *dump_dir = NULL;
    int n_threads = 1;
    for (int i = 4; i < argc; i++) {
        if (i + 1 >= argc) {
            usage(stderr);
            return 2;
        }
        if (strcmp(argv[i], "--threads") == 0)
            n_threads = atoi(argv[++i]);
        else if (strcmp(argv[i], "--kv") == 0)
            kv = argv[++i];
        else if (strcmp(argv[i], "--fa") == 0)
            fa = argv[++i];
        else if (strcmp(argv[i], "--dump") == 0)
            dump_dir = argv[++i];
        else {
            fprintf(stderr, "llamacpp_logits: unknown option '%s'\n", argv[i]);
            usage(stderr);
            return 2;
        }
    }
    bool kv_ok = strcmp(kv, "f32") == 0 || strcmp(kv, "f16") == 0;
    bool fa_ok = strcmp(fa, "auto") == 0 || strcmp(fa, "on") == 0 || strcmp(fa, "off") == 0;
    llama_token *tokens = NULL;
    int32_t n_tok = 0;
    if (n_threads < 1 || !kv_ok || !fa_ok || !parse_tokens(tokens_s, &tokens, &n_tok)) {
        usage(stderr);
        return 2;
    }

    int rc = 1;
    struct llama_model *model = NULL;
    struct llama_context *ctx = NULL;
    struct llama_batch batch = {0};
    bool batch_made = false;
    FILE *out = NULL;
    dump_state ds = {.dir = dump_dir};

    llama_backend_init();
    struct llama_model_params mp = llama_model_default_params();
    mp.n_gpu_layers = 0;
    if (!(model = llama_model_load_from_file(model_path, mp))) {
        fprintf(stderr, "llamacpp_logits: cannot load %s\n", model_path);
        goto done;
    }
    const struct llama_vocab *vocab = llama_model_get_vocab(model);
    const int32_t n_vocab = llama_vocab_n_tokens(vocab);
    for (int32_t i = 0; i < n_tok; i++)
        if (tokens[i] >= n_vocab) {
            fprintf(stderr, "llamacpp_logits: token %d >= n_vocab %d\n", tokens[i], n_vocab);
            goto done;
        }

    struct llama_context_params cp = llama_context_default_params();
    // A context just large enough (the model's own is up to 1M tokens: a needlessly large cache).
    cp.n_ctx = (uint32_t)((n_tok + 255) / 256 * 256);
    cp.n_batch = (uint32_t)n_tok;
    cp.n_ubatch = (uint32_t)n_tok;
    cp.n_seq_max = 1;
    cp.n_threads = n_threads;
    cp.n_threads_batch = n_threads;
    cp.type_k = cp.type_v = strcmp(kv, "f32") == 0 ? GGML_TYPE_F32 : GGML_TYPE_F16;
    cp.flash_attn_type = strcmp(fa, "on") == 0    ? LLAMA_FLASH_ATTN_TYPE_ENABLED
                         : strcmp(fa, "off") == 0 ? LLAMA_FLASH_ATTN_TYPE_DISABLED
                                                  : LLAMA_FLASH_ATTN_TYPE_AUTO;
    if (dump_dir) {
        mkdir(dump_dir, 0777); // may exist
        char path[4096];
        snprintf(path, sizeof path, "%s/index.txt", dump_dir);
        if (!(ds.index = fopen(path, "w"))) {
            fprintf(stderr, "llamacpp_logits: cannot write %s\n", path);
            goto done;
        }
        cp.cb_eval = dump_cb;
        cp.cb_eval_user_data = &ds;
    }
    if (!(ctx = llama_init_from_model(model, cp))) {
        fprintf(stderr, "llamacpp_logits: cannot create a context\n");
        goto done;
    }

    batch = llama_batch_init(n_tok, 0, 1);
    batch_made = true;
    for (int32_t i = 0; i < n_tok; i++) {
        batch.token[i] = tokens[i];
        batch.pos[i] = i;
        batch.n_seq_id[i] = 1;
        batch.seq_id[i][0] = 0;
        batch.logits[i] = 1;
    }
    batch.n_tokens = n_tok;
    int32_t r = llama_decode(ctx, batch);
    if (r != 0) {
        fprintf(stderr, "llamacpp_logits: llama_decode returned %d\n", r);
        goto done;
    }
    if (!(out = fopen(out_path, "wb"))) {
        fprintf(stderr, "llamacpp_logits: cannot write %s\n", out_path);
        goto done;
    }
    for (int32_t i = 0; i < n_tok; i++) {
        const float *row = llama_get_logits_ith(ctx, i);
        if (!row) {
            fprintf(stderr, "llamacpp_logits: no logits for position %d\n", i);
            goto done;
        }
        if (fwrite(row, sizeof(float), (size_t)n_vocab, out) != (size_t)n_vocab) {
            fprintf(stderr, "llamacpp_logits: cannot write %s\n", out_path);
            goto done;
        }
    }
    if (fclose(out) != 0) {
        out = NULL;
        fprintf(stderr, "llamacpp_logits: cannot write %s\n", out_path);
        goto done;
    }
    out = NULL;
    fprintf(stderr, "llamacpp_logits: %d tokens x %d logits -> %s\n", n_tok, n_vocab, out_path);
    rc = 0;
done:
    if (out) fclose(out);
    if (ds.index) fclose(ds.index);
    free(ds.seen);
    free(ds.count);
    if (batch_made) llama_batch_free(batch);
    if (ctx) llama_free(ctx);
    if (model) llama_model_free(model);
    llama_backend_free();
    free(tokens);
    return rc;
}
