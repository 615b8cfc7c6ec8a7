#include "ep/wire.h"

#include <stdio.h>
#include <string.h>

#include "base/log.h"

// Returns a failing status to the caller.
#define RET_IF(expr)                                                                               \
    do {                                                                                           \
        di_status s_ = (expr);                                                                     \
        if (s_ != DI_OK) return s_;                                                                \
    } while (0)

uint64_t di_ep_frame_limit(uint16_t type) {
    switch (type) {
    case DI_EP_HELLO:
    case DI_EP_ERROR:
        return DI_EP_MAX_TEXT;
    case DI_EP_ASSIGN:
        return DI_EP_MAX_ASSIGN;
    case DI_EP_COMPUTE:
    case DI_EP_RESULT:
        return DI_EP_MAX_FRAME;
    case DI_EP_OK:
        return 0;
    default:
        return UINT64_MAX; // unknown
    }
}

di_status di_ep_hdr_check(const di_ep_hdr *h, char *why, size_t why_n) {
    return di_sock_frame_check(h->magic, h->version, h->type, h->len, DI_EP_MAGIC, DI_EP_VERSION,
                               "expert-parallel", di_ep_frame_limit(h->type), why, why_n);
}

static int32_t rd_i32(const uint8_t *p) {
    int32_t v;
    memcpy(&v, p, sizeof v);
    return v;
}

di_status di_ep_decode_compute(const void *payload, uint64_t len, int32_t n_layers,
                               int32_t n_expert, int32_t D, di_ep_compute *out, int32_t cap_groups,
                               char *why, size_t why_n) {
    const uint8_t *p = payload;
    if (len < 16) {
        snprintf(why, why_n, "compute request of %llu bytes is shorter than its 16-byte header",
                 (unsigned long long)len);
        return DI_ERR_FORMAT;
    }
    const int32_t layer = rd_i32(p), d = rd_i32(p + 4), n_groups = rd_i32(p + 8);
    if (layer < 0 || layer >= n_layers) {
        snprintf(why, why_n, "layer %d is outside [0, %d)", layer, n_layers);
        return DI_ERR_FORMAT;
    }
    if (d != D) {
        snprintf(why, why_n, "rows of width %d, the model's is %d", d, D);
        return DI_ERR_FORMAT;
    }
    if (n_groups < 1 || rd_i32(p + 12) != 0) {
        snprintf(why, why_n, "%d groups (need >= 1) or a nonzero reserved word", n_groups);
        return DI_ERR_FORMAT;
    }
    if (n_groups > cap_groups) {
        snprintf(why, why_n, "%d groups exceed the limit of %d", n_groups, cap_groups);
        return DI_ERR_INVALID;
    }
    uint64_t off = 16, rows = 0;
    const uint64_t row_bytes = ((uint64_t)D + 1) * sizeof(float);
    for (int32_t g = 0; g < n_groups; g++) {
        if (len - off < 8) {
            snprintf(why, why_n, "group %d: truncated header", g);
            return DI_ERR_FORMAT;
        }
        const int32_t e = rd_i32(p + off), n = rd_i32(p + off + 4);
        off += 8;
        if (e < 0 || e >= n_expert) {
            snprintf(why, why_n, "group %d: expert %d is outside [0, %d)", g, e, n_expert);
            return DI_ERR_FORMAT;
        }
        if (n < 1 || rows + (uint64_t)n > DI_EP_MAX_ROWS) {
            snprintf(why, why_n, "group %d: %d rows (need 1 .. %d rows per request)", g, n,
                     DI_EP_MAX_ROWS);
            return DI_ERR_FORMAT;
        }
        if ((len - off) / row_bytes < (uint64_t)n) {
            snprintf(why, why_n, "group %d: %d rows of width %d do not fit the %llu bytes left", g,
                     n, D, (unsigned long long)(len - off));
            return DI_ERR_FORMAT;
        }
        out->groups[g] = (di_ep_group){.expert = e,
                                       .n = n,
                                       .x = (const float *)(p + off),
                                       .w = (const float *)(p + off + (uint64_t)n * D * 4)};
        off += (uint64_t)n * row_bytes;
        rows += (uint64_t)n;
    }
    if (off != len) {
        snprintf(why, why_n, "%llu trailing bytes after the last group",
                 (unsigned long long)(len - off));
        return DI_ERR_FORMAT;
    }
    out->layer = layer;
    out->D = D;
    out->n_groups = n_groups;
    out->n_rows = (int64_t)rows;
    return DI_OK;
}

di_status di_ep_decode_assign(const void *payload, uint64_t len, int32_t n_layers, int32_t n_expert,
                              const int32_t **pairs, int32_t *count, char *why, size_t why_n) {
    const uint8_t *p = payload;
    if (len < 12) {
        snprintf(why, why_n, "assignment of %llu bytes is shorter than its 12-byte header",
                 (unsigned long long)len);
        return DI_ERR_FORMAT;
    }
    const int32_t nl = rd_i32(p), ne = rd_i32(p + 4), n = rd_i32(p + 8);
    if (nl != n_layers || ne != n_expert) {
        snprintf(why, why_n,
                 "placement of %d MoE layers x %d experts, the worker's model has %d x %d", nl, ne,
                 n_layers, n_expert);
        return DI_ERR_FORMAT;
    }
    if (n < 0 || (uint64_t)n * 8 != len - 12) {
        snprintf(why, why_n, "assignment of %d pairs in %llu bytes", n,
                 (unsigned long long)(len - 12));
        return DI_ERR_FORMAT;
    }
    const int32_t *pr = (const int32_t *)(p + 12);
    for (int32_t i = 0; i < n; i++) {
        int32_t l = rd_i32(p + 12 + 8 * (uint64_t)i), e = rd_i32(p + 16 + 8 * (uint64_t)i);
        if (l < 0 || l >= n_layers || e < 0 || e >= n_expert) {
            snprintf(why, why_n, "assignment pair %d: (layer %d, expert %d) out of range", i, l, e);
            return DI_ERR_FORMAT;
        }
    }
    *pairs = pr;
    *count = n;
    return DI_OK;
}

di_status di_ep_send_frame(int fd, uint16_t type, const void *payload, uint64_t len) {
    di_ep_hdr h = {.magic = DI_EP_MAGIC, .version = DI_EP_VERSION, .type = type, .len = len};
    RET_IF(di_sock_send_all(fd, &h, sizeof h));
    return len ? di_sock_send_all(fd, payload, (size_t)len) : DI_OK;
}

di_status di_ep_recv_hdr(int fd, di_ep_hdr *h, char *why, size_t why_n) {
    if (di_sock_recv_all(fd, h, sizeof *h) != DI_OK) {
        snprintf(why, why_n, "connection closed or timed out");
        return DI_ERR_IO;
    }
    return di_ep_hdr_check(h, why, why_n);
}
