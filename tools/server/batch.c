// batch — `deepinfer batch` (docs/server.md, "Offline batches"): a file of requests in the OpenAI
// Batch input format, one JSON object per line ({"custom_id", "method": "POST", "url", "body"}),
// answered through the same validation, rendering, engine and response shapes as `deepinfer
// serve` (a server without HTTP), up to `concurrency` requests in the engine at once, each answer
// written as one line of the Batch output format as soon as it completes:
//   {"id": "batch_req_<n>", "custom_id", "response": {"status_code", "request_id", "body"},
//    "error": null}
// where body is what the HTTP route would answer (its error shape on 4xx/5xx); a line that is not
// such a request gets "response": null and "error": {"code", "message"} naming the line. Lines are
// independent: a bad one never stops the others. custom_ids must be unique within the file (the
// OpenAI Batch API's rule): the first line with an id owns it, a later line with the same id is not
// run and gets the error "duplicate_custom_id" naming both lines.
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "server/server.h"

typedef struct batch_slot {
    srv_gen *g; // NULL: free
    json_t *custom_id;
    int64_t line;
} batch_slot;

typedef struct batch_run {
    srv *s;
    FILE *out;
    // Every custom_id seen so far (any line whose custom_id is a non-empty string) -> its first
    // line number; owned.
    json_t *seen;
    int64_t n_written, n_ok, n_http_err, n_line_err;
} batch_run;

static void write_line(batch_run *b, json_t *custom_id, int status, const char *request_id,
                       json_t *body, const char *err_code, const char *err_msg) {
    char id[48];
    snprintf(id, sizeof id, "batch_req_%lld", (long long)b->n_written + 1);
    json_t *o = json_object();
    json_object_set_new(o, "id", json_string(id));
    json_object_set(o, "custom_id", custom_id ? custom_id : json_null());
    if (body) {
        json_object_set_new(o, "response",
                            json_pack("{s:i,s:s,s:o}", "status_code", status, "request_id",
                                      request_id ? request_id : id, "body", body));
        json_object_set_new(o, "error", json_null());
    } else {
        json_object_set_new(o, "response", json_null());
        json_object_set_new(o, "error",
                            json_pack("{s:s,s:s}", "code", err_code, "message", err_msg));
    }
    char *text = json_dumps(o, JSON_COMPACT);
    json_decref(o);
    if (text) {
        fputs(text, b->out);
        fputc('\n', b->out);
        fflush(b->out); // a killed run keeps every answer written so far
        free(text);
    }
    b->n_written++;
    if (err_code)
        b->n_line_err++;
    else if (status == 200)
        b->n_ok++;
    else
        b->n_http_err++;
}

// The generation routes a batch line may name (the serve routes, without the beta ones).
typedef enum batch_kind { B_CHAT, B_CMPL, B_RESP, B_MSG } batch_kind;

static bool batch_route(const char *url, batch_kind *k, srv_api *api) {
    static const struct {
        const char *url;
        batch_kind k;
        srv_api api;
    } routes[] = {
        {"/v1/chat/completions", B_CHAT, SRV_API_CHAT},
        {"/v1/completions", B_CMPL, SRV_API_COMPLETIONS},
        {"/v1/responses", B_RESP, SRV_API_RESPONSES},
        {"/v1/messages", B_MSG, SRV_API_MESSAGES},
    };
    for (size_t i = 0; i < sizeof routes / sizeof routes[0]; i++)
        if (!strcmp(url, routes[i].url)) {
            *k = routes[i].k;
            *api = routes[i].api;
            return true;
        }
    return false;
}

