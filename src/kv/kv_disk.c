// kv_disk — the prefix cache's persistent tier: one verified file per block (see kv_disk.h and
// docs/kv-cache.md).
#include "kv/kv_disk.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h> // flock
#include <sys/stat.h>
#include <sys/uio.h> // readv, writev
#include <time.h>
#include <unistd.h>
#include <zlib.h> // crc32_z

#include "base/log.h"
#include "base/mem.h"
#include "base/status.h" // DI_TRY

enum {
    HEADER_BYTES = 128,
    MAX_INDEX = 1 << 22, // records indexed at most (whatever the budget): 4M x ~40 bytes
    MAX_WARN = 16,       // drops / write errors logged at WARN; later ones at DEBUG
    PATH_CAP = 4096,
};

static const char k_magic[8] = {'D', 'I', 'K', 'V', 'B', 'L', 'K', '\0'};

// The record header, native byte order (a store is not moved between machines of different
// endianness; the magic, version and checksums reject such a file anyway).
typedef struct rec_header {
    char magic[8];
    uint32_t version;
    uint32_t header_bytes;
    uint64_t model_id;
    uint32_t precision;
    int32_t block_tokens;
    int64_t block_floats;
    int64_t payload_floats;
    uint64_t hash, parent, salt;
    int64_t written_s;   // when written (informational; retention uses the file's mtime)
    uint32_t crc_data;   // CRC-32 of the tokens, then the payload
    uint32_t crc_header; // CRC-32 of this header with crc_header = 0
    uint64_t snap_bytes; // the tail snapshot after the payload (0: none; version 3)
    uint32_t crc_snap;   // CRC-32 of its bytes
    unsigned char pad[HEADER_BYTES - 100]; // zero
} rec_header;
_Static_assert(sizeof(rec_header) == HEADER_BYTES, "record header is 128 bytes");

// Three threads use a store: the engine thread (lookups: has, snap_bytes, stats), the disk IO
// thread of kv/kv_disk_io.h (writes) and its read thread (reads). mu guards the index, the
// statistics and the path scratch; rmu serialises readers and guards the read scratch (rpath, hdr,
// tokens). A read holds mu only for its index steps (the lookup, then the verdict: last use, or
// the drop of a bad record), not for its file IO, so a lookup or the stats on the engine thread
// never wait for a read's IO (a V4-Flash record with its snapshot: 35-50 ms). A write holds mu for
// its index steps only (room, then the new entry); its file IO uses the writer's own scratch
// (wpath, wtmp, whdr), so one writer at a time. A record being written is not indexed until it is
// complete: a lookup meanwhile misses.
struct di_kv_disk {
    pthread_mutex_t mu;
    pthread_mutex_t rmu; // readers (see above)
    char *rpath;         // owned [PATH_CAP]: the reader's path (under rmu)
    char *dir;           // owned
    char *path;          // owned [PATH_CAP]: scratch for record paths (under mu)
    char *wpath, *wtmp;  // owned [PATH_CAP]: the writer's
    rec_header *whdr;    // owned: the writer's header
    int lock_fd;         // DIR/LOCK, flock'ed
    di_kv_disk_layout l;
    size_t rec_bytes, max_bytes; // rec_bytes: a record without a snapshot
    int64_t ttl_s;
    int64_t (*now_s)(void *user);
    void *now_user;
    rec_header *hdr; // owned: read scratch (under rmu)
    int32_t *tokens; // owned [block_tokens]: read scratch
    // Index: slots with hash, last use and an LRU list (head = least recently used).
    int32_t cap;
    int32_t n_hw;                 // slots ever used (slots >= n_hw are untouched)
    uint64_t *hash;               // owned [cap]
    int64_t *last_s;              // owned [cap]
    int64_t *bytes;               // owned [cap]: the record's file size (its snapshot included)
    int32_t *prev, *next, *chain; // owned [cap]
    int32_t *free_slots;          // owned [cap]
    int32_t n_free;
    int32_t *bucket; // owned [n_buckets]: slot + 1 of the chain's first, 0 = empty
    uint64_t mask;
    int32_t lru_head, lru_tail;
    int32_t n_warn;
    di_kv_disk_stats st;
};

static int64_t now_s(const di_kv_disk *d) {
    return d->now_s ? d->now_s(d->now_user) : (int64_t)time(NULL);
}

static int64_t mono_us(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000 + ts.tv_nsec / 1000;
}

