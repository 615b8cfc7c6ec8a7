// parse_api — the public wrapper (di_parser_* in include/deepinfer.h) of the incremental output
// parser in parse.c, for callers that may include only the public header (tools/server).
// Copies the stop strings (parse.c borrows them) and remembers which one finished the stream.
// Thread-safety: one parser per stream, one thread at a time.
#include <stdlib.h>
#include <string.h>

#include "base/mem.h"
#include "tok/parse.h" // di_parse_*

_Static_assert((int)DI_PARSER_EVENT_TOOL_CALL_ABORT == (int)DI_PARSE_EVENT_TOOL_CALL_ABORT,
               "public and internal parser event kinds must match");
_Static_assert((int)DI_PARSER_EVENT_ARGS_DELTA == (int)DI_PARSE_EVENT_ARGS_DELTA, "event kinds");
_Static_assert((int)DI_PARSER_FINISH_TOOL_CALLS == (int)DI_PARSE_FINISH_TOOL_CALLS, "finish");
_Static_assert((int)DI_PARSER_STAGE_TOOL_CALLS == (int)DI_PARSE_STAGE_TOOL_CALLS, "stages");

enum { TAIL_BYTES = 1024 }; // > the longest stop string (256) plus one fed piece in practice

struct di_parser {
    di_parse *p; // owned
    char **stop; // owned copies
    size_t n_stop;
    const di_tokenizer *tok; // borrowed
    di_detok *detok;         // owned
    char tail[TAIL_BYTES];   // last bytes fed, to name the stop string that matched
    size_t n_tail;
    const char *matched; // view into stop[], once finished by a stop string
    di_parser_emit_fn emit;
    void *user;
};

static void trampoline(void *user, const di_parse_event *ev) {
    const di_parser *q = user;
    di_parser_event e = {(di_parser_event_kind)ev->kind, ev->call_index, ev->text, ev->len};
    q->emit(q->user, &e);
}

di_status di_parser_create(const di_tokenizer *tok, di_parser_stage start, bool tools_enabled,
                           bool json_output, const char *const *stop, size_t n_stop,
                           di_parser_emit_fn emit, void *user, di_parser **out) {
    if (!emit || !out || (n_stop && !stop)) return DI_ERR_INVALID;
    di_parser *q = calloc(1, sizeof *q);
    if (!q) return DI_ERR_NOMEM;
    di_status st = DI_OK;
    if (n_stop) {
        q->stop = calloc(n_stop, sizeof *q->stop);
        if (!q->stop) goto nomem;
        for (size_t i = 0; i < n_stop; i++) {
            if (!stop[i]) {
                q->n_stop = i;
                st = DI_ERR_INVALID;
                goto fail;
            }
            q->stop[i] = strdup(stop[i]);
            q->n_stop = i + 1;
            if (!q->stop[i]) goto nomem;
        }
    }
    q->tok = tok;
    if (tok && (st = di_detok_create(tok, false, &q->detok)) != DI_OK) goto fail;
    di_parse_options o = {.start = (di_parse_stage)start,
                          .tools_enabled = tools_enabled,
                          .stop = (const char *const *)q->stop,
                          .n_stop = q->n_stop,
                          .json_output = json_output};
    q->emit = emit;
    q->user = user;
    st = di_parse_create(&o, trampoline, q, &q->p);
    if (st != DI_OK) goto fail;
    *out = q;
    return DI_OK;
nomem:
    st = DI_ERR_NOMEM;
fail:
    di_parser_destroy(q);
    return st;
}

void di_parser_destroy(di_parser *q) {
    if (!q) return;
    di_parse_destroy(q->p);
    di_detok_destroy(q->detok);
    for (size_t i = 0; i < q->n_stop; i++) free(q->stop[i]);
    free(q->stop);
    free(q);
}

static void remember(di_parser *q, const char *t, size_t n) {
    if (!q->n_stop) return;
    if (n >= TAIL_BYTES) {
        memcpy(q->tail, t + n - TAIL_BYTES, TAIL_BYTES);
        q->n_tail = TAIL_BYTES;
        return;
    }
    if (q->n_tail + n > TAIL_BYTES) {
        size_t drop = q->n_tail + n - TAIL_BYTES;
        memmove(q->tail, q->tail + drop, q->n_tail - drop);
        q->n_tail -= drop;
    }
    memcpy(q->tail + q->n_tail, t, n);
    q->n_tail += n;
}

// After the parser finished on a stop string: the one whose first occurrence in the tail ends
// earliest is the one the parser matched (it stops at the first complete match).
static void name_match(di_parser *q) {
    size_t best_end = (size_t)-1;
    for (size_t i = 0; i < q->n_stop; i++) {
        size_t ls = strlen(q->stop[i]);
        for (size_t k = 0; k + ls <= q->n_tail; k++) {
            if (memcmp(q->tail + k, q->stop[i], ls) == 0) {
                if (k + ls < best_end) {
                    best_end = k + ls;
                    q->matched = q->stop[i];
                }
                break;
            }
        }
    }
}

static di_status feed(di_parser *q, const char *t, size_t n) {
    bool was = di_parse_finished(q->p);
    remember(q, t, n);
    di_status st = di_parse_feed(q->p, t, n);
    if (!was && di_parse_finished(q->p) && q->n_stop) name_match(q);
    return st;
}

di_status di_parser_feed(di_parser *q, const char *text, size_t n) {
    if (!q || (n && !text)) return DI_ERR_INVALID;
    return feed(q, text, n);
}

di_status di_parser_feed_token(di_parser *q, int32_t id) {
    if (!q || !q->detok) return DI_ERR_INVALID;
    if (id == 1) { // EOS (spec §1.1), as di_parse_feed_token
        di_parser_end(q, DI_PARSER_FINISH_STOP);
        return DI_OK;
    }
    const char *t;
    size_t n;
    di_status st = di_detok_push(q->detok, id, &t, &n);
    if (st != DI_OK) return st;
    return n ? feed(q, t, n) : DI_OK;
}

di_parser_finish di_parser_end(di_parser *q, di_parser_finish reason) {
    if (q->detok) {
        const char *t;
        size_t n;
        di_detok_flush(q->detok, &t, &n);
        if (n && !di_parse_finished(q->p)) feed(q, t, n);
    }
    return (di_parser_finish)di_parse_end(q->p, (di_parse_finish)reason);
}

bool di_parser_finished(const di_parser *q) {
    return di_parse_finished(q->p);
}

const char *di_parser_stop_string(const di_parser *q) {
    return q->matched;
}
