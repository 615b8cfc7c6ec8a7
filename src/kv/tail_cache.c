// tail_cache — LRU of tail snapshots keyed by prefix-cache block id (see tail_cache.h).
#include "kv/tail_cache.h"

#include "base/log.h"
#include "base/mem.h"

struct di_tail_cache {
    size_t snap_bytes;
    int32_t n_ids, n_slots;
    uint8_t *arena;         // owned [n_slots, snap_bytes]
    int32_t *slot_of;       // owned [n_ids]: the block's slot, -1 none
    int32_t *id_of;         // owned [n_slots]: the slot's block, -1 free
    int32_t *newer, *older; // owned [n_slots]: LRU links of used slots (-1 ends)
    int32_t newest, oldest; // used slots, -1 when none
    int32_t *free_list;     // owned [n_slots]
    int32_t n_free;
    di_tail_cache_stats st;
};

di_status di_tail_cache_create(int32_t n_ids, size_t snap_bytes, size_t budget_bytes,
                               di_tail_cache **out) {
    *out = NULL;
    if (n_ids < 1 || snap_bytes == 0 || budget_bytes < snap_bytes) return DI_ERR_INVALID;
    size_t n = budget_bytes / snap_bytes;
    if (n > (size_t)n_ids) n = (size_t)n_ids; // one snapshot a block at most
    di_tail_cache *tc = di_calloc(1, sizeof *tc);
    if (!tc) return DI_ERR_NOMEM;
    tc->snap_bytes = snap_bytes;
    tc->n_ids = n_ids;
    tc->n_slots = (int32_t)n;
    tc->arena = di_calloc(n, snap_bytes);
    tc->slot_of = di_malloc(sizeof(int32_t) * (size_t)n_ids);
    tc->id_of = di_malloc(sizeof(int32_t) * n);
    tc->newer = di_malloc(sizeof(int32_t) * n);
    tc->older = di_malloc(sizeof(int32_t) * n);
    tc->free_list = di_malloc(sizeof(int32_t) * n);
    if (!tc->arena || !tc->slot_of || !tc->id_of || !tc->newer || !tc->older || !tc->free_list) {
        di_tail_cache_destroy(tc);
        return DI_ERR_NOMEM;
    }
    for (int32_t i = 0; i < n_ids; i++) tc->slot_of[i] = -1;
    for (int32_t i = 0; i < tc->n_slots; i++) {
        tc->id_of[i] = -1;
        tc->free_list[i] = tc->n_slots - 1 - i;
    }
    tc->n_free = tc->n_slots;
    tc->newest = tc->oldest = -1;
    *out = tc;
    return DI_OK;
}

void di_tail_cache_destroy(di_tail_cache *tc) {
    if (!tc) return;
    di_free(tc->arena);
    di_free(tc->slot_of);
    di_free(tc->id_of);
    di_free(tc->newer);
    di_free(tc->older);
    di_free(tc->free_list);
    di_free(tc);
}

size_t di_tail_cache_snap_bytes(const di_tail_cache *tc) {
    return tc->snap_bytes;
}

int32_t di_tail_cache_n_slots(const di_tail_cache *tc) {
    return tc->n_slots;
}

static void unlink_slot(di_tail_cache *tc, int32_t k) {
    if (tc->newer[k] >= 0)
        tc->older[tc->newer[k]] = tc->older[k];
    else
        tc->newest = tc->older[k];
    if (tc->older[k] >= 0)
        tc->newer[tc->older[k]] = tc->newer[k];
    else
        tc->oldest = tc->newer[k];
}

static void push_newest(di_tail_cache *tc, int32_t k) {
    tc->newer[k] = -1;
    tc->older[k] = tc->newest;
    if (tc->newest >= 0) tc->newer[tc->newest] = k;
    tc->newest = k;
    if (tc->oldest < 0) tc->oldest = k;
}

static void release_slot(di_tail_cache *tc, int32_t k) {
    unlink_slot(tc, k);
    tc->slot_of[tc->id_of[k]] = -1;
    tc->id_of[k] = -1;
    tc->free_list[tc->n_free++] = k;
    tc->st.n_stored--;
}

uint8_t *di_tail_cache_put(di_tail_cache *tc, int32_t id) {
    DI_ASSERT(id >= 0 && id < tc->n_ids && tc->slot_of[id] < 0);
    if (tc->n_free == 0) {
        release_slot(tc, tc->oldest);
        tc->st.n_evicted++;
    }
    const int32_t k = tc->free_list[--tc->n_free];
    tc->slot_of[id] = k;
    tc->id_of[k] = id;
    tc->st.n_stored++;
    push_newest(tc, k);
    tc->st.n_taken++;
    return tc->arena + (size_t)k * tc->snap_bytes;
}

const uint8_t *di_tail_cache_get(di_tail_cache *tc, int32_t id) {
    DI_ASSERT(id >= 0 && id < tc->n_ids);
    int32_t k = tc->slot_of[id];
    if (k < 0) return NULL;
    unlink_slot(tc, k);
    push_newest(tc, k);
    return tc->arena + (size_t)k * tc->snap_bytes;
}

bool di_tail_cache_has(const di_tail_cache *tc, int32_t id) {
    return id >= 0 && id < tc->n_ids && tc->slot_of[id] >= 0;
}

void di_tail_cache_drop(di_tail_cache *tc, int32_t id) {
    DI_ASSERT(id >= 0 && id < tc->n_ids);
    int32_t k = tc->slot_of[id];
    if (k < 0) return;
    release_slot(tc, k);
    tc->st.n_dropped++;
}

void di_tail_cache_get_stats(const di_tail_cache *tc, di_tail_cache_stats *st) {
    *st = tc->st;
    st->bytes = tc->st.n_stored * (int64_t)tc->snap_bytes;
}
