// The device-resident V4.1 forward (model/dsv41_dev.h) on the CPU backend against the model's own
// V4.1 CPU forward (di_dsv41_forward_batch, one session per slot) fed the same chunks, on the tiny
// V4.1 model (di_synth_v41_write, official layout: FP8 32x32 / FP4 / Engram FP8; W = 16, layers
// SWA / kv+index source m=2 / reuse m=2 / candidate source m=1 / reuse m=1 / reindex m=1, Engram
// on layers 0 and 1, candidate blocks of 4 entries, 3 kept, top-8). Both sides run the same
// kernels, so every logit must be bit-identical (memcmp):
//   (a) one sequence: prefill chunks straddling the window, the ratio-2 groups and the candidate
//       blocks, then decodes until the candidate pool restricts the reindex layer and the window
//       has wrapped many times;
//   (b) a ragged batch of 3 slots at different positions in one call (prefill chunks and decodes
//       mixed), every row's logits;
//   (c) a slot restarted at position 0 inside a batch (on other blocks);
//   (d) bad calls refused with DI_ERR_INVALID and no change of state;
//   (e) decode graphs: long ragged decodes of 3 slots on a state with graphs and on one with
//       DI_DEV_GRAPHS=0 fed the same calls: bit-identical logits, both equal to the sessions, the
//       graphs replayed (stats); a decode step enqueues the same ops at 2 and 3 sequences and
//       uploads once;
//   (f) the product wiring (di_dsv41_dev_attach): plain sessions against a model without it,
//       prompts longer than one dev call; its rollback as the CPU session's; what it refuses;
//   (g) prefix reuse: a slot attached to another's full blocks replays from the bounded-replay
//       start and continues bit-identically to the cold prefill; so does one on copies of those
//       blocks made through the entry block I/O (read / write round-trips exactly);
//   (i) tail snapshots: a slot's tail restored into another slot continues bit-identically;
//   (n) rollback: ragged verify-shaped calls of another token stream, up to
//       DI_DSV41_ROLLBACK_MAX rows taken back per slot (di_dsv41_dev_rollback against the
//       sessions' di_dsv41_rollback), fed on: every logit bit-identical; decode steps too; bad
//       rollbacks, successive ones more than 16 below the highest position fed and one below a
//       tail restore refused;
//   (j) the Engram tables stay in host memory: the dev uploads no weight inside a table (the
//       backend's weight_upload watched), and its calls' results above come from the rows
//       gathered into each call's staging;
//   (k) di_dsv41_dev_prepare_decode captures the decode graph of every size up to the slots at
//       once (block 0, listed as cached, keeps its contents exactly), and decode steps of slots
//       restarted afterwards launch those graphs (no capture) with the sessions' logits; so does
//       di_dsv41_dev_prepare_verify for verify steps (2 and 3 rows per sequence), launched by
//       such steps later;
// each in the FP32 recipe and in the official one (R-OFF). Every state has shared entry blocks
// listed per call in a shuffled, non-contiguous order. A V4 model is refused.
//   (h) (a) - (e) again on the committed v41_long fixture (other layer schedule and candidate
//       pool; see fixture_long).
//   (l) pipeline stages cut anywhere (dsv41_dev.h "Pipeline stages": what crosses a cut is handed
//       over): any increasing split taken (cuts right after kv source 1, 2, and after the
//       candidate source, 4, among them), a block's memory counting the mirrors, the DP's split
//       the byte-optimal one of all splits, too many stages refused; then (`test_dev41_forward
//       --cuts`, its own ctest entry) every split into 2 and 3 stages on 2 and 3 CPU backends in
//       both recipes (cut_case): prefill, ragged batches and decodes (graphs replayed), prefix
//       reuse on cached blocks and on block I/O copies, every logit bit-identical (memcmp) to a
//       1-stage forward and to the CPU forward, block bytes and tail snapshots equal to the
//       1-stage state's, each call's uploads and hand-overs by kind (decode_handovers: 3 stages
//       with the last CPU backend refusing peer copies, so it receives through the host bounce);
//   (m) pipeline stages (`test_dev41_forward --stages`, its own ctest entry): (a), (b)-(e), (g),
//       (i), (k), (f) in both recipes with the forward on 2 CPU backends (the DP's split: [0, 3),
//       [3, 6)), then on 3 ([0, 2), [2, 4), [4, 6): mirrors of both kv sources, the top-k and the
//       candidate pool handed over), and (h) at 2 stages (the fixture's split cuts inside kv
//       source 1's range): every logit bit-identical (memcmp) to the sessions' CPU forward and
//       to a 1-stage forward fed the same calls beside it (h_call), entry blocks' bytes and tail
//       snapshots equal to the 1-stage state's, every call's hand-overs counted by kind (at 3
//       stages the last one receives through the host bounce).
// --deferred: some of the scenarios above on CPU backends in deferred mode (backend.h
// di_cpu_backend_set_deferred), on 1 then 3 stages: the same bits, so the host code syncs wherever
// the CUDA backend's asynchrony needs it.
#include "harness.h"

#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "backend/backend.h"
#include "io/safetensors.h"
#include "model/dsv41.h"
#include "model/dsv41_dev.h"
#include "model/synth.h"
#include "sample/sampler.h" // di_argmax: what a greedy row's pick must be

enum { N_SLOTS = 3, N_CTX = 192, MAX_ROWS = 48, BT = 16 };
enum { MAXB = N_CTX / BT, N_BLK = (N_SLOTS + 1) * MAXB };

static char g_dir[256], g_fix[256], g_ds[256];
static bool g_mtp; // (o): sessions with DSpark (mtp) and dev states with it on (h_init)

// Under ASan + UBSan the FP32 runs of (n) and (o) are left to the release stage (the official
// recipe's runs take the same paths, and its roundings besides).
#if defined(__SANITIZE_ADDRESS__) || defined(DI_ASAN)
enum { SAN = 1 };
#else
enum { SAN = 0 };
#endif

// Pipeline stages of every dev forward the harness creates ((m): 2 and 3 with --stages).
enum { MAX_STAGES = 3 };
static int32_t g_stages = 1;
static const int32_t *g_split; // (l): the split of the g_stages stages (NULL: di_dsv41_dev_split's)
static const char *g_model = g_dir; // the model h_init loads

typedef struct harness {
    di_model *m;
    di_backend *b, *more[MAX_STAGES - 1]; // b: stage 0's (and the 1-stage forward's); more: later
    di_dsv41_dev *d;
    di_dsv41_dev_state *st, *st2; // st2: NULL or a second state fed the same calls
    // With stages (g_stages > 1): a 1-stage forward and state fed the same calls as st (h_call).
    di_dsv41_dev *d1;
    di_dsv41_dev_state *st1;
    di_session *ses[N_SLOTS];
    int gen[N_SLOTS];
    int32_t blk[N_SLOTS][MAXB], spare[MAXB];
    int64_t V;
    float *got, *got2, *ref;
    int n_rows, n_bad;
    // (p) greedy picks: h_call runs st through di_dsv41_dev_forward_picks with every third row
    // (shifting by call) greedy; n_calls counts the calls.
    bool picks;
    int n_calls, n_picked;
} harness;

static int32_t token_of(int slot, int gen, int32_t pos) {
    return (int32_t)((slot * 131 + gen * 71 + pos * 97 + (pos * pos) % 13 + 7) % 250);
}

static di_session *new_session(di_model *m) {
    di_session_options so = di_session_options_default();
    so.n_ctx_max = N_CTX;
    so.mtp = g_mtp;
    di_session *s = NULL;
    CHECK_EQ(di_session_create(m, &so, &s), DI_OK);
    return s;
}

static void h_init(harness *h, di_precision prec, bool two_states) {
    memset(h, 0, sizeof *h);
    di_model_options mo = di_model_options_default();
    mo.n_threads = 2;
    mo.precision = prec;
    CHECK_EQ(di_model_load(g_model, &mo, &h->m), DI_OK);
    CHECK_EQ(di_cpu_backend_create(2, &h->b), DI_OK);
    di_backend *bs[MAX_STAGES] = {h->b};
    for (int32_t k = 1; k < g_stages; k++) {
        CHECK_EQ(di_cpu_backend_create(2, &h->more[k - 1]), DI_OK);
        bs[k] = h->more[k - 1];
    }
    // 3 stages: the last backend copies nothing directly, so what it receives (from stage 1 and
    // the mirrors' rows from stage 0) goes through the host bounce (as between GPUs without peer
    // access), what stage 1 receives directly (decode_handovers).
    if (g_stages == 3) di_cpu_backend_set_peer(bs[2], false);
    if (g_split)
        CHECK_EQ(di_dsv41_dev_create_split(h->m, bs, g_stages, g_split, &h->d), DI_OK);
    else
        CHECK_EQ(di_dsv41_dev_create_stages(h->m, bs, g_stages, &h->d), DI_OK);
    CHECK_EQ(di_dsv41_dev_n_stages(h->d), g_stages);
    CHECK_EQ(di_dsv41_dev_block_tokens(h->d), BT);
    CHECK_EQ(di_dsv41_dev_state_create(h->d, N_SLOTS, N_CTX, MAX_ROWS, N_BLK, BT, &h->st), DI_OK);
    if (g_stages > 1) {
        CHECK_EQ(di_dsv41_dev_create(h->m, h->b, &h->d1), DI_OK);
        CHECK_EQ(di_dsv41_dev_state_create(h->d1, N_SLOTS, N_CTX, MAX_ROWS, N_BLK, BT, &h->st1),
                 DI_OK);
    }
    if (two_states) {
        setenv("DI_DEV_GRAPHS", "0", 1);
        CHECK_EQ(di_dsv41_dev_state_create(h->d, N_SLOTS, N_CTX, MAX_ROWS, N_BLK, BT, &h->st2),
                 DI_OK);
        unsetenv("DI_DEV_GRAPHS");
    }
    if (g_mtp) {
        CHECK_EQ(di_dsv41_dev_dspark_enable(h->st), DI_OK);
        if (h->st2) CHECK_EQ(di_dsv41_dev_dspark_enable(h->st2), DI_OK);
        if (h->st1) CHECK_EQ(di_dsv41_dev_dspark_enable(h->st1), DI_OK);
    }
    // Shuffled, non-contiguous block ids: a permutation of [0, N_BLK) dealt out to the slots and
    // the spare set (29 is prime to N_BLK = 48).
    int32_t perm[N_BLK];
    for (int i = 0; i < N_BLK; i++) perm[i] = (i * 29 + 5) % N_BLK; // 29 is prime to 48
    for (int i = 0; i < N_SLOTS; i++)
        for (int j = 0; j < MAXB; j++) h->blk[i][j] = perm[j * (N_SLOTS + 1) + i];
    for (int j = 0; j < MAXB; j++) h->spare[j] = perm[j * (N_SLOTS + 1) + N_SLOTS];
    for (int i = 0; i < N_SLOTS; i++) h->ses[i] = new_session(h->m);
    h->V = h->m->hp.n_vocab;
    h->got = malloc(sizeof(float) * (size_t)(MAX_ROWS * h->V));
    h->got2 = malloc(sizeof(float) * (size_t)(MAX_ROWS * h->V));
    h->ref = malloc(sizeof(float) * (size_t)(MAX_ROWS * h->V));
}

static void h_free(harness *h) {
    for (int i = 0; i < N_SLOTS; i++) di_session_destroy(h->ses[i]);
    di_dsv41_dev_state_destroy(h->st);
    di_dsv41_dev_state_destroy(h->st2);
    di_dsv41_dev_state_destroy(h->st1);
    di_dsv41_dev_destroy(h->d);
    di_dsv41_dev_destroy(h->d1);
    di_backend_destroy(h->b);
    for (int k = 0; k < MAX_STAGES - 1; k++) di_backend_destroy(h->more[k]);
    di_model_destroy(h->m);
    free(h->got);
    free(h->got2);
    free(h->ref);
}

