// Sessions (include/deepinfer.h di_session_*) on the device-resident forward's CPU twin, attached
// on backends the model owns (di_model_dev_open, so it can be rebuilt), V4 (synth tiny-128: SWA,
// CSA m=4 and HCA m=128 layers) and V4.1 (synth v41-tiny, official layout): the device-loss
// recovery and the token states of save / restore (model/dsv4.c "sessions on the device-resident
// forward", dsv4_state.c "token states"). The reference of every device run is a session of the
// same model that never lost the device: logits compared bit for bit.
//   (a) two sessions A and B decode greedily in turns; the backend is lost inside one of A's
//       calls (di_cpu_backend_lose: that call's k-th backend entry and every later one fail with
//       DI_ERR_DEVICE_LOST): A recovers inside the call (its stats count one loss, one recovery,
//       its tokens replayed), B replays at its next call (no loss of its own); both give the
//       reference's logits and tokens. Then DI_SESSION_LOSE_DEVICE=1 (the drill): a new session's
//       first call fails without running and is recovered the same way; and di_model_dev_rebuild
//       called from outside mid-generation (as the engine would): the session replays.
//   (b) the bound: device_loss_max 1: a second loss within the window ends the call with
//       DI_ERR_DEVICE_LOST, the session keeping its position; a further call fails the same way
//       (the device stays lost); the model is usable again after a fresh rebuild.
//   (c) save / restore: a token state saved mid-generation restores into a fresh device session
//       and into a session on a CPU-only model of the same checkpoint, which continue with the
//       logits of the uninterrupted run (the device's, bit for bit; the CPU's, bit for bit against
//       a CPU session fed the same tokens); every byte flipped, every truncation, another model's
//       state, a context too small and a CPU state given to a device session are DI_ERR_FORMAT and
//       leave the device session unchanged; a token state restores into a CPU session of its own.
//   (d) (a) and (b) again on two pipeline stages (V4 and V4.1), the second stage's backend lost
//       (release build only: under ASan the same code paths as (a, b)).
//   (e) a V4.1 DSpark session (mtp, synth v41-tiny with its DSpark block) on the device forward
//       against a CPU DSpark session: draft / verify / rollback steps as generate --dspark's
//       (rollbacks of all, none and some drafts), bit for bit through a token-state save /
//       restore, backend losses inside a draft and a verify call, a rollback on a state dropped
//       by a rebuild from outside, and the drill; rollbacks past 16, the position, or 16 below
//       the highest position fed (successive ones) refused alike, the edge then continuing alike
//       (release 8 steps, ASan 4).
//   (f) a V4 MTP session (tiny-128's sliding-window MTP block) on the device forward against a
//       CPU MTP session: verify steps of an anchor and 1 to 8 drafts (the first the MTP block's
//       argmax) in one call, every row's logits and MTP logits, the drafts (each MTP row's
//       argmax) and anchors bit for bit through rollbacks of all, none and some drafts (up to
//       8), a token-state save / restore into a fresh device session, a backend loss inside a
//       verify call, a rebuild from outside before a rollback and the drill; a rollback past what
//       the rings hold (more than 8 below the highest position fed, across calls) refused by
//       both sessions, nothing lost; 8 taken back across the first HCA window's close (release);
//       the prompt fed in chunks as one call. Again on two pipeline stages and in the official
//       recipe (release), and with the backends deferred (--deferred, release stage only). Release
//       10 steps, ASan 4 without the losses.
#include "harness.h"

#include <stdlib.h>
#include <string.h>

#include "backend/backend.h"
#include "base/log.h" // di_log_set_sink: the refusals' errors counted, not printed
#include "model/dsv4.h"
#include "model/synth.h"

// Under ASan + UBSan (a memory check, about 35 times slower) a shorter prompt and run, without
// (d): 23 s on an idle 2-core machine (about 15 s of CPU; 89 s with the full run) against 2.5 s
// in a release build (5 s with (d)); (f) adds 1.9 s there (4 steps, no losses), 2 s in release
// (1 s, and 1 s on two stages: most of it the HCA case's two 132-token runs).
#if defined(__SANITIZE_ADDRESS__)
enum { N_PROMPT = 20, N_GEN = 6 };
#else
enum { N_PROMPT = 70, N_GEN = 10 };
#endif
enum { V = 512, N_CTX = 128 };

static char g_dir4[256], g_dir41[256];
static int32_t g_prompt[N_PROMPT];

static int g_n_errors;

static void count_sink(di_log_level level, const char *msg, void *user) {
    (void)msg, (void)user;
    g_n_errors += level == DI_LOG_LEVEL_ERROR;
}

static int32_t argmax(const float *v) {
    int32_t b = 0;
    for (int32_t i = 1; i < V; i++)
        if (v[i] > v[b]) b = i;
    return b;
}

static int32_t g_stages = 1; // pipeline stages of the twin ((d): 2, the last one's backend lost)
static di_precision g_prec = DI_PRECISION_FP32; // the models' recipe ((f): the official one too)

// A model of dir with (twin) or without the device-resident forward's CPU twin.
static di_model *load(const char *dir, bool twin) {
    di_model_options mo = di_model_options_default();
    mo.n_threads = 2;
    mo.precision = g_prec;
    di_model *m = NULL;
    if (di_model_load(dir, &mo, &m) != DI_OK) return NULL;
    di_device devs[2] = {{.kind = DI_DEVICE_CPU}, {.kind = DI_DEVICE_CPU}};
    if (twin && di_model_dev_open(m, devs, g_stages) != DI_OK) {
        di_model_destroy(m);
        return NULL;
    }
    return m;
}

