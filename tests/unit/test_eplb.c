// eplb and placement (src/ep): the placement table's basics and checks; the planner's invariants
// (every expert >= 1 replica, every rank exactly slots_per_rank, no two replicas of an expert on
// one rank when avoidable, determinism), its quality on Zipf-skewed and uniform loads, its
// stability (same load: 0 moves; small perturbation: few moves), the front's shared-expert load on
// rank 0, the rebalancing decision; the
// placement and load files (round trip, every malformed field refused); load counting through a
// real forward of the tiny V4 fixture (hash layers and the MTP block included) and of the V4.1
// tiny model, and through the serving engine (readable while it runs, nothing allocated per step).
#include "harness.h"

#include <pthread.h>
#include <stdatomic.h>
#include <unistd.h>

#include "base/mem.h"
#include "ep/eplb.h"
#include "ep/eplb_async.h"
#include "model/dsv4.h"
#include "model/synth.h"

#define FIXTURE "tests/data/fixtures/tiny/hf"

// Zipf(s) loads over a fixed pseudo-random permutation of the experts (seeded LCG).
static void zipf(int64_t *w, int32_t E, double s, uint64_t seed) {
    int32_t *perm = di_malloc(sizeof(int32_t) * (size_t)E);
    for (int32_t i = 0; i < E; i++) perm[i] = i;
    for (int32_t i = E - 1; i > 0; i--) {
        seed = seed * 6364136223846793005ull + 1442695040888963407ull;
        const int32_t j = (int32_t)((seed >> 33) % (uint64_t)(i + 1));
        const int32_t t = perm[i];
        perm[i] = perm[j];
        perm[j] = t;
    }
    for (int32_t e = 0; e < E; e++) w[perm[e]] = (int64_t)(1e6 / pow(e + 1, s)) + 1;
    di_free(perm);
}

static di_ep_load_table table(int32_t L, int32_t E) {
    di_ep_load_table t;
    CHECK_EQ(di_ep_load_table_alloc(L, E, &t), DI_OK);
    return t;
}

static di_eplb_options opts(int32_t R, int32_t S) {
    di_eplb_options o = di_eplb_options_default();
    o.n_ranks = R;
    o.slots_per_rank = S;
    return o;
}

static void test_placement_basics(void) {
    di_ep_placement p, q;
    CHECK_EQ(di_ep_placement_contiguous(2, 8, 4, &p), DI_OK);
    const int32_t want[8] = {0, 0, 1, 1, 2, 2, 3, 3};
    for (int32_t l = 0; l < 2; l++)
        for (int32_t e = 0; e < 8; e++) {
            CHECK_EQ(p.expert[l * 8 + e], e);
            CHECK_EQ(p.rank[l * 8 + e], want[e]);
            CHECK_EQ(di_ep_placement_count(&p, l, e, want[e]), 1);
            CHECK_EQ(di_ep_placement_count(&p, l, e, (want[e] + 1) % 4), 0);
        }
    char why[160];
    CHECK_EQ(di_ep_placement_check(&p, why, sizeof why), DI_OK);
    CHECK_EQ(di_ep_placement_copy(&p, &q), DI_OK);
    CHECK(di_ep_placement_equal(&p, &q));
    q.rank[3] = 2;
    CHECK(!di_ep_placement_equal(&p, &q));
    q.rank[3] = 4;
    CHECK_EQ(di_ep_placement_check(&q, why, sizeof why), DI_ERR_INVALID);
    CHECK(strstr(why, "rank 4") != NULL);
    q.rank[3] = 1;
    q.expert[8 + 5] = 8;
    CHECK_EQ(di_ep_placement_check(&q, why, sizeof why), DI_ERR_INVALID);
    CHECK(strstr(why, "names expert 8") != NULL);
    q.expert[8 + 5] = 4; // expert 5 of layer 1 now has no replica
    CHECK_EQ(di_ep_placement_check(&q, NULL, 0), DI_ERR_INVALID);
    CHECK_EQ(di_ep_placement_check(&q, why, sizeof why), DI_ERR_INVALID);
    CHECK(strstr(why, "layer 1 expert 5 has no replica") != NULL);
    q.n_slots = 7;
    CHECK_EQ(di_ep_placement_check(&q, why, sizeof why), DI_ERR_INVALID);
    CHECK(strstr(why, "bad shape") != NULL);
    di_ep_placement_free(&q);
    di_ep_placement_free(&p);
    CHECK_EQ(di_ep_placement_contiguous(0, 8, 4, &p), DI_ERR_INVALID);
    CHECK_EQ(di_ep_placement_alloc(1, 8, 2, 7, &p), DI_ERR_INVALID);
    CHECK(p.expert == NULL);
}

// The planner's invariants on one plan of layer-count L.
static void check_invariants(const di_ep_placement *p, int32_t S) {
    CHECK_EQ(di_ep_placement_check(p, NULL, 0), DI_OK);
    const int32_t R = p->n_ranks, E = p->n_expert;
    int32_t *rn = di_calloc((size_t)R, sizeof(int32_t));
    int32_t *cnt = di_calloc((size_t)E, sizeof(int32_t));
    int64_t dup = 0, avoidable = 0;
    for (int32_t l = 0; l < p->n_layers; l++) {
        memset(rn, 0, sizeof(int32_t) * (size_t)R);
        memset(cnt, 0, sizeof(int32_t) * (size_t)E);
        for (int32_t s = 0; s < p->n_slots; s++) {
            rn[p->rank[(int64_t)l * p->n_slots + s]]++;
            cnt[p->expert[(int64_t)l * p->n_slots + s]]++;
        }
        for (int32_t r = 0; r < R; r++) CHECK_EQ(rn[r], S);
        for (int32_t e = 0; e < E; e++) {
            CHECK(cnt[e] >= 1);
            for (int32_t r = 0; r < R; r++) {
                const int32_t c = di_ep_placement_count(p, l, e, r);
                if (c > 1) {
                    dup += c - 1;
                    if (cnt[e] <= R) avoidable++;
                }
            }
        }
    }
    CHECK_EQ(avoidable, 0);
    di_free(rn);
    di_free(cnt);
}

