// cuda_backend — device context, the caching memory pool, weight upload, CUDA graphs and the op
// dispatch table (cuda_backend.h).
#include <cublasLt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend/cuda/common.cuh"
#include "backend/cuda/gemm.cuh" // di_cuda_lt_*

// ---- errors: the sticky ones lose the device ----

// Devices whose context a sticky error poisoned (set by di_cuda_error, cleared by
// di_cuda_device_reset). Process-wide: a sticky error poisons the device's (primary) context for
// every backend on it.
enum { DI_CUDA_MAX_DEVICES = 64 };
static bool g_lost[DI_CUDA_MAX_DEVICES];

// The errors after which every later call in the process fails the same way (driver_types.h: "the
// process must be terminated and relaunched", or an uncorrectable hardware error).
static bool is_sticky(cudaError_t e) {
    switch (e) {
    case cudaErrorIllegalAddress:
    case cudaErrorLaunchFailure:
    case cudaErrorLaunchTimeout:
    case cudaErrorECCUncorrectable:
    case cudaErrorIllegalInstruction:
    case cudaErrorMisalignedAddress:
    case cudaErrorInvalidAddressSpace:
    case cudaErrorInvalidPc:
    case cudaErrorHardwareStackError:
    case cudaErrorAssert:
    case cudaErrorContextIsDestroyed:
    case cudaErrorExternalDevice:
    case cudaErrorContained:        // an exception contained by the GPU (peer memory over NVLink)
    case cudaErrorTensorMemoryLeak: // a kernel left tensor memory allocated (sm_100)
    case cudaErrorNvlinkUncorrectable: // as cudaErrorECCUncorrectable
    case cudaErrorMpsClientTerminated:
        return true;
    default:
        return false;
    }
}

extern "C" bool di_cuda_error_is_sticky(int code) {
    return code != 0 && is_sticky((cudaError_t)code);
}

extern "C" di_status di_cuda_error(cudaError_t e) {
    if (e == cudaSuccess) return DI_OK;
    if (!is_sticky(e)) return DI_ERR_CUDA;
    int dev = -1;
    if (cudaGetDevice(&dev) == cudaSuccess && dev >= 0 && dev < DI_CUDA_MAX_DEVICES &&
        !__atomic_exchange_n(&g_lost[dev], true, __ATOMIC_SEQ_CST))
        DI_CUDA_LOG_ERROR("CUDA device %d lost: %s (%s) is sticky; every call on it is refused "
                          "until it is reset",
                          dev, cudaGetErrorString(e), cudaGetErrorName(e));
    return DI_ERR_DEVICE_LOST;
}

extern "C" bool di_cuda_lost(int device) {
    return device >= 0 && device < DI_CUDA_MAX_DEVICES &&
           __atomic_load_n(&g_lost[device], __ATOMIC_SEQ_CST);
}

extern "C" di_status di_cuda_device_reset(int device) {
    if (device < 0 || device >= di_cuda_device_count()) {
        DI_CUDA_LOG_ERROR("cudaDeviceReset: no CUDA device %d", device);
        return DI_ERR_INVALID;
    }
    cudaError_t e = cudaSetDevice(device);
    if (e == cudaSuccess) e = cudaDeviceReset();
    if (e != cudaSuccess) {
        DI_CUDA_LOG_ERROR("cudaDeviceReset on device %d: %s (%s)", device, cudaGetErrorString(e),
                          cudaGetErrorName(e));
        return DI_ERR_CUDA;
    }
    (void)cudaGetLastError();
    if (device < DI_CUDA_MAX_DEVICES) __atomic_store_n(&g_lost[device], false, __ATOMIC_SEQ_CST);
    DI_CUDA_LOG_WARN("CUDA device %d reset", device);
    return DI_OK;
}

// ---- context ----

extern "C" int di_cuda_device_count(void) {
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess) {
        (void)cudaGetLastError(); // no driver / no device is not an error here
        return 0;
    }
    return n;
}

