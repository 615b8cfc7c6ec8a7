// parse — incremental DSML/reasoning output parser (see parse.h; spec serving.md §1.11).
#include "tok/parse.h"

#include <stdio.h>
#include <string.h>

#include "base/log.h"
#include "base/mem.h"
#include "tok/tokenizer.h"

typedef enum stage {
    ST_REASONING = 0,
    ST_CONTENT,
    ST_TOOL_CALLS,
    ST_TOOL_NAME,
    ST_ARGS,
    ST_PARAM_NAME,
    ST_PARAM_TYPE,
    ST_VALUE_STR,
    ST_VALUE_RAW,
    ST_FINISHED,
} stage;

#define MAX_STOP 16
#define MAX_LABELS (4 + MAX_STOP)

struct di_parse {
    di_parse_options opt;
    di_parse_emit_fn emit;
    void *user;
    stage st;
    bool leading;       // drop leading newlines of the reasoning/content section
    int32_t n_calls;    // calls begun
    bool call_open;     // a call has begun and not ended
    int32_t n_params;   // parameters of the open call
    di_buf pending;     // owned: bytes not yet processed (held back)
    di_buf scratch;     // owned: escaped text for events
    di_buf param_names; // owned: NUL-separated parameter names of the open call
    di_buf cur_name;    // owned: name of the parameter being read
    di_detok *detok;    // owned, created on the first token
    const di_tokenizer *detok_tok;
    uint32_t flags;
    bool completed_call;
    di_parse_finish finish;
    // JSON mode filter over content (opt.json_output)
    int json_state;    // JS_* below
    char json_hold[8]; // bytes that may still become a fence (before) or its end (fenced)
    size_t json_n_hold;
    int32_t json_depth;
    bool json_in_string, json_escape;
    di_buf json_out;    // owned: filtered bytes of one content event
    bool json_emitting; // the filter is emitting its output (not to be filtered again)
};

static const char k_think_end[] = "</think>";
static const char k_dsml[] = "<｜DSML｜";
static const char k_dsml_close[] = "</｜DSML｜";
static const char k_invoke[] = "invoke name=\"";
static const char k_param[] = "parameter name=\"";
static const char k_end_v4[] = "</｜DSML｜tool_calls>";
static const char k_end_v41[] = "</｜DSML｜ calls>";

// ---- lifecycle ----

di_status di_parse_create(const di_parse_options *opt, di_parse_emit_fn emit, void *user,
                          di_parse **out) {
    if (!opt || !emit || !out || opt->n_stop > MAX_STOP) return DI_ERR_INVALID;
    for (size_t i = 0; i < opt->n_stop; i++) {
        size_t n = opt->stop[i] ? strlen(opt->stop[i]) : 0;
        if (n == 0 || n > 256) {
            DI_LOG_ERROR("parse: stop string %zu is empty or longer than 256 bytes", i);
            return DI_ERR_INVALID;
        }
    }
    di_parse *p = di_calloc(1, sizeof *p);
    if (!p) return DI_ERR_NOMEM;
    p->opt = *opt;
    p->emit = emit;
    p->user = user;
    p->st = opt->start == DI_PARSE_STAGE_REASONING ? ST_REASONING
            : opt->start == DI_PARSE_STAGE_CONTENT ? ST_CONTENT
                                                   : ST_TOOL_CALLS;
    p->leading = true;
    di_buf_init(&p->pending);
    di_buf_init(&p->scratch);
    di_buf_init(&p->param_names);
    di_buf_init(&p->cur_name);
    di_buf_init(&p->json_out);
    *out = p;
    return DI_OK;
}

void di_parse_destroy(di_parse *p) {
    if (!p) return;
    di_buf_deinit(&p->pending);
    di_buf_deinit(&p->scratch);
    di_buf_deinit(&p->param_names);
    di_buf_deinit(&p->cur_name);
    di_buf_deinit(&p->json_out);
    di_detok_destroy(p->detok);
    di_free(p);
}

