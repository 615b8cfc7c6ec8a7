// request — public prompt rendering of API requests (di_render_request in include/deepinfer.h):
// maps an OpenAI Chat Completions, OpenAI Responses or Anthropic Messages request (spec
// serving.md §2) onto the renderer's conversation JSON, renders it and tokenizes it.
// Only the fields that change the prompt are read; sampling fields are ignored here.
// Thread-safety: any thread.
#include <jansson.h>
#include <stdlib.h>
#include <string.h>

#include "base/log.h"
#include "base/mem.h"
#include "tok/render.h"
#include "tok/tokenizer.h"

// ---- shared helpers ----

static json_t *msg(const char *role) {
    return json_pack("{s:s}", "role", role);
}

static const char *effort_from_thinking(const json_t *req, bool *thinking) {
    // Chat: {"thinking": {"type": "enabled"|"disabled"}}, "reasoning_effort"; default on
    const json_t *th = json_object_get(req, "thinking");
    const char *type = json_string_value(json_object_get(th, "type"));
    if (type) *thinking = strcmp(type, "disabled") != 0;
    return NULL;
}

// Whether an Anthropic block carries a cache_control breakpoint (validated by the server).
static bool cached(const json_t *b) {
    const json_t *cc = json_object_get(b, "cache_control");
    return cc && !json_is_null(cc);
}

// Text of an Anthropic / Responses content array (text parts joined with "\n\n") or a string.
// marks: blocks with cache_control become snapshot points (Messages).
static json_t *content_to_official_m(const json_t *c, bool marks) {
    if (!c || json_is_string(c) || json_is_null(c)) return json_incref((json_t *)c);
    if (!json_is_array(c)) return NULL;
    json_t *blocks = json_array();
    size_t i;
    json_t *b;
    json_array_foreach(c, i, b) {
        const char *t = json_string_value(json_object_get(b, "type"));
        if (json_is_string(b)) {
            json_array_append_new(blocks, json_pack("{s:s,s:O}", "type", "text", "text", b));
        } else if (t &&
                   (!strcmp(t, "text") || !strcmp(t, "input_text") || !strcmp(t, "output_text"))) {
            json_array_append_new(
                blocks, json_pack("{s:s,s:O}", "type", "text", "text", json_object_get(b, "text")));
        } else if (t &&
                   (!strcmp(t, "image") || !strcmp(t, "image_url") || !strcmp(t, "input_image"))) {
            json_array_append_new(blocks, json_pack("{s:s}", "type", "image"));
        } else {
            continue;
        }
        if (marks && cached(b))
            json_object_set_new(json_array_get(blocks, json_array_size(blocks) - 1), "snapshot",
                                json_true());
    }
    return blocks;
}

static json_t *content_to_official(const json_t *c) {
    return content_to_official_m(c, false);
}

// ---- OpenAI Chat Completions ----

// The response-format section of the system message (spec serving.md §1.8): json_object renders
// the response_format object itself (the recipe's text), json_schema the schema object (the
// design's `{schema}`; the whole format when it has none). regex and grammar (deepinfer
// extensions) are enforced only, never rendered.
static void set_response_format(json_t *out, const char *type, const json_t *rf,
                                const json_t *schema) {
    if (!type) return;
    if (!strcmp(type, "json_object"))
        json_object_set(out, "response_format", (json_t *)rf);
    else if (!strcmp(type, "json_schema"))
        json_object_set(out, "response_format", (json_t *)(schema ? schema : rf));
}

