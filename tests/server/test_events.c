// Tests for the server's API event generators (tools/server/api_*.c via gen.c) on a fixed model
// output: reasoning, content and two DSML tool calls, which the random-weight test model never
// produces. The output is replayed (srv_gen_replay, no engine) token by token, in odd byte splits
// that cut UTF-8 characters and DSML labels, and truncated inside a call; each API's SSE stream
// (Chat, Responses, Messages) and non-streaming body must be exactly the expected events/JSON.
// Tool calls stream incrementally (spec §2.6): begin at the name's end, then argument pieces; a
// call cut off by max_tokens is closed properly in the stream and dropped from the body (§1.11).
// Streams are compared after merging consecutive text deltas of the same field (their split
// follows the input split); ids, timestamps and sequence numbers are normalised.
#include "harness.h"

#include <stdlib.h>

#include "server/server.h"

static srv g_srv;

#define D "｜DSML｜"
static const char k_out[] =
    "Check the \"weather\" — 天气.</think>\n\nLooking it up.\n\n<" D "tool_calls>\n<" D
    "invoke name=\"get_weather\">\n<" D "parameter name=\"city\" string=\"true\">Paris \"FR\"</" D
    "parameter>\n<" D "parameter name=\"days\" string=\"false\">3</" D "parameter>\n</" D
    "invoke>\n<" D "invoke name=\"now\">\n</" D "invoke>\n</" D "tool_calls>";
// cut inside the first call's "days" value: that call is incomplete
static const char k_cut_at[] = "3</";

enum mode { TOKENS, SPLITS, TRUNCATED, TRUNCATED_SPLITS };

typedef struct run {
    char *sse;    // stream text (stream runs)
    json_t *body; // non-stream body
    int raw_records;
} run;

static void replace_all(sb *b, const char *from, const char *to) {
    sb o = {0};
    size_t nf = strlen(from);
    for (size_t i = 0; i < b->n;) {
        if (nf && i + nf <= b->n && !memcmp(b->p + i, from, nf)) {
            sb_adds(&o, to);
            i += nf;
        } else {
            sb_add(&o, b->p + i, 1);
            i++;
        }
    }
    sb_free(b);
    *b = o;
}

// Replays k_out (or its truncated prefix) through a generation of api; returns the SSE text or
// the body, with the tool-call ids replaced by CALL0/CALL1.
static run replay(srv_api api, bool stream, enum mode mode) {
    static const srv_api_ops *const ops[] = {&srv_chat_ops, NULL, &srv_responses_ops,
                                             &srv_messages_ops};
    run r = {0};
    atomic_store(&g_srv.next_id, 0);
    json_t *req = json_pack("{s:s}", "model", "m");
    srv_gen *g = srv_gen_create(&g_srv, api, req);
    json_decref(req);
    g->ops = ops[api];
    g->stream = stream;
    g->thinking = true;
    g->tools = true;
    g->stage = DI_PARSER_STAGE_REASONING;
    g->created = 1;
    snprintf(g->id, sizeof g->id, "%s",
             api == SRV_API_CHAT        ? "chatcmpl-ID"
             : api == SRV_API_RESPONSES ? "resp_ID"
                                        : "msg_ID");
    srv_err e;
    CHECK(srv_gen_init_parsers(g, &e));
    if (stream && g->ops->stream_begin) g->ops->stream_begin(g);
    size_t n = sizeof k_out - 1;
    bool truncated = mode == TRUNCATED || mode == TRUNCATED_SPLITS;
    if (truncated) n = (size_t)(strstr(k_out, k_cut_at) - k_out) + 1;
    srv_tok_ev ev = {.choice = 0, .token = -1, .finish = DI_FINISH_NONE};
    if (mode == SPLITS || mode == TRUNCATED_SPLITS) {
        static const size_t k_sizes[] = {1, 2, 3, 5, 7, 11, 4};
        for (size_t i = 0, k = 0; i < n; k++) {
            size_t m = k_sizes[k % 7] < n - i ? k_sizes[k % 7] : n - i;
            srv_gen_replay_text(g, 0, k_out + i, m);
            i += m;
        }
    } else {
        int32_t *ids = NULL;
        size_t n_ids = 0;
        CHECK(di_tokenizer_encode(g_srv.tok, k_out, n, false, &ids, &n_ids) == DI_OK);
        CHECK(n_ids > 20);
        for (size_t i = 0; i < n_ids; i++) {
            ev.token = ids[i];
            srv_gen_replay(g, &ev);
        }
        di_tok_free(ids);
    }
    // the engine's last event: EOS after a complete block, max_tokens inside the truncated call
    ev.token = -1;
    ev.finish = truncated ? DI_FINISH_LENGTH : DI_FINISH_STOP;
    srv_gen_replay(g, &ev);
    CHECK(srv_gen_pump(g, 0));
    char ids[2][40];
    srv tmp = {.started_at = g_srv.started_at};
    for (int i = 0; i < 2; i++) srv_make_id(&tmp, g->ops->call_prefix, ids[i], sizeof ids[i]);
    sb out = {0};
    if (stream) {
        sb_add(&out, g->out.p ? g->out.p : "", g->out.n);
    } else {
        json_t *b = g->ops->body(g);
        sb_add_json(&out, b);
        json_decref(b);
    }
    replace_all(&out, ids[0], "CALL0");
    replace_all(&out, ids[1], "CALL1");
    if (stream) {
        r.sse = out.p ? out.p : strdup("");
    } else {
        r.body = json_loads(out.p, 0, NULL);
        sb_free(&out);
        json_object_del(r.body, "usage"); // counts differ between token and byte replays
    }
    srv_gen_destroy(g);
    return r;
}

