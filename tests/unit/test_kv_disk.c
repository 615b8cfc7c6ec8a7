// kv_disk: records round-trip across a reopen; every kind of damage (truncated, extended, flipped
// payload / token / header bytes, another model, a record under another hash's name, different
// tokens, parent or salt, a vanished file) makes the read a miss and deletes the record; the byte
// budget evicts the least recently used; the time-to-live drops records at open and on lookup;
// records with a tail snapshot (round trip, damage to the snapshot section, the budget counting
// it) and one of the previous version; a second store on a locked directory is refused; leftovers
// are cleaned at open; writes and reads allocate nothing; the write queue (kv_disk_io): records
// written by its IO thread are byte for byte those of synchronous writes, queued records are found
// (and checked) before they are on disk, a full queue drops (counted) or waits, the ring wraps with
// records of mixed sizes, IO errors are counted, destroy writes what is queued; the read thread
// (a read job: a chain from the store and the queue, verified, stopping at the first miss or bad
// record, its snapshot; held, aborted, destroyed in flight); and the time of one write / read of a
// V4-Flash-shaped block, and of staging it on the queue.
#include "harness.h"

#include <fcntl.h>
#include <pthread.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include <zlib.h>

#include "base/mem.h"
#include "kv/kv_disk.h"
#include "kv/kv_disk_io.h"

enum { BT = 16, NF = 1000 };

static char g_root[256];
static int g_n_dirs;
static int64_t g_now;

static int64_t fake_now(void *user) {
    (void)user;
    return g_now;
}

static const char *new_dir(char *buf, size_t cap) {
    snprintf(buf, cap, "%s/d%d", g_root, g_n_dirs++);
    return buf;
}

static di_kv_disk_layout layout(uint64_t model_id) {
    return (di_kv_disk_layout){.model_id = model_id,
                               .precision = 0,
                               .block_tokens = BT,
                               .block_floats = 1024,
                               .payload_floats = NF};
}

static di_kv_disk *open_store(const char *dir, uint64_t model_id, size_t max_bytes, int64_t ttl) {
    di_kv_disk_options o = {
        .dir = dir, .max_bytes = max_bytes, .ttl_s = ttl, .now_s = fake_now, .now_user = NULL};
    di_kv_disk_layout l = layout(model_id);
    di_kv_disk *d = NULL;
    CHECK_EQ(di_kv_disk_create(&o, &l, &d), DI_OK);
    return d;
}

// Block k's tokens and payload (deterministic).
static void block(int k, int32_t *tok, float *pay) {
    for (int i = 0; i < BT; i++) tok[i] = k * 100 + i;
    for (int i = 0; i < NF; i++) pay[i] = (float)k + (float)i * 0.001f;
}

static uint64_t hash_of(int k) {
    return 0x1234567890abcdefull * (uint64_t)(k + 1);
}

static bool exists(const char *p) {
    return access(p, F_OK) == 0;
}

static void test_roundtrip(void) {
    char dir[300];
    new_dir(dir, sizeof dir);
    g_now = 1700000000;
    di_kv_disk *d = open_store(dir, 7, 0, 0);
    if (!d) return;
    int32_t tok[BT];
    static float pay[NF], back[NF];
    block(1, tok, pay);
    CHECK(!di_kv_disk_has(d, hash_of(1)));
    CHECK(!di_kv_disk_read(d, hash_of(1), 11, 5, tok, back, NULL, 0, NULL));
    int64_t a0 = di_mem_thread_allocs();
    CHECK_EQ(di_kv_disk_write(d, hash_of(1), 11, 5, tok, pay, NULL, 0), DI_OK);
    CHECK_EQ(di_kv_disk_write(d, hash_of(1), 11, 5, tok, pay, NULL, 0),
             DI_OK); // already there: no write
    CHECK(di_kv_disk_read(d, hash_of(1), 11, 5, tok, back, NULL, 0, NULL));
    CHECK_EQ(di_mem_thread_allocs() - a0, 0); // nothing allocated on the step path
    CHECK(!memcmp(pay, back, sizeof pay));
    di_kv_disk_stats st;
    di_kv_disk_get_stats(d, &st);
    CHECK_EQ(st.n_written, 1);
    CHECK_EQ(st.n_read, 1);
    CHECK_EQ(st.n_records, 1);
    CHECK_EQ(st.n_bytes, (int64_t)di_kv_disk_record_bytes(d));
    CHECK_EQ(di_kv_disk_record_bytes(d), 128 + 4 * BT + 4 * NF);
    di_kv_disk_destroy(d);
    // A restart finds it.
    d = open_store(dir, 7, 0, 0);
    if (!d) return;
    di_kv_disk_get_stats(d, &st);
    CHECK_EQ(st.n_found_at_open, 1);
    memset(back, 0, sizeof back);
    CHECK(di_kv_disk_read(d, hash_of(1), 11, 5, tok, back, NULL, 0, NULL));
    CHECK(!memcmp(pay, back, sizeof pay));
    di_kv_disk_destroy(d);
}

// Damage kinds applied to a record file.
enum {
    DMG_TRUNCATE,
    DMG_EXTEND,
    DMG_PAYLOAD,
    DMG_TOKEN,
    DMG_MAGIC,
    DMG_HEADER_FIELD, // a header byte (the salt) with its checksum left as is
    DMG_DELETE,
    DMG_N
};

