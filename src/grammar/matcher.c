// matcher — the per-request recognizer of a compiled grammar and the allowed-token masks; the
// vocabulary trie those masks walk (see grammar.h).
//
// Why a pushdown recognizer over stack sets (and not Earley): the grammars here are written for
// generation (JSON Schema, regex, hand-written EBNF without left recursion) and are close to
// deterministic, so the set of live stacks stays tiny (1-3 in JSON), every step is a handful of
// byte-set tests, and the state is a few integers — cheap to copy, hash (for the mask cache) and
// bound. Earley items would need a chart per byte and general completion; left recursion, the one
// thing Earley handles and this does not, is refused by the compiler with a clear message.
//
// State: a set of stacks. A stack is a chain of nodes (pos, parent) in an arena; pos is the next
// element to match, parents are return positions. Stacks are normalised so that every top is a
// BYTES element (rule references are expanded into their alternatives; a stack that runs out is
// the "accepting" flag). Advancing by a byte keeps the stacks whose top set holds it, steps them
// and normalises again; tails are shared, duplicates are dropped by a 64-bit hash of the whole
// chain (verified node by node).
//
// Memory: create allocates the arena (max_nodes nodes, twice: committed state and compaction
// target), the level table, the dedupe table and the mask cache. advance and mask only bump and
// reset indices: no allocation. The mask walk descends the vocabulary trie depth first, one level
// of stacks per byte, pruning every subtree whose byte no live stack accepts; it allocates its
// nodes above the committed ones and drops them on the way back up. After an advance the live
// nodes are compacted into the second arena, so the committed state never grows beyond what is
// reachable. Any bound exceeded (stacks per level, depth, nodes, expansion work) sets the error
// status DI_ERR_UNSUPPORTED: the caller ends the request; nothing crashes or allocates.
//
// Token sets per position (the idea of xgrammar's adaptive token mask cache). Inside a JSON string
// ~126,000 tokens are allowed and a cold walk of the trie costs milliseconds; yet almost all of
// that answer depends only on the top few nodes of a stack, not on what lies below. A *position*
// is the chain of positions of a stack's top DI_TSET_K nodes (the whole stack if shorter). Walking
// the trie from that chain alone, over a bottom that means "the frame returned" (the accept flag of
// a level), splits the vocabulary into tokens *accepted* (their bytes end with the frame's stacks
// still alive, or exactly where it returns: whatever lies below, the real stack accepts them too),
// *rejected* (they die inside the frame without it having returned before: the stack below is never
// consulted) and *context-dependent* (the frame returned before their last byte, and the bytes
// after that belong to the stack below). The mask of a stack set is the OR over its stacks of
// accepted(position) and of the context-dependent tokens that the exact walk accepts from that one
// stack (checked in trie order, sharing prefixes: a few thousand short walks at most, most of them
// hitting the level's loop set). The sets live in the grammar (di_grammar_tsets), computed once per
// (grammar, position) by whichever matcher needs them first and shared by all matchers of that
// grammar on any thread (a mutex; entries are immutable once published). Their storage is reserved
// when a matcher is created, so masks still allocate nothing: a position that does not fit, a limit
// hit while computing or checking, or a matcher over another vocabulary takes the exact walk.
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "base/log.h"
#include "base/mem.h"
#include "grammar/grammar.h"
#include "tok/tokenizer.h" // di_tokenizer_vocab
#include "tok/vocab.h"     // DI_VOCAB_FLAG_*

// ---- vocabulary trie ----

#define DI_TRIE_SUB_MIN 8 // subtrees this large keep their byte set (the mask's bulk marking)

struct di_grammar_vocab {
    int32_t n_vocab;
    uint32_t *tok_off;  // owned [n_vocab + 1]: token i's bytes are bytes[off[i], off[i+1])
    uint8_t *tok_bytes; // owned
    uint8_t *tok_ok;    // owned [n_vocab]: 1 if the grammar may allow the token
    // Trie in preorder: node 0 is the root (no byte); node x's children are x+1, then
    // end[child] after each child, up to end[x].
    int32_t n_nodes;
    uint8_t *byte;   // owned [n_nodes]: the byte on the edge into the node
    int32_t *end;    // owned [n_nodes]: one past the node's subtree
    int32_t *at_off; // owned [n_nodes + 1]: tokens whose bytes end at the node: at[at_off[x]..)
    int32_t *at;     // owned
    int32_t max_len; // longest token in bytes
    // Bytes on the edges below node x (its subtree minus x's own edge), for nodes whose subtree
    // holds at least DI_TRIE_SUB_MIN nodes: sub[sub_idx[x]], sub_idx -1 for the others.
    int32_t *sub_idx;   // owned [n_nodes]
    uint64_t (*sub)[4]; // owned [n_sub]
    uint64_t id;        // hash of the token bytes: the identity token sets are computed over
};

void di_grammar_vocab_destroy(di_grammar_vocab *v) {
    if (!v) return;
    di_free(v->tok_off);
    di_free(v->tok_bytes);
    di_free(v->tok_ok);
    di_free(v->byte);
    di_free(v->end);
    di_free(v->at_off);
    di_free(v->at);
    di_free(v->sub_idx);
    di_free(v->sub);
    di_free(v);
}

