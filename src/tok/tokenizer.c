// tokenizer — the public di_tokenizer API (include/deepinfer.h): vocab + pre-tokenizer + BPE,
// added-token splitting, UTF-8 validation, HF-compatible decoding.
// Thread-safety: a di_tokenizer is immutable after load; per-call scratch comes from a small
// mutex-protected pool so encode may run on any number of threads.
#include "tok/tokenizer.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "base/log.h"
#include "base/mem.h"
#include "tok/bpe.h"
#include "tok/pretok.h"

// ---- contexts ----

typedef struct enc_ctx {
    di_pretok_ctx *pre;   // owned
    di_bpe_scratch bpe;   // owned
    struct enc_ctx *next; // free-list link
} enc_ctx;

struct di_tokenizer {
    di_vocab *vocab;   // owned
    di_pretok *pretok; // owned
    pthread_mutex_t lock;
    enc_ctx *free_ctx; // owned free list, guarded by lock
};

static void ctx_destroy(enc_ctx *c) {
    if (!c) return;
    di_pretok_ctx_destroy(c->pre);
    di_bpe_scratch_deinit(&c->bpe);
    di_free(c);
}

static enc_ctx *ctx_acquire(const di_tokenizer *ctok) {
    di_tokenizer *tok = (di_tokenizer *)ctok; // the pool is the only mutable part
    pthread_mutex_lock(&tok->lock);
    enc_ctx *c = tok->free_ctx;
    if (c) tok->free_ctx = c->next;
    pthread_mutex_unlock(&tok->lock);
    if (c) return c;
    c = di_calloc(1, sizeof *c);
    if (!c) return NULL;
    di_bpe_scratch_init(&c->bpe);
    if (di_pretok_ctx_create(tok->pretok, &c->pre) != DI_OK) {
        di_free(c);
        return NULL;
    }
    return c;
}

static void ctx_release(const di_tokenizer *ctok, enc_ctx *c) {
    di_tokenizer *tok = (di_tokenizer *)ctok;
    pthread_mutex_lock(&tok->lock);
    c->next = tok->free_ctx;
    tok->free_ctx = c;
    pthread_mutex_unlock(&tok->lock);
}

// ---- lifecycle ----

di_status di_tokenizer_load(const char *path, di_tokenizer **out) {
    if (!path || !out) return DI_ERR_INVALID;
    di_tokenizer *tok = di_calloc(1, sizeof *tok);
    if (!tok) return DI_ERR_NOMEM;
    pthread_mutex_init(&tok->lock, NULL);
    di_status st = di_vocab_load(path, &tok->vocab);
    if (st == DI_OK) st = di_pretok_create(&tok->pretok);
    if (st != DI_OK) {
        di_tokenizer_destroy(tok);
        return st;
    }
    *out = tok;
    return DI_OK;
}

static bool file_exists(const char *p) {
    struct stat sb;
    return stat(p, &sb) == 0 && S_ISREG(sb.st_mode);
}

static char g_default_path[4096];
static pthread_once_t g_default_once = PTHREAD_ONCE_INIT;

static void init_default_path(void) {
    // __FILE__ is <root>/src/tok/tokenizer.c (CMake compiles with absolute paths)
    const char *f = __FILE__;
    size_t n = strlen(f);
    int slashes = 0;
    while (n > 0 && slashes < 3)
        if (f[--n] == '/') slashes++;
    if (slashes == 3)
        snprintf(g_default_path, sizeof g_default_path, "%.*s/%s", (int)n, f,
                 DI_TOKENIZER_DEFAULT_REL);
    else
        snprintf(g_default_path, sizeof g_default_path, "%s", DI_TOKENIZER_DEFAULT_REL);
}

const char *di_tokenizer_default_path(void) {
    const char *env = getenv("DI_TOKENIZER");
    if (env && *env) return env;
    pthread_once(&g_default_once, init_default_path);
    return g_default_path;
}

di_status di_tokenizer_load_for_model(const char *model_dir, di_tokenizer **out) {
    if (model_dir) {
        size_t n = strlen(model_dir) + 32;
        char *p = di_malloc(n);
        if (!p) return DI_ERR_NOMEM;
        snprintf(p, n, "%s/tokenizer.json", model_dir);
        if (file_exists(p)) {
            di_status st = di_tokenizer_load(p, out);
            di_free(p);
            return st;
        }
        di_free(p);
        DI_LOG_INFO("%s has no tokenizer.json; using %s", model_dir, di_tokenizer_default_path());
    }
    return di_tokenizer_load(di_tokenizer_default_path(), out);
}

void di_tokenizer_destroy(di_tokenizer *tok) {
    if (!tok) return;
    while (tok->free_ctx) {
        enc_ctx *c = tok->free_ctx;
        tok->free_ctx = c->next;
        ctx_destroy(c);
    }
    di_pretok_destroy(tok->pretok);
    di_vocab_destroy(tok->vocab);
    pthread_mutex_destroy(&tok->lock);
    di_free(tok);
}

