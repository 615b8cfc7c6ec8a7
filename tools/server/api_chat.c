// api_chat — OpenAI Chat Completions and (legacy) Completions: request validation and mapping,
// the non-streaming body and the chat.completion.chunk SSE sequence of spec serving.md §2.2.
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "server/server.h"

bool srv_lookup_model(srv *s, const json_t *req, srv_api api, srv_err *e);

static const char *const k_roles[] = {"system", "developer", "user", "assistant", "tool"};
static const char *const k_efforts[] = {"none", "minimal", "low", "medium", "high", "xhigh", "max"};

static bool in_list(const char *s, const char *const *l, size_t n) {
    for (size_t i = 0; i < n; i++)
        if (!strcmp(s, l[i])) return true;
    return false;
}

// beta: the request came on /beta/chat/completions, where the last assistant message may be a
// prefix to continue (Chat prefix completion, serving.md §1.10).
static bool check_messages(const json_t *req, bool beta, srv_err *e) {
    const json_t *msgs = json_object_get(req, "messages");
    if (!msgs) {
        srv_err_set(e, 400, "messages", "'messages' is required.");
        return false;
    }
    if (!json_is_array(msgs) || json_array_size(msgs) == 0) {
        srv_err_set(e, 400, "messages", "'messages' must be a non-empty array.");
        return false;
    }
    size_t i;
    json_t *m;
    bool seen_calls = false;
    json_array_foreach(msgs, i, m) {
        if (!json_is_object(m)) {
            srv_err_set(e, 400, "messages", "messages[%zu] must be an object.", i);
            return false;
        }
        const char *role = json_string_value(json_object_get(m, "role"));
        if (!role || !in_list(role, k_roles, 5)) {
            srv_err_set(e, 400, "messages",
                        "messages[%zu].role must be one of system, developer, user, assistant, "
                        "tool.",
                        i);
            return false;
        }
        const json_t *c = json_object_get(m, "content");
        if (c && !json_is_null(c) && !json_is_string(c) && !json_is_array(c)) {
            srv_err_set(e, 400, "messages", "messages[%zu].content must be a string or an array.",
                        i);
            return false;
        }
        size_t k;
        json_t *p;
        json_array_foreach(json_is_array(c) ? c : NULL, k, p) {
            const char *t = json_string_value(json_object_get(p, "type"));
            if (!t || (strcmp(t, "text") && strcmp(t, "image_url"))) {
                srv_err_set(e, 400, "messages",
                            "messages[%zu].content[%zu].type must be 'text' or 'image_url'.", i, k);
                return false;
            }
            if (!strcmp(t, "image_url")) {
                srv_err_set(e, 400, "messages", "This model does not accept images.");
                return false;
            }
            if (!json_is_string(json_object_get(p, "text"))) {
                srv_err_set(e, 400, "messages", "messages[%zu].content[%zu].text must be a string.",
                            i, k);
                return false;
            }
        }
        if (!strcmp(role, "user") && (!c || json_is_null(c))) {
            srv_err_set(e, 400, "messages", "messages[%zu]: a user message needs 'content'.", i);
            return false;
        }
        const json_t *rc = json_object_get(m, "reasoning_content");
        if (rc && !json_is_null(rc) && !json_is_string(rc)) {
            srv_err_set(e, 400, "messages", "messages[%zu].reasoning_content must be a string.", i);
            return false;
        }
        const json_t *calls = json_object_get(m, "tool_calls");
        if (calls && !json_is_null(calls)) {
            if (!json_is_array(calls) || strcmp(role, "assistant")) {
                srv_err_set(e, 400, "messages",
                            "messages[%zu].tool_calls must be an array on an assistant message.",
                            i);
                return false;
            }
            json_array_foreach(calls, k, p) {
                const json_t *fn = json_object_get(p, "function");
                if (!json_is_string(json_object_get(fn, "name")) ||
                    !json_is_string(json_object_get(fn, "arguments"))) {
                    srv_err_set(e, 400, "messages",
                                "messages[%zu].tool_calls[%zu].function needs string 'name' and "
                                "'arguments'.",
                                i, k);
                    return false;
                }
                seen_calls = true;
            }
        }
        if (!strcmp(role, "tool")) {
            if (!seen_calls) {
                srv_err_set(e, 400, "messages",
                            "Messages with role 'tool' must be a response to a preceding message "
                            "with 'tool_calls'.");
                return false;
            }
            if (!json_is_string(json_object_get(m, "tool_call_id"))) {
                srv_err_set(e, 400, "messages", "messages[%zu].tool_call_id must be a string.", i);
                return false;
            }
        }
        const json_t *pre = json_object_get(m, "prefix");
        if (pre && !json_is_null(pre) && !json_is_boolean(pre)) {
            srv_err_set(e, 400, "messages", "messages[%zu].prefix must be a boolean.", i);
            return false;
        }
        // wo_eos: the official encoder's name of the same flag (the renderer honours both)
        if (json_is_true(pre) || json_is_true(json_object_get(m, "wo_eos"))) {
            srv_err_set(e, 400, "messages", "prefix is only allowed on the last assistant message");
            if (i + 1 != json_array_size(msgs) || strcmp(role, "assistant")) return false;
            if (!beta) {
                srv_err_set(e, 400, "messages",
                            "Chat prefix completion is served on the /beta path only "
                            "(POST /beta/chat/completions).");
                return false;
            }
        }
    }
    return true;
}

