// engine + KV transfer (prefill/decode disaggregation, docs/disaggregation.md), on the tiny
// synthesised model: (a) engine A runs a prompt (one token), exports its cached chain; engine B
// imports it and runs the prompt: a prefix hit of every full block, and tokens, logprobs and top
// logprobs identical to an engine without any cache (greedy and seeded); a second import finds
// the blocks present; the transfer carries the tail snapshot A took at the prompt's last block
// boundary (192), so B's hit computes nothing before it (n_replayed 0); (b) a corrupted transfer
// (a record's payload, the snapshot's bytes), one whose record hash is not its tokens' chain hash
// (valid checksums), and one made by another checkpoint are refused and insert nothing (no block,
// no snapshot); (c) an engine without the prefix cache refuses both calls; (d) the same exchange
// on the V4.1 tiny model (its blocks are its pages: the entries and index keys of every kv
// source): the decode side's hit replays nothing and gives the tokens of an engine without cache;
// a decode side without tail snapshots takes the blocks, ignores the snapshot and replays the
// bounded suffix, exactly as well.
#include "harness.h"

#include <stdlib.h>
#include <sys/stat.h>

#include "kv/kv_transfer.h"
#include "model/synth.h"

enum { V = 512, N_TOP = 3, MAX_GEN = 8, N_P = 200, N_CTX = 512 };

static char g_dir[256], g_other[300], g_v41[300];
static int32_t g_p[N_P];
#include "engine_prompt.h" // result, on_event, same, engine_options, run

static di_engine *engine(const char *dir, bool prefix) {
    di_engine_options o = engine_options(64u << 20);
    o.no_prefix_cache = !prefix;
    di_engine *e = NULL;
    CHECK_EQ(di_engine_create(dir, &o, &e), DI_OK);
    return e;
}

static int64_t cached_blocks(di_engine *e) {
    di_engine_stats st;
    di_engine_get_stats(e, &st);
    return st.n_blocks_cached;
}

static di_engine_stats stats(di_engine *e) {
    di_engine_stats st;
    di_engine_get_stats(e, &st);
    return st;
}

