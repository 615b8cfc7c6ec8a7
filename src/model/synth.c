#include "model/synth.h"

#include <math.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h> // mkdir

#include "base/buf.h"
#include "base/log.h"
#include "base/mem.h"
#include "base/thread.h" // di_pool: fast codes on every core
#include "io/safetensors.h"
#include "tensor/quant_ref.h"

// ---- presets ----

di_status di_synth_preset(const char *name, di_synth_config *c) {
    memset(c, 0, sizeof *c);
    c->seed = 1234;
    c->official = true;
    c->route_scale = 1.5f;
    c->swiglu_limit = 10.0f;
    c->rope_dims = 64;
    c->n_mtp = 1;
    c->n_hash_layers = 2;
    if (strcmp(name, "tiny") == 0) {
        c->n_vocab = 129280;
        c->n_embd = 128;
        c->n_layer = 6;
        c->n_head = 4;
        c->head_dim = 128;
        c->q_lora_rank = 128;
        c->o_groups = 2;
        c->o_lora_rank = 128;
        c->window = 16;
        c->n_index_head = 4;
        c->index_head_dim = 128;
        c->index_topk = 3;
        c->n_expert = 8;
        c->n_expert_used = 2;
        c->expert_ff = 128;
        c->hca_ratio = 8;
        int32_t r[6] = {0, 4, 8, 4, 8, 0};
        memcpy(c->ratios, r, sizeof r);
        return DI_OK;
    }
    if (strcmp(name, "tiny-128") == 0) {
        // The tiny widths with V4's own compression ratios (4 and 128), the only ones llama.cpp's
        // deepseek4 loader accepts: the small model both engines run (bench/cpu/
        // vs_llamacpp_logits.sh). HCA needs > 128 tokens to hold an entry. 32 indexer heads
        // instead of 4: an index score is a sum of ReLUs over heads, so with 4 heads 1/16 of the
        // entries score exactly 0 and top-k ties are common, which each engine breaks its own way.
        di_status st = di_synth_preset("tiny", c);
        if (st != DI_OK) return st;
        c->hca_ratio = 128;
        c->n_index_head = 32;
        int32_t r[6] = {0, 4, 128, 4, 128, 0};
        memcpy(c->ratios, r, sizeof r);
        return DI_OK;
    }
    if (strcmp(name, "flash-4l") == 0) {
        c->n_vocab = 129280;
        c->n_embd = 4096;
        c->n_layer = 4;
        c->n_head = 64;
        c->head_dim = 512;
        c->q_lora_rank = 1024;
        c->o_groups = 8;
        c->o_lora_rank = 1024;
        c->window = 128;
        c->n_index_head = 64;
        c->index_head_dim = 128;
        c->index_topk = 512;
        c->n_expert = 32;
        c->n_expert_used = 6;
        c->expert_ff = 2048;
        c->hca_ratio = 128;
        c->n_hash_layers = 1;
        int32_t r[4] = {0, 4, 128, 4};
        memcpy(c->ratios, r, sizeof r);
        return DI_OK;
    }
    if (strncmp(name, "flash-full", 10) == 0) {
        // Every V4-Flash width (256 experts), few layers: the device forward's benchmark model.
        int n = 2;
        char tail = 0;
        const size_t len = strlen(name);
        if (name[10] != 0 && (name[10] != '-' || name[len - 1] != 'l' ||
                              sscanf(name + 10, "-%dl%c", &n, &tail) != 1 || n < 1 || n > 64)) {
            DI_LOG_ERROR("synth: preset \"%s\": flash-full-<N>l takes N = 1..64", name);
            return DI_ERR_INVALID;
        }
        di_status st = di_synth_preset("flash-4l", c);
        if (st != DI_OK) return st;
        c->n_layer = n;
        c->n_expert = 256;
        c->n_hash_layers = 0; // score routing, as 40 of V4-Flash's 43 layers
        c->n_mtp = 0;
        c->fast = true;
        for (int il = 0; il < n; il++) c->ratios[il] = il % 2 ? 128 : 4;
        return DI_OK;
    }
    DI_LOG_ERROR("synth: unknown preset \"%s\" (tiny, tiny-128, flash-4l, flash-full[-<N>l])",
                 name);
    return DI_ERR_INVALID;
}

// ---- random numbers (splitmix64 + Box-Muller), deterministic per seed ----

typedef struct rng {
    uint64_t s;
} rng;

