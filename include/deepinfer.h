/*
 * deepinfer.h — the public C API of deepinfer, an inference engine for DeepSeek V4-family models.
 *
 * Objects are opaque handles. Every function that can fail returns di_status (DI_OK = 0, errors
 * negative) and writes its results through out-parameters only on success. Errors are logged once,
 * where they happen, through the library's log sink (stderr by default); the library never writes
 * to stdout.
 *
 * Thread-safety: a di_model is immutable after load and may be shared by sessions, but forward
 * calls on sessions of the same model must not overlap in time: they share the model's thread
 * pool and scratch (the serving engine drives one model from one thread). A di_session is used by
 * one thread at a time.
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
    DI_ERR_BUSY = -9,        // the engine's request queue is full; retry later
    // The device was lost: a sticky device error (CUDA: an illegal address, a launch failure, an
    // uncorrectable ECC error, a device-side assert, ...) poisoned its context, so every later call
    // on it fails until the device is reset. The serving engine rebuilds its device state and goes
    // on (docs/cuda.md, "Device loss"), or, past its bound, refuses requests with this status.
    DI_ERR_DEVICE_LOST = -10,
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

// Where the model's matmuls run. DI_DEVICE_CPU (the zero value): everything on the CPU.
// DI_DEVICE_CUDA: every matmul of the forward on CUDA device `index` (weights uploaded once, on
// first use), while norms, attention, MoE routing and the sequence state stay on the CPU; every
// matmul synchronises (a correctness path, not yet a fast one: docs/cuda.md). Needs a build
// configured with -DDI_CUDA=ON.
typedef enum di_device_kind {
    DI_DEVICE_CPU = 0,
    DI_DEVICE_CUDA = 1,
} di_device_kind;

// The most devices after the first one a di_device lists (so at most 8 pipeline stages).
enum { DI_DEVICE_MAX_MORE = 7 };

typedef struct di_device {
    di_device_kind kind;
    int32_t index; // CUDA device ordinal (>= 0); 0 for the CPU
    // A list of CUDA devices (`--device cuda:0,1,2,3`; DI_DEVICE_CUDA only): n_more further
    // ordinals after `index`. A V4 or V4.1 model's device-resident forward then runs as
    // 1 + n_more pipeline stages (docs/cuda.md "Several GPUs: pipeline stages"): its layers split
    // into contiguous ranges of about equal weight bytes, stage 0 on `index`, stage k on
    // more[k - 1] (an ordinal may repeat: cuda:0,0 is two stages on one GPU; a V4.1 model's
    // later stages keep mirrors of the earlier kv sources they read). di_model_load returns
    // DI_ERR_INVALID for a list longer than the model's layers. What does not run on the
    // device-resident forward (the offloaded matmuls of a model it cannot hold) uses `index`. 0
    // (the zero value, as before this field existed): the one device `index`.
    int32_t n_more;
    int32_t more[DI_DEVICE_MAX_MORE];
} di_device;

// DI_OK when this build can run on `device` (DI_DEVICE_CPU always; DI_DEVICE_CUDA in a DI_CUDA
// build, for index >= 0). DI_ERR_UNSUPPORTED (logged: "this build has no CUDA backend: configure
// with -DDI_CUDA=ON") or DI_ERR_INVALID (unknown kind, negative index, n_more outside [0,
// DI_DEVICE_MAX_MORE], a negative ordinal in more, a list on the CPU) otherwise. Does not touch
// the device: whether it exists is found out by di_model_load.
di_status di_device_check(const di_device *device);

// Work done on the device since the model was loaded (all zero on the CPU).
typedef struct di_device_stats {
    int64_t n_matmuls;    // matmuls run on the device
    int64_t n_declined;   // matmuls the device declined (an unsupported weight kind, or a failed
                          // CUDA call, logged): computed on the CPU instead
    int64_t n_weights;    // distinct weight matrices uploaded
    int64_t weight_bytes; // bytes of weights (and their scales) uploaded
    // The forward is device-resident (docs/cuda.md): activations, KV and compressor state stay in
    // the device's memory and only token ids and logits cross (the engine's steps; a model's
    // sessions, MTP ones included). false: the CPU forward, its matmuls offloaded when
    // n_matmuls > 0.
    bool resident;
} di_device_stats;

typedef struct di_model_options {
    int n_threads;          // CPU threads of the model's pool; 0 = one per online CPU
    di_precision precision; // numerics recipe; default DI_PRECISION_FP32
    di_device device;       // where the matmuls run; default (zero) the CPU
    // Expert workers ("HOST:PORT,HOST:PORT...", `deepinfer expert-worker`) computing the routed
    // experts placed on them (docs/expert-parallel.md); read at load only. NULL or "": none.
    const char *ep_workers;
    // A placement file (`deepinfer eplb -o`, docs/expert-parallel.md "Files") for those workers:
    // which rank holds each (layer, expert) replica. NULL: contiguous shares, the front first.
    const char *ep_placement;
    // Context-parallel workers ("HOST:PORT,HOST:PORT...", `deepinfer cp-worker`,
    // docs/context-parallel.md): a V4 or V4.1 session's prefill call of at least cp_min_tokens
    // tokens is split over them and this process, which computes the last piece and keeps the
    // whole state (logits bit-identical to one process). Read at load only; refused for --device.
    // NULL or "": none.
    const char *cp_workers;
    int32_t cp_min_tokens; // shortest prefill call split over the workers; 0: 1024
    // The device state the pipeline stages' split balances KV capacity for (docs/cuda.md "Several
    // GPUs: pipeline stages", "The split"): dev_slots sequences of dev_ctx positions, calls of
    // dev_rows rows, dev_spec with speculation's rings (V4's MTP, V4.1's DSpark); the serving
    // engine fills them in from its options. 0 / false: the engine's defaults (16, 8192, 256, no
    // speculation). dev_reserve_bytes: device memory every stage leaves free besides its weights,
    // that state and its entry blocks (backend scratch, graphs); 0: DI_DEV_RESERVE_DEFAULT_BYTES.
    // Read at load (the split is chosen before the weights go up) and by the engine (its blocks).
    int32_t dev_slots, dev_ctx, dev_rows;
    bool dev_spec;
    size_t dev_reserve_bytes;
} di_model_options;

// The default of di_model_options.dev_reserve_bytes: 1 GiB per stage.
#define DI_DEV_RESERVE_DEFAULT_BYTES ((size_t)1 << 30)

// Default options: all CPUs, FP32, CPU only.
di_model_options di_model_options_default(void);

// Loads a checkpoint directory: config.json plus model.safetensors or a sharded set with
// model.safetensors.index.json, in DeepSeek's official layout (FP8/FP4) or as written by
// transformers' save_pretrained; or a GGUF file of llama.cpp's deepseek4 architecture (`dir` names
// the .gguf file, or a directory without config.json holding exactly one), whose metadata gives
// the hyper-parameters. Weights are memory-mapped. Every tensor is checked against the config; the
// first mismatch is logged with the tensor's name.
// With a CUDA device, also creates the device context (freed by di_model_destroy).
// Returns DI_ERR_IO (missing/unreadable file), DI_ERR_FORMAT (bad config or checkpoint),
// DI_ERR_UNSUPPORTED (an architecture this build does not run; a CUDA device in a build without
// CUDA, or one that does not exist; cp_workers with a device), DI_ERR_CUDA (the
// device context failed), DI_ERR_INVALID (bad options; an expert or prefill worker running another
// model), DI_ERR_NOMEM; with ep_workers or cp_workers also DI_ERR_IO (a worker unreachable).
di_status di_model_load(const char *dir, const di_model_options *opt, di_model **out);

// What a checkpoint's configuration says, read without mapping its weights: config.json, or the
// GGUF file's metadata, found and validated as di_model_load finds and validates them. The tools
// take the prompt format from it (DeepSeek V4.1 checkpoints render chat requests in the dsv41
// encoding, docs/tokenizer.md), whichever of the three V4.1 config forms the checkpoint has.
typedef struct di_model_config {
    bool v41; // DeepSeek V4.1 (else V4)
    int32_t n_vocab;
    int64_t max_position_embeddings; // 1,048,576 when the config names none
} di_model_config;

// Errors as di_model_load's reading of the configuration: DI_ERR_IO, DI_ERR_FORMAT,
// DI_ERR_UNSUPPORTED (logged), DI_ERR_INVALID (NULL arguments).
di_status di_model_read_config(const char *model_dir, di_model_config *out);
// Frees the model and unmaps its files. NULL does nothing. Sessions must be destroyed first.
void di_model_destroy(di_model *model);

typedef struct di_model_info {
    const char *arch;   // "deepseek_v4"; borrowed from the model
    const char *layout; // "official" or "hf"; borrowed
    int32_t n_vocab;
    int32_t n_layers;     // main decoder layers
    int32_t n_mtp_layers; // MTP blocks present in the checkpoint (0 if none)
    int32_t hidden_size;
    int32_t n_heads;
    int32_t head_dim;
    int32_t n_routed_experts;
    int32_t n_experts_per_tok;
    int32_t sliding_window;
    int32_t bos_token_id, eos_token_id;
    int64_t n_params; // parameters in the main stack, embedding and head (MTP excluded)
    int64_t n_params_mtp;
    size_t weight_bytes; // bytes of tensor data in the checkpoint files
    int32_t n_threads;
    di_precision precision;
    di_device device;
    di_device_stats device_stats; // so far (a snapshot; call again after forwards)
} di_model_info;

void di_model_get_info(const di_model *model, di_model_info *out);

// Counters of a model's context parallelism (docs/context-parallel.md), since load.
typedef struct di_cp_stats {
    int32_t n_workers;
    int64_t calls;      // prefill calls split over the workers (the failed ones included)
    int64_t tokens;     // tokens of the calls that succeeded
    int64_t bytes_sent; // every frame this process sent or received, relayed ones included
    int64_t bytes_recv;
    int64_t errors; // calls that failed (DI_ERR_IO)
} di_cp_stats;
// false (out zeroed) when the model has no context-parallel workers. Any thread.
bool di_model_cp_stats(const di_model *model, di_cp_stats *out);

// Counters of one expert worker of a model (docs/expert-parallel.md), since load.
typedef struct di_ep_worker_stats {
    char addr[128];     // HOST:PORT
    int64_t calls;      // requests sent (one per MoE layer call with rows for this worker)
    int64_t rows;       // rows sent
    int64_t bytes_sent; // frames, headers included
    int64_t bytes_recv;
    int64_t wait_us;  // time spent waiting for its results
    int64_t errors;   // failed connects, requests and replies
    int64_t connects; // connections opened (1 + reconnections)
} di_ep_worker_stats;
// Writes the counters of up to cap of the model's expert workers (rank order); returns how many
// it has (0: no expert parallelism). Safe from any thread.
int32_t di_model_ep_stats(const di_model *model, di_ep_worker_stats *out, int32_t cap);
// Writes a multi-line description (config, layer schedule, dtypes; with a device list, the
// pipeline stages) into buf (NUL-terminated, truncated to cap). Returns the length it needed.
size_t di_model_describe(const di_model *model, char *buf, size_t cap);
// One pipeline stage of di_model_stage_plan: layers [layer0, layer1), weight_bytes of weights,
// fixed_bytes of the planned device state's fixed part (slots' tails, call rows, scratch),
// block_bytes per entry block (its layers' entries, V4.1's mirrors); with memory: budget_bytes
// (free less the reserve) and n_blocks, the blocks it holds (INT64_MAX: its layers keep none);
// without: 0 and -1.
typedef struct di_stage_plan {
    int32_t layer0, layer1;
    int64_t weight_bytes, fixed_bytes, block_bytes, budget_bytes, n_blocks;
} di_stage_plan;
// The split of a V4 or V4.1 model's layers into n_stages pipeline stages as the device-resident
// forward chooses it on devices with free_bytes[k] free (NULL: unknown, the weight balance of
// di_model_stage_split) for the device state the model options' dev_* fields plan (docs/cuda.md
// "The split": the most entry blocks every stage holds, then the smallest largest stage):
// stages[0, n_stages) and *n_blocks, the blocks every stage holds (-1 without memory). Host only.
// DI_ERR_INVALID as di_model_stage_split; DI_ERR_NOMEM (logged: the stage and its bytes) when no
// split leaves every stage room for its weights, fixed state and one max-context sequence.
di_status di_model_stage_plan(const di_model *model, int32_t n_stages, const size_t *free_bytes,
                              di_stage_plan *stages, int64_t *n_blocks);
// The split of a V4 or V4.1 model's layers into n_stages pipeline stages as the device-resident
// forward makes it for a device list of n_stages entries whose memory is unknown (di_device.more;
// docs/cuda.md "Several GPUs: pipeline stages"; with memory: di_model_stage_plan): contiguous
// ranges of about equal weight bytes, at least one layer each (V4.1: any cut, its Engram tables,
// which stay in host memory, not counted); stage k holds layers [layer0[k], layer0[k + 1])
// (layer0: n_stages + 1 entries) and stage_bytes[k] bytes of weights (the embedding counted on
// stage 0, the head on the last, and there the MTP block with dev_spec (V4) or DSpark's blocks
// (V4.1) with the embedding copy they use; NULL: not wanted). Host only (no device).
// DI_ERR_INVALID (n_stages < 1, > DI_DEVICE_MAX_MORE + 1 or > the model's layers; logged),
// DI_ERR_NOMEM.
di_status di_model_stage_split(const di_model *model, int32_t n_stages, int32_t *layer0,
                               int64_t *stage_bytes);
// Compression ratio of layer il (0 = sliding window only, 4 = CSA, other = HCA); -1 if out of
// range.
int32_t di_model_layer_ratio(const di_model *model, int32_t il);

// Writes a random-weight DeepSeek V4 checkpoint (config.json + model.safetensors) into the
// existing directory dir. preset: "tiny" (the spec's tiny test shapes with the real 129,280-token
// vocabulary; the built-in default model), "flash-4l" (true V4-Flash widths, 4 layers, 32
// experts; for benchmarks), "flash-full" / "flash-full-<N>l" (every V4-Flash width with 256
// experts, N layers (default 2), no MTP block, fast random codes: ~3.3 GB per layer + 2.1 GB) or
// "v41-tiny" (the DeepSeek V4.1 tiny test model of deepseek-v41.md §7.2, with DSpark in the
// official layout) or "v41-flash-4l" (V4.1-Flash widths, 4 layers, 32 experts, one Engram
// layer, no DSpark, fast random codes: 5.9 GiB; for benchmarks). official: DeepSeek's FP8/FP4
// layout with an MTP block, else the Hugging Face naming in BF16. The weights are random, so
// generated text is meaningless. Returns DI_ERR_INVALID (unknown preset), DI_ERR_IO, DI_ERR_NOMEM.
di_status di_synth_checkpoint(const char *preset, const char *dir, bool official, uint64_t seed);

// Converts the official-layout checkpoint in src_dir to a GGUF file of llama.cpp's deepseek4
// architecture at dst_path (loadable by di_model_load and by llama.cpp). type: "q8_0" (what
// llama.cpp's converter writes: FP8 -> Q8_0, FP4 experts -> MXFP4, float kept), "q4_k", "bf16",
// "f16" or "f32". Returns DI_ERR_INVALID (unknown type, not the official layout), DI_ERR_IO,
// DI_ERR_FORMAT, DI_ERR_NOMEM.
di_status di_convert_gguf(const char *src_dir, const char *dst_path, const char *type);

// ---- session: one sequence's incremental state ----

typedef struct di_session di_session;

typedef struct di_session_options {
    int32_t n_ctx_max; // positions this session may reach; 0 = the model's max_position_embeddings
    bool mtp; // run the MTP block (V4) / DSpark context (V4.1) on every step (needs its weights)
    // A session on the device-resident forward recovers from a lost device (di_session_forward):
    // at most device_loss_max losses found by its calls within device_loss_window_s seconds
    // (0: 3 and 600 s, the serving engine's defaults). Must not be negative.
    int32_t device_loss_max;
    int32_t device_loss_window_s;
} di_session_options;

di_session_options di_session_options_default(void);

// Creates an empty sequence state (position 0). DI_ERR_INVALID if mtp is requested but the
// checkpoint has no MTP block, or for a negative count; DI_ERR_NOMEM.
// Sessions on the device-resident forward (a model loaded with --device cuda: every V4 session, MTP
// ones included, every V4.1 session, DSpark ones included; docs/cuda.md "Sessions on the
// device-resident forward") keep the tokens they were fed on the host (4 bytes a position):
// device-loss recovery and di_session_save replay them. Creating and destroying such sessions must
// not overlap the forward calls of the model's other sessions (a recovery rebuilds the device state
// of all of them). DI_SESSION_LOSE_DEVICE=N (debug) makes the first N forward calls of every
// session created afterwards fail as on a lost device, without running: a drill of the recovery (on
// the CPU forward there is nothing to rebuild: the call fails with DI_ERR_DEVICE_LOST).
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
// Returns DI_ERR_INVALID (bad token id, n_tokens < 1, context exceeds n_ctx_max), DI_ERR_NOMEM;
// on the device-resident forward (--device cuda, V4 or V4.1) also DI_ERR_CUDA, after
// which the session is reset to position 0. A lost device (DI_ERR_DEVICE_LOST) is recovered
// inside the call: the device state of every session on the model's device-resident forward is
// dropped, the forward rebuilt (the devices reset, the weights uploaded again:
// di_model_dev_rebuild; needs a forward the model opened itself, as --device does), this session's
// tokens replayed into a new device state and the call run again, so its logits and every later
// one equal a run that never lost the device (the model's other sessions replay theirs at their
// next call); logged at WARN, counted in di_session_get_stats. More losses than
// device_loss_max within device_loss_window_s, or a rebuild that fails: DI_ERR_DEVICE_LOST
// (logged), the session keeping its tokens and position (a later call tries again, counting
// another loss). With expert workers DI_ERR_IO (the session must be discarded); with prefill
// workers (a call of at least cp_min_tokens tokens) DI_ERR_IO, after which the session is exactly
// as before the call (retry it, with or without the workers).
di_status di_session_forward(di_session *s, const int32_t *tokens, int32_t n_tokens,
                             const di_forward_out *out);

// Serialises the state into a new buffer (*bytes, free with di_free_buffer). On the CPU forward:
// the whole state (position, window rings, compressed pools, compressor buffers). On the
// device-resident forward: the model's identity and the tokens fed (a token state: 32 bytes +
// 4 a position, whatever the model's size), which di_session_restore replays (the device's state
// is not downloaded: the device-resident forward keeps no rollback rows and snapshots its rings
// only at block boundaries: docs/cuda.md "Sessions on the device-resident forward"). DI_ERR_NOMEM.
di_status di_session_save(const di_session *s, void **bytes, size_t *n_bytes);
// Restores a state written by di_session_save for the same model. A token state (saved on the
// device-resident forward) restores into any session of the model, on the device or on the CPU:
// the session is reset and the tokens fed again (in chunks; the cost of their prefill), after
// which its state is the one of a session fed those tokens, so it continues with the same logits.
// A CPU state restores into a session on the CPU forward only. DI_ERR_FORMAT (logged) when the
// bytes are not such a state (another model, truncated, corrupted, more positions than the
// session's n_ctx_max, a CPU state given to a device session): a session on the device-resident
// forward, or one given bytes that claim to be a token state, is then unchanged; a CPU session
// given other bad bytes is left reset. The replay's errors (as di_session_forward) leave the
// session reset.
di_status di_session_restore(di_session *s, const void *bytes, size_t n_bytes);
void di_free_buffer(void *p);

// What a session's device-loss recovery did (di_session_forward): losses its calls found (a drill's
// included), recoveries done (each rebuilt the device state and replayed the session's tokens)
// and tokens replayed in all (restores and replays after another session's recovery included).
typedef struct di_session_stats {
    int64_t n_device_losses;
    int64_t n_device_recoveries;
    int64_t n_replayed_tokens;
} di_session_stats;
void di_session_get_stats(const di_session *s, di_session_stats *out);

// Takes back the last n_tokens positions (speculative tokens the target rejected): afterwards the
// session is exactly the state of a run that never fed them (its logits and MTP logits too). At
// most 16 positions per call on DeepSeek V4.1, 8 on V4 (on the CPU forward and on the
// device-resident one, MTP and DSpark sessions included). The new position (unless 0) must also
// be at most that limit (8 on V4, 16 on V4.1) below the highest position fed since the session was
// created or reset, across calls: on V4 taking back 8, feeding 1 and taking back 2 more is refused
// (the rings hold no more rows: the row fed again gives back none of those the taken-back rows
// overwrote); after restoring a state, nothing below its position. Returns DI_ERR_INVALID
// (n_tokens < 0, more than fed, over the limit); nothing changes then.
di_status di_session_rollback(di_session *s, int32_t n_tokens);

// One DSpark draft block (DeepSeek V4.1, spec deepseek-v41.md §3.3).
typedef struct di_draft {
    int32_t n;          // drafts in the block (dspark_block_size, <= 16)
    int32_t tokens[16]; // greedy drafts for positions a+1 .. a+n (a = di_session_n_past)
    float
        confidence[16]; // P(draft j accepted | drafts before j accepted), from the confidence head
    float conf_logit[16]; // the confidence head's logits
} di_draft;

// Drafts a block after the last forward: anchor = the token chosen for position a =
// di_session_n_past(s) (not fed yet). logits: NULL or [n, n_vocab] Markov-corrected draft logits.
// The session must run the speculative module (di_session_options.mtp on a V4.1 checkpoint with
// DSpark weights). The session state is unchanged. On the device-resident V4.1 forward the draft
// runs there (the CPU forward's drafts, confidences and logits, bit for bit), with the session's
// device-loss recovery (di_session_forward). Returns DI_ERR_INVALID (no DSpark, bad anchor,
// nothing fed yet), DI_ERR_UNSUPPORTED (a V4 session), DI_ERR_NOMEM.
di_status di_session_draft(di_session *s, int32_t anchor, di_draft *out, float *logits);

// ---- structured output: grammars (src/grammar; docs/structured-output.md) ----
//
// A di_grammar constrains what a request may generate. It is compiled once (any thread), is
// immutable afterwards, and may be shared by any number of requests. A di_grammar_vocab is the
// byte trie of a tokenizer's tokens that the engine walks to compute each step's allowed tokens;
// build it once per tokenizer and pass it in di_engine_options.

typedef struct di_grammar di_grammar;
typedef struct di_tokenizer di_tokenizer; // (declared again below with its API)
typedef struct di_grammar_vocab di_grammar_vocab;

typedef enum di_grammar_kind {
    DI_GRAMMAR_KIND_EBNF = 0,        // GBNF-style EBNF text; the start rule is `root`
    DI_GRAMMAR_KIND_JSON_SCHEMA = 1, // a JSON Schema (JSON text)
    DI_GRAMMAR_KIND_JSON_OBJECT = 2, // any JSON object (text ignored, may be NULL)
    DI_GRAMMAR_KIND_REGEX = 3,       // an ECMAScript regular expression; the whole output matches
} di_grammar_kind;

enum {
    // JSON Schema: OpenAI's strict mode (an object without additionalProperties allows none).
    DI_GRAMMAR_FLAG_STRICT = 1,
};

// Compiles n_text bytes of text of the given kind into *out (free with di_grammar_destroy).
// flags: DI_GRAMMAR_FLAG_*. On DI_ERR_INVALID, err (err_size bytes, may be NULL) receives a
// human-readable reason: "line:col: ..." for EBNF, the keyword and its JSON pointer for JSON
// Schema, the offset for a regex. DI_ERR_NOMEM.
di_status di_grammar_compile(di_grammar_kind kind, const char *text, size_t n_text, uint32_t flags,
                             di_grammar **out, char *err, size_t err_size);
// Tool calls (docs/structured-output.md "Tool calls"): a grammar over DSML tool-call blocks
// (serving.md §1.6) built from a tool list, for the text that follows a prompt prefilled with the
// block header ("\n\n<｜DSML｜tool_calls>\n", V4.1 "\n\n<｜DSML｜ calls>\n"): one or more
// invokes of the listed tools, each parameter a declared property of the tool's JSON-schema
// parameters (declared order, required ones present): string-typed ones as string="true" raw
// text (no U+FF5C '｜'; an enum or const as its literal values), any other as string="false" and
// a JSON value constrained by its schema; then the block's closing tag. DSML tags use the
// tokenizer's ｜DSML｜ special token as a token terminal.
typedef enum di_grammar_tools_start {
    DI_GRAMMAR_TOOLS_AFTER_HEADER = 0, // after the prefilled "\n\n<｜DSML｜tool_calls>\n"
    DI_GRAMMAR_TOOLS_AFTER_DSML = 1,   // after the first ｜DSML｜ token: "tool_calls>\n" ...
                                       // (tool_choice auto, grammar_after = that token)
    DI_GRAMMAR_TOOLS_BLOCK = 2, // the whole block: "\n"{0,2} "<" ｜DSML｜ "tool_calls>\n"...
} di_grammar_tools_start;

typedef struct di_grammar_tools_options {
    const char *name;             // only this tool (a named tool_choice); NULL: any of the tools
    bool parallel;                // several invokes (parallel_tool_calls); false: exactly one
    int encoding;                 // 0 = dsv4 ("tool_calls", "invoke"), 1 = dsv41 (" calls", ...)
    di_grammar_tools_start start; // where the grammar begins
} di_grammar_tools_options;

// tools_json: a JSON array of tools, each {"name", "parameters"} (Responses), {"type":
// "function", "function": {"name", "parameters", "strict"?}} (Chat) or {"name", "input_schema"}
// (Anthropic); "strict": true applies DI_GRAMMAR_FLAG_STRICT to that tool's schemas.
// DI_ERR_INVALID with a reason in err (a schema the converter refuses, a name that DSML cannot
// carry, an unknown o->name), DI_ERR_UNSUPPORTED (tok has no ｜DSML｜ token), DI_ERR_NOMEM.
di_status di_grammar_compile_tools(const di_tokenizer *tok, const char *tools_json, size_t n,
                                   const di_grammar_tools_options *o, di_grammar **out, char *err,
                                   size_t err_size);
// A grammar that accepts what a or b accepts (root ::= a | b), e.g. a response format or a tool
// block. a and b are borrowed (copied). DI_ERR_INVALID (over the grammar limits), DI_ERR_NOMEM.
di_status di_grammar_union(const di_grammar *a, const di_grammar *b, di_grammar **out);
// Releases the caller's reference. NULL does nothing. Requests already submitted with g keep their
// own reference (the grammar is freed when the last of them finishes).
void di_grammar_destroy(di_grammar *g);
// Number of rules in g (generated rules included): a size measure for logs and tests.
int32_t di_grammar_n_rules(const di_grammar *g);

// A cache of compiled grammars (docs/structured-output.md "Token sets"): requests that compile the
// same response format or tool list get the same di_grammar, and so share the token sets its
// masks compute (the first request's string contexts make the second's cheap). Keyed by the
// exact generated EBNF text (compared byte for byte); at most n_max grammars and bytes_max bytes
// (text, compiled arrays, token sets), least recently used evicted first. The cache holds one
// reference per grammar; callers own the references they get. Any thread.
typedef struct di_grammar_cache di_grammar_cache;
// DI_ERR_NOMEM.
di_status di_grammar_cache_create(int32_t n_max, size_t bytes_max, di_grammar_cache **out);
// Drops the cache's references (grammars still held elsewhere live on). NULL does nothing.
void di_grammar_cache_destroy(di_grammar_cache *c);
// di_grammar_compile, di_grammar_compile_tools and di_grammar_union through cache c (NULL: no
// cache); same arguments, results and errors. A union is cached when a and b came from a cache.
di_status di_grammar_cache_compile(di_grammar_cache *c, di_grammar_kind kind, const char *text,
                                   size_t n_text, uint32_t flags, di_grammar **out, char *err,
                                   size_t err_size);
di_status di_grammar_cache_compile_tools(di_grammar_cache *c, const di_tokenizer *tok,
                                         const char *tools_json, size_t n,
                                         const di_grammar_tools_options *o, di_grammar **out,
                                         char *err, size_t err_size);
di_status di_grammar_cache_union(di_grammar_cache *c, const di_grammar *a, const di_grammar *b,
                                 di_grammar **out);
// Lookups that found a grammar, lookups that compiled one, grammars held now.
void di_grammar_cache_get_stats(di_grammar_cache *c, int64_t *n_hits, int64_t *n_misses,
                                int32_t *n_grammars);

// Builds the token trie of tok (borrowed only during the call): every token except added tokens
// (special or not: they are never allowed by a grammar). DI_ERR_NOMEM.
di_status di_grammar_vocab_create(const di_tokenizer *tok, di_grammar_vocab **out);
void di_grammar_vocab_destroy(di_grammar_vocab *v);

// ---- engine: many concurrent requests (continuous batching) ----
//
// An engine owns a model, a paged KV pool, a prefix cache, a scheduler and one engine thread.
// Requests are submitted from any thread; each step the engine thread batches running decodes
// with chunks of waiting prefills under a token budget, runs one ragged forward pass, samples,
// and reports tokens through the request's callback. Results do not depend on what else runs:
// every request's tokens and log-probabilities equal those of the request run alone.
// See docs/architecture.md (engine) and docs/kv-cache.md.

#define DI_MAX_LOGPROBS 20
#define DI_MAX_STOP 16   // stop ids and stop strings per request, each
#define DI_MAX_SNAP_AT 4 // requested tail-snapshot points per request (di_request_params.snap_at)
#define DI_PRIORITY_MIN (-1000000) // di_request_params.priority range
#define DI_PRIORITY_MAX 1000000
#define DI_ENGINE_PRIORITY_AGING_MS 10000 // di_engine_options.priority_aging_ms's default

typedef struct di_engine di_engine;

typedef struct di_logit_bias {
    int32_t token;
    float bias; // added to the logit
} di_logit_bias;

typedef struct di_sample_params {
    float temperature;        // 0 = greedy (ties to the lowest id)
    int32_t top_k;            // keep the k most likely; 0 = all
    float top_p;              // nucleus mass in (0, 1]; 1 = off
    float min_p;              // drop tokens below min_p x the top probability; 0 = off
    float repetition_penalty; // > 0; 1 = off. Divides positive / multiplies negative logits of
                              // every token in the prompt or output (HF semantics)
    float presence_penalty;   // subtracted once from each token already generated; 0 = off
    float frequency_penalty;  // subtracted per occurrence in the output; 0 = off
    const di_logit_bias *logit_bias; // borrowed until submit returns (copied); may be NULL
    int32_t n_logit_bias;
    uint64_t seed; // randomness is a function of (seed, position) only
    // Report di_event.logprob, the chosen token's log-probability under the raw logits (a softmax
    // over the whole vocabulary per token; skipped, and logprob 0, when off). n_logprobs > 0
    // implies it.
    bool logprobs;
    int32_t n_logprobs; // top-N log-probabilities per token, 0 .. DI_MAX_LOGPROBS
} di_sample_params;

// Greedy, no truncation, no penalties, seed 0, no logprobs.
di_sample_params di_sample_params_default(void);

typedef enum di_finish {
    DI_FINISH_NONE = 0,      // more tokens follow
    DI_FINISH_STOP = 1,      // EOS, a stop id or a stop string
    DI_FINISH_LENGTH = 2,    // max_tokens reached (or the context is full)
    DI_FINISH_CANCELLED = 3, // di_engine_cancel
    DI_FINISH_ERROR = 4,     // see di_event.status
} di_finish;

typedef struct di_event {
    uint64_t request_id;
    int32_t token; // the new token, or -1 on a final event that carries none
    int32_t index; // index of the token in the output (0 = first generated)
    float logprob; // log-softmax of the raw logits at token (0 unless sample.logprobs or
                   // n_logprobs); under an active grammar, of the masked logits
    int32_t n_top; // top-N log-probabilities (borrowed, valid during the callback)
    const int32_t *top_ids;
    const float *top_logprobs;
    const char *text; // bytes released by this token (stop strings held back; needs
    size_t n_text;    // di_engine_options.token_bytes, else NULL / 0); borrowed
    di_finish finish; // != DI_FINISH_NONE on the request's last event
    di_status status; // DI_OK, or the error of DI_FINISH_ERROR
    // On the last event: prompt tokens taken from the prefix cache, tokens recomputed to rebuild
    // their window state (bounded replay), and forward rows the request cost in all.
    int32_t n_cached, n_replayed, n_computed;
    int32_t n_preempted; // times the request was preempted and recomputed
} di_event;

// Called on the engine thread for every event; must be quick and must not call the engine
// except di_engine_cancel.
typedef void (*di_event_fn)(void *user, const di_event *ev);

typedef struct di_request_params {
    const int32_t *prompt; // n_prompt >= 1 ids (copied)
    int32_t n_prompt;
    di_sample_params sample;
    int32_t max_tokens;      // >= 1
    const int32_t *stop_ids; // extra stop token ids (copied), up to DI_MAX_STOP
    int32_t n_stop_ids;
    bool ignore_eos;                 // do not stop at the model's EOS
    const char *const *stop_strings; // NUL-terminated (copied), up to DI_MAX_STOP; need
    int32_t n_stop_strings;          // di_engine_options.token_bytes
    uint64_t cache_salt; // prefix-cache namespace: only requests with the same salt share
    // Scheduling (docs/architecture.md, "Scheduling"). Lower priorities run first (vLLM's
    // convention; default 0, in [DI_PRIORITY_MIN, DI_PRIORITY_MAX]): admission takes the best
    // effective priority first (the priority less one level per
    // di_engine_options.priority_aging_ms waited), and a waiting request that finds no room
    // preempts running requests of a worse priority (newest first; they recompute later,
    // exactly). Among equal priorities admission prefers the tenant that received the fewest
    // weighted tokens (a virtual token counter: fair share between users; tenant 0 is one tenant
    // too), then arrival order.
    int32_t priority;
    uint64_t tenant;
    // Snapshot points (docs/kv-cache.md, "Snapshot points"): token offsets into the prompt where,
    // besides the prompt's last block boundary, the engine keeps a tail snapshot, so that a later
    // prompt sharing only tokens[0 .. p) (a system prompt, tool definitions) continues from it
    // without the bounded replay. Each p is rounded down to a block boundary (skipped when that
    // is 0, at or beyond the last boundary, or already a point). Copied; non-decreasing, each in
    // 1 .. n_prompt, at most DI_MAX_SNAP_AT (DI_ERR_INVALID otherwise). Ignored without tail
    // snapshots; a point changes only where prefill chunks end, never a result.
    const int32_t *snap_at;
    int32_t n_snap_at;
    float *first_logits; // optional [n_vocab]: receives the logits that chose token 0
    // Structured output (docs/structured-output.md): while the grammar is active, only tokens it
    // accepts next may be sampled (masked to -inf before bias, penalties and truncation; logprobs
    // then describe that masked distribution); EOS and the stop ids only when the grammar can end;
    // when nothing more can follow, the request finishes with DI_FINISH_STOP. The grammar is
    // borrowed for the call (the request keeps a reference); the engine needs
    // di_engine_options.grammar_vocab. A matcher limit exceeded (nesting too deep, too many
    // parses) ends the request with DI_FINISH_ERROR and DI_ERR_UNSUPPORTED.
    const di_grammar *grammar; // NULL: unconstrained
    // The grammar becomes active after this token is generated (e.g. </think>: reasoning is never
    // constrained); -1 (the default): from the first generated token.
    int32_t grammar_after;
    di_event_fn on_event;
    void *user;
} di_request_params;

di_request_params di_request_params_default(void);

typedef struct di_engine_options {
    int n_threads; // CPU threads; 0 = one per online CPU
    di_precision precision;
    di_device device;         // where the model runs (di_model_options.device); CUDA on a V4
                              // FP32 checkpoint: the device-resident forward (see create)
    size_t kv_memory_bytes;   // the KV pool (window rings, compressed entries, compressor
                              // buffers). On the device-resident forward it is device memory:
                              // max_seqs slots' rings, the rest entry blocks; its blocks are
                              // also capped by the memory the stages report left after their
                              // weights, fixed state and dev_reserve_bytes (docs/cuda.md "The
                              // split"). On V4.1: max_seqs slot tails, the rest blocks (see
                              // create). 0 = automatic: on the device-resident forward whose
                              // devices report their memory, every block the stages hold (the
                              // cap alone), elsewhere 256 MiB
    size_t dev_reserve_bytes; // di_model_options.dev_reserve_bytes; 0: its default
    int32_t max_seqs;         // sequences running at once; 0 = 16
    int32_t max_batch_tokens; // forward rows per step (token budget); 0 = 256
    int32_t max_ctx;          // positions per request; 0 = 8192 (capped by the model)
    int32_t max_queue;        // waiting requests; more are refused with DI_ERR_BUSY; 0 = 1024
    // Priority aging (docs/architecture.md, "Scheduling"): a waiting request's effective priority
    // improves by one level per priority_aging_ms it has waited, so that a steady stream of
    // better-priority work cannot starve it; 0: no aging (< 0 is refused). Default
    // (di_engine_options_default, a NULL options pointer): 10000.
    int32_t priority_aging_ms;
    const char *ep_workers;   // expert workers (di_model_options.ep_workers); NULL: none
    const char *ep_placement; // their initial placement (di_model_options.ep_placement)
    // Prefill workers (di_model_options.cp_workers, docs/context-parallel.md): a step's prefill
    // chunk of at least cp_min_tokens rows (0: 1024; chunks are at most max_batch_tokens) runs
    // alone over them; the step's other sequences go in the batched call. CPU forward (V4 without
    // MTP speculation; V4.1 with or without DSpark, a verify runs here); refused on a device.
    // NULL: none.
    const char *cp_workers;
    int32_t cp_min_tokens;
    // Online EPLB (docs/expert-parallel.md, "Online rebalancing"; with ep_workers only): every
    // eplb_interval steps (0: never) the engine plans a placement from the routing load since the
    // previous plan, with eplb_slots_per_rank replicas per rank (0: the current placement's
    // n_slots / ranks, rounded up to hold every expert), and applies it between two steps when
    // it lowers the max / mean rank load by more than eplb_min_gain (0: 0.05).
    int32_t eplb_interval;
    int32_t eplb_slots_per_rank;
    double eplb_min_gain;
    bool no_prefix_cache; // disable prefix reuse
    // Tail snapshots (docs/kv-cache.md, "Tail snapshots"): the tail state of a prompt's last
    // block boundary, kept with its cached block, so that a prefix hit there computes nothing
    // before the hit (no bounded replay). Their byte budget (least recently used out); 0 = 256
    // MiB (memory is touched only as snapshots are taken). Every forward (CPU, V4.1,
    // device-resident) with the prefix cache. no_tail_cache: off (every hit
    // is continued by the bounded replay); a budget below one snapshot is refused
    // (DI_ERR_INVALID).
    size_t tail_cache_bytes;
    bool no_tail_cache;
    // The prefix cache's disk tier (docs/kv-cache.md, "Disk tier"): a directory (created if
    // missing; borrowed until di_engine_create returns) where evicted cached blocks are written
    // and from which a later request, or a later engine on the same directory, reads them back.
    // NULL = off. Every forward (on the device-resident one the entry blocks are downloaded and
    // uploaded around the forward calls); needs the prefix cache. One engine per directory
    // (DI_ERR_BUSY otherwise).
    const char *kv_disk_dir;
    size_t kv_disk_bytes;  // the disk tier's byte budget (least recently used out); 0 = 16 GiB
    int64_t kv_disk_ttl_s; // records unused this long are dropped; 0 = 72 hours
    // Evicted blocks are copied into a staging queue and written by an IO thread (the engine
    // thread never waits for the disk): its bytes (0 = 256 MiB); a record that does not fit is
    // dropped and counted (n_disk_writes_dropped).
    size_t kv_disk_queue_bytes;
    // A waiting request whose prompt continues on disk is admitted once a read thread has read its
    // blocks (the others are admitted meanwhile): the pool bytes one such prefetch reserves at most
    // (blocks beyond are computed), its tail snapshot's staging included; 0 = 1 GiB.
    size_t kv_disk_read_bytes;
    // Such prefetches at once, one per waiting request, read one after another (a record is never
    // read twice: a request whose prompt shares it waits for the other read); all of them reserve
    // at most half of the pool's available blocks. 1 .. 64; 0 = 4.
    int32_t kv_disk_prefetches;
    // Speculative decoding with DSpark (DeepSeek V4.1 checkpoints with DSpark weights only;
    // docs/architecture.md, "Speculative decoding"): each decode step of a sequence drafts a block
    // and verifies up to spec_tokens drafts in one forward of spec_tokens + 1 rows, emitting the
    // accepted drafts and one sampled token. Outputs (tokens, logprobs) are bit for bit those
    // without it, for every sampling configuration; only the cost changes. 0 = off (the default);
    // at most DI_MAX_SPEC_TOKENS, and capped (logged) at the checkpoint's DSpark block size.
    // Refused by di_engine_create with DI_ERR_UNSUPPORTED on a V4 checkpoint or a V4.1 checkpoint
    // without DSpark weights.
    int32_t spec_tokens;
    // Verify only the longest draft prefix whose estimated survival (the product of the DSpark
    // confidence head's acceptance probabilities) is at least this, and at least one draft.
    // 0 = DI_SPEC_MIN_CONFIDENCE_DEFAULT; negative: no cut (always spec_tokens drafts). In [-1, 1].
    float spec_min_confidence;
    // Optional token bytes (e.g. from a di_tokenizer) for stop strings and event text.
    const char *(*token_bytes)(void *user, int32_t id, size_t *n_bytes);
    void *token_bytes_user;
    // Token trie for requests with a grammar (borrowed; must outlive the engine). NULL: requests
    // with a grammar are refused with DI_ERR_INVALID.
    const di_grammar_vocab *grammar_vocab;
    // Device loss on the device-resident forward (docs/cuda.md, "Device loss"): a step whose
    // forward returns DI_ERR_DEVICE_LOST ends its requests with it, preempts the other running
    // requests for recompute, drops the device's prefix-cache blocks and rebuilds the device
    // state (devices reset, weights uploaded again), up to device_loss_max times within
    // device_loss_window_s seconds (0: 3 and 600). One more loss within the window, or a failed
    // rebuild, leaves the engine unhealthy (di_engine_stats.unhealthy): every request, waiting or
    // submitted later, ends or is refused with DI_ERR_DEVICE_LOST. Negative values are refused.
    int32_t device_loss_max;
    int32_t device_loss_window_s;
} di_engine_options;

di_engine_options di_engine_options_default(void);

#define DI_MAX_SPEC_TOKENS 16               // di_engine_options.spec_tokens at most
#define DI_SPEC_MIN_CONFIDENCE_DEFAULT 0.1f // di_engine_options.spec_min_confidence's default

typedef struct di_engine_stats {
    int64_t n_blocks_total, n_blocks_free; // KV pool blocks (free includes evictable cached; on
                                           // the device-resident forward: its entry blocks)
    int64_t n_blocks_cached;               // held only by the prefix cache
    int64_t block_bytes;
    int32_t block_tokens;
    int64_t kv_memory_bytes; // the KV pool as sized: di_engine_options.kv_memory_bytes, or what
                             // its 0 came to (the devices' memory, or 256 MiB)
    int32_t n_running, n_waiting;
    int64_t n_steps, n_prefill_tokens, n_decode_tokens, n_preemptions;
    int64_t n_priority_preemptions; // of n_preemptions: for a waiting request of better priority
    // Fair share (docs/architecture.md, "Scheduling"): tenants with a running or waiting request,
    // and the tenant entries held (those and idle ones remembered; at most max_seqs + max_queue).
    int32_t n_tenants_backlogged, n_tenants_tracked;
    int64_t n_cache_hit_tokens, n_replayed_tokens;
    // Tail snapshots (0 when off): bytes of one; snapshots taken (at a prompt's last block
    // boundary) and admissions continued from one since create; held now and their bytes;
    // dropped for room (least recently used) and with their evicted blocks since create.
    int64_t tail_snap_bytes, n_tail_taken, n_tail_restored, n_tail_stored, tail_bytes;
    int64_t n_tail_evicted, n_tail_dropped;
    // The disk tier (all 0 without one): prompt tokens of n_cache_hit_tokens whose blocks were
    // read from disk; blocks written (evicted or flushed at destroy) and read back since create;
    // records and bytes on disk now; records dropped because they failed verification (corrupt,
    // truncated, another model or layout, different tokens). Of the blocks written / read, those
    // whose record carries the block's tail snapshot (read: restored into the tail cache).
    int64_t n_disk_hit_tokens, n_disk_blocks_written, n_disk_blocks_read;
    int64_t n_disk_records, disk_bytes, n_disk_dropped;
    int64_t n_disk_snaps_written, n_disk_snaps_read;
    // The disk tier's write queue (kv_disk_queue_bytes; docs/kv-cache.md, "Disk tier"): records
    // queued for the IO thread, dropped because its staging was full (only a cache entry lost),
    // and lookups served from it (blocks not yet on disk; counted in n_disk_blocks_read and
    // n_disk_hit_tokens too, their snapshots in n_disk_snaps_read) since create; records and
    // staging bytes queued now; writes that failed on the IO thread (logged; the block is not
    // kept). Time: the engine thread's staging (copies; the shutdown flush's waits too) in all and
    // its longest single record, and the IO thread's writes (off the engine thread).
    int64_t n_disk_writes_queued, n_disk_writes_dropped, n_disk_queue_hits;
    int64_t n_disk_writes_pending, disk_pending_bytes, n_disk_write_errors;
    int64_t disk_stage_us, disk_stage_us_max, disk_write_us;
    // Admission reads (docs/kv-cache.md, "Disk tier"): prefetches started and done; records and
    // bytes the read thread read for them and its time; the engine thread's time on them (probing
    // the index, reserving blocks, taking the read blocks: no file IO); requests admitted after
    // waiting for their prefetch, and the total of those waits.
    int64_t n_disk_prefetches, n_disk_prefetches_done, n_disk_prefetch_blocks, disk_prefetch_bytes;
    int64_t disk_prefetch_read_us, disk_prefetch_engine_us, n_disk_prefetch_waits;
    int64_t disk_prefetch_wait_us;
    // The disk tier on the device-resident forward (docs/kv-cache.md): evicted device blocks
    // downloaded for their write-back, read blocks uploaded into device blocks (both before a
    // forward call, or while none runs), and write-backs lost (no room in the transfer batch, a
    // failed download, or recorded after a failed step). 0 on the other forwards.
    int64_t n_disk_dev_downloads, n_disk_dev_uploads, n_disk_dev_lost;
    int64_t n_step_allocs; // heap allocations made by the engine thread inside steps (debug
                           // builds count them; always 0 in a correct build)
    // Where the steps' time went on the forward thread, since create: the forward calls (with
    // speculation's draft and MTP calls, and on the device the logits' downloads) and the
    // sampling of their rows (on the model's thread pool; greedy rows on the device-resident
    // forward arrive as their argmax and cost nothing here).
    int64_t forward_us, sample_us;
    // Asynchronous scheduling: steps whose plan was built while the previous step's forward
    // ran, and those of them whose plan was complete before that forward returned.
    int64_t n_plans_ahead, n_plans_overlapped;
    // Structured output: token masks the engine thread computed while the forward that samples
    // with them ran (the others are computed by the sampling threads, after the forward).
    int64_t n_masks_ahead;
    // Work of the weight matmuls run on the CPU since create: bytes of weights read and
    // multiply-adds done (what a step's time is bounded by: bytes / read bandwidth or
    // multiply-adds / FMA peak). Matmuls run on a device are counted in `device` instead.
    int64_t weight_bytes, weight_macs;
    // Batched forward calls the CPU forwards ran since create (one per step on the CPU and V4.1
    // forwards, whatever the step's sequences; 0 on the device-resident forward).
    int64_t n_forward_calls;
    di_device_stats device; // the model's device work (zero on the CPU)
    // Steps whose forward failed (the device-resident forward: DI_ERR_CUDA, DI_ERR_NOMEM): their
    // requests ended with DI_FINISH_ERROR and the error in di_event.status; the engine goes on.
    int64_t n_failed_steps;
    // Steps failed since the last step that succeeded (0 after a success, and after a device
    // loss is recovered): a device whose every step fails keeps counting; the server reports
    // itself failing from 3 in a row on (docs/server.md, /ready and /health). A lost device (a
    // sticky CUDA error) is recovered or given up on instead (n_device_losses below).
    int64_t n_failed_in_a_row;
    // Device loss (di_engine_options.device_loss_max; docs/cuda.md, "Device loss"): steps whose
    // forward found the device lost (DI_ERR_DEVICE_LOST), rebuilds of the device state that
    // succeeded, running requests preempted for recompute by them, and whether the engine gave up
    // (too many losses within the window, or a failed rebuild): it then refuses every request with
    // DI_ERR_DEVICE_LOST (the server's /health and /ready answer 503), for good.
    int64_t n_device_losses, n_device_recoveries, n_device_loss_preempted;
    bool unhealthy;
    // Speculative decoding (di_engine_options.spec_tokens): verify forwards (one per sequence and
    // step that speculated), drafts the DSpark module proposed, drafts fed to the target after
    // the confidence cut (the extra forward rows), drafts accepted (tokens gained over one per
    // verify), and verifies by accepted drafts (n_spec_accept_hist[j]: j drafts accepted).
    // Tokens per verify = (n_spec_verifies + n_spec_accepted) / n_spec_verifies.
    int64_t n_spec_verifies, n_spec_drafted, n_spec_verified, n_spec_accepted;
    int64_t n_spec_accept_hist[DI_MAX_SPEC_TOKENS + 1];
    // What drafts: "DSpark" (V4.1: blocks cut by confidence), "MTP" (V4: the MTP block, one
    // draft per verify, always verified); NULL without speculation. Static storage.
    const char *spec_drafter;
    // Expert routing load (docs/expert-parallel.md, "EPLB"), counted by the CPU and V4.1
    // forwards (0 on the device-resident forward): routed (token, expert) pairs since create over
    // every MoE layer (main layers and MTP blocks), and the mean over layers of max / mean expert
    // load (1 = every expert equally loaded; 0 before any load). Per-expert counts:
    // di_engine_expert_load.
    int64_t n_expert_pairs;
    double expert_load_imbalance;
    // Online EPLB: plans made, plans applied, replicas moved by them, and the balance (max / mean
    // rank load, 1 = perfect) of the placement in force under the last planned window (0 before
    // the first plan). eplb_plan_us: time the planner thread spent on those plans (off the engine
    // thread: steps go on while a plan is computed; it is applied between two steps).
    int64_t n_eplb_plans, n_eplb_rebalances, n_eplb_moves;
    double eplb_balance;
    int64_t eplb_plan_us;
} di_engine_stats;

// Loads the model at model_dir and starts the engine thread. When the model has the
// device-resident forward (di_model_load with a CUDA device on a V4 FP32 checkpoint), every step
// runs on it: one device state of max_seqs slots and max_batch_tokens rows whose compressed
// entries are paged in entry blocks sized from kv_memory_bytes (the KV manager's blocks: the
// prefix cache and bounded replay work as on the CPU path), created and exercised once here; a
// step whose device call fails ends its requests with DI_FINISH_ERROR and goes on.
// A DeepSeek V4.1 checkpoint runs one V4.1 session per slot (with the DSpark module when
// spec_tokens > 0, which makes a slot's tail larger), its tail (rings, history) reserved here for
// max_ctx positions and max_batch_tokens rows; a step runs its sequences in one batched call.
// kv_memory_bytes pays the max_seqs tails first (max_seqs is lowered, logged, so that the blocks
// of one max_ctx sequence still fit) and buys blocks of entries and index keys with the rest, as
// on the CPU forward: sequences take blocks as they grow, are preempted when they run out, and a
// prefix hit shares cached blocks (docs/kv-cache.md, "DeepSeek V4.1"). A verify forward feeds
// spec_tokens + 1 rows of one sequence beside the step's token budget (max_batch_tokens bounds the
// rows of one call). Otherwise the CPU forward runs, its matmuls on the device when one is given.
// With kv_disk_dir (any forward), the engine opens the prefix cache's disk tier there.
// DI_ERR_IO (also: the disk tier's directory cannot be created or read), DI_ERR_FORMAT,
// DI_ERR_UNSUPPORTED (as di_model_load; spec_tokens > 0 on a checkpoint without DSpark),
// DI_ERR_INVALID (bad options; e.g. a KV budget too small for one sequence, a spec_tokens or
// spec_min_confidence out of range, a V4.1 checkpoint whose sessions cannot run: no Engram token
// map, kv_disk_dir with no_prefix_cache), DI_ERR_BUSY (kv_disk_dir is locked by another engine),
// DI_ERR_CUDA (the device state or its first call failed), DI_ERR_NOMEM.
di_status di_engine_create(const char *model_dir, const di_engine_options *opt, di_engine **out);
// Cancels every request (each gets its final event), stops the thread, writes the cached blocks
// not yet on disk to the disk tier (if any, so that a restarted engine finds them), frees
// everything. NULL does nothing.
void di_engine_destroy(di_engine *e);
// The engine's model's expert-worker counters (di_model_ep_stats). Safe from any thread.
int32_t di_engine_ep_stats(di_engine *e, di_ep_worker_stats *out, int32_t cap);
// Any thread (the server's /ready and /health). With expert workers and steps failing in a row,
// reconnects the workers that are down (2 s timeouts; at most once a second, later calls return
// the last answer) and, when every worker answers, ends the failure streak (n_failed_in_a_row =
// 0: with expert workers a step fails because of them, and the next one reaches them). DI_OK:
// no workers, nothing failing, or every worker answers; DI_ERR_IO: a worker is still down;
// DI_ERR_BUSY: a forward is using the workers (its outcome ends or extends the streak).
di_status di_engine_probe_workers(di_engine *e);
// Any thread. Copies the request and queues it; *id receives its id. DI_ERR_INVALID (bad
// parameters, prompt + max_tokens beyond max_ctx, stop strings without token_bytes),
// DI_ERR_BUSY (queue full), DI_ERR_NOMEM.
di_status di_engine_submit(di_engine *e, const di_request_params *p, uint64_t *id);
// Any thread. Marks the request cancelled; the engine thread frees its KV blocks before its next
// step and sends DI_FINISH_CANCELLED. Unknown or finished ids are ignored.
void di_engine_cancel(di_engine *e, uint64_t id);
// Any thread. Blocks until no request is waiting or running, no online EPLB plan is in flight
// (a plan being computed is applied first), and the disk tier's write queue is empty (every block
// evicted so far is on disk, or failed and counted).
void di_engine_wait_idle(di_engine *e);
// Any thread. A consistent snapshot taken between steps.
void di_engine_get_stats(di_engine *e, di_engine_stats *out);
// Any thread, never blocking the engine. The routing load since create of every (MoE layer,
// expert) as the expert-load JSON document (docs/expert-parallel.md: "deepinfer-expert-load",
// version 1; the input of `deepinfer eplb --load`) in a new buffer (*json, *n bytes,
// NUL-terminated; free with di_free_buffer). DI_ERR_NOMEM.
di_status di_engine_expert_load(di_engine *e, char **json, size_t *n);

// KV transfer for prefill/decode disaggregation (docs/disaggregation.md): the prefix cache's full
// blocks of a prompt, moved between engines of the same model as a verified transfer (a header and
// the disk tier's block records). Both run on the engine thread between steps; the caller waits
// (any thread but the engine's: never from an event callback). CPU forward with the prefix cache
// only: DI_ERR_UNSUPPORTED otherwise. On an error err[cap] says why (DI_ERR_BUSY: the engine is
// stopping). Export: the cached blocks of tokens[0 .. n_tokens) under cache_salt, whole blocks from
// the first on, stopping at the first one not cached (run the prompt first: its blocks are cached
// when it has been computed), into *bytes (free with di_free_buffer); *n_blocks of them.
// DI_ERR_INVALID (n_tokens beyond the context), DI_ERR_UNSUPPORTED, DI_ERR_BUSY, DI_ERR_NOMEM.
di_status di_engine_kv_export(di_engine *e, const int32_t *tokens, int32_t n_tokens,
                              uint64_t cache_salt, void **bytes, size_t *n_bytes, int32_t *n_blocks,
                              char *err, size_t cap);
// Import: verifies the whole transfer (model identity and precision, layout, checksums, the chain
// and its hashes), then adds its blocks to the prefix cache as idle cached blocks (a later request
// with that prompt attaches them: a prefix hit, continued by the bounded replay). On success
// *n_inserted blocks were copied in, *n_present were cached already; the chain stops early when
// the pool has no block to spare. A transfer failing any check inserts nothing: DI_ERR_INVALID
// (made by another model identity or precision), DI_ERR_FORMAT (malformed or corrupt),
// DI_ERR_UNSUPPORTED, DI_ERR_BUSY, DI_ERR_NOMEM.
di_status di_engine_kv_import(di_engine *e, const void *bytes, size_t n_bytes, int32_t *n_inserted,
                              int32_t *n_present, char *err, size_t cap);
// Probe: how much of a prompt this engine holds (the PD router asks the decode replica before
// moving KV): *n_cached tokens of tokens[0 .. n_tokens) under cache_salt are in whole cached
// blocks, the chain from the first block, in memory or in the disk tier (*n_disk of them on disk,
// read when the request comes). Reads and changes nothing; runs between steps like the others.
// 0 and 0 without a prefix cache. DI_ERR_INVALID (n_tokens beyond the context), DI_ERR_BUSY.
di_status di_engine_kv_probe(di_engine *e, const int32_t *tokens, int32_t n_tokens,
                             uint64_t cache_salt, int32_t *n_cached, int32_t *n_disk);

// ---- tokenizer and chat rendering ----
//
// DeepSeek V4/V4.1 byte-level BPE tokenizer (HF tokenizer.json), prompt rendering and output
// parsing; implemented in src/tok (docs/tokenizer.md). A di_tokenizer is immutable after load and
// may be used from any thread; a di_detok belongs to one stream (one thread at a time).

typedef struct di_tokenizer di_tokenizer;

// Loads a Hugging Face tokenizer.json (plain, or gzip-compressed) of a byte-level BPE model with
// DeepSeek V3/V4's pre-tokenizer. Returns DI_ERR_IO (cannot read), DI_ERR_FORMAT (malformed or
// inconsistent file), DI_ERR_UNSUPPORTED (another model type or pre-tokenizer), DI_ERR_NOMEM.
di_status di_tokenizer_load(const char *path, di_tokenizer **out);
// The tokenizer of a model directory: model_dir/tokenizer.json if present, else the copy of
// DeepSeek V4's tokenizer committed with the sources (data/tokenizer/deepseek-v4/tokenizer.json;
// the environment variable DI_TOKENIZER overrides that fallback). model_dir may be NULL.
// Same return codes as di_tokenizer_load.
di_status di_tokenizer_load_for_model(const char *model_dir, di_tokenizer **out);
// Frees the tokenizer. NULL does nothing. Detokenizers made from it must be destroyed first.
void di_tokenizer_destroy(di_tokenizer *tok);
// Ids run 0 .. n_vocab-1 (129,280 for DeepSeek V4).
int32_t di_tokenizer_n_vocab(const di_tokenizer *tok);
// Id of the token whose text is exactly the NUL-terminated `text` (e.g. "<｜User｜>"), or -1.
int32_t di_tokenizer_token_id(const di_tokenizer *tok, const char *text);
// Bytes of token id (borrowed from tok, not NUL-terminated; *n_bytes gets the length), or NULL
// if id is not a token.
const char *di_tokenizer_token_bytes(const di_tokenizer *tok, int32_t id, size_t *n_bytes);
// true if id is an added token marked special (BOS, EOS, <｜User｜>, ...).
bool di_tokenizer_is_special(const di_tokenizer *tok, int32_t id);

// Encodes n_bytes of UTF-8 text. special = true: added tokens in the text are recognised (use for
// template text only); false: the text is plain BPE, so "<｜User｜>" typed by a user becomes
// ordinary tokens (spec serving.md §1.1 rule 2). Ids are identical to HF tokenizers' encode
// (special) or its pre-tokenizer + model (plain). *ids is a new array (free with di_tok_free;
// NULL when *n_ids is 0). DI_ERR_INVALID (text is not valid UTF-8; logged with the byte offset),
// DI_ERR_NOMEM.
di_status di_tokenizer_encode(const di_tokenizer *tok, const char *text, size_t n_bytes,
                              bool special, int32_t **ids, size_t *n_ids);
// Decodes ids to text exactly as HF tokenizers' decode: token bytes concatenated, then invalid
// UTF-8 replaced by U+FFFD per maximal invalid subpart. skip_special drops special tokens.
// *text is NUL-terminated (free with di_tok_free). DI_ERR_INVALID (an id out of range),
// DI_ERR_NOMEM.
di_status di_tokenizer_decode(const di_tokenizer *tok, const int32_t *ids, size_t n_ids,
                              bool skip_special, char **text, size_t *n_bytes);
// Frees memory returned by the di_tokenizer_*, di_detok_* and di_render_* functions. NULL ok.
void di_tok_free(void *p);

// Streaming detokenizer: text for each generated token as soon as it forms complete UTF-8
// characters. Never emits a partial UTF-8 sequence; bytes that can never become valid are
// replaced by U+FFFD as HF's decode would, so the concatenation of all outputs (with the final
// flush) equals di_tokenizer_decode of all ids.
typedef struct di_detok di_detok;

// DI_ERR_NOMEM. tok is borrowed and must outlive the detokenizer.
di_status di_detok_create(const di_tokenizer *tok, bool skip_special, di_detok **out);
void di_detok_destroy(di_detok *d);
// Feeds one id; *text receives the newly completed text (possibly empty), borrowed from d and
// valid until the next call on d. DI_ERR_INVALID (id out of range; the state is unchanged).
di_status di_detok_push(di_detok *d, int32_t id, const char **text, size_t *n_bytes);
// Ends the stream: held bytes of an incomplete character come out as U+FFFD. The detokenizer is
// then empty and may be reused.
void di_detok_flush(di_detok *d, const char **text, size_t *n_bytes);

// Prompt rendering of an API request (spec serving.md §1-§2): the request is mapped to a
// conversation, rendered in the DeepSeek V4 (dsv4) or V4.1 (dsv41) format, and tokenized: special
// tokens written by the template become their ids, all text from the request (messages, reasoning,
// tool schemas, arguments, results) is plain BPE.
typedef enum di_render_api {
    DI_RENDER_API_CHAT = 0,      // OpenAI Chat Completions request
    DI_RENDER_API_RESPONSES = 1, // OpenAI Responses request
    DI_RENDER_API_MESSAGES = 2,  // Anthropic Messages request
    DI_RENDER_API_RAW = 3,       // the official encoder's input ({"messages", "tools", options})
} di_render_api;

typedef struct di_render_options {
    int encoding;           // 0 = dsv4, 1 = dsv41
    bool effort_table_0731; // dsv4: V4-0731/0813 effort texts (default: V4-0424 preview)
    bool official;          // skip the recipe's system-message normalisation (parity tests)
} di_render_options;

di_render_options di_render_options_default(void);

// Renders request_json (n_bytes of UTF-8 JSON). *text (NUL-terminated) and, when ids is not NULL,
// *ids are new buffers (free with di_tok_free). tok may be NULL when ids is NULL.
// Returns DI_ERR_INVALID (not JSON, or a request the format cannot express; logged with the
// field), DI_ERR_UNSUPPORTED (the tokenizer lacks a token the encoding needs, e.g. <｜System｜>
// for dsv41 with the V4 tokenizer), DI_ERR_NOMEM.
di_status di_render_request(const di_tokenizer *tok, const char *request_json, size_t n_bytes,
                            di_render_api api, const di_render_options *opt, char **text,
                            size_t *n_text, int32_t **ids, size_t *n_ids);

// Snapshot points of a rendered request (docs/kv-cache.md, "Snapshot points"; docs/server.md):
// token offsets into its ids for di_request_params.snap_at. The end of the system prefix (system
// messages, instructions, tool definitions: everything before the first user turn) is always one
// when there is such a prefix; a Messages request adds the end of every block marked with
// cache_control (system blocks, message content blocks; a marked tool definition marks the end of
// the system prefix, where the tool definitions end). The offsets are token boundaries: exact
// (ids[0 .. p) are the ids of the text before it alone) where a special token follows, which is
// so for the system prefix before a user turn, a message's last block and an assistant turn;
// inside plain text (a block followed by another), the last token boundary before the block's
// end. Ascending, distinct, each in 1 .. n_ids; at most DI_MAX_SNAP_AT: the cache_control marks
// first (beyond DI_MAX_SNAP_AT the first ones), then the system prefix's end if there is room.
typedef struct di_render_points {
    int32_t at[DI_MAX_SNAP_AT];
    int32_t n;
    int32_t system_end; // token offset of the system prefix's end; 0: none
    int32_t n_marked;   // cache_control marks found (before the cap and merging)
    // The output continues reasoning: a thinking-mode generation header, or a prefix-completion
    // assistant message that gives reasoning and no content (the open prefix form).
    bool ends_in_reasoning;
} di_render_points;

// di_render_request that also fills *points (NULL: the same as di_render_request); needs ids.
di_status di_render_request_points(const di_tokenizer *tok, const char *request_json,
                                   size_t n_bytes, di_render_api api, const di_render_options *opt,
                                   char **text, size_t *n_text, int32_t **ids, size_t *n_ids,
                                   di_render_points *points);

// ---- output parser (public wrapper of src/tok/parse.c; implemented in src/tok/parse_api.c) ----
//
// Incremental parser of generated text (spec serving.md §1.11, §2.6): splits decoded output into
// reasoning, content and DSML tool calls (name, then arguments as JSON text in pieces), holding
// back only bytes that may still become a label. One parser per output stream, one thread at a
// time. Event kinds and finish values mirror src/tok/parse.h one to one.

typedef enum di_parser_event_kind {
    DI_PARSER_EVENT_REASONING = 0, // text: reasoning bytes
    DI_PARSER_EVENT_CONTENT,       // text: answer bytes
    DI_PARSER_EVENT_TOOL_CALL_BEGIN,
    DI_PARSER_EVENT_TOOL_NAME, // text: bytes of the name (may come in pieces)
    DI_PARSER_EVENT_TOOL_NAME_END,
    DI_PARSER_EVENT_ARGS_DELTA, // text: JSON text of the arguments, in pieces
    DI_PARSER_EVENT_TOOL_CALL_END,
    DI_PARSER_EVENT_TOOL_CALL_ABORT, // the open call was incomplete at the end and is discarded
} di_parser_event_kind;

typedef struct di_parser_event {
    di_parser_event_kind kind;
    int32_t call_index; // tool-call events: 0-based index of the call
    const char *text;   // borrowed, valid during the callback; not NUL-terminated
    size_t len;
} di_parser_event;

typedef void (*di_parser_emit_fn)(void *user, const di_parser_event *ev);

typedef enum di_parser_stage {
    DI_PARSER_STAGE_REASONING = 0, // the prompt ends with "<think>"
    DI_PARSER_STAGE_CONTENT,       // the prompt ends with "</think>"
    DI_PARSER_STAGE_TOOL_CALLS,    // the prompt ends with an opened DSML block
} di_parser_stage;

typedef enum di_parser_finish {
    DI_PARSER_FINISH_NONE = 0,
    DI_PARSER_FINISH_STOP, // EOS or the end of a tool-call block
    DI_PARSER_FINISH_STOP_SEQUENCE,
    DI_PARSER_FINISH_LENGTH,
    DI_PARSER_FINISH_TOOL_CALLS, // stopped with at least one complete tool call
} di_parser_finish;

typedef struct di_parser di_parser;

// stop: borrowed stop strings applied to content only (copied). tok: borrowed tokenizer used by
// di_parser_feed_token; must outlive the parser. DI_ERR_INVALID (an empty stop string or one over
// 256 bytes), DI_ERR_NOMEM.
// json_output: JSON mode (response_format json_object, serving.md §1.8): in the answer a leading
// ```json / ``` fence is skipped and text outside the JSON becomes spaces.
di_status di_parser_create(const di_tokenizer *tok, di_parser_stage start, bool tools_enabled,
                           bool json_output, const char *const *stop, size_t n_stop,
                           di_parser_emit_fn emit, void *user, di_parser **out);
void di_parser_destroy(di_parser *p);
// Feeds decoded bytes (any split). DI_ERR_NOMEM.
di_status di_parser_feed(di_parser *p, const char *text, size_t n);
// Feeds one generated token id (EOS ends the stream with STOP). DI_ERR_INVALID (bad id),
// DI_ERR_NOMEM.
di_status di_parser_feed_token(di_parser *p, int32_t id);
// Ends the stream with reason (STOP or LENGTH); flushes held bytes, aborts an incomplete call and
// returns the final reason (TOOL_CALLS when a call completed and the stream stopped normally).
// Calling it again returns the same reason.
di_parser_finish di_parser_end(di_parser *p, di_parser_finish reason);
// true once the parser reached its Finished stage (a stop string or the end of the DSML block):
// nothing more will be emitted and generation may be stopped.
bool di_parser_finished(const di_parser *p);
// The stop string that finished the stream (borrowed), or NULL.
const char *di_parser_stop_string(const di_parser *p);

#ifdef __cplusplus
}
#endif
