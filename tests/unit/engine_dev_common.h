/*
 * engine_dev_common — the harness shared by the tests of the serving engine on a device-resident
 * forward run on the CPU backend (its oracle twin): test_engine_dev.c (V4, model/dsv4_dev.h) and
 * test_engine_dev41.c (V4.1, model/dsv41_dev.h). Both compare the engine on the twin with the
 * engine's own CPU forward on the tiny model bit for bit; what differs between them is only how
 * the twin is attached (the includer's attach_cpu_twin) and the model. Here: the engine options
 * both use, engine creation on either forward, the end-of-run checks, a prompt run alone, the
 * shared-prefix prompts and their run, and the injected-failure scenario (b).
 *
 * Header-only (static), included after engine_requests.h; the includer defines first g_dir (the
 * model directory), attach_cpu_twin (a di_engine_create_prepared hook attaching the twin to the
 * CPU backend passed as user) and g_ref (the CPU engine's results of the request set, filled by
 * its scenario (a) before test_failure runs).
 */
#pragma once

#include <stdatomic.h>
#include <string.h>

#include "backend/backend.h"
#include "engine/engine_internal.h"

// Two threads, max_seqs slots, 32 rows per step (chunked prefill), max_ctx MAX_CTX, the prefix
// cache on and tail snapshots off on both forwards (the CPU engine then replays as the
// device-resident one does; the tests that want snapshots turn them on).
static di_engine_options options(size_t kv_bytes, int32_t max_seqs) {
    di_engine_options o = di_engine_options_default();
    o.n_threads = 2;
    o.kv_memory_bytes = kv_bytes;
    o.max_seqs = max_seqs;
    o.max_batch_tokens = 32;
    o.max_ctx = MAX_CTX;
    o.no_prefix_cache = false;
    o.no_tail_cache = true;
    return o;
}

// b: the engine runs the device-resident forward on CPU backend b (borrowed: destroy it after
// the engine); NULL: the engine's CPU forward.
static di_engine *engine_o(const di_engine_options *o, di_backend *b) {
    di_engine *e = NULL;
    if (b)
        CHECK_EQ(di_engine_create_prepared(g_dir, o, attach_cpu_twin, b, &e), DI_OK);
    else
        CHECK_EQ(di_engine_create(g_dir, o, &e), DI_OK);
    return e;
}

static di_engine *engine(size_t kv_bytes, int32_t max_seqs, di_backend *b) {
    di_engine_options o = options(kv_bytes, max_seqs);
    return engine_o(&o, b);
}

// After a run: every block back, nothing allocated inside a step, the forward resident or not as
// `dev` says; on the device-resident forward decode steps ran from the graphs prepared at create
// (one per batch size up to max_seqs, at least 2 here) and no step captured one.
static void check_clean(di_engine *e, bool dev) {
    di_engine_stats st;
    di_engine_get_stats(e, &st);
    CHECK_EQ(st.n_blocks_free, st.n_blocks_total);
    CHECK_EQ(st.n_step_allocs, 0);
    CHECK_EQ(st.device.resident, dev);
    di_dsv4_dev_graph_stats gs;
    di_engine_get_graph_stats(e, &gs);
    if (dev) {
        CHECK_EQ(gs.n_captured, gs.n_cached);
        CHECK(gs.n_cached >= 2);
        CHECK(gs.n_replayed > 0);
        CHECK(di_engine_dev_state_bytes(e) > 0);
    } else {
        CHECK_EQ(gs.n_cached + gs.n_replayed, 0);
        CHECK_EQ(di_engine_dev_state_bytes(e), 0);
    }
}

// Runs prompt[0, n) with request i's parameters alone to completion into *r.
static void run_alone(di_engine *e, int i, const int32_t *prompt, int32_t n, result *r) {
    memset(r, 0, sizeof *r);
    di_request_params p = request(i, r);
    p.prompt = prompt;
    p.n_prompt = n;
    uint64_t id;
    CHECK_EQ(di_engine_submit(e, &p, &id), DI_OK);
    di_engine_wait_idle(e);
}

// The shared-prefix prompts: D_REQ prompts whose first D_PREFIX tokens are one and the same, then
// their own; request i's is D_PREFIX + 3 + i tokens long.
enum { D_PREFIX = 300, D_REQ = 4 };
static int32_t g_dprompt[D_REQ][D_PREFIX + 10];

