#include "backend/cpu/ref_ops.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "backend/cpu/gemm.h" // di_cpu_isa_detect
#include "base/log.h"
#include "base/mem.h"
#include "tensor/quant_ref.h" // di_quant_act_q8, di_codes_row_*

di_status di_cpu_init(di_cpu *cpu, di_pool *pool, int64_t max_row) {
    cpu->pool = pool;
    cpu->n_threads = di_pool_n_threads(pool);
    cpu->row_cap = max_row;
    cpu->row_scratch = di_aligned_alloc(sizeof(float) * (size_t)max_row * (size_t)cpu->n_threads);
    cpu->isa = di_cpu_isa_detect();
    cpu->n_weight_bytes = 0;
    cpu->n_weight_macs = 0;
    cpu->gemm_ld = (max_row + 15) & ~(int64_t)15;
    cpu->gemm_rows = di_gemm_scratch_rows(cpu->gemm_ld);
    cpu->gemm_scratch = di_aligned_alloc(sizeof(float) * (size_t)cpu->gemm_rows *
                                         (size_t)cpu->gemm_ld * (size_t)cpu->n_threads);
    cpu->act_ld = (max_row + 63) & ~(int64_t)63;
    cpu->act_q = di_aligned_alloc((size_t)DI_CPU_ACT_TOKENS * (size_t)cpu->act_ld);
    cpu->act_d =
        di_aligned_alloc(sizeof(float) * (size_t)DI_CPU_ACT_TOKENS * (size_t)(cpu->act_ld / 32));
    cpu->act_s =
        di_aligned_alloc(sizeof(int16_t) * (size_t)DI_CPU_ACT_TOKENS * (size_t)(cpu->act_ld / 16));
    if (!cpu->row_scratch || !cpu->gemm_scratch || !cpu->act_q || !cpu->act_d || !cpu->act_s) {
        di_cpu_deinit(cpu);
        return DI_ERR_NOMEM;
    }
    return DI_OK;
}

void di_cpu_deinit(di_cpu *cpu) {
    di_aligned_free(cpu->row_scratch);
    di_aligned_free(cpu->gemm_scratch);
    di_aligned_free(cpu->act_q);
    di_aligned_free(cpu->act_d);
    di_aligned_free(cpu->act_s);
    cpu->row_scratch = NULL;
    cpu->gemm_scratch = NULL;
    cpu->act_q = NULL;
    cpu->act_d = NULL;
    cpu->act_s = NULL;
}

float di_ref_dot(const float *a, const float *b, int64_t n) {
    // Eight independent partial sums (vectorisable), combined pairwise in a fixed order.
    float s[8] = {0};
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        for (int k = 0; k < 8; k++) s[k] += a[i + k] * b[i + k];
    float tail = 0;
    for (; i < n; i++) tail += a[i] * b[i];
    return ((s[0] + s[4]) + (s[1] + s[5])) + ((s[2] + s[6]) + (s[3] + s[7])) + tail;
}

// ---- 8-bit activations (Q8_0, MXFP4) ----

di_ref_act di_ref_matmul_act(const di_tensor *w) {
    switch (w->kind) {
    case DI_TENSOR_KIND_Q8_0:
    case DI_TENSOR_KIND_MXFP4:
        return DI_REF_ACT_Q8_0;
    case DI_TENSOR_KIND_Q4_K:
        return DI_REF_ACT_Q8_K;
    default:
        return DI_REF_ACT_F32;
    }
}

void di_ref_row_codes(const di_tensor *w, int64_t r, int8_t *q, float *d) {
    DI_ASSERT(r >= 0 && r < w->ne[1]);
    const uint8_t *row = (const uint8_t *)w->data + (size_t)r * w->nb1;
    if (w->kind == DI_TENSOR_KIND_Q8_0)
        di_codes_row_q8_0(row, w->ne[0], q, d);
    else if (w->kind == DI_TENSOR_KIND_MXFP4)
        di_codes_row_mxfp4(row, w->ne[0], q, d);
    else
        DI_ASSERT(!"not an 8-bit-activation kind");
}

