/*
 * worker — an expert worker (docs/expert-parallel.md): a TCP service that computes routed
 * experts of a model for any number of fronts. It holds no KV and no sequences: each request is
 * rows of (layer, expert) groups and each answer their outputs, computed by the same code as the
 * front's (di_dsv4_expert), so results are bit-identical to a single process.
 * One thread accepts; one thread serves each connection (handshake: the front's model identity
 * must be this model's; assignment: the (layer, expert) pairs it may ask for; then requests).
 * Computation is serialised on the model's thread pool; every frame is validated and a bad one
 * answered with an error, never taking the worker down.
 * Thread-safety: start and stop from one thread; the model must not run anything else meanwhile.
 */
#pragma once

#include "deepinfer.h"

typedef struct di_ep_worker di_ep_worker;

// Listens on host:port (host "" or "0.0.0.0": every interface; port 0: any free one, see
// di_ep_worker_port) and serves model m (borrowed; it must outlive the worker).
// DI_ERR_IO (cannot listen, logged), DI_ERR_NOMEM.
di_status di_ep_worker_start(di_model *m, const char *host, int port, di_ep_worker **out);
int di_ep_worker_port(const di_ep_worker *w);
// Closes the listening socket and every connection and joins the threads. NULL does nothing.
void di_ep_worker_stop(di_ep_worker *w);
