// grammar token sets (matcher.c, "token sets per position"): masks computed from the grammar's
// shared token sets equal the exact walk of the whole vocabulary trie bit for bit, n_allowed
// included, on the real DeepSeek V4 vocabulary. For JSON Schemas (formats, patterns, lengths,
// enums, nested objects and arrays, a recursive $ref), regexes, hand-written EBNF with token
// terminals, json_object, tool-call grammars (alone and united with a format), documents are fed
// token by token and, from points along them, random continuations sampled from the mask; after
// every token both matchers' masks are compared. Also: the sets are really used (no fallback under
// default limits) and shared by a second request; tight limits (a fallback, or an error where the
// exact walk errs too); several threads computing masks of one grammar at once, the grammar
// compiled by each through one compiled-grammar cache (di_grammar_cache_*), which is also tested
// alone: hits, keys, eviction, errors, lifetimes.
#include "harness.h"

#include <pthread.h>

#include "grammar/grammar.h"

static di_tokenizer *g_tok;
static di_grammar_vocab *g_vocab;
static int32_t g_words, g_dsml;
static uint64_t g_rng = 0x9e3779b97f4a7c15ull;

static uint32_t rnd(void) {
    g_rng ^= g_rng << 13, g_rng ^= g_rng >> 7, g_rng ^= g_rng << 17;
    return (uint32_t)(g_rng >> 11);
}

// The tokens of text, where each "｜DSML｜" is the special token and the rest the text's own
// tokenization.
static int32_t tokenize(const char *s, int32_t *ids, int32_t cap) {
    int32_t n = 0;
    while (*s) {
        const char *d = strstr(s, "｜DSML｜");
        const size_t len = d ? (size_t)(d - s) : strlen(s);
        int32_t *piece = NULL;
        size_t np = 0;
        if (len && di_tokenizer_encode(g_tok, s, len, false, &piece, &np) != DI_OK) return -1;
        for (size_t i = 0; i < np && n < cap; i++) ids[n++] = piece[i];
        di_tok_free(piece);
        s += len;
        if (d && n < cap) ids[n++] = g_dsml, s += strlen("｜DSML｜");
    }
    return n;
}

static di_grammar *compile(di_grammar_kind kind, const char *text) {
    di_grammar *g = NULL;
    char err[512];
    if (di_grammar_compile(kind, text, text ? strlen(text) : 0, 0, &g, err, sizeof err) != DI_OK)
        fprintf(stderr, "compile failed: %s\n  for: %s\n", err, text);
    return g;
}

typedef struct pair {
    di_grammar_matcher *ts, *ex; // token sets / exact walk
    uint64_t *mts, *mex;         // their masks
    int32_t n_allowed;           // of the last comparison (exact)
    int n_masks;
} pair;

// g accepts exactly text (bytes, then can_end).
static bool accepts_text(const di_grammar *g, const char *text) {
    di_grammar_matcher *m = NULL;
    if (di_grammar_matcher_create(g, g_vocab, NULL, &m) != DI_OK) return false;
    const bool ok =
        di_grammar_matcher_advance(m, text, strlen(text)) && di_grammar_matcher_can_end(m);
    di_grammar_matcher_destroy(m);
    return ok;
}

static bool pair_init(pair *p, const di_grammar *g, const di_grammar_matcher_limits *base) {
    // The token-set path without the per-request mask cache (every mask from the sets); the exact
    // walk with it (a hit is that walk's own earlier mask of the same stack set: time saved).
    di_grammar_matcher_limits lt = base ? *base : di_grammar_matcher_limits_default();
    di_grammar_matcher_limits le = lt;
    lt.n_cache = 0;
    lt.token_sets = true;
    le.token_sets = false;
    *p = (pair){.mts = calloc((size_t)g_words, 8), .mex = calloc((size_t)g_words, 8)};
    return di_grammar_matcher_create(g, g_vocab, &lt, &p->ts) == DI_OK &&
           di_grammar_matcher_create(g, g_vocab, &le, &p->ex) == DI_OK;
}

static void pair_deinit(pair *p) {
    di_grammar_matcher_destroy(p->ts);
    di_grammar_matcher_destroy(p->ex);
    free(p->mts);
    free(p->mex);
}

