// Tests for src/tensor/quant_ref: element conversions (exhaustive where the domain is small),
// rounding ties and boundaries, the known-answer vectors of spec §6.5, Q8/Q4 fake-quant, the
// Hadamard transform and row dequantisation.
#include "harness.h"

#include <float.h>
#include <stdint.h>

#include "tensor/quant_ref.h"

static uint32_t bits_of(float x) {
    uint32_t u;
    memcpy(&u, &x, sizeof u);
    return u;
}

static float from_bits(uint32_t u) {
    float x;
    memcpy(&x, &u, sizeof x);
    return x;
}

// Bit-exact float comparison (distinguishes -0 from +0); NaN equals any NaN.
static int same_float(float a, float b) {
    if (isnan(a) || isnan(b)) return isnan(a) && isnan(b);
    return bits_of(a) == bits_of(b);
}

#define CHECK_FEQ(a, b)                                                                            \
    do {                                                                                           \
        float fa_ = (a), fb_ = (b);                                                                \
        if (same_float(fa_, fb_)) {                                                                \
            g_checks_passed++;                                                                     \
        } else {                                                                                   \
            g_checks_failed++;                                                                     \
            fprintf(stderr, "%s:%d: CHECK_FEQ failed: %s = %.9g (0x%08x), %s = %.9g (0x%08x)\n",   \
                    __FILE__, __LINE__, #a, (double)fa_, (unsigned)bits_of(fa_), #b, (double)fb_,  \
                    (unsigned)bits_of(fb_));                                                       \
        }                                                                                          \
    } while (0)

// Spec §4.3 formula for an e4m3fn byte, computed independently of the library's table.
static float e4m3_formula(int c) {
    int s = (c >> 7) & 1, e = (c >> 3) & 15, f = c & 7;
    double mag = e == 0 ? f / 8.0 * ldexp(1.0, -6) : (1.0 + f / 8.0) * ldexp(1.0, e - 7);
    return (float)(s ? -mag : mag);
}

// ---- bf16 and f16 ----

static void test_bf16(void) {
    CHECK_EQ(di_f32_to_bf16(1.0f), 0x3F80);
    CHECK_EQ(di_f32_to_bf16(-2.0f), 0xC000);
    // Ties go to the even bf16 mantissa.
    CHECK_EQ(di_f32_to_bf16(from_bits(0x3F808000u)), 0x3F80); // tie, 0x3F80 even
    CHECK_EQ(di_f32_to_bf16(from_bits(0x3F818000u)), 0x3F82); // tie, 0x3F82 even
    CHECK_EQ(di_f32_to_bf16(from_bits(0x3F808001u)), 0x3F81); // just above the tie
    CHECK_EQ(di_f32_to_bf16(from_bits(0x3F807FFFu)), 0x3F80); // just below the tie
    CHECK_EQ(di_f32_to_bf16(from_bits(0xBF818000u)), 0xBF82); // negative tie
    // Mantissa carry into the exponent, and overflow to inf.
    CHECK_EQ(di_f32_to_bf16(from_bits(0x3FFFFFFFu)), 0x4000);
    CHECK_EQ(di_f32_to_bf16(FLT_MAX), 0x7F80);
    CHECK_EQ(di_f32_to_bf16(INFINITY), 0x7F80);
    CHECK_EQ(di_f32_to_bf16(-INFINITY), 0xFF80);
    CHECK_EQ(di_f32_to_bf16(-0.0f), 0x8000);
    // NaN stays NaN, including a signalling NaN whose payload lies only in the dropped bits.
    CHECK(isnan(di_bf16_to_f32(di_f32_to_bf16(NAN))));
    CHECK(isnan(di_bf16_to_f32(di_f32_to_bf16(from_bits(0x7F800001u)))));
    CHECK(isnan(di_bf16_to_f32(di_f32_to_bf16(from_bits(0xFF800001u)))));
    CHECK(isnan(di_round_bf16(from_bits(0x7FFFFFFFu))));
    // Subnormals round the same way.
    CHECK_EQ(di_f32_to_bf16(from_bits(0x00008000u)), 0x0000);
    CHECK_EQ(di_f32_to_bf16(from_bits(0x00018000u)), 0x0002);
    CHECK_FEQ(di_round_bf16(1.00390625f), 1.0f);      // 1 + 2^-8: tie -> even
    CHECK_FEQ(di_round_bf16(1.01171875f), 1.015625f); // 1 + 3·2^-8: tie -> even (up)
    // Every bf16 pattern that is not NaN round-trips exactly.
    int bad = 0;
    for (uint32_t h = 0; h < 0x10000u; h++) {
        float x = di_bf16_to_f32((uint16_t)h);
        if (bits_of(x) != h << 16) bad++;
        if (!isnan(x) && di_f32_to_bf16(x) != h) bad++;
    }
    CHECK_EQ(bad, 0);
}

