// eplb — load statistics, the replication / packing planner and the rebalancing decision
// (ep/eplb.h; files in eplb_file.c).
#include "ep/eplb.h"

#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "base/log.h"
#include "base/mem.h"

// ---- load tables ----

di_status di_ep_load_table_alloc(int32_t n_layers, int32_t n_expert, di_ep_load_table *out) {
    memset(out, 0, sizeof(*out));
    if (n_layers < 1 || n_expert < 1) return DI_ERR_INVALID;
    out->count = di_calloc(di_mul_size((size_t)n_layers, (size_t)n_expert), sizeof(int64_t));
    out->rows = di_calloc((size_t)n_layers, sizeof(int64_t));
    if (!out->count || !out->rows) {
        di_ep_load_table_free(out);
        return DI_ERR_NOMEM;
    }
    out->n_layers = n_layers;
    out->n_expert = n_expert;
    return DI_OK;
}

void di_ep_load_table_free(di_ep_load_table *t) {
    di_free(t->count);
    di_free(t->rows);
    memset(t, 0, sizeof(*t));
}

int64_t di_ep_load_table_pairs(const di_ep_load_table *t) {
    int64_t n = 0;
    for (int64_t i = 0; i < (int64_t)t->n_layers * t->n_expert; i++) n += t->count[i];
    return n;
}

double di_ep_load_table_imbalance(const di_ep_load_table *t) {
    double sum = 0;
    int32_t n = 0;
    for (int32_t l = 0; l < t->n_layers; l++) {
        const int64_t *c = t->count + (int64_t)l * t->n_expert;
        int64_t tot = 0, mx = 0;
        for (int32_t e = 0; e < t->n_expert; e++) {
            tot += c[e];
            if (c[e] > mx) mx = c[e];
        }
        if (tot <= 0) continue;
        sum += (double)mx * t->n_expert / (double)tot;
        n++;
    }
    return n ? sum / n : 0.0;
}

// ---- live counters ----

struct di_ep_load {
    int32_t n_layers, n_expert;
    _Atomic int64_t *count; // [n_layers * n_expert], written by the forward thread only
    _Atomic int64_t *rows;  // [n_layers]
    pthread_mutex_t mu;     // readers only: the window's baseline
    int64_t *base;          // [n_layers * n_expert] totals at the last window
    int64_t *base_rows;     // [n_layers]
};

di_status di_ep_load_create(int32_t n_layers, int32_t n_expert, di_ep_load **out) {
    *out = NULL;
    if (n_layers < 1 || n_expert < 1) return DI_ERR_INVALID;
    di_ep_load *l = di_calloc(1, sizeof(*l));
    if (!l) return DI_ERR_NOMEM;
    const size_t n = di_mul_size((size_t)n_layers, (size_t)n_expert);
    l->n_layers = n_layers;
    l->n_expert = n_expert;
    l->count = di_calloc(n, sizeof(*l->count));
    l->rows = di_calloc((size_t)n_layers, sizeof(*l->rows));
    l->base = di_calloc(n, sizeof(int64_t));
    l->base_rows = di_calloc((size_t)n_layers, sizeof(int64_t));
    pthread_mutex_init(&l->mu, NULL);
    if (!l->count || !l->rows || !l->base || !l->base_rows) {
        di_ep_load_destroy(l);
        return DI_ERR_NOMEM;
    }
    *out = l;
    return DI_OK;
}

void di_ep_load_destroy(di_ep_load *l) {
    if (!l) return;
    pthread_mutex_destroy(&l->mu);
    di_free((void *)l->count);
    di_free((void *)l->rows);
    di_free(l->base);
    di_free(l->base_rows);
    di_free(l);
}

int32_t di_ep_load_n_layers(const di_ep_load *l) {
    return l->n_layers;
}
int32_t di_ep_load_n_expert(const di_ep_load *l) {
    return l->n_expert;
}

// One writer: a relaxed load and store (plain moves on x86-64) instead of a locked add.
static inline void bump(_Atomic int64_t *c, int64_t v) {
    atomic_store_explicit(c, atomic_load_explicit(c, memory_order_relaxed) + v,
                          memory_order_relaxed);
}

void di_ep_load_record(di_ep_load *l, int32_t layer, const int32_t *sel, int32_t n_rows,
                       int32_t k) {
    if (!l || layer < 0 || layer >= l->n_layers || n_rows <= 0 || k <= 0) return;
    _Atomic int64_t *c = l->count + (int64_t)layer * l->n_expert;
    const uint32_t E = (uint32_t)l->n_expert;
    for (int64_t i = 0; i < (int64_t)n_rows * k; i++)
        if ((uint32_t)sel[i] < E) bump(&c[sel[i]], 1);
    bump(&l->rows[layer], n_rows);
}

