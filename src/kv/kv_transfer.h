/*
 * kv_transfer — the KV transfer of prefill/decode disaggregation (docs/disaggregation.md): a
 * 64-byte header (magic, version, model identity, precision, block_tokens, record count and size,
 * header CRC-32, and the tail snapshot's size, block and CRC-32) followed by that many block
 * records of the disk tier's format (kv/kv_disk.h), the blocks of one prompt's hash chain in
 * order, then optionally the tail snapshot (kv/tail_cache.h) kept with one of those blocks (the
 * deepest that has one): the receiver attaches it to that block, so that a hit there computes
 * nothing before it (docs/kv-cache.md, "Tail snapshots").
 *
 * di_kv_transfer_check verifies a whole transfer before anything is used: the header against the
 * receiver's layout, every record (kv_disk's checks: identity, layout, checksums) and the chain
 * links (record 0 has parent 0; record i's parent is record i-1's hash; one salt), and the
 * snapshot (its block one of the records, its size the receiver's, its CRC-32). That each
 * hash is the chain hash of its tokens is checked by the importer, which owns the hash function
 * (kv_manager.c).
 *
 * Owns: nothing. Thread-safety: pure functions.
 */
#pragma once

#include <stddef.h>
#include <stdint.h>

#include "kv/kv_disk.h" // di_kv_disk_layout, di_kv_disk_record

// Version 5: the records' block_floats is their payload's (version 4: the sender's pool block, so
// a CPU and a device-resident replica's records differed there) and the precision may carry
// DI_KV_TRANSFER_PRECISION_DEVICE. Version 4: records of kv_disk's version 3 (a snapshot section,
// always empty here: the transfer carries its snapshot after the records). Version 3: the optional
// tail snapshot (version 2: records of kv_disk's version 2, V4.1 pages packed). Other versions are
// refused.
#define DI_KV_TRANSFER_VERSION 5
#define DI_KV_TRANSFER_HEADER_BYTES 64
// Set in the precision of a transfer (header and records) made by the device-resident forward:
// its records hold the device's entry rows (model/dsv4_dev.h, di_dsv4_dev_state_read_block) and
// its snapshot the device tail. A CPU-forward replica of the same checkpoint and precision sees
// another model's transfer first; the importer (kv_manager.c) then reads it under the other
// forward's layout: the records are taken when their layout is its own (FP32 recipe), the
// snapshot (another format) never; else it is refused as another model's (docs/disaggregation.md).
#define DI_KV_TRANSFER_PRECISION_DEVICE 0x100u

// Bytes of a transfer of n_blocks records of layout l and a snapshot of snap_bytes (0: none).
size_t di_kv_transfer_bytes(const di_kv_disk_layout *l, int32_t n_blocks, size_t snap_bytes);
// Writes the header of a transfer of n_blocks records into out and, when snap_bytes > 0, the tail
// snapshot snap of record snap_block (0 <= snap_block < n_blocks) after the records; record i
// goes at out + di_kv_transfer_record_offset(l, i) (di_kv_disk_record_put).
void di_kv_transfer_put_header(const di_kv_disk_layout *l, int32_t n_blocks, const void *snap,
                               size_t snap_bytes, int32_t snap_block, void *out);
size_t di_kv_transfer_record_offset(const di_kv_disk_layout *l, int32_t i);

typedef struct di_kv_transfer {
    int32_t n_blocks;
    uint64_t salt;              // every record's
    const unsigned char *first; // record 0 (records are di_kv_disk_record_size apart)
    size_t record_bytes;
    const unsigned char *snap; // the tail snapshot of record snap_block (verified), or NULL
    size_t snap_bytes;
    int32_t snap_block; // -1: none
} di_kv_transfer;

// Verifies the n bytes at buf as a transfer for layout l with at most max_blocks records and
// tail snapshots of snap_bytes (the receiver's; 0: it keeps none, and a snapshot is verified but
// not handed out). DI_KV_DISK_CHECK_OK and *out; or DI_KV_DISK_CHECK_OTHER_MODEL (the header or a
// record names another model identity or precision) or DI_KV_DISK_CHECK_CORRUPT (anything else:
// truncated, trailing bytes, bad magic / version / counts / checksums, broken chain links, too
// many records, a snapshot of another size or on no record), with a message in why[cap].
di_kv_disk_check di_kv_transfer_check(const di_kv_disk_layout *l, size_t snap_bytes,
                                      const void *buf, size_t n, int32_t max_blocks,
                                      di_kv_transfer *out, char *why, size_t cap);
// Record i of a checked transfer (already verified: cannot fail).
void di_kv_transfer_record(const di_kv_disk_layout *l, const di_kv_transfer *t, int32_t i,
                           di_kv_disk_record *out);
