// The device-resident forward (model/dsv4_dev.h) on the CPU backend against the model's own CPU
// forward (di_session_forward) fed the same chunks: it runs the same kernels, so any difference
// is the orchestration's (state layout, key lists, compressor windows and overlap, rings).
//   (a) one sequence, prefill chunks straddling window / ratio boundaries then decodes, on the
//       tiny-128 synthetic model (SWA / CSA m=4 / HCA m=128) and the committed hca128 fixture in
//       both layouts; then every CSA indexer key its entry blocks hold (read_block) equals its
//       session's key bit for bit;
//   (b) a ragged batch of 3 slots at different positions in one call, each vs its own session;
//   (c) a slot restarted at position 0 inside a batch;
//   (d) bad calls refused with DI_ERR_INVALID and no change of state;
//   (e) the product wiring: di_dsv4_dev_attach, then plain sessions (chunked internally, save
//       refused) against a model without it;
//   (f) decode graphs: a long ragged decode of 3 and 2 slots (every ratio's windows closing, the
//       sliding window wrapping, a slot restarted inside a decode batch) on a state with graphs
//       and on one with DI_DEV_GRAPHS=0: bit-identical logits, both equal to the sessions, and the
//       graphs actually replayed (stats);
//   (g) what a decode step costs (issue #7): ops enqueued (= the commands the CPU backend records
//       in its graph), uploads and bytes at 1, 3, 16 sequences on tiny-128 and 1, 64 on flash-4l's
//       shapes scaled down, with private and with shared blocks: the ops must not grow with the
//       sequences (shared blocks add exactly one: the page table's scatter), and a call uploads
//       once;
//   (h) the official precision recipe (R-OFF; KV pools of FP8 KV rows and indexer keys of Q4
//       codes, 68 bytes at 128 dims, asserted by their bytes per row and an entry block's bytes;
//       (a)'s keys decoded exactly): (a), (b, c), (e) and (f) again on models loaded
//       with DI_PRECISION_OFFICIAL (tiny-128 in the official layout: FP8 / FP4 weights, A8, CSA's
//       indexer with Hadamard + Q4; the hca128 fixture in both layouts): every BF16 rounding and
//       fake quantisation of the CPU forward is an op of the dev forward, so the logits are
//       bit-identical too (dropping any one rounding point breaks that: checked by hand);
//   (i) what the dev forward refuses: DeepSeek V4.1;
//   (j) prefix reuse on shared entry blocks: a second slot attached to the first slot's full
//       blocks replays from Q = max(0, H - n_layer (W - 1)) with win_lo = Q and continues
//       bit-identically to the cold prefill (then both decode on the shared blocks with identical
//       logits); a third attached to one block recomputes from 0 (win_lo 0) and matches too; the
//       cached blocks' device bytes are unchanged; bad block lists and replay parameters are
//       refused without changing anything;
//   (k) tail snapshots: a slot's tail saved at block boundaries and restored into other slots (and
//       into itself after another sequence) continues bit-identically, decode graphs included;
//   (l) the MTP block and rollback, both recipes (at test_mtp);
//   (m) pipeline stages (dsv4_dev.h "Pipeline stages"; `test_dev_forward --stages`, its own ctest
//       entry): (a)-(l) but (g) again with the forward split into 2 stages on as many CPU
//       backends, and (a) on tiny-128, (b)-(d), (f), (j)-(l) with 3 stages: every logit
//       bit-identical (memcmp) to the sessions' CPU forward and to a 1-stage forward fed the same
//       calls beside it (run_step), entry blocks' bytes equal to the 1-stage state's (test_prefix),
//       tail snapshots of the same size restored across states; every call's hand-overs counted
//       by kind (2 stages: the peer copy; 3: one boundary peer, the other through the host
//       bounce, the last CPU backend refusing peer copies) and bytes; the split itself
//       (test_split): balanced weight bytes, at least one layer per stage, more stages than layers
//       refused.
// Every state of (a)-(d), (f), (h) and (j) has shared entry blocks listed per call in a shuffled,
// non-contiguous order (a restarted slot moves to other blocks); (e)'s sessions use private ones.
// --deferred: the one-sequence, ragged, graph, prefix, tail and MTP scenarios on CPU backends in
// deferred mode (backend.h di_cpu_backend_set_deferred), on 1 then 3 stages: the same bits, so the
// host code syncs wherever the CUDA backend's asynchrony needs it.
#include "harness.h"

#include <math.h>
#include <stdlib.h>

#include "backend/backend.h"
#include "kv/kv_manager.h" // di_kv_block_tokens
#include "model/dsv4.h"
#include "model/dsv4_dev.h"
#include "model/synth.h"
#include "sample/sampler.h"   // di_argmax: what a greedy row's pick must be
#include "tensor/quant_ref.h" // di_quant_q4_unpack: the official recipe's index key codes

// Both sides run the same kernels in the same order on the same rows, so the logits should be
// bit-identical; the bound leaves room only for a reordered sum somewhere (~1e-7 relative per op),
// far below what a wrong key, window slot or ring row does (~1e-2 and more).
#define TOL_DEV 1e-5

enum { V_SYNTH = 512, N_SLOTS = 3, N_CTX = 320, MAX_ROWS = 96 };
// Entry blocks of the harness's states: tiny-128's ratios 4 and 128 and window 16 give blocks of
// 128 positions, so N_CTX takes 3 per slot; the state has one spare set for restarts.
enum { BT = 128, MAXB = (N_CTX + BT - 1) / BT, N_BLK = (N_SLOTS + 1) * MAXB };

static char g_dir[256];
// The precision recipe every model of the harness is loaded with ((h) runs under OFFICIAL).
static di_precision g_prec = DI_PRECISION_FP32;
// Pipeline stages of every dev forward the tests create ((m): 2 and 3 with --stages), each on a
// CPU backend of its own.
enum { MAX_STAGES = 3 };
static int32_t g_stages = 1;

// g_stages CPU backends of n_threads threads into bs (NULLs past them) and m's dev forward on
// them; false (bs cleaned up by free_backends) on failure.
static bool make_dev(di_model *m, int n_threads, di_backend *bs[MAX_STAGES], di_dsv4_dev **d) {
    memset(bs, 0, sizeof(di_backend *) * MAX_STAGES);
    for (int32_t k = 0; k < g_stages; k++)
        if (di_cpu_backend_create(n_threads, &bs[k]) != DI_OK) return false;
    // 3 stages: the last backend copies nothing directly, so the second boundary hands over
    // through the host bounce (as between GPUs without peer access), the first one directly.
    if (g_stages == 3) di_cpu_backend_set_peer(bs[2], false);
    if (d && di_dsv4_dev_create_stages(m, bs, g_stages, d) != DI_OK) return false;
    if (d) CHECK_EQ(di_dsv4_dev_n_stages(*d), g_stages);
    return true;
}

static void free_backends(di_backend *bs[MAX_STAGES]) {
    for (int32_t k = 0; k < MAX_STAGES; k++) di_backend_destroy(bs[k]);
}

static int32_t token_of(int slot, int gen, int32_t pos, int32_t V) {
    return (int32_t)((slot * 131 + gen * 71 + pos * 97 + 7) % V);
}

typedef struct harness_ctx {
    di_model *m;
    di_backend *b[MAX_STAGES];
    di_dsv4_dev *d;
    di_dsv4_dev_state *st;
    di_dsv4_dev_state *st2; // NULL, or a second state fed the same calls (logits bit-identical)
    // With stages (g_stages > 1): a 1-stage forward and state fed the same calls as st (run_step:
    // logits bit-identical).
    di_backend *b1;
    di_dsv4_dev *d1;
    di_dsv4_dev_state *st1;
    di_session *ses[N_SLOTS];
    int gen[N_SLOTS]; // token stream of each slot (changes at a restart)
    // Shared entry blocks: each slot's block ids (a shuffled, non-contiguous set), and a spare
    // set a restarted slot swaps its own with (so its page table changes).
    int32_t blk[N_SLOTS][MAXB], spare[MAXB];
    int32_t V;
    float *got, *got2, *ref;
    double max_diff, max_ref;
    int64_t rows;
    // (n) greedy picks: run_step runs st through di_dsv4_dev_forward_picks with every third logit
    // row (shifting by call) greedy; n_calls counts the calls, n_picked the picks checked.
    bool picks;
    int64_t n_calls, n_picked;
} harness_ctx;

// Block ids 0..N_BLK-1 in a fixed shuffled order, MAXB per slot, then the spare set.
static void shuffle_blocks(harness_ctx *h) {
    int32_t ids[N_BLK];
    uint32_t x = 12345;
    for (int32_t i = 0; i < N_BLK; i++) ids[i] = i;
    for (int32_t i = N_BLK - 1; i > 0; i--) {
        x = x * 1103515245u + 12345u;
        int32_t j = (int32_t)((x >> 8) % (uint32_t)(i + 1)), t = ids[i];
        ids[i] = ids[j], ids[j] = t;
    }
    for (int s = 0; s < N_SLOTS; s++) memcpy(h->blk[s], ids + s * MAXB, sizeof h->blk[s]);
    memcpy(h->spare, ids + N_SLOTS * MAXB, sizeof h->spare);
}

static bool open_ctx(harness_ctx *h, const char *dir) {
    memset(h, 0, sizeof *h);
    di_model_options mo = di_model_options_default();
    mo.n_threads = 2;
    mo.precision = g_prec;
    if (di_model_load(dir, &mo, &h->m) != DI_OK) return false;
    h->V = h->m->hp.n_vocab;
    CHECK(make_dev(h->m, 2, h->b, &h->d));
    if (!h->d) return false;
    CHECK_EQ(di_dsv4_dev_block_tokens(h->d), BT);
    CHECK(di_dsv4_dev_state_create(h->d, N_SLOTS, N_CTX, MAX_ROWS, N_BLK, BT, &h->st) == DI_OK);
    if (g_stages > 1) {
        CHECK(di_cpu_backend_create(2, &h->b1) == DI_OK);
        CHECK(di_dsv4_dev_create(h->m, h->b1, &h->d1) == DI_OK);
        if (!h->d1) return false;
        CHECK(di_dsv4_dev_state_create(h->d1, N_SLOTS, N_CTX, MAX_ROWS, N_BLK, BT, &h->st1) ==
              DI_OK);
        if (!h->st1) return false;
    }
    shuffle_blocks(h);
    // The KV pools' format: FP32 rows, or (official recipe) the FP8 KV rows, which the
    // comparisons below show lossless (bit-identical logits).
    const di_hparams *hp = &h->m->hp;
    if (h->st)
        CHECK_EQ(di_dsv4_dev_state_kv_row_bytes(h->st),
                 g_prec == DI_PRECISION_OFFICIAL
                     ? di_backend_kv_row_bytes(hp->head_dim, hp->rope_main.n_dims)
                     : (int64_t)sizeof(float) * hp->head_dim);
    if (h->st && g_prec == DI_PRECISION_OFFICIAL)
        CHECK(di_dsv4_dev_state_kv_row_bytes(h->st) < (int64_t)sizeof(float) * hp->head_dim);
    // ... and the indexer's keys: FP32 rows, or (official) their Q4 codes (68 bytes at 128 dims);
    // an entry block is every compressing layer's E entry rows and CSA's E keys.
    if (h->st) {
        const int64_t kb = di_dsv4_dev_state_index_key_bytes(h->st);
        CHECK_EQ(kb, g_prec == DI_PRECISION_OFFICIAL
                         ? di_backend_code_row_bytes(4, hp->index_head_dim, DI_BACKEND_KEY_BLOCK)
                         : (int64_t)sizeof(float) * hp->index_head_dim);
        if (g_prec == DI_PRECISION_OFFICIAL && hp->index_head_dim == 128) CHECK_EQ(kb, 68);
        int64_t want = 0, bb = 0, sb = 0;
        for (int il = 0; il < hp->n_layer; il++) {
            const int32_t r = h->m->layers[il].ratio;
            if (r > 0) want += BT / r * (di_dsv4_dev_state_kv_row_bytes(h->st) + (r == 4 ? kb : 0));
        }
        CHECK_EQ(di_dsv4_dev_sizes(h->d, N_CTX, BT, &bb, &sb), DI_OK);
        CHECK_EQ(bb, want);
        // ... and the stage split's estimate of a block (di_dsv4_dev_split_mem's costs) agrees.
        di_dev_stage_cost cost;
        di_dsv4_dev_stage_cost(h->m, 0, hp->n_layer, &cost);
        CHECK_EQ(cost.block_bytes, bb);
    }
    di_session_options so = {.n_ctx_max = N_CTX};
    for (int i = 0; i < N_SLOTS; i++) CHECK(di_session_create(h->m, &so, &h->ses[i]) == DI_OK);
    h->got = malloc(sizeof(float) * MAX_ROWS * (size_t)h->V);
    h->got2 = malloc(sizeof(float) * MAX_ROWS * (size_t)h->V);
    h->ref = malloc(sizeof(float) * MAX_ROWS * (size_t)h->V);
    return h->st && h->got && h->ref;
}