static uint64_t mix64(uint64_t z) {
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

const char *di_kv_disk_path(const di_kv_disk *d, uint64_t h, char *buf, size_t cap) {
    snprintf(buf, cap, "%s/%02x/%016llx.kvb", d->dir, (unsigned)(h >> 56), (unsigned long long)h);
    return buf;
}

static void tmp_path(const di_kv_disk *d, uint64_t h, char *buf, size_t cap) {
    snprintf(buf, cap, "%s/%02x/%016llx.tmp", d->dir, (unsigned)(h >> 56), (unsigned long long)h);
}

// ---- index ----

static int32_t find(const di_kv_disk *d, uint64_t h) {
    for (int32_t s = d->bucket[mix64(h) & d->mask] - 1; s >= 0; s = d->chain[s] - 1)
        if (d->hash[s] == h) return s;
    return -1;
}

static void lru_unlink(di_kv_disk *d, int32_t s) {
    int32_t a = d->prev[s], b = d->next[s];
    if (a >= 0)
        d->next[a] = b;
    else
        d->lru_head = b;
    if (b >= 0)
        d->prev[b] = a;
    else
        d->lru_tail = a;
}

static void lru_push(di_kv_disk *d, int32_t s) {
    d->prev[s] = d->lru_tail;
    d->next[s] = -1;
    if (d->lru_tail >= 0)
        d->next[d->lru_tail] = s;
    else
        d->lru_head = s;
    d->lru_tail = s;
}

// Indexes h as the most recently used record (the caller made room: n_records < cap).
static void index_add(di_kv_disk *d, uint64_t h, int64_t last_s, int64_t bytes) {
    DI_ASSERT(d->st.n_records < d->cap);
    int32_t s = d->n_free > 0 ? d->free_slots[--d->n_free] : d->n_hw++;
    d->hash[s] = h;
    d->last_s[s] = last_s;
    d->bytes[s] = bytes;
    int32_t *b = &d->bucket[mix64(h) & d->mask];
    d->chain[s] = *b;
    *b = s + 1;
    lru_push(d, s);
    d->st.n_records++;
    d->st.n_bytes += bytes;
}

static void index_remove(di_kv_disk *d, int32_t s) {
    int32_t *link = &d->bucket[mix64(d->hash[s]) & d->mask];
    while (*link != s + 1) link = &d->chain[*link - 1];
    *link = d->chain[s];
    lru_unlink(d, s);
    d->free_slots[d->n_free++] = s;
    d->st.n_records--;
    d->st.n_bytes -= d->bytes[s];
}

// Deletes slot s's file and forgets it.
static void delete_record(di_kv_disk *d, int32_t s) {
    di_kv_disk_path(d, d->hash[s], d->path, PATH_CAP);
    if (unlink(d->path) != 0 && errno != ENOENT)
        DI_LOG_DEBUG("kv disk: cannot delete %s: %s", d->path, strerror(errno));
    index_remove(d, s);
}

// A record that failed a check: deleted, counted, logged (once per record).
static void drop(di_kv_disk *d, int32_t s, const char *why) {
    char p[PATH_CAP];
    di_kv_disk_path(d, d->hash[s], p, sizeof p);
    if (d->n_warn < MAX_WARN) {
        d->n_warn++;
        DI_LOG_WARN("kv disk: dropped %s: %s (the lookup is a miss; the block is recomputed)%s", p,
                    why, d->n_warn == MAX_WARN ? "; further drops are logged at DEBUG" : "");
    } else {
        DI_LOG_DEBUG("kv disk: dropped %s: %s", p, why);
    }
    d->st.n_dropped++;
    delete_record(d, s);
}

static bool expired(const di_kv_disk *d, int64_t last_s, int64_t now) {
    return now - last_s > d->ttl_s;
}

// ---- create / destroy ----

// mkdir -p for path (its components); true if it exists as a directory afterwards.
static bool make_dirs(const char *path) {
    char buf[PATH_CAP];
    size_t n = strlen(path);
    if (n == 0 || n >= sizeof buf) return false;
    memcpy(buf, path, n + 1);
    for (size_t i = 1; i <= n; i++) {
        if (buf[i] != '/' && buf[i] != 0) continue;
        char c = buf[i];
        buf[i] = 0;
        if (mkdir(buf, 0755) != 0 && errno != EEXIST) return false;
        buf[i] = c;
    }
    struct stat sb;
    return stat(path, &sb) == 0 && S_ISDIR(sb.st_mode);
}

typedef struct found {
    uint64_t hash;
    int64_t mtime_s, bytes;
} found;

static int cmp_found(const void *a, const void *b) {
    const found *x = a, *y = b;
    if (x->mtime_s != y->mtime_s) return x->mtime_s < y->mtime_s ? -1 : 1;
    return x->hash < y->hash ? -1 : x->hash > y->hash;
}

// Parses "<16 hex>.kvb" / ".tmp": 1 record, 2 temp file, 0 other.
static int parse_name(const char *name, uint64_t *h) {
    if (strlen(name) != 20 || name[16] != '.') return 0;
    uint64_t v = 0;
    for (int i = 0; i < 16; i++) {
        char c = name[i];
        int x = c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10 : -1;
        if (x < 0) return 0;
        v = v << 4 | (uint64_t)x;
    }
    *h = v;
    if (!strcmp(name + 16, ".kvb")) return 1;
    if (!strcmp(name + 16, ".tmp")) return 2;
    return 0;
}

// Scans the 256 fan-out directories (creating them): deletes temp files, records of the wrong
// size and expired ones, then indexes the rest oldest first, evicting beyond the budget.
static di_status scan(di_kv_disk *d) {
    di_status st = DI_OK;
    const int64_t t0 = mono_us(), now = now_s(d);
    found *f = NULL;
    size_t n = 0, cap = 0;
    int64_t n_bad = 0, n_tmp = 0, n_old = 0;
    char sub[PATH_CAP], p[PATH_CAP];
    for (int k = 0; k < 256; k++) {
        snprintf(sub, sizeof sub, "%s/%02x", d->dir, k);
        if (mkdir(sub, 0755) != 0 && errno != EEXIST) {
            DI_LOG_ERROR("kv disk: cannot create %s: %s", sub, strerror(errno));
            st = DI_ERR_IO;
            goto out;
        }
        DIR *dh = opendir(sub);
        if (!dh) {
            DI_LOG_ERROR("kv disk: cannot read %s: %s", sub, strerror(errno));
            st = DI_ERR_IO;
            goto out;
        }
        for (struct dirent *de; (de = readdir(dh));) {
            uint64_t h = 0;
            int kind = parse_name(de->d_name, &h);
            if (kind == 0) continue;
            snprintf(p, sizeof p, "%s/%s", sub, de->d_name);
            struct stat sb;
            if (kind == 2 || (unsigned)(h >> 56) != (unsigned)k) { // crash leftover, misplaced
                n_tmp += unlink(p) == 0;
                continue;
            }
            if (stat(p, &sb) != 0 || !S_ISREG(sb.st_mode)) continue;
            // Shorter than a record without a snapshot: another layout, or truncated. A longer
            // one is a record with a tail snapshot (or another layout's: verified on read).
            if ((size_t)sb.st_size < d->rec_bytes) {
                n_bad += unlink(p) == 0;
                continue;
            }
            if (expired(d, (int64_t)sb.st_mtime, now)) {
                n_old += unlink(p) == 0;
                continue;
            }
            if (n == cap) {
                size_t nc = cap ? 2 * cap : 1024;
                found *g = di_realloc(f, nc * sizeof *f);
                if (!g) {
                    closedir(dh);
                    st = DI_ERR_NOMEM;
                    goto out;
                }
                f = g, cap = nc;
            }
            f[n++] = (found){h, (int64_t)sb.st_mtime, (int64_t)sb.st_size};
        }
        closedir(dh);
    }
    if (n) qsort(f, n, sizeof *f, cmp_found);
    // The newest records that fit the budget (and the index) are kept.
    size_t keep = 0, kept_bytes = 0;
    while (keep < n && keep < (size_t)d->cap &&
           kept_bytes + (size_t)f[n - 1 - keep].bytes <= d->max_bytes)
        kept_bytes += (size_t)f[n - 1 - keep++].bytes;
    for (size_t i = 0; i < n - keep; i++) {
        di_kv_disk_path(d, f[i].hash, p, sizeof p);
        d->st.n_evicted += unlink(p) == 0;
    }
    for (size_t i = n - keep; i < n; i++) index_add(d, f[i].hash, f[i].mtime_s, f[i].bytes);
    d->st.n_expired += n_old;
    d->st.n_found_at_open = d->st.n_records;
    d->st.bytes_found_at_open = d->st.n_bytes;
    DI_LOG_INFO("kv disk: %s: %lld records (%.1f MiB) found in %.1f ms; deleted %lld expired, "
                "%lld of another size, %lld temporary or misplaced, %lld over the budget",
                d->dir, (long long)d->st.n_records, (double)d->st.n_bytes / (1 << 20),
                (double)(mono_us() - t0) / 1000.0, (long long)n_old, (long long)n_bad,
                (long long)n_tmp, (long long)(n - keep));
out:
    di_free(f);
    return st;
}

di_status di_kv_disk_create(const di_kv_disk_options *o, const di_kv_disk_layout *l,
                            di_kv_disk **out) {
    if (!o->dir || !o->dir[0] || strlen(o->dir) > PATH_CAP - 64 || l->block_tokens < 1 ||
        l->payload_floats < 1 || l->payload_floats > l->block_floats) {
        DI_LOG_ERROR("kv disk: bad directory or layout");
        return DI_ERR_INVALID;
    }
    di_status st = DI_OK;
    di_kv_disk *d = di_calloc(1, sizeof *d);
    if (!d) return DI_ERR_NOMEM;
    d->lock_fd = -1;
    pthread_mutex_init(&d->mu, NULL);
    pthread_mutex_init(&d->rmu, NULL);
    d->l = *l;
    d->rec_bytes = di_kv_disk_record_size(l);
    d->max_bytes = o->max_bytes ? o->max_bytes : DI_KV_DISK_BYTES_DEFAULT;
    d->ttl_s = o->ttl_s > 0 ? o->ttl_s : DI_KV_DISK_TTL_S_DEFAULT;
    d->now_s = o->now_s;
    d->now_user = o->now_user;
    d->lru_head = d->lru_tail = -1;
    if (d->max_bytes < d->rec_bytes) {
        DI_LOG_ERROR("kv disk: a budget of %zu bytes holds no record of %zu bytes", d->max_bytes,
                     d->rec_bytes);
        st = DI_ERR_INVALID;
        goto fail;
    }
    size_t cap = d->max_bytes / d->rec_bytes;
    d->cap = cap > MAX_INDEX ? MAX_INDEX : (int32_t)cap;
    uint64_t nb = 16;
    while (nb < 2 * (uint64_t)d->cap) nb *= 2;
    d->mask = nb - 1;
    // calloc: untouched index pages cost no memory (a large budget of small records).
    const size_t nc = (size_t)d->cap;
    d->dir = di_malloc(strlen(o->dir) + 1);
    d->path = di_malloc(PATH_CAP);
    d->rpath = di_malloc(PATH_CAP);
    d->wpath = di_malloc(PATH_CAP);
    d->wtmp = di_malloc(PATH_CAP);
    d->hdr = di_calloc(1, sizeof *d->hdr);
    d->whdr = di_calloc(1, sizeof *d->whdr);
    d->tokens = di_malloc(sizeof(int32_t) * (size_t)l->block_tokens);
    d->hash = di_calloc(nc, sizeof *d->hash);
    d->last_s = di_calloc(nc, sizeof *d->last_s);
    d->bytes = di_calloc(nc, sizeof *d->bytes);
    d->prev = di_calloc(nc, sizeof *d->prev);
    d->next = di_calloc(nc, sizeof *d->next);
    d->chain = di_calloc(nc, sizeof *d->chain);
    d->free_slots = di_calloc(nc, sizeof *d->free_slots);
    d->bucket = di_calloc(nb, sizeof *d->bucket);
    if (!d->dir || !d->path || !d->rpath || !d->wpath || !d->wtmp || !d->whdr || !d->hdr ||
        !d->tokens || !d->hash || !d->last_s || !d->bytes || !d->prev || !d->next || !d->chain ||
        !d->free_slots || !d->bucket) {
        st = DI_ERR_NOMEM;
        goto fail;
    }
    memcpy(d->dir, o->dir, strlen(o->dir) + 1);
    if (!make_dirs(d->dir)) {
        DI_LOG_ERROR("kv disk: cannot create the directory %s: %s", d->dir, strerror(errno));
        st = DI_ERR_IO;
        goto fail;
    }
    snprintf(d->path, PATH_CAP, "%s/LOCK", d->dir);
    d->lock_fd = open(d->path, O_RDWR | O_CREAT | O_CLOEXEC, 0644);
    if (d->lock_fd < 0) {
        DI_LOG_ERROR("kv disk: cannot open %s: %s", d->path, strerror(errno));
        st = DI_ERR_IO;
        goto fail;
    }
    if (flock(d->lock_fd, LOCK_EX | LOCK_NB) != 0) {
        if (errno == EWOULDBLOCK) {
            DI_LOG_ERROR("kv disk: %s is in use by another engine (%s is locked): give each "
                         "engine its own --kv-disk-dir",
                         d->dir, d->path);
            st = DI_ERR_BUSY;
        } else {
            DI_LOG_ERROR("kv disk: cannot lock %s: %s", d->path, strerror(errno));
            st = DI_ERR_IO;
        }
        goto fail;
    }
    DI_TRY(scan(d));
    DI_LOG_INFO("kv disk: %s: records of %zu bytes (%d tokens), budget %.1f GiB (%d records), "
                "time-to-live %lld s",
                d->dir, d->rec_bytes, (int)l->block_tokens, (double)d->max_bytes / (1 << 30),
                (int)d->cap, (long long)d->ttl_s);
    *out = d;
    return DI_OK;
fail:
    di_kv_disk_destroy(d);
    return st;
}

void di_kv_disk_destroy(di_kv_disk *d) {
    if (!d) return;
    if (d->lock_fd >= 0) close(d->lock_fd); // releases the flock
    di_free(d->dir);
    di_free(d->path);
    di_free(d->rpath);
    di_free(d->wpath);
    di_free(d->wtmp);
    di_free(d->whdr);
    di_free(d->hdr);
    di_free(d->tokens);
    di_free(d->hash);
    di_free(d->last_s);
    di_free(d->bytes);
    di_free(d->prev);
    di_free(d->next);
    di_free(d->chain);
    di_free(d->free_slots);
    di_free(d->bucket);
    pthread_mutex_destroy(&d->mu);
    pthread_mutex_destroy(&d->rmu);
    di_free(d);
}

size_t di_kv_disk_record_bytes(const di_kv_disk *d) {
    return d->rec_bytes;
}

const di_kv_disk_layout *di_kv_disk_get_layout(const di_kv_disk *d) {
    return &d->l;
}

int32_t di_kv_disk_capacity(const di_kv_disk *d) {
    return d->cap;
}

void di_kv_disk_get_stats(const di_kv_disk *d, di_kv_disk_stats *out) {
    pthread_mutex_t *mu = (pthread_mutex_t *)&d->mu; // the lock is not the store's state
    pthread_mutex_lock(mu);
    *out = d->st;
    pthread_mutex_unlock(mu);
}

// ---- lookup ----

// di_kv_disk_has under mu.
static bool has_locked(di_kv_disk *d, uint64_t h) {
    int32_t s = find(d, h);
    if (s < 0) return false;
    if (expired(d, d->last_s[s], now_s(d))) {
        d->st.n_expired++;
        delete_record(d, s);
        return false;
    }
    return true;
}

bool di_kv_disk_has(di_kv_disk *d, uint64_t h) {
    pthread_mutex_lock(&d->mu);
    const bool has = has_locked(d, h);
    pthread_mutex_unlock(&d->mu);
    return has;
}

// ---- write ----

static uint32_t crc_data(const int32_t *tokens, size_t n_tok, const float *payload, size_t n_f) {
    uLong c = crc32_z(0L, Z_NULL, 0);
    c = crc32_z(c, (const Bytef *)tokens, sizeof(int32_t) * n_tok);
    c = crc32_z(c, (const Bytef *)payload, sizeof(float) * n_f);
    return (uint32_t)c;
}

static uint32_t crc_bytes(const void *p, size_t n) {
    return (uint32_t)crc32_z(crc32_z(0L, Z_NULL, 0), (const Bytef *)p, n);
}

static uint32_t crc_header(rec_header *h) {
    uint32_t saved = h->crc_header;
    h->crc_header = 0;
    uint32_t c = (uint32_t)crc32_z(crc32_z(0L, Z_NULL, 0), (const Bytef *)h, sizeof *h);
    h->crc_header = saved;
    return c;
}

// The header of the record of block h (tokens and payload: the layout's sizes).
static void fill_header(rec_header *hd, const di_kv_disk_layout *l, uint64_t h, uint64_t parent,
                        uint64_t salt, int64_t written_s, const int32_t *tokens,
                        const float *payload, const void *snap, size_t snap_bytes) {
    memset(hd, 0, sizeof *hd);
    memcpy(hd->magic, k_magic, sizeof k_magic);
    hd->version = DI_KV_DISK_VERSION;
    hd->header_bytes = HEADER_BYTES;
    hd->model_id = l->model_id;
    hd->precision = l->precision;
    hd->block_tokens = l->block_tokens;
    hd->block_floats = l->block_floats;
    hd->payload_floats = l->payload_floats;
    hd->hash = h;
    hd->parent = parent;
    hd->salt = salt;
    hd->written_s = written_s;
    hd->crc_data = crc_data(tokens, (size_t)l->block_tokens, payload, (size_t)l->payload_floats);
    hd->snap_bytes = snap_bytes;
    if (snap_bytes) hd->crc_snap = crc_bytes(snap, snap_bytes);
    hd->crc_header = crc_header(hd);
}

// Whether a record header is one of layout l; if not, why (static text). The data checksum is the
// caller's.
static di_kv_disk_check check_header(rec_header *hd, const di_kv_disk_layout *l, const char **why) {
    if (memcmp(hd->magic, k_magic, sizeof k_magic) || hd->version != DI_KV_DISK_VERSION ||
        hd->header_bytes != HEADER_BYTES || crc_header(hd) != hd->crc_header) {
        *why = "bad header (magic, version or header checksum)";
        return DI_KV_DISK_CHECK_CORRUPT;
    }
    if (hd->model_id != l->model_id || hd->precision != l->precision) {
        *why = "written for another model (checkpoint, hyper-parameters or precision)";
        return DI_KV_DISK_CHECK_OTHER_MODEL;
    }
    if (hd->block_tokens != l->block_tokens || hd->block_floats != l->block_floats ||
        hd->payload_floats != l->payload_floats) {
        *why = "written for another block layout";
        return DI_KV_DISK_CHECK_CORRUPT;
    }
    return DI_KV_DISK_CHECK_OK;
}

// ---- records in memory ----

size_t di_kv_disk_record_size(const di_kv_disk_layout *l) {
    return HEADER_BYTES + sizeof(int32_t) * (size_t)l->block_tokens +
           sizeof(float) * (size_t)l->payload_floats;
}

void di_kv_disk_record_put(const di_kv_disk_layout *l, uint64_t h, uint64_t parent, uint64_t salt,
                           const int32_t *tokens, const float *payload, void *out) {
    rec_header hd;
    fill_header(&hd, l, h, parent, salt, (int64_t)time(NULL), tokens, payload, NULL, 0);
    unsigned char *o = out;
    const size_t nt = sizeof(int32_t) * (size_t)l->block_tokens;
    memcpy(o, &hd, sizeof hd);
    memcpy(o + HEADER_BYTES, tokens, nt);
    memcpy(o + HEADER_BYTES + nt, payload, sizeof(float) * (size_t)l->payload_floats);
}

di_kv_disk_check di_kv_disk_record_check(const di_kv_disk_layout *l, const void *rec, size_t n,
                                         di_kv_disk_record *out, const char **why) {
    const unsigned char *r = rec;
    rec_header hd;
    if (n < HEADER_BYTES) {
        *why = "truncated record (shorter than its header)";
        return DI_KV_DISK_CHECK_CORRUPT;
    }
    memcpy(&hd, r, sizeof hd);
    const di_kv_disk_check e = check_header(&hd, l, why);
    if (e != DI_KV_DISK_CHECK_OK) return e;
    if (n != di_kv_disk_record_size(l) || hd.snap_bytes != 0) {
        *why = "wrong record size (truncated, trailing bytes, or a tail snapshot section)";
        return DI_KV_DISK_CHECK_CORRUPT;
    }
    const size_t nt = sizeof(int32_t) * (size_t)l->block_tokens;
    uLong c = crc32_z(0L, Z_NULL, 0);
    c = crc32_z(c, (const Bytef *)(r + HEADER_BYTES), nt);
    c = crc32_z(c, (const Bytef *)(r + HEADER_BYTES + nt),
                sizeof(float) * (size_t)l->payload_floats);
    if ((uint32_t)c != hd.crc_data) {
        *why = "payload checksum mismatch";
        return DI_KV_DISK_CHECK_CORRUPT;
    }
    out->hash = hd.hash;
    out->parent = hd.parent;
    out->salt = hd.salt;
    out->tokens = r + HEADER_BYTES;
    out->payload = r + HEADER_BYTES + nt;
    *why = NULL;
    return DI_KV_DISK_CHECK_OK;
}

// Writes every byte of iov[0..n) (adjusting iov on short writes). false on an error.
static bool writev_all(int fd, struct iovec *iov, int n) {
    while (n > 0) {
        ssize_t w = writev(fd, iov, n);
        if (w < 0) {
            if (errno == EINTR) continue;
            return false;
        }
        while (n > 0 && (size_t)w >= iov->iov_len) w -= (ssize_t)iov->iov_len, iov++, n--;
        if (n > 0) {
            iov->iov_base = (char *)iov->iov_base + w;
            iov->iov_len -= (size_t)w;
        }
    }
    return true;
}

// Reads exactly the bytes of iov[0..n); returns the bytes read (short at end of file), -1 error.
static ssize_t readv_all(int fd, struct iovec *iov, int n) {
    ssize_t total = 0;
    while (n > 0) {
        ssize_t r = readv(fd, iov, n);
        if (r < 0) {
            if (errno == EINTR) continue;
            return -1;
        }
        if (r == 0) break;
        total += r;
        while (n > 0 && (size_t)r >= iov->iov_len) r -= (ssize_t)iov->iov_len, iov++, n--;
        if (n > 0) {
            iov->iov_base = (char *)iov->iov_base + r;
            iov->iov_len -= (size_t)r;
        }
    }
    return total;
}

// A failed write (under mu; err: its errno): counted and logged, the block is just not kept.
static void write_error(di_kv_disk *d, const char *what, int err) {
    d->st.n_write_errors++;
    if (d->n_warn < MAX_WARN) {
        d->n_warn++;
        DI_LOG_WARN("kv disk: cannot %s %s: %s (the block is not kept on disk)", what, d->wtmp,
                    strerror(err));
    } else {
        DI_LOG_DEBUG("kv disk: cannot %s %s: %s", what, d->wtmp, strerror(err));
    }
}

di_status di_kv_disk_write(di_kv_disk *d, uint64_t h, uint64_t parent, uint64_t salt,
                           const int32_t *tokens, const float *payload, const void *snap,
                           size_t snap_bytes) {
    if (!snap) snap_bytes = 0;
    if (d->rec_bytes + snap_bytes > d->max_bytes) snap_bytes = 0; // the block alone fits
    const int64_t t0 = mono_us();
    // Index step 1 (under mu): skip, or make room. Only this writer adds records, and readers only
    // remove them, so the room made here is still there at step 2.
    pthread_mutex_lock(&d->mu);
    if (has_locked(d, h)) {
        // The same chain hash, parent and tokens: the same block. Rewritten only to add a
        // snapshot the record lacks.
        const int32_t s = find(d, h);
        if (!snap_bytes || d->bytes[s] > (int64_t)d->rec_bytes) {
            pthread_mutex_unlock(&d->mu);
            return DI_OK;
        }
        delete_record(d, s);
    }
    const int64_t now = now_s(d);
    const size_t need = d->rec_bytes + snap_bytes;
    while (d->st.n_records >= d->cap || (size_t)d->st.n_bytes + need > d->max_bytes) {
        d->st.n_evicted++;
        delete_record(d, d->lru_head);
    }
    pthread_mutex_unlock(&d->mu);
    // The file (no lock: a lookup of h meanwhile misses; the writer's scratch).
    const size_t n_tok = (size_t)d->l.block_tokens, n_f = (size_t)d->l.payload_floats;
    rec_header *hd = d->whdr;
    fill_header(hd, &d->l, h, parent, salt, now, tokens, payload, snap, snap_bytes);
    tmp_path(d, h, d->wtmp, PATH_CAP);
    di_kv_disk_path(d, h, d->wpath, PATH_CAP);
    const char *failed = NULL;
    int err = 0;
    int fd = open(d->wtmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd < 0) {
        failed = "create", err = errno;
    } else {
        struct iovec iov[4] = {{hd, sizeof *hd},
                               {(void *)tokens, sizeof(int32_t) * n_tok},
                               {(void *)payload, sizeof(float) * n_f},
                               {(void *)snap, snap_bytes}};
        const struct timespec ts[2] = {{(time_t)now, 0}, {(time_t)now, 0}};
        bool ok = writev_all(fd, iov, snap_bytes ? 4 : 3);
        if (!ok) failed = "write", err = errno;
        if (ok) (void)futimens(fd, ts); // last use = now (retention reads the mtime at open)
        if (close(fd) != 0 && !failed) failed = "write", err = errno;
        if (!failed && rename(d->wtmp, d->wpath) != 0) failed = "rename", err = errno;
        if (failed) unlink(d->wtmp);
    }
    // Index step 2 (under mu): the complete record, or the error.
    pthread_mutex_lock(&d->mu);
    if (failed) {
        write_error(d, failed, err);
        pthread_mutex_unlock(&d->mu);
        return DI_ERR_IO;
    }
    index_add(d, h, now, (int64_t)need);
    d->st.n_written++;
    d->st.n_snaps_written += snap_bytes > 0;
    d->st.write_us += mono_us() - t0;
    pthread_mutex_unlock(&d->mu);
    return DI_OK;
}

// ---- read ----

size_t di_kv_disk_snap_bytes(di_kv_disk *d, uint64_t h) {
    pthread_mutex_lock(&d->mu);
    const int32_t s = find(d, h);
    const size_t n = s < 0 ? 0 : (size_t)d->bytes[s] - d->rec_bytes;
    pthread_mutex_unlock(&d->mu);
    return n;
}

// di_kv_disk_read under rmu: mu is taken for the lookup and for the verdict only.
static bool read_unlocked(di_kv_disk *d, uint64_t h, uint64_t parent, uint64_t salt,
                          const int32_t *tokens, float *payload, void *snap, size_t snap_bytes,
                          bool *snap_read) {
    if (snap_read) *snap_read = false;
    pthread_mutex_lock(&d->mu);
    if (!has_locked(d, h)) {
        pthread_mutex_unlock(&d->mu);
        return false;
    }
    const int64_t t0 = mono_us(), now = now_s(d);
    di_kv_disk_path(d, h, d->rpath, PATH_CAP);
    pthread_mutex_unlock(&d->mu);
    const size_t n_tok = (size_t)d->l.block_tokens, n_f = (size_t)d->l.payload_floats;
    // The file IO, without mu: a writer may meanwhile evict the record (the open file stays
    // readable) or replace it by rename (this read sees one whole file, old or new).
    const char *why = NULL;
    int fd = open(d->rpath, O_RDONLY | O_CLOEXEC);
    rec_header *hd = d->hdr;
    bool with_snap = false;
    if (fd < 0) {
        why = "cannot open it";
    } else {
        struct stat sb;
        struct iovec iov[3] = {{d->hdr, sizeof *d->hdr},
                               {d->tokens, sizeof(int32_t) * n_tok},
                               {payload, sizeof(float) * n_f}};
        if (fstat(fd, &sb) != 0 || (size_t)sb.st_size < d->rec_bytes)
            why = "wrong size (truncated or not a record of this layout)";
        else if (readv_all(fd, iov, 3) != (ssize_t)d->rec_bytes)
            why = "short read";
        else if (check_header(hd, &d->l, &why) == DI_KV_DISK_CHECK_OK) {
            if ((uint64_t)sb.st_size != d->rec_bytes + hd->snap_bytes)
                why = "wrong size (a truncated tail snapshot section, or trailing bytes)";
            else if (hd->hash != h || hd->parent != parent || hd->salt != salt ||
                     memcmp(d->tokens, tokens, sizeof(int32_t) * n_tok))
                why = "its hash, parent, salt or tokens differ from the lookup's";
            else if (crc_data(d->tokens, n_tok, payload, n_f) != hd->crc_data)
                why = "payload checksum mismatch";
        }
        // The snapshot is read (and verified) when the caller keeps snapshots of its size;
        // otherwise the block is used alone (the snapshot of another forward or speculation
        // setting is ignored).
        if (!why && snap && snap_bytes && hd->snap_bytes == snap_bytes) {
            struct iovec sv = {snap, snap_bytes};
            if (readv_all(fd, &sv, 1) != (ssize_t)snap_bytes)
                why = "short read (tail snapshot)";
            else if (crc_bytes(snap, snap_bytes) != hd->crc_snap)
                why = "tail snapshot checksum mismatch";
            else
                with_snap = true;
        }
        if (!why) {
            const struct timespec ts[2] = {{(time_t)now, 0}, {(time_t)now, 0}};
            (void)futimens(fd, ts); // last use (survives a restart); best effort
        }
        close(fd);
    }
    pthread_mutex_lock(&d->mu);
    // The record may have left the index meanwhile (evicted, or dropped): nothing to update.
    const int32_t s = find(d, h);
    if (why) {
        if (s >= 0) drop(d, s, why);
        pthread_mutex_unlock(&d->mu);
        return false;
    }
    if (s >= 0) {
        d->last_s[s] = now;
        lru_unlink(d, s);
        lru_push(d, s);
    }
    d->st.n_read++;
    d->st.n_snaps_read += with_snap;
    d->st.read_us += mono_us() - t0;
    pthread_mutex_unlock(&d->mu);
    if (snap_read) *snap_read = with_snap;
    return true;
}

bool di_kv_disk_read(di_kv_disk *d, uint64_t h, uint64_t parent, uint64_t salt,
                     const int32_t *tokens, float *payload, void *snap, size_t snap_bytes,
                     bool *snap_read) {
    pthread_mutex_lock(&d->rmu);
    const bool hit =
        read_unlocked(d, h, parent, salt, tokens, payload, snap, snap_bytes, snap_read);
    pthread_mutex_unlock(&d->rmu);
    return hit;
}
