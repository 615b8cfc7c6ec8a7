// V4 state rollback (di_session_rollback, dsv4_state.c): a session with the MTP block fed a prefix,
// then n rejected tokens (one call or two), rolled back by n and fed a continuation must give the
// continuation's logits and MTP logits bit for bit (memcmp) as a fresh session fed the prefix and
// the continuation, for every n in 1..DI_DSV4_ROLLBACK_MAX, at prefixes where the taken-back span
// closes CSA (m = 4) and HCA (m = 8 on the tiny model) windows and crosses the window ring's wrap
// (W = 16, ring W + 8); in FP32 and in the official recipe. Each case starts from the prefix's
// state saved once (di_session_save / restore: the format holds the rollback rows). A rollback
// past what is allowed is refused with DI_ERR_INVALID and changes nothing, successive rollbacks
// more than DI_DSV4_ROLLBACK_MAX below the highest position fed included.
#include "harness.h"

#include <stdlib.h>
#include <string.h>

#include "model/dsv4.h"
#include "model/synth.h"

static char g_dir[256];

enum { V = 512, N_B = 11, MAX_T = 96 };

// Prefix lengths: the rejected span [p, p + n) closes CSA windows (p + n crosses a multiple of 4)
// and HCA windows (of 8) for most n, and from p = 17 on every position wraps the 24-row ring.
static const int32_t k_prefix[] = {1, 6, 13, 16, 27, 38, 61};

static uint64_t g_rng = 0x9e3779b97f4a7c15ull;

static int32_t rnd_token(void) {
    g_rng ^= g_rng << 13, g_rng ^= g_rng >> 7, g_rng ^= g_rng << 17;
    return (int32_t)(g_rng % V);
}

// Feeds toks in chunks of at most `chunk` (the MTP and main logits of the last call to the caller).
static void feed(di_session *s, const int32_t *toks, int32_t n, int32_t chunk, float *logits,
                 float *mtp, int32_t *n_mtp) {
    for (int32_t done = 0; done < n;) {
        int32_t k = n - done < chunk ? n - done : chunk;
        di_forward_out fo = {.logits = logits, .mtp_logits = mtp, .n_mtp_out = n_mtp};
        CHECK_EQ(di_session_forward(s, toks + done, k, done + k == n ? &fo : NULL), DI_OK);
        done += k;
    }
}

