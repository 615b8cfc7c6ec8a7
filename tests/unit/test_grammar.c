// grammar: the EBNF compiler's errors; the matcher accepting and refusing strings (UTF-8 split
// across advances included); allowed-token masks equal to brute force (advancing a copy of the
// matcher by each token's bytes) on the real DeepSeek V4 vocabulary; the regex converter against
// PCRE2 (full-match semantics) on crafted and random strings; JSON Schema documents accepted and
// refused; matcher limits ending in an error status.
#include "harness.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include "base/mem.h" // di_mem_thread_allocs
#include "grammar/grammar.h"

static di_tokenizer *g_tok;
static di_grammar_vocab *g_vocab;

static di_grammar *compile(di_grammar_kind kind, const char *text, uint32_t flags) {
    di_grammar *g = NULL;
    char err[512];
    di_status st =
        di_grammar_compile(kind, text, text ? strlen(text) : 0, flags, &g, err, sizeof err);
    if (st != DI_OK) fprintf(stderr, "compile failed: %s\n  for: %s\n", err, text);
    return g;
}

// Whether the grammar accepts exactly s (advanced byte by byte, then can_end).
static bool accepts_n(const di_grammar *g, const char *s, size_t n) {
    di_grammar_matcher *m = NULL;
    if (di_grammar_matcher_create(g, NULL, NULL, &m) != DI_OK) return false;
    bool ok = true;
    for (size_t i = 0; i < n && ok; i++) ok = di_grammar_matcher_advance(m, s + i, 1);
    ok = ok && di_grammar_matcher_can_end(m);
    di_grammar_matcher_destroy(m);
    return ok;
}

static bool accepts(const di_grammar *g, const char *s) {
    return accepts_n(g, s, strlen(s));
}

static void expect_error(const char *text, const char *needle) {
    di_grammar *g = NULL;
    char err[512] = "";
    di_status st =
        di_grammar_compile(DI_GRAMMAR_KIND_EBNF, text, strlen(text), 0, &g, err, sizeof err);
    CHECK_EQ(st, DI_ERR_INVALID);
    if (!strstr(err, needle)) fprintf(stderr, "error '%s' lacks '%s'\n", err, needle);
    CHECK(strstr(err, needle) != NULL);
    di_grammar_destroy(g);
}

// ---- compiler ----

static void test_compile_errors(void) {
    expect_error("root ::= \"a\" (", "1:14: unclosed '('");
    expect_error("root ::= \"a\"\nfoo ::= bar", "2:9: undefined rule 'bar'");
    expect_error("root ::= x\nx ::= x \"a\" | \"b\"", "rule 'x' is left-recursive");
    expect_error("root ::= y\ny ::= \"a\"? z \"c\"\nz ::= \"b\"? y \"b\"", "left-recursive");
    expect_error("root ::= \"abc", "1:10: unterminated string literal");
    expect_error("root ::= [a-", "unterminated character class");
    expect_error("root ::= [z-a]", "out of order");
    expect_error("root ::= \"\\q\"", "unknown escape");
    expect_error("root ::= \"a\"{3,2}", "maximum is below the minimum");
    expect_error("root ::= * \"a\"", "must follow an element");
    expect_error("foo ::= \"a\"", "no rule 'root'");
    expect_error("root ::= \"a\"\nroot ::= \"b\"", "defined twice");
    expect_error("root ::= \"a\"{1000000}", "over the limit");
    expect_error("root ::= \"\\xff\\xfe\" \"\xff\"", "invalid UTF-8");
    // Too large: 50 rules of 100,000 elements each.
    char *big = malloc(50 * 40 + 16);
    size_t n = (size_t)sprintf(big, "root ::= r0\n");
    for (int i = 0; i < 50; i++) n += (size_t)sprintf(big + n, "r%d ::= \"a\"{100000}\n", i);
    expect_error(big, "too large");
    free(big);
    // Unused rules are fine; comments and multi-line rules.
    di_grammar *g = compile(DI_GRAMMAR_KIND_EBNF,
                            "# a comment\nroot ::= a\n  | b # trailing\nunused ::= \"z\"\n"
                            "a ::= \"x\"\nb ::= ( \"y\" \n \"w\" )",
                            0);
    CHECK(g != NULL);
    if (g) {
        CHECK(accepts(g, "x"));
        CHECK(accepts(g, "yw"));
        CHECK(!accepts(g, "z"));
    }
    di_grammar_destroy(g);
}

static void test_matcher_strings(void) {
    di_grammar *g = compile(DI_GRAMMAR_KIND_EBNF,
                            "root ::= \"{\" ws pair (\",\" ws pair)* \"}\"\n"
                            "pair ::= key ws \":\" ws num ws\n"
                            "key ::= \"\\\"\" [a-z_]+ \"\\\"\"\n"
                            "num ::= \"-\"? [0-9]{1,3}\n"
                            "ws ::= [ \\t\\n]{0,2}\n",
                            0);
    CHECK(g != NULL);
    if (!g) return;
    CHECK(accepts(g, "{\"a\":1}"));
    CHECK(accepts(g, "{\"a\" : -12 ,  \"b_c\":999}"));
    CHECK(!accepts(g, "{\"a\":1234}"));
    CHECK(!accepts(g, "{\"a\":1"));
    CHECK(!accepts(g, "{\"A\":1}"));
    CHECK(!accepts(g, "{\"a\":1}}"));
    CHECK(!accepts(g, "{\"a\":   1}"));
    di_grammar_destroy(g);

    // Repetition bounds, optional, alternation, '.', negated classes, escapes.
    struct {
        const char *grammar, *yes[4], *no[4];
    } cases[] = {
        {"root ::= \"ab\"{2,3}", {"abab", "ababab"}, {"ab", "abababab", "aba"}},
        {"root ::= [a-c]{2,}", {"ab", "cccccc"}, {"a", "ad", ""}},
        {"root ::= (\"x\" | \"yz\")+ \"!\"?", {"x", "yzx!", "xxyz"}, {"", "y", "!"}},
        {"root ::= . .", {"ab", "é😀", "\n\t"}, {"a", "abc"}},
        {"root ::= [^\"\\\\]*", {"", "abc", "日本"}, {"\"", "a\\"}},
        {"root ::= \"\\x41\\u00e9\\U0001F600\\t\"", {"Aé😀\t"}, {"A"}},
        {"root ::= [α-ω]+", {"αβγ", "ω"}, {"a", "Ω"}},
        {"root ::= \"a\"{0} \"b\"", {"b"}, {"ab"}},
        {"root ::= ( )  \"\" \"c\"", {"c"}, {""}},
    };
    for (size_t k = 0; k < sizeof cases / sizeof cases[0]; k++) {
        di_grammar *h = compile(DI_GRAMMAR_KIND_EBNF, cases[k].grammar, 0);
        CHECK(h != NULL);
        if (!h) continue;
        for (int i = 0; i < 4 && cases[k].yes[i]; i++) {
            if (!accepts(h, cases[k].yes[i]))
                fprintf(stderr, "'%s' should accept '%s'\n", cases[k].grammar, cases[k].yes[i]);
            CHECK(accepts(h, cases[k].yes[i]));
        }
        for (int i = 0; i < 4 && cases[k].no[i]; i++) {
            if (accepts(h, cases[k].no[i]))
                fprintf(stderr, "'%s' should refuse '%s'\n", cases[k].grammar, cases[k].no[i]);
            CHECK(!accepts(h, cases[k].no[i]));
        }
        di_grammar_destroy(h);
    }
}

