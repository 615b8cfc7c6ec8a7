/*
 * grammar — structured output: a compiled context-free grammar over bytes (di_grammar), the
 * per-request recognizer that advances over generated tokens and computes allowed-token masks
 * (di_grammar_matcher), and the per-tokenizer byte trie the masks walk (di_grammar_vocab).
 *
 * Every front end produces EBNF text that grammar.c compiles: json_schema.c (JSON Schema → EBNF),
 * regex.c (ECMAScript regex → EBNF). The compiled form is purely byte-level: a character class
 * over code points becomes a rule whose alternatives are UTF-8 byte-range sequences, so a token
 * that ends in the middle of a multi-byte character is matched byte by byte and the rest of the
 * character is required from the next token (DeepSeek's tokenizer is byte-level BPE).
 *
 * Compiled form: rules, each a list of alternatives; an alternative is a run of elements in the
 * flat `elems` array ending with an END element. An element matches one byte out of a 256-bit set
 * (BYTES), refers to a rule (RULE), or matches one token id as a unit (TOKEN: EBNF `<[id]>`, how
 * a grammar names a special token such as DSML's `｜DSML｜`; bytes never match it, it never
 * matches bytes). Repetition and groups become generated rules (right
 * recursion for `*`, a chain of optional rules for `{m,n}`); left recursion is refused at compile
 * time, so expanding a rule always terminates.
 *
 * Owns: a di_grammar owns all its arrays and its token-set cache (matcher.c: the tokens accepted,
 * rejected or context-dependent at each grammar position, filled lazily by the masks of its
 * matchers). The grammar itself is immutable after compile; the token-set cache is behind a mutex.
 * Thread-safety: any thread (grammar, vocab); one matcher per request, used by one thread at a
 * time; matchers of one grammar may run on different threads at once.
 */
#pragma once

#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "base/buf.h"  // di_buf
#include "base/json.h" // json_t
#include "deepinfer.h"

enum {
    DI_GRAMMAR_ELEM_END = 0,   // end of an alternative
    DI_GRAMMAR_ELEM_BYTES = 1, // one byte out of sets[val]
    DI_GRAMMAR_ELEM_RULE = 2,  // rule val
    DI_GRAMMAR_ELEM_TOKEN = 3, // the one token id val, as a unit (EBNF `<[id]>`: special tokens)
};

// Limits of the compiler (refused with a clear message beyond them).
#define DI_GRAMMAR_MAX_ELEMS (1 << 22)  // elements of the compiled grammar
#define DI_GRAMMAR_MAX_RULES (1 << 20)  // rules, generated ones included
#define DI_GRAMMAR_MAX_REPEAT 100000    // m and n of {m,n}
#define DI_GRAMMAR_MAX_TEXT (16u << 20) // bytes of grammar text

// Token sets per grammar position, shared by every matcher of one grammar (matcher.c).
typedef struct di_grammar_tsets di_grammar_tsets;

typedef struct di_grammar_elem {
    uint32_t type; // DI_GRAMMAR_ELEM_*
    int32_t val;   // set index (BYTES), rule id (RULE), token id (TOKEN)
} di_grammar_elem;

struct di_grammar {
    atomic_int refs; // di_grammar_destroy drops one; matchers of requests hold one each
    int32_t n_rules;
    char **rule_names;      // owned [n_rules] (owned strings)
    int32_t *alt_off;       // owned [n_rules + 1]: rule r's alternatives are alts[alt_off[r]..)
    int32_t *alts;          // owned [n_alts]: start position in elems of each alternative
    di_grammar_elem *elems; // owned [n_elems]
    int32_t n_elems, n_alts;
    uint64_t (*sets)[4]; // owned [n_sets]: 256-bit byte sets
    int32_t n_sets;
    int32_t root;
    di_grammar_tsets *tsets; // owned: created with the grammar, filled by masks (any thread)
    char *key;               // owned: the key it is cached under (grammar_cache.c), or NULL
    size_t n_key;
};

static inline bool di_grammar_set_has(const uint64_t *set, uint8_t b) {
    return (set[b >> 6] >> (b & 63)) & 1;
}

// Takes a reference (released by di_grammar_destroy): the engine keeps a request's grammar alive
// after the caller destroyed its own. Any thread.
const di_grammar *di_grammar_retain(const di_grammar *g);

// Compiles EBNF text (grammar.c). Errors: DI_ERR_INVALID with "line:col: message" in err.
di_status di_grammar_compile_ebnf(const char *text, size_t n, di_grammar **out, char *err,
                                  size_t err_size);

// The cached grammar compiled from this EBNF text, or compiles and caches it (grammar_cache.c):
// where di_grammar_cache_compile and _compile_tools send their generated text.
di_status di_grammar_cache_ebnf(di_grammar_cache *c, const char *text, size_t n, di_grammar **out,
                                char *err, size_t err_size);

// JSON Schema (json_schema.c) and regex (regex.c) → EBNF text appended to out. The regex form
// defines rule `prefix` (and helpers named prefix_*); json_mode: each matched character is
// written as it appears inside a JSON string (quote, backslash and controls escaped). anchored:
// the whole text must match (false: search semantics, `.*` around an unanchored pattern).
// DI_ERR_INVALID with a message in err.
di_status di_grammar_regex_to_ebnf(const char *re, size_t n, const char *prefix, bool json_mode,
                                   di_buf *out, char *err, size_t err_size);
di_status di_grammar_schema_to_ebnf(const char *schema, size_t n, bool strict, di_buf *out,
                                    char *err, size_t err_size);
