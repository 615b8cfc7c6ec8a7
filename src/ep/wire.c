#include "ep/wire.h"

#include <errno.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

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
    if (h->magic != DI_EP_MAGIC) {
        snprintf(why, why_n, "bad frame magic 0x%08x (not a deepinfer expert-parallel peer)",
                 (unsigned)h->magic);
        return DI_ERR_FORMAT;
    }
    if (h->version != DI_EP_VERSION) {
        snprintf(why, why_n, "wire version %u, this build speaks %u", (unsigned)h->version,
                 (unsigned)DI_EP_VERSION);
        return DI_ERR_FORMAT;
    }
    uint64_t lim = di_ep_frame_limit(h->type);
    if (lim == UINT64_MAX) {
        snprintf(why, why_n, "unknown frame type %u", (unsigned)h->type);
        return DI_ERR_FORMAT;
    }
    if (h->len > lim) {
        snprintf(why, why_n, "frame type %u of %llu bytes exceeds its limit of %llu",
                 (unsigned)h->type, (unsigned long long)h->len, (unsigned long long)lim);
        return DI_ERR_FORMAT;
    }
    return DI_OK;
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

di_status di_ep_send_all(int fd, const void *p, size_t n) {
    const uint8_t *b = p;
    while (n > 0) {
        ssize_t k = send(fd, b, n, MSG_NOSIGNAL);
        if (k < 0 && errno == EINTR) continue;
        if (k <= 0) return DI_ERR_IO;
        b += k;
        n -= (size_t)k;
    }
    return DI_OK;
}

di_status di_ep_recv_all(int fd, void *p, size_t n) {
    uint8_t *b = p;
    while (n > 0) {
        ssize_t k = recv(fd, b, n, 0);
        if (k < 0 && errno == EINTR) continue;
        if (k <= 0) return DI_ERR_IO;
        b += k;
        n -= (size_t)k;
    }
    return DI_OK;
}

di_status di_ep_send_frame(int fd, uint16_t type, const void *payload, uint64_t len) {
    di_ep_hdr h = {.magic = DI_EP_MAGIC, .version = DI_EP_VERSION, .type = type, .len = len};
    RET_IF(di_ep_send_all(fd, &h, sizeof h));
    return len ? di_ep_send_all(fd, payload, (size_t)len) : DI_OK;
}

di_status di_ep_recv_hdr(int fd, di_ep_hdr *h, char *why, size_t why_n) {
    if (di_ep_recv_all(fd, h, sizeof *h) != DI_OK) {
        snprintf(why, why_n, "connection closed or timed out");
        return DI_ERR_IO;
    }
    return di_ep_hdr_check(h, why, why_n);
}

bool di_ep_split_addr(const char *s, char *host, size_t host_n, int *port) {
    const char *c = strrchr(s, ':');
    if (!c || (size_t)(c - s) >= host_n) return false;
    char *end;
    errno = 0;
    long v = strtol(c + 1, &end, 10);
    if (end == c + 1 || *end || errno || v < 0 || v > 65535) return false;
    memcpy(host, s, (size_t)(c - s));
    host[c - s] = 0;
    *port = (int)v;
    return true;
}

void di_ep_sock_tune(int fd, int timeout_ms) {
    int one = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    struct timeval tv = {.tv_sec = timeout_ms / 1000, .tv_usec = (timeout_ms % 1000) * 1000};
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
}

int di_ep_connect(const char *host, int port, int timeout_ms) {
    struct addrinfo hints = {.ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM}, *res = NULL;
    char ps[16];
    snprintf(ps, sizeof ps, "%d", port);
    int gr = getaddrinfo(host, ps, &hints, &res);
    if (gr != 0) {
        DI_LOG_ERROR("ep: cannot resolve %s: %s", host, gai_strerror(gr));
        return -1;
    }
    int fd = -1, err = 0;
    for (struct addrinfo *a = res; a && fd < 0; a = a->ai_next) {
        fd = socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol);
        if (fd < 0) {
            err = errno;
            continue;
        }
        // Non-blocking connect bounded by the timeout, then back to blocking.
        int fl = fcntl(fd, F_GETFL);
        fcntl(fd, F_SETFL, fl | O_NONBLOCK);
        int r = connect(fd, a->ai_addr, a->ai_addrlen);
        if (r != 0 && errno == EINPROGRESS) {
            struct pollfd pf = {.fd = fd, .events = POLLOUT};
            r = poll(&pf, 1, timeout_ms);
            if (r == 1) {
                socklen_t l = sizeof err;
                getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &l);
                r = err ? -1 : 0;
            } else {
                err = r == 0 ? ETIMEDOUT : errno;
                r = -1;
            }
        } else if (r != 0) {
            err = errno;
        }
        if (r != 0) {
            close(fd);
            fd = -1;
            continue;
        }
        fcntl(fd, F_SETFL, fl);
        di_ep_sock_tune(fd, timeout_ms);
    }
    freeaddrinfo(res);
    if (fd < 0) DI_LOG_ERROR("ep: cannot connect to %s:%d: %s", host, port, strerror(err));
    return fd;
}