static inline uint64_t mix(uint64_t z) {
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

// Of every token's bytes (lengths and usability included): two vocabularies with equal hashes
// give the same token sets.
static uint64_t vocab_hash(const di_grammar_vocab *v) {
    uint64_t h = mix((uint64_t)v->n_vocab + 1);
    for (int32_t i = 0; i < v->n_vocab; i++)
        h = mix(h ^ ((uint64_t)(v->tok_off[i + 1] - v->tok_off[i]) << 1 | v->tok_ok[i]));
    const uint32_t n = v->tok_off[v->n_vocab];
    uint32_t i = 0;
    for (; i + 8 <= n; i += 8) {
        uint64_t w;
        memcpy(&w, v->tok_bytes + i, 8);
        h = mix(h + w);
    }
    for (; i < n; i++) h = mix(h + v->tok_bytes[i]);
    return h | 1; // never 0 (an unbound token-set cache)
}

static int cmp_tok(const void *a, const void *b, void *ctx) {
    const di_grammar_vocab *v = ctx;
    int32_t x = *(const int32_t *)a, y = *(const int32_t *)b;
    uint32_t nx = v->tok_off[x + 1] - v->tok_off[x], ny = v->tok_off[y + 1] - v->tok_off[y];
    int c = memcmp(v->tok_bytes + v->tok_off[x], v->tok_bytes + v->tok_off[y], nx < ny ? nx : ny);
    if (c) return c;
    if (nx != ny) return nx < ny ? -1 : 1;
    return x < y ? -1 : x > y;
}

di_status di_grammar_vocab_create(const di_tokenizer *tok, di_grammar_vocab **out) {
    const di_vocab *tv = di_tokenizer_vocab(tok);
    const int32_t V = tv->n_vocab;
    di_grammar_vocab *v = di_calloc(1, sizeof *v);
    int32_t *order = di_malloc(sizeof(int32_t) * (size_t)V);
    if (!v || !order) goto nomem;
    v->n_vocab = V;
    v->tok_off = di_malloc(sizeof(uint32_t) * ((size_t)V + 1));
    v->tok_ok = di_calloc((size_t)V, 1);
    size_t total = 0;
    for (int32_t i = 0; i < V; i++)
        if (di_vocab_valid(tv, i) && !(tv->tok_flags[i] & DI_VOCAB_FLAG_ADDED))
            total += tv->tok_off[i + 1] - tv->tok_off[i];
    v->tok_bytes = di_malloc(total + 1);
    if (!v->tok_off || !v->tok_ok || !v->tok_bytes) goto nomem;
    int32_t n_ok = 0;
    uint32_t off = 0;
    for (int32_t i = 0; i < V; i++) {
        v->tok_off[i] = off;
        if (!di_vocab_valid(tv, i) || (tv->tok_flags[i] & DI_VOCAB_FLAG_ADDED)) continue;
        uint32_t n = tv->tok_off[i + 1] - tv->tok_off[i];
        if (n == 0) continue;
        memcpy(v->tok_bytes + off, tv->tok_bytes + tv->tok_off[i], n);
        off += n;
        v->tok_ok[i] = 1;
        order[n_ok++] = i;
        if ((int32_t)n > v->max_len) v->max_len = (int32_t)n;
    }
    v->tok_off[V] = off;
    v->id = vocab_hash(v);
    qsort_r(order, (size_t)n_ok, sizeof *order, cmp_tok, v);
    // Preorder trie from the sorted tokens: at most one node per byte plus the root.
    size_t cap = total + 1;
    v->byte = di_malloc(cap);
    v->end = di_malloc(sizeof(int32_t) * cap);
    v->at_off = di_malloc(sizeof(int32_t) * (cap + 1));
    v->at = di_malloc(sizeof(int32_t) * ((size_t)n_ok + 1));
    int32_t *path = di_malloc(sizeof(int32_t) * ((size_t)v->max_len + 2));
    if (!v->byte || !v->end || !v->at_off || !v->at || !path) {
        di_free(path);
        goto nomem;
    }
    int32_t nn = 1, depth = 0, n_at = 0;
    v->byte[0] = 0;
    path[0] = 0;
    v->at_off[0] = 0;
    // at_off is filled as nodes are created; tokens at a node are appended while it is the
    // deepest node (sorted order puts a token right after its prefix's path).
    const uint8_t *prev = NULL;
    uint32_t n_prev = 0;
    for (int32_t k = 0; k < n_ok; k++) {
        int32_t id = order[k];
        const uint8_t *b = v->tok_bytes + v->tok_off[id];
        uint32_t n = v->tok_off[id + 1] - v->tok_off[id];
        uint32_t common = 0;
        while (prev && common < n && common < n_prev && b[common] == prev[common]) common++;
        while (depth > (int32_t)common) v->end[path[depth--]] = nn;
        for (uint32_t j = common; j < n; j++) {
            v->byte[nn] = b[j];
            v->at_off[nn] = n_at;
            path[++depth] = nn++;
        }
        v->at[n_at++] = id;
        prev = b, n_prev = n;
    }
    while (depth > 0) v->end[path[depth--]] = nn;
    v->end[0] = nn;
    // at_off[x] was set when x was created (= tokens before it); tokens at x follow it directly,
    // before any child is created, so node x's tokens are at[at_off[x] .. at_off[x + 1]).
    v->at_off[nn] = n_at;
    v->n_nodes = nn;
    di_free(path);
    // Subtree byte sets, bottom-up (reverse preorder: children come after their parent).
    {
        uint64_t(*all)[4] = di_calloc((size_t)nn, sizeof *all);
        v->sub_idx = di_malloc(sizeof(int32_t) * (size_t)nn);
        if (!all || !v->sub_idx) {
            di_free(all);
            goto nomem;
        }
        int32_t n_sub = 0;
        for (int32_t x = nn - 1; x >= 0; x--) {
            for (int32_t ch = x + 1; ch < v->end[x]; ch = v->end[ch]) {
                for (int w = 0; w < 4; w++) all[x][w] |= all[ch][w];
                all[x][v->byte[ch] >> 6] |= 1ull << (v->byte[ch] & 63);
            }
            v->sub_idx[x] = v->end[x] - x >= DI_TRIE_SUB_MIN ? n_sub++ : -1;
        }
        v->sub = di_malloc(sizeof *v->sub * (size_t)(n_sub + 1));
        if (!v->sub) {
            di_free(all);
            goto nomem;
        }
        for (int32_t x = 0; x < nn; x++)
            if (v->sub_idx[x] >= 0) memcpy(v->sub[v->sub_idx[x]], all[x], sizeof all[x]);
        di_free(all);
    }
    di_free(order);
    *out = v;
    return DI_OK;
nomem:
    di_free(order);
    di_grammar_vocab_destroy(v);
    return DI_ERR_NOMEM;
}

int32_t di_grammar_vocab_n_tokens(const di_grammar_vocab *v) {
    return v->n_vocab;
}

const uint8_t *di_grammar_vocab_token(const di_grammar_vocab *v, int32_t id, size_t *n) {
    if (id < 0 || id >= v->n_vocab || !v->tok_ok[id]) return NULL;
    *n = v->tok_off[id + 1] - v->tok_off[id];
    return v->tok_bytes + v->tok_off[id];
}

// ---- token sets per position: the shared store ----

// A position is first the top DI_TSET_K nodes of a stack (header comment); one deeper while it
// leaves more than DI_TSET_CTX_DEEPEN tokens context-dependent (e.g. a bounded repetition inside
// a regex returns after a character or two: one node more holds what follows), up to
// DI_TSET_K_MAX nodes. Fewer nodes are shared by more stacks; more leave fewer tokens to check.
#define DI_TSET_K 3
#define DI_TSET_K_MAX 8
#define DI_TSET_CTX_DEEPEN 512
// Storage: a matcher's creation makes sure the newest chunk has at least half of `want` free,
// want = DI_TSET_RESERVE or what the store already holds, up to DI_TSET_RESERVE_MAX (a grammar
// whose requests met many positions will meet more). A fresh chunk is mostly address space (a
// block this large is mapped, or taken from the top of the heap: its pages are committed as
// entries are written), so what a grammar's sets cost is what they use (1.5 MB for a schema of
// ten formatted and length-bounded strings; a reused heap block may already be resident). A
// position is computed only with DI_TSET_ENTRY_MIN bytes free (a string position's entry is 16 KB
// plus its context-dependent list); without room the mask takes the exact walk.
#define DI_TSET_RESERVE ((size_t)8 << 20)
#define DI_TSET_RESERVE_MAX ((size_t)32 << 20)
#define DI_TSET_ENTRY_MIN ((size_t)64 << 10)
#define DI_TSET_MAX ((size_t)64 << 20) // entries per grammar; beyond, new positions take the walk
#define DI_TSET_SLOTS 256              // initial hash buckets

typedef struct tset { // one position's classes; immutable once published
    int32_t key[DI_TSET_K_MAX];
    int32_t n_key;
    uint64_t hash;
    int32_t n_acc, n_ctx;
    bool acc_bits;          // the accepted tokens as a bitset over the vocabulary (else a list)
    const uint64_t *bits;   // view into the store [words], acc_bits
    const int32_t *acc_ids; // view [n_acc], ascending, !acc_bits
    const int32_t *ctx;     // view [n_ctx]: context-dependent ids in trie preorder
    struct tset *next;      // the bucket's next entry
} tset;

typedef struct tchunk {
    struct tchunk *next;
    size_t size, used; // bytes of data[] and the part handed out
    _Alignas(8) uint8_t data[];
} tchunk;

struct di_grammar_tsets {
    pthread_mutex_t mu; // guards everything below
    uint64_t vocab_id;  // the vocabulary the sets are over (0: none yet, the first matcher binds)
    tset **slot;        // owned [cap]: hash buckets, chained (entries live in the chunks)
    int32_t cap, n;
    tchunk *chunks; // owned: newest first, entries are bump-allocated in the newest
    size_t used;    // bytes handed out to entries
    int64_t n_ctx, n_fallbacks;
    double compute_us;
};

di_status di_grammar_tsets_create(di_grammar_tsets **out) {
    di_grammar_tsets *t = di_calloc(1, sizeof *t);
    if (!t) return DI_ERR_NOMEM;
    if (pthread_mutex_init(&t->mu, NULL) != 0) {
        di_free(t);
        return DI_ERR_NOMEM;
    }
    *out = t;
    return DI_OK;
}

void di_grammar_tsets_destroy(di_grammar_tsets *t) {
    if (!t) return;
    for (tchunk *c = t->chunks, *nx; c; c = nx) nx = c->next, di_free(c);
    di_free(t->slot);
    pthread_mutex_destroy(&t->mu);
    di_free(t);
}

void di_grammar_tsets_get_stats(const di_grammar *g, di_grammar_tsets_stats *out) {
    di_grammar_tsets *t = g->tsets;
    pthread_mutex_lock(&t->mu);
    *out = (di_grammar_tsets_stats){.n_positions = t->n,
                                    .n_ctx = t->n_ctx,
                                    .bytes = t->used,
                                    .compute_us = t->compute_us,
                                    .n_fallbacks = t->n_fallbacks};
    pthread_mutex_unlock(&t->mu);
}

static uint64_t key_hash(const int32_t *key, int32_t n_key) {
    uint64_t h = 0x7f4a7c15u + (uint64_t)n_key;
    for (int32_t i = 0; i < n_key; i++) h = mix(h * 31 + (uint64_t)(uint32_t)key[i]);
    return h;
}

// The entry of key, or NULL. Caller holds the mutex.
static const tset *tsets_find(const di_grammar_tsets *t, const int32_t *key, int32_t n_key,
                              uint64_t h) {
    for (const tset *e = t->slot[h & (uint64_t)(t->cap - 1)]; e; e = e->next)
        if (e->hash == h && e->n_key == n_key && !memcmp(e->key, key, sizeof(int32_t) * n_key))
            return e;
    return NULL;
}

// Publishes e. Caller holds the mutex.
static void tsets_insert(di_grammar_tsets *t, tset *e) {
    tset **b = &t->slot[e->hash & (uint64_t)(t->cap - 1)];
    e->next = *b;
    *b = e;
    t->n++;
}

// Off the step path (matcher creation): binds the store to the vocabulary and makes room (hash
// slots, a chunk with DI_TSET_RESERVE free bytes) for the positions the coming masks will add.
// false: the store is bound to another vocabulary (that matcher takes the exact walk).
static bool tsets_reserve(di_grammar_tsets *t, uint64_t vocab_id) {
    pthread_mutex_lock(&t->mu);
    if (!t->vocab_id) t->vocab_id = vocab_id;
    const bool ok = t->vocab_id == vocab_id;
    if (ok && t->n >= t->cap) { // rehash at load 1 (chains stay correct if this fails)
        const int32_t cap = t->cap ? t->cap * 2 : DI_TSET_SLOTS;
        tset **slot = di_calloc((size_t)cap, sizeof *slot);
        if (slot) {
            tset **old = t->slot;
            const int32_t old_cap = t->cap;
            t->slot = slot, t->cap = cap, t->n = 0;
            for (int32_t i = 0; i < old_cap; i++)
                for (tset *e = old[i], *nx; e; e = nx) nx = e->next, tsets_insert(t, e);
            di_free(old);
        }
    }
    const size_t want = t->used < DI_TSET_RESERVE       ? DI_TSET_RESERVE
                        : t->used > DI_TSET_RESERVE_MAX ? DI_TSET_RESERVE_MAX
                                                        : t->used;
    if (ok && (!t->chunks || t->chunks->size - t->chunks->used < want / 2) &&
        t->used + want <= DI_TSET_MAX) {
        tchunk *c = di_malloc(sizeof *c + want);
        if (c) {
            *c = (tchunk){.next = t->chunks, .size = want};
            t->chunks = c;
        }
    }
    pthread_mutex_unlock(&t->mu);
    return ok && t->cap > 0;
}

// n bytes (8-aligned) of the newest chunk, or NULL when they do not fit. Caller holds the mutex.
static void *tsets_alloc(di_grammar_tsets *t, size_t n) {
    n = (n + 7) & ~(size_t)7;
    tchunk *c = t->chunks;
    if (!c || c->size - c->used < n) return NULL;
    void *p = c->data + c->used;
    c->used += n;
    t->used += n;
    return p;
}

// ---- matcher state ----

typedef struct gnode {
    int32_t pos;    // element to match next (a return position when not a top)
    int32_t parent; // node index, -1 = bottom
    int32_t depth;  // nodes in the chain
    int32_t origin; // compaction: the index this node was copied from
    uint64_t hash;  // of the whole chain
} gnode;

typedef struct trans { // a memoised transition of a mask walk
    uint64_t from, to; // level hashes
    uint32_t stamp;    // the walk it belongs to
    int32_t start, n;  // the target level's tops
    uint8_t byte;
    bool acc;
} trans;

typedef struct cache_entry {
    uint64_t key;
    int32_t n_allowed;
    bool valid;
} cache_entry;

struct di_grammar_matcher {
    const di_grammar *g;       // borrowed
    const di_grammar_vocab *v; // borrowed, may be NULL
    di_grammar_matcher_limits lim;
    gnode *nodes;   // owned [max_nodes]: committed [0, n_nodes), scratch above
    gnode *nodes2;  // owned [max_nodes]: compaction target
    int32_t *remap; // owned [max_nodes], -1 outside a compaction
    int32_t n_nodes, n_nodes_used;
    int32_t *tops; // owned [max_nodes]: committed tops [0, n_tops), level scratch above
    int32_t n_tops, n_tops_used;
    int32_t *tmp;  // owned [max_stacks]
    int32_t *path; // owned [max_depth + 1]
    bool accept;   // the committed state can end
    // Dedupe of the level being built: open addressing over (stamp, top).
    uint32_t *ht_stamp; // owned [ht_cap]
    int32_t *ht_top;    // owned [ht_cap]
    int32_t ht_cap;
    // Expansions of the level being built, keyed by (rule, continuation hash): a rule expanded
    // twice with the same continuation yields the same stacks (this also ends the cycles of
    // tail calls through nullable rules that the compiler lets through, e.g. (x?)*).
    uint32_t *ex_stamp; // owned [ex_cap]
    uint64_t *ex_key;   // owned [ex_cap]
    int32_t ex_cap;
    uint32_t stamp;
    int32_t lvl_start; // first top of the level being built
    bool lvl_accept;
    int64_t work; // expansions in the level being built
    di_status err;
    // Self-loop sets of the stack sets met by mask walks, by set hash (direct-mapped): the bytes
    // after which the set is the same again (inside a JSON string: almost every byte).
    uint64_t *loop_key;      // owned [n_loop]
    uint64_t (*loop_set)[8]; // owned [n_loop]: known bytes [0..4), looping bytes [4..8)
    int32_t n_loop;
    trans *trans; // owned [n_trans]: direct-mapped
    int32_t n_trans;
    uint32_t walk_stamp;
    bool caching;                    // the walk still memoises transitions
    int32_t floor_nodes, floor_tops; // below these, scratch holds memoised levels
    // Mask cache (by stack-set hash).
    cache_entry *cache;    // owned [n_cache]
    uint64_t *cache_masks; // owned [n_cache, words]
    int32_t cache_next, words;
    int64_t n_cache_hits, n_masks;
    // Token sets (see the header comment).
    di_grammar_tsets *ts; // borrowed (the grammar's); NULL: exact walks only
    uint64_t *ts_acc;     // owned [words]: a position's accepted tokens while it is computed
    uint64_t *ts_ctx;     // owned [words]: its context-dependent tokens
    const tset **ts_ent;  // owned [max_stacks]: the sets of the committed tops during a mask
    int32_t *dfs_start;   // owned [max_len + 2]: the context-dependent check's level per depth
    int32_t *dfs_n;       // owned [max_len + 2]
    int32_t *dfs_nodes;   // owned [max_len + 2]: arena marks after each level
    int32_t *dfs_tops;    // owned [max_len + 2]
    uint64_t *dfs_hash;   // owned [max_len + 2]
    bool *dfs_acc;        // owned [max_len + 2]
    bool quiet;           // a limit hit now falls back to the exact walk: no warning
};

di_grammar_matcher_limits di_grammar_matcher_limits_default(void) {
    di_grammar_matcher_limits l = {.max_stacks = 512,
                                   .max_depth = 512,
                                   .max_nodes = 1 << 14,
                                   .n_cache = 8,
                                   .token_sets = true};
    return l;
}

static void set_err(di_grammar_matcher *m, const char *what) {
    if (m->err == DI_OK && !m->quiet)
        DI_LOG_WARN("grammar: the matcher exceeded its %s limit; the request ends with an error",
                    what);
    m->err = DI_ERR_UNSUPPORTED;
}

static inline uint64_t chain_hash(const di_grammar_matcher *m, int32_t pos, int32_t parent) {
    uint64_t ph = parent < 0 ? 0x5bd1e995u : m->nodes[parent].hash;
    return mix(ph * 0x9e3779b97f4a7c15ull + (uint64_t)pos + 1);
}

static int32_t new_node(di_grammar_matcher *m, int32_t pos, int32_t parent, uint64_t h) {
    if (m->n_nodes_used >= m->lim.max_nodes) return set_err(m, "stack node"), -1;
    int32_t d = parent < 0 ? 1 : m->nodes[parent].depth + 1;
    if (d > m->lim.max_depth) return set_err(m, "nesting depth"), -1;
    int32_t i = m->n_nodes_used++;
    m->nodes[i] = (gnode){.pos = pos, .parent = parent, .depth = d, .hash = h};
    return i;
}

// Chain (pos, parent) equals node t's chain.
static bool chain_eq(const di_grammar_matcher *m, int32_t t, int32_t pos, int32_t parent) {
    if (m->nodes[t].pos != pos) return false;
    int32_t a = m->nodes[t].parent, b = parent;
    while (a != b) {
        if (a < 0 || b < 0 || m->nodes[a].pos != m->nodes[b].pos) return false;
        a = m->nodes[a].parent, b = m->nodes[b].parent;
    }
    return true;
}

// Adds the top (pos, parent) to the level being built unless present; existing >= 0 is a node
// that already holds exactly this chain.
static void add_top(di_grammar_matcher *m, int32_t pos, int32_t parent, int32_t existing) {
    uint64_t h = existing >= 0 ? m->nodes[existing].hash : chain_hash(m, pos, parent);
    uint32_t mask = (uint32_t)m->ht_cap - 1, k = (uint32_t)h & mask;
    for (;; k = (k + 1) & mask) {
        if (m->ht_stamp[k] != m->stamp) break;
        int32_t t = m->tops[m->ht_top[k]];
        if (m->nodes[t].hash == h && chain_eq(m, t, pos, parent)) return;
    }
    if (m->n_tops_used - m->lvl_start >= m->lim.max_stacks) {
        set_err(m, "stack count");
        return;
    }
    if (m->n_tops_used >= m->lim.max_nodes) {
        set_err(m, "stack node");
        return;
    }
    int32_t node = existing >= 0 ? existing : new_node(m, pos, parent, h);
    if (node < 0) return;
    m->ht_stamp[k] = m->stamp;
    m->ht_top[k] = m->n_tops_used;
    m->tops[m->n_tops_used++] = node;
}

static void place(di_grammar_matcher *m, int32_t pos, int32_t parent, int32_t existing);

// Expands rule r whose alternatives return to stack ret.
static void expand(di_grammar_matcher *m, int32_t r, int32_t ret) {
    const di_grammar *g = m->g;
    const uint64_t key =
        mix((ret < 0 ? 0x5bd1e995u : m->nodes[ret].hash) ^ ((uint64_t)r << 32 | 0x9e37u));
    uint32_t mask = (uint32_t)m->ex_cap - 1, k = (uint32_t)key & mask;
    for (; m->ex_stamp[k] == m->stamp; k = (k + 1) & mask)
        if (m->ex_key[k] == key) return; // already expanded with this continuation
    if (++m->work > (int64_t)m->lim.max_stacks * 4) {
        set_err(m, "expansion work");
        return;
    }
    m->ex_stamp[k] = m->stamp;
    m->ex_key[k] = key;
    for (int32_t a = g->alt_off[r]; a < g->alt_off[r + 1] && m->err == DI_OK; a++) {
        int32_t first = g->alts[a];
        if (g->elems[first].type == DI_GRAMMAR_ELEM_END) {
            // ε: return to ret
            if (ret < 0)
                m->lvl_accept = true;
            else
                place(m, m->nodes[ret].pos, m->nodes[ret].parent, ret);
        } else {
            place(m, first, ret, -1);
        }
    }
}

// Puts the stack (pos, parent) into the level, normalised (expanding a rule reference at pos).
static void place(di_grammar_matcher *m, int32_t pos, int32_t parent, int32_t existing) {
    const di_grammar_elem *e = &m->g->elems[pos];
    if (e->type == DI_GRAMMAR_ELEM_BYTES || e->type == DI_GRAMMAR_ELEM_TOKEN) {
        add_top(m, pos, parent, existing);
        return;
    }
    // A rule reference: its continuation (unless it is the last element: a tail call).
    int32_t ret = parent;
    if (m->g->elems[pos + 1].type != DI_GRAMMAR_ELEM_END) {
        ret = new_node(m, pos + 1, parent, chain_hash(m, pos + 1, parent));
        if (ret < 0) return;
    }
    expand(m, e->val, ret);
}

static void level_begin(di_grammar_matcher *m) {
    if (++m->stamp == 0) {
        memset(m->ht_stamp, 0, sizeof(uint32_t) * (size_t)m->ht_cap);
        memset(m->ex_stamp, 0, sizeof(uint32_t) * (size_t)m->ex_cap);
        m->stamp = 1;
    }
    m->lvl_start = m->n_tops_used;
    m->lvl_accept = false;
    m->work = 0;
}

// Puts the stacks that follow top t (its element matched) into the level being built.
static void step_past(di_grammar_matcher *m, int32_t t) {
    const di_grammar *g = m->g;
    int32_t q = m->nodes[t].pos + 1, parent = m->nodes[t].parent;
    if (g->elems[q].type != DI_GRAMMAR_ELEM_END)
        place(m, q, parent, -1);
    else if (parent < 0)
        m->lvl_accept = true;
    else
        place(m, m->nodes[parent].pos, m->nodes[parent].parent, parent);
}

// Builds the level after byte b from the tops in[0..n_in) (token terminals never match a byte).
static void step(di_grammar_matcher *m, const int32_t *in, int32_t n_in, uint8_t b) {
    const di_grammar *g = m->g;
    level_begin(m);
    for (int32_t i = 0; i < n_in && m->err == DI_OK; i++) {
        const di_grammar_elem *e = &g->elems[m->nodes[in[i]].pos];
        if (e->type != DI_GRAMMAR_ELEM_BYTES || !di_grammar_set_has(g->sets[e->val], b)) continue;
        step_past(m, in[i]);
    }
}

// Adds to the level being built the stacks after token terminal `token` from in[0..n_in).
static void step_token(di_grammar_matcher *m, const int32_t *in, int32_t n_in, int32_t token) {
    const di_grammar *g = m->g;
    for (int32_t i = 0; i < n_in && m->err == DI_OK; i++) {
        const di_grammar_elem *e = &g->elems[m->nodes[in[i]].pos];
        if (e->type == DI_GRAMMAR_ELEM_TOKEN && e->val == token) step_past(m, in[i]);
    }
}

// A committed top is the token terminal `token`.
static bool token_next(const di_grammar_matcher *m, int32_t token) {
    for (int32_t i = 0; i < m->n_tops; i++) {
        const di_grammar_elem *e = &m->g->elems[m->nodes[m->tops[i]].pos];
        if (e->type == DI_GRAMMAR_ELEM_TOKEN && e->val == token) return true;
    }
    return false;
}

// ---- create / copy ----

void di_grammar_matcher_destroy(di_grammar_matcher *m) {
    if (!m) return;
    di_free(m->nodes);
    di_free(m->nodes2);
    di_free(m->remap);
    di_free(m->tops);
    di_free(m->tmp);
    di_free(m->path);
    di_free(m->ht_stamp);
    di_free(m->ht_top);
    di_free(m->ex_stamp);
    di_free(m->ex_key);
    di_free(m->cache);
    di_free(m->cache_masks);
    di_free(m->trans);
    di_free(m->loop_key);
    di_free(m->loop_set);
    di_free(m->ts_acc);
    di_free(m->ts_ctx);
    di_free(m->ts_ent);
    di_free(m->dfs_start);
    di_free(m->dfs_n);
    di_free(m->dfs_nodes);
    di_free(m->dfs_tops);
    di_free(m->dfs_hash);
    di_free(m->dfs_acc);
    di_free(m);
}

// Makes the level just built the committed state: compacts its nodes into nodes2 and swaps.
static void commit(di_grammar_matcher *m) {
    const int32_t n = m->n_tops_used - m->lvl_start;
    memcpy(m->tmp, m->tops + m->lvl_start, sizeof(int32_t) * (size_t)n);
    int32_t nn = 0;
    for (int32_t i = 0; i < n; i++) {
        // Copy the chain's uncopied part bottom-up (parents before children).
        int32_t t = m->tmp[i], d = 0;
        for (int32_t x = t; x >= 0 && m->remap[x] < 0; x = m->nodes[x].parent) m->path[d++] = x;
        while (d > 0) {
            int32_t x = m->path[--d], p = m->nodes[x].parent;
            gnode c = m->nodes[x];
            c.parent = p < 0 ? -1 : m->remap[p];
            c.origin = x;
            m->nodes2[nn] = c;
            m->remap[x] = nn++;
        }
        m->tmp[i] = m->remap[t];
    }
    for (int32_t j = 0; j < nn; j++) m->remap[m->nodes2[j].origin] = -1;
    gnode *sw = m->nodes;
    m->nodes = m->nodes2;
    m->nodes2 = sw;
    m->n_nodes = m->n_nodes_used = nn;
    memcpy(m->tops, m->tmp, sizeof(int32_t) * (size_t)n);
    m->n_tops = m->n_tops_used = n;
    m->accept = m->lvl_accept;
}

di_status di_grammar_matcher_create(const di_grammar *g, const di_grammar_vocab *vocab,
                                    const di_grammar_matcher_limits *lim,
                                    di_grammar_matcher **out) {
    di_grammar_matcher *m = di_calloc(1, sizeof *m);
    if (!m) return DI_ERR_NOMEM;
    m->g = g;
    m->v = vocab;
    m->lim = lim ? *lim : di_grammar_matcher_limits_default();
    if (m->lim.max_stacks < 1) m->lim.max_stacks = 1;
    if (m->lim.max_nodes < 64) m->lim.max_nodes = 64;
    if (m->lim.n_cache < 0) m->lim.n_cache = 0;
    const size_t N = (size_t)m->lim.max_nodes;
    m->nodes = di_malloc(sizeof(gnode) * N);
    m->nodes2 = di_malloc(sizeof(gnode) * N);
    m->remap = di_malloc(sizeof(int32_t) * N);
    m->tops = di_malloc(sizeof(int32_t) * N);
    if (m->lim.max_depth < 1) m->lim.max_depth = 1;
    m->tmp = di_malloc(sizeof(int32_t) * (size_t)m->lim.max_stacks);
    m->path = di_malloc(sizeof(int32_t) * ((size_t)m->lim.max_depth + 1));
    m->ht_cap = 16;
    while (m->ht_cap < 2 * m->lim.max_stacks) m->ht_cap *= 2;
    m->ht_stamp = di_calloc((size_t)m->ht_cap, sizeof(uint32_t));
    m->ht_top = di_malloc(sizeof(int32_t) * (size_t)m->ht_cap);
    m->ex_cap = 2 * m->ht_cap * 4; // > 2x the work limit (max_stacks * 4 expansions per level)
    m->ex_stamp = di_calloc((size_t)m->ex_cap, sizeof(uint32_t));
    m->ex_key = di_malloc(sizeof(uint64_t) * (size_t)m->ex_cap);
    m->n_loop = 64;
    m->loop_key = di_calloc((size_t)m->n_loop, sizeof *m->loop_key);
    m->loop_set = di_calloc((size_t)m->n_loop, sizeof *m->loop_set);
    m->n_trans = 4096;
    m->trans = di_calloc((size_t)m->n_trans, sizeof *m->trans);
    if (!m->loop_key || !m->loop_set || !m->trans) goto nomem;
    if (vocab) {
        m->words = (vocab->n_vocab + 63) / 64;
        const size_t nd = (size_t)vocab->max_len + 2;
        m->ts_acc = di_malloc(sizeof(uint64_t) * (size_t)m->words);
        m->ts_ctx = di_malloc(sizeof(uint64_t) * (size_t)m->words);
        m->ts_ent = di_malloc(sizeof *m->ts_ent * (size_t)m->lim.max_stacks);
        m->dfs_start = di_malloc(sizeof(int32_t) * nd);
        m->dfs_n = di_malloc(sizeof(int32_t) * nd);
        m->dfs_nodes = di_malloc(sizeof(int32_t) * nd);
        m->dfs_tops = di_malloc(sizeof(int32_t) * nd);
        m->dfs_hash = di_malloc(sizeof(uint64_t) * nd);
        m->dfs_acc = di_malloc(sizeof(bool) * nd);
        if (!m->ts_acc || !m->ts_ctx || !m->ts_ent || !m->dfs_start || !m->dfs_n || !m->dfs_nodes ||
            !m->dfs_tops || !m->dfs_hash || !m->dfs_acc)
            goto nomem;
        if (m->lim.token_sets && g->tsets && tsets_reserve(g->tsets, vocab->id)) m->ts = g->tsets;
    }
    if (vocab && m->lim.n_cache > 0) {
        m->cache = di_calloc((size_t)m->lim.n_cache, sizeof *m->cache);
        m->cache_masks = di_malloc(sizeof(uint64_t) * (size_t)m->words * (size_t)m->lim.n_cache);
        if (!m->cache || !m->cache_masks) goto nomem;
    }
    if (!m->nodes || !m->nodes2 || !m->remap || !m->tops || !m->tmp || !m->path || !m->ht_stamp ||
        !m->ht_top)
        goto nomem;
    memset(m->remap, 0xff, sizeof(int32_t) * N);
    level_begin(m);
    expand(m, g->root, -1);
    if (m->err != DI_OK) {
        di_grammar_matcher_destroy(m);
        return DI_ERR_UNSUPPORTED;
    }
    commit(m);
    *out = m;
    return DI_OK;
nomem:
    di_grammar_matcher_destroy(m);
    return DI_ERR_NOMEM;
}

void di_grammar_matcher_copy(di_grammar_matcher *dst, const di_grammar_matcher *src) {
    DI_ASSERT(dst->g == src->g && dst->lim.max_nodes == src->lim.max_nodes &&
              dst->lim.max_stacks == src->lim.max_stacks);
    memcpy(dst->nodes, src->nodes, sizeof(gnode) * (size_t)src->n_nodes);
    memcpy(dst->tops, src->tops, sizeof(int32_t) * (size_t)src->n_tops);
    dst->n_nodes = dst->n_nodes_used = src->n_nodes;
    dst->n_tops = dst->n_tops_used = src->n_tops;
    dst->accept = src->accept;
    dst->err = src->err;
}

// ---- advance ----

bool di_grammar_matcher_advance(di_grammar_matcher *m, const void *bytes, size_t n) {
    if (m->err != DI_OK) return false;
    const uint8_t *b = bytes;
    int32_t in_start = 0, n_in = m->n_tops;
    bool acc = m->accept;
    for (size_t i = 0; i < n; i++) {
        step(m, m->tops + in_start, n_in, b[i]);
        in_start = m->lvl_start;
        n_in = m->n_tops_used - m->lvl_start;
        acc = m->lvl_accept;
        if (m->err != DI_OK || (n_in == 0 && (!acc || i + 1 < n))) {
            m->n_nodes_used = m->n_nodes;
            m->n_tops_used = m->n_tops;
            return false;
        }
    }
    if (n == 0) return true;
    (void)acc;
    commit(m);
    return true;
}

bool di_grammar_matcher_advance_token(di_grammar_matcher *m, int32_t token) {
    size_t n = 0;
    const uint8_t *b = m->v ? di_grammar_vocab_token(m->v, token, &n) : NULL;
    if (m->err != DI_OK) return false;
    if (!token_next(m, token)) return b && di_grammar_matcher_advance(m, b, n);
    // By the token terminal, and (an ordinary token) by its bytes too: the union of both.
    int32_t s_b = 0, n_b = 0;
    bool acc_b = false;
    if (b) {
        int32_t in_start = 0, n_in = m->n_tops;
        for (size_t i = 0; i < n && m->err == DI_OK; i++) {
            step(m, m->tops + in_start, n_in, b[i]);
            in_start = m->lvl_start, n_in = m->n_tops_used - m->lvl_start;
            acc_b = m->lvl_accept;
            if (n_in == 0 && !acc_b) break;
        }
        s_b = in_start, n_b = n_in;
    }
    if (m->err == DI_OK) {
        level_begin(m);
        for (int32_t i = 0; i < n_b && m->err == DI_OK; i++) {
            const int32_t t = m->tops[s_b + i];
            add_top(m, m->nodes[t].pos, m->nodes[t].parent, t);
        }
        m->lvl_accept = acc_b;
        step_token(m, m->tops, m->n_tops, token);
    }
    if (m->err != DI_OK || (m->n_tops_used == m->lvl_start && !m->lvl_accept)) {
        m->n_nodes_used = m->n_nodes;
        m->n_tops_used = m->n_tops;
        return false;
    }
    commit(m);
    return true;
}

bool di_grammar_matcher_can_end(const di_grammar_matcher *m) {
    return m->err == DI_OK && m->accept;
}

bool di_grammar_matcher_is_done(const di_grammar_matcher *m) {
    return m->err == DI_OK && m->accept && m->n_tops == 0;
}

di_status di_grammar_matcher_status(const di_grammar_matcher *m) {
    return m->err;
}

int32_t di_grammar_matcher_n_stacks(const di_grammar_matcher *m) {
    return m->n_tops + (m->accept ? 1 : 0);
}

// ---- masks ----

typedef struct walk {
    di_grammar_matcher *m;
    const di_grammar_vocab *v;
    uint64_t *mask; // the allowed tokens (classify: the accepted ones)
    uint64_t *ctx;  // classify: the context-dependent ones
    bool classify;  // a position's walk (the bottom means "the frame returned")
    int32_t n_allowed;
} walk;

// Hash of the level tops[start..start+n) with its accept flag (order-independent: a set).
static uint64_t level_hash(const di_grammar_matcher *m, int32_t start, int32_t n, bool acc) {
    uint64_t key = acc ? 0x2545F4914F6CDD1Dull : 0x73;
    for (int32_t i = 0; i < n; i++) key += mix(m->nodes[m->tops[start + i]].hash);
    return key;
}

static void mark_range(walk *w, int32_t lo, int32_t hi) {
    for (int32_t k = lo; k < hi; k++) {
        int32_t id = w->v->at[k];
        w->mask[id >> 6] |= 1ull << (id & 63);
    }
    w->n_allowed += hi - lo;
}

// Classify: the tokens at[lo..hi) are context-dependent.
static void mark_ctx(walk *w, int32_t lo, int32_t hi) {
    for (int32_t k = lo; k < hi; k++) {
        int32_t id = w->v->at[k];
        w->ctx[id >> 6] |= 1ull << (id & 63);
    }
}

// The cache slot of level hash h: its known and loop sets (a byte b with known and loop bits set
// leads back to the same level).
static uint64_t *loop_slot(di_grammar_matcher *m, uint64_t h) {
    const int32_t slot = (int32_t)(h % (uint64_t)m->n_loop);
    uint64_t *e = m->loop_set[slot];
    if (m->loop_key[slot] != h) {
        m->loop_key[slot] = h;
        memset(e, 0, sizeof(uint64_t) * 8);
    }
    return e; // [0..4): known, [4..8): loop
}

// The level reached from level hash h by byte b in this walk, if known.
static bool trans_get(const di_grammar_matcher *m, uint64_t h, uint8_t b, int32_t *s2, int32_t *n2,
                      bool *acc2, uint64_t *h2) {
    const uint32_t k = (uint32_t)(mix(h + b) & (uint64_t)(m->n_trans - 1));
    const trans *t = &m->trans[k];
    if (t->stamp != m->walk_stamp || t->from != h || t->byte != b) return false;
    *s2 = t->start, *n2 = t->n, *acc2 = t->acc, *h2 = t->to;
    return true;
}

static void trans_put(di_grammar_matcher *m, uint64_t h, uint8_t b, int32_t s2, int32_t n2,
                      bool acc2, uint64_t h2) {
    const uint32_t k = (uint32_t)(mix(h + b) & (uint64_t)(m->n_trans - 1));
    m->trans[k] = (trans){
        .from = h, .to = h2, .stamp = m->walk_stamp, .start = s2, .n = n2, .byte = b, .acc = acc2};
}

// Marks the tokens below trie node x, reached with the level tops[start..start+n) (hash h).
// Transitions (level, byte) -> level are memoised for the walk (their levels stay allocated
// while the arena is less than 3/4 full; after that, levels are freed on the way back up, above
// the memoised ones). A byte that loops back to the same level descends with that level; a
// subtree whose every byte loops is marked wholesale (its tokens are one contiguous range in
// preorder).
// lv: the level's union (u, [0..4)) and known / loop sets ([4..8), [8..12)), shared by the
// descents that stay on the same level; NULL for a new level.
// Classify (a position's walk): tokens ending alive or at a return are accepted (mask); ret: the
// frame returned at some level on the path to x (x's included), so a token that dies below x
// died in bytes that belong to the stack under the frame: context-dependent (ctx).
static void descend(walk *w, int32_t x, int32_t start, int32_t n, uint64_t h, uint64_t *lv,
                    bool ret) {
    di_grammar_matcher *m = w->m;
    const di_grammar_vocab *v = w->v;
    const di_grammar *g = m->g;
    uint64_t own[12];
    if (!lv) {
        lv = own;
        memset(lv, 0, sizeof(uint64_t) * 4); // bytes some stack accepts next
        for (int32_t i = 0; i < n; i++) {
            const di_grammar_elem *e = &g->elems[m->nodes[m->tops[start + i]].pos];
            if (e->type != DI_GRAMMAR_ELEM_BYTES) continue; // a token terminal: not in the trie
            const uint64_t *s = g->sets[e->val];
            lv[0] |= s[0], lv[1] |= s[1], lv[2] |= s[2], lv[3] |= s[3];
        }
        // known [4..8), loop [8..12): from the cache, updated as bytes are tried
        memcpy(lv + 4, loop_slot(m, h), sizeof(uint64_t) * 8);
    }
    const uint64_t *u = lv;
    uint64_t *kl = lv + 4;
    const uint64_t *loop = kl + 4;
    for (int32_t c = x + 1; c < v->end[x] && m->err == DI_OK; c = v->end[c]) {
        const uint8_t b = v->byte[c];
        if (!di_grammar_set_has(u, b)) {
            if (w->classify && ret) mark_ctx(w, v->at_off[c], v->at_off[v->end[c]]);
            continue;
        }
        const int32_t nodes0 = m->n_nodes_used, tops0 = m->n_tops_used;
        int32_t s2 = start, n2 = n;
        bool acc2 = false, fresh = false;
        uint64_t h2 = h;
        if (di_grammar_set_has(kl, b) && di_grammar_set_has(loop, b)) {
            // a known loop: the same level again (no lookup)
        } else if (!trans_get(m, h, b, &s2, &n2, &acc2, &h2)) {
            step(m, m->tops + start, n, b);
            if (m->err != DI_OK) break;
            s2 = m->lvl_start, n2 = m->n_tops_used - m->lvl_start, acc2 = m->lvl_accept;
            h2 = level_hash(m, s2, n2, acc2);
            if (n2 == n && h2 == h) { // a loop: the new level is the parent's again
                m->n_nodes_used = nodes0, m->n_tops_used = tops0;
                s2 = start;
            } else if (n2 == 0) {
                m->n_nodes_used = nodes0, m->n_tops_used = tops0;
            }
            fresh = true;
            if (m->caching) {
                trans_put(m, h, b, s2, n2, acc2, h2);
                if (m->n_nodes_used > m->lim.max_nodes / 4 * 3 ||
                    m->n_tops_used > m->lim.max_nodes / 4 * 3) {
                    m->caching = false; // keep what is memoised, free the rest from here on
                    m->floor_nodes = m->n_nodes_used, m->floor_tops = m->n_tops_used;
                }
                fresh = false;
            }
            kl[b >> 6] |= 1ull << (b & 63);
            if (n2 == n && h2 == h) kl[4 + (b >> 6)] |= 1ull << (b & 63);
            memcpy(loop_slot(m, h), kl, sizeof(uint64_t) * 8);
        }
        if (n2 == n && h2 == h) {
            const int32_t si = v->sub_idx[c];
            if (si >= 0 && !(v->sub[si][0] & ~loop[0]) && !(v->sub[si][1] & ~loop[1]) &&
                !(v->sub[si][2] & ~loop[2]) && !(v->sub[si][3] & ~loop[3])) {
                mark_range(w, v->at_off[c], v->at_off[v->end[c]]);
                continue;
            }
            mark_range(w, v->at_off[c], v->at_off[c + 1]);
            if (v->end[c] > c + 1) descend(w, c, start, n, h, lv, ret || acc2);
            continue;
        }
        if (n2 > 0 || acc2) {
            mark_range(w, v->at_off[c], v->at_off[c + 1]);
            if (n2 > 0 && v->end[c] > c + 1) descend(w, c, s2, n2, h2, NULL, ret || acc2);
            if (n2 == 0 && w->classify) mark_ctx(w, v->at_off[c + 1], v->at_off[v->end[c]]);
        } else if (w->classify && ret) {
            mark_ctx(w, v->at_off[c], v->at_off[v->end[c]]);
        }
        if (fresh) { // not memoised: free it (never below what is)
            m->n_nodes_used = nodes0 > m->floor_nodes ? nodes0 : m->floor_nodes;
            m->n_tops_used = tops0 > m->floor_tops ? tops0 : m->floor_tops;
        }
    }
}

static void walk_begin(di_grammar_matcher *m) {
    if (++m->walk_stamp == 0) {
        memset(m->trans, 0, sizeof *m->trans * (size_t)m->n_trans);
        m->walk_stamp = 1;
    }
    m->caching = true;
    m->floor_nodes = m->n_nodes_used, m->floor_tops = m->n_tops_used;
}

static void scratch_reset(di_grammar_matcher *m) {
    m->n_nodes_used = m->n_nodes;
    m->n_tops_used = m->n_tops;
}

static double now_us(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec * 1e6 + (double)ts.tv_nsec * 1e-3;
}

static int32_t popcount_words(const uint64_t *w, int32_t n) {
    int32_t c = 0;
    for (int32_t i = 0; i < n; i++) c += __builtin_popcountll(w[i]);
    return c;
}

// Computes the token sets of the position key[0..n_key) (top first) and publishes them: the
// classify walk from the frame alone, over the committed state's scratch. NULL when a limit was
// hit or the store has no room (the caller takes the exact walk).
static const tset *tset_compute(di_grammar_matcher *m, const int32_t *key, int32_t n_key,
                                uint64_t hk) {
    di_grammar_tsets *t = m->ts;
    const di_grammar_vocab *v = m->v;
    const int32_t words = m->words;
    const double t0 = now_us();
    memset(m->ts_acc, 0, sizeof(uint64_t) * (size_t)words);
    memset(m->ts_ctx, 0, sizeof(uint64_t) * (size_t)words);
    m->quiet = true;
    int32_t node = -1; // the frame, built bottom up over -1 (returning sets the accept flag)
    for (int32_t i = n_key - 1; i >= 0 && m->err == DI_OK; i--)
        node = new_node(m, key[i], node, chain_hash(m, key[i], node));
    if (m->err == DI_OK && m->n_tops_used >= m->lim.max_nodes) set_err(m, "stack node");
    if (m->err == DI_OK) {
        const int32_t s0 = m->n_tops_used;
        m->tops[m->n_tops_used++] = node;
        walk w = {.m = m, .v = v, .mask = m->ts_acc, .ctx = m->ts_ctx, .classify = true};
        walk_begin(m);
        descend(&w, 0, s0, 1, level_hash(m, s0, 1, false), NULL, false);
    }
    scratch_reset(m);
    m->quiet = false;
    if (m->err != DI_OK) {
        m->err = DI_OK; // the committed state is intact; the exact walk decides
        return NULL;
    }
    const int32_t n_acc = popcount_words(m->ts_acc, words);
    const int32_t n_ctx = popcount_words(m->ts_ctx, words);
    // A list while it is smaller than the bitset.
    const bool acc_bits = (size_t)n_acc * sizeof(int32_t) >= (size_t)words * sizeof(uint64_t);
    const size_t n_head = (sizeof(tset) + 7) & ~(size_t)7;
    const size_t n_acc_bytes =
        acc_bits ? sizeof(uint64_t) * (size_t)words : sizeof(int32_t) * (size_t)n_acc;
    const size_t n_bytes = n_head + ((n_acc_bytes + 7) & ~(size_t)7) + sizeof(int32_t) * n_ctx;
    pthread_mutex_lock(&t->mu);
    const tset *old = tsets_find(t, key, n_key, hk);
    uint8_t *mem = old ? NULL : tsets_alloc(t, n_bytes);
    pthread_mutex_unlock(&t->mu);
    if (old || !mem) return old;
    // The reserved bytes are this thread's until published.
    tset *e = (tset *)mem;
    *e = (tset){.n_key = n_key, .hash = hk, .n_acc = n_acc, .n_ctx = n_ctx, .acc_bits = acc_bits};
    memcpy(e->key, key, sizeof(int32_t) * (size_t)n_key);
    uint8_t *p = mem + n_head;
    if (acc_bits) {
        memcpy(p, m->ts_acc, n_acc_bytes);
        e->bits = (const uint64_t *)p;
    } else {
        int32_t *ids = (int32_t *)p, k = 0;
        for (int32_t i = 0; i < words; i++)
            for (uint64_t b = m->ts_acc[i]; b; b &= b - 1) ids[k++] = i * 64 + __builtin_ctzll(b);
        e->acc_ids = ids;
    }
    int32_t *ctx = (int32_t *)(p + ((n_acc_bytes + 7) & ~(size_t)7)), k = 0;
    const int32_t n_at = v->at_off[v->n_nodes];
    for (int32_t i = 0; i < n_at && k < n_ctx; i++) { // trie preorder: prefixes shared in order
        const int32_t id = v->at[i];
        if ((m->ts_ctx[id >> 6] >> (id & 63)) & 1) ctx[k++] = id;
    }
    e->ctx = ctx;
    pthread_mutex_lock(&t->mu);
    const tset *won = tsets_find(t, key, n_key, hk); // another thread's, computed meanwhile
    if (!won) {
        tsets_insert(t, e);
        t->n_ctx += n_ctx;
        t->compute_us += now_us() - t0;
    }
    pthread_mutex_unlock(&t->mu);
    return won ? won : e;
}

// The token sets of committed top node `top`'s position (computed if new), or NULL.
static const tset *tset_get(di_grammar_matcher *m, int32_t top) {
    int32_t key[DI_TSET_K_MAX], depth = 0;
    for (int32_t x = top; x >= 0 && depth < DI_TSET_K_MAX; x = m->nodes[x].parent)
        key[depth++] = m->nodes[x].pos;
    for (int32_t n_key = depth < DI_TSET_K ? depth : DI_TSET_K;; n_key++) {
        const uint64_t hk = key_hash(key, n_key);
        pthread_mutex_lock(&m->ts->mu);
        const tset *e = tsets_find(m->ts, key, n_key, hk);
        const bool room =
            m->ts->chunks && m->ts->chunks->size - m->ts->chunks->used >= DI_TSET_ENTRY_MIN;
        pthread_mutex_unlock(&m->ts->mu);
        if (!e) e = room ? tset_compute(m, key, n_key, hk) : NULL;
        if (!e || e->n_ctx <= DI_TSET_CTX_DEEPEN || n_key == depth) return e;
    }
}

// Sets in mask the context-dependent tokens of e that the one committed stack `top` accepts: the
// exact walk, token by token in trie order, keeping the levels of the previous token's prefix
// (dfs_*[d]: the level after d bytes) and skipping the bytes known to loop. false: a limit.
static bool check_ctx(di_grammar_matcher *m, int32_t top, const tset *e, uint64_t *mask) {
    const di_grammar_vocab *v = m->v;
    int32_t *ls = m->dfs_start, *ln = m->dfs_n, *lnodes = m->dfs_nodes, *ltops = m->dfs_tops;
    uint64_t *lh = m->dfs_hash;
    bool *lacc = m->dfs_acc;
    if (m->n_tops_used >= m->lim.max_nodes) return set_err(m, "stack node"), false;
    ls[0] = m->n_tops_used;
    m->tops[m->n_tops_used++] = top;
    ln[0] = 1, lacc[0] = false, lh[0] = level_hash(m, ls[0], 1, false);
    lnodes[0] = m->n_nodes_used, ltops[0] = m->n_tops_used;
    int32_t valid = 0; // levels [0, valid] hold the previous token's prefix
    const uint8_t *prev = NULL;
    int32_t n_prev = 0;
    for (int32_t k = 0; k < e->n_ctx; k++) {
        const int32_t id = e->ctx[k];
        const uint8_t *b = v->tok_bytes + v->tok_off[id];
        const int32_t n = (int32_t)(v->tok_off[id + 1] - v->tok_off[id]);
        int32_t d = 0;
        while (d < valid && d < n && d < n_prev && b[d] == prev[d]) d++;
        m->n_nodes_used = lnodes[d], m->n_tops_used = ltops[d];
        for (; d < n && ln[d] > 0; d++) {
            const uint8_t c = b[d];
            const uint64_t *ks = loop_slot(m, lh[d]);
            if (di_grammar_set_has(ks, c) && di_grammar_set_has(ks + 4, c)) { // the same level
                ls[d + 1] = ls[d], ln[d + 1] = ln[d], lacc[d + 1] = lacc[d], lh[d + 1] = lh[d];
                lnodes[d + 1] = m->n_nodes_used, ltops[d + 1] = m->n_tops_used;
                continue;
            }
            step(m, m->tops + ls[d], ln[d], c);
            if (m->err != DI_OK) return false;
            int32_t s2 = m->lvl_start, n2 = m->n_tops_used - m->lvl_start;
            const bool acc2 = m->lvl_accept;
            const uint64_t h2 = level_hash(m, s2, n2, acc2);
            const bool loop = n2 == ln[d] && h2 == lh[d];
            if (loop || n2 == 0) {
                m->n_nodes_used = lnodes[d], m->n_tops_used = ltops[d];
                if (loop) s2 = ls[d];
            }
            uint64_t *kl = loop_slot(m, lh[d]);
            kl[c >> 6] |= 1ull << (c & 63);
            if (loop) kl[4 + (c >> 6)] |= 1ull << (c & 63);
            ls[d + 1] = s2, ln[d + 1] = n2, lacc[d + 1] = acc2, lh[d + 1] = h2;
            lnodes[d + 1] = m->n_nodes_used, ltops[d + 1] = m->n_tops_used;
        }
        valid = d, prev = b, n_prev = n;
        if (d == n && (ln[n] > 0 || lacc[n])) mask[id >> 6] |= 1ull << (id & 63);
    }
    return true;
}

// The mask from the token sets of the committed tops (token terminals excluded). false: a set
// unavailable or a limit hit (mask undefined, the state intact): the caller takes the exact walk.
static bool mask_tsets(di_grammar_matcher *m, uint64_t *mask, int32_t *n_allowed) {
    const di_grammar *g = m->g;
    const int32_t words = m->words;
    memset(mask, 0, sizeof(uint64_t) * (size_t)words);
    for (int32_t i = 0; i < m->n_tops; i++) {
        const int32_t t = m->tops[i];
        m->ts_ent[i] = NULL;
        if (g->elems[m->nodes[t].pos].type != DI_GRAMMAR_ELEM_BYTES) continue;
        const tset *e = tset_get(m, t);
        if (!e) return false;
        m->ts_ent[i] = e;
        if (e->acc_bits) {
            for (int32_t k = 0; k < words; k++) mask[k] |= e->bits[k];
        } else {
            for (int32_t k = 0; k < e->n_acc; k++)
                mask[e->acc_ids[k] >> 6] |= 1ull << (e->acc_ids[k] & 63);
        }
    }
    bool ok = true;
    m->quiet = true;
    for (int32_t i = 0; i < m->n_tops && ok; i++) {
        // A position that is the whole stack returns to the grammar's end: its context-dependent
        // tokens have bytes left after it, so the stack rejects them all (nothing to check).
        const tset *e = m->ts_ent[i];
        if (e && e->n_ctx > 0 && e->n_key < m->nodes[m->tops[i]].depth) {
            ok = check_ctx(m, m->tops[i], e, mask);
            scratch_reset(m);
        }
    }
    m->quiet = false;
    if (!ok) {
        m->err = DI_OK; // the committed state is intact; the exact walk decides
        return false;
    }
    *n_allowed = popcount_words(mask, words);
    return true;
}

di_status di_grammar_matcher_mask(di_grammar_matcher *m, uint64_t *mask, int32_t *n_allowed) {
    if (m->err != DI_OK) return m->err;
    DI_ASSERT(m->v);
    const di_grammar_vocab *v = m->v;
    const int32_t words = (v->n_vocab + 63) / 64;
    const uint64_t key = level_hash(m, 0, m->n_tops, m->accept);
    m->n_masks++;
    for (int32_t i = 0; i < (m->cache ? m->lim.n_cache : 0); i++) {
        if (m->cache[i].valid && m->cache[i].key == key) {
            memcpy(mask, m->cache_masks + (size_t)i * (size_t)words,
                   sizeof(uint64_t) * (size_t)words);
            *n_allowed = m->cache[i].n_allowed;
            m->n_cache_hits++;
            return DI_OK;
        }
    }
    walk w = {.m = m, .v = v, .mask = mask};
    if (!m->ts || !mask_tsets(m, mask, &w.n_allowed)) {
        if (m->ts) {
            pthread_mutex_lock(&m->ts->mu);
            m->ts->n_fallbacks++;
            pthread_mutex_unlock(&m->ts->mu);
        }
        // The exact walk of the whole trie from the whole stack set.
        memset(mask, 0, sizeof(uint64_t) * (size_t)words);
        w.n_allowed = 0;
        walk_begin(m);
        if (m->n_tops > 0) descend(&w, 0, 0, m->n_tops, key, NULL, false);
        scratch_reset(m);
        if (m->err != DI_OK) return m->err;
    }
    for (int32_t i = 0; i < m->n_tops; i++) { // token terminals that can come next
        const di_grammar_elem *e = &m->g->elems[m->nodes[m->tops[i]].pos];
        if (e->type != DI_GRAMMAR_ELEM_TOKEN || e->val >= v->n_vocab) continue;
        uint64_t *wd = &mask[e->val >> 6], bit = 1ull << (e->val & 63);
        if (!(*wd & bit)) *wd |= bit, w.n_allowed++;
    }
    *n_allowed = w.n_allowed;
    if (m->cache) {
        int32_t i = m->cache_next;
        m->cache_next = (i + 1) % m->lim.n_cache;
        m->cache[i] = (cache_entry){.key = key, .n_allowed = w.n_allowed, .valid = true};
        memcpy(m->cache_masks + (size_t)i * (size_t)words, mask, sizeof(uint64_t) * (size_t)words);
    }
    return DI_OK;
}