// Records custom_id cid as used by line `no`; false (msg written) when an earlier line used it.
// Keys are compared as the whole string, NULs included (json_object_getn).
static bool first_use(batch_run *b, json_t *cid, int64_t no, char *msg, size_t cap) {
    const char *id = json_string_value(cid);
    const size_t n = json_string_length(cid);
    json_t *prev = json_object_getn(b->seen, id, n);
    if (prev) {
        snprintf(msg, cap,
                 "line %lld: \"custom_id\" \"%.*s\" is a duplicate of line %lld's (custom_id must "
                 "be unique in a batch)",
                 (long long)no, n > 64 ? 64 : (int)n, id, (long long)json_integer_value(prev));
        return false;
    }
    json_object_setn_new(b->seen, id, n, json_integer(no));
    return true;
}

// Starts line `no` (text[0, n)) in slot sl, or answers it at once (bad line, validation error).
static void start_line(batch_run *b, batch_slot *sl, const char *text, size_t n, int64_t no) {
    char msg[512];
    json_error_t jerr;
    json_t *line = json_loadb(text, n, JSON_REJECT_DUPLICATES, &jerr);
    json_t *cid = json_object_get(line, "custom_id");
    const char *method = json_string_value(json_object_get(line, "method"));
    const char *url = json_string_value(json_object_get(line, "url"));
    json_t *body = json_object_get(line, "body");
    batch_kind k;
    srv_api api;
    if (!line || !json_is_object(line)) {
        snprintf(msg, sizeof msg, "line %lld: %s", (long long)no,
                 line ? "not a JSON object" : jerr.text);
        write_line(b, NULL, 0, NULL, NULL, "invalid_json_line", msg);
    } else if (!json_is_string(cid) || !json_string_length(cid)) {
        snprintf(msg, sizeof msg, "line %lld: \"custom_id\" must be a non-empty string",
                 (long long)no);
        write_line(b, NULL, 0, NULL, NULL, "missing_custom_id", msg);
    } else if (!first_use(b, cid, no, msg, sizeof msg)) {
        write_line(b, cid, 0, NULL, NULL, "duplicate_custom_id", msg);
    } else if (!method || strcmp(method, "POST")) {
        snprintf(msg, sizeof msg, "line %lld: \"method\" must be \"POST\"", (long long)no);
        write_line(b, cid, 0, NULL, NULL, "invalid_method", msg);
    } else if (!url || !batch_route(url, &k, &api)) {
        snprintf(msg, sizeof msg,
                 "line %lld: \"url\" must be /v1/chat/completions, /v1/completions, "
                 "/v1/responses or /v1/messages",
                 (long long)no);
        write_line(b, cid, 0, NULL, NULL, "invalid_url", msg);
    } else if (!json_is_object(body)) {
        snprintf(msg, sizeof msg, "line %lld: \"body\" must be a JSON object", (long long)no);
        write_line(b, cid, 0, NULL, NULL, "invalid_body", msg);
    } else if (json_is_true(json_object_get(body, "stream"))) {
        snprintf(msg, sizeof msg, "line %lld: a batch request cannot stream (\"stream\": true)",
                 (long long)no);
        write_line(b, cid, 0, NULL, NULL, "invalid_body", msg);
    } else {
        srv_err e;
        srv_gen *g = NULL;
        json_incref(body); // the prepare call takes its reference
        bool ok = k == B_CHAT   ? srv_chat_prepare(b->s, body, false, &g, &e)
                  : k == B_CMPL ? srv_completions_prepare(b->s, body, false, &g, &e)
                  : k == B_RESP ? srv_responses_prepare(b->s, body, &g, &e)
                                : srv_messages_prepare(b->s, body, &g, &e);
        json_decref(body);
        if (ok) {
            sl->g = g;
            sl->custom_id = json_incref(cid);
            sl->line = no;
        } else { // the route's answer: the API's error shape and status
            write_line(b, cid, e.status, NULL, srv_err_body(api, &e), NULL, NULL);
        }
    }
    json_decref(line);
}