extern "C" di_status di_cuda_create(int device, di_cuda **out) {
    di_status st = DI_OK;
    int n = di_cuda_device_count();
    if (device < 0 || device >= n) {
        DI_CUDA_LOG_ERROR("CUDA device %d requested, %d present", device, n);
        return DI_ERR_UNSUPPORTED;
    }
    di_cuda *cu = (di_cuda *)calloc(1, sizeof *cu);
    if (!cu) return DI_ERR_NOMEM;
    cu->device = device;
    cudaDeviceProp p;
    cudaStream_t s = NULL;
    cublasLtHandle_t lt = NULL;
    int mem_clock_khz = 0, bus_bits = 0;
    CUDA_TRY(cudaSetDevice(device));
    CUDA_TRY(cudaGetDeviceProperties(&p, device));
    cu->cc_major = p.major;
    cu->cc_minor = p.minor;
    cu->n_sm = p.multiProcessorCount;
    cu->smem_optin = p.sharedMemPerBlockOptin;
    {
        const char *e = getenv("DI_CUDA_ATTN_TC"); // the debug switch: 0 keeps the SIMT kernel
        cu->attn_tc = e && !strcmp(e, "0") ? -1 : 0;
        cu->attn_codes_tc = cu->attn_tc;
        const char *w = getenv("DI_CUDA_ATTN_WG"); // 0: skip the wgmma kernels (mma.sync first)
        cu->attn_wg = cu->attn_tc < 0 || (w && !strcmp(w, "0")) ? -1 : 0;
        cu->attn_codes_wg = cu->attn_wg;
        cu->attn_tc_check_tol = 0.1f;
    }
    cu->l2_bytes = (size_t)p.l2CacheSize;
    // Informational only (the benchmarks measure the real ceiling): a driver that no longer reports
    // the memory clock leaves it 0 instead of failing the context.
    if (cudaDeviceGetAttribute(&mem_clock_khz, cudaDevAttrMemoryClockRate, device) != cudaSuccess ||
        cudaDeviceGetAttribute(&bus_bits, cudaDevAttrGlobalMemoryBusWidth, device) != cudaSuccess) {
        (void)cudaGetLastError();
        mem_clock_khz = bus_bits = 0;
    }
    // DDR: two transfers per clock.
    cu->hbm_peak_gbs = 2.0 * mem_clock_khz * 1e3 * (bus_bits / 8.0) / 1e9;
    CUDA_TRY(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    cu->stream = s;
    {
        cudaEvent_t ev = NULL;
        CUDA_TRY(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming));
        cu->peer_event = ev;
    }
    {
        void *fh = NULL, *fd = NULL;
        CUDA_TRY(cudaHostAlloc(&fh, sizeof(int), cudaHostAllocMapped | cudaHostAllocPortable));
        cu->flags_host = (int *)fh;
        *cu->flags_host = 0;
        CUDA_TRY(cudaHostGetDevicePointer(&fd, fh, 0));
        cu->flags_dev = (int *)fd;
    }
    // Peer access to every other device that allows it (the pipeline stages' hand-over,
    // di_cuda_peer_copy). Enabled per context pair: a second backend on this device finds it
    // enabled already; a device without it (no NVLink / P2P over PCIe) is left to the host bounce.
    for (int j = 0; j < n && j < 64; j++) {
        int can = 0;
        if (j == device) continue;
        if (cudaDeviceCanAccessPeer(&can, device, j) != cudaSuccess || !can) {
            (void)cudaGetLastError();
            continue;
        }
        const cudaError_t e = cudaDeviceEnablePeerAccess(j, 0);
        if (e == cudaSuccess || e == cudaErrorPeerAccessAlreadyEnabled) {
            cu->peer_mask |= (uint64_t)1 << j;
        } else {
            DI_CUDA_LOG_WARN("CUDA device %d: peer access to device %d refused (%s): hand-overs "
                             "between them go through the host",
                             device, j, cudaGetErrorString(e));
        }
        (void)cudaGetLastError(); // AlreadyEnabled and a refusal are not sticky: clear them
    }
    if (cublasLtCreate(&lt) != CUBLAS_STATUS_SUCCESS) {
        DI_CUDA_LOG_ERROR("cublasLtCreate failed");
        st = DI_ERR_CUDA;
        goto fail;
    }
    cu->cublaslt = lt;
    DI_TRY(di_cuda_lt_cache_create(cu));
    *out = cu;
    return DI_OK;
fail:
    // A failed call (an allocation: cudaHostAlloc, cudaStreamCreate) leaves its error as the
    // thread's last one, which a later launch check would report as its own: cleared (a sticky
    // one has lost the device anyway).
    if (st != DI_ERR_DEVICE_LOST) (void)cudaGetLastError();
    di_cuda_destroy(cu);
    return st;
}

