// Snapshot points of rendered requests (di_render_request_points, src/tok/request.c, render.c
// marks and system_end; docs/kv-cache.md "Snapshot points"): the end of the system prefix for
// Chat Completions (system + tools), Responses (instructions) and Messages (system string or
// blocks), and the Messages cache_control breakpoints on system blocks, tool definitions,
// message text blocks, tool results and assistant turns. Every point is checked to be exact:
// ids[0 .. p) decode to a prefix of the prompt text, that prefix is where the test expects it
// (before a given substring), and its own tokenization (special tokens recognised) is ids[0 .. p).
#include "harness.h"

#include "deepinfer.h"

static di_tokenizer *g_tok;

typedef struct rendered {
    char *text;
    size_t n_text;
    int32_t *ids;
    size_t n_ids;
    di_render_points pts;
    di_status st;
} rendered;

static rendered render(const char *json, di_render_api api) {
    rendered r = {0};
    r.st = di_render_request_points(g_tok, json, strlen(json), api, NULL, &r.text, &r.n_text,
                                    &r.ids, &r.n_ids, &r.pts);
    return r;
}

static void drop(rendered *r) {
    di_tok_free(r->text);
    di_tok_free(r->ids);
}

// Point p is exact and ends the text right before the first occurrence of `before` after
// `after` (NULL: from the start), or up to `slack` bytes before it.
static void check_point_in(const rendered *r, int32_t p, const char *after, const char *before,
                           size_t slack) {
    CHECK(p > 0 && (size_t)p <= r->n_ids);
    if (p <= 0 || (size_t)p > r->n_ids) return;
    char *dec = NULL;
    size_t n = 0;
    CHECK_EQ(di_tokenizer_decode(g_tok, r->ids, (size_t)p, false, &dec, &n), DI_OK);
    if (!dec) return;
    CHECK(n <= r->n_text && !memcmp(dec, r->text, n));
    const char *from = after ? strstr(r->text, after) : r->text;
    CHECK(from != NULL);
    const char *at = from ? strstr(from + (after ? strlen(after) : 0), before) : NULL;
    CHECK(at != NULL);
    if (at) CHECK((size_t)(at - r->text) >= n && (size_t)(at - r->text) <= n + slack);
    int32_t *ids = NULL;
    size_t n_ids = 0;
    CHECK_EQ(di_tokenizer_encode(g_tok, dec, n, true, &ids, &n_ids), DI_OK);
    CHECK_EQ(n_ids, (size_t)p);
    CHECK(n_ids == (size_t)p && !memcmp(ids, r->ids, sizeof(int32_t) * n_ids));
    di_tok_free(ids);
    di_tok_free(dec);
}

static void check_point(const rendered *r, int32_t p, const char *after, const char *before) {
    check_point_in(r, p, after, before, 0);
}

#define TOOLS_OAI                                                                                  \
    "[{\"type\":\"function\",\"function\":{\"name\":\"w\",\"description\":\"d\",\"parameters\":{"  \
    "\"type\":\"object\"}}}]"

static void test_system_prefix(void) {
    // Chat: system + tools; the user message shares nothing with the tools' text.
    rendered c = render("{\"messages\":[{\"role\":\"system\",\"content\":\"You are a careful "
                        "assistant. Answer briefly.\"},{\"role\":\"user\",\"content\":\"hello\"}],"
                        "\"tools\":" TOOLS_OAI "}",
                        DI_RENDER_API_CHAT);
    CHECK_EQ(c.st, DI_OK);
    CHECK_EQ(c.pts.n, 1);
    CHECK_EQ(c.pts.at[0], c.pts.system_end);
    CHECK_EQ(c.pts.n_marked, 0);
    check_point(&c, c.pts.system_end, NULL, "<｜User｜>hello");
    CHECK(strstr(c.text, "### Available Tool Schemas") != NULL);
    // The same system prompt with another user message: the same point, the same ids before it.
    rendered c2 = render("{\"messages\":[{\"role\":\"system\",\"content\":\"You are a careful "
                         "assistant. Answer briefly.\"},{\"role\":\"user\",\"content\":\"What is "
                         "2+2?\"}],\"tools\":" TOOLS_OAI "}",
                         DI_RENDER_API_CHAT);
    CHECK_EQ(c2.pts.system_end, c.pts.system_end);
    CHECK(!memcmp(c.ids, c2.ids, sizeof(int32_t) * (size_t)c.pts.system_end));
    CHECK(c2.ids[c.pts.system_end] == c.ids[c.pts.system_end]); // <｜User｜>
    drop(&c2);
    // Two system messages (joined by "\n\n") and a developer one (a system message too).
    rendered d = render("{\"messages\":[{\"role\":\"system\",\"content\":\"A.\"},{\"role\":"
                        "\"developer\",\"content\":\"B.\"},{\"role\":\"user\",\"content\":\"q\"}]}",
                        DI_RENDER_API_CHAT);
    CHECK_EQ(d.st, DI_OK);
    check_point(&d, d.pts.system_end, "A.\n\nB.", "");
    drop(&d);
    // Responses: instructions.
    rendered r =
        render("{\"instructions\":\"Be terse.\",\"input\":\"hi\"}", DI_RENDER_API_RESPONSES);
    CHECK_EQ(r.st, DI_OK);
    CHECK_EQ(r.pts.n, 1);
    check_point(&r, r.pts.system_end, NULL, "<｜User｜>hi");
    drop(&r);
    // Messages: a system string.
    rendered m = render("{\"max_tokens\":5,\"system\":\"Sys prompt.\",\"messages\":[{\"role\":"
                        "\"user\",\"content\":\"hi\"}]}",
                        DI_RENDER_API_MESSAGES);
    CHECK_EQ(m.st, DI_OK);
    CHECK_EQ(m.pts.n, 1);
    check_point(&m, m.pts.system_end, NULL, "<｜User｜>hi");
    drop(&m);
    // No system prefix: no point (BOS alone is no prefix).
    rendered u =
        render("{\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}]}", DI_RENDER_API_CHAT);
    CHECK_EQ(u.st, DI_OK);
    CHECK_EQ(u.pts.n, 0);
    CHECK_EQ(u.pts.system_end, 0);
    drop(&u);
    drop(&c);
}

