// Tests for src/io/gguf: write -> parse round trips (metadata of every value type, tensors of every
// supported ggml type, fill callbacks, files), typed metadata access, and malformed images made
// from a valid one — every truncation, bad magic/version/counts, unknown value and tensor types,
// nested arrays, bad booleans, duplicate keys and names, bad dims, ne[0] off the block, bad
// alignment, misaligned, out-of-range and overlapping offsets — each refused with DI_ERR_FORMAT and
// a message naming the file.
//
// Every image is parsed from an exactly-sized heap copy, so under ASan any read past its end fails.
// With DI_GGUF_WRITE_SEEDS=<dir> set, the valid images are also written to <dir>: that is how the
// fuzz seeds in fuzz/corpus/gguf/ were made.
#include "harness.h"

#include <stdint.h>
#include <unistd.h>

#include "base/buf.h"
#include "base/log.h"
#include "base/mem.h"
#include "io/gguf.h"

// ---- helpers ----

static char g_last_error[2048];
static int g_n_errors;

static void capture_sink(di_log_level level, const char *msg, void *user) {
    (void)user;
    if (level != DI_LOG_LEVEL_ERROR) return;
    g_n_errors++;
    snprintf(g_last_error, sizeof g_last_error, "%s", msg);
}

static di_status parse_exact(const void *bytes, size_t n, const char *what) {
    uint8_t *copy = malloc(n ? n : 1);
    if (n) memcpy(copy, bytes, n);
    di_gguf_file *f = NULL;
    g_last_error[0] = 0;
    di_status st = di_gguf_parse(copy, n, what, &f);
    if (st == DI_OK) {
        volatile uint8_t sink = 0;
        for (int64_t i = 0; i < di_gguf_n_tensors(f); i++) {
            const di_gguf_tensor *t = di_gguf_tensor_at(f, i);
            if (t->n_bytes)
                sink ^= ((const uint8_t *)t->data)[0] ^ ((const uint8_t *)t->data)[t->n_bytes - 1];
        }
        (void)sink;
        di_gguf_close(f);
    }
    free(copy);
    return st;
}

static void write_seed(const di_buf *b, const char *name) {
    const char *dir = getenv("DI_GGUF_WRITE_SEEDS");
    if (!dir) return;
    char path[512];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    FILE *fp = fopen(path, "wb");
    if (fp) {
        fwrite(b->data, 1, b->len, fp);
        fclose(fp);
    }
}

// A small valid image: metadata of several types, three tensors (f32, q8_0, q4_K).
static float g_f32[12];
static uint8_t g_q8[2 * 34], g_q4k[144];

static void build_valid(di_buf *out) {
    di_gguf_writer *w = NULL;
    CHECK(di_gguf_writer_create(&w) == DI_OK);
    CHECK(di_gguf_writer_add_str(w, "general.architecture", "deepseek4") == DI_OK);
    CHECK(di_gguf_writer_add_u32(w, "deepseek4.block_count", 4) == DI_OK);
    CHECK(di_gguf_writer_add_f32(w, "deepseek4.rope.freq_base", 10000.0f) == DI_OK);
    CHECK(di_gguf_writer_add_bool(w, "deepseek4.expert_weights_norm", true) == DI_OK);
    int32_t ratios[4] = {0, 4, 128, 4};
    CHECK(di_gguf_writer_add_arr(w, "deepseek4.attention.compress_ratios", DI_GGUF_VTYPE_INT32,
                                 ratios, 4) == DI_OK);
    const char *toks[3] = {"a", "bc", ""};
    CHECK(di_gguf_writer_add_arr_str(w, "tokenizer.ggml.tokens", toks, 3) == DI_OK);
    for (int i = 0; i < 12; i++) g_f32[i] = (float)i - 3.5f;
    for (size_t i = 0; i < sizeof g_q8; i++) g_q8[i] = (uint8_t)(i * 7);
    for (size_t i = 0; i < sizeof g_q4k; i++) g_q4k[i] = (uint8_t)(i * 13);
    int64_t ne_a[2] = {4, 3}, ne_b[1] = {64}, ne_c[2] = {256, 1};
    CHECK(di_gguf_writer_add_tensor(w, "a.weight", DI_GGML_TYPE_F32, 2, ne_a, g_f32) == DI_OK);
    CHECK(di_gguf_writer_add_tensor(w, "b.weight", DI_GGML_TYPE_Q8_0, 1, ne_b, g_q8) == DI_OK);
    CHECK(di_gguf_writer_add_tensor(w, "c.weight", DI_GGML_TYPE_Q4_K, 2, ne_c, g_q4k) == DI_OK);
    CHECK(di_gguf_writer_write_buf(w, out, NULL, NULL) == DI_OK);
    di_gguf_writer_destroy(w);
}

