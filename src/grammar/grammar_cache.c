// grammar_cache — compiled grammars shared by the requests that ask for the same one
// (include/deepinfer.h, di_grammar_cache_*).
//
// Why: a grammar's token sets per position (matcher.c) are computed by the masks of its matchers
// and kept in the grammar; requests that compile their own copy of the same response format or
// tool list would each start cold (the first token of every string context a full trie walk).
// Requests that share one compiled grammar share its token sets: the second request is warm.
//
// Key: the exact final EBNF text a compile produced (a JSON Schema's, a regex's, a tool list's
// generated grammar), compared byte for byte on a hit (the 64-bit hash only picks candidates, so
// a collision cannot hand out another grammar); a union's key is its parts' keys. The vocabulary
// is not part of the key: a grammar's token sets bind to the first vocabulary that uses them and
// matchers over another take the exact walk (a server has one).
// Bounds: at most n_max grammars and bytes_max bytes (EBNF text, compiled arrays and token sets),
// least recently used evicted first. An entry holds one reference; eviction drops it, so requests
// still using the grammar keep it alive. Entries are few (64 by default): lookups scan them.
// Thread-safety: any thread (a mutex).
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "base/mem.h"
#include "grammar/grammar.h"

typedef struct gc_entry {
    uint64_t hash; // of the key (g->key)
    di_grammar *g; // one reference
    uint64_t used; // tick of the last hit or insert (LRU)
} gc_entry;

struct di_grammar_cache {
    pthread_mutex_t mu; // guards everything below
    int32_t n_max, n;
    size_t bytes_max;
    gc_entry *e; // owned [n_max]
    uint64_t tick;
    int64_t n_hits, n_misses;
};

di_status di_grammar_cache_create(int32_t n_max, size_t bytes_max, di_grammar_cache **out) {
    di_grammar_cache *c = di_calloc(1, sizeof *c);
    if (!c) return DI_ERR_NOMEM;
    c->n_max = n_max > 0 ? n_max : 1;
    c->bytes_max = bytes_max;
    c->e = di_calloc((size_t)c->n_max, sizeof *c->e);
    if (!c->e || pthread_mutex_init(&c->mu, NULL) != 0) {
        di_free(c->e);
        di_free(c);
        return DI_ERR_NOMEM;
    }
    *out = c;
    return DI_OK;
}

void di_grammar_cache_destroy(di_grammar_cache *c) {
    if (!c) return;
    for (int32_t i = 0; i < c->n; i++) di_grammar_destroy(c->e[i].g);
    pthread_mutex_destroy(&c->mu);
    di_free(c->e);
    di_free(c);
}

void di_grammar_cache_get_stats(di_grammar_cache *c, int64_t *n_hits, int64_t *n_misses,
                                int32_t *n_grammars) {
    pthread_mutex_lock(&c->mu);
    *n_hits = c->n_hits, *n_misses = c->n_misses, *n_grammars = c->n;
    pthread_mutex_unlock(&c->mu);
}

static uint64_t key_hash(const char *s, size_t n) { // FNV-1a, then a finaliser
    uint64_t h = 0xcbf29ce484222325ull;
    for (size_t i = 0; i < n; i++) h = (h ^ (uint8_t)s[i]) * 0x100000001b3ull;
    h ^= h >> 33;
    h *= 0xff51afd7ed558ccdull;
    return h ^ (h >> 33);
}

// Bytes an entry accounts for: its key, its compiled arrays and its token sets so far.
static size_t entry_bytes(const di_grammar *g) {
    di_grammar_tsets_stats ts;
    di_grammar_tsets_get_stats(g, &ts);
    return g->n_key + (size_t)g->n_elems * sizeof(di_grammar_elem) +
           (size_t)g->n_alts * sizeof(int32_t) * 2 + (size_t)g->n_sets * 32 + ts.bytes;
}

// The cached grammar with this key (a new reference), or NULL. Caller holds the mutex.
static di_grammar *find(di_grammar_cache *c, const char *key, size_t n, uint64_t h) {
    for (int32_t i = 0; i < c->n; i++) {
        di_grammar *g = c->e[i].g;
        if (c->e[i].hash == h && g->n_key == n && !memcmp(g->key, key, n)) {
            c->e[i].used = ++c->tick;
            return (di_grammar *)di_grammar_retain(g);
        }
    }
    return NULL;
}