static void damage(const char *p, int kind, size_t rec) {
    if (kind == DMG_DELETE) {
        CHECK_EQ(unlink(p), 0);
        return;
    }
    int fd = open(p, O_RDWR);
    CHECK(fd >= 0);
    if (fd < 0) return;
    unsigned char c;
    off_t at = kind == DMG_PAYLOAD ? (off_t)rec - 3
               : kind == DMG_TOKEN ? 128 + 5
               : kind == DMG_MAGIC ? 0
                                   : 64; // rec_header.salt
    if (kind == DMG_TRUNCATE) {
        CHECK_EQ(ftruncate(fd, (off_t)rec - 1), 0);
    } else if (kind == DMG_EXTEND) {
        c = 0;
        CHECK_EQ(pwrite(fd, &c, 1, (off_t)rec), 1);
    } else {
        CHECK_EQ(pread(fd, &c, 1, at), 1);
        c ^= 0x10;
        CHECK_EQ(pwrite(fd, &c, 1, at), 1);
    }
    close(fd);
}

static void test_corruption(void) {
    char dir[300], p[4200];
    new_dir(dir, sizeof dir);
    g_now = 1700000000;
    di_kv_disk *d = open_store(dir, 7, 0, 0);
    if (!d) return;
    int32_t tok[BT];
    static float pay[NF], back[NF];
    const size_t rec = di_kv_disk_record_bytes(d);
    int64_t dropped = 0;
    di_kv_disk_stats st;
    for (int kind = 0; kind < DMG_N; kind++) {
        block(kind, tok, pay);
        uint64_t h = hash_of(kind);
        CHECK_EQ(di_kv_disk_write(d, h, 3, 4, tok, pay, NULL, 0), DI_OK);
        di_kv_disk_path(d, h, p, sizeof p);
        CHECK(exists(p));
        damage(p, kind, rec);
        CHECK(!di_kv_disk_read(d, h, 3, 4, tok, back, NULL, 0, NULL));
        CHECK(!exists(p)); // deleted
        CHECK(!di_kv_disk_has(d, h));
        di_kv_disk_get_stats(d, &st);
        CHECK_EQ(st.n_dropped, ++dropped);
        CHECK_EQ(st.n_records, 0);
    }
    // A valid record looked up with different tokens, parent or salt (what a 64-bit collision
    // would look like): a miss, and dropped.
    for (int which = 0; which < 3; which++) {
        block(20, tok, pay);
        CHECK_EQ(di_kv_disk_write(d, hash_of(20), 3, 4, tok, pay, NULL, 0), DI_OK);
        if (which == 0) tok[BT - 1]++;
        CHECK(!di_kv_disk_read(d, hash_of(20), which == 1 ? 9 : 3, which == 2 ? 9 : 4, tok, back,
                               NULL, 0, NULL));
        CHECK(!di_kv_disk_has(d, hash_of(20)));
        di_kv_disk_get_stats(d, &st);
        CHECK_EQ(st.n_dropped, ++dropped);
    }
    // A valid record under another hash's name (copied there while the store was closed).
    block(30, tok, pay);
    CHECK_EQ(di_kv_disk_write(d, hash_of(30), 3, 4, tok, pay, NULL, 0), DI_OK);
    di_kv_disk_destroy(d);
    char q[4200], cmd[9000];
    {
        di_kv_disk *t = open_store(dir, 7, 0, 0);
        if (!t) return;
        di_kv_disk_path(t, hash_of(30), p, sizeof p);
        di_kv_disk_path(t, hash_of(31), q, sizeof q);
        di_kv_disk_destroy(t);
    }
    snprintf(cmd, sizeof cmd, "cp '%s' '%s'", p, q);
    CHECK_EQ(system(cmd), 0);
    d = open_store(dir, 7, 0, 0);
    if (!d) return;
    di_kv_disk_get_stats(d, &st);
    CHECK_EQ(st.n_found_at_open, 2);
    CHECK(!di_kv_disk_read(d, hash_of(31), 3, 4, tok, back, NULL, 0, NULL));
    CHECK(!exists(q));
    CHECK(di_kv_disk_read(d, hash_of(30), 3, 4, tok, back, NULL, 0, NULL));
    CHECK(!memcmp(pay, back, sizeof pay));
    di_kv_disk_destroy(d);
    // Another model (same sizes): its records are never returned.
    d = open_store(dir, 8, 0, 0);
    if (!d) return;
    CHECK(!di_kv_disk_read(d, hash_of(30), 3, 4, tok, back, NULL, 0, NULL));
    di_kv_disk_get_stats(d, &st);
    CHECK_EQ(st.n_dropped, 1);
    CHECK(!exists(p));
    di_kv_disk_destroy(d);
}

static void test_budget_lru(void) {
    char dir[300], p[4200];
    new_dir(dir, sizeof dir);
    g_now = (int64_t)time(NULL);
    di_kv_disk *d = open_store(dir, 7, 0, 0);
    if (!d) return;
    const size_t rec = di_kv_disk_record_bytes(d);
    di_kv_disk_destroy(d);
    d = open_store(dir, 7, 3 * rec, 0);
    if (!d) return;
    int32_t tok[BT];
    static float pay[NF], back[NF];
    for (int k = 0; k < 3; k++) {
        g_now++;
        block(k, tok, pay);
        CHECK_EQ(di_kv_disk_write(d, hash_of(k), 0, 0, tok, pay, NULL, 0), DI_OK);
    }
    g_now++;
    block(0, tok, pay);
    CHECK(
        di_kv_disk_read(d, hash_of(0), 0, 0, tok, back, NULL, 0, NULL)); // 0 is now the most recent
    g_now++;
    block(3, tok, pay);
    CHECK_EQ(di_kv_disk_write(d, hash_of(3), 0, 0, tok, pay, NULL, 0), DI_OK); // evicts 1
    CHECK(di_kv_disk_has(d, hash_of(0)));
    CHECK(!di_kv_disk_has(d, hash_of(1)));
    CHECK(!exists(di_kv_disk_path(d, hash_of(1), p, sizeof p)));
    CHECK(di_kv_disk_has(d, hash_of(2)));
    CHECK(di_kv_disk_has(d, hash_of(3)));
    di_kv_disk_stats st;
    di_kv_disk_get_stats(d, &st);
    CHECK_EQ(st.n_evicted, 1);
    CHECK_EQ(st.n_records, 3);
    CHECK_EQ(st.n_bytes, (int64_t)(3 * rec));
    di_kv_disk_destroy(d);
    // Reopened with room for two: the two most recently used stay (3 at now, 0 read before).
    d = open_store(dir, 7, 2 * rec, 0);
    if (!d) return;
    CHECK(di_kv_disk_has(d, hash_of(0)));
    CHECK(!di_kv_disk_has(d, hash_of(2)));
    CHECK(di_kv_disk_has(d, hash_of(3)));
    di_kv_disk_get_stats(d, &st);
    CHECK_EQ(st.n_records, 2);
    CHECK_EQ(st.n_evicted, 1);
    di_kv_disk_destroy(d);
    // A budget below one record is refused.
    di_kv_disk_options o = {.dir = dir, .max_bytes = rec - 1};
    di_kv_disk_layout l = layout(7);
    CHECK_EQ(di_kv_disk_create(&o, &l, &d), DI_ERR_INVALID);
}