// ---- SSE normalisation: records → merged, one compact line each ----

static json_t *text_field(json_t *data, const char **key_out, char *merge_key, size_t cap) {
    // Chat chunk: a delta with only text (or only arguments of one call)
    json_t *ch = json_array_get(json_object_get(data, "choices"), 0);
    json_t *d = json_object_get(ch, "delta");
    if (d && json_is_null(json_object_get(ch, "finish_reason"))) {
        json_t *tc = json_object_get(d, "tool_calls");
        if (json_is_string(json_object_get(d, "reasoning_content")) &&
            !json_object_get(d, "role")) {
            *key_out = "reasoning_content";
            snprintf(merge_key, cap, "chat.reasoning");
            return d;
        }
        if (json_is_string(json_object_get(d, "content")) && !json_object_get(d, "role")) {
            *key_out = "content";
            snprintf(merge_key, cap, "chat.content");
            return d;
        }
        json_t *c0 = json_array_get(tc, 0);
        if (c0 && !json_object_get(c0, "id")) {
            *key_out = "arguments";
            snprintf(merge_key, cap, "chat.args.%lld",
                     (long long)json_integer_value(json_object_get(c0, "index")));
            return json_object_get(c0, "function");
        }
        return NULL;
    }
    const char *type = json_string_value(json_object_get(data, "type"));
    if (!type) return NULL;
    if (strstr(type, ".delta") && strncmp(type, "response.", 9) == 0) { // Responses
        *key_out = "delta";
        snprintf(merge_key, cap, "%s.%s", type,
                 json_string_value(json_object_get(data, "item_id")));
        return data;
    }
    if (!strcmp(type, "content_block_delta")) { // Messages
        json_t *dd = json_object_get(data, "delta");
        const char *dt = json_string_value(json_object_get(dd, "type"));
        *key_out = !strcmp(dt, "thinking_delta")     ? "thinking"
                   : !strcmp(dt, "text_delta")       ? "text"
                   : !strcmp(dt, "input_json_delta") ? "partial_json"
                                                     : NULL;
        if (!*key_out) return NULL;
        snprintf(merge_key, cap, "%s.%lld", dt,
                 (long long)json_integer_value(json_object_get(data, "index")));
        return dd;
    }
    return NULL;
}

static int g_args_raw; // tool-argument delta records of the last normalised stream, unmerged

