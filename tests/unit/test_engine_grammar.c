// engine + grammar (structured output) on the tiny random-weight model with the real DeepSeek V4
// vocabulary: constrained requests with a JSON Schema produce text that parses (jansson) and
// satisfies the schema, greedy and seeded; the same tokens alone, batched with other requests and
// preempted (a tiny KV budget);
// grammar_after leaves the tokens up to the trigger unconstrained; a grammar that is done finishes
// the request with DI_FINISH_STOP; a matcher limit ends just that request with an error; the step
// path allocates nothing; a named tool_choice (tool grammar after the prefilled block header)
// gives a block that the output parser turns into one call whose arguments satisfy the schema;
// tool_choice auto (grammar_after = ｜DSML｜) constrains the text after that token to a block. The
// weights are random: the grammar is what makes the output valid.
#include "harness.h"

#include <jansson.h>
#include <stdatomic.h>
#include <unistd.h>

#include "engine/engine_internal.h" // di_engine_set_grammar_limits
#include "model/synth.h"

static char g_dir[256];
static di_tokenizer *g_tok;
static di_grammar_vocab *g_gv;

typedef struct result {
    int32_t tokens[512];
    int32_t n;
    char text[4096];
    size_t n_text;
    atomic_int finished;
    di_finish finish;
    di_status status;
} result;

static void on_event(void *user, const di_event *ev) {
    result *r = user;
    if (ev->token >= 0 && r->n < 512) {
        r->tokens[r->n++] = ev->token;
        size_t nb = 0;
        const char *b = di_tokenizer_token_bytes(g_tok, ev->token, &nb);
        if (b && !di_tokenizer_is_special(g_tok, ev->token) && r->n_text + nb < sizeof r->text) {
            memcpy(r->text + r->n_text, b, nb);
            r->n_text += nb;
        }
    }
    if (ev->finish != DI_FINISH_NONE) {
        r->finish = ev->finish;
        r->status = ev->status;
        atomic_fetch_add(&r->finished, 1);
    }
}

static const char *tok_bytes(void *user, int32_t id, size_t *n) {
    (void)user;
    return di_tokenizer_token_bytes(g_tok, id, n);
}

static di_engine *engine_kv_ctx(size_t kv_bytes, int32_t max_ctx) {
    di_engine_options o = di_engine_options_default();
    o.n_threads = 2;
    o.kv_memory_bytes = kv_bytes;
    o.max_seqs = 8;
    o.max_batch_tokens = 64;
    o.max_ctx = max_ctx;
    o.grammar_vocab = g_gv;
    o.token_bytes = tok_bytes;
    di_engine *e = NULL;
    CHECK_EQ(di_engine_create(g_dir, &o, &e), DI_OK);
    return e;
}

static di_engine *engine_kv(size_t kv_bytes) {
    return engine_kv_ctx(kv_bytes, 640);
}

static di_engine *engine(void) {
    return engine_kv(64u << 20);
}

static void check_clean(di_engine *e) {
    di_engine_stats st;
    di_engine_get_stats(e, &st);
    CHECK_EQ(st.n_step_allocs, 0);
    CHECK_EQ(st.n_blocks_free, st.n_blocks_total);
}

// Every string is bounded, so a random model must finish within max_tokens.
static const char *k_schema =
    "{\"type\":\"object\",\"properties\":{"
    "\"name\":{\"type\":\"string\",\"maxLength\":6},"
    "\"age\":{\"type\":\"integer\",\"minimum\":0,\"maximum\":120},"
    "\"ok\":{\"type\":\"boolean\"},"
    "\"color\":{\"enum\":[\"red\",\"green\",\"blue\"]},"
    "\"tags\":{\"type\":\"array\",\"items\":{\"type\":\"string\",\"maxLength\":3},\"maxItems\":2}},"
    "\"required\":[\"name\",\"age\",\"ok\"],\"additionalProperties\":false}";

