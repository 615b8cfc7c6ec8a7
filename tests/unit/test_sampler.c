// sampler: greedy, temperature, top-k / top-p / min-p, penalties, logit bias, logprobs, and the
// counter-based randomness (same (seed, position) -> same token, whatever the call order); a
// grammar's allowed-token mask.
#include "harness.h"

#include <math.h>

#include "sample/sampler.h"

enum { V = 8 };

static di_sampler *g_s;

static int32_t draw(const float *logits, const di_sample_params *p, int64_t pos) {
    di_sample_result r;
    di_sampler_sample(g_s, logits, p, NULL, 0, 0, pos, &r);
    return r.token;
}

static void test_greedy_and_ties(void) {
    float l[V] = {1, 3, 3, 0, -1, 2, 3, 0};
    di_sample_params p = di_sample_params_default();
    CHECK_EQ(draw(l, &p, 0), 1); // ties to the lowest id
    p.seed = 99;                 // seed is irrelevant for greedy
    CHECK_EQ(draw(l, &p, 7), 1);
}

static void test_uniform_counter(void) {
    double a = di_sample_uniform(42, 1000), b = di_sample_uniform(42, 1000);
    CHECK(a == b);
    CHECK(di_sample_uniform(42, 1001) != a);
    CHECK(di_sample_uniform(43, 1000) != a);
    double sum = 0;
    int ok = 1;
    for (int64_t i = 0; i < 100000; i++) {
        double u = di_sample_uniform(7, i);
        ok &= u >= 0 && u < 1;
        sum += u;
    }
    CHECK(ok);
    CHECK_NEAR(sum / 100000, 0.5, 0.01);
}

static void test_distribution_and_order_independence(void) {
    float l[V];
    double want[V] = {0.4, 0.3, 0.2, 0.1, 0, 0, 0, 0};
    for (int i = 0; i < V; i++) l[i] = want[i] > 0 ? logf((float)want[i]) : -INFINITY;
    di_sample_params p = di_sample_params_default();
    p.temperature = 1;
    p.seed = 1234;
    enum { N = 40000 };
    static int32_t fwd[N];
    int count[V] = {0};
    for (int i = 0; i < N; i++) count[fwd[i] = draw(l, &p, i)]++;
    for (int i = 0; i < V; i++) CHECK_NEAR((double)count[i] / N, want[i], 0.015);
    // Reverse order of positions: the same token at every position (counter-based).
    int same = 1;
    for (int i = N - 1; i >= 0; i--) same &= draw(l, &p, i) == fwd[i];
    CHECK(same);
    // A different seed draws a different sequence.
    p.seed = 1235;
    int diff = 0;
    for (int i = 0; i < 200; i++) diff += draw(l, &p, i) != fwd[i];
    CHECK(diff > 50);
}

static void test_truncation(void) {
    float l[V];
    double pr[V] = {0.35, 0.25, 0.2, 0.1, 0.05, 0.03, 0.015, 0.005};
    for (int i = 0; i < V; i++) l[i] = logf((float)pr[i]);
    di_sample_params p = di_sample_params_default();
    p.temperature = 1;
    int seen[V];
    // top-k = 2: only ids 0, 1.
    p.top_k = 2;
    memset(seen, 0, sizeof seen);
    for (int i = 0; i < 3000; i++) seen[draw(l, &p, i)]++;
    CHECK(seen[0] > 0 && seen[1] > 0 &&
          seen[2] + seen[3] + seen[4] + seen[5] + seen[6] + seen[7] == 0);
    CHECK_NEAR((double)seen[0] / 3000, 0.35 / 0.6, 0.04);
    // top-p = 0.75: the smallest prefix reaching 0.75 is {0, 1, 2} (0.8).
    p.top_k = 0;
    p.top_p = 0.75f;
    memset(seen, 0, sizeof seen);
    for (int i = 0; i < 3000; i++) seen[draw(l, &p, i)]++;
    CHECK(seen[2] > 0 && seen[3] == 0 && seen[7] == 0);
    // top-p smaller than the top token's mass: always the top token.
    p.top_p = 0.2f;
    int all0 = 1;
    for (int i = 0; i < 500; i++) all0 &= draw(l, &p, i) == 0;
    CHECK(all0);
    // min-p = 0.5: keep tokens with p >= 0.175 -> {0, 1, 2}.
    p.top_p = 1;
    p.min_p = 0.5f;
    memset(seen, 0, sizeof seen);
    for (int i = 0; i < 3000; i++) seen[draw(l, &p, i)]++;
    CHECK(seen[2] > 0 && seen[3] == 0);
    // temperature sharpens: T = 0.1 almost always the top token.
    p.min_p = 0;
    p.temperature = 0.1f;
    memset(seen, 0, sizeof seen);
    for (int i = 0; i < 1000; i++) seen[draw(l, &p, i)]++;
    CHECK(seen[0] > 950);
}