float di_ref_dot_q8(const int8_t *qw, const float *dw, const int8_t *qx, const float *dx,
                    int64_t n) {
    float s[8] = {0};
    for (int64_t b = 0; b < n / 32; b++) {
        const float d = dw[b] * dx[b]; // exact for Q8_0 (two f16 values) and MXFP4 (2^k)
        for (int l = 0; l < 8; l++) {
            const int8_t *a = qw + 32 * b + 4 * l, *c = qx + 32 * b + 4 * l;
            int32_t v = 0;
            for (int k = 0; k < 4; k++) v += (int32_t)a[k] * (int32_t)c[k];
            s[l] = fmaf(d, (float)v, s[l]); // one rounding, as the AVX2 level's FMA
        }
    }
    return ((s[0] + s[4]) + (s[1] + s[5])) + ((s[2] + s[6]) + (s[3] + s[7]));
}

float di_ref_dot_q4_k(const uint8_t *row, const int8_t *qx, const float *dx, const int16_t *bsums,
                      int64_t n) {
    float s[8] = {0};
    for (int64_t b = 0; b < n / 256; b++) {
        const uint8_t *blk = row + 144 * b;
        uint16_t h[2];
        memcpy(h, blk, 4);
        const int8_t *x = qx + 256 * b;
        int32_t lanes[8] = {0}, mins[8];
        for (int j = 0; j < 8; j++) {
            uint8_t sc, m;
            di_q4_k_scale_min(j, blk + 4, &sc, &m);
            const uint8_t *q = blk + 16 + 32 * (j / 2); // low nibbles: even j, high: odd j
            for (int l = 0; l < 8; l++) {
                int32_t v = 0;
                for (int k = 0; k < 4; k++) {
                    const int c = 4 * l + k;
                    v += (int32_t)((j & 1 ? q[c] >> 4 : q[c] & 15)) * (int32_t)x[32 * j + c];
                }
                lanes[l] += (int32_t)sc * v;
            }
            mins[j] = (int32_t)m * ((int32_t)bsums[16 * b + 2 * j] + bsums[16 * b + 2 * j + 1]);
        }
        const float dd = dx[b] * di_f16_to_f32(h[0]), dm = dx[b] * di_f16_to_f32(h[1]);
        for (int l = 0; l < 8; l++) s[l] = fmaf(dd, (float)lanes[l], s[l]);
        for (int l = 0; l < 8; l++) s[l] = fmaf(-dm, (float)mins[l], s[l]);
    }
    return ((s[0] + s[4]) + (s[1] + s[5])) + ((s[2] + s[6]) + (s[3] + s[7]));
}

// ---- matmul ----

typedef struct matmul_ctx {
    di_cpu *cpu;
    const di_tensor *w;
    const float *x;
    int64_t n_tok, x_stride;
    float *y;
    int64_t y_stride;
    bool split_rows; // partition output rows (else tokens)
} matmul_ctx;

static void matmul_task(void *p, int ith, int nth) {
    matmul_ctx *c = p;
    float *row = c->cpu->row_scratch + (size_t)ith * (size_t)c->cpu->row_cap;
    int64_t n_in = c->w->ne[0], n_out = c->w->ne[1];
    int64_t r_lo = 0, r_hi = n_out, t_lo = 0, t_hi = c->n_tok;
    if (c->split_rows)
        di_split_range(n_out, ith, nth, &r_lo, &r_hi);
    else
        di_split_range(c->n_tok, ith, nth, &t_lo, &t_hi);
    if (t_lo >= t_hi) return;
    if (di_ref_matmul_act(c->w) == DI_REF_ACT_Q8_K) {
        // Scratch (4 * row_cap bytes): one token's codes, scales and sums.
        int8_t *qx = (int8_t *)row;
        float *dx = (float *)(qx + n_in);
        int16_t *bs = (int16_t *)(dx + n_in / 256);
        for (int64_t o = r_lo; o < r_hi; o++) {
            const uint8_t *wrow = (const uint8_t *)c->w->data + (size_t)o * c->w->nb1;
            for (int64_t t = t_lo; t < t_hi; t++) {
                di_quant_act_q8_k(c->x + t * c->x_stride, n_in, qx, dx, bs);
                c->y[t * c->y_stride + o] = di_ref_dot_q4_k(wrow, qx, dx, bs, n_in);
            }
        }
        return;
    }
    if (di_ref_matmul_act(c->w) == DI_REF_ACT_Q8_0) {
        // Scratch (4 * row_cap bytes): the weight row's codes and scales, then one token's.
        int8_t *qw = (int8_t *)row, *qx = qw + n_in + n_in / 8;
        float *dw = (float *)(qw + n_in), *dx = (float *)(qx + n_in);
        for (int64_t o = r_lo; o < r_hi; o++) {
            di_ref_row_codes(c->w, o, qw, dw);
            for (int64_t t = t_lo; t < t_hi; t++) {
                di_quant_act_q8(c->x + t * c->x_stride, n_in, qx, dx);
                c->y[t * c->y_stride + o] = di_ref_dot_q8(qw, dw, qx, dx, n_in);
            }
        }
        return;
    }
    for (int64_t o = r_lo; o < r_hi; o++) {
        di_tensor_row_f32(c->w, o, row);
        for (int64_t t = t_lo; t < t_hi; t++)
            c->y[t * c->y_stride + o] = di_ref_dot(row, c->x + t * c->x_stride, n_in);
    }
}