static void test_export_import(void) {
    result ref[2], r;
    di_engine *c = engine(g_dir, false); // the reference: no cache at all
    if (!c) return;
    run(c, g_p, N_P, false, MAX_GEN, &ref[0]);
    run(c, g_p, N_P, true, MAX_GEN, &ref[1]);
    di_engine_destroy(c);

    di_engine *a = engine(g_dir, true); // the prefill side
    if (!a) return;
    run(a, g_p, N_P, false, 1, &r);
    void *x = NULL;
    size_t n = 0;
    int32_t nb = -1;
    char err[512] = "";
    CHECK_EQ(di_engine_kv_export(a, g_p, N_P, 0, &x, &n, &nb, err, sizeof err), DI_OK);
    CHECK_EQ(nb, 12); // 200 computed positions: 12 full blocks of 16
    // A prefix of the prompt exports its own whole blocks; an uncached salt exports none.
    void *y = NULL;
    size_t ny = 0;
    int32_t nby = -1;
    CHECK_EQ(di_engine_kv_export(a, g_p, 40, 0, &y, &ny, &nby, err, sizeof err), DI_OK);
    CHECK_EQ(nby, 2);
    di_free_buffer(y);
    CHECK_EQ(di_engine_kv_export(a, g_p, N_P, 7, &y, &ny, &nby, err, sizeof err), DI_OK);
    CHECK_EQ(nby, 0);
    CHECK_EQ(ny, (size_t)DI_KV_TRANSFER_HEADER_BYTES);
    di_free_buffer(y);
    CHECK_EQ(di_engine_kv_export(a, g_p, N_CTX + 1, 0, &y, &ny, &nby, err, sizeof err),
             DI_ERR_INVALID);
    di_engine_destroy(a);

    di_engine *b = engine(g_dir, true); // the decode side
    if (!b) return;
    int32_t ins = -1, pres = -1;
    const size_t snap = (size_t)stats(b).tail_snap_bytes;
    CHECK(snap > 0);
    CHECK(n > DI_KV_TRANSFER_HEADER_BYTES + snap); // the records, then the snapshot
    CHECK_EQ(di_engine_kv_import(b, x, n, &ins, &pres, err, sizeof err), DI_OK);
    CHECK_EQ(ins, 12);
    CHECK_EQ(pres, 0);
    CHECK_EQ(cached_blocks(b), 12);
    CHECK_EQ(stats(b).n_tail_stored, 1);
    CHECK_EQ(di_engine_kv_import(b, x, n, &ins, &pres, err, sizeof err), DI_OK);
    CHECK_EQ(ins, 0);
    CHECK_EQ(pres, 12);
    CHECK_EQ(stats(b).n_tail_stored, 1);
    for (int k = 0; k < 2; k++) {
        run(b, g_p, N_P, k == 1, MAX_GEN, &r);
        CHECK(same(&r, &ref[k]));
        CHECK_EQ(r.n_cached, 192);
        CHECK_EQ(r.n_replayed, 0); // the transferred snapshot at 192
    }
    di_engine_stats st;
    di_engine_get_stats(b, &st);
    CHECK_EQ(st.n_cache_hit_tokens, 384);
    CHECK_EQ(st.n_replayed_tokens, 0);
    CHECK_EQ(st.n_tail_restored, 2);
    CHECK_EQ(st.n_step_allocs, 0);
    fprintf(stderr,
            "transfer: %d blocks + a %zu-byte tail snapshot, %zu bytes (%.0f bytes per prompt "
            "token)\n",
            (int)nb, snap, n, (double)n / (12 * 16));
    di_engine_destroy(b);

    // (b) Refusals insert nothing.
    b = engine(g_dir, true);
    if (!b) return;
    unsigned char *z = malloc(n);
    memcpy(z, x, n);
    z[n - 7] ^= 0x40; // the tail snapshot
    CHECK_EQ(di_engine_kv_import(b, z, n, &ins, &pres, err, sizeof err), DI_ERR_FORMAT);
    CHECK(strstr(err, "tail snapshot") && strstr(err, "checksum"));
    z[n - 7] ^= 0x40;
    z[n - snap - 7] ^= 0x40; // the last record's payload
    CHECK_EQ(di_engine_kv_import(b, z, n, &ins, &pres, err, sizeof err), DI_ERR_FORMAT);
    CHECK(strstr(err, "record 11") && strstr(err, "checksum"));
    CHECK_EQ(di_engine_kv_import(b, z, n - 1, &ins, &pres, err, sizeof err), DI_ERR_FORMAT);
    CHECK_EQ(cached_blocks(b), 0);
    CHECK_EQ(stats(b).n_tail_stored, 0);
    // Record 5's tokens changed and its record rebuilt with valid checksums under the same hash:
    // only the chain-hash check can tell.
    memcpy(z, x, n);
    unsigned char *r5 = z + DI_KV_TRANSFER_HEADER_BYTES;
    di_kv_disk_layout l;
    memcpy(&l.model_id, r5 + 16, 8); // the record header's fields (kv_disk.c)
    memcpy(&l.precision, r5 + 24, 4);
    memcpy(&l.block_tokens, r5 + 28, 4);
    memcpy(&l.block_floats, r5 + 32, 8);
    memcpy(&l.payload_floats, r5 + 40, 8);
    r5 = z + di_kv_transfer_record_offset(&l, 5);
    di_kv_disk_record rec;
    const char *why = NULL;
    CHECK_EQ(di_kv_disk_record_check(&l, r5, di_kv_disk_record_size(&l), &rec, &why),
             DI_KV_DISK_CHECK_OK);
    int32_t tok[64];
    CHECK(l.block_tokens <= 64);
    memcpy(tok, rec.tokens, sizeof(int32_t) * (size_t)l.block_tokens);
    tok[3] ^= 1;
    float *pay = malloc(sizeof(float) * (size_t)l.payload_floats);
    memcpy(pay, rec.payload, sizeof(float) * (size_t)l.payload_floats);
    di_kv_disk_record_put(&l, rec.hash, rec.parent, rec.salt, tok, pay, r5);
    free(pay);
    CHECK_EQ(di_engine_kv_import(b, z, n, &ins, &pres, err, sizeof err), DI_ERR_FORMAT);
    CHECK(strstr(err, "chain hash") != NULL);
    CHECK_EQ(cached_blocks(b), 0);
    free(z);
    run(b, g_p, N_P, false, MAX_GEN, &r);
    CHECK_EQ(r.n_cached, 0);
    CHECK(same(&r, &ref[0]));
    di_engine_destroy(b);

    // Another checkpoint of the same architecture refuses the transfer, naming the model.
    b = engine(g_other, true);
    if (!b) return;
    CHECK_EQ(di_engine_kv_import(b, x, n, &ins, &pres, err, sizeof err), DI_ERR_INVALID);
    CHECK(strstr(err, "another model") != NULL);
    CHECK_EQ(cached_blocks(b), 0);
    di_engine_destroy(b);

    // (c) No prefix cache: both refused.
    b = engine(g_dir, false);
    if (!b) return;
    CHECK_EQ(di_engine_kv_import(b, x, n, &ins, &pres, err, sizeof err), DI_ERR_UNSUPPORTED);
    CHECK(strstr(err, "prefix cache") != NULL);
    CHECK_EQ(di_engine_kv_export(b, g_p, N_P, 0, &y, &ny, &nby, err, sizeof err),
             DI_ERR_UNSUPPORTED);
    di_engine_destroy(b);
    di_free_buffer(x);
}

