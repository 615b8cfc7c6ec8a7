// dev_common — the pieces both device-resident forwards share (dev_common.h).
#include "model/dev_common.h"

#include "base/log.h"
#include "base/mem.h"
#include "base/status.h" // DI_TRY

static di_status track(di_dev_up *u, void *p) {
    if (u->n_blocks == u->cap_blocks) {
        int32_t cap = u->cap_blocks ? 2 * u->cap_blocks : 64;
        void **q = di_realloc(u->blocks, sizeof(void *) * (size_t)cap);
        if (!q) return DI_ERR_NOMEM;
        u->blocks = q;
        u->cap_blocks = cap;
    }
    u->blocks[u->n_blocks++] = p;
    return DI_OK;
}

di_status di_dev_up_bytes(di_dev_up *u, const void *host, size_t bytes, void **out) {
    di_backend *b = u->b;
    void *p = NULL;
    di_status st = b->vt->alloc(b, bytes, &p);
    if (st != DI_OK) return st;
    if ((st = track(u, p)) != DI_OK) {
        b->vt->free(b, p);
        return st;
    }
    if ((st = b->vt->upload(b, p, host, bytes)) != DI_OK) return st;
    *out = p;
    return DI_OK;
}

di_status di_dev_up_floats(di_dev_up *u, const float *host, int64_t n, float **out) {
    void *p = NULL;
    di_status st = di_dev_up_bytes(u, host, sizeof(float) * (size_t)n, &p);
    if (st == DI_OK) *out = p;
    return st;
}

di_status di_dev_up_weight(di_dev_up *u, const di_tensor *w, di_tensor *out) {
    if (!u->b->vt->supports_matmul(u->b, w)) {
        DI_LOG_ERROR("%s: backend %s cannot multiply %s (%s)", u->who, u->b->vt->name,
                     w->name ? w->name : "?", di_tensor_kind_name(w->kind));
        return DI_ERR_UNSUPPORTED;
    }
    di_status st = u->b->vt->weight_upload(u->b, w, out);
    if (st != DI_OK)
        DI_LOG_ERROR("%s: cannot upload %s to %s", u->who, w->name ? w->name : "?", u->b->desc);
    return st;
}

// The experts' tensors: each uploaded, then the array of them copied into backend memory.
static di_status up_experts(di_dev_up *u, const di_tensor *w, int32_t E, di_tensor *tmp,
                            const di_tensor **out) {
    di_status st = DI_OK;
    for (int32_t e = 0; e < E && st == DI_OK; e++) st = di_dev_up_weight(u, &w[e], &tmp[e]);
    void *p = NULL;
    if (st == DI_OK) st = di_dev_up_bytes(u, tmp, sizeof(di_tensor) * (size_t)E, &p);
    if (st == DI_OK) *out = p;
    return st;
}

