// pretok — DeepSeek's pre-tokenizer split rules on PCRE2 JIT (see pretok.h).
#define PCRE2_CODE_UNIT_WIDTH 8
#include "tok/pretok.h"

#include <pcre2.h>
#include <string.h>

#include "base/log.h"
#include "base/mem.h"

// ---- patterns ----

// Splits 1 and 2 of tokenizer.json, as one alternation (see pretok.h for why that is exact).
static const char k_pat_split[] =
    "\\p{N}{1,3}|[\\x{4e00}-\\x{9fa5}\\x{3040}-\\x{309f}\\x{30a0}-\\x{30ff}]+";

// Split 3. `\s` is spelled out as Oniguruma's Unicode White_Space set, which HF uses: PCRE2's UCP
// `\s` is "Z category or \t\n\v\f\r" and so misses U+0085 (NEXT LINE) and matches U+180E on old
// tables. WS is White_Space; NWS its complement for `\S`.
#define WS "\\t\\n\\x{0b}\\f\\r \\x{85}\\x{a0}\\x{1680}\\x{2000}-\\x{200a}\\x{2028}\\x{2029}\\x{202f}\\x{205f}\\x{3000}"
static const char k_pat_word[] = "[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+"
                                 "|[^\\r\\n\\p{L}\\p{P}\\p{S}]?[\\p{L}\\p{M}]+"
                                 "| ?[\\p{P}\\p{S}]+[\\r\\n]*"
                                 "|[" WS "]*[\\r\\n]+"
                                 "|[" WS "]+(?![^" WS "])"
                                 "|[" WS "]+";

struct di_pretok {
    pcre2_code *split; // owned
    pcre2_code *word;  // owned
};

struct di_pretok_ctx {
    pcre2_match_data *md_split; // owned
    pcre2_match_data *md_word;  // owned
    pcre2_match_context *mctx;  // owned
    pcre2_jit_stack *jit_stack; // owned
};

static pcre2_code *compile(const char *pat) {
    int err;
    PCRE2_SIZE off;
    pcre2_code *re = pcre2_compile((PCRE2_SPTR)pat, PCRE2_ZERO_TERMINATED, PCRE2_UTF | PCRE2_UCP,
                                   &err, &off, NULL);
    if (!re) {
        PCRE2_UCHAR msg[256];
        pcre2_get_error_message(err, msg, sizeof msg);
        DI_LOG_ERROR("pretok: pattern does not compile at %zu: %s", (size_t)off, (char *)msg);
        return NULL;
    }
    if (pcre2_jit_compile(re, PCRE2_JIT_COMPLETE) != 0)
        DI_LOG_WARN("pretok: PCRE2 JIT unavailable; using the interpreter (slower)");
    return re;
}

di_status di_pretok_create(di_pretok **out) {
    di_pretok *p = di_calloc(1, sizeof *p);
    if (!p) return DI_ERR_NOMEM;
    p->split = compile(k_pat_split);
    p->word = compile(k_pat_word);
    if (!p->split || !p->word) {
        di_pretok_destroy(p);
        return DI_ERR_UNSUPPORTED;
    }
    *out = p;
    return DI_OK;
}

void di_pretok_destroy(di_pretok *p) {
    if (!p) return;
    pcre2_code_free(p->split);
    pcre2_code_free(p->word);
    di_free(p);
}

di_status di_pretok_ctx_create(const di_pretok *p, di_pretok_ctx **out) {
    di_pretok_ctx *c = di_calloc(1, sizeof *c);
    if (!c) return DI_ERR_NOMEM;
    c->md_split = pcre2_match_data_create_from_pattern(p->split, NULL);
    c->md_word = pcre2_match_data_create_from_pattern(p->word, NULL);
    c->mctx = pcre2_match_context_create(NULL);
    // The lookahead alternative backtracks over whitespace runs; a 1 MiB JIT stack covers runs far
    // longer than any request (the default 32 KiB does not).
    c->jit_stack = pcre2_jit_stack_create(32 * 1024, 1024 * 1024, NULL);
    if (!c->md_split || !c->md_word || !c->mctx || !c->jit_stack) {
        di_pretok_ctx_destroy(c);
        return DI_ERR_NOMEM;
    }
    pcre2_jit_stack_assign(c->mctx, NULL, c->jit_stack);
    *out = c;
    return DI_OK;
}

void di_pretok_ctx_destroy(di_pretok_ctx *c) {
    if (!c) return;
    pcre2_match_data_free(c->md_split);
    pcre2_match_data_free(c->md_word);
    pcre2_match_context_free(c->mctx);
    pcre2_jit_stack_free(c->jit_stack);
    di_free(c);
}

// ---- splitting ----

// Length of the UTF-8 sequence starting with byte b (input is valid UTF-8).
static size_t utf8_len(unsigned char b) { return b < 0x80 ? 1 : b < 0xE0 ? 2 : b < 0xF0 ? 3 : 4; }

// Runs re over text and calls fn on every match and every gap between matches (Isolated).
static di_status split_isolated(const pcre2_code *re, pcre2_match_data *md, pcre2_match_context *mc,
                                const char *text, size_t n, di_pretok_fn fn, void *user) {
    size_t pos = 0, emitted = 0;
    di_status st;
    while (pos < n) {
        int rc = pcre2_match(re, (PCRE2_SPTR)text, n, pos, PCRE2_NO_UTF_CHECK, md, mc);
        if (rc == PCRE2_ERROR_NOMATCH) break;
        if (rc < 0) {
            PCRE2_UCHAR msg[256];
            pcre2_get_error_message(rc, msg, sizeof msg);
            DI_LOG_ERROR("pretok: regex match failed: %s", (char *)msg);
            return DI_ERR_INVALID;
        }
        PCRE2_SIZE *ov = pcre2_get_ovector_pointer(md);
        size_t ms = ov[0], me = ov[1];
        if (me == ms) { // no alternative matches empty; kept as a guard against looping
            pos = ms + utf8_len((unsigned char)text[ms]);
            continue;
        }
        if (ms > emitted && (st = fn(user, text + emitted, ms - emitted)) != DI_OK) return st;
        if ((st = fn(user, text + ms, me - ms)) != DI_OK) return st;
        emitted = pos = me;
    }
    if (n > emitted && (st = fn(user, text + emitted, n - emitted)) != DI_OK) return st;
    return DI_OK;
}

typedef struct stage2 {
    const di_pretok *p;
    di_pretok_ctx *c;
    di_pretok_fn fn;
    void *user;
} stage2;

static di_status run_word(void *user, const char *piece, size_t n) {
    stage2 *s = user;
    return split_isolated(s->p->word, s->c->md_word, s->c->mctx, piece, n, s->fn, s->user);
}

di_status di_pretok_split(const di_pretok *p, di_pretok_ctx *c, const char *text, size_t n,
                          di_pretok_fn fn, void *user) {
    stage2 s = {p, c, fn, user};
    return split_isolated(p->split, c->md_split, c->mctx, text, n, run_word, &s);
}
