// libFuzzer target for src/kv/kv_transfer + kv_disk's in-memory records, in two modes chosen by
// the first byte:
//   - even: the rest of the input is verified as a KV transfer (docs/disaggregation.md) for a
//     fixed small layout and tail snapshots of SNAP bytes, as POST /internal/kv does; an accepted
//     one is walked record by record (touching the first and last byte of its tokens and payload
//     and of its snapshot, so that ASan flags any pointer outside the input) and its chain links
//     are checked again;
//   - odd: the input is a recipe for a transfer built with the writers (valid checksums, so the
//     checks behind them are reached): a record count, per record its hash, salt, tokens and
//     payload bytes and whether its parent link, salt, model or layout is wrong, and for the
//     header whether its model, layout or count is wrong and whether it carries a tail snapshot
//     (of the last record), of the right size or not, intact or with a flipped byte. The verdict
//     must be exactly what the recipe says: accepted iff nothing is wrong, "another model" iff
//     only identities are wrong.
// Any crash, sanitizer report or wrong verdict (__builtin_trap) is a finding.
// Seeds: fuzz/corpus/kv_transfer/ (made by tests/unit/test_kv_transfer.c with
// DI_KV_TRANSFER_WRITE_SEEDS=<dir>; the same layout as here).
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kv/kv_transfer.h"

enum { BT = 8, NF = 100, MAX_BLOCKS = 4, SNAP = 48 };

static const di_kv_disk_layout k_layout = {.model_id = 0xabc,
                                           .precision = 0,
                                           .block_tokens = BT,
                                           .block_floats = 128,
                                           .payload_floats = NF};

// Reads the recipe's next byte (0 once it is used up).
static uint8_t next(const uint8_t **p, const uint8_t *end) {
    return *p < end ? *(*p)++ : 0;
}

static void check_accepted(const uint8_t *data, size_t size, const di_kv_transfer *t) {
    if (t->n_blocks < 0 || t->n_blocks > MAX_BLOCKS ||
        size != di_kv_transfer_bytes(&k_layout, t->n_blocks, t->snap_bytes))
        __builtin_trap();
    volatile uint8_t sink = 0;
    if (t->snap) {
        if (t->snap_bytes != SNAP || t->snap_block < 0 || t->snap_block >= t->n_blocks ||
            t->snap < data || t->snap + SNAP > data + size)
            __builtin_trap();
        sink ^= t->snap[0] ^ t->snap[SNAP - 1];
    } else if (t->snap_block != -1 || t->snap_bytes != 0) {
        __builtin_trap();
    }
    uint64_t parent = 0;
    for (int32_t i = 0; i < t->n_blocks; i++) {
        di_kv_disk_record r;
        di_kv_transfer_record(&k_layout, t, i, &r);
        if (r.parent != parent || r.salt != t->salt) __builtin_trap();
        parent = r.hash;
        const uint8_t *tok = r.tokens, *pay = r.payload;
        if (tok < data || pay + sizeof(float) * NF > data + size) __builtin_trap();
        sink ^= tok[0] ^ tok[sizeof(int32_t) * BT - 1];
        sink ^= pay[0] ^ pay[sizeof(float) * NF - 1];
    }
    (void)sink;
}