static bool check_options(const json_t *req, srv_gen *g, srv_err *e) {
    const json_t *th = json_object_get(req, "thinking");
    if (th && !json_is_null(th)) {
        const char *t = json_string_value(json_object_get(th, "type"));
        if (!json_is_object(th) || !t) {
            srv_err_set(e, 400, "thinking",
                        "'thinking' must be {\"type\": \"enabled\"|\"disabled\"}.");
            return false;
        }
        if (strcmp(t, "enabled") && strcmp(t, "disabled") && strcmp(t, "adaptive")) {
            srv_err_set(e, 422, "thinking", "'thinking.type' must be enabled or disabled.");
            return false;
        }
    }
    const json_t *eff = json_object_get(req, "reasoning_effort");
    if (eff && !json_is_null(eff)) {
        if (!json_is_string(eff)) {
            srv_err_set(e, 400, "reasoning_effort", "'reasoning_effort' must be a string.");
            return false;
        }
        if (!in_list(json_string_value(eff), k_efforts, 7)) {
            srv_err_set(e, 422, "reasoning_effort", "Invalid reasoning effort: %s",
                        json_string_value(eff));
            return false;
        }
    }
    // json_object / json_schema are rendered into the system message (serving.md §1.8) and
    // enforced by a grammar after </think>; regex and grammar are enforced only.
    if (!srv_gen_response_format(g, json_object_get(req, "response_format"), "response_format", e))
        return false;
    const json_t *tools = json_object_get(req, "tools");
    if (!srv_check_tools(tools, SRV_API_CHAT, e)) return false;
    return srv_check_tool_choice(g, tools, json_object_get(req, "tool_choice"), SRV_API_CHAT, e);
}

static bool max_tokens(const json_t *req, srv_gen *g, const char *k1, const char *k2, srv_err *e) {
    const json_t *v = json_object_get(req, k1);
    const char *key = k1;
    if ((!v || json_is_null(v)) && k2) {
        v = json_object_get(req, k2);
        key = k2;
    }
    if (!v || json_is_null(v)) return true;
    if (!json_is_integer(v)) {
        srv_err_set(e, 400, key, "'%s' must be an integer.", key);
        return false;
    }
    json_int_t x = json_integer_value(v);
    if (x < 1 || x > 393216) {
        srv_err_set(e, 422, key, "'%s' must be between 1 and 393216; got %lld.", key, (long long)x);
        return false;
    }
    g->max_tokens = (int32_t)x;
    return true;
}

