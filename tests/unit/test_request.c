// Tests for src/tok/request.c (di_render_request): Chat Completions, Responses and Anthropic
// Messages requests map to the same conversation and so to the same prompt; options and errors.
#include "harness.h"

#include "deepinfer.h"

static di_tokenizer *g_tok;

static char *render(const char *json, di_render_api api, const di_render_options *opt) {
    char *text = NULL;
    size_t n;
    di_status st = di_render_request(NULL, json, strlen(json), api, opt, &text, &n, NULL, NULL);
    return st == DI_OK ? text : NULL;
}

#define TOOLS_OAI                                                                                  \
    "[{\"type\":\"function\",\"function\":{\"name\":\"w\",\"description\":\"d\",\"parameters\":{"  \
    "\"type\":\"object\"}}}]"

static void test_same_prompt_across_apis(void) {
    const char *chat =
        "{\"model\":\"m\",\"messages\":[{\"role\":\"system\",\"content\":\"S\"},"
        "{\"role\":\"user\",\"content\":\"q\"},"
        "{\"role\":\"assistant\",\"content\":\"\",\"reasoning_content\":\"r\",\"tool_calls\":"
        "[{\"id\":\"c1\",\"type\":\"function\",\"function\":{\"name\":\"w\",\"arguments\":\"{"
        "\\\"city\\\": \\\"B\\\"}\"}}]},"
        "{\"role\":\"tool\",\"tool_call_id\":\"c1\",\"content\":\"sunny\"}],"
        "\"tools\":" TOOLS_OAI "}";
    const char *resp =
        "{\"model\":\"m\",\"instructions\":\"S\",\"input\":[{\"role\":\"user\",\"content\":\"q\"},"
        "{\"type\":\"reasoning\",\"content\":[{\"type\":\"reasoning_text\",\"text\":\"r\"}]},"
        "{\"type\":\"function_call\",\"call_id\":\"c1\",\"name\":\"w\",\"arguments\":\"{"
        "\\\"city\\\": \\\"B\\\"}\"},"
        "{\"type\":\"function_call_output\",\"call_id\":\"c1\",\"output\":\"sunny\"}],"
        "\"tools\":[{\"type\":\"function\",\"name\":\"w\",\"description\":\"d\",\"parameters\":{"
        "\"type\":\"object\"}}]}";
    const char *msgs =
        "{\"model\":\"m\",\"max_tokens\":9,\"system\":\"S\",\"messages\":[{\"role\":\"user\","
        "\"content\":\"q\"},"
        "{\"role\":\"assistant\",\"content\":[{\"type\":\"thinking\",\"thinking\":\"r\","
        "\"signature\":\"x\"},"
        "{\"type\":\"tool_use\",\"id\":\"c1\",\"name\":\"w\",\"input\":{\"city\":\"B\"}}]},"
        "{\"role\":\"user\",\"content\":[{\"type\":\"tool_result\",\"tool_use_id\":\"c1\","
        "\"content\":\"sunny\"}]}],"
        "\"tools\":[{\"name\":\"w\",\"description\":\"d\",\"input_schema\":{\"type\":\"object\"}}]"
        "}";
    char *a = render(chat, DI_RENDER_API_CHAT, NULL);
    char *b = render(resp, DI_RENDER_API_RESPONSES, NULL);
    char *c = render(msgs, DI_RENDER_API_MESSAGES, NULL);
    CHECK(a && b && c);
    if (a && b) CHECK_STR_EQ(b, a);
    if (a && c) CHECK_STR_EQ(c, a);
    if (a) {
        CHECK(strstr(a, "<｜User｜><tool_result>sunny</tool_result><｜Assistant｜><think>") !=
              NULL);
        CHECK(strstr(a, "<think>r</think>\n\n<｜DSML｜tool_calls>") != NULL);
        CHECK(strstr(a, "{\"name\": \"w\", \"description\": \"d\", \"parameters\": {\"type\": "
                        "\"object\"}}") != NULL);
    }
    di_tok_free(a);
    di_tok_free(b);
    di_tok_free(c);
}