static di_session *session(di_model *m, int32_t loss_max) {
    di_session_options so = {.n_ctx_max = N_CTX, .device_loss_max = loss_max};
    di_session *s = NULL;
    return di_session_create(m, &so, &s) == DI_OK ? s : NULL;
}

// A greedy run: logits [N_GEN + 1, V] (the prompt's last row, then each decode step's) and the
// tokens chosen [N_GEN + 1].
typedef struct run {
    float logits[N_GEN + 1][V];
    int32_t tok[N_GEN + 1];
} run;

// Step k of a greedy run on s (k 0: the prompt).
static di_status step(di_session *s, run *r, int k) {
    di_forward_out fo = {.logits = r->logits[k], .last_only = true};
    di_status st = k == 0 ? di_session_forward(s, g_prompt, N_PROMPT, &fo)
                          : di_session_forward(s, &r->tok[k - 1], 1, &fo);
    if (st == DI_OK) r->tok[k] = argmax(r->logits[k]);
    return st;
}

static bool reference(di_model *m, run *ref) {
    di_session *s = session(m, 0);
    bool ok = s != NULL;
    for (int k = 0; ok && k <= N_GEN; k++) ok = step(s, ref, k) == DI_OK;
    di_session_destroy(s);
    return ok;
}

static bool same_run(const run *a, const run *b) {
    return !memcmp(a->logits, b->logits, sizeof a->logits) &&
           !memcmp(a->tok, b->tok, sizeof a->tok);
}

// ---- (a), (b) device loss ----

// The backend a test loses: the last stage's (after a rebuild, the new one).
static di_backend *lost(const di_model *m) {
    return g_stages > 1 ? m->dev_more[g_stages - 2] : m->dev_backend;
}

static void test_loss(const char *dir, const char *name) {
    di_model *m = load(dir, true);
    CHECK(m && (m->dev || m->dev41));
    if (!m) return;
    run *ref = calloc(1, sizeof *ref), *ra = calloc(1, sizeof *ra), *rb = calloc(1, sizeof *rb);
    CHECK(reference(m, ref));
    di_session *a = session(m, 0), *b = session(m, 0);
    CHECK(a && b);
    for (int k = 0; a && b && k <= N_GEN; k++) {
        // Inside A's third decode step, 5 backend entries into it.
        if (k == 3) di_cpu_backend_lose(lost(m), 5);
        CHECK_EQ(step(a, ra, k), DI_OK);
        CHECK_EQ(step(b, rb, k), DI_OK);
    }
    CHECK(same_run(ra, ref));
    CHECK(same_run(rb, ref));
    di_session_stats sa, sb;
    di_session_get_stats(a, &sa);
    di_session_get_stats(b, &sb);
    CHECK_EQ(sa.n_device_losses, 1);
    CHECK_EQ(sa.n_device_recoveries, 1);
    CHECK_EQ(sa.n_replayed_tokens, N_PROMPT + 2);
    CHECK_EQ(sb.n_device_losses, 0);
    CHECK_EQ(sb.n_replayed_tokens, N_PROMPT + 2);
    CHECK_EQ(di_session_n_past(a), N_PROMPT + N_GEN);
    di_session_destroy(a);
    di_session_destroy(b);
    // The drill: the first call fails without running.
    setenv("DI_SESSION_LOSE_DEVICE", "1", 1);
    a = session(m, 0);
    unsetenv("DI_SESSION_LOSE_DEVICE");
    memset(ra, 0, sizeof *ra);
    for (int k = 0; a && k <= N_GEN; k++) CHECK_EQ(step(a, ra, k), DI_OK);
    CHECK(same_run(ra, ref));
    di_session_get_stats(a, &sa);
    CHECK_EQ(sa.n_device_losses, 1);
    CHECK_EQ(sa.n_device_recoveries, 1);
    di_session_destroy(a);
    // A rebuild from outside the session (the serving engine's, a caller's): the session's state
    // is dropped with the old forward and replayed at its next call.
    a = session(m, 0);
    memset(ra, 0, sizeof *ra);
    for (int k = 0; a && k <= N_GEN; k++) {
        if (k == 3) CHECK_EQ(di_model_dev_rebuild(m), DI_OK);
        CHECK_EQ(step(a, ra, k), DI_OK);
    }
    CHECK(same_run(ra, ref));
    di_session_get_stats(a, &sa);
    CHECK_EQ(sa.n_device_losses, 0);
    CHECK_EQ(sa.n_replayed_tokens, N_PROMPT + 2);
    di_session_destroy(a);

    // (b) device_loss_max 1: the second loss within the window is not recovered.
    a = session(m, 1);
    for (int k = 0; a && k <= 2; k++) CHECK_EQ(step(a, ra, k), DI_OK);
    di_cpu_backend_lose(lost(m), 3);
    CHECK_EQ(step(a, ra, 3), DI_OK); // recovered
    di_cpu_backend_lose(lost(m), 3);
    CHECK_EQ(step(a, ra, 4), DI_ERR_DEVICE_LOST);
    CHECK_EQ(di_session_n_past(a), N_PROMPT + 3); // its tokens kept
    CHECK_EQ(step(a, ra, 4), DI_ERR_DEVICE_LOST); // still lost, still over the bound
    di_session_get_stats(a, &sa);
    CHECK_EQ(sa.n_device_losses, 3);
    CHECK_EQ(sa.n_device_recoveries, 1);
    di_session_destroy(a);
    // A fresh rebuild (no session holds a state) makes the model usable again.
    CHECK_EQ(di_model_dev_rebuild(m), DI_OK);
    memset(ra, 0, sizeof *ra);
    a = session(m, 0);
    for (int k = 0; a && k <= N_GEN; k++) CHECK_EQ(step(a, ra, k), DI_OK);
    CHECK(same_run(ra, ref));
    di_session_destroy(a);
    fprintf(stderr, "%s: device loss recovered bit for bit; bound enforced\n", name);
    free(ref);
    free(ra);
    free(rb);
    di_model_destroy(m);
}

