// cuda_ops — the CUDA implementation of the backend vtable (backend/backend.h): a di_backend whose
// impl is a di_cuda context and whose entries are the launchers of backend/cuda/*.cuh.
//
// Every entry that touches the device first makes the context's device current on the calling
// thread (cudaSetDevice, cheap when it already is), as offload.cu does: the thread running the
// forward need not be the thread that created the backend. Shapes a launcher cannot handle are
// refused with DI_ERR_INVALID before any work (the launchers check them first).
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend/backend.h"
#include "backend/cuda/attn.cuh"
#include "backend/cuda/common.cuh"
#include "backend/cuda/gemm.cuh"
#include "backend/cuda/indexer.cuh"
#include "backend/cuda/mhc.cuh"
#include "backend/cuda/moe.cuh"
#include "backend/cuda/norm.cuh"
#include "backend/cuda/quant.cuh"
#include "backend/cuda/rope.cuh"
#include "backend/cuda/rows.cuh"
#include "backend/cuda/sample.cuh"
#include "backend/cuda/v41.cuh"

static_assert(DI_CUDA_POOL_NO_ROW == DI_BACKEND_NO_ROW, "compress_pool's no-row marker");

// The context of b with its device made current on this thread (declares `cu`); a lost device
// (a sticky error seen on it, backend.h DI_ERR_DEVICE_LOST) refuses at once.
#define ENTER(b)                                                                                   \
    di_cuda *cu = (di_cuda *)(b)->impl;                                                            \
    if (di_cuda_lost(cu->device)) return DI_ERR_DEVICE_LOST;                                       \
    CUDA_CHECK(cudaSetDevice(cu->device))

// Entries a capture cannot hold (backend.h graph_begin): refused, and the capture fails, as on
// the CPU twin (which checks the same list).
static di_status refuse(di_cuda *cu, const char *what) {
    DI_CUDA_LOG_ERROR("cuda backend: %s inside a graph capture", what);
    cu->refused = true;
    return DI_ERR_INVALID;
}

#define NOT_CAPTURING(cu, what)                                                                    \
    do {                                                                                           \
        if ((cu)->capturing) return refuse((cu), (what));                                          \
    } while (0)

// ---- memory and copies ----

static di_status op_alloc(di_backend *b, size_t bytes, void **out) {
    ENTER(b);
    NOT_CAPTURING(cu, "alloc");
    return di_cuda_alloc(cu, bytes, out);
}

static void op_free(di_backend *b, void *p) {
    di_cuda *cu = (di_cuda *)b->impl;
    if (cu->capturing) {
        (void)refuse(cu, "free"); // not freed: the capture fails
        return;
    }
    di_cuda_free(cu, p); // host bookkeeping only: no device call
}

static di_status op_upload(di_backend *b, void *dst, const void *src, size_t bytes) {
    ENTER(b);
    NOT_CAPTURING(cu, "upload");
    return bytes ? di_cuda_upload(cu, dst, src, bytes) : DI_OK;
}

static di_status op_download(di_backend *b, void *dst, const void *src, size_t bytes) {
    ENTER(b);
    NOT_CAPTURING(cu, "download");
    return bytes ? di_cuda_download(cu, dst, src, bytes) : DI_OK;
}

static di_status op_memset(di_backend *b, void *dst, int value, size_t bytes) {
    ENTER(b);
    return bytes ? di_cuda_memset(cu, dst, value, bytes) : DI_OK;
}

static di_status op_copy(di_backend *b, void *dst, const void *src, size_t bytes) {
    ENTER(b);
    return bytes ? di_cuda_copy_d2d(cu, dst, src, bytes) : DI_OK;
}

// The pipeline stages' hand-over (backend.h can_peer / peer_copy).
static bool op_can_peer(const di_backend *b, const di_backend *src_b) {
    return src_b->vt == b->vt &&
           di_cuda_can_peer((const di_cuda *)b->impl, (const di_cuda *)src_b->impl);
}

