// api_responses — OpenAI Responses, stateless (spec serving.md §2.3): validation, the response
// object and the response.created … response.completed event sequence with sequence numbers.
// Output items in generation order: reasoning, message (omitted when empty), function calls.
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "server/server.h"

bool srv_lookup_model(srv *s, const json_t *req, srv_api api, srv_err *e);

enum { IT_NONE = 0, IT_REASONING, IT_MESSAGE, IT_CALL };

static const char *const k_efforts[] = {"none", "minimal", "low", "medium",
                                        "high", "xhigh",   "max", "ultra"};

static bool check(const json_t *req, srv_gen *g, srv_err *e) {
    const json_t *in = json_object_get(req, "input");
    if (!in) {
        srv_err_set(e, 400, "input", "'input' is required.");
        return false;
    }
    if (!json_is_string(in) && !json_is_array(in)) {
        srv_err_set(e, 400, "input", "'input' must be a string or an array of items.");
        return false;
    }
    size_t i;
    json_t *it;
    json_array_foreach(json_is_array(in) ? in : NULL, i, it) {
        if (!json_is_object(it)) {
            srv_err_set(e, 400, "input", "input[%zu] must be an object.", i);
            return false;
        }
        const char *t = json_string_value(json_object_get(it, "type"));
        const char *role = json_string_value(json_object_get(it, "role"));
        if ((!t || !strcmp(t, "message"))) {
            if (!role || (strcmp(role, "user") && strcmp(role, "assistant") &&
                          strcmp(role, "system") && strcmp(role, "developer"))) {
                srv_err_set(e, 400, "input",
                            "input[%zu].role must be user, assistant, system or developer.", i);
                return false;
            }
            const json_t *c = json_object_get(it, "content");
            if (!json_is_string(c) && !json_is_array(c)) {
                srv_err_set(e, 400, "input", "input[%zu].content must be a string or an array.", i);
                return false;
            }
        } else if (!strcmp(t, "function_call")) {
            if (!json_is_string(json_object_get(it, "name")) ||
                !json_is_string(json_object_get(it, "arguments")) ||
                !json_is_string(json_object_get(it, "call_id"))) {
                srv_err_set(e, 400, "input",
                            "input[%zu]: function_call needs string call_id, name and arguments.",
                            i);
                return false;
            }
        } else if (!strcmp(t, "function_call_output")) {
            if (!json_is_string(json_object_get(it, "call_id"))) {
                srv_err_set(e, 400, "input", "input[%zu].call_id must be a string.", i);
                return false;
            }
        } else if (strcmp(t, "reasoning")) {
            srv_err_set(e, 400, "input", "input[%zu].type '%s' is not supported.", i, t);
            return false;
        }
    }
    const json_t *prev = json_object_get(req, "previous_response_id");
    if ((prev && !json_is_null(prev)) || (json_object_get(req, "conversation") &&
                                          !json_is_null(json_object_get(req, "conversation")))) {
        srv_err_set(e, 400, "previous_response_id", "previous_response_id is not supported");
        return false;
    }
    const json_t *ins = json_object_get(req, "instructions");
    if (ins && !json_is_null(ins) && !json_is_string(ins)) {
        srv_err_set(e, 400, "instructions", "'instructions' must be a string.");
        return false;
    }
    const json_t *mo = json_object_get(req, "max_output_tokens");
    if (mo && !json_is_null(mo)) {
        if (!json_is_integer(mo)) {
            srv_err_set(e, 400, "max_output_tokens", "'max_output_tokens' must be an integer.");
            return false;
        }
        if (json_integer_value(mo) < 1 || json_integer_value(mo) > 393216) {
            srv_err_set(e, 422, "max_output_tokens",
                        "'max_output_tokens' must be between 1 and 393216.");
            return false;
        }
        g->max_tokens = (int32_t)json_integer_value(mo);
    }
    const json_t *eff = json_object_get(json_object_get(req, "reasoning"), "effort");
    if (eff && !json_is_null(eff)) {
        bool ok = false;
        for (size_t k = 0; json_is_string(eff) && k < 8; k++)
            if (!strcmp(json_string_value(eff), k_efforts[k])) ok = true;
        if (!ok) {
            srv_err_set(e, 422, "reasoning.effort", "Invalid reasoning effort: %s",
                        json_is_string(eff) ? json_string_value(eff) : "(not a string)");
            return false;
        }
    }
    const json_t *fmt = json_object_get(json_object_get(req, "text"), "format");
    if (!srv_gen_response_format(g, fmt, "text.format", e)) return false;
    const json_t *tools = json_object_get(req, "tools");
    if (!srv_check_tools(tools, SRV_API_RESPONSES, e)) return false;
    return srv_check_tool_choice(g, tools, json_object_get(req, "tool_choice"), SRV_API_RESPONSES,
                                 e);
}

