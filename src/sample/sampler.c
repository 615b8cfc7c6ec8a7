// sampler — logit processing and token choice for one request row (see sampler.h).
#include "sample/sampler.h"

#include <float.h>
#include <math.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "base/log.h"
#include "base/mem.h"

enum { SEL_HIST16 = 32768 }; // kth_key takes 16 bits at once from this many keys

struct di_sampler {
    int32_t n_vocab;
    float *work;    // owned [V]: processed logits
    double *prob;   // owned [V]: candidates' weights (prefix sums in the untruncated draw)
    int32_t *cand;  // owned [V]: candidate ids (sorted prefix after truncation)
    uint32_t *mark; // owned [V]: stamp of the last call that counted the token
    int32_t *count; // owned [V]: occurrences in the output (valid where mark == stamp)
    uint32_t stamp;
    float *masked; // owned [V]: the logits under a grammar's mask
    // Selection scratch (select_top): two buffers of 8 V bytes, each candidates' keys and ids
    // ([V] each) or the sort's packed (key, id) words ([V]); and the pre-filter's group maxima.
    uint64_t *sel_a;       // owned [V]
    uint64_t *sel_b;       // owned [V]
    uint32_t *sel_key;     // view: sel_a's first half
    int32_t *sel_id;       // view: sel_a's second half
    uint32_t *sel_key2;    // view: sel_b's first half
    int32_t *sel_id2;      // view: sel_b's second half
    uint32_t *gmax;        // owned [V / 8 + 1]
    int32_t gmax_bs;       // the block size gmax holds the maxima for
    uint32_t *hist16;      // owned [65536] where V >= SEL_HIST16, else NULL: kth_key's
    const float *gmax_row; // borrowed: the row gmax holds the block maxima of (NULL: none); reset
                           // by every call, so that a row rewritten between calls is never
                           // taken for the same
};

di_sample_params di_sample_params_default(void) {
    di_sample_params p = {
        .temperature = 0, .top_k = 0, .top_p = 1, .min_p = 0, .repetition_penalty = 1};
    return p;
}

// ---- create / check ----

di_status di_sampler_create(int32_t n_vocab, di_sampler **out) {
    if (n_vocab < 1) return DI_ERR_INVALID;
    di_sampler *s = di_calloc(1, sizeof *s);
    if (!s) return DI_ERR_NOMEM;
    size_t V = (size_t)n_vocab;
    s->n_vocab = n_vocab;
    s->work = di_malloc(sizeof(float) * V);
    s->prob = di_malloc(sizeof(double) * V);
    s->cand = di_malloc(sizeof(int32_t) * V);
    s->mark = di_calloc(V, sizeof(uint32_t));
    s->count = di_calloc(V, sizeof(int32_t));
    s->masked = di_malloc(sizeof(float) * V);
    s->sel_a = di_malloc(sizeof(uint64_t) * V);
    s->sel_b = di_malloc(sizeof(uint64_t) * V);
    if (n_vocab >= SEL_HIST16) {
        s->hist16 = di_malloc(sizeof(uint32_t) << 16);
        if (!s->hist16) {
            di_sampler_destroy(s);
            return DI_ERR_NOMEM;
        }
    }
    s->gmax = di_malloc(sizeof(uint32_t) * (V / 8 + 1));
    if (!s->work || !s->prob || !s->cand || !s->mark || !s->count || !s->masked || !s->sel_a ||
        !s->sel_b || !s->gmax) {
        di_sampler_destroy(s);
        return DI_ERR_NOMEM;
    }
    s->sel_key = (uint32_t *)s->sel_a, s->sel_id = (int32_t *)(s->sel_key + V);
    s->sel_key2 = (uint32_t *)s->sel_b, s->sel_id2 = (int32_t *)(s->sel_key2 + V);
    *out = s;
    return DI_OK;
}

void di_sampler_destroy(di_sampler *s) {
    if (!s) return;
    di_free(s->work);
    di_free(s->prob);
    di_free(s->cand);
    di_free(s->mark);
    di_free(s->count);
    di_free(s->masked);
    di_free(s->sel_a);
    di_free(s->sel_b);
    di_free(s->hist16);
    di_free(s->gmax);
    di_free(s);
}

di_status di_sample_params_check(const di_sample_params *p, int32_t n_vocab) {
    const char *why = NULL;
    if (!(p->temperature >= 0) || !isfinite(p->temperature))
        why = "temperature must be >= 0";
    else if (p->top_k < 0)
        why = "top_k must be >= 0";
    else if (!(p->top_p > 0 && p->top_p <= 1))
        why = "top_p must be in (0, 1]";
    else if (!(p->min_p >= 0 && p->min_p <= 1))
        why = "min_p must be in [0, 1]";
    else if (!(p->repetition_penalty > 0) || !isfinite(p->repetition_penalty))
        why = "repetition_penalty must be > 0";
    else if (!isfinite(p->presence_penalty) || !isfinite(p->frequency_penalty))
        why = "penalties must be finite";
    else if (p->n_logprobs < 0 || p->n_logprobs > DI_MAX_LOGPROBS)
        why = "n_logprobs must be in [0, 20]";
    else if (p->n_logprobs > n_vocab) // the top n_logprobs of the vocabulary (a tiny one)
        why = "n_logprobs must not exceed the vocabulary";
    else if (p->n_logit_bias < 0 || (p->n_logit_bias > 0 && !p->logit_bias))
        why = "logit_bias is missing";
    for (int32_t i = 0; !why && i < p->n_logit_bias; i++) {
        if (p->logit_bias[i].token < 0 || p->logit_bias[i].token >= n_vocab)
            why = "logit_bias names a token outside the vocabulary";
        else if (isnan(p->logit_bias[i].bias))
            why = "logit_bias value is NaN";
    }
    if (why) {
        DI_LOG_ERROR("sampling parameters: %s", why);
        return DI_ERR_INVALID;
    }
    return DI_OK;
}

// ---- counter-based randomness ----

