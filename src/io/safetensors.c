// safetensors — see safetensors.h. Sections: name index, parsing one image, files, sets of
// shards, writing.
#include "io/safetensors.h"

#include <dirent.h>
#include <errno.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <stddef.h>
#include <string.h>
#include <sys/stat.h>

#include "base/json.h" // di_json_load_file
#include "base/log.h"
#include "base/mem.h"
#include "base/name_index.h"
#include "base/mmap.h"
#include "base/status.h" // DI_TRY

// Names longer than this are cut in error messages (a fuzzed header can hold a 100 MiB name).
#define NAME_LOG_MAX 200

// The tensor tables' name index (base/name_index.h) over di_st_tensor.name.
#define ST_INSERT(h, ts, k)                                                                        \
    di_name_index_insert(h, ts, sizeof(di_st_tensor), offsetof(di_st_tensor, name), k)
#define ST_FIND(h, ts, name)                                                                       \
    di_name_index_find(h, ts, sizeof(di_st_tensor), offsetof(di_st_tensor, name), name)

// ---- parsing one image ----

struct di_st_file {
    di_mmap map;           // owned mapping; zero when parsed from caller memory
    char *what;            // owned copy of the name used in errors
    di_st_tensor *tensors; // owned [n_tensors]; header order
    int64_t n_tensors;
    const char **meta_kv; // owned [2 * n_meta]; strings point into `strings`
    int64_t n_meta;
    char *strings;       // owned: tensor names and metadata keys/values, NUL-terminated
    di_name_index index; // owned
};

typedef struct span {
    uint64_t begin, end;
    int64_t k; // tensor index
} span;

static int span_cmp(const void *a, const void *b) {
    const span *x = a, *y = b;
    if (x->begin != y->begin) return x->begin < y->begin ? -1 : 1;
    if (x->end != y->end) return x->end < y->end ? -1 : 1;
    return 0;
}

// Reads a JSON integer >= 0. Reals ("2.0") are not accepted: the format writes integers.
static bool get_uint(const json_t *v, uint64_t *out) {
    if (!json_is_integer(v)) return false;
    json_int_t x = json_integer_value(v);
    if (x < 0) return false;
    *out = (uint64_t)x;
    return true;
}

// Validates one tensor entry and fills t (name and data excepted) and *sp.
// data_size: bytes in the data region. Logs and returns DI_ERR_FORMAT on any violation.
static di_status parse_entry(const char *what, const char *name, const json_t *e, size_t data_size,
                             di_st_tensor *t, span *sp) {
#define BAD(...)                                                                                   \
    do {                                                                                           \
        DI_LOG_ERROR("%s: tensor \"%.*s\": " __VA_ARGS__);                                         \
        return DI_ERR_FORMAT;                                                                      \
    } while (0)
#define ARGS what, NAME_LOG_MAX, name
    if (!json_is_object(e)) BAD("entry is not an object", ARGS);
    const char *key;
    const json_t *v;
    json_object_foreach((json_t *)e, key, v) {
        if (strcmp(key, "dtype") != 0 && strcmp(key, "shape") != 0 &&
            strcmp(key, "data_offsets") != 0)
            BAD("unknown field \"%.*s\"", ARGS, NAME_LOG_MAX, key);
    }

    const json_t *jd = json_object_get(e, "dtype");
    if (!jd) BAD("missing \"dtype\"", ARGS);
    if (!json_is_string(jd)) BAD("\"dtype\" is not a string", ARGS);
    if (!di_dtype_from_name(json_string_value(jd), &t->dtype))
        BAD("unknown dtype \"%.*s\"", ARGS, NAME_LOG_MAX, json_string_value(jd));

    const json_t *js = json_object_get(e, "shape");
    if (!js) BAD("missing \"shape\"", ARGS);
    if (!json_is_array(js)) BAD("\"shape\" is not an array", ARGS);
    size_t n_dims = json_array_size(js);
    if (n_dims > DI_ST_MAX_DIMS) BAD("%zu dims, more than %d", ARGS, n_dims, DI_ST_MAX_DIMS);
    // The running product must stay representable even if a later dim is 0: such a shape is
    // nonsense and downstream code multiplies dims in other orders.
    uint64_t n_elements = 1;
    for (size_t d = 0; d < n_dims; d++) {
        uint64_t dim;
        if (!get_uint(json_array_get(js, d), &dim))
            BAD("shape[%zu] is not a non-negative integer", ARGS, d);
        if (dim != 0 && n_elements > (uint64_t)INT64_MAX / dim)
            BAD("element count overflows at shape[%zu]", ARGS, d);
        n_elements *= dim;
        t->shape[d] = (int64_t)dim;
    }
    size_t elt = di_dtype_size(t->dtype);
    if (n_elements > SIZE_MAX / elt) BAD("byte size overflows", ARGS);
    size_t n_bytes = (size_t)n_elements * elt;

    const json_t *jo = json_object_get(e, "data_offsets");
    if (!jo) BAD("missing \"data_offsets\"", ARGS);
    if (!json_is_array(jo) || json_array_size(jo) != 2)
        BAD("\"data_offsets\" is not an array of two integers", ARGS);
    uint64_t begin, end;
    if (!get_uint(json_array_get(jo, 0), &begin) || !get_uint(json_array_get(jo, 1), &end))
        BAD("\"data_offsets\" are not non-negative integers", ARGS);
    if (begin > end)
        BAD("data_offsets [%llu, %llu]: begin > end", ARGS, (unsigned long long)begin,
            (unsigned long long)end);
    if (end > (uint64_t)data_size)
        BAD("data_offsets end %llu beyond the data region (%zu bytes)", ARGS,
            (unsigned long long)end, data_size);
    if (end - begin != (uint64_t)n_bytes)
        BAD("data_offsets span %llu bytes but %s shape needs %zu", ARGS,
            (unsigned long long)(end - begin), di_dtype_name(t->dtype), n_bytes);
#undef ARGS
#undef BAD

    t->n_dims = (int)n_dims;
    t->n_elements = (int64_t)n_elements;
    t->n_bytes = n_bytes;
    t->shard = 0;
    sp->begin = begin;
    sp->end = end;
    return DI_OK;
}