static void test_options(void) {
    const char *req =
        "{\"messages\":[{\"role\":\"user\",\"content\":\"q\"}],\"reasoning_effort\":\"max\"}";
    char *t = render(req, DI_RENDER_API_CHAT, NULL);
    CHECK(t && strncmp(t, "<｜begin▁of▁sentence｜>Reasoning Effort: Absolute maximum", 50) == 0);
    di_tok_free(t);
    di_render_options o = di_render_options_default();
    o.effort_table_0731 = true;
    t = render(req, DI_RENDER_API_CHAT, &o);
    CHECK(t && strstr(t, "Beyond maximum") != NULL);
    di_tok_free(t);
    o.encoding = 1;
    t = render(req, DI_RENDER_API_CHAT, &o);
    CHECK_STR_EQ(
        t, "<｜begin▁of▁sentence｜><｜System｜>Reasoning Effort: 100 (range 1-100, the higher the "
           "value, the more thorough the reasoning)\n\n<｜User｜>q<｜Assistant｜><think>");
    di_tok_free(t);
    const char *chat_off = "{\"messages\":[{\"role\":\"user\",\"content\":\"q\"}],\"thinking\":{"
                           "\"type\":\"disabled\"}}";
    t = render(chat_off, DI_RENDER_API_CHAT, NULL);
    CHECK_STR_EQ(t, "<｜begin▁of▁sentence｜><｜User｜>q<｜Assistant｜></think>");
    di_tok_free(t);
    // ids through the public API
    char *text;
    size_t n, n_ids;
    int32_t *ids;
    CHECK(di_render_request(g_tok, chat_off, strlen(chat_off), DI_RENDER_API_CHAT, NULL, &text, &n,
                            &ids, &n_ids) == DI_OK);
    CHECK_EQ(n_ids, 5);
    CHECK(n_ids == 5 && ids[0] == 0 && ids[1] == 128803 && ids[3] == 128804 && ids[4] == 128822);
    di_tok_free(text);
    di_tok_free(ids);
}

static void test_errors(void) {
    CHECK(render("not json", DI_RENDER_API_CHAT, NULL) == NULL);
    CHECK(render("[1, 2]", DI_RENDER_API_CHAT, NULL) == NULL);
    CHECK(render("{\"messages\": 5}", DI_RENDER_API_CHAT, NULL) == NULL);
    CHECK(render("{\"messages\": [{\"role\": \"user\", \"content\": \"q\"}], \"reasoning_effort\": "
                 "\"extreme\"}",
                 DI_RENDER_API_CHAT, NULL) == NULL);
    char *t = render("{\"input\": 5}", DI_RENDER_API_RESPONSES, NULL); // no messages: BOS only
    CHECK_STR_EQ(t, "<｜begin▁of▁sentence｜>");
    di_tok_free(t);
    size_t n;
    CHECK_EQ(di_render_request(NULL, NULL, 0, DI_RENDER_API_CHAT, NULL, &t, &n, NULL, NULL),
             DI_ERR_INVALID);
}

// Regression (fuzzer artifact leak-d7913e7d…): an Anthropic tool_use block without "input" leaked
// the {} substituted for it. The leak itself is caught by LeakSanitizer in the ASan build
// (DI_SANITIZE=address); here the prompt is also checked to carry the call with empty arguments.
static void test_tool_use_without_input(void) {
    const char *fuzz_case =
        "{\"model\":\"m\",\"max_tokens\":5,\"system\":[{\"type\":\"text\",\"text\":\"s\"}],"
        "\"messages\":[{\"role\":\"user\",\"content\":\"q\"},{\"role\":\"assistant\","
        "\"content\":[{\"type\":\"thinking\",\"thinking\":\"t\"},{\"type\":\"tool_use\","
        "\"id\":\"a\",\"e\":\"user\",\"content\":\"x\"},{\"type\":\"function_call\","
        "\"call_id\":\"c\",\"name\":\"f\",\"arguse_id\":\"a\",\"content\":\"r\"}]}]}";
    char *t = render(fuzz_case, DI_RENDER_API_MESSAGES, NULL);
    di_tok_free(t); // either outcome is fine; nothing may leak
    const char *named =
        "{\"model\":\"m\",\"max_tokens\":5,\"messages\":[{\"role\":\"user\",\"content\":"
        "\"q\"},{\"role\":\"assistant\",\"content\":[{\"type\":\"tool_use\",\"id\":\"c1\","
        "\"name\":\"w\"}]},{\"role\":\"user\",\"content\":[{\"type\":\"tool_result\","
        "\"tool_use_id\":\"c1\",\"content\":\"ok\"}]}]}";
    t = render(named, DI_RENDER_API_MESSAGES, NULL);
    CHECK(t != NULL);
    if (t) CHECK(strstr(t, "invoke name=\"w\">") != NULL && strstr(t, "tool_calls>") != NULL);
    di_tok_free(t);
}

int main(void) {
    if (di_tokenizer_load_for_model(NULL, &g_tok) != DI_OK) return 1;
    RUN(test_same_prompt_across_apis);
    RUN(test_options);
    RUN(test_errors);
    RUN(test_tool_use_without_input);
    di_tokenizer_destroy(g_tok);
    return test_finish();
}