bool di_parse_finished(const di_parse *p) {
    return p->st == ST_FINISHED;
}
uint32_t di_parse_flags(const di_parse *p) {
    return p->flags;
}

// ---- events ----

static bool calls_visible(const di_parse *p) {
    return p->opt.tools_enabled;
}

static void json_filter(di_parse *p, const char *text, size_t n, bool end);

static void emit(di_parse *p, di_parse_event_kind kind, const char *text, size_t n) {
    if (kind == DI_PARSE_EVENT_CONTENT && p->opt.json_output && !p->json_emitting) {
        json_filter(p, text, n, false);
        return;
    }
    bool call_ev = kind >= DI_PARSE_EVENT_TOOL_CALL_BEGIN;
    if (call_ev && !calls_visible(p)) return;
    if (!call_ev && n == 0) return;
    di_parse_event ev = {kind, call_ev ? p->n_calls - 1 : -1, text, n};
    p->emit(p->user, &ev);
}

// ---- JSON mode (spec serving.md §1.8) ----

enum { JS_BEFORE = 0, JS_FENCED, JS_RAW, JS_AFTER };
static const char k_fence_json[] = "```json\n", k_fence_plain[] = "```\n", k_fence_end[] = "\n```";

static bool is_prefix(const char *hold, size_t n, const char *s) {
    return n <= strlen(s) && memcmp(hold, s, n) == 0;
}

static void json_put(di_parse *p, const char *s, size_t n, bool blank) {
    for (size_t i = 0; i < n; i++) (void)di_buf_append(&p->json_out, blank ? " " : s + i, 1);
}

// Filters content bytes; `end` flushes what is held. Emits one CONTENT event per call.
static void json_filter(di_parse *p, const char *text, size_t n, bool end) {
    di_buf_clear(&p->json_out);
    for (size_t i = 0; i < n; i++) {
        char c = text[i];
        switch (p->json_state) {
        case JS_BEFORE:
            if (p->json_n_hold || c == '`') {
                p->json_hold[p->json_n_hold++] = c;
                bool pj = is_prefix(p->json_hold, p->json_n_hold, k_fence_json);
                bool pp = is_prefix(p->json_hold, p->json_n_hold, k_fence_plain);
                if ((pj && p->json_n_hold == strlen(k_fence_json)) ||
                    (pp && p->json_n_hold == strlen(k_fence_plain))) {
                    json_put(p, p->json_hold, p->json_n_hold, true);
                    p->json_n_hold = 0;
                    p->json_state = JS_FENCED;
                } else if (!pj && !pp) { // not a fence: outside text, then look at c again
                    json_put(p, p->json_hold, p->json_n_hold - 1, true);
                    p->json_n_hold = 0;
                    i--;
                    if (c == '`') { // cannot restart a fence on the same byte twice
                        json_put(p, &c, 1, true);
                        i++;
                    }
                }
            } else if (c == '{' || c == '[') {
                p->json_state = JS_RAW;
                p->json_depth = 1;
                json_put(p, &c, 1, false);
            } else {
                json_put(p, &c, 1, true);
            }
            break;
        case JS_FENCED:
            if (p->json_n_hold || c == '\n') {
                p->json_hold[p->json_n_hold++] = c;
                if (!is_prefix(p->json_hold, p->json_n_hold, k_fence_end)) {
                    // not the closing fence: the held bytes are JSON; c is examined again
                    json_put(p, p->json_hold, p->json_n_hold - 1, false);
                    p->json_n_hold = 0;
                    i--;
                    if (c == '\n') { // a newline can itself start the closing fence
                        p->json_hold[p->json_n_hold++] = c;
                        i++;
                    }
                } else if (p->json_n_hold == strlen(k_fence_end)) {
                    json_put(p, p->json_hold, p->json_n_hold, true);
                    p->json_n_hold = 0;
                    p->json_state = JS_AFTER;
                }
            } else {
                json_put(p, &c, 1, false);
            }
            break;
        case JS_RAW:
            json_put(p, &c, 1, false);
            if (p->json_in_string) {
                if (p->json_escape)
                    p->json_escape = false;
                else if (c == '\\')
                    p->json_escape = true;
                else if (c == '"')
                    p->json_in_string = false;
            } else if (c == '"') {
                p->json_in_string = true;
            } else if (c == '{' || c == '[') {
                p->json_depth++;
            } else if ((c == '}' || c == ']') && --p->json_depth == 0) {
                p->json_state = JS_AFTER;
            }
            break;
        default: // JS_AFTER
            json_put(p, &c, 1, true);
        }
    }
    if (end && p->json_n_hold) {
        // an unfinished fence before the JSON is outside text; an unfinished end inside is JSON
        json_put(p, p->json_hold, p->json_n_hold, p->json_state == JS_BEFORE);
        p->json_n_hold = 0;
    }
    if (p->json_out.len) {
        p->json_emitting = true;
        emit(p, DI_PARSE_EVENT_CONTENT, p->json_out.data, p->json_out.len);
        p->json_emitting = false;
    }
}

