// Speculative decoding in the engine (engine.c, "speculative decoding"), run twice: with DSpark
// on the V4.1 forward (the V4.1 tiny model, di_synth_v41_write, official layout with DSpark,
// blocks of K = 5 drafts), then with the MTP block on V4's CPU forward (the V4 tiny model,
// official layout with its MTP block: one draft per verify, g_k = 1; the rejected row rolled back
// in the KV manager's blocks). The oracle is the same engine with speculation off (itself checked
// against plain sessions by test_engine_v41.c / test_engine.c): speculation must not change a
// single bit of any output. Where a case below names K, the V4 run has blocks of g_k = 1.
//   (a) DSpark's own drafts, spec_tokens 5, with the default confidence cut and with none: six
//       concurrent requests (greedy, seeded temperature/top-k, top-p + min-p, repetition /
//       presence / frequency penalties, logit bias) on 3 slots with chunked prefill give the
//       tokens, logprobs, top logprobs and first logits of the engine without speculation; the
//       verify counters add up; nothing is allocated inside a step; a slot's tail costs more with
//       DSpark (fewer blocks in the same memory);
//   (b) oracle drafts through the draft hook (engine_internal.h): the true continuation (all
//       accepted: k + 1 tokens per verify), one wrong at draft 3 (2 accepted), all wrong (none
//       accepted): exact outputs, and the verify counters equal those simulated from the
//       policy (k = min(spec_tokens, max_tokens - n_gen - 1)), max_tokens landing inside blocks;
//   (c) (V4.1: MTP drafts have no confidence) the confidence cut: the same oracle drafts with
//   confidences 0.9, 0.9, 0.9, 0.1, 0.9 and a
//       cut of 0.5 verify at most 3 drafts (fewer rows than without a cut) and give the same
//       tokens;
//   (d) stops inside a block: a stop id, a stop string spanning two tokens and EOS (not ignored;
//       a logit bias makes it likely) end a request in the middle of a verified block exactly as
//       without speculation, and the rest of the block is dropped;
//   (e) a request cancelled from its callback in the middle of a block gets exactly the tokens up
//       to the cancelling one; requests reusing the slot are exact;
//   (f) a forward failed (di_engine_fail_forward) while both running requests speculate ends
//       exactly those requests with the error; the others, and later ones in the failed slots,
//       are exact;
//   (g) options: spec_tokens on a V4.1 checkpoint without DSpark or a V4 one without its MTP block
//       is DI_ERR_UNSUPPORTED (MTP speculation on the device-resident forward: test_engine_dev.c
//       (h)); out-of-range spec_tokens / spec_min_confidence are DI_ERR_INVALID; spec_tokens is
//       capped (DSpark's block, MTP's one draft);
//   (h) verifies beyond a one-row token budget, and the synchronous order (DI_ENGINE_SYNC=1):
//       exact, no step allocation;
//   (i) a request with a grammar active from the start (a regex over the real tokenizer) is never
//       drafted for on an engine with speculation, beside one that speculates: both exact, the
//       constraint held;
//   (j) a request whose grammar waits for a trigger token speculates until the trigger: oracle
//       drafts of its unconstrained continuation run past the trigger (their rows, sampled without
//       the grammar, match them), the block is cut at the trigger, no draft is asked for after
//       it, and the output equals the engine's without speculation;
//   (k) under memory pressure (a pool smaller than the requests need at once) speculating
//       sequences are preempted and recomputed: exact, every block back;
//   (l) (V4) the prefix cache on: the six requests twice on one engine with oracle drafts, the
//       second round on cache hits (bounded replay, then verifies): both rounds exact.
// Under ASan the V4 run keeps (a), (b), (k) and (l) (the rest is the engine's, checked by the V4.1
// run): 123 s instead of 203 s on 2 cores.
#include "harness.h"

#include <stdatomic.h>
#include <stdlib.h>
#include <sys/stat.h>

#include "engine/engine_internal.h"
#include "model/synth.h"

enum { V = 512, N_REQ = 6, MAX_GEN = 40, N_TOP = 3, ROWS = 32, N_THREADS = 2, K = 5 };

static char g_root[256], g_dir[300];
static bool g_v4;            // this run: V4 with the MTP block (else V4.1 with DSpark)
static int32_t g_k;          // drafts per verify at most: K (DSpark's block), 1 (MTP)
#include "engine_requests.h" // g_prompt, g_len, result, on_event, same

// ---- requests: engine_requests.h's, with more sampling configurations ----

typedef enum stop_kind { STOP_NONE, STOP_ID, STOP_STRING, STOP_EOS } stop_kind;

static int32_t g_eos;
static char g_stop_str[8];
static int32_t g_stop_id;

static di_request_params spec_request(int i, result *res, stop_kind stop) {
    di_request_params p = request(i, res);
    p.max_tokens = MAX_GEN - 3 * (i % 3); // 40, 37, 34: blocks of 6 end at different points
    di_sample_params *sp = &p.sample;
    static const di_logit_bias bias[2] = {{7, 1.5f}, {300, -2.0f}};
    if (i == 2) { // nucleus + min-p, seeded
        sp->temperature = 1.1f;
        sp->top_p = 0.9f;
        sp->min_p = 0.02f;
        sp->seed = 5;
    } else if (i == 3) { // penalties (their history includes the accepted drafts)
        sp->repetition_penalty = 1.3f;
        sp->presence_penalty = 0.4f;
        sp->frequency_penalty = 0.3f;
    } else if (i == 4) {
        sp->temperature = 0.7f;
        sp->logit_bias = bias;
        sp->n_logit_bias = 2;
        sp->seed = 9;
    }
    if (stop == STOP_ID) {
        p.stop_ids = &g_stop_id;
        p.n_stop_ids = 1;
    } else if (stop == STOP_STRING) {
        static const char *strs[1] = {g_stop_str};
        p.stop_strings = strs;
        p.n_stop_strings = 1;
    } else if (stop == STOP_EOS) { // sampled, EOS made likely: it comes out some tokens in
        static di_logit_bias eos_bias[1];
        eos_bias[0] = (di_logit_bias){g_eos, 3.5f};
        p.ignore_eos = false;
        sp->temperature = 1.0f;
        sp->top_k = 0;
        sp->seed = 1234;
        sp->logit_bias = eos_bias;
        sp->n_logit_bias = 1;
    }
    return p;
}

