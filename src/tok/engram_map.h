/*
 * engram_map — DeepSeek V4.1's Engram compressed token map, derived from the tokenizer the way
 * transformers' build_compressed_token_map does: every id is decoded alone (special tokens
 * included), normalised (NFKC, NFD, strip marks, lowercase, whitespace runs to one space, trim;
 * a lone space is kept), and ids whose keys are equal share one compressed id, numbered in
 * order of first appearance. A decode that needs U+FFFD (a partial UTF-8 byte token) is keyed
 * by the token's raw vocabulary string instead. See docs/tokenizer.md.
 * Thread-safety: pure function of a read-only tokenizer; any thread.
 */
#pragma once

#include <stdint.h>

#include "deepinfer.h" // di_tokenizer, di_status

// Builds the map for ids [0, n_vocab) of tok: *map (di_malloc'd, n_vocab entries, freed with
// di_free) and *n_keys (the compressed vocabulary size). DI_ERR_INVALID (bad arguments),
// DI_ERR_NOMEM, DI_ERR_FORMAT (ICU could not normalise a token).
di_status di_engram_map_build(const di_tokenizer *tok, int32_t **map, int32_t *n_map,
                              int32_t *n_keys);
