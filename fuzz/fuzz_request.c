// libFuzzer target: request JSON → conversation → prompt (di_render_request for the three APIs)
// and the server's incremental output parser over the same bytes. Any crash, leak or sanitizer
// report is a bug: the server feeds untrusted request bodies into exactly these functions.
#include <stddef.h>
#include <stdint.h>

#include "deepinfer.h"

static void sink(void *user, const di_parser_event *ev) {
    (void)user;
    (void)ev;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size < 1) return 0;
    di_render_api api = (di_render_api)(data[0] % 3); // chat, responses, messages
    const char *json = (const char *)data + 1;
    char *text = NULL;
    size_t n_text = 0;
    if (di_render_request(NULL, json, size - 1, api, NULL, &text, &n_text, NULL, NULL) == DI_OK)
        di_tok_free(text);
    static const char *const stop[] = {"</", "\n\n"};
    di_parser *p = NULL;
    if (di_parser_create(NULL, (di_parser_stage)(data[0] % 3), data[0] & 4, data[0] & 8, stop, 2,
                         sink, NULL, &p) == DI_OK) {
        di_parser_feed(p, json, size - 1);
        di_parser_end(p, DI_PARSER_FINISH_STOP);
        di_parser_destroy(p);
    }
    return 0;
}