static void test_penalties_and_bias(void) {
    float l[V] = {2.0f, 1.9f, 1.0f, -1.0f, 0, 0, 0, 0};
    di_sample_params p = di_sample_params_default();
    di_sample_result r;
    int32_t hist[4] = {5, 0, 0, 3}; // prompt {5}, generated {0, 0, 3}
    // repetition 1.1: 2.0 / 1.1 = 1.818 < 1.9 -> id 1.
    p.repetition_penalty = 1.1f;
    di_sampler_sample(g_s, l, &p, hist, 1, 3, 4, &r);
    CHECK_EQ(r.token, 1);
    // The prompt counts for repetition: id 5 (logit 0) stays 0; a negative one is multiplied.
    p.repetition_penalty = 1;
    // frequency 0.06 per occurrence: id 0 -> 2.0 - 0.12 = 1.88 < 1.9 -> id 1; 0.04 -> 1.92 -> id 0.
    p.frequency_penalty = 0.06f;
    di_sampler_sample(g_s, l, &p, hist, 1, 3, 4, &r);
    CHECK_EQ(r.token, 1);
    p.frequency_penalty = 0.04f;
    di_sampler_sample(g_s, l, &p, hist, 1, 3, 4, &r);
    CHECK_EQ(r.token, 0);
    // presence applies once per distinct generated token, not to prompt tokens.
    p.frequency_penalty = 0;
    p.presence_penalty = 0.2f;
    di_sampler_sample(g_s, l, &p, hist, 1, 3, 4, &r);
    CHECK_EQ(r.token, 1);
    p.presence_penalty = 0.05f;
    di_sampler_sample(g_s, l, &p, hist, 1, 3, 4, &r);
    CHECK_EQ(r.token, 0);
    // logit bias forces a token; logprob is still of the raw logits (and 0 when not asked for).
    p = di_sample_params_default();
    di_logit_bias b = {7, 100};
    p.logit_bias = &b;
    p.n_logit_bias = 1;
    di_sampler_sample(g_s, l, &p, NULL, 0, 0, 0, &r);
    CHECK_EQ(r.token, 7);
    CHECK_EQ(r.logprob, 0);
    p.logprobs = true;
    di_sampler_sample(g_s, l, &p, NULL, 0, 0, 0, &r);
    CHECK_EQ(r.token, 7);
    double lse = 0;
    for (int i = 0; i < V; i++) lse += exp(l[i]);
    lse = log(lse);
    CHECK_NEAR(r.logprob, 0 - lse, 1e-5);
}

static void test_logprobs(void) {
    float l[V] = {0.5f, 3, 1, 3, -2, 0, 2, 1};
    di_sample_params p = di_sample_params_default();
    p.n_logprobs = 4;
    di_sample_result r;
    di_sampler_sample(g_s, l, &p, NULL, 0, 0, 0, &r);
    CHECK_EQ(r.n_top, 4);
    int32_t want[4] = {1, 3, 6, 2}; // descending, ties to the lower id
    for (int i = 0; i < 4; i++) CHECK_EQ(r.top_ids[i], want[i]);
    double z = 0;
    for (int i = 0; i < V; i++) z += exp(l[i]);
    for (int i = 0; i < 4; i++) CHECK_NEAR(r.top_logprobs[i], l[want[i]] - log(z), 1e-5);
    CHECK_NEAR(r.logprob, r.top_logprobs[0], 1e-7);
}

static int32_t draw_n(di_sampler *s, const float *l, const di_sample_params *p) {
    di_sample_result r;
    di_sampler_sample(s, l, p, NULL, 0, 0, 0, &r);
    return r.token;
}

