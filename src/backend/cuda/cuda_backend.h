/*
 * cuda_backend — the CUDA backend's host side: one device context (device, one stream, a cuBLASLt
 * handle), a caching device memory pool, weight upload (once, from the mapped di_tensor), CUDA
 * graph capture of decode steps, and the op dispatch table with supports_op and the CPU fallback.
 * The kernels live one op family per <op>.cu, declared in <op>.cuh (plain C launchers).
 *
 * Conventions (docs/cuda.md):
 *   - Every launcher takes device pointers, enqueues on cu->stream and returns di_status: launch
 *     errors come back at once (cudaGetLastError), faults inside a kernel at the next
 *     di_cuda_sync (DI_ERR_CUDA, logged with the CUDA error string).
 *   - A device weight is a di_tensor whose data/scale point to device memory (same layout as the
 *     host tensor, row0 reduced to the offset inside the first scale block), so every kernel
 *     decodes exactly what quant_ref.c decodes on the CPU.
 *   - Activations are FP32 on the device, as in the CPU forward; accumulation is FP32.
 *
 *   - Peer access: at create the context enables access to every other device that allows it
 *     (di_cuda_peer_copy: the pipeline stages' device-to-device hand-over; the host bounce
 *     elsewhere).
 *   - A failed allocation is reported by the allocation (its error cleared, not left for the next
 *     launch check); device data outside a kernel's contract that the kernel can detect
 * (attention's n_keys beyond max_keys) is clamped and flagged, and the next di_cuda_sync returns
 *     DI_ERR_INVALID.
 *
 * Owns: di_cuda owns its stream, cuBLASLt handle, every pool block and every uploaded weight.
 * Thread-safety: engine thread only (one stream per engine; conventions §5).
 */
#pragma once

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "deepinfer.h"     // di_status
#include "tensor/tensor.h" // di_tensor

