// The official-precision switch (spec §0.1, §5): on a random-weight checkpoint in the official
// layout, check that each R-OFF rounding point is in effect — residual streams BF16, KV nope dims
// Q8-representable (window rows and compressed entries), indexer keys Q4-representable — that FP32
// mode has none of it, that both modes agree closely, and that chunking stays exact.
#include "harness.h"

#include <stdlib.h>
#include <sys/stat.h>

#include "model/dsv4.h"
#include "model/synth.h"
#include "tensor/quant_ref.h"

static char g_dir[256];

typedef struct stream_check {
    int64_t non_bf16;
    int64_t total;
} stream_check;

static void on_trace(void *user, const char *name, int il, const void *data, bool is_int,
                     int64_t n_rows, int64_t row_len) {
    (void)il;
    stream_check *c = user;
    if (is_int || strcmp(name, "layer_out") != 0) return;
    const float *v = data;
    for (int64_t i = 0; i < n_rows * row_len; i++) {
        c->total++;
        c->non_bf16 += di_round_bf16(v[i]) != v[i];
    }
}

// Fraction of values in rows [n, d] (first `n_q` dims of each row) not invariant under Q8/Q4.
static double not_quantised(const float *rows, int64_t n, int64_t d, int64_t n_q, bool q4) {
    float buf[1024];
    int64_t bad = 0;
    for (int64_t r = 0; r < n; r++) {
        memcpy(buf, rows + r * d, sizeof(float) * (size_t)n_q);
        if (q4)
            di_fake_quant_q4(buf, n_q, 32);
        else
            di_fake_quant_q8(buf, n_q, 64);
        for (int64_t i = 0; i < n_q; i++) bad += buf[i] != rows[r * d + i];
    }
    return n ? (double)bad / (double)(n * n_q) : 0;
}

static void run(di_precision prec, float *logits, int32_t T, const int32_t *ids, stream_check *sc,
                double *kv_bad, double *cmp_bad, double *idx_bad) {
    di_model_options o = di_model_options_default();
    o.n_threads = 2;
    o.precision = prec;
    di_model *m = NULL;
    CHECK(di_model_load(g_dir, &o, &m) == DI_OK);
    if (!m) return;
    di_session *s = NULL;
    CHECK(di_session_create(m, NULL, &s) == DI_OK);
    s->trace = on_trace;
    s->trace_user = sc;
    di_forward_out fo = {.logits = logits};
    CHECK(di_session_forward(s, ids, T, &fo) == DI_OK);
    const di_hparams *hp = &m->hp;
    int n_nope = hp->head_dim - hp->rope_main.n_dims;
    *kv_bad = *cmp_bad = *idx_bad = 0;
    for (int il = 0; il < hp->n_layer; il++) {
        const di_dsv4_layer_state *ls = &s->layers[il];
        int64_t n_ring = T < hp->window ? T : hp->window;
        *kv_bad = fmax(*kv_bad, not_quantised(ls->ring, n_ring, hp->head_dim, n_nope, false));
        if (m->layers[il].ratio > 0)
            *cmp_bad = fmax(*cmp_bad, not_quantised(ls->cmp.entries, ls->cmp.n_entries,
                                                    hp->head_dim, n_nope, false));
        if (m->layers[il].ratio == 4)
            *idx_bad = fmax(*idx_bad, not_quantised(ls->idx.entries, ls->idx.n_entries,
                                                    hp->index_head_dim, hp->index_head_dim, true));
    }
    // chunked feeding is exact in this mode too
    float *chunked = malloc(sizeof(float) * (size_t)(T * hp->n_vocab));
    di_session_reset(s);
    s->trace = NULL;
    int32_t done = 0, step = 7;
    while (done < T) {
        int32_t n = T - done < step ? T - done : step;
        di_forward_out f2 = {.logits = chunked + (int64_t)done * hp->n_vocab};
        CHECK(di_session_forward(s, ids + done, n, &f2) == DI_OK);
        done += n;
        step = step == 7 ? 1 : 7;
    }
    double md = 0;
    for (int64_t i = 0; i < (int64_t)T * hp->n_vocab; i++)
        md = fmax(md, fabs(chunked[i] - logits[i]));
    CHECK(md <= 1e-5);
    free(chunked);
    di_session_destroy(s);
    di_model_destroy(m);
}

static void test_official_rounding_points(void) {
    enum { T = 40 };
    int32_t ids[T];
    for (int i = 0; i < T; i++) ids[i] = (i * 97 + 13) % 512;
    int64_t V = 512;
    float *lf = malloc(sizeof(float) * T * V), *lo = malloc(sizeof(float) * T * V);
    stream_check sf = {0}, so = {0};
    double kf, cf, xf, ko, co, xo;
    run(DI_PRECISION_FP32, lf, T, ids, &sf, &kf, &cf, &xf);
    run(DI_PRECISION_OFFICIAL, lo, T, ids, &so, &ko, &co, &xo);
    fprintf(stderr,
            "fp32: %lld/%lld stream values not bf16, kv %.3f cmp %.3f idx %.3f not quantised\n",
            (long long)sf.non_bf16, (long long)sf.total, kf, cf, xf);
    fprintf(stderr,
            "official: %lld/%lld stream values not bf16, kv %.3f cmp %.3f idx %.3f not quantised\n",
            (long long)so.non_bf16, (long long)so.total, ko, co, xo);
    CHECK(so.total > 0 && so.non_bf16 == 0); // BF16 residual streams
    CHECK(sf.non_bf16 > sf.total / 2);       // FP32 mode keeps full precision
    CHECK(ko == 0 && co == 0 && xo == 0);    // Q8 / Q4 fixed points
    CHECK(kf > 0.5 && cf > 0.5 && xf > 0.5);
    // Same model, quantisation noise only: the logits stay strongly correlated. (FP8 activations
    // carry 3 mantissa bits, so per-element differences are large on a random-weight model.)
    double sff = 0, soo = 0, sfo = 0, md = 0;
    for (int64_t i = 0; i < T * V; i++) {
        sff += (double)lf[i] * lf[i];
        soo += (double)lo[i] * lo[i];
        sfo += (double)lf[i] * lo[i];
        md = fmax(md, fabs(lf[i] - lo[i]));
    }
    double corr = sfo / sqrt(sff * soo);
    fprintf(stderr, "official vs fp32 logits: max|d| %.4g, correlation %.4f\n", md, corr);
    CHECK(md > 0);
    CHECK(corr > 0.9);
    free(lf);
    free(lo);
}

int main(void) {
    snprintf(g_dir, sizeof g_dir, "/tmp/di_test_precision_XXXXXX");
    if (!mkdtemp(g_dir)) return 1;
    di_synth_config c;
    CHECK(di_synth_preset("tiny", &c) == DI_OK);
    c.n_vocab = 512;
    CHECK(di_synth_write(&c, g_dir) == DI_OK);
    RUN(test_official_rounding_points);
    di_test_remove_dir(g_dir);
    return test_finish();
}