static bool is_metadata_key(const char *key) {
    return strcmp(key, "__metadata__") == 0;
}

// Checks "__metadata__" (an object of string -> string) and adds its string bytes to *n_strings.
static di_status check_metadata(const char *what, const json_t *m, int64_t *n_meta,
                                size_t *n_strings) {
    if (!json_is_object(m)) {
        DI_LOG_ERROR("%s: \"__metadata__\" is not an object", what);
        return DI_ERR_FORMAT;
    }
    const char *key;
    const json_t *v;
    json_object_foreach((json_t *)m, key, v) {
        if (!json_is_string(v)) {
            DI_LOG_ERROR("%s: \"__metadata__\" value of \"%.*s\" is not a string", what,
                         NAME_LOG_MAX, key);
            return DI_ERR_FORMAT;
        }
        *n_strings += strlen(key) + 1 + json_string_length(v) + 1;
    }
    *n_meta = (int64_t)json_object_size(m);
    return DI_OK;
}

static char *copy_str(char **cursor, const char *s) {
    size_t n = strlen(s) + 1;
    char *p = *cursor;
    memcpy(p, s, n);
    *cursor += n;
    return p;
}

// Overlap check over the non-empty tensors, sorted by offset. Empty ranges overlap nothing.
static di_status check_overlaps(const char *what, const di_st_tensor *ts, span *spans, int64_t n) {
    qsort(spans, (size_t)n, sizeof *spans, span_cmp);
    const span *prev = NULL;
    for (int64_t i = 0; i < n; i++) {
        const span *s = &spans[i];
        if (s->begin == s->end) continue;
        if (prev && s->begin < prev->end) {
            DI_LOG_ERROR("%s: tensor \"%.*s\" [%llu, %llu) overlaps tensor \"%.*s\" [%llu, %llu)",
                         what, NAME_LOG_MAX, ts[s->k].name, (unsigned long long)s->begin,
                         (unsigned long long)s->end, NAME_LOG_MAX, ts[prev->k].name,
                         (unsigned long long)prev->begin, (unsigned long long)prev->end);
            return DI_ERR_FORMAT;
        }
        prev = s;
    }
    return DI_OK;
}

