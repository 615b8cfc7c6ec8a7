/*
 * kv_disk — the persistent tier of the prefix cache: full, final entry blocks kept on disk across
 * evictions and restarts (docs/kv-cache.md, "Disk tier").
 *
 * One file per block, `DIR/<hh>/<hash:016x>.kvb` (hh = the hash's top byte: 256 fan-out
 * directories), named by the block's chain hash. A record is a 128-byte header (magic, format
 * version, model id, precision, block_tokens, block_floats, payload_floats, chain hash, parent
 * hash, salt, a CRC-32 of the tokens + payload and one of the header, the tail snapshot's size and
 * CRC-32), the block's tokens, its payload (the block's entry floats) and optionally the tail
 * snapshot kept with the block (kv/tail_cache.h: opaque bytes here). Every field is checked on
 * read against what the caller expects; any mismatch, a short or long file or a bad checksum (the
 * snapshot's included, when it is read) drops the record (the file is deleted, counted, logged)
 * and the read is a miss: a wrong block or snapshot is never returned.
 * Files are written to `<name>.tmp` and renamed (atomic on POSIX file systems), without fsync: a
 * crash can lose recent records, or leave a renamed file whose data never reached the disk, but
 * such a file fails its checksum and is dropped. Leftover `.tmp` files are deleted at open.
 * Retention: a byte budget (least recently used records go first) and a time-to-live since last
 * use (a record's mtime, refreshed on every hit; expired records are dropped at open and on
 * lookup). `DIR/LOCK` is held with flock for the store's lifetime: a second store (another engine,
 * in this process or another) on the same directory is refused with DI_ERR_BUSY.
 *
 * Owns: the index (sized at create for the budget; no allocation afterwards), the lock, one
 * header buffer. Does not: know what a payload means, or hash chains (the caller gives the hash).
 * Writes and reads are synchronous on the caller's thread (cost: docs/kv-cache.md); the engine
 * writes through kv/kv_disk_io.h, whose IO thread calls di_kv_disk_write, and reads through its
 * read thread (the admission prefetch), never on the engine thread.
 * Thread-safety: any thread; one writer (di_kv_disk_write) at a time; readers are serialised
 * among themselves. An internal mutex guards the index and the statistics (with the readers' one,
 * the locks of kv/: the engine thread, the IO thread and the read thread share a store); a read or
 * a write holds it only for its index steps, not for its file IO (a lookup of a record being
 * written misses; lookups and stats never wait for a read's or a write's IO). create / destroy:
 * one thread, nothing else running.
 */
#pragma once

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "deepinfer.h" // di_status

typedef struct di_kv_disk di_kv_disk;

// Version 3: an optional tail snapshot after the payload (its size and CRC-32 in the header).
// Version 2: V4.1 payloads are packed pages (Q4e entries, Q4 index keys; model/dsv41.h), no longer
// FP32. Records of older versions are dropped on read.
#define DI_KV_DISK_VERSION 3
#define DI_KV_DISK_BYTES_DEFAULT ((size_t)16 << 30) // 16 GiB
#define DI_KV_DISK_TTL_S_DEFAULT ((int64_t)72 * 3600)

// What every record of a store must match (else it is dropped on read).
typedef struct di_kv_disk_layout {
    uint64_t model_id;      // the prefix cache's model identity (hyper-parameters, precision)
    uint32_t precision;     // di_precision
    int32_t block_tokens;   // tokens per block
    int64_t block_floats;   // floats per pool block (the layout's identity)
    int64_t payload_floats; // floats stored per record (the entry part of a block, <= block_floats)
} di_kv_disk_layout;

typedef struct di_kv_disk_options {
    const char *dir;  // borrowed during create; created if missing (its parent must exist)
    size_t max_bytes; // record bytes kept at most; 0 = DI_KV_DISK_BYTES_DEFAULT
    int64_t ttl_s;    // drop records unused for longer; 0 = DI_KV_DISK_TTL_S_DEFAULT
    // Seconds since the epoch (tests move time); NULL = the real clock.
    int64_t (*now_s)(void *user);
    void *now_user;
    // The write queue's staging bytes (kv/kv_disk_io.h; di_kv_manager_open_disk creates it; the
    // store itself ignores this); 0 = DI_KV_DISK_IO_BYTES_DEFAULT.
    size_t queue_bytes;
    // Pool bytes one admission prefetch reserves at most for the records it reads, its tail
    // snapshot's staging included (kv_manager.h, di_kv_prefetch; the store ignores this);
    // 0 = DI_KV_DISK_READ_BYTES_DEFAULT.
    size_t read_bytes;
    // Admission prefetches at once (kv_manager.h; 1 .. DI_KV_DISK_IO_MAX_READS; the store ignores
    // this); 0 = DI_KV_DISK_PREFETCHES_DEFAULT.
    int32_t prefetches;
} di_kv_disk_options;

#define DI_KV_DISK_READ_BYTES_DEFAULT ((size_t)1 << 30) // 1 GiB
#define DI_KV_DISK_PREFETCHES_DEFAULT 4