static uint64_t mix64(uint64_t z) {
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

double di_sample_uniform(uint64_t seed, int64_t pos) {
    // Two rounds of the splitmix64 finaliser over (seed, pos): a keyed counter generator.
    uint64_t z = mix64(seed + 0x9e3779b97f4a7c15ull);
    z = mix64(z ^ ((uint64_t)pos * 0xd1b54a32d192ed03ull + 0x9e3779b97f4a7c15ull));
    return (double)(z >> 11) * (1.0 / 9007199254740992.0);
}

// ---- argmax ----

// The first index of the largest value (NaNs never win; a NaN at 0 keeps 0).
static int32_t argmax_scalar(const float *v, int32_t n) {
    int32_t best = 0;
    for (int32_t i = 1; i < n; i++)
        if (v[i] > v[best]) best = i;
    return best;
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

// The vector level: 0 scalar, 1 AVX2 (with FMA), 2 AVX-512F as well (decided once per process,
// so a machine always gives the same bits; the AVX-512 forms give the AVX2 forms' bits anyway,
// lane for lane). DI_CPU_ISA=scalar or =avx2 (the CPU backend's debug switch, backend/cpu/gemm.h)
// lowers it, for the tests of every level on one machine; read once per process.
static int isa_level(void) {
#ifdef DI_SUM_EXP_AVX2
    static atomic_int have = -1; // every thread that sets it sets the same value
    int h = atomic_load_explicit(&have, memory_order_relaxed);
    if (h < 0) {
        const char *isa = getenv("DI_CPU_ISA");
        h = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") ? 1 : 0;
        if (h && __builtin_cpu_supports("avx512f")) h = 2;
        if (isa && strcmp(isa, "scalar") == 0) h = 0;
        if (isa && strcmp(isa, "avx2") == 0 && h > 1) h = 1;
        atomic_store_explicit(&have, h, memory_order_relaxed);
    }
    return h;
#else
    return 0;
#endif
}

// Whether the AVX2 forms are used.
static bool use_avx2(void) {
    return isa_level() >= 1;
}

#ifdef DI_SUM_EXP_AVX2
// exp_le0 on 8 lanes, as exp4_le0 (FMA) or as exp4_le0_exact (no FMA) on two 4-lane halves. The
// same operations lane by lane, so the same bits; half the instructions of the AVX2 forms, which
// is what bounds the exp passes (about 1.5x faster on Zen 4, whose AVX-512 units are 256 bits
// wide).
#define DI_EXP8_BODY(MULADD, MULSUB_FROM)                                                          \
    const __m512d shift = _mm512_set1_pd(6755399441055744.0);                                      \
    __mmask8 ok = _mm512_cmp_pd_mask(d, _mm512_set1_pd(-708.0), _CMP_GE_OQ);                       \
    __m512d ks = MULADD(d, _mm512_set1_pd(1.4426950408889634), shift);                             \
    __m512d kd = _mm512_sub_pd(ks, shift);                                                         \
    __m512d r = MULSUB_FROM(kd, _mm512_set1_pd(6.93147180369123816490e-01), d);                    \
    r = MULSUB_FROM(kd, _mm512_set1_pd(1.90821492927058770002e-10), r);                            \
    __m512d p = _mm512_set1_pd(1.0 / 479001600.0);                                                 \
    p = MULADD(p, r, _mm512_set1_pd(1.0 / 39916800.0));                                            \
    p = MULADD(p, r, _mm512_set1_pd(1.0 / 3628800.0));                                             \
    p = MULADD(p, r, _mm512_set1_pd(1.0 / 362880.0));                                              \
    p = MULADD(p, r, _mm512_set1_pd(1.0 / 40320.0));                                               \
    p = MULADD(p, r, _mm512_set1_pd(1.0 / 5040.0));                                                \
    p = MULADD(p, r, _mm512_set1_pd(1.0 / 720.0));                                                 \
    p = MULADD(p, r, _mm512_set1_pd(1.0 / 120.0));                                                 \
    p = MULADD(p, r, _mm512_set1_pd(1.0 / 24.0));                                                  \
    p = MULADD(p, r, _mm512_set1_pd(1.0 / 6.0));                                                   \
    p = MULADD(p, r, _mm512_set1_pd(0.5));                                                         \
    p = MULADD(p, r, _mm512_set1_pd(1.0));                                                         \
    p = MULADD(p, r, _mm512_set1_pd(1.0));                                                         \
    __m512i k = _mm512_sub_epi64(_mm512_castpd_si512(ks), _mm512_castpd_si512(shift));             \
    __m512i e = _mm512_slli_epi64(_mm512_add_epi64(k, _mm512_set1_epi64(1023)), 52);               \
    return _mm512_maskz_mov_pd(ok, _mm512_mul_pd(p, _mm512_castsi512_pd(e)))

#define DI_MULADD_SEP(a, b, c) _mm512_add_pd(_mm512_mul_pd(a, b), c)
#define DI_MULSUB_SEP(a, b, c) _mm512_sub_pd(c, _mm512_mul_pd(a, b))

__attribute__((target("avx512f"))) static inline __m512d exp8_le0(__m512d d) {
    DI_EXP8_BODY(_mm512_fmadd_pd, _mm512_fnmadd_pd);
}

__attribute__((target("avx512f"))) static inline __m512d exp8_le0_exact(__m512d d) {
    DI_EXP8_BODY(DI_MULADD_SEP, DI_MULSUB_SEP);
}

// sum_exp_avx2 on 8 lanes: lanes 0-3 are its a0, lanes 4-7 its a1, each fed the same terms in the
// same order; the same tail and the same final reduction.
__attribute__((target("avx512f"))) static double sum_exp_avx512(const float *x, int32_t n, double m,
                                                                double scale) {
    const __m512d vm = _mm512_set1_pd(m), vs = _mm512_set1_pd(scale);
    __m512d a = _mm512_setzero_pd();
    int32_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m512d d = _mm512_mul_pd(_mm512_sub_pd(_mm512_cvtps_pd(_mm256_loadu_ps(x + i)), vm), vs);
        a = _mm512_add_pd(a, exp8_le0(d));
    }
    double l[8];
    _mm512_storeu_pd(l, a);
    for (; i < n; i++) l[0] += exp_le0(((double)x[i] - m) * scale);
    return ((l[0] + l[4]) + (l[1] + l[5])) + ((l[2] + l[6]) + (l[3] + l[7]));
}
#endif

int32_t di_argmax(const float *v, int32_t n) {
#ifdef DI_SUM_EXP_AVX2
    if (use_avx2()) return argmax_avx2(v, n);
#endif
    return argmax_scalar(v, n);
}

// Sum over i of exp((x[i] - m) * scale), x[i] <= m: the AVX2 form where the CPU has it (chosen
// once per process, so a machine always gives the same bits), else four scalar partial sums.
static double sum_exp(const float *x, int32_t n, double m, double scale) {
#ifdef DI_SUM_EXP_AVX2
    if (isa_level() >= 2) return sum_exp_avx512(x, n, m, scale);
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

// ---- exp over candidates, bit for bit exp_le0 ----

#ifdef DI_SUM_EXP_AVX2
// exp_le0 on 4 lanes without FMA: the scalar form's operations one by one (each mul and add
// rounded on its own, as the scalar code is compiled: baseline x86-64 has no FMA and ISO C mode
// does not contract), so every lane's bits are exp_le0's. target("avx2") without "fma": the
// compiler cannot fuse them either.
__attribute__((target("avx2"))) static inline __m256d exp4_le0_exact(__m256d d) {
    const __m256d shift = _mm256_set1_pd(6755399441055744.0);
    __m256d ok = _mm256_cmp_pd(d, _mm256_set1_pd(-708.0), _CMP_GE_OQ); // false for NaN
    __m256d ks = _mm256_add_pd(_mm256_mul_pd(d, _mm256_set1_pd(1.4426950408889634)), shift);
    __m256d kd = _mm256_sub_pd(ks, shift);
    __m256d r = _mm256_sub_pd(d, _mm256_mul_pd(kd, _mm256_set1_pd(6.93147180369123816490e-01)));
    r = _mm256_sub_pd(r, _mm256_mul_pd(kd, _mm256_set1_pd(1.90821492927058770002e-10)));
    __m256d p = _mm256_set1_pd(1.0 / 479001600.0);
    p = _mm256_add_pd(_mm256_mul_pd(p, r), _mm256_set1_pd(1.0 / 39916800.0));
    p = _mm256_add_pd(_mm256_mul_pd(p, r), _mm256_set1_pd(1.0 / 3628800.0));
    p = _mm256_add_pd(_mm256_mul_pd(p, r), _mm256_set1_pd(1.0 / 362880.0));
    p = _mm256_add_pd(_mm256_mul_pd(p, r), _mm256_set1_pd(1.0 / 40320.0));
    p = _mm256_add_pd(_mm256_mul_pd(p, r), _mm256_set1_pd(1.0 / 5040.0));
    p = _mm256_add_pd(_mm256_mul_pd(p, r), _mm256_set1_pd(1.0 / 720.0));
    p = _mm256_add_pd(_mm256_mul_pd(p, r), _mm256_set1_pd(1.0 / 120.0));
    p = _mm256_add_pd(_mm256_mul_pd(p, r), _mm256_set1_pd(1.0 / 24.0));
    p = _mm256_add_pd(_mm256_mul_pd(p, r), _mm256_set1_pd(1.0 / 6.0));
    p = _mm256_add_pd(_mm256_mul_pd(p, r), _mm256_set1_pd(0.5));
    p = _mm256_add_pd(_mm256_mul_pd(p, r), _mm256_set1_pd(1.0));
    p = _mm256_add_pd(_mm256_mul_pd(p, r), _mm256_set1_pd(1.0));
    // (int64_t)kd, as the scalar form takes it: kd is an integer in [-1021, 0] wherever ok holds
    // (and the lane is 0 elsewhere), and ks's bits are shift's plus kd.
    __m256i k = _mm256_sub_epi64(_mm256_castpd_si256(ks), _mm256_castpd_si256(shift));
    __m256i e = _mm256_slli_epi64(_mm256_add_epi64(k, _mm256_set1_epi64x(1023)), 52);
    return _mm256_and_pd(_mm256_mul_pd(p, _mm256_castsi256_pd(e)), ok);
}

__attribute__((target("avx2"))) static void
exp_ids_avx2(const float *w, const int32_t *c, int32_t n, double m, double scale, double *pr) {
    const __m256d vm = _mm256_set1_pd(m), vs = _mm256_set1_pd(scale);
    int32_t i = 0;
    for (; i + 4 <= n; i += 4) {
        __m128 x = _mm_setr_ps(w[c[i]], w[c[i + 1]], w[c[i + 2]], w[c[i + 3]]);
        _mm256_storeu_pd(pr + i,
                         exp4_le0_exact(_mm256_mul_pd(_mm256_sub_pd(_mm256_cvtps_pd(x), vm), vs)));
    }
    for (; i < n; i++) pr[i] = exp_le0(((double)w[c[i]] - m) * scale);
}

// prefix_exp's body: eight exps at a time in vectors, then their sequential sum (the chain of
// dependent adds is the loop's critical path; the exps run beside it).
__attribute__((target("avx2"))) static double prefix_exp_avx2(const float *x, int32_t n, double m,
                                                              double scale, double *sums) {
    const __m256d vm = _mm256_set1_pd(m), vs = _mm256_set1_pd(scale);
    double acc = 0, e[8];
    int32_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256d d0 = _mm256_mul_pd(_mm256_sub_pd(_mm256_cvtps_pd(_mm_loadu_ps(x + i)), vm), vs);
        __m256d d1 = _mm256_mul_pd(_mm256_sub_pd(_mm256_cvtps_pd(_mm_loadu_ps(x + i + 4)), vm), vs);
        _mm256_storeu_pd(e, exp4_le0_exact(d0));
        _mm256_storeu_pd(e + 4, exp4_le0_exact(d1));
        for (int j = 0; j < 8; j++) sums[i + j] = (acc += e[j]);
    }
    for (; i < n; i++) sums[i] = (acc += exp_le0(((double)x[i] - m) * scale));
    return acc;
}

__attribute__((target("avx512f"))) static double
prefix_exp_avx512(const float *x, int32_t n, double m, double scale, double *sums) {
    const __m512d vm = _mm512_set1_pd(m), vs = _mm512_set1_pd(scale);
    double acc = 0, e[16];
    int32_t i = 0;
    for (; i + 16 <= n; i += 16) {
        __m512d d0 = _mm512_mul_pd(_mm512_sub_pd(_mm512_cvtps_pd(_mm256_loadu_ps(x + i)), vm), vs);
        __m512d d1 =
            _mm512_mul_pd(_mm512_sub_pd(_mm512_cvtps_pd(_mm256_loadu_ps(x + i + 8)), vm), vs);
        _mm512_storeu_pd(e, exp8_le0_exact(d0));
        _mm512_storeu_pd(e + 8, exp8_le0_exact(d1));
        for (int j = 0; j < 16; j++) sums[i + j] = (acc += e[j]);
    }
    for (; i < n; i++) sums[i] = (acc += exp_le0(((double)x[i] - m) * scale));
    return acc;
}
#endif

// pr[i] = exp_le0((w[c[i]] - m) * scale) for i < n.
static void exp_ids(const float *w, const int32_t *c, int32_t n, double m, double scale,
                    double *pr) {
#ifdef DI_SUM_EXP_AVX2
    if (use_avx2()) {
        exp_ids_avx2(w, c, n, m, scale, pr);
        return;
    }
#endif
    for (int32_t i = 0; i < n; i++) pr[i] = exp_le0(((double)w[c[i]] - m) * scale);
}

// sums[i] = the sequential (id order) double sum of exp_le0((x[j] - m) * scale) over j <= i;
// returns sums[n - 1] (0 when n == 0). Nondecreasing: every term is >= 0.
static double prefix_exp(const float *x, int32_t n, double m, double scale, double *sums) {
#ifdef DI_SUM_EXP_AVX2
    if (isa_level() >= 2) return prefix_exp_avx512(x, n, m, scale, sums);
    if (use_avx2()) return prefix_exp_avx2(x, n, m, scale, sums);
#endif
    double acc = 0;
    for (int32_t i = 0; i < n; i++) sums[i] = (acc += exp_le0(((double)x[i] - m) * scale));
    return acc;
}

// ---- selection ----
//
// The k best ids of a row in the order (value descending, then id ascending): the order the
// sampler has always used (a strict total order on NaN-free rows, so any exact selection gives
// the same ids in the same order). Values map to order-preserving keys: -0 counts as +0 (they
// compare equal), and NaN maps to 0, below -inf: NaNs rank after every number. The k-th best key
// comes from a radix select (11, 11 and 10 bits); where k is small next to the row, a pre-filter
// bounds it first: the k-th largest of the maxima of disjoint groups is at most the k-th
// largest value (k groups hold a value at least as large), so only values at or above it can be
// selected, usually a little more than k of them (groups: blocks of 32 consecutive ids, or of 8
// for larger k), and only in the blocks whose maximum reaches it. The
// selected ones are then sorted (LSD radix, stable over ids in ascending order).

enum {
    SEL_SMALL = 32,      // candidates sorted by insertion up to this many
    SEL_BLOCK = 32,      // the pre-filter's groups: blocks of 32 values where k <= n / 32,
    SEL_BLOCK_SMALL = 8, // else blocks of 8 where k <= n / 8 (more groups than k)
};

static inline uint32_t key_of(float x) {
    x += 0.0f; // -0 becomes +0
    uint32_t u;
    memcpy(&u, &x, sizeof u);
    if (x != x) return 0;
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

#ifdef DI_SUM_EXP_AVX2
__attribute__((target("avx2"))) static inline __m256i key8(const float *v) {
    __m256 x = _mm256_add_ps(_mm256_loadu_ps(v), _mm256_setzero_ps());
    __m256i u = _mm256_castps_si256(x);
    __m256i flip = _mm256_or_si256(_mm256_srai_epi32(u, 31), _mm256_set1_epi32(INT32_MIN));
    __m256i ord = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_ORD_Q));
    return _mm256_and_si256(_mm256_xor_si256(u, flip), ord);
}