void di_ref_matmul(di_cpu *cpu, const di_tensor *w, const float *x, int64_t n_tok, int64_t x_stride,
                   float *y, int64_t y_stride) {
    DI_ASSERT(w->ne[0] <= cpu->row_cap);
    if (n_tok <= 0 || w->ne[1] <= 0) return;
    matmul_ctx c = {cpu, w, x, n_tok, x_stride, y, y_stride, true};
    // Few output rows and many tokens: split tokens so every thread has work (each thread then
    // dequantises all rows; the rows are few).
    c.split_rows = w->ne[1] >= 8 * (int64_t)cpu->n_threads || n_tok < cpu->n_threads;
    di_pool_run(cpu->pool, matmul_task, &c);
}

// ---- elementwise ----

void di_ref_rmsnorm(float *x, int64_t n_rows, int64_t n, int64_t stride, const float *w,
                    float eps) {
    for (int64_t r = 0; r < n_rows; r++) {
        float *v = x + r * stride;
        float ss = di_ref_dot(v, v, n);
        float inv = 1.0f / sqrtf(ss / (float)n + eps);
        if (w)
            for (int64_t i = 0; i < n; i++) v[i] = w[i] * (v[i] * inv);
        else
            for (int64_t i = 0; i < n; i++) v[i] = v[i] * inv;
    }
}

void di_ref_rope(float *v, int64_t n, int32_t n_rot, const float *omega, int64_t pos, float scale,
                 bool inverse) {
    float *r = v + (n - n_rot);
    for (int32_t i = 0; i < n_rot / 2; i++) {
        float ang = (float)pos * omega[i]; // one FP32 rounding, as the references
        float c = cosf(ang) * scale, s = sinf(ang) * scale;
        if (inverse) s = -s;
        float a = r[2 * i], b = r[2 * i + 1];
        r[2 * i] = a * c - b * s;
        r[2 * i + 1] = b * c + a * s;
    }
}

// ---- mHC coefficients (spec §2.3) ----

void di_ref_hc_coeffs(const float *mix, const float *base, const float *scale, int nc, int iters,
                      float eps, float *pre, float *post, float *comb) {
    for (int s = 0; s < nc; s++) pre[s] = di_sigmoid(mix[s] * scale[0] + base[s]) + eps;
    if (!post) return;
    float *C = comb;
    for (int s = 0; s < nc; s++) post[s] = 2.0f * di_sigmoid(mix[nc + s] * scale[1] + base[nc + s]);
    for (int j = 0; j < nc; j++)
        for (int k = 0; k < nc; k++)
            C[j * nc + k] = mix[2 * nc + j * nc + k] * scale[2] + base[2 * nc + j * nc + k];
    // Sinkhorn: row softmax + eps, column normalisation, then (iters - 1) x (rows, columns).
    for (int j = 0; j < nc; j++) {
        float mx = C[j * nc];
        for (int k = 1; k < nc; k++) mx = fmaxf(mx, C[j * nc + k]);
        float sum = 0;
        for (int k = 0; k < nc; k++) sum += (C[j * nc + k] = expf(C[j * nc + k] - mx));
        for (int k = 0; k < nc; k++) C[j * nc + k] = C[j * nc + k] / sum + eps;
    }
    for (int it = 0; it < iters; it++) {
        if (it > 0) {
            for (int j = 0; j < nc; j++) {
                float sum = 0;
                for (int k = 0; k < nc; k++) sum += C[j * nc + k];
                for (int k = 0; k < nc; k++) C[j * nc + k] /= sum + eps;
            }
        }
        for (int k = 0; k < nc; k++) {
            float sum = 0;
            for (int j = 0; j < nc; j++) sum += C[j * nc + k];
            for (int j = 0; j < nc; j++) C[j * nc + k] /= sum + eps;
        }
    }
}