void di_ep_load_summary(di_ep_load *l, int64_t *pairs, double *imbalance) {
    int64_t all = 0;
    double sum = 0;
    int32_t n = 0;
    for (int32_t layer = 0; layer < l->n_layers; layer++) {
        const _Atomic int64_t *c = l->count + (int64_t)layer * l->n_expert;
        int64_t tot = 0, mx = 0;
        for (int32_t e = 0; e < l->n_expert; e++) {
            const int64_t v = atomic_load_explicit(&c[e], memory_order_relaxed);
            tot += v;
            if (v > mx) mx = v;
        }
        all += tot;
        if (tot <= 0) continue;
        sum += (double)mx * l->n_expert / (double)tot;
        n++;
    }
    *pairs = all;
    *imbalance = n ? sum / n : 0.0;
}

di_status di_ep_load_totals(di_ep_load *l, di_ep_load_table *out) {
    if (out->n_layers != l->n_layers || out->n_expert != l->n_expert) return DI_ERR_INVALID;
    const int64_t n = (int64_t)l->n_layers * l->n_expert;
    for (int64_t i = 0; i < n; i++)
        out->count[i] = atomic_load_explicit(&l->count[i], memory_order_relaxed);
    for (int32_t i = 0; i < l->n_layers; i++)
        out->rows[i] = atomic_load_explicit(&l->rows[i], memory_order_relaxed);
    return DI_OK;
}

di_status di_ep_load_window(di_ep_load *l, di_ep_load_table *out) {
    if (out->n_layers != l->n_layers || out->n_expert != l->n_expert) return DI_ERR_INVALID;
    const int64_t n = (int64_t)l->n_layers * l->n_expert;
    pthread_mutex_lock(&l->mu);
    for (int64_t i = 0; i < n; i++) {
        const int64_t v = atomic_load_explicit(&l->count[i], memory_order_relaxed);
        out->count[i] = v - l->base[i];
        l->base[i] = v;
    }
    for (int32_t i = 0; i < l->n_layers; i++) {
        const int64_t v = atomic_load_explicit(&l->rows[i], memory_order_relaxed);
        out->rows[i] = v - l->base_rows[i];
        l->base_rows[i] = v;
    }
    pthread_mutex_unlock(&l->mu);
    return DI_OK;
}

// ---- balance and moves ----

di_eplb_options di_eplb_options_default(void) {
    return (di_eplb_options){.n_ranks = 1,
                             .slots_per_rank = 0,
                             .keep_tolerance = 0.05,
                             .min_gain = 0.05,
                             .front_load_per_row = 0};
}

// Rank loads of one layer of p into rl[n_ranks], rank 0 starting at `front` (cnt: scratch
// [n_expert]); returns the total, front included.
static double rank_loads(const di_ep_placement *p, int32_t layer, const double *load, double front,
                         int32_t *cnt, double *rl) {
    const int32_t *ex = p->expert + (int64_t)layer * p->n_slots;
    const int32_t *rk = p->rank + (int64_t)layer * p->n_slots;
    memset(cnt, 0, sizeof(int32_t) * (size_t)p->n_expert);
    memset(rl, 0, sizeof(double) * (size_t)p->n_ranks);
    for (int32_t s = 0; s < p->n_slots; s++) cnt[ex[s]]++;
    rl[0] = front;
    double tot = front;
    for (int32_t e = 0; e < p->n_expert; e++) tot += cnt[e] ? load[e] : 0;
    for (int32_t s = 0; s < p->n_slots; s++) rl[rk[s]] += load[ex[s]] / cnt[ex[s]];
    return tot;
}

static double max_of(const double *v, int32_t n) {
    double m = 0;
    for (int32_t i = 0; i < n; i++)
        if (v[i] > m) m = v[i];
    return m;
}

double di_eplb_layer_balance(const di_ep_placement *p, int32_t layer, const double *load,
                             double front) {
    int32_t *cnt = di_malloc(sizeof(int32_t) * (size_t)p->n_expert);
    double *rl = di_malloc(sizeof(double) * (size_t)p->n_ranks);
    double b = 1.0;
    if (cnt && rl) {
        const double tot = rank_loads(p, layer, load, front, cnt, rl);
        if (tot > 0) b = max_of(rl, p->n_ranks) * p->n_ranks / tot;
    }
    di_free(cnt);
    di_free(rl);
    return b;
}

// Sum over layers of max rank load and of the mean rank load (scratch allocated here).
static di_status balance_sums(const di_ep_placement *p, const di_ep_load_table *t, double front,
                              double *smax, double *smean) {
    *smax = *smean = 0;
    if (p->n_layers != t->n_layers || p->n_expert != t->n_expert) return DI_ERR_INVALID;
    int32_t *cnt = di_malloc(sizeof(int32_t) * (size_t)p->n_expert);
    double *rl = di_malloc(sizeof(double) * (size_t)p->n_ranks);
    double *w = di_malloc(sizeof(double) * (size_t)p->n_expert);
    di_status st = cnt && rl && w ? DI_OK : DI_ERR_NOMEM;
    for (int32_t l = 0; l < p->n_layers && st == DI_OK; l++) {
        for (int32_t e = 0; e < p->n_expert; e++)
            w[e] = (double)t->count[(int64_t)l * t->n_expert + e];
        const double tot = rank_loads(p, l, w, front * (double)t->rows[l], cnt, rl);
        *smax += max_of(rl, p->n_ranks);
        *smean += tot / p->n_ranks;
    }
    di_free(cnt);
    di_free(rl);
    di_free(w);
    return st;
}

