// gemm — instruction-set dispatch, static partitioning and row blocking of di_cpu_matmul (the
// kernels themselves are in gemm_avx2.c and gemm_avx512.c). See gemm.h for the numerics contract.
#include "backend/cpu/gemm.h"

#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "base/log.h"
#include "tensor/quant_ref.h" // di_quant_act_q8, di_quant_act_q8_k

#if defined(__x86_64__) && defined(__GNUC__)
#include <cpuid.h>

// F16C from CPUID leaf 1 (ECX bit 29): clang < 15 rejects "f16c" in __builtin_cpu_supports.
static bool cpu_has_f16c(void) {
    unsigned a, b, c, d;
    return __get_cpuid(1, &a, &b, &c, &d) && (c & bit_F16C);
}

// AVX-512 VNNI from CPUID leaf 7 (ECX bit 11); the OS's saving of the zmm and mask registers is
// what __builtin_cpu_supports("avx512f") checks (XCR0).
static bool cpu_has_avx512_vnni(void) {
    unsigned a, b, c, d;
    return __get_cpuid_count(7, 0, &a, &b, &c, &d) && (c & bit_AVX512VNNI);
}
#endif

// ---- instruction-set level ----

static const char *const k_isa_names[DI_CPU_ISA_COUNT] = {"scalar", "avx2", "avx512"};

const char *di_cpu_isa_name(di_cpu_isa isa) {
    return isa >= 0 && isa < DI_CPU_ISA_COUNT ? k_isa_names[isa] : "?";
}

di_cpu_isa di_cpu_isa_supported(void) {
#if defined(__x86_64__) && defined(__GNUC__)
    if (!di_gemm_avx2_built() || !__builtin_cpu_supports("avx2") ||
        !__builtin_cpu_supports("fma") || !cpu_has_f16c())
        return DI_CPU_ISA_SCALAR;
    if (di_gemm_avx512_built() && __builtin_cpu_supports("avx512f") &&
        __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
        __builtin_cpu_supports("avx512dq") && cpu_has_avx512_vnni())
        return DI_CPU_ISA_AVX512;
    return DI_CPU_ISA_AVX2;
#endif
    return DI_CPU_ISA_SCALAR;
}

di_cpu_isa di_cpu_isa_detect(void) {
    static atomic_int warned;
    di_cpu_isa best = di_cpu_isa_supported();
    const char *env = getenv("DI_CPU_ISA");
    if (!env || !*env) return best;
    for (int i = 0; i < DI_CPU_ISA_COUNT; i++) {
        if (strcmp(env, k_isa_names[i]) != 0) continue;
        if (i > (int)best) {
            if (!atomic_exchange(&warned, 1))
                DI_LOG_WARN("DI_CPU_ISA=%s: this CPU supports at most %s; using that", env,
                            di_cpu_isa_name(best));
            return best;
        }
        return (di_cpu_isa)i;
    }
    if (!atomic_exchange(&warned, 1))
        DI_LOG_WARN("DI_CPU_ISA=%s is not one of scalar, avx2, avx512; ignored", env);
    return best;
}

int di_gemm_scratch_rows(int64_t ld) {
    const int64_t rows = ((int64_t)(512 << 10) / (int64_t)sizeof(float) / ld) & ~(int64_t)3;
    return rows < 4 ? 4 : rows > DI_GEMM_BLOCK_ROWS ? DI_GEMM_BLOCK_ROWS : (int)rows;
}

bool di_cpu_set_isa(di_cpu *cpu, di_cpu_isa isa) {
    if (isa < 0 || isa > di_cpu_isa_supported()) return false;
    cpu->isa = isa;
    return true;
}

// ---- matmul ----

enum {
    ROWS = DI_GEMM_GEMV_ROWS, // rows decoded together when few tokens use them (the tile's height)
    SEG = 1024,   // columns per decoded segment when few tokens share it (4 rows x 4 KiB in L1)
    SEG_TOKS = 3, // at most this many tokens: decode in registers or stream segments
    PF_ROW_BYTES = 1024, // bytes of each upcoming row prefetched in the many-token path
    PF_AHEAD = 8,        // blocks of 4 rows ahead the many-token path prefetches (at least)
};