// Two letters per token (filled by main): stop strings can span tokens.
static char g_bytes[V][2];

static const char *token_bytes(void *user, int32_t id, size_t *n) {
    (void)user;
    *n = 2;
    return g_bytes[id];
}

// ---- the draft hook: oracle drafts ----

typedef enum oracle { ORACLE_OFF, ORACLE_FULL, ORACLE_PART, ORACLE_WRONG } oracle;

static struct {
    oracle mode;
    bool cut_conf;       // confidences 0.9 0.9 0.9 0.1 0.9
    const result *truth; // [N_REQ]: the continuation without stops (ids 1 .. N_REQ)
    atomic_int n_calls;
} g_hook;

static void draft_hook(void *user, uint64_t id, int32_t n_gen, di_draft *d) {
    (void)user;
    atomic_fetch_add(&g_hook.n_calls, 1);
    CHECK(id >= 1);
    if (id < 1) return;
    const result *t = &g_hook.truth[(id - 1) % N_REQ]; // (l) submits the six twice: ids 1..12
    for (int32_t j = 0; j < d->n; j++) {
        const int32_t g = n_gen + j;
        const int32_t tok = g < t->n ? t->tokens[g] : 0;
        if (g_hook.mode == ORACLE_FULL) d->tokens[j] = tok;
        if (g_hook.mode == ORACLE_PART) d->tokens[j] = j == 2 ? (tok + 1) % V : tok;
        if (g_hook.mode == ORACLE_WRONG) d->tokens[j] = (tok + 1) % V;
        d->confidence[j] = g_hook.cut_conf ? (j == 3 ? 0.1f : 0.9f) : 1.0f;
    }
}

// ---- engines ----

static di_engine *engine_opt(int32_t spec, float min_conf, int32_t max_seqs, size_t kv_bytes,
                             bool prefix_cache) {
    di_engine_options o = di_engine_options_default();
    o.n_threads = N_THREADS;
    o.kv_memory_bytes = kv_bytes;
    o.max_seqs = max_seqs;
    o.max_batch_tokens = ROWS;
    o.max_ctx = 256;
    o.spec_tokens = spec;
    o.spec_min_confidence = min_conf;
    o.token_bytes = token_bytes;
    // The prefix cache under speculation: (l) on V4, test_engine_v41_prefix.c (e) on V4.1.
    o.no_prefix_cache = !prefix_cache;
    di_engine *e = NULL;
    CHECK_EQ(di_engine_create(g_dir, &o, &e), DI_OK);
    return e;
}

static di_engine *engine_kv(int32_t spec, float min_conf, int32_t max_seqs, size_t kv_bytes) {
    return engine_opt(spec, min_conf, max_seqs, kv_bytes, false);
}

static di_engine *engine(int32_t spec, float min_conf, int32_t max_seqs) {
    return engine_kv(spec, min_conf, max_seqs, (size_t)64 << 20);
}

// Submits requests [0, n) on a fresh engine (ids 1 .. n) and waits.
static void run_all(di_engine *e, result *res, int n, stop_kind stop) {
    for (int i = 0; i < n; i++) {
        memset(&res[i], 0, sizeof res[i]);
        di_request_params p = spec_request(i, &res[i], stop);
        uint64_t id = 0;
        CHECK_EQ(di_engine_submit(e, &p, &id), DI_OK);
        res[i].id = id;
    }
    di_engine_wait_idle(e);
}

static void check_clean(di_engine *e) {
    di_engine_stats st;
    di_engine_get_stats(e, &st);
    CHECK_EQ(st.n_blocks_free, st.n_blocks_total);
    CHECK_EQ(st.n_step_allocs, 0);
    CHECK_EQ(st.n_preemptions, 0);
    int64_t hist_verifies = 0, hist_accepted = 0;
    for (int j = 0; j <= DI_MAX_SPEC_TOKENS; j++) {
        hist_verifies += st.n_spec_accept_hist[j];
        hist_accepted += j * st.n_spec_accept_hist[j];
    }
    CHECK_EQ(hist_verifies, st.n_spec_verifies);
    CHECK_EQ(hist_accepted, st.n_spec_accepted);
    // One batched forward call per step that ran, its verifies included.
    CHECK_EQ(st.n_forward_calls, st.n_steps - st.n_failed_steps);
    CHECK(st.n_spec_accepted <= st.n_spec_verified && st.n_spec_verified <= st.n_spec_drafted);
}

static result g_off[N_REQ]; // no speculation, no stops: the truth

// The baseline of a configuration: the engine without speculation.
static void baseline(result *res, int n, stop_kind stop) {
    di_engine *e = engine(0, 0, 3);
    if (!e) return;
    run_all(e, res, n, stop);
    di_engine_stats st;
    di_engine_get_stats(e, &st);
    CHECK_EQ(st.n_spec_verifies, 0);
    check_clean(e);
    di_engine_destroy(e);
}

// ---- (a) ----

// V4: the MTP drafts the engine made (the hook records them, unchanged), per request id and n_gen.
static int32_t g_mtp_draft[N_REQ + 1][MAX_GEN];

static void record_hook(void *user, uint64_t id, int32_t n_gen, di_draft *d) {
    (void)user;
    CHECK(id >= 1 && id <= N_REQ && n_gen >= 1 && n_gen < MAX_GEN && d->n == 1);
    if (id >= 1 && id <= N_REQ && n_gen >= 1 && n_gen < MAX_GEN)
        g_mtp_draft[id][n_gen] = d->tokens[0];
}

