/*
 * engram_map — see engram_map.h. The normaliser mirrors HF tokenizers' Sequence of NFKC, NFD,
 * StripAccents (drops General_Category Mark: unicode-normalization's is_combining_mark), Lowercase
 * (Rust str::to_lowercase: full mappings and the final-sigma rule, = ICU u_strToLower with the
 * root locale), Replace(/[ \t\r\n]+/, " "), Replace(/^ $/, sentinel), Strip (Rust
 * char::is_whitespace, = White_Space), Replace(sentinel, " "), done with ICU on UTF-16.
 */
#include "tok/engram_map.h"

#include <string.h>

#include <unicode/uchar.h>
#include <unicode/unorm2.h>
#include <unicode/ustring.h>
#include <unicode/utf16.h>

#include "base/buf.h"
#include "base/log.h"
#include "base/mem.h"
#include "tok/tokenizer.h"
#include "tok/vocab.h"

// ---- scratch UTF-16 buffers ----

typedef struct {
    UChar *p;
    int32_t n, cap;
} ubuf;

static di_status ubuf_reserve(ubuf *b, int32_t cap) {
    if (cap <= b->cap) return DI_OK;
    int32_t c = b->cap ? b->cap : 64;
    while (c < cap) c *= 2;
    UChar *p = di_realloc(b->p, sizeof(UChar) * (size_t)c);
    if (!p) return DI_ERR_NOMEM;
    b->p = p;
    b->cap = c;
    return DI_OK;
}

static di_status icu_status(UErrorCode e, const char *what) {
    if (U_SUCCESS(e)) return DI_OK;
    DI_LOG_ERROR("engram map: ICU %s failed: %s", what, u_errorName(e));
    return e == U_MEMORY_ALLOCATION_ERROR ? DI_ERR_NOMEM : DI_ERR_FORMAT;
}

// dst = norm(src). Retries once with the preflighted size.
static di_status normalize(const UNormalizer2 *norm, const ubuf *src, ubuf *dst) {
    for (int pass = 0; pass < 2; pass++) {
        UErrorCode e = U_ZERO_ERROR;
        int32_t n = unorm2_normalize(norm, src->p, src->n, dst->p, dst->cap, &e);
        if (e == U_BUFFER_OVERFLOW_ERROR && pass == 0) {
            if (ubuf_reserve(dst, n + 1) != DI_OK) return DI_ERR_NOMEM;
            continue;
        }
        if (e == U_STRING_NOT_TERMINATED_WARNING) e = U_ZERO_ERROR;
        dst->n = n;
        return icu_status(e, "normalize");
    }
    return DI_ERR_FORMAT;
}

static di_status lower(const ubuf *src, ubuf *dst) {
    for (int pass = 0; pass < 2; pass++) {
        UErrorCode e = U_ZERO_ERROR;
        int32_t n = u_strToLower(dst->p, dst->cap, src->p, src->n, "", &e);
        if (e == U_BUFFER_OVERFLOW_ERROR && pass == 0) {
            if (ubuf_reserve(dst, n + 1) != DI_OK) return DI_ERR_NOMEM;
            continue;
        }
        if (e == U_STRING_NOT_TERMINATED_WARNING) e = U_ZERO_ERROR;
        dst->n = n;
        return icu_status(e, "u_strToLower");
    }
    return DI_ERR_FORMAT;
}

typedef struct {
    const UNormalizer2 *nfkc, *nfd;
    ubuf a, b;
    di_buf out; // the key, UTF-8
} normer;