static di_status op_peer_copy(di_backend *b, void *dst, di_backend *src_b, const void *src,
                              size_t bytes) {
    ENTER(b);
    di_cuda *scu = (di_cuda *)src_b->impl;
    if (di_cuda_lost(scu->device)) return DI_ERR_DEVICE_LOST;
    NOT_CAPTURING(cu, "peer_copy");
    NOT_CAPTURING(scu, "peer_copy");
    if (!op_can_peer(b, src_b)) {
        DI_CUDA_LOG_ERROR("cuda backend: peer_copy from device %d to %d without peer access",
                          scu->device, cu->device);
        return DI_ERR_UNSUPPORTED;
    }
    return bytes ? di_cuda_peer_copy(cu, dst, scu, src, bytes) : DI_OK;
}

// Device memory (backend.h mem_info): what the device has free now, for every backend and
// process on it.
static di_status op_mem_info(di_backend *b, size_t *free_bytes, size_t *total_bytes) {
    ENTER(b);
    NOT_CAPTURING(cu, "mem_info");
    size_t fr = 0, tot = 0;
    CUDA_CHECK(cudaMemGetInfo(&fr, &tot));
    *free_bytes = fr;
    *total_bytes = tot;
    return DI_OK;
}

static di_status op_sync(di_backend *b) {
    ENTER(b);
    NOT_CAPTURING(cu, "sync");
    return di_cuda_sync(cu);
}

static di_status op_host_alloc(di_backend *b, size_t bytes, void **out) {
    ENTER(b);
    NOT_CAPTURING(cu, "host_alloc");
    void *p = NULL;
    const cudaError_t e = cudaHostAlloc(&p, bytes ? bytes : 1, cudaHostAllocPortable);
    if (e != cudaSuccess) {
        DI_CUDA_LOG_ERROR("cudaHostAlloc(%zu bytes): %s", bytes, cudaGetErrorString(e));
        if (di_cuda_error(e) == DI_ERR_DEVICE_LOST) return DI_ERR_DEVICE_LOST;
        (void)cudaGetLastError(); // not sticky: clear it
        return DI_ERR_NOMEM;
    }
    *out = p;
    return DI_OK;
}

static void op_host_free(di_backend *b, void *p) {
    di_cuda *cu = (di_cuda *)b->impl;
    if (cu->capturing) { // cudaFreeHost synchronises: not inside a capture, as on the CPU twin
        (void)refuse(cu, "host_free"); // not freed: the capture fails
        return;
    }
    if (!p) return;
    const cudaError_t e = cudaFreeHost(p);
    if (e != cudaSuccess) { // logged and taken: not left for the next launch check
        DI_CUDA_LOG_ERROR("cudaFreeHost(%p): %s", p, cudaGetErrorString(e));
        (void)di_cuda_error_taken(e);
    }
}

static di_status op_weight_upload(di_backend *b, const di_tensor *host, di_tensor *dev) {
    ENTER(b);
    NOT_CAPTURING(cu, "weight_upload");
    return di_cuda_tensor_upload(cu, host, dev);
}

static bool op_supports_matmul(const di_backend *b, const di_tensor *w) {
    return di_cuda_supports_op((const di_cuda *)b->impl, DI_CUDA_OP_MATMUL, w);
}

// ---- ops ----

static di_status op_matmul(di_backend *b, const di_tensor *w, const float *x, int64_t n_tok,
                           int64_t xs, float *y, int64_t ys) {
    ENTER(b);
    if (!di_cuda_supports_op(cu, DI_CUDA_OP_MATMUL, w)) {
        DI_CUDA_LOG_ERROR("matmul: weight %s of kind %d is not supported on the GPU",
                          w->name ? w->name : "?", (int)w->kind);
        return DI_ERR_INVALID;
    }
    return di_cuda_matmul(cu, w, x, n_tok, xs, y, ys);
}

static di_status op_matmul_a8(di_backend *b, const di_tensor *w, const float *x, int64_t n_tok,
                              int64_t xs, float *aq, float *y, int64_t ys) {
    ENTER(b);
    if (!di_cuda_supports_op(cu, DI_CUDA_OP_MATMUL, w)) {
        DI_CUDA_LOG_ERROR("matmul_a8: weight %s of kind %d is not supported on the GPU",
                          w->name ? w->name : "?", (int)w->kind);
        return DI_ERR_INVALID;
    }
    return di_cuda_matmul_a8(cu, w, x, n_tok, xs, aq, y, ys);
}

