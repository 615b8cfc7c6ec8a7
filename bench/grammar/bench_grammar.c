// Grammar-constrained decoding costs on the real DeepSeek V4 vocabulary (129,280 tokens): compile
// time of a typical JSON Schema, then a document is fed token by token (its own tokenization) and
// the allowed-token mask is computed before every token, without the mask cache (a cold walk of
// the vocabulary trie) and with it. Prints µs/token by where the document is (inside a string
// value, or in structure: between keys, values, punctuation) and the overall mean; then the same
// for a DSML tool-call block under a tool grammar (three tools, two calls); then constrained
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

static int bench_tools(di_tokenizer *tok, const di_grammar_vocab *vocab, int reps) {
    const int32_t dsml = di_tokenizer_token_id(tok, "｜DSML｜");
    di_grammar *g = NULL;
    char err[512];
    double t0 = now();
    for (int r = 0; r < 20; r++) {
        di_grammar_destroy(g);
        g = NULL;
        if (di_grammar_compile_tools(tok, k_tools, strlen(k_tools), NULL, &g, err, sizeof err) !=
            DI_OK) {
            fprintf(stderr, "tools: %s\n", err);
            return 1;
        }
    }
    const double t_compile = (now() - t0) / 20;
    int32_t ids[1024];
    size_t n_ids = 0;
    for (const char *s = k_block; *s;) {
        const char *d = strstr(s, "｜DSML｜");
        size_t n = d ? (size_t)(d - s) : strlen(s);
        int32_t *piece = NULL;
        size_t np = 0;
        if (n && di_tokenizer_encode(tok, s, n, false, &piece, &np) != DI_OK) return 1;
        for (size_t i = 0; i < np && n_ids < 1023; i++) ids[n_ids++] = piece[i];
        di_tok_free(piece);
        s += n;
        if (d) ids[n_ids++] = dsml, s += strlen("｜DSML｜");
    }
    const int32_t V = di_tokenizer_n_vocab(tok);
    uint64_t *mask = malloc(sizeof(uint64_t) * (size_t)((V + 63) / 64));
    printf("tool grammar: 3 tools compiled in %.3f ms (%d rules); block: %zu tokens\n",
           t_compile * 1e3, di_grammar_n_rules(g), n_ids);
    for (int cached = 0; cached < 2; cached++) {
        di_grammar_matcher_limits lim = di_grammar_matcher_limits_default();
        if (!cached) lim.n_cache = 0;
        double best = 1e30, max_us = 0;
        for (int r = 0; r < reps; r++) {
            di_grammar_matcher *m = NULL;
            if (di_grammar_matcher_create(g, vocab, &lim, &m) != DI_OK) return 1;
            double s_all = 0;
            for (size_t i = 0; i < n_ids; i++) {
                int32_t n_allowed = 0;
                double a = now();
                if (di_grammar_matcher_mask(m, mask, &n_allowed) != DI_OK) return 1;
                double dt = now() - a;
                s_all += dt;
                if (dt * 1e6 > max_us) max_us = dt * 1e6;
                if (!((mask[ids[i] >> 6] >> (ids[i] & 63)) & 1) ||
                    !di_grammar_matcher_advance_token(m, ids[i])) {
                    fprintf(stderr, "tool block token %zu refused\n", i);
                    return 1;
                }
            }
            if (!di_grammar_matcher_is_done(m)) fprintf(stderr, "tool block not complete\n");
            di_grammar_matcher_destroy(m);
            if (s_all < best) best = s_all;
        }
        printf("tool mask %-9s: %7.1f us/token mean (%zu tokens), slowest %.0f us\n",
               cached ? "cache on" : "cache off", best / (double)n_ids * 1e6, n_ids, max_us);
    }
    free(mask);
    di_grammar_destroy(g);
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
    double t_compile = (now() - t0) / 20;
    int32_t *ids = NULL;
    size_t n_ids = 0;
    if (di_tokenizer_encode(tok, k_doc, strlen(k_doc), false, &ids, &n_ids) != DI_OK) return 1;
    const int32_t V = di_tokenizer_n_vocab(tok);
    uint64_t *mask = malloc(sizeof(uint64_t) * (size_t)((V + 63) / 64));
    printf("vocab trie: %d tokens, built in %.1f ms; schema compiled in %.3f ms (%d rules); "
           "document: %zu tokens, %zu bytes\n",
           V, t_vocab * 1e3, t_compile * 1e3, di_grammar_n_rules(g), n_ids, strlen(k_doc));
    for (int cached = 0; cached < 2; cached++) {
        di_grammar_matcher_limits lim = di_grammar_matcher_limits_default();
        if (!cached) lim.n_cache = 0;
        double best_str = 1e30, best_struct = 1e30, best_all = 1e30, max_us = 0;
        int n_str = 0, n_struct = 0;
        long long allowed_sum = 0;
        for (int r = 0; r < reps; r++) {
            di_grammar_matcher *m = NULL;
            if (di_grammar_matcher_create(g, vocab, &lim, &m) != DI_OK) return 1;
            double s_str = 0, s_struct = 0, s_all = 0;
            n_str = n_struct = 0;
            allowed_sum = 0;
            bool in_string = false; // inside a JSON string before this token
            for (size_t i = 0; i < n_ids; i++) {
                int32_t n_allowed = 0;
                double a = now();
                if (di_grammar_matcher_mask(m, mask, &n_allowed) != DI_OK) return 1;
                double dt = now() - a;
                allowed_sum += n_allowed;
                if (!((mask[ids[i] >> 6] >> (ids[i] & 63)) & 1)) {
                    fprintf(stderr, "token %zu of the document is not allowed\n", i);
                    return 1;
                }
                s_all += dt;
                if (dt * 1e6 > max_us) max_us = dt * 1e6;
                if (verbose && r == 0) {
                    size_t nb = 0;
                    const char *tb = di_tokenizer_token_bytes(tok, ids[i], &nb);
                    printf("  cache %d token %3zu %-16.*s %9.1f us, %6d allowed, %d stacks\n",
                           cached, i, (int)nb, tb, dt * 1e6, n_allowed,
                           di_grammar_matcher_n_stacks(m));
                }
                if (in_string)
                    s_str += dt, n_str++;
                else
                    s_struct += dt, n_struct++;
                size_t nb = 0;
                const char *b = di_tokenizer_token_bytes(tok, ids[i], &nb);
                for (size_t k = 0; k < nb; k++) {
                    if (b[k] == '"' && !(k > 0 && b[k - 1] == '\\')) in_string = !in_string;
                }
                if (!di_grammar_matcher_advance_token(m, ids[i])) {
                    fprintf(stderr, "token %zu refused\n", i);
                    return 1;
                }
            }
            if (!di_grammar_matcher_is_done(m)) fprintf(stderr, "document not complete\n");
            di_grammar_matcher_destroy(m);
            if (s_all < best_all) best_all = s_all;
            if (s_str < best_str) best_str = s_str;
            if (s_struct < best_struct) best_struct = s_struct;
        }
        printf("mask %-9s: %7.1f us/token mean (%zu tokens), inside strings %7.1f us (%d), "
               "structure %7.1f us (%d), slowest %.0f us, %.0f tokens allowed on average\n",
               cached ? "cache on" : "cache off", best_all / (double)n_ids * 1e6, n_ids,
               n_str ? best_str / n_str * 1e6 : 0, n_str,
               n_struct ? best_struct / n_struct * 1e6 : 0, n_struct, max_us,
               (double)allowed_sum / (double)n_ids);
    }
    free(mask);
    di_tok_free(ids);
    if (bench_engine(vocab, g, reps)) return 1;
    di_grammar_destroy(g);
    if (bench_tools(tok, vocab, reps)) return 1;
    di_grammar_vocab_destroy(vocab);
    di_tokenizer_destroy(tok);
    return 0;
}
