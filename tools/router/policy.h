/*
 * policy — the routing decision of `deepinfer route` (docs/router.md), free of I/O so that it is
 * unit-tested on its own (tests/router/test_router_policy.c):
 *   - rt_prefix_key: the canonical prefix of a request that decides its replica;
 *   - rt_ring: a consistent-hash ring of the replicas with virtual nodes;
 *   - rt_chain / rt_seen: the prefixes the router sent to each replica (chain hashes of the
 *     canonical prompt text in RT_CHUNK-byte chunks), to find the replica whose prefix cache
 *     holds the longest part of a new request's prompt;
 *   - rt_policy_pick: the replica with the longest such match, else prefix affinity on the ring,
 *     falling back to the least-loaded healthy replica when the chosen one is overloaded.
 * Owns the ring's points and a table's slots. Thread-safety: a ring is immutable after
 * rt_ring_create and may be read from any thread; an rt_seen is the caller's to lock (the router
 * holds rt.mu); the other functions keep no state.
 */
#pragma once

#include <jansson.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

// 64-bit FNV-1a followed by the splitmix64 finaliser (FNV alone clusters on short keys).
uint64_t rt_hash(const void *p, size_t n);

// The routing key of a parsed request body, written to out (at most cap bytes, not terminated);
// returns its length. When the request names a user (OpenAI `user`, Anthropic
// `metadata.user_id`) and pin_user is set, the key is "user\x1f" + that name (*pinned = true).
// Otherwise it is the first cap bytes of the canonical prompt text: for each of the fields
// system, instructions, tools, messages, input, prompt present in the body, in that order, the
// field name and "\x1f", then for an array every element as compact JSON with sorted keys
// followed by "\n", for any other value its compact JSON followed by "\n". A conversation extended
// by further messages therefore has its shorter form as a byte prefix. 0: nothing to hash.
size_t rt_prefix_key(const json_t *req, bool pin_user, char *out, size_t cap, bool *pinned);

// A replica's address as given ("http://host:port[/...]" or "host:port") into out as
// "http://host:port" without trailing slashes; false if the scheme is not http, or the result is
// empty or longer than cap - 1.
bool rt_replica_url(const char *s, char *out, size_t cap);

// ---- prefixes sent to a replica ----

// Bytes of canonical prompt text per chain hash: a request matches a replica in whole chunks.
#define RT_CHUNK 256

// The chain hashes of text[0, n): out[i] covers its first (i + 1) * RT_CHUNK bytes (each hash
// folds the previous one with the next chunk, so equal hashes mean equal prefixes); whole chunks
// only, at most cap of them. Returns how many.
int rt_chain(const char *text, size_t n, uint64_t *out, int cap);

// A bounded set of chain hashes (2-way set-associative, 2^log2_slots slots, a newer hash evicting
// an older one of its set): the prefixes recently sent to one replica. A hint, never a promise:
// the replica's own cache may have evicted them (the cost is a cache miss there).
typedef struct rt_seen {
    uint64_t *h; // owned [mask + 1]; 0: empty
    uint32_t mask;
} rt_seen;

bool rt_seen_init(rt_seen *s, int log2_slots); // false on out of memory or a bad size
void rt_seen_free(rt_seen *s);
void rt_seen_clear(rt_seen *s); // the replica restarted or left rotation: it holds nothing known
void rt_seen_add(rt_seen *s, const uint64_t *chain, int n);
// The chunks of chain (from rt_chain) whose prefix s holds: the largest i such that chain[i - 1]
// is in s (0: none).
int rt_seen_match(const rt_seen *s, const uint64_t *chain, int n);

typedef struct rt_ring rt_ring;

// A ring of n_vnodes points per replica at rt_hash("<name>#<k>"), k = 0..n_vnodes-1. names are
// copied only as hashes. false on out of memory or a bad argument. Destroy with rt_ring_destroy.
bool rt_ring_create(int n_replicas, const char *const *names, int n_vnodes, rt_ring **out);
void rt_ring_destroy(rt_ring *r);
// The first replica clockwise from h whose usable[i] is true, or -1 when none is.
int rt_ring_lookup(const rt_ring *r, uint64_t h, const bool *usable);

// A replica's state as the policy sees it.
typedef struct rt_replica_load {
    bool healthy;
    int64_t n_inflight; // requests the router has in flight on it
    int64_t n_waiting;  // its deepinfer:num_requests_waiting at the last poll
} rt_replica_load;

typedef enum rt_pick {
    RT_PICK_NONE = 0, // no healthy replica
    RT_PICK_AFFINE,   // the ring's replica for the key
    RT_PICK_FALLBACK, // the least-loaded one: the affine replica was overloaded
    RT_PICK_LEAST,    // the least-loaded one: no key (nothing to hash) or a retry
    RT_PICK_MATCH,    // the replica that was sent the longest prefix of the request's prompt
} rt_pick;

// load = n_inflight + n_waiting. The usable replicas are the healthy ones other than exclude.
// match (NULL: none) gives each replica's rt_seen_match for the request: the usable replicas with
// the largest match > 0 are the candidates, and among them the ring's replica for key
// (rt_ring_lookup over the candidates) is chosen (RT_PICK_MATCH); with no match, the ring's
// replica among all usable ones (RT_PICK_AFFINE). The chosen replica is overloaded when its load
// is at least min_load + max_imbalance, min_load being the least load among the usable replicas;
// then, or when has_key is false, or on a retry (exclude >= 0: the replica that failed the first
// try), the least-loaded usable one is taken (ties: the lowest index). exclude: -1 for a first
// try. Returns the replica index, or -1 with RT_PICK_NONE.
int rt_policy_pick(const rt_ring *r, bool has_key, uint64_t key, const int *match,
                   const rt_replica_load *loads, int n, int exclude, int64_t max_imbalance,
                   rt_pick *how);