di_status di_eplb_balance(const di_ep_placement *p, const di_ep_load_table *t,
                          double front_load_per_row, double *out) {
    *out = 0;
    double smax, smean;
    const di_status st = balance_sums(p, t, front_load_per_row, &smax, &smean);
    if (st != DI_OK) return st;
    *out = smean > 0 ? smax / smean : 1.0;
    return DI_OK;
}

// Moves of one layer: sum over (rank, expert) of max(0, replicas in next - replicas in cur).
// hold: scratch [max ranks * n_expert].
static int64_t layer_moves(const di_ep_placement *cur, const di_ep_placement *next, int32_t l,
                           int32_t *hold) {
    const int32_t E = cur->n_expert;
    const int32_t R = cur->n_ranks > next->n_ranks ? cur->n_ranks : next->n_ranks;
    memset(hold, 0, sizeof(int32_t) * (size_t)R * (size_t)E);
    for (int32_t s = 0; s < cur->n_slots; s++) {
        const int64_t i = (int64_t)l * cur->n_slots + s;
        hold[(int64_t)cur->rank[i] * E + cur->expert[i]]++;
    }
    int64_t moves = 0;
    for (int32_t s = 0; s < next->n_slots; s++) {
        const int64_t i = (int64_t)l * next->n_slots + s;
        int32_t *h = &hold[(int64_t)next->rank[i] * E + next->expert[i]];
        if (*h > 0)
            (*h)--;
        else
            moves++;
    }
    return moves;
}

int64_t di_eplb_moves(const di_ep_placement *cur, const di_ep_placement *next) {
    if (cur->n_layers != next->n_layers || cur->n_expert != next->n_expert) return -1;
    const int32_t R = cur->n_ranks > next->n_ranks ? cur->n_ranks : next->n_ranks;
    int32_t *hold = di_malloc(di_mul_size((size_t)R, (size_t)cur->n_expert) * sizeof(int32_t));
    if (!hold) return -1;
    int64_t moves = 0;
    for (int32_t l = 0; l < cur->n_layers; l++) moves += layer_moves(cur, next, l, hold);
    di_free(hold);
    return moves;
}

// ---- the planner ----

typedef struct item {
    double load; // load per replica
    int32_t e;
} item;

static int item_cmp(const void *a, const void *b) {
    const item *x = a, *y = b;
    if (x->load != y->load) return x->load > y->load ? -1 : 1;
    return (x->e > y->e) - (x->e < y->e);
}

// Scratch of one plan call, sized once.
typedef struct planner {
    int32_t E, R, S, N;
    double tol;
    double front;        // the layer's front load: rank 0 starts with it
    double *w;           // [E] loads of the layer
    int32_t *cnt;        // [E] replicas per expert
    int32_t *kept;       // [E] replicas already placed (kept in place) per expert
    item *items;         // [N] replicas to place, descending load per replica
    int32_t *a_rank;     // [N] sticky plan: rank of items[i]
    int32_t *work_hold;  // [R * E] replicas of each expert on each rank (plan being built)
    double *rl;          // [R] rank loads
    int32_t *rn;         // [R] replicas per rank
    uint8_t *holds;      // [R * E] rank r holds expert e (packing)
    int32_t *f_exp;      // [N] fresh plan: expert of each replica, rank-major (S per rank)
    int32_t *s_exp;      // [N] repaired plan (cur's slot layout): expert of each slot
    int32_t *ov;         // [R * R] overlap of fresh rank f with cur rank c
    int32_t *map;        // [R] fresh rank -> cur rank
    int32_t *cur_hold;   // [R * E] replicas of each expert on each rank in cur
    uint8_t *used_f;     // [R] matched fresh ranks
    uint8_t *used_c;     // [R] matched cur ranks
    uint8_t *slot_taken; // [N] emit_fresh: slot filled; emit_sticky: item i has its old slot
} planner;

static void planner_free(planner *p) {
    di_free(p->w);
    di_free(p->cnt);
    di_free(p->kept);
    di_free(p->items);
    di_free(p->a_rank);
    di_free(p->work_hold);
    di_free(p->rl);
    di_free(p->rn);
    di_free(p->holds);
    di_free(p->f_exp);
    di_free(p->s_exp);
    di_free(p->ov);
    di_free(p->map);
    di_free(p->cur_hold);
    di_free(p->used_f);
    di_free(p->used_c);
    di_free(p->slot_taken);
}

