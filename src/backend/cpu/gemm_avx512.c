// gemm_avx512 — the AVX-512 kernels of gemm.h (AVX-512 F, BW, VL, DQ and VNNI, besides the AVX2
// level's AVX2, FMA and F16C): the many-token FMA tile over decoded rows, the fused GEMVs of FP8,
// FP4 and BF16, and the VNNI integer GEMVs of Q8_0 and MXFP4. Compiled with those -m flags on
// x86-64 (CMakeLists.txt); called only after gemm.c checked that the CPU supports them. Elsewhere
// the file builds to stubs that report "not built".
//
// Every output keeps the AVX2 level's arithmetic to the bit (gemm.h: one 8-lane chain per output,
// column c in lane c % 8, in column order, then reduce8), so a 512-bit register holds the 8-lane
// chains of two outputs side by side: lanes 0..7 one weight row, lanes 8..15 the next row, both
// against the same token, whose 8 activations are broadcast to both halves. A group of nr <= 4
// rows is two such pairs; when nr is odd the last row also stands in for the missing one, whose
// sums are computed and dropped. tests/backend/test_ops.c checks every shape against the AVX2
// level bit for bit.
#include "backend/cpu/gemm.h"

#include <string.h>

#include "base/log.h"
#include "tensor/quant_ref.h"

#if defined(__x86_64__) && defined(__AVX512F__) && defined(__AVX512BW__) &&                        \
    defined(__AVX512VL__) && defined(__AVX512DQ__) && defined(__AVX512VNNI__) &&                   \
    defined(__FMA__) && defined(__F16C__)

#include <immintrin.h>

#include "backend/cpu/gemm_asan.h"
#include "backend/cpu/simd.h"

bool di_gemm_avx512_built(void) {
    return true;
}

// Floats up to the next multiple of 8 (the decoded rows' zero padding).
__attribute__((unused)) static inline int64_t up8(int64_t n) { // in READS only
    return (n + 7) & ~(int64_t)7;
}

// Row 2p + h of a group of nr rows, the last row standing in for missing ones.
static inline int pair_row(int p, int h, int nr) {
    return 2 * p + h < nr ? 2 * p + h : nr - 1;
}

// Two 8-float halves into one register: lo in lanes 0..7, hi in 8..15.
static inline __m512 join8(__m256 lo, __m256 hi) {
    return _mm512_insertf32x8(_mm512_castps256_ps512(lo), hi, 1);
}

// One float per half.
static inline __m512 pair_scale(float lo, float hi) {
    return _mm512_mask_mov_ps(_mm512_set1_ps(lo), 0xFF00, _mm512_set1_ps(hi));
}

// 8 activations at x, in both halves.
static inline __m512 bcast8(const float *x) {
    return _mm512_broadcast_f32x8(_mm256_loadu_ps(x));
}

// The reduce8 sums of row pairs p01 (rows 0, 1) and p23 (rows 2, 3) of one token to y[0..nr):
// per row (a_k + a_k+4) for k < 4, then two levels of horizontal adds give
// ((a0+a4)+(a1+a5)) + ((a2+a6)+(a3+a7)), the order of the AVX2 level's sums.
static inline void sums_store(__m512 p01, __m512 p23, int nr, float *y) {
    const __m256 r[4] = {_mm512_castps512_ps256(p01), _mm512_extractf32x8_ps(p01, 1),
                         _mm512_castps512_ps256(p23), _mm512_extractf32x8_ps(p23, 1)};
    __m128 s[4];
    for (int i = 0; i < 4; i++)
        s[i] = _mm_add_ps(_mm256_castps256_ps128(r[i]), _mm256_extractf128_ps(r[i], 1));
    const __m128 h = _mm_hadd_ps(_mm_hadd_ps(s[0], s[1]), _mm_hadd_ps(s[2], s[3]));
    _mm_mask_storeu_ps(y, (__mmask8)((1u << nr) - 1), h);
}

// ---- the many-token FMA tile over decoded rows ----

enum { TILE_TOKS = DI_GEMM_AVX512_TILE_TOKS }; // 2 pairs x 12 = 24 accumulators + 2 w + 1 x
_Static_assert(sizeof(__m512[2][TILE_TOKS]) <= DI_GEMM_TILE_STATE, "tile state");

