// detok — streaming detokenizer (public API in include/deepinfer.h). Holds back at most the bytes
// of one incomplete UTF-8 character (< 4 bytes) between calls; everything else is emitted at once.
#include <string.h>

#include "base/buf.h"
#include "base/mem.h"
#include "tok/tokenizer.h"

struct di_detok {
    const di_tokenizer *tok; // borrowed
    bool skip_special;
    char held[8]; // bytes of an incomplete character from earlier tokens
    size_t n_held;
    di_buf raw; // owned scratch: held + the new token's bytes
    di_buf out; // owned: text returned by the last call
};

di_status di_detok_create(const di_tokenizer *tok, bool skip_special, di_detok **out) {
    if (!tok || !out) return DI_ERR_INVALID;
    di_detok *d = di_calloc(1, sizeof *d);
    if (!d) return DI_ERR_NOMEM;
    d->tok = tok;
    d->skip_special = skip_special;
    di_buf_init(&d->raw);
    di_buf_init(&d->out);
    *out = d;
    return DI_OK;
}

void di_detok_destroy(di_detok *d) {
    if (!d) return;
    di_buf_deinit(&d->raw);
    di_buf_deinit(&d->out);
    di_free(d);
}

di_status di_detok_push(di_detok *d, int32_t id, const char **text, size_t *n_bytes) {
    di_buf_clear(&d->raw);
    di_buf_clear(&d->out);
    di_status st = di_buf_append(&d->raw, d->held, d->n_held);
    if (st == DI_OK) st = di_tokenizer_decode_raw(d->tok, &id, 1, d->skip_special, &d->raw);
    size_t used = 0;
    if (st == DI_OK) st = di_utf8_append_lossy(&d->out, d->raw.data, d->raw.len, false, &used);
    if (st != DI_OK) return st;
    // What is left is a valid prefix of one character: at most 3 bytes.
    d->n_held = d->raw.len - used;
    memcpy(d->held, d->raw.data + used, d->n_held);
    *text = d->out.data ? d->out.data : "";
    *n_bytes = d->out.len;
    return DI_OK;
}

void di_detok_flush(di_detok *d, const char **text, size_t *n_bytes) {
    di_buf_clear(&d->out);
    // Cannot fail for want of memory: out holds at least one earlier token's worth or is grown
    // by at most 3 * 3 bytes here; on failure nothing is emitted.
    if (di_utf8_append_lossy(&d->out, d->held, d->n_held, true, NULL) != DI_OK)
        di_buf_clear(&d->out);
    d->n_held = 0;
    *text = d->out.data ? d->out.data : "";
    *n_bytes = d->out.len;
}