static di_status planner_init(planner *p, int32_t E, int32_t R, int32_t S, double tol) {
    memset(p, 0, sizeof(*p));
    p->E = E;
    p->R = R;
    p->S = S;
    p->N = R * S;
    p->tol = tol;
    const size_t RE = di_mul_size((size_t)R, (size_t)E), RR = di_mul_size((size_t)R, (size_t)R);
    p->w = di_malloc(sizeof(double) * (size_t)E);
    p->cnt = di_malloc(sizeof(int32_t) * (size_t)E);
    p->kept = di_malloc(sizeof(int32_t) * (size_t)E);
    p->items = di_malloc(sizeof(item) * (size_t)p->N);
    p->a_rank = di_malloc(sizeof(int32_t) * (size_t)p->N);
    p->work_hold = di_malloc(di_mul_size(RE, sizeof(int32_t)));
    p->rl = di_malloc(sizeof(double) * (size_t)R);
    p->rn = di_malloc(sizeof(int32_t) * (size_t)R);
    p->holds = di_malloc(RE ? RE : 1);
    p->f_exp = di_malloc(sizeof(int32_t) * (size_t)p->N);
    p->s_exp = di_malloc(sizeof(int32_t) * (size_t)p->N);
    p->ov = di_malloc(di_mul_size(RR, sizeof(int32_t)));
    p->map = di_malloc(sizeof(int32_t) * (size_t)R);
    p->cur_hold = di_malloc(di_mul_size(RE, sizeof(int32_t)));
    p->used_f = di_malloc((size_t)R);
    p->used_c = di_malloc((size_t)R);
    p->slot_taken = di_malloc((size_t)p->N);
    if (!p->w || !p->cnt || !p->kept || !p->items || !p->a_rank || !p->work_hold || !p->rl ||
        !p->rn || !p->holds || !p->f_exp || !p->s_exp || !p->ov || !p->map || !p->cur_hold ||
        !p->used_f || !p->used_c || !p->slot_taken) {
        planner_free(p);
        return DI_ERR_NOMEM;
    }
    return DI_OK;
}

// (a) Replica counts: one each, then one more at a time to the largest load per replica.
static void replicate(planner *p) {
    for (int32_t e = 0; e < p->E; e++) p->cnt[e] = 1;
    for (int32_t extra = p->N - p->E; extra > 0; extra--) {
        int32_t best = 0;
        double bl = p->w[0] / p->cnt[0];
        for (int32_t e = 1; e < p->E; e++) {
            const double l = p->w[e] / p->cnt[e];
            if (l > bl) {
                bl = l;
                best = e;
            }
        }
        p->cnt[best]++;
    }
}

// The least-loaded rank with a free slot, preferring ranks that do not hold e yet; ties: lower
// rank. But the front (rank 0 with a front load) is not preferred for that when a rank holding e
// would stay below the front's load with the replica: a second replica of an expert on one rank
// only costs a slot, while the front's load is the step's bottleneck once it exceeds the mean.
static int32_t pick_rank(const planner *p, int32_t e) {
    int32_t best = -1, any = -1;
    for (int32_t r = 0; r < p->R; r++) {
        if (p->rn[r] >= p->S) continue;
        if (any < 0 || p->rl[r] < p->rl[any]) any = r;
        if (p->holds[(int64_t)r * p->E + e]) continue;
        if (best < 0 || p->rl[r] < p->rl[best]) best = r;
    }
    if (best == 0 && p->front > 0 && any > 0 && p->rl[any] + p->w[e] / p->cnt[e] < p->rl[0])
        return any;
    return best >= 0 ? best : any;
}

// Replicas left to place (cnt - kept) in descending load per replica into items; their number.
static int32_t pending_items(planner *p) {
    int32_t n = 0;
    for (int32_t e = 0; e < p->E; e++)
        for (int32_t j = p->kept[e]; j < p->cnt[e]; j++)
            p->items[n++] = (item){p->w[e] / p->cnt[e], e};
    qsort(p->items, (size_t)n, sizeof(item), item_cmp);
    return n;
}

static void place(planner *p, int32_t r, int32_t e) {
    p->rl[r] += p->w[e] / p->cnt[e];
    p->rn[r]++;
    p->holds[(int64_t)r * p->E + e] = 1;
}

static void reset_ranks(planner *p) {
    memset(p->rl, 0, sizeof(double) * (size_t)p->R);
    p->rl[0] = p->front;
    memset(p->rn, 0, sizeof(int32_t) * (size_t)p->R);
    memset(p->holds, 0, (size_t)p->R * (size_t)p->E);
}

