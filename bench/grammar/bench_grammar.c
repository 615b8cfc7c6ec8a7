// Grammar-constrained decoding costs on the real DeepSeek V4 vocabulary (129,280 tokens): compile
// time of a typical JSON Schema and of a tool grammar, then a document under each (a JSON document,
// its own tokenization; one of formatted and length-bounded strings; a DSML tool-call block, three
// tools, two calls) is fed token by token and
// the allowed-token mask is computed before every token: by the exact walk of the vocabulary trie
// (without the per-request mask cache and with it) and from the grammar's token sets per position
// (the first request on a new grammar, which computes them: cold; a second request sharing them:
// warm), side by side in one run. Prints µs/token by where the document is (inside a string or
// parameter value, or in structure: keys, tags, punctuation), the slowest first token of a string
// or value, and the token sets' precompute (positions, time, memory); then constrained
// decoding through the engine on the tiny random-weight model (the real vocabulary): decode
// tokens/s of requests under the schema and of unconstrained ones, with the engine's overlap
// (the next plan and the constrained rows' masks computed while the forward runs) and without it
// (DI_ENGINE_SYNC=1); the model's pool leaves one CPU to the engine thread, as masks ahead need.
// Not a test.
//
//   build/bench_grammar [reps] [-v]
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "deepinfer.h"
#include "grammar/grammar.h"
#include "model/synth.h"

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static const char *k_schema =
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

static const char *k_doc =
    "{\"name\": \"Ada Lovelace, Countess of Lovelace\", \"age\": 36, \"email\": "
    "\"ada@example.org\", \"tags\": [\"mathematics\", \"analytical engine\", \"poetry\"], "
    "\"address\": {\"street\": \"12 St James's Square\", \"city\": \"London\", \"zip\": "
    "\"12345\"}, \"active\": true, \"notes\": \"Wrote the first published algorithm intended "
    "for a machine; translated Menabrea's article and added her own notes.\"}";

// Strings whose grammars have no loop for the exact walk to skip along (bounded repetitions inside
// formats and lengths): its most expensive case.
static const char *k_formats =
    "{\"type\":\"object\",\"properties\":{\"mail\":{\"type\":\"string\",\"format\":\"email\"},"
    "\"host\":{\"type\":\"string\",\"format\":\"hostname\"},\"when\":{\"type\":\"string\","
    "\"format\":\"date-time\"},\"mid\":{\"type\":\"string\",\"maxLength\":40},\"code\":{\"type\":"
    "\"string\",\"pattern\":\"^[A-Z]{2}-[0-9]+$\"}}}";

static const char *k_formats_doc =
    "{\"mail\": \"someone.important@mail.example-domain.org\", \"host\": "
    "\"api.service-name.example.com\", \"when\": \"2024-02-29T23:59:60.5+01:00\", \"mid\": \"a "
    "string of some forty characters or so!\", \"code\": \"AB-12345\"}";

// A tool-call grammar (di_grammar_compile_tools): three tools, the block after the prefilled header
// with two calls; ｜DSML｜ is the special token (a token terminal), the rest the text's own tokens.
static const char *k_tools =
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
    "{\"type\":\"string\"},\"body\":{\"type\":\"string\"}},\"required\":[\"to\",\"body\"]}}}]";

static const char *k_block =
    "<｜DSML｜invoke name=\"get_weather\">\n<｜DSML｜parameter name=\"location\" "
    "string=\"true\">San Francisco, California</｜DSML｜parameter>\n<｜DSML｜parameter "
    "name=\"unit\" string=\"true\">celsius</｜DSML｜parameter>\n</｜DSML｜invoke>\n<｜DSML｜invoke "
    "name=\"search\">\n<｜DSML｜parameter name=\"query\" string=\"true\">best hiking trails near "
    "the Golden Gate bridge</｜DSML｜parameter>\n<｜DSML｜parameter name=\"filters\" "
    "string=\"false\">{\"site\": \"alltrails.com\", \"lang\": \"en\"}</｜DSML｜parameter>\n"
    "</｜DSML｜invoke>\n</｜DSML｜tool_calls>";

// ---- masks along a document ----

enum { TOK_STRUCT = 0, TOK_VALUE = 1, TOK_FIRST = 2 }; // structure / in a string / its first token

typedef struct doc_stats { // one request's mask times (s)
    double all, value, structure, first_max, slowest;
    int n_value, n_struct, n_first;
    double allowed_mean;
} doc_stats;

