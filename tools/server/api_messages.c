// api_messages — Anthropic Messages (spec serving.md §2.4): validation, the message body and the
// message_start … message_stop event sequence. Exactly one content block is open at a time; a
// block is closed before the next opens; thinking blocks only in thinking mode; no empty text
// blocks. anthropic-version / anthropic-beta headers are accepted and ignored (§2.1).
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "server/server.h"

bool srv_lookup_model(srv *s, const json_t *req, srv_api api, srv_err *e);

enum { BLK_NONE = 0, BLK_THINKING, BLK_TEXT, BLK_TOOL };

// Prompt caching breakpoints (docs/server.md, "Prompt caching"): cache_control on system blocks,
// tool definitions and message content blocks (and the blocks of a tool result) is
// {"type": "ephemeral"} with an optional "ttl" of "5m" or "1h"; at most SRV_MAX_CACHE_CONTROL in a
// request, as Anthropic's API. Each marked block's end becomes a snapshot point (tok/request.c).
enum { SRV_MAX_CACHE_CONTROL = 4 };

static bool check_cc(const json_t *b, const char *where, size_t i, size_t k, int *n, srv_err *e) {
    const json_t *cc = json_object_get(b, "cache_control");
    if (!cc || json_is_null(cc)) return true;
    char at[64];
    if (k == (size_t)-1)
        snprintf(at, sizeof at, "%s.%zu", where, i);
    else
        snprintf(at, sizeof at, "%s.%zu.content.%zu", where, i, k);
    const char *type = json_string_value(json_object_get(cc, "type"));
    if (!json_is_object(cc) || !type || strcmp(type, "ephemeral")) {
        srv_err_set(e, 400, "cache_control", "%s.cache_control.type: Input should be 'ephemeral'",
                    at);
        return false;
    }
    const json_t *ttl = json_object_get(cc, "ttl");
    const char *t = json_string_value(ttl);
    if (ttl && !json_is_null(ttl) && (!t || (strcmp(t, "5m") && strcmp(t, "1h")))) {
        srv_err_set(e, 400, "cache_control", "%s.cache_control.ttl: Input should be '5m' or '1h'",
                    at);
        return false;
    }
    (*n)++;
    return true;
}

static bool check_cache_control(const json_t *req, srv_err *e) {
    int n = 0;
    size_t i, k, j;
    json_t *m, *b, *x;
    const json_t *sys = json_object_get(req, "system");
    json_array_foreach(json_is_array(sys) ? sys : NULL, i, b) {
        if (!check_cc(b, "system", i, (size_t)-1, &n, e)) return false;
    }
    const json_t *tools = json_object_get(req, "tools");
    json_array_foreach(json_is_array(tools) ? tools : NULL, i, b) {
        if (!check_cc(b, "tools", i, (size_t)-1, &n, e)) return false;
    }
    json_array_foreach(json_object_get(req, "messages"), i, m) {
        const json_t *c = json_object_get(m, "content");
        json_array_foreach(json_is_array(c) ? c : NULL, k, b) {
            if (!check_cc(b, "messages", i, k, &n, e)) return false;
            const json_t *tc = json_object_get(b, "content"); // a tool result's blocks
            json_array_foreach(json_is_array(tc) ? tc : NULL, j, x) {
                if (!check_cc(x, "messages", i, k, &n, e)) return false;
            }
        }
    }
    if (n > SRV_MAX_CACHE_CONTROL) {
        srv_err_set(e, 400, "cache_control",
                    "A maximum of %d blocks with cache_control may be provided. Found %d.",
                    SRV_MAX_CACHE_CONTROL, n);
        return false;
    }
    return true;
}

