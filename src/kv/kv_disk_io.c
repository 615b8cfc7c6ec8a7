// kv_disk_io — the disk tier's write queue: a staging ring and the IO thread that empties it (see
// kv_disk_io.h and docs/kv-cache.md, "Disk tier").
#include "kv/kv_disk_io.h"

#include <pthread.h>
#include <string.h>
#include <time.h>

#include "base/log.h"
#include "base/mem.h"

enum { ALIGN = 64, MAX_ENTRIES = 1 << 20 };
#define NO_ROOM ((size_t)-1)

static size_t align_up(size_t n) {
    return (n + ALIGN - 1) / ALIGN * ALIGN;
}

static int64_t mono_us(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000 + ts.tv_nsec / 1000;
}

// One staged record: at ring + off its tokens, then its payload, then its snapshot (each start
// aligned to ALIGN); `bytes` reserved in all.
typedef struct entry {
    uint64_t h, parent, salt;
    size_t off, bytes, snap_bytes;
} entry;

struct di_kv_disk_io {
    di_kv_disk *d;             // borrowed
    size_t tok_bytes, f_bytes; // of one record's tokens / payload
    size_t data_bytes;         // staging bytes of a record without a snapshot (aligned parts)
    unsigned char *ring;       // owned [cap]
    size_t cap;
    // Queued records, oldest first: ents[first], ... (circular). The ring holds them in the same
    // order from ents[first].off on, wrapping once to 0; wr is where the next one goes. Guarded by
    // mu; a record's bytes are written under mu before it is queued and read by the IO thread
    // (without mu) until it is popped, so no one writes them meanwhile.
    entry *ents; // owned [max_ents]
    int32_t max_ents, first, n;
    size_t wr, used;
    pthread_t thread;
    bool started, quit, hold; // quit, hold: guarded by mu
    pthread_mutex_t mu;
    pthread_cond_t cv_work; // the IO thread waits for records
    pthread_cond_t cv_room; // put (with wait) and drain wait for the IO thread
    di_kv_disk_io_stats st; // guarded by mu
    // The read thread and its queue of jobs, oldest first: rq[(rq_first + i) % MAX_READS] for
    // i < rq_n, the first one running (guarded by mu; a job's fields by its state: the read thread
    // writes the results between submit and done, the submitter reads them after).
    pthread_t rthread;
    bool rstarted, rhold;
    di_kv_disk_read_job *rq[DI_KV_DISK_IO_MAX_READS]; // borrowed
    int32_t rq_first, rq_n;
    pthread_cond_t cv_read; // the read thread waits for a job (or a release of rhold)
    di_kv_disk_io_notify_fn notify;
    void *notify_user;
};

// The offset of `need` free bytes for the next record, or NO_ROOM (under mu).
static size_t reserve(const di_kv_disk_io *q, size_t need) {
    if (q->n == 0) return need <= q->cap ? 0 : NO_ROOM;
    if (q->n == q->max_ents) return NO_ROOM;
    const size_t oldest = q->ents[q->first].off;
    if (q->wr > oldest) { // live bytes: [oldest, wr); free: [wr, cap) and [0, oldest)
        if (q->cap - q->wr >= need) return q->wr;
        return oldest >= need ? 0 : NO_ROOM; // wraps (the end's gap is skipped)
    }
    // Wrapped: live bytes [oldest, ...) and [0, wr); free: [wr, oldest).
    return oldest - q->wr >= need ? q->wr : NO_ROOM;
}

static void *io_main(void *p) {
    di_kv_disk_io *q = p;
    pthread_mutex_lock(&q->mu);
    for (;;) {
        while ((q->n == 0 || q->hold) && !q->quit) pthread_cond_wait(&q->cv_work, &q->mu);
        if (q->n == 0) break; // quit, and everything written
        const entry e = q->ents[q->first];
        pthread_mutex_unlock(&q->mu);
        // The record stays queued (found by lookups) until it is indexed on disk.
        const unsigned char *b = q->ring + e.off;
        const size_t ot = align_up(q->tok_bytes), of = ot + align_up(q->f_bytes);
        // A failure is counted and logged by kv_disk: the record is simply not kept.
        (void)di_kv_disk_write(q->d, e.h, e.parent, e.salt, (const int32_t *)b,
                               (const float *)(b + ot), e.snap_bytes ? b + of : NULL, e.snap_bytes);
        pthread_mutex_lock(&q->mu);
        q->first = (q->first + 1) % q->max_ents;
        q->n--;
        q->used -= e.bytes;
        pthread_cond_broadcast(&q->cv_room);
    }
    pthread_mutex_unlock(&q->mu);
    return NULL;
}

