// routes — the endpoint table (spec §2.1): generation endpoints of the three APIs, models,
// health, readiness and Prometheus metrics; authentication, admission (429/503) and the
// JSON-parse step of validation.
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "server/server.h"

// ---- metrics ----

static const double k_buckets[SRV_N_BUCKETS] = {0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08,
                                                0.1,   0.25,  0.5,  1.0,  2.5,  5.0,  10.0};

void srv_metrics_observe(srv_hist *h, double v) {
    int i = 0;
    while (i < SRV_N_BUCKETS && v > k_buckets[i]) i++;
    h->counts[i]++;
    h->sum += v;
    h->n++;
}

void srv_metrics_status(srv *s, int status) {
    pthread_mutex_lock(&s->metrics_mu);
    int k = status / 100;
    if (k >= 1 && k <= 5) s->n_status[k]++;
    pthread_mutex_unlock(&s->metrics_mu);
}

static void hist(sb *b, const char *name, const char *help, const srv_hist *h, const char *m) {
    sb_addf(b, "# HELP %s %s\n# TYPE %s histogram\n", name, help, name);
    uint64_t cum = 0;
    for (int i = 0; i < SRV_N_BUCKETS; i++) {
        cum += h->counts[i];
        sb_addf(b, "%s_bucket{model_name=\"%s\",le=\"%g\"} %llu\n", name, m, k_buckets[i],
                (unsigned long long)cum);
    }
    cum += h->counts[SRV_N_BUCKETS];
    sb_addf(b, "%s_bucket{model_name=\"%s\",le=\"+Inf\"} %llu\n", name, m, (unsigned long long)cum);
    sb_addf(b, "%s_sum{model_name=\"%s\"} %.6f\n%s_count{model_name=\"%s\"} %llu\n", name, m,
            h->sum, name, m, (unsigned long long)h->n);
}

