// Tests for src/io/safetensors: write -> open round trips over every dtype and edge shapes, sharded
// directories with and without an index (and their mismatches), and a corpus of malformed images
// generated from a valid one, each of which must be refused with DI_ERR_FORMAT or DI_ERR_IO.
//
// Every image is parsed from an exactly-sized heap copy, so under ASan any read past its end fails.
// With DI_ST_WRITE_SEEDS=<dir> set, a handful of the images are also written to <dir>: that is how
// the fuzz seeds in fuzz/corpus/safetensors/ were made.
#include "harness.h"

#include <dirent.h>
#include <stdint.h>
#include <sys/stat.h>
#include <unistd.h>

#include "base/buf.h"
#include "base/log.h"
#include "base/mem.h"
#include "io/safetensors.h"

// ---- helpers ----

// Captures error messages so that tests can check they name the file and the tensor.
static char g_last_error[2048];
static int g_n_errors;

static void capture_sink(di_log_level level, const char *msg, void *user) {
    (void)user;
    if (level != DI_LOG_LEVEL_ERROR) return;
    g_n_errors++;
    snprintf(g_last_error, sizeof g_last_error, "%s", msg);
}

static void errors_reset(void) {
    g_last_error[0] = 0;
    g_n_errors = 0;
}

// Parses a heap copy of exactly n bytes (so ASan sees any over-read) and closes the result.
static di_status parse_exact(const void *bytes, size_t n, const char *what) {
    uint8_t *copy = malloc(n ? n : 1);
    if (n) memcpy(copy, bytes, n);
    di_st_file *f = NULL;
    di_status st = di_st_file_parse(copy, n, what, &f);
    if (st == DI_OK) {
        // Touch every tensor's first and last byte, as the fuzz target does.
        volatile uint8_t sink = 0;
        for (int64_t i = 0; i < di_st_file_n_tensors(f); i++) {
            const di_st_tensor *t = di_st_file_tensor(f, i);
            if (t->n_bytes)
                sink ^= ((const uint8_t *)t->data)[0] ^ ((const uint8_t *)t->data)[t->n_bytes - 1];
        }
        (void)sink;
        di_st_file_close(f);
    }
    free(copy);
    return st;
}

// An image from a header text and data bytes. header_len overrides the length field unless it is
// -1; INT64_MIN stands for 2^63.
static void make_image(di_buf *out, const char *header, const void *data, size_t n_data,
                       int64_t header_len) {
    size_t n_header = strlen(header);
    uint64_t n = header_len != -1 ? (uint64_t)header_len : (uint64_t)n_header;
    uint8_t le[8];
    for (int i = 0; i < 8; i++) le[i] = (uint8_t)(n >> (8 * i));
    di_buf_clear(out);
    di_buf_append(out, le, 8);
    di_buf_append(out, header, n_header);
    di_buf_append(out, data, n_data);
}

static const char *tmp_root(void) {
    static char dir[64];
    if (!dir[0]) {
        snprintf(dir, sizeof dir, "/tmp/di_test_st_XXXXXX");
        if (!mkdtemp(dir)) {
            perror("mkdtemp");
            exit(1);
        }
    }
    return dir;
}

// A fresh empty directory under the test's temp root.
static const char *tmp_subdir(const char *name, char *buf, size_t cap) {
    snprintf(buf, cap, "%s/%s", tmp_root(), name);
    mkdir(buf, 0700);
    return buf;
}

// Removes a flat directory (files only) and the directory itself.
static void rm_flat_dir(const char *dir) {
    DIR *d = opendir(dir);
    if (!d) return;
    struct dirent *de;
    char path[512];
    while ((de = readdir(d)) != NULL) {
        if (strcmp(de->d_name, ".") == 0 || strcmp(de->d_name, "..") == 0) continue;
        snprintf(path, sizeof path, "%s/%s", dir, de->d_name);
        unlink(path);
    }
    closedir(d);
    rmdir(dir);
}

static void write_text(const char *dir, const char *name, const char *text) {
    char path[512];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    FILE *fp = fopen(path, "wb");
    if (!fp) return;
    fputs(text, fp);
    fclose(fp);
}

static void write_bytes(const char *dir, const char *name, const void *b, size_t n) {
    char path[512];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    FILE *fp = fopen(path, "wb");
    if (!fp) return;
    fwrite(b, 1, n, fp);
    fclose(fp);
}

