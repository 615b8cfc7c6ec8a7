// libFuzzer target for di_session_restore (model/dsv4_state.c: the CPU state format and the
// device sessions' token states) on a synthesized tiny V4 model (tiny-128, vocabulary 512, written
// once into a temporary directory), with one session on the device-resident forward's CPU twin and
// one on the CPU forward, in two modes chosen by the first byte:
//   - even: the rest of the input is restored as it is into the device session (fed 3 tokens
//     before) and into the CPU session: DI_OK or DI_ERR_FORMAT only; the device session is
//     unchanged by a refusal (position 3), and after a success at most its context;
//   - odd: the input is a recipe for a valid token state: byte 1 gives the count n (1..24) of
//     tokens, then n token bytes (missing ones 0), fed to a fresh device session and saved; byte
//     n + 2, when present, damages it: even values flip one byte (its index from byte n + 3),
//     odd ones truncate it (its length from byte n + 3). The verdict must be exactly the recipe's:
//     an intact state restores (position n), and the restored session's logits for one more token
//     equal the saved session's bit for bit; a damaged one is DI_ERR_FORMAT and changes nothing.
// Any crash, sanitizer report or wrong verdict (__builtin_trap) is a finding. Seeds:
// fuzz/corpus/session_state/ (hand-made recipes and raw inputs).
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "base/log.h"
#include "model/dsv4.h"
#include "model/synth.h"

enum { V = 512, N_CTX = 64 };

static di_model *g_dev, *g_cpu;
static float g_a[V], g_b[V];

static void quiet(di_log_level level, const char *msg, void *user) {
    (void)level, (void)msg, (void)user;
}

static di_model *load(const char *dir, bool twin) {
    di_model_options mo = di_model_options_default();
    mo.n_threads = 1;
    di_model *m = NULL;
    if (di_model_load(dir, &mo, &m) != DI_OK) abort();
    di_device dev = {.kind = DI_DEVICE_CPU};
    if (twin && di_model_dev_open(m, &dev, 1) != DI_OK) abort();
    return m;
}

int LLVMFuzzerInitialize(int *argc, char ***argv) {
    (void)argc, (void)argv;
    di_log_set_sink(quiet, NULL); // expected refusals would flood the output
    char dir[] = "/tmp/di_fuzz_session_state_XXXXXX";
    if (!mkdtemp(dir)) abort();
    di_synth_config c;
    if (di_synth_preset("tiny-128", &c) != DI_OK) abort();
    c.n_vocab = V;
    if (di_synth_write(&c, dir) != DI_OK) abort();
    g_dev = load(dir, true);
    g_cpu = load(dir, false);
    // The weights are mapped: the files may go now.
    char path[256];
    snprintf(path, sizeof path, "%s/config.json", dir);
    unlink(path);
    snprintf(path, sizeof path, "%s/model.safetensors", dir);
    unlink(path);
    rmdir(dir);
    return 0;
}

static di_session *session(di_model *m) {
    di_session_options so = {.n_ctx_max = N_CTX};
    di_session *s = NULL;
    if (di_session_create(m, &so, &s) != DI_OK) abort();
    return s;
}

static void feed(di_session *s, const int32_t *t, int32_t n, float *logits) {
    di_forward_out fo = {.logits = logits, .last_only = true};
    if (di_session_forward(s, t, n, logits ? &fo : NULL) != DI_OK) abort();
}

static void raw(const uint8_t *data, size_t size) {
    static const int32_t three[3] = {7, 11, 13};
    di_session *d = session(g_dev), *c = session(g_cpu);
    feed(d, three, 3, NULL);
    di_status st = di_session_restore(d, data, size);
    if (st != DI_OK && st != DI_ERR_FORMAT) __builtin_trap();
    if (st == DI_ERR_FORMAT && di_session_n_past(d) != 3) __builtin_trap();
    if (di_session_n_past(d) > N_CTX) __builtin_trap();
    st = di_session_restore(c, data, size);
    if (st != DI_OK && st != DI_ERR_FORMAT) __builtin_trap();
    if (di_session_n_past(c) > N_CTX) __builtin_trap();
    di_session_destroy(d);
    di_session_destroy(c);
}

static void recipe(const uint8_t *data, size_t size) {
    const int32_t n = size > 1 ? data[1] % 24 + 1 : 1;
    int32_t toks[25];
    for (int32_t t = 0; t < n; t++) toks[t] = (size_t)t + 2 < size ? data[t + 2] * 2 : 0;
    di_session *s = session(g_dev), *r = session(g_dev);
    feed(s, toks, n, NULL);
    void *bytes = NULL;
    size_t nb = 0;
    if (di_session_save(s, &bytes, &nb) != DI_OK) abort();
    const size_t k = (size_t)n + 2;
    const bool damage = k < size;
    size_t n_use = nb;
    if (damage) {
        const size_t at = k + 1 < size ? data[k + 1] : 0;
        if (data[k] % 2 == 0)
            ((unsigned char *)bytes)[at % nb] ^= (unsigned char)(data[k] | 1);
        else
            n_use = at % nb;
    }
    static const int32_t one = 5;
    feed(r, &one, 1, NULL);
    di_status st = di_session_restore(r, bytes, n_use);
    if (damage) {
        if (st != DI_ERR_FORMAT || di_session_n_past(r) != 1) __builtin_trap();
    } else {
        if (st != DI_OK || di_session_n_past(r) != n) __builtin_trap();
        const int32_t next = 9;
        feed(s, &next, 1, g_a);
        feed(r, &next, 1, g_b);
        if (memcmp(g_a, g_b, sizeof g_a)) __builtin_trap();
    }
    di_free_buffer(bytes);
    di_session_destroy(s);
    di_session_destroy(r);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size < 1) return 0;
    if (data[0] % 2)
        recipe(data, size);
    else
        raw(data + 1, size - 1);
    return 0;
}