// Many tokens: each thread decodes blocks of gemm_rows rows (up to 32, 512 KiB) and walks every
// token tile (3 tokens AVX2, 12 AVX-512) over them in k-blocks of DI_GEMM_KBLK columns, so the
// tile's activations over one k-block (AVX-512: 18 KiB) stay in L1 (32 KiB or more) while every
// 4-row group passes over them (6 KiB each, from L2). Whole rows instead read every group's
// activations from L2 or, once the call's tokens outgrow L2, from L3. At 4096 columns (FP8, 1
// thread, AVX-512) 128 and 512 tokens ran at 1.25x and 2.2x k-blocked, 32 and 64 tokens at
// ~0.95x; k-blocks of 256, 384 and 512 alike.

// Thread ith's gemm scratch: gemm_rows decoded rows of gemm_ld floats.
static float *thread_scratch(const di_cpu *cpu, int ith) {
    return cpu->gemm_scratch + (size_t)ith * (size_t)cpu->gemm_rows * (size_t)cpu->gemm_ld;
}

// One matmul call (f32 path), or one chunk of DI_CPU_ACT_TOKENS tokens of an 8-bit one (x, y: the
// chunk's first token).
typedef struct matmul_ctx {
    di_cpu *cpu;
    const di_tensor *w;
    const float *x;
    int64_t n_tok, x_stride;
    float *y;
    int64_t y_stride;
    bool split_rows; // partition output rows (else tokens)
    di_cpu_isa isa;  // the level this call runs (f32 path: scalar when the layout needs it)
    bool fused;      // f32 path: a GEMV decoding in registers (few tokens, supported layout)
} matmul_ctx;

// This thread's output rows [r_lo, r_hi) and tokens [t_lo, t_hi): rows or tokens split, the
// other whole. Returns false when the thread has no work.
static bool task_range(const matmul_ctx *c, int ith, int nth, int64_t *r_lo, int64_t *r_hi,
                       int64_t *t_lo, int64_t *t_hi) {
    *r_lo = 0, *r_hi = c->w->ne[1], *t_lo = 0, *t_hi = c->n_tok;
    if (c->split_rows)
        di_split_range(c->w->ne[1], ith, nth, r_lo, r_hi);
    else
        di_split_range(c->n_tok, ith, nth, t_lo, t_hi);
    return *t_lo < *t_hi && *r_lo < *r_hi;
}

// Few output rows and many tokens (the mHC mixes, the router): split tokens so every thread has
// work; each thread then decodes all the (few) rows. Either split gives the same numbers.
static bool split_rows(const di_cpu *cpu, const di_tensor *w, int64_t n_tok) {
    return w->ne[1] >= 8 * (int64_t)cpu->n_threads || n_tok < cpu->n_threads;
}

// The fixed lane reduction of di_ref_dot.
static inline float reduce8(const float a[8]) {
    return ((a[0] + a[4]) + (a[1] + a[5])) + ((a[2] + a[6]) + (a[3] + a[7]));
}