// The hand-overs of a call ("Pipeline stages"), from the schedule, by kind (h_init: with 3
// stages everything stage 2 receives goes through the host bounce): per later stage the streams
// and pre, one per earlier kv source a layer there reads (its mirror's rows), the top-k when its
// first compressing layer is no index source but one came before, the candidate pool and its
// counts when an index source follows the candidate source, the DSpark taps when a target layer
// is before it.
static void decode_handovers(const di_model *m, const di_dsv41_dev *d, int64_t *peer,
                             int64_t *host) {
    const di_hparams *hp = &m->hp;
    *peer = *host = 0;
    for (int32_t k = 1; k < di_dsv41_dev_n_stages(d); k++) {
        int32_t l0 = 0, l1 = 0;
        di_dsv41_dev_stage(d, k, &l0, &l1);
        int64_t n = 2;
        for (int src = 0; src < l0; src++) {
            if (!hp->kv_source[src]) continue;
            bool read = false;
            for (int il = l0; il < l1; il++) {
                int s = -1;
                for (int j = il; j >= 0 && s < 0 && hp->compress_ratio[il] > 0; j--)
                    if (hp->kv_source[j]) s = j;
                read |= s == src;
            }
            n += read;
        }
        bool idx_before = false, idx_after = false;
        for (int il = 0; il < l0; il++) idx_before |= hp->index_source[il];
        for (int il = l0; il < hp->n_layer; il++) idx_after |= hp->index_source[il];
        for (int il = l0; il < hp->n_layer && idx_before; il++)
            if (hp->compress_ratio[il] > 0) {
                n += !hp->index_source[il];
                break;
            }
        if (hp->candidate_layer >= 0 && hp->candidate_layer < l0 && idx_after) n += 2;
        bool taps = false; // (o) DSpark: the taps of a target layer before the stage
        for (int t = 0; t < hp->n_dspark_target && g_mtp; t++) taps |= hp->dspark_target[t] < l0;
        n += taps;
        *(k == 2 ? host : peer) += n;
    }
}

// The uploads of a call: the staging per stage, and every hand-over through the host bounce.
static int64_t decode_uploads(const di_model *m, const di_dsv41_dev *d) {
    int64_t peer = 0, host = 0;
    decode_handovers(m, d, &peer, &host);
    return di_dsv41_dev_n_stages(d) + host;
}

// One call: slots[i] feeds n_tok[i] tokens at its position (restart[i]: at 0, on the spare
// blocks, with a new token stream); every row's logits compared with the sessions'.
static void h_call(harness *h, int n, const int *slots, const int *n_tok, const bool *restart) {
    di_dsv41_dev_seq seqs[N_SLOTS];
    int32_t tokens[MAX_ROWS], rows[MAX_ROWS];
    int T = 0;
    for (int i = 0; i < n; i++) {
        const int s = slots[i];
        if (restart && restart[i]) {
            h->gen[s]++;
            for (int j = 0; j < MAXB; j++) { // swap the slot's blocks with the spare set
                int32_t t = h->blk[s][j];
                h->blk[s][j] = h->spare[j];
                h->spare[j] = t;
            }
            di_session_destroy(h->ses[s]);
            h->ses[s] = new_session(h->m);
        }
        const int32_t pos = restart && restart[i] ? 0 : di_dsv41_dev_n_past(h->st, s);
        CHECK_EQ(pos, h->ses[s]->pos);
        seqs[i] = (di_dsv41_dev_seq){
            .slot = s, .pos = pos, .n_tok = n_tok[i], .blocks = h->blk[s], .n_blocks = MAXB};
        for (int t = 0; t < n_tok[i]; t++, T++) {
            tokens[T] = token_of(s, h->gen[s], pos + t);
            rows[T] = T;
        }
    }
    di_dsv41_dev_graph_stats g0, g1;
    di_dsv41_dev_get_graph_stats(h->st, &g0);
    // (p) with picks: the greedy rows' logits are not written (0xFF bytes stay), their picks are.
    uint8_t greedy[MAX_ROWS] = {0};
    int32_t picks[MAX_ROWS];
    int n_greedy = 0;
    for (int t = 0; t < T && h->picks; t++) n_greedy += greedy[t] = (t + h->n_calls) % 3 == 2;
    h->n_calls++;
    memset(h->got, 0xFF, sizeof(float) * (size_t)(T * h->V));
    CHECK_EQ(di_dsv41_dev_forward_picks(h->st, seqs, n, tokens, rows, T, h->got,
                                        h->picks ? greedy : NULL, picks),
             DI_OK);
    di_dsv41_dev_get_graph_stats(h->st, &g1);
    { // the bytes of results: 4 per row more when a row is greedy, 4 V less per greedy row
        const int64_t want = (n_greedy ? 4 * (int64_t)T : 0) + 4 * h->V * (T - n_greedy);
        CHECK_EQ(g1.last_download_bytes, want);
        CHECK_EQ(g1.n_download_bytes - g0.n_download_bytes, want);
        h->n_picked += n_greedy;
    }
    if (g_stages > 1) { // (l), (m) every call's hand-overs, by kind
        int64_t peer = 0, host = 0;
        decode_handovers(h->m, h->d, &peer, &host);
        CHECK_EQ(g1.n_handover_peer - g0.n_handover_peer, peer);
        CHECK_EQ(g1.n_handover_host - g0.n_handover_host, host);
        CHECK_EQ(g1.last_uploads, decode_uploads(h->m, h->d));
        CHECK(g1.last_handover_bytes >= (int64_t)(g_stages - 1) * T * (int64_t)sizeof(float) *
                                            h->m->hp.hc_mult * (h->m->hp.n_embd + 1));
    }
    // A greedy row of st's call: its pick is di_argmax of the row `full` (another state's, or
    // the session's), its logits untouched; another row: the same logits as `full`.
#define SAME_ROW(t, full)                                                                          \
    (greedy[t] ? picks[t] == di_argmax((full), (int32_t)h->V) &&                                   \
                     ((const uint32_t *)(h->got + (int64_t)(t)*h->V))[h->V - 1] == 0xFFFFFFFFu     \
               : memcmp(h->got + (int64_t)(t)*h->V, (full), sizeof(float) * (size_t)h->V) == 0)
    di_dsv41_dev_state *others[2] = {h->st2, h->st1}; // (m) st1: the 1-stage forward
    for (int k = 0; k < 2; k++) {
        if (!others[k]) continue;
        CHECK_EQ(di_dsv41_dev_forward(others[k], seqs, n, tokens, rows, T, h->got2), DI_OK);
        for (int t = 0; t < T; t++) CHECK(SAME_ROW(t, h->got2 + (int64_t)t * h->V));
    }
    int r = 0;
    for (int i = 0; i < n; i++) {
        di_session *ses = h->ses[slots[i]];
        di_dsv41_seq one = {.s = ses, .tokens = tokens + r, .n_tok = n_tok[i], .n_out = n_tok[i]};
        CHECK_EQ(di_dsv41_forward_batch(h->m, di_dsv41_ws(ses), &one, 1, h->ref), DI_OK);
        for (int t = 0; t < n_tok[i]; t++) {
            const float *a = h->got + (int64_t)(r + t) * h->V, *b = h->ref + (int64_t)t * h->V;
            h->n_rows++;
            if (greedy[r + t]) {
                if (!SAME_ROW(r + t, b) && h->n_bad++ < 5)
                    fprintf(stderr, "slot %d pos %d: greedy pick %d, not %d\n", slots[i],
                            seqs[i].pos + t, picks[r + t], di_argmax(b, (int32_t)h->V));
            } else if (memcmp(a, b, sizeof(float) * (size_t)h->V) != 0) {
                double mx = 0;
                for (int64_t v = 0; v < h->V; v++) {
                    double e = a[v] > b[v] ? a[v] - b[v] : b[v] - a[v];
                    if (e > mx) mx = e;
                }
                if (h->n_bad++ < 5)
                    fprintf(stderr, "slot %d pos %d: logits differ (max %.3g)\n", slots[i],
                            seqs[i].pos + t, mx);
            }
        }
        r += n_tok[i];
    }
#undef SAME_ROW
}

// (a) one sequence: chunks straddling W = 16, ratio-2 groups and candidate blocks, then decodes.
static void one_sequence(di_precision prec) {
    harness h;
    h_init(&h, prec, false);
    const int chunks[] = {7, 9, 1, 15, 3, 17, 30, 5};
    const int slot = 1;
    for (size_t k = 0; k < sizeof chunks / sizeof *chunks; k++)
        h_call(&h, 1, &slot, &chunks[k], NULL);
    const int one = 1;
    for (int k = 0; k < 60; k++) h_call(&h, 1, &slot, &one, NULL);
    CHECK_EQ(di_dsv41_dev_n_past(h.st, slot), 147);
    CHECK(h.n_rows == 147);
    CHECK_EQ(h.n_bad, 0);
    // The blocks hold the CPU forward's pages byte for byte (the same packed codes at the same
    // offsets, zero padding): the last one partly written, a ratio-2 group open at its end.
    const size_t pb = di_dsv41_page_bytes(h.m, BT);
    uint8_t *io = malloc(pb);
    int n_same = 0;
    for (int j = 0; j < (147 + BT - 1) / BT; j++) {
        CHECK_EQ(di_dsv41_dev_state_read_block(h.st, h.blk[slot][j], io), DI_OK);
        n_same += memcmp(io, h.ses[slot]->v41->pages[j], pb) == 0;
    }
    CHECK_EQ(n_same, (147 + BT - 1) / BT);
    free(io);
    h_free(&h);
}

