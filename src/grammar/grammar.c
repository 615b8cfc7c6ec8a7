// grammar — the EBNF compiler (see grammar.h) and di_grammar_compile, the public entry point.
//
// Syntax (GBNF-like): `name ::= alternatives`, one rule after another (a rule ends where the next
// `name ::=` starts; newlines are whitespace); alternatives separated by `|`; elements: "string"
// literals (escapes \n \r \t \" \\ \' \[ \] \xHH \uHHHH \UHHHHHHHH; \x and \u name code points,
// written as UTF-8), [classes] with ranges and [^negation], `.` (any code point), rule names
// ([A-Za-z0-9_-]), `<[id]>` (the one token id, as a unit: special tokens), ( groups ); postfix `*`
// `+` `?` `{m}` `{m,}` `{m,n}`; `#` comments to the end of the line. The start rule is `root`.
// Unused rules are fine; undefined rules, left recursion (direct or through nullable prefixes) and
// grammars over the limits of grammar.h are refused with line:column.
#include "grammar/grammar.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/hash.h"
#include "base/log.h"
#include "base/mem.h"

// ---- compile state ----

typedef struct crule {
    char *name;    // owned
    di_buf body;   // int32 codes: (val << 2 | type); an END code closes each alternative
    int line, col; // where it was first named (definition or use)
    bool defined, generated;
} crule;

typedef struct class_key { // a generated class rule, for reuse
    uint64_t hash;
    int32_t rule;
} class_key;

typedef struct cc {
    const char *s;
    size_t n, i;
    int line;
    size_t line_start;
    char *err;
    size_t err_size;
    bool failed;
    di_status st;
    crule *rules;
    int32_t n_rules, cap_rules;
    uint64_t (*sets)[4];
    int32_t n_sets, cap_sets;
    int32_t single[256]; // set index of each single-byte set, -1 if none yet
    class_key *classes;
    int32_t n_classes, cap_classes;
    int64_t n_codes;  // elements emitted so far (the size limit)
    int32_t cur_rule; // the user rule being parsed (names generated rules)
    int32_t *name_ht; // owned [name_cap]: user rule ids by name hash, -1 empty
    int32_t name_cap, n_names;
    int32_t n_gen;
} cc;

#define CODE(type, val) ((int32_t)(((uint32_t)(val) << 2) | (uint32_t)(type)))
#define CODE_TYPE(c) ((uint32_t)(c)&3u)
#define CODE_VAL(c) ((int32_t)((uint32_t)(c) >> 2))

