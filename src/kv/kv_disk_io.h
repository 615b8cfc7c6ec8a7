/*
 * kv_disk_io — the disk tier's write queue and IO thread (docs/kv-cache.md, "Disk tier"): the
 * engine thread stages a record (its block's tokens and entry payload, and its tail snapshot when
 * it has one) by copying it into a bounded staging ring, and goes on; the IO thread writes the
 * records, oldest first, with di_kv_disk_write (kv/kv_disk.h). A Flash record with a snapshot
 * (28.6 MiB) costs the engine thread a copy (a few ms) instead of a 55-177 ms file write.
 *
 * Why a copy: an evicted block returns to the pool at once (the allocation that evicted it wants
 * it), and its snapshot slot goes with it; pinning them until written would make eviction wait for
 * the disk. The staging ring is the queue's budget: a record that does not fit is dropped and
 * counted (di_kv_disk_io_put without wait: eviction never waits for the disk; a dropped record only
 * loses a cache entry), or waited for (with wait: the shutdown flush, which must not lose any).
 * A queued record is found by di_kv_disk_io_read until it is written and indexed on disk, so a
 * lookup that tries the queue first and the store second never misses a record in between.
 * Errors of the IO thread are counted and logged by kv_disk (n_write_errors); it never stops.
 *
 * Reads (the admission prefetches, docs/kv-cache.md, "Disk tier"): a read thread of its own runs
 * read jobs one after another, oldest first, from a queue of up to DI_KV_DISK_IO_MAX_READS: each
 * a chain of block records (each from the queue, else from the store) into memory the submitter
 * reserved (pool blocks: kv_manager.c), verified, and one record's tail snapshot. Its own thread,
 * so a backlog of 28.6 MiB snapshot writes never delays an admission's reads; one thread, because
 * the store serialises its readers anyway (kv_disk.h), and a queue, so that the reads of several
 * waiting requests follow each other without a gap while the engine admits the first. A job is
 * the submitter's memory, which it does not touch until the job is done (or the queue destroyed);
 * the read thread never sees a request.
 *
 * Owns: the IO and read threads, the staging ring, the descriptor array and the read queue (sized
 * at create: no allocation afterwards). Borrows the store (it must outlive the queue) and the read
 * jobs.
 * Thread-safety: put, read, find, drain, hold, the read job calls and stats from any thread, under
 * the queue's mutex; one producer thread (the engine thread) at a time.
 */
#pragma once

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "deepinfer.h"  // di_status
#include "kv/kv_disk.h" // di_kv_disk

typedef struct di_kv_disk_io di_kv_disk_io;

#define DI_KV_DISK_IO_BYTES_DEFAULT ((size_t)256 << 20) // 256 MiB of staging

typedef struct di_kv_disk_io_stats {
    int64_t n_queued;       // records staged since create
    int64_t n_dropped;      // records dropped because the staging ring was full (not written)
    int64_t n_hits;         // lookups served from the queue (a record not yet on disk)
    int64_t n_snap_hits;    // of which with the record's tail snapshot (copied out)
    int64_t n_pending;      // records queued now (the one being written included)
    int64_t pending_bytes;  // their staging bytes
    int64_t stage_us;       // the producer's time in put (copies, and waits of put with wait)
    int64_t stage_us_max;   // the longest put
    int64_t capacity_bytes; // the staging ring's size
} di_kv_disk_io_stats;

// The queue of store d (borrowed) with staging_bytes of staging (0: DI_KV_DISK_IO_BYTES_DEFAULT;
// at least one record without a snapshot), and its IO thread. DI_ERR_NOMEM (also: the thread
// cannot start; logged).
di_status di_kv_disk_io_create(di_kv_disk *d, size_t staging_bytes, di_kv_disk_io **out);
// Writes every queued record (a hold is released), joins the thread, frees. NULL does nothing.
void di_kv_disk_io_destroy(di_kv_disk_io *q);

// Stages the record of block h (tokens: block_tokens ids; payload: payload_floats; snap: NULL or
// snap_bytes) for the IO thread. The snapshot is left out when the record with it would not fit
// the whole ring. When the ring is full: with wait, blocks until the IO thread made room; without,
// drops the record (counted) and returns DI_ERR_BUSY. DI_OK: queued (copied: the caller's memory
// may be reused at once).
di_status di_kv_disk_io_put(di_kv_disk_io *q, uint64_t h, uint64_t parent, uint64_t salt,
                            const int32_t *tokens, const float *payload, const void *snap,
                            size_t snap_bytes, bool wait);