struct di_cuda_pool_block {
    void *ptr;
    size_t bytes;
    bool in_use;
    bool graph; // taken inside a capture: bound to graphs, reused only inside captures
    di_cuda_pool_block *next;
};

extern "C" void di_cuda_destroy(di_cuda *cu) {
    if (!cu) return;
    (void)cudaSetDevice(cu->device); // any thread may destroy it
    if (cu->stream) (void)cudaStreamSynchronize(di_stream(cu));
    for (di_cuda_pool_block *b = cu->blocks, *nx; b; b = nx) {
        nx = b->next;
        (void)cudaFree(b->ptr);
        free(b);
    }
    for (int64_t i = 0; i < cu->n_weights; i++) (void)cudaFree(cu->weights[i]);
    free(cu->weights);
    di_cuda_lt_cache_free(cu);
    if (cu->cublaslt) cublasLtDestroy((cublasLtHandle_t)cu->cublaslt);
    if (cu->peer_event) (void)cudaEventDestroy((cudaEvent_t)cu->peer_event);
    if (cu->flags_host) (void)cudaFreeHost(cu->flags_host);
    if (cu->stream) (void)cudaStreamDestroy(di_stream(cu));
    free(cu);
}

extern "C" void di_cuda_describe(const di_cuda *cu, char *buf, size_t cap) {
    cudaDeviceProp p;
    if (cudaGetDeviceProperties(&p, cu->device) != cudaSuccess) {
        snprintf(buf, cap, "CUDA device %d (properties unavailable)", cu->device);
        return;
    }
    snprintf(buf, cap, "%s (sm_%d%d, %d SMs, %.1f GiB, L2 %.0f MiB, HBM peak %.0f GB/s)", p.name,
             p.major, p.minor, p.multiProcessorCount, p.totalGlobalMem / 1073741824.0,
             cu->l2_bytes / 1048576.0, cu->hbm_peak_gbs);
}

// ---- memory ----

// Small requests round to 256 bytes, larger ones to 2 MiB, so freed blocks match later requests.
static size_t pool_round(size_t bytes) {
    if (bytes == 0) bytes = 1;
    if (bytes <= ((size_t)1 << 20)) return (bytes + 255) & ~(size_t)255;
    const size_t big = (size_t)2 << 20;
    return (bytes + big - 1) / big * big;
}

// cudaMalloc, its failure reported here: a failed allocation also leaves its error as the
// thread's last error, which the next launch check (cudaGetLastError) would report as a launch
// failure of an unrelated kernel. Cleared, unless sticky (then the device is lost anyway).
static di_status device_malloc(di_cuda *cu, void **p, size_t bytes, const char *what) {
    const cudaError_t e = cudaMalloc(p, bytes);
    if (e == cudaSuccess) return DI_OK;
    DI_CUDA_LOG_ERROR("cudaMalloc(%zu bytes, %s; pool holds %zu, weights %zu): %s", bytes, what,
                      cu->pool_bytes, cu->weight_bytes, cudaGetErrorString(e));
    const di_status st = di_cuda_error(e);
    if (st != DI_ERR_DEVICE_LOST) (void)cudaGetLastError();
    *p = NULL;
    return st;
}

