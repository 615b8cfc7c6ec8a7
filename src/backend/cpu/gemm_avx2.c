// gemm_avx2 — the AVX2 + FMA + F16C kernels of gemm.h: weight decoding for every di_tensor kind
// multiplied in f32 and the 4-row x 3-token FMA tile; the 8-bit activation quantisers and the
// integer-dot GEMVs of Q8_0, MXFP4 and Q4_K. Compiled with -mavx2 -mfma -mf16c on x86-64
// (CMakeLists.txt); called only after gemm.c checked the CPU supports them. Elsewhere the file
// builds to stubs that report "not built".
#include "backend/cpu/gemm.h"

#include <math.h> // fabsf
#include <string.h>

#include "base/log.h"
#include "tensor/quant_ref.h"

#if defined(__x86_64__) && defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)

#include <immintrin.h>

#include "backend/cpu/gemm_asan.h"
#include "backend/cpu/simd.h"

bool di_gemm_avx2_built(void) {
    return true;
}

// Floats up to the next multiple of 8 (the decoded rows' zero padding).
__attribute__((unused)) static inline int64_t up8(int64_t n) { // in READS only
    return (n + 7) & ~(int64_t)7;
}

// ---- element decoders (8 values -> 8 floats, exact) ----

// e4m3fn -> binary16 by moving bits: with the byte in the high half of a 16-bit lane
// (s eeee mmm 00000000), an arithmetic shift right by one and clearing bit 14 gives
// s 0eeee mmm0000000, the same number times 2^-8 (bias 7 vs 15), subnormals included (e4m3
// subnormals land on f16 subnormals); the 2^8 is folded into the block scale. The largest
// magnitude 0x3F80 is e4m3fn's NaN (0x7F/0xFF): adding 0x80 reaches bit 14 only there, which
// turns it into an f16 NaN.
static inline __m256 fp8_hi8(__m128i v) { // v: 8 codes in the high bytes of 16-bit lanes
    __m128i h = _mm_and_si128(_mm_srai_epi16(v, 1), _mm_set1_epi16((short)0xBFFF));
    h = _mm_or_si128(h,
                     _mm_and_si128(_mm_add_epi16(h, _mm_set1_epi16(0x80)), _mm_set1_epi16(0x4000)));
    return _mm256_cvtph_ps(h);
}

// 16 codes -> two vectors of 8 floats (times 2^-8).
static inline void fp8x16(const uint8_t *p, __m256 *a, __m256 *b) {
    __m128i v = _mm_loadu_si128((const __m128i *)p), z = _mm_setzero_si128();
    *a = fp8_hi8(_mm_unpacklo_epi8(z, v));
    *b = fp8_hi8(_mm_unpackhi_epi8(z, v));
}

static inline __m256 fp8x8(const uint8_t *p) {
    return fp8_hi8(_mm_unpacklo_epi8(_mm_setzero_si128(), _mm_loadl_epi64((const __m128i *)p)));
}

// e2m1 code -> high byte of its binary16 value (every e2m1 value has a zero low byte).
static inline __m128i fp4_lut(void) {
    return _mm_setr_epi8(0x00, 0x38, 0x3C, 0x3E, 0x40, 0x42, 0x44, 0x46, (char)0x80, (char)0xB8,
                         (char)0xBC, (char)0xBE, (char)0xC0, (char)0xC2, (char)0xC4, (char)0xC6);
}

// 16 e2m1 values from 8 packed bytes (low nibble first) -> two vectors of 8 floats.
static inline void fp4x16(const uint8_t *p, __m128i lut, __m256 *a, __m256 *b) {
    __m128i v = _mm_loadl_epi64((const __m128i *)p);
    __m128i lo = _mm_and_si128(v, _mm_set1_epi8(0x0F));
    __m128i hi = _mm_and_si128(_mm_srli_epi16(v, 4), _mm_set1_epi8(0x0F));
    __m128i hb = _mm_shuffle_epi8(lut, _mm_unpacklo_epi8(lo, hi)); // 16 codes in column order
    __m128i z = _mm_setzero_si128();
    *a = _mm256_cvtph_ps(_mm_unpacklo_epi8(z, hb));
    *b = _mm256_cvtph_ps(_mm_unpackhi_epi8(z, hb));
}

static inline __m256 fp4x8(const uint8_t *p, __m128i lut) {
    uint32_t w;
    memcpy(&w, p, 4);
    __m128i v = _mm_cvtsi32_si128((int)w);
    __m128i lo = _mm_and_si128(v, _mm_set1_epi8(0x0F));
    __m128i hi = _mm_and_si128(_mm_srli_epi16(v, 4), _mm_set1_epi8(0x0F));
    __m128i hb = _mm_shuffle_epi8(lut, _mm_unpacklo_epi8(lo, hi));
    return _mm256_cvtph_ps(_mm_unpacklo_epi8(_mm_setzero_si128(), hb));
}

// ---- row decoding ----

// Multiplying by a UE8M0 scale 2^(u-127) is exact; for FP8 the decoded value also carries 2^-8.
// s*256 overflows for u >= 248, so those blocks multiply twice (still exact, as the reference's
// one product is whenever it is finite).
typedef struct scale8 {
    __m256 a, b; // w = (v * a) * b
} scale8;

static inline scale8 fp8_scale(uint8_t u) {
    float s = di_ue8m0_to_f32(u);
    scale8 r;
    if (u < 248) {
        r.a = _mm256_set1_ps(s * 256.0f);
        r.b = _mm256_set1_ps(1.0f);
    } else {
        r.a = _mm256_set1_ps(256.0f);
        r.b = _mm256_set1_ps(s);
    }
    return r;
}

static void decode_fp8(const di_tensor *w, int64_t r, int64_t c0, int64_t c1, float *dst) {
    const uint8_t *row = (const uint8_t *)w->data + (size_t)r * w->nb1;
    const uint8_t *srow = w->scale + (size_t)((w->row0 + r) / w->block_out) * w->scale_nb1;
    const int64_t bi = w->block_in;
    int64_t c = c0;
    for (int64_t blk = c0 / bi; c + 8 <= c1; blk++) { // no division per block
        int64_t bend = (blk + 1) * bi;
        if (bend > c1) bend = c1;
        scale8 s = fp8_scale(srow[blk]);
        for (; c + 8 <= bend; c += 8)
            _mm256_store_ps(dst + (c - c0), _mm256_mul_ps(_mm256_mul_ps(fp8x8(row + c), s.a), s.b));
        if (c < bend) break; // the row's tail (bi % 8 == 0, so only at c1)
    }
    for (; c < c1; c++) dst[c - c0] = di_e4m3_to_f32(row[c]) * di_ue8m0_to_f32(srow[c / bi]);
}

static void decode_fp4(const di_tensor *w, int64_t r, int64_t c0, int64_t c1, float *dst) {
    const uint8_t *row = (const uint8_t *)w->data + (size_t)r * w->nb1; // column c at byte c/2
    const uint8_t *srow = w->scale + (size_t)((w->row0 + r) / w->block_out) * w->scale_nb1;
    const int64_t bi = w->block_in;
    const __m128i lut = fp4_lut();
    int64_t c = c0;
    for (int64_t blk = c0 / bi; c + 8 <= c1; blk++) { // no division per block
        int64_t bend = (blk + 1) * bi;
        if (bend > c1) bend = c1;
        __m256 s = _mm256_set1_ps(di_ue8m0_to_f32(srow[blk]));
        for (; c + 16 <= bend; c += 16) {
            __m256 a, b;
            fp4x16(row + c / 2, lut, &a, &b);
            _mm256_store_ps(dst + (c - c0), _mm256_mul_ps(a, s));
            _mm256_store_ps(dst + (c - c0) + 8, _mm256_mul_ps(b, s));
        }
        for (; c + 8 <= bend; c += 8)
            _mm256_store_ps(dst + (c - c0), _mm256_mul_ps(fp4x8(row + c / 2, lut), s));
        if (c < bend) break;
    }
    for (; c < c1; c++) {
        uint8_t byte = row[c / 2];
        dst[c - c0] = di_e2m1_to_f32(c & 1 ? byte >> 4 : byte & 15) * di_ue8m0_to_f32(srow[c / bi]);
    }
}

