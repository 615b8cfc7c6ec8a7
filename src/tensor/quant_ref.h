/*
 * quant_ref — the scalar numeric primitives of the model, written to be obviously right rather
 * than fast: the oracle every optimised CPU or CUDA kernel is tested against.
 *
 * What it does (spec deepseek-v4.md §2.0, §4.3, §5 items 14–16):
 *   - element conversions: f32 <-> bf16 (round to nearest even), f16 -> f32, FP8 e4m3fn <-> f32,
 *     FP4 e2m1 <-> f32, UE8M0 scale byte -> f32;
 *   - the R-OFF fake-quantisers Q8 (e4m3, power-of-two scale per block), Q4 (e2m1, same scheme)
 *     and the activation quant A8 = Q8 with 128-element blocks;
 *   - packed rows of Q8 / Q4 / Q4e codes and scales (the V4.1 state's storage), bit-exact;
 *   - the Walsh-Hadamard transform (Sylvester order, orthonormal scale);
 *   - row dequantisation of F32/F16/BF16, FP8 block-scaled and packed FP4 weights to f32, used by
 *     the matmul reference.
 * Every result is bit-exact and deterministic: rounding is done by hand (round to nearest, ties to
 * even) and never depends on the floating-point environment's rounding mode.
 *
 * Owns: nothing but constant decode tables (e4m3, UE8M0, e2m1). No allocation.
 * Does not: quantise whole tensors, choose block layouts, thread, or vectorise; callers loop.
 * Inputs are assumed to be validated (block sizes, even lengths); violations are invariants and
 * abort through DI_ASSERT.
 *
 * Thread-safety: any thread (pure functions over caller-owned memory, constant tables).
 */
#pragma once

#include <stddef.h> // size_t
#include <stdint.h>
#include <string.h> // memcpy

#include "tensor/dtype.h" // di_dtype

// ---- element conversions ----

// f32 -> bf16 bit pattern, round to nearest, ties to even. Overflow rounds to ±inf as IEEE does;
// NaN stays NaN (the quiet bit is forced so that a signalling NaN cannot truncate to inf).
uint16_t di_f32_to_bf16(float x);

// bf16 bit pattern -> f32. Exact.
float di_bf16_to_f32(uint16_t h);

// f32 -> bf16 -> f32: the value a BF16 tensor would store. Written bf16(x) in the spec.
float di_round_bf16(float x);

// IEEE 754 binary16 bit pattern -> f32, including subnormals, ±inf and NaN. Exact.
float di_f16_to_f32(uint16_t h);

// FP8 e4m3fn byte -> f32 (spec §4.3): sign bit 7, exponent bits 6–3 (bias 7), mantissa bits 2–0;
// exponent 0 is subnormal (f/8 · 2^-6); 0x7F/0xFF are NaN; no infinities; max ±448. Exact.
float di_e4m3_to_f32(uint8_t code);

// f32 -> FP8 e4m3fn byte: clamp to ±448 (so ±inf saturates to ±448), then round to nearest,
// ties to even mantissa, on the e4m3 grid including subnormals (step 2^-9 below 2^-6). The sign
// of zero is kept (-1e-9 -> 0x80). NaN -> 0x7F (0xFF if the sign bit is set).
uint8_t di_f32_to_e4m3(float x);

// FP4 e2m1 code (low 4 bits of `code`; high bits ignored) -> f32: bit 3 is the sign, magnitude
// {0, 0.5, 1, 1.5, 2, 3, 4, 6}[code & 7]. Code 8 is -0. Exact.
float di_e2m1_to_f32(uint8_t code);

// f32 -> e2m1 code in 0..15: clamp to ±6, then round to nearest with ties to the even code
// (2.5 -> 2, 5 -> 4, 0.25 -> 0, spec §6.5). The sign of zero is kept. e2m1 has no NaN: NaN maps to
// code 0 (+0); fake-quant callers deal with non-finite blocks before getting here.
uint8_t di_f32_to_e2m1(float x);

// UE8M0 scale byte -> 2^(u-127) (spec §4.3). u = 0 gives 2^-127, an exact f32 subnormal;
// u = 255 gives NaN. Exact. Inline: the kernels look a scale up per block of 32 or 128 weights.
extern const float di_ue8m0_f32_table[256];
static inline float di_ue8m0_to_f32(uint8_t u) {
    return di_ue8m0_f32_table[u];
}

