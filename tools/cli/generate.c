// deepinfer generate: greedy or temperature sampling from a prompt of token ids.
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli/args.h"
#include "cli/cli.h"

static void usage(FILE *f) {
    fprintf(f, "usage: deepinfer generate --model DIR --tokens 5,17,... [-n 64]\n"
               "                          [--temperature 0] [--seed 0] [--threads N]\n"
               "                          [--precision fp32|official] [--no-stop]\n"
               "Prints the generated token ids, comma-separated, on one line. Temperature 0 is\n"
               "greedy (ties to the lowest id); generation stops at the model's EOS token unless\n"
               "--no-stop is given.\n");
}

// splitmix64: a small deterministic generator for the seeded sampler.
static uint64_t next_u64(uint64_t *s) {
    uint64_t z = (*s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

static int32_t pick(const float *logits, int32_t n, double temperature, uint64_t *rng) {
    int32_t best = 0;
    for (int32_t i = 1; i < n; i++)
        if (logits[i] > logits[best]) best = i;
    if (temperature <= 0) return best;
    double sum = 0;
    for (int32_t i = 0; i < n; i++) sum += exp((logits[i] - logits[best]) / temperature);
    double u = (double)(next_u64(rng) >> 11) / 9007199254740992.0 * sum, acc = 0;
    for (int32_t i = 0; i < n; i++) {
        acc += exp((logits[i] - logits[best]) / temperature);
        if (u < acc) return i;
    }
    return best;
}

int di_cli_generate(int argc, char **argv) {
    di_model_args ma = {.opt = di_model_options_default()};
    const char *tokens_s = NULL;
    long n_gen = 64, seed = 0;
    double temperature = 0;
    bool stop_at_eos = true;
    for (int i = 1; i < argc; i++) {
        int r = di_args_model_option(argc, argv, &i, &ma);
        if (r < 0) return 2;
        if (r > 0) continue;
        const char *a = argv[i];
        if (strcmp(a, "--help") == 0) {
            usage(stdout);
            return 0;
        }
        if (strcmp(a, "--no-stop") == 0) {
            stop_at_eos = false;
            continue;
        }
        if (i + 1 >= argc) {
            fprintf(stderr, "deepinfer generate: unknown option or missing value '%s'\n", a);
            return 2;
        }
        const char *v = argv[++i];
        if (strcmp(a, "--tokens") == 0) tokens_s = v;
        else if (strcmp(a, "-n") == 0) {
            if (!di_args_int(v, "-n", 0, 1 << 24, &n_gen)) return 2;
        } else if (strcmp(a, "--seed") == 0) {
            if (!di_args_int(v, "--seed", 0, 0x7fffffffL, &seed)) return 2;
        } else if (strcmp(a, "--temperature") == 0) {
            char *end;
            temperature = strtod(v, &end);
            if (*end || temperature < 0 || !isfinite(temperature)) {
                fprintf(stderr, "deepinfer generate: --temperature must be a number >= 0\n");
                return 2;
            }
        } else {
            fprintf(stderr, "deepinfer generate: unknown option '%s'\n", a);
            usage(stderr);
            return 2;
        }
    }
    if (!tokens_s) {
        usage(stderr);
        return 2;
    }
    if (!ma.model && !(ma.model = di_args_default_model())) return 1;
    int32_t *prompt = NULL, n_prompt = 0;
    if (!di_args_int_list(tokens_s, "--tokens", &prompt, &n_prompt)) return 2;
    int rc = 1;
    di_model *m = NULL;
    di_session *s = NULL;
    float *logits = NULL;
    di_status st = di_model_load(ma.model, &ma.opt, &m);
    if (st != DI_OK) {
        fprintf(stderr, "deepinfer generate: cannot load %s: %s\n", ma.model, di_status_str(st));
        goto done;
    }
    di_model_info info;
    di_model_get_info(m, &info);
    if ((st = di_session_create(m, NULL, &s)) != DI_OK) goto done;
    logits = malloc(sizeof(float) * (size_t)info.n_vocab);
    if (!logits) goto done;
    uint64_t rng = (uint64_t)seed;
    di_forward_out fo = {.logits = logits, .last_only = true};
    if ((st = di_session_forward(s, prompt, n_prompt, &fo)) != DI_OK) {
        fprintf(stderr, "deepinfer generate: %s\n", di_status_str(st));
        goto done;
    }
    const int32_t eos = info.eos_token_id;
    for (long i = 0; i < n_gen; i++) {
        int32_t tok = pick(logits, info.n_vocab, temperature, &rng);
        printf("%s%d", i ? "," : "", tok);
        fflush(stdout);
        if ((stop_at_eos && tok == eos) || i + 1 == n_gen) break;
        if ((st = di_session_forward(s, &tok, 1, &fo)) != DI_OK) {
            fprintf(stderr, "\ndeepinfer generate: %s\n", di_status_str(st));
            goto done;
        }
    }
    printf("\n");
    rc = 0;
done:
    free(logits);
    free(prompt);
    di_session_destroy(s);
    di_model_destroy(m);
    return rc;
}