static bool check(const json_t *req, srv_gen *g, srv_err *e) {
    const json_t *mt = json_object_get(req, "max_tokens");
    if (!mt && g->probe_only) { // count_tokens (and a KV probe): nothing is generated
        g->max_tokens = 1;
    } else if (!mt) {
        srv_err_set(e, 400, "max_tokens", "max_tokens: Field required");
        return false;
    } else if (!json_is_integer(mt)) {
        srv_err_set(e, 400, "max_tokens", "max_tokens: Input should be a valid integer");
        return false;
    } else if (json_integer_value(mt) < 1 || json_integer_value(mt) > 393216) {
        srv_err_set(e, 400, "max_tokens", "max_tokens: must be between 1 and 393216");
        return false;
    } else {
        g->max_tokens = (int32_t)json_integer_value(mt);
    }
    const json_t *msgs = json_object_get(req, "messages");
    if (!json_is_array(msgs) || !json_array_size(msgs)) {
        srv_err_set(e, 400, "messages", "messages: Field required (a non-empty array)");
        return false;
    }
    size_t i, k;
    json_t *m, *b;
    json_array_foreach(msgs, i, m) {
        const char *role = json_string_value(json_object_get(m, "role"));
        if (!role || (strcmp(role, "user") && strcmp(role, "assistant"))) {
            srv_err_set(e, 400, "messages", "messages.%zu.role: must be 'user' or 'assistant'", i);
            return false;
        }
        const json_t *c = json_object_get(m, "content");
        if (!json_is_string(c) && !json_is_array(c)) {
            srv_err_set(e, 400, "messages",
                        "messages.%zu.content: must be a string or a list of blocks", i);
            return false;
        }
        json_array_foreach(json_is_array(c) ? c : NULL, k, b) {
            const char *t = json_string_value(json_object_get(b, "type"));
            if (!t) {
                srv_err_set(e, 400, "messages", "messages.%zu.content.%zu.type: Field required", i,
                            k);
                return false;
            }
            if (!strcmp(t, "text") && !json_is_string(json_object_get(b, "text"))) {
                srv_err_set(e, 400, "messages", "messages.%zu.content.%zu.text: must be a string",
                            i, k);
                return false;
            }
            if (!strcmp(t, "image")) {
                srv_err_set(e, 400, "messages", "This model does not accept images.");
                return false;
            }
            if (!strcmp(t, "tool_use") && (!json_is_string(json_object_get(b, "name")) ||
                                           !json_is_object(json_object_get(b, "input")))) {
                srv_err_set(
                    e, 400, "messages",
                    "messages.%zu.content.%zu: tool_use needs a string name and an object input", i,
                    k);
                return false;
            }
            if (!strcmp(t, "tool_result") && !json_is_string(json_object_get(b, "tool_use_id"))) {
                srv_err_set(e, 400, "messages",
                            "messages.%zu.content.%zu.tool_use_id: Field required", i, k);
                return false;
            }
        }
    }
    const json_t *sys = json_object_get(req, "system");
    if (sys && !json_is_null(sys) && !json_is_string(sys) && !json_is_array(sys)) {
        srv_err_set(e, 400, "system", "system: must be a string or a list of text blocks");
        return false;
    }
    const json_t *th = json_object_get(req, "thinking");
    if (th && !json_is_null(th)) {
        const char *t = json_string_value(json_object_get(th, "type"));
        if (!t || (strcmp(t, "enabled") && strcmp(t, "disabled") && strcmp(t, "adaptive"))) {
            srv_err_set(e, 400, "thinking",
                        "thinking.type: must be 'enabled', 'disabled' or 'adaptive'");
            return false;
        }
    }
    if (!check_cache_control(req, e)) return false;
    const json_t *tools = json_object_get(req, "tools");
    if (!srv_check_tools(tools, SRV_API_MESSAGES, e)) return false;
    return srv_check_tool_choice(g, tools, json_object_get(req, "tool_choice"), SRV_API_MESSAGES,
                                 e);
}

bool srv_messages_prepare(srv *s, json_t *req, srv_gen **out, srv_err *e) {
    srv_gen *g = srv_gen_create(s, SRV_API_MESSAGES, req);
    if (!g) {
        srv_err_set(e, 503, NULL, "Out of memory.");
        return false;
    }
    g->ops = &srv_messages_ops;
    srv_make_id(s, "msg_", g->id, sizeof g->id);
    g->include_usage = true;
    if (!srv_check_model(s, req, true, e) || !check(req, g, e) ||
        !srv_check_sampling(g, req, SRV_API_MESSAGES, e) ||
        !srv_lookup_model(s, req, SRV_API_MESSAGES, e) ||
        !srv_render(g, DI_RENDER_API_MESSAGES, e) || !srv_check_length(g, e) ||
        !srv_gen_start(g, e)) {
        srv_gen_destroy(g);
        return false;
    }
    *out = g;
    return true;
}