di_status di_dev_up_moe(di_dev_up *u, const di_model *m, const di_dsv4_layer_w *lw, di_tensor *tmp,
                        di_backend_moe_w *mw) {
    const di_hparams *hp = &m->hp;
    const int32_t E = lw->n_expert, K = lw->n_expert_used;
    di_status st = DI_OK;
    mw->n_expert = E;
    mw->n_used = K;
    mw->D = hp->n_embd;
    mw->F = lw->w1[0].ne[1];
    mw->route_scale = hp->route_scale;
    mw->swiglu_limit = hp->swiglu_limit;
    mw->shared_clamp = hp->shared_expert_clamp;
    mw->official = m->opt.precision == DI_PRECISION_OFFICIAL;
    // dsv4_moe.c: R-HF's denominator epsilon; V4's official recipe has none, V4.1's has it.
    mw->hf_eps = !mw->official || hp->v41;
    if (hp->v41) {
        mw->gate_temp = hp->gate_temp;
        mw->a8_block = 32;
    }
    DI_TRY(di_dev_up_weight(u, &lw->gate, &mw->gate));
    if (lw->hash_routed) {
        void *p = NULL;
        DI_TRY(
            di_dev_up_bytes(u, lw->tid2eid, sizeof(int32_t) * (size_t)hp->n_vocab * (size_t)K, &p));
        mw->tid2eid = p;
    } else {
        float *p = NULL;
        DI_TRY(di_dev_up_floats(u, lw->gate_bias, E, &p));
        mw->gate_bias = p;
    }
    mw->routed_kind = lw->w1[0].kind;
    for (int32_t e = 0; e < E; e++) {
        if (lw->w1[e].kind != mw->routed_kind || lw->w2[e].kind != mw->routed_kind ||
            lw->w3[e].kind != mw->routed_kind) {
            DI_LOG_ERROR("%s: layer %d: routed experts of mixed weight kinds", u->who, lw->il);
            return DI_ERR_UNSUPPORTED;
        }
    }
    DI_TRY(up_experts(u, lw->w1, E, tmp, &mw->w1));
    DI_TRY(up_experts(u, lw->w2, E, tmp, &mw->w2));
    DI_TRY(up_experts(u, lw->w3, E, tmp, &mw->w3));
    DI_TRY(di_dev_up_weight(u, &lw->sh_w1, &mw->sh_w1));
    DI_TRY(di_dev_up_weight(u, &lw->sh_w2, &mw->sh_w2));
    DI_TRY(di_dev_up_weight(u, &lw->sh_w3, &mw->sh_w3));
    return DI_OK;
fail:
    return st;
}

void di_dev_up_free(di_dev_up *u) {
    for (int32_t i = 0; i < u->n_blocks; i++) u->b->vt->free(u->b, u->blocks[i]);
    di_free(u->blocks);
    u->blocks = NULL;
    u->n_blocks = u->cap_blocks = 0;
}

di_status di_dev_capture(di_backend *b, di_status (*run)(const void *ctx), const void *ctx,
                         void **out) {
    di_status st = b->vt->graph_begin(b);
    if (st != DI_OK) return st;
    st = run(ctx);
    void *g = NULL;
    const di_status st_end = b->vt->graph_end(b, &g);
    if (st == DI_OK)
        st = st_end;
    else if (st_end == DI_OK)
        b->vt->graph_destroy(b, g);
    if (st == DI_OK) *out = g;
    return st;
}

bool di_dev_logit_rows_ok(const char *who, const int32_t *logit_rows, int32_t n_logit_rows,
                          int64_t n_rows, const float *logits) {
    if (n_logit_rows < 0 || n_logit_rows > n_rows ||
        (n_logit_rows > 0 && (!logits || !logit_rows))) {
        DI_LOG_ERROR("%s: %d logit rows for %lld rows", who, n_logit_rows, (long long)n_rows);
        return false;
    }
    for (int32_t k = 0; k < n_logit_rows; k++) {
        if (logit_rows[k] < 0 || logit_rows[k] >= n_rows ||
            (k > 0 && logit_rows[k] <= logit_rows[k - 1])) {
            DI_LOG_ERROR("%s: logit row %d (index %d) is out of range or not ascending", who,
                         logit_rows[k], k);
            return false;
        }
    }
    return true;
}

// ---- pipeline stages ----

int64_t di_dev_tensor_bytes(const di_tensor *t) {
    return t->data ? (int64_t)di_tensor_bytes(t) : 0;
}

// ---- a call's logits to the host, greedy rows as their picks ----