// NP row pairs x NT tokens over columns [c0, c1) of decoded rows (w: column 0), continuing the
// accumulators st[p][j] (from zero when c0 == 0); when c1 == n the reduce8 sums go to
// y[j * ys + i], else the accumulators back to st. Keeping them in memory between k-blocks changes
// no bit: each output's 8 lane chains still run over the columns in order.
static inline __attribute__((always_inline)) void
tile_k(const float *w, int64_t ws, int nr, int NP, const float *x, int64_t xstride, int NT,
       int64_t c0, int64_t c1, int64_t n, __m512 st[2][TILE_TOKS], float *y, int64_t ys) {
    const float *wr[4];
    for (int i = 0; i < 4; i++) wr[i] = w + pair_row(i / 2, i % 2, nr) * ws;
    __m512 a[2][TILE_TOKS];
    DI_UNROLL
    for (int p = 0; p < NP; p++) {
        DI_UNROLL
        for (int j = 0; j < NT; j++) a[p][j] = c0 == 0 ? _mm512_setzero_ps() : st[p][j];
    }
    // Token j at xb[j / 3] + (j % 3) * xstride: four pointers and the stride (base + index x
    // scale addresses) instead of twelve pointers, which did not fit the registers with the
    // loop's others (GCC reloaded 5-6 from the stack every step, on load ports the tile nearly
    // fills).
    const char *xb[4];
    const int NQ = (NT + 2) / 3; // the pointers in use (none past the tile's last token)
    for (int q = 0; q < NQ; q++) xb[q] = (const char *)(x + c0) + (int64_t)(3 * q) * xstride * 4;
    const int64_t sb = xstride * 4;
    const int64_t full = c1 & ~(int64_t)7;
    int64_t c = c0;
    for (; c < full; c += 8) {
        __m512 wv[2];
        DI_UNROLL
        for (int p = 0; p < NP; p++)
            wv[p] = join8(_mm256_load_ps(wr[2 * p] + c), _mm256_load_ps(wr[2 * p + 1] + c));
        DI_UNROLL
        for (int j = 0; j < NT; j++) {
            const __m512 xv = bcast8((const float *)(xb[j / 3] + (j % 3) * sb));
            DI_UNROLL
            for (int p = 0; p < NP; p++) a[p][j] = _mm512_fmadd_ps(wv[p], xv, a[p][j]);
        }
        DI_UNROLL
        for (int q = 0; q < NQ; q++) xb[q] += 32;
    }
    if (c < c1) { // the last partial chunk (c1 == n): x masked to zero, w zero-padded
        const __mmask8 m = (__mmask8)((1u << (c1 - c)) - 1);
        __m512 wv[2];
        DI_UNROLL
        for (int p = 0; p < NP; p++)
            wv[p] = join8(_mm256_load_ps(wr[2 * p] + c), _mm256_load_ps(wr[2 * p + 1] + c));
        DI_UNROLL
        for (int j = 0; j < NT; j++) {
            const __m512 xv = _mm512_broadcast_f32x8(
                _mm256_maskz_loadu_ps(m, (const float *)(xb[j / 3] + (j % 3) * sb)));
            DI_UNROLL
            for (int p = 0; p < NP; p++) a[p][j] = _mm512_fmadd_ps(wv[p], xv, a[p][j]);
        }
    }
    if (c1 == n) {
        DI_UNROLL
        for (int j = 0; j < NT; j++) sums_store(a[0][j], a[NP - 1][j], nr, y + j * ys);
        return;
    }
    DI_UNROLL
    for (int p = 0; p < NP; p++) {
        DI_UNROLL
        for (int j = 0; j < NT; j++) st[p][j] = a[p][j];
    }
}

void di_gemm_avx512_tile_k(const float *w, int64_t w_stride, int nr, const float *x,
                           int64_t x_stride, int nt, int64_t c0, int64_t c1, int64_t n, void *st,
                           float *y, int64_t y_stride) {
    for (int i = 0; i < nr; i++) READS(w + i * w_stride + c0, sizeof(float) * up8(c1 - c0));
    for (int j = 0; j < nt; j++) READS(x + j * x_stride + c0, sizeof(float) * (size_t)(c1 - c0));
    if (c1 == n) writes_y(y, y_stride, nr, nt);
#define T(P, N)                                                                                    \
    case (P)*16 + (N):                                                                             \
        tile_k(w, w_stride, nr, P, x, x_stride, N, c0, c1, n, (__m512(*)[TILE_TOKS])st, y,         \
               y_stride);                                                                          \
        return;
#define T12(P)                                                                                     \
    T(P, 1)                                                                                        \
    T(P, 2) T(P, 3) T(P, 4) T(P, 5) T(P, 6) T(P, 7) T(P, 8) T(P, 9) T(P, 10) T(P, 11) T(P, 12)
    switch ((nr + 1) / 2 * 16 + nt) {
        T12(1)
        T12(2)
    }
#undef T12
#undef T
    DI_ASSERT(!"tile shape out of range");
}

// ---- fused GEMV: decode in registers (at most 3 tokens) ----

// The accumulators acc[row][token] (8 lanes each) of NP pairs x NT tokens, in and out.
static inline __attribute__((always_inline)) void acc_load(int nr, int NP, int NT,
                                                           float acc[4][3][8], __m512 a[2][3]) {
    DI_UNROLL
    for (int p = 0; p < NP; p++) {
        DI_UNROLL
        for (int j = 0; j < NT; j++)
            a[p][j] = join8(_mm256_loadu_ps(acc[pair_row(p, 0, nr)][j]),
                            _mm256_loadu_ps(acc[pair_row(p, 1, nr)][j]));
    }
}

static inline __attribute__((always_inline)) void acc_store(int nr, int NP, int NT, __m512 a[2][3],
                                                            float acc[4][3][8]) {
    DI_UNROLL
    for (int p = 0; p < NP; p++) {
        DI_UNROLL
        for (int j = 0; j < NT; j++) {
            _mm256_storeu_ps(acc[2 * p][j], _mm512_castps512_ps256(a[p][j]));
            if (2 * p + 1 < nr)
                _mm256_storeu_ps(acc[2 * p + 1][j], _mm512_extractf32x8_ps(a[p][j], 1));
        }
    }
}

// Row pointers of the pairs (data rows, and for FP8 / FP4 their scale rows).
static inline void pair_rows(const di_tensor *w, int64_t r0, int nr, const uint8_t *rows[4],
                             const uint8_t *srows[4]) {
    for (int i = 0; i < 4; i++) {
        const int64_t r = r0 + pair_row(i / 2, i % 2, nr);
        rows[i] = (const uint8_t *)w->data + (size_t)r * w->nb1;
        if (srows) srows[i] = w->scale + (size_t)((w->row0 + r) / w->block_out) * w->scale_nb1;
    }
}