// Each recorded MTP draft is the argmax of a plain session's MTP logits (di_session_options.mtp)
// fed the request's prompt and output: the draft for output token g (anchor: output token g - 1
// at position P = n_prompt + g - 1) is the MTP block's prediction at position P - 1 (§2.10).
// So the engine's MTP state (run after each step's accept on the kept rows, in prefill chunks,
// beside other sequences) is exactly a session's. Returns the drafts compared.
static int32_t check_mtp_drafts(const result *got) {
    di_model_options mo = di_model_options_default();
    mo.n_threads = N_THREADS;
    di_model *m = NULL;
    CHECK_EQ(di_model_load(g_dir, &mo, &m), DI_OK);
    if (!m) return 0;
    di_session_options so = {.mtp = true};
    float *ml = malloc(sizeof(float) * 256 * V);
    int32_t toks[256], n_cmp = 0, n_bad = 0;
    for (int i = 0; i < N_REQ && ml; i++) {
        di_session *s = NULL;
        CHECK_EQ(di_session_create(m, &so, &s), DI_OK);
        if (!s) break;
        const int32_t n = g_len[i] + got[i].n;
        memcpy(toks, g_prompt[i], sizeof(int32_t) * (size_t)g_len[i]);
        memcpy(toks + g_len[i], got[i].tokens, sizeof(int32_t) * (size_t)got[i].n);
        int32_t n_mtp = 0;
        di_forward_out fo = {.mtp_logits = ml, .n_mtp_out = &n_mtp};
        CHECK_EQ(di_session_forward(s, toks, n, &fo), DI_OK); // MTP rows: positions 0 .. n - 2
        for (int32_t g = 1; g < got[i].n; g++) {
            if (g_mtp_draft[i + 1][g] < 0) continue; // no draft for it (max_tokens reached)
            const float *l = ml + (int64_t)(g_len[i] + g - 2) * V;
            int32_t best = 0;
            for (int32_t t = 1; t < V; t++)
                if (l[t] > l[best]) best = t;
            n_bad += best != g_mtp_draft[i + 1][g];
            n_cmp++;
        }
        di_session_destroy(s);
    }
    CHECK_EQ(n_bad, 0);
    free(ml);
    di_model_destroy(m);
    return n_cmp;
}

static void test_own_drafts(void) {
    const float cuts[2] = {0, -1}; // the default cut, none
    int64_t blocks_off = 0;
    {
        di_engine *e = engine(0, 0, 3);
        di_engine_stats st;
        if (e) {
            di_engine_get_stats(e, &st);
            blocks_off = st.n_blocks_total;
            di_engine_destroy(e);
        }
    }
    for (int c = 0; c < 2; c++) {
        di_engine *e = engine(K, cuts[c], 3);
        if (!e) return;
        memset(g_mtp_draft, 0xff, sizeof g_mtp_draft); // -1: none
        if (g_v4) di_engine_set_draft_hook(e, record_hook, NULL);
        static result got[N_REQ];
        run_all(e, got, N_REQ, STOP_NONE);
        int n_same = 0;
        for (int i = 0; i < N_REQ; i++) {
            n_same += same(&got[i], &g_off[i]);
            CHECK_EQ(got[i].finish, DI_FINISH_LENGTH);
        }
        di_engine_stats st;
        di_engine_get_stats(e, &st);
        const int32_t n_mtp = g_v4 ? check_mtp_drafts(got) : 0;
        fprintf(stderr,
                "(a) %s's drafts, cut %g: %d/%d identical; %lld verifies, %lld drafted, %lld "
                "verified, %lld accepted; %lld steps; %d MTP drafts equal a session's\n",
                g_v4 ? "MTP" : "DSpark", (double)cuts[c], n_same, N_REQ,
                (long long)st.n_spec_verifies, (long long)st.n_spec_drafted,
                (long long)st.n_spec_verified, (long long)st.n_spec_accepted, (long long)st.n_steps,
                n_mtp);
        if (g_v4) CHECK_EQ(n_mtp, st.n_spec_verifies);
        CHECK_EQ(n_same, N_REQ);
        CHECK(st.n_spec_verifies > 0);
        // Verifies of several sequences shared a step, and its one forward call (check_clean).
        CHECK(st.n_spec_verifies > st.n_steps / 2);
        CHECK_EQ(st.n_spec_drafted, (int64_t)g_k * st.n_spec_verifies); // the block size: 5 / 1
        if (c == 1 && g_k > 1) CHECK(st.n_spec_verified > st.n_spec_verifies); // no cut: k > 1
        // A slot's tail holds the DSpark (MTP) rings and scratch too: fewer blocks in the same
        // memory.
        CHECK(st.n_blocks_total < blocks_off);
        check_clean(e);
        di_engine_destroy(e);
    }
}

// ---- (b), (c) ----

typedef struct counts {
    int64_t verifies, verified, accepted, hist[DI_MAX_SPEC_TOKENS + 1];
} counts;

// The verify counters the policy gives when every request runs to max_tokens with confidences
// that pass the cut up to `cut` drafts: the first token comes from the prefill; then each step
// verifies k = min(K, cut, max_tokens - n_gen - 1) drafts (none when k < 1: a plain decode).
static counts simulate(oracle mode, int32_t cut) {
    counts c = {0};
    for (int i = 0; i < N_REQ; i++) {
        const int32_t m = MAX_GEN - 3 * (i % 3);
        for (int32_t n = 1; n < m;) {
            int32_t k = g_k < cut ? g_k : cut;
            if (m - n - 1 < k) k = m - n - 1;
            if (k < 1) {
                n++;
                continue;
            }
            const int32_t acc = mode == ORACLE_FULL ? k : mode == ORACLE_PART ? (k < 2 ? k : 2) : 0;
            c.verifies++, c.verified += k, c.accepted += acc, c.hist[acc]++;
            n += acc + 1;
        }
    }
    return c;
}