// Offsets inside the valid image (found by scanning for the names).
static size_t find(const di_buf *b, const char *s) {
    size_t n = strlen(s);
    for (size_t i = 0; i + n <= b->len; i++)
        if (memcmp(b->data + i, s, n) == 0) return i;
    return (size_t)-1;
}

static void put32(di_buf *b, size_t at, uint32_t v) {
    memcpy(b->data + at, &v, 4);
}
static void put64(di_buf *b, size_t at, uint64_t v) {
    memcpy(b->data + at, &v, 8);
}

// ---- round trips ----

static void test_round_trip(void) {
    di_buf b;
    di_buf_init(&b);
    build_valid(&b);
    write_seed(&b, "valid.gguf");
    di_gguf_file *f = NULL;
    CHECK(di_gguf_parse((const uint8_t *)b.data, b.len, "valid", &f) == DI_OK);
    CHECK_EQ(di_gguf_version(f), 3u);
    CHECK_EQ(di_gguf_alignment(f), 32u);
    CHECK_EQ(di_gguf_n_kv(f), 6);
    CHECK_EQ(di_gguf_n_tensors(f), 3);
    const char *s;
    size_t len;
    CHECK(di_gguf_get_str(f, "general.architecture", &s, &len));
    CHECK(len == 9 && memcmp(s, "deepseek4", 9) == 0);
    int64_t v;
    CHECK(di_gguf_get_int(f, "deepseek4.block_count", &v) && v == 4);
    CHECK(di_gguf_get_int(f, "deepseek4.expert_weights_norm", &v) && v == 1);
    double d;
    CHECK(di_gguf_get_num(f, "deepseek4.rope.freq_base", &d) && d == 10000.0);
    CHECK(di_gguf_get_num(f, "deepseek4.block_count", &d) && d == 4.0);
    CHECK(!di_gguf_get_int(f, "deepseek4.rope.freq_base", &v)); // a float is not an integer
    CHECK(!di_gguf_get_str(f, "deepseek4.block_count", &s, &len));
    CHECK(!di_gguf_get_int(f, "missing", &v));
    int64_t arr[8], n;
    CHECK(di_gguf_get_int_arr(f, "deepseek4.attention.compress_ratios", arr, 8, &n));
    CHECK(n == 4 && arr[0] == 0 && arr[1] == 4 && arr[2] == 128 && arr[3] == 4);
    CHECK(di_gguf_get_int_arr(f, "deepseek4.block_count", arr, 3, &n)); // scalar: broadcast
    CHECK(n == -1 && arr[0] == 4 && arr[2] == 4);
    CHECK(!di_gguf_get_int_arr(f, "tokenizer.ggml.tokens", arr, 8, &n));
    const di_gguf_kv *kv = di_gguf_find_kv(f, "tokenizer.ggml.tokens");
    CHECK(kv && kv->type == DI_GGUF_VTYPE_ARRAY && kv->arr_type == DI_GGUF_VTYPE_STRING &&
          kv->n == 3);
    const di_gguf_tensor *a = di_gguf_find_tensor(f, "a.weight");
    CHECK(a && a->type == DI_GGML_TYPE_F32 && a->n_dims == 2 && a->ne[0] == 4 && a->ne[1] == 3);
    CHECK(a && a->n_bytes == 48 && memcmp(a->data, g_f32, 48) == 0);
    const di_gguf_tensor *q = di_gguf_find_tensor(f, "b.weight");
    CHECK(q && q->n_bytes == sizeof g_q8 && memcmp(q->data, g_q8, sizeof g_q8) == 0);
    const di_gguf_tensor *c = di_gguf_find_tensor(f, "c.weight");
    CHECK(c && c->n_bytes == 144 && memcmp(c->data, g_q4k, 144) == 0);
    CHECK(c && ((uintptr_t)c->data - (uintptr_t)b.data) % 32 == 0);
    CHECK(di_gguf_data_bytes(f) == 48 + sizeof g_q8 + 144);
    CHECK(di_gguf_find_tensor(f, "nope") == NULL);
    di_gguf_close(f);
    di_buf_deinit(&b);
}

static di_status fill_ramp(void *user, int64_t i, uint8_t *dst, size_t n) {
    (void)user;
    for (size_t k = 0; k < n; k++) dst[k] = (uint8_t)(k + (size_t)i);
    return DI_OK;
}