// 16 e4m3fn codes (8 of one row, then 8 of the next) -> their values times 2^-8, the AVX2 level's
// fp8_hi8 in fewer operations: the sign-extended byte shifted left by 7 is s s eeee mmm 0000000,
// the AVX2 level's arithmetic shift of the code in the high byte. Adding 0x80 carries into bit 14
// only from eeee mmm all ones (e4m3fn's NaN), so bit 14 of the sum XOR bit 14 (s) is 1 exactly
// there: one ternary-logic operation writes that bit into bit 14 and keeps the others, giving the
// AVX2 level's binary16 bits (bit 14 cleared, or set for the NaN, which then is an f16 NaN).
static inline __m512 fp8_pair(__m128i v) {
    const __m256i h = _mm256_slli_epi16(_mm256_cvtepi8_epi16(v), 7);
    const __m256i t = _mm256_add_epi16(h, _mm256_set1_epi16(0x80));
    // per bit: mask ? h ^ t : h
    return _mm512_cvtph_ps(_mm256_ternarylogic_epi32(h, t, _mm256_set1_epi16(0x4000), 0x78));
}

// fp8_pair's binary16 bits for 32 codes at once: the 16 columns c..c+15 of a row pair as one
// register of words [a c..c+7, b c..c+7, a c+8..c+15, b c+8..c+15] (the halves fp8_pair makes of
// unpacklo / unpackhi_epi64), so the shift and fix-up run once per 32 codes; each half of the
// result is then fp8_pair's input.
static inline __m512i fp8_pair2_h(const uint8_t *ra, const uint8_t *rb) {
    const __m256i v = _mm256_permute4x64_epi64(
        _mm256_loadu2_m128i((const __m128i *)rb, (const __m128i *)ra), 0xD8);
    const __m512i h = _mm512_slli_epi16(_mm512_cvtepi8_epi16(v), 7);
    const __m512i t = _mm512_add_epi16(h, _mm512_set1_epi16(0x80));
    return _mm512_ternarylogic_epi32(h, t, _mm512_set1_epi16(0x4000), 0x78);
}

// FP8: w = (v * a) * b per block as the AVX2 level's scale8 (b = 1 unless the UE8M0 byte is
// >= 248, and multiplying by 1 is exact, so blocks whose rows all have b = 1 skip it).
static inline __attribute__((always_inline)) void gemv_fp8(const di_tensor *w, int64_t r0, int nr,
                                                           int NP, const float *const *xs, int NT,
                                                           float acc[4][3][8]) {
    const int64_t n = w->ne[0], bi = w->block_in;
    const uint8_t *rows[4], *srows[4];
    pair_rows(w, r0, nr, rows, srows);
    const size_t pf = di_gemm_pf_next_group(w);
    __m512 a[2][3];
    acc_load(nr, NP, NT, acc, a);
    for (int64_t blk = 0, c0 = 0; c0 < n; blk++, c0 += bi) {
        const int64_t c1 = c0 + bi < n ? c0 + bi : n;
        __m512 sa[2], sb[2];
        bool big = false;
        DI_UNROLL
        for (int p = 0; p < NP; p++) {
            float fa[2], fb[2];
            DI_UNROLL
            for (int h = 0; h < 2; h++) {
                const uint8_t u = srows[2 * p + h][blk];
                const float s = di_ue8m0_to_f32(u);
                fa[h] = u < 248 ? s * 256.0f : 256.0f;
                fb[h] = u < 248 ? 1.0f : s;
                big |= u >= 248;
            }
            sa[p] = pair_scale(fa[0], fa[1]);
            sb[p] = pair_scale(fb[0], fb[1]);
        }
        for (int64_t c = c0; c < c1; c += 16) {
            __m512 xl[3], xh[3];
            DI_UNROLL
            for (int j = 0; j < NT; j++) {
                xl[j] = bcast8(xs[j] + c);
                xh[j] = bcast8(xs[j] + c + 8);
            }
            DI_UNROLL
            for (int p = 0; p < NP; p++) {
                const uint8_t *ra = rows[2 * p], *rb = rows[2 * p + 1];
                _mm_prefetch((const char *)ra + c + pf, _MM_HINT_T0);
                _mm_prefetch((const char *)rb + c + pf, _MM_HINT_T0);
                const __m512i h = fp8_pair2_h(ra + c, rb + c);
                __m512 lo = _mm512_mul_ps(_mm512_cvtph_ps(_mm512_castsi512_si256(h)), sa[p]);
                __m512 hi = _mm512_mul_ps(_mm512_cvtph_ps(_mm512_extracti64x4_epi64(h, 1)), sa[p]);
                if (big) {
                    lo = _mm512_mul_ps(lo, sb[p]);
                    hi = _mm512_mul_ps(hi, sb[p]);
                }
                DI_UNROLL
                for (int j = 0; j < NT; j++) {
                    a[p][j] = _mm512_fmadd_ps(lo, xl[j], a[p][j]);
                    a[p][j] = _mm512_fmadd_ps(hi, xh[j], a[p][j]);
                }
            }
        }
    }
    acc_store(nr, NP, NT, a, acc);
}