// Reads job j's records, in chain order, stopping at the first that is in neither the queue nor
// the store (or fails its checks), at an abort, or at quit (a shutdown: the job is done short).
static void read_job(di_kv_disk_io *q, di_kv_disk_read_job *j) {
    const int32_t B = di_kv_disk_get_layout(q->d)->block_tokens;
    int32_t i = 0;
    for (; i < j->n; i++) {
        pthread_mutex_lock(&q->mu);
        while (q->rhold && !q->quit && !j->stop) pthread_cond_wait(&q->cv_read, &q->mu);
        const bool stop = q->quit || j->stop;
        pthread_mutex_unlock(&q->mu);
        if (stop) break;
        if (!j->dst[i]) continue; // the submitter holds it
        const uint64_t parent = i > 0 ? j->hash[i - 1] : j->parent0;
        const int32_t *t = j->tokens + (int64_t)i * B;
        void *snap = i == j->snap_block ? j->snap : NULL;
        bool got_snap = false;
        // The write queue first, then the store: a queued record leaves the queue only once it is
        // indexed on disk, so this order misses none in between; a record written meanwhile (or a
        // collision in the queue) is read from the store, which has the final word.
        bool got = di_kv_disk_io_read(q, j->hash[i], parent, j->salt, t, j->dst[i], snap,
                                      j->snap_bytes, &got_snap);
        if (!got)
            got = di_kv_disk_read(q->d, j->hash[i], parent, j->salt, t, j->dst[i], snap,
                                  j->snap_bytes, &got_snap);
        if (!got) break; // fewer cached blocks: the request computes the rest
        j->n_read++;
        j->bytes_read += (int64_t)q->f_bytes + (got_snap ? (int64_t)j->snap_bytes : 0);
        if (snap) j->snap_ok = got_snap;
    }
    j->n_ok = i;
    if (j->snap_block >= i) j->snap_ok = false;
}

// The queue's oldest job is done (under mu): it leaves the queue, its memory is the submitter's.
static void read_pop(di_kv_disk_io *q) {
    q->rq[q->rq_first]->busy = false;
    q->rq_first = (q->rq_first + 1) % DI_KV_DISK_IO_MAX_READS;
    q->rq_n--;
}

static void *read_main(void *p) {
    di_kv_disk_io *q = p;
    pthread_mutex_lock(&q->mu);
    for (;;) {
        // A held thread starts no job but the one told to stop (it ends at once).
        while ((q->rq_n == 0 || (q->rhold && !q->rq[q->rq_first]->stop)) && !q->quit)
            pthread_cond_wait(&q->cv_read, &q->mu);
        if (q->quit && q->rq_n == 0) break;
        di_kv_disk_read_job *j = q->rq[q->rq_first];
        pthread_mutex_unlock(&q->mu);
        const int64_t t0 = mono_us();
        read_job(q, j);
        j->done_us = mono_us();
        j->read_us = j->done_us - t0;
        pthread_mutex_lock(&q->mu);
        read_pop(q);
        pthread_cond_broadcast(&q->cv_room); // di_kv_disk_io_read_wait
        const di_kv_disk_io_notify_fn fn = q->notify;
        void *user = q->notify_user;
        pthread_mutex_unlock(&q->mu);
        if (fn) fn(user); // without mu: the submitter's lock may be taken before mu elsewhere
        pthread_mutex_lock(&q->mu);
    }
    pthread_mutex_unlock(&q->mu);
    return NULL;
}

di_status di_kv_disk_io_create(di_kv_disk *d, size_t staging_bytes, di_kv_disk_io **out) {
    const di_kv_disk_layout *l = di_kv_disk_get_layout(d);
    di_kv_disk_io *q = di_calloc(1, sizeof *q);
    if (!q) return DI_ERR_NOMEM;
    di_status st = DI_OK;
    pthread_mutex_init(&q->mu, NULL);
    pthread_cond_init(&q->cv_work, NULL);
    pthread_cond_init(&q->cv_room, NULL);
    pthread_cond_init(&q->cv_read, NULL);
    q->d = d;
    q->tok_bytes = sizeof(int32_t) * (size_t)l->block_tokens;
    q->f_bytes = sizeof(float) * (size_t)l->payload_floats;
    q->data_bytes = align_up(q->tok_bytes) + align_up(q->f_bytes);
    q->cap = staging_bytes ? staging_bytes : DI_KV_DISK_IO_BYTES_DEFAULT;
    if (q->cap < q->data_bytes) q->cap = q->data_bytes;
    q->cap = align_up(q->cap);
    const size_t ne = q->cap / q->data_bytes + 1;
    q->max_ents = ne > MAX_ENTRIES ? MAX_ENTRIES : (int32_t)ne;
    // calloc: staging pages cost memory once a burst of evictions first reaches them.
    q->ring = di_calloc(q->cap, 1);
    q->ents = di_calloc((size_t)q->max_ents, sizeof *q->ents);
    if (!q->ring || !q->ents) {
        st = DI_ERR_NOMEM;
        goto fail;
    }
    q->st.capacity_bytes = (int64_t)q->cap;
    if (pthread_create(&q->thread, NULL, io_main, q) != 0) {
        DI_LOG_ERROR("kv disk: cannot start the disk IO thread");
        st = DI_ERR_NOMEM;
        goto fail;
    }
    q->started = true;
    if (pthread_create(&q->rthread, NULL, read_main, q) != 0) {
        DI_LOG_ERROR("kv disk: cannot start the disk read thread");
        st = DI_ERR_NOMEM;
        goto fail;
    }
    q->rstarted = true;
    DI_LOG_INFO("kv disk: writes go through an IO thread with %.1f MiB of staging (%d records at "
                "most); a record that does not fit is dropped and counted",
                (double)q->cap / (1 << 20), (int)q->max_ents);
    *out = q;
    return DI_OK;
fail:
    di_kv_disk_io_destroy(q);
    return st;
}