static void run_case(di_precision prec) {
    di_model_options mo = di_model_options_default();
    mo.n_threads = 2;
    mo.precision = prec;
    di_model *m = NULL;
    CHECK(di_model_load(g_dir, &mo, &m) == DI_OK);
    if (!m) return;
    di_session_options so = {.mtp = true};
    di_session *ref = NULL, *s = NULL;
    CHECK_EQ(di_session_create(m, &so, &ref), DI_OK);
    CHECK_EQ(di_session_create(m, &so, &s), DI_OK);
    float *want = malloc(sizeof(float) * N_B * V), *got = malloc(sizeof(float) * N_B * V);
    float *want_m = malloc(sizeof(float) * N_B * V), *got_m = malloc(sizeof(float) * N_B * V);
    int32_t prefix[MAX_T], rejected[DI_DSV4_ROLLBACK_MAX], cont[N_B];
    int64_t n_cases = 0, n_diff = 0;
    for (size_t ip = 0; ip < sizeof k_prefix / sizeof k_prefix[0]; ip++) {
        const int32_t p = k_prefix[ip];
        for (int32_t t = 0; t < p; t++) prefix[t] = rnd_token();
        for (int32_t t = 0; t < N_B; t++) cont[t] = rnd_token();
        // The reference: a session that never saw the rejected tokens.
        int32_t n_want = 0, n_got = 0;
        di_session_reset(ref);
        feed(ref, prefix, p, 7, NULL, NULL, NULL);
        feed(ref, cont, N_B, N_B, want, want_m, &n_want);
        CHECK_EQ(n_want, N_B);
        void *saved = NULL;
        size_t n_saved = 0;
        di_session_reset(s);
        feed(s, prefix, p, 7, NULL, NULL, NULL);
        CHECK_EQ(di_session_save(s, &saved, &n_saved), DI_OK);
        for (int32_t n = 1; saved && n <= DI_DSV4_ROLLBACK_MAX; n++) {
            for (int32_t t = 0; t < n; t++) rejected[t] = rnd_token();
            CHECK_EQ(di_session_restore(s, saved, n_saved), DI_OK);
            // The rejected tokens: one call (a verify), or one by one for odd n (drafts fed as
            // they come, rolled back together).
            feed(s, rejected, n, n % 2 ? 1 : n, NULL, NULL, NULL);
            CHECK_EQ(di_session_rollback(s, n), DI_OK);
            CHECK_EQ(di_session_n_past(s), p);
            feed(s, cont, N_B, N_B, got, got_m, &n_got);
            CHECK_EQ(n_got, N_B);
            const bool same = memcmp(got, want, sizeof(float) * N_B * V) == 0 &&
                              memcmp(got_m, want_m, sizeof(float) * N_B * V) == 0;
            if (!same) {
                fprintf(stderr, "prefix %d, rollback %d: logits differ\n", p, n);
                n_diff++;
            }
            n_cases++;
        }
        di_free_buffer(saved);
    }
    // Refused: over the bound, more than fed, negative; the state is unchanged afterwards.
    di_session_reset(s);
    feed(s, prefix, 20, 20, NULL, NULL, NULL);
    di_session_reset(ref);
    feed(ref, prefix, 20, 20, NULL, NULL, NULL);
    CHECK_EQ(di_session_rollback(s, DI_DSV4_ROLLBACK_MAX + 1), DI_ERR_INVALID);
    CHECK_EQ(di_session_rollback(s, -1), DI_ERR_INVALID);
    CHECK_EQ(di_session_n_past(s), 20);
    // Successive rollbacks: the bound counts from the highest position fed. 8 taken back, 1 fed
    // and 3 more taken back would be 10 below it: the window ring (W + 8 rows) lost position
    // 18 - W + 1's row, which position 18 reads, to the first rejected rows (this was accepted,
    // giving other logits); 1 more is 8 below it.
    int32_t junk[DI_DSV4_ROLLBACK_MAX];
    for (int32_t t = 0; t < DI_DSV4_ROLLBACK_MAX; t++) junk[t] = rnd_token();
    feed(s, junk, DI_DSV4_ROLLBACK_MAX, DI_DSV4_ROLLBACK_MAX, NULL, NULL, NULL);
    CHECK_EQ(di_session_rollback(s, DI_DSV4_ROLLBACK_MAX), DI_OK);
    feed(s, junk, 1, 1, NULL, NULL, NULL);
    CHECK_EQ(di_session_rollback(s, 3), DI_ERR_INVALID);
    CHECK_EQ(di_session_rollback(s, 2), DI_ERR_INVALID); // 9 below: the device's limit too
    CHECK_EQ(di_session_n_past(s), 21);
    CHECK_EQ(di_session_rollback(s, 1), DI_OK);
    CHECK_EQ(di_session_n_past(s), 20);
    di_session *fresh = NULL;
    CHECK_EQ(di_session_create(m, &so, &fresh), DI_OK);
    feed(fresh, prefix, 3, 3, NULL, NULL, NULL);
    CHECK_EQ(di_session_rollback(fresh, 4), DI_ERR_INVALID);
    CHECK_EQ(di_session_n_past(fresh), 3);
    CHECK_EQ(di_session_rollback(fresh, 3), DI_OK); // back to nothing: as new
    CHECK_EQ(di_session_n_past(fresh), 0);
    int32_t nw = 0, ng = 0;
    feed(s, cont, N_B, N_B, got, got_m, &ng);
    feed(ref, cont, N_B, N_B, want, want_m, &nw);
    CHECK(memcmp(got, want, sizeof(float) * N_B * V) == 0);
    CHECK(memcmp(got_m, want_m, sizeof(float) * N_B * V) == 0);
    // A session rolled back to position 0 equals a new one.
    di_session_reset(ref);
    feed(fresh, cont, N_B, N_B, got, got_m, &ng);
    feed(ref, cont, N_B, N_B, want, want_m, &nw);
    CHECK_EQ(ng, nw);
    CHECK(memcmp(got, want, sizeof(float) * N_B * V) == 0);
    CHECK(memcmp(got_m, want_m, sizeof(float) * (size_t)nw * V) == 0);
    fprintf(stderr, "%s: %lld rollbacks (n = 1..%d), %lld differ\n",
            prec == DI_PRECISION_OFFICIAL ? "official" : "fp32", (long long)n_cases,
            DI_DSV4_ROLLBACK_MAX, (long long)n_diff);
    CHECK_EQ(n_diff, 0);
    di_session_destroy(fresh);
    di_session_destroy(s);
    di_session_destroy(ref);
    free(want);
    free(got);
    free(want_m);
    free(got_m);
    di_model_destroy(m);
}

static void test_rollback_fp32(void) {
    run_case(DI_PRECISION_FP32);
}

static void test_rollback_official(void) {
    run_case(DI_PRECISION_OFFICIAL);
}

int main(void) {
    snprintf(g_dir, sizeof g_dir, "/tmp/di_test_state_XXXXXX");
    if (!mkdtemp(g_dir)) return 1;
    di_synth_config c;
    CHECK(di_synth_preset("tiny", &c) == DI_OK);
    c.n_vocab = V;
    c.official = true; // the official layout carries the MTP block
    CHECK(di_synth_write(&c, g_dir) == DI_OK);
    RUN(test_rollback_fp32);
    RUN(test_rollback_official);
    di_test_remove_dir(g_dir);
    return test_finish();
}
