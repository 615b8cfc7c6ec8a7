// logits_cmp: compares two logit files row by row (bench/cpu/vs_llamacpp_logits.sh). Each file is
// either a float32 .npy [T, vocab] (deepinfer logits --out) or raw little-endian float32
// [T][vocab] (llamacpp_logits); both must hold the same T and vocab.
//
//   logits_cmp REF TEST N_VOCAB [LABEL]
//
// Per position: max |test - ref| / max |ref|, cosine similarity, whether the argmaxes agree and how
// many of the 5 largest logits the two share; then a summary line "summary LABEL: ..." (worst and
// median of each measure) and a sanity verdict: "same model" when the median cosine is >= 0.99 and
// at least half of the argmaxes agree, else "DIFFERENT" (exit status 3). The numbers are reported,
// not gated: the verdict only says whether the two computations are recognisably the same model.
// Medians, because one flipped discrete choice (an indexer top-k or expert selection at a near
// tie) perturbs the positions after it, through the compressed KV, without the models differing.
#include <math.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

enum { TOPK = 5 };
#define COS_SAME 0.99 // median; random-weight logits of two different models have cosine ~0
// Two different models agree on ~1/vocab of the argmaxes; quantisation flips near-ties, in tiny
// random-weight models (top-3 of a few index entries) up to ~20 % of the positions.
#define ARGMAX_SAME 0.5

// Reads a whole file; skips an .npy header (v1: u16 length, v2/3: u32) if there is one.
static float *load(const char *path, int64_t n_vocab, int64_t *n_rows) {
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    fseek(f, 0, SEEK_END);
    long size = ftell(f);
    fseek(f, 0, SEEK_SET);
    unsigned char head[12];
    long skip = 0;
    if (size >= 12 && fread(head, 1, 12, f) == 12 && memcmp(head, "\x93NUMPY", 6) == 0) {
        skip =
            head[6] == 1
                ? 10 + (head[8] | head[9] << 8)
                : 12 + (long)(head[8] | head[9] << 8 | head[10] << 16 | (uint32_t)head[11] << 24);
    }
    long bytes = size - skip;
    if (bytes <= 0 || bytes % (long)(4 * n_vocab)) {
        fclose(f);
        fprintf(stderr, "logits_cmp: %s: %ld bytes of data is not a multiple of %lld floats\n",
                path, bytes, (long long)n_vocab);
        return NULL;
    }
    float *x = malloc((size_t)bytes);
    fseek(f, skip, SEEK_SET);
    if (!x || fread(x, 1, (size_t)bytes, f) != (size_t)bytes) {
        free(x);
        fclose(f);
        return NULL;
    }
    fclose(f);
    *n_rows = bytes / (4 * n_vocab);
    return x;
}

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static void top(const float *x, int64_t n, int64_t *idx) {
    for (int k = 0; k < TOPK; k++) idx[k] = -1;
    for (int64_t v = 0; v < n; v++) {
        int k = TOPK;
        while (k > 0 && (idx[k - 1] < 0 || x[v] > x[idx[k - 1]])) k--;
        if (k == TOPK) continue;
        memmove(idx + k + 1, idx + k, sizeof *idx * (size_t)(TOPK - 1 - k));
        idx[k] = v;
    }
}

int main(int argc, char **argv) {
    if (argc < 4) {
        fprintf(stderr, "usage: logits_cmp REF TEST N_VOCAB [LABEL]\n");
        return 2;
    }
    int64_t n_vocab = atoll(argv[3]), n_ref = 0, n_test = 0;
    const char *label = argc > 4 ? argv[4] : "";
    if (n_vocab < TOPK) {
        fprintf(stderr, "logits_cmp: bad N_VOCAB '%s'\n", argv[3]);
        return 2;
    }
    float *ref = load(argv[1], n_vocab, &n_ref), *test = load(argv[2], n_vocab, &n_test);
    if (!ref || !test || n_ref != n_test) {
        fprintf(stderr, "logits_cmp: cannot compare %s (%lld rows) with %s (%lld rows)\n", argv[1],
                (long long)n_ref, argv[2], (long long)n_test);
        return 2;
    }
    printf("%5s %12s %10s %6s %5s %9s %9s\n", "pos", "maxdiff/max", "cosine", "argmax", "top5",
           "ref max", "test max");
    double worst_rel = 0, min_cos = 1, sum_top = 0;
    double *rels = malloc(sizeof(double) * (size_t)n_ref),
           *coss = malloc(sizeof(double) * (size_t)n_ref);
    if (!rels || !coss) return 2;
    int64_t n_arg = 0;
    for (int64_t t = 0; t < n_ref; t++) {
        const float *a = ref + t * n_vocab, *b = test + t * n_vocab;
        double amax = 0, dmax = 0, dot = 0, na = 0, nb = 0;
        for (int64_t v = 0; v < n_vocab; v++) {
            amax = fmax(amax, fabs(a[v]));
            dmax = fmax(dmax, fabs((double)b[v] - a[v]));
            dot += (double)a[v] * b[v];
            na += (double)a[v] * a[v];
            nb += (double)b[v] * b[v];
        }
        double rel = amax > 0 ? dmax / amax : dmax, cos = dot / (sqrt(na) * sqrt(nb) + 1e-300);
        int64_t ta[TOPK], tb[TOPK];
        top(a, n_vocab, ta);
        top(b, n_vocab, tb);
        int shared = 0;
        for (int i = 0; i < TOPK; i++)
            for (int j = 0; j < TOPK; j++) shared += ta[i] == tb[j];
        bool same_arg = ta[0] == tb[0];
        printf("%5lld %12.3e %10.7f %6s %3d/%d %9.4f %9.4f\n", (long long)t, rel, cos,
               same_arg ? "same" : "DIFF", shared, TOPK, a[ta[0]], b[tb[0]]);
        rels[t] = rel;
        coss[t] = cos;
        worst_rel = fmax(worst_rel, rel);
        min_cos = fmin(min_cos, cos);
        n_arg += same_arg;
        sum_top += shared;
    }
    qsort(rels, (size_t)n_ref, sizeof *rels, cmp_double);
    qsort(coss, (size_t)n_ref, sizeof *coss, cmp_double);
    double med_rel = rels[n_ref / 2], med_cos = coss[n_ref / 2];
    bool same = med_cos >= COS_SAME && (double)n_arg >= ARGMAX_SAME * (double)n_ref;
    printf("summary %s: %lld positions, maxdiff/max median %.3e worst %.3e, cosine median %.7f "
           "min %.7f, argmax %lld/%lld, mean top-5 overlap %.2f/5 -> %s\n",
           label, (long long)n_ref, med_rel, worst_rel, med_cos, min_cos, (long long)n_arg,
           (long long)n_ref, sum_top / (double)n_ref, same ? "same model" : "DIFFERENT");
    free(rels);
    free(coss);
    free(ref);
    free(test);
    return same ? 0 : 3;
}