// Normalises UTF-8 text (valid) into n->out. An empty result leaves n->out empty.
static di_status normalize_text(normer *n, const char *s, size_t len) {
    UErrorCode e = U_ZERO_ERROR;
    di_status st;
    if ((st = ubuf_reserve(&n->a, (int32_t)len + 1)) != DI_OK) return st;
    u_strFromUTF8(n->a.p, n->a.cap, &n->a.n, s, (int32_t)len, &e);
    if (e == U_STRING_NOT_TERMINATED_WARNING) e = U_ZERO_ERROR;
    if ((st = icu_status(e, "u_strFromUTF8")) != DI_OK) return st;
    if ((st = normalize(n->nfkc, &n->a, &n->b)) != DI_OK) return st;
    if ((st = normalize(n->nfd, &n->b, &n->a)) != DI_OK) return st;
    // StripAccents: drop every Mark (Mn, Mc, Me) code point.
    int32_t w = 0;
    for (int32_t i = 0; i < n->a.n;) {
        int32_t start = i;
        UChar32 c;
        U16_NEXT(n->a.p, i, n->a.n, c);
        if (U_GET_GC_MASK(c) & U_GC_M_MASK) continue;
        while (start < i) n->a.p[w++] = n->a.p[start++];
    }
    n->a.n = w;
    if ((st = lower(&n->a, &n->b)) != DI_OK) return st;
    // Whitespace runs [ \t\r\n]+ become one space.
    w = 0;
    bool in_ws = false;
    for (int32_t i = 0; i < n->b.n; i++) {
        UChar c = n->b.p[i];
        bool ws = c == ' ' || c == '\t' || c == '\r' || c == '\n';
        if (ws && in_ws) continue;
        in_ws = ws;
        n->b.p[w++] = ws ? (UChar)' ' : c;
    }
    n->b.n = w;
    // A text that is exactly one space stays one space; otherwise trim White_Space both ends.
    int32_t lo = 0, hi = n->b.n;
    if (!(hi == 1 && n->b.p[0] == ' ')) {
        while (lo < hi) {
            int32_t i = lo;
            UChar32 c;
            U16_NEXT(n->b.p, i, hi, c);
            if (!u_isUWhiteSpace(c)) break;
            lo = i;
        }
        while (hi > lo) {
            int32_t i = hi;
            UChar32 c;
            U16_PREV(n->b.p, lo, i, c);
            if (!u_isUWhiteSpace(c)) break;
            hi = i;
        }
    }
    di_buf_clear(&n->out);
    if (hi == lo) return DI_OK;
    int32_t need = 0;
    e = U_ZERO_ERROR;
    u_strToUTF8(NULL, 0, &need, n->b.p + lo, hi - lo, &e);
    if (e != U_BUFFER_OVERFLOW_ERROR && U_FAILURE(e)) return icu_status(e, "u_strToUTF8");
    if ((st = di_buf_reserve(&n->out, (size_t)need + 1)) != DI_OK) return st;
    e = U_ZERO_ERROR;
    u_strToUTF8(n->out.data, (int32_t)n->out.cap, &need, n->b.p + lo, hi - lo, &e);
    if (e == U_STRING_NOT_TERMINATED_WARNING) e = U_ZERO_ERROR;
    if ((st = icu_status(e, "u_strToUTF8")) != DI_OK) return st;
    n->out.len = (size_t)need;
    return DI_OK;
}

// ---- byte-level raw form (GPT-2 bytes_to_unicode) ----

static uint32_t byte_to_cp(int b) {
    if ((b >= 33 && b <= 126) || (b >= 161 && b <= 172) || (b >= 174 && b <= 255))
        return (uint32_t)b;
    int k = 0;
    for (int c = 0; c < b; c++)
        if (!((c >= 33 && c <= 126) || (c >= 161 && c <= 172) || (c >= 174 && c <= 255))) k++;
    return 256u + (uint32_t)k;
}

// Appends the UTF-8 of code point c (< 0x800 here) to out.
static di_status append_cp(di_buf *out, uint32_t c) {
    char u[2];
    if (c < 0x80) return di_buf_append(out, (char[]){(char)c}, 1);
    u[0] = (char)(0xC0 | (c >> 6));
    u[1] = (char)(0x80 | (c & 0x3F));
    return di_buf_append(out, u, 2);
}

// ---- key table: open addressing over (offset, length) into one byte arena ----

typedef struct {
    di_buf arena;
    uint32_t *off, *len; // per key
    int32_t *slot;       // [cap] key index, -1 = empty
    size_t cap;
    int32_t n;
} keytab;

static uint64_t hash_bytes(const char *s, size_t n) {
    uint64_t h = 1469598103934665603ull;
    for (size_t i = 0; i < n; i++) h = (h ^ (unsigned char)s[i]) * 1099511628211ull;
    return h ^ (h >> 29);
}

// The compressed id of key (s, n), adding it when new; -1 on NOMEM.
static int32_t keytab_intern(keytab *t, const char *s, size_t n) {
    size_t mask = t->cap - 1;
    size_t h = hash_bytes(s, n) & mask;
    for (;; h = (h + 1) & mask) {
        int32_t k = t->slot[h];
        if (k < 0) break;
        if (t->len[k] == n && memcmp(t->arena.data + t->off[k], s, n) == 0) return k;
    }
    size_t off = t->arena.len;
    if (di_buf_append(&t->arena, s, n) != DI_OK) return -1;
    t->off[t->n] = (uint32_t)off;
    t->len[t->n] = (uint32_t)n;
    t->slot[h] = t->n;
    return t->n++;
}