// (b), (c), (d), (e) on one harness with two states.
static void batches(di_precision prec) {
    harness h;
    h_init(&h, prec, true);
    const int all[N_SLOTS] = {0, 1, 2};
    // Different starting positions.
    const int pre0[N_SLOTS] = {5, 18, 23};
    h_call(&h, N_SLOTS, all, pre0, NULL);
    // (b) ragged rounds mixing prefill chunks and decodes, in varying slot orders.
    const int order[4][N_SLOTS] = {{2, 0, 1}, {1, 2, 0}, {0, 1, 2}, {2, 1, 0}};
    const int sizes[4][N_SLOTS] = {{1, 12, 3}, {9, 1, 1}, {2, 17, 1}, {1, 1, 11}};
    for (int k = 0; k < 4; k++) h_call(&h, N_SLOTS, order[k], sizes[k], NULL);
    // (c) slot 1 restarted at 0 inside a batch.
    const int sz_c[N_SLOTS] = {3, 6, 1};
    const bool rs_c[N_SLOTS] = {false, true, false};
    h_call(&h, N_SLOTS, all, sz_c, rs_c);
    // (d) bad calls: nothing changes.
    {
        int32_t past[N_SLOTS];
        for (int i = 0; i < N_SLOTS; i++) past[i] = di_dsv41_dev_n_past(h.st, i);
        int32_t tok[4] = {1, 2, 3, 4}, rows[4] = {0, 1, 2, 3};
        di_dsv41_dev_seq ok = {
            .slot = 0, .pos = past[0], .n_tok = 1, .blocks = h.blk[0], .n_blocks = MAXB};
        di_dsv41_dev_seq bad[2];
        bad[0] = ok, bad[1] = ok; // a slot twice
        CHECK_EQ(di_dsv41_dev_forward(h.st, bad, 2, tok, rows, 2, h.got), DI_ERR_INVALID);
        bad[1] = ok, bad[1].slot = 3; // out of range
        CHECK_EQ(di_dsv41_dev_forward(h.st, bad, 2, tok, rows, 2, h.got), DI_ERR_INVALID);
        bad[0] = ok, bad[0].pos = past[0] + 1; // a gap
        CHECK_EQ(di_dsv41_dev_forward(h.st, bad, 1, tok, rows, 1, h.got), DI_ERR_INVALID);
        bad[0] = ok, bad[0].n_blocks = 0; // no blocks
        CHECK_EQ(di_dsv41_dev_forward(h.st, bad, 1, tok, rows, 1, h.got), DI_ERR_INVALID);
        bad[0] = ok, bad[1] = ok, bad[1].slot = 1, bad[1].pos = past[1],
        bad[1].blocks = h.blk[0]; // blocks listed twice
        CHECK_EQ(di_dsv41_dev_forward(h.st, bad, 2, tok, rows, 2, h.got), DI_ERR_INVALID);
        int32_t big[1] = {100000}; // a token outside the vocabulary
        CHECK_EQ(di_dsv41_dev_forward(h.st, &ok, 1, big, rows, 1, h.got), DI_ERR_INVALID);
        int32_t down[2] = {1, 0}; // logit rows not ascending
        bad[0] = ok, bad[0].n_tok = 2;
        CHECK_EQ(di_dsv41_dev_forward(h.st, bad, 1, tok, down, 2, h.got), DI_ERR_INVALID);
        bad[0] = ok, bad[0].n_tok = MAX_ROWS + 1; // too many rows
        CHECK_EQ(di_dsv41_dev_forward(h.st, bad, 1, tok, rows, 0, NULL), DI_ERR_INVALID);
        for (int i = 0; i < N_SLOTS; i++) CHECK_EQ(di_dsv41_dev_n_past(h.st, i), past[i]);
    }
    // (e) decode steps of 3 and of 2 slots (graphs captured, then replayed), a restart inside.
    const int ones[N_SLOTS] = {1, 1, 1};
    for (int k = 0; k < 40; k++) {
        if (k == 20) {
            const bool rs[N_SLOTS] = {false, false, true};
            h_call(&h, N_SLOTS, all, ones, rs);
        } else if (k % 5 == 4) {
            const int two[2] = {2, 0};
            h_call(&h, 2, two, ones, NULL);
        } else {
            h_call(&h, N_SLOTS, all, ones, NULL);
        }
    }
    // What a decode step costs: the same ops at 2 and 3 sequences (no per-sequence op), replayed
    // or run directly, and one upload.
    di_dsv41_dev_graph_stats g, g2;
    const int two[2] = {2, 0};
    h_call(&h, 2, two, ones, NULL);
    di_dsv41_dev_get_graph_stats(h.st, &g);
    di_dsv41_dev_get_graph_stats(h.st2, &g2);
    const int64_t ops2 = g.last_ops;
    CHECK(ops2 > 100);
    CHECK_EQ(g2.last_ops, ops2);
    h_call(&h, N_SLOTS, all, ones, NULL);
    di_dsv41_dev_get_graph_stats(h.st, &g);
    di_dsv41_dev_get_graph_stats(h.st2, &g2);
    CHECK_EQ(g.last_ops, ops2);
    CHECK_EQ(g2.last_ops, ops2);
    CHECK_EQ(g.last_uploads, decode_uploads(h.m, h.d));
    CHECK(g.last_upload_bytes > 0 && g.last_upload_bytes == g2.last_upload_bytes);
    CHECK(g.n_replayed > 20);
    CHECK_EQ(g.n_cached, 2);
    CHECK_EQ(g2.n_replayed, 0);
    CHECK_EQ(g2.n_cached, 0);
    // (p) greedy picks (di_dsv41_dev_forward_picks, h_call): ragged calls, then decode steps
    // (graphs replayed), every third row greedy: each pick di_argmax of the row st2 and the
    // sessions computed, the other rows their logits, the greedy rows' logits not written, 4 bytes
    // downloaded a greedy row instead of 4 V; a replayed decode step (one greedy row of 3) costs
    // the graph's ops and the argmax op after it. Greedy rows without picks are refused.
    h.picks = true;
    const int picked0 = h.n_picked;
    for (int k = 0; k < 4; k++) h_call(&h, N_SLOTS, order[k], sizes[k], NULL);
    for (int k = 0; k < 6; k++) h_call(&h, N_SLOTS, all, ones, NULL);
    di_dsv41_dev_get_graph_stats(h.st, &g);
    CHECK_EQ(g.last_ops, ops2 + 1);
    CHECK(h.n_picked - picked0 >= 6 + 10);
    {
        const uint8_t gr[1] = {1};
        int32_t tok[1] = {1}, rows[1] = {0};
        di_dsv41_dev_seq ok = {.slot = 0,
                               .pos = di_dsv41_dev_n_past(h.st, 0),
                               .n_tok = 1,
                               .blocks = h.blk[0],
                               .n_blocks = MAXB};
        CHECK_EQ(di_dsv41_dev_forward_picks(h.st, &ok, 1, tok, rows, 1, h.got, gr, NULL),
                 DI_ERR_INVALID);
    }
    CHECK_EQ(h.n_bad, 0);
    fprintf(stderr,
            "  %d rows compared (%d greedy picks); graphs: %lld direct, %lld captured, %lld "
            "replayed; a decode step %lld ops, %lld bytes uploaded\n",
            h.n_rows, h.n_picked, (long long)g.n_direct, (long long)g.n_captured,
            (long long)g.n_replayed, (long long)ops2, (long long)g.last_upload_bytes);
    h_free(&h);
}

// (g) prefix reuse on shared entry blocks: slot 1 attached to slot 0's first H positions' blocks
// replays from Q = H - n_layer (W - 1) (win_lo = Q, n_cached = H, the prefix tokens for Engram) and
// its logits from H on equal slot 0's cold ones bit for bit; then both decode in one call on the
// shared blocks (identical logits; slot 0 still equal to its CPU session, so the cached blocks
// were not written); bad replay parameters refused without changing anything.
static void prefix_reuse(di_precision prec) {
    harness h;
    h_init(&h, prec, false);
    const di_hparams *hp = &h.m->hp;
    enum { H = 112, AFTER = 20 };
    const int s0 = 0, s1 = 1;
    const int chunks[] = {40, 40, 32};
    for (int k = 0; k < 3; k++) h_call(&h, 1, &s0, &chunks[k], NULL);
    float *cold = malloc(sizeof(float) * (size_t)(AFTER * h.V));
    const int one = 1;
    for (int k = 0; k < AFTER; k++) {
        h_call(&h, 1, &s0, &one, NULL);
        memcpy(cold + (int64_t)k * h.V, h.got, sizeof(float) * (size_t)h.V);
    }
    if (h.st1) { // (m) a block's bytes: the stages' parts in layer order, the 1-stage bytes
        int64_t bb1 = 0, sb1 = 0;
        CHECK_EQ(di_dsv41_dev_sizes(h.d, BT, &bb1, &sb1), DI_OK);
        uint8_t *x = malloc((size_t)bb1), *y = malloc((size_t)bb1);
        for (int j = 0; j < (H + AFTER) / BT + 1; j++) {
            CHECK_EQ(di_dsv41_dev_state_read_block(h.st, h.blk[s0][j], x), DI_OK);
            CHECK_EQ(di_dsv41_dev_state_read_block(h.st1, h.blk[s0][j], y), DI_OK);
            CHECK(memcmp(x, y, (size_t)bb1) == 0);
        }
        free(x);
        free(y);
    }
    int32_t blk1[MAXB], tok[H + AFTER + 8], rows[MAX_ROWS];
    for (int j = 0; j < MAXB; j++) blk1[j] = j < H / BT ? h.blk[s0][j] : h.blk[s1][j];
    for (int p = 0; p < H + AFTER + 8; p++) tok[p] = token_of(s0, h.gen[s0], p);
    for (int r = 0; r < MAX_ROWS; r++) rows[r] = r;
    const int32_t Q = H - hp->n_layer * (hp->window - 1);
    CHECK(Q > 0);
    di_dsv41_dev_seq sq = {
        .slot = s1, .blocks = blk1, .n_blocks = MAXB, .win_lo = Q, .n_cached = H, .prefix = tok};
    // Refused: win_lo beyond the cache, no prefix tokens, n_cached off a block boundary.
    const int32_t past1 = di_dsv41_dev_n_past(h.st, s1);
    di_dsv41_dev_seq bad = sq;
    bad.pos = H + 8, bad.win_lo = H + 8, bad.n_tok = 1;
    CHECK_EQ(di_dsv41_dev_forward(h.st, &bad, 1, tok, rows, 0, NULL), DI_ERR_INVALID);
    bad = sq, bad.pos = Q, bad.n_tok = 1, bad.prefix = NULL;
    CHECK_EQ(di_dsv41_dev_forward(h.st, &bad, 1, tok + Q, rows, 0, NULL), DI_ERR_INVALID);
    bad = sq, bad.pos = Q, bad.n_tok = 1, bad.n_cached = H - 1;
    CHECK_EQ(di_dsv41_dev_forward(h.st, &bad, 1, tok + Q, rows, 0, NULL), DI_ERR_INVALID);
    CHECK_EQ(di_dsv41_dev_n_past(h.st, s1), past1);
    // The replay, in chunks of MAX_ROWS, then the positions after H with their logits.
    int n_same = 0;
    for (int32_t p = Q; p < H + AFTER;) {
        const int32_t n = H + AFTER - p < MAX_ROWS ? H + AFTER - p : MAX_ROWS;
        sq.pos = p, sq.n_tok = n;
        CHECK_EQ(di_dsv41_dev_forward(h.st, &sq, 1, tok + p, rows, n, h.got), DI_OK);
        for (int32_t t = 0; t < n; t++)
            if (p + t >= H)
                n_same += memcmp(h.got + (int64_t)t * h.V, cold + (int64_t)(p + t - H) * h.V,
                                 sizeof(float) * (size_t)h.V) == 0;
        p += n;
    }
    CHECK_EQ(n_same, AFTER);
    // Entry block I/O: slot 0's cached blocks read out and written into the spare blocks (read
    // back equal); slot 2 replays on those copies and matches the cold logits too.
    int64_t bb = 0, sb = 0;
    CHECK_EQ(di_dsv41_dev_sizes(h.d, BT, &bb, &sb), DI_OK);
    CHECK(bb > 0 && sb > 0);
    CHECK_EQ(di_dsv41_dev_sizes(h.d, BT + 1, &bb, &sb), DI_ERR_INVALID);
    CHECK_EQ(di_dsv41_dev_state_n_blocks(h.st), N_BLK);
    uint8_t *io = malloc((size_t)bb), *back = malloc((size_t)bb);
    int32_t blk2[MAXB];
    for (int j = 0; j < MAXB; j++) blk2[j] = j < H / BT ? h.spare[j] : h.blk[2][j];
    for (int j = 0; j < H / BT; j++) {
        CHECK_EQ(di_dsv41_dev_state_read_block(h.st, h.blk[s0][j], io), DI_OK);
        CHECK_EQ(di_dsv41_dev_state_write_block(h.st, h.spare[j], io), DI_OK);
        CHECK_EQ(di_dsv41_dev_state_read_block(h.st, h.spare[j], back), DI_OK);
        CHECK(memcmp(io, back, (size_t)bb) == 0);
    }
    CHECK_EQ(di_dsv41_dev_state_read_block(h.st, N_BLK, io), DI_ERR_INVALID);
    di_dsv41_dev_seq s2 = sq;
    s2.slot = 2, s2.blocks = blk2;
    n_same = 0;
    for (int32_t p = Q; p < H + AFTER;) {
        const int32_t n = H + AFTER - p < MAX_ROWS ? H + AFTER - p : MAX_ROWS;
        s2.pos = p, s2.n_tok = n;
        CHECK_EQ(di_dsv41_dev_forward(h.st, &s2, 1, tok + p, rows, n, h.got), DI_OK);
        for (int32_t t = 0; t < n; t++)
            if (p + t >= H)
                n_same += memcmp(h.got + (int64_t)t * h.V, cold + (int64_t)(p + t - H) * h.V,
                                 sizeof(float) * (size_t)h.V) == 0;
        p += n;
    }
    CHECK_EQ(n_same, AFTER);
    free(io);
    free(back);
    // Both decode on the shared blocks in one call: the same logits; slot 0 = its session.
    for (int k = 0; k < 6; k++) {
        const int32_t p = H + AFTER + k;
        di_dsv41_dev_seq two[2] = {
            {.slot = s0, .pos = p, .n_tok = 1, .blocks = h.blk[s0], .n_blocks = MAXB},
            {.slot = s1,
             .pos = p,
             .n_tok = 1,
             .blocks = blk1,
             .n_blocks = MAXB,
             .win_lo = Q,
             .n_cached = H,
             .prefix = tok}};
        int32_t t2[2] = {tok[p], tok[p]};
        CHECK_EQ(di_dsv41_dev_forward(h.st, two, 2, t2, rows, 2, h.got), DI_OK);
        CHECK(memcmp(h.got, h.got + h.V, sizeof(float) * (size_t)h.V) == 0);
        di_dsv41_seq ref = {.s = h.ses[s0], .tokens = &tok[p], .n_tok = 1, .n_out = 1};
        CHECK_EQ(di_dsv41_forward_batch(h.m, di_dsv41_ws(h.ses[s0]), &ref, 1, h.ref), DI_OK);
        CHECK(memcmp(h.got, h.ref, sizeof(float) * (size_t)h.V) == 0);
    }
    CHECK_EQ(h.n_bad, 0);
    free(cold);
    h_free(&h);
}