char *srv_metrics_text(srv *s) {
    di_engine_stats st;
    di_engine_get_stats(s->engine, &st);
    const char *m = s->cfg.model_name;
    sb b = {0};
#define GAUGE(name, help, fmt, v)                                                                  \
    sb_addf(&b,                                                                                    \
            "# HELP " name " " help "\n# TYPE " name " gauge\n" name "{model_name=\"%s\"} " fmt    \
            "\n",                                                                                  \
            m, v)
#define COUNTER(name, help, v)                                                                     \
    sb_addf(&b,                                                                                    \
            "# HELP " name " " help "\n# TYPE " name " counter\n" name                             \
            "{model_name=\"%s\"} %llu\n",                                                          \
            m, (unsigned long long)(v))
    GAUGE("deepinfer:num_requests_running", "Sequences in the running batch.", "%d", st.n_running);
    GAUGE("deepinfer:num_requests_waiting", "Sequences waiting for admission.", "%d", st.n_waiting);
    GAUGE("deepinfer:num_http_requests_in_flight", "Generation requests being served.", "%d",
          atomic_load(&s->inflight));
    double usage =
        st.n_blocks_total ? 1.0 - (double)st.n_blocks_free / (double)st.n_blocks_total : 0;
    GAUGE("deepinfer:kv_cache_usage_perc", "KV pool usage (1 = full).", "%.6f", usage);
    GAUGE("deepinfer:kv_blocks_total", "KV pool blocks.", "%lld", (long long)st.n_blocks_total);
    GAUGE("deepinfer:kv_blocks_free", "Free KV blocks (evictable cached included).", "%lld",
          (long long)st.n_blocks_free);
    GAUGE("deepinfer:kv_blocks_cached", "KV blocks held only by the prefix cache.", "%lld",
          (long long)st.n_blocks_cached);
    double looked = (double)(st.n_cache_hit_tokens + st.n_prefill_tokens);
    GAUGE("deepinfer:prefix_cache_hit_rate", "Prompt tokens served from the prefix cache.", "%.6f",
          looked > 0 ? (double)st.n_cache_hit_tokens / looked : 0.0);
    COUNTER("deepinfer:prefix_cache_hit_tokens_total", "Prompt tokens taken from the cache.",
            st.n_cache_hit_tokens);
    COUNTER("deepinfer:prefix_cache_replayed_tokens_total",
            "Cached positions computed again after prefix hits (prefill tokens: the bounded replay "
            "rebuilding the sliding window, or the positions between a tail snapshot and a deeper "
            "hit).",
            st.n_replayed_tokens);
    COUNTER("deepinfer:tail_snapshots_taken_total",
            "Tail snapshots taken at a prompt's last block boundary (docs/kv-cache.md).",
            st.n_tail_taken);
    COUNTER("deepinfer:tail_snapshots_restored_total",
            "Prefix hits continued from a tail snapshot instead of the bounded replay.",
            st.n_tail_restored);
    COUNTER("deepinfer:tail_snapshots_evicted_total",
            "Tail snapshots dropped for room (least recently used).", st.n_tail_evicted);
    GAUGE("deepinfer:tail_snapshots", "Tail snapshots held.", "%lld", (long long)st.n_tail_stored);
    GAUGE("deepinfer:tail_snapshot_bytes", "Bytes of the tail snapshots held.", "%lld",
          (long long)st.tail_bytes);
    COUNTER("deepinfer:prefix_cache_disk_hit_tokens_total",
            "Prompt tokens taken from the prefix cache's disk tier (part of the hit tokens).",
            st.n_disk_hit_tokens);
    COUNTER("deepinfer:kv_disk_blocks_written_total",
            "KV blocks written to the disk tier (evicted, or flushed at shutdown).",
            st.n_disk_blocks_written);
    COUNTER("deepinfer:kv_disk_blocks_read_total", "KV blocks read back from the disk tier.",
            st.n_disk_blocks_read);
    COUNTER("deepinfer:kv_disk_snapshots_written_total",
            "Disk-tier records written with their block's tail snapshot.", st.n_disk_snaps_written);
    COUNTER("deepinfer:kv_disk_snapshots_read_total",
            "Tail snapshots read back from the disk tier with their blocks (hits replay nothing).",
            st.n_disk_snaps_read);
    COUNTER("deepinfer:kv_disk_dropped_total",
            "Disk-tier records dropped as corrupt, truncated or not matching.", st.n_disk_dropped);
    GAUGE("deepinfer:kv_disk_records", "Records in the disk tier.", "%lld",
          (long long)st.n_disk_records);
    GAUGE("deepinfer:kv_disk_bytes", "Bytes of records in the disk tier.", "%lld",
          (long long)st.disk_bytes);
    // Its write queue: evicted blocks are copied into staging on the engine thread and written
    // by the IO thread.
    COUNTER("deepinfer:kv_disk_writes_queued_total",
            "Disk-tier records queued for the IO thread (evictions, shutdown flush).",
            st.n_disk_writes_queued);
    COUNTER("deepinfer:kv_disk_writes_dropped_total",
            "Disk-tier records not written because the write queue was full (cache entries lost).",
            st.n_disk_writes_dropped);
    COUNTER("deepinfer:kv_disk_write_errors_total",
            "Disk-tier writes that failed on the IO thread (the block is not kept).",
            st.n_disk_write_errors);
    COUNTER("deepinfer:kv_disk_queue_hits_total",
            "Disk-tier lookups served from the write queue (blocks not yet on disk).",
            st.n_disk_queue_hits);
    GAUGE("deepinfer:kv_disk_writes_pending", "Disk-tier records queued now.", "%lld",
          (long long)st.n_disk_writes_pending);
    GAUGE("deepinfer:kv_disk_queue_bytes", "Staging bytes of the queued disk-tier records.", "%lld",
          (long long)st.disk_pending_bytes);
    GAUGE("deepinfer:kv_disk_stage_seconds_total",
          "Engine-thread time staging disk-tier records (copies into the write queue).", "%.6f",
          (double)st.disk_stage_us / 1e6);
    GAUGE("deepinfer:kv_disk_write_seconds_total",
          "IO-thread time writing disk-tier records (off the engine thread).", "%.6f",
          (double)st.disk_write_us / 1e6);
    // Its read thread: a waiting request whose prompt continues on disk is admitted once its
    // blocks are read (the others are admitted meanwhile).
    COUNTER("deepinfer:kv_disk_prefetches_total",
            "Admission prefetches started (a waiting request's blocks read from the disk tier).",
            st.n_disk_prefetches);
    COUNTER("deepinfer:kv_disk_prefetches_done_total", "Admission prefetches done.",
            st.n_disk_prefetches_done);
    COUNTER("deepinfer:kv_disk_prefetch_blocks_total",
            "Disk-tier records read by the read thread for admission prefetches.",
            st.n_disk_prefetch_blocks);
    COUNTER("deepinfer:kv_disk_prefetch_bytes_total",
            "Bytes (payloads and tail snapshots) read by the read thread for admission prefetches.",
            st.disk_prefetch_bytes);
    GAUGE("deepinfer:kv_disk_prefetch_read_seconds_total",
          "Read-thread time reading admission prefetches (off the engine thread).", "%.6f",
          (double)st.disk_prefetch_read_us / 1e6);
    GAUGE("deepinfer:kv_disk_prefetch_engine_seconds_total",
          "Engine-thread time on admission prefetches (index probes, taking read blocks; no file "
          "IO).",
          "%.6f", (double)st.disk_prefetch_engine_us / 1e6);
    COUNTER("deepinfer:kv_disk_prefetch_waits_total",
            "Requests admitted after waiting for their admission prefetch.",
            st.n_disk_prefetch_waits);
    GAUGE("deepinfer:kv_disk_prefetch_wait_seconds_total",
          "Time requests waited for their admission prefetch, in all.", "%.6f",
          (double)st.disk_prefetch_wait_us / 1e6);
    // On the device-resident forward: device blocks moved for the disk tier.
    COUNTER("deepinfer:kv_disk_device_downloads_total",
            "Evicted device blocks downloaded for their disk-tier write-back.",
            st.n_disk_dev_downloads);
    COUNTER("deepinfer:kv_disk_device_uploads_total",
            "Blocks read from the disk tier uploaded into device blocks.", st.n_disk_dev_uploads);
    COUNTER("deepinfer:kv_disk_device_lost_total",
            "Device write-backs lost (no room in the transfer batch, a failed download or step).",
            st.n_disk_dev_lost);
    COUNTER("deepinfer:num_preemptions_total", "Preemptions.", st.n_preemptions);
    COUNTER("deepinfer:priority_preemptions_total",
            "Preemptions for a waiting request of a better priority.", st.n_priority_preemptions);
    GAUGE("deepinfer:tenants_backlogged", "Users (tenants) with a running or waiting request.",
          "%d", st.n_tenants_backlogged);
    GAUGE(
        "deepinfer:tenants_tracked",
        "Users (tenants) whose fair-share counter is held (backlogged or recently idle; bounded).",
        "%d", st.n_tenants_tracked);
    COUNTER("deepinfer:engine_steps_total", "Engine steps.", st.n_steps);
    GAUGE("deepinfer:engine_forward_seconds_total",
          "Forward-thread time in the steps' forward calls (draft and MTP calls included).", "%.6f",
          (double)st.forward_us / 1e6);
    GAUGE("deepinfer:engine_sample_seconds_total",
          "Forward-thread time sampling the steps' rows (on the model's thread pool).", "%.6f",
          (double)st.sample_us / 1e6);
    COUNTER("deepinfer:engine_failed_steps_total",
            "Engine steps whose forward failed (their requests ended with an error).",
            st.n_failed_steps);
    COUNTER("deepinfer:engine_device_losses_total",
            "Steps whose forward found the device lost (a sticky device error).",
            st.n_device_losses);
    COUNTER("deepinfer:engine_device_recoveries_total",
            "Device losses recovered: the device state rebuilt, the running requests recomputed.",
            st.n_device_recoveries);
    COUNTER("deepinfer:engine_device_loss_preempted_total",
            "Running requests preempted for recompute by a device recovery.",
            st.n_device_loss_preempted);
    GAUGE("deepinfer:engine_unhealthy",
          "1 once the engine gave up on a lost device (every request refused; /ready and "
          "/health: 503).",
          "%d", st.unhealthy ? 1 : 0);
    GAUGE("deepinfer:engine_failed_steps_in_a_row",
          "Failed steps since the last one that succeeded (/ready and /health: 503 from " SRV_STR(
              SRV_FAILING_STEPS) " on).",
          "%lld", (long long)st.n_failed_in_a_row);
    // Speculative decoding (--spec-tokens; all zero when off).
    COUNTER("deepinfer:spec_decode_num_verifies_total",
            "Verify forwards of speculative decoding (one per sequence and step).",
            st.n_spec_verifies);
    COUNTER("deepinfer:spec_decode_num_draft_tokens_total", "Draft tokens DSpark proposed.",
            st.n_spec_drafted);
    COUNTER("deepinfer:spec_decode_num_verified_tokens_total",
            "Draft tokens verified by the target (after the confidence cut).", st.n_spec_verified);
    COUNTER("deepinfer:spec_decode_num_accepted_tokens_total", "Draft tokens accepted.",
            st.n_spec_accepted);
    sb_addf(&b, "# HELP deepinfer:spec_decode_verifies_by_accepted_total Verifies by the number "
                "of drafts they accepted.\n"
                "# TYPE deepinfer:spec_decode_verifies_by_accepted_total counter\n");
    for (int j = 0; j <= DI_MAX_SPEC_TOKENS; j++)
        sb_addf(&b,
                "deepinfer:spec_decode_verifies_by_accepted_total{model_name=\"%s\","
                "accepted=\"%d\"} %llu\n",
                m, j, (unsigned long long)st.n_spec_accept_hist[j]);
    // Expert parallelism (--ep-workers): one series per worker.
    di_ep_worker_stats ew[64];
    const int32_t n_ew = di_engine_ep_stats(s->engine, ew, 64);
    static const struct {
        const char *name, *help;
        size_t off;
    } k_ep[] = {
        {"deepinfer:ep_requests_total",
         "Requests sent to an expert worker (one per MoE layer call).",
         offsetof(di_ep_worker_stats, calls)},
        {"deepinfer:ep_rows_total", "Rows sent to an expert worker.",
         offsetof(di_ep_worker_stats, rows)},
        {"deepinfer:ep_sent_bytes_total", "Bytes sent to an expert worker.",
         offsetof(di_ep_worker_stats, bytes_sent)},
        {"deepinfer:ep_received_bytes_total", "Bytes received from an expert worker.",
         offsetof(di_ep_worker_stats, bytes_recv)},
        {"deepinfer:ep_wait_microseconds_total",
         "Time spent waiting for an expert worker's results.",
         offsetof(di_ep_worker_stats, wait_us)},
        {"deepinfer:ep_errors_total", "Failed connects, requests and replies of an expert worker.",
         offsetof(di_ep_worker_stats, errors)},
        {"deepinfer:ep_connects_total", "Connections opened to an expert worker.",
         offsetof(di_ep_worker_stats, connects)},
    };
    for (size_t k = 0; n_ew > 0 && k < sizeof k_ep / sizeof k_ep[0]; k++) {
        sb_addf(&b, "# HELP %s %s\n# TYPE %s counter\n", k_ep[k].name, k_ep[k].help, k_ep[k].name);
        for (int32_t i = 0; i < n_ew && i < 64; i++) {
            int64_t v;
            memcpy(&v, (const char *)&ew[i] + k_ep[k].off, sizeof v);
            sb_addf(&b, "%s{model_name=\"%s\",worker=\"%s\"} %lld\n", k_ep[k].name, m, ew[i].addr,
                    (long long)v);
        }
    }
    int64_t g_hits = 0, g_misses = 0;
    int32_t g_held = 0;
    if (s->gcache) di_grammar_cache_get_stats(s->gcache, &g_hits, &g_misses, &g_held);
    COUNTER("deepinfer:grammar_cache_hits_total",
            "Response formats and tool grammars found compiled in the grammar cache (their token "
            "sets shared).",
            g_hits);
    COUNTER("deepinfer:grammar_cache_misses_total",
            "Response formats and tool grammars compiled (not in the grammar cache).", g_misses);
    // Expert routing load (EPLB; per-expert counts: GET /internal/expert-load).
    COUNTER("deepinfer:expert_routed_pairs_total",
            "Routed (token, expert) pairs over every MoE layer (main layers and MTP blocks).",
            st.n_expert_pairs);
    GAUGE("deepinfer:expert_load_imbalance",
          "Mean over MoE layers of max / mean expert load since start (1 = balanced).", "%.6f",
          st.expert_load_imbalance);
    // Online EPLB (--eplb-interval; 0 without it).
    COUNTER("deepinfer:eplb_plans_total", "Expert placements planned by online EPLB.",
            st.n_eplb_plans);
    COUNTER("deepinfer:eplb_rebalances_total", "Planned placements applied to the expert workers.",
            st.n_eplb_rebalances);
    COUNTER("deepinfer:eplb_moved_replicas_total",
            "Expert replicas the applied placements put on another rank.", st.n_eplb_moves);
    GAUGE("deepinfer:eplb_balance",
          "Max / mean rank load of the placement in force under the last planned window.", "%.6f",
          st.eplb_balance);
    GAUGE("deepinfer:eplb_plan_seconds_total",
          "Time the EPLB planner thread spent planning (off the engine thread).", "%.6f",
          (double)st.eplb_plan_us / 1e6);
    GAUGE("deepinfer:grammar_cache_grammars", "Compiled grammars held by the grammar cache.", "%d",
          (int)g_held);
    pthread_mutex_lock(&s->metrics_mu);
    COUNTER("deepinfer:prompt_tokens_total", "Prompt tokens processed.", s->n_prompt_tokens);
    COUNTER("deepinfer:generation_tokens_total", "Tokens generated.", s->n_gen_tokens);
    COUNTER("deepinfer:request_success_total", "Requests that finished.", s->n_requests_ok);
    COUNTER("deepinfer:request_failure_total", "Requests failed or cancelled.", s->n_requests_err);
    sb_addf(&b, "# HELP deepinfer:http_responses_total HTTP responses by status class.\n"
                "# TYPE deepinfer:http_responses_total counter\n");
    for (int k = 1; k <= 5; k++)
        sb_addf(&b, "deepinfer:http_responses_total{model_name=\"%s\",status=\"%dxx\"} %llu\n", m,
                k, (unsigned long long)s->n_status[k]);
    hist(&b, "deepinfer:time_to_first_token_seconds", "Time to first token.", &s->ttft, m);
    hist(&b, "deepinfer:inter_token_latency_seconds", "Inter-token latency.", &s->itl, m);
    hist(&b, "deepinfer:e2e_request_latency_seconds", "End-to-end request latency.", &s->e2e, m);
    COUNTER("deepinfer:kv_transfer_exports_total",
            "Prefills answered with a KV transfer (POST /internal/prefill).", s->n_kv_exports);
    COUNTER("deepinfer:kv_transfer_export_blocks_total", "KV blocks exported.",
            s->n_kv_export_blocks);
    COUNTER("deepinfer:kv_transfer_export_bytes_total", "KV transfer bytes exported.",
            s->n_kv_export_bytes);
    COUNTER("deepinfer:kv_transfer_imports_total", "KV transfers imported (POST /internal/kv).",
            s->n_kv_imports);
    COUNTER("deepinfer:kv_transfer_import_blocks_total",
            "KV blocks imported into the prefix cache (copied in).", s->n_kv_import_blocks);
    COUNTER("deepinfer:kv_transfer_import_present_blocks_total",
            "KV blocks of imported transfers that were cached already.", s->n_kv_import_present);
    COUNTER("deepinfer:kv_transfer_import_bytes_total", "KV transfer bytes imported.",
            s->n_kv_import_bytes);
    COUNTER("deepinfer:kv_transfer_import_refused_total",
            "KV transfers refused (malformed, corrupt, another model, unsupported).",
            s->n_kv_import_refused);
    COUNTER("deepinfer:kv_transfer_probes_total",
            "Prefix-cache probes answered (POST /internal/kv/probe).", s->n_kv_probes);
    sb_addf(&b,
            "# HELP deepinfer:kv_transfer_engine_seconds_total Engine time exporting / "
            "importing KV transfers.\n# TYPE deepinfer:kv_transfer_engine_seconds_total counter\n"
            "deepinfer:kv_transfer_engine_seconds_total{model_name=\"%s\",op=\"export\"} %.6f\n"
            "deepinfer:kv_transfer_engine_seconds_total{model_name=\"%s\",op=\"import\"} %.6f\n",
            m, s->kv_export_s, m, s->kv_import_s);
    pthread_mutex_unlock(&s->metrics_mu);
#undef GAUGE
#undef COUNTER
    return b.p;
}