extern "C" di_status di_cuda_alloc(di_cuda *cu, size_t bytes, void **out) {
    const size_t want = pool_round(bytes);
    for (di_cuda_pool_block *b = cu->blocks; b; b = b->next) {
        // A graph's scratch is rewritten by every replay: never handed out outside a capture
        // (the caller might keep it across replays). Inside a capture only graph blocks are
        // reused, so no block that a caller outside may take later gets bound to a graph.
        if (!b->in_use && b->bytes == want && b->graph == cu->capturing) {
            b->in_use = true;
            *out = b->ptr;
            return DI_OK;
        }
    }
    di_cuda_pool_block *b = (di_cuda_pool_block *)calloc(1, sizeof *b);
    if (!b) return DI_ERR_NOMEM;
    const di_status st = device_malloc(cu, &b->ptr, want, "pool");
    if (st != DI_OK) {
        free(b);
        return st;
    }
    b->bytes = want;
    b->in_use = true;
    b->graph = cu->capturing; // relaxed capture mode allows cudaMalloc
    b->next = cu->blocks;
    cu->blocks = b;
    cu->pool_bytes += want;
    *out = b->ptr;
    return DI_OK;
}

extern "C" void di_cuda_free(di_cuda *cu, void *p) {
    if (!p) return;
    for (di_cuda_pool_block *b = cu->blocks; b; b = b->next) {
        if (b->ptr == p) {
            b->in_use = false;
            return;
        }
    }
    DI_CUDA_LOG_ERROR("di_cuda_free: %p is not a pool block", p);
}

extern "C" di_status di_cuda_upload(di_cuda *cu, void *dst, const void *src, size_t bytes) {
    CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, di_stream(cu)));
    // Sync: the host buffer is pageable and the caller may reuse it at once.
    CUDA_CHECK(cudaStreamSynchronize(di_stream(cu)));
    return DI_OK;
}

// After a stream synchronisation: the device-side error flags the kernels raised since the last
// check (common.cuh DI_CUDA_FLAG_*), logged and cleared.
static di_status check_flags(di_cuda *cu) {
    volatile int *f = cu->flags_host;
    const int bits = f ? *f : 0;
    if (!bits) return DI_OK;
    *f = 0;
    if (bits & DI_CUDA_FLAG_ATTN_KEYS)
        DI_CUDA_LOG_ERROR("attention on device %d: a row's key count (n_keys, device data) was "
                          "negative or beyond the call's max_keys; clamped, the output is not the "
                          "op's",
                          cu->device);
    return DI_ERR_INVALID;
}

extern "C" di_status di_cuda_download(di_cuda *cu, void *dst, const void *src, size_t bytes) {
    CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, di_stream(cu)));
    // Sync: the caller reads the host buffer at once.
    CUDA_CHECK(cudaStreamSynchronize(di_stream(cu)));
    return check_flags(cu);
}

extern "C" di_status di_cuda_memset(di_cuda *cu, void *dst, int value, size_t bytes) {
    CUDA_CHECK(cudaMemsetAsync(dst, value, bytes, di_stream(cu)));
    return DI_OK;
}

extern "C" di_status di_cuda_copy_d2d(di_cuda *cu, void *dst, const void *src, size_t bytes) {
    CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, di_stream(cu)));
    return DI_OK;
}

extern "C" bool di_cuda_can_peer(const di_cuda *dst, const di_cuda *src) {
    if (dst->device == src->device) return true;
    if (dst->device >= 64 || src->device >= 64) return false;
    return (dst->peer_mask >> src->device & 1) && (src->peer_mask >> dst->device & 1);
}