typedef struct doc {
    const char *name;
    int32_t ids[1024];
    uint8_t kind[1024];
    size_t n;
    bool tools;         // compiled by di_grammar_compile_tools (else a JSON Schema)
    const char *schema; // the JSON Schema
} doc;

static di_grammar *doc_grammar(const doc *d, di_tokenizer *tok) {
    di_grammar *g = NULL;
    char err[512];
    const di_status st = d->tools ? di_grammar_compile_tools(tok, k_tools, strlen(k_tools), NULL,
                                                             &g, err, sizeof err)
                                  : di_grammar_compile(DI_GRAMMAR_KIND_JSON_SCHEMA, d->schema,
                                                       strlen(d->schema), 0, &g, err, sizeof err);
    if (st != DI_OK) fprintf(stderr, "%s: %s\n", d->name, err);
    return g;
}

// One request: a new matcher of g fed the document, the mask timed before every token.
static int run_doc(const doc *d, const di_grammar *g, const di_grammar_vocab *vocab,
                   const di_grammar_matcher_limits *lim, uint64_t *mask, doc_stats *out,
                   di_tokenizer *tok, const char *verbose) {
    di_grammar_matcher *m = NULL;
    if (di_grammar_matcher_create(g, vocab, lim, &m) != DI_OK) return 1;
    doc_stats s = {0};
    long long allowed = 0;
    for (size_t i = 0; i < d->n; i++) {
        int32_t n_allowed = 0;
        const double a = now();
        if (di_grammar_matcher_mask(m, mask, &n_allowed) != DI_OK) return 1;
        const double dt = now() - a;
        allowed += n_allowed;
        if (!((mask[d->ids[i] >> 6] >> (d->ids[i] & 63)) & 1)) {
            fprintf(stderr, "%s: token %zu is not allowed\n", d->name, i);
            return 1;
        }
        if (verbose) {
            size_t nb = 0;
            const char *tb = di_tokenizer_token_bytes(tok, d->ids[i], &nb);
            printf("  %s token %3zu %-16.*s %9.1f us, %6d allowed, %d stacks\n", verbose, i,
                   (int)nb, tb, dt * 1e6, n_allowed, di_grammar_matcher_n_stacks(m));
        }
        s.all += dt;
        if (dt > s.slowest) s.slowest = dt;
        if (d->kind[i] == TOK_STRUCT) {
            s.structure += dt, s.n_struct++;
        } else {
            s.value += dt, s.n_value++;
            if (d->kind[i] == TOK_FIRST && dt > s.first_max) s.first_max = dt;
            s.n_first += d->kind[i] == TOK_FIRST;
        }
        if (!di_grammar_matcher_advance_token(m, d->ids[i])) {
            fprintf(stderr, "%s: token %zu refused\n", d->name, i);
            return 1;
        }
    }
    if (!di_grammar_matcher_is_done(m)) fprintf(stderr, "%s: not complete\n", d->name);
    di_grammar_matcher_destroy(m);
    s.allowed_mean = (double)allowed / (double)d->n;
    *out = s;
    return 0;
}

static void stats_min(doc_stats *best, const doc_stats *s) {
    if (s->all < best->all) best->all = s->all;
    if (s->value < best->value) best->value = s->value;
    if (s->structure < best->structure) best->structure = s->structure;
    if (s->first_max < best->first_max) best->first_max = s->first_max;
    if (s->slowest < best->slowest) best->slowest = s->slowest;
    best->n_value = s->n_value, best->n_struct = s->n_struct, best->n_first = s->n_first;
    best->allowed_mean = s->allowed_mean;
}

static void stats_print(const char *what, const doc_stats *s, size_t n) {
    printf("  %-40s %8.1f %8.1f %8.1f %10.0f %9.0f\n", what, s->all / (double)n * 1e6,
           s->n_value ? s->value / s->n_value * 1e6 : 0,
           s->n_struct ? s->structure / s->n_struct * 1e6 : 0, s->first_max * 1e6,
           s->slowest * 1e6);
}