// e2m1 code -> high byte of its binary16 value, in each 128-bit lane (the row decoder's table).
static inline __m256i fp4_lut2(void) {
    return _mm256_broadcastsi128_si256(
        _mm_setr_epi8(0x00, 0x38, 0x3C, 0x3E, 0x40, 0x42, 0x44, 0x46, (char)0x80, (char)0xB8,
                      (char)0xBC, (char)0xBE, (char)0xC0, (char)0xC2, (char)0xC4, (char)0xC6));
}

// The fused FP4 GEMV's word permutes. A row pair's 32 columns are 16 words (words 0..7 row a,
// 8..15 row b; word i holds columns 4i..4i+3, low nibble first). For column half h (16 columns),
// FP4_GATHER[h] copies into every word the source word of one (row, column), placed so that
// unpacking the looked-up words with zeros (unpacklo / unpackhi_epi16 per 128-bit lane) yields
// lanes 0..7 = row a's and 8..15 = row b's columns 16h..16h+7, then 16h+8..16h+15: in 128-bit
// lane L, word j is row L / 2, column (j & 3) + 8 (j >> 2) + 4 (L & 1) of the half. FP4_SHIFT
// brings that column's nibble to bits 0..3; the lookup (vpermw: bits 0..4 of the index, over a
// 32-word table of the 16 e2m1 values twice) ignores the bits above 3 that way.
static const uint16_t FP4_GATHER[2][32] = {
    {0, 0, 0, 0, 2,  2,  2,  2,  1, 1, 1, 1, 3,  3,  3,  3,            // row a, columns 0..15
     8, 8, 8, 8, 10, 10, 10, 10, 9, 9, 9, 9, 11, 11, 11, 11},          // row b
    {4,  4,  4,  4,  6,  6,  6,  6,  5,  5,  5,  5,  7,  7,  7,  7,    // row a, columns 16..31
     12, 12, 12, 12, 14, 14, 14, 14, 13, 13, 13, 13, 15, 15, 15, 15}}; // row b
static const uint16_t FP4_SHIFT[32] = {0, 4, 8, 12, 0, 4, 8, 12, 0, 4, 8, 12, 0, 4, 8, 12,
                                       0, 4, 8, 12, 0, 4, 8, 12, 0, 4, 8, 12, 0, 4, 8, 12};
// e2m1 code -> its value as bfloat16 (exact: at most 2 significant bits), twice.
static const uint16_t FP4_BF16[32] = {
    0x0000, 0x3F00, 0x3F80, 0x3FC0, 0x4000, 0x4040, 0x4080, 0x40C0, // +0 .. 6
    0x8000, 0xBF00, 0xBF80, 0xBFC0, 0xC000, 0xC040, 0xC080, 0xC0C0, // -0 .. -6
    0x0000, 0x3F00, 0x3F80, 0x3FC0, 0x4000, 0x4040, 0x4080, 0x40C0, // again
    0x8000, 0xBF00, 0xBF80, 0xBFC0, 0xC000, 0xC040, 0xC080, 0xC0C0};

// FP4: w = q * s per block (block_in a multiple of 32); 32 columns of both rows per step: per 16
// columns two word permutes, a shift and two unpacks give the 32 values as floats (the same
// floats as the row decoder's binary16 path: every e2m1 value is exact in both formats).
static inline __attribute__((always_inline)) void gemv_fp4(const di_tensor *w, int64_t r0, int nr,
                                                           int NP, const float *const *xs, int NT,
                                                           float acc[4][3][8]) {
    const int64_t n = w->ne[0], bi = w->block_in;
    const uint8_t *rows[4], *srows[4];
    pair_rows(w, r0, nr, rows, srows);
    const size_t pf = di_gemm_pf_next_group(w);
    const __m512i gather0 = _mm512_loadu_si512(FP4_GATHER[0]),
                  gather1 = _mm512_loadu_si512(FP4_GATHER[1]),
                  shift = _mm512_loadu_si512(FP4_SHIFT), table = _mm512_loadu_si512(FP4_BF16),
                  z = _mm512_setzero_si512();
    __m512 a[2][3];
    acc_load(nr, NP, NT, acc, a);
    for (int64_t blk = 0, c0 = 0; c0 < n; blk++, c0 += bi) {
        const int64_t c1 = c0 + bi < n ? c0 + bi : n;
        __m512 s[2];
        DI_UNROLL
        for (int p = 0; p < NP; p++)
            s[p] = pair_scale(di_ue8m0_to_f32(srows[2 * p][blk]),
                              di_ue8m0_to_f32(srows[2 * p + 1][blk]));
        for (int64_t c = c0; c < c1; c += 32) {
            __m512 xv[3][4];
            DI_UNROLL
            for (int j = 0; j < NT; j++) {
                DI_UNROLL
                for (int k = 0; k < 4; k++) xv[j][k] = bcast8(xs[j] + c + 8 * k);
            }
            DI_UNROLL
            for (int p = 0; p < NP; p++) {
                const uint8_t *ra = rows[2 * p] + c / 2, *rb = rows[2 * p + 1] + c / 2;
                _mm_prefetch((const char *)ra + pf, _MM_HINT_T0);
                _mm_prefetch((const char *)rb + pf, _MM_HINT_T0);
                const __m512i v = _mm512_castsi256_si512(
                    _mm256_loadu2_m128i((const __m128i *)rb, (const __m128i *)ra));
                const __m512i h0 = _mm512_permutexvar_epi16(
                    _mm512_srlv_epi16(_mm512_permutexvar_epi16(gather0, v), shift), table);
                const __m512i h1 = _mm512_permutexvar_epi16(
                    _mm512_srlv_epi16(_mm512_permutexvar_epi16(gather1, v), shift), table);
                const __m512 q[4] = {_mm512_castsi512_ps(_mm512_unpacklo_epi16(z, h0)),
                                     _mm512_castsi512_ps(_mm512_unpackhi_epi16(z, h0)),
                                     _mm512_castsi512_ps(_mm512_unpacklo_epi16(z, h1)),
                                     _mm512_castsi512_ps(_mm512_unpackhi_epi16(z, h1))};
                DI_UNROLL
                for (int k = 0; k < 4; k++) {
                    const __m512 wv = _mm512_mul_ps(q[k], s[p]);
                    DI_UNROLL
                    for (int j = 0; j < NT; j++) a[p][j] = _mm512_fmadd_ps(wv, xv[j][k], a[p][j]);
                }
            }
        }
    }
    acc_store(nr, NP, NT, a, acc);
}

