// tools — grammars over DSML tool-call blocks (di_grammar_compile_tools; include/deepinfer.h,
// docs/structured-output.md "Tool calls", serving.md §1.6).
//
// The grammar covers, by o->start, the text after the prefilled header "<｜DSML｜tool_calls>\n"
// (V4.1 "<｜DSML｜ calls>\n"), the text after the first ｜DSML｜ token ("tool_calls>\n" first),
// or the whole block ("\n"{0,2} "<" D "tool_calls>\n" first):
//
//   body   ::= invoke ("\n" invoke)* "\n</" D "tool_calls>"       (parallel: one or more invokes)
//   invoke ::= t0 | t1 | ...                                        (or the one named tool)
//   t0     ::= "<" D "invoke name=\"" NAME "\">\n" F_0 "\n</" D "invoke>"
//   F_j / A_j: the parameters j.. in declared order, joined by "\n" (A_j: one was written before),
//              optional ones may be left out, required ones may not (as json_schema.c's objects)
//   p_j    ::= "<" D "parameter name=\"" KEY "\" string=\"true\">" RAW "</" D "parameter>"
//            | ... string=\"false\">" JSON "</" D "parameter>"
//
// D is the ｜DSML｜ special token as a token terminal <[id]>: text never spells a tag. A raw value
// (string="true", string-typed parameters) is any text without U+FF5C '｜' (the output parser ends
// a value at the text "</｜DSML｜", so a value must not be able to spell it in bytes); a string
// schema with pattern, format or a length bound is written as string="false" JSON instead (the
// converter enforces those on JSON strings); enum / const strings are their raw literals. Every
// other parameter is string="false" with a JSON value of its schema (json_schema.c, whose $refs
// resolve in the tool's parameters document). Parameters are the declared "properties" only: a
// parameters document with a top-level $ref, anyOf/oneOf/allOf, patternProperties or a schema for
// additionalProperties is refused rather than narrowed to no parameters.
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#include "base/mem.h"
#include "grammar/grammar.h"

typedef struct tparam {
    const char *key;
    const json_t *schema;
    bool required, raw;
    int32_t item; // schema item (raw == false), -1 for raw ones
} tparam;

typedef struct ttool {
    const char *name;
    const json_t *params; // the parameters document (may be NULL: no parameters)
    bool strict;
    size_t first, n; // its parameters in the flat array
} ttool;

static const json_t *tool_fn(const json_t *t) {
    const json_t *f = json_object_get(t, "function");
    return json_is_object(f) ? f : t;
}

// A string-typed schema written as raw text (string="true"): "type": "string" without the string
// keywords that only a JSON string can carry in this grammar.
static bool is_raw_string(const json_t *s) {
    const char *t = json_string_value(json_object_get(s, "type"));
    if (!t || strcmp(t, "string")) return false;
    return !json_object_get(s, "pattern") && !json_object_get(s, "format") &&
           !json_object_get(s, "minLength") && !json_object_get(s, "maxLength") &&
           !json_object_get(s, "$ref") && !json_object_get(s, "anyOf") &&
           !json_object_get(s, "oneOf") && !json_object_get(s, "allOf");
}

static bool valid_dsml_text(const char *s) { // a name DSML can carry: no '"', no '｜', not empty
    return s && *s && !strchr(s, '"') && !strstr(s, "｜");
}

static di_status put(di_buf *b, const char *s) {
    return di_buf_append_str(b, s);
}

