// deepinfer eplb --load LOAD.json --ranks N --slots-per-rank S [--current PLACEMENT.json]
//                [-o PLACEMENT.json] [--tolerance F] [--min-gain G] [--front-shared N]
// deepinfer eplb --bench [--layers L] [--experts E]
// Plans an expert-parallel placement from a routing load (GET /internal/expert-load) and prints
// each layer's balance (max / mean rank load) of the contiguous placement and of the plan, and the
// replicas moved against --current; or measures the planner on Zipf loads (docs/expert-parallel.md,
// "EPLB").
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "base/mem.h"
#include "cli/args.h"
#include "cli/cli.h"
#include "ep/eplb.h"

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static void usage(FILE *f) {
    fprintf(
        f, "usage: deepinfer eplb --load LOAD.json --ranks N --slots-per-rank S "
           "[--current PLACEMENT.json] [-o PLACEMENT.json] [--tolerance F] [--min-gain G]\n"
           "       [--front-shared N]\n"
           "       deepinfer eplb --bench [--layers L] [--experts E]\n"
           "Plans where each MoE layer's experts and their redundant replicas live over N ranks of "
           "S slots\n(N x S >= experts) from a routing load (serve's GET /internal/expert-load), "
           "prints each\nlayer's balance (max / mean rank load; 1.0 = perfect) for the contiguous "
           "placement and the\nplan, and the replicas moved against --current. --tolerance "
           "(default 0.05): a plan that\nkeeps --current's replicas in place is taken when its "
           "max rank load is within this fraction\nof the best. With --current, also whether "
           "the plan is worth applying: it lowers the\nbalance by more than --min-gain (default "
           "0.05). --front-shared (default 1, the shared expert\ncount of V4 and V4.1): rank 0, "
           "the front, also computes that many shared experts per routed\nrow while the workers "
           "compute, so it counts as that much more load (0: packed like the\nothers). --bench: "
           "the planner on Zipf loads at V4-Flash shape.\n");
}

// Balance of one layer of p under the counts of layer l of t, rank 0 with its front load.
static double layer_balance(const di_ep_placement *p, const di_ep_load_table *t, int32_t l,
                            double front_load_per_row, double *w) {
    for (int32_t e = 0; e < t->n_expert; e++) w[e] = (double)t->count[(int64_t)l * t->n_expert + e];
    return di_eplb_layer_balance(p, l, w, front_load_per_row * (double)t->rows[l]);
}

static int plan(const char *load_path, const char *cur_path, const char *out_path,
                const di_eplb_options *o) {
    char why[512];
    di_ep_load_table t;
    di_status st = di_eplb_load_read(load_path, &t, why, sizeof why);
    if (st != DI_OK) {
        fprintf(stderr, "deepinfer eplb: %s: %s\n", load_path, why[0] ? why : di_status_str(st));
        return 1;
    }
    di_ep_placement cur = {0}, next = {0}, contig = {0};
    int rc = 1;
    if (cur_path) {
        st = di_eplb_placement_read(cur_path, &cur, why, sizeof why);
        if (st != DI_OK) {
            fprintf(stderr, "deepinfer eplb: %s: %s\n", cur_path, why[0] ? why : di_status_str(st));
            goto done;
        }
        if (cur.n_layers != t.n_layers || cur.n_expert != t.n_expert) {
            fprintf(stderr,
                    "deepinfer eplb: %s has %d layers of %d experts, the load %d layers of %d\n",
                    cur_path, cur.n_layers, cur.n_expert, t.n_layers, t.n_expert);
            goto done;
        }
    }
    if ((int64_t)o->n_ranks * o->slots_per_rank < t.n_expert) {
        fprintf(stderr, "deepinfer eplb: %d ranks x %d slots cannot hold %d experts\n", o->n_ranks,
                o->slots_per_rank, t.n_expert);
        rc = 2;
        goto done;
    }
    di_eplb_report rep;
    st = cur_path ? di_eplb_rebalance(&t, &cur, o, &next, &rep)
                  : di_eplb_plan(&t, o, NULL, &next, &rep);
    if (st == DI_OK) st = di_ep_placement_contiguous(t.n_layers, t.n_expert, o->n_ranks, &contig);
    if (st != DI_OK) {
        fprintf(stderr, "deepinfer eplb: planning failed: %s\n", di_status_str(st));
        goto done;
    }
    double *w = di_malloc(sizeof(double) * (size_t)t.n_expert);
    if (!w) goto done;
    printf("%d layers, %d experts, %d ranks x %d slots (%d redundant replicas per layer), "
           "%lld routed pairs\n",
           t.n_layers, t.n_expert, o->n_ranks, o->slots_per_rank,
           o->n_ranks * o->slots_per_rank - t.n_expert, (long long)di_ep_load_table_pairs(&t));
    printf("layer  contiguous  %s  eplb\n", cur_path ? "current" : "");
    for (int32_t l = 0; l < t.n_layers; l++) {
        const double f = o->front_load_per_row;
        printf("%5d  %10.4f", l, layer_balance(&contig, &t, l, f, w));
        if (cur_path) printf("  %7.4f", layer_balance(&cur, &t, l, f, w));
        printf("  %s%.4f\n", cur_path ? "" : " ", layer_balance(&next, &t, l, f, w));
    }
    di_free(w);
    printf("overall (max / mean rank load, 1.0 = perfect): contiguous %.4f",
           rep.balance_contiguous);
    if (cur_path) printf(", current %.4f", rep.balance_before);
    printf(", eplb %.4f\n", rep.balance_after);
    if (cur_path)
        printf("moves against %s: %lld of %lld replicas, %d of %d layers changed\n", cur_path,
               (long long)rep.n_moves, (long long)next.n_layers * next.n_slots,
               rep.n_layers_changed, next.n_layers);
    if (cur_path)
        printf("worth applying: %s (balance %.4f -> %.4f, minimum gain %.4f)\n",
               rep.apply ? "yes" : "no", rep.balance_before, rep.balance_after, o->min_gain);
    if (out_path) {
        st = di_eplb_placement_write(&next, out_path);
        if (st != DI_OK) {
            fprintf(stderr, "deepinfer eplb: cannot write %s: %s\n", out_path, di_status_str(st));
            goto done;
        }
        printf("wrote %s\n", out_path);
    }
    rc = 0;
done:
    di_ep_placement_free(&cur);
    di_ep_placement_free(&next);
    di_ep_placement_free(&contig);
    di_ep_load_table_free(&t);
    return rc;
}