// JSON-escapes bytes of a string value / key and emits them as an ARGS_DELTA.
static di_status emit_escaped(di_parse *p, const char *s, size_t n) {
    di_buf_clear(&p->scratch);
    di_status st = DI_OK;
    for (size_t i = 0; i < n && st == DI_OK; i++) {
        unsigned char c = (unsigned char)s[i];
        char e[8];
        switch (c) {
        case '"':
            st = di_buf_append(&p->scratch, "\\\"", 2);
            break;
        case '\\':
            st = di_buf_append(&p->scratch, "\\\\", 2);
            break;
        case '\n':
            st = di_buf_append(&p->scratch, "\\n", 2);
            break;
        case '\r':
            st = di_buf_append(&p->scratch, "\\r", 2);
            break;
        case '\t':
            st = di_buf_append(&p->scratch, "\\t", 2);
            break;
        case '\b':
            st = di_buf_append(&p->scratch, "\\b", 2);
            break;
        case '\f':
            st = di_buf_append(&p->scratch, "\\f", 2);
            break;
        default:
            if (c < 0x20) {
                snprintf(e, sizeof e, "\\u%04x", c);
                st = di_buf_append(&p->scratch, e, 6);
            } else {
                st = di_buf_append(&p->scratch, s + i, 1);
            }
        }
    }
    if (st == DI_OK) emit(p, DI_PARSE_EVENT_ARGS_DELTA, p->scratch.data, p->scratch.len);
    return st;
}

// Text of the current section (reasoning or content), with leading newlines dropped.
static void emit_section(di_parse *p, const char *s, size_t n) {
    if (p->leading) {
        while (n && *s == '\n') s++, n--;
        if (n) p->leading = false;
    }
    if (p->st == ST_REASONING)
        emit(p, DI_PARSE_EVENT_REASONING, s, n);
    else if (p->st == ST_CONTENT)
        emit(p, DI_PARSE_EVENT_CONTENT, s, n);
}

// Bytes of the current stage that are not part of a label.
static di_status stage_text(di_parse *p, const char *s, size_t n) {
    switch (p->st) {
    case ST_REASONING:
    case ST_CONTENT:
        emit_section(p, s, n);
        return DI_OK;
    case ST_TOOL_NAME:
        emit(p, DI_PARSE_EVENT_TOOL_NAME, s, n);
        return DI_OK;
    case ST_PARAM_NAME:
        if (di_buf_append(&p->cur_name, s, n) != DI_OK) return DI_ERR_NOMEM;
        return emit_escaped(p, s, n);
    case ST_VALUE_STR:
        return emit_escaped(p, s, n);
    case ST_VALUE_RAW:
        emit(p, DI_PARSE_EVENT_ARGS_DELTA, s, n);
        return DI_OK;
    case ST_FINISHED:
        if (n) p->flags |= DI_PARSE_FLAG_CONTENT_AFTER_FINISHED;
        return DI_OK;
    default:
        return DI_OK; // markup between labels is dropped
    }
}

