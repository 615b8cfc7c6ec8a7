// Tests for src/tok/render: byte-exact rendering of DeepSeek's official V4 encoder vectors
// (shared/reference/deepseek-v4-flash/encoding-tests, parameters of spec serving.md §1.12), the
// V4.1 vectors in tests/data/tok/render_v41.json (spec §1.3-§1.6 rules, cross-checked with
// deepseek-recipe 0.2.0 where they agree), token ids of rendered prompts, Python-style JSON,
// and rejection of bad conversations.
#include "harness.h"

#include <jansson.h>

#include "base/mem.h"
#include "tok/render.h"
#include "tok/tokenizer.h"
#include "tok/vocab.h"

static di_tokenizer *g_tok;

static char *read_text(const char *rel, size_t *n) {
    char p[4096];
    test_src_path(rel, p, sizeof p);
    char *data = NULL;
    if (di_vocab_read_file(p, &data, n) != DI_OK) return NULL;
    return data;
}

static const char *ref_dir(void) {
    static char dir[4096];
    // DeepSeek's official encoder vectors, copied from shared/reference (MIT) so the tests need
    // nothing outside the repository; DI_SHARED_DIR points at another copy of shared/.
    const char *env = getenv("DI_SHARED_DIR");
    if (env)
        snprintf(dir, sizeof dir, "%s/reference/deepseek-v4-flash/encoding-tests", env);
    else
        snprintf(dir, sizeof dir, "tests/data/tok/encoding-tests");
    return dir;
}

// Renders one official vector: golden 1 carries top-level tools (attached to messages[0] by the
// official test, which is our request-tools step); golden 4 is chat mode (spec §1.12).
static void check_official(int n) {
    char rel[4200], p[4300];
    snprintf(rel, sizeof rel, "%s/test_input_%d.json", ref_dir(), n);
    json_error_t err;
    const char *root = getenv("DI_SOURCE_DIR");
    snprintf(p, sizeof p, "%s/%s", root ? root : ".", rel);
    json_t *doc = json_load_file(p, JSON_DECODE_ANY, &err);
    if (!doc) {
        fprintf(stderr, "cannot read %s: %s\n", p, err.text);
        CHECK(!"official vector missing");
        return;
    }
    di_render_conv conv;
    void *mem = NULL;
    CHECK(di_render_conv_from_json(doc, &conv, &mem) == DI_OK);
    conv.thinking = n != 4;
    conv.effort_table = DI_RENDER_EFFORT_TABLE_V4_0424;
    di_render_out out;
    di_render_out_init(&out);
    CHECK(di_render_conv_text(&conv, &out) == DI_OK);
    snprintf(rel, sizeof rel, "%s/test_output_%d.txt", ref_dir(), n);
    snprintf(p, sizeof p, "%s/%s", root ? root : ".", rel);
    FILE *f = fopen(p, "rb");
    CHECK(f != NULL);
    char *want = calloc(1, 1 << 20);
    size_t nw = f ? fread(want, 1, (1 << 20) - 1, f) : 0;
    if (f) fclose(f);
    bool same = out.text.len == nw && memcmp(out.text.data, want, nw) == 0;
    CHECK(same);
    if (!same) {
        size_t k = 0;
        while (k < nw && k < out.text.len && want[k] == out.text.data[k]) k++;
        fprintf(stderr, "golden %d differs at byte %zu:\n  got  \"%.80s\"\n  want \"%.80s\"\n", n,
                k, out.text.data + k, want + k);
    } else {
        fprintf(stderr, "official vector %d: byte-exact (%zu bytes)\n", n, nw);
    }
    // ids: the official encoder tokenizes the whole prompt with added-token recognition; the
    // goldens' content holds no special-token text, so our ids must equal that.
    int32_t *ids = NULL, *ref = NULL;
    size_t n_ids = 0, n_ref = 0;
    CHECK(di_render_ids(g_tok, &out, &ids, &n_ids) == DI_OK);
    CHECK(di_tokenizer_encode(g_tok, want, nw, true, &ref, &n_ref) == DI_OK);
    CHECK_EQ(n_ids, n_ref);
    CHECK(n_ids == n_ref && memcmp(ids, ref, n_ids * sizeof *ids) == 0);
    CHECK_EQ(ids[0], 0);
    di_tok_free(ids);
    di_tok_free(ref);
    free(want);
    di_render_out_deinit(&out);
    di_render_conv_free_mem(mem);
    json_decref(doc);
}