// Saves a fuzz seed when DI_ST_WRITE_SEEDS names a directory.
static void save_seed(const char *name, const void *b, size_t n) {
    const char *dir = getenv("DI_ST_WRITE_SEEDS");
    if (dir && *dir) write_bytes(dir, name, b, n);
}

static di_st_write_tensor wt(const char *name, di_dtype dtype, int n_dims, const int64_t *shape,
                             const void *data) {
    di_st_write_tensor t = {.name = name, .dtype = dtype, .n_dims = n_dims, .data = data};
    for (int d = 0; d < n_dims; d++) t.shape[d] = shape[d];
    return t;
}

// ---- round trip ----

static uint8_t g_pattern[4096];

static void fill_pattern(void) {
    for (size_t i = 0; i < sizeof g_pattern; i++) g_pattern[i] = (uint8_t)(i * 131 + 7);
}

enum { N_RT = 14 };

// Tensors covering every dtype, a 0-d scalar, zero-element tensors and the maximum rank.
static void rt_tensors(di_st_write_tensor *ts) {
    static const int64_t s23[] = {2, 3}, s5[] = {5}, s0[] = {0}, s403[] = {4, 0, 3};
    static const int64_t s8[] = {3, 1, 2, 1, 1, 1, 1, 2}, s22[] = {2, 2}, s7[] = {7};
    static const int64_t s31[] = {3, 1}, s16[] = {16};
    int i = 0;
    ts[i++] = wt("layers.0.attn.wq_a.weight", DI_DTYPE_F32, 2, s23, g_pattern);
    ts[i++] = wt("norm.weight", DI_DTYPE_BF16, 1, s5, g_pattern + 1);
    ts[i++] = wt("scalar", DI_DTYPE_I64, 0, NULL, g_pattern + 2); // shape []
    ts[i++] = wt("empty.u8", DI_DTYPE_U8, 1, s0, NULL);           // zero elements
    ts[i++] = wt("empty.f8", DI_DTYPE_F8_E4M3, 3, s403, NULL);    // zero elements, 3-d
    ts[i++] = wt("rank8", DI_DTYPE_I8, 8, s8, g_pattern + 3);
    ts[i++] = wt("f64", DI_DTYPE_F64, 2, s22, g_pattern + 4);
    ts[i++] = wt("f16", DI_DTYPE_F16, 1, s7, g_pattern + 5);
    ts[i++] = wt("layers.0.attn.wq_a.scale", DI_DTYPE_F8_E8M0, 2, s31, g_pattern + 6);
    ts[i++] = wt("e5m2", DI_DTYPE_F8_E5M2, 1, s16, g_pattern + 7);
    ts[i++] = wt("i16", DI_DTYPE_I16, 1, s5, g_pattern + 8);
    ts[i++] = wt("i32", DI_DTYPE_I32, 2, s23, g_pattern + 9);
    ts[i++] = wt("mask", DI_DTYPE_BOOL, 1, s7, g_pattern + 10);
    ts[i++] = wt("ünïcode/name.weight", DI_DTYPE_U8, 2, s22, g_pattern + 11);
}

static const char *const k_meta[] = {"format", "pt", "producer", "test_safetensors"};

static void check_same(const di_st_tensor *t, const di_st_write_tensor *w, int shard) {
    CHECK(t != NULL);
    if (!t) return;
    CHECK_STR_EQ(t->name, w->name);
    CHECK_EQ(t->dtype, w->dtype);
    CHECK_EQ(t->n_dims, w->n_dims);
    int64_t n = 1;
    for (int d = 0; d < w->n_dims; d++) {
        CHECK_EQ(t->shape[d], w->shape[d]);
        n *= w->shape[d];
    }
    CHECK_EQ(t->n_elements, n);
    CHECK_EQ(t->n_bytes, (size_t)n * di_dtype_size(w->dtype));
    CHECK_EQ(t->shard, shard);
    if (t->n_bytes) CHECK(memcmp(t->data, w->data, t->n_bytes) == 0);
}

