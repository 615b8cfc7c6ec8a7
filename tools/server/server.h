/*
 * server — shared declarations of `deepinfer serve` (tools/server): the server context, the
 * per-request generation driver (gen.c) that turns engine tokens into parser events, the
 * per-API mappings (api_chat.c, api_responses.c, api_messages.c) and the HTTP glue (http.c).
 *
 * Threads: libmicrohttpd runs one thread per connection; each request's parsing, rendering,
 * detokenisation and event generation happens on that thread. The engine thread only appends
 * token events to the request's queue (queue.c). Counters in srv are atomics or under metrics_mu.
 * Includes only the public header (conventions: tools/ include only include/deepinfer.h).
 */
#pragma once

#include <jansson.h>
#include <microhttpd.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "cli/args.h" // di_http_args
#include "deepinfer.h"

#define SRV_MAX_N 8             // choices per request (spec §3: n ≤ 8)
#define SRV_MAX_LOGIT_BIAS 1024 // logit_bias entries per request
#define SRV_FIM_MAX_TOKENS 4096 // max_tokens of a FIM completion (the hosted API's limit)
#define SRV_MAX_USER_ID 512     // bytes of a user id (the hosted API's limit)
// Failed engine steps in a row from which /ready and /health answer 503 "failing" (routes.c).
#define SRV_FAILING_STEPS 3
// Compiled grammars kept for reuse (their token sets shared by the requests that ask for the same
// format or tools): the most recently used 64, or fewer if they hold more than 512 MB.
#define SRV_GRAMMAR_CACHE_N 64
#define SRV_GRAMMAR_CACHE_BYTES ((size_t)512 << 20)
#define SRV_STR_(x) #x
#define SRV_STR(x) SRV_STR_(x)

typedef enum srv_api {
    SRV_API_CHAT = 0,
    SRV_API_COMPLETIONS,
    SRV_API_RESPONSES,
    SRV_API_MESSAGES,
    SRV_API_OTHER, // models, health, metrics: OpenAI error shape
} srv_api;

// ---- string builder ----

typedef struct sb {
    char *p; // owned, NUL-terminated when n > 0
    size_t n, cap;
} sb;

