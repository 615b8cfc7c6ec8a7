/*
 * engram_hash — the integer n-gram hashing of DeepSeek V4.1's Engram memory (spec deepseek-v41.md
 * §2.3.1): the primes and column offsets of every Engram layer, the odd multipliers (NumPy's
 * default_rng(10007 · layer_id).integers(0, bound, size = max_ngram) · 2 + 1, reproduced bit for
 * bit: SeedSequence, PCG64 XSL-RR, Lemire's bounded integers), and the row ids of one position.
 *
 * Owns: nothing on the heap (fixed arrays). Does not: map token ids to the compressed vocabulary
 * (the caller passes compressed ids; the map is data, see dsv41.h), or read tables.
 * Thread-safety: immutable after di_engram_hash_init; any thread.
 */
#pragma once

#include <stdint.h>

#include "deepinfer.h"     // di_status
#include "model/hparams.h" // di_hparams, DI_MAX_ENGRAM

#define DI_ENGRAM_MAX_COLS 256 // (max_ngram - 1) · n_head
#define DI_ENGRAM_DEAD (-1)    // compressed id of a position that breaks n-grams (image span)

typedef struct di_engram_hash {
    int32_t n_layer;                                  // Engram layers
    int32_t max_ngram;                                // n-grams of size 2 .. max_ngram
    int32_t n_head;                                   // hash heads per n-gram size
    int32_t n_col;                                    // (max_ngram - 1) · n_head columns per layer
    int64_t bound;                                    // multipliers are 2u + 1 with u < bound
    int64_t mult[DI_MAX_ENGRAM][8];                   // [layer][look-back]
    int64_t prime[DI_MAX_ENGRAM][DI_ENGRAM_MAX_COLS]; // [layer][column]
    int64_t offset[DI_MAX_ENGRAM][DI_ENGRAM_MAX_COLS]; // running sums of the primes
    int64_t rows[DI_MAX_ENGRAM];                       // sum of a layer's primes
} di_engram_hash;

// Builds the constants from the config (engram_layer_ids, engram_vocab_size, n-gram size, heads,
// compressed vocabulary). DI_ERR_FORMAT (logged) if a layer's prime total differs from
// engram_num_embeddings or the sizes are out of range.
di_status di_engram_hash_init(di_engram_hash *h, const di_hparams *hp);

// Row ids [n_col] (column offsets included) of Engram layer L for the position whose compressed
// id is look[0], look[k] = compressed id k positions back, or DI_ENGRAM_DEAD (also for positions
// before the sequence start). pad = the compressed id of engram_pad_id.
void di_engram_hash_rows(const di_engram_hash *h, int L, const int32_t *look, int32_t pad,
                         int64_t *rows);

// NumPy default_rng(seed).integers(0, bound, size = n, dtype = int64) (bound > 2^32). For tests.
void di_engram_numpy_integers(uint64_t seed, int64_t bound, int n, int64_t *out);
