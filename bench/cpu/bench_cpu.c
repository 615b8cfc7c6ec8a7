// bench_cpu — CPU roofline benchmark (not a test): in one run, on the same thread pool sizes,
//   1. a STREAM-like read bandwidth (sum of a buffer far larger than the last-level cache);
//   2. di_cpu_matmul GEMV over FP8 / FP4 / BF16 / Q8_0 / Q4_K / MXFP4 matrices larger than the
//      cache: weight bytes per second and the ratio to (1); 64-token GEMM (whole matrix) and
//      512-token GEMM (its first 4096 rows) multiply-adds per second against the FMA peak
//      (probe.h) measured on the same pool;
//   3. at 1 thread, the attention-side kernels (vec.h) at V4-Flash shapes, scalar vs best level;
//   4. with --model: prefill tokens/s and decode tokens/s of a checkpoint, decode's weight bytes
//      per token (counted by di_cpu_matmul) and its roofline ratio = achieved bytes/s / (1).
// Every timing is the best of --reps repetitions (the machine is shared; best-of is the least
// noisy estimate of what the hardware allows). Usage:
//   bench_cpu [--model DIR] [--threads 1,2] [--prompt 64] [--decode 8] [--reps 3] [--bw-mib 1024]
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "backend/cpu/gemm.h"
#include "backend/cpu/probe.h"
#include "backend/cpu/vec.h"
#include "base/mem.h"
#include "base/thread.h"
#include "model/dsv4.h"

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static uint64_t g_rng = 42;
static uint64_t rnd(void) {
    uint64_t z = (g_rng += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

// ---- GEMV over synthetic matrices ----

typedef struct synth_mat {
    di_tensor t;
    uint8_t *data, *scale; // owned
} synth_mat;

static synth_mat make_mat(di_tensor_kind kind, int64_t n_in, int64_t n_out) {
    synth_mat m = {0};
    di_tensor *t = &m.t;
    t->name = "bench";
    t->kind = kind;
    t->ne[0] = n_in;
    t->ne[1] = n_out;
    int64_t be;
    size_t bb;
    bool block = di_tensor_kind_block(kind, &be, &bb); // ggml block kinds (GGUF)
    t->nb1 = block                         ? (size_t)(n_in / be) * bb
             : kind == DI_TENSOR_KIND_FP8  ? (size_t)n_in
             : kind == DI_TENSOR_KIND_FP4  ? (size_t)n_in / 2
             : kind == DI_TENSOR_KIND_BF16 ? (size_t)n_in * 2
                                           : (size_t)n_in * 4;
    size_t bytes = t->nb1 * (size_t)n_out;
    m.data = di_aligned_alloc(bytes);
    for (size_t i = 0; i < bytes; i += 8) {
        uint64_t v = rnd() & 0x3F3F3F3F3F3F3F3Full; // finite, moderate FP8 / BF16 / FP4 codes
        memcpy(m.data + i, &v, bytes - i < 8 ? bytes - i : 8);
    }
    // Block scales (f16 d / dmin) anywhere in the 0x3F-masked bytes are finite: 0x3F3F as f16 is
    // about 1.3. MXFP4 exponents get the range of real weights (2^-10 .. 2^-3): masked bytes
    // (2^-128 .. 2^-65) make d_w * d_x of the 8-bit path subnormal in one block of seven, and
    // subnormal FMA operands cost this CPU about a third of the 64-token GEMM's speed.
    if (kind == DI_TENSOR_KIND_MXFP4)
        for (size_t i = 0; i < bytes; i += 17) m.data[i] = (uint8_t)(118 + rnd() % 8);
    // BF16: high bytes 0x3C..0x3F of either sign (|w| in 2^-7 .. 1, as real weights); masked
    // bytes make one weight in 64 subnormal, and each subnormal FMA operand costs an Intel core a
    // microcode assist (the 64-token GEMM ran at 2 GFLOP/s).
    if (kind == DI_TENSOR_KIND_BF16)
        for (size_t i = 1; i < bytes; i += 2)
            m.data[i] = (uint8_t)((rnd() & 0x80) | (0x3C + rnd() % 4));
    t->data = m.data;
    if (kind == DI_TENSOR_KIND_FP8 || kind == DI_TENSOR_KIND_FP4) {
        t->block_out = kind == DI_TENSOR_KIND_FP8 ? 128 : 1;
        t->block_in = kind == DI_TENSOR_KIND_FP8 ? 128 : 32;
        t->scale_nb1 = (size_t)(n_in / t->block_in);
        size_t sb = t->scale_nb1 * (size_t)((n_out + t->block_out - 1) / t->block_out);
        m.scale = malloc(sb);
        for (size_t i = 0; i < sb; i++) m.scale[i] = (uint8_t)(120 + rnd() % 8);
        t->scale = m.scale;
    }
    return m;
}

static void empty_job(void *ctx, int ith, int nth) {
    (void)ctx, (void)ith, (void)nth;
}

// The pool's hand-off: the time of an empty di_pool_run while the workers poll (back to back),
// and while they sleep (each job after a pause of 5 polling periods, base/thread.h), best of reps.
static void bench_pool(di_pool *pool, int nth, int reps) {
    double hot = 1e30, cold = 1e30;
    for (int r = 0; r < reps; r++) {
        const int n = 20000;
        double t0 = now_s();
        for (int i = 0; i < n; i++) di_pool_run(pool, empty_job, NULL);
        double t = (now_s() - t0) / n;
        if (t < hot) hot = t;
        double sum = 0;
        const int m = 100;
        for (int i = 0; i < m; i++) {
            const struct timespec pause = {0, 5L * DI_POOL_SPIN_NS};
            nanosleep(&pause, NULL);
            double t1 = now_s();
            di_pool_run(pool, empty_job, NULL);
            sum += now_s() - t1;
        }
        if (sum / m < cold) cold = sum / m;
    }
    printf("threads %d: pool hand-off %.2f us per empty job back to back, %.1f us after the "
           "workers fell asleep\n",
           nth, hot * 1e6, cold * 1e6);
}

static void bench_gemv(di_cpu *cpu, double bw, double mac_peak, int reps) {
    // Each matrix is 64 MiB (twice the last-level cache of the development machine).
    static const struct {
        di_tensor_kind kind;
        int64_t n_in, n_out;
    } cases[] = {{DI_TENSOR_KIND_FP8, 4096, 16384},  {DI_TENSOR_KIND_FP4, 4096, 32768},
                 {DI_TENSOR_KIND_BF16, 4096, 8192},  {DI_TENSOR_KIND_Q8_0, 4096, 16384},
                 {DI_TENSOR_KIND_Q4_K, 4096, 32768}, {DI_TENSOR_KIND_MXFP4, 4096, 32768}};
    // The 512-token GEMM multiplies the first 4096 rows only (a quarter to an eighth of the
    // time of the whole matrix): its activations (8 MiB) outgrow L2, as a prefill chunk's do.
    enum { BIG_TOKS = 512, BIG_ROWS = 4096 };
    float *x = di_aligned_alloc(sizeof(float) * 4096 * BIG_TOKS);
    float *y = di_aligned_alloc(sizeof(float) * 32768 * 64);
    for (int i = 0; i < 4096 * BIG_TOKS; i++) x[i] = (float)(rnd() % 1000) / 500.0f - 1.0f;
    for (size_t k = 0; k < sizeof cases / sizeof cases[0]; k++) {
        synth_mat m = make_mat(cases[k].kind, cases[k].n_in, cases[k].n_out);
        double bytes = (double)di_tensor_bytes(&m.t);
        double best = 1e30, best64 = 1e30, best_big = 1e30;
        for (int r = 0; r < reps + 1; r++) {
            double t0 = now_s();
            di_cpu_matmul(cpu, &m.t, x, 1, 4096, y, cases[k].n_out);
            double t = now_s() - t0;
            if (r > 0 && t < best) best = t;
        }
        for (int r = 0; r < 2; r++) {
            double t0 = now_s();
            di_cpu_matmul(cpu, &m.t, x, 64, 4096, y, cases[k].n_out);
            double t = now_s() - t0;
            if (t < best64) best64 = t;
        }
        const di_tensor top = di_tensor_rows(&m.t, 0, BIG_ROWS);
        for (int r = 0; r < 2; r++) {
            double t0 = now_s();
            di_cpu_matmul(cpu, &top, x, BIG_TOKS, 4096, y, BIG_ROWS);
            double t = now_s() - t0;
            if (t < best_big) best_big = t;
        }
        double flops64 = 2.0 * 64 * (double)cases[k].n_in * (double)cases[k].n_out;
        double flops_big = 2.0 * BIG_TOKS * (double)cases[k].n_in * BIG_ROWS;
        printf("  gemv %-15s %5lldx%-5lld %6.1f MiB: %6.2f GB/s = %.2f of read bandwidth; "
               "64 tokens: %6.1f GFLOP/s = %.2f of FMA peak; %d x %d rows: %6.1f = %.2f\n",
               di_tensor_kind_name(cases[k].kind), (long long)cases[k].n_out,
               (long long)cases[k].n_in, bytes / 1048576.0, bytes / best / 1e9, bytes / best / bw,
               flops64 / best64 / 1e9, flops64 / 2 / best64 / mac_peak, BIG_TOKS, BIG_ROWS,
               flops_big / best_big / 1e9, flops_big / 2 / best_big / mac_peak);
        di_aligned_free(m.data);
        free(m.scale);
    }
    di_aligned_free(x);
    di_aligned_free(y);
}

// ---- attention-side kernels (backend/cpu/vec.h), one thread ----

// One token's CSA attention at V4-Flash shapes (64 heads x 512, 128 window + 512 selected keys:
// scores and the weighted sum) and its lightning-indexer scores at context 16384 (64 index heads
// x 128 against 4096 compressed keys), at the scalar level (the reference arithmetic) and the
// best level; multiply-adds per second against one thread's FMA peak.
static void bench_attention(double mac_peak, int reps) {
    enum { H = 64, DH = 512, NK = 640, HI = 64, DI = 128, NI = 4096 };
    float *keys = di_aligned_alloc(sizeof(float) * NK * DH),
          *q = di_aligned_alloc(sizeof(float) * H * DH);
    float *ik = di_aligned_alloc(sizeof(float) * NI * DI),
          *iq = di_aligned_alloc(sizeof(float) * HI * DI);
    float *sc = di_aligned_alloc(sizeof(float) * 8 * NI),
          *o = di_aligned_alloc(sizeof(float) * 8 * DH);
    float w[HI];
    const float *kp[NI];
    for (int i = 0; i < NK * DH; i++) keys[i] = (float)(rnd() % 1000) / 500.0f - 1.0f;
    for (int i = 0; i < H * DH; i++) q[i] = (float)(rnd() % 1000) / 500.0f - 1.0f;
    for (int i = 0; i < NI * DI; i++) ik[i] = (float)(rnd() % 1000) / 500.0f - 1.0f;
    for (int i = 0; i < HI * DI; i++) iq[i] = (float)(rnd() % 1000) / 500.0f - 1.0f;
    for (int i = 0; i < HI; i++) w[i] = (float)(rnd() % 1000) / 1000.0f;
    double best[2][2] = {{1e30, 1e30}, {1e30, 1e30}};
    const int top = (int)di_cpu_isa_detect();
    for (int l = 0; l < 2; l++) {
        int isa = l ? top : DI_CPU_ISA_SCALAR;
        for (int r = 0; r < reps; r++) {
            double t0 = now_s();
            // As di_dsv4_attend_heads: groups of 8 heads share each 64-key block.
            for (int j = 0; j < NK; j++) kp[j] = keys + (int64_t)j * DH;
            for (int h0 = 0; h0 < H; h0 += 8) {
                for (int j0 = 0; j0 < NK; j0 += 64)
                    for (int h = h0; h < h0 + 8; h++)
                        di_cpu_dots(isa, q + h * DH, kp + j0, 64, DH, 0.04f,
                                    sc + (h - h0) * NK + j0);
                for (int j = 0; j < 8 * NK; j++) sc[j] = 1.0f / NK;
                for (int i = 0; i < 8 * DH; i++) o[i] = 0;
                for (int j0 = 0; j0 < NK; j0 += 64)
                    for (int h = 0; h < 8; h++)
                        di_cpu_weighted_sum(isa, sc + h * NK + j0, kp + j0, 64, DH, o + h * DH);
            }
            double t1 = now_s();
            for (int j = 0; j < NI; j++) kp[j] = ik + (int64_t)j * DI;
            di_cpu_index_scores(isa, iq, w, HI, kp, NI, DI, sc);
            double t2 = now_s();
            if (t1 - t0 < best[l][0]) best[l][0] = t1 - t0;
            if (t2 - t1 < best[l][1]) best[l][1] = t2 - t1;
        }
    }
    const double macs[2] = {2.0 * H * NK * DH, (double)HI * NI * DI};
    const char *what[2] = {"CSA attention, 64 heads x 640 keys x 512",
                           "indexer, 64 x 128 vs 4096 keys"};
    for (int k = 0; k < 2; k++)
        printf("  %-42s scalar %7.2f ms, %s %7.2f ms (%.1fx): %.1f G multiply-adds/s = %.2f of "
               "one thread's FMA peak\n",
               what[k], best[0][k] * 1e3, di_cpu_isa_name((di_cpu_isa)top), best[1][k] * 1e3,
               best[0][k] / best[1][k], macs[k] / best[1][k] / 1e9,
               macs[k] / best[1][k] / mac_peak);
    di_aligned_free(keys), di_aligned_free(q), di_aligned_free(ik), di_aligned_free(iq);
    di_aligned_free(sc), di_aligned_free(o);
}

// ---- model ----

static int bench_model(const char *dir, int nth, int n_prompt, int n_decode, int reps, double bw) {
    di_model_options mo = di_model_options_default();
    mo.n_threads = nth;
    di_model *m = NULL;
    if (di_model_load(dir, &mo, &m) != DI_OK) {
        fprintf(stderr, "bench_cpu: cannot load %s\n", dir);
        return 1;
    }
    int32_t V = m->hp.n_vocab;
    float *logits = malloc(sizeof(float) * (size_t)V);
    int32_t *ids = malloc(sizeof(int32_t) * (size_t)n_prompt);
    for (int i = 0; i < n_prompt; i++) ids[i] = (int32_t)(10 + rnd() % (uint64_t)(V - 10));
    double best_prefill = 1e30, best_tok = 1e30, sum_tok = 0;
    double bytes_tok = 0;
    int n_tok_timed = 0;
    for (int r = 0; r < reps; r++) {
        di_session *s = NULL;
        if (di_session_create(m, NULL, &s) != DI_OK) return 1;
        di_forward_out fo = {.logits = logits, .last_only = true};
        double t0 = now_s();
        if (di_session_forward(s, ids, n_prompt, &fo) != DI_OK) return 1;
        double t = now_s() - t0;
        if (t < best_prefill) best_prefill = t;
        for (int i = 0; i < n_decode; i++) {
            int32_t tok = 0;
            for (int32_t v = 1; v < V; v++)
                if (logits[v] > logits[tok]) tok = v;
            uint64_t b0 = m->cpu.n_weight_bytes;
            t0 = now_s();
            if (di_session_forward(s, &tok, 1, &fo) != DI_OK) return 1;
            t = now_s() - t0;
            bytes_tok += (double)(m->cpu.n_weight_bytes - b0);
            sum_tok += t;
            n_tok_timed++;
            if (t < best_tok) best_tok = t;
        }
        di_session_destroy(s);
    }
    bytes_tok /= n_tok_timed;
    double mean_tok = sum_tok / n_tok_timed;
    printf("  model %d thread(s): prefill %d tokens %.2f s = %.2f tokens/s; decode at context %d: "
           "best %.3f s/token (mean %.3f) = %.2f tokens/s\n",
           nth, n_prompt, best_prefill, n_prompt / best_prefill, n_prompt, best_tok, mean_tok,
           1.0 / best_tok);
    printf("  model %d thread(s): decode reads %.1f MiB of weights per token: %.2f GB/s = roofline "
           "ratio %.2f (mean-time ratio %.2f)\n",
           nth, bytes_tok / 1048576.0, bytes_tok / best_tok / 1e9, bytes_tok / best_tok / bw,
           bytes_tok / mean_tok / bw);
    free(logits);
    free(ids);
    di_model_destroy(m);
    return 0;
}

int main(int argc, char **argv) {
    const char *model = NULL, *threads = "1,2";
    int n_prompt = 64, n_decode = 8, reps = 3;
    long bw_mib = 1024;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!v) {
            fprintf(stderr, "bench_cpu: %s needs a value\n", a);
            return 2;
        }
        i++;
        if (!strcmp(a, "--model"))
            model = v;
        else if (!strcmp(a, "--threads"))
            threads = v;
        else if (!strcmp(a, "--prompt"))
            n_prompt = atoi(v);
        else if (!strcmp(a, "--decode"))
            n_decode = atoi(v);
        else if (!strcmp(a, "--reps"))
            reps = atoi(v);
        else if (!strcmp(a, "--bw-mib"))
            bw_mib = atol(v);
        else {
            fprintf(stderr, "bench_cpu: unknown option %s\n", a);
            return 2;
        }
    }
    if (n_prompt < 1 || n_decode < 1 || reps < 1 || bw_mib < 64) {
        fprintf(stderr, "bench_cpu: bad arguments\n");
        return 2;
    }
    const size_t bw_bytes = (size_t)bw_mib << 20;
    printf("level %s (DI_CPU_ISA lowers it)\n", di_cpu_isa_name(di_cpu_isa_detect()));
    for (const char *p = threads; *p;) {
        int nth = atoi(p);
        di_pool *pool = NULL;
        if (nth < 1 || di_pool_create(nth, &pool) != DI_OK) return 2;
        double bw = di_probe_read_bw(pool, bw_bytes, reps);
        if (bw <= 0) return 1;
        printf("threads %d: read bandwidth %.2f GB/s (%ld MiB buffer)\n", nth, bw / 1e9, bw_mib);
        di_cpu cpu;
        if (di_cpu_init(&cpu, pool, 4096) != DI_OK) return 1;
        double mac = di_probe_fma_peak(pool, (di_cpu_isa)cpu.isa, reps);
        printf("threads %d: FMA peak %.2f G multiply-adds/s (%s)\n", nth, mac / 1e9,
               di_cpu_isa_name((di_cpu_isa)cpu.isa));
        if (nth > 1) bench_pool(pool, nth, reps);
        bench_gemv(&cpu, bw, mac, reps);
        if (nth == 1) bench_attention(mac, reps); // one row's attention runs on one thread
        di_cpu_deinit(&cpu);
        di_pool_destroy(pool);
        if (model && bench_model(model, nth, n_prompt, n_decode, reps, bw)) return 1;
        // Bandwidth again after the model, to show the drift of a shared machine.
        di_pool_create(nth, &pool);
        printf("threads %d: read bandwidth after: %.2f GB/s\n", nth,
               di_probe_read_bw(pool, bw_bytes, reps) / 1e9);
        di_pool_destroy(pool);
        while (*p && *p != ',') p++;
        if (*p == ',') p++;
    }
    return 0;
}
