// sampler: greedy, temperature, top-k / top-p / min-p, penalties, logit bias, logprobs, and the
// counter-based randomness (same (seed, position) -> same token, whatever the call order); a
// grammar's allowed-token mask; the randomized equivalence with the oracle (sampler_ref.c: the
// implementation before the selection rework) bit for bit, and NaN rows' safety.
#include "harness.h"

#include <float.h>
#include <math.h>

#include "sample/sampler.h"
#include "sampler_ref.h"

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
    p.n_logprobs = V + 1; // more than the vocabulary holds (the sampler would read past the row)
    CHECK(V + 1 <= DI_MAX_LOGPROBS);
    CHECK_EQ(di_sample_params_check(&p, V), DI_ERR_INVALID);
    p.n_logprobs = V;
    CHECK_EQ(di_sample_params_check(&p, V), DI_OK);
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

// ---- equivalence with the oracle ----

static uint64_t g_rng = 0x243f6a8885a308d3ull;

static uint64_t rnd(void) {
    uint64_t z = (g_rng += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

static int32_t rnd_below(int32_t n) {
    return (int32_t)(rnd() % (uint64_t)n);
}
static double rnd01(void) {
    return (double)(rnd() >> 11) * (1.0 / 9007199254740992.0);
}
static double gauss(void) {
    double u = rnd01() + 1e-300, v = rnd01();
    return sqrt(-2 * log(u)) * cos(6.283185307179586 * v);
}

typedef enum row_shape {
    SHAPE_FLAT,   // N(0, 3)
    SHAPE_PEAKED, // N(0, 3) plus 20 tokens at 25, 24.26, ..., 11
    SHAPE_TIES,   // a handful of values (-0 and +0 among them), most entries equal to others
    SHAPE_NEGINF, // N(0, 3) with -inf entries (sometimes all but a few)
    SHAPE_HUGE,   // magnitudes up to FLT_MAX, and +inf entries
    SHAPE_TINY,   // magnitudes near 1e-30 and subnormals, +-0
    SHAPE_CONST,  // one value everywhere
    SHAPE_QUANT,  // N(0, 3) rounded to 1/8: long runs of ties inside the distribution
    SHAPE_COUNT
} row_shape;

static const char *const k_shape_names[SHAPE_COUNT] = {"flat", "peaked", "ties",  "neginf",
                                                       "huge", "tiny",   "const", "quant"};

static void make_row(float *l, int32_t nv, row_shape shape) {
    switch (shape) {
    case SHAPE_FLAT:
    case SHAPE_PEAKED:
    case SHAPE_NEGINF:
        for (int32_t i = 0; i < nv; i++) l[i] = (float)(3 * gauss());
        if (shape == SHAPE_PEAKED)
            for (int32_t j = 0; j < 20; j++) l[rnd_below(nv)] = 25.0f - (float)j * (14.0f / 19);
        if (shape == SHAPE_NEGINF) {
            double frac = rnd01() < 0.3 ? 0.999 : rnd01();
            for (int32_t i = 0; i < nv; i++)
                if (rnd01() < frac) l[i] = -INFINITY;
            l[rnd_below(nv)] = (float)gauss();
        }
        break;
    case SHAPE_TIES: {
        static const float vals[] = {-2, -1, -0.0f, 0.0f, 0.5f, 1, 3, 3, -INFINITY};
        int nvals = 2 + rnd_below(8);
        for (int32_t i = 0; i < nv; i++) l[i] = vals[rnd_below(nvals)];
        break;
    }
    case SHAPE_HUGE:
        for (int32_t i = 0; i < nv; i++) l[i] = (float)(gauss() * 1e37);
        for (int j = 0; j < 3; j++) l[rnd_below(nv)] = rnd01() < 0.5 ? FLT_MAX : -FLT_MAX;
        if (rnd01() < 0.3) l[rnd_below(nv)] = INFINITY;
        if (rnd01() < 0.3) l[rnd_below(nv)] = -INFINITY;
        break;
    case SHAPE_TINY:
        for (int32_t i = 0; i < nv; i++) {
            double g = gauss();
            l[i] = rnd01() < 0.3   ? (float)(g * 1e-42)
                   : rnd01() < 0.1 ? (g < 0 ? -0.0f : 0.0f)
                                   : (float)(g * 1e-30);
        }
        break;
    case SHAPE_CONST: {
        float c = rnd01() < 0.2 ? -INFINITY : (float)gauss();
        for (int32_t i = 0; i < nv; i++) l[i] = c;
        if (c == -INFINITY) l[rnd_below(nv)] = 0; // a row with no finite entry is not sampled
        break;
    }
    case SHAPE_QUANT:
        for (int32_t i = 0; i < nv; i++) l[i] = roundf((float)(3 * gauss()) * 8) / 8;
        break;
    case SHAPE_COUNT:
        break;
    }
}

static void make_params(di_sample_params *p, di_logit_bias *bias, int32_t nv) {
    static const float temps[] = {0, 0.3f, 0.7f, 1, 2};
    static const float top_ps[] = {1, 1, 0.95f, 0.5f, 1e-6f, 0.999f};
    static const float rep[] = {1, 1, 1.1f, 0.9f};
    static const float pen[] = {0, 0, 0.5f, -0.5f, 0.25f};
    static const float bias_vals[] = {1, -1, 100, -100, 1e9f, INFINITY, -INFINITY, 0.01f};
    const int32_t top_ks[] = {0, 0, 1, 5, 50, 1000, nv, nv + 7, 2, 64, 1024};
    *p = di_sample_params_default();
    p->temperature = temps[rnd_below(5)];
    p->top_k = top_ks[rnd_below(11)];
    p->top_p = top_ps[rnd_below(6)];
    p->min_p = rnd01() < 0.3 ? (rnd01() < 0.5 ? 0.05f : 0.5f) : 0;
    p->repetition_penalty = rep[rnd_below(4)];
    p->presence_penalty = pen[rnd_below(5)];
    p->frequency_penalty = pen[rnd_below(5)];
    p->n_logit_bias = rnd01() < 0.3 ? 1 + rnd_below(5) : 0;
    for (int32_t i = 0; i < p->n_logit_bias; i++)
        bias[i] = (di_logit_bias){rnd_below(nv), bias_vals[rnd_below(8)]};
    p->logit_bias = p->n_logit_bias ? bias : NULL;
    p->seed = rnd();
    p->logprobs = rnd01() < 0.5;
    p->n_logprobs = rnd01() < 0.5 ? rnd_below(DI_MAX_LOGPROBS + 1) : 0;
    if (p->n_logprobs > nv) p->n_logprobs = nv;
}

// The two results agree bit for bit (the top lists up to n_top).
static bool same_result(const di_sample_result *a, const di_sample_result *b) {
    return a->token == b->token && memcmp(&a->logprob, &b->logprob, sizeof a->logprob) == 0 &&
           a->n_top == b->n_top &&
           memcmp(a->top_ids, b->top_ids, sizeof(int32_t) * (size_t)a->n_top) == 0 &&
           memcmp(a->top_logprobs, b->top_logprobs, sizeof(float) * (size_t)a->n_top) == 0;
}

static void report(const char *what, row_shape shape, int32_t nv, const di_sample_params *p,
                   const di_sample_result *a, const di_sample_result *b) {
    fprintf(stderr,
            "%s differs: shape %s V %d t %g top_k %d top_p %g min_p %g rep %g pres %g freq %g "
            "bias %d lp %d n_lp %d: token %d vs %d, logprob %.9g vs %.9g\n",
            what, k_shape_names[shape], nv, p->temperature, p->top_k, p->top_p, p->min_p,
            p->repetition_penalty, p->presence_penalty, p->frequency_penalty, p->n_logit_bias,
            p->logprobs, p->n_logprobs, a->token, b->token, a->logprob, b->logprob);
}

// Whether the logit bias turns a logit into NaN (an infinite bias on an infinite logit of the
// other sign, or two opposite infinite biases): a NaN row then, outside the equivalence (bias is
// the only processing that can: the penalties add finite amounts and scale by finite factors).
// allow: the mask (masked logits are -inf), or NULL.
static int g_nan_rows; // rows the bias made NaN rows (compared for nothing)

static bool bias_makes_nan(const float *l, const uint64_t *allow, const di_sample_params *p) {
    for (int32_t i = 0; i < p->n_logit_bias; i++) {
        const int32_t t = p->logit_bias[i].token;
        float w = !allow || ((allow[t / 64] >> (t % 64)) & 1) ? l[t] : -INFINITY;
        for (int32_t j = 0; j < p->n_logit_bias; j++)
            if (p->logit_bias[j].token == t) w += p->logit_bias[j].bias;
        if (isnan(w)) return g_nan_rows++, true;
    }
    return false;
}

// One row under both samplers, plain and under a random allowed-token mask; false on a difference.
static bool compare_row(di_sampler *s, ref_sampler *r, const float *l, uint64_t *allow,
                        int32_t *hist, int32_t nv, row_shape shape, const di_sample_params *p) {
    int32_t n_prompt = rnd01() < 0.5 ? rnd_below(40) : 0, n_gen = rnd_below(40);
    int32_t span = rnd01() < 0.5 ? (nv < 30 ? nv : 30) : nv; // repeated tokens, or spread
    for (int32_t i = 0; i < n_prompt + n_gen; i++) hist[i] = rnd_below(span);
    int64_t pos = n_prompt + n_gen + rnd_below(1000);
    di_sample_result a, b;
    memset(&a, 0xa5, sizeof a), memset(&b, 0x5a, sizeof b);
    di_sampler_sample(s, l, p, hist, n_prompt, n_gen, pos, &a);
    ref_sampler_sample(r, l, p, hist, n_prompt, n_gen, pos, &b);
    bool ok = bias_makes_nan(l, NULL, p) || same_result(&a, &b);
    if (!ok) report("sample", shape, nv, p, &a, &b);
    // A mask: dense, sparse or in runs of whole words; at least one allowed token.
    const int32_t n_words = (nv + 63) / 64;
    double dens = rnd01();
    int kind = rnd_below(3);
    for (int32_t w = 0; w < n_words; w++) {
        if (kind == 0)
            allow[w] = rnd01() < dens ? ~0ull : 0;
        else {
            uint64_t bits = 0;
            for (int j = 0; j < 64; j++) bits |= (uint64_t)(rnd01() < dens * dens) << j;
            allow[w] = kind == 1 ? bits : rnd01() < 0.5 ? bits : ~bits;
        }
    }
    int32_t must = rnd_below(nv);
    allow[must / 64] |= 1ull << (must % 64);
    memset(&a, 0xa5, sizeof a), memset(&b, 0x5a, sizeof b);
    di_sampler_sample_allowed(s, l, allow, p, hist, n_prompt, n_gen, pos, &a);
    ref_sampler_sample_allowed(r, l, allow, p, hist, n_prompt, n_gen, pos, &b);
    if (!bias_makes_nan(l, allow, p) && !same_result(&a, &b))
        report("sample_allowed", shape, nv, p, &a, &b), ok = false;
    return ok;
}

// Thousands of rows of every shape, small vocabularies and V4's, under random parameter sets:
// token, logprob, top ids and top logprobs equal to the oracle's bit for bit.
static void test_oracle_equivalence(void) {
    enum { V_BIG = 129280 };
    static const int32_t sizes[] = {1,   2,   3,    7,    20,   63,    64,   65,
                                    100, 257, 1000, 1031, 4099, 20000, 40000};
    float *l = malloc(sizeof(float) * V_BIG);
    uint64_t *allow = malloc(sizeof(uint64_t) * (V_BIG / 64 + 1));
    int32_t hist[80];
    di_logit_bias bias[5];
    int n_rows = 0, n_bad = 0;
    for (size_t si = 0; si < sizeof sizes / sizeof sizes[0] + 1; si++) {
        const int32_t nv = si < sizeof sizes / sizeof sizes[0] ? sizes[si] : V_BIG;
        const int reps = nv == V_BIG ? 48 : nv >= 40000 ? 96 : nv >= 4099 ? 160 : 480;
        di_sampler *s = NULL;
        ref_sampler *r = NULL;
        CHECK_EQ(di_sampler_create(nv, &s), DI_OK);
        CHECK_EQ(ref_sampler_create(nv, &r), DI_OK);
        if (!s || !r) break;
        for (int rep = 0; rep < reps; rep++) {
            row_shape shape = (row_shape)(rep % SHAPE_COUNT);
            make_row(l, nv, shape);
            for (int j = 0; j < (nv == V_BIG ? 2 : 3); j++) { // several parameter sets per row
                di_sample_params p;
                make_params(&p, bias, nv);
                if (nv == V_BIG && (p.top_k >= nv || (p.top_k == 0 && p.top_p == 1)) &&
                    rep % 6 != 0)
                    p.top_k = 50; // the oracle's full heap sorts are slow: a few of them only
                n_bad += !compare_row(s, r, l, allow, hist, nv, shape, &p);
                n_rows++;
            }
        }
        di_sampler_destroy(s);
        ref_sampler_destroy(r);
    }
    fprintf(stderr,
            "  %d rows compared (twice: plain and masked), %d differ, %d NaN rows skipped\n",
            n_rows, n_bad, g_nan_rows);
    CHECK_EQ(n_bad, 0);
    free(l);
    free(allow);
}

// The vector exps of the draws equal the scalar exp bit for bit: exponents <= 0 over the whole
// range (near -708, at the reduction's boundaries k ln2 / 2, huge and tiny scales, -inf, NaN, a
// +inf maximum), an odd count for the scalar tails.
static void test_exp_exact(void) {
    enum { N = 40001 };
    float *x = malloc(sizeof(float) * N);
    static const double scales[] = {1, 1 / 0.3, 1 / 0.7, 0.5, 1e-3, 1e3, 1e-30, 1e30};
    int64_t bad = 0;
    for (size_t si = 0; si < sizeof scales / sizeof scales[0]; si++) {
        for (int32_t i = 0; i < N; i++) {
            double g = gauss();
            switch (i % 5) {
            case 0:
                x[i] = (float)(3 * g);
                break;
            case 1:
                x[i] = (float)(-(rnd01() * 800) / scales[si]);
                break;
            case 2:
                x[i] = (float)((-(double)rnd_below(2100) * 0.34657359027997264) / scales[si]);
                break;
            case 3:
                x[i] = (float)((-708 + 1e-3 * g) / scales[si]);
                break;
            default:
                x[i] = (float)(g * 1e-3);
            }
        }
        for (int32_t i = 0; i < N; i++) x[i] = -fabsf(x[i]); // exponents <= 0: m is the maximum
        x[7] = -INFINITY, x[11] = NAN, x[17] = 0;
        bad += di_sampler_exp_mismatches(x, N, 0, scales[si]);
        bad += di_sampler_exp_mismatches(x, N, 2.5, scales[si]);
        bad += di_sampler_exp_mismatches(x + 1, 5, 0, scales[si]);
        x[13] = INFINITY; // a row whose maximum is +inf: NaN and -inf exponents
        bad += di_sampler_exp_mismatches(x, N, INFINITY, scales[si]);
    }
    CHECK_EQ(bad, 0);
    free(x);
}

// Rows with NaNs (anywhere, at 0, everywhere): any parameters give a token in [0, V) (under the
// sanitizers: without reading out of bounds). The order among NaNs is sampler.h's rule.
static void test_nan_rows(void) {
    static const int32_t sizes[] = {1, 5, 64, 1000, 129280};
    float *l = malloc(sizeof(float) * 129280);
    uint64_t *allow = malloc(sizeof(uint64_t) * (129280 / 64 + 1));
    int32_t hist[80];
    di_logit_bias bias[5];
    int bad = 0;
    for (size_t si = 0; si < sizeof sizes / sizeof sizes[0]; si++) {
        const int32_t nv = sizes[si];
        di_sampler *s = NULL;
        CHECK_EQ(di_sampler_create(nv, &s), DI_OK);
        if (!s) break;
        for (int rep = 0; rep < (nv > 10000 ? 40 : 200); rep++) {
            make_row(l, nv, (row_shape)(rep % SHAPE_COUNT));
            int kind = rep % 4;
            for (int32_t i = 0; i < nv; i++)
                if (kind == 3 || rnd01() < (kind == 0 ? 0.01 : 0.5)) l[i] = NAN;
            if (kind == 1) l[0] = NAN;
            if (kind == 2) l[rnd_below(nv)] = -NAN;
            di_sample_params p;
            make_params(&p, bias, nv);
            for (int32_t i = 0; i < 10; i++) hist[i] = rnd_below(nv);
            di_sample_result res;
            di_sampler_sample(s, l, &p, hist, 4, 6, 10 + rep, &res);
            bad += !(res.token >= 0 && res.token < nv);
            for (int32_t i = 0; i < res.n_top; i++)
                bad += !(res.top_ids[i] >= 0 && res.top_ids[i] < nv);
            for (int32_t w = 0; w < (nv + 63) / 64; w++) allow[w] = rnd();
            allow[0] |= 1;
            di_sampler_sample_allowed(s, l, allow, &p, hist, 4, 6, 10 + rep, &res);
            bad += !(res.token >= 0 && res.token < nv);
        }
        di_sampler_destroy(s);
    }
    CHECK_EQ(bad, 0);
    free(l);
    free(allow);
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
    RUN(test_oracle_equivalence);
    RUN(test_exp_exact);
    RUN(test_nan_rows);
    di_sampler_destroy(g_s);
    return test_finish();
}