// Both masks of the current state; false when they differ (or the exact walk hit a limit: the
// token-set path may then succeed or fail, nothing to compare).
static bool pair_compare(pair *p, const char *what, int step) {
    int32_t nt = -1, ne = -1;
    const di_status se = di_grammar_matcher_mask(p->ex, p->mex, &ne);
    const di_status st = di_grammar_matcher_mask(p->ts, p->mts, &nt);
    p->n_masks++;
    if (se != DI_OK) return false;
    CHECK_EQ(st, DI_OK);
    if (st != DI_OK) return false;
    const bool same = !memcmp(p->mts, p->mex, sizeof(uint64_t) * (size_t)g_words);
    CHECK(same);
    CHECK_EQ(nt, ne);
    if (!same) {
        int shown = 0;
        for (int32_t id = 0; id < g_words * 64 && shown < 5; id++) {
            const int a = (int)((p->mts[id >> 6] >> (id & 63)) & 1);
            const int b = (int)((p->mex[id >> 6] >> (id & 63)) & 1);
            if (a == b) continue;
            size_t nb = 0;
            const char *tb = di_tokenizer_token_bytes(g_tok, id, &nb);
            fprintf(stderr, "%s, step %d: token %d '%.*s': token sets %d, exact %d\n", what, step,
                    (int)id, (int)nb, tb ? tb : "", a, b);
            shown++;
        }
    }
    p->n_allowed = ne;
    return same && nt == ne;
}

static bool pair_advance(pair *p, int32_t id) {
    const bool a = di_grammar_matcher_advance_token(p->ts, id);
    const bool b = di_grammar_matcher_advance_token(p->ex, id);
    CHECK_EQ(a, b);
    return a && b;
}

// A token allowed by the last mask, at random (-1: none).
static int32_t pick(const pair *p) {
    if (p->n_allowed <= 0) return -1;
    int32_t r = (int32_t)(rnd() % (uint32_t)p->n_allowed);
    for (int32_t w = 0; w < g_words; w++) {
        const int c = __builtin_popcountll(p->mex[w]);
        if (r >= c) {
            r -= c;
            continue;
        }
        uint64_t b = p->mex[w];
        while (r-- > 0) b &= b - 1;
        return w * 64 + __builtin_ctzll(b);
    }
    return -1;
}

// Feeds the text's tokens to a pair, comparing the masks before every token and at the end; at
// n_branch random points (and at the end, unless n_branch < 0) also continues with up to 12
// tokens sampled from the mask. Returns the number of masks compared.
static int diff_doc(const di_grammar *g, const char *what, const char *text, int n_branch,
                    const di_grammar_matcher_limits *lim) {
    int32_t ids[2048];
    const int32_t n = tokenize(text, ids, 2048);
    CHECK(n > 0);
    pair p, b;
    if (!pair_init(&p, g, lim) || !pair_init(&b, g, lim)) {
        CHECK(false);
        pair_deinit(&p), pair_deinit(&b);
        return 0;
    }
    for (int32_t i = 0; i <= n; i++) {
        if (!pair_compare(&p, what, i)) break;
        const bool branch = n_branch >= 0 && (i == n || (int32_t)(rnd() % (uint32_t)n) < n_branch);
        if (branch) {
            di_grammar_matcher_copy(b.ts, p.ts);
            di_grammar_matcher_copy(b.ex, p.ex);
            for (int k = 0; k < 12 && pair_compare(&b, what, 10000 * (i + 1) + k); k++) {
                const int32_t t = pick(&b);
                if (t < 0 || !pair_advance(&b, t)) break;
            }
            p.n_masks += b.n_masks, b.n_masks = 0;
        }
        if (i < n && !pair_advance(&p, ids[i])) {
            if (!lim) fprintf(stderr, "%s: token %d of the document refused\n", what, (int)i);
            CHECK(lim != NULL); // only tight limits may stop a valid document
            break;
        }
    }
    if (!lim) CHECK(di_grammar_matcher_is_done(p.ex) || di_grammar_matcher_can_end(p.ex));
    const int n_masks = p.n_masks;
    pair_deinit(&p), pair_deinit(&b);
    return n_masks;
}