bool srv_responses_prepare(srv *s, json_t *req, srv_gen **out, srv_err *e) {
    srv_gen *g = srv_gen_create(s, SRV_API_RESPONSES, req);
    if (!g) {
        srv_err_set(e, 503, NULL, "Out of memory.");
        return false;
    }
    g->ops = &srv_responses_ops;
    srv_make_id(s, "resp_", g->id, sizeof g->id);
    // input_tokens (a probe) counts without a model, as the hosted endpoint does
    if (!srv_check_model(s, req, !g->probe_only, e) || !check(req, g, e) ||
        !srv_check_sampling(g, req, SRV_API_RESPONSES, e) ||
        !srv_lookup_model(s, req, SRV_API_RESPONSES, e) ||
        !srv_render(g, DI_RENDER_API_RESPONSES, e) || !srv_check_length(g, e) ||
        !srv_gen_start(g, e)) {
        srv_gen_destroy(g);
        return false;
    }
    *out = g;
    return true;
}

// ---- response object ----

// Item ids derive from the response id so they are stable between the stream and the object.
static void item_id(const srv_gen *g, const char *prefix, int k, char *out, size_t cap) {
    snprintf(out, cap, "%s%s_%d", prefix, g->id + 5, k);
}

static json_t *reasoning_item(const srv_gen *g, const srv_choice *c) {
    char id[96];
    item_id(g, "rs_", 0, id, sizeof id);
    return json_pack("{s:s,s:s,s:[],s:[{s:s,s:o}]}", "type", "reasoning", "id", id, "summary",
                     "content", "type", "reasoning_text", "text",
                     json_stringn_lossy(c->reasoning.p, c->reasoning.n));
}

static json_t *message_item(const srv_gen *g, const srv_choice *c, const char *status) {
    char id[96];
    item_id(g, "msg_", 0, id, sizeof id);
    return json_pack("{s:s,s:s,s:s,s:s,s:[{s:s,s:o,s:[]}]}", "type", "message", "id", id, "role",
                     "assistant", "status", status, "content", "type", "output_text", "text",
                     json_stringn_lossy(c->content.p, c->content.n), "annotations");
}

static json_t *call_item(const srv_gen *g, const srv_call *k, int idx, const char *status) {
    char id[96];
    item_id(g, "fc_", idx, id, sizeof id);
    return json_pack("{s:s,s:s,s:s,s:o,s:o,s:s}", "type", "function_call", "id", id, "call_id",
                     k->id, "name", json_stringn_lossy(k->name.p, k->name.n), "arguments",
                     json_stringn_lossy(k->args.p, k->args.n), "status", status);
}

