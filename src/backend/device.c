// device — opens the model's matmul accelerator for a di_device (device.h).
#include "backend/device.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/log.h"

#ifdef DI_HAVE_CUDA
#include "backend/cuda/offload.cuh"
#endif

di_status di_device_check(const di_device *d) {
    if (d->kind == DI_DEVICE_CPU && d->n_more != 0) {
        DI_LOG_ERROR("a device list is for CUDA devices (cuda:0,1,...)");
        return DI_ERR_INVALID;
    }
    if (d->kind == DI_DEVICE_CPU) return DI_OK;
    if (d->kind != DI_DEVICE_CUDA) {
        DI_LOG_ERROR("unknown device kind %d", (int)d->kind);
        return DI_ERR_INVALID;
    }
    if (d->index < 0) {
        DI_LOG_ERROR("CUDA device index %d: must be >= 0", (int)d->index);
        return DI_ERR_INVALID;
    }
    if (d->n_more < 0 || d->n_more > DI_DEVICE_MAX_MORE) {
        DI_LOG_ERROR("a list of %d CUDA devices: 1 to %d", (int)d->n_more + 1,
                     DI_DEVICE_MAX_MORE + 1);
        return DI_ERR_INVALID;
    }
    for (int32_t i = 0; i < d->n_more; i++) {
        if (d->more[i] < 0) {
            DI_LOG_ERROR("CUDA device index %d (list entry %d): must be >= 0", (int)d->more[i],
                         (int)i + 1);
            return DI_ERR_INVALID;
        }
    }
#ifdef DI_HAVE_CUDA
    return DI_OK;
#else
    DI_LOG_ERROR("this build has no CUDA backend: configure with -DDI_CUDA=ON");
    return DI_ERR_UNSUPPORTED;
#endif
}

#ifdef DI_HAVE_CUDA
typedef struct cuda_accel {
    di_cuda *cu;          // owned
    di_cuda_offload *off; // owned
} cuda_accel;

static void cuda_close(void *user) {
    cuda_accel *a = user;
    di_cuda_offload_destroy(a->off); // before its context
    di_cuda_destroy(a->cu);
    free(a);
}

static void cuda_stats(const void *user, di_device_stats *out) {
    const cuda_accel *a = user;
    di_cuda_offload_stats s;
    di_cuda_offload_get_stats(a->off, &s);
    out->n_matmuls = s.n_calls;
    out->n_declined = s.n_declined;
    out->n_weights = s.n_weights;
    out->weight_bytes = (int64_t)s.weight_bytes;
}

static di_status cuda_open(int32_t index, di_accel *out) {
    cuda_accel *a = calloc(1, sizeof *a);
    if (!a) return DI_ERR_NOMEM;
    di_status st = di_cuda_create(index, &a->cu);
    if (st == DI_OK) st = di_cuda_offload_create(a->cu, &a->off);
    if (st != DI_OK) {
        DI_LOG_ERROR("cannot use CUDA device %d: %s", (int)index, di_status_str(st));
        di_cuda_destroy(a->cu);
        free(a);
        return st;
    }
    char desc[200];
    di_cuda_describe(a->cu, desc, sizeof desc);
    snprintf(out->name, sizeof out->name, "cuda:%d", (int)index);
    snprintf(out->desc, sizeof out->desc, "%s, %s", out->name, desc);
    out->matmul = di_cuda_offload_matmul;
    out->user = a;
    out->close = cuda_close;
    out->get_stats = cuda_stats;
    return DI_OK;
}
#endif

di_status di_accel_open(const di_device *dev, di_accel *out) {
    memset(out, 0, sizeof *out);
    di_status st = di_device_check(dev); // refuses CUDA in a build without it
#ifdef DI_HAVE_CUDA
    if (st == DI_OK && dev->kind == DI_DEVICE_CUDA) st = cuda_open(dev->index, out);
#endif
    return st;
}

void di_accel_close(di_accel *a) {
    if (a->close) a->close(a->user);
    memset(a, 0, sizeof *a);
}

void di_accel_get_stats(const di_accel *a, di_device_stats *out) {
    memset(out, 0, sizeof *out);
    if (a->get_stats) a->get_stats(a->user, out);
}