static void run_oracle(oracle mode, bool cut_conf, float min_conf, const counts *want,
                       const char *what) {
    di_engine *e = engine(K, min_conf, 3);
    if (!e) return;
    g_hook.mode = mode;
    g_hook.cut_conf = cut_conf;
    g_hook.truth = g_off;
    atomic_store(&g_hook.n_calls, 0);
    di_engine_set_draft_hook(e, draft_hook, NULL);
    static result got[N_REQ];
    run_all(e, got, N_REQ, STOP_NONE);
    int n_same = 0;
    for (int i = 0; i < N_REQ; i++) n_same += same(&got[i], &g_off[i]);
    di_engine_stats st;
    di_engine_get_stats(e, &st);
    fprintf(stderr,
            "(%s) oracle drafts: %d/%d identical; %lld steps, %lld verifies of %lld drafts, "
            "%lld accepted (simulated %lld, %lld, %lld): %.2f tokens per verify\n",
            what, n_same, N_REQ, (long long)st.n_steps, (long long)st.n_spec_verifies,
            (long long)st.n_spec_verified, (long long)st.n_spec_accepted, (long long)want->verifies,
            (long long)want->verified, (long long)want->accepted,
            st.n_spec_verifies
                ? (double)(st.n_spec_verifies + st.n_spec_accepted) / (double)st.n_spec_verifies
                : 0.0);
    CHECK_EQ(n_same, N_REQ);
    CHECK_EQ(st.n_spec_verifies, want->verifies);
    CHECK_EQ(st.n_spec_verified, want->verified);
    CHECK_EQ(st.n_spec_accepted, want->accepted);
    CHECK(!memcmp(st.n_spec_accept_hist, want->hist, sizeof want->hist));
    CHECK_EQ(atomic_load(&g_hook.n_calls), want->verifies);
    CHECK(st.n_plans_ahead > 0); // the plans built ahead were corrected for the accepted drafts
    check_clean(e);
    di_engine_destroy(e);
}

static void test_oracle(void) {
    counts full = simulate(ORACLE_FULL, K), part = simulate(ORACLE_PART, K),
           wrong = simulate(ORACLE_WRONG, K);
    run_oracle(ORACLE_FULL, false, -1, &full, "b full");
    CHECK(full.hist[g_k] > 0 && full.accepted == full.verified); // K + 1 tokens per full verify
    run_oracle(ORACLE_PART, false, -1, &part, "b part");
    run_oracle(ORACLE_WRONG, false, -1, &wrong, "b wrong");
    if (g_v4) return; // (c): MTP drafts carry no confidence, the cut does not apply
    // (c) The cut: survival 0.9, 0.81, 0.729, then 0.073 < 0.5: three drafts per verify.
    counts cut = simulate(ORACLE_FULL, 3);
    CHECK(cut.verified < full.verified);
    run_oracle(ORACLE_FULL, true, 0.5f, &cut, "c cut 0.5");
    // A cut below every survival verifies all K, as none does.
    run_oracle(ORACLE_FULL, true, 0.01f, &full, "c cut 0.01");
}

// ---- (d) ----

static void test_stops(void) {
    static result off[N_REQ], got[N_REQ];
    // A stop id: request 0's 4th token, which the oracle's first block (tokens 1..6) holds in its
    // middle; a stop string: the second letter of token 8 and the first of token 9 (block 7..12).
    g_stop_id = g_off[0].tokens[3];
    const char *b8, *b9;
    size_t n;
    b8 = token_bytes(NULL, g_off[0].tokens[8], &n);
    g_stop_str[0] = b8[1];
    b9 = token_bytes(NULL, g_off[0].tokens[9], &n);
    g_stop_str[1] = b9[0];
    g_stop_str[2] = 0;
    const stop_kind kinds[3] = {STOP_ID, STOP_STRING, STOP_EOS};
    const char *names[3] = {"stop id", "stop string", "EOS"};
    for (int s = 0; s < 3; s++) {
        baseline(off, N_REQ, kinds[s]);
        // The truth of the oracle: the same requests with nothing stopping them.
        static result truth[N_REQ];
        if (kinds[s] == STOP_EOS) { // the same sampling, EOS ignored
            di_engine *e = engine(0, 0, 3);
            if (!e) return;
            for (int i = 0; i < N_REQ; i++) {
                memset(&truth[i], 0, sizeof truth[i]);
                di_request_params p = spec_request(i, &truth[i], STOP_EOS);
                p.ignore_eos = true;
                uint64_t id;
                CHECK_EQ(di_engine_submit(e, &p, &id), DI_OK);
            }
            di_engine_wait_idle(e);
            di_engine_destroy(e);
        } else {
            memcpy(truth, g_off, sizeof truth);
        }
        di_engine *e = engine(K, -1, 3);
        if (!e) return;
        g_hook.mode = ORACLE_FULL;
        g_hook.cut_conf = false;
        g_hook.truth = truth;
        di_engine_set_draft_hook(e, draft_hook, NULL);
        run_all(e, got, N_REQ, kinds[s]);
        int n_same = 0, n_stopped = 0, n_mid = 0;
        for (int i = 0; i < N_REQ; i++) {
            n_same += same(&got[i], &off[i]) && got[i].finish == off[i].finish;
            if (off[i].finish != DI_FINISH_STOP) continue;
            n_stopped++;
            // Oracle blocks cover tokens 1..6, 7..12, ...: a stop at index t is mid-block unless
            // t is a block's last token (and the truth goes on after it).
            const int32_t t = off[i].n - 1;
            n_mid += t >= 1 && t % (g_k + 1) != 0 && truth[i].n > t + 1;
        }
        fprintf(stderr, "(d) %s: %d/%d identical, %d stopped, %d of them inside a block\n",
                names[s], n_same, N_REQ, n_stopped, n_mid);
        CHECK_EQ(n_same, N_REQ);
        CHECK(n_mid >= 1);
        di_engine_stats st;
        di_engine_get_stats(e, &st);
        CHECK(st.n_spec_accepted > 0);
        check_clean(e);
        di_engine_destroy(e);
    }
}

// ---- (e) ----