static void test_loss_v4(void) {
    test_loss(g_dir4, "(a, b) V4");
}

static void test_loss_v41(void) {
    test_loss(g_dir41, "(a, b) V4.1");
}

#if !defined(__SANITIZE_ADDRESS__) // the same code paths as (a, b): release only
// (d) (a) and (b) on two pipeline stages, the second stage's backend lost (every stage rebuilt).
static void test_loss_stages(void) {
    g_stages = 2;
    test_loss(g_dir4, "(d) V4, 2 stages");
    test_loss(g_dir41, "(d) V4.1, 2 stages");
    g_stages = 1;
}
#endif

// ---- (c) save / restore ----

enum { K_SAVE = 4 }; // saved after the prompt and 4 decode steps (at position N_PROMPT + 4)

// Continues s from step K_SAVE + 1 with ref's tokens into r; true when every row equals ref's.
static bool continues(di_session *s, const run *ref, run *r) {
    for (int k = K_SAVE + 1; k <= N_GEN; k++) {
        di_forward_out fo = {.logits = r->logits[k], .last_only = true};
        if (di_session_forward(s, &ref->tok[k - 1], 1, &fo) != DI_OK) return false;
    }
    return !memcmp(r->logits[K_SAVE + 1], ref->logits[K_SAVE + 1],
                   sizeof(float) * V * (N_GEN - K_SAVE));
}

static void test_save(const char *dir, const char *other_dir, const char *name) {
    di_model *m = load(dir, true), *cpu = load(dir, false), *other = load(other_dir, true);
    CHECK(m && cpu && other);
    if (!m || !cpu || !other) goto done;
    run *ref = calloc(1, sizeof *ref), *r = calloc(1, sizeof *r), *rc = calloc(1, sizeof *rc);
    CHECK(reference(m, ref));
    // The saved session: the prompt and K_SAVE decode steps.
    di_session *s = session(m, 0);
    for (int k = 0; s && k <= K_SAVE; k++) CHECK_EQ(step(s, r, k), DI_OK);
    void *bytes = NULL;
    size_t nb = 0;
    CHECK_EQ(di_session_save(s, &bytes, &nb), DI_OK);
    CHECK_EQ(nb, 24 + 4 * (size_t)(N_PROMPT + K_SAVE) + 8); // header, tokens, checksum
    CHECK(continues(s, ref, r));
    di_session_destroy(s);

    // Into a fresh device session.
    di_session *d = session(m, 0);
    CHECK_EQ(di_session_restore(d, bytes, nb), DI_OK);
    CHECK_EQ(di_session_n_past(d), N_PROMPT + K_SAVE);
    // Bad bytes leave it unchanged: every byte flipped, every truncation.
    unsigned char *bad = malloc(nb);
    int n_refused = 0, n_tries = 0;
    di_log_set_sink(count_sink, NULL); // hundreds of refusals, each logged once
    g_n_errors = 0;
    for (size_t i = 0; i < nb; i++) {
        memcpy(bad, bytes, nb);
        bad[i] ^= 0x40;
        n_refused += di_session_restore(d, bad, nb) == DI_ERR_FORMAT;
        n_tries++;
    }
    for (size_t n = 0; n < nb; n++, n_tries++)
        n_refused += di_session_restore(d, bytes, n) == DI_ERR_FORMAT;
    di_log_set_sink(NULL, NULL);
    CHECK_EQ(n_refused, n_tries);
    CHECK_EQ(g_n_errors, n_tries);
    // Another model's token state; a context too small for it.
    di_session *o = session(other, 0);
    run *ro = calloc(1, sizeof *ro);
    CHECK_EQ(step(o, ro, 0), DI_OK);
    void *obytes = NULL;
    size_t onb = 0;
    CHECK_EQ(di_session_save(o, &obytes, &onb), DI_OK);
    CHECK_EQ(di_session_restore(d, obytes, onb), DI_ERR_FORMAT);
    di_session_options small = {.n_ctx_max = N_PROMPT};
    di_session *t = NULL;
    CHECK_EQ(di_session_create(m, &small, &t), DI_OK);
    CHECK_EQ(di_session_restore(t, bytes, nb), DI_ERR_FORMAT);
    di_session_destroy(t);
    // A CPU session's state into the device session: DI_ERR_FORMAT, unchanged.
    di_session *c = session(cpu, 0);
    CHECK_EQ(step(c, rc, 0), DI_OK);
    void *cbytes = NULL;
    size_t cnb = 0;
    CHECK_EQ(di_session_save(c, &cbytes, &cnb), DI_OK);
    CHECK_EQ(di_session_restore(d, cbytes, cnb), DI_ERR_FORMAT);
    CHECK_EQ(di_session_n_past(d), N_PROMPT + K_SAVE);
    memset(r, 0, sizeof *r);
    CHECK(continues(d, ref, r)); // bit for bit the uninterrupted run

    // Into the CPU session (it had fed the prompt: restore resets it): the CPU forward's logits of
    // the same tokens, i.e. those of a CPU session fed them directly.
    run *cref = calloc(1, sizeof *cref);
    di_session *c2 = session(cpu, 0);
    for (int k = 0; c2 && k <= N_GEN; k++) {
        di_forward_out fo = {.logits = cref->logits[k], .last_only = true};
        CHECK_EQ(k == 0 ? di_session_forward(c2, g_prompt, N_PROMPT, &fo)
                        : di_session_forward(c2, &ref->tok[k - 1], 1, &fo),
                 DI_OK);
        cref->tok[k] = ref->tok[k];
    }
    CHECK_EQ(di_session_restore(c, bytes, nb), DI_OK);
    CHECK_EQ(di_session_n_past(c), N_PROMPT + K_SAVE);
    memset(rc, 0, sizeof *rc);
    CHECK(continues(c, cref, rc));
    // A CPU session's own state still round-trips on the CPU.
    di_session_reset(c);
    CHECK_EQ(di_session_restore(c, cbytes, cnb), DI_OK);
    CHECK_EQ(di_session_n_past(c), N_PROMPT);
    fprintf(stderr,
            "%s: token state of %zu bytes: device -> device and device -> CPU continue "
            "bit for bit; %d bad images refused\n",
            name, nb, n_tries);
    di_free_buffer(bytes);
    di_free_buffer(obytes);
    di_free_buffer(cbytes);
    free(bad);
    free(ref);
    free(r);
    free(rc);
    free(ro);
    free(cref);
    di_session_destroy(d);
    di_session_destroy(o);
    di_session_destroy(c);
    di_session_destroy(c2);
done:
    di_model_destroy(m);
    di_model_destroy(cpu);
    di_model_destroy(other);
}