// Returns the normalised stream; *n_raw = records before merging. Checks the SSE framing.
static char *normalise(const char *sse, int *n_raw) {
    g_args_raw = 0;
    sb out = {0};
    json_t *prev = NULL, *prev_holder = NULL;
    const char *prev_key = NULL;
    char prev_merge[160] = "";
    char prev_event[64] = "";
    long long seq = 0;
    *n_raw = 0;
    sb lines = {0};
    for (const char *p = sse; *p;) {
        const char *end = strstr(p, "\n\n");
        CHECK(end != NULL); // every record ends with a blank line
        if (!end) break;
        char event[64] = "";
        const char *data = p;
        if (!strncmp(p, "event: ", 7)) {
            const char *nl = strchr(p, '\n');
            snprintf(event, sizeof event, "%.*s", (int)(nl - p - 7), p + 7);
            data = nl + 1;
        }
        CHECK(!strncmp(data, "data: ", 6));
        data += 6;
        (*n_raw)++;
        json_t *j = NULL;
        if (strncmp(data, "[DONE]", 6) != 0) {
            j = json_loadb(data, (size_t)(end - data), 0, NULL);
            CHECK(j != NULL);
        }
        if (j) { // token counts differ between token and byte replays
            json_object_del(j, "usage");
            json_object_del(json_object_get(j, "response"), "usage");
            json_object_del(json_object_get(j, "message"), "usage");
        }
        if (j && json_object_get(j, "sequence_number")) { // Responses: 0, 1, 2, …
            CHECK_EQ(json_integer_value(json_object_get(j, "sequence_number")), seq);
            seq++;
            json_object_del(j, "sequence_number");
        }
        if (j && event[0]) // Messages and Responses: the event name is the payload's type
            CHECK_STR_EQ(json_string_value(json_object_get(j, "type")), event);
        const char *key = NULL;
        char merge[160] = "";
        json_t *holder = j ? text_field(j, &key, merge, sizeof merge) : NULL;
        if (holder && (!strncmp(merge, "chat.args.", 10) ||
                       !strncmp(merge, "response.function_call_arguments.delta", 38) ||
                       !strncmp(merge, "input_json_delta", 16)))
            g_args_raw++;
        if (holder && prev && !strcmp(merge, prev_merge) && !strcmp(event, prev_event)) {
            const char *a = json_string_value(json_object_get(prev_holder, prev_key));
            const char *b = json_string_value(json_object_get(holder, key));
            json_object_set_new(prev_holder, prev_key, json_sprintf("%s%s", a, b));
            json_decref(j);
        } else {
            if (prev) {
                sb_adds(&lines, prev_event[0] ? prev_event : "-");
                sb_adds(&lines, " ");
                sb_add_json(&lines, prev);
                sb_adds(&lines, "\n");
                json_decref(prev);
                prev = NULL;
            }
            if (j) {
                prev = j;
                prev_holder = holder;
                prev_key = key;
                snprintf(prev_merge, sizeof prev_merge, "%s", holder ? merge : "");
                snprintf(prev_event, sizeof prev_event, "%s", event);
            } else {
                sb_adds(&lines, "[DONE]\n");
            }
        }
        p = end + 2;
    }
    if (prev) {
        sb_adds(&lines, prev_event[0] ? prev_event : "-");
        sb_adds(&lines, " ");
        sb_add_json(&lines, prev);
        sb_adds(&lines, "\n");
        json_decref(prev);
    }
    sb_free(&out);
    return lines.p ? lines.p : strdup("");
}

// ---- expected output: tests/server/events/<api>_<case>.txt (reviewed against serving.md §2) ----

static char *golden(const char *name) {
    char path[256];
    snprintf(path, sizeof path, "tests/server/events/%s.txt", name);
    FILE *f = fopen(path, "rb");
    CHECK(f != NULL);
    if (!f) return strdup("");
    sb b = {0};
    char buf[4096];
    size_t n;
    while ((n = fread(buf, 1, sizeof buf, f)) > 0) sb_add(&b, buf, n);
    fclose(f);
    return b.p ? b.p : strdup("");
}

static void dump_sorted(sb *b, const char *s) { // re-dump each line with sorted keys
    for (const char *p = s; *p;) {
        const char *nl = strchr(p, '\n');
        const char *sp = memchr(p, ' ', (size_t)(nl - p));
        if (!sp) {
            sb_add(b, p, (size_t)(nl - p + 1));
        } else {
            sb_add(b, p, (size_t)(sp - p + 1));
            json_t *j = json_loadb(sp + 1, (size_t)(nl - sp - 1), 0, NULL);
            char *t = json_dumps(j, JSON_COMPACT | JSON_SORT_KEYS);
            sb_adds(b, t);
            sb_adds(b, "\n");
            free(t);
            json_decref(j);
        }
        p = nl + 1;
    }
}

static char *stream_lines(srv_api api, enum mode mode, int *n_raw) {
    run r = replay(api, true, mode);
    char *norm = normalise(r.sse, n_raw);
    free(r.sse);
    sb b = {0};
    dump_sorted(&b, norm);
    free(norm);
    return b.p ? b.p : strdup("");
}

static const char *const k_api_names[] = {"chat", "", "responses", "messages"};

static void check_golden(const char *got, const char *name) {
    if (getenv("DI_PRINT_EVENTS")) printf("== %s\n%s", name, got); // to review a change
    char *want = golden(name);
    CHECK_STR_EQ(got, want);
    free(want);
}

// Stream: token by token and in odd splits give the same merged events, which are the golden ones.
static void check_stream(srv_api api) {
    char name[64];
    snprintf(name, sizeof name, "%s_stream", k_api_names[api]);
    int raw_tok = 0, raw_split = 0;
    char *tok = stream_lines(api, TOKENS, &raw_tok);
    int args_tok = g_args_raw; // stream_lines(TOKENS) set it
    char *split = stream_lines(api, SPLITS, &raw_split);
    check_golden(tok, name);
    CHECK(args_tok > 8); // tool arguments really were streamed in pieces (spec §2.6)
    CHECK_STR_EQ(split, tok);
    int merged = 0;
    for (const char *p = tok; *p; p++) merged += *p == '\n';
    CHECK(raw_tok > merged + 5); // reasoning and content really were streamed incrementally
    free(tok);
    free(split);
}