// Several JSON Schemas into one grammar text: JSON's shared rules once, then each item's rules
// (names unique across the items); items[i].name receives the rule that matches item i. The rules
// never define `root`. DI_ERR_INVALID with "JSON Schema at '#ptr': ..." in err.
typedef struct di_grammar_schema_item {
    const json_t *root;   // borrowed: the document the item's $refs resolve in
    const json_t *schema; // borrowed: the (sub)schema to convert
    const char *ptr;      // its JSON pointer in root, for messages ("" for root)
    bool strict;          // DI_GRAMMAR_FLAG_STRICT for this item
    char name[32];        // out
} di_grammar_schema_item;
di_status di_grammar_schemas_to_ebnf(di_grammar_schema_item *items, size_t n, di_buf *out,
                                     char *err, size_t err_size);
// The grammar of any JSON object (response_format json_object).
const char *di_grammar_json_object_ebnf(void);

// Appends s as an EBNF string literal ("..." with escapes).
di_status di_grammar_put_literal(di_buf *out, const char *s, size_t n);

// ---- matcher (matcher.c) ----

// The token-set cache of a grammar: created empty by the compiler (DI_ERR_NOMEM), destroyed with
// the grammar.
di_status di_grammar_tsets_create(di_grammar_tsets **out);
void di_grammar_tsets_destroy(di_grammar_tsets *t);

typedef struct di_grammar_tsets_stats {
    int32_t n_positions; // positions whose token sets are cached
    int64_t n_ctx;       // context-dependent tokens over those positions
    size_t bytes;        // memory held by its entries (the reserve beyond is address space)
    double compute_us;   // time spent computing them (all threads)
    int64_t n_fallbacks; // masks computed by the exact walk (sets unavailable or a limit)
} di_grammar_tsets_stats;
// A snapshot of g's token-set cache (benchmarks, tests). Any thread.
void di_grammar_tsets_get_stats(const di_grammar *g, di_grammar_tsets_stats *out);

typedef struct di_grammar_matcher di_grammar_matcher;

typedef struct di_grammar_matcher_limits {
    int32_t max_stacks; // stacks alive at once (one per way the text so far can be parsed)
    int32_t max_depth;  // rule nesting of one stack
    int32_t max_nodes;  // stack nodes (committed state plus a mask walk's scratch)
    int32_t n_cache;    // masks memoised by stack set (0: none)
    // Masks from the grammar's token sets per position (true, the default) or by the exact walk of
    // the whole vocabulary trie (false: a debug switch; both give the same masks, tests compare).
    bool token_sets;
} di_grammar_matcher_limits;

di_grammar_matcher_limits di_grammar_matcher_limits_default(void);

// Creates a matcher at the start of g. vocab (borrowed, may be NULL: no masks) and g must outlive
// it. Allocates everything the matcher will need (advance and mask allocate nothing).
// DI_ERR_NOMEM; DI_ERR_UNSUPPORTED when the start state already exceeds the limits.
di_status di_grammar_matcher_create(const di_grammar *g, const di_grammar_vocab *vocab,
                                    const di_grammar_matcher_limits *lim, di_grammar_matcher **out);
void di_grammar_matcher_destroy(di_grammar_matcher *m);
// Copies src's state into dst (same grammar, vocab and limits). No allocation.
void di_grammar_matcher_copy(di_grammar_matcher *dst, const di_grammar_matcher *src);

// Advances by n bytes: true if the grammar accepts them (the state moves), false if not (the
// state is unchanged). A limit exceeded also returns false and sets the error status.
bool di_grammar_matcher_advance(di_grammar_matcher *m, const void *bytes, size_t n);
// Advances by token id: by its bytes (vocab required) and, where a token terminal `<[id]>` for
// it can come next, by that terminal (the union of both). A special token (no bytes in the
// vocab) advances only through a token terminal.
bool di_grammar_matcher_advance_token(di_grammar_matcher *m, int32_t token);
// The text so far is a complete sentence of the grammar.
bool di_grammar_matcher_can_end(const di_grammar_matcher *m);
// Complete, and nothing more can follow.
bool di_grammar_matcher_is_done(const di_grammar_matcher *m);
// DI_OK, or DI_ERR_UNSUPPORTED once a limit was exceeded (the matcher is then unusable).
di_status di_grammar_matcher_status(const di_grammar_matcher *m);
// Writes the allowed-token bitset (bit i of mask[i / 64]) over the vocabulary: the tokens whose
// bytes the grammar accepts next, and the tokens of the token terminals that can come next.
// Other special tokens are never set (the caller allows EOS when can_end). *n_allowed gets the
// count. Computed from the grammar's token sets per position (computing the missing ones, for
// every matcher of the grammar), or by the exact walk of the trie: the same mask either way.
// DI_ERR_UNSUPPORTED (a limit exceeded; mask undefined).
di_status di_grammar_matcher_mask(di_grammar_matcher *m, uint64_t *mask, int32_t *n_allowed);
// Stacks in the current state (tests, benchmarks).
int32_t di_grammar_matcher_n_stacks(const di_grammar_matcher *m);

// ---- vocabulary trie (matcher.c) ----

// Number of tokens and the bytes of token id in the vocab (NULL for special/absent tokens).
int32_t di_grammar_vocab_n_tokens(const di_grammar_vocab *v);
const uint8_t *di_grammar_vocab_token(const di_grammar_vocab *v, int32_t id, size_t *n);
