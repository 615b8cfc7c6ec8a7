#include "base/buf.h"

#include <stdio.h>
#include <string.h>

#include "base/hash.h"
#include "base/mem.h"

void di_buf_init(di_buf *b) {
    b->data = NULL;
    b->len = 0;
    b->cap = 0;
}

void di_buf_deinit(di_buf *b) {
    di_free(b->data);
    di_buf_init(b);
}

void di_buf_clear(di_buf *b) {
    b->len = 0;
    if (b->data) b->data[0] = 0;
}

di_status di_buf_reserve(di_buf *b, size_t extra) {
    size_t need = b->len + extra + 1;
    if (need <= b->cap) return DI_OK;
    size_t cap = b->cap ? b->cap : 64;
    while (cap < need) cap *= 2;
    char *p = di_realloc(b->data, cap);
    if (!p) return DI_ERR_NOMEM;
    b->data = p;
    b->cap = cap;
    return DI_OK;
}

di_status di_buf_append(di_buf *b, const void *data, size_t n) {
    di_status st = di_buf_reserve(b, n);
    if (st != DI_OK) return st;
    if (n) memcpy(b->data + b->len, data, n);
    b->len += n;
    b->data[b->len] = 0;
    return DI_OK;
}

di_status di_buf_append_str(di_buf *b, const char *s) {
    return di_buf_append(b, s, strlen(s));
}

di_status di_buf_printf(di_buf *b, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(NULL, 0, fmt, ap);
    va_end(ap);
    if (n < 0) return DI_ERR_INVALID;
    di_status st = di_buf_reserve(b, (size_t)n);
    if (st != DI_OK) return st;
    va_start(ap, fmt);
    vsnprintf(b->data + b->len, (size_t)n + 1, fmt, ap);
    va_end(ap);
    b->len += (size_t)n;
    return DI_OK;
}

char *di_buf_take(di_buf *b) {
    char *p = b->data;
    di_buf_init(b);
    return p;
}

di_status di_buf_seal(di_buf *b, void **bytes, size_t *n_bytes) {
    uint64_t sum = di_fnv1a(b->data, b->len, DI_FNV1A_INIT);
    di_status st = di_buf_append(b, &sum, sizeof sum);
    if (st) {
        di_buf_deinit(b);
        return st;
    }
    *n_bytes = b->len;
    *bytes = di_buf_take(b);
    return DI_OK;
}

bool di_reader_open(di_reader *r, const void *bytes, size_t n_bytes) {
    uint64_t sum;
    r->p = bytes;
    r->left = 0;
    if (n_bytes < sizeof sum) return false;
    memcpy(&sum, r->p + n_bytes - sizeof sum, sizeof sum);
    if (di_fnv1a(bytes, n_bytes - sizeof sum, DI_FNV1A_INIT) != sum) return false;
    r->left = n_bytes - sizeof sum;
    return true;
}

bool di_reader_get(di_reader *r, void *dst, size_t n) {
    if (n > r->left) return false;
    if (n) memcpy(dst, r->p, n);
    r->p += n;
    r->left -= n;
    return true;
}