extern "C" di_status di_cuda_peer_copy(di_cuda *dst, void *d, di_cuda *src, const void *s,
                                       size_t bytes) {
    cudaEvent_t ev_src = (cudaEvent_t)src->peer_event, ev_dst = (cudaEvent_t)dst->peer_event;
    // The copy after src's work (an event is recorded on its own device's stream), ...
    CUDA_CHECK(cudaSetDevice(src->device));
    CUDA_CHECK(cudaEventRecord(ev_src, di_stream(src)));
    CUDA_CHECK(cudaSetDevice(dst->device));
    CUDA_CHECK(cudaStreamWaitEvent(di_stream(dst), ev_src, 0));
    if (dst->device == src->device)
        CUDA_CHECK(cudaMemcpyAsync(d, s, bytes, cudaMemcpyDeviceToDevice, di_stream(dst)));
    else
        CUDA_CHECK(cudaMemcpyPeerAsync(d, dst->device, s, src->device, bytes, di_stream(dst)));
    // ... and src's later work after the copy.
    CUDA_CHECK(cudaEventRecord(ev_dst, di_stream(dst)));
    CUDA_CHECK(cudaSetDevice(src->device));
    CUDA_CHECK(cudaStreamWaitEvent(di_stream(src), ev_dst, 0));
    CUDA_CHECK(cudaSetDevice(dst->device));
    return DI_OK;
}

extern "C" di_status di_cuda_sync(di_cuda *cu) {
    CUDA_CHECK(cudaStreamSynchronize(di_stream(cu)));
    CUDA_CHECK(cudaGetLastError());
    return check_flags(cu);
}

extern "C" di_status di_cuda_check_launch(const char *what) {
    cudaError_t e = cudaGetLastError();
    if (e != cudaSuccess) {
        DI_CUDA_LOG_ERROR("launch of %s failed: %s (%s)", what, cudaGetErrorString(e),
                          cudaGetErrorName(e));
        return di_cuda_error(e);
    }
    return DI_OK;
}

// ---- weights ----

static di_status weight_alloc(di_cuda *cu, size_t bytes, void **out) {
    if (cu->n_weights == cu->cap_weights) {
        int64_t cap = cu->cap_weights ? 2 * cu->cap_weights : 256;
        void **w = (void **)realloc(cu->weights, sizeof(void *) * (size_t)cap);
        if (!w) return DI_ERR_NOMEM;
        cu->weights = w;
        cu->cap_weights = cap;
    }
    const di_status st = device_malloc(cu, out, bytes ? bytes : 1, "weight");
    if (st != DI_OK) return st;
    cu->weights[cu->n_weights++] = *out;
    cu->weight_bytes += bytes;
    return DI_OK;
}

extern "C" di_status di_cuda_tensor_upload(di_cuda *cu, const di_tensor *host, di_tensor *dev) {
    di_status st;
    di_tensor d = *host;
    const size_t data_bytes = host->nb1 * (size_t)host->ne[1];
    void *p = NULL;
    if ((st = weight_alloc(cu, data_bytes, &p)) != DI_OK) return st;
    if ((st = di_cuda_upload(cu, p, host->data, data_bytes)) != DI_OK) return st;
    d.data = p;
    if (host->scale) {
        // Scale rows covering rows [row0, row0 + ne1) of the scale grid.
        const int64_t s0 = host->row0 / host->block_out;
        const int64_t s1 = (host->row0 + host->ne[1] + host->block_out - 1) / host->block_out;
        const size_t scale_bytes = host->scale_nb1 * (size_t)(s1 - s0);
        void *sp = NULL;
        if ((st = weight_alloc(cu, scale_bytes, &sp)) != DI_OK) return st;
        st = di_cuda_upload(cu, sp, host->scale + (size_t)s0 * host->scale_nb1, scale_bytes);
        if (st != DI_OK) return st;
        d.scale = (const uint8_t *)sp;
        d.row0 = host->row0 - s0 * host->block_out;
    }
    if ((st = di_cuda_lt_weight_uploaded(cu, &d)) != DI_OK) return st;
    *dev = d;
    return DI_OK;
}

