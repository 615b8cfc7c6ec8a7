// kv_transfer — a header and a chain of block records (see kv_transfer.h).
#include "kv/kv_transfer.h"

#include <stdio.h>
#include <string.h>
#include <zlib.h> // crc32_z

#include "base/log.h" // DI_ASSERT

static const char k_magic[8] = {'D', 'I', 'K', 'V', 'X', 'F', 'R', '\0'};

// Native byte order, like the records (the magic and checksums reject another order).
typedef struct xfr_header {
    char magic[8];
    uint32_t version;
    uint32_t header_bytes;
    uint64_t model_id;
    uint32_t precision;
    int32_t block_tokens;
    int32_t n_blocks;
    uint32_t crc_header; // CRC-32 of this header with crc_header = 0
    uint64_t record_bytes;
    uint64_t snap_bytes; // the tail snapshot after the records (0: none; version 3)
    int32_t snap_block;  // the record it belongs to (-1: none)
    uint32_t snap_crc;   // CRC-32 of its bytes
} xfr_header;
_Static_assert(sizeof(xfr_header) == DI_KV_TRANSFER_HEADER_BYTES, "transfer header is 64 bytes");

static uint32_t header_crc(xfr_header *h) {
    uint32_t saved = h->crc_header;
    h->crc_header = 0;
    uint32_t c = (uint32_t)crc32_z(crc32_z(0L, Z_NULL, 0), (const Bytef *)h, sizeof *h);
    h->crc_header = saved;
    return c;
}

size_t di_kv_transfer_bytes(const di_kv_disk_layout *l, int32_t n_blocks, size_t snap_bytes) {
    return DI_KV_TRANSFER_HEADER_BYTES + (size_t)n_blocks * di_kv_disk_record_size(l) + snap_bytes;
}

static uint32_t crc(const void *p, size_t n) {
    return (uint32_t)crc32_z(crc32_z(0L, Z_NULL, 0), (const Bytef *)p, n);
}

size_t di_kv_transfer_record_offset(const di_kv_disk_layout *l, int32_t i) {
    return DI_KV_TRANSFER_HEADER_BYTES + (size_t)i * di_kv_disk_record_size(l);
}

void di_kv_transfer_put_header(const di_kv_disk_layout *l, int32_t n_blocks, const void *snap,
                               size_t snap_bytes, int32_t snap_block, void *out) {
    DI_ASSERT(snap_bytes == 0 || (snap && snap_block >= 0 && snap_block < n_blocks));
    xfr_header h;
    memset(&h, 0, sizeof h);
    memcpy(h.magic, k_magic, sizeof k_magic);
    h.version = DI_KV_TRANSFER_VERSION;
    h.header_bytes = DI_KV_TRANSFER_HEADER_BYTES;
    h.model_id = l->model_id;
    h.precision = l->precision;
    h.block_tokens = l->block_tokens;
    h.n_blocks = n_blocks;
    h.record_bytes = di_kv_disk_record_size(l);
    h.snap_bytes = snap_bytes;
    h.snap_block = snap_bytes ? snap_block : -1;
    if (snap_bytes) {
        memcpy((unsigned char *)out + di_kv_transfer_record_offset(l, n_blocks), snap, snap_bytes);
        h.snap_crc = crc(snap, snap_bytes);
    }
    h.crc_header = header_crc(&h);
    memcpy(out, &h, sizeof h);
}

void di_kv_transfer_record(const di_kv_disk_layout *l, const di_kv_transfer *t, int32_t i,
                           di_kv_disk_record *out) {
    const char *why = NULL;
    di_kv_disk_check err = di_kv_disk_record_check(l, t->first + (size_t)i * t->record_bytes,
                                                   t->record_bytes, out, &why);
    DI_ASSERT(err == DI_KV_DISK_CHECK_OK); // verified by di_kv_transfer_check
}