// The document satisfies k_schema (checked by hand).
static bool valid_doc(const char *text, size_t n) {
    json_error_t je;
    json_t *d = json_loadb(text, n, 0, &je);
    if (!d) {
        fprintf(stderr, "not JSON (%s): %.*s\n", je.text, (int)n, text);
        return false;
    }
    bool ok = json_is_object(d);
    const json_t *name = json_object_get(d, "name"), *age = json_object_get(d, "age");
    const json_t *okv = json_object_get(d, "ok"), *color = json_object_get(d, "color");
    const json_t *tags = json_object_get(d, "tags");
    ok = ok && json_is_string(name) && json_is_integer(age) && json_is_boolean(okv);
    ok = ok && json_integer_value(age) >= 0 && json_integer_value(age) <= 120;
    if (ok && color)
        ok = json_is_string(color) && (!strcmp(json_string_value(color), "red") ||
                                       !strcmp(json_string_value(color), "green") ||
                                       !strcmp(json_string_value(color), "blue"));
    if (ok && tags) ok = json_is_array(tags) && json_array_size(tags) <= 2;
    const char *key;
    json_t *v;
    json_object_foreach(d, key, v) {
        if (strcmp(key, "name") && strcmp(key, "age") && strcmp(key, "ok") &&
            strcmp(key, "color") && strcmp(key, "tags"))
            ok = false;
    }
    if (!ok) fprintf(stderr, "does not satisfy the schema: %.*s\n", (int)n, text);
    json_decref(d);
    return ok;
}

static int32_t g_prompt[6][256];
static int g_long; // prompts of 200+ tokens (the preemption test)

static di_request_params request(int i, const di_grammar *g, result *res) {
    di_request_params p = di_request_params_default();
    for (int t = 0; t < 256; t++) g_prompt[i][t] = (int32_t)((t * 131 + i * 977 + 7) % 120000);
    p.prompt = g_prompt[i];
    p.n_prompt = g_long ? 200 + 10 * i : 10 + 5 * i;
    p.max_tokens = 400;
    p.grammar = g;
    if (i % 2) { // seeded sampling on odd requests
        p.sample.temperature = 0.9f;
        p.sample.top_p = 0.95f;
        p.sample.seed = 500 + (uint64_t)i;
    }
    p.on_event = on_event;
    p.user = res;
    return p;
}

static di_grammar *compile(di_grammar_kind kind, const char *text) {
    di_grammar *g = NULL;
    char err[256];
    CHECK_EQ(di_grammar_compile(kind, text, strlen(text), 0, &g, err, sizeof err), DI_OK);
    return g;
}

static result g_alone[6];

static void test_json_schema_alone_and_batched(void) {
    di_grammar *g = compile(DI_GRAMMAR_KIND_JSON_SCHEMA, k_schema);
    di_engine *e = engine();
    if (!g || !e) goto out;
    di_engine_set_masks_ahead(e, false);
    for (int i = 0; i < 4; i++) {
        uint64_t id;
        di_request_params p = request(i, g, &g_alone[i]);
        CHECK_EQ(di_engine_submit(e, &p, &id), DI_OK);
        di_engine_wait_idle(e);
        CHECK_EQ(g_alone[i].finish, DI_FINISH_STOP);
        CHECK(valid_doc(g_alone[i].text, g_alone[i].n_text));
    }
    di_engine_stats st0;
    di_engine_get_stats(e, &st0);
    const int64_t masks_alone = st0.n_masks_ahead;
    // Batched: the same four with two unconstrained requests in between, the masks computed
    // ahead by the engine thread this time (alone: by the sampling threads).
    di_engine_set_masks_ahead(e, true);
    static result together[6];
    memset(together, 0, sizeof together);
    for (int i = 0; i < 6; i++) {
        uint64_t id;
        di_request_params p = request(i, i < 4 ? g : NULL, &together[i]);
        if (i >= 4) p.max_tokens = 30, p.ignore_eos = true;
        CHECK_EQ(di_engine_submit(e, &p, &id), DI_OK);
    }
    di_grammar_destroy(g); // the requests hold their own references
    g = NULL;
    di_engine_wait_idle(e);
    for (int i = 0; i < 4; i++) {
        CHECK_EQ(together[i].n, g_alone[i].n);
        CHECK(
            !memcmp(together[i].tokens, g_alone[i].tokens, sizeof(int32_t) * (size_t)g_alone[i].n));
    }
    CHECK_EQ(together[4].finish, DI_FINISH_LENGTH);
    CHECK_EQ(together[4].n, 30);
    // The engine thread computed masks while the forwards ran (engine.c, "masks ahead"), none
    // when alone: a mask is a pure function of the matcher, so the tokens are the same whoever
    // computed each one.
    di_engine_stats st;
    di_engine_get_stats(e, &st);
    printf("masks computed ahead: %lld (%lld of them before the batched run)\n",
           (long long)st.n_masks_ahead, (long long)masks_alone);
    CHECK_EQ(masks_alone, 0);
    CHECK(st.n_masks_ahead > 0);
    printf("constrained (greedy): %.*s\n", (int)g_alone[0].n_text, g_alone[0].text);
    printf("constrained (seeded): %.*s\n", (int)g_alone[1].n_text, g_alone[1].text);
    check_clean(e);
out:
    di_engine_destroy(e);
    di_grammar_destroy(g);
}