static void test_save_v4(void) {
    test_save(g_dir4, g_dir41, "(c) V4");
}

static void test_save_v41(void) {
    test_save(g_dir41, g_dir4, "(c) V4.1");
}

// ---- (e) DSpark sessions (V4.1, mtp) on the device forward ----
//
// A loop like generate's dspark_loop: draft from the anchor (logits asked for), verify anchor +
// drafts in one call (every row's logits), take back a scheduled number of drafts (all, none,
// some: rollbacks of n, 0 and between), the next anchor the verify row's argmax after the kept
// ones. The device session's drafts, confidences, draft logits, verify logits and anchors equal the
// CPU session's (memcmp), with a token-state save and restore into a fresh device session, a
// backend loss inside a verify call and one inside a draft call, and the DI_SESSION_LOSE_DEVICE
// drill, all mid-run. Rollbacks past DI_DSV41_ROLLBACK_MAX or the position are refused, nothing
// changed.
#if defined(__SANITIZE_ADDRESS__)
enum { N_IT = 4 };
#else
enum { N_IT = 8 };
#endif
enum { B_MAX = 16 };

static char g_dir41d[256];

typedef struct spec_run {
    di_draft d[N_IT];
    float dl[N_IT][B_MAX][V];     // the drafts' logits
    float vl[N_IT][B_MAX + 1][V]; // the verify rows' logits
    int32_t anchor[N_IT + 1];
    int32_t pos[N_IT + 1];
} spec_run;

static di_session *spec_session(di_model *m) {
    di_session_options so = {.n_ctx_max = N_CTX + 64, .mtp = true};
    di_session *s = NULL;
    return di_session_create(m, &so, &s) == DI_OK ? s : NULL;
}

// Drafts taken back at iteration it (of n): all, none, then some.
static int32_t spec_back(int it, int32_t n) {
    static const int32_t sched[] = {-1, 0, 5, -1, 1, 0, 9, 3};
    const int32_t b = sched[it % 8];
    return b < 0 ? n : b < n ? b : n;
}

// The loop on *ps (replaced by the session restored into); with disturb, at iteration 0 a token
// state restored into a fresh session, 1 a loss inside the draft, 2 one inside the verify, 3
// rollbacks past the limit refused, then a rebuild from outside before the rollback (the state
// dropped), 4 the drill (in the restore's replay).
// *ps's token state saved and restored into t (a fresh session, NULL: out of memory), which then
// replaces *ps. False when a step fails, t's position is not want_pos (< 0: not checked) or its
// device recoveries are not want_rec (< 0: not checked); t is destroyed then.
static bool move_state(di_session **ps, di_session *t, int32_t want_pos, int64_t want_rec) {
    void *bytes = NULL;
    size_t nb = 0;
    di_status st = t ? di_session_save(*ps, &bytes, &nb) : DI_ERR_NOMEM;
    if (st == DI_OK) st = di_session_restore(t, bytes, nb);
    di_free_buffer(bytes);
    di_session_stats ss = {0};
    if (st == DI_OK) di_session_get_stats(t, &ss);
    if (st != DI_OK || (want_pos >= 0 && di_session_n_past(t) != want_pos) ||
        (want_rec >= 0 && ss.n_device_recoveries != want_rec)) {
        di_session_destroy(t);
        return false;
    }
    di_session_destroy(*ps);
    *ps = t;
    return true;
}