static void decode_float(const di_tensor *w, int64_t r, int64_t c0, int64_t c1, float *dst) {
    const uint8_t *row = (const uint8_t *)w->data + (size_t)r * w->nb1;
    int64_t c = c0;
    switch (w->kind) {
    case DI_TENSOR_KIND_F32:
        for (; c + 8 <= c1; c += 8)
            _mm256_store_ps(dst + (c - c0), _mm256_loadu_ps((const float *)(row + 4 * c)));
        for (; c < c1; c++) memcpy(dst + (c - c0), row + 4 * c, 4);
        return;
    case DI_TENSOR_KIND_F16:
        for (; c + 8 <= c1; c += 8)
            _mm256_store_ps(dst + (c - c0),
                            _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(row + 2 * c))));
        break;
    case DI_TENSOR_KIND_BF16:
        for (; c + 8 <= c1; c += 8) {
            __m256i v = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(row + 2 * c)));
            _mm256_store_ps(dst + (c - c0), _mm256_castsi256_ps(_mm256_slli_epi32(v, 16)));
        }
        break;
    default:
        DI_ASSERT(!"not a float kind");
    }
    for (; c < c1; c++) {
        uint16_t h;
        memcpy(&h, row + 2 * c, 2);
        dst[c - c0] = w->kind == DI_TENSOR_KIND_F16 ? di_f16_to_f32(h) : di_bf16_to_f32(h);
    }
}

// ---- ggml block formats ----

// Columns [c0, c1) fall on whole blocks: c0 is 0 or a multiple of the 1024-column segment and c1
// a segment end or the row end, and every block size (32, 256) divides 1024 and the row.
static inline float f16_at(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return di_f16_to_f32(h);
}

// Q2_K: per 16 values (d * sc) * q - (dmin * m), q the 2-bit code at `shift` of 16 bytes.
static inline __m256 q2x8(const uint8_t *q, int shift) {
    __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)q));
    v = _mm256_and_si256(_mm256_srli_epi32(v, shift), _mm256_set1_epi32(3));
    return _mm256_cvtepi32_ps(v);
}

// Calls body(k, w8) for the 32 8-value chunks of one Q2_K block in column order.
#define Q2K_BLOCK(blk, body)                                                                       \
    do {                                                                                           \
        const float d_ = f16_at((blk) + 80), dmin_ = f16_at((blk) + 82);                           \
        int is_ = 0, k_ = 0;                                                                       \
        for (int h_ = 0; h_ < 2; h_++)                                                             \
            for (int sh_ = 0; sh_ < 8; sh_ += 2)                                                   \
                for (int part_ = 0; part_ < 2; part_++) {                                          \
                    const uint8_t sc_ = (blk)[is_++];                                              \
                    const __m256 dl_ = _mm256_set1_ps(d_ * (float)(sc_ & 0xF));                    \
                    const __m256 ml_ = _mm256_set1_ps(dmin_ * (float)(sc_ >> 4));                  \
                    const uint8_t *q_ = (blk) + 16 + 32 * h_ + 16 * part_;                         \
                    for (int c_ = 0; c_ < 2; c_++, k_++) {                                         \
                        __m256 w8 =                                                                \
                            _mm256_sub_ps(_mm256_mul_ps(dl_, q2x8(q_ + 8 * c_, sh_)), ml_);        \
                        body(k_, w8);                                                              \
                    }                                                                              \
                }                                                                                  \
    } while (0)

static void decode_q2_k(const di_tensor *w, int64_t r, int64_t c0, int64_t c1, float *dst) {
    const uint8_t *row = (const uint8_t *)w->data + (size_t)r * w->nb1;
    for (int64_t c = c0; c < c1; c += 256) {
        const uint8_t *blk = row + (size_t)(c / 256) * 84;
        float *y = dst + (c - c0);
#define STORE(k, w8) _mm256_store_ps(y + 8 * (k), w8)
        Q2K_BLOCK(blk, STORE);
#undef STORE
    }
}

// IQ2_XXS: per 8 values ((d * (0.5 + s)) * 0.25) * grid, negated where the sign bit is set (a
// sign-bit flip is exactly the reference's multiplication by -1).
static inline __m256 iq2x8(uint8_t idx, uint8_t signs, __m256 db) {
    const uint64_t g = di_iq2xxs_grid(idx);
    __m256 v = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128((long long)g)));
    const __m256i bit = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
    __m256i neg = _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_set1_epi32(signs), bit), bit);
    return _mm256_xor_ps(_mm256_mul_ps(db, v),
                         _mm256_and_ps(_mm256_castsi256_ps(neg), _mm256_set1_ps(-0.0f)));
}

#define IQ2XXS_BLOCK(blk, body)                                                                    \
    do {                                                                                           \
        const float d_ = f16_at(blk);                                                              \
        for (int ib_ = 0; ib_ < 8; ib_++) {                                                        \
            uint32_t aux_[2];                                                                      \
            memcpy(aux_, (blk) + 2 + 8 * ib_, 8);                                                  \
            const float t_ = d_ * (0.5f + (float)(aux_[1] >> 28));                                 \
            const __m256 db_ = _mm256_set1_ps(t_ * 0.25f);                                         \
            for (int l_ = 0; l_ < 4; l_++) {                                                       \
                const uint8_t sg_ = di_iq2xs_signs((int)((aux_[1] >> (7 * l_)) & 127));            \
                __m256 w8 = iq2x8((uint8_t)(aux_[0] >> (8 * l_)), sg_, db_);                       \
                body(4 * ib_ + l_, w8);                                                            \
            }                                                                                      \
        }                                                                                          \
    } while (0)

static void decode_iq2_xxs(const di_tensor *w, int64_t r, int64_t c0, int64_t c1, float *dst) {
    const uint8_t *row = (const uint8_t *)w->data + (size_t)r * w->nb1;
    for (int64_t c = c0; c < c1; c += 256) {
        const uint8_t *blk = row + (size_t)(c / 256) * 66;
        float *y = dst + (c - c0);
#define STORE(k, w8) _mm256_store_ps(y + 8 * (k), w8)
        IQ2XXS_BLOCK(blk, STORE);
#undef STORE
    }
}

void di_gemm_avx2_decode(const di_tensor *w, int64_t r0, int nr, int64_t c0, int64_t c1, float *dst,
                         int64_t dst_stride) {
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
        case DI_TENSOR_KIND_Q2_K:
            decode_q2_k(w, r0 + i, c0, c1, d);
            break;
        case DI_TENSOR_KIND_IQ2_XXS:
            decode_iq2_xxs(w, r0 + i, c0, c1, d);
            break;
        default:
            decode_float(w, r0 + i, c0, c1, d);
            break;
        }
        if (c1 == n)
            for (int64_t c = c1; c < c0 + ((c1 - c0 + 7) & ~(int64_t)7); c++) d[c - c0] = 0;
    }
}

// The fused GEMVs below start here: row pointers, and the running 8-lane sums into registers.
static inline __attribute__((always_inline)) void gemv_begin(const di_tensor *w, int64_t r0, int NR,
                                                             int NT, float acc[4][3][8],
                                                             const uint8_t *rows[4],
                                                             __m256 a[4][3]) {
    DI_UNROLL
    for (int i = 0; i < NR; i++) {
        rows[i] = (const uint8_t *)w->data + (size_t)(r0 + i) * w->nb1;
        DI_UNROLL
        for (int j = 0; j < NT; j++) a[i][j] = _mm256_loadu_ps(acc[i][j]);
    }
}

