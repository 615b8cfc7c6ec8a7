// cpu_backend — the backend vtable (backend.h) on host memory with the CPU kernels: the oracle twin
// of the CUDA backend. Every op repeats the arithmetic of the model's own CPU forward
// (model/dsv4.c, dsv4_attn.c, dsv4_moe.c, in the FP32 and the official recipe) on the same kernels
// (di_cpu_matmul, vec.h, ref_ops.h), in the same order, so the device-resident forward run here
// reproduces di_session_forward (tests/model/test_dev_forward.c). Memory is host memory: upload,
// download and copy are memcpy, sync does nothing, weights are used in place (weight_upload makes
// no copy).
//
// Graphs (the twin of CUDA graph capture): between graph_begin and graph_end every op, memset and
// copy is recorded as a command (the entry and all its arguments by value) instead of run, and
// graph_launch runs the commands again through the same entries. Like a CUDA graph, a replay reads
// the backend memory the pointers name as it is at launch, and uses the scalars and pointers of
// the capture; the calls a CUDA capture cannot hold (alloc, free, upload, download, sync,
// weight_upload) are refused and fail the capture. Shapes are checked when the graph runs.
//
// Deferred mode (di_cpu_backend_set_deferred, or DI_CPU_DEFERRED=1 at create; tests): the twin
// of the CUDA backend's asynchrony. Every op, memset, copy, free and graph_launch is queued as a
// command (the same records as a capture) instead of run, and the queue runs, in order, at the
// points where the CUDA backend's stream is synchronised: upload, download, sync,
// weight_upload, host_free (cudaFreeHost), peer_copy (both backends' queues, then the copy) and
// destroy. So host code that reads or writes backend memory without a download or upload, or
// hands an op host memory it rewrites or frees before the next sync, gets different bits (or an
// ASan report) on the CPU twin too, as it would on a GPU; free is queued because the CUDA pool
// reuses a block in stream order. A queued command's shape error surfaces at that flush point.
//
// Owns: its thread pool, di_cpu scratch (grown to the widest weight row uploaded or multiplied),
// the MoE and attention scratch (grown when a call needs more: the first calls of a shape only).
// Thread-safety: one thread at a time (backend.h).
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend/backend.h"
#include "backend/cpu/gemm.h"    // di_cpu_matmul
#include "backend/cpu/ref_ops.h" // di_ref_*, di_cpu
#include "backend/cpu/vec.h"     // di_cpu_dots, di_cpu_weighted_sum, di_cpu_index_scores
#include "base/log.h"
#include "base/mem.h"
#include "base/thread.h"
#include "tensor/quant_ref.h" // di_round_bf16, di_fake_quant_q8/q4, di_hadamard

// Key rows handed to the vec.h kernels at once (model/dsv4.h DI_DSV4_KEY_CHUNK: the same chunks,
// though the results do not depend on them) and heads of a row sharing them (DI_DSV4_HEAD_GROUP).
enum { KEY_CHUNK = 64, HEAD_GROUP = 8, ALIGN_BYTES = 256 };

typedef struct cpu_impl {
    di_pool *pool; // owned
    di_cpu cpu;    // owned scratch; row_cap grows to the widest row seen
    bool cpu_ok;
    // MoE scratch (floats and ints), grown as needed.
    float *moe_f; // owned
    size_t moe_f_cap;
    int32_t *moe_i; // owned
    size_t moe_i_cap;
    // attn_kv scratch: the decoded key rows and their list, grown as needed.
    float *kv_rows; // owned
    size_t kv_rows_cap;
    int32_t *kv_idx; // owned
    size_t kv_idx_cap;
    // attn_codes scratch: per thread, the decoded keys of one row (max_keys rows of dh floats).
    float *kd; // owned [n_threads * kd_per_thread]
    size_t kd_per_thread;
    // index_scores_q4 scratch: per thread, a chunk of decoded index keys.
    float *ik_rows; // owned [n_threads * ik_per_thread]
    size_t ik_per_thread;
    // Attention / indexer scratch: per thread, key pointers and scores.
    const float **kp; // owned [n_threads * kp_per_thread]
    size_t kp_per_thread;
    float *sc; // owned [n_threads * sc_per_thread]
    size_t sc_per_thread;
    // Graph capture: the commands recorded so far (owned), whether a capture is open, whether
    // something was refused inside it.
    struct cmd *rec;
    int64_t n_rec, cap_rec;
    bool capturing, refused;
    // A simulated device loss (di_cpu_backend_lose, tests): lose_in entries from now on the
    // backend is lost (0: not armed); once lost, every entry but the frees and destroy returns
    // DI_ERR_DEVICE_LOST, as a CUDA context after a sticky error, until the backend is destroyed.
    int64_t lose_in;
    bool lost;
    bool no_peer; // di_cpu_backend_set_peer(b, false): can_peer is false both ways (tests)
    // di_cpu_backend_set_mem (tests): the free and total bytes mem_info reports (both 0, the
    // default, or free > total: it cannot say).
    size_t mem_free, mem_total;
    // Deferred mode (di_cpu_backend_set_deferred): the queued commands (owned), whether the queue
    // is being run (its entries then run at once).
    struct cmd *q;
    int64_t n_q, cap_q;
    bool deferred, flushing;
} cpu_impl;

static const di_backend_vt cpu_vt;

static cpu_impl *impl_of(const di_backend *b) {
    return b->impl;
}

// Counts an entry against an armed loss; whether the backend is lost (then the entry fails).
static bool lost_now(cpu_impl *c) {
    if (c->lost) return true;
    if (c->flushing) return false; // a queued command was counted when it was queued
    if (c->lose_in <= 0 || --c->lose_in > 0) return false;
    c->lost = true;
    DI_LOG_ERROR("cpu backend: simulated device loss: every later call fails with %s",
                 di_status_str(DI_ERR_DEVICE_LOST));
    return true;
}

#define ALIVE(c)                                                                                   \
    do {                                                                                           \
        if (lost_now(c)) return DI_ERR_DEVICE_LOST;                                                \
    } while (0)

// ---- graph commands ----

typedef enum cmd_op {
    CMD_MEMSET,
    CMD_COPY,
    CMD_MATMUL,
    CMD_EMBED,
    CMD_RMSNORM,
    CMD_ROPE,
    CMD_SCALE,
    CMD_MHC_PRE,
    CMD_MHC_POST,
    CMD_MOE,
    CMD_SCATTER_ROWS,
    CMD_ADD_APE,
    CMD_COMPRESS_POOL,
    CMD_ATTN,
    CMD_INDEX_SCORES,
    CMD_TOPK,
    CMD_OFFSET_LIST,
    CMD_ROUND_BF16,
    CMD_FAKE_QUANT,
    CMD_HADAMARD,
    CMD_KV_QUANT,
    CMD_ATTN_KV,
    CMD_MHC_PRE_CARRIED,
    CMD_ENGRAM_GATE,
    CMD_INDEX_CAND,
    CMD_PACK_ROWS,
    CMD_ATTN_CODES,
    CMD_INDEX_SCORES_Q4,
    CMD_ARGMAX_ROWS,
    CMD_FREE, // deferred mode only: a free after the commands before it
} cmd_op;

// One recorded entry: its arguments by value (tensors and the MoE weight struct copied: the
// caller's may be a stack temporary; the memory their pointers name is read at launch).
typedef struct cmd {
    cmd_op op;
    union {
        struct {
            void *p;
        } free;
        struct {
            void *dst;
            int value;
            size_t bytes;
        } memset;
        struct {
            void *dst;
            const void *src;
            size_t bytes;
        } copy;
        struct {
            di_tensor w;
            const float *x;
            int64_t n_tok, xs;
            float *y;
            int64_t ys;
        } matmul;
        struct {
            di_tensor table;
            const int32_t *ids;
            int32_t n, copies;
            float *x;
        } embed;
        struct {
            float *x;
            int64_t n_rows, n, stride;
            const float *w;
            float eps;
        } rmsnorm;
        struct {
            float *x;
            int64_t n_rows, row_stride, n;
            int32_t n_rot;
            const float *omega;
            const int32_t *pos;
            int32_t rows_per_pos;
            float scale;
            bool inverse;
        } rope;
        struct {
            float *x;
            int64_t n;
            float s;
        } scale;
        struct {
            const float *x, *mix_raw, *base, *scale;
            int32_t nc;
            int64_t D;
            int32_t n_tok, iters;
            float hc_eps, norm_eps;
            bool head;
            float *a, *post, *comb;
        } mhc_pre;
        struct {
            const float *o;
            float *x;
            const float *post, *comb;
            int32_t nc;
            int64_t D;
            int32_t n_tok;
        } mhc_post;
        struct {
            di_backend_moe_w w;
            const float *f;
            const int32_t *ids;
            int32_t n_tok;
            float *out;
        } moe;
        struct {
            const float *src;
            int64_t n, src_stride, width;
            float *dst;
            int64_t dst_stride;
            const int32_t *dst_rows, *src_rows;
        } scatter_rows;
        struct {
            float *z;
            int64_t n, stride, width;
            const float *ape;
            const int32_t *pos;
            int32_t m;
        } add_ape;
        struct {
            const float *call_c, *call_z;
            int64_t call_stride;
            const float *ring_c, *ring_z;
            const int32_t *src;
            int32_t n_win, m, c, d;
            float *entry;
        } compress_pool;
        struct {
            const float *q, *pool;
            const int32_t *key_idx;
            int64_t key_stride;
            const int32_t *n_keys;
            int32_t max_keys;
            const float *sink;
            int32_t n_tok, H, dh;
            float scale;
            bool round_p;
            float *o;
        } attn;
        struct {
            const float *kv;
            int64_t n, kv_stride;
            int32_t dh, n_rot;
            uint8_t *pool;
            const int32_t *dst_rows;
        } kv_quant;
        struct {
            const float *q;
            const uint8_t *pool;
            const int32_t *key_idx;
            int64_t key_stride;
            const int32_t *n_keys;
            int32_t max_keys;
            const float *sink;
            int32_t n_tok, H, dh, n_rot;
            float scale;
            bool round_p;
            float *o;
        } attn_kv;
        struct {
            const float *qi, *wi, *keys;
            const int64_t *key_base;
            const int32_t *pages, *page_off;
            int32_t per_page;
            const int32_t *n_vis;
            int32_t max_vis, n_tok, HI, DI;
            bool round_bf16;
            float *scores;
            int64_t score_stride;
        } index_scores;
        struct {
            const float *scores;
            int64_t score_stride;
            const int32_t *n_vis;
            int32_t n_tok, topk;
            int32_t *sel;
        } topk;
        struct {
            const int32_t *sel;
            int32_t n_tok, k;
            const int32_t *base, *off, *pages, *page_off;
            int32_t per_page;
            int32_t *dst;
            int64_t dst_stride;
        } offset_list;
        struct {
            float *x;
            int64_t n;
        } round_bf16;
        struct {
            const float *x;
            int64_t n_rows, n, stride;
            int32_t block, bits;
            float *y;
        } fake_quant;
        struct {
            float *x;
            int64_t n_rows, n;
        } hadamard;
        struct {
            const float *x, *mix_raw, *base, *scale;
            int32_t nc;
            int64_t D;
            int32_t n_tok, iters;
            float hc_eps, norm_eps;
            const float *pre_in;
            float *a, *pre_out, *post, *comb;
        } mhc_pre_carried;
        struct {
            const float *kv, *qk;
            int32_t nc;
            int64_t D;
            int32_t n_tok;
            float eps;
            float *x;
        } engram_gate;
        struct {
            int32_t mode;
            float *scores;
            int64_t score_stride;
            const int32_t *n_vis;
            int32_t n_tok, bs, ntb;
            int32_t *cand, *n_cand, *sel;
            int32_t k;
            float *work;
        } index_cand;
        struct {
            const float *x;
            int64_t n, x_stride;
            int32_t n_dims, block, bits;
            uint8_t *dst;
            const int32_t *dst_rows, *src_rows;
        } pack_rows;
        struct {
            const float *q;
            const uint8_t *win, *ent;
            const int32_t *key_idx;
            int64_t key_stride;
            const int32_t *n_win, *n_keys;
            int32_t max_keys;
            const float *sink;
            int32_t n_tok, H, dh;
            float scale;
            bool round_p;
            float *o;
        } attn_codes;
        struct {
            const float *qi, *wi;
            const uint8_t *keys;
            const int64_t *key_base;
            const int32_t *pages, *page_off;
            int32_t per_page;
            const int32_t *n_vis;
            int32_t max_vis, n_tok, HI, DI;
            bool round_bf16;
            float *scores;
            int64_t score_stride;
        } index_scores_q4;
        struct {
            const float *x;
            int64_t n_rows, V, stride;
            int32_t *ids;
        } argmax_rows;
    } u;
} cmd;