static void fail_at(cc *c, size_t pos, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static void fail_at(cc *c, size_t pos, const char *fmt, ...) {
    if (c->failed) return;
    c->failed = true;
    c->st = DI_ERR_INVALID;
    int line = 1;
    size_t ls = 0;
    for (size_t k = 0; k < pos && k < c->n; k++)
        if (c->s[k] == '\n') line++, ls = k + 1;
    char msg[384];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    if (c->err && c->err_size)
        snprintf(c->err, c->err_size, "%d:%d: %s", line, (int)(pos - ls) + 1, msg);
}

static void nomem(cc *c) {
    if (!c->failed) {
        c->failed = true;
        c->st = DI_ERR_NOMEM;
        if (c->err && c->err_size) snprintf(c->err, c->err_size, "out of memory");
    }
}

// Enters user rule r (its name set) into the name table, growing it to stay under half full.
static bool index_name(cc *c, int32_t r) {
    if (2 * (c->n_names + 1) > c->name_cap) {
        int32_t cap = c->name_cap ? c->name_cap * 2 : 256;
        int32_t *t = di_malloc(sizeof(int32_t) * (size_t)cap);
        if (!t) return false;
        memset(t, 0xff, sizeof(int32_t) * (size_t)cap);
        int32_t *old = c->name_ht;
        const int32_t old_cap = c->name_cap;
        c->name_ht = t;
        c->name_cap = cap;
        c->n_names = 0;
        for (int32_t k = 0; k < old_cap; k++)
            if (old[k] >= 0) index_name(c, old[k]);
        di_free(old);
    }
    const char *name = c->rules[r].name;
    const uint32_t mask = (uint32_t)c->name_cap - 1;
    uint32_t k = (uint32_t)di_fnv1a(name, strlen(name), 14695981039346656037ull) & mask;
    while (c->name_ht[k] >= 0) k = (k + 1) & mask;
    c->name_ht[k] = r;
    c->n_names++;
    return true;
}

static int32_t add_rule(cc *c, const char *name, size_t n, bool generated) {
    if (c->n_rules >= DI_GRAMMAR_MAX_RULES) {
        fail_at(c, c->i, "the grammar is too large (more than %d rules)", DI_GRAMMAR_MAX_RULES);
        return -1;
    }
    if (c->n_rules == c->cap_rules) {
        int32_t cap = c->cap_rules ? c->cap_rules * 2 : 64;
        crule *r = di_realloc(c->rules, sizeof *r * (size_t)cap);
        if (!r) return nomem(c), -1;
        c->rules = r;
        c->cap_rules = cap;
    }
    crule *r = &c->rules[c->n_rules];
    memset(r, 0, sizeof *r);
    r->name = di_malloc(n + 1);
    if (!r->name) return nomem(c), -1;
    memcpy(r->name, name, n);
    r->name[n] = 0;
    di_buf_init(&r->body);
    r->generated = generated;
    if (!generated && !index_name(c, c->n_rules)) return nomem(c), -1;
    return c->n_rules++;
}

// The user rule named name[0..n), or -1 (open addressing over the names' hashes).
static int32_t find_rule(const cc *c, const char *name, size_t n) {
    if (!c->name_cap) return -1;
    const uint32_t mask = (uint32_t)c->name_cap - 1;
    for (uint32_t k = (uint32_t)di_fnv1a(name, n, 14695981039346656037ull) & mask;;
         k = (k + 1) & mask) {
        const int32_t i = c->name_ht[k];
        if (i < 0) return -1;
        if (strlen(c->rules[i].name) == n && !memcmp(c->rules[i].name, name, n)) return i;
    }
}

static int32_t gen_rule(cc *c) {
    char name[160];
    const char *base = c->cur_rule >= 0 ? c->rules[c->cur_rule].name : "rule";
    snprintf(name, sizeof name, "%.120s_%d", base, (int)++c->n_gen);
    return add_rule(c, name, strlen(name), true);
}

static int32_t set_index(cc *c, const uint64_t set[4]) {
    int one = -1, cnt = 0;
    for (int w = 0; w < 4; w++)
        for (int b = 0; b < 64; b++)
            if ((set[w] >> b) & 1) cnt++, one = w * 64 + b;
    if (cnt == 1 && c->single[one] >= 0) return c->single[one];
    for (int32_t i = 0; cnt != 1 && i < c->n_sets; i++)
        if (!memcmp(c->sets[i], set, sizeof(uint64_t) * 4)) return i;
    if (c->n_sets == c->cap_sets) {
        int32_t cap = c->cap_sets ? c->cap_sets * 2 : 64;
        uint64_t(*p)[4] = di_realloc(c->sets, sizeof *p * (size_t)cap);
        if (!p) return nomem(c), -1;
        c->sets = p;
        c->cap_sets = cap;
    }
    memcpy(c->sets[c->n_sets], set, sizeof(uint64_t) * 4);
    if (cnt == 1) c->single[one] = c->n_sets;
    return c->n_sets++;
}

// ---- sequences under construction ----

typedef struct seq {
    int32_t *v; // owned
    int32_t n, cap;
} seq;

static void seq_push(cc *c, seq *s, int32_t code) {
    if (c->failed) return;
    if (++c->n_codes > DI_GRAMMAR_MAX_ELEMS) {
        fail_at(c, c->i, "the grammar is too large (more than %d elements)", DI_GRAMMAR_MAX_ELEMS);
        return;
    }
    if (s->n == s->cap) {
        int32_t cap = s->cap ? s->cap * 2 : 16;
        int32_t *p = di_realloc(s->v, sizeof *p * (size_t)cap);
        if (!p) {
            nomem(c);
            return;
        }
        s->v = p;
        s->cap = cap;
    }
    s->v[s->n++] = code;
}

// Appends one alternative (codes + END) to rule r.
static void rule_add_alt(cc *c, int32_t r, const int32_t *codes, int32_t n) {
    if (c->failed) return;
    di_buf *b = &c->rules[r].body;
    int32_t end = CODE(DI_GRAMMAR_ELEM_END, 0);
    if (di_buf_append(b, codes, sizeof(int32_t) * (size_t)n) != DI_OK ||
        di_buf_append(b, &end, sizeof end) != DI_OK)
        nomem(c);
    c->n_codes++;
}

static void push_byte(cc *c, seq *s, uint8_t byte) {
    uint64_t set[4] = {0};
    set[byte >> 6] |= 1ull << (byte & 63);
    int32_t k = set_index(c, set);
    if (k >= 0) seq_push(c, s, CODE(DI_GRAMMAR_ELEM_BYTES, k));
}

static int utf8_put(uint32_t cp, uint8_t *o) {
    if (cp < 0x80) return o[0] = (uint8_t)cp, 1;
    if (cp < 0x800) return o[0] = (uint8_t)(0xC0 | cp >> 6), o[1] = (uint8_t)(0x80 | (cp & 63)), 2;
    if (cp < 0x10000) {
        o[0] = (uint8_t)(0xE0 | cp >> 12);
        o[1] = (uint8_t)(0x80 | ((cp >> 6) & 63));
        o[2] = (uint8_t)(0x80 | (cp & 63));
        return 3;
    }
    o[0] = (uint8_t)(0xF0 | cp >> 18);
    o[1] = (uint8_t)(0x80 | ((cp >> 12) & 63));
    o[2] = (uint8_t)(0x80 | ((cp >> 6) & 63));
    o[3] = (uint8_t)(0x80 | (cp & 63));
    return 4;
}

// ---- character classes: code-point ranges → UTF-8 byte-range sequences ----

typedef struct range {
    uint32_t lo, hi;
} range;

typedef struct u8seq {
    int n;
    uint8_t lo[4], hi[4];
} u8seq;

typedef struct u8out {
    u8seq *v; // owned
    int32_t n, cap;
} u8out;

static bool u8out_push(u8out *o, const u8seq *q) {
    if (o->n == o->cap) {
        int32_t cap = o->cap ? o->cap * 2 : 16;
        u8seq *p = di_realloc(o->v, sizeof *p * (size_t)cap);
        if (!p) return false;
        o->v = p;
        o->cap = cap;
    }
    o->v[o->n++] = *q;
    return true;
}

// Splits [lo, hi] (no surrogates, same encoded length after the first steps) into sequences of
// byte ranges: the standard construction (each sequence's bytes vary independently).
static bool split_utf8(uint32_t lo, uint32_t hi, u8out *o) {
    static const uint32_t lens[3] = {0x7F, 0x7FF, 0xFFFF};
    for (int k = 0; k < 3; k++)
        if (lo <= lens[k] && hi > lens[k])
            return split_utf8(lo, lens[k], o) && split_utf8(lens[k] + 1, hi, o);
    if (hi < 0x80) {
        u8seq q = {.n = 1, .lo = {(uint8_t)lo}, .hi = {(uint8_t)hi}};
        return u8out_push(o, &q);
    }
    for (int i = 1; i < 4; i++) {
        uint32_t m = (1u << (6 * i)) - 1;
        if ((lo & ~m) != (hi & ~m)) {
            if ((lo & m) != 0) return split_utf8(lo, lo | m, o) && split_utf8((lo | m) + 1, hi, o);
            if ((hi & m) != m)
                return split_utf8(lo, (hi & ~m) - 1, o) && split_utf8(hi & ~m, hi, o);
        }
    }
    u8seq q;
    uint8_t a[4], b[4];
    q.n = utf8_put(lo, a);
    utf8_put(hi, b);
    for (int k = 0; k < q.n; k++) q.lo[k] = a[k], q.hi[k] = b[k];
    return u8out_push(o, &q);
}

static int cmp_range(const void *a, const void *b) {
    const range *x = a, *y = b;
    return x->lo < y->lo ? -1 : x->lo > y->lo;
}

// Sorts and merges r[0..n); returns the new count.
static int32_t merge_ranges(range *r, int32_t n) {
    if (n == 0) return 0;
    qsort(r, (size_t)n, sizeof *r, cmp_range);
    int32_t k = 0;
    for (int32_t i = 1; i < n; i++) {
        if (r[i].lo <= r[k].hi + 1) {
            if (r[i].hi > r[k].hi) r[k].hi = r[i].hi;
        } else {
            r[++k] = r[i];
        }
    }
    return k + 1;
}

// Emits a reference matching one code point out of the merged ranges r[0..n) (surrogates are
// never matched): an inline byte set when every code point is ASCII, else a class rule (shared
// by identical classes).
static void push_class(cc *c, seq *s, const range *r, int32_t n, size_t pos) {
    if (c->failed) return;
    if (n == 0) {
        fail_at(c, pos, "empty character class (matches nothing)");
        return;
    }
    if (r[n - 1].hi < 0x80) {
        uint64_t set[4] = {0};
        for (int32_t i = 0; i < n; i++)
            for (uint32_t b = r[i].lo; b <= r[i].hi; b++) set[b >> 6] |= 1ull << (b & 63);
        int32_t k = set_index(c, set);
        if (k >= 0) seq_push(c, s, CODE(DI_GRAMMAR_ELEM_BYTES, k));
        return;
    }
    uint64_t h = di_fnv1a(r, sizeof *r * (size_t)n, 14695981039346656037ull);
    for (int32_t i = 0; i < c->n_classes; i++)
        if (c->classes[i].hash == h) {
            seq_push(c, s, CODE(DI_GRAMMAR_ELEM_RULE, c->classes[i].rule));
            return;
        }
    u8out o = {0};
    bool ok = true;
    for (int32_t i = 0; i < n && ok; i++) {
        uint32_t lo = r[i].lo, hi = r[i].hi;
        if (lo <= 0xDFFF && hi >= 0xD800) { // cut the surrogates out
            if (lo < 0xD800) ok = split_utf8(lo, 0xD7FF, &o);
            if (ok && hi > 0xDFFF) ok = split_utf8(0xE000, hi, &o);
        } else {
            ok = split_utf8(lo, hi, &o);
        }
    }
    if (!ok) {
        di_free(o.v);
        {
            nomem(c);
            return;
        }
    }
    int32_t rule = gen_rule(c);
    // ASCII part first, as one byte set; then each multi-byte sequence as an alternative.
    uint64_t ascii[4] = {0};
    bool any_ascii = false;
    for (int32_t i = 0; i < o.n; i++)
        if (o.v[i].n == 1)
            for (uint32_t b = o.v[i].lo[0]; b <= o.v[i].hi[0]; b++)
                ascii[b >> 6] |= 1ull << (b & 63), any_ascii = true;
    if (rule >= 0 && any_ascii) {
        int32_t code = CODE(DI_GRAMMAR_ELEM_BYTES, set_index(c, ascii));
        rule_add_alt(c, rule, &code, 1);
    }
    for (int32_t i = 0; rule >= 0 && i < o.n && !c->failed; i++) {
        if (o.v[i].n == 1) continue;
        int32_t codes[4];
        for (int k = 0; k < o.v[i].n; k++) {
            uint64_t set[4] = {0};
            for (uint32_t b = o.v[i].lo[k]; b <= o.v[i].hi[k]; b++) set[b >> 6] |= 1ull << (b & 63);
            codes[k] = CODE(DI_GRAMMAR_ELEM_BYTES, set_index(c, set));
        }
        rule_add_alt(c, rule, codes, o.v[i].n);
    }
    di_free(o.v);
    if (rule < 0 || c->failed) return;
    c->rules[rule].defined = true;
    if (c->n_classes == c->cap_classes) {
        int32_t cap = c->cap_classes ? c->cap_classes * 2 : 16;
        class_key *p = di_realloc(c->classes, sizeof *p * (size_t)cap);
        if (!p) {
            nomem(c);
            return;
        }
        c->classes = p;
        c->cap_classes = cap;
    }
    c->classes[c->n_classes++] = (class_key){.hash = h, .rule = rule};
    seq_push(c, s, CODE(DI_GRAMMAR_ELEM_RULE, rule));
}

// ---- lexer ----

static void skip_ws(cc *c) {
    while (c->i < c->n) {
        char ch = c->s[c->i];
        if (ch == ' ' || ch == '\t' || ch == '\n' || ch == '\r') {
            c->i++;
        } else if (ch == '#') {
            while (c->i < c->n && c->s[c->i] != '\n') c->i++;
        } else {
            break;
        }
    }
}

static bool is_name_char(char ch) {
    return (ch >= 'a' && ch <= 'z') || (ch >= 'A' && ch <= 'Z') || (ch >= '0' && ch <= '9') ||
           ch == '_' || ch == '-';
}

// Decodes one UTF-8 code point at c->i (validated); returns it and advances, or fails.
static uint32_t next_cp(cc *c) {
    const uint8_t *p = (const uint8_t *)c->s + c->i;
    size_t left = c->n - c->i;
    uint32_t cp;
    int len;
    if (p[0] < 0x80) return c->i++, p[0];
    if ((p[0] & 0xE0) == 0xC0)
        cp = p[0] & 0x1F, len = 2;
    else if ((p[0] & 0xF0) == 0xE0)
        cp = p[0] & 0x0F, len = 3;
    else if ((p[0] & 0xF8) == 0xF0)
        cp = p[0] & 0x07, len = 4;
    else
        len = 0, cp = 0;
    if (len == 0 || (size_t)len > left) goto bad;
    for (int k = 1; k < len; k++) {
        if ((p[k] & 0xC0) != 0x80) goto bad;
        cp = cp << 6 | (p[k] & 0x3F);
    }
    if ((len == 2 && cp < 0x80) || (len == 3 && cp < 0x800) || (len == 4 && cp < 0x10000) ||
        cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF))
        goto bad;
    c->i += (size_t)len;
    return cp;
bad:
    fail_at(c, c->i, "invalid UTF-8 in the grammar text");
    c->i = c->n;
    return 0;
}

