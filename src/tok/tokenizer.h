/*
 * tokenizer — internal side of the public di_tokenizer (include/deepinfer.h): helpers shared by
 * detok.c, render.c and the tests. The tokenizer is vocab (tables) + pretok (splits) + bpe
 * (merges); added tokens are split out first (leftmost-longest, HF's two passes) when the caller
 * asks for template-text encoding.
 * Thread-safety: any thread (see include/deepinfer.h).
 */
#pragma once

#include <stdbool.h>
#include <stddef.h>

#include "base/buf.h"  // di_buf
#include "deepinfer.h" // di_tokenizer
#include "tok/bpe.h"   // di_bpe_ids
#include "tok/vocab.h" // di_vocab

// Committed copy of DeepSeek V4's tokenizer, relative to the source tree root; the root is found
// from this file's __FILE__ so that a build tree needs no configuration (docs/tokenizer.md).
#define DI_TOKENIZER_DEFAULT_REL "data/tokenizer/deepseek-v4/tokenizer.json"

// The fallback path of di_tokenizer_load_for_model: $DI_TOKENIZER, else the committed copy.
const char *di_tokenizer_default_path(void);

const di_vocab *di_tokenizer_vocab(const di_tokenizer *tok);

// Appends the ids of text to out (see di_tokenizer_encode for the contract).
di_status di_tokenizer_encode_into(const di_tokenizer *tok, const char *text, size_t n,
                                   bool special, di_bpe_ids *out);
// Appends the raw bytes of ids (no UTF-8 repair) to out. DI_ERR_INVALID, DI_ERR_NOMEM.
di_status di_tokenizer_decode_raw(const di_tokenizer *tok, const int32_t *ids, size_t n_ids,
                                  bool skip_special, di_buf *out);

// ---- UTF-8 helpers ----

// Length of the longest prefix of s that is valid UTF-8 (RFC 3629: no surrogates, no overlongs).
size_t di_utf8_valid_prefix(const char *s, size_t n);
// At an invalid position s[0]: length of the maximal invalid subpart (one U+FFFD), or 0 with
// *need_more set when s is a valid but incomplete character and !final.
size_t di_utf8_invalid_len(const char *s, size_t n, bool final, bool *need_more);
// Appends s to out with invalid sequences replaced by U+FFFD (Rust from_utf8_lossy, which HF
// uses). When !final an incomplete character at the end is not consumed; *consumed (may be NULL)
// receives the bytes used.
di_status di_utf8_append_lossy(di_buf *out, const char *s, size_t n, bool final, size_t *consumed);