static void test_cancel(void) {
    di_engine *e = engine(K, -1, 2);
    if (!e) return;
    g_hook.mode = ORACLE_FULL;
    g_hook.cut_conf = false;
    g_hook.truth = g_off;
    di_engine_set_draft_hook(e, draft_hook, NULL);
    static result got[N_REQ];
    // 0 and 1 are cancelled from the callback of their 4th and 9th tokens (inside the blocks
    // 1..6 and 7..12); 2 and 3 wait for their slots, 4 and 5 come after.
    for (int i = 0; i < 4; i++) {
        memset(&got[i], 0, sizeof got[i]);
        di_request_params p = spec_request(i, &got[i], STOP_NONE);
        if (i < 2) {
            got[i].cancel_engine = e;
            got[i].cancel_after = 4 + 5 * i;
        }
        uint64_t id;
        CHECK_EQ(di_engine_submit(e, &p, &id), DI_OK);
    }
    di_engine_wait_idle(e);
    for (int i = 0; i < 2; i++) {
        CHECK_EQ(got[i].finish, DI_FINISH_CANCELLED);
        CHECK_EQ(got[i].n, 4 + 5 * i); // the block stops at the cancelling token
        CHECK(!memcmp(got[i].tokens, g_off[i].tokens, sizeof(int32_t) * (size_t)got[i].n));
    }
    for (int i = 2; i < 4; i++) CHECK(same(&got[i], &g_off[i]));
    di_engine_set_draft_hook(e, NULL, NULL); // DSpark's own drafts for the last two
    for (int i = 4; i < N_REQ; i++) {
        memset(&got[i], 0, sizeof got[i]);
        di_request_params p = spec_request(i, &got[i], STOP_NONE);
        uint64_t id;
        CHECK_EQ(di_engine_submit(e, &p, &id), DI_OK);
    }
    di_engine_wait_idle(e);
    for (int i = 4; i < N_REQ; i++) CHECK(same(&got[i], &g_off[i]));
    fprintf(stderr, "(e) cancelled inside blocks after %d and %d tokens; 4 others identical\n",
            got[0].n, got[1].n);
    check_clean(e);
    di_engine_destroy(e);
}

// ---- (f) ----

static void test_failure(void) {
    di_engine *e = engine(K, -1, 2);
    if (!e) return;
    g_hook.mode = ORACLE_FULL;
    g_hook.cut_conf = false;
    g_hook.truth = g_off;
    di_engine_set_draft_hook(e, draft_hook, NULL);
    static result got[N_REQ];
    // Request 0's 150-token prompt takes forwards 1-5 (32 rows each), request 1 (5 tokens) joins
    // in the 5th; from the 6th on both verify oracle blocks; the 8th fails.
    di_engine_fail_forward(e, 7, 1, DI_ERR_NOMEM);
    for (int i = 0; i < 4; i++) {
        memset(&got[i], 0, sizeof got[i]);
        di_request_params p = spec_request(i, &got[i], STOP_NONE);
        uint64_t id;
        CHECK_EQ(di_engine_submit(e, &p, &id), DI_OK);
    }
    di_engine_wait_idle(e);
    di_engine_stats st;
    di_engine_get_stats(e, &st);
    CHECK(st.n_spec_accepted > 0); // it failed after blocks were accepted
    for (int i = 0; i < 2; i++) {
        CHECK_EQ(got[i].finish, DI_FINISH_ERROR);
        CHECK_EQ(got[i].status, DI_ERR_NOMEM);
        CHECK(got[i].n > 1 && got[i].n < g_off[i].n);
        CHECK(!memcmp(got[i].tokens, g_off[i].tokens, sizeof(int32_t) * (size_t)got[i].n));
    }
    for (int i = 2; i < 4; i++) CHECK(same(&got[i], &g_off[i]));
    for (int i = 4; i < N_REQ; i++) { // into the failed slots, from position 0
        memset(&got[i], 0, sizeof got[i]);
        di_request_params p = spec_request(i, &got[i], STOP_NONE);
        uint64_t id;
        CHECK_EQ(di_engine_submit(e, &p, &id), DI_OK);
    }
    di_engine_wait_idle(e);
    for (int i = 4; i < N_REQ; i++) CHECK(same(&got[i], &g_off[i]));
    di_engine_get_stats(e, &st);
    fprintf(stderr,
            "(f) failed forward 8: requests 0 (%d tokens) and 1 (%d tokens) ended with %s; the "
            "4 others identical\n",
            got[0].n, got[1].n, di_status_str(got[0].status));
    CHECK_EQ(st.n_failed_steps, 1);
    check_clean(e);
    di_engine_destroy(e);
}

// ---- (g) ----

static void test_options(void) {
    char dir[320];
    di_engine_options o = di_engine_options_default();
    o.n_threads = N_THREADS;
    o.max_ctx = 256;
    o.spec_tokens = 3;
    di_engine *e = NULL;
    if (g_v4) { // a V4 checkpoint without its MTP block
        snprintf(dir, sizeof dir, "%s/v4-no-mtp", g_root);
        mkdir(dir, 0755);
        di_synth_config c;
        CHECK_EQ(di_synth_preset("tiny", &c), DI_OK);
        c.n_vocab = V;
        c.n_mtp = 0;
        CHECK_EQ(di_synth_write(&c, dir), DI_OK);
    } else {
        snprintf(dir, sizeof dir, "%s/v41-no-dspark", g_root);
        mkdir(dir, 0755);
        CHECK_EQ(di_synth_v41_write(dir, true, false, 41), DI_OK);
    }
    CHECK_EQ(di_engine_create(dir, &o, &e), DI_ERR_UNSUPPORTED);
    o.spec_tokens = DI_MAX_SPEC_TOKENS + 1;
    CHECK_EQ(di_engine_create(g_dir, &o, &e), DI_ERR_INVALID);
    o.spec_tokens = -1;
    CHECK_EQ(di_engine_create(g_dir, &o, &e), DI_ERR_INVALID);
    o.spec_tokens = 2;
    o.spec_min_confidence = 1.5f;
    CHECK_EQ(di_engine_create(g_dir, &o, &e), DI_ERR_INVALID);
    CHECK(e == NULL);
    o.spec_min_confidence = 0;
    o.spec_tokens = DI_MAX_SPEC_TOKENS; // capped at the block size (5), at MTP's one draft
    CHECK_EQ(di_engine_create(g_dir, &o, &e), DI_OK);
    di_engine_destroy(e);
}

// ---- (h) ----

