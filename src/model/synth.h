/*
 * synth — writes a random-weight DeepSeek V4 checkpoint (config.json + model.safetensors) in the
 * official layout (FP8 e4m3 with 128x128 UE8M0 scales, FP4 e2m1 experts with 1x32 scales) or the
 * Hugging Face layout (BF16, stacked experts). Used for the built-in default model, the loader's
 * bad-checkpoint tests, memory measurements and the benchmark models at true V4 widths. The
 * weights are random: the model's text is meaningless.
 *
 * Owns: nothing after return. Thread-safety: any thread (no shared state).
 */
#pragma once

#include <stdbool.h>
#include <stdint.h>

#include "deepinfer.h" // di_status

typedef struct di_synth_config {
    int32_t n_vocab, n_embd, n_layer, n_head, head_dim, rope_dims, q_lora_rank;
    int32_t o_groups, o_lora_rank, window;
    int32_t n_index_head, index_head_dim, index_topk;
    int32_t n_expert, n_expert_used, expert_ff, n_hash_layers, n_mtp;
    int32_t hca_ratio;  // compress ratio of HCA layers (128 in V4)
    int32_t ratios[64]; // per main layer: 0, 4 or hca_ratio
    float swiglu_limit, route_scale;
    uint64_t seed;
    bool official;     // official layout (FP8/FP4) else HF names in BF16
    int32_t fp8_block; // FP8 weight block (0 = 128)
    // Fast random codes (benchmark models at full width, where the exact path takes minutes per
    // layer): BF16 and FP8 values from a cheap approximate normal (a sum of four uniforms) with one
    // power-of-two scale per tensor, FP4 expert bytes uniformly random with one UE8M0 scale giving
    // an RMS near 1/sqrt(cols); generated on every core, deterministic per seed whatever the core
    // count. F32 vectors and hash tables as the exact path.
    bool fast;
} di_synth_config;

// Presets: "tiny" (spec §6.2 shapes with the real 129,280-token vocabulary: the default model),
// "tiny-128" (the tiny widths with HCA ratio 128: layers SWA/CSA/HCA/CSA/HCA/SWA, and 32 indexer
// heads; llama.cpp runs it too), "flash-4l" (true V4-Flash widths, 4 layers SWA/CSA/HCA/CSA, 32
// experts top-6 — benchmarks), "flash-full" / "flash-full-<N>l" (N = 1..64, default 2: every
// V4-Flash width including 256 experts top-6, layers CSA/HCA alternating, score routing on every
// layer (no hash layers), no MTP block, fast random codes: ~3.3 GB per layer + 2.1 GB embedding
// and head — bench/cuda/bench_forward.c). DI_ERR_INVALID for an unknown name.
di_status di_synth_preset(const char *name, di_synth_config *out);
// Writes dir/config.json and dir/model.safetensors (dir must exist). DI_ERR_IO, DI_ERR_NOMEM.
di_status di_synth_write(const di_synth_config *cfg, const char *dir);

// Writes the DeepSeek V4.1 tiny test model of deepseek-v41.md §7.2 (6 layers SWA / kv+index source
// m=2 / reuse m=2 / candidate source m=1 / reuse m=1 / reindex m=1, Engram on layers 0 and 1) into
// dir: config.json, model.safetensors and engram/token_map.safetensors (the stub map id div 2).
// official: FP8 32x32 / FP4 1x32 / Engram FP8 per-32 tensors under the official names, with the
// DSpark block mtp.0 when dspark; else the native names in FP32 with no DSpark (as the fixtures'
// R-HF export). Random weights. DI_ERR_IO, DI_ERR_NOMEM.
di_status di_synth_v41_write(const char *dir, bool official, bool dspark, uint64_t seed);
