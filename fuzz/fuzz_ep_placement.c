// libFuzzer target for src/ep/eplb_file.c: the input is read as a placement file and as an
// expert-load file (docs/expert-parallel.md, "EPLB"), both from memory. A placement that is
// accepted must pass di_ep_placement_check and survive a dump / parse round trip unchanged; an
// accepted load table likewise. Any crash, sanitizer report or broken round trip
// (__builtin_trap) is a finding. Seeds: fuzz/corpus/ep_placement/; dictionary:
// fuzz/ep_placement.dict.
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "base/mem.h"
#include "ep/eplb.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    char why[256];
    di_ep_placement p, q;
    if (di_eplb_placement_parse((const char *)data, size, &p, why, sizeof why) == DI_OK) {
        if (di_ep_placement_check(&p, NULL, 0) != DI_OK) __builtin_trap();
        char *text = NULL;
        if (di_eplb_placement_dump(&p, &text) != DI_OK) __builtin_trap();
        if (di_eplb_placement_parse(text, strlen(text), &q, why, sizeof why) != DI_OK ||
            !di_ep_placement_equal(&p, &q))
            __builtin_trap();
        di_free(text);
        di_ep_placement_free(&q);
        di_ep_placement_free(&p);
    } else if (p.expert || p.rank) {
        __builtin_trap(); // a refusal leaves nothing allocated
    }
    di_ep_load_table t, u;
    if (di_eplb_load_parse((const char *)data, size, &t, why, sizeof why) == DI_OK) {
        char *text = NULL;
        if (di_eplb_load_dump(&t, &text) != DI_OK) __builtin_trap();
        if (di_eplb_load_parse(text, strlen(text), &u, why, sizeof why) != DI_OK ||
            u.n_layers != t.n_layers || u.n_expert != t.n_expert ||
            memcmp(u.count, t.count, sizeof(int64_t) * (size_t)t.n_layers * (size_t)t.n_expert) ||
            memcmp(u.rows, t.rows, sizeof(int64_t) * (size_t)t.n_layers))
            __builtin_trap();
        di_free(text);
        di_ep_load_table_free(&u);
        di_ep_load_table_free(&t);
    }
    return 0;
}