static const char *stop_reason(const srv_choice *c) {
    switch (c->pfinish) {
    case DI_PARSER_FINISH_LENGTH:
        return "max_tokens";
    case DI_PARSER_FINISH_TOOL_CALLS:
        return "tool_use";
    case DI_PARSER_FINISH_STOP_SEQUENCE:
        return "stop_sequence";
    default:
        return "end_turn";
    }
}

// [design] §2.4: an opaque non-empty signature (FNV-1a of the reasoning, hex).
static void signature(const sb *r, char out[24]) {
    uint64_t h = 1469598103934665603ull;
    for (size_t i = 0; i < r->n; i++) h = (h ^ (unsigned char)r->p[i]) * 1099511628211ull;
    snprintf(out, 24, "sig%016llx", (unsigned long long)h);
}

static json_t *usage(const srv_gen *g, bool start) {
    const srv_choice *c = &g->ch[0];
    int64_t P = (int64_t)g->n_prompt;
    return json_pack("{s:I,s:I,s:I,s:I}", "input_tokens", (json_int_t)(P - c->n_cached),
                     "output_tokens", (json_int_t)(start ? 0 : c->n_gen), "cache_read_input_tokens",
                     (json_int_t)c->n_cached, "cache_creation_input_tokens", (json_int_t)0);
}

static json_t *stop_seq(const srv_choice *c) {
    const char *s =
        c->pfinish == DI_PARSER_FINISH_STOP_SEQUENCE ? di_parser_stop_string(c->parser) : NULL;
    return s ? json_string(s) : json_null();
}

static json_t *tool_input(const srv_call *k) {
    json_t *in = json_loadb(k->args.p ? k->args.p : "{}", k->args.n ? k->args.n : 2, 0, NULL);
    if (!json_is_object(in)) {
        json_decref(in);
        fprintf(stderr, "WARN  messages: tool arguments are not a JSON object; sending {}\n");
        in = json_object();
    }
    return in;
}

static json_t *msg_body(srv_gen *g) {
    srv_choice *c = &g->ch[0];
    json_t *content = json_array();
    if (g->thinking) {
        char sig[24];
        signature(&c->reasoning, sig);
        json_array_append_new(content, json_pack("{s:s,s:o,s:s}", "type", "thinking", "thinking",
                                                 json_stringn_lossy(c->reasoning.p, c->reasoning.n),
                                                 "signature", sig));
    }
    if (c->content.n)
        json_array_append_new(content, json_pack("{s:s,s:o}", "type", "text", "text",
                                                 json_stringn_lossy(c->content.p, c->content.n)));
    for (int k = 0; k < c->n_calls; k++)
        json_array_append_new(
            content, json_pack("{s:s,s:s,s:o,s:o}", "type", "tool_use", "id", c->calls[k].id,
                               "name", json_stringn_lossy(c->calls[k].name.p, c->calls[k].name.n),
                               "input", tool_input(&c->calls[k])));
    return json_pack("{s:s,s:s,s:s,s:s,s:o,s:s,s:o,s:o}", "id", g->id, "type", "message", "role",
                     "assistant", "model", g->s->cfg.model_name, "content", content, "stop_reason",
                     stop_reason(c), "stop_sequence", stop_seq(c), "usage", usage(g, false));
}

// ---- streaming ----

static void ev(srv_gen *g, const char *name, json_t *data) { // steals data
    sb_addf(&g->out, "event: %s\ndata: ", name);
    sb_add_json(&g->out, data);
    sb_adds(&g->out, "\n\n");
    json_decref(data);
}

static void close_block(srv_gen *g, srv_choice *c) {
    if (c->blk_kind == BLK_NONE) return;
    if (c->blk_kind == BLK_THINKING) {
        char sig[24];
        signature(&c->reasoning, sig);
        ev(g, "content_block_delta",
           json_pack("{s:s,s:i,s:{s:s,s:s}}", "type", "content_block_delta", "index", c->blk_index,
                     "delta", "type", "signature_delta", "signature", sig));
    }
    ev(g, "content_block_stop",
       json_pack("{s:s,s:i}", "type", "content_block_stop", "index", c->blk_index));
    c->blk_kind = BLK_NONE;
}