static bool spec_loop(di_model *m, di_session **ps, spec_run *r, bool disturb) {
    di_session *s = *ps;
    float last[V];
    di_forward_out fo = {.logits = last, .last_only = true};
    if (di_session_forward(s, g_prompt, N_PROMPT, &fo) != DI_OK) return false;
    r->anchor[0] = argmax(last);
    r->pos[0] = di_session_n_past(s);
    for (int it = 0; it < N_IT; it++) {
        if (disturb && it == 1) di_cpu_backend_lose(lost(m), 4); // inside the draft call
        if (di_session_draft(s, r->anchor[it], &r->d[it], &r->dl[it][0][0]) != DI_OK) return false;
        const int32_t n = r->d[it].n;
        if (n < 1 || n > B_MAX) return false;
        int32_t ver[B_MAX + 1];
        ver[0] = r->anchor[it];
        memcpy(ver + 1, r->d[it].tokens, sizeof(int32_t) * (size_t)n);
        if (disturb && it == 2) di_cpu_backend_lose(lost(m), 6); // inside the verify call
        di_forward_out vo = {.logits = &r->vl[it][0][0]};
        if (di_session_forward(s, ver, n + 1, &vo) != DI_OK) return false;
        const int32_t back = spec_back(it, n);
        if (disturb && it == 3) {
            // Past the limits: refused, nothing changed.
            const int32_t p = di_session_n_past(s);
            if (di_session_rollback(s, 17) != DI_ERR_INVALID ||
                di_session_rollback(s, -1) != DI_ERR_INVALID || di_session_n_past(s) != p)
                return false;
            // A rebuild from outside drops the state: the rollback below moves the position
            // only, and the next call (the draft) replays the kept tokens.
            if (di_model_dev_rebuild(m) != DI_OK || s->dev41) return false;
        }
        if (di_session_rollback(s, back) != DI_OK) return false;
        r->anchor[it + 1] = argmax(r->vl[it][n - back]);
        r->pos[it + 1] = di_session_n_past(s);
        if (disturb && it == 0) { // a token state into a fresh device session
            if (!move_state(ps, spec_session(m), r->pos[1], -1)) return false;
            s = *ps;
        }
        if (disturb && it == 4) { // the drill: the next call (a draft, then the verify) recovers
            setenv("DI_SESSION_LOSE_DEVICE", "1", 1);
            di_session *t = spec_session(m);
            unsetenv("DI_SESSION_LOSE_DEVICE");
            // The drill counts forward calls: the restore's replay is the first, recovered.
            if (!move_state(ps, t, -1, 1)) return false;
            s = *ps;
        }
    }
    return true;
}

static void test_dspark(void) {
    di_model *m = load(g_dir41d, true), *cpu = load(g_dir41d, false);
    CHECK(m && cpu && m->dev41);
    if (!m || !cpu) goto done;
    CHECK(m->hp.dspark_block_size >= 1 && m->hp.dspark_block_size <= B_MAX);
    spec_run *ref = calloc(1, sizeof *ref), *r = calloc(1, sizeof *r);
    di_session *c = spec_session(cpu), *s = spec_session(m);
    CHECK(c && s);
    CHECK(spec_loop(cpu, &c, ref, false));
    CHECK(!c->dev_on);
    CHECK(spec_loop(m, &s, r, true));
    CHECK(s && s->dev_on);
    di_session_stats ss;
    di_session_get_stats(s, &ss);
    CHECK(!memcmp(ref->d, r->d, sizeof ref->d));
    CHECK(!memcmp(ref->dl, r->dl, sizeof ref->dl));
    CHECK(!memcmp(ref->anchor, r->anchor, sizeof ref->anchor));
    CHECK(!memcmp(ref->pos, r->pos, sizeof ref->pos));
    // Verify rows: those of each call's rows (n + 1 of them).
    for (int it = 0; it < N_IT; it++)
        CHECK(!memcmp(ref->vl[it], r->vl[it], sizeof(float) * V * (size_t)(ref->d[it].n + 1)));
    // A rollback past the position on a fresh device session.
    di_session *t = spec_session(m);
    float last[V];
    di_forward_out fo = {.logits = last, .last_only = true};
    CHECK_EQ(di_session_forward(t, g_prompt, 3, &fo), DI_OK);
    CHECK_EQ(di_session_rollback(t, 4), DI_ERR_INVALID);
    CHECK_EQ(di_session_rollback(t, 3), DI_OK);
    CHECK_EQ(di_session_n_past(t), 0);
    // Successive rollbacks, refused alike more than 16 below the highest position fed (37: 16
    // taken back, 1 fed, then 4 or 2 more would be 19 or 17 below; the rings lost rows the new
    // position reads), 1 more (the edge) taken: the sessions then continue alike.
    di_session *u = spec_session(m), *uc = spec_session(cpu);
    CHECK(u && uc);
    int32_t tk[40]; // the prompt may be shorter (ASan)
    for (int32_t i = 0; i < 40; i++) tk[i] = (int32_t)((i * 53 + 7) % V);
    float lu[V], luc[V];
    di_forward_out fu = {.logits = lu, .last_only = true}, fuc = {.logits = luc, .last_only = true};
    for (int k = 0; u && uc && k < 2; k++) {
        di_session *x = k ? uc : u;
        di_forward_out *fx = k ? &fuc : &fu;
        CHECK_EQ(di_session_forward(x, tk, 21, fx), DI_OK);
        CHECK_EQ(di_session_forward(x, tk + 24, 16, fx), DI_OK);
        CHECK_EQ(di_session_rollback(x, 16), DI_OK);
        CHECK_EQ(di_session_forward(x, tk + 21, 1, fx), DI_OK);
        CHECK_EQ(di_session_rollback(x, 4), DI_ERR_INVALID);
        CHECK_EQ(di_session_rollback(x, 2), DI_ERR_INVALID);
        CHECK_EQ(di_session_n_past(x), 22);
        CHECK_EQ(di_session_rollback(x, 1), DI_OK);
        CHECK_EQ(di_session_forward(x, tk + 21, 19, fx), DI_OK);
    }
    CHECK(u && u->dev_on);
    CHECK(!memcmp(lu, luc, sizeof lu));
    di_session_destroy(u);
    di_session_destroy(uc);
    fprintf(stderr,
            "(e) V4.1 DSpark: %d draft / verify / rollback steps on the device session = the CPU "
            "session's (positions %d .. %d), through a save / restore, 2 losses, a rebuild and a "
            "drill\n",
            N_IT, r->pos[0], r->pos[N_IT]);
    di_session_destroy(t);
    di_session_destroy(c);
    di_session_destroy(s);
    free(ref);
    free(r);
done:
    di_model_destroy(m);
    di_model_destroy(cpu);
}