static json_t *response_obj(srv_gen *g, const char *status, bool final) {
    const srv_choice *c = &g->ch[0];
    json_t *output = json_array();
    json_t *usage = json_null(), *incomplete = json_null();
    if (final) {
        if (g->thinking) json_array_append_new(output, reasoning_item(g, c));
        if (c->content.n || (!c->n_calls && !c->aborted_item))
            json_array_append_new(output, message_item(g, c, "completed"));
        for (int k = 0; k < c->n_calls; k++)
            json_array_append_new(output, call_item(g, &c->calls[k], k, "completed"));
        // streaming only: the call cut off by max_output_tokens was already announced, so the
        // terminal object lists it as streamed (status "incomplete"); the body drops it (§1.11)
        if (c->aborted_item) json_array_append(output, c->aborted_item);
        int64_t P = (int64_t)g->n_prompt;
        usage = json_pack("{s:I,s:{s:I,s:I},s:I,s:{s:I},s:I}", "input_tokens", (json_int_t)P,
                          "input_tokens_details", "cached_tokens", (json_int_t)c->n_cached,
                          "replayed_tokens", (json_int_t)c->n_replayed, "output_tokens",
                          (json_int_t)c->n_gen, "output_tokens_details", "reasoning_tokens",
                          (json_int_t)c->n_reasoning_tokens, "total_tokens",
                          (json_int_t)(P + c->n_gen));
        if (!strcmp(status, "incomplete"))
            incomplete = json_pack("{s:s}", "reason", "max_output_tokens");
    }
    const json_t *req = g->req;
    json_t *tools = json_object_get(req, "tools");
    json_t *tc = json_object_get(req, "tool_choice");
    json_t *eff = json_object_get(json_object_get(req, "reasoning"), "effort");
    json_t *r = json_pack(
        "{s:s,s:s,s:I,s:s,s:s,s:o,s:o,s:o,s:n,s:b,s:o,s:o,s:f,s:f,s:o,s:{s:o},s:{s:{s:s}}}", "id",
        g->id, "object", "response", "created_at", (json_int_t)g->created, "status", status,
        "model", g->s->cfg.model_name, "output", output, "usage", usage, "incomplete_details",
        incomplete, "error", "parallel_tool_calls", (int)g->tool_parallel, "tool_choice",
        tc ? json_incref(tc) : json_string("auto"), "tools",
        json_is_array(tools) ? json_incref(tools) : json_array(), "temperature",
        (double)g->sp.temperature, "top_p", (double)g->sp.top_p, "max_output_tokens",
        g->max_tokens > 0 ? json_integer(g->max_tokens) : json_null(), "reasoning", "effort",
        eff ? json_incref(eff) : json_string(g->thinking ? "high" : "none"), "text", "format",
        "type", "text");
    const json_t *fmt = json_object_get(json_object_get(g->req, "text"), "format");
    if (r && json_is_object(fmt)) // echo the requested format, as the hosted API does
        json_object_set_new(r, "text", json_pack("{s:O}", "format", fmt));
    return r;
}

static const char *final_status(const srv_gen *g) {
    if (g->failed) return "failed";
    return g->ch[0].pfinish == DI_PARSER_FINISH_LENGTH ? "incomplete" : "completed";
}

static json_t *resp_body(srv_gen *g) {
    return response_obj(g, final_status(g), true);
}

// ---- streaming ----

static void ev(srv_gen *g, const char *type, json_t *data) { // steals data
    json_object_set_new(data, "type", json_string(type));
    json_object_set_new(data, "sequence_number", json_integer(g->seq++));
    sb_addf(&g->out, "event: %s\ndata: ", type);
    sb_add_json(&g->out, data);
    sb_adds(&g->out, "\n\n");
    json_decref(data);
}