__attribute__((target("avx2"))) static void keys_avx2(const float *v, int32_t n, uint32_t *key,
                                                      int32_t *id) {
    int32_t i = 0;
    const __m256i step = _mm256_set1_epi32(8);
    __m256i vi = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    for (; i + 8 <= n; i += 8) {
        _mm256_storeu_si256((__m256i *)(key + i), key8(v + i));
        _mm256_storeu_si256((__m256i *)(id + i), vi);
        vi = _mm256_add_epi32(vi, step);
    }
    for (; i < n; i++) key[i] = key_of(v[i]), id[i] = i;
}

// The maxima of the full blocks of bs (8 or 32) values: gmax[b] = the largest key of
// v[b * bs .. b * bs + bs).
__attribute__((target("avx2"))) static void group_max_avx2(const float *v, int32_t n_blocks,
                                                           int32_t bs, uint32_t *gmax) {
    for (int32_t b = 0; b < n_blocks; b++) {
        const float *x = v + (size_t)b * bs;
        __m256i m = key8(x);
        if (bs == 32)
            m = _mm256_max_epu32(_mm256_max_epu32(m, key8(x + 8)),
                                 _mm256_max_epu32(key8(x + 16), key8(x + 24)));
        __m128i h = _mm_max_epu32(_mm256_castsi256_si128(m), _mm256_extracti128_si256(m, 1));
        h = _mm_max_epu32(h, _mm_shuffle_epi32(h, 0x4e));
        h = _mm_max_epu32(h, _mm_shuffle_epi32(h, 0xb1));
        gmax[b] = (uint32_t)_mm_cvtsi128_si32(h);
    }
}

