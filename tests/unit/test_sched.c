// Scheduler policy (src/sched/scheduler.c), driven step by step without a forward (an accounting
// KV manager: blocks without memory) on a clock the test sets: the virtual token counter orders
// tenants by the weighted tokens they received, not by their running requests; an idle tenant
// coming back is lifted to the backlogged minimum; aging admits a priority-5 request under a
// steady stream of priority-0 work after its aging interval (never without aging), the aged
// request is not preempted by that stream, and a preempted one keeps its age; the tenant table
// stays bounded over thousands of tenants (recycling idle ones, sharing an overflow entry when
// every entry is backlogged) and the scheduler allocates nothing after init.
#include "harness.h"

#include "base/mem.h"
#include "kv/kv_manager.h"
#include "model/synth.h"
#include "sched/scheduler.h"

static char g_dir[256];
static di_model *g_m;
enum { V = 512, MAX_CTX = 256, MAX_REQ = 1024 };

// A scheduler on an accounting KV manager with blocks for max_seqs full sequences, and the
// requests the test made (finished ones are destroyed; admitted_at: the step of the first
// admission, -1 before).
typedef struct sim {
    di_kv_manager *kv;
    di_sched s;
    int64_t step;
    di_request *req[MAX_REQ];
    int64_t admitted_at[MAX_REQ];
    bool done[MAX_REQ];
    int n_req;
} sim;

static bool sim_init(sim *m, int32_t max_seqs, int32_t max_tenants, int64_t aging_ms) {
    memset(m, 0, sizeof *m);
    const int32_t per_seq = (MAX_CTX + di_kv_block_tokens(g_m) - 1) / di_kv_block_tokens(g_m);
    CHECK_EQ(di_kv_manager_create_accounting(g_m, per_seq * max_seqs, 4096, max_seqs, MAX_CTX,
                                             false, &m->kv),
             DI_OK);
    if (!m->kv) return false;
    CHECK_EQ(di_sched_init(&m->s, m->kv, max_seqs, 64, max_tenants), DI_OK);
    m->s.aging_ms = aging_ms;
    return true;
}

static void sim_deinit(sim *m) {
    for (int i = 0; i < m->n_req; i++)
        if (!m->done[i]) {
            di_sched_remove(&m->s, m->req[i]);
            di_request_destroy(m->req[i]);
        }
    di_sched_deinit(&m->s);
    di_kv_manager_destroy(m->kv);
}

static void ignore_event(void *user, const di_event *ev) {
    (void)user;
    (void)ev;
}

// Steps (at time t) until cond holds, at most 10000 steps (a broken policy fails, not hangs).
#define UNTIL(cond, t)                                                                             \
    for (int n_ = 0; !(cond) && n_ < 10000; n_++) sim_step(&m, t)

// Enqueues a new request (its index): n_prompt distinct tokens, max_tokens to generate.
static int submit(sim *m, int32_t n_prompt, int32_t max_tokens, int32_t priority, uint64_t tenant) {
    int32_t prompt[MAX_CTX];
    const int k = m->n_req;
    for (int32_t t = 0; t < n_prompt; t++) prompt[t] = (k * 131 + t * 7 + 1) % V;
    di_request_params p = di_request_params_default();
    p.prompt = prompt;
    p.n_prompt = n_prompt;
    p.max_tokens = max_tokens;
    p.priority = priority;
    p.tenant = tenant;
    p.on_event = ignore_event; // the scheduler emits nothing; the request needs one
    di_request *r = NULL;
    CHECK_EQ(di_request_create(&p, V, MAX_CTX, false, NULL, NULL, &r), DI_OK);
    if (!r) return -1;
    r->id = r->arrival = (uint64_t)k;
    m->req[k] = r;
    m->admitted_at[k] = -1;
    m->n_req++;
    di_sched_enqueue(&m->s, r);
    return k;
}

// One step at now_ms: plan, run (advance), sample a token for each logit row; a request that
// reached max_tokens leaves. Returns the rows planned.
static int32_t sim_step(sim *m, int64_t now_ms) {
    di_sched *s = &m->s;
    s->now_ms = now_ms;
    di_sched_step(s);
    di_sched_finalize(s);
    di_sched_advance(s);
    for (int i = 0; i < m->n_req; i++)
        if (!m->done[i] && m->req[i]->slot >= 0 && m->admitted_at[i] < 0)
            m->admitted_at[i] = m->step;
    const int32_t rows = s->n_rows;
    for (int32_t k = s->n_logit - 1; k >= 0; k--) { // the last first: removal reorders the rest
        di_request *r = s->logit_req[k];
        r->n_pending = 0;
        r->tokens[di_request_n_tokens(r)] = (int32_t)(r->id % V);
        if (++r->n_gen < r->max_tokens) continue;
        di_sched_remove(s, r);
        m->done[r->id] = true;
        m->req[r->id] = NULL;
        di_request_destroy(r);
    }
    m->step++;
    return rows;
}

