// Tests for src/tok/parse: round trips render → tokenize → parse token by token for every
// assistant message of the official V4 vectors and for synthetic messages (0..3 calls, typed and
// Unicode arguments, V4 and V4.1 spelling); whole-text vs byte-by-byte vs random splits; truncation
// inside a call; stop strings; DSML without tools; stray and malformed markup.
#include "harness.h"

#include <jansson.h>

#include "base/mem.h"
#include "tok/parse.h"
#include "tok/render.h"
#include "tok/tokenizer.h"

static di_tokenizer *g_tok;
static unsigned g_rng = 12345;
static unsigned rnd(void) {
    return g_rng = g_rng * 1103515245u + 12345u, (g_rng >> 16) & 0x7fff;
}

// Completion text of assistant message `am` (JSON) after a one-user prompt, as the model would
// write it: rendered [user, assistant] minus the rendered [user] prompt.
static char *completion_of(const json_t *am, bool v41, bool thinking) {
    json_t *doc = json_pack("{s:[{s:s,s:s},O],s:s,s:s,s:b}", "messages", "role", "user", "content",
                            "q", am, "encoding", v41 ? "dsv41" : "dsv4", "thinking_mode",
                            thinking ? "thinking" : "chat", "drop_thinking", 0);
    json_t *doc1 = json_pack("{s:[{s:s,s:s}],s:s,s:s,s:b}", "messages", "role", "user", "content",
                             "q", "encoding", v41 ? "dsv41" : "dsv4", "thinking_mode",
                             thinking ? "thinking" : "chat", "drop_thinking", 0);
    char *res = NULL;
    di_render_conv c, c1;
    void *m = NULL, *m1 = NULL;
    di_render_out o, o1;
    di_render_out_init(&o);
    di_render_out_init(&o1);
    if (di_render_conv_from_json(doc, &c, &m) == DI_OK &&
        di_render_conv_from_json(doc1, &c1, &m1) == DI_OK && di_render_conv_text(&c, &o) == DI_OK &&
        di_render_conv_text(&c1, &o1) == DI_OK && o.text.len >= o1.text.len &&
        memcmp(o.text.data, o1.text.data, o1.text.len) == 0)
        res = strdup(o.text.data + o1.text.len);
    di_render_out_deinit(&o);
    di_render_out_deinit(&o1);
    di_render_conv_free_mem(m);
    di_render_conv_free_mem(m1);
    json_decref(doc);
    json_decref(doc1);
    return res;
}

// Parses completion token by token (special tokens recognised: the model emits them).
static void parse_tokens(const char *text, bool tools, di_parse_stage start, di_parse_result *r) {
    int32_t *ids;
    size_t n;
    di_parse_result_init(r);
    CHECK(di_tokenizer_encode(g_tok, text, strlen(text), true, &ids, &n) == DI_OK);
    di_parse_options opt = {.start = start, .tools_enabled = tools};
    di_parse *p;
    CHECK(di_parse_create(&opt, di_parse_result_emit, r, &p) == DI_OK);
    for (size_t i = 0; i < n; i++) CHECK(di_parse_feed_token(p, g_tok, ids[i]) == DI_OK);
    if (!di_parse_finished(p)) di_parse_end(p, DI_PARSE_FINISH_LENGTH);
    r->finish = di_parse_end(p, DI_PARSE_FINISH_STOP);
    r->flags = di_parse_flags(p);
    di_parse_destroy(p);
    di_tok_free(ids);
}

static bool str_field_eq(const json_t *m, const char *key, const di_buf *b) {
    const char *want = json_string_value(json_object_get(m, key));
    if (!want) want = "";
    return strlen(want) == b->len && memcmp(want, b->data ? b->data : "", b->len) == 0;
}

static int g_roundtrips;