// The exact walk (mask cache off and on) and the token sets (the first request on a new grammar:
// cold; the second: warm, with the mask cache and without), best of reps each; the token sets'
// precompute from the cold requests.
static int bench_doc(const doc *d, di_tokenizer *tok, const di_grammar_vocab *vocab, int reps,
                     bool verbose) {
    const int32_t V = di_tokenizer_n_vocab(tok);
    uint64_t *mask = malloc(sizeof(uint64_t) * (size_t)((V + 63) / 64));
    const doc_stats init = {1e30, 1e30, 1e30, 1e30, 1e30, 0, 0, 0, 0};
    doc_stats ex_off = init, ex_on = init, cold = init, warm = init, warm_off = init, s;
    di_grammar_tsets_stats pre = {0}, pre_best = {.compute_us = 1e30};
    di_grammar_matcher_limits l_ex = di_grammar_matcher_limits_default(), l_ex_off, l_ts, l_ts_off;
    l_ex.token_sets = false;
    l_ex_off = l_ex, l_ex_off.n_cache = 0;
    l_ts = di_grammar_matcher_limits_default();
    l_ts_off = l_ts, l_ts_off.n_cache = 0;
    di_grammar *g = doc_grammar(d, tok);
    if (!g) return 1;
    for (int r = 0; r < reps; r++) {
        if (run_doc(d, g, vocab, &l_ex_off, mask, &s, tok, verbose && !r ? "exact" : NULL))
            return 1;
        stats_min(&ex_off, &s);
        if (run_doc(d, g, vocab, &l_ex, mask, &s, tok, NULL)) return 1;
        stats_min(&ex_on, &s);
        di_grammar *fresh = doc_grammar(d, tok); // an empty token-set cache
        if (!fresh) return 1;
        if (run_doc(d, fresh, vocab, &l_ts, mask, &s, tok, verbose && !r ? "cold" : NULL)) return 1;
        stats_min(&cold, &s);
        di_grammar_tsets_get_stats(fresh, &pre);
        if (pre.compute_us < pre_best.compute_us) pre_best = pre;
        if (run_doc(d, fresh, vocab, &l_ts, mask, &s, tok, verbose && !r ? "warm" : NULL)) return 1;
        stats_min(&warm, &s);
        if (run_doc(d, fresh, vocab, &l_ts_off, mask, &s, tok, NULL)) return 1;
        stats_min(&warm_off, &s);
        di_grammar_tsets_get_stats(fresh, &pre);
        if (pre.n_fallbacks)
            fprintf(stderr, "%s: %lld exact walks\n", d->name, (long long)pre.n_fallbacks);
        di_grammar_destroy(fresh);
    }
    printf("%s: %zu tokens (%d in strings, %d of them a string's first; %d in structure), "
           "%.0f tokens allowed on average; us, best of %d:\n",
           d->name, d->n, ex_on.n_value, ex_on.n_first, ex_on.n_struct, ex_on.allowed_mean, reps);
    printf("  %-40s %8s %8s %8s %10s %9s\n", "mask", "mean", "strings", "struct", "1st (max)",
           "slowest");
    stats_print("exact walk, mask cache off", &ex_off, d->n);
    stats_print("exact walk, mask cache on", &ex_on, d->n);
    stats_print("token sets, 1st request (cold)", &cold, d->n);
    stats_print("token sets, 2nd request (warm)", &warm, d->n);
    stats_print("token sets, 2nd request, mask cache off", &warm_off, d->n);
    printf("  exact / token sets (cache on): cold %.1fx, warm %.1fx mean; first token of a string "
           "%.1fx cold, %.1fx warm\n",
           ex_on.all / cold.all, ex_on.all / warm.all, ex_on.first_max / cold.first_max,
           ex_on.first_max / warm.first_max);
    printf("  precompute (1st request): %d positions in %.1f ms, %.0f us/position, %lld "
           "context-dependent tokens, %.0f KB\n",
           pre_best.n_positions, pre_best.compute_us / 1e3,
           pre_best.n_positions ? pre_best.compute_us / pre_best.n_positions : 0,
           (long long)pre_best.n_ctx, (double)pre_best.bytes / 1024);
    di_grammar_destroy(g);
    free(mask);
    return 0;
}

// A JSON document under a schema: its own tokenization; a token is in a string when an odd
// number of unescaped quotes precede it.
static int doc_json(doc *d, di_tokenizer *tok, const char *name, const char *schema,
                    const char *text) {
    int32_t *ids = NULL;
    size_t n = 0;
    if (di_tokenizer_encode(tok, text, strlen(text), false, &ids, &n) != DI_OK || n > 1024)
        return 1;
    d->name = name;
    d->schema = schema;
    d->n = n;
    bool in_string = false, was = false;
    for (size_t i = 0; i < n; i++) {
        d->ids[i] = ids[i];
        d->kind[i] = !in_string ? TOK_STRUCT : was ? TOK_VALUE : TOK_FIRST;
        was = in_string;
        size_t nb = 0;
        const char *b = di_tokenizer_token_bytes(tok, ids[i], &nb);
        for (size_t k = 0; k < nb; k++)
            if (b[k] == '"' && !(k > 0 && b[k - 1] == '\\')) in_string = !in_string;
    }
    di_tok_free(ids);
    return 0;
}

