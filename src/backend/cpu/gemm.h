/*
 * gemm — the optimised CPU matmul over every di_tensor kind (F32, F16, BF16, FP8 e4m3 + UE8M0
 * block scales, FP4 e2m1 + UE8M0 per-32 scales, and the ggml block formats of GGUF files: Q2_K and
 * IQ2_XXS decoded in registers with the reference's arithmetic, Q8_0, MXFP4 and Q4_K multiplied by
 * 8-bit activations with integer dot products): the engine's one release path for linear layers.
 * cpu/ref_ops.c's di_ref_matmul stays the oracle it is tested against (tests/backend/test_ops.c).
 *
 * Instruction-set levels, chosen once per di_cpu at init by CPU features (di_cpu_isa_detect):
 *   - AVX-512 (F, BW, VL, DQ and VNNI, with the AVX2 level's features): the AVX2 level's
 *     arithmetic to the bit, two outputs' 8-lane chains per 512-bit register (gemm_avx512.c):
 *     the many-token FMA tile (4 rows x up to 12 tokens) and its row decoding of FP8, FP4 and
 *     BF16 (16 values a step), the fused GEMVs of FP8, FP4 and BF16 (FP8: the half-float bits of
 *     32 codes per shift and fix-up; FP4: word permutes, vpermw, copy each column's nibble into
 *     its lane and look up its value as bfloat16, exact for e2m1, with no half-float
 *     conversion), and vpdpbusd for the integer dots of Q8_0 and MXFP4 (up to 8 tokens a tile);
 *     the other kinds, the quantisers and the attention kernels run the AVX2 code;
 *   - AVX2 + FMA + F16C: weights decoded eight at a time in registers (e4m3 through the F16C
 *     half-float converter, e2m1 through a pshufb table), multiplied by the block scale (exact:
 *     a power of two) and accumulated with FMA;
 *   - scalar: the portable fallback; the reference arithmetic (row dequantisation + di_ref_dot)
 *     with the same blocking and threading, so it equals di_ref_matmul bit for bit.
 * The environment switch DI_CPU_ISA=scalar|avx2|avx512 lowers the level (a debug switch for CI
 * and benchmarks to cover the lower levels; it can never raise it above what the CPU supports).
 *
 * Two numerics contracts, by weight kind:
 *   - exact weights, f32 activations (F32, F16, BF16, FP8, FP4, Q2_K, IQ2_XXS): every weight
 *     dequantised exactly (di_tensor_row_f32) and multiplied by the f32 activations, as below;
 *   - 8-bit activations (Q8_0, MXFP4: DI_REF_ACT_Q8_0), the arithmetic llama.cpp's CPU backend
 *     uses for these files: each token's activation row is quantised once per call in blocks of
 *     32 (di_quant_act_q8: d = f16(amax / 127), q = round-half-away(x * 127 / amax), |q| <= 127),
 *     the weight row is taken as its integer codes and per-32 scales (Q8_0: the stored int8 and
 *     f16 d; MXFP4: the e2m1 codes doubled, {0, +-1, +-2, +-3, +-4, +-6, +-8, +-12}, with d =
 *     2^(e-128), the UE8M0 scale times 0.5), and y = sum over blocks b of (d_w,b * d_x,b) * (the
 *     exact integer dot of the block's codes) in the fixed f32 order of di_ref_dot_q8: eight lanes,
 *     lane l of block b holding columns 4l..4l+3, one FMA per lane and block in block order, then
 *     di_ref_dot's lane reduction. Both levels compute exactly that, so they agree bit for bit with
 *     di_ref_matmul; against f32 activations the result moves by up to ~0.56 d_x per activation
 *     (about 1e-3 of sum |w x| on random data; tests/backend/test_ops.c);
 *   - 8-bit activations in blocks of 256 (Q4_K: DI_REF_ACT_Q8_K), ggml's Q8_K: per block of 256
 *     d = mx / -127 in f32 (mx the first value of largest magnitude), q = round-half-even(x / d)
 *     clamped at 127, and per-16 sums of q; the weight's nibbles, 6-bit sub-block scales and
 *     mins are multiplied as integers and only two products per block are f32 (the exact
 *     contract in di_ref_dot_q4_k). Q2_K and IQ2_XXS (also Q8_K in ggml) are not on it yet.
 *
 * Numerics (why results do not depend on batching or threads): output element (t, o) is computed
 * by exactly one thread as one 8-lane accumulator running over the columns in order (FMA at the
 * AVX2 level), reduced in the fixed order of di_ref_dot. Neither the token tile, the row block,
 * the column segment nor the thread partition changes that sequence, so a token's outputs are the
 * same whatever other tokens share the call and whatever the thread count (the serving engine's
 * batch invariance). Each weight row is decoded once per call: groups of four rows are decoded to
 * per-thread scratch (in 1024-column segments when at most 3 tokens use them; else whole rows, in
 * blocks of up to 32) and every token of the call is multiplied against them in tiles of 4 rows x
 * 3 tokens (AVX2) or 12 tokens (AVX-512), k-blocked so a tile's activations stay in L1.
 * The 8-bit kinds keep the same invariance: a token's codes depend only on its own row, its
 * outputs only on its codes and the weights; the token chunks (DI_CPU_ACT_TOKENS), tiles and
 * thread partition never enter the arithmetic. The AVX-512 level computes every output with the
 * AVX2 level's operations in the AVX2 level's order, so the two levels agree bit for bit
 * (test_ops).
 *
 * Owns: nothing; scratch lives in di_cpu (ref_ops.h). Thread-safety: as di_cpu (engine thread).
 */