// The keys >= t of the full blocks, in id order, appended at key/id + m; returns the new count.
// Only the blocks whose maximum reaches t can hold one: about k of them.
__attribute__((target("avx2"))) static int32_t filter_avx2(const float *v, int32_t n_blocks,
                                                           int32_t bs, const uint32_t *gmax,
                                                           uint32_t t, uint32_t *key, int32_t *id,
                                                           int32_t m) {
    const __m256i vt = _mm256_set1_epi32((int32_t)t);
    uint32_t tmp[8];
    for (int32_t b = 0; b < n_blocks; b++) {
        if (gmax[b] < t) continue;
        for (int32_t i = b * bs; i < (b + 1) * bs; i += 8) {
            __m256i k = key8(v + i);
            __m256i ge = _mm256_cmpeq_epi32(_mm256_max_epu32(k, vt), k);
            unsigned bits = (unsigned)_mm256_movemask_ps(_mm256_castsi256_ps(ge));
            if (!bits) continue;
            _mm256_storeu_si256((__m256i *)tmp, k);
            while (bits) {
                int j = __builtin_ctz(bits);
                bits &= bits - 1;
                key[m] = tmp[j], id[m] = i + j, m++;
            }
        }
    }
    return m;
}

// The keys >= t of key[0..n) (ids: their indices), in id order, into okey/oid; returns the count.
__attribute__((target("avx2"))) static int32_t
collect_ge_avx2(const uint32_t *key, int32_t n, uint32_t t, uint32_t *okey, int32_t *oid) {
    const __m256i vt = _mm256_set1_epi32((int32_t)t);
    int32_t i = 0, m = 0;
    for (; i + 8 <= n; i += 8) {
        __m256i k = _mm256_loadu_si256((const __m256i *)(key + i));
        __m256i ge = _mm256_cmpeq_epi32(_mm256_max_epu32(k, vt), k);
        unsigned bits = (unsigned)_mm256_movemask_ps(_mm256_castsi256_ps(ge));
        while (bits) {
            int j = __builtin_ctz(bits);
            bits &= bits - 1;
            okey[m] = key[i + j], oid[m] = i + j, m++;
        }
    }
    for (; i < n; i++)
        if (key[i] >= t) okey[m] = key[i], oid[m] = i, m++;
    return m;
}
#endif