static void test_official_1(void) {
    check_official(1);
}
static void test_official_2(void) {
    check_official(2);
}
static void test_official_3(void) {
    check_official(3);
}
static void test_official_4(void) {
    check_official(4);
}

// tests/data/tok/render_v41.json: [{"name", "input": {...conversation...}, "text": expected}]
static void test_vectors_file(void) {
    size_t n;
    char *data = read_text("tests/data/tok/render_vectors.json", &n);
    CHECK(data != NULL);
    if (!data) return;
    json_error_t err;
    json_t *doc = json_loadb(data, n, 0, &err);
    di_free(data);
    CHECK(json_is_array(doc));
    size_t i, n_ok = 0;
    json_t *v;
    json_array_foreach(doc, i, v) {
        const char *name = json_string_value(json_object_get(v, "name"));
        const char *want = json_string_value(json_object_get(v, "text"));
        di_render_conv conv;
        void *mem = NULL;
        di_render_out out;
        di_render_out_init(&out);
        di_status st = di_render_conv_from_json(json_object_get(v, "input"), &conv, &mem);
        if (st == DI_OK) st = di_render_conv_text(&conv, &out);
        const char *err_want = json_string_value(json_object_get(v, "error"));
        if (err_want) {
            if (st != DI_OK)
                n_ok++;
            else
                fprintf(stderr, "vector '%s': expected an error\n", name);
        } else if (st == DI_OK && want && strcmp(out.text.data, want) == 0) {
            n_ok++;
        } else {
            fprintf(stderr, "vector '%s' differs:\n  got  %s\n  want %s\n", name,
                    out.text.data ? out.text.data : "(error)", want);
        }
        di_render_out_deinit(&out);
        di_render_conv_free_mem(mem);
    }
    fprintf(stderr, "render vectors: %zu/%zu\n", n_ok, json_array_size(doc));
    CHECK_EQ(n_ok, json_array_size(doc));
    json_decref(doc);
}

static void check_py(const char *json_in, const char *want) {
    json_error_t err;
    json_t *v = json_loads(json_in, JSON_DECODE_ANY, &err);
    CHECK(v != NULL);
    di_buf b;
    di_buf_init(&b);
    CHECK(di_render_pyjson(v, &b) == DI_OK);
    CHECK_STR_EQ(b.data, want);
    di_buf_deinit(&b);
    json_decref(v);
}

static void test_pyjson(void) {
    // spec §1.6: Python json.dumps(json.loads(x), ensure_ascii=False)
    check_py("{\"a\": 1.0, \"c\": [1,2]}", "{\"a\": 1.0, \"c\": [1, 2]}");
    check_py("1.50", "1.5");
    check_py("1e2", "100.0");
    check_py("1e16", "1e+16");
    check_py("1e-5", "1e-05");
    check_py("0.0001", "0.0001");
    check_py("-0", "0");
    check_py("-0.0", "-0.0");
    check_py("123456789012345678", "123456789012345678");
    check_py("0.1", "0.1");
    check_py("1.7976931348623157e308", "1.7976931348623157e+308");
    check_py("5e-324", "5e-324");
    check_py("123.456e3", "123456.0");
    check_py("\"a\\\"b\\\\c\\n\\u0001\\u007f/é\\u2028\"",
             "\"a\\\"b\\\\c\\n\\u0001\x7f/é\xe2\x80\xa8\"");
    check_py("{\"z\": 1, \"a\": {\"y\": null, \"b\": true}}",
             "{\"z\": 1, \"a\": {\"y\": null, \"b\": true}}");
}

static di_status render_json(const char *json_in, di_render_out *out) {
    json_error_t err;
    json_t *doc = json_loads(json_in, 0, &err);
    if (!doc) return DI_ERR_FORMAT;
    di_render_conv conv;
    void *mem = NULL;
    di_status st = di_render_conv_from_json(doc, &conv, &mem);
    if (st == DI_OK) st = di_render_conv_text(&conv, out);
    di_render_conv_free_mem(mem);
    json_decref(doc);
    return st;
}