static void test_planner_invariants(void) {
    static const int32_t shapes[][3] = {{8, 4, 2},    {8, 4, 3},    {16, 4, 5},
                                        {256, 8, 34}, {256, 64, 5}, {10, 3, 7}};
    for (size_t k = 0; k < sizeof shapes / sizeof shapes[0]; k++) {
        const int32_t E = shapes[k][0], R = shapes[k][1], S = shapes[k][2], L = 3;
        di_ep_load_table t = table(L, E);
        for (int32_t l = 0; l < L; l++) zipf(t.count + (int64_t)l * E, E, 0.5 * (l + 1), 7 + l);
        di_eplb_options o = opts(R, S);
        di_ep_placement a, b;
        di_eplb_report rep;
        CHECK_EQ(di_eplb_plan(&t, &o, NULL, &a, &rep), DI_OK);
        check_invariants(&a, S);
        CHECK_EQ(rep.n_moves, (int64_t)L * R * S);
        CHECK_EQ(di_eplb_plan(&t, &o, NULL, &b, NULL), DI_OK);
        CHECK(di_ep_placement_equal(&a, &b)); // deterministic
        di_ep_placement_free(&a);
        di_ep_placement_free(&b);
        di_ep_load_table_free(&t);
    }
    // Bad options and shapes.
    di_ep_load_table t = table(2, 8);
    di_ep_placement p;
    di_eplb_options o = opts(2, 3); // 6 slots < 8 experts
    CHECK_EQ(di_eplb_plan(&t, &o, NULL, &p, NULL), DI_ERR_INVALID);
    o = opts(0, 8);
    CHECK_EQ(di_eplb_plan(&t, &o, NULL, &p, NULL), DI_ERR_INVALID);
    o = opts(2, 4);
    o.keep_tolerance = -1;
    CHECK_EQ(di_eplb_plan(&t, &o, NULL, &p, NULL), DI_ERR_INVALID);
    o = opts(2, 4);
    t.count[3] = -1;
    CHECK_EQ(di_eplb_plan(&t, &o, NULL, &p, NULL), DI_ERR_INVALID);
    t.count[3] = 0;
    di_ep_placement other;
    CHECK_EQ(di_ep_placement_contiguous(3, 8, 2, &other), DI_OK); // 3 layers, the load has 2
    CHECK_EQ(di_eplb_plan(&t, &o, &other, &p, NULL), DI_ERR_INVALID);
    di_ep_placement_free(&other);
    di_ep_load_table_free(&t);
}

// Max rank load of one layer (replica load = expert load / replicas).
static double layer_max(const di_ep_placement *p, int32_t l, const int64_t *w, double *mean,
                        double *max_rep) {
    double rl[256] = {0};
    int32_t cnt[512] = {0};
    double tot = 0;
    *max_rep = 0;
    for (int32_t s = 0; s < p->n_slots; s++) cnt[p->expert[(int64_t)l * p->n_slots + s]]++;
    for (int32_t s = 0; s < p->n_slots; s++) {
        const int32_t e = p->expert[(int64_t)l * p->n_slots + s];
        const double x = (double)w[e] / cnt[e];
        rl[p->rank[(int64_t)l * p->n_slots + s]] += x;
        if (x > *max_rep) *max_rep = x;
        tot += x;
    }
    *mean = tot / p->n_ranks;
    double m = 0;
    for (int32_t r = 0; r < p->n_ranks; r++)
        if (rl[r] > m) m = rl[r];
    return m;
}

static void test_planner_quality(void) {
    const int32_t E = 256;
    static const double skew[] = {0.5, 1.0, 1.5};
    static const int32_t ranks[] = {8, 16, 32, 64};
    for (size_t i = 0; i < 3; i++)
        for (size_t j = 0; j < 4; j++) {
            const int32_t R = ranks[j], S = E / R + 1; // R redundant replicas
            di_ep_load_table t = table(1, E);
            zipf(t.count, E, skew[i], 42);
            di_eplb_options o = opts(R, S);
            di_ep_placement p;
            di_eplb_report rep;
            CHECK_EQ(di_eplb_plan(&t, &o, NULL, &p, &rep), DI_OK);
            // The list-scheduling bound: the fullest rank exceeds the mean by at most the largest
            // replica (docs/expert-parallel.md: checked, not proven, with slots per rank fixed).
            double mean, max_rep;
            const double mx = layer_max(&p, 0, t.count, &mean, &max_rep);
            CHECK(mx <= mean + max_rep + 1e-6);
            CHECK_NEAR(rep.balance_after, mx / mean, 1e-9);
            CHECK(rep.balance_after < rep.balance_contiguous);
            if (skew[i] == 1.0 && R == 16) {
                // The measured values (docs/expert-parallel.md, "EPLB"), as a regression bound.
                CHECK(rep.balance_after < 1.05);
                CHECK(rep.balance_contiguous > 1.5);
            }
            di_ep_placement_free(&p);
            di_ep_load_table_free(&t);
        }
    // Uniform loads: perfect balance, exactly.
    di_ep_load_table t = table(2, E);
    for (int32_t i = 0; i < 2 * E; i++) t.count[i] = 1000;
    di_eplb_options o = opts(16, 16);
    di_ep_placement p;
    di_eplb_report rep;
    CHECK_EQ(di_eplb_plan(&t, &o, NULL, &p, &rep), DI_OK);
    CHECK(rep.balance_after == 1.0);
    CHECK(rep.balance_contiguous == 1.0);
    di_ep_placement_free(&p);
    // No load at all: still a valid placement, balance 1.
    memset(t.count, 0, sizeof(int64_t) * 2 * E);
    o = opts(16, 17);
    CHECK_EQ(di_eplb_plan(&t, &o, NULL, &p, &rep), DI_OK);
    check_invariants(&p, 17);
    CHECK(rep.balance_after == 1.0);
    di_ep_placement_free(&p);
    di_ep_load_table_free(&t);
}

