// Scalar reference for element conversions, fake quantisation, Hadamard and row dequantisation.
// See quant_ref.h for the contracts; spec deepseek-v4.md §2.0, §4.3, §5 items 14–16.
#include "tensor/quant_ref.h"

#include <stdbool.h>
#include <math.h>   // ldexpf, frexpf, floorf, fmodf, sqrt, isnan, isfinite, signbit, NAN
#include <string.h> // memcpy

#include "base/log.h" // DI_ASSERT

// ---- helpers ----

static uint32_t f32_bits(float x) {
    uint32_t u;
    memcpy(&u, &x, sizeof u);
    return u;
}

static float f32_from_bits(uint32_t u) {
    float x;
    memcpy(&x, &u, sizeof x);
    return x;
}

// Round a non-negative value to the nearest integer, ties to even, by hand so that the result does
// not depend on the rounding mode. x is small here (< 2^24), so floorf and the difference are
// exact.
static float round_half_even(float x) {
    float q = floorf(x);
    float r = x - q;
    if (r > 0.5f || (r == 0.5f && fmodf(q, 2.0f) != 0.0f)) q += 1.0f;
    return q;
}

// ---- decode tables ----

// Generated once from the spec formulas (§4.3) and written as hex-float literals, so they are
// exact and constant; tests/unit/test_quant_ref.c re-derives every entry from the formula.
// e4m3fn: index = byte; 0x7F/0xFF are NaN.
static const float k_e4m3_f32[256] = {
    0.0f,     0x1p-9f,    0x1p-8f,    0x1.8p-8f,  0x1p-7f,    0x1.4p-7f,  0x1.8p-7f,  0x1.cp-7f,
    0x1p-6f,  0x1.2p-6f,  0x1.4p-6f,  0x1.6p-6f,  0x1.8p-6f,  0x1.ap-6f,  0x1.cp-6f,  0x1.ep-6f,
    0x1p-5f,  0x1.2p-5f,  0x1.4p-5f,  0x1.6p-5f,  0x1.8p-5f,  0x1.ap-5f,  0x1.cp-5f,  0x1.ep-5f,
    0x1p-4f,  0x1.2p-4f,  0x1.4p-4f,  0x1.6p-4f,  0x1.8p-4f,  0x1.ap-4f,  0x1.cp-4f,  0x1.ep-4f,
    0x1p-3f,  0x1.2p-3f,  0x1.4p-3f,  0x1.6p-3f,  0x1.8p-3f,  0x1.ap-3f,  0x1.cp-3f,  0x1.ep-3f,
    0x1p-2f,  0x1.2p-2f,  0x1.4p-2f,  0x1.6p-2f,  0x1.8p-2f,  0x1.ap-2f,  0x1.cp-2f,  0x1.ep-2f,
    0x1p-1f,  0x1.2p-1f,  0x1.4p-1f,  0x1.6p-1f,  0x1.8p-1f,  0x1.ap-1f,  0x1.cp-1f,  0x1.ep-1f,
    0x1p+0f,  0x1.2p+0f,  0x1.4p+0f,  0x1.6p+0f,  0x1.8p+0f,  0x1.ap+0f,  0x1.cp+0f,  0x1.ep+0f,
    0x1p+1f,  0x1.2p+1f,  0x1.4p+1f,  0x1.6p+1f,  0x1.8p+1f,  0x1.ap+1f,  0x1.cp+1f,  0x1.ep+1f,
    0x1p+2f,  0x1.2p+2f,  0x1.4p+2f,  0x1.6p+2f,  0x1.8p+2f,  0x1.ap+2f,  0x1.cp+2f,  0x1.ep+2f,
    0x1p+3f,  0x1.2p+3f,  0x1.4p+3f,  0x1.6p+3f,  0x1.8p+3f,  0x1.ap+3f,  0x1.cp+3f,  0x1.ep+3f,
    0x1p+4f,  0x1.2p+4f,  0x1.4p+4f,  0x1.6p+4f,  0x1.8p+4f,  0x1.ap+4f,  0x1.cp+4f,  0x1.ep+4f,
    0x1p+5f,  0x1.2p+5f,  0x1.4p+5f,  0x1.6p+5f,  0x1.8p+5f,  0x1.ap+5f,  0x1.cp+5f,  0x1.ep+5f,
    0x1p+6f,  0x1.2p+6f,  0x1.4p+6f,  0x1.6p+6f,  0x1.8p+6f,  0x1.ap+6f,  0x1.cp+6f,  0x1.ep+6f,
    0x1p+7f,  0x1.2p+7f,  0x1.4p+7f,  0x1.6p+7f,  0x1.8p+7f,  0x1.ap+7f,  0x1.cp+7f,  0x1.ep+7f,
    0x1p+8f,  0x1.2p+8f,  0x1.4p+8f,  0x1.6p+8f,  0x1.8p+8f,  0x1.ap+8f,  0x1.cp+8f,  NAN,
    -0.0f,    -0x1p-9f,   -0x1p-8f,   -0x1.8p-8f, -0x1p-7f,   -0x1.4p-7f, -0x1.8p-7f, -0x1.cp-7f,
    -0x1p-6f, -0x1.2p-6f, -0x1.4p-6f, -0x1.6p-6f, -0x1.8p-6f, -0x1.ap-6f, -0x1.cp-6f, -0x1.ep-6f,
    -0x1p-5f, -0x1.2p-5f, -0x1.4p-5f, -0x1.6p-5f, -0x1.8p-5f, -0x1.ap-5f, -0x1.cp-5f, -0x1.ep-5f,
    -0x1p-4f, -0x1.2p-4f, -0x1.4p-4f, -0x1.6p-4f, -0x1.8p-4f, -0x1.ap-4f, -0x1.cp-4f, -0x1.ep-4f,
    -0x1p-3f, -0x1.2p-3f, -0x1.4p-3f, -0x1.6p-3f, -0x1.8p-3f, -0x1.ap-3f, -0x1.cp-3f, -0x1.ep-3f,
    -0x1p-2f, -0x1.2p-2f, -0x1.4p-2f, -0x1.6p-2f, -0x1.8p-2f, -0x1.ap-2f, -0x1.cp-2f, -0x1.ep-2f,
    -0x1p-1f, -0x1.2p-1f, -0x1.4p-1f, -0x1.6p-1f, -0x1.8p-1f, -0x1.ap-1f, -0x1.cp-1f, -0x1.ep-1f,
    -0x1p+0f, -0x1.2p+0f, -0x1.4p+0f, -0x1.6p+0f, -0x1.8p+0f, -0x1.ap+0f, -0x1.cp+0f, -0x1.ep+0f,
    -0x1p+1f, -0x1.2p+1f, -0x1.4p+1f, -0x1.6p+1f, -0x1.8p+1f, -0x1.ap+1f, -0x1.cp+1f, -0x1.ep+1f,
    -0x1p+2f, -0x1.2p+2f, -0x1.4p+2f, -0x1.6p+2f, -0x1.8p+2f, -0x1.ap+2f, -0x1.cp+2f, -0x1.ep+2f,
    -0x1p+3f, -0x1.2p+3f, -0x1.4p+3f, -0x1.6p+3f, -0x1.8p+3f, -0x1.ap+3f, -0x1.cp+3f, -0x1.ep+3f,
    -0x1p+4f, -0x1.2p+4f, -0x1.4p+4f, -0x1.6p+4f, -0x1.8p+4f, -0x1.ap+4f, -0x1.cp+4f, -0x1.ep+4f,
    -0x1p+5f, -0x1.2p+5f, -0x1.4p+5f, -0x1.6p+5f, -0x1.8p+5f, -0x1.ap+5f, -0x1.cp+5f, -0x1.ep+5f,
    -0x1p+6f, -0x1.2p+6f, -0x1.4p+6f, -0x1.6p+6f, -0x1.8p+6f, -0x1.ap+6f, -0x1.cp+6f, -0x1.ep+6f,
    -0x1p+7f, -0x1.2p+7f, -0x1.4p+7f, -0x1.6p+7f, -0x1.8p+7f, -0x1.ap+7f, -0x1.cp+7f, -0x1.ep+7f,
    -0x1p+8f, -0x1.2p+8f, -0x1.4p+8f, -0x1.6p+8f, -0x1.8p+8f, -0x1.ap+8f, -0x1.cp+8f, -NAN,
};