// Diffs each document of one grammar under default limits, twice. The token-set path must serve
// most masks of the first run (a position that finds no reserved room falls back to the exact
// walk) and every mask of the second, which meets only positions the first published.
static void diff_grammar(di_grammar *g, const char *what, const char *const *docs, int n_docs) {
    CHECK(g != NULL);
    if (!g) return;
    int n_masks = 0;
    for (int i = 0; i < n_docs; i++) n_masks += diff_doc(g, what, docs[i], 4, NULL);
    di_grammar_tsets_stats s1, s2;
    di_grammar_tsets_get_stats(g, &s1);
    CHECK(s1.n_positions > 0);
    CHECK(s1.n_fallbacks * 5 <= n_masks);
    for (int i = 0; i < n_docs; i++) n_masks += diff_doc(g, what, docs[i], -1, NULL);
    di_grammar_tsets_get_stats(g, &s2);
    CHECK_EQ(s2.n_fallbacks, s1.n_fallbacks);
    CHECK_EQ(s2.n_positions, s1.n_positions);
    fprintf(stderr,
            "  %-22s %5d masks equal (%lld by the exact walk); %d positions (%lld "
            "context-dependent tokens), %.0f KB, computed in %.1f ms\n",
            what, n_masks, (long long)s2.n_fallbacks, s2.n_positions, (long long)s2.n_ctx,
            (double)s2.bytes / 1024, s2.compute_us / 1e3);
    di_grammar_destroy(g);
}

// ---- grammars and documents ----

