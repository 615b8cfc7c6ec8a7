// eplb_file — the JSON files of placements and expert loads (ep/eplb.h; docs/expert-parallel.md):
// strict readers (every field checked, unknown fields refused, sizes bounded before anything is
// allocated) and writers that put one layer per line.
#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#include "base/buf.h"
#include "base/json.h"
#include "base/mem.h"
#include "ep/eplb.h"

#define PLACEMENT_FORMAT "deepinfer-ep-placement"
#define LOAD_FORMAT "deepinfer-expert-load"

// Bounds on what a file may declare (DeepSeek V4-Pro: 61 + 1 layers, 384 experts): far above any
// model, low enough that a hostile file cannot make the reader allocate much.
enum { MAX_LAYERS = 1024, MAX_EXPERT = 65536, MAX_RANKS = 65536, MAX_ENTRIES = 1 << 24 };

static di_status bad(char *why, size_t why_n, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static di_status bad(char *why, size_t why_n, const char *fmt, ...) {
    if (why && why_n) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(why, why_n, fmt, ap);
        va_end(ap);
    }
    return DI_ERR_FORMAT;
}

// Only the keys named in `keys` (NULL-terminated); the first other one into *extra.
static bool only_keys(json_t *obj, const char *const *keys, const char **extra) {
    const char *k;
    json_t *v;
    json_object_foreach(obj, k, v) {
        bool known = false;
        for (int i = 0; keys[i] && !known; i++) known = !strcmp(k, keys[i]);
        if (!known) {
            *extra = k;
            return false;
        }
    }
    (void)v;
    return true;
}

// The header shared by both formats: no field outside `keys`, format string, version 1, the integer
// fields in `ints` (each in [1, max]).
static di_status header(json_t *root, const char *format, const char *const *keys,
                        const char *const *ints, const int64_t *max, int64_t *vals, char *why,
                        size_t why_n) {
    const char *extra = NULL;
    if (!only_keys(root, keys, &extra)) return bad(why, why_n, "unknown field \"%.64s\"", extra);
    const char *f = di_json_get_str(root, "format");
    if (!f) return bad(why, why_n, "\"format\" is missing or not a string");
    if (strcmp(f, format))
        return bad(why, why_n, "\"format\" is \"%.64s\", expected \"%s\"", f, format);
    json_t *ver = json_object_get(root, "version");
    if (!json_is_integer(ver)) return bad(why, why_n, "\"version\" is missing or not an integer");
    if (json_integer_value(ver) != 1)
        return bad(why, why_n, "\"version\" %lld is not supported (1 is)",
                   (long long)json_integer_value(ver));
    for (int i = 0; ints[i]; i++) {
        json_t *v = json_object_get(root, ints[i]);
        if (!json_is_integer(v))
            return bad(why, why_n, "\"%s\" is missing or not an integer", ints[i]);
        vals[i] = json_integer_value(v);
        if (vals[i] < 1 || vals[i] > max[i])
            return bad(why, why_n, "\"%s\" is %lld, outside [1, %lld]", ints[i], (long long)vals[i],
                       (long long)max[i]);
    }
    return DI_OK;
}

// An array of exactly n integers in [lo, hi] into out (int32 or int64 by `wide`).
static di_status int_array(json_t *a, int64_t n, int64_t lo, int64_t hi, void *out, bool wide,
                           const char *what, char *why, size_t why_n) {
    if (!json_is_array(a)) return bad(why, why_n, "%s is missing or not an array", what);
    if ((int64_t)json_array_size(a) != n)
        return bad(why, why_n, "%s has %zu entries, expected %lld", what, json_array_size(a),
                   (long long)n);
    for (int64_t i = 0; i < n; i++) {
        json_t *v = json_array_get(a, (size_t)i);
        if (!json_is_integer(v))
            return bad(why, why_n, "%s entry %lld is not an integer", what, (long long)i);
        const int64_t x = json_integer_value(v);
        if (x < lo || x > hi)
            return bad(why, why_n, "%s entry %lld is %lld, outside [%lld, %lld]", what,
                       (long long)i, (long long)x, (long long)lo, (long long)hi);
        if (wide)
            ((int64_t *)out)[i] = x;
        else
            ((int32_t *)out)[i] = (int32_t)x;
    }
    return DI_OK;
}