bool srv_chat_prepare(srv *s, json_t *req, bool beta, srv_gen **out, srv_err *e) {
    srv_gen *g = srv_gen_create(s, SRV_API_CHAT, req);
    if (!g) {
        srv_err_set(e, 503, NULL, "Out of memory.");
        return false;
    }
    g->ops = &srv_chat_ops;
    srv_make_id(s, "chatcmpl-", g->id, sizeof g->id);
    if (!srv_check_model(s, req, true, e) || !check_messages(req, beta, e) ||
        !srv_check_sampling(g, req, SRV_API_CHAT, e) || !check_options(req, g, e) ||
        !max_tokens(req, g, "max_completion_tokens", "max_tokens", e) ||
        !srv_lookup_model(s, req, SRV_API_CHAT, e) || !srv_render(g, DI_RENDER_API_CHAT, e) ||
        !srv_check_length(g, e) || !srv_gen_start(g, e)) {
        srv_gen_destroy(g);
        return false;
    }
    *out = g;
    return true;
}

// ---- Chat: non-streaming body ----

static json_t *usage_json(const srv_gen *g) {
    int64_t gen = 0, cached = 0, reas = 0;
    for (int i = 0; i < g->n; i++) {
        gen += g->ch[i].n_gen;
        reas += g->ch[i].n_reasoning_tokens;
    }
    cached = g->ch[0].n_cached; // the prompt is shared by the n choices; count it once
    int64_t P = (int64_t)g->n_prompt;
    return json_pack("{s:I,s:I,s:I,s:{s:I,s:I},s:{s:I},s:I,s:I}", "prompt_tokens", (json_int_t)P,
                     "completion_tokens", (json_int_t)gen, "total_tokens", (json_int_t)(P + gen),
                     "prompt_tokens_details", "cached_tokens", (json_int_t)cached,
                     "replayed_tokens", (json_int_t)g->ch[0].n_replayed,
                     "completion_tokens_details", "reasoning_tokens", (json_int_t)reas,
                     "prompt_cache_hit_tokens", (json_int_t)cached, "prompt_cache_miss_tokens",
                     (json_int_t)(P - cached));
}

static json_t *calls_json(const srv_choice *c, bool with_index) {
    json_t *a = json_array();
    for (int k = 0; k < c->n_calls; k++) {
        const srv_call *t = &c->calls[k];
        json_t *o = json_pack("{s:s,s:s,s:{s:o,s:o}}", "id", t->id, "type", "function", "function",
                              "name", json_stringn_lossy(t->name.p, t->name.n), "arguments",
                              json_stringn_lossy(t->args.p, t->args.n));
        if (with_index) json_object_set_new(o, "index", json_integer(k));
        json_array_append_new(a, o);
    }
    return a;
}

static json_t *logprobs_json(const srv_choice *c) {
    if (!c->lp_content) return json_null();
    return json_pack("{s:O,s:O}", "content", c->lp_content, "reasoning_content", c->lp_reasoning);
}

static json_t *chat_body(srv_gen *g) {
    json_t *choices = json_array();
    for (int i = 0; i < g->n; i++) {
        srv_choice *c = &g->ch[i];
        json_t *msg = json_pack("{s:s,s:o}", "role", "assistant", "content",
                                json_stringn_lossy(c->content.p, c->content.n));
        if (g->thinking)
            json_object_set_new(msg, "reasoning_content",
                                json_stringn_lossy(c->reasoning.p, c->reasoning.n));
        if (c->n_calls) json_object_set_new(msg, "tool_calls", calls_json(c, false));
        json_array_append_new(choices, json_pack("{s:i,s:s,s:o,s:o}", "index", i, "finish_reason",
                                                 srv_finish_openai(c), "logprobs", logprobs_json(c),
                                                 "message", msg));
    }
    return json_pack("{s:s,s:s,s:I,s:s,s:s,s:o,s:o}", "id", g->id, "object", "chat.completion",
                     "created", (json_int_t)g->created, "model", g->s->cfg.model_name,
                     "system_fingerprint", "fp_deepinfer", "choices", choices, "usage",
                     usage_json(g));
}