static void test_ttl(void) {
    char dir[300], p[4200];
    new_dir(dir, sizeof dir);
    const int64_t t0 = (int64_t)time(NULL);
    g_now = t0;
    di_kv_disk *d = open_store(dir, 7, 0, 100);
    if (!d) return;
    int32_t tok[BT];
    static float pay[NF], back[NF];
    block(1, tok, pay);
    CHECK_EQ(di_kv_disk_write(d, hash_of(1), 0, 0, tok, pay, NULL, 0), DI_OK);
    block(2, tok, pay);
    CHECK_EQ(di_kv_disk_write(d, hash_of(2), 0, 0, tok, pay, NULL, 0), DI_OK);
    g_now = t0 + 60;
    CHECK(di_kv_disk_read(d, hash_of(2), 0, 0, tok, back, NULL, 0,
                          NULL)); // used: lives until t0 + 160
    g_now = t0 + 150;
    CHECK(!di_kv_disk_has(d, hash_of(1))); // unused for 150 s > 100: dropped on lookup
    CHECK(!exists(di_kv_disk_path(d, hash_of(1), p, sizeof p)));
    CHECK(di_kv_disk_has(d, hash_of(2)));
    di_kv_disk_stats st;
    di_kv_disk_get_stats(d, &st);
    CHECK_EQ(st.n_expired, 1);
    di_kv_disk_destroy(d);
    // At open: the file's mtime (last use, t0 + 60) is too old at t0 + 200.
    g_now = t0 + 200;
    d = open_store(dir, 7, 0, 100);
    if (!d) return;
    di_kv_disk_get_stats(d, &st);
    CHECK_EQ(st.n_found_at_open, 0);
    CHECK_EQ(st.n_expired, 1);
    CHECK(!exists(di_kv_disk_path(d, hash_of(2), p, sizeof p)));
    di_kv_disk_destroy(d);
}

static void test_lock_and_leftovers(void) {
    char dir[300], p[4200], q[4200];
    new_dir(dir, sizeof dir);
    g_now = (int64_t)time(NULL);
    di_kv_disk *a = open_store(dir, 7, 0, 0), *b = NULL;
    if (!a) return;
    di_kv_disk_options o = {.dir = dir, .now_s = fake_now};
    di_kv_disk_layout l = layout(7);
    CHECK_EQ(di_kv_disk_create(&o, &l, &b), DI_ERR_BUSY); // a second engine on the same directory
    CHECK(b == NULL);
    // Leftovers for the next open: a crash's temporary file, a record of another size, a stranger.
    di_kv_disk_path(a, hash_of(5), p, sizeof p);
    snprintf(q, sizeof q, "%.*s.tmp", (int)(strlen(p) - 4), p);
    FILE *f = fopen(q, "w");
    CHECK(f != NULL);
    if (f) fclose(f);
    f = fopen(p, "w");
    CHECK(f != NULL);
    if (f) fputs("short", f), fclose(f);
    char other[4200];
    snprintf(other, sizeof other, "%s/README", dir);
    f = fopen(other, "w");
    if (f) fclose(f);
    di_kv_disk_destroy(a);
    CHECK_EQ(di_kv_disk_create(&o, &l, &b), DI_OK); // the lock is free again
    CHECK(!exists(p));
    CHECK(!exists(q));
    CHECK(exists(other));
    di_kv_disk_stats st;
    di_kv_disk_get_stats(b, &st);
    CHECK_EQ(st.n_records, 0);
    di_kv_disk_destroy(b);
}

static double now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec * 1e3 + (double)ts.tv_nsec / 1e6;
}

