/*
 * render — DeepSeek V4 / V4.1 prompt rendering (spec serving.md §1): a conversation (messages,
 * tools, thinking mode, effort) becomes the exact prompt text of the official encoder and, with a
 * tokenizer, its token ids.
 *
 * The rendered text is kept together with the byte ranges that are special tokens (role tokens,
 * <think>, ｜DSML｜, ... written by the template). Ids are those tokens' ids plus plain BPE of the
 * text between them, so text from users (content, reasoning, tool arguments and results, schemas)
 * never turns into control tokens (§1.1 rule 2), and the ids equal the official encoder's
 * tokenizer.encode(prompt) whenever the content holds no special-token text.
 *
 * Owns: nothing after a call returns except the di_render_out it filled. Does not: convert HTTP
 * API requests (tools/server), parse model output (parse.c).
 * Thread-safety: any thread; inputs are read only.
 */
#pragma once

#include <jansson.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "base/buf.h"  // di_buf
#include "deepinfer.h" // di_status, di_tokenizer

typedef enum di_render_role {
    DI_RENDER_ROLE_SYSTEM = 0,
    DI_RENDER_ROLE_USER,
    DI_RENDER_ROLE_ASSISTANT,
    DI_RENDER_ROLE_TOOL,
    DI_RENDER_ROLE_DEVELOPER,       // internal search-agent role (golden 3)
    DI_RENDER_ROLE_LATEST_REMINDER, // internal (goldens 3, 4)
} di_render_role;

typedef enum di_render_task {
    DI_RENDER_TASK_NONE = 0,
    DI_RENDER_TASK_ACTION,
    DI_RENDER_TASK_QUERY,
    DI_RENDER_TASK_AUTHORITY,
    DI_RENDER_TASK_DOMAIN,
    DI_RENDER_TASK_TITLE,
    DI_RENDER_TASK_READ_URL,
} di_render_task;

typedef struct di_render_call {
    const char *id;        // borrowed; may be NULL
    const char *name;      // borrowed
    const char *arguments; // borrowed JSON text of an object (rendered raw if it does not parse)
} di_render_call;

// One content block of a user/tool/system message (V4.1 images, tool-result text parts).
typedef struct di_render_block {
    bool is_image; // an image placeholder (V4.1: <｜deepseek_image｜>; V4: "[Unsupported image]")
    const char *text; // borrowed text of a text block
    bool snapshot;    // a snapshot point right after this block (di_render_out.marks)
} di_render_block;

typedef struct di_render_msg {
    di_render_role role;
    const char *content;           // borrowed; NULL = absent (renders as "")
    const char *reasoning;         // borrowed reasoning_content; NULL = absent
    const di_render_block *blocks; // borrowed; used instead of content when n_blocks > 0
    size_t n_blocks;
    const di_render_call *calls; // borrowed
    size_t n_calls;
    const char *tool_call_id;      // borrowed (tool messages)
    const json_t *tools;           // borrowed OpenAI tool list carried by a system/developer msg
    const json_t *response_format; // borrowed, carried by a system/developer message
    di_render_task task;
    bool prefix; // chat prefix completion: last assistant message, rendered without EOS
    // A snapshot point (di_render_out.marks) after this message: after its content (system,
    // user, tool: before what follows it in the same turn), after its EOS (assistant), after its
    // tools (developer, latest_reminder: after the content).
    bool snapshot;
} di_render_msg;

typedef enum di_render_encoding {
    DI_RENDER_ENCODING_DSV4 = 0,
    DI_RENDER_ENCODING_DSV41 = 1,
} di_render_encoding;

typedef enum di_render_effort_table {
    DI_RENDER_EFFORT_TABLE_V4_0424 = 0, // high: no text, max: text A
    DI_RENDER_EFFORT_TABLE_V4_0731 = 1, // low: no text, high: text A, max: text B
} di_render_effort_table;

typedef enum di_render_tool_choice {
    DI_RENDER_TOOL_CHOICE_AUTO = 0,
    DI_RENDER_TOOL_CHOICE_NONE,
    DI_RENDER_TOOL_CHOICE_REQUIRED, // the prompt ends with the opening of a DSML block
} di_render_tool_choice;

// Effort levels; V4.1 also takes numbers 1..100 (effort_value).
enum {
    DI_RENDER_EFFORT_DEFAULT = 0, // high
    DI_RENDER_EFFORT_LOW = -1,
    DI_RENDER_EFFORT_HIGH = -2,
    DI_RENDER_EFFORT_MAX = -3,
};