static void test_f16(void) {
    CHECK_FEQ(di_f16_to_f32(0x3C00), 1.0f);
    CHECK_FEQ(di_f16_to_f32(0xC000), -2.0f);
    CHECK_FEQ(di_f16_to_f32(0x7BFF), 65504.0f);
    CHECK_FEQ(di_f16_to_f32(0x0001), 0x1p-24f);
    CHECK_FEQ(di_f16_to_f32(0x03FF), 1023.0f * 0x1p-24f);
    CHECK_FEQ(di_f16_to_f32(0x0400), 0x1p-14f);
    CHECK_FEQ(di_f16_to_f32(0x8000), -0.0f);
    CHECK_FEQ(di_f16_to_f32(0x7C00), INFINITY);
    CHECK_FEQ(di_f16_to_f32(0xFC00), -INFINITY);
    CHECK(isnan(di_f16_to_f32(0x7E00)));
    CHECK(isnan(di_f16_to_f32(0x7C01)));
    // Exhaustive against the IEEE formula.
    int bad = 0;
    for (uint32_t h = 0; h < 0x10000u; h++) {
        int s = (h >> 15) & 1, e = (h >> 10) & 31, m = h & 1023;
        float got = di_f16_to_f32((uint16_t)h);
        if (e == 31) {
            if (m == 0 ? !(isinf(got) && (signbit(got) != 0) == s) : !isnan(got)) bad++;
            continue;
        }
        double mag = e == 0 ? ldexp(m, -24) : ldexp(1024 + m, e - 25);
        if (!same_float(got, (float)(s ? -mag : mag))) bad++;
    }
    CHECK_EQ(bad, 0);
}

// ---- e4m3 ----

static void test_e4m3_codes(void) {
    // All 256 codes decode per the spec formula and re-encode to themselves (NaN apart).
    for (int c = 0; c < 256; c++) {
        float x = di_e4m3_to_f32((uint8_t)c);
        if ((c & 0x7F) == 0x7F) {
            CHECK(isnan(x));
            CHECK_EQ(di_f32_to_e4m3(x) & 0x7F, 0x7F);
            continue;
        }
        CHECK_FEQ(x, e4m3_formula(c));
        CHECK_EQ(di_f32_to_e4m3(x), c); // includes 0x80 (-0) keeping its sign
    }
    CHECK_FEQ(di_e4m3_to_f32(0x7E), 448.0f);
    CHECK_FEQ(di_e4m3_to_f32(0xFE), -448.0f);
    CHECK_FEQ(di_e4m3_to_f32(0x01), 0x1p-9f);
    CHECK_FEQ(di_e4m3_to_f32(0x08), 0x1p-6f);
    CHECK_FEQ(di_e4m3_to_f32(0x38), 1.0f);
}

static void test_e4m3_rounding(void) {
    // Midpoints between every pair of adjacent codes go to the even mantissa (= even code, as the
    // mantissa is the low 3 bits); one ulp above goes up, one ulp below goes down. Both signs.
    for (int c = 0; c < 0x7E; c++) {
        float lo = di_e4m3_to_f32((uint8_t)c), hi = di_e4m3_to_f32((uint8_t)(c + 1));
        float mid = 0.5f * (lo + hi); // exact: at most 5 significant bits
        CHECK(mid > lo && mid < hi);
        int even = (c & 1) ? c + 1 : c;
        CHECK_EQ(di_f32_to_e4m3(mid), even);
        CHECK_EQ(di_f32_to_e4m3(nextafterf(mid, INFINITY)), c + 1);
        CHECK_EQ(di_f32_to_e4m3(nextafterf(mid, 0.0f)), c);
        CHECK_EQ(di_f32_to_e4m3(-mid), 0x80 | even);
        CHECK_EQ(di_f32_to_e4m3(-nextafterf(mid, INFINITY)), 0x80 | (c + 1));
        CHECK_EQ(di_f32_to_e4m3(-nextafterf(mid, 0.0f)), 0x80 | c);
    }
    // Spec §6.5 plain e4m3 RNE examples.
    CHECK_FEQ(di_e4m3_to_f32(di_f32_to_e4m3(1.0625f)), 1.0f);
    CHECK_FEQ(di_e4m3_to_f32(di_f32_to_e4m3(1.1875f)), 1.25f);
    CHECK_FEQ(di_e4m3_to_f32(di_f32_to_e4m3(440.0f)), 448.0f);
    CHECK_FEQ(di_e4m3_to_f32(di_f32_to_e4m3(0.002f)), 0.001953125f);
    CHECK_FEQ(di_e4m3_to_f32(di_f32_to_e4m3(-0.9f)), -0.875f);
    // Saturation: clamp to ±448 before rounding.
    CHECK_EQ(di_f32_to_e4m3(1e6f), 0x7E);
    CHECK_EQ(di_f32_to_e4m3(-1e6f), 0xFE);
    CHECK_EQ(di_f32_to_e4m3(464.0f), 0x7E); // would round to 512 without the clamp
    CHECK_EQ(di_f32_to_e4m3(500.0f), 0x7E);
    CHECK_EQ(di_f32_to_e4m3(INFINITY), 0x7E);
    CHECK_EQ(di_f32_to_e4m3(-INFINITY), 0xFE);
    CHECK_EQ(di_f32_to_e4m3(NAN), 0x7F);
    // Subnormal boundaries: step 2^-9 below 2^-6.
    CHECK_EQ(di_f32_to_e4m3(0x1p-10f), 0x00);                         // tie 0 | 2^-9 -> 0
    CHECK_EQ(di_f32_to_e4m3(nextafterf(0x1p-10f, 1.0f)), 0x01);       // above the tie
    CHECK_EQ(di_f32_to_e4m3(3.0f * 0x1p-10f), 0x02);                  // tie 1 | 2 -> 2
    CHECK_EQ(di_f32_to_e4m3(7.0f * 0x1p-9f), 0x07);                   // largest subnormal
    CHECK_EQ(di_f32_to_e4m3(7.5f * 0x1p-9f), 0x08);                   // tie 7 | 8 -> 8
    CHECK_EQ(di_f32_to_e4m3(nextafterf(7.5f * 0x1p-9f, 0.0f)), 0x07); // below the tie
    CHECK_EQ(di_f32_to_e4m3(0x1p-6f), 0x08);                          // smallest normal
    CHECK_EQ(di_f32_to_e4m3(nextafterf(0x1p-6f, 0.0f)), 0x08);        // rounds up to it
    CHECK_EQ(di_f32_to_e4m3(1e-30f), 0x00);
    CHECK_EQ(di_f32_to_e4m3(FLT_TRUE_MIN), 0x00);
    // Sign of zero is kept.
    CHECK_EQ(di_f32_to_e4m3(0.0f), 0x00);
    CHECK_EQ(di_f32_to_e4m3(-0.0f), 0x80);
    CHECK_EQ(di_f32_to_e4m3(-1e-9f), 0x80);
    CHECK_EQ(di_f32_to_e4m3(-0x1p-10f), 0x80);
}