// ---- labels ----

typedef struct label {
    const char *s;
    size_t n;
    int id;
} label;

enum {
    L_THINK_END,
    L_DSML,
    L_STRAY_DSML,
    L_DSML_CLOSE,
    L_INVOKE,
    L_PARAM,
    L_END_V4,
    L_END_V41,
    L_QUOTE,
    L_TRUE,
    L_FALSE,
    L_STOP0,
};

static size_t stage_labels(const di_parse *p, label *l) {
    size_t n = 0;
#define ADD(str, ident) (l[n++] = (label){str, sizeof str - 1, ident})
    switch (p->st) {
    case ST_REASONING:
        ADD(k_think_end, L_THINK_END);
        ADD(k_dsml, L_DSML);
        ADD(k_dsml_close, L_STRAY_DSML);
        ADD("｜DSML｜", L_STRAY_DSML);
        break;
    case ST_CONTENT:
        ADD(k_think_end, L_THINK_END);
        ADD(k_dsml, L_DSML);
        ADD(k_dsml_close, L_STRAY_DSML);
        ADD("｜DSML｜", L_STRAY_DSML);
        for (size_t i = 0; i < p->opt.n_stop; i++)
            l[n++] = (label){p->opt.stop[i], strlen(p->opt.stop[i]), L_STOP0 + (int)i};
        break;
    case ST_TOOL_CALLS:
        ADD(k_invoke, L_INVOKE);
        ADD(k_end_v4, L_END_V4);
        ADD(k_end_v41, L_END_V41);
        break;
    case ST_TOOL_NAME:
    case ST_PARAM_NAME:
        ADD("\"", L_QUOTE);
        break;
    case ST_ARGS:
        ADD(k_param, L_PARAM);
        ADD(k_dsml_close, L_DSML_CLOSE);
        break;
    case ST_PARAM_TYPE:
        ADD("true\">", L_TRUE);
        ADD("false\">", L_FALSE);
        break;
    case ST_VALUE_STR:
    case ST_VALUE_RAW:
        ADD(k_dsml_close, L_DSML_CLOSE);
        break;
    case ST_FINISHED:
        break;
    }
#undef ADD
    return n;
}

static void end_call(di_parse *p) {
    emit(p, DI_PARSE_EVENT_ARGS_DELTA, p->n_params ? "}" : "{}", p->n_params ? 1 : 2);
    emit(p, DI_PARSE_EVENT_TOOL_CALL_END, NULL, 0);
    p->call_open = false;
    p->completed_call = true;
}

