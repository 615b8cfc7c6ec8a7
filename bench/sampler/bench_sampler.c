// Host sampler cost at DeepSeek V4's vocabulary (V = 129,280): µs per row of di_sampler_sample
// (and di_sampler_sample_allowed under a grammar-like mask) for the parameter sets the engine
// sees, on flat rows (logits N(0, 3)) and peaked ones (the same plus 20 tokens at 25 .. 11),
// next to the oracle (tests/unit/sampler_ref.c, the implementation before the selection rework)
// on the same rows, their ratio, and every path's cost in read passes over the row: one pass is
// the time of summing the row's V floats, measured in the same run (the physical reference: no
// sampler reads the row fewer times than once). Every result is also compared with the oracle's
// (a mismatch is reported: the bench is no test, test_sampler is). One thread. Not a test.
//
//   build/bench_sampler [min_seconds_per_cell [path name substring]]
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "sample/sampler.h"
#include "sampler_ref.h"

enum { V = 129280, N_ROWS = 8, N_HIST = 256 };

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static uint64_t g_rng = 0x9e3779b97f4a7c15ull;
static double rnd01(void) {
    uint64_t z = (g_rng += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return (double)((z ^ (z >> 31)) >> 11) * (1.0 / 9007199254740992.0);
}
static double gauss(void) {
    return sqrt(-2 * log(rnd01() + 1e-300)) * cos(6.283185307179586 * rnd01());
}

// One read pass: the sum of the row's floats (eight partial sums, so it runs at the load rate
// rather than at the adder's latency).
static float read_pass(const float *x) {
    float s[8] = {0};
    for (int32_t i = 0; i + 8 <= V; i += 8)
        for (int j = 0; j < 8; j++) s[j] += x[i + j];
    return ((s[0] + s[1]) + (s[2] + s[3])) + ((s[4] + s[5]) + (s[6] + s[7]));
}

typedef struct bench_case {
    const char *name;
    di_sample_params p;
    bool masked; // under the allowed-token mask
} bench_case;

static volatile float g_sink;

int main(int argc, char **argv) {
    const double min_s = argc > 1 ? atof(argv[1]) : 0.3;
    const char *only = argc > 2 ? argv[2] : NULL;
    float *rows[2][N_ROWS];
    for (int k = 0; k < 2; k++)
        for (int r = 0; r < N_ROWS; r++) {
            float *l = rows[k][r] = malloc(sizeof(float) * V);
            for (int32_t i = 0; i < V; i++) l[i] = (float)(3 * gauss());
            if (k == 1)
                for (int j = 0; j < 20; j++)
                    l[(int32_t)(rnd01() * V)] = 25.0f - (float)j * (14.0f / 19);
        }
    int32_t hist[N_HIST];
    for (int i = 0; i < N_HIST; i++) hist[i] = (int32_t)(rnd01() * (i < 128 ? 2000 : V));
    uint64_t *allow = malloc(sizeof(uint64_t) * (V / 64 + 1));
    for (int32_t w = 0; w < V / 64 + 1; w++) // a grammar's mask: runs of allowed and refused words
        allow[w] = (w / 16) % 3 == 0 ? ~0ull : (w % 5 == 0 ? 0x0f0f0f0f0f0f0f0full : 0);
    di_sampler *s = NULL;
    ref_sampler *ref = NULL;
    if (di_sampler_create(V, &s) != DI_OK || ref_sampler_create(V, &ref) != DI_OK) return 1;

    di_sample_params d = di_sample_params_default();
    bench_case cases[16];
    int n_cases = 0;
    cases[n_cases++] = (bench_case){"greedy", d, false};
    di_sample_params p = d;
    p.temperature = 0.7f, p.top_p = 0.95f;
    cases[n_cases++] = (bench_case){"t=0.7 top_p=0.95", p, false};
    p = d, p.temperature = 1, p.top_k = 50, p.repetition_penalty = 1.1f;
    cases[n_cases++] = (bench_case){"t=1 top_k=50 rep=1.1", p, false};
    p = d, p.temperature = 1, p.logprobs = true, p.n_logprobs = 5;
    cases[n_cases++] = (bench_case){"t=1 logprobs+5", p, false};
    p = d, p.temperature = 1;
    cases[n_cases++] = (bench_case){"t=1", p, false};
    p = d, p.temperature = 0.6f, p.top_k = 20, p.top_p = 0.95f;
    cases[n_cases++] = (bench_case){"t=0.6 top_k=20 top_p=0.95", p, false};
    p = d, p.temperature = 1, p.min_p = 0.05f;
    cases[n_cases++] = (bench_case){"t=1 min_p=0.05", p, false};
    p = d, p.temperature = 1, p.presence_penalty = 0.5f, p.frequency_penalty = 0.2f;
    p.logprobs = true;
    cases[n_cases++] = (bench_case){"t=1 pres+freq logprobs", p, false};
    p = d, p.temperature = 0.7f, p.top_p = 0.95f;
    cases[n_cases++] = (bench_case){"masked t=0.7 top_p=0.95", p, true};
    p = d;
    cases[n_cases++] = (bench_case){"masked greedy", p, true};

    // The physical reference.
    double t0 = now();
    int64_t n_pass = 0;
    while (now() - t0 < min_s)
        for (int r = 0; r < N_ROWS; r++, n_pass++) g_sink += read_pass(rows[0][r]);
    const double pass_us = (now() - t0) * 1e6 / (double)n_pass;
    printf("V = %d, one thread; one read pass (sum of V floats) = %.2f us\n\n", V, pass_us);
    printf("%-28s %-6s %10s %10s %8s %9s %9s %s\n", "path", "rows", "new us", "oracle us", "ratio",
           "new pass", "orac pass", "");
    int bad_total = 0;
    for (int c = 0; c < n_cases; c++) {
        if (only && !strstr(cases[c].name, only)) continue;
        for (int k = 0; k < 2; k++) {
            const bench_case *bc = &cases[c];
            double us[2];
            int bad = 0;
            di_sample_result want[N_ROWS];
            for (int impl = 1; impl >= 0; impl--) { // the oracle first: its results are compared
                int64_t n = 0, pos = 1000;
                double t = now();
                while (n < N_ROWS || now() - t < min_s) {
                    for (int r = 0; r < N_ROWS; r++, n++, pos++) {
                        di_sample_result res;
                        const float *l = rows[k][r];
                        const int64_t at = 1000 + r; // the same draw per row every round
                        if (impl == 0 && bc->masked)
                            di_sampler_sample_allowed(s, l, allow, &bc->p, hist, 128, 128, at,
                                                      &res);
                        else if (impl == 0)
                            di_sampler_sample(s, l, &bc->p, hist, 128, 128, at, &res);
                        else if (bc->masked)
                            ref_sampler_sample_allowed(ref, l, allow, &bc->p, hist, 128, 128, at,
                                                       &res);
                        else
                            ref_sampler_sample(ref, l, &bc->p, hist, 128, 128, at, &res);
                        if (impl == 1)
                            want[r] = res;
                        else
                            bad += res.token != want[r].token ||
                                   memcmp(&res.logprob, &want[r].logprob, sizeof(float)) != 0 ||
                                   memcmp(res.top_ids, want[r].top_ids,
                                          sizeof(int32_t) * (size_t)res.n_top) != 0;
                    }
                }
                (void)pos;
                us[impl] = (now() - t) * 1e6 / (double)n;
            }
            bad_total += bad;
            printf("%-28s %-6s %10.1f %10.1f %7.1fx %9.2f %9.2f %s\n", bc->name,
                   k ? "peaked" : "flat", us[0], us[1], us[1] / us[0], us[0] / pass_us,
                   us[1] / pass_us, bad ? "MISMATCH" : "");
            fflush(stdout);
        }
    }
    if (bad_total) printf("\n%d results differ from the oracle's\n", bad_total);
    di_sampler_destroy(s);
    ref_sampler_destroy(ref);
    for (int k = 0; k < 2; k++)
        for (int r = 0; r < N_ROWS; r++) free(rows[k][r]);
    free(allow);
    return bad_total != 0;
}