static void close_item(srv_gen *g, srv_choice *c) {
    int oi = c->blk_index;
    char id[96];
    if (c->blk_kind == IT_REASONING) {
        item_id(g, "rs_", 0, id, sizeof id);
        json_t *text = json_stringn_lossy(c->reasoning.p, c->reasoning.n);
        ev(g, "response.reasoning_text.done",
           json_pack("{s:s,s:i,s:i,s:O}", "item_id", id, "output_index", oi, "content_index", 0,
                     "text", text));
        ev(g, "response.content_part.done",
           json_pack("{s:s,s:i,s:i,s:{s:s,s:O}}", "item_id", id, "output_index", oi,
                     "content_index", 0, "part", "type", "reasoning_text", "text", text));
        json_decref(text);
        ev(g, "response.output_item.done",
           json_pack("{s:i,s:o}", "output_index", oi, "item", reasoning_item(g, c)));
    } else if (c->blk_kind == IT_MESSAGE) {
        item_id(g, "msg_", 0, id, sizeof id);
        json_t *text = json_stringn_lossy(c->content.p, c->content.n);
        ev(g, "response.output_text.done",
           json_pack("{s:s,s:i,s:i,s:O}", "item_id", id, "output_index", oi, "content_index", 0,
                     "text", text));
        ev(g, "response.content_part.done",
           json_pack("{s:s,s:i,s:i,s:{s:s,s:O,s:[]}}", "item_id", id, "output_index", oi,
                     "content_index", 0, "part", "type", "output_text", "text", text,
                     "annotations"));
        json_decref(text);
        ev(g, "response.output_item.done",
           json_pack("{s:i,s:o}", "output_index", oi, "item", message_item(g, c, "completed")));
    } else if (c->blk_kind == IT_CALL) {
        int k = c->n_calls - 1;
        const srv_call *call = &c->calls[k];
        item_id(g, "fc_", k, id, sizeof id);
        ev(g, "response.function_call_arguments.done",
           json_pack("{s:s,s:i,s:o,s:o}", "item_id", id, "output_index", oi, "name",
                     json_stringn_lossy(call->name.p, call->name.n), "arguments",
                     json_stringn_lossy(call->args.p, call->args.n)));
        ev(g, "response.output_item.done",
           json_pack("{s:i,s:o}", "output_index", oi, "item", call_item(g, call, k, "completed")));
    }
    c->blk_kind = IT_NONE;
}

static void open_item(srv_gen *g, srv_choice *c, int kind) {
    close_item(g, c);
    c->blk_kind = kind;
    c->blk_index = c->n_blocks++;
    int oi = c->blk_index;
    char id[96];
    if (kind == IT_REASONING) {
        item_id(g, "rs_", 0, id, sizeof id);
        ev(g, "response.output_item.added",
           json_pack("{s:i,s:{s:s,s:s,s:[],s:[]}}", "output_index", oi, "item", "type", "reasoning",
                     "id", id, "summary", "content"));
        ev(g, "response.content_part.added",
           json_pack("{s:s,s:i,s:i,s:{s:s,s:s}}", "item_id", id, "output_index", oi,
                     "content_index", 0, "part", "type", "reasoning_text", "text", ""));
    } else if (kind == IT_MESSAGE) {
        item_id(g, "msg_", 0, id, sizeof id);
        ev(g, "response.output_item.added",
           json_pack("{s:i,s:{s:s,s:s,s:s,s:s,s:[]}}", "output_index", oi, "item", "type",
                     "message", "id", id, "role", "assistant", "status", "in_progress", "content"));
        ev(g, "response.content_part.added",
           json_pack("{s:s,s:i,s:i,s:{s:s,s:s,s:[]}}", "item_id", id, "output_index", oi,
                     "content_index", 0, "part", "type", "output_text", "text", "", "annotations"));
    } else {
        int k = c->n_calls - 1;
        json_t *item = call_item(g, &c->calls[k], k, "in_progress");
        json_object_set_new(item, "arguments", json_string(""));
        ev(g, "response.output_item.added",
           json_pack("{s:i,s:o}", "output_index", oi, "item", item));
    }
}

static void resp_begin(srv_gen *g) {
    ev(g, "response.created",
       json_pack("{s:o}", "response", response_obj(g, "in_progress", false)));
    ev(g, "response.in_progress",
       json_pack("{s:o}", "response", response_obj(g, "in_progress", false)));
    if (g->thinking) open_item(g, &g->ch[0], IT_REASONING);
}