// (b) The fresh plan: f_exp[r * S + j] the j-th replica of rank r. Returns its max rank load.
static double pack_fresh(planner *p) {
    reset_ranks(p);
    memset(p->kept, 0, sizeof(int32_t) * (size_t)p->E);
    const int32_t n = pending_items(p);
    for (int32_t i = 0; i < n; i++) {
        const int32_t r = pick_rank(p, p->items[i].e);
        p->f_exp[(int64_t)r * p->S + p->rn[r]] = p->items[i].e;
        place(p, r, p->items[i].e);
    }
    return max_of(p->rl, p->R);
}

// The sticky plan: the fresh plan's greedy (replicas in descending load per replica), except
// that a replica goes to a rank that holds its expert in cur (cur_hold, [R * E]) when one with a
// free slot stays within `cap` (the least loaded of them). a_rank[i] receives the rank of items[i].
// Returns its max rank load.
static double pack_sticky(planner *p, double cap) {
    reset_ranks(p);
    memset(p->kept, 0, sizeof(int32_t) * (size_t)p->E);
    memcpy(p->work_hold, p->cur_hold, sizeof(int32_t) * (size_t)p->R * (size_t)p->E);
    const int32_t n = pending_items(p);
    const double lightest = n ? p->items[n - 1].load : 0;
    for (int32_t i = 0; i < n; i++) {
        const int32_t e = p->items[i].e;
        const double x = p->items[i].load;
        int32_t r = -1;
        // Within the cap with the rank's other free slots filled with the lightest replicas.
        for (int32_t q = 0; q < p->R; q++)
            if (p->work_hold[(int64_t)q * p->E + e] > 0 && p->rn[q] < p->S &&
                p->rl[q] + x + (p->S - p->rn[q] - 1) * lightest <= cap &&
                (r < 0 || p->rl[q] < p->rl[r]))
                r = q;
        if (r >= 0)
            p->work_hold[(int64_t)r * p->E + e]--;
        else
            r = pick_rank(p, e);
        p->a_rank[i] = r;
        place(p, r, e);
    }
    return max_of(p->rl, p->R);
}

// Lays the sticky plan out on cur's slots (crk: rank of each slot, cex: its expert): a replica
// takes a slot of its rank that held its expert, else the rank's first free slot.
static void emit_sticky(planner *p, const int32_t *cex, const int32_t *crk, int32_t *oex) {
    const int32_t N = p->N;
    for (int32_t s = 0; s < N; s++) oex[s] = -1;
    for (int32_t i = 0; i < N; i++) {
        const int32_t e = p->items[i].e, r = p->a_rank[i];
        p->slot_taken[i] = 0; // here: item i has a slot
        for (int32_t s = 0; s < N; s++)
            if (crk[s] == r && cex[s] == e && oex[s] < 0) {
                oex[s] = e;
                p->slot_taken[i] = 1;
                break;
            }
    }
    for (int32_t i = 0; i < N; i++) {
        if (p->slot_taken[i]) continue;
        for (int32_t s = 0; s < N; s++)
            if (crk[s] == p->a_rank[i] && oex[s] < 0) {
                oex[s] = p->items[i].e;
                break;
            }
    }
}

// Replicas of layout nex (on cur's slots: crk) that land on a rank without a replica of their
// expert in cur (cur_hold); uses work_hold.
static int64_t slot_moves(planner *p, const int32_t *crk, const int32_t *nex) {
    memcpy(p->work_hold, p->cur_hold, sizeof(int32_t) * (size_t)p->R * (size_t)p->E);
    int64_t moves = 0;
    for (int32_t s = 0; s < p->N; s++) {
        int32_t *h = &p->work_hold[(int64_t)crk[s] * p->E + nex[s]];
        if (*h > 0)
            (*h)--;
        else
            moves++;
    }
    return moves;
}

// Swaps the experts of slots a and b of the repaired plan (s_exp), updating loads and holdings.
static void swap_slots(planner *p, const int32_t *crk, int32_t a, int32_t b) {
    const int32_t E = p->E, ea = p->s_exp[a], eb = p->s_exp[b], A = crk[a], B = crk[b];
    const double la = p->w[ea] / p->cnt[ea], lb = p->w[eb] / p->cnt[eb];
    p->rl[A] += lb - la;
    p->rl[B] += la - lb;
    p->work_hold[(int64_t)A * E + ea]--;
    p->work_hold[(int64_t)A * E + eb]++;
    p->work_hold[(int64_t)B * E + eb]--;
    p->work_hold[(int64_t)B * E + ea]++;
    p->s_exp[a] = eb;
    p->s_exp[b] = ea;
}