// Routed load of each rank of layer l of p (rl[n_ranks]).
static void routed_loads(const di_ep_placement *p, int32_t l, const int64_t *w, double *rl) {
    int32_t cnt[512] = {0};
    for (int32_t r = 0; r < p->n_ranks; r++) rl[r] = 0;
    for (int32_t s = 0; s < p->n_slots; s++) cnt[p->expert[(int64_t)l * p->n_slots + s]]++;
    for (int32_t s = 0; s < p->n_slots; s++) {
        const int32_t e = p->expert[(int64_t)l * p->n_slots + s];
        rl[p->rank[(int64_t)l * p->n_slots + s]] += (double)w[e] / cnt[e];
    }
}

// Rank 0, the front, computes the shared expert of every row besides its replicas: with
// front_load_per_row the planner starts it at that load, so it gets the lightest replicas and the
// balance counting the front is better than a plan that ignores it; it stays rank 0 when a plan is
// matched to a current placement; bad values are refused.
static void test_planner_front(void) {
    const int32_t E = 256, R = 8, S = 33, K = 6;
    di_ep_load_table t = table(1, E);
    zipf(t.count, E, 1.0, 7);
    int64_t pairs = 0;
    for (int32_t e = 0; e < E; e++) pairs += t.count[e];
    t.rows[0] = pairs / K;
    di_eplb_options o = opts(R, S);
    di_ep_placement plain, front, again;
    di_eplb_report rp, rf, ra;
    CHECK_EQ(di_eplb_plan(&t, &o, NULL, &plain, &rp), DI_OK);
    o.front_load_per_row = 1;
    CHECK_EQ(di_eplb_plan(&t, &o, NULL, &front, &rf), DI_OK);
    check_invariants(&front, S);
    double rl[8];
    routed_loads(&front, 0, t.count, rl);
    for (int32_t r = 1; r < R; r++) CHECK(rl[0] < rl[r]);
    // balance with the front: its plan against the plain plan's, both counted with the front
    double b_plain, b_front;
    CHECK_EQ(di_eplb_balance(&plain, &t, 1, &b_plain), DI_OK);
    CHECK_EQ(di_eplb_balance(&front, &t, 1, &b_front), DI_OK);
    CHECK_NEAR(b_front, rf.balance_after, 1e-12);
    CHECK(b_front < b_plain - 0.5); // 1.30 against 2.0: the front computes a sixth of the pairs
    // the rank loads the report counts: max(rank 0 = routed + rows, the others) over the mean
    double mx = rl[0] + (double)t.rows[0], tot = mx;
    for (int32_t r = 1; r < R; r++) {
        tot += rl[r];
        if (rl[r] > mx) mx = rl[r];
    }
    CHECK_NEAR(b_front, mx * R / tot, 1e-9);
    printf("front load: balance %.4f (a plan ignoring it: %.4f)\n", b_front, b_plain);
    // matched to the plain plan (rank 0 heavy there): the front stays rank 0, lightest routed
    CHECK_EQ(di_eplb_plan(&t, &o, &plain, &again, &ra), DI_OK);
    routed_loads(&again, 0, t.count, rl);
    for (int32_t r = 1; r < R; r++) CHECK(rl[0] < rl[r]);
    CHECK(ra.balance_after <= rf.balance_after * (1 + o.keep_tolerance) + 1e-9);
    di_ep_placement_free(&again);
    // refused: a negative or non-finite front load, a negative row count
    di_ep_placement bad;
    o.front_load_per_row = -1;
    CHECK_EQ(di_eplb_plan(&t, &o, NULL, &bad, NULL), DI_ERR_INVALID);
    o.front_load_per_row = NAN;
    CHECK_EQ(di_eplb_plan(&t, &o, NULL, &bad, NULL), DI_ERR_INVALID);
    o.front_load_per_row = 1;
    t.rows[0] = -1;
    CHECK_EQ(di_eplb_plan(&t, &o, NULL, &bad, NULL), DI_ERR_INVALID);
    di_ep_placement_free(&plain);
    di_ep_placement_free(&front);
    di_ep_load_table_free(&t);
}

static void test_planner_stability(void) {
    const int32_t E = 256, L = 4, R = 32, S = 9; // 32 redundant replicas
    di_ep_load_table t = table(L, E), u = table(L, E);
    for (int32_t l = 0; l < L; l++) zipf(t.count + (int64_t)l * E, E, 1.0, 100 + l);
    di_eplb_options o = opts(R, S);
    di_ep_placement a, b, c;
    di_eplb_report rep;
    CHECK_EQ(di_eplb_plan(&t, &o, NULL, &a, NULL), DI_OK);
    CHECK_EQ(di_eplb_plan(&t, &o, &a, &b, &rep), DI_OK); // the same load again: nothing moves
    CHECK_EQ(rep.n_moves, 0);
    CHECK_EQ(rep.n_layers_changed, 0);
    CHECK(di_ep_placement_equal(&a, &b));
    CHECK_EQ(di_eplb_moves(&a, &b), 0);
    // +-3% noise on every expert: few replicas move, balance stays near the fresh plan's.
    uint64_t seed = 9;
    for (int64_t i = 0; i < (int64_t)L * E; i++) {
        seed = seed * 6364136223846793005ull + 1442695040888963407ull;
        u.count[i] = t.count[i] + t.count[i] * (int64_t)((seed >> 33) % 61 - 30) / 1000;
    }
    di_ep_placement fresh;
    di_eplb_report frep;
    CHECK_EQ(di_eplb_plan(&u, &o, NULL, &fresh, &frep), DI_OK);
    CHECK_EQ(di_eplb_plan(&u, &o, &a, &c, &rep), DI_OK);
    check_invariants(&c, S);
    CHECK(rep.n_moves <= (int64_t)L * R * S / 20); // at most 5% of the replicas
    CHECK(rep.balance_after <= frep.balance_after * (1 + o.keep_tolerance) + 1e-9);
    CHECK_EQ(di_eplb_moves(&a, &c), rep.n_moves);
    di_ep_placement_free(&fresh);
    di_ep_placement_free(&c);
    // +-25%: the placement as it is falls out of the tolerance; the kept replicas stay in place.
    for (int64_t i = 0; i < (int64_t)L * E; i++) {
        seed = seed * 6364136223846793005ull + 1442695040888963407ull;
        u.count[i] = t.count[i] + t.count[i] * (int64_t)((seed >> 33) % 501 - 250) / 1000;
    }
    CHECK_EQ(di_eplb_plan(&u, &o, NULL, &fresh, &frep), DI_OK);
    CHECK_EQ(di_eplb_plan(&u, &o, &a, &c, &rep), DI_OK);
    check_invariants(&c, S);
    CHECK(rep.n_moves > 0);
    CHECK(rep.n_moves <= (int64_t)L * R * S / 10); // measured: 55 of 1152
    CHECK(rep.balance_after <= frep.balance_after * (1 + o.keep_tolerance) + 1e-9);
    CHECK(rep.balance_after < rep.balance_before);
    // A quite different load moves more, and renumbering keeps overlap: fewer moves than a
    // fresh plan laid out from scratch.
    for (int32_t l = 0; l < L; l++) zipf(u.count + (int64_t)l * E, E, 1.0, 900 + l);
    di_ep_placement d;
    CHECK_EQ(di_eplb_plan(&u, &o, &a, &d, &rep), DI_OK);
    check_invariants(&d, S);
    CHECK(rep.n_moves > 0);
    CHECK(rep.n_moves < (int64_t)L * R * S);
    di_ep_placement_free(&d);
    di_ep_placement_free(&fresh);
    di_ep_placement_free(&a);
    di_ep_placement_free(&b);
    di_ep_placement_free(&c);
    di_ep_load_table_free(&t);
    di_ep_load_table_free(&u);
}

