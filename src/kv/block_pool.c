// block_pool — fixed-size KV blocks with reference counts, a free stack and an LRU of idle
// cached blocks (see block_pool.h).
#include "kv/block_pool.h"

#include <string.h>

#include "base/log.h"
#include "base/mem.h"

struct di_block_pool {
    unsigned char *arena; // owned [n * block_bytes]
    size_t block_bytes;
    int32_t n;
    int32_t *refs;       // owned [n]
    bool *cached;        // owned [n]
    int32_t *free_stack; // owned [n]
    int32_t n_free;
    // LRU of idle cached blocks: doubly linked through prev/next; head = least recent.
    int32_t *prev, *next; // owned [n]; -2 = not in the list
    int32_t lru_head, lru_tail, n_lru;
    di_block_evict_fn evict;
    void *evict_user;
};

static di_status create(int32_t n_blocks, size_t block_bytes, bool arena, di_block_pool **out) {
    if (n_blocks < 1 || block_bytes == 0) return DI_ERR_INVALID;
    di_block_pool *p = di_calloc(1, sizeof *p);
    if (!p) return DI_ERR_NOMEM;
    p->block_bytes = (block_bytes + 63) & ~(size_t)63;
    p->n = n_blocks;
    size_t total = arena ? di_mul_size(p->block_bytes, (size_t)n_blocks) : 0;
    p->arena = total ? di_aligned_alloc(total) : NULL;
    p->refs = di_calloc((size_t)n_blocks, sizeof *p->refs);
    p->cached = di_calloc((size_t)n_blocks, sizeof *p->cached);
    p->free_stack = di_malloc(sizeof(int32_t) * (size_t)n_blocks);
    p->prev = di_malloc(sizeof(int32_t) * (size_t)n_blocks);
    p->next = di_malloc(sizeof(int32_t) * (size_t)n_blocks);
    if ((arena && !p->arena) || !p->refs || !p->cached || !p->free_stack || !p->prev || !p->next) {
        DI_LOG_ERROR("block pool: cannot allocate %d blocks of %zu bytes", n_blocks, block_bytes);
        di_block_pool_destroy(p);
        return DI_ERR_NOMEM;
    }
    // Lowest ids first out of the stack.
    for (int32_t i = 0; i < n_blocks; i++) {
        p->free_stack[i] = n_blocks - 1 - i;
        p->prev[i] = p->next[i] = -2;
    }
    p->n_free = n_blocks;
    p->lru_head = p->lru_tail = -1;
    *out = p;
    return DI_OK;
}

di_status di_block_pool_create(int32_t n_blocks, size_t block_bytes, di_block_pool **out) {
    return create(n_blocks, block_bytes, true, out);
}

di_status di_block_pool_create_accounting(int32_t n_blocks, size_t block_bytes,
                                          di_block_pool **out) {
    return create(n_blocks, block_bytes, false, out);
}

void di_block_pool_destroy(di_block_pool *p) {
    if (!p) return;
    di_aligned_free(p->arena);
    di_free(p->refs);
    di_free(p->cached);
    di_free(p->free_stack);
    di_free(p->prev);
    di_free(p->next);
    di_free(p);
}

void di_block_pool_set_evict(di_block_pool *p, di_block_evict_fn fn, void *user) {
    p->evict = fn;
    p->evict_user = user;
}

// ---- LRU of idle cached blocks ----

static void lru_remove(di_block_pool *p, int32_t id) {
    DI_ASSERT(p->prev[id] != -2);
    int32_t a = p->prev[id], b = p->next[id];
    if (a >= 0)
        p->next[a] = b;
    else
        p->lru_head = b;
    if (b >= 0)
        p->prev[b] = a;
    else
        p->lru_tail = a;
    p->prev[id] = p->next[id] = -2;
    p->n_lru--;
}

static void lru_push(di_block_pool *p, int32_t id) {
    p->prev[id] = p->lru_tail;
    p->next[id] = -1;
    if (p->lru_tail >= 0)
        p->next[p->lru_tail] = id;
    else
        p->lru_head = id;
    p->lru_tail = id;
    p->n_lru++;
}

// ---- alloc / ref ----

di_status di_block_pool_alloc(di_block_pool *p, int32_t *id) {
    int32_t b;
    if (p->n_free > 0) {
        b = p->free_stack[--p->n_free];
    } else if (p->n_lru > 0) {
        b = p->lru_head;
        lru_remove(p, b);
        p->cached[b] = false;
        if (p->evict) p->evict(p->evict_user, b);
    } else {
        return DI_ERR_NO_KV;
    }
    DI_ASSERT(p->refs[b] == 0);
    p->refs[b] = 1;
    *id = b;
    return DI_OK;
}

void di_block_pool_ref(di_block_pool *p, int32_t id) {
    DI_ASSERT(id >= 0 && id < p->n);
    if (p->refs[id] == 0) {
        DI_ASSERT(p->cached[id]); // only idle cached blocks are revived
        lru_remove(p, id);
    }
    p->refs[id]++;
}

void di_block_pool_unref(di_block_pool *p, int32_t id) {
    DI_ASSERT(id >= 0 && id < p->n && p->refs[id] > 0);
    if (--p->refs[id] > 0) return;
    if (p->cached[id])
        lru_push(p, id);
    else
        p->free_stack[p->n_free++] = id;
}

void di_block_pool_set_cached(di_block_pool *p, int32_t id, bool cached) {
    DI_ASSERT(id >= 0 && id < p->n);
    if (p->cached[id] == cached) return;
    if (!cached && p->refs[id] == 0) { // forgetting an idle cached block frees it
        lru_remove(p, id);
        p->free_stack[p->n_free++] = id;
    }
    p->cached[id] = cached;
}

// ---- queries ----

void *di_block_pool_ptr(const di_block_pool *p, int32_t id) {
    DI_ASSERT(id >= 0 && id < p->n);
    return p->arena ? p->arena + (size_t)id * p->block_bytes : NULL;
}

int32_t di_block_pool_refs(const di_block_pool *p, int32_t id) {
    return p->refs[id];
}

int32_t di_block_pool_n_total(const di_block_pool *p) {
    return p->n;
}

int32_t di_block_pool_n_available(const di_block_pool *p) {
    return p->n_free + p->n_lru;
}

int32_t di_block_pool_n_cached_idle(const di_block_pool *p) {
    return p->n_lru;
}

size_t di_block_pool_block_bytes(const di_block_pool *p) {
    return p->block_bytes;
}

int32_t di_block_pool_lru_newest(const di_block_pool *p) {
    return p->lru_tail;
}

int32_t di_block_pool_lru_older(const di_block_pool *p, int32_t id) {
    DI_ASSERT(id >= 0 && id < p->n && p->prev[id] != -2);
    return p->prev[id];
}