di_status di_st_file_parse(const uint8_t *bytes, size_t n_bytes, const char *what,
                           di_st_file **out) {
    if (!what) what = "(memory)";
    di_status st = DI_OK;
    json_t *root = NULL;
    di_st_file *f = NULL;
    span *spans = NULL;

    if (n_bytes < 8) {
        DI_LOG_ERROR("%s: %zu bytes, shorter than the 8-byte header length", what, n_bytes);
        return DI_ERR_FORMAT;
    }
    uint64_t n_header = 0;
    for (int i = 7; i >= 0; i--) n_header = (n_header << 8) | bytes[i];
    if (n_header > DI_ST_HEADER_BYTES_MAX) {
        DI_LOG_ERROR("%s: header length %llu exceeds the %llu-byte limit", what,
                     (unsigned long long)n_header, (unsigned long long)DI_ST_HEADER_BYTES_MAX);
        return DI_ERR_FORMAT;
    }
    if (n_header > n_bytes - 8) {
        DI_LOG_ERROR("%s: header length %llu exceeds the file (%zu bytes)", what,
                     (unsigned long long)n_header, n_bytes);
        return DI_ERR_FORMAT;
    }
    const uint8_t *data = bytes + 8 + n_header;
    size_t data_size = n_bytes - 8 - (size_t)n_header;

    // Jansson validates UTF-8, rejects NUL in keys and values (no JSON_ALLOW_NUL), bounds nesting
    // depth, and (without JSON_DISABLE_EOF_CHECK) allows only whitespace after the object, which
    // is what the format's space padding is.
    json_error_t jerr;
    root = json_loadb((const char *)bytes + 8, (size_t)n_header, JSON_REJECT_DUPLICATES, &jerr);
    if (!root) {
        DI_LOG_ERROR("%s: header is not valid JSON (byte %d): %s", what, jerr.position, jerr.text);
        return DI_ERR_FORMAT;
    }
    if (!json_is_object(root)) {
        DI_LOG_ERROR("%s: header is not a JSON object", what);
        st = DI_ERR_FORMAT;
        goto fail;
    }

    // Pass 1: count tensors and string bytes, validate metadata and names.
    int64_t n_tensors = 0, n_meta = 0;
    size_t n_strings = 0;
    const char *key;
    json_t *v;
    json_object_foreach(root, key, v) {
        if (is_metadata_key(key)) {
            DI_TRY(check_metadata(what, v, &n_meta, &n_strings));
            continue;
        }
        if (key[0] == 0) {
            DI_LOG_ERROR("%s: tensor with an empty name", what);
            st = DI_ERR_FORMAT;
            goto fail;
        }
        n_tensors++;
        n_strings += strlen(key) + 1;
    }

    f = di_calloc(1, sizeof *f);
    if (!f) goto nomem;
    f->what = di_strdup(what);
    f->tensors = di_calloc((size_t)n_tensors, sizeof *f->tensors);
    f->meta_kv = di_calloc((size_t)n_meta * 2, sizeof *f->meta_kv);
    f->strings = di_malloc(n_strings);
    spans = di_calloc((size_t)n_tensors, sizeof *spans);
    if (!f->what || !f->tensors || !f->meta_kv || !f->strings || !spans) goto nomem;

    // Pass 2: fill tensors and metadata.
    char *cursor = f->strings;
    json_object_foreach(root, key, v) {
        if (is_metadata_key(key)) {
            const char *mk;
            json_t *mv;
            json_object_foreach(v, mk, mv) {
                f->meta_kv[2 * f->n_meta] = copy_str(&cursor, mk);
                f->meta_kv[2 * f->n_meta + 1] = copy_str(&cursor, json_string_value(mv));
                f->n_meta++;
            }
            continue;
        }
        int64_t k = f->n_tensors;
        di_st_tensor *t = &f->tensors[k];
        DI_TRY(parse_entry(what, key, v, data_size, t, &spans[k]));
        t->name = copy_str(&cursor, key);
        t->data = data + spans[k].begin;
        spans[k].k = k;
        f->n_tensors++;
    }
    DI_ASSERT(f->n_tensors == n_tensors && f->n_meta == n_meta);
    DI_TRY(check_overlaps(what, f->tensors, spans, n_tensors));

    if (di_name_index_init(&f->index, n_tensors) != DI_OK) goto nomem;
    for (int64_t k = 0; k < n_tensors; k++) {
        // JSON_REJECT_DUPLICATES already refused repeated keys; this is the invariant.
        DI_ASSERT(ST_INSERT(&f->index, f->tensors, k) < 0);
    }

    di_free(spans);
    json_decref(root);
    *out = f;
    return DI_OK;

nomem:
    DI_LOG_ERROR("%s: out of memory reading the header", what);
    st = DI_ERR_NOMEM;
fail:
    di_free(spans);
    di_st_file_close(f);
    json_decref(root);
    return st;
}

