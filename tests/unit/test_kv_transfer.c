// kv_transfer + kv_disk's records in memory: a record round-trips through di_kv_disk_record_put /
// di_kv_disk_record_check (any alignment); a transfer of a chain round-trips through
// di_kv_transfer_check; and every kind of damage is refused with its reason: truncated or extended
// transfers and records, a flipped bit anywhere (header, record header, tokens, payload), another
// model identity or precision (told apart from corruption), another block layout, a broken chain
// link or salt, more records than the receiver takes, and an empty buffer. Version 3's tail
// snapshot (of the last record here): round trip, a flipped bit in it, another size than the
// receiver's, and a receiver keeping no snapshots (verified, not handed out); versions 2, 3 and 4
// refused. DI_KV_TRANSFER_WRITE_SEEDS=<dir> also writes the fuzz target's seeds there (fuzz/corpus/
// kv_transfer/: transfers of 0, 1 and 4 blocks in fuzz/fuzz_kv_transfer.c's layout, this one's).
#include "harness.h"

#include <stdlib.h>
#include <string.h>

#include "kv/kv_transfer.h"

enum { BT = 8, NF = 100, NB = 4, SNAP = 48 };

static di_kv_disk_layout layout(uint64_t model_id, uint32_t precision) {
    return (di_kv_disk_layout){.model_id = model_id,
                               .precision = precision,
                               .block_tokens = BT,
                               .block_floats = 128,
                               .payload_floats = NF};
}

static void block(int k, int32_t *tok, float *pay) {
    for (int i = 0; i < BT; i++) tok[i] = k * 10 + i;
    for (int i = 0; i < NF; i++) pay[i] = (float)k - (float)i * 0.25f;
}

// A transfer of n chained blocks (hash k = 1000 + k, parent = the previous hash or 0) of layout l,
// with a tail snapshot of snap bytes (i * 5 + 1) on its last block (snap 0: none).
static unsigned char *make_snap(const di_kv_disk_layout *l, int n, uint64_t salt, size_t snap,
                                size_t *size) {
    *size = di_kv_transfer_bytes(l, n, snap);
    unsigned char *b = malloc(*size);
    CHECK(b != NULL);
    unsigned char tail[SNAP];
    for (size_t i = 0; i < sizeof tail; i++) tail[i] = (unsigned char)(i * 5 + 1);
    di_kv_transfer_put_header(l, n, tail, snap, n - 1, b);
    int32_t tok[BT];
    float pay[NF];
    for (int k = 0; k < n; k++) {
        block(k, tok, pay);
        di_kv_disk_record_put(l, 1000 + (uint64_t)k, k ? 1000 + (uint64_t)k - 1 : 0, salt, tok, pay,
                              b + di_kv_transfer_record_offset(l, k));
    }
    return b;
}

static unsigned char *make(const di_kv_disk_layout *l, int n, uint64_t salt, size_t *size) {
    return make_snap(l, n, salt, 0, size);
}