static void close_ctx(harness_ctx *h) {
    for (int i = 0; i < N_SLOTS; i++) di_session_destroy(h->ses[i]);
    di_dsv4_dev_state_destroy(h->st);
    di_dsv4_dev_state_destroy(h->st2);
    di_dsv4_dev_state_destroy(h->st1);
    di_dsv4_dev_destroy(h->d);
    di_dsv4_dev_destroy(h->d1);
    free_backends(h->b);
    di_backend_destroy(h->b1);
    di_model_destroy(h->m);
    free(h->got);
    free(h->got2);
    free(h->ref);
}

// One call: n_seq (slot, n_tok, restart) triples; every row's logits compared to each slot's
// session fed the same chunk.
typedef struct step {
    int n;
    int slot[N_SLOTS], n_tok[N_SLOTS];
    bool restart[N_SLOTS];
    bool last_rows; // logits of each sequence's last row only (gathered rows), else every row
} step;

static void run_step(harness_ctx *h, const step *sp) {
    di_dsv4_dev_seq seqs[N_SLOTS];
    int32_t tokens[MAX_ROWS], rows[MAX_ROWS];
    int32_t T = 0;
    for (int i = 0; i < sp->n; i++) {
        int s = sp->slot[i];
        if (sp->restart[i]) {
            h->gen[s]++;
            di_session_reset(h->ses[s]);
            int32_t t[MAXB];
            memcpy(t, h->blk[s], sizeof t);
            memcpy(h->blk[s], h->spare, sizeof t);
            memcpy(h->spare, t, sizeof t);
        }
        int32_t pos = di_session_n_past(h->ses[s]);
        seqs[i] = (di_dsv4_dev_seq){
            .slot = s, .pos = pos, .n_tok = sp->n_tok[i], .blocks = h->blk[s], .n_blocks = MAXB};
        for (int32_t t = 0; t < sp->n_tok[i]; t++)
            tokens[T + t] = token_of(s, h->gen[s], pos + t, h->V);
        T += sp->n_tok[i];
    }
    int32_t n_rows = 0;
    for (int32_t i = 0, r = 0; i < sp->n; r += sp->n_tok[i++])
        for (int32_t t = sp->last_rows ? sp->n_tok[i] - 1 : 0; t < sp->n_tok[i]; t++)
            rows[n_rows++] = r + t;
    di_dsv4_dev_graph_stats g0, g1;
    di_dsv4_dev_get_graph_stats(h->st, &g0);
    // (n) with picks: a greedy row's logits are not written (0xFF bytes stay), its pick is.
    uint8_t greedy[MAX_ROWS] = {0};
    int32_t picks[MAX_ROWS];
    int32_t n_greedy = 0;
    for (int32_t k = 0; k < n_rows && h->picks; k++)
        n_greedy += greedy[k] = (k + h->n_calls) % 3 == 2;
    h->n_calls++;
    memset(h->got, 0xFF, sizeof(float) * (size_t)n_rows * (size_t)h->V);
    CHECK_EQ(di_dsv4_dev_forward_picks(h->st, seqs, sp->n, tokens, rows, n_rows, h->got,
                                       h->picks ? greedy : NULL, picks),
             DI_OK);
    di_dsv4_dev_get_graph_stats(h->st, &g1);
    { // the bytes of results: 4 per row more when a row is greedy, 4 V less per greedy row
        const int64_t want =
            (n_greedy ? 4 * (int64_t)n_rows : 0) + 4 * (int64_t)h->V * (n_rows - n_greedy);
        CHECK_EQ(g1.last_download_bytes, want);
        CHECK_EQ(g1.n_download_bytes - g0.n_download_bytes, want);
    }
    { // (m) the hand-overs: the streams once per boundary, by kind (make_dev), the bounce's
      // upload counted with the stages' one metadata upload each
        const int64_t n_host = g_stages == 3, n_peer = g_stages - 1 - n_host;
        const di_hparams *hp = &h->m->hp;
        CHECK_EQ(g1.n_handover_peer - g0.n_handover_peer, n_peer);
        CHECK_EQ(g1.n_handover_host - g0.n_handover_host, n_host);
        CHECK_EQ(g1.last_handover_bytes,
                 (int64_t)(g_stages - 1) * T * (int64_t)sizeof(float) * hp->hc_mult * hp->n_embd);
        CHECK_EQ(g1.last_uploads, g_stages + n_host);
    }
    // Logit row k of st's call against the row `full` (another state's, or the session's): a
    // greedy row's pick is di_argmax(full) and its logits are untouched, another row's logits
    // are full's.
#define SAME_ROW(k, full)                                                                          \
    (greedy[k] ? picks[k] == di_argmax((full), h->V) &&                                            \
                     ((const uint32_t *)(h->got + (int64_t)(k)*h->V))[h->V - 1] == 0xFFFFFFFFu     \
               : memcmp(h->got + (int64_t)(k)*h->V, (full), sizeof(float) * (size_t)h->V) == 0)
    di_dsv4_dev_state *others[2] = {h->st2, h->st1}; // (m) st1: the 1-stage forward
    for (int j = 0; j < 2; j++) {
        if (!others[j]) continue;
        CHECK_EQ(di_dsv4_dev_forward(others[j], seqs, sp->n, tokens, rows, n_rows, h->got2), DI_OK);
        for (int32_t k = 0; k < n_rows; k++) CHECK(SAME_ROW(k, h->got2 + (int64_t)k * h->V));
    }
    int32_t r0 = 0, k_got = 0;
    for (int i = 0; i < sp->n; i++) {
        int s = sp->slot[i];
        di_forward_out fo = {.logits = h->ref, .last_only = sp->last_rows};
        CHECK_EQ(di_session_forward(h->ses[s], tokens + r0, sp->n_tok[i], &fo), DI_OK);
        CHECK_EQ(di_dsv4_dev_n_past(h->st, s), di_session_n_past(h->ses[s]));
        const int32_t n = sp->last_rows ? 1 : sp->n_tok[i];
        for (int64_t k = 0; k < (int64_t)n * h->V; k++) {
            if (greedy[k_got + k / h->V]) { // its pick instead (once per row)
                if (k % h->V == 0) {
                    CHECK(SAME_ROW(k_got + k / h->V, h->ref + k));
                    h->n_picked++;
                }
                continue;
            }
            double r = h->ref[k], g = h->got[(int64_t)k_got * h->V + k];
            if (fabs(r) > h->max_ref) h->max_ref = fabs(r);
            if (!(fabs(g - r) <= h->max_diff)) h->max_diff = isnan(g) ? INFINITY : fabs(g - r);
        }
        h->rows += n;
        k_got += n;
        r0 += sp->n_tok[i];
    }
    CHECK_EQ(k_got, n_rows);
#undef SAME_ROW
}

static void report(const harness_ctx *h, const char *what) {
    double rel = h->max_ref > 0 ? h->max_diff / h->max_ref : INFINITY;
    fprintf(stderr, "%s: %lld rows, max |dev - cpu| = %.3g, max |logit| = %.3g, relative %.3g\n",
            what, (long long)h->rows, h->max_diff, h->max_ref, rel);
    CHECK(h->rows > 0);
    CHECK(rel <= TOL_DEV);
    CHECK(h->max_diff == 0); // the same kernels on the same rows: bit-identical
}

#define ONE(slot_, n_tok_)                                                                         \
    {                                                                                              \
        .n = 1, .slot = {slot_}, .n_tok = { n_tok_ }                                               \
    }

// The indexer keys slot `slot`'s entry blocks hold (di_dsv4_dev_state_read_block's layout) are
// the keys its session's CPU forward computed, bit for bit: FP32 rows as they are, or (official)
// Q4 codes decoded exactly (tensor/quant_ref.h di_quant_q4_unpack). Returns the keys compared.
static int64_t check_index_keys(const harness_ctx *h, int slot) {
    const di_hparams *hp = &h->m->hp;
    const di_session *ses = h->ses[slot];
    const int64_t DI = hp->index_head_dim, rb = di_dsv4_dev_state_kv_row_bytes(h->st);
    const int64_t kb = di_dsv4_dev_state_index_key_bytes(h->st);
    int64_t bb = 0, sb = 0, n = 0, bad = 0;
    CHECK_EQ(di_dsv4_dev_sizes(h->d, N_CTX, BT, &bb, &sb), DI_OK);
    uint8_t *blk = malloc((size_t)bb);
    float *key = malloc(sizeof(float) * (size_t)DI);
    if (!blk || !key) {
        CHECK(false);
        goto done;
    }
    for (int32_t b = 0; b < MAXB && b * BT < ses->pos; b++) {
        CHECK_EQ(di_dsv4_dev_state_read_block(h->st, h->blk[slot][b], blk), DI_OK);
        int64_t off = 0;
        for (int il = 0; il < hp->n_layer; il++) {
            const int32_t r = h->m->layers[il].ratio;
            if (r <= 0) continue;
            const int64_t E = BT / r;
            off += E * rb; // the entries' rows
            if (r != 4) continue;
            const di_dsv4_cmp_state *cs = &ses->layers[il].idx;
            for (int64_t e = 0; e < E && b * E + e < cs->n_entries; e++, n++) {
                const uint8_t *k = blk + off + e * kb;
                if (g_prec == DI_PRECISION_OFFICIAL)
                    di_quant_q4_unpack(k, DI, DI_BACKEND_KEY_BLOCK, key);
                else
                    memcpy(key, k, sizeof(float) * (size_t)DI);
                bad += memcmp(key, di_dsv4_entry(cs, b * E + e, (int32_t)DI),
                              sizeof(float) * (size_t)DI) != 0;
            }
            off += E * kb;
        }
        CHECK_EQ(off, bb);
    }
    fprintf(stderr, "keys: %lld compared, %lld differ\n", (long long)n, (long long)bad);
    CHECK_EQ(bad, 0);
done:
    free(blk);
    free(key);
    return n;
}

// (a) one sequence: 1, 3, 5 (crosses CSA windows and the 16-row window), 64 (to 73), 60 (crosses
// 128: the first HCA window closes mid-chunk), decodes, 96, then 30 (crosses 256); then its
// entry blocks' indexer keys against the session's (check_index_keys).
static void one_sequence(const char *dir, const char *what) {
    harness_ctx h;
    if (!open_ctx(&h, dir)) {
        CHECK(false);
        close_ctx(&h);
        return;
    }
    const int chunks[] = {1, 3, 5, 64, 60, 1, 1, 1, 1, 1, 1, 1, 96, 30, 1, 1};
    for (size_t i = 0; i < sizeof chunks / sizeof chunks[0]; i++) {
        step sp = ONE(0, chunks[i]);
        run_step(&h, &sp);
    }
    CHECK_EQ(di_session_n_past(h.ses[0]), 268);
    int n_csa = 0;
    for (int il = 0; il < h.m->hp.n_layer; il++) n_csa += h.m->layers[il].ratio == 4;
    CHECK_EQ(check_index_keys(&h, 0), (int64_t)n_csa * (268 / 4)); // every CSA entry's key
    report(&h, what);
    close_ctx(&h);
}

static void test_one_sequence_synth(void) {
    one_sequence(g_dir, "(a) tiny-128, one sequence");
}

static void test_one_sequence_fixture(void) {
    one_sequence("tests/data/fixtures/hca128/hf", "(a) hca128 fixture, hf layout");
    one_sequence("tests/data/fixtures/hca128/official", "(a) hca128 fixture, official layout");
}