// The tile and the GEMVs end here: the 8-lane sums back to memory.
static inline __attribute__((always_inline)) void acc_store(int NR, int NT, __m256 a[4][3],
                                                            float acc[4][3][8]) {
    DI_UNROLL
    for (int i = 0; i < NR; i++) {
        DI_UNROLL
        for (int j = 0; j < NT; j++) _mm256_storeu_ps(acc[i][j], a[i][j]);
    }
}

// ---- the FMA tile ----

// NR rows x NT tokens of 8-lane accumulators; always inlined with constant NR, NT so they stay in
// registers (4 x 3 = 12 accumulators + 3 x + 1 w = 16 ymm).
static inline __attribute__((always_inline)) void tile(const float *w, int64_t ws, int NR,
                                                       const float *const *xs, int NT, int64_t c0,
                                                       int64_t c1, int64_t n, float acc[4][3][8]) {
    __m256 a[4][3];
    DI_UNROLL
    for (int i = 0; i < NR; i++) {
        DI_UNROLL
        for (int j = 0; j < NT; j++) a[i][j] = _mm256_loadu_ps(acc[i][j]);
    }
    const int64_t full = c1 < (n & ~(int64_t)7) ? c1 : (n & ~(int64_t)7);
    int64_t c = c0;
    for (; c < full; c += 8) {
        __m256 xv[3];
        DI_UNROLL
        for (int j = 0; j < NT; j++) xv[j] = _mm256_loadu_ps(xs[j] + c);
        DI_UNROLL
        for (int i = 0; i < NR; i++) {
            __m256 wv = _mm256_load_ps(w + i * ws + (c - c0));
            DI_UNROLL
            for (int j = 0; j < NT; j++) a[i][j] = _mm256_fmadd_ps(wv, xv[j], a[i][j]);
        }
    }
    if (c < c1) { // the last partial chunk of the row: x masked, w zero-padded by decode
        int rem = (int)(n - c);
        __m256i mask =
            _mm256_cmpgt_epi32(_mm256_set1_epi32(rem), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
        __m256 xv[3];
        DI_UNROLL
        for (int j = 0; j < NT; j++) xv[j] = _mm256_maskload_ps(xs[j] + c, mask);
        DI_UNROLL
        for (int i = 0; i < NR; i++) {
            __m256 wv = _mm256_load_ps(w + i * ws + (c - c0));
            DI_UNROLL
            for (int j = 0; j < NT; j++) a[i][j] = _mm256_fmadd_ps(wv, xv[j], a[i][j]);
        }
    }
    acc_store(NR, NT, a, acc);
}

void di_gemm_avx2_tile(const float *w, int64_t w_stride, int nr, const float *const *xs, int nt,
                       int64_t c0, int64_t c1, int64_t n, float acc[4][3][8]) {
    for (int i = 0; i < nr; i++) READS(w + i * w_stride, sizeof(float) * up8(c1 - c0));
    for (int j = 0; j < nt; j++)
        READS(xs[j] + c0, sizeof(float) * ((c0 + up8(c1 - c0) < n ? c0 + up8(c1 - c0) : n) - c0));
    touches_acc(acc, nr, nt);
#define T(R, N)                                                                                    \
    case (R)*4 + (N):                                                                              \
        tile(w, w_stride, R, xs, N, c0, c1, n, acc);                                               \
        return;
    switch (nr * 4 + nt) {
        T(1, 1)
        T(1, 2) T(1, 3) T(2, 1) T(2, 2) T(2, 3) T(3, 1) T(3, 2) T(3, 3) T(4, 1) T(4, 2) T(4, 3)
    }
#undef T
    DI_ASSERT(!"tile shape out of range");
}

// A whole-row tile that starts from zero and writes its sums straight to y (no accumulator
// round trip through memory): row i of token j goes to y[j * y_stride + i]. The horizontal sum
// is reduce8's order, ((a0+a4)+(a1+a5)) + ((a2+a6)+(a3+a7)), so the bits equal those of
// di_gemm_avx2_tile over [0, n) from zeroed accumulators followed by reduce8.
static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1)); // a_i + a_i+4
    __m128 h = _mm_hadd_ps(s, s);                            // (s0+s1, s2+s3, ...)
    return _mm_cvtss_f32(_mm_add_ss(h, _mm_movehdup_ps(h))); // (s0+s1) + (s2+s3)
}

// The reduce8 sums of NR x NT accumulators to y[j * y_stride + i] (row i, token j).
static inline __attribute__((always_inline)) void sums_store(int NR, int NT, __m256 a[4][3],
                                                             float *y, int64_t y_stride) {
    if (NR == 4) { // four rows of a token at once: three hadds give reduce8's order per row
        DI_UNROLL
        for (int j = 0; j < NT; j++) {
            __m128 s[4];
            DI_UNROLL
            for (int i = 0; i < 4; i++)
                s[i] =
                    _mm_add_ps(_mm256_castps256_ps128(a[i][j]), _mm256_extractf128_ps(a[i][j], 1));
            __m128 h01 = _mm_hadd_ps(s[0], s[1]); // (s0_0+s0_1, s0_2+s0_3, s1_0+s1_1, s1_2+s1_3)
            __m128 h23 = _mm_hadd_ps(s[2], s[3]);
            _mm_storeu_ps(y + j * y_stride, _mm_hadd_ps(h01, h23));
        }
        return;
    }
    DI_UNROLL
    for (int i = 0; i < NR; i++) {
        DI_UNROLL
        for (int j = 0; j < NT; j++) y[j * y_stride + i] = hsum8(a[i][j]);
    }
}