typedef struct cpu_graph {
    cmd *cmds; // owned [n]
    int64_t n;
} cpu_graph;

// Appends a command to the open capture (the list grows on the host: capture time only).
static di_status record(cpu_impl *c, const cmd *k) {
    if (c->n_rec == c->cap_rec) {
        int64_t cap = c->cap_rec ? 2 * c->cap_rec : 256;
        cmd *p = di_realloc(c->rec, sizeof(cmd) * (size_t)cap);
        if (!p) {
            c->refused = true;
            return DI_ERR_NOMEM;
        }
        c->rec = p;
        c->cap_rec = cap;
    }
    c->rec[c->n_rec++] = *k;
    return DI_OK;
}

// Deferred mode: appends a command to the queue (DI_ERR_NOMEM: not queued, nothing run).
static di_status enqueue(cpu_impl *c, const cmd *k) {
    if (c->n_q == c->cap_q) {
        int64_t cap = c->cap_q ? 2 * c->cap_q : 1024;
        cmd *p = di_realloc(c->q, sizeof(cmd) * (size_t)cap);
        if (!p) return DI_ERR_NOMEM;
        c->q = p;
        c->cap_q = cap;
    }
    c->q[c->n_q++] = *k;
    return DI_OK;
}

static di_status replay(di_backend *b, const cmd *k);

// Deferred mode: runs the queued commands in order (a CUDA stream synchronisation). The first
// error is logged and returned (as a fault of asynchronous work surfaces at the next sync); the
// commands after it still run, as a stream's later kernels do.
static di_status flush(di_backend *b) {
    cpu_impl *c = impl_of(b);
    if (c->flushing || c->n_q == 0) return DI_OK;
    c->flushing = true;
    di_status first = DI_OK;
    for (int64_t i = 0; i < c->n_q; i++) {
        const di_status st = replay(b, &c->q[i]);
        if (st != DI_OK && first == DI_OK) {
            DI_LOG_ERROR("cpu backend: deferred command %lld (op %d) failed: %s", (long long)i,
                         (int)c->q[i].op, di_status_str(st));
            first = st;
        }
    }
    c->n_q = 0;
    c->flushing = false;
    return first;
}

#define FLUSH(b)                                                                                   \
    do {                                                                                           \
        const di_status fst_ = flush(b);                                                           \
        if (fst_ != DI_OK) return fst_;                                                            \
    } while (0)

// An entry a capture cannot hold: refused, and the capture fails.
static di_status refuse(cpu_impl *c, const char *what) {
    DI_LOG_ERROR("cpu backend: %s inside a graph capture (a CUDA capture cannot hold it)", what);
    c->refused = true;
    return DI_ERR_INVALID;
}

// During a capture: records the entry (enum value op, union member `member`, the arguments of
// the enclosing call in the member's order) and returns; in deferred mode (outside a flush) it
// queues it likewise.
#define RECORD(c, op_, member, ...)                                                                \
    do {                                                                                           \
        ALIVE(c);                                                                                  \
        if ((c)->capturing) {                                                                      \
            cmd k_ = {.op = op_, .u.member = {__VA_ARGS__}};                                       \
            return record((c), &k_);                                                               \
        }                                                                                          \
        if ((c)->deferred && !(c)->flushing) {                                                     \
            cmd k_ = {.op = op_, .u.member = {__VA_ARGS__}};                                       \
            return enqueue((c), &k_);                                                              \
        }                                                                                          \
    } while (0)

// ---- memory and copies ----

static di_status cpu_alloc(di_backend *b, size_t bytes, void **out) {
    ALIVE(impl_of(b));
    if (impl_of(b)->capturing) return refuse(impl_of(b), "alloc");
    void *p = NULL;
    size_t n = (bytes + ALIGN_BYTES - 1) / ALIGN_BYTES * ALIGN_BYTES;
    if (posix_memalign(&p, ALIGN_BYTES, n ? n : ALIGN_BYTES) != 0) {
        DI_LOG_ERROR("cpu backend: cannot allocate %zu bytes", bytes);
        return DI_ERR_NOMEM;
    }
    *out = p;
    return DI_OK;
}

static void cpu_free(di_backend *b, void *p) {
    cpu_impl *c = impl_of(b);
    if (c->capturing) {
        (void)refuse(c, "free"); // not freed: the capture fails
        return;
    }
    if (p && c->deferred && !c->flushing && c->n_q > 0) {
        // After the queued commands, which may use the block (the CUDA pool reuses it in stream
        // order). Without room in the queue: they run first.
        const cmd k = {.op = CMD_FREE, .u.free = {p}};
        if (enqueue(c, &k) == DI_OK) return;
        (void)flush(b);
    }
    free(p);
}

// host_free: cudaFreeHost synchronises with the device's work first.
static void cpu_host_free(di_backend *b, void *p) {
    cpu_impl *c = impl_of(b);
    if (c->capturing) {
        (void)refuse(c, "host_free"); // not freed: the capture fails
        return;
    }
    (void)flush(b); // an error of queued work surfaces at the next sync
    free(p);
}

static di_status cpu_copy(di_backend *b, void *dst, const void *src, size_t bytes) {
    RECORD(impl_of(b), CMD_COPY, copy, dst, src, bytes);
    if (bytes) memmove(dst, src, bytes);
    return DI_OK;
}

// Host <-> backend copies synchronise on CUDA: not inside a capture.
static di_status cpu_upload(di_backend *b, void *dst, const void *src, size_t bytes) {
    ALIVE(impl_of(b));
    if (impl_of(b)->capturing) return refuse(impl_of(b), "upload");
    FLUSH(b);
    if (bytes) memmove(dst, src, bytes);
    return DI_OK;
}

static di_status cpu_download(di_backend *b, void *dst, const void *src, size_t bytes) {
    ALIVE(impl_of(b));
    if (impl_of(b)->capturing) return refuse(impl_of(b), "download");
    FLUSH(b);
    if (bytes) memmove(dst, src, bytes);
    return DI_OK;
}

// Between two CPU backends: one address space, so a memmove (synchronous: both "streams" are the
// calling thread). Refused inside a capture of either, as CUDA's must be (it records events).
static bool cpu_can_peer(const di_backend *b, const di_backend *src_b) {
    return src_b->vt == &cpu_vt && !impl_of(b)->no_peer && !impl_of(src_b)->no_peer;
}

static di_status cpu_peer_copy(di_backend *b, void *dst, di_backend *src_b, const void *src,
                               size_t bytes) {
    cpu_impl *c = impl_of(b);
    ALIVE(c);
    if (src_b != b) ALIVE(impl_of(src_b));
    if (c->capturing) return refuse(c, "peer_copy");
    if (impl_of(src_b)->capturing) return refuse(impl_of(src_b), "peer_copy");
    if (!cpu_can_peer(b, src_b)) {
        DI_LOG_ERROR("cpu backend: peer_copy between backends that cannot peer");
        return DI_ERR_UNSUPPORTED;
    }
    // Deferred mode: after src_b's and b's queued work, before anything queued later on either.
    if (src_b != b) FLUSH(src_b);
    FLUSH(b);
    if (bytes) memmove(dst, src, bytes);
    return DI_OK;
}

// ---- device memory ----

// Not an entry a device loss drill counts (it runs at create, outside the steps the drills
// count), but a lost backend refuses it as CUDA's would.
static di_status cpu_mem_info(di_backend *b, size_t *free_bytes, size_t *total_bytes) {
    cpu_impl *c = impl_of(b);
    if (c->lost) return DI_ERR_DEVICE_LOST;
    if (c->capturing) return refuse(c, "mem_info");
    // Unset (or set back to 0, 0) or set so (free > total): cannot say. The host's free memory is
    // no device's: a CPU backend stands in for one in tests, whose splits must not follow the
    // machine's load.
    if (!c->mem_total || c->mem_free > c->mem_total) return DI_ERR_UNSUPPORTED;
    *free_bytes = c->mem_free;
    *total_bytes = c->mem_total;
    return DI_OK;
}

static di_status cpu_memset(di_backend *b, void *dst, int value, size_t bytes) {
    RECORD(impl_of(b), CMD_MEMSET, memset, dst, value, bytes);
    if (bytes) memset(dst, value, bytes);
    return DI_OK;
}

static di_status cpu_sync(di_backend *b) {
    ALIVE(impl_of(b));
    if (impl_of(b)->capturing) return refuse(impl_of(b), "sync");
    return flush(b);
}

// di_cpu_matmul asserts its row capacity: grow it (re-init) for a wider weight.
static di_status ensure_row(cpu_impl *c, int64_t n_in) {
    if (c->cpu_ok && n_in <= c->cpu.row_cap) return DI_OK;
    int64_t cap = c->cpu_ok ? c->cpu.row_cap : 0;
    if (n_in > cap) cap = n_in;
    if (c->cpu_ok) di_cpu_deinit(&c->cpu);
    c->cpu_ok = false;
    di_status st = di_cpu_init(&c->cpu, c->pool, cap);
    if (st != DI_OK) {
        DI_LOG_ERROR("cpu backend: cannot allocate matmul scratch for rows of %lld",
                     (long long)cap);
        return st;
    }
    c->cpu_ok = true;
    return DI_OK;
}

static di_status cpu_weight_upload(di_backend *b, const di_tensor *host, di_tensor *dev) {
    ALIVE(impl_of(b));
    if (impl_of(b)->capturing) return refuse(impl_of(b), "weight_upload");
    FLUSH(b);
    di_status st = ensure_row(impl_of(b), host->ne[0]);
    if (st != DI_OK) return st;
    *dev = *host; // host memory is this backend's memory: no copy
    return DI_OK;
}

static bool cpu_supports_matmul(const di_backend *b, const di_tensor *w) {
    (void)b;
    switch (w->kind) {
    case DI_TENSOR_KIND_F32:
    case DI_TENSOR_KIND_F16:
    case DI_TENSOR_KIND_BF16:
    case DI_TENSOR_KIND_FP8:
    case DI_TENSOR_KIND_FP4:
    case DI_TENSOR_KIND_Q8_0:
    case DI_TENSOR_KIND_MXFP4:
    case DI_TENSOR_KIND_Q4_K:
    case DI_TENSOR_KIND_Q2_K:
    case DI_TENSOR_KIND_IQ2_XXS:
        return true;
    default:
        return false;
    }
}

