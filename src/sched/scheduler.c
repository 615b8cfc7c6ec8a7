// scheduler — admission, token budget, chunked prefill, preemption by recompute (scheduler.h).
#include "sched/scheduler.h"

#include <string.h>
#include <time.h> // clock_gettime: how long requests wait for their disk prefetch

#include "base/log.h"
#include "base/mem.h"

di_status di_sched_init(di_sched *s, di_kv_manager *kv, int32_t max_seqs, int32_t max_batch_tokens,
                        int32_t max_tenants) {
    memset(s, 0, sizeof *s);
    if (max_seqs < 1 || max_batch_tokens < max_seqs || max_seqs > kv->max_seqs || max_tenants < 1 ||
        max_tenants > (1 << 28))
        return DI_ERR_INVALID;
    s->kv = kv;
    s->max_seqs = max_seqs;
    s->max_batch_tokens = max_batch_tokens;
    size_t n = (size_t)max_seqs;
    s->running = di_calloc(n, sizeof *s->running);
    s->free_slots = di_malloc(sizeof(int32_t) * n);
    s->seqs = di_calloc(n, sizeof *s->seqs);
    s->seq_req = di_calloc(n, sizeof *s->seq_req);
    s->tokens = di_malloc(sizeof(int32_t) * (size_t)max_batch_tokens);
    s->logit_rows = di_malloc(sizeof(int32_t) * n);
    s->logit_req = di_calloc(n, sizeof *s->logit_req);
    s->max_tenants = max_tenants;
    s->tenant_hash_cap = 2;
    while (s->tenant_hash_cap < 2 * max_tenants) s->tenant_hash_cap *= 2;
    s->tenants = di_calloc((size_t)max_tenants + 1, sizeof *s->tenants);
    s->tenant_hash = di_malloc(sizeof(int32_t) * (size_t)s->tenant_hash_cap);
    if (!s->running || !s->free_slots || !s->seqs || !s->seq_req || !s->tokens || !s->logit_rows ||
        !s->logit_req || !s->tenants || !s->tenant_hash) {
        di_sched_deinit(s);
        return DI_ERR_NOMEM;
    }
    for (int32_t i = 0; i < max_seqs; i++) s->free_slots[i] = max_seqs - 1 - i;
    s->n_free_slots = max_seqs;
    for (int32_t i = 0; i < s->tenant_hash_cap; i++) s->tenant_hash[i] = -1;
    s->idle_head = s->idle_tail = -1;
    return DI_OK;
}

void di_sched_deinit(di_sched *s) {
    di_free(s->running);
    di_free(s->free_slots);
    di_free(s->seqs);
    di_free(s->seq_req);
    di_free(s->tokens);
    di_free(s->logit_rows);
    di_free(s->logit_req);
    di_free(s->tenants);
    di_free(s->tenant_hash);
    memset(s, 0, sizeof *s);
}

// ---- fair share: the tenant table and virtual token counters ----

static uint32_t tenant_home(const di_sched *s, uint64_t key) {
    return (uint32_t)((key * 0x9e3779b97f4a7c15ull) >> 32) & (uint32_t)(s->tenant_hash_cap - 1);
}

// The hash cell holding key, or the empty cell where the probe ended.
static uint32_t tenant_cell(const di_sched *s, uint64_t key) {
    const uint32_t mask = (uint32_t)(s->tenant_hash_cap - 1);
    uint32_t i = tenant_home(s, key);
    while (s->tenant_hash[i] >= 0 && s->tenants[s->tenant_hash[i]].key != key) i = (i + 1) & mask;
    return i;
}

// Empties hash cell i, moving later entries of its probe run back (linear probing has no
// tombstones, so lookups stay short however many tenants came and went).
static void tenant_unhash(di_sched *s, uint32_t i) {
    const uint32_t mask = (uint32_t)(s->tenant_hash_cap - 1);
    for (uint32_t j = i;;) {
        j = (j + 1) & mask;
        if (s->tenant_hash[j] < 0) break;
        const uint32_t k = tenant_home(s, s->tenants[s->tenant_hash[j]].key);
        // The entry at j stays when its home lies cyclically in (i, j].
        if (i <= j ? (i < k && k <= j) : (i < k || k <= j)) continue;
        s->tenant_hash[i] = s->tenant_hash[j];
        i = j;
    }
    s->tenant_hash[i] = -1;
}