static json_t *from_chat(const json_t *req) {
    if (!json_is_array(json_object_get(req, "messages"))) {
        DI_LOG_ERROR("render: a chat request needs a \"messages\" array");
        return NULL;
    }
    json_t *out = json_object();
    json_t *msgs = json_array();
    const json_t *in = json_object_get(req, "messages");
    size_t i;
    json_t *m;
    json_array_foreach(in, i, m) {
        json_t *c = json_deep_copy(m);
        const char *role = json_string_value(json_object_get(c, "role"));
        if (role && !strcmp(role, "developer"))
            json_object_set_new(c, "role", json_string("system"));
        json_t *content = content_to_official(json_object_get(m, "content"));
        if (content)
            json_object_set_new(c, "content", content);
        else
            json_object_del(c, "content");
        json_array_append_new(msgs, c);
    }
    json_object_set_new(out, "messages", msgs);
    bool thinking = true;
    effort_from_thinking(req, &thinking);
    json_object_set_new(out, "thinking_mode", json_string(thinking ? "thinking" : "chat"));
    const json_t *eff = json_object_get(req, "reasoning_effort");
    if (eff) json_object_set(out, "reasoning_effort", (json_t *)eff);
    const json_t *tools = json_object_get(req, "tools");
    if (tools) json_object_set(out, "tools", (json_t *)tools);
    const json_t *tc = json_object_get(req, "tool_choice");
    if (json_is_string(tc))
        json_object_set(out, "tool_choice", (json_t *)tc);
    else if (json_is_object(tc))
        json_object_set_new(out, "tool_choice", json_string("required"));
    const json_t *rf = json_object_get(req, "response_format");
    const json_t *rs = json_object_get(json_object_get(rf, "json_schema"), "schema");
    set_response_format(out, json_string_value(json_object_get(rf, "type")), rf, rs);
    return out;
}

// ---- OpenAI Responses ----

static json_t *from_responses(const json_t *req) {
    json_t *out = json_object();
    json_t *msgs = json_array();
    const json_t *instr = json_object_get(req, "instructions");
    if (json_is_string(instr)) {
        json_t *s = msg("system");
        json_object_set(s, "content", (json_t *)instr);
        json_array_append_new(msgs, s);
    }
    const json_t *input = json_object_get(req, "input");
    if (json_is_string(input)) {
        json_t *u = msg("user");
        json_object_set(u, "content", (json_t *)input);
        json_array_append_new(msgs, u);
    }
    json_t *last_asst = NULL; // assistant message collecting reasoning / function calls
    size_t i;
    json_t *it;
    json_array_foreach(json_is_array(input) ? input : NULL, i, it) {
        const char *type = json_string_value(json_object_get(it, "type"));
        const char *role = json_string_value(json_object_get(it, "role"));
        if ((!type || !strcmp(type, "message")) && role) {
            bool asst = !strcmp(role, "assistant");
            json_t *mm = msg(!strcmp(role, "developer") ? "system" : role);
            json_t *content = content_to_official(json_object_get(it, "content"));
            if (content) json_object_set_new(mm, "content", content);
            if (asst && last_asst && !json_object_get(last_asst, "content")) {
                json_object_set_new(last_asst, "content",
                                    content ? json_incref(content) : json_string(""));
                json_decref(mm);
                continue;
            }
            json_array_append_new(msgs, mm);
            last_asst = asst ? mm : NULL;
        } else if (type && !strcmp(type, "reasoning")) {
            if (!last_asst) {
                last_asst = msg("assistant");
                json_array_append_new(msgs, last_asst);
            }
            const json_t *c = json_object_get(it, "content");
            const json_t *t0 = json_object_get(json_array_get(c, 0), "text");
            if (!t0)
                t0 = json_object_get(json_array_get(json_object_get(it, "summary"), 0), "text");
            if (json_is_string(t0)) json_object_set(last_asst, "reasoning_content", (json_t *)t0);
        } else if (type && !strcmp(type, "function_call")) {
            if (!last_asst) {
                last_asst = msg("assistant");
                json_array_append_new(msgs, last_asst);
            }
            json_t *calls = json_object_get(last_asst, "tool_calls");
            if (!calls) json_object_set_new(last_asst, "tool_calls", calls = json_array());
            json_array_append_new(calls,
                                  json_pack("{s:O?,s:s,s:{s:O?,s:O?}}", "id",
                                            json_object_get(it, "call_id"), "type", "function",
                                            "function", "name", json_object_get(it, "name"),
                                            "arguments", json_object_get(it, "arguments")));
        } else if (type && !strcmp(type, "function_call_output")) {
            json_t *t = msg("tool");
            json_object_set(t, "tool_call_id", json_object_get(it, "call_id"));
            json_t *content = content_to_official(json_object_get(it, "output"));
            if (content) json_object_set_new(t, "content", content);
            json_array_append_new(msgs, t);
            last_asst = NULL;
        }
    }
    json_object_set_new(out, "messages", msgs);
    const json_t *reasoning = json_object_get(req, "reasoning");
    const json_t *eff = json_object_get(reasoning, "effort");
    if (eff && !json_is_null(eff)) json_object_set(out, "reasoning_effort", (json_t *)eff);
    bool thinking = true;
    effort_from_thinking(req, &thinking);
    json_object_set_new(out, "thinking_mode", json_string(thinking ? "thinking" : "chat"));
    const json_t *tools = json_object_get(req, "tools");
    if (json_is_array(tools)) {
        json_t *ot = json_array();
        json_array_foreach(tools, i, it) {
            const char *type = json_string_value(json_object_get(it, "type"));
            if (type && strcmp(type, "function") != 0) continue; // server tools dropped (§2.3)
            json_array_append_new(ot, json_pack("{s:s,s:{s:O?,s:O?,s:O?}}", "type", "function",
                                                "function", "name", json_object_get(it, "name"),
                                                "description", json_object_get(it, "description"),
                                                "parameters", json_object_get(it, "parameters")));
        }
        json_object_set_new(out, "tools", ot);
    }
    const json_t *tc = json_object_get(req, "tool_choice");
    if (json_is_string(tc))
        json_object_set(out, "tool_choice", (json_t *)tc);
    else if (json_is_object(tc)) // a named function: forced like required (header prefill)
        json_object_set_new(out, "tool_choice", json_string("required"));
    const json_t *fmt = json_object_get(json_object_get(req, "text"), "format");
    const char *ft = json_string_value(json_object_get(fmt, "type"));
    if (ft && !strcmp(ft, "json_object")) {
        json_t *jo = json_pack("{s:s}", "type", "json_object");
        set_response_format(out, ft, jo, NULL);
        json_decref(jo);
    } else {
        set_response_format(out, ft, fmt, json_object_get(fmt, "schema"));
    }
    return out;
}