// NR rows x NT tokens over columns [c0, c1) of decoded rows (w: column 0), continuing the
// accumulators st (from zero when c0 == 0); when c1 == n the reduce8 sums go to
// y[j * y_stride + i], else the accumulators back to st (the same bits: each output's 8 lanes
// still run over the columns in order).
static inline __attribute__((always_inline)) void tile_k(const float *w, int64_t ws, int NR,
                                                         const float *const *xs, int NT, int64_t c0,
                                                         int64_t c1, int64_t n, __m256 st[4][3],
                                                         float *y, int64_t y_stride) {
    __m256 a[4][3];
    DI_UNROLL
    for (int i = 0; i < NR; i++) {
        DI_UNROLL
        for (int j = 0; j < NT; j++) a[i][j] = c0 == 0 ? _mm256_setzero_ps() : st[i][j];
    }
    const int64_t full = c1 & ~(int64_t)7;
    int64_t c = c0;
    for (; c < full; c += 8) {
        __m256 xv[3];
        DI_UNROLL
        for (int j = 0; j < NT; j++) xv[j] = _mm256_loadu_ps(xs[j] + c);
        DI_UNROLL
        for (int i = 0; i < NR; i++) {
            __m256 wv = _mm256_load_ps(w + i * ws + c);
            DI_UNROLL
            for (int j = 0; j < NT; j++) a[i][j] = _mm256_fmadd_ps(wv, xv[j], a[i][j]);
        }
    }
    if (c < c1) { // the last partial chunk (c1 == n): x masked, w zero-padded by the decoder
        int rem = (int)(c1 - c);
        __m256i mask =
            _mm256_cmpgt_epi32(_mm256_set1_epi32(rem), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
        __m256 xv[3];
        DI_UNROLL
        for (int j = 0; j < NT; j++) xv[j] = _mm256_maskload_ps(xs[j] + c, mask);
        DI_UNROLL
        for (int i = 0; i < NR; i++) {
            __m256 wv = _mm256_load_ps(w + i * ws + c);
            DI_UNROLL
            for (int j = 0; j < NT; j++) a[i][j] = _mm256_fmadd_ps(wv, xv[j], a[i][j]);
        }
    }
    if (c1 == n) {
        sums_store(NR, NT, a, y, y_stride);
        return;
    }
    DI_UNROLL
    for (int i = 0; i < NR; i++) {
        DI_UNROLL
        for (int j = 0; j < NT; j++) st[i][j] = a[i][j];
    }
}

void di_gemm_avx2_tile_k(const float *w, int64_t w_stride, int nr, const float *x, int64_t x_stride,
                         int nt, int64_t c0, int64_t c1, int64_t n, void *st, float *y,
                         int64_t y_stride) {
    for (int i = 0; i < nr; i++) READS(w + i * w_stride + c0, sizeof(float) * up8(c1 - c0));
    for (int j = 0; j < nt; j++) READS(x + j * x_stride + c0, sizeof(float) * (size_t)(c1 - c0));
    if (c1 == n) writes_y(y, y_stride, nr, nt);
    const float *xs[3];
    for (int j = 0; j < nt; j++) xs[j] = x + j * x_stride;
#define T(R, N)                                                                                    \
    case (R)*4 + (N):                                                                              \
        tile_k(w, w_stride, R, xs, N, c0, c1, n, (__m256(*)[3])st, y, y_stride);                   \
        return;
#define T3(R) T(R, 1) T(R, 2) T(R, 3)
    switch (nr * 4 + nt) {
        T3(1)
        T3(2)
        T3(3)
        T3(4)
    }
#undef T3
#undef T
    DI_ASSERT(!"tile shape out of range");
}

// ---- fused GEMV: decode in registers, no staging (at most 3 tokens) ----

// The same per-element arithmetic and accumulation order as decode + tile (exact dequantised
// weight, one FMA per 8 columns in column order), so the two paths give the same bits.
static inline __attribute__((always_inline)) void gemv_fp8(const di_tensor *w, int64_t r0, int NR,
                                                           const float *const *xs, int NT,
                                                           float acc[4][3][8]) {
    const int64_t n = w->ne[0], bi = w->block_in;
    const uint8_t *rows[4], *srows[4];
    __m256 a[4][3];
    gemv_begin(w, r0, NR, NT, acc, rows, a);
    const size_t pf = di_gemm_pf_next_group(w);
    DI_UNROLL
    for (int i = 0; i < NR; i++)
        srows[i] = w->scale + (size_t)((w->row0 + r0 + i) / w->block_out) * w->scale_nb1;
    for (int64_t blk = 0, c0 = 0; c0 < n; blk++, c0 += bi) {
        const int64_t c1 = c0 + bi < n ? c0 + bi : n;
        scale8 s[4];
        DI_UNROLL
        for (int i = 0; i < NR; i++) s[i] = fp8_scale(srows[i][blk]);
        for (int64_t c = c0; c < c1; c += 16) {
            DI_UNROLL
            for (int i = 0; i < NR; i++) {
                _mm_prefetch((const char *)rows[i] + c + pf, _MM_HINT_T0);
                __m256 lo, hi;
                fp8x16(rows[i] + c, &lo, &hi);
                lo = _mm256_mul_ps(_mm256_mul_ps(lo, s[i].a), s[i].b);
                hi = _mm256_mul_ps(_mm256_mul_ps(hi, s[i].a), s[i].b);
                DI_UNROLL
                for (int j = 0; j < NT; j++) {
                    a[i][j] = _mm256_fmadd_ps(lo, _mm256_loadu_ps(xs[j] + c), a[i][j]);
                    a[i][j] = _mm256_fmadd_ps(hi, _mm256_loadu_ps(xs[j] + c + 8), a[i][j]);
                }
            }
        }
    }
    acc_store(NR, NT, a, acc);
}

static inline __attribute__((always_inline)) void gemv_fp4(const di_tensor *w, int64_t r0, int NR,
                                                           const float *const *xs, int NT,
                                                           float acc[4][3][8]) {
    const int64_t n = w->ne[0], bi = w->block_in;
    const uint8_t *rows[4], *srows[4];
    const __m128i lut = fp4_lut(), m4 = _mm_set1_epi8(0x0F), z = _mm_setzero_si128();
    __m256 a[4][3];
    gemv_begin(w, r0, NR, NT, acc, rows, a);
    const size_t pf = di_gemm_pf_next_group(w);
    DI_UNROLL
    for (int i = 0; i < NR; i++)
        srows[i] = w->scale + (size_t)((w->row0 + r0 + i) / w->block_out) * w->scale_nb1;
    for (int64_t blk = 0, c0 = 0; c0 < n; blk++, c0 += bi) {
        const int64_t c1 = c0 + bi < n ? c0 + bi : n;
        DI_UNROLL
        for (int i = 0; i < NR; i++) {
            const __m256 s = _mm256_set1_ps(di_ue8m0_to_f32(srows[i][blk]));
            for (int64_t c = c0; c < c1; c += 32) {
                _mm_prefetch((const char *)rows[i] + c / 2 + pf, _MM_HINT_T0);
                __m128i v = _mm_loadu_si128((const __m128i *)(rows[i] + c / 2));
                __m128i lo = _mm_and_si128(v, m4), hi = _mm_and_si128(_mm_srli_epi16(v, 4), m4);
                __m128i h0 = _mm_shuffle_epi8(lut, _mm_unpacklo_epi8(lo, hi)); // columns 0..15
                __m128i h1 = _mm_shuffle_epi8(lut, _mm_unpackhi_epi8(lo, hi)); // 16..31
                __m256 q[4] = {_mm256_cvtph_ps(_mm_unpacklo_epi8(z, h0)),
                               _mm256_cvtph_ps(_mm_unpackhi_epi8(z, h0)),
                               _mm256_cvtph_ps(_mm_unpacklo_epi8(z, h1)),
                               _mm256_cvtph_ps(_mm_unpackhi_epi8(z, h1))};
                DI_UNROLL
                for (int k = 0; k < 4; k++) {
                    __m256 wv = _mm256_mul_ps(q[k], s);
                    DI_UNROLL
                    for (int j = 0; j < NT; j++)
                        a[i][j] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(xs[j] + c + 8 * k), a[i][j]);
                }
            }
        }
    }
    acc_store(NR, NT, a, acc);
}

static inline __attribute__((always_inline)) void gemv_bf16(const di_tensor *w, int64_t r0, int NR,
                                                            const float *const *xs, int NT,
                                                            float acc[4][3][8]) {
    const int64_t n = w->ne[0];
    const uint8_t *rows[4];
    __m256 a[4][3];
    gemv_begin(w, r0, NR, NT, acc, rows, a);
    const size_t pf = di_gemm_pf_next_group(w);
    for (int64_t c = 0; c < n; c += 8) {
        DI_UNROLL
        for (int i = 0; i < NR; i++) {
            if ((c & 31) == 0) _mm_prefetch((const char *)rows[i] + 2 * c + pf, _MM_HINT_T0);
            __m256i v = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(rows[i] + 2 * c)));
            __m256 wv = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
            DI_UNROLL
            for (int j = 0; j < NT; j++)
                a[i][j] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(xs[j] + c), a[i][j]);
        }
    }
    acc_store(NR, NT, a, acc);
}