// VTC, not running counts: tenant 1 runs one long prompt, tenant 2 three short ones (more
// running requests, far fewer tokens). When tenant 2's first request ends, tenant 2's waiting
// request goes before tenant 1's older one (fewest running requests would take tenant 1's).
static void test_vtc_order(void) {
    sim m;
    if (!sim_init(&m, 4, 16, 0)) return;
    const int a0 = submit(&m, 200, 30, 0, 1);
    const int b0 = submit(&m, 10, 2, 0, 2);
    const int b1 = submit(&m, 10, 30, 0, 2);
    const int b3 = submit(&m, 10, 30, 0, 2);
    // a0 (first come) takes the whole budget for 3 steps, then tenant 2's three fit beside its
    // last chunk.
    for (int n = 0; n < 10 && m.admitted_at[b3] < 0; n++) sim_step(&m, 0);
    CHECK(m.admitted_at[a0] >= 0 && m.admitted_at[b0] >= 0 && m.admitted_at[b1] >= 0 &&
          m.admitted_at[b3] >= 0 && !m.done[b0]);
    const int a1 = submit(&m, 20, 5, 0, 1);
    const int b2 = submit(&m, 20, 5, 0, 2);
    UNTIL(m.done[b0], 0);
    // Charged so far: tenant 1 its 200 prompt tokens and generated ones (weight 2), tenant 2 its
    // three prompts of 10 and theirs.
    const int64_t va = di_sched_tenant_vtc(&m.s, 1), vb = di_sched_tenant_vtc(&m.s, 2);
    fprintf(stderr, "vtc: tenant 1 %lld, tenant 2 %lld\n", (long long)va, (long long)vb);
    CHECK(va >= 200 && vb >= 30 && vb < va);
    sim_step(&m, 0);
    CHECK(m.admitted_at[b2] >= 0);
    CHECK_EQ(m.admitted_at[a1], -1);
    CHECK(di_sched_tenant_vtc(&m.s, 2) >= vb + 20); // its prompt, charged at admission
    UNTIL(m.admitted_at[a1] >= 0, 0);
    CHECK(m.admitted_at[b2] < m.admitted_at[a1]);
    sim_deinit(&m);
}

// The lift rule: tenant 2 is served a little and goes idle; tenant 1 is then served much more
// and stays backlogged (three requests, one slot). Tenant 2 coming back (when the first has
// ended) is lifted to tenant 1's counter, so it does not jump ahead of tenant 1's older waiting
// request (equal counters: the older first); it goes right after it, as that admission charged
// tenant 1 its prompt. Without the lift it would go first.
static void test_vtc_lift(void) {
    sim m;
    if (!sim_init(&m, 1, 16, 0)) return;
    const int b0 = submit(&m, 10, 2, 0, 2);
    UNTIL(m.done[b0], 0);
    const int64_t vb_idle = di_sched_tenant_vtc(&m.s, 2);
    CHECK_EQ(vb_idle, 10 + 2 * DI_SCHED_VTC_W_OUT); // its prompt and its 2 generated tokens
    CHECK_EQ(m.s.n_tenants_live, 0);
    CHECK_EQ(m.s.n_tenants, 1); // remembered while idle
    int a[3];
    for (int i = 0; i < 3; i++) a[i] = submit(&m, 60, 3, 0, 1);
    UNTIL(m.done[a[0]], 0); // the slot is free, a[1] and a[2] wait: nothing charges meanwhile
    const int64_t va = di_sched_tenant_vtc(&m.s, 1);
    CHECK(va > 3 * vb_idle);
    const int b1 = submit(&m, 10, 2, 0, 2);
    CHECK_EQ(di_sched_tenant_vtc(&m.s, 2), va); // lifted to the backlogged minimum
    UNTIL(m.done[a[2]], 0);
    fprintf(stderr, "lift: admitted at steps %lld %lld, tenant 2 at %lld, then %lld\n",
            (long long)m.admitted_at[a[0]], (long long)m.admitted_at[a[1]],
            (long long)m.admitted_at[b1], (long long)m.admitted_at[a[2]]);
    CHECK(m.admitted_at[a[1]] < m.admitted_at[b1]);
    CHECK(m.admitted_at[b1] < m.admitted_at[a[2]]);
    sim_deinit(&m);
}