static void test_json_schemas(void) {
    static const char *schema =
        "{\"type\":\"object\",\"properties\":{"
        "\"name\":{\"type\":\"string\"},"
        "\"age\":{\"type\":\"integer\",\"minimum\":0,\"maximum\":150},"
        "\"email\":{\"type\":\"string\",\"format\":\"email\"},"
        "\"tags\":{\"type\":\"array\",\"items\":{\"type\":\"string\"},\"maxItems\":8},"
        "\"address\":{\"type\":\"object\",\"properties\":{\"street\":{\"type\":\"string\"},"
        "\"city\":{\"type\":\"string\"},\"zip\":{\"type\":\"string\",\"pattern\":\"^[0-9]{5}$\"}},"
        "\"required\":[\"street\",\"city\"],\"additionalProperties\":false},"
        "\"active\":{\"type\":\"boolean\"},"
        "\"notes\":{\"type\":[\"string\",\"null\"]}},"
        "\"required\":[\"name\",\"age\",\"tags\",\"address\",\"active\"],"
        "\"additionalProperties\":false}";
    static const char *docs[] = {
        "{\"name\": \"Ada Lovelace, Countess of Lovelace\", \"age\": 36, \"email\": "
        "\"ada@example.org\", \"tags\": [\"mathematics\", \"analytical engine\", \"poetry\"], "
        "\"address\": {\"street\": \"12 St James's Square\", \"city\": \"London\", \"zip\": "
        "\"12345\"}, \"active\": true, \"notes\": \"Wrote the first published algorithm intended "
        "for a machine; translated Menabrea's article and added her own notes.\"}",
        "{\n  \"name\": \"Zoë \\\"Z\\\" Ñúñez — 北京 🚀\\n\\t\\u00e9\",\n  \"age\": 0,\n  "
        "\"tags\": [],\n  \"address\": {\"street\": \"\", \"city\": \"\\\\\"},\n  "
        "\"active\": false,\n  \"notes\": null\n}"};
    diff_grammar(compile(DI_GRAMMAR_KIND_JSON_SCHEMA, schema), "schema (bench)", docs, 2);

    static const char *formats =
        "{\"type\":\"object\",\"properties\":{"
        "\"when\":{\"type\":\"string\",\"format\":\"date-time\"},"
        "\"day\":{\"type\":\"string\",\"format\":\"date\"},"
        "\"id\":{\"type\":\"string\",\"format\":\"uuid\"},"
        "\"ip\":{\"type\":\"string\",\"format\":\"ipv4\"},"
        "\"host\":{\"type\":\"string\",\"format\":\"hostname\"},"
        "\"code\":{\"type\":\"string\",\"pattern\":\"^[A-Z]{2}-[0-9]+$\"},"
        "\"word\":{\"type\":\"string\",\"pattern\":\"ab+c\"},"
        "\"short\":{\"type\":\"string\",\"maxLength\":5},"
        "\"mid\":{\"type\":\"string\",\"minLength\":2,\"maxLength\":40},"
        "\"kind\":{\"enum\":[\"alpha\",\"beta\",3,null,{\"k\":[1]}]},"
        "\"c\":{\"const\":\"fixed\"},"
        "\"x\":{\"type\":\"number\"},"
        "\"items\":{\"type\":\"array\",\"minItems\":1,\"items\":{\"type\":\"object\","
        "\"properties\":{\"n\":{\"type\":\"integer\"},\"v\":{\"anyOf\":[{\"type\":\"string\"},"
        "{\"type\":\"array\",\"items\":{\"type\":\"number\"}}]}},\"required\":[\"n\"]}}}}";
    static const char *fdocs[] = {
        "{\"when\": \"2024-02-29T23:59:60.5+01:00\", \"day\": \"1999-12-31\", \"id\": "
        "\"123e4567-e89b-12d3-a456-426614174000\", \"ip\": \"192.168.0.1\", \"host\": "
        "\"api.example.com\", \"code\": \"AB-12345\", \"word\": \"xx abbbc yy\", \"short\": "
        "\"héllo\", \"mid\": \"a string of some forty characters or so!\", \"kind\": {\"k\":[1]}, "
        "\"c\": \"fixed\", \"x\": -1.5e+10, \"items\": [{\"n\": 1, \"v\": \"s\"}, {\"n\": -2, "
        "\"v\": [1, 2.5, -3e2]}], \"extra\": {\"any\": [true, null, \"thing\"]}}",
        "{\"kind\": null, \"short\": \"\", \"items\": [{\"n\": 0}]}"};
    diff_grammar(compile(DI_GRAMMAR_KIND_JSON_SCHEMA, formats), "schema (formats)", fdocs, 2);

    static const char *rec =
        "{\"$defs\":{\"node\":{\"type\":\"object\",\"properties\":{\"v\":{\"type\":\"string\"},"
        "\"kids\":{\"type\":\"array\",\"items\":{\"$ref\":\"#/$defs/node\"}}},\"required\":[\"v\"],"
        "\"additionalProperties\":false}},\"$ref\":\"#/$defs/node\"}";
    static const char *rdocs[] = {"{\"v\": \"root\", \"kids\": [{\"v\": \"a\", \"kids\": [{\"v\": "
                                  "\"deep \\\"quoted\\\"\"}]}, {\"v\": \"b\", \"kids\": []}]}"};
    diff_grammar(compile(DI_GRAMMAR_KIND_JSON_SCHEMA, rec), "schema (recursive)", rdocs, 1);

    static const char *odocs[] = {
        "{\"a\": [1, {\"b\": null}], \"c\": \"\\u00e9 text with \\\"quotes\\\" and more\", "
        "\"d\": -0.5e3, \"e\": {}, \"f\": [], \"g\": \"line\\nbreak\"}",
        "{ }"};
    diff_grammar(compile(DI_GRAMMAR_KIND_JSON_OBJECT, NULL), "json_object", odocs, 2);
}

static void test_regexes(void) {
    static const char *d1[] = {"alice.smith@example.org"};
    diff_grammar(compile(DI_GRAMMAR_KIND_REGEX, "[a-z.]+@[a-z]+\\.(com|org)"), "regex email", d1,
                 1);
    static const char *d2[] = {"555-1234 then some free text, of any kind: 北京"};
    diff_grammar(compile(DI_GRAMMAR_KIND_REGEX, "\\d{3}-\\d{4}( .*)?"), "regex phone", d2, 1);
    static const char *d3[] = {"ababcdcdab e"};
    diff_grammar(compile(DI_GRAMMAR_KIND_REGEX, "(ab|cd)*( e)?"), "regex loop", d3, 1);
    static const char *d4[] = {"Zoë, Ñ and 北京 are words"};
    diff_grammar(compile(DI_GRAMMAR_KIND_REGEX, "([\\w\\u00C0-\\u9FFF]+[ ,]*)+"), "regex unicode",
                 d4, 1);
}