// Q2_K and IQ2_XXS: one 256-column block of a row at a time, decoded in registers chunk by chunk.
#define GEMV_BLOCK256(NAME, BB, BLOCK_MACRO)                                                       \
    static inline __attribute__((always_inline)) void NAME(const di_tensor *w, int64_t r0, int NR, \
                                                           const float *const *xs, int NT,         \
                                                           float acc[4][3][8]) {                   \
        const int64_t n = w->ne[0];                                                                \
        const size_t pf = di_gemm_pf_next_group(w);                                                \
        const uint8_t *rows[4];                                                                    \
        __m256 a[4][3];                                                                            \
        DI_UNROLL                                                                                  \
        for (int i = 0; i < NR; i++) {                                                             \
            rows[i] = (const uint8_t *)w->data + (size_t)(r0 + i) * w->nb1;                        \
            DI_UNROLL                                                                              \
            for (int j = 0; j < NT; j++) a[i][j] = _mm256_loadu_ps(acc[i][j]);                     \
        }                                                                                          \
        for (int64_t c = 0; c < n; c += 256) {                                                     \
            DI_UNROLL                                                                              \
            for (int i = 0; i < NR; i++) {                                                         \
                const uint8_t *blk = rows[i] + (size_t)(c / 256) * (BB);                           \
                _mm_prefetch((const char *)blk + pf, _MM_HINT_T0);                                 \
                _mm_prefetch((const char *)blk + pf + 64, _MM_HINT_T0);                            \
                BLOCK_MACRO(blk, FMA_BODY);                                                        \
            }                                                                                      \
        }                                                                                          \
        DI_UNROLL                                                                                  \
        for (int i = 0; i < NR; i++) {                                                             \
            DI_UNROLL                                                                              \
            for (int j = 0; j < NT; j++) _mm256_storeu_ps(acc[i][j], a[i][j]);                     \
        }                                                                                          \
    }
#define FMA_BODY(k, w8)                                                                            \
    DI_UNROLL                                                                                      \
    for (int j = 0; j < NT; j++)                                                                   \
    a[i][j] = _mm256_fmadd_ps(w8, _mm256_loadu_ps(xs[j] + c + 8 * (k)), a[i][j])
GEMV_BLOCK256(gemv_q2_k, 84, Q2K_BLOCK)
GEMV_BLOCK256(gemv_iq2_xxs, 66, IQ2XXS_BLOCK)
#undef FMA_BODY
#undef GEMV_BLOCK256

bool di_gemm_avx2_gemv_ok(const di_tensor *w) {
    const int64_t n = w->ne[0];
    switch (w->kind) {
    case DI_TENSOR_KIND_FP8:
        return w->block_in % 16 == 0 && n % 16 == 0;
    case DI_TENSOR_KIND_FP4:
        return w->block_in % 32 == 0 && n % 32 == 0;
    case DI_TENSOR_KIND_BF16:
        return n % 8 == 0;
    case DI_TENSOR_KIND_Q2_K: // rows are whole blocks by construction
    case DI_TENSOR_KIND_IQ2_XXS:
        return true;
    default:
        return false;
    }
}

void di_gemm_avx2_gemv(const di_tensor *w, int64_t r0, int nr, const float *const *xs, int nt,
                       float acc[4][3][8]) {
    reads_w_rows(w, r0, nr);
    reads_each((const void *const *)xs, nt, sizeof(float) * (size_t)w->ne[0]);
    touches_acc(acc, nr, nt);
#define G(R, N)                                                                                    \
    case (R)*4 + (N):                                                                              \
        if (w->kind == DI_TENSOR_KIND_FP8)                                                         \
            gemv_fp8(w, r0, R, xs, N, acc);                                                        \
        else if (w->kind == DI_TENSOR_KIND_FP4)                                                    \
            gemv_fp4(w, r0, R, xs, N, acc);                                                        \
        else if (w->kind == DI_TENSOR_KIND_Q2_K)                                                   \
            gemv_q2_k(w, r0, R, xs, N, acc);                                                       \
        else if (w->kind == DI_TENSOR_KIND_IQ2_XXS)                                                \
            gemv_iq2_xxs(w, r0, R, xs, N, acc);                                                    \
        else                                                                                       \
            gemv_bf16(w, r0, R, xs, N, acc);                                                       \
        return;
    switch (nr * 4 + nt) {
        G(1, 1)
        G(1, 2) G(1, 3) G(2, 1) G(2, 2) G(2, 3) G(3, 1) G(3, 2) G(3, 3) G(4, 1) G(4, 2) G(4, 3)
    }
#undef G
    DI_ASSERT(!"gemv shape out of range");
}

// ---- 8-bit activations: quantisation and the integer GEMV (Q8_0, MXFP4) ----

// di_quant_act_q8's bits: the same amax (max is exact in any order), the same scalar d and id,
// then per value the same two float operations (x * id, + copysign(0.5 - 2^-25)) and truncation.
void di_gemm_avx2_quant_act(const float *x, int64_t n, int8_t *q, float *d) {
    READS(x, sizeof(float) * (size_t)n);
    WRITES(q, (size_t)n);
    WRITES(d, sizeof(float) * (size_t)(n / 32));
    const __m256 sign = _mm256_set1_ps(-0.0f), half = _mm256_set1_ps(0x1.fffffep-2f);
    const __m256i perm = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    for (int64_t b = 0; b < n / 32; b++) {
        const float *v = x + 32 * b;
        __m256 xv[4], m = _mm256_setzero_ps();
        DI_UNROLL
        for (int k = 0; k < 4; k++) {
            xv[k] = _mm256_loadu_ps(v + 8 * k);
            m = _mm256_max_ps(m, _mm256_andnot_ps(sign, xv[k]));
        }
        __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
        m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
        const float dr = _mm_cvtss_f32(m4) / 127.0f;
        d[b] = di_f16_to_f32(di_f32_to_f16(dr));
        const __m256 id = _mm256_set1_ps(d[b] != 0 ? 1.0f / dr : 0.0f);
        __m256i qi[4];
        DI_UNROLL
        for (int k = 0; k < 4; k++) {
            __m256 s = _mm256_mul_ps(xv[k], id);
            __m256 r = _mm256_add_ps(s, _mm256_or_ps(_mm256_and_ps(s, sign), half));
            qi[k] = _mm256_cvttps_epi32(r);
        }
        // |q| <= 127: the packs never saturate. packs interleave 128-bit lanes; perm undoes it.
        __m256i p =
            _mm256_packs_epi16(_mm256_packs_epi32(qi[0], qi[1]), _mm256_packs_epi32(qi[2], qi[3]));
        _mm256_storeu_si256((__m256i *)(q + 32 * b), _mm256_permutevar8x32_epi32(p, perm));
    }
}

// MXFP4's doubled e2m1 codes as int8 through a pshufb table (ggml's kvalues_mxfp4).
static inline __m128i mxfp4_lut(void) {
    return _mm_setr_epi8(0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12);
}

// di_mxfp4_scale's bits for every exponent byte: one broadcast load per block instead of a branch,
// shift and move (the scale was a fifth of the MXFP4 GEMV's instructions).
#define MX_S(e)                                                                                    \
    ((e) < 2 ? 0x00200000u << ((e)&1)                                                              \
             : (uint32_t)((e)-1) << 23) // &1: no shift past 31 in the unused arm
#define MX_S4(e) MX_S(e), MX_S((e) + 1), MX_S((e) + 2), MX_S((e) + 3)
#define MX_S16(e) MX_S4(e), MX_S4((e) + 4), MX_S4((e) + 8), MX_S4((e) + 12)
#define MX_S64(e) MX_S16(e), MX_S16((e) + 16), MX_S16((e) + 32), MX_S16((e) + 48)
const uint32_t di_gemm_mxfp4_scale_bits[256] = {MX_S64(0), MX_S64(64), MX_S64(128), MX_S64(192)};
#undef MX_S64
#undef MX_S16
#undef MX_S4
#undef MX_S

// Where a kernel reads the weights: Q8_0 or MXFP4 blocks in place, or codes and scales already
// decoded to rows of int8 and floats (di_gemm_avx2_codes).
typedef enum src_kind { SRC_Q8_0, SRC_MXFP4, SRC_CODES } src_kind;

typedef struct int8_src {
    const uint8_t *rows[4]; // row i's blocks, or its codes (SRC_CODES)
    const float *d[4];      // SRC_CODES: row i's scales
    size_t pf;              // in place: bytes ahead to prefetch (the next group of 4 rows)
} int8_src;