static void fill_dprompt(void) {
    for (int i = 0; i < D_REQ; i++)
        for (int t = 0; t < D_PREFIX + 10; t++)
            g_dprompt[i][t] = (int32_t)((t < D_PREFIX ? t * 13 + 5 : t * 7 + i * 59) % V);
}

// The first shared-prefix request alone, then the rest together.
static void run_shared(di_engine *e, result *res) {
    for (int i = 0; i < D_REQ; i++) {
        memset(&res[i], 0, sizeof res[i]);
        di_request_params p = request(i, &res[i]);
        p.prompt = g_dprompt[i];
        p.n_prompt = D_PREFIX + 3 + i;
        uint64_t id;
        CHECK_EQ(di_engine_submit(e, &p, &id), DI_OK);
        if (i == 0) di_engine_wait_idle(e);
    }
    di_engine_wait_idle(e);
}

// (b) A forward failure injected mid-run ends exactly the requests of that step with
// DI_FINISH_ERROR / DI_ERR_CUDA; the others, and requests submitted afterwards into the failed
// slots (from position 0), give the CPU engine's tokens (g_ref).
static void test_failure(void) {
    di_backend *b = NULL;
    CHECK_EQ(di_cpu_backend_create(2, &b), DI_OK);
    if (!b) return;
    di_engine *e = engine((size_t)64 << 20, 2, b);
    if (!e) {
        di_backend_destroy(b);
        return;
    }
    static result got[N_REQ];
    // Two run at a time. Request 0's 150-token prompt takes steps 1-5 (32 rows each), request 1
    // (5 tokens) joins in step 5's leftover rows; the 9th forward, where both decode (and the plan
    // of step 10, built during it, holds their placeholder rows), fails. 2 and 3 wait meanwhile.
    di_engine_fail_forward(e, 8, 1, DI_ERR_CUDA);
    run(e, got, 0, 4);
    di_engine_wait_idle(e);
    int n_failed = 0, n_ok = 0;
    for (int i = 0; i < 4; i++) {
        CHECK_EQ(atomic_load(&got[i].finished), 1);
        if (got[i].finish == DI_FINISH_ERROR) {
            CHECK_EQ(got[i].status, DI_ERR_CUDA);
            n_failed++;
        } else {
            CHECK(same(&got[i], &g_ref[i]));
            n_ok++;
        }
    }
    CHECK(got[0].finish == DI_FINISH_ERROR && got[1].finish == DI_FINISH_ERROR);
    CHECK(got[0].n > 0 && got[1].n > 0); // both had begun to decode
    for (int i = 0; i < 2; i++)          // the tokens before the failure are the CPU engine's
        CHECK(!memcmp(got[i].tokens, g_ref[i].tokens, sizeof(int32_t) * (size_t)got[i].n));
    CHECK(got[2].finish != DI_FINISH_ERROR && got[3].finish != DI_FINISH_ERROR);
    run(e, got, 4, N_REQ);
    di_engine_wait_idle(e);
    for (int i = 4; i < N_REQ; i++) CHECK(same(&got[i], &g_ref[i]));
    di_engine_stats st;
    di_engine_get_stats(e, &st);
    fprintf(stderr,
            "(b) injected DI_ERR_CUDA: %d requests ended with the error, %d + %d identical to "
            "the CPU engine; %lld failed steps\n",
            n_failed, n_ok, N_REQ - 4, (long long)st.n_failed_steps);
    CHECK_EQ(n_failed, 2);
    CHECK_EQ(st.n_failed_steps, 1);
    check_clean(e, true);
    di_engine_destroy(e);
    di_backend_destroy(b);
}

// ---- greedy rows: the device's argmax instead of the row (engine.c "greedy rows on the device")

// Request i of the greedy set: request(i)'s prompt, length and budget, its sampling by kind
// i % 5 (every request ignores EOS):
//   0: greedy and nothing else of its rows: every row crosses as its device argmax;
//   1: greedy with logprobs and N_TOP top logprobs: full rows;
//   2: seeded sampling (temperature 0.8, top_k 40), no logprobs: full rows;
//   3: greedy with first_logits: its first row full, the later ones picks;
//   4: greedy with a repetition penalty: full rows.
// only_greedy: every request of kind 0.
static di_request_params greedy_request(int i, result *r, bool only_greedy) {
    di_request_params p = request(i, r);
    const int kind = only_greedy ? 0 : i % 5;
    p.sample = di_sample_params_default();
    p.first_logits = kind == 3 ? r->first : NULL;
    if (kind == 1) p.sample.logprobs = true, p.sample.n_logprobs = N_TOP;
    if (kind == 2)
        p.sample.temperature = 0.8f, p.sample.top_k = 40, p.sample.seed = 91 + (uint64_t)i;
    if (kind == 4) p.sample.repetition_penalty = 1.3f;
    return p;
}