static void test_rebalance(void) {
    const int32_t E = 64, L = 2, R = 8;
    di_ep_load_table t = table(L, E);
    for (int32_t l = 0; l < L; l++) zipf(t.count + (int64_t)l * E, E, 1.2, 5 + l);
    di_ep_placement cur, next, again;
    CHECK_EQ(di_ep_placement_contiguous(L, E, R, &cur), DI_OK);
    di_eplb_options o = opts(R, 10); // 16 redundant replicas
    di_eplb_report rep;
    CHECK_EQ(di_eplb_rebalance(&t, &cur, &o, &next, &rep), DI_OK);
    CHECK(rep.apply);
    CHECK(rep.balance_before > 1.5);
    CHECK(rep.balance_after < rep.balance_before - o.min_gain);
    CHECK(rep.balance_before == rep.balance_contiguous);
    CHECK(rep.n_moves > 0);
    const int64_t moved = rep.n_moves;
    check_invariants(&next, 10);
    // Re-run on the placement just applied: nothing to gain.
    CHECK_EQ(di_eplb_rebalance(&t, &next, &o, &again, &rep), DI_OK);
    CHECK(!rep.apply);
    CHECK_EQ(rep.n_moves, 0);
    di_ep_placement_free(&again);
    // A threshold above the gain: not applied.
    o.min_gain = 10;
    CHECK_EQ(di_eplb_rebalance(&t, &cur, &o, &again, &rep), DI_OK);
    CHECK(!rep.apply);
    di_ep_placement_free(&again);
    // An empty window never applies; uniform loads on the contiguous placement do not either.
    o.min_gain = 0.05;
    memset(t.count, 0, sizeof(int64_t) * (size_t)(L * E));
    CHECK_EQ(di_eplb_rebalance(&t, &cur, &o, &again, &rep), DI_OK);
    CHECK(!rep.apply);
    di_ep_placement_free(&again);
    for (int32_t i = 0; i < L * E; i++) t.count[i] = 50;
    o = opts(R, E / R);
    CHECK_EQ(di_eplb_rebalance(&t, &cur, &o, &again, &rep), DI_OK);
    CHECK(!rep.apply);
    CHECK(rep.balance_before == 1.0);
    di_ep_placement_free(&again);
    CHECK_EQ(di_eplb_rebalance(&t, NULL, &o, &again, &rep), DI_ERR_INVALID);
    // Shapes that differ: no moves count, no balance.
    di_ep_placement three;
    CHECK_EQ(di_ep_placement_contiguous(3, E, R, &three), DI_OK);
    CHECK_EQ(di_eplb_moves(&cur, &three), -1);
    double b = 5;
    CHECK_EQ(di_eplb_balance(&three, &t, 0, &b), DI_ERR_INVALID);
    CHECK(b == 0);
    CHECK_EQ(di_eplb_moves(&cur, &cur), 0);
    CHECK_EQ(di_eplb_moves(&cur, &next), moved);
    CHECK(moved < (int64_t)L * R * 10); // renumbered ranks keep some experts where they were
    di_ep_placement_free(&three);
    di_ep_placement_free(&cur);
    di_ep_placement_free(&next);
    di_ep_load_table_free(&t);
}

// Replaces the first `from` in text by `to` and expects the placement parser to refuse it with
// `why` containing `msg`.
static void refuse_placement(const char *text, const char *from, const char *to, const char *msg) {
    char buf[4096];
    const char *at = strstr(text, from);
    CHECK(at != NULL);
    if (!at) return;
    snprintf(buf, sizeof buf, "%.*s%s%s", (int)(at - text), text, to, at + strlen(from));
    di_ep_placement p;
    char why[256] = "";
    CHECK_EQ(di_eplb_placement_parse(buf, strlen(buf), &p, why, sizeof why), DI_ERR_FORMAT);
    CHECK(p.expert == NULL && p.rank == NULL);
    if (!strstr(why, msg))
        fprintf(stderr, "  %s -> %s: got \"%s\", want \"%s\"\n", from, to, why, msg);
    CHECK(strstr(why, msg) != NULL);
}

static void refuse_load(const char *text, const char *from, const char *to, const char *msg) {
    char buf[4096];
    const char *at = strstr(text, from);
    CHECK(at != NULL);
    if (!at) return;
    snprintf(buf, sizeof buf, "%.*s%s%s", (int)(at - text), text, to, at + strlen(from));
    di_ep_load_table t;
    char why[256] = "";
    CHECK_EQ(di_eplb_load_parse(buf, strlen(buf), &t, why, sizeof why), DI_ERR_FORMAT);
    CHECK(t.count == NULL);
    if (!strstr(why, msg))
        fprintf(stderr, "  %s -> %s: got \"%s\", want \"%s\"\n", from, to, why, msg);
    CHECK(strstr(why, msg) != NULL);
}