// Records with a tail snapshot: round trip (with and without one, across a reopen), a snapshot of
// another size or none asked for (the block alone), a record rewritten to add one, every damage
// of the snapshot section (a flipped byte, truncated, extended) dropping the whole record, a
// record of the previous version (2) dropped, and the budget counting snapshot bytes.
static void test_snapshots(void) {
    enum { SNAP = 3000 };
    char dir[300], p[4200];
    new_dir(dir, sizeof dir);
    g_now = 1700000000;
    di_kv_disk *d = open_store(dir, 7, 0, 0);
    if (!d) return;
    const size_t rec = di_kv_disk_record_bytes(d);
    int32_t tok[BT];
    static float pay[NF], back[NF];
    static unsigned char snap[SNAP], sback[SNAP + 8];
    for (int i = 0; i < SNAP; i++) snap[i] = (unsigned char)(i * 7 + 3);
    block(1, tok, pay);
    int64_t a0 = di_mem_thread_allocs();
    CHECK_EQ(di_kv_disk_write(d, hash_of(1), 0, 5, tok, pay, snap, SNAP), DI_OK);
    CHECK_EQ(di_kv_disk_snap_bytes(d, hash_of(1)), (size_t)SNAP);
    bool got = false;
    CHECK(di_kv_disk_read(d, hash_of(1), 0, 5, tok, back, sback, SNAP, &got));
    CHECK_EQ(di_mem_thread_allocs() - a0, 0);
    CHECK(got);
    CHECK(!memcmp(back, pay, sizeof pay));
    CHECK(!memcmp(sback, snap, SNAP));
    // Not asked for, or of another size: the block alone.
    CHECK(di_kv_disk_read(d, hash_of(1), 0, 5, tok, back, NULL, 0, &got));
    CHECK(!got);
    CHECK(di_kv_disk_read(d, hash_of(1), 0, 5, tok, back, sback, SNAP + 8, &got));
    CHECK(!got);
    CHECK(!memcmp(back, pay, sizeof pay));
    // A record without one is rewritten to add it; one with it is not rewritten.
    block(2, tok, pay);
    CHECK_EQ(di_kv_disk_write(d, hash_of(2), 0, 5, tok, pay, NULL, 0), DI_OK);
    CHECK_EQ(di_kv_disk_snap_bytes(d, hash_of(2)), (size_t)0);
    CHECK(di_kv_disk_read(d, hash_of(2), 0, 5, tok, back, sback, SNAP, &got));
    CHECK(!got);
    CHECK_EQ(di_kv_disk_write(d, hash_of(2), 0, 5, tok, pay, snap, SNAP), DI_OK);
    CHECK_EQ(di_kv_disk_write(d, hash_of(2), 0, 5, tok, pay, snap, SNAP), DI_OK);
    di_kv_disk_stats st;
    di_kv_disk_get_stats(d, &st);
    CHECK_EQ(st.n_written, 3);
    CHECK_EQ(st.n_snaps_written, 2);
    CHECK_EQ(st.n_snaps_read, 1);
    CHECK_EQ(st.n_records, 2);
    CHECK_EQ(st.n_bytes, (int64_t)(2 * (rec + SNAP)));
    di_kv_disk_destroy(d);
    // A restart finds both with their snapshots (and counts their bytes).
    d = open_store(dir, 7, 0, 0);
    if (!d) return;
    di_kv_disk_get_stats(d, &st);
    CHECK_EQ(st.n_found_at_open, 2);
    CHECK_EQ(st.bytes_found_at_open, (int64_t)(2 * (rec + SNAP)));
    memset(sback, 0, sizeof sback);
    CHECK(di_kv_disk_read(d, hash_of(2), 0, 5, tok, back, sback, SNAP, &got));
    CHECK(got);
    CHECK(!memcmp(back, pay, sizeof pay));
    CHECK(!memcmp(sback, snap, SNAP));
    // Damage to the snapshot section drops the whole record, also for a reader not asking for
    // the snapshot when the size no longer matches the header.
    for (int kind = 0; kind < 4; kind++) {
        block(10 + kind, tok, pay);
        const uint64_t h = hash_of(10 + kind);
        CHECK_EQ(di_kv_disk_write(d, h, 0, 5, tok, pay, snap, SNAP), DI_OK);
        di_kv_disk_path(d, h, p, sizeof p);
        int fd = open(p, O_RDWR);
        CHECK(fd >= 0);
        if (fd < 0) continue;
        unsigned char c = 0;
        if (kind == 0 || kind == 1) { // a flipped first / last snapshot byte
            const off_t at = (off_t)(kind == 0 ? rec : rec + SNAP - 1);
            CHECK_EQ(pread(fd, &c, 1, at), 1);
            c ^= 0x01;
            CHECK_EQ(pwrite(fd, &c, 1, at), 1);
        } else if (kind == 2) {
            CHECK_EQ(ftruncate(fd, (off_t)(rec + SNAP - 1)), 0);
        } else {
            CHECK_EQ(pwrite(fd, &c, 1, (off_t)(rec + SNAP)), 1);
        }
        close(fd);
        di_kv_disk_get_stats(d, &st);
        const int64_t dropped = st.n_dropped, read = st.n_read;
        if (kind >= 2)
            CHECK(!di_kv_disk_read(d, h, 0, 5, tok, back, NULL, 0, NULL));
        else
            CHECK(!di_kv_disk_read(d, h, 0, 5, tok, back, sback, SNAP, &got));
        di_kv_disk_get_stats(d, &st);
        CHECK_EQ(st.n_dropped, dropped + 1);
        CHECK_EQ(st.n_read, read);
        CHECK(!exists(p));
        CHECK(!di_kv_disk_has(d, h));
    }
    // A record of version 2 (a valid header otherwise): dropped.
    {
        block(20, tok, pay);
        CHECK_EQ(di_kv_disk_write(d, hash_of(20), 0, 5, tok, pay, NULL, 0), DI_OK);
        di_kv_disk_path(d, hash_of(20), p, sizeof p);
        unsigned char hd[128];
        int fd = open(p, O_RDWR);
        CHECK(fd >= 0);
        if (fd >= 0) {
            CHECK_EQ(pread(fd, hd, sizeof hd, 0), (ssize_t)sizeof hd);
            uint32_t v = 2, zero = 0;
            memcpy(hd + 8, &v, 4);
            memcpy(hd + 84, &zero, 4); // crc_header, computed with itself 0
            uint32_t c = (uint32_t)crc32_z(crc32_z(0L, Z_NULL, 0), hd, sizeof hd);
            memcpy(hd + 84, &c, 4);
            CHECK_EQ(pwrite(fd, hd, sizeof hd, 0), (ssize_t)sizeof hd);
            close(fd);
        }
        di_kv_disk_get_stats(d, &st);
        const int64_t dropped = st.n_dropped;
        CHECK(!di_kv_disk_read(d, hash_of(20), 0, 5, tok, back, NULL, 0, NULL));
        di_kv_disk_get_stats(d, &st);
        CHECK_EQ(st.n_dropped, dropped + 1);
        CHECK(!exists(p));
    }
    di_kv_disk_destroy(d);
    // The budget counts snapshot bytes: 2 records with snapshots + 1 without fit; a third with a
    // snapshot evicts the least recently used. A budget below one record with its snapshot
    // keeps the block alone.
    new_dir(dir, sizeof dir);
    d = open_store(dir, 7, 3 * rec + 2 * SNAP, 0);
    if (!d) return;
    for (int k = 0; k < 3; k++) {
        block(30 + k, tok, pay);
        CHECK_EQ(di_kv_disk_write(d, hash_of(30 + k), 0, 0, tok, pay, k < 2 ? snap : NULL, SNAP),
                 DI_OK);
    }
    di_kv_disk_get_stats(d, &st);
    CHECK_EQ(st.n_records, 3);
    CHECK_EQ(st.n_evicted, 0);
    block(33, tok, pay);
    CHECK_EQ(di_kv_disk_write(d, hash_of(33), 0, 0, tok, pay, snap, SNAP), DI_OK);
    di_kv_disk_get_stats(d, &st);
    CHECK_EQ(st.n_evicted, 1);
    CHECK(!di_kv_disk_has(d, hash_of(30)));
    CHECK(st.n_bytes <= (int64_t)(3 * rec + 2 * SNAP));
    CHECK_EQ(st.n_bytes, (int64_t)(3 * rec + 2 * SNAP));
    di_kv_disk_destroy(d);
    new_dir(dir, sizeof dir);
    d = open_store(dir, 7, rec + SNAP - 1, 0);
    if (!d) return;
    block(40, tok, pay);
    CHECK_EQ(di_kv_disk_write(d, hash_of(40), 0, 0, tok, pay, snap, SNAP), DI_OK);
    CHECK_EQ(di_kv_disk_snap_bytes(d, hash_of(40)), (size_t)0);
    di_kv_disk_get_stats(d, &st);
    CHECK_EQ(st.n_snaps_written, 0);
    CHECK(di_kv_disk_read(d, hash_of(40), 0, 0, tok, back, sback, SNAP, &got));
    CHECK(!got);
    di_kv_disk_destroy(d);
}

