// Tests for src/backend/cuda/wgmma_layout.h, the host-checkable half of the wgmma helpers: the
// descriptor's bit packing (fields and round trip), the 128-byte swizzle, the SW128 k-blocked tile
// against the PTX ISA's canonical K-major and MN-major layouts as read from the descriptors the
// attention kernel builds (every element of every k16 step), the accumulator fragment map against
// the PTX figure, and a host emulation of the kernel's two products (S = Q K^T per warpgroup,
// O = P V with V read MN-major) through those descriptors and that map against a plain GEMM. The
// same functions run on the GPU (wgmma_probe.cu, attn.cu), where test_cuda_wgmma checks the
// instructions themselves.
#include "harness.h"

#include <stdint.h>

#include "backend/cuda/wgmma_layout.h"

static void test_desc_bits(void) {
    // Start 0x1C400, LBO 8192, SBO 1024, 128-byte swizzle, field by field.
    const uint64_t d = di_wg_desc(0x1C400u, 8192u, 1024u, DI_WG_SWIZZLE_128B);
    CHECK_EQ(d & 0x3FFFu, 0x1C400u >> 4);
    CHECK_EQ((d >> 16) & 0x3FFFu, 8192u >> 4);
    CHECK_EQ((d >> 32) & 0x3FFFu, 1024u >> 4);
    CHECK_EQ((d >> 49) & 7u, 0);     // base offset
    CHECK_EQ((d >> 62) & 3u, 1);     // 128B swizzle
    CHECK_EQ(d & 0xC000C000ull, 0);  // reserved bits 14-15, 30-31
    CHECK_EQ((d >> 46) & 7u, 0);     // reserved 46-48
    CHECK_EQ((d >> 52) & 0x3FFu, 0); // reserved 52-61
    CHECK_EQ(di_wg_desc_addr(d), 0x1C400u);
    CHECK_EQ(di_wg_desc_lbo(d), 8192u);
    CHECK_EQ(di_wg_desc_sbo(d), 1024u);
    CHECK_EQ(di_wg_desc_swizzle(d), DI_WG_SWIZZLE_128B);
    // The whole value for one case, by hand from the PTX ISA's table.
    CHECK(d == ((uint64_t)1 << 62 | (uint64_t)0x40 << 32 | (uint64_t)0x200 << 16 | 0x1C40u));
    // Only the low 18 address bits are encoded (a generic address's high bits are dropped).
    CHECK_EQ(di_wg_desc_addr(di_wg_desc(0xFFFC0410u, 16u, 1024u, 1)), 0x00410u);
    CHECK_EQ(di_wg_desc_swizzle(di_wg_desc(0, 0, 0, DI_WG_SWIZZLE_32B)), DI_WG_SWIZZLE_32B);
}

static void test_swizzle(void) {
    // A bijection on each 1024-byte atom: chunk c of row r goes to chunk c ^ r, bytes inside a
    // chunk stay in order, row 0 and the bits above 10 are untouched.
    static unsigned char seen[2048];
    memset(seen, 0, sizeof seen);
    for (uint32_t a = 0; a < 2048; a++) {
        const uint32_t s = di_wg_sw128(a);
        CHECK(s < 2048 && (s >> 10) == (a >> 10));
        if (s < 2048) seen[s]++;
        CHECK_EQ((s >> 4) & 7u, ((a >> 4) & 7u) ^ ((a >> 7) & 7u));
        CHECK_EQ(s & 15u, a & 15u);
        if (a < 128) CHECK_EQ(s, a);
    }
    int all_once = 1;
    for (int i = 0; i < 2048; i++) all_once &= seen[i] == 1;
    CHECK(all_once);
}

// The kernel's tiles: 64 rows (heads or keys) x 512 dims, and P: 64 heads x 64 keys.
enum { ROWS = 64, DH = 512, NK = 64 };

static void test_tile(void) {
    // Every element of a 64 x 512 tile has its own 2 bytes in [0, 64 KB); 8 consecutive columns
    // from a multiple of 8 are 16 contiguous bytes (the decode's 16-byte stores).
    static unsigned char seen[ROWS * DH * 2];
    memset(seen, 0, sizeof seen);
    int ok = 1, contiguous = 1;
    for (int r = 0; r < ROWS; r++)
        for (int c = 0; c < DH; c++) {
            const uint32_t o = di_wg_tile_off(r, c, ROWS);
            if (o >= sizeof seen || (o & 1)) {
                ok = 0;
                continue;
            }
            seen[o]++;
            if (c % 8 && o != di_wg_tile_off(r, c - c % 8, ROWS) + 2u * (uint32_t)(c % 8))
                contiguous = 0;
        }
    for (size_t i = 0; i < sizeof seen; i += 2) ok &= seen[i] == 1 && seen[i + 1] == 0;
    CHECK(ok);
    CHECK(contiguous);
    // Column blocks of 64 rows x 128 bytes: element (r, 64 b) of row r % 8 == 0 at b * 8 KB +
    // r * 128.
    CHECK_EQ(di_wg_tile_off(8, 64, ROWS), 8192 + 8 * 128);
    CHECK_EQ(di_wg_tile_off(1, 0, ROWS), 128 + 16); // row 1's chunk 0 swizzled to chunk 1
}

