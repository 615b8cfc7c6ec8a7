/*
 * block_pool — the KV memory: one arena of n fixed-size blocks allocated at create, handed out
 * by id with reference counts (or, created for accounting, only the ids and counts: the blocks'
 * memory is elsewhere, e.g. the device-resident forward's entry blocks, model/dsv4_dev.h). A block
 * whose count drops to zero goes back to the free list, or, if the prefix cache holds it, to an LRU
 * list of evictable cached blocks: allocation takes a free block first and evicts the least
 * recently used cached block only when none is free (the eviction hook tells the prefix cache to
 * forget it).
 *
 * Owns: the arena, the per-block counters and lists. Does not: know what a block holds.
 * Thread-safety: engine thread only.
 */
#pragma once

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "deepinfer.h" // di_status

typedef struct di_block_pool di_block_pool;

// Called when a cached block with no references is taken for reuse.
typedef void (*di_block_evict_fn)(void *user, int32_t id);

// n_blocks >= 1 blocks of block_bytes (rounded up to 64) each. DI_ERR_INVALID, DI_ERR_NOMEM.
di_status di_block_pool_create(int32_t n_blocks, size_t block_bytes, di_block_pool **out);
// The same pool without an arena: ids, counts, the free list and the LRU only (di_block_pool_ptr
// returns NULL); block_bytes is what each block stands for (reported, not allocated).
di_status di_block_pool_create_accounting(int32_t n_blocks, size_t block_bytes,
                                          di_block_pool **out);
void di_block_pool_destroy(di_block_pool *p);
void di_block_pool_set_evict(di_block_pool *p, di_block_evict_fn fn, void *user);

// Takes a block (count 1). DI_ERR_NO_KV when every block is referenced.
di_status di_block_pool_alloc(di_block_pool *p, int32_t *id);
// Adds a reference to a block (count >= 1, or a cached block with count 0, which leaves the LRU).
void di_block_pool_ref(di_block_pool *p, int32_t id);
// Drops a reference; at zero the block is free, or evictable if cached.
void di_block_pool_unref(di_block_pool *p, int32_t id);
// Marks a block as held by the prefix cache (evictable at count 0) or not.
void di_block_pool_set_cached(di_block_pool *p, int32_t id, bool cached);

void *di_block_pool_ptr(const di_block_pool *p, int32_t id); // NULL without an arena
int32_t di_block_pool_refs(const di_block_pool *p, int32_t id);
int32_t di_block_pool_n_total(const di_block_pool *p);
// Blocks an allocation can get: free + evictable cached.
int32_t di_block_pool_n_available(const di_block_pool *p);
// Cached blocks with no reference (evictable).
int32_t di_block_pool_n_cached_idle(const di_block_pool *p);
size_t di_block_pool_block_bytes(const di_block_pool *p);
// The idle cached blocks from the most recently used on: the first, then the one after id; -1 at
// the end.
int32_t di_block_pool_lru_newest(const di_block_pool *p);
int32_t di_block_pool_lru_older(const di_block_pool *p, int32_t id);