static di_status load_root(const char *text, size_t n, json_t **root, char *why, size_t why_n) {
    json_error_t err;
    *root = json_loadb(text, n, JSON_REJECT_DUPLICATES, &err);
    if (!*root)
        return bad(why, why_n, "invalid JSON: %s (line %d, column %d)", err.text, err.line,
                   err.column);
    if (!json_is_object(*root)) {
        json_decref(*root);
        *root = NULL;
        return bad(why, why_n, "the document is not a JSON object");
    }
    return DI_OK;
}

di_status di_eplb_placement_parse(const char *text, size_t n, di_ep_placement *out, char *why,
                                  size_t why_n) {
    memset(out, 0, sizeof(*out));
    if (why && why_n) why[0] = 0;
    json_t *root;
    di_status st = load_root(text, n, &root, why, why_n);
    if (st != DI_OK) return st;
    static const char *const keys[] = {"format",  "version", "n_layers", "n_expert",
                                       "n_ranks", "n_slots", "layers",   NULL};
    static const char *const ints[] = {"n_layers", "n_expert", "n_ranks", "n_slots", NULL};
    static const int64_t max[] = {MAX_LAYERS, MAX_EXPERT, MAX_RANKS, MAX_ENTRIES};
    int64_t v[4];
    st = header(root, PLACEMENT_FORMAT, keys, ints, max, v, why, why_n);
    if (st != DI_OK) goto done;
    if (v[3] < v[1]) {
        st = bad(why, why_n, "\"n_slots\" %lld is below \"n_expert\" %lld", (long long)v[3],
                 (long long)v[1]);
        goto done;
    }
    if (v[0] * v[3] > MAX_ENTRIES) {
        st = bad(why, why_n, "%lld layers x %lld slots is more than %d replicas", (long long)v[0],
                 (long long)v[3], MAX_ENTRIES);
        goto done;
    }
    json_t *layers = json_object_get(root, "layers");
    if (!json_is_array(layers) || (int64_t)json_array_size(layers) != v[0]) {
        st = bad(why, why_n, "\"layers\" must be an array of n_layers (%lld) objects",
                 (long long)v[0]);
        goto done;
    }
    st = di_ep_placement_alloc((int32_t)v[0], (int32_t)v[1], (int32_t)v[2], (int32_t)v[3], out);
    if (st != DI_OK) goto done;
    static const char *const lkeys[] = {"expert", "rank", NULL};
    for (int64_t l = 0; l < v[0] && st == DI_OK; l++) {
        json_t *ly = json_array_get(layers, (size_t)l);
        char what[64];
        const char *extra = NULL;
        if (!json_is_object(ly)) {
            st = bad(why, why_n, "layers[%lld] is not an object", (long long)l);
            break;
        }
        if (!only_keys(ly, lkeys, &extra)) {
            st = bad(why, why_n, "layers[%lld]: unknown field \"%.64s\"", (long long)l, extra);
            break;
        }
        snprintf(what, sizeof what, "layers[%lld].expert", (long long)l);
        st = int_array(json_object_get(ly, "expert"), v[3], 0, v[1] - 1, out->expert + l * v[3],
                       false, what, why, why_n);
        if (st != DI_OK) break;
        snprintf(what, sizeof what, "layers[%lld].rank", (long long)l);
        st = int_array(json_object_get(ly, "rank"), v[3], 0, v[2] - 1, out->rank + l * v[3], false,
                       what, why, why_n);
    }
    if (st == DI_OK) {
        char w[160];
        if (di_ep_placement_check(out, w, sizeof w) != DI_OK) st = bad(why, why_n, "%s", w);
    }
done:
    json_decref(root);
    if (st != DI_OK) di_ep_placement_free(out);
    return st;
}