// ---- CUDA graphs ----

struct di_cuda_graph {
    cudaGraph_t graph;
    cudaGraphExec_t exec;
};

extern "C" di_status di_cuda_graph_begin(di_cuda *cu) {
    // Relaxed: a pool miss inside the capture may call cudaMalloc, which the stricter modes refuse
    // (the pool's blocks are reused in stream order, which the graph keeps as dependencies).
    CUDA_CHECK(cudaStreamBeginCapture(di_stream(cu), cudaStreamCaptureModeRelaxed));
    cu->capturing = true;
    cu->refused = false;
    return DI_OK;
}

extern "C" di_status di_cuda_graph_end(di_cuda *cu, di_cuda_graph **out) {
    di_status st = DI_OK;
    const bool refused = cu->refused;
    cu->capturing = false;
    cu->refused = false;
    di_cuda_graph *g = (di_cuda_graph *)calloc(1, sizeof *g);
    if (!g || refused) { // the capture is closed either way
        cudaGraph_t tmp = NULL;
        const cudaError_t e = cudaStreamEndCapture(di_stream(cu), &tmp);
        if (e == cudaSuccess && tmp) cudaGraphDestroy(tmp);
        // A capture invalidated by a failed launch inside it ends with an error: taken here (not
        // left for the next launch check to report as its own).
        if (e != cudaSuccess) (void)di_cuda_error_taken(e);
        free(g);
        return refused ? DI_ERR_INVALID : DI_ERR_NOMEM;
    }
    CUDA_TRY(cudaStreamEndCapture(di_stream(cu), &g->graph));
    CUDA_TRY(cudaGraphInstantiate(&g->exec, g->graph, 0));
    *out = g;
    return DI_OK;
fail:
    di_cuda_graph_destroy(g);
    return st;
}

extern "C" di_status di_cuda_graph_launch(di_cuda *cu, const di_cuda_graph *g) {
    CUDA_CHECK(cudaGraphLaunch(g->exec, di_stream(cu)));
    return DI_OK;
}

extern "C" void di_cuda_graph_destroy(di_cuda_graph *g) {
    if (!g) return;
    if (g->exec) cudaGraphExecDestroy(g->exec);
    if (g->graph) cudaGraphDestroy(g->graph);
    free(g);
}

// ---- op dispatch ----

static const char *const k_op_names[DI_CUDA_OP_COUNT] = {
    "matmul", "rmsnorm", "rope",     "softmax", "swiglu",   "mhc",
    "router", "moe",     "kv_quant", "attn",    "compress", "indexer",
};

extern "C" const char *di_cuda_op_name(di_cuda_op op) {
    return op >= 0 && op < DI_CUDA_OP_COUNT ? k_op_names[op] : "?";
}

extern "C" bool di_cuda_supports_op(const di_cuda *cu, di_cuda_op op, const di_tensor *w) {
    if (op < 0 || op >= DI_CUDA_OP_COUNT) return false;
    if (cu->disabled_ops & (1u << op)) return false;
    if (op == DI_CUDA_OP_MATMUL || op == DI_CUDA_OP_MOE) {
        if (!w) return false;
        switch (w->kind) {
        case DI_TENSOR_KIND_F32:
        case DI_TENSOR_KIND_F16:
        case DI_TENSOR_KIND_BF16:
            return true;
        case DI_TENSOR_KIND_FP8:
            return w->block_in > 0 && w->block_out > 0;
        case DI_TENSOR_KIND_FP4:
            // Packed pairs: an even row length (tensor/quant_ref.h).
            return w->block_in > 0 && w->block_out > 0 && w->ne[0] % 2 == 0;
        default: // the GGUF block kinds (Q8_0, Q4_K, ...): not on the GPU yet, the CPU runs them
            return false;
        }
    }
    return true;
}