// Rows [o0, o0+nr) for tokens [t_lo, t_hi): decode once, multiply every token.
static void block_simd(const matmul_ctx *c, float *scr, int64_t ld, int64_t o0, bool first, int nr,
                       int64_t t_lo, int64_t t_hi) {
    const di_tensor *w = c->w;
    const int64_t n = w->ne[0];
    float acc[4][3][8];
    const float *xs[3];
    if (t_hi - t_lo <= SEG_TOKS) {
        int nt = (int)(t_hi - t_lo);
        for (int j = 0; j < nt; j++) xs[j] = c->x + (t_lo + j) * c->x_stride;
        memset(acc, 0, sizeof acc);
        if (c->fused && c->isa >= DI_CPU_ISA_AVX512 && di_gemm_avx512_gemv_ok(w))
            di_gemm_avx512_gemv(w, o0, nr, xs, nt, acc);
        else if (c->fused)
            di_gemm_avx2_gemv(w, o0, nr, xs, nt, acc);
        else
            for (int64_t c0 = 0; c0 < n; c0 += SEG) {
                int64_t c1 = c0 + SEG < n ? c0 + SEG : n;
                di_gemm_avx2_decode(w, o0, nr, c0, c1, scr, ld);
                di_gemm_avx2_tile(scr, ld, nr, xs, nt, c0, c1, n, acc);
            }
        for (int i = 0; i < nr; i++)
            for (int j = 0; j < nt; j++)
                c->y[(t_lo + j) * c->y_stride + o0 + i] = reduce8(acc[i][j]);
        return;
    }
    // The rows up to PF_AHEAD blocks of 4 (or one block of nr) ahead, while this block computes
    // (the first block of a thread asks for all of them, later ones for the last nr): with many
    // tokens the rows are decoded whole, one block at a time, and their loads would otherwise wait
    // on memory each time (short rows, e.g. a 129280 x 128 head, read at 2-3x the time without
    // it).
    const int64_t pf_hi = o0 + (PF_AHEAD * ROWS > 2 * nr ? PF_AHEAD * ROWS : 2 * nr);
    for (int64_t r = first ? o0 + nr : pf_hi - nr; r < pf_hi && r < w->ne[1]; r++) {
        const char *row = (const char *)w->data + (size_t)r * w->nb1;
        for (int64_t b = 0; b < (int64_t)w->nb1 && b < PF_ROW_BYTES; b += 64)
            __builtin_prefetch(row + b);
    }
    if (c->isa >= DI_CPU_ISA_AVX512)
        di_gemm_avx512_decode(w, o0, nr, 0, n, scr, ld);
    else
        di_gemm_avx2_decode(w, o0, nr, 0, n, scr, ld);
    // Tokens in balanced tiles of at most 3 (AVX2; 16 = 3+3+3+3+2+2, not ...+3+1) or 12
    // (AVX-512), k-blocked over all nr rows: a one-token tile costs almost what a full one does.
    // Every output is the same whatever its tile.
    const bool avx512 = c->isa >= DI_CPU_ISA_AVX512;
    const int64_t tile = avx512 ? DI_GEMM_AVX512_TILE_TOKS : SEG_TOKS, n_groups = (nr + 3) / 4;
    const int64_t n_tiles = (t_hi - t_lo + tile - 1) / tile;
    _Alignas(64) unsigned char st[DI_GEMM_BLOCK_ROWS / 4][DI_GEMM_TILE_STATE];
    for (int64_t t = t_lo, k = 0; t < t_hi; k++) {
        const int nt = (int)((t_hi - t + (n_tiles - k) - 1) / (n_tiles - k));
        const float *x = c->x + t * c->x_stride;
        for (int64_t c0 = 0; c0 < n; c0 += DI_GEMM_KBLK) {
            const int64_t c1 = n - c0 > DI_GEMM_KBLK ? c0 + DI_GEMM_KBLK : n;
            for (int64_t g = 0; g < n_groups; g++) {
                const int ng = (int)(nr - 4 * g < 4 ? nr - 4 * g : 4);
                const float *wg = scr + 4 * g * ld;
                float *yg = c->y + t * c->y_stride + o0 + 4 * g;
                if (avx512)
                    di_gemm_avx512_tile_k(wg, ld, ng, x, c->x_stride, nt, c0, c1, n, st[g], yg,
                                          c->y_stride);
                else
                    di_gemm_avx2_tile_k(wg, ld, ng, x, c->x_stride, nt, c0, c1, n, st[g], yg,
                                        c->y_stride);
            }
        }
        t += nt;
    }
}

static void block_scalar(const matmul_ctx *c, float *scr, int64_t o, int64_t t_lo, int64_t t_hi) {
    di_tensor_row_f32(c->w, o, scr);
    for (int64_t t = t_lo; t < t_hi; t++)
        c->y[t * c->y_stride + o] = di_ref_dot(scr, c->x + t * c->x_stride, c->w->ne[0]);
}

static void matmul_task(void *p, int ith, int nth) {
    const matmul_ctx *c = p;
    const int64_t ld = c->cpu->gemm_ld;
    float *scr = thread_scratch(c->cpu, ith);
    int64_t r_lo, r_hi, t_lo, t_hi;
    if (!task_range(c, ith, nth, &r_lo, &r_hi, &t_lo, &t_hi)) return;
    if (c->isa == DI_CPU_ISA_SCALAR) {
        for (int64_t o = r_lo; o < r_hi; o++) block_scalar(c, scr, o, t_lo, t_hi);
        return;
    }
    const int rows = t_hi - t_lo > SEG_TOKS ? c->cpu->gemm_rows : ROWS;
    for (int64_t o = r_lo; o < r_hi; o += rows) {
        int nr = (int)(r_hi - o < rows ? r_hi - o : rows);
        block_simd(c, scr, ld, o, o == r_lo, nr, t_lo, t_hi);
    }
}

// ---- 8-bit activations (Q8_0, MXFP4: blocks of 32; Q4_K: blocks of 256) ----