static void test_ebnf_token_terminals(void) {
    char text[768];
    snprintf(text, sizeof text,
             "root ::= \"<\" <[%d]> \"tool_calls>\" body | \"<tool\" [a-z_]* | text\n"
             "body ::= (\"\\n\" <[%d]>? item)* \"\\nend\"\n"
             "item ::= \"[\" [^\\]\\n]* \"]\" | \"(\" root \")\"\n"
             "text ::= [!-~ ]+ (\"\\n\" text)?\n",
             (int)g_dsml, (int)g_dsml);
    static const char *docs[] = {"<｜DSML｜tool_calls>\n[some item text]\n｜DSML｜(<tool_x)\nend",
                                 "<tool_calls_but_text",
                                 "plain words, symbols !#$\nand a second line"};
    diff_grammar(compile(DI_GRAMMAR_KIND_EBNF, text), "ebnf terminals", docs, 3);
}

static const char k_tools[] =
    "[{\"type\":\"function\",\"function\":{\"name\":\"get_weather\",\"parameters\":{\"type\":"
    "\"object\",\"properties\":{\"location\":{\"type\":\"string\"},\"unit\":{\"type\":\"string\","
    "\"enum\":[\"celsius\",\"fahrenheit\"]},\"days\":{\"type\":\"integer\",\"minimum\":1,"
    "\"maximum\":14}},\"required\":[\"location\"]}}},"
    "{\"type\":\"function\",\"function\":{\"name\":\"search\",\"parameters\":{\"type\":\"object\","
    "\"properties\":{\"query\":{\"type\":\"string\"},\"limit\":{\"type\":\"integer\"},\"filters\":"
    "{\"type\":\"object\",\"properties\":{\"site\":{\"type\":\"string\"},\"lang\":{\"type\":"
    "\"string\"}}}},\"required\":[\"query\"]}}},"
    "{\"type\":\"function\",\"function\":{\"name\":\"send_email\",\"parameters\":{\"type\":"
    "\"object\",\"properties\":{\"to\":{\"type\":\"string\",\"format\":\"email\"},\"subject\":"
    "{\"type\":\"string\",\"maxLength\":30},\"body\":{\"type\":\"string\"}},"
    "\"required\":[\"to\",\"body\"]}}}]";

#define K_BLOCK                                                                                      \
    "<｜DSML｜invoke name=\"get_weather\">\n<｜DSML｜parameter name=\"location\" "               \
    "string=\"true\">San Francisco, California</｜DSML｜parameter>\n<｜DSML｜parameter "         \
    "name=\"unit\" "                                                                                 \
    "string=\"true\">celsius</｜DSML｜parameter>\n</｜DSML｜invoke>\n<｜DSML｜invoke "         \
    "name=\"search\">\n<｜DSML｜parameter name=\"query\" string=\"true\">best \"hiking\" trails\n" \
    "near <the> Golden Gate</｜DSML｜parameter>\n<｜DSML｜parameter name=\"filters\" "           \
    "string=\"false\">{\"site\": \"alltrails.com\", \"lang\": \"en\"}</｜DSML｜parameter>\n"       \
    "</｜DSML｜invoke>\n<｜DSML｜invoke name=\"send_email\">\n<｜DSML｜parameter name=\"to\" " \
    "string=\"false\">\"a@b.org\"</｜DSML｜parameter>\n<｜DSML｜parameter name=\"subject\" "     \
    "string=\"false\">\"Hi\"</｜DSML｜parameter>\n<｜DSML｜parameter name=\"body\" "             \
    "string=\"true\">Dear A,\n\nsee you.</｜DSML｜parameter>\n</｜DSML｜invoke>\n"               \
    "</｜DSML｜tool_calls>"