// One request with oracle drafts on an engine of one slot and a token budget of one row (every
// verify of 6 rows is beyond the budget: the sessions are reserved for it), and six on an engine
// that plans each step after the previous one (DI_ENGINE_SYNC=1: no plan to correct): exact, no
// allocation in a step.
static void test_budget_and_sync(void) {
    di_engine_options o = di_engine_options_default();
    o.n_threads = N_THREADS;
    o.kv_memory_bytes = (size_t)64 << 20;
    o.max_seqs = 1;
    o.max_batch_tokens = 1;
    o.max_ctx = 256;
    o.spec_tokens = K;
    o.spec_min_confidence = -1;
    di_engine *e = NULL;
    CHECK_EQ(di_engine_create(g_dir, &o, &e), DI_OK);
    if (!e) return;
    g_hook.mode = ORACLE_FULL;
    g_hook.cut_conf = false;
    g_hook.truth = g_off;
    di_engine_set_draft_hook(e, draft_hook, NULL);
    static result got[N_REQ];
    run_all(e, got, 2, STOP_NONE); // ids 1, 2: requests 0 and 1, one after the other
    const bool budget_same = same(&got[0], &g_off[0]) && same(&got[1], &g_off[1]);
    CHECK(budget_same);
    di_engine_stats st;
    di_engine_get_stats(e, &st);
    CHECK(st.n_spec_accepted > 0);
    check_clean(e);
    di_engine_destroy(e);
    setenv("DI_ENGINE_SYNC", "1", 1);
    e = engine(K, -1, 3);
    unsetenv("DI_ENGINE_SYNC");
    if (!e) return;
    di_engine_set_draft_hook(e, draft_hook, NULL);
    run_all(e, got, N_REQ, STOP_NONE);
    int n_same = 0;
    for (int i = 0; i < N_REQ; i++) n_same += same(&got[i], &g_off[i]);
    di_engine_get_stats(e, &st);
    fprintf(stderr,
            "(h) one-row budget: 2/2 requests %s; DI_ENGINE_SYNC=1: %d/%d identical, %lld plans "
            "ahead, %lld accepted\n",
            budget_same ? "identical" : "DIFFERENT", n_same, N_REQ, (long long)st.n_plans_ahead,
            (long long)st.n_spec_accepted);
    CHECK_EQ(n_same, N_REQ);
    CHECK_EQ(st.n_plans_ahead, 0);
    CHECK(st.n_spec_accepted > 0);
    check_clean(e);
    di_engine_destroy(e);
}

// The tiny config's DSpark block is 2 drafts (spec §7.2); the released model's is 5. Nothing in
// the DSpark weights depends on it (the block is its rows), so the test model's config.json
// says 5: verifies of up to 5 drafts, blocks of up to 6 tokens.
static bool set_block_size_5(const char *dir) {
    char path[400];
    snprintf(path, sizeof path, "%s/config.json", dir);
    FILE *f = fopen(path, "rb");
    if (!f) return false;
    static char buf[1 << 16];
    size_t n = fread(buf, 1, sizeof buf - 1, f);
    fclose(f);
    buf[n] = 0;
    char *at = strstr(buf, "\"dspark_block_size\": 2,");
    if (!at) return false;
    at[strlen("\"dspark_block_size\": ")] = '5';
    f = fopen(path, "wb");
    if (!f) return false;
    bool ok = fwrite(buf, 1, n, f) == n;
    return fclose(f) == 0 && ok;
}

// ---- (i) a request with a grammar does not speculate ----

static atomic_int g_drafts_for[N_REQ + 1]; // draft blocks the hook saw, per request id

static void count_hook(void *user, uint64_t id, int32_t n_gen, di_draft *d) {
    (void)user, (void)n_gen, (void)d;
    if (id <= N_REQ) atomic_fetch_add(&g_drafts_for[id], 1);
}

// Its matcher advances one sampled token at a time, so on an engine with speculation it decodes
// plainly beside a speculating request, and both give the tokens they give without speculation.
static void test_grammar_no_spec(void) {
    di_tokenizer *tok = NULL;
    di_grammar_vocab *gv = NULL;
    di_grammar *g = NULL;
    char err[256] = "";
    static const char re[] = "[a-z]{1,60}";
    CHECK_EQ(di_tokenizer_load_for_model(NULL, &tok), DI_OK);
    if (tok) CHECK_EQ(di_grammar_vocab_create(tok, &gv), DI_OK);
    CHECK_EQ(di_grammar_compile(DI_GRAMMAR_KIND_REGEX, re, strlen(re), 0, &g, err, sizeof err),
             DI_OK);
    result res[2][2]; // [speculation off, on][the constrained request, a plain one]
    for (int on = 0; gv && g && on < 2; on++) {
        di_engine_options o = di_engine_options_default();
        o.n_threads = N_THREADS;
        o.kv_memory_bytes = (size_t)64 << 20;
        o.max_seqs = 2;
        o.max_batch_tokens = ROWS;
        o.max_ctx = 256;
        o.spec_tokens = on ? K : 0;
        o.spec_min_confidence = -1; // no cut: every verify feeds K drafts
        o.token_bytes = token_bytes;
        o.grammar_vocab = gv;
        di_engine *e = NULL;
        CHECK_EQ(di_engine_create(g_dir, &o, &e), DI_OK);
        if (!e) break;
        di_engine_set_draft_hook(e, count_hook, NULL);
        for (int i = 0; i <= N_REQ; i++) atomic_store(&g_drafts_for[i], 0);
        for (int j = 0; j < 2; j++) {
            memset(&res[on][j], 0, sizeof res[on][j]);
            di_request_params p = request(j, &res[on][j]);
            if (j == 0) p.grammar = g;
            uint64_t id = 0;
            CHECK_EQ(di_engine_submit(e, &p, &id), DI_OK);
            res[on][j].id = id;
        }
        di_engine_wait_idle(e);
        di_engine_stats st;
        di_engine_get_stats(e, &st);
        CHECK_EQ(st.n_step_allocs, 0);
        CHECK_EQ(atomic_load(&g_drafts_for[res[on][0].id]), 0); // never drafted for
        if (on) {
            CHECK(atomic_load(&g_drafts_for[res[on][1].id]) > 0);
            CHECK(st.n_spec_verifies > 0);
        }
        di_engine_destroy(e);
    }
    if (gv && g) {
        CHECK(same(&res[0][0], &res[1][0]));
        CHECK(same(&res[0][1], &res[1][1]));
        CHECK(res[0][0].n > 0);
        for (int32_t t = 0; t < res[0][0].n; t++) { // the constraint held: letters only
            size_t nb = 0;
            const char *b = di_tokenizer_token_bytes(tok, res[0][0].tokens[t], &nb);
            CHECK(b && nb > 0);
            for (size_t k = 0; b && k < nb; k++) CHECK(b[k] >= 'a' && b[k] <= 'z');
        }
    }
    di_grammar_destroy(g);
    di_grammar_vocab_destroy(gv);
    di_tokenizer_destroy(tok);
}