static di_status op_embed(di_backend *b, const di_tensor *table, const int32_t *ids, int32_t n,
                          int32_t copies, float *x) {
    ENTER(b);
    return di_cuda_embed(cu, table, ids, n, copies, x);
}

static di_status op_rmsnorm(di_backend *b, float *x, int64_t n_rows, int64_t n, int64_t stride,
                            const float *w, float eps) {
    ENTER(b);
    if (n_rows > 0 && n < 1) return DI_ERR_INVALID;
    return di_cuda_rmsnorm(cu, x, n_rows, n, stride, w, eps);
}

static di_status op_rope(di_backend *b, float *x, int64_t n_rows, int64_t row_stride, int64_t n,
                         int32_t n_rot, const float *omega, const int32_t *pos,
                         int32_t rows_per_pos, float scale, bool inverse) {
    ENTER(b);
    if (n_rot < 0 || n_rot % 2 != 0 || n_rot > n || rows_per_pos < 1) return DI_ERR_INVALID;
    return di_cuda_rope(cu, x, n_rows, row_stride, n, n_rot, omega, pos, rows_per_pos, scale,
                        inverse);
}

static di_status op_scale(di_backend *b, float *x, int64_t n, float s) {
    ENTER(b);
    return di_cuda_scale(cu, x, n, s);
}

static di_status op_mhc_pre(di_backend *b, const float *x, const float *mix_raw, const float *base,
                            const float *scale, int32_t nc, int64_t D, int32_t n_tok, int32_t iters,
                            float hc_eps, float norm_eps, bool head, float *a, float *post,
                            float *comb) {
    ENTER(b);
    return di_cuda_mhc_pre(cu, x, mix_raw, base, scale, nc, D, n_tok, iters, hc_eps, norm_eps, head,
                           a, post, comb);
}

static di_status op_mhc_post(di_backend *b, const float *o, float *x, const float *post,
                             const float *comb, int32_t nc, int64_t D, int32_t n_tok) {
    ENTER(b);
    return di_cuda_mhc_post(cu, o, x, post, comb, nc, D, n_tok);
}

static di_status op_moe(di_backend *b, const di_backend_moe_w *w, const float *f,
                        const int32_t *ids, int32_t n_tok, float *out) {
    ENTER(b);
    if (n_tok <= 0) return DI_OK;
    // The expert weights must be GPU kinds (the grouped kernel decodes them in place).
    if (!di_cuda_supports_op(cu, DI_CUDA_OP_MATMUL, &w->gate) ||
        !di_cuda_supports_op(cu, DI_CUDA_OP_MATMUL, &w->sh_w1) ||
        !di_cuda_supports_op(cu, DI_CUDA_OP_MATMUL, &w->sh_w2) ||
        !di_cuda_supports_op(cu, DI_CUDA_OP_MATMUL, &w->sh_w3)) {
        DI_CUDA_LOG_ERROR("moe: a gate or shared-expert weight kind is not supported on the GPU");
        return DI_ERR_INVALID;
    }
    di_cuda_moe_w cw;
    memset(&cw, 0, sizeof cw);
    cw.gate = w->gate;
    cw.gate_bias = w->gate_bias;
    cw.tid2eid = w->tid2eid;
    cw.w1 = w->w1, cw.w2 = w->w2, cw.w3 = w->w3;
    cw.sh_w1 = w->sh_w1, cw.sh_w2 = w->sh_w2, cw.sh_w3 = w->sh_w3;
    cw.n_expert = w->n_expert, cw.n_used = w->n_used;
    cw.D = w->D, cw.F = w->F;
    cw.route_scale = w->route_scale, cw.swiglu_limit = w->swiglu_limit;
    cw.shared_clamp = w->shared_clamp;
    cw.hf_eps = w->hf_eps;
    cw.official = w->official;
    cw.gate_temp = w->gate_temp;
    cw.a8_block = w->a8_block;
    cw.routed_kind = w->routed_kind;
    return di_cuda_moe(cu, &cw, f, ids, n_tok, out, NULL, NULL);
}