// The sampler's own exp (a polynomial, not libm): log-probabilities of logits spread over the
// whole useful range (gaps up to 700 below the maximum, and -inf) match libm's to 1e-12.
static void test_logprob_precision(void) {
    di_sampler *s = NULL;
    enum { NV = 1003 };
    CHECK_EQ(di_sampler_create(NV, &s), DI_OK);
    if (!s) return;
    static float l[NV];
    for (int i = 0; i < NV; i++) l[i] = (float)(-0.7 * i + 3.0 * sin(i * 0.37));
    l[17] = -INFINITY;
    l[500] = 12.5f;
    di_sample_params p = di_sample_params_default();
    p.logprobs = true;
    for (int tok = 0; tok < NV; tok += 97) {
        float mx = l[500];
        double z = 0;
        for (int i = 0; i < NV; i++) z += exp((double)l[i] - mx);
        double lse = mx + log(z);
        p.logit_bias = &(di_logit_bias){tok, 1e9f}; // forces tok; logprob is of the raw logits
        p.n_logit_bias = 1;
        di_sample_result r;
        di_sampler_sample(s, l, &p, NULL, 0, 0, 0, &r);
        CHECK_EQ(r.token, tok);
        CHECK_NEAR(r.logprob, (float)(l[tok] - lse), 1e-6 * fabs(l[tok] - lse) + 1e-6);
    }
    // Greedy is the first index of the maximum; NaNs never win, a NaN at 0 keeps 0.
    for (int i = 0; i < NV; i++) l[i] = (float)(i % 7) - 20.0f;
    l[5] = NAN;
    l[600] = l[900] = 4.0f;
    l[1001] = 4.0f;
    p = di_sample_params_default();
    CHECK_EQ(draw_n(s, l, &p), 600);
    l[600] = -0.0f, l[900] = 0.0f, l[1001] = -1e-30f;
    for (int i = 0; i < NV; i++)
        if (l[i] > 0) l[i] = -l[i];
    l[5] = NAN;
    CHECK_EQ(draw_n(s, l, &p), 600); // -0 and +0 are equal: the first wins
    l[1002] = INFINITY;
    CHECK_EQ(draw_n(s, l, &p), 1002); // in the scalar tail of the vector scan
    l[0] = NAN;
    CHECK_EQ(draw_n(s, l, &p), 0);
    // Tempered draws see the same weights: a uniform-ish row gives every candidate.
    for (int i = 0; i < NV; i++) l[i] = (float)(i % 5) * 0.01f;
    p = di_sample_params_default();
    p.temperature = 1;
    int seen[5] = {0};
    for (int pos = 0; pos < 200; pos++) {
        di_sample_result r;
        di_sampler_sample(s, l, &p, NULL, 0, 0, pos, &r);
        seen[r.token % 5]++;
    }
    for (int k = 0; k < 5; k++) CHECK(seen[k] > 10);
    di_sampler_destroy(s);
}

static void test_params_check(void) {
    di_sample_params p = di_sample_params_default();
    CHECK_EQ(di_sample_params_check(&p, V), DI_OK);
    p.top_p = 0;
    CHECK_EQ(di_sample_params_check(&p, V), DI_ERR_INVALID);
    p = di_sample_params_default();
    p.temperature = -1;
    CHECK_EQ(di_sample_params_check(&p, V), DI_ERR_INVALID);
    p = di_sample_params_default();
    p.n_logprobs = DI_MAX_LOGPROBS + 1;
    CHECK_EQ(di_sample_params_check(&p, V), DI_ERR_INVALID);
    p = di_sample_params_default();
    di_logit_bias b = {V, 1};
    p.logit_bias = &b;
    p.n_logit_bias = 1;
    CHECK_EQ(di_sample_params_check(&p, V), DI_ERR_INVALID);
}

// A grammar's mask: only allowed tokens are drawn (greedy, sampled, with top-k applied over the
// allowed ones only), and logprobs are those of the masked distribution.
static void test_allowed_mask(void) {
    float l[V] = {5, 1, 4, 0, 3, -1, 2, 6};
    const uint64_t allow = (1u << 1) | (1u << 3) | (1u << 5); // ids 1, 3, 5
    di_sample_params p = di_sample_params_default();
    p.logprobs = true;
    p.n_logprobs = 3;
    di_sample_result r;
    di_sampler_sample_allowed(g_s, l, &allow, &p, NULL, 0, 0, 0, &r);
    CHECK_EQ(r.token, 1); // the best allowed, not the best overall (7)
    const double z = exp(1.0) + exp(0.0) + exp(-1.0);
    CHECK_NEAR(r.logprob, 1.0 - log(z), 1e-5);
    CHECK_EQ(r.top_ids[0], 1);
    CHECK_EQ(r.top_ids[1], 3);
    CHECK_EQ(r.top_ids[2], 5);
    p.temperature = 1.5f;
    p.top_k = 2; // over the allowed tokens: 1 and 3
    int seen[V] = {0};
    for (int64_t pos = 0; pos < 400; pos++) {
        di_sampler_sample_allowed(g_s, l, &allow, &p, NULL, 0, 0, pos, &r);
        CHECK(r.token >= 0 && r.token < V);
        if (r.token >= 0 && r.token < V) seen[r.token]++;
    }
    CHECK(seen[1] > 0 && seen[3] > 0);
    CHECK_EQ(seen[0] + seen[2] + seen[4] + seen[5] + seen[6] + seen[7], 0);
}

int main(void) {
    if (di_sampler_create(V, &g_s) != DI_OK) return 1;
    RUN(test_allowed_mask);
    RUN(test_greedy_and_ties);
    RUN(test_uniform_counter);
    RUN(test_distribution_and_order_independence);
    RUN(test_truncation);
    RUN(test_penalties_and_bias);
    RUN(test_logprobs);
    RUN(test_logprob_precision);
    RUN(test_params_check);
    di_sampler_destroy(g_s);
    return test_finish();
}
