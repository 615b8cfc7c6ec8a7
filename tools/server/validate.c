// validate — request checks shared by the APIs (spec §4.3 order: types → ranges → model →
// render → length) and the rendering of a validated request into prompt ids.
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "server/server.h"

// A JSON number (integer or real) as double; false if v is not a number.
static bool num(const json_t *v, double *out) {
    if (json_is_integer(v)) {
        *out = (double)json_integer_value(v);
        return true;
    }
    if (json_is_real(v)) {
        *out = json_real_value(v);
        return true;
    }
    return false;
}

// Optional number field in [lo, hi] (open ends when lo_open/hi_open). 400 on a wrong type,
// 422 on a value out of range (spec §4.2).
static bool opt_num(const json_t *req, const char *key, double lo, double hi, bool lo_open,
                    double *out, bool *present, srv_err *e) {
    const json_t *v = json_object_get(req, key);
    if (present) *present = false;
    if (!v || json_is_null(v)) return true;
    double x;
    if (!num(v, &x) || isnan(x)) {
        srv_err_set(e, 400, key, "'%s' must be a number.", key);
        return false;
    }
    if ((lo_open ? x <= lo : x < lo) || x > hi) {
        srv_err_set(e, 422, key, "'%s' must be %s %g and <= %g; got %g.", key,
                    lo_open ? ">" : ">=", lo, hi, x);
        return false;
    }
    *out = x;
    if (present) *present = true;
    return true;
}

static bool opt_int(const json_t *req, const char *key, long long lo, long long hi, long long *out,
                    bool *present, srv_err *e) {
    const json_t *v = json_object_get(req, key);
    if (present) *present = false;
    if (!v || json_is_null(v)) return true;
    if (!json_is_integer(v)) {
        srv_err_set(e, 400, key, "'%s' must be an integer.", key);
        return false;
    }
    long long x = json_integer_value(v);
    if (x < lo || x > hi) {
        srv_err_set(e, 422, key, "'%s' must be between %lld and %lld; got %lld.", key, lo, hi, x);
        return false;
    }
    *out = x;
    if (present) *present = true;
    return true;
}

static bool opt_bool(const json_t *req, const char *key, bool *out, srv_err *e) {
    const json_t *v = json_object_get(req, key);
    if (!v || json_is_null(v)) return true;
    if (!json_is_boolean(v)) {
        srv_err_set(e, 400, key, "'%s' must be a boolean.", key);
        return false;
    }
    *out = json_is_true(v);
    return true;
}

bool srv_check_model(srv *s, const json_t *req, bool required, srv_err *e) {
    (void)s;
    const json_t *m = json_object_get(req, "model");
    if (!m || json_is_null(m)) {
        if (!required) return true;
        srv_err_set(e, 400, "model", "'model' is required.");
        return false;
    }
    if (!json_is_string(m)) {
        srv_err_set(e, 400, "model", "'model' must be a string.");
        return false;
    }
    return true; // looked up after the range checks (spec §4.3 order), see srv_lookup_model
}

bool srv_lookup_model(srv *s, const json_t *req, srv_api api, srv_err *e);
bool srv_lookup_model(srv *s, const json_t *req, srv_api api, srv_err *e) {
    const char *m = json_string_value(json_object_get(req, "model"));
    if (!m || !strcmp(m, s->cfg.model_name)) return true;
    // Anthropic clients send claude-* names; the hosted API routes them to its model (§2.4)
    if (api == SRV_API_MESSAGES && !strncmp(m, "claude", 6)) return true;
    srv_err_set(e, 404, "model", "The model '%s' does not exist. This server serves '%s'.", m,
                s->cfg.model_name);
    return false;
}

