// libFuzzer target for the request-side parsing of `deepinfer route` (tools/router/policy.c,
// docs/router.md): the input is a request body exactly as a client sends it to the router, parsed
// as the router parses it (json_loadb with JSON_REJECT_DUPLICATES; anything that is not an object
// is refused before the policy sees it), then
//   - rt_prefix_key with and without user pinning, at two caps: the key never exceeds its cap, is
//     the same on a second call, and the shorter cap's key is a byte prefix of the longer's;
//   - the documented prefix property: with `messages` an array and no later keyed field (`input`,
//     `prompt`), the key of the body without its last message is a byte prefix of the full key;
//   - rt_chain on the key: whole chunks only (n / RT_CHUNK, at most its cap), and the chain of
//     the key's first half is the first part of the key's chain;
//   - rt_seen: an empty table matches nothing; after adding the chain, a match never exceeds it.
// Any crash, sanitizer report or broken property (__builtin_trap) is a finding. Seeds:
// fuzz/corpus/router/ (request bodies of the three APIs).
#include <jansson.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "router/policy.h"

enum { CAP_SHORT = 300, CAP_LONG = 4096, MAX_CHAIN = CAP_LONG / RT_CHUNK };

static void check_keys(const json_t *req, bool pin_user) {
    static char a[CAP_SHORT], b[CAP_LONG], c[CAP_LONG];
    bool pa = false, pb = false, pc = false;
    const size_t na = rt_prefix_key(req, pin_user, a, sizeof a, &pa);
    const size_t nb = rt_prefix_key(req, pin_user, b, sizeof b, &pb);
    const size_t nc = rt_prefix_key(req, pin_user, c, sizeof c, &pc);
    if (na > sizeof a || nb > sizeof b) __builtin_trap();
    if (nb != nc || pb != pc || memcmp(b, c, nb)) __builtin_trap(); // deterministic
    if (pa != pb || na > nb || memcmp(a, b, na)) __builtin_trap();  // a cap only truncates
    if (!pin_user && pb) __builtin_trap();

    uint64_t chain[MAX_CHAIN], half[MAX_CHAIN];
    const int n = rt_chain(b, nb, chain, MAX_CHAIN);
    const size_t whole = nb / RT_CHUNK;
    if (n != (int)(whole < MAX_CHAIN ? whole : MAX_CHAIN)) __builtin_trap();
    const int nh = rt_chain(b, nb / 2, half, MAX_CHAIN);
    if (nh > n || memcmp(half, chain, sizeof(uint64_t) * (size_t)nh)) __builtin_trap();
    rt_seen s;
    if (!rt_seen_init(&s, 6)) return;
    if (rt_seen_match(&s, chain, n) != 0) __builtin_trap();
    rt_seen_add(&s, chain, n);
    const int m = rt_seen_match(&s, chain, n);
    if (m < 0 || m > n) __builtin_trap();
    rt_seen_free(&s);
}

// The key of req without the last element of its messages array is a prefix of req's key when
// messages is the last field of the key that is present.
static void check_extension(json_t *req) {
    json_t *msgs = json_object_get(req, "messages");
    if (!json_is_array(msgs) || json_array_size(msgs) == 0) return;
    const json_t *input = json_object_get(req, "input"), *prompt = json_object_get(req, "prompt");
    if ((input && !json_is_null(input)) || (prompt && !json_is_null(prompt))) return;
    static char full[CAP_LONG], shorter[CAP_LONG];
    bool pinned;
    const size_t nf = rt_prefix_key(req, false, full, sizeof full, &pinned);
    json_t *copy = json_deep_copy(req);
    if (!copy) return;
    json_array_remove(json_object_get(copy, "messages"), json_array_size(msgs) - 1);
    const size_t ns = rt_prefix_key(copy, false, shorter, sizeof shorter, &pinned);
    json_decref(copy);
    if (ns > nf || memcmp(shorter, full, ns)) __builtin_trap();
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    json_error_t err;
    json_t *req = json_loadb((const char *)data, size, JSON_REJECT_DUPLICATES, &err);
    if (!req) return 0;
    if (json_is_object(req)) {
        check_keys(req, false);
        check_keys(req, true);
        check_extension(req);
    }
    json_decref(req);
    return 0;
}