// ---- Chat: streaming ----

static void sse_data(srv_gen *g, json_t *obj) { // steals obj
    sb_adds(&g->out, "data: ");
    sb_add_json(&g->out, obj);
    sb_adds(&g->out, "\n\n");
    json_decref(obj);
}

static json_t *chunk(srv_gen *g, int index, json_t *delta, const char *finish, json_t *lp) {
    json_t *ch = json_pack("{s:i,s:o,s:o,s:s?}", "index", index, "delta", delta, "logprobs",
                           lp ? lp : json_null(), "finish_reason", finish);
    if (!finish) json_object_set_new(ch, "finish_reason", json_null());
    return json_pack("{s:s,s:s,s:I,s:s,s:s,s:[o]}", "id", g->id, "object", "chat.completion.chunk",
                     "created", (json_int_t)g->created, "model", g->s->cfg.model_name,
                     "system_fingerprint", "fp_deepinfer", "choices", ch);
}

static void chat_head(srv_gen *g, srv_choice *c) {
    if (c->head_sent) return;
    c->head_sent = true;
    json_t *d = g->thinking ? json_pack("{s:s,s:n,s:s}", "role", "assistant", "content",
                                        "reasoning_content", "")
                            : json_pack("{s:s,s:s}", "role", "assistant", "content", "");
    sse_data(g, chunk(g, c->idx, d, NULL, NULL));
}

static void chat_begin(srv_gen *g) {
    for (int i = 0; i < g->n; i++) chat_head(g, &g->ch[i]);
}

// Logprobs entries added since the last chunk of this choice (streamed with the text they made).
static json_t *new_logprobs(srv_choice *c) {
    if (!c->lp_content) return NULL;
    size_t nc = json_array_size(c->lp_content), nr = json_array_size(c->lp_reasoning);
    // blk_index / n_blocks: how many content / reasoning entries were already streamed
    json_t *a = json_array(), *b = json_array();
    for (size_t i = (size_t)c->blk_index; i < nc; i++)
        json_array_append(a, json_array_get(c->lp_content, i));
    for (size_t i = (size_t)c->n_blocks; i < nr; i++)
        json_array_append(b, json_array_get(c->lp_reasoning, i));
    c->blk_index = (int)nc;
    c->n_blocks = (int)nr;
    return json_pack("{s:o,s:o}", "content", a, "reasoning_content", b);
}

static void chat_event(srv_gen *g, srv_choice *c, const di_parser_event *ev) {
    chat_head(g, c);
    json_t *d = NULL;
    switch (ev->kind) {
    case DI_PARSER_EVENT_REASONING:
        d = json_pack("{s:n,s:o}", "content", "reasoning_content",
                      json_stringn_lossy(ev->text, ev->len));
        break;
    case DI_PARSER_EVENT_CONTENT:
        d = json_pack("{s:o}", "content", json_stringn_lossy(ev->text, ev->len));
        if (g->thinking) json_object_set_new(d, "reasoning_content", json_null());
        break;
    case DI_PARSER_EVENT_TOOL_NAME_END: {
        // spec §2.2 step 4 / §2.6: the call's first delta at name end (id, name, arguments "")
        const srv_call *k = &c->calls[c->n_calls - 1];
        d = json_pack("{s:[{s:i,s:s,s:s,s:{s:o,s:s}}]}", "tool_calls", "index", c->n_calls - 1,
                      "id", k->id, "type", "function", "function", "name",
                      json_stringn_lossy(k->name.p, k->name.n), "arguments", "");
        break;
    }
    case DI_PARSER_EVENT_ARGS_DELTA:
        if (!c->n_calls || !c->calls[c->n_calls - 1].named || !ev->len) return;
        d = json_pack("{s:[{s:i,s:{s:o}}]}", "tool_calls", "index", c->n_calls - 1, "function",
                      "arguments", json_stringn_lossy(ev->text, ev->len));
        break;
    default:
        // TOOL_CALL_END needs no chunk; TOOL_CALL_ABORT (truncation inside a call, spec §1.11):
        // no further deltas of that call, the finish chunk says "length"
        return;
    }
    sse_data(g, chunk(g, c->idx, d, NULL, new_logprobs(c)));
}