// Builds the transfer a recipe describes and checks the verdict.
static void recipe(const uint8_t *p, const uint8_t *end) {
    const uint8_t head = next(&p, end);
    const int n = head % (MAX_BLOCKS + 2); // one more than the receiver takes, at most
    di_kv_disk_layout hl = k_layout;
    bool other_model = false, corrupt = n > MAX_BLOCKS;
    if (head & 0x10) hl.model_id ^= 1, other_model = true;
    if (head & 0x20) hl.precision = 1, other_model = true;
    if ((head & 0x40) && !(head & 0x30)) hl.block_tokens = BT * 2, corrupt = true;
    // The snapshot: none, of the receiver's size, or of another size; 0x80 flips a byte of it.
    const uint8_t sf = next(&p, end);
    // (The header's own layout places it; with another block layout, none.)
    const size_t snap = n == 0 || hl.block_tokens != BT ? 0
                        : (sf & 3) == 1                 ? SNAP
                        : (sf & 3) == 2                 ? SNAP + 8
                                                        : 0;
    const bool snap_bad = snap && ((sf & 0x80) || snap != SNAP);
    uint8_t tail[SNAP + 8];
    for (size_t k = 0; k < sizeof tail; k++) tail[k] = next(&p, end);
    const size_t total = di_kv_transfer_bytes(&k_layout, n, snap);
    unsigned char *b = calloc(1, total);
    if (!b) return;
    di_kv_transfer_put_header(&hl, n, tail, snap, n - 1, b);
    if (snap && (sf & 0x80)) b[total - 1 - sf % snap] ^= 0x20;
    uint64_t prev = 0, salt0 = 0;
    bool rec_model = false, rec_corrupt = false; // the first bad record decides the verdict
    for (int i = 0; i < n; i++) {
        const uint8_t f = next(&p, end);
        uint64_t h = 0;
        for (int k = 0; k < 8; k++) h = h << 8 | next(&p, end);
        const uint64_t salt = f & 0x01 ? 7 : 0;
        if (i == 0) salt0 = salt;
        uint64_t parent = f & 0x02 ? prev ^ 0x55 : prev;
        int32_t tok[BT];
        float pay[NF];
        for (int k = 0; k < BT; k++) tok[k] = (int32_t)next(&p, end) * 3;
        for (int k = 0; k < NF; k++) pay[k] = (float)next(&p, end);
        di_kv_disk_layout rl = k_layout;
        const bool rm = f & 0x04, rc = (f & 0x08) && !rm;
        if (rm) rl.model_id ^= 2;
        if (rc) rl.payload_floats = NF - 1; // a record of another layout (wrong size inside)
        di_kv_disk_record_put(&rl, h, parent, salt, tok, pay,
                              b + di_kv_transfer_record_offset(&k_layout, i));
        const bool link_bad = parent != prev || salt != salt0;
        if (!rec_model && !rec_corrupt) {
            if (rm)
                rec_model = true;
            else if (rc || link_bad)
                rec_corrupt = true;
        }
        prev = h;
    }
    di_kv_transfer t;
    char why[512] = "";
    const di_kv_disk_check e =
        di_kv_transfer_check(&k_layout, SNAP, b, total, MAX_BLOCKS, &t, why, sizeof why);
    // The header is checked first (identity, then layout, count and snapshot), then the records
    // in order.
    di_kv_disk_check want = other_model           ? DI_KV_DISK_CHECK_OTHER_MODEL
                            : corrupt || snap_bad ? DI_KV_DISK_CHECK_CORRUPT
                            : rec_model           ? DI_KV_DISK_CHECK_OTHER_MODEL
                            : rec_corrupt         ? DI_KV_DISK_CHECK_CORRUPT
                                                  : DI_KV_DISK_CHECK_OK;
    if (e != want || (e != DI_KV_DISK_CHECK_OK && !why[0])) __builtin_trap();
    if (e == DI_KV_DISK_CHECK_OK) {
        if (t.n_blocks != n || t.salt != salt0 || (t.snap != NULL) != (snap > 0)) __builtin_trap();
        check_accepted(b, total, &t);
    }
    free(b);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size == 0) return 0;
    if (data[0] & 1) {
        recipe(data + 1, data + size);
        return 0;
    }
    di_kv_transfer t;
    char why[512];
    why[0] = 0;
    di_kv_disk_check e =
        di_kv_transfer_check(&k_layout, SNAP, data + 1, size - 1, MAX_BLOCKS, &t, why, sizeof why);
    if (e != DI_KV_DISK_CHECK_OK) {
        if (!why[0]) __builtin_trap(); // every refusal says why
        return 0;
    }
    check_accepted(data + 1, size - 1, &t);
    return 0;
}