// The repaired plan into s_exp (on cur's slots): every replica of cur kept in its slot while the
// new replica counts allow, the others in descending load onto the least-loaded ranks' free
// slots, then swaps of two replicas between the fullest rank and another one, the swap that
// lowers the larger of the two ranks' loads the most first, until the fullest rank is within
// cap or no swap helps. Returns its max rank load.
static double pack_repair(planner *p, const int32_t *cex, const int32_t *crk, double cap) {
    const int32_t E = p->E, N = p->N;
    reset_ranks(p);
    memset(p->kept, 0, sizeof(int32_t) * (size_t)E);
    memset(p->work_hold, 0, sizeof(int32_t) * (size_t)p->R * (size_t)E);
    for (int32_t s = 0; s < N; s++) {
        const int32_t e = cex[s];
        p->s_exp[s] = -1;
        if (p->kept[e] >= p->cnt[e]) continue;
        p->kept[e]++;
        p->s_exp[s] = e;
        place(p, crk[s], e);
        p->work_hold[(int64_t)crk[s] * E + e]++;
    }
    const int32_t n = pending_items(p);
    for (int32_t i = 0; i < n; i++) {
        const int32_t e = p->items[i].e, r = pick_rank(p, e);
        for (int32_t s = 0; s < N; s++)
            if (crk[s] == r && p->s_exp[s] < 0) {
                p->s_exp[s] = e;
                break;
            }
        place(p, r, e);
        p->work_hold[(int64_t)r * E + e]++;
    }
    // Two replicas of an expert on one rank (the free slots left were on ranks holding it):
    // swapped with a replica of another rank, the swap that keeps the larger load lowest.
    for (int32_t sa = 0; sa < N; sa++) {
        const int32_t A = crk[sa], ea = p->s_exp[sa];
        if (p->work_hold[(int64_t)A * E + ea] < 2 || p->cnt[ea] > p->R) continue;
        const double la = p->w[ea] / p->cnt[ea];
        int32_t bb = -1;
        double best = INFINITY;
        for (int32_t sb = 0; sb < N; sb++) {
            const int32_t B = crk[sb], eb = p->s_exp[sb];
            if (B == A || eb == ea || p->work_hold[(int64_t)B * E + ea] ||
                p->work_hold[(int64_t)A * E + eb])
                continue;
            const double lb = p->w[eb] / p->cnt[eb];
            const double na = p->rl[A] - la + lb, nb = p->rl[B] - lb + la;
            if ((na > nb ? na : nb) < best) {
                best = na > nb ? na : nb;
                bb = sb;
            }
        }
        if (bb < 0) return INFINITY; // cannot be undone by one swap: not this plan
        swap_slots(p, crk, sa, bb);
    }
    for (int32_t it = 0; it < 4 * N; it++) {
        int32_t A = 0;
        for (int32_t r = 1; r < p->R; r++)
            if (p->rl[r] > p->rl[A]) A = r;
        if (p->rl[A] <= cap) break;
        int32_t ba = -1, bb = -1;
        double best = p->rl[A] * (1 - 1e-12);
        for (int32_t sa = 0; sa < N; sa++) {
            if (crk[sa] != A) continue;
            const int32_t ea = p->s_exp[sa];
            const double la = p->w[ea] / p->cnt[ea];
            for (int32_t sb = 0; sb < N; sb++) {
                const int32_t B = crk[sb], eb = p->s_exp[sb];
                if (B == A || eb == ea) continue;
                const double lb = p->w[eb] / p->cnt[eb];
                if (lb >= la || p->work_hold[(int64_t)A * E + eb] ||
                    p->work_hold[(int64_t)B * E + ea])
                    continue;
                const double na = p->rl[A] - la + lb, nb = p->rl[B] - lb + la;
                const double m = na > nb ? na : nb;
                if (m < best) {
                    best = m;
                    ba = sa;
                    bb = sb;
                }
            }
        }
        if (ba < 0) break;
        swap_slots(p, crk, ba, bb);
    }
    return max_of(p->rl, p->R);
}

// Renumbers the fresh plan's ranks to overlap cur's (same n_ranks) the most: greedy matching on
// the overlap matrix, largest first, ties to the lower fresh rank then the lower cur rank.
static void match_ranks(planner *p, const int32_t *cex, const int32_t *crk, int32_t n_cur) {
    const int32_t R = p->R, E = p->E, S = p->S;
    memset(p->cur_hold, 0, sizeof(int32_t) * (size_t)R * (size_t)E);
    for (int32_t s = 0; s < n_cur; s++) p->cur_hold[(int64_t)crk[s] * E + cex[s]]++;
    memset(p->ov, 0, sizeof(int32_t) * (size_t)R * (size_t)R);
    for (int32_t f = 0; f < R; f++)
        for (int32_t j = 0; j < S; j++) {
            const int32_t e = p->f_exp[(int64_t)f * S + j];
            for (int32_t c = 0; c < R; c++)
                p->ov[(int64_t)f * R + c] += p->cur_hold[(int64_t)c * E + e] > 0;
        }
    memset(p->used_f, 0, (size_t)(uint32_t)R);
    memset(p->used_c, 0, (size_t)(uint32_t)R);
    int32_t k0 = 0;
    if (p->front > 0) { // the front's rank was packed with its load: it stays rank 0
        p->used_f[0] = p->used_c[0] = 1;
        p->map[0] = 0;
        k0 = 1;
    }
    for (int32_t k = k0; k < R; k++) {
        int32_t bf = -1, bc = -1, bv = -1;
        for (int32_t f = 0; f < R; f++) {
            if (p->used_f[f]) continue;
            for (int32_t c = 0; c < R; c++)
                if (!p->used_c[c] && p->ov[(int64_t)f * R + c] > bv) {
                    bv = p->ov[(int64_t)f * R + c];
                    bf = f;
                    bc = c;
                }
        }
        p->used_f[bf] = p->used_c[bc] = 1;
        p->map[bf] = bc;
    }
}

