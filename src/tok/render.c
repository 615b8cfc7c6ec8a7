// render — DeepSeek V4 / V4.1 prompt rendering (see render.h; spec serving.md §1.2-§1.10).
// The order of operations is the official encoder's: normalise, attach tools, merge tool results,
// sort them, drop old reasoning, render each message with the transition rule.
#include "tok/render.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/log.h"
#include "base/mem.h"
#include "base/status.h" // DI_TRY
#include "tok/tokenizer.h"

// ---- fixed strings (spec §1.1, §1.5, §1.6) ----

#define S_BOS "<｜begin▁of▁sentence｜>"
#define S_EOS "<｜end▁of▁sentence｜>"
#define S_USER "<｜User｜>"
#define S_ASSISTANT "<｜Assistant｜>"
#define S_SYSTEM "<｜System｜>"
#define S_REMINDER "<｜latest_reminder｜>"
#define S_THINK "<think>"
#define S_UNTHINK "</think>"
#define S_DSML "｜DSML｜"
#define S_IMAGE "<｜deepseek_image｜>"

// Strings that are special tokens wherever the template writes them.
static const char *const k_specials[] = {
    S_BOS,
    S_EOS,
    S_USER,
    S_ASSISTANT,
    S_SYSTEM,
    S_REMINDER,
    S_THINK,
    S_UNTHINK,
    S_DSML,
    S_IMAGE,
    "<｜action｜>",
    "<｜query｜>",
    "<｜authority｜>",
    "<｜domain｜>",
    "<｜title｜>",
    "<｜read_url｜>",
    "<｜fim▁begin｜>",
    "<｜fim▁hole｜>",
    "<｜fim▁end｜>",
};

static const char *const k_task_token[] = {
    [DI_RENDER_TASK_ACTION] = "<｜action｜>",       [DI_RENDER_TASK_QUERY] = "<｜query｜>",
    [DI_RENDER_TASK_AUTHORITY] = "<｜authority｜>", [DI_RENDER_TASK_DOMAIN] = "<｜domain｜>",
    [DI_RENDER_TASK_TITLE] = "<｜title｜>",         [DI_RENDER_TASK_READ_URL] = "<｜read_url｜>",
};

static const char k_effort_a[] =
    "Reasoning Effort: Absolute maximum with no shortcuts permitted.\n"
    "You MUST be very thorough in your thinking and comprehensively decompose the problem to "
    "resolve the root cause, rigorously stress-testing your logic against all potential paths, "
    "edge cases, and adversarial scenarios.\n"
    "Explicitly write out your entire deliberation process, documenting every intermediate step, "
    "considered alternative, and rejected hypothesis to ensure absolutely no assumption is left "
    "unchecked.\n\n";

static const char k_effort_b[] =
    "Reasoning Effort: Beyond maximum \xe2\x80\x94 exhaustive, relentless, and uncompromising.\n"
    "You MUST reason with the utmost depth and rigor, leaving absolutely nothing to chance: "
    "exhaustively decompose the problem into its most fundamental components, trace every causal "
    "chain to its root, and resolve the underlying cause rather than any surface symptom.\n"
    "Do not stop reasoning until you have independently verified the solution from multiple "
    "angles and are certain that no assumption remains unchecked and no error remains "
    "undiscovered.\n\n";

// Tools block (§1.6) in V4 spelling; tag names after ｜DSML｜ are respelled for V4.1.
static const char k_tools_head[] =
    "## Tools\n\n"
    "You have access to a set of tools to help answer the user's question. You can invoke tools by "
    "writing a \"<｜DSML｜@calls>\" block like the following:\n\n"
    "<｜DSML｜@calls>\n"
    "<｜DSML｜@invoke name=\"$TOOL_NAME\">\n"
    "<｜DSML｜@parameter name=\"$PARAMETER_NAME\" string=\"true|false\">$PARAMETER_VALUE"
    "</｜DSML｜@parameter>\n"
    "...\n"
    "</｜DSML｜@invoke>\n"
    "<｜DSML｜@invoke name=\"$TOOL_NAME2\">\n"
    "...\n"
    "</｜DSML｜@invoke>\n"
    "</｜DSML｜@calls>\n\n"
    "String parameters should be specified as is and set `string=\"true\"`. For all other types "
    "(numbers, booleans, arrays, objects), pass the value in JSON format and set "
    "`string=\"false\"`.\n\n"
    "If thinking_mode is enabled (triggered by <think>), you MUST output your complete reasoning "
    "inside <think>...</think> BEFORE any tool calls or final response.\n\n"
    "Otherwise, output directly after </think> with tool calls or final response.\n\n"
    "### Available Tool Schemas\n\n";
static const char k_tools_tail[] =
    "\nYou MUST strictly follow the above defined tool name and parameter schemas to invoke tool "
    "calls.\n";

// ---- output buffer with special ranges ----

void di_render_out_init(di_render_out *o) {
    memset(o, 0, sizeof *o);
    di_buf_init(&o->text);
}

void di_render_out_deinit(di_render_out *o) {
    di_buf_deinit(&o->text);
    di_free(o->special_off);
    di_free(o->special_len);
    memset(o, 0, sizeof *o);
}

static di_status add_special(di_render_out *o, size_t off, size_t len) {
    if (o->n_special == o->cap_special) {
        size_t cap = o->cap_special ? o->cap_special * 2 : 64;
        size_t *no = di_realloc(o->special_off, cap * sizeof *no);
        if (!no) return DI_ERR_NOMEM;
        o->special_off = no;
        int32_t *nl = di_realloc(o->special_len, cap * sizeof *nl);
        if (!nl) return DI_ERR_NOMEM;
        o->special_len = nl;
        o->cap_special = cap;
    }
    o->special_off[o->n_special] = off;
    o->special_len[o->n_special] = (int32_t)len;
    o->n_special++;
    return DI_OK;
}

// Content: plain text, never special.
static di_status put(di_render_out *o, const char *s) {
    return s ? di_buf_append_str(&o->text, s) : DI_OK;
}

static di_status put_n(di_render_out *o, const char *s, size_t n) {
    return di_buf_append(&o->text, s, n);
}

// A snapshot point here.
static void mark(di_render_out *o) {
    if (o->n_marks < DI_RENDER_MAX_MARKS) o->marks[o->n_marks++] = o->text.len;
}

// s with snapshot points at the offsets marks[n] (ascending) of it.
static di_status put_marked(di_render_out *o, const char *s, const size_t *marks, size_t n) {
    size_t at = 0;
    for (size_t i = 0; s && i < n; i++) {
        di_status st = put_n(o, s + at, marks[i] - at);
        if (st != DI_OK) return st;
        at = marks[i];
        mark(o);
    }
    return put(o, s ? s + at : NULL);
}

// Template text: the special strings in it are special tokens. '@' in template text is replaced by
// the DSML tag-name separator of the encoding ("" for V4 "tool_calls", " " for V4.1 " calls").
typedef struct rctx {
    const di_render_conv *c;
    di_render_out *o;
    bool v41;
} rctx;