// The smallest KV pool the engine accepts (one sequence of max_ctx positions): four constrained
// requests with long prompts grow into each other and are preempted and recomputed; the matcher
// state survives (the tokens of each run alone).
static void test_preemption(void) {
    g_long = 1;
    di_grammar *g = compile(DI_GRAMMAR_KIND_JSON_SCHEMA, k_schema);
    di_engine *e = engine();
    static result alone[4], tiny[4];
    di_engine_stats st;
    if (!g || !e) goto out;
    for (int i = 0; i < 4; i++) {
        uint64_t id;
        di_request_params p = request(i, g, &alone[i]);
        CHECK_EQ(di_engine_submit(e, &p, &id), DI_OK);
        di_engine_wait_idle(e);
        CHECK_EQ(alone[i].finish, DI_FINISH_STOP);
    }
    di_engine_get_stats(e, &st);
    di_engine_destroy(e);
    e = engine_kv((size_t)st.block_bytes * (size_t)(16 + 640 / st.block_tokens));
    if (!e) goto out;
    for (int i = 0; i < 4; i++) {
        uint64_t id;
        di_request_params p = request(i, g, &tiny[i]);
        CHECK_EQ(di_engine_submit(e, &p, &id), DI_OK);
    }
    di_engine_wait_idle(e);
    di_engine_get_stats(e, &st);
    printf("tiny KV budget: %lld preemptions\n", (long long)st.n_preemptions);
    CHECK(st.n_preemptions > 0);
    for (int i = 0; i < 4; i++) {
        CHECK_EQ(tiny[i].n, alone[i].n);
        CHECK(!memcmp(tiny[i].tokens, alone[i].tokens, sizeof(int32_t) * (size_t)alone[i].n));
        CHECK(valid_doc(tiny[i].text, tiny[i].n_text));
    }
    check_clean(e);
out:
    g_long = 0;
    di_engine_destroy(e);
    di_grammar_destroy(g);
}