// ceil(log2(x)) read from the f32 bit pattern: biased exponent - 127 + (mantissa != 0). So an
// exact power of two gives that power and anything above it gives the next one (spec §5.15).
// Contract: x > 0 and normal (DI_ASSERT); the fake-quant floors guarantee this.
int di_ceil_log2_bits(float x);

// ---- fake quantisation (R-OFF, spec §2.0) ----

// Q8(v, block), in place over n elements (n a multiple of block, block > 0; DI_ASSERT). Per block
// of `block` contiguous elements: amax = max(max|v|, 1e-4); s =
// 2^ceil_log2(fl32(amax·fl32(1/448))); v = e4m3_RNE(clamp(v/s, ±448)) · s. Results are exact in
// BF16. A block containing inf or NaN becomes all NaN (as the PyTorch reference's NaN/inf amax
// would make it).
void di_fake_quant_q8(float *v, int64_t n, int64_t block);

// Q4(v, block), in place (model block 32; same preconditions as Q8): amax floor 6·2^-126,
// s = 2^ceil_log2(fl32(amax·fl32(1/6))), v = e2m1_RNE(clamp(v/s, ±6)) · s. Non-finite blocks
// become all NaN.
void di_fake_quant_q4(float *v, int64_t n, int64_t block);

// A8(v) = Q8(v, 128): activation quant in front of every FP8/FP4 GEMM in R-OFF. n must be a
// multiple of 128 (DI_ASSERT).
void di_act_quant_a8(float *v, int64_t n);

// Q4e(v, block), in place (DeepSeek V4.1 compressed KV, block 16; spec deepseek-v41.md §2.0):
// amax = max(max|v|, 6·2^-9); s = e4m3_RNE_sat(fl32(amax / 6)) (an E4M3 value, not a power of
// two); v = e2m1_RNE(clamp(fl32(v / s), ±6)) · s. Non-finite blocks become all NaN. n a multiple
// of block (DI_ASSERT).
void di_fake_quant_q4e(float *v, int64_t n, int64_t block);

// ---- packed rows (DeepSeek V4.1 state: docs/kv-cache.md, "DeepSeek V4.1") ----
//
// di_quant_*_pack fake-quantise v in place exactly as di_fake_quant_q8 / _q4 / _q4e do (the same
// code: the quantiser optionally emits its codes) and write the row's codes and scales to out
// (di_quant_*_row_bytes bytes). di_quant_*_unpack decode such a row to the same floats, bit for
// bit: signed zeros, subnormals, the amax floors, saturation, and non-finite blocks (all NaN,
// stored as a NaN scale) included; every value is a table entry times the block's scale, an exact
// f32 product. Packing an already fake-quantised row gives that row back. n a multiple of block
// (and block even for the 4-bit rows; DI_ASSERT). Row layouts, nb = n / block:
//   Q8:  n e4m3 code bytes, then nb UE8M0 scale bytes (2^(u-127); 0xFF: the block is NaN).
//   Q4:  n / 2 e2m1 pair bytes (low nibble = even element, as the FP4 weights:
//        di_dequant_row_fp4), then nb UE8M0 scale bytes (0xFF: NaN).
//   Q4e: n / 2 e2m1 pair bytes, then nb E4M3 scale bytes (0x7F: NaN).
// V4.1-Flash: a 512-dim window row at Q8/32 is 528 bytes (2,048 as FP32), an entry at Q4e/16 288
// and a 128-dim index key at Q4/32 68.
void di_quant_q8_pack(float *v, int64_t n, int64_t block, uint8_t *out);
void di_quant_q4_pack(float *v, int64_t n, int64_t block, uint8_t *out);
void di_quant_q4e_pack(float *v, int64_t n, int64_t block, uint8_t *out);
void di_quant_q8_unpack(const uint8_t *restrict in, int64_t n, int64_t block, float *restrict v);
void di_quant_q4_unpack(const uint8_t *restrict in, int64_t n, int64_t block, float *restrict v);
void di_quant_q4e_unpack(const uint8_t *restrict in, int64_t n, int64_t block, float *restrict v);
size_t di_quant_q8_row_bytes(int64_t n, int64_t block);
size_t di_quant_q4_row_bytes(int64_t n, int64_t block);
size_t di_quant_q4e_row_bytes(int64_t n, int64_t block);

// ---- Hadamard ----