static di_status tpl(rctx *r, const char *s) {
    di_status st;
    while (*s) {
        if (*s == '@') {
            // DSML tag names: "@calls" is "tool_calls" in V4 and " calls" in V4.1; "@invoke" and
            // "@parameter" are "invoke" / " invoke" and "parameter" / " parameter".
            s++;
            const char *sep = r->v41 ? " " : strncmp(s, "calls", 5) == 0 ? "tool_" : "";
            if ((st = put(r->o, sep)) != DI_OK) return st;
            continue;
        }
        size_t best = 0;
        for (size_t i = 0; i < sizeof k_specials / sizeof k_specials[0]; i++) {
            size_t n = strlen(k_specials[i]);
            if (n > best && strncmp(s, k_specials[i], n) == 0) best = n;
        }
        if (best) {
            if ((st = add_special(r->o, r->o->text.len, best)) != DI_OK) return st;
            if ((st = put_n(r->o, s, best)) != DI_OK) return st;
            s += best;
            continue;
        }
        size_t run = 1;
        while (s[run] && s[run] != '@' && s[run] != '<' && (unsigned char)s[run] != 0xEF) run++;
        if ((st = put_n(r->o, s, run)) != DI_OK) return st;
        s += run;
    }
    return DI_OK;
}

// ---- Python-style JSON (spec §1.6) ----

static di_status pystr(const char *s, size_t n, di_buf *b) {
    di_status st = di_buf_append(b, "\"", 1);
    size_t run = 0;
    for (size_t i = 0; i < n && st == DI_OK; i++) {
        unsigned char c = (unsigned char)s[i];
        const char *esc = NULL;
        char u[8];
        switch (c) {
        case '"':
            esc = "\\\"";
            break;
        case '\\':
            esc = "\\\\";
            break;
        case '\n':
            esc = "\\n";
            break;
        case '\r':
            esc = "\\r";
            break;
        case '\t':
            esc = "\\t";
            break;
        case '\b':
            esc = "\\b";
            break;
        case '\f':
            esc = "\\f";
            break;
        default:
            if (c < 0x20) {
                snprintf(u, sizeof u, "\\u%04x", c);
                esc = u;
            }
        }
        if (!esc) continue;
        if (i > run) st = di_buf_append(b, s + run, i - run);
        if (st == DI_OK) st = di_buf_append_str(b, esc);
        run = i + 1;
    }
    if (st == DI_OK && n > run) st = di_buf_append(b, s + run, n - run);
    if (st == DI_OK) st = di_buf_append(b, "\"", 1);
    return st;
}

// Python repr(float): shortest round-trip digits; exponent form when exp < -4 or exp >= 16.
static di_status pyfloat(double d, di_buf *b) {
    if (isnan(d)) return di_buf_append_str(b, "NaN");
    if (isinf(d)) return di_buf_append_str(b, d < 0 ? "-Infinity" : "Infinity");
    if (d == 0) return di_buf_append_str(b, signbit(d) ? "-0.0" : "0.0");
    char e[40];
    for (int p = 1; p <= 17; p++) {
        snprintf(e, sizeof e, "%.*e", p - 1, d);
        if (strtod(e, NULL) == d) break;
    }
    // e = [-]D[.DDD]e[+-]XX
    const char *q = e;
    bool neg = *q == '-';
    if (neg) q++;
    char digits[32];
    int nd = 0;
    for (; *q && *q != 'e'; q++)
        if (*q != '.') digits[nd++] = *q;
    while (nd > 1 && digits[nd - 1] == '0') nd--;
    int exp = atoi(q + 1);
    char out[64];
    int k = 0;
    if (neg) out[k++] = '-';
    if (exp < -4 || exp >= 16) {
        out[k++] = digits[0];
        if (nd > 1) {
            out[k++] = '.';
            for (int i = 1; i < nd; i++) out[k++] = digits[i];
        }
        k += snprintf(out + k, sizeof out - (size_t)k, "e%c%02d", exp < 0 ? '-' : '+', abs(exp));
    } else if (exp >= 0) {
        for (int i = 0; i <= exp; i++) out[k++] = i < nd ? digits[i] : '0';
        out[k++] = '.';
        if (nd > exp + 1)
            for (int i = exp + 1; i < nd; i++) out[k++] = digits[i];
        else
            out[k++] = '0';
    } else {
        out[k++] = '0';
        out[k++] = '.';
        for (int i = 0; i < -exp - 1; i++) out[k++] = '0';
        for (int i = 0; i < nd; i++) out[k++] = digits[i];
    }
    return di_buf_append(b, out, (size_t)k);
}

di_status di_render_pyjson(const json_t *v, di_buf *b) {
    di_status st = DI_OK;
    switch (json_typeof(v)) {
    case JSON_OBJECT: {
        const char *key;
        json_t *val;
        bool first = true;
        st = di_buf_append(b, "{", 1);
        json_object_foreach((json_t *)v, key, val) {
            if (st == DI_OK && !first) st = di_buf_append(b, ", ", 2);
            first = false;
            if (st == DI_OK) st = pystr(key, strlen(key), b);
            if (st == DI_OK) st = di_buf_append(b, ": ", 2);
            if (st == DI_OK) st = di_render_pyjson(val, b);
        }
        return st == DI_OK ? di_buf_append(b, "}", 1) : st;
    }
    case JSON_ARRAY: {
        size_t i;
        json_t *val;
        st = di_buf_append(b, "[", 1);
        json_array_foreach((json_t *)v, i, val) {
            if (st == DI_OK && i) st = di_buf_append(b, ", ", 2);
            if (st == DI_OK) st = di_render_pyjson(val, b);
        }
        return st == DI_OK ? di_buf_append(b, "]", 1) : st;
    }
    case JSON_STRING:
        return pystr(json_string_value(v), json_string_length(v), b);
    case JSON_INTEGER:
        return di_buf_printf(b, "%lld", (long long)json_integer_value(v));
    case JSON_REAL:
        return pyfloat(json_real_value(v), b);
    case JSON_TRUE:
        return di_buf_append_str(b, "true");
    case JSON_FALSE:
        return di_buf_append_str(b, "false");
    case JSON_NULL:
        return di_buf_append_str(b, "null");
    }
    return DI_ERR_INVALID;
}

static di_status put_pyjson(di_render_out *o, const json_t *v) {
    return di_render_pyjson(v, &o->text);
}

// ---- working messages ----

typedef struct wblock {
    bool is_tool_result;
    bool is_image;
    const char *text;           // borrowed (text block, or tool result content)
    const di_render_block *sub; // tool result given as blocks
    size_t n_sub;
    const char *tool_use_id;
    bool snapshot; // a snapshot point after the block
} wblock;

typedef struct wmsg {
    di_render_role role;
    const char *content;
    const char *reasoning;
    const di_render_call *calls;
    size_t n_calls;
    const json_t *tools;
    const json_t *response_format;
    di_render_task task;
    bool prefix;
    const char *tool_call_id; // borrowed
    char *owned_content;      // owned (merged system text), or NULL
    wblock *blocks;           // owned when merged user/tool turn; NULL: use content
    size_t n_blocks;
    const di_render_block *user_blocks; // borrowed content blocks of a plain message
    size_t n_user_blocks;
    bool snap_end; // a snapshot point after the message (user / tool: moved onto its block)
    size_t cmark[DI_RENDER_MAX_MARKS]; // system: snapshot points at these offsets of content
    size_t n_cmark;
} wmsg;