// OpenAI logit_bias: {"<token id>": bias in [-100, 100], ...}, ids of the model's vocabulary,
// at most SRV_MAX_LOGIT_BIAS entries; added to the logits before sampling (greedy included).
static bool check_logit_bias(srv_gen *g, const json_t *lb, srv_err *e) {
    if (!lb || json_is_null(lb)) return true;
    if (!json_is_object(lb)) {
        srv_err_set(e, 400, "logit_bias",
                    "'logit_bias' must be an object mapping token ids to "
                    "numbers.");
        return false;
    }
    const size_t n = json_object_size(lb);
    if (n == 0) return true;
    if (n > SRV_MAX_LOGIT_BIAS) {
        srv_err_set(e, 422, "logit_bias", "'logit_bias' takes at most %d tokens, got %zu.",
                    SRV_MAX_LOGIT_BIAS, n);
        return false;
    }
    g->bias = malloc(sizeof *g->bias * n);
    if (!g->bias) {
        srv_err_set(e, 503, NULL, "The server is out of memory; retry later.");
        return false;
    }
    const char *key;
    const json_t *v;
    int32_t k = 0;
    json_object_foreach((json_t *)lb, key, v) {
        char *end = NULL;
        errno = 0;
        long long id = strtoll(key, &end, 10);
        if (!key[0] || *end || !(key[0] >= '0' && key[0] <= '9')) {
            srv_err_set(e, 400, "logit_bias", "'logit_bias' key '%.64s' is not a token id.", key);
            return false;
        }
        if (errno || id >= g->s->n_vocab) {
            srv_err_set(e, 422, "logit_bias",
                        "'logit_bias' key '%.64s' is not a token id of this model (0 .. %d).", key,
                        g->s->n_vocab - 1);
            return false;
        }
        if (!json_is_number(v)) {
            srv_err_set(e, 400, "logit_bias", "'logit_bias' value of token %lld must be a number.",
                        id);
            return false;
        }
        if (!(json_number_value(v) >= -100 && json_number_value(v) <= 100)) {
            srv_err_set(e, 422, "logit_bias",
                        "'logit_bias' value of token %lld must be in [-100, 100].", id);
            return false;
        }
        g->bias[k].token = (int32_t)id;
        g->bias[k].bias = (float)json_number_value(v);
        k++;
    }
    g->sp.logit_bias = g->bias;
    g->sp.n_logit_bias = k;
    return true;
}

// The user id (Chat / Completions / Responses `user_id`, else `user`; Messages
// `metadata.user_id`): a string of at most SRV_MAX_USER_ID bytes. Its hash is the request's tenant
// (di_request_params.tenant: the scheduler shares slots fairly between users) and, under
// --cache-isolation user, its prefix-cache namespace (di_request_params.cache_salt). No id: the
// anonymous user (0).
static bool check_user(srv_gen *g, const json_t *req, srv_api api, srv_err *e) {
    const char *param = "user_id";
    const json_t *u = NULL;
    if (api == SRV_API_MESSAGES) {
        const json_t *md = json_object_get(req, "metadata");
        if (md && !json_is_null(md) && !json_is_object(md)) {
            srv_err_set(e, 400, "metadata", "'metadata' must be an object.");
            return false;
        }
        u = json_object_get(md, "user_id");
        param = "metadata.user_id";
    } else {
        u = json_object_get(req, "user_id");
        if (!u || json_is_null(u)) {
            u = json_object_get(req, "user");
            param = "user";
        }
    }
    if (!u || json_is_null(u)) return true;
    if (!json_is_string(u) || json_string_length(u) > SRV_MAX_USER_ID) {
        srv_err_set(e, 400, param, "'%s' must be a string of at most %d bytes.", param,
                    SRV_MAX_USER_ID);
        return false;
    }
    uint64_t h = 0xcbf29ce484222325ull; // FNV-1a 64 of "user:" and the id
    const char *id = json_string_value(u);
    const size_t n = json_string_length(u);
    for (size_t i = 0; i < 5 + n; i++)
        h = (h ^ (unsigned char)(i < 5 ? "user:"[i] : id[i - 5])) * 0x100000001b3ull;
    if (!h) h = 1; // 0 is the anonymous user
    g->tenant = h; // fair share between users (the engine's scheduler)
    if (g->s->cfg.cache_isolation_user) g->cache_salt = h;
    return true;
}