di_status di_dev_logits_down(di_backend *b, const float *dev, int32_t n, int64_t V,
                             const uint8_t *greedy, int32_t *pick_dev, int32_t *pick_host,
                             float *logits, int32_t *picks, int64_t *n_ops, int64_t *n_bytes) {
    const size_t row = sizeof(float) * (size_t)V;
    bool any = false;
    for (int32_t k = 0; greedy && k < n && !any; k++) any = greedy[k] != 0;
    if (!any) {
        *n_bytes += (int64_t)(row * (size_t)n);
        return n > 0 ? b->vt->download(b, logits, dev, row * (size_t)n) : DI_OK;
    }
    // Every row's pick in one launch (a sampled row's is not used: one op however they mix).
    di_status st = b->vt->argmax_rows(b, dev, n, V, V, pick_dev);
    ++*n_ops;
    if (st == DI_OK) st = b->vt->download(b, pick_host, pick_dev, sizeof(int32_t) * (size_t)n);
    if (st != DI_OK) return st;
    *n_bytes += (int64_t)(sizeof(int32_t) * (size_t)n);
    for (int32_t k = 0; k < n;) {
        if (greedy[k]) {
            picks[k] = pick_host[k];
            k++;
            continue;
        }
        int32_t e = k + 1;
        while (e < n && !greedy[e]) e++;
        st = b->vt->download(b, logits + (int64_t)k * V, dev + (int64_t)k * V,
                             row * (size_t)(e - k));
        if (st != DI_OK) return st;
        *n_bytes += (int64_t)(row * (size_t)(e - k));
        k = e;
    }
    return DI_OK;
}

// ---- the KV-aware split ----

// Blocks a stage of cost c holds within budget (dev_common.h di_dev_split_out.blocks).
static int64_t stage_blocks(const di_dev_stage_cost *c, int64_t budget) {
    const int64_t left = budget - c->weight_bytes - c->fixed_bytes;
    if (left < 0) return -1;
    return c->block_bytes > 0 ? left / c->block_bytes : INT64_MAX;
}

