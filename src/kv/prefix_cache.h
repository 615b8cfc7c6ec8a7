/*
 * prefix_cache — full KV blocks of finished or running requests, found again by the tokens that
 * produced them. Block i of a sequence is keyed by a hash chain: h_i = H(h_{i-1}, tokens of block
 * i, salt, model identity), h_{-1} = 0, so a block is only reused behind the very same prefix
 * under the same salt and model. Entries also keep the block's tokens and parent hash, compared on
 * lookup, so a 64-bit hash collision can never reuse a wrong block. An optional spill function
 * sees every evicted block first (the disk tier writes it back). What a block holds and how a
 * hit is continued exactly is the KV manager's business (docs/kv-cache.md).
 *
 * Owns: the table (sized at create for every block of the pool; no allocation afterwards).
 * Borrows the block pool: the cache marks its blocks cached there and is told of evictions.
 * Thread-safety: engine thread only.
 */
#pragma once

#include <stdbool.h>
#include <stdint.h>

#include "deepinfer.h"     // di_status
#include "kv/block_pool.h" // di_block_pool

typedef struct di_prefix_cache di_prefix_cache;

// DI_ERR_NOMEM. Installs itself as the pool's eviction hook.
di_status di_prefix_cache_create(di_block_pool *pool, int32_t block_tokens, uint64_t model_id,
                                 di_prefix_cache **out);
void di_prefix_cache_destroy(di_prefix_cache *pc);

// The chain hash of a block after `parent` (0 for the first block).
uint64_t di_prefix_cache_hash(const di_prefix_cache *pc, uint64_t parent, const int32_t *tokens,
                              uint64_t salt);

// Longest run of cached blocks for tokens[0 .. n_blocks_max * block_tokens): writes their ids to
// ids[] (no references taken) and returns how many.
int32_t di_prefix_cache_match(di_prefix_cache *pc, const int32_t *tokens, int32_t n_blocks_max,
                              uint64_t salt, int32_t *ids);

// The cached block with chain hash h, parent and tokens, or -1 (no reference taken).
int32_t di_prefix_cache_find(const di_prefix_cache *pc, uint64_t h, uint64_t parent,
                             const int32_t *tokens);

// Records block `id` (full, final) under chain hash h with its parent, tokens and salt. Returns
// false when that hash is already cached (another sequence made the same block first).
bool di_prefix_cache_insert(di_prefix_cache *pc, uint64_t h, uint64_t parent, uint64_t salt,
                            const int32_t *tokens, int32_t id);

// Called with a cached block's identity just before the pool reuses it (eviction; its memory is
// still intact): the disk tier's write-back (kv/kv_disk.h).
typedef void (*di_prefix_cache_spill_fn)(void *user, uint64_t h, uint64_t parent, uint64_t salt,
                                         const int32_t *tokens, int32_t id);
void di_prefix_cache_set_spill(di_prefix_cache *pc, di_prefix_cache_spill_fn fn, void *user);
// Calls the spill function for cached blocks, most recently used first (those in use, then the
// idle ones newest first), until it has returned true max_n times (orderly shutdown: the blocks
// most worth keeping, within the disk budget) or every block was offered; returns how many it
// returned true for.
typedef bool (*di_prefix_cache_offer_fn)(void *user, uint64_t h, uint64_t parent, uint64_t salt,
                                         const int32_t *tokens, int32_t id);
int32_t di_prefix_cache_offer_recent(di_prefix_cache *pc, di_prefix_cache_offer_fn fn, void *user,
                                     int32_t max_n);

// Called whenever a block leaves the cache (evicted or removed), after the spill function: the
// tail snapshots attached to cached blocks (kv/tail_cache.h) go with their block.
typedef void (*di_prefix_cache_forget_fn)(void *user, int32_t id);
void di_prefix_cache_set_forget(di_prefix_cache *pc, di_prefix_cache_forget_fn fn, void *user);
// Whether block id is in the cache (published and not evicted or removed).
bool di_prefix_cache_holds(const di_prefix_cache *pc, int32_t id);

// Forgets block `id` (its contents were never computed: the step that was to write them failed);
// an idle one becomes free. Returns whether it was cached.
bool di_prefix_cache_remove(di_prefix_cache *pc, int32_t id);
int32_t di_prefix_cache_n_blocks(const di_prefix_cache *pc);
