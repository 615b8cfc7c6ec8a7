/*
 * hparams — the hyper-parameters of a DeepSeek V4 checkpoint, read once from config.json and
 * validated at load. Accepts both Hugging Face field names (hidden_size, layer_types,
 * rope_parameters, ...) and the official inference names (dim, n_layers, compress_ratios,
 * rope_factor, ...), and reproduces how transformers' DeepseekV4Config derives its layer schedule
 * and RoPE parameters (spec deepseek-v4.md §1.1).
 *
 * Owns: nothing on the heap (fixed arrays). Thread-safety: immutable after di_hparams_load.
 */
#pragma once

#include <stdbool.h>
#include <stdint.h>

#include "deepinfer.h" // di_status

#define DI_MAX_LAYERS 256 // main layers + MTP layers
#define DI_MAX_ENGRAM 8

typedef struct di_rope_params {
    float theta;
    bool yarn;
    float factor;             // YaRN factor
    int64_t original_max_pos; // YaRN L0
    float beta_fast, beta_slow;
    float attention_factor; // multiplies cos and sin (1.0 for V4)
    int32_t n_dims;         // rotated trailing dims (64 for V4)
} di_rope_params;

typedef struct di_hparams {
    int32_t n_vocab;
    int32_t n_embd;       // D
    int32_t n_layer;      // main decoder layers
    int32_t n_mtp;        // MTP blocks declared by the config
    int32_t n_head;       // H
    int32_t head_dim;     // Dh
    int32_t q_lora_rank;  // Rq
    int32_t o_groups;     // G
    int32_t o_lora_rank;  // Ro
    int32_t window;       // W, sliding window including the query
    int32_t n_index_head; // HI
    int32_t index_head_dim;
    int32_t index_topk;
    int32_t hc_mult; // NC
    int32_t hc_iters;
    float hc_eps;
    float norm_eps;
    int32_t n_expert;      // E
    int32_t n_expert_used; // K
    int32_t n_expert_shared;
    int32_t expert_ff; // F
    float route_scale;
    float swiglu_limit;       // 0 = no clamp
    bool shared_expert_clamp; // the shared expert uses the SwiGLU clamp too (current revision)
    int64_t max_pos;
    int32_t bos_token, eos_token;
    // Per layer, main layers first then MTP layers (index n_layer + i). Ratio 0: sliding window
    // only; 4: CSA (overlapping compressor + lightning indexer); any other: HCA.
    int32_t compress_ratio[DI_MAX_LAYERS];
    bool hash_routed[DI_MAX_LAYERS];
    di_rope_params rope_main;     // layers with ratio 0 and MTP
    di_rope_params rope_compress; // every rotation inside a layer with ratio > 0
    // Checkpoint quantisation (official layout).
    int32_t fp8_block_out, fp8_block_in; // 128 x 128 (V4), 32 x 32 (V4.1)
    char model_type[32];
    float gate_temp; // router logits are divided by it (V4.1; 1 for V4)

    // ---- DeepSeek V4.1 (model_type deepseek_v41; spec deepseek-v41.md §1) ----
    // Ratios are 0 (window only), 2 (CSA2 pooling, non-overlapping) or 1 (plain projection).
    bool v41;
    bool kv_source[DI_MAX_LAYERS];    // layer owns a compressor (Cmain + Kidx)
    bool index_source[DI_MAX_LAYERS]; // layer runs an indexer and publishes a top-k
    int32_t candidate_layer;          // level-1 candidate pool source; -1 disables
    int32_t candidate_topk_blocks, candidate_block_size;
    int32_t n_engram;                    // Engram layers (ascending)
    int32_t engram_layer[DI_MAX_ENGRAM]; // layer ids
    int64_t engram_rows[DI_MAX_ENGRAM];  // table rows per Engram layer
    int64_t engram_vocab;                // start of the prime search
    int64_t engram_cvocab;               // compressed vocabulary size
    int32_t engram_max_ngram, engram_n_head, engram_head_dim, engram_pad_id;
    int32_t dspark_block_size, dspark_noise_token, dspark_markov_rank;
    int32_t dspark_n_expert, dspark_n_expert_used;
    int32_t n_dspark_target, dspark_target[8];
    int32_t image_token;
} di_hparams;

// Reads and validates dir/config.json: DeepSeek V4 (model_type deepseek_v4, or no model_type) or
// V4.1 (deepseek_v41: the composite HF config with text_config, or the official flat config, which
// V4.1's kv_source_layers identify). DI_ERR_IO if missing; DI_ERR_FORMAT (logged with the field
// name) for missing/invalid fields; DI_ERR_UNSUPPORTED for another model_type.
di_status di_hparams_load(const char *config_path, di_hparams *out);

// The cross-field checks every source of hyper-parameters must pass (experts, head groups, hc
// and RoPE dims, indexer); `path` names the source in the message. DI_ERR_FORMAT.
di_status di_hparams_check(const char *path, const di_hparams *hp);

// Fills omega[n_dims/2] with the rotation frequencies of p (spec §2.0), in FP32.
void di_rope_freqs(const di_rope_params *p, float *omega);