// ---- files ----

di_status di_st_file_open(const char *path, di_st_file **out) {
    di_mmap map;
    di_status st = di_mmap_open(path, &map);
    if (st != DI_OK) return st;
    di_st_file *f = NULL;
    st = di_st_file_parse(map.data, map.size, path, &f);
    if (st != DI_OK) {
        di_mmap_close(&map);
        return st;
    }
    f->map = map;
    *out = f;
    return DI_OK;
}

void di_st_file_close(di_st_file *f) {
    if (!f) return;
    di_name_index_deinit(&f->index);
    di_free(f->strings);
    di_free(f->meta_kv);
    di_free(f->tensors);
    di_free(f->what);
    di_mmap_close(&f->map);
    di_free(f);
}

int64_t di_st_file_n_tensors(const di_st_file *f) {
    return f->n_tensors;
}

const di_st_tensor *di_st_file_tensor(const di_st_file *f, int64_t i) {
    DI_ASSERT(i >= 0 && i < f->n_tensors);
    return &f->tensors[i];
}

const di_st_tensor *di_st_file_find(const di_st_file *f, const char *name) {
    int64_t k = ST_FIND(&f->index, f->tensors, name);
    return k < 0 ? NULL : &f->tensors[k];
}

const char *di_st_file_metadata(const di_st_file *f, const char *key) {
    if (!key) return NULL;
    for (int64_t i = 0; i < f->n_meta; i++) {
        if (strcmp(f->meta_kv[2 * i], key) == 0) return f->meta_kv[2 * i + 1];
    }
    return NULL;
}

// ---- sets of shards ----

#define INDEX_FILE_NAME "model.safetensors.index.json"

struct di_st_set {
    di_st_file **files; // owned [n_files]
    int n_files;
    di_st_tensor *tensors; // owned [n_tensors]: copies with shard set; names borrowed from files
    int64_t n_tensors;     // (or from `names` for a view set)
    char *names;           // owned by a view set (di_st_set_create_view); NULL otherwise
    di_name_index index;   // owned
    size_t data_bytes;
};

static int cmp_str_ptr(const void *a, const void *b) {
    return strcmp(*(const char *const *)a, *(const char *const *)b);
}

// A shard name from the index must stay inside dir.
static bool is_plain_file_name(const char *s) {
    return s[0] != 0 && !strchr(s, '/') && !strchr(s, '\\') && !strstr(s, "..");
}

// Opens dir/names[i] for each i into s->files (sorted names, so shard numbers are stable).
static di_status open_shards(di_st_set *s, const char *dir, const char **names, int n) {
    s->files = di_calloc((size_t)n, sizeof *s->files);
    if (!s->files) return DI_ERR_NOMEM;
    di_buf path;
    di_buf_init(&path);
    di_status st = DI_OK;
    for (int i = 0; i < n; i++) {
        di_buf_clear(&path);
        DI_TRY(di_buf_printf(&path, "%s/%s", dir, names[i]));
        DI_TRY(di_st_file_open(path.data, &s->files[i]));
        s->n_files = i + 1;
    }
fail:
    di_buf_deinit(&path);
    return st;
}

// Gathers every shard's tensors into s and builds the name index. Duplicate names are an error.
static di_status build_set(di_st_set *s) {
    int64_t n = 0;
    for (int i = 0; i < s->n_files; i++) n += s->files[i]->n_tensors;
    s->tensors = di_calloc((size_t)n, sizeof *s->tensors);
    if (!s->tensors || di_name_index_init(&s->index, n) != DI_OK) return DI_ERR_NOMEM;
    for (int i = 0; i < s->n_files; i++) {
        const di_st_file *f = s->files[i];
        for (int64_t j = 0; j < f->n_tensors; j++) {
            int64_t k = s->n_tensors;
            s->tensors[k] = f->tensors[j];
            s->tensors[k].shard = i;
            int64_t dup = ST_INSERT(&s->index, s->tensors, k);
            if (dup >= 0) {
                DI_LOG_ERROR("tensor \"%.*s\" is in both %s and %s", NAME_LOG_MAX,
                             f->tensors[j].name, s->files[s->tensors[dup].shard]->what, f->what);
                return DI_ERR_FORMAT;
            }
            s->data_bytes += f->tensors[j].n_bytes;
            s->n_tensors++;
        }
    }
    return DI_OK;
}

