/*
 * sock — blocking TCP helpers shared by the processes that talk to each other (expert parallelism,
 * ep/wire.h; context parallelism, cp/wire.h): exact reads and writes, "HOST:PORT" parsing, connect
 * with a timeout, a listening socket, and the connection server both workers run (an accept
 * thread and a thread per connection). Framing and protocols live with their users.
 * Owns nothing but a server's sockets and threads: every other socket belongs to its caller.
 * Thread-safety: any thread; a socket is read by one thread and written by one thread at a time.
 */
#pragma once

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

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

// Checks a 16-byte frame header (magic, version, type, payload length) of a framed protocol
// (ep/wire.h, cp/wire.h): want_magic and want_version are the protocol's, `peer_kind` names its
// peers in errors ("expert-parallel"), limit is the type's payload limit (UINT64_MAX: a type this
// version does not know). DI_OK, or DI_ERR_FORMAT with the reason in why[why_n].
di_status di_sock_frame_check(uint32_t magic, uint16_t version, uint16_t type, uint64_t len,
                              uint32_t want_magic, uint16_t want_version, const char *peer_kind,
                              uint64_t limit, char *why, size_t why_n);

// ---- a connection server (the expert and prefill workers) ----
//
// Listens on host:port; an accept thread takes each connection (the socket tuned with timeout_ms
// for sends and none for receives: a client may stay idle between requests) and runs
// serve(user, fd, peer) on a thread of its own until it returns; the socket is then closed.
// Finished connections are joined as new ones come (or at least once a second). Thread-safety:
// serve runs on many threads at once (user must allow it); start and stop from one thread.
typedef struct di_sock_server di_sock_server;
typedef void (*di_sock_serve_fn)(void *user, int fd, const char *peer);

// Logs under `who` (e.g. "ep worker"). DI_ERR_IO (cannot listen or start; logged), DI_ERR_NOMEM.
di_status di_sock_server_start(const char *who, const char *host, int port, int timeout_ms,
                               di_sock_serve_fn serve, void *user, di_sock_server **out);
int di_sock_server_port(
    const di_sock_server *s); // the bound port (port 0 at start: the chosen one)
// Stops accepting, shuts every live connection down (its serve sees the peer gone and returns),
// joins all threads, frees. NULL does nothing.
void di_sock_server_stop(di_sock_server *s);
