// Tests tools/router/policy.c: the routing key, the consistent-hash ring, the prefixes sent to
// each replica (chain hashes, the bounded table) and the match-affine-or-least-loaded choice of
// `deepinfer route`.
#include "harness.h"
#include "router/policy.h"

static const char *const k_names[4] = {"http://10.0.0.1:8000", "http://10.0.0.2:8000",
                                       "http://10.0.0.3:8000", "http://10.0.0.4:8000"};

static uint64_t key_of(int i) {
    char s[32];
    int n = snprintf(s, sizeof s, "prompt-%d", i);
    return rt_hash(s, (size_t)n);
}

static void test_hash(void) {
    CHECK(rt_hash("abc", 3) == rt_hash("abc", 3));
    CHECK(rt_hash("abc", 3) != rt_hash("abd", 3));
    CHECK(rt_hash("", 0) != rt_hash("a", 1));
}

// Every replica gets a fair share of keys: 64 virtual nodes keep each within [15%, 55%] of 3.
static void test_ring_spread(void) {
    rt_ring *r = NULL;
    CHECK(rt_ring_create(3, k_names, 64, &r));
    bool all[3] = {true, true, true};
    int count[3] = {0};
    const int n = 30000;
    for (int i = 0; i < n; i++) {
        int rep = rt_ring_lookup(r, key_of(i), all);
        CHECK(rep >= 0 && rep < 3);
        if (rep >= 0 && rep < 3) count[rep]++;
    }
    for (int k = 0; k < 3; k++) {
        CHECK(count[k] > n * 15 / 100);
        CHECK(count[k] < n * 55 / 100);
    }
    bool none[3] = {false, false, false};
    CHECK_EQ(rt_ring_lookup(r, key_of(1), none), -1);
    rt_ring_destroy(r);
    rt_ring_destroy(NULL);
    CHECK(!rt_ring_create(0, k_names, 64, &r));
}

// Consistency: a replica leaving moves only its own keys; one joining takes keys only to itself.
static void test_ring_consistency(void) {
    rt_ring *r3 = NULL, *r4 = NULL;
    CHECK(rt_ring_create(3, k_names, 64, &r3));
    CHECK(rt_ring_create(4, k_names, 64, &r4));
    bool all[4] = {true, true, true, true};
    bool no1[3] = {true, false, true};
    int moved = 0, joined = 0;
    for (int i = 0; i < 5000; i++) {
        int before = rt_ring_lookup(r3, key_of(i), all);
        int after = rt_ring_lookup(r3, key_of(i), no1);
        if (before != 1) {
            CHECK_EQ(after, before);
        } else {
            moved++;
            CHECK(after == 0 || after == 2);
        }
        int with4 = rt_ring_lookup(r4, key_of(i), all);
        if (with4 != before) {
            CHECK_EQ(with4, 3);
            joined++;
        }
    }
    CHECK(moved > 0);
    CHECK(joined > 5000 / 10 && joined < 5000 * 45 / 100); // about a quarter
    rt_ring_destroy(r3);
    rt_ring_destroy(r4);
}