// Index mode: weight_map names the shards; each shard must hold exactly the names mapped to it.
static di_status open_indexed(di_st_set *s, const char *dir, const char *index_path) {
    json_t *root = NULL;
    const char **names = NULL;
    di_status st = di_json_load_file(index_path, &root);
    if (st != DI_OK) return st;

    const json_t *wm = json_object_get(root, "weight_map");
    if (!json_is_object(wm)) {
        DI_LOG_ERROR("%s: \"weight_map\" is missing or not an object", index_path);
        st = DI_ERR_FORMAT;
        goto fail;
    }
    size_t n_entries = json_object_size(wm);
    names = di_calloc(n_entries, sizeof *names);
    if (!names) {
        st = DI_ERR_NOMEM;
        goto fail;
    }
    const char *key;
    json_t *v;
    size_t n = 0;
    json_object_foreach((json_t *)wm, key, v) {
        const char *file = json_string_value(v);
        if (!file) {
            DI_LOG_ERROR("%s: tensor \"%.*s\": shard is not a string", index_path, NAME_LOG_MAX,
                         key);
            st = DI_ERR_FORMAT;
            goto fail;
        }
        if (!is_plain_file_name(file)) {
            DI_LOG_ERROR("%s: tensor \"%.*s\": shard \"%.*s\" is not a plain file name", index_path,
                         NAME_LOG_MAX, key, NAME_LOG_MAX, file);
            st = DI_ERR_FORMAT;
            goto fail;
        }
        names[n++] = file;
    }
    if (n == 0) {
        DI_LOG_ERROR("%s: \"weight_map\" is empty", index_path);
        st = DI_ERR_FORMAT;
        goto fail;
    }
    qsort(names, n, sizeof *names, cmp_str_ptr);
    size_t n_shards = 0;
    for (size_t i = 0; i < n; i++) {
        if (n_shards == 0 || strcmp(names[n_shards - 1], names[i]) != 0)
            names[n_shards++] = names[i];
    }
    DI_TRY(open_shards(s, dir, names, (int)n_shards));

    // Every shard tensor must be mapped to that shard ...
    for (int i = 0; i < s->n_files; i++) {
        const di_st_file *f = s->files[i];
        for (int64_t j = 0; j < f->n_tensors; j++) {
            const char *tn = f->tensors[j].name;
            const char *mapped = json_string_value(json_object_get(wm, tn));
            if (!mapped) {
                DI_LOG_ERROR("%s: tensor \"%.*s\" is not listed in %s", f->what, NAME_LOG_MAX, tn,
                             index_path);
                st = DI_ERR_FORMAT;
                goto fail;
            }
            if (strcmp(mapped, names[i]) != 0) {
                DI_LOG_ERROR("%s: tensor \"%.*s\" is mapped to %s by %s", f->what, NAME_LOG_MAX, tn,
                             mapped, index_path);
                st = DI_ERR_FORMAT;
                goto fail;
            }
        }
    }
    // ... and every mapped tensor must be in its shard.
    json_object_foreach((json_t *)wm, key, v) {
        const char *file = json_string_value(v);
        const char **hit = bsearch(&file, names, n_shards, sizeof *names, cmp_str_ptr);
        DI_ASSERT(hit);
        const di_st_file *f = s->files[hit - names];
        if (!di_st_file_find(f, key)) {
            DI_LOG_ERROR("%s: tensor \"%.*s\" listed for this shard by %s is missing", f->what,
                         NAME_LOG_MAX, key, index_path);
            st = DI_ERR_FORMAT;
            goto fail;
        }
    }
    st = build_set(s);
fail:
    di_free(names);
    json_decref(root);
    return st;
}