// (b) ragged batches of 3 slots, (c) a restart, (d) refused calls.
static void test_ragged(void) {
    harness_ctx h;
    if (!open_ctx(&h, g_dir)) {
        CHECK(false);
        close_ctx(&h);
        return;
    }
    const step steps[] = {
        {.n = 3, .slot = {0, 1, 2}, .n_tok = {10, 1, 40}},
        {.n = 3, .slot = {2, 0, 1}, .n_tok = {60, 1, 30}}, // slots out of order
        {.n = 3, .slot = {0, 1, 2}, .n_tok = {50, 1, 40}}, // slot 2 crosses 128
        {.n = 3, .slot = {0, 1, 2}, .n_tok = {1, 1, 1}},
        {.n = 3, .slot = {2, 0, 1}, .n_tok = {7, 3, 5}, .last_rows = true}, // gathered rows
        {.n = 1, .slot = {1}, .n_tok = {85}},
        {.n = 3, .slot = {0, 1, 2}, .n_tok = {70, 10, 5}},
        // (c) slot 1 starts a new sequence at position 0 while the others continue
        {.n = 3, .slot = {1, 0, 2}, .n_tok = {20, 1, 3}, .restart = {true, false, false}},
        {.n = 3, .slot = {0, 1, 2}, .n_tok = {1, 17, 1}},
    };
    for (size_t i = 0; i < sizeof steps / sizeof steps[0]; i++) run_step(&h, &steps[i]);
    report(&h, "(b, c) ragged batches with a restart");

    // (d) refused calls leave every slot as it was.
    int32_t tok[MAX_ROWS + 1] = {0}, row0 = 0;
    int32_t past[N_SLOTS];
    for (int s = 0; s < N_SLOTS; s++) past[s] = di_dsv4_dev_n_past(h.st, s);
    di_dsv4_dev_seq bad[][2] = {
        {{.slot = 0, .pos = past[0] + 1, .n_tok = 1}}, // wrong position
        {{.slot = 0, .pos = 5, .n_tok = 1}},           // neither n_past nor 0
        {{.slot = N_SLOTS, .pos = 0, .n_tok = 1}},     // bad slot
        {{.slot = -1, .pos = 0, .n_tok = 1}},
        {{.slot = 0, .pos = 0, .n_tok = MAX_ROWS + 1}}, // too many rows
        {{.slot = 0, .pos = past[0], .n_tok = 0}},      // no tokens
        {{.slot = 2, .pos = past[2], .n_tok = N_CTX - past[2] + 1}},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        int s = bad[i][0].slot >= 0 && bad[i][0].slot < N_SLOTS ? bad[i][0].slot : 0;
        bad[i][0].blocks = h.blk[s];
        bad[i][0].n_blocks = MAXB;
        CHECK_EQ(di_dsv4_dev_forward(h.st, bad[i], 1, tok, &row0, 1, h.got), DI_ERR_INVALID);
    }
    di_dsv4_dev_seq twice[2] = {
        {.slot = 1, .pos = past[1], .n_tok = 1, .blocks = h.blk[1], .n_blocks = MAXB},
        {.slot = 1, .pos = past[1], .n_tok = 1, .blocks = h.blk[1], .n_blocks = MAXB}};
    CHECK_EQ(di_dsv4_dev_forward(h.st, twice, 2, tok, &row0, 1, h.got), DI_ERR_INVALID);
    di_dsv4_dev_seq ok = {
        .slot = 0, .pos = past[0], .n_tok = 2, .blocks = h.blk[0], .n_blocks = MAXB};
    int32_t bad_tok[2] = {0, h.V}, desc_rows[2] = {1, 0};
    CHECK_EQ(di_dsv4_dev_forward(h.st, &ok, 1, bad_tok, &row0, 1, h.got), DI_ERR_INVALID);
    CHECK_EQ(di_dsv4_dev_forward(h.st, &ok, 1, tok, desc_rows, 2, h.got), DI_ERR_INVALID);
    CHECK_EQ(di_dsv4_dev_forward(h.st, &ok, 1, tok, &row0, 1, NULL), DI_ERR_INVALID);
    for (int s = 0; s < N_SLOTS; s++) CHECK_EQ(di_dsv4_dev_n_past(h.st, s), past[s]);
    // ... and the slots continue exactly.
    h.rows = 0, h.max_diff = 0;
    const step after = {.n = 3, .slot = {2, 1, 0}, .n_tok = {1, 2, 3}};
    run_step(&h, &after);
    report(&h, "(d) after refused calls");
    close_ctx(&h);
}

// (e) di_dsv4_dev_attach: plain sessions on the device-resident forward vs a model without it.
static void test_attach(void) {
    di_model_options mo = di_model_options_default();
    mo.n_threads = 2;
    mo.precision = g_prec;
    di_model *cpu = NULL, *dev = NULL;
    di_backend *b[MAX_STAGES] = {0};
    CHECK(di_model_load(g_dir, &mo, &cpu) == DI_OK);
    CHECK(di_model_load(g_dir, &mo, &dev) == DI_OK);
    CHECK(make_dev(NULL, 2, b, NULL));
    if (!cpu || !dev || !b[g_stages - 1]) goto done;
    CHECK_EQ(di_dsv4_dev_attach_stages(dev, b, g_stages), DI_OK);
    CHECK_EQ(di_dsv4_dev_attach(dev, b[0]), DI_ERR_INVALID); // one per model
    {
        const int32_t n_ctx = 300, V = cpu->hp.n_vocab;
        di_session_options so = {.n_ctx_max = n_ctx};
        di_session *a = NULL, *s = NULL;
        CHECK(di_session_create(cpu, &so, &a) == DI_OK);
        CHECK(di_session_create(dev, &so, &s) == DI_OK);
        CHECK(s && s->dev && a && !a->dev);
        float *ra = malloc(sizeof(float) * (size_t)n_ctx * (size_t)V);
        float *rs = malloc(sizeof(float) * (size_t)n_ctx * (size_t)V);
        int32_t toks[300];
        for (int32_t t = 0; t < n_ctx; t++) toks[t] = token_of(0, 0, t, V);
        double max_diff = 0, max_ref = 0;
        // 270 rows: more than a session's dev call (DI_DSV4_DEV_SESSION_ROWS), fed in chunks.
        const int32_t chunks[] = {270, 1, 1, 20};
        const bool last_only[] = {false, true, false, true};
        int32_t p = 0;
        for (int k = 0; k < 4; k++) {
            di_forward_out fa = {.logits = ra, .last_only = last_only[k]};
            di_forward_out fs = {.logits = rs, .last_only = last_only[k]};
            CHECK_EQ(di_session_forward(a, toks + p, chunks[k], &fa), DI_OK);
            CHECK_EQ(di_session_forward(s, toks + p, chunks[k], &fs), DI_OK);
            int64_t n = (last_only[k] ? 1 : chunks[k]) * (int64_t)V;
            for (int64_t i = 0; i < n; i++) {
                if (fabs(ra[i]) > max_ref) max_ref = fabs(ra[i]);
                double e = fabs((double)rs[i] - ra[i]);
                if (!(e <= max_diff)) max_diff = isnan(e) ? INFINITY : e;
            }
            p += chunks[k];
        }
        CHECK_EQ(di_session_n_past(s), 292);
        fprintf(stderr, "(e) attached: max |dev - cpu| = %.3g of max |logit| %.3g\n", max_diff,
                max_ref);
        CHECK(max_diff <= TOL_DEV * max_ref);
        void *bytes = NULL;
        size_t nb = 0;
        CHECK_EQ(di_session_save(s, &bytes, &nb), DI_OK); // a token state: test_session_dev.c
        di_free_buffer(bytes);
        // Reset starts slot 0 afresh: the first position again.
        di_session_reset(s);
        di_session_reset(a);
        di_forward_out fa = {.logits = ra}, fs = {.logits = rs};
        CHECK_EQ(di_session_forward(a, toks, 3, &fa), DI_OK);
        CHECK_EQ(di_session_forward(s, toks, 3, &fs), DI_OK);
        for (int64_t i = 0; i < 3 * (int64_t)V; i++)
            CHECK(fabs((double)rs[i] - ra[i]) <= TOL_DEV * max_ref);
        free(ra);
        free(rs);
        di_session_destroy(a);
        di_session_destroy(s);
        // MTP sessions run there too (the MTP block uploaded by the first; test_session_dev.c (f)
        // checks them bit for bit).
        so.mtp = true;
        CHECK(di_session_create(dev, &so, &s) == DI_OK);
        CHECK(s && s->dev && di_dsv4_dev_has_mtp(dev->dev));
        di_session_destroy(s);
    }
done:
    di_model_destroy(dev); // before the backends it borrows
    di_model_destroy(cpu);
    free_backends(b);
}

// (f) decode graphs vs direct calls (DI_DEV_GRAPHS=0) vs the sessions over a long ragged decode.
static void test_graphs(void) {
    harness_ctx h;
    if (!open_ctx(&h, g_dir)) { // h.st: graphs on (DI_DEV_GRAPHS unset)
        CHECK(false);
        close_ctx(&h);
        return;
    }
    CHECK(setenv("DI_DEV_GRAPHS", "0", 1) == 0);
    CHECK_EQ(di_dsv4_dev_state_create(h.d, N_SLOTS, N_CTX, MAX_ROWS, N_BLK, BT, &h.st2), DI_OK);
    CHECK(unsetenv("DI_DEV_GRAPHS") == 0);
    if (!h.st2) {
        close_ctx(&h);
        return;
    }
    // Prefill: slot 0 to 120 (its first HCA window closes at 127), slot 1 to 5, slot 2 to 250
    // (its second closes at 255); then decode steps of 3 and 2 slots in changing orders, with
    // slot 1 restarted at position 0 inside a decode batch. W = 16 wraps every 16 steps, CSA
    // windows close every 4.
    const step prefill[] = {
        {.n = 3, .slot = {0, 1, 2}, .n_tok = {60, 5, 31}},
        {.n = 1, .slot = {2}, .n_tok = {96}},
        {.n = 1, .slot = {2}, .n_tok = {96}},
        {.n = 2, .slot = {2, 0}, .n_tok = {27, 60}},
    };
    for (size_t i = 0; i < sizeof prefill / sizeof prefill[0]; i++) run_step(&h, &prefill[i]);
    di_dsv4_dev_graph_stats g0;
    di_dsv4_dev_get_graph_stats(h.st, &g0);
    for (int k = 0; k < 30; k++) {
        step sp = {.n = 3, .slot = {k % 3, (k + 1) % 3, (k + 2) % 3}, .n_tok = {1, 1, 1}};
        if (k % 5 == 3) sp = (step){.n = 2, .slot = {2, 0}, .n_tok = {1, 1}};
        if (k == 11) // slot 1 restarts at position 0 in a decode batch (its graph is cached)
            for (int i = 0; i < 3; i++) sp.restart[i] = sp.slot[i] == 1;
        run_step(&h, &sp);
    }
    CHECK_EQ(di_session_n_past(h.ses[0]), 150);
    CHECK_EQ(di_session_n_past(h.ses[2]), 280);
    report(&h, "(f) ragged decode with graphs = without = sessions");
    di_dsv4_dev_graph_stats g, n;
    di_dsv4_dev_get_graph_stats(h.st, &g);
    di_dsv4_dev_get_graph_stats(h.st2, &n);
    fprintf(stderr,
            "(f) graphs on: %lld direct, %lld captured, %lld replayed, %d cached; off: %lld "
            "direct\n",
            (long long)g.n_direct, (long long)g.n_captured, (long long)g.n_replayed, g.n_cached,
            (long long)n.n_direct);
    CHECK_EQ(g0.n_captured, 0); // prefill runs directly
    CHECK_EQ(g.n_captured, 2);  // 3 slots and 2 slots: each once
    CHECK_EQ(g.n_cached, 2);
    CHECK_EQ(g.n_replayed, 30 - 2 - 2); // every decode step but the first two of each size
    CHECK_EQ(g.n_direct, 4 + 2);
    CHECK(n.n_captured == 0 && n.n_replayed == 0 && n.n_direct == 4 + 30);
    // (n) greedy picks (di_dsv4_dev_forward_picks, run_step): a ragged prefill call, then decode
    // steps (graphs replayed), every third logit row greedy: each pick di_argmax of the row st2
    // and the sessions computed, the other rows their logits, the greedy rows' logits not written,
    // 4 bytes downloaded a greedy row instead of 4 V; a replayed step with a greedy row costs the
    // graph's ops and the argmax op after it. Greedy rows without picks are refused.
    h.picks = true;
    const step mixed = {.n = 3, .slot = {1, 0, 2}, .n_tok = {7, 2, 5}, .last_rows = false};
    run_step(&h, &mixed);
    for (int k = 0; k < 6; k++) {
        const step sp = {.n = 3, .slot = {0, 1, 2}, .n_tok = {1, 1, 1}};
        run_step(&h, &sp);
        di_dsv4_dev_get_graph_stats(h.st, &g);
        di_dsv4_dev_get_graph_stats(h.st2, &n);
        CHECK_EQ(g.last_ops, n.last_ops + 1); // st2 runs the same step's ops directly
    }
    CHECK(h.n_picked >= 14 / 3 + 6); // a third of the 14 rows, one row of each decode step
    {
        di_dsv4_dev_seq sq = {.slot = 0,
                              .pos = di_dsv4_dev_n_past(h.st, 0),
                              .n_tok = 1,
                              .blocks = h.blk[0],
                              .n_blocks = MAXB};
        const uint8_t gr[1] = {1};
        int32_t t0[1] = {1}, r0[1] = {0};
        CHECK_EQ(di_dsv4_dev_forward_picks(h.st, &sq, 1, t0, r0, 1, h.got, gr, NULL),
                 DI_ERR_INVALID);
    }
    report(&h, "(n) greedy picks = di_argmax of the rows");
    close_ctx(&h);
}

// The CPU backend's graph_end, wrapped to count the commands of each captured graph.
static di_backend_vt g_count_vt;
static di_status (*g_real_graph_end)(di_backend *, void **);
static int64_t g_graph_cmds = -1;

static di_status counting_graph_end(di_backend *b, void **graph) {
    di_status st = g_real_graph_end(b, graph);
    if (st == DI_OK) g_graph_cmds = di_cpu_backend_graph_n_cmds(*graph);
    return st;
}

static void count_graphs(di_backend *b) {
    g_count_vt = *b->vt;
    g_real_graph_end = b->vt->graph_end;
    g_count_vt.graph_end = counting_graph_end;
    b->vt = &g_count_vt;
}