static int hexval(char ch) {
    if (ch >= '0' && ch <= '9') return ch - '0';
    if (ch >= 'a' && ch <= 'f') return ch - 'a' + 10;
    if (ch >= 'A' && ch <= 'F') return ch - 'A' + 10;
    return -1;
}

// One character of a literal or class at c->i (after the caller checked it is not the closing
// delimiter): an escape or a UTF-8 code point.
static uint32_t lex_char(cc *c) {
    if (c->s[c->i] != '\\') return next_cp(c);
    size_t at = c->i;
    if (c->i + 1 >= c->n) {
        fail_at(c, at, "unfinished escape");
        return 0;
    }
    char e = c->s[c->i + 1];
    c->i += 2;
    int nd = 0;
    switch (e) {
    case 'n':
        return '\n';
    case 'r':
        return '\r';
    case 't':
        return '\t';
    case '0':
        return 0;
    case '\\':
    case '"':
    case '\'':
    case '[':
    case ']':
    case '-':
    case '^':
    case '/':
        return (uint8_t)e;
    case 'x':
        nd = 2;
        break;
    case 'u':
        nd = 4;
        break;
    case 'U':
        nd = 8;
        break;
    default:
        fail_at(c, at, "unknown escape '\\%c'", e);
        return 0;
    }
    uint32_t v = 0;
    for (int k = 0; k < nd; k++) {
        int h = c->i < c->n ? hexval(c->s[c->i]) : -1;
        if (h < 0) {
            fail_at(c, at, "escape '\\%c' needs %d hex digits", e, nd);
            return 0;
        }
        v = v * 16 + (uint32_t)h;
        c->i++;
    }
    if (v > 0x10FFFF || (v >= 0xD800 && v <= 0xDFFF)) {
        fail_at(c, at, "escape names U+%X, which is not a Unicode scalar value", v);
        return 0;
    }
    return v;
}