// A character split across two advances (as across two tokens), can_end / is_done, a refused
// advance leaving the state unchanged.
static void test_utf8_split_and_done(void) {
    di_grammar *g = compile(DI_GRAMMAR_KIND_EBNF, "root ::= [α-ω] \"!\"", 0);
    CHECK(g != NULL);
    if (!g) return;
    di_grammar_matcher *m = NULL;
    CHECK(di_grammar_matcher_create(g, NULL, NULL, &m) == DI_OK);
    const char *beta = "β"; // CE B2
    CHECK(di_grammar_matcher_advance(m, beta, 1));
    CHECK(!di_grammar_matcher_can_end(m));
    CHECK(!di_grammar_matcher_advance(m, "\x80", 1)); // β is CE B2: B2 only, not 80..B0 outside
    CHECK(!di_grammar_matcher_advance(m, "!", 1));
    CHECK(di_grammar_matcher_advance(m, beta + 1, 1)); // the refusals changed nothing
    CHECK(!di_grammar_matcher_is_done(m));
    CHECK(di_grammar_matcher_advance(m, "!", 1));
    CHECK(di_grammar_matcher_can_end(m));
    CHECK(di_grammar_matcher_is_done(m));
    CHECK(!di_grammar_matcher_advance(m, "!", 1));
    di_grammar_matcher_destroy(m);
    di_grammar_destroy(g);
    // can_end but not done: more may follow.
    g = compile(DI_GRAMMAR_KIND_EBNF, "root ::= \"a\"+", 0);
    CHECK(di_grammar_matcher_create(g, NULL, NULL, &m) == DI_OK);
    CHECK(di_grammar_matcher_advance(m, "aa", 2));
    CHECK(di_grammar_matcher_can_end(m));
    CHECK(!di_grammar_matcher_is_done(m));
    di_grammar_matcher_destroy(m);
    di_grammar_destroy(g);
}

// Limits: a deep nesting exceeds max_depth; the matcher reports DI_ERR_UNSUPPORTED.
static void test_limits(void) {
    di_grammar *g = compile(DI_GRAMMAR_KIND_JSON_OBJECT, NULL, 0);
    CHECK(g != NULL);
    if (!g) return;
    di_grammar_matcher_limits lim = di_grammar_matcher_limits_default();
    lim.max_depth = 40;
    di_grammar_matcher *m = NULL;
    CHECK(di_grammar_matcher_create(g, g_vocab, &lim, &m) == DI_OK);
    bool ok = di_grammar_matcher_advance(m, "{\"a\":", 5);
    for (int i = 0; i < 100 && ok; i++) ok = di_grammar_matcher_advance(m, "[", 1);
    CHECK(!ok);
    CHECK_EQ(di_grammar_matcher_status(m), DI_ERR_UNSUPPORTED);
    uint64_t mask[1];
    int32_t n = 0;
    CHECK_EQ(di_grammar_matcher_mask(m, mask, &n), DI_ERR_UNSUPPORTED);
    di_grammar_matcher_destroy(m);
    di_grammar_destroy(g);
}

// ---- masks vs brute force on the real vocabulary ----

// The mask after prefix (bytes) then toks[0..n_toks) (token ids) equals brute force.
static void check_mask_toks(const di_grammar *g, const char *prefix, const int32_t *toks,
                            int n_toks) {
    di_grammar_matcher *m = NULL, *c = NULL;
    CHECK(di_grammar_matcher_create(g, g_vocab, NULL, &m) == DI_OK);
    CHECK(di_grammar_matcher_create(g, g_vocab, NULL, &c) == DI_OK);
    if (!m || !c) goto out;
    for (const char *p = prefix; *p; p++) {
        if (!di_grammar_matcher_advance(m, p, 1)) {
            fprintf(stderr, "prefix '%s' refused at %zu\n", prefix, (size_t)(p - prefix));
            CHECK(false);
            goto out;
        }
    }
    for (int i = 0; i < n_toks; i++) {
        if (!di_grammar_matcher_advance_token(m, toks[i])) {
            fprintf(stderr, "prefix '%s': token %d refused\n", prefix, (int)toks[i]);
            CHECK(false);
            goto out;
        }
    }
    const int32_t V = di_grammar_vocab_n_tokens(g_vocab);
    uint64_t *mask = calloc((size_t)(V + 63) / 64, 8);
    int32_t n_allowed = -1, n_brute = 0, n_bad = 0;
    const int64_t a0 = di_mem_thread_allocs();
    CHECK(di_grammar_matcher_mask(m, mask, &n_allowed) == DI_OK);
    CHECK_EQ(di_mem_thread_allocs() - a0, 0); // the step path allocates nothing
    for (int32_t id = 0; id < V; id++) {
        di_grammar_matcher_copy(c, m);
        const int64_t a1 = di_mem_thread_allocs();
        bool want = di_grammar_matcher_advance_token(c, id);
        if (di_mem_thread_allocs() != a1) n_bad++;
        bool got = (mask[id >> 6] >> (id & 63)) & 1;
        n_brute += want;
        if (want != got && n_bad++ < 5) {
            size_t nb = 0;
            const char *b = di_tokenizer_token_bytes(g_tok, id, &nb);
            fprintf(stderr, "prefix '%s': token %d '%.*s': mask %d, brute force %d\n", prefix,
                    (int)id, (int)nb, b ? b : "", got, want);
        }
    }
    CHECK_EQ(n_bad, 0);
    CHECK_EQ(n_allowed, n_brute);
    // A second call (the cache) gives the same mask.
    uint64_t *again = calloc((size_t)(V + 63) / 64, 8);
    int32_t n2 = -1;
    CHECK(di_grammar_matcher_mask(m, again, &n2) == DI_OK);
    CHECK(!memcmp(mask, again, (size_t)(V + 63) / 64 * 8));
    CHECK_EQ(n2, n_allowed);
    free(again);
    free(mask);
out:
    di_grammar_matcher_destroy(m);
    di_grammar_matcher_destroy(c);
}