// ---- (f) V4 MTP sessions on the device forward ----
//
// A verify loop on the session API (include/deepinfer.h di_forward_out.mtp_logits): each call
// feeds the anchor and k drafts (k = 1 .. 8 by the schedule; the first draft the argmax of the
// last call's last MTP row, the others made up), with every row's logits and the MTP logits of
// its rows (positions p - 1 .. p + k - 1); then takes back a scheduled number of drafts (all,
// none, some: the state of each is what the next call reads), the next anchor the argmax of the
// verify row after the kept ones.
#if defined(__SANITIZE_ADDRESS__)
enum { M_IT = 4 };
#else
enum { M_IT = 10 };
#endif
enum { M_MAX = 8 }; // DI_DSV4_ROLLBACK_MAX drafts

typedef struct mtp_run {
    float pl[V];                    // the prompt's last row
    float pm[N_PROMPT][V];          // the prompt's MTP rows (N_PROMPT - 1)
    float vl[M_IT][M_MAX + 1][V];   // verify rows' logits
    float vm[M_IT][M_MAX + 1][V];   // their MTP rows
    int32_t draft[M_IT][M_MAX + 1]; // every MTP row's argmax (the drafts it makes)
    int32_t n_mtp[M_IT + 1];
    int32_t anchor[M_IT + 1], pos[M_IT + 1];
} mtp_run;

static di_session *mtp_session(di_model *m) {
    di_session_options so = {.n_ctx_max = N_CTX + 64, .mtp = true};
    di_session *s = NULL;
    return di_session_create(m, &so, &s) == DI_OK ? s : NULL;
}

// Drafts at iteration it and how many of them are taken back (-1: all).
static const int32_t mtp_k[] = {3, 8, 8, 1, 5, 2, 8, 4, 1, 6};
static const int32_t mtp_back[] = {-1, 0, -1, 1, 2, 0, 5, -1, 0, 3};

// The loop on *ps (replaced by the session restored into); with disturb, at iteration 1 a token
// state restored into a fresh session, 2 a backend loss inside the verify call, 3 a rollback the
// device rings cannot take refused, 4 a rebuild from outside before the rollback (the state
// dropped), 5 the drill (a fresh session's restore replays through it).
static bool mtp_loop(di_model *m, di_session **ps, mtp_run *r, bool disturb) {
    di_session *s = *ps;
    int32_t n_m = -1;
    // The prompt in two calls (its MTP rows: positions 0 .. N_PROMPT - 2 either way).
    di_forward_out fo = {.mtp_logits = &r->pm[0][0], .n_mtp_out = &n_m};
    const int32_t cut = N_PROMPT / 3;
    if (di_session_forward(s, g_prompt, cut, &fo) != DI_OK || n_m != cut - 1) return false;
    fo = (di_forward_out){
        .logits = r->pl, .last_only = true, .mtp_logits = &r->pm[cut - 1][0], .n_mtp_out = &n_m};
    if (di_session_forward(s, g_prompt + cut, N_PROMPT - cut, &fo) != DI_OK) return false;
    r->n_mtp[0] = n_m; // N_PROMPT - cut: the pending position cut - 1 and the call's rows
    r->anchor[0] = argmax(r->pl);
    r->pos[0] = di_session_n_past(s);
    int32_t guess = argmax(r->pm[N_PROMPT - 2]);
    for (int it = 0; it < M_IT; it++) {
        const int32_t k = mtp_k[it];
        int32_t ver[M_MAX + 1] = {r->anchor[it], guess};
        for (int32_t j = 2; j <= k; j++) ver[j] = (ver[j - 1] * 7 + 3) % V;
        if (disturb && it == 2) di_cpu_backend_lose(lost(m), 6); // inside the verify call
        di_forward_out vo = {
            .logits = &r->vl[it][0][0], .mtp_logits = &r->vm[it][0][0], .n_mtp_out = &n_m};
        if (di_session_forward(s, ver, k + 1, &vo) != DI_OK) return false;
        r->n_mtp[it + 1] = n_m;
        for (int32_t j = 0; j < n_m; j++) r->draft[it][j] = argmax(r->vm[it][j]);
        const int32_t back = mtp_back[it] < 0 ? k : mtp_back[it];
        if (disturb && it == 3) {
            // Past the limits: refused, nothing changed.
            const int32_t p = di_session_n_past(s);
            if (di_session_rollback(s, M_MAX + 1) != DI_ERR_INVALID ||
                di_session_rollback(s, -1) != DI_ERR_INVALID || di_session_n_past(s) != p)
                return false;
        }
        if (disturb && it == 4 && (di_model_dev_rebuild(m) != DI_OK || s->dev)) return false;
        if (di_session_rollback(s, back) != DI_OK) return false;
        r->anchor[it + 1] = argmax(r->vl[it][k - back]);
        r->pos[it + 1] = di_session_n_past(s);
        guess = argmax(r->vm[it][k - back]);   // the MTP row of the last kept position
        if (disturb && (it == 1 || it == 5)) { // a token state into a fresh device session
            if (it == 5) setenv("DI_SESSION_LOSE_DEVICE", "1", 1); // the drill: its replay
            di_session *t = mtp_session(m);
            unsetenv("DI_SESSION_LOSE_DEVICE");
            if (!move_state(ps, t, r->pos[it + 1], it == 5)) return false;
            s = *ps;
        }
    }
    return true;
}