// ---- top-k (spec §2.6) ----

// Heap order: a is worse than b if its score is lower, or equal with a higher index.
static inline bool worse(const float *sc, int32_t a, int32_t b) {
    return sc[a] < sc[b] || (sc[a] == sc[b] && a > b);
}

static int cmp_i32(const void *a, const void *b) {
    int32_t x = *(const int32_t *)a, y = *(const int32_t *)b;
    return (x > y) - (x < y);
}

int32_t di_ref_argmax(const float *v, int64_t n) {
    int64_t best = 0;
    for (int64_t i = 1; i < n; i++)
        if (v[i] > v[best]) best = i;
    return (int32_t)best;
}

void di_ref_topk(const float *sc, int64_t n, int32_t k, int32_t *sel) {
    // Min-heap of the k best (score descending, index ascending): O(n log k). Candidates come
    // in ascending index, so an equal score never displaces: ties keep the lower index.
    int32_t n_heap = 0;
    for (int64_t w = 0; w < n; w++) {
        if (n_heap < k) {
            int32_t i = n_heap++;
            sel[i] = (int32_t)w;
            while (i > 0 && worse(sc, sel[i], sel[(i - 1) / 2])) {
                int32_t par = (i - 1) / 2, tmp = sel[par];
                sel[par] = sel[i], sel[i] = tmp, i = par;
            }
        } else if (worse(sc, sel[0], (int32_t)w)) {
            sel[0] = (int32_t)w;
            for (int32_t i = 0;;) {
                int32_t l = 2 * i + 1, r = l + 1, m = i;
                if (l < k && worse(sc, sel[l], sel[m])) m = l;
                if (r < k && worse(sc, sel[r], sel[m])) m = r;
                if (m == i) break;
                int32_t tmp = sel[m];
                sel[m] = sel[i], sel[i] = tmp, i = m;
            }
        }
    }
    qsort(sel, (size_t)n_heap, sizeof *sel, cmp_i32); // ascending entry order
}

void di_ref_hc_post(const float *o, float *x, const float *post, const float *comb, int nc,
                    int64_t D, int32_t n_tok) {
    float mixed[16];
    for (int32_t t = 0; t < n_tok; t++) {
        float *xt = x + (int64_t)t * nc * D;
        const float *C = comb + t * nc * nc, *pt = post + t * nc, *ot = o + (int64_t)t * D;
        for (int64_t d = 0; d < D; d++) {
            for (int k = 0; k < nc; k++) {
                float acc = pt[k] * ot[d];
                for (int j = 0; j < nc; j++) acc += C[j * nc + k] * xt[j * D + d];
                mixed[k] = acc;
            }
            for (int k = 0; k < nc; k++) xt[k * D + d] = mixed[k];
        }
    }
}

void di_ref_route(const float *s, int32_t E, int32_t K, const float *bias, float eps,
                  float route_scale, int32_t *sel, float *wgt) {
    for (int32_t k = 0; k < K && bias; k++) {
        int32_t best = -1;
        float bv = -INFINITY;
        for (int32_t e = 0; e < E; e++) {
            bool taken = false;
            for (int32_t j = 0; j < k; j++) taken |= sel[j] == e;
            float v = s[e] + bias[e];
            if (!taken && (best < 0 || v > bv)) best = e, bv = v;
        }
        sel[k] = best;
    }
    float sum = 0;
    for (int32_t k = 0; k < K; k++) sum += s[sel[k]];
    sum += eps;
    for (int32_t k = 0; k < K; k++) wgt[k] = s[sel[k]] / sum * route_scale;
}

int32_t di_ref_moe_gather(const int32_t *sel, const float *wgt, int32_t n_tok, int32_t K, int32_t e,
                          const float *f, int64_t D, float *xin, int32_t *rows, float *rw) {
    int32_t n = 0;
    for (int32_t t = 0; t < n_tok; t++) {
        for (int32_t k = 0; k < K; k++) {
            if (sel[t * K + k] != e) continue;
            memcpy(xin + (int64_t)n * D, f + (int64_t)t * D, sizeof(float) * (size_t)D);
            rows[n] = t;
            rw[n] = wgt[t * K + k];
            n++;
        }
    }
    return n;
}

