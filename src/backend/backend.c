// backend — opens the backend of a di_device (backend.h): the CPU twin always, CUDA when the build
// has it (this file is compiled with DI_HAVE_CUDA when DI_CUDA=ON, as device.c).
#include "backend/backend.h"

#include "base/log.h"

di_status di_backend_open(const di_device *dev, int n_threads, di_backend **out) {
    if (!dev || dev->kind == DI_DEVICE_CPU) return di_cpu_backend_create(n_threads, out);
    if (dev->kind != DI_DEVICE_CUDA) {
        DI_LOG_ERROR("backend: unknown device kind %d", (int)dev->kind);
        return DI_ERR_INVALID;
    }
    if (dev->index < 0) {
        DI_LOG_ERROR("backend: CUDA device index %d: must be >= 0", (int)dev->index);
        return DI_ERR_INVALID;
    }
#ifdef DI_HAVE_CUDA
    return di_cuda_backend_create(dev->index, out);
#else
    DI_LOG_ERROR("backend: this build has no CUDA backend: configure with -DDI_CUDA=ON");
    return DI_ERR_UNSUPPORTED;
#endif
}

di_status di_backend_reset_device(const di_device *dev) {
    if (!dev || dev->kind == DI_DEVICE_CPU) return DI_OK; // a CPU backend is never really lost
#ifdef DI_HAVE_CUDA
    return di_cuda_device_reset(dev->index);
#else
    DI_LOG_ERROR("backend: this build has no CUDA backend to reset");
    return DI_ERR_UNSUPPORTED;
#endif
}

void di_backend_destroy(di_backend *b) {
    if (!b) return;
    b->vt->destroy(b);
}

di_status di_backend_mem_info(di_backend *b, size_t *free_bytes, size_t *total_bytes) {
    if (!b->vt->mem_info) return DI_ERR_UNSUPPORTED;
    return b->vt->mem_info(b, free_bytes, total_bytes);
}

bool di_backend_can_peer(const di_backend *b, const di_backend *src_b) {
    return b->vt == src_b->vt && b->vt->can_peer && b->vt->can_peer(b, src_b);
}

di_status di_backend_hand_over(di_backend *b, void *dst, di_backend *src_b, const void *src,
                               size_t bytes, void *bounce, bool *peer) {
    if (di_backend_can_peer(b, src_b)) {
        *peer = true;
        return bytes ? b->vt->peer_copy(b, dst, src_b, src, bytes) : DI_OK;
    }
    DI_ASSERT(bounce); // the caller allocates one wherever a pair of its backends cannot peer
    *peer = false;
    di_status st = src_b->vt->download(src_b, bounce, src, bytes); // waits for src_b's work
    return st == DI_OK ? b->vt->upload(b, dst, bounce, bytes) : st;
}