void sb_add(sb *b, const char *s, size_t n);
void sb_adds(sb *b, const char *s);
void sb_addf(sb *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
void sb_free(sb *b);
// Appends the compact JSON of v (a reference is NOT stolen).
void sb_add_json(sb *b, const json_t *v);
// A JSON string of n bytes that may not be valid UTF-8: invalid bytes become U+FFFD.
json_t *json_stringn_lossy(const char *s, size_t n);

// ---- errors ----

typedef struct srv_err {
    int status;        // HTTP status
    const char *type;  // OpenAI type (the Anthropic type is derived from status)
    const char *code;  // OpenAI code; NULL = type
    const char *param; // offending field or NULL
    int retry_after_s; // > 0: Retry-After header
    char msg[512];
} srv_err;

void srv_err_set(srv_err *e, int status, const char *param, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
// The error body in the API's own shape (spec §4.1). New reference.
json_t *srv_err_body(srv_api api, const srv_err *e);

// ---- server context ----

typedef struct srv_config {
    // host, port, api_key (NULL: no auth), max_body_bytes, timeout_s (idle connection), drain_s
    // (SIGTERM: wait at most this long for in-flight requests)
    di_http_args http;
    const char *model_dir;  // borrowed
    const char *model_name; // served model id
    int n_threads;
    size_t kv_memory_bytes;
    const char *kv_disk_dir; // borrowed (argv); NULL: no disk tier
    size_t kv_disk_bytes;    // 0: the engine's default (16 GiB)
    size_t tail_cache_bytes; // tail snapshots' budget; 0: the engine's default (256 MiB)
    bool no_tail_cache;      // --tail-cache-mib 0
    int64_t kv_disk_ttl_s;   // 0: the engine's default (72 h)
    // --kv-disk-queue: the disk IO thread's staging; 0: the engine's default (256 MiB)
    size_t kv_disk_queue_bytes;
    size_t kv_disk_read_bytes; // --kv-disk-read: pool bytes one admission prefetch reserves (0: 1G)
    int32_t kv_disk_prefetches; // --kv-disk-prefetches: admission prefetches at once (0: 4)
    int32_t max_ctx;
    int32_t max_seqs;
    int32_t max_batch_tokens;     // forward rows per step (--max-batch-tokens); 0 = 256
    int32_t priority_aging_ms;    // --priority-aging-ms: one priority level per N ms waited; 0 off
    int32_t device_loss_max;      // --device-loss-max: device rebuilds within the window (0: 3)
    int32_t device_loss_window_s; // --device-loss-window: seconds (0: 600)
    int32_t spec_tokens;          // DSpark drafts per verify (V4.1 with DSpark); 0 = off
    float spec_min_confidence;    // the confidence cut; 0 = the engine's default, < 0 none
    int32_t eplb_interval;        // online EPLB every N steps (--ep-workers); 0 = off
    int32_t eplb_slots_per_rank;  // replicas per rank; 0 = the placement's
    double eplb_min_gain;         // 0 = the engine's default (0.05)
    int max_inflight;             // concurrent generation requests; more get 429
    double keepalive_s;           // SSE keep-alive period while nothing is produced
    bool kv_transfer; // --kv-transfer: POST /internal/prefill and /internal/kv are served
    // --cache-isolation user: each request's prefix-cache namespace is its user id (Chat /
    // Completions / Responses `user_id` or `user`, Messages `metadata.user_id`), so users share
    // no cached prompt; requests without one share the anonymous namespace.
    bool cache_isolation_user;
    // --fim: POST /beta/completions takes `suffix` (FIM; its V4 prompt layout is unverified
    // against the hosted API, serving.md §1.10, hence off by default).
    bool fim;
    size_t max_kv_transfer_bytes; // body limit of POST /internal/kv
} srv_config;

#define SRV_N_BUCKETS 14

typedef struct srv_hist {
    uint64_t counts[SRV_N_BUCKETS + 1]; // last = +Inf
    double sum;
    uint64_t n;
} srv_hist;

typedef struct srv {
    srv_config cfg;
    di_engine *engine;        // owned
    di_tokenizer *tok;        // owned
    di_grammar_vocab *gvocab; // owned: the token trie of structured output
    di_grammar_cache *gcache; // owned: compiled response formats and tool grammars, shared
    int32_t think_end;        // id of </think> (structured output starts after it), or -1
    int32_t dsml;             // id of ｜DSML｜ (tool_choice auto: tool grammars start after it)
    int32_t n_ctx;            // effective context per request
    int32_t n_vocab;          // the model's vocabulary (logit_bias ids are below it)
    int encoding; // prompt format (di_render_options.encoding): 1 (dsv41) for a V4.1 model
    long started_at;
    atomic_int inflight;  // generation requests being served
    atomic_bool draining; // SIGTERM received
    atomic_bool ready;
    atomic_uint_fast64_t next_id;
    pthread_mutex_t metrics_mu; // guards the fields below
    uint64_t n_requests_ok, n_requests_err, n_prompt_tokens, n_gen_tokens, n_cached_tokens;
    uint64_t n_status[6]; // by HTTP status class 1xx..5xx (index 1..5)
    srv_hist ttft, itl, e2e;
    // KV transfer (docs/disaggregation.md): prefills exported, transfers imported.
    uint64_t n_kv_exports, n_kv_export_blocks, n_kv_export_bytes;
    uint64_t n_kv_imports, n_kv_import_blocks, n_kv_import_present, n_kv_import_bytes;
    uint64_t n_kv_import_refused;
    uint64_t n_kv_probes;            // POST /internal/kv/probe answered
    double kv_export_s, kv_import_s; // time in the engine's export / import
} srv;

void srv_metrics_observe(srv_hist *h, double v);
void srv_metrics_status(srv *s, int status);
// Prometheus text exposition of the server and engine counters. Caller frees with free().
char *srv_metrics_text(srv *s);

// ---- generation: one HTTP request's engine requests (n choices) and their parsed output ----

typedef struct srv_call {
    char id[40]; // "call_…" / "toolu_…" / "fc_…" (the API's prefix)
    sb name, args;
    bool named; // TOOL_NAME_END seen
    bool done;  // TOOL_CALL_END seen
} srv_call;

typedef struct srv_tok_ev {
    int32_t choice, token;
    float logprob;
    int32_t n_top;
    int32_t top_ids[DI_MAX_LOGPROBS];
    float top_lp[DI_MAX_LOGPROBS];
    di_finish finish;
    di_status status;
    int32_t n_cached, n_replayed;
} srv_tok_ev;

struct srv_gen;

typedef struct srv_choice {
    struct srv_gen *g; // borrowed back-pointer
    int idx;
    uint64_t eid; // engine request id
    bool submitted, ended, parser_cancelled;
    di_parser *parser; // owned
    sb reasoning, content;
    srv_call *calls; // owned
    int n_calls, cap_calls;
    int32_t n_gen, n_cached, n_replayed, n_reasoning_tokens;
    di_finish efinish;
    di_status estatus;
    di_parser_finish pfinish;
    int section;                       // 0 reasoning, 1 content: section of the latest text event
    json_t *lp_content, *lp_reasoning; // owned logprobs arrays (when requested)
    // per-API streaming state
    int blk_kind;  // messages/responses: kind of the open block (0 none)
    int blk_index; // its index
    int n_blocks;  // blocks/items emitted so far
    bool head_sent;
    json_t *aborted_item; // Responses stream: the function_call item cut off by truncation
} srv_choice;

typedef struct srv_api_ops {
    // Streaming: called on the connection thread; they append SSE text to g->out.
    void (*stream_begin)(struct srv_gen *g);
    void (*stream_event)(struct srv_gen *g, srv_choice *c, const di_parser_event *ev);
    void (*stream_choice_end)(struct srv_gen *g, srv_choice *c);
    void (*stream_end)(struct srv_gen *g);
    void (*stream_error)(struct srv_gen *g, const srv_err *e);
    // Non-streaming body (new reference).
    json_t *(*body)(struct srv_gen *g);
    const char *keepalive; // SSE keep-alive text
    const char *call_prefix;
} srv_api_ops;

typedef struct srv_gen {
    srv *s;
    bool prefill_only; // POST /internal/prefill: one choice, one token, no stream (srv_gen_start)
    bool probe_only;   // POST /internal/kv/probe: rendered, never submitted (srv_gen_start)
    srv_api api;
    const srv_api_ops *ops;
    json_t *req; // owned request document
    bool stream, include_usage;
    char id[64];
    long created;
    int32_t *prompt; // owned (di_tok_free)
    size_t n_prompt;
    // Snapshot points of the prompt (di_render_points: the system prefix's end, Messages
    // cache_control breakpoints), passed to the engine as di_request_params.snap_at.
    int32_t snap_at[DI_MAX_SNAP_AT];
    int32_t n_snap_at;
    di_parser_stage stage;
    bool tools;            // tool calls parsed (tools given and tool_choice != none)
    bool tool_forced;      // tool_choice required / any / a named tool: the header is prefilled
    const char *tool_name; // borrowed from req: the named tool, or NULL
    bool tool_parallel;    // several calls allowed (parallel tool calls not disabled)
    bool json_output;    // response_format json_object: JSON mode in the answer (serving.md §1.8)
    di_grammar *grammar; // owned: the response format's constraint, or NULL
    const char *grammar_param; // "response_format" or "text.format" (errors)
    int32_t grammar_after;     // the engine's grammar_after (srv_gen_tool_grammar)
    bool thinking;
    int n;
    srv_choice ch[SRV_MAX_N];
    // engine request parameters (stop strings go to the parser, content only)
    di_sample_params sp; // sp.logit_bias points at `bias`
    di_logit_bias *bias; // owned [sp.n_logit_bias]: Chat / Completions logit_bias
    uint64_t cache_salt; // the prefix-cache namespace (--cache-isolation user: the user id's)
    uint64_t tenant;     // the user id's hash: fair share in the scheduler (0: anonymous)
    int32_t priority;    // request `priority` (lower first)
    int32_t max_tokens;
    const char *stop[DI_MAX_STOP]; // borrowed from req
    int n_stop;
    int top_logprobs; // -1: no logprobs
    // queue between the engine thread and the connection thread (queue.c)
    pthread_mutex_t mu;
    pthread_cond_t cv;
    srv_tok_ev *q; // owned ring
    size_t q_head, q_len, q_cap;
    int n_final; // final engine events received
    bool q_oom;
    // streaming output
    sb out;
    size_t out_off;
    bool out_done, failed;
    int64_t seq; // Responses sequence_number
    double t_start, t_first, t_last_out, t_last_tok;
    struct MHD_Connection *conn; // borrowed, for the disconnect check
    bool client_gone;
} srv_gen;

// gen.c
// Token counting (POST /v1/messages/count_tokens, POST /v1/responses/input_tokens): g prepared
// as a probe (validated and rendered as its route does, not submitted; Messages' max_tokens and
// Responses' model optional) answers its prompt's tokens in the API's shape: Messages
// {"input_tokens"}, Responses {"object":"response.input_tokens","input_tokens"}. Destroys g,
// releases the in-flight slot.
enum MHD_Result srv_run_count(srv *s, struct MHD_Connection *c, srv_gen *g);
// Set by a connection thread around the API's prepare call for POST /internal/prefill: the
// generation srv_gen_create makes there is prefill_only (the same validation and rendering as the
// public route; srv_gen_start then submits one choice of one token).
extern _Thread_local bool srv_prefill_only;
// The same around POST /internal/kv/probe's prepare call: the generation is probe_only (and
// prefill_only, for the same rendering), and srv_gen_start submits nothing.
extern _Thread_local bool srv_probe_only;
// Creates a generation for api over the parsed request (req reference is taken). The caller
// fills sampling fields, then calls srv_gen_start. NULL on out of memory.
srv_gen *srv_gen_create(srv *s, srv_api api, json_t *req);
// The response format (Chat response_format, Responses text.format; param names it in errors):
// text, json_object, json_schema, and the deepinfer extensions regex and grammar. Compiles the
// constraint into g->grammar (docs/structured-output.md). false with a 400 in e when the format or
// its schema / regex / grammar is invalid.
bool srv_gen_response_format(srv_gen *g, const json_t *fmt, const char *param, srv_err *e);
// The message of a failed generation (500): the engine's, or the structured-output constraint's.
const char *srv_gen_fail_message(const srv_gen *g);
// The tool-call constraint (docs/server.md "Tool calls"), after srv_render: a forced choice
// (the prompt ends in the block header) constrains the answer to a block of the allowed tools
// (the response format, if any, is dropped: the answer is the block); auto with a constrained
// format: the format or a block; auto alone: the text after the first ｜DSML｜ token is a valid
// block. Sets g->grammar and g->grammar_after. false with a 400 in e when a tool schema the
// grammar compiler refuses must be enforced (forced, or with a format); auto alone then stays
// unconstrained.
bool srv_gen_tool_grammar(srv_gen *g, srv_err *e);
// Submits the n engine requests. On failure fills e and returns false (nothing is running).
bool srv_gen_start(srv_gen *g, srv_err *e);
// The choices' output parsers (part of srv_gen_start; on its own only for srv_gen_replay).
bool srv_gen_init_parsers(srv_gen *g, srv_err *e);
// Test seam (tests/server/test_events.c), no engine involved: after srv_gen_init_parsers, feeds
// one engine event (token and/or finish) exactly as srv_gen_pump would, or decoded bytes in any
// split straight into choice's parser. The API hooks run as in serving.
void srv_gen_replay(srv_gen *g, const srv_tok_ev *ev);
void srv_gen_replay_text(srv_gen *g, int choice, const char *text, size_t n);
// Processes engine events for up to wait_ms (0: only those queued). Returns true when every
// choice has ended (and, when streaming, stream_end was appended).
bool srv_gen_pump(srv_gen *g, int wait_ms);
// Cancels unfinished choices, waits for their final events, logs the request line, frees.
void srv_gen_destroy(srv_gen *g);
double srv_now(void);
// The time-ordered id "<prefix><24 url-safe chars>" into out (cap ≥ 40).
void srv_make_id(srv *s, const char *prefix, char *out, size_t cap);
// The finish reason names.
const char *srv_finish_openai(const srv_choice *c);

// queue.c
void srv_queue_init(srv_gen *g);
void srv_queue_deinit(srv_gen *g);
void srv_queue_on_event(void *user, const di_event *ev); // di_event_fn; user = srv_choice
// Pops one event into *ev, waiting up to wait_ms; false if none.
bool srv_queue_pop(srv_gen *g, srv_tok_ev *ev, int wait_ms);
// Waits until n final events were received.
void srv_queue_wait_finals(srv_gen *g, int n);

// Request validation helpers (validate.c). Each returns false and fills e on a bad value.
bool srv_check_sampling(srv_gen *g, const json_t *req, srv_api api, srv_err *e);
bool srv_check_model(srv *s, const json_t *req, bool required, srv_err *e);
bool srv_check_tools(const json_t *tools, srv_api api, srv_err *e);
// tool_choice and parallel tool calls in the API's spelling (Chat and Responses:
// parallel_tool_calls; Messages: tool_choice.disable_parallel_tool_use), checked against the
// (already checked) tools: a forced or named choice needs tools, a named one must be among them.
// Sets g->tools (tools given and the choice is not none: calls are rendered and parsed),
// g->tool_forced, g->tool_name and g->tool_parallel.
bool srv_check_tool_choice(srv_gen *g, const json_t *tools, const json_t *tc, srv_api api,
                           srv_err *e);
bool srv_render(srv_gen *g, di_render_api rapi, srv_err *e);
bool srv_check_length(srv_gen *g, srv_err *e);

// api_*.c
extern const srv_api_ops srv_chat_ops, srv_completions_ops, srv_responses_ops, srv_messages_ops;
// Validate and map a request; on success *out is a started generation.
// beta: the request came on a /beta path (Chat prefix completion, Completions FIM).
bool srv_chat_prepare(srv *s, json_t *req, bool beta, srv_gen **out, srv_err *e);
bool srv_completions_prepare(srv *s, json_t *req, bool beta, srv_gen **out, srv_err *e);
bool srv_responses_prepare(srv *s, json_t *req, srv_gen **out, srv_err *e);
bool srv_messages_prepare(srv *s, json_t *req, srv_gen **out, srv_err *e);

// batch.c: `deepinfer batch` (docs/server.md, "Offline batches"): the OpenAI Batch input file
// in_path ("-": stdin) answered into out_path ("-": stdout), up to `concurrency` requests in the
// engine at once, answers in completion order. 0, or 1 when a file cannot be read or written
// (the lines' own errors are answers, not failures).
int srv_run_batch(srv *s, const char *in_path, const char *out_path, int concurrency);

// http.c
typedef struct srv_http srv_http;
// Handles one complete request (the body collected up to max_body_bytes; too_large: it was over
// and is dropped) on its connection thread; returns the MHD result of queueing a response.
typedef enum MHD_Result (*srv_http_handler)(void *cls, struct MHD_Connection *c, const char *url,
                                            const char *method, const char *body, size_t n_body,
                                            bool too_large);
typedef struct srv_http_opts {
    const char *who; // the subcommand, in messages ("serve", "route")
    const char *host;
    int port;
    size_t max_body_bytes;
    // POST to this path (NULL: none) may carry up to max_bulk_bytes (binary KV transfers).
    const char *bulk_path;
    size_t max_bulk_bytes;
    int timeout_s; // idle connection timeout
    int max_connections;
    srv_http_handler handler;
    void *cls; // borrowed, passed to handler
} srv_http_opts;
// A libmicrohttpd daemon with one thread per connection on o->host:o->port (shared by
// `deepinfer serve` and `deepinfer route`). false (with a message on stderr) if it cannot listen.
bool srv_http_listen(const srv_http_opts *o, srv_http **out);
// srv_http_listen with the server's configuration and srv_route.
bool srv_http_start(srv *s, srv_http **out);
// Stops accepting (open connections continue), then waits at most drain_s seconds for *inflight to
// reach 0.
void srv_http_drain(srv_http *h, atomic_int *inflight, int drain_s);
// The clean shutdown of serve and route: after srv_http_on_signals, SIGTERM and SIGINT ask for it
// (SIGPIPE is ignored); srv_http_wait_signal returns once one was received.
void srv_http_on_signals(void);
void srv_http_wait_signal(void);
void srv_http_stop(srv_http *h);
// routes.c: handles one complete request; returns the MHD result of queueing a response.
enum MHD_Result srv_route(srv *s, struct MHD_Connection *c, const char *url, const char *method,
                          const char *body, size_t n_body, bool too_large);
// http.c helpers used by routes
enum MHD_Result srv_send_json(struct MHD_Connection *c, int status, json_t *body,
                              int retry_after_s); // steals body
enum MHD_Result srv_send_text(struct MHD_Connection *c, int status, const char *ctype,
                              const char *text);
enum MHD_Result srv_send_error(struct MHD_Connection *c, srv_api api, const srv_err *e);
enum MHD_Result srv_run_generation(srv *s, struct MHD_Connection *c, srv_gen *g);
bool srv_client_gone(struct MHD_Connection *c);
// Whether a client's secret equals key, in a time that depends only on the client's length (never
// on where they differ or on key). NULL given: false.
bool srv_secret_equal(const char *given, const char *key);
// The API key rule of serve and route (docs/server.md, "Authentication"): key NULL lets every
// request in; else "Authorization: Bearer <key>" (which wins when present), or "x-api-key: <key>"
// where x_api_key_ok (the Anthropic paths). admin_key (route's --admin-key) takes Bearer only:
// srv_authorized(c, admin_key, false).
bool srv_authorized(struct MHD_Connection *c, const char *key, bool x_api_key_ok);
// internal.c (docs/disaggregation.md): POST /internal/prefill runs g (prefill_only) and answers
// the prompt's cached blocks as a KV transfer; POST /internal/kv imports one; POST
// /internal/kv/probe answers how much of a prompt is cached. They release the in-flight slot /
// take none.
enum MHD_Result srv_run_prefill(srv *s, struct MHD_Connection *c, srv_gen *g);
enum MHD_Result srv_import_kv(srv *s, struct MHD_Connection *c, const char *body, size_t n);
// POST /internal/kv/probe: how much of g's prompt the prefix cache holds (di_engine_kv_probe);
// 200 {"prompt_tokens","cached_tokens","disk_tokens"}. Destroys g, releases the in-flight slot.
enum MHD_Result srv_probe_kv(srv *s, struct MHD_Connection *c, srv_gen *g);
