// dev_common's KV-aware split (src/model/dev_common.c di_dev_split_mem) on synthetic layer tables
// against a brute force over every split: the most blocks every stage holds (max-min), then the
// smallest largest stage; unequal budgets; the weight balance without budgets; the refusal of a
// split whose bottleneck stage cannot hold one sequence's blocks; di_dev_stage_budgets on the CPU
// backend's test hook (di_cpu_backend_set_mem).
#include "harness.h"

#include "backend/backend.h"
#include "model/dev_common.h"

// A synthetic model: per layer weight bytes, block bytes, per-slot bytes; the first stage also
// holds emb bytes, the last head bytes and head_blk bytes per block (a DSpark-like block) —
// and a "mirror": a stage starting after layer src_of[il] but holding il pays blk[src] again.
typedef struct table {
    int32_t L;
    int64_t w[64], blk[64], fix[64], emb, head, head_blk;
    int32_t src_of[64]; // the layer whose block rows layer il reads (il itself or earlier)
} table;

static void cost_fn(const void *ctx, int32_t l0, int32_t l1, int32_t L, di_dev_stage_cost *out) {
    const table *t = ctx;
    di_dev_stage_cost c = {0};
    for (int32_t il = l0; il < l1; il++) {
        c.weight_bytes += t->w[il];
        c.block_bytes += t->blk[il];
        c.fixed_bytes += t->fix[il];
    }
    for (int32_t j = 0; j < l0; j++) { // mirrors of earlier sources read here
        bool read = false;
        for (int32_t il = l0; il < l1; il++) read |= t->src_of[il] == j;
        if (read) c.block_bytes += t->blk[j];
    }
    if (l0 == 0) c.weight_bytes += t->emb;
    if (l1 == L) c.weight_bytes += t->head, c.block_bytes += t->head_blk;
    *out = c;
}

static int64_t blocks_of(const di_dev_stage_cost *c, int64_t budget) {
    const int64_t left = budget - c->weight_bytes - c->fixed_bytes;
    if (left < 0) return -1;
    return c->block_bytes > 0 ? left / c->block_bytes : INT64_MAX;
}

// Brute force over every split: the most blocks every stage holds, then the least largest stage
// (which of several such splits the DP returns is its tie rule's: not compared).
typedef struct best {
    int64_t blocks, weight;
    bool any;
} best;

static void brute(const table *t, int32_t n, const int64_t *budget, int32_t k, int32_t at,
                  int32_t *l0, best *b) {
    if (k == n) {
        if (at != t->L) return;
        int64_t mb = INT64_MAX, mw = 0;
        for (int32_t s = 0; s < n; s++) {
            di_dev_stage_cost c;
            cost_fn(t, l0[s], l0[s + 1], t->L, &c);
            const int64_t bl = budget ? blocks_of(&c, budget[s]) : -1;
            if (bl < mb) mb = bl;
            if (c.weight_bytes > mw) mw = c.weight_bytes;
        }
        if (!b->any || mb > b->blocks || (mb == b->blocks && mw < b->weight)) {
            b->any = true, b->blocks = mb, b->weight = mw;
        }
        return;
    }
    for (int32_t e = at + 1; e <= t->L - (n - k - 1); e++) {
        l0[k + 1] = e;
        brute(t, n, budget, k + 1, e, l0, b);
    }
}

static uint64_t g_rng = 0x9e3779b97f4a7c15ull;
static int64_t rnd(int64_t lo, int64_t hi) {
    g_rng ^= g_rng << 13, g_rng ^= g_rng >> 7, g_rng ^= g_rng << 17;
    return lo + (int64_t)(g_rng % (uint64_t)(hi - lo + 1));
}