// The tool-call block: ｜DSML｜ as the special token; a token is in a value when it starts
// between a parameter's `">` and the `</` that closes it.
static int doc_tools(doc *d, di_tokenizer *tok) {
    const int32_t dsml = di_tokenizer_token_id(tok, "｜DSML｜");
    d->name = "DSML tool-call block under the tool grammar";
    d->tools = true;
    d->n = 0;
    for (const char *s = k_block; *s;) {
        const char *x = strstr(s, "｜DSML｜");
        size_t n = x ? (size_t)(x - s) : strlen(s);
        int32_t *piece = NULL;
        size_t np = 0;
        if (n && di_tokenizer_encode(tok, s, n, false, &piece, &np) != DI_OK) return 1;
        for (size_t i = 0; i < np && d->n < 1023; i++) d->ids[d->n++] = piece[i];
        di_tok_free(piece);
        s += n;
        if (x) d->ids[d->n++] = dsml, s += strlen("｜DSML｜");
    }
    size_t off = 0;
    bool was = false;
    for (size_t i = 0; i < d->n; i++) {
        const char *at = k_block + off;
        // the last `string="..."">` before this token, and whether its value is still open
        const char *open = NULL;
        for (const char *p = strstr(k_block, "\">"); p && p < at; p = strstr(p + 2, "\">"))
            if (p - k_block >= 6 && !memcmp(p - 5, "false", 5))
                open = p + 2;
            else if (p - k_block >= 5 && !memcmp(p - 4, "true", 4))
                open = p + 2;
        const char *close = open ? strstr(open, "</") : NULL;
        const bool in = open && at >= open && at < close;
        d->kind[i] = !in ? TOK_STRUCT : was ? TOK_VALUE : TOK_FIRST;
        was = in;
        size_t nb = 0;
        di_tokenizer_token_bytes(tok, d->ids[i], &nb);
        off += nb;
    }
    return 0;
}

// ---- constrained decoding through the engine ----

typedef struct gen_count {
    atomic_int n_tokens, n_done;
} gen_count;

static void on_gen(void *user, const di_event *ev) {
    gen_count *c = user;
    if (ev->token >= 0) atomic_fetch_add(&c->n_tokens, 1);
    if (ev->finish != DI_FINISH_NONE) atomic_fetch_add(&c->n_done, 1);
}

// Decode tokens/s of n_req concurrent requests of 64 tokens (constrained by g, or not), the best
// of reps runs; *ahead: the share of masks the engine thread computed during the forward.
static double engine_rate(const char *dir, const di_grammar_vocab *vocab, const di_grammar *g,
                          int n_req, int reps, double *ahead) {
    di_engine_options o = di_engine_options_default();
    const long n_cpu = sysconf(_SC_NPROCESSORS_ONLN);
    o.n_threads = n_cpu > 1 ? (int)n_cpu - 1 : 1; // a CPU left for the engine thread's masks
    o.kv_memory_bytes = (size_t)256 << 20;
    o.max_seqs = n_req;
    o.max_ctx = 512;
    o.grammar_vocab = vocab;
    di_engine *e = NULL;
    if (di_engine_create(dir, &o, &e) != DI_OK) return -1;
    static const int32_t prompt[8] = {100, 2000, 300, 4000, 500, 6000, 700, 8000};
    double best = 0;
    int64_t n_tok = 0;
    for (int r = 0; r < reps; r++) {
        gen_count c = {0};
        double t0 = now();
        for (int i = 0; i < n_req; i++) {
            di_request_params p = di_request_params_default();
            p.prompt = prompt;
            p.n_prompt = 8;
            p.max_tokens = 64;
            p.ignore_eos = true;
            p.sample.temperature = 1.0f;
            p.sample.seed = (uint64_t)(r * 100 + i);
            p.grammar = g;
            p.on_event = on_gen;
            p.user = &c;
            uint64_t id;
            if (di_engine_submit(e, &p, &id) != DI_OK) return -1;
        }
        di_engine_wait_idle(e);
        const double rate = atomic_load(&c.n_tokens) / (now() - t0);
        if (rate > best) best = rate;
        n_tok += atomic_load(&c.n_tokens);
    }
    di_engine_stats st;
    di_engine_get_stats(e, &st); // (the last step's count may land after wait_idle returns)
    *ahead = n_tok ? (double)st.n_masks_ahead / (double)n_tok : 0;
    di_engine_destroy(e);
    return best;
}