// (g) What a decode step costs (issue #7): ops enqueued (a replayed graph counts the ops it
// captured), uploads and bytes, at n sequences on a fresh state of n_slots slots: three decode
// steps at positions 0, 1, 2 (direct, captured, replayed). Returns the replayed step's stats.
// shared: the engine's kind of state (entry blocks listed per call: slot i's block j is
// (n_slots - 1 - i) * max_blocks + j); else private blocks (sessions).
static di_dsv4_dev_graph_stats decode_costs(di_dsv4_dev *d, int32_t n_slots, int32_t n_ctx,
                                            int32_t n, int32_t V, bool shared) {
    di_dsv4_dev_graph_stats g[3];
    memset(g, 0, sizeof g);
    di_dsv4_dev_state *st = NULL;
    g_graph_cmds = -1;
    const int32_t bt = di_dsv4_dev_block_tokens(d), mb = (n_ctx + bt - 1) / bt;
    CHECK_EQ(di_dsv4_dev_state_create(d, n_slots, n_ctx, n, shared ? n_slots * mb : 0, bt, &st),
             DI_OK);
    di_dsv4_dev_seq *seqs = calloc((size_t)n, sizeof *seqs);
    int32_t *tok = calloc((size_t)n, sizeof *tok), *rows = calloc((size_t)n, sizeof *rows);
    int32_t *blk = calloc((size_t)(n_slots * mb), sizeof *blk);
    float *logits = malloc(sizeof(float) * (size_t)n * (size_t)V);
    if (!st || !seqs || !tok || !rows || !logits || !blk) {
        CHECK(false);
        goto done;
    }
    for (int32_t i = 0; i < n_slots * mb; i++) blk[i] = (n_slots - 1 - i / mb) * mb + i % mb;
    for (int32_t p = 0; p < 3; p++) {
        for (int32_t i = 0; i < n; i++) {
            seqs[i] = (di_dsv4_dev_seq){.slot = i,
                                        .pos = p,
                                        .n_tok = 1,
                                        .blocks = shared ? blk + i * mb : NULL,
                                        .n_blocks = shared ? mb : 0};
            tok[i] = (i * 7 + p) % V;
            rows[i] = i;
        }
        CHECK_EQ(di_dsv4_dev_forward(st, seqs, n, tok, rows, n, logits), DI_OK);
        di_dsv4_dev_get_graph_stats(st, &g[p]);
    }
    // The replayed graph holds the ops the direct run enqueued (the backend recorded as many
    // commands); the uploads are the same: one per call.
    CHECK_EQ(g[2].n_replayed, 1);
    CHECK_EQ(g[0].last_ops, g[2].last_ops);
    CHECK_EQ(g[2].last_ops, g_graph_cmds);
    CHECK_EQ(g[0].last_upload_bytes, g[2].last_upload_bytes);
    CHECK_EQ(g[2].last_uploads, 1);
done:
    free(seqs), free(tok), free(rows), free(logits), free(blk);
    di_dsv4_dev_state_destroy(st);
    return g[2];
}

static void print_costs(const char *model, int32_t n_ctx, int32_t n, bool shared,
                        const di_dsv4_dev_graph_stats *g) {
    fprintf(stderr,
            "(g) %s, n_ctx %d, %s blocks, decode of %2d: %5lld ops, %3lld uploads, %8lld bytes "
            "uploaded\n",
            model, n_ctx, shared ? "shared " : "private", n, (long long)g->last_ops,
            (long long)g->last_uploads, (long long)g->last_upload_bytes);
}

static void test_decode_costs(void) {
    di_model_options mo = di_model_options_default();
    mo.n_threads = 2;
    di_model *m = NULL;
    di_backend *b = NULL;
    di_dsv4_dev *d = NULL;
    CHECK(di_model_load(g_dir, &mo, &m) == DI_OK);
    CHECK(di_cpu_backend_create(2, &b) == DI_OK);
    if (b) count_graphs(b);
    if (m && b) CHECK(di_dsv4_dev_create(m, b, &d) == DI_OK);
    if (!d) goto done;
    const int32_t ns[] = {1, 3, 16};
    for (int sh = 0; sh < 2; sh++) {
        di_dsv4_dev_graph_stats g[3];
        for (int i = 0; i < 3; i++) {
            g[i] = decode_costs(d, 16, N_CTX, ns[i], m->hp.n_vocab, sh == 1);
            print_costs("tiny-128", N_CTX, ns[i], sh == 1, &g[i]);
        }
        // One launch per op whatever the number of sequences (no per-sequence ops in a graph):
        // 215 with private blocks; shared blocks add the page table's one scatter.
        CHECK_EQ(g[0].last_ops, sh ? 216 : 215);
        CHECK_EQ(g[1].last_ops, g[0].last_ops);
        CHECK_EQ(g[2].last_ops, g[0].last_ops);
    }
done:
    di_dsv4_dev_destroy(d);
    di_backend_destroy(b);
    di_model_destroy(m);
}

// (g) The same on flash-4l's shapes scaled down (W 128, top-k 512, 8 output groups, layers
// SWA / CSA 4 / HCA 128 / CSA 4; tiny widths): the per-call lists of V4-Flash.
static void test_decode_costs_flash(void) {
    char dir[256];
    snprintf(dir, sizeof dir, "/tmp/di_test_dev_flash_XXXXXX");
    if (!mkdtemp(dir)) {
        CHECK(false);
        return;
    }
    di_synth_config c;
    CHECK(di_synth_preset("flash-4l", &c) == DI_OK);
    c.n_vocab = V_SYNTH, c.n_embd = 128, c.n_head = 8, c.head_dim = 128, c.q_lora_rank = 128;
    c.o_lora_rank = 128, c.n_index_head = 4, c.index_head_dim = 128, c.n_expert = 8;
    c.expert_ff = 128;
    CHECK(di_synth_write(&c, dir) == DI_OK);
    di_model_options mo = di_model_options_default();
    mo.n_threads = 2;
    di_model *m = NULL;
    di_backend *b = NULL;
    di_dsv4_dev *d = NULL;
    CHECK(di_model_load(dir, &mo, &m) == DI_OK);
    CHECK(di_cpu_backend_create(2, &b) == DI_OK);
    if (b) count_graphs(b);
    if (m && b) CHECK(di_dsv4_dev_create(m, b, &d) == DI_OK);
    if (d) {
        const int32_t n_ctx = 8192, ns[] = {1, 64};
        for (int sh = 0; sh < 2; sh++) {
            di_dsv4_dev_graph_stats g[2];
            for (int i = 0; i < 2; i++) {
                g[i] = decode_costs(d, 64, n_ctx, ns[i], m->hp.n_vocab, sh == 1);
                print_costs("flash-4l shapes", n_ctx, ns[i], sh == 1, &g[i]);
            }
            CHECK_EQ(g[0].last_ops, sh ? 185 : 184); // + the page table's scatter
            CHECK_EQ(g[1].last_ops, g[0].last_ops);
        }
    }
    di_dsv4_dev_destroy(d);
    di_backend_destroy(b);
    di_model_destroy(m);
    di_test_remove_dir(dir);
}

// Feeds positions [from, to) of toks to sequence `sq` (its slot, blocks, win_lo, n_cached) in
// chunks of 96, every row's logits, and folds |logits - cold| of the rows from exact_from on into
// *max_diff (n_cmp rows compared).
static void feed_compare(harness_ctx *h, di_dsv4_dev_seq sq, int32_t from, int32_t to,
                         int32_t exact_from, const int32_t *toks, const int32_t *rows,
                         const float *cold, double *max_diff, int64_t *n_cmp) {
    const int32_t V = h->V;
    for (int32_t p = from; p < to;) {
        int32_t n = to - p < 96 ? to - p : 96;
        sq.pos = p, sq.n_tok = n;
        CHECK_EQ(di_dsv4_dev_forward(h->st, &sq, 1, toks + p, rows, n, h->got), DI_OK);
        for (int32_t t = 0; t < n; t++) {
            if (p + t < exact_from) continue;
            const float *a = h->got + (int64_t)t * V, *b = cold + (int64_t)(p + t) * V;
            for (int32_t v = 0; v < V; v++)
                if (fabs((double)a[v] - b[v]) > *max_diff) *max_diff = fabs((double)a[v] - b[v]);
            (*n_cmp)++;
        }
        p += n;
    }
}

