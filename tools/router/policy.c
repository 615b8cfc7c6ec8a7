// policy — routing key, consistent-hash ring and the affine-or-least-loaded choice (policy.h).
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "router/policy.h"

uint64_t rt_hash(const void *p, size_t n) {
    const unsigned char *b = p;
    uint64_t h = 0xcbf29ce484222325ull;
    for (size_t i = 0; i < n; i++) {
        h ^= b[i];
        h *= 0x100000001b3ull;
    }
    h ^= h >> 30;
    h *= 0xbf58476d1ce4e5b9ull;
    h ^= h >> 27;
    h *= 0x94d049bb133111ebull;
    h ^= h >> 31;
    return h;
}

// ---- routing key ----

typedef struct keybuf {
    char *p;
    size_t n, cap;
} keybuf;

static void kadd(keybuf *k, const char *s, size_t n) {
    size_t room = k->cap - k->n;
    if (n > room) n = room;
    memcpy(k->p + k->n, s, n);
    k->n += n;
}

static void kadd_json(keybuf *k, const json_t *v) {
    if (k->n >= k->cap) return;
    char *s = json_dumps(v, JSON_COMPACT | JSON_SORT_KEYS | JSON_ENCODE_ANY);
    if (!s) return; // out of memory: a shorter key only costs affinity
    kadd(k, s, strlen(s));
    kadd(k, "\n", 1);
    free(s);
}

size_t rt_prefix_key(const json_t *req, bool pin_user, char *out, size_t cap, bool *pinned) {
    keybuf k = {out, 0, cap};
    *pinned = false;
    if (pin_user) {
        const char *u = json_string_value(json_object_get(req, "user"));
        if (!u) u = json_string_value(json_object_get(json_object_get(req, "metadata"), "user_id"));
        if (u && *u) {
            kadd(&k, "user\x1f", 5);
            kadd(&k, u, strlen(u));
            *pinned = true;
            return k.n;
        }
    }
    static const char *const k_fields[] = {"system",   "instructions", "tools",
                                           "messages", "input",        "prompt"};
    for (size_t f = 0; f < sizeof k_fields / sizeof k_fields[0] && k.n < cap; f++) {
        const json_t *v = json_object_get(req, k_fields[f]);
        if (!v || json_is_null(v)) continue;
        kadd(&k, k_fields[f], strlen(k_fields[f]));
        kadd(&k, "\x1f", 1);
        if (json_is_array(v)) {
            for (size_t i = 0; i < json_array_size(v) && k.n < cap; i++)
                kadd_json(&k, json_array_get(v, i));
        } else {
            kadd_json(&k, v);
        }
    }
    return k.n;
}

bool rt_replica_url(const char *s, char *out, size_t cap) {
    if (strstr(s, "://") && strncmp(s, "http://", 7)) return false;
    int n = snprintf(out, cap, "%s%s", strncmp(s, "http://", 7) ? "http://" : "", s);
    if (n <= 7 || (size_t)n >= cap) return false;
    while (n > 7 && out[n - 1] == '/') out[--n] = 0;
    return n > 7;
}

// ---- prefixes sent to a replica ----

int rt_chain(const char *text, size_t n, uint64_t *out, int cap) {
    int k = 0;
    uint64_t prev = 0;
    for (size_t off = 0; off + RT_CHUNK <= n && k < cap; off += RT_CHUNK) {
        unsigned char buf[8 + RT_CHUNK];
        memcpy(buf, &prev, 8);
        memcpy(buf + 8, text + off, RT_CHUNK);
        prev = rt_hash(buf, sizeof buf);
        out[k++] = prev ? prev : 1; // 0 marks an empty slot
    }
    return k;
}

bool rt_seen_init(rt_seen *s, int log2_slots) {
    s->h = NULL;
    s->mask = 0;
    if (log2_slots < 1 || log2_slots > 30) return false;
    s->h = calloc((size_t)1 << log2_slots, sizeof *s->h);
    if (!s->h) return false;
    s->mask = (uint32_t)(((size_t)1 << log2_slots) - 1);
    return true;
}

void rt_seen_free(rt_seen *s) {
    free(s->h);
    s->h = NULL;
    s->mask = 0;
}

void rt_seen_clear(rt_seen *s) {
    if (s->h) memset(s->h, 0, sizeof *s->h * ((size_t)s->mask + 1));
}

// The two slots of h's set.
static uint32_t seen_set(const rt_seen *s, uint64_t h) {
    return (uint32_t)h & s->mask & ~1u;
}