static void test_round_trip(void) {
    di_st_write_tensor ts[N_RT];
    rt_tensors(ts);
    char dir[256], path[512];
    tmp_subdir("rt", dir, sizeof dir);
    snprintf(path, sizeof path, "%s/model.safetensors", dir);
    CHECK(di_st_write_file_meta(path, ts, N_RT, k_meta, 2) == DI_OK);

    di_st_file *f = NULL;
    CHECK(di_st_file_open(path, &f) == DI_OK);
    if (!f) return;
    CHECK_EQ(di_st_file_n_tensors(f), N_RT);
    for (int i = 0; i < N_RT; i++) {
        check_same(di_st_file_tensor(f, i), &ts[i], 0); // header order is kept
        CHECK(di_st_file_find(f, ts[i].name) == di_st_file_tensor(f, i));
    }
    CHECK(di_st_file_find(f, "absent") == NULL);
    CHECK(di_st_file_find(f, "") == NULL);
    CHECK(di_st_file_find(f, "__metadata__") == NULL);
    CHECK_STR_EQ(di_st_file_metadata(f, "format"), "pt");
    CHECK_STR_EQ(di_st_file_metadata(f, "producer"), "test_safetensors");
    CHECK(di_st_file_metadata(f, "absent") == NULL);
    const di_st_tensor *sc = di_st_file_find(f, "scalar");
    CHECK(sc && sc->n_dims == 0 && sc->n_elements == 1 && sc->n_bytes == 8);
    di_st_file_close(f);
    di_st_file_close(NULL);

    // The image itself: 8-byte length, padded header starting with '{', contiguous data.
    di_buf b;
    di_buf_init(&b);
    CHECK(di_st_write_buf(&b, ts, N_RT, k_meta, 2) == DI_OK);
    uint64_t n_header = 0;
    for (int i = 7; i >= 0; i--) n_header = (n_header << 8) | (uint8_t)b.data[i];
    CHECK_EQ(n_header % 8, 0);
    CHECK_EQ(b.data[8], '{');
    CHECK(b.data[8 + n_header - 1] == '}' || b.data[8 + n_header - 1] == ' ');
    size_t n_data = 0;
    for (int i = 0; i < N_RT; i++) {
        size_t n = di_dtype_size(ts[i].dtype);
        for (int d = 0; d < ts[i].n_dims; d++) n *= (size_t)ts[i].shape[d];
        n_data += n;
    }
    CHECK_EQ(b.len, 8 + n_header + n_data);
    CHECK(parse_exact(b.data, b.len, "rt-mem") == DI_OK);
    save_seed("valid_round_trip", b.data, b.len);

    // No tensors at all is a valid (empty) file.
    di_buf_clear(&b);
    CHECK(di_st_write_buf(&b, NULL, 0, NULL, 0) == DI_OK);
    CHECK(parse_exact(b.data, b.len, "empty") == DI_OK);
    di_buf_deinit(&b);
    rm_flat_dir(dir);
}

static void test_writer_rejects(void) {
    static const int64_t s2[] = {2}, sneg[] = {-1};
    di_st_write_tensor ts[2];
    di_buf b;
    di_buf_init(&b);
    ts[0] = wt("a", DI_DTYPE_F32, 1, s2, g_pattern);
    ts[1] = wt("a", DI_DTYPE_F32, 1, s2, g_pattern);
    CHECK(di_st_write_buf(&b, ts, 2, NULL, 0) == DI_ERR_INVALID); // duplicate
    ts[1].name = "";
    CHECK(di_st_write_buf(&b, ts, 2, NULL, 0) == DI_ERR_INVALID); // empty
    ts[1].name = "__metadata__";
    CHECK(di_st_write_buf(&b, ts, 2, NULL, 0) == DI_ERR_INVALID);
    ts[1] = wt("b", DI_DTYPE_F32, 1, sneg, g_pattern);
    CHECK(di_st_write_buf(&b, ts, 2, NULL, 0) == DI_ERR_INVALID); // negative dim
    ts[1] = wt("b", DI_DTYPE_COUNT, 1, s2, g_pattern);
    CHECK(di_st_write_buf(&b, ts, 2, NULL, 0) == DI_ERR_INVALID); // dtype
    ts[1] = wt("b", DI_DTYPE_F32, 1, s2, NULL);
    CHECK(di_st_write_buf(&b, ts, 2, NULL, 0) == DI_ERR_INVALID); // no data
    ts[1] = wt("b", DI_DTYPE_F32, 1, s2, g_pattern);
    ts[1].n_dims = DI_ST_MAX_DIMS + 1;
    CHECK(di_st_write_buf(&b, ts, 2, NULL, 0) == DI_ERR_INVALID); // rank
    ts[1] = wt("b\xff", DI_DTYPE_F32, 1, s2, g_pattern);
    CHECK(di_st_write_buf(&b, ts, 2, NULL, 0) == DI_ERR_INVALID); // not UTF-8
    CHECK(di_st_write_file("/nonexistent-dir/x.safetensors", ts, 1) == DI_ERR_IO);
    di_buf_deinit(&b);
}