// Block b of row i: its 32 weight codes in column order and its scale. Q8_0: the int8 values and
// the f16 d (F16C converts exactly); MXFP4: low nibbles are columns 0..15, high nibbles 16..31.
static inline __attribute__((always_inline)) __m256i
int8_block(src_kind sk, const int8_src *src, int i, int64_t b, __m128i lut, float *dw) {
    if (sk == SRC_CODES) {
        *dw = src->d[i][b];
        return _mm256_load_si256((const __m256i *)(src->rows[i] + 32 * b));
    }
    if (sk == SRC_Q8_0) {
        const uint8_t *blk = src->rows[i] + 34 * b;
        _mm_prefetch((const char *)blk + src->pf, _MM_HINT_T0);
        uint16_t h;
        memcpy(&h, blk, 2);
        *dw = _cvtsh_ss(h);
        return _mm256_loadu_si256((const __m256i *)(blk + 2));
    }
    const uint8_t *blk = src->rows[i] + 17 * b;
    _mm_prefetch((const char *)blk + src->pf, _MM_HINT_T0);
    memcpy(dw, &di_gemm_mxfp4_scale_bits[blk[0]], 4);
    const __m128i v = _mm_loadu_si128((const __m128i *)(blk + 1)), m4 = _mm_set1_epi8(0x0F);
    const __m128i lo = _mm_shuffle_epi8(lut, _mm_and_si128(v, m4));
    const __m128i hi = _mm_shuffle_epi8(lut, _mm_and_si128(_mm_srli_epi16(v, 4), m4));
    return _mm256_inserti128_si256(_mm256_castsi128_si256(lo), hi, 1);
}

// Two consecutive MXFP4 blocks (34 bytes at blk) as codes in column order and scales.
static inline __attribute__((always_inline)) void
mxfp4_pair(const uint8_t *blk, size_t pf, __m128i lut, __m256i w[2], __m256 d[2]) {
    _mm_prefetch((const char *)blk + pf, _MM_HINT_T0);
    const __m256i l2 = _mm256_broadcastsi128_si256(lut), m4 = _mm256_set1_epi8(0x0F);
    const __m256i v = _mm256_loadu2_m128i((const __m128i *)(blk + 18), (const __m128i *)(blk + 1));
    const __m256i lo = _mm256_shuffle_epi8(l2, _mm256_and_si256(v, m4)); // columns 0..15 of each
    const __m256i hi = _mm256_shuffle_epi8(l2, _mm256_and_si256(_mm256_srli_epi16(v, 4), m4));
    w[0] = _mm256_permute2x128_si256(lo, hi, 0x20);
    w[1] = _mm256_permute2x128_si256(lo, hi, 0x31);
    d[0] = _mm256_castsi256_ps(_mm256_set1_epi32((int)di_gemm_mxfp4_scale_bits[blk[0]]));
    d[1] = _mm256_castsi256_ps(_mm256_set1_epi32((int)di_gemm_mxfp4_scale_bits[blk[17]]));
}

// NR rows x NT tokens, whole rows, sums to y (di_ref_dot_q8's bits). Per block of 32: |w| and
// x * sign(w) (vpsignb; |w| <= 128 and |x| <= 127 keep vpmaddubsw's pair sums within int16),
// vpmaddubsw + vpmaddwd give lane l the exact sum of columns 4l..4l+3, converted exactly to f32
// (|sum| <= 4 * 128 * 127 < 2^24) and added by one FMA with dw * dx, as di_ref_dot_q8's fmaf.
static inline __attribute__((always_inline)) void
gemv_int8(src_kind sk, const int8_src *src, int64_t n, int NR, const int8_t *const *xq,
          const float *const *xd, int NT, float *y, int64_t y_stride) {
    const __m128i lut = mxfp4_lut();
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 a[4][3];
    DI_UNROLL
    for (int i = 0; i < NR; i++) {
        DI_UNROLL
        for (int j = 0; j < NT; j++) a[i][j] = _mm256_setzero_ps();
    }
    int64_t b = 0;
    if (sk == SRC_MXFP4) // two blocks per step: one 256-bit nibble split and table lookup for both
        for (; b + 2 <= n / 32; b += 2) {
            __m256i xv[2][3];
            __m256 dx[2][3];
            DI_UNROLL
            for (int j = 0; j < NT; j++) {
                DI_UNROLL
                for (int h = 0; h < 2; h++) {
                    xv[h][j] = _mm256_load_si256((const __m256i *)(xq[j] + 32 * (b + h)));
                    dx[h][j] = _mm256_broadcast_ss(xd[j] + b + h);
                }
            }
            DI_UNROLL
            for (int i = 0; i < NR; i++) {
                __m256i wv[2];
                __m256 dwv[2];
                mxfp4_pair(src->rows[i] + 17 * b, src->pf, lut, wv, dwv);
                DI_UNROLL
                for (int h = 0; h < 2; h++) { // block b, then b + 1: the reference's order
                    const __m256i aw = _mm256_sign_epi8(wv[h], wv[h]);
                    DI_UNROLL
                    for (int j = 0; j < NT; j++) {
                        __m256i p = _mm256_maddubs_epi16(aw, _mm256_sign_epi8(xv[h][j], wv[h]));
                        __m256 s = _mm256_cvtepi32_ps(_mm256_madd_epi16(p, ones));
                        a[i][j] = _mm256_fmadd_ps(_mm256_mul_ps(dwv[h], dx[h][j]), s, a[i][j]);
                    }
                }
            }
        }
    for (; b < n / 32; b++) {
        __m256i xv[3];
        __m256 dx[3];
        DI_UNROLL
        for (int j = 0; j < NT; j++) {
            xv[j] = _mm256_load_si256((const __m256i *)(xq[j] + 32 * b));
            dx[j] = _mm256_broadcast_ss(xd[j] + b);
        }
        DI_UNROLL
        for (int i = 0; i < NR; i++) {
            float dw;
            const __m256i wv = int8_block(sk, src, i, b, lut, &dw);
            const __m256i aw = _mm256_sign_epi8(wv, wv);
            const __m256 dwv = _mm256_set1_ps(dw);
            DI_UNROLL
            for (int j = 0; j < NT; j++) {
                __m256i p = _mm256_maddubs_epi16(aw, _mm256_sign_epi8(xv[j], wv));
                __m256 s = _mm256_cvtepi32_ps(_mm256_madd_epi16(p, ones));
                a[i][j] = _mm256_fmadd_ps(_mm256_mul_ps(dwv, dx[j]), s, a[i][j]);
            }
        }
    }
    sums_store(NR, NT, a, y, y_stride);
}

#define INT8_SHAPES(G)                                                                             \
    switch (nr * 4 + nt) {                                                                         \
        G(1, 1)                                                                                    \
        G(1, 2) G(1, 3) G(2, 1) G(2, 2) G(2, 3) G(3, 1) G(3, 2) G(3, 3) G(4, 1) G(4, 2) G(4, 3)    \
    }                                                                                              \
    DI_ASSERT(!"gemv shape out of range");

void di_gemm_avx2_gemv_int8(const di_tensor *w, int64_t r0, int nr, const int8_t *const *xq,
                            const float *const *xd, int nt, float *y, int64_t y_stride) {
    const bool mx = w->kind == DI_TENSOR_KIND_MXFP4;
    DI_ASSERT(mx || w->kind == DI_TENSOR_KIND_Q8_0);
    reads_w_rows(w, r0, nr);
    reads_each((const void *const *)xq, nt, (size_t)w->ne[0]);
    reads_each((const void *const *)xd, nt, sizeof(float) * (size_t)(w->ne[0] / 32));
    writes_y(y, y_stride, nr, nt);
    int8_src src;
    for (int i = 0; i < nr; i++) src.rows[i] = (const uint8_t *)w->data + (size_t)(r0 + i) * w->nb1;
    src.pf = di_gemm_pf_next_group(w);
#define G(R, N)                                                                                    \
    case (R)*4 + (N):                                                                              \
        if (mx)                                                                                    \
            gemv_int8(SRC_MXFP4, &src, w->ne[0], R, xq, xd, N, y, y_stride);                       \
        else                                                                                       \
            gemv_int8(SRC_Q8_0, &src, w->ne[0], R, xq, xd, N, y, y_stride);                        \
        return;
    INT8_SHAPES(G)
#undef G
}