// UE8M0: index = byte, 2^(u-127); 0 is the subnormal 2^-127, 255 is NaN.
const float di_ue8m0_f32_table[256] = {
    0x1p-127f, 0x1p-126f, 0x1p-125f, 0x1p-124f, 0x1p-123f, 0x1p-122f, 0x1p-121f, 0x1p-120f,
    0x1p-119f, 0x1p-118f, 0x1p-117f, 0x1p-116f, 0x1p-115f, 0x1p-114f, 0x1p-113f, 0x1p-112f,
    0x1p-111f, 0x1p-110f, 0x1p-109f, 0x1p-108f, 0x1p-107f, 0x1p-106f, 0x1p-105f, 0x1p-104f,
    0x1p-103f, 0x1p-102f, 0x1p-101f, 0x1p-100f, 0x1p-99f,  0x1p-98f,  0x1p-97f,  0x1p-96f,
    0x1p-95f,  0x1p-94f,  0x1p-93f,  0x1p-92f,  0x1p-91f,  0x1p-90f,  0x1p-89f,  0x1p-88f,
    0x1p-87f,  0x1p-86f,  0x1p-85f,  0x1p-84f,  0x1p-83f,  0x1p-82f,  0x1p-81f,  0x1p-80f,
    0x1p-79f,  0x1p-78f,  0x1p-77f,  0x1p-76f,  0x1p-75f,  0x1p-74f,  0x1p-73f,  0x1p-72f,
    0x1p-71f,  0x1p-70f,  0x1p-69f,  0x1p-68f,  0x1p-67f,  0x1p-66f,  0x1p-65f,  0x1p-64f,
    0x1p-63f,  0x1p-62f,  0x1p-61f,  0x1p-60f,  0x1p-59f,  0x1p-58f,  0x1p-57f,  0x1p-56f,
    0x1p-55f,  0x1p-54f,  0x1p-53f,  0x1p-52f,  0x1p-51f,  0x1p-50f,  0x1p-49f,  0x1p-48f,
    0x1p-47f,  0x1p-46f,  0x1p-45f,  0x1p-44f,  0x1p-43f,  0x1p-42f,  0x1p-41f,  0x1p-40f,
    0x1p-39f,  0x1p-38f,  0x1p-37f,  0x1p-36f,  0x1p-35f,  0x1p-34f,  0x1p-33f,  0x1p-32f,
    0x1p-31f,  0x1p-30f,  0x1p-29f,  0x1p-28f,  0x1p-27f,  0x1p-26f,  0x1p-25f,  0x1p-24f,
    0x1p-23f,  0x1p-22f,  0x1p-21f,  0x1p-20f,  0x1p-19f,  0x1p-18f,  0x1p-17f,  0x1p-16f,
    0x1p-15f,  0x1p-14f,  0x1p-13f,  0x1p-12f,  0x1p-11f,  0x1p-10f,  0x1p-9f,   0x1p-8f,
    0x1p-7f,   0x1p-6f,   0x1p-5f,   0x1p-4f,   0x1p-3f,   0x1p-2f,   0x1p-1f,   0x1p+0f,
    0x1p+1f,   0x1p+2f,   0x1p+3f,   0x1p+4f,   0x1p+5f,   0x1p+6f,   0x1p+7f,   0x1p+8f,
    0x1p+9f,   0x1p+10f,  0x1p+11f,  0x1p+12f,  0x1p+13f,  0x1p+14f,  0x1p+15f,  0x1p+16f,
    0x1p+17f,  0x1p+18f,  0x1p+19f,  0x1p+20f,  0x1p+21f,  0x1p+22f,  0x1p+23f,  0x1p+24f,
    0x1p+25f,  0x1p+26f,  0x1p+27f,  0x1p+28f,  0x1p+29f,  0x1p+30f,  0x1p+31f,  0x1p+32f,
    0x1p+33f,  0x1p+34f,  0x1p+35f,  0x1p+36f,  0x1p+37f,  0x1p+38f,  0x1p+39f,  0x1p+40f,
    0x1p+41f,  0x1p+42f,  0x1p+43f,  0x1p+44f,  0x1p+45f,  0x1p+46f,  0x1p+47f,  0x1p+48f,
    0x1p+49f,  0x1p+50f,  0x1p+51f,  0x1p+52f,  0x1p+53f,  0x1p+54f,  0x1p+55f,  0x1p+56f,
    0x1p+57f,  0x1p+58f,  0x1p+59f,  0x1p+60f,  0x1p+61f,  0x1p+62f,  0x1p+63f,  0x1p+64f,
    0x1p+65f,  0x1p+66f,  0x1p+67f,  0x1p+68f,  0x1p+69f,  0x1p+70f,  0x1p+71f,  0x1p+72f,
    0x1p+73f,  0x1p+74f,  0x1p+75f,  0x1p+76f,  0x1p+77f,  0x1p+78f,  0x1p+79f,  0x1p+80f,
    0x1p+81f,  0x1p+82f,  0x1p+83f,  0x1p+84f,  0x1p+85f,  0x1p+86f,  0x1p+87f,  0x1p+88f,
    0x1p+89f,  0x1p+90f,  0x1p+91f,  0x1p+92f,  0x1p+93f,  0x1p+94f,  0x1p+95f,  0x1p+96f,
    0x1p+97f,  0x1p+98f,  0x1p+99f,  0x1p+100f, 0x1p+101f, 0x1p+102f, 0x1p+103f, 0x1p+104f,
    0x1p+105f, 0x1p+106f, 0x1p+107f, 0x1p+108f, 0x1p+109f, 0x1p+110f, 0x1p+111f, 0x1p+112f,
    0x1p+113f, 0x1p+114f, 0x1p+115f, 0x1p+116f, 0x1p+117f, 0x1p+118f, 0x1p+119f, 0x1p+120f,
    0x1p+121f, 0x1p+122f, 0x1p+123f, 0x1p+124f, 0x1p+125f, 0x1p+126f, 0x1p+127f, NAN,
};