static void chat_choice_end(srv_gen *g, srv_choice *c) {
    chat_head(g, c);
    if (c->efinish == DI_FINISH_ERROR) {
        srv_err err;
        srv_err_set(&err, 500, NULL, "%s", srv_gen_fail_message(g));
        sse_data(g, srv_err_body(SRV_API_CHAT, &err));
        return;
    }
    json_t *ch = chunk(g, c->idx, json_object(), srv_finish_openai(c), new_logprobs(c));
    // [design] §2.2 step 6: usage also on the last choice chunk when include_usage is set
    bool last = true;
    for (int i = 0; i < g->n; i++)
        if (!g->ch[i].ended) last = false;
    if (last && g->include_usage) json_object_set_new(ch, "usage", usage_json(g));
    sse_data(g, ch);
}

static void chat_end(srv_gen *g) {
    if (g->include_usage) {
        json_t *u = json_pack("{s:s,s:s,s:I,s:s,s:s,s:[],s:o}", "id", g->id, "object",
                              "chat.completion.chunk", "created", (json_int_t)g->created, "model",
                              g->s->cfg.model_name, "system_fingerprint", "fp_deepinfer", "choices",
                              "usage", usage_json(g));
        sse_data(g, u);
    }
    sb_adds(&g->out, "data: [DONE]\n\n");
}

static void chat_error(srv_gen *g, const srv_err *e) {
    sse_data(g, srv_err_body(SRV_API_CHAT, e));
    sb_adds(&g->out, "data: [DONE]\n\n");
}

const srv_api_ops srv_chat_ops = {chat_begin, chat_event, chat_choice_end,    chat_end,
                                  chat_error, chat_body,  ": keep-alive\n\n", "call_"};

// ---- Completions (legacy): raw text continuation of a prompt ----

// The ids of text, plain BPE (special-token text in it stays text), appended to g->prompt.
static bool append_text(srv_gen *g, const char *text, const char *param, srv_err *e) {
    int32_t *ids = NULL;
    size_t n = 0;
    if (di_tokenizer_encode(g->s->tok, text, strlen(text), false, &ids, &n) != DI_OK) {
        srv_err_set(e, 400, param, "'%s' is not valid UTF-8 text.", param);
        return false;
    }
    int32_t *p = realloc(g->prompt, (g->n_prompt + n) * sizeof *p);
    if (!p) {
        di_tok_free(ids);
        srv_err_set(e, 503, NULL, "Out of memory.");
        return false;
    }
    if (n) memcpy(p + g->n_prompt, ids, n * sizeof *ids);
    g->prompt = p;
    g->n_prompt += n;
    di_tok_free(ids);
    return true;
}

// One special token id appended to g->prompt; 500 when the served tokenizer lacks it.
static bool append_special(srv_gen *g, const char *name, srv_err *e) {
    const int32_t id = di_tokenizer_token_id(g->s->tok, name);
    int32_t *p = id < 0 ? NULL : realloc(g->prompt, (g->n_prompt + 1) * sizeof *p);
    if (!p) {
        if (id < 0)
            srv_err_set(e, 500, NULL, "The served model's tokenizer has no %s token.", name);
        else
            srv_err_set(e, 503, NULL, "Out of memory.");
        return false;
    }
    p[g->n_prompt++] = id;
    g->prompt = p;
    return true;
}