static di_status op_scatter_rows(di_backend *b, const float *src, int64_t n, int64_t src_stride,
                                 int64_t width, float *dst, int64_t dst_stride,
                                 const int32_t *dst_rows, const int32_t *src_rows) {
    ENTER(b);
    return di_cuda_scatter_rows(cu, src, n, src_stride, width, dst, dst_stride, dst_rows, src_rows);
}

static di_status op_add_ape(di_backend *b, float *z, int64_t n, int64_t stride, int64_t width,
                            const float *ape, const int32_t *pos, int32_t m) {
    ENTER(b);
    return di_cuda_add_ape(cu, z, n, stride, width, ape, pos, m);
}

static di_status op_compress_pool(di_backend *b, const float *call_c, const float *call_z,
                                  int64_t call_stride, const float *ring_c, const float *ring_z,
                                  const int32_t *src, int32_t n_win, int32_t m, int32_t c,
                                  int32_t d, float *entry) {
    ENTER(b);
    return di_cuda_compress_pool_list(cu, call_c, call_z, call_stride, ring_c, ring_z, src, n_win,
                                      m, c, d, entry);
}

static di_status op_attn(di_backend *b, const float *q, const float *pool, const int32_t *key_idx,
                         int64_t key_stride, const int32_t *n_keys, int32_t max_keys,
                         const float *sink, int32_t n_tok, int32_t H, int32_t dh, float scale,
                         bool round_p, float *o) {
    ENTER(b);
    return di_cuda_attn_f32(cu, q, pool, key_idx, key_stride, n_keys, max_keys, sink, n_tok, H, dh,
                            scale, round_p, o);
}

static di_status op_kv_quant(di_backend *b, const float *kv, int64_t n, int64_t kv_stride,
                             int32_t dh, int32_t n_rot, uint8_t *pool, const int32_t *dst_rows) {
    ENTER(b);
    return di_cuda_kv_quant(cu, kv, n, kv_stride, dh, n_rot, pool, dst_rows);
}

static di_status op_attn_kv(di_backend *b, const float *q, const uint8_t *pool,
                            const int32_t *key_idx, int64_t key_stride, const int32_t *n_keys,
                            int32_t max_keys, const float *sink, int32_t n_tok, int32_t H,
                            int32_t dh, int32_t n_rot, float scale, bool round_p, float *o) {
    ENTER(b);
    return di_cuda_attn_kv_dispatch(cu, q, pool, key_idx, key_stride, n_keys, max_keys, sink, n_tok,
                                    H, dh, n_rot, scale, round_p, o);
}

static di_status op_index_scores(di_backend *b, const float *qi, const float *wi, const float *keys,
                                 const int64_t *key_base, const int32_t *pages,
                                 const int32_t *page_off, int32_t per_page, const int32_t *n_vis,
                                 int32_t max_vis, int32_t n_tok, int32_t HI, int32_t DI,
                                 bool round_bf16, float *scores, int64_t score_stride) {
    ENTER(b);
    return di_cuda_indexer_scores(cu, qi, wi, keys, key_base, pages, page_off, per_page, n_vis,
                                  max_vis, n_tok, HI, DI, round_bf16, scores, score_stride);
}

static di_status op_index_scores_q4(di_backend *b, const float *qi, const float *wi,
                                    const uint8_t *keys, const int64_t *key_base,
                                    const int32_t *pages, const int32_t *page_off, int32_t per_page,
                                    const int32_t *n_vis, int32_t max_vis, int32_t n_tok,
                                    int32_t HI, int32_t DI, bool round_bf16, float *scores,
                                    int64_t score_stride) {
    ENTER(b);
    return di_cuda_indexer_scores_q4(cu, qi, wi, keys, key_base, pages, page_off, per_page, n_vis,
                                     max_vis, n_tok, HI, DI, round_bf16, scores, score_stride);
}

static di_status op_pack_rows(di_backend *b, const float *x, int64_t n, int64_t x_stride,
                              int32_t n_dims, int32_t block, int32_t bits, uint8_t *dst,
                              const int32_t *dst_rows, const int32_t *src_rows) {
    ENTER(b);
    return di_cuda_pack_rows(cu, x, n, x_stride, n_dims, block, bits, dst, dst_rows, src_rows);
}