// Every supported ggml type, tensors produced by the fill callback, and a file on disk.
static void test_types_and_file(void) {
    static const uint32_t types[] = {DI_GGML_TYPE_F32,     DI_GGML_TYPE_F16,  DI_GGML_TYPE_BF16,
                                     DI_GGML_TYPE_Q8_0,    DI_GGML_TYPE_Q2_K, DI_GGML_TYPE_Q4_K,
                                     DI_GGML_TYPE_I8,      DI_GGML_TYPE_I16,  DI_GGML_TYPE_I32,
                                     DI_GGML_TYPE_IQ2_XXS, DI_GGML_TYPE_I64,  DI_GGML_TYPE_F64,
                                     DI_GGML_TYPE_MXFP4};
    di_gguf_writer *w = NULL;
    CHECK(di_gguf_writer_create(&w) == DI_OK);
    CHECK(di_gguf_writer_add_u32(w, "general.alignment", 32) == DI_OK);
    for (size_t i = 0; i < sizeof types / sizeof types[0]; i++) {
        char name[32];
        snprintf(name, sizeof name, "t%zu.%s", i, di_ggml_type_name(types[i]));
        int64_t ne[3] = {256, 3, 2};
        CHECK(di_gguf_writer_add_tensor(w, name, types[i], 3, ne, NULL) == DI_OK);
    }
    int64_t bad_ne[1] = {100};
    CHECK(di_gguf_writer_add_tensor(w, "x", DI_GGML_TYPE_Q4_K, 1, bad_ne, NULL) == DI_ERR_INVALID);
    CHECK(di_gguf_writer_add_tensor(w, "x", 2 /* Q4_0 */, 1, bad_ne, NULL) == DI_ERR_INVALID);
    CHECK(di_gguf_writer_add_tensor(w, "t0.f32", DI_GGML_TYPE_F32, 1, bad_ne, NULL) ==
          DI_ERR_INVALID);
    char path[] = "/tmp/test_gguf_XXXXXX";
    int fd = mkstemp(path);
    CHECK(fd >= 0);
    close(fd);
    CHECK(di_gguf_writer_write_file(w, path, fill_ramp, NULL) == DI_OK);
    di_gguf_writer_destroy(w);
    di_gguf_file *f = NULL;
    CHECK(di_gguf_open(path, &f) == DI_OK);
    CHECK_EQ(di_gguf_n_tensors(f), (int64_t)(sizeof types / sizeof types[0]));
    for (int64_t i = 0; f && i < di_gguf_n_tensors(f); i++) {
        const di_gguf_tensor *t = di_gguf_tensor_at(f, i);
        int64_t blck;
        size_t bb;
        CHECK(di_ggml_type_info(t->type, &blck, &bb));
        CHECK(t->n_bytes == (size_t)(256 * 6 / blck) * bb);
        CHECK(t->n_elements == 256 * 6 && t->ne[2] == 2 && t->ne[3] == 1);
        bool ok = true;
        for (size_t k = 0; k < t->n_bytes; k++)
            ok &= ((const uint8_t *)t->data)[k] == (uint8_t)(k + (size_t)i);
        CHECK(ok);
    }
    di_gguf_close(f);
    unlink(path);
    CHECK(di_gguf_open("/nonexistent/x.gguf", &f) == DI_ERR_IO);
}

// ---- malformed images ----

static void expect_format(const di_buf *b, const char *what, const char *msg_part) {
    di_status st = parse_exact(b->data, b->len, what);
    if (st != DI_ERR_FORMAT) fprintf(stderr, "  %s: got %d\n", what, st);
    CHECK_EQ(st, DI_ERR_FORMAT);
    if (msg_part && !strstr(g_last_error, msg_part))
        fprintf(stderr, "  %s: message \"%s\" lacks \"%s\"\n", what, g_last_error, msg_part);
    CHECK(!msg_part || strstr(g_last_error, msg_part));
    CHECK(strstr(g_last_error, what) != NULL);
}

static void copy_buf(di_buf *dst, const di_buf *src) {
    di_buf_clear(dst);
    di_buf_append(dst, src->data, src->len);
}

static void test_truncations(void) {
    di_buf b, t;
    di_buf_init(&b);
    di_buf_init(&t);
    build_valid(&b);
    // Every prefix shorter than the end of the last tensor's data is refused.
    const size_t end = b.len - (144 % 32 ? 32 - 144 % 32 : 0);
    int n_bad = 0;
    for (size_t n = 0; n < end; n++) {
        di_status st = parse_exact(b.data, n, "prefix");
        n_bad += st != DI_ERR_FORMAT;
    }
    CHECK_EQ(n_bad, 0);
    CHECK(parse_exact(b.data, end, "exact end") == DI_OK);
    CHECK(parse_exact(b.data, b.len, "padded end") == DI_OK);
    di_buf_deinit(&b);
    di_buf_deinit(&t);
}

