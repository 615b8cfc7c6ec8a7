// libFuzzer target: the output parser (src/tok/parse) and the renderer's JSON front end.
// The first byte picks options (start stage, tools on/off, stop strings) and a split pattern; the
// rest is model output. Invariants:
//   - feeding the text whole and in arbitrary splits gives the same event transcript;
//   - no reasoning/content event contains "｜DSML｜" markup;
//   - tool-call events are well nested (begin, name..., name end, args..., end | abort);
// The same bytes are also given to di_render_request (raw API) as a conversation JSON: it must
// either fail cleanly or render.
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "base/buf.h"
#include "base/log.h"
#include "deepinfer.h"
#include "tok/parse.h"

typedef struct tr {
    di_buf b;
    int open; // 0 none, 1 name, 2 args
    int last_kind;
} tr;

static void on_event(void *user, const di_parse_event *ev) {
    tr *t = user;
    if (ev->kind <= DI_PARSE_EVENT_CONTENT && ev->len &&
        memmem(ev->text, ev->len,
               "\xef\xbd\x9c"
               "DSML"
               "\xef\xbd\x9c",
               10))
        abort(); // DSML leaked into reasoning/content
    switch (ev->kind) {
    case DI_PARSE_EVENT_TOOL_CALL_BEGIN:
        if (t->open) abort();
        t->open = 1;
        break;
    case DI_PARSE_EVENT_TOOL_NAME:
        if (t->open != 1) abort();
        break;
    case DI_PARSE_EVENT_TOOL_NAME_END:
        if (t->open != 1) abort();
        t->open = 2;
        break;
    case DI_PARSE_EVENT_ARGS_DELTA:
        if (t->open != 2) abort();
        break;
    case DI_PARSE_EVENT_TOOL_CALL_END:
        if (t->open != 2) abort();
        t->open = 0;
        break;
    case DI_PARSE_EVENT_TOOL_CALL_ABORT:
        if (!t->open) abort();
        t->open = 0;
        break;
    default:
        break;
    }
    // transcript with text events of one kind merged, so that splits compare equal
    bool text = ev->kind == DI_PARSE_EVENT_REASONING || ev->kind == DI_PARSE_EVENT_CONTENT ||
                ev->kind == DI_PARSE_EVENT_TOOL_NAME || ev->kind == DI_PARSE_EVENT_ARGS_DELTA;
    if (!(text && (int)ev->kind == t->last_kind)) di_buf_printf(&t->b, "|%d:", (int)ev->kind);
    di_buf_append(&t->b, ev->text ? ev->text : "", ev->len);
    t->last_kind = text ? (int)ev->kind : -1;
}

static void run(const char *s, size_t n, uint8_t mode, bool split, tr *t) {
    static const char *stops[] = {"STOP", "\n\n", "<｜"};
    di_parse_options opt = {.start = (di_parse_stage)(mode % 3),
                            .tools_enabled = (mode >> 2) & 1,
                            .stop = stops,
                            .n_stop = (mode >> 3) % 4,
                            .json_output = (mode >> 5) & 1};
    di_buf_init(&t->b);
    t->open = 0;
    t->last_kind = -1;
    di_parse *p;
    if (di_parse_create(&opt, on_event, t, &p) != DI_OK) abort();
    size_t pos = 0, step = 1;
    while (pos < n) {
        size_t len = split ? step : n - pos;
        if (len > n - pos) len = n - pos;
        if (di_parse_feed(p, s + pos, len) != DI_OK) abort();
        pos += len;
        step = step * 5 % 11 + 1; // 1..11, irregular
    }
    di_parse_end(p, (mode >> 5) & 1 ? DI_PARSE_FINISH_LENGTH : DI_PARSE_FINISH_STOP);
    if (t->open) abort(); // every call ends or is aborted
    di_parse_destroy(p);
    di_buf_append(&t->b, "", 0);
}

static void quiet(di_log_level level, const char *msg, void *user) {
    (void)level;
    (void)msg;
    (void)user;
}

int LLVMFuzzerInitialize(int *argc, char ***argv) {
    (void)argc;
    (void)argv;
    di_log_set_sink(quiet, NULL); // expected errors would flood the output
    return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size < 1) return 0;
    uint8_t mode = data[0];
    const char *s = (const char *)data + 1;
    size_t n = size - 1;
    tr whole, parts;
    run(s, n, mode, false, &whole);
    run(s, n, mode, true, &parts);
    if (whole.b.len != parts.b.len || memcmp(whole.b.data, parts.b.data, whole.b.len) != 0) abort();
    di_buf_deinit(&whole.b);
    di_buf_deinit(&parts.b);
    // renderer front end on the same bytes (text only; no tokenizer needed)
    char *text;
    size_t nt;
    di_status st = di_render_request(NULL, s, n, DI_RENDER_API_RAW, NULL, &text, &nt, NULL, NULL);
    if (st == DI_OK)
        di_tok_free(text);
    else if (st != DI_ERR_INVALID && st != DI_ERR_UNSUPPORTED)
        abort();
    for (int api = 0; api < 3; api++) {
        st = di_render_request(NULL, s, n, (di_render_api)api, NULL, &text, &nt, NULL, NULL);
        if (st == DI_OK)
            di_tok_free(text);
        else if (st != DI_ERR_INVALID && st != DI_ERR_UNSUPPORTED)
            abort();
    }
    return 0;
}