static di_status putf(di_buf *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static di_status putf(di_buf *b, const char *fmt, ...) {
    char tmp[512];
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(tmp, sizeof tmp, fmt, ap);
    va_end(ap);
    if (n < 0 || (size_t)n >= sizeof tmp) return DI_ERR_INVALID;
    return di_buf_append(b, tmp, (size_t)n);
}

// The raw value of parameter p: enum / const string literals, or any text without '｜'.
static di_status put_raw(di_buf *b, const tparam *p, char *err, size_t err_size) {
    const json_t *cst = json_object_get(p->schema, "const"),
                 *en = json_object_get(p->schema, "enum");
    if (!cst && !en) return put(b, "tc-raw");
    di_status st = put(b, "(");
    size_t n = cst ? 1 : json_array_size(en);
    if (!cst && (!json_is_array(en) || n == 0)) {
        snprintf(err, err_size, "parameter '%s': 'enum' must be a non-empty array", p->key);
        return DI_ERR_INVALID;
    }
    for (size_t i = 0; i < n && st == DI_OK; i++) {
        const json_t *v = cst ? cst : json_array_get(en, i);
        if (!json_is_string(v)) {
            snprintf(err, err_size, "parameter '%s': a string's enum/const holds a non-string",
                     p->key);
            return DI_ERR_INVALID;
        }
        if (i) st = put(b, " | ");
        if (st == DI_OK)
            st = di_grammar_put_literal(b, json_string_value(v), json_string_length(v));
    }
    return st == DI_OK ? put(b, ")") : st;
}

static di_status tools_ebnf(const json_t *tools, const di_grammar_tools_options *o, int32_t dsml,
                            di_buf *out, char *err, size_t err_size) {
    const size_t nt = json_array_size(tools);
    if (!json_is_array(tools) || nt == 0) {
        snprintf(err, err_size, "tools must be a non-empty array");
        return DI_ERR_INVALID;
    }
    ttool *tt = di_calloc(nt, sizeof *tt);
    size_t np = 0;
    for (size_t i = 0; i < nt; i++) {
        const json_t *pr = json_object_get(tool_fn(json_array_get(tools, i)), "parameters");
        if (!pr) pr = json_object_get(json_array_get(tools, i), "input_schema");
        np += json_object_size(json_object_get(pr, "properties"));
    }
    tparam *pp = di_calloc(np + 1, sizeof *pp);
    di_grammar_schema_item *items = di_calloc(np + 1, sizeof *items);
    char(*ptrs)[300] = di_calloc(np + 1, sizeof *ptrs);
    di_status st = tt && pp && items && ptrs ? DI_OK : DI_ERR_NOMEM;
    size_t n_items = 0, k = 0;
    bool found = !o->name;
    for (size_t i = 0; i < nt && st == DI_OK; i++) {
        const json_t *t = json_array_get(tools, i), *f = tool_fn(t);
        ttool *x = &tt[i];
        x->name = json_string_value(json_object_get(f, "name"));
        x->params = json_object_get(f, "parameters");
        if (!x->params) x->params = json_object_get(t, "input_schema");
        x->strict = json_is_true(json_object_get(f, "strict"));
        x->first = k;
        if (!valid_dsml_text(x->name)) {
            snprintf(err, err_size, "tools[%zu]: a name DSML can carry is required (no '\"')", i);
            st = DI_ERR_INVALID;
            break;
        }
        if (o->name && strcmp(o->name, x->name)) continue;
        found = true;
        const json_t *props = json_object_get(x->params, "properties");
        const json_t *req = json_object_get(x->params, "required");
        if (x->params && !json_is_object(x->params)) {
            snprintf(err, err_size, "tools[%zu] '%s': parameters must be a JSON Schema object", i,
                     x->name);
            st = DI_ERR_INVALID;
            break;
        }
        // Parameters come from "properties" only: a document that defines them otherwise would
        // be silently narrowed to no parameters, so it is refused.
        static const char *const k_other[] = {
            "$ref", "anyOf", "oneOf", "allOf", "patternProperties", "additionalProperties"};
        for (size_t q = 0; q < sizeof k_other / sizeof k_other[0] && st == DI_OK; q++) {
            const json_t *v = json_object_get(x->params, k_other[q]);
            if (!v ||
                (q == 5 && (json_is_boolean(v) || (json_is_object(v) && json_object_size(v) == 0))))
                continue; // additionalProperties true/false/{}: only declared ones are written
            snprintf(err, err_size,
                     "tools[%zu] '%s' parameters: '%s' at the top level is not supported in a "
                     "tool-call grammar (parameters are the declared 'properties')",
                     i, x->name, k_other[q]);
            st = DI_ERR_INVALID;
        }
        if (st != DI_OK) break;
        const char *key;
        const json_t *val;
        json_object_foreach((json_t *)props, key, val) {
            tparam *p = &pp[k++];
            p->key = key;
            p->schema = val;
            p->item = -1;
            if (!valid_dsml_text(key)) {
                snprintf(err, err_size,
                         "tools[%zu] '%s': parameter name '%s' cannot be written "
                         "in DSML",
                         i, x->name, key);
                st = DI_ERR_INVALID;
                break;
            }
            for (size_t r = 0; r < json_array_size(req); r++) {
                const char *rk = json_string_value(json_array_get(req, r));
                if (rk && !strcmp(rk, key)) p->required = true;
            }
            p->raw = json_is_object(val) && is_raw_string(val);
            if (!p->raw) {
                snprintf(ptrs[n_items], sizeof ptrs[n_items], "/properties/%s", key);
                items[n_items] = (di_grammar_schema_item){
                    .root = x->params, .schema = val, .ptr = ptrs[n_items], .strict = x->strict};
                p->item = (int32_t)n_items++;
            }
        }
        x->n = k - x->first;
    }
    if (st == DI_OK && !found) {
        snprintf(err, err_size, "no tool named '%s'", o->name);
        st = DI_ERR_INVALID;
    }
    char e2[400] = "";
    if (st == DI_OK) st = di_grammar_schemas_to_ebnf(items, n_items, out, e2, sizeof e2);
    if (st == DI_ERR_INVALID && e2[0]) {
        // name the tool of the failing schema: convert each tool's items alone until one fails
        snprintf(err, err_size, "%s", e2);
        for (size_t i = 0; i < nt; i++) {
            size_t lo = n_items, hi = 0;
            for (size_t j = tt[i].first; j < tt[i].first + tt[i].n; j++)
                if (pp[j].item >= 0) {
                    if ((size_t)pp[j].item < lo) lo = (size_t)pp[j].item;
                    hi = (size_t)pp[j].item + 1;
                }
            if (lo >= hi) continue;
            di_buf scratch;
            di_buf_init(&scratch);
            di_status s2 = di_grammar_schemas_to_ebnf(items + lo, hi - lo, &scratch, e2, sizeof e2);
            di_buf_deinit(&scratch);
            if (s2 == DI_ERR_INVALID) {
                snprintf(err, err_size, "tools[%zu] '%s' parameters: %s", i, tt[i].name, e2);
                break;
            }
        }
    }
    const char *calls = o->encoding ? " calls" : "tool_calls";
    const char *inv = o->encoding ? " invoke" : "invoke";
    const char *par = o->encoding ? " parameter" : "parameter";
    if (st == DI_OK)
        st = putf(out,
                  "tc-raw ::= [^\\uFF5C]*\n"
                  "tc-body ::= tc-invoke %s\"\\n</\" <[%d]> \"%s>\"\n",
                  o->parallel ? "(\"\\n\" tc-invoke)* " : "", (int)dsml, calls);
    if (st == DI_OK) {
        if (o->start == DI_GRAMMAR_TOOLS_AFTER_HEADER)
            st = put(out, "root ::= tc-body\n");
        else if (o->start == DI_GRAMMAR_TOOLS_AFTER_DSML)
            st = putf(out, "root ::= \"%s>\\n\" tc-body\n", calls);
        else
            st = putf(out, "root ::= \"\\n\"{0,2} \"<\" <[%d]> \"%s>\\n\" tc-body\n", (int)dsml,
                      calls);
    }
    if (st == DI_OK) st = put(out, "tc-invoke ::= ");
    bool first_alt = true;
    for (size_t i = 0; i < nt && st == DI_OK; i++) {
        if (o->name && strcmp(o->name, tt[i].name)) continue;
        st = putf(out, "%stc-t%zu", first_alt ? "" : " | ", i);
        first_alt = false;
    }
    if (st == DI_OK) st = put(out, "\n");
    for (size_t i = 0; i < nt && st == DI_OK; i++) {
        const ttool *x = &tt[i];
        if (o->name && strcmp(o->name, x->name)) continue;
        st = putf(out, "tc-t%zu ::= \"<\" <[%d]> \"%s name=\\\"\" ", i, (int)dsml, inv);
        if (st == DI_OK) st = di_grammar_put_literal(out, x->name, strlen(x->name));
        if (st == DI_OK)
            st =
                putf(out, " \"\\\">\\n\" tc-t%zu-f0 \"\\n</\" <[%d]> \"%s>\"\n", i, (int)dsml, inv);
        // F_j (f = 1: nothing written yet) and A_j (f = 0: "\n" before each), j = 0..n
        for (size_t j = 0; j <= x->n && st == DI_OK; j++) {
            for (int f = 0; f < 2 && st == DI_OK; f++) {
                st = putf(out, "tc-t%zu-%c%zu ::= ", i, f ? 'f' : 'a', j);
                if (st != DI_OK) break;
                if (j == x->n) {
                    st = put(out, "\"\"\n");
                    continue;
                }
                const tparam *p = &pp[x->first + j];
                di_buf pb;
                di_buf_init(&pb);
                st = putf(&pb, "%s\"<\" <[%d]> \"%s name=\\\"\" ", f ? "" : "\"\\n\" ", (int)dsml,
                          par);
                if (st == DI_OK) st = di_grammar_put_literal(&pb, p->key, strlen(p->key));
                if (st == DI_OK)
                    st = putf(&pb, " \"\\\" string=\\\"%s\\\">\" ", p->raw ? "true" : "false");
                if (st == DI_OK)
                    st = p->raw ? put_raw(&pb, p, err, err_size) : put(&pb, items[p->item].name);
                if (st == DI_OK) st = putf(&pb, " \"</\" <[%d]> \"%s>\"", (int)dsml, par);
                if (st == DI_OK) st = di_buf_append(&pb, "", 1);
                // present: p then A_{j+1}; absent (optional only): F/A_{j+1}
                if (st == DI_OK) st = put(out, (const char *)pb.data);
                if (st == DI_OK) st = putf(out, " tc-t%zu-a%zu", i, j + 1);
                di_buf_deinit(&pb);
                if (st == DI_OK && !p->required)
                    st = putf(out, " | tc-t%zu-%c%zu", i, f ? 'f' : 'a', j + 1);
                if (st == DI_OK) st = put(out, "\n");
            }
        }
    }
    di_free(tt);
    di_free(pp);
    di_free(items);
    di_free(ptrs);
    return st;
}

di_status di_grammar_compile_tools(const di_tokenizer *tok, const char *tools_json, size_t n,
                                   const di_grammar_tools_options *o, di_grammar **out, char *err,
                                   size_t err_size) {
    return di_grammar_cache_compile_tools(NULL, tok, tools_json, n, o, out, err, err_size);
}

di_status di_grammar_cache_compile_tools(di_grammar_cache *c, const di_tokenizer *tok,
                                         const char *tools_json, size_t n,
                                         const di_grammar_tools_options *o, di_grammar **out,
                                         char *err, size_t err_size) {
    char ebuf[512];
    if (!err || !err_size) err = ebuf, err_size = sizeof ebuf;
    err[0] = 0;
    const int32_t dsml = tok ? di_tokenizer_token_id(tok, "｜DSML｜") : -1;
    if (dsml < 0) {
        snprintf(err, err_size, "the tokenizer has no ｜DSML｜ token");
        return DI_ERR_UNSUPPORTED;
    }
    json_error_t je;
    json_t *tools = json_loadb(tools_json ? tools_json : "", n, 0, &je);
    if (!tools) {
        snprintf(err, err_size, "the tools are not JSON: %s", je.text);
        return DI_ERR_INVALID;
    }
    di_grammar_tools_options def = {.parallel = true};
    di_buf text;
    di_buf_init(&text);
    di_status st = tools_ebnf(tools, o ? o : &def, dsml, &text, err, err_size);
    if (st == DI_OK)
        st = di_grammar_cache_ebnf(c, text.data ? text.data : "", text.len, out, err, err_size);
    if (st == DI_ERR_NOMEM) snprintf(err, err_size, "out of memory");
    di_buf_deinit(&text);
    json_decref(tools);
    return st;
}