// Applies a matched label: state transition and its events.
static di_status take_label(di_parse *p, int id) {
    switch (id) {
    case L_THINK_END:
        if (p->st == ST_REASONING) {
            p->st = ST_CONTENT;
            p->leading = true;
        } else {
            p->flags |= DI_PARSE_FLAG_EXTRA_END_OF_THINKING; // stray </think> in content
        }
        return DI_OK;
    case L_DSML:
        p->st = ST_TOOL_CALLS;
        if (!p->opt.tools_enabled) {
            p->flags |= DI_PARSE_FLAG_DSML_SUPPRESSED;
            DI_LOG_WARN("parse: DSML tool-call markup in output without tools; stripped");
        }
        return DI_OK;
    case L_STRAY_DSML: // a closer or bare DSML token outside a block: markup never reaches text
        p->flags |= DI_PARSE_FLAG_STRAY_MARKUP;
        return DI_OK;
    case L_INVOKE:
        p->n_calls++;
        p->call_open = true;
        p->n_params = 0;
        di_buf_clear(&p->param_names);
        emit(p, DI_PARSE_EVENT_TOOL_CALL_BEGIN, NULL, 0);
        p->st = ST_TOOL_NAME;
        return DI_OK;
    case L_END_V4:
    case L_END_V41:
        p->st = ST_FINISHED;
        return DI_OK;
    case L_QUOTE:
        if (p->st == ST_TOOL_NAME) {
            emit(p, DI_PARSE_EVENT_TOOL_NAME_END, NULL, 0);
            p->st = ST_ARGS;
        } else { // end of a parameter name
            // duplicate names are a format error (§1.6); flagged, the value is still streamed
            const char *names = p->param_names.data;
            for (size_t off = 0; names && off < p->param_names.len;) {
                size_t len = strlen(names + off);
                if (len == p->cur_name.len && memcmp(names + off, p->cur_name.data, len) == 0)
                    p->flags |= DI_PARSE_FLAG_DUPLICATE_PARAMETER;
                off += len + 1;
            }
            if (di_buf_append(&p->param_names, p->cur_name.data ? p->cur_name.data : "",
                              p->cur_name.len) != DI_OK ||
                di_buf_append(&p->param_names, "", 1) != DI_OK)
                return DI_ERR_NOMEM;
            emit(p, DI_PARSE_EVENT_ARGS_DELTA, "\": ", 3);
            p->st = ST_PARAM_TYPE;
        }
        return DI_OK;
    case L_PARAM:
        emit(p, DI_PARSE_EVENT_ARGS_DELTA, p->n_params ? ", \"" : "{\"", p->n_params ? 3 : 2);
        p->n_params++;
        di_buf_clear(&p->cur_name);
        p->st = ST_PARAM_NAME;
        return DI_OK;
    case L_TRUE:
        emit(p, DI_PARSE_EVENT_ARGS_DELTA, "\"", 1);
        p->st = ST_VALUE_STR;
        return DI_OK;
    case L_FALSE:
        p->st = ST_VALUE_RAW;
        return DI_OK;
    case L_DSML_CLOSE:
        if (p->st == ST_VALUE_STR) emit(p, DI_PARSE_EVENT_ARGS_DELTA, "\"", 1);
        if (p->st == ST_ARGS) {
            end_call(p);
            p->st = ST_TOOL_CALLS;
        } else {
            p->st = ST_ARGS;
        }
        return DI_OK;
    default: // a stop string
        p->st = ST_FINISHED;
        p->finish = DI_PARSE_FINISH_STOP_SEQUENCE;
        return DI_OK;
    }
}

// Length of the longest suffix of s[0..n) that is a proper prefix of some label.
static size_t partial_suffix(const char *s, size_t n, const label *l, size_t nl) {
    size_t best = 0;
    for (size_t k = 0; k < nl; k++) {
        size_t max = l[k].n - 1 < n ? l[k].n - 1 : n;
        for (size_t len = max; len > best; len--)
            if (memcmp(s + n - len, l[k].s, len) == 0) {
                best = len;
                break;
            }
    }
    return best;
}

// Bytes at the end of s that begin an incomplete UTF-8 character.
static size_t utf8_tail(const char *s, size_t n) {
    const unsigned char *u = (const unsigned char *)s;
    for (size_t back = 1; back <= 3 && back <= n; back++) {
        unsigned char c = u[n - back];
        if ((c & 0xC0) == 0x80) continue; // continuation byte
        size_t need = c >= 0xF0 ? 4 : c >= 0xE0 ? 3 : c >= 0xC0 ? 2 : 1;
        return need > back ? back : 0;
    }
    return 0;
}