// ---- routing ----

typedef enum kind {
    K_CHAT,
    K_CMPL,
    K_RESP,
    K_MSG,
    K_MSG_COUNT,  // POST /v1/messages/count_tokens: the Messages prompt's token count
    K_RESP_COUNT, // POST /v1/responses/input_tokens: the Responses prompt's token count
    K_MODELS,
    K_HEALTH,
    K_READY,
    K_METRICS,
    K_PREFILL,    // POST /internal/prefill?route=<a generation path> (--kv-transfer)
    K_KV_IMPORT,  // POST /internal/kv (--kv-transfer)
    K_KV_PROBE,   // POST /internal/kv/probe?route=<a generation path> (--kv-transfer)
    K_EXPERT_LOAD // GET /internal/expert-load (EPLB: the routing load per layer and expert)
} kind;

static const struct route {
    const char *path;
    const char *method;
    kind k;
    bool beta; // DeepSeek's beta features: Chat prefix completion, Completions FIM (`suffix`)
} k_routes[] = {
    {"/v1/chat/completions", "POST", K_CHAT, false},
    {"/chat/completions", "POST", K_CHAT, false},
    {"/beta/chat/completions", "POST", K_CHAT, true},
    {"/v1/completions", "POST", K_CMPL, false},
    {"/completions", "POST", K_CMPL, false},
    {"/beta/completions", "POST", K_CMPL, true},
    {"/v1/responses", "POST", K_RESP, false},
    {"/responses", "POST", K_RESP, false},
    {"/v1/responses/input_tokens", "POST", K_RESP_COUNT, false},
    {"/responses/input_tokens", "POST", K_RESP_COUNT, false},
    {"/v1/messages", "POST", K_MSG, false},
    {"/anthropic/v1/messages", "POST", K_MSG, false},
    {"/anthropic/messages", "POST", K_MSG, false},
    {"/v1/messages/count_tokens", "POST", K_MSG_COUNT, false},
    {"/anthropic/v1/messages/count_tokens", "POST", K_MSG_COUNT, false},
    {"/anthropic/messages/count_tokens", "POST", K_MSG_COUNT, false},
    {"/v1/models", "GET", K_MODELS, false},
    {"/models", "GET", K_MODELS, false},
    {"/health", "GET", K_HEALTH, false},
    {"/ready", "GET", K_READY, false},
    {"/metrics", "GET", K_METRICS, false},
    {"/internal/prefill", "POST", K_PREFILL, false},
    {"/internal/kv", "POST", K_KV_IMPORT, false},
    {"/internal/kv/probe", "POST", K_KV_PROBE, false},
    {"/internal/expert-load", "GET", K_EXPERT_LOAD, false},
};