static inline __attribute__((always_inline)) void gemv_bf16(const di_tensor *w, int64_t r0, int nr,
                                                            int NP, const float *const *xs, int NT,
                                                            float acc[4][3][8]) {
    const int64_t n = w->ne[0];
    const uint8_t *rows[4];
    pair_rows(w, r0, nr, rows, NULL);
    const size_t pf = di_gemm_pf_next_group(w);
    __m512 a[2][3];
    acc_load(nr, NP, NT, acc, a);
    for (int64_t c = 0; c < n; c += 8) {
        __m512 xv[3];
        DI_UNROLL
        for (int j = 0; j < NT; j++) xv[j] = bcast8(xs[j] + c);
        DI_UNROLL
        for (int p = 0; p < NP; p++) {
            const uint8_t *ra = rows[2 * p] + 2 * c, *rb = rows[2 * p + 1] + 2 * c;
            if ((c & 31) == 0) {
                _mm_prefetch((const char *)ra + pf, _MM_HINT_T0);
                _mm_prefetch((const char *)rb + pf, _MM_HINT_T0);
            }
            const __m256i v = _mm256_loadu2_m128i((const __m128i *)rb, (const __m128i *)ra);
            const __m512 wv = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16));
            DI_UNROLL
            for (int j = 0; j < NT; j++) a[p][j] = _mm512_fmadd_ps(wv, xv[j], a[p][j]);
        }
    }
    acc_store(nr, NP, NT, a, acc);
}

bool di_gemm_avx512_gemv_ok(const di_tensor *w) {
    const int64_t n = w->ne[0];
    switch (w->kind) {
    case DI_TENSOR_KIND_FP8:
        return w->block_in % 16 == 0 && n % 16 == 0;
    case DI_TENSOR_KIND_FP4:
        return w->block_in % 32 == 0 && n % 32 == 0;
    case DI_TENSOR_KIND_BF16:
        return n % 8 == 0;
    default:
        return false;
    }
}

void di_gemm_avx512_gemv(const di_tensor *w, int64_t r0, int nr, const float *const *xs, int nt,
                         float acc[4][3][8]) {
    reads_w_rows(w, r0, nr);
    reads_each((const void *const *)xs, nt, sizeof(float) * (size_t)w->ne[0]);
    touches_acc(acc, nr, nt);
    DI_ASSERT(nr >= 1 && nr <= 4 && di_gemm_avx512_gemv_ok(w));
#define G(P, N)                                                                                    \
    case (P)*4 + (N):                                                                              \
        if (w->kind == DI_TENSOR_KIND_FP8)                                                         \
            gemv_fp8(w, r0, nr, P, xs, N, acc);                                                    \
        else if (w->kind == DI_TENSOR_KIND_FP4)                                                    \
            gemv_fp4(w, r0, nr, P, xs, N, acc);                                                    \
        else                                                                                       \
            gemv_bf16(w, r0, nr, P, xs, N, acc);                                                   \
        return;
    switch ((nr + 1) / 2 * 4 + nt) { G(1, 1) G(1, 2) G(1, 3) G(2, 1) G(2, 2) G(2, 3) }
#undef G
    DI_ASSERT(!"gemv shape out of range");
}

// ---- row decoding for the many-token tile (di_gemm_avx2_decode's values, 16 at a time) ----

// FP8 row r, columns [c0, c1): per block (v * a) * b as the fused GEMV, masked at a block's or
// the row's end (any block_in). The AVX2 level's scalar tail computes v * s in one product; this
// is the same number: v * 2^-8 is exact and the one product that rounds sees the same operands'
// exact product.
static void decode_fp8(const di_tensor *w, int64_t r, int64_t c0, int64_t c1, float *dst) {
    const uint8_t *row = (const uint8_t *)w->data + (size_t)r * w->nb1;
    const uint8_t *srow = w->scale + (size_t)((w->row0 + r) / w->block_out) * w->scale_nb1;
    const int64_t bi = w->block_in;
    for (int64_t blk = c0 / bi, c = c0; c < c1; blk++) { // no division per block
        const int64_t bend = (blk + 1) * bi < c1 ? (blk + 1) * bi : c1;
        const uint8_t u = srow[blk];
        const float s = di_ue8m0_to_f32(u);
        const __m512 a = _mm512_set1_ps(u < 248 ? s * 256.0f : 256.0f), b = _mm512_set1_ps(s);
        for (; c < bend; c += 16) {
            const __mmask16 m = bend - c >= 16 ? 0xFFFF : (__mmask16)((1u << (bend - c)) - 1);
            __m512 v = _mm512_mul_ps(fp8_pair(_mm_maskz_loadu_epi8(m, row + c)), a);
            if (u >= 248) v = _mm512_mul_ps(v, b);
            _mm512_mask_storeu_ps(dst + (c - c0), m, v);
        }
        c = bend;
    }
}