// Random tables (up to 11 layers, 1..4 stages, unequal budgets, mirrors): the DP reaches the brute
// force's blocks and then its largest stage; without budgets the least largest stage.
static void test_vs_brute(void) {
#if defined(DI_ASAN) || defined(__SANITIZE_ADDRESS__)
    const int n_cases = 60;
#else
    const int n_cases = 400;
#endif
    int n_differs = 0;
    for (int tc = 0; tc < n_cases; tc++) {
        table t = {.L = (int32_t)rnd(1, 11)};
        for (int32_t il = 0; il < t.L; il++) {
            t.w[il] = rnd(1, 100);
            t.blk[il] = rnd(0, 3) ? rnd(1, 8) : 0;
            t.fix[il] = rnd(0, 20);
            t.src_of[il] = (int32_t)rnd(0, il);
        }
        t.emb = rnd(0, 80), t.head = rnd(0, 80), t.head_blk = rnd(0, 4);
        const int32_t n = (int32_t)rnd(1, t.L < 4 ? t.L : 4);
        int64_t budget[8];
        for (int32_t k = 0; k < n; k++) budget[k] = rnd(200, 2000);
        di_dev_split_out sp;
        const di_status st = di_dev_split_mem("test", t.L, n, cost_fn, &t, budget, 0, &sp);
        best b = {0};
        int32_t l0[9] = {0};
        brute(&t, n, budget, 0, 0, l0, &b);
        if (b.blocks < 0) { // no split holds even the weights and fixed state somewhere
            CHECK_EQ(st, DI_ERR_NOMEM);
            continue;
        }
        CHECK_EQ(st, DI_OK);
        if (st != DI_OK) continue;
        CHECK_EQ(sp.n_blocks, b.blocks);
        int64_t mw = 0;
        for (int32_t k = 0; k < n; k++)
            if (sp.cost[k].weight_bytes > mw) mw = sp.cost[k].weight_bytes;
        CHECK_EQ(mw, b.weight);
        CHECK(sp.by_memory && sp.layer0[0] == 0 && sp.layer0[n] == t.L);
        for (int32_t k = 0; k < n; k++) { // the outcome is the split's own numbers
            di_dev_stage_cost c;
            CHECK(sp.layer0[k] < sp.layer0[k + 1]);
            cost_fn(&t, sp.layer0[k], sp.layer0[k + 1], t.L, &c);
            CHECK_EQ(sp.blocks[k], blocks_of(&c, budget[k]));
            CHECK(sp.blocks[k] >= sp.n_blocks);
        }
        // Without budgets: the weight balance, the brute force's least largest stage.
        di_dev_split_out wp;
        CHECK_EQ(di_dev_split_mem("test", t.L, n, cost_fn, &t, NULL, 1, &wp), DI_OK);
        CHECK(!wp.by_memory && wp.n_blocks == -1);
        best bw = {0};
        brute(&t, n, NULL, 0, 0, l0, &bw);
        int64_t ww = 0;
        for (int32_t k = 0; k < n; k++) {
            CHECK_EQ(wp.blocks[k], -1);
            if (wp.cost[k].weight_bytes > ww) ww = wp.cost[k].weight_bytes;
        }
        CHECK_EQ(ww, bw.weight);
        for (int32_t k = 1; k < n; k++) n_differs += wp.layer0[k] != sp.layer0[k];
    }
    CHECK(n_differs > 0); // the memory changes the split on some tables
}

// A known answer: 4 equal layers, all weights equal, layers 2 and 3 keep twice the block bytes;
// two stages of equal memory. Weights alone: [0, 2) [2, 4). KV-aware: [0, 3) [3, 4) holds more
// blocks (the heavy layers no longer share a stage); a smaller second device moves the cut back.
static void test_known(void) {
    table t = {.L = 4, .w = {100, 100, 100, 100}, .blk = {1, 1, 4, 4}, .src_of = {0, 1, 2, 3}};
    int64_t budget[2] = {1000, 1000};
    di_dev_split_out sp;
    CHECK_EQ(di_dev_split_mem("test", 4, 2, cost_fn, &t, NULL, 0, &sp), DI_OK);
    CHECK(sp.layer0[1] == 2);
    CHECK_EQ(di_dev_split_mem("test", 4, 2, cost_fn, &t, budget, 0, &sp), DI_OK);
    // [0,3): 700 left / 6 = 116; [3,4): 900 / 4 = 225 -> 116. [0,2): 800 / 2 = 400, [2,4): 800 /
    // 8 = 100 -> 100. [0,1): 900, [1,4): 700 / 9 = 77.
    CHECK_EQ(sp.layer0[1], 3);
    CHECK_EQ(sp.n_blocks, 116);
    CHECK_EQ(sp.blocks[0], 116);
    CHECK_EQ(sp.blocks[1], 225);
    CHECK_EQ(sp.cost[0].weight_bytes, 300);
    CHECK_EQ(sp.budget_bytes[1], 1000);
    // A second device of 500 bytes: [0,3) [3,4) gives min(116, 100) = 100, [0,2) [2,4) min(400,
    // 37): the cut stays at 3. A second device of 5000 and a first of 600: [0,1) 500 / 1 = 500,
    // [1,4) 4700 / 9 = 522 -> 500 beats [0,2) 400 / 2 = 200 and [0,3) 300 / 6 = 50.
    budget[1] = 500;
    CHECK_EQ(di_dev_split_mem("test", 4, 2, cost_fn, &t, budget, 0, &sp), DI_OK);
    CHECK_EQ(sp.layer0[1], 3);
    CHECK_EQ(sp.n_blocks, 100);
    budget[0] = 600, budget[1] = 5000;
    CHECK_EQ(di_dev_split_mem("test", 4, 2, cost_fn, &t, budget, 0, &sp), DI_OK);
    CHECK_EQ(sp.layer0[1], 1);
    CHECK_EQ(sp.n_blocks, 500);
    // Ties on blocks go to the lighter largest stage: no block bytes at all (every split holds
    // unbounded blocks) gives the weight balance.
    table z = {.L = 4, .w = {10, 10, 10, 30}, .src_of = {0, 1, 2, 3}};
    CHECK_EQ(di_dev_split_mem("test", 4, 2, cost_fn, &z, budget, 0, &sp), DI_OK);
    CHECK_EQ(sp.n_blocks, INT64_MAX);
    CHECK_EQ(sp.layer0[1], 3);
}

