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

di_status di_dev_split(const int64_t *pre, int64_t head, int32_t L, int32_t n_stages,
                       int32_t *layer0, int64_t *stage_bytes) {
    if (n_stages < 1 || n_stages > L) return DI_ERR_INVALID;
    // f[k * (L + 1) + l] = the least largest stage of layers [0, l) as stages 0..k (INT64_MAX:
    // none), cut[.] the first layer of stage k there (the smallest such); O(n L^2).
    const size_t cells = (size_t)n_stages * (size_t)(L + 1);
    int64_t *f = di_malloc(sizeof(int64_t) * cells);
    int32_t *cut = di_malloc(sizeof(int32_t) * cells);
    if (!f || !cut) {
        di_free(f), di_free(cut);
        return DI_ERR_NOMEM;
    }
    for (size_t i = 0; i < cells; i++) f[i] = INT64_MAX, cut[i] = -1;
    for (int32_t l = 1; l <= L; l++) f[l] = pre[l] + (n_stages == 1 && l == L ? head : 0);
    for (int32_t k = 1; k < n_stages; k++) {
        for (int32_t l = k + 1; l <= L; l++) {
            const int64_t extra = k == n_stages - 1 && l == L ? head : 0;
            int64_t best = INT64_MAX;
            for (int32_t j = k; j < l; j++) {
                const int64_t prev = f[(k - 1) * (L + 1) + j], here = pre[l] - pre[j] + extra;
                if (prev == INT64_MAX) continue;
                const int64_t v = prev > here ? prev : here;
                if (v < best) best = v, cut[k * (L + 1) + l] = j;
            }
            f[k * (L + 1) + l] = best;
        }
    }
    const bool found = f[(size_t)(n_stages - 1) * (size_t)(L + 1) + (size_t)L] != INT64_MAX;
    for (int32_t k = n_stages - 1, l = L; found && k > 0; k--) l = layer0[k] = cut[k * (L + 1) + l];
    di_free(f);
    di_free(cut);
    if (!found) return DI_ERR_INVALID;
    layer0[0] = 0;
    layer0[n_stages] = L;
    for (int32_t k = 0; stage_bytes && k < n_stages; k++)
        stage_bytes[k] =
            pre[layer0[k + 1]] - (k ? pre[layer0[k]] : 0) + (k == n_stages - 1 ? head : 0);
    return DI_OK;
}

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