// e2m1 magnitudes for codes 0..7 (bit 3 is the sign).
static const float k_e2m1_mag[8] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};

// e2m1 codes 0..15 -> value (bit 3 is the sign; code 8 is -0).
static const float k_e2m1_f32[16] = {0.0f,  0.5f,  1.0f,  1.5f,  2.0f,  3.0f,  4.0f,  6.0f,
                                     -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};

// A byte of two e2m1 codes -> its two values, low nibble first (the packed rows' unpacker reads a
// pair per byte). Spelled out by the preprocessor from the same magnitudes.
#define E2M1_MAG(m)                                                                                \
    ((m) == 0   ? 0.0f                                                                             \
     : (m) == 1 ? 0.5f                                                                             \
     : (m) == 2 ? 1.0f                                                                             \
     : (m) == 3 ? 1.5f                                                                             \
     : (m) == 4 ? 2.0f                                                                             \
     : (m) == 5 ? 3.0f                                                                             \
     : (m) == 6 ? 4.0f                                                                             \
                : 6.0f)
#define E2M1_VAL(c) (((c)&8) ? -E2M1_MAG((c)&7) : E2M1_MAG((c)&7))
#define E2M1_PAIR(b)                                                                               \
    { E2M1_VAL((b)&15), E2M1_VAL((b) >> 4) }
#define E2M1_ROW(h)                                                                                \
    E2M1_PAIR(16 * (h) + 0), E2M1_PAIR(16 * (h) + 1), E2M1_PAIR(16 * (h) + 2),                     \
        E2M1_PAIR(16 * (h) + 3), E2M1_PAIR(16 * (h) + 4), E2M1_PAIR(16 * (h) + 5),                 \
        E2M1_PAIR(16 * (h) + 6), E2M1_PAIR(16 * (h) + 7), E2M1_PAIR(16 * (h) + 8),                 \
        E2M1_PAIR(16 * (h) + 9), E2M1_PAIR(16 * (h) + 10), E2M1_PAIR(16 * (h) + 11),               \
        E2M1_PAIR(16 * (h) + 12), E2M1_PAIR(16 * (h) + 13), E2M1_PAIR(16 * (h) + 14),              \
        E2M1_PAIR(16 * (h) + 15)
static const float k_e2m1_pair[256][2] = {E2M1_ROW(0),  E2M1_ROW(1),  E2M1_ROW(2),  E2M1_ROW(3),
                                          E2M1_ROW(4),  E2M1_ROW(5),  E2M1_ROW(6),  E2M1_ROW(7),
                                          E2M1_ROW(8),  E2M1_ROW(9),  E2M1_ROW(10), E2M1_ROW(11),
                                          E2M1_ROW(12), E2M1_ROW(13), E2M1_ROW(14), E2M1_ROW(15)};

// ---- element conversions ----

uint16_t di_f32_to_bf16(float x) {
    uint32_t u = f32_bits(x);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u) {
        // NaN: keep sign and top payload bits, force the quiet bit so it cannot become inf.
        return (uint16_t)((u >> 16) | 0x0040u);
    }
    // Round to nearest even: add 0x7FFF plus the lowest kept bit, then truncate. A carry out of
    // the mantissa bumps the exponent, which is the correct result (up to inf on overflow).
    u += 0x7FFFu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

float di_bf16_to_f32(uint16_t h) {
    return f32_from_bits((uint32_t)h << 16);
}

float di_round_bf16(float x) {
    return di_bf16_to_f32(di_f32_to_bf16(x));
}

float di_f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1Fu;
    uint32_t mant = h & 0x3FFu;
    if (exp == 0) {
        // Zero or subnormal: mant · 2^-24, exact in f32.
        float mag = ldexpf((float)mant, -24);
        return sign ? -mag : mag;
    }
    if (exp == 31) return f32_from_bits(sign | 0x7F800000u | (mant << 13)); // inf / NaN
    return f32_from_bits(sign | ((exp + 112u) << 23) | (mant << 13));       // rebias 15 -> 127
}

float di_e4m3_to_f32(uint8_t code) {
    return k_e4m3_f32[code];
}

uint8_t di_f32_to_e4m3(float x) {
    uint8_t sign = signbit(x) ? 0x80u : 0x00u;
    if (isnan(x)) return (uint8_t)(sign | 0x7Fu);
    float a = fabsf(x);
    if (a > 448.0f) a = 448.0f; // saturate (also ±inf) before rounding
    if (a < 0x1p-6f) {
        // Subnormal range: the grid is k · 2^-9, k = 0..8; k = 8 is code 0x08 = 2^-6, the smallest
        // normal, so the code is k itself. a · 2^9 is exact.
        return (uint8_t)(sign | (uint8_t)round_half_even(a * 0x1p9f));
    }
    // Normal: a = m · 2^e with m in [1, 2); the 3-bit mantissa is round((m - 1) · 8). Codes are
    // monotone in the value, so a mantissa carry (q == 8) correctly lands on the next exponent.
    // a <= 448 = 1.75 · 2^8 keeps the result at most 0x7E.
    int e;
    float f = frexpf(a, &e); // a = f · 2^e, f in [0.5, 1)
    float q = round_half_even((2.0f * f - 1.0f) * 8.0f);
    int code = ((e - 1 + 7) << 3) + (int)q;
    return (uint8_t)(sign | (uint8_t)code);
}

float di_e2m1_to_f32(uint8_t code) {
    return k_e2m1_f32[code & 0x0Fu];
}

uint8_t di_f32_to_e2m1(float x) {
    if (isnan(x)) return 0;
    uint8_t sign = signbit(x) ? 0x08u : 0x00u;
    float a = fabsf(x);
    if (a > 6.0f) a = 6.0f;
    // Walk up the grid: stop at the first code whose upper midpoint is above a; on a midpoint
    // pick the even code of the two neighbours.
    uint8_t c = 0;
    while (c < 7) {
        float mid = 0.5f * (k_e2m1_mag[c] + k_e2m1_mag[c + 1]); // exact: few mantissa bits
        if (a < mid) break;
        if (a == mid) {
            if (c & 1u) c++;
            break;
        }
        c++;
    }
    return (uint8_t)(sign | c);
}

int di_ceil_log2_bits(float x) {
    DI_ASSERT(x > 0.0f && isnormal(x));
    uint32_t u = f32_bits(x);
    int exp = (int)((u >> 23) & 0xFFu) - 127;
    return exp + ((u & 0x7FFFFFu) != 0);
}

// ---- fake quantisation ----