static uint64_t next_u64(rng *r) {
    uint64_t z = (r->s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

static float uniform(rng *r) {
    return ((float)(next_u64(r) >> 40) + 0.5f) / 16777216.0f;
}

static float normal(rng *r) {
    float u1 = uniform(r), u2 = uniform(r);
    return sqrtf(-2.0f * logf(u1)) * cosf(6.2831853f * u2);
}

// ---- tensor list ----

typedef struct tlist {
    di_st_write_tensor *t; // owned array; names and data owned too
    int64_t n, cap;
} tlist;

static di_status add(tlist *l, const char *name, di_dtype dt, int nd, int64_t d0, int64_t d1,
                     void *data) {
    if (!data) return DI_ERR_NOMEM;
    if (l->n == l->cap) {
        int64_t cap = l->cap ? 2 * l->cap : 256;
        di_st_write_tensor *p = di_realloc(l->t, sizeof *p * (size_t)cap);
        if (!p) {
            di_free(data);
            return DI_ERR_NOMEM;
        }
        l->t = p;
        l->cap = cap;
    }
    char *nm = di_strdup(name);
    if (!nm) {
        di_free(data);
        return DI_ERR_NOMEM;
    }
    di_st_write_tensor *t = &l->t[l->n++];
    memset(t, 0, sizeof *t);
    t->name = nm;
    t->dtype = dt;
    t->n_dims = nd;
    t->shape[0] = d0;
    t->shape[1] = d1;
    t->data = data;
    return DI_OK;
}

static void tlist_free(tlist *l) {
    for (int64_t i = 0; i < l->n; i++) {
        di_free((void *)l->t[i].name);
        di_free((void *)l->t[i].data);
    }
    di_free(l->t);
}

typedef struct gen {
    const di_synth_config *c;
    rng r;
    tlist l;
    di_pool *pool; // owned by di_synth_write; NULL: one thread
} gen;

// ---- fast random codes (di_synth_config.fast) ----

// Work is cut into fixed chunks, each with its own generator seeded from (tensor seed, chunk): the
// bytes do not depend on the number of threads.
enum { FAST_CHUNK = 1 << 16 };

typedef enum fast_kind { FAST_KIND_BF16, FAST_KIND_FP8, FAST_KIND_BYTES } fast_kind;

typedef struct fast_job {
    fast_kind kind;
    void *out; // owned by the caller
    int64_t n; // elements (bytes for FAST_KIND_BYTES)
    uint64_t seed;
    float mean, std, inv_scale; // value = mean + std * N(0,1), FP8 code of value * inv_scale
} fast_job;

// An approximate N(0, 1) from one 64-bit draw: the sum of four 16-bit uniforms (mean 2, variance
// 1/3) centred and scaled; bounded by +-3.46 (no outliers, which suits random weights).
static inline float fast_normal(uint64_t z) {
    float s = (float)(z & 0xffff) + (float)((z >> 16) & 0xffff) + (float)((z >> 32) & 0xffff) +
              (float)(z >> 48);
    return ((s + 2.0f) * (1.0f / 65536.0f) - 2.0f) * 1.7320508f;
}

static void fast_fill(void *ctx, int ith, int nth) {
    const fast_job *j = ctx;
    const int64_t n_chunk = (j->n + FAST_CHUNK - 1) / FAST_CHUNK;
    int64_t lo, hi;
    di_split_range(n_chunk, ith, nth, &lo, &hi);
    for (int64_t k = lo; k < hi; k++) {
        rng r = {j->seed};
        r.s ^= next_u64(&(rng){(uint64_t)k * 0x2545f4914f6cdd1dull + 1});
        const int64_t i0 = k * FAST_CHUNK, i1 = i0 + FAST_CHUNK < j->n ? i0 + FAST_CHUNK : j->n;
        if (j->kind == FAST_KIND_BF16) {
            uint16_t *o = j->out;
            for (int64_t i = i0; i < i1; i++)
                o[i] = di_f32_to_bf16(j->mean + j->std * fast_normal(next_u64(&r)));
        } else if (j->kind == FAST_KIND_FP8) {
            uint8_t *o = j->out;
            for (int64_t i = i0; i < i1; i++)
                o[i] = di_f32_to_e4m3(j->std * fast_normal(next_u64(&r)) * j->inv_scale);
        } else {
            uint8_t *o = j->out;
            for (int64_t i = i0; i < i1; i += 8) {
                uint64_t z = next_u64(&r);
                memcpy(o + i, &z, (size_t)(i1 - i < 8 ? i1 - i : 8));
            }
        }
    }
}

// A new array of n codes (2 bytes each for BF16, 1 otherwise), or NULL.
static void *fast_codes(gen *g, fast_kind kind, int64_t n, float mean, float std, float inv_scale) {
    fast_job j = {kind,     di_malloc((size_t)n * (kind == FAST_KIND_BF16 ? 2 : 1)),
                  n,        next_u64(&g->r),
                  mean,     std,
                  inv_scale};
    if (j.out) di_pool_run(g->pool, fast_fill, &j);
    return j.out;
}

static uint8_t *const_bytes(int64_t n, uint8_t v) {
    uint8_t *p = di_malloc((size_t)n);
    if (p) memset(p, v, (size_t)n);
    return p;
}

// Values: mean + std * N(0,1), returned as a new F32 array of n.
static float *randn(gen *g, int64_t n, float mean, float std) {
    float *v = di_malloc(sizeof(float) * (size_t)n);
    if (v)
        for (int64_t i = 0; i < n; i++) v[i] = mean + std * normal(&g->r);
    return v;
}

static void *to_bf16(float *v, int64_t n) {
    if (!v) return NULL;
    uint16_t *o = di_malloc(sizeof(uint16_t) * (size_t)n);
    if (o)
        for (int64_t i = 0; i < n; i++) o[i] = di_f32_to_bf16(v[i]);
    di_free(v);
    return o;
}

static di_status add_f32(gen *g, const char *name, int nd, int64_t d0, int64_t d1, float mean,
                         float std) {
    return add(&g->l, name, DI_DTYPE_F32, nd, d0, d1, randn(g, nd == 1 ? d0 : d0 * d1, mean, std));
}

static di_status add_bf16(gen *g, const char *name, int nd, int64_t d0, int64_t d1, float mean,
                          float std) {
    int64_t n = nd == 1 ? d0 : d0 * d1;
    if (g->c->fast)
        return add(&g->l, name, DI_DTYPE_BF16, nd, d0, d1,
                   fast_codes(g, FAST_KIND_BF16, n, mean, std, 1.0f));
    return add(&g->l, name, DI_DTYPE_BF16, nd, d0, d1, to_bf16(randn(g, n, mean, std), n));
}

static uint8_t pow2_scale_byte(float amax, float qmax) {
    float s = amax / qmax;
    if (!(s > 1e-30f)) s = 1e-30f;
    return (uint8_t)(di_ceil_log2_bits(s) + 127);
}

// Adds an FP8 weight's codes q [rows, cols] and its scales sc [br, bc] (both taken over, also on
// failure) as `name` and `name` with ".weight" replaced by ".scale".
static di_status add_fp8(gen *g, const char *name, int64_t rows, int64_t cols, int64_t br,
                         int64_t bc, uint8_t *q, uint8_t *sc) {
    if (!q || !sc) {
        di_free(q), di_free(sc);
        return DI_ERR_NOMEM;
    }
    char sname[256];
    snprintf(sname, sizeof sname, "%.*s.scale", (int)(strlen(name) - 7), name);
    di_status st = add(&g->l, name, DI_DTYPE_F8_E4M3, 2, rows, cols, q);
    if (st == DI_OK)
        st = add(&g->l, sname, DI_DTYPE_F8_E8M0, 2, br, bc, sc);
    else
        di_free(sc);
    return st;
}

// A [rows, cols] linear weight ~ N(0, 1/cols): FP8 + 128x128 scales (official) or BF16.
static di_status add_linear_blk(gen *g, const char *name, int64_t rows, int64_t cols, bool fp8,
                                int64_t bo, int64_t bi);

static di_status add_linear(gen *g, const char *name, int64_t rows, int64_t cols, bool fp8) {
    int64_t blk = g->c->fp8_block > 0 ? g->c->fp8_block : 128;
    return add_linear_blk(g, name, rows, cols, fp8, blk, blk);
}

// An FP8 weight with bo x bi UE8M0 block scales (official), else BF16.
static di_status add_linear_blk(gen *g, const char *name, int64_t rows, int64_t cols, bool fp8,
                                int64_t bo, int64_t bi) {
    float std = 1.0f / sqrtf((float)cols);
    if (!g->c->official || !fp8) return add_bf16(g, name, 2, rows, cols, 0, std);
    int64_t br = (rows + bo - 1) / bo, bc = (cols + bi - 1) / bi;
    if (g->c->fast) { // one scale for the whole tensor: the values' bound 3.47 std maps to <= 448
        const uint8_t sb = pow2_scale_byte(3.47f * std, 448.0f);
        uint8_t *q = fast_codes(g, FAST_KIND_FP8, rows * cols, 0, std, 1.0f / di_ue8m0_to_f32(sb));
        uint8_t *sc = const_bytes(br * bc, sb);
        return add_fp8(g, name, rows, cols, br, bc, q, sc);
    }
    float *w = randn(g, rows * cols, 0, std);
    uint8_t *q = di_malloc((size_t)(rows * cols)), *sc = di_malloc((size_t)(br * bc));
    if (!w || !q || !sc) {
        di_free(w), di_free(q), di_free(sc);
        return DI_ERR_NOMEM;
    }
    for (int64_t i0 = 0; i0 < br; i0++)
        for (int64_t j0 = 0; j0 < bc; j0++) {
            float amax = 0;
            for (int64_t r = i0 * bo; r < rows && r < i0 * bo + bo; r++)
                for (int64_t c = j0 * bi; c < cols && c < j0 * bi + bi; c++)
                    amax = fmaxf(amax, fabsf(w[r * cols + c]));
            uint8_t sb = pow2_scale_byte(amax, 448.0f);
            float inv = 1.0f / di_ue8m0_to_f32(sb);
            sc[i0 * bc + j0] = sb;
            for (int64_t r = i0 * bo; r < rows && r < i0 * bo + bo; r++)
                for (int64_t c = j0 * bi; c < cols && c < j0 * bi + bi; c++)
                    q[r * cols + c] = di_f32_to_e4m3(w[r * cols + c] * inv);
        }
    di_free(w);
    return add_fp8(g, name, rows, cols, br, bc, q, sc);
}

// Takes q (FP4 e2m1 pairs, [rows, cols / 2] bytes) and sc (1x32 scales) into the checkpoint as
// `name` and its ".scale" (as add_fp8).
static di_status add_fp4(gen *g, const char *name, int64_t rows, int64_t cols, uint8_t *q,
                         uint8_t *sc) {
    if (!q || !sc) {
        di_free(q), di_free(sc);
        return DI_ERR_NOMEM;
    }
    char sname[256];
    snprintf(sname, sizeof sname, "%.*s.scale", (int)(strlen(name) - 7), name);
    di_status st = add(&g->l, name, DI_DTYPE_I8, 2, rows, cols / 2, q);
    if (st == DI_OK)
        st = add(&g->l, sname, DI_DTYPE_F8_E8M0, 2, rows, cols / 32, sc);
    else
        di_free(sc);
    return st;
}

// A routed expert's [rows, cols] weight: FP4 e2m1 pairs + 1x32 scales (official) or BF16.
static di_status add_expert(gen *g, const char *name, int64_t rows, int64_t cols) {
    if (!g->c->official) return add_linear(g, name, rows, cols, false);
    float std = 1.0f / sqrtf((float)cols);
    if (g->c->fast) {
        // Uniform random codes: RMS of the e2m1 magnitudes {0, .5, 1, 1.5, 2, 3, 4, 6} is
        // sqrt(68.5 / 8) = 2.93; the nearest power-of-two scale to std / 2.93.
        const uint8_t sb = (uint8_t)(127 + (int)lroundf(log2f(std / 2.926f)));
        return add_fp4(g, name, rows, cols,
                       fast_codes(g, FAST_KIND_BYTES, rows * cols / 2, 0, 0, 0),
                       const_bytes(rows * cols / 32, sb));
    }
    float *w = randn(g, rows * cols, 0, std);
    uint8_t *q = di_calloc((size_t)(rows * cols / 2), 1),
            *sc = di_malloc((size_t)(rows * cols / 32));
    if (!w || !q || !sc) {
        di_free(w), di_free(q), di_free(sc);
        return DI_ERR_NOMEM;
    }
    for (int64_t r = 0; r < rows; r++)
        for (int64_t b = 0; b < cols / 32; b++) {
            float amax = 0;
            const float *v = w + r * cols + b * 32;
            for (int i = 0; i < 32; i++) amax = fmaxf(amax, fabsf(v[i]));
            uint8_t sb = pow2_scale_byte(amax, 6.0f);
            float inv = 1.0f / di_ue8m0_to_f32(sb);
            sc[r * (cols / 32) + b] = sb;
            for (int i = 0; i < 32; i++) {
                uint8_t code = di_f32_to_e2m1(v[i] * inv) & 0xF;
                int64_t idx = r * cols + b * 32 + i;
                q[idx / 2] |= (uint8_t)(idx % 2 ? code << 4 : code);
            }
        }
    di_free(w);
    return add_fp4(g, name, rows, cols, q, sc);
}

// ---- the model's tensors (names as weights.c binds them) ----

#define TRY(x)                                                                                     \
    do {                                                                                           \
        di_status st_ = (x);                                                                       \
        if (st_ != DI_OK) return st_;                                                              \
    } while (0)

static const char *nm(char *buf, const char *a, const char *b) {
    snprintf(buf, 256, "%s%s", a, b);
    return buf;
}

static di_status gen_block(gen *g, const char *p, int ratio, bool hash) {
    const di_synth_config *c = g->c;
    int64_t D = c->n_embd, nc = 4, mix = (2 + nc) * nc, H = c->n_head, Dh = c->head_dim;
    int64_t Rq = c->q_lora_rank, G = c->o_groups, Ro = c->o_lora_rank, E = c->n_expert;
    int64_t F = c->expert_ff;
    bool off = c->official;
    char b[256];
    TRY(add_bf16(g, nm(b, p, off ? "attn_norm.weight" : "input_layernorm.weight"), 1, D, 0, 1,
                 0.1f));
    TRY(add_bf16(g, nm(b, p, off ? "ffn_norm.weight" : "post_attention_layernorm.weight"), 1, D, 0,
                 1, 0.1f));
    const char *sites[2] = {"attn", "ffn"};
    for (int s = 0; s < 2; s++) {
        char suf[64];
        snprintf(suf, sizeof suf, off ? "hc_%s_fn" : "%s_hc.fn", sites[s]);
        TRY(add_f32(g, nm(b, p, suf), 2, mix, nc * D, 0, 1.0f / sqrtf((float)(nc * D))));
        snprintf(suf, sizeof suf, off ? "hc_%s_base" : "%s_hc.base", sites[s]);
        TRY(add_f32(g, nm(b, p, suf), 1, mix, 0, 0, 0.5f));
        snprintf(suf, sizeof suf, off ? "hc_%s_scale" : "%s_hc.scale", sites[s]);
        TRY(add_f32(g, nm(b, p, suf), 1, 3, 0, 1, 0.2f));
    }
    const char *A = off ? "attn." : "self_attn.";
    char pa[256];
    snprintf(pa, sizeof pa, "%s%s", p, A);
    TRY(add_linear(g, nm(b, pa, off ? "wq_a.weight" : "q_a_proj.weight"), Rq, D, true));
    TRY(add_bf16(g, nm(b, pa, off ? "q_norm.weight" : "q_a_norm.weight"), 1, Rq, 0, 1, 0.1f));
    TRY(add_linear(g, nm(b, pa, off ? "wq_b.weight" : "q_b_proj.weight"), H * Dh, Rq, true));
    TRY(add_linear(g, nm(b, pa, off ? "wkv.weight" : "kv_proj.weight"), Dh, D, true));
    TRY(add_bf16(g, nm(b, pa, "kv_norm.weight"), 1, Dh, 0, 1, 0.1f));
    TRY(add_linear(g, nm(b, pa, off ? "wo_a.weight" : "o_a_proj.weight"), G * Ro, H * Dh / G,
                   true));
    TRY(add_linear(g, nm(b, pa, off ? "wo_b.weight" : "o_b_proj.weight"), D, G * Ro, true));
    TRY(add_f32(g, nm(b, pa, off ? "attn_sink" : "sinks"), 1, H, 0, 0, 1));
    for (int which = 0; which < (ratio == 4 ? 2 : ratio > 0 ? 1 : 0); which++) {
        int64_t d = which ? c->index_head_dim : Dh, m = which ? 4 : ratio, cc = m == 4 ? 2 : 1;
        char pc[256];
        snprintf(pc, sizeof pc, "%s%s", pa,
                 off ? (which ? "indexer.compressor." : "compressor.")
                     : (which ? "compressor.indexer." : "compressor."));
        TRY(add_bf16(g, nm(b, pc, off ? "wkv.weight" : "kv_proj.weight"), 2, cc * d, D, 0,
                     1.0f / sqrtf((float)D)));
        TRY(add_bf16(g, nm(b, pc, off ? "wgate.weight" : "gate_proj.weight"), 2, cc * d, D, 0,
                     1.0f / sqrtf((float)D)));
        TRY(add_f32(g, nm(b, pc, off ? "ape" : "position_bias"), 2, m, cc * d, 0, 0.5f));
        TRY(add_bf16(g, nm(b, pc, off ? "norm.weight" : "kv_norm.weight"), 1, d, 0, 1, 0.1f));
    }
    if (ratio == 4) {
        int64_t HI = c->n_index_head, DI = c->index_head_dim;
        TRY(add_linear(
            g, nm(b, pa, off ? "indexer.wq_b.weight" : "compressor.indexer.q_b_proj.weight"),
            HI * DI, Rq, true));
        TRY(add_bf16(g,
                     nm(b, pa,
                        off ? "indexer.weights_proj.weight"
                            : "compressor.indexer.scorer.weights_proj.weight"),
                     2, HI, D, 0, 1.0f / sqrtf((float)D)));
    }
    char pf[256];
    snprintf(pf, sizeof pf, "%s%s", p, off ? "ffn." : "mlp.");
    TRY(add_bf16(g, nm(b, pf, "gate.weight"), 2, E, D, 0, 1.0f / sqrtf((float)D)));
    if (hash) {
        int64_t K = c->n_expert_used;
        int64_t *t2e = di_malloc(sizeof(int64_t) * (size_t)(c->n_vocab * K));
        if (!t2e) return DI_ERR_NOMEM;
        for (int64_t v = 0; v < c->n_vocab; v++)
            for (int64_t k = 0; k < K; k++) {
                int64_t e;
                bool dup;
                do { // K distinct experts per token
                    e = (int64_t)(next_u64(&g->r) % (uint64_t)E);
                    dup = false;
                    for (int64_t j = 0; j < k; j++) dup |= t2e[v * K + j] == e;
                } while (dup);
                t2e[v * K + k] = e;
            }
        TRY(add(&g->l, nm(b, pf, "gate.tid2eid"), DI_DTYPE_I64, 2, c->n_vocab, K, t2e));
    } else {
        TRY(add_f32(g, nm(b, pf, off ? "gate.bias" : "gate.e_score_correction_bias"), 1, E, 0, 0,
                    0.1f));
    }
    if (off) {
        for (int64_t e = 0; e < E; e++) {
            char s[96];
            snprintf(s, sizeof s, "experts.%lld.w1.weight", (long long)e);
            TRY(add_expert(g, nm(b, pf, s), F, D));
            snprintf(s, sizeof s, "experts.%lld.w2.weight", (long long)e);
            TRY(add_expert(g, nm(b, pf, s), D, F));
            snprintf(s, sizeof s, "experts.%lld.w3.weight", (long long)e);
            TRY(add_expert(g, nm(b, pf, s), F, D));
        }
        TRY(add_linear(g, nm(b, pf, "shared_experts.w1.weight"), F, D, true));
        TRY(add_linear(g, nm(b, pf, "shared_experts.w2.weight"), D, F, true));
        TRY(add_linear(g, nm(b, pf, "shared_experts.w3.weight"), F, D, true));
    } else {
        TRY(add_bf16(g, nm(b, pf, "experts.gate_up_proj"), 2, E * 2 * F, D, 0,
                     1.0f / sqrtf((float)D)));
        g->l.t[g->l.n - 1].n_dims = 3, g->l.t[g->l.n - 1].shape[0] = E,
                        g->l.t[g->l.n - 1].shape[1] = 2 * F, g->l.t[g->l.n - 1].shape[2] = D;
        TRY(add_bf16(g, nm(b, pf, "experts.down_proj"), 2, E * D, F, 0, 1.0f / sqrtf((float)F)));
        g->l.t[g->l.n - 1].n_dims = 3, g->l.t[g->l.n - 1].shape[0] = E,
                        g->l.t[g->l.n - 1].shape[1] = D, g->l.t[g->l.n - 1].shape[2] = F;
        TRY(add_linear(g, nm(b, pf, "shared_experts.gate_proj.weight"), F, D, false));
        TRY(add_linear(g, nm(b, pf, "shared_experts.down_proj.weight"), D, F, false));
        TRY(add_linear(g, nm(b, pf, "shared_experts.up_proj.weight"), F, D, false));
    }
    return DI_OK;
}

static di_status write_config(const di_synth_config *c, const char *dir) {
    di_buf b;
    di_buf_init(&b);
    di_buf_printf(
        &b,
        "{\n  \"architectures\": [\"DeepseekV4ForCausalLM\"],\n  \"model_type\": \"deepseek_v4\",\n"
        "  \"_comment\": \"random weights written by deepinfer synth (seed %llu): the model's text "
        "is meaningless\",\n"
        "  \"vocab_size\": %d, \"hidden_size\": %d, \"num_hidden_layers\": %d,\n"
        "  \"num_attention_heads\": %d, \"num_key_value_heads\": 1, \"head_dim\": %d,\n"
        "  \"qk_rope_head_dim\": %d, \"q_lora_rank\": %d, \"o_groups\": %d, \"o_lora_rank\": %d,\n"
        "  \"sliding_window\": %d, \"index_n_heads\": %d, \"index_head_dim\": %d, \"index_topk\": "
        "%d,\n"
        "  \"n_routed_experts\": %d, \"num_experts_per_tok\": %d, \"n_shared_experts\": 1,\n"
        "  \"moe_intermediate_size\": %d, \"num_hash_layers\": %d, \"scoring_func\": "
        "\"sqrtsoftplus\",\n"
        "  \"routed_scaling_factor\": %g, \"swiglu_limit\": %g, \"norm_topk_prob\": true,\n"
        "  \"hc_mult\": 4, \"hc_sinkhorn_iters\": 20, \"hc_eps\": 1e-06, \"rms_norm_eps\": 1e-06,\n"
        "  \"num_nextn_predict_layers\": %d, \"max_position_embeddings\": 1048576,\n"
        "  \"rope_theta\": 10000, \"compress_rope_theta\": 160000,\n"
        "  \"rope_scaling\": {\"type\": \"yarn\", \"factor\": 16, "
        "\"original_max_position_embeddings\": 65536, \"beta_fast\": 32, \"beta_slow\": 1},\n"
        "  \"bos_token_id\": 0, \"eos_token_id\": 1, \"tie_word_embeddings\": false,\n",
        (unsigned long long)c->seed, c->n_vocab, c->n_embd, c->n_layer, c->n_head, c->head_dim,
        c->rope_dims, c->q_lora_rank, c->o_groups, c->o_lora_rank, c->window, c->n_index_head,
        c->index_head_dim, c->index_topk, c->n_expert, c->n_expert_used, c->expert_ff,
        c->n_hash_layers, c->route_scale, c->swiglu_limit, c->n_mtp);
    di_buf_printf(&b, "  \"layer_types\": [");
    for (int il = 0; il < c->n_layer; il++)
        di_buf_printf(&b, "%s\"%s\"", il ? ", " : "",
                      c->ratios[il] == 0   ? "sliding_attention"
                      : c->ratios[il] == 4 ? "compressed_sparse_attention"
                                           : "heavily_compressed_attention");
    di_buf_printf(&b,
                  "],\n  \"compress_rates\": {\"compressed_sparse_attention\": 4, "
                  "\"heavily_compressed_attention\": %d}",
                  c->hca_ratio);
    if (c->official)
        di_buf_printf(
            &b,
            ",\n  \"expert_dtype\": \"fp4\",\n  \"quantization_config\": {\"activation_scheme\": "
            "\"dynamic\", \"fmt\": \"e4m3\", \"quant_method\": \"fp8\", \"scale_fmt\": "
            "\"ue8m0\", \"weight_block_size\": [128, 128]}");
    di_buf_printf(&b, "\n}\n");
    char path[4096];
    snprintf(path, sizeof path, "%s/config.json", dir);
    FILE *f = fopen(path, "w");
    bool ok = f && b.data && fwrite(b.data, 1, b.len, f) == b.len;
    if (f) ok = (fclose(f) == 0) && ok;
    di_buf_deinit(&b);
    if (!ok) {
        DI_LOG_ERROR("synth: cannot write %s", path);
        return DI_ERR_IO;
    }
    return DI_OK;
}

di_status di_synth_write(const di_synth_config *c, const char *dir) {
    if (c->n_layer < 1 || c->n_layer > 64 || c->n_embd % 128 || c->n_expert_used > c->n_expert) {
        DI_LOG_ERROR("synth: invalid configuration");
        return DI_ERR_INVALID;
    }
    gen g = {.c = c, .r = {c->seed}};
    di_status st = DI_OK;
    if (c->fast && (st = di_pool_create(0, &g.pool)) != DI_OK) return st;
    bool off = c->official;
    int64_t V = c->n_vocab, D = c->n_embd;
    char b[256];
#define GTRY(x)                                                                                    \
    do {                                                                                           \
        if ((st = (x)) != DI_OK) goto done;                                                        \
    } while (0)
    GTRY(add_bf16(&g, off ? "embed.weight" : "model.embed_tokens.weight", 2, V, D, 0, 1.0f));
    GTRY(add_bf16(&g, off ? "head.weight" : "lm_head.weight", 2, V, D, 0, 1.0f / sqrtf((float)D)));
    GTRY(add_bf16(&g, off ? "norm.weight" : "model.norm.weight", 1, D, 0, 1, 0.1f));
    GTRY(add_f32(&g, off ? "hc_head_fn" : "model.hc_head.hc_fn", 2, 4, 4 * D, 0,
                 1.0f / sqrtf(4.0f * D)));
    GTRY(add_f32(&g, off ? "hc_head_base" : "model.hc_head.hc_base", 1, 4, 0, 0, 0.5f));
    GTRY(add_f32(&g, off ? "hc_head_scale" : "model.hc_head.hc_scale", 1, 1, 0, 1, 0.2f));
    for (int il = 0; il < c->n_layer; il++) {
        snprintf(b, sizeof b, off ? "layers.%d." : "model.layers.%d.", il);
        GTRY(gen_block(&g, b, c->ratios[il], il < c->n_hash_layers));
    }
    if (off && c->n_mtp > 0) { // MTP block 0 (HF checkpoints carry no MTP)
        char p[32] = "mtp.0.";
        GTRY(add_linear(&g, nm(b, p, "e_proj.weight"), D, D, true));
        GTRY(add_linear(&g, nm(b, p, "h_proj.weight"), D, D, true));
        GTRY(add_bf16(&g, nm(b, p, "enorm.weight"), 1, D, 0, 1, 0.1f));
        GTRY(add_bf16(&g, nm(b, p, "hnorm.weight"), 1, D, 0, 1, 0.1f));
        GTRY(add_bf16(&g, nm(b, p, "norm.weight"), 1, D, 0, 1, 0.1f));
        GTRY(add_f32(&g, nm(b, p, "hc_head_fn"), 2, 4, 4 * D, 0, 1.0f / sqrtf(4.0f * D)));
        GTRY(add_f32(&g, nm(b, p, "hc_head_base"), 1, 4, 0, 0, 0.5f));
        GTRY(add_f32(&g, nm(b, p, "hc_head_scale"), 1, 1, 0, 1, 0.2f));
        GTRY(gen_block(&g, p, 0, false));
    }
    GTRY(write_config(c, dir));
    char path[4096];
    snprintf(path, sizeof path, "%s/model.safetensors", dir);
    GTRY(di_st_write_file(path, g.l.t, g.l.n));
done:
    if (c->official == false && c->n_mtp > 0 && st == DI_OK)
        DI_LOG_INFO("synth: the HF layout carries no MTP block (as save_pretrained)");
    tlist_free(&g.l);
    di_pool_destroy(g.pool);
    return st;
#undef GTRY
}

// ---- DeepSeek V4.1 tiny model (deepseek-v41.md §7.2) ----

// Native names throughout; official: FP8 / FP4 where the release has them, else F32.
static di_status v41_lin(gen *g, const char *p, const char *name, int64_t rows, int64_t cols,
                         bool fp8) {
    char b[256];
    if (g->c->official) return add_linear(g, nm(b, p, name), rows, cols, fp8);
    return add_f32(g, nm(b, p, name), 2, rows, cols, 0, 1.0f / sqrtf((float)cols));
}

static di_status v41_vec(gen *g, const char *p, const char *name, int64_t n, float mean,
                         float std) {
    char b[256];
    if (g->c->official) return add_bf16(g, nm(b, p, name), 1, n, 0, mean, std);
    return add_f32(g, nm(b, p, name), 1, n, 0, mean, std);
}

typedef struct v41_shape {
    int64_t D, H, Dh, Rq, G, Ro, HI, DI, F, NC, ncol, hd, V;
} v41_shape;

static di_status gen_v41_block(gen *g, const v41_shape *z, const char *p, int ratio, bool kv_src,
                               bool idx_src, int64_t engram_rows, int64_t E) {
    char b[256], pa[256], pf[256];
    const int64_t D = z->D, mix = (2 + z->NC) * z->NC;
    TRY(v41_vec(g, p, "attn_norm.weight", D, 1, 0.1f));
    TRY(v41_vec(g, p, "ffn_norm.weight", D, 1, 0.1f));
    const char *sites[2] = {"attn", "ffn"};
    for (int s = 0; s < 2; s++) {
        char suf[64];
        snprintf(suf, sizeof suf, "hc_%s_fn", sites[s]);
        TRY(add_f32(g, nm(b, p, suf), 2, mix, z->NC * D, 0, 1.0f / sqrtf((float)(z->NC * D))));
        snprintf(suf, sizeof suf, "hc_%s_base", sites[s]);
        TRY(add_f32(g, nm(b, p, suf), 1, mix, 0, 0, 0.5f));
        snprintf(suf, sizeof suf, "hc_%s_scale", sites[s]);
        TRY(add_f32(g, nm(b, p, suf), 1, 3, 0, 1, 0.2f));
    }
    if (engram_rows > 0) {
        const int64_t n = engram_rows * z->hd;
        if (g->c->official) {
            TRY(add_linear_blk(g, nm(b, p, "engram.embed.weight"), engram_rows, z->hd, true, 1,
                               32));
        } else {
            TRY(add(&g->l, nm(b, p, "engram.embed.weight"), DI_DTYPE_F32, 2, engram_rows, z->hd,
                    randn(g, n, 0, 1.0f)));
        }
        TRY(v41_lin(g, p, "engram.wkv.weight", (z->NC + 1) * D, z->ncol * z->hd, true));
        if (g->c->official) {
            TRY(add_bf16(g, nm(b, p, "engram.q_weight"), 2, z->NC, D, 1, 0.3f));
            TRY(add_bf16(g, nm(b, p, "engram.k_weight"), 2, z->NC, D, 1, 0.3f));
        } else {
            TRY(add_f32(g, nm(b, p, "engram.q_weight"), 2, z->NC, D, 1, 0.3f));
            TRY(add_f32(g, nm(b, p, "engram.k_weight"), 2, z->NC, D, 1, 0.3f));
        }
    }
    snprintf(pa, sizeof pa, "%sattn.", p);
    TRY(v41_lin(g, pa, "wq_a.weight", z->Rq, D, true));
    TRY(v41_vec(g, pa, "q_norm.weight", z->Rq, 1, 0.1f));
    TRY(v41_lin(g, pa, "wq_b.weight", z->H * z->Dh, z->Rq, true));
    TRY(v41_lin(g, pa, "wkv.weight", z->Dh, D, true));
    TRY(v41_vec(g, pa, "kv_norm.weight", z->Dh, 1, 0.1f));
    TRY(v41_lin(g, pa, "wo_a.weight", z->G * z->Ro, z->H * z->Dh / z->G, true));
    TRY(v41_lin(g, pa, "wo_b.weight", D, z->G * z->Ro, true));
    TRY(add_f32(g, nm(b, pa, "attn_sink"), 1, z->H, 0, 0, 1));
    if (kv_src) {
        TRY(v41_lin(g, pa, "compressor.wkv.weight", z->Dh, D, false));
        if (ratio == 2) TRY(v41_lin(g, pa, "compressor.wgate.weight", z->Dh, D, false));
        TRY(v41_vec(g, pa, "compressor.norm.weight", z->Dh, 1, 0.1f));
        TRY(v41_lin(g, pa, "indexer.wk.weight", z->DI, z->Dh, false));
        TRY(v41_vec(g, pa, "indexer.k_norm.weight", z->DI, 1, 0.1f));
    }
    if (idx_src) {
        TRY(v41_lin(g, pa, "indexer.wq_b.weight", z->HI * z->DI, z->Rq, true));
        TRY(v41_lin(g, pa, "indexer.weights_proj.weight", z->HI, D, false));
    }
    snprintf(pf, sizeof pf, "%sffn.", p);
    TRY(v41_lin(g, pf, "gate.weight", E, D, false));
    TRY(add_f32(g, nm(b, pf, "gate.bias"), 1, E, 0, 0, 0.1f));
    TRY(add_f32(g, nm(b, pf, "gate.bias_vl"), 1, E, 0, 0, 0.1f));
    for (int64_t e = 0; e < E; e++) {
        char s[96];
        for (int w = 1; w <= 3; w++) {
            snprintf(s, sizeof s, "experts.%lld.w%d.weight", (long long)e, w);
            int64_t rows = w == 2 ? D : z->F, cols = w == 2 ? z->F : D;
            if (g->c->official)
                TRY(add_expert(g, nm(b, pf, s), rows, cols));
            else
                TRY(v41_lin(g, pf, s, rows, cols, false));
        }
    }
    TRY(v41_lin(g, pf, "shared_experts.w1.weight", z->F, D, true));
    TRY(v41_lin(g, pf, "shared_experts.w2.weight", D, z->F, true));
    TRY(v41_lin(g, pf, "shared_experts.w3.weight", z->F, D, true));
    return DI_OK;
}

// A V4.1 checkpoint's shape and layer schedule: the presets v41-tiny (spec §7.2) and
// v41-flash-4l (V4.1-Flash's widths, 4 layers, 32 experts: the CPU benchmark's model).
typedef struct v41_spec {
    v41_shape z;
    int32_t n_layer;
    int32_t ratio[8];
    bool kv[8], idx[8];             // KV sources (they compress), index sources
    int32_t engram[2], n_engram;    // Engram layers
    int64_t engram_vocab;           // engram_vocab_size: a layer's rows are the sum of its primes
    int32_t engram_heads, n_cvocab; // engram_n_heads; compressed vocabulary (cmap[id] = id / 2)
    int32_t cand_layer, cand_blocks, cand_block_size, index_topk;
    int32_t rope, window, E, K, max_pos, yarn_orig;
    float yarn_factor;
    int32_t image_token, dspark_target[2];
    bool fast; // di_synth_config.fast: the large preset's random codes on every core
} v41_spec;

static const v41_spec k_v41_tiny = {.z = {.D = 256,
                                          .H = 4,
                                          .Dh = 64,
                                          .Rq = 64,
                                          .G = 2,
                                          .Ro = 64,
                                          .HI = 4,
                                          .DI = 64,
                                          .F = 128,
                                          .NC = 4,
                                          .ncol = 6,
                                          .hd = 32,
                                          .V = 512},
                                    .n_layer = 6,
                                    .ratio = {0, 2, 2, 1, 1, 1},
                                    .kv = {0, 1, 0, 1, 0, 0},
                                    .idx = {0, 1, 0, 1, 0, 1},
                                    .engram = {0, 1},
                                    .n_engram = 2,
                                    .engram_vocab = 100,
                                    .engram_heads = 2,
                                    .n_cvocab = 256,
                                    .cand_layer = 3,
                                    .cand_blocks = 3,
                                    .cand_block_size = 4,
                                    .index_topk = 8,
                                    .rope = 16,
                                    .window = 16,
                                    .E = 4,
                                    .K = 2,
                                    .max_pos = 4096,
                                    .yarn_orig = 32,
                                    .yarn_factor = 4.0f,
                                    .image_token = 500,
                                    .dspark_target = {4, 5}};

static const v41_spec k_v41_flash_4l = {
    .z = {.D = 5120,
          .H = 64,
          .Dh = 512,
          .Rq = 1280,
          .G = 8,
          .Ro = 1024,
          .HI = 32,
          .DI = 128,
          .F = 2304,
          .NC = 4,
          .ncol = 24,
          .hd = 256,
          .V = 129280},
    .n_layer = 4,
    .ratio = {0, 2, 2, 1},
    .kv = {0, 1, 0, 1},
    .idx = {0, 1, 0, 1},
    .engram = {1},
    .n_engram = 1,
    .engram_vocab = 40000, // 24 primes above it: ~960k rows of 256 (246 MB; the release: 16M)
    .engram_heads = 8,
    .n_cvocab = 64640,
    .cand_layer = 3,
    .cand_blocks = 2048,
    .cand_block_size = 8,
    .index_topk = 512,
    .rope = 64,
    .window = 128,
    .E = 32,
    .K = 6,
    .max_pos = 1048576,
    .yarn_orig = 65536,
    .yarn_factor = 16.0f,
    .image_token = 128815,
    .dspark_target = {2, 3},
    .fast = true};

static bool is_prime(int64_t n) {
    if (n < 2) return false;
    for (int64_t d = 2; d * d <= n; d++)
        if (n % d == 0) return false;
    return true;
}

// The rows of every Engram layer (spec §2.3.1: for each layer, n-gram size and head, the
// smallest prime above the last one handed out for that size, never used in any layer; the
// search of each size starts at engram_vocab_size - 1).
static void v41_engram_rows(const v41_spec *sp, int64_t *rows) {
    enum { MAX_NGRAM = 4 };
    int64_t last[MAX_NGRAM + 1], used[64];
    int n_used = 0;
    for (int n = 2; n <= MAX_NGRAM; n++) last[n] = sp->engram_vocab - 1;
    for (int l = 0; l < sp->n_engram; l++) {
        rows[l] = 0;
        for (int n = 2; n <= MAX_NGRAM; n++)
            for (int h = 0; h < sp->engram_heads; h++) {
                int64_t p = last[n] + 1;
                for (;; p++) {
                    bool taken = false;
                    for (int i = 0; i < n_used; i++) taken = taken || used[i] == p;
                    if (!taken && is_prime(p)) break;
                }
                used[n_used++] = p;
                last[n] = p;
                rows[l] += p;
            }
    }
}

// "[a, b, c]" of the first n values (prefixed by `extra` entries when given).
static void json_ints(di_buf *b, const int32_t *v, int n, const char *extra) {
    di_buf_printf(b, "[");
    for (int i = 0; i < n; i++) di_buf_printf(b, "%s%d", i ? ", " : "", (int)v[i]);
    di_buf_printf(b, "%s]", extra ? extra : "");
}

static di_status v41_write(const char *dir, const v41_spec *sp, bool official, bool dspark,
                           uint64_t seed) {
    di_synth_config c;
    memset(&c, 0, sizeof c);
    c.official = official;
    c.seed = seed;
    c.fp8_block = 32;
    c.fast = sp->fast;
    gen g = {.c = &c, .r = {seed}};
    const v41_shape z = sp->z;
    int64_t engram_rows[2] = {0, 0};
    v41_engram_rows(sp, engram_rows);
    di_status st = DI_OK;
    char b[256];
    di_buf cfg;
    di_buf_init(&cfg);
    if (c.fast && (st = di_pool_create(0, &g.pool)) != DI_OK) return st;
#define GTRY(x)                                                                                    \
    do {                                                                                           \
        if ((st = (x)) != DI_OK) goto done;                                                        \
    } while (0)
    if (official) {
        GTRY(add_bf16(&g, "embed.weight", 2, z.V, z.D, 0, 1.0f));
        GTRY(add_bf16(&g, "head.weight", 2, z.V, z.D, 0, 1.0f / sqrtf((float)z.D)));
    } else {
        GTRY(add_f32(&g, "embed.weight", 2, z.V, z.D, 0, 1.0f));
        GTRY(add_f32(&g, "head.weight", 2, z.V, z.D, 0, 1.0f / sqrtf((float)z.D)));
    }
    GTRY(v41_vec(&g, "", "norm.weight", z.D, 1, 0.1f));
    for (int il = 0; il < sp->n_layer; il++) {
        int64_t rows = 0;
        for (int l = 0; l < sp->n_engram; l++)
            if (sp->engram[l] == il) rows = engram_rows[l];
        snprintf(b, sizeof b, "layers.%d.", il);
        GTRY(gen_v41_block(&g, &z, b, sp->ratio[il], sp->kv[il], sp->idx[il], rows, sp->E));
    }
    if (dspark) {
        GTRY(gen_v41_block(&g, &z, "mtp.0.", 0, false, false, 0, sp->E));
        GTRY(v41_lin(&g, "mtp.0.", "main_proj.weight", z.D, 2 * z.D, true));
        GTRY(v41_vec(&g, "mtp.0.", "main_norm.weight", z.D, 1, 0.1f));
        GTRY(v41_vec(&g, "mtp.0.", "norm.weight", z.D, 1, 0.1f));
        GTRY(add_bf16(&g, "mtp.0.markov_head.embed.weight", 2, z.V, 32, 0, 1.0f));
        GTRY(add_bf16(&g, "mtp.0.markov_head.head.weight", 2, z.V, 32, 0, 0.2f));
        GTRY(add_bf16(&g, "mtp.0.confidence_head.proj.weight", 2, 1, z.D + 32, 0, 0.05f));
    }
    char path[4096];
    snprintf(path, sizeof path, "%s/model.safetensors", dir);
    GTRY(di_st_write_file(path, g.l.t, g.l.n));
    // The Engram compressed-token stub map cmap[id] = id div 2 (spec §7.4).
    {
        int32_t *map = di_malloc(sizeof(int32_t) * (size_t)z.V);
        if (!map) GTRY(DI_ERR_NOMEM);
        for (int64_t i = 0; i < z.V; i++) map[i] = (int32_t)(i / 2);
        di_st_write_tensor t = {
            .name = "token_map", .dtype = DI_DTYPE_I32, .n_dims = 1, .shape = {z.V}, .data = map};
        snprintf(path, sizeof path, "%s/engram", dir);
        mkdir(path, 0755); // may exist
        snprintf(path, sizeof path, "%s/engram/token_map.safetensors", dir);
        st = di_st_write_file(path, &t, 1);
        di_free(map);
        if (st != DI_OK) goto done;
    }
    int32_t kv_ids[8], idx_ids[8], n_kv = 0, n_idx = 0;
    for (int il = 0; il < sp->n_layer; il++) {
        if (sp->kv[il]) kv_ids[n_kv++] = il;
        if (sp->idx[il]) idx_ids[n_idx++] = il;
    }
    const int32_t erows[2] = {(int32_t)engram_rows[0], (int32_t)engram_rows[1]};
    di_buf_printf(
        &cfg,
        "{\n  \"model_type\": \"deepseek_v41\", \"architectures\": [\"DeepseekV41ForCausalLM\"],\n"
        "  \"_comment\": \"random weights written by deepinfer synth (seed %llu)\",\n"
        "  \"bos_token_id\": 0, \"eos_token_id\": 1, \"image_token_id\": %d,\n%s"
        "  \"text_config\": {\n"
        "    \"vocab_size\": %d, \"hidden_size\": %d, \"num_hidden_layers\": %d,\n"
        "    \"num_nextn_predict_layers\": %d, \"compress_ratios\": ",
        (unsigned long long)seed, (int)sp->image_token,
        official ? "  \"quantization_config\": {\"quant_method\": \"fp8\", \"activation_scheme\": "
                   "\"dynamic\", \"weight_block_size\": [32, 32], \"scale_fmt\": \"ue8m0\", "
                   "\"expert_dtype\": \"fp4\"},\n"
                 : "",
        (int)z.V, (int)z.D, (int)sp->n_layer, dspark ? 1 : 0);
    json_ints(&cfg, sp->ratio, sp->n_layer, dspark ? ", 0" : NULL);
    di_buf_printf(&cfg, ",\n    \"kv_source_layer_ids\": ");
    json_ints(&cfg, kv_ids, n_kv, NULL);
    di_buf_printf(&cfg, ", \"index_source_layer_ids\": ");
    json_ints(&cfg, idx_ids, n_idx, NULL);
    di_buf_printf(
        &cfg,
        ",\n    \"candidate_source_layer_id\": %d, \"candidate_topk_blocks\": %d,\n"
        "    \"candidate_block_size\": %d, \"index_n_heads\": %d, \"index_head_dim\": %d,\n"
        "    \"index_topk\": %d, \"num_attention_heads\": %d, \"num_key_value_heads\": 1,\n"
        "    \"head_dim\": %d, \"qk_rope_head_dim\": %d, \"q_lora_rank\": %d, \"o_groups\": %d,\n"
        "    \"o_lora_rank\": %d, \"sliding_window\": %d, \"n_routed_experts\": %d,\n"
        "    \"num_experts_per_tok\": %d, \"n_shared_experts\": 1, \"moe_intermediate_size\": %d,\n"
        "    \"scoring_func\": \"sqrtsoftplus\", \"norm_topk_prob\": true,\n"
        "    \"routed_scaling_factor\": 1.5, \"gate_temp\": 1.0, \"swiglu_limit\": 10.0,\n"
        "    \"rms_norm_eps\": 1e-20, \"hc_mult\": 4, \"hc_sinkhorn_iters\": 20, \"hc_eps\": "
        "1e-06,\n"
        "    \"rope_theta\": 10000.0, \"compress_rope_theta\": 160000.0,\n"
        "    \"rope_parameters\": {\"main\": {\"rope_type\": \"default\", \"rope_theta\": "
        "10000.0,\n"
        "      \"partial_rotary_factor\": %g}, \"compress\": {\"rope_type\": \"yarn\",\n"
        "      \"rope_theta\": 160000.0, \"partial_rotary_factor\": %g, \"factor\": %.1f,\n"
        "      \"original_max_position_embeddings\": %d, \"beta_fast\": 32.0, \"beta_slow\": 1.0,\n"
        "      \"attention_factor\": 1.0}},\n"
        "    \"max_position_embeddings\": %d,\n"
        "    \"engram_layer_ids\": ",
        (int)sp->cand_layer, (int)sp->cand_blocks, (int)sp->cand_block_size, (int)z.HI, (int)z.DI,
        (int)sp->index_topk, (int)z.H, (int)z.Dh, (int)sp->rope, (int)z.Rq, (int)z.G, (int)z.Ro,
        (int)sp->window, (int)sp->E, (int)sp->K, (int)z.F, (double)sp->rope / (double)z.Dh,
        (double)sp->rope / (double)z.Dh, (double)sp->yarn_factor, (int)sp->yarn_orig,
        (int)sp->max_pos);
    json_ints(&cfg, sp->engram, sp->n_engram, NULL);
    di_buf_printf(&cfg, ", \"engram_num_embeddings\": ");
    json_ints(&cfg, erows, sp->n_engram, NULL);
    di_buf_printf(
        &cfg,
        ",\n    \"engram_vocab_size\": %lld, \"engram_max_ngram_size\": 4, \"engram_n_heads\": "
        "%d,\n"
        "    \"engram_head_dim\": %d, \"engram_pad_id\": 2, \"engram_compressed_vocab_size\": "
        "%d,\n"
        "    \"dspark_block_size\": 2, \"dspark_noise_token_id\": %d,\n"
        "    \"dspark_target_layer_ids\": [%d, %d], \"dspark_markov_rank\": 32,\n"
        "    \"tie_word_embeddings\": false\n  }\n}\n",
        (long long)sp->engram_vocab, (int)sp->engram_heads, (int)z.hd, (int)sp->n_cvocab,
        (int)z.V - 1, (int)sp->dspark_target[0], (int)sp->dspark_target[1]);
    snprintf(path, sizeof path, "%s/config.json", dir);
    FILE *f = fopen(path, "w");
    bool ok = f && cfg.data && fwrite(cfg.data, 1, cfg.len, f) == cfg.len;
    if (f) ok = (fclose(f) == 0) && ok;
    if (!ok) {
        DI_LOG_ERROR("synth: cannot write %s", path);
        st = DI_ERR_IO;
    }
done:
    di_buf_deinit(&cfg);
    tlist_free(&g.l);
    di_pool_destroy(g.pool);
    return st;
#undef GTRY
}

di_status di_synth_v41_write(const char *dir, bool official, bool dspark, uint64_t seed) {
    return v41_write(dir, &k_v41_tiny, official, dspark, seed);
}

di_status di_synth_checkpoint(const char *preset, const char *dir, bool official, uint64_t seed) {
    if (strcmp(preset, "v41-tiny") == 0) return di_synth_v41_write(dir, official, official, seed);
    if (strcmp(preset, "v41-flash-4l") == 0) // no DSpark: the benchmark runs the backbone
        return v41_write(dir, &k_v41_flash_4l, official, false, seed);
    di_synth_config c;
    di_status st = di_synth_preset(preset, &c);
    if (st != DI_OK) return st;
    c.official = official;
    c.seed = seed;
    return di_synth_write(&c, dir);
}
