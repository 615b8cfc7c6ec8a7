/*
 * probe — the machine's two physical limits, measured on the thread pool the engine uses, so that
 * benchmarks can print their results as ratios against them in the same run:
 *   - read bandwidth: a STREAM-like sum over a buffer far larger than the last-level cache;
 *   - multiply-add peak: twelve independent FMA chains per thread, at the instruction-set level
 *     di_cpu_matmul uses (8-lane FMA at the AVX2 level, scalar fmaf at the scalar level).
 * Both are best-of-reps figures (the least noisy estimate on a shared machine).
 *
 * Owns: nothing beyond each call. Thread-safety: one call at a time per pool.
 */
#pragma once

#include <stddef.h>

#include "backend/cpu/gemm.h" // di_cpu_isa
#include "base/thread.h"      // di_pool

// Bytes per second summing a `bytes`-byte buffer with every pool thread (best of reps; the first
// pass only warms the pages). Returns 0 when the buffer cannot be allocated.
double di_probe_read_bw(di_pool *pool, size_t bytes, int reps);
// Multiply-adds per second over the pool at `isa` (best of reps, each ~50 ms per thread).
double di_probe_fma_peak(di_pool *pool, di_cpu_isa isa, int reps);