typedef struct di_render_conv {
    const di_render_msg *msgs; // borrowed
    size_t n_msgs;
    const json_t *tools;           // request tools (put on the first system message, §1.2 step 3)
    const json_t *response_format; // request response_format ({"type": "json_object"}, ...)
    di_render_tool_choice tool_choice;
    di_render_encoding encoding;
    di_render_effort_table effort_table; // dsv4 only
    bool thinking;                       // thinking mode (else chat / non-think)
    int32_t effort;                      // DI_RENDER_EFFORT_* or, for dsv41, 1..100
    bool keep_reasoning;                 // disables drop_thinking (§1.7); default false
    bool normalize_system; // recipe normalisation of system messages (§1.2 step 2); the API
                           // layer sets it, parity tests with the official encoder do not
    bool no_bos;           // do not start with BOS
    bool snapshot_system;  // a snapshot point at the end of the system prefix (its marks)
} di_render_conv;

enum { DI_RENDER_MAX_MARKS = 16 };

typedef struct di_render_out {
    di_buf text;         // owned: the prompt text
    size_t *special_off; // owned [n_special]: byte offsets of special tokens in text
    int32_t *special_len;
    size_t n_special;
    size_t cap_special;
    bool ends_in_tool_calls; // the prompt forces a tool call: the parser starts in ToolCalls
    bool ends_in_reasoning;  // the output continues reasoning (thinking header or open prefix)
    // Where the system prefix ends: the byte offset in text of the first message that is not a
    // leading system message (system messages, tools, response format and, V4.1 thinking, the
    // effort line all come before it); 0 when there is no such prefix or nothing follows it.
    size_t system_end;
    // Snapshot points requested by the conversation (the snapshot flags of messages and blocks,
    // snapshot_system), as byte offsets in text, in text order (repeats possible); at most
    // DI_RENDER_MAX_MARKS (more are dropped).
    size_t marks[DI_RENDER_MAX_MARKS];
    size_t n_marks;
} di_render_out;

void di_render_out_init(di_render_out *o);
void di_render_out_deinit(di_render_out *o);

// Renders conv into out (cleared first). DI_ERR_INVALID (a message that the format cannot express:
// developer without content, prefix on a message that is not the last assistant, effort out of
// range, tool arguments that are not a JSON object are rendered raw), DI_ERR_NOMEM.
di_status di_render_conv_text(const di_render_conv *conv, di_render_out *out);

// Ids of a rendered prompt: special ranges become their token ids, the rest plain BPE.
// DI_ERR_UNSUPPORTED if the tokenizer has no token for a special string used (e.g. <｜System｜>
// with the V4 tokenizer), DI_ERR_NOMEM. *ids: free with di_tok_free.
di_status di_render_ids(const di_tokenizer *tok, const di_render_out *r, int32_t **ids,
                        size_t *n_ids);

// The token offset of text offset `off` of a rendered prompt whose ids are ids[n_ids] (from
// di_render_ids of the same di_render_out): the number of leading ids whose bytes all lie before
// off. Exact (tokens[0 .. t) are the ids of the text before off alone) when off is next to a
// special token (the system prefix's end before a user turn); inside plain text, the last token
// boundary at or before off. -1 if the ids' bytes do not add up to the text (other ids).
int32_t di_render_token_offset(const di_tokenizer *tok, const int32_t *ids, size_t n_ids,
                               size_t off);

// FIM prompt (§1.10): BOS<｜fim▁begin｜>{prefix}<｜fim▁hole｜>{suffix}<｜fim▁end｜>.
di_status di_render_fim(const char *prefix, const char *suffix, di_render_out *out);

// Python json.dumps(v, ensure_ascii=False) of a JSON value (spec §1.6 number and string rules).
di_status di_render_pyjson(const json_t *v, di_buf *out);

// Builds a conversation from the official encoder's JSON input: either a bare message array or
// an object {"messages": [...], "tools": [...], "response_format"?, "thinking_mode"?: "chat"|
// "thinking", "reasoning_effort"?: "low"|"high"|"max"|n, "encoding"?: "dsv4"|"dsv41",
// "effort_table"?, "tool_choice"?, "drop_thinking"?, "normalize_system"?, "snapshot_system"?};
// deepinfer's "snapshot": true on a message or a content block sets its snapshot flag. Strings in
// conv borrow from doc; arrays are allocated into *mem (free with di_render_conv_free_mem).
// DI_ERR_INVALID with a log line naming the bad field.
di_status di_render_conv_from_json(const json_t *doc, di_render_conv *conv, void **mem);
void di_render_conv_free_mem(void *mem);