// Processes pending bytes; at_end: nothing more will come (hold nothing back).
static di_status run(di_parse *p, bool at_end) {
    di_status st;
    size_t pos = 0;
    const char *s = p->pending.data;
    size_t n = p->pending.len;
    if (n == 0) return DI_OK;
    for (;;) {
        label l[MAX_LABELS];
        size_t nl = stage_labels(p, l);
        // earliest label occurrence (longest at equal position)
        size_t best_at = SIZE_MAX, best_k = 0;
        for (size_t k = 0; k < nl; k++) {
            const char *f = l[k].n <= n - pos ? memmem(s + pos, n - pos, l[k].s, l[k].n) : NULL;
            if (f) {
                size_t at = (size_t)(f - s);
                if (at < best_at || (at == best_at && l[k].n > l[best_k].n)) {
                    best_at = at;
                    best_k = k;
                }
            }
        }
        if (best_at == SIZE_MAX) {
            size_t hold = at_end ? 0 : partial_suffix(s + pos, n - pos, l, nl);
            bool section = p->st == ST_REASONING || p->st == ST_CONTENT;
            if (!at_end && section) { // up to two newlines that may precede a DSML block
                size_t k = 0;
                while (k < 2 && n - pos - hold > 0 && s[n - hold - 1] == '\n') hold++, k++;
            }
            if (!at_end && hold == 0) hold = utf8_tail(s + pos, n - pos);
            if ((st = stage_text(p, s + pos, n - pos - hold)) != DI_OK) return st;
            pos = n - hold;
            break;
        }
        if (!at_end) {
            // A label that is a proper prefix of a longer one (stop "<｜" vs "<｜DSML｜") waits
            // until the longer one is decided, so that any split gives the whole-text result.
            bool wait = false;
            for (size_t k = 0; k < nl && !wait; k++)
                wait = l[k].n > l[best_k].n && n - best_at < l[k].n &&
                       memcmp(s + best_at, l[k].s, n - best_at) == 0;
            if (wait) {
                size_t keep = best_at; // newlines that may precede a DSML block wait too
                if (p->st == ST_REASONING || p->st == ST_CONTENT)
                    for (int k = 0; k < 2 && keep > pos && s[keep - 1] == '\n'; k++) keep--;
                if ((st = stage_text(p, s + pos, keep - pos)) != DI_OK) return st;
                pos = keep;
                break;
            }
        }
        size_t text_end = best_at;
        if (l[best_k].id == L_DSML && (p->st == ST_REASONING || p->st == ST_CONTENT)) {
            // the renderer writes "\n\n" before the block: not part of the text
            for (int k = 0; k < 2 && text_end > pos && s[text_end - 1] == '\n'; k++) text_end--;
        }
        if ((st = stage_text(p, s + pos, text_end - pos)) != DI_OK) return st;
        pos = best_at + l[best_k].n;
        if ((st = take_label(p, l[best_k].id)) != DI_OK) return st;
    }
    memmove(p->pending.data, s + pos, n - pos);
    p->pending.len = n - pos;
    return DI_OK;
}

di_status di_parse_feed(di_parse *p, const char *text, size_t n) {
    if (n == 0) return DI_OK;
    di_status st = di_buf_append(&p->pending, text, n);
    return st == DI_OK ? run(p, false) : st;
}

di_status di_parse_feed_token(di_parse *p, const di_tokenizer *tok, int32_t id) {
    if (id == 1) { // EOS: the only stop token (spec §1.1)
        di_parse_end(p, DI_PARSE_FINISH_STOP);
        return DI_OK;
    }
    if (!p->detok || p->detok_tok != tok) {
        di_detok_destroy(p->detok);
        p->detok = NULL;
        di_status st = di_detok_create(tok, false, &p->detok);
        if (st != DI_OK) return st;
        p->detok_tok = tok;
    }
    const char *t;
    size_t n;
    di_status st = di_detok_push(p->detok, id, &t, &n);
    return st == DI_OK ? di_parse_feed(p, t, n) : st;
}

