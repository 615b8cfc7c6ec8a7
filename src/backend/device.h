/*
 * device — the model's compute device (di_model_options.device): opens the accelerator that
 * di_model_load attaches to the model's matmul hook (model/dsv4.h di_dsv4_matmul), so src/model
 * never includes CUDA. DI_DEVICE_CUDA, in a build with DI_HAVE_CUDA (CMake -DDI_CUDA=ON): a
 * di_cuda context on the device and the offload of backend/cuda/offload.cuh (every matmul on the
 * GPU, synchronised; the rest of the forward stays on the CPU). Without DI_HAVE_CUDA it is refused
 * with DI_ERR_UNSUPPORTED.
 *
 * Owns: an open di_accel owns its user state (context, uploaded weights), freed by
 * di_accel_close. Thread-safety: one thread at a time (the one running the model's forward: the
 * caller of di_session_forward, or the engine's forward thread); open and close on any thread.
 */
#pragma once

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "deepinfer.h"
#include "tensor/tensor.h"

// The model's hook signature (model/dsv4.h di_dsv4_matmul_fn): true when y was computed.
typedef bool (*di_accel_matmul_fn)(void *user, const di_tensor *w, const float *x, int64_t n_tok,
                                   int64_t x_stride, float *y, int64_t y_stride);

typedef struct di_accel {
    di_accel_matmul_fn matmul; // NULL: nothing open (the CPU)
    void *user;                // owned; the hook's first argument
    void (*close)(void *user);
    void (*get_stats)(const void *user, di_device_stats *out);
    char name[16];  // "cuda:0"
    char desc[256]; // "cuda:0, NVIDIA H200 (sm_90, ...)"
} di_accel;

// Opens the accelerator of `dev` into *out (zeroed first). DI_DEVICE_CPU: nothing to open (DI_OK,
// out->matmul NULL). DI_DEVICE_CUDA: DI_ERR_UNSUPPORTED without CUDA in this build or without such
// a device, DI_ERR_CUDA, DI_ERR_NOMEM; DI_ERR_INVALID for a bad kind or index. Errors are logged.
di_status di_accel_open(const di_device *dev, di_accel *out);
// Frees what di_accel_open made and zeroes *a. A zeroed or closed di_accel: no-op.
void di_accel_close(di_accel *a);
// The device's work so far (zeroes when nothing is open).
void di_accel_get_stats(const di_accel *a, di_device_stats *out);