// ---- sharded directories ----

static di_status open_dir_status(const char *dir) {
    di_st_set *s = NULL;
    di_status st = di_st_set_open_dir(dir, &s);
    CHECK((st == DI_OK) == (s != NULL));
    di_st_set_close(s);
    return st;
}

#define SHARD1 "model-00001-of-00002.safetensors"
#define SHARD2 "model-00002-of-00002.safetensors"

// Writes shard 1 {a, b} and shard 2 {c} (plus extra_name into shard 2 when not NULL).
static void write_shards(const char *dir, const di_st_write_tensor *abc, const char *extra_name) {
    char path[512];
    snprintf(path, sizeof path, "%s/" SHARD1, dir);
    CHECK(di_st_write_file(path, abc, 2) == DI_OK);
    di_st_write_tensor s2[2] = {abc[2], abc[2]};
    s2[1].name = extra_name;
    snprintf(path, sizeof path, "%s/" SHARD2, dir);
    CHECK(di_st_write_file(path, s2, extra_name ? 2 : 1) == DI_OK);
}

static const char *k_index_ok =
    "{\"metadata\": {\"total_size\": 64}, \"weight_map\": {"
    "\"a\": \"" SHARD1 "\", \"c\": \"" SHARD2 "\", \"b\": \"" SHARD1 "\"}}";