// Zipf(s) loads of n_pairs routed pairs over a per-layer pseudo-random permutation of the experts.
static void zipf_layer(int64_t *c, int32_t E, double s, int64_t n_pairs, uint64_t seed) {
    double h = 0;
    for (int32_t i = 0; i < E; i++) h += 1.0 / pow(i + 1, s);
    for (int32_t i = 0; i < E; i++) c[i] = i; // c: the permutation first
    for (int32_t i = E - 1; i > 0; i--) {
        seed = seed * 6364136223846793005ull + 1442695040888963407ull;
        const int32_t j = (int32_t)((seed >> 33) % (uint64_t)(i + 1));
        const int64_t x = c[i];
        c[i] = c[j];
        c[j] = x;
    }
    int64_t *perm = di_malloc(sizeof(int64_t) * (size_t)E);
    memcpy(perm, c, sizeof(int64_t) * (size_t)E);
    for (int32_t i = 0; i < E; i++)
        c[perm[i]] = (int64_t)llround((double)n_pairs / pow(i + 1, s) / h);
    di_free(perm);
}

static int bench(int32_t L, int32_t E) {
    static const double skew[] = {0.5, 1.0, 1.5};
    static const int32_t ranks[] = {8, 16, 32, 64};
    static const int32_t redundant[] = {0, 16, 32, 64};
    const int64_t n_pairs = (int64_t)1 << 20; // per layer: ~175k tokens x K = 6
    di_ep_load_table t, u;
    if (di_ep_load_table_alloc(L, E, &t) != DI_OK || di_ep_load_table_alloc(L, E, &u) != DI_OK)
        return 1;
    printf("EPLB planner: %d MoE layers, %d experts, Zipf loads (%lld routed pairs per layer), "
           "balance = max / mean rank load (1.0 = perfect)\n",
           L, E, (long long)n_pairs);
    printf("| zipf s | ranks | slots/rank | redundant | contiguous | EPLB | plan ms/layer | "
           "re-plan ms/layer (+-30%%) | moves after +-10%% | moves after +-30%% |\n"
           "|---|---|---|---|---|---|---|---|---|---|\n");
    int rc = 0;
    for (size_t a = 0; a < 3; a++) {
        for (int32_t l = 0; l < L; l++)
            zipf_layer(t.count + (int64_t)l * E, E, skew[a], n_pairs, 1000 + (uint64_t)l);
        for (size_t b = 0; b < 4; b++)
            for (size_t c = 0; c < 4; c++) {
                const int32_t R = ranks[b], S = (E + redundant[c] + R - 1) / R;
                if (c > 0 && S == (E + redundant[c - 1] + R - 1) / R) continue; // same shape
                di_eplb_options o = di_eplb_options_default();
                o.n_ranks = R;
                o.slots_per_rank = S;
                di_ep_placement p, q;
                di_eplb_report rep, rq;
                const double t0 = now_s();
                if (di_eplb_plan(&t, &o, NULL, &p, &rep) != DI_OK) return 1;
                const double ms = (now_s() - t0) * 1e3 / L;
                int64_t moves[2];
                double replan_ms = 0;
                static const int32_t noise[2] = {100, 300}; // per mille
                for (int k = 0; k < 2; k++) {
                    uint64_t seed = 77 + (uint64_t)k;
                    for (int64_t i = 0; i < (int64_t)L * E; i++) {
                        seed = seed * 6364136223846793005ull + 1442695040888963407ull;
                        const int64_t d =
                            (int64_t)((seed >> 33) % (uint64_t)(2 * noise[k] + 1)) - noise[k];
                        u.count[i] = t.count[i] + t.count[i] * d / 1000;
                    }
                    const double t1 = now_s();
                    if (di_eplb_plan(&u, &o, &p, &q, &rq) != DI_OK) return 1;
                    replan_ms = (now_s() - t1) * 1e3 / L;
                    moves[k] = rq.n_moves;
                    di_ep_placement_free(&q);
                }
                const double n_rep = (double)L * R * S;
                printf("| %.1f | %d | %d | %d | %.3f | %.3f | %.2f | %.2f | %.1f%% | %.1f%% |\n",
                       skew[a], R, S, R * S - E, rep.balance_contiguous, rep.balance_after, ms,
                       replan_ms, 100.0 * (double)moves[0] / n_rep,
                       100.0 * (double)moves[1] / n_rep);
                di_ep_placement_free(&p);
            }
    }
    di_ep_load_table_free(&t);
    di_ep_load_table_free(&u);
    // The cost of counting on the forward thread: one di_ep_load_record per MoE call.
    di_ep_load *live;
    if (di_ep_load_create(L, E, &live) != DI_OK) return 1;
    enum { K = 6, MAX_ROWS = 256 };
    int32_t *sel = di_malloc(sizeof(int32_t) * MAX_ROWS * K);
    if (!sel) rc = 1;
    for (int32_t i = 0; sel && i < MAX_ROWS * K; i++)
        sel[i] = (int32_t)((i * 2654435761u) % (uint32_t)E);
    static const int32_t rows[] = {1, 16, 256};
    printf("\nload counting (di_ep_load_record, K = %d):", K);
    for (size_t r = 0; sel && r < 3; r++) {
        const int n_calls = 200000 / rows[r];
        const double t0 = now_s();
        for (int c = 0; c < n_calls; c++) di_ep_load_record(live, c % L, sel, rows[r], K);
        printf(" %d rows: %.0f ns per MoE call;", rows[r], (now_s() - t0) * 1e9 / n_calls);
    }
    printf("\n");
    di_free(sel);
    di_ep_load_destroy(live);
    return rc;
}