typedef struct wlist {
    wmsg *m;
    size_t n, cap;
} wlist;

static void wlist_free(wlist *w) {
    for (size_t i = 0; i < w->n; i++) {
        di_free(w->m[i].owned_content);
        di_free(w->m[i].blocks);
    }
    di_free(w->m);
    memset(w, 0, sizeof *w);
}

static di_status wlist_push(wlist *w, const wmsg *m) {
    if (w->n == w->cap) {
        size_t cap = w->cap ? w->cap * 2 : 16;
        wmsg *nm = di_realloc(w->m, cap * sizeof *nm);
        if (!nm) return DI_ERR_NOMEM;
        w->m = nm;
        w->cap = cap;
    }
    w->m[w->n++] = *m;
    return DI_OK;
}

static di_status block_push(wmsg *m, const wblock *b) {
    wblock *nb = di_realloc(m->blocks, (m->n_blocks + 1) * sizeof *nb);
    if (!nb) return DI_ERR_NOMEM;
    m->blocks = nb;
    m->blocks[m->n_blocks++] = *b;
    return DI_OK;
}

static bool is_user_side(di_render_role r) {
    return r == DI_RENDER_ROLE_USER || r == DI_RENDER_ROLE_DEVELOPER;
}

// ---- pipeline steps ----

// §1.2 step 2 (recipe normalisation): leading systems joined by "\n\n"; later ones become user
// messages (V4) or stay system (V4.1).
static di_status normalize_system(const di_render_conv *c, wlist *w) {
    size_t lead = 0;
    while (lead < w->n && w->m[lead].role == DI_RENDER_ROLE_SYSTEM) lead++;
    if (lead > 1) {
        di_buf b;
        di_buf_init(&b);
        di_status st = DI_OK;
        size_t cmark[DI_RENDER_MAX_MARKS], n_cmark = 0;
        for (size_t i = 0; i < lead && st == DI_OK; i++) {
            if (i) st = di_buf_append_str(&b, "\n\n");
            for (size_t k = 0; k < w->m[i].n_cmark && n_cmark < DI_RENDER_MAX_MARKS; k++)
                cmark[n_cmark++] = b.len + w->m[i].cmark[k];
            if (st == DI_OK && w->m[i].content) st = di_buf_append_str(&b, w->m[i].content);
        }
        if (st == DI_OK) st = di_buf_append(&b, "", 0);
        if (st != DI_OK) {
            di_buf_deinit(&b);
            return st;
        }
        wmsg first = w->m[0];
        for (size_t i = 1; i < lead; i++) {
            if (!first.tools) first.tools = w->m[i].tools;
            if (!first.response_format) first.response_format = w->m[i].response_format;
        }
        di_free(first.owned_content);
        for (size_t i = 1; i < lead; i++) di_free(w->m[i].owned_content);
        first.owned_content = di_buf_take(&b);
        first.content = first.owned_content;
        memcpy(first.cmark, cmark, sizeof cmark);
        first.n_cmark = n_cmark;
        w->m[0] = first;
        memmove(w->m + 1, w->m + lead, (w->n - lead) * sizeof *w->m);
        w->n -= lead - 1;
    }
    if (c->encoding == DI_RENDER_ENCODING_DSV4)
        for (size_t i = 1; i < w->n; i++)
            if (w->m[i].role == DI_RENDER_ROLE_SYSTEM) {
                w->m[i].role = DI_RENDER_ROLE_USER; // a user turn: its points at its end
                w->m[i].snap_end = w->m[i].n_cmark > 0;
                w->m[i].n_cmark = 0;
            }
    return DI_OK;
}

// §1.2 step 3: request tools / response format onto the first system message.
static di_status attach_request_tools(const di_render_conv *c, wlist *w) {
    bool tools =
        c->tools && json_array_size(c->tools) > 0 && c->tool_choice != DI_RENDER_TOOL_CHOICE_NONE;
    bool rf = c->response_format && !json_is_null(c->response_format);
    if (!tools && !rf) return DI_OK;
    size_t i = 0;
    while (i < w->n && w->m[i].role != DI_RENDER_ROLE_SYSTEM) i++;
    if (i == w->n) {
        wmsg sys = {.role = DI_RENDER_ROLE_SYSTEM};
        di_status st = wlist_push(w, &sys);
        if (st != DI_OK) return st;
        memmove(w->m + 1, w->m, (w->n - 1) * sizeof *w->m);
        w->m[0] = sys;
        i = 0;
    }
    if (tools) w->m[i].tools = c->tools;
    if (rf) w->m[i].response_format = c->response_format;
    return DI_OK;
}

// §1.2 step 4 (official merge_tool_messages): tool results and following user texts form one
// user turn of blocks; a user message after a task-carrying turn starts a new turn.
static di_status merge_tools(wlist *in, wlist *out) {
    di_status st;
    for (size_t i = 0; i < in->n; i++) {
        wmsg *m = &in->m[i];
        wmsg *last = out->n ? &out->m[out->n - 1] : NULL;
        if (m->role == DI_RENDER_ROLE_TOOL) {
            wblock b = {.is_tool_result = true,
                        .text = m->content ? m->content : "",
                        .sub = m->user_blocks,
                        .n_sub = m->n_user_blocks,
                        .tool_use_id = m->tool_call_id,
                        .snapshot = m->snap_end};
            if (last && last->role == DI_RENDER_ROLE_USER && last->blocks) {
                if ((st = block_push(last, &b)) != DI_OK) return st;
            } else {
                wmsg u = {.role = DI_RENDER_ROLE_USER};
                if ((st = block_push(&u, &b)) != DI_OK) return st;
                if ((st = wlist_push(out, &u)) != DI_OK) {
                    di_free(u.blocks);
                    return st;
                }
            }
        } else if (m->role == DI_RENDER_ROLE_USER) {
            wblock b = {.text = m->content ? m->content : "",
                        .sub = m->user_blocks,
                        .n_sub = m->n_user_blocks,
                        .snapshot = m->snap_end};
            if (last && last->role == DI_RENDER_ROLE_USER && last->blocks &&
                last->task == DI_RENDER_TASK_NONE) {
                if ((st = block_push(last, &b)) != DI_OK) return st;
            } else {
                wmsg u = *m;
                u.owned_content = NULL;
                u.blocks = NULL;
                u.n_blocks = 0;
                u.snap_end = false; // on its block
                if ((st = block_push(&u, &b)) != DI_OK) return st;
                if ((st = wlist_push(out, &u)) != DI_OK) {
                    di_free(u.blocks);
                    return st;
                }
            }
        } else {
            wmsg x = *m;
            m->owned_content = NULL; // moved
            if ((st = wlist_push(out, &x)) != DI_OK) return st;
        }
    }
    return DI_OK;
}

