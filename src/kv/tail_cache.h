/*
 * tail_cache — tail snapshots of cached prefix blocks (docs/kv-cache.md, "Tail snapshots").
 *
 * A prefix-cache hit of H positions gives the compressed entries of positions < H, not the state
 * that lives only in a sequence's tail (window rows, compressor overlaps, V4.1 (C, Z) slots,
 * MTP / DSpark rings). A snapshot is that tail, copied right after a forward call that ended at H
 * (a block boundary), attached to the cached block that ends at H: a later hit on that block
 * restores it and computes nothing before H (no bounded replay). What the bytes hold is the
 * engine's business (the V4 slot's tail blocks and MTP ring, or the V4.1 session's rings and
 * (C, Z) slots); here they are opaque, all of one size.
 *
 * Storage: n_slots = budget / snap_bytes snapshot slots in one zeroed arena (calloc'd at create:
 * pages never used cost no memory), least recently used out when full; a snapshot lives no
 * longer than its block (the prefix cache drops it when the block is evicted or removed).
 *
 * Owns: the arena, the id → slot map, the LRU links (sized at create; no allocation after).
 * Thread-safety: engine thread only.
 */
#pragma once

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "deepinfer.h" // di_status

typedef struct di_tail_cache di_tail_cache;

typedef struct di_tail_cache_stats {
    int64_t n_stored;  // snapshots held now
    int64_t bytes;     // their bytes (n_stored * snap_bytes)
    int64_t n_taken;   // snapshots written since create
    int64_t n_evicted; // dropped for room (least recently used) since create
    int64_t n_dropped; // dropped with their block (evicted from the prefix cache, removed)
} di_tail_cache_stats;

// Snapshots of snap_bytes for the blocks 0 .. n_ids - 1, as many as budget_bytes holds. A budget
// below one snapshot is refused (DI_ERR_INVALID: the caller leaves snapshots off instead);
// DI_ERR_NOMEM.
di_status di_tail_cache_create(int32_t n_ids, size_t snap_bytes, size_t budget_bytes,
                               di_tail_cache **out);
void di_tail_cache_destroy(di_tail_cache *tc);
size_t di_tail_cache_snap_bytes(const di_tail_cache *tc);
int32_t di_tail_cache_n_slots(const di_tail_cache *tc);

// The snapshot buffer of block id, which has none, to fill now (the least recently used snapshot
// makes room if needed). Never NULL.
uint8_t *di_tail_cache_put(di_tail_cache *tc, int32_t id);
// Block id's snapshot (now the most recently used), or NULL.
const uint8_t *di_tail_cache_get(di_tail_cache *tc, int32_t id);
bool di_tail_cache_has(const di_tail_cache *tc, int32_t id);
// Forgets block id's snapshot, if any (its block left the prefix cache).
void di_tail_cache_drop(di_tail_cache *tc, int32_t id);
void di_tail_cache_get_stats(const di_tail_cache *tc, di_tail_cache_stats *st);