static void idle_unlink(di_sched *s, int32_t t) {
    di_sched_tenant *e = &s->tenants[t];
    if (e->idle_prev >= 0)
        s->tenants[e->idle_prev].idle_next = e->idle_next;
    else
        s->idle_head = e->idle_next;
    if (e->idle_next >= 0)
        s->tenants[e->idle_next].idle_prev = e->idle_prev;
    else
        s->idle_tail = e->idle_prev;
}

// The entry of tenant key, made (a never used entry, else the least recently idle one is
// recycled, else the shared overflow entry) when the table does not hold it.
static int32_t tenant_entry(di_sched *s, uint64_t key) {
    uint32_t cell = tenant_cell(s, key);
    if (s->tenant_hash[cell] >= 0) return s->tenant_hash[cell];
    int32_t t;
    if (s->n_tenants < s->max_tenants) {
        t = s->n_tenants++;
    } else if (s->idle_head >= 0) { // forget the least recently idle tenant
        t = s->idle_head;
        idle_unlink(s, t);
        tenant_unhash(s, tenant_cell(s, s->tenants[t].key));
        cell = tenant_cell(s, key); // the deletion may have moved the probe's end
    } else {                        // every entry is backlogged: share the overflow entry
        s->n_tenant_overflows++;
        return s->max_tenants;
    }
    s->tenants[t] = (di_sched_tenant){.key = key, .idle_prev = -1, .idle_next = -1};
    s->tenant_hash[cell] = t;
    return t;
}

// r's tenant gets one more backlogged request. A tenant that was idle (or new) is lifted to the
// smallest counter of the backlogged tenants (the VTC rule: idle time banks no credit), or to
// that of the last tenant to go idle when none is backlogged.
static void tenant_join(di_sched *s, di_request *r) {
    const int32_t t = tenant_entry(s, r->tenant);
    di_sched_tenant *e = &s->tenants[t];
    r->tenant_idx = t;
    if (e->n_live++ > 0) return;
    if (t < s->max_tenants && (e->idle_prev >= 0 || s->idle_head == t)) idle_unlink(s, t);
    int64_t lift = s->vtc_last_idle;
    bool any = false;
    for (int32_t i = 0; i <= s->n_tenants; i++) { // the used entries, then the overflow one
        const di_sched_tenant *o = &s->tenants[i < s->n_tenants ? i : s->max_tenants];
        if (o == e || o->n_live == 0 || (any && o->vtc >= lift)) continue;
        lift = o->vtc;
        any = true;
    }
    if (e->vtc < lift) e->vtc = lift;
    s->n_tenants_live++;
}

// r left the scheduler: its tenant may become idle (remembered, most recently idle last).
static void tenant_leave(di_sched *s, const di_request *r) {
    const int32_t t = r->tenant_idx;
    di_sched_tenant *e = &s->tenants[t];
    if (--e->n_live > 0) return;
    s->n_tenants_live--;
    s->vtc_last_idle = e->vtc;
    if (t == s->max_tenants) return; // the overflow entry is never recycled
    e->idle_prev = s->idle_tail;
    e->idle_next = -1;
    if (s->idle_tail >= 0)
        s->tenants[s->idle_tail].idle_next = t;
    else
        s->idle_head = t;
    s->idle_tail = t;
}

// Charges r's tenant for positions [r->n_charged, end) not charged before: prompt positions
// weight 1, generated tokens DI_SCHED_VTC_W_OUT.
static void charge(di_sched *s, di_request *r, int32_t end) {
    if (end <= r->n_charged) return;
    const int32_t p = r->n_prompt;
    const int32_t lo = r->n_charged, mid = lo < p ? (end < p ? end : p) : lo;
    s->tenants[r->tenant_idx].vtc +=
        (int64_t)(mid - lo) + (int64_t)(end - mid) * DI_SCHED_VTC_W_OUT;
    r->n_charged = end;
}

int64_t di_sched_tenant_vtc(const di_sched *s, uint64_t key) {
    const int32_t t = s->tenant_hash[tenant_cell(s, key)];
    return t >= 0 ? s->tenants[t].vtc : -1;
}

// ---- aging ----

int32_t di_sched_effective_priority(const di_sched *s, const di_request *r) {
    if (s->aging_ms <= 0 || s->now_ms <= r->enqueue_ms) return r->priority;
    const int64_t p = (int64_t)r->priority - (s->now_ms - r->enqueue_ms) / s->aging_ms;
    return p < INT32_MIN ? INT32_MIN : (int32_t)p;
}