// grammar_after: the tokens up to and including the trigger are those of the unconstrained run;
// after it the output follows the grammar.
static void test_grammar_after(void) {
    di_grammar *g =
        compile(DI_GRAMMAR_KIND_EBNF, "root ::= \"[\" [0-9]{1,3} (\",\" [0-9]{1,3}){0,2} \"]\"");
    di_engine *e = engine();
    if (!g || !e) goto out;
    static result free_run, cons;
    uint64_t id;
    di_request_params p = request(0, NULL, &free_run);
    p.max_tokens = 8;
    p.ignore_eos = true;
    CHECK_EQ(di_engine_submit(e, &p, &id), DI_OK);
    di_engine_wait_idle(e);
    CHECK_EQ(free_run.n, 8);
    // The trigger: the third free token, unless it already appeared before.
    int at = 2;
    while (at < 7 &&
           (free_run.tokens[at] == free_run.tokens[0] || free_run.tokens[at] == free_run.tokens[1]))
        at++;
    p = request(0, g, &cons);
    p.grammar_after = free_run.tokens[at];
    p.max_tokens = 60;
    CHECK_EQ(di_engine_submit(e, &p, &id), DI_OK);
    di_engine_wait_idle(e);
    CHECK(cons.n > at + 1);
    CHECK(!memcmp(cons.tokens, free_run.tokens, sizeof(int32_t) * (size_t)(at + 1)));
    CHECK_EQ(cons.finish, DI_FINISH_STOP);
    // The text after the trigger matches the grammar.
    size_t skip = 0;
    for (int i = 0; i <= at; i++) {
        size_t nb = 0;
        di_tokenizer_token_bytes(g_tok, cons.tokens[i], &nb);
        if (!di_tokenizer_is_special(g_tok, cons.tokens[i])) skip += nb;
    }
    const char *t = cons.text + skip;
    size_t n = cons.n_text - skip;
    CHECK(n >= 3 && t[0] == '[' && t[n - 1] == ']');
    for (size_t i = 1; i + 1 < n; i++) CHECK((t[i] >= '0' && t[i] <= '9') || t[i] == ',');
    printf("grammar_after token %d: constrained part '%.*s'\n", (int)p.grammar_after, (int)n, t);
    check_clean(e);
out:
    di_engine_destroy(e);
    di_grammar_destroy(g);
}

// A grammar that is done ends the request (STOP) even with ignore_eos; EOS is refused before.
static void test_done_and_limit_error(void) {
    di_grammar *g = compile(DI_GRAMMAR_KIND_EBNF, "root ::= \"ab\" [0-9]");
    di_grammar *deep = compile(DI_GRAMMAR_KIND_EBNF, "root ::= \"[\" root \"]\"");
    di_engine *e = engine();
    if (!g || !deep || !e) goto out;
    static result a, b, c;
    uint64_t id;
    di_request_params p = request(1, g, &a);
    p.ignore_eos = true;
    CHECK_EQ(di_engine_submit(e, &p, &id), DI_OK);
    di_engine_wait_idle(e);
    CHECK_EQ(a.finish, DI_FINISH_STOP);
    CHECK_EQ(a.n_text, 3);
    CHECK(a.n_text == 3 && !memcmp(a.text, "ab", 2) && a.text[2] >= '0' && a.text[2] <= '9');
    // Nesting past the limit: that request ends with an error, the other one goes on.
    di_grammar_matcher_limits lim = di_grammar_matcher_limits_default();
    lim.max_depth = 6;
    di_engine_set_grammar_limits(e, &lim);
    p = request(2, deep, &b);
    CHECK_EQ(di_engine_submit(e, &p, &id), DI_OK);
    di_request_params q = request(3, NULL, &c);
    q.max_tokens = 20;
    q.ignore_eos = true;
    CHECK_EQ(di_engine_submit(e, &q, &id), DI_OK);
    di_engine_wait_idle(e);
    CHECK_EQ(b.finish, DI_FINISH_ERROR);
    CHECK_EQ(b.status, DI_ERR_UNSUPPORTED);
    CHECK(b.n < 6);
    CHECK_EQ(c.finish, DI_FINISH_LENGTH);
    CHECK_EQ(c.n, 20);
    check_clean(e);
out:
    di_engine_destroy(e);
    di_grammar_destroy(g);
    di_grammar_destroy(deep);
}

// ---- tool calls: a named tool_choice (the prompt ends in the block header) ----

typedef struct calls_out {
    char name[4][64];
    char args[4][1024];
    int n;
} calls_out;

static void on_parse(void *user, const di_parser_event *ev) {
    calls_out *c = user;
    if (ev->kind == DI_PARSER_EVENT_TOOL_CALL_BEGIN && c->n < 4) c->n++;
    if (c->n == 0 || c->n > 4) return;
    char *dst = ev->kind == DI_PARSER_EVENT_TOOL_NAME    ? c->name[c->n - 1]
                : ev->kind == DI_PARSER_EVENT_ARGS_DELTA ? c->args[c->n - 1]
                                                         : NULL;
    const size_t cap =
        ev->kind == DI_PARSER_EVENT_TOOL_NAME ? sizeof c->name[0] : sizeof c->args[0];
    if (dst && ev->len && strlen(dst) + ev->len < cap) strncat(dst, ev->text, ev->len);
}