static void check_mask(const di_grammar *g, const char *prefix) {
    check_mask_toks(g, prefix, NULL, 0);
}

static void test_mask_brute_force(void) {
    if (!g_vocab) return;
    const char *schema =
        "{\"type\":\"object\",\"properties\":{\"name\":{\"type\":\"string\"},\"age\":{\"type\":"
        "\"integer\"},\"tags\":{\"type\":\"array\",\"items\":{\"type\":\"string\"},\"maxItems\":3},"
        "\"ok\":{\"type\":\"boolean\"}},\"required\":[\"name\",\"age\"],\"additionalProperties\":"
        "false}";
    di_grammar *g = compile(DI_GRAMMAR_KIND_JSON_SCHEMA, schema, 0);
    CHECK(g != NULL);
    if (g) {
        const char *states[] = {"",
                                "{",
                                "{\"na",
                                "{\"name\": \"Jo",
                                "{\"name\":\"x\\",
                                "{\"name\":\"é",
                                "{\"name\":\"\xe6",
                                "{\"name\":\"a\",\"age\":4",
                                "{\"name\":\"a\",\"age\":4,\"tags\":[",
                                "{\"name\":\"a\",\"age\":4}"};
        for (size_t i = 0; i < sizeof states / sizeof states[0]; i++) check_mask(g, states[i]);
    }
    di_grammar_destroy(g);
    g = compile(DI_GRAMMAR_KIND_REGEX, "[0-9]{3}-[a-z]+( [A-Z]\\w*)?", 0);
    if (g) {
        check_mask(g, "");
        check_mask(g, "12");
        check_mask(g, "123-ab");
    }
    di_grammar_destroy(g);
    g = compile(DI_GRAMMAR_KIND_EBNF, "root ::= [α-ω]+ \"日本\" | \"  \"* \"x\"", 0);
    if (g) {
        check_mask(g, "");
        check_mask(g, "\xce");
        check_mask(g, "  ");
    }
    di_grammar_destroy(g);
}

// Token terminals <[id]>: a special token as a unit. Bytes never match one, it never matches
// bytes; masks set its bit exactly when it can come next (brute force advances every id).
static void test_token_terminals(void) {
    expect_error("root ::= <[12a]>", "1:10: expected a token terminal <[id]>");
    expect_error("root ::= <12>", "expected a token terminal");
    expect_error("root ::= <[99999999999]>", "out of range");
    // A token terminal consumes input: this is not left-recursive; the next one is.
    di_grammar *g = compile(DI_GRAMMAR_KIND_EBNF, "root ::= <[7]>? x\nx ::= <[7]> x | \"a\"", 0);
    CHECK(g != NULL);
    di_grammar_destroy(g);
    expect_error("root ::= x\nx ::= y? x <[7]> | \"b\"\ny ::= \"c\"", "left-recursive");
    if (!g_vocab) return;
    const int32_t dsml = 128825, eos = 1;
    size_t nb = 0;
    const char *dsml_text = di_tokenizer_token_bytes(g_tok, dsml, &nb);
    CHECK(dsml_text && nb == strlen("｜DSML｜") && !memcmp(dsml_text, "｜DSML｜", nb));
    CHECK(di_grammar_vocab_token(g_vocab, dsml, &nb) == NULL); // special: not in the trie
    // The DSML terminal beside the same text spelled in bytes; EOS as a terminal; token 100 (an
    // ordinary token) as a terminal too: it advances by its bytes or as the terminal (the union).
    char text[512];
    size_t n100 = 0;
    const char *t100 = di_tokenizer_token_bytes(g_tok, 100, &n100);
    CHECK(t100 && n100 > 0);
    snprintf(text, sizeof text,
             "root ::= \"<\" <[%d]> \"tool_calls>\" body | \"<tool\" [a-z_]* | \"<\" \"｜DSML｜\" "
             "\"x\" | <[%d]> \"x\" | <[%d]> \"y\" | [!-~]+\nbody ::= \"\\n\" <[%d]>? \"z\"",
             dsml, eos, 100, dsml);
    g = compile(DI_GRAMMAR_KIND_EBNF, text, 0);
    CHECK(g != NULL);
    if (!g) return;
    const int32_t t_dsml[] = {dsml}, t_eos[] = {eos}, t_100[] = {100};
    check_mask(g, "");
    check_mask(g, "<");
    check_mask_toks(g, "<", t_dsml, 1);
    check_mask(g, "<tool_calls");
    check_mask_toks(g, "", t_eos, 1);
    check_mask_toks(g, "", t_100, 1);
    {
        di_grammar_matcher *m = NULL;
        CHECK(di_grammar_matcher_create(g, g_vocab, NULL, &m) == DI_OK);
        if (m) {
            CHECK(di_grammar_matcher_advance(m, "<", 1));
            CHECK(di_grammar_matcher_advance_token(m, dsml));
            CHECK(!di_grammar_matcher_advance_token(m, dsml)); // bytes expected next
            CHECK(!di_grammar_matcher_advance(m, "x", 1));     // the text branch is gone
            CHECK(di_grammar_matcher_advance(m, "tool_calls>\n", 12));
            di_grammar_matcher *c = NULL;
            CHECK(di_grammar_matcher_create(g, g_vocab, NULL, &c) == DI_OK);
            if (c) {
                di_grammar_matcher_copy(c, m);
                CHECK(di_grammar_matcher_advance(c, "z", 1)); // the terminal is optional
                CHECK(di_grammar_matcher_is_done(c));
                di_grammar_matcher_destroy(c);
            }
            CHECK(di_grammar_matcher_advance_token(m, dsml));
            CHECK(!di_grammar_matcher_can_end(m));
            CHECK(di_grammar_matcher_advance(m, "z", 1));
            CHECK(di_grammar_matcher_is_done(m));
            di_grammar_matcher_destroy(m);
        }
        // The same text in bytes is the other branch, never the terminal.
        m = NULL;
        CHECK(di_grammar_matcher_create(g, g_vocab, NULL, &m) == DI_OK);
        if (m) {
            CHECK(di_grammar_matcher_advance(m, "<｜DSML｜", strlen("<｜DSML｜")));
            CHECK(!di_grammar_matcher_advance(m, "tool_calls>", 11));
            CHECK(di_grammar_matcher_advance(m, "x", 1));
            CHECK(di_grammar_matcher_is_done(m));
            di_grammar_matcher_destroy(m);
        }
    }
    di_grammar_destroy(g);
}

