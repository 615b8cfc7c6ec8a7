// bench_forward — the PRODUCT path's decode and prefill figures on the GPU: the device-resident
// forward (model/dsv4_dev.h: di_dsv4_dev_create / _state_create / _forward) on the CUDA backend
// (backend/backend.h, di_backend_open), over a synthesized model at every V4-Flash width (hidden
// 4096, 64 heads x 512, q rank 1024, o groups 8 x 1024, 256 FP4 experts top-6 of width 2048, FP8
// attention weights, window 128, CSA (ratio 4, indexer 64 x 128 top-512) and HCA (ratio 128)
// layers alternating, 4 mHC streams, the real 129,280-token vocabulary) but few layers
// (model/synth.h preset "flash-full-<N>l"). Where bench_cuda's `layer` and `model` sections chain
// kernels by hand, this times what `deepinfer generate --device cuda` and the serving engine run.
//
// Steps (each printed as it finishes, so a timeout still leaves the earlier numbers):
//   1. copy: device-to-device copy bandwidth (2 GiB each way, bytes read + written), measured the
//      way bench_cuda's `copy` section does: the HBM ceiling of the roofline figures below;
//   2. synthesis (fast random codes, every core) into a temporary directory (/dev/shm when it has
//      room, else $TMPDIR or /tmp), di_model_load, then the files are unlinked (the mapping keeps
//      them); di_dsv4_dev_create uploads every weight once;
//   3. prefill: one sequence of --prefill tokens (default 512) from position 0, logits of its last
//      row: tokens/s; then (GPU) the same in the official recipe (row `pre-off`: A8 activations,
//      its linears on FP8 tensor cores through matmul_a8, FP8 KV rows) on a second upload of the
//      weights, and its batch-1 decode at --ctx (row `dec-off`: attention on tensor cores where
//      the device has them, attn_kv's di_cuda_attn_kv_dispatch); the rest runs the FP32 recipe;
//   4. decode at batch 1 and batch --batch (default 64): every slot is filled to --ctx positions
//      (default 1024; batch: 8 sequences x 256 rows per call, stopped early at a multiple of 256
//      when --budget would be passed), then timed steps of one token per
//      slot: `decode` rows fetch every slot's logits (the product's step: layers + head + logits
//      download), `layers` rows fetch none (n_logit_rows = 0: the layers alone), whose time per
//      layer is reported;
//   5. one extra untimed batch step with the backend's moe entry wrapped (a copy of the vtable in
//      this process) to count the distinct experts the step's tokens select per layer: the
//      router's score (sqrt(softplus(gate . x)) + bias, top-K) is recomputed on the host from the
//      MoE input and gate downloaded from the device.
// Roofline: the bytes a step must read / the copy bandwidth. Bytes = per layer, every weight the
// step reads (attention projections, mHC fns, compressors, indexer, gate, shared expert) + the
// distinct experts selected x their bytes + KV rows read (FP32 rows of Dh floats: window keys +
// CSA top-k or every HCA entry) + the CSA indexer's entries; plus, for `decode` rows, the head and
// the embedding rows. Activations are not counted.
// Method (.library/device/METHOD.md): CUDA events on the backend's stream around each call (the
// forward returns after its end-of-step sync, so an event pair spans the host work between the
// call's kernels too: the product's step latency), warm-up first, median of the repetitions.
//
// --cpu runs the same steps on the CPU backend (wall clock, no copy figure, no roofline): a smoke
// test of this program's logic on a machine without a GPU, with small --ctx/--batch/--prefill;
// its times mean nothing for the GPU.
// Exit status: 0; 77 when there is no CUDA device (nothing is synthesized); 1 on an error.
#include <cuda_runtime_api.h>
#include <errno.h>
#include <math.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <time.h>
#include <unistd.h>

#include "backend/backend.h"           // di_backend, di_backend_vt
#include "backend/cuda/cuda_backend.h" // di_cuda: the CUDA backend's impl (its stream)
#include "model/dsv4.h"                // di_model internals: the weights, for the byte counts
#include "model/dsv4_dev.h"            // di_dsv4_dev_*
#include "model/synth.h"               // di_synth_preset, di_synth_write
#include "tensor/quant_ref.h"          // di_bf16_to_f32

// ---- plumbing ----

#define CK(call)                                                                                   \
    do {                                                                                           \
        cudaError_t e_ = (call);                                                                   \
        if (e_ != cudaSuccess) {                                                                   \
            fprintf(stderr, "bench_forward: %s:%d: %s: %s\n", __FILE__, __LINE__, #call,           \
                    cudaGetErrorString(e_));                                                       \
            exit(1);                                                                               \
        }                                                                                          \
    } while (0)