static int32_t collect_ge(const uint32_t *key, int32_t n, uint32_t t, uint32_t *okey,
                          int32_t *oid) {
#ifdef DI_SUM_EXP_AVX2
    if (use_avx2()) return collect_ge_avx2(key, n, t, okey, oid);
#endif
    int32_t m = 0;
    for (int32_t i = 0; i < n; i++)
        if (key[i] >= t) okey[m] = key[i], oid[m] = i, m++;
    return m;
}

static void keys_all(const float *v, int32_t n, uint32_t *key, int32_t *id) {
#ifdef DI_SUM_EXP_AVX2
    if (use_avx2()) {
        keys_avx2(v, n, key, id);
        return;
    }
#endif
    for (int32_t i = 0; i < n; i++) key[i] = key_of(v[i]), id[i] = i;
}

static void group_max(const float *v, int32_t n_blocks, int32_t bs, uint32_t *gmax) {
#ifdef DI_SUM_EXP_AVX2
    if (use_avx2()) {
        group_max_avx2(v, n_blocks, bs, gmax);
        return;
    }
#endif
    for (int32_t b = 0; b < n_blocks; b++) {
        const float *x = v + (size_t)b * bs;
        uint32_t mx = 0;
        for (int j = 0; j < bs; j++) {
            uint32_t k = key_of(x[j]);
            mx = k > mx ? k : mx;
        }
        gmax[b] = mx;
    }
}

static int32_t filter(const float *v, int32_t n_blocks, int32_t bs, const uint32_t *gmax,
                      uint32_t t, uint32_t *key, int32_t *id, int32_t m) {
#ifdef DI_SUM_EXP_AVX2
    if (use_avx2()) return filter_avx2(v, n_blocks, bs, gmax, t, key, id, m);
#endif
    for (int32_t b = 0; b < n_blocks; b++) {
        if (gmax[b] < t) continue;
        for (int32_t i = b * bs; i < (b + 1) * bs; i++) {
            uint32_t k = key_of(v[i]);
            if (k >= t) key[m] = k, id[m] = i, m++;
        }
    }
    return m;
}

// The k-th largest of key[0..m) (1 <= k <= m); *n_above: how many are strictly larger. A radix
// select on 8-bit digits (small histograms: m is usually a few thousand); scratch: [m] (the keys
// of the bucket followed, after each digit but the last).
static uint32_t kth_key(const uint32_t *key, int32_t m, int32_t k, uint32_t *scratch,
                        int32_t *n_above) {
    uint32_t hist[256];
    uint32_t prefix = 0;
    int32_t above = 0;
    const uint32_t *src = key;
    int32_t cnt = m;
    int sh = 24;
    for (; sh >= 0; sh -= 8) {
        memset(hist, 0, sizeof hist);
        if (cnt >= 1024) {
            // Four histograms in turn: runs of one digit (most keys share their high bits)
            // would otherwise chain every increment through one counter.
            uint32_t h4[4][256];
            memset(h4, 0, sizeof h4);
            int32_t i = 0;
            for (; i + 4 <= cnt; i += 4) {
                h4[0][(src[i] >> sh) & 255]++, h4[1][(src[i + 1] >> sh) & 255]++;
                h4[2][(src[i + 2] >> sh) & 255]++, h4[3][(src[i + 3] >> sh) & 255]++;
            }
            for (; i < cnt; i++) hist[(src[i] >> sh) & 255]++;
            for (int b = 0; b < 256; b++) hist[b] += h4[0][b] + h4[1][b] + h4[2][b] + h4[3][b];
        } else {
            for (int32_t i = 0; i < cnt; i++) hist[(src[i] >> sh) & 255]++;
        }
        // The bucket holding the k-th largest: the buckets above it hold fewer than k - above.
        int32_t b = 255, acc = above;
        while (acc + (int32_t)hist[b] < k) acc += (int32_t)hist[b--];
        above = acc;
        prefix |= (uint32_t)b << sh;
        if (sh == 0) break;
        if ((int32_t)hist[b] == cnt) continue; // every key in it: nothing to drop
        int32_t j = 0; // branch-free: which keys stay is data, not a pattern
        for (int32_t i = 0; i < cnt; i++) {
            const uint32_t kk = src[i];
            scratch[j] = kk;
            j += ((kk >> sh) & 255) == (uint32_t)b;
        }
        src = scratch, cnt = j;
    }
    *n_above = above;
    return prefix;
}

#ifdef DI_SUM_EXP_AVX2
// kth_key_grouped's two loops on AVX2: the maxima of the groups (lane j of the 8 rows of each
// block of 64 keys) and the keys reaching t0, in order; returns the count written.
__attribute__((target("avx2"))) static void lane_max_avx2(const uint32_t *key, int32_t n_blocks,
                                                          uint32_t *gm) {
    for (int32_t b = 0; b < n_blocks; b++) {
        const __m256i *x = (const __m256i *)(key + (size_t)b * 64);
        __m256i m0 = _mm256_max_epu32(_mm256_loadu_si256(x), _mm256_loadu_si256(x + 1));
        __m256i m1 = _mm256_max_epu32(_mm256_loadu_si256(x + 2), _mm256_loadu_si256(x + 3));
        __m256i m2 = _mm256_max_epu32(_mm256_loadu_si256(x + 4), _mm256_loadu_si256(x + 5));
        __m256i m3 = _mm256_max_epu32(_mm256_loadu_si256(x + 6), _mm256_loadu_si256(x + 7));
        m0 = _mm256_max_epu32(_mm256_max_epu32(m0, m1), _mm256_max_epu32(m2, m3));
        _mm256_storeu_si256((__m256i *)(gm + (size_t)b * 8), m0);
    }
}

__attribute__((target("avx2"))) static int32_t keys_ge_avx2(const uint32_t *key, int32_t m,
                                                            uint32_t t0, uint32_t *out) {
    const __m256i vt = _mm256_set1_epi32((int32_t)t0);
    int32_t i = 0, c = 0;
    for (; i + 8 <= m; i += 8) {
        __m256i k = _mm256_loadu_si256((const __m256i *)(key + i));
        unsigned bits = (unsigned)_mm256_movemask_ps(
            _mm256_castsi256_ps(_mm256_cmpeq_epi32(_mm256_max_epu32(k, vt), k)));
        while (bits) {
            out[c++] = key[i + __builtin_ctz(bits)];
            bits &= bits - 1;
        }
    }
    for (; i < m; i++)
        if (key[i] >= t0) out[c++] = key[i];
    return c;
}
#endif