// The message parsed back must equal the original (arguments compared as JSON values).
static void check_roundtrip(const json_t *am, bool v41, bool thinking) {
    char *text = completion_of(am, v41, thinking);
    CHECK(text != NULL);
    if (!text) return;
    di_parse_result r;
    parse_tokens(text, true, thinking ? DI_PARSE_STAGE_REASONING : DI_PARSE_STAGE_CONTENT, &r);
    bool ok = true;
    if (thinking) ok &= str_field_eq(am, "reasoning_content", &r.reasoning);
    ok &= str_field_eq(am, "content", &r.content);
    const json_t *calls = json_object_get(am, "tool_calls");
    ok &= json_array_size(calls) == r.n_calls;
    for (size_t i = 0; ok && i < r.n_calls; i++) {
        const json_t *fn = json_object_get(json_array_get(calls, i), "function");
        ok &= str_field_eq(fn, "name", &r.calls[i].name);
        json_error_t e;
        json_t *a = json_loads(json_string_value(json_object_get(fn, "arguments")), 0, &e);
        json_t *b = json_loads(r.calls[i].arguments.data, 0, &e);
        ok &= a && b && json_equal(a, b);
        if (!(a && b && json_equal(a, b)))
            fprintf(stderr, "  args: %s vs %s\n",
                    json_string_value(json_object_get(fn, "arguments")), r.calls[i].arguments.data);
        json_decref(a);
        json_decref(b);
    }
    ok &= r.finish == (r.n_calls ? DI_PARSE_FINISH_TOOL_CALLS : DI_PARSE_FINISH_STOP);
    ok &= (r.flags & ~(unsigned)DI_PARSE_FLAG_CONTENT_AFTER_FINISHED) == 0;
    CHECK(ok);
    if (!ok) {
        char *js = json_dumps(am, JSON_COMPACT);
        fprintf(stderr,
                "round trip failed for %s\n  completion: %s\n  got reasoning \"%s\" content \"%s\" "
                "%zu calls finish %d flags %u\n",
                js, text, r.reasoning.data ? r.reasoning.data : "",
                r.content.data ? r.content.data : "", r.n_calls, r.finish, r.flags);
        free(js);
    } else {
        g_roundtrips++;
    }
    di_parse_result_deinit(&r);
    free(text);
}

static void test_official_roundtrip(void) {
    // every assistant message of the official V4 vectors (spec §1.12 harness)
    int n_msgs = 0;
    for (int k = 1; k <= 4; k++) {
        char p[4096];
        const char *sh = getenv("DI_SHARED_DIR"), *root = getenv("DI_SOURCE_DIR");
        if (sh)
            snprintf(p, sizeof p,
                     "%s/reference/deepseek-v4-flash/encoding-tests/test_input_%d.json", sh, k);
        else
            snprintf(p, sizeof p, "%s/tests/data/tok/encoding-tests/test_input_%d.json",
                     root ? root : ".", k);
        json_error_t e;
        json_t *doc = json_load_file(p, 0, &e);
        CHECK(doc != NULL);
        const json_t *msgs = json_is_array(doc) ? doc : json_object_get(doc, "messages");
        size_t i;
        json_t *m;
        json_array_foreach(msgs, i, m) {
            if (strcmp(json_string_value(json_object_get(m, "role")), "assistant") != 0) continue;
            json_t *c = json_deep_copy(m);
            json_object_del(c, "task");
            json_object_del(c, "mask");
            check_roundtrip(c, false, true);
            check_roundtrip(c, true, true);
            json_t *nr = json_deep_copy(c);
            json_object_del(nr, "reasoning_content");
            check_roundtrip(nr, false, false);
            json_decref(nr);
            json_decref(c);
            n_msgs++;
        }
        json_decref(doc);
    }
    fprintf(stderr, "official assistant messages round-tripped: %d (x3 modes)\n", n_msgs);
    CHECK_EQ(n_msgs, 8); // two assistant messages in each of the four vectors
}

static json_t *call(const char *name, const char *args) {
    return json_pack("{s:s,s:{s:s,s:s}}", "type", "function", "function", "name", name, "arguments",
                     args);
}

