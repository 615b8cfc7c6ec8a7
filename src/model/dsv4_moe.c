// dsv4_moe — the mixture of experts of one layer (spec §2.8): the router (hash-routed layers take
// tid2eid[token], score-routed layers take the top-K of sqrt(softplus(logit)) + bias), the routed
// experts grouped by expert so each expert's weights are read once per call, and the shared
// expert. SwiGLU with the one-sided gate clamp and the symmetric up clamp. With expert workers
// (m->ep, ep/ep.h) the routed experts placed on them are computed there, overlapping the local
// ones; the combine adds every expert's rows in ascending id either way (bit-identical).
#include <math.h>
#include <string.h>

#include "base/log.h"
#include "ep/ep.h"
#include "ep/eplb.h"
#include "model/dsv4.h"
#include "tensor/quant_ref.h"

// `weight` scales h before w2 in official precision (R-OFF) and the output otherwise (R-HF),
// which is the same in exact arithmetic.
void di_dsv4_expert(di_dsv4_ctx *c, const di_tensor *w1, const di_tensor *w3, const di_tensor *w2,
                    const float *x, int32_t n, float limit, const float *weight, float *y) {
    const di_model *m = c->model;
    const int64_t D = m->hp.n_embd, F = w1->ne[1];
    const bool official = m->opt.precision == DI_PRECISION_OFFICIAL;
    float *g = di_dsv4_scratch(c, DI_SCR_MOE_G), *u = di_dsv4_scratch(c, DI_SCR_MOE_U);
    di_dsv4_linear(c, w1, x, n, D, g, F, true); // gate: [n, F]
    di_dsv4_linear(c, w3, x, n, D, u, F, true); // up:   [n, F]
    di_ref_swiglu(g, u, (int64_t)n * F, limit);
    if (official && weight) {
        for (int32_t r = 0; r < n; r++)
            for (int64_t i = 0; i < F; i++) g[r * F + i] *= weight[r];
    }
    di_dsv4_round(m, g, (int64_t)n * F);
    di_dsv4_linear(c, w2, g, n, F, y, D, true); // [n, D]
    if (!official && weight) {
        for (int32_t r = 0; r < n; r++)
            for (int64_t i = 0; i < D; i++) y[r * D + i] *= weight[r];
    }
}