// ---- (j) a grammar that waits for a trigger token: speculation up to the trigger ----

static struct {
    const result *truth; // the request's continuation without a grammar
    uint64_t id;         // the request the hook drafts for
    atomic_int n_calls, max_n_gen;
} g_trig;

static void trigger_hook(void *user, uint64_t id, int32_t n_gen, di_draft *d) {
    (void)user;
    if (id != g_trig.id) return;
    atomic_fetch_add(&g_trig.n_calls, 1);
    if (n_gen > atomic_load(&g_trig.max_n_gen)) atomic_store(&g_trig.max_n_gen, n_gen);
    for (int32_t j = 0; j < d->n; j++) {
        const int32_t g = n_gen + j;
        d->tokens[j] = g < g_trig.truth->n ? g_trig.truth->tokens[g] : 0;
        d->confidence[j] = 1.0f;
    }
}

static void test_grammar_after_spec(void) {
    di_tokenizer *tok = NULL;
    di_grammar_vocab *gv = NULL;
    di_grammar *g = NULL;
    char err[256] = "";
    static const char re[] = "[a-z]{1,60}";
    CHECK_EQ(di_tokenizer_load_for_model(NULL, &tok), DI_OK);
    if (tok) CHECK_EQ(di_grammar_vocab_create(tok, &gv), DI_OK);
    CHECK_EQ(di_grammar_compile(DI_GRAMMAR_KIND_REGEX, re, strlen(re), 0, &g, err, sizeof err),
             DI_OK);
    static result plain, res[2]; // without a grammar; [speculation off, on] with it
    int32_t t0 = -1;             // where the trigger comes out: the first new id from index 2
    for (int run = -1; gv && g && run < 2; run++) {
        di_engine_options o = di_engine_options_default();
        o.n_threads = N_THREADS;
        o.kv_memory_bytes = (size_t)64 << 20;
        o.max_seqs = 1;
        o.max_batch_tokens = ROWS;
        o.max_ctx = 256;
        o.spec_tokens = run == 1 ? K : 0;
        o.spec_min_confidence = -1;
        o.token_bytes = token_bytes;
        o.grammar_vocab = gv;
        di_engine *e = NULL;
        CHECK_EQ(di_engine_create(g_dir, &o, &e), DI_OK);
        if (!e) break;
        di_engine_set_draft_hook(e, trigger_hook, NULL);
        result *out = run < 0 ? &plain : &res[run];
        memset(out, 0, sizeof *out);
        di_request_params p = request(0, out); // greedy
        if (run >= 0) {
            p.grammar = g;
            p.grammar_after = plain.tokens[t0];
        }
        g_trig.truth = &plain;
        atomic_store(&g_trig.n_calls, 0);
        atomic_store(&g_trig.max_n_gen, -1);
        CHECK_EQ(di_engine_submit(e, &p, &g_trig.id), DI_OK);
        di_engine_wait_idle(e);
        di_engine_stats st;
        di_engine_get_stats(e, &st);
        CHECK_EQ(st.n_step_allocs, 0);
        if (run < 0) {
            for (int32_t t = 2; t0 < 0 && t < plain.n; t++) {
                bool seen = false;
                for (int32_t u = 0; u < t; u++) seen |= plain.tokens[u] == plain.tokens[t];
                if (!seen) t0 = t;
            }
            CHECK(t0 >= 2 && t0 + 2 < plain.n);
            if (t0 < 0) break;
        }
        if (run == 1) {
            CHECK(atomic_load(&g_trig.n_calls) > 0);     // it speculated before the trigger
            CHECK(atomic_load(&g_trig.max_n_gen) <= t0); // and never after it
            CHECK(st.n_spec_verifies > 0);
            // The first block (drafts from n_gen 1) covers the trigger with rows after it (V4.1;
            // an MTP verify has one draft: its block ends at the trigger, or the trigger is its
            // draft and the bonus row after it goes).
            if (g_k > 1) CHECK(t0 < 1 + K);
        }
        di_engine_destroy(e);
    }
    if (gv && g && t0 >= 0) {
        CHECK(same(&res[0], &res[1]));
        // Up to the trigger the output is the unconstrained one; after it the grammar held
        // (letters only), so it differs from the unconstrained continuation.
        CHECK(res[0].n > t0 + 1 &&
              !memcmp(res[0].tokens, plain.tokens, sizeof(int32_t) * (t0 + 1)));
        bool differs = false;
        for (int32_t t = t0 + 1; t < res[0].n; t++) {
            differs |= t < plain.n && res[0].tokens[t] != plain.tokens[t];
            size_t nb = 0;
            const char *b = di_tokenizer_token_bytes(tok, res[0].tokens[t], &nb);
            CHECK(b && nb > 0);
            for (size_t k = 0; b && k < nb; k++) CHECK(b[k] >= 'a' && b[k] <= 'z');
        }
        CHECK(differs);
    }
    di_grammar_destroy(g);
    di_grammar_vocab_destroy(gv);
    di_tokenizer_destroy(tok);
}

// ---- (k) ----