static void test_synthetic_roundtrip(void) {
    const char *args[] = {
        "{}",
        "{\"location\": \"Beijing\"}",
        "{\"n\": 5, \"x\": -1.5e-07, \"big\": 12345678901234}",
        "{\"o\": {\"a\": [1, 2, {\"b\": null}]}, \"t\": true, \"f\": false}",
        "{\"q\": \"say \\\"hi\\\"\\nnew line\\ttab \\\\ back\"}",
        "{\"uni\": \"中文 😀 ñ\", \"arr\": [\"x\", \"y\"]}",
        "{\"empty\": \"\"}",
        "{\"s\": \"</think> <think> a < b > c\"}",
        "{\"nested\": \"{\\\"json\\\": 1}\"}",
    };
    const char *contents[] = {"",           "Sure.",          "Line one\nline two",
                              "中文回答 😀", "x < y && y > z", "ends with newline\n"};
    const char *reasonings[] = {"", "Think about it.", "Multi\nline\n\nreasoning", "推理过程"};
    int n = 0;
    for (int it = 0; it < 300; it++) {
        json_t *calls = json_array();
        int nc = (int)(rnd() % 4);
        for (int k = 0; k < nc; k++) {
            char name[32];
            snprintf(name, sizeof name, "tool_%d", (int)(rnd() % 100));
            json_array_append_new(calls, call(name, args[rnd() % (sizeof args / sizeof *args)]));
        }
        json_t *m = json_pack(
            "{s:s,s:s,s:s,s:o}", "role", "assistant", "content",
            contents[rnd() % (sizeof contents / sizeof *contents)], "reasoning_content",
            reasonings[rnd() % (sizeof reasonings / sizeof *reasonings)], "tool_calls", calls);
        check_roundtrip(m, rnd() % 2, true);
        json_decref(m);
        n++;
    }
    fprintf(stderr, "synthetic round trips: %d, total passing %d\n", n, g_roundtrips);
}

// event transcript: kinds and text, for comparing splits
typedef struct transcript {
    di_buf b;
} transcript;

static void tr_emit(void *user, const di_parse_event *ev) {
    transcript *t = user;
    di_buf_printf(&t->b, "%d/%d:", (int)ev->kind, (int)ev->call_index);
    // adjacent text events of one kind are merged so that transcripts compare across splits
    di_buf_append(&t->b, ev->text ? ev->text : "", ev->len);
    di_buf_append(&t->b, "\x1f", 1);
}

static void normalize(di_buf *b) { // merge consecutive same-kind text events
    di_buf out;
    di_buf_init(&out);
    char prev[32] = "";
    char *s = b->data ? b->data : "";
    size_t n = b->len;
    for (size_t i = 0; i < n;) {
        char *sep = memchr(s + i, '\x1f', n - i);
        size_t len = (size_t)(sep - (s + i));
        char *colon = memchr(s + i, ':', len);
        size_t hl = (size_t)(colon - (s + i)) + 1;
        char head[32];
        snprintf(head, sizeof head, "%.*s", (int)hl, s + i);
        bool text_kind = head[0] == '0' || head[0] == '1' || head[0] == '3' || head[0] == '5';
        if (!(text_kind && strcmp(head, prev) == 0)) {
            if (out.len) di_buf_append(&out, "\x1f", 1);
            di_buf_append(&out, head, hl);
        }
        di_buf_append(&out, colon + 1, len - hl);
        snprintf(prev, sizeof prev, "%s", text_kind ? head : "");
        i += len + 1;
    }
    di_buf_append(&out, "", 0);
    di_buf_deinit(b);
    *b = out;
}

static void run_split(const char *text, size_t n, const size_t *cuts, size_t n_cuts, transcript *t,
                      di_parse_finish *fin) {
    di_buf_init(&t->b);
    // "<｜" is a prefix of the DSML label: any split must still give the whole-text result
    const char *stops[] = {"STOP!", "\n\nEND", "<｜"};
    di_parse_options opt = {
        .start = DI_PARSE_STAGE_REASONING, .tools_enabled = true, .stop = stops, .n_stop = 3};
    di_parse *p;
    CHECK(di_parse_create(&opt, tr_emit, t, &p) == DI_OK);
    size_t pos = 0;
    for (size_t i = 0; i <= n_cuts; i++) {
        size_t end = i < n_cuts ? cuts[i] : n;
        CHECK(di_parse_feed(p, text + pos, end - pos) == DI_OK);
        pos = end;
    }
    *fin = di_parse_end(p, DI_PARSE_FINISH_STOP);
    di_parse_destroy(p);
    normalize(&t->b);
}