static void run_greedy(di_engine *e, result *res, bool only_greedy) {
    for (int i = 0; i < N_REQ; i++) {
        memset(&res[i], 0, sizeof res[i]);
        di_request_params p = greedy_request(i, &res[i], only_greedy);
        uint64_t id;
        CHECK_EQ(di_engine_submit(e, &p, &id), DI_OK);
    }
    di_engine_wait_idle(e);
}

// Drafts for the greedy set (user: the reference results of the set being run): by the output
// token's position all right or the first one wrong, so verifies accept and reject.
static void greedy_oracle(void *user, uint64_t id, int32_t n_gen, di_draft *d) {
    const result *t = (const result *)user + (id - 1) % N_REQ;
    for (int32_t j = 0; j < d->n; j++) {
        const int32_t g = n_gen + j, tok = g < t->n ? t->tokens[g] : 0;
        d->tokens[j] = n_gen % 2 == 1 && j == 0 ? (tok + 1) % V : tok;
    }
}

// The references: the greedy set, mixed (g_gref[0]) and greedy only ([1]), on the CPU engine
// without speculation (whose outputs speculation never changes).
static result g_gref[2][N_REQ];
static void greedy_refs(void) {
    di_engine_options oc = options((size_t)64 << 20, N_REQ);
    di_engine *cpu = engine_o(&oc, NULL);
    if (!cpu) return;
    for (int only = 0; only < 2; only++) run_greedy(cpu, g_gref[only], only);
    di_engine_destroy(cpu);
}

// The greedy set, mixed and greedy only, on the dev engine of options o (spec_tokens > 0: with
// the oracle's drafts) against g_gref: identical results (tokens, logprobs, top logprobs,
// first logits, finish reasons). The bytes of results the dev state downloaded (graph stats'
// n_download_bytes): the greedy-only run downloads no row at all (V = 512 floats), 4 bytes per
// token without speculation (one logit row a token); the mixed one at least a row for every token
// of kinds 1, 2, 4 and fewer than a row a token.
static void greedy_rows_case(const char *tag, const di_engine_options *o, di_backend *b) {
    static result got[N_REQ];
    result(*ref)[N_REQ] = g_gref;
    di_engine *dev = engine_o(o, b);
    if (!dev) return;
    for (int only = 0; only < 2; only++) {
        if (o->spec_tokens > 0) di_engine_set_draft_hook(dev, greedy_oracle, ref[only]);
        di_dsv4_dev_graph_stats g0, g1;
        di_engine_get_graph_stats(dev, &g0);
        run_greedy(dev, got, only);
        di_engine_get_graph_stats(dev, &g1);
        const int64_t bytes = g1.n_download_bytes - g0.n_download_bytes;
        int n_same = 0;
        int64_t n_tok = 0, n_full = 0;
        for (int i = 0; i < N_REQ; i++) {
            n_same += same(&got[i], &ref[only][i]);
            CHECK_EQ(got[i].finish, ref[only][i].finish);
            n_tok += got[i].n;
            const int kind = only ? 0 : i % 5;
            if (kind == 1 || kind == 2 || kind == 4) n_full += got[i].n;
        }
        di_engine_stats st;
        di_engine_get_stats(dev, &st);
        fprintf(stderr,
                "(greedy rows) %s, %s: %d/%d identical to the CPU engine, %lld tokens, %lld "
                "bytes of results downloaded (a row: %lld), %lld preemptions, %lld verifies\n",
                tag, only ? "greedy only" : "mixed", n_same, N_REQ, (long long)n_tok,
                (long long)bytes, (long long)(4 * V), (long long)st.n_preemptions,
                (long long)st.n_spec_verifies);
        CHECK_EQ(n_same, N_REQ);
        if (only) { // ids only: one a token, or (speculation) a few: verify and draft rows
            CHECK(bytes > 0 && bytes <= 4 * 16 * n_tok);
            if (o->spec_tokens == 0) CHECK_EQ(bytes, 4 * n_tok);
        } else {
            CHECK(bytes >= 4 * V * n_full);
            CHECK(bytes < 4 * V * n_tok);
        }
    }
    check_clean(dev, true);
    di_engine_destroy(dev);
}