// ---- Anthropic Messages ----

static json_t *from_messages(const json_t *req) {
    if (!json_is_array(json_object_get(req, "messages"))) {
        DI_LOG_ERROR("render: a Messages request needs a \"messages\" array");
        return NULL;
    }
    json_t *out = json_object();
    json_t *msgs = json_array();
    const json_t *sys = json_object_get(req, "system");
    if (sys && !json_is_null(sys)) {
        json_t *s = msg("system");
        if (json_is_array(sys)) { // text blocks joined with "\n\n" (render.c system_text)
            json_t *b = content_to_official_m(sys, true);
            json_object_set_new(s, "content", b);
        } else {
            json_object_set(s, "content", (json_t *)sys);
        }
        json_array_append_new(msgs, s);
    }
    size_t i, k;
    json_t *m, *b;
    json_array_foreach(json_object_get(req, "messages"), i, m) {
        const char *role = json_string_value(json_object_get(m, "role"));
        const json_t *content = json_object_get(m, "content");
        if (!role) continue;
        if (json_is_string(content)) {
            json_t *mm = msg(role);
            json_object_set(mm, "content", (json_t *)content);
            json_array_append_new(msgs, mm);
            continue;
        }
        json_t *cur = NULL, *texts = NULL, *calls = NULL;
        json_array_foreach(content, k, b) {
            const char *t = json_string_value(json_object_get(b, "type"));
            if (!t) continue;
            if (!strcmp(t, "tool_result")) {
                json_t *tm = msg("tool");
                json_object_set(tm, "tool_call_id", json_object_get(b, "tool_use_id"));
                json_t *c = content_to_official(json_object_get(b, "content"));
                // marked, or one of its blocks is: the point after the result
                bool mark = cached(b);
                size_t j;
                json_t *x;
                json_array_foreach(json_object_get(b, "content"), j, x) mark |= cached(x);
                if (mark) json_object_set_new(tm, "snapshot", json_true());
                if (json_is_true(json_object_get(b, "is_error")) && json_is_string(c)) {
                    json_t *e = json_sprintf("Error: %s", json_string_value(c)); // §2.4 [design]
                    json_decref(c);
                    c = e;
                }
                if (c) json_object_set_new(tm, "content", c);
                json_array_append_new(msgs, tm);
                cur = NULL;
                texts = NULL;
                continue;
            }
            if (!cur) {
                cur = msg(role);
                texts = json_array();
                json_object_set_new(cur, "content", texts);
                json_array_append_new(msgs, cur);
                calls = NULL;
            }
            if (!strcmp(t, "text") || !strcmp(t, "image")) {
                json_t *tb = !strcmp(t, "text") ? json_pack("{s:s,s:O?}", "type", "text", "text",
                                                            json_object_get(b, "text"))
                                                : json_pack("{s:s}", "type", "image");
                // an assistant's text blocks are joined into one string below: its point is
                // then after the whole turn
                if (cached(b) && !strcmp(role, "assistant"))
                    json_object_set_new(cur, "snapshot", json_true());
                else if (cached(b))
                    json_object_set_new(tb, "snapshot", json_true());
                json_array_append_new(texts, tb);
                continue;
            }
            if (cached(b)) json_object_set_new(cur, "snapshot", json_true());
            if (!strcmp(t, "thinking")) {
                json_object_set(cur, "reasoning_content", json_object_get(b, "thinking"));
            } else if (!strcmp(t, "tool_use")) {
                if (!calls) json_object_set_new(cur, "tool_calls", calls = json_array());
                // "O" takes a new reference, so a fresh {} for a missing "input" is released
                // here; passing json_object() straight to "O" leaked it (fuzzer, leak-d7913e7d).
                json_t *args = json_object_get(b, "input");
                json_t *empty = args ? NULL : json_object();
                json_array_append_new(
                    calls, json_pack("{s:O?,s:s,s:{s:O?,s:O}}", "id", json_object_get(b, "id"),
                                     "type", "function", "function", "name",
                                     json_object_get(b, "name"), "arguments", args ? args : empty));
                json_decref(empty);
            }
        }
    }
    // assistant content given as blocks: join text blocks into a string
    json_array_foreach(msgs, i, m) {
        const json_t *c = json_object_get(m, "content");
        if (!json_is_array(c) || strcmp(json_string_value(json_object_get(m, "role")), "assistant"))
            continue;
        json_t *s = json_string("");
        json_array_foreach(c, k, b) {
            const char *t = json_string_value(json_object_get(b, "text"));
            if (!t) continue;
            json_t *n = json_sprintf("%s%s%s", json_string_value(s),
                                     json_string_length(s) ? "\n\n" : "", t);
            json_decref(s);
            s = n;
        }
        json_object_set_new(m, "content", s);
    }
    json_object_set_new(out, "messages", msgs);
    bool thinking = true;
    effort_from_thinking(req, &thinking);
    json_object_set_new(out, "thinking_mode", json_string(thinking ? "thinking" : "chat"));
    const json_t *eff = json_object_get(json_object_get(req, "output_config"), "effort");
    if (eff) json_object_set(out, "reasoning_effort", (json_t *)eff);
    const json_t *tools = json_object_get(req, "tools");
    if (json_is_array(tools)) {
        json_t *ot = json_array();
        json_array_foreach(tools, i, b) {
            // the tool definitions end the system prefix: a marked one marks that end
            if (cached(b)) json_object_set_new(out, "snapshot_system", json_true());
            if (json_object_get(b, "type") && !json_object_get(b, "input_schema")) continue;
            json_array_append_new(ot, json_pack("{s:s,s:{s:O?,s:O?,s:O?}}", "type", "function",
                                                "function", "name", json_object_get(b, "name"),
                                                "description", json_object_get(b, "description"),
                                                "parameters", json_object_get(b, "input_schema")));
        }
        json_object_set_new(out, "tools", ot);
    }
    const char *tct =
        json_string_value(json_object_get(json_object_get(req, "tool_choice"), "type"));
    if (tct)
        json_object_set_new(out, "tool_choice",
                            json_string(!strcmp(tct, "none")   ? "none"
                                        : !strcmp(tct, "auto") ? "auto"
                                                               : "required"));
    return out;
}

