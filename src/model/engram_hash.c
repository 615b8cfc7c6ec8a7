// engram_hash — Engram n-gram row ids (spec deepseek-v41.md §2.3.1, App. A.1/A.2).
#include "model/engram_hash.h"

#include <string.h>

#include "base/log.h"

// ---- NumPy's default_rng: SeedSequence -> PCG64 (XSL-RR 128/64) -> bounded integers ----

__extension__ typedef unsigned __int128 u128;

static uint32_t hashmix(uint32_t value, uint32_t *hash_const) {
    value ^= *hash_const;
    *hash_const *= 0x931e8875u; // MULT_A
    value *= *hash_const;
    value ^= value >> 16;
    return value;
}

static uint32_t mix(uint32_t x, uint32_t y) {
    uint32_t r = 0xca01f9ddu * x - 0x4973f715u * y;
    return r ^ (r >> 16);
}

// SeedSequence(seed).generate_state(4, uint64) for a seed below 2^64.
static void seed_sequence_state(uint64_t seed, uint64_t out[4]) {
    uint32_t entropy[2];
    int n_ent = 0;
    if (seed == 0) entropy[n_ent++] = 0;
    while (seed) entropy[n_ent++] = (uint32_t)seed, seed >>= 32;
    uint32_t pool[4], hc = 0x43b0d7e5u; // INIT_A
    for (int i = 0; i < 4; i++) pool[i] = hashmix(i < n_ent ? entropy[i] : 0, &hc);
    for (int s = 0; s < 4; s++)
        for (int d = 0; d < 4; d++)
            if (s != d) pool[d] = mix(pool[d], hashmix(pool[s], &hc));
    uint32_t words[8], hb = 0x8b51f9ddu; // INIT_B
    for (int i = 0; i < 8; i++) {
        uint32_t v = pool[i % 4];
        v ^= hb;
        hb *= 0x58f38dedu; // MULT_B
        v *= hb;
        v ^= v >> 16;
        words[i] = v;
    }
    for (int i = 0; i < 4; i++) out[i] = (uint64_t)words[2 * i] | (uint64_t)words[2 * i + 1] << 32;
}

typedef struct pcg64 {
    u128 state, inc;
} pcg64;

static void pcg_step(pcg64 *r) {
    const u128 mult = ((u128)2549297995355413924ull << 64) | 4865540595714422341ull;
    r->state = r->state * mult + r->inc;
}

static uint64_t pcg_next(pcg64 *r) {
    pcg_step(r);
    uint64_t x = (uint64_t)(r->state >> 64) ^ (uint64_t)r->state;
    unsigned rot = (unsigned)(r->state >> 122);
    return (x >> rot) | (x << ((64 - rot) & 63));
}

void di_engram_numpy_integers(uint64_t seed, int64_t bound, int n, int64_t *out) {
    uint64_t v[4];
    seed_sequence_state(seed, v);
    pcg64 r = {0, (((u128)v[2] << 64 | v[3]) << 1) | 1};
    pcg_step(&r);
    r.state += (u128)v[0] << 64 | v[1];
    pcg_step(&r);
    const uint64_t rng_excl = (uint64_t)bound; // rng = bound - 1; Lemire's method
    DI_ASSERT(rng_excl > 0xFFFFFFFFull);
    for (int i = 0; i < n; i++) {
        u128 m = (u128)pcg_next(&r) * rng_excl;
        uint64_t left = (uint64_t)m;
        if (left < rng_excl) {
            uint64_t threshold = (UINT64_MAX - (rng_excl - 1)) % rng_excl;
            while (left < threshold) {
                m = (u128)pcg_next(&r) * rng_excl;
                left = (uint64_t)m;
            }
        }
        out[i] = (int64_t)(m >> 64);
    }
}

// ---- primes ----