#ifdef __cplusplus
extern "C" {
#endif

typedef struct di_cuda_pool_block di_cuda_pool_block; // cuda_backend.cu
typedef struct di_cuda_lt_cache di_cuda_lt_cache;     // gemm_lt.cu

typedef struct di_cuda {
    int device;
    void *stream;   // owned cudaStream_t
    void *cublaslt; // owned cublasLtHandle_t
    int cc_major, cc_minor, n_sm;
    size_t smem_optin;   // shared memory per block after opting in: static + dynamic
    size_t l2_bytes;     // L2 size
    double hbm_peak_gbs; // from memory clock and bus width (a datasheet-style number)
    // Caching pool: freed blocks keep their memory and are reused for requests of the same
    // rounded size; everything is returned to the driver at destroy.
    di_cuda_pool_block *blocks; // owned list of every block
    size_t pool_bytes;          // bytes held from the driver
    // Weights uploaded with di_cuda_tensor_upload: freed at destroy.
    void **weights; // owned array of device pointers
    int64_t n_weights, cap_weights;
    size_t weight_bytes;
    bool warned_fallback[32]; // one WARN per op that fell back to the CPU
    // Debug switch (tests): ops whose bit (1 << di_cuda_op) is set report unsupported, so the CPU
    // fallback path can be checked with ordinary inputs. 0 in the engine.
    uint32_t disabled_ops;
    // Graph capture: open between di_cuda_graph_begin and _end; `refused` is set by the backend
    // vtable (cuda_ops.cu) when it refused a call inside the capture (the capture then fails).
    bool capturing, refused;
    // matmul_a8's FP8 tensor-core path (gemm.cuh di_cuda_matmul_a8): 0 not checked yet, 1 checked
    // against the SIMT path on its first call, -1 off (mismatch or no cuBLASLt algorithm); calls
    // that took it.
    int fp8_tc;
    int64_t n_fp8_tc_calls;
    // What those calls reuse (gemm_lt.cu): the cuBLASLt-layout scales of every uploaded FP8 weight
    // (made once at upload) and the cuBLASLt algorithm of each shape; calls that found both.
    di_cuda_lt_cache *lt_cache; // owned
    int64_t n_fp8_tc_cached;
    // attn_kv's tensor-core path in the official recipe (attn.cuh di_cuda_attn_kv_dispatch): 0 not
    // checked yet, 1 checked against the exact SIMT kernel on its first call, -1 off (mismatch, a
    // device without the shared memory, or DI_CUDA_ATTN_TC=0 at create); calls that took it. The
    // check passes when max |TC - SIMT| <= attn_tc_check_tol * max |SIMT| (0.1: a gross-error
    // detector; the kernel's element bound is test_cuda_attn's; a test sets it negative to force
    // the mismatch path).
    int attn_tc;
    int64_t n_attn_tc_calls;
    float attn_tc_check_tol;
    // attn_codes' tensor-core path (attn.cuh di_cuda_attn_codes_dispatch), checked the same way
    // (the same helper, tolerance and DI_CUDA_ATTN_TC switch) against the exact FP32 kernel.
    int attn_codes_tc;
    int64_t n_attn_codes_tc_calls;
    // The wgmma kernels of both (attn.cuh di_cuda_attn_wg, di_cuda_attn_codes_wg: cc 9.0 with
    // sm_90a code), tried before the mma.sync ones and checked the same way, each with its own
    // state (as attn_tc; -1 also for DI_CUDA_ATTN_WG=0 at create) and count; once off, the mma.sync
    // kernel (and its own check) serves the op.
    int attn_wg, attn_codes_wg;
    int64_t n_attn_wg_calls, n_attn_codes_wg_calls;
    // The routed experts' tensor-core grouped GEMM (moe_tc.cuh di_cuda_moe_grouped_a8): 0 not
    // checked yet, 1 checked against the SIMT kernel on its first call, -1 off (mismatch, or
    // DI_CUDA_MOE_TC=0); calls that took it. moe_tc_fault (tests only, false in the engine): the
    // first call's tensor-core result is corrupted before the check compares it (the off path).
    int moe_tc;
    int64_t n_moe_tc_calls;
    bool moe_tc_fault;
    // Peer access (di_cuda_peer_copy): bit j set when this context's device reaches device j's
    // memory directly (cudaDeviceCanAccessPeer, then cudaDeviceEnablePeerAccess at create; devices
    // 0..63); the event that orders a peer copy between this stream and the other's.
    uint64_t peer_mask;
    void *peer_event; // owned cudaEvent_t (timing disabled)
    // Device-side error flags (common.cuh DI_CUDA_FLAG_*): mapped page-locked host memory the
    // kernels or their bits into (flags_dev: its device address), read and cleared by di_cuda_sync
    // and di_cuda_download after their stream synchronisation (no copy: zero-copy memory).
    int *flags_host; // owned (cudaHostAlloc, mapped)
    int *flags_dev;
} di_cuda;

// Number of CUDA devices usable by this process (0 when there is no driver or device). Any thread.
int di_cuda_device_count(void);

// Whether a CUDA error (a cudaError_t's value) is sticky: it poisons the context, every later call
// fails (di_cuda_error then returns DI_ERR_DEVICE_LOST and marks the device lost): illegal address
// or instruction, launch failure or timeout, misaligned address, hardware stack error, device-side
// assert, uncorrectable ECC or NVLink error, an exception contained by the GPU, a tensor-memory
// leak, a terminated MPS client, a destroyed context. A pure function: any thread, no device.
bool di_cuda_error_is_sticky(int code);
// Device loss (backend.h DI_ERR_DEVICE_LOST): whether a sticky error was seen on `device` since it
// was last reset (the backend's entries then refuse at once with DI_ERR_DEVICE_LOST). Any thread.
bool di_cuda_lost(int device);
// cudaDeviceReset on `device` (every context, stream, allocation and graph of this process there
// is gone: destroy the backends on it first) and clears its lost mark. DI_ERR_INVALID (no such
// device), DI_ERR_CUDA (logged).
di_status di_cuda_device_reset(int device);

// Creates a context on `device`: its stream and cuBLASLt handle. DI_ERR_UNSUPPORTED when there is
// no such device, DI_ERR_CUDA, DI_ERR_NOMEM. Free with di_cuda_destroy.
di_status di_cuda_create(int device, di_cuda **out);
// Synchronises, then frees every pool block, weight, the handle and the stream. NULL: no-op.
void di_cuda_destroy(di_cuda *cu);
// "NVIDIA H200 (sm_90, 132 SMs, 139.8 GiB)" into buf.
void di_cuda_describe(const di_cuda *cu, char *buf, size_t cap);

// ---- memory ----

// Device memory of at least `bytes` (256-byte aligned) from the caching pool. Stream-ordered: it
// may be used by work enqueued after this call. DI_ERR_CUDA (out of memory), DI_ERR_NOMEM.
di_status di_cuda_alloc(di_cuda *cu, size_t bytes, void **out);
// Returns a block to the pool (work already enqueued on the stream may still use it: the pool
// only hands it out again for later work on the same stream). NULL: no-op.
void di_cuda_free(di_cuda *cu, void *p);
// Host <-> device copies on the stream. Upload and download synchronise the stream before they
// return (host memory is pageable; the caller may reuse or read it at once). DI_ERR_CUDA.
di_status di_cuda_upload(di_cuda *cu, void *dst, const void *src, size_t bytes);
di_status di_cuda_download(di_cuda *cu, void *dst, const void *src, size_t bytes);
di_status di_cuda_memset(di_cuda *cu, void *dst, int value, size_t bytes);
di_status di_cuda_copy_d2d(di_cuda *cu, void *dst, const void *src, size_t bytes);
// Whether di_cuda_peer_copy copies from src's memory into dst's directly: the same device, or two
// devices with peer access enabled both ways (peer_mask).
bool di_cuda_can_peer(const di_cuda *dst, const di_cuda *src);
// dst's d <- src's s (bytes): on dst's stream after an event recorded on src's stream (everything
// enqueued there before), cudaMemcpyPeerAsync (a plain device copy on one device), then an event
// src's stream waits on (so src's later work cannot overwrite s before it is read). Asynchronous.
// Leaves dst's device current. DI_ERR_CUDA (logged); the caller checked di_cuda_can_peer.
di_status di_cuda_peer_copy(di_cuda *dst, void *d, di_cuda *src, const void *s, size_t bytes);
// Waits for the stream; turns an asynchronous kernel fault into DI_ERR_CUDA (logged), and a
// device-side error flag a kernel raised since the last sync (cu->flags_host: device data outside
// a kernel's contract, e.g. attention's n_keys[t] > max_keys, clamped) into DI_ERR_INVALID
// (logged, cleared). The named sync points of the engine (end of step, logits readback) call this.
di_status di_cuda_sync(di_cuda *cu);
// Status of the last launch (cudaGetLastError), logged with `what` when it failed.
di_status di_cuda_check_launch(const char *what);

// ---- weights ----

// Copies a host weight matrix (mapped checkpoint view) to the device once: *dev gets the same
// kind, shape and strides with device data and scale pointers (the scale rows covering the view
// only; row0 becomes row0 mod block_out). The memory belongs to cu (freed at destroy).
// DI_ERR_CUDA, DI_ERR_NOMEM.
di_status di_cuda_tensor_upload(di_cuda *cu, const di_tensor *host, di_tensor *dev);

// ---- CUDA graphs (decode steps) ----

typedef struct di_cuda_graph di_cuda_graph;
// Starts capturing everything enqueued on cu->stream (no launch runs until the graph is
// launched). Launchers must not synchronise while capturing (no upload/download/sync). Pool
// blocks taken inside a capture (a launcher's scratch) stay bound to the graph's kernels for
// good: the pool hands them out again only inside captures (whose graphs run in stream order
// with each other), never outside one, where a caller may keep a block across replays.
// DI_ERR_CUDA.
di_status di_cuda_graph_begin(di_cuda *cu);
// Ends the capture and instantiates the graph (*out, free with di_cuda_graph_destroy).
di_status di_cuda_graph_end(di_cuda *cu, di_cuda_graph **out);
di_status di_cuda_graph_launch(di_cuda *cu, const di_cuda_graph *g);
void di_cuda_graph_destroy(di_cuda_graph *g);

// ---- op dispatch ----

typedef enum di_cuda_op {
    DI_CUDA_OP_MATMUL = 0, // gemm.cuh: any weight kind, FP32 activations
    DI_CUDA_OP_RMSNORM,    // norm.cuh
    DI_CUDA_OP_ROPE,       // rope.cuh
    DI_CUDA_OP_SOFTMAX,    // norm.cuh (sampling-side softmax)
    DI_CUDA_OP_SWIGLU,     // moe.cuh
    DI_CUDA_OP_MHC,        // mhc.cuh: hc_pre (Sinkhorn) and hc_post
    DI_CUDA_OP_ROUTER,     // moe.cuh: sqrtsoftplus + bias top-k, or hash
    DI_CUDA_OP_MOE,        // moe.cuh: grouped routed experts
    DI_CUDA_OP_KV_QUANT,   // attn.cuh: FP32 row -> 584-byte FP8 KV row
    DI_CUDA_OP_ATTN,       // attn.cuh: window + compressed keys with the sink
    DI_CUDA_OP_COMPRESS,   // attn.cuh: compressor window pooling
    DI_CUDA_OP_INDEXER,    // indexer.cuh: scores + top-k
    DI_CUDA_OP_COUNT
} di_cuda_op;

const char *di_cuda_op_name(di_cuda_op op);
// Whether this build and device run `op` on the GPU for weights of kind `w` (w may be NULL for
// ops without weights). An unsupported op runs on the CPU (di_cuda_matmul_or_cpu) with one WARN.
bool di_cuda_supports_op(const di_cuda *cu, di_cuda_op op, const di_tensor *w);

#ifdef __cplusplus
}
#endif