int di_cli_eplb(int argc, char **argv) {
    const char *load = NULL, *cur = NULL, *out = NULL;
    long ranks = 0, slots = 0, layers = 44, experts = 256, front = 1;
    double tol = 0.05, gain = 0.05;
    bool do_bench = false;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
            usage(stdout);
            return 0;
        }
        if (!strcmp(a, "--bench")) {
            do_bench = true;
            continue;
        }
        if (i + 1 >= argc) {
            fprintf(stderr, "deepinfer eplb: '%s' needs a value\n", a);
            return 2;
        }
        const char *v = argv[++i];
        if (!strcmp(a, "--load")) {
            load = v;
        } else if (!strcmp(a, "--current")) {
            cur = v;
        } else if (!strcmp(a, "-o") || !strcmp(a, "--out")) {
            out = v;
        } else if (!strcmp(a, "--ranks")) {
            if (!di_args_int(v, "--ranks", 1, 65536, &ranks)) return 2;
        } else if (!strcmp(a, "--slots-per-rank")) {
            if (!di_args_int(v, "--slots-per-rank", 1, 65536, &slots)) return 2;
        } else if (!strcmp(a, "--front-shared")) {
            if (!di_args_int(v, "--front-shared", 0, 64, &front)) return 2;
        } else if (!strcmp(a, "--layers")) {
            if (!di_args_int(v, "--layers", 1, 1024, &layers)) return 2;
        } else if (!strcmp(a, "--experts")) {
            if (!di_args_int(v, "--experts", 1, 65536, &experts)) return 2;
        } else if (!strcmp(a, "--tolerance") || !strcmp(a, "--min-gain")) {
            char *end;
            const double x = strtod(v, &end);
            if (end == v || *end || !(x >= 0 && x <= 10)) {
                fprintf(stderr, "deepinfer eplb: %s needs a number in [0, 10], got '%s'\n", a, v);
                return 2;
            }
            *(!strcmp(a, "--tolerance") ? &tol : &gain) = x;
        } else {
            fprintf(stderr, "deepinfer eplb: unknown option '%s'\n", a);
            return 2;
        }
    }
    if (do_bench) return bench((int32_t)layers, (int32_t)experts);
    if (!load || !ranks || !slots) {
        fprintf(stderr, "deepinfer eplb: --load, --ranks and --slots-per-rank are required\n");
        usage(stderr);
        return 2;
    }
    di_eplb_options o = di_eplb_options_default();
    o.n_ranks = (int32_t)ranks;
    o.slots_per_rank = (int32_t)slots;
    o.keep_tolerance = tol;
    o.min_gain = gain;
    o.front_load_per_row = (double)front;
    return plan(load, cur, out, &o);
}
