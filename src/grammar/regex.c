// regex — an ECMAScript regular expression (the subset JSON Schema `pattern` uses) → EBNF text
// (see grammar.h). Supported: literals, escapes (\d \w \s \D \W \S, \t \n \r \v \f \0, \xHH,
// \uHHHH with surrogate pairs, \u{H..}, escaped punctuation), classes with ranges, negation and
// class escapes, `.` (any code point but \n \r U+2028 U+2029), groups ( ), (?: ) and (?<name> ),
// alternation, * + ? {m} {m,} {m,n}, and the anchors ^ and $ at the ends of a top-level branch.
// Refused with a clear message: backreferences, lookaround, lazy quantifiers, word boundaries,
// anchors elsewhere.
//
// Semantics: as a response format (json_mode false) the whole output must match (^ and $ are
// implied). As a JSON Schema pattern (json_mode true) the standard's search semantics apply: a
// top-level branch not starting with ^ gets any text before it, one not ending with $ any text
// after it; and every character is matched as it is written inside a JSON string: `"`, `\` and
// control characters by their (shortest) JSON escape, everything else raw.
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/mem.h"
#include "grammar/grammar.h"

typedef struct rrange {
    uint32_t lo, hi;
} rrange;

typedef struct rset {
    rrange *r; // owned
    int32_t n, cap;
} rset;

typedef struct rx {
    const char *s;
    size_t n, i;
    bool json;
    di_buf *out;
    char *err;
    size_t err_size;
    bool failed;
    di_status st;
    int depth;
} rx;