typedef struct di_kv_disk_stats {
    int64_t n_records, n_bytes;            // on disk now (what the index holds)
    int64_t n_written, n_read;             // records written / read and verified since create
    int64_t n_snaps_written, n_snaps_read; // of which with a tail snapshot (read: and taken)
    int64_t n_dropped;                     // records dropped as corrupt, truncated or not matching
    int64_t n_expired;                     // records dropped by the time-to-live
    int64_t n_evicted;                     // records deleted to stay within the byte budget
    int64_t n_write_errors;    // writes that failed (disk full, ...): the block is just not kept
    int64_t write_us, read_us; // time spent in writes / reads (verification included)
    int64_t n_found_at_open, bytes_found_at_open;
} di_kv_disk_stats;

// Opens (creating if needed) the store at o->dir, takes its lock and scans it: files shorter than a
// record without a snapshot and expired records are deleted, the rest indexed with their sizes
// (oldest first out). DI_ERR_INVALID (no dir, a budget below one record, a bad layout), DI_ERR_IO
// (the directory cannot be created or read), DI_ERR_BUSY (another store holds the lock),
// DI_ERR_NOMEM. All logged.
di_status di_kv_disk_create(const di_kv_disk_options *o, const di_kv_disk_layout *l,
                            di_kv_disk **out);
// Releases the lock and frees the index (records stay on disk). NULL does nothing.
void di_kv_disk_destroy(di_kv_disk *d);

// Bytes of one record (header, tokens, payload) without a snapshot.
size_t di_kv_disk_record_bytes(const di_kv_disk *d);
// The layout the store was created with.
const di_kv_disk_layout *di_kv_disk_get_layout(const di_kv_disk *d);
// Records the budget (and the index) hold at most.
int32_t di_kv_disk_capacity(const di_kv_disk *d);

// Whether a record for hash h is indexed and not expired (an expired one is dropped).
bool di_kv_disk_has(di_kv_disk *d, uint64_t h);

// Stores a block (tokens: block_tokens ids; payload: payload_floats) and, when snap is not NULL,
// its tail snapshot (snap_bytes; left out when the record with it would exceed the whole
// budget), unless h is already there (rewritten only to add a snapshot its record lacks),
// deleting least recently used records first to stay within the budget (which counts every
// record's bytes, snapshot included). DI_ERR_IO (logged; the block is simply not kept).
di_status di_kv_disk_write(di_kv_disk *d, uint64_t h, uint64_t parent, uint64_t salt,
                           const int32_t *tokens, const float *payload, const void *snap,
                           size_t snap_bytes);

// The tail snapshot bytes of h's indexed record (0: none, or no record).
size_t di_kv_disk_snap_bytes(di_kv_disk *d, uint64_t h);

// Reads the record of h into payload (payload_floats) if it exists, is not expired and matches
// the layout, h, parent, salt and tokens with valid checksums; refreshes its last use. When snap
// is not NULL and the record holds a snapshot of snap_bytes, that is read into snap and verified
// too (*snap_read = true); a snapshot of another size, or any when snap is NULL, is ignored (the
// block is used alone). Returns true on such a hit. Otherwise false; a record that exists but
// fails any check (its snapshot's included) is deleted. payload and snap may be overwritten even
// on a miss. snap_read may be NULL.
bool di_kv_disk_read(di_kv_disk *d, uint64_t h, uint64_t parent, uint64_t salt,
                     const int32_t *tokens, float *payload, void *snap, size_t snap_bytes,
                     bool *snap_read);

void di_kv_disk_get_stats(const di_kv_disk *d, di_kv_disk_stats *out);

// ---- records in memory (the KV transfer of prefill/decode disaggregation: docs/disaggregation.md)
// The same record as a file's bytes: header, tokens, payload (native byte order), without a tail
// snapshot section (the KV transfer carries its snapshot itself: kv/kv_transfer.h).

// Bytes of one record of layout l.
size_t di_kv_disk_record_size(const di_kv_disk_layout *l);
// Writes the record of block h (tokens: block_tokens ids; payload: payload_floats) into out
// (di_kv_disk_record_size(l) bytes, any alignment).
void di_kv_disk_record_put(const di_kv_disk_layout *l, uint64_t h, uint64_t parent, uint64_t salt,
                           const int32_t *tokens, const float *payload, void *out);

typedef enum di_kv_disk_check {
    DI_KV_DISK_CHECK_OK = 0,
    DI_KV_DISK_CHECK_CORRUPT,     // truncated, bad magic / version / size, a checksum mismatch
    DI_KV_DISK_CHECK_OTHER_MODEL, // a valid header of another model identity or precision
} di_kv_disk_check;

// A verified record's fields; tokens and payload point into the checked bytes (any alignment:
// copy them out with memcpy).
typedef struct di_kv_disk_record {
    uint64_t hash, parent, salt;
    const void *tokens;  // block_tokens int32
    const void *payload; // payload_floats float
} di_kv_disk_record;

// Verifies the n bytes at rec as one record of layout l (magic, version, header checksum, model
// identity, layout, size, data checksum): DI_KV_DISK_CHECK_OK and *out, or the error and a static
// reason in *why. Whether hash, parent and tokens form the expected chain is the caller's check.
di_kv_disk_check di_kv_disk_record_check(const di_kv_disk_layout *l, const void *rec, size_t n,
                                         di_kv_disk_record *out, const char **why);

// The path of h's record into buf (tests corrupt it). Returns buf.
const char *di_kv_disk_path(const di_kv_disk *d, uint64_t h, char *buf, size_t cap);