// Writes a finished slot's answer and frees the slot.
static void finish_slot(batch_run *b, batch_slot *sl) {
    srv_gen *g = sl->g;
    if (g->failed) {
        srv_err e;
        srv_err_set(&e, 500, NULL, "%s", srv_gen_fail_message(g));
        write_line(b, sl->custom_id, 500, g->id, srv_err_body(g->api, &e), NULL, NULL);
    } else {
        write_line(b, sl->custom_id, 200, g->id, g->ops->body(g), NULL, NULL);
    }
    srv_gen_destroy(g);
    json_decref(sl->custom_id);
    *sl = (batch_slot){0};
}

int srv_run_batch(srv *s, const char *in_path, const char *out_path, int concurrency) {
    FILE *in = strcmp(in_path, "-") ? fopen(in_path, "r") : stdin;
    if (!in) {
        fprintf(stderr, "ERROR batch: cannot open %s\n", in_path);
        return 1;
    }
    FILE *out = strcmp(out_path, "-") ? fopen(out_path, "w") : stdout;
    if (!out) {
        fprintf(stderr, "ERROR batch: cannot write %s\n", out_path);
        if (in != stdin) fclose(in);
        return 1;
    }
    batch_slot *slots = calloc((size_t)concurrency, sizeof *slots);
    json_t *seen = json_object();
    if (!slots || !seen) {
        free(slots);
        json_decref(seen);
        if (in != stdin) fclose(in);
        if (out != stdout) fclose(out);
        return 1;
    }
    batch_run b = {.s = s, .out = out, .seen = seen};
    const double t0 = srv_now();
    char *text = NULL;
    size_t cap = 0;
    int64_t no = 0;
    bool eof = false;
    int n_busy = 0;
    while (!eof || n_busy > 0) {
        // Fill the free slots from the file (blank lines are skipped, as the Batch API does).
        for (int i = 0; i < concurrency && !eof; i++) {
            if (slots[i].g) continue;
            ssize_t n;
            while ((n = getline(&text, &cap, in)) >= 0) {
                no++;
                while (n > 0 && (text[n - 1] == '\n' || text[n - 1] == '\r')) n--;
                if (n == 0) continue;
                start_line(&b, &slots[i], text, (size_t)n, no);
                if (slots[i].g) break;
            }
            if (n < 0) eof = true;
            if (slots[i].g) n_busy++;
        }
        // Advance every running request; write those that finished.
        bool progress = false;
        for (int i = 0; i < concurrency; i++) {
            if (!slots[i].g || !srv_gen_pump(slots[i].g, 0)) continue;
            finish_slot(&b, &slots[i]);
            n_busy--;
            progress = true;
        }
        if (!progress && n_busy > 0) {
            const struct timespec ts = {0, 1000000}; // 1 ms: the engine's steps are longer
            nanosleep(&ts, NULL);
        }
    }
    free(text);
    free(slots);
    json_decref(b.seen);
    const double dt = srv_now() - t0;
    pthread_mutex_lock(&s->metrics_mu);
    const uint64_t n_prompt = s->n_prompt_tokens, n_gen = s->n_gen_tokens;
    pthread_mutex_unlock(&s->metrics_mu);
    fprintf(stderr,
            "INFO  batch: %lld line(s): %lld answered 200, %lld with an HTTP error, %lld not "
            "requests; %llu prompt and %llu generated tokens in %.2f s (%.1f generated "
            "tokens/s)\n",
            (long long)b.n_written, (long long)b.n_ok, (long long)b.n_http_err,
            (long long)b.n_line_err, (unsigned long long)n_prompt, (unsigned long long)n_gen, dt,
            dt > 0 ? n_gen / dt : 0.0);
    const bool read_err = ferror(in);
    if (in != stdin) fclose(in);
    const bool write_err = out != stdout ? fclose(out) != 0 : fflush(out) != 0;
    if (read_err || write_err) {
        fprintf(stderr, "ERROR batch: %s\n",
                read_err ? "reading the input failed" : "writing the output failed");
        return 1;
    }
    return 0;
}
