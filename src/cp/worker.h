/*
 * worker — a context-parallel prefill worker (docs/context-parallel.md): a TCP service that
 * computes one piece of a front's long prefill. It holds no sequences between jobs: each job
 * brings its tokens (and, for the first piece after a prefix, the state at its start); the state
 * of the earlier pieces arrives layer by layer from the front, and this piece's state leaves layer
 * by layer as soon as each attention is done, computed by the same session forward as the front's
 * (model/dsv4.h, di_dsv4_session_forward with a di_dsv4_cp_hook; on a V4.1 model
 * di_dsv41_forward_cp, with the job's Engram history ids written first), so results are
 * bit-identical to a single process. One thread accepts; one thread serves each connection
 * (handshake: the front's model identity must be this model's; then jobs). Computation is
 * serialised on the model's thread pool; every frame is validated and a bad one answered with an
 * error (the job ends, the connection closes), never taking the worker down. Thread-safety: start
 * and stop from one thread; the model must not run anything else meanwhile.
 */
#pragma once

#include "deepinfer.h"

typedef struct di_cp_worker di_cp_worker;

// Listens on host:port (host "" or "0.0.0.0": every interface; port 0: any free one, see
// di_cp_worker_port) and serves model m (borrowed; it must outlive the worker). DI_ERR_UNSUPPORTED
// for a V4.1 model or one on a device (logged), DI_ERR_IO (cannot listen, logged), DI_ERR_NOMEM.
di_status di_cp_worker_start(di_model *m, const char *host, int port, di_cp_worker **out);
int di_cp_worker_port(const di_cp_worker *w);
// Closes the listening socket and every connection and joins the threads. NULL does nothing.
void di_cp_worker_stop(di_cp_worker *w);