// A completion's prompt: BOS and the text; with a suffix the FIM layout of serving.md §1.10,
// BOS<｜fim▁begin｜>{prompt}<｜fim▁hole｜>{suffix}<｜fim▁end｜>, the special tokens by id (so
// special-token text inside the prompt or suffix stays text).
static bool completion_prompt(srv_gen *g, const char *text, const char *suffix, srv_err *e) {
    g->prompt = malloc(sizeof *g->prompt);
    if (!g->prompt) {
        srv_err_set(e, 503, NULL, "Out of memory.");
        return false;
    }
    g->prompt[0] = 0; // BOS
    g->n_prompt = 1;
    if (!suffix) return append_text(g, text, "prompt", e);
    return append_special(g, "<｜fim▁begin｜>", e) && append_text(g, text, "prompt", e) &&
           append_special(g, "<｜fim▁hole｜>", e) && append_text(g, suffix, "suffix", e) &&
           append_special(g, "<｜fim▁end｜>", e);
}

bool srv_completions_prepare(srv *s, json_t *req, bool beta, srv_gen **out, srv_err *e) {
    srv_gen *g = srv_gen_create(s, SRV_API_COMPLETIONS, req);
    if (!g) {
        srv_err_set(e, 503, NULL, "Out of memory.");
        return false;
    }
    g->ops = &srv_completions_ops;
    srv_make_id(s, "cmpl-", g->id, sizeof g->id);
    g->stage = DI_PARSER_STAGE_CONTENT;
    const json_t *p = json_object_get(req, "prompt");
    if (!srv_check_model(s, req, true, e)) goto fail;
    if (!p) {
        srv_err_set(e, 400, "prompt", "'prompt' is required.");
        goto fail;
    }
    if (json_is_array(p) && json_array_size(p) == 1 && json_is_string(json_array_get(p, 0)))
        p = json_array_get(p, 0);
    if (!json_is_string(p) || json_string_length(p) == 0) {
        srv_err_set(e, 400, "prompt", "'prompt' must be a non-empty string.");
        goto fail;
    }
    const json_t *suffix = json_object_get(req, "suffix");
    if (suffix && json_is_null(suffix)) suffix = NULL;
    if (suffix) {
        if (!beta) {
            srv_err_set(
                e, 400, "suffix",
                "'suffix' (FIM) is served on the /beta path only (POST /beta/completions).");
            goto fail;
        }
        if (!s->cfg.fim) {
            srv_err_set(e, 400, "suffix",
                        "FIM completion is disabled on this server (start it with --fim).");
            goto fail;
        }
        if (!json_is_string(suffix)) {
            srv_err_set(e, 400, "suffix", "'suffix' must be a string.");
            goto fail;
        }
    }
    if (!srv_check_sampling(g, req, SRV_API_COMPLETIONS, e)) goto fail;
    if (!max_tokens(req, g, "max_tokens", NULL, e)) goto fail;
    if (g->max_tokens <= 0) g->max_tokens = 16; // OpenAI's default for completions
    if (suffix && g->max_tokens > SRV_FIM_MAX_TOKENS) {
        srv_err_set(e, 422, "max_tokens", "'max_tokens' of a FIM completion is at most %d; got %d.",
                    SRV_FIM_MAX_TOKENS, (int)g->max_tokens);
        goto fail;
    }
    if (!srv_lookup_model(s, req, SRV_API_COMPLETIONS, e)) goto fail;
    if (!completion_prompt(g, json_string_value(p), suffix ? json_string_value(suffix) : NULL, e))
        goto fail;
    for (int i = 0; i < SRV_MAX_N; i++) g->ch[i].section = 1;
    if (!srv_check_length(g, e) || !srv_gen_start(g, e)) goto fail;
    *out = g;
    return true;
fail:
    srv_gen_destroy(g);
    return false;
}