// Bounded parameters (an enum raw string, a JSON string with maxLength, an integer range, a
// nested object), so a random model finishes the block within max_tokens.
static const char *k_tool_req =
    "{\"model\":\"m\",\"thinking\":{\"type\":\"disabled\"},\"messages\":[{\"role\":\"user\","
    "\"content\":\"Weather?\"}],\"tools\":[{\"type\":\"function\",\"function\":{\"name\":\"other\","
    "\"parameters\":{\"type\":\"object\",\"properties\":{\"q\":{\"type\":\"string\"}}}}},"
    "{\"type\":\"function\",\"function\":{\"name\":\"get_weather\",\"parameters\":{\"type\":"
    "\"object\",\"properties\":{\"unit\":{\"type\":\"string\",\"enum\":[\"celsius\","
    "\"fahrenheit\"]},\"city\":{\"type\":\"string\",\"maxLength\":8},\"days\":{\"type\":"
    "\"integer\",\"minimum\":1,\"maximum\":7},\"opts\":{\"type\":\"object\",\"properties\":{"
    "\"hourly\":{\"type\":\"boolean\"}},\"required\":[\"hourly\"],\"additionalProperties\":false}},"
    "\"required\":[\"unit\",\"city\",\"days\"],\"additionalProperties\":false}}}],"
    "\"tool_choice\":{\"type\":\"function\",\"function\":{\"name\":\"get_weather\"}}}";

static bool valid_weather_args(const char *args) {
    json_error_t je;
    json_t *a = json_loads(args, 0, &je);
    bool ok = json_is_object(a);
    const json_t *unit = json_object_get(a, "unit"), *city = json_object_get(a, "city");
    const json_t *days = json_object_get(a, "days"), *opts = json_object_get(a, "opts");
    ok = ok && json_is_string(unit) &&
         (!strcmp(json_string_value(unit), "celsius") ||
          !strcmp(json_string_value(unit), "fahrenheit"));
    ok = ok && json_is_string(city) && json_string_length(city) <= 8 * 4; // ≤ 8 characters
    ok = ok && json_is_integer(days) && json_integer_value(days) >= 1 &&
         json_integer_value(days) <= 7;
    if (ok && opts)
        ok = json_is_object(opts) && json_object_size(opts) == 1 &&
             json_is_boolean(json_object_get(opts, "hourly"));
    ok = ok && json_object_size(a) == (opts ? 4u : 3u);
    if (!ok) fprintf(stderr, "arguments do not satisfy the schema: %s\n", args);
    json_decref(a);
    return ok;
}