// ---- dense ops ----

static di_status cpu_matmul(di_backend *b, const di_tensor *w, const float *x, int64_t n_tok,
                            int64_t xs, float *y, int64_t ys) {
    cpu_impl *c = impl_of(b);
    RECORD(c, CMD_MATMUL, matmul, *w, x, n_tok, xs, y, ys);
    if (n_tok <= 0) return DI_OK;
    di_status st = ensure_row(c, w->ne[0]);
    if (st != DI_OK) return st;
    di_cpu_matmul(&c->cpu, w, x, n_tok, xs, y, ys);
    return DI_OK;
}

// Two entries, each recorded on its own inside a capture (backend.h matmul_a8).
static di_status cpu_fake_quant(di_backend *b, const float *x, int64_t n_rows, int64_t n,
                                int64_t stride, int32_t block, int32_t bits, float *y);

static di_status cpu_matmul_a8(di_backend *b, const di_tensor *w, const float *x, int64_t n_tok,
                               int64_t xs, float *aq, float *y, int64_t ys) {
    di_status st = cpu_fake_quant(b, x, n_tok, w->ne[0], xs, 128, 8, aq);
    return st == DI_OK ? cpu_matmul(b, w, aq, n_tok, xs, y, ys) : st;
}

static di_status cpu_embed(di_backend *b, const di_tensor *table, const int32_t *ids, int32_t n,
                           int32_t copies, float *x) {
    RECORD(impl_of(b), CMD_EMBED, embed, *table, ids, n, copies, x);
    const int64_t D = table->ne[0];
    for (int32_t t = 0; t < n; t++) {
        if (ids[t] < 0 || ids[t] >= table->ne[1]) {
            DI_LOG_ERROR("cpu backend: embed id %d outside [0, %lld)", ids[t],
                         (long long)table->ne[1]);
            return DI_ERR_INVALID;
        }
        float *xt = x + (int64_t)t * copies * D;
        di_tensor_row_f32(table, ids[t], xt);
        for (int32_t k = 1; k < copies; k++) memcpy(xt + k * D, xt, sizeof(float) * (size_t)D);
    }
    return DI_OK;
}

static di_status cpu_rmsnorm(di_backend *b, float *x, int64_t n_rows, int64_t n, int64_t stride,
                             const float *w, float eps) {
    RECORD(impl_of(b), CMD_RMSNORM, rmsnorm, x, n_rows, n, stride, w, eps);
    if (n_rows > 0) di_ref_rmsnorm(x, n_rows, n, stride, w, eps);
    return DI_OK;
}

static di_status cpu_rope(di_backend *b, float *x, int64_t n_rows, int64_t row_stride, int64_t n,
                          int32_t n_rot, const float *omega, const int32_t *pos,
                          int32_t rows_per_pos, float scale, bool inverse) {
    RECORD(impl_of(b), CMD_ROPE, rope, x, n_rows, row_stride, n, n_rot, omega, pos, rows_per_pos,
           scale, inverse);
    if (rows_per_pos < 1 || n_rot > n || n_rot % 2) return DI_ERR_INVALID;
    for (int64_t r = 0; r < n_rows; r++)
        di_ref_rope(x + r * row_stride, n, n_rot, omega, pos[r / rows_per_pos], scale, inverse);
    return DI_OK;
}

static di_status cpu_scale(di_backend *b, float *x, int64_t n, float s) {
    RECORD(impl_of(b), CMD_SCALE, scale, x, n, s);
    for (int64_t i = 0; i < n; i++) x[i] *= s;
    return DI_OK;
}

// ---- mHC (model/dsv4.c hc_pre_task, di_dsv4_hc_post) ----

typedef struct mhc_ctx {
    const float *x, *mix_raw, *base, *scale;
    int32_t nc, n_tok, iters;
    int64_t D;
    float hc_eps, norm_eps;
    bool head;
    float *a, *post, *comb;
    float *pre; // mhc_pre_carried: the coefficients' pre [T, nc] (a is not written)
} mhc_ctx;

static void mhc_pre_task(void *p, int ith, int nth) {
    const mhc_ctx *c = p;
    const int nc = c->nc;
    const int64_t D = c->D;
    const int n_mix = c->head ? nc : (2 + nc) * nc;
    int64_t lo, hi;
    di_split_range(c->n_tok, ith, nth, &lo, &hi);
    for (int64_t t = lo; t < hi; t++) {
        const float *xf = c->x + t * nc * D;
        float r = 1.0f / sqrtf(di_ref_dot(xf, xf, (int64_t)nc * D) / (float)(nc * D) + c->norm_eps);
        float mix[16 * 18];
        for (int i = 0; i < n_mix; i++) mix[i] = c->mix_raw[t * n_mix + i] * r;
        float pre[16];
        di_ref_hc_coeffs(mix, c->base, c->scale, nc, c->iters, c->hc_eps, pre,
                         c->head ? NULL : c->post + t * nc, c->head ? NULL : c->comb + t * nc * nc);
        if (c->pre) {
            for (int s = 0; s < nc; s++) c->pre[t * nc + s] = pre[s];
            continue;
        }
        float *a = c->a + t * D;
        for (int64_t d = 0; d < D; d++) {
            float acc = 0;
            for (int s = 0; s < nc; s++) acc += pre[s] * xf[s * D + d];
            a[d] = acc;
        }
    }
}

static di_status cpu_mhc_pre(di_backend *b, const float *x, const float *mix_raw, const float *base,
                             const float *scale, int32_t nc, int64_t D, int32_t n_tok,
                             int32_t iters, float hc_eps, float norm_eps, bool head, float *a,
                             float *post, float *comb) {
    RECORD(impl_of(b), CMD_MHC_PRE, mhc_pre, x, mix_raw, base, scale, nc, D, n_tok, iters, hc_eps,
           norm_eps, head, a, post, comb);
    if (nc < 1 || nc > 16) return DI_ERR_INVALID;
    if (n_tok <= 0) return DI_OK;
    mhc_ctx c = {x,      mix_raw,  base, scale, nc,   n_tok, iters, D,
                 hc_eps, norm_eps, head, a,     post, comb,  NULL};
    di_pool_run(impl_of(b)->pool, mhc_pre_task, &c);
    return DI_OK;
}

static di_status cpu_mhc_post(di_backend *b, const float *o, float *x, const float *post,
                              const float *comb, int32_t nc, int64_t D, int32_t n_tok) {
    RECORD(impl_of(b), CMD_MHC_POST, mhc_post, o, x, post, comb, nc, D, n_tok);
    if (nc < 1 || nc > 16) return DI_ERR_INVALID;
    di_ref_hc_post(o, x, post, comb, nc, D, n_tok);
    return DI_OK;
}

// ---- MoE (model/dsv4_moe.c) ----

static di_status grow_f(float **p, size_t *cap, size_t need) {
    if (need <= *cap) return DI_OK;
    float *q = di_aligned_alloc(sizeof(float) * need);
    if (!q) return DI_ERR_NOMEM;
    di_aligned_free(*p);
    *p = q;
    *cap = need;
    return DI_OK;
}

static di_status grow_i(int32_t **p, size_t *cap, size_t need) {
    if (need <= *cap) return DI_OK;
    int32_t *q = di_malloc(sizeof(int32_t) * need);
    if (!q) return DI_ERR_NOMEM;
    di_free(*p);
    *p = q;
    *cap = need;
    return DI_OK;
}

static void round_all(float *x, int64_t n) {
    for (int64_t i = 0; i < n; i++) x[i] = di_round_bf16(x[i]);
}

// y = W x (model/dsv4_attn.c di_dsv4_linear): official, FP8/FP4 weights see A8 of x (Q8, blocks
// of a8_block, into xq [n, K]) and the output is rounded to BF16.
static void linear(cpu_impl *c, const di_tensor *w, const float *x, int32_t n, float *xq, float *y,
                   bool official, int32_t a8_block) {
    const int64_t K = w->ne[0], N = w->ne[1];
    if (official && (w->kind == DI_TENSOR_KIND_FP8 || w->kind == DI_TENSOR_KIND_FP4)) {
        memcpy(xq, x, sizeof(float) * (size_t)n * (size_t)K);
        for (int32_t r = 0; r < n; r++) di_fake_quant_q8(xq + (int64_t)r * K, K, a8_block);
        x = xq;
    }
    di_cpu_matmul(&c->cpu, w, x, n, K, y, N);
    if (official) round_all(y, (int64_t)n * N);
}

// One expert on n rows of x [n, D] -> y [n, D]; weight (per row, may be NULL) scales the output
// (FP32 recipe) or h before w2 (official: dsv4_moe.c expert). xq: A8 scratch [n, max(D, F)].
static void expert(cpu_impl *c, const di_tensor *w1, const di_tensor *w3, const di_tensor *w2,
                   const float *x, int32_t n, int64_t D, float limit, const float *weight, float *g,
                   float *u, float *y, float *xq, bool official, int32_t a8_block) {
    const int64_t F = w1->ne[1];
    linear(c, w1, x, n, xq, g, official, a8_block); // gate: [n, F]
    linear(c, w3, x, n, xq, u, official, a8_block); // up:   [n, F]
    di_ref_swiglu(g, u, (int64_t)n * F, limit);
    if (official && weight)
        for (int32_t r = 0; r < n; r++)
            for (int64_t i = 0; i < F; i++) g[r * F + i] *= weight[r];
    if (official) round_all(g, (int64_t)n * F);
    linear(c, w2, g, n, xq, y, official, a8_block); // [n, D]
    if (!official && weight)
        for (int32_t r = 0; r < n; r++)
            for (int64_t i = 0; i < D; i++) y[r * D + i] *= weight[r];
}