di_status di_dev_split_mem(const char *who, int32_t L, int32_t n_stages, di_dev_stage_cost_fn cost,
                           const void *ctx, const int64_t *budget_bytes, int64_t min_blocks,
                           di_dev_split_out *out) {
    if (n_stages < 1 || n_stages > L || n_stages > DI_DEV_SPLIT_MAX_STAGES) return DI_ERR_INVALID;
    const size_t W = (size_t)(L + 1), cells = (size_t)n_stages * W;
    // tab[a * W + b]: the cost of a stage holding [a, b) (a < b); g / f the two DPs' values and
    // cut the first layer of the last stage at (k, l).
    di_dev_stage_cost *tab = di_calloc(W * W, sizeof *tab);
    int64_t *g = di_malloc(sizeof(int64_t) * cells), *f = di_malloc(sizeof(int64_t) * cells);
    int32_t *cut = di_malloc(sizeof(int32_t) * cells);
    if (!tab || !g || !f || !cut) {
        di_free(tab), di_free(g), di_free(f), di_free(cut);
        return DI_ERR_NOMEM;
    }
    for (int32_t a = 0; a < L; a++)
        for (int32_t b = a + 1; b <= L; b++) cost(ctx, a, b, L, &tab[(size_t)a * W + (size_t)b]);
#define COST(a, b) (&tab[(size_t)(a)*W + (size_t)(b)])
    // DP 1, with budgets: g[k][l] the most blocks every stage of [0, l) as stages 0..k holds
    // (INT64_MIN: no such split).
    int64_t best_blocks = -1;
    if (budget_bytes) {
        for (size_t i = 0; i < cells; i++) g[i] = INT64_MIN;
        for (int32_t l = 1; l <= L; l++) g[l] = stage_blocks(COST(0, l), budget_bytes[0]);
        for (int32_t k = 1; k < n_stages; k++)
            for (int32_t l = k + 1; l <= L; l++)
                for (int32_t j = k; j < l; j++) {
                    const int64_t prev = g[(size_t)(k - 1) * W + (size_t)j];
                    if (prev == INT64_MIN) continue;
                    const int64_t here = stage_blocks(COST(j, l), budget_bytes[k]);
                    const int64_t v = prev < here ? prev : here;
                    if (v > g[(size_t)k * W + (size_t)l]) g[(size_t)k * W + (size_t)l] = v;
                }
        best_blocks = g[(size_t)(n_stages - 1) * W + (size_t)L];
    }
    // DP 2: f[k][l] the least largest stage (weight bytes) of [0, l) as stages 0..k, over the
    // splits whose every stage holds best_blocks (with budgets; any split without), ties to the
    // earlier cut (INT64_MAX: none).
    for (size_t i = 0; i < cells; i++) f[i] = INT64_MAX, cut[i] = -1;
#define OK_STAGE(k, a, b)                                                                          \
    (!budget_bytes || stage_blocks(COST(a, b), budget_bytes[k]) >= best_blocks)
    for (int32_t l = 1; l <= L; l++)
        if ((n_stages > 1 || l == L) && OK_STAGE(0, 0, l)) f[l] = COST(0, l)->weight_bytes;
    for (int32_t k = 1; k < n_stages; k++)
        for (int32_t l = k + 1; l <= L; l++) {
            if (k == n_stages - 1 && l != L) continue;
            for (int32_t j = k; j < l; j++) {
                const int64_t prev = f[(size_t)(k - 1) * W + (size_t)j];
                if (prev == INT64_MAX || !OK_STAGE(k, j, l)) continue;
                const int64_t here = COST(j, l)->weight_bytes, v = prev > here ? prev : here;
                if (v < f[(size_t)k * W + (size_t)l])
                    f[(size_t)k * W + (size_t)l] = v, cut[(size_t)k * W + (size_t)l] = j;
            }
        }
#undef OK_STAGE
    const bool found = f[(size_t)(n_stages - 1) * W + (size_t)L] != INT64_MAX;
    di_dev_split_out o = {.n_stages = n_stages, .by_memory = budget_bytes != NULL};
    if (found) {
        o.layer0[0] = 0;
        o.layer0[n_stages] = L;
        for (int32_t k = n_stages - 1, l = L; k > 0; k--)
            l = o.layer0[k] = cut[(size_t)k * W + (size_t)l];
        o.n_blocks = budget_bytes ? INT64_MAX : -1;
        for (int32_t k = 0; k < n_stages; k++) {
            o.cost[k] = *COST(o.layer0[k], o.layer0[k + 1]);
            o.budget_bytes[k] = budget_bytes ? budget_bytes[k] : 0;
            o.blocks[k] = budget_bytes ? stage_blocks(&o.cost[k], budget_bytes[k]) : -1;
            if (budget_bytes && o.blocks[k] < o.n_blocks) o.n_blocks = o.blocks[k];
        }
    }
#undef COST
    di_free(tab), di_free(g), di_free(f), di_free(cut);
    DI_ASSERT(found); // every split is allowed without budgets; with them, DP 1 found one
    if (budget_bytes && o.n_blocks < min_blocks) {
        int32_t k = 0; // the bottleneck: the first stage holding the fewest blocks
        for (int32_t j = 1; j < n_stages; j++)
            if (o.blocks[j] < o.blocks[k]) k = j;
        const di_dev_stage_cost *c = &o.cost[k];
        if (o.n_blocks < 0)
            DI_LOG_ERROR("%s: no split into %d stages fits every stage's weights and fixed state: "
                         "the best leaves stage %d (layers [%d, %d)) with %lld bytes for %lld "
                         "bytes of weights + %lld of fixed state",
                         who, (int)n_stages, (int)k, (int)o.layer0[k], (int)o.layer0[k + 1],
                         (long long)o.budget_bytes[k], (long long)c->weight_bytes,
                         (long long)c->fixed_bytes);
        else
            DI_LOG_ERROR("%s: no split into %d stages holds the weights, the fixed state and %lld "
                         "entry blocks (one sequence) on every stage: the best leaves stage %d "
                         "(layers [%d, %d)) with %lld bytes for %lld bytes of weights + %lld of "
                         "fixed state + %lld x %lld bytes of blocks",
                         who, (int)n_stages, (long long)min_blocks, (int)k, (int)o.layer0[k],
                         (int)o.layer0[k + 1], (long long)o.budget_bytes[k],
                         (long long)c->weight_bytes, (long long)c->fixed_bytes,
                         (long long)min_blocks, (long long)c->block_bytes);
        return DI_ERR_NOMEM;
    }
    *out = o;
    return DI_OK;
}