static void test_policy(void) {
    rt_ring *r = NULL;
    CHECK(rt_ring_create(3, k_names, 64, &r));
    rt_replica_load l[3] = {{true, 0, 0}, {true, 0, 0}, {true, 0, 0}};
    bool all[3] = {true, true, true};
    uint64_t key = key_of(7);
    int a = rt_ring_lookup(r, key, all);
    rt_pick how = RT_PICK_NONE;
    CHECK_EQ(rt_policy_pick(r, true, key, NULL, l, 3, -1, 4, &how), a);
    CHECK_EQ(how, RT_PICK_AFFINE);
    // Below the margin: still affine. In-flight and waiting add up.
    l[a].n_inflight = 2;
    l[a].n_waiting = 1;
    CHECK_EQ(rt_policy_pick(r, true, key, NULL, l, 3, -1, 4, &how), a);
    CHECK_EQ(how, RT_PICK_AFFINE);
    // At min + margin: the least-loaded one (the lowest index among equals).
    l[a].n_waiting = 2;
    int other = a == 0 ? 1 : 0;
    CHECK_EQ(rt_policy_pick(r, true, key, NULL, l, 3, -1, 4, &how), other);
    CHECK_EQ(how, RT_PICK_FALLBACK);
    // Relative, not absolute: everyone busy, the affine one is not overloaded.
    for (int k = 0; k < 3; k++) l[k].n_inflight = 10;
    l[a].n_waiting = 3;
    CHECK_EQ(rt_policy_pick(r, true, key, NULL, l, 3, -1, 4, &how), a);
    CHECK_EQ(how, RT_PICK_AFFINE);
    // Unhealthy replicas are never chosen; the key moves along the ring.
    l[a].healthy = false;
    int b = rt_policy_pick(r, true, key, NULL, l, 3, -1, 4, &how);
    CHECK(b >= 0 && b != a);
    CHECK_EQ(how, RT_PICK_AFFINE);
    // A retry excludes the failed replica and takes the least loaded.
    l[a].healthy = true;
    for (int k = 0; k < 3; k++) l[k] = (rt_replica_load){true, 5 - k, 0};
    CHECK_EQ(rt_policy_pick(r, true, key, NULL, l, 3, 2, 4, &how), 1);
    CHECK_EQ(how, RT_PICK_LEAST);
    CHECK_EQ(rt_policy_pick(r, false, 0, NULL, l, 3, -1, 4, &how), 2);
    CHECK_EQ(how, RT_PICK_LEAST);
    // Nothing healthy (or only the excluded one): none.
    for (int k = 0; k < 3; k++) l[k].healthy = false;
    CHECK_EQ(rt_policy_pick(r, true, key, NULL, l, 3, -1, 4, &how), -1);
    CHECK_EQ(how, RT_PICK_NONE);
    l[1].healthy = true;
    CHECK_EQ(rt_policy_pick(r, true, key, NULL, l, 3, 1, 4, &how), -1);
    CHECK_EQ(how, RT_PICK_NONE);
    rt_ring_destroy(r);
}

// Chain hashes: whole chunks only, equal prefixes give equal hashes, a change in a chunk changes
// that hash and every later one.
static void test_chain(void) {
    char a[5 * RT_CHUNK + 10], b[sizeof a];
    for (size_t i = 0; i < sizeof a; i++) a[i] = (char)('a' + i % 23);
    memcpy(b, a, sizeof a);
    b[2 * RT_CHUNK + 5] ^= 1; // inside chunk 2
    uint64_t ca[8], cb[8];
    CHECK_EQ(rt_chain(a, sizeof a, ca, 8), 5);
    CHECK_EQ(rt_chain(b, sizeof b, cb, 8), 5);
    CHECK(ca[0] == cb[0] && ca[1] == cb[1]);
    for (int k = 2; k < 5; k++) CHECK(ca[k] != cb[k]);
    CHECK_EQ(rt_chain(a, RT_CHUNK - 1, ca, 8), 0);
    CHECK_EQ(rt_chain(a, sizeof a, ca, 3), 3);
    uint64_t c1[1];
    CHECK_EQ(rt_chain(a + RT_CHUNK, RT_CHUNK, c1, 1), 1);
    CHECK(c1[0] != ca[1]); // a chunk's hash depends on what precedes it
}