static void test_record_roundtrip(void) {
    const di_kv_disk_layout l = layout(0xabc, 0);
    const size_t rb = di_kv_disk_record_size(&l);
    CHECK_EQ(rb, 128 + 4 * BT + 4 * NF);
    unsigned char *buf = malloc(rb + 1);
    int32_t tok[BT], tok2[BT];
    float pay[NF], pay2[NF];
    block(3, tok, pay);
    di_kv_disk_record_put(&l, 77, 66, 5, tok, pay, buf + 1); // unaligned
    di_kv_disk_record r;
    const char *why = "unset";
    CHECK_EQ(di_kv_disk_record_check(&l, buf + 1, rb, &r, &why), DI_KV_DISK_CHECK_OK);
    CHECK(why == NULL);
    CHECK_EQ(r.hash, 77u);
    CHECK_EQ(r.parent, 66u);
    CHECK_EQ(r.salt, 5u);
    memcpy(tok2, r.tokens, sizeof tok2);
    memcpy(pay2, r.payload, sizeof pay2);
    CHECK(!memcmp(tok, tok2, sizeof tok) && !memcmp(pay, pay2, sizeof pay));
    // Sizes: short, long, shorter than a header.
    CHECK_EQ(di_kv_disk_record_check(&l, buf + 1, rb - 1, &r, &why), DI_KV_DISK_CHECK_CORRUPT);
    CHECK(strstr(why, "size") != NULL);
    CHECK_EQ(di_kv_disk_record_check(&l, buf + 1, 10, &r, &why), DI_KV_DISK_CHECK_CORRUPT);
    CHECK(strstr(why, "truncated") != NULL);
    // A flipped bit (bits 0, 3 and 6 of every byte, one at a time) is always caught: header
    // fields, tokens, payload, checksums.
    int n_caught = 0;
    for (size_t i = 0; i < rb; i++) {
        for (int bit = 0; bit < 8; bit += 3) {
            buf[1 + i] ^= (unsigned char)(1u << bit);
            n_caught += di_kv_disk_record_check(&l, buf + 1, rb, &r, &why) != DI_KV_DISK_CHECK_OK;
            buf[1 + i] ^= (unsigned char)(1u << bit);
        }
    }
    CHECK_EQ(n_caught, (int)rb * 3);
    // Another model / precision: a clear, distinct error. Another layout: corrupt.
    const di_kv_disk_layout other = layout(0xabd, 0), prec = layout(0xabc, 1);
    CHECK_EQ(di_kv_disk_record_check(&other, buf + 1, rb, &r, &why), DI_KV_DISK_CHECK_OTHER_MODEL);
    CHECK(strstr(why, "another model") != NULL);
    CHECK_EQ(di_kv_disk_record_check(&prec, buf + 1, rb, &r, &why), DI_KV_DISK_CHECK_OTHER_MODEL);
    di_kv_disk_layout wide = l;
    wide.payload_floats = NF - 1;
    CHECK_EQ(di_kv_disk_record_check(&wide, buf + 1, rb, &r, &why), DI_KV_DISK_CHECK_CORRUPT);
    CHECK(strstr(why, "layout") != NULL);
    free(buf);
}

static void test_transfer_roundtrip(void) {
    const di_kv_disk_layout l = layout(0xabc, 0);
    size_t n;
    unsigned char *b = make(&l, NB, 9, &n);
    di_kv_transfer t;
    char why[256] = "";
    CHECK_EQ(di_kv_transfer_check(&l, SNAP, b, n, NB, &t, why, sizeof why), DI_KV_DISK_CHECK_OK);
    CHECK_EQ(t.n_blocks, NB);
    CHECK_EQ(t.salt, 9u);
    CHECK(t.snap == NULL && t.snap_block == -1);
    for (int k = 0; k < NB; k++) {
        di_kv_disk_record r;
        di_kv_transfer_record(&l, &t, k, &r);
        int32_t tok[BT], tok2[BT];
        float pay[NF], pay2[NF];
        block(k, tok, pay);
        memcpy(tok2, r.tokens, sizeof tok2);
        memcpy(pay2, r.payload, sizeof pay2);
        CHECK_EQ(r.hash, 1000u + (uint64_t)k);
        CHECK(!memcmp(tok, tok2, sizeof tok) && !memcmp(pay, pay2, sizeof pay));
    }
    free(b);
    // An empty chain is a valid transfer (a prompt shorter than a block).
    b = make(&l, 0, 0, &n);
    CHECK_EQ(n, (size_t)DI_KV_TRANSFER_HEADER_BYTES);
    CHECK_EQ(di_kv_transfer_check(&l, SNAP, b, n, NB, &t, why, sizeof why), DI_KV_DISK_CHECK_OK);
    CHECK_EQ(t.n_blocks, 0);
    free(b);
    // With a tail snapshot of the last block: handed out as written; a receiver that keeps no
    // snapshots (0) accepts the transfer without it.
    b = make_snap(&l, NB, 9, SNAP, &n);
    CHECK_EQ(n, di_kv_transfer_bytes(&l, NB, 0) + SNAP);
    CHECK_EQ(di_kv_transfer_check(&l, SNAP, b, n, NB, &t, why, sizeof why), DI_KV_DISK_CHECK_OK);
    CHECK_EQ(t.snap_block, NB - 1);
    CHECK_EQ(t.snap_bytes, (size_t)SNAP);
    CHECK(t.snap == b + di_kv_transfer_record_offset(&l, NB));
    int n_ok = 0;
    for (int i = 0; t.snap && i < SNAP; i++) n_ok += t.snap[i] == (unsigned char)(i * 5 + 1);
    CHECK_EQ(n_ok, SNAP);
    CHECK_EQ(di_kv_transfer_check(&l, 0, b, n, NB, &t, why, sizeof why), DI_KV_DISK_CHECK_OK);
    CHECK(t.snap == NULL && t.snap_block == -1 && t.snap_bytes == 0);
    free(b);
}