static void test_splits(void) {
    const char *texts[] = {
        "\n\nreason 中文 </think>\n\nanswer 😀\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke "
        "name=\"f\">\n"
        "<｜DSML｜parameter name=\"a\" string=\"true\">v \"q\"\n</｜DSML｜parameter>\n"
        "<｜DSML｜parameter name=\"b\" string=\"false\">[1, "
        "2]</｜DSML｜parameter>\n</｜DSML｜invoke>\n"
        "<｜DSML｜invoke name=\"g\">\n\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>",
        "r</think>text with STOP! after",
        "r</think>a </think> b <｜DSML｜ calls>\n<｜DSML｜ invoke name=\"x\">\n<｜DSML｜ parameter "
        "name=\"k\" string=\"true\">é</｜DSML｜ parameter>\n</｜DSML｜ invoke>\n</｜DSML｜ "
        "calls>trailing",
        "reasoning only, truncated <｜DS",
        "r</think>ans\n\nEND more",
        "r</think>x\n<｜DSML｜tool_calls>\n<｜DSML｜invoke "
        "name=\"f\">\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>",
        "r</think>y\n<｜other",
        "r</think>z</｜DSML｜invoke>｜DSML｜w",
    };
    for (size_t k = 0; k < sizeof texts / sizeof *texts; k++) {
        const char *t = texts[k];
        size_t n = strlen(t);
        transcript whole, one, rs;
        di_parse_finish f0, f1, f2;
        run_split(t, n, NULL, 0, &whole, &f0);
        size_t *cuts = malloc(n * sizeof *cuts);
        for (size_t i = 0; i + 1 < n; i++) cuts[i] = i + 1; // byte by byte
        run_split(t, n, cuts, n ? n - 1 : 0, &one, &f1);
        for (int rep = 0; rep < 50; rep++) { // random splits
            size_t nc = 0, pos = 0;
            while (pos < n) {
                pos += 1 + rnd() % 7;
                if (pos < n) cuts[nc++] = pos;
            }
            run_split(t, n, cuts, nc, &rs, &f2);
            CHECK_STR_EQ(rs.b.data, whole.b.data);
            CHECK_EQ(f2, f0);
            di_buf_deinit(&rs.b);
        }
        CHECK_STR_EQ(one.b.data, whole.b.data);
        CHECK_EQ(f1, f0);
        // no DSML markup ever reaches reasoning or content
        CHECK(strstr(whole.b.data, "DSML") == NULL);
        free(cuts);
        di_buf_deinit(&whole.b);
        di_buf_deinit(&one.b);
    }
}