// 16 FP4 columns from 8 packed bytes (low nibble first): their e2m1 values.
static inline __m512 fp4x16(__m128i v, __m128i lut) {
    const __m128i m4 = _mm_set1_epi8(0x0F);
    const __m128i lo = _mm_and_si128(v, m4), hi = _mm_and_si128(_mm_srli_epi16(v, 4), m4);
    const __m128i hb = _mm_shuffle_epi8(lut, _mm_unpacklo_epi8(lo, hi));
    return _mm512_cvtph_ps(_mm256_slli_epi16(_mm256_cvtepu8_epi16(hb), 8));
}

// FP4 row r, columns [c0, c1): q * s per block, 16 columns a step from an even column; a block
// that starts on an odd column or leaves fewer than 16 takes the AVX2 level's scalar products.
static void decode_fp4(const di_tensor *w, int64_t r, int64_t c0, int64_t c1, float *dst) {
    const uint8_t *row = (const uint8_t *)w->data + (size_t)r * w->nb1;
    const uint8_t *srow = w->scale + (size_t)((w->row0 + r) / w->block_out) * w->scale_nb1;
    const int64_t bi = w->block_in;
    const __m128i lut = _mm256_castsi256_si128(fp4_lut2());
    for (int64_t blk = c0 / bi, c = c0; c < c1; blk++) { // no division per block
        const int64_t bend = (blk + 1) * bi < c1 ? (blk + 1) * bi : c1;
        const float s = di_ue8m0_to_f32(srow[blk]);
        const __m512 sv = _mm512_set1_ps(s);
        if ((c & 1) == 0)
            for (; c + 16 <= bend; c += 16)
                _mm512_storeu_ps(
                    dst + (c - c0),
                    _mm512_mul_ps(fp4x16(_mm_loadl_epi64((const __m128i *)(row + c / 2)), lut),
                                  sv));
        for (; c < bend; c++) {
            const uint8_t byte = row[c / 2];
            dst[c - c0] = di_e2m1_to_f32(c & 1 ? byte >> 4 : byte & 15) * s;
        }
    }
}

// BF16 row r, columns [c0, c1): the high halves of f32, masked at the end.
static void decode_bf16(const di_tensor *w, int64_t r, int64_t c0, int64_t c1, float *dst) {
    const uint16_t *row = (const uint16_t *)((const uint8_t *)w->data + (size_t)r * w->nb1);
    for (int64_t c = c0; c < c1; c += 16) {
        const __mmask16 m = c1 - c >= 16 ? 0xFFFF : (__mmask16)((1u << (c1 - c)) - 1);
        const __m512i v = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, row + c));
        _mm512_mask_storeu_ps(dst + (c - c0), m, _mm512_castsi512_ps(_mm512_slli_epi32(v, 16)));
    }
}

void di_gemm_avx512_decode(const di_tensor *w, int64_t r0, int nr, int64_t c0, int64_t c1,
                           float *dst, int64_t dst_stride) {
    const int64_t n = w->ne[0];
    reads_w_rows(w, r0, nr);
    for (int i = 0; i < nr; i++)
        WRITES(dst + i * dst_stride, sizeof(float) * (c1 == n ? up8(c1 - c0) : c1 - c0));
    for (int i = 0; i < nr; i++) {
        float *d = dst + i * dst_stride;
        switch (w->kind) {
        case DI_TENSOR_KIND_FP8:
            decode_fp8(w, r0 + i, c0, c1, d);
            break;
        case DI_TENSOR_KIND_FP4:
            decode_fp4(w, r0 + i, c0, c1, d);
            break;
        case DI_TENSOR_KIND_BF16:
            decode_bf16(w, r0 + i, c0, c1, d);
            break;
        default: // F32, F16, Q2_K, IQ2_XXS
            di_gemm_avx2_decode(w, r0 + i, 1, c0, c1, d, dst_stride);
            continue;
        }
        if (c1 == n)
            for (int64_t c = c1; c < c0 + up8(c1 - c0); c++) d[c - c0] = 0;
    }
}

// ---- 8-bit activations: the VNNI integer GEMV (Q8_0, MXFP4) ----

enum { INT8_TOKS = DI_GEMM_AVX512_INT8_TOKS }; // 2 pairs x 8 tokens = 16 accumulators

// Where the weights are read: Q8_0 or MXFP4 blocks in place, or codes and scales already decoded
// by di_gemm_avx2_codes.
typedef enum src_kind { SRC_Q8_0, SRC_MXFP4, SRC_CODES } src_kind;

typedef struct int8_src {
    const uint8_t *rows[4]; // the pairs' rows (the last row standing in for missing ones)
    const float *d[4];      // SRC_CODES: their scales
    size_t pf;              // in place: bytes ahead to prefetch (the next group of 4 rows)
} int8_src;