// Tokens [t_lo, t_hi) of the chunk into cpu->act_q / act_d (and act_s for Q4_K).
static void quant_rows(const matmul_ctx *c, int64_t t_lo, int64_t t_hi) {
    const di_cpu *cpu = c->cpu;
    const int64_t n = c->w->ne[0], ldd = cpu->act_ld / 32, lds = cpu->act_ld / 16;
    const bool k = di_ref_matmul_act(c->w) == DI_REF_ACT_Q8_K, simd = c->isa >= DI_CPU_ISA_AVX2;
    for (int64_t t = t_lo; t < t_hi; t++) {
        const float *x = c->x + t * c->x_stride;
        int8_t *q = cpu->act_q + t * cpu->act_ld;
        float *d = cpu->act_d + t * ldd;
        int16_t *s = cpu->act_s + t * lds;
        if (k && simd)
            di_gemm_avx2_quant_act_q8_k(x, n, q, d, s);
        else if (k)
            di_quant_act_q8_k(x, n, q, d, s);
        else if (simd)
            di_gemm_avx2_quant_act(x, n, q, d);
        else
            di_quant_act_q8(x, n, q, d);
    }
}

static void quant_task(void *p, int ith, int nth) {
    const matmul_ctx *c = p;
    int64_t t_lo, t_hi;
    di_split_range(c->n_tok, ith, nth, &t_lo, &t_hi);
    quant_rows(c, t_lo, t_hi);
}

// Output rows [r_lo, r_hi) x tokens [t_lo, t_hi) of the chunk. AVX2 / AVX-512: blocks of 4 rows,
// tokens in balanced tiles of at most 3 (AVX2, and Q4_K at either level) or 8 (AVX-512 VNNI);
// scalar: the reference's di_ref_dot_q8 against the row's codes, or di_ref_dot_q4_k.
static void int8_task(void *p, int ith, int nth) {
    const matmul_ctx *c = p;
    const di_cpu *cpu = c->cpu;
    const int64_t n = c->w->ne[0], ldq = cpu->act_ld, ldd = ldq / 32, lds = ldq / 16;
    const bool k8 = di_ref_matmul_act(c->w) == DI_REF_ACT_Q8_K;
    int64_t r_lo, r_hi, t_lo, t_hi;
    if (!task_range(c, ith, nth, &r_lo, &r_hi, &t_lo, &t_hi)) return;
    if (c->isa == DI_CPU_ISA_SCALAR && k8) {
        for (int64_t o = r_lo; o < r_hi; o++) {
            const uint8_t *row = (const uint8_t *)c->w->data + (size_t)o * c->w->nb1;
            for (int64_t t = t_lo; t < t_hi; t++)
                c->y[t * c->y_stride + o] = di_ref_dot_q4_k(
                    row, cpu->act_q + t * ldq, cpu->act_d + t * ldd, cpu->act_s + t * lds, n);
        }
        return;
    }
    if (c->isa == DI_CPU_ISA_SCALAR) {
        int8_t *qw = (int8_t *)thread_scratch(cpu, ith);
        float *dw = (float *)(qw + n);
        for (int64_t o = r_lo; o < r_hi; o++) {
            di_ref_row_codes(c->w, o, qw, dw);
            for (int64_t t = t_lo; t < t_hi; t++)
                c->y[t * c->y_stride + o] =
                    di_ref_dot_q8(qw, dw, cpu->act_q + t * ldq, cpu->act_d + t * ldd, n);
        }
        return;
    }
    const bool vnni = c->isa >= DI_CPU_ISA_AVX512 && !k8;
    const int tile = vnni ? DI_GEMM_AVX512_INT8_TOKS : SEG_TOKS;
    const int64_t nt_all = t_hi - t_lo, n_tiles = (nt_all + tile - 1) / tile;
    // More than one token tile: each group of rows is decoded once to aligned int8 codes and
    // float scales (per-thread scratch: 4.5 act_ld bytes of the 16 gemm_ld) and every tile reads
    // those; one tile reads the blocks in place.
    const bool staged = nt_all > tile && !k8; // Q4_K: its scales unpack per block anyway
    const int64_t ldw = cpu->act_ld, ldwd = ldw / 32;
    int8_t *wq = (int8_t *)thread_scratch(cpu, ith);
    float *wd = (float *)(wq + ROWS * ldw);
    for (int64_t o = r_lo; o < r_hi; o += ROWS) {
        const int nr = (int)(r_hi - o < ROWS ? r_hi - o : ROWS);
        if (staged) di_gemm_avx2_codes(c->w, o, nr, wq, ldw, wd, ldwd);
        for (int64_t t = t_lo, k = 0; t < t_hi; k++) {
            const int nt = (int)((t_hi - t + (n_tiles - k) - 1) / (n_tiles - k));
            const int8_t *xq[DI_GEMM_AVX512_INT8_TOKS];
            const float *xd[DI_GEMM_AVX512_INT8_TOKS];
            const int16_t *xs[DI_GEMM_AVX512_INT8_TOKS];
            for (int j = 0; j < nt; j++) {
                xq[j] = cpu->act_q + (t + j) * ldq;
                xd[j] = cpu->act_d + (t + j) * ldd;
                xs[j] = cpu->act_s + (t + j) * lds;
            }
            float *y = c->y + t * c->y_stride + o;
            if (k8)
                di_gemm_avx2_gemv_q4_k8(c->w, o, nr, xq, xd, xs, nt, y, c->y_stride);
            else if (vnni && staged)
                di_gemm_avx512_gemv_codes(wq, ldw, wd, ldwd, n, nr, xq, xd, nt, y, c->y_stride);
            else if (vnni)
                di_gemm_avx512_gemv_int8(c->w, o, nr, xq, xd, nt, y, c->y_stride);
            else if (staged)
                di_gemm_avx2_gemv_codes(wq, ldw, wd, ldwd, n, nr, xq, xd, nt, y, c->y_stride);
            else
                di_gemm_avx2_gemv_int8(c->w, o, nr, xq, xd, nt, y, c->y_stride);
            t += nt;
        }
    }
}