static void test_preempted(void) {
    // 3 slot tails and a pool too small for the 6 requests at once: sequences that verify drafts
    // (and roll rejected rows back) are preempted and recomputed. V4.1: 100 KiB (20 blocks of
    // packed pages). V4: 3 MTP rings of 24 rows of 128 floats (36 KiB) and 40 blocks of 16 KiB (a
    // sequence: 16 tail blocks and one per 16 positions; one of max_ctx 256 needs 32).
    di_engine *e = engine_kv(K, -1, 3, g_v4 ? (36u + 40u * 16u) << 10 : (size_t)100 << 10);
    if (!e) return;
    static result got[N_REQ];
    run_all(e, got, N_REQ, STOP_NONE);
    int n_same = 0;
    for (int i = 0; i < N_REQ; i++) n_same += same(&got[i], &g_off[i]);
    di_engine_stats st;
    di_engine_get_stats(e, &st);
    fprintf(stderr,
            "(k) under memory pressure (%lld blocks): %d/%d identical; %lld preemptions, %lld "
            "verifies, %lld drafts verified\n",
            (long long)st.n_blocks_total, n_same, N_REQ, (long long)st.n_preemptions,
            (long long)st.n_spec_verifies, (long long)st.n_spec_verified);
    CHECK_EQ(n_same, N_REQ);
    CHECK(st.n_preemptions > 0);
    CHECK(st.n_spec_verifies > 0 && (g_k == 1 || st.n_spec_verified > st.n_spec_verifies));
    CHECK_EQ(st.n_blocks_free, st.n_blocks_total);
    CHECK_EQ(st.n_step_allocs, 0);
    di_engine_destroy(e);
}

// ---- (l) ----

static void test_prefix_cache(void) {
    di_engine *e = engine_opt(K, -1, 3, (size_t)64 << 20, true);
    if (!e) return;
    g_hook.mode = ORACLE_FULL;
    g_hook.cut_conf = false;
    g_hook.truth = g_off;
    di_engine_set_draft_hook(e, draft_hook, NULL);
    static result got[2][N_REQ];
    int n_same = 0, n_hit = 0;
    for (int round = 0; round < 2; round++) {
        run_all(e, got[round], N_REQ, STOP_NONE); // ids 1..6, then 7..12: the hook maps both
        for (int i = 0; i < N_REQ; i++) {
            n_same += same(&got[round][i], &g_off[i]);
            n_hit += round == 1 && got[round][i].n_cached > 0;
        }
    }
    di_engine_stats st;
    di_engine_get_stats(e, &st);
    fprintf(stderr,
            "(l) prefix cache: %d/%d identical, %d of the second round's requests hit (%d "
            "positions cached for request 0); %lld accepted\n",
            n_same, 2 * N_REQ, n_hit, got[1][0].n_cached, (long long)st.n_spec_accepted);
    CHECK_EQ(n_same, 2 * N_REQ);
    CHECK(n_hit >= N_REQ - 1); // every prompt of 16 tokens or more
    CHECK(st.n_spec_accepted > 0);
    CHECK_EQ(st.n_step_allocs, 0);
    di_engine_destroy(e);
}

// One run of the suite on the checkpoint in g_dir (g_v4, g_k set).
// Under AddressSanitizer (CI's sanitized stage) the V4 run is a memory check of what is V4's own
// (its MTP drafts, oracle verifies, preemption and the prefix cache): the stop, cancel, failure,
// option, budget and grammar paths of speculation are the engine's, the same for both drafters,
// and the V4.1 run checks them under ASan.
#if defined(__SANITIZE_ADDRESS__)
enum { V4_ALL = 0 };
#else
enum { V4_ALL = 1 };
#endif

static void run_suite(void) {
    di_model_options mo = di_model_options_default();
    mo.n_threads = N_THREADS;
    di_model *m = NULL;
    CHECK_EQ(di_model_load(g_dir, &mo, &m), DI_OK);
    if (m) {
        di_model_info info;
        di_model_get_info(m, &info);
        g_eos = info.eos_token_id;
        di_model_destroy(m);
    }
    fprintf(stderr, "---- %s ----\n", g_v4 ? "V4 with the MTP block" : "V4.1 with DSpark");
    baseline(g_off, N_REQ, STOP_NONE);
    for (int i = 0; i < N_REQ; i++) CHECK_EQ(g_off[i].n, MAX_GEN - 3 * (i % 3));
    test_own_drafts();
    test_oracle();
    const bool all = !g_v4 || V4_ALL;
    if (all) test_stops();
    if (all) test_cancel();
    if (all) test_failure();
    if (all) test_options();
    if (all) test_budget_and_sync();
    if (all) test_grammar_no_spec();
    if (all) test_grammar_after_spec();
    test_preempted();
    if (g_v4) test_prefix_cache();
}

int main(void) {
    snprintf(g_root, sizeof g_root, "/tmp/di_test_engine_spec_XXXXXX");
    if (!mkdtemp(g_root)) return 1;
    for (int i = 0; i < N_REQ; i++)
        for (int t = 0; t < g_len[i]; t++) g_prompt[i][t] = (int32_t)((t * 31 + i * 97 + 11) % V);
    for (int i = 0; i < V; i++) {
        g_bytes[i][0] = (char)('a' + i % 26);
        g_bytes[i][1] = (char)('a' + (i / 26) % 26);
    }
    (void)run; // engine_requests.h's submitter: this test submits spec_request's variants
    di_set_log_level(1);
    snprintf(g_dir, sizeof g_dir, "%s/v41-tiny", g_root);
    mkdir(g_dir, 0755);
    CHECK_EQ(di_synth_v41_write(g_dir, true, true, 41), DI_OK);
    CHECK(set_block_size_5(g_dir));
    g_v4 = false, g_k = K;
    run_suite();
    snprintf(g_dir, sizeof g_dir, "%s/v4-tiny", g_root);
    mkdir(g_dir, 0755);
    di_synth_config c;
    CHECK_EQ(di_synth_preset("tiny", &c), DI_OK);
    c.n_vocab = V; // the official layout: with its MTP block
    CHECK_EQ(di_synth_write(&c, g_dir), DI_OK);
    g_v4 = true, g_k = 1;
    run_suite();
    di_test_remove_dir(g_root);
    return test_finish();
}