static void test_mtp(bool disturb, const char *name) {
    di_model *m = load(g_dir4, true), *cpu = load(g_dir4, false);
    CHECK(m && cpu && m->dev);
    if (!m || !cpu) goto done;
    mtp_run *ref = calloc(1, sizeof *ref), *r = calloc(1, sizeof *r);
    di_session *c = mtp_session(cpu), *s = mtp_session(m);
    CHECK(c && s && !c->dev_on && s->dev);
    CHECK(mtp_loop(cpu, &c, ref, false));
    CHECK(mtp_loop(m, &s, r, disturb));
    CHECK(s && s->dev_on);
    CHECK(!memcmp(ref->pl, r->pl, sizeof ref->pl));
    CHECK(!memcmp(ref->pm, r->pm, sizeof(float) * V * (N_PROMPT - 1)));
    CHECK(!memcmp(ref->n_mtp, r->n_mtp, sizeof ref->n_mtp));
    CHECK(!memcmp(ref->anchor, r->anchor, sizeof ref->anchor));
    CHECK(!memcmp(ref->pos, r->pos, sizeof ref->pos));
    for (int it = 0; it < M_IT; it++) {
        const size_t n = (size_t)mtp_k[it] + 1;
        CHECK_EQ(ref->n_mtp[it + 1], (int32_t)n);
        CHECK(!memcmp(ref->vl[it], r->vl[it], sizeof(float) * V * n));
        CHECK(!memcmp(ref->vm[it], r->vm[it], sizeof(float) * V * n));
        CHECK(!memcmp(ref->draft[it], r->draft[it], sizeof(int32_t) * n));
    }
    // Both refuse what the rings cannot take back (8 below the highest position fed: taking back
    // 8, feeding 1 and taking back 2 more would reach 9; the CPU rings hold 9, the device's 8, and
    // both sessions count 8), losing nothing: the sessions then continue alike.
    di_session *t = mtp_session(m), *tc = mtp_session(cpu);
    CHECK(t && tc);
    float lt[2][V], lc[2][V], mt[9][V], mc[9][V];
    int32_t tk[140]; // the prompt may be shorter (ASan)
    for (int32_t i = 0; i < 140; i++) tk[i] = (int32_t)((i * 53 + 7) % V);
    di_forward_out ft = {.logits = lt[0], .last_only = true, .mtp_logits = mt[0]};
    di_forward_out fc = {.logits = lc[0], .last_only = true, .mtp_logits = mc[0]};
    for (int i = 0; t && tc && i < 2; i++) {
        CHECK_EQ(di_session_forward(t, tk + 9 * i, 9, &ft), DI_OK);
        CHECK_EQ(di_session_forward(tc, tk + 9 * i, 9, &fc), DI_OK);
        CHECK_EQ(di_session_rollback(t, 8), DI_OK);
        CHECK_EQ(di_session_rollback(tc, 8), DI_OK);
    }
    if (t && tc) {
        CHECK_EQ(di_session_forward(t, tk + 30, 1, &ft), DI_OK);
        CHECK_EQ(di_session_forward(tc, tk + 30, 1, &fc), DI_OK);
        CHECK_EQ(di_session_rollback(t, 2), DI_ERR_INVALID);
        CHECK_EQ(di_session_rollback(tc, 2), DI_ERR_INVALID);
        CHECK_EQ(di_session_n_past(t), 3);
        CHECK_EQ(di_session_n_past(tc), 3);
        CHECK_EQ(di_session_rollback(t, 1), DI_OK);
        CHECK_EQ(di_session_rollback(tc, 1), DI_OK);
        ft.logits = lt[1], fc.logits = lc[1];
        CHECK_EQ(di_session_forward(t, tk + 40, 9, &ft), DI_OK);
        CHECK_EQ(di_session_forward(tc, tk + 40, 9, &fc), DI_OK);
        CHECK(!memcmp(lt, lc, sizeof lt));
        CHECK(!memcmp(mt, mc, sizeof mt));
        CHECK_EQ(di_session_rollback(t, 11), DI_ERR_INVALID); // and the API's limits
        CHECK_EQ(di_session_rollback(t, 9), DI_ERR_INVALID);
#if !defined(__SANITIZE_ADDRESS__) // two 132-token runs: release only
        // 8 rows taken back across the first HCA window's close (position 127) and CSA's.
        di_session_reset(t);
        di_session_reset(tc);
        float l2[2][8][V], m2[2][9][V];
        int32_t n2[2] = {0, 0};
        for (int k = 0; k < 2; k++) {
            di_session *x = k ? tc : t;
            di_forward_out f = {.mtp_logits = m2[k][0], .n_mtp_out = &n2[k]};
            CHECK_EQ(di_session_forward(x, tk, 60, NULL), DI_OK);
            CHECK_EQ(di_session_forward(x, tk + 60, 64, NULL), DI_OK);
            CHECK_EQ(di_session_forward(x, tk + 1, 8, &f), DI_OK); // positions 124 .. 131
            CHECK_EQ(di_session_rollback(x, 8), DI_OK);
            f.logits = l2[k][0];
            CHECK_EQ(di_session_forward(x, tk + 124, 8, &f), DI_OK);
            CHECK_EQ(di_session_n_past(x), 132);
        }
        CHECK_EQ(n2[0], 8);
        CHECK_EQ(n2[1], 8);
        CHECK(!memcmp(l2[0], l2[1], sizeof l2[0]));
        CHECK(!memcmp(m2[0], m2[1], sizeof(float) * 8 * V));
#endif
    }
    fprintf(stderr,
            "%s: %d verify / rollback steps on the device session = the CPU session's "
            "(positions %d .. %d; logits, MTP logits, drafts)%s; a rollback past the rings "
            "refused\n",
            name, M_IT, r->pos[0], r->pos[M_IT],
            disturb ? ", through 2 save / restores, a loss, a rebuild and a drill" : "");
    di_session_destroy(t);
    di_session_destroy(tc);
    di_session_destroy(c);
    di_session_destroy(s);
    free(ref);
    free(r);
done:
    di_model_destroy(m);
    di_model_destroy(cpu);
}