static void test_tool_grammars(void) {
    static const char *docs[] = {K_BLOCK};
    di_grammar *g = NULL;
    di_grammar_tools_options o = {.parallel = true};
    CHECK(di_grammar_compile_tools(g_tok, k_tools, strlen(k_tools), &o, &g, NULL, 0) == DI_OK);
    diff_grammar(g, "tools (after header)", docs, 1);
    // A response format or a block (tool_choice auto with a format).
    static const char *udocs[] = {"\n\n<｜DSML｜tool_calls>\n" K_BLOCK, "{\"answer\": \"none\"}"};
    di_grammar *blk = NULL, *u = NULL;
    o.start = DI_GRAMMAR_TOOLS_BLOCK;
    CHECK(di_grammar_compile_tools(g_tok, k_tools, strlen(k_tools), &o, &blk, NULL, 0) == DI_OK);
    di_grammar *fmt = compile(DI_GRAMMAR_KIND_JSON_OBJECT, NULL);
    CHECK(blk && fmt && di_grammar_union(fmt, blk, &u) == DI_OK);
    di_grammar_destroy(blk);
    di_grammar_destroy(fmt);
    diff_grammar(u, "format or tools", udocs, 2);
}

// Tight limits: a position's walk or a context-dependent check may hit one (the mask falls back
// to the exact walk) and the exact walk may hit one too; whenever the exact walk gives a mask, the
// token-set path gives the same.
static void test_tight_limits(void) {
    di_grammar *g = compile(DI_GRAMMAR_KIND_JSON_OBJECT, NULL);
    CHECK(g != NULL);
    if (!g) return;
    static const char *doc = "{\"a\": {\"b\": {\"c\": [[[\"deep string\", 1]]]}}, \"d\": \"x\"}";
    const int32_t sizes[] = {64, 200, 400, 1000};
    for (int i = 0; i < 4; i++) {
        di_grammar_matcher_limits lim = di_grammar_matcher_limits_default();
        lim.max_nodes = sizes[i];
        lim.max_stacks = 16;
        lim.max_depth = 12;
        diff_doc(g, "tight limits", doc, 4, &lim);
    }
    di_grammar_destroy(g);
}

// ---- threads ----

typedef struct thread_job {
    di_grammar_cache *cache;
    const di_grammar *g; // out: the grammar the thread compiled through the cache
    const int32_t *ids;
    int32_t n;
    const uint64_t *want; // [n + 1][words]: the exact masks along the document
    const int32_t *want_n;
    pthread_barrier_t *start;
    int n_bad; // out
} thread_job;

static void *thread_main(void *p) {
    thread_job *j = p;
    di_grammar_matcher *m = NULL;
    di_grammar *g = NULL;
    uint64_t *mask = calloc((size_t)g_words, 8);
    di_grammar_tools_options o = {.parallel = true};
    pthread_barrier_wait(j->start);
    if (di_grammar_cache_compile_tools(j->cache, g_tok, k_tools, strlen(k_tools), &o, &g, NULL,
                                       0) != DI_OK)
        j->n_bad++;
    j->g = g;
    if (!g || !mask || di_grammar_matcher_create(g, g_vocab, NULL, &m) != DI_OK) {
        j->n_bad++;
    } else {
        for (int32_t i = 0; i <= j->n; i++) {
            int32_t na = -1;
            if (di_grammar_matcher_mask(m, mask, &na) != DI_OK || na != j->want_n[i] ||
                memcmp(mask, j->want + (size_t)i * (size_t)g_words,
                       sizeof(uint64_t) * (size_t)g_words))
                j->n_bad++;
            if (i < j->n && !di_grammar_matcher_advance_token(m, j->ids[i])) {
                j->n_bad++;
                break;
            }
        }
    }
    di_grammar_matcher_destroy(m);
    di_grammar_destroy(g);
    free(mask);
    return NULL;
}