// The planner thread: the plan it hands back is di_eplb_rebalance's on the same window and
// placement; one plan at most in flight; while held, nothing is planned and the caller goes on.
static atomic_int g_plans_done;
static void count_done(void *user) {
    (void)user;
    atomic_fetch_add(&g_plans_done, 1);
}

static void test_async_planner(void) {
    const int32_t E = 64, L = 2, R = 8;
    di_ep_load_table t = table(L, E);
    for (int32_t l = 0; l < L; l++) zipf(t.count + (int64_t)l * E, E, 1.2, 5 + l);
    di_ep_placement cur, want;
    CHECK_EQ(di_ep_placement_contiguous(L, E, R, &cur), DI_OK);
    const di_eplb_options o = opts(R, 10);
    di_eplb_report rep_want;
    CHECK_EQ(di_eplb_rebalance(&t, &cur, &o, &want, &rep_want), DI_OK);
    CHECK(rep_want.apply);

    di_eplb_async *a = NULL;
    CHECK_EQ(di_eplb_async_create(L, E, count_done, NULL, &a), DI_OK);
    if (!a) return;
    di_eplb_async_result r;
    CHECK(di_eplb_async_idle(a));
    CHECK(!di_eplb_async_take(a, &r)); // nothing submitted
    di_eplb_async_hold(a, true);
    di_ep_load_table *w = di_eplb_async_window(a);
    CHECK(w != NULL);
    memcpy(w->count, t.count, sizeof(int64_t) * (size_t)(L * E));
    memcpy(w->rows, t.rows, sizeof(int64_t) * (size_t)L);
    di_ep_placement c2;
    CHECK_EQ(di_ep_placement_contiguous(L, E, R, &c2), DI_OK);
    CHECK_EQ(di_eplb_async_submit(a, &c2, &o), DI_OK);
    CHECK(c2.expert == NULL); // moved in
    // Held: in flight, not done, a second plan is refused, the window is not the caller's.
    usleep(20000);
    CHECK(!di_eplb_async_idle(a));
    CHECK(!di_eplb_async_take(a, &r));
    CHECK(di_eplb_async_window(a) == NULL);
    di_ep_placement c3;
    CHECK_EQ(di_ep_placement_contiguous(L, E, R, &c3), DI_OK);
    CHECK_EQ(di_eplb_async_submit(a, &c3, &o), DI_ERR_BUSY);
    CHECK_EQ(atomic_load(&g_plans_done), 0);
    di_eplb_async_hold(a, false);
    di_eplb_async_wait(a);
    CHECK_EQ(atomic_load(&g_plans_done), 1);
    CHECK(di_eplb_async_take(a, &r));
    CHECK(di_eplb_async_idle(a));
    CHECK_EQ(r.st, DI_OK);
    CHECK(r.rep.apply);
    CHECK(r.rep.balance_after == rep_want.balance_after);
    CHECK_EQ(r.rep.n_moves, rep_want.n_moves);
    CHECK_EQ(r.pairs, di_ep_load_table_pairs(&t));
    CHECK(r.plan_us >= 0);
    CHECK_EQ(r.next.n_slots, want.n_slots);
    CHECK(!memcmp(r.next.expert, want.expert, sizeof(int32_t) * (size_t)(L * want.n_slots)));
    CHECK(!memcmp(r.next.rank, want.rank, sizeof(int32_t) * (size_t)(L * want.n_slots)));
    CHECK(!memcmp(r.cur.expert, cur.expert, sizeof(int32_t) * (size_t)(L * cur.n_slots)));
    di_ep_placement_free(&r.cur);
    di_ep_placement_free(&r.next);
    // Idle again: a second plan is taken; destroy with a plan queued and held joins cleanly.
    di_eplb_async_hold(a, true);
    CHECK_EQ(di_eplb_async_submit(a, &c3, &o), DI_OK);
    di_eplb_async_destroy(a);
    di_ep_placement_free(&c3);
    di_ep_placement_free(&cur);
    di_ep_placement_free(&want);
    di_ep_load_table_free(&t);
}