// (j) Prefix reuse on shared blocks (docs/kv-cache.md, bounded replay): slot 0 prefills 300
// positions cold in chunks across block boundaries; slot 1 then takes slot 0's two full blocks
// (H = 256 cached positions) and a block of its own, replays from Q = max(0, H - n_layer (W - 1))
// with win_lo = Q, and its logits from H on equal slot 0's bit for bit; slot 0's cached blocks
// hold the same bytes after the replay; both slots then decode together, sharing the blocks,
// with identical logits. Bad block lists and replay parameters are refused before any work, and
// nothing changes.
static void test_prefix(void) {
    harness_ctx h;
    if (!open_ctx(&h, g_dir)) {
        CHECK(false);
        close_ctx(&h);
        return;
    }
    const di_hparams *hp = &h.m->hp;
    const int32_t V = h.V, L = 300, H = 2 * BT, R = hp->n_layer * (hp->window - 1);
    const int32_t Q = H - R > 0 ? H - R : 0;
    int32_t toks[N_CTX], rows[MAX_ROWS], r0 = 0;
    for (int32_t t = 0; t < N_CTX; t++) toks[t] = token_of(0, 7, t, V);
    for (int32_t i = 0; i < MAX_ROWS; i++) rows[i] = i;
    float *cold = malloc(sizeof(float) * (size_t)N_CTX * (size_t)V);
    int64_t bb = 0, sb = 0;
    CHECK_EQ(di_dsv4_dev_sizes(h.d, N_CTX, BT, &bb, &sb), DI_OK);
    uint8_t *before = malloc((size_t)(2 * bb)), *after = malloc((size_t)(2 * bb));
    if (!cold || !before || !after || bb <= 0) {
        CHECK(false);
        goto done;
    }
    // Slot 0, cold: chunks of 96 cross both block boundaries (128, 256) mid-chunk.
    for (int32_t p = 0; p < L;) {
        int32_t n = L - p < 96 ? L - p : 96;
        di_dsv4_dev_seq sq = {
            .slot = 0, .pos = p, .n_tok = n, .blocks = h.blk[0], .n_blocks = MAXB};
        CHECK_EQ(di_dsv4_dev_forward(h.st, &sq, 1, toks + p, rows, n, cold + (int64_t)p * V),
                 DI_OK);
        if (h.st1) { // (m) the 1-stage state: the same logits
            CHECK_EQ(di_dsv4_dev_forward(h.st1, &sq, 1, toks + p, rows, n, h.got2), DI_OK);
            CHECK(memcmp(h.got2, cold + (int64_t)p * V, sizeof(float) * (size_t)n * (size_t)V) ==
                  0);
        }
        p += n;
    }
    for (int b = 0; b < 2; b++)
        CHECK_EQ(di_dsv4_dev_state_read_block(h.st, h.blk[0][b], before + b * bb), DI_OK);
    if (h.st1) { // (m) a block's bytes: the stages' parts in layer order, the 1-stage bytes
        int64_t bb1 = 0, sb1 = 0;
        CHECK_EQ(di_dsv4_dev_sizes(h.d1, N_CTX, BT, &bb1, &sb1), DI_OK);
        CHECK_EQ(bb1, bb);
        CHECK_EQ(sb1 + (g_stages - 1) * (int64_t)sizeof(int32_t) * MAXB, sb); // a page table each
        for (int b = 0; b < 2; b++) {
            CHECK_EQ(di_dsv4_dev_state_read_block(h.st1, h.blk[0][b], after + b * bb), DI_OK);
            CHECK(memcmp(before + b * bb, after + b * bb, (size_t)bb) == 0);
        }
    }
    // Block I/O (the disk tier's write-back and read-in): block 0's bytes written into spare block
    // 0 read back identically (the hit replayed from 0 below reads its entries from that copy), a
    // byte pattern written into spare blocks 1 and 2 too, and slot 0's blocks are untouched.
    CHECK_EQ(di_dsv4_dev_state_write_block(h.st, h.spare[0], before), DI_OK);
    CHECK_EQ(di_dsv4_dev_state_read_block(h.st, h.spare[0], after), DI_OK);
    CHECK(memcmp(before, after, (size_t)bb) == 0);
    for (int64_t i = 0; i < 2 * bb; i++) after[i] = (uint8_t)(i * 131 + 17);
    CHECK_EQ(di_dsv4_dev_state_write_block(h.st, h.spare[1], after), DI_OK);
    CHECK_EQ(di_dsv4_dev_state_write_block(h.st, h.spare[2], after + bb), DI_OK);
    {
        uint8_t *back = malloc((size_t)(3 * bb));
        CHECK(back != NULL);
        if (back) {
            CHECK_EQ(di_dsv4_dev_state_read_block(h.st, h.spare[1], back), DI_OK);
            CHECK_EQ(di_dsv4_dev_state_read_block(h.st, h.spare[2], back + bb), DI_OK);
            CHECK(memcmp(back, after, (size_t)(2 * bb)) == 0);
            for (int b = 0; b < 2; b++)
                CHECK_EQ(di_dsv4_dev_state_read_block(h.st, h.blk[0][b], back + b * bb), DI_OK);
            CHECK(memcmp(back, before, (size_t)(2 * bb)) == 0);
            free(back);
        }
        CHECK_EQ(di_dsv4_dev_state_write_block(h.st, N_BLK, before), DI_ERR_INVALID);
        CHECK_EQ(di_dsv4_dev_state_read_block(h.st, -1, after), DI_ERR_INVALID);
    }

    // Refused: each leaves both slots where they are.
    const int32_t shared_blk[MAXB] = {h.blk[0][0], h.blk[0][1], h.blk[1][2]};
    const int32_t out_of_range[MAXB] = {h.blk[0][0], N_BLK, h.blk[1][2]};
    const int32_t negative[MAXB] = {-1, h.blk[0][1], h.blk[1][2]};
    const int32_t reads_written[MAXB] = {h.blk[0][2], h.blk[0][1], h.blk[1][2]};
    const di_dsv4_dev_seq replay = {.slot = 1,
                                    .pos = Q,
                                    .n_tok = 1,
                                    .blocks = shared_blk,
                                    .n_blocks = MAXB,
                                    .win_lo = Q,
                                    .n_cached = H};
    // slot 0 closes a CSA window in its block 2 (positions 300..303).
    const di_dsv4_dev_seq writer = {
        .slot = 0, .pos = L, .n_tok = 4, .blocks = h.blk[0], .n_blocks = MAXB};
    di_dsv4_dev_seq bad[][2] = {
        {replay, writer}, {replay, writer}, {replay, writer}, {replay, writer}, {replay, writer},
        {replay, writer}, {replay, writer}, {replay, writer}, {replay, writer},
    };
    int32_t n_bad[9] = {1, 1, 1, 1, 1, 1, 1, 2, 2};
    bad[0][0].blocks = NULL;          // no blocks on a shared state
    bad[1][0].n_blocks = 1;           // fewer than its positions need
    bad[2][0].blocks = out_of_range;  // a block id past the state's
    bad[3][0].blocks = negative;      // a negative block id
    bad[4][0].n_cached = H - 4;       // not a multiple of the block
    bad[5][0].win_lo = Q + 1;         // after pos
    bad[6][0].n_cached = BT;          // kept windows would read positions before win_lo
    bad[7][0].blocks = reads_written; // reads the block slot 0 writes
    bad[8][0] = (di_dsv4_dev_seq){.slot = 1,
                                  .pos = 0,
                                  .n_tok = 4,
                                  .blocks = reads_written,
                                  .n_blocks = MAXB}; // writes it too: twice
    for (int i = 0; i < 9; i++) {
        int32_t tk[8] = {0};
        CHECK_EQ(di_dsv4_dev_forward(h.st, bad[i], n_bad[i], tk, &r0, 1, h.got), DI_ERR_INVALID);
        CHECK_EQ(di_dsv4_dev_n_past(h.st, 0), L);
        CHECK_EQ(di_dsv4_dev_n_past(h.st, 1), 0);
    }
    {
        di_dsv4_dev_state *ps = NULL; // a private state refuses block lists
        CHECK_EQ(di_dsv4_dev_state_create(h.d, 1, N_CTX, 8, 0, 0, &ps), DI_OK);
        di_dsv4_dev_seq sq = {.slot = 0, .pos = 0, .n_tok = 1, .blocks = shared_blk, .n_blocks = 3};
        if (ps) CHECK_EQ(di_dsv4_dev_forward(ps, &sq, 1, toks, &r0, 1, h.got), DI_ERR_INVALID);
        di_dsv4_dev_state_destroy(ps);
    }
    CHECK_EQ(di_dsv4_dev_state_create(h.d, 1, N_CTX, 8, 0, 100, &(di_dsv4_dev_state *){NULL}),
             DI_ERR_INVALID); // blocks of 100 positions: not a multiple of the ratio 128

    // The replay: its first call is decode-shaped (one token, its logits) but writes slot 1's
    // page table entries 0 and 1: run directly, counted.
    di_dsv4_dev_graph_stats g0, g1;
    di_dsv4_dev_get_graph_stats(h.st, &g0);
    CHECK_EQ(di_dsv4_dev_forward(h.st, &replay, 1, toks + Q, &r0, 1, h.got), DI_OK);
    di_dsv4_dev_get_graph_stats(h.st, &g1);
    CHECK_EQ(g1.n_direct_pages, g0.n_direct_pages + 1);
    CHECK_EQ(g1.n_direct, g0.n_direct + 1);
    {
        di_dsv4_dev_seq other = replay; // continuing with another win_lo: refused
        other.pos = Q + 1;
        other.win_lo = 0;
        CHECK_EQ(di_dsv4_dev_forward(h.st, &other, 1, toks + Q + 1, &r0, 1, h.got), DI_ERR_INVALID);
    }
    double max_diff = 0;
    int64_t n_cmp = 0;
    // Replayed rows before H are not exact by design: compared from H on.
    feed_compare(&h, replay, Q + 1, L, H, toks, rows, cold, &max_diff, &n_cmp);
    for (int b = 0; b < 2; b++)
        CHECK_EQ(di_dsv4_dev_state_read_block(h.st, h.blk[0][b], after + b * bb), DI_OK);
    CHECK(memcmp(before, after, (size_t)(2 * bb)) == 0);
    // Both continue together on the shared blocks (decode graphs): identical logits.
    double max_pair = 0;
    for (int32_t p = L; p < L + 6; p++) {
        di_dsv4_dev_seq two[2] = {
            {.slot = 0, .pos = p, .n_tok = 1, .blocks = h.blk[0], .n_blocks = MAXB}, replay};
        two[1].pos = p;
        int32_t tk[2] = {token_of(1, 1, p, V), token_of(1, 1, p, V)}, rr[2] = {0, 1};
        CHECK_EQ(di_dsv4_dev_forward(h.st, two, 2, tk, rr, 2, h.got), DI_OK);
        for (int32_t v = 0; v < V; v++) {
            double e = fabs((double)h.got[v] - h.got[V + v]);
            if (!(e <= max_pair)) max_pair = isnan(e) ? INFINITY : e;
        }
    }
    // A hit replayed from position 0 (what the engine does for a hit within the replay bound,
    // H <= n_layer (W - 1)): slot 2 takes slot 0's first block (128 cached positions; its copy
    // written into spare block 0 above), recomputes from 0 with win_lo 0, stores no cached entry,
    // and matches the cold rows from 128 on.
    {
        const int32_t b2[MAXB] = {h.spare[0], h.blk[2][1], h.blk[2][2]};
        const di_dsv4_dev_seq sq = {.slot = 2, .blocks = b2, .n_blocks = MAXB, .n_cached = BT};
        feed_compare(&h, sq, 0, L, BT, toks, rows, cold, &max_diff, &n_cmp);
    }
    for (int b = 0; b < 2; b++)
        CHECK_EQ(di_dsv4_dev_state_read_block(h.st, h.blk[0][b], after + b * bb), DI_OK);
    const bool kept = memcmp(before, after, (size_t)(2 * bb)) == 0;
    CHECK(kept);
    fprintf(stderr,
            "(j) prefix hit of %d positions, replay from %d (and a hit of %d replayed from 0): "
            "%lld rows compared, max |replayed - cold| = %.3g; shared decode max |slot 1 - slot 0| "
            "= %.3g; cached blocks (%lld "
            "bytes each) %s\n",
            H, Q, BT, (long long)n_cmp, max_diff, max_pair, (long long)bb,
            kept ? "unchanged" : "CHANGED");
    CHECK(n_cmp == (L - H) + (L - BT));
    CHECK(max_diff == 0);
    CHECK(max_pair == 0);
done:
    free(cold), free(before), free(after);
    close_ctx(&h);
}

// (k) Tail snapshots (docs/kv-cache.md): on a state of 512 positions, slot 0 prefills L = 420
// positions cold (chunks of up to 96 that end at each 128-position block boundary) and saves its
// tail at 128, 256 and 384 (1, 2, 3 HCA windows closed before them, CSA's overlap and the 16-row
// window wrapped many times), then decodes D tokens. Each snapshot restored into slot 1
// (taking slot 0's blocks before it, its own after) continues to L and decodes the same tokens:
// every row's logits memcmp-equal to the cold run, the decode steps through the cached graph
// (stats). The snapshot at 256 restored into slot 0 itself after it ran another sequence on other
// blocks; the one at 384 into slots 1 and 2 at once (a 2-sequence prefill and decode batch).
// Refused without any change: positions that are no multiple of the ratios, a snapshot claimed
// at another position or corrupted, slots out of range, a save of a slot replayed from a win_lo
// its window does not reach back to.
enum { T_CTX = 512, T_MAXB = T_CTX / BT, T_L = 420, T_D = 6, T_NP = 3 };

// Feeds positions [from, to) of toks to sequences seqs (n of them, one chunk each step, every row
// of each) in chunks of up to 96 rows in all, and folds whether every row equals cold into *same.
static void tail_feed(di_dsv4_dev_state *st, di_dsv4_dev_seq *seqs, int n, int32_t from, int32_t to,
                      const int32_t *toks, int32_t V, float *got, const float *cold, bool *same) {
    int32_t rows[MAX_ROWS], tk[MAX_ROWS];
    for (int32_t p = from; p < to;) {
        const int32_t per = MAX_ROWS / n, c = to - p < per ? to - p : per;
        for (int i = 0; i < n; i++) {
            seqs[i].pos = p, seqs[i].n_tok = c;
            memcpy(tk + i * c, toks + p, sizeof(int32_t) * (size_t)c);
        }
        for (int32_t r = 0; r < n * c; r++) rows[r] = r;
        CHECK_EQ(di_dsv4_dev_forward(st, seqs, n, tk, rows, n * c, got), DI_OK);
        for (int i = 0; i < n; i++)
            *same = *same && memcmp(got + (int64_t)i * c * V, cold + (int64_t)p * V,
                                    sizeof(float) * (size_t)c * (size_t)V) == 0;
        p += c;
    }
}

// Decodes T_D tokens (dtok) on seqs from position T_L, each step's logits against cold_dec.
static void tail_decode(di_dsv4_dev_state *st, di_dsv4_dev_seq *seqs, int n, const int32_t *dtok,
                        int32_t V, float *got, const float *cold_dec, bool *same) {
    for (int32_t j = 0; j < T_D; j++) {
        int32_t tk[N_SLOTS], rows[N_SLOTS];
        for (int i = 0; i < n; i++) {
            seqs[i].pos = T_L + j, seqs[i].n_tok = 1;
            tk[i] = dtok[j], rows[i] = i;
        }
        CHECK_EQ(di_dsv4_dev_forward(st, seqs, n, tk, rows, n, got), DI_OK);
        for (int i = 0; i < n; i++)
            *same = *same && memcmp(got + (int64_t)i * V, cold_dec + (int64_t)j * V,
                                    sizeof(float) * (size_t)V) == 0;
    }
}

