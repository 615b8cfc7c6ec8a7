/*
 * offload — runs the model's matmuls on the GPU while the rest of the forward stays on the CPU:
 * the first step of wiring src/model to the CUDA backend. di_cuda_offload_matmul has the model's
 * accelerator-hook signature (model/dsv4.h di_dsv4_matmul_fn): it uploads each weight the first
 * time it sees it (keyed by its data pointer and view; weights are uploaded once), copies the
 * activations up, runs di_cuda_matmul and copies the result back into the strided rows of y.
 * Every call synchronises (the CPU needs y at once): a correctness path for whole-model tests
 * (tiny fixture logits vs the CPU), not the speed path.
 *
 * Owns: the weight table and staging buffers (device copies of weights belong to the di_cuda).
 * Thread-safety: one thread at a time, any thread (each call makes cu's device current on the
 * calling thread): the thread running the model's forward (the engine's forward thread).
 */
#pragma once

#include <stdbool.h>

#include "backend/cuda/cuda_backend.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct di_cuda_offload di_cuda_offload;

// cu is borrowed and must outlive the offload. DI_ERR_NOMEM.
di_status di_cuda_offload_create(di_cuda *cu, di_cuda_offload **out);
void di_cuda_offload_destroy(di_cuda_offload *o);

// The hook (user = the di_cuda_offload). Returns false, leaving y to the CPU, when the backend
// does not support w or a CUDA call failed (logged; the failure count is kept).
bool di_cuda_offload_matmul(void *user, const di_tensor *w, const float *x, int64_t n_tok,
                            int64_t x_stride, float *y, int64_t y_stride);

typedef struct di_cuda_offload_stats {
    int64_t n_calls;    // matmuls run on the GPU
    int64_t n_declined; // unsupported or failed: left to the CPU
    int64_t n_weights;  // distinct weights uploaded
    size_t weight_bytes;
} di_cuda_offload_stats;

void di_cuda_offload_get_stats(const di_cuda_offload *o, di_cuda_offload_stats *out);

#ifdef __cplusplus
}
#endif
