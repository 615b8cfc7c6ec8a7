// json_schema — JSON Schema → EBNF text (see grammar.h; docs/structured-output.md lists what is
// enforced). The output is compact JSON with bounded optional whitespace: one optional gap of at
// most one space, or a newline and up to 40 spaces or tabs, between tokens (so pretty-printing
// works, and a model can never loop on whitespace). Object properties come in the schema's
// declared order; optional ones may be left out. Numbers are bounded: at most 16 integer digits,
// 16 fraction digits and 3 exponent digits.
//
// Enforced: type (one or a list, "null" included), properties / required / additionalProperties
// (default: allowed, or none with strict), items, prefixItems, minItems, maxItems, minLength,
// maxLength, pattern (search semantics, regex.c), format (date-time, date, time, uuid, email,
// ipv4, hostname), enum, const, anyOf / oneOf (as alternation: oneOf's exclusivity is not
// checked), allOf with one schema, $ref to "#", "#/$defs/..." and "#/definitions/..." (recursion
// allowed), minimum / maximum / exclusiveMinimum / exclusiveMaximum on integers when the range
// is finite on both sides and spans at most DI_SCHEMA_MAX_INT_RANGE values (enumerated).
// Annotations are ignored. Every other keyword that constrains a value is refused with its name
// and JSON pointer; minimum / maximum on numbers and open-ended integer bounds are accepted but
// not enforced (documented).
#include <jansson.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#include "base/mem.h"
#include "grammar/grammar.h"

#define DI_SCHEMA_MAX_INT_RANGE 1000
#define DI_SCHEMA_MAX_REFS 4096

typedef struct sref {
    const json_t *target; // borrowed (the schema document)
    int32_t id;
} sref;

typedef struct sc {
    const json_t *root; // borrowed
    bool strict;
    di_buf *out; // rules
    char *err;
    size_t err_size;
    bool failed;
    di_status st;
    int32_t n_rules;
    sref refs[DI_SCHEMA_MAX_REFS];
    int32_t n_refs;
    int depth;
} sc;