// In place Walsh-Hadamard transform of n elements (n a power of two, n >= 1; DI_ASSERT):
// y_i = n^-1/2 · Σ_j (-1)^popcount(i & j) · v_j, Sylvester natural order (as
// fast_hadamard_transform.hadamard_transform(x, scale=n^-1/2)). Computed in f32 by the
// O(n log n) butterfly, then each output multiplied by fl32(n^-1/2). The output stays f32; the
// indexer rounds it to BF16 itself.
void di_hadamard(float *v, int64_t n);

// ---- row dequantisation (matmul reference) ----

// Converts one row of n elements of dtype F32, F16 or BF16 (`row`, borrowed, n · size bytes) to
// f32 in `out` (caller-owned, n floats). Any other dtype is an invariant violation (DI_ASSERT).
void di_dequant_row_f32(di_dtype dtype, const void *row, int64_t n, float *restrict out);

// FP8 block-scaled row: out[i] = e4m3(row[i]) · ue8m0(scale_row[i / block]). `scale_row` is the
// scale row of this output row's block (V4: block = 128, scale tensor [out/128, in/128], so the
// caller passes scale + (o / 128) · (in / 128)); it holds ceil(n / block) bytes. All pointers are
// borrowed; out has n floats.
void di_dequant_row_fp8(const uint8_t *restrict row, const uint8_t *restrict scale_row, int64_t n,
                        int64_t block, float *restrict out);

// Packed FP4 row (V4 routed experts): `packed` holds n/2 bytes (n even; DI_ASSERT), the low nibble
// of byte k is element 2k and the high nibble element 2k+1 (spec §4.3).
// out[i] = e2m1(code_i) · ue8m0(scale_row[i / block]) (V4: block = 32, one scale row per output
// row). All pointers are borrowed; out has n floats.
void di_dequant_row_fp4(const uint8_t *restrict packed, const uint8_t *restrict scale_row,
                        int64_t n, int64_t block, float *restrict out);

// ---- ggml block formats (GGUF files) ----
//
// Row dequantisation of the ggml block formats, bit-exact to ggml's dequantize_row_* (ggml-quants.c
// as of llama.cpp 0c1e57098): the same products in the same order, each rounded to f32 (no fused
// multiply-add; every product is its own statement so no compiler contracts it). `row` holds
// n / block blocks (n a multiple of the block; DI_ASSERT); out has n floats.
//   Q8_0    (32 per block, 34 bytes): f16 d, int8 q[32];            y = q * d
//   Q4_K    (256, 144 bytes): f16 d, f16 dmin, 12 bytes of 6-bit scales/mins for 8 sub-blocks of
//           32, 128 bytes of nibbles (each 32 bytes: low nibbles sub-block 2k, high 2k+1);
//           y = (d * sc) * q - (dmin * m)
//   Q2_K    (256, 84 bytes): 16 bytes of 4-bit scale | 4-bit min per 16 values, 64 bytes of 2-bit
//           codes, f16 d, f16 dmin;                                 y = (d * sc) * q - (dmin * m)
//   IQ2_XXS (256, 66 bytes): f16 d, 32 uint16: per 32 values 4 grid indices (8 values each from
//           ggml's iq2xxs_grid), 4 x 7 sign bits and a 4-bit scale;  y = ((d * (0.5 + s)) * 0.25) *
//           grid * ±1
//   MXFP4   (32, 17 bytes): UE8M0 e, 16 bytes: low nibble = value j, high = value j + 16, codes
//           e2m1 doubled {0,1,2,3,4,6,8,12,...}; y = code * 2^(e-128)
void di_dequant_row_q8_0(const uint8_t *restrict row, int64_t n, float *restrict out);
void di_dequant_row_q4_k(const uint8_t *restrict row, int64_t n, float *restrict out);
void di_dequant_row_q2_k(const uint8_t *restrict row, int64_t n, float *restrict out);
void di_dequant_row_iq2_xxs(const uint8_t *restrict row, int64_t n, float *restrict out);
void di_dequant_row_mxfp4(const uint8_t *restrict row, int64_t n, float *restrict out);

// Q4_K's 6-bit scale and min of sub-block j (0..7) from the 12 scale bytes (ggml's
// get_scale_min_k4). Inline: the AVX2 GEMV unpacks eight per block and row.
static inline void di_q4_k_scale_min(int j, const uint8_t *restrict q, uint8_t *sc, uint8_t *m) {
    if (j < 4) {
        *sc = q[j] & 63;
        *m = q[j + 4] & 63;
    } else {
        *sc = (uint8_t)((q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4));
        *m = (uint8_t)((q[j + 4] >> 4) | ((q[j] >> 6) << 4));
    }
}
// ggml's iq2xxs_grid entry i (0..255): 8 bytes, each 0x08, 0x19 or 0x2b.
uint64_t di_iq2xxs_grid(int i);
// ggml's ksigns_iq2xs: i (0..127) with bit 7 set to make an even number of set bits.
uint8_t di_iq2xs_signs(int i);