static void test_tail(void) {
    harness_ctx h;
    if (!open_ctx(&h, g_dir)) {
        CHECK(false);
        close_ctx(&h);
        return;
    }
    const di_hparams *hp = &h.m->hp;
    const int32_t V = h.V, pts[T_NP] = {128, 256, 384};
    // Blocks: slot 0's cold run A, slot 1's and 2's own, and S for slot 0's other sequence.
    int32_t A[T_MAXB], B1[T_MAXB], B2[T_MAXB], S[T_MAXB];
    for (int32_t j = 0; j < T_MAXB; j++)
        A[j] = 3 * j + 2, B1[j] = 3 * j, B2[j] = 3 * j + 1, S[j] = 3 * T_MAXB + j;
    di_dsv4_dev_state *st = NULL;
    CHECK_EQ(di_dsv4_dev_state_create(h.d, N_SLOTS, T_CTX, MAX_ROWS, 4 * T_MAXB, BT, &st), DI_OK);
    // The snapshot's size: header, every layer's W - 1 window rows, CSA's last m = 4 rows of its
    // main and indexer C and Z rings (2-fold windows); nothing of HCA's.
    size_t want = 16;
    for (int il = 0; il < hp->n_layer; il++) {
        const di_dsv4_layer_w *lw = &h.m->layers[il];
        want += (size_t)(hp->window - 1) * (size_t)di_dsv4_dev_state_kv_row_bytes(h.st);
        if (lw->ratio == 4)
            want += 2 * 4 * sizeof(float) * (size_t)(2 * lw->cmp.d + 2 * lw->idx_cmp.d);
    }
    const size_t tb = di_dsv4_dev_tail_bytes(h.d);
    CHECK_EQ((int64_t)tb, (int64_t)want);
    int32_t toks[T_CTX], other[T_CTX], dtok[T_D];
    for (int32_t t = 0; t < T_CTX; t++)
        toks[t] = token_of(0, 9, t, V), other[t] = token_of(1, 3, t, V);
    for (int32_t j = 0; j < T_D; j++) dtok[j] = token_of(2, 5, j, V);
    float *cold = malloc(sizeof(float) * (size_t)T_L * (size_t)V);
    float *cold_dec = malloc(sizeof(float) * (size_t)T_D * (size_t)V);
    float *got = malloc(sizeof(float) * (size_t)MAX_ROWS * (size_t)V);
    uint8_t *snap = malloc(tb * T_NP), *bad = malloc(tb);
    if (!st || !cold || !cold_dec || !got || !snap || !bad) {
        CHECK(false);
        goto done;
    }
    { // cold: slot 0, chunks ending at each snapshot point, saved there
        int32_t rows[MAX_ROWS];
        for (int32_t r = 0; r < MAX_ROWS; r++) rows[r] = r;
        int k = 0;
        for (int32_t p = 0; p < T_L;) {
            int32_t n = T_L - p < 96 ? T_L - p : 96;
            if (k < T_NP && p + n > pts[k]) n = pts[k] - p;
            di_dsv4_dev_seq sq = {.slot = 0, .pos = p, .n_tok = n, .blocks = A, .n_blocks = T_MAXB};
            CHECK_EQ(di_dsv4_dev_forward(st, &sq, 1, toks + p, rows, n, cold + (int64_t)p * V),
                     DI_OK);
            p += n;
            if (k < T_NP && p == pts[k])
                CHECK_EQ(di_dsv4_dev_tail_save(st, 0, snap + tb * k++), DI_OK);
        }
        CHECK_EQ(k, T_NP);
        if (h.d1) { // (m) the 1-stage forward's snapshots of the same run: the same bytes
            di_dsv4_dev_state *s1 = NULL;
            CHECK_EQ(di_dsv4_dev_state_create(h.d1, 1, T_CTX, MAX_ROWS, 4 * T_MAXB, BT, &s1),
                     DI_OK);
            CHECK_EQ((int64_t)di_dsv4_dev_tail_bytes(h.d1), (int64_t)tb);
            uint8_t *snap1 = malloc(tb);
            for (int32_t p = 0, j = 0; s1 && snap1 && p < T_L;) {
                int32_t n = T_L - p < 96 ? T_L - p : 96;
                if (j < T_NP && p + n > pts[j]) n = pts[j] - p;
                di_dsv4_dev_seq sq = {
                    .slot = 0, .pos = p, .n_tok = n, .blocks = A, .n_blocks = T_MAXB};
                CHECK_EQ(di_dsv4_dev_forward(s1, &sq, 1, toks + p, rows, n, got), DI_OK);
                p += n;
                if (j < T_NP && p == pts[j]) {
                    CHECK_EQ(di_dsv4_dev_tail_save(s1, 0, snap1), DI_OK);
                    CHECK(memcmp(snap1, snap + tb * j++, tb) == 0);
                }
            }
            CHECK(snap1 != NULL);
            free(snap1);
            di_dsv4_dev_state_destroy(s1);
        }
        di_dsv4_dev_seq sq = {.slot = 0, .blocks = A, .n_blocks = T_MAXB};
        for (int32_t j = 0; j < T_D; j++) { // the cold decode: its logits are the reference
            sq.pos = T_L + j, sq.n_tok = 1;
            CHECK_EQ(di_dsv4_dev_forward(st, &sq, 1, dtok + j, rows, 1, cold_dec + (int64_t)j * V),
                     DI_OK);
        }
    }
    // Refused, nothing changed: slot 0 stays at T_L + T_D, slot 1 at 0.
    CHECK_EQ(di_dsv4_dev_tail_save(st, 0, bad), DI_ERR_INVALID); // 426: no multiple of 4 or 128
    CHECK_EQ(di_dsv4_dev_tail_save(st, N_SLOTS, bad), DI_ERR_INVALID);
    CHECK_EQ(di_dsv4_dev_tail_restore(st, 1, 100, snap), DI_ERR_INVALID);
    CHECK_EQ(di_dsv4_dev_tail_restore(st, 1, 256, snap), DI_ERR_INVALID); // taken at 128
    CHECK_EQ(di_dsv4_dev_tail_restore(st, -1, 128, snap), DI_ERR_INVALID);
    memcpy(bad, snap, tb);
    bad[0] ^= 1;
    CHECK_EQ(di_dsv4_dev_tail_restore(st, 1, 128, bad), DI_ERR_INVALID);
    CHECK_EQ(di_dsv4_dev_n_past(st, 0), T_L + T_D);
    CHECK_EQ(di_dsv4_dev_n_past(st, 1), 0);
    { // a slot replayed from win_lo 120 on A's first block: at 128 its window starts at 120
        di_dsv4_dev_seq rq = {.slot = 2,
                              .pos = 120,
                              .n_tok = 8,
                              .blocks = A,
                              .n_blocks = T_MAXB,
                              .win_lo = 120,
                              .n_cached = BT};
        int32_t r0 = 0;
        CHECK_EQ(di_dsv4_dev_forward(st, &rq, 1, toks + 120, &r0, 1, got), DI_OK);
        CHECK_EQ(di_dsv4_dev_n_past(st, 2), 128);
        CHECK_EQ(di_dsv4_dev_tail_save(st, 2, bad), DI_ERR_INVALID);
    }
    bool same = true;
    int64_t n_restored = 0;
    di_dsv4_dev_graph_stats g0, g1;
    // Each snapshot into slot 1: A's blocks before it, B1's after.
    for (int k = 0; k < T_NP; k++) {
        int32_t blk[T_MAXB];
        for (int32_t j = 0; j < T_MAXB; j++) blk[j] = j < pts[k] / BT ? A[j] : B1[j];
        CHECK_EQ(di_dsv4_dev_tail_restore(st, 1, pts[k], snap + tb * k), DI_OK);
        CHECK_EQ(di_dsv4_dev_n_past(st, 1), pts[k]);
        di_dsv4_dev_seq sq = {.slot = 1, .blocks = blk, .n_blocks = T_MAXB, .n_cached = pts[k]};
        tail_feed(st, &sq, 1, pts[k], T_L, toks, V, got, cold, &same);
        di_dsv4_dev_get_graph_stats(st, &g0);
        tail_decode(st, &sq, 1, dtok, V, got, cold_dec, &same);
        di_dsv4_dev_get_graph_stats(st, &g1);
        CHECK_EQ(g1.n_replayed - g0.n_replayed, T_D); // every decode step from the cached graph
        n_restored++;
    }
    { // slot 0 runs another sequence on S, then takes the snapshot at 256 back (A's first two)
        di_dsv4_dev_seq sq = {.slot = 0, .blocks = S, .n_blocks = T_MAXB};
        bool ignore = true;
        tail_feed(st, &sq, 1, 0, 100, other, V, got, cold, &ignore);
        const int32_t blk[T_MAXB] = {A[0], A[1], S[2], S[3]};
        CHECK_EQ(di_dsv4_dev_tail_restore(st, 0, 256, snap + tb), DI_OK);
        di_dsv4_dev_seq s0 = {.slot = 0, .blocks = blk, .n_blocks = T_MAXB, .n_cached = 256};
        tail_feed(st, &s0, 1, 256, T_L, toks, V, got, cold, &same);
        tail_decode(st, &s0, 1, dtok, V, got, cold_dec, &same);
        n_restored++;
    }
    { // the snapshot at 384 into slots 1 and 2 at once, both continued in the same calls
        int32_t b1[T_MAXB], b2[T_MAXB];
        for (int32_t j = 0; j < T_MAXB; j++)
            b1[j] = j < 3 ? A[j] : B1[j], b2[j] = j < 3 ? A[j] : B2[j];
        CHECK_EQ(di_dsv4_dev_tail_restore(st, 1, 384, snap + 2 * tb), DI_OK);
        CHECK_EQ(di_dsv4_dev_tail_restore(st, 2, 384, snap + 2 * tb), DI_OK);
        di_dsv4_dev_seq two[2] = {{.slot = 1, .blocks = b1, .n_blocks = T_MAXB, .n_cached = 384},
                                  {.slot = 2, .blocks = b2, .n_blocks = T_MAXB, .n_cached = 384}};
        tail_feed(st, two, 2, 384, T_L, toks, V, got, cold, &same);
        di_dsv4_dev_get_graph_stats(st, &g0);
        tail_decode(st, two, 2, dtok, V, got, cold_dec, &same);
        di_dsv4_dev_get_graph_stats(st, &g1);
        CHECK(g1.n_replayed > g0.n_replayed); // the 2-sequence graph: direct, captured, launched
        n_restored += 2;
    }
    fprintf(stderr,
            "(k) tail snapshots of %zu bytes at 128, 256, 384: %lld restores continued to %d "
            "and decoded %d tokens: %s the cold run\n",
            tb, (long long)n_restored, T_L, T_D, same ? "bit-identical to" : "DIFFERENT FROM");
    CHECK(same);
done:
    free(cold), free(cold_dec), free(got), free(snap), free(bad);
    di_dsv4_dev_state_destroy(st);
    close_ctx(&h);
}

// (h) the official recipe: the same checks, models loaded with DI_PRECISION_OFFICIAL.
static void test_official(void) {
    g_prec = DI_PRECISION_OFFICIAL;
    one_sequence(g_dir, "(h) official recipe: tiny-128 (FP8/FP4), one sequence");
    one_sequence("tests/data/fixtures/hca128/official", "(h) official recipe: hca128, official");
    one_sequence("tests/data/fixtures/hca128/hf", "(h) official recipe: hca128, hf layout");
    test_ragged();
    test_attach();
    test_graphs();
    test_prefix();
    test_tail();
    g_prec = DI_PRECISION_FP32;
}

// (i) The model refuses what the forward does not do: DeepSeek V4.1 (either recipe).
static void test_unsupported(void) {
    di_model_options mo = di_model_options_default();
    mo.n_threads = 1;
    mo.precision = DI_PRECISION_OFFICIAL;
    di_model *m = NULL;
    di_backend *b = NULL;
    di_dsv4_dev *d = NULL;
    CHECK(di_model_load("tests/data/fixtures/v41_tiny/official", &mo, &m) == DI_OK);
    CHECK(di_cpu_backend_create(1, &b) == DI_OK);
    if (m && b) CHECK_EQ(di_dsv4_dev_create(m, b, &d), DI_ERR_UNSUPPORTED);
    CHECK(d == NULL);
    di_device cuda = {.kind = DI_DEVICE_CUDA};
    di_backend *cb = NULL;
    if (di_device_check(&cuda) == DI_ERR_UNSUPPORTED) // a build without CUDA
        CHECK_EQ(di_backend_open(&cuda, 1, &cb), DI_ERR_UNSUPPORTED);
    di_backend_destroy(cb);
    di_model_destroy(m);
    di_backend_destroy(b);
}

// (l) The MTP block (dsv4_dev.h "MTP"): a state of 3 slots with the MTP block enabled against 3
// CPU sessions created with MTP (di_session_options.mtp), fed the same tokens. A ragged prefill
// (chunks straddling the 16-row window and the CSA / HCA windows), then decode steps that verify
// two rows per slot ([the token, a draft]): every other draft is wrong and taken back
// (di_dsv4_dev_rollback), including rows that close a CSA window and the first HCA window (128)
// and rows that wrap the window ring; after each main call the MTP call runs on the kept rows
// (positions p, with the token at p + 1). The dev MTP logits of every position and the main
// logits of the kept rows are bit-identical (memcmp) to the sessions', the verify steps replaying
// their decode graph (3 sequences of 2 rows). A second rollback, a rollback to win_lo, an MTP call
// not continuing its ring and enabling after a state exists are refused; the tail grows by the MTP
// ring's W - 1 rows, and a slot restored from a snapshot continues with main and MTP logits
// bit-identical to the slot it was taken from (mtp_tail).
enum { MTP_CTX = 160 };

// The tail with the MTP ring: slot 0 restarted, fed 128 positions (a block boundary) with its MTP
// calls, its tail saved and restored into slot 1 (on slot 0's first block); then both feed the
// same 12 tokens: main and MTP logits bit-identical (memcmp), so the MTP ring came back exactly.
static void mtp_tail(const di_dsv4_dev *d, di_dsv4_dev_state *st, int32_t blk[N_SLOTS][MAXB],
                     int32_t V, float *got, float *ml) {
    const size_t VB = sizeof(float) * (size_t)V;
    int32_t tok[MAX_ROWS], nxt[MAX_ROWS], rows[MAX_ROWS];
    for (int32_t t = 0; t < MAX_ROWS; t++) rows[t] = t;
    const int32_t chunks[2][2] = {{0, 96}, {96, 32}};
    for (int c = 0; c < 2; c++) {
        const int32_t p0 = chunks[c][0], n = chunks[c][1];
        di_dsv4_dev_seq sq = {.slot = 0, .pos = p0, .n_tok = n, .blocks = blk[0], .n_blocks = MAXB};
        for (int32_t t = 0; t < n; t++) {
            tok[t] = token_of(0, 1, p0 + t, V);
            nxt[t] = token_of(0, 1, p0 + t + 1, V);
        }
        CHECK_EQ(di_dsv4_dev_forward(st, &sq, 1, tok, NULL, 0, NULL), DI_OK);
        CHECK_EQ(di_dsv4_dev_mtp_forward(st, &sq, 1, rows, nxt, NULL, 0, NULL), DI_OK);
    }
    uint8_t *snap = malloc(di_dsv4_dev_tail_bytes(d));
    if (!snap) return;
    CHECK_EQ(di_dsv4_dev_tail_save(st, 0, snap), DI_OK);
    CHECK_EQ(di_dsv4_dev_tail_restore(st, 1, 128, snap), DI_OK);
    CHECK_EQ(di_dsv4_dev_mtp_n_past(st, 1), 128);
    const int32_t blk1[MAXB] = {blk[0][0], blk[1][1], blk[1][2]};
    float *out[2] = {got, ml}; // slot 0's, slot 1's: main logits then MTP logits, 12 rows each
    for (int s = 0; s < 2; s++) {
        di_dsv4_dev_seq sq = {.slot = s,
                              .pos = 128,
                              .n_tok = 12,
                              .blocks = s ? blk1 : blk[0],
                              .n_blocks = MAXB,
                              .n_cached = s ? 128 : 0};
        for (int32_t t = 0; t < 12; t++) {
            tok[t] = token_of(0, 1, 128 + t, V);
            nxt[t] = token_of(0, 1, 129 + t, V);
        }
        CHECK_EQ(di_dsv4_dev_forward(st, &sq, 1, tok, rows, 12, out[s]), DI_OK);
        CHECK_EQ(di_dsv4_dev_mtp_forward(st, &sq, 1, rows, nxt, rows, 12, out[s] + 12 * V), DI_OK);
    }
    CHECK(memcmp(got, ml, VB * 24) == 0);
    free(snap);
}

