// libFuzzer target for src/cp/wire.c: the input is one frame as a context-parallel peer receives
// it (a 16-byte header, then the payload). The header is checked (di_cp_hdr_check); a job, a layer
// message or a main-stream row is decoded against the shapes of a small model (4 main layers:
// SWA, CSA m = 4, HCA m = 128, SWA; an MTP block; window rings of 24 rows of 16 floats) as the
// worker and the front do, and every view a decoder returns is read (ASan flags any pointer
// outside the payload). Invariants: a decoded job's ranks, positions, token ids and entry counts
// are in range; a decoded layer's entries satisfy 0 <= from <= n = pos / ratio and its views end
// exactly at the payload's end. A job is also decoded against a small V4.1 model (3 main layers:
// SWA, a kv source m = 2, a kv source m = 1; a DSpark block; an Engram look-back of 3 ids), and a
// V4.1 layer message (LAYER41) against it: a decoded job's history ids are in range and end the
// payload; a decoded V4.1 layer's entries satisfy 0 <= from <= n = pos / ratio on a source (0, 0
// elsewhere) and its views end exactly at the payload's end. Seeds: fuzz/corpus/cp_wire/ (a valid
// frame of each kind).
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "base/log.h"
#include "cp/wire.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static void dims_init(di_cp_dims *d) {
    memset(d, 0, sizeof *d);
    d->n_layers = 4;
    d->has_mtp = true;
    d->n_mtp = 1;
    d->n_vocab = 64;
    d->row_floats = 2 * 8;
    d->max_pos = 4096;
    d->ring_floats = 24 * 16;
    const int32_t ratio[5] = {0, 4, 128, 0, 0};
    for (int il = 0; il < 5; il++) {
        d->ratio[il] = ratio[il];
        d->n_cmp[il] = ratio[il] == 4 ? 2 : ratio[il] > 0 ? 1 : 0;
        for (int k = 0; k < d->n_cmp[il]; k++) {
            d->cmp_d[il][k] = k == 0 ? 16 : 8;
            d->cmp_ring_floats[il][k] = (int64_t)(2 * ratio[il] + 8) * 2 * d->cmp_d[il][k];
        }
    }
}

static void dims_init41(di_cp_dims *d) {
    memset(d, 0, sizeof *d);
    d->n_layers = 3;
    d->has_mtp = true;
    d->n_mtp = 1;
    d->n_vocab = 64;
    d->row_floats = 2 * 8;
    d->max_pos = 4096;
    d->v41 = true;
    d->ring_bytes = 20 * 34;
    d->cz_floats = 10 * 2 * 16;
    d->ent_bytes = 40;
    d->key_bytes = 20;
    d->n_hist = 3;
    d->n_hist_ids = 100;
    const int32_t ratio[3] = {0, 2, 1};
    for (int il = 0; il < 3; il++) d->ratio[il] = ratio[il], d->src[il] = ratio[il] > 0;
}

static void check_job(const uint8_t *p, uint64_t len, const di_cp_dims *d) {
    di_cp_job j;
    char why[256];
    if (di_cp_decode_job(p, len, d, &j, why, sizeof why) != DI_OK) return;
    if (j.rank < 0 || j.rank >= j.n_ranks - 1 || j.n_tok < 1 ||
        (int64_t)j.pos + j.n_tok > d->max_pos)
        __builtin_trap();
    for (int32_t t = 0; t < j.n_tok; t++)
        if (j.tokens[t] < 0 || j.tokens[t] >= d->n_vocab) __builtin_trap();
    for (int32_t i = 0; i < 2 * j.n_state; i++)
        if (j.from[i] < 0) __builtin_trap();
    if (j.n_hist < 0 || j.n_hist > d->n_hist || j.n_hist > j.pos) __builtin_trap();
    for (int32_t i = 0; i < j.n_hist; i++)
        if (j.hist[i] < 0 || j.hist[i] >= d->n_hist_ids) __builtin_trap();
    if ((const uint8_t *)(j.tokens + j.n_tok + j.n_hist) != p + len) __builtin_trap();
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    static bool init;
    static di_cp_dims d, d41;
    if (!init) di_set_log_level(0), dims_init(&d), dims_init41(&d41), init = true;
    di_cp_hdr h;
    char why[256];
    if (size < sizeof h) return 0;
    memcpy(&h, data, sizeof h);
    if (di_cp_hdr_check(&h, why, sizeof why) != DI_OK) return 0;
    if (h.len != size - sizeof h) return 0; // a peer reads exactly len bytes
    // The receive buffer: heap, 8-byte aligned (the decoders return int64 and float views).
    uint8_t *p = aligned_alloc(64, ((size_t)h.len + 63) / 64 * 64 + 64);
    if (!p) return 0;
    memcpy(p, data + sizeof h, h.len);
    volatile float sink = 0;
    if (h.type == DI_CP_JOB) {
        check_job(p, h.len, &d);
        check_job(p, h.len, &d41);
    } else if (h.type == DI_CP_LAYER) {
        di_cp_layer l;
        if (di_cp_decode_layer(p, h.len, &d, &l, why, sizeof why) == DI_OK) {
            const float *end = l.ring + d.ring_floats;
            sink += l.ring[0] + l.ring[d.ring_floats - 1];
            for (int k = 0; k < d.n_cmp[l.il]; k++) {
                const di_cp_cmp *c = &l.cmp[k];
                if (c->from < 0 || c->from > c->n || c->n != l.pos / d.ratio[l.il])
                    __builtin_trap();
                sink += c->buf_c[0] + c->buf_z[d.cmp_ring_floats[l.il][k] - 1];
                end = c->entries + (c->n - c->from) * d.cmp_d[l.il][k];
                if (c->n > c->from) sink += end[-1];
            }
            if ((const uint8_t *)end != p + h.len) __builtin_trap();
        }
    } else if (h.type == DI_CP_LAYER41) {
        di_cp_layer41 l;
        if (di_cp_decode_layer41(p, h.len, &d41, &l, why, sizeof why) == DI_OK) {
            const bool src = l.il < d41.n_layers && d41.src[l.il];
            if (l.from < 0 || l.from > l.n || l.n != (src ? l.pos / d41.ratio[l.il] : 0))
                __builtin_trap();
            if ((l.cz != NULL) != (src && d41.ratio[l.il] == 2)) __builtin_trap();
            if (l.cz) sink += l.cz[0] + l.cz[d41.cz_floats - 1];
            sink += l.ring[0] + l.ring[d41.ring_bytes - 1];
            const uint8_t *end = l.keys + (l.n - l.from) * d41.key_bytes;
            if (l.n > l.from) sink += l.ent[0] + end[-1];
            if (end != p + h.len) __builtin_trap();
        }
    } else if (h.type == DI_CP_XROW) {
        int32_t pos;
        const float *row;
        if (di_cp_decode_xrow(p, h.len, &d, &pos, &row, why, sizeof why) == DI_OK) {
            if (pos < 0 || pos >= d.max_pos) __builtin_trap();
            sink += row[0] + row[d.row_floats - 1];
        }
    }
    free(p);
    return 0;
}