static bool has_st_suffix(const char *name) {
    static const char suffix[] = ".safetensors";
    size_t n = strlen(name), ns = sizeof suffix - 1;
    return n > ns && strcmp(name + n - ns, suffix) == 0;
}

// No index: every *.safetensors file in dir, sorted by name.
static di_status open_scanned(di_st_set *s, const char *dir) {
    DIR *d = opendir(dir);
    if (!d) {
        DI_LOG_ERROR("cannot open checkpoint directory %s: %s", dir, strerror(errno));
        return DI_ERR_IO;
    }
    di_status st = DI_OK;
    char **names = NULL;
    size_t n = 0, cap = 0;
    const struct dirent *de;
    while ((de = readdir(d)) != NULL) {
        if (de->d_name[0] == '.' || !has_st_suffix(de->d_name)) continue;
        if (n == cap) {
            cap = cap ? cap * 2 : 16;
            char **p = di_realloc(names, cap * sizeof *names);
            if (!p) goto nomem;
            names = p;
        }
        if (!(names[n] = di_strdup(de->d_name))) goto nomem;
        n++;
    }
    if (n == 0) {
        DI_LOG_ERROR("no %s and no *.safetensors file in %s", INDEX_FILE_NAME, dir);
        st = DI_ERR_IO;
        goto fail;
    }
    if (n > (size_t)INT32_MAX) {
        DI_LOG_ERROR("%s: too many shards (%zu)", dir, n);
        st = DI_ERR_FORMAT;
        goto fail;
    }
    qsort(names, n, sizeof *names, cmp_str_ptr);
    DI_TRY(open_shards(s, dir, (const char **)names, (int)n));
    st = build_set(s);
    goto fail;
nomem:
    st = DI_ERR_NOMEM;
fail:
    for (size_t i = 0; i < n; i++) di_free(names[i]);
    di_free(names);
    closedir(d);
    return st;
}

di_status di_st_set_open_dir(const char *dir, di_st_set **out) {
    di_buf index_path;
    di_buf_init(&index_path);
    di_st_set *s = di_calloc(1, sizeof *s);
    di_status st = DI_OK;
    if (!s) {
        st = DI_ERR_NOMEM;
        goto fail;
    }
    DI_TRY(di_buf_printf(&index_path, "%s/%s", dir, INDEX_FILE_NAME));
    struct stat sb;
    if (stat(index_path.data, &sb) == 0) {
        DI_TRY(open_indexed(s, dir, index_path.data));
    } else if (errno == ENOENT) {
        DI_TRY(open_scanned(s, dir));
    } else {
        DI_LOG_ERROR("cannot stat %s: %s", index_path.data, strerror(errno));
        st = DI_ERR_IO;
        goto fail;
    }
    di_buf_deinit(&index_path);
    *out = s;
    return DI_OK;
fail:
    if (st == DI_ERR_NOMEM) DI_LOG_ERROR("%s: out of memory opening the checkpoint", dir);
    di_buf_deinit(&index_path);
    di_st_set_close(s);
    return st;
}

void di_st_set_close(di_st_set *s) {
    if (!s) return;
    di_name_index_deinit(&s->index);
    di_free(s->tensors);
    di_free(s->names);
    for (int i = 0; i < s->n_files; i++) di_st_file_close(s->files[i]);
    di_free(s->files);
    di_free(s);
}

di_status di_st_set_create_view(const di_st_tensor *tensors, int64_t n_tensors, di_st_set **out) {
    di_st_set *s = di_calloc(1, sizeof *s);
    if (!s) return DI_ERR_NOMEM;
    di_status st = DI_OK;
    size_t n_chars = 0;
    for (int64_t i = 0; i < n_tensors; i++) n_chars += strlen(tensors[i].name) + 1;
    s->names = di_malloc(n_chars + 1);
    s->tensors = di_calloc((size_t)n_tensors + 1, sizeof *s->tensors);
    if (!s->names || !s->tensors || di_name_index_init(&s->index, n_tensors) != DI_OK) {
        st = DI_ERR_NOMEM;
        goto fail;
    }
    size_t pos = 0;
    for (int64_t i = 0; i < n_tensors; i++) {
        size_t len = strlen(tensors[i].name);
        memcpy(s->names + pos, tensors[i].name, len + 1);
        s->tensors[i] = tensors[i];
        s->tensors[i].name = s->names + pos;
        pos += len + 1;
        if (ST_INSERT(&s->index, s->tensors, i) >= 0) {
            DI_LOG_ERROR("tensor \"%.*s\" is listed twice", NAME_LOG_MAX, tensors[i].name);
            st = DI_ERR_FORMAT;
            goto fail;
        }
        s->data_bytes += tensors[i].n_bytes;
        s->n_tensors = i + 1;
    }
    *out = s;
    return DI_OK;
fail:
    di_st_set_close(s);
    return st;
}