static void test_named_tool_choice(void) {
    char *text = NULL;
    int32_t *ids = NULL;
    size_t n_text = 0, n_ids = 0;
    di_render_options ro = di_render_options_default();
    CHECK_EQ(di_render_request(g_tok, k_tool_req, strlen(k_tool_req), DI_RENDER_API_CHAT, &ro,
                               &text, &n_text, &ids, &n_ids),
             DI_OK);
    // the prompt ends in the block header (serving.md §1.4): the grammar applies from token one
    static const char hdr[] = "\n\n<｜DSML｜tool_calls>\n";
    CHECK(text && n_text > sizeof hdr && !strcmp(text + n_text - (sizeof hdr - 1), hdr));
    json_error_t je;
    json_t *req = json_loads(k_tool_req, 0, &je);
    char *tools = json_dumps(json_object_get(req, "tools"), JSON_COMPACT);
    di_grammar_tools_options o = {.name = "get_weather", .parallel = false};
    di_grammar *g = NULL;
    char err[512];
    CHECK_EQ(di_grammar_compile_tools(g_tok, tools, strlen(tools), &o, &g, err, sizeof err), DI_OK);
    // The V4.1 spelling (" invoke", " parameter", " calls") on the third run: the parser reads
    // both (the tiny V4 model's prompt keeps the V4 header; only the output is checked).
    di_grammar *g41 = NULL;
    o.encoding = 1;
    CHECK_EQ(di_grammar_compile_tools(g_tok, tools, strlen(tools), &o, &g41, err, sizeof err),
             DI_OK);
    printf("tool prompt: %zu tokens\n", n_ids);
    di_engine *e = engine_kv_ctx(64u << 20, 2048);
    for (int k = 0; k < 3 && g && e && ids; k++) {
        result r = {0};
        di_request_params p = di_request_params_default();
        p.prompt = ids;
        p.n_prompt = (int32_t)n_ids;
        p.max_tokens = 400;
        p.grammar = k == 2 ? g41 : g;
        p.on_event = on_event;
        p.user = &r;
        if (k) p.sample.temperature = 1.0f, p.sample.seed = 40 + (uint64_t)k;
        uint64_t id;
        CHECK_EQ(di_engine_submit(e, &p, &id), DI_OK);
        di_engine_wait_idle(e);
        CHECK_EQ(r.finish, DI_FINISH_STOP); // the grammar is done after the block's closing tag
        calls_out c = {0};
        di_parser *ps = NULL;
        CHECK_EQ(di_parser_create(g_tok, DI_PARSER_STAGE_TOOL_CALLS, true, false, NULL, 0, on_parse,
                                  &c, &ps),
                 DI_OK);
        for (int32_t i = 0; ps && i < r.n; i++)
            CHECK_EQ(di_parser_feed_token(ps, r.tokens[i]), DI_OK);
        CHECK(ps && di_parser_finished(ps));
        CHECK_EQ(di_parser_end(ps, DI_PARSER_FINISH_STOP), DI_PARSER_FINISH_TOOL_CALLS);
        di_parser_destroy(ps);
        CHECK_EQ(c.n, 1);
        CHECK(!strcmp(c.name[0], "get_weather"));
        CHECK(valid_weather_args(c.args[0]));
        printf("named tool call (%s): %s(%s), %d tokens\n",
               k == 2 ? "seeded, V4.1 spelling"
               : k    ? "seeded"
                      : "greedy",
               c.name[0], c.args[0], (int)r.n);
        r.text[r.n_text < sizeof r.text ? r.n_text : sizeof r.text - 1] = 0;
        CHECK((strstr(r.text, "</｜DSML｜ invoke>") != NULL) == (k == 2));
        CHECK((strstr(r.text, "</｜DSML｜invoke>") != NULL) == (k != 2));
    }
    if (e) check_clean(e);
    di_engine_destroy(e);
    di_grammar_destroy(g);
    di_grammar_destroy(g41);
    free(tools);
    json_decref(req);
    di_tok_free(text);
    di_tok_free(ids);
}