static di_status op_attn_codes(di_backend *b, const float *q, const uint8_t *win,
                               const uint8_t *ent, const int32_t *key_idx, int64_t key_stride,
                               const int32_t *n_win, const int32_t *n_keys, int32_t max_keys,
                               const float *sink, int32_t n_tok, int32_t H, int32_t dh, float scale,
                               bool round_p, float *o) {
    ENTER(b);
    return di_cuda_attn_codes_dispatch(cu, q, win, ent, key_idx, key_stride, n_win, n_keys,
                                       max_keys, sink, n_tok, H, dh, scale, round_p, o);
}

static di_status op_topk(di_backend *b, const float *scores, int64_t score_stride,
                         const int32_t *n_vis, int32_t n_tok, int32_t topk, int32_t *sel) {
    ENTER(b);
    return di_cuda_topk(cu, scores, score_stride, n_vis, n_tok, topk, sel);
}

static di_status op_offset_list(di_backend *b, const int32_t *sel, int32_t n_tok, int32_t k,
                                const int32_t *base, const int32_t *off, const int32_t *pages,
                                const int32_t *page_off, int32_t per_page, int32_t *dst,
                                int64_t dst_stride) {
    ENTER(b);
    return di_cuda_offset_list(cu, sel, n_tok, k, base, off, pages, page_off, per_page, dst,
                               dst_stride);
}

// ---- the official recipe's rounding points (quant.cuh) ----

static di_status op_round_bf16(di_backend *b, float *x, int64_t n) {
    ENTER(b);
    return di_cuda_round_bf16(cu, x, n);
}

static di_status op_fake_quant(di_backend *b, const float *x, int64_t n_rows, int64_t n,
                               int64_t stride, int32_t block, int32_t bits, float *y) {
    ENTER(b);
    return di_cuda_fake_quant(cu, x, n_rows, n, stride, block, bits, y);
}

// ---- DeepSeek V4.1 (mhc.cuh, v41.cuh) ----

static di_status op_mhc_pre_carried(di_backend *b, const float *x, const float *mix_raw,
                                    const float *base, const float *scale, int32_t nc, int64_t D,
                                    int32_t n_tok, int32_t iters, float hc_eps, float norm_eps,
                                    const float *pre_in, float *a, float *pre_out, float *post,
                                    float *comb) {
    ENTER(b);
    return di_cuda_mhc_pre_carried(cu, x, mix_raw, base, scale, nc, D, n_tok, iters, hc_eps,
                                   norm_eps, pre_in, a, pre_out, post, comb);
}

static di_status op_engram_gate(di_backend *b, const float *kv, const float *qk, int32_t nc,
                                int64_t D, int32_t n_tok, float eps, float *x) {
    ENTER(b);
    return di_cuda_engram_gate(cu, kv, qk, nc, D, n_tok, eps, x);
}

static di_status op_index_cand(di_backend *b, int32_t mode, float *scores, int64_t score_stride,
                               const int32_t *n_vis, int32_t n_tok, int32_t bs, int32_t ntb,
                               int32_t *cand, int32_t *n_cand, int32_t *sel, int32_t k,
                               float *work) {
    ENTER(b);
    return di_cuda_index_cand(cu, mode, scores, score_stride, n_vis, n_tok, bs, ntb, cand, n_cand,
                              sel, k, work);
}

static di_status op_hadamard(di_backend *b, float *x, int64_t n_rows, int64_t n) {
    ENTER(b);
    return di_cuda_hadamard(cu, x, n_rows, n);
}

// ---- greedy picks (sample.cuh) ----

static di_status op_argmax_rows(di_backend *b, const float *x, int64_t n_rows, int64_t V,
                                int64_t stride, int32_t *ids) {
    ENTER(b);
    return di_cuda_argmax_rows(cu, x, n_rows, V, stride, ids);
}

// ---- graphs ----

static di_status op_graph_begin(di_backend *b) {
    ENTER(b);
    if (cu->capturing) {
        DI_CUDA_LOG_ERROR("cuda backend: graph_begin inside a capture");
        return DI_ERR_INVALID;
    }
    return di_cuda_graph_begin(cu);
}