static void test_files(void) {
    // Placement: round trip through text and through a file.
    di_ep_load_table t = table(2, 4);
    zipf(t.count, 4, 1.0, 1);
    zipf(t.count + 4, 4, 1.0, 2);
    t.rows[0] = t.rows[1] = 12345;
    di_eplb_options o = opts(3, 2);
    di_ep_placement p, q;
    CHECK_EQ(di_eplb_plan(&t, &o, NULL, &p, NULL), DI_OK);
    char *text = NULL;
    CHECK_EQ(di_eplb_placement_dump(&p, &text), DI_OK);
    char why[256];
    CHECK_EQ(di_eplb_placement_parse(text, strlen(text), &q, why, sizeof why), DI_OK);
    CHECK(di_ep_placement_equal(&p, &q));
    di_ep_placement_free(&q);
    di_free(text);
    char path[] = "/tmp/di_test_eplb_XXXXXX";
    const int fd = mkstemp(path);
    CHECK(fd >= 0);
    close(fd);
    CHECK_EQ(di_eplb_placement_write(&p, path), DI_OK);
    CHECK_EQ(di_eplb_placement_read(path, &q, why, sizeof why), DI_OK);
    CHECK(di_ep_placement_equal(&p, &q));
    di_ep_placement_free(&q);
    CHECK_EQ(di_eplb_placement_read("/nonexistent/x.json", &q, why, sizeof why), DI_ERR_IO);
    CHECK(strstr(why, "cannot open") != NULL);
    // A fixed small document, then every field broken in turn.
    const char *doc = "{\"format\":\"deepinfer-ep-placement\",\"version\":1,\"n_layers\":1,"
                      "\"n_expert\":2,\"n_ranks\":2,\"n_slots\":3,\"layers\":[{\"expert\":[0,1,1],"
                      "\"rank\":[0,1,0]}]}";
    CHECK_EQ(di_eplb_placement_parse(doc, strlen(doc), &q, why, sizeof why), DI_OK);
    CHECK_EQ(q.n_slots, 3);
    CHECK_EQ(q.expert[2], 1);
    CHECK_EQ(q.rank[2], 0);
    di_ep_placement_free(&q);
    refuse_placement(doc, "{", "[", "invalid JSON");
    refuse_placement(doc, "{\"format", "[{\"format", "invalid JSON");
    refuse_placement(doc, "\"deepinfer-ep-placement\"", "\"deepinfer-expert-load\"",
                     "\"format\" is \"deepinfer-expert-load\"");
    refuse_placement(doc, "\"format\":\"deepinfer-ep-placement\",", "", "\"format\" is missing");
    refuse_placement(doc, "\"format\":\"deepinfer-ep-placement\"", "\"format\":7",
                     "\"format\" is missing or not a string");
    refuse_placement(doc, "\"version\":1", "\"version\":2", "\"version\" 2 is not supported");
    refuse_placement(doc, "\"version\":1", "\"version\":\"1\"", "\"version\" is missing");
    refuse_placement(doc, "\"n_layers\":1", "\"n_layers\":0", "\"n_layers\" is 0, outside");
    refuse_placement(doc, "\"n_layers\":1", "\"n_layers\":1.5", "\"n_layers\" is missing or not");
    refuse_placement(doc, "\"n_layers\":1", "\"n_layers\":2", "\"layers\" must be an array");
    refuse_placement(doc, "\"n_expert\":2", "\"n_expert\":-3", "\"n_expert\" is -3");
    refuse_placement(doc, "\"n_expert\":2", "\"n_expert\":4", "\"n_slots\" 3 is below");
    refuse_placement(doc, "\"n_ranks\":2", "\"n_ranks\":99999999", "\"n_ranks\" is 99999999");
    refuse_placement(doc, "\"n_ranks\":2,", "", "\"n_ranks\" is missing");
    refuse_placement(doc, "\"n_slots\":3", "\"n_slots\":4", "layers[0].expert has 3 entries");
    refuse_placement(doc, "\"n_layers\":1,\"n_expert\":2,\"n_ranks\":2,\"n_slots\":3",
                     "\"n_layers\":2,\"n_expert\":2,\"n_ranks\":2,\"n_slots\":9000000",
                     "2 layers x 9000000 slots");
    refuse_placement(doc, "\"n_slots\":3", "\"n_slots\":3,\"x\":1", "unknown field \"x\"");
    refuse_placement(doc, "\"n_slots\":3", "\"n_slots\":3,\"n_slots\":3", "invalid JSON");
    refuse_placement(doc, "[{\"expert\"", "[7,{\"expert\"", "\"layers\" must be an array");
    refuse_placement(doc, "{\"expert\":[0,1,1],\"rank\":[0,1,0]}", "7",
                     "layers[0] is not an object");
    refuse_placement(doc, "\"expert\":[0,1,1]", "\"expert\":[0,1,1],\"y\":0",
                     "layers[0]: unknown field \"y\"");
    refuse_placement(doc, "\"expert\":[0,1,1]", "\"expert\":{}", "layers[0].expert is missing");
    refuse_placement(doc, "\"expert\":[0,1,1],", "", "layers[0].expert is missing");
    refuse_placement(doc, "\"expert\":[0,1,1]", "\"expert\":[0,1,2]",
                     "layers[0].expert entry 2 is 2, outside [0, 1]");
    refuse_placement(doc, "\"expert\":[0,1,1]", "\"expert\":[0,1,null]",
                     "layers[0].expert entry 2 is not an integer");
    refuse_placement(doc, "\"expert\":[0,1,1]", "\"expert\":[0,0,0]", "expert 1 has no replica");
    refuse_placement(doc, "\"rank\":[0,1,0]", "\"rank\":[0,1,-1]", "layers[0].rank entry 2 is -1");
    refuse_placement(doc, "\"rank\":[0,1,0]", "\"rank\":[0,1]", "layers[0].rank has 2 entries");
    refuse_placement(doc, "\"rank\":[0,1,0]", "\"rank\":[0,1,9223372036854775808]", "invalid JSON");
    // Load: round trip and refusals.
    CHECK_EQ(di_eplb_load_dump(&t, &text), DI_OK);
    di_ep_load_table u;
    CHECK_EQ(di_eplb_load_parse(text, strlen(text), &u, why, sizeof why), DI_OK);
    CHECK_EQ(u.n_layers, 2);
    CHECK_EQ(u.n_expert, 4);
    CHECK(!memcmp(u.count, t.count, sizeof(int64_t) * 8));
    CHECK(!memcmp(u.rows, t.rows, sizeof(int64_t) * 2));
    di_ep_load_table_free(&u);
    di_free(text);
    FILE *f = fopen(path, "w");
    fputs("{\"format\":\"deepinfer-expert-load\",\"version\":1,\"n_layers\":1,\"n_expert\":2,"
          "\"rows\":[3],\"load\":[[4,2]]}",
          f);
    fclose(f);
    CHECK_EQ(di_eplb_load_read(path, &u, why, sizeof why), DI_OK);
    CHECK_EQ(u.count[0], 4);
    CHECK_EQ(u.rows[0], 3);
    di_ep_load_table_free(&u);
    const char *ld = "{\"format\":\"deepinfer-expert-load\",\"version\":1,\"n_layers\":1,"
                     "\"n_expert\":2,\"rows\":[3],\"load\":[[4,2]]}";
    refuse_load(ld, "\"deepinfer-expert-load\"", "\"deepinfer-ep-placement\"", "\"format\" is");
    refuse_load(ld, "\"version\":1", "\"version\":0", "\"version\" 0");
    refuse_load(ld, "\"n_layers\":1", "\"n_layers\":2", "\"load\" must be an array");
    refuse_load(ld, "\"n_expert\":2", "\"n_expert\":3", "load[0] has 2 entries");
    refuse_load(ld, "\"n_expert\":2", "\"n_expert\":100000", "\"n_expert\" is 100000");
    refuse_load(ld, "\"rows\":[3]", "\"rows\":[-3]", "\"rows\" entry 0 is -3");
    refuse_load(ld, "\"rows\":[3],", "", "\"rows\" is missing");
    refuse_load(ld, "[[4,2]]", "[[4,-2]]", "load[0] entry 1 is -2");
    refuse_load(ld, "[[4,2]]", "[[4,2.0]]", "load[0] entry 1 is not an integer");
    refuse_load(ld, "[[4,2]]", "[{}]", "load[0] is missing or not an array");
    refuse_load(ld, "\"load\"", "\"lode\"", "unknown field \"lode\"");
    refuse_load(ld, "}", "", "invalid JSON");
    unlink(path);
    di_ep_placement_free(&p);
    di_ep_load_table_free(&t);
}