// ---- parser ----

static void parse_alts(cc *c, int32_t rule, int depth);

// Wraps s->v[from..n) into a new rule (one alternative) and leaves one reference in its place.
static int32_t wrap(cc *c, seq *s, int32_t from) {
    if (s->n - from == 1) return s->v[from];
    int32_t r = gen_rule(c);
    if (r < 0) return 0;
    rule_add_alt(c, r, s->v + from, s->n - from);
    c->rules[r].defined = true;
    s->n = from;
    return CODE(DI_GRAMMAR_ELEM_RULE, r);
}

// x* as a new rule R ::= x R | ε.
static int32_t star(cc *c, int32_t x) {
    int32_t r = gen_rule(c);
    if (r < 0) return 0;
    int32_t codes[2] = {x, CODE(DI_GRAMMAR_ELEM_RULE, r)};
    rule_add_alt(c, r, codes, 2);
    rule_add_alt(c, r, NULL, 0);
    c->rules[r].defined = true;
    return CODE(DI_GRAMMAR_ELEM_RULE, r);
}

static bool parse_int(cc *c, int64_t *v) {
    size_t at = c->i;
    int64_t x = 0;
    while (c->i < c->n && c->s[c->i] >= '0' && c->s[c->i] <= '9') {
        x = x * 10 + (c->s[c->i++] - '0');
        if (x > DI_GRAMMAR_MAX_REPEAT) {
            fail_at(c, at, "repetition count over the limit of %d", DI_GRAMMAR_MAX_REPEAT);
            return false;
        }
    }
    if (c->i == at) return false;
    *v = x;
    return true;
}

// Applies a postfix operator at c->i to the atom s->v[from..n).
static void postfix(cc *c, seq *s, int32_t from) {
    while (!c->failed && c->i < c->n) {
        char op = c->s[c->i];
        if (op != '*' && op != '+' && op != '?' && op != '{') return;
        size_t at = c->i++;
        int32_t x = wrap(c, s, from);
        s->n = from;
        int64_t m = 0, n = -1; // n = -1: unbounded
        if (op == '*')
            m = 0, n = -1;
        else if (op == '+')
            m = 1, n = -1;
        else if (op == '?')
            m = 0, n = 1;
        else {
            skip_ws(c);
            if (!parse_int(c, &m)) {
                if (!c->failed) fail_at(c, at, "expected a number after '{'");
                return;
            }
            skip_ws(c);
            n = m;
            if (c->i < c->n && c->s[c->i] == ',') {
                c->i++;
                skip_ws(c);
                n = -1;
                if (c->i < c->n && c->s[c->i] != '}' && !parse_int(c, &n)) {
                    if (!c->failed) fail_at(c, at, "expected a number or '}' in the repetition");
                    return;
                }
                skip_ws(c);
            }
            if (c->i >= c->n || c->s[c->i] != '}') {
                fail_at(c, at, "expected '}' closing the repetition");
                return;
            }
            c->i++;
            if (n >= 0 && n < m) {
                fail_at(c, at, "repetition {%lld,%lld}: the maximum is below the minimum",
                        (long long)m, (long long)n);
                return;
            }
        }
        for (int64_t k = 0; k < m && !c->failed; k++) seq_push(c, s, x);
        if (n < 0) {
            seq_push(c, s, star(c, x));
        } else if (n > m) {
            // O_1 ::= x | ε ; O_k ::= x O_{k-1} | ε  (linear in n - m; right recursive)
            int32_t prev = -1;
            for (int64_t k = 0; k < n - m && !c->failed; k++) {
                int32_t r = gen_rule(c);
                if (r < 0) return;
                int32_t codes[2] = {x, prev};
                rule_add_alt(c, r, codes, prev < 0 ? 1 : 2);
                rule_add_alt(c, r, NULL, 0);
                c->rules[r].defined = true;
                prev = CODE(DI_GRAMMAR_ELEM_RULE, r);
            }
            seq_push(c, s, prev);
        }
    }
}

// True if a rule definition (`name ::=`) starts at c->i.
static bool at_definition(const cc *c) {
    size_t j = c->i;
    while (j < c->n && is_name_char(c->s[j])) j++;
    if (j == c->i) return false;
    while (j < c->n && (c->s[j] == ' ' || c->s[j] == '\t')) j++;
    return c->n - j >= 3 && !memcmp(c->s + j, "::=", 3);
}