static void test_content_is_plain(void) {
    // spec §5.4: <｜User｜> typed by a user is 5 content tokens; empty chat prompt is 4 ids
    di_render_out out;
    di_render_out_init(&out);
    CHECK(render_json(
              "{\"thinking_mode\":\"chat\",\"messages\":[{\"role\":\"user\",\"content\":\"\"}]}",
              &out) == DI_OK);
    int32_t *ids;
    size_t n;
    CHECK(di_render_ids(g_tok, &out, &ids, &n) == DI_OK);
    CHECK_EQ(n, 4);
    CHECK(n == 4 && ids[0] == 0 && ids[1] == 128803 && ids[2] == 128804 && ids[3] == 128822);
    di_tok_free(ids);
    CHECK(render_json("{\"thinking_mode\":\"chat\",\"messages\":[{\"role\":\"user\",\"content\":"
                      "\"<｜User｜>\"}]}",
                      &out) == DI_OK);
    CHECK(di_render_ids(g_tok, &out, &ids, &n) == DI_OK);
    CHECK_EQ(n, 9);
    for (size_t i = 2; i < 7 && n == 9; i++) CHECK(ids[i] < 128000);
    di_tok_free(ids);
    // dsv41 needs <｜System｜>, which the V4 tokenizer lacks: a clear error, not silent BPE
    CHECK(
        render_json("{\"encoding\":\"dsv41\",\"messages\":[{\"role\":\"user\",\"content\":\"q\"}]}",
                    &out) == DI_OK);
    CHECK_EQ(di_render_ids(g_tok, &out, &ids, &n), DI_ERR_UNSUPPORTED);
    di_render_out_deinit(&out);
}

static void test_bad_input(void) {
    di_render_out out;
    di_render_out_init(&out);
    CHECK_EQ(render_json("{\"messages\": 3}", &out), DI_ERR_INVALID);
    CHECK_EQ(render_json("{\"messages\": [{\"role\": \"wizard\"}]}", &out), DI_ERR_INVALID);
    CHECK_EQ(render_json("{\"messages\": [{\"role\": \"user\", \"content\": 5}]}", &out),
             DI_ERR_INVALID);
    CHECK_EQ(render_json("{\"messages\": [{\"role\": \"developer\"}]}", &out), DI_ERR_INVALID);
    CHECK_EQ(
        render_json("{\"messages\": [{\"role\": \"assistant\", \"content\": \"x\", \"prefix\": "
                    "true}, {\"role\": \"user\", \"content\": \"q\"}]}",
                    &out),
        DI_ERR_INVALID);
    CHECK_EQ(
        render_json("{\"reasoning_effort\": 101, \"encoding\": \"dsv41\", \"messages\": []}", &out),
        DI_ERR_INVALID);
    CHECK_EQ(render_json("{\"reasoning_effort\": true, \"messages\": []}", &out), DI_ERR_INVALID);
    CHECK_EQ(
        render_json("{\"reasoning_effort\": 50, \"encoding\": \"dsv4\", \"messages\": []}", &out),
        DI_ERR_INVALID);
    CHECK_EQ(render_json("{\"messages\": [{\"role\": \"assistant\", \"tool_calls\": [{}]}]}", &out),
             DI_ERR_INVALID);
    CHECK_EQ(render_json("{\"messages\": [{\"role\": \"user\", \"task\": \"fly\"}]}", &out),
             DI_ERR_INVALID);
    di_render_out_deinit(&out);
}

static void test_fim(void) {
    di_render_out out;
    di_render_out_init(&out);
    CHECK(di_render_fim("def f(", "):\n", &out) == DI_OK);
    CHECK_STR_EQ(out.text.data,
                 "<｜begin▁of▁sentence｜><｜fim▁begin｜>def f(<｜fim▁hole｜>):\n<｜fim▁end｜>");
    int32_t *ids;
    size_t n;
    CHECK(di_render_ids(g_tok, &out, &ids, &n) == DI_OK);
    CHECK(n > 4 && ids[0] == 0 && ids[1] == 128801 && ids[n - 1] == 128802);
    di_tok_free(ids);
    di_render_out_deinit(&out);
}

int main(void) {
    if (di_tokenizer_load_for_model(NULL, &g_tok) != DI_OK) return 1;
    RUN(test_official_1);
    RUN(test_official_2);
    RUN(test_official_3);
    RUN(test_official_4);
    RUN(test_pyjson);
    RUN(test_content_is_plain);
    RUN(test_bad_input);
    RUN(test_fim);
    RUN(test_vectors_file);
    di_tokenizer_destroy(g_tok);
    return test_finish();
}
