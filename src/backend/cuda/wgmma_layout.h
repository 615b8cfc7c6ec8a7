/*
 * wgmma_layout — the host-checkable half of the Hopper wgmma helpers (wgmma.cuh holds the
 * instructions): the shared-memory matrix descriptor's bit packing, the 128-byte swizzle, the
 * one tile layout the wgmma kernels store their BF16 operands in, and the accumulator fragment's
 * (thread, register) -> (row, column) map. Plain C99 static inline functions, __host__ __device__
 * under nvcc, so tests/unit/test_wgmma_layout.c checks them on the CPU (against the PTX ISA's
 * documented canonical layouts, written out independently below as di_wg_ref_*) and the CUDA
 * probe (wgmma_probe.cu, test_cuda_wgmma) and the attention kernel (attn.cu) use the same code:
 * a fix the probe finds fixes the kernel.
 *
 * The layout ("SW128 k-blocked"): a BF16 matrix of R rows (R a multiple of 8) and C columns (C a
 * multiple of 64) is stored as C/64 column blocks of R rows x 128 bytes, block b at b * R * 128;
 * inside a block, row r's 16-byte chunk c (columns 8c .. 8c+7 of the block) sits at
 * r * 128 + 16 * (c ^ (r % 8)): the 128-byte swizzle (PTX: address bits [4,7) ^= bits [7,10)),
 * which the hardware applies to the absolute shared-memory address, hence the tile base must be
 * 1024-byte aligned (the descriptor's base-offset field stays 0). The same bytes serve as
 *   - a K-major operand (rows = M or N, columns = K; Q and the key tile for S = Q K^T, P for
 *     P V): per k16 step the descriptor starts at block k/64, byte (k % 64) * 2 of row 0;
 *     SBO = 1024 (the next 8 rows), LBO unused (1, as CUTLASS sets it for swizzled K-major);
 *   - an MN-major operand (rows = K, columns = N; the key tile read as V for P V, tnspB = 1):
 *     per k16 step the descriptor starts at row k of block n0/64; LBO = R * 128 (the next 64
 *     columns along N), SBO = 1024 (the next 8 rows along K).
 *
 * The accumulator of wgmma.m64nNk16 (FP32, N/2 registers per thread of the warpgroup): thread
 * tid's register i holds row 16 * (tid / 32) + (tid % 32) / 4 + 8 * ((i / 2) % 2) and column
 * 8 * (i / 4) + 2 * (tid % 4) + i % 2 (PTX ISA "Matrix fragments for wgmma .m64nNk16", the D
 * figure: each warp's 16 rows, the mma.sync m16n8 C fragment repeated along N).
 *
 * Owns nothing. Thread-safety: pure functions, any thread.
 */
#pragma once

#include <stdint.h>

#if defined(__CUDACC__)
#define DI_WG_FN static __host__ __device__ __forceinline__
#else
#define DI_WG_FN static inline
#endif

// The descriptor's swizzle field (bits 62-63, sm_90).
enum {
    DI_WG_SWIZZLE_NONE = 0,
    DI_WG_SWIZZLE_128B = 1,
    DI_WG_SWIZZLE_64B = 2,
    DI_WG_SWIZZLE_32B = 3,
};

// ---- the matrix descriptor ----

// The 64-bit shared-memory matrix descriptor of wgmma (PTX ISA "Matrix Descriptor Format"):
// bits 0-13 the start address >> 4 (of the low 18 address bits), 16-29 the leading-dimension byte
// offset >> 4, 32-45 the stride-dimension byte offset >> 4, 49-51 the base offset (0 here: the
// tiles are 1024-byte aligned), 62-63 the swizzle mode.
DI_WG_FN uint64_t di_wg_desc(uint32_t smem_addr, uint32_t lbo_bytes, uint32_t sbo_bytes,
                             int swizzle) {
    return (uint64_t)((smem_addr & 0x3FFFFu) >> 4) | (uint64_t)((lbo_bytes >> 4) & 0x3FFFu) << 16 |
           (uint64_t)((sbo_bytes >> 4) & 0x3FFFu) << 32 | (uint64_t)(swizzle & 3) << 62;
}