// Four threads compile the same tools through one cache and run the same document on matchers of
// the grammar they get, all at once: they race to insert it (all must get the one grammar) and to
// compute the same positions; twice (the second time every set is shared).
static void test_threads(void) {
    di_grammar_cache *cache = NULL;
    CHECK(di_grammar_cache_create(4, (size_t)1 << 30, &cache) == DI_OK);
    di_grammar *g = NULL;
    di_grammar_tools_options o = {.parallel = true};
    CHECK(di_grammar_compile_tools(g_tok, k_tools, strlen(k_tools), &o, &g, NULL, 0) == DI_OK);
    if (!g || !cache) return;
    int32_t ids[1024];
    const int32_t n = tokenize(K_BLOCK, ids, 1024);
    uint64_t *want = calloc((size_t)(n + 1) * (size_t)g_words, 8);
    int32_t *want_n = calloc((size_t)n + 1, sizeof(int32_t));
    di_grammar_matcher_limits le = di_grammar_matcher_limits_default();
    le.token_sets = false;
    di_grammar_matcher *ex = NULL;
    CHECK(want && want_n && di_grammar_matcher_create(g, g_vocab, &le, &ex) == DI_OK);
    for (int32_t i = 0; ex && i <= n; i++) {
        CHECK(di_grammar_matcher_mask(ex, want + (size_t)i * (size_t)g_words, &want_n[i]) == DI_OK);
        if (i < n) CHECK(di_grammar_matcher_advance_token(ex, ids[i]));
    }
    di_grammar_matcher_destroy(ex);
    enum { N_THREADS = 4 };
    for (int round = 0; round < 2; round++) {
        pthread_barrier_t start;
        pthread_barrier_init(&start, NULL, N_THREADS);
        pthread_t th[N_THREADS];
        thread_job jobs[N_THREADS];
        for (int t = 0; t < N_THREADS; t++) {
            jobs[t] = (thread_job){.cache = cache,
                                   .ids = ids,
                                   .n = n,
                                   .want = want,
                                   .want_n = want_n,
                                   .start = &start};
            CHECK(pthread_create(&th[t], NULL, thread_main, &jobs[t]) == 0);
        }
        for (int t = 0; t < N_THREADS; t++) {
            pthread_join(th[t], NULL);
            CHECK_EQ(jobs[t].n_bad, 0);
            CHECK(jobs[t].g == jobs[0].g); // one compiled grammar for all
        }
        pthread_barrier_destroy(&start);
        if (round == 0) { // the cache still holds it: the sets computed above are there
            di_grammar *c = NULL;
            CHECK(di_grammar_cache_compile_tools(cache, g_tok, k_tools, strlen(k_tools), &o, &c,
                                                 NULL, 0) == DI_OK);
            di_grammar_tsets_stats s = {0};
            if (c) di_grammar_tsets_get_stats(c, &s);
            CHECK(c == jobs[0].g && s.n_positions > 0 && s.n_fallbacks == 0);
            di_grammar_destroy(c);
        }
    }
    int64_t hits = 0, misses = 0;
    int32_t n_grammars = 0;
    di_grammar_cache_get_stats(cache, &hits, &misses, &n_grammars);
    CHECK_EQ(hits + misses, 2 * N_THREADS + 1);
    CHECK(misses >= 1 && misses <= N_THREADS); // racing first compiles may all miss
    CHECK_EQ(n_grammars, 1);
    di_grammar_cache_destroy(cache);
    free(want);
    free(want_n);
    di_grammar_destroy(g);
}

// ---- the compiled-grammar cache ----