// One write and one read of a V4-Flash-shaped block: 128 positions, 21 CSA layers (32 entries of
// 512 floats + 32 indexer keys of 128) and 20 HCA layers (1 entry of 512): 440,320 floats
// (1.76 MB). Page cache, no fsync: what the engine thread pays per evicted / restored block.
// ---- the write queue (kv_disk_io) ----

static bool same_file(const char *a, const char *b) {
    FILE *fa = fopen(a, "rb"), *fb = fopen(b, "rb");
    bool same = fa && fb;
    while (same) {
        int x = fgetc(fa), y = fgetc(fb);
        if (x != y) same = false;
        if (x == EOF || y == EOF) break;
    }
    if (fa) fclose(fa);
    if (fb) fclose(fb);
    return same;
}

typedef struct release_later {
    di_kv_disk_io *q;
    int ms;
} release_later;

static void *release_main(void *p) {
    release_later *r = p;
    usleep((useconds_t)r->ms * 1000);
    di_kv_disk_io_hold(r->q, false);
    return NULL;
}

static void test_queue(void) {
    enum { SNAP = 3000 };
    char dir[300], dir2[300], pa[4200], pb[4200];
    new_dir(dir, sizeof dir);
    new_dir(dir2, sizeof dir2);
    g_now = 1700000000;
    di_kv_disk *d = open_store(dir, 7, 0, 0), *d2 = open_store(dir2, 7, 0, 0);
    di_kv_disk_io *q = NULL;
    if (!d || !d2) goto out;
    // Staging for three records without a snapshot (tokens and payload, each 64-aligned).
    const size_t rec = 64 + 4032;
    CHECK_EQ(di_kv_disk_io_create(d, 3 * rec, &q), DI_OK);
    if (!q) goto out;
    int32_t tok[BT], other[BT];
    static float pay[NF], back[NF];
    static unsigned char snap[SNAP], sback[SNAP];
    for (int i = 0; i < SNAP; i++) snap[i] = (unsigned char)(i * 7);
    // Held: records stay queued; lookups find them there (and only with their parent, salt and
    // tokens), the store does not have them yet.
    di_kv_disk_io_hold(q, true);
    for (int k = 0; k < 2; k++) {
        block(k, tok, pay);
        CHECK_EQ(di_kv_disk_io_put(q, hash_of(k), 11, 5, tok, pay, NULL, 0, false), DI_OK);
    }
    block(1, tok, pay);
    pay[0] = -1; // the caller's memory is reused at once: the queue holds a copy
    size_t sb = 9;
    CHECK(di_kv_disk_io_find(q, hash_of(1), &sb));
    CHECK_EQ(sb, 0);
    CHECK(!di_kv_disk_io_find(q, hash_of(2), NULL));
    CHECK(!di_kv_disk_has(d, hash_of(0)));
    block(1, tok, pay);
    bool got = true;
    CHECK(di_kv_disk_io_read(q, hash_of(1), 11, 5, tok, back, NULL, 0, &got));
    CHECK(!got);
    CHECK(!memcmp(back, pay, sizeof pay));
    memcpy(other, tok, sizeof tok);
    other[3]++;
    CHECK(!di_kv_disk_io_read(q, hash_of(1), 11, 5, other, back, NULL, 0, NULL));
    CHECK(!di_kv_disk_io_read(q, hash_of(1), 12, 5, tok, back, NULL, 0, NULL));
    CHECK(!di_kv_disk_io_read(q, hash_of(1), 11, 6, tok, back, NULL, 0, NULL));
    // A third fits; a fourth does not: dropped and counted (eviction never waits).
    block(2, tok, pay);
    CHECK_EQ(di_kv_disk_io_put(q, hash_of(2), 11, 5, tok, pay, NULL, 0, false), DI_OK);
    block(3, tok, pay);
    CHECK_EQ(di_kv_disk_io_put(q, hash_of(3), 11, 5, tok, pay, NULL, 0, false), DI_ERR_BUSY);
    di_kv_disk_io_stats qs;
    di_kv_disk_io_get_stats(q, &qs);
    CHECK_EQ(qs.n_queued, 3);
    CHECK_EQ(qs.n_dropped, 1);
    CHECK_EQ(qs.n_pending, 3);
    CHECK_EQ(qs.pending_bytes, (int64_t)(3 * rec));
    CHECK_EQ(qs.n_hits, 1);
    // With wait (the shutdown flush): blocks until the IO thread made room, nothing dropped.
    pthread_t th;
    release_later rl = {q, 50};
    CHECK_EQ(pthread_create(&th, NULL, release_main, &rl), 0);
    CHECK_EQ(di_kv_disk_io_put(q, hash_of(3), 11, 5, tok, pay, NULL, 0, true), DI_OK);
    pthread_join(th, NULL);
    di_kv_disk_io_drain(q);
    di_kv_disk_io_get_stats(q, &qs);
    CHECK_EQ(qs.n_dropped, 1);
    CHECK_EQ(qs.n_pending, 0);
    CHECK_EQ(qs.pending_bytes, 0);
    // Written: the same files as synchronous writes of the same records.
    for (int k = 0; k < 4; k++) {
        block(k, tok, pay);
        CHECK_EQ(di_kv_disk_write(d2, hash_of(k), 11, 5, tok, pay, NULL, 0), DI_OK);
        CHECK(di_kv_disk_has(d, hash_of(k)));
        CHECK(same_file(di_kv_disk_path(d, hash_of(k), pa, sizeof pa),
                        di_kv_disk_path(d2, hash_of(k), pb, sizeof pb)));
        CHECK(!di_kv_disk_io_find(q, hash_of(k), NULL));
    }
    // A snapshot larger than the whole staging is left out (the block alone is queued); one that
    // fits is queued and found with its record.
    static unsigned char big[3 * (64 + 4032)];
    block(4, tok, pay);
    di_kv_disk_io_hold(q, true);
    CHECK_EQ(di_kv_disk_io_put(q, hash_of(4), 11, 5, tok, pay, big, sizeof big, false), DI_OK);
    CHECK(di_kv_disk_io_find(q, hash_of(4), &sb));
    CHECK_EQ(sb, 0);
    block(5, tok, pay);
    CHECK_EQ(di_kv_disk_io_put(q, hash_of(5), 11, 5, tok, pay, snap, SNAP, false), DI_OK);
    CHECK(di_kv_disk_io_find(q, hash_of(5), &sb));
    CHECK_EQ(sb, SNAP);
    CHECK(di_kv_disk_io_read(q, hash_of(5), 11, 5, tok, back, sback, SNAP, &got));
    CHECK(got);
    CHECK(!memcmp(sback, snap, SNAP));
    di_kv_disk_io_hold(q, false);
    di_kv_disk_io_drain(q);
    CHECK_EQ(di_kv_disk_snap_bytes(d, hash_of(5)), SNAP);
    CHECK_EQ(di_kv_disk_snap_bytes(d, hash_of(4)), 0);
    // The ring wraps: many records of mixed sizes through three records of staging, while the IO
    // thread writes; each one intact on disk.
    for (int k = 10; k < 60; k++) {
        block(k, tok, pay);
        const bool with = k % 3 == 0;
        CHECK_EQ(di_kv_disk_io_put(q, hash_of(k), 11, 5, tok, pay, with ? snap : NULL,
                                   with ? (size_t)SNAP : 0, true),
                 DI_OK);
    }
    di_kv_disk_io_drain(q);
    int bad = 0;
    for (int k = 10; k < 60; k++) {
        block(k, tok, pay);
        const bool with = k % 3 == 0;
        got = false;
        bad += !di_kv_disk_read(d, hash_of(k), 11, 5, tok, back, sback, SNAP, &got);
        bad += memcmp(back, pay, sizeof pay) != 0 || got != with;
        if (with) bad += memcmp(sback, snap, SNAP) != 0;
    }
    CHECK_EQ(bad, 0);
    // An IO error on the IO thread (the record's fan-out directory is a file now): counted and
    // logged, the queue goes on with the next record.
    char sub[320];
    snprintf(sub, sizeof sub, "%s/%02x", dir, (unsigned)(hash_of(70) >> 56));
    di_test_remove_dir(sub);
    FILE *f = fopen(sub, "w");
    CHECK(f != NULL);
    if (f) fclose(f);
    block(70, tok, pay);
    CHECK_EQ(di_kv_disk_io_put(q, hash_of(70), 11, 5, tok, pay, NULL, 0, true), DI_OK);
    block(71, tok, pay);
    CHECK_EQ(di_kv_disk_io_put(q, hash_of(71), 11, 5, tok, pay, NULL, 0, true), DI_OK);
    di_kv_disk_io_drain(q);
    di_kv_disk_stats ds;
    di_kv_disk_get_stats(d, &ds);
    CHECK_EQ(ds.n_write_errors, 1);
    CHECK(!di_kv_disk_has(d, hash_of(70)));
    CHECK(di_kv_disk_has(d, hash_of(71)) || (hash_of(71) >> 56) == (hash_of(70) >> 56));
    unlink(sub);
    CHECK_EQ(mkdir(sub, 0755), 0);
    // Destroy writes what is queued, held or not: a reopened store finds it.
    di_kv_disk_io_hold(q, true);
    block(80, tok, pay);
    CHECK_EQ(di_kv_disk_io_put(q, hash_of(80), 11, 5, tok, pay, NULL, 0, false), DI_OK);
    di_kv_disk_io_destroy(q);
    q = NULL;
    di_kv_disk_destroy(d);
    d = open_store(dir, 7, 0, 0);
    if (!d) goto out;
    CHECK(di_kv_disk_read(d, hash_of(80), 11, 5, tok, back, NULL, 0, NULL));
    CHECK(!memcmp(back, pay, sizeof pay));
out:
    di_kv_disk_io_destroy(q);
    di_kv_disk_destroy(d);
    di_kv_disk_destroy(d2);
}

