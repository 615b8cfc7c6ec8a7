// libFuzzer target for src/io/safetensors: parses the input as a whole safetensors image, then
// walks every tensor (touching its first and last data byte, so that ASan flags any data pointer
// outside the input), looks each one up by name and reads the metadata. Any crash, sanitizer
// report or broken invariant (__builtin_trap) is a finding.
// Seeds: fuzz/corpus/safetensors/ (made by tests/unit/test_safetensors.c, see its header).
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "base/log.h"
#include "io/safetensors.h"

static void quiet_sink(di_log_level level, const char *msg, void *user) {
    (void)level;
    (void)msg;
    (void)user;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    di_log_set_sink(quiet_sink, NULL); // formatting still runs: the messages are exercised too
    di_st_file *f = NULL;
    if (di_st_file_parse(data, size, "fuzz", &f) != DI_OK) return 0;
    volatile uint8_t sink = 0;
    int64_t n = di_st_file_n_tensors(f);
    for (int64_t i = 0; i < n; i++) {
        const di_st_tensor *t = di_st_file_tensor(f, i);
        if (di_st_file_find(f, t->name) != t) __builtin_trap();
        if (t->n_dims < 0 || t->n_dims > DI_ST_MAX_DIMS || t->n_elements < 0) __builtin_trap();
        if (t->n_bytes != (size_t)t->n_elements * di_dtype_size(t->dtype)) __builtin_trap();
        const uint8_t *p = t->data;
        if (p < data || p > data + size || t->n_bytes > (size_t)(data + size - p)) __builtin_trap();
        if (t->n_bytes) sink ^= p[0] ^ p[t->n_bytes - 1];
    }
    (void)sink;
    const char *fmt = di_st_file_metadata(f, "format");
    if (fmt) sink ^= (uint8_t)fmt[0];
    di_st_file_close(f);
    return 0;
}
