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

int rt_policy_pick(const rt_ring *r, bool has_key, uint64_t key, const rt_replica_load *loads,
                   int n, int exclude, int64_t max_imbalance, rt_pick *how) {
    bool usable[256];
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
    int a = rt_ring_lookup(r, key, usable);
    int64_t la = loads[a].n_inflight + loads[a].n_waiting;
    if (la >= min_load + max_imbalance && a != least) {
        *how = RT_PICK_FALLBACK;
        return least;
    }
    *how = RT_PICK_AFFINE;
    return a;
}