// ---- queues ----

void di_sched_enqueue(di_sched *s, di_request *r) {
    r->enqueue_ms = s->now_ms;
    tenant_join(s, r);
    r->next = NULL;
    if (s->wait_tail)
        s->wait_tail->next = r;
    else
        s->wait_head = r;
    s->wait_tail = r;
    s->n_waiting++;
}

static void push_front(di_sched *s, di_request *r) {
    r->next = s->wait_head;
    s->wait_head = r;
    if (!s->wait_tail) s->wait_tail = r;
    s->n_waiting++;
}

// Running order: the better run priority first, then the older.
static bool runs_before(const di_request *a, const di_request *b) {
    return a->run_priority != b->run_priority ? a->run_priority < b->run_priority
                                              : a->arrival < b->arrival;
}

// The waiting request to admit next: the lowest effective priority, then the tenant with the
// smallest virtual token counter, then the oldest. NULL when none waits.
static di_request *best_waiting(const di_sched *s) {
    di_request *best = NULL;
    int32_t best_p = 0;
    int64_t best_c = 0;
    for (di_request *r = s->wait_head; r; r = r->next) {
        if (r->disk_skip) continue;
        const int32_t p = di_sched_effective_priority(s, r);
        const int64_t c = s->tenants[r->tenant_idx].vtc;
        if (!best || p < best_p ||
            (p == best_p && (c < best_c || (c == best_c && r->arrival < best->arrival)))) {
            best = r;
            best_p = p;
            best_c = c;
        }
    }
    return best;
}

static int64_t mono_us(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000 + ts.tv_nsec / 1000;
}

// The best waiting request that can be attached now. One whose prompt continues on disk waits
// (skipped by this plan) while its prefetch runs (started here when a prefetch is free;
// kv_manager.h, di_kv_prefetch): the others are admitted meanwhile, in the same order.
static di_request *next_ready(di_sched *s) {
    for (;;) {
        di_request *r = best_waiting(s);
        if (!r) return NULL;
        if (di_kv_prefetch(s->kv, r->id, r->salt, r->tokens, di_request_n_tokens(r) - 1) ==
            DI_KV_PREFETCH_READY)
            return r;
        r->disk_skip = true;
        s->n_disk_skipped++;
        if (!r->disk_wait_since_us) r->disk_wait_since_us = mono_us();
    }
}

static void unlink_waiting(di_sched *s, di_request *r) {
    di_request **link = &s->wait_head, *prev = NULL;
    while (*link && *link != r) prev = *link, link = &(*link)->next;
    DI_ASSERT(*link);
    *link = r->next;
    if (s->wait_tail == r) s->wait_tail = prev;
    s->n_waiting--;
}

static void release(di_sched *s, di_request *r) {
    di_kv_seq_close(s->kv, r->slot);
    s->free_slots[s->n_free_slots++] = r->slot;
    r->slot = -1;
    for (int32_t i = 0; i < s->n_running; i++) {
        if (s->running[i] != r) continue;
        memmove(s->running + i, s->running + i + 1,
                sizeof(*s->running) * (size_t)(s->n_running - i - 1));
        s->n_running--;
        return;
    }
    DI_ASSERT(false);
}

// Removes r's rows from the current plan, keeping the others in order.
static void drop_rows(di_sched *s, di_request *r) {
    int32_t row = 0, k = 0;
    for (int32_t i = 0; i < s->n_seq; i++) {
        int32_t n = s->seqs[i].n_tok;
        if (s->seq_req[i] != r) {
            row += n;
            continue;
        }
        memmove(s->tokens + row, s->tokens + row + n,
                sizeof(int32_t) * (size_t)(s->n_rows - row - n));
        memmove(s->seqs + i, s->seqs + i + 1, sizeof(*s->seqs) * (size_t)(s->n_seq - i - 1));
        memmove(s->seq_req + i, s->seq_req + i + 1,
                sizeof(*s->seq_req) * (size_t)(s->n_seq - i - 1));
        s->n_seq--;
        s->n_rows -= n;
        for (int32_t j = 0; j < s->n_logit; j++) {
            if (s->logit_req[j] == r) continue;
            s->logit_rows[k] =
                s->logit_rows[j] >= row + n ? s->logit_rows[j] - n : s->logit_rows[j];
            s->logit_req[k++] = s->logit_req[j];
        }
        s->n_logit = k;
        return;
    }
}

