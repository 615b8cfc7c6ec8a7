// libFuzzer target for src/io/gguf: parses the input as a whole GGUF image, then walks every
// metadata entry through the typed getters and every tensor (touching its first and last data
// byte, so that ASan flags any data pointer outside the input) and looks each one up by name. Any
// crash, sanitizer report or broken invariant (__builtin_trap) is a finding.
// Seeds: fuzz/corpus/gguf/ (made by tests/unit/test_gguf.c with DI_GGUF_WRITE_SEEDS, see its
// header).
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "base/log.h"
#include "io/gguf.h"

static void quiet_sink(di_log_level level, const char *msg, void *user) {
    (void)level;
    (void)msg;
    (void)user;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    di_log_set_sink(quiet_sink, NULL); // formatting still runs: the messages are exercised too
    di_gguf_file *f = NULL;
    if (di_gguf_parse(data, size, "fuzz", &f) != DI_OK) return 0;
    volatile uint8_t sink = 0;
    for (int64_t i = 0; i < di_gguf_n_kv(f); i++) {
        const di_gguf_kv *kv = di_gguf_kv_at(f, i);
        if (di_gguf_find_kv(f, kv->key) != kv) __builtin_trap();
        int64_t v, arr[4], n;
        double d, darr[4];
        const char *s;
        size_t len;
        if (di_gguf_get_int(f, kv->key, &v)) sink ^= (uint8_t)v;
        if (di_gguf_get_num(f, kv->key, &d)) sink ^= (uint8_t)(d != d);
        if (di_gguf_get_str(f, kv->key, &s, &len) && len) sink ^= (uint8_t)(s[0] ^ s[len - 1]);
        if (di_gguf_get_int_arr(f, kv->key, arr, 4, &n)) sink ^= (uint8_t)n;
        if (di_gguf_get_num_arr(f, kv->key, darr, 4, &n)) sink ^= (uint8_t)n;
    }
    for (int64_t i = 0; i < di_gguf_n_tensors(f); i++) {
        const di_gguf_tensor *t = di_gguf_tensor_at(f, i);
        if (di_gguf_find_tensor(f, t->name) != t) __builtin_trap();
        if (t->n_dims < 1 || t->n_dims > DI_GGUF_MAX_DIMS || t->n_elements < 0) __builtin_trap();
        int64_t blck;
        size_t bb;
        if (!di_ggml_type_info(t->type, &blck, &bb)) __builtin_trap();
        if (t->n_bytes != (size_t)(t->n_elements / blck) * bb) __builtin_trap();
        const uint8_t *p = t->data;
        if (p < data || p > data + size || t->n_bytes > (size_t)(data + size - p)) __builtin_trap();
        if (t->n_bytes) sink ^= p[0] ^ p[t->n_bytes - 1];
    }
    (void)sink;
    di_gguf_close(f);
    return 0;
}