#pragma once

#include <stdbool.h>
#include <stdint.h>

#include "backend/cpu/ref_ops.h" // di_cpu
#include "tensor/tensor.h"       // di_tensor

typedef enum di_cpu_isa {
    DI_CPU_ISA_SCALAR = 0,
    DI_CPU_ISA_AVX2 = 1,   // AVX2 + FMA + F16C
    DI_CPU_ISA_AVX512 = 2, // AVX-512 F/BW/VL/DQ/VNNI + the AVX2 level's features
    DI_CPU_ISA_COUNT
} di_cpu_isa;

// The best level this CPU and build support (no environment applied). Any thread.
di_cpu_isa di_cpu_isa_supported(void);
// Rows of `ld` floats each thread's gemm scratch holds (di_cpu.gemm_rows): the many-token block,
// up to DI_GEMM_BLOCK_ROWS rows in 512 KiB (a multiple of 4, at least 4).
int di_gemm_scratch_rows(int64_t ld);
// di_cpu_isa_supported() lowered by DI_CPU_ISA when set (an unknown name or a level above the
// supported one is logged once at WARN and ignored / clamped). Any thread.
di_cpu_isa di_cpu_isa_detect(void);
// "scalar", "avx2", "avx512".
const char *di_cpu_isa_name(di_cpu_isa isa);
// Sets the level a di_cpu uses (tests sweep the levels). Returns false, changing nothing, when the
// CPU cannot run it.
bool di_cpu_set_isa(di_cpu *cpu, di_cpu_isa isa);

// y[t*y_stride + o] = sum_i W[o, i] * x[t*x_stride + i] for t < n_tok, o < W.ne[1] (as
// di_ref_matmul; FP32 accumulation, dequantisation fused; Q8_0, MXFP4, Q4_K on 8-bit activations).
// Needs W.ne[0] <= the max_row given to di_cpu_init (DI_ASSERT). x and y must not overlap.
void di_cpu_matmul(di_cpu *cpu, const di_tensor *w, const float *x, int64_t n_tok, int64_t x_stride,
                   float *y, int64_t y_stride);

// ---- internal: the AVX2 level (gemm_avx2.c, compiled with -mavx2 -mfma -mf16c) ----

// True when gemm_avx2.c was built with its kernels (x86-64 only).
bool di_gemm_avx2_built(void);
// Decodes columns [c0, c1) of rows r0..r0+nr-1 of w (any kind but Q8_0, MXFP4, Q4_K) into dst (row
// i at dst + i*dst_stride, c1-c0 values, then zeros up to the next multiple of 8 when c1 == ne[0]).
// Exact (every decoded value equals di_tensor_row_f32's).
void di_gemm_avx2_decode(const di_tensor *w, int64_t r0, int nr, int64_t c0, int64_t c1, float *dst,
                         int64_t dst_stride);
