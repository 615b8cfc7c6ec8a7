// sampler_ref — the sampler as it was before the selection and exp rework (src/sample/sampler.c
// at e6bce8e), kept unchanged but for its names (ref_*) and the ISA switch (use_avx2 honours
// DI_CPU_ISA=scalar like the new one), as the oracle that test_sampler and bench_sampler compare
// the new sampler with bit for bit. Not part of the library.
#include "sampler_ref.h"

#include <float.h>
#include <math.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "base/mem.h"

struct ref_sampler {
    int32_t n_vocab;
    float *work;    // owned [V]: processed logits
    double *prob;   // owned [V]
    int32_t *cand;  // owned [V]: candidate ids (sorted prefix after truncation)
    uint32_t *mark; // owned [V]: stamp of the last call that counted the token
    int32_t *count; // owned [V]: occurrences in the output (valid where mark == stamp)
    uint32_t stamp;
    float *masked; // owned [V]: the logits under a grammar's mask
};

// ---- create ----

di_status ref_sampler_create(int32_t n_vocab, ref_sampler **out) {
    if (n_vocab < 1) return DI_ERR_INVALID;
    ref_sampler *s = di_calloc(1, sizeof *s);
    if (!s) return DI_ERR_NOMEM;
    size_t V = (size_t)n_vocab;
    s->n_vocab = n_vocab;
    s->work = di_malloc(sizeof(float) * V);
    s->prob = di_malloc(sizeof(double) * V);
    s->cand = di_malloc(sizeof(int32_t) * V);
    s->mark = di_calloc(V, sizeof(uint32_t));
    s->count = di_calloc(V, sizeof(int32_t));
    s->masked = di_malloc(sizeof(float) * V);
    if (!s->work || !s->prob || !s->cand || !s->mark || !s->count || !s->masked) {
        ref_sampler_destroy(s);
        return DI_ERR_NOMEM;
    }
    *out = s;
    return DI_OK;
}

void ref_sampler_destroy(ref_sampler *s) {
    if (!s) return;
    di_free(s->work);
    di_free(s->prob);
    di_free(s->cand);
    di_free(s->mark);
    di_free(s->count);
    di_free(s->masked);
    di_free(s);
}

// ---- counter-based randomness ----