static void test_grammar_cache(void) {
    di_grammar_cache *c = NULL;
    CHECK(di_grammar_cache_create(3, (size_t)1 << 30, &c) == DI_OK);
    if (!c) return;
    static const char *schema =
        "{\"type\":\"object\",\"properties\":{\"a\":{\"type\":\"string\"}}}";
    const size_t n = strlen(schema);
    di_grammar *a = NULL, *a2 = NULL, *strict = NULL, *re = NULL, *bad = NULL;
    char err[256] = "";
    CHECK(di_grammar_cache_compile(c, DI_GRAMMAR_KIND_JSON_SCHEMA, schema, n, 0, &a, err,
                                   sizeof err) == DI_OK);
    CHECK(di_grammar_cache_compile(c, DI_GRAMMAR_KIND_JSON_SCHEMA, schema, n, 0, &a2, err,
                                   sizeof err) == DI_OK);
    CHECK(a && a == a2); // the same text: the same grammar
    CHECK(di_grammar_cache_compile(c, DI_GRAMMAR_KIND_JSON_SCHEMA, schema, n,
                                   DI_GRAMMAR_FLAG_STRICT, &strict, err, sizeof err) == DI_OK);
    CHECK(strict && strict != a); // strict mode generates another grammar
    // Refused: the message as without a cache, nothing cached, *out untouched.
    CHECK(di_grammar_cache_compile(c, DI_GRAMMAR_KIND_JSON_SCHEMA, "{\"not\":{}}", 10, 0, &bad, err,
                                   sizeof err) == DI_ERR_INVALID);
    CHECK(bad == NULL && strstr(err, "'not'") != NULL);
    // A union of cached parts is cached too.
    di_grammar *blk = NULL, *u1 = NULL, *u2 = NULL;
    di_grammar_tools_options o = {.parallel = true, .start = DI_GRAMMAR_TOOLS_BLOCK};
    CHECK(di_grammar_cache_compile_tools(c, g_tok, k_tools, strlen(k_tools), &o, &blk, NULL, 0) ==
          DI_OK);
    CHECK(blk && di_grammar_cache_union(c, a, blk, &u1) == DI_OK);
    CHECK(blk && di_grammar_cache_union(c, a, blk, &u2) == DI_OK);
    CHECK(u1 && u1 == u2);
    int64_t hits = 0, misses = 0;
    int32_t n_grammars = 0;
    di_grammar_cache_get_stats(c, &hits, &misses, &n_grammars);
    CHECK_EQ(hits, 2);
    CHECK_EQ(n_grammars, 3); // a, strict, blk, u1: the least recently used (strict) evicted
    // An evicted grammar its caller still holds works; compiling it again makes a new one.
    CHECK(accepts_text(strict, "{\"a\": \"x\"}"));
    CHECK(di_grammar_cache_compile(c, DI_GRAMMAR_KIND_REGEX, "[0-9]+", 6, 0, &re, err,
                                   sizeof err) == DI_OK);
    di_grammar *s2 = NULL;
    CHECK(di_grammar_cache_compile(c, DI_GRAMMAR_KIND_JSON_SCHEMA, schema, n,
                                   DI_GRAMMAR_FLAG_STRICT, &s2, err, sizeof err) == DI_OK);
    CHECK(s2 && s2 != strict);
    // Grammars outlive the cache.
    di_grammar_cache_destroy(c);
    CHECK(accepts_text(a, "{\"a\": \"y\"}") && accepts_text(u1, "{\"a\": \"z\"}"));
    CHECK(accepts_text(re, "123"));
    di_grammar *all[] = {a, a2, strict, re, blk, u1, u2, s2};
    for (size_t i = 0; i < sizeof all / sizeof *all; i++) di_grammar_destroy(all[i]);
    // A byte-bounded cache keeps only what fits (here: the newest).
    CHECK(di_grammar_cache_create(8, 1, &c) == DI_OK);
    if (!c) return;
    CHECK(di_grammar_cache_compile(c, DI_GRAMMAR_KIND_REGEX, "a+", 2, 0, &a, NULL, 0) == DI_OK);
    CHECK(di_grammar_cache_compile(c, DI_GRAMMAR_KIND_REGEX, "b+", 2, 0, &a2, NULL, 0) == DI_OK);
    di_grammar_cache_get_stats(c, &hits, &misses, &n_grammars);
    CHECK_EQ(n_grammars, 1);
    di_grammar_cache_destroy(c);
    di_grammar_destroy(a);
    di_grammar_destroy(a2);
}

int main(void) {
    CHECK(di_tokenizer_load_for_model(NULL, &g_tok) == DI_OK); // data/tokenizer/deepseek-v4
    if (!g_tok || di_grammar_vocab_create(g_tok, &g_vocab) != DI_OK) {
        CHECK(false);
        return test_finish();
    }
    g_words = (di_grammar_vocab_n_tokens(g_vocab) + 63) / 64;
    g_dsml = di_tokenizer_token_id(g_tok, "｜DSML｜");
    CHECK(g_dsml >= 0);
    RUN(test_json_schemas);
    RUN(test_regexes);
    RUN(test_ebnf_token_terminals);
    RUN(test_tool_grammars);
    RUN(test_tight_limits);
    RUN(test_threads);
    RUN(test_grammar_cache);
    di_grammar_vocab_destroy(g_vocab);
    di_tokenizer_destroy(g_tok);
    return test_finish();
}