static di_status cpu_moe(di_backend *b, const di_backend_moe_w *w, const float *f,
                         const int32_t *ids, int32_t n_tok, float *out) {
    cpu_impl *c = impl_of(b);
    RECORD(c, CMD_MOE, moe, *w, f, ids, n_tok, out);
    if (n_tok <= 0) return DI_OK;
    // Scratch for the wider of the routed and the shared expert.
    const int64_t D = w->D, F = w->F > w->sh_w1.ne[1] ? w->F : w->sh_w1.ne[1], E = w->n_expert;
    const int32_t K = w->n_used;
    if (K < 1 || K > E || (!w->tid2eid && !w->gate_bias)) return DI_ERR_INVALID;
    int64_t widest = D > F ? D : F;
    di_status st = ensure_row(c, widest);
    if (st != DI_OK) return st;
    // Floats: score [T, E], wgt [T, K], rw [T*K], xin [T*K, D], g, u [max(T*K, T), F], yout
    // [max(T*K, T), D] (the shared expert runs on all T rows), official: xq [max(T*K, T), widest].
    const size_t T = (size_t)n_tok, TK = T * (size_t)K, TR = TK > T ? TK : T;
    const size_t o_score = 0, o_wgt = o_score + T * (size_t)E, o_rw = o_wgt + TK, o_xin = o_rw + TK,
                 o_g = o_xin + TK * (size_t)D, o_u = o_g + TR * (size_t)F,
                 o_y = o_u + TR * (size_t)F, o_xq = o_y + TR * (size_t)D,
                 n_f = o_xq + (w->official ? TR * (size_t)widest : 0);
    if ((st = grow_f(&c->moe_f, &c->moe_f_cap, n_f)) != DI_OK ||
        (st = grow_i(&c->moe_i, &c->moe_i_cap, 2 * TK)) != DI_OK) {
        DI_LOG_ERROR("cpu backend: cannot allocate MoE scratch for %d rows", n_tok);
        return st;
    }
    float *score = c->moe_f + o_score, *wgt = c->moe_f + o_wgt, *rw = c->moe_f + o_rw;
    float *xin = c->moe_f + o_xin, *g = c->moe_f + o_g, *u = c->moe_f + o_u;
    float *yout = c->moe_f + o_y, *xq = w->official ? c->moe_f + o_xq : NULL;
    int32_t *sel = c->moe_i, *rows = c->moe_i + TK;

    // Router in FP32: s = sqrt(softplus(gate . f)) (V4.1: of gate . f / gate_temp).
    di_cpu_matmul(&c->cpu, &w->gate, f, n_tok, D, score, E);
    if (w->gate_temp > 0)
        for (int64_t i = 0; i < (int64_t)n_tok * E; i++) score[i] /= w->gate_temp;
    for (int64_t i = 0; i < (int64_t)n_tok * E; i++) score[i] = sqrtf(di_softplus(score[i]));
    for (int32_t t = 0; t < n_tok; t++) {
        const float *s = score + t * E;
        int32_t *se = sel + t * K;
        if (w->tid2eid) memcpy(se, w->tid2eid + (int64_t)ids[t] * K, sizeof(int32_t) * (size_t)K);
        di_ref_route(s, (int32_t)E, K, w->tid2eid ? NULL : w->gate_bias, w->hf_eps ? 1e-20f : 0.0f,
                     w->route_scale, se, wgt + t * K);
    }

    // Routed experts in ascending id, each on the rows routed to it (duplicates count twice).
    const int32_t a8_block = w->a8_block > 0 ? w->a8_block : 128;
    memset(out, 0, sizeof(float) * T * (size_t)D);
    for (int32_t e = 0; e < E; e++) {
        const int32_t n = di_ref_moe_gather(sel, wgt, n_tok, K, e, f, D, xin, rows, rw);
        if (n == 0) continue;
        expert(c, &w->w1[e], &w->w3[e], &w->w2[e], xin, n, D, w->swiglu_limit, rw, g, u, yout, xq,
               w->official, a8_block);
        di_ref_moe_add_rows(yout, rows, n, D, out);
    }
    // Shared expert on every row, then one sum.
    expert(c, &w->sh_w1, &w->sh_w3, &w->sh_w2, f, n_tok, D, w->shared_clamp ? w->swiglu_limit : 0,
           NULL, g, u, yout, xq, w->official, a8_block);
    for (int64_t i = 0; i < (int64_t)n_tok * D; i++) out[i] += yout[i];
    if (w->official) round_all(out, (int64_t)n_tok * D);
    return DI_OK;
}

// ---- rows, compressor ----

static di_status cpu_scatter_rows(di_backend *b, const float *src, int64_t n, int64_t src_stride,
                                  int64_t width, float *dst, int64_t dst_stride,
                                  const int32_t *dst_rows, const int32_t *src_rows) {
    RECORD(impl_of(b), CMD_SCATTER_ROWS, scatter_rows, src, n, src_stride, width, dst, dst_stride,
           dst_rows, src_rows);
    for (int64_t i = 0; i < n; i++) {
        if (dst_rows[i] < 0) continue; // padding, skipped
        const int64_t r = src_rows ? src_rows[i] : i;
        memcpy(dst + (int64_t)dst_rows[i] * dst_stride, src + r * src_stride,
               sizeof(float) * (size_t)width);
    }
    return DI_OK;
}

static di_status cpu_add_ape(di_backend *b, float *z, int64_t n, int64_t stride, int64_t width,
                             const float *ape, const int32_t *pos, int32_t m) {
    RECORD(impl_of(b), CMD_ADD_APE, add_ape, z, n, stride, width, ape, pos, m);
    if (m < 1) return DI_ERR_INVALID;
    for (int64_t t = 0; t < n; t++) {
        float *zt = z + t * stride;
        const float *a = ape + (int64_t)(pos[t] % m) * width;
        for (int64_t i = 0; i < width; i++) zt[i] = zt[i] + a[i];
    }
    return DI_OK;
}

// The token rows of slot j of a window: C and Z at column offset col, or NULL (no token).
static void pool_slot(const float *call_c, const float *call_z, int64_t call_stride,
                      const float *ring_c, const float *ring_z, int64_t ring_width, int32_t idx,
                      int64_t col, const float **pc, const float **pz) {
    if (idx == DI_BACKEND_NO_ROW) {
        *pc = *pz = NULL;
    } else if (idx >= 0) {
        *pc = call_c + (int64_t)idx * call_stride + col;
        *pz = call_z + (int64_t)idx * call_stride + col;
    } else {
        int64_t r = -(int64_t)idx - 1;
        *pc = ring_c + r * ring_width + col;
        *pz = ring_z + r * ring_width + col;
    }
}

static di_status cpu_compress_pool(di_backend *b, const float *call_c, const float *call_z,
                                   int64_t call_stride, const float *ring_c, const float *ring_z,
                                   const int32_t *src, int32_t n_win, int32_t m, int32_t c,
                                   int32_t d, float *entry) {
    RECORD(impl_of(b), CMD_COMPRESS_POOL, compress_pool, call_c, call_z, call_stride, ring_c,
           ring_z, src, n_win, m, c, d, entry);
    if ((c != 1 && c != 2) || m < 1 || m > 1024 || d < 1) return DI_ERR_INVALID;
    const int64_t width = (int64_t)c * d;
    const int32_t n_slot = c * m;
    const float *pc[2048], *pz[2048];
    for (int32_t w = 0; w < n_win; w++) {
        const int32_t *s = src + (int64_t)w * n_slot;
        // Slot j's columns: c == 2 takes the overlap's [0, d) and this window's [d, 2d).
        for (int32_t j = 0; j < n_slot; j++)
            pool_slot(call_c, call_z, call_stride, ring_c, ring_z, width, s[j],
                      c == 2 && j >= m ? d : 0, &pc[j], &pz[j]);
        float *e = entry + (int64_t)w * d;
        for (int32_t ch = 0; ch < d; ch++) {
            float mx = -INFINITY;
            for (int32_t j = 0; j < n_slot; j++)
                if (pz[j]) mx = fmaxf(mx, pz[j][ch]);
            float den = 0, num = 0;
            for (int32_t j = 0; j < n_slot; j++) {
                if (!pz[j]) continue;
                float p = expf(pz[j][ch] - mx);
                den += p;
                num += p * pc[j][ch];
            }
            e[ch] = den > 0 ? num / den : 0.0f; // no slot present: a padding window
        }
    }
    return DI_OK;
}

// ---- attention, indexer ----

static di_status grow_scratch(cpu_impl *c, size_t kp_per_thread, size_t sc_per_thread) {
    const size_t nth = (size_t)di_pool_n_threads(c->pool);
    if (kp_per_thread > c->kp_per_thread) {
        const float **p = di_malloc(sizeof(*p) * kp_per_thread * nth);
        if (!p) return DI_ERR_NOMEM;
        di_free((void *)c->kp);
        c->kp = p;
        c->kp_per_thread = kp_per_thread;
    }
    if (sc_per_thread > c->sc_per_thread) {
        float *p = di_aligned_alloc(sizeof(float) * sc_per_thread * nth);
        if (!p) return DI_ERR_NOMEM;
        di_aligned_free(c->sc);
        c->sc = p;
        c->sc_per_thread = sc_per_thread;
    }
    return DI_OK;
}

typedef struct attn_ctx {
    const cpu_impl *c;
    const float *q, *pool, *sink;
    const int32_t *key_idx, *n_keys;
    int64_t key_stride;
    int32_t n_tok, H, dh;
    float scale;
    bool round_p;
    float *o;
    // attn_codes: the keys are V4.1's codes (pool unused): key j < n_win[t] a Q8 window row of
    // win, the others Q4e entries of ent, each row's present keys decoded into the thread's kd.
    const uint8_t *win, *ent;
    const int32_t *n_win;
} attn_ctx;

// Heads [h0, h0 + nh) of row t (model/dsv4_attn.c di_dsv4_attend_heads without the inverse RoPE).
static void attn_task(void *p, int ith, int nth) {
    const attn_ctx *a = p;
    const int isa = a->c->cpu.isa;
    const int32_t H = a->H, dh = a->dh;
    const float **kp = a->c->kp + (size_t)ith * a->c->kp_per_thread;
    float *sc = a->c->sc + (size_t)ith * a->c->sc_per_thread;
    const int32_t n_grp = (H + HEAD_GROUP - 1) / HEAD_GROUP;
    int64_t lo, hi, t_prev = -1, n_k = 0;
    di_split_range((int64_t)a->n_tok * n_grp, ith, nth, &lo, &hi);
    for (int64_t tg = lo; tg < hi; tg++) {
        const int64_t t = tg / n_grp;
        const int32_t h0 = (int32_t)(tg % n_grp) * HEAD_GROUP;
        const int32_t nh = H - h0 < HEAD_GROUP ? H - h0 : HEAD_GROUP;
        if (t != t_prev) { // this row's present keys, in list order
            n_k = 0;
            const int32_t *ki = a->key_idx + t * a->key_stride;
            if (a->win) { // decoded exactly (attn_codes), once per row and thread
                float *kd = a->c->kd + (size_t)ith * a->c->kd_per_thread;
                const int64_t wb = di_backend_code_row_bytes(8, dh, DI_BACKEND_WIN_BLOCK);
                const int64_t eb =
                    di_backend_code_row_bytes(DI_BACKEND_Q4E, dh, DI_BACKEND_ENT_BLOCK);
                for (int32_t j = 0; j < a->n_keys[t]; j++) {
                    if (ki[j] < 0) continue;
                    float *v = kd + n_k * dh;
                    if (j < a->n_win[t])
                        di_quant_q8_unpack(a->win + (int64_t)ki[j] * wb, dh, DI_BACKEND_WIN_BLOCK,
                                           v);
                    else
                        di_quant_q4e_unpack(a->ent + (int64_t)ki[j] * eb, dh, DI_BACKEND_ENT_BLOCK,
                                            v);
                    kp[n_k++] = v;
                }
            } else {
                for (int32_t j = 0; j < a->n_keys[t]; j++)
                    if (ki[j] >= 0) kp[n_k++] = a->pool + (int64_t)ki[j] * dh;
            }
            t_prev = t;
        }
        const float *q = a->q + (t * H + h0) * dh;
        float *o = a->o + (t * H + h0) * dh;
        for (int64_t j0 = 0; j0 < n_k; j0 += KEY_CHUNK) {
            int64_t nk = n_k - j0 < KEY_CHUNK ? n_k - j0 : KEY_CHUNK;
            for (int32_t h = 0; h < nh; h++)
                di_cpu_dots(isa, q + h * dh, kp + j0, nk, dh, a->scale, sc + h * n_k + j0);
        }
        for (int32_t h = 0; h < nh; h++) {
            float *s = sc + h * n_k, mx = a->sink[h0 + h];
            for (int64_t j = 0; j < n_k; j++) mx = fmaxf(mx, s[j]);
            float den = expf(a->sink[h0 + h] - mx); // the sink takes mass, gives no value
            for (int64_t j = 0; j < n_k; j++) den += (s[j] = expf(s[j] - mx));
            float inv = 1.0f / den;
            for (int64_t j = 0; j < n_k; j++) {
                s[j] *= inv;
                if (a->round_p) s[j] = di_round_bf16(s[j]); // official: BF16 p
            }
        }
        memset(o, 0, sizeof(float) * (size_t)nh * (size_t)dh);
        for (int64_t j0 = 0; j0 < n_k; j0 += KEY_CHUNK) {
            int64_t nk = n_k - j0 < KEY_CHUNK ? n_k - j0 : KEY_CHUNK;
            for (int32_t h = 0; h < nh; h++)
                di_cpu_weighted_sum(isa, sc + h * n_k + j0, kp + j0, nk, dh, o + h * dh);
        }
    }
}