di_kv_disk_check di_kv_transfer_check(const di_kv_disk_layout *l, size_t snap_bytes,
                                      const void *buf, size_t n, int32_t max_blocks,
                                      di_kv_transfer *out, char *why, size_t cap) {
    const unsigned char *b = buf;
    xfr_header h;
    if (n < sizeof h) {
        snprintf(why, cap, "truncated transfer: %zu bytes, shorter than its %d-byte header", n,
                 DI_KV_TRANSFER_HEADER_BYTES);
        return DI_KV_DISK_CHECK_CORRUPT;
    }
    memcpy(&h, b, sizeof h);
    if (!memcmp(h.magic, k_magic, sizeof k_magic) && h.version != DI_KV_TRANSFER_VERSION) {
        snprintf(why, cap,
                 "a KV transfer of version %u; this engine reads version %d only (the prefill "
                 "and decode replicas must run the same deepinfer build)",
                 (unsigned)h.version, DI_KV_TRANSFER_VERSION);
        return DI_KV_DISK_CHECK_CORRUPT;
    }
    if (memcmp(h.magic, k_magic, sizeof k_magic) || h.header_bytes != DI_KV_TRANSFER_HEADER_BYTES ||
        header_crc(&h) != h.crc_header) {
        snprintf(why, cap, "not a KV transfer of version %d (magic, version or header checksum)",
                 DI_KV_TRANSFER_VERSION);
        return DI_KV_DISK_CHECK_CORRUPT;
    }
    if (h.model_id != l->model_id || h.precision != l->precision) {
        snprintf(why, cap,
                 "the transfer was made by another model (identity %016llx, precision %u; this "
                 "engine: %016llx, precision %u): the replicas must serve the same checkpoint "
                 "with the same precision",
                 (unsigned long long)h.model_id, (unsigned)h.precision,
                 (unsigned long long)l->model_id, (unsigned)l->precision);
        return DI_KV_DISK_CHECK_OTHER_MODEL;
    }
    const size_t rb = di_kv_disk_record_size(l);
    if (h.block_tokens != l->block_tokens || h.record_bytes != rb) {
        snprintf(why, cap,
                 "the transfer's block layout (%d tokens, %llu-byte records) is not "
                 "this engine's (%d, %zu)",
                 (int)h.block_tokens, (unsigned long long)h.record_bytes, (int)l->block_tokens, rb);
        return DI_KV_DISK_CHECK_CORRUPT;
    }
    if (h.n_blocks < 0 || h.n_blocks > max_blocks) {
        snprintf(why, cap, "the transfer holds %d blocks; this engine takes 0 to %d",
                 (int)h.n_blocks, (int)max_blocks);
        return DI_KV_DISK_CHECK_CORRUPT;
    }
    if (h.snap_bytes == 0
            ? h.snap_block != -1
            : h.snap_block < 0 || h.snap_block >= h.n_blocks ||
                  (snap_bytes && h.snap_bytes != snap_bytes) || h.snap_bytes > (uint64_t)n) {
        snprintf(why, cap,
                 "the transfer's tail snapshot (%llu bytes, block %d of %d) does not fit this "
                 "engine (snapshots of %zu bytes: another forward or speculation setting?)",
                 (unsigned long long)h.snap_bytes, (int)h.snap_block, (int)h.n_blocks, snap_bytes);
        return DI_KV_DISK_CHECK_CORRUPT;
    }
    if (n != di_kv_transfer_bytes(l, h.n_blocks, (size_t)h.snap_bytes)) {
        snprintf(why, cap,
                 "the transfer is %zu bytes; %d records and a %llu-byte snapshot make %zu "
                 "(truncated, or trailing bytes)",
                 n, (int)h.n_blocks, (unsigned long long)h.snap_bytes,
                 di_kv_transfer_bytes(l, h.n_blocks, (size_t)h.snap_bytes));
        return DI_KV_DISK_CHECK_CORRUPT;
    }
    const unsigned char *snap = b + di_kv_transfer_record_offset(l, h.n_blocks);
    if (h.snap_bytes && crc(snap, (size_t)h.snap_bytes) != h.snap_crc) {
        snprintf(why, cap, "the transfer's tail snapshot fails its checksum");
        return DI_KV_DISK_CHECK_CORRUPT;
    }
    uint64_t parent = 0, salt = 0;
    for (int32_t i = 0; i < h.n_blocks; i++) {
        di_kv_disk_record r;
        const char *w = NULL;
        di_kv_disk_check err =
            di_kv_disk_record_check(l, b + di_kv_transfer_record_offset(l, i), rb, &r, &w);
        if (err != DI_KV_DISK_CHECK_OK) {
            snprintf(why, cap, "block record %d of %d: %s", (int)i, (int)h.n_blocks, w);
            return err;
        }
        if (i == 0) salt = r.salt;
        if (r.parent != parent || r.salt != salt) {
            snprintf(why, cap,
                     "block record %d of %d does not continue the chain (its parent "
                     "or salt is not the previous record's)",
                     (int)i, (int)h.n_blocks);
            return DI_KV_DISK_CHECK_CORRUPT;
        }
        parent = r.hash;
    }
    out->n_blocks = h.n_blocks;
    out->salt = salt;
    out->first = b + DI_KV_TRANSFER_HEADER_BYTES;
    out->record_bytes = rb;
    const bool take = h.snap_bytes && snap_bytes;
    out->snap = take ? snap : NULL;
    out->snap_bytes = take ? (size_t)h.snap_bytes : 0;
    out->snap_block = take ? h.snap_block : -1;
    return DI_KV_DISK_CHECK_OK;
}