static json_t *cmpl_lp(const srv_choice *c) {
    if (!c->lp_content) return json_null();
    json_t *toks = json_array(), *lps = json_array(), *tops = json_array();
    size_t i;
    json_t *v;
    json_array_foreach(c->lp_content, i, v) {
        json_array_append(toks, json_object_get(v, "token"));
        json_array_append(lps, json_object_get(v, "logprob"));
        json_t *t = json_object();
        size_t k;
        json_t *w;
        json_array_foreach(json_object_get(v, "top_logprobs"), k, w) json_object_set(
            t, json_string_value(json_object_get(w, "token")), json_object_get(w, "logprob"));
        json_array_append_new(tops, t);
    }
    return json_pack("{s:o,s:o,s:o}", "tokens", toks, "token_logprobs", lps, "top_logprobs", tops);
}

static json_t *cmpl_usage(const srv_gen *g) {
    int64_t gen = 0;
    for (int i = 0; i < g->n; i++) gen += g->ch[i].n_gen;
    return json_pack("{s:I,s:I,s:I,s:{s:I,s:I}}", "prompt_tokens", (json_int_t)g->n_prompt,
                     "completion_tokens", (json_int_t)gen, "total_tokens",
                     (json_int_t)(g->n_prompt + (size_t)gen), "prompt_tokens_details",
                     "cached_tokens", (json_int_t)g->ch[0].n_cached, "replayed_tokens",
                     (json_int_t)g->ch[0].n_replayed);
}

static json_t *cmpl_body(srv_gen *g) {
    json_t *choices = json_array();
    for (int i = 0; i < g->n; i++) {
        srv_choice *c = &g->ch[i];
        json_array_append_new(choices, json_pack("{s:i,s:o,s:s,s:o}", "index", i, "text",
                                                 json_stringn_lossy(c->content.p, c->content.n),
                                                 "finish_reason", srv_finish_openai(c), "logprobs",
                                                 cmpl_lp(c)));
    }
    return json_pack("{s:s,s:s,s:I,s:s,s:o,s:o}", "id", g->id, "object", "text_completion",
                     "created", (json_int_t)g->created, "model", g->s->cfg.model_name, "choices",
                     choices, "usage", cmpl_usage(g));
}

static json_t *cmpl_chunk(srv_gen *g, int i, json_t *text, const char *finish) {
    json_t *ch = json_pack("{s:i,s:o,s:n,s:s?}", "index", i, "text", text, "logprobs",
                           "finish_reason", finish);
    if (!finish) json_object_set_new(ch, "finish_reason", json_null());
    return json_pack("{s:s,s:s,s:I,s:s,s:[o]}", "id", g->id, "object", "text_completion", "created",
                     (json_int_t)g->created, "model", g->s->cfg.model_name, "choices", ch);
}

static void cmpl_event(srv_gen *g, srv_choice *c, const di_parser_event *ev) {
    if (ev->kind != DI_PARSER_EVENT_CONTENT && ev->kind != DI_PARSER_EVENT_REASONING) return;
    sse_data(g, cmpl_chunk(g, c->idx, json_stringn_lossy(ev->text, ev->len), NULL));
}

static void cmpl_choice_end(srv_gen *g, srv_choice *c) {
    if (c->efinish == DI_FINISH_ERROR) {
        srv_err err;
        srv_err_set(&err, 500, NULL, "Generation failed: %s.", di_status_str(c->estatus));
        sse_data(g, srv_err_body(SRV_API_COMPLETIONS, &err));
        return;
    }
    sse_data(g, cmpl_chunk(g, c->idx, json_string(""), srv_finish_openai(c)));
}

static void cmpl_end(srv_gen *g) {
    if (g->include_usage) {
        json_t *u = json_pack("{s:s,s:s,s:I,s:s,s:[],s:o}", "id", g->id, "object",
                              "text_completion", "created", (json_int_t)g->created, "model",
                              g->s->cfg.model_name, "choices", "usage", cmpl_usage(g));
        sse_data(g, u);
    }
    sb_adds(&g->out, "data: [DONE]\n\n");
}

const srv_api_ops srv_completions_ops = {NULL,       cmpl_event, cmpl_choice_end,    cmpl_end,
                                         chat_error, cmpl_body,  ": keep-alive\n\n", "call_"};