// tool_choice auto: unconstrained until the model writes ｜DSML｜ (grammar_after), then the rest
// must be a valid block. The prompt ends with "<" and a logit bias makes ｜DSML｜ the first
// token (a random model would practically never write it); what follows is the grammar's.
static void test_auto_after_dsml(void) {
    char *text = NULL;
    int32_t *ids = NULL;
    size_t n_text = 0, n_ids = 0;
    static const char req_auto[] =
        "{\"model\":\"m\",\"thinking\":{\"type\":\"disabled\"},\"messages\":[{\"role\":\"user\","
        "\"content\":\"Weather?\"},{\"role\":\"assistant\",\"content\":\"\\n\\n<\",\"prefix\":"
        "true}]}";
    di_render_options ro = di_render_options_default();
    CHECK_EQ(di_render_request(g_tok, req_auto, strlen(req_auto), DI_RENDER_API_CHAT, &ro, &text,
                               &n_text, &ids, &n_ids),
             DI_OK);
    json_error_t je;
    json_t *req = json_loads(k_tool_req, 0, &je);
    char *tools = json_dumps(json_object_get(req, "tools"), JSON_COMPACT);
    di_grammar_tools_options o = {.parallel = true, .start = DI_GRAMMAR_TOOLS_AFTER_DSML};
    di_grammar *g = NULL;
    char err[512];
    CHECK_EQ(di_grammar_compile_tools(g_tok, tools, strlen(tools), &o, &g, err, sizeof err), DI_OK);
    const int32_t dsml = di_tokenizer_token_id(g_tok, "｜DSML｜");
    di_engine *e = engine_kv_ctx(64u << 20, 2048);
    if (g && e && ids && n_text > 0 && text[n_text - 1] == '<') {
        result r = {0};
        di_logit_bias bias = {.token = dsml, .bias = 100.0f};
        di_request_params p = di_request_params_default();
        p.prompt = ids;
        p.n_prompt = (int32_t)n_ids;
        p.max_tokens = 600;
        p.grammar = g;
        p.grammar_after = dsml;
        p.sample.temperature = 1.0f;
        p.sample.seed = 77;
        p.sample.logit_bias = &bias;
        p.sample.n_logit_bias = 1;
        p.on_event = on_event;
        p.user = &r;
        uint64_t id;
        CHECK_EQ(di_engine_submit(e, &p, &id), DI_OK);
        di_engine_wait_idle(e);
        CHECK_EQ(r.finish, DI_FINISH_STOP);
        CHECK(r.n > 1 && r.tokens[0] == dsml);
        calls_out c = {0};
        di_parser *ps = NULL;
        CHECK_EQ(di_parser_create(g_tok, DI_PARSER_STAGE_CONTENT, true, false, NULL, 0, on_parse,
                                  &c, &ps),
                 DI_OK);
        if (ps) {
            CHECK_EQ(di_parser_feed(ps, "\n\n<", 3), DI_OK); // the prefilled text
            for (int32_t i = 0; i < r.n; i++)
                CHECK_EQ(di_parser_feed_token(ps, r.tokens[i]), DI_OK);
            CHECK(di_parser_finished(ps));
            CHECK_EQ(di_parser_end(ps, DI_PARSER_FINISH_STOP), DI_PARSER_FINISH_TOOL_CALLS);
            di_parser_destroy(ps);
        }
        CHECK(c.n >= 1);
        for (int k = 0; k < c.n && k < 4; k++) {
            if (!strcmp(c.name[k], "get_weather")) {
                CHECK(valid_weather_args(c.args[k]));
            } else {
                CHECK(!strcmp(c.name[k], "other"));
                json_t *a = json_loads(c.args[k], 0, &je);
                CHECK(json_is_object(a) && json_object_size(a) <= 1);
                CHECK(json_object_size(a) == 0 || json_is_string(json_object_get(a, "q")));
                json_decref(a);
            }
            printf("auto tool call %d: %s(%.80s)\n", k, c.name[k], c.args[k]);
        }
    } else {
        CHECK(false); // the prompt must end with the prefilled "<"
    }
    if (e) check_clean(e);
    di_engine_destroy(e);
    di_grammar_destroy(g);
    free(tools);
    json_decref(req);
    di_tok_free(text);
    di_tok_free(ids);
}

int main(void) {
    snprintf(g_dir, sizeof g_dir, "/tmp/di_test_engine_grammar_XXXXXX");
    if (!mkdtemp(g_dir)) return 1;
    di_synth_config c;
    CHECK(di_synth_preset("tiny", &c) == DI_OK);
    CHECK(di_synth_write(&c, g_dir) == DI_OK);
    if (di_tokenizer_load_for_model(NULL, &g_tok) != DI_OK) return 1;
    CHECK(di_grammar_vocab_create(g_tok, &g_gv) == DI_OK);
    di_set_log_level(0);
    RUN(test_json_schema_alone_and_batched);
    RUN(test_preemption);
    RUN(test_grammar_after);
    RUN(test_done_and_limit_error);
    RUN(test_named_tool_choice);
    RUN(test_auto_after_dsml);
    di_grammar_vocab_destroy(g_gv);
    di_tokenizer_destroy(g_tok);
    di_test_remove_dir(g_dir);
    return test_finish();
}
