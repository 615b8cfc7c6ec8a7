/*
 * sampler_ref — the oracle of the sampler: the implementation before the selection and exp rework,
 * unchanged but for its names, so that tests/unit/test_sampler.c and bench/sampler/bench_sampler.c
 * can compare src/sample/sampler.c with it bit for bit (token, logprob, top ids, top logprobs).
 * Same contracts as di_sampler_create / _destroy / _sample / _sample_allowed (sample/sampler.h).
 * Owns: a ref_sampler owns its work arrays. Thread-safety: a ref_sampler is used by one thread.
 */
#pragma once

#include <stdint.h>

#include "sample/sampler.h" // di_sample_result, di_sample_params

typedef struct ref_sampler ref_sampler;

di_status ref_sampler_create(int32_t n_vocab, ref_sampler **out);
void ref_sampler_destroy(ref_sampler *s);
void ref_sampler_sample(ref_sampler *s, const float *logits, const di_sample_params *p,
                        const int32_t *history, int32_t n_prompt, int32_t n_gen, int64_t pos,
                        di_sample_result *res);
void ref_sampler_sample_allowed(ref_sampler *s, const float *logits, const uint64_t *allow,
                                const di_sample_params *p, const int32_t *history, int32_t n_prompt,
                                int32_t n_gen, int64_t pos, di_sample_result *res);