// attn / attn_kv: every n_keys[t] in [0, max_keys] (backend.h), else DI_ERR_INVALID before any
// work (logged; CUDA, which cannot read the device counts before its kernels run, clamps them and
// returns it at the next sync).
static bool keys_ok(const char *what, const int32_t *n_keys, int32_t n_tok, int32_t max_keys) {
    for (int32_t t = 0; t < n_tok; t++)
        if (n_keys[t] < 0 || n_keys[t] > max_keys) {
            DI_LOG_ERROR("cpu backend: %s: row %d has %d keys, outside [0, max_keys = %d]", what, t,
                         n_keys[t], max_keys);
            return false;
        }
    return true;
}

static di_status cpu_attn(di_backend *b, const float *q, const float *pool, const int32_t *key_idx,
                          int64_t key_stride, const int32_t *n_keys, int32_t max_keys,
                          const float *sink, int32_t n_tok, int32_t H, int32_t dh, float scale,
                          bool round_p, float *o) {
    cpu_impl *c = impl_of(b);
    RECORD(c, CMD_ATTN, attn, q, pool, key_idx, key_stride, n_keys, max_keys, sink, n_tok, H, dh,
           scale, round_p, o);
    if (n_tok <= 0) return DI_OK;
    if (max_keys < 0 || H < 1 || dh < 1 || key_stride < max_keys) return DI_ERR_INVALID;
    if (!keys_ok("attn", n_keys, n_tok, max_keys)) return DI_ERR_INVALID;
    size_t mk = (size_t)max_keys + 1;
    if (grow_scratch(c, mk, mk * HEAD_GROUP) != DI_OK) {
        DI_LOG_ERROR("cpu backend: cannot allocate attention scratch for %d keys", max_keys);
        return DI_ERR_NOMEM;
    }
    attn_ctx a = {c, q,  pool,  sink,    key_idx, n_keys, key_stride, n_tok,
                  H, dh, scale, round_p, o,       NULL,   NULL,       NULL};
    di_pool_run(c->pool, attn_task, &a);
    return DI_OK;
}

// ---- KV rows (backend.h kv_quant; the layout of backend/cuda/attn.cuh) ----

// One FP32 row of dh values -> one KV row of row_bytes (di_cuda_kv_quant's encoding).
static void kv_encode_row(const float *v, int32_t dh, int32_t n_rot, int64_t row_bytes,
                          uint8_t *row) {
    const int32_t nope = dh - n_rot, nb = nope / 64;
    for (int32_t b = 0; b < nb; b++) {
        const float *x = v + (int64_t)b * 64;
        float amax = 0.0f;
        for (int32_t j = 0; j < 64; j++) amax = fmaxf(amax, fabsf(x[j]));
        amax = fmaxf(amax, 1e-4f);                               // Q8's floor
        const int k = di_ceil_log2_bits(amax * (1.0f / 448.0f)); // one f32 rounding
        const float inv_s = ldexpf(1.0f, -k);                    // exact
        for (int32_t j = 0; j < 64; j++) row[b * 64 + j] = di_f32_to_e4m3(x[j] * inv_s);
        row[nope + 2 * n_rot + b] = (uint8_t)(127 + k);
    }
    for (int32_t d = 0; d < n_rot; d++) {
        const uint16_t h = di_f32_to_bf16(v[nope + d]);
        memcpy(row + nope + 2 * d, &h, sizeof h); // little-endian hosts (conventions)
    }
    const int64_t used = nope + 2 * (int64_t)n_rot + nb;
    memset(row + used, 0, (size_t)(row_bytes - used));
}

// One KV row -> dh FP32 values, exactly.
static void kv_decode_row(const uint8_t *row, int32_t dh, int32_t n_rot, float *v) {
    const int32_t nope = dh - n_rot;
    for (int32_t d = 0; d < nope; d++)
        v[d] = di_e4m3_to_f32(row[d]) * di_ue8m0_to_f32(row[nope + 2 * n_rot + d / 64]);
    for (int32_t d = 0; d < n_rot; d++) {
        uint16_t h;
        memcpy(&h, row + nope + 2 * d, sizeof h);
        v[nope + d] = di_bf16_to_f32(h);
    }
}

static bool kv_shape_ok(int32_t dh, int32_t n_rot) {
    return n_rot >= 0 && n_rot % 2 == 0 && dh > n_rot && (dh - n_rot) % 64 == 0 && dh <= 1024;
}

static di_status cpu_kv_quant(di_backend *b, const float *kv, int64_t n, int64_t kv_stride,
                              int32_t dh, int32_t n_rot, uint8_t *pool, const int32_t *dst_rows) {
    RECORD(impl_of(b), CMD_KV_QUANT, kv_quant, kv, n, kv_stride, dh, n_rot, pool, dst_rows);
    if (!kv_shape_ok(dh, n_rot)) return DI_ERR_INVALID;
    const int64_t rb = di_backend_kv_row_bytes(dh, n_rot);
    for (int64_t i = 0; i < n; i++) {
        const int64_t r = dst_rows ? dst_rows[i] : i;
        if (r < 0) continue; // padding, skipped
        kv_encode_row(kv + i * kv_stride, dh, n_rot, rb, pool + r * rb);
    }
    return DI_OK;
}

// The twin of di_cuda_attn's FP8-row instance: the listed rows decoded exactly into FP32 rows
// (compacted: a list entry per present key), then attn's arithmetic on them.
static di_status cpu_attn_kv(di_backend *b, const float *q, const uint8_t *pool,
                             const int32_t *key_idx, int64_t key_stride, const int32_t *n_keys,
                             int32_t max_keys, const float *sink, int32_t n_tok, int32_t H,
                             int32_t dh, int32_t n_rot, float scale, bool round_p, float *o) {
    cpu_impl *c = impl_of(b);
    RECORD(c, CMD_ATTN_KV, attn_kv, q, pool, key_idx, key_stride, n_keys, max_keys, sink, n_tok, H,
           dh, n_rot, scale, round_p, o);
    if (n_tok <= 0) return DI_OK;
    if (!kv_shape_ok(dh, n_rot) || max_keys < 0 || key_stride < max_keys) return DI_ERR_INVALID;
    if (!keys_ok("attn_kv", n_keys, n_tok, max_keys)) return DI_ERR_INVALID;
    const size_t n_idx = (size_t)n_tok * (size_t)key_stride;
    size_t n_rows = 0;
    for (int32_t t = 0; t < n_tok; t++)
        for (int32_t j = 0; j < n_keys[t]; j++) n_rows += key_idx[(int64_t)t * key_stride + j] >= 0;
    if (grow_i(&c->kv_idx, &c->kv_idx_cap, n_idx ? n_idx : 1) != DI_OK ||
        grow_f(&c->kv_rows, &c->kv_rows_cap, (size_t)dh * (n_rows ? n_rows : 1)) != DI_OK)
        return DI_ERR_NOMEM;
    int32_t *idx = c->kv_idx;
    float *rows = c->kv_rows;
    const int64_t rb = di_backend_kv_row_bytes(dh, n_rot);
    int32_t r = 0;
    for (int32_t t = 0; t < n_tok; t++)
        for (int64_t j = 0; j < key_stride; j++) {
            const int64_t at = (int64_t)t * key_stride + j;
            idx[at] = -1;
            if (j >= n_keys[t] || key_idx[at] < 0) continue;
            kv_decode_row(pool + (int64_t)key_idx[at] * rb, dh, n_rot, rows + (int64_t)r * dh);
            idx[at] = r++;
        }
    return cpu_attn(b, q, rows, idx, key_stride, n_keys, max_keys, sink, n_tok, H, dh, scale,
                    round_p, o);
}

// The index scores of index_scores and index_scores_q4: keys as FP32 rows (keys) or as Q4 codes
// (codes: each chunk's keys decoded into the thread's scratch first, then scored the same way:
// every key on its own, so the scores are those of the decoded FP32 keys).
typedef struct index_ctx {
    const cpu_impl *c;
    const float *qi, *wi, *keys;
    const uint8_t *codes; // non-NULL: Q4 keys (keys NULL)
    const int64_t *key_base;
    const int32_t *pages, *page_off;
    int32_t per_page;
    const int32_t *n_vis;
    int32_t n_tok, HI, DI;
    bool round_bf16;
    float *scores;
    int64_t score_stride;
} index_ctx;

static void index_task(void *p, int ith, int nth) {
    const index_ctx *x = p;
    const float **kp = x->c->kp + (size_t)ith * x->c->kp_per_thread;
    float *kd = x->codes ? x->c->ik_rows + (size_t)ith * x->c->ik_per_thread : NULL;
    const int64_t kb = x->codes ? di_backend_code_row_bytes(4, x->DI, DI_BACKEND_KEY_BLOCK) : 0;
    int64_t lo, hi;
    di_split_range(x->n_tok, ith, nth, &lo, &hi);
    for (int64_t t = lo; t < hi; t++) {
        const int64_t base = x->key_base ? x->key_base[t] : 0;
        float *sc = x->scores + t * x->score_stride;
        for (int64_t w0 = 0; w0 < x->n_vis[t]; w0 += KEY_CHUNK) {
            int64_t nk = x->n_vis[t] - w0 < KEY_CHUNK ? x->n_vis[t] - w0 : KEY_CHUNK;
            // Each key scored on its own (vec.h), so a chunk may gather keys from any rows.
            int64_t n_ok = 0;
            for (int64_t w = 0; w < nk; w++) {
                int64_t row = w0 + w;
                if (x->pages) {
                    int32_t pg = x->pages[x->page_off[t] + row / x->per_page];
                    if (pg < 0) {
                        sc[row] = -INFINITY;
                        continue;
                    }
                    row = (int64_t)pg * x->per_page + row % x->per_page;
                }
                if (x->codes) {
                    float *k = kd + n_ok * x->DI;
                    di_quant_q4_unpack(x->codes + (base + row) * kb, x->DI, DI_BACKEND_KEY_BLOCK,
                                       k);
                    kp[n_ok++] = k;
                } else {
                    kp[n_ok++] = x->keys + (base + row) * x->DI;
                }
            }
            if (n_ok == nk) {
                di_cpu_index_scores(x->c->cpu.isa, x->qi + t * x->HI * x->DI, x->wi + t * x->HI,
                                    x->HI, kp, nk, x->DI, sc + w0);
                continue;
            }
            for (int64_t w = 0, j = 0; w < nk; w++) { // entries of negative pages: -inf above
                const int64_t row = w0 + w;
                if (x->pages[x->page_off[t] + row / x->per_page] < 0) continue;
                di_cpu_index_scores(x->c->cpu.isa, x->qi + t * x->HI * x->DI, x->wi + t * x->HI,
                                    x->HI, kp + j++, 1, x->DI, sc + row);
            }
        }
        if (x->round_bf16) round_all(x->scores + t * x->score_stride, x->n_vis[t]);
    }
}