// True when di_gemm_avx2_gemv handles w: FP8 (block_in and n_in multiples of 16), FP4 (of 32),
// BF16 (n_in a multiple of 8), Q2_K, IQ2_XXS.
bool di_gemm_avx2_gemv_ok(const di_tensor *w);
// acc[i][j] (8 lanes each) += rows r0..r0+nr-1 of w (nr <= 4) times tokens xs[j] (nt <= 3) over
// all columns, decoding in registers; the same bits as di_gemm_avx2_decode + di_gemm_avx2_tile.
void di_gemm_avx2_gemv(const di_tensor *w, int64_t r0, int nr, const float *const *xs, int nt,
                       float acc[4][3][8]);
// acc[i][j] (8 lanes each) += W rows (dst-layout, nr <= 4) times tokens xs[j] (nt <= 3) over
// columns [c0, c1) of a row of n columns; the last partial 8-chunk reads x with a mask.
void di_gemm_avx2_tile(const float *w, int64_t w_stride, int nr, const float *const *xs, int nt,
                       int64_t c0, int64_t c1, int64_t n, float acc[4][3][8]);
#define DI_GEMM_BLOCK_ROWS 32   // at most this many decoded rows per many-token call (both levels)
#define DI_GEMM_KBLK 384        // columns per k-block of the many-token tiles (gemm.c: why)
#define DI_GEMM_TILE_STATE 1536 // bytes of one tile's accumulators between k-blocks (either level)
#define DI_GEMM_GEMV_ROWS 4     // rows per few-token GEMV call (a group; gemm.c's ROWS)

// Where every GEMV prefetches (both levels): each row at the same columns of the next group of
// DI_GEMM_GEMV_ROWS rows (this thread's next call), returned as the byte distance. A group's rows
// are interleaved short streams, which the hardware prefetchers alone follow poorly, and
// prefetching a fixed 512 bytes ahead within them left every group starting on cold lines (a
// 4096-column MXFP4 or FP4 row is 2 KiB): MXFP4 from memory ran at half Q8_0's bytes/s,
// flash-4l's native decode at 1 thread (AVX-512) 0.226-0.291 s/token against 0.200-0.208 a
// group ahead, a Q2_K GEMV from memory at 1.42-1.65 GB/s against 1.58-1.81.
static inline size_t di_gemm_pf_next_group(const di_tensor *w) {
    return DI_GEMM_GEMV_ROWS * w->nb1;
}
// One k-block [c0, c1) of nr <= 4 decoded rows (row i at w + i*w_stride, column 0 at w; zero-padded
// to a multiple of 8 past n) times nt <= 3 tokens (token j at x + j*x_stride), continuing the
// accumulators in st (DI_GEMM_TILE_STATE bytes, 64-byte aligned; from zero when c0 == 0). When
// c1 == n the sums go to y[j * y_stride + i]; the bits of di_gemm_avx2_tile over [0, n) from
// zeroed accumulators followed by reduce8, whatever the k-blocks.
void di_gemm_avx2_tile_k(const float *w, int64_t w_stride, int nr, const float *x, int64_t x_stride,
                         int nt, int64_t c0, int64_t c1, int64_t n, void *st, float *y,
                         int64_t y_stride);
// One token's activations (n a multiple of 32) as di_quant_act_q8 computes them, bit for bit.
void di_gemm_avx2_quant_act(const float *x, int64_t n, int8_t *q, float *d);
// y[j * y_stride + i] = row r0+i (i < nr <= 4) of w (Q8_0 or MXFP4) times token j (j < nt <= 3,
// codes xq[j], scales xd[j] from di_gemm_avx2_quant_act), over whole rows: the bits of
// di_ref_dot_q8 on the row's codes (di_ref_row_codes).
void di_gemm_avx2_gemv_int8(const di_tensor *w, int64_t r0, int nr, const int8_t *const *xq,
                            const float *const *xd, int nt, float *y, int64_t y_stride);
// Rows r0..r0+nr-1 (nr <= 4) of a Q8_0 or MXFP4 w as their codes (row i at q + i*ldq, 32-byte
// aligned, ldq a multiple of 32) and per-32 scales (d + i*ldd): di_ref_row_codes's values.
void di_gemm_avx2_codes(const di_tensor *w, int64_t r0, int nr, int8_t *q, int64_t ldq, float *d,
                        int64_t ldd);