static void mtp_run(di_precision prec) {
    di_model_options mo = di_model_options_default();
    mo.n_threads = 2;
    mo.precision = prec;
    di_model *m = NULL;
    di_backend *b[MAX_STAGES] = {0};
    di_dsv4_dev *d = NULL;
    di_dsv4_dev_state *st = NULL;
    di_session *ses[N_SLOTS] = {0};
    CHECK(di_model_load(g_dir, &mo, &m) == DI_OK);
    if (!m) goto done;
    CHECK(m->n_mtp_loaded == 1);
    CHECK(make_dev(m, 2, b, &d));
    if (!d) goto done;
    const size_t tb0 = di_dsv4_dev_tail_bytes(d);
    CHECK(!di_dsv4_dev_has_mtp(d));
    CHECK_EQ(di_dsv4_dev_mtp_enable(d), DI_OK);
    CHECK(di_dsv4_dev_has_mtp(d));
    const int32_t V = m->hp.n_vocab, W = m->hp.window;
    CHECK(di_dsv4_dev_state_create(d, N_SLOTS, MTP_CTX, MAX_ROWS, N_BLK, BT, &st) == DI_OK);
    if (!st) goto done;
    CHECK_EQ((int64_t)di_dsv4_dev_tail_bytes(d),
             (int64_t)tb0 + (int64_t)(W - 1) * di_dsv4_dev_state_kv_row_bytes(st));
    CHECK_EQ(di_dsv4_dev_mtp_enable(d), DI_OK); // no-op once enabled
    di_session_options so = {.n_ctx_max = MTP_CTX, .mtp = true};
    for (int i = 0; i < N_SLOTS; i++) CHECK(di_session_create(m, &so, &ses[i]) == DI_OK);
    harness_ctx hb; // the shuffled block sets of the harness
    shuffle_blocks(&hb);
    const size_t VB = sizeof(float) * (size_t)V;
    // Per slot and position: the dev's and the session's MTP logits.
    float *dev_ml = calloc((size_t)N_SLOTS * MTP_CTX, VB),
          *cpu_ml = calloc((size_t)N_SLOTS * MTP_CTX, VB);
    float *got = malloc(VB * MAX_ROWS), *ref = malloc(VB * MAX_ROWS), *ml = malloc(VB * MAX_ROWS);
    int32_t cpu_hi[N_SLOTS] = {0}, dev_hi[N_SLOTS] = {0}; // positions compared so far (exclusive)
    // (n) the MTP call's greedy picks (di_dsv4_dev_mtp_forward_picks: every other row at odd
    // steps), per slot and position; -1: the row's logits came down.
    int32_t *dev_pick = malloc(sizeof(int32_t) * (size_t)N_SLOTS * MTP_CTX);
    int64_t n_mpicked = 0;
    if (!dev_ml || !cpu_ml || !got || !ref || !ml || !dev_pick) goto free_all;
    for (int64_t i = 0; i < (int64_t)N_SLOTS * MTP_CTX; i++) dev_pick[i] = -1;
    // Ragged prefill (3 calls), then 24 verify steps of every slot.
    const int32_t pre[3][N_SLOTS] = {{37, 5, 1}, {40, 17, 16}, {33, 30, 15}};
    int64_t n_rolled = 0;
    for (int stp = 0; stp < 3 + 24; stp++) {
        const bool verify = stp >= 3;
        di_dsv4_dev_seq seqs[N_SLOTS], ms[N_SLOTS];
        int32_t tok[MAX_ROWS], rows[MAX_ROWS], xr[MAX_ROWS], nxt[MAX_ROWS], mrows[MAX_ROWS];
        bool wrong[N_SLOTS];
        int32_t T = 0, n_rows = 0, n_m = 0, n_mrows = 0;
        for (int s = 0; s < N_SLOTS; s++) {
            const int32_t pos = di_session_n_past(ses[s]), n = verify ? 2 : pre[stp][s];
            // Drafts: wrong at odd steps of slot 0 and 2, even ones of slot 1.
            wrong[s] = verify && ((stp + s) % 2 == 1);
            seqs[s] = (di_dsv4_dev_seq){
                .slot = s, .pos = pos, .n_tok = n, .blocks = hb.blk[s], .n_blocks = MAXB};
            for (int32_t t = 0; t < n; t++) tok[T + t] = token_of(s, 0, pos + t, V);
            if (wrong[s]) tok[T + 1] = (tok[T + 1] + 1) % V;
            // Logits of every row (a verify step: the decode graphs of 2 rows per sequence).
            for (int32_t t = 0; t < n; t++) rows[n_rows++] = T + t;
            T += n;
        }
        CHECK_EQ(di_dsv4_dev_forward(st, seqs, N_SLOTS, tok, rows, n_rows, got), DI_OK);
        int32_t r0 = 0;
        for (int s = 0; s < N_SLOTS; s++) {
            const int32_t pos = seqs[s].pos, keep = seqs[s].n_tok - (wrong[s] ? 1 : 0);
            if (wrong[s]) {
                CHECK_EQ(di_dsv4_dev_rollback(st, s, pos + keep), DI_OK);
                CHECK_EQ(di_dsv4_dev_rollback(st, s, pos + keep - 1), DI_ERR_INVALID); // 2 rows
                n_rolled++;
            }
            // The session: the kept tokens (correct ones), every row's logits and MTP logits.
            int32_t ct[MAX_ROWS], n_mtp = 0;
            for (int32_t t = 0; t < keep; t++) ct[t] = token_of(s, 0, pos + t, V);
            di_forward_out fo = {.logits = ref, .mtp_logits = ml, .n_mtp_out = &n_mtp};
            CHECK_EQ(di_session_forward(ses[s], ct, keep, &fo), DI_OK);
            CHECK(memcmp(ref, got + (int64_t)r0 * V, VB * (size_t)keep) == 0);
            const int32_t p_first = pos == 0 ? 0 : pos - 1;
            CHECK_EQ(p_first + n_mtp, pos + keep - 1);
            memcpy(cpu_ml + ((int64_t)s * MTP_CTX + p_first) * V, ml, VB * (size_t)n_mtp);
            cpu_hi[s] = p_first + n_mtp;
            CHECK_EQ(di_dsv4_dev_n_past(st, s), pos + keep);
            // The dev MTP call: the kept rows, each with the token after it.
            ms[n_m++] = (di_dsv4_dev_seq){.slot = s, .pos = pos, .n_tok = keep};
            for (int32_t t = 0; t < keep; t++) {
                xr[n_mrows] = r0 + t;
                nxt[n_mrows] = token_of(s, 0, pos + t + 1, V);
                mrows[n_mrows] = n_mrows;
                n_mrows++;
            }
            r0 += seqs[s].n_tok;
        }
        uint8_t greedy[MAX_ROWS];
        int32_t picks[MAX_ROWS];
        for (int32_t k = 0; k < n_mrows; k++) greedy[k] = stp % 2 == 1 && k % 2 == 0;
        CHECK_EQ(
            di_dsv4_dev_mtp_forward_picks(st, ms, n_m, xr, nxt, mrows, n_mrows, got, greedy, picks),
            DI_OK);
        for (int i = 0, r = 0; i < n_m; r += ms[i].n_tok, i++) {
            const int s = ms[i].slot;
            memcpy(dev_ml + ((int64_t)s * MTP_CTX + ms[i].pos) * V, got + (int64_t)r * V,
                   VB * (size_t)ms[i].n_tok);
            for (int32_t t = 0; t < ms[i].n_tok; t++)
                dev_pick[s * MTP_CTX + ms[i].pos + t] = greedy[r + t] ? picks[r + t] : -1;
            dev_hi[s] = ms[i].pos + ms[i].n_tok;
            CHECK_EQ(di_dsv4_dev_mtp_n_past(st, s), dev_hi[s]);
        }
        // The MTP streams replaced the main ones: another MTP call needs a main call first.
        CHECK_EQ(di_dsv4_dev_mtp_forward(st, ms, 1, xr, nxt, NULL, 0, NULL), DI_ERR_INVALID);
    }
    CHECK(n_rolled >= 30);
    di_dsv4_dev_graph_stats gs;
    di_dsv4_dev_get_graph_stats(st, &gs);
    CHECK_EQ(gs.n_captured, 1); // the verify steps of 3 sequences: one direct, one captured
    CHECK_EQ(gs.n_replayed, 24 - 2);
    CHECK(di_session_n_past(ses[0]) > 128); // slot 0's rejected rows crossed the first HCA window
    for (int s = 0; s < N_SLOTS; s++) {
        CHECK_EQ(dev_hi[s], cpu_hi[s] + 1); // the session's last position waits for its token
        for (int32_t p = 0; p < cpu_hi[s]; p++) {
            const int64_t o = ((int64_t)s * MTP_CTX + p) * V;
            if (dev_pick[s * MTP_CTX + p] >= 0) { // a draft: the argmax of the session's row
                CHECK_EQ(dev_pick[s * MTP_CTX + p], di_argmax(cpu_ml + o, V));
                n_mpicked++;
            } else {
                CHECK(memcmp(dev_ml + o, cpu_ml + o, VB) == 0);
            }
        }
    }
    CHECK(n_mpicked >= 24);
    // Refusals: two rows back, to win_lo (0), an MTP call that does not continue its ring.
    CHECK_EQ(di_dsv4_dev_rollback(st, 0, di_dsv4_dev_n_past(st, 0) - 2), DI_ERR_INVALID);
    CHECK_EQ(di_dsv4_dev_rollback(st, 5, 0), DI_ERR_INVALID);
    {
        di_dsv4_dev_seq sq = {.slot = 1,
                              .pos = di_dsv4_dev_n_past(st, 1),
                              .n_tok = 1,
                              .blocks = hb.blk[1],
                              .n_blocks = MAXB};
        int32_t t0[2] = {3, 4}, r[2] = {0, 0};
        CHECK_EQ(di_dsv4_dev_forward(st, &sq, 1, t0, r, 1, got), DI_OK);
        sq.pos -= 1; // the MTP ring is one behind the main one: an earlier start is refused
        CHECK_EQ(di_dsv4_dev_mtp_forward(st, &sq, 1, r, t0, NULL, 0, NULL), DI_ERR_INVALID);
        sq.pos += 1, sq.n_tok = 2; // ... and so are rows past what the main ring consumed
        CHECK_EQ(di_dsv4_dev_mtp_forward(st, &sq, 1, r, t0, NULL, 0, NULL), DI_ERR_INVALID);
        sq.n_tok = 1; // the continuation runs
        CHECK_EQ(di_dsv4_dev_mtp_forward(st, &sq, 1, r, t0, NULL, 0, NULL), DI_OK);
    }
    CHECK_EQ(di_dsv4_dev_mtp_enable(d), DI_OK);
    mtp_tail(d, st, hb.blk, V, got, ml);
free_all:
    free(dev_pick);
    free(dev_ml);
    free(cpu_ml);
    free(got);
    free(ref);
    free(ml);
done:
    for (int i = 0; i < N_SLOTS; i++) di_session_destroy(ses[i]);
    di_dsv4_dev_state_destroy(st);
    di_dsv4_dev_destroy(d);
    free_backends(b);
    di_model_destroy(m);
}