// One quantiser serves the fake quant (codes NULL) and the packers (codes and scale given), so a
// packed row is by construction the fake-quantised one: every value is lut[code] · scale, and the
// unpackers compute that same exact product.
typedef struct fq_format {
    float qmax;               // largest magnitude of the grid: 448 (e4m3) or 6 (e2m1)
    float inv_qmax;           // fl32(1 / qmax): R-OFF multiplies by the reciprocal (spec §5.15)
    float amax_floor;         // 1e-4 (FP8) or 6 · 2^-126 (FP4)
    uint8_t (*encode)(float); // a value in [-qmax, qmax] -> the code of its nearest grid point
    const float *decode;      // code -> grid value
    bool nibbles;             // 4-bit codes, two per byte (low nibble = even element)
} fq_format;

static const fq_format k_fmt_q8 = {448.0f, 1.0f / 448.0f, 1e-4f, di_f32_to_e4m3, k_e4m3_f32, false};
static const fq_format k_fmt_q4 = {6.0f,           1.0f / 6.0f, 6.0f * 0x1p-126f,
                                   di_f32_to_e2m1, k_e2m1_f32,  true};

// Code j of a block goes to codes[j] (bytes) or the nibble j of codes (pairs; blocks are even).
static void put_code(uint8_t *codes, int64_t j, uint8_t code, bool nibbles) {
    if (!nibbles)
        codes[j] = code;
    else if (j & 1)
        codes[j >> 1] |= (uint8_t)(code << 4);
    else
        codes[j >> 1] = code;
}

// Fake-quantises one block of n values in place; with codes, also writes its codes (n bytes or
// n / 2 pair bytes) and its UE8M0 scale byte (0xFF, NaN, for a non-finite block, whose codes are
// 0).
static void fake_quant_block(float *v, int64_t n, const fq_format *fmt, uint8_t *codes,
                             uint8_t *scale) {
    float amax = 0.0f;
    for (int64_t j = 0; j < n; j++) {
        if (!isfinite(v[j])) {
            // The PyTorch reference's amax is inf or NaN here, its scale too, and every v/s · s
            // turns into NaN; do the same instead of quietly hiding the bad value.
            for (int64_t k = 0; k < n; k++) v[k] = NAN;
            if (codes) {
                memset(codes, 0, (size_t)(fmt->nibbles ? n / 2 : n));
                *scale = 0xFF;
            }
            return;
        }
        float a = fabsf(v[j]);
        if (a > amax) amax = a;
    }
    if (amax < fmt->amax_floor) amax = fmt->amax_floor;
    float ratio = amax * fmt->inv_qmax; // one f32 rounding, as fl32(amax · fl32(1/qmax))
    int e = di_ceil_log2_bits(ratio);   // -126 .. 126 (the floors keep ratio normal)
    float s = ldexpf(1.0f, e);
    for (int64_t j = 0; j < n; j++) {
        float x = v[j] / s; // exact: s is a power of two and the quotient stays normal or zero
        if (x > fmt->qmax) x = fmt->qmax;
        if (x < -fmt->qmax) x = -fmt->qmax;
        uint8_t code = fmt->encode(x);
        v[j] = fmt->decode[code] * s; // exact: a few mantissa bits times a power of two
        if (codes) put_code(codes, j, code, fmt->nibbles);
    }
    if (codes) *scale = (uint8_t)(e + 127);
}

// Blocks of v; with out, the packed row: the codes of all blocks, then their scale bytes.
static void fake_quant(float *v, int64_t n, int64_t block, const fq_format *fmt, uint8_t *out) {
    DI_ASSERT(block > 0 && n >= 0 && n % block == 0 && (!fmt->nibbles || block % 2 == 0));
    const int64_t code_bytes = fmt->nibbles ? n / 2 : n;
    for (int64_t i = 0; i < n; i += block)
        fake_quant_block(v + i, block, fmt, out ? out + (fmt->nibbles ? i / 2 : i) : NULL,
                         out ? out + code_bytes + i / block : NULL);
}

void di_fake_quant_q8(float *v, int64_t n, int64_t block) {
    fake_quant(v, n, block, &k_fmt_q8, NULL);
}

void di_fake_quant_q4(float *v, int64_t n, int64_t block) {
    fake_quant(v, n, block, &k_fmt_q4, NULL);
}

void di_act_quant_a8(float *v, int64_t n) {
    di_fake_quant_q8(v, n, 128);
}

// One Q4e block in place; with codes, its e2m1 pair bytes and E4M3 scale byte (0x7F, NaN, for a
// non-finite block, whose codes are 0).
static void q4e_block(float *b, int64_t block, uint8_t *codes, uint8_t *scale) {
    float amax = 0.0f;
    bool finite = true;
    for (int64_t j = 0; j < block; j++) {
        finite &= isfinite(b[j]) != 0;
        if (fabsf(b[j]) > amax) amax = fabsf(b[j]);
    }
    if (!finite) {
        for (int64_t j = 0; j < block; j++) b[j] = NAN;
        if (codes) {
            memset(codes, 0, (size_t)(block / 2));
            *scale = 0x7F;
        }
        return;
    }
    if (amax < 6.0f * 0x1p-9f) amax = 6.0f * 0x1p-9f;
    // A true E4M3 scale by division (not a power of two), saturating at 448; never 0 (the floor
    // gives the smallest subnormal 2^-9) and never NaN.
    uint8_t sc = di_f32_to_e4m3(amax / 6.0f);
    float s = k_e4m3_f32[sc];
    for (int64_t j = 0; j < block; j++) {
        float x = b[j] / s;
        if (x > 6.0f) x = 6.0f;
        if (x < -6.0f) x = -6.0f;
        uint8_t code = di_f32_to_e2m1(x);
        b[j] = k_e2m1_f32[code] * s; // exact: 2 significant bits times 4
        if (codes) put_code(codes, j, code, true);
    }
    if (codes) *scale = sc;
}

static void fake_quant_q4e(float *v, int64_t n, int64_t block, uint8_t *out) {
    DI_ASSERT(block > 0 && n >= 0 && n % block == 0 && (!out || block % 2 == 0));
    for (int64_t i = 0; i < n; i += block)
        q4e_block(v + i, block, out ? out + i / 2 : NULL, out ? out + n / 2 + i / block : NULL);
}

void di_fake_quant_q4e(float *v, int64_t n, int64_t block) {
    fake_quant_q4e(v, n, block, NULL);
}

// ---- packed rows ----

void di_quant_q8_pack(float *v, int64_t n, int64_t block, uint8_t *out) {
    fake_quant(v, n, block, &k_fmt_q8, out);
}

void di_quant_q4_pack(float *v, int64_t n, int64_t block, uint8_t *out) {
    fake_quant(v, n, block, &k_fmt_q4, out);
}

void di_quant_q4e_pack(float *v, int64_t n, int64_t block, uint8_t *out) {
    fake_quant_q4e(v, n, block, out);
}

size_t di_quant_q8_row_bytes(int64_t n, int64_t block) {
    return (size_t)(n + n / block);
}

size_t di_quant_q4_row_bytes(int64_t n, int64_t block) {
    return (size_t)(n / 2 + n / block);
}

size_t di_quant_q4e_row_bytes(int64_t n, int64_t block) {
    return (size_t)(n / 2 + n / block);
}