// kth_key for many keys and a small k: the k-th largest of the maxima of groups of 8 bounds it
// from below (as in select_top), so only the keys reaching that bound (usually a few more than k)
// go through the radix select; the keys above the k-th are all among them, so *n_above is theirs.
// scratch: [2 m] (the maxima and then the keys reaching the bound, with kth_key's scratch after).
static uint32_t kth_key_grouped(const uint32_t *key, int32_t m, int32_t k, uint32_t *scratch,
                                int32_t *n_above) {
    const int32_t n_blocks = m / 64, g = n_blocks * 8; // groups: lane j of each block's 8 rows
    if (m < 1024 || (int64_t)k * 16 > m) return kth_key(key, m, k, scratch, n_above);
    int32_t c = 0, unused;
#ifdef DI_SUM_EXP_AVX2
    if (use_avx2()) {
        lane_max_avx2(key, n_blocks, scratch);
        const uint32_t t0 = kth_key(scratch, g, k, scratch + g, &unused);
        c = keys_ge_avx2(key, m, t0, scratch);
        return kth_key(scratch, c, k, scratch + c, n_above);
    }
#endif
    for (int32_t b = 0; b < n_blocks; b++)
        for (int j = 0; j < 8; j++) {
            uint32_t mx = 0;
            for (int r = 0; r < 8; r++) {
                const uint32_t x = key[b * 64 + r * 8 + j];
                mx = x > mx ? x : mx;
            }
            scratch[b * 8 + j] = mx;
        }
    const uint32_t t0 = kth_key(scratch, g, k, scratch + g, &unused);
    for (int32_t i = 0; i < m; i++)
        if (key[i] >= t0) scratch[c++] = key[i];
    return kth_key(scratch, c, k, scratch + c, n_above);
}

// A lower bound on the k-th largest of key[0..n) (1 <= k <= n) at least k keys reach, and fewer
// than k the next multiple of 2^16: the k-th largest key's first 16 bits, from one histogram
// (hist16: [65536]).
static uint32_t bound16(const uint32_t *key, int32_t n, int32_t k, uint32_t *hist16) {
    memset(hist16, 0, sizeof(uint32_t) << 16);
    for (int32_t i = 0; i < n; i++) hist16[key[i] >> 16]++;
    int32_t b = 65535, acc = 0;
    while (acc + (int32_t)hist16[b] < k) acc += (int32_t)hist16[b--];
    return (uint32_t)b << 16;
}

// Sorts key/id[0..m) (ids ascending) by key descending, ids ascending among equal keys, into
// out[0..m) (ids). x, y: [m] scratch words, x apart from key/id (y may be their memory: they are
// read once, into x, first). The words are (~key << 32 | id): ascending words are the order, and
// an LSD radix on the key's bytes keeps the ids' order among equal keys (it is stable).
static void sort_desc(const uint32_t *key, const int32_t *id, int32_t m, uint64_t *x, uint64_t *y,
                      int32_t *out) {
    for (int32_t i = 0; i < m; i++) x[i] = (uint64_t)~key[i] << 32 | (uint32_t)id[i];
    if (m <= SEL_SMALL) {
        for (int32_t i = 1; i < m; i++) {
            uint64_t w = x[i];
            int32_t j = i;
            for (; j > 0 && x[j - 1] > w; j--) x[j] = x[j - 1];
            x[j] = w;
        }
    } else {
        // 8 bits a pass over the key's 4 bytes, a pass skipped where one bucket holds all.
        uint32_t hist[4][256];
        memset(hist, 0, sizeof hist);
        for (int32_t i = 0; i < m; i++) {
            const uint32_t k = (uint32_t)(x[i] >> 32);
            hist[0][k & 255]++, hist[1][(k >> 8) & 255]++;
            hist[2][(k >> 16) & 255]++, hist[3][k >> 24]++;
        }
        for (int pass = 0; pass < 4; pass++) {
            const int sh = 32 + pass * 8;
            uint32_t *h = hist[pass];
            if (h[(x[0] >> sh) & 255] == (uint32_t)m) continue;
            uint32_t sum = 0;
            for (int b = 0; b < 256; b++) {
                uint32_t c = h[b];
                h[b] = sum, sum += c;
            }
            for (int32_t i = 0; i < m; i++) y[h[(x[i] >> sh) & 255]++] = x[i];
            uint64_t *t = x;
            x = y, y = t;
        }
    }
    for (int32_t i = 0; i < m; i++) out[i] = (int32_t)(uint32_t)x[i];
}

// Keeps, of key/id[0..m) in id order, the keys above t and the first n_eq equal to it (exactly
// k in all, in the same order); returns their count.
static int32_t trim_to_k(uint32_t *key, int32_t *id, int32_t m, uint32_t t, int32_t n_eq) {
    int32_t j = 0;
    for (int32_t i = 0; i < m; i++) { // branch-free: which keys stay is data, not a pattern
        const uint32_t kk = key[i];
        const int32_t d = id[i], eq = kk == t, take = (kk > t) | (eq & (n_eq > 0));
        key[j] = kk, id[j] = d;
        j += take, n_eq -= eq & take;
    }
    return j;
}

// The k best ids of v[n] (1 <= k <= n) into out[0..k), best first; out is not a selection buffer.
static void select_top(di_sampler *s, const float *v, int32_t n, int32_t k, int32_t *out) {
    uint32_t *key = s->sel_key;
    int32_t *id = s->sel_id, m;
    const int32_t bs = (int64_t)k * SEL_BLOCK <= n ? SEL_BLOCK : SEL_BLOCK_SMALL;
    const int32_t n_blocks = n / bs;
    if ((int64_t)k * bs <= n && n_blocks >= 4) {
        // k <= n / bs = n_blocks groups: the bound exists. The maxima serve every selection on
        // the same row within a call (the nucleus may widen several times).
        if (s->gmax_row != v || s->gmax_bs != bs)
            group_max(v, n_blocks, bs, s->gmax), s->gmax_row = v, s->gmax_bs = bs;
        int32_t n_above;
        const uint32_t t = kth_key_grouped(s->gmax, n_blocks, k, s->sel_key2, &n_above);
        m = filter(v, n_blocks, bs, s->gmax, t, key, id, 0);
        for (int32_t i = n_blocks * bs; i < n; i++) // the tail: every value a candidate
            key[m] = key_of(v[i]), id[m] = i, m++;
        if (m > k) { // exactly k: the keys above the k-th best, then the first ids holding it
            int32_t n_above2;
            const uint32_t t2 = kth_key(key, m, k, s->sel_key2, &n_above2);
            m = trim_to_k(key, id, m, t2, k - n_above2);
        }
    } else if (k < n) {
        // Every value a candidate: a bound on the k-th best key from the row's keys (their first
        // 16 bits where the row is long), the keys reaching it in id order (into the second
        // buffers), then exactly k of them as above.
        keys_all(v, n, key, id);
        int32_t n_above;
        const uint32_t t = s->hist16 && n >= SEL_HIST16 ? bound16(key, n, k, s->hist16)
                                                        : kth_key(key, n, k, s->sel_key2, &n_above);
        m = collect_ge(key, n, t, s->sel_key2, s->sel_id2);
        if (m > k) {
            const uint32_t t2 = kth_key(s->sel_key2, m, k, key, &n_above);
            m = trim_to_k(s->sel_key2, s->sel_id2, m, t2, k - n_above);
        }
        sort_desc(s->sel_key2, s->sel_id2, m, s->sel_a, s->sel_b, out);
        return;
    } else {
        keys_all(v, n, key, id);
        m = n;
    }
    sort_desc(key, id, m, s->sel_b, s->sel_a, out);
}