// Truncated inside the first call (finish length): the call was begun and partly streamed, so it
// is closed properly (Chat: finish "length"; Responses: item done "incomplete", response
// incomplete; Messages: content_block_stop, stop_reason max_tokens); no DSML ever leaks; token and
// byte-split replays agree.
static void check_truncated(srv_api api) {
    char name[64];
    snprintf(name, sizeof name, "%s_truncated", k_api_names[api]);
    int raw = 0, raw_split = 0;
    char *tok = stream_lines(api, TRUNCATED, &raw);
    int args_tok = g_args_raw;
    char *split = stream_lines(api, TRUNCATED_SPLITS, &raw_split);
    check_golden(tok, name);
    CHECK_STR_EQ(split, tok);
    CHECK(strstr(tok, "get_weather") != NULL); // begun at the name's end
    CHECK(args_tok > 4);                       // and its arguments streamed as they came
    CHECK(strstr(tok, "DSML") == NULL && strstr(tok, "invoke") == NULL &&
          strstr(tok, "parameter") == NULL);
    free(tok);
    free(split);
    // the non-streaming object drops the incomplete call (spec §1.11) and says it was cut off
    run nb = replay(api, false, TRUNCATED);
    char *body = json_dumps(nb.body, JSON_COMPACT);
    CHECK(body && strstr(body, "get_weather") == NULL && strstr(body, "DSML") == NULL);
    CHECK(body &&
          strstr(body, api == SRV_API_CHAT        ? "\"finish_reason\":\"length\""
                       : api == SRV_API_RESPONSES ? "\"status\":\"incomplete\""
                                                  : "\"stop_reason\":\"max_tokens\"") != NULL);
    free(body);
    json_decref(nb.body);
}

static void check_body(srv_api api) {
    char name[64];
    snprintf(name, sizeof name, "%s_body", k_api_names[api]);
    run a = replay(api, false, TOKENS), b = replay(api, false, SPLITS);
    char *ta = json_dumps(a.body, JSON_COMPACT | JSON_SORT_KEYS);
    char *tb = json_dumps(b.body, JSON_COMPACT | JSON_SORT_KEYS);
    sb line = {0};
    sb_adds(&line, ta);
    sb_adds(&line, "\n");
    check_golden(line.p, name);
    CHECK_STR_EQ(tb, ta);
    sb_free(&line);
    free(ta);
    free(tb);
    json_decref(a.body);
    json_decref(b.body);
}

static void test_chat(void) {
    check_stream(SRV_API_CHAT);
    check_truncated(SRV_API_CHAT);
    check_body(SRV_API_CHAT);
}

static void test_responses(void) {
    check_stream(SRV_API_RESPONSES);
    check_truncated(SRV_API_RESPONSES);
    check_body(SRV_API_RESPONSES);
}

static void test_messages(void) {
    check_stream(SRV_API_MESSAGES);
    check_truncated(SRV_API_MESSAGES);
    check_body(SRV_API_MESSAGES);
}

// The API keys' comparison (srv_secret_equal, http.c): equal only when every byte and the length
// are, whichever byte differs and whichever string is longer.
static void test_secret_equal(void) {
    CHECK(srv_secret_equal("sk-abc", "sk-abc"));
    CHECK(!srv_secret_equal("sk-abd", "sk-abc"));
    CHECK(!srv_secret_equal("xk-abc", "sk-abc"));
    CHECK(!srv_secret_equal("sk-ab", "sk-abc"));
    CHECK(!srv_secret_equal("sk-abcsk-abc", "sk-abc")); // the key twice: its cycle, longer
    CHECK(!srv_secret_equal("", "sk-abc"));
    CHECK(!srv_secret_equal("a", ""));
    CHECK(srv_secret_equal("", ""));
    CHECK(!srv_secret_equal(NULL, "sk-abc"));
    CHECK(!srv_secret_equal("sk-abc", NULL));
}

int main(void) {
    RUN(test_secret_equal);
    if (di_tokenizer_load_for_model(NULL, &g_srv.tok) != DI_OK) return 1;
    g_srv.cfg.model_name = "m";
    pthread_mutex_init(&g_srv.metrics_mu, NULL);
    RUN(test_chat);
    RUN(test_responses);
    RUN(test_messages);
    di_tokenizer_destroy(g_srv.tok);
    return test_finish();
}