// Writes the fresh plan into layer l of out: fresh rank f becomes rank map[f]; on cur's slot
// layout (crk/cex, when given) a replica takes the slot that held the same expert, else the
// rank's first free slot; without it, slots are rank-major.
static void emit_fresh(planner *p, const int32_t *cex, const int32_t *crk, int32_t *oex,
                       int32_t *ork) {
    const int32_t R = p->R, S = p->S, N = p->N;
    if (!crk) {
        for (int32_t c = 0; c < R; c++) {
            int32_t f = 0;
            while (p->map[f] != c) f++;
            for (int32_t j = 0; j < S; j++) {
                oex[c * S + j] = p->f_exp[(int64_t)f * S + j];
                ork[c * S + j] = c;
            }
        }
        return;
    }
    memset(p->slot_taken, 0, (size_t)N);
    for (int32_t s = 0; s < N; s++) ork[s] = crk[s];
    for (int32_t f = 0; f < R; f++) {
        const int32_t c = p->map[f];
        for (int32_t j = 0; j < S; j++) { // first the replicas that stay in a slot of theirs
            const int32_t e = p->f_exp[(int64_t)f * S + j];
            for (int32_t s = 0; s < N; s++)
                if (crk[s] == c && !p->slot_taken[s] && cex[s] == e) {
                    p->slot_taken[s] = 1;
                    oex[s] = e;
                    p->f_exp[(int64_t)f * S + j] = -1 - e; // placed
                    break;
                }
        }
        for (int32_t j = 0; j < S; j++) {
            const int32_t e = p->f_exp[(int64_t)f * S + j];
            if (e < 0) continue;
            for (int32_t s = 0; s < N; s++)
                if (crk[s] == c && !p->slot_taken[s]) {
                    p->slot_taken[s] = 1;
                    oex[s] = e;
                    break;
                }
        }
    }
}

// True when layer l of cur has exactly S replicas on every rank (its slot layout can be kept).
static bool uniform_layout(const di_ep_placement *cur, int32_t l, int32_t S, int32_t *rn) {
    memset(rn, 0, sizeof(int32_t) * (size_t)cur->n_ranks);
    for (int32_t s = 0; s < cur->n_slots; s++) rn[cur->rank[(int64_t)l * cur->n_slots + s]]++;
    for (int32_t r = 0; r < cur->n_ranks; r++)
        if (rn[r] != S) return false;
    return true;
}

static bool options_ok(const di_eplb_options *o, int32_t n_expert, int32_t n_layers) {
    if (o->n_ranks < 1 || o->slots_per_rank < 1) return false;
    const int64_t N = (int64_t)o->n_ranks * o->slots_per_rank;
    if (N < n_expert || N * n_layers > INT32_MAX) return false;
    return isfinite(o->keep_tolerance) && o->keep_tolerance >= 0 && isfinite(o->min_gain) &&
           o->min_gain >= 0 && isfinite(o->front_load_per_row) && o->front_load_per_row >= 0;
}