// di_gemm_avx2_gemv_int8 over rows already decoded by di_gemm_avx2_codes (n columns): the same
// bits.
void di_gemm_avx2_gemv_codes(const int8_t *q, int64_t ldq, const float *d, int64_t ldd, int64_t n,
                             int nr, const int8_t *const *xq, const float *const *xd, int nt,
                             float *y, int64_t y_stride);
// One token's activations (n a multiple of 256) as di_quant_act_q8_k computes them, bit for bit.
void di_gemm_avx2_quant_act_q8_k(const float *x, int64_t n, int8_t *q, float *d, int16_t *bsums);
// y[j * y_stride + i] = row r0+i (i < nr <= 4) of a Q4_K w times token j (j < nt <= 3; codes xq[j]
// 32-byte aligned, scales xd[j], sums xs[j] from di_gemm_avx2_quant_act_q8_k): the bits of
// di_ref_dot_q4_k.
void di_gemm_avx2_gemv_q4_k8(const di_tensor *w, int64_t r0, int nr, const int8_t *const *xq,
                             const float *const *xd, const int16_t *const *xs, int nt, float *y,
                             int64_t y_stride);
// Twelve independent 8-lane FMA chains, `iters` steps each (probe.c's multiply-add peak).
float di_gemm_avx2_fma_loop(int64_t iters);
// di_mxfp4_scale's bits for every UE8M0 byte (both levels' MXFP4 kernels).
extern const uint32_t di_gemm_mxfp4_scale_bits[256];

// ---- internal: the AVX-512 level (gemm_avx512.c, compiled with -mavx512{f,bw,vl,dq,vnni}) ----
// Each entry gives the bits of its AVX2 twin above, for more rows or tokens per call.

#define DI_GEMM_AVX512_INT8_TOKS 8  // tokens per integer tile
#define DI_GEMM_AVX512_TILE_TOKS 12 // tokens per FMA tile

// True when gemm_avx512.c was built with its kernels (x86-64 only).
bool di_gemm_avx512_built(void);
// di_gemm_avx2_tile_k with nt <= DI_GEMM_AVX512_TILE_TOKS.
void di_gemm_avx512_tile_k(const float *w, int64_t w_stride, int nr, const float *x,
                           int64_t x_stride, int nt, int64_t c0, int64_t c1, int64_t n, void *st,
                           float *y, int64_t y_stride);
// di_gemm_avx2_decode (FP8, FP4 and BF16 16 values at a time; the other kinds through it).
void di_gemm_avx512_decode(const di_tensor *w, int64_t r0, int nr, int64_t c0, int64_t c1,
                           float *dst, int64_t dst_stride);
// True when di_gemm_avx512_gemv handles w: FP8 (block_in and n_in multiples of 16), FP4 (of 32),
// BF16 (n_in a multiple of 8); the other kinds take di_gemm_avx2_gemv at this level.
bool di_gemm_avx512_gemv_ok(const di_tensor *w);
// di_gemm_avx2_gemv (nr <= 4, nt <= 3).
void di_gemm_avx512_gemv(const di_tensor *w, int64_t r0, int nr, const float *const *xs, int nt,
                         float acc[4][3][8]);
// di_gemm_avx2_gemv_int8 with nt <= DI_GEMM_AVX512_INT8_TOKS (xq[j] 32-byte aligned).
void di_gemm_avx512_gemv_int8(const di_tensor *w, int64_t r0, int nr, const int8_t *const *xq,
                              const float *const *xd, int nt, float *y, int64_t y_stride);
// di_gemm_avx2_gemv_codes with nt <= DI_GEMM_AVX512_INT8_TOKS.
void di_gemm_avx512_gemv_codes(const int8_t *q, int64_t ldq, const float *d, int64_t ldd, int64_t n,
                               int nr, const int8_t *const *xq, const float *const *xd, int nt,
                               float *y, int64_t y_stride);
// Twelve independent 16-lane FMA chains, `iters` steps each (probe.c's multiply-add peak).
float di_gemm_avx512_fma_loop(int64_t iters);