// (i) tail snapshots: slot 0's tail saved at a block boundary H, restored into slot 1 (on slot 0's
// blocks below H, its own above): slot 1 then decodes bit-identically to slot 0; a bad restore is
// refused without changing anything.
static void tail_case(di_precision prec) {
    harness h;
    h_init(&h, prec, false);
    enum { H = 96, AFTER = 12 };
    const int s0 = 0, s1 = 1;
    const int chunks[] = {48, 41, 7};
    for (int k = 0; k < 3; k++) h_call(&h, 1, &s0, &chunks[k], NULL);
    const size_t tb = di_dsv41_dev_tail_bytes(h.d);
    // Every layer's 16 window ring rows as Q8 codes of 64 dims, then every DSpark block's.
    CHECK_EQ(tb, 16 + (6 + (size_t)h.m->n_mtp_loaded) * 16 * 66);
    uint8_t *tail = malloc(tb);
    CHECK_EQ(di_dsv41_dev_tail_save(h.st, s0, tail), DI_OK);
    if (h.st1) { // (m) the 1-stage state's snapshot of the same run: the same bytes
        uint8_t *t1 = malloc(tb);
        CHECK_EQ(di_dsv41_dev_tail_save(h.st1, s0, t1), DI_OK);
        CHECK(memcmp(tail, t1, tb) == 0);
        free(t1);
    }
    int32_t tok[H + AFTER], rows[MAX_ROWS], blk1[MAXB];
    for (int p = 0; p < H + AFTER; p++) tok[p] = token_of(s0, h.gen[s0], p);
    for (int r = 0; r < MAX_ROWS; r++) rows[r] = r;
    for (int j = 0; j < MAXB; j++) blk1[j] = j < H / BT ? h.blk[s0][j] : h.blk[s1][j];
    float *cold = malloc(sizeof(float) * (size_t)(AFTER * h.V));
    const int one = 1;
    for (int k = 0; k < AFTER; k++) {
        h_call(&h, 1, &s0, &one, NULL);
        memcpy(cold + (int64_t)k * h.V, h.got, sizeof(float) * (size_t)h.V);
    }
    CHECK_EQ(di_dsv41_dev_tail_restore(h.st, s1, H + 2, tail, tok), DI_ERR_INVALID); // not at H
    CHECK_EQ(di_dsv41_dev_tail_restore(h.st, N_SLOTS, H, tail, tok), DI_ERR_INVALID);
    CHECK_EQ(di_dsv41_dev_n_past(h.st, s1), 0);
    CHECK_EQ(di_dsv41_dev_tail_restore(h.st, s1, H, tail, tok), DI_OK);
    CHECK_EQ(di_dsv41_dev_n_past(h.st, s1), H);
    int n_same = 0;
    for (int k = 0; k < AFTER; k++) {
        di_dsv41_dev_seq sq = {
            .slot = s1, .pos = H + k, .n_tok = 1, .blocks = blk1, .n_blocks = MAXB};
        CHECK_EQ(di_dsv41_dev_forward(h.st, &sq, 1, &tok[H + k], rows, 1, h.got), DI_OK);
        n_same += memcmp(h.got, cold + (int64_t)k * h.V, sizeof(float) * (size_t)h.V) == 0;
    }
    CHECK_EQ(n_same, AFTER);
    CHECK_EQ(h.n_bad, 0);
    free(tail);
    free(cold);
    h_free(&h);
}

// (k) prepared decode graphs.
static void prepare_case(di_precision prec) {
    harness h;
    h_init(&h, prec, false);
    h.picks = true; // (p) the decode and verify graphs' steps with greedy rows
    int64_t blk_bytes = 0, slot_bytes = 0;
    CHECK_EQ(di_dsv41_dev_sizes(h.d, BT, &blk_bytes, &slot_bytes), DI_OK);
    CHECK(di_dsv41_dev_state_bytes(h.st) > N_BLK * blk_bytes + N_SLOTS * slot_bytes);
    uint8_t *pat = calloc((size_t)blk_bytes, 1), *back = malloc((size_t)blk_bytes);
    // A pattern in the page's runs (entries and index keys of every kv source), its padding zero
    // (a block's padding is not stored: it reads back as zeros).
    for (int il = 0; il < h.m->hp.n_layer; il++) {
        if (!h.m->hp.kv_source[il]) continue;
        const int64_t E = BT / h.m->hp.compress_ratio[il];
        const int64_t ne = E * (h.m->hp.head_dim / 2 + h.m->hp.head_dim / 16);
        const int64_t nk = E * (h.m->hp.index_head_dim / 2 + h.m->hp.index_head_dim / 32);
        int64_t om = 0, oi = 0;
        di_dsv41_page_offsets(h.m, BT, il, &om, &oi);
        for (int64_t i = 0; i < ne; i++) pat[om + i] = (uint8_t)((om + i) * 37 % 251);
        for (int64_t i = 0; i < nk; i++) pat[oi + i] = (uint8_t)((oi + i) * 41 % 253);
    }
    CHECK_EQ(di_dsv41_dev_state_write_block(h.st, 0, pat), DI_OK);
    CHECK_EQ(di_dsv41_dev_prepare_decode(h.st, 8), DI_OK); // capped at the 3 slots
    di_dsv41_dev_graph_stats g;
    di_dsv41_dev_get_graph_stats(h.st, &g);
    CHECK_EQ(g.n_captured, N_SLOTS);
    CHECK_EQ(g.n_cached, N_SLOTS);
    CHECK_EQ(g.n_direct, N_SLOTS);
    CHECK_EQ(g.n_replayed, 0); // a capture launches its graph, counted as captured
    // Verify steps of 2 and 3 rows per sequence, 1 .. 3 sequences: 6 graphs more.
    CHECK_EQ(di_dsv41_dev_prepare_verify(h.st, 8, 3), DI_OK);
    di_dsv41_dev_get_graph_stats(h.st, &g);
    CHECK_EQ(g.n_captured, N_SLOTS + 6);
    CHECK_EQ(di_dsv41_dev_state_read_block(h.st, 0, back), DI_OK);
    CHECK(memcmp(pat, back, (size_t)blk_bytes) == 0);
    const int all[N_SLOTS] = {0, 1, 2}, pre[N_SLOTS] = {5, 19, 2}, ones[N_SLOTS] = {1, 1, 1};
    const bool rs[N_SLOTS] = {true, true, true};
    h_call(&h, N_SLOTS, all, pre, rs);
    for (int k = 0; k < 12; k++) h_call(&h, k % 3 == 2 ? 2 : N_SLOTS, all, ones, NULL);
    di_dsv41_dev_get_graph_stats(h.st, &g);
    CHECK_EQ(g.n_captured, N_SLOTS + 6);
    CHECK_EQ(g.n_replayed, 12);
    // Verify-shaped steps launch the prepared graphs (the sessions' logits, every row).
    const int twos[N_SLOTS] = {2, 2, 2}, threes[N_SLOTS] = {3, 3, 3};
    h_call(&h, N_SLOTS, all, twos, NULL);
    h_call(&h, 2, all, threes, NULL);
    h_call(&h, N_SLOTS, all, threes, NULL);
    di_dsv41_dev_get_graph_stats(h.st, &g);
    CHECK_EQ(g.n_captured, N_SLOTS + 6);
    CHECK_EQ(g.n_replayed, 15);
    CHECK_EQ(h.n_bad, 0);
    free(pat);
    free(back);
    h_free(&h);
}

static void fp32_prepare(void) {
    prepare_case(DI_PRECISION_FP32);
}
static void official_prepare(void) {
    prepare_case(DI_PRECISION_OFFICIAL);
}

// (n) rollback (di_dsv41_dev_rollback): verify-shaped calls of speculative tokens (another token
// stream than the one fed after, so a trace of a rejected row would show) on 3 slots in ragged
// batches, then n of each slot's rows taken back (up to DI_DSV41_ROLLBACK_MAX: odd and even
// positions, whole calls, the window wrapped and a ratio-2 group left open) on the dev states
// (graphs on and off, and the 1-stage forward with stages) and on the sessions
// (di_dsv41_rollback), fed on: every logit row bit-identical (h_call); decode steps (graphs)
// rolled back too; bad rollbacks refused without a change (successive ones more than
// DI_DSV41_ROLLBACK_MAX below the highest position fed too), and one below a tail restore.
static void h_rollback(harness *h, int s, int n) {
    CHECK_EQ(di_dsv41_dev_rollback(h->st, s, n), DI_OK);
    if (h->st2) CHECK_EQ(di_dsv41_dev_rollback(h->st2, s, n), DI_OK);
    if (h->st1) CHECK_EQ(di_dsv41_dev_rollback(h->st1, s, n), DI_OK);
    CHECK_EQ(di_dsv41_rollback(h->ses[s], n), DI_OK);
    CHECK_EQ(di_dsv41_dev_n_past(h->st, s), h->ses[s]->pos);
}

static void rollback_case(di_precision prec) {
    harness h;
    h_init(&h, prec, true);
    const int all[N_SLOTS] = {0, 1, 2};
    const int pre[N_SLOTS] = {9, 20, 17};
    h_call(&h, N_SLOTS, all, pre, NULL);
#if defined(__SANITIZE_ADDRESS__) || defined(DI_ASAN)
    enum { ROUNDS = 3 };
#else
    enum { ROUNDS = 8 };
#endif
    // Per round: each slot's speculative rows, then how many of them go back.
    const int spec[8][N_SLOTS] = {{6, 3, 17}, {2, 6, 6},  {16, 1, 5}, {6, 6, 6},
                                  {3, 17, 2}, {6, 2, 16}, {1, 6, 4},  {5, 5, 5}};
    const int back[8][N_SLOTS] = {{5, 2, 16}, {1, 6, 3},  {16, 1, 4}, {3, 4, 6},
                                  {2, 16, 1}, {6, 1, 15}, {0, 5, 3},  {4, 2, 1}};
    const int kept[N_SLOTS] = {1, 2, 3};
    for (int k = 0; k < ROUNDS; k++) {
        for (int i = 0; i < N_SLOTS; i++) h.gen[i] += 1000; // the speculative token stream
        h_call(&h, N_SLOTS, all, spec[k], NULL);
        for (int i = 0; i < N_SLOTS; i++) {
            h.gen[i] -= 1000;
            h_rollback(&h, i, back[k][i]);
        }
        h_call(&h, N_SLOTS, all, kept, NULL);
    }
    // Decode steps (graph shape) rolled back one at a time.
    const int ones[N_SLOTS] = {1, 1, 1};
    for (int k = 0; k < 6; k++) {
        for (int i = 0; i < N_SLOTS; i++) h.gen[i] += 1000;
        h_call(&h, N_SLOTS, all, ones, NULL);
        for (int i = 0; i < N_SLOTS; i++) {
            h.gen[i] -= 1000;
            if (k % 2 == 0 || i == 1) h_rollback(&h, i, 1);
        }
        h_call(&h, N_SLOTS, all, ones, NULL);
    }
    // Successive rollbacks: 16 rows taken back, 1 fed, then 2 more would be 17 below the highest
    // position fed (the rejected rows overwrote a window ring row the new position reads):
    // refused by the states and the session, nothing changed; 1 more (16 below, the edge) taken
    // and fed on bit-identically.
    const int z = 0, sixteen = DI_DSV41_ROLLBACK_MAX, one = 1, three = 3;
    h.gen[0] += 1000;
    h_call(&h, 1, &z, &sixteen, NULL);
    h.gen[0] -= 1000;
    h_rollback(&h, 0, DI_DSV41_ROLLBACK_MAX);
    h_call(&h, 1, &z, &one, NULL);
    const int32_t pz = di_dsv41_dev_n_past(h.st, 0);
    CHECK_EQ(di_dsv41_dev_rollback(h.st, 0, 2), DI_ERR_INVALID);
    if (h.st2) CHECK_EQ(di_dsv41_dev_rollback(h.st2, 0, 2), DI_ERR_INVALID);
    if (h.st1) CHECK_EQ(di_dsv41_dev_rollback(h.st1, 0, 2), DI_ERR_INVALID);
    CHECK_EQ(di_dsv41_rollback(h.ses[0], 2), DI_ERR_INVALID);
    CHECK_EQ(di_dsv41_dev_n_past(h.st, 0), pz);
    h_rollback(&h, 0, 1);
    h_call(&h, 1, &z, &three, NULL);
    // Bad rollbacks: nothing changes.
    const int32_t p0 = di_dsv41_dev_n_past(h.st, 0);
    CHECK_EQ(di_dsv41_dev_rollback(h.st, 0, DI_DSV41_ROLLBACK_MAX + 1), DI_ERR_INVALID);
    CHECK_EQ(di_dsv41_dev_rollback(h.st, 0, -1), DI_ERR_INVALID);
    CHECK_EQ(di_dsv41_dev_rollback(h.st, N_SLOTS, 1), DI_ERR_INVALID);
    CHECK_EQ(di_dsv41_dev_n_past(h.st, 0), p0);
    // After a restart at 0 a slot cannot go below 0; after a tail restore not below its position.
    const bool rs[N_SLOTS] = {false, false, true};
    const int two[N_SLOTS] = {1, 1, 2};
    h_call(&h, N_SLOTS, all, two, rs);
    CHECK_EQ(di_dsv41_dev_rollback(h.st, 2, 3), DI_ERR_INVALID);
    const int fill = BT - 2;
    const int s2 = 2;
    h_call(&h, 1, &s2, &fill, NULL);
    CHECK_EQ(di_dsv41_dev_n_past(h.st, 2), BT);
    uint8_t *tail = malloc(di_dsv41_dev_tail_bytes(h.d));
    int32_t tok[BT];
    for (int p = 0; p < BT; p++) tok[p] = token_of(2, h.gen[2], p);
    CHECK_EQ(di_dsv41_dev_tail_save(h.st, 2, tail), DI_OK);
    CHECK_EQ(di_dsv41_dev_tail_restore(h.st, 2, BT, tail, tok), DI_OK);
    CHECK_EQ(di_dsv41_dev_rollback(h.st, 2, 1), DI_ERR_INVALID);
    CHECK_EQ(di_dsv41_dev_rollback(h.st, 2, 0), DI_OK);
    free(tail);
    CHECK(h.n_rows > 0);
    CHECK_EQ(h.n_bad, 0);
    h_free(&h);
}

