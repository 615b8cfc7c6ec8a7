// simd — what the SIMD kernel files (gemm_avx2.c, gemm_avx512.c, vec_avx2.c) share.
#pragma once

// Put before every loop over a register tile's rows, tokens, pairs or lanes (a trip count known
// at compile time once the kernel is inlined): it is unrolled whole, so that the tile's
// accumulators live in registers. GCC -O2 unrolls such loops only when they are small; a 12-token
// tile's 24 accumulators, or a 4-row x 3-token tile's 12, stayed in a stack array, with a load
// and a store around every FMA (half the FMA rate, or less). Unrolling changes no result: the
// same operations in the same order.
#define DI_UNROLL _Pragma("GCC unroll 16")