// Reads a whole file (at most 1 GiB) into a new buffer.
static di_status slurp(const char *path, char **text, size_t *n, char *why, size_t why_n) {
    *text = NULL;
    FILE *f = fopen(path, "rb");
    if (!f) {
        if (why && why_n) snprintf(why, why_n, "cannot open %s: %s", path, strerror(errno));
        return DI_ERR_IO;
    }
    di_buf b;
    di_buf_init(&b);
    char chunk[1 << 16];
    size_t got;
    di_status st = DI_OK;
    while (st == DI_OK && (got = fread(chunk, 1, sizeof chunk, f)) > 0) {
        st = b.len + got > ((size_t)1 << 30) ? DI_ERR_FORMAT : di_buf_append(&b, chunk, got);
    }
    if (st == DI_OK && ferror(f)) st = DI_ERR_IO;
    fclose(f);
    if (st != DI_OK) {
        di_buf_deinit(&b);
        if (why && why_n)
            snprintf(why, why_n, "%s: %s", path,
                     st == DI_ERR_IO       ? "read error"
                     : st == DI_ERR_FORMAT ? "larger than 1 GiB"
                                           : "out of memory");
        return st;
    }
    *n = b.len;
    *text = di_buf_take(&b);
    if (!*text) *text = di_strdup("");
    return *text ? DI_OK : DI_ERR_NOMEM;
}

di_status di_eplb_placement_read(const char *path, di_ep_placement *out, char *why, size_t why_n) {
    memset(out, 0, sizeof(*out));
    char *text;
    size_t n;
    di_status st = slurp(path, &text, &n, why, why_n);
    if (st != DI_OK) return st;
    st = di_eplb_placement_parse(text, n, out, why, why_n);
    di_free(text);
    return st;
}

static di_status ints_line(di_buf *b, const char *key, const void *v, int64_t n, bool wide) {
    di_status st = di_buf_printf(b, "\"%s\":[", key);
    for (int64_t i = 0; i < n && st == DI_OK; i++)
        st = di_buf_printf(b, i ? ",%lld" : "%lld",
                           wide ? (long long)((const int64_t *)v)[i]
                                : (long long)((const int32_t *)v)[i]);
    return st == DI_OK ? di_buf_append_str(b, "]") : st;
}

di_status di_eplb_placement_dump(const di_ep_placement *p, char **text) {
    *text = NULL;
    if (di_ep_placement_check(p, NULL, 0) != DI_OK) return DI_ERR_INVALID;
    di_buf b;
    di_buf_init(&b);
    di_status st =
        di_buf_printf(&b,
                      "{\"format\":\"" PLACEMENT_FORMAT "\",\"version\":1,\"n_layers\":%d,"
                      "\"n_expert\":%d,\"n_ranks\":%d,\"n_slots\":%d,\"layers\":[\n",
                      p->n_layers, p->n_expert, p->n_ranks, p->n_slots);
    for (int32_t l = 0; l < p->n_layers && st == DI_OK; l++) {
        const int64_t o = (int64_t)l * p->n_slots;
        st = di_buf_append_str(&b, "{");
        if (st == DI_OK) st = ints_line(&b, "expert", p->expert + o, p->n_slots, false);
        if (st == DI_OK) st = di_buf_append_str(&b, ",");
        if (st == DI_OK) st = ints_line(&b, "rank", p->rank + o, p->n_slots, false);
        if (st == DI_OK) st = di_buf_append_str(&b, l + 1 < p->n_layers ? "},\n" : "}\n");
    }
    if (st == DI_OK) st = di_buf_append_str(&b, "]}\n");
    if (st != DI_OK) {
        di_buf_deinit(&b);
        return DI_ERR_NOMEM;
    }
    *text = di_buf_take(&b);
    return *text ? DI_OK : DI_ERR_NOMEM;
}

static di_status write_text(const char *text, const char *path) {
    FILE *f = fopen(path, "wb");
    if (!f) return DI_ERR_IO;
    const size_t n = strlen(text);
    const bool ok = fwrite(text, 1, n, f) == n;
    return fclose(f) == 0 && ok ? DI_OK : DI_ERR_IO;
}

di_status di_eplb_placement_write(const di_ep_placement *p, const char *path) {
    char *text;
    di_status st = di_eplb_placement_dump(p, &text);
    if (st != DI_OK) return st;
    st = write_text(text, path);
    di_free(text);
    return st;
}