void di_sched_remove(di_sched *s, di_request *r) {
    drop_rows(s, r);
    // Its generated tokens not fed back (the last one at least) were served too.
    if (r->slot >= 0) charge(s, r, di_request_n_tokens(r));
    tenant_leave(s, r);
    di_kv_prefetch_drop(s->kv, r->id); // its prefetch, if one runs or waits for it
    if (r->slot >= 0) {
        release(s, r);
        return;
    }
    for (di_request *w = s->wait_head; w; w = w->next)
        if (w == r) {
            unlink_waiting(s, r);
            return;
        }
}

// Preemption by recompute: the request keeps its tokens and starts over from position 0 when
// readmitted (its published blocks usually come back from the prefix cache).
static void preempt(di_sched *s, di_request *r) {
    release(s, r);
    r->n_done = 0;
    r->win_lo = 0;
    r->n_preempted++;
    s->n_preemptions++;
    push_front(s, r);
}

void di_sched_preempt(di_sched *s, di_request *r) {
    DI_ASSERT(r->slot >= 0);
    drop_rows(s, r);
    preempt(s, r);
    s->aborted = true;
}

// ---- planning ----

static void plan_rows(di_sched *s, di_request *r, int32_t n) {
    di_dsv4_seq *sq = &s->seqs[s->n_seq];
    *sq = (di_dsv4_seq){
        .layers = s->kv->seqs[r->slot].layers, .pos = r->n_done, .n_tok = n, .win_lo = r->win_lo};
    s->seq_req[s->n_seq++] = r;
    // The pending token (being sampled by the step in flight) gets a placeholder.
    int32_t known = di_request_n_tokens(r) - r->n_done;
    if (known > n) known = n;
    memcpy(s->tokens + s->n_rows, r->tokens + r->n_done, sizeof(int32_t) * (size_t)known);
    for (int32_t i = known; i < n; i++) s->tokens[s->n_rows + i] = -1;
    s->n_rows += n;
    if (r->n_done + n == di_request_n_planned(r)) { // its last known token: sample the next
        s->logit_rows[s->n_logit] = s->n_rows - 1;
        s->logit_req[s->n_logit++] = r;
    }
}

// Grows r's blocks for n more rows, preempting the newest running requests if needed. Returns
// false if r itself was preempted.
static bool reserve(di_sched *s, di_request *r, int32_t n) {
    while (di_kv_seq_reserve(s->kv, r->slot, r->n_done + n) != DI_OK) {
        if (s->ahead) { // preempting would free state the running forward uses
            s->aborted = true;
            return false;
        }
        di_request *victim = s->running[s->n_running - 1];
        preempt(s, victim);
        if (victim == r) return false;
    }
    return true;
}

static void step_once(di_sched *s);

int32_t di_sched_snap_points(const di_sched *s, const di_request *r, int32_t *out) {
    if (!s->kv->tails || !s->restore) return 0;
    const int32_t B = s->kv->block_tokens;
    const int32_t last = (r->n_prompt - 1) / B * B;
    // Below a replayed hit the window rows are not exact yet (the replay's proof holds at the hit).
    const int32_t lo = r->win_lo > 0 ? r->replay_end : 0;
    int32_t n = 0;
    for (int32_t i = 0; i < r->n_snap_at; i++) {
        const int32_t p = r->snap_at[i] / B * B;
        if (p > 0 && p < last && p >= lo && (n == 0 || out[n - 1] != p)) out[n++] = p;
    }
    if (last > 0 && last >= lo) out[n++] = last;
    return n;
}

bool di_sched_is_snap_point(const di_sched *s, const di_request *r, int32_t pos) {
    int32_t pts[DI_SCHED_MAX_SNAP];
    const int32_t n = di_sched_snap_points(s, r, pts);
    for (int32_t i = 0; i < n; i++)
        if (pts[i] == pos) return true;
    return false;
}

// A chunk of n rows from r->n_done ends at r's first snapshot point it would cross.
static int32_t cut_at_snap(const di_sched *s, const di_request *r, int32_t n) {
    int32_t pts[DI_SCHED_MAX_SNAP];
    const int32_t k = di_sched_snap_points(s, r, pts);
    for (int32_t i = 0; i < k; i++)
        if (r->n_done < pts[i] && r->n_done + n > pts[i]) return pts[i] - r->n_done;
    return n;
}

