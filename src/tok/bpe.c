// bpe — byte-level BPE merges (see bpe.h).
#include "tok/bpe.h"

#include <string.h>

#include "base/mem.h"

// Pieces up to this many bytes use the array scan (O(n^2) integer compares, O(n) hash lookups),
// longer ones the heap (O(n log n)); both apply merges in exactly the same order.
#define SCAN_MAX_BYTES 64

di_status di_bpe_ids_push(di_bpe_ids *a, int32_t id) {
    if (a->n == a->cap) {
        size_t ncap = a->cap ? a->cap * 2 : 64;
        int32_t *ni = di_realloc(a->ids, ncap * sizeof *ni);
        if (!ni) return DI_ERR_NOMEM;
        a->ids = ni;
        a->cap = ncap;
    }
    a->ids[a->n++] = id;
    return DI_OK;
}

void di_bpe_ids_deinit(di_bpe_ids *a) {
    di_free(a->ids);
    memset(a, 0, sizeof *a);
}

void di_bpe_scratch_init(di_bpe_scratch *s) {
    memset(s, 0, sizeof *s);
}

void di_bpe_scratch_deinit(di_bpe_scratch *s) {
    di_free(s->sym);
    di_free(s->rank);
    di_free(s->next);
    di_free(s->prev);
    di_free(s->heap);
    memset(s, 0, sizeof *s);
}

static di_status scratch_reserve(di_bpe_scratch *s, size_t n) {
    if (n <= s->cap) return DI_OK;
    size_t cap = s->cap ? s->cap : 256;
    while (cap < n) cap *= 2;
    int32_t *a = di_realloc(s->sym, cap * sizeof *a);
    if (!a) return DI_ERR_NOMEM;
    s->sym = a;
    if (!(a = di_realloc(s->rank, cap * sizeof *a))) return DI_ERR_NOMEM;
    s->rank = a;
    if (!(a = di_realloc(s->next, cap * sizeof *a))) return DI_ERR_NOMEM;
    s->next = a;
    if (!(a = di_realloc(s->prev, cap * sizeof *a))) return DI_ERR_NOMEM;
    s->prev = a;
    s->cap = cap;
    return DI_OK;
}

static inline int32_t pair_rank(const di_vocab *v, int32_t a, int32_t b) {
    int32_t r, id;
    return di_vocab_merge(v, a, b, &r, &id) ? r : INT32_MAX;
}

// ---- short pieces: array scan ----

static di_status encode_scan(const di_vocab *v, di_bpe_scratch *s, const char *p, size_t n,
                             di_bpe_ids *out) {
    int32_t *sym = s->sym, *rank = s->rank;
    size_t m = n;
    for (size_t i = 0; i < n; i++) sym[i] = v->byte_id[(uint8_t)p[i]];
    for (size_t i = 0; i + 1 < m; i++) rank[i] = pair_rank(v, sym[i], sym[i + 1]);
    while (m > 1) {
        int32_t best = INT32_MAX;
        size_t bi = 0;
        for (size_t i = 0; i + 1 < m; i++)
            if (rank[i] < best) {
                best = rank[i];
                bi = i;
            }
        if (best == INT32_MAX) break;
        int32_t r = 0, id = 0;
        di_vocab_merge(v, sym[bi], sym[bi + 1], &r, &id);
        sym[bi] = id;
        memmove(sym + bi + 1, sym + bi + 2, (m - bi - 2) * sizeof *sym);
        if (bi + 2 < m) memmove(rank + bi + 1, rank + bi + 2, (m - bi - 3) * sizeof *rank);
        m--;
        if (bi > 0) rank[bi - 1] = pair_rank(v, sym[bi - 1], sym[bi]);
        if (bi + 1 < m) rank[bi] = pair_rank(v, sym[bi], sym[bi + 1]);
    }
    for (size_t i = 0; i < m; i++) {
        di_status st = di_bpe_ids_push(out, sym[i]);
        if (st != DI_OK) return st;
    }
    return DI_OK;
}