// ---- public entry ----

di_render_options di_render_options_default(void) {
    return (di_render_options){.encoding = 0, .effort_table_0731 = false, .official = false};
}

static int cmp_i32(const void *a, const void *b) {
    const int32_t x = *(const int32_t *)a, y = *(const int32_t *)b;
    return (x > y) - (x < y);
}

// The snapshot points of a rendered prompt (di_render_points in deepinfer.h).
static di_status points_of(const di_tokenizer *tok, const di_render_out *out, const int32_t *ids,
                           size_t n_ids, di_render_points *p) {
    memset(p, 0, sizeof *p);
    int32_t m[DI_RENDER_MAX_MARKS];
    size_t n = 0;
    for (size_t i = 0; i < out->n_marks; i++) {
        const int32_t t = di_render_token_offset(tok, ids, n_ids, out->marks[i]);
        if (t < 0) return DI_ERR_INVALID;
        if (t > 0) m[n++] = t;
    }
    p->n_marked = (int32_t)out->n_marks;
    qsort(m, n, sizeof *m, cmp_i32);
    for (size_t i = 0; i < n && p->n < DI_MAX_SNAP_AT; i++)
        if (p->n == 0 || p->at[p->n - 1] != m[i]) p->at[p->n++] = m[i];
    if (out->system_end) {
        const int32_t t = di_render_token_offset(tok, ids, n_ids, out->system_end);
        if (t < 0) return DI_ERR_INVALID;
        p->system_end = t;
        bool have = t == 0;
        for (int32_t i = 0; i < p->n; i++) have |= p->at[i] == t;
        if (!have && p->n < DI_MAX_SNAP_AT) {
            p->at[p->n++] = t;
            qsort(p->at, (size_t)p->n, sizeof *p->at, cmp_i32);
        }
    }
    return DI_OK;
}