// ---- tool-call grammars (tools.c) ----

// Whether g accepts exactly s, where each "｜DSML｜" in s is the special token (a token terminal)
// and everything else is bytes.
static bool accepts_dsml(const di_grammar *g, const char *s) {
    const int32_t dsml = di_tokenizer_token_id(g_tok, "｜DSML｜");
    di_grammar_matcher *m = NULL;
    if (di_grammar_matcher_create(g, g_vocab, NULL, &m) != DI_OK) return false;
    bool ok = true;
    while (ok && *s) {
        const char *d = strstr(s, "｜DSML｜");
        size_t n = d ? (size_t)(d - s) : strlen(s);
        for (size_t i = 0; i < n && ok; i++) ok = di_grammar_matcher_advance(m, s + i, 1);
        s += n;
        if (ok && d) {
            ok = di_grammar_matcher_advance_token(m, dsml);
            s += strlen("｜DSML｜");
        }
    }
    ok = ok && di_grammar_matcher_can_end(m);
    di_grammar_matcher_destroy(m);
    return ok;
}

static di_grammar *tools_grammar(const char *tools, const char *name, bool parallel, int enc) {
    di_grammar_tools_options o = {.name = name, .parallel = parallel, .encoding = enc};
    di_grammar *g = NULL;
    char err[512] = "";
    di_status st = di_grammar_compile_tools(g_tok, tools, strlen(tools), &o, &g, err, sizeof err);
    if (st != DI_OK) fprintf(stderr, "tools grammar: %s\n", err);
    return g;
}

static const char k_tools[] =
    "[{\"type\":\"function\",\"function\":{\"name\":\"get_weather\",\"parameters\":{\"type\":"
    "\"object\",\"properties\":{\"location\":{\"type\":\"string\"},\"unit\":{\"type\":\"string\","
    "\"enum\":[\"c\",\"f\"]},\"days\":{\"type\":\"integer\",\"minimum\":1,\"maximum\":7}},"
    "\"required\":[\"location\"]}}},"
    "{\"type\":\"function\",\"function\":{\"name\":\"search\",\"parameters\":{\"type\":\"object\","
    "\"properties\":{\"query\":{\"type\":\"string\",\"maxLength\":20},\"filters\":{\"type\":"
    "\"object\",\"properties\":{\"site\":{\"type\":\"string\"}},\"required\":[\"site\"],"
    "\"additionalProperties\":false}},\"required\":[\"query\",\"filters\"]}}},"
    "{\"name\":\"now\",\"input_schema\":{\"type\":\"object\"}}]";

#define W_OPEN "<｜DSML｜invoke name=\"get_weather\">\n"
#define W_LOC                                                                                      \
    "<｜DSML｜parameter name=\"location\" string=\"true\">Beijing, 北京</｜DSML｜parameter>"
#define W_UNIT "<｜DSML｜parameter name=\"unit\" string=\"true\">c</｜DSML｜parameter>"
#define W_DAYS "<｜DSML｜parameter name=\"days\" string=\"false\">3</｜DSML｜parameter>"
#define I_CLOSE "\n</｜DSML｜invoke>"
#define B_CLOSE "\n</｜DSML｜tool_calls>"
#define S_CALL                                                                                     \
    "<｜DSML｜invoke name=\"search\">\n<｜DSML｜parameter name=\"query\" "                     \
    "string=\"false\">\"deep \\\"infer\\\"\"</｜DSML｜parameter>\n<｜DSML｜parameter "         \
    "name=\"filters\" string=\"false\">{\"site\": \"x.org\"}</｜DSML｜parameter>" I_CLOSE
#define N_CALL "<｜DSML｜invoke name=\"now\">\n\n</｜DSML｜invoke>"