void di_tok_free(void *p) {
    di_free(p);
}

const di_vocab *di_tokenizer_vocab(const di_tokenizer *tok) {
    return tok->vocab;
}

// ---- lookups ----

int32_t di_tokenizer_n_vocab(const di_tokenizer *tok) {
    return tok->vocab->n_vocab;
}

int32_t di_tokenizer_token_id(const di_tokenizer *tok, const char *text) {
    return text ? di_vocab_find(tok->vocab, text, strlen(text)) : -1;
}

const char *di_tokenizer_token_bytes(const di_tokenizer *tok, int32_t id, size_t *n_bytes) {
    const di_vocab *v = tok->vocab;
    if (!di_vocab_valid(v, id)) return NULL;
    *n_bytes = v->tok_off[id + 1] - v->tok_off[id];
    return v->tok_bytes + v->tok_off[id];
}

bool di_tokenizer_is_special(const di_tokenizer *tok, int32_t id) {
    return di_vocab_valid(tok->vocab, id) && (tok->vocab->tok_flags[id] & DI_VOCAB_FLAG_SPECIAL);
}

// ---- UTF-8 ----

size_t di_utf8_valid_prefix(const char *s, size_t n) {
    const unsigned char *u = (const unsigned char *)s;
    size_t i = 0;
    while (i < n) {
        unsigned char c = u[i];
        if (c < 0x80) {
            i++;
            continue;
        }
        size_t len;
        unsigned char lo = 0x80, hi = 0xBF;
        if (c >= 0xC2 && c <= 0xDF)
            len = 2;
        else if (c >= 0xE0 && c <= 0xEF) {
            len = 3;
            if (c == 0xE0) lo = 0xA0;
            if (c == 0xED) hi = 0x9F; // no surrogates
        } else if (c >= 0xF0 && c <= 0xF4) {
            len = 4;
            if (c == 0xF0) lo = 0x90;
            if (c == 0xF4) hi = 0x8F;
        } else
            return i;
        if (i + len > n) return i;
        if (u[i + 1] < lo || u[i + 1] > hi) return i;
        for (size_t k = 2; k < len; k++)
            if (u[i + k] < 0x80 || u[i + k] > 0xBF) return i;
        i += len;
    }
    return n;
}

// Length of the maximal invalid subpart at s[0] (the unit that one U+FFFD replaces), or 0 if s
// starts with a valid character or with a valid but truncated prefix that needs more bytes (only
// when !final).
size_t di_utf8_invalid_len(const char *s, size_t n, bool final, bool *need_more) {
    const unsigned char *u = (const unsigned char *)s;
    *need_more = false;
    unsigned char c = u[0];
    size_t len;
    unsigned char lo = 0x80, hi = 0xBF;
    if (c < 0x80) return 0;
    if (c >= 0xC2 && c <= 0xDF)
        len = 2;
    else if (c >= 0xE0 && c <= 0xEF) {
        len = 3;
        if (c == 0xE0) lo = 0xA0;
        if (c == 0xED) hi = 0x9F;
    } else if (c >= 0xF0 && c <= 0xF4) {
        len = 4;
        if (c == 0xF0) lo = 0x90;
        if (c == 0xF4) hi = 0x8F;
    } else
        return 1;
    for (size_t k = 1; k < len; k++) {
        if (k >= n) {
            if (!final) *need_more = true;
            return final ? k : 0;
        }
        unsigned char b = u[k];
        unsigned char l = k == 1 ? lo : 0x80, h = k == 1 ? hi : 0xBF;
        if (b < l || b > h) return k;
    }
    return 0;
}

di_status di_utf8_append_lossy(di_buf *out, const char *s, size_t n, bool final, size_t *consumed) {
    static const char k_fffd[3] = {(char)0xEF, (char)0xBF, (char)0xBD};
    size_t i = 0;
    di_status st;
    while (i < n) {
        size_t ok = di_utf8_valid_prefix(s + i, n - i);
        if (ok && (st = di_buf_append(out, s + i, ok)) != DI_OK) return st;
        i += ok;
        if (i == n) break;
        bool more;
        size_t bad = di_utf8_invalid_len(s + i, n - i, final, &more);
        if (more) break; // an incomplete character at the end: keep it for later
        if ((st = di_buf_append(out, k_fffd, 3)) != DI_OK) return st;
        i += bad;
    }
    if (consumed) *consumed = i;
    return di_buf_append(out, "", 0);
}

// ---- encoding ----

typedef struct piece_sink {
    const di_vocab *v;
    di_bpe_scratch *bpe;
    di_bpe_ids *out;
} piece_sink;

static di_status on_piece(void *user, const char *piece, size_t n) {
    piece_sink *ps = user;
    return di_bpe_encode_piece(ps->v, ps->bpe, piece, n, ps->out);
}