static void test_mtp_v4(void) {
#if defined(__SANITIZE_ADDRESS__)
    test_mtp(false, "(f) V4 MTP"); // the losses' paths are (a)'s
#else
    test_mtp(true, "(f) V4 MTP");
#endif
}

static void test_mtp_deferred(void) {
    test_mtp(false, "(f) V4 MTP, deferred");
}

#if !defined(__SANITIZE_ADDRESS__)
// (f) on two pipeline stages (the MTP block, its ring and the kept streams on the last one, the
// rollback's bookkeeping on both; the second stage's backend lost).
static void test_mtp_stages(void) {
    g_stages = 2;
    test_mtp(true, "(f) V4 MTP, 2 stages");
    g_stages = 1;
}

// (f) in the official recipe (FP8 KV rows in the rings, Q4 index key codes in the entries).
static void test_mtp_official(void) {
    g_prec = DI_PRECISION_OFFICIAL;
    test_mtp(true, "(f) V4 MTP, official recipe");
    g_prec = DI_PRECISION_FP32;
}
#endif

int main(int argc, char **argv) {
    snprintf(g_dir4, sizeof g_dir4, "/tmp/di_test_session_dev4_XXXXXX");
    snprintf(g_dir41, sizeof g_dir41, "/tmp/di_test_session_dev41_XXXXXX");
    snprintf(g_dir41d, sizeof g_dir41d, "/tmp/di_test_session_dev41d_XXXXXX");
    if (!mkdtemp(g_dir4) || !mkdtemp(g_dir41) || !mkdtemp(g_dir41d)) return 1;
    di_synth_config c;
    CHECK(di_synth_preset("tiny-128", &c) == DI_OK);
    c.n_vocab = V;
    CHECK(di_synth_write(&c, g_dir4) == DI_OK);
    CHECK_EQ(di_synth_v41_write(g_dir41, true, false, 43), DI_OK);
    CHECK_EQ(di_synth_v41_write(g_dir41d, true, true, 47), DI_OK);
    for (int t = 0; t < N_PROMPT; t++) g_prompt[t] = (int32_t)((t * 31 + t * t + 3) % V);
    di_set_log_level(1);
    if (argc > 1 && strcmp(argv[1], "--deferred") == 0) {
        // The CPU backends in deferred mode (backend.h di_cpu_backend_set_deferred: work runs at
        // the CUDA stream's sync points only): (f) must give the same bits.
        setenv("DI_CPU_DEFERRED", "1", 1);
        RUN(test_mtp_deferred);
        di_test_remove_dir(g_dir4);
        di_test_remove_dir(g_dir41d);
        di_test_remove_dir(g_dir41);
        return test_finish();
    }
    RUN(test_loss_v4);
    RUN(test_loss_v41);
#if !defined(__SANITIZE_ADDRESS__)
    RUN(test_loss_stages);
#endif
    RUN(test_save_v4);
    RUN(test_save_v41);
    RUN(test_dspark);
    RUN(test_mtp_v4);
#if !defined(__SANITIZE_ADDRESS__)
    RUN(test_mtp_stages);
    RUN(test_mtp_official);
#endif
    di_test_remove_dir(g_dir4);
    di_test_remove_dir(g_dir41d);
    di_test_remove_dir(g_dir41);
    return test_finish();
}