static void test_cases(void) {
    di_parse_options opt = {.start = DI_PARSE_STAGE_REASONING, .tools_enabled = true};
    di_parse_result r;
    // stop sequence in content
    const char *stops[] = {"STOP"};
    di_parse_options so = {.start = DI_PARSE_STAGE_CONTENT, .stop = stops, .n_stop = 1};
    di_parse_result_init(&r);
    CHECK(di_parse_text(&so, "abc STOP def", 12, DI_PARSE_FINISH_STOP, &r) == DI_OK);
    CHECK_STR_EQ(r.content.data, "abc ");
    CHECK_EQ(r.finish, DI_PARSE_FINISH_STOP_SEQUENCE);
    CHECK(r.flags & DI_PARSE_FLAG_CONTENT_AFTER_FINISHED);
    di_parse_result_deinit(&r);
    // stop strings never apply to reasoning
    di_parse_options so2 = so;
    so2.start = DI_PARSE_STAGE_REASONING;
    di_parse_result_init(&r);
    CHECK(di_parse_text(&so2, "STOP</think>x", 13, DI_PARSE_FINISH_STOP, &r) == DI_OK);
    CHECK_STR_EQ(r.reasoning.data, "STOP");
    CHECK_STR_EQ(r.content.data, "x");
    di_parse_result_deinit(&r);
    // truncation (length) inside a call: the call is dropped, no markup leaks
    const char *tr = "r</think>ok\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke "
                     "name=\"f\">\n<｜DSML｜parameter name=\"a\" string=\"tr";
    di_parse_result_init(&r);
    CHECK(di_parse_text(&opt, tr, strlen(tr), DI_PARSE_FINISH_LENGTH, &r) == DI_OK);
    CHECK_STR_EQ(r.content.data, "ok");
    CHECK_EQ(r.n_calls, 0);
    CHECK_EQ(r.finish, DI_PARSE_FINISH_LENGTH);
    CHECK(r.flags & DI_PARSE_FLAG_CALL_ABORTED);
    di_parse_result_deinit(&r);
    // a complete call whose outer closing tag is missing is kept at EOS
    const char *nc =
        "r</think>\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"f\">\n</｜DSML｜invoke>\n";
    di_parse_result_init(&r);
    CHECK(di_parse_text(&opt, nc, strlen(nc), DI_PARSE_FINISH_STOP, &r) == DI_OK);
    CHECK_EQ(r.n_calls, 1);
    CHECK(r.n_calls == 1 && strcmp(r.calls[0].arguments.data, "{}") == 0);
    CHECK_EQ(r.finish, DI_PARSE_FINISH_TOOL_CALLS);
    di_parse_result_deinit(&r);
    // DSML without tools: stripped, no calls, content kept
    di_parse_options nt = {.start = DI_PARSE_STAGE_CONTENT, .tools_enabled = false};
    const char *d = "hello\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke "
                    "name=\"f\">\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>";
    di_parse_result_init(&r);
    CHECK(di_parse_text(&nt, d, strlen(d), DI_PARSE_FINISH_STOP, &r) == DI_OK);
    CHECK_STR_EQ(r.content.data, "hello");
    CHECK_EQ(r.n_calls, 0);
    CHECK(r.flags & DI_PARSE_FLAG_DSML_SUPPRESSED);
    CHECK_EQ(r.finish, DI_PARSE_FINISH_STOP);
    di_parse_result_deinit(&r);
    // forced tool call: parser starts in ToolCalls
    di_parse_options tc = {.start = DI_PARSE_STAGE_TOOL_CALLS, .tools_enabled = true};
    const char *f =
        "<｜DSML｜invoke name=\"g\">\n<｜DSML｜parameter name=\"n\" "
        "string=\"false\">3</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>";
    di_parse_result_init(&r);
    CHECK(di_parse_text(&tc, f, strlen(f), DI_PARSE_FINISH_STOP, &r) == DI_OK);
    CHECK(r.n_calls == 1 && strcmp(r.calls[0].name.data, "g") == 0 &&
          strcmp(r.calls[0].arguments.data, "{\"n\": 3}") == 0);
    di_parse_result_deinit(&r);
    // duplicate parameter names are flagged
    const char *dup = "<｜DSML｜invoke name=\"g\">\n<｜DSML｜parameter name=\"n\" "
                      "string=\"false\">3</｜DSML｜parameter>\n<｜DSML｜parameter name=\"n\" "
                      "string=\"false\">4</｜DSML｜parameter>\n</｜DSML｜invoke>";
    di_parse_result_init(&r);
    CHECK(di_parse_text(&tc, dup, strlen(dup), DI_PARSE_FINISH_STOP, &r) == DI_OK);
    CHECK(r.flags & DI_PARSE_FLAG_DUPLICATE_PARAMETER);
    di_parse_result_deinit(&r);
    // stray </think> in content
    di_parse_result_init(&r);
    CHECK(di_parse_text(&opt, "r</think>a</think>b", 19, DI_PARSE_FINISH_STOP, &r) == DI_OK);
    CHECK_STR_EQ(r.content.data, "ab");
    CHECK(r.flags & DI_PARSE_FLAG_EXTRA_END_OF_THINKING);
    di_parse_result_deinit(&r);
    // stray DSML closers or bare DSML tokens never reach content (found by fuzz_parse)
    di_parse_result_init(&r);
    const char *st = "r</think>a</｜DSML｜parameter>b｜DSML｜c";
    CHECK(di_parse_text(&opt, st, strlen(st), DI_PARSE_FINISH_STOP, &r) == DI_OK);
    CHECK_STR_EQ(r.content.data, "aparameter>bc");
    CHECK(r.flags & DI_PARSE_FLAG_STRAY_MARKUP);
    di_parse_result_deinit(&r);
    // bad options
    const char *empty[] = {""};
    di_parse_options bad = {.stop = empty, .n_stop = 1};
    di_parse *p = NULL;
    CHECK_EQ(di_parse_create(&bad, di_parse_result_emit, &r, &p), DI_ERR_INVALID);
    // invalid token id through the token path
    di_parse_result_init(&r);
    CHECK(di_parse_create(&opt, di_parse_result_emit, &r, &p) == DI_OK);
    CHECK_EQ(di_parse_feed_token(p, g_tok, 999999), DI_ERR_INVALID);
    CHECK(di_parse_feed_token(p, g_tok, 1) == DI_OK); // EOS
    CHECK(di_parse_finished(p));
    di_parse_destroy(p);
    di_parse_result_deinit(&r);
}