// Every value is lut[code] · scale: the product the quantiser formed, exact in f32. A NaN scale
// (a non-finite block) makes the block NaN, written as the quantiser writes it (not left to the
// multiplication, whose NaN payload is the hardware's choice).
void di_quant_q8_unpack(const uint8_t *restrict in, int64_t n, int64_t block, float *restrict v) {
    DI_ASSERT(block > 0 && n >= 0 && n % block == 0);
    const uint8_t *sc = in + n;
    for (int64_t i = 0; i < n; i += block) {
        const uint8_t u = sc[i / block];
        if (u == 0xFF) {
            for (int64_t j = 0; j < block; j++) v[i + j] = NAN;
            continue;
        }
        const float s = di_ue8m0_f32_table[u];
        for (int64_t j = 0; j < block; j++) v[i + j] = k_e4m3_f32[in[i + j]] * s;
    }
}

// The e2m1 pair rows of Q4 and Q4e: the scale table and NaN byte differ.
static void unpack_e2m1(const uint8_t *restrict in, int64_t n, int64_t block,
                        const float *restrict scale_lut, uint8_t nan_byte, float *restrict v) {
    DI_ASSERT(block > 0 && n >= 0 && n % block == 0 && block % 2 == 0);
    const uint8_t *sc = in + n / 2;
    for (int64_t i = 0; i < n; i += block) {
        const uint8_t u = sc[i / block];
        if (u == nan_byte) {
            for (int64_t j = 0; j < block; j++) v[i + j] = NAN;
            continue;
        }
        // Copy the code values a byte (two floats) at a time, then scale the block: the same
        // products as k_e2m1_f32[code] · s, in a loop the compiler vectorises.
        const float s = scale_lut[u];
        const uint8_t *p = in + i / 2;
        float *b = v + i;
        for (int64_t j = 0; j < block / 2; j++)
            memcpy(b + 2 * j, k_e2m1_pair[p[j]], 2 * sizeof(float));
        for (int64_t j = 0; j < block; j++) b[j] *= s;
    }
}

void di_quant_q4_unpack(const uint8_t *restrict in, int64_t n, int64_t block, float *restrict v) {
    unpack_e2m1(in, n, block, di_ue8m0_f32_table, 0xFF, v);
}

void di_quant_q4e_unpack(const uint8_t *restrict in, int64_t n, int64_t block, float *restrict v) {
    unpack_e2m1(in, n, block, k_e4m3_f32, 0x7F, v);
}

// ---- Hadamard ----

void di_hadamard(float *v, int64_t n) {
    DI_ASSERT(n >= 1 && (n & (n - 1)) == 0);
    // Butterfly on H_2n = [[H_n, H_n], [H_n, -H_n]]: after the stage of half-width h, element i
    // carries the signs (-1)^popcount(i & j) for the bits below 2h, giving natural order.
    for (int64_t h = 1; h < n; h *= 2) {
        for (int64_t i = 0; i < n; i += 2 * h) {
            for (int64_t j = i; j < i + h; j++) {
                float a = v[j], b = v[j + h];
                v[j] = a + b;
                v[j + h] = a - b;
            }
        }
    }
    float scale = (float)(1.0 / sqrt((double)n)); // fl32(n^-1/2), correctly rounded
    for (int64_t i = 0; i < n; i++) v[i] *= scale;
}

// ---- row dequantisation ----

void di_dequant_row_f32(di_dtype dtype, const void *row, int64_t n, float *restrict out) {
    DI_ASSERT(n >= 0);
    DI_ASSERT(dtype == DI_DTYPE_F32 || dtype == DI_DTYPE_F16 || dtype == DI_DTYPE_BF16);
    switch (dtype) {
    case DI_DTYPE_F32:
        memcpy(out, row, (size_t)n * sizeof(float));
        return;
    // safetensors does not align tensor data, so 16-bit elements are loaded with memcpy (a plain
    // load on x86 and ARM64, and defined behaviour at any address).
    case DI_DTYPE_F16: {
        const unsigned char *b = row;
        for (int64_t i = 0; i < n; i++) {
            uint16_t h;
            memcpy(&h, b + 2 * i, 2);
            out[i] = di_f16_to_f32(h);
        }
        return;
    }
    case DI_DTYPE_BF16: {
        const unsigned char *b = row;
        for (int64_t i = 0; i < n; i++) {
            uint16_t h;
            memcpy(&h, b + 2 * i, 2);
            out[i] = di_bf16_to_f32(h);
        }
        return;
    }
    default:
        return; // excluded by the assertion above
    }
}

void di_dequant_row_fp8(const uint8_t *restrict row, const uint8_t *restrict scale_row, int64_t n,
                        int64_t block, float *restrict out) {
    DI_ASSERT(n >= 0 && block > 0);
    for (int64_t i = 0; i < n; i++) {
        out[i] = k_e4m3_f32[row[i]] * di_ue8m0_f32_table[scale_row[i / block]];
    }
}

void di_dequant_row_fp4(const uint8_t *restrict packed, const uint8_t *restrict scale_row,
                        int64_t n, int64_t block, float *restrict out) {
    DI_ASSERT(n >= 0 && n % 2 == 0 && block > 0);
    for (int64_t i = 0; i < n; i++) {
        uint8_t byte = packed[i / 2];
        uint8_t code = (i & 1) ? (uint8_t)(byte >> 4) : (uint8_t)(byte & 0x0Fu); // low = even
        out[i] = di_e2m1_to_f32(code) * di_ue8m0_f32_table[scale_row[i / block]];
    }
}

// ---- ggml block formats ----