static di_status cpu_index_scores(di_backend *b, const float *qi, const float *wi,
                                  const float *keys, const int64_t *key_base, const int32_t *pages,
                                  const int32_t *page_off, int32_t per_page, const int32_t *n_vis,
                                  int32_t max_vis, int32_t n_tok, int32_t HI, int32_t DI,
                                  bool round_bf16, float *scores, int64_t score_stride) {
    cpu_impl *c = impl_of(b);
    RECORD(c, CMD_INDEX_SCORES, index_scores, qi, wi, keys, key_base, pages, page_off, per_page,
           n_vis, max_vis, n_tok, HI, DI, round_bf16, scores, score_stride);
    if (n_tok <= 0) return DI_OK;
    if (score_stride < max_vis || HI < 1 || DI < 1 || (pages && per_page < 1))
        return DI_ERR_INVALID;
    for (int32_t t = 0; t < n_tok; t++)
        if (n_vis[t] < 0 || n_vis[t] > max_vis) return DI_ERR_INVALID;
    if (grow_scratch(c, KEY_CHUNK, 0) != DI_OK) return DI_ERR_NOMEM;
    index_ctx x = {.c = c,
                   .qi = qi,
                   .wi = wi,
                   .keys = keys,
                   .key_base = key_base,
                   .pages = pages,
                   .page_off = page_off,
                   .per_page = per_page,
                   .n_vis = n_vis,
                   .n_tok = n_tok,
                   .HI = HI,
                   .DI = DI,
                   .round_bf16 = round_bf16,
                   .scores = scores,
                   .score_stride = score_stride};
    di_pool_run(c->pool, index_task, &x);
    return DI_OK;
}

static di_status cpu_topk(di_backend *b, const float *scores, int64_t score_stride,
                          const int32_t *n_vis, int32_t n_tok, int32_t topk, int32_t *sel) {
    RECORD(impl_of(b), CMD_TOPK, topk, scores, score_stride, n_vis, n_tok, topk, sel);
    if (topk < 1) return DI_ERR_INVALID;
    for (int32_t t = 0; t < n_tok; t++) {
        int32_t *s = sel + (int64_t)t * topk;
        for (int32_t i = 0; i < topk; i++) s[i] = -1;
        int32_t vis = n_vis[t], k = vis < topk ? vis : topk;
        if (k == vis) { // every visible entry is selected: no scores needed
            for (int32_t i = 0; i < k; i++) s[i] = i;
            continue;
        }
        di_ref_topk(scores + t * score_stride, vis, k, s);
    }
    return DI_OK;
}

static di_status cpu_offset_list(di_backend *b, const int32_t *sel, int32_t n_tok, int32_t k,
                                 const int32_t *base, const int32_t *off, const int32_t *pages,
                                 const int32_t *page_off, int32_t per_page, int32_t *dst,
                                 int64_t dst_stride) {
    RECORD(impl_of(b), CMD_OFFSET_LIST, offset_list, sel, n_tok, k, base, off, pages, page_off,
           per_page, dst, dst_stride);
    if (k < 0 || (pages && per_page < 1)) return DI_ERR_INVALID;
    for (int32_t t = 0; t < n_tok; t++)
        for (int32_t i = 0; i < k; i++) {
            int32_t s = sel ? sel[(int64_t)t * k + i] : i; // NULL: entry i
            int32_t row = -1;
            if (s >= 0 && !pages) {
                row = base[t] + s;
            } else if (s >= 0) {
                int32_t pg = pages[page_off[t] + s / per_page];
                if (pg >= 0) row = (int32_t)(base[t] + (int64_t)pg * per_page + s % per_page);
            }
            dst[t * dst_stride + off[t] + i] = row;
        }
    return DI_OK;
}

// ---- the official recipe's rounding points (tensor/quant_ref.c) ----

static di_status cpu_round_bf16(di_backend *b, float *x, int64_t n) {
    RECORD(impl_of(b), CMD_ROUND_BF16, round_bf16, x, n);
    round_all(x, n);
    return DI_OK;
}

static di_status cpu_fake_quant(di_backend *b, const float *x, int64_t n_rows, int64_t n,
                                int64_t stride, int32_t block, int32_t bits, float *y) {
    RECORD(impl_of(b), CMD_FAKE_QUANT, fake_quant, x, n_rows, n, stride, block, bits, y);
    if (block < 1 || block > 1024 || n % block != 0 ||
        (bits != 8 && bits != 4 && bits != DI_BACKEND_Q4E) || n > stride)
        return DI_ERR_INVALID;
    for (int64_t r = 0; r < n_rows; r++) {
        float *yr = y + r * stride;
        if (yr != x + r * stride) memcpy(yr, x + r * stride, sizeof(float) * (size_t)n);
        if (bits == 8)
            di_fake_quant_q8(yr, n, block);
        else if (bits == 4)
            di_fake_quant_q4(yr, n, block);
        else
            di_fake_quant_q4e(yr, n, block);
    }
    return DI_OK;
}

static di_status cpu_hadamard(di_backend *b, float *x, int64_t n_rows, int64_t n) {
    RECORD(impl_of(b), CMD_HADAMARD, hadamard, x, n_rows, n);
    if (n < 1 || n > 1024 || (n & (n - 1)) != 0) return DI_ERR_INVALID;
    for (int64_t r = 0; r < n_rows; r++) di_hadamard(x + r * n, n);
    return DI_OK;
}

// ---- V4.1's KV codes (backend.h pack_rows, attn_codes, index_scores_q4) ----

static bool code_fmt_ok(int32_t n_dims, int32_t block, int32_t bits) {
    return block >= 2 && block % 2 == 0 && n_dims >= block && n_dims <= 1024 &&
           n_dims % block == 0 && (bits == 8 || bits == 4 || bits == DI_BACKEND_Q4E);
}

static di_status cpu_pack_rows(di_backend *b, const float *x, int64_t n, int64_t x_stride,
                               int32_t n_dims, int32_t block, int32_t bits, uint8_t *dst,
                               const int32_t *dst_rows, const int32_t *src_rows) {
    cpu_impl *c = impl_of(b);
    RECORD(c, CMD_PACK_ROWS, pack_rows, x, n, x_stride, n_dims, block, bits, dst, dst_rows,
           src_rows);
    if (!code_fmt_ok(n_dims, block, bits)) return DI_ERR_INVALID;
    if (n <= 0) return DI_OK;
    // The packers quantise in place: each row goes through a copy (x is left as it is).
    float v[1024]; // a row's copy: n_dims <= 1024 (code_fmt_ok)
    const int64_t rb = di_backend_code_row_bytes(bits, n_dims, block);
    for (int64_t i = 0; i < n; i++) {
        const int64_t r = dst_rows ? dst_rows[i] : i;
        if (r < 0) continue; // padding, skipped
        const int64_t si = src_rows ? src_rows[i] : i;
        memcpy(v, x + si * x_stride, sizeof(float) * (size_t)n_dims);
        uint8_t *row = dst + r * rb;
        if (bits == 8)
            di_quant_q8_pack(v, n_dims, block, row);
        else if (bits == 4)
            di_quant_q4_pack(v, n_dims, block, row);
        else
            di_quant_q4e_pack(v, n_dims, block, row);
    }
    return DI_OK;
}

// The twin of di_cuda_attn_codes: attn's task on each row's present keys, decoded exactly into
// the thread's scratch (max_keys rows of dh floats a thread, grown once: no allocation that
// depends on a call's rows), so the arithmetic is attn's on those FP32 rows.
static di_status cpu_attn_codes(di_backend *b, const float *q, const uint8_t *win,
                                const uint8_t *ent, const int32_t *key_idx, int64_t key_stride,
                                const int32_t *n_win, const int32_t *n_keys, int32_t max_keys,
                                const float *sink, int32_t n_tok, int32_t H, int32_t dh,
                                float scale, bool round_p, float *o) {
    cpu_impl *c = impl_of(b);
    RECORD(c, CMD_ATTN_CODES, attn_codes, q, win, ent, key_idx, key_stride, n_win, n_keys, max_keys,
           sink, n_tok, H, dh, scale, round_p, o);
    if (n_tok <= 0) return DI_OK;
    if (dh < 32 || dh % 32 != 0 || dh > 1024 || max_keys < 0 || H < 1 || key_stride < max_keys)
        return DI_ERR_INVALID;
    for (int32_t t = 0; t < n_tok; t++)
        if (n_keys[t] < 0 || n_keys[t] > max_keys || n_win[t] < 0 || n_win[t] > n_keys[t])
            return DI_ERR_INVALID;
    const size_t mk = (size_t)max_keys + 1, per = mk * (size_t)dh;
    if (grow_scratch(c, mk, mk * HEAD_GROUP) != DI_OK) {
        DI_LOG_ERROR("cpu backend: cannot allocate attention scratch for %d keys", max_keys);
        return DI_ERR_NOMEM;
    }
    if (per > c->kd_per_thread) {
        float *p = di_aligned_alloc(sizeof(float) * per * (size_t)di_pool_n_threads(c->pool));
        if (!p) {
            DI_LOG_ERROR("cpu backend: cannot allocate the decoded keys of %d keys", max_keys);
            return DI_ERR_NOMEM;
        }
        di_aligned_free(c->kd);
        c->kd = p;
        c->kd_per_thread = per;
    }
    attn_ctx a = {c, q,  NULL,  sink,    key_idx, n_keys, key_stride, n_tok,
                  H, dh, scale, round_p, o,       win,    ent,        n_win};
    di_pool_run(c->pool, attn_task, &a);
    return DI_OK;
}

static di_status cpu_index_scores_q4(di_backend *b, const float *qi, const float *wi,
                                     const uint8_t *keys, const int64_t *key_base,
                                     const int32_t *pages, const int32_t *page_off,
                                     int32_t per_page, const int32_t *n_vis, int32_t max_vis,
                                     int32_t n_tok, int32_t HI, int32_t DI, bool round_bf16,
                                     float *scores, int64_t score_stride) {
    cpu_impl *c = impl_of(b);
    RECORD(c, CMD_INDEX_SCORES_Q4, index_scores_q4, qi, wi, keys, key_base, pages, page_off,
           per_page, n_vis, max_vis, n_tok, HI, DI, round_bf16, scores, score_stride);
    if (n_tok <= 0) return DI_OK;
    if (score_stride < max_vis || HI < 1 || DI < DI_BACKEND_KEY_BLOCK ||
        DI % DI_BACKEND_KEY_BLOCK != 0 || (pages && per_page < 1))
        return DI_ERR_INVALID;
    for (int32_t t = 0; t < n_tok; t++)
        if (n_vis[t] < 0 || n_vis[t] > max_vis) return DI_ERR_INVALID;
    if (grow_scratch(c, KEY_CHUNK, 0) != DI_OK) return DI_ERR_NOMEM;
    const size_t per = (size_t)KEY_CHUNK * (size_t)DI;
    if (per > c->ik_per_thread) {
        float *q = di_aligned_alloc(sizeof(float) * per * (size_t)di_pool_n_threads(c->pool));
        if (!q) return DI_ERR_NOMEM;
        di_aligned_free(c->ik_rows);
        c->ik_rows = q;
        c->ik_per_thread = per;
    }
    index_ctx x = {.c = c,
                   .qi = qi,
                   .wi = wi,
                   .codes = keys,
                   .key_base = key_base,
                   .pages = pages,
                   .page_off = page_off,
                   .per_page = per_page,
                   .n_vis = n_vis,
                   .n_tok = n_tok,
                   .HI = HI,
                   .DI = DI,
                   .round_bf16 = round_bf16,
                   .scores = scores,
                   .score_stride = score_stride};
    di_pool_run(c->pool, index_task, &x);
    return DI_OK;
}