// §1.2 step 5 (official sort_tool_results_by_call_order): stable sort of the tool results of each
// user turn by the call order of the latest assistant with calls; unknown ids sort as 0.
static void sort_tool_results(wlist *w) {
    const di_render_call *calls = NULL;
    size_t n_calls = 0;
    for (size_t i = 0; i < w->n; i++) {
        wmsg *m = &w->m[i];
        if (m->role == DI_RENDER_ROLE_ASSISTANT && m->n_calls) {
            calls = m->calls;
            n_calls = m->n_calls;
            continue;
        }
        if (m->role != DI_RENDER_ROLE_USER || !m->blocks || !n_calls) continue;
        size_t n_tr = 0;
        for (size_t k = 0; k < m->n_blocks; k++) n_tr += m->blocks[k].is_tool_result;
        if (n_tr < 2) continue;
        bool any_id = false;
        for (size_t k = 0; k < n_calls; k++) any_id |= calls[k].id && *calls[k].id;
        if (!any_id) continue;
        // insertion sort of the tool-result blocks (stable), in their own slots
        for (size_t a = 0; a < m->n_blocks; a++) {
            if (!m->blocks[a].is_tool_result) continue;
            for (size_t b = a + 1; b < m->n_blocks; b++) {
                if (!m->blocks[b].is_tool_result) continue;
                size_t ka = 0, kb = 0;
                for (size_t k = 0; k < n_calls; k++) {
                    // the first call with an id wins, as a Python dict built in order keeps the
                    // last; ids are unique in practice
                    if (calls[k].id && m->blocks[a].tool_use_id &&
                        strcmp(calls[k].id, m->blocks[a].tool_use_id) == 0)
                        ka = k;
                    if (calls[k].id && m->blocks[b].tool_use_id &&
                        strcmp(calls[k].id, m->blocks[b].tool_use_id) == 0)
                        kb = k;
                }
                if (kb < ka) { // move b before a, keeping the others' order
                    wblock t = m->blocks[b];
                    size_t prev = b;
                    for (size_t q = b; q-- > a;) {
                        if (!m->blocks[q].is_tool_result) continue;
                        m->blocks[prev] = m->blocks[q];
                        prev = q;
                    }
                    m->blocks[a] = t;
                }
            }
        }
    }
}

static size_t last_user_index(const wlist *w) {
    for (size_t i = w->n; i-- > 0;)
        if (is_user_side(w->m[i].role)) return i;
    return SIZE_MAX;
}

// §1.7 (official _drop_thinking_messages): before the last user-side turn, assistants lose their
// reasoning and developer messages are removed.
static void drop_thinking(wlist *w) {
    size_t lu = last_user_index(w), k = 0;
    for (size_t i = 0; i < w->n; i++) {
        wmsg m = w->m[i];
        if (lu != SIZE_MAX && i < lu) {
            if (m.role == DI_RENDER_ROLE_DEVELOPER) {
                di_free(m.owned_content);
                di_free(m.blocks);
                continue;
            }
            if (m.role == DI_RENDER_ROLE_ASSISTANT) m.reasoning = NULL;
        }
        w->m[k++] = m;
    }
    w->n = k;
}

// ---- rendering ----

static di_status render_tools_block(rctx *r, const json_t *tools) {
    di_status st = tpl(r, k_tools_head);
    size_t i;
    json_t *t;
    json_array_foreach((json_t *)tools, i, t) {
        const json_t *fn = json_object_get(t, "function");
        if (!fn) fn = t; // accept bare function objects
        const json_t *name = json_object_get(fn, "name");
        const json_t *desc = json_object_get(fn, "description");
        const json_t *params = json_object_get(fn, "parameters");
        if (!json_is_string(name)) {
            DI_LOG_ERROR("render: tools[%zu] has no function name", i);
            return DI_ERR_INVALID;
        }
        // §1.6 [design]: exactly name, description (default ""), parameters
        if (st == DI_OK && i) st = put(r->o, "\n");
        if (st == DI_OK) st = put(r->o, "{\"name\": ");
        if (st == DI_OK) st = put_pyjson(r->o, name);
        if (st == DI_OK) st = put(r->o, ", \"description\": ");
        if (st == DI_OK)
            st = desc && !json_is_null(desc) ? put_pyjson(r->o, desc) : put(r->o, "\"\"");
        if (st == DI_OK) st = put(r->o, ", \"parameters\": ");
        if (st == DI_OK) st = params ? put_pyjson(r->o, params) : put(r->o, "{}");
        if (st == DI_OK) st = put(r->o, "}");
    }
    if (st == DI_OK) st = put(r->o, "\n");
    if (st == DI_OK) st = tpl(r, k_tools_tail);
    return st;
}

static di_status render_response_format(rctx *r, const json_t *rf) {
    di_status st = put(r->o, "\n\n## Response Format:\n\nYou MUST strictly adhere to the following "
                             "schema to reply:\n");
    return st == DI_OK ? put_pyjson(r->o, rf) : st;
}

static di_status render_calls(rctx *r, const di_render_call *calls, size_t n) {
    di_status st = tpl(r, "\n\n<｜DSML｜@calls>\n");
    for (size_t i = 0; i < n && st == DI_OK; i++) {
        if (i) st = put(r->o, "\n");
        if (st == DI_OK) st = tpl(r, "<｜DSML｜@invoke name=\"");
        if (st == DI_OK) st = put(r->o, calls[i].name ? calls[i].name : "");
        if (st == DI_OK) st = put(r->o, "\">\n");
        json_error_t err;
        const char *a = calls[i].arguments ? calls[i].arguments : "";
        json_t *args = json_loads(a, JSON_DECODE_ANY, &err);
        if (json_is_object(args)) {
            const char *key;
            json_t *val;
            bool first = true;
            json_object_foreach(args, key, val) {
                if (st == DI_OK && !first) st = put(r->o, "\n");
                first = false;
                if (st == DI_OK) st = tpl(r, "<｜DSML｜@parameter name=\"");
                if (st == DI_OK) st = put(r->o, key);
                if (json_is_string(val)) {
                    if (st == DI_OK) st = put(r->o, "\" string=\"true\">");
                    if (st == DI_OK)
                        st = put_n(r->o, json_string_value(val), json_string_length(val));
                } else {
                    if (st == DI_OK) st = put(r->o, "\" string=\"false\">");
                    if (st == DI_OK) st = put_pyjson(r->o, val);
                }
                if (st == DI_OK) st = tpl(r, "</｜DSML｜@parameter>");
            }
        } else {
            // not a JSON object: one raw string parameter named "arguments" (§1.6)
            if (st == DI_OK) st = tpl(r, "<｜DSML｜@parameter name=\"arguments\" string=\"true\">");
            if (st == DI_OK) st = put(r->o, a);
            if (st == DI_OK) st = tpl(r, "</｜DSML｜@parameter>");
        }
        json_decref(args);
        if (st == DI_OK) st = tpl(r, "\n</｜DSML｜@invoke>");
    }
    if (st == DI_OK) st = tpl(r, "\n</｜DSML｜@calls>");
    return st;
}

