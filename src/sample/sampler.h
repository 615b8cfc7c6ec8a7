/*
 * sampler — turns one row of logits into the next token of one request: logit bias, repetition /
 * presence / frequency penalties, greedy or temperature sampling with top-k, top-p and min-p
 * truncation, and the top-N log-probabilities. Randomness is counter-based: the uniform number
 * for the token at absolute position `pos` of a request is a pure function of (seed, pos)
 * (di_sample_uniform), so a seeded request draws the same tokens alone, in any batch, and after
 * a preemption that recomputes it.
 *
 * Candidates (top-k, the nucleus, min-p, the top-N log-probabilities) are the k best ids in the
 * order (value descending, id ascending), found by a radix select on order-preserving keys of the
 * values behind a bound from block maxima (about one read pass of the row for small k) and sorted
 * by an LSD radix; the nucleus decides its prefix test from bounds on the row's mass where they
 * suffice (peaked rows skip the mass's exp pass); the untruncated draw keeps the prefix sums of
 * its weights and binary-searches them. Exactness: for every row without NaN (after bias: an
 * infinite bias on an infinite logit of the other sign makes a NaN) and every parameter set the
 * token, logprob, top ids and top logprobs are bit for bit those of the implementation before
 * this selection (kept as the oracle in tests/unit/sampler_ref.c; test_sampler compares them),
 * on each vector level (scalar, AVX2, AVX-512F; chosen once per process, DI_CPU_ISA=scalar|avx2
 * lowers it): the vector exps of the draws are the scalar exp's bits (separate multiplies and
 * adds, no FMA), the row sums keep their lanes and order, every sequential sum its order. NaN
 * rows: a NaN ranks below every number (-inf included) in the candidates and weighs 0; the result
 * is a valid token id in [0, V), nothing more is promised (the order among them is not the old
 * one's).
 *
 * Owns: di_sampler owns its work arrays (sized for the vocabulary at create, about 45 bytes per
 * token plus 256 KiB: 6 MB at V4's 129,280; nothing is allocated per token). Does not: decide when
 * a request stops (sched/request.c and stop.c do).
 * Thread-safety: a di_sampler is used by one thread (the engine thread).
 */
#pragma once

#include <stdbool.h>
#include <stdint.h>

#include "deepinfer.h" // di_status, di_sample_params

typedef struct di_sampler di_sampler;

typedef struct di_sample_result {
    int32_t token;
    float logprob; // log-softmax of the raw logits at `token`
    int32_t n_top; // = params.n_logprobs
    int32_t top_ids[DI_MAX_LOGPROBS];
    float top_logprobs[DI_MAX_LOGPROBS]; // descending; ties to the lower id
} di_sample_result;

// DI_ERR_INVALID (n_vocab < 1), DI_ERR_NOMEM.
// The first index of the largest of v[0..n) (NaNs never win; a NaN at 0 keeps 0); AVX2 where the
// CPU has it. What greedy sampling takes.
int32_t di_argmax(const float *v, int32_t n);

di_status di_sampler_create(int32_t n_vocab, di_sampler **out);
void di_sampler_destroy(di_sampler *s);

// Checks a request's parameters (the boundary): DI_ERR_INVALID with a logged reason.
di_status di_sample_params_check(const di_sample_params *p, int32_t n_vocab);

// Samples from logits [n_vocab] (not modified). history: the request's prompt then its generated
// tokens (n_prompt + n_gen ids); the repetition penalty covers all of them, the presence and
// frequency penalties only the generated ones. pos: the absolute position the new token will
// take (n_prompt + n_gen). Parameters must have passed di_sample_params_check. A row with NaNs
// gives a valid token id (the rule above).
void di_sampler_sample(di_sampler *s, const float *logits, const di_sample_params *p,
                       const int32_t *history, int32_t n_prompt, int32_t n_gen, int64_t pos,
                       di_sample_result *res);

// di_sampler_sample over the logits with every token outside `allow` (a bitset over the
// vocabulary: bit i of allow[i / 64]) set to -inf first: a grammar's mask, applied before bias,
// penalties and truncation; the log-probabilities reported are those of the masked logits. At
// least one token must be allowed.
void di_sampler_sample_allowed(di_sampler *s, const float *logits, const uint64_t *allow,
                               const di_sample_params *p, const int32_t *history, int32_t n_prompt,
                               int32_t n_gen, int64_t pos, di_sample_result *res);

// The counter-based generator: a uniform double in [0, 1) from (seed, pos) alone (splitmix64
// finalisers over a hash of both).
double di_sample_uniform(uint64_t seed, int64_t pos);

// Test hook (tests/unit/test_sampler.c): how many of the weights exp((x[i] - m) * scale) over
// x[0..n) (gathered by id, and as the untruncated draw's prefix sums), computed at this process's
// level (scalar, AVX2 or AVX-512, sampler.c isa_level), differ in any bit from the scalar form's,
// plus 1 if the AVX-512 level's row sum (sum_exp) differs from the AVX2 level's; 0 is the
// sampler's exactness rule. -1 when out of memory. Allocates; any thread.
int64_t di_sampler_exp_mismatches(const float *x, int32_t n, double m, double scale);