// Aging: one slot, a priority-5 request L enqueued at t = 0 and a steady stream of priority-0
// requests (one more enqueued whenever one is admitted, so one always waits), 100 ms a step,
// aging 1 s. L's effective priority reaches the stream's 0 at t = 5 s and, older, it is admitted
// then; it runs with that priority, so the stream does not preempt it. Then a priority -5
// request preempts it, and L, still old, is admitted again before the stream. Without aging L
// waits as long as the stream flows.
static int64_t stream(sim *m, int l, int64_t t_end, int64_t *t) {
    int waiting = submit(m, 8, 3, 0, 1);
    for (; *t < t_end && m->admitted_at[l] < 0; *t += 100) {
        sim_step(m, *t);
        if (m->admitted_at[waiting] >= 0) waiting = submit(m, 8, 3, 0, 1);
    }
    return m->admitted_at[l] >= 0 ? *t - 100 : -1; // the time of the step that admitted it
}

static void test_aging(void) {
    sim m;
    if (!sim_init(&m, 1, 16, 1000)) return;
    int64_t t = 0;
    const int l = submit(&m, 8, 20, 5, 1);
    CHECK_EQ(di_sched_effective_priority(&m.s, m.req[l]), 5);
    const int64_t t_in = stream(&m, l, 60000, &t);
    fprintf(stderr, "aging 1 s: the priority-5 request admitted at t = %lld ms\n", (long long)t_in);
    // Admitted once it reached 0 (t >= 5 s), as soon as the running stream request ended (3
    // steps at most).
    CHECK(t_in >= 5000 && t_in <= 5400);
    CHECK_EQ(m.req[l]->run_priority, 0);
    // The stream (fresh priority 0) does not preempt it: it runs to its end among them.
    const int64_t pre = m.s.n_priority_preemptions;
    for (int i = 0; i < 5; i++, t += 100) sim_step(&m, t);
    CHECK_EQ(m.s.n_priority_preemptions, pre);
    CHECK_EQ(m.req[l]->n_preempted, 0);
    CHECK(m.req[l]->n_gen > 0);
    // A priority -5 request preempts it (its aged priority is about -1); it keeps its age and
    // is admitted again before the priority-0 stream once -5 is done.
    const int64_t enq = m.req[l]->enqueue_ms;
    const int hi = submit(&m, 8, 3, -5, 2);
    sim_step(&m, t);
    t += 100;
    CHECK_EQ(m.s.n_priority_preemptions, pre + 1);
    CHECK_EQ(m.req[l]->n_preempted, 1);
    CHECK(m.admitted_at[hi] >= 0);
    CHECK_EQ(m.req[l]->enqueue_ms, enq);
    const int s1 = submit(&m, 8, 3, 0, 1);
    for (int n = 0; n < 100 && !m.done[hi]; n++, t += 100) sim_step(&m, t);
    sim_step(&m, t);
    CHECK(m.req[l]->slot >= 0);
    CHECK_EQ(m.admitted_at[s1], -1);
    sim_deinit(&m);

    // Without aging: a minute of stream, and it still waits; it runs once the stream stops.
    if (!sim_init(&m, 1, 16, 0)) return;
    t = 0;
    const int l0 = submit(&m, 8, 20, 5, 1);
    CHECK_EQ(stream(&m, l0, 60000, &t), -1);
    CHECK_EQ(di_sched_effective_priority(&m.s, m.req[l0]), 5);
    for (int i = 0; i < 10; i++, t += 100) sim_step(&m, t);
    CHECK(m.admitted_at[l0] >= 0);
    sim_deinit(&m);
}

// Priority preemption compares with running requests aged to now: one slot, a priority-0
// request admitted at once and still running after 3 aging intervals is not preempted by a
// priority-0 request that has waited 2 of them (its effective -2 would beat a frozen 0).
static void test_no_aging_cascade(void) {
    sim m;
    if (!sim_init(&m, 1, 16, 1000)) return;
    const int r0 = submit(&m, 8, 50, 0, 1);
    sim_step(&m, 0);
    m.s.now_ms = 1000;
    const int r1 = submit(&m, 8, 3, 0, 2);
    int64_t t = 1000;
    for (; t <= 3500; t += 100) sim_step(&m, t);
    CHECK_EQ(di_sched_effective_priority(&m.s, m.req[r1]), -2);
    CHECK_EQ(m.s.n_priority_preemptions, 0);
    CHECK_EQ(m.req[r0]->n_preempted, 0);
    CHECK_EQ(m.admitted_at[r1], -1);
    sim_deinit(&m);
}