// Chunks of DI_CPU_ACT_TOKENS tokens: quantise them (on this thread for one token, else split over
// the pool), then multiply. A token's outputs depend only on its own activation row and the
// weights, so neither the chunking nor the partition changes a bit.
static void matmul_int8(di_cpu *cpu, const di_tensor *w, const float *x, int64_t n_tok,
                        int64_t x_stride, float *y, int64_t y_stride) {
    for (int64_t t0 = 0; t0 < n_tok; t0 += DI_CPU_ACT_TOKENS) {
        const int64_t nt = n_tok - t0 < DI_CPU_ACT_TOKENS ? n_tok - t0 : DI_CPU_ACT_TOKENS;
        matmul_ctx c = {.cpu = cpu,
                        .w = w,
                        .x = x + t0 * x_stride,
                        .n_tok = nt,
                        .x_stride = x_stride,
                        .y = y + t0 * y_stride,
                        .y_stride = y_stride,
                        .split_rows = split_rows(cpu, w, nt),
                        .isa = cpu->isa};
        if (nt == 1)
            quant_rows(&c, 0, 1);
        else
            di_pool_run(cpu->pool, quant_task, &c);
        di_pool_run(cpu->pool, int8_task, &c);
    }
}

// ---- dispatch ----

// The AVX2 decoders step through scale blocks in whole 8-column chunks.
static bool avx2_layout_ok(const di_tensor *w) {
    if (w->kind == DI_TENSOR_KIND_FP8 || w->kind == DI_TENSOR_KIND_FP4)
        return w->block_in > 0 && w->block_in % 8 == 0;
    return true;
}

void di_cpu_matmul(di_cpu *cpu, const di_tensor *w, const float *x, int64_t n_tok, int64_t x_stride,
                   float *y, int64_t y_stride) {
    DI_ASSERT(w->ne[0] <= cpu->row_cap);
    if (n_tok <= 0 || w->ne[1] <= 0) return;
    cpu->n_weight_bytes += di_tensor_bytes(w);
    cpu->n_weight_macs += (uint64_t)w->ne[0] * (uint64_t)w->ne[1] * (uint64_t)n_tok;
    if (di_ref_matmul_act(w) != DI_REF_ACT_F32) {
        matmul_int8(cpu, w, x, n_tok, x_stride, y, y_stride);
        return;
    }
    matmul_ctx c = {cpu,
                    w,
                    x,
                    n_tok,
                    x_stride,
                    y,
                    y_stride,
                    split_rows(cpu, w, n_tok),
                    avx2_layout_ok(w) ? cpu->isa : DI_CPU_ISA_SCALAR,
                    false};
    c.fused = c.isa >= DI_CPU_ISA_AVX2 && di_gemm_avx2_gemv_ok(w);
    di_pool_run(cpu->pool, matmul_task, &c);
}