static void test_sharded(void) {
    static const int64_t s23[] = {2, 3}, s4[] = {4}, s0[] = {0};
    di_st_write_tensor abc[3] = {
        wt("a", DI_DTYPE_F32, 2, s23, g_pattern),      // 24 bytes
        wt("b", DI_DTYPE_BF16, 1, s4, g_pattern + 50), // 8 bytes
        wt("c", DI_DTYPE_I64, 1, s4, g_pattern + 99),  // 32 bytes
    };
    char dir[256];
    tmp_subdir("sharded", dir, sizeof dir);
    write_shards(dir, abc, NULL);
    write_text(dir, "model.safetensors.index.json", k_index_ok);
    write_text(dir, "README.md", "not a shard");

    di_st_set *s = NULL;
    CHECK(di_st_set_open_dir(dir, &s) == DI_OK);
    if (s) {
        CHECK_EQ(di_st_set_n_tensors(s), 3);
        check_same(di_st_set_find(s, "a"), &abc[0], 0);
        check_same(di_st_set_find(s, "b"), &abc[1], 0);
        check_same(di_st_set_find(s, "c"), &abc[2], 1);
        CHECK(di_st_set_find(s, "d") == NULL);
        CHECK_EQ(di_st_set_data_bytes(s), 24 + 8 + 32);
        for (int64_t i = 0; i < di_st_set_n_tensors(s); i++) {
            const di_st_tensor *t = di_st_set_tensor(s, i);
            CHECK(di_st_set_find(s, t->name) == t);
        }
        CHECK_STR_EQ(di_st_set_tensor(s, 2)->name, "c");
        di_st_set_close(s);
    }
    di_st_set_close(NULL);

    // Index mismatches.
    errors_reset();
    write_text(dir, "model.safetensors.index.json",
               "{\"weight_map\": {\"a\": \"" SHARD1 "\", \"b\": \"" SHARD1 "\", \"c\": \"" SHARD2
               "\", \"d\": \"" SHARD2 "\"}}");
    CHECK_EQ(open_dir_status(dir), DI_ERR_FORMAT); // d listed but missing from its shard
    CHECK(strstr(g_last_error, "\"d\"") && strstr(g_last_error, SHARD2));

    errors_reset();
    write_text(dir, "model.safetensors.index.json",
               "{\"weight_map\": {\"a\": \"" SHARD1 "\", \"c\": \"" SHARD2 "\"}}");
    CHECK_EQ(open_dir_status(dir), DI_ERR_FORMAT); // b in shard 1 but not in the index
    CHECK(strstr(g_last_error, "\"b\"") && strstr(g_last_error, SHARD1));

    errors_reset();
    write_text(dir, "model.safetensors.index.json",
               "{\"weight_map\": {\"a\": \"" SHARD1 "\", \"b\": \"" SHARD2 "\", \"c\": \"" SHARD2
               "\"}}");
    CHECK_EQ(open_dir_status(dir), DI_ERR_FORMAT); // b mapped to the wrong shard
    CHECK(strstr(g_last_error, "\"b\"") != NULL);

    di_status st;
    write_text(dir, "model.safetensors.index.json",
               "{\"weight_map\": {\"a\": \"" SHARD1 "\", \"b\": \"" SHARD1 "\", \"c\": \"" SHARD2
               "\", \"x\": \"model-00003-of-00002.safetensors\"}}");
    st = open_dir_status(dir); // a missing shard
    CHECK(st == DI_ERR_IO || st == DI_ERR_FORMAT);

    static const char *const bad_indexes[] = {
        "{\"weight_map\": {\"a\": \"../x.safetensors\"}}",
        "{\"weight_map\": {\"a\": \"sub/" SHARD1 "\"}}",
        "{\"weight_map\": {\"a\": \"/etc/passwd\"}}",
        "{\"weight_map\": {\"a\": \"..\"}}",
        "{\"weight_map\": {\"a\": \"\"}}",
        "{\"weight_map\": {\"a\": 3}}",
        "{\"weight_map\": {}}",
        "{\"weight_map\": []}",
        "{\"metadata\": {}}",
        "[]",
        "not json",
        "{\"weight_map\": {\"a\": \"" SHARD1 "\", \"a\": \"" SHARD1 "\"}}",
    };
    for (size_t i = 0; i < sizeof bad_indexes / sizeof *bad_indexes; i++) {
        write_text(dir, "model.safetensors.index.json", bad_indexes[i]);
        st = open_dir_status(dir);
        CHECK(st == DI_ERR_FORMAT || st == DI_ERR_IO);
        if (st == DI_OK) fprintf(stderr, "  accepted bad index %zu: %s\n", i, bad_indexes[i]);
    }

    // An extra tensor in shard 2 that the (correct otherwise) index does not list.
    write_shards(dir, abc, "extra");
    write_text(dir, "model.safetensors.index.json", k_index_ok);
    errors_reset();
    CHECK_EQ(open_dir_status(dir), DI_ERR_FORMAT);
    CHECK(strstr(g_last_error, "\"extra\"") != NULL);

    // A malformed shard behind a good index.
    write_shards(dir, abc, NULL);
    char shard2[512];
    snprintf(shard2, sizeof shard2, "%s/" SHARD2, dir);
    CHECK(truncate(shard2, 20) == 0);
    CHECK_EQ(open_dir_status(dir), DI_ERR_FORMAT);

    // No index: every *.safetensors file, in name order.
    char idx[512];
    snprintf(idx, sizeof idx, "%s/model.safetensors.index.json", dir);
    unlink(idx);
    write_shards(dir, abc, NULL);
    CHECK(di_st_set_open_dir(dir, &s) == DI_OK);
    if (s) {
        CHECK_EQ(di_st_set_n_tensors(s), 3);
        CHECK_STR_EQ(di_st_set_tensor(s, 0)->name, "a");
        CHECK_EQ(di_st_set_find(s, "c")->shard, 1);
        di_st_set_close(s);
    }
    // A hidden file is ignored; a zero-element tensor in a third shard is fine.
    write_text(dir, ".hidden.safetensors", "garbage");
    di_st_write_tensor z = wt("z", DI_DTYPE_U8, 1, s0, NULL);
    char p3[512];
    snprintf(p3, sizeof p3, "%s/zz.safetensors", dir);
    CHECK(di_st_write_file(p3, &z, 1) == DI_OK);
    CHECK(di_st_set_open_dir(dir, &s) == DI_OK);
    if (s) {
        CHECK_EQ(di_st_set_n_tensors(s), 4);
        CHECK_EQ(di_st_set_find(s, "z")->shard, 2);
        CHECK_EQ(di_st_set_data_bytes(s), 64);
        di_st_set_close(s);
    }
    // The same name in two shards.
    write_shards(dir, abc, "a");
    errors_reset();
    CHECK_EQ(open_dir_status(dir), DI_ERR_FORMAT);
    CHECK(strstr(g_last_error, "\"a\"") && strstr(g_last_error, SHARD1) &&
          strstr(g_last_error, SHARD2));
    rm_flat_dir(dir);

    // Nothing to open.
    tmp_subdir("empty", dir, sizeof dir);
    errors_reset();
    CHECK_EQ(open_dir_status(dir), DI_ERR_IO);
    CHECK(strstr(g_last_error, "safetensors") != NULL);
    rm_flat_dir(dir);
    CHECK_EQ(open_dir_status("/nonexistent/di_test_dir"), DI_ERR_IO);
    di_st_file *f = NULL;
    CHECK_EQ(di_st_file_open("/nonexistent/x.safetensors", &f), DI_ERR_IO);
}