static uint64_t mix64(uint64_t z) {
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

static double ref_uniform(uint64_t seed, int64_t pos) {
    // Two rounds of the splitmix64 finaliser over (seed, pos): a keyed counter generator.
    uint64_t z = mix64(seed + 0x9e3779b97f4a7c15ull);
    z = mix64(z ^ ((uint64_t)pos * 0xd1b54a32d192ed03ull + 0x9e3779b97f4a7c15ull));
    return (double)(z >> 11) * (1.0 / 9007199254740992.0);
}

// ---- selection helpers ----

// a ranks before b: higher value, then lower id.
static inline bool before(const float *v, int32_t a, int32_t b) {
    return v[a] > v[b] || (v[a] == v[b] && a < b);
}

// The first index of the largest value (NaNs never win; a NaN at 0 keeps 0).
static int32_t argmax_scalar(const float *v, int32_t n) {
    int32_t best = 0;
    for (int32_t i = 1; i < n; i++)
        if (v[i] > v[best]) best = i;
    return best;
}

static void sift_down(const float *v, int32_t *h, int32_t n, int32_t i) {
    for (;;) { // min-heap on "before": the root is the worst kept candidate
        int32_t l = 2 * i + 1, r = l + 1, m = i;
        if (l < n && before(v, h[m], h[l])) m = l;
        if (r < n && before(v, h[m], h[r])) m = r;
        if (m == i) return;
        int32_t t = h[m];
        h[m] = h[i], h[i] = t, i = m;
    }
}

// The k best ids of v[n] into out[0..k), best first. O(n log k).
static void top_k_ids(const float *v, int32_t n, int32_t k, int32_t *out) {
    for (int32_t i = 0; i < k; i++) out[i] = i;
    for (int32_t i = k / 2 - 1; i >= 0; i--) sift_down(v, out, k, i);
    for (int32_t i = k; i < n; i++) {
        if (before(v, i, out[0])) {
            out[0] = i;
            sift_down(v, out, k, 0);
        }
    }
    for (int32_t end = k - 1; end > 0; end--) { // heap sort: worst goes to the end
        int32_t t = out[0];
        out[0] = out[end], out[end] = t;
        sift_down(v, out, end, 0);
    }
}

// ---- sampling ----

// exp(d) for d <= 0 (every exponent here is a logit minus the maximum): Cody-Waite reduction
// d = k ln2 + r, |r| <= ln2/2, a degree-12 Taylor polynomial (relative error < 1e-15), then
// 2^k through the exponent bits. Inlined and branch-light so the vocabulary-wide sums run several
// times faster than libm's exp; deterministic. Below -708 (and NaN) gives 0.
static inline double exp_le0(double d) {
    if (!(d >= -708.0)) return 0.0;
    const double shift = 6755399441055744.0; // 1.5 * 2^52: adding it rounds to an integer
    double kd = (d * 1.4426950408889634 + shift) - shift;
    double r = (d - kd * 6.93147180369123816490e-01) - kd * 1.90821492927058770002e-10;
    double p = 1.0 / 479001600.0;
    p = p * r + 1.0 / 39916800.0;
    p = p * r + 1.0 / 3628800.0;
    p = p * r + 1.0 / 362880.0;
    p = p * r + 1.0 / 40320.0;
    p = p * r + 1.0 / 5040.0;
    p = p * r + 1.0 / 720.0;
    p = p * r + 1.0 / 120.0;
    p = p * r + 1.0 / 24.0;
    p = p * r + 1.0 / 6.0;
    p = p * r + 0.5;
    p = p * r + 1.0;
    p = p * r + 1.0;
    uint64_t bits = (uint64_t)((int64_t)kd + 1023) << 52;
    double two_k;
    memcpy(&two_k, &bits, sizeof two_k);
    return p * two_k;
}

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define DI_SUM_EXP_AVX2 1

// exp_le0 on 4 lanes with FMA (the same reduction and polynomial; FMA rounds once where the
// scalar form rounds twice, so the bits may differ from it in the last place).
__attribute__((target("avx2,fma"))) static inline __m256d exp4_le0(__m256d d) {
    const __m256d shift = _mm256_set1_pd(6755399441055744.0);
    __m256d ok = _mm256_cmp_pd(d, _mm256_set1_pd(-708.0), _CMP_GE_OQ); // false for NaN
    __m256d ks = _mm256_fmadd_pd(d, _mm256_set1_pd(1.4426950408889634), shift);
    __m256d kd = _mm256_sub_pd(ks, shift);
    __m256d r = _mm256_fnmadd_pd(kd, _mm256_set1_pd(6.93147180369123816490e-01), d);
    r = _mm256_fnmadd_pd(kd, _mm256_set1_pd(1.90821492927058770002e-10), r);
    __m256d p = _mm256_set1_pd(1.0 / 479001600.0);
    p = _mm256_fmadd_pd(p, r, _mm256_set1_pd(1.0 / 39916800.0));
    p = _mm256_fmadd_pd(p, r, _mm256_set1_pd(1.0 / 3628800.0));
    p = _mm256_fmadd_pd(p, r, _mm256_set1_pd(1.0 / 362880.0));
    p = _mm256_fmadd_pd(p, r, _mm256_set1_pd(1.0 / 40320.0));
    p = _mm256_fmadd_pd(p, r, _mm256_set1_pd(1.0 / 5040.0));
    p = _mm256_fmadd_pd(p, r, _mm256_set1_pd(1.0 / 720.0));
    p = _mm256_fmadd_pd(p, r, _mm256_set1_pd(1.0 / 120.0));
    p = _mm256_fmadd_pd(p, r, _mm256_set1_pd(1.0 / 24.0));
    p = _mm256_fmadd_pd(p, r, _mm256_set1_pd(1.0 / 6.0));
    p = _mm256_fmadd_pd(p, r, _mm256_set1_pd(0.5));
    p = _mm256_fmadd_pd(p, r, _mm256_set1_pd(1.0));
    p = _mm256_fmadd_pd(p, r, _mm256_set1_pd(1.0));
    // k as an integer: ks's bits are shift's bits plus k.
    __m256i k = _mm256_sub_epi64(_mm256_castpd_si256(ks), _mm256_castpd_si256(shift));
    __m256i e = _mm256_slli_epi64(_mm256_add_epi64(k, _mm256_set1_epi64x(1023)), 52);
    return _mm256_and_pd(_mm256_mul_pd(p, _mm256_castsi256_pd(e)), ok);
}

// sum_exp's body on AVX2: eight lanes of partial sums, then a fixed reduction; the tail as
// the scalar form.
__attribute__((target("avx2,fma"))) static double sum_exp_avx2(const float *x, int32_t n, double m,
                                                               double scale) {
    const __m256d vm = _mm256_set1_pd(m), vs = _mm256_set1_pd(scale);
    __m256d a0 = _mm256_setzero_pd(), a1 = _mm256_setzero_pd();
    int32_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256d d0 = _mm256_mul_pd(_mm256_sub_pd(_mm256_cvtps_pd(_mm_loadu_ps(x + i)), vm), vs);
        __m256d d1 = _mm256_mul_pd(_mm256_sub_pd(_mm256_cvtps_pd(_mm_loadu_ps(x + i + 4)), vm), vs);
        a0 = _mm256_add_pd(a0, exp4_le0(d0));
        a1 = _mm256_add_pd(a1, exp4_le0(d1));
    }
    double l[8];
    _mm256_storeu_pd(l, a0);
    _mm256_storeu_pd(l + 4, a1);
    for (; i < n; i++) l[0] += exp_le0(((double)x[i] - m) * scale);
    return ((l[0] + l[4]) + (l[1] + l[5])) + ((l[2] + l[6]) + (l[3] + l[7]));
}
#endif