// base: a 1024-aligned shared address, not 0 (the swizzle is on absolute addresses).
static const uint32_t Q_BASE = 0x2400u, K_BASE = 0x12400u, P_BASE = 0x22400u;

static void test_descs_match_tile(void) {
    int bad = 0;
    // S = Q K^T, warpgroup g: A = Q rows 0..63, B = key rows 32 g .. 32 g + 31, k over the dims.
    for (int g = 0; g < 2; g++)
        for (int k0 = 0; k0 < DH; k0 += 16) {
            const uint64_t da = di_wg_desc_kmajor(Q_BASE, ROWS, 0, k0);
            const uint64_t db = di_wg_desc_kmajor(K_BASE, ROWS, 32 * g, k0);
            for (int k = 0; k < 16; k++) {
                for (int m = 0; m < 64; m++)
                    bad +=
                        di_wg_ref_kmajor_addr(da, m, k) != Q_BASE + di_wg_tile_off(m, k0 + k, ROWS);
                for (int n = 0; n < 32; n++)
                    bad += di_wg_ref_kmajor_addr(db, n, k) !=
                           K_BASE + di_wg_tile_off(32 * g + n, k0 + k, ROWS);
            }
        }
    // O = P V, warpgroup g: A = P (64 heads x 64 keys), B = keys k0.. x dims 256 g .. (MN-major).
    for (int g = 0; g < 2; g++)
        for (int k0 = 0; k0 < NK; k0 += 16) {
            const uint64_t da = di_wg_desc_kmajor(P_BASE, ROWS, 0, k0);
            const uint64_t db = di_wg_desc_mnmajor(K_BASE, ROWS, k0, 256 * g);
            CHECK_EQ(di_wg_desc_lbo(db), ROWS * 128);
            CHECK_EQ(di_wg_desc_sbo(db), 1024);
            for (int k = 0; k < 16; k++) {
                for (int m = 0; m < 64; m++)
                    bad +=
                        di_wg_ref_kmajor_addr(da, m, k) != P_BASE + di_wg_tile_off(m, k0 + k, ROWS);
                for (int n = 0; n < 256; n++)
                    bad += di_wg_ref_mnmajor_addr(db, n, k) !=
                           K_BASE + di_wg_tile_off(k0 + k, 256 * g + n, ROWS);
            }
        }
    CHECK_EQ(bad, 0);
}

static void test_acc_map(void) {
    // The PTX figure's corners: thread 0 holds (0,0) (0,1) (8,0) (8,1) (0,8) ...; lane 5 row 1
    // columns 2, 3; warp 1 starts at row 16.
    CHECK_EQ(di_wg_acc_row(0, 0), 0);
    CHECK_EQ(di_wg_acc_col(0, 1), 1);
    CHECK_EQ(di_wg_acc_row(0, 2), 8);
    CHECK_EQ(di_wg_acc_col(0, 2), 0);
    CHECK_EQ(di_wg_acc_col(0, 4), 8);
    CHECK_EQ(di_wg_acc_row(5, 0), 1);
    CHECK_EQ(di_wg_acc_col(5, 0), 2);
    CHECK_EQ(di_wg_acc_col(5, 1), 3);
    CHECK_EQ(di_wg_acc_row(32, 0), 16);
    CHECK_EQ(di_wg_acc_row(127, 3), 63);
    CHECK_EQ(di_wg_acc_col(127, 127), 255);
    // A bijection of (thread, register) onto 64 x N for each N the kernels use.
    static const int ns[] = {32, 64, 256};
    static unsigned char seen[64 * 256];
    for (int q = 0; q < 3; q++) {
        const int n = ns[q];
        memset(seen, 0, sizeof seen);
        int ok = 1;
        for (int t = 0; t < 128; t++)
            for (int i = 0; i < n / 2; i++) {
                const int r = di_wg_acc_row(t, i), c = di_wg_acc_col(t, i);
                if (r < 0 || r >= 64 || c < 0 || c >= n) {
                    ok = 0;
                    continue;
                }
                seen[r * n + c]++;
            }
        for (int e = 0; e < 64 * n; e++) ok &= seen[e] == 1;
        CHECK(ok);
    }
}