static void rfail(rx *x, size_t at, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static void rfail(rx *x, size_t at, const char *fmt, ...) {
    if (x->failed) return;
    x->failed = true;
    x->st = DI_ERR_INVALID;
    char msg[256];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    if (x->err && x->err_size) snprintf(x->err, x->err_size, "regex offset %zu: %s", at, msg);
}

static void put(rx *x, const char *s) {
    if (!x->failed && di_buf_append_str(x->out, s) != DI_OK) x->failed = true, x->st = DI_ERR_NOMEM;
}

static void putf(rx *x, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void putf(rx *x, const char *fmt, ...) {
    char tmp[64];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(tmp, sizeof tmp, fmt, ap);
    va_end(ap);
    put(x, tmp);
}

// ---- sets ----

static void set_add(rx *x, rset *s, uint32_t lo, uint32_t hi) {
    if (s->n == s->cap) {
        int32_t cap = s->cap ? s->cap * 2 : 8;
        rrange *p = di_realloc(s->r, sizeof *p * (size_t)cap);
        if (!p) {
            x->failed = true, x->st = DI_ERR_NOMEM;
            return;
        }
        s->r = p;
        s->cap = cap;
    }
    s->r[s->n++] = (rrange){lo, hi};
}

static int cmp_rr(const void *a, const void *b) {
    const rrange *p = a, *q = b;
    return p->lo < q->lo ? -1 : p->lo > q->lo;
}

static void set_norm(rset *s) {
    if (!s->n) return;
    qsort(s->r, (size_t)s->n, sizeof *s->r, cmp_rr);
    int32_t k = 0;
    for (int32_t i = 1; i < s->n; i++) {
        if (s->r[i].lo <= s->r[k].hi + 1) {
            if (s->r[i].hi > s->r[k].hi) s->r[k].hi = s->r[i].hi;
        } else {
            s->r[++k] = s->r[i];
        }
    }
    s->n = k + 1;
}

// s = complement of s within [0, 0x10FFFF].
static void set_negate(rx *x, rset *s) {
    set_norm(s);
    rset t = {0};
    uint32_t next = 0;
    for (int32_t i = 0; i < s->n; i++) {
        if (s->r[i].lo > next) set_add(x, &t, next, s->r[i].lo - 1);
        next = s->r[i].hi + 1;
    }
    if (next <= 0x10FFFF) set_add(x, &t, next, 0x10FFFF);
    di_free(s->r);
    *s = t;
}

// Adds the set of class escape e (d w s, upper case: negated) to s.
static void add_class_escape(rx *x, rset *s, char e) {
    rset t = {0};
    switch (e | 0x20) {
    case 'd':
        set_add(x, &t, '0', '9');
        break;
    case 'w':
        set_add(x, &t, '0', '9'), set_add(x, &t, 'A', 'Z'), set_add(x, &t, 'a', 'z');
        set_add(x, &t, '_', '_');
        break;
    default: // s: ECMAScript WhiteSpace and LineTerminator
        set_add(x, &t, 9, 13), set_add(x, &t, ' ', ' '), set_add(x, &t, 0xA0, 0xA0);
        set_add(x, &t, 0x1680, 0x1680), set_add(x, &t, 0x2000, 0x200A);
        set_add(x, &t, 0x2028, 0x2029), set_add(x, &t, 0x202F, 0x202F);
        set_add(x, &t, 0x205F, 0x205F), set_add(x, &t, 0x3000, 0x3000);
        set_add(x, &t, 0xFEFF, 0xFEFF);
    }
    if (e >= 'A' && e <= 'Z') set_negate(x, &t);
    for (int32_t i = 0; i < t.n; i++) set_add(x, s, t.r[i].lo, t.r[i].hi);
    di_free(t.r);
}

// ---- emission ----

static void put_cp_class(rx *x, uint32_t cp) {
    if ((cp >= '0' && cp <= '9') || (cp >= 'a' && cp <= 'z') || (cp >= 'A' && cp <= 'Z'))
        putf(x, "%c", (char)cp);
    else
        putf(x, "\\U%08X", cp);
}

static void put_class(rx *x, const rset *s) {
    put(x, "[");
    for (int32_t i = 0; i < s->n; i++) {
        put_cp_class(x, s->r[i].lo);
        if (s->r[i].hi != s->r[i].lo) put(x, "-"), put_cp_class(x, s->r[i].hi);
    }
    put(x, "]");
}

// The JSON escape of a character that must be escaped inside a JSON string, as EBNF literal.
static void put_json_escape(rx *x, uint32_t cp) {
    switch (cp) {
    case '"':
        put(x, "\"\\\\\\\"\"");
        return; // JSON \"  -> EBNF "\\\""
    case '\\':
        put(x, "\"\\\\\\\\\"");
        return; // JSON \\  -> EBNF "\\\\"
    case '\b':
        put(x, "\"\\\\b\"");
        return;
    case '\f':
        put(x, "\"\\\\f\"");
        return;
    case '\n':
        put(x, "\"\\\\n\"");
        return;
    case '\r':
        put(x, "\"\\\\r\"");
        return;
    case '\t':
        put(x, "\"\\\\t\"");
        return;
    default:
        putf(x, "\"\\\\u%04x\"", cp);
    }
}

// Emits one atom matching one code point of s (normalised, non-empty).
static void emit_set(rx *x, rset *s, size_t at) {
    set_norm(s);
    if (s->n == 0) {
        rfail(x, at, "this class matches no character");
        return;
    }
    if (!x->json) {
        put_class(x, s);
        return;
    }
    // JSON: the characters that need no escape raw, the others by their escapes.
    rset plain = {0};
    int n_special = 0;
    uint32_t special[34];
    for (int32_t i = 0; i < s->n; i++) {
        uint32_t lo = s->r[i].lo, hi = s->r[i].hi;
        for (uint32_t c = lo; c <= hi && c < 0x20; c++) special[n_special++] = c;
        if (lo <= '"' && hi >= '"') special[n_special++] = '"';
        if (lo <= '\\' && hi >= '\\') special[n_special++] = '\\';
        uint32_t a = lo < 0x20 ? 0x20 : lo;
        // cut '"' and '\\' out of [a, hi]
        uint32_t cuts[2] = {'"', '\\'};
        for (int k = 0; k < 2 && a <= hi; k++) {
            if (cuts[k] >= a && cuts[k] <= hi) {
                if (cuts[k] > a) set_add(x, &plain, a, cuts[k] - 1);
                a = cuts[k] + 1;
            }
        }
        if (a <= hi) set_add(x, &plain, a, hi);
    }
    put(x, "(");
    bool first = true;
    if (plain.n) put_class(x, &plain), first = false;
    for (int i = 0; i < n_special; i++) {
        if (!first) put(x, " | ");
        put_json_escape(x, special[i]);
        first = false;
    }
    put(x, ")");
    di_free(plain.r);
}

static void emit_cp(rx *x, uint32_t cp, size_t at) {
    rset s = {0};
    set_add(x, &s, cp, cp);
    emit_set(x, &s, at);
    di_free(s.r);
}

static void emit_dot(rx *x, size_t at) {
    rset s = {0};
    set_add(x, &s, 0, 0x10FFFF);
    rset nl = {0};
    set_add(x, &nl, '\n', '\n'), set_add(x, &nl, '\r', '\r'), set_add(x, &nl, 0x2028, 0x2029);
    set_negate(x, &nl);
    emit_set(x, &nl, at);
    di_free(s.r);
    di_free(nl.r);
}

static void emit_any(rx *x) { // any code point (search padding)
    rset s = {0};
    set_add(x, &s, 0, 0x10FFFF);
    emit_set(x, &s, 0);
    di_free(s.r);
}

// ---- parser ----

static uint32_t decode_cp(rx *x) {
    const uint8_t *p = (const uint8_t *)x->s + x->i;
    size_t left = x->n - x->i;
    if (p[0] < 0x80) return x->i++, p[0];
    int len = (p[0] & 0xE0) == 0xC0 ? 2 : (p[0] & 0xF0) == 0xE0 ? 3 : (p[0] & 0xF8) == 0xF0 ? 4 : 0;
    uint32_t cp = len == 2 ? p[0] & 0x1Fu : len == 3 ? p[0] & 0x0Fu : p[0] & 0x07u;
    bool ok = len > 0 && (size_t)len <= left;
    for (int k = 1; ok && k < len; k++) {
        ok = (p[k] & 0xC0) == 0x80;
        cp = cp << 6 | (p[k] & 0x3Fu);
    }
    if (ok && ((len == 2 && cp < 0x80) || (len == 3 && cp < 0x800) || (len == 4 && cp < 0x10000) ||
               cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)))
        ok = false;
    if (!ok) {
        rfail(x, x->i, "invalid UTF-8");
        x->i = x->n;
        return 0;
    }
    x->i += (size_t)len;
    return cp;
}

static int hexd(char c) {
    return c >= '0' && c <= '9'   ? c - '0'
           : c >= 'a' && c <= 'f' ? c - 'a' + 10
           : c >= 'A' && c <= 'F' ? c - 'A' + 10
                                  : -1;
}

static bool read_hex(rx *x, int nd, uint32_t *v) {
    uint32_t a = 0;
    for (int k = 0; k < nd; k++) {
        int h = x->i < x->n ? hexd(x->s[x->i]) : -1;
        if (h < 0) return false;
        a = a * 16 + (uint32_t)h;
        x->i++;
    }
    *v = a;
    return true;
}

// An escape at x->i (after the backslash). Returns the code point, or sets *cls to the class
// letter (d w s D W S) and returns 0.
static uint32_t parse_escape(rx *x, bool in_class, char *cls) {
    size_t at = x->i - 1;
    *cls = 0;
    if (x->i >= x->n) return rfail(x, at, "trailing backslash"), 0;
    char e = x->s[x->i++];
    uint32_t v = 0;
    switch (e) {
    case 'd':
    case 'w':
    case 's':
    case 'D':
    case 'W':
    case 'S':
        *cls = e;
        return 0;
    case 't':
        return '\t';
    case 'n':
        return '\n';
    case 'r':
        return '\r';
    case 'v':
        return '\v';
    case 'f':
        return '\f';
    case '0':
        if (x->i < x->n && x->s[x->i] >= '0' && x->s[x->i] <= '9')
            return rfail(x, at, "octal escapes are not supported"), 0;
        return 0;
    case 'b':
        if (in_class) return '\b';
        return rfail(x, at, "word boundaries (\\b) are not supported"), 0;
    case 'B':
        return rfail(x, at, "word boundaries (\\B) are not supported"), 0;
    case 'k':
        return rfail(x, at, "backreferences are not supported"), 0;
    case 'c':
        return rfail(x, at, "control escapes (\\c) are not supported"), 0;
    case 'p':
    case 'P':
        return rfail(x, at, "Unicode property escapes are not supported"), 0;
    case 'x':
        if (!read_hex(x, 2, &v)) return rfail(x, at, "\\x needs two hex digits"), 0;
        return v;
    case 'u':
        if (x->i < x->n && x->s[x->i] == '{') {
            x->i++;
            v = 0;
            size_t d0 = x->i;
            while (x->i < x->n && hexd(x->s[x->i]) >= 0 && v <= 0x10FFFF)
                v = v * 16 + (uint32_t)hexd(x->s[x->i++]);
            if (x->i == d0 || x->i >= x->n || x->s[x->i] != '}' || v > 0x10FFFF)
                return rfail(x, at, "bad \\u{...} escape"), 0;
            x->i++;
        } else if (!read_hex(x, 4, &v)) {
            return rfail(x, at, "\\u needs four hex digits"), 0;
        }
        if (v >= 0xD800 && v <= 0xDBFF && x->i + 6 <= x->n && x->s[x->i] == '\\' &&
            x->s[x->i + 1] == 'u') { // a surrogate pair
            size_t save = x->i;
            uint32_t lo;
            x->i += 2;
            if (read_hex(x, 4, &lo) && lo >= 0xDC00 && lo <= 0xDFFF)
                return 0x10000 + ((v - 0xD800) << 10) + (lo - 0xDC00);
            x->i = save;
        }
        if (v >= 0xD800 && v <= 0xDFFF) return rfail(x, at, "lone surrogate escape"), 0;
        return v;
    default:
        if (e >= '1' && e <= '9') return rfail(x, at, "backreferences are not supported"), 0;
        if ((e >= 'a' && e <= 'z') || (e >= 'A' && e <= 'Z'))
            return rfail(x, at, "unknown escape '\\%c'", e), 0;
        x->i--;
        return decode_cp(x); // escaped punctuation (or any other character): itself
    }
}

static void parse_class(rx *x) {
    size_t at = x->i - 1;
    rset s = {0};
    bool neg = x->i < x->n && x->s[x->i] == '^';
    if (neg) x->i++;
    while (!x->failed && x->i < x->n && x->s[x->i] != ']') {
        char cls = 0;
        uint32_t lo;
        if (x->s[x->i] == '\\') {
            x->i++;
            lo = parse_escape(x, true, &cls);
        } else {
            lo = decode_cp(x);
        }
        if (cls) {
            add_class_escape(x, &s, cls);
            continue;
        }
        uint32_t hi = lo;
        if (x->i + 1 < x->n && x->s[x->i] == '-' && x->s[x->i + 1] != ']') {
            x->i++;
            char cls2 = 0;
            if (x->s[x->i] == '\\') {
                x->i++;
                hi = parse_escape(x, true, &cls2);
            } else {
                hi = decode_cp(x);
            }
            if (cls2) {
                rfail(x, at, "a class escape cannot end a range");
                break;
            }
            if (hi < lo) {
                rfail(x, at, "class range out of order");
                break;
            }
        }
        set_add(x, &s, lo, hi);
    }
    if (!x->failed && x->i >= x->n) rfail(x, at, "unterminated character class");
    if (!x->failed) {
        x->i++;
        if (neg) set_negate(x, &s);
        emit_set(x, &s, at);
    }
    di_free(s.r);
}

static void parse_alt(rx *x, bool top);

// A quantifier at x->i, if any: appends its EBNF form. `{` that is not a quantifier is literal.
static bool quantifier(rx *x) {
    if (x->i >= x->n) return false;
    char q = x->s[x->i];
    size_t at = x->i;
    if (q == '*' || q == '+' || q == '?') {
        x->i++;
        putf(x, "%c", q);
    } else if (q == '{') {
        size_t j = x->i + 1;
        long m = 0, n = -2;
        size_t d0 = j;
        while (j < x->n && x->s[j] >= '0' && x->s[j] <= '9' && m <= DI_GRAMMAR_MAX_REPEAT)
            m = m * 10 + (x->s[j++] - '0');
        if (j == d0) return false;
        if (j < x->n && x->s[j] == ',') {
            j++;
            n = -1;
            size_t d1 = j;
            long v = 0;
            while (j < x->n && x->s[j] >= '0' && x->s[j] <= '9' && v <= DI_GRAMMAR_MAX_REPEAT)
                v = v * 10 + (x->s[j++] - '0');
            if (j > d1) n = v;
        }
        if (j >= x->n || x->s[j] != '}') return false;
        x->i = j + 1;
        if (m > DI_GRAMMAR_MAX_REPEAT || n > DI_GRAMMAR_MAX_REPEAT)
            return rfail(x, at, "repetition count over %d", DI_GRAMMAR_MAX_REPEAT), true;
        if (n >= 0 && n < m) return rfail(x, at, "repetition {%ld,%ld} out of order", m, n), true;
        if (n == -2)
            putf(x, "{%ld}", m);
        else if (n == -1)
            putf(x, "{%ld,}", m);
        else
            putf(x, "{%ld,%ld}", m, n);
    } else {
        return false;
    }
    if (x->i < x->n && x->s[x->i] == '?')
        return rfail(x, x->i, "lazy quantifiers are not supported"), true;
    if (x->i < x->n && strchr("*+?", x->s[x->i]))
        return rfail(x, x->i, "nothing to repeat (a quantifier after a quantifier)"), true;
    return true;
}

// One branch: a sequence of quantified atoms, up to '|' or ')' (or the end).
static void parse_branch(rx *x, bool top) {
    bool any = false;
    if (top && x->i < x->n && x->s[x->i] == '^') {
        x->i++;
    } else if (top && x->json) {
        emit_any(x), put(x, "* ");
    }
    while (!x->failed && x->i < x->n) {
        char c = x->s[x->i];
        size_t at = x->i;
        if (c == '|' || c == ')') break;
        if (c == '$') {
            x->i++;
            bool end = x->i >= x->n || x->s[x->i] == '|' || (!top && false);
            if (!top || !end) {
                rfail(x, at, "'$' is supported only at the end of the pattern");
                return;
            }
            if (!any) put(x, "\"\"");
            return;
        }
        if (c == '^') {
            rfail(x, at, "'^' is supported only at the start of the pattern");
            return;
        }
        if (c == '*' || c == '+' || c == '?') {
            rfail(x, at, "nothing to repeat before '%c'", c);
            return;
        }
        put(x, any ? " " : "");
        any = true;
        if (c == '(') {
            x->i++;
            if (x->i < x->n && x->s[x->i] == '?') {
                if (x->i + 1 < x->n && x->s[x->i + 1] == ':') {
                    x->i += 2;
                } else if (x->i + 1 < x->n && x->s[x->i + 1] == '<' && x->i + 2 < x->n &&
                           x->s[x->i + 2] != '=' && x->s[x->i + 2] != '!') {
                    size_t j = x->i + 2;
                    while (j < x->n && x->s[j] != '>') j++;
                    if (j >= x->n) {
                        rfail(x, at, "unterminated group name");
                        return;
                    }
                    x->i = j + 1;
                } else {
                    {
                        rfail(x, at, "lookaround and inline flags are not supported");
                        return;
                    }
                }
            }
            if (++x->depth > 200) {
                rfail(x, at, "groups nested too deeply");
                return;
            }
            put(x, "(");
            parse_alt(x, false);
            x->depth--;
            if (x->failed) return;
            if (x->i >= x->n || x->s[x->i] != ')') {
                rfail(x, at, "unclosed '('");
                return;
            }
            x->i++;
            put(x, ")");
        } else if (c == '[') {
            x->i++;
            parse_class(x);
        } else if (c == '.') {
            x->i++;
            emit_dot(x, at);
        } else if (c == '\\') {
            x->i++;
            char cls = 0;
            uint32_t cp = parse_escape(x, false, &cls);
            if (x->failed) return;
            if (cls) {
                rset s = {0};
                add_class_escape(x, &s, cls);
                emit_set(x, &s, at);
                di_free(s.r);
            } else {
                emit_cp(x, cp, at);
            }
        } else {
            emit_cp(x, decode_cp(x), at);
        }
        quantifier(x);
    }
    if (!any && !(top && x->json)) put(x, "\"\"");
    if (top && x->json && !x->failed) put(x, " "), emit_any(x), put(x, "*");
}

static void parse_alt(rx *x, bool top) {
    for (;;) {
        parse_branch(x, top);
        if (x->failed || x->i >= x->n || x->s[x->i] != '|') break;
        x->i++;
        put(x, " | ");
    }
}

di_status di_grammar_regex_to_ebnf(const char *re, size_t n, const char *prefix, bool json_mode,
                                   di_buf *out, char *err, size_t err_size) {
    rx x = {.s = re, .n = n, .json = json_mode, .out = out, .err = err, .err_size = err_size};
    putf(&x, "%.40s ::= ", prefix);
    parse_alt(&x, true);
    if (!x.failed && x.i < x.n) rfail(&x, x.i, "unmatched ')'");
    put(&x, "\n");
    if (x.failed && x.st == DI_ERR_NOMEM && err && err_size)
        snprintf(err, err_size, "out of memory");
    return x.failed ? x.st : DI_OK;
}