// Bounded tenant table: 2000 distinct tenants, one request each, over time (two slots, eight
// entries): never more than eight entries, no overflow, every request served; the most recently
// idle tenants are remembered, older ones recycled. Then twelve tenants backlogged at once: four
// share the overflow entry, all are served, and the table is consistent afterwards. Nothing is
// allocated by the scheduler after init.
static void test_tenant_table_bounded(void) {
    sim m;
    if (!sim_init(&m, 2, 8, 0)) return;
    int64_t allocs = 0;
    int served = 0;
    for (int k = 0; k < 2000; k++) {
        if (m.n_req == MAX_REQ) { // reuse the request records (all done by now)
            for (int i = 0; i < m.n_req; i++) CHECK(m.done[i]);
            m.n_req = 0;
            memset(m.done, 0, sizeof m.done);
        }
        const int i = submit(&m, 5, 2, 0, 1000 + (uint64_t)k);
        const int64_t a0 = di_mem_thread_allocs();
        UNTIL(m.done[i], 0);
        allocs += di_mem_thread_allocs() - a0;
        served++;
        CHECK(m.s.n_tenants <= 8);
    }
    CHECK_EQ(served, 2000);
    CHECK_EQ(m.s.n_tenants, 8);
    CHECK_EQ(m.s.n_tenants_live, 0);
    CHECK_EQ(m.s.n_tenant_overflows, 0);
    for (int k = 1992; k < 2000; k++) CHECK(di_sched_tenant_vtc(&m.s, 1000 + (uint64_t)k) > 0);
    CHECK_EQ(di_sched_tenant_vtc(&m.s, 1000 + 1991), -1);
    CHECK_EQ(di_sched_tenant_vtc(&m.s, 1000), -1);
    // Twelve tenants backlogged at once.
    m.n_req = 0;
    memset(m.done, 0, sizeof m.done);
    for (int k = 0; k < 12; k++) submit(&m, 5, 2, 0, 5000 + (uint64_t)k);
    CHECK_EQ(m.s.n_tenant_overflows, 4);
    CHECK_EQ(m.s.n_tenants_live, 9); // eight entries and the shared one
    const int64_t a0 = di_mem_thread_allocs();
    for (int n = 0; n < 100 && m.s.n_waiting + m.s.n_running > 0; n++) sim_step(&m, 0);
    allocs += di_mem_thread_allocs() - a0;
    for (int k = 0; k < 12; k++) CHECK(m.done[k]);
    CHECK_EQ(m.s.n_tenants_live, 0);
    CHECK_EQ(m.s.n_tenants, 8);
    for (int k = 0; k < 8; k++) CHECK(di_sched_tenant_vtc(&m.s, 5000 + (uint64_t)k) > 0);
    CHECK_EQ(di_sched_tenant_vtc(&m.s, 5000 + 8), -1);
    CHECK_EQ(allocs, 0);
    // Back to normal: a new tenant takes a recycled entry.
    const int i = submit(&m, 5, 2, 0, 7);
    CHECK_EQ(m.s.n_tenant_overflows, 4);
    UNTIL(m.done[i], 0);
    CHECK(di_sched_tenant_vtc(&m.s, 7) > 0);
    sim_deinit(&m);
}

int main(void) {
    snprintf(g_dir, sizeof g_dir, "/tmp/di_test_sched_XXXXXX");
    if (!mkdtemp(g_dir)) return 1;
    di_synth_config c;
    CHECK(di_synth_preset("tiny", &c) == DI_OK);
    c.n_vocab = V;
    CHECK(di_synth_write(&c, g_dir) == DI_OK);
    di_model_options mo = di_model_options_default();
    mo.n_threads = 1;
    CHECK(di_model_load(g_dir, &mo, &g_m) == DI_OK);
    di_set_log_level(1);
    if (g_m) {
        RUN(test_vtc_order);
        RUN(test_vtc_lift);
        RUN(test_aging);
        RUN(test_no_aging_cascade);
        RUN(test_tenant_table_bounded);
    }
    di_model_destroy(g_m);
    di_test_remove_dir(g_dir);
    return test_finish();
}