// ---- sampling ----

// The nucleus test `acc / z >= top_p` decided without z (the sum_exp of the whole row) where
// bounds suffice: +1 it holds, -1 it fails, 0 unknown. acc: the prefix mass (the sequential sum
// of the first k weights); a_have: the sum of the first `have` weights (have >= k), n_rest: the
// ids outside them, each weighing at most w_last (the have-th weight: the row is sorted, so every
// other exponent is at most its exponent). The weights are exp_le0 of the same exponents that
// sum_exp evaluates, so with S their exact mass, z lies within S (1 +- 2e-11) (relative errors:
// the exps' < 1e-15 each, the sum's < V u) and a_have <= S <= a_have + n_rest w_last (to the
// same tolerance); a margin of 1e-8 leaves the rounded quotient on the same side of top_p.
static int nucleus_bound(double acc, double a_have, double w_last, int32_t n_rest, float top_p) {
    const double upper = a_have + (double)n_rest * w_last;
    if (!(acc > 0 && a_have > 0 && upper < INFINITY)) return 0; // inf, NaN or no mass: exactly
    if (acc / upper >= top_p * (1 + 1e-8)) return 1;
    if (acc / a_have < top_p * (1 - 1e-8)) return -1;
    return 0;
}

// The nucleus' sorted prefix widened from `was` to `have` candidates (s->cand) and their weights
// (s->prob; the first `was` stay as they are: a prefix of the same order); *m0 is set to the best
// candidate's value on the first call (was == 0). Returns the sum of the `have` weights.
static double nucleus_widen(di_sampler *s, const float *w, int32_t V, int32_t was, int32_t have,
                            double *m0, double inv_t) {
    select_top(s, w, V, have, s->cand);
    if (was == 0) *m0 = w[s->cand[0]];
    exp_ids(w, s->cand + was, have - was, *m0, inv_t, s->prob + was);
    double a = 0;
    for (int32_t i = 0; i < have; i++) a += s->prob[i];
    return a;
}

