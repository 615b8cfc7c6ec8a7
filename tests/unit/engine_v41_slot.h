/*
 * engine_v41_slot — one V4.1 engine slot's session, set up as the engine sets it up, for the
 * tests that measure a slot's bytes (test_engine_v41.c, test_engine_v41_prefix.c): the model
 * loaded with the engine's thread count, a session of MAX_CTX positions on a workspace of its own
 * (the engine's slots share the engine's, outside kv_memory_bytes), bound to pool blocks (no
 * entries of its own); the caller reserves its rows. Header-only (static): the includer includes
 * harness.h and defines MAX_CTX and N_THREADS first.
 */
#pragma once

#include "deepinfer.h"
#include "model/dsv41.h"

typedef struct v41_slot {
    di_model *m;
    di_session *s;
    di_dsv4_ws ws;
} v41_slot;

// Opens t on the checkpoint in dir; false, holding nothing, when the model or the session fails.
static bool v41_slot_open(v41_slot *t, const char *dir) {
    *t = (v41_slot){0};
    di_model_options mo = di_model_options_default();
    mo.n_threads = N_THREADS;
    CHECK_EQ(di_model_load(dir, &mo, &t->m), DI_OK);
    if (!t->m) return false;
    di_session_options so = {.n_ctx_max = MAX_CTX};
    CHECK_EQ(di_session_create(t->m, &so, &t->s), DI_OK);
    if (!t->s) {
        di_model_destroy(t->m);
        return false;
    }
    di_dsv41_share_ws(t->s, &t->ws);
    di_dsv41_bind_pages(t->s, NULL, 0); // an engine slot's: its blocks are the pool's
    return true;
}

static void v41_slot_close(v41_slot *t) {
    di_session_destroy(t->s);
    di_dsv4_ws_free(&t->ws);
    di_model_destroy(t->m);
}