di_dev_plan di_dev_plan_of(const di_model *m, int32_t block_tokens) {
    const di_model_options *o = &m->opt;
    di_dev_plan p = {
        .n_slots = o->dev_slots ? o->dev_slots : DI_DEV_PLAN_SLOTS_DEFAULT,
        .n_ctx = o->dev_ctx ? o->dev_ctx : DI_DEV_PLAN_CTX_DEFAULT,
        .max_rows = o->dev_rows ? o->dev_rows : DI_DEV_PLAN_ROWS_DEFAULT,
        .block_tokens = block_tokens,
        .spec = o->dev_spec,
        .reserve_bytes =
            (int64_t)(o->dev_reserve_bytes ? o->dev_reserve_bytes : DI_DEV_RESERVE_DEFAULT_BYTES)};
    if (p.n_ctx > m->hp.max_pos) p.n_ctx = (int32_t)m->hp.max_pos;
    return p;
}

bool di_dev_stage_budgets(di_backend *const *b, int32_t n, int64_t reserve_bytes, int64_t *budget) {
    int64_t fr[DI_DEV_SPLIT_MAX_STAGES];
    DI_ASSERT(n >= 1 && n <= DI_DEV_SPLIT_MAX_STAGES);
    for (int32_t k = 0; k < n; k++) {
        size_t free_bytes = 0, total_bytes = 0;
        if (di_backend_mem_info(b[k], &free_bytes, &total_bytes) != DI_OK) return false;
        fr[k] = free_bytes > (size_t)INT64_MAX ? INT64_MAX : (int64_t)free_bytes;
    }
    for (int32_t k = 0; k < n; k++) {
        // Stages on one device (the same backend, or two backends on one GPU: cuda:0,0) share its
        // free memory. CPU backends count as devices of their own (the test hook models them so).
        int32_t share = 0;
        for (int32_t j = 0; j < n; j++)
            share += b[j] == b[k] || (b[k]->device.kind != DI_DEVICE_CPU &&
                                      b[j]->device.kind == b[k]->device.kind &&
                                      b[j]->device.index == b[k]->device.index);
        const int64_t v = fr[k] / share - reserve_bytes;
        budget[k] = v > 0 ? v : 0;
    }
    return true;
}

void di_dev_split_log(const char *who, const di_dev_split_out *sp, const di_dev_plan *plan) {
    const double mib = 1048576.0;
    if (!sp->by_memory)
        DI_LOG_INFO("%s: some stage's backend cannot report its memory: the split balances the "
                    "weights only",
                    who);
    else
        DI_LOG_INFO("%s: the split holds the most entry blocks on every stage (%lld) for %d slots "
                    "of %d positions, %d rows per call, %.0f MiB left free on each",
                    who, (long long)sp->n_blocks, (int)plan->n_slots, (int)plan->n_ctx,
                    (int)plan->max_rows, (double)plan->reserve_bytes / mib);
    for (int32_t k = 0; k < sp->n_stages; k++) {
        const di_dev_stage_cost *c = &sp->cost[k];
        if (sp->by_memory)
            DI_LOG_INFO("%s: split stage %d: layers [%d, %d), %.1f MiB of weights, %.1f MiB of "
                        "fixed state, %lld bytes per block; %.1f MiB for them: %lld blocks",
                        who, (int)k, (int)sp->layer0[k], (int)sp->layer0[k + 1],
                        (double)c->weight_bytes / mib, (double)c->fixed_bytes / mib,
                        (long long)c->block_bytes, (double)sp->budget_bytes[k] / mib,
                        (long long)sp->blocks[k]);
        else
            DI_LOG_INFO("%s: split stage %d: layers [%d, %d), %.1f MiB of weights, %lld bytes per "
                        "block",
                        who, (int)k, (int)sp->layer0[k], (int)sp->layer0[k + 1],
                        (double)c->weight_bytes / mib, (long long)c->block_bytes);
    }
}