void di_sampler_sample(di_sampler *s, const float *logits, const di_sample_params *p,
                       const int32_t *history, int32_t n_prompt, int32_t n_gen, int64_t pos,
                       di_sample_result *res) {
    const int32_t V = s->n_vocab;
    s->gmax_row = NULL;

    const bool want_lp = p->logprobs || p->n_logprobs > 0;
    const int32_t n_hist = n_prompt + n_gen;
    // Whether bias or penalties change a logit (then they work on a copy, else on the logits).
    const bool modify = p->n_logit_bias > 0 ||
                        ((p->presence_penalty != 0 || p->frequency_penalty != 0) && n_gen > 0) ||
                        (p->repetition_penalty != 1 && n_hist > 0);
    const bool untruncated = !(p->top_k > 0 || p->top_p < 1 || p->min_p > 0);
    // The raw argmax, where something uses it: the log-probabilities, greedy and the untruncated
    // draw on the unchanged logits (the truncating paths take their best candidate instead).
    const int32_t i_max =
        want_lp || (!modify && (p->temperature == 0 || untruncated)) ? di_argmax(logits, V) : -1;

    // Log-probabilities of the raw logits (reported, whatever the processing), when asked for.
    const double lse = want_lp ? logits[i_max] + log(sum_exp(logits, V, logits[i_max], 1.0)) : 0;
    res->n_top = p->n_logprobs;
    if (p->n_logprobs > 0) {
        select_top(s, logits, V, p->n_logprobs, res->top_ids);
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

    // Processing: bias, then penalties, on a copy; without any that changes a logit, the logits
    // themselves (w == logits, and their argmax is i_max).
    const float *w = logits;
    if (modify) {
        float *wm = s->work;
        memcpy(wm, logits, sizeof(float) * (size_t)V);
        for (int32_t i = 0; i < p->n_logit_bias; i++)
            wm[p->logit_bias[i].token] += p->logit_bias[i].bias;
        if (++s->stamp == 0) { // wrapped: clear the stamps
            memset(s->mark, 0, sizeof(uint32_t) * (size_t)V);
            s->stamp = 1;
        }
        const uint32_t st = s->stamp;
        if (p->presence_penalty != 0 || p->frequency_penalty != 0) {
            for (int32_t i = n_prompt; i < n_hist; i++) {
                int32_t t = history[i];
                if (s->mark[t] != st) s->mark[t] = st, s->count[t] = 0;
                s->count[t]++;
            }
            for (int32_t i = n_prompt; i < n_hist; i++) {
                int32_t t = history[i];
                if (s->count[t] > 0) {
                    wm[t] -= p->presence_penalty + p->frequency_penalty * (float)s->count[t];
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
                wm[t] = wm[t] > 0 ? wm[t] / p->repetition_penalty : wm[t] * p->repetition_penalty;
            }
        }
        w = wm;
    }
    // The processed row's argmax, where a path needs it: greedy and the untruncated draw.
    const int32_t w_max = !modify                              ? i_max
                          : p->temperature == 0 || untruncated ? di_argmax(w, V)
                                                               : -1;

    int32_t tok;
    if (p->temperature == 0) {
        tok = w_max;
    } else if (untruncated) {
        // No truncation: the draw over ids in ascending order. The prefix sums of the weights
        // are the draw's running sum (the same sequential additions as the total), so the token
        // is the first id whose prefix sum exceeds u: a binary search.
        double *sums = s->prob;
        const double z = prefix_exp(w, V, w[w_max], 1.0 / p->temperature, sums);
        const double u = di_sample_uniform(p->seed, pos) * z;
        int32_t lo = 0, hi = V; // the first i with u < sums[i], V when none
        while (lo < hi) {
            int32_t mid = lo + (hi - lo) / 2;
            if (u < sums[mid])
                hi = mid;
            else
                lo = mid + 1;
        }
        tok = lo < V ? lo : V - 1;
    } else {
        // Candidates, best first: top-k (or everything), then top-p / min-p on the tempered
        // softmax, on a sorted prefix of the row.
        int32_t *c = s->cand;
        double *pr = s->prob;
        const double inv_t = 1.0 / p->temperature;
        int32_t k = p->top_k > 0 && p->top_k < V ? p->top_k : V, n;
        if (p->top_k == 0 && p->top_p < 1) {
            // Nucleus without top-k: the prefix of k = 64, 256, 1024, ... (x4, up to V) that first
            // holds top_p of the row's mass z. Prefixes of one sorted order are prefixes of each
            // other, so a wider selection keeps the weights and the prefix mass computed so far.
            // z (a pass of exps over the row) is computed only when bounds cannot decide the
            // test (nucleus_bound).
            // m0: the best candidate's value, the row's maximum (the oracle took di_argmax's:
            // the same id on a NaN-free row).
            double m0 = 0, z = 0, a_have = 0;
            bool have_z = false;
            int32_t have = 0, done = 0;
            double acc = 0;
            for (k = 64 < V ? 64 : V;; k = k * 4 < V ? k * 4 : V) {
                if (k > have) a_have = nucleus_widen(s, w, V, have, k, &m0, inv_t), have = k;
                for (; done < k; done++) acc += pr[done];
                if (k == V) break;
                int verdict =
                    have_z ? 0 : nucleus_bound(acc, a_have, pr[have - 1], V - have, p->top_p);
                if (verdict == 0 && !have_z && have < 1024 && have < V) {
                    // Undecided on the first prefix alone: the bounds of a wider one may decide
                    // (and it serves the next two k).
                    const int32_t wide = 1024 < V ? 1024 : V;
                    a_have = nucleus_widen(s, w, V, have, wide, &m0, inv_t), have = wide;
                    verdict = nucleus_bound(acc, a_have, pr[have - 1], V - have, p->top_p);
                }
                if (verdict == 0 && !have_z) z = sum_exp(w, V, m0, inv_t), have_z = true;
                if (verdict > 0 || (have_z && acc / z >= p->top_p)) break;
            }
            n = k;
        } else if (p->top_p == 1) {
            // min-p alone (with or without top-k): only the prefix up to the first token below
            // min_p x the best matters; grow a sorted prefix until it shows one (or is all k).
            int32_t kk = k < 64 ? k : 64, done = 0;
            for (;;) {
                select_top(s, w, V, kk, c);
                exp_ids(w, c + done, kk - done, w[c[0]], inv_t, pr + done);
                const double lim = p->min_p * pr[0];
                for (; done < kk && pr[done] >= lim; done++) {
                }
                if (done < kk || kk == k) break;
                kk = kk < k / 8 ? kk * 8 : k;
            }
            n = kk;
        } else {
            select_top(s, w, V, k, c);
            exp_ids(w, c, k, w[c[0]], inv_t, pr);
            n = k;
        }
        double z = 0;
        for (int32_t i = 0; i < n; i++) z += pr[i];
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
        double u = di_sample_uniform(p->seed, pos) * z, acc = 0;
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

void di_sampler_sample_allowed(di_sampler *s, const float *logits, const uint64_t *allow,
                               const di_sample_params *p, const int32_t *history, int32_t n_prompt,
                               int32_t n_gen, int64_t pos, di_sample_result *res) {
    const int32_t V = s->n_vocab;
    float *m = s->masked;
    // Whole words of the mask at once: grammar masks come in long runs of 0s and of 1s.
    for (int32_t i0 = 0; i0 < V; i0 += 64) {
        const uint64_t bits = allow[i0 >> 6];
        const int32_t n = V - i0 < 64 ? V - i0 : 64;
        if (bits == ~0ull) {
            memcpy(m + i0, logits + i0, sizeof(float) * (size_t)n);
        } else if (bits == 0) {
            for (int32_t j = 0; j < n; j++) m[i0 + j] = -INFINITY;
        } else {
            for (int32_t j = 0; j < n; j++)
                m[i0 + j] = ((bits >> j) & 1) ? logits[i0 + j] : -INFINITY;
        }
    }
    di_sampler_sample(s, m, p, history, n_prompt, n_gen, pos, res);
    // The draw's fallback (the last candidate, when rounding leaves the cumulative sum short of
    // the uniform) could land on a masked token: take the best allowed one instead.
    if (!((allow[res->token >> 6] >> (res->token & 63)) & 1)) {
        int32_t best = -1;
        for (int32_t i = 0; i < V; i++)
            if (m[i] != -INFINITY && (best < 0 || m[i] > m[best])) best = i;
        if (best >= 0) res->token = best, res->logprob = -INFINITY;
    }
}

// ---- test hook ----

int64_t di_sampler_exp_mismatches(const float *x, int32_t n, double m, double scale) {
    if (n < 1) return 0;
    double *a = di_malloc(sizeof(double) * (size_t)n), *b = di_malloc(sizeof(double) * (size_t)n);
    int32_t *ids = di_malloc(sizeof(int32_t) * (size_t)n);
    if (!a || !b || !ids) {
        di_free(a), di_free(b), di_free(ids);
        return -1;
    }
    for (int32_t i = 0; i < n; i++) ids[i] = n - 1 - i; // gathered in reverse
    int64_t bad = 0;
    exp_ids(x, ids, n, m, scale, a);
    for (int32_t i = 0; i < n; i++) {
        double e = exp_le0(((double)x[ids[i]] - m) * scale);
        bad += memcmp(&a[i], &e, sizeof e) != 0;
    }
    const double total = prefix_exp(x, n, m, scale, b);
    double acc = 0;
    for (int32_t i = 0; i < n; i++) {
        acc += exp_le0(((double)x[i] - m) * scale);
        bad += memcmp(&b[i], &acc, sizeof acc) != 0;
    }
    bad += memcmp(&total, &acc, sizeof acc) != 0;
#ifdef DI_SUM_EXP_AVX2
    if (isa_level() >= 2) { // the row sums of the AVX-512 level are the AVX2 level's
        const double s512 = sum_exp_avx512(x, n, m, scale), s2 = sum_exp_avx2(x, n, m, scale);
        bad += memcmp(&s512, &s2, sizeof s2) != 0;
    }
#endif
    di_free(a), di_free(b), di_free(ids);
    return bad;
}