void di_kv_disk_io_destroy(di_kv_disk_io *q) {
    if (!q) return;
    if (q->started || q->rstarted) {
        pthread_mutex_lock(&q->mu);
        q->quit = true; // the IO thread writes what is queued, then ends; a read job stops short
        q->hold = q->rhold = false;
        pthread_cond_broadcast(&q->cv_work);
        pthread_cond_broadcast(&q->cv_read);
        pthread_mutex_unlock(&q->mu);
        if (q->started) pthread_join(q->thread, NULL);
        if (q->rstarted) pthread_join(q->rthread, NULL);
    }
    di_free(q->ring);
    di_free(q->ents);
    pthread_cond_destroy(&q->cv_work);
    pthread_cond_destroy(&q->cv_room);
    pthread_cond_destroy(&q->cv_read);
    pthread_mutex_destroy(&q->mu);
    di_free(q);
}

di_status di_kv_disk_io_put(di_kv_disk_io *q, uint64_t h, uint64_t parent, uint64_t salt,
                            const int32_t *tokens, const float *payload, const void *snap,
                            size_t snap_bytes, bool wait) {
    const int64_t t0 = mono_us();
    if (!snap) snap_bytes = 0;
    if (q->data_bytes + align_up(snap_bytes) > q->cap) snap_bytes = 0; // the block alone fits
    const size_t need = q->data_bytes + align_up(snap_bytes);
    di_status st = DI_OK;
    pthread_mutex_lock(&q->mu);
    size_t off;
    while ((off = reserve(q, need)) == NO_ROOM) {
        if (!wait) {
            q->st.n_dropped++;
            st = DI_ERR_BUSY;
            goto out;
        }
        pthread_cond_wait(&q->cv_room, &q->mu);
    }
    // The copy runs under mu: the IO thread only waits for it at its next pop (a few ms for the
    // largest record), and a lookup on this thread never sees a half-written record.
    unsigned char *b = q->ring + off;
    const size_t ot = align_up(q->tok_bytes), of = ot + align_up(q->f_bytes);
    memcpy(b, tokens, q->tok_bytes);
    memcpy(b + ot, payload, q->f_bytes);
    if (snap_bytes) memcpy(b + of, snap, snap_bytes);
    q->ents[(q->first + q->n) % q->max_ents] = (entry){.h = h,
                                                       .parent = parent,
                                                       .salt = salt,
                                                       .off = off,
                                                       .bytes = need,
                                                       .snap_bytes = snap_bytes};
    q->n++;
    q->wr = off + need;
    q->used += need;
    q->st.n_queued++;
    pthread_cond_signal(&q->cv_work);
out:;
    const int64_t dt = mono_us() - t0;
    q->st.stage_us += dt;
    if (dt > q->st.stage_us_max) q->st.stage_us_max = dt;
    pthread_mutex_unlock(&q->mu);
    return st;
}

// The newest queued record of h, or NULL (under mu).
static const entry *find_locked(const di_kv_disk_io *q, uint64_t h) {
    for (int32_t i = q->n - 1; i >= 0; i--) {
        const entry *e = &q->ents[(q->first + i) % q->max_ents];
        if (e->h == h) return e;
    }
    return NULL;
}

bool di_kv_disk_io_find(di_kv_disk_io *q, uint64_t h, size_t *snap_bytes) {
    pthread_mutex_lock(&q->mu);
    const entry *e = find_locked(q, h);
    if (e && snap_bytes) *snap_bytes = e->snap_bytes;
    pthread_mutex_unlock(&q->mu);
    return e != NULL;
}