di_status di_eplb_plan(const di_ep_load_table *t, const di_eplb_options *opt,
                       const di_ep_placement *cur, di_ep_placement *out, di_eplb_report *report) {
    memset(out, 0, sizeof(*out));
    if (report) memset(report, 0, sizeof(*report));
    if (!t || t->n_layers < 1 || t->n_expert < 1 || !t->count || !t->rows || !opt ||
        !options_ok(opt, t->n_expert, t->n_layers))
        return DI_ERR_INVALID;
    for (int64_t i = 0; i < (int64_t)t->n_layers * t->n_expert; i++)
        if (t->count[i] < 0) return DI_ERR_INVALID;
    for (int32_t l = 0; l < t->n_layers; l++)
        if (t->rows[l] < 0) return DI_ERR_INVALID;
    if (cur) {
        char why[160];
        if (cur->n_layers != t->n_layers || cur->n_expert != t->n_expert ||
            di_ep_placement_check(cur, why, sizeof why) != DI_OK)
            return DI_ERR_INVALID;
    }
    const int32_t E = t->n_expert, R = opt->n_ranks, S = opt->slots_per_rank, N = R * S;
    const bool same_ranks = cur && cur->n_ranks == R;
    const bool same_slots = same_ranks && cur->n_slots == N;
    planner p;
    di_status st = planner_init(&p, E, R, S, opt->keep_tolerance);
    if (st != DI_OK) return st;
    st = di_ep_placement_alloc(t->n_layers, E, R, N, out);
    for (int32_t l = 0; l < t->n_layers && st == DI_OK; l++) {
        for (int32_t e = 0; e < E; e++) p.w[e] = (double)t->count[(int64_t)l * E + e];
        p.front = opt->front_load_per_row * (double)t->rows[l];
        replicate(&p);
        const double best = pack_fresh(&p);
        const int32_t *cex = cur ? cur->expert + (int64_t)l * cur->n_slots : NULL;
        const int32_t *crk = cur ? cur->rank + (int64_t)l * cur->n_slots : NULL;
        int32_t *oex = out->expert + (int64_t)l * N, *ork = out->rank + (int64_t)l * N;
        const bool keep_layout = same_slots && uniform_layout(cur, l, S, p.rn);
        if (keep_layout) {
            // The layer as it is, when within the tolerance of the fresh plan (its replica
            // counts included); else the sticky plan under a cap lowered step by step (fewer
            // kept replicas, more room for the others) until it is within the tolerance; else
            // the fresh plan.
            const double cap = best * (1.0 + p.tol) + 1e-9 * best;
            rank_loads(cur, l, p.w, p.front, p.kept, p.rl);
            if (max_of(p.rl, R) <= cap) {
                memcpy(oex, cex, sizeof(int32_t) * (size_t)N);
                memcpy(ork, crk, sizeof(int32_t) * (size_t)N);
                continue;
            }
            memset(p.cur_hold, 0, sizeof(int32_t) * (size_t)R * (size_t)E);
            for (int32_t s = 0; s < N; s++) p.cur_hold[(int64_t)crk[s] * E + cex[s]]++;
            const bool repaired = pack_repair(&p, cex, crk, cap) <= cap;
            static const double k_keep[] = {1.0, 0.98, 0.95, 0.9, 0.8};
            bool kept = false;
            for (size_t i = 0; i < sizeof k_keep / sizeof k_keep[0] && !kept; i++)
                kept = pack_sticky(&p, cap * k_keep[i]) <= cap;
            if (kept) emit_sticky(&p, cex, crk, oex);
            // Of the plans within the tolerance, the one that moves fewer replicas.
            if (repaired && (!kept || slot_moves(&p, crk, p.s_exp) <= slot_moves(&p, crk, oex)))
                memcpy(oex, p.s_exp, sizeof(int32_t) * (size_t)N);
            if (repaired || kept) {
                memcpy(ork, crk, sizeof(int32_t) * (size_t)N);
                continue;
            }
        }
        if (same_ranks) {
            match_ranks(&p, cex, crk, cur->n_slots);
        } else {
            for (int32_t r = 0; r < R; r++) p.map[r] = r;
        }
        emit_fresh(&p, keep_layout ? cex : NULL, keep_layout ? crk : NULL, oex, ork);
    }
    planner_free(&p);
    if (st != DI_OK) {
        di_ep_placement_free(out);
        return st;
    }
    if (report) {
        di_ep_placement contig = {0};
        const double f = opt->front_load_per_row;
        st = di_eplb_balance(out, t, f, &report->balance_after);
        if (st == DI_OK && cur) st = di_eplb_balance(cur, t, f, &report->balance_before);
        if (st == DI_OK) st = di_ep_placement_contiguous(t->n_layers, E, R, &contig);
        if (st == DI_OK) st = di_eplb_balance(&contig, t, f, &report->balance_contiguous);
        di_ep_placement_free(&contig);
        if (st == DI_OK && cur) {
            const int32_t RM = cur->n_ranks > R ? cur->n_ranks : R;
            int32_t *hold = di_malloc(di_mul_size((size_t)RM, (size_t)E) * sizeof(int32_t));
            if (!hold) st = DI_ERR_NOMEM;
            for (int32_t l = 0; l < t->n_layers && st == DI_OK; l++) {
                const int64_t m = layer_moves(cur, out, l, hold);
                report->n_moves += m;
                report->n_layers_changed += m > 0;
            }
            di_free(hold);
        } else if (st == DI_OK) {
            report->n_moves = (int64_t)t->n_layers * N;
            report->n_layers_changed = t->n_layers;
        }
        if (st != DI_OK) di_ep_placement_free(out);
    }
    return st;
}

di_status di_eplb_rebalance(const di_ep_load_table *window, const di_ep_placement *cur,
                            const di_eplb_options *opt, di_ep_placement *next,
                            di_eplb_report *report) {
    memset(next, 0, sizeof(*next));
    memset(report, 0, sizeof(*report));
    if (!cur) return DI_ERR_INVALID;
    const di_status st = di_eplb_plan(window, opt, cur, next, report);
    if (st != DI_OK) return st;
    report->apply = di_ep_load_table_pairs(window) > 0 && report->n_moves > 0 &&
                    report->balance_before - report->balance_after > opt->min_gain;
    return DI_OK;
}