void di_dsv4_moe(di_dsv4_ctx *c, const di_dsv4_layer_w *lw, const float *f, const int32_t *ids,
                 float *out) {
    di_model *m = c->model;
    const int32_t n_tok = c->n_rows;
    const di_hparams *hp = &m->hp;
    const int64_t D = hp->n_embd, E = lw->n_expert;
    const int32_t K = lw->n_expert_used;
    const bool official = m->opt.precision == DI_PRECISION_OFFICIAL;

    // Router in FP32: s = sqrt(softplus(gate . f)).
    float *score = di_dsv4_scratch(c, DI_SCR_LOGIT); // [T, E]
    di_dsv4_matmul(m, &lw->gate, f, n_tok, D, score, E);
    // V4.1 divides the logits by gate_temp first (1 for V4: the division is exact, a no-op).
    for (int64_t i = 0; i < (int64_t)n_tok * E; i++)
        score[i] = sqrtf(di_softplus(score[i] / hp->gate_temp));

    // Selection and routing weights: sel [T, K] (session int scratch), wgt [T, K].
    int32_t *sel = c->ws->sel;
    float *wgt = di_dsv4_scratch(c, DI_SCR_MOE_W);
    for (int32_t t = 0; t < n_tok; t++) {
        const float *st = score + t * E;
        int32_t *se = sel + t * K;
        if (lw->hash_routed)
            memcpy(se, lw->tid2eid + (int64_t)ids[t] * K, sizeof(int32_t) * (size_t)K);
        // R-HF's denominator epsilon; V4.1's R-OFF has it too.
        const float eps = !official || hp->v41 ? 1e-20f : 0.0f;
        di_ref_route(st, (int32_t)E, K, lw->hash_routed ? NULL : lw->gate_bias, eps,
                     hp->route_scale, se, wgt + t * K);
    }

    if (m->expert_load && E == di_ep_load_n_expert(m->expert_load))
        di_ep_load_record(m->expert_load, lw->il, sel, n_tok, K); // il: the MoE layer index

    // Routed experts, in ascending expert id; each gathers the (token, slot) pairs routed to it.
    // Duplicates in a hash row contribute twice (as R-HF does).
    memset(out, 0, sizeof(float) * (size_t)(n_tok * D));
    float *xin = di_dsv4_scratch(c, DI_SCR_MOE_IN), *yout = di_dsv4_scratch(c, DI_SCR_MOE_OUT);
    float *rw = di_dsv4_scratch(c, DI_SCR_MOE_RW);
    int32_t *rows = c->ws->sel + (int64_t)n_tok * K; // token of each gathered row
    di_ep *ep = m->ep;
    bool remote = false;
    if (ep) di_ep_begin(ep, lw->il, (int32_t)E, &remote);
    di_status st = c->status;
    // Expert parallelism: an expert's rows are split between its replicas (contiguous chunks);
    // first every remote chunk goes out (one request per worker), then the ascending loop below
    // computes the local chunks and takes each remote one's output as its turn comes.
    di_ep_chunk ch[DI_EP_MAX_REPLICAS];
    for (int32_t e = 0; remote && st == DI_OK && e < E; e++) {
        if (!di_ep_remote(ep, e)) continue; // gathered once, in the loop below
        const int32_t n = di_ref_moe_gather(sel, wgt, n_tok, K, e, f, D, xin, rows, rw);
        const int32_t nc = n ? di_ep_chunks(ep, e, n, ch) : 0;
        for (int32_t i = 0; i < nc && st == DI_OK; i++)
            if (ch[i].rank != 0)
                st = di_ep_add(ep, ch[i].rank, e, xin + (int64_t)ch[i].off * D, rw + ch[i].off,
                               ch[i].n);
    }
    if (remote && st == DI_OK) st = di_ep_send(ep);
    // The shared expert too computes while the workers do (into the handle's buffer; added last,
    // as in one process).
    const float limit = hp->shared_expert_clamp ? hp->swiglu_limit : 0;
    float *shared = NULL;
    if (remote && st == DI_OK) {
        shared = di_ep_scratch(ep, (int64_t)n_tok * D);
        if (shared)
            di_dsv4_expert(c, &lw->sh_w1, &lw->sh_w3, &lw->sh_w2, f, n_tok, limit, NULL, shared);
        else
            st = DI_ERR_NOMEM;
    }
    for (int32_t e = 0; e < E && st == DI_OK; e++) {
        const int32_t n = di_ref_moe_gather(sel, wgt, n_tok, K, e, f, D, xin, rows, rw);
        if (n == 0) continue;
        const int32_t nc =
            remote ? di_ep_chunks(ep, e, n, ch) : (ch[0] = (di_ep_chunk){0, 0, n}, 1);
        for (int32_t i = 0; i < nc && st == DI_OK; i++) {
            const int64_t o = (int64_t)ch[i].off * D;
            if (ch[i].rank == 0)
                di_dsv4_expert(c, &lw->w1[e], &lw->w3[e], &lw->w2[e], xin + o, ch[i].n,
                               hp->swiglu_limit, rw + ch[i].off, yout + o);
            else
                st = di_ep_recv(ep, ch[i].rank, e, ch[i].n, yout + o);
        }
        if (st == DI_OK) di_ref_moe_add_rows(yout, rows, n, D, out);
    }
    if (st == DI_OK && !shared) { // shared expert on every token, then one sum
        shared = yout;
        di_dsv4_expert(c, &lw->sh_w1, &lw->sh_w3, &lw->sh_w2, f, n_tok, limit, NULL, shared);
    }
    if (st == DI_OK)
        for (int64_t i = 0; i < (int64_t)n_tok * D; i++) out[i] += shared[i];
    if (ep) di_ep_end(ep, st);
    if (st != DI_OK) { // the call fails; later layers skip their work (see di_dsv4_ctx.status)
        c->status = st;
        memset(out, 0, sizeof(float) * (size_t)(n_tok * D));
        return;
    }
    di_dsv4_round(m, out, (int64_t)n_tok * D);
}