static void resp_event(srv_gen *g, srv_choice *c, const di_parser_event *e) {
    char id[96];
    switch (e->kind) {
    case DI_PARSER_EVENT_REASONING:
        if (c->blk_kind != IT_REASONING) return;
        item_id(g, "rs_", 0, id, sizeof id);
        ev(g, "response.reasoning_text.delta",
           json_pack("{s:s,s:i,s:i,s:o}", "item_id", id, "output_index", c->blk_index,
                     "content_index", 0, "delta", json_stringn_lossy(e->text, e->len)));
        return;
    case DI_PARSER_EVENT_CONTENT:
        if (!e->len) return;
        if (c->blk_kind != IT_MESSAGE) open_item(g, c, IT_MESSAGE);
        item_id(g, "msg_", 0, id, sizeof id);
        ev(g, "response.output_text.delta",
           json_pack("{s:s,s:i,s:i,s:o,s:[]}", "item_id", id, "output_index", c->blk_index,
                     "content_index", 0, "delta", json_stringn_lossy(e->text, e->len), "logprobs"));
        return;
    case DI_PARSER_EVENT_TOOL_NAME_END:
        open_item(g, c, IT_CALL);
        return; // spec §2.6
    case DI_PARSER_EVENT_ARGS_DELTA:
        if (c->blk_kind != IT_CALL || !e->len) return;
        item_id(g, "fc_", c->n_calls - 1, id, sizeof id);
        ev(g, "response.function_call_arguments.delta",
           json_pack("{s:s,s:i,s:o}", "item_id", id, "output_index", c->blk_index, "delta",
                     json_stringn_lossy(e->text, e->len)));
        return;
    case DI_PARSER_EVENT_TOOL_CALL_END:
        close_item(g, c);
        return;
    case DI_PARSER_EVENT_TOOL_CALL_ABORT: {
        // truncated inside a call (max_output_tokens, spec §1.11): the open item is finished
        // with status "incomplete" (arguments as streamed, no .done since they are not); the
        // response then ends with response.incomplete
        if (c->blk_kind != IT_CALL) return; // cut before the name ended: nothing was sent
        int k = c->n_calls - 1;
        c->aborted_item = call_item(g, &c->calls[k], k, "incomplete");
        ev(g, "response.output_item.done",
           json_pack("{s:i,s:O}", "output_index", c->blk_index, "item", c->aborted_item));
        c->blk_kind = IT_NONE;
        return;
    }
    default:
        return;
    }
}

static void resp_choice_end(srv_gen *g, srv_choice *c) {
    close_item(g, c);
    if (!c->content.n && !c->n_calls && !c->aborted_item && c->efinish != DI_FINISH_ERROR) {
        open_item(g, c, IT_MESSAGE); // the object always has a message when there are no calls
        close_item(g, c);
    }
}

static void resp_end(srv_gen *g) {
    const char *st = final_status(g);
    if (g->failed) {
        json_t *r = response_obj(g, "failed", true);
        json_object_set_new(r, "error",
                            json_pack("{s:s,s:s}", "code", "server_error", "message",
                                      "Generation failed in the engine."));
        ev(g, "response.failed", json_pack("{s:o}", "response", r));
        return;
    }
    char type[64];
    snprintf(type, sizeof type, "response.%s", st);
    ev(g, type, json_pack("{s:o}", "response", response_obj(g, st, true)));
}

static void resp_error(srv_gen *g, const srv_err *e) {
    ev(g, "error",
       json_pack("{s:s,s:s,s:s?}", "code", e->code ? e->code : e->type, "message", e->msg, "param",
                 e->param));
}

const srv_api_ops srv_responses_ops = {resp_begin, resp_event, resp_choice_end,    resp_end,
                                       resp_error, resp_body,  ": keep-alive\n\n", "call_"};