static void fp32_rollback(void) {
    if (!SAN) rollback_case(DI_PRECISION_FP32);
}
static void official_rollback(void) {
    rollback_case(DI_PRECISION_OFFICIAL);
}

// (o) DSpark (di_dsv41_dev_dspark_enable, di_dsv41_dev_draft) on the DSpark model: after every
// call (ragged prefill chunks, decode steps in graphs, verify-shaped calls of another token stream
// with rows rolled back) each slot's draft block, drafted on the dev states in one call, is bit
// for bit di_dsv41_draft_batch's on the sessions: tokens, confidences and their logits, and every
// draft logit (memcmp); the context rows come from the taps of every call (the drafts read
// them); a tail snapshot restored into another slot drafts the same; bad drafts refused.
static void h_draft(harness *h, int n, const int *slots) {
    const int32_t B = h->m->hp.dspark_block_size;
    di_dsv41_dev_draft_seq dv[N_SLOTS];
    di_dsv41_draft_seq cpu[N_SLOTS];
    const size_t nl = (size_t)n * (size_t)B * (size_t)h->V;
    float *lg = malloc(sizeof(float) * nl), *lg2 = malloc(sizeof(float) * nl),
          *ref = malloc(sizeof(float) * nl);
    for (int i = 0; i < n; i++) {
        const int s = slots[i];
        const int32_t a = di_dsv41_dev_n_past(h->st, s);
        const int32_t anchor = token_of(s, h->gen[s] + 7, a);
        dv[i] = (di_dsv41_dev_draft_seq){.slot = s, .anchor = anchor};
        cpu[i] = (di_dsv41_draft_seq){.s = h->ses[s], .anchor = anchor};
    }
    CHECK_EQ(di_dsv41_draft_batch(h->m, di_dsv41_ws(h->ses[slots[0]]), cpu, n, ref), DI_OK);
    di_dsv41_dev_state *sts[3] = {h->st, h->st2, h->st1};
    for (int k = 0; k < 3; k++) {
        if (!sts[k]) continue;
        di_dsv41_dev_draft_seq d2[N_SLOTS];
        memcpy(d2, dv, sizeof d2);
        CHECK_EQ(di_dsv41_dev_draft(sts[k], d2, n, k == 0 ? lg : lg2), DI_OK);
        for (int i = 0; i < n; i++) {
            const bool same = memcmp(&d2[i].out, &cpu[i].out, sizeof d2[i].out) == 0;
            CHECK(same);
            h->n_rows++;
            if (!same && h->n_bad++ < 5)
                fprintf(stderr, "draft of slot %d: tokens %d/%d conf %g/%g\n", slots[i],
                        d2[i].out.tokens[0], cpu[i].out.tokens[0], d2[i].out.confidence[0],
                        cpu[i].out.confidence[0]);
        }
        CHECK(memcmp(k == 0 ? lg : lg2, ref, sizeof(float) * nl) == 0);
    }
    free(lg);
    free(lg2);
    free(ref);
}

static void dspark_case(di_precision prec) {
    g_mtp = true;
    g_model = g_ds;
    harness h;
    h_init(&h, prec, true);
    CHECK(di_dsv41_dev_dspark_on(h.st));
    CHECK(h.m->hp.dspark_block_size >= 2);
    h.picks = true; // (p) greedy rows in DSpark states' calls (their context rows after the head)
    const int all[N_SLOTS] = {0, 1, 2};
    const int pre[N_SLOTS] = {5, 19, 22};
    h_call(&h, N_SLOTS, all, pre, NULL);
    h_draft(&h, N_SLOTS, all);
    const int order[N_SLOTS] = {2, 0, 1}, sizes[N_SLOTS] = {1, 12, 3};
    h_call(&h, N_SLOTS, order, sizes, NULL);
    h_draft(&h, N_SLOTS, order);
    const int two[2] = {1, 2};
    h_draft(&h, 2, two);
#if defined(__SANITIZE_ADDRESS__) || defined(DI_ASAN)
    enum { STEPS = 7 }; // a decode graph replayed at the third decode step
#else
    enum { STEPS = 20 };
#endif
    const int ones[N_SLOTS] = {1, 1, 1};
    // Verifies: [anchor, drafts] of another stream, rejected rows back; ragged, and uniform (a
    // verify graph: captured at its second step, replayed after).
    const int spec[2][N_SLOTS] = {{3, 2, 3}, {3, 3, 3}}, back[2][N_SLOTS] = {{2, 0, 3}, {1, 3, 0}};
    for (int k = 0; k < STEPS; k++) {
        if (k % 3 != 0) {
            const int v = k % 3 - 1;
            for (int i = 0; i < N_SLOTS; i++) h.gen[i] += 1000;
            h_call(&h, N_SLOTS, all, spec[v], NULL);
            for (int i = 0; i < N_SLOTS; i++) {
                h.gen[i] -= 1000;
                h_rollback(&h, i, back[v][i]);
            }
        } else {
            h_call(&h, N_SLOTS, all, ones, NULL);
        }
        h_draft(&h, N_SLOTS, all);
    }
    di_dsv41_dev_graph_stats g;
    di_dsv41_dev_get_graph_stats(h.st, &g);
    CHECK(g.n_replayed > 0);
    // A tail snapshot (window and DSpark rings) of slot 2, restarted and fed 2 * BT positions,
    // restored into slot 1 on slot 2's blocks below it: the same drafts as slot 2 (logits too),
    // before and after one more position on both.
    {
        const bool rs[N_SLOTS] = {false, false, true};
        const int sz[N_SLOTS] = {1, 1, 2 * BT};
        h_call(&h, N_SLOTS, all, sz, rs);
        enum { P = 2 * BT };
        CHECK_EQ(di_dsv41_dev_n_past(h.st, 2), P);
        uint8_t *tail = malloc(di_dsv41_dev_tail_bytes(h.d));
        int32_t tok[P + 1], blk1[MAXB], rows[1] = {0};
        for (int q = 0; q <= P; q++) tok[q] = token_of(2, h.gen[2], q);
        for (int j = 0; j < MAXB; j++) blk1[j] = j < P / BT ? h.blk[2][j] : h.blk[1][j];
        CHECK_EQ(di_dsv41_dev_tail_save(h.st, 2, tail), DI_OK);
        CHECK_EQ(di_dsv41_dev_tail_restore(h.st, 1, P, tail, tok), DI_OK);
        const int64_t nl = (int64_t)h.m->hp.dspark_block_size * h.V;
        float *l1 = malloc(sizeof(float) * (size_t)nl), *l2 = malloc(sizeof(float) * (size_t)nl);
        for (int step = 0; step < 2; step++) {
            di_dsv41_dev_draft_seq a2 = {.slot = 2, .anchor = 11}, a1 = {.slot = 1, .anchor = 11};
            CHECK_EQ(di_dsv41_dev_draft(h.st, &a2, 1, l2), DI_OK);
            CHECK_EQ(di_dsv41_dev_draft(h.st, &a1, 1, l1), DI_OK);
            CHECK(memcmp(&a1.out, &a2.out, sizeof a1.out) == 0);
            CHECK(memcmp(l1, l2, sizeof(float) * (size_t)nl) == 0);
            const int32_t q = P + step;
            di_dsv41_dev_seq q2 = {
                .slot = 2, .pos = q, .n_tok = 1, .blocks = h.blk[2], .n_blocks = MAXB};
            di_dsv41_dev_seq q1 = {
                .slot = 1, .pos = q, .n_tok = 1, .blocks = blk1, .n_blocks = MAXB};
            if (step == 0) {
                CHECK_EQ(di_dsv41_dev_forward(h.st, &q2, 1, &tok[P], rows, 1, h.got), DI_OK);
                CHECK_EQ(di_dsv41_dev_forward(h.st, &q1, 1, &tok[P], rows, 1, h.got2), DI_OK);
                CHECK(memcmp(h.got, h.got2, sizeof(float) * (size_t)h.V) == 0);
            }
        }
        free(l1);
        free(l2);
        free(tail);
    }
    // Bad drafts: nothing runs.
    di_dsv41_dev_draft_seq bad[2] = {{.slot = 0, .anchor = 1}, {.slot = 0, .anchor = 1}};
    CHECK_EQ(di_dsv41_dev_draft(h.st, bad, 2, NULL), DI_ERR_INVALID); // a slot twice
    bad[0].anchor = (int32_t)h.V;
    CHECK_EQ(di_dsv41_dev_draft(h.st, bad, 1, NULL), DI_ERR_INVALID); // anchor out of range
    bad[0] = (di_dsv41_dev_draft_seq){.slot = N_SLOTS, .anchor = 1};
    CHECK_EQ(di_dsv41_dev_draft(h.st, bad, 1, NULL), DI_ERR_INVALID);
    CHECK(h.n_rows > 0);
    CHECK_EQ(h.n_bad, 0);
    h_free(&h);
    g_mtp = false;
    g_model = g_dir;
}

static void fp32_dspark(void) {
    if (!SAN) dspark_case(DI_PRECISION_FP32);
}
static void official_dspark(void) {
    dspark_case(DI_PRECISION_OFFICIAL);
}

static void fp32_tail(void) {
    tail_case(DI_PRECISION_FP32);
}
static void official_tail(void) {
    tail_case(DI_PRECISION_OFFICIAL);
}