// ---- DeepSeek V4.1 (model/dsv41.c, dsv41_attn.c) ----

static di_status cpu_mhc_pre_carried(di_backend *b, const float *x, const float *mix_raw,
                                     const float *base, const float *scale, int32_t nc, int64_t D,
                                     int32_t n_tok, int32_t iters, float hc_eps, float norm_eps,
                                     const float *pre_in, float *a, float *pre_out, float *post,
                                     float *comb) {
    RECORD(impl_of(b), CMD_MHC_PRE_CARRIED, mhc_pre_carried, x, mix_raw, base, scale, nc, D, n_tok,
           iters, hc_eps, norm_eps, pre_in, a, pre_out, post, comb);
    if (nc < 1 || nc > 16) return DI_ERR_INVALID;
    if (n_tok <= 0) return DI_OK;
    if (mix_raw) {
        mhc_ctx c = {.x = x,
                     .mix_raw = mix_raw,
                     .base = base,
                     .scale = scale,
                     .nc = nc,
                     .n_tok = n_tok,
                     .iters = iters,
                     .D = D,
                     .hc_eps = hc_eps,
                     .norm_eps = norm_eps,
                     .pre = pre_out,
                     .post = post,
                     .comb = comb};
        di_pool_run(impl_of(b)->pool, mhc_pre_task, &c);
    }
    di_ref_hc_collapse(x, pre_in, nc, D, n_tok, a);
    return DI_OK;
}

static di_status cpu_engram_gate(di_backend *b, const float *kv, const float *qk, int32_t nc,
                                 int64_t D, int32_t n_tok, float eps, float *x) {
    RECORD(impl_of(b), CMD_ENGRAM_GATE, engram_gate, kv, qk, nc, D, n_tok, eps, x);
    if (nc < 1 || D < 1) return DI_ERR_INVALID;
    if (n_tok > 0) di_ref_engram_gate(kv, qk, nc, D, n_tok, eps, x);
    return DI_OK;
}

static di_status cpu_index_cand(di_backend *b, int32_t mode, float *scores, int64_t score_stride,
                                const int32_t *n_vis, int32_t n_tok, int32_t bs, int32_t ntb,
                                int32_t *cand, int32_t *n_cand, int32_t *sel, int32_t k,
                                float *work) {
    RECORD(impl_of(b), CMD_INDEX_CAND, index_cand, mode, scores, score_stride, n_vis, n_tok, bs,
           ntb, cand, n_cand, sel, k, work);
    if (bs < 1 || ntb < 1 || k < 1 || mode < DI_BACKEND_CAND_BUILD || mode > DI_BACKEND_CAND_DROP ||
        (mode == DI_BACKEND_CAND_BUILD && !work))
        return DI_ERR_INVALID;
    for (int32_t t = 0; t < n_tok; t++)
        if (n_vis[t] < 0) return DI_ERR_INVALID;
    for (int32_t t = 0; t < n_tok; t++) {
        float *sc = scores + t * score_stride;
        if (mode == DI_BACKEND_CAND_BUILD)
            n_cand[t] = di_ref_cand_build(sc, n_vis[t], bs, ntb, work + t * (score_stride / bs + 1),
                                          cand + (int64_t)t * ntb);
        else if (mode == DI_BACKEND_CAND_MASK)
            di_ref_cand_mask(sc, n_vis[t], bs, cand + (int64_t)t * ntb, n_cand[t]);
        else
            di_ref_cand_drop(sc, sel + (int64_t)t * k, k);
    }
    return DI_OK;
}

// ---- greedy picks (backend.h argmax_rows) ----

typedef struct argmax_ctx {
    const float *x;
    int64_t n_rows, V, stride;
    int32_t *ids;
} argmax_ctx;

static void argmax_task(void *p, int ith, int nth) {
    const argmax_ctx *a = p;
    int64_t lo, hi;
    di_split_range(a->n_rows, ith, nth, &lo, &hi);
    for (int64_t r = lo; r < hi; r++) a->ids[r] = di_ref_argmax(a->x + r * a->stride, a->V);
}

static di_status cpu_argmax_rows(di_backend *b, const float *x, int64_t n_rows, int64_t V,
                                 int64_t stride, int32_t *ids) {
    cpu_impl *c = impl_of(b);
    RECORD(c, CMD_ARGMAX_ROWS, argmax_rows, x, n_rows, V, stride, ids);
    if (V < 1 || V > INT32_MAX || stride < V || n_rows < 0) {
        DI_LOG_ERROR("cpu backend: argmax_rows of %lld rows of %lld values %lld apart",
                     (long long)n_rows, (long long)V, (long long)stride);
        return DI_ERR_INVALID;
    }
    if (n_rows == 0) return DI_OK;
    argmax_ctx a = {.x = x, .n_rows = n_rows, .V = V, .stride = stride, .ids = ids};
    if (n_rows == 1)
        argmax_task(&a, 0, 1); // one row: no pool hand-off
    else
        di_pool_run(c->pool, argmax_task, &a);
    return DI_OK;
}

// ---- graphs ----

static di_status cpu_graph_begin(di_backend *b) {
    cpu_impl *c = impl_of(b);
    ALIVE(c);
    if (c->capturing) {
        DI_LOG_ERROR("cpu backend: graph_begin inside a capture");
        return DI_ERR_INVALID;
    }
    c->capturing = true;
    c->refused = false;
    c->n_rec = 0;
    return DI_OK;
}

static di_status cpu_graph_end(di_backend *b, void **graph) {
    cpu_impl *c = impl_of(b);
    if (!c->capturing) {
        DI_LOG_ERROR("cpu backend: graph_end without a capture");
        return DI_ERR_INVALID;
    }
    c->capturing = false;
    ALIVE(c);                              // the capture is closed either way
    if (c->refused) return DI_ERR_INVALID; // logged where it was refused
    cpu_graph *g = di_calloc(1, sizeof *g);
    if (!g) return DI_ERR_NOMEM;
    if (c->n_rec > 0) {
        g->cmds = di_malloc(sizeof(cmd) * (size_t)c->n_rec);
        if (!g->cmds) {
            di_free(g);
            return DI_ERR_NOMEM;
        }
        memcpy(g->cmds, c->rec, sizeof(cmd) * (size_t)c->n_rec);
    }
    g->n = c->n_rec;
    *graph = g;
    return DI_OK;
}