static void parse_seq(cc *c, seq *s, int depth) {
    for (;;) {
        skip_ws(c);
        if (c->failed || c->i >= c->n) return;
        char ch = c->s[c->i];
        if (ch == '|' || ch == ')') return;
        if (depth == 0 && at_definition(c)) return;
        int32_t from = s->n;
        size_t at = c->i;
        if (ch == '"' || ch == '\'') {
            char q = ch;
            c->i++;
            while (!c->failed && c->i < c->n && c->s[c->i] != q) {
                uint32_t cp = lex_char(c);
                uint8_t u[4];
                int nb = utf8_put(cp, u);
                for (int k = 0; k < nb; k++) push_byte(c, s, u[k]);
            }
            if (c->i >= c->n) {
                fail_at(c, at, "unterminated string literal");
                return;
            }
            c->i++;
            if (s->n == from) { // "" matches the empty string
                skip_ws(c);
                if (c->i < c->n && strchr("*+?{", c->s[c->i])) {
                    fail_at(c, c->i, "repetition of an empty string");
                    return;
                }
                continue;
            }
        } else if (ch == '[') {
            c->i++;
            bool neg = c->i < c->n && c->s[c->i] == '^';
            if (neg) c->i++;
            range stackr[64], *r = stackr;
            int32_t nr = 0, cap = 64;
            while (!c->failed && c->i < c->n && c->s[c->i] != ']') {
                uint32_t lo = lex_char(c), hi = lo;
                if (c->i + 1 < c->n && c->s[c->i] == '-' && c->s[c->i + 1] != ']') {
                    c->i++;
                    hi = lex_char(c);
                    if (hi < lo && !c->failed) {
                        fail_at(c, at, "class range out of order (U+%X-U+%X)", lo, hi);
                        break;
                    }
                }
                if (nr + 2 >= cap) {
                    range *p = di_malloc(sizeof *p * (size_t)cap * 2);
                    if (!p) {
                        nomem(c);
                        break;
                    }
                    memcpy(p, r, sizeof *r * (size_t)nr);
                    if (r != stackr) di_free(r);
                    r = p;
                    cap *= 2;
                }
                r[nr++] = (range){lo, hi};
            }
            if (!c->failed && c->i >= c->n) fail_at(c, at, "unterminated character class");
            if (!c->failed) {
                c->i++;
                nr = merge_ranges(r, nr);
                if (neg) { // complement within [0, 0x10FFFF]; needs nr + 1 slots
                    range *p = di_malloc(sizeof *p * (size_t)(nr + 1));
                    if (!p) {
                        nomem(c);
                    } else {
                        int32_t k = 0;
                        uint32_t next = 0;
                        for (int32_t i = 0; i < nr; i++) {
                            if (r[i].lo > next) p[k++] = (range){next, r[i].lo - 1};
                            next = r[i].hi + 1;
                        }
                        if (next <= 0x10FFFF) p[k++] = (range){next, 0x10FFFF};
                        push_class(c, s, p, k, at);
                        di_free(p);
                    }
                } else {
                    push_class(c, s, r, nr, at);
                }
            }
            if (r != stackr) di_free(r);
        } else if (ch == '<') {
            // <[id]>: one token id, matched as a unit (a special token; see grammar.h)
            int64_t id = -1;
            c->i++;
            if (c->i < c->n && c->s[c->i] == '[') {
                c->i++;
                for (size_t d0 = c->i; c->i < c->n && c->s[c->i] >= '0' && c->s[c->i] <= '9';) {
                    id = (id < 0 ? 0 : id) * 10 + (c->s[c->i++] - '0');
                    if (c->i - d0 > 10) break; // out of range below
                }
            }
            if (id < 0 || c->n - c->i < 2 || c->s[c->i] != ']' || c->s[c->i + 1] != '>') {
                fail_at(c, at, "expected a token terminal <[id]> (a token id in decimal)");
                return;
            }
            if (id > 0x3fffffff) {
                fail_at(c, at, "token id %lld is out of range", (long long)id);
                return;
            }
            c->i += 2;
            seq_push(c, s, CODE(DI_GRAMMAR_ELEM_TOKEN, id));
        } else if (ch == '.') {
            c->i++;
            range any = {0, 0x10FFFF};
            push_class(c, s, &any, 1, at);
        } else if (ch == '(') {
            c->i++;
            int32_t r = gen_rule(c);
            if (r < 0) return;
            parse_alts(c, r, depth + 1);
            if (c->failed) return;
            skip_ws(c);
            if (c->i >= c->n || c->s[c->i] != ')') {
                fail_at(c, at, "unclosed '('");
                return;
            }
            c->i++;
            c->rules[r].defined = true;
            seq_push(c, s, CODE(DI_GRAMMAR_ELEM_RULE, r));
        } else if (is_name_char(ch)) {
            size_t j = c->i;
            while (j < c->n && is_name_char(c->s[j])) j++;
            int32_t r = find_rule(c, c->s + c->i, j - c->i);
            if (r < 0) {
                r = add_rule(c, c->s + c->i, j - c->i, false);
                if (r < 0) return;
                int line = 1;
                size_t ls = 0;
                for (size_t k = 0; k < c->i; k++)
                    if (c->s[k] == '\n') line++, ls = k + 1;
                c->rules[r].line = line;
                c->rules[r].col = (int)(c->i - ls) + 1;
            }
            c->i = j;
            seq_push(c, s, CODE(DI_GRAMMAR_ELEM_RULE, r));
        } else if (ch == '*' || ch == '+' || ch == '?' || ch == '{') {
            {
                fail_at(c, at, "'%c' must follow an element", ch);
                return;
            }
        } else {
            {
                fail_at(c, at, "unexpected character '%c'", ch);
                return;
            }
        }
        if (depth > 200) {
            fail_at(c, at, "groups nested too deeply");
            return;
        }
        postfix(c, s, from);
    }
}

static void parse_alts(cc *c, int32_t rule, int depth) {
    seq s = {0};
    for (;;) {
        s.n = 0;
        parse_seq(c, &s, depth);
        if (c->failed) break;
        rule_add_alt(c, rule, s.v, s.n);
        skip_ws(c);
        if (c->i < c->n && c->s[c->i] == '|') {
            c->i++;
            continue;
        }
        break;
    }
    di_free(s.v);
}

// ---- checks: undefined rules, left recursion ----

// Rule r's codes and alternatives (views into its body).
static const int32_t *body(const cc *c, int32_t r, size_t *n) {
    *n = c->rules[r].body.len / sizeof(int32_t);
    return (const int32_t *)c->rules[r].body.data;
}