// (f) the product wiring: di_dsv41_dev_attach, then plain sessions (a 300-token prompt fed in the
// dev forward's chunks of 256 rows, then decodes with last_only) against a model without it; a
// save (a token state), a rollback as the CPU session's (past 16 positions refused), and batched
// calls of such a session refused.
static void wiring(di_precision prec) {
    di_model_options mo = di_model_options_default();
    mo.n_threads = 2;
    mo.precision = prec;
    di_model *md = NULL, *mc = NULL;
    di_backend *b = NULL, *bk[MAX_STAGES] = {NULL};
    CHECK_EQ(di_model_load(g_dir, &mo, &md), DI_OK);
    CHECK_EQ(di_model_load(g_dir, &mo, &mc), DI_OK);
    for (int32_t k = 0; k < g_stages; k++) CHECK_EQ(di_cpu_backend_create(2, &bk[k]), DI_OK);
    b = bk[0];
    if (!md || !mc || !b || !bk[g_stages - 1]) return;
    CHECK_EQ(di_dsv41_dev_attach_stages(md, bk, g_stages), DI_OK);
    CHECK_EQ(di_dsv41_dev_n_stages(md->dev41), g_stages);
    CHECK_EQ(di_dsv41_dev_attach(md, b), DI_ERR_INVALID);
    if (g_stages > 1) { // (m) what the model describes: one line per stage, its layers
        char desc[8192];
        di_model_describe(md, desc, sizeof desc);
        int32_t a = -1, e = -1; // the split the backends' memory chose (di_dsv41_dev_split_mem)
        CHECK(di_dsv41_dev_stage(md->dev41, g_stages - 1, &a, &e) == bk[g_stages - 1]);
        char want[96];
        snprintf(want, sizeof want, "pipeline stage %d  layers [%d, 6) + head, ", g_stages - 1, a);
        CHECK(strstr(desc, want) != NULL);
    }
    di_session_options so = di_session_options_default();
    so.n_ctx_max = 400;
    di_session *sd = NULL, *sc = NULL;
    CHECK_EQ(di_session_create(md, &so, &sd), DI_OK);
    CHECK_EQ(di_session_create(mc, &so, &sc), DI_OK);
    enum { P = 300, DEC = 20 };
    const int64_t V = md->hp.n_vocab;
    int32_t tok[P];
    for (int i = 0; i < P; i++) tok[i] = token_of(0, 3, i);
    float *ld = malloc(sizeof(float) * (size_t)(P * V)),
          *lc = malloc(sizeof(float) * (size_t)(P * V));
    di_forward_out od = {.logits = ld}, oc = {.logits = lc};
    CHECK_EQ(di_session_forward(sd, tok, P, &od), DI_OK);
    CHECK_EQ(di_session_forward(sc, tok, P, &oc), DI_OK);
    CHECK(memcmp(ld, lc, sizeof(float) * (size_t)(P * V)) == 0);
    od.last_only = oc.last_only = true;
    int n_same = 0;
    for (int k = 0; k < DEC; k++) {
        int32_t t = token_of(1, 3, P + k);
        CHECK_EQ(di_session_forward(sd, &t, 1, &od), DI_OK);
        CHECK_EQ(di_session_forward(sc, &t, 1, &oc), DI_OK);
        n_same += memcmp(ld, lc, sizeof(float) * (size_t)V) == 0;
    }
    CHECK_EQ(n_same, DEC);
    CHECK_EQ(sd->pos, P + DEC);
    void *bytes = NULL;
    size_t nb = 0;
    CHECK_EQ(di_session_save(sd, &bytes, &nb), DI_OK); // a token state: test_session_dev.c
    di_free_buffer(bytes);
    // Rollback on a device session (di_dsv41_dev_rollback, <= 16 positions): the CPU session's
    // logits after taking a position back and feeding another token.
    CHECK_EQ(di_session_rollback(sd, 1), DI_OK);
    CHECK_EQ(di_session_rollback(sc, 1), DI_OK);
    CHECK_EQ(sd->pos, P + DEC - 1);
    int32_t other = token_of(2, 5, P + DEC);
    CHECK_EQ(di_session_forward(sd, &other, 1, &od), DI_OK);
    CHECK_EQ(di_session_forward(sc, &other, 1, &oc), DI_OK);
    CHECK(memcmp(ld, lc, sizeof(float) * (size_t)V) == 0);
    CHECK_EQ(di_session_rollback(sd, 17), DI_ERR_INVALID); // past DI_DSV41_ROLLBACK_MAX
    int32_t one = 5;
    di_dsv41_seq bs = {.s = sd, .tokens = &one, .n_tok = 1, .n_out = 1};
    CHECK_EQ(di_dsv41_forward_batch(md, di_dsv41_ws(sd), &bs, 1, ld), DI_ERR_INVALID);
    CHECK_EQ(sd->pos, P + DEC);
    di_session_destroy(sd);
    di_session_destroy(sc);
    free(ld);
    free(lc);
    di_model_destroy(md); // the dev forward first, then the caller's backends
    di_model_destroy(mc);
    for (int32_t k = 0; k < g_stages; k++) di_backend_destroy(bk[k]);
}

// (h) the committed v41_long fixture (official layout; 7 layers: kv sources m = 2 and m = 1, a
// reindex layer of ratio 2 without keys of its own, 4 candidate blocks of 8 restricting layer 6,
// Engram on the kv sources): (a) - (e) again. Its directory carries no Engram token map
// (ref.safetensors has it as engram_cmap): the model directory is assembled in a temp dir, as
// tests/model/test_v41_fixtures.c does.
static bool assemble_fixture(void) {
    const char *src = "tests/data/fixtures/v41_long";
    char path[1024], cwd[512], a[2048], b[2048];
    if (!getcwd(cwd, sizeof cwd)) return false;
    snprintf(path, sizeof path, "%s/ref.safetensors", src);
    di_st_file *ref = NULL;
    if (di_st_file_open(path, &ref) != DI_OK) return false;
    const di_st_tensor *cmap = di_st_file_find(ref, "engram_cmap");
    bool ok = cmap && cmap->dtype == DI_DTYPE_I32;
    const char *files[2] = {"config.json", "model.safetensors"};
    for (int i = 0; i < 2 && ok; i++) {
        snprintf(a, sizeof a, "%s/%s/official/%s", cwd, src, files[i]);
        snprintf(b, sizeof b, "%s/%s", g_fix, files[i]);
        ok = symlink(a, b) == 0;
    }
    snprintf(b, sizeof b, "%s/engram", g_fix);
    ok = ok && mkdir(b, 0755) == 0;
    if (ok) {
        snprintf(b, sizeof b, "%s/engram/token_map.safetensors", g_fix);
        di_st_write_tensor t = {.name = "token_map",
                                .dtype = DI_DTYPE_I32,
                                .n_dims = 1,
                                .shape = {cmap->n_elements},
                                .data = cmap->data};
        ok = di_st_write_file(b, &t, 1) == DI_OK;
    }
    di_st_file_close(ref);
    return ok;
}

static void fixture_long(void) {
    g_model = g_fix;
    one_sequence(DI_PRECISION_FP32);
    batches(DI_PRECISION_FP32);
    one_sequence(DI_PRECISION_OFFICIAL);
    batches(DI_PRECISION_OFFICIAL);
    g_model = g_dir;
}

static void refuses_v4(void) {
    char dir[256];
    snprintf(dir, sizeof dir, "/tmp/di_test_dev41_v4_XXXXXX");
    CHECK(mkdtemp(dir) != NULL);
    di_synth_config cfg;
    CHECK_EQ(di_synth_preset("tiny-128", &cfg), DI_OK);
    cfg.n_vocab = 512;
    CHECK_EQ(di_synth_write(&cfg, dir), DI_OK);
    di_model_options mo = di_model_options_default();
    mo.n_threads = 1;
    di_model *m = NULL;
    di_backend *b = NULL;
    di_dsv41_dev *d = NULL;
    CHECK_EQ(di_model_load(dir, &mo, &m), DI_OK);
    CHECK_EQ(di_cpu_backend_create(1, &b), DI_OK);
    CHECK_EQ(di_dsv41_dev_create(m, b, &d), DI_ERR_UNSUPPORTED);
    di_backend_destroy(b);
    di_model_destroy(m);
    di_test_remove_dir(dir);
}

// (l) the split: any cut is taken (what crosses it is handed over), the DP's split is the
// byte-optimal one, a block's memory counts the mirrors.
static void stage_rules(void) {
    di_model_options mo = di_model_options_default();
    mo.n_threads = 1;
    di_model *m = NULL;
    di_backend *b = NULL;
    CHECK_EQ(di_model_load(g_dir, &mo, &m), DI_OK);
    CHECK_EQ(di_cpu_backend_create(1, &b), DI_OK);
    if (!m || !b) return;
    const di_hparams *hp = &m->hp;
    const int32_t L = hp->n_layer;
    CHECK_EQ(L, 6);
    // Ratios 0 2 2 1 1 1, kv sources 1 and 3, index sources 1, 3, 5, candidate source 3.
    di_backend *bs[6] = {b, b, b, b, b, b};
    di_dsv41_dev *d = NULL;
    // Right after kv source 1 (layer 2 reads its entries and top-k on another stage), right after
    // the candidate source 3 (layers 4, 5 read its entries, top-k and candidate pool), both.
    const int32_t after_src[3] = {0, 2, 6}, after_cand[3] = {0, 4, 6}, both[4] = {0, 2, 4, 6};
    const int32_t empty[3] = {0, 3, 3}, late[3] = {1, 3, 6};
    // An entry and its index key as packed codes (Q4e of head_dim, Q4 of index_head_dim): 70
    // bytes on the tiny model (36 + 34; 2,560 as FP32 rows before).
    const int64_t row =
        (hp->head_dim / 2 + hp->head_dim / 16) + (hp->index_head_dim / 2 + hp->index_head_dim / 32);
    CHECK_EQ(row, 70);
    int64_t blk = 0, slot = 0, mem = 0, per[3] = {0, 0, 0};
    CHECK_EQ(di_dsv41_dev_create_split(m, bs, 2, empty, &d), DI_ERR_INVALID);
    CHECK_EQ(di_dsv41_dev_create_split(m, bs, 2, late, &d), DI_ERR_INVALID);
    CHECK(d == NULL);
    // A block: source 1's 8 entries and keys, source 3's 16; a mirror adds its source's.
    CHECK_EQ(di_dsv41_dev_create_split(m, bs, 2, after_src, &d), DI_OK);
    if (d) {
        // The I/O bytes: the CPU forward's page (each run padded to 64 bytes: 320 + 320 for
        // source 1's 8 entries and keys, 576 + 576 for source 3's 16); the memory: the codes.
        CHECK_EQ(di_dsv41_dev_sizes(d, BT, &blk, &slot), DI_OK);
        CHECK_EQ(blk, (int64_t)di_dsv41_page_bytes(m, BT));
        CHECK_EQ(blk, 1792);
        // Every layer's 16 + DI_DSV41_ROLLBACK_MAX window ring rows (Q8: 64 + 2 bytes) and
        // source 1's C and Z rings of DI_DSV41_ROLLBACK_MAX + 2 FP32 rows.
        CHECK_EQ(slot, 6 * (16 + DI_DSV41_ROLLBACK_MAX) * 66 +
                           2 * (DI_DSV41_ROLLBACK_MAX + 2) * hp->head_dim * 4);
        CHECK_EQ(slot, 21888);
        CHECK_EQ(di_dsv41_dev_block_mem_bytes(d, BT, &mem, per), DI_OK);
        CHECK_EQ(per[0], 8 * row);            // source 1
        CHECK_EQ(per[1], 8 * row + 16 * row); // source 1's mirror, source 3
        CHECK_EQ(mem, 24 * row + 8 * row);
        CHECK_EQ(di_dsv41_dev_block_mem_bytes(d, BT + 1, &mem, per), DI_ERR_INVALID);
        di_dsv41_dev_destroy(d);
        d = NULL;
    }
    CHECK_EQ(di_dsv41_dev_create_split(m, bs, 2, after_cand, &d), DI_OK);
    if (d) {
        CHECK_EQ(di_dsv41_dev_block_mem_bytes(d, BT, &mem, per), DI_OK);
        CHECK_EQ(per[0], 24 * row);
        CHECK_EQ(per[1], 16 * row); // source 3's mirror only
        CHECK_EQ(mem, 24 * row + 16 * row);
        di_dsv41_dev_destroy(d);
        d = NULL;
    }
    CHECK_EQ(di_dsv41_dev_create_split(m, bs, 3, both, &d), DI_OK);
    if (d) {
        int32_t a = 0, e = 0;
        CHECK_EQ(di_dsv41_dev_n_stages(d), 3);
        for (int32_t k = 0; k < 3; k++) {
            CHECK(di_dsv41_dev_stage(d, k, &a, &e) == b);
            CHECK_EQ(a, both[k]);
            CHECK_EQ(e, both[k + 1]);
        }
        CHECK(di_dsv41_dev_stage(d, 3, &a, &e) == NULL);
        CHECK_EQ(di_dsv41_dev_block_mem_bytes(d, BT, &mem, per), DI_OK);
        CHECK_EQ(per[0], 8 * row);
        CHECK_EQ(per[1], 24 * row);
        CHECK_EQ(per[2], 16 * row);
        CHECK_EQ(mem, 24 * row + 24 * row);
        di_dsv41_dev_destroy(d);
        d = NULL;
    }
    CHECK_EQ(di_dsv41_dev_create(m, b, &d), DI_OK);
    if (d) {
        CHECK_EQ(di_dsv41_dev_block_mem_bytes(d, BT, &mem, per), DI_OK);
        CHECK_EQ(mem, 24 * row); // one stage: no mirror
        di_dsv41_dev_destroy(d);
        d = NULL;
    }
    // The DP against every split: one layer per stage gives each layer's bytes (the embedding on
    // the first, the head on the last); the 2- and 3-stage splits are the byte-optimal ones.
    int32_t l0[8];
    int64_t one[6], bytes[6], total = 0;
    CHECK_EQ(di_dsv41_dev_split(m, 6, l0, one), DI_OK);
    for (int32_t k = 0; k < 6; k++) CHECK_EQ(l0[k], k);
    for (int32_t k = 0; k < 6; k++) total += one[k];
    CHECK_EQ(di_dsv41_dev_split(m, 1, l0, bytes), DI_OK);
    CHECK_EQ(bytes[0], total);
    int64_t best2 = INT64_MAX, best3 = INT64_MAX;
    for (int32_t c1 = 1; c1 < L; c1++) {
        int64_t a = 0, e = 0;
        for (int32_t il = 0; il < L; il++) *(il < c1 ? &a : &e) += one[il];
        if ((a > e ? a : e) < best2) best2 = a > e ? a : e;
        for (int32_t c2 = c1 + 1; c2 < L; c2++) {
            int64_t x[3] = {0, 0, 0}, mx = 0;
            for (int32_t il = 0; il < L; il++) x[il < c1 ? 0 : il < c2 ? 1 : 2] += one[il];
            for (int k = 0; k < 3; k++) mx = x[k] > mx ? x[k] : mx;
            if (mx < best3) best3 = mx;
        }
    }
    CHECK_EQ(di_dsv41_dev_split(m, 2, l0, bytes), DI_OK);
    CHECK_EQ(bytes[0] + bytes[1], total);
    CHECK_EQ(bytes[0] > bytes[1] ? bytes[0] : bytes[1], best2);
    fprintf(stderr, "(l) 2 stages: [0, %d) [%d, 6), %lld + %lld bytes\n", l0[1], l0[1],
            (long long)bytes[0], (long long)bytes[1]);
    CHECK_EQ(di_dsv41_dev_split(m, 3, l0, bytes), DI_OK);
    int64_t mx3 = 0;
    for (int k = 0; k < 3; k++) mx3 = bytes[k] > mx3 ? bytes[k] : mx3;
    CHECK_EQ(mx3, best3);
    fprintf(stderr, "(l) 3 stages: [0, %d) [%d, %d) [%d, 6)\n", l0[1], l0[1], l0[2], l0[2]);
    CHECK_EQ(di_dsv41_dev_split(m, 7, l0, bytes), DI_ERR_INVALID); // more stages than layers
    CHECK_EQ(di_dsv41_dev_split(m, 0, l0, bytes), DI_ERR_INVALID);
    CHECK_EQ(di_dsv41_dev_create_stages(m, bs, 7, &d), DI_ERR_INVALID);
    di_backend_destroy(b);
    di_model_destroy(m);
}

