/*
 * deepinfer.h — the public C API of deepinfer, an inference engine for DeepSeek V4-family models.
 *
 * Objects are opaque handles. Every function that can fail returns di_status (DI_OK = 0, errors
 * negative) and writes its results through out-parameters only on success. Errors are logged once,
 * where they happen, through the library's log sink (stderr by default); the library never writes
 * to stdout.
 *
 * Thread-safety: a di_model is immutable after load and may be shared by sessions; a di_session is
 * used by one thread at a time.
 */
#pragma once

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

// ---- status ----

typedef enum di_status {
    DI_OK = 0,
    DI_ERR_NOMEM = -1,       // an allocation failed
    DI_ERR_IO = -2,          // a file could not be opened, read or mapped
    DI_ERR_FORMAT = -3,      // a file's contents are malformed or do not match the config
    DI_ERR_INVALID = -4,     // an argument is out of range
    DI_ERR_NO_KV = -5,       // the KV budget is exhausted
    DI_ERR_CUDA = -6,        // a CUDA call failed
    DI_ERR_CANCELLED = -7,   // the request was cancelled
    DI_ERR_UNSUPPORTED = -8, // a valid input that this build cannot handle
} di_status;

// A static, human-readable name for st.
const char *di_status_str(di_status st);

// ---- logging ----

// level: 0 error, 1 warn, 2 info (default), 3 debug. Before start only.
void di_set_log_level(int level);

// ---- model ----

typedef struct di_model di_model;

typedef enum di_precision {
    // FP32 everywhere: the mathematics of Hugging Face transformers' DeepseekV4ForCausalLM (R-HF).
    DI_PRECISION_FP32 = 0,
    // DeepSeek's official inference numerics (R-OFF): FP8 activation quantisation before FP8/FP4
    // GEMMs, Q8 of the KV nope dims, Hadamard + Q4 in the indexer, BF16 residual streams and
    // BF16 rounding where the official code rounds (spec deepseek-v4.md §0.1, §5).
    DI_PRECISION_OFFICIAL = 1,
} di_precision;

typedef struct di_model_options {
    int n_threads;          // CPU threads of the model's pool; 0 = one per online CPU
    di_precision precision; // numerics recipe; default DI_PRECISION_FP32
} di_model_options;

// Default options: all CPUs, FP32.
di_model_options di_model_options_default(void);

// Loads a checkpoint directory: config.json plus model.safetensors or a sharded set with
// model.safetensors.index.json, in DeepSeek's official layout (FP8/FP4) or as written by
// transformers' save_pretrained. Weights are memory-mapped. Every tensor is checked against the
// config; the first mismatch is logged with the tensor's name.
// Returns DI_ERR_IO (missing/unreadable file), DI_ERR_FORMAT (bad config or checkpoint),
// DI_ERR_UNSUPPORTED (an architecture this build does not run), DI_ERR_NOMEM.
di_status di_model_load(const char *dir, const di_model_options *opt, di_model **out);
// Frees the model and unmaps its files. NULL does nothing. Sessions must be destroyed first.
void di_model_destroy(di_model *model);

typedef struct di_model_info {
    const char *arch;         // "deepseek_v4"; borrowed from the model
    const char *layout;       // "official" or "hf"; borrowed
    int32_t n_vocab;
    int32_t n_layers;         // main decoder layers
    int32_t n_mtp_layers;     // MTP blocks present in the checkpoint (0 if none)
    int32_t hidden_size;
    int32_t n_heads;
    int32_t head_dim;
    int32_t n_routed_experts;
    int32_t n_experts_per_tok;
    int32_t sliding_window;
    int64_t n_params;         // parameters in the main stack, embedding and head (MTP excluded)
    int64_t n_params_mtp;
    size_t weight_bytes;      // bytes of tensor data in the checkpoint files
    int32_t n_threads;
    di_precision precision;
} di_model_info;

void di_model_get_info(const di_model *model, di_model_info *out);
// Writes a multi-line description (config, layer schedule, dtypes) into buf (NUL-terminated,
// truncated to cap). Returns the length it needed.
size_t di_model_describe(const di_model *model, char *buf, size_t cap);
// Compression ratio of layer il (0 = sliding window only, 4 = CSA, other = HCA); -1 if out of range.
int32_t di_model_layer_ratio(const di_model *model, int32_t il);

// ---- session: one sequence's incremental state ----

typedef struct di_session di_session;

typedef struct di_session_options {
    int32_t n_ctx_max; // positions this session may reach; 0 = the model's max_position_embeddings
    bool mtp;          // run the MTP block on every step (needs MTP weights)
} di_session_options;

di_session_options di_session_options_default(void);

// Creates an empty sequence state (position 0). DI_ERR_INVALID if mtp is requested but the
// checkpoint has no MTP block; DI_ERR_NOMEM.
di_status di_session_create(di_model *model, const di_session_options *opt, di_session **out);
void di_session_destroy(di_session *s);
// Tokens consumed so far (= position of the next token).
int32_t di_session_n_past(const di_session *s);
// Forgets everything (back to position 0) without freeing buffers.
void di_session_reset(di_session *s);

typedef struct di_forward_out {
    // [n_tokens, n_vocab] logits for every fed position, or, when last_only, [1, n_vocab] for the
    // last one. NULL: no logits are computed.
    float *logits;
    bool last_only;
    // MTP logits [n, n_vocab] (session created with mtp). The MTP block at position p needs the
    // token at p+1, so a call feeding positions [p0, p0+n) yields the MTP logits of positions
    // max(p0-1, 0) .. p0+n-2; *n_mtp_out receives how many rows were written (n, or n-1 when
    // p0 = 0). mtp_logits may be NULL even when the session runs MTP (its state still advances).
    float *mtp_logits;
    int32_t *n_mtp_out;
} di_forward_out;

// Feeds n_tokens tokens (ids < n_vocab) at the next positions and advances the state. Feeding
// the same tokens in any chunking yields the same logits as one call.
// Returns DI_ERR_INVALID (bad token id, n_tokens < 1, context exceeds n_ctx_max), DI_ERR_NOMEM.
di_status di_session_forward(di_session *s, const int32_t *tokens, int32_t n_tokens,
                             const di_forward_out *out);

// Serialises the whole state (position, window rings, compressed pools, compressor buffers) into
// a new buffer (*bytes, free with di_free_buffer). DI_ERR_NOMEM.
di_status di_session_save(const di_session *s, void **bytes, size_t *n_bytes);
// Restores a state written by di_session_save for the same model. DI_ERR_FORMAT if the bytes are
// not such a state (wrong model, truncated, corrupted); the session is then left reset.
di_status di_session_restore(di_session *s, const void *bytes, size_t n_bytes);
void di_free_buffer(void *p);

#ifdef __cplusplus
}
#endif