void di_ref_moe_add_rows(const float *y, const int32_t *rows, int32_t n, int64_t D, float *out) {
    for (int32_t r = 0; r < n; r++) {
        float *o = out + (int64_t)rows[r] * D;
        const float *yr = y + (int64_t)r * D;
        for (int64_t i = 0; i < D; i++) o[i] += yr[i];
    }
}

void di_ref_swiglu(float *g, const float *u, int64_t n, float limit) {
    for (int64_t i = 0; i < n; i++) {
        float gt = g[i], up = u[i];
        if (limit > 0) {
            gt = fminf(gt, limit);
            up = fminf(fmaxf(up, -limit), limit);
        }
        g[i] = di_silu(gt) * up;
    }
}

// ---- DeepSeek V4.1 ----

void di_ref_hc_collapse(const float *x, const float *pre, int nc, int64_t D, int32_t n_tok,
                        float *a) {
    for (int32_t t = 0; t < n_tok; t++) {
        const float *xt = x + (int64_t)t * nc * D, *p = pre + (int64_t)t * nc;
        float *at = a + (int64_t)t * D;
        for (int64_t d = 0; d < D; d++) {
            float acc = 0;
            for (int s = 0; s < nc; s++) acc += p[s] * xt[s * D + d];
            at[d] = acc;
        }
    }
}

void di_ref_engram_gate(const float *kv, const float *qk, int nc, int64_t D, int32_t n_tok,
                        float eps, float *x) {
    const float inv_sqrt_d = 1.0f / sqrtf((float)D);
    for (int32_t t = 0; t < n_tok; t++) {
        const float *kvt = kv + (int64_t)t * (nc + 1) * D, *val = kvt + nc * D;
        float *xt = x + (int64_t)t * nc * D;
        for (int s = 0; s < nc; s++) {
            const float *key = kvt + s * D, *w = qk + s * D;
            float *hs = xt + s * D;
            float ss_h = 0, ss_k = 0, dot = 0;
            for (int64_t d = 0; d < D; d++) {
                ss_h += hs[d] * hs[d];
                ss_k += key[d] * key[d];
                dot += hs[d] * w[d] * key[d];
            }
            dot *= 1.0f / sqrtf(ss_h / (float)D + eps) * (1.0f / sqrtf(ss_k / (float)D + eps)) *
                   inv_sqrt_d;
            float sgn = dot > 0 ? 1.0f : dot < 0 ? -1.0f : 0.0f;
            float g = di_sigmoid(sgn * sqrtf(fmaxf(fabsf(dot), 1e-6f)));
            for (int64_t d = 0; d < D; d++) hs[d] = hs[d] + g * val[d];
        }
    }
}

int32_t di_ref_cand_build(const float *sc, int64_t vis, int32_t bs, int32_t ntb, float *blk,
                          int32_t *cand) {
    int64_t n_blk = (vis + bs - 1) / bs;
    for (int64_t b = 0; b < n_blk; b++) {
        float mx = -INFINITY;
        for (int64_t w = b * bs; w < (b + 1) * bs && w < vis; w++) mx = fmaxf(mx, sc[w]);
        blk[b] = mx;
    }
    if (n_blk > 0) blk[n_blk - 1] = INFINITY;
    int32_t k = (int32_t)(n_blk < ntb ? n_blk : ntb);
    di_ref_topk(blk, n_blk, k, cand);
    return k;
}

void di_ref_cand_mask(float *sc, int64_t vis, int32_t bs, const int32_t *cand, int32_t n_cand) {
    for (int64_t w = 0; w < vis; w++) {
        bool in = false;
        for (int32_t i = 0; i < n_cand && !in; i++) in = cand[i] == w / bs;
        if (!in) sc[w] = -INFINITY;
    }
}

int32_t di_ref_cand_drop(const float *sc, int32_t *sel, int32_t k) {
    int32_t n = 0;
    for (int32_t i = 0; i < k; i++)
        if (sel[i] >= 0 && sc[sel[i]] > -INFINITY) sel[n++] = sel[i];
    for (int32_t i = n; i < k; i++) sel[i] = -1;
    return n;
}