// Block b of pair p: the 64 weight codes (32 of each row, in column order) and the two scales.
static inline __attribute__((always_inline)) __m512i int8_pair(src_kind sk, const int8_src *src,
                                                               int p, int64_t b, __m512 *dw) {
    const uint8_t *ra = src->rows[2 * p], *rb = src->rows[2 * p + 1];
    if (sk == SRC_CODES) {
        *dw = pair_scale(src->d[2 * p][b], src->d[2 * p + 1][b]);
        return _mm512_inserti64x4(
            _mm512_castsi256_si512(_mm256_load_si256((const __m256i *)(ra + 32 * b))),
            _mm256_load_si256((const __m256i *)(rb + 32 * b)), 1);
    }
    if (sk == SRC_Q8_0) {
        const uint8_t *ba = ra + 34 * b, *bb = rb + 34 * b;
        _mm_prefetch((const char *)ba + src->pf, _MM_HINT_T0);
        _mm_prefetch((const char *)bb + src->pf, _MM_HINT_T0);
        uint16_t ha, hb;
        memcpy(&ha, ba, 2);
        memcpy(&hb, bb, 2);
        *dw = pair_scale(_cvtsh_ss(ha), _cvtsh_ss(hb));
        return _mm512_inserti64x4(
            _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(ba + 2))),
            _mm256_loadu_si256((const __m256i *)(bb + 2)), 1);
    }
    // MXFP4: each row's 16 bytes in two 128-bit lanes, shifted by 0 (low nibbles: columns 0..15)
    // and 4 (high nibbles: 16..31), masked, then ggml's doubled e2m1 values by table.
    const uint8_t *ba = ra + 17 * b, *bb = rb + 17 * b;
    _mm_prefetch((const char *)ba + src->pf, _MM_HINT_T0);
    _mm_prefetch((const char *)bb + src->pf, _MM_HINT_T0);
    float da, db;
    memcpy(&da, &di_gemm_mxfp4_scale_bits[ba[0]], 4);
    memcpy(&db, &di_gemm_mxfp4_scale_bits[bb[0]], 4);
    *dw = pair_scale(da, db);
    const __m512i lut = _mm512_broadcast_i32x4(
        _mm_setr_epi8(0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12));
    const __m512i shift = _mm512_set_epi64(0x0004000400040004, 0x0004000400040004, 0, 0,
                                           0x0004000400040004, 0x0004000400040004, 0, 0);
    __m512i v = _mm512_inserti64x4(
        _mm512_castsi256_si512(
            _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(ba + 1)))),
        _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(bb + 1))), 1);
    v = _mm512_and_si512(_mm512_srlv_epi16(v, shift), _mm512_set1_epi8(0x0F));
    return _mm512_shuffle_epi8(lut, v);
}

// NP pairs x NT tokens, whole rows, sums to y (di_ref_dot_q8's bits, as the AVX2 level). Per
// block of 32: |w| (unsigned) and x negated where w < 0; vpdpbusd gives lane l of each half the
// exact sum of columns 4l..4l+3 (what the AVX2 level's vpmaddubsw + vpmaddwd give: no product or
// sum leaves int16 there), converted exactly to f32 and added by one FMA with dw * dx.
static inline __attribute__((always_inline)) void
gemv_int8(src_kind sk, const int8_src *src, int64_t n, int nr, int NP, const int8_t *const *xq,
          const float *const *xd, int NT, float *y, int64_t y_stride) {
    const __m512i z = _mm512_setzero_si512();
    __m512 a[2][INT8_TOKS];
    DI_UNROLL
    for (int p = 0; p < NP; p++) {
        DI_UNROLL
        for (int j = 0; j < NT; j++) a[p][j] = _mm512_setzero_ps();
    }
    for (int64_t b = 0; b < n / 32; b++) {
        __m512i aw[2];
        __mmask64 neg[2];
        __m512 dw[2];
        DI_UNROLL
        for (int p = 0; p < NP; p++) {
            const __m512i wv = int8_pair(sk, src, p, b, &dw[p]);
            aw[p] = _mm512_abs_epi8(wv);
            neg[p] = _mm512_movepi8_mask(wv);
        }
        DI_UNROLL
        for (int j = 0; j < NT; j++) {
            const __m512i xv =
                _mm512_broadcast_i32x8(_mm256_load_si256((const __m256i *)(xq[j] + 32 * b)));
            const __m512 dx = _mm512_set1_ps(xd[j][b]);
            DI_UNROLL
            for (int p = 0; p < NP; p++) {
                const __m512i sx = _mm512_mask_sub_epi8(xv, neg[p], z, xv);
                const __m512 s = _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(z, aw[p], sx));
                a[p][j] = _mm512_fmadd_ps(_mm512_mul_ps(dw[p], dx), s, a[p][j]);
            }
        }
    }
    DI_UNROLL
    for (int j = 0; j < NT; j++) sums_store(a[0][j], a[NP - 1][j], nr, y + j * y_stride);
}

#define INT8_ROW(G, P) G(P, 1) G(P, 2) G(P, 3) G(P, 4) G(P, 5) G(P, 6) G(P, 7) G(P, 8)
#define INT8_SHAPES(G)                                                                             \
    switch ((nr + 1) / 2 * 16 + nt) {                                                              \
        INT8_ROW(G, 1)                                                                             \
        INT8_ROW(G, 2)                                                                             \
    }                                                                                              \
    DI_ASSERT(!"gemv shape out of range");