// ---- malformed images ----

// The valid base image: metadata, a: F32 [2, 2] at [0, 16), b: BF16 [3] at [16, 22).
#define ENTRY_A "\"a\":{\"dtype\":\"F32\",\"shape\":[2,2],\"data_offsets\":[0,16]}"
#define ENTRY_B "\"b\":{\"dtype\":\"BF16\",\"shape\":[3],\"data_offsets\":[16,22]}"
#define META "\"__metadata__\":{\"format\":\"pt\"}"
#define BASE_HEADER "{" META "," ENTRY_A "," ENTRY_B "}"
enum { BASE_DATA = 22 };

typedef struct bad_case {
    const char *name;   // also the `what` passed to the parser
    const char *header; // NULL: use the base header
    int64_t header_len; // -1: the header's length
    int64_t n_data;     // -1: BASE_DATA
    const char *tensor; // the tensor the error must name, or NULL
    bool seed;          // also save it as a fuzz seed
} bad_case;

static const bad_case k_bad[] = {
    {"header_len_past_end", NULL, 1000, -1, NULL, false},
    {"header_len_past_end_by_one", NULL, (int64_t)(sizeof(BASE_HEADER) - 1 + BASE_DATA + 1), -1,
     NULL, false},
    {"header_len_huge", NULL, INT64_MIN, -1, NULL, true}, // INT64_MIN: 2^63 in the field
    {"header_len_zero", NULL, 0, -1, NULL, false},
    {"not_json", "this is not json", -1, -1, NULL, true},
    {"json_array", "[1,2,3]", -1, -1, NULL, true},
    {"json_string", "\"a\"", -1, -1, NULL, false},
    {"trailing_garbage", BASE_HEADER " x", -1, -1, NULL, false},
    {"nul_padding", BASE_HEADER "\0\0", -1, -1, NULL, false}, // strlen stops at NUL: see below
    {"unknown_dtype", "{\"a\":{\"dtype\":\"F33\",\"shape\":[2,2],\"data_offsets\":[0,16]}}", -1, -1,
     "a", true},
    {"dtype_not_string", "{\"a\":{\"dtype\":4,\"shape\":[2,2],\"data_offsets\":[0,16]}}", -1, -1,
     "a", false},
    {"missing_dtype", "{\"a\":{\"shape\":[2,2],\"data_offsets\":[0,16]}}", -1, -1, "a", false},
    {"unknown_field", "{\"a\":{\"dtype\":\"F32\",\"shape\":[2,2],\"data_offsets\":[0,16],\"x\":1}}",
     -1, -1, "a", false},
    {"entry_not_object", "{\"a\":[1,2]}", -1, -1, "a", false},
    {"negative_dim", "{\"a\":{\"dtype\":\"F32\",\"shape\":[-2,-2],\"data_offsets\":[0,16]}}", -1,
     -1, "a", true},
    {"shape_not_array", "{\"a\":{\"dtype\":\"F32\",\"shape\":4,\"data_offsets\":[0,16]}}", -1, -1,
     "a", false},
    {"shape_real", "{\"a\":{\"dtype\":\"F32\",\"shape\":[2.0,2],\"data_offsets\":[0,16]}}", -1, -1,
     "a", false},
    {"shape_huge_int",
     "{\"a\":{\"dtype\":\"F32\",\"shape\":[99999999999999999999],\"data_offsets\":[0,16]}}", -1, -1,
     NULL, false},
    {"shape_bytes_mismatch", "{\"a\":{\"dtype\":\"F32\",\"shape\":[2,3],\"data_offsets\":[0,16]}}",
     -1, -1, "a", true},
    {"begin_gt_end", "{\"a\":{\"dtype\":\"F32\",\"shape\":[2,2],\"data_offsets\":[16,0]}}", -1, -1,
     "a", false},
    {"end_past_data", "{\"a\":{\"dtype\":\"F32\",\"shape\":[2,3],\"data_offsets\":[0,24]}}", -1, -1,
     "a", true},
    {"offsets_negative", "{\"a\":{\"dtype\":\"F32\",\"shape\":[2,2],\"data_offsets\":[-16,0]}}", -1,
     -1, "a", false},
    {"offsets_strings", "{\"a\":{\"dtype\":\"F32\",\"shape\":[2,2],\"data_offsets\":[\"0\",16]}}",
     -1, -1, "a", false},
    {"offsets_reals", "{\"a\":{\"dtype\":\"F32\",\"shape\":[2,2],\"data_offsets\":[0.0,16.0]}}", -1,
     -1, "a", false},
    {"offsets_one", "{\"a\":{\"dtype\":\"F32\",\"shape\":[0],\"data_offsets\":[0]}}", -1, -1, "a",
     false},
    {"offsets_three", "{\"a\":{\"dtype\":\"F32\",\"shape\":[2,2],\"data_offsets\":[0,16,16]}}", -1,
     -1, "a", false},
    {"missing_offsets", "{\"a\":{\"dtype\":\"F32\",\"shape\":[2,2]}}", -1, -1, "a", false},
    {"overlap", "{" ENTRY_A ",\"b\":{\"dtype\":\"BF16\",\"shape\":[3],\"data_offsets\":[10,16]}}",
     -1, -1, "b", true},
    {"overlap_same_range",
     "{" ENTRY_A ",\"c\":{\"dtype\":\"I32\",\"shape\":[4],\"data_offsets\":[0,16]}}", -1, -1, NULL,
     false},
    {"duplicate_key", "{" ENTRY_A "," ENTRY_A "}", -1, -1, NULL, true},
    {"too_many_dims",
     "{\"a\":{\"dtype\":\"F32\",\"shape\":[1,1,1,1,1,1,1,1,4],\"data_offsets\":[0,16]}}", -1, -1,
     "a", false},
    {"n_elements_overflow",
     "{\"a\":{\"dtype\":\"F32\",\"shape\":[1099511627776,1099511627776,1099511627776],"
     "\"data_offsets\":[0,16]}}",
     -1, -1, "a", true},
    {"overflow_then_zero",
     "{\"a\":{\"dtype\":\"F32\",\"shape\":[4294967296,4294967296,0],\"data_offsets\":[0,0]}}", -1,
     -1, "a", false},
    {"bytes_overflow",
     "{\"a\":{\"dtype\":\"F64\",\"shape\":[4611686018427387904],\"data_offsets\":[0,0]}}", -1, -1,
     "a", false},
    {"metadata_not_strings", "{\"__metadata__\":{\"format\":1}," ENTRY_A "}", -1, -1, NULL, true},
    {"metadata_not_object", "{\"__metadata__\":\"pt\"," ENTRY_A "}", -1, -1, NULL, false},
    {"empty_name", "{\"\":{\"dtype\":\"F32\",\"shape\":[2,2],\"data_offsets\":[0,16]}}", -1, -1,
     NULL, true},
    {"nul_in_name", "{\"a\\u0000b\":{\"dtype\":\"F32\",\"shape\":[2,2],\"data_offsets\":[0,16]}}",
     -1, -1, NULL, false},
    {"bad_utf8", "{\"a\xff\":{\"dtype\":\"F32\",\"shape\":[2,2],\"data_offsets\":[0,16]}}", -1, -1,
     NULL, false},
    {"unterminated", "{\"a\":{\"dtype\":\"F32\",\"shape\":[2,2],\"data_offsets\":[0,16]}", -1, -1,
     NULL, false},
};