// Live counters: totals, windows, out-of-range ids ignored.
static void test_load_counters(void) {
    di_ep_load *l;
    CHECK_EQ(di_ep_load_create(0, 4, &l), DI_ERR_INVALID);
    CHECK_EQ(di_ep_load_create(2, 4, &l), DI_OK);
    const int32_t sel[6] = {0, 1, 1, 3, 9, -1};
    di_ep_load_record(l, 0, sel, 3, 2);
    di_ep_load_record(l, 1, sel, 2, 2);
    di_ep_load_record(l, 2, sel, 2, 2); // no such layer
    di_ep_load_table t = table(2, 4), w = table(2, 4), bad = table(2, 5);
    CHECK_EQ(di_ep_load_totals(l, &bad), DI_ERR_INVALID);
    CHECK_EQ(di_ep_load_window(l, &bad), DI_ERR_INVALID);
    CHECK_EQ(di_ep_load_totals(l, &t), DI_OK);
    const int64_t want[8] = {1, 2, 0, 1, 1, 2, 0, 1};
    CHECK(!memcmp(t.count, want, sizeof want));
    CHECK_EQ(t.rows[0], 3);
    CHECK_EQ(t.rows[1], 2);
    CHECK_EQ(di_ep_load_window(l, &w), DI_OK);
    CHECK(!memcmp(w.count, want, sizeof want));
    di_ep_load_record(l, 1, sel + 2, 1, 2);
    CHECK_EQ(di_ep_load_window(l, &w), DI_OK);
    const int64_t want2[8] = {0, 0, 0, 0, 0, 1, 0, 1};
    CHECK(!memcmp(w.count, want2, sizeof want2));
    CHECK_EQ(w.rows[1], 1);
    CHECK_EQ(w.rows[0], 0);
    CHECK_EQ(di_ep_load_totals(l, &t), DI_OK);
    CHECK_EQ(t.count[4 + 3], 2);
    int64_t pairs;
    double imb;
    di_ep_load_summary(l, &pairs, &imb);
    CHECK_EQ(pairs, di_ep_load_table_pairs(&t));
    CHECK_EQ(pairs, 10);
    CHECK_NEAR(imb, di_ep_load_table_imbalance(&t), 1e-12);
    CHECK_NEAR(imb, (2.0 * 4 / 4 + 3.0 * 4 / 6) / 2, 1e-12);
    di_ep_load_table_free(&t);
    di_ep_load_table_free(&w);
    di_ep_load_table_free(&bad);
    di_ep_load_destroy(l);
}

// A real forward of the tiny fixture (2 hash-routed layers, 4 score-routed, 1 MTP block):
// every layer's counts sum to rows x K, the hash layers' counts are exactly tid2eid's.
static void test_forward_counts(void) {
    di_model_options mo = di_model_options_default();
    mo.n_threads = 2;
    di_model *m = NULL;
    if (di_model_load(FIXTURE, &mo, &m) != DI_OK) {
        CHECK(!"fixture loads");
        return;
    }
    const int32_t NL = m->hp.n_layer, L = NL + m->n_mtp_loaded, E = m->hp.n_expert,
                  K = m->hp.n_expert_used;
    CHECK_EQ(L, 7);
    di_ep_load *l;
    CHECK_EQ(di_ep_load_create(L, E, &l), DI_OK);
    m->expert_load = l;
    di_session_options so = di_session_options_default();
    so.mtp = true;
    di_session *s = NULL;
    CHECK_EQ(di_session_create(m, &so, &s), DI_OK);
    enum { T = 40 };
    int32_t tok[T];
    for (int32_t i = 0; i < T; i++) tok[i] = (i * 37 + 5) % 500;
    CHECK_EQ(di_session_forward(s, tok, 25, NULL), DI_OK);
    CHECK_EQ(di_session_forward(s, tok + 25, T - 25, NULL), DI_OK);
    di_ep_load_table t = table(L, E);
    CHECK_EQ(di_ep_load_totals(l, &t), DI_OK);
    for (int32_t layer = 0; layer < L; layer++) {
        int64_t sum = 0;
        for (int32_t e = 0; e < E; e++) sum += t.count[(int64_t)layer * E + e];
        // The MTP block of position p needs token p+1: T-1 rows after the two calls.
        CHECK_EQ(t.rows[layer], layer < NL ? T : T - 1);
        CHECK_EQ(sum, t.rows[layer] * K);
    }
    int32_t n_hash = 0;
    for (int32_t layer = 0; layer < NL; layer++) {
        const di_dsv4_layer_w *lw = &m->layers[layer];
        if (!lw->hash_routed) continue;
        n_hash++;
        int64_t want[64] = {0};
        for (int32_t i = 0; i < T; i++)
            for (int32_t k = 0; k < K; k++) want[lw->tid2eid[(int64_t)tok[i] * K + k]]++;
        for (int32_t e = 0; e < E; e++) CHECK_EQ(t.count[(int64_t)layer * E + e], want[e]);
    }
    CHECK_EQ(n_hash, 2);
    m->expert_load = NULL; // off: nothing more is counted
    CHECK_EQ(di_session_forward(s, tok, 3, NULL), DI_OK);
    di_ep_load_table u = table(L, E);
    CHECK_EQ(di_ep_load_totals(l, &u), DI_OK);
    CHECK(!memcmp(t.count, u.count, sizeof(int64_t) * (size_t)(L * E)));
    di_ep_load_table_free(&t);
    di_ep_load_table_free(&u);
    di_session_destroy(s);
    di_model_destroy(m);
    di_ep_load_destroy(l);
}