static void test_flash_block_time(void) {
    enum { FB = 128, FF = 21 * (32 * 512 + 32 * 128) + 20 * 512, N = 16 };
    char dir[300];
    new_dir(dir, sizeof dir);
    di_kv_disk_options o = {.dir = dir};
    di_kv_disk_layout l = {
        .model_id = 1, .block_tokens = FB, .block_floats = FF, .payload_floats = FF};
    di_kv_disk *d = NULL;
    CHECK_EQ(di_kv_disk_create(&o, &l, &d), DI_OK);
    if (!d) return;
    float *pay = di_malloc(sizeof(float) * FF), *back = di_malloc(sizeof(float) * FF);
    unsigned char *snap = NULL, *sback = NULL;
    int32_t tok[FB];
    CHECK(pay && back);
    if (!pay || !back) goto out;
    for (int i = 0; i < FF; i++) pay[i] = (float)i * 1e-3f;
    for (int i = 0; i < FB; i++) tok[i] = i;
    double t = now_ms();
    for (int k = 0; k < N; k++) {
        pay[0] = (float)k;
        CHECK_EQ(di_kv_disk_write(d, hash_of(k), 0, 0, tok, pay, NULL, 0), DI_OK);
    }
    const double w = (now_ms() - t) / N;
    t = now_ms();
    for (int k = 0; k < N; k++) {
        CHECK(di_kv_disk_read(d, hash_of(k), 0, 0, tok, back, NULL, 0, NULL));
        CHECK_EQ(back[0], (float)k);
    }
    const double r = (now_ms() - t) / N;
    CHECK(!memcmp(pay + 1, back + 1, sizeof(float) * (FF - 1)));
    fprintf(stderr, "V4-Flash-shaped block (%zu bytes a record): write %.3f ms, read %.3f ms\n",
            di_kv_disk_record_bytes(d), w, r);
    // One with a V4-Flash tail snapshot (17 tail blocks of 1,761,280 bytes: docs/kv-cache.md).
    enum { FS = 17 * 1761280 };
    snap = di_malloc(FS);
    sback = di_malloc(FS);
    CHECK(snap && sback);
    if (!snap || !sback) goto out;
    for (size_t i = 0; i < FS; i += 4096) snap[i] = (unsigned char)(i >> 12);
    t = now_ms();
    CHECK_EQ(di_kv_disk_write(d, hash_of(N), 0, 0, tok, pay, snap, FS), DI_OK);
    const double ws = now_ms() - t;
    t = now_ms();
    bool got = false;
    CHECK(di_kv_disk_read(d, hash_of(N), 0, 0, tok, back, sback, FS, &got));
    const double rs = now_ms() - t;
    CHECK(got);
    CHECK(!memcmp(snap, sback, FS));
    fprintf(stderr, "  with its tail snapshot (%zu bytes a record): write %.3f ms, read %.3f ms\n",
            di_kv_disk_record_bytes(d) + FS, ws, rs);
    // The engine thread's share through the write queue: staging a copy (the IO thread writes).
    {
        di_kv_disk_io *q = NULL;
        CHECK_EQ(di_kv_disk_io_create(d, 0, &q), DI_OK);
        if (q) {
            // 4 records spaced as evictions are (the IO thread keeps up), twice: the first round
            // touches fresh staging pages, the second reuses them (steady state).
            for (int round = 0; round < 2; round++) {
                double stage = 0, stage_max = 0;
                for (int k = 0; k < 4; k++) {
                    di_kv_disk_io_drain(q);
                    t = now_ms();
                    CHECK_EQ(di_kv_disk_io_put(q, hash_of(N + 1 + k + 4 * round), 0, 0, tok, pay,
                                               snap, FS, false),
                             DI_OK);
                    const double dt = now_ms() - t;
                    stage += dt / 4;
                    if (dt > stage_max) stage_max = dt;
                }
                di_kv_disk_io_drain(q);
                for (int k = 0; k < 4; k++)
                    CHECK_EQ(di_kv_disk_snap_bytes(d, hash_of(N + 1 + k + 4 * round)), FS);
                fprintf(stderr,
                        "  through the write queue (%s staging): the caller blocks %.3f ms a "
                        "record (max %.3f), the IO thread writes it\n",
                        round ? "warm" : "fresh", stage, stage_max);
            }
            di_kv_disk_io_destroy(q);
        }
    }
out:
    di_free(snap);
    di_free(sback);
    di_free(pay);
    di_free(back);
    di_kv_disk_destroy(d);
}