static int bench_engine(const di_grammar_vocab *vocab, const di_grammar *g, int reps) {
    char dir[] = "/tmp/di_bench_grammar_XXXXXX";
    if (!mkdtemp(dir)) return 1;
    di_synth_config c;
    if (di_synth_preset("tiny", &c) != DI_OK || di_synth_write(&c, dir) != DI_OK) return 1;
    di_set_log_level(1);
    const long n_cpu = sysconf(_SC_NPROCESSORS_ONLN);
    printf("engine, tiny model, %ld pool threads, 4 requests x 64 tokens (sampled), tokens/s, "
           "best of %d:\n",
           n_cpu > 1 ? n_cpu - 1 : 1, reps);
    for (int sync = 0; sync < 2; sync++) {
        setenv("DI_ENGINE_SYNC", sync ? "1" : "0", 1);
        double ahead = 0, unused = 0;
        const double rc = engine_rate(dir, vocab, g, 4, reps, &ahead);
        const double ru = engine_rate(dir, vocab, NULL, 4, reps, &unused);
        printf("  %-34s constrained %7.1f  unconstrained %7.1f  masks computed ahead %3.0f%%\n",
               sync ? "synchronous (DI_ENGINE_SYNC=1)" : "overlapped (plans and masks ahead)", rc,
               ru, 100 * ahead);
    }
    unsetenv("DI_ENGINE_SYNC");
    char cmd[128];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
    return system(cmd) != 0;
}

int main(int argc, char **argv) {
    int reps = argc > 1 ? atoi(argv[1]) : 3;
    const bool verbose = argc > 2 && !strcmp(argv[2], "-v"); // print each token's mask time
    di_tokenizer *tok = NULL;
    di_grammar_vocab *vocab = NULL;
    if (di_tokenizer_load_for_model(NULL, &tok) != DI_OK) return 1;
    double t0 = now();
    if (di_grammar_vocab_create(tok, &vocab) != DI_OK) return 1;
    double t_vocab = now() - t0;
    di_grammar *g = NULL;
    char err[256];
    t0 = now();
    for (int r = 0; r < 20; r++) {
        di_grammar_destroy(g);
        g = NULL;
        if (di_grammar_compile(DI_GRAMMAR_KIND_JSON_SCHEMA, k_schema, strlen(k_schema), 0, &g, err,
                               sizeof err) != DI_OK) {
            fprintf(stderr, "compile: %s\n", err);
            return 1;
        }
    }
    const double t_compile = (now() - t0) / 20;
    di_grammar *tg = NULL;
    t0 = now();
    for (int r = 0; r < 20; r++) {
        di_grammar_destroy(tg);
        tg = NULL;
        if (di_grammar_compile_tools(tok, k_tools, strlen(k_tools), NULL, &tg, err, sizeof err) !=
            DI_OK) {
            fprintf(stderr, "tools: %s\n", err);
            return 1;
        }
    }
    const double t_tools = (now() - t0) / 20;
    printf("vocab trie: %d tokens, built in %.1f ms; schema compiled in %.3f ms (%d rules); "
           "3 tools compiled in %.3f ms (%d rules)\n",
           di_tokenizer_n_vocab(tok), t_vocab * 1e3, t_compile * 1e3, di_grammar_n_rules(g),
           t_tools * 1e3, di_grammar_n_rules(tg));
    di_grammar_destroy(tg);
    static doc dj, df, dt;
    if (doc_json(&dj, tok, "JSON document under the schema", k_schema, k_doc) ||
        doc_json(&df, tok, "JSON document of formatted strings", k_formats, k_formats_doc) ||
        doc_tools(&dt, tok))
        return 1;
    if (bench_doc(&dj, tok, vocab, reps, verbose) || bench_doc(&df, tok, vocab, reps, verbose) ||
        bench_doc(&dt, tok, vocab, reps, verbose))
        return 1;
    if (bench_engine(vocab, g, reps)) return 1;
    di_grammar_destroy(g);
    di_grammar_vocab_destroy(vocab);
    di_tokenizer_destroy(tok);
    return 0;
}