static void test_e4m3_brute_force(void) {
    // Independent check of the encoder: for a dense sweep of f32 bit patterns covering the whole
    // e4m3 range (and past it), the nearest grid value found by exhaustive search, ties to the
    // even code, after the ±448 clamp.
    int bad = 0;
    for (uint32_t u = 0x2E000000u; u < 0x44000000u; u += 0x1F3u) { // 2^-35 .. 512
        float x = from_bits(u), a = x > 448.0f ? 448.0f : x;
        int best = 0;
        for (int c = 1; c < 0x7F; c++) {
            float dc = fabsf(di_e4m3_to_f32((uint8_t)c) - a);
            float db = fabsf(di_e4m3_to_f32((uint8_t)best) - a);
            if (dc < db || (dc == db && (c & 1) == 0)) best = c;
        }
        if (di_f32_to_e4m3(x) != best || di_f32_to_e4m3(-x) != (0x80 | best)) bad++;
    }
    CHECK_EQ(bad, 0);
}

// ---- e2m1, ue8m0, ceil_log2 ----

static void test_e2m1(void) {
    static const float mags[8] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};
    for (int c = 0; c < 16; c++) {
        float x = di_e2m1_to_f32((uint8_t)c);
        CHECK_FEQ(x, (c & 8) ? -mags[c & 7] : mags[c & 7]);
        CHECK_EQ(di_f32_to_e2m1(x), c);                    // code 8 is -0 and keeps its sign
        CHECK_FEQ(di_e2m1_to_f32((uint8_t)(c | 0xF0)), x); // high bits ignored
    }
    // Midpoints go to the even code, neighbours of the midpoint to the nearer code.
    for (int c = 0; c < 7; c++) {
        float mid = 0.5f * (mags[c] + mags[c + 1]);
        int even = (c & 1) ? c + 1 : c;
        CHECK_EQ(di_f32_to_e2m1(mid), even);
        CHECK_EQ(di_f32_to_e2m1(nextafterf(mid, INFINITY)), c + 1);
        CHECK_EQ(di_f32_to_e2m1(nextafterf(mid, 0.0f)), c);
        CHECK_EQ(di_f32_to_e2m1(-mid), 8 | even);
    }
    CHECK_FEQ(di_e2m1_to_f32(di_f32_to_e2m1(2.5f)), 2.0f);
    CHECK_FEQ(di_e2m1_to_f32(di_f32_to_e2m1(5.0f)), 4.0f);
    CHECK_FEQ(di_e2m1_to_f32(di_f32_to_e2m1(0.25f)), 0.0f);
    CHECK_FEQ(di_e2m1_to_f32(di_f32_to_e2m1(0.75f)), 1.0f);
    CHECK_FEQ(di_e2m1_to_f32(di_f32_to_e2m1(1.25f)), 1.0f);
    CHECK_FEQ(di_e2m1_to_f32(di_f32_to_e2m1(1.75f)), 2.0f);
    CHECK_FEQ(di_e2m1_to_f32(di_f32_to_e2m1(3.5f)), 4.0f);
    CHECK_EQ(di_f32_to_e2m1(7.0f), 0x7); // saturate
    CHECK_EQ(di_f32_to_e2m1(1e9f), 0x7);
    CHECK_EQ(di_f32_to_e2m1(-INFINITY), 0xF);
    CHECK_EQ(di_f32_to_e2m1(-0.1f), 0x8);
}

static void test_ue8m0(void) {
    for (int u = 1; u < 255; u++) {
        CHECK_EQ(bits_of(di_ue8m0_to_f32((uint8_t)u)), (uint32_t)u << 23);
        CHECK_FEQ(di_ue8m0_to_f32((uint8_t)u), ldexpf(1.0f, u - 127));
    }
    CHECK_FEQ(di_ue8m0_to_f32(0), ldexpf(1.0f, -127));
    CHECK_EQ(bits_of(di_ue8m0_to_f32(0)), 0x00400000u); // the subnormal 2^-127
    CHECK_FEQ(di_ue8m0_to_f32(127), 1.0f);
    CHECK_FEQ(di_ue8m0_to_f32(128), 2.0f);
    CHECK_FEQ(di_ue8m0_to_f32(117), 0x1p-10f);
    CHECK(isnan(di_ue8m0_to_f32(255)));
}