static bool seen_has(const rt_seen *s, uint64_t h) {
    const uint32_t i = seen_set(s, h);
    return s->h[i] == h || s->h[i + 1] == h;
}

void rt_seen_add(rt_seen *s, const uint64_t *chain, int n) {
    if (!s->h) return;
    for (int k = 0; k < n; k++) {
        const uint64_t h = chain[k];
        const uint32_t i = seen_set(s, h);
        if (s->h[i] == h || s->h[i + 1] == h) continue;
        // The newer hash goes to the way the older entry leaves: way 0 holds the newest.
        s->h[i + 1] = s->h[i];
        s->h[i] = h;
    }
}

int rt_seen_match(const rt_seen *s, const uint64_t *chain, int n) {
    if (!s->h) return 0;
    for (int k = n; k > 0; k--)
        if (seen_has(s, chain[k - 1])) return k;
    return 0;
}

// ---- consistent-hash ring ----

typedef struct point {
    uint64_t h;
    int replica;
} point;

struct rt_ring {
    point *pts; // owned, sorted by h
    int n_pts, n_replicas;
};

static int cmp_point(const void *a, const void *b) {
    const point *x = a, *y = b;
    if (x->h != y->h) return x->h < y->h ? -1 : 1;
    return x->replica - y->replica; // equal hashes: a stable order
}

bool rt_ring_create(int n_replicas, const char *const *names, int n_vnodes, rt_ring **out) {
    if (n_replicas <= 0 || n_vnodes <= 0) return false;
    rt_ring *r = calloc(1, sizeof *r);
    if (!r) return false;
    r->pts = calloc((size_t)n_replicas * (size_t)n_vnodes, sizeof *r->pts);
    if (!r->pts) {
        free(r);
        return false;
    }
    char buf[1100];
    for (int i = 0; i < n_replicas; i++)
        for (int v = 0; v < n_vnodes; v++) {
            int len = snprintf(buf, sizeof buf, "%.1024s#%d", names[i], v);
            r->pts[r->n_pts++] = (point){rt_hash(buf, (size_t)len), i};
        }
    qsort(r->pts, (size_t)r->n_pts, sizeof *r->pts, cmp_point);
    r->n_replicas = n_replicas;
    *out = r;
    return true;
}

void rt_ring_destroy(rt_ring *r) {
    if (!r) return;
    free(r->pts);
    free(r);
}

int rt_ring_lookup(const rt_ring *r, uint64_t h, const bool *usable) {
    int lo = 0, hi = r->n_pts; // first point with hash >= h (wrapping to 0)
    while (lo < hi) {
        int mid = lo + (hi - lo) / 2;
        if (r->pts[mid].h < h)
            lo = mid + 1;
        else
            hi = mid;
    }
    for (int k = 0; k < r->n_pts; k++) {
        int rep = r->pts[(lo + k) % r->n_pts].replica;
        if (usable[rep]) return rep;
    }
    return -1;
}

// ---- the choice ----

int rt_policy_pick(const rt_ring *r, bool has_key, uint64_t key, const int *match,
                   const rt_replica_load *loads, int n, int exclude, int64_t max_imbalance,
                   rt_pick *how) {
    bool usable[256], cand[256];
    if (n > 256) n = 256; // the CLI caps replicas at 64
    int least = -1;
    int64_t min_load = 0;
    for (int i = 0; i < n; i++) {
        usable[i] = loads[i].healthy && i != exclude;
        if (!usable[i]) continue;
        int64_t l = loads[i].n_inflight + loads[i].n_waiting;
        if (least < 0 || l < min_load) {
            least = i;
            min_load = l;
        }
    }
    if (least < 0) {
        *how = RT_PICK_NONE;
        return -1;
    }
    if (!has_key || exclude >= 0) {
        *how = RT_PICK_LEAST;
        return least;
    }
    int best = 0; // the longest match among the usable replicas
    for (int i = 0; match && i < n; i++)
        if (usable[i] && match[i] > best) best = match[i];
    for (int i = 0; i < n; i++) cand[i] = usable[i] && (best == 0 || match[i] == best);
    int a = rt_ring_lookup(r, key, cand);
    int64_t la = loads[a].n_inflight + loads[a].n_waiting;
    if (la >= min_load + max_imbalance && a != least) {
        *how = RT_PICK_FALLBACK;
        return least;
    }
    *how = best > 0 ? RT_PICK_MATCH : RT_PICK_AFFINE;
    return a;
}