static int is_prime(int64_t n) {
    if (n < 2) return 0;
    if (n % 2 == 0) return n == 2;
    for (int64_t d = 3; d <= n / d; d += 2)
        if (n % d == 0) return 0;
    return 1;
}

di_status di_engram_hash_init(di_engram_hash *h, const di_hparams *hp) {
    memset(h, 0, sizeof *h);
    h->n_layer = hp->n_engram;
    h->max_ngram = hp->engram_max_ngram;
    h->n_head = hp->engram_n_head;
    h->n_col = (hp->engram_max_ngram - 1) * hp->engram_n_head;
    if (h->n_layer == 0) return DI_OK;
    if (h->n_col > DI_ENGRAM_MAX_COLS || h->max_ngram > 8) {
        DI_LOG_ERROR("engram: %d hash columns exceed the supported %d", h->n_col,
                     DI_ENGRAM_MAX_COLS);
        return DI_ERR_FORMAT;
    }
    h->bound = INT64_MAX / hp->engram_cvocab / 2;
    if (h->bound <= (int64_t)0xFFFFFFFF) {
        DI_LOG_ERROR("engram: engram_compressed_vocab_size %lld is too large",
                     (long long)hp->engram_cvocab);
        return DI_ERR_FORMAT;
    }
    // Primes: per layer, per n-gram size, per head: the next prime above the last one handed
    // out for this n-gram size (search from engram_vocab_size - 1), never used before.
    int64_t used[DI_MAX_ENGRAM * DI_ENGRAM_MAX_COLS], last[8];
    int n_used = 0;
    for (int n = 0; n < h->max_ngram - 1; n++) last[n] = hp->engram_vocab - 1;
    for (int L = 0; L < h->n_layer; L++) {
        int64_t off = 0;
        for (int n = 0; n < h->max_ngram - 1; n++) {
            for (int hd = 0; hd < h->n_head; hd++) {
                int64_t p = last[n];
                for (;;) {
                    p++;
                    if (!is_prime(p)) continue;
                    int dup = 0;
                    for (int i = 0; i < n_used && !dup; i++) dup = used[i] == p;
                    if (!dup) break;
                }
                used[n_used++] = p;
                last[n] = p;
                int col = n * h->n_head + hd;
                h->prime[L][col] = p;
                h->offset[L][col] = off;
                off += p;
            }
        }
        h->rows[L] = off;
        if (off != hp->engram_rows[L]) {
            DI_LOG_ERROR("engram: layer %d needs %lld table rows (sum of its primes), but "
                         "engram_num_embeddings[%d] = %lld",
                         hp->engram_layer[L], (long long)off, L, (long long)hp->engram_rows[L]);
            return DI_ERR_FORMAT;
        }
        int64_t u[8];
        di_engram_numpy_integers(10007ull * (uint64_t)hp->engram_layer[L], h->bound, h->max_ngram,
                                 u);
        for (int k = 0; k < h->max_ngram; k++) h->mult[L][k] = 2 * u[k] + 1;
    }
    return DI_OK;
}

void di_engram_hash_rows(const di_engram_hash *h, int L, const int32_t *look, int32_t pad,
                         int64_t *rows) {
    // Cumulative blocking: once a look-back is missing or DEAD, every longer one is padded.
    int64_t tok[8];
    int blocked = 0;
    for (int k = 0; k < h->max_ngram; k++) {
        blocked |= look[k] == DI_ENGRAM_DEAD;
        tok[k] = blocked ? pad : look[k];
    }
    // r = tok_0 M_0 xor tok_1 M_1 xor ...: every product fits in int64 (M < 2^63 / cvocab).
    int64_t r = tok[0] * h->mult[L][0];
    for (int n = 1; n < h->max_ngram; n++) {
        r ^= tok[n] * h->mult[L][n];
        for (int hd = 0; hd < h->n_head; hd++) {
            int col = (n - 1) * h->n_head + hd;
            rows[col] = r % h->prime[L][col] + h->offset[L][col];
        }
    }
}