static void test_mtp(void) {
    // Under AddressSanitizer (CI's sanitized stage) a memory check: the official recipe only (the
    // FP32 recipe's ops and its rounding ops); the release stage checks both. The sanitized
    // stage's total is what keeps CI under 20 minutes.
#if !defined(__SANITIZE_ADDRESS__)
    mtp_run(DI_PRECISION_FP32);
#endif
    mtp_run(DI_PRECISION_OFFICIAL);
    // Enabled after a state exists: that state keeps no MTP ring (its MTP calls and tail
    // snapshots refused), the states made afterwards have one.
    di_model_options mo = di_model_options_default();
    mo.n_threads = 1;
    di_model *m = NULL;
    di_backend *b[MAX_STAGES] = {0};
    di_dsv4_dev *d = NULL;
    di_dsv4_dev_state *st = NULL;
    CHECK(di_model_load(g_dir, &mo, &m) == DI_OK);
    if (m) CHECK(make_dev(m, 1, b, &d));
    if (d) CHECK(di_dsv4_dev_state_create(d, 1, 64, 8, 0, 0, &st) == DI_OK);
    di_dsv4_dev_state *st2 = NULL;
    if (st) {
        CHECK_EQ(di_dsv4_dev_mtp_enable(d), DI_OK);
        CHECK(di_dsv4_dev_state_create(d, 1, 64, 8, 0, 0, &st2) == DI_OK);
        const int32_t tok[4] = {1, 2, 3, 4}, rows[1] = {0}, ids[1] = {5};
        const di_dsv4_dev_seq sq = {.slot = 0, .pos = 0, .n_tok = 4};
        const di_dsv4_dev_seq mq = {.slot = 0, .pos = 0, .n_tok = 1};
        uint8_t *tail = malloc(di_dsv4_dev_tail_bytes(d));
        CHECK(st2 && tail);
        for (int k = 0; st2 && tail && k < 2; k++) {
            di_dsv4_dev_state *t = k ? st2 : st;
            CHECK_EQ(di_dsv4_dev_tail_save(t, 0, tail), k ? DI_OK : DI_ERR_INVALID); // at 0
            CHECK_EQ(di_dsv4_dev_forward(t, &sq, 1, tok, NULL, 0, NULL), DI_OK);
            CHECK_EQ(di_dsv4_dev_mtp_forward(t, &mq, 1, rows, ids, NULL, 0, NULL),
                     k ? DI_OK : DI_ERR_INVALID);
        }
        free(tail);
    }
    di_dsv4_dev_state_destroy(st);
    di_dsv4_dev_state_destroy(st2);
    di_dsv4_dev_destroy(d);
    free_backends(b);
    di_model_destroy(m);
}

// (m) The split (di_dsv4_dev_split): contiguous ranges covering every layer, at least one each,
// the stages' weight bytes adding up to the model's and balanced as well as whole layers allow
// (no stage exceeds the even share by more than one layer's bytes); what the stages report;
// refused: no stage, more stages than layers (tiny-128 has 6) or than the most.
static void test_split(void) {
    di_model_options mo = di_model_options_default();
    mo.n_threads = 1;
    di_model *m = NULL;
    CHECK(di_model_load(g_dir, &mo, &m) == DI_OK);
    if (!m) return;
    const int32_t L = m->hp.n_layer;
    int32_t l0[DI_DSV4_DEV_MAX_STAGES + 1];
    int64_t bytes[DI_DSV4_DEV_MAX_STAGES], one = 0;
    CHECK_EQ(di_dsv4_dev_split(m, 1, l0, bytes), DI_OK);
    CHECK(l0[0] == 0 && l0[1] == L);
    one = bytes[0];
    // One layer per stage: the biggest one-layer stage bounds how far a cut is from its share.
    int64_t per[DI_DSV4_DEV_MAX_STAGES], big1 = 0;
    CHECK_EQ(di_dsv4_dev_split(m, L, l0, per), DI_OK);
    for (int32_t k = 0; k < L; k++) {
        CHECK_EQ(l0[k], k);
        if (per[k] > big1) big1 = per[k];
    }
    for (int32_t n = 2; n <= L; n++) {
        CHECK_EQ(di_dsv4_dev_split(m, n, l0, bytes), DI_OK);
        int64_t sum = 0, big = 0;
        for (int32_t k = 0; k < n; k++) {
            CHECK(l0[k + 1] > l0[k]);
            sum += bytes[k];
        }
        for (int32_t k = 0; k < n; k++)
            if (bytes[k] > big) big = bytes[k];
        CHECK(big <= one / n + big1);
        CHECK(l0[0] == 0 && l0[n] == L);
        CHECK_EQ(sum, one);
        fprintf(stderr, "(m) %d stages:", n);
        for (int32_t k = 0; k < n; k++)
            fprintf(stderr, " [%d, %d) %.2f MiB", l0[k], l0[k + 1], bytes[k] / 1048576.0);
        fprintf(stderr, "\n");
        if (n == 2) CHECK(big < one); // both stages hold something
    }
    CHECK_EQ(di_dsv4_dev_split(m, 0, l0, bytes), DI_ERR_INVALID);
    CHECK_EQ(di_dsv4_dev_split(m, L + 1, l0, bytes), DI_ERR_INVALID);
    CHECK_EQ(di_dsv4_dev_split(m, DI_DSV4_DEV_MAX_STAGES + 1, l0, bytes), DI_ERR_INVALID);
    di_backend *b[8] = {0};
    for (int k = 0; k < 8; k++) CHECK(di_cpu_backend_create(1, &b[k]) == DI_OK);
    di_dsv4_dev *d = NULL;
    CHECK_EQ(di_dsv4_dev_create_stages(m, b, L + 1, &d), DI_ERR_INVALID);
    CHECK_EQ(di_dsv4_dev_create_stages(m, b, 0, &d), DI_ERR_INVALID);
    CHECK(d == NULL);
    // Two stages on the same backend (cuda:0,0's shape) that cannot say its memory: the weight
    // split (di_dsv4_dev_split_mem's fallback), and what the stages report.
    di_backend *same[2] = {b[0], b[0]};
    di_cpu_backend_set_mem(b[0], 1, 0);
    CHECK_EQ(di_dsv4_dev_create_stages(m, same, 2, &d), DI_OK);
    di_cpu_backend_set_mem(b[0], 0, 0);
    if (d) {
        int32_t a0 = -1, a1 = -1, c0 = -1, c1 = -1;
        CHECK_EQ(di_dsv4_dev_split(m, 2, l0, NULL), DI_OK);
        CHECK(di_dsv4_dev_stage(d, 0, &a0, &a1) == b[0]);
        CHECK(di_dsv4_dev_stage(d, 1, &c0, &c1) == b[0]);
        CHECK(a0 == 0 && a1 == l0[1] && c0 == l0[1] && c1 == L);
        CHECK(di_dsv4_dev_stage(d, 2, &a0, &a1) == NULL);
        CHECK(di_dsv4_dev_backend(d) == b[0]);
    }
    di_dsv4_dev_destroy(d);
    d = NULL;
    // The KV-aware split (di_dsv4_dev_split_mem): stage 1 just short of one sequence's blocks on
    // the weight split, which the memory moves; the backends reporting those budgets (plus the
    // reserve) get the same split from create_stages.
    di_model_destroy(m);
    m = NULL;
    mo.dev_slots = 2, mo.dev_ctx = 256, mo.dev_rows = 32, mo.dev_reserve_bytes = 4096;
    CHECK(di_model_load(g_dir, &mo, &m) == DI_OK);
    if (!m) return;
    CHECK_EQ(di_dsv4_dev_split(m, 2, l0, NULL), DI_OK);
    di_dev_stage_cost w0, w1;
    di_dsv4_dev_stage_cost(m, 0, l0[1], &w0);
    di_dsv4_dev_stage_cost(m, l0[1], L, &w1);
    const int32_t bt = di_kv_block_tokens(m), n_one = (256 + bt - 1) / bt;
    const int64_t budget[2] = {4 * (w0.weight_bytes + w0.fixed_bytes + w1.weight_bytes +
                                    w1.fixed_bytes +
                                    64 * n_one * (w0.block_bytes + w1.block_bytes)),
                               w1.weight_bytes + w1.fixed_bytes + n_one * w1.block_bytes - 1};
    di_dev_split_out sp;
    CHECK_EQ(di_dsv4_dev_split_mem(m, 2, NULL, &sp), DI_OK);
    CHECK(!sp.by_memory && sp.layer0[1] == l0[1]);
    CHECK_EQ(di_dsv4_dev_split_mem(m, 2, budget, &sp), DI_OK);
    CHECK(sp.layer0[1] != l0[1] && sp.n_blocks >= n_one);
    fprintf(stderr,
            "(m) KV-aware: weights [0, %d) [%d, %d), memory [0, %d) [%d, %d): %lld blocks\n", l0[1],
            l0[1], L, sp.layer0[1], sp.layer0[1], L, (long long)sp.n_blocks);
    for (int k = 0; k < 2; k++)
        di_cpu_backend_set_mem(b[k], (size_t)budget[k] + 4096, 2 * (size_t)budget[k] + 4096);
    CHECK_EQ(di_dsv4_dev_create_stages(m, b, 2, &d), DI_OK);
    if (d) {
        int32_t a0 = -1, a1 = -1;
        CHECK(di_dsv4_dev_stage(d, 1, &a0, &a1) == b[1]);
        CHECK(a0 == sp.layer0[1] && a1 == L);
    }
    di_dsv4_dev_destroy(d);
    const int64_t tiny[2] = {budget[0], w1.weight_bytes / 4};
    CHECK_EQ(di_dsv4_dev_split_mem(m, 2, tiny, &sp), DI_ERR_NOMEM);
    // With speculation planned (dev_spec) the last stage counts the MTP block and the embedding
    // copy (di_dsv4_dev_mtp_enable's uploads) and the MTP window ring in its slots.
    if (m->n_mtp_loaded > 0) {
        m->opt.dev_spec = true;
        di_dev_stage_cost s1, s0;
        di_dsv4_dev_stage_cost(m, l0[1], L, &s1);
        di_dsv4_dev_stage_cost(m, 0, l0[1], &s0);
        CHECK(s1.weight_bytes > w1.weight_bytes + (int64_t)di_tensor_bytes(&m->embed));
        CHECK(s1.fixed_bytes > w1.fixed_bytes);
        CHECK_EQ(s0.weight_bytes, w0.weight_bytes);
        CHECK_EQ(s1.block_bytes, w1.block_bytes);
        m->opt.dev_spec = false;
    }
    for (int k = 0; k < 8; k++) di_backend_destroy(b[k]);
    di_model_destroy(m);
}

// Under AddressSanitizer (scripts/test.sh's second stage) --stages is a memory check: 3 stages only
// (a middle stage both receives and hands over); the release stage checks exactness at 2 and 3.
// The sanitized stage's total is what keeps CI under 20 minutes.
#if defined(__SANITIZE_ADDRESS__)
enum { FIRST_STAGES = 3 };
#else
enum { FIRST_STAGES = 2 };
#endif

int main(int argc, char **argv) {
    snprintf(g_dir, sizeof g_dir, "/tmp/di_test_dev_XXXXXX");
    if (!mkdtemp(g_dir)) return 1;
    di_synth_config c;
    CHECK(di_synth_preset("tiny-128", &c) == DI_OK);
    c.n_vocab = V_SYNTH;
    CHECK(di_synth_write(&c, g_dir) == DI_OK);
    if (argc > 1 && strcmp(argv[1], "--deferred") == 0) {
        // --deferred: the scenarios on CPU backends in deferred mode (backend.h
        // di_cpu_backend_set_deferred: work runs at the CUDA stream's sync points only), on one
        // stage, then on 3 (a peer copy, then a host bounce): host code that reads backend memory
        // before a download, or rewrites or frees memory queued work still reads, gives other
        // bits. Under AddressSanitizer (a host buffer freed under queued work) the ragged batch and
        // the tails on 3 stages only.
        setenv("DI_CPU_DEFERRED", "1", 1);
        for (g_stages = FIRST_STAGES == 2 ? 1 : 3; g_stages <= MAX_STAGES; g_stages += 2) {
            fprintf(stderr, "---- deferred, %d pipeline stages ----\n", g_stages);
#if !defined(__SANITIZE_ADDRESS__)
            RUN(test_one_sequence_synth);
            RUN(test_graphs);
            RUN(test_prefix);
            RUN(test_mtp);
#endif
            RUN(test_ragged);
            RUN(test_tail);
        }
        di_test_remove_dir(g_dir);
        return test_finish();
    }
    if (argc > 1 && strcmp(argv[1], "--stages") == 0) { // (m): the scenarios on 2, then 3 stages
        RUN(test_split);
        for (g_stages = FIRST_STAGES; g_stages <= MAX_STAGES; g_stages++) {
            // 3 stages (a middle stage both receiving and handing over): the FP32 scenarios and
            // the MTP (test_mtp says in which recipes); the fixtures, sessions and the official
            // re-runs at 2.
            const bool all = g_stages == 2;
            fprintf(stderr, "---- %d pipeline stages ----\n", g_stages);
            RUN(test_one_sequence_synth);
            if (all) RUN(test_one_sequence_fixture);
            RUN(test_ragged);
            if (all) RUN(test_attach);
            RUN(test_graphs);
            RUN(test_prefix);
            RUN(test_tail);
            if (all) RUN(test_official);
            RUN(test_mtp);
        }
        di_test_remove_dir(g_dir);
        return test_finish();
    }
    RUN(test_one_sequence_synth);
    RUN(test_one_sequence_fixture);
    RUN(test_ragged);
    RUN(test_attach);
    RUN(test_graphs);
    RUN(test_decode_costs);
    RUN(test_decode_costs_flash);
    RUN(test_prefix);
    RUN(test_tail);
    RUN(test_official);
    RUN(test_unsupported);
    RUN(test_mtp);
    di_test_remove_dir(g_dir);
    return test_finish();
}