void di_gemm_avx2_codes(const di_tensor *w, int64_t r0, int nr, int8_t *q, int64_t ldq, float *d,
                        int64_t ldd) {
    const bool mx = w->kind == DI_TENSOR_KIND_MXFP4;
    DI_ASSERT(mx || w->kind == DI_TENSOR_KIND_Q8_0);
    reads_w_rows(w, r0, nr);
    for (int i = 0; i < nr; i++) {
        WRITES(q + i * ldq, (size_t)w->ne[0]);
        WRITES(d + i * ldd, sizeof(float) * (size_t)(w->ne[0] / 32));
    }
    const __m128i lut = mxfp4_lut();
    for (int i = 0; i < nr; i++) {
        int8_src src;
        src.rows[0] = (const uint8_t *)w->data + (size_t)(r0 + i) * w->nb1;
        src.pf = di_gemm_pf_next_group(w);
        for (int64_t b = 0; b < w->ne[0] / 32; b++) {
            __m256i v = int8_block(mx ? SRC_MXFP4 : SRC_Q8_0, &src, 0, b, lut, d + i * ldd + b);
            _mm256_store_si256((__m256i *)(q + i * ldq + 32 * b), v);
        }
    }
}

void di_gemm_avx2_gemv_codes(const int8_t *q, int64_t ldq, const float *d, int64_t ldd, int64_t n,
                             int nr, const int8_t *const *xq, const float *const *xd, int nt,
                             float *y, int64_t y_stride) {
    for (int i = 0; i < nr; i++) {
        READS(q + i * ldq, (size_t)n);
        READS(d + i * ldd, sizeof(float) * (size_t)(n / 32));
    }
    reads_each((const void *const *)xq, nt, (size_t)n);
    reads_each((const void *const *)xd, nt, sizeof(float) * (size_t)(n / 32));
    writes_y(y, y_stride, nr, nt);
    int8_src src;
    for (int i = 0; i < nr; i++) {
        src.rows[i] = (const uint8_t *)(q + i * ldq);
        src.d[i] = d + i * ldd;
    }
#define G(R, N)                                                                                    \
    case (R)*4 + (N):                                                                              \
        gemv_int8(SRC_CODES, &src, n, R, xq, xd, N, y, y_stride);                                  \
        return;
    INT8_SHAPES(G)
#undef G
}
#undef INT8_SHAPES

// ---- 8-bit activations in blocks of 256: Q4_K ----

// di_quant_act_q8_k's bits: the same first value of largest magnitude (found by a scalar scan for
// the vector maximum), the same scalar -127 / mx, per value the same product rounded to nearest
// even (vroundps) and clamped at 127, the same integer sums.
void di_gemm_avx2_quant_act_q8_k(const float *x, int64_t n, int8_t *q, float *d, int16_t *bsums) {
    READS(x, sizeof(float) * (size_t)n);
    WRITES(q, (size_t)n);
    WRITES(d, sizeof(float) * (size_t)(n / 256));
    WRITES(bsums, sizeof(int16_t) * (size_t)(n / 16));
    const __m256 sign = _mm256_set1_ps(-0.0f), top = _mm256_set1_ps(127.0f);
    const __m256i perm = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    for (int64_t b = 0; b < n / 256; b++) {
        const float *v = x + 256 * b;
        int8_t *qb = q + 256 * b;
        __m256 m = _mm256_setzero_ps();
        for (int k = 0; k < 32; k++)
            m = _mm256_max_ps(m, _mm256_andnot_ps(sign, _mm256_loadu_ps(v + 8 * k)));
        __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
        m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
        const float amax = _mm_cvtss_f32(m4);
        if (amax == 0) {
            d[b] = 0;
            memset(qb, 0, 256);
            memset(bsums + 16 * b, 0, 16 * sizeof(int16_t));
            continue;
        }
        int j = 0;
        while (fabsf(v[j]) != amax) j++;
        const float is = -127.0f / v[j];
        const __m256 isv = _mm256_set1_ps(is);
        DI_UNROLL
        for (int k = 0; k < 8; k++) {
            __m256i qi[4];
            DI_UNROLL
            for (int u = 0; u < 4; u++) {
                __m256 r = _mm256_round_ps(_mm256_mul_ps(isv, _mm256_loadu_ps(v + 32 * k + 8 * u)),
                                           _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
                qi[u] = _mm256_cvttps_epi32(_mm256_min_ps(r, top));
            }
            __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(qi[0], qi[1]),
                                           _mm256_packs_epi32(qi[2], qi[3]));
            _mm256_storeu_si256((__m256i *)(qb + 32 * k), _mm256_permutevar8x32_epi32(p, perm));
        }
        for (int k = 0; k < 16; k++) {
            int s = 0;
            for (int i = 0; i < 16; i++) s += qb[16 * k + i];
            bsums[16 * b + k] = (int16_t)s;
        }
        d[b] = 1.0f / is;
    }
}

// NR Q4_K rows x NT tokens, whole rows, sums to y (di_ref_dot_q4_k's bits). Per block and row: the
// nibbles of sub-blocks 2p (low) and 2p+1 (high) times the token's codes by vpmaddubsw (unsigned
// nibble x signed code: pair sums <= 2 * 15 * 127, no saturation), times the sub-block scale by
// vpmaddwd: lane l gets the scaled sum of the sub-block's columns 4l..4l+3, summed over the eight
// sub-blocks in int32 (exact in any order); then the reference's FMAs.
static inline __attribute__((always_inline)) void
gemv_q4_k8(const di_tensor *w, int64_t r0, int NR, const int8_t *const *xq, const float *const *xd,
           const int16_t *const *xs, int NT, float *y, int64_t y_stride) {
    const uint8_t *rows[4];
    const size_t pf = di_gemm_pf_next_group(w);
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    __m256 a[4][3];
    DI_UNROLL
    for (int i = 0; i < NR; i++) {
        rows[i] = (const uint8_t *)w->data + (size_t)(r0 + i) * w->nb1;
        DI_UNROLL
        for (int j = 0; j < NT; j++) a[i][j] = _mm256_setzero_ps();
    }
    for (int64_t b = 0; b < w->ne[0] / 256; b++) {
        DI_UNROLL
        for (int i = 0; i < NR; i++) {
            const uint8_t *blk = rows[i] + 144 * b;
            _mm_prefetch((const char *)blk + pf, _MM_HINT_T0);
            _mm_prefetch((const char *)blk + pf + 64, _MM_HINT_T0);
            _mm_prefetch((const char *)blk + pf + 128, _MM_HINT_T0);
            uint8_t sc[8], mn[8];
            DI_UNROLL
            for (int j = 0; j < 8; j++) di_q4_k_scale_min(j, blk + 4, &sc[j], &mn[j]);
            __m256i s[3];
            DI_UNROLL
            for (int t = 0; t < NT; t++) s[t] = _mm256_setzero_si256();
            DI_UNROLL
            for (int p = 0; p < 4; p++) {
                const __m256i v = _mm256_loadu_si256((const __m256i *)(blk + 16 + 32 * p));
                const __m256i lo = _mm256_and_si256(v, m4);
                const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
                const __m256i s0 = _mm256_set1_epi16(sc[2 * p]),
                              s1 = _mm256_set1_epi16(sc[2 * p + 1]);
                DI_UNROLL
                for (int t = 0; t < NT; t++) {
                    const int8_t *xb = xq[t] + 256 * b + 64 * p;
                    __m256i p0 = _mm256_maddubs_epi16(lo, _mm256_load_si256((const __m256i *)xb));
                    __m256i p1 =
                        _mm256_maddubs_epi16(hi, _mm256_load_si256((const __m256i *)(xb + 32)));
                    s[t] = _mm256_add_epi32(s[t], _mm256_add_epi32(_mm256_madd_epi16(p0, s0),
                                                                   _mm256_madd_epi16(p1, s1)));
                }
            }
            uint16_t h[2];
            memcpy(h, blk, 4);
            const float dw = _cvtsh_ss(h[0]), dmin = _cvtsh_ss(h[1]);
            // Lane l of vpmaddwd(mins duplicated, bsums) is m_l * (bsums[2l] + bsums[2l+1]).
            const __m128i m8 = _mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i *)mn));
            const __m256i mins =
                _mm256_set_m128i(_mm_unpackhi_epi16(m8, m8), _mm_unpacklo_epi16(m8, m8));
            DI_UNROLL
            for (int t = 0; t < NT; t++) {
                const __m256i ms =
                    _mm256_madd_epi16(mins, _mm256_loadu_si256((const __m256i *)(xs[t] + 16 * b)));
                const float dx = xd[t][b];
                a[i][t] =
                    _mm256_fmadd_ps(_mm256_set1_ps(dx * dw), _mm256_cvtepi32_ps(s[t]), a[i][t]);
                a[i][t] =
                    _mm256_fmadd_ps(_mm256_set1_ps(-(dx * dmin)), _mm256_cvtepi32_ps(ms), a[i][t]);
            }
        }
    }
    sums_store(NR, NT, a, y, y_stride);
}