static void test_tool_grammars(void) {
    if (!g_tok) return;
    di_grammar *g = tools_grammar(k_tools, NULL, true, 0);
    CHECK(g != NULL);
    if (g) {
        CHECK(accepts_dsml(g, W_OPEN W_LOC I_CLOSE B_CLOSE));
        CHECK(accepts_dsml(g, W_OPEN W_LOC "\n" W_UNIT "\n" W_DAYS I_CLOSE B_CLOSE));
        CHECK(accepts_dsml(g, W_OPEN W_LOC "\n" W_DAYS I_CLOSE "\n" S_CALL "\n" N_CALL B_CLOSE));
        CHECK(accepts_dsml(g, S_CALL B_CLOSE));
        CHECK(accepts_dsml(g, N_CALL B_CLOSE));
        // refused: an unknown tool, a missing required parameter, an undeclared one, declared
        // order broken, a value outside its schema, the wrong string= form, '｜' in a raw value,
        // a tag spelled in text, no closing tag, text after the block
        CHECK(!accepts_dsml(g, "<｜DSML｜invoke name=\"get_wether\">\n" W_LOC I_CLOSE B_CLOSE));
        CHECK(!accepts_dsml(g, W_OPEN W_UNIT I_CLOSE B_CLOSE));
        CHECK(!accepts_dsml(g, W_OPEN W_LOC "\n<｜DSML｜parameter name=\"city\" string=\"true\">x"
                                            "</｜DSML｜parameter>" I_CLOSE B_CLOSE));
        CHECK(!accepts_dsml(g, W_OPEN W_LOC "\n" W_DAYS "\n" W_UNIT I_CLOSE B_CLOSE));
        CHECK(!accepts_dsml(g, W_OPEN W_LOC "\n<｜DSML｜parameter name=\"days\" string=\"false\">"
                                            "9</｜DSML｜parameter>" I_CLOSE B_CLOSE));
        CHECK(!accepts_dsml(g, W_OPEN W_LOC "\n<｜DSML｜parameter name=\"unit\" string=\"true\">"
                                            "k</｜DSML｜parameter>" I_CLOSE B_CLOSE));
        CHECK(!accepts_dsml(g, W_OPEN "<｜DSML｜parameter name=\"location\" string=\"false\">"
                                      "\"x\"</｜DSML｜parameter>" I_CLOSE B_CLOSE));
        CHECK(!accepts_dsml(g, W_OPEN "<｜DSML｜parameter name=\"location\" string=\"true\">"
                                      "a｜b</｜DSML｜parameter>" I_CLOSE B_CLOSE));
        CHECK(!accepts_dsml(g,
                            "<｜DSML｜invoke name=\"search\">\n<｜DSML｜parameter name=\"query\" "
                            "string=\"false\">\"abc\"</｜DSML｜parameter>" I_CLOSE B_CLOSE));
        CHECK(!accepts_dsml(g,
                            "<｜DSML｜invoke name=\"search\">\n<｜DSML｜parameter name=\"query\" "
                            "string=\"false\">\"0123456789012345678901\"</｜DSML｜parameter>\n"
                            "<｜DSML｜parameter name=\"filters\" string=\"false\">{\"site\": "
                            "\"x\"}</｜DSML｜parameter>" I_CLOSE B_CLOSE));
        CHECK(!accepts_dsml(g, W_OPEN W_LOC I_CLOSE));
        CHECK(!accepts_dsml(g, W_OPEN W_LOC I_CLOSE B_CLOSE "\n"));
        CHECK(!accepts_dsml(g, "<|DSML|invoke name=\"now\">\n\n</｜DSML｜invoke>" B_CLOSE));
        CHECK(!accepts_dsml(g, ""));
        // The text spelling of the token is refused where a tag goes (accepts_n: bytes only).
        const char *as_text = N_CALL B_CLOSE;
        CHECK(!accepts_n(g, as_text, strlen(as_text)));
        // masks equal brute force inside a tool grammar (tag positions, a raw value, JSON)
        const int32_t dsml = di_tokenizer_token_id(g_tok, "｜DSML｜");
        const int32_t t1[] = {dsml};
        check_mask(g, "");
        check_mask(g, "<");
        check_mask_toks(g, "<", t1, 1);
        check_mask(g, "");
        di_grammar_destroy(g);
    }
    // parallel_tool_calls false: exactly one invoke
    g = tools_grammar(k_tools, NULL, false, 0);
    CHECK(g != NULL);
    if (g) {
        CHECK(accepts_dsml(g, N_CALL B_CLOSE));
        CHECK(!accepts_dsml(g, N_CALL "\n" N_CALL B_CLOSE));
        CHECK(!accepts_dsml(g, W_OPEN W_LOC I_CLOSE "\n" N_CALL B_CLOSE));
        di_grammar_destroy(g);
    }
    // a named tool: only that one
    g = tools_grammar(k_tools, "get_weather", true, 0);
    CHECK(g != NULL);
    if (g) {
        CHECK(accepts_dsml(g, W_OPEN W_LOC I_CLOSE B_CLOSE));
        CHECK(accepts_dsml(g, W_OPEN W_LOC I_CLOSE "\n" W_OPEN W_LOC "\n" W_UNIT I_CLOSE B_CLOSE));
        CHECK(!accepts_dsml(g, N_CALL B_CLOSE));
        CHECK(!accepts_dsml(g, W_OPEN W_LOC I_CLOSE "\n" N_CALL B_CLOSE));
        di_grammar_destroy(g);
    }
    // V4.1 spelling: " calls", " invoke", " parameter"
    g = tools_grammar(k_tools, "get_weather", false, 1);
    CHECK(g != NULL);
    if (g) {
        CHECK(accepts_dsml(g, "<｜DSML｜ invoke name=\"get_weather\">\n<｜DSML｜ parameter "
                              "name=\"location\" string=\"true\">Paris</｜DSML｜ parameter>\n"
                              "</｜DSML｜ invoke>\n</｜DSML｜ calls>"));
        CHECK(!accepts_dsml(g, W_OPEN W_LOC I_CLOSE B_CLOSE));
        di_grammar_destroy(g);
    }
    // where the grammar starts: after the first ｜DSML｜ token (tool_choice auto), the whole block
    // (in a union with a response format)
    di_grammar_tools_options os = {.parallel = true, .start = DI_GRAMMAR_TOOLS_AFTER_DSML};
    g = NULL;
    CHECK(di_grammar_compile_tools(g_tok, k_tools, strlen(k_tools), &os, &g, NULL, 0) == DI_OK);
    if (g) {
        CHECK(accepts_dsml(g, "tool_calls>\n" N_CALL B_CLOSE));
        CHECK(!accepts_dsml(g, N_CALL B_CLOSE));
        di_grammar_destroy(g);
    }
    os.start = DI_GRAMMAR_TOOLS_BLOCK;
    di_grammar *blk = NULL;
    CHECK(di_grammar_compile_tools(g_tok, k_tools, strlen(k_tools), &os, &blk, NULL, 0) == DI_OK);
    di_grammar *fmt = compile(DI_GRAMMAR_KIND_JSON_SCHEMA,
                              "{\"type\":\"object\",\"properties\":{\"a\":{\"type\":\"integer\"}},"
                              "\"required\":[\"a\"],\"additionalProperties\":false}",
                              0);
    g = NULL;
    CHECK(blk && fmt && di_grammar_union(fmt, blk, &g) == DI_OK);
    if (g) {
        CHECK(accepts_dsml(g, "{\"a\": 12}"));
        CHECK(accepts_dsml(g, "\n\n<｜DSML｜tool_calls>\n" N_CALL B_CLOSE));
        CHECK(accepts_dsml(g, "<｜DSML｜tool_calls>\n" W_OPEN W_LOC I_CLOSE B_CLOSE));
        CHECK(!accepts_dsml(g, "\n\n\n<｜DSML｜tool_calls>\n" N_CALL B_CLOSE));
        CHECK(!accepts_dsml(g, "{\"a\": 12}\n\n<｜DSML｜tool_calls>\n" N_CALL B_CLOSE));
        CHECK(!accepts_dsml(g, "{\"b\": 12}"));
        CHECK(!accepts_dsml(g, "\n\n<｜DSML｜tool_calls>\n" B_CLOSE));
        const int32_t dsml = di_tokenizer_token_id(g_tok, "｜DSML｜");
        const int32_t t1[] = {dsml};
        check_mask(g, "");
        check_mask(g, "\n\n<");
        check_mask_toks(g, "\n\n<", t1, 1);
        check_mask(g, "{\"a\":");
        di_grammar_destroy(g);
    }
    di_grammar_destroy(blk);
    di_grammar_destroy(fmt);
    // errors: unknown named tool, a schema the converter refuses (named: tool and pointer), a
    // name DSML cannot carry, no tokenizer token
    di_grammar_tools_options o = {.name = "nope", .parallel = true};
    char err[512] = "";
    CHECK(di_grammar_compile_tools(g_tok, k_tools, strlen(k_tools), &o, &g, err, sizeof err) ==
          DI_ERR_INVALID);
    CHECK(strstr(err, "no tool named 'nope'") != NULL);
    const char *bad =
        "[{\"name\":\"a\",\"parameters\":{\"properties\":{\"x\":{\"type\":\"integer\"}}}},"
        "{\"name\":\"b\",\"parameters\":{\"properties\":{\"y\":{\"not\":{}}}}}]";
    o = (di_grammar_tools_options){.parallel = true};
    CHECK(di_grammar_compile_tools(g_tok, bad, strlen(bad), &o, &g, err, sizeof err) ==
          DI_ERR_INVALID);
    CHECK(strstr(err, "tools[1] 'b' parameters: JSON Schema at '#/properties/y': keyword 'not'") !=
          NULL);
    if (!strstr(err, "tools[1] 'b'")) fprintf(stderr, "error: %s\n", err);
    o.name = "a"; // only the named tool's schemas are compiled
    CHECK(di_grammar_compile_tools(g_tok, bad, strlen(bad), &o, &g, err, sizeof err) == DI_OK);
    di_grammar_destroy(g);
    const char *quote = "[{\"name\":\"a\",\"parameters\":{\"properties\":{\"x\\\"y\":{}}}}]";
    CHECK(di_grammar_compile_tools(g_tok, quote, strlen(quote), NULL, &g, err, sizeof err) ==
          DI_ERR_INVALID);
    CHECK(strstr(err, "cannot be written in DSML") != NULL);
    CHECK(di_grammar_compile_tools(NULL, k_tools, strlen(k_tools), NULL, &g, err, sizeof err) ==
          DI_ERR_UNSUPPORTED);
    // parameters defined other than by "properties" are refused (not narrowed to none)
    const char *refd = "[{\"name\":\"a\",\"parameters\":{\"$ref\":\"#/$defs/A\",\"$defs\":{\"A\":"
                       "{\"type\":\"object\"}}}}]";
    CHECK(di_grammar_compile_tools(g_tok, refd, strlen(refd), NULL, &g, err, sizeof err) ==
          DI_ERR_INVALID);
    CHECK(strstr(err, "'$ref' at the top level is not supported") != NULL);
    const char *dict = "[{\"name\":\"a\",\"parameters\":{\"type\":\"object\","
                       "\"additionalProperties\":{\"type\":\"string\"}}}]";
    CHECK(di_grammar_compile_tools(g_tok, dict, strlen(dict), NULL, &g, err, sizeof err) ==
          DI_ERR_INVALID);
    CHECK(strstr(err, "'additionalProperties' at the top level") != NULL);
    const char *closed = "[{\"name\":\"a\",\"parameters\":{\"type\":\"object\",\"properties\":{"
                         "\"x\":{\"type\":\"integer\"}},\"additionalProperties\":false}}]";
    g = NULL;
    CHECK(di_grammar_compile_tools(g_tok, closed, strlen(closed), NULL, &g, err, sizeof err) ==
          DI_OK);
    CHECK(g && accepts_dsml(g, "<｜DSML｜invoke name=\"a\">\n<｜DSML｜parameter name=\"x\" "
                               "string=\"false\">-4</｜DSML｜parameter>\n</｜DSML｜invoke>\n"
                               "</｜DSML｜tool_calls>"));
    di_grammar_destroy(g);
}