// ---- the read thread (kv_disk_io reads: the admission prefetch) ----

static void test_read_job(void) {
    char dir[300];
    di_kv_disk *d = open_store(new_dir(dir, sizeof dir), 7, 1 << 20, 0);
    di_kv_disk_io *q = NULL;
    if (d) CHECK_EQ(di_kv_disk_io_create(d, 0, &q), DI_OK);
    if (!q) {
        di_kv_disk_destroy(d);
        return;
    }
    enum { N = 5 };
    static int32_t tok[N * BT];
    static float pay[N][NF], back[N][NF];
    static unsigned char snap[64], sback[64];
    uint64_t hash[N];
    float *dst[N];
    for (int k = 0; k < N; k++) {
        block(k, tok + k * BT, pay[k]);
        hash[k] = hash_of(k);
        dst[k] = back[k];
    }
    memset(snap, 0x5a, sizeof snap);
    // A chain: blocks 0 and 1 on disk (1 with a snapshot), 2 queued (writes held), 3 nowhere, 4
    // on disk: the job reads 0..2 (2 from the queue) and stops at 3.
    CHECK_EQ(di_kv_disk_write(d, hash[0], 0, 5, tok, pay[0], NULL, 0), DI_OK);
    CHECK_EQ(di_kv_disk_write(d, hash[1], hash[0], 5, tok + BT, pay[1], snap, sizeof snap), DI_OK);
    CHECK_EQ(di_kv_disk_write(d, hash[4], hash[3], 5, tok + 4 * BT, pay[4], NULL, 0), DI_OK);
    di_kv_disk_io_hold(q, true);
    CHECK_EQ(di_kv_disk_io_put(q, hash[2], hash[1], 5, tok + 2 * BT, pay[2], NULL, 0, false),
             DI_OK);
    di_kv_disk_read_job j = {.salt = 5,
                             .parent0 = 0,
                             .n = N,
                             .hash = hash,
                             .tokens = tok,
                             .dst = dst,
                             .snap_block = 1,
                             .snap = sback,
                             .snap_bytes = sizeof sback};
    // Reads held: the job waits (submitting it again is refused meanwhile), and so do two jobs
    // queued behind it: one aborted while queued is done at once without a read (the running
    // one is not disturbed); released, the others run in order.
    float o_back[N][NF];
    float *o_dst[N] = {o_back[0], o_back[1], NULL, NULL, NULL};
    di_kv_disk_read_job j2 = {
        .salt = 5, .n = 2, .hash = hash, .tokens = tok, .dst = o_dst, .snap_block = -1};
    di_kv_disk_read_job j3 = j2;
    di_kv_disk_io_hold_reads(q, true);
    CHECK_EQ(di_kv_disk_io_read_submit(q, &j), DI_OK);
    CHECK_EQ(di_kv_disk_io_read_submit(q, &j), DI_ERR_BUSY);
    CHECK_EQ(di_kv_disk_io_read_submit(q, &j2), DI_OK);
    CHECK_EQ(di_kv_disk_io_read_submit(q, &j3), DI_OK);
    usleep(20000);
    CHECK(!di_kv_disk_io_read_done(q, &j));
    CHECK(!di_kv_disk_io_read_done(q, &j2));
    di_kv_disk_io_read_abort(q, &j2);
    CHECK(di_kv_disk_io_read_done(q, &j2));
    CHECK_EQ(j2.n_ok, 0);
    CHECK_EQ(j2.n_read, 0);
    CHECK(!di_kv_disk_io_read_done(q, &j));
    di_kv_disk_io_hold_reads(q, false);
    di_kv_disk_io_read_wait(q, &j3);
    CHECK(di_kv_disk_io_read_done(q, &j));
    CHECK(j3.done_us >= j.done_us); // oldest first
    CHECK_EQ(j3.n_ok, 2);
    CHECK_EQ(j3.n_read, 2);
    CHECK(!memcmp(o_back[0], pay[0], sizeof pay[0]));
    CHECK(!memcmp(o_back[1], pay[1], sizeof pay[1]));
    CHECK_EQ(j.n_ok, 3);
    CHECK_EQ(j.n_read, 3);
    CHECK(j.snap_ok);
    CHECK(!memcmp(sback, snap, sizeof snap));
    CHECK_EQ(j.bytes_read, (int64_t)(3 * sizeof(float) * NF + sizeof snap));
    for (int k = 0; k < 3; k++) CHECK(!memcmp(back[k], pay[k], sizeof pay[k]));
    // Blocks the submitter has (dst NULL) are not read; a record whose tokens are not the chain's
    // ends it there (block 1 with block 0's tokens).
    dst[0] = NULL;
    memcpy(tok + BT, tok, sizeof(int32_t) * BT);
    j.snap_block = -1;
    CHECK_EQ(di_kv_disk_io_read_submit(q, &j), DI_OK);
    di_kv_disk_io_read_wait(q, &j);
    CHECK_EQ(j.n_ok, 1);
    CHECK_EQ(j.n_read, 0);
    CHECK(!j.snap_ok);
    // Aborted while held: done at once, nothing read.
    block(1, tok + BT, pay[1]);
    dst[0] = back[0];
    di_kv_disk_io_hold_reads(q, true);
    CHECK_EQ(di_kv_disk_io_read_submit(q, &j), DI_OK);
    di_kv_disk_io_read_abort(q, &j);
    di_kv_disk_io_read_wait(q, &j);
    CHECK_EQ(j.n_ok, 0);
    CHECK_EQ(j.n_read, 0);
    // Destroyed with a job in flight and one queued (held): the read thread stops both and is
    // joined.
    CHECK_EQ(di_kv_disk_io_read_submit(q, &j), DI_OK);
    CHECK_EQ(di_kv_disk_io_read_submit(q, &j2), DI_OK);
    di_kv_disk_io_hold(q, false);
    di_kv_disk_io_destroy(q);
    CHECK_EQ(j.n_read, 0);
    CHECK_EQ(j2.n_read, 0);
    CHECK(!j.busy && !j2.busy);
    di_kv_disk_destroy(d);
}

int main(void) {
    snprintf(g_root, sizeof g_root, "/tmp/di_test_kv_disk_XXXXXX");
    if (!mkdtemp(g_root)) return 1;
    di_set_log_level(1);
    RUN(test_roundtrip);
    RUN(test_corruption);
    RUN(test_snapshots);
    RUN(test_budget_lru);
    RUN(test_ttl);
    RUN(test_lock_and_leftovers);
    RUN(test_queue);
    RUN(test_read_job);
    RUN(test_flash_block_time);
    di_test_remove_dir(g_root);
    return test_finish();
}
