// prefix_cache — chained-hash table of full KV blocks (see prefix_cache.h).
#include "kv/prefix_cache.h"

#include <string.h>

#include "base/log.h"
#include "base/mem.h"

struct di_prefix_cache {
    di_block_pool *pool; // borrowed
    int32_t block_tokens;
    uint64_t model_id;
    int32_t n_ids;   // pool blocks
    int32_t *bucket; // owned [n_buckets]: first block id of the chain, -1 empty
    uint64_t mask;
    uint64_t *hash, *parent, *salt; // owned [n_ids]
    int32_t *next;                  // owned [n_ids]: next id in the bucket chain
    bool *present;                  // owned [n_ids]
    int32_t *tokens;                // owned [n_ids, block_tokens]
    int32_t n_present;
    di_prefix_cache_spill_fn spill; // NULL: none
    void *spill_user;
    di_prefix_cache_forget_fn forget; // NULL: none
    void *forget_user;
};

static uint64_t mix64(uint64_t z) {
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

static void on_evict(void *user, int32_t id);

di_status di_prefix_cache_create(di_block_pool *pool, int32_t block_tokens, uint64_t model_id,
                                 di_prefix_cache **out) {
    di_prefix_cache *pc = di_calloc(1, sizeof *pc);
    if (!pc) return DI_ERR_NOMEM;
    pc->pool = pool;
    pc->block_tokens = block_tokens;
    pc->model_id = model_id;
    pc->n_ids = di_block_pool_n_total(pool);
    uint64_t nb = 16;
    while (nb < 2 * (uint64_t)pc->n_ids) nb *= 2;
    pc->mask = nb - 1;
    pc->bucket = di_malloc(sizeof(int32_t) * nb);
    pc->hash = di_calloc((size_t)pc->n_ids, sizeof(uint64_t));
    pc->parent = di_calloc((size_t)pc->n_ids, sizeof(uint64_t));
    pc->salt = di_calloc((size_t)pc->n_ids, sizeof(uint64_t));
    pc->next = di_calloc((size_t)pc->n_ids, sizeof(int32_t));
    pc->present = di_calloc((size_t)pc->n_ids, sizeof(bool));
    pc->tokens = di_malloc(sizeof(int32_t) * (size_t)pc->n_ids * (size_t)block_tokens);
    if (!pc->bucket || !pc->hash || !pc->parent || !pc->salt || !pc->next || !pc->present ||
        !pc->tokens) {
        di_prefix_cache_destroy(pc);
        return DI_ERR_NOMEM;
    }
    for (uint64_t i = 0; i < nb; i++) pc->bucket[i] = -1;
    di_block_pool_set_evict(pool, on_evict, pc);
    *out = pc;
    return DI_OK;
}

void di_prefix_cache_destroy(di_prefix_cache *pc) {
    if (!pc) return;
    di_free(pc->bucket);
    di_free(pc->hash);
    di_free(pc->parent);
    di_free(pc->salt);
    di_free(pc->next);
    di_free(pc->present);
    di_free(pc->tokens);
    di_free(pc);
}

uint64_t di_prefix_cache_hash(const di_prefix_cache *pc, uint64_t parent, const int32_t *tokens,
                              uint64_t salt) {
    uint64_t h = mix64(parent ^ 0x243f6a8885a308d3ull);
    h = mix64(h ^ salt);
    h = mix64(h ^ pc->model_id);
    for (int32_t i = 0; i < pc->block_tokens; i++)
        h = mix64(h ^ ((uint64_t)(uint32_t)tokens[i] + 0x9e3779b97f4a7c15ull * (uint64_t)(i + 1)));
    return h;
}

static int32_t find(const di_prefix_cache *pc, uint64_t h, uint64_t parent, const int32_t *tokens) {
    for (int32_t id = pc->bucket[h & pc->mask]; id >= 0; id = pc->next[id]) {
        if (pc->hash[id] == h && pc->parent[id] == parent &&
            memcmp(pc->tokens + (int64_t)id * pc->block_tokens, tokens,
                   sizeof(int32_t) * (size_t)pc->block_tokens) == 0)
            return id;
    }
    return -1;
}

int32_t di_prefix_cache_match(di_prefix_cache *pc, const int32_t *tokens, int32_t n_blocks_max,
                              uint64_t salt, int32_t *ids) {
    uint64_t parent = 0;
    int32_t n = 0;
    for (; n < n_blocks_max; n++) {
        const int32_t *t = tokens + (int64_t)n * pc->block_tokens;
        uint64_t h = di_prefix_cache_hash(pc, parent, t, salt);
        int32_t id = find(pc, h, parent, t);
        if (id < 0) break;
        ids[n] = id;
        parent = h;
    }
    return n;
}

int32_t di_prefix_cache_find(const di_prefix_cache *pc, uint64_t h, uint64_t parent,
                             const int32_t *tokens) {
    return find(pc, h, parent, tokens);
}

bool di_prefix_cache_insert(di_prefix_cache *pc, uint64_t h, uint64_t parent, uint64_t salt,
                            const int32_t *tokens, int32_t id) {
    DI_ASSERT(id >= 0 && id < pc->n_ids && !pc->present[id]);
    if (find(pc, h, parent, tokens) >= 0) return false;
    pc->hash[id] = h;
    pc->parent[id] = parent;
    pc->salt[id] = salt;
    memcpy(pc->tokens + (int64_t)id * pc->block_tokens, tokens,
           sizeof(int32_t) * (size_t)pc->block_tokens);
    pc->next[id] = pc->bucket[h & pc->mask];
    pc->bucket[h & pc->mask] = id;
    pc->present[id] = true;
    pc->n_present++;
    di_block_pool_set_cached(pc->pool, id, true);
    return true;
}

static void unlink_id(di_prefix_cache *pc, int32_t id) {
    DI_ASSERT(pc->present[id]);
    int32_t *link = &pc->bucket[pc->hash[id] & pc->mask];
    while (*link != id) link = &pc->next[*link];
    *link = pc->next[id];
    pc->present[id] = false;
    pc->n_present--;
    if (pc->forget) pc->forget(pc->forget_user, id);
}

static void spill(const di_prefix_cache *pc, int32_t id) {
    pc->spill(pc->spill_user, pc->hash[id], pc->parent[id], pc->salt[id],
              pc->tokens + (int64_t)id * pc->block_tokens, id);
}

// The pool reuses an idle cached block: spill it (its memory is intact until the hook returns),
// then unlink it.
static void on_evict(void *user, int32_t id) {
    di_prefix_cache *pc = user;
    if (pc->spill) spill(pc, id);
    unlink_id(pc, id);
}

void di_prefix_cache_set_spill(di_prefix_cache *pc, di_prefix_cache_spill_fn fn, void *user) {
    pc->spill = fn;
    pc->spill_user = user;
}

void di_prefix_cache_set_forget(di_prefix_cache *pc, di_prefix_cache_forget_fn fn, void *user) {
    pc->forget = fn;
    pc->forget_user = user;
}

bool di_prefix_cache_holds(const di_prefix_cache *pc, int32_t id) {
    return id >= 0 && id < pc->n_ids && pc->present[id];
}

int32_t di_prefix_cache_offer_recent(di_prefix_cache *pc, di_prefix_cache_offer_fn fn, void *user,
                                     int32_t max_n) {
    int32_t n = 0;
    // Referenced cached blocks first: in use now, the most recent of all.
    for (int32_t id = 0; id < pc->n_ids && n < max_n; id++)
        if (pc->present[id] && di_block_pool_refs(pc->pool, id) > 0)
            n += fn(user, pc->hash[id], pc->parent[id], pc->salt[id],
                    pc->tokens + (int64_t)id * pc->block_tokens, id);
    for (int32_t id = di_block_pool_lru_newest(pc->pool); id >= 0 && n < max_n;
         id = di_block_pool_lru_older(pc->pool, id)) {
        DI_ASSERT(pc->present[id]); // the LRU holds only cached blocks
        n += fn(user, pc->hash[id], pc->parent[id], pc->salt[id],
                pc->tokens + (int64_t)id * pc->block_tokens, id);
    }
    return n;
}

bool di_prefix_cache_remove(di_prefix_cache *pc, int32_t id) {
    DI_ASSERT(id >= 0 && id < pc->n_ids);
    if (!pc->present[id]) return false;
    unlink_id(pc, id);
    di_block_pool_set_cached(pc->pool, id, false);
    return true;
}

int32_t di_prefix_cache_n_blocks(const di_prefix_cache *pc) {
    return pc->n_present;
}