// ---- host emulation of the kernel's two products ----

static uint16_t g_smem[0x30000 / 2]; // the block's shared memory, as BF16 words

static uint16_t bf16_of_int(int v) { // small integers are exact in BF16: the float's top half
    const float f = (float)v;
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return (uint16_t)(u >> 16);
}
static float f_of_bf16(uint16_t b) {
    const uint32_t u = (uint32_t)b << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}
static float at(uint32_t addr) {
    return f_of_bf16(g_smem[addr / 2]);
}

// d (the warpgroup's registers, [128][n/2]) += A B of one k16 step, read as the hardware reads
// them: A K-major (da), B K-major (db, tnsp 0) or MN-major (tnsp 1).
static void emu_mma(float *d, int n, uint64_t da, uint64_t db, int tnsp) {
    for (int t = 0; t < 128; t++)
        for (int i = 0; i < n / 2; i++) {
            const int r = di_wg_acc_row(t, i), c = di_wg_acc_col(t, i);
            float s = 0.0f;
            for (int k = 0; k < 16; k++)
                s += at(di_wg_ref_kmajor_addr(da, r, k)) *
                     at(tnsp ? di_wg_ref_mnmajor_addr(db, c, k) : di_wg_ref_kmajor_addr(db, c, k));
            d[t * (n / 2) + i] += s;
        }
}

static void test_emulated_products(void) {
    static int q[64][DH], kt[NK][DH], p[64][NK];
    uint32_t seed = 12345u;
    for (int r = 0; r < 64; r++)
        for (int c = 0; c < DH; c++) {
            seed = seed * 1664525u + 1013904223u;
            q[r][c] = (int)(seed >> 28) - 8;
            seed = seed * 1664525u + 1013904223u;
            kt[r][c] = (int)(seed >> 28) - 8;
            g_smem[(Q_BASE + di_wg_tile_off(r, c, ROWS)) / 2] = bf16_of_int(q[r][c]);
            g_smem[(K_BASE + di_wg_tile_off(r, c, ROWS)) / 2] = bf16_of_int(kt[r][c]);
        }
    for (int r = 0; r < 64; r++)
        for (int c = 0; c < NK; c++) {
            seed = seed * 1664525u + 1013904223u;
            p[r][c] = (int)(seed >> 29) - 4;
            g_smem[(P_BASE + di_wg_tile_off(r, c, ROWS)) / 2] = bf16_of_int(p[r][c]);
        }
    // S: warpgroup g's 64 x 32 block of keys 32 g ..; exact (integer sums < 2^24).
    static float s[128 * 16];
    int bad = 0;
    for (int g = 0; g < 2; g++) {
        memset(s, 0, sizeof s);
        for (int k0 = 0; k0 < DH; k0 += 16)
            emu_mma(s, 32, di_wg_desc_kmajor(Q_BASE, ROWS, 0, k0),
                    di_wg_desc_kmajor(K_BASE, ROWS, 32 * g, k0), 0);
        for (int t = 0; t < 128; t++)
            for (int i = 0; i < 16; i++) {
                const int r = di_wg_acc_row(t, i), c = 32 * g + di_wg_acc_col(t, i);
                long ref = 0;
                for (int d = 0; d < DH; d++) ref += (long)q[r][d] * kt[c][d];
                bad += s[t * 16 + i] != (float)ref;
            }
    }
    CHECK_EQ(bad, 0);
    // O: warpgroup g's 64 x 256 block of dims 256 g .. of P V (V = the key tile).
    static float o[128 * 128];
    bad = 0;
    for (int g = 0; g < 2; g++) {
        memset(o, 0, sizeof o);
        for (int k0 = 0; k0 < NK; k0 += 16)
            emu_mma(o, 256, di_wg_desc_kmajor(P_BASE, ROWS, 0, k0),
                    di_wg_desc_mnmajor(K_BASE, ROWS, k0, 256 * g), 1);
        for (int t = 0; t < 128; t++)
            for (int i = 0; i < 128; i++) {
                const int r = di_wg_acc_row(t, i), c = 256 * g + di_wg_acc_col(t, i);
                long ref = 0;
                for (int j = 0; j < NK; j++) ref += (long)p[r][j] * kt[j][c];
                bad += o[t * 128 + i] != (float)ref;
            }
    }
    CHECK_EQ(bad, 0);
}

int main(void) {
    RUN(test_desc_bits);
    RUN(test_swizzle);
    RUN(test_tile);
    RUN(test_descs_match_tile);
    RUN(test_acc_map);
    RUN(test_emulated_products);
    return test_finish();
}
