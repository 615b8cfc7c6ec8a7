// internal — the KV-transfer endpoints of prefill/decode disaggregation (docs/disaggregation.md),
// served only with --kv-transfer: POST /internal/prefill computes a request's prompt and answers
// its cached blocks as a KV transfer (application/octet-stream); POST /internal/kv imports such a
// transfer into the prefix cache; POST /internal/kv/probe tells how much of a request's prompt the
// prefix cache holds (the router skips the prefill step when little is new). Cluster-internal:
// whoever can reach them can fill the prefix cache (a transfer's checksums detect damage, not
// forgery), so they are off by default and take the API key when one is set.
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "server/server.h"

static enum MHD_Result refuse(srv *s, struct MHD_Connection *c, int status, const char *code,
                              const char *fmt, const char *msg) {
    srv_err e;
    srv_err_set(&e, status, NULL, fmt, msg);
    e.code = code;
    srv_metrics_status(s, status);
    return srv_send_error(c, SRV_API_OTHER, &e);
}

// The HTTP status and error code of a failed export / import.
static int status_of(di_status st, const char **code) {
    switch (st) {
    case DI_ERR_INVALID:
        *code = "kv_model_mismatch";
        return 409;
    case DI_ERR_FORMAT:
        *code = "invalid_kv_transfer";
        return 400;
    case DI_ERR_UNSUPPORTED:
        *code = "kv_transfer_unsupported";
        return 501;
    default:
        *code = "unavailable";
        return 503; // DI_ERR_BUSY (stopping), DI_ERR_NOMEM
    }
}

enum MHD_Result srv_run_prefill(srv *s, struct MHD_Connection *c, srv_gen *g) {
    g->conn = c;
    while (!srv_gen_pump(g, 100)) {
        if (!g->client_gone && srv_client_gone(c)) { // the router gave up: stop computing
            g->client_gone = true;
            di_engine_cancel(s->engine, g->ch[0].eid);
        }
    }
    enum MHD_Result ret;
    if (g->failed || g->ch[0].efinish == DI_FINISH_CANCELLED) {
        ret = refuse(s, c, 500, NULL, "%s",
                     g->failed ? srv_gen_fail_message(g) : "The prefill was cancelled.");
    } else {
        void *x = NULL;
        size_t n = 0;
        int32_t nb = 0;
        char err[512] = "";
        const double t0 = srv_now();
        di_status st = di_engine_kv_export(s->engine, g->prompt, (int32_t)g->n_prompt,
                                           g->cache_salt, &x, &n, &nb, err, sizeof err);
        const double dt = srv_now() - t0;
        if (st != DI_OK) {
            const char *code;
            int status = status_of(st, &code);
            ret = refuse(s, c, status, code, "KV export failed: %s.", err[0] ? err : "no memory");
        } else {
            pthread_mutex_lock(&s->metrics_mu);
            s->n_kv_exports++;
            s->n_kv_export_blocks += (uint64_t)nb;
            s->n_kv_export_bytes += n;
            s->kv_export_s += dt;
            pthread_mutex_unlock(&s->metrics_mu);
            struct MHD_Response *r = MHD_create_response_from_buffer(n, x, MHD_RESPMEM_MUST_COPY);
            di_free_buffer(x);
            if (!r) {
                ret = MHD_NO;
            } else {
                char v[32];
                snprintf(v, sizeof v, "%d", (int)nb);
                MHD_add_response_header(r, "X-Deepinfer-KV-Blocks", v);
                snprintf(v, sizeof v, "%zu", g->n_prompt);
                MHD_add_response_header(r, "X-Deepinfer-Prompt-Tokens", v);
                MHD_add_response_header(r, MHD_HTTP_HEADER_CONTENT_TYPE,
                                        "application/octet-stream");
                srv_metrics_status(s, 200);
                ret = MHD_queue_response(c, 200, r);
                MHD_destroy_response(r);
            }
        }
    }
    srv_gen_destroy(g);
    atomic_fetch_sub(&s->inflight, 1);
    return ret;
}

enum MHD_Result srv_import_kv(srv *s, struct MHD_Connection *c, const char *body, size_t n) {
    int32_t ins = 0, pres = 0;
    char err[512] = "";
    const double t0 = srv_now();
    di_status st = di_engine_kv_import(s->engine, body, n, &ins, &pres, err, sizeof err);
    const double dt = srv_now() - t0;
    pthread_mutex_lock(&s->metrics_mu);
    if (st == DI_OK) {
        s->n_kv_imports++;
        s->n_kv_import_blocks += (uint64_t)ins;
        s->n_kv_import_present += (uint64_t)pres;
        s->n_kv_import_bytes += n;
        s->kv_import_s += dt;
    } else {
        s->n_kv_import_refused++;
    }
    pthread_mutex_unlock(&s->metrics_mu);
    if (st != DI_OK) {
        const char *code;
        int status = status_of(st, &code);
        fprintf(stderr, "WARN  KV import refused (%d): %s\n", status, err);
        return refuse(s, c, status, code, "KV import refused: %s.", err[0] ? err : "no memory");
    }
    srv_metrics_status(s, 200);
    return srv_send_json(c, 200,
                         json_pack("{s:i,s:i,s:I}", "inserted_blocks", (int)ins, "present_blocks",
                                   (int)pres, "bytes", (json_int_t)n),
                         0);
}

enum MHD_Result srv_probe_kv(srv *s, struct MHD_Connection *c, srv_gen *g) {
    int32_t cached = 0, disk = 0;
    const di_status st = di_engine_kv_probe(s->engine, g->prompt, (int32_t)g->n_prompt,
                                            g->cache_salt, &cached, &disk);
    const json_int_t n_prompt = (json_int_t)g->n_prompt;
    srv_gen_destroy(g);
    atomic_fetch_sub(&s->inflight, 1);
    if (st != DI_OK) {
        const char *code;
        const int status = status_of(st, &code);
        return refuse(s, c, status, code, "KV probe failed: %s.", di_status_str(st));
    }
    pthread_mutex_lock(&s->metrics_mu);
    s->n_kv_probes++;
    pthread_mutex_unlock(&s->metrics_mu);
    srv_metrics_status(s, 200);
    return srv_send_json(c, 200,
                         json_pack("{s:I,s:i,s:i}", "prompt_tokens", n_prompt, "cached_tokens",
                                   (int)cached, "disk_tokens", (int)disk),
                         0);
}