bool srv_check_sampling(srv_gen *g, const json_t *req, srv_api api, srv_err *e) {
    double x;
    bool have;
    long long k;
    if (!opt_bool(req, "stream", &g->stream, e)) return false;
    double tmax = api == SRV_API_MESSAGES ? 1.0 : 2.0;
    if (!opt_num(req, "temperature", 0, tmax, false, &x, &have, e)) return false;
    if (have) g->sp.temperature = (float)x;
    if (!opt_num(req, "top_p", 0, 1, true, &x, &have, e)) return false;
    if (have) g->sp.top_p = (float)x;
    if (!opt_int(req, "top_k", -1, 1 << 20, &k, &have, e)) return false;
    if (have) g->sp.top_k = k < 0 ? 0 : (int32_t)k;
    if (!opt_num(req, "min_p", 0, 1, false, &x, &have, e)) return false;
    if (have) g->sp.min_p = (float)x;
    if (api == SRV_API_CHAT || api == SRV_API_COMPLETIONS) {
        if (!opt_num(req, "presence_penalty", -2, 2, false, &x, &have, e)) return false;
        if (have) g->sp.presence_penalty = (float)x;
        if (!opt_num(req, "frequency_penalty", -2, 2, false, &x, &have, e)) return false;
        if (have) g->sp.frequency_penalty = (float)x;
        if (!opt_num(req, "repetition_penalty", 0, 10, true, &x, &have, e)) return false;
        if (have) g->sp.repetition_penalty = (float)x;
        if (!opt_int(req, "seed", INT64_MIN, INT64_MAX, &k, &have, e)) return false;
        if (have) g->sp.seed = (uint64_t)k;
        if (!opt_int(req, "n", 1, SRV_MAX_N, &k, &have, e)) return false;
        if (have) g->n = (int)k;
        if (!check_logit_bias(g, json_object_get(req, "logit_bias"), e)) return false;
    }
    if (!check_user(g, req, api, e)) return false;
    // deepinfer extension (vLLM's name and convention): lower runs first, default 0
    if (!opt_int(req, "priority", DI_PRIORITY_MIN, DI_PRIORITY_MAX, &k, &have, e)) return false;
    if (have) g->priority = (int32_t)k;
    // stop strings: Chat/Completions "stop", Messages "stop_sequences"
    const char *skey = api == SRV_API_MESSAGES ? "stop_sequences" : "stop";
    const json_t *stop = api == SRV_API_RESPONSES ? NULL : json_object_get(req, skey);
    if (stop && !json_is_null(stop)) {
        if (json_is_string(stop) && api != SRV_API_MESSAGES) {
            g->stop[g->n_stop++] = json_string_value(stop);
        } else if (json_is_array(stop)) {
            if (json_array_size(stop) > DI_MAX_STOP) {
                srv_err_set(e, 422, skey, "'%s' takes at most %d strings.", skey, DI_MAX_STOP);
                return false;
            }
            size_t i;
            json_t *v;
            json_array_foreach(stop, i, v) {
                if (!json_is_string(v)) {
                    srv_err_set(e, 400, skey, "'%s' must hold strings.", skey);
                    return false;
                }
                g->stop[g->n_stop++] = json_string_value(v);
            }
        } else {
            srv_err_set(e, 400, skey, "'%s' must be %s.", skey,
                        api == SRV_API_MESSAGES ? "an array of strings"
                                                : "a string or an array of strings");
            return false;
        }
        for (int i = 0; i < g->n_stop; i++) {
            size_t n = strlen(g->stop[i]);
            if (n == 0 || n > 256) {
                srv_err_set(e, 422, skey, "Stop sequences must be 1 to 256 bytes long.");
                return false;
            }
        }
    }
    // logprobs (Chat; Completions takes an integer)
    if (api == SRV_API_CHAT) {
        bool lp = false;
        if (!opt_bool(req, "logprobs", &lp, e)) return false;
        if (!opt_int(req, "top_logprobs", 0, DI_MAX_LOGPROBS, &k, &have, e)) return false;
        if (have && !lp) {
            srv_err_set(e, 400, "top_logprobs", "'top_logprobs' requires 'logprobs' to be true.");
            return false;
        }
        if (lp) g->top_logprobs = have ? (int)k : 0;
    } else if (api == SRV_API_COMPLETIONS) {
        if (!opt_int(req, "logprobs", 0, 5, &k, &have, e)) return false;
        if (have) g->top_logprobs = (int)k;
    }
    const json_t *so = json_object_get(req, "stream_options");
    if (so && !json_is_null(so)) {
        if (!json_is_object(so)) {
            srv_err_set(e, 400, "stream_options", "'stream_options' must be an object.");
            return false;
        }
        if (!opt_bool(so, "include_usage", &g->include_usage, e)) return false;
    }
    return true;
}

