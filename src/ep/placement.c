// placement — the expert-parallel placement table (ep/placement.h).
#include "ep/placement.h"

#include <stdio.h>
#include <string.h>

#include "base/mem.h"

di_status di_ep_placement_alloc(int32_t n_layers, int32_t n_expert, int32_t n_ranks,
                                int32_t n_slots, di_ep_placement *out) {
    memset(out, 0, sizeof(*out));
    if (n_layers < 1 || n_expert < 1 || n_ranks < 1 || n_slots < n_expert) return DI_ERR_INVALID;
    const size_t n = di_mul_size((size_t)n_layers, (size_t)n_slots);
    if (n == 0) return DI_ERR_INVALID;
    out->expert = di_calloc(n, sizeof(int32_t));
    out->rank = di_calloc(n, sizeof(int32_t));
    if (!out->expert || !out->rank) {
        di_ep_placement_free(out);
        return DI_ERR_NOMEM;
    }
    out->n_layers = n_layers;
    out->n_expert = n_expert;
    out->n_ranks = n_ranks;
    out->n_slots = n_slots;
    return DI_OK;
}

di_status di_ep_placement_contiguous(int32_t n_layers, int32_t n_expert, int32_t n_ranks,
                                     di_ep_placement *out) {
    di_status st = di_ep_placement_alloc(n_layers, n_expert, n_ranks, n_expert, out);
    if (st != DI_OK) return st;
    for (int32_t l = 0; l < n_layers; l++)
        for (int32_t e = 0; e < n_expert; e++) {
            out->expert[(int64_t)l * n_expert + e] = e;
            out->rank[(int64_t)l * n_expert + e] = (int32_t)((int64_t)e * n_ranks / n_expert);
        }
    return DI_OK;
}

di_status di_ep_placement_check(const di_ep_placement *p, char *why, size_t why_n) {
    char scratch[8];
    if (!why) {
        why = scratch;
        why_n = sizeof(scratch);
    }
    if (p->n_layers < 1 || p->n_expert < 1 || p->n_ranks < 1 || p->n_slots < p->n_expert ||
        !p->expert || !p->rank) {
        snprintf(why, why_n, "bad shape: %d layers, %d experts, %d ranks, %d replicas per layer",
                 p->n_layers, p->n_expert, p->n_ranks, p->n_slots);
        return DI_ERR_INVALID;
    }
    int32_t *seen = di_calloc((size_t)p->n_expert, sizeof(int32_t));
    if (!seen) {
        snprintf(why, why_n, "out of memory");
        return DI_ERR_NOMEM;
    }
    di_status st = DI_OK;
    for (int32_t l = 0; l < p->n_layers && st == DI_OK; l++) {
        memset(seen, 0, sizeof(int32_t) * (size_t)p->n_expert);
        for (int32_t s = 0; s < p->n_slots; s++) {
            const int64_t i = (int64_t)l * p->n_slots + s;
            if (p->expert[i] < 0 || p->expert[i] >= p->n_expert) {
                snprintf(why, why_n, "layer %d replica %d names expert %d (of %d)", l, s,
                         p->expert[i], p->n_expert);
                st = DI_ERR_INVALID;
                break;
            }
            if (p->rank[i] < 0 || p->rank[i] >= p->n_ranks) {
                snprintf(why, why_n, "layer %d replica %d is on rank %d (of %d)", l, s, p->rank[i],
                         p->n_ranks);
                st = DI_ERR_INVALID;
                break;
            }
            seen[p->expert[i]]++;
        }
        for (int32_t e = 0; e < p->n_expert && st == DI_OK; e++)
            if (!seen[e]) {
                snprintf(why, why_n, "layer %d expert %d has no replica", l, e);
                st = DI_ERR_INVALID;
            }
    }
    di_free(seen);
    return st;
}

di_status di_ep_placement_copy(const di_ep_placement *src, di_ep_placement *dst) {
    di_status st =
        di_ep_placement_alloc(src->n_layers, src->n_expert, src->n_ranks, src->n_slots, dst);
    if (st != DI_OK) return st;
    const size_t n = (size_t)src->n_layers * (size_t)src->n_slots * sizeof(int32_t);
    memcpy(dst->expert, src->expert, n);
    memcpy(dst->rank, src->rank, n);
    return DI_OK;
}

bool di_ep_placement_equal(const di_ep_placement *a, const di_ep_placement *b) {
    if (a->n_layers != b->n_layers || a->n_expert != b->n_expert || a->n_ranks != b->n_ranks ||
        a->n_slots != b->n_slots)
        return false;
    const size_t n = (size_t)a->n_layers * (size_t)a->n_slots * sizeof(int32_t);
    return !memcmp(a->expert, b->expert, n) && !memcmp(a->rank, b->rank, n);
}

int32_t di_ep_placement_count(const di_ep_placement *p, int32_t layer, int32_t e, int32_t rank) {
    int32_t n = 0;
    for (int32_t s = 0; s < p->n_slots; s++) {
        const int64_t i = (int64_t)layer * p->n_slots + s;
        n += p->expert[i] == e && p->rank[i] == rank;
    }
    return n;
}

void di_ep_placement_free(di_ep_placement *p) {
    di_free(p->expert);
    di_free(p->rank);
    memset(p, 0, sizeof(*p));
}