static void sfail(sc *c, const char *ptr, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static void sfail(sc *c, const char *ptr, const char *fmt, ...) {
    if (c->failed) return;
    c->failed = true;
    c->st = DI_ERR_INVALID;
    char msg[300];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    if (c->err && c->err_size) snprintf(c->err, c->err_size, "JSON Schema at '#%s': %s", ptr, msg);
}

static void bput(sc *c, di_buf *b, const char *s) {
    if (!c->failed && di_buf_append_str(b, s) != DI_OK) c->failed = true, c->st = DI_ERR_NOMEM;
}

static void bputf(sc *c, di_buf *b, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
// Any length (rule bodies hold property names of any size).
static void bputf(sc *c, di_buf *b, const char *fmt, ...) {
    char tmp[256];
    va_list ap, ap2;
    va_start(ap, fmt);
    va_copy(ap2, ap);
    int n = vsnprintf(tmp, sizeof tmp, fmt, ap);
    va_end(ap);
    if (n >= 0 && (size_t)n < sizeof tmp) {
        bput(c, b, tmp);
    } else if (n >= 0) {
        char *big = di_malloc((size_t)n + 1);
        if (big) {
            vsnprintf(big, (size_t)n + 1, fmt, ap2);
            bput(c, b, big);
            di_free(big);
        } else {
            c->failed = true, c->st = DI_ERR_NOMEM;
        }
    }
    va_end(ap2);
}

static void blit(sc *c, di_buf *b, const char *s, size_t n) {
    if (!c->failed && di_grammar_put_literal(b, s, n) != DI_OK)
        c->failed = true, c->st = DI_ERR_NOMEM;
}

// A JSON value's compact text as an EBNF literal.
static void put_json_literal(sc *c, di_buf *b, const json_t *v) {
    char *t = json_dumps(v, JSON_COMPACT | JSON_ENCODE_ANY);
    if (!t) {
        c->failed = true, c->st = DI_ERR_NOMEM;
        return;
    }
    blit(c, b, t, strlen(t));
    free(t);
}

// Appends "/key" (JSON-pointer escaped) to ptr.
static void ptr_join(char *dst, size_t cap, const char *ptr, const char *key) {
    size_t n = (size_t)snprintf(dst, cap, "%s/", ptr);
    for (const char *k = key; *k && n + 3 < cap; k++) {
        if (*k == '~')
            dst[n++] = '~', dst[n++] = '0';
        else if (*k == '/')
            dst[n++] = '~', dst[n++] = '1';
        else
            dst[n++] = *k;
    }
    dst[n < cap ? n : cap - 1] = 0;
}

static const char *const k_annotations[] = {
    "title",   "description",      "examples",        "default",  "$schema",
    "$id",     "$comment",         "deprecated",      "readOnly", "writeOnly",
    "$anchor", "contentMediaType", "contentEncoding", "strict",   "name",
    "$defs",   "definitions",      "discriminator",   "nullable", NULL};

static bool in_list(const char *const *l, const char *k) {
    for (; *l; l++)
        if (!strcmp(*l, k)) return true;
    return false;
}

// A keyword that constrains values and is not enforced here: refused.
static const char *const k_refused[] = {"not",
                                        "if",
                                        "then",
                                        "else",
                                        "dependentRequired",
                                        "dependentSchemas",
                                        "dependencies",
                                        "patternProperties",
                                        "propertyNames",
                                        "minProperties",
                                        "maxProperties",
                                        "uniqueItems",
                                        "contains",
                                        "minContains",
                                        "maxContains",
                                        "multipleOf",
                                        "unevaluatedProperties",
                                        "unevaluatedItems",
                                        "additionalItems",
                                        "$dynamicRef",
                                        "$recursiveRef",
                                        NULL};

static void gen(sc *c, const json_t *s, const char *ptr, char name[32]);

// Writes a new rule "sN ::= body" and its name.
static void new_rule(sc *c, di_buf *body, char name[32]) {
    snprintf(name, 32, "s%d", (int)c->n_rules++);
    bputf(c, c->out, "%s ::= ", name);
    bput(c, c->out, body->data ? body->data : "\"\"");
    bput(c, c->out, "\n");
}

// ---- strings ----

static const char *format_regex(const char *f) {
#define DATE "[0-9]{4}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])"
#define TIME                                                                                       \
    "([01][0-9]|2[0-3]):[0-5][0-9]:([0-5][0-9]|60)(\\.[0-9]{1,9})?(Z|z|[+-]([01][0-9]|2[0-3]):[0-" \
    "5][0-9])"
#define OCTET "(25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])"
#define LABEL "[a-zA-Z0-9]([a-zA-Z0-9-]{0,61}[a-zA-Z0-9])?"
    if (!strcmp(f, "date")) return "^" DATE "$";
    if (!strcmp(f, "time")) return "^" TIME "$";
    if (!strcmp(f, "date-time")) return "^" DATE "[Tt ]" TIME "$";
    if (!strcmp(f, "uuid"))
        return "^[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}$";
    if (!strcmp(f, "email")) return "^[a-zA-Z0-9.!#$%&'*+/=?^_`{|}~-]+@" LABEL "(\\." LABEL ")*$";
    if (!strcmp(f, "ipv4")) return "^(" OCTET "\\.){3}" OCTET "$";
    if (!strcmp(f, "hostname")) return "^" LABEL "(\\." LABEL ")*$";
    return NULL;
#undef DATE
#undef TIME
#undef OCTET
#undef LABEL
}

static bool get_count(sc *c, const json_t *s, const char *key, const char *ptr, int64_t *v) {
    const json_t *x = json_object_get(s, key);
    if (!x) return false;
    if (!json_is_integer(x) || json_integer_value(x) < 0 ||
        json_integer_value(x) > DI_GRAMMAR_MAX_REPEAT) {
        sfail(c, ptr, "'%s' must be an integer in [0, %d]", key, DI_GRAMMAR_MAX_REPEAT);
        return false;
    }
    *v = json_integer_value(x);
    return true;
}

static void gen_string(sc *c, const json_t *s, const char *ptr, di_buf *b) {
    const json_t *pat = json_object_get(s, "pattern"), *fmt = json_object_get(s, "format");
    int64_t lo = 0, hi = -1;
    bool has_lo = get_count(c, s, "minLength", ptr, &lo);
    bool has_hi = get_count(c, s, "maxLength", ptr, &hi);
    if (c->failed) return;
    if (has_hi && hi < lo) {
        sfail(c, ptr, "maxLength is below minLength");
        return;
    }
    const char *re = NULL;
    if (fmt) {
        if (!json_is_string(fmt)) {
            sfail(c, ptr, "'format' must be a string");
            return;
        }
        re = format_regex(json_string_value(fmt));
        if (!re) {
            sfail(c, ptr,
                  "format '%s' is not supported (supported: date-time, date, time, "
                  "uuid, email, ipv4, hostname)",
                  json_string_value(fmt));
            return;
        }
    }
    if (pat) {
        if (!json_is_string(pat)) {
            sfail(c, ptr, "'pattern' must be a string");
            return;
        }
        if (re) {
            sfail(c, ptr, "'pattern' together with 'format' is not supported");
            return;
        }
        re = json_string_value(pat);
    }
    if (re && (has_lo || has_hi)) {
        sfail(c, ptr, "minLength/maxLength together with pattern or format is not supported");
        return;
    }
    if (re) {
        char name[32];
        snprintf(name, sizeof name, "s%d", (int)c->n_rules++);
        char e2[200];
        size_t n0 = c->out->len;
        di_status st = di_grammar_regex_to_ebnf(re, strlen(re), name, true, c->out, e2, sizeof e2);
        if (st != DI_OK) {
            c->out->len = n0;
            if (c->out->data) c->out->data[n0] = 0;
            if (st == DI_ERR_NOMEM) c->failed = true, c->st = st;
            {
                sfail(c, ptr, "%s: %s", pat ? "pattern" : "format", e2);
                return;
            }
        }
        bputf(c, b, "\"\\\"\" %s \"\\\"\"", name);
        return;
    }
    if (!has_lo && !has_hi) {
        bput(c, b, "json-string");
        return;
    }
    if (has_hi)
        bputf(c, b, "\"\\\"\" json-char{%lld,%lld} \"\\\"\"", (long long)lo, (long long)hi);
    else
        bputf(c, b, "\"\\\"\" json-char{%lld,} \"\\\"\"", (long long)lo);
}

// ---- integers ----

static void gen_integer(sc *c, const json_t *s, const char *ptr, di_buf *b) {
    const json_t *mn = json_object_get(s, "minimum"), *mx = json_object_get(s, "maximum");
    const json_t *xmn = json_object_get(s, "exclusiveMinimum");
    const json_t *xmx = json_object_get(s, "exclusiveMaximum");
    bool has_lo = false, has_hi = false;
    double lo = 0, hi = 0;
    if (mn && json_is_number(mn)) lo = json_number_value(mn), has_lo = true;
    if (xmn && json_is_number(xmn)) {
        double v = json_number_value(xmn) + 1;
        if (!has_lo || v > lo) lo = v;
        has_lo = true;
    }
    if (mx && json_is_number(mx)) hi = json_number_value(mx), has_hi = true;
    if (xmx && json_is_number(xmx)) {
        double v = json_number_value(xmx) - 1;
        if (!has_hi || v < hi) hi = v;
        has_hi = true;
    }
    if (has_lo && has_hi) {
        long long a = (long long)__builtin_ceil(lo), z = (long long)__builtin_floor(hi);
        if (z < a) {
            sfail(c, ptr, "the integer range is empty");
            return;
        }
        if (z - a < DI_SCHEMA_MAX_INT_RANGE) {
            bput(c, b, "(");
            for (long long v = a; v <= z; v++) bputf(c, b, "%s\"%lld\"", v > a ? " | " : "", v);
            bput(c, b, ")");
            return;
        }
    }
    bput(c, b, "json-int"); // open-ended or wide range: not enforced (documented)
}

// ---- objects ----

static void gen_object(sc *c, const json_t *s, const char *ptr, di_buf *b) {
    const json_t *props = json_object_get(s, "properties");
    const json_t *req = json_object_get(s, "required");
    const json_t *addl = json_object_get(s, "additionalProperties");
    char p2[512];
    if (props && !json_is_object(props)) {
        sfail(c, ptr, "'properties' must be an object");
        return;
    }
    if (req && !json_is_array(req)) {
        sfail(c, ptr, "'required' must be an array");
        return;
    }
    for (size_t i = 0; req && i < json_array_size(req); i++) {
        const json_t *k = json_array_get(req, i);
        if (!json_is_string(k)) {
            sfail(c, ptr, "'required' must list strings");
            return;
        }
        if (!props || !json_object_get(props, json_string_value(k))) {
            sfail(c, ptr, "required property '%s' is not declared in 'properties'",
                  json_string_value(k));
            return;
        }
    }
    // Additional properties: false, true or a schema; absent: allowed unless strict.
    char extra[32] = "";
    bool allow_extra = addl ? !json_is_false(addl) : !c->strict;
    if (addl && !json_is_boolean(addl) && !json_is_object(addl)) {
        sfail(c, ptr, "'additionalProperties' must be a boolean or a schema");
        return;
    }
    if (allow_extra) {
        if (addl && json_is_object(addl)) {
            ptr_join(p2, sizeof p2, ptr, "additionalProperties");
            gen(c, addl, p2, extra);
        } else {
            strcpy(extra, "json-value");
        }
    }
    if (c->failed) return;
    size_t n = props ? json_object_size(props) : 0;
    if (n == 0 && allow_extra && !strcmp(extra, "json-value")) {
        bput(c, b, "json-object");
        return;
    }
    // Property value rules, in declared order.
    const char **keys = di_calloc(n + 1, sizeof *keys);
    char(*vals)[32] = di_calloc(n + 1, 32);
    bool *required = di_calloc(n + 1, 1);
    if (!keys || !vals || !required) {
        di_free(keys), di_free(vals), di_free(required);
        c->failed = true, c->st = DI_ERR_NOMEM;
        return;
    }
    size_t i = 0;
    const char *key;
    const json_t *val;
    json_object_foreach((json_t *)props, key, val) {
        keys[i] = key;
        char pp[512];
        ptr_join(pp, sizeof pp, ptr, "properties");
        ptr_join(p2, sizeof p2, pp, key);
        gen(c, val, p2, vals[i]);
        for (size_t r = 0; req && r < json_array_size(req); r++)
            if (!strcmp(json_string_value(json_array_get(req, r)), key)) required[i] = true;
        i++;
    }
    // A_j: properties j.. remain, one already written; F_j: none written yet (see the header of
    // docs/structured-output.md: optional properties may be left out, order is declared order).
    int32_t base = c->n_rules;
    c->n_rules += (int32_t)(2 * (n + 1));
    di_buf body;
    for (size_t j = n + 1; j-- > 0 && !c->failed;) {
        for (int f = 0; f < 2; f++) { // f = 0: A_j, f = 1: F_j
            di_buf_init(&body);
            if (j == n) {
                if (allow_extra && f == 0)
                    bputf(c, &body, "(\",\" ws json-string ws \":\" ws %s ws)*", extra);
                else if (allow_extra)
                    bputf(c, &body,
                          "(json-string ws \":\" ws %s ws (\",\" ws json-string ws \":\" ws %s "
                          "ws)*)?",
                          extra, extra);
                else
                    bput(c, &body, "\"\"");
            } else {
                if (f == 0) bput(c, &body, "\",\" ws ");
                blit(c, &body, "\"", 1);
                bput(c, &body, " ");
                json_t *ks = json_string(keys[j]);
                char *kq = ks ? json_dumps(ks, JSON_ENCODE_ANY) : NULL;
                json_decref(ks);
                if (!kq) {
                    c->failed = true, c->st = DI_ERR_NOMEM;
                } else {
                    // kq is "\"key\"" with JSON escapes: match it as written (without quotes,
                    // already emitted around it).
                    blit(c, &body, kq + 1, strlen(kq) - 2);
                    free(kq);
                }
                bput(c, &body, " ");
                blit(c, &body, "\"", 1);
                bputf(c, &body, " ws \":\" ws %s ws a%d", vals[j], (int)(base + 2 * (j + 1)));
                if (!required[j]) bputf(c, &body, " | a%d", (int)(base + 2 * (j + 1) + f));
            }
            bputf(c, c->out, "a%d ::= %s\n", (int)(base + 2 * j + f),
                  body.data ? body.data : "\"\"");
            di_buf_deinit(&body);
        }
    }
    bputf(c, b, "\"{\" ws a%d \"}\"", (int)(base + 1));
    di_free(keys), di_free(vals), di_free(required);
}

// ---- arrays ----

static void gen_array(sc *c, const json_t *s, const char *ptr, di_buf *b) {
    const json_t *items = json_object_get(s, "items"), *prefix = json_object_get(s, "prefixItems");
    int64_t lo = 0, hi = -1;
    get_count(c, s, "minItems", ptr, &lo);
    bool has_hi = get_count(c, s, "maxItems", ptr, &hi);
    if (c->failed) return;
    if (!has_hi) hi = -1;
    if (hi >= 0 && hi < lo) {
        sfail(c, ptr, "maxItems is below minItems");
        return;
    }
    if (prefix && !json_is_array(prefix)) {
        sfail(c, ptr, "'prefixItems' must be an array");
        return;
    }
    if (items && !json_is_object(items) && !json_is_boolean(items)) {
        sfail(c, ptr, "'items' must be a schema (tuple form: use prefixItems)");
        return;
    }
    char p2[512], item[32] = "json-value";
    if (items && json_is_object(items)) {
        ptr_join(p2, sizeof p2, ptr, "items");
        gen(c, items, p2, item);
    }
    const int64_t k = prefix ? (int64_t)json_array_size(prefix) : 0;
    if (items && json_is_false(items)) hi = hi < 0 || hi > k ? k : hi;
    if (lo > k && items && json_is_false(items)) {
        sfail(c, ptr, "minItems exceeds prefixItems");
        return;
    }
    char(*pn)[32] = di_calloc((size_t)k + 1, 32);
    if (!pn) {
        c->failed = true, c->st = DI_ERR_NOMEM;
        return;
    }
    for (int64_t i = 0; i < k && !c->failed; i++) {
        char pp[512], idx[24];
        ptr_join(pp, sizeof pp, ptr, "prefixItems");
        snprintf(idx, sizeof idx, "%lld", (long long)i);
        ptr_join(p2, sizeof p2, pp, idx);
        gen(c, json_array_get(prefix, (size_t)i), p2, pn[i]);
    }
    bput(c, b, "\"[\" ws ");
    // Elements i = 0..: prefix schemas first, then `item`; each after the minimum is optional.
    int64_t n_close = 0;
    for (int64_t i = 0; i < k && (hi < 0 || i < hi) && !c->failed; i++) {
        if (i >= lo) bput(c, b, "("), n_close++;
        if (i > 0) bput(c, b, "\",\" ws ");
        bputf(c, b, "%s ws ", pn[i]);
    }
    if (hi < 0 || hi > k) {
        int64_t rlo = lo > k ? lo - k : 0, rhi = hi < 0 ? -1 : hi - k;
        if (k == 0) {
            // item ws ("," ws item ws){rlo-1, rhi-1}, optional when rlo == 0
            bputf(c, b, "%s%s ws (\",\" ws %s ws)", rlo == 0 ? "(" : "", item, item);
            int64_t a = rlo > 0 ? rlo - 1 : 0;
            if (rhi < 0)
                bputf(c, b, "{%lld,}", (long long)a);
            else
                bputf(c, b, "{%lld,%lld}", (long long)a, (long long)(rhi - 1));
            if (rlo == 0) bput(c, b, ")?");
        } else {
            bputf(c, b, "(\",\" ws %s ws)", item);
            if (rhi < 0)
                bputf(c, b, "{%lld,}", (long long)rlo);
            else
                bputf(c, b, "{%lld,%lld}", (long long)rlo, (long long)rhi);
        }
    }
    for (int64_t i = 0; i < n_close; i++) bput(c, b, ")?");
    bput(c, b, " \"]\"");
    di_free(pn);
}

// ---- dispatch ----

static void gen_type(sc *c, const json_t *s, const char *t, const char *ptr, di_buf *b) {
    if (!strcmp(t, "string"))
        gen_string(c, s, ptr, b);
    else if (!strcmp(t, "integer"))
        gen_integer(c, s, ptr, b);
    else if (!strcmp(t, "number"))
        bput(c, b, "json-number");
    else if (!strcmp(t, "boolean"))
        bput(c, b, "(\"true\" | \"false\")");
    else if (!strcmp(t, "null"))
        bput(c, b, "\"null\"");
    else if (!strcmp(t, "object"))
        gen_object(c, s, ptr, b);
    else if (!strcmp(t, "array"))
        gen_array(c, s, ptr, b);
    else
        sfail(c, ptr, "unknown type '%s'", t);
}

// Resolves a local reference: "#" or a JSON pointer "#/a/b" within the document.
static const json_t *resolve(const sc *c, const char *ref) {
    if (ref[0] != '#') return NULL;
    const json_t *x = c->root;
    const char *p = ref + 1;
    while (*p == '/' && x) {
        p++;
        char key[256];
        size_t n = 0;
        while (*p && *p != '/' && n + 1 < sizeof key) {
            if (p[0] == '~' && p[1] == '0')
                key[n++] = '~', p += 2;
            else if (p[0] == '~' && p[1] == '1')
                key[n++] = '/', p += 2;
            else
                key[n++] = *p++;
        }
        key[n] = 0;
        if (json_is_object(x))
            x = json_object_get(x, key);
        else if (json_is_array(x))
            x = json_array_get(x, (size_t)strtoul(key, NULL, 10));
        else
            x = NULL;
    }
    return *p ? NULL : x;
}

static void gen(sc *c, const json_t *s, const char *ptr, char name[32]) {
    if (c->failed) return;
    if (++c->depth > 64) {
        c->depth--;
        {
            sfail(c, ptr, "schema nested too deeply (64 levels)");
            return;
        }
    }
    di_buf b;
    di_buf_init(&b);
    if (json_is_true(s)) {
        strcpy(name, "json-value");
        goto done;
    }
    if (json_is_false(s)) {
        sfail(c, ptr, "the schema 'false' matches nothing");
        goto done;
    }
    if (!json_is_object(s)) {
        sfail(c, ptr, "a schema must be an object or a boolean");
        goto done;
    }
    const char *key;
    const json_t *val;
    json_object_foreach((json_t *)s, key, val) {
        if (in_list(k_refused, key)) {
            sfail(c, ptr, "keyword '%s' is not supported", key);
            goto done;
        }
        if (json_object_get(s, "$ref") && strcmp(key, "$ref") && !in_list(k_annotations, key)) {
            sfail(c, ptr, "keyword '%s' next to '$ref' is not supported", key);
            goto done;
        }
    }
    const json_t *ref = json_object_get(s, "$ref");
    if (ref) {
        const json_t *t = json_is_string(ref) ? resolve(c, json_string_value(ref)) : NULL;
        if (!t) {
            sfail(c, ptr, "$ref '%s' is not a local reference that resolves ('#', '#/$defs/...')",
                  json_is_string(ref) ? json_string_value(ref) : "?");
            goto done;
        }
        for (int32_t i = 0; i < c->n_refs; i++)
            if (c->refs[i].target == t) {
                snprintf(name, 32, "r%d", (int)c->refs[i].id);
                goto done;
            }
        if (c->n_refs == DI_SCHEMA_MAX_REFS) {
            sfail(c, ptr, "too many distinct $ref targets");
            goto done;
        }
        int32_t id = c->n_refs;
        c->refs[c->n_refs++] = (sref){.target = t, .id = id};
        char inner[32];
        gen(c, t, json_string_value(ref) + 1, inner);
        bputf(c, c->out, "r%d ::= %s\n", (int)id, inner);
        snprintf(name, 32, "r%d", (int)id);
        goto done;
    }
    const json_t *cst = json_object_get(s, "const"), *en = json_object_get(s, "enum");
    const json_t *any = json_object_get(s, "anyOf");
    if (!any) any = json_object_get(s, "oneOf");
    const json_t *all = json_object_get(s, "allOf");
    if (cst) {
        put_json_literal(c, &b, cst);
    } else if (en) {
        if (!json_is_array(en) || json_array_size(en) == 0) {
            sfail(c, ptr, "'enum' must be a non-empty array");
            goto done;
        }
        bput(c, &b, "(");
        for (size_t i = 0; i < json_array_size(en); i++) {
            if (i) bput(c, &b, " | ");
            put_json_literal(c, &b, json_array_get(en, i));
        }
        bput(c, &b, ")");
    } else if (any || all) {
        const json_t *list = any ? any : all;
        if (!json_is_array(list) || json_array_size(list) == 0) {
            sfail(c, ptr, "'%s' must be a non-empty array", any ? "anyOf/oneOf" : "allOf");
            goto done;
        }
        if (!any && json_array_size(list) != 1) {
            sfail(c, ptr, "'allOf' with more than one schema is not supported");
            goto done;
        }
        if (any && all) {
            sfail(c, ptr, "'allOf' next to 'anyOf'/'oneOf' is not supported");
            goto done;
        }
        if (json_object_get(s, "type") || json_object_get(s, "properties")) {
            sfail(c, ptr,
                  "'%s' next to 'type' or 'properties' is not supported (move them into "
                  "each alternative)",
                  any ? (json_object_get(s, "anyOf") ? "anyOf" : "oneOf") : "allOf");
            goto done;
        }
        bput(c, &b, "(");
        for (size_t i = 0; i < json_array_size(list); i++) {
            char pp[512], p2[512], idx[24], sub[32];
            ptr_join(pp, sizeof pp, ptr,
                     any ? (json_object_get(s, "anyOf") ? "anyOf" : "oneOf") : "allOf");
            snprintf(idx, sizeof idx, "%zu", i);
            ptr_join(p2, sizeof p2, pp, idx);
            gen(c, json_array_get(list, i), p2, sub);
            bputf(c, &b, "%s%s", i ? " | " : "", sub);
        }
        bput(c, &b, ")");
    } else {
        const json_t *type = json_object_get(s, "type");
        if (!type) {
            // No type: inferred from the keywords present, else any value.
            if (json_object_get(s, "properties") || json_object_get(s, "required") ||
                json_object_get(s, "additionalProperties"))
                gen_type(c, s, "object", ptr, &b);
            else if (json_object_get(s, "items") || json_object_get(s, "prefixItems") ||
                     json_object_get(s, "minItems") || json_object_get(s, "maxItems"))
                gen_type(c, s, "array", ptr, &b);
            else if (json_object_get(s, "pattern") || json_object_get(s, "format") ||
                     json_object_get(s, "minLength") || json_object_get(s, "maxLength"))
                gen_type(c, s, "string", ptr, &b);
            else if (json_object_get(s, "minimum") || json_object_get(s, "maximum"))
                bput(c, &b, "json-number");
            else
                bput(c, &b, "json-value");
        } else if (json_is_string(type)) {
            gen_type(c, s, json_string_value(type), ptr, &b);
        } else if (json_is_array(type) && json_array_size(type) > 0) {
            bput(c, &b, "(");
            for (size_t i = 0; i < json_array_size(type); i++) {
                const json_t *t = json_array_get(type, i);
                if (!json_is_string(t)) {
                    sfail(c, ptr, "'type' must be a string or an array of strings");
                    goto done;
                }
                if (i) bput(c, &b, " | ");
                gen_type(c, s, json_string_value(t), ptr, &b);
            }
            bput(c, &b, ")");
        } else {
            sfail(c, ptr, "'type' must be a string or an array of strings");
        }
    }
    if (!c->failed) new_rule(c, &b, name);
done:
    di_buf_deinit(&b);
    c->depth--;
}

// ---- shared rules ----

#define JSON_COMMON                                                                                \
    "ws ::= | \" \" | \"\\n\" [ \\t]{0,40}\n"                                                      \
    "json-char ::= [^\"\\\\\\x00-\\x1F] | \"\\\\\" ([\"\\\\/bfnrt] | \"u\" [0-9a-fA-F]{4})\n"      \
    "json-string ::= \"\\\"\" json-char* \"\\\"\"\n"                                               \
    "json-int ::= \"-\"? (\"0\" | [1-9] [0-9]{0,15})\n"                                            \
    "json-number ::= json-int (\".\" [0-9]{1,16})? ([eE] [-+]? [0-9]{1,3})?\n"                     \
    "json-value ::= json-object | json-array | json-string | json-number | \"true\" | \"false\" "  \
    "| \"null\"\n"                                                                                 \
    "json-object ::= \"{\" ws (json-string ws \":\" ws json-value ws (\",\" ws json-string ws "    \
    "\":\" ws json-value ws)*)? \"}\"\n"                                                           \
    "json-array ::= \"[\" ws (json-value ws (\",\" ws json-value ws)*)? \"]\"\n"

const char *di_grammar_json_object_ebnf(void) {
    return "root ::= json-object\n" JSON_COMMON;
}

di_status di_grammar_schema_to_ebnf(const char *schema, size_t n, bool strict, di_buf *out,
                                    char *err, size_t err_size) {
    json_error_t je;
    json_t *root = json_loadb(schema, n, JSON_DECODE_ANY, &je);
    if (!root) {
        if (err && err_size)
            snprintf(err, err_size, "the schema is not JSON: %s (line %d, column %d)", je.text,
                     je.line, je.column);
        return DI_ERR_INVALID;
    }
    sc *c = di_calloc(1, sizeof *c);
    if (!c) {
        json_decref(root);
        return DI_ERR_NOMEM;
    }
    c->root = root;
    c->strict = strict;
    c->out = out;
    c->err = err;
    c->err_size = err_size;
    bput(c, out, JSON_COMMON);
    char name[32];
    gen(c, root, "", name);
    if (!c->failed) bputf(c, out, "root ::= %s\n", name);
    di_status st = c->failed ? c->st : DI_OK;
    if (st == DI_ERR_NOMEM && err && err_size) snprintf(err, err_size, "out of memory");
    di_free(c);
    json_decref(root);
    return st;
}

di_status di_grammar_schemas_to_ebnf(di_grammar_schema_item *items, size_t n, di_buf *out,
                                     char *err, size_t err_size) {
    sc *c = di_calloc(1, sizeof *c);
    if (!c) return DI_ERR_NOMEM;
    c->out = out;
    c->err = err;
    c->err_size = err_size;
    bput(c, out, JSON_COMMON);
    // One context for all items: rule numbers and $ref ids (keyed by the target's address, so
    // distinct documents never share one) are unique across them.
    for (size_t i = 0; i < n && !c->failed; i++) {
        c->root = items[i].root;
        c->strict = items[i].strict;
        gen(c, items[i].schema, items[i].ptr ? items[i].ptr : "", items[i].name);
    }
    di_status st = c->failed ? c->st : DI_OK;
    if (st == DI_ERR_NOMEM && err && err_size) snprintf(err, err_size, "out of memory");
    di_free(c);
    return st;
}
