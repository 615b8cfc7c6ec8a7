// dsv4_mtp — the multi-token-prediction block (spec §2.10): it reads the main model's residual
// streams after the last layer (before the head's mHC) at position p and the embedding of the
// token at p + 1, runs one sliding-window decoder block with its own window ring, and predicts
// the token at p + 2 through its own head mHC and norm and the shared lm head. A ragged batch
// like the main forward: sessions run it on their own rows, the engine on every sequence of a
// step (its MTP drafts).
#include <string.h>

#include "base/log.h" // DI_ASSERT
#include "model/dsv4.h"

di_status di_dsv4_mtp_forward_batch(di_dsv4_ctx *c, const float *x_main, const int32_t *ids_next,
                                    const int32_t *logit_rows, int32_t n_logit_rows,
                                    float *logits) {
    di_model *m = c->model;
    const di_hparams *hp = &m->hp;
    const di_dsv4_mtp_w *mw = &m->mtp[0];
    const int nc = hp->hc_mult;
    const int64_t D = hp->n_embd;
    const int32_t n = c->n_rows;
    float *tmp = di_dsv4_scratch(c, DI_SCR_A); // [n, D]
    float *e = di_dsv4_scratch(c, DI_SCR_H);   // [n, D]
    float *xm = di_dsv4_scratch(c, DI_SCR_XM); // [n, NC, D]

    // e = e_proj . RMSNorm(embed[id_next], enorm)
    for (int32_t t = 0; t < n; t++) di_tensor_row_f32(&m->embed, ids_next[t], tmp + t * D);
    di_ref_rmsnorm(tmp, n, D, D, mw->enorm, hp->norm_eps);
    di_dsv4_round(m, tmp, n * D);
    di_dsv4_linear(c, &mw->e_proj, tmp, n, D, e, D, true);
    // X0[t, s] = e[t] + h_proj . RMSNorm(Xmain[t, s], hnorm)
    for (int k = 0; k < nc; k++) {
        for (int32_t t = 0; t < n; t++)
            memcpy(tmp + t * D, x_main + ((int64_t)t * nc + k) * D, sizeof(float) * (size_t)D);
        di_ref_rmsnorm(tmp, n, D, D, mw->hnorm, hp->norm_eps);
        di_dsv4_round(m, tmp, n * D);
        di_dsv4_linear(c, &mw->h_proj, tmp, n, D, xm + k * D, nc * D, true);
    }
    for (int32_t t = 0; t < n; t++)
        for (int k = 0; k < nc; k++) {
            float *row = xm + ((int64_t)t * nc + k) * D;
            for (int64_t i = 0; i < D; i++) row[i] += e[t * D + i];
        }
    di_dsv4_round(m, xm, (int64_t)n * nc * D);

    di_dsv4_block(c, &mw->block, hp->n_layer, xm, ids_next);
    if (c->trace) c->trace(c->trace_user, "mtp_out", hp->n_layer, xm, false, n, nc * D);
    if (c->status != DI_OK || !logits || n_logit_rows == 0) return c->status;
    // The rows asked for, gathered to the front of XM (ascending: each copy moves a row down).
    const size_t row = sizeof(float) * (size_t)(nc * D);
    for (int32_t k = 0; logit_rows && k < n_logit_rows; k++) {
        DI_ASSERT(logit_rows[k] >= k && logit_rows[k] < n);
        if (logit_rows[k] != k)
            memmove(xm + (int64_t)k * nc * D, xm + (int64_t)logit_rows[k] * nc * D, row);
    }
    float *h = di_dsv4_scratch(c, DI_SCR_H);
    di_dsv4_hc_head(c, &mw->hc_head, mw->norm, xm, n_logit_rows, h);
    di_dsv4_matmul(m, &m->head, h, n_logit_rows, D, logits, hp->n_vocab);
    return DI_OK;
}