// ggml's iq2xxs_grid (ggml-common.h, MIT licence, llama.cpp 0c1e57098): the 256 8-value patterns of
// IQ2_XXS. Generated by a script from the ggml source; each byte is 0x08, 0x19 or 0x2b.
static const uint64_t k_iq2xxs_grid[256] = {
    0x0808080808080808ull, 0x080808080808082bull, 0x0808080808081919ull, 0x0808080808082b08ull,
    0x0808080808082b2bull, 0x0808080808190819ull, 0x0808080808191908ull, 0x08080808082b0808ull,
    0x08080808082b082bull, 0x08080808082b2b08ull, 0x08080808082b2b2bull, 0x0808080819080819ull,
    0x0808080819081908ull, 0x0808080819190808ull, 0x0808080819192b08ull, 0x08080808192b0819ull,
    0x08080808192b1908ull, 0x080808082b080808ull, 0x080808082b08082bull, 0x080808082b082b2bull,
    0x080808082b2b082bull, 0x0808081908080819ull, 0x0808081908081908ull, 0x0808081908190808ull,
    0x0808081908191919ull, 0x0808081919080808ull, 0x080808192b081908ull, 0x080808192b192b08ull,
    0x0808082b08080808ull, 0x0808082b0808082bull, 0x0808082b082b082bull, 0x0808082b2b08082bull,
    0x0808190808080819ull, 0x0808190808081908ull, 0x0808190808190808ull, 0x08081908082b0819ull,
    0x08081908082b1908ull, 0x0808190819080808ull, 0x080819081908082bull, 0x0808190819082b08ull,
    0x08081908192b0808ull, 0x080819082b080819ull, 0x080819082b081908ull, 0x080819082b190808ull,
    0x080819082b2b1908ull, 0x0808191908080808ull, 0x080819190808082bull, 0x0808191908082b08ull,
    0x08081919082b0808ull, 0x080819191908192bull, 0x08081919192b2b19ull, 0x080819192b080808ull,
    0x080819192b190819ull, 0x0808192b08082b19ull, 0x0808192b08190808ull, 0x0808192b19080808ull,
    0x0808192b2b081908ull, 0x0808192b2b2b1908ull, 0x08082b0808080808ull, 0x08082b0808081919ull,
    0x08082b0808082b08ull, 0x08082b0808191908ull, 0x08082b08082b2b08ull, 0x08082b0819080819ull,
    0x08082b0819081908ull, 0x08082b0819190808ull, 0x08082b081919082bull, 0x08082b082b082b08ull,
    0x08082b1908081908ull, 0x08082b1919080808ull, 0x08082b2b0808082bull, 0x08082b2b08191908ull,
    0x0819080808080819ull, 0x0819080808081908ull, 0x0819080808190808ull, 0x08190808082b0819ull,
    0x0819080819080808ull, 0x08190808192b0808ull, 0x081908082b081908ull, 0x081908082b190808ull,
    0x081908082b191919ull, 0x0819081908080808ull, 0x0819081908082b08ull, 0x08190819082b0808ull,
    0x0819081919190808ull, 0x0819081919192b2bull, 0x081908192b080808ull, 0x0819082b082b1908ull,
    0x0819082b19081919ull, 0x0819190808080808ull, 0x0819190808082b08ull, 0x08191908082b0808ull,
    0x08191908082b1919ull, 0x0819190819082b19ull, 0x081919082b080808ull, 0x0819191908192b08ull,
    0x08191919192b082bull, 0x0819192b08080808ull, 0x0819192b0819192bull, 0x08192b0808080819ull,
    0x08192b0808081908ull, 0x08192b0808190808ull, 0x08192b0819080808ull, 0x08192b082b080819ull,
    0x08192b1908080808ull, 0x08192b1908081919ull, 0x08192b192b2b0808ull, 0x08192b2b19190819ull,
    0x082b080808080808ull, 0x082b08080808082bull, 0x082b080808082b2bull, 0x082b080819081908ull,
    0x082b0808192b0819ull, 0x082b08082b080808ull, 0x082b08082b08082bull, 0x082b0819082b2b19ull,
    0x082b081919082b08ull, 0x082b082b08080808ull, 0x082b082b0808082bull, 0x082b190808080819ull,
    0x082b190808081908ull, 0x082b190808190808ull, 0x082b190819080808ull, 0x082b19081919192bull,
    0x082b191908080808ull, 0x082b191919080819ull, 0x082b1919192b1908ull, 0x082b192b2b190808ull,
    0x082b2b0808082b08ull, 0x082b2b08082b0808ull, 0x082b2b082b191908ull, 0x082b2b2b19081908ull,
    0x1908080808080819ull, 0x1908080808081908ull, 0x1908080808190808ull, 0x1908080808192b08ull,
    0x19080808082b0819ull, 0x19080808082b1908ull, 0x1908080819080808ull, 0x1908080819082b08ull,
    0x190808081919192bull, 0x19080808192b0808ull, 0x190808082b080819ull, 0x190808082b081908ull,
    0x190808082b190808ull, 0x1908081908080808ull, 0x19080819082b0808ull, 0x19080819192b0819ull,
    0x190808192b080808ull, 0x190808192b081919ull, 0x1908082b08080819ull, 0x1908082b08190808ull,
    0x1908082b19082b08ull, 0x1908082b1919192bull, 0x1908082b192b2b08ull, 0x1908190808080808ull,
    0x1908190808082b08ull, 0x19081908082b0808ull, 0x190819082b080808ull, 0x190819082b192b19ull,
    0x190819190819082bull, 0x19081919082b1908ull, 0x1908192b08080808ull, 0x19082b0808080819ull,
    0x19082b0808081908ull, 0x19082b0808190808ull, 0x19082b0819080808ull, 0x19082b0819081919ull,
    0x19082b1908080808ull, 0x19082b1919192b08ull, 0x19082b19192b0819ull, 0x19082b192b08082bull,
    0x19082b2b19081919ull, 0x19082b2b2b190808ull, 0x1919080808080808ull, 0x1919080808082b08ull,
    0x1919080808190819ull, 0x1919080808192b19ull, 0x19190808082b0808ull, 0x191908082b080808ull,
    0x191908082b082b08ull, 0x1919081908081908ull, 0x191908191908082bull, 0x191908192b2b1908ull,
    0x1919082b2b190819ull, 0x191919082b190808ull, 0x191919082b19082bull, 0x1919191908082b2bull,
    0x1919192b08080819ull, 0x1919192b19191908ull, 0x19192b0808080808ull, 0x19192b0808190819ull,
    0x19192b0808192b19ull, 0x19192b08192b1908ull, 0x19192b1919080808ull, 0x19192b2b08082b08ull,
    0x192b080808081908ull, 0x192b080808190808ull, 0x192b080819080808ull, 0x192b0808192b2b08ull,
    0x192b081908080808ull, 0x192b081919191919ull, 0x192b082b08192b08ull, 0x192b082b192b0808ull,
    0x192b190808080808ull, 0x192b190808081919ull, 0x192b191908190808ull, 0x192b19190819082bull,
    0x192b19192b081908ull, 0x192b2b081908082bull, 0x2b08080808080808ull, 0x2b0808080808082bull,
    0x2b08080808082b2bull, 0x2b08080819080819ull, 0x2b0808082b08082bull, 0x2b08081908081908ull,
    0x2b08081908192b08ull, 0x2b08081919080808ull, 0x2b08082b08190819ull, 0x2b08190808080819ull,
    0x2b08190808081908ull, 0x2b08190808190808ull, 0x2b08190808191919ull, 0x2b08190819080808ull,
    0x2b081908192b0808ull, 0x2b08191908080808ull, 0x2b0819191908192bull, 0x2b0819192b191908ull,
    0x2b08192b08082b19ull, 0x2b08192b19080808ull, 0x2b08192b192b0808ull, 0x2b082b080808082bull,
    0x2b082b1908081908ull, 0x2b082b2b08190819ull, 0x2b19080808081908ull, 0x2b19080808190808ull,
    0x2b190808082b1908ull, 0x2b19080819080808ull, 0x2b1908082b2b0819ull, 0x2b1908190819192bull,
    0x2b1908192b080808ull, 0x2b19082b19081919ull, 0x2b19190808080808ull, 0x2b191908082b082bull,
    0x2b19190819081908ull, 0x2b19191919190819ull, 0x2b192b082b080819ull, 0x2b192b19082b0808ull,
    0x2b2b08080808082bull, 0x2b2b080819190808ull, 0x2b2b08082b081919ull, 0x2b2b081908082b19ull,
    0x2b2b082b08080808ull, 0x2b2b190808192b08ull, 0x2b2b2b0819190808ull, 0x2b2b2b1908081908ull,
};