// ---- long pieces: linked list and min-heap (HF's Word::merge_all) ----

static void heap_push(uint64_t *h, size_t *n, uint64_t x) {
    size_t i = (*n)++;
    while (i > 0) {
        size_t p = (i - 1) / 2;
        if (h[p] <= x) break;
        h[i] = h[p];
        i = p;
    }
    h[i] = x;
}

static uint64_t heap_pop(uint64_t *h, size_t *n) {
    uint64_t top = h[0], x = h[--(*n)];
    size_t i = 0;
    for (;;) {
        size_t c = 2 * i + 1;
        if (c >= *n) break;
        if (c + 1 < *n && h[c + 1] < h[c]) c++;
        if (h[c] >= x) break;
        h[i] = h[c];
        i = c;
    }
    if (*n) h[i] = x;
    return top;
}

static di_status encode_heap(const di_vocab *v, di_bpe_scratch *s, const char *p, size_t n,
                             di_bpe_ids *out) {
    // Every merge pushes at most two entries; n initial entries + 2 per merge.
    size_t need = 3 * n + 1;
    if (s->heap_cap < need) {
        uint64_t *h = di_realloc(s->heap, need * sizeof *h);
        if (!h) return DI_ERR_NOMEM;
        s->heap = h;
        s->heap_cap = need;
    }
    int32_t *sym = s->sym, *next = s->next, *prev = s->prev;
    uint64_t *heap = s->heap;
    size_t hn = 0;
    for (size_t i = 0; i < n; i++) {
        sym[i] = v->byte_id[(uint8_t)p[i]];
        next[i] = i + 1 < n ? (int32_t)(i + 1) : -1;
        prev[i] = (int32_t)i - 1;
    }
    for (size_t i = 0; i + 1 < n; i++) {
        int32_t r = pair_rank(v, sym[i], sym[i + 1]);
        if (r != INT32_MAX) heap_push(heap, &hn, ((uint64_t)(uint32_t)r << 32) | i);
    }
    while (hn) {
        uint64_t top = heap_pop(heap, &hn);
        int32_t r = (int32_t)(top >> 32), pos = (int32_t)(uint32_t)top;
        if (sym[pos] < 0 || next[pos] < 0) continue; // symbol merged away, or now last
        int32_t nx = next[pos], cr, id;
        // Stale entry: the pair at pos changed since it was pushed (its rank differs; a changed
        // pair always spans more bytes and so merges to a different token, as HF checks).
        if (!di_vocab_merge(v, sym[pos], sym[nx], &cr, &id) || cr != r) continue;
        sym[pos] = id;
        sym[nx] = -1;
        next[pos] = next[nx];
        if (next[nx] >= 0) prev[next[nx]] = pos;
        if (prev[pos] >= 0) {
            int32_t pp = prev[pos], pr = pair_rank(v, sym[pp], sym[pos]);
            if (pr != INT32_MAX)
                heap_push(heap, &hn, ((uint64_t)(uint32_t)pr << 32) | (uint32_t)pp);
        }
        if (next[pos] >= 0) {
            int32_t nr = pair_rank(v, sym[pos], sym[next[pos]]);
            if (nr != INT32_MAX)
                heap_push(heap, &hn, ((uint64_t)(uint32_t)nr << 32) | (uint32_t)pos);
        }
    }
    for (int32_t i = 0; i >= 0; i = next[i]) {
        di_status st = di_bpe_ids_push(out, sym[i]);
        if (st != DI_OK) return st;
    }
    return DI_OK;
}

di_status di_bpe_encode_piece(const di_vocab *v, di_bpe_scratch *s, const char *piece, size_t n,
                              di_bpe_ids *out) {
    if (n == 0) return DI_OK;
    if (n == 1) return di_bpe_ids_push(out, v->byte_id[(uint8_t)piece[0]]);
    di_status st = scratch_reserve(s, n);
    if (st != DI_OK) return st;
    return n <= SCAN_MAX_BYTES ? encode_scan(v, s, piece, n, out)
                               : encode_heap(v, s, piece, n, out);
}
