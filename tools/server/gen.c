// gen — the generation driver shared by the three APIs: submits a request's n engine requests,
// feeds their tokens through a detokenising output parser per choice, accumulates reasoning,
// content, tool calls and logprobs, and calls the API's streaming hooks. Also the small string
// builder, error and id helpers of the server. Thread-safety: a srv_gen belongs to the connection
// thread that created it; only queue.c is touched by the engine thread.
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "server/server.h"

// ---- string builder ----

void sb_add(sb *b, const char *s, size_t n) {
    if (b->n + n + 1 > b->cap) {
        size_t cap = b->cap ? b->cap : 256;
        while (cap < b->n + n + 1) cap *= 2;
        char *p = realloc(b->p, cap);
        if (!p) abort(); // out of memory on a string builder: no sane recovery
        b->p = p;
        b->cap = cap;
    }
    if (n) memcpy(b->p + b->n, s, n);
    b->n += n;
    b->p[b->n] = 0;
}

void sb_adds(sb *b, const char *s) {
    sb_add(b, s, strlen(s));
}

void sb_addf(sb *b, const char *fmt, ...) {
    char tmp[1024];
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(tmp, sizeof tmp, fmt, ap);
    va_end(ap);
    if (n < 0) return;
    if ((size_t)n < sizeof tmp) {
        sb_add(b, tmp, (size_t)n);
        return;
    }
    char *big = malloc((size_t)n + 1);
    if (!big) abort();
    va_start(ap, fmt);
    vsnprintf(big, (size_t)n + 1, fmt, ap);
    va_end(ap);
    sb_add(b, big, (size_t)n);
    free(big);
}

void sb_free(sb *b) {
    free(b->p);
    memset(b, 0, sizeof *b);
}

void sb_add_json(sb *b, const json_t *v) {
    char *s = json_dumps(v, JSON_COMPACT | JSON_ENCODE_ANY);
    if (!s) abort();
    sb_adds(b, s);
    free(s);
}

json_t *json_stringn_lossy(const char *s, size_t n) {
    json_t *j = json_stringn(s, n);
    if (j) return j;
    sb b = {0};
    for (size_t i = 0; i < n;) {
        unsigned char c = (unsigned char)s[i];
        size_t len = c < 0x80 ? 1 : (c >> 5) == 6 ? 2 : (c >> 4) == 14 ? 3 : (c >> 3) == 30 ? 4 : 0;
        json_t *t = len && i + len <= n ? json_stringn(s + i, len) : NULL;
        if (t) {
            sb_add(&b, s + i, len);
            json_decref(t);
            i += len;
        } else {
            sb_adds(&b, "\xEF\xBF\xBD");
            i++;
        }
    }
    j = json_stringn(b.p ? b.p : "", b.n);
    sb_free(&b);
    return j ? j : json_string("");
}

// ---- errors ----

void srv_err_set(srv_err *e, int status, const char *param, const char *fmt, ...) {
    e->status = status;
    e->param = param;
    e->type = status == 401   ? "authentication_error"
              : status == 429 ? "rate_limit_error"
              : status >= 500 ? "api_error"
                              : "invalid_request_error";
    e->code = status == 404 ? "model_not_found" : status == 503 ? "server_overloaded" : NULL;
    e->retry_after_s = (status == 429 || status == 503) ? 1 : 0;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(e->msg, sizeof e->msg, fmt, ap);
    va_end(ap);
}

json_t *srv_err_body(srv_api api, const srv_err *e) {
    if (api == SRV_API_MESSAGES) { // spec §4.1/§4.2, Anthropic shape
        const char *t = e->status == 401   ? "authentication_error"
                        : e->status == 403 ? "permission_error"
                        : e->status == 404 ? "not_found_error"
                        : e->status == 413 ? "request_too_large"
                        : e->status == 429 ? "rate_limit_error"
                        : e->status == 503 ? "overloaded_error"
                        : e->status >= 500 ? "api_error"
                                           : "invalid_request_error";
        return json_pack("{s:s,s:{s:s,s:s}}", "type", "error", "error", "type", t, "message",
                         e->msg);
    }
    return json_pack("{s:{s:s,s:s,s:s?,s:s}}", "error", "message", e->msg, "type", e->type, "param",
                     e->param, "code", e->code ? e->code : e->type);
}

// ---- ids and time ----

double srv_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

