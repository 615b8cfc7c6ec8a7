// libFuzzer target for src/ep/wire.c: the input is one frame as an expert worker receives it (a
// 16-byte header, then the payload). The header is checked (di_ep_hdr_check); a compute or an
// assignment payload is decoded for a model of 7 MoE layers x 8 experts of width 16, as the
// worker does, and every view it returns is read (ASan flags any pointer outside the payload).
// Invariants: a decoded request's groups are in range, their rows add up to n_rows and their
// views lie inside the payload. Seeds: fuzz/corpus/ep_wire/ (valid frames of every request type
// and a few broken ones).
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "base/log.h"
#include "ep/wire.h"

enum { NL = 7, NE = 8, D = 16, MAX_GROUPS = 64 };

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    static bool quiet;
    if (!quiet) di_set_log_level(0), quiet = true;
    di_ep_hdr h;
    char why[256];
    if (size < sizeof h) return 0;
    memcpy(&h, data, sizeof h);
    if (di_ep_hdr_check(&h, why, sizeof why) != DI_OK) return 0;
    if (h.len != size - sizeof h) return 0; // the worker reads exactly len bytes
    // The worker's payload buffer: heap, 4-byte aligned (the decoders return float views).
    uint8_t *p = malloc(h.len ? h.len : 1);
    if (!p) return 0;
    memcpy(p, data + sizeof h, h.len);
    volatile float sink = 0;
    if (h.type == DI_EP_COMPUTE) {
        di_ep_group g[MAX_GROUPS];
        di_ep_compute rq = {.groups = g};
        if (di_ep_decode_compute(p, h.len, NL, NE, D, &rq, MAX_GROUPS, why, sizeof why) == DI_OK) {
            int64_t rows = 0;
            for (int32_t i = 0; i < rq.n_groups; i++) {
                if (g[i].expert < 0 || g[i].expert >= NE || g[i].n < 1) __builtin_trap();
                const uint8_t *xe = (const uint8_t *)(g[i].x + (int64_t)g[i].n * D);
                const uint8_t *we = (const uint8_t *)(g[i].w + g[i].n);
                if ((const uint8_t *)g[i].x < p || we > p + h.len || xe > p + h.len)
                    __builtin_trap();
                sink += g[i].x[0] + g[i].x[(int64_t)g[i].n * D - 1] + g[i].w[g[i].n - 1];
                rows += g[i].n;
            }
            if (rows != rq.n_rows || rq.layer < 0 || rq.layer >= NL) __builtin_trap();
        }
    } else if (h.type == DI_EP_ASSIGN) {
        const int32_t *pairs;
        int32_t n;
        if (di_ep_decode_assign(p, h.len, NL, NE, &pairs, &n, why, sizeof why) == DI_OK) {
            for (int32_t i = 0; i < n; i++) {
                int32_t pr[2];
                memcpy(pr, pairs + 2 * i, sizeof pr);
                if (pr[0] < 0 || pr[0] >= NL || pr[1] < 0 || pr[1] >= NE) __builtin_trap();
            }
        }
    }
    free(p);
    return 0;
}