void di_gemm_avx2_gemv_q4_k8(const di_tensor *w, int64_t r0, int nr, const int8_t *const *xq,
                             const float *const *xd, const int16_t *const *xs, int nt, float *y,
                             int64_t y_stride) {
    DI_ASSERT(w->kind == DI_TENSOR_KIND_Q4_K);
    reads_w_rows(w, r0, nr);
    reads_each((const void *const *)xq, nt, (size_t)w->ne[0]);
    reads_each((const void *const *)xd, nt, sizeof(float) * (size_t)(w->ne[0] / 256));
    reads_each((const void *const *)xs, nt, sizeof(int16_t) * (size_t)(w->ne[0] / 16));
    writes_y(y, y_stride, nr, nt);
#define G(R, N)                                                                                    \
    case (R)*4 + (N):                                                                              \
        gemv_q4_k8(w, r0, R, xq, xd, xs, N, y, y_stride);                                          \
        return;
    switch (nr * 4 + nt) {
        G(1, 1)
        G(1, 2) G(1, 3) G(2, 1) G(2, 2) G(2, 3) G(3, 1) G(3, 2) G(3, 3) G(4, 1) G(4, 2) G(4, 3)
    }
#undef G
    DI_ASSERT(!"gemv shape out of range");
}

// ---- the FMA peak probe (probe.c) ----

float di_gemm_avx2_fma_loop(int64_t iters) {
    __m256 a[12];
    const __m256 h = _mm256_set1_ps(0.5f), one = _mm256_set1_ps(1.0f);
    DI_UNROLL
    for (int i = 0; i < 12; i++) a[i] = _mm256_set1_ps((float)i);
    for (int64_t k = 0; k < iters; k++) {
        DI_UNROLL
        for (int i = 0; i < 12; i++) a[i] = _mm256_fmadd_ps(a[i], h, one);
    }
    float s = 0;
    DI_UNROLL
    for (int i = 0; i < 12; i++) s += _mm256_cvtss_f32(a[i]);
    return s;
}

#else // not built with AVX2: gemm.c never selects this level

float di_gemm_avx2_fma_loop(int64_t iters) {
    (void)iters;
    DI_ASSERT(!"AVX2 kernels not built");
    return 0;
}

bool di_gemm_avx2_gemv_ok(const di_tensor *w) {
    (void)w;
    return false;
}

void di_gemm_avx2_gemv(const di_tensor *w, int64_t r0, int nr, const float *const *xs, int nt,
                       float acc[4][3][8]) {
    (void)w, (void)r0, (void)nr, (void)xs, (void)nt, (void)acc;
    DI_ASSERT(!"AVX2 kernels not built");
}

bool di_gemm_avx2_built(void) {
    return false;
}

void di_gemm_avx2_quant_act(const float *x, int64_t n, int8_t *q, float *d) {
    (void)x, (void)n, (void)q, (void)d;
    DI_ASSERT(!"AVX2 kernels not built");
}

void di_gemm_avx2_gemv_int8(const di_tensor *w, int64_t r0, int nr, const int8_t *const *xq,
                            const float *const *xd, int nt, float *y, int64_t y_stride) {
    (void)w, (void)r0, (void)nr, (void)xq, (void)xd, (void)nt, (void)y, (void)y_stride;
    DI_ASSERT(!"AVX2 kernels not built");
}

void di_gemm_avx2_quant_act_q8_k(const float *x, int64_t n, int8_t *q, float *d, int16_t *bsums) {
    (void)x, (void)n, (void)q, (void)d, (void)bsums;
    DI_ASSERT(!"AVX2 kernels not built");
}

void di_gemm_avx2_gemv_q4_k8(const di_tensor *w, int64_t r0, int nr, const int8_t *const *xq,
                             const float *const *xd, const int16_t *const *xs, int nt, float *y,
                             int64_t y_stride) {
    (void)w, (void)r0, (void)nr, (void)xq, (void)xd, (void)xs, (void)nt, (void)y, (void)y_stride;
    DI_ASSERT(!"AVX2 kernels not built");
}

void di_gemm_avx2_codes(const di_tensor *w, int64_t r0, int nr, int8_t *q, int64_t ldq, float *d,
                        int64_t ldd) {
    (void)w, (void)r0, (void)nr, (void)q, (void)ldq, (void)d, (void)ldd;
    DI_ASSERT(!"AVX2 kernels not built");
}

void di_gemm_avx2_gemv_codes(const int8_t *q, int64_t ldq, const float *d, int64_t ldd, int64_t n,
                             int nr, const int8_t *const *xq, const float *const *xd, int nt,
                             float *y, int64_t y_stride) {
    (void)q, (void)ldq, (void)d, (void)ldd, (void)n, (void)nr, (void)xq, (void)xd, (void)nt,
        (void)y, (void)y_stride;
    DI_ASSERT(!"AVX2 kernels not built");
}

void di_gemm_avx2_decode(const di_tensor *w, int64_t r0, int nr, int64_t c0, int64_t c1, float *dst,
                         int64_t dst_stride) {
    (void)w, (void)r0, (void)nr, (void)c0, (void)c1, (void)dst, (void)dst_stride;
    DI_ASSERT(!"AVX2 kernels not built");
}

void di_gemm_avx2_tile_k(const float *w, int64_t w_stride, int nr, const float *x, int64_t x_stride,
                         int nt, int64_t c0, int64_t c1, int64_t n, void *st, float *y,
                         int64_t y_stride) {
    (void)w, (void)w_stride, (void)nr, (void)x, (void)x_stride, (void)nt, (void)c0, (void)c1,
        (void)n, (void)st, (void)y, (void)y_stride;
    DI_ASSERT(!"AVX2 kernels not built");
}

void di_gemm_avx2_tile(const float *w, int64_t w_stride, int nr, const float *const *xs, int nt,
                       int64_t c0, int64_t c1, int64_t n, float acc[4][3][8]) {
    (void)w, (void)w_stride, (void)nr, (void)xs, (void)nt, (void)c0, (void)c1, (void)n, (void)acc;
    DI_ASSERT(!"AVX2 kernels not built");
}

#endif