// ---- 8-bit activations and integer weight codes (the GGUF matmul contract, backend/cpu/gemm.h)
// ----
//
// Q8_0 and MXFP4 weights are multiplied by 8-bit activations with integer dot products, as ggml
// does. These are the scalar primitives of that contract; the SIMD code reproduces their bits.

// One activation row of n values (n a multiple of 32; DI_ASSERT) in blocks of 32, ggml's
// quantize_row_q8_0 reference: amax = max|x|, dr = amax / 127, d = f16(dr) (round to nearest even,
// stored back as f32 in d[b]), id = 1 / dr where d != 0 else 0, q = round-half-away(x * id)
// computed as trunc(x * id + copysign(0.5 - 2^-25, x * id)) (exactly roundf on |v| < 2^23; the
// same two float operations in the SIMD code). |q| <= 127 (x * id <= 127 (1 + 3 ulp)). Where d is
// 0 the block's q are 0 (ggml's q there are multiplied by d = 0 and cannot matter). Inputs must be
// finite; a block with amax > 65504 * 127 gets d = inf, as in ggml.
void di_quant_act_q8(const float *restrict x, int64_t n, int8_t *restrict q, float *restrict d);

// One activation row (n a multiple of 256; DI_ASSERT) in blocks of 256 for the K-quant weights,
// ggml's quantize_row_q8_K reference: mx = the first value of largest magnitude, is = -127 / mx,
// q = min(127, round-half-even(is * x)) (so mx itself gets -127), d[b] = 1 / is (f32, not rounded
// to f16), bsums[16 b + k] = the sum of q over the block's values 16k..16k+15. An all-zero block
// gets d = 0 and q = 0. Inputs must be finite.
void di_quant_act_q8_k(const float *restrict x, int64_t n, int8_t *restrict q, float *restrict d,
                       int16_t *restrict bsums);

// The integer codes and per-32 scales of one weight row (n a multiple of 32), whose products are
// exactly di_dequant_row_*'s values:
//   Q8_0: q = the stored int8, d = the f16 block scale;
//   MXFP4: q = the e2m1 code doubled {0, ±1, ±2, ±3, ±4, ±6, ±8, ±12} (ggml's kvalues_mxfp4) in
//   column order, d = 2^(e-128) (the UE8M0 scale times 0.5).
void di_codes_row_q8_0(const uint8_t *restrict row, int64_t n, int8_t *restrict q,
                       float *restrict d);
void di_codes_row_mxfp4(const uint8_t *restrict row, int64_t n, int8_t *restrict q,
                        float *restrict d);
// ggml's MXFP4 block scale 2^(e-128) (subnormal for e < 2). Exact. Inline: the AVX2 GEMV calls it
// once per row and block.
static inline float di_mxfp4_scale(uint8_t e) {
    uint32_t bits = e < 2 ? 0x00200000u << e : (uint32_t)(e - 1) << 23;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

// f32 -> IEEE binary16 bit pattern, round to nearest even; overflow to ±inf; NaN stays NaN.
uint16_t di_f32_to_f16(float x);

// Quantisers used by the GGUF writer (not bit-exact to ggml's; any valid encoding loads the same
// everywhere). n a multiple of the block (DI_ASSERT); out receives n / block blocks.
// Q8_0: d = amax / 127 (stored f16), q = round(x / d) clamped to [-127, 127].
void di_quant_row_q8_0(const float *restrict x, int64_t n, uint8_t *restrict out);
// Q4_K: per sub-block of 32 an asymmetric range [min(0, lo), hi] with 15 steps; the sub-block
// scales and mins are themselves 6-bit multiples of per-block f16 d and dmin.
void di_quant_row_q4_k(const float *restrict x, int64_t n, uint8_t *restrict out);
// MXFP4 from a row already in our FP4 layout (two e2m1 codes per byte, low nibble = even column,
// one UE8M0 scale per 32): exact repacking (code doubled with exponent one lower).
void di_repack_row_fp4_mxfp4(const uint8_t *restrict packed, const uint8_t *restrict scale_row,
                             int64_t n, uint8_t *restrict out);