// The V4.1 forward counts through the same hook (the V4.1 tiny model, di_synth_v41_write):
// every main layer's counts sum to rows x K.
static void test_forward_counts_v41(void) {
    char root[] = "/tmp/di_test_eplb_v41_XXXXXX";
    if (!mkdtemp(root) || di_synth_v41_write(root, true, false, 41) != DI_OK) {
        CHECK(!"the V4.1 tiny model is written");
        return;
    }
    di_model_options mo = di_model_options_default();
    mo.n_threads = 2;
    di_model *m = NULL;
    const di_status lst = di_model_load(root, &mo, &m);
    CHECK_EQ(lst, DI_OK);
    if (lst != DI_OK) {
        di_test_remove_dir(root);
        return;
    }
    const int32_t NL = m->hp.n_layer, E = m->hp.n_expert, K = m->hp.n_expert_used;
    di_ep_load *l;
    CHECK_EQ(di_ep_load_create(NL + m->n_mtp_loaded, E, &l), DI_OK);
    m->expert_load = l;
    di_session_options so = di_session_options_default();
    di_session *s = NULL;
    CHECK_EQ(di_session_create(m, &so, &s), DI_OK);
    enum { T = 24 };
    int32_t tok[T];
    for (int32_t i = 0; i < T; i++) tok[i] = (i * 29 + 3) % 400;
    CHECK_EQ(di_session_forward(s, tok, T, NULL), DI_OK);
    di_ep_load_table t = table(NL + m->n_mtp_loaded, E);
    CHECK_EQ(di_ep_load_totals(l, &t), DI_OK);
    for (int32_t layer = 0; layer < NL; layer++) {
        int64_t sum = 0;
        for (int32_t e = 0; e < E; e++) sum += t.count[(int64_t)layer * E + e];
        CHECK_EQ(t.rows[layer], T);
        CHECK_EQ(sum, (int64_t)T * K);
    }
    di_ep_load_table_free(&t);
    di_session_destroy(s);
    di_model_destroy(m);
    di_ep_load_destroy(l);
    di_test_remove_dir(root);
}

typedef struct watch {
    di_engine *e;
    atomic_bool stop;
    int64_t n_reads, last_pairs;
    bool monotonic, parsed;
} watch;

// Another thread reads the stats and the per-expert load while the engine runs.
static void *watcher(void *arg) {
    watch *w = arg;
    while (!atomic_load(&w->stop)) {
        di_engine_stats st;
        di_engine_get_stats(w->e, &st);
        if (st.n_expert_pairs < w->last_pairs) w->monotonic = false;
        w->last_pairs = st.n_expert_pairs;
        char *json;
        size_t n;
        if (di_engine_expert_load(w->e, &json, &n) == DI_OK) {
            di_ep_load_table t;
            if (di_eplb_load_parse(json, n, &t, NULL, 0) != DI_OK) w->parsed = false;
            di_ep_load_table_free(&t);
            di_free_buffer(json);
        }
        w->n_reads++;
    }
    return NULL;
}

static void on_event(void *user, const di_event *ev) {
    (void)user, (void)ev;
}

static void test_engine_counts(void) {
    di_engine_options o = di_engine_options_default();
    o.n_threads = 2;
    o.kv_memory_bytes = 32u << 20;
    o.max_seqs = 4;
    o.max_ctx = 256;
    // Rows are counted below: no prefix cache, whose hits depend on whether a request is admitted
    // before or after another's prefill published the blocks they share.
    o.no_prefix_cache = true;
    di_engine *e = NULL;
    CHECK_EQ(di_engine_create(FIXTURE, &o, &e), DI_OK);
    if (!e) return;
    watch w = {.e = e, .monotonic = true, .parsed = true};
    pthread_t th;
    pthread_create(&th, NULL, watcher, &w);
    enum { P = 30, G = 8, NREQ = 3 };
    int32_t prompt[P];
    for (int32_t i = 0; i < P; i++) prompt[i] = (i * 13 + 1) % 500;
    for (int r = 0; r < NREQ; r++) {
        di_request_params p = di_request_params_default();
        p.prompt = prompt;
        p.n_prompt = P - r;
        p.max_tokens = G;
        p.ignore_eos = true;
        p.on_event = on_event;
        uint64_t id;
        CHECK_EQ(di_engine_submit(e, &p, &id), DI_OK);
    }
    di_engine_wait_idle(e);
    atomic_store(&w.stop, true);
    pthread_join(th, NULL);
    CHECK(w.n_reads > 0);
    CHECK(w.monotonic);
    CHECK(w.parsed);
    di_engine_stats st;
    di_engine_get_stats(e, &st);
    CHECK_EQ(st.n_step_allocs, 0);
    // Rows through each of the 6 main layers: every prompt token and every generated token but
    // the last (which is sampled, never fed back); K = 2. No MTP block without speculation.
    const int64_t rows = (int64_t)(3 * P - 3) + NREQ * (G - 1);
    CHECK_EQ(st.n_expert_pairs, 6 * rows * 2);
    CHECK(st.expert_load_imbalance >= 1.0);
    char *json;
    size_t n;
    CHECK_EQ(di_engine_expert_load(e, &json, &n), DI_OK);
    di_ep_load_table t;
    CHECK_EQ(di_eplb_load_parse(json, n, &t, NULL, 0), DI_OK);
    CHECK_EQ(t.n_layers, 7);
    CHECK_EQ(t.n_expert, 8);
    CHECK_EQ(di_ep_load_table_pairs(&t), st.n_expert_pairs);
    CHECK_EQ(t.rows[0], rows);
    CHECK_EQ(t.rows[6], 0);
    CHECK_NEAR(di_ep_load_table_imbalance(&t), st.expert_load_imbalance, 1e-12);
    di_ep_load_table_free(&t);
    di_free_buffer(json);
    di_engine_destroy(e);
}

int main(void) {
    RUN(test_placement_basics);
    RUN(test_planner_invariants);
    RUN(test_planner_quality);
    RUN(test_planner_front);
    RUN(test_planner_stability);
    RUN(test_rebalance);
    RUN(test_async_planner);
    RUN(test_files);
    RUN(test_load_counters);
    RUN(test_forward_counts);
    RUN(test_forward_counts_v41);
    RUN(test_engine_counts);
    return test_finish();
}