void di_gemm_avx512_gemv_int8(const di_tensor *w, int64_t r0, int nr, const int8_t *const *xq,
                              const float *const *xd, int nt, float *y, int64_t y_stride) {
    const bool mx = w->kind == DI_TENSOR_KIND_MXFP4;
    DI_ASSERT(mx || w->kind == DI_TENSOR_KIND_Q8_0);
    DI_ASSERT(nr >= 1 && nr <= 4);
    reads_w_rows(w, r0, nr);
    reads_each((const void *const *)xq, nt, (size_t)w->ne[0]);
    reads_each((const void *const *)xd, nt, sizeof(float) * (size_t)(w->ne[0] / 32));
    writes_y(y, y_stride, nr, nt);
    int8_src src;
    for (int i = 0; i < 4; i++)
        src.rows[i] = (const uint8_t *)w->data + (size_t)(r0 + pair_row(i / 2, i % 2, nr)) * w->nb1;
    src.pf = di_gemm_pf_next_group(w);
#define G(P, N)                                                                                    \
    case (P)*16 + (N):                                                                             \
        if (mx)                                                                                    \
            gemv_int8(SRC_MXFP4, &src, w->ne[0], nr, P, xq, xd, N, y, y_stride);                   \
        else                                                                                       \
            gemv_int8(SRC_Q8_0, &src, w->ne[0], nr, P, xq, xd, N, y, y_stride);                    \
        return;
    INT8_SHAPES(G)
#undef G
}

void di_gemm_avx512_gemv_codes(const int8_t *q, int64_t ldq, const float *d, int64_t ldd, int64_t n,
                               int nr, const int8_t *const *xq, const float *const *xd, int nt,
                               float *y, int64_t y_stride) {
    DI_ASSERT(nr >= 1 && nr <= 4);
    for (int i = 0; i < nr; i++) {
        READS(q + i * ldq, (size_t)n);
        READS(d + i * ldd, sizeof(float) * (size_t)(n / 32));
    }
    reads_each((const void *const *)xq, nt, (size_t)n);
    reads_each((const void *const *)xd, nt, sizeof(float) * (size_t)(n / 32));
    writes_y(y, y_stride, nr, nt);
    int8_src src;
    for (int i = 0; i < 4; i++) {
        const int r = pair_row(i / 2, i % 2, nr);
        src.rows[i] = (const uint8_t *)(q + r * ldq);
        src.d[i] = d + r * ldd;
    }
#define G(P, N)                                                                                    \
    case (P)*16 + (N):                                                                             \
        gemv_int8(SRC_CODES, &src, n, nr, P, xq, xd, N, y, y_stride);                              \
        return;
    INT8_SHAPES(G)
#undef G
}
#undef INT8_SHAPES
#undef INT8_ROW

// ---- the FMA peak probe (probe.c) ----

float di_gemm_avx512_fma_loop(int64_t iters) {
    __m512 a[12];
    const __m512 h = _mm512_set1_ps(0.5f), one = _mm512_set1_ps(1.0f);
    for (int i = 0; i < 12; i++) a[i] = _mm512_set1_ps((float)i);
    for (int64_t k = 0; k < iters; k++) {
        DI_UNROLL
        for (int i = 0; i < 12; i++) a[i] = _mm512_fmadd_ps(a[i], h, one);
    }
    float s = 0;
    for (int i = 0; i < 12; i++) s += _mm512_cvtss_f32(a[i]);
    return s;
}

#else // not built with AVX-512: gemm.c never selects this level

bool di_gemm_avx512_built(void) {
    return false;
}

void di_gemm_avx512_tile_k(const float *w, int64_t w_stride, int nr, const float *x,
                           int64_t x_stride, int nt, int64_t c0, int64_t c1, int64_t n, void *st,
                           float *y, int64_t y_stride) {
    (void)w, (void)w_stride, (void)nr, (void)x, (void)x_stride, (void)nt, (void)c0, (void)c1,
        (void)n, (void)st, (void)y, (void)y_stride;
    DI_ASSERT(!"AVX-512 kernels not built");
}

void di_gemm_avx512_decode(const di_tensor *w, int64_t r0, int nr, int64_t c0, int64_t c1,
                           float *dst, int64_t dst_stride) {
    (void)w, (void)r0, (void)nr, (void)c0, (void)c1, (void)dst, (void)dst_stride;
    DI_ASSERT(!"AVX-512 kernels not built");
}

bool di_gemm_avx512_gemv_ok(const di_tensor *w) {
    (void)w;
    return false;
}

void di_gemm_avx512_gemv(const di_tensor *w, int64_t r0, int nr, const float *const *xs, int nt,
                         float acc[4][3][8]) {
    (void)w, (void)r0, (void)nr, (void)xs, (void)nt, (void)acc;
    DI_ASSERT(!"AVX-512 kernels not built");
}

void di_gemm_avx512_gemv_int8(const di_tensor *w, int64_t r0, int nr, const int8_t *const *xq,
                              const float *const *xd, int nt, float *y, int64_t y_stride) {
    (void)w, (void)r0, (void)nr, (void)xq, (void)xd, (void)nt, (void)y, (void)y_stride;
    DI_ASSERT(!"AVX-512 kernels not built");
}

void di_gemm_avx512_gemv_codes(const int8_t *q, int64_t ldq, const float *d, int64_t ldd, int64_t n,
                               int nr, const int8_t *const *xq, const float *const *xd, int nt,
                               float *y, int64_t y_stride) {
    (void)q, (void)ldq, (void)d, (void)ldd, (void)n, (void)nr, (void)xq, (void)xd, (void)nt,
        (void)y, (void)y_stride;
    DI_ASSERT(!"AVX-512 kernels not built");
}

float di_gemm_avx512_fma_loop(int64_t iters) {
    (void)iters;
    DI_ASSERT(!"AVX-512 kernels not built");
    return 0;
}

#endif