#ifdef DI_SUM_EXP_AVX2
// argmax_scalar's answer in two vector passes: the largest non-NaN value M (max_ps returns its
// second operand when the first is NaN), then the first index holding M; the first index of the
// maximum is what the scalar scan keeps (-0 and +0 compare equal in both).
__attribute__((target("avx2"))) static int32_t argmax_avx2(const float *v, int32_t n) {
    if (n < 16 || v[0] != v[0]) return argmax_scalar(v, n);
    __m256 m0 = _mm256_set1_ps(-INFINITY), m1 = m0;
    int32_t i = 0;
    for (; i + 16 <= n; i += 16) {
        m0 = _mm256_max_ps(_mm256_loadu_ps(v + i), m0);
        m1 = _mm256_max_ps(_mm256_loadu_ps(v + i + 8), m1);
    }
    float l[8];
    _mm256_storeu_ps(l, _mm256_max_ps(m0, m1));
    float mx = l[0];
    for (int k = 1; k < 8; k++) mx = l[k] > mx ? l[k] : mx;
    for (; i < n; i++) mx = v[i] > mx ? v[i] : mx;
    const __m256 vm = _mm256_set1_ps(mx);
    for (i = 0; i + 8 <= n; i += 8) {
        int bits = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(v + i), vm, _CMP_EQ_OQ));
        if (bits) return i + __builtin_ctz((unsigned)bits);
    }
    for (; i < n; i++)
        if (v[i] == mx) return i;
    return 0; // not reached: mx is one of the values
}
#endif

// Whether the AVX2 forms are used (decided once per process, so a machine always gives the
// same bits).
static bool use_avx2(void) {
#ifdef DI_SUM_EXP_AVX2
    static atomic_int have = -1; // every thread that sets it sets the same value
    int h = atomic_load_explicit(&have, memory_order_relaxed);
    if (h < 0) {
        // DI_CPU_ISA=scalar (the CPU backend's debug switch, backend/cpu/gemm.h) takes the
        // scalar forms on an AVX2 machine too, for the tests of both; read once per process.
        const char *isa = getenv("DI_CPU_ISA");
        h = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
            !(isa && strcmp(isa, "scalar") == 0);
        atomic_store_explicit(&have, h, memory_order_relaxed);
    }
    return h != 0;
#else
    return false;
#endif
}