uint64_t di_iq2xxs_grid(int i) {
    DI_ASSERT(i >= 0 && i < 256);
    return k_iq2xxs_grid[i];
}

uint8_t di_iq2xs_signs(int i) {
    DI_ASSERT(i >= 0 && i < 128);
    return (uint8_t)(i | ((__builtin_popcount((unsigned)i) & 1) << 7));
}

static float ld_f16(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return di_f16_to_f32(h);
}

void di_dequant_row_q8_0(const uint8_t *restrict row, int64_t n, float *restrict out) {
    DI_ASSERT(n % 32 == 0);
    for (int64_t b = 0; b < n / 32; b++) {
        const uint8_t *blk = row + 34 * b;
        const float d = ld_f16(blk);
        for (int j = 0; j < 32; j++) out[32 * b + j] = (float)(int8_t)blk[2 + j] * d;
    }
}

void di_dequant_row_q4_k(const uint8_t *restrict row, int64_t n, float *restrict out) {
    DI_ASSERT(n % 256 == 0);
    for (int64_t b = 0; b < n / 256; b++) {
        const uint8_t *blk = row + 144 * b;
        const float d = ld_f16(blk), dmin = ld_f16(blk + 2);
        const uint8_t *scales = blk + 4, *q = blk + 16;
        float *y = out + 256 * b;
        for (int j = 0; j < 8; j += 2) {
            uint8_t sc, m;
            di_q4_k_scale_min(j, scales, &sc, &m);
            const float d1 = d * sc, m1 = dmin * m;
            di_q4_k_scale_min(j + 1, scales, &sc, &m);
            const float d2 = d * sc, m2 = dmin * m;
            for (int l = 0; l < 32; l++) {
                const float t = d1 * (float)(q[l] & 0xF);
                *y++ = t - m1;
            }
            for (int l = 0; l < 32; l++) {
                const float t = d2 * (float)(q[l] >> 4);
                *y++ = t - m2;
            }
            q += 32;
        }
    }
}

void di_dequant_row_q2_k(const uint8_t *restrict row, int64_t n, float *restrict out) {
    DI_ASSERT(n % 256 == 0);
    for (int64_t b = 0; b < n / 256; b++) {
        const uint8_t *blk = row + 84 * b;
        const uint8_t *scales = blk, *q = blk + 16;
        const float d = ld_f16(blk + 80), dmin = ld_f16(blk + 82);
        float *y = out + 256 * b;
        int is = 0;
        for (int h = 0; h < 2; h++) { // two halves of 128 values, 32 code bytes each
            for (int shift = 0; shift < 8; shift += 2) {
                for (int part = 0; part < 2; part++) {
                    const uint8_t sc = scales[is++];
                    const float dl = d * (float)(sc & 0xF), ml = dmin * (float)(sc >> 4);
                    for (int l = 0; l < 16; l++) {
                        const float t = dl * (float)((q[16 * part + l] >> shift) & 3);
                        *y++ = t - ml;
                    }
                }
            }
            q += 32;
        }
    }
}

void di_dequant_row_iq2_xxs(const uint8_t *restrict row, int64_t n, float *restrict out) {
    DI_ASSERT(n % 256 == 0);
    for (int64_t b = 0; b < n / 256; b++) {
        const uint8_t *blk = row + 66 * b;
        const float d = ld_f16(blk);
        float *y = out + 256 * b;
        for (int ib = 0; ib < 8; ib++) {
            uint32_t aux[2];
            memcpy(aux, blk + 2 + 8 * ib, 8);
            const uint8_t *idx = (const uint8_t *)aux; // little-endian: bytes of aux[0]
            const float t = d * (0.5f + (float)(aux[1] >> 28));
            const float db = t * 0.25f;
            for (int l = 0; l < 4; l++) {
                const uint64_t g = k_iq2xxs_grid[idx[l]];
                const uint8_t signs = di_iq2xs_signs((int)((aux[1] >> (7 * l)) & 127));
                for (int j = 0; j < 8; j++) {
                    const float v = db * (float)((g >> (8 * j)) & 0xFF);
                    *y++ = v * ((signs >> j) & 1 ? -1.0f : 1.0f);
                }
            }
        }
    }
}

