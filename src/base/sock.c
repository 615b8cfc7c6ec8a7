// sock — blocking TCP helpers (base/sock.h).
#include "base/sock.h"

#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include "base/log.h"
#include "base/mem.h"

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

di_status di_sock_frame_check(uint32_t magic, uint16_t version, uint16_t type, uint64_t len,
                              uint32_t want_magic, uint16_t want_version, const char *peer_kind,
                              uint64_t limit, char *why, size_t why_n) {
    if (magic != want_magic) {
        snprintf(why, why_n, "bad frame magic 0x%08x (not a deepinfer %s peer)", (unsigned)magic,
                 peer_kind);
        return DI_ERR_FORMAT;
    }
    if (version != want_version) {
        snprintf(why, why_n, "wire version %u, this build speaks %u", (unsigned)version,
                 (unsigned)want_version);
        return DI_ERR_FORMAT;
    }
    if (limit == UINT64_MAX) {
        snprintf(why, why_n, "unknown frame type %u", (unsigned)type);
        return DI_ERR_FORMAT;
    }
    if (len > limit) {
        snprintf(why, why_n, "frame type %u of %llu bytes exceeds its limit of %llu",
                 (unsigned)type, (unsigned long long)len, (unsigned long long)limit);
        return DI_ERR_FORMAT;
    }
    return DI_OK;
}

// ---- connection server ----

typedef struct sock_conn {
    struct di_sock_server *srv;
    int fd;
    pthread_t th;
    bool done; // serve returned (joined by the accept thread or at stop); under srv->mu
    char peer[64];
    struct sock_conn *next;
} sock_conn;

struct di_sock_server {
    const char *who;
    int lfd, port, timeout_ms;
    int stop_pipe[2];
    pthread_t th;
    pthread_mutex_t mu; // conns, done flags
    sock_conn *conns;
    di_sock_serve_fn serve;
    void *user;
};

static void *conn_main(void *p) {
    sock_conn *cn = p;
    cn->srv->serve(cn->srv->user, cn->fd, cn->peer);
    pthread_mutex_lock(&cn->srv->mu);
    cn->done = true;
    pthread_mutex_unlock(&cn->srv->mu);
    return NULL;
}

// Joins and frees finished connections (all of them, shutting the live ones down first, when all).
static void reap(di_sock_server *s, bool all) {
    pthread_mutex_lock(&s->mu);
    sock_conn **pp = &s->conns;
    while (*pp) {
        sock_conn *cn = *pp;
        if (all && !cn->done) shutdown(cn->fd, SHUT_RDWR);
        if (!all && !cn->done) {
            pp = &cn->next;
            continue;
        }
        *pp = cn->next;
        pthread_mutex_unlock(&s->mu);
        pthread_join(cn->th, NULL);
        close(cn->fd);
        di_free(cn);
        pthread_mutex_lock(&s->mu);
    }
    pthread_mutex_unlock(&s->mu);
}

static void *accept_main(void *p) {
    di_sock_server *s = p;
    for (;;) {
        struct pollfd pf[2] = {{.fd = s->lfd, .events = POLLIN},
                               {.fd = s->stop_pipe[0], .events = POLLIN}};
        int r = poll(pf, 2, 1000);
        if (r < 0 && errno == EINTR) continue;
        if (r < 0 || pf[1].revents) break;
        reap(s, false);
        if (!(pf[0].revents & POLLIN)) continue;
        struct sockaddr_storage sa;
        socklen_t sl = sizeof sa;
        int fd = accept4(s->lfd, (struct sockaddr *)&sa, &sl, SOCK_CLOEXEC);
        if (fd < 0) continue;
        sock_conn *cn = di_calloc(1, sizeof *cn);
        if (!cn) {
            close(fd);
            continue;
        }
        cn->srv = s;
        cn->fd = fd;
        char host[NI_MAXHOST] = "?", serv[NI_MAXSERV] = "?";
        getnameinfo((struct sockaddr *)&sa, sl, host, sizeof host, serv, sizeof serv,
                    NI_NUMERICHOST | NI_NUMERICSERV);
        snprintf(cn->peer, sizeof cn->peer, "%s:%s", host, serv);
        di_sock_tune(fd, s->timeout_ms);
        struct timeval tv = {0}; // no receive timeout: a client may stay idle between requests
        setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
        DI_LOG_INFO("%s: front %s connected", s->who, cn->peer);
        pthread_mutex_lock(&s->mu);
        if (pthread_create(&cn->th, NULL, conn_main, cn) != 0) {
            pthread_mutex_unlock(&s->mu);
            DI_LOG_ERROR("%s: cannot start a thread for %s", s->who, cn->peer);
            close(fd);
            di_free(cn);
            continue;
        }
        cn->next = s->conns;
        s->conns = cn;
        pthread_mutex_unlock(&s->mu);
    }
    return NULL;
}

di_status di_sock_server_start(const char *who, const char *host, int port, int timeout_ms,
                               di_sock_serve_fn serve, void *user, di_sock_server **out) {
    *out = NULL;
    di_sock_server *s = di_calloc(1, sizeof *s);
    if (!s) return DI_ERR_NOMEM;
    s->who = who;
    s->timeout_ms = timeout_ms;
    s->serve = serve;
    s->user = user;
    s->lfd = di_sock_listen(who, host, port, &s->port);
    if (s->lfd < 0) {
        di_free(s);
        return DI_ERR_IO;
    }
    pthread_mutex_init(&s->mu, NULL);
    if (pipe(s->stop_pipe) != 0) {
        DI_LOG_ERROR("%s: cannot start: %s", who, strerror(errno));
        close(s->lfd);
        pthread_mutex_destroy(&s->mu);
        di_free(s);
        return DI_ERR_IO;
    }
    if (pthread_create(&s->th, NULL, accept_main, s) != 0) {
        DI_LOG_ERROR("%s: cannot start its accept thread", who);
        close(s->lfd);
        close(s->stop_pipe[0]);
        close(s->stop_pipe[1]);
        pthread_mutex_destroy(&s->mu);
        di_free(s);
        return DI_ERR_IO;
    }
    *out = s;
    return DI_OK;
}

int di_sock_server_port(const di_sock_server *s) {
    return s->port;
}

void di_sock_server_stop(di_sock_server *s) {
    if (!s) return;
    (void)!write(s->stop_pipe[1], "x", 1);
    pthread_join(s->th, NULL);
    close(s->lfd);
    reap(s, true);
    close(s->stop_pipe[0]);
    close(s->stop_pipe[1]);
    pthread_mutex_destroy(&s->mu);
    di_free(s);
}