static di_kv_disk_check check(const di_kv_disk_layout *l, const unsigned char *b, size_t n,
                              int32_t max, const char *want) {
    di_kv_transfer t;
    char why[512] = "";
    di_kv_disk_check e = di_kv_transfer_check(l, SNAP, b, n, max, &t, why, sizeof why);
    if (want && !strstr(why, want)) {
        fprintf(stderr, "  reason \"%s\" lacks \"%s\"\n", why, want);
        CHECK(false);
    }
    return e;
}

static void test_transfer_damage(void) {
    const di_kv_disk_layout l = layout(0xabc, 0);
    size_t n;
    unsigned char *b = make_snap(&l, NB, 9, SNAP, &n);
    CHECK_EQ(check(&l, b, 0, NB, "truncated"), DI_KV_DISK_CHECK_CORRUPT);
    CHECK_EQ(check(&l, b, 63, NB, "truncated"), DI_KV_DISK_CHECK_CORRUPT);
    CHECK_EQ(check(&l, b, n - 1, NB, "trailing"), DI_KV_DISK_CHECK_CORRUPT);
    unsigned char *big = calloc(1, n + 1);
    memcpy(big, b, n);
    CHECK_EQ(check(&l, big, n + 1, NB, "trailing"), DI_KV_DISK_CHECK_CORRUPT);
    free(big);
    CHECK_EQ(check(&l, b, n, NB - 1, "blocks"), DI_KV_DISK_CHECK_CORRUPT); // more than it takes
    // Any flipped bit anywhere.
    int n_caught = 0;
    for (size_t i = 0; i < n; i++) {
        b[i] ^= 0x10;
        n_caught += check(&l, b, n, NB, NULL) != DI_KV_DISK_CHECK_OK;
        b[i] ^= 0x10;
    }
    CHECK_EQ(n_caught, (int)n); // the snapshot's bytes included
    CHECK_EQ(check(&l, b, n, NB, NULL), DI_KV_DISK_CHECK_OK);
    b[n - 1] ^= 1;
    CHECK_EQ(check(&l, b, n, NB, "snapshot fails its checksum"), DI_KV_DISK_CHECK_CORRUPT);
    b[n - 1] ^= 1;
    // A receiver whose snapshots have another size (another forward or speculation setting).
    {
        di_kv_transfer t;
        char why[512] = "";
        CHECK_EQ(di_kv_transfer_check(&l, SNAP + 4, b, n, NB, &t, why, sizeof why),
                 DI_KV_DISK_CHECK_CORRUPT);
        CHECK(strstr(why, "tail snapshot") != NULL);
    }
    // Versions 2 (no snapshot fields), 3 (records of kv_disk's version 2) and 4 (block_floats the
    // sender's pool block): refused as such.
    uint32_t v;
    memcpy(&v, b + 8, sizeof v);
    CHECK_EQ(v, (uint32_t)DI_KV_TRANSFER_VERSION);
    v = 2;
    memcpy(b + 8, &v, sizeof v);
    CHECK_EQ(check(&l, b, n, NB, "version 2"), DI_KV_DISK_CHECK_CORRUPT);
    v = 3;
    memcpy(b + 8, &v, sizeof v);
    CHECK_EQ(check(&l, b, n, NB, "version 3"), DI_KV_DISK_CHECK_CORRUPT);
    v = 4;
    memcpy(b + 8, &v, sizeof v);
    CHECK_EQ(check(&l, b, n, NB, "version 4"), DI_KV_DISK_CHECK_CORRUPT);
    v = DI_KV_TRANSFER_VERSION;
    memcpy(b + 8, &v, sizeof v);
    // Another model or precision: told apart.
    const di_kv_disk_layout other = layout(0xdef, 0), prec = layout(0xabc, 2);
    CHECK_EQ(check(&other, b, n, NB, "another model"), DI_KV_DISK_CHECK_OTHER_MODEL);
    CHECK_EQ(check(&prec, b, n, NB, "another model"), DI_KV_DISK_CHECK_OTHER_MODEL);
    di_kv_disk_layout bt = l;
    bt.block_tokens = BT * 2;
    CHECK_EQ(check(&bt, b, n, NB, "layout"), DI_KV_DISK_CHECK_CORRUPT);
    free(b);
    // Broken chain: record 2 whose parent is not record 1's hash; or another salt.
    b = make(&l, NB, 9, &n);
    int32_t tok[BT];
    float pay[NF];
    block(2, tok, pay);
    di_kv_disk_record_put(&l, 1002, 4242, 9, tok, pay, b + di_kv_transfer_record_offset(&l, 2));
    CHECK_EQ(check(&l, b, n, NB, "chain"), DI_KV_DISK_CHECK_CORRUPT);
    di_kv_disk_record_put(&l, 1002, 1001, 8, tok, pay, b + di_kv_transfer_record_offset(&l, 2));
    CHECK_EQ(check(&l, b, n, NB, "chain"), DI_KV_DISK_CHECK_CORRUPT);
    di_kv_disk_record_put(&l, 1002, 1001, 9, tok, pay, b + di_kv_transfer_record_offset(&l, 2));
    CHECK_EQ(check(&l, b, n, NB, NULL), DI_KV_DISK_CHECK_OK);
    // A record of another model inside a transfer whose header is this model's.
    di_kv_disk_record_put(&other, 1002, 1001, 9, tok, pay, b + di_kv_transfer_record_offset(&l, 2));
    CHECK_EQ(check(&l, b, n, NB, "record 2"), DI_KV_DISK_CHECK_OTHER_MODEL);
    free(b);
}