static di_status render_sub_blocks(rctx *r, const di_render_block *b, size_t n) {
    di_status st = DI_OK;
    for (size_t i = 0; i < n && st == DI_OK; i++) {
        if (i) st = put(r->o, "\n\n");
        if (st != DI_OK) break;
        if (b[i].is_image)
            st = r->v41 ? tpl(r, S_IMAGE) : put(r->o, "[Unsupported image]");
        else
            st = put(r->o, b[i].text);
        if (b[i].snapshot) mark(r->o);
    }
    return st;
}

static di_status render_user_content(rctx *r, const wmsg *m) {
    if (!m->blocks) return put(r->o, m->content);
    di_status st = DI_OK;
    for (size_t i = 0; i < m->n_blocks && st == DI_OK; i++) {
        const wblock *b = &m->blocks[i];
        if (i) st = put(r->o, "\n\n");
        if (st != DI_OK) break;
        if (b->is_tool_result) {
            st = put(r->o, "<tool_result>");
            if (st == DI_OK)
                st = b->n_sub ? render_sub_blocks(r, b->sub, b->n_sub) : put(r->o, b->text);
            if (st == DI_OK) st = put(r->o, "</tool_result>");
        } else {
            st = b->n_sub ? render_sub_blocks(r, b->sub, b->n_sub) : put(r->o, b->text);
        }
        if (b->snapshot) mark(r->o);
    }
    return st;
}

static di_status render_effort(rctx *r) {
    const di_render_conv *c = r->c;
    if (!c->thinking) return DI_OK;
    int32_t e = c->effort == DI_RENDER_EFFORT_DEFAULT ? DI_RENDER_EFFORT_HIGH : c->effort;
    if (r->v41) {
        int32_t n = e == DI_RENDER_EFFORT_LOW    ? 50
                    : e == DI_RENDER_EFFORT_HIGH ? 75
                    : e == DI_RENDER_EFFORT_MAX  ? 100
                                                 : e;
        char line[160];
        snprintf(line, sizeof line,
                 "Reasoning Effort: %d (range 1-100, the higher the value, the more thorough the "
                 "reasoning)\n\n",
                 (int)n);
        return put(r->o, line);
    }
    const char *text = NULL;
    if (c->effort_table == DI_RENDER_EFFORT_TABLE_V4_0424) {
        if (e == DI_RENDER_EFFORT_MAX) text = k_effort_a;
    } else {
        if (e == DI_RENDER_EFFORT_HIGH) text = k_effort_a;
        if (e == DI_RENDER_EFFORT_MAX) text = k_effort_b;
    }
    return text ? put(r->o, text) : DI_OK;
}

// One message of the official render_message, with the V4.1 differences.
static di_status render_message(rctx *r, const wlist *w, size_t idx, bool drop) {
    const di_render_conv *c = r->c;
    const wmsg *m = &w->m[idx];
    size_t lu = last_user_index(w);
    di_status st = DI_OK;
    bool last = idx + 1 == w->n;

    if (idx == 0) {
        if (r->v41 && c->thinking) {
            // effort line inside the first system turn (or a system turn of its own)
            DI_TRY(tpl(r, S_SYSTEM));
            DI_TRY(render_effort(r));
        } else if (!r->v41) {
            DI_TRY(render_effort(r));
        }
    }

    switch (m->role) {
    case DI_RENDER_ROLE_SYSTEM:
        if (r->v41 && !(idx == 0 && c->thinking)) DI_TRY(tpl(r, S_SYSTEM));
        DI_TRY(put_marked(r->o, m->content, m->cmark, m->n_cmark));
        if (m->tools && json_array_size(m->tools)) {
            DI_TRY(put(r->o, "\n\n"));
            DI_TRY(render_tools_block(r, m->tools));
        }
        if (m->response_format) DI_TRY(render_response_format(r, m->response_format));
        break;
    case DI_RENDER_ROLE_DEVELOPER:
        if (!m->content || !*m->content) {
            DI_LOG_ERROR("render: developer messages require content (message %zu)", idx);
            return DI_ERR_INVALID;
        }
        DI_TRY(tpl(r, S_USER));
        DI_TRY(put(r->o, m->content));
        if (m->tools && json_array_size(m->tools)) {
            DI_TRY(put(r->o, "\n\n"));
            DI_TRY(render_tools_block(r, m->tools));
        }
        if (m->response_format) DI_TRY(render_response_format(r, m->response_format));
        break;
    case DI_RENDER_ROLE_USER:
        DI_TRY(tpl(r, S_USER));
        DI_TRY(render_user_content(r, m));
        break;
    case DI_RENDER_ROLE_LATEST_REMINDER:
        DI_TRY(tpl(r, S_REMINDER));
        DI_TRY(put(r->o, m->content));
        break;
    case DI_RENDER_ROLE_TOOL: // merged away before rendering
        return DI_ERR_INVALID;
    case DI_RENDER_ROLE_ASSISTANT: {
        bool prev_task = idx > 0 && w->m[idx - 1].task != DI_RENDER_TASK_NONE;
        if (c->thinking && !prev_task && (!drop || lu == SIZE_MAX || idx > lu)) {
            DI_TRY(put(r->o, m->reasoning));
            // open prefix form [design]: reasoning given, no content yet
            bool open = m->prefix && m->reasoning && (!m->content || !*m->content) && !m->n_calls;
            if (open) {
                r->o->ends_in_reasoning = true;
                return DI_OK;
            }
            DI_TRY(tpl(r, S_UNTHINK));
        }
        DI_TRY(put(r->o, m->content));
        if (m->n_calls) DI_TRY(render_calls(r, m->calls, m->n_calls));
        if (m->prefix) return DI_OK;
        DI_TRY(tpl(r, S_EOS));
        break;
    }
    }

    if (m->snap_end) mark(r->o);
    // transition (§1.3): only before an assistant / latest_reminder, or at the end
    if (!last && w->m[idx + 1].role != DI_RENDER_ROLE_ASSISTANT &&
        w->m[idx + 1].role != DI_RENDER_ROLE_LATEST_REMINDER)
        return DI_OK;
    if (m->task != DI_RENDER_TASK_NONE) {
        if (m->task != DI_RENDER_TASK_ACTION) return tpl(r, k_task_token[m->task]);
        DI_TRY(tpl(r, S_ASSISTANT));
        DI_TRY(tpl(r, c->thinking ? S_THINK : S_UNTHINK));
        return tpl(r, k_task_token[m->task]);
    }
    bool user_side =
        is_user_side(m->role) || (r->v41 && m->role == DI_RENDER_ROLE_SYSTEM && idx > 0 && last);
    if (user_side) {
        DI_TRY(tpl(r, S_ASSISTANT));
        bool think = c->thinking && (!drop || lu == SIZE_MAX || idx >= lu);
        DI_TRY(tpl(r, think ? S_THINK : S_UNTHINK));
        if (last) {
            r->o->ends_in_reasoning = think;
            if (c->tool_choice == DI_RENDER_TOOL_CHOICE_REQUIRED) {
                DI_TRY(tpl(r, "\n\n<｜DSML｜@calls>\n"));
                r->o->ends_in_tool_calls = true;
                r->o->ends_in_reasoning = false;
            }
        }
    }
    return DI_OK;
fail:
    return st;
}