static int32_t ref_argmax(const float *v, int32_t n) {
#ifdef DI_SUM_EXP_AVX2
    if (use_avx2()) return argmax_avx2(v, n);
#endif
    return argmax_scalar(v, n);
}

// Sum over i of exp((x[i] - m) * scale), x[i] <= m: the AVX2 form where the CPU has it (chosen
// once per process, so a machine always gives the same bits), else four scalar partial sums.
static double sum_exp(const float *x, int32_t n, double m, double scale) {
#ifdef DI_SUM_EXP_AVX2
    if (use_avx2()) return sum_exp_avx2(x, n, m, scale);
#endif
    double s0 = 0, s1 = 0, s2 = 0, s3 = 0;
    int32_t i = 0;
    for (; i + 4 <= n; i += 4) {
        s0 += exp_le0(((double)x[i] - m) * scale);
        s1 += exp_le0(((double)x[i + 1] - m) * scale);
        s2 += exp_le0(((double)x[i + 2] - m) * scale);
        s3 += exp_le0(((double)x[i + 3] - m) * scale);
    }
    for (; i < n; i++) s0 += exp_le0(((double)x[i] - m) * scale);
    return (s0 + s1) + (s2 + s3);
}

void ref_sampler_sample(ref_sampler *s, const float *logits, const di_sample_params *p,
                        const int32_t *history, int32_t n_prompt, int32_t n_gen, int64_t pos,
                        di_sample_result *res) {
    const int32_t V = s->n_vocab;
    float *w = s->work;

    // Log-probabilities of the raw logits (reported, whatever the processing), when asked for.
    const int32_t i_max = ref_argmax(logits, V);
    const bool want_lp = p->logprobs || p->n_logprobs > 0;
    const double lse = want_lp ? logits[i_max] + log(sum_exp(logits, V, logits[i_max], 1.0)) : 0;
    res->n_top = p->n_logprobs;
    if (p->n_logprobs > 0) {
        top_k_ids(logits, V, p->n_logprobs, res->top_ids);
        for (int32_t i = 0; i < p->n_logprobs; i++)
            res->top_logprobs[i] = (float)(logits[res->top_ids[i]] - lse);
    }

    // Plain greedy (no bias, no penalty): the raw argmax, which the processing below would
    // find again on an unchanged copy.
    if (p->temperature == 0 && p->n_logit_bias == 0 && p->presence_penalty == 0 &&
        p->frequency_penalty == 0 && p->repetition_penalty == 1) {
        res->token = i_max;
        res->logprob = want_lp ? (float)(logits[i_max] - lse) : 0;
        return;
    }

    // Processing: bias, then penalties.
    memcpy(w, logits, sizeof(float) * (size_t)V);
    for (int32_t i = 0; i < p->n_logit_bias; i++)
        w[p->logit_bias[i].token] += p->logit_bias[i].bias;
    if (++s->stamp == 0) { // wrapped: clear the stamps
        memset(s->mark, 0, sizeof(uint32_t) * (size_t)V);
        s->stamp = 1;
    }
    const uint32_t st = s->stamp;
    const int32_t n_hist = n_prompt + n_gen;
    if (p->presence_penalty != 0 || p->frequency_penalty != 0) {
        for (int32_t i = n_prompt; i < n_hist; i++) {
            int32_t t = history[i];
            if (s->mark[t] != st) s->mark[t] = st, s->count[t] = 0;
            s->count[t]++;
        }
        for (int32_t i = n_prompt; i < n_hist; i++) {
            int32_t t = history[i];
            if (s->count[t] > 0) {
                w[t] -= p->presence_penalty + p->frequency_penalty * (float)s->count[t];
                s->count[t] = 0; // once per distinct token
            }
        }
        if (++s->stamp == 0) memset(s->mark, 0, sizeof(uint32_t) * (size_t)V), s->stamp = 1;
    }
    if (p->repetition_penalty != 1) {
        const uint32_t st2 = s->stamp;
        for (int32_t i = 0; i < n_hist; i++) {
            int32_t t = history[i];
            if (s->mark[t] == st2) continue;
            s->mark[t] = st2;
            w[t] = w[t] > 0 ? w[t] / p->repetition_penalty : w[t] * p->repetition_penalty;
        }
    }

    int32_t tok;
    if (p->temperature == 0) {
        tok = ref_argmax(w, V);
    } else {
        // Candidates, best first: top-k (or everything), then top-p / min-p on the tempered
        // softmax. Truncation works on a sorted prefix; without any, the draw runs over ids in
        // ascending order.
        const bool truncate = p->top_k > 0 || p->top_p < 1 || p->min_p > 0;
        int32_t n = V;
        int32_t *c = s->cand;
        double *pr = s->prob;
        const double inv_t = 1.0 / p->temperature;
        if (!truncate) {
            for (int32_t i = 0; i < V; i++) c[i] = i;
        } else {
            int32_t k = p->top_k > 0 && p->top_k < V ? p->top_k : V;
            if (p->top_k == 0 && p->top_p < 1) {
                // Nucleus without top-k: sort only as much as needed — grow a sorted prefix
                // until it holds top_p of the mass (the set is the same as with a full sort).
                double m0 = w[ref_argmax(w, V)], z = sum_exp(w, V, m0, inv_t);
                for (k = 64 < V ? 64 : V;; k = k * 4 < V ? k * 4 : V) {
                    top_k_ids(w, V, k, c);
                    double acc = 0;
                    for (int32_t i = 0; i < k; i++) acc += exp_le0(((double)w[c[i]] - m0) * inv_t);
                    if (acc / z >= p->top_p || k == V) break;
                }
            } else {
                top_k_ids(w, V, k, c);
            }
            n = k;
        }
        double m0 = w[c[0]];
        if (!truncate) m0 = w[ref_argmax(w, V)];
        double z = 0;
        for (int32_t i = 0; i < n; i++) z += (pr[i] = exp_le0(((double)w[c[i]] - m0) * inv_t));
        if (truncate) {
            // top-p: the smallest best-first prefix reaching top_p of the (top-k) mass.
            if (p->top_p < 1) {
                double acc = 0;
                int32_t keep = n;
                for (int32_t i = 0; i < n; i++) {
                    acc += pr[i];
                    if (acc >= p->top_p * z) {
                        keep = i + 1;
                        break;
                    }
                }
                n = keep;
            }
            // min-p: relative to the best candidate (pr[0] is its unnormalised weight, 1).
            if (p->min_p > 0) {
                int32_t keep = 0;
                while (keep < n && pr[keep] >= p->min_p * pr[0]) keep++;
                n = keep > 0 ? keep : 1;
            }
            z = 0;
            for (int32_t i = 0; i < n; i++) z += pr[i];
        }
        double u = ref_uniform(p->seed, pos) * z, acc = 0;
        tok = c[n - 1];
        for (int32_t i = 0; i < n; i++) {
            acc += pr[i];
            if (u < acc) {
                tok = c[i];
                break;
            }
        }
    }
    res->token = tok;
    res->logprob = want_lp ? (float)(logits[tok] - lse) : 0;
}

void ref_sampler_sample_allowed(ref_sampler *s, const float *logits, const uint64_t *allow,
                                const di_sample_params *p, const int32_t *history, int32_t n_prompt,
                                int32_t n_gen, int64_t pos, di_sample_result *res) {
    const int32_t V = s->n_vocab;
    float *m = s->masked;
    for (int32_t i = 0; i < V; i++)
        m[i] = ((allow[i >> 6] >> (i & 63)) & 1) ? logits[i] : -INFINITY;
    ref_sampler_sample(s, m, p, history, n_prompt, n_gen, pos, res);
    // The draw's fallback (the last candidate, when rounding leaves the cumulative sum short of
    // the uniform) could land on a masked token: take the best allowed one instead.
    if (!((allow[res->token >> 6] >> (res->token & 63)) & 1)) {
        int32_t best = -1;
        for (int32_t i = 0; i < V; i++)
            if (m[i] != -INFINITY && (best < 0 || m[i] > m[best])) best = i;
        if (best >= 0) res->token = best, res->logprob = -INFINITY;
    }
}