// ---- regex vs PCRE2 ----

static uint64_t g_rng = 88172645463325252ull;
static uint32_t rnd(void) {
    g_rng ^= g_rng << 13, g_rng ^= g_rng >> 7, g_rng ^= g_rng << 17;
    return (uint32_t)(g_rng >> 11);
}

static int n_regex_cases;

static void regex_diff(const char *re, const char *alphabet) {
    di_grammar *g = compile(DI_GRAMMAR_KIND_REGEX, re, 0);
    CHECK(g != NULL);
    int ec;
    PCRE2_SIZE eo;
    pcre2_code *pc = pcre2_compile((PCRE2_SPTR)re, PCRE2_ZERO_TERMINATED,
                                   PCRE2_UTF | PCRE2_ALT_BSUX | PCRE2_ANCHORED | PCRE2_ENDANCHORED,
                                   &ec, &eo, NULL);
    CHECK(pc != NULL);
    if (!g || !pc) goto out;
    pcre2_match_data *md = pcre2_match_data_create_from_pattern(pc, NULL);
    // The alphabet's characters (UTF-8), for random strings.
    const char *chars[64];
    int n_chars = 0;
    for (const char *p = alphabet; *p && n_chars < 64;) {
        chars[n_chars++] = p;
        p++;
        while ((*p & 0xC0) == 0x80) p++;
    }
    int n_yes = 0;
    for (int t = 0; t < 400; t++) {
        char s[128];
        size_t n = 0;
        int len = (int)(rnd() % 12);
        for (int i = 0; i < len; i++) {
            const char *c = chars[rnd() % (uint32_t)n_chars];
            size_t cl = 1;
            while ((c[cl] & 0xC0) == 0x80) cl++;
            memcpy(s + n, c, cl);
            n += cl;
        }
        s[n] = 0;
        bool want = pcre2_match(pc, (PCRE2_SPTR)s, n, 0, 0, md, NULL) >= 0;
        bool got = accepts_n(g, s, n);
        n_yes += want;
        if (want != got)
            fprintf(stderr, "regex /%s/ on '%s': pcre2 %d, grammar %d\n", re, s, want, got);
        CHECK_EQ(want, got);
        n_regex_cases++;
    }
    (void)n_yes;
    pcre2_match_data_free(md);
out:
    pcre2_code_free(pc);
    di_grammar_destroy(g);
}