// A system message's text: its content, or its text blocks joined with "\n\n" (images have no
// text in a system prompt); its snapshot points become offsets of that text (w->cmark).
static di_status system_text(const di_render_msg *m, wmsg *w) {
    if (!m->n_blocks) {
        if (m->snapshot) w->cmark[w->n_cmark++] = m->content ? strlen(m->content) : 0;
        w->snap_end = false;
        return DI_OK;
    }
    di_buf b;
    di_buf_init(&b);
    di_status st = DI_OK;
    bool first = true;
    for (size_t k = 0; k < m->n_blocks && st == DI_OK; k++) {
        if (!m->blocks[k].is_image) {
            if (!first) st = di_buf_append_str(&b, "\n\n");
            if (st == DI_OK) st = di_buf_append_str(&b, m->blocks[k].text);
            first = false;
        }
        if (m->blocks[k].snapshot && w->n_cmark < DI_RENDER_MAX_MARKS)
            w->cmark[w->n_cmark++] = b.len;
    }
    if (st == DI_OK && m->snapshot && w->n_cmark < DI_RENDER_MAX_MARKS)
        w->cmark[w->n_cmark++] = b.len;
    if (st == DI_OK) st = di_buf_append(&b, "", 0);
    if (st != DI_OK) {
        di_buf_deinit(&b);
        return st;
    }
    w->owned_content = di_buf_take(&b);
    w->content = w->owned_content;
    w->user_blocks = NULL;
    w->n_user_blocks = 0;
    w->snap_end = false;
    return DI_OK;
}

di_status di_render_conv_text(const di_render_conv *c, di_render_out *out) {
    di_status st = DI_OK;
    wlist a = {0}, b = {0};
    di_buf_clear(&out->text);
    out->n_special = 0;
    out->ends_in_tool_calls = out->ends_in_reasoning = false;
    out->system_end = out->n_marks = 0;
    rctx r = {c, out, c->encoding == DI_RENDER_ENCODING_DSV41};
    if (c->encoding == DI_RENDER_ENCODING_DSV41) {
        if (c->effort != DI_RENDER_EFFORT_DEFAULT && c->effort != DI_RENDER_EFFORT_LOW &&
            c->effort != DI_RENDER_EFFORT_HIGH && c->effort != DI_RENDER_EFFORT_MAX &&
            (c->effort < 1 || c->effort > 100)) {
            DI_LOG_ERROR("render: Invalid reasoning effort: %d", (int)c->effort);
            return DI_ERR_INVALID;
        }
    } else if (c->effort > 0 || c->effort < DI_RENDER_EFFORT_MAX) {
        DI_LOG_ERROR("render: Invalid reasoning effort: %d (dsv4 takes low|high|max)",
                     (int)c->effort);
        return DI_ERR_INVALID;
    }
    for (size_t i = 0; i < c->n_msgs; i++) {
        const di_render_msg *m = &c->msgs[i];
        if (m->prefix && (m->role != DI_RENDER_ROLE_ASSISTANT || i + 1 != c->n_msgs)) {
            DI_LOG_ERROR("render: prefix is only allowed on the last assistant message");
            st = DI_ERR_INVALID;
            goto fail;
        }
        if ((unsigned)m->role > DI_RENDER_ROLE_LATEST_REMINDER ||
            (unsigned)m->task > DI_RENDER_TASK_READ_URL) {
            DI_LOG_ERROR("render: message %zu has an unknown role or task", i);
            st = DI_ERR_INVALID;
            goto fail;
        }
        if (c->encoding == DI_RENDER_ENCODING_DSV41) {
            // §1.1 rule 3 [design]: the image placeholder typed as text would break image
            // accounting; it is refused rather than rendered as plain text
            bool bad = m->content && strstr(m->content, S_IMAGE);
            for (size_t k = 0; k < m->n_blocks; k++)
                bad |= m->blocks[k].text && strstr(m->blocks[k].text, S_IMAGE) != NULL;
            if (bad) {
                DI_LOG_ERROR("render: message %zu contains the image placeholder as text", i);
                st = DI_ERR_INVALID;
                goto fail;
            }
        }
        wmsg w = {.role = m->role,
                  .content = m->content,
                  .reasoning = m->reasoning,
                  .calls = m->calls,
                  .n_calls = m->n_calls,
                  .tools = m->tools,
                  .response_format = m->response_format,
                  .task = m->task,
                  .prefix = m->prefix,
                  .user_blocks = m->blocks,
                  .n_user_blocks = m->n_blocks};
        w.tool_call_id = m->tool_call_id;
        w.snap_end = m->snapshot;
        if (m->role == DI_RENDER_ROLE_SYSTEM) DI_TRY(system_text(m, &w));
        st = wlist_push(&a, &w);
        if (st != DI_OK) {
            di_free(w.owned_content);
            goto fail;
        }
    }
    if (c->normalize_system) DI_TRY(normalize_system(c, &a));
    DI_TRY(attach_request_tools(c, &a));
    DI_TRY(merge_tools(&a, &b));
    sort_tool_results(&b);
    bool drop = !c->keep_reasoning;
    for (size_t i = 0; i < b.n; i++)
        if (b.m[i].tools && json_array_size(b.m[i].tools)) drop = false;
    if (c->thinking && drop) drop_thinking(&b);
    if (!c->no_bos) DI_TRY(tpl(&r, S_BOS));
    if (b.n == 0 && r.v41 && c->thinking) { // effort line with no messages at all
        DI_TRY(tpl(&r, S_SYSTEM));
        DI_TRY(render_effort(&r));
    } else if (b.n == 0) {
        DI_TRY(render_effort(&r));
    }
    size_t lead = 0; // the leading system messages: the system prefix
    while (lead < b.n && b.m[lead].role == DI_RENDER_ROLE_SYSTEM) lead++;
    for (size_t i = 0; i < b.n; i++) {
        if (i == lead && lead > 0) {
            out->system_end = out->text.len;
            if (c->snapshot_system) mark(out);
        }
        DI_TRY(render_message(&r, &b, i, drop));
    }
    st = di_buf_append(&out->text, "", 0);
fail:
    wlist_free(&a);
    wlist_free(&b);
    return st;
}

// ---- ids ----

