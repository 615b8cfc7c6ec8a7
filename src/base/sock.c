// sock — blocking TCP helpers (base/sock.h).
#include "base/sock.h"

#include <arpa/inet.h>
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

di_status di_sock_send_all(int fd, const void *p, size_t n) {
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

di_status di_sock_recv_all(int fd, void *p, size_t n) {
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

bool di_sock_split_addr(const char *s, char *host, size_t host_n, int *port) {
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

void di_sock_tune(int fd, int timeout_ms) {
    int one = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    struct timeval tv = {.tv_sec = timeout_ms / 1000, .tv_usec = (timeout_ms % 1000) * 1000};
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
}

int di_sock_connect(const char *who, const char *host, int port, int timeout_ms) {
    struct addrinfo hints = {.ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM}, *res = NULL;
    char ps[16];
    snprintf(ps, sizeof ps, "%d", port);
    int gr = getaddrinfo(host, ps, &hints, &res);
    if (gr != 0) {
        DI_LOG_ERROR("%s: cannot resolve %s: %s", who, host, gai_strerror(gr));
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
        di_sock_tune(fd, timeout_ms);
    }
    freeaddrinfo(res);
    if (fd < 0) DI_LOG_ERROR("%s: cannot connect to %s:%d: %s", who, host, port, strerror(err));
    return fd;
}

int di_sock_listen(const char *who, const char *host, int port, int *bound_port) {
    struct addrinfo hints = {.ai_family = AF_UNSPEC,
                             .ai_socktype = SOCK_STREAM,
                             .ai_flags = AI_PASSIVE},
                    *res = NULL;
    char ps[16];
    snprintf(ps, sizeof ps, "%d", port);
    const char *h = host && *host ? host : NULL;
    int gr = getaddrinfo(h, ps, &hints, &res);
    if (gr != 0) {
        DI_LOG_ERROR("%s: cannot resolve '%s': %s", who, host ? host : "", gai_strerror(gr));
        return -1;
    }
    int lfd = -1, err = 0;
    for (struct addrinfo *a = res; a && lfd < 0; a = a->ai_next) {
        int fd = socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol);
        if (fd < 0) continue;
        int one = 1;
        setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
        if (bind(fd, a->ai_addr, a->ai_addrlen) == 0 && listen(fd, 64) == 0) {
            lfd = fd;
        } else {
            err = errno;
            close(fd);
        }
    }
    freeaddrinfo(res);
    if (lfd < 0) {
        DI_LOG_ERROR("%s: cannot listen on %s:%d: %s", who, host ? host : "", port, strerror(err));
        return -1;
    }
    struct sockaddr_storage sa;
    socklen_t sl = sizeof sa;
    getsockname(lfd, (struct sockaddr *)&sa, &sl);
    *bound_port = ntohs(sa.ss_family == AF_INET6 ? ((struct sockaddr_in6 *)&sa)->sin6_port
                                                 : ((struct sockaddr_in *)&sa)->sin_port);
    return lfd;
}