void di_sched_step(di_sched *s) {
    s->ahead = s->aborted = false;
    step_once(s);
    // Nothing could run although requests are running: they all wait for blocks. Preempt the
    // newest and plan again (each round frees a request's blocks, so this ends).
    while (s->n_seq == 0 && s->n_running > 0) {
        preempt(s, s->running[s->n_running - 1]);
        step_once(s);
    }
}

void di_sched_step_ahead(di_sched *s) {
    s->ahead = true;
    s->aborted = false;
    step_once(s);
    if (s->n_seq == 0) s->aborted = true; // plan again once the step is sampled
    s->ahead = false;
}

void di_sched_finalize(di_sched *s) {
    DI_ASSERT(!s->aborted);
    int32_t row = 0;
    for (int32_t i = 0; i < s->n_seq; i++) {
        di_request *r = s->seq_req[i];
        int32_t n = s->seqs[i].n_tok;
        DI_ASSERT(r->n_pending == 0 && s->seqs[i].pos + n <= di_request_n_tokens(r));
        memcpy(s->tokens + row, r->tokens + s->seqs[i].pos, sizeof(int32_t) * (size_t)n);
        di_kv_seq_commit(s->kv, r->slot);
        row += n;
    }
}

// A decode that ends by length when the step in flight is sampled: not planned ahead.
static bool ends_by_length(const di_sched *s, const di_request *r) {
    return r->n_pending &&
           (r->n_gen + 1 >= r->max_tokens || di_request_n_planned(r) >= s->kv->max_ctx);
}

// Blocks r's first chunk of at most budget rows needs (those its done prefetch holds for it
// count as free: they are its own).
static bool room_for(const di_sched *s, const di_request *r, int32_t budget) {
    const int32_t n_tok = di_request_n_tokens(r);
    const int32_t need = di_kv_blocks_for(s->kv, budget < n_tok ? budget : n_tok);
    // Held blocks stand in for entry blocks only: the tail blocks are always fresh.
    int32_t held = di_kv_prefetch_held(s->kv, r->id);
    if (held > need - s->kv->n_tail) held = need - s->kv->n_tail;
    return di_block_pool_n_available(s->kv->pool) + held >= need;
}

// The best waiting request finds no slot or no blocks while running requests of a worse priority
// (aged to now: scheduler.h) hold them: those are preempted, last (newest of the worst run
// priority) first, until it fits. Planning ahead cannot preempt: the plan is abandoned (false)
// and made again synchronously.
static bool preempt_for_priority(di_sched *s) {
    di_request *w = next_ready(s);
    const int32_t wp = w ? di_sched_effective_priority(s, w) : 0;
    while (w && s->n_running > 0 &&
           di_sched_effective_priority(s, s->running[s->n_running - 1]) > wp &&
           (s->n_free_slots == 0 || !room_for(s, w, s->max_batch_tokens))) {
        if (s->ahead) {
            s->aborted = true;
            return false;
        }
        preempt(s, s->running[s->n_running - 1]);
        s->n_priority_preemptions++;
    }
    return true;
}