static void test_malformed(void) {
    di_buf v, b;
    di_buf_init(&v);
    di_buf_init(&b);
    build_valid(&v);
    const size_t k_arch = find(&v, "general.architecture") - 8; // key length field
    const size_t k_bool = find(&v, "deepseek4.expert_weights_norm") + 29;
    const size_t k_ratios = find(&v, "deepseek4.attention.compress_ratios") + 35;
    const size_t t_a = find(&v, "a.weight") + 8; // after the name: n_dims
    const size_t t_b = find(&v, "b.weight") + 8; // n_dims, ne[0], type, offset
    const size_t t_c = find(&v, "c.weight") + 8; // n_dims, ne[0], ne[1], type, offset
    const size_t toks = find(&v, "tokenizer.ggml.tokens") + 21; // value type

    copy_buf(&b, &v);
    memcpy(b.data, "GGUG", 4);
    expect_format(&b, "bad magic", "magic");
    copy_buf(&b, &v);
    put32(&b, 4, 1);
    expect_format(&b, "version 1", "version 1");
    copy_buf(&b, &v);
    put32(&b, 4, 4);
    expect_format(&b, "version 4", "version");
    copy_buf(&b, &v);
    put64(&b, 8, (uint64_t)1 << 60);
    expect_format(&b, "huge tensor count", "tensor count");
    copy_buf(&b, &v);
    put64(&b, 16, (uint64_t)1 << 60);
    expect_format(&b, "huge kv count", "metadata count");
    copy_buf(&b, &v);
    put64(&b, 8, 4); // one more tensor than there is
    expect_format(&b, "tensor count too high", NULL);
    copy_buf(&b, &v);
    put64(&b, k_arch, (uint64_t)1 << 40);
    expect_format(&b, "key length past end", "truncated key");
    copy_buf(&b, &v);
    put64(&b, k_arch, 0);
    expect_format(&b, "empty key", NULL);
    copy_buf(&b, &v);
    b.data[k_arch + 8 + 3] = 0;
    expect_format(&b, "NUL in key", "NUL");
    copy_buf(&b, &v);
    put32(&b, k_arch + 8 + 20, 13);
    expect_format(&b, "unknown value type", "unknown value type");
    copy_buf(&b, &v);
    b.data[k_bool + 4] = 2;
    expect_format(&b, "bool 2", "invalid scalar");
    copy_buf(&b, &v);
    put32(&b, k_ratios + 4, DI_GGUF_VTYPE_ARRAY);
    expect_format(&b, "nested array", "nested");
    copy_buf(&b, &v);
    put32(&b, k_ratios + 4, 77);
    expect_format(&b, "bad element type", "element type");
    copy_buf(&b, &v);
    put64(&b, k_ratios + 8, (uint64_t)1 << 62);
    expect_format(&b, "array count past end", "array");
    copy_buf(&b, &v);
    put64(&b, toks + 4 + 4, (uint64_t)1 << 61);
    expect_format(&b, "string array count past end", "array");
    {
        di_gguf_writer *w = NULL;
        di_buf d;
        di_buf_init(&d);
        CHECK(di_gguf_writer_create(&w) == DI_OK);
        di_gguf_writer_add_u32(w, "k", 1);
        di_gguf_writer_add_u32(w, "k", 2);
        CHECK(di_gguf_writer_write_buf(w, &d, NULL, NULL) == DI_OK);
        expect_format(&d, "duplicate key", "duplicate metadata key");
        di_buf_clear(&d);
        di_gguf_writer_destroy(w);
        // general.alignment: wrong type, zero, not a power of two.
        CHECK(di_gguf_writer_create(&w) == DI_OK);
        di_gguf_writer_add_i32(w, "general.alignment", 64);
        CHECK(di_gguf_writer_write_buf(w, &d, NULL, NULL) == DI_OK);
        expect_format(&d, "alignment int32", "uint32");
        di_buf_clear(&d);
        di_gguf_writer_destroy(w);
        CHECK(di_gguf_writer_create(&w) == DI_OK);
        di_gguf_writer_add_u32(w, "general.alignment", 48);
        CHECK(di_gguf_writer_write_buf(w, &d, NULL, NULL) == DI_OK);
        expect_format(&d, "alignment 48", "power of two");
        di_buf_clear(&d);
        di_gguf_writer_destroy(w);
        CHECK(di_gguf_writer_create(&w) == DI_OK);
        di_gguf_writer_add_u32(w, "general.alignment", 0);
        CHECK(di_gguf_writer_write_buf(w, &d, NULL, NULL) == DI_OK);
        expect_format(&d, "alignment 0", "power of two");
        di_buf_deinit(&d);
        di_gguf_writer_destroy(w);
    }
    // Tensor infos.
    copy_buf(&b, &v);
    put32(&b, t_a, 0);
    expect_format(&b, "zero dims", "dims");
    copy_buf(&b, &v);
    put32(&b, t_a, 5);
    expect_format(&b, "five dims", "dims");
    copy_buf(&b, &v);
    put64(&b, t_a + 4, (uint64_t)1 << 62);
    put64(&b, t_a + 12, (uint64_t)1 << 62);
    expect_format(&b, "element overflow", "overflow");
    copy_buf(&b, &v);
    put64(&b, t_a + 4, UINT64_MAX);
    expect_format(&b, "ne above int64", "overflow");
    copy_buf(&b, &v);
    put32(&b, t_b + 12, 2); // Q4_0
    expect_format(&b, "removed/unsupported type", "unsupported ggml type 2");
    copy_buf(&b, &v);
    put32(&b, t_b + 12, 4); // a removed type number
    expect_format(&b, "type 4", "unsupported ggml type");
    copy_buf(&b, &v);
    put32(&b, t_b + 12, 1000);
    expect_format(&b, "type 1000", "unsupported ggml type");
    copy_buf(&b, &v);
    put64(&b, t_b + 4, 48); // not a multiple of 32
    expect_format(&b, "ne0 off block", "multiple");
    copy_buf(&b, &v);
    put64(&b, t_b + 16, 4); // misaligned offset
    expect_format(&b, "misaligned offset", "alignment");
    copy_buf(&b, &v);
    put64(&b, t_b + 16, 1u << 20);
    expect_format(&b, "offset past end", "beyond");
    copy_buf(&b, &v);
    put64(&b, t_c + 20 + 4, 64); // c starts where b does (b at 64: 68 bytes)
    expect_format(&b, "overlap", "overlap");
    copy_buf(&b, &v);
    put64(&b, t_c + 20 + 4, 0); // c over a
    expect_format(&b, "overlap a", "overlap");
    copy_buf(&b, &v);
    memcpy(b.data + t_c - 8, "b.weight", 8);
    expect_format(&b, "duplicate tensor", "duplicate tensor name");
    copy_buf(&b, &v);
    put64(&b, t_a - 16, 0); // empty name
    expect_format(&b, "empty name", NULL);
    {
        // A name of 64 bytes (ggml's limit is 63).
        char long_name[65];
        memset(long_name, 'x', 64);
        long_name[64] = 0;
        di_gguf_writer *w = NULL;
        di_buf d;
        di_buf_init(&d);
        CHECK(di_gguf_writer_create(&w) == DI_OK);
        int64_t ne[1] = {4};
        CHECK(di_gguf_writer_add_tensor(w, long_name, DI_GGML_TYPE_F32, 1, ne, g_f32) ==
              DI_ERR_INVALID);
        CHECK(di_gguf_writer_add_tensor(w, "y", DI_GGML_TYPE_F32, 1, ne, g_f32) == DI_OK);
        CHECK(di_gguf_writer_write_buf(w, &d, NULL, NULL) == DI_OK);
        // Patch the name length to 64 with the next bytes taken as name: refused for length.
        size_t at = find(&d, "y") - 8;
        put64(&d, at, 64);
        expect_format(&d, "name too long", NULL);
        di_buf_deinit(&d);
        di_gguf_writer_destroy(w);
    }
    // Zero tensors and no metadata: valid.
    {
        di_gguf_writer *w = NULL;
        di_buf d;
        di_buf_init(&d);
        CHECK(di_gguf_writer_create(&w) == DI_OK);
        CHECK(di_gguf_writer_write_buf(w, &d, NULL, NULL) == DI_OK);
        write_seed(&d, "empty.gguf");
        CHECK(parse_exact(d.data, d.len, "empty") == DI_OK);
        CHECK(parse_exact(d.data, 24, "empty, no padding") == DI_OK);
        di_buf_deinit(&d);
        di_gguf_writer_destroy(w);
    }
    di_buf_deinit(&v);
    di_buf_deinit(&b);
}

int main(void) {
    di_log_set_sink(capture_sink, NULL);
    RUN(test_round_trip);
    RUN(test_types_and_file);
    RUN(test_truncations);
    RUN(test_malformed);
    (void)g_n_errors;
    return test_finish();
}