// Whether a record of h is queued (newest one), and the bytes of its snapshot (0: none).
bool di_kv_disk_io_find(di_kv_disk_io *q, uint64_t h, size_t *snap_bytes);
// As di_kv_disk_read, from the newest queued record of h: true (copied into payload, and into
// snap when it holds a snapshot of snap_bytes: *snap_read) when h is queued with that parent, salt
// and tokens; false otherwise (nothing written).
bool di_kv_disk_io_read(di_kv_disk_io *q, uint64_t h, uint64_t parent, uint64_t salt,
                        const int32_t *tokens, float *payload, void *snap, size_t snap_bytes,
                        bool *snap_read);
// Blocks until every record queued before the call is written (or failed): the queue is empty.
// Must not be called while held.
void di_kv_disk_io_drain(di_kv_disk_io *q);
// Test hook: while held, the IO thread writes nothing (records stay queued; put drops or waits).
void di_kv_disk_io_hold(di_kv_disk_io *q, bool hold);
void di_kv_disk_io_get_stats(di_kv_disk_io *q, di_kv_disk_io_stats *out);

// ---- reads (the read thread) ----

// A chain of n blocks to read: block i's record has chain hash hash[i], parent hash[i - 1]
// (parent0 for block 0), the job's salt and tokens[i * block_tokens ...]. Blocks with dst[i] NULL
// are not read (the submitter has them). Filled by the submitter, then read-only until done.
typedef struct di_kv_disk_read_job {
    uint64_t salt, parent0;
    int32_t n;
    const uint64_t *hash;  // borrowed [n]
    const int32_t *tokens; // borrowed [n * block_tokens]
    float *const *dst;     // borrowed [n]: where block i's payload (payload_floats) goes, or NULL
    int32_t snap_block;    // the block whose record's snapshot is read into snap (-1: none)
    void *snap;            // borrowed [snap_bytes]
    size_t snap_bytes;
    // Results, written by the read thread (valid once di_kv_disk_io_read_done says so).
    int32_t n_ok;               // blocks [0, n_ok) are there (read and verified, or not to read)
    bool snap_ok;               // snap holds snap_block's verified snapshot (snap_block < n_ok)
    int32_t n_read;             // records read (and verified): the queue's and the store's
    int64_t bytes_read;         // their payload and snapshot bytes
    int64_t read_us;            // the read thread's time on the job
    int64_t submit_us, done_us; // CLOCK_MONOTONIC microseconds
    // The queue's state of the job (under its mutex): submitted and not done; asked to stop.
    bool busy, stop;
} di_kv_disk_read_job;

// Read jobs queued or running at most.
#define DI_KV_DISK_IO_MAX_READS 64

// Called on the read thread when a job is done (no lock of the queue held): wakes the submitter.
typedef void (*di_kv_disk_io_notify_fn)(void *user);
// Before any job: the function called when one is done (NULL: none).
void di_kv_disk_io_set_notify(di_kv_disk_io *q, di_kv_disk_io_notify_fn fn, void *user);
// Queues job (borrowed until done) for the read thread, after the jobs queued before it.
// DI_ERR_BUSY: the job is not done yet, or DI_KV_DISK_IO_MAX_READS jobs are queued or running.
di_status di_kv_disk_io_read_submit(di_kv_disk_io *q, di_kv_disk_read_job *job);
// Whether job is done (then its memory is the submitter's again; also true when it was never
// submitted).
bool di_kv_disk_io_read_done(di_kv_disk_io *q, const di_kv_disk_read_job *job);
// Job stops: a queued one leaves the queue done at once (n_ok 0), a running one before its next
// record (n_ok: the blocks done so far), held or not, so it is done soon (at most one record's
// read later). Nothing when it is done.
void di_kv_disk_io_read_abort(di_kv_disk_io *q, di_kv_disk_read_job *job);
// Blocks until job is done (at once when it is).
void di_kv_disk_io_read_wait(di_kv_disk_io *q, const di_kv_disk_read_job *job);
// Test hook: while held, the read thread starts no job and reads no further record.
void di_kv_disk_io_hold_reads(di_kv_disk_io *q, bool hold);