di_status di_render_ids(const di_tokenizer *tok, const di_render_out *r, int32_t **ids,
                        size_t *n_ids) {
    di_bpe_ids out = {0};
    di_status st = DI_OK;
    size_t pos = 0;
    const char *text = r->text.data ? r->text.data : "";
    for (size_t i = 0; i <= r->n_special && st == DI_OK; i++) {
        size_t end = i < r->n_special ? r->special_off[i] : r->text.len;
        if (end > pos) st = di_tokenizer_encode_into(tok, text + pos, end - pos, false, &out);
        if (st != DI_OK || i == r->n_special) break;
        size_t n = (size_t)r->special_len[i];
        int32_t id = di_vocab_find(di_tokenizer_vocab(tok), text + end, n);
        if (id < 0) {
            DI_LOG_ERROR("render: the tokenizer has no token \"%.*s\" (wrong tokenizer for this "
                         "encoding?)",
                         (int)n, text + end);
            st = DI_ERR_UNSUPPORTED;
            break;
        }
        st = di_bpe_ids_push(&out, id);
        pos = end + n;
    }
    if (st != DI_OK) {
        di_bpe_ids_deinit(&out);
        return st;
    }
    *ids = out.ids;
    *n_ids = out.n;
    return DI_OK;
}

int32_t di_render_token_offset(const di_tokenizer *tok, const int32_t *ids, size_t n_ids,
                               size_t off) {
    size_t at = 0, t = 0;
    for (; t < n_ids; t++) {
        size_t n = 0;
        if (!di_tokenizer_token_bytes(tok, ids[t], &n)) return -1;
        if (at + n > off) break;
        at += n;
    }
    return t <= INT32_MAX ? (int32_t)t : -1;
}

di_status di_render_fim(const char *prefix, const char *suffix, di_render_out *out) {
    rctx r = {NULL, out, false};
    di_buf_clear(&out->text);
    out->n_special = 0;
    di_status st = tpl(&r, S_BOS "<｜fim▁begin｜>");
    if (st == DI_OK) st = put(out, prefix);
    if (st == DI_OK) st = tpl(&r, "<｜fim▁hole｜>");
    if (st == DI_OK) st = put(out, suffix);
    if (st == DI_OK) st = tpl(&r, "<｜fim▁end｜>");
    return st;
}

// ---- conversation from JSON (official encoder input format) ----

typedef struct conv_mem {
    di_render_msg *msgs;
    void **ptrs; // owned allocations (calls, blocks, serialised arguments)
    size_t n_ptrs, cap_ptrs;
} conv_mem;

void di_render_conv_free_mem(void *mem) {
    conv_mem *cm = mem;
    if (!cm) return;
    for (size_t i = 0; i < cm->n_ptrs; i++) di_free(cm->ptrs[i]);
    di_free(cm->ptrs);
    di_free(cm->msgs);
    di_free(cm);
}

static void *mem_keep(conv_mem *cm, void *p) {
    if (!p) return NULL;
    if (cm->n_ptrs == cm->cap_ptrs) {
        size_t cap = cm->cap_ptrs ? cm->cap_ptrs * 2 : 16;
        void **np = di_realloc(cm->ptrs, cap * sizeof *np);
        if (!np) {
            di_free(p);
            return NULL;
        }
        cm->ptrs = np;
        cm->cap_ptrs = cap;
    }
    cm->ptrs[cm->n_ptrs++] = p;
    return p;
}

static bool opt_str(const json_t *o, const char *key, const char **out, size_t i) {
    const json_t *v = json_object_get(o, key);
    if (!v || json_is_null(v)) {
        *out = NULL;
        return true;
    }
    if (!json_is_string(v)) {
        DI_LOG_ERROR("render: messages[%zu].%s must be a string", i, key);
        return false;
    }
    *out = json_string_value(v);
    return true;
}

static di_status parse_blocks(conv_mem *cm, const json_t *arr, const di_render_block **out,
                              size_t *n_out, size_t i) {
    size_t n = json_array_size(arr);
    di_render_block *b = mem_keep(cm, di_calloc(n ? n : 1, sizeof *b));
    if (!b) return DI_ERR_NOMEM;
    for (size_t k = 0; k < n; k++) {
        const json_t *e = json_array_get(arr, k);
        const char *type = json_string_value(json_object_get(e, "type"));
        if (json_is_string(e)) {
            b[k].text = json_string_value(e);
        } else if (type && strcmp(type, "text") == 0 &&
                   json_is_string(json_object_get(e, "text"))) {
            b[k].text = json_string_value(json_object_get(e, "text"));
        } else if (type && (strcmp(type, "image") == 0 || strcmp(type, "image_url") == 0)) {
            b[k].is_image = true;
        } else {
            DI_LOG_ERROR("render: messages[%zu].content[%zu] is not a text or image block", i, k);
            return DI_ERR_INVALID;
        }
    }
    for (size_t k = 0; k < n; k++)
        b[k].snapshot = json_is_true(json_object_get(json_array_get(arr, k), "snapshot"));
    *out = b;
    *n_out = n;
    return DI_OK;
}

static di_status parse_effort(const json_t *v, int32_t *out) {
    if (!v || json_is_null(v)) {
        *out = DI_RENDER_EFFORT_DEFAULT;
        return DI_OK;
    }
    if (json_is_integer(v)) {
        json_int_t n = json_integer_value(v);
        if (n < 1 || n > 100) goto bad;
        *out = (int32_t)n;
        return DI_OK;
    }
    const char *s = json_string_value(v);
    if (!s) goto bad;
    // API-level mapping (§1.5): minimal/low → low, medium/high/xhigh → high, max/ultra → max
    if (!strcmp(s, "low") || !strcmp(s, "minimal"))
        *out = DI_RENDER_EFFORT_LOW;
    else if (!strcmp(s, "high") || !strcmp(s, "medium") || !strcmp(s, "xhigh"))
        *out = DI_RENDER_EFFORT_HIGH;
    else if (!strcmp(s, "max") || !strcmp(s, "ultra"))
        *out = DI_RENDER_EFFORT_MAX;
    else
        goto bad;
    return DI_OK;
bad:
    DI_LOG_ERROR("render: Invalid reasoning effort (bools, floats and unknown names are rejected)");
    return DI_ERR_INVALID;
}

static const struct {
    const char *name;
    int value;
} k_roles[] = {{"system", DI_RENDER_ROLE_SYSTEM},
               {"user", DI_RENDER_ROLE_USER},
               {"assistant", DI_RENDER_ROLE_ASSISTANT},
               {"tool", DI_RENDER_ROLE_TOOL},
               {"developer", DI_RENDER_ROLE_DEVELOPER},
               {"latest_reminder", DI_RENDER_ROLE_LATEST_REMINDER}},
  k_tasks[] = {{"action", DI_RENDER_TASK_ACTION},       {"query", DI_RENDER_TASK_QUERY},
               {"authority", DI_RENDER_TASK_AUTHORITY}, {"domain", DI_RENDER_TASK_DOMAIN},
               {"title", DI_RENDER_TASK_TITLE},         {"read_url", DI_RENDER_TASK_READ_URL}};