static bool check(cc *c) {
    for (int32_t r = 0; r < c->n_rules; r++) {
        if (!c->rules[r].defined) {
            if (c->err && c->err_size)
                snprintf(c->err, c->err_size, "%d:%d: undefined rule '%s'", c->rules[r].line,
                         c->rules[r].col, c->rules[r].name);
            c->failed = true;
            c->st = DI_ERR_INVALID;
            return false;
        }
    }
    // Nullable rules (fixpoint).
    bool *nul = di_calloc((size_t)c->n_rules, 1);
    uint8_t *state = di_calloc((size_t)c->n_rules, 1);
    int32_t *stk = di_malloc(sizeof(int32_t) * 2 * (size_t)c->n_rules + 2);
    if (!nul || !state || !stk) {
        di_free(nul), di_free(state), di_free(stk);
        nomem(c);
        return false;
    }
    for (bool changed = true; changed;) {
        changed = false;
        for (int32_t r = 0; r < c->n_rules; r++) {
            if (nul[r]) continue;
            size_t n;
            const int32_t *b = body(c, r, &n);
            bool all = true;
            for (size_t k = 0; k < n; k++) {
                uint32_t t = CODE_TYPE(b[k]);
                if (t == DI_GRAMMAR_ELEM_END) {
                    if (all) {
                        nul[r] = changed = true;
                        break;
                    }
                    all = true;
                } else if (t != DI_GRAMMAR_ELEM_RULE || !nul[CODE_VAL(b[k])]) {
                    all = false;
                }
            }
        }
    }
    // Left-call graph: r -> s when s can start r (everything before it in an alternative is
    // nullable). An edge is a tail call when s is the alternative's last element: the matcher
    // expands it with the same continuation, and its per-level (rule, continuation) memo ends a
    // cycle made of tail calls only (e.g. (x?)* or a ::= "x"? a). A cycle through a non-tail
    // edge grows the stack forever: that is left recursion, refused. Found with Tarjan's strongly
    // connected components (iterative): a non-tail edge inside one component.
    int32_t *e_off = di_calloc((size_t)c->n_rules + 1, sizeof(int32_t));
    di_buf edges; // pairs (callee, tail)
    di_buf_init(&edges);
    bool ok = e_off != NULL;
    for (int32_t r = 0; r < c->n_rules && ok; r++) {
        e_off[r] = (int32_t)(edges.len / (2 * sizeof(int32_t)));
        size_t n;
        const int32_t *b = body(c, r, &n);
        bool lead = true;
        for (size_t k = 0; k < n && ok; k++) {
            uint32_t t = CODE_TYPE(b[k]);
            if (t == DI_GRAMMAR_ELEM_END) {
                lead = true;
                continue;
            }
            if (!lead) continue;
            if (t != DI_GRAMMAR_ELEM_RULE) {
                lead = false;
                continue;
            }
            int32_t e[2] = {CODE_VAL(b[k]), CODE_TYPE(b[k + 1]) == DI_GRAMMAR_ELEM_END};
            ok = di_buf_append(&edges, e, sizeof e) == DI_OK;
            if (!nul[CODE_VAL(b[k])]) lead = false;
        }
    }
    if (!ok) {
        di_free(e_off), di_buf_deinit(&edges), di_free(nul), di_free(state), di_free(stk);
        nomem(c);
        return false;
    }
    e_off[c->n_rules] = (int32_t)(edges.len / (2 * sizeof(int32_t)));
    const int32_t *E = (const int32_t *)edges.data;
    int32_t *idx = di_malloc(sizeof(int32_t) * (size_t)c->n_rules);
    int32_t *low = di_malloc(sizeof(int32_t) * (size_t)c->n_rules);
    int32_t *comp = di_malloc(sizeof(int32_t) * (size_t)c->n_rules);
    int32_t *tstk = di_malloc(sizeof(int32_t) * (size_t)c->n_rules + 1);
    if (!idx || !low || !comp || !tstk) {
        ok = false;
        nomem(c);
    }
    for (int32_t r = 0; ok && r < c->n_rules; r++) idx[r] = -1, comp[r] = -1;
    int32_t counter = 0, tsp = 0, n_comp = 0;
    for (int32_t r0 = 0; ok && r0 < c->n_rules; r0++) {
        if (idx[r0] >= 0) continue;
        int32_t sp = 0; // call stack: (rule, next edge)
        stk[sp++] = r0, stk[sp++] = e_off[r0];
        idx[r0] = low[r0] = counter++;
        tstk[tsp++] = r0;
        state[r0] = 1; // on the Tarjan stack
        while (sp) {
            int32_t r = stk[sp - 2], k = stk[sp - 1];
            if (k < e_off[r + 1]) {
                stk[sp - 1] = k + 1;
                int32_t v = E[2 * k];
                if (idx[v] < 0) {
                    idx[v] = low[v] = counter++;
                    tstk[tsp++] = v;
                    state[v] = 1;
                    stk[sp++] = v, stk[sp++] = e_off[v];
                } else if (state[v] == 1 && idx[v] < low[r]) {
                    low[r] = idx[v];
                }
                continue;
            }
            if (low[r] == idx[r]) {
                int32_t v;
                do {
                    v = tstk[--tsp];
                    state[v] = 2;
                    comp[v] = n_comp;
                } while (v != r);
                n_comp++;
            }
            sp -= 2;
            if (sp && low[r] < low[stk[sp - 2]]) low[stk[sp - 2]] = low[r];
        }
    }
    for (int32_t r = 0; ok && r < c->n_rules; r++) {
        for (int32_t k = e_off[r]; k < e_off[r + 1]; k++) {
            int32_t v = E[2 * k];
            if (E[2 * k + 1] || comp[v] != comp[r]) continue;
            // Name a user rule of the component (a generated one stands for a group in it).
            const char *name = c->rules[r].name;
            for (int32_t q = 0; q < c->n_rules; q++)
                if (comp[q] == comp[r] && !c->rules[q].generated) {
                    name = c->rules[q].name;
                    break;
                }
            if (c->err && c->err_size)
                snprintf(c->err, c->err_size,
                         "rule '%s' is left-recursive (it can reach itself without consuming "
                         "input); rewrite it with repetition, e.g. a ::= b (\"+\" b)*",
                         name);
            c->failed = true;
            c->st = DI_ERR_INVALID;
            ok = false;
            break;
        }
    }
    di_free(idx), di_free(low), di_free(comp), di_free(tstk), di_free(e_off);
    di_buf_deinit(&edges);
    di_free(nul), di_free(state), di_free(stk);
    return ok;
}

// ---- assembly ----

const di_grammar *di_grammar_retain(const di_grammar *g) {
    atomic_fetch_add(&((di_grammar *)g)->refs, 1); // the count is the one mutable field
    return g;
}