bool di_kv_disk_io_read(di_kv_disk_io *q, uint64_t h, uint64_t parent, uint64_t salt,
                        const int32_t *tokens, float *payload, void *snap, size_t snap_bytes,
                        bool *snap_read) {
    if (snap_read) *snap_read = false;
    pthread_mutex_lock(&q->mu);
    const entry *e = find_locked(q, h);
    const unsigned char *b = e ? q->ring + e->off : NULL;
    const size_t ot = align_up(q->tok_bytes), of = ot + align_up(q->f_bytes);
    // The same chain hash with another parent, salt or tokens (a hash collision) is a miss, as on
    // disk.
    const bool hit =
        e && e->parent == parent && e->salt == salt && !memcmp(b, tokens, q->tok_bytes);
    if (hit) {
        memcpy(payload, b + ot, q->f_bytes);
        if (snap && snap_bytes && e->snap_bytes == snap_bytes) {
            memcpy(snap, b + of, snap_bytes);
            if (snap_read) *snap_read = true;
            q->st.n_snap_hits++;
        }
        q->st.n_hits++;
    }
    pthread_mutex_unlock(&q->mu);
    return hit;
}

void di_kv_disk_io_drain(di_kv_disk_io *q) {
    pthread_mutex_lock(&q->mu);
    while (q->n > 0) pthread_cond_wait(&q->cv_room, &q->mu);
    pthread_mutex_unlock(&q->mu);
}

void di_kv_disk_io_hold(di_kv_disk_io *q, bool hold) {
    pthread_mutex_lock(&q->mu);
    q->hold = hold;
    pthread_cond_broadcast(&q->cv_work);
    pthread_mutex_unlock(&q->mu);
}

void di_kv_disk_io_get_stats(di_kv_disk_io *q, di_kv_disk_io_stats *out) {
    pthread_mutex_lock(&q->mu);
    *out = q->st;
    out->n_pending = q->n;
    out->pending_bytes = (int64_t)q->used;
    pthread_mutex_unlock(&q->mu);
}

// ---- reads ----

void di_kv_disk_io_set_notify(di_kv_disk_io *q, di_kv_disk_io_notify_fn fn, void *user) {
    pthread_mutex_lock(&q->mu);
    q->notify = fn;
    q->notify_user = user;
    pthread_mutex_unlock(&q->mu);
}

di_status di_kv_disk_io_read_submit(di_kv_disk_io *q, di_kv_disk_read_job *job) {
    pthread_mutex_lock(&q->mu);
    if (job->busy || q->rq_n == DI_KV_DISK_IO_MAX_READS) {
        pthread_mutex_unlock(&q->mu);
        return DI_ERR_BUSY;
    }
    job->n_ok = job->n_read = 0;
    job->snap_ok = job->stop = false;
    job->bytes_read = job->read_us = job->done_us = 0;
    job->submit_us = mono_us();
    job->busy = true;
    q->rq[(q->rq_first + q->rq_n++) % DI_KV_DISK_IO_MAX_READS] = job;
    pthread_cond_broadcast(&q->cv_read);
    pthread_mutex_unlock(&q->mu);
    return DI_OK;
}

bool di_kv_disk_io_read_done(di_kv_disk_io *q, const di_kv_disk_read_job *job) {
    pthread_mutex_lock(&q->mu);
    const bool done = !job->busy;
    pthread_mutex_unlock(&q->mu);
    return done;
}

void di_kv_disk_io_read_abort(di_kv_disk_io *q, di_kv_disk_read_job *job) {
    pthread_mutex_lock(&q->mu);
    if (job->busy && q->rq[q->rq_first] != job) { // queued: it leaves the queue, never started
        int32_t i = 0;
        while (q->rq[(q->rq_first + i) % DI_KV_DISK_IO_MAX_READS] != job) i++;
        for (; i + 1 < q->rq_n; i++)
            q->rq[(q->rq_first + i) % DI_KV_DISK_IO_MAX_READS] =
                q->rq[(q->rq_first + i + 1) % DI_KV_DISK_IO_MAX_READS];
        q->rq_n--;
        job->busy = false;
        job->submit_us = job->done_us = mono_us();
        pthread_cond_broadcast(&q->cv_room);
    } else if (job->busy) { // running, or first and about to (even while held): stops short
        job->stop = true;
        pthread_cond_broadcast(&q->cv_read);
    }
    pthread_mutex_unlock(&q->mu);
}

void di_kv_disk_io_read_wait(di_kv_disk_io *q, const di_kv_disk_read_job *job) {
    pthread_mutex_lock(&q->mu);
    while (job->busy) pthread_cond_wait(&q->cv_room, &q->mu);
    pthread_mutex_unlock(&q->mu);
}

void di_kv_disk_io_hold_reads(di_kv_disk_io *q, bool hold) {
    pthread_mutex_lock(&q->mu);
    q->rhold = hold;
    pthread_cond_broadcast(&q->cv_read);
    pthread_mutex_unlock(&q->mu);
}