static void step_once(di_sched *s) {
    s->n_seq = s->n_rows = s->n_logit = 0;
    int32_t budget = s->max_batch_tokens;
    s->n_disk_skipped = 0;
    for (di_request *w = s->wait_head; w; w = w->next) w->disk_skip = false;
    if (s->wait_head && !preempt_for_priority(s)) return;
    // 1. decodes, in running order (best priority, then oldest, first).
    for (int32_t i = 0; i < s->n_running; i++) {
        di_request *r = s->running[i];
        if (di_request_n_planned(r) - r->n_done != 1 || ends_by_length(s, r)) continue;
        if (!reserve(s, r, 1)) {
            if (s->aborted) return;
            i = -1; // the running set changed: restart, skipping those already planned
            s->n_seq = s->n_rows = s->n_logit = 0;
            budget = s->max_batch_tokens;
            continue;
        }
        bool planned = false;
        for (int32_t k = 0; k < s->n_seq; k++) planned |= s->seq_req[k] == r;
        if (planned) continue;
        plan_rows(s, r, 1);
        budget--;
    }
    // 2. prefill / replay chunks of running requests, cut to the blocks there are (no
    // preemption here: a newer request may already be planned).
    for (int32_t i = 0; i < s->n_running && budget > 0; i++) {
        di_request *r = s->running[i];
        int32_t left = di_request_n_planned(r) - r->n_done;
        if (left <= 1) continue;
        int32_t n = cut_at_snap(s, r, left < budget ? left : budget);
        (void)di_kv_seq_reserve(s->kv, r->slot, r->n_done + n);
        int32_t cover = s->kv->seqs[r->slot].n_blocks * s->kv->block_tokens - r->n_done;
        if (cover < n) n = cover;
        if (n <= 0) continue;
        plan_rows(s, r, n);
        budget -= n;
    }
    // 3. admission, best first (effective priority, fair share, arrival).
    while (s->wait_head && s->n_free_slots > 0 && budget > 0) {
        di_request *r = next_ready(s);
        if (!r) break; // every waiting request waits for a disk prefetch
        int32_t n_tok = di_request_n_tokens(r);
        int32_t slot = s->free_slots[s->n_free_slots - 1];
        if (!room_for(s, r, budget) || di_kv_seq_open(s->kv, slot, r->salt) != DI_OK) {
            // Nothing runs (so nothing frees blocks) and the prefetches of requests behind r
            // hold some: they yield them to r, which is tried again.
            if (s->n_running == 0 && s->n_seq == 0 && di_kv_prefetch_yield(s->kv, r->id) > 0)
                continue;
            break;
        }
        s->n_free_slots--;
        unlink_waiting(s, r);
        r->run_priority = di_sched_effective_priority(s, r);
        r->slot = slot;
        int32_t hit = di_kv_seq_attach_prefix(s->kv, slot, r->id, r->tokens, n_tok - 1);
        if (r->disk_wait_since_us) { // it waited for its prefetch
            s->n_disk_waits++;
            s->disk_wait_us += mono_us() - r->disk_wait_since_us;
            r->disk_wait_since_us = 0;
        }
        int32_t q = hit > s->kv->replay_tokens ? hit - s->kv->replay_tokens : 0;
        r->win_lo = q;
        r->replay_end = hit;
        // A tail snapshot at a boundary sp of the hit holds the whole state there: compute
        // sp .. hit - 1 only (none at sp == hit), every window row available (win_lo 0).
        int32_t sp = 0;
        const uint8_t *snap = s->restore ? di_kv_tail_best(s->kv, slot, hit, &sp) : NULL;
        if (snap && s->restore(s->restore_user, r, sp, snap)) {
            q = sp;
            r->win_lo = 0;
            s->n_tail_restores++;
        }
        r->n_done = q;
        // The prompt is charged now, so that the next admission of this plan sees it; cached
        // positions are free (replayed ones too: the replay is the cache's cost).
        if (r->n_charged < hit) r->n_charged = hit;
        charge(s, r, r->n_charged > r->n_prompt ? r->n_charged : r->n_prompt);
        r->n_cached += hit;
        r->n_replayed += hit - q;
        s->n_cache_hit_tokens += hit;
        s->n_replayed_tokens += hit - q;
        // Insert in running order (a preempted request is older than the running newer ones).
        int32_t at = s->n_running;
        while (at > 0 && runs_before(r, s->running[at - 1])) at--;
        memmove(s->running + at + 1, s->running + at,
                sizeof(*s->running) * (size_t)(s->n_running - at));
        s->running[at] = r;
        s->n_running++;
        int32_t left = n_tok - r->n_done;
        int32_t n = cut_at_snap(s, r, left < budget ? left : budget);
        if (di_kv_seq_reserve(s->kv, slot, r->n_done + n) != DI_OK) {
            preempt(s, r);      // blocks ran out after all; try again later
            s->n_preemptions--; // not a real preemption: nothing was computed
            r->n_preempted--;
            break;
        }
        plan_rows(s, r, n);
        budget -= n;
    }
}

void di_sched_advance(di_sched *s) {
    for (int32_t k = 0; k < s->n_logit; k++) s->logit_req[k]->n_pending = 1;
    for (int32_t i = 0; i < s->n_seq; i++) {
        di_request *r = s->seq_req[i];
        int32_t n = s->seqs[i].n_tok;
        bool decode = di_request_n_tokens(r) - r->n_done == 1 && n == 1 && r->n_gen > 0 &&
                      r->n_done >= r->n_prompt;
        if (decode)
            s->n_decode_rows += n;
        else
            s->n_prefill_rows += n;
        r->n_done += n;
        r->n_computed += n;
        charge(s, r, r->n_done); // generated tokens as their positions are computed
        di_kv_seq_publish(s->kv, r->slot, r->tokens, r->n_done);
    }
}