int64_t di_st_set_n_tensors(const di_st_set *s) {
    return s->n_tensors;
}

const di_st_tensor *di_st_set_tensor(const di_st_set *s, int64_t i) {
    DI_ASSERT(i >= 0 && i < s->n_tensors);
    return &s->tensors[i];
}

const di_st_tensor *di_st_set_find(const di_st_set *s, const char *name) {
    int64_t k = ST_FIND(&s->index, s->tensors, name);
    return k < 0 ? NULL : &s->tensors[k];
}

size_t di_st_set_data_bytes(const di_st_set *s) {
    return s->data_bytes;
}

// ---- writing ----

// Byte size of a write description, or DI_ERR_INVALID.
static di_status write_tensor_bytes(const di_st_write_tensor *t, size_t *out) {
    if ((unsigned)t->dtype >= DI_DTYPE_COUNT || t->n_dims < 0 || t->n_dims > DI_ST_MAX_DIMS)
        return DI_ERR_INVALID;
    uint64_t n = 1;
    for (int d = 0; d < t->n_dims; d++) {
        int64_t dim = t->shape[d];
        if (dim < 0 || (dim != 0 && n > (uint64_t)INT64_MAX / (uint64_t)dim)) return DI_ERR_INVALID;
        n *= (uint64_t)dim;
    }
    size_t elt = di_dtype_size(t->dtype);
    if (elt == 0 || n > SIZE_MAX / elt) return DI_ERR_INVALID; // 0: a ggml block format
    *out = (size_t)n * elt;
    if (*out > 0 && !t->data) return DI_ERR_INVALID;
    return DI_OK;
}

// jansson refuses keys and strings that are not UTF-8; say so instead of reporting no memory.
static bool is_utf8(const char *s) {
    json_t *j = json_string(s);
    json_decref(j);
    return j != NULL;
}

// Header JSON (no padding), malloc'd by jansson: free with free().
static di_status build_header(const di_st_write_tensor *tensors, int64_t n_tensors,
                              const char *const *meta_kv, int64_t n_meta, char **out) {
    di_status st = DI_ERR_NOMEM;
    json_t *root = json_object();
    if (!root) return DI_ERR_NOMEM;
    if (n_meta > 0) {
        json_t *m = json_object();
        if (json_object_set_new(root, "__metadata__", m) != 0) goto fail;
        for (int64_t i = 0; i < n_meta; i++) {
            const char *k = meta_kv[2 * i], *v = meta_kv[2 * i + 1];
            if (!k || !v || !is_utf8(k) || !is_utf8(v)) {
                DI_LOG_ERROR("safetensors writer: metadata pair %lld is NULL or not UTF-8",
                             (long long)i);
                st = DI_ERR_INVALID;
                goto fail;
            }
            if (json_object_set_new(m, k, json_string(v)) != 0) goto fail;
        }
    }
    uint64_t offset = 0;
    for (int64_t i = 0; i < n_tensors; i++) {
        const di_st_write_tensor *t = &tensors[i];
        size_t n_bytes = 0;
        const char *name = t->name ? t->name : "";
        if (name[0] == 0 || is_metadata_key(name) || !is_utf8(name) ||
            json_object_get(root, name) || write_tensor_bytes(t, &n_bytes) != DI_OK ||
            n_bytes > (uint64_t)INT64_MAX - offset) {
            DI_LOG_ERROR("safetensors writer: tensor %lld \"%.*s\": bad name, dtype, shape or data",
                         (long long)i, NAME_LOG_MAX, name);
            st = DI_ERR_INVALID;
            goto fail;
        }
        // json_object_set_new steals the value even when it fails, so nothing leaks on error.
        json_t *e = json_object();
        if (json_object_set_new(root, name, e) != 0) goto fail;
        json_t *shape = json_array();
        if (json_object_set_new(e, "dtype", json_string(di_dtype_name(t->dtype))) != 0 ||
            json_object_set_new(e, "shape", shape) != 0)
            goto fail;
        for (int d = 0; d < t->n_dims; d++) {
            if (json_array_append_new(shape, json_integer(t->shape[d])) != 0) goto fail;
        }
        json_t *offs = json_pack("[II]", (json_int_t)offset, (json_int_t)(offset + n_bytes));
        if (json_object_set_new(e, "data_offsets", offs) != 0) goto fail;
        offset += n_bytes;
    }
    *out = json_dumps(root, JSON_COMPACT | JSON_PRESERVE_ORDER);
    st = *out ? DI_OK : DI_ERR_NOMEM;
fail:
    if (st == DI_ERR_NOMEM) DI_LOG_ERROR("safetensors writer: out of memory");
    json_decref(root);
    return st;
}