static void test_regex_pcre2(void) {
    struct {
        const char *re, *alphabet;
    } cases[] = {
        {"a*b+c?", "abc"},
        {"(ab|a)(c|bcd)?d", "abcd"},
        {"[a-c]{2,3}x{0,2}", "abcx"},
        {"^\\d{1,3}(\\.\\d+)?$", "0123.a"},
        {"\\w+@\\w+\\.(com|org)", "ab@.comrg_1"},
        {"[^a-c]+", "abcdé\n"},
        {"(?:x|yz)*", "xyz"},
        {"a.c", "abc\né"},
        {"[\\s\\d]+", " 1\t2x"},
        {"\\D\\W\\S", "a1 !"},
        {"(a|b)+(ab)?", "ab"},
        {"colou?r", "colur"},
        {"[-+]?[0-9]*\\.?[0-9]+([eE][-+]?[0-9]+)?", "0123.eE+-"},
        {"(é|ü)+\\u00e9", "éüa"},
        {"\\(\\)\\[\\]\\{\\}", "()[]{}"},
        {"x{2}y{1,}z{0,1}", "xyz"},
        {"((a)|b)c", "abc"},
        {"[a\\-z]+", "a-zb"},
        {"\\x41\\u0042", "ABC"},
        {"", "a"},
        {"a|", "ab"},
        {"[.]\\.", ".a"},
        {"(?<year>\\d{2})-\\d", "12-3"},
    };
    for (size_t k = 0; k < sizeof cases / sizeof cases[0]; k++)
        regex_diff(cases[k].re, cases[k].alphabet);
    // Random regexes over a small alphabet.
    for (int t = 0; t < 60; t++) {
        char re[64];
        size_t n = 0;
        int atoms = 1 + (int)(rnd() % 5);
        for (int a = 0; a < atoms; a++) {
            static const char *const at[] = {"a", "b",      "[ab]",   "[^a]",
                                             ".", "(a|bc)", "(?:b|)", "\\d"};
            n += (size_t)sprintf(re + n, "%s", at[rnd() % 8]);
            static const char *const q[] = {"", "", "*", "+", "?", "{2}", "{1,2}", "{0,}"};
            n += (size_t)sprintf(re + n, "%s", q[rnd() % 8]);
        }
        regex_diff(re, "abc1");
    }
    // Refused constructs.
    const char *bad[] = {"(a)\\1", "a(?=b)", "a+?", "\\bx", "a^b",
                         "a$b",    "[b-a]",  "(a",  "a)",   "x**"};
    for (size_t k = 0; k < sizeof bad / sizeof bad[0]; k++) {
        di_grammar *g = NULL;
        char err[256] = "";
        CHECK_EQ(di_grammar_compile(DI_GRAMMAR_KIND_REGEX, bad[k], strlen(bad[k]), 0, &g, err,
                                    sizeof err),
                 DI_ERR_INVALID);
        CHECK(err[0] != 0);
        di_grammar_destroy(g);
    }
    printf("regex vs PCRE2: %d strings\n", n_regex_cases);
}

// ---- JSON Schema ----

static void schema_case(const char *schema, uint32_t flags, const char *const *yes,
                        const char *const *no) {
    di_grammar *g = compile(DI_GRAMMAR_KIND_JSON_SCHEMA, schema, flags);
    CHECK(g != NULL);
    if (!g) return;
    for (; yes && *yes; yes++) {
        if (!accepts(g, *yes)) fprintf(stderr, "schema %s should accept %s\n", schema, *yes);
        CHECK(accepts(g, *yes));
    }
    for (; no && *no; no++) {
        if (accepts(g, *no)) fprintf(stderr, "schema %s should refuse %s\n", schema, *no);
        CHECK(!accepts(g, *no));
    }
    di_grammar_destroy(g);
}

static void schema_error(const char *schema, const char *needle) {
    di_grammar *g = NULL;
    char err[512] = "";
    CHECK_EQ(di_grammar_compile(DI_GRAMMAR_KIND_JSON_SCHEMA, schema, strlen(schema), 0, &g, err,
                                sizeof err),
             DI_ERR_INVALID);
    if (!strstr(err, needle)) fprintf(stderr, "schema error '%s' lacks '%s'\n", err, needle);
    CHECK(strstr(err, needle) != NULL);
    di_grammar_destroy(g);
}

