// stop — stop-string matching over released token bytes (see stop.h).
#include "sample/stop.h"

#include <string.h>

#include "base/log.h"
#include "base/mem.h"

di_status di_stop_init(di_stop *s, const char *const *strings, int32_t n) {
    memset(s, 0, sizeof *s);
    if (n < 0 || n > DI_MAX_STOP || (n > 0 && !strings)) return DI_ERR_INVALID;
    size_t total = 0;
    for (int32_t i = 0; i < n; i++) {
        size_t len = strings[i] ? strlen(strings[i]) : 0;
        if (len == 0 || len > DI_STOP_MAX_LEN) return DI_ERR_INVALID;
        total += len;
        if (len > s->longest) s->longest = len;
    }
    s->strings = di_malloc(total + 1);
    s->held = di_malloc(s->longest + 1);
    s->work = di_malloc(s->longest + DI_STOP_TOKEN_MAX + 1);
    if (!s->strings || !s->held || !s->work) {
        di_stop_deinit(s);
        return DI_ERR_NOMEM;
    }
    for (int32_t i = 0; i < n; i++) {
        size_t len = strlen(strings[i]);
        s->off[i + 1] = s->off[i] + len;
        memcpy(s->strings + s->off[i], strings[i], len);
    }
    s->n = n;
    return DI_OK;
}

void di_stop_deinit(di_stop *s) {
    di_free(s->strings);
    di_free(s->held);
    di_free(s->work);
    memset(s, 0, sizeof *s);
}

// Length of the longest suffix of h[0..n) that is a proper prefix of some stop string.
static size_t partial_suffix(const di_stop *s, const char *h, size_t n) {
    size_t best = 0;
    for (int32_t i = 0; i < s->n; i++) {
        const char *str = s->strings + s->off[i];
        size_t len = s->off[i + 1] - s->off[i];
        for (size_t k = len - 1 < n ? len - 1 : n; k > best; k--) {
            if (memcmp(h + n - k, str, k) == 0) {
                best = k;
                break;
            }
        }
    }
    return best;
}

// Start of the earliest complete stop string in h[0..n), or -1.
static long find_stop(const di_stop *s, const char *h, size_t n) {
    long first = -1;
    for (int32_t i = 0; i < s->n; i++) {
        const char *str = s->strings + s->off[i];
        size_t len = s->off[i + 1] - s->off[i];
        for (size_t at = 0; at + len <= n && (first < 0 || (long)at < first); at++) {
            if (memcmp(h + at, str, len) == 0) {
                first = (long)at;
                break;
            }
        }
    }
    return first;
}

bool di_stop_push(di_stop *s, const char *bytes, size_t n, const char **out, size_t *n_out) {
    if (s->n == 0) { // no stop strings: bytes go straight through
        *out = bytes;
        *n_out = n;
        return false;
    }
    DI_ASSERT(n <= DI_STOP_TOKEN_MAX);
    // work = held bytes, then this token's bytes.
    memcpy(s->work, s->held, s->n_held);
    if (n) memcpy(s->work + s->n_held, bytes, n);
    size_t n_work = s->n_held + n;
    long at = find_stop(s, s->work, n_work);
    *out = s->work;
    if (at >= 0) {
        *n_out = (size_t)at;
        s->n_held = 0;
        return true;
    }
    size_t keep = partial_suffix(s, s->work, n_work);
    *n_out = n_work - keep;
    memcpy(s->held, s->work + n_work - keep, keep);
    s->n_held = keep;
    return false;
}

void di_stop_flush(di_stop *s, const char **out, size_t *n_out) {
    if (s->n == 0) {
        *out = "";
        *n_out = 0;
        return;
    }
    memcpy(s->work, s->held, s->n_held);
    *out = s->work;
    *n_out = s->n_held;
    s->n_held = 0;
}