static bool has_fffd(const char *s, size_t n) {
    for (size_t i = 0; i + 2 < n; i++)
        if ((unsigned char)s[i] == 0xEF && (unsigned char)s[i + 1] == 0xBF &&
            (unsigned char)s[i + 2] == 0xBD)
            return true;
    return false;
}

di_status di_engram_map_build(const di_tokenizer *tok, int32_t **map, int32_t *n_map,
                              int32_t *n_keys) {
    if (!tok || !map || !n_map || !n_keys) return DI_ERR_INVALID;
    const di_vocab *v = di_tokenizer_vocab(tok);
    int32_t nv = v->n_vocab;
    UErrorCode e = U_ZERO_ERROR;
    normer nm = {.nfkc = unorm2_getNFKCInstance(&e)};
    if (U_SUCCESS(e)) nm.nfd = unorm2_getNFDInstance(&e);
    di_status st = icu_status(e, "unorm2_get*Instance");
    if (st != DI_OK) return st;
    di_buf_init(&nm.out);
    di_buf text, raw;
    di_buf_init(&text);
    di_buf_init(&raw);
    keytab kt = {0};
    di_buf_init(&kt.arena);
    kt.cap = 16;
    while (kt.cap < 2 * (size_t)nv + 16) kt.cap <<= 1;
    kt.off = di_malloc(sizeof(uint32_t) * ((size_t)nv + 1));
    kt.len = di_malloc(sizeof(uint32_t) * ((size_t)nv + 1));
    kt.slot = di_malloc(sizeof(int32_t) * kt.cap);
    int32_t *out = di_malloc(sizeof(int32_t) * ((size_t)nv + 1));
    if (!kt.off || !kt.len || !kt.slot || !out) {
        st = DI_ERR_NOMEM;
        goto done;
    }
    memset(kt.slot, 0xFF, sizeof(int32_t) * kt.cap);
    for (int32_t id = 0; id < nv && st == DI_OK; id++) {
        // HF decode([id], skip_special_tokens=False): the token's bytes, made UTF-8 lossily.
        // An id missing from the vocabulary decodes to "".
        const char *tb = v->tok_bytes + v->tok_off[id];
        size_t tn = v->tok_off[id + 1] - v->tok_off[id];
        di_buf_clear(&text);
        if ((st = di_utf8_append_lossy(&text, tb, tn, true, NULL)) != DI_OK) break;
        const char *ks;
        size_t kn;
        if (text.len && has_fffd(text.data, text.len)) {
            // The raw vocabulary string (id_to_token): a model token in the byte-level
            // alphabet; an added token's content as written (only when it is valid UTF-8,
            // i.e. was not byte-level decoded).
            di_buf_clear(&raw);
            bool valid = di_utf8_valid_prefix(tb, tn) == tn;
            if ((v->tok_flags[id] & DI_VOCAB_FLAG_ADDED) && valid) {
                st = di_buf_append(&raw, tb, tn);
            } else {
                for (size_t i = 0; i < tn && st == DI_OK; i++)
                    st = append_cp(&raw, byte_to_cp((unsigned char)tb[i]));
            }
            if (st != DI_OK) break;
            ks = raw.data ? raw.data : "";
            kn = raw.len;
        } else {
            if ((st = normalize_text(&nm, text.data ? text.data : "", text.len)) != DI_OK) break;
            if (nm.out.len) {
                ks = nm.out.data;
                kn = nm.out.len;
            } else {
                ks = text.data ? text.data : "";
                kn = text.len;
            }
        }
        int32_t k = keytab_intern(&kt, ks, kn);
        if (k < 0) st = DI_ERR_NOMEM;
        out[id] = k;
    }
done:
    if (st == DI_OK) {
        *map = out;
        *n_map = nv;
        *n_keys = kt.n;
    } else {
        di_free(out);
    }
    di_free(kt.off);
    di_free(kt.len);
    di_free(kt.slot);
    di_buf_deinit(&kt.arena);
    di_buf_deinit(&text);
    di_buf_deinit(&raw);
    di_buf_deinit(&nm.out);
    di_free(nm.a.p);
    di_free(nm.b.p);
    return st;
}