// Plain text (no added tokens) → ids.
static di_status encode_plain(const di_tokenizer *tok, enc_ctx *c, const char *text, size_t n,
                              di_bpe_ids *out) {
    if (n == 0) return DI_OK;
    piece_sink ps = {tok->vocab, &c->bpe, out};
    return di_pretok_split(tok->pretok, c->pre, text, n, on_piece, &ps);
}

// Gaps between normalized=false added tokens: split out normalized=true ones (HF's second pass).
static di_status encode_norm_pass(const di_tokenizer *tok, enc_ctx *c, const char *text, size_t n,
                                  di_bpe_ids *out) {
    const di_vocab *v = tok->vocab;
    size_t start = 0;
    di_status st;
    for (size_t i = 0; i < n;) {
        size_t len;
        int32_t id = di_vocab_trie_match(&v->trie_norm, text, n, i, &len);
        if (id < 0) {
            i++;
            continue;
        }
        if ((st = encode_plain(tok, c, text + start, i - start, out)) != DI_OK) return st;
        if ((st = di_bpe_ids_push(out, id)) != DI_OK) return st;
        i += len;
        start = i;
    }
    return encode_plain(tok, c, text + start, n - start, out);
}

di_status di_tokenizer_encode_into(const di_tokenizer *tok, const char *text, size_t n,
                                   bool special, di_bpe_ids *out) {
    size_t valid = di_utf8_valid_prefix(text, n);
    if (valid != n) {
        DI_LOG_ERROR("tokenizer: input is not valid UTF-8 (byte %zu of %zu)", valid, n);
        return DI_ERR_INVALID;
    }
    enc_ctx *c = ctx_acquire(tok);
    if (!c) return DI_ERR_NOMEM;
    di_status st = DI_OK;
    if (!special) {
        st = encode_plain(tok, c, text, n, out);
    } else {
        const di_vocab *v = tok->vocab;
        size_t start = 0;
        for (size_t i = 0; i < n && st == DI_OK;) {
            size_t len;
            int32_t id = di_vocab_trie_match(&v->trie_raw, text, n, i, &len);
            if (id < 0) {
                i++;
                continue;
            }
            st = encode_norm_pass(tok, c, text + start, i - start, out);
            if (st == DI_OK) st = di_bpe_ids_push(out, id);
            i += len;
            start = i;
        }
        if (st == DI_OK) st = encode_norm_pass(tok, c, text + start, n - start, out);
    }
    ctx_release(tok, c);
    return st;
}

di_status di_tokenizer_encode(const di_tokenizer *tok, const char *text, size_t n_bytes,
                              bool special, int32_t **ids, size_t *n_ids) {
    if (!tok || (!text && n_bytes) || !ids || !n_ids) return DI_ERR_INVALID;
    di_bpe_ids out = {0};
    di_status st = di_tokenizer_encode_into(tok, text ? text : "", n_bytes, special, &out);
    if (st != DI_OK) {
        di_bpe_ids_deinit(&out);
        return st;
    }
    *ids = out.ids;
    *n_ids = out.n;
    return DI_OK;
}

// ---- decoding ----

di_status di_tokenizer_decode_raw(const di_tokenizer *tok, const int32_t *ids, size_t n_ids,
                                  bool skip_special, di_buf *out) {
    const di_vocab *v = tok->vocab;
    for (size_t i = 0; i < n_ids; i++) {
        if (!di_vocab_valid(v, ids[i])) {
            DI_LOG_ERROR("tokenizer: id %d at position %zu is not a token", ids[i], i);
            return DI_ERR_INVALID;
        }
    }
    for (size_t i = 0; i < n_ids; i++) {
        int32_t id = ids[i];
        if (skip_special && (v->tok_flags[id] & DI_VOCAB_FLAG_SPECIAL)) continue;
        di_status st =
            di_buf_append(out, v->tok_bytes + v->tok_off[id], v->tok_off[id + 1] - v->tok_off[id]);
        if (st != DI_OK) return st;
    }
    return di_buf_append(out, "", 0);
}

di_status di_tokenizer_decode(const di_tokenizer *tok, const int32_t *ids, size_t n_ids,
                              bool skip_special, char **text, size_t *n_bytes) {
    if (!tok || (!ids && n_ids) || !text || !n_bytes) return DI_ERR_INVALID;
    di_buf raw, out;
    di_buf_init(&raw);
    di_buf_init(&out);
    di_status st = di_tokenizer_decode_raw(tok, ids, n_ids, skip_special, &raw);
    if (st == DI_OK) st = di_utf8_append_lossy(&out, raw.data ? raw.data : "", raw.len, true, NULL);
    di_buf_deinit(&raw);
    if (st != DI_OK) {
        di_buf_deinit(&out);
        return st;
    }
    *n_bytes = out.len;
    *text = di_buf_take(&out);
    return DI_OK;
}