static di_status op_graph_end(di_backend *b, void **graph) {
    ENTER(b);
    if (!cu->capturing) {
        DI_CUDA_LOG_ERROR("cuda backend: graph_end without a capture");
        return DI_ERR_INVALID;
    }
    di_cuda_graph *g = NULL;
    di_status st = di_cuda_graph_end(cu, &g); // closes the capture in every case
    if (st == DI_OK) *graph = g;
    return st;
}

static di_status op_graph_launch(di_backend *b, const void *graph) {
    ENTER(b);
    NOT_CAPTURING(cu, "graph_launch");
    return di_cuda_graph_launch(cu, (const di_cuda_graph *)graph);
}

static void op_graph_destroy(di_backend *b, void *graph) {
    (void)b;
    di_cuda_graph_destroy((di_cuda_graph *)graph);
}

// ---- lifetime ----

static void op_destroy(di_backend *b) {
    if (!b) return;
    di_cuda_destroy((di_cuda *)b->impl); // makes its device current itself
    free(b);
}

static di_backend_vt make_vt(void) {
    di_backend_vt vt;
    memset(&vt, 0, sizeof vt);
    vt.name = "cuda";
    vt.alloc = op_alloc;
    vt.free = op_free;
    vt.upload = op_upload;
    vt.download = op_download;
    vt.memset = op_memset;
    vt.copy = op_copy;
    vt.sync = op_sync;
    vt.weight_upload = op_weight_upload;
    vt.supports_matmul = op_supports_matmul;
    vt.can_peer = op_can_peer;
    vt.peer_copy = op_peer_copy;
    vt.mem_info = op_mem_info;
    vt.host_alloc = op_host_alloc;
    vt.host_free = op_host_free;
    vt.matmul = op_matmul;
    vt.embed = op_embed;
    vt.rmsnorm = op_rmsnorm;
    vt.rope = op_rope;
    vt.scale = op_scale;
    vt.mhc_pre = op_mhc_pre;
    vt.mhc_post = op_mhc_post;
    vt.moe = op_moe;
    vt.scatter_rows = op_scatter_rows;
    vt.add_ape = op_add_ape;
    vt.compress_pool = op_compress_pool;
    vt.attn = op_attn;
    vt.kv_quant = op_kv_quant;
    vt.attn_kv = op_attn_kv;
    vt.index_scores = op_index_scores;
    vt.index_scores_q4 = op_index_scores_q4;
    vt.pack_rows = op_pack_rows;
    vt.attn_codes = op_attn_codes;
    vt.topk = op_topk;
    vt.offset_list = op_offset_list;
    vt.destroy = op_destroy;
    vt.graph_begin = op_graph_begin;
    vt.graph_end = op_graph_end;
    vt.graph_launch = op_graph_launch;
    vt.graph_destroy = op_graph_destroy;
    vt.round_bf16 = op_round_bf16;
    vt.fake_quant = op_fake_quant;
    vt.matmul_a8 = op_matmul_a8;
    vt.hadamard = op_hadamard;
    vt.mhc_pre_carried = op_mhc_pre_carried;
    vt.engram_gate = op_engram_gate;
    vt.index_cand = op_index_cand;
    vt.argmax_rows = op_argmax_rows;
    return vt;
}

// Filled once, before main (a constant: every backend shares it).
static const di_backend_vt k_cuda_vt = make_vt();

extern "C" di_status di_cuda_backend_create(int device, di_backend **out) {
    di_cuda *cu = NULL;
    di_status st = di_cuda_create(device, &cu); // DI_ERR_UNSUPPORTED without that device
    if (st != DI_OK) return st;
    di_backend *b = (di_backend *)calloc(1, sizeof *b);
    if (!b) {
        di_cuda_destroy(cu);
        return DI_ERR_NOMEM;
    }
    b->vt = &k_cuda_vt;
    b->device.kind = DI_DEVICE_CUDA;
    b->device.index = device;
    b->impl = cu;
    char desc[200];
    di_cuda_describe(cu, desc, sizeof desc);
    snprintf(b->desc, sizeof b->desc, "cuda:%d, %s", device, desc);
    *out = b;
    return DI_OK;
}
