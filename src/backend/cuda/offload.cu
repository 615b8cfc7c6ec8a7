// offload — the model's matmuls on the GPU (offload.cuh).
#include <stdlib.h>
#include <string.h>

#include "backend/cuda/common.cuh"
#include "backend/cuda/gemm.cuh"
#include "backend/cuda/offload.cuh"

typedef struct entry {
    const void *data; // host view start (the key, with row0 and the shape)
    int64_t row0, ne0, ne1;
    di_tensor dev;
    bool used;
} entry;

struct di_cuda_offload {
    di_cuda *cu;  // borrowed
    entry *table; // owned, open addressing, cap a power of two
    int64_t cap, n;
    float *hx, *hy; // owned host staging
    size_t hx_cap, hy_cap;
    void *dx, *dy; // pool blocks
    size_t dx_cap, dy_cap;
    di_cuda_offload_stats stats;
};

static uint64_t key_hash(const void *p, int64_t row0, int64_t ne0, int64_t ne1) {
    uint64_t h = (uint64_t)(uintptr_t)p * 0x9e3779b97f4a7c15ull;
    h ^= (uint64_t)row0 * 0xbf58476d1ce4e5b9ull + (uint64_t)ne0 * 31 + (uint64_t)ne1;
    return h ^ (h >> 29);
}

static entry *find(entry *t, int64_t cap, const di_tensor *w) {
    uint64_t i = key_hash(w->data, w->row0, w->ne[0], w->ne[1]) & (uint64_t)(cap - 1);
    for (;; i = (i + 1) & (uint64_t)(cap - 1)) {
        entry *e = &t[i];
        if (!e->used) return e;
        if (e->data == w->data && e->row0 == w->row0 && e->ne0 == w->ne[0] && e->ne1 == w->ne[1])
            return e;
    }
}

static di_status grow_table(di_cuda_offload *o) {
    const int64_t cap = o->cap ? 2 * o->cap : 256;
    entry *t = (entry *)calloc((size_t)cap, sizeof *t);
    if (!t) return DI_ERR_NOMEM;
    for (int64_t i = 0; i < o->cap; i++) {
        if (!o->table[i].used) continue;
        di_tensor k;
        k.data = o->table[i].data, k.row0 = o->table[i].row0;
        k.ne[0] = o->table[i].ne0, k.ne[1] = o->table[i].ne1;
        *find(t, cap, &k) = o->table[i];
    }
    free(o->table);
    o->table = t;
    o->cap = cap;
    return DI_OK;
}

extern "C" di_status di_cuda_offload_create(di_cuda *cu, di_cuda_offload **out) {
    di_cuda_offload *o = (di_cuda_offload *)calloc(1, sizeof *o);
    if (!o) return DI_ERR_NOMEM;
    o->cu = cu;
    if (grow_table(o) != DI_OK) {
        free(o);
        return DI_ERR_NOMEM;
    }
    *out = o;
    return DI_OK;
}

extern "C" void di_cuda_offload_destroy(di_cuda_offload *o) {
    if (!o) return;
    di_cuda_free(o->cu, o->dx);
    di_cuda_free(o->cu, o->dy);
    free(o->table);
    free(o->hx);
    free(o->hy);
    free(o);
}

extern "C" void di_cuda_offload_get_stats(const di_cuda_offload *o, di_cuda_offload_stats *out) {
    *out = o->stats;
}

// Grows a host or device staging buffer to at least `bytes`.
static di_status host_reserve(float **p, size_t *cap, size_t bytes) {
    if (*cap >= bytes) return DI_OK;
    float *n = (float *)realloc(*p, bytes);
    if (!n) return DI_ERR_NOMEM;
    *p = n;
    *cap = bytes;
    return DI_OK;
}

static di_status dev_reserve(di_cuda *cu, void **p, size_t *cap, size_t bytes) {
    if (*cap >= bytes) return DI_OK;
    di_cuda_free(cu, *p);
    *p = NULL;
    *cap = 0;
    di_status st = di_cuda_alloc(cu, bytes, p);
    if (st == DI_OK) *cap = bytes;
    return st;
}

static di_status run(di_cuda_offload *o, const di_tensor *w, const float *x, int64_t n_tok,
                     int64_t x_stride, float *y, int64_t y_stride) {
    di_status st;
    // The calling thread may not be the one that created the context (the engine's forward
    // thread): make its device current here (cheap when it already is).
    CUDA_CHECK(cudaSetDevice(o->cu->device));
    if (o->n * 2 >= o->cap && (st = grow_table(o)) != DI_OK) return st;
    entry *e = find(o->table, o->cap, w);
    if (!e->used) { // first sight: upload once
        if ((st = di_cuda_tensor_upload(o->cu, w, &e->dev)) != DI_OK) return st;
        e->data = w->data, e->row0 = w->row0, e->ne0 = w->ne[0], e->ne1 = w->ne[1];
        e->used = true;
        o->n++;
        o->stats.n_weights++;
        // tensor/tensor.h is not declared extern "C": count the bytes here.
        o->stats.weight_bytes += w->nb1 * (size_t)w->ne[1];
        if (w->scale)
            o->stats.weight_bytes +=
                w->scale_nb1 * (size_t)((w->row0 + w->ne[1] + w->block_out - 1) / w->block_out -
                                        w->row0 / w->block_out);
    }
    const int64_t n_in = w->ne[0], n_out = w->ne[1];
    const size_t xb = sizeof(float) * (size_t)(n_tok * n_in);
    const size_t yb = sizeof(float) * (size_t)(n_tok * n_out);
    if ((st = host_reserve(&o->hx, &o->hx_cap, xb)) != DI_OK) return st;
    if ((st = host_reserve(&o->hy, &o->hy_cap, yb)) != DI_OK) return st;
    if ((st = dev_reserve(o->cu, &o->dx, &o->dx_cap, xb)) != DI_OK) return st;
    if ((st = dev_reserve(o->cu, &o->dy, &o->dy_cap, yb)) != DI_OK) return st;
    for (int64_t t = 0; t < n_tok; t++)
        memcpy(o->hx + t * n_in, x + t * x_stride, sizeof(float) * (size_t)n_in);
    if ((st = di_cuda_upload(o->cu, o->dx, o->hx, xb)) != DI_OK) return st;
    st = di_cuda_matmul(o->cu, &e->dev, (const float *)o->dx, n_tok, n_in, (float *)o->dy, n_out);
    if (st != DI_OK) return st;
    // Sync: the CPU forward reads y right after this call.
    if ((st = di_cuda_sync(o->cu)) != DI_OK) return st;
    if ((st = di_cuda_download(o->cu, o->hy, o->dy, yb)) != DI_OK) return st;
    for (int64_t t = 0; t < n_tok; t++)
        memcpy(y + t * y_stride, o->hy + t * n_out, sizeof(float) * (size_t)n_out);
    return DI_OK;
}

extern "C" bool di_cuda_offload_matmul(void *user, const di_tensor *w, const float *x,
                                       int64_t n_tok, int64_t x_stride, float *y,
                                       int64_t y_stride) {
    di_cuda_offload *o = (di_cuda_offload *)user;
    if (n_tok <= 0 || w->ne[1] <= 0) return true;
    if (!di_cuda_supports_op(o->cu, DI_CUDA_OP_MATMUL, w) ||
        run(o, w, x, n_tok, x_stride, y, y_stride) != DI_OK) {
        o->stats.n_declined++;
        return false;
    }
    o->stats.n_calls++;
    return true;
}