static void test_json_schema(void) {
    schema_case("{\"type\":\"object\",\"properties\":{\"a\":{\"type\":\"integer\"},\"b\":{\"type\":"
                "\"string\"}},\"required\":[\"a\"],\"additionalProperties\":false}",
                0,
                (const char *[]){"{\"a\":1}", "{\"a\":-20,\"b\":\"x\"}",
                                 "{ \"a\": 1, \"b\": \"\" }", "{\n  \"a\": 1\n}", NULL},
                (const char *[]){"{}", "{\"b\":\"x\"}", "{\"b\":\"x\",\"a\":1}",
                                 "{\"a\":1,\"c\":2}", "{\"a\":1.5}", "{\"a\":01}", "{\"a\":1}x",
                                 NULL});
    // Default additionalProperties: allowed (after the declared ones), none in strict mode.
    const char *open = "{\"type\":\"object\",\"properties\":{\"a\":{\"type\":\"null\"}}}";
    // (An extra property may repeat a declared name: not excluded, docs/structured-output.md.)
    schema_case(open, 0, (const char *[]){"{\"a\":null,\"z\":[1,{}]}", "{\"q\":true}", "{}", NULL},
                (const char *[]){"{\"a\":null,}", "{\"q\"}", NULL});
    schema_case(open, DI_GRAMMAR_FLAG_STRICT, (const char *[]){"{\"a\":null}", "{}", NULL},
                (const char *[]){"{\"a\":null,\"z\":1}", NULL});
    // Arrays: items, min/max, prefixItems.
    schema_case(
        "{\"type\":\"array\",\"items\":{\"type\":\"number\"},\"minItems\":1,\"maxItems\":3}", 0,
        (const char *[]){"[1]", "[1, 2.5e3, -0.5]", NULL},
        (const char *[]){"[]", "[1,2,3,4]", "[\"a\"]", "[1,]", NULL});
    schema_case(
        "{\"type\":\"array\",\"prefixItems\":[{\"type\":\"string\"},{\"type\":\"boolean\"}],"
        "\"items\":false}",
        0, (const char *[]){"[]", "[\"a\"]", "[\"a\",true]", NULL},
        (const char *[]){"[true]", "[\"a\",true,1]", NULL});
    schema_case("{\"type\":\"array\",\"prefixItems\":[{\"const\":1}],\"items\":{\"type\":\"null\"},"
                "\"minItems\":2}",
                0, (const char *[]){"[1,null]", "[1,null,null]", NULL},
                (const char *[]){"[1]", "[null,null]", NULL});
    // Strings: lengths, pattern (search semantics), formats, escapes.
    schema_case("{\"type\":\"string\",\"minLength\":2,\"maxLength\":3}", 0,
                (const char *[]){"\"ab\"", "\"a\\nb\"", "\"日本語\"", NULL},
                (const char *[]){"\"a\"", "\"abcd\"", NULL});
    schema_case("{\"type\":\"string\",\"pattern\":\"^[A-Z]{2}\\\\d+$\"}", 0,
                (const char *[]){"\"AB12\"", NULL}, (const char *[]){"\"xAB12\"", "\"AB\"", NULL});
    schema_case("{\"type\":\"string\",\"pattern\":\"a\\\"b\"}", 0,
                (const char *[]){"\"a\\\"b\"", "\"xxa\\\"byy\"", NULL},
                (const char *[]){"\"ab\"", NULL});
    schema_case(
        "{\"type\":\"string\",\"format\":\"date-time\"}", 0,
        (const char *[]){"\"2024-02-29T12:30:00Z\"", "\"2024-01-01T00:00:00.123+05:30\"", NULL},
        (const char *[]){"\"2024-13-01T00:00:00Z\"", "\"2024-01-01\"", NULL});
    schema_case("{\"type\":\"string\",\"format\":\"uuid\"}", 0,
                (const char *[]){"\"123e4567-e89b-12d3-a456-426614174000\"", NULL},
                (const char *[]){"\"123e4567\"", NULL});
    schema_case("{\"format\":\"email\"}", 0, (const char *[]){"\"a.b@example.com\"", NULL},
                (const char *[]){"\"a@\"", "\"@b.com\"", NULL});
    // enum, const, anyOf, types, integer ranges.
    schema_case("{\"enum\":[\"red\",\"green\",1,null,{\"a\":[1]}]}", 0,
                (const char *[]){"\"red\"", "1", "null", "{\"a\":[1]}", NULL},
                (const char *[]){"\"blue\"", "2", "{\"a\":[2]}", NULL});
    schema_case("{\"anyOf\":[{\"type\":\"integer\"},{\"type\":\"array\",\"items\":{\"type\":"
                "\"integer\"}}]}",
                0, (const char *[]){"5", "[1,2]", NULL}, (const char *[]){"\"5\"", NULL});
    schema_case("{\"type\":[\"string\",\"null\"]}", 0, (const char *[]){"\"x\"", "null", NULL},
                (const char *[]){"1", NULL});
    schema_case("{\"type\":\"integer\",\"minimum\":-3,\"maximum\":12}", 0,
                (const char *[]){"-3", "0", "12", NULL}, (const char *[]){"13", "-4", "1.0", NULL});
    schema_case("{\"allOf\":[{\"type\":\"boolean\"}]}", 0, (const char *[]){"true", NULL},
                (const char *[]){"1", NULL});
    // $ref recursion ($defs and definitions) and nesting.
    schema_case(
        "{\"$defs\":{\"node\":{\"type\":\"object\",\"properties\":{\"v\":{\"type\":"
        "\"integer\"},\"kids\":{\"type\":\"array\",\"items\":{\"$ref\":\"#/$defs/node\"}}},"
        "\"required\":[\"v\"],\"additionalProperties\":false}},\"$ref\":\"#/$defs/node\"}",
        0,
        (const char *[]){"{\"v\":1}", "{\"v\":1,\"kids\":[{\"v\":2,\"kids\":[{\"v\":3}]}]}", NULL},
        (const char *[]){"{\"v\":1,\"kids\":[{}]}", NULL});
    schema_case(
        "{\"definitions\":{\"x\":{\"type\":\"string\"}},\"type\":\"object\",\"properties\":"
        "{\"p\":{\"$ref\":\"#/definitions/x\",\"description\":\"d\"}},\"required\":[\"p\"]}",
        DI_GRAMMAR_FLAG_STRICT, (const char *[]){"{\"p\":\"x\"}", NULL},
        (const char *[]){"{\"p\":1}", NULL});
    // A property name longer than any fixed buffer (a fuzzer find).
    char long_key[1200];
    size_t nk =
        (size_t)snprintf(long_key, sizeof long_key, "{\"type\":\"object\",\"properties\":{\"");
    for (int i = 0; i < 300; i++) long_key[nk++] = (char)('a' + i % 26);
    nk += (size_t)snprintf(long_key + nk, sizeof long_key - nk, "\":{\"type\":\"null\"}}}");
    di_grammar *lk = compile(DI_GRAMMAR_KIND_JSON_SCHEMA, long_key, DI_GRAMMAR_FLAG_STRICT);
    CHECK(lk != NULL);
    di_grammar_destroy(lk);
    schema_case("true", 0, (const char *[]){"1", "\"s\"", "[{}]", NULL},
                (const char *[]){"", NULL});
    // Errors name the keyword and the pointer.
    schema_error("{\"type\":\"object\",\"properties\":{\"a\":{\"not\":{}}}}",
                 "'#/properties/a': keyword 'not' is not supported");
    schema_error("{\"type\":\"string\",\"format\":\"uri\"}", "format 'uri' is not supported");
    schema_error("{\"$ref\":\"http://x/y\"}", "not a local reference");
    schema_error("{\"type\":\"string\",\"pattern\":\"(a\"}", "pattern: regex offset 0: unclosed");
    schema_error("{\"type\":\"array\",\"uniqueItems\":true}", "'uniqueItems' is not supported");
    schema_error("{\"type\":\"object\",\"required\":[\"x\"]}", "required property 'x'");
    schema_error("{\"type\":", "not JSON");
    // json_object
    di_grammar *g = compile(DI_GRAMMAR_KIND_JSON_OBJECT, NULL, 0);
    CHECK(g && accepts(g, "{\"a\": [1, {\"b\": null}], \"c\": \"\\u00e9\"}"));
    CHECK(g && !accepts(g, "[1]"));
    CHECK(g && !accepts(g, "{\"a\":1,}"));
    di_grammar_destroy(g);
}

int main(void) {
    if (di_tokenizer_load_for_model(NULL, &g_tok) == DI_OK)
        CHECK(di_grammar_vocab_create(g_tok, &g_vocab) == DI_OK);
    else
        fprintf(stderr, "no tokenizer: mask tests need data/tokenizer/deepseek-v4\n");
    CHECK(g_tok != NULL);
    test_compile_errors();
    test_matcher_strings();
    test_utf8_split_and_done();
    test_limits();
    test_mask_brute_force();
    test_token_terminals();
    test_tool_grammars();
    test_regex_pcre2();
    test_json_schema();
    di_grammar_vocab_destroy(g_vocab);
    di_tokenizer_destroy(g_tok);
    printf("%d passed, %d failed\n", g_checks_passed, g_checks_failed);
    return g_checks_failed ? 1 : 0;
}