// The refusal: the best split's bottleneck cannot hold its weights, fixed state and one sequence
// (min_blocks), or its weights at all: DI_ERR_NOMEM, out untouched. Bad counts: DI_ERR_INVALID.
static void test_refusal(void) {
    table t = {.L = 4, .w = {100, 100, 100, 100}, .blk = {1, 1, 4, 4}, .src_of = {0, 1, 2, 3}};
    const int64_t budget[2] = {1000, 1000};
    di_dev_split_out sp = {.n_stages = -7};
    CHECK_EQ(di_dev_split_mem("test", 4, 2, cost_fn, &t, budget, 117, &sp), DI_ERR_NOMEM);
    CHECK_EQ(sp.n_stages, -7);
    CHECK_EQ(di_dev_split_mem("test", 4, 2, cost_fn, &t, budget, 116, &sp), DI_OK);
    const int64_t tiny[2] = {150, 150}; // 200 bytes of weights on some stage whatever the cut
    CHECK_EQ(di_dev_split_mem("test", 4, 2, cost_fn, &t, tiny, 0, &sp), DI_ERR_NOMEM);
    CHECK_EQ(di_dev_split_mem("test", 4, 0, cost_fn, &t, budget, 0, &sp), DI_ERR_INVALID);
    CHECK_EQ(di_dev_split_mem("test", 4, 5, cost_fn, &t, budget, 0, &sp), DI_ERR_INVALID);
}

// di_dev_stage_budgets on CPU backends of the test hook's memory: each one's free memory less the
// reserve (floored at 0), one backend listed twice sharing its memory; false when one cannot say.
static void test_budgets(void) {
    di_backend *a = NULL, *b = NULL;
    CHECK_EQ(di_cpu_backend_create(1, &a), DI_OK);
    CHECK_EQ(di_cpu_backend_create(1, &b), DI_OK);
    if (!a || !b) return;
    di_cpu_backend_set_mem(a, 3000, 4000);
    di_cpu_backend_set_mem(b, 1000, 4000);
    int64_t budget[3];
    di_backend *const two[2] = {a, b};
    CHECK(di_dev_stage_budgets(two, 2, 500, budget));
    CHECK(budget[0] == 2500 && budget[1] == 500);
    di_backend *const same[3] = {a, a, b};
    CHECK(di_dev_stage_budgets(same, 3, 2000, budget));
    CHECK(budget[0] == 0 && budget[1] == 0 && budget[2] == 0); // 1500 - 2000, floored
    CHECK(di_dev_stage_budgets(same, 3, 100, budget));
    CHECK(budget[0] == 1400 && budget[1] == 1400 && budget[2] == 900);
    di_cpu_backend_set_mem(b, 1, 0); // b cannot say: no budgets (the weight balance then)
    CHECK(!di_dev_stage_budgets(two, 2, 500, budget));
    di_backend_destroy(a);
    di_backend_destroy(b);
}

int main(void) {
    RUN(test_known);
    RUN(test_refusal);
    RUN(test_vs_brute);
    RUN(test_budgets);
    return test_finish();
}