di_status di_st_write_buf(di_buf *out, const di_st_write_tensor *tensors, int64_t n_tensors,
                          const char *const *meta_kv, int64_t n_meta) {
    char *header = NULL;
    di_status st = build_header(tensors, n_tensors, meta_kv, n_meta, &header);
    if (st != DI_OK) return st;
    size_t n_header = strlen(header);
    size_t n_pad = (8 - n_header % 8) % 8; // the data region starts 8-byte aligned
    uint64_t n = (uint64_t)(n_header + n_pad);
    uint8_t len_le[8];
    for (int i = 0; i < 8; i++) len_le[i] = (uint8_t)(n >> (8 * i));
    DI_TRY(di_buf_append(out, len_le, sizeof len_le));
    DI_TRY(di_buf_append(out, header, n_header));
    DI_TRY(di_buf_append(out, "        ", n_pad));
    for (int64_t i = 0; i < n_tensors; i++) {
        size_t n_bytes = 0;
        DI_ASSERT(write_tensor_bytes(&tensors[i], &n_bytes) == DI_OK); // checked by build_header
        DI_TRY(di_buf_append(out, tensors[i].data, n_bytes));
    }
fail:
    free(header);
    return st;
}

di_status di_st_write_file_meta(const char *path, const di_st_write_tensor *tensors,
                                int64_t n_tensors, const char *const *meta_kv, int64_t n_meta) {
    // Streamed: the header, then each tensor's bytes straight from its buffer (no copy of the whole
    // file in memory: benchmark checkpoints run to tens of GB). Same bytes as di_st_write_buf.
    char *header = NULL;
    di_status st = build_header(tensors, n_tensors, meta_kv, n_meta, &header);
    if (st != DI_OK) return st;
    FILE *fp = fopen(path, "wb");
    if (!fp) {
        DI_LOG_ERROR("cannot create %s: %s", path, strerror(errno));
        free(header);
        return DI_ERR_IO;
    }
    size_t n_header = strlen(header);
    size_t n_pad = (8 - n_header % 8) % 8; // the data region starts 8-byte aligned
    uint64_t n = (uint64_t)(n_header + n_pad);
    uint8_t len_le[8];
    for (int i = 0; i < 8; i++) len_le[i] = (uint8_t)(n >> (8 * i));
    bool ok = fwrite(len_le, 1, sizeof len_le, fp) == sizeof len_le &&
              fwrite(header, 1, n_header, fp) == n_header &&
              fwrite("        ", 1, n_pad, fp) == n_pad;
    for (int64_t i = 0; ok && i < n_tensors; i++) {
        size_t n_bytes = 0;
        DI_ASSERT(write_tensor_bytes(&tensors[i], &n_bytes) == DI_OK); // checked by build_header
        ok = n_bytes == 0 || fwrite(tensors[i].data, 1, n_bytes, fp) == n_bytes;
    }
    ok = (fclose(fp) == 0) && ok;
    if (!ok) {
        DI_LOG_ERROR("cannot write %s: %s", path, strerror(errno));
        st = DI_ERR_IO;
    }
    free(header);
    return st;
}

di_status di_st_write_file(const char *path, const di_st_write_tensor *tensors, int64_t n_tensors) {
    return di_st_write_file_meta(path, tensors, n_tensors, NULL, 0);
}