static di_status replay(di_backend *b, const cmd *k) {
    switch (k->op) {
#define A(m) k->u.m
    case CMD_FREE:
        free(A(free).p);
        return DI_OK;
    case CMD_MEMSET:
        return cpu_memset(b, A(memset).dst, A(memset).value, A(memset).bytes);
    case CMD_COPY:
        return cpu_copy(b, A(copy).dst, A(copy).src, A(copy).bytes);
    case CMD_MATMUL:
        return cpu_matmul(b, &A(matmul).w, A(matmul).x, A(matmul).n_tok, A(matmul).xs, A(matmul).y,
                          A(matmul).ys);
    case CMD_EMBED:
        return cpu_embed(b, &A(embed).table, A(embed).ids, A(embed).n, A(embed).copies, A(embed).x);
    case CMD_RMSNORM:
        return cpu_rmsnorm(b, A(rmsnorm).x, A(rmsnorm).n_rows, A(rmsnorm).n, A(rmsnorm).stride,
                           A(rmsnorm).w, A(rmsnorm).eps);
    case CMD_ROPE:
        return cpu_rope(b, A(rope).x, A(rope).n_rows, A(rope).row_stride, A(rope).n, A(rope).n_rot,
                        A(rope).omega, A(rope).pos, A(rope).rows_per_pos, A(rope).scale,
                        A(rope).inverse);
    case CMD_SCALE:
        return cpu_scale(b, A(scale).x, A(scale).n, A(scale).s);
    case CMD_MHC_PRE:
        return cpu_mhc_pre(b, A(mhc_pre).x, A(mhc_pre).mix_raw, A(mhc_pre).base, A(mhc_pre).scale,
                           A(mhc_pre).nc, A(mhc_pre).D, A(mhc_pre).n_tok, A(mhc_pre).iters,
                           A(mhc_pre).hc_eps, A(mhc_pre).norm_eps, A(mhc_pre).head, A(mhc_pre).a,
                           A(mhc_pre).post, A(mhc_pre).comb);
    case CMD_MHC_POST:
        return cpu_mhc_post(b, A(mhc_post).o, A(mhc_post).x, A(mhc_post).post, A(mhc_post).comb,
                            A(mhc_post).nc, A(mhc_post).D, A(mhc_post).n_tok);
    case CMD_MOE:
        return cpu_moe(b, &A(moe).w, A(moe).f, A(moe).ids, A(moe).n_tok, A(moe).out);
    case CMD_SCATTER_ROWS:
        return cpu_scatter_rows(b, A(scatter_rows).src, A(scatter_rows).n,
                                A(scatter_rows).src_stride, A(scatter_rows).width,
                                A(scatter_rows).dst, A(scatter_rows).dst_stride,
                                A(scatter_rows).dst_rows, A(scatter_rows).src_rows);
    case CMD_ADD_APE:
        return cpu_add_ape(b, A(add_ape).z, A(add_ape).n, A(add_ape).stride, A(add_ape).width,
                           A(add_ape).ape, A(add_ape).pos, A(add_ape).m);
    case CMD_COMPRESS_POOL:
        return cpu_compress_pool(b, A(compress_pool).call_c, A(compress_pool).call_z,
                                 A(compress_pool).call_stride, A(compress_pool).ring_c,
                                 A(compress_pool).ring_z, A(compress_pool).src,
                                 A(compress_pool).n_win, A(compress_pool).m, A(compress_pool).c,
                                 A(compress_pool).d, A(compress_pool).entry);
    case CMD_ATTN:
        return cpu_attn(b, A(attn).q, A(attn).pool, A(attn).key_idx, A(attn).key_stride,
                        A(attn).n_keys, A(attn).max_keys, A(attn).sink, A(attn).n_tok, A(attn).H,
                        A(attn).dh, A(attn).scale, A(attn).round_p, A(attn).o);
    case CMD_KV_QUANT:
        return cpu_kv_quant(b, A(kv_quant).kv, A(kv_quant).n, A(kv_quant).kv_stride, A(kv_quant).dh,
                            A(kv_quant).n_rot, A(kv_quant).pool, A(kv_quant).dst_rows);
    case CMD_ATTN_KV:
        return cpu_attn_kv(b, A(attn_kv).q, A(attn_kv).pool, A(attn_kv).key_idx,
                           A(attn_kv).key_stride, A(attn_kv).n_keys, A(attn_kv).max_keys,
                           A(attn_kv).sink, A(attn_kv).n_tok, A(attn_kv).H, A(attn_kv).dh,
                           A(attn_kv).n_rot, A(attn_kv).scale, A(attn_kv).round_p, A(attn_kv).o);
    case CMD_INDEX_SCORES:
        return cpu_index_scores(
            b, A(index_scores).qi, A(index_scores).wi, A(index_scores).keys,
            A(index_scores).key_base, A(index_scores).pages, A(index_scores).page_off,
            A(index_scores).per_page, A(index_scores).n_vis, A(index_scores).max_vis,
            A(index_scores).n_tok, A(index_scores).HI, A(index_scores).DI,
            A(index_scores).round_bf16, A(index_scores).scores, A(index_scores).score_stride);
    case CMD_ARGMAX_ROWS:
        return cpu_argmax_rows(b, A(argmax_rows).x, A(argmax_rows).n_rows, A(argmax_rows).V,
                               A(argmax_rows).stride, A(argmax_rows).ids);
    case CMD_TOPK:
        return cpu_topk(b, A(topk).scores, A(topk).score_stride, A(topk).n_vis, A(topk).n_tok,
                        A(topk).topk, A(topk).sel);
    case CMD_OFFSET_LIST:
        return cpu_offset_list(b, A(offset_list).sel, A(offset_list).n_tok, A(offset_list).k,
                               A(offset_list).base, A(offset_list).off, A(offset_list).pages,
                               A(offset_list).page_off, A(offset_list).per_page, A(offset_list).dst,
                               A(offset_list).dst_stride);
    case CMD_ROUND_BF16:
        return cpu_round_bf16(b, A(round_bf16).x, A(round_bf16).n);
    case CMD_FAKE_QUANT:
        return cpu_fake_quant(b, A(fake_quant).x, A(fake_quant).n_rows, A(fake_quant).n,
                              A(fake_quant).stride, A(fake_quant).block, A(fake_quant).bits,
                              A(fake_quant).y);
    case CMD_HADAMARD:
        return cpu_hadamard(b, A(hadamard).x, A(hadamard).n_rows, A(hadamard).n);
    case CMD_MHC_PRE_CARRIED:
        return cpu_mhc_pre_carried(
            b, A(mhc_pre_carried).x, A(mhc_pre_carried).mix_raw, A(mhc_pre_carried).base,
            A(mhc_pre_carried).scale, A(mhc_pre_carried).nc, A(mhc_pre_carried).D,
            A(mhc_pre_carried).n_tok, A(mhc_pre_carried).iters, A(mhc_pre_carried).hc_eps,
            A(mhc_pre_carried).norm_eps, A(mhc_pre_carried).pre_in, A(mhc_pre_carried).a,
            A(mhc_pre_carried).pre_out, A(mhc_pre_carried).post, A(mhc_pre_carried).comb);
    case CMD_ENGRAM_GATE:
        return cpu_engram_gate(b, A(engram_gate).kv, A(engram_gate).qk, A(engram_gate).nc,
                               A(engram_gate).D, A(engram_gate).n_tok, A(engram_gate).eps,
                               A(engram_gate).x);
    case CMD_INDEX_CAND:
        return cpu_index_cand(b, A(index_cand).mode, A(index_cand).scores,
                              A(index_cand).score_stride, A(index_cand).n_vis, A(index_cand).n_tok,
                              A(index_cand).bs, A(index_cand).ntb, A(index_cand).cand,
                              A(index_cand).n_cand, A(index_cand).sel, A(index_cand).k,
                              A(index_cand).work);
    case CMD_PACK_ROWS:
        return cpu_pack_rows(b, A(pack_rows).x, A(pack_rows).n, A(pack_rows).x_stride,
                             A(pack_rows).n_dims, A(pack_rows).block, A(pack_rows).bits,
                             A(pack_rows).dst, A(pack_rows).dst_rows, A(pack_rows).src_rows);
    case CMD_ATTN_CODES:
        return cpu_attn_codes(b, A(attn_codes).q, A(attn_codes).win, A(attn_codes).ent,
                              A(attn_codes).key_idx, A(attn_codes).key_stride, A(attn_codes).n_win,
                              A(attn_codes).n_keys, A(attn_codes).max_keys, A(attn_codes).sink,
                              A(attn_codes).n_tok, A(attn_codes).H, A(attn_codes).dh,
                              A(attn_codes).scale, A(attn_codes).round_p, A(attn_codes).o);
    case CMD_INDEX_SCORES_Q4:
        return cpu_index_scores_q4(
            b, A(index_scores_q4).qi, A(index_scores_q4).wi, A(index_scores_q4).keys,
            A(index_scores_q4).key_base, A(index_scores_q4).pages, A(index_scores_q4).page_off,
            A(index_scores_q4).per_page, A(index_scores_q4).n_vis, A(index_scores_q4).max_vis,
            A(index_scores_q4).n_tok, A(index_scores_q4).HI, A(index_scores_q4).DI,
            A(index_scores_q4).round_bf16, A(index_scores_q4).scores,
            A(index_scores_q4).score_stride);
#undef A
    }
    return DI_ERR_INVALID;
}

static di_status cpu_graph_launch(di_backend *b, const void *graph) {
    cpu_impl *c = impl_of(b);
    ALIVE(c);
    if (c->capturing) {
        DI_LOG_ERROR("cpu backend: graph_launch inside a capture");
        c->refused = true;
        return DI_ERR_INVALID;
    }
    const cpu_graph *g = graph;
    if (c->deferred && !c->flushing) { // queued, each command counted (an armed loss) as it is
        for (int64_t i = 0; i < g->n; i++) {
            ALIVE(c); // as each replayed entry counts below
            di_status st = enqueue(c, &g->cmds[i]);
            if (st != DI_OK) return st;
        }
        return DI_OK;
    }
    for (int64_t i = 0; i < g->n; i++) {
        di_status st = replay(b, &g->cmds[i]);
        if (st != DI_OK) {
            DI_LOG_ERROR("cpu backend: graph command %lld (op %d) failed: %s", (long long)i,
                         (int)g->cmds[i].op, di_status_str(st));
            return st;
        }
    }
    return DI_OK;
}

void di_cpu_backend_lose(di_backend *b, int64_t n_ok) {
    DI_ASSERT(b->vt == &cpu_vt);
    cpu_impl *c = impl_of(b);
    if (n_ok < 0) {
        c->lose_in = 0; // disarmed; a lost backend stays lost
        return;
    }
    c->lose_in = n_ok + 1;
}

void di_cpu_backend_set_peer(di_backend *b, bool on) {
    DI_ASSERT(b->vt == &cpu_vt);
    impl_of(b)->no_peer = !on;
}

void di_cpu_backend_set_mem(di_backend *b, size_t free_bytes, size_t total_bytes) {
    DI_ASSERT(b->vt == &cpu_vt);
    impl_of(b)->mem_free = free_bytes;
    impl_of(b)->mem_total = total_bytes;
}

void di_cpu_backend_set_deferred(di_backend *b, bool on) {
    DI_ASSERT(b->vt == &cpu_vt);
    if (!on) (void)flush(b);
    impl_of(b)->deferred = on;
}

bool di_cpu_backend_is_lost(const di_backend *b) {
    return b->vt == &cpu_vt && impl_of(b)->lost;
}

int64_t di_cpu_backend_graph_n_cmds(const void *graph) {
    return ((const cpu_graph *)graph)->n;
}

static void cpu_graph_destroy(di_backend *b, void *graph) {
    (void)b;
    cpu_graph *g = graph;
    if (!g) return;
    di_free(g->cmds);
    di_free(g);
}

// ---- lifetime ----

static void cpu_destroy(di_backend *b) {
    cpu_impl *c = impl_of(b);
    if (c) {
        // The queued frees run; the other queued work is dropped: nothing can read its results,
        // and the host memory it names (a CPU weight is the checkpoint's mapping) may be gone.
        for (int64_t i = 0; i < c->n_q; i++)
            if (c->q[i].op == CMD_FREE) free(c->q[i].u.free.p);
        di_free(c->q);
        di_free(c->rec);
        if (c->cpu_ok) di_cpu_deinit(&c->cpu);
        di_pool_destroy(c->pool);
        di_aligned_free(c->moe_f);
        di_free(c->moe_i);
        di_aligned_free(c->kv_rows);
        di_free(c->kv_idx);
        di_aligned_free(c->ik_rows);
        di_aligned_free(c->kd);
        di_free((void *)c->kp);
        di_aligned_free(c->sc);
        di_free(c);
    }
    di_free(b);
}

static const di_backend_vt cpu_vt = {
    .name = "cpu",
    .alloc = cpu_alloc,
    .free = cpu_free,
    .upload = cpu_upload,
    .download = cpu_download,
    .memset = cpu_memset,
    .copy = cpu_copy,
    .sync = cpu_sync,
    .weight_upload = cpu_weight_upload,
    .supports_matmul = cpu_supports_matmul,
    .can_peer = cpu_can_peer,
    .peer_copy = cpu_peer_copy,
    .mem_info = cpu_mem_info,
    .host_alloc = cpu_alloc, // this backend's memory is host memory
    .host_free = cpu_host_free,
    .matmul = cpu_matmul,
    .matmul_a8 = cpu_matmul_a8,
    .embed = cpu_embed,
    .rmsnorm = cpu_rmsnorm,
    .rope = cpu_rope,
    .scale = cpu_scale,
    .mhc_pre = cpu_mhc_pre,
    .mhc_post = cpu_mhc_post,
    .moe = cpu_moe,
    .scatter_rows = cpu_scatter_rows,
    .add_ape = cpu_add_ape,
    .compress_pool = cpu_compress_pool,
    .attn = cpu_attn,
    .kv_quant = cpu_kv_quant,
    .attn_kv = cpu_attn_kv,
    .index_scores = cpu_index_scores,
    .topk = cpu_topk,
    .offset_list = cpu_offset_list,
    .destroy = cpu_destroy,
    .graph_begin = cpu_graph_begin,
    .graph_end = cpu_graph_end,
    .graph_launch = cpu_graph_launch,
    .graph_destroy = cpu_graph_destroy,
    .round_bf16 = cpu_round_bf16,
    .fake_quant = cpu_fake_quant,
    .hadamard = cpu_hadamard,
    .mhc_pre_carried = cpu_mhc_pre_carried,
    .engram_gate = cpu_engram_gate,
    .index_cand = cpu_index_cand,
    .pack_rows = cpu_pack_rows,
    .attn_codes = cpu_attn_codes,
    .index_scores_q4 = cpu_index_scores_q4,
    .argmax_rows = cpu_argmax_rows,
};

di_status di_cpu_backend_create(int n_threads, di_backend **out) {
    di_backend *b = di_calloc(1, sizeof *b);
    cpu_impl *c = di_calloc(1, sizeof *c);
    if (!b || !c) {
        di_free(b);
        di_free(c);
        return DI_ERR_NOMEM;
    }
    b->vt = &cpu_vt;
    b->device.kind = DI_DEVICE_CPU;
    b->impl = c;
    di_status st = di_pool_create(n_threads, &c->pool);
    if (st == DI_OK) st = ensure_row(c, 256);
    if (st != DI_OK) {
        cpu_destroy(b);
        return st;
    }
    const char *env = getenv("DI_CPU_DEFERRED"); // tests: every CPU backend deferred
    c->deferred = env && env[0] == '1';
    snprintf(b->desc, sizeof b->desc, "cpu (%d threads, %s)", di_pool_n_threads(c->pool),
             di_cpu_isa_name((di_cpu_isa)c->cpu.isa));
    *out = b;
    return DI_OK;
}