// (q) the KV-aware split (di_dsv41_dev_split_mem) on two CPU backends of unequal memory
// (di_cpu_backend_set_mem): stage 1 gets just too little for the weight split's stage 1 to hold
// one sequence's blocks, so that split would be refused; the chosen split differs, holds more
// blocks (checked against the stage costs) and di_dsv41_dev_create_stages takes it; its logits
// are the 1-stage forward's and the CPU forward's bit for bit ((l) on it: q_split). Without
// memory (a budget-less call) it is di_dsv41_dev_split's.
static int32_t q_split[3];
static void mem_split(void) {
    di_model_options mo = di_model_options_default();
    mo.n_threads = 2;
    mo.dev_slots = N_SLOTS, mo.dev_ctx = N_CTX, mo.dev_rows = MAX_ROWS;
    mo.dev_reserve_bytes = 4096;
    di_model *m = NULL;
    CHECK_EQ(di_model_load(g_model, &mo, &m), DI_OK);
    if (!m) return;
    const int32_t L = m->hp.n_layer, one_seq = (N_CTX + BT - 1) / BT;
    int32_t wl0[3];
    int64_t wb[2];
    CHECK_EQ(di_dsv41_dev_split(m, 2, wl0, wb), DI_OK);
    di_dev_split_out sp;
    CHECK_EQ(di_dsv41_dev_split_mem(m, 2, NULL, &sp), DI_OK);
    CHECK(!sp.by_memory && sp.layer0[1] == wl0[1]);
    di_dev_stage_cost w0, w1;
    di_dsv41_dev_stage_cost(m, 0, wl0[1], &w0);
    di_dsv41_dev_stage_cost(m, wl0[1], L, &w1);
    CHECK(w1.block_bytes > 0);
    const int64_t budget[2] = {8 * (w0.weight_bytes + w1.weight_bytes + w0.fixed_bytes +
                                    w1.fixed_bytes +
                                    64 * one_seq * (w0.block_bytes + w1.block_bytes)),
                               w1.weight_bytes + w1.fixed_bytes + one_seq * w1.block_bytes - 1};
    CHECK_EQ(di_dsv41_dev_split_mem(m, 2, budget, &sp), DI_OK);
    CHECK(sp.by_memory);
    CHECK(sp.layer0[1] != wl0[1]);
    CHECK(sp.n_blocks >= one_seq); // the weight split: one_seq - 1 on stage 1
    for (int32_t k = 0; k < 2; k++) {
        di_dev_stage_cost c;
        di_dsv41_dev_stage_cost(m, sp.layer0[k], sp.layer0[k + 1], &c);
        const int64_t left = budget[k] - c.weight_bytes - c.fixed_bytes;
        CHECK_EQ(sp.blocks[k], c.block_bytes > 0 ? left / c.block_bytes : INT64_MAX);
    }
    fprintf(stderr, "(q) weights: [0, %d) [%d, %d); memory: [0, %d) [%d, %d), %lld blocks\n",
            wl0[1], wl0[1], L, sp.layer0[1], sp.layer0[1], L, (long long)sp.n_blocks);
    // Too little for any split: refused (logged with the stage and its bytes).
    const int64_t tiny[2] = {budget[0], w1.weight_bytes / 4};
    di_dev_split_out no;
    CHECK_EQ(di_dsv41_dev_split_mem(m, 2, tiny, &no), DI_ERR_NOMEM);
    // The backends report those budgets plus the reserve: create_stages takes the same split.
    di_backend *bs[2] = {NULL, NULL};
    CHECK_EQ(di_cpu_backend_create(2, &bs[0]), DI_OK);
    CHECK_EQ(di_cpu_backend_create(2, &bs[1]), DI_OK);
    for (int32_t k = 0; k < 2 && bs[k]; k++)
        di_cpu_backend_set_mem(bs[k], (size_t)budget[k] + mo.dev_reserve_bytes,
                               (size_t)budget[k] * 2 + mo.dev_reserve_bytes);
    di_dsv41_dev *d = NULL;
    if (bs[0] && bs[1]) CHECK_EQ(di_dsv41_dev_create_stages(m, bs, 2, &d), DI_OK);
    if (d) {
        int32_t a = -1, e = -1;
        CHECK(di_dsv41_dev_stage(d, 1, &a, &e) == bs[1]);
        CHECK(a == sp.layer0[1] && e == L);
        di_dsv41_dev_destroy(d);
    }
    di_backend_destroy(bs[0]);
    di_backend_destroy(bs[1]);
    q_split[0] = 0, q_split[1] = sp.layer0[1], q_split[2] = L;
    di_model_destroy(m);
}

// (l) one split (g_split, g_stages): the forward against the 1-stage forward beside it and the CPU
// sessions (h_call): prefill chunks and decodes (graphs captured, then replayed: the hand-over
// between graph launches), the block bytes and a tail snapshot equal to the 1-stage state's; a
// replay on slot 0's cached blocks (prefix reuse: the mirrors' copies of blocks another sequence
// wrote) and one on copies of them written through the block I/O (owners and mirrors) continue
// exactly as slot 0 did.
static void cut_case(di_precision prec) {
    harness h;
    h_init(&h, prec, false);
    const di_hparams *hp = &h.m->hp;
    enum { H = 112, AFTER = 8 };
    const int s0 = 0, s2 = 2;
    const int chunks[] = {7, 33, 40, 32}, one = 1, batch[2] = {0, 2}, sz[2] = {1, 13};
    for (int k = 0; k < 4; k++) h_call(&h, 1, &s0, &chunks[k], NULL);
    float *cold = malloc(sizeof(float) * (size_t)(AFTER * h.V));
    for (int k = 0; k < AFTER; k++) {
        h_call(&h, 1, &s0, &one, NULL);
        memcpy(cold + (int64_t)k * h.V, h.got, sizeof(float) * (size_t)h.V);
    }
    // A ragged batch (slot 0 past its cold logits, slot 2 a prefill) and decodes of the two.
    const int ones[2] = {1, 1};
    h_call(&h, 2, batch, sz, NULL);
    for (int k = 0; k < 4; k++) h_call(&h, 2, batch, ones, NULL);
    di_dsv41_dev_graph_stats g;
    di_dsv41_dev_get_graph_stats(h.st, &g);
    CHECK(g.n_replayed >= 8);
    CHECK_EQ(g.last_uploads, decode_uploads(h.m, h.d));
    // Block bytes and a tail snapshot (at H + AFTER + 1 + 4 = 125: odd, so one more decode).
    h_call(&h, 2, batch, ones, NULL);
    int64_t bb = 0, sb = 0;
    CHECK_EQ(di_dsv41_dev_sizes(h.d, BT, &bb, &sb), DI_OK);
    uint8_t *x = malloc((size_t)bb), *y = malloc((size_t)bb);
    for (int j = 0; j < (H + AFTER + 6) / BT + 1; j++) {
        CHECK_EQ(di_dsv41_dev_state_read_block(h.st, h.blk[s0][j], x), DI_OK);
        CHECK_EQ(di_dsv41_dev_state_read_block(h.st1, h.blk[s0][j], y), DI_OK);
        CHECK(memcmp(x, y, (size_t)bb) == 0);
    }
    const size_t tb = di_dsv41_dev_tail_bytes(h.d);
    uint8_t *t0 = malloc(tb), *t1 = malloc(tb);
    CHECK_EQ(di_dsv41_dev_n_past(h.st, s0), H + AFTER + 6);
    CHECK_EQ(di_dsv41_dev_tail_save(h.st, s0, t0), DI_OK);
    CHECK_EQ(di_dsv41_dev_tail_save(h.st1, s0, t1), DI_OK);
    CHECK(memcmp(t0, t1, tb) == 0);
    // Prefix reuse: slot 1 on slot 0's first H positions' blocks, replaying from Q; then slot 2
    // restarted on copies of them in the spare blocks (read from st, written into st's owners
    // and mirrors; st1 gets the same bytes).
    int32_t tok[H + AFTER], rows[MAX_ROWS], blk1[MAXB], blk2[MAXB];
    for (int p = 0; p < H + AFTER; p++) tok[p] = token_of(s0, h.gen[s0], p);
    for (int r = 0; r < MAX_ROWS; r++) rows[r] = r;
    for (int j = 0; j < MAXB; j++) {
        blk1[j] = j < H / BT ? h.blk[s0][j] : h.blk[1][j];
        blk2[j] = j < H / BT ? h.spare[j] : h.blk[s2][j];
    }
    for (int j = 0; j < H / BT; j++) {
        CHECK_EQ(di_dsv41_dev_state_read_block(h.st, h.blk[s0][j], x), DI_OK);
        CHECK_EQ(di_dsv41_dev_state_write_block(h.st, h.spare[j], x), DI_OK);
        CHECK_EQ(di_dsv41_dev_state_write_block(h.st1, h.spare[j], x), DI_OK);
    }
    const int32_t Q = H - hp->n_layer * (hp->window - 1);
    for (int pass = 0; pass < 2; pass++) {
        di_dsv41_dev_seq sq = {.slot = pass ? s2 : 1,
                               .blocks = pass ? blk2 : blk1,
                               .n_blocks = MAXB,
                               .win_lo = Q,
                               .n_cached = H,
                               .prefix = tok};
        int n_same = 0;
        for (int32_t p = Q; p < H + AFTER;) {
            const int32_t n = H + AFTER - p < MAX_ROWS ? H + AFTER - p : MAX_ROWS;
            sq.pos = p, sq.n_tok = n;
            CHECK_EQ(di_dsv41_dev_forward(h.st, &sq, 1, tok + p, rows, n, h.got), DI_OK);
            CHECK_EQ(di_dsv41_dev_forward(h.st1, &sq, 1, tok + p, rows, n, h.got2), DI_OK);
            CHECK(memcmp(h.got, h.got2, sizeof(float) * (size_t)(n * h.V)) == 0);
            for (int32_t t = 0; t < n; t++)
                if (p + t >= H)
                    n_same += memcmp(h.got + (int64_t)t * h.V, cold + (int64_t)(p + t - H) * h.V,
                                     sizeof(float) * (size_t)h.V) == 0;
            p += n;
        }
        CHECK_EQ(n_same, AFTER);
    }
    CHECK_EQ(h.n_bad, 0);
    free(x);
    free(y);
    free(t0);
    free(t1);
    free(cold);
    h_free(&h);
}

