/*
 * sock — blocking TCP helpers shared by the processes that talk to each other (expert parallelism,
 * ep/wire.h; context parallelism, cp/wire.h): exact reads and writes, "HOST:PORT" parsing, connect
 * with a timeout, a listening socket. Framing and protocols live with their users.
 * Owns nothing: every socket belongs to its caller.
 * Thread-safety: any thread; a socket is read by one thread and written by one thread at a time.
 */
#pragma once

#include <stdbool.h>
#include <stddef.h>

#include "deepinfer.h" // di_status

// Writes / reads exactly n bytes (EINTR retried). DI_ERR_IO on error, timeout or a closed peer.
di_status di_sock_send_all(int fd, const void *p, size_t n);
di_status di_sock_recv_all(int fd, void *p, size_t n);
// Splits "HOST:PORT" (the last colon; HOST may be empty for all interfaces when listening).
// false when malformed.
bool di_sock_split_addr(const char *s, char *host, size_t host_n, int *port);
// Sets TCP_NODELAY and the send/receive timeouts (0: none).
void di_sock_tune(int fd, int timeout_ms);
// Connects to host:port within timeout_ms (then di_sock_tune with it). The socket, or -1 with the
// reason logged under `who` (the caller's module, e.g. "ep").
int di_sock_connect(const char *who, const char *host, int port, int timeout_ms);
// Listens on host:port (host "" or NULL: every interface; port 0: any free one). The socket, its
// port in *bound_port, or -1 with the reason logged under `who`.
int di_sock_listen(const char *who, const char *host, int port, int *bound_port);
