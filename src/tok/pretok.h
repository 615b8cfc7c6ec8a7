/*
 * pretok — DeepSeek's pre-tokenizer: splits text (no added tokens in it) into the pieces that BPE
 * encodes independently. The tokenizer.json of DeepSeek V3/V4 chains three regex splits, all
 * "Isolated" (each match and each gap between matches becomes a piece), then ByteLevel without
 * its own regex:
 *
 *   1. \p{N}{1,3}
 *   2. [\x{4e00}-\x{9fa5}\x{3040}-\x{309f}\x{30a0}-\x{30ff}]+
 *   3. [!"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+|
 *      ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+
 *
 * Splits 1 and 2 are run as one PCRE2 pattern (their match sets are disjoint: no \p{N} character
 * lies in the CJK ranges, so the pieces are the same), split 3 on each resulting piece. PCRE2 is
 * used with UTF + UCP and JIT. HF evaluates these with Oniguruma, so the character classes are
 * spelled out where the two engines' Unicode tables disagree (see pretok.c); the golden corpus in
 * tests/data/tok checks the result against HF tokenizers piece for piece.
 *
 * Owns: the compiled patterns. Thread-safety: a di_pretok is immutable and shared; each thread
 * uses its own di_pretok_ctx (match data) for splitting.
 */
#pragma once

#include <stddef.h>

#include "deepinfer.h" // di_status

typedef struct di_pretok di_pretok;
typedef struct di_pretok_ctx di_pretok_ctx;

// Compiles the patterns. DI_ERR_NOMEM, or DI_ERR_UNSUPPORTED if PCRE2 lacks UTF/JIT support.
di_status di_pretok_create(di_pretok **out);
void di_pretok_destroy(di_pretok *p);

// Per-thread matching state. DI_ERR_NOMEM.
di_status di_pretok_ctx_create(const di_pretok *p, di_pretok_ctx **out);
void di_pretok_ctx_destroy(di_pretok_ctx *c);

// Called once per piece, in order; pieces are non-empty and tile the text exactly. A non-OK
// return stops the split and is returned by di_pretok_split.
typedef di_status (*di_pretok_fn)(void *user, const char *piece, size_t n);

// Splits text (valid UTF-8; the caller has checked it). DI_ERR_NOMEM, DI_ERR_INVALID if the
// regex engine fails (resource limits), or the callback's error.
di_status di_pretok_split(const di_pretok *p, di_pretok_ctx *c, const char *text, size_t n,
                          di_pretok_fn fn, void *user);