static void test_ceil_log2(void) {
    // An exact power of two gives that power; anything above it gives the next one.
    for (int k = -126; k <= 127; k++) {
        float p = ldexpf(1.0f, k);
        CHECK_EQ(di_ceil_log2_bits(p), k);
        CHECK_EQ(di_ceil_log2_bits(nextafterf(p, INFINITY)), k + 1);
        if (k > -126) CHECK_EQ(di_ceil_log2_bits(nextafterf(p, 0.0f)), k);
    }
    CHECK_EQ(di_ceil_log2_bits(1.0f), 0);
    CHECK_EQ(di_ceil_log2_bits(3.0f), 2);
    CHECK_EQ(di_ceil_log2_bits(0.75f), 0);
    CHECK_EQ(di_ceil_log2_bits(0.4f / 448.0f), -10);
    CHECK_EQ(di_ceil_log2_bits(FLT_MAX), 128);
}

// ---- fake quantisation ----

static void check_vec(const float *got, const float *want, int n) {
    for (int i = 0; i < n; i++) CHECK_FEQ(got[i], want[i]);
}

static void test_q8_known_answers(void) {
    // Spec §6.5, B = 4. The scale is re-derived from the rule to check the stated one as well.
    float a[4] = {0.1f, -0.2f, 0.3f, 0.4f};
    CHECK_EQ(di_ceil_log2_bits(0.4f * (1.0f / 448.0f)), -10);
    di_fake_quant_q8(a, 4, 4);
    check_vec(a, (const float[]){0.1015625f, -0.203125f, 0.3125f, 0.40625f}, 4);

    float b[4] = {448.0f, 1.0f, -3.0f, 0.001f};
    CHECK_EQ(di_ceil_log2_bits(448.0f * (1.0f / 448.0f)), 0);
    di_fake_quant_q8(b, 4, 4);
    check_vec(b, (const float[]){448.0f, 1.0f, -3.0f, 0.001953125f}, 4);

    float z[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    CHECK_EQ(di_ceil_log2_bits(1e-4f * (1.0f / 448.0f)), -22);
    di_fake_quant_q8(z, 4, 4);
    check_vec(z, (const float[]){0.0f, 0.0f, 0.0f, 0.0f}, 4);

    // The three blocks in one call: each block gets its own scale.
    float all[12] = {0.1f, -0.2f, 0.3f, 0.4f, 448.0f, 1.0f, -3.0f, 0.001f, 0, 0, 0, 0};
    di_fake_quant_q8(all, 12, 4);
    check_vec(all,
              (const float[]){0.1015625f, -0.203125f, 0.3125f, 0.40625f, 448.0f, 1.0f, -3.0f,
                              0.001953125f, 0, 0, 0, 0},
              12);

    // The 1e-4 floor sets the scale for tiny blocks: 2^-22, so 2^-31 is the smallest step.
    float t[4] = {2e-10f, 0x1p-31f, -0x1p-29f, 1e-9f};
    di_fake_quant_q8(t, 4, 4);
    check_vec(t, (const float[]){0.0f, 0x1p-31f, -0x1p-29f, 0x1p-30f}, 4);
}

static void test_q8_properties(void) {
    // Random blocks of 128: every output is exact in BF16, on the e4m3 grid times a power of two,
    // within half a grid step of the input, and Q8 is idempotent. A8 is Q8 with block 128.
    enum { N = 128 * 8 };
    static float v[N], w[N], a8[N];
    uint32_t rng = 12345u;
    for (int i = 0; i < N; i++) {
        rng = rng * 1664525u + 1013904223u;
        float r = (float)(rng >> 8) * 0x1p-24f - 0.5f; // [-0.5, 0.5)
        v[i] = r * ldexpf(1.0f, (i / 128) * 3 - 10);   // blocks span 2^-10 .. 2^11
    }
    memcpy(w, v, sizeof v);
    memcpy(a8, v, sizeof v);
    di_fake_quant_q8(w, N, 128);
    di_act_quant_a8(a8, N);
    int bad = 0;
    for (int i = 0; i < N; i++) {
        if (!same_float(w[i], a8[i])) bad++;
        if (!same_float(w[i], di_round_bf16(w[i]))) bad++;
        if (fabsf(w[i] - v[i]) > fabsf(v[i]) * 0x1p-4f + 0x1p-40f) bad++;
    }
    CHECK_EQ(bad, 0);
    memcpy(a8, w, sizeof w);
    di_fake_quant_q8(a8, N, 128);
    bad = 0;
    for (int i = 0; i < N; i++) bad += !same_float(a8[i], w[i]);
    CHECK_EQ(bad, 0);

    // A block holding inf or NaN becomes NaN; neighbouring blocks are untouched.
    float nb[8] = {1.0f, INFINITY, 2.0f, 3.0f, 1.0f, 2.0f, 3.0f, 4.0f};
    di_fake_quant_q8(nb, 8, 4);
    for (int i = 0; i < 4; i++) CHECK(isnan(nb[i]));
    check_vec(nb + 4, (const float[]){1.0f, 2.0f, 3.0f, 4.0f}, 4);
}

static void test_q4_known_answers(void) {
    // Spec §6.5 (the first example has 4 elements, so B = 4; the second has B = 6).
    float a[4] = {3.0f, -1.0f, 0.2f, 0.7f};
    di_fake_quant_q4(a, 4, 4);
    check_vec(a, (const float[]){3.0f, -1.0f, 0.25f, 0.75f}, 4);

    float b[6] = {5.0f, 2.5f, 0.25f, 0.75f, 1.25f, -6.0f};
    CHECK_EQ(di_ceil_log2_bits(6.0f * (1.0f / 6.0f)), 0); // fl32(6 · fl32(1/6)) == 1 exactly
    di_fake_quant_q4(b, 6, 6);
    check_vec(b, (const float[]){4.0f, 2.0f, 0.0f, 1.0f, 1.0f, -6.0f}, 6);

    // Two blocks in one call get independent scales (0.5 and 2; fl32(12 · fl32(1/6)) == 2).
    float c[8] = {3.0f, -1.0f, 0.2f, 0.7f, 12.0f, 5.0f, -2.9f, 1.0f};
    di_fake_quant_q4(c, 8, 4);
    check_vec(c, (const float[]){3.0f, -1.0f, 0.25f, 0.75f, 12.0f, 4.0f, -3.0f, 1.0f}, 8);

    // The 6·2^-126 floor: an all-zero block stays zero, and the scale stays normal.
    float z[4] = {0.0f, -0.0f, 0.0f, 0.0f};
    CHECK_EQ(di_ceil_log2_bits(6.0f * 0x1p-126f * (1.0f / 6.0f)), -126);
    di_fake_quant_q4(z, 4, 4);
    check_vec(z, (const float[]){0.0f, -0.0f, 0.0f, 0.0f}, 4);
}

// ---- Hadamard ----

static void test_hadamard(void) {
    enum { N = 128 };
    static float v[N], orig[N], y[N];
    uint32_t rng = 777u;
    for (int i = 0; i < N; i++) {
        rng = rng * 1664525u + 1013904223u;
        orig[i] = (float)(rng >> 8) * 0x1p-23f - 1.0f; // [-1, 1)
    }

    // Matches the direct O(n^2) definition (double accumulation) to f32 rounding noise:
    // log2(128) = 7 butterfly stages of sums of |v| <= 1 values, so errors stay far below 1e-5.
    memcpy(y, orig, sizeof y);
    di_hadamard(y, N);
    double max_err = 0.0;
    for (int i = 0; i < N; i++) {
        double s = 0.0;
        for (int j = 0; j < N; j++)
            s += (__builtin_popcount((unsigned)(i & j)) & 1) ? -orig[j] : orig[j];
        s /= sqrt((double)N);
        double err = fabs(s - y[i]);
        if (err > max_err) max_err = err;
    }
    CHECK_NEAR(max_err, 0.0, 1e-5);

    // Orthonormal and symmetric, so applying it twice returns the input.
    memcpy(v, orig, sizeof v);
    di_hadamard(v, N);
    di_hadamard(v, N);
    max_err = 0.0;
    for (int i = 0; i < N; i++) {
        double err = fabs((double)v[i] - orig[i]);
        if (err > max_err) max_err = err;
    }
    CHECK_NEAR(max_err, 0.0, 1e-6);

    // H(e_0) is the constant n^-1/2; H(e_k) has entry i = n^-1/2 · (-1)^popcount(i & k).
    for (int n = 1; n <= 1024; n *= 2) {
        float e[1024] = {0};
        e[0] = 1.0f;
        di_hadamard(e, n);
        float c = (float)(1.0 / sqrt((double)n));
        int bad = 0;
        for (int i = 0; i < n; i++) bad += !same_float(e[i], c);
        CHECK_EQ(bad, 0);
    }
    float e5[8] = {0, 0, 0, 0, 0, 1.0f, 0, 0};
    di_hadamard(e5, 8);
    float c8 = (float)(1.0 / sqrt(8.0));
    for (int i = 0; i < 8; i++)
        CHECK_FEQ(e5[i], (__builtin_popcount((unsigned)(i & 5)) & 1) ? -c8 : c8);
    float two[2] = {3.0f, 1.0f};
    di_hadamard(two, 2);
    CHECK_NEAR(two[0], 4.0 / sqrt(2.0), 1e-6);
    CHECK_NEAR(two[1], 2.0 / sqrt(2.0), 1e-6);
}

// ---- row dequantisation ----

static void test_dequant_f32_rows(void) {
    float f[3] = {1.5f, -2.0f, 0x1p-130f}, out[4];
    di_dequant_row_f32(DI_DTYPE_F32, f, 3, out);
    check_vec(out, f, 3);

    uint16_t h[4] = {0x3C00, 0xC000, 0x0001, 0x7C00};
    di_dequant_row_f32(DI_DTYPE_F16, h, 4, out);
    CHECK_FEQ(out[0], 1.0f);
    CHECK_FEQ(out[1], -2.0f);
    CHECK_FEQ(out[2], 0x1p-24f);
    CHECK_FEQ(out[3], INFINITY);

    uint16_t b[3] = {0x3F80, 0xC040, 0x0001};
    di_dequant_row_f32(DI_DTYPE_BF16, b, 3, out);
    CHECK_FEQ(out[0], 1.0f);
    CHECK_FEQ(out[1], -3.0f);
    CHECK_FEQ(out[2], from_bits(0x00010000u));
}

static void test_dequant_fp8_row(void) {
    enum { N = 256 + 64 };
    static uint8_t row[N];
    static float out[N];
    uint8_t scale[3] = {127, 130, 117};                                       // 1, 8, 2^-10
    for (int i = 0; i < N; i++) row[i] = (uint8_t)(i % 7 == 6 ? 0xB4 : 0x38); // -0.75 or 1.0
    di_dequant_row_fp8(row, scale, N, 128, out);
    int bad = 0;
    for (int i = 0; i < N; i++) {
        float s = i < 128 ? 1.0f : i < 256 ? 8.0f : 0x1p-10f;
        bad += !same_float(out[i], di_e4m3_to_f32(row[i]) * s);
    }
    CHECK_EQ(bad, 0);
    CHECK_FEQ(out[126], 1.0f);
    CHECK_FEQ(out[127], 1.0f);  // last element of block 0
    CHECK_FEQ(out[128], 8.0f);  // first element of block 1: the scale changes here
    CHECK_FEQ(out[132], -6.0f); // 132 % 7 == 6: -0.75 · 8
    CHECK_FEQ(out[255], 8.0f);
    CHECK_FEQ(out[256], 0x1p-10f);
    CHECK_FEQ(di_e4m3_to_f32(0xB4), -0.75f);
}

static void test_dequant_fp4_row(void) {
    // Hand-made byte 0xB2: low nibble 0x2 (= +1.0) is element 0, high nibble 0xB (= -1.5) is
    // element 1.
    uint8_t one[1] = {0xB2};
    uint8_t s1[1] = {128}; // 2
    float o2[2];
    di_dequant_row_fp4(one, s1, 2, 32, o2);
    CHECK_FEQ(o2[0], 2.0f);
    CHECK_FEQ(o2[1], -3.0f);

    // 64 elements, block 32: scale 1 for 0..31, 2^-3 for 32..63.
    enum { N = 64 };
    uint8_t packed[N / 2];
    for (int k = 0; k < N / 2; k++) packed[k] = (uint8_t)((k & 15) | ((15 - (k & 15)) << 4));
    uint8_t sc[2] = {127, 124};
    float out[N];
    di_dequant_row_fp4(packed, sc, N, 32, out);
    int bad = 0;
    for (int i = 0; i < N; i++) {
        int k = i / 2;
        uint8_t code = (i & 1) ? (uint8_t)(15 - (k & 15)) : (uint8_t)(k & 15);
        float s = i < 32 ? 1.0f : 0.125f;
        bad += !same_float(out[i], di_e2m1_to_f32(code) * s);
    }
    CHECK_EQ(bad, 0);
    CHECK_FEQ(out[0], 0.0f);     // code 0
    CHECK_FEQ(out[1], -6.0f);    // code 15
    CHECK_FEQ(out[14], 6.0f);    // k = 7: code 7
    CHECK_FEQ(out[29], 0.5f);    // k = 14: high nibble 1 -> +0.5
    CHECK_FEQ(out[31], 0.0f);    // k = 15: high nibble 0 -> 0
    CHECK_FEQ(out[33], -0.75f);  // k = 16, block 1: high nibble 15 -> -6 · 2^-3
    CHECK_FEQ(out[35], -0.5f);   // k = 17: high nibble 14 -> -4 · 2^-3
    CHECK_FEQ(out[34], 0.0625f); // k = 17: low nibble 1 -> 0.5 · 2^-3
}

// Q4e (spec deepseek-v41.md App. A.3): FP4 e2m1 with one E4M3 scale per 16.
static void test_q4e_known_answers(void) {
    float a[16] = {0.1f, -0.2f, 0.3f,  0.4f, 1.0f, -2.5f, 3.3f, 0,
                   5.0f, -7.0f, 0.05f, 0.6f, 0.7f, 0.8f,  0.9f, 1.1f};
    const float wa[16] = {0,    -0.0f,  0.5625f, 0.5625f, 1.125f,  -2.25f,  3.375f, 0,
                          4.5f, -6.75f, 0,       0.5625f, 0.5625f, 0.5625f, 1.125f, 1.125f};
    di_fake_quant_q4e(a, 16, 16);
    for (int i = 0; i < 16; i++) CHECK(a[i] == wa[i]);
    CHECK(signbit(a[1]));
    float z[16] = {0};
    di_fake_quant_q4e(z, 16, 16);
    for (int i = 0; i < 16; i++) CHECK(z[i] == 0);
    float b[32] = {1.0f, 0.3f, -0.26f, 0.74f, 0.76f, 1.24f, 1.26f, 2.4f,
                   2.6f, 3.4f, 3.6f,   5.9f,  0,     0,     0,     -0.01f};
    const float wb[16] = {1, 0.5f, -0.5f, 0.5f, 1, 1, 1.5f, 2, 3, 3, 4, 6, 0, 0, 0, -0.0f};
    for (int i = 16; i < 32; i++) b[i] = b[i - 16] * 4; // a second block, scaled: same codes
    di_fake_quant_q4e(b, 32, 16);
    for (int i = 0; i < 16; i++) CHECK(b[i] == wb[i]);
    for (int i = 16; i < 32; i++) CHECK(b[i] == 4 * wb[i - 16]);
    CHECK(signbit(b[15]));
    // Ties after division by the scale 1 (amax 6): 0.25->0, 0.75->1, 1.25->1, 1.75->2, 2.5->2,
    // 3.5->4, 5->4.
    float t[16] = {0.25f, 0.75f, 1.25f, 1.75f, 2.5f, 3.5f, 5.0f, 6.0f};
    const float wt[8] = {0, 1, 1, 2, 2, 4, 4, 6};
    di_fake_quant_q4e(t, 16, 16);
    for (int i = 0; i < 8; i++) CHECK(t[i] == wt[i]);
}

// ---- packed rows ----

typedef struct pack_fmt {
    const char *name;
    int64_t block;
    void (*fake)(float *, int64_t, int64_t);
    void (*pack)(float *, int64_t, int64_t, uint8_t *);
    void (*unpack)(const uint8_t *, int64_t, int64_t, float *);
    size_t (*row_bytes)(int64_t, int64_t);
    size_t bytes_256; // row bytes of n = 256
} pack_fmt;

static const pack_fmt k_pack_fmts[] = {
    {"q8", 32, di_fake_quant_q8, di_quant_q8_pack, di_quant_q8_unpack, di_quant_q8_row_bytes,
     256 + 8},
    {"q4", 32, di_fake_quant_q4, di_quant_q4_pack, di_quant_q4_unpack, di_quant_q4_row_bytes,
     128 + 8},
    {"q4e", 16, di_fake_quant_q4e, di_quant_q4e_pack, di_quant_q4e_unpack, di_quant_q4e_row_bytes,
     128 + 16},
};

#define PACK_N 256

static uint64_t g_rng = 0x9E3779B97F4A7C15ull;
static uint32_t rnd(void) { // xorshift64*
    g_rng ^= g_rng >> 12;
    g_rng ^= g_rng << 25;
    g_rng ^= g_rng >> 27;
    return (uint32_t)((g_rng * 0x2545F4914F6CDD1Dull) >> 32);
}

// Bitwise float rows (NaN bit patterns included: the unpacker must write the quantiser's NaN).
static int same_bits(const float *a, const float *b, int64_t n) {
    return memcmp(a, b, sizeof(float) * (size_t)n) == 0;
}

// pack == fake quant in place and unpack(pack) == that, bitwise; the bytes stop at row_bytes.
// *fq receives the fake-quantised row.
static int pack_once(const pack_fmt *f, const float *row, float *fq) {
    float got[PACK_N], back[PACK_N];
    uint8_t bytes[2 * PACK_N];
    memcpy(fq, row, sizeof got);
    memcpy(got, row, sizeof got);
    f->fake(fq, PACK_N, f->block);
    memset(bytes, 0xA5, sizeof bytes);
    f->pack(got, PACK_N, f->block, bytes);
    int bad = !same_bits(got, fq, PACK_N) || bytes[f->row_bytes(PACK_N, f->block)] != 0xA5;
    f->unpack(bytes, PACK_N, f->block, back);
    return bad + !same_bits(back, fq, PACK_N);
}

// pack_once on the row and again on its fake-quantised row (whatever the magnitudes: including
// the blocks fake quant moves, an overflow to inf or a Q4e scale at the subnormal floor).
static int check_pack_row(const pack_fmt *f, const float *row) {
    float fq[PACK_N], fq2[PACK_N];
    int bad = pack_once(f, row, fq);
    return bad + pack_once(f, fq, fq2);
}

static void test_pack_rows(void) {
    static const float k_specials[] = {
        0.0f,           -0.0f,   1e-4f,    -1e-4f,   0.99e-4f,  6.0f * 0x1p-126f,
        6.0f * 0x1p-9f, 0x1p-9f, -0x1p-9f, 0x1p-10f, 0x1p-149f, -0x1p-149f,
        0x1p-126f,      448.0f,  -448.0f,  449.0f,
        2688.0f, // 448 · 6: the Q4e scale saturates
        1e6f,           -1e30f,  FLT_MAX,  -FLT_MAX, 2.5f,      -5.0f,
        0.25f};
    const int n_spec = (int)(sizeof k_specials / sizeof k_specials[0]);
    for (size_t fi = 0; fi < sizeof k_pack_fmts / sizeof k_pack_fmts[0]; fi++) {
        const pack_fmt *f = &k_pack_fmts[fi];
        CHECK_EQ((long long)f->row_bytes(PACK_N, f->block), (long long)f->bytes_256);
        float row[PACK_N];
        int bad = 0;
        // Random rows, one magnitude per block from 2^-150 to 2^127 (subnormal and saturated
        // scales), mixed signs, exact zeros and negative zeros sprinkled in.
        for (int it = 0; it < 2000; it++) {
            for (int64_t b = 0; b < PACK_N; b += f->block) {
                float mag = ldexpf(1.0f, (int)(rnd() % 278) - 150);
                for (int64_t j = b; j < b + f->block; j++) {
                    uint32_t r = rnd();
                    float u = (float)(r >> 8) * 0x1p-24f; // [0, 1)
                    float x = u * mag * (float)(1 + (r & 3));
                    if ((r & 0xF0) == 0) x = 0.0f;
                    row[j] = (r & 0x100) ? -x : x;
                }
            }
            bad += check_pack_row(f, row);
        }
        // Every special value alone in a block of zeros, and blocks made only of it.
        for (int i = 0; i < n_spec; i++) {
            for (int64_t j = 0; j < PACK_N; j++) row[j] = (j % 3) ? -0.0f : 0.0f;
            row[5] = k_specials[i];
            for (int64_t j = f->block; j < 2 * f->block; j++) row[j] = k_specials[i];
            for (int64_t j = 2 * f->block; j < 3 * f->block; j++)
                row[j] = k_specials[i] * ((j & 1) ? -0.5f : 1.0f);
            bad += check_pack_row(f, row);
        }
        // Non-finite blocks: NaN, +inf, -inf each poison exactly their block.
        const float nonfinite[3] = {NAN, INFINITY, -INFINITY};
        for (int i = 0; i < 3; i++) {
            for (int64_t j = 0; j < PACK_N; j++) row[j] = (float)j * 0.37f - 40.0f;
            row[f->block + 3] = nonfinite[i];
            float fq[PACK_N];
            memcpy(fq, row, sizeof fq);
            f->fake(fq, PACK_N, f->block);
            CHECK(isnan(fq[f->block]) && !isnan(fq[0]) && !isnan(fq[2 * f->block]));
            bad += check_pack_row(f, row);
        }
        if (bad) fprintf(stderr, "  %s: %d mismatching rows\n", f->name, bad);
        CHECK_EQ(bad, 0);
        // Idempotence where fake quant is idempotent (no overflow, Q4e scales normal and below
        // saturation): a packed fake-quantised row decodes to itself. The bytes may differ (a
        // block whose maximum rounded down to half the scale's range takes the next scale down).
        int not_same = 0;
        for (int it = 0; it < 2000; it++) {
            float fq[PACK_N], fq2[PACK_N];
            for (int64_t b = 0; b < PACK_N; b += f->block) {
                float mag =
                    ldexpf(1.0f, f->block == 16 ? (int)(rnd() % 9) : (int)(rnd() % 200) - 100);
                for (int64_t j = b; j < b + f->block; j++) {
                    uint32_t r = rnd();
                    float x = (float)(r >> 8) * 0x1p-24f * mag * (float)(1 + (r & 3));
                    row[j] = (r & 0x100) ? -x : x;
                }
            }
            bad += pack_once(f, row, fq);
            bad += pack_once(f, fq, fq2);
            not_same += !same_bits(fq2, fq, PACK_N);
        }
        CHECK_EQ(bad, 0);
        CHECK_EQ(not_same, 0);
    }
}

// The byte layout itself: Q8's codes are e4m3 bytes then UE8M0 exponents; Q4's e2m1 nibbles are
// in the FP4 weights' order (di_dequant_row_fp4 decodes a Q4 row); Q4e's scales are E4M3 bytes.
static void test_pack_layout(void) {
    float v[64];
    uint8_t b[128];
    for (int j = 0; j < 64; j++) v[j] = (j < 32) ? 1.5f : -3.0f;
    di_quant_q8_pack(v, 64, 32, b); // 1.5 / 448 -> scale 2^-8: code of 384; -3 -> 2^-7
    CHECK_EQ(b[0], di_f32_to_e4m3(384.0f));
    CHECK_EQ(b[32], di_f32_to_e4m3(-384.0f));
    CHECK_EQ(b[64], 127 - 8);
    CHECK_EQ(b[65], 127 - 7);
    float q4[64], fp4[64];
    for (int j = 0; j < 64; j++) q4[j] = (float)(j % 13) * 0.25f - 1.0f;
    di_quant_q4_pack(q4, 64, 32, b);
    di_dequant_row_fp4(b, b + 32, 64, 32, fp4);
    CHECK(same_bits(fp4, q4, 64));
    for (int j = 0; j < 16; j++) v[j] = j == 3 ? 12.0f : 0.0f;
    di_quant_q4e_pack(v, 16, 16, b);
    CHECK_EQ(b[8], di_f32_to_e4m3(2.0f)); // amax 12 / 6
    CHECK_EQ(b[1], 0x70);                 // element 3 (high nibble of byte 1): 12 / 2 = code 7
}

int main(void) {
    RUN(test_bf16);
    RUN(test_f16);
    RUN(test_e4m3_codes);
    RUN(test_e4m3_rounding);
    RUN(test_e4m3_brute_force);
    RUN(test_e2m1);
    RUN(test_ue8m0);
    RUN(test_ceil_log2);
    RUN(test_q8_known_answers);
    RUN(test_q8_properties);
    RUN(test_q4_known_answers);
    RUN(test_hadamard);
    RUN(test_dequant_f32_rows);
    RUN(test_dequant_fp8_row);
    RUN(test_dequant_fp4_row);
    RUN(test_q4e_known_answers);
    RUN(test_pack_rows);
    RUN(test_pack_layout);
    return test_finish();
}
