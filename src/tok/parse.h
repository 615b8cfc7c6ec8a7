/*
 * parse — incremental parser of DeepSeek V4/V4.1 model output (spec serving.md §1.11, §2.6):
 * separates reasoning, content and DSML tool calls, token by token or over whole text.
 *
 * A byte-level state machine over decoded text (labels such as "<｜DSML｜" span several tokens and
 * "<" / tag names are ordinary text): Reasoning → Content → ToolCalls → ToolName → Args →
 * ParamName → ParamType → ParamValue → ... → Finished. Any suffix that could still become a label
 * (and at most two newlines before a DSML block, and an incomplete UTF-8 character) is held back;
 * every other byte is emitted at once. Both DSML spellings (V4 "tool_calls", V4.1 " calls") are
 * accepted. Tool arguments stream as JSON text: string="true" values are escaped as JSON strings,
 * string="false" values copied verbatim, giving {"k1": v1, "k2": v2}.
 * Tolerance: leading newlines after <think>/</think> are dropped; a stray </think> in content is
 * dropped (flagged); DSML never reaches content; text after the block is dropped (flagged); an
 * incomplete call at the end is discarded (DI_PARSE_EVENT_TOOL_CALL_ABORT) and never leaks.
 *
 * Owns: its buffers. Thread-safety: one parser per stream, one thread at a time.
 */
#pragma once

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "base/buf.h"  // di_buf
#include "deepinfer.h" // di_status, di_tokenizer

typedef enum di_parse_stage {
    DI_PARSE_STAGE_REASONING = 0, // after "<think>" (thinking mode)
    DI_PARSE_STAGE_CONTENT,       // after "</think>" (chat mode, or a closed prefix)
    DI_PARSE_STAGE_TOOL_CALLS, // after a forced "<｜DSML｜tool_calls>\n" (tool_choice=required)
} di_parse_stage;

typedef enum di_parse_event_kind {
    DI_PARSE_EVENT_REASONING = 0, // text: reasoning bytes
    DI_PARSE_EVENT_CONTENT,       // text: answer bytes
    DI_PARSE_EVENT_TOOL_CALL_BEGIN,
    DI_PARSE_EVENT_TOOL_NAME, // text: bytes of the name (may come in pieces)
    DI_PARSE_EVENT_TOOL_NAME_END,
    DI_PARSE_EVENT_ARGS_DELTA, // text: JSON text of the arguments, in pieces
    DI_PARSE_EVENT_TOOL_CALL_END,
    DI_PARSE_EVENT_TOOL_CALL_ABORT, // the open call was incomplete at the end and is discarded
} di_parse_event_kind;

typedef struct di_parse_event {
    di_parse_event_kind kind;
    int32_t call_index; // tool-call events: 0-based index of the call
    const char *text;   // borrowed, valid during the callback; not NUL-terminated
    size_t len;
} di_parse_event;

typedef void (*di_parse_emit_fn)(void *user, const di_parse_event *ev);

typedef enum di_parse_finish {
    DI_PARSE_FINISH_NONE = 0,
    DI_PARSE_FINISH_STOP, // EOS or the end of a tool-call block
    DI_PARSE_FINISH_STOP_SEQUENCE,
    DI_PARSE_FINISH_LENGTH,     // the caller ran out of tokens
    DI_PARSE_FINISH_TOOL_CALLS, // stopped with at least one complete tool call
} di_parse_finish;

enum {
    DI_PARSE_FLAG_EXTRA_END_OF_THINKING = 1, // a </think> in content was dropped
    DI_PARSE_FLAG_CONTENT_AFTER_FINISHED = 2,
    DI_PARSE_FLAG_DUPLICATE_PARAMETER = 4,
    DI_PARSE_FLAG_DSML_SUPPRESSED = 8, // DSML without tools requested: calls dropped
    DI_PARSE_FLAG_CALL_ABORTED = 16,
    DI_PARSE_FLAG_STRAY_MARKUP = 32, // a DSML closer / bare ｜DSML｜ outside a block was dropped
};

typedef struct di_parse_options {
    di_parse_stage start;
    bool tools_enabled;      // false: DSML blocks are stripped, no call events
    const char *const *stop; // borrowed stop strings (content only); may be NULL
    size_t n_stop;
    // JSON mode (response_format json_object / json_schema, spec serving.md §1.8): in the answer,
    // a leading ```json / ``` fence is skipped and its closing newline + ``` ends the JSON; a raw
    // { or [ also starts JSON and its matching bracket ends it; every byte outside the JSON is
    // replaced by a space (not removed, so byte offsets hold). No validation is implied.
    bool json_output;
} di_parse_options;

typedef struct di_parse di_parse;

// DI_ERR_INVALID (a stop string that is empty or > 256 bytes), DI_ERR_NOMEM.
di_status di_parse_create(const di_parse_options *opt, di_parse_emit_fn emit, void *user,
                          di_parse **out);
void di_parse_destroy(di_parse *p);
// Feeds decoded output bytes (any split). DI_ERR_NOMEM.
di_status di_parse_feed(di_parse *p, const char *text, size_t n);
// Feeds one generated token: EOS (id 1) finishes with DI_PARSE_FINISH_STOP, any other id is
// detokenized (tok borrowed) and fed. DI_ERR_INVALID (bad id), DI_ERR_NOMEM.
di_status di_parse_feed_token(di_parse *p, const di_tokenizer *tok, int32_t id);
// Ends the stream (reason: STOP for EOS, LENGTH when the token budget ran out); flushes held
// bytes and aborts an incomplete call. Returns the final finish reason (TOOL_CALLS when a call
// completed and the stream stopped normally).
di_parse_finish di_parse_end(di_parse *p, di_parse_finish reason);
bool di_parse_finished(const di_parse *p); // Finished stage reached (block end or stop string)
uint32_t di_parse_flags(const di_parse *p);

// ---- whole-message result (also what the event stream accumulates to) ----

typedef struct di_parse_call {
    di_buf name;      // owned
    di_buf arguments; // owned JSON text
} di_parse_call;

typedef struct di_parse_result {
    di_buf reasoning;     // owned
    di_buf content;       // owned
    di_parse_call *calls; // owned
    size_t n_calls;
    bool has_reasoning; // a reasoning section was present
    di_parse_finish finish;
    uint32_t flags;
} di_parse_result;

void di_parse_result_init(di_parse_result *r);
void di_parse_result_deinit(di_parse_result *r);
// Event sink that accumulates into a di_parse_result (user = the result).
void di_parse_result_emit(void *user, const di_parse_event *ev);
// Whole-text parse: equivalent to feeding text and ending with reason. DI_ERR_NOMEM.
di_status di_parse_text(const di_parse_options *opt, const char *text, size_t n,
                        di_parse_finish reason, di_parse_result *out);