void di_grammar_destroy(di_grammar *g) {
    if (!g || atomic_fetch_sub(&g->refs, 1) > 1) return;
    for (int32_t i = 0; g->rule_names && i < g->n_rules; i++) di_free(g->rule_names[i]);
    di_free(g->rule_names);
    di_free(g->alt_off);
    di_free(g->alts);
    di_free(g->elems);
    di_free(g->sets);
    di_grammar_tsets_destroy(g->tsets);
    di_free(g->key);
    di_free(g);
}

int32_t di_grammar_n_rules(const di_grammar *g) {
    return g->n_rules;
}

static di_status assemble(cc *c, int32_t root, di_grammar **out) {
    di_grammar *g = di_calloc(1, sizeof *g);
    if (!g) return DI_ERR_NOMEM;
    int64_t n_elems = 0, n_alts = 0;
    for (int32_t r = 0; r < c->n_rules; r++) {
        size_t n;
        const int32_t *b = body(c, r, &n);
        n_elems += (int64_t)n;
        for (size_t k = 0; k < n; k++) n_alts += CODE_TYPE(b[k]) == DI_GRAMMAR_ELEM_END;
    }
    atomic_init(&g->refs, 1);
    g->n_rules = c->n_rules;
    g->rule_names = di_calloc((size_t)c->n_rules, sizeof(char *));
    g->alt_off = di_malloc(sizeof(int32_t) * ((size_t)c->n_rules + 1));
    g->alts = di_malloc(sizeof(int32_t) * (size_t)(n_alts + 1));
    g->elems = di_malloc(sizeof(di_grammar_elem) * (size_t)(n_elems + 1));
    g->sets = di_malloc(sizeof *g->sets * (size_t)(c->n_sets + 1));
    if (!g->rule_names || !g->alt_off || !g->alts || !g->elems || !g->sets ||
        di_grammar_tsets_create(&g->tsets) != DI_OK) {
        di_grammar_destroy(g);
        return DI_ERR_NOMEM;
    }
    if (c->n_sets) memcpy(g->sets, c->sets, sizeof *g->sets * (size_t)c->n_sets);
    g->n_sets = c->n_sets;
    int32_t e = 0, a = 0;
    for (int32_t r = 0; r < c->n_rules; r++) {
        g->rule_names[r] = c->rules[r].name;
        c->rules[r].name = NULL;
        g->alt_off[r] = a;
        size_t n;
        const int32_t *b = body(c, r, &n);
        bool start = true;
        for (size_t k = 0; k < n; k++) {
            if (start) g->alts[a++] = e, start = false;
            g->elems[e++] = (di_grammar_elem){.type = CODE_TYPE(b[k]), .val = CODE_VAL(b[k])};
            if (CODE_TYPE(b[k]) == DI_GRAMMAR_ELEM_END) start = true;
        }
    }
    g->alt_off[c->n_rules] = a;
    g->n_elems = e;
    g->n_alts = a;
    g->root = root;
    *out = g;
    return DI_OK;
}

di_status di_grammar_compile_ebnf(const char *text, size_t n, di_grammar **out, char *err,
                                  size_t err_size) {
    if (err && err_size) err[0] = 0;
    if (n > DI_GRAMMAR_MAX_TEXT) {
        if (err && err_size)
            snprintf(err, err_size, "the grammar text is over %u bytes", DI_GRAMMAR_MAX_TEXT);
        return DI_ERR_INVALID;
    }
    cc c = {.s = text, .n = n, .err = err, .err_size = err_size, .cur_rule = -1};
    memset(c.single, 0xff, sizeof c.single);
    skip_ws(&c);
    while (!c.failed && c.i < c.n) {
        size_t at = c.i;
        if (!at_definition(&c)) {
            fail_at(&c, at, "expected a rule definition 'name ::= ...'");
            break;
        }
        size_t j = c.i;
        while (j < c.n && is_name_char(c.s[j])) j++;
        int32_t r = find_rule(&c, c.s + c.i, j - c.i);
        if (r >= 0 && c.rules[r].defined) {
            fail_at(&c, at, "rule '%.*s' is defined twice", (int)(j - c.i), c.s + c.i);
            break;
        }
        if (r < 0) r = add_rule(&c, c.s + c.i, j - c.i, false);
        if (r < 0) break;
        c.rules[r].defined = true;
        c.i = j;
        skip_ws(&c);
        c.i += 3; // "::="
        c.cur_rule = r;
        c.n_gen = 0;
        parse_alts(&c, r, 0);
        if (c.failed) break;
        skip_ws(&c);
        if (c.i < c.n && !at_definition(&c)) {
            fail_at(&c, c.i, "unexpected '%c'", c.s[c.i]);
            break;
        }
    }
    int32_t root = c.failed ? -1 : find_rule(&c, "root", 4);
    if (!c.failed && (root < 0 || !c.rules[root].defined)) {
        if (err && err_size) snprintf(err, err_size, "1:1: the grammar has no rule 'root'");
        c.failed = true;
        c.st = DI_ERR_INVALID;
    }
    di_status st = DI_OK;
    if (!c.failed) check(&c);
    if (c.failed)
        st = c.st;
    else
        st = assemble(&c, root, out);
    for (int32_t r = 0; r < c.n_rules; r++) {
        di_free(c.rules[r].name);
        di_buf_deinit(&c.rules[r].body);
    }
    di_free(c.rules);
    di_free(c.name_ht);
    di_free(c.sets);
    di_free(c.classes);
    return st;
}

// ---- helpers for the front ends ----

di_status di_grammar_put_literal(di_buf *out, const char *s, size_t n) {
    di_status st = di_buf_append(out, "\"", 1);
    for (size_t i = 0; i < n && st == DI_OK; i++) {
        uint8_t ch = (uint8_t)s[i];
        if (ch == '"' || ch == '\\')
            st = di_buf_printf(out, "\\%c", ch);
        else if (ch < 0x20 || ch == 0x7f)
            st = di_buf_printf(out, "\\x%02X", ch);
        else
            st = di_buf_append(out, &s[i], 1);
    }
    if (st == DI_OK) st = di_buf_append(out, "\"", 1);
    return st;
}

// ---- public entry ----

di_status di_grammar_compile(di_grammar_kind kind, const char *text, size_t n_text, uint32_t flags,
                             di_grammar **out, char *err, size_t err_size) {
    return di_grammar_cache_compile(NULL, kind, text, n_text, flags, out, err, err_size);
}