static void open_block(srv_gen *g, srv_choice *c, int kind, json_t *block) {
    close_block(g, c);
    c->blk_kind = kind;
    c->blk_index = c->n_blocks++;
    ev(g, "content_block_start",
       json_pack("{s:s,s:i,s:o}", "type", "content_block_start", "index", c->blk_index,
                 "content_block", block));
}

static void msg_begin(srv_gen *g) {
    ev(g, "message_start",
       json_pack("{s:s,s:{s:s,s:s,s:s,s:s,s:[],s:n,s:n,s:o}}", "type", "message_start", "message",
                 "id", g->id, "type", "message", "role", "assistant", "model", g->s->cfg.model_name,
                 "content", "stop_reason", "stop_sequence", "usage", usage(g, true)));
    if (g->thinking) {
        open_block(g, &g->ch[0], BLK_THINKING,
                   json_pack("{s:s,s:s,s:s}", "type", "thinking", "thinking", "", "signature", ""));
    }
    ev(g, "ping", json_pack("{s:s}", "type", "ping"));
}

static void msg_event(srv_gen *g, srv_choice *c, const di_parser_event *e) {
    json_t *d = NULL;
    switch (e->kind) {
    case DI_PARSER_EVENT_REASONING:
        if (c->blk_kind != BLK_THINKING) return; // thinking is only ever the first block
        d = json_pack("{s:s,s:o}", "type", "thinking_delta", "thinking",
                      json_stringn_lossy(e->text, e->len));
        break;
    case DI_PARSER_EVENT_CONTENT:
        if (!e->len) return;
        if (c->blk_kind != BLK_TEXT)
            open_block(g, c, BLK_TEXT, json_pack("{s:s,s:s}", "type", "text", "text", ""));
        d = json_pack("{s:s,s:o}", "type", "text_delta", "text",
                      json_stringn_lossy(e->text, e->len));
        break;
    case DI_PARSER_EVENT_TOOL_NAME_END: { // spec §2.4 / §2.6: the block starts at name end
        const srv_call *k = &c->calls[c->n_calls - 1];
        open_block(g, c, BLK_TOOL,
                   json_pack("{s:s,s:s,s:o,s:{}}", "type", "tool_use", "id", k->id, "name",
                             json_stringn_lossy(k->name.p, k->name.n), "input"));
        return;
    }
    case DI_PARSER_EVENT_ARGS_DELTA:
        if (c->blk_kind != BLK_TOOL || !e->len) return;
        d = json_pack("{s:s,s:o}", "type", "input_json_delta", "partial_json",
                      json_stringn_lossy(e->text, e->len));
        break;
    case DI_PARSER_EVENT_TOOL_CALL_END:
    case DI_PARSER_EVENT_TOOL_CALL_ABORT:
        // a call cut off by max_tokens (spec §1.11) is closed like a complete one: exactly one
        // content_block_stop per block; message_delta then says stop_reason "max_tokens"
        if (c->blk_kind == BLK_TOOL) close_block(g, c);
        return;
    default:
        return;
    }
    ev(g, "content_block_delta",
       json_pack("{s:s,s:i,s:o}", "type", "content_block_delta", "index", c->blk_index, "delta",
                 d));
}

static void msg_choice_end(srv_gen *g, srv_choice *c) {
    close_block(g, c);
    if (c->efinish == DI_FINISH_ERROR) {
        ev(g, "error",
           json_pack("{s:s,s:{s:s,s:s}}", "type", "error", "error", "type", "api_error", "message",
                     "Generation failed in the engine."));
        return;
    }
    ev(g, "message_delta",
       json_pack("{s:s,s:{s:s,s:o},s:{s:I}}", "type", "message_delta", "delta", "stop_reason",
                 stop_reason(c), "stop_sequence", stop_seq(c), "usage", "output_tokens",
                 (json_int_t)c->n_gen));
}

static void msg_end(srv_gen *g) {
    if (!g->failed) ev(g, "message_stop", json_pack("{s:s}", "type", "message_stop"));
}

static void msg_error(srv_gen *g, const srv_err *e) {
    ev(g, "error", srv_err_body(SRV_API_MESSAGES, e));
}

const srv_api_ops srv_messages_ops = {msg_begin,
                                      msg_event,
                                      msg_choice_end,
                                      msg_end,
                                      msg_error,
                                      msg_body,
                                      "event: ping\ndata: {\"type\": \"ping\"}\n\n",
                                      "toolu_"};