// (l) every split of the tiny model into 2 and 3 stages (the cuts a rule once refused among them:
// 2, right after kv source 1, and 4, right after the candidate source), both recipes. Under
// AddressSanitizer a memory check (CUT_RECIPES: one recipe each) of two splits with every kind of
// hand-over: 2 + 4 (a ratio-2 source's mirror and the top-k into the middle stage, which hands
// its own source over; the top-k and the candidate pool into the last) and 4 + 5 (one owner
// handing its source to two stages, the candidate pool passed on through the middle one).
static void every_cut(void) {
#if defined(__SANITIZE_ADDRESS__)
    static const int32_t splits[][4] = {{0, 2, 4, 6}, {0, 4, 5, 6}};
    static const int32_t n_of[] = {3, 3};
    enum { CUT_RECIPES = 1 };
#else
    enum { CUT_RECIPES = 2 };
    static const int32_t splits[][4] = {{0, 1, 6},    {0, 2, 6},    {0, 3, 6},    {0, 4, 6},
                                        {0, 5, 6},    {0, 1, 2, 6}, {0, 1, 3, 6}, {0, 1, 4, 6},
                                        {0, 1, 5, 6}, {0, 2, 3, 6}, {0, 2, 4, 6}, {0, 2, 5, 6},
                                        {0, 3, 4, 6}, {0, 3, 5, 6}, {0, 4, 5, 6}};
    static const int32_t n_of[] = {2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3};
#endif
    for (size_t i = 0; i < sizeof n_of / sizeof *n_of; i++) {
        g_stages = n_of[i];
        g_split = splits[i];
        const int before = g_checks_failed;
        if (CUT_RECIPES == 2 || i % 2 == 0) cut_case(DI_PRECISION_FP32);
        if (CUT_RECIPES == 2 || i % 2 == 1) cut_case(DI_PRECISION_OFFICIAL);
        if (g_stages == 2)
            fprintf(stderr, "(l) cut %d: %s\n", splits[i][1],
                    g_checks_failed == before ? "exact" : "FAILED");
        else
            fprintf(stderr, "(l) cuts %d, %d: %s\n", splits[i][1], splits[i][2],
                    g_checks_failed == before ? "exact" : "FAILED");
    }
    g_split = NULL;
    g_stages = 1;
}

static void mem_split_logits(void) {
    cut_case(DI_PRECISION_FP32);
}

// (j): the CPU backend with weight_upload watched: every host tensor it is given is recorded.
static const di_backend_vt *g_cpu_vt;
static const void *g_up_data[4096];
static size_t g_up_bytes[4096];
static int g_n_up;

static di_status watched_upload(di_backend *b, const di_tensor *host, di_tensor *dev) {
    CHECK(g_n_up < 4096);
    if (g_n_up < 4096) {
        g_up_data[g_n_up] = host->data;
        g_up_bytes[g_n_up++] = (size_t)host->ne[1] * host->nb1;
    }
    return g_cpu_vt->weight_upload(b, host, dev);
}

static void engram_on_host(void) {
    di_model_options mo = di_model_options_default();
    mo.n_threads = 1;
    di_model *m = NULL;
    di_backend *b = NULL;
    CHECK_EQ(di_model_load(g_dir, &mo, &m), DI_OK);
    CHECK_EQ(di_cpu_backend_create(1, &b), DI_OK);
    di_backend_vt vt = *b->vt;
    vt.weight_upload = watched_upload;
    g_cpu_vt = b->vt;
    g_n_up = 0;
    di_backend watched = *b; // the same implementation, its weight uploads recorded
    watched.vt = &vt;
    di_dsv41_dev *d = NULL;
    CHECK_EQ(di_dsv41_dev_create(m, &watched, &d), DI_OK);
    CHECK(g_n_up > 0);
    int n_tables = 0;
    for (int il = 0; il < m->hp.n_layer; il++) {
        const di_tensor *t = &m->layers[il].eg_table;
        if (m->layers[il].engram < 0) continue;
        n_tables++;
        const uint8_t *lo = t->data, *hi = lo + (size_t)t->ne[1] * t->nb1;
        for (int i = 0; i < g_n_up; i++) {
            const uint8_t *p = g_up_data[i];
            CHECK(p + g_up_bytes[i] <= lo || p >= hi); // no upload overlaps the table
        }
    }
    CHECK_EQ(n_tables, 2);
    // A call still runs on it (its Engram rows from the staging).
    di_dsv41_dev_state *st = NULL;
    CHECK_EQ(di_dsv41_dev_state_create(d, 1, N_CTX, MAX_ROWS, 0, 0, &st), DI_OK);
    int32_t tok[8] = {5, 17, 99, 3, 200, 41, 7, 12}, last = 7;
    float *logits = malloc(sizeof(float) * (size_t)m->hp.n_vocab);
    di_dsv41_dev_seq sq = {.slot = 0, .pos = 0, .n_tok = 8};
    CHECK_EQ(di_dsv41_dev_forward(st, &sq, 1, tok, &last, 1, logits), DI_OK);
    free(logits);
    di_dsv41_dev_state_destroy(st);
    di_dsv41_dev_destroy(d);
    di_backend_destroy(b);
    di_model_destroy(m);
}

static void fp32_one(void) {
    one_sequence(DI_PRECISION_FP32);
}
static void fp32_batches(void) {
    batches(DI_PRECISION_FP32);
}
static void official_one(void) {
    one_sequence(DI_PRECISION_OFFICIAL);
}
static void official_batches(void) {
    batches(DI_PRECISION_OFFICIAL);
}
static void fp32_prefix(void) {
    prefix_reuse(DI_PRECISION_FP32);
}
static void official_prefix(void) {
    prefix_reuse(DI_PRECISION_OFFICIAL);
}
static void fp32_wiring(void) {
    wiring(DI_PRECISION_FP32);
}
static void official_wiring(void) {
    wiring(DI_PRECISION_OFFICIAL);
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
    snprintf(g_dir, sizeof g_dir, "/tmp/di_test_dev41_XXXXXX");
    if (!mkdtemp(g_dir)) return 1;
    CHECK(di_synth_v41_write(g_dir, true, false, 41) == DI_OK);
    snprintf(g_ds, sizeof g_ds, "/tmp/di_test_dev41_ds_XXXXXX");
    if (!mkdtemp(g_ds)) return 1;
    CHECK(di_synth_v41_write(g_ds, true, true, 41) == DI_OK);
    if (argc > 1 && strcmp(argv[1], "--cuts") == 0) { // (l): every cut
        RUN(every_cut);
        di_test_remove_dir(g_dir);
        di_test_remove_dir(g_ds);
        return test_finish();
    }
    if (argc > 1 && strcmp(argv[1], "--deferred") == 0) {
        // --deferred: scenarios on CPU backends in deferred mode (backend.h
        // di_cpu_backend_set_deferred: work runs at the CUDA stream's sync points only), on one
        // stage, then on 3: host code that reads backend memory before a download, or rewrites or
        // frees memory queued work still reads, gives other bits. Under AddressSanitizer (a host
        // buffer freed under queued work) the batches and a tail on 3 stages only.
        setenv("DI_CPU_DEFERRED", "1", 1);
        for (g_stages = SAN ? 3 : 1; g_stages <= MAX_STAGES; g_stages += 2) {
            fprintf(stderr, "---- deferred, %d pipeline stages ----\n", g_stages);
            if (!SAN) RUN(fp32_one);
            RUN(official_batches);
            if (!SAN) RUN(official_prefix);
            RUN(fp32_tail);
            if (!SAN) RUN(official_rollback);
            if (!SAN) RUN(official_dspark);
            if (!SAN) RUN(official_prepare);
        }
        di_test_remove_dir(g_dir);
        di_test_remove_dir(g_ds);
        return test_finish();
    }
    if (argc > 1 && strcmp(argv[1], "--stages") == 0) { // (m): the scenarios on 2, then 3 stages
        snprintf(g_fix, sizeof g_fix, "/tmp/di_test_dev41_fix_XXXXXX");
        CHECK(mkdtemp(g_fix) != NULL);
        CHECK(assemble_fixture());
        for (g_stages = FIRST_STAGES; g_stages <= MAX_STAGES; g_stages++) {
            fprintf(stderr, "---- %d pipeline stages ----\n", g_stages);
            RUN(fp32_one);
            RUN(fp32_batches);
            RUN(official_one);
            RUN(official_batches);
            RUN(fp32_prefix);
            RUN(official_prefix);
            RUN(fp32_tail);
            RUN(official_tail);
            RUN(fp32_rollback);
            RUN(official_rollback);
            RUN(fp32_dspark);
            RUN(official_dspark);
            RUN(fp32_prepare);
            RUN(official_prepare);
            RUN(fp32_wiring);
            RUN(official_wiring);
            if (g_stages == 2) RUN(fixture_long);
        }
        // (o) DSpark with the taps crossing cuts (targets 4 and 5): [0, 5) [5, 6) hands layer
        // 4's tap over; [0, 4) [4, 5) [5, 6) passes it through a middle stage.
        static const int32_t ds2[3] = {0, 5, 6}, ds3[4] = {0, 4, 5, 6};
        for (g_stages = FIRST_STAGES; g_stages <= MAX_STAGES; g_stages++) {
            g_split = g_stages == 2 ? ds2 : ds3;
            fprintf(stderr, "---- DSpark on %d pipeline stages ----\n", g_stages);
            RUN(fp32_dspark);
            RUN(official_dspark);
        }
        g_split = NULL;
        di_test_remove_dir(g_fix);
        di_test_remove_dir(g_dir);
        di_test_remove_dir(g_ds);
        return test_finish();
    }
    RUN(stage_rules);
    RUN(mem_split);
    if (q_split[2] > 0) { // (q)'s split, bit for bit as (l)'s cuts
        g_stages = 2, g_split = q_split;
        RUN(mem_split_logits);
        g_stages = 1, g_split = NULL;
    }
    RUN(fp32_one);
    RUN(fp32_batches);
    RUN(official_one);
    RUN(official_batches);
    RUN(fp32_prefix);
    RUN(official_prefix);
    RUN(fp32_tail);
    RUN(official_tail);
    RUN(fp32_rollback);
    RUN(official_rollback);
    RUN(fp32_dspark);
    RUN(official_dspark);
    RUN(fp32_prepare);
    RUN(official_prepare);
    RUN(fp32_wiring);
    RUN(official_wiring);
    RUN(refuses_v4);
    RUN(engram_on_host);
    snprintf(g_fix, sizeof g_fix, "/tmp/di_test_dev41_fix_XXXXXX");
    CHECK(mkdtemp(g_fix) != NULL);
    CHECK(assemble_fixture());
    RUN(fixture_long);
    di_test_remove_dir(g_fix);
    di_test_remove_dir(g_dir);
    di_test_remove_dir(g_ds);
    return test_finish();
}
