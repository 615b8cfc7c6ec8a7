/*
 * vocab — the token table of a byte-level BPE tokenizer loaded from a Hugging Face
 * `tokenizer.json` (plain or gzip-compressed): every id's bytes, the merge table, the 256 byte
 * tokens and the added (special and non-special) tokens with their leftmost-longest matchers.
 *
 * Owns: all tables (built once at load, immutable afterwards). Does not: split text (pretok),
 * run merges (bpe) or render prompts (render).
 * Thread-safety: a loaded di_vocab is read-only and may be used from any thread.
 *
 * Validation happens here, once: a tokenizer.json whose model is not byte-level BPE, whose merges
 * name unknown tokens, or whose ids collide is rejected with DI_ERR_FORMAT and a log line saying
 * what is wrong. Interior code (bpe.c) trusts the tables.
 */
#pragma once

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "deepinfer.h" // di_status

typedef struct di_vocab di_vocab;

// One node of a byte trie over added-token contents (first-child / next-sibling form).
typedef struct di_vocab_trie_node {
    int32_t child;   // first child node index, -1 if none
    int32_t sibling; // next sibling, -1 if none
    int32_t token;   // id of the added token ending here, -1 if none
    uint8_t byte;    // edge label from the parent
} di_vocab_trie_node;

typedef struct di_vocab_trie {
    di_vocab_trie_node *nodes; // owned; nodes[0] is the root
    int32_t n_nodes;
    int32_t cap;
    bool first_byte[256]; // bytes that can start a match (fast skip)
} di_vocab_trie;

struct di_vocab {
    int32_t n_vocab;    // highest id + 1
    int32_t n_model;    // tokens of the BPE model itself
    uint32_t *tok_off;  // owned [n_vocab + 1]: token i's decoded bytes are bytes[off[i], off[i+1])
    char *tok_bytes;    // owned
    uint8_t *tok_flags; // owned [n_vocab]: DI_VOCAB_FLAG_*
    int32_t byte_id[256]; // id of the token for each single byte
    size_t max_token_bytes;

    // merges: open addressing on (left << 32 | right) → (rank, merged id)
    uint64_t *merge_keys; // owned [merge_cap]; UINT64_MAX = empty slot
    int32_t *merge_rank;  // owned [merge_cap]
    int32_t *merge_id;    // owned [merge_cap]
    size_t merge_cap;     // power of two
    int32_t n_merges;

    // exact token lookup: bytes → id over every token (model and added)
    int32_t *tok_hash;   // owned [tok_hash_cap]; -1 = empty
    size_t tok_hash_cap; // power of two

    // Added tokens are split out of template text first by a leftmost-longest match over the
    // tokens marked normalized=false, then, in the gaps, over those marked normalized=true —
    // the two passes of HF tokenizers' AddedVocabulary (its normalizer here is empty).
    di_vocab_trie trie_raw;
    di_vocab_trie trie_norm;
    int32_t n_added;
};

enum {
    DI_VOCAB_FLAG_VALID = 1,   // the id exists
    DI_VOCAB_FLAG_ADDED = 2,   // an added token (never produced by BPE)
    DI_VOCAB_FLAG_SPECIAL = 4, // an added token with special=true
};

// Loads path (a tokenizer.json, or the same gzip-compressed; detected by magic bytes).
// DI_ERR_IO (cannot read), DI_ERR_FORMAT (not a byte-level BPE tokenizer.json, or inconsistent),
// DI_ERR_NOMEM. *out is freed with di_vocab_destroy.
di_status di_vocab_load(const char *path, di_vocab **out);
// Same from bytes in memory (JSON text, or gzip of it).
di_status di_vocab_load_mem(const void *data, size_t n_bytes, di_vocab **out);
void di_vocab_destroy(di_vocab *v);

// Exact lookup of a token by its decoded bytes; -1 if no token has exactly these bytes.
int32_t di_vocab_find(const di_vocab *v, const char *bytes, size_t n);

static inline bool di_vocab_valid(const di_vocab *v, int32_t id) {
    return id >= 0 && id < v->n_vocab && (v->tok_flags[id] & DI_VOCAB_FLAG_VALID);
}

// Longest added token starting at text[pos] in trie t; returns its id and writes its length, or
// -1 if none starts there.
int32_t di_vocab_trie_match(const di_vocab_trie *t, const char *text, size_t n, size_t pos,
                            size_t *len);

// Merge of adjacent tokens (a, b): writes rank and merged id and returns true, or false if none.
static inline bool di_vocab_merge(const di_vocab *v, int32_t a, int32_t b, int32_t *rank,
                                  int32_t *id) {
    uint64_t key = ((uint64_t)(uint32_t)a << 32) | (uint32_t)b;
    size_t mask = v->merge_cap - 1;
    size_t h = (size_t)((key * 0x9E3779B97F4A7C15ull) >> 20) & mask;
    for (;;) {
        uint64_t k = v->merge_keys[h];
        if (k == key) {
            *rank = v->merge_rank[h];
            *id = v->merge_id[h];
            return true;
        }
        if (k == UINT64_MAX) return false;
        h = (h + 1) & mask;
    }
}

// Reads a whole file, transparently gunzipping it. *data is freed with di_free.
di_status di_vocab_read_file(const char *path, char **data, size_t *n_bytes);