di_status di_grammar_cache_compile(di_grammar_cache *c, di_grammar_kind kind, const char *text,
                                   size_t n_text, uint32_t flags, di_grammar **out, char *err,
                                   size_t err_size) {
    if (err && err_size) err[0] = 0;
    if (!out || (!text && kind != DI_GRAMMAR_KIND_JSON_OBJECT)) {
        if (err && err_size) snprintf(err, err_size, "no grammar text");
        return DI_ERR_INVALID;
    }
    if (kind == DI_GRAMMAR_KIND_EBNF)
        return di_grammar_cache_ebnf(c, text, n_text, out, err, err_size);
    di_buf b;
    di_buf_init(&b);
    di_status st = DI_OK;
    switch (kind) {
    case DI_GRAMMAR_KIND_JSON_SCHEMA:
        st = di_grammar_schema_to_ebnf(text, n_text, (flags & DI_GRAMMAR_FLAG_STRICT) != 0, &b, err,
                                       err_size);
        break;
    case DI_GRAMMAR_KIND_JSON_OBJECT:
        st = di_buf_append_str(&b, di_grammar_json_object_ebnf());
        break;
    case DI_GRAMMAR_KIND_REGEX:
        st = di_buf_append_str(&b, "root ::= re\n");
        if (st == DI_OK)
            st = di_grammar_regex_to_ebnf(text, n_text, "re", false, &b, err, err_size);
        break;
    default:
        if (err && err_size) snprintf(err, err_size, "unknown grammar kind %d", (int)kind);
        st = DI_ERR_INVALID;
    }
    if (st == DI_OK) {
        char e2[256];
        st = di_grammar_cache_ebnf(c, b.data, b.len, out, e2, sizeof e2);
        if (st == DI_ERR_INVALID) {
            // A front end wrote a grammar the compiler refused: a bug or a size limit.
            if (err && err_size) snprintf(err, err_size, "the generated grammar: %s", e2);
            DI_LOG_DEBUG("grammar: generated grammar refused (%s):\n%s", e2, b.data);
        }
    }
    di_buf_deinit(&b);
    return st;
}

di_status di_grammar_union(const di_grammar *a, const di_grammar *b, di_grammar **out) {
    // b's rules, alternatives, elements and sets follow a's (indices shifted); a new rule `root`
    // with the alternatives a.root and b.root comes last. Neither part can reach the new rule,
    // so no left recursion appears.
    const int64_t n_rules = (int64_t)a->n_rules + b->n_rules + 1;
    const int64_t n_elems = (int64_t)a->n_elems + b->n_elems + 4;
    if (n_rules > DI_GRAMMAR_MAX_RULES || n_elems > DI_GRAMMAR_MAX_ELEMS) return DI_ERR_INVALID;
    di_grammar *g = di_calloc(1, sizeof *g);
    if (!g) return DI_ERR_NOMEM;
    atomic_init(&g->refs, 1);
    g->n_rules = (int32_t)n_rules;
    g->n_alts = a->n_alts + b->n_alts + 2;
    g->n_elems = (int32_t)n_elems;
    g->n_sets = a->n_sets + b->n_sets;
    g->rule_names = di_calloc((size_t)n_rules, sizeof(char *));
    g->alt_off = di_malloc(sizeof(int32_t) * ((size_t)n_rules + 1));
    g->alts = di_malloc(sizeof(int32_t) * (size_t)g->n_alts);
    g->elems = di_malloc(sizeof(di_grammar_elem) * (size_t)n_elems);
    g->sets = di_malloc(sizeof *g->sets * (size_t)(g->n_sets + 1));
    if (!g->rule_names || !g->alt_off || !g->alts || !g->elems || !g->sets ||
        di_grammar_tsets_create(&g->tsets) != DI_OK)
        goto nomem;
    for (int32_t r = 0; r < g->n_rules; r++) {
        const char *nm = r < a->n_rules                ? a->rule_names[r]
                         : r < a->n_rules + b->n_rules ? b->rule_names[r - a->n_rules]
                                                       : "root";
        size_t len = strlen(nm);
        if (!(g->rule_names[r] = di_malloc(len + 1))) goto nomem;
        memcpy(g->rule_names[r], nm, len + 1);
    }
    memcpy(g->sets, a->sets, sizeof *g->sets * (size_t)a->n_sets);
    memcpy(g->sets + a->n_sets, b->sets, sizeof *g->sets * (size_t)b->n_sets);
    memcpy(g->elems, a->elems, sizeof *g->elems * (size_t)a->n_elems);
    for (int32_t i = 0; i < b->n_elems; i++) {
        di_grammar_elem e = b->elems[i];
        if (e.type == DI_GRAMMAR_ELEM_BYTES) e.val += a->n_sets;
        if (e.type == DI_GRAMMAR_ELEM_RULE) e.val += a->n_rules;
        g->elems[a->n_elems + i] = e;
    }
    const int32_t e0 = a->n_elems + b->n_elems;
    g->elems[e0] = (di_grammar_elem){DI_GRAMMAR_ELEM_RULE, a->root};
    g->elems[e0 + 1] = (di_grammar_elem){DI_GRAMMAR_ELEM_END, 0};
    g->elems[e0 + 2] = (di_grammar_elem){DI_GRAMMAR_ELEM_RULE, a->n_rules + b->root};
    g->elems[e0 + 3] = (di_grammar_elem){DI_GRAMMAR_ELEM_END, 0};
    memcpy(g->alts, a->alts, sizeof(int32_t) * (size_t)a->n_alts);
    for (int32_t i = 0; i < b->n_alts; i++) g->alts[a->n_alts + i] = b->alts[i] + a->n_elems;
    g->alts[a->n_alts + b->n_alts] = e0;
    g->alts[a->n_alts + b->n_alts + 1] = e0 + 2;
    memcpy(g->alt_off, a->alt_off, sizeof(int32_t) * (size_t)a->n_rules);
    for (int32_t r = 0; r <= b->n_rules; r++)
        g->alt_off[a->n_rules + r] = b->alt_off[r] + a->n_alts;
    g->alt_off[n_rules] = g->n_alts;
    g->root = (int32_t)n_rules - 1;
    *out = g;
    return DI_OK;
nomem:
    di_grammar_destroy(g);
    return DI_ERR_NOMEM;
}