static di_status parse_msg(conv_mem *cm, const json_t *jm, di_render_msg *m, size_t i) {
    if (!json_is_object(jm)) {
        DI_LOG_ERROR("render: messages[%zu] is not an object", i);
        return DI_ERR_INVALID;
    }
    const char *role = json_string_value(json_object_get(jm, "role"));
    m->role = (di_render_role)-1;
    for (size_t k = 0; role && k < sizeof k_roles / sizeof k_roles[0]; k++)
        if (!strcmp(role, k_roles[k].name)) m->role = (di_render_role)k_roles[k].value;
    if ((int)m->role < 0) {
        DI_LOG_ERROR("render: messages[%zu].role is missing or unknown", i);
        return DI_ERR_INVALID;
    }
    const json_t *content = json_object_get(jm, "content");
    if (json_is_array(content)) {
        di_status st = parse_blocks(cm, content, &m->blocks, &m->n_blocks, i);
        if (st != DI_OK) return st;
    } else if (!opt_str(jm, "content", &m->content, i)) {
        return DI_ERR_INVALID;
    }
    if (!opt_str(jm, "reasoning_content", &m->reasoning, i) ||
        !opt_str(jm, "tool_call_id", &m->tool_call_id, i))
        return DI_ERR_INVALID;
    const char *task = NULL;
    if (!opt_str(jm, "task", &task, i)) return DI_ERR_INVALID;
    if (task) {
        for (size_t k = 0; k < sizeof k_tasks / sizeof k_tasks[0]; k++)
            if (!strcmp(task, k_tasks[k].name)) m->task = (di_render_task)k_tasks[k].value;
        if (m->task == DI_RENDER_TASK_NONE) {
            DI_LOG_ERROR("render: messages[%zu].task '%s' is unknown", i, task);
            return DI_ERR_INVALID;
        }
    }
    const json_t *tools = json_object_get(jm, "tools");
    if (tools && !json_is_null(tools)) {
        if (!json_is_array(tools)) {
            DI_LOG_ERROR("render: messages[%zu].tools must be an array", i);
            return DI_ERR_INVALID;
        }
        m->tools = tools;
    }
    const json_t *rf = json_object_get(jm, "response_format");
    if (rf && !json_is_null(rf)) m->response_format = rf;
    m->prefix =
        json_is_true(json_object_get(jm, "prefix")) || json_is_true(json_object_get(jm, "wo_eos"));
    m->snapshot = json_is_true(json_object_get(jm, "snapshot"));
    const json_t *calls = json_object_get(jm, "tool_calls");
    if (calls && !json_is_null(calls)) {
        if (!json_is_array(calls)) {
            DI_LOG_ERROR("render: messages[%zu].tool_calls must be an array", i);
            return DI_ERR_INVALID;
        }
        size_t n = json_array_size(calls);
        di_render_call *c = mem_keep(cm, di_calloc(n ? n : 1, sizeof *c));
        if (!c) return DI_ERR_NOMEM;
        for (size_t k = 0; k < n; k++) {
            const json_t *jc = json_array_get(calls, k);
            const json_t *fn = json_object_get(jc, "function");
            if (!fn) fn = jc;
            c[k].id = json_string_value(json_object_get(jc, "id"));
            c[k].name = json_string_value(json_object_get(fn, "name"));
            const json_t *args = json_object_get(fn, "arguments");
            if (!c[k].name) {
                DI_LOG_ERROR("render: messages[%zu].tool_calls[%zu] has no function name", i, k);
                return DI_ERR_INVALID;
            }
            if (json_is_string(args)) {
                c[k].arguments = json_string_value(args);
            } else if (args && !json_is_null(args)) { // an object given directly
                di_buf b;
                di_buf_init(&b);
                di_status st = di_render_pyjson(args, &b);
                if (st == DI_OK) st = di_buf_append(&b, "", 0);
                if (st != DI_OK) {
                    di_buf_deinit(&b);
                    return st;
                }
                c[k].arguments = mem_keep(cm, di_buf_take(&b));
                if (!c[k].arguments) return DI_ERR_NOMEM;
            } else {
                c[k].arguments = "";
            }
        }
        m->calls = c;
        m->n_calls = n;
    }
    return DI_OK;
}

di_status di_render_conv_from_json(const json_t *doc, di_render_conv *conv, void **mem) {
    memset(conv, 0, sizeof *conv);
    const json_t *msgs = json_is_array(doc) ? doc : json_object_get(doc, "messages");
    if (!json_is_array(msgs)) {
        DI_LOG_ERROR("render: expected a message array or an object with \"messages\"");
        return DI_ERR_INVALID;
    }
    conv_mem *cm = di_calloc(1, sizeof *cm);
    if (!cm) return DI_ERR_NOMEM;
    size_t n = json_array_size(msgs);
    cm->msgs = di_calloc(n ? n : 1, sizeof *cm->msgs);
    di_status st = cm->msgs ? DI_OK : DI_ERR_NOMEM;
    for (size_t i = 0; i < n && st == DI_OK; i++)
        st = parse_msg(cm, json_array_get(msgs, i), &cm->msgs[i], i);
    conv->msgs = cm->msgs;
    conv->n_msgs = n;
    conv->thinking = true;
    if (st == DI_OK && json_is_object(doc)) {
        const json_t *tools = json_object_get(doc, "tools");
        if (tools && !json_is_null(tools)) {
            if (!json_is_array(tools)) {
                DI_LOG_ERROR("render: tools must be an array");
                st = DI_ERR_INVALID;
            }
            conv->tools = tools;
        }
        const json_t *rf = json_object_get(doc, "response_format");
        if (rf && !json_is_null(rf)) conv->response_format = rf;
        const char *s;
        if ((s = json_string_value(json_object_get(doc, "thinking_mode"))))
            conv->thinking = strcmp(s, "chat") != 0;
        if (json_is_boolean(json_object_get(doc, "thinking")))
            conv->thinking = json_is_true(json_object_get(doc, "thinking"));
        if (st == DI_OK) st = parse_effort(json_object_get(doc, "reasoning_effort"), &conv->effort);
        if ((s = json_string_value(json_object_get(doc, "encoding")))) {
            if (!strcmp(s, "dsv41"))
                conv->encoding = DI_RENDER_ENCODING_DSV41;
            else if (strcmp(s, "dsv4") != 0) {
                DI_LOG_ERROR("render: encoding must be dsv4 or dsv41");
                st = DI_ERR_INVALID;
            }
        }
        if ((s = json_string_value(json_object_get(doc, "effort_table"))))
            conv->effort_table = !strcmp(s, "v4_0731") ? DI_RENDER_EFFORT_TABLE_V4_0731
                                                       : DI_RENDER_EFFORT_TABLE_V4_0424;
        if ((s = json_string_value(json_object_get(doc, "tool_choice")))) {
            if (!strcmp(s, "none"))
                conv->tool_choice = DI_RENDER_TOOL_CHOICE_NONE;
            else if (!strcmp(s, "required"))
                conv->tool_choice = DI_RENDER_TOOL_CHOICE_REQUIRED;
        }
        conv->keep_reasoning = json_is_false(json_object_get(doc, "drop_thinking"));
        conv->normalize_system = json_is_true(json_object_get(doc, "normalize_system"));
        conv->snapshot_system = json_is_true(json_object_get(doc, "snapshot_system"));
        conv->no_bos = json_is_false(json_object_get(doc, "add_bos"));
    }
    if (st != DI_OK) {
        di_render_conv_free_mem(cm);
        memset(conv, 0, sizeof *conv);
        return st;
    }
    *mem = cm;
    return DI_OK;
}
