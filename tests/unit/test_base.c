// Tests for src/base: buffer, thread pool partitioning and execution, json helpers.
#include "harness.h"

#include <stdatomic.h>
#include <stdint.h>
#include <time.h>

#include "base/buf.h"
#include "base/json.h"
#include "base/mem.h"
#include "base/thread.h"

static void test_buf(void) {
    di_buf b;
    di_buf_init(&b);
    CHECK(di_buf_append_str(&b, "abc") == DI_OK);
    CHECK(di_buf_printf(&b, "-%d-", 42) == DI_OK);
    for (int i = 0; i < 1000; i++) CHECK(di_buf_append(&b, "x", 1) == DI_OK);
    CHECK_EQ(b.len, 1007);
    CHECK(strncmp(b.data, "abc-42-x", 8) == 0);
    CHECK_EQ(b.data[b.len], 0);
    char *s = di_buf_take(&b);
    CHECK(b.data == NULL);
    di_free(s);
    di_buf_deinit(&b);
}

// di_buf_seal / di_reader: a sealed image reads back field by field; a changed byte, a truncated
// image and a read past the end are refused.
static void test_sealed_image(void) {
    di_buf b;
    di_buf_init(&b);
    uint32_t a = 0xdeadbeef, x = 0;
    double d = 3.5, y = 0;
    CHECK(di_buf_append(&b, &a, sizeof a) == DI_OK);
    CHECK(di_buf_append(&b, &d, sizeof d) == DI_OK);
    void *img = NULL;
    size_t n = 0;
    CHECK(di_buf_seal(&b, &img, &n) == DI_OK);
    CHECK(n == sizeof a + sizeof d + sizeof(uint64_t));
    CHECK(b.data == NULL && b.len == 0);
    di_reader r;
    CHECK(di_reader_open(&r, img, n));
    CHECK(di_reader_get(&r, &x, sizeof x) && x == a);
    CHECK(di_reader_get(&r, &y, sizeof y) && y == d);
    CHECK(r.left == 0 && !di_reader_get(&r, &x, 1));
    CHECK(!di_reader_open(&r, img, n - 1));
    CHECK(!di_reader_open(&r, img, 7));
    ((unsigned char *)img)[2] ^= 0x10;
    CHECK(!di_reader_open(&r, img, n));
    di_free(img);
}

static void test_split_range(void) {
    for (int nth = 1; nth <= 7; nth++) {
        for (int64_t n = 0; n < 30; n++) {
            int64_t expect_lo = 0;
            for (int ith = 0; ith < nth; ith++) {
                int64_t lo, hi;
                di_split_range(n, ith, nth, &lo, &hi);
                CHECK_EQ(lo, expect_lo);
                CHECK(hi - lo <= n / nth + 1);
                expect_lo = hi;
            }
            CHECK_EQ(expect_lo, n);
        }
    }
}

typedef struct sum_ctx {
    const int64_t *v;
    int64_t n;
    int64_t partial[16];
    atomic_int calls;
} sum_ctx;

static void sum_task(void *p, int ith, int nth) {
    sum_ctx *c = p;
    int64_t lo, hi, s = 0;
    di_split_range(c->n, ith, nth, &lo, &hi);
    for (int64_t i = lo; i < hi; i++) s += c->v[i];
    c->partial[ith] = s;
    atomic_fetch_add(&c->calls, 1);
}

static void test_pool(void) {
    int64_t v[1000];
    for (int i = 0; i < 1000; i++) v[i] = i;
    for (int nt = 1; nt <= 4; nt++) {
        di_pool *pool = NULL;
        CHECK(di_pool_create(nt, &pool) == DI_OK);
        CHECK_EQ(di_pool_n_threads(pool), nt);
        for (int rep = 0; rep < 50; rep++) {
            sum_ctx c = {.v = v, .n = 1000};
            atomic_init(&c.calls, 0);
            di_pool_run(pool, sum_task, &c);
            int64_t s = 0;
            for (int i = 0; i < nt; i++) s += c.partial[i];
            CHECK_EQ(s, 499500);
            CHECK_EQ(atomic_load(&c.calls), nt);
        }
        di_pool_destroy(pool);
    }
    di_pool_destroy(NULL);
}

typedef struct once_ctx {
    atomic_int ran[8]; // calls per thread index
    int slow;          // the thread that takes 4 spins before it returns (-1: none)
} once_ctx;

static void sleep_ns(long ns) {
    struct timespec t = {.tv_sec = ns / 1000000000, .tv_nsec = ns % 1000000000};
    while (nanosleep(&t, &t) != 0) {
    }
}

static void once_task(void *p, int ith, int nth) {
    once_ctx *c = p;
    (void)nth;
    if (ith == c->slow) sleep_ns(4L * DI_POOL_SPIN_NS);
    atomic_fetch_add(&c->ran[ith], 1);
}

// The pool's waits spin, then sleep (thread.h): jobs that find the workers spinning, jobs that
// find them asleep (a gap of several spins), a worker slow enough that the submitter sleeps, and
// the submitter slow while the workers wait. Every job runs on every thread exactly once and has
// finished when di_pool_run returns; a lost wake-up hangs here (the ctest timeout).
static void test_pool_sleep(void) {
    for (int nt = 2; nt <= 4; nt++) {
        di_pool *pool = NULL;
        CHECK(di_pool_create(nt, &pool) == DI_OK);
        for (int rep = 0; rep < 24; rep++) {
            once_ctx c = {.slow = rep % 3 == 2 ? rep % nt : -1};
            for (int i = 0; i < 8; i++) atomic_init(&c.ran[i], 0);
            if (rep % 4 == 1) sleep_ns(3L * DI_POOL_SPIN_NS); // the workers fall asleep
            di_pool_run(pool, once_task, &c);
            for (int i = 0; i < nt; i++) CHECK_EQ(atomic_load(&c.ran[i]), 1);
        }
        for (int rep = 0; rep < 20000; rep++) { // back to back: the workers never sleep
            once_ctx c = {.slow = -1};
            for (int i = 0; i < 8; i++) atomic_init(&c.ran[i], 0);
            di_pool_run(pool, once_task, &c);
            int ok = 1;
            for (int i = 0; i < nt; i++) ok &= atomic_load(&c.ran[i]) == 1;
            if (!ok) {
                CHECK(ok);
                break;
            }
        }
        di_pool_destroy(pool);
    }
}

static void test_json(void) {
    json_error_t err;
    json_t *j =
        json_loads("{\"a\": 3, \"b\": 2.0, \"c\": 1.5, \"s\": \"x\", \"t\": true}", 0, &err);
    CHECK(j != NULL);
    int64_t i;
    double d;
    bool b;
    CHECK(di_json_get_int(j, "a", &i) && i == 3);
    CHECK(di_json_get_int(j, "b", &i) && i == 2);
    CHECK(!di_json_get_int(j, "c", &i));
    CHECK(di_json_get_num(j, "c", &d) && d == 1.5);
    CHECK(di_json_get_bool(j, "t", &b) && b);
    CHECK_STR_EQ(di_json_get_str(j, "s"), "x");
    CHECK(di_json_get_str(j, "a") == NULL);
    json_decref(j);
    json_t *out = NULL;
    CHECK(di_json_load_file("/nonexistent/x.json", &out) == DI_ERR_IO);
}

int main(void) {
    RUN(test_buf);
    RUN(test_sealed_image);
    RUN(test_split_range);
    RUN(test_pool);
    RUN(test_pool_sleep);
    RUN(test_json);
    return test_finish();
}