di_status di_eplb_load_parse(const char *text, size_t n, di_ep_load_table *out, char *why,
                             size_t why_n) {
    memset(out, 0, sizeof(*out));
    if (why && why_n) why[0] = 0;
    json_t *root;
    di_status st = load_root(text, n, &root, why, why_n);
    if (st != DI_OK) return st;
    static const char *const keys[] = {"format", "version", "n_layers", "n_expert",
                                       "rows",   "load",    NULL};
    static const char *const ints[] = {"n_layers", "n_expert", NULL};
    static const int64_t max[] = {MAX_LAYERS, MAX_EXPERT};
    int64_t v[2];
    st = header(root, LOAD_FORMAT, keys, ints, max, v, why, why_n);
    if (st != DI_OK) goto done;
    if (v[0] * v[1] > MAX_ENTRIES) {
        st = bad(why, why_n, "%lld layers x %lld experts is more than %d counts", (long long)v[0],
                 (long long)v[1], MAX_ENTRIES);
        goto done;
    }
    json_t *load = json_object_get(root, "load");
    if (!json_is_array(load) || (int64_t)json_array_size(load) != v[0]) {
        st =
            bad(why, why_n, "\"load\" must be an array of n_layers (%lld) arrays", (long long)v[0]);
        goto done;
    }
    st = di_ep_load_table_alloc((int32_t)v[0], (int32_t)v[1], out);
    if (st != DI_OK) goto done;
    st = int_array(json_object_get(root, "rows"), v[0], 0, INT64_MAX, out->rows, true, "\"rows\"",
                   why, why_n);
    for (int64_t l = 0; l < v[0] && st == DI_OK; l++) {
        char what[48];
        snprintf(what, sizeof what, "load[%lld]", (long long)l);
        st = int_array(json_array_get(load, (size_t)l), v[1], 0, INT64_MAX, out->count + l * v[1],
                       true, what, why, why_n);
    }
done:
    json_decref(root);
    if (st != DI_OK) di_ep_load_table_free(out);
    return st;
}

di_status di_eplb_load_read(const char *path, di_ep_load_table *out, char *why, size_t why_n) {
    memset(out, 0, sizeof(*out));
    char *text;
    size_t n;
    di_status st = slurp(path, &text, &n, why, why_n);
    if (st != DI_OK) return st;
    st = di_eplb_load_parse(text, n, out, why, why_n);
    di_free(text);
    return st;
}

di_status di_eplb_load_dump(const di_ep_load_table *t, char **text) {
    *text = NULL;
    if (t->n_layers < 1 || t->n_expert < 1 || !t->count || !t->rows) return DI_ERR_INVALID;
    di_buf b;
    di_buf_init(&b);
    di_status st = di_buf_printf(&b,
                                 "{\"format\":\"" LOAD_FORMAT "\",\"version\":1,\"n_layers\":%d,"
                                 "\"n_expert\":%d,\n",
                                 t->n_layers, t->n_expert);
    if (st == DI_OK) st = ints_line(&b, "rows", t->rows, t->n_layers, true);
    if (st == DI_OK) st = di_buf_append_str(&b, ",\n\"load\":[\n");
    for (int32_t l = 0; l < t->n_layers && st == DI_OK; l++) {
        st = di_buf_append_str(&b, "[");
        const int64_t *c = t->count + (int64_t)l * t->n_expert;
        for (int32_t e = 0; e < t->n_expert && st == DI_OK; e++)
            st = di_buf_printf(&b, e ? ",%lld" : "%lld", (long long)c[e]);
        if (st == DI_OK) st = di_buf_append_str(&b, l + 1 < t->n_layers ? "],\n" : "]\n");
    }
    if (st == DI_OK) st = di_buf_append_str(&b, "]}\n");
    if (st != DI_OK) {
        di_buf_deinit(&b);
        return DI_ERR_NOMEM;
    }
    *text = di_buf_take(&b);
    return *text ? DI_OK : DI_ERR_NOMEM;
}