#define CC ",\"cache_control\":{\"type\":\"ephemeral\"}"

static void test_cache_control(void) {
    // System blocks (the first marked), tools (one marked: the system prefix's end), a user
    // message's last text block, an assistant turn, a tool result.
    const char *req =
        "{\"max_tokens\":5,\"system\":[{\"type\":\"text\",\"text\":\"Rules: be kind.\"" CC "},"
        "{\"type\":\"text\",\"text\":\"Today is Monday.\"}],"
        "\"tools\":[{\"name\":\"w\",\"description\":\"d\",\"input_schema\":{\"type\":"
        "\"object\"}" CC "}],"
        "\"messages\":[{\"role\":\"user\",\"content\":[{\"type\":\"text\",\"text\":\"first\"},"
        "{\"type\":\"text\",\"text\":\"question\"" CC "}]},"
        "{\"role\":\"assistant\",\"content\":[{\"type\":\"text\",\"text\":\"answer\"" CC "}]},"
        "{\"role\":\"user\",\"content\":\"next\"}]}";
    rendered r = render(req, DI_RENDER_API_MESSAGES);
    CHECK_EQ(r.st, DI_OK);
    CHECK_EQ(r.pts.n_marked, 4);
    CHECK_EQ(r.pts.n, 4);
    // System blocks render (joined with "\n\n").
    CHECK(strstr(r.text, "Rules: be kind.\n\nToday is Monday.\n\n## Tools") != NULL);
    // after the first system block: inside plain text, the last token boundary before the
    // block's end (".\n\n" is one token): one byte short, and still exact
    check_point_in(&r, r.pts.at[0], NULL, "\n\nToday is Monday.", 1);
    check_point_in(&r, r.pts.at[0], NULL, ".\n\nToday is Monday.", 0);
    check_point(&r, r.pts.at[1], NULL, "<｜User｜>first");
    CHECK_EQ(r.pts.at[1], r.pts.system_end);
    check_point(&r, r.pts.at[2], NULL, "<｜Assistant｜>");
    check_point(&r, r.pts.at[3], "answer<｜end▁of▁sentence｜>", "");
    drop(&r);
    // A tool result marked: the point after </tool_result>.
    const char *tr =
        "{\"max_tokens\":5,\"messages\":[{\"role\":\"user\",\"content\":\"q\"},"
        "{\"role\":\"assistant\",\"content\":[{\"type\":\"tool_use\",\"id\":\"c1\",\"name\":\"w\","
        "\"input\":{}}]},{\"role\":\"user\",\"content\":[{\"type\":\"tool_result\",\"tool_use_id\":"
        "\"c1\",\"content\":\"sunny\"" CC "}]}],"
        "\"tools\":[{\"name\":\"w\",\"description\":\"d\",\"input_schema\":{\"type\":\"object\"}}]"
        "}";
    rendered t = render(tr, DI_RENDER_API_MESSAGES);
    CHECK_EQ(t.st, DI_OK);
    CHECK_EQ(t.pts.n, 2); // the tool result and the system prefix (the tools)
    check_point(&t, t.pts.at[1], "sunny</tool_result>", "");
    check_point(&t, t.pts.at[0], NULL, "<｜User｜>q");
    drop(&t);
    // Four breakpoints and a system prefix of its own: the four are kept, the automatic one is
    // left out; a breakpoint on the same position as another counts once.
    const char *four =
        "{\"max_tokens\":5,\"system\":\"S.\",\"messages\":["
        "{\"role\":\"user\",\"content\":[{\"type\":\"text\",\"text\":\"a\"" CC "}]},"
        "{\"role\":\"assistant\",\"content\":[{\"type\":\"text\",\"text\":\"b\"" CC "}]},"
        "{\"role\":\"user\",\"content\":[{\"type\":\"text\",\"text\":\"c\"" CC "}]},"
        "{\"role\":\"assistant\",\"content\":[{\"type\":\"text\",\"text\":\"d\"" CC "}]},"
        "{\"role\":\"user\",\"content\":\"e\"}]}";
    rendered f = render(four, DI_RENDER_API_MESSAGES);
    CHECK_EQ(f.st, DI_OK);
    CHECK_EQ(f.pts.n, 4);
    CHECK(f.pts.system_end > 0);
    for (int32_t i = 0; i < f.pts.n; i++) CHECK(f.pts.at[i] != f.pts.system_end);
    for (int32_t i = 1; i < f.pts.n; i++) CHECK(f.pts.at[i] > f.pts.at[i - 1]);
    check_point(&f, f.pts.at[0], "<｜User｜>a", "");
    drop(&f);
    // cache_control is a Messages field: a chat content part carrying one adds no point.
    rendered c = render("{\"messages\":[{\"role\":\"user\",\"content\":[{\"type\":\"text\","
                        "\"text\":\"x\"" CC "}]}]}",
                        DI_RENDER_API_CHAT);
    CHECK_EQ(c.st, DI_OK);
    CHECK_EQ(c.pts.n, 0);
    drop(&c);
}

int main(void) {
    if (di_tokenizer_load_for_model(NULL, &g_tok) != DI_OK) return 1;
    RUN(test_system_prefix);
    RUN(test_cache_control);
    di_tokenizer_destroy(g_tok);
    return test_finish();
}