// The table: the longest recorded prefix, bounded memory (old entries evicted), cleared.
static void test_seen(void) {
    rt_seen s;
    CHECK(!rt_seen_init(&s, 0));
    CHECK(rt_seen_init(&s, 6)); // 64 slots
    char t[6 * RT_CHUNK];
    for (size_t i = 0; i < sizeof t; i++) t[i] = (char)(i * 7 + 3);
    uint64_t c[6], d[6];
    CHECK_EQ(rt_chain(t, sizeof t, c, 6), 6);
    CHECK_EQ(rt_seen_match(&s, c, 6), 0);
    rt_seen_add(&s, c, 3);                // a request of 3 chunks was sent
    CHECK_EQ(rt_seen_match(&s, c, 6), 3); // a longer one shares 3
    CHECK_EQ(rt_seen_match(&s, c, 2), 2);
    t[RT_CHUNK / 2] ^= 1; // another first chunk: nothing in common
    CHECK_EQ(rt_chain(t, sizeof t, d, 6), 6);
    CHECK_EQ(rt_seen_match(&s, d, 6), 0);
    // Many other prefixes later the old one is gone: the table is bounded.
    for (int k = 0; k < 200; k++) {
        char u[RT_CHUNK];
        memset(u, k, sizeof u);
        u[0] = 'Z';
        uint64_t e[1];
        CHECK_EQ(rt_chain(u, sizeof u, e, 1), 1);
        rt_seen_add(&s, e, 1);
        CHECK_EQ(rt_seen_match(&s, e, 1), 1); // the newest is always found
    }
    CHECK(rt_seen_match(&s, c, 3) < 3);
    rt_seen_add(&s, c, 3);
    CHECK_EQ(rt_seen_match(&s, c, 3), 3);
    rt_seen_clear(&s);
    CHECK_EQ(rt_seen_match(&s, c, 3), 0);
    rt_seen_free(&s);
    CHECK_EQ(rt_seen_match(&s, c, 3), 0); // a freed table matches nothing
}

// The longest match wins over the ring; ties go to the ring's replica among them; an overloaded
// match falls back to the least loaded; unusable replicas' matches do not count.
static void test_policy_match(void) {
    rt_ring *r = NULL;
    CHECK(rt_ring_create(3, k_names, 64, &r));
    rt_replica_load l[3] = {{true, 0, 0}, {true, 0, 0}, {true, 0, 0}};
    bool all[3] = {true, true, true};
    uint64_t key = key_of(11);
    const int a = rt_ring_lookup(r, key, all), o = (a + 1) % 3, p = (a + 2) % 3;
    rt_pick how = RT_PICK_NONE;
    int m[3] = {0, 0, 0};
    CHECK_EQ(rt_policy_pick(r, true, key, m, l, 3, -1, 4, &how), a); // no match: the ring
    CHECK_EQ(how, RT_PICK_AFFINE);
    m[o] = 2;
    m[p] = 1;
    CHECK_EQ(rt_policy_pick(r, true, key, m, l, 3, -1, 4, &how), o); // the longest match
    CHECK_EQ(how, RT_PICK_MATCH);
    m[p] = 2; // a tie between o and p: the ring's replica among them
    bool op[3] = {false, false, false};
    op[o] = op[p] = true;
    CHECK_EQ(rt_policy_pick(r, true, key, m, l, 3, -1, 4, &how), rt_ring_lookup(r, key, op));
    CHECK_EQ(how, RT_PICK_MATCH);
    m[a] = 2; // the ring's own replica among the tied
    CHECK_EQ(rt_policy_pick(r, true, key, m, l, 3, -1, 4, &how), a);
    m[a] = 0;
    m[p] = 1;
    l[o].n_inflight = 4; // the match is overloaded: the least loaded
    int least = a < p ? a : p;
    CHECK_EQ(rt_policy_pick(r, true, key, m, l, 3, -1, 4, &how), least);
    CHECK_EQ(how, RT_PICK_FALLBACK);
    l[o].n_inflight = 0;
    l[o].healthy = false; // an unhealthy replica's match is ignored: p's is the longest now
    CHECK_EQ(rt_policy_pick(r, true, key, m, l, 3, -1, 4, &how), p);
    CHECK_EQ(how, RT_PICK_MATCH);
    l[o].healthy = true;
    CHECK_EQ(rt_policy_pick(r, true, key, m, l, 3, o, 4, &how), least); // a retry: least loaded
    CHECK_EQ(how, RT_PICK_LEAST);
    rt_ring_destroy(r);
}

static size_t key_str(const char *json, bool pin, char *out, size_t cap, bool *pinned) {
    json_t *j = json_loads(json, 0, NULL);
    CHECK(j != NULL);
    size_t n = rt_prefix_key(j, pin, out, cap, pinned);
    json_decref(j);
    return n;
}