#define DK(call)                                                                                   \
    do {                                                                                           \
        di_status s_ = (call);                                                                     \
        if (s_ != DI_OK) {                                                                         \
            fprintf(stderr, "bench_forward: %s:%d: %s: %s\n", __FILE__, __LINE__, #call,           \
                    di_status_str(s_));                                                            \
            cleanup_dir();                                                                         \
            exit(1);                                                                               \
        }                                                                                          \
    } while (0)

typedef struct opts {
    int n_layer, ctx, prefill, batch, steps, reps;
    int budget_s; // stop filling the batch's contexts early to end within this (0: no limit)
    const char *dir;
    bool quick, keep, cpu;
} opts;

static bool g_cpu; // --cpu: the CPU backend, wall-clock times

static char g_dir[4096];   // the temporary model directory, "" when none
static bool g_dir_created; // ours to remove

static void cleanup_dir(void) {
    if (!g_dir[0]) return;
    char p[4200];
    snprintf(p, sizeof p, "%s/model.safetensors", g_dir);
    unlink(p);
    snprintf(p, sizeof p, "%s/config.json", g_dir);
    unlink(p);
    if (g_dir_created) rmdir(g_dir);
    g_dir[0] = 0;
}

static double now_s(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

static int cmp_float(const void *a, const void *b) {
    float x = *(const float *)a, y = *(const float *)b;
    return (x > y) - (x < y);
}

static float median(float *v, int n) {
    qsort(v, (size_t)n, sizeof *v, cmp_float);
    return v[n / 2];
}

static uint64_t g_rng = 0x853c49e6748fea9bull;
static int32_t rand_token(int32_t V) {
    g_rng = g_rng * 6364136223846793005ull + 1442695040888963407ull;
    return (int32_t)((g_rng >> 33) % (uint64_t)V);
}

// ---- copy bandwidth (bench_cuda's `copy` section, same sizes and count) ----

static double copy_gbs(cudaStream_t s, bool quick) {
    const size_t n = (size_t)2 << 30; // 2 GiB each way: far beyond L2
    void *a = NULL, *b = NULL;
    CK(cudaMalloc(&a, n));
    CK(cudaMalloc(&b, n));
    CK(cudaMemsetAsync(a, 0x5a, n, s));
    cudaEvent_t e0, e1;
    CK(cudaEventCreate(&e0));
    CK(cudaEventCreate(&e1));
    const int warm = 2, reps = quick ? 5 : 10;
    float ms[16];
    for (int i = 0; i < warm + reps; i++) {
        CK(cudaEventRecord(e0, s));
        CK(cudaMemcpyAsync(b, a, n, cudaMemcpyDeviceToDevice, s));
        CK(cudaEventRecord(e1, s));
        CK(cudaEventSynchronize(e1));
        if (i >= warm) CK(cudaEventElapsedTime(&ms[i - warm], e0, e1));
    }
    cudaEventDestroy(e0);
    cudaEventDestroy(e1);
    CK(cudaFree(a));
    CK(cudaFree(b));
    const double t = median(ms, reps);
    const double gbs = 2.0 * (double)n / (t * 1e-3) / 1e9;
    printf("%-28s %10.3f ms  %8.0f GB/s (read + write)\n", "d2d 2 GiB", t, gbs);
    return gbs;
}

// ---- the bytes a step must read ----

static double hc_bytes(const di_dsv4_hc_w *hc) {
    return (double)di_tensor_bytes(&hc->fn);
}

// Weights every token of a step reads in layer il, the routed experts excepted.
static double layer_fixed_bytes(const di_model *m, int il) {
    const di_dsv4_layer_w *lw = &m->layers[il];
    double b = hc_bytes(&lw->hc_attn) + hc_bytes(&lw->hc_ffn);
    const di_tensor *t[] = {&lw->wq_a, &lw->wq_b,  &lw->wkv,   &lw->wo_a, &lw->wo_b,
                            &lw->gate, &lw->sh_w1, &lw->sh_w2, &lw->sh_w3};
    for (size_t i = 0; i < sizeof t / sizeof t[0]; i++) b += (double)di_tensor_bytes(t[i]);
    if (lw->ratio > 0)
        b += (double)(di_tensor_bytes(&lw->cmp.wkv) + di_tensor_bytes(&lw->cmp.wgate));
    if (lw->ratio == 4)
        b += (double)(di_tensor_bytes(&lw->idx_cmp.wkv) + di_tensor_bytes(&lw->idx_cmp.wgate) +
                      di_tensor_bytes(&lw->idx_wq_b) + di_tensor_bytes(&lw->idx_weights_proj));
    return b;
}

static double expert_bytes(const di_model *m, int il) {
    const di_dsv4_layer_w *lw = &m->layers[il];
    return (double)(di_tensor_bytes(&lw->w1[0]) + di_tensor_bytes(&lw->w2[0]) +
                    di_tensor_bytes(&lw->w3[0]));
}

// KV and indexer bytes layer il reads for one query at position p (p + 1 positions visible).
// Key bytes one query row reads at position p in layer il: rows of kv_row bytes (FP32 rows of
// head_dim floats in the FP32 recipe, the 584-byte FP8 rows in the official one) plus the CSA
// indexer's keys of key bytes (FP32 rows, or the official recipe's 68-byte Q4 codes).
static double kv_bytes(const di_model *m, int il, int64_t p, double kv_row, double key) {
    const di_hparams *hp = &m->hp;
    const int32_t r = m->layers[il].ratio;
    const int64_t W = hp->window, vis = p + 1;
    int64_t keys = vis < W ? vis : W;
    double b = 0;
    if (r > 0) {
        const int64_t n_ent = vis / r;
        if (r == 4) {
            keys += n_ent < hp->index_topk ? n_ent : hp->index_topk;
            b += (double)n_ent * key; // the indexer scores every entry
        } else {
            keys += n_ent;
        }
    }
    return b + (double)keys * kv_row;
}

static double head_bytes(const di_model *m, int32_t B) {
    return (double)di_tensor_bytes(&m->head) + hc_bytes(&m->hc_head) +
           (double)B * (double)m->embed.nb1;
}

// ---- distinct experts per layer: the moe entry wrapped ----

static const di_backend_vt *g_vt_orig; // the CUDA backend's table
static di_backend_vt g_vt_count;       // a copy whose moe counts first
static int64_t g_hits;                 // distinct experts, summed over the layers counted
static int g_layers_counted;
static bool g_count_failed;

static di_status count_moe(di_backend *b, const di_backend_moe_w *w, const float *f,
                           const int32_t *ids, int32_t n_tok, float *out) {
    const int64_t E = w->n_expert, K = w->n_used, D = w->D;
    float *x = malloc(sizeof(float) * (size_t)(n_tok * D));
    float *g = malloc(sizeof(float) * (size_t)(E * D));
    float *bias = calloc((size_t)E, sizeof(float));
    int32_t *tok = malloc(sizeof(int32_t) * (size_t)n_tok);
    void *raw = malloc(w->gate.nb1 * (size_t)E);
    char *hit = calloc((size_t)E, 1);
    int32_t *t2e = NULL;
    bool ok = x && g && bias && tok && raw && hit &&
              (w->gate.kind == DI_TENSOR_KIND_BF16 || w->gate.kind == DI_TENSOR_KIND_F32);
    ok = ok && g_vt_orig->download(b, x, f, sizeof(float) * (size_t)(n_tok * D)) == DI_OK;
    ok = ok && g_vt_orig->download(b, raw, w->gate.data, w->gate.nb1 * (size_t)E) == DI_OK;
    if (ok && w->gate_bias)
        ok = g_vt_orig->download(b, bias, w->gate_bias, sizeof(float) * (size_t)E) == DI_OK;
    if (ok && w->tid2eid) { // hash routing: the table's row of each token
        t2e = malloc(sizeof(int32_t) * (size_t)(n_tok * K));
        ok = t2e && g_vt_orig->download(b, tok, ids, sizeof(int32_t) * (size_t)n_tok) == DI_OK;
        for (int32_t t = 0; ok && t < n_tok; t++)
            ok = g_vt_orig->download(b, t2e + t * K, w->tid2eid + (int64_t)tok[t] * K,
                                     sizeof(int32_t) * (size_t)K) == DI_OK;
        for (int64_t i = 0; ok && i < n_tok * K; i++)
            if (t2e[i] >= 0 && t2e[i] < E) hit[t2e[i]] = 1;
    } else if (ok) {
        for (int64_t e = 0; e < E; e++)
            for (int64_t i = 0; i < D; i++)
                g[e * D + i] = w->gate.kind == DI_TENSOR_KIND_F32
                                   ? ((const float *)((const char *)raw + e * w->gate.nb1))[i]
                                   : di_bf16_to_f32(((const uint16_t *)((const char *)raw +
                                                                        e * w->gate.nb1))[i]);
        float sc[1024];
        ok = E <= 1024;
        for (int32_t t = 0; ok && t < n_tok; t++) {
            for (int64_t e = 0; e < E; e++) {
                double dot = 0;
                for (int64_t i = 0; i < D; i++) dot += (double)g[e * D + i] * x[t * D + i];
                // sqrtsoftplus score + the selection bias (spec §2.8)
                sc[e] = (float)sqrt(log1p(exp(dot))) + bias[e];
            }
            for (int64_t k = 0; k < K; k++) {
                int64_t best = -1;
                for (int64_t e = 0; e < E; e++)
                    if (sc[e] > -INFINITY && (best < 0 || sc[e] > sc[best])) best = e;
                if (best < 0) break;
                hit[best] = 1;
                sc[best] = -INFINITY;
            }
        }
    }
    if (ok) {
        for (int64_t e = 0; e < E; e++) g_hits += hit[e];
        g_layers_counted++;
    } else {
        g_count_failed = true;
    }
    free(x), free(g), free(bias), free(tok), free(raw), free(hit), free(t2e);
    return g_vt_orig->moe(b, w, f, ids, n_tok, out);
}

// ---- timing the forward ----

typedef struct bench {
    di_model *m;
    di_backend *b;
    cudaStream_t s;
    di_dsv4_dev *d;
    int32_t V;
    float *logits; // host [batch, V]
    cudaEvent_t e0, e1;
} bench;

// One call's milliseconds (CUDA events on the backend's stream around it).
static float timed_forward(bench *x, di_dsv4_dev_state *st, const di_dsv4_dev_seq *seqs, int n_seq,
                           const int32_t *tokens, const int32_t *rows, int n_rows) {
    if (g_cpu) {
        const double t0 = now_s();
        DK(di_dsv4_dev_forward(st, seqs, n_seq, tokens, rows, n_rows, x->logits));
        return (float)((now_s() - t0) * 1e3);
    }
    CK(cudaEventRecord(x->e0, x->s));
    DK(di_dsv4_dev_forward(st, seqs, n_seq, tokens, rows, n_rows, x->logits));
    CK(cudaEventRecord(x->e1, x->s));
    CK(cudaEventSynchronize(x->e1));
    float ms = 0;
    CK(cudaEventElapsedTime(&ms, x->e0, x->e1));
    return ms;
}

// Prefill of one sequence of o->prefill tokens from position 0 on dev d (a 1-slot state of its
// own), logits of the last row: the median of reps timed calls after one untimed, as a row `name`.
static void prefill(bench *x, di_dsv4_dev *d, const opts *o, int32_t n_ctx, int32_t chunk, int reps,
                    const char *name) {
    di_dsv4_dev_state *st = NULL;
    DK(di_dsv4_dev_state_create(d, 1, n_ctx, o->prefill > chunk ? o->prefill : chunk, 0, 0, &st));
    int32_t *tok = malloc(sizeof(int32_t) * (size_t)o->prefill);
    float ms[16];
    if (!tok) exit(1);
    for (int32_t t = 0; t < o->prefill; t++) tok[t] = rand_token(x->V);
    const di_dsv4_dev_seq sq = {.slot = 0, .pos = 0, .n_tok = o->prefill};
    const int32_t last = o->prefill - 1;
    for (int i = 0; i < 1 + reps; i++) {
        float t = timed_forward(x, st, &sq, 1, tok, &last, 1);
        if (i >= 1) ms[i - 1] = t;
    }
    const float med = median(ms, reps);
    printf("%-8s %6d %6d %8s %10.4f %10.1f %9s %9s %9s %8s\n", name, 1, o->prefill, "-", med,
           o->prefill / (med * 1e-3), "-", "-", "-", "-");
    fflush(stdout);
    free(tok);
    di_dsv4_dev_state_destroy(st);
}

// Fills slots [0, B) from position 0 to ctx, chunk rows per sequence, up to max_rows per call,
// one chunk position of every slot after another. When `deadline` (now_s seconds; 0: none) would
// be passed by one more round of the length of the last, stops after a complete round: every slot
// then holds the same *reached positions (< ctx).
static double fill(bench *x, di_dsv4_dev_state *st, int32_t B, int32_t ctx, int32_t chunk,
                   int32_t max_rows, double deadline, int32_t *reached) {
    const int per_call = max_rows / chunk > 0 ? max_rows / chunk : 1;
    di_dsv4_dev_seq *seqs = malloc(sizeof *seqs * (size_t)per_call);
    int32_t *tok = malloc(sizeof(int32_t) * (size_t)max_rows);
    if (!seqs || !tok) exit(1);
    double ms = 0, t_round = 0;
    int32_t p0 = 0;
    for (; p0 < ctx; p0 += chunk) {
        if (deadline > 0 && p0 > 0 && now_s() + t_round > deadline) break;
        const double t0 = now_s();
        const int32_t n = ctx - p0 < chunk ? ctx - p0 : chunk;
        for (int32_t s0 = 0; s0 < B; s0 += per_call) {
            int k = 0, T = 0;
            for (int32_t s = s0; s < B && k < per_call; s++, k++) {
                seqs[k] = (di_dsv4_dev_seq){.slot = s, .pos = p0, .n_tok = n};
                for (int32_t t = 0; t < n; t++) tok[T++] = rand_token(x->V);
            }
            ms += timed_forward(x, st, seqs, k, tok, NULL, 0);
        }
        t_round = now_s() - t0;
    }
    *reached = p0 < ctx ? p0 : ctx;
    free(seqs), free(tok);
    return ms;
}

typedef struct step_fig {
    float ms;        // median per step
    int32_t ctx;     // the first timed step's position
    double n_expert; // distinct experts per layer (measured, or the uniform expectation)
} step_fig;

// warm + reps decode steps of one token in every slot [0, B); logits of every row or none.
static step_fig decode(bench *x, di_dsv4_dev_state *st, int32_t B, int warm, int reps,
                       bool logits) {
    di_dsv4_dev_seq *seqs = malloc(sizeof *seqs * (size_t)B);
    int32_t *tok = malloc(sizeof(int32_t) * (size_t)B), *rows = malloc(sizeof(int32_t) * (size_t)B);
    float *ms = malloc(sizeof(float) * (size_t)reps);
    if (!seqs || !tok || !rows || !ms) exit(1);
    step_fig f = {0};
    for (int i = 0; i < warm + reps; i++) {
        for (int32_t s = 0; s < B; s++) {
            seqs[s] = (di_dsv4_dev_seq){.slot = s, .pos = di_dsv4_dev_n_past(st, s), .n_tok = 1};
            tok[s] = rand_token(x->V);
            rows[s] = s;
        }
        if (i == warm) f.ctx = seqs[0].pos;
        float t = timed_forward(x, st, seqs, B, tok, rows, logits ? B : 0);
        if (i >= warm) ms[i - warm] = t;
    }
    f.ms = median(ms, reps);
    free(seqs), free(tok), free(rows), free(ms);
    return f;
}

// Bytes of one decode step of B sequences at position p, KV rows of kv_row bytes, indexer keys of
// key bytes; with the head when `head`.
static double step_bytes(const di_model *m, int32_t B, int64_t p, double n_expert, bool head,
                         double kv_row, double key) {
    double b = 0;
    for (int il = 0; il < m->hp.n_layer; il++)
        b += layer_fixed_bytes(m, il) + n_expert * expert_bytes(m, il) +
             B * kv_bytes(m, il, p, kv_row, key);
    return b + (head ? head_bytes(m, B) : 0.0);
}

static void print_header(void) {
    printf("%-8s %6s %6s %8s %10s %10s %9s %9s %9s %8s\n", "phase", "batch", "ctx", "experts",
           "ms/step", "tokens/s", "ms/layer", "MB/step", "roof ms", "of roof");
}

static void print_step(const char *phase, const bench *x, int32_t B, const step_fig *f, bool head,
                       double gbs, double kv_row, double key) {
    const int nl = x->m->hp.n_layer;
    const double bytes = step_bytes(x->m, B, f->ctx, f->n_expert, head, kv_row, key);
    const double roof_ms = gbs > 0 ? bytes / (gbs * 1e9) * 1e3 : 0;
    char lay[32] = "-", roof[32] = "-", of[32] = "-";
    if (!head) snprintf(lay, sizeof lay, "%.4f", f->ms / nl);
    if (gbs > 0) {
        snprintf(roof, sizeof roof, "%.4f", roof_ms);
        snprintf(of, sizeof of, "%.1f%%", 100.0 * roof_ms / f->ms);
    }
    printf("%-8s %6d %6d %8.1f %10.4f %10.1f %9s %9.1f %9s %8s\n", phase, B, f->ctx, f->n_expert,
           f->ms, B / (f->ms * 1e-3), lay, bytes / 1e6, roof, of);
    fflush(stdout);
}

// ---- main ----

static bool parse_int(const char *v, int lo, int hi, int *out) {
    char *end = NULL;
    errno = 0;
    long x = strtol(v, &end, 10);
    if (errno || !end || *end || x < lo || x > hi) return false;
    *out = (int)x;
    return true;
}

static void usage(void) {
    fprintf(stderr,
            "usage: bench_forward [--quick] [--layers N (2)] [--ctx N (1024)] [--prefill N (512)]\n"
            "                     [--batch N (64)] [--steps N (20; quick 5)] [--dir DIR] "
            "[--keep] [--cpu]\n"
            "                     [--budget S (0: none): fill the batch's contexts only as far as\n"
            "                      ends the run within S seconds]\n");
}

// A directory for the model: `want` or the first of /dev/shm, $TMPDIR, /tmp with room.
static bool pick_dir(const char *want, double need) {
    if (want) {
        snprintf(g_dir, sizeof g_dir, "%s", want);
        if (mkdir(g_dir, 0755) == 0)
            g_dir_created = true;
        else if (errno != EEXIST)
            return false;
        return true;
    }
    const char *tmp = getenv("TMPDIR");
    const char *cand[] = {"/dev/shm", tmp && *tmp ? tmp : "/tmp", "/tmp"};
    for (size_t i = 0; i < sizeof cand / sizeof cand[0]; i++) {
        struct statvfs v;
        if (statvfs(cand[i], &v) != 0) continue;
        const double avail = (double)v.f_bavail * (double)v.f_frsize;
        if (avail < need * 1.1 + (double)(1u << 30)) continue;
        snprintf(g_dir, sizeof g_dir, "%s/di-bench-forward-XXXXXX", cand[i]);
        if (mkdtemp(g_dir)) {
            g_dir_created = true;
            return true;
        }
    }
    g_dir[0] = 0;
    return false;
}

int main(int argc, char **argv) {
    opts o = {.n_layer = 2, .ctx = 1024, .prefill = 512, .batch = 64, .steps = 0};
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        const char *v = i + 1 < argc ? argv[i + 1] : NULL;
        bool ok = true;
        if (!strcmp(a, "--quick")) {
            o.quick = true;
            continue;
        } else if (!strcmp(a, "--keep")) {
            o.keep = true;
            continue;
        } else if (!strcmp(a, "--cpu")) {
            o.cpu = g_cpu = true;
            continue;
        } else if (!v) {
            ok = false;
        } else if (!strcmp(a, "--layers")) {
            ok = parse_int(v, 1, 64, &o.n_layer);
        } else if (!strcmp(a, "--ctx")) {
            ok = parse_int(v, 1, 1 << 20, &o.ctx);
        } else if (!strcmp(a, "--prefill")) {
            ok = parse_int(v, 1, 1 << 16, &o.prefill);
        } else if (!strcmp(a, "--batch")) {
            ok = parse_int(v, 1, 4096, &o.batch);
        } else if (!strcmp(a, "--budget")) {
            ok = parse_int(v, 0, 1 << 20, &o.budget_s);
        } else if (!strcmp(a, "--steps")) {
            ok = parse_int(v, 1, 1000, &o.steps);
        } else if (!strcmp(a, "--dir")) {
            o.dir = v;
        } else {
            ok = false;
        }
        if (!ok) {
            usage();
            return 2;
        }
        i++;
    }
    if (o.steps == 0) o.steps = o.quick ? 5 : 20;
    const int warm = 2, reps_prefill = o.quick ? 3 : 5;

    // No device: say so before any synthesis (as bench_cuda).
    if (!o.cpu && di_cuda_device_count() == 0) {
        fprintf(stderr, "bench_forward: no CUDA device\n");
        return 77;
    }
    const double t_start = now_s();
    bench x = {0};
    const di_device dev = {.kind = o.cpu ? DI_DEVICE_CPU : DI_DEVICE_CUDA, .index = 0};
    DK(di_backend_open(&dev, 0, &x.b));
    printf("device: %s%s\n", x.b->desc, o.quick ? " (quick)" : "");
    printf("\n== forward: di_dsv4_dev_forward on the %s backend, %d V4-Flash layers "
           "(flash-full-%dl)\n",
           x.b->vt->name, o.n_layer, o.n_layer);
    double gbs = 0;
    if (!o.cpu) {
        x.s = (cudaStream_t)((di_cuda *)x.b->impl)->stream;
        gbs = copy_gbs(x.s, o.quick);
    }
    fflush(stdout);

    // Synthesis, load, upload.
    char preset[32];
    snprintf(preset, sizeof preset, "flash-full-%dl", o.n_layer);
    di_synth_config cfg;
    DK(di_synth_preset(preset, &cfg));
    const double FD = (double)cfg.expert_ff * cfg.n_embd;
    const double need = o.n_layer * (cfg.n_expert * 3.0 * (FD / 2 + FD / 32) + 200e6) +
                        2.0 * 2.0 * cfg.n_vocab * cfg.n_embd;
    if (!pick_dir(o.dir, need)) {
        fprintf(stderr, "bench_forward: no directory with %.1f GB free (/dev/shm, $TMPDIR, /tmp)\n",
                need / 1e9);
        return 1;
    }
    double t0 = now_s();
    DK(di_synth_write(&cfg, g_dir));
    double t1 = now_s();
    printf("synth: %s, %.1f GB in %.1f s (%.1f s per layer incl. the %.1f GB embedding + head) "
           "into %s\n",
           preset, need / 1e9, t1 - t0, (t1 - t0) / o.n_layer, 4.0 * cfg.n_vocab * cfg.n_embd / 1e9,
           g_dir);
    fflush(stdout);
    di_model_options mo = di_model_options_default();
    mo.n_threads = 4; // the CPU forward is not used
    DK(di_model_load(g_dir, &mo, &x.m));
    double t2 = now_s();
    if (!o.keep) cleanup_dir(); // the mapping keeps the data
    DK(di_dsv4_dev_create(x.m, x.b, &x.d));
    double t3 = now_s();
    const double up_gb = o.cpu ? 0 : (double)((di_cuda *)x.b->impl)->weight_bytes / 1e9;
    printf("load: %.1f s; upload (di_dsv4_dev_create): %.1f GB in %.1f s\n", t2 - t1, up_gb,
           t3 - t2);
    x.V = x.m->hp.n_vocab;
    const int32_t B = o.batch;
    { // as the engine: the backend's host memory (page-locked on CUDA)
        void *p = NULL;
        DK(x.b->vt->host_alloc(x.b, sizeof(float) * (size_t)x.V * (size_t)(B > 1 ? B : 1), &p));
        x.logits = p;
    }
    if (!o.cpu) {
        CK(cudaEventCreate(&x.e0));
        CK(cudaEventCreate(&x.e1));
    }
    {
        double fixed = 0, ex = 0;
        for (int il = 0; il < o.n_layer; il++)
            fixed += layer_fixed_bytes(x.m, il), ex += expert_bytes(x.m, il);
        printf("bytes per layer: %.1f MB fixed (attention, mHC, compressors, indexer, gate, "
               "shared), %.2f MB per routed expert; head %.1f MB\n",
               fixed / o.n_layer / 1e6, ex / o.n_layer / 1e6, head_bytes(x.m, 0) / 1e6);
    }
    fflush(stdout);

    const double f32_row = 4.0 * x.m->hp.head_dim;       // the FP32 recipe's KV rows
    const double f32_key = 4.0 * x.m->hp.index_head_dim; // and indexer keys
    // Prefill of one sequence and batch-1 decode on a 1-slot state.
    const int32_t chunk = 512;
    const int32_t n_ctx = (o.ctx > o.prefill ? o.ctx : o.prefill) + 2 * (warm + o.steps) + 8;
    print_header();
    prefill(&x, x.d, &o, n_ctx, chunk, reps_prefill, "prefill");
    if (!o.cpu) { // the official recipe's prefill: its linears on FP8 tensor cores (matmul_a8)
        di_dsv4_dev *d8 = NULL;
        x.m->opt.precision = DI_PRECISION_OFFICIAL; // read by di_dsv4_dev_create alone
        DK(di_dsv4_dev_create(x.m, x.b, &d8));      // a second upload of the weights
        x.m->opt.precision = DI_PRECISION_FP32;
        const di_cuda *cu = (const di_cuda *)x.b->impl;
        const int64_t tc0 = cu->n_fp8_tc_calls;
        prefill(&x, d8, &o, n_ctx, chunk, reps_prefill, "pre-off");
        printf("(pre-off: the official recipe (A8, BF16 rounding points, FP8 KV rows); FP8 tensor "
               "cores %s, %lld linears on them per call)\n",
               cu->fp8_tc > 0   ? "verified and used"
               : cu->fp8_tc < 0 ? "OFF (see the log)"
                                : "unused",
               (long long)((cu->n_fp8_tc_calls - tc0) / (1 + reps_prefill)));
        fflush(stdout);
        // The official recipe's batch-1 decode (row `dec-off`): FP8 KV rows, attention on tensor
        // cores where the device has them (attn_kv: di_cuda_attn_kv_dispatch), A8 + SIMT
        // linears (decode rows stay off cuBLASLt).
        di_dsv4_dev_state *s8 = NULL;
        DK(di_dsv4_dev_state_create(d8, 1, n_ctx, o.prefill > chunk ? o.prefill : chunk, 0, 0,
                                    &s8));
        int32_t reached8 = 0;
        fill(&x, s8, 1, o.ctx, chunk, chunk, 0, &reached8);
        const int64_t at0 = cu->n_attn_tc_calls, aw0 = cu->n_attn_wg_calls;
        step_fig f8 = decode(&x, s8, 1, warm, o.steps, true);
        f8.n_expert = x.m->hp.n_expert_used;
        print_header();
        print_step("dec-off", &x, 1, &f8, true, gbs, (double)di_dsv4_dev_state_kv_row_bytes(s8),
                   (double)di_dsv4_dev_state_index_key_bytes(s8));
        // Two tensor-core kernels: wgmma (cc 9.0, tried first) and mma.sync (its fallback).
        printf("(dec-off: the official recipe's decode; attention on tensor cores wgmma %s / "
               "mma.sync %s, %lld wgmma and %lld mma.sync attention calls per step)\n",
               cu->attn_wg > 0   ? "verified and used"
               : cu->attn_wg < 0 ? "OFF"
                                 : "unused",
               cu->attn_tc > 0   ? "verified and used"
               : cu->attn_tc < 0 ? "OFF (see the log)"
                                 : "unused",
               (long long)((cu->n_attn_wg_calls - aw0) / (warm + o.steps)),
               (long long)((cu->n_attn_tc_calls - at0) / (warm + o.steps)));
        fflush(stdout);
        di_dsv4_dev_state_destroy(s8);
        di_dsv4_dev_destroy(d8);
    }
    di_dsv4_dev_state *s1 = NULL;
    DK(di_dsv4_dev_state_create(x.d, 1, n_ctx, o.prefill > chunk ? o.prefill : chunk, 0, 0, &s1));
    const double n_exp1 = x.m->hp.n_expert_used; // one token: K distinct experts
    int32_t reached = 0;
    fill(&x, s1, 1, o.ctx, chunk, chunk, 0, &reached);
    step_fig f = decode(&x, s1, 1, warm, o.steps, true);
    f.n_expert = n_exp1;
    print_step("decode", &x, 1, &f, true, gbs, f32_row, f32_key);
    f = decode(&x, s1, 1, warm, o.steps, false);
    f.n_expert = n_exp1;
    print_step("layers", &x, 1, &f, false, gbs, f32_row, f32_key);
    di_dsv4_dev_state_destroy(s1);

    // Batch B: fill every slot (8 sequences x 256 rows per call), then decode.
    if (B > 1) {
        const int32_t max_rows = 4 * chunk > B ? 4 * chunk : B;
        di_dsv4_dev_state *sb = NULL;
        DK(di_dsv4_dev_state_create(x.d, B, o.ctx + 2 * (warm + o.steps) + 8, max_rows, 0, 0, &sb));
        // The decode steps after the fill take a few seconds (B = 64: ~1 s of steps, the expert
        // count ~1 s, teardown): the fill stops 10 s before the budget's end.
        // (A budget under 10 s: one round only. 0: no deadline.)
        const double deadline =
            o.budget_s <= 0 ? 0 : (o.budget_s > 10 ? t_start + o.budget_s - 10.0 : 1.0);
        // Rounds of 256 positions (8 sequences per call): a finer stop for the budget.
        const double fill_ms = fill(&x, sb, B, o.ctx, chunk / 2, max_rows, deadline, &reached);
        printf("%-8s %6d %6d %8s %10.1f %10.1f %9s %9s %9s %8s   (%d x %d tokens, %d rows per "
               "call%s)\n",
               "fill", B, reached, "-", fill_ms, (double)B * reached / (fill_ms * 1e-3), "-", "-",
               "-", "-", B, reached, max_rows,
               reached < o.ctx ? "; stopped early for --budget" : "");
        fflush(stdout);
        step_fig fd = decode(&x, sb, B, warm, o.steps, true);
        step_fig fl = decode(&x, sb, B, warm, o.steps, false);
        // The experts this batch's tokens touch: one more (untimed) step through the wrapper.
        g_vt_orig = x.b->vt;
        g_vt_count = *g_vt_orig;
        g_vt_count.moe = count_moe;
        x.b->vt = &g_vt_count;
        {
            // Not through DK: a failure here (e.g. a download refused inside a graph capture of a
            // later forward) costs only the count, not the rows below.
            di_dsv4_dev_seq *sq = malloc(sizeof *sq * (size_t)B);
            int32_t *tk = malloc(sizeof(int32_t) * (size_t)B);
            if (!sq || !tk) return 1;
            for (int32_t i = 0; i < B; i++) {
                sq[i] = (di_dsv4_dev_seq){.slot = i, .pos = di_dsv4_dev_n_past(sb, i), .n_tok = 1};
                tk[i] = rand_token(x.V);
            }
            if (di_dsv4_dev_forward(sb, sq, B, tk, NULL, 0, NULL) != DI_OK) g_count_failed = true;
            free(sq), free(tk);
        }
        x.b->vt = g_vt_orig;
        const int64_t E = x.m->hp.n_expert, K = x.m->hp.n_expert_used;
        double n_exp = E * (1.0 - pow(1.0 - (double)K / (double)E, B)); // uniform expectation
        if (!g_count_failed && g_layers_counted > 0)
            n_exp = (double)g_hits / g_layers_counted;
        else
            printf("(expert count failed: the uniform-routing expectation %.1f is used)\n", n_exp);
        fd.n_expert = fl.n_expert = n_exp;
        print_step("decode", &x, B, &fd, true, gbs, f32_row, f32_key);
        print_step("layers", &x, B, &fl, false, gbs, f32_row, f32_key);
        di_dsv4_dev_state_destroy(sb);
    }
    printf(
        "(decode: a step of one token per slot, every slot's logits downloaded; layers: the\n"
        " same step without logits, ms/layer = its time / %d layers; experts: distinct experts\n"
        " selected per layer; roof ms = bytes the step must read (weights touched + KV rows +\n"
        " CSA index entries [+ head]) / copy %.0f GB/s; of roof = roof ms / ms; %.0f s in all)\n",
        o.n_layer, gbs, now_s() - t_start);
    if (o.cpu) printf("(--cpu: a smoke run on the CPU backend; no copy figure, no roofline)\n");

    if (!o.cpu) {
        cudaEventDestroy(x.e0);
        cudaEventDestroy(x.e1);
    }
    x.b->vt->host_free(x.b, x.logits);
    di_dsv4_dev_destroy(x.d);
    di_model_destroy(x.m);
    di_backend_destroy(x.b);
    if (!o.keep) cleanup_dir();
    return 0;
}