static void check_refused(const char *what, di_status st, const char *tensor) {
    CHECK(st == DI_ERR_FORMAT || st == DI_ERR_IO);
    if (st == DI_OK) fprintf(stderr, "  accepted malformed image \"%s\"\n", what);
    if (st != DI_OK) {
        if (getenv("DI_TEST_VERBOSE")) fprintf(stderr, "  %-28s -> %s\n", what, g_last_error);
        CHECK(g_n_errors > 0);
        CHECK(strstr(g_last_error, what) != NULL);
        if (tensor) {
            char quoted[64];
            snprintf(quoted, sizeof quoted, "\"%s\"", tensor);
            CHECK(strstr(g_last_error, quoted) != NULL);
        }
    }
}

static void test_bad_corpus(void) {
    uint8_t data[64];
    memcpy(data, g_pattern, sizeof data);
    di_buf img;
    di_buf_init(&img);

    // The base image is valid ...
    make_image(&img, BASE_HEADER, data, BASE_DATA, -1);
    CHECK(parse_exact(img.data, img.len, "base") == DI_OK);
    save_seed("valid_base", img.data, img.len);
    // ... and every strict prefix of it is refused.
    int n_truncated_ok = 0;
    for (size_t n = 0; n < img.len; n++) {
        errors_reset();
        di_status st = parse_exact(img.data, n, "truncated");
        if (st == DI_OK) n_truncated_ok++;
        check_refused("truncated", st, NULL);
    }
    CHECK_EQ(n_truncated_ok, 0);
    // Likewise for the bigger round-trip image (more dtypes, a scalar, empty tensors).
    di_st_write_tensor ts[N_RT];
    rt_tensors(ts);
    di_buf rt;
    di_buf_init(&rt);
    CHECK(di_st_write_buf(&rt, ts, N_RT, k_meta, 2) == DI_OK);
    n_truncated_ok = 0;
    for (size_t n = 0; n < rt.len; n++) {
        errors_reset();
        di_status st = parse_exact(rt.data, n, "truncated_rt");
        if (st == DI_OK) n_truncated_ok++;
        check_refused("truncated_rt", st, NULL);
    }
    CHECK_EQ(n_truncated_ok, 0);
    save_seed("bad_truncated", rt.data, rt.len / 2);
    di_buf_deinit(&rt);

    for (size_t i = 0; i < sizeof k_bad / sizeof *k_bad; i++) {
        const bad_case *c = &k_bad[i];
        const char *h = c->header ? c->header : BASE_HEADER;
        size_t n_data = c->n_data >= 0 ? (size_t)c->n_data : BASE_DATA;
        make_image(&img, h, data, n_data, c->header_len);
        if (strcmp(c->name, "nul_padding") == 0) {
            // Rebuild with two NUL bytes inside the header region instead of spaces.
            size_t nh = strlen(BASE_HEADER) + 2;
            char hdr[sizeof(BASE_HEADER) + 2];
            memcpy(hdr, BASE_HEADER, nh - 2);
            hdr[nh - 2] = hdr[nh - 1] = 0;
            uint8_t le[8];
            for (int k = 0; k < 8; k++) le[k] = (uint8_t)((uint64_t)nh >> (8 * k));
            di_buf_clear(&img);
            di_buf_append(&img, le, 8);
            di_buf_append(&img, hdr, nh);
            di_buf_append(&img, data, n_data);
        }
        errors_reset();
        check_refused(c->name, parse_exact(img.data, img.len, c->name), c->tensor);
        if (c->seed) {
            char seed[96];
            snprintf(seed, sizeof seed, "bad_%s", c->name);
            save_seed(seed, img.data, img.len);
        }
    }

    // Nesting far deeper than any header: jansson's depth limit must stop it without a crash.
    {
        enum { DEPTH = 100000 };
        char *deep = malloc(2 * DEPTH + 1);
        memset(deep, '[', DEPTH);
        memset(deep + DEPTH, ']', DEPTH);
        deep[2 * DEPTH] = 0;
        make_image(&img, deep, NULL, 0, -1);
        errors_reset();
        check_refused("deep", parse_exact(img.data, img.len, "deep"), NULL);
        free(deep);
    }

    // Accepted oddities: trailing bytes after the last tensor, gaps, an empty tensor inside
    // another's range, tensors listed out of offset order, space padding.
    static const char *const k_good[] = {
        "{\"b\":{\"dtype\":\"BF16\",\"shape\":[3],\"data_offsets\":[16,22]}," ENTRY_A "}",
        "{" ENTRY_A ",\"e\":{\"dtype\":\"U8\",\"shape\":[0],\"data_offsets\":[8,8]}}",
        "{\"b\":{\"dtype\":\"BF16\",\"shape\":[3],\"data_offsets\":[16,22]}}",
        "{\"e\":{\"dtype\":\"U8\",\"shape\":[2,0],\"data_offsets\":[22,22]}}",
        "{}",
        BASE_HEADER "        ",
    };
    for (size_t i = 0; i < sizeof k_good / sizeof *k_good; i++) {
        make_image(&img, k_good[i], data, BASE_DATA, -1);
        di_status st = parse_exact(img.data, img.len, "good");
        CHECK_EQ(st, DI_OK);
        if (st != DI_OK) fprintf(stderr, "  refused valid image %zu: %s\n", i, k_good[i]);
    }
    di_buf_deinit(&img);
}

int main(void) {
    fill_pattern();
    di_log_set_sink(capture_sink, NULL);
    RUN(test_round_trip);
    RUN(test_writer_rejects);
    RUN(test_sharded);
    RUN(test_bad_corpus);
    di_log_set_sink(NULL, NULL);
    rmdir(tmp_root());
    return test_finish();
}