di_status di_render_request(const di_tokenizer *tok, const char *request_json, size_t n_bytes,
                            di_render_api api, const di_render_options *opt, char **text,
                            size_t *n_text, int32_t **ids, size_t *n_ids) {
    return di_render_request_points(tok, request_json, n_bytes, api, opt, text, n_text, ids, n_ids,
                                    NULL);
}

di_status di_render_request_points(const di_tokenizer *tok, const char *request_json,
                                   size_t n_bytes, di_render_api api, const di_render_options *opt,
                                   char **text, size_t *n_text, int32_t **ids, size_t *n_ids,
                                   di_render_points *points) {
    if (!request_json || !text || !n_text || (points && (!ids || !n_ids))) return DI_ERR_INVALID;
    di_render_options o = opt ? *opt : di_render_options_default();
    json_error_t err;
    json_t *req = json_loadb(request_json, n_bytes, JSON_ALLOW_NUL, &err);
    if (!req) {
        DI_LOG_ERROR("render: request is not JSON (%d:%d: %s)", err.line, err.column, err.text);
        return DI_ERR_INVALID;
    }
    json_t *doc = NULL;
    if (api == DI_RENDER_API_RAW)
        doc = json_incref(req);
    else if (!json_is_object(req))
        doc = NULL;
    else if (api == DI_RENDER_API_CHAT)
        doc = from_chat(req);
    else if (api == DI_RENDER_API_RESPONSES)
        doc = from_responses(req);
    else if (api == DI_RENDER_API_MESSAGES)
        doc = from_messages(req);
    di_status st = DI_OK;
    void *mem = NULL;
    di_render_conv conv;
    di_render_out out;
    di_render_out_init(&out);
    if (!doc) {
        DI_LOG_ERROR("render: the request is not a JSON object of the chosen API");
        st = DI_ERR_INVALID;
        goto done;
    }
    if (api != DI_RENDER_API_RAW) {
        json_object_set_new(doc, "encoding", json_string(o.encoding == 1 ? "dsv41" : "dsv4"));
        json_object_set_new(doc, "effort_table",
                            json_string(o.effort_table_0731 ? "v4_0731" : "v4_0424"));
        json_object_set_new(doc, "normalize_system", json_boolean(!o.official));
    }
    st = di_render_conv_from_json(doc, &conv, &mem);
    if (st == DI_OK) st = di_render_conv_text(&conv, &out);
    if (st == DI_OK && ids && n_ids) st = di_render_ids(tok, &out, ids, n_ids);
    if (st == DI_OK && points) {
        st = points_of(tok, &out, *ids, *n_ids, points);
        points->ends_in_reasoning = out.ends_in_reasoning;
        if (st != DI_OK) {
            DI_LOG_ERROR("render: the ids do not spell the prompt text (snapshot points)");
            di_tok_free(*ids);
            *ids = NULL;
        }
    }
    if (st == DI_OK) {
        *n_text = out.text.len;
        *text = di_buf_take(&out.text);
    }
done:
    di_render_out_deinit(&out);
    di_render_conv_free_mem(mem);
    json_decref(doc);
    json_decref(req);
    return st;
}