// ggml's kvalues_mxfp4: the e2m1 values doubled.
static const int8_t k_mxfp4_vals[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

void di_dequant_row_mxfp4(const uint8_t *restrict row, int64_t n, float *restrict out) {
    const int8_t *k_vals = k_mxfp4_vals;
    DI_ASSERT(n % 32 == 0);
    for (int64_t b = 0; b < n / 32; b++) {
        const uint8_t *blk = row + 17 * b;
        const float d = di_mxfp4_scale(blk[0]);
        for (int j = 0; j < 16; j++) {
            out[32 * b + j] = (float)k_vals[blk[1 + j] & 0xF] * d;
            out[32 * b + j + 16] = (float)k_vals[blk[1 + j] >> 4] * d;
        }
    }
}

uint16_t di_f32_to_f16(float x) {
    uint32_t u = f32_bits(x);
    uint16_t sign = (uint16_t)((u >> 16) & 0x8000u);
    uint32_t a = u & 0x7FFFFFFFu;
    if (a > 0x7F800000u) return (uint16_t)(sign | 0x7E00u);  // NaN
    if (a >= 0x477FF000u) return (uint16_t)(sign | 0x7C00u); // rounds to >= 65520: inf
    if (a < 0x38800000u) {                                   // below 2^-14: subnormal or zero
        // value / 2^-24 rounded to nearest even, computed exactly in f32 by scaling.
        float m = f32_from_bits(a) * 0x1p24f; // < 1024, exact
        float q = round_half_even(m);
        return (uint16_t)(sign | (uint16_t)q);
    }
    uint32_t exp = (a >> 23) - 112u; // rebias 127 -> 15
    uint32_t mant = a & 0x7FFFFFu;
    uint32_t h = (exp << 10) | (mant >> 13);
    uint32_t rem = mant & 0x1FFFu;
    if (rem > 0x1000u || (rem == 0x1000u && (h & 1))) h++; // carries into the exponent correctly
    return (uint16_t)(sign | h);
}

void di_quant_row_q8_0(const float *restrict x, int64_t n, uint8_t *restrict out) {
    DI_ASSERT(n % 32 == 0);
    for (int64_t b = 0; b < n / 32; b++) {
        const float *v = x + 32 * b;
        uint8_t *blk = out + 34 * b;
        float amax = 0;
        for (int j = 0; j < 32; j++) amax = fmaxf(amax, fabsf(v[j]));
        const float d = amax / 127.0f;
        uint16_t h = di_f32_to_f16(d);
        memcpy(blk, &h, 2);
        const float dq = di_f16_to_f32(h);
        for (int j = 0; j < 32; j++) {
            float q = dq > 0 ? v[j] / dq : 0.0f;
            q = q < -127.0f ? -127.0f : q > 127.0f ? 127.0f : q;
            blk[2 + j] = (uint8_t)(int8_t)lrintf(q);
        }
    }
}

void di_quant_row_q4_k(const float *restrict x, int64_t n, uint8_t *restrict out) {
    DI_ASSERT(n % 256 == 0);
    for (int64_t b = 0; b < n / 256; b++) {
        const float *v = x + 256 * b;
        uint8_t *blk = out + 144 * b;
        float scale[8], min[8], max_scale = 0, max_min = 0;
        for (int s = 0; s < 8; s++) {
            float lo = 0, hi = 0; // the range always includes 0 so min >= 0 below
            for (int l = 0; l < 32; l++) {
                lo = fminf(lo, v[32 * s + l]);
                hi = fmaxf(hi, v[32 * s + l]);
            }
            scale[s] = (hi - lo) / 15.0f;
            min[s] = -lo;
            max_scale = fmaxf(max_scale, scale[s]);
            max_min = fmaxf(max_min, min[s]);
        }
        uint16_t hd = di_f32_to_f16(max_scale / 63.0f), hm = di_f32_to_f16(max_min / 63.0f);
        memcpy(blk, &hd, 2);
        memcpy(blk + 2, &hm, 2);
        const float d = di_f16_to_f32(hd), dmin = di_f16_to_f32(hm);
        uint8_t ls[8], lm[8];
        for (int s = 0; s < 8; s++) {
            long a = d > 0 ? lrintf(scale[s] / d) : 0, m = dmin > 0 ? lrintf(min[s] / dmin) : 0;
            ls[s] = (uint8_t)(a < 0 ? 0 : a > 63 ? 63 : a);
            lm[s] = (uint8_t)(m < 0 ? 0 : m > 63 ? 63 : m);
        }
        uint8_t *sc = blk + 4;
        for (int j = 0; j < 4; j++) {
            sc[j] = (uint8_t)(ls[j] | ((ls[j + 4] >> 4) << 6));
            sc[j + 4] = (uint8_t)(lm[j] | ((lm[j + 4] >> 4) << 6));
            sc[j + 8] = (uint8_t)((ls[j + 4] & 0xF) | ((lm[j + 4] & 0xF) << 4));
        }
        uint8_t *q = blk + 16;
        for (int s = 0; s < 8; s++) {
            const float ds = d * ls[s], ms = dmin * lm[s];
            for (int l = 0; l < 32; l++) {
                long c = ds > 0 ? lrintf((v[32 * s + l] + ms) / ds) : 0;
                uint8_t code = (uint8_t)(c < 0 ? 0 : c > 15 ? 15 : c);
                uint8_t *dst = q + 32 * (s / 2) + l;
                if (s % 2 == 0)
                    *dst = code;
                else
                    *dst = (uint8_t)(*dst | (code << 4));
            }
        }
    }
}

void di_repack_row_fp4_mxfp4(const uint8_t *restrict packed, const uint8_t *restrict scale_row,
                             int64_t n, uint8_t *restrict out) {
    DI_ASSERT(n % 32 == 0);
    for (int64_t b = 0; b < n / 32; b++) {
        uint8_t *blk = out + 17 * b;
        const uint8_t *p = packed + 16 * b; // 32 codes, two per byte, column order
        blk[0] = scale_row[b];              // e2m1(c) * 2^(u-127) = 2*e2m1(c) * 2^(u-128)
        for (int j = 0; j < 16; j++) {
            uint8_t lo = (uint8_t)(j & 1 ? p[j / 2] >> 4 : p[j / 2] & 15);
            uint8_t hi = (uint8_t)((j + 16) & 1 ? p[(j + 16) / 2] >> 4 : p[(j + 16) / 2] & 15);
            blk[1 + j] = (uint8_t)(lo | (hi << 4));
        }
    }
}

// ---- 8-bit activations and integer weight codes ----

void di_quant_act_q8(const float *restrict x, int64_t n, int8_t *restrict q, float *restrict d) {
    DI_ASSERT(n % 32 == 0);
    for (int64_t b = 0; b < n / 32; b++) {
        const float *v = x + 32 * b;
        float amax = 0;
        for (int j = 0; j < 32; j++) amax = fmaxf(amax, fabsf(v[j]));
        const float dr = amax / 127.0f;
        d[b] = di_f16_to_f32(di_f32_to_f16(dr));
        const float id = d[b] != 0 ? 1.0f / dr : 0.0f;
        for (int j = 0; j < 32; j++) {
            const float s = v[j] * id;
            const float r = s + copysignf(0x1.fffffep-2f, s); // 0.5 - 2^-25
            q[32 * b + j] = (int8_t)(int)r;                   // truncation toward zero
        }
    }
}

void di_codes_row_q8_0(const uint8_t *restrict row, int64_t n, int8_t *restrict q,
                       float *restrict d) {
    DI_ASSERT(n % 32 == 0);
    for (int64_t b = 0; b < n / 32; b++) {
        const uint8_t *blk = row + 34 * b;
        d[b] = ld_f16(blk);
        memcpy(q + 32 * b, blk + 2, 32);
    }
}

void di_codes_row_mxfp4(const uint8_t *restrict row, int64_t n, int8_t *restrict q,
                        float *restrict d) {
    DI_ASSERT(n % 32 == 0);
    for (int64_t b = 0; b < n / 32; b++) {
        const uint8_t *blk = row + 17 * b;
        d[b] = di_mxfp4_scale(blk[0]);
        for (int j = 0; j < 16; j++) {
            q[32 * b + j] = k_mxfp4_vals[blk[1 + j] & 0xF];
            q[32 * b + j + 16] = k_mxfp4_vals[blk[1 + j] >> 4];
        }
    }
}

void di_quant_act_q8_k(const float *restrict x, int64_t n, int8_t *restrict q, float *restrict d,
                       int16_t *restrict bsums) {
    DI_ASSERT(n % 256 == 0);
    for (int64_t b = 0; b < n / 256; b++) {
        const float *v = x + 256 * b;
        int8_t *qb = q + 256 * b;
        float amax = 0, mx = 0;
        for (int j = 0; j < 256; j++)
            if (fabsf(v[j]) > amax) amax = fabsf(v[j]), mx = v[j];
        if (amax == 0) {
            d[b] = 0;
            memset(qb, 0, 256);
            memset(bsums + 16 * b, 0, 16 * sizeof(int16_t));
            continue;
        }
        const float is = -127.0f / mx;
        for (int j = 0; j < 256; j++) {
            const float r = round_half_even(is * v[j]);
            qb[j] = (int8_t)(r > 127.0f ? 127 : (int)r);
        }
        for (int k = 0; k < 16; k++) {
            int s = 0;
            for (int j = 0; j < 16; j++) s += qb[16 * k + j];
            bsums[16 * b + k] = (int16_t)s;
        }
        d[b] = 1.0f / is;
    }
}