di_parse_finish di_parse_end(di_parse *p, di_parse_finish reason) {
    if (p->detok) {
        const char *t;
        size_t n;
        di_detok_flush(p->detok, &t, &n);
        if (n) di_parse_feed(p, t, n);
    }
    // Held bytes: text of the section, or markup of an unfinished call (dropped).
    if (p->st == ST_REASONING || p->st == ST_CONTENT) run(p, true);
    p->pending.len = 0;
    if (p->opt.json_output) json_filter(p, NULL, 0, true);
    if (p->call_open) {
        // spec §1.11: an incomplete call is dropped, never leaked; a complete call without the
        // outer closing tag is kept
        emit(p, DI_PARSE_EVENT_TOOL_CALL_ABORT, NULL, 0);
        p->flags |= DI_PARSE_FLAG_CALL_ABORTED;
        p->call_open = false;
    }
    if (p->finish == DI_PARSE_FINISH_NONE) {
        p->finish = reason;
        if (reason == DI_PARSE_FINISH_STOP && p->completed_call && p->opt.tools_enabled)
            p->finish = DI_PARSE_FINISH_TOOL_CALLS;
    }
    p->st = ST_FINISHED;
    return p->finish;
}

// ---- result accumulation ----

void di_parse_result_init(di_parse_result *r) {
    memset(r, 0, sizeof *r);
    di_buf_init(&r->reasoning);
    di_buf_init(&r->content);
}

void di_parse_result_deinit(di_parse_result *r) {
    di_buf_deinit(&r->reasoning);
    di_buf_deinit(&r->content);
    for (size_t i = 0; i < r->n_calls; i++) {
        di_buf_deinit(&r->calls[i].name);
        di_buf_deinit(&r->calls[i].arguments);
    }
    di_free(r->calls);
    memset(r, 0, sizeof *r);
}

void di_parse_result_emit(void *user, const di_parse_event *ev) {
    di_parse_result *r = user;
    di_parse_call *c = r->n_calls ? &r->calls[r->n_calls - 1] : NULL;
    // Allocation failures here leave the result short; di_parse_text reports them by comparing.
    switch (ev->kind) {
    case DI_PARSE_EVENT_REASONING:
        r->has_reasoning = true;
        di_buf_append(&r->reasoning, ev->text, ev->len);
        break;
    case DI_PARSE_EVENT_CONTENT:
        di_buf_append(&r->content, ev->text, ev->len);
        break;
    case DI_PARSE_EVENT_TOOL_CALL_BEGIN: {
        di_parse_call *nc = di_realloc(r->calls, (r->n_calls + 1) * sizeof *nc);
        if (!nc) break;
        r->calls = nc;
        di_buf_init(&nc[r->n_calls].name);
        di_buf_init(&nc[r->n_calls].arguments);
        di_buf_append(&nc[r->n_calls].name, "", 0);
        di_buf_append(&nc[r->n_calls].arguments, "", 0);
        r->n_calls++;
        break;
    }
    case DI_PARSE_EVENT_TOOL_NAME:
        if (c) di_buf_append(&c->name, ev->text, ev->len);
        break;
    case DI_PARSE_EVENT_ARGS_DELTA:
        if (c) di_buf_append(&c->arguments, ev->text, ev->len);
        break;
    case DI_PARSE_EVENT_TOOL_CALL_ABORT:
        if (c) {
            di_buf_deinit(&c->name);
            di_buf_deinit(&c->arguments);
            r->n_calls--;
        }
        break;
    default:
        break;
    }
}

di_status di_parse_text(const di_parse_options *opt, const char *text, size_t n,
                        di_parse_finish reason, di_parse_result *out) {
    di_parse *p;
    di_status st = di_parse_create(opt, di_parse_result_emit, out, &p);
    if (st != DI_OK) return st;
    st = di_parse_feed(p, text, n);
    out->finish = di_parse_end(p, reason);
    out->flags = di_parse_flags(p);
    di_parse_destroy(p);
    return st;
}
