// libFuzzer target for src/kv/kv_transfer + kv_disk's in-memory records: verifies the input as a
// KV transfer (docs/disaggregation.md) for a fixed small layout, as POST /internal/kv does, then
// walks every record of an accepted one (touching the first and last byte of its tokens and
// payload, so that ASan flags any pointer outside the input) and checks the chain links it
// promises. Any crash, sanitizer report or broken invariant (__builtin_trap) is a finding.
// Seeds: fuzz/corpus/kv_transfer/ (made by tests/unit/test_kv_transfer.c with
// DI_KV_TRANSFER_WRITE_SEEDS=<dir>; the same layout as here).
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "kv/kv_transfer.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    const di_kv_disk_layout l = {.model_id = 0xabc,
                                 .precision = 0,
                                 .block_tokens = 8,
                                 .block_floats = 128,
                                 .payload_floats = 100};
    di_kv_transfer t;
    char why[512];
    why[0] = 0;
    di_kv_disk_check e = di_kv_transfer_check(&l, data, size, 4, &t, why, sizeof why);
    if (e != DI_KV_DISK_CHECK_OK) {
        if (!why[0] || strlen(why) >= sizeof why) __builtin_trap(); // every refusal says why
        return 0;
    }
    if (t.n_blocks < 0 || t.n_blocks > 4 || size != di_kv_transfer_bytes(&l, t.n_blocks))
        __builtin_trap();
    volatile uint8_t sink = 0;
    uint64_t parent = 0;
    for (int32_t i = 0; i < t.n_blocks; i++) {
        di_kv_disk_record r;
        di_kv_transfer_record(&l, &t, i, &r);
        if (r.parent != parent || r.salt != t.salt) __builtin_trap();
        parent = r.hash;
        const uint8_t *tok = r.tokens, *pay = r.payload;
        sink ^= tok[0] ^ tok[sizeof(int32_t) * 8 - 1];
        sink ^= pay[0] ^ pay[sizeof(float) * 100 - 1];
    }
    (void)sink;
    return 0;
}