// JSON mode (spec serving.md §1.8): fences skipped, text outside the JSON blanked with spaces
// (same byte count), identical whole-text and byte-by-byte.
static void json_case(const char *in, const char *want) {
    di_parse_options o = {.start = DI_PARSE_STAGE_CONTENT, .json_output = true};
    di_parse_result whole;
    di_parse_result_init(&whole);
    CHECK(di_parse_text(&o, in, strlen(in), DI_PARSE_FINISH_STOP, &whole) == DI_OK);
    CHECK_STR_EQ(whole.content.data ? whole.content.data : "", want);
    CHECK_EQ(whole.content.len, strlen(in));
    di_parse_result bytes;
    di_parse_result_init(&bytes);
    di_parse *p = NULL;
    CHECK(di_parse_create(&o, di_parse_result_emit, &bytes, &p) == DI_OK);
    for (size_t i = 0; in[i]; i++) CHECK(di_parse_feed(p, in + i, 1) == DI_OK);
    di_parse_end(p, DI_PARSE_FINISH_STOP);
    di_parse_destroy(p);
    CHECK_STR_EQ(bytes.content.data ? bytes.content.data : "", want);
    di_parse_result_deinit(&whole);
    di_parse_result_deinit(&bytes);
}

static void test_json_mode(void) {
    json_case("```json\n{\"a\": 1}\n```\nThanks", "        {\"a\": 1}           ");
    json_case("```\n[1,2]\n```", "    [1,2]    ");
    json_case("Sure! {\"x\": [1, {\"y\": \"}]\\\"\"}]} done",
              "      {\"x\": [1, {\"y\": \"}]\\\"\"}]}     ");
    json_case("no json here", "            ");
    json_case("```js", "     ");
    json_case("```python\n{}", "          {}");
    json_case("```json\n{\"s\": \"a\nb\"}\n``", "        {\"s\": \"a\nb\"}\n``"); // unclosed fence
    json_case("[1]\n[2]", "[1]    ");
    // reasoning is untouched
    di_parse_options o = {.start = DI_PARSE_STAGE_REASONING, .json_output = true};
    di_parse_result r;
    di_parse_result_init(&r);
    const char *in = "think {x}</think>ok {\"k\":2}";
    CHECK(di_parse_text(&o, in, strlen(in), DI_PARSE_FINISH_STOP, &r) == DI_OK);
    CHECK_STR_EQ(r.reasoning.data, "think {x}");
    CHECK_STR_EQ(r.content.data, "   {\"k\":2}");
    di_parse_result_deinit(&r);
}

int main(void) {
    if (di_tokenizer_load_for_model(NULL, &g_tok) != DI_OK) return 1;
    RUN(test_json_mode);
    RUN(test_official_roundtrip);
    RUN(test_synthetic_roundtrip);
    RUN(test_splits);
    RUN(test_cases);
    di_tokenizer_destroy(g_tok);
    return test_finish();
}