void srv_make_id(srv *s, const char *prefix, char *out, size_t cap) {
    static const char k_abc[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_";
    // unique per process (counter) and unlikely to repeat across restarts (start time mixed in)
    uint64_t x = atomic_fetch_add(&s->next_id, 1) * 0x9E3779B97F4A7C15ull ^
                 (uint64_t)s->started_at * 0xBF58476D1CE4E5B9ull;
    char r[25];
    for (int i = 0; i < 24; i++) {
        x ^= x >> 31;
        x *= 0x94D049BB133111EBull;
        x ^= x >> 29;
        r[i] = k_abc[(x >> 58) & 63];
    }
    r[24] = 0;
    snprintf(out, cap, "%s%s", prefix, r);
}

const char *srv_finish_openai(const srv_choice *c) {
    switch (c->pfinish) {
    case DI_PARSER_FINISH_LENGTH:
        return "length";
    case DI_PARSER_FINISH_TOOL_CALLS:
        return "tool_calls";
    default:
        return "stop";
    }
}

// ---- lifecycle ----

_Thread_local bool srv_prefill_only;
_Thread_local bool srv_probe_only;

srv_gen *srv_gen_create(srv *s, srv_api api, json_t *req) {
    srv_gen *g = calloc(1, sizeof *g);
    if (!g) return NULL;
    g->s = s;
    g->prefill_only = srv_prefill_only;
    g->probe_only = srv_probe_only;
    g->api = api;
    g->req = json_incref(req);
    g->n = 1;
    g->sp = di_sample_params_default();
    g->sp.temperature = 1.0f;
    g->top_logprobs = -1;
    g->tool_parallel = true;
    g->grammar_after = -1;
    g->created = (long)time(NULL);
    g->t_start = srv_now();
    g->t_last_out = g->t_start;
    for (int i = 0; i < SRV_MAX_N; i++) {
        g->ch[i].g = g;
        g->ch[i].idx = i;
    }
    srv_queue_init(g);
    return g;
}

static void on_parser_event(void *user, const di_parser_event *ev);

bool srv_gen_init_parsers(srv_gen *g, srv_err *e) {
    srv *s = g->s;
    for (int i = 0; i < g->n; i++) {
        srv_choice *c = &g->ch[i];
        if (di_parser_create(s->tok, g->stage, g->tools, g->json_output, g->stop, (size_t)g->n_stop,
                             on_parser_event, c, &c->parser) != DI_OK) {
            srv_err_set(e, 400, "stop", "Invalid stop sequence (empty or longer than 256 bytes).");
            return false;
        }
        if (g->top_logprobs >= 0) {
            c->lp_content = json_array();
            c->lp_reasoning = json_array();
        }
    }
    return true;
}

bool srv_gen_response_format(srv_gen *g, const json_t *fmt, const char *param, srv_err *e) {
    if (!fmt || json_is_null(fmt)) return true;
    const char *t = json_string_value(json_object_get(fmt, "type"));
    if (!json_is_object(fmt) || !t) {
        srv_err_set(e, 400, param, "'%s' must be an object with 'type'.", param);
        return false;
    }
    g->grammar_param = param;
    di_grammar_kind kind;
    const char *text = NULL;
    char *owned = NULL;
    uint32_t flags = 0;
    if (!strcmp(t, "text")) return true;
    if (!strcmp(t, "json_object")) {
        g->json_output = true; // the recipe's JSON mode in the parser, and now enforced too
        kind = DI_GRAMMAR_KIND_JSON_OBJECT;
    } else if (!strcmp(t, "json_schema")) {
        // Chat nests the fields under "json_schema"; Responses has them on the format itself.
        const json_t *js = g->api == SRV_API_RESPONSES ? fmt : json_object_get(fmt, "json_schema");
        const char *pfx = g->api == SRV_API_RESPONSES ? "" : ".json_schema";
        if (!json_is_object(js)) {
            srv_err_set(e, 400, param, "Missing required parameter: '%s.json_schema'.", param);
            return false;
        }
        if (!json_is_string(json_object_get(js, "name"))) {
            srv_err_set(e, 400, param, "Missing required parameter: '%s%s.name'.", param, pfx);
            return false;
        }
        const json_t *schema = json_object_get(js, "schema"),
                     *strict = json_object_get(js, "strict");
        if (schema && !json_is_object(schema)) {
            srv_err_set(e, 400, param, "'%s%s.schema' must be an object.", param, pfx);
            return false;
        }
        if (strict && !json_is_boolean(strict) && !json_is_null(strict)) {
            srv_err_set(e, 400, param, "'%s%s.strict' must be a boolean.", param, pfx);
            return false;
        }
        if (json_is_true(strict)) flags |= DI_GRAMMAR_FLAG_STRICT;
        owned = schema ? json_dumps(schema, JSON_COMPACT) : strdup("true");
        if (!owned) {
            srv_err_set(e, 503, NULL, "The server is out of memory; retry later.");
            return false;
        }
        text = owned;
        kind = DI_GRAMMAR_KIND_JSON_SCHEMA;
    } else if (!strcmp(t, "regex") || !strcmp(t, "grammar")) {
        text = json_string_value(json_object_get(fmt, t));
        if (!text) {
            srv_err_set(e, 400, param, "'%s.%s' must be a string.", param, t);
            return false;
        }
        kind = !strcmp(t, "regex") ? DI_GRAMMAR_KIND_REGEX : DI_GRAMMAR_KIND_EBNF;
    } else {
        srv_err_set(e, 400, param,
                    "%s type '%s' is not supported: use text, json_object, json_schema, regex or "
                    "grammar.",
                    param, t);
        return false;
    }
    char err[512];
    di_status st = di_grammar_cache_compile(g->s->gcache, kind, text, text ? strlen(text) : 0,
                                            flags, &g->grammar, err, sizeof err);
    free(owned);
    if (st == DI_ERR_NOMEM) {
        srv_err_set(e, 503, NULL, "The server is out of memory; retry later.");
        return false;
    }
    if (st != DI_OK) {
        srv_err_set(e, 400, param, "Invalid %s in '%s': %s",
                    kind == DI_GRAMMAR_KIND_JSON_SCHEMA ? "JSON schema"
                    : kind == DI_GRAMMAR_KIND_REGEX     ? "regex"
                                                        : "grammar",
                    param, err);
        return false;
    }
    return true;
}

const char *srv_gen_fail_message(const srv_gen *g) {
    for (int i = 0; g->grammar && i < g->n; i++)
        if (g->ch[i].efinish == DI_FINISH_ERROR && g->ch[i].estatus == DI_ERR_UNSUPPORTED)
            return "Generation failed: the structured-output constraint could not go on (its "
                   "matcher's limits: nesting too deep or too many parses; or no token can "
                   "continue the grammar).";
    return "Generation failed in the engine.";
}

bool srv_gen_tool_grammar(srv_gen *g, srv_err *e) {
    srv *s = g->s;
    // Structured output constrains the answer only: in thinking mode from </think> on.
    g->grammar_after = g->stage == DI_PARSER_STAGE_REASONING ? s->think_end : -1;
    if (!g->tools) return true;
    const bool forced = g->stage == DI_PARSER_STAGE_TOOL_CALLS;
    di_grammar_tools_options o = {.name = forced ? g->tool_name : NULL,
                                  .parallel = g->tool_parallel,
                                  .encoding = s->encoding,
                                  .start = forced       ? DI_GRAMMAR_TOOLS_AFTER_HEADER
                                           : g->grammar ? DI_GRAMMAR_TOOLS_BLOCK
                                                        : DI_GRAMMAR_TOOLS_AFTER_DSML};
    if (!forced && !g->grammar && s->dsml < 0) return true; // no ｜DSML｜ token: unconstrained
    char *tools = json_dumps(json_object_get(g->req, "tools"), JSON_COMPACT);
    if (!tools) {
        srv_err_set(e, 503, NULL, "The server is out of memory; retry later.");
        return false;
    }
    di_grammar *tg = NULL;
    char err[512] = "";
    di_status st = di_grammar_cache_compile_tools(s->gcache, s->tok, tools, strlen(tools), &o, &tg,
                                                  err, sizeof err);
    free(tools);
    if (st == DI_OK && !forced && g->grammar) { // auto with a format: the format or a block
        di_grammar *u = NULL;
        st = di_grammar_cache_union(s->gcache, g->grammar, tg, &u);
        di_grammar_destroy(tg);
        tg = u;
        if (st == DI_ERR_INVALID) snprintf(err, sizeof err, "the grammar is too large");
    }
    if (st == DI_ERR_NOMEM) {
        srv_err_set(e, 503, NULL, "The server is out of memory; retry later.");
        return false;
    }
    if (st != DI_OK && !forced && !g->grammar)
        return true; // auto: a schema the compiler refuses leaves the calls unconstrained
    if (st != DI_OK) {
        srv_err_set(e, st == DI_ERR_INVALID ? 400 : 500, "tools",
                    "The tools cannot be enforced as a tool-call grammar: %s", err);
        return false;
    }
    di_grammar_destroy(g->grammar); // forced: the answer is the block, not a formatted text
    g->grammar = tg;
    if (forced)
        g->grammar_after = -1; // the prompt ends in the block header: constrained from the start
    else if (o.start == DI_GRAMMAR_TOOLS_AFTER_DSML)
        g->grammar_after = s->dsml; // the parser starts a block there too (reasoning or answer)
    // else (auto with a format): where the format starts (after </think> in thinking mode)
    return true;
}

bool srv_gen_start(srv_gen *g, srv_err *e) {
    srv *s = g->s;
    if (!srv_gen_tool_grammar(g, e)) return false;
    if (atomic_load(&s->draining)) {
        srv_err_set(e, 503, NULL, "The server is shutting down; retry on another instance.");
        return false;
    }
    if (g->probe_only) return true; // rendered and validated; the probe looks its prompt up
    if (g->prefill_only) {          // the prompt's KV is the product: one choice, one token
        g->n = 1;
        g->stream = false;
        g->max_tokens = 1;
    }
    if (!srv_gen_init_parsers(g, e)) return false;
    for (int i = 0; i < g->n; i++) {
        srv_choice *c = &g->ch[i];
        di_request_params p = di_request_params_default();
        p.prompt = g->prompt;
        p.n_prompt = (int32_t)g->n_prompt;
        p.sample = g->sp;
        p.sample.seed = g->sp.seed + (uint64_t)i; // n choices: independent streams
        p.sample.logprobs = g->top_logprobs >= 0;
        p.sample.n_logprobs = g->top_logprobs > 0 ? g->top_logprobs : 0;
        p.max_tokens = g->max_tokens;
        p.grammar = g->grammar;
        p.grammar_after = g->grammar_after;
        p.snap_at = g->snap_at;
        p.cache_salt = g->cache_salt;
        p.priority = g->priority;
        p.tenant = g->tenant;
        p.n_snap_at = g->n_snap_at;
        p.on_event = srv_queue_on_event;
        p.user = c;
        di_status st = di_engine_submit(s->engine, &p, &c->eid);
        if (st != DI_OK) {
            for (int k = 0; k < i; k++) di_engine_cancel(s->engine, g->ch[k].eid);
            srv_queue_wait_finals(g, i);
            for (int k = 0; k < i; k++) g->ch[k].ended = true;
            if (st == DI_ERR_BUSY)
                srv_err_set(e, 503, NULL, "The engine's queue is full; retry later.");
            else if (st == DI_ERR_DEVICE_LOST)
                srv_err_set(e, 503, NULL,
                            "The device was lost and could not be recovered: this replica "
                            "refuses requests (see /health); retry on another one.");
            else if (st == DI_ERR_NOMEM)
                srv_err_set(e, 503, NULL, "The server is out of memory; retry later.");
            else
                srv_err_set(e, 400, NULL, "The request was rejected by the engine: %s.",
                            di_status_str(st));
            return false;
        }
        c->submitted = true;
    }
    return true;
}

// ---- parser events → choice state → API stream hooks ----

static void on_parser_event(void *user, const di_parser_event *ev) {
    srv_choice *c = user;
    srv_gen *g = c->g;
    switch (ev->kind) {
    case DI_PARSER_EVENT_REASONING:
        sb_add(&c->reasoning, ev->text, ev->len);
        c->section = 0;
        break;
    case DI_PARSER_EVENT_CONTENT:
        sb_add(&c->content, ev->text, ev->len);
        c->section = 1;
        break;
    case DI_PARSER_EVENT_TOOL_CALL_BEGIN: {
        if (c->n_calls == c->cap_calls) {
            int cap = c->cap_calls ? c->cap_calls * 2 : 4;
            srv_call *n = realloc(c->calls, (size_t)cap * sizeof *n);
            if (!n) abort();
            c->calls = n;
            c->cap_calls = cap;
        }
        srv_call *k = &c->calls[c->n_calls++];
        memset(k, 0, sizeof *k);
        srv_make_id(g->s, g->ops->call_prefix, k->id, sizeof k->id);
        c->section = 2;
        break;
    }
    case DI_PARSER_EVENT_TOOL_NAME:
        if (c->n_calls) sb_add(&c->calls[c->n_calls - 1].name, ev->text, ev->len);
        break;
    case DI_PARSER_EVENT_TOOL_NAME_END:
        if (c->n_calls) c->calls[c->n_calls - 1].named = true;
        break;
    case DI_PARSER_EVENT_ARGS_DELTA:
        if (c->n_calls) sb_add(&c->calls[c->n_calls - 1].args, ev->text, ev->len);
        break;
    case DI_PARSER_EVENT_TOOL_CALL_END:
        if (c->n_calls) c->calls[c->n_calls - 1].done = true;
        break;
    case DI_PARSER_EVENT_TOOL_CALL_ABORT:
        break;
    }
    if (g->stream && g->ops->stream_event) g->ops->stream_event(g, c, ev);
    if (ev->kind == DI_PARSER_EVENT_TOOL_CALL_ABORT && c->n_calls) { // spec §1.11: dropped
        srv_call *k = &c->calls[--c->n_calls];
        sb_free(&k->name);
        sb_free(&k->args);
    }
}

static json_t *token_lp(srv *s, int32_t id, float lp) {
    size_t n = 0;
    const char *b = di_tokenizer_token_bytes(s->tok, id, &n);
    json_t *bytes = json_array();
    for (size_t i = 0; i < n; i++) json_array_append_new(bytes, json_integer((unsigned char)b[i]));
    return json_pack("{s:o,s:f,s:o}", "token", json_stringn_lossy(b ? b : "", n), "logprob",
                     (double)lp, "bytes", bytes);
}

static void handle(srv_gen *g, const srv_tok_ev *ev) {
    srv_choice *c = &g->ch[ev->choice];
    srv *s = g->s;
    if (c->ended) return;
    double now = srv_now();
    if (ev->token >= 0) {
        c->n_gen++;
        if (g->t_first == 0) g->t_first = now;
        if (g->t_last_tok > 0) {
            pthread_mutex_lock(&s->metrics_mu);
            srv_metrics_observe(&s->itl, now - g->t_last_tok);
            pthread_mutex_unlock(&s->metrics_mu);
        }
        g->t_last_tok = now;
        if (!di_parser_finished(c->parser)) {
            int before = c->section;
            di_parser_feed_token(c->parser, ev->token);
            if (c->section == 0 && before == 0 && g->thinking) c->n_reasoning_tokens++;
            if (c->lp_content) {
                json_t *e = token_lp(s, ev->token, ev->logprob);
                json_t *top = json_array();
                for (int i = 0; i < ev->n_top; i++)
                    json_array_append_new(top, token_lp(s, ev->top_ids[i], ev->top_lp[i]));
                json_object_set_new(e, "top_logprobs", top);
                json_array_append_new(
                    c->section == 0 && g->thinking ? c->lp_reasoning : c->lp_content, e);
            }
            if (di_parser_finished(c->parser) && ev->finish == DI_FINISH_NONE &&
                !c->parser_cancelled) {
                // a stop string or the end of the DSML block: nothing more will be used
                c->parser_cancelled = true;
                if (c->submitted) di_engine_cancel(s->engine, c->eid);
            }
        }
    }
    if (ev->finish != DI_FINISH_NONE) {
        c->efinish = ev->finish;
        c->estatus = ev->status;
        c->n_cached = ev->n_cached;
        c->n_replayed = ev->n_replayed;
        di_parser_finish r =
            ev->finish == DI_FINISH_LENGTH ? DI_PARSER_FINISH_LENGTH : DI_PARSER_FINISH_STOP;
        c->pfinish = di_parser_end(c->parser, r);
        c->ended = true;
        if (ev->finish == DI_FINISH_ERROR) g->failed = true;
        if (g->stream && g->ops->stream_choice_end) g->ops->stream_choice_end(g, c);
    }
}

void srv_gen_replay(srv_gen *g, const srv_tok_ev *ev) {
    handle(g, ev);
}

void srv_gen_replay_text(srv_gen *g, int choice, const char *text, size_t n) {
    srv_choice *c = &g->ch[choice];
    if (!c->ended && !di_parser_finished(c->parser)) di_parser_feed(c->parser, text, n);
}

static bool all_ended(const srv_gen *g) {
    for (int i = 0; i < g->n; i++)
        if (!g->ch[i].ended) return false;
    return true;
}

bool srv_gen_pump(srv_gen *g, int wait_ms) {
    srv_tok_ev ev;
    bool any = srv_queue_pop(g, &ev, wait_ms);
    while (any) {
        handle(g, &ev);
        any = srv_queue_pop(g, &ev, 0);
    }
    if (!all_ended(g)) return false;
    if (g->stream && !g->out_done) {
        if (g->ops->stream_end) g->ops->stream_end(g);
        g->out_done = true;
    }
    return true;
}

void srv_gen_destroy(srv_gen *g) {
    if (!g) return;
    srv *s = g->s;
    int n_sub = 0;
    for (int i = 0; i < g->n; i++) {
        if (!g->ch[i].submitted) continue;
        n_sub++;
        if (!g->ch[i].ended) di_engine_cancel(s->engine, g->ch[i].eid);
    }
    // the engine calls back into g until each request's final event: wait for all of them
    srv_queue_wait_finals(g, n_sub);
    if (n_sub) {
        int64_t gen = 0, cached = 0;
        bool cancelled = false;
        for (int i = 0; i < g->n; i++) {
            gen += g->ch[i].n_gen;
            cached += g->ch[i].n_cached;
            if (g->ch[i].efinish == DI_FINISH_CANCELLED && !g->ch[i].parser_cancelled)
                cancelled = true;
        }
        double now = srv_now();
        double ttft = g->t_first > 0 ? g->t_first - g->t_start : 0;
        double dec = g->t_first > 0 && now > g->t_first ? now - g->t_first : 0;
        double tps = dec > 0 && gen > 1 ? (double)(gen - g->n) / dec : 0;
        pthread_mutex_lock(&s->metrics_mu);
        s->n_prompt_tokens += g->n_prompt * (uint64_t)g->n;
        s->n_gen_tokens += (uint64_t)gen;
        s->n_cached_tokens += (uint64_t)cached;
        if (g->t_first > 0) srv_metrics_observe(&s->ttft, ttft);
        srv_metrics_observe(&s->e2e, now - g->t_start);
        if (g->failed || cancelled)
            s->n_requests_err++;
        else
            s->n_requests_ok++;
        pthread_mutex_unlock(&s->metrics_mu);
        fprintf(stderr,
                "INFO  request %s: prompt %zu tokens (cached %lld), generated %lld tokens, "
                "TTFT %.1f ms, %.1f tokens/s, %s%s\n",
                g->id, g->n_prompt, (long long)cached, (long long)gen, ttft * 1e3, tps,
                g->failed   ? "failed"
                : cancelled ? "cancelled"
                            : "finished",
                g->client_gone ? " (client disconnected)" : "");
    }
    for (int i = 0; i < SRV_MAX_N; i++) {
        srv_choice *c = &g->ch[i];
        di_parser_destroy(c->parser);
        sb_free(&c->reasoning);
        sb_free(&c->content);
        for (int k = 0; k < c->n_calls; k++) {
            sb_free(&c->calls[k].name);
            sb_free(&c->calls[k].args);
        }
        free(c->calls);
        json_decref(c->lp_content);
        json_decref(c->lp_reasoning);
        json_decref(c->aborted_item);
    }
    sb_free(&g->out);
    di_tok_free(g->prompt);
    json_decref(g->req);
    srv_queue_deinit(g);
    di_grammar_destroy(g->grammar);
    free(g->bias);
    free(g);
}

enum MHD_Result srv_run_count(srv *s, struct MHD_Connection *c, srv_gen *g) {
    const json_int_t n = (json_int_t)g->n_prompt;
    const bool responses = g->api == SRV_API_RESPONSES;
    srv_gen_destroy(g);
    atomic_fetch_sub(&s->inflight, 1);
    srv_metrics_status(s, 200);
    json_t *o = responses
                    ? json_pack("{s:s,s:I}", "object", "response.input_tokens", "input_tokens", n)
                    : json_pack("{s:I}", "input_tokens", n);
    return srv_send_json(c, 200, o, 0);
}