static bool name_ok(const char *s) {
    size_t n = strlen(s);
    if (n < 1 || n > 64) return false;
    for (size_t i = 0; i < n; i++) {
        char c = s[i];
        if (!((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
              c == '_' || c == '-'))
            return false;
    }
    return true;
}

bool srv_check_tools(const json_t *tools, srv_api api, srv_err *e) {
    if (!tools || json_is_null(tools)) return true;
    if (!json_is_array(tools)) {
        srv_err_set(e, 400, "tools", "'tools' must be an array.");
        return false;
    }
    if (json_array_size(tools) > 128) {
        srv_err_set(e, 400, "tools", "At most 128 tools are supported.");
        return false;
    }
    size_t i;
    json_t *t;
    json_array_foreach(tools, i, t) {
        if (!json_is_object(t)) {
            srv_err_set(e, 400, "tools", "tools[%zu] must be an object.", i);
            return false;
        }
        const char *type = json_string_value(json_object_get(t, "type"));
        const json_t *fn = t, *params = NULL;
        const char *pkey = "parameters";
        if (api == SRV_API_CHAT) {
            if (!type || strcmp(type, "function")) {
                srv_err_set(e, 400, "tools", "tools[%zu].type must be 'function'.", i);
                return false;
            }
            fn = json_object_get(t, "function");
            if (!json_is_object(fn)) {
                srv_err_set(e, 400, "tools", "tools[%zu].function must be an object.", i);
                return false;
            }
        } else if (api == SRV_API_RESPONSES) {
            if (!type) {
                srv_err_set(e, 400, "tools", "tools[%zu].type is required.", i);
                return false;
            }
            if (strcmp(type, "function")) continue; // server tools are ignored (§2.3)
        } else {                                    // Messages
            pkey = "input_schema";
            if (type && strcmp(type, "custom") && !json_object_get(t, "input_schema")) {
                srv_err_set(e, 400, "tools", "Server tools are not supported");
                return false;
            }
        }
        const char *name = json_string_value(json_object_get(fn, "name"));
        if (!name || !name_ok(name)) {
            srv_err_set(e, 400, "tools", "tools[%zu]: the name must match ^[A-Za-z0-9_-]{1,64}$.",
                        i);
            return false;
        }
        params = json_object_get(fn, pkey);
        if (api == SRV_API_MESSAGES && !params) {
            srv_err_set(e, 400, "tools", "tools[%zu].input_schema is required.", i);
            return false;
        }
        if (params && !json_is_null(params)) {
            const json_t *pt = json_object_get(params, "type");
            if (!json_is_object(params) || (pt && !json_is_string(pt))) {
                srv_err_set(e, 400, "tools", "tools[%zu].%s must be a JSON Schema object.", i,
                            pkey);
                return false;
            }
        }
    }
    return true;
}

// The parser's start stage from the end of the rendered prompt: whatever the renderer decided
// about thinking mode and forced tool calls, the parser continues from there.
static di_parser_stage stage_of(const char *text, size_t n, bool *thinking) {
    static const char k_think[] = "<think>", k_dsml_open[] = "tool_calls>\n",
                      k_dsml41[] = " calls>\n";
    size_t lt = sizeof k_think - 1, ld = sizeof k_dsml_open - 1, l41 = sizeof k_dsml41 - 1;
    *thinking = n >= lt && !memcmp(text + n - lt, k_think, lt);
    if ((n >= ld && !memcmp(text + n - ld, k_dsml_open, ld)) ||
        (n >= l41 && !memcmp(text + n - l41, k_dsml41, l41)))
        return DI_PARSER_STAGE_TOOL_CALLS;
    return *thinking ? DI_PARSER_STAGE_REASONING : DI_PARSER_STAGE_CONTENT;
}

// The name of tool i of a request's tools (NULL when it has none): Chat nests it in "function".
static const char *tool_name(const json_t *t, srv_api api) {
    return json_string_value(
        json_object_get(api == SRV_API_CHAT ? json_object_get(t, "function") : t, "name"));
}

bool srv_check_tool_choice(srv_gen *g, const json_t *tools, const json_t *tc, srv_api api,
                           srv_err *e) {
    const bool has_tools = json_array_size(tools) > 0;
    g->tools = has_tools;
    g->tool_forced = false;
    g->tool_name = NULL;
    g->tool_parallel = true;
    const char *pkey =
        api == SRV_API_MESSAGES ? "tool_choice.disable_parallel_tool_use" : "parallel_tool_calls";
    const json_t *par = api == SRV_API_MESSAGES ? json_object_get(tc, "disable_parallel_tool_use")
                                                : json_object_get(g->req, "parallel_tool_calls");
    if (par && !json_is_null(par)) {
        if (!json_is_boolean(par)) {
            srv_err_set(e, 400, pkey, "'%s' must be a boolean.", pkey);
            return false;
        }
        g->tool_parallel = api == SRV_API_MESSAGES ? json_is_false(par) : json_is_true(par);
    }
    if (!tc || json_is_null(tc)) return true;
    // Each API's spelling of the four choices (serving spec §2.2, §3, §4).
    const char *mode = NULL, *name = NULL;
    if (api == SRV_API_MESSAGES) {
        mode = json_string_value(json_object_get(tc, "type"));
        if (!mode || (strcmp(mode, "auto") && strcmp(mode, "any") && strcmp(mode, "tool") &&
                      strcmp(mode, "none"))) {
            srv_err_set(e, 400, "tool_choice", "tool_choice.type: must be auto, any, tool or none");
            return false;
        }
        if (!strcmp(mode, "tool") && !(name = json_string_value(json_object_get(tc, "name")))) {
            srv_err_set(e, 400, "tool_choice", "tool_choice.name is required for type 'tool'.");
            return false;
        }
    } else if (json_is_string(tc)) {
        mode = json_string_value(tc);
        if (strcmp(mode, "none") && strcmp(mode, "auto") && strcmp(mode, "required")) {
            srv_err_set(e, 422, "tool_choice",
                        "'tool_choice' must be none, auto, required or a function.");
            return false;
        }
    } else if (json_is_object(tc)) {
        const char *type = json_string_value(json_object_get(tc, "type"));
        if (!type || strcmp(type, "function")) {
            srv_err_set(e, 400, "tool_choice", "tool_choice.type must be 'function'.");
            return false;
        }
        mode = "function";
        name = json_string_value(
            json_object_get(api == SRV_API_CHAT ? json_object_get(tc, "function") : tc, "name"));
        if (!name) {
            srv_err_set(e, 400, "tool_choice", "'%s' is required.",
                        api == SRV_API_CHAT ? "tool_choice.function.name" : "tool_choice.name");
            return false;
        }
    } else {
        srv_err_set(e, 400, "tool_choice", "'tool_choice' must be a string or an object.");
        return false;
    }
    if (!strcmp(mode, "none")) {
        g->tools = false;
        return true;
    }
    if (!strcmp(mode, "auto")) return true;
    if (!has_tools) { // required / any / a named tool
        srv_err_set(e, 400, "tool_choice", "tool_choice '%s' needs 'tools'.", name ? name : mode);
        return false;
    }
    if (name) {
        size_t i;
        json_t *t;
        bool found = false;
        json_array_foreach(tools, i, t) {
            const char *n = tool_name(t, api);
            if (n && !strcmp(n, name)) found = true;
        }
        if (!found) {
            srv_err_set(e, 400, "tool_choice", "tool_choice names '%s', which is not in 'tools'.",
                        name);
            return false;
        }
    }
    g->tool_forced = true; // required / any / a named tool
    g->tool_name = name;
    return true;
}

bool srv_render(srv_gen *g, di_render_api rapi, srv_err *e) {
    char *body = json_dumps(g->req, JSON_COMPACT);
    if (!body) {
        srv_err_set(e, 503, NULL, "Out of memory.");
        return false;
    }
    char *text = NULL;
    size_t n_text = 0;
    di_render_options o = di_render_options_default();
    o.encoding = g->s->encoding;
    di_render_points pts;
    di_status st = di_render_request_points(g->s->tok, body, strlen(body), rapi, &o, &text, &n_text,
                                            &g->prompt, &g->n_prompt, &pts);
    free(body);
    if (st == DI_ERR_UNSUPPORTED) { // the server's tokenizer, not the request (docs/server.md)
        srv_err_set(e, 500, NULL,
                    "The served model's tokenizer lacks a special token of the DeepSeek %s "
                    "prompt format: the model directory needs its own tokenizer.json.",
                    g->s->encoding ? "V4.1" : "V4");
        return false;
    }
    if (st != DI_OK) {
        // the renderer logs the field; its message is not available through the public API
        srv_err_set(e, 400, "messages",
                    "The conversation cannot be rendered as a DeepSeek %s prompt (%s): check "
                    "roles, message order, tool calls and reasoning effort.",
                    g->s->encoding ? "V4.1" : "V4", di_status_str(st));
        return false;
    }
    // the prompt's tail state at these points is kept (docs/kv-cache.md, "Snapshot points")
    memcpy(g->snap_at, pts.at, sizeof g->snap_at);
    g->n_snap_at = pts.n;
    bool thinking;
    g->stage = stage_of(text, n_text, &thinking);
    if (pts.ends_in_reasoning && g->stage != DI_PARSER_STAGE_TOOL_CALLS) {
        g->stage = DI_PARSER_STAGE_REASONING; // also a prefix completion's open reasoning
        thinking = true;
    }
    g->thinking = thinking || g->stage == DI_PARSER_STAGE_TOOL_CALLS;
    di_tok_free(text);
    for (int i = 0; i < SRV_MAX_N; i++)
        g->ch[i].section = g->stage == DI_PARSER_STAGE_REASONING ? 0 : 1;
    return true;
}

bool srv_check_length(srv_gen *g, srv_err *e) {
    int64_t C = g->s->n_ctx, P = (int64_t)g->n_prompt;
    if (g->max_tokens <= 0) { // default: what fits (spec default 8192/65536, capped by context)
        int64_t def = g->thinking ? 65536 : 8192;
        int64_t room = C - P;
        g->max_tokens = (int32_t)(room < def ? room : def);
        if (g->max_tokens < 1) g->max_tokens = 1;
        if (P + 1 > C) goto overflow;
        return true;
    }
    if (P + g->max_tokens <= C) return true;
overflow:
    srv_err_set(e, 400, "messages",
                "This model's maximum context length is %lld tokens. However, you requested "
                "%lld tokens (%lld in the messages, %lld in the completion). Please reduce the "
                "length of the messages or completion.",
                (long long)C, (long long)(P + (g->max_tokens > 0 ? g->max_tokens : 1)),
                (long long)P, (long long)(g->max_tokens > 0 ? g->max_tokens : 1));
    return false;
}