static di_grammar *cache_find(di_grammar_cache *c, const char *key, size_t n) {
    const uint64_t h = key_hash(key, n);
    pthread_mutex_lock(&c->mu);
    di_grammar *g = find(c, key, n, h);
    if (g)
        c->n_hits++;
    else
        c->n_misses++;
    pthread_mutex_unlock(&c->mu);
    return g;
}

// Inserts g (the caller's reference passes to the returned grammar) under key (owned, moved into
// g), evicting as needed; if another thread cached the same key meanwhile, g is dropped and that
// grammar returned.
static di_grammar *cache_put(di_grammar_cache *c, di_grammar *g, char *key, size_t n) {
    const uint64_t h = key_hash(key, n);
    pthread_mutex_lock(&c->mu);
    di_grammar *old = find(c, key, n, h); // compiled by another thread meanwhile
    if (old) {
        pthread_mutex_unlock(&c->mu);
        di_free(key);
        di_grammar_destroy(g);
        return old;
    }
    g->key = key, g->n_key = n;
    // Make room: the least recently used first, until the count and the bytes fit.
    size_t total = entry_bytes(g);
    for (int32_t i = 0; i < c->n; i++) total += entry_bytes(c->e[i].g);
    while (c->n > 0 && (c->n >= c->n_max || total > c->bytes_max)) {
        int32_t lru = 0;
        for (int32_t i = 1; i < c->n; i++)
            if (c->e[i].used < c->e[lru].used) lru = i;
        total -= entry_bytes(c->e[lru].g);
        di_grammar_destroy(c->e[lru].g);
        c->e[lru] = c->e[--c->n];
    }
    c->e[c->n++] =
        (gc_entry){.hash = h, .g = (di_grammar *)di_grammar_retain(g), .used = ++c->tick};
    pthread_mutex_unlock(&c->mu);
    return g;
}

// ---- compiling through a cache ----

di_status di_grammar_cache_ebnf(di_grammar_cache *c, const char *text, size_t n, di_grammar **out,
                                char *err, size_t err_size) {
    if (!c) return di_grammar_compile_ebnf(text, n, out, err, err_size);
    di_grammar *g = cache_find(c, text, n);
    if (g) {
        if (err && err_size) err[0] = 0;
        *out = g;
        return DI_OK;
    }
    char *key = di_malloc(n + 1);
    if (!key) return DI_ERR_NOMEM;
    memcpy(key, text, n);
    key[n] = 0;
    const di_status st = di_grammar_compile_ebnf(text, n, &g, err, err_size);
    if (st != DI_OK) {
        di_free(key);
        return st;
    }
    *out = cache_put(c, g, key, n);
    return DI_OK;
}

di_status di_grammar_cache_union(di_grammar_cache *c, const di_grammar *a, const di_grammar *b,
                                 di_grammar **out) {
    if (!c || !a->key || !b->key) return di_grammar_union(a, b, out);
    // "\0union\0", a's key length (8 bytes), a's key, b's key: no EBNF text starts with NUL.
    static const char tag[] = "\0union\0";
    const size_t n = sizeof tag - 1 + 8 + a->n_key + b->n_key;
    char *key = di_malloc(n);
    if (!key) return DI_ERR_NOMEM;
    const uint64_t na = a->n_key;
    memcpy(key, tag, sizeof tag - 1);
    memcpy(key + sizeof tag - 1, &na, 8);
    memcpy(key + sizeof tag - 1 + 8, a->key, a->n_key);
    memcpy(key + sizeof tag - 1 + 8 + a->n_key, b->key, b->n_key);
    di_grammar *g = cache_find(c, key, n);
    if (g) {
        di_free(key);
        *out = g;
        return DI_OK;
    }
    const di_status st = di_grammar_union(a, b, &g);
    if (st != DI_OK) {
        di_free(key);
        return st;
    }
    *out = cache_put(c, g, key, n);
    return DI_OK;
}