static void test_v41(void) {
    result ref, r;
    di_engine *c = engine(g_v41, false);
    if (!c) return;
    run(c, g_p, N_P, true, MAX_GEN, &ref);
    di_engine_destroy(c);
    di_engine *a = engine(g_v41, true);
    if (!a) return;
    run(a, g_p, N_P, true, 1, &r);
    void *x = NULL;
    size_t n = 0;
    int32_t nb = -1, ins = -1, pres = -1;
    char err[512] = "";
    CHECK_EQ(di_engine_kv_export(a, g_p, N_P, 0, &x, &n, &nb, err, sizeof err), DI_OK);
    CHECK_EQ(nb, 12); // 200 computed positions: 12 full blocks of 16
    di_engine_destroy(a);
    di_engine *b = engine(g_v41, true);
    if (!b) return;
    CHECK_EQ(di_engine_kv_import(b, x, n, &ins, &pres, err, sizeof err), DI_OK);
    CHECK_EQ(ins, 12);
    CHECK_EQ(cached_blocks(b), 12);
    run(b, g_p, N_P, true, MAX_GEN, &r);
    CHECK(same(&r, &ref));
    CHECK_EQ(r.n_cached, 192);
    CHECK_EQ(r.n_replayed, 0); // the transferred snapshot at 192
    di_engine_stats st;
    di_engine_get_stats(b, &st);
    CHECK_EQ(st.n_tail_restored, 1);
    CHECK_EQ(st.n_step_allocs, 0);
    fprintf(stderr, "V4.1 transfer: %d blocks + a %lld-byte tail snapshot, %zu bytes\n", (int)nb,
            (long long)st.tail_snap_bytes, n);
    di_engine_destroy(b);
    // A decode side without tail snapshots: the blocks, the bounded replay, the same tokens.
    di_engine_options o = engine_options(64u << 20);
    o.no_tail_cache = true;
    b = NULL;
    CHECK_EQ(di_engine_create(g_v41, &o, &b), DI_OK);
    if (b) {
        CHECK_EQ(di_engine_kv_import(b, x, n, &ins, &pres, err, sizeof err), DI_OK);
        CHECK_EQ(ins, 12);
        run(b, g_p, N_P, true, MAX_GEN, &r);
        CHECK(same(&r, &ref));
        CHECK_EQ(r.n_cached, 192);
        CHECK_EQ(r.n_replayed, 90);
        di_engine_destroy(b);
    }
    // A V4 engine refuses the V4.1 transfer, naming the model.
    b = engine(g_dir, true);
    if (b) {
        CHECK_EQ(di_engine_kv_import(b, x, n, &ins, &pres, err, sizeof err), DI_ERR_INVALID);
        CHECK(strstr(err, "another model") != NULL);
        di_engine_destroy(b);
    }
    di_free_buffer(x);
}

int main(void) {
    snprintf(g_dir, sizeof g_dir, "/tmp/di_test_engine_transfer_XXXXXX");
    if (!mkdtemp(g_dir)) return 1;
    snprintf(g_other, sizeof g_other, "%s/other", g_dir);
    di_synth_config c;
    CHECK(di_synth_preset("tiny", &c) == DI_OK);
    c.n_vocab = V;
    CHECK(di_synth_write(&c, g_dir) == DI_OK);
    CHECK_EQ(mkdir(g_other, 0700), 0);
    c.seed ^= 0x5eed;
    CHECK(di_synth_write(&c, g_other) == DI_OK);
    snprintf(g_v41, sizeof g_v41, "%s/v41", g_dir);
    CHECK_EQ(mkdir(g_v41, 0700), 0);
    CHECK_EQ(di_synth_v41_write(g_v41, true, false, 41), DI_OK);
    for (int t = 0; t < N_P; t++) g_p[t] = (int32_t)((t * 37 + 11) % V);
    di_set_log_level(1);
    RUN(test_export_import);
    RUN(test_v41);
    di_test_remove_dir(g_dir);
    return test_finish();
}