static void write_seed(const char *dir, const char *name, const unsigned char *b, size_t n) {
    char path[512];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    FILE *f = fopen(path, "wb");
    CHECK(f != NULL);
    if (f) {
        CHECK_EQ(fwrite(b, 1, n, f), n);
        fclose(f);
    }
}

// The fuzz target's seeds: a 0 byte (its "parse" mode) and a transfer of 0, 1 and 4 blocks (the
// one of 4 with a tail snapshot of SNAP bytes, the target's receiver's size); and two recipes (a
// first byte of 1: its "build" mode) of 3 good records and of 2 records with a broken link.
static void write_seeds(const char *dir) {
    const di_kv_disk_layout l = layout(0xabc, 0);
    const int counts[] = {0, 1, NB};
    for (int k = 0; k < 3; k++) {
        size_t n;
        unsigned char *b = make_snap(&l, counts[k], (uint64_t)k, counts[k] == NB ? SNAP : 0, &n);
        unsigned char *s = malloc(n + 1);
        CHECK(s != NULL);
        if (!s) return;
        s[0] = 0;
        memcpy(s + 1, b, n);
        char name[32];
        snprintf(name, sizeof name, "chain%d.bin", counts[k]);
        write_seed(dir, name, s, n + 1);
        free(s);
        free(b);
    }
    // A recipe: its mode byte, the head (3 records), the snapshot flags (1: one of SNAP bytes)
    // and SNAP + 8 snapshot bytes, then per record its flags, hash, tokens and payload.
    enum { REC = 1 + 8 + BT + NF, PRE = 3 + SNAP + 8 };
    unsigned char r[PRE + 3 * REC];
    memset(r, 0, sizeof r);
    r[0] = 1;
    r[1] = 3;
    r[2] = 1;
    for (size_t i = 3; i < sizeof r; i++) r[i] = (unsigned char)(i * 7 % 251 & ~0x0f);
    r[PRE] = 0; // record 0's flags: none
    write_seed(dir, "recipe3.bin", r, sizeof r);
    r[1] = 2;
    r[2] = 0;
    r[PRE + REC] = 0x02; // record 1: a broken parent link
    write_seed(dir, "recipe2_link.bin", r, PRE + 2 * REC);
}

int main(void) {
    const char *seeds = getenv("DI_KV_TRANSFER_WRITE_SEEDS");
    if (seeds) write_seeds(seeds);
    RUN(test_record_roundtrip);
    RUN(test_transfer_roundtrip);
    RUN(test_transfer_damage);
    return test_finish();
}