static void test_prefix_key(void) {
    char a[4096], b[4096];
    bool pinned;
    // A conversation extended by more messages keeps its shorter form as a byte prefix.
    size_t na = key_str("{\"messages\":[{\"role\":\"system\",\"content\":\"S\"},"
                        "{\"role\":\"user\",\"content\":\"hi\"}]}",
                        true, a, sizeof a, &pinned);
    size_t nb = key_str("{\"messages\":[{\"content\":\"S\",\"role\":\"system\"},"
                        "{\"role\":\"user\",\"content\":\"hi\"},"
                        "{\"role\":\"assistant\",\"content\":\"yo\"}],\"max_tokens\":9}",
                        true, b, sizeof b, &pinned);
    CHECK(!pinned);
    CHECK(na > 0 && nb > na);
    CHECK(memcmp(a, b, na) == 0); // key order inside a message does not matter
    CHECK(memcmp(a, "messages\x1f{\"content\":\"S\",\"role\":\"system\"}\n", 40) == 0);
    // Only the first cap bytes count: a shared long prefix gives one key.
    char big[600];
    memset(big, 'x', sizeof big - 1);
    big[sizeof big - 1] = 0;
    char ja[800], jb[800];
    snprintf(ja, sizeof ja, "{\"prompt\":\"%s one\"}", big);
    snprintf(jb, sizeof jb, "{\"prompt\":\"%s two\"}", big);
    na = key_str(ja, true, a, 256, &pinned);
    nb = key_str(jb, true, b, 256, &pinned);
    CHECK_EQ(na, 256);
    CHECK_EQ(nb, 256);
    CHECK(rt_hash(a, na) == rt_hash(b, nb));
    na = key_str(ja, true, a, sizeof a, &pinned);
    nb = key_str(jb, true, b, sizeof b, &pinned);
    CHECK(rt_hash(a, na) != rt_hash(b, nb));
    // Field order is fixed: system before messages whatever the body's order.
    na = key_str("{\"messages\":[1],\"system\":\"S\"}", true, a, sizeof a, &pinned);
    CHECK(na > 7 && memcmp(a, "system\x1f\"S\"\n", 11) == 0);
    // A user pins (when enabled) whatever the prompt.
    na = key_str("{\"user\":\"u1\",\"prompt\":\"p\"}", true, a, sizeof a, &pinned);
    CHECK(pinned);
    CHECK(na == 7 && memcmp(a, "user\x1fu1", 7) == 0);
    na = key_str("{\"metadata\":{\"user_id\":\"u1\"},\"messages\":[]}", true, b, sizeof b, &pinned);
    CHECK(pinned && na == 7 && memcmp(b, "user\x1fu1", 7) == 0);
    na = key_str("{\"user\":\"u1\",\"prompt\":\"p\"}", false, a, sizeof a, &pinned);
    CHECK(!pinned && na > 0 && memcmp(a, "prompt\x1f", 7) == 0);
    // Nothing to hash.
    CHECK_EQ(key_str("{\"model\":\"m\"}", true, a, sizeof a, &pinned), 0);
}

// rt_replica_url: the scheme added when missing, trailing slashes dropped, other schemes, empty
// and too-long addresses refused.
static void test_replica_url(void) {
    char out[32];
    CHECK(rt_replica_url("127.0.0.1:8001", out, sizeof out));
    CHECK_STR_EQ(out, "http://127.0.0.1:8001");
    CHECK(rt_replica_url("http://h:1//", out, sizeof out));
    CHECK_STR_EQ(out, "http://h:1");
    CHECK(!rt_replica_url("https://h:1", out, sizeof out));
    CHECK(!rt_replica_url("ftp://h:1", out, sizeof out));
    CHECK(!rt_replica_url("", out, sizeof out));
    CHECK(!rt_replica_url("http://", out, sizeof out));
    CHECK(!rt_replica_url("http:///", out, sizeof out));
    CHECK(!rt_replica_url("a-host-name-that-is-far-too-long:8000", out, sizeof out));
}

int main(void) {
    RUN(test_hash);
    RUN(test_ring_spread);
    RUN(test_ring_consistency);
    RUN(test_policy);
    RUN(test_chain);
    RUN(test_seen);
    RUN(test_policy_match);
    RUN(test_prefix_key);
    RUN(test_replica_url);
    return test_finish();
}
