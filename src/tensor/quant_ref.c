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
static const float k_ue8m0_f32[256] = {
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
    float mag = k_e2m1_mag[code & 7u];
    return (code & 8u) ? -mag : mag;
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

float di_ue8m0_to_f32(uint8_t u) {
    return k_ue8m0_f32[u];
}

int di_ceil_log2_bits(float x) {
    DI_ASSERT(x > 0.0f && isnormal(x));
    uint32_t u = f32_bits(x);
    int exp = (int)((u >> 23) & 0xFFu) - 127;
    return exp + ((u & 0x7FFFFFu) != 0);
}

// ---- fake quantisation ----

typedef struct fq_format {
    float qmax;              // largest magnitude of the grid: 448 (e4m3) or 6 (e2m1)
    float inv_qmax;          // fl32(1 / qmax): R-OFF multiplies by the reciprocal (spec §5.15)
    float amax_floor;        // 1e-4 (FP8) or 6 · 2^-126 (FP4)
    float (*to_grid)(float); // round a value in [-qmax, qmax] to the nearest grid point
} fq_format;

static float e4m3_grid(float x) {
    return di_e4m3_to_f32(di_f32_to_e4m3(x));
}

static float e2m1_grid(float x) {
    return di_e2m1_to_f32(di_f32_to_e2m1(x));
}

static void fake_quant_block(float *v, int64_t n, const fq_format *fmt) {
    float amax = 0.0f;
    for (int64_t j = 0; j < n; j++) {
        if (!isfinite(v[j])) {
            // The PyTorch reference's amax is inf or NaN here, its scale too, and every v/s · s
            // turns into NaN; do the same instead of quietly hiding the bad value.
            for (int64_t k = 0; k < n; k++) v[k] = NAN;
            return;
        }
        float a = fabsf(v[j]);
        if (a > amax) amax = a;
    }
    if (amax < fmt->amax_floor) amax = fmt->amax_floor;
    float ratio = amax * fmt->inv_qmax; // one f32 rounding, as fl32(amax · fl32(1/qmax))
    float s = ldexpf(1.0f, di_ceil_log2_bits(ratio));
    for (int64_t j = 0; j < n; j++) {
        float x = v[j] / s; // exact: s is a power of two and the quotient stays normal or zero
        if (x > fmt->qmax) x = fmt->qmax;
        if (x < -fmt->qmax) x = -fmt->qmax;
        v[j] = fmt->to_grid(x) * s; // exact: a few mantissa bits times a power of two
    }
}

static void fake_quant(float *v, int64_t n, int64_t block, const fq_format *fmt) {
    DI_ASSERT(block > 0 && n >= 0 && n % block == 0);
    for (int64_t i = 0; i < n; i += block) fake_quant_block(v + i, block, fmt);
}

void di_fake_quant_q8(float *v, int64_t n, int64_t block) {
    static const fq_format k_q8 = {448.0f, 1.0f / 448.0f, 1e-4f, e4m3_grid};
    fake_quant(v, n, block, &k_q8);
}

void di_fake_quant_q4(float *v, int64_t n, int64_t block) {
    static const fq_format k_q4 = {6.0f, 1.0f / 6.0f, 6.0f * 0x1p-126f, e2m1_grid};
    fake_quant(v, n, block, &k_q4);
}

void di_act_quant_a8(float *v, int64_t n) {
    di_fake_quant_q8(v, n, 128);
}

void di_fake_quant_q4e(float *v, int64_t n, int64_t block) {
    DI_ASSERT(block > 0 && n >= 0 && n % block == 0);
    for (int64_t i = 0; i < n; i += block) {
        float *b = v + i, amax = 0.0f;
        bool finite = true;
        for (int64_t j = 0; j < block; j++) {
            finite &= isfinite(b[j]) != 0;
            if (fabsf(b[j]) > amax) amax = fabsf(b[j]);
        }
        if (!finite) {
            for (int64_t j = 0; j < block; j++) b[j] = NAN;
            continue;
        }
        if (amax < 6.0f * 0x1p-9f) amax = 6.0f * 0x1p-9f;
        // A true E4M3 scale by division (not a power of two), saturating at 448.
        float s = di_e4m3_to_f32(di_f32_to_e4m3(amax / 6.0f));
        for (int64_t j = 0; j < block; j++) {
            float x = b[j] / s;
            if (x > 6.0f) x = 6.0f;
            if (x < -6.0f) x = -6.0f;
            b[j] = e2m1_grid(x) * s; // exact: 2 significant bits times 4
        }
    }
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
        out[i] = k_e4m3_f32[row[i]] * k_ue8m0_f32[scale_row[i / block]];
    }
}

void di_dequant_row_fp4(const uint8_t *restrict packed, const uint8_t *restrict scale_row,
                        int64_t n, int64_t block, float *restrict out) {
    DI_ASSERT(n >= 0 && n % 2 == 0 && block > 0);
    for (int64_t i = 0; i < n; i++) {
        uint8_t byte = packed[i / 2];
        uint8_t code = (i & 1) ? (uint8_t)(byte >> 4) : (uint8_t)(byte & 0x0Fu); // low = even
        out[i] = di_e2m1_to_f32(code) * k_ue8m0_f32[scale_row[i / block]];
    }
}