static srv_api api_of(kind k) {
    return k == K_CHAT                        ? SRV_API_CHAT
           : k == K_CMPL                      ? SRV_API_COMPLETIONS
           : k == K_RESP || k == K_RESP_COUNT ? SRV_API_RESPONSES
           : k == K_MSG || k == K_MSG_COUNT   ? SRV_API_MESSAGES
                                              : SRV_API_OTHER;
}

static enum MHD_Result fail(srv *s, struct MHD_Connection *c, srv_api api, const srv_err *e) {
    srv_metrics_status(s, e->status);
    return srv_send_error(c, api, e);
}

static bool authorized(srv *s, struct MHD_Connection *c, kind k) {
    return srv_authorized(c, s->cfg.http.api_key, k == K_MSG || k == K_MSG_COUNT);
}

enum MHD_Result srv_route(srv *s, struct MHD_Connection *c, const char *url, const char *method,
                          const char *body, size_t n_body, bool too_large) {
    srv_err e;
    const struct route *r = NULL;
    bool path_known = false;
    for (size_t i = 0; i < sizeof k_routes / sizeof k_routes[0]; i++) {
        if (strcmp(url, k_routes[i].path)) continue;
        const kind k = k_routes[i].k;
        if ((k == K_PREFILL || k == K_KV_IMPORT || k == K_KV_PROBE) && !s->cfg.kv_transfer)
            continue; // internal endpoints exist only with --kv-transfer
        path_known = true;
        if (!strcmp(method, k_routes[i].method)) r = &k_routes[i];
    }
    if (!r) {
        srv_api api = strstr(url, "messages") ? SRV_API_MESSAGES : SRV_API_OTHER;
        if (path_known) {
            srv_err_set(&e, 405, NULL, "Method %s is not allowed on %s.", method, url);
        } else {
            srv_err_set(&e, 404, NULL, "Unknown path %s.", url);
            e.code = "not_found";
        }
        return fail(s, c, api, &e);
    }
    srv_api api = api_of(r->k);
    // Failing: the engine's last SRV_FAILING_STEPS steps or more all failed (a device whose every
    // step fails; a sticky CUDA error is recovered by the engine, or it gives up: below): /ready
    // turns 503 so a load balancer stops sending, /health too so an orchestrator restarts the
    // process. A step that succeeds ends it (requests are still accepted meanwhile). Device lost
    // for good (the engine gave up rebuilding it: too many losses within its window, or a failed
    // rebuild; docs/server.md): /ready and /health 503 "device_lost" for the rest of the process,
    // and every generation request 503 (the engine refuses them).
    int64_t n_failing = 0;
    bool lost = false;
    int64_t n_losses = 0, n_recoveries = 0;
    if ((r->k == K_HEALTH || r->k == K_READY) && atomic_load(&s->ready)) {
        di_engine_stats st;
        di_engine_get_stats(s->engine, &st);
        lost = st.unhealthy;
        n_losses = st.n_device_losses;
        n_recoveries = st.n_device_recoveries;
        // With expert workers the failures were theirs: once they answer again the streak ends
        // here, without waiting for a request to reach this front (a router polls /ready).
        if (st.n_failed_in_a_row >= SRV_FAILING_STEPS &&
            di_engine_probe_workers(s->engine) == DI_OK)
            di_engine_get_stats(s->engine, &st);
        if (st.n_failed_in_a_row >= SRV_FAILING_STEPS) n_failing = st.n_failed_in_a_row;
    }
    if (r->k == K_HEALTH) {
        const int code = n_failing || lost ? 503 : 200;
        srv_metrics_status(s, code);
        return srv_send_json(c, code,
                             lost        ? json_pack("{s:s,s:I,s:I}", "status", "device_lost",
                                                     "device_losses", (json_int_t)n_losses,
                                                     "device_recoveries", (json_int_t)n_recoveries)
                             : n_failing ? json_pack("{s:s,s:I}", "status", "failing",
                                                     "failed_steps_in_a_row", (json_int_t)n_failing)
                                         : json_pack("{s:s}", "status", "ok"),
                             code == 503 ? 1 : 0);
    }
    if (r->k == K_READY) {
        bool ok = atomic_load(&s->ready) && !atomic_load(&s->draining) && !n_failing && !lost;
        srv_metrics_status(s, ok ? 200 : 503);
        return srv_send_json(c, ok ? 200 : 503,
                             json_pack("{s:s}", "status",
                                       ok                          ? "ready"
                                       : atomic_load(&s->draining) ? "draining"
                                       : lost                      ? "device_lost"
                                       : n_failing                 ? "failing"
                                                                   : "loading"),
                             ok ? 0 : 1);
    }
    if (r->k == K_METRICS) {
        char *t = srv_metrics_text(s);
        srv_metrics_status(s, 200);
        enum MHD_Result ret =
            srv_send_text(c, 200, "text/plain; version=0.0.4; charset=utf-8", t ? t : "");
        free(t);
        return ret;
    }
    if (!authorized(s, c, r->k)) {
        srv_err_set(&e, 401, NULL, "Invalid or missing API key.");
        return fail(s, c, api, &e);
    }
    if (r->k == K_MODELS) {
        srv_metrics_status(s, 200);
        return srv_send_json(c, 200,
                             json_pack("{s:s,s:[{s:s,s:s,s:I,s:s,s:i}]}", "object", "list", "data",
                                       "id", s->cfg.model_name, "object", "model", "created",
                                       (json_int_t)s->started_at, "owned_by", "deepinfer",
                                       "max_model_len", s->n_ctx),
                             0);
    }
    if (r->k == K_EXPERT_LOAD) {
        char *json = NULL;
        size_t n = 0;
        if (di_engine_expert_load(s->engine, &json, &n) != DI_OK) {
            srv_err_set(&e, 503, NULL, "Out of memory reading the expert load.");
            return fail(s, c, api, &e);
        }
        srv_metrics_status(s, 200);
        enum MHD_Result ret = srv_send_text(c, 200, "application/json", json);
        di_free_buffer(json);
        return ret;
    }
    // generation endpoints (and the internal ones)
    if (too_large) {
        srv_err_set(&e, 413, NULL, "The request body is larger than %zu bytes.",
                    r->k == K_KV_IMPORT ? s->cfg.max_kv_transfer_bytes
                                        : s->cfg.http.max_body_bytes);
        return fail(s, c, api, &e);
    }
    if (atomic_load(&s->draining)) {
        srv_err_set(&e, 503, NULL, "The server is shutting down.");
        return fail(s, c, api, &e);
    }
    if (r->k == K_KV_IMPORT) return srv_import_kv(s, c, body, n_body);
    kind gk = r->k; // the generation route: the request's own, or the one a prefill / probe names
    bool beta = r->beta;
    if (r->k == K_PREFILL || r->k == K_KV_PROBE) {
        const char *path = MHD_lookup_connection_value(c, MHD_GET_ARGUMENT_KIND, "route");
        const struct route *t = NULL;
        for (size_t i = 0; path && i < sizeof k_routes / sizeof k_routes[0]; i++)
            if (!strcmp(path, k_routes[i].path) && k_routes[i].k <= K_MSG) t = &k_routes[i];
        if (!t) {
            srv_err_set(&e, 400, "route",
                        "POST %s needs ?route= naming a generation path (such as "
                        "/v1/chat/completions), got %s%s%s.",
                        url, path ? "'" : "", path ? path : "none", path ? "'" : "");
            return fail(s, c, api, &e);
        }
        gk = t->k;
        beta = t->beta;
        api = api_of(gk);
    }
    if (r->k == K_MSG_COUNT) gk = K_MSG;
    if (r->k == K_RESP_COUNT) gk = K_RESP;
    const bool count = r->k == K_MSG_COUNT || r->k == K_RESP_COUNT;
    json_error_t jerr;
    json_t *req = json_loadb(body, n_body, JSON_REJECT_DUPLICATES, &jerr);
    if (!req) {
        srv_err_set(&e, 400, NULL, "Invalid JSON body: %s (line %d, column %d).", jerr.text,
                    jerr.line, jerr.column);
        return fail(s, c, api, &e);
    }
    if (!json_is_object(req)) {
        json_decref(req);
        srv_err_set(&e, 400, NULL, "The request body must be a JSON object.");
        return fail(s, c, api, &e);
    }
    if (atomic_fetch_add(&s->inflight, 1) >= s->cfg.max_inflight) {
        atomic_fetch_sub(&s->inflight, 1);
        json_decref(req);
        srv_err_set(&e, 429, NULL, "Too many concurrent requests (limit %d); retry later.",
                    s->cfg.max_inflight);
        return fail(s, c, api, &e);
    }
    srv_gen *g = NULL;
    srv_prefill_only = r->k == K_PREFILL || r->k == K_KV_PROBE;
    srv_probe_only = r->k == K_KV_PROBE || count;
    bool ok = gk == K_CHAT   ? srv_chat_prepare(s, req, beta, &g, &e)
              : gk == K_CMPL ? srv_completions_prepare(s, req, beta, &g, &e)
              : gk == K_RESP ? srv_responses_prepare(s, req, &g, &e)
                             : srv_messages_prepare(s, req, &g, &e);
    srv_prefill_only = srv_probe_only = false;
    json_decref(req);
    if (!ok) {
        atomic_fetch_sub(&s->inflight, 1);
        return fail(s, c, api, &e);
    }
    if (r->k == K_PREFILL) return srv_run_prefill(s, c, g); // releases the in-flight slot
    if (r->k == K_KV_PROBE) return srv_probe_kv(s, c, g);   // releases the in-flight slot
    if (count) return srv_run_count(s, c, g);               // releases the in-flight slot
    return srv_run_generation(s, c, g);                     // releases the in-flight slot
}