// The fields back (the unit test's round trip; the probe prints them on a failure).
DI_WG_FN uint32_t di_wg_desc_addr(uint64_t d) {
    return (uint32_t)(d & 0x3FFFu) << 4;
}
DI_WG_FN uint32_t di_wg_desc_lbo(uint64_t d) {
    return (uint32_t)((d >> 16) & 0x3FFFu) << 4;
}
DI_WG_FN uint32_t di_wg_desc_sbo(uint64_t d) {
    return (uint32_t)((d >> 32) & 0x3FFFu) << 4;
}
DI_WG_FN int di_wg_desc_swizzle(uint64_t d) {
    return (int)(d >> 62);
}

// ---- the SW128 k-blocked tile ----

// The 128-byte swizzle of a shared-memory byte address (or an offset from a 1024-aligned base).
DI_WG_FN uint32_t di_wg_sw128(uint32_t a) {
    return a ^ (((a >> 7) & 7u) << 4);
}

// Byte offset of BF16 element (r, c) in a tile of `rows` rows (the layout above).
DI_WG_FN uint32_t di_wg_tile_off(int r, int c, int rows) {
    return (uint32_t)(c / 64) * (uint32_t)rows * 128u +
           di_wg_sw128((uint32_t)r * 128u + (uint32_t)(c % 64) * 2u);
}

// Descriptor of the k16 step at column k (a multiple of 16) of a K-major operand whose rows
// r0 .. r0+M-1 (r0 a multiple of 8) are read, in a tile of `rows` rows at shared address base.
DI_WG_FN uint64_t di_wg_desc_kmajor(uint32_t base, int rows, int r0, int k) {
    return di_wg_desc(base + (uint32_t)(k / 64) * (uint32_t)rows * 128u + (uint32_t)r0 * 128u +
                          (uint32_t)(k % 64) * 2u,
                      16u, 1024u, DI_WG_SWIZZLE_128B);
}

// Descriptor of the k16 step at row k (a multiple of 8) of an MN-major operand (rows = K) whose
// columns n0 .. (n0 a multiple of 64) are read, in a tile of `rows` rows at shared address base.
DI_WG_FN uint64_t di_wg_desc_mnmajor(uint32_t base, int rows, int k, int n0) {
    return di_wg_desc(base + (uint32_t)(n0 / 64) * (uint32_t)rows * 128u + (uint32_t)k * 128u,
                      (uint32_t)rows * 128u, 1024u, DI_WG_SWIZZLE_128B);
}

// ---- the PTX ISA's canonical layouts, read from a descriptor (the unit test's reference) ----

// Shared address of element (mn, k) (k < 16: one instruction's K) of a K-major SW128 operand as
// the hardware reads it from descriptor d: the canonical layout ((8, m), (8, 2)) over 16-byte
// units, ((8 rows 128 bytes apart, m groups SBO apart), (8 elements, 2 chunks)), then the swizzle
// on the absolute address.
DI_WG_FN uint32_t di_wg_ref_kmajor_addr(uint64_t d, int mn, int k) {
    const uint32_t a = di_wg_desc_addr(d) + (uint32_t)(mn / 8) * di_wg_desc_sbo(d) +
                       (uint32_t)(mn % 8) * 128u + (uint32_t)k * 2u;
    return di_wg_sw128(a);
}

// The same for an MN-major SW128 operand (tnsp): ((64 elements along MN in one 128-byte row,
// groups of 64 LBO apart), (8 rows along K 128 bytes apart, groups of 8 SBO apart)).
DI_WG_FN uint32_t di_wg_ref_mnmajor_addr(uint64_t d, int mn, int k) {
    const uint32_t a = di_wg_desc_addr(d) + (uint32_t)(mn / 64) * di_wg_desc_lbo(d) +
                       (uint32_t)(k / 8) * di_wg_desc_sbo(d) + (uint32_t)(k % 8) * 128u +
                       (uint32_t)(mn % 64) * 2u;
    return di_wg_sw128(a);
}

// ---- the accumulator fragment ----

// Row and column of register i of thread tid (0..127 in the warpgroup) in an m64nN FP32
// accumulator.
DI_WG_FN int di_wg_acc_row(int tid, int i) {
    return 16 * (tid / 32) + (tid % 32) / 4 + 8 * ((i / 2) % 2);
}
DI_WG_FN int di_wg_acc_col(int tid, int i) {
    return 8 * (i / 4) + 2 * (tid % 4) + i % 2;
}
