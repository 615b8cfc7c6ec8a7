// gguf — see gguf.h. Sections: type tables, a bounds-checked cursor, parsing, lookups, writing.
// The format's facts (layout, value type numbers, ggml type numbers and block sizes) follow ggml's
// gguf.cpp / ggml.c as of llama.cpp 0c1e57098; the code is our own.
#include "io/gguf.h"

#include <stdio.h>
#include <stdlib.h>
#include <stddef.h>
#include <string.h>

#include "base/log.h"
#include "base/mem.h"
#include "base/name_index.h"
#include "base/mmap.h"

#define NAME_LOG_MAX 200 // names longer than this are cut in messages

// ---- type tables ----

static const struct {
    uint32_t type;
    const char *name;
    int64_t blck;
    size_t bytes;
} k_ggml_types[] = {
    {DI_GGML_TYPE_F32, "f32", 1, 4},       {DI_GGML_TYPE_F16, "f16", 1, 2},
    {DI_GGML_TYPE_Q8_0, "q8_0", 32, 34},   {DI_GGML_TYPE_Q2_K, "q2_K", 256, 84},
    {DI_GGML_TYPE_Q4_K, "q4_K", 256, 144}, {DI_GGML_TYPE_IQ2_XXS, "iq2_xxs", 256, 66},
    {DI_GGML_TYPE_I8, "i8", 1, 1},         {DI_GGML_TYPE_I16, "i16", 1, 2},
    {DI_GGML_TYPE_I32, "i32", 1, 4},       {DI_GGML_TYPE_I64, "i64", 1, 8},
    {DI_GGML_TYPE_F64, "f64", 1, 8},       {DI_GGML_TYPE_BF16, "bf16", 1, 2},
    {DI_GGML_TYPE_MXFP4, "mxfp4", 32, 17},
};

bool di_ggml_type_info(uint32_t type, int64_t *blck, size_t *block_bytes) {
    for (size_t i = 0; i < sizeof k_ggml_types / sizeof k_ggml_types[0]; i++) {
        if (k_ggml_types[i].type != type) continue;
        if (blck) *blck = k_ggml_types[i].blck;
        if (block_bytes) *block_bytes = k_ggml_types[i].bytes;
        return true;
    }
    return false;
}

const char *di_ggml_type_name(uint32_t type) {
    for (size_t i = 0; i < sizeof k_ggml_types / sizeof k_ggml_types[0]; i++)
        if (k_ggml_types[i].type == type) return k_ggml_types[i].name;
    return "?";
}

// Bytes of one scalar value type; 0 for STRING/ARRAY/unknown.
static size_t vtype_size(uint32_t t) {
    switch (t) {
    case DI_GGUF_VTYPE_UINT8:
    case DI_GGUF_VTYPE_INT8:
    case DI_GGUF_VTYPE_BOOL:
        return 1;
    case DI_GGUF_VTYPE_UINT16:
    case DI_GGUF_VTYPE_INT16:
        return 2;
    case DI_GGUF_VTYPE_UINT32:
    case DI_GGUF_VTYPE_INT32:
    case DI_GGUF_VTYPE_FLOAT32:
        return 4;
    case DI_GGUF_VTYPE_UINT64:
    case DI_GGUF_VTYPE_INT64:
    case DI_GGUF_VTYPE_FLOAT64:
        return 8;
    default:
        return 0;
    }
}

// ---- cursor ----

typedef struct cursor {
    const uint8_t *p; // image start
    size_t n, pos;
    const char *what;
} cursor;

static bool rd(cursor *c, void *dst, size_t k) {
    if (c->n - c->pos < k) return false;
    memcpy(dst, c->p + c->pos, k);
    c->pos += k;
    return true;
}

// A string: u64 length then bytes. *s points into the image (not NUL-terminated).
static bool rd_str(cursor *c, const char **s, uint64_t *len) {
    uint64_t l;
    if (!rd(c, &l, 8)) return false;
    if (l > c->n - c->pos) return false;
    *s = (const char *)c->p + c->pos;
    *len = l;
    c->pos += (size_t)l;
    return true;
}

// ---- the file ----

struct di_gguf_file {
    di_mmap map; // owned; zero when parsed from caller memory
    char *what;  // owned
    uint32_t version, alignment;
    di_gguf_kv *kv; // owned [cap_kv]; keys owned (NULL past the last parsed entry)
    int64_t n_kv, cap_kv;
    di_gguf_tensor *tensors; // owned [cap_tensors]; names owned
    int64_t n_tensors, cap_tensors;
    di_name_index kv_index; // owned
    di_name_index t_index;  // owned
    size_t data_bytes;
};

#define KV_INDEX(f) &(f)->kv_index, (f)->kv, sizeof(di_gguf_kv), offsetof(di_gguf_kv, key)
#define T_INDEX(f)                                                                                 \
    &(f)->t_index, (f)->tensors, sizeof(di_gguf_tensor), offsetof(di_gguf_tensor, name)

void di_gguf_close(di_gguf_file *f) {
    if (!f) return;
    di_name_index_deinit(&f->kv_index);
    di_name_index_deinit(&f->t_index);
    for (int64_t i = 0; f->kv && i < f->cap_kv; i++) di_free((char *)f->kv[i].key);
    for (int64_t i = 0; f->tensors && i < f->cap_tensors; i++) di_free((char *)f->tensors[i].name);
    di_free(f->tensors);
    di_free(f->kv);
    di_free(f->what);
    di_mmap_close(&f->map);
    di_free(f);
}

typedef struct span {
    uint64_t begin, end;
    int64_t k;
} span;

static int span_cmp(const void *a, const void *b) {
    const span *x = a, *y = b;
    if (x->begin != y->begin) return x->begin < y->begin ? -1 : 1;
    if (x->end != y->end) return x->end < y->end ? -1 : 1;
    return 0;
}

#define BAD(...)                                                                                   \
    do {                                                                                           \
        DI_LOG_ERROR(__VA_ARGS__);                                                                 \
        st = DI_ERR_FORMAT;                                                                        \
        goto fail;                                                                                 \
    } while (0)

// A NUL-terminated heap copy of a length-delimited name (free with di_free), or NULL.
static char *dup_name(const char *s, uint64_t len) {
    char *p = di_malloc((size_t)len + 1);
    if (p) {
        memcpy(p, s, (size_t)len);
        p[len] = 0;
    }
    return p;
}

// Skips (and checks) one value of type t at the cursor. Arrays are one level deep.
static bool skip_value(cursor *c, uint32_t t, uint32_t *arr_type, uint64_t *n, uint64_t *str_len) {
    *n = 1;
    if (t == DI_GGUF_VTYPE_STRING) {
        const char *s;
        return rd_str(c, &s, str_len);
    }
    if (t == DI_GGUF_VTYPE_ARRAY) {
        uint32_t et;
        uint64_t cnt;
        if (!rd(c, &et, 4) || !rd(c, &cnt, 8)) return false;
        *arr_type = et;
        *n = cnt;
        if (et == DI_GGUF_VTYPE_STRING) {
            // Each string needs at least its 8-byte length: bound the loop by the bytes left.
            if (cnt > (c->n - c->pos) / 8) return false;
            for (uint64_t i = 0; i < cnt; i++) {
                const char *s;
                uint64_t l;
                if (!rd_str(c, &s, &l)) return false;
            }
            return true;
        }
        size_t es = vtype_size(et);
        if (es == 0) return false; // nested array or unknown element type (caller reports)
        if (cnt > (c->n - c->pos) / es) return false;
        if (et == DI_GGUF_VTYPE_BOOL)
            for (uint64_t i = 0; i < cnt; i++)
                if (c->p[c->pos + i] > 1) return false;
        c->pos += (size_t)(cnt * es);
        return true;
    }
    size_t es = vtype_size(t);
    if (es == 0 || c->n - c->pos < es) return false;
    if (t == DI_GGUF_VTYPE_BOOL && c->p[c->pos] > 1) return false;
    c->pos += es;
    return true;
}

di_status di_gguf_parse(const uint8_t *bytes, size_t n_bytes, const char *what,
                        di_gguf_file **out) {
    di_status st = DI_OK;
    span *spans = NULL;
    if (!what) what = "(memory)";
    di_gguf_file *f = di_calloc(1, sizeof *f);
    if (!f) return DI_ERR_NOMEM;
    f->what = di_strdup(what);
    if (!f->what) {
        st = DI_ERR_NOMEM;
        goto fail;
    }
    what = f->what;
    cursor c = {bytes, n_bytes, 0, what};

    // header
    uint32_t magic, version;
    uint64_t n_tensors, n_kv;
    if (!rd(&c, &magic, 4)) BAD("%s: truncated GGUF header (%zu bytes)", what, n_bytes);
    if (memcmp(&magic, "GGUF", 4) != 0) BAD("%s: not a GGUF file (bad magic)", what);
    if (!rd(&c, &version, 4)) BAD("%s: truncated GGUF header (no version)", what);
    if (version == 1) BAD("%s: GGUF version 1 (32-bit counts) is not supported", what);
    if (version != 2 && version != 3) BAD("%s: unknown GGUF version %u", what, version);
    if (!rd(&c, &n_tensors, 8) || !rd(&c, &n_kv, 8))
        BAD("%s: truncated GGUF header (no counts)", what);
    // Every entry needs some bytes: a key/value at least 8 + 4 + 1, a tensor info 8 + 4 + 8 + 4
    // + 8.
    if (n_kv > (n_bytes - c.pos) / 13)
        BAD("%s: metadata count %llu is more than the file can hold", what,
            (unsigned long long)n_kv);
    if (n_tensors > (n_bytes - c.pos) / 32)
        BAD("%s: tensor count %llu is more than the file can hold", what,
            (unsigned long long)n_tensors);
    f->version = version;
    f->alignment = DI_GGUF_DEFAULT_ALIGNMENT;

    // Keys and names are copied one by one (a GGUF's header is small next to its data, so the
    // counts, bounded above by the bytes left, are the only sizes allocated up front).
    f->kv = di_calloc((size_t)n_kv + 1, sizeof *f->kv);
    f->tensors = di_calloc((size_t)n_tensors + 1, sizeof *f->tensors);
    f->cap_kv = (int64_t)n_kv;
    f->cap_tensors = (int64_t)n_tensors;
    if (!f->kv || !f->tensors) {
        st = DI_ERR_NOMEM;
        goto fail;
    }
    if ((st = di_name_index_init(&f->kv_index, (int64_t)n_kv)) != DI_OK) goto fail;
    if ((st = di_name_index_init(&f->t_index, (int64_t)n_tensors)) != DI_OK) goto fail;

    // metadata
    for (uint64_t i = 0; i < n_kv; i++) {
        const char *key;
        uint64_t klen;
        if (!rd_str(&c, &key, &klen))
            BAD("%s: metadata entry %llu: truncated key", what, (unsigned long long)i);
        if (klen == 0) BAD("%s: metadata entry %llu: empty key", what, (unsigned long long)i);
        di_gguf_kv *kv = &f->kv[i];
        if (memchr(key, 0, (size_t)klen))
            BAD("%s: metadata entry %llu: key contains a NUL byte", what, (unsigned long long)i);
        if (!(kv->key = dup_name(key, klen))) {
            st = DI_ERR_NOMEM;
            goto fail;
        }
        uint32_t t;
        if (!rd(&c, &t, 4))
            BAD("%s: key \"%.*s\": truncated value type", what, NAME_LOG_MAX, kv->key);
        if (t >= DI_GGUF_VTYPE_COUNT)
            BAD("%s: key \"%.*s\": unknown value type %u", what, NAME_LOG_MAX, kv->key, t);
        kv->type = (di_gguf_vtype)t;
        size_t vstart = c.pos;
        uint32_t et = 0;
        if (t == DI_GGUF_VTYPE_ARRAY) {
            uint32_t peek;
            if (c.n - c.pos >= 4) {
                memcpy(&peek, c.p + c.pos, 4);
                if (peek == DI_GGUF_VTYPE_ARRAY)
                    BAD("%s: key \"%.*s\": nested arrays are not supported", what, NAME_LOG_MAX,
                        kv->key);
                if (peek >= DI_GGUF_VTYPE_COUNT)
                    BAD("%s: key \"%.*s\": unknown array element type %u", what, NAME_LOG_MAX,
                        kv->key, peek);
            }
        }
        if (!skip_value(&c, t, &et, &kv->n, &kv->str_len))
            BAD("%s: key \"%.*s\": truncated or invalid %s value", what, NAME_LOG_MAX, kv->key,
                t == DI_GGUF_VTYPE_ARRAY ? "array" : "scalar");
        kv->arr_type = (di_gguf_vtype)et;
        kv->data = bytes + vstart + (t == DI_GGUF_VTYPE_ARRAY ? 12 : 0);
        if (di_name_index_insert(KV_INDEX(f), (int64_t)i) >= 0)
            BAD("%s: duplicate metadata key \"%.*s\"", what, NAME_LOG_MAX, kv->key);
        f->n_kv = (int64_t)i + 1;
    }

    const di_gguf_kv *al = di_gguf_find_kv(f, "general.alignment");
    if (al) {
        uint32_t a;
        if (al->type != DI_GGUF_VTYPE_UINT32) BAD("%s: general.alignment must be a uint32", what);
        memcpy(&a, al->data, 4);
        if (a == 0 || (a & (a - 1)) != 0)
            BAD("%s: general.alignment %u is not a power of two", what, a);
        f->alignment = a;
    }

    // tensor infos
    for (uint64_t i = 0; i < n_tensors; i++) {
        di_gguf_tensor *t = &f->tensors[i];
        const char *name;
        uint64_t nlen;
        if (!rd_str(&c, &name, &nlen))
            BAD("%s: tensor info %llu: truncated name", what, (unsigned long long)i);
        if (nlen == 0) BAD("%s: tensor info %llu: empty name", what, (unsigned long long)i);
        if (nlen >= DI_GGUF_NAME_MAX)
            BAD("%s: tensor \"%.*s\": name is %llu bytes, ggml allows at most %d", what,
                NAME_LOG_MAX, name, (unsigned long long)nlen, DI_GGUF_NAME_MAX - 1);
        if (memchr(name, 0, (size_t)nlen))
            BAD("%s: tensor info %llu: name contains a NUL byte", what, (unsigned long long)i);
        if (!(t->name = dup_name(name, nlen))) {
            st = DI_ERR_NOMEM;
            goto fail;
        }
        uint32_t nd;
        if (!rd(&c, &nd, 4)) BAD("%s: tensor \"%s\": truncated info", what, t->name);
        if (nd < 1 || nd > DI_GGUF_MAX_DIMS)
            BAD("%s: tensor \"%s\": %u dims (1..%d allowed)", what, t->name, nd, DI_GGUF_MAX_DIMS);
        t->n_dims = (int)nd;
        uint64_t n_el = 1;
        for (int d = 0; d < DI_GGUF_MAX_DIMS; d++) t->ne[d] = 1;
        for (uint32_t d = 0; d < nd; d++) {
            uint64_t ne;
            if (!rd(&c, &ne, 8)) BAD("%s: tensor \"%s\": truncated info", what, t->name);
            if (ne > (uint64_t)INT64_MAX || (ne != 0 && n_el > (uint64_t)INT64_MAX / ne))
                BAD("%s: tensor \"%s\": element count overflows at ne[%u]", what, t->name, d);
            n_el *= ne;
            t->ne[d] = (int64_t)ne;
        }
        if (!rd(&c, &t->type, 4) || !rd(&c, &t->offset, 8))
            BAD("%s: tensor \"%s\": truncated info", what, t->name);
        int64_t blck;
        size_t bb;
        if (!di_ggml_type_info(t->type, &blck, &bb))
            BAD("%s: tensor \"%s\": unsupported ggml type %u", what, t->name, t->type);
        if (t->ne[0] % blck != 0)
            BAD("%s: tensor \"%s\": ne[0] = %lld is not a multiple of the %s block (%lld)", what,
                t->name, (long long)t->ne[0], di_ggml_type_name(t->type), (long long)blck);
        uint64_t n_blocks = n_el / (uint64_t)blck;
        if (n_blocks > SIZE_MAX / bb) BAD("%s: tensor \"%s\": byte size overflows", what, t->name);
        t->n_elements = (int64_t)n_el;
        t->n_bytes = (size_t)n_blocks * bb;
        if (t->offset % f->alignment != 0)
            BAD("%s: tensor \"%s\": offset %llu is not a multiple of the alignment %u", what,
                t->name, (unsigned long long)t->offset, f->alignment);
        if (di_name_index_insert(T_INDEX(f), (int64_t)i) >= 0)
            BAD("%s: duplicate tensor name \"%s\"", what, t->name);
        f->n_tensors = (int64_t)i + 1;
    }

    // data region
    size_t hdr_end = c.pos;
    size_t pad = (f->alignment - hdr_end % f->alignment) % f->alignment;
    size_t data_start = hdr_end + pad;
    size_t data_size = data_start <= n_bytes ? n_bytes - data_start : 0;
    if (n_tensors > 0 && data_start > n_bytes)
        BAD("%s: file ends inside the padding before the data region", what);
    spans = di_malloc(sizeof *spans * ((size_t)n_tensors + 1));
    if (!spans) {
        st = DI_ERR_NOMEM;
        goto fail;
    }
    for (int64_t i = 0; i < f->n_tensors; i++) {
        di_gguf_tensor *t = &f->tensors[i];
        if (t->offset > data_size || t->n_bytes > data_size - t->offset)
            BAD("%s: tensor \"%s\": data [%llu, +%zu) is beyond the data region (%zu bytes)", what,
                t->name, (unsigned long long)t->offset, t->n_bytes, data_size);
        t->data = bytes + data_start + t->offset;
        f->data_bytes += t->n_bytes;
        spans[i] = (span){t->offset, t->offset + t->n_bytes, i};
    }
    qsort(spans, (size_t)f->n_tensors, sizeof *spans, span_cmp);
    // Empty tensors overlap nothing; otherwise each must start at or after the furthest end so far.
    uint64_t max_end = 0;
    int64_t max_k = -1;
    for (int64_t i = 0; i < f->n_tensors; i++) {
        if (spans[i].end == spans[i].begin) continue;
        if (max_k >= 0 && spans[i].begin < max_end)
            BAD("%s: tensors \"%s\" and \"%s\" overlap", what, f->tensors[max_k].name,
                f->tensors[spans[i].k].name);
        if (spans[i].end > max_end) {
            max_end = spans[i].end;
            max_k = spans[i].k;
        }
    }
    di_free(spans);
    *out = f;
    return DI_OK;
fail:
    di_free(spans);
    di_gguf_close(f);
    return st;
}
#undef BAD

di_status di_gguf_open(const char *path, di_gguf_file **out) {
    di_mmap m;
    di_status st = di_mmap_open(path, &m);
    if (st != DI_OK) return st;
    di_gguf_file *f;
    st = di_gguf_parse(m.data, m.size, path, &f);
    if (st != DI_OK) {
        di_mmap_close(&m);
        return st;
    }
    f->map = m;
    *out = f;
    return DI_OK;
}

// ---- lookups ----

uint32_t di_gguf_version(const di_gguf_file *f) {
    return f->version;
}
uint32_t di_gguf_alignment(const di_gguf_file *f) {
    return f->alignment;
}
int64_t di_gguf_n_kv(const di_gguf_file *f) {
    return f->n_kv;
}
const di_gguf_kv *di_gguf_kv_at(const di_gguf_file *f, int64_t i) {
    DI_ASSERT(i >= 0 && i < f->n_kv);
    return &f->kv[i];
}
int64_t di_gguf_n_tensors(const di_gguf_file *f) {
    return f->n_tensors;
}
const di_gguf_tensor *di_gguf_tensor_at(const di_gguf_file *f, int64_t i) {
    DI_ASSERT(i >= 0 && i < f->n_tensors);
    return &f->tensors[i];
}
size_t di_gguf_data_bytes(const di_gguf_file *f) {
    return f->data_bytes;
}

const di_gguf_kv *di_gguf_find_kv(const di_gguf_file *f, const char *key) {
    int64_t k = di_name_index_find(KV_INDEX(f), key);
    return k < 0 ? NULL : &f->kv[k];
}

const di_gguf_tensor *di_gguf_find_tensor(const di_gguf_file *f, const char *name) {
    int64_t k = di_name_index_find(T_INDEX(f), name);
    return k < 0 ? NULL : &f->tensors[k];
}

// Reads element i of integer type t at p into *out; false for a non-integer type or a uint64 that
// does not fit int64.
static bool load_int(uint32_t t, const uint8_t *p, int64_t *out) {
    switch (t) {
    case DI_GGUF_VTYPE_UINT8:
    case DI_GGUF_VTYPE_BOOL:
        *out = p[0];
        return true;
    case DI_GGUF_VTYPE_INT8:
        *out = (int8_t)p[0];
        return true;
    case DI_GGUF_VTYPE_UINT16: {
        uint16_t v;
        memcpy(&v, p, 2);
        *out = v;
        return true;
    }
    case DI_GGUF_VTYPE_INT16: {
        int16_t v;
        memcpy(&v, p, 2);
        *out = v;
        return true;
    }
    case DI_GGUF_VTYPE_UINT32: {
        uint32_t v;
        memcpy(&v, p, 4);
        *out = v;
        return true;
    }
    case DI_GGUF_VTYPE_INT32: {
        int32_t v;
        memcpy(&v, p, 4);
        *out = v;
        return true;
    }
    case DI_GGUF_VTYPE_UINT64: {
        uint64_t v;
        memcpy(&v, p, 8);
        if (v > (uint64_t)INT64_MAX) return false;
        *out = (int64_t)v;
        return true;
    }
    case DI_GGUF_VTYPE_INT64: {
        int64_t v;
        memcpy(&v, p, 8);
        *out = v;
        return true;
    }
    default:
        return false;
    }
}

static bool load_num(uint32_t t, const uint8_t *p, double *out) {
    if (t == DI_GGUF_VTYPE_FLOAT32) {
        float v;
        memcpy(&v, p, 4);
        *out = v;
        return true;
    }
    if (t == DI_GGUF_VTYPE_FLOAT64) {
        double v;
        memcpy(&v, p, 8);
        *out = v;
        return true;
    }
    int64_t i;
    if (!load_int(t, p, &i)) return false;
    *out = (double)i;
    return true;
}

bool di_gguf_get_int(const di_gguf_file *f, const char *key, int64_t *out) {
    const di_gguf_kv *kv = di_gguf_find_kv(f, key);
    return kv && load_int(kv->type, kv->data, out);
}

bool di_gguf_get_num(const di_gguf_file *f, const char *key, double *out) {
    const di_gguf_kv *kv = di_gguf_find_kv(f, key);
    return kv && load_num(kv->type, kv->data, out);
}

bool di_gguf_get_str(const di_gguf_file *f, const char *key, const char **s, size_t *len) {
    const di_gguf_kv *kv = di_gguf_find_kv(f, key);
    if (!kv || kv->type != DI_GGUF_VTYPE_STRING) return false;
    *s = (const char *)kv->data + 8;
    *len = (size_t)kv->str_len;
    return true;
}

bool di_gguf_get_int_arr(const di_gguf_file *f, const char *key, int64_t *out, int64_t cap,
                         int64_t *n) {
    const di_gguf_kv *kv = di_gguf_find_kv(f, key);
    if (!kv) return false;
    if (kv->type != DI_GGUF_VTYPE_ARRAY) {
        int64_t v;
        if (!load_int(kv->type, kv->data, &v)) return false;
        for (int64_t i = 0; i < cap; i++) out[i] = v;
        *n = -1; // a scalar: broadcast
        return true;
    }
    size_t es = vtype_size(kv->arr_type);
    if (es == 0 || kv->arr_type == DI_GGUF_VTYPE_FLOAT32 || kv->arr_type == DI_GGUF_VTYPE_FLOAT64)
        return false;
    int64_t m = (int64_t)kv->n < cap ? (int64_t)kv->n : cap;
    for (int64_t i = 0; i < m; i++)
        if (!load_int(kv->arr_type, kv->data + (size_t)i * es, &out[i])) return false;
    *n = (int64_t)kv->n;
    return true;
}

bool di_gguf_get_num_arr(const di_gguf_file *f, const char *key, double *out, int64_t cap,
                         int64_t *n) {
    const di_gguf_kv *kv = di_gguf_find_kv(f, key);
    if (!kv) return false;
    if (kv->type != DI_GGUF_VTYPE_ARRAY) {
        double v;
        if (!load_num(kv->type, kv->data, &v)) return false;
        for (int64_t i = 0; i < cap; i++) out[i] = v;
        *n = -1;
        return true;
    }
    size_t es = vtype_size(kv->arr_type);
    if (es == 0) return false;
    int64_t m = (int64_t)kv->n < cap ? (int64_t)kv->n : cap;
    for (int64_t i = 0; i < m; i++)
        if (!load_num(kv->arr_type, kv->data + (size_t)i * es, &out[i])) return false;
    *n = (int64_t)kv->n;
    return true;
}

// ---- writing ----

typedef struct wtensor {
    char name[DI_GGUF_NAME_MAX];
    uint32_t type;
    int n_dims;
    int64_t ne[DI_GGUF_MAX_DIMS];
    const void *data; // borrowed, or NULL (fill)
    size_t n_bytes;
    uint64_t offset;
} wtensor;

struct di_gguf_writer {
    di_buf kv; // serialised metadata entries
    int64_t n_kv;
    wtensor *t; // owned
    int64_t n_t, cap_t;
    uint64_t data_size;
};

di_status di_gguf_writer_create(di_gguf_writer **out) {
    di_gguf_writer *w = di_calloc(1, sizeof *w);
    if (!w) return DI_ERR_NOMEM;
    di_buf_init(&w->kv);
    *out = w;
    return DI_OK;
}

void di_gguf_writer_destroy(di_gguf_writer *w) {
    if (!w) return;
    di_buf_deinit(&w->kv);
    di_free(w->t);
    di_free(w);
}

static di_status put_str(di_buf *b, const char *s) {
    uint64_t l = strlen(s);
    di_status st = di_buf_append(b, &l, 8);
    return st == DI_OK ? di_buf_append(b, s, (size_t)l) : st;
}

static di_status put_key(di_gguf_writer *w, const char *key, uint32_t t) {
    di_status st = put_str(&w->kv, key);
    if (st == DI_OK) st = di_buf_append(&w->kv, &t, 4);
    if (st == DI_OK) w->n_kv++;
    return st;
}

di_status di_gguf_writer_add_u32(di_gguf_writer *w, const char *key, uint32_t v) {
    di_status st = put_key(w, key, DI_GGUF_VTYPE_UINT32);
    return st == DI_OK ? di_buf_append(&w->kv, &v, 4) : st;
}

di_status di_gguf_writer_add_i32(di_gguf_writer *w, const char *key, int32_t v) {
    di_status st = put_key(w, key, DI_GGUF_VTYPE_INT32);
    return st == DI_OK ? di_buf_append(&w->kv, &v, 4) : st;
}

di_status di_gguf_writer_add_f32(di_gguf_writer *w, const char *key, float v) {
    di_status st = put_key(w, key, DI_GGUF_VTYPE_FLOAT32);
    return st == DI_OK ? di_buf_append(&w->kv, &v, 4) : st;
}

di_status di_gguf_writer_add_bool(di_gguf_writer *w, const char *key, bool v) {
    uint8_t b = v ? 1 : 0;
    di_status st = put_key(w, key, DI_GGUF_VTYPE_BOOL);
    return st == DI_OK ? di_buf_append(&w->kv, &b, 1) : st;
}

di_status di_gguf_writer_add_str(di_gguf_writer *w, const char *key, const char *v) {
    di_status st = put_key(w, key, DI_GGUF_VTYPE_STRING);
    return st == DI_OK ? put_str(&w->kv, v) : st;
}

di_status di_gguf_writer_add_arr(di_gguf_writer *w, const char *key, di_gguf_vtype elem,
                                 const void *values, uint64_t n) {
    size_t es = vtype_size(elem);
    if (es == 0) return DI_ERR_INVALID;
    uint32_t et = elem;
    di_status st = put_key(w, key, DI_GGUF_VTYPE_ARRAY);
    if (st == DI_OK) st = di_buf_append(&w->kv, &et, 4);
    if (st == DI_OK) st = di_buf_append(&w->kv, &n, 8);
    if (st == DI_OK && n) st = di_buf_append(&w->kv, values, (size_t)n * es);
    return st;
}

di_status di_gguf_writer_add_arr_str(di_gguf_writer *w, const char *key, const char *const *v,
                                     uint64_t n) {
    uint32_t et = DI_GGUF_VTYPE_STRING;
    di_status st = put_key(w, key, DI_GGUF_VTYPE_ARRAY);
    if (st == DI_OK) st = di_buf_append(&w->kv, &et, 4);
    if (st == DI_OK) st = di_buf_append(&w->kv, &n, 8);
    for (uint64_t i = 0; st == DI_OK && i < n; i++) st = put_str(&w->kv, v[i]);
    return st;
}

di_status di_gguf_writer_add_tensor(di_gguf_writer *w, const char *name, uint32_t type, int n_dims,
                                    const int64_t *ne, const void *data) {
    int64_t blck;
    size_t bb;
    if (!name || !*name || strlen(name) >= DI_GGUF_NAME_MAX ||
        !di_ggml_type_info(type, &blck, &bb) || n_dims < 1 || n_dims > DI_GGUF_MAX_DIMS ||
        ne[0] % blck != 0)
        return DI_ERR_INVALID;
    for (int64_t i = 0; i < w->n_t; i++)
        if (strcmp(w->t[i].name, name) == 0) return DI_ERR_INVALID;
    if (w->n_t == w->cap_t) {
        int64_t cap = w->cap_t ? 2 * w->cap_t : 64;
        wtensor *p = di_realloc(w->t, sizeof *p * (size_t)cap);
        if (!p) return DI_ERR_NOMEM;
        w->t = p;
        w->cap_t = cap;
    }
    wtensor *t = &w->t[w->n_t];
    memset(t, 0, sizeof *t);
    snprintf(t->name, sizeof t->name, "%s", name);
    t->type = type;
    t->n_dims = n_dims;
    int64_t n = 1;
    for (int d = 0; d < DI_GGUF_MAX_DIMS; d++) {
        t->ne[d] = d < n_dims ? ne[d] : 1;
        if (t->ne[d] < 0) return DI_ERR_INVALID;
        n *= t->ne[d];
    }
    t->data = data;
    t->n_bytes = (size_t)(n / blck) * bb;
    t->offset = w->data_size;
    w->data_size += (t->n_bytes + DI_GGUF_DEFAULT_ALIGNMENT - 1) / DI_GGUF_DEFAULT_ALIGNMENT *
                    DI_GGUF_DEFAULT_ALIGNMENT;
    w->n_t++;
    return DI_OK;
}

// The header: magic, version 3, counts, metadata, tensor infos, padding to the alignment.
static di_status build_header(const di_gguf_writer *w, di_buf *h) {
    uint32_t v = 3;
    uint64_t nt = (uint64_t)w->n_t, nk = (uint64_t)w->n_kv;
    di_status st = di_buf_append(h, "GGUF", 4);
    if (st == DI_OK) st = di_buf_append(h, &v, 4);
    if (st == DI_OK) st = di_buf_append(h, &nt, 8);
    if (st == DI_OK) st = di_buf_append(h, &nk, 8);
    if (st == DI_OK && w->kv.len) st = di_buf_append(h, w->kv.data, w->kv.len);
    for (int64_t i = 0; st == DI_OK && i < w->n_t; i++) {
        const wtensor *t = &w->t[i];
        uint32_t nd = (uint32_t)t->n_dims;
        st = put_str(h, t->name);
        if (st == DI_OK) st = di_buf_append(h, &nd, 4);
        for (int d = 0; st == DI_OK && d < t->n_dims; d++) st = di_buf_append(h, &t->ne[d], 8);
        if (st == DI_OK) st = di_buf_append(h, &t->type, 4);
        if (st == DI_OK) st = di_buf_append(h, &t->offset, 8);
    }
    static const uint8_t zeros[DI_GGUF_DEFAULT_ALIGNMENT];
    size_t pad = (DI_GGUF_DEFAULT_ALIGNMENT - h->len % DI_GGUF_DEFAULT_ALIGNMENT) %
                 DI_GGUF_DEFAULT_ALIGNMENT;
    if (st == DI_OK && pad) st = di_buf_append(h, zeros, pad);
    return st;
}

// Calls emit(ctx, bytes, n) for every tensor's data and padding, producing fill tensors into a
// scratch buffer one at a time.
typedef di_status (*emit_fn)(void *ctx, const void *p, size_t n);

static di_status emit_data(const di_gguf_writer *w, di_gguf_fill_fn fill, void *user, emit_fn emit,
                           void *ctx) {
    static const uint8_t zeros[DI_GGUF_DEFAULT_ALIGNMENT];
    uint8_t *scr = NULL;
    size_t scr_cap = 0;
    di_status st = DI_OK;
    for (int64_t i = 0; st == DI_OK && i < w->n_t; i++) {
        const wtensor *t = &w->t[i];
        const void *p = t->data;
        if (!p && t->n_bytes) {
            if (!fill) {
                st = DI_ERR_INVALID;
                break;
            }
            if (scr_cap < t->n_bytes) {
                di_free(scr);
                scr = di_malloc(t->n_bytes);
                scr_cap = scr ? t->n_bytes : 0;
                if (!scr) {
                    st = DI_ERR_NOMEM;
                    break;
                }
            }
            st = fill(user, i, scr, t->n_bytes);
            p = scr;
        }
        if (st == DI_OK && t->n_bytes) st = emit(ctx, p, t->n_bytes);
        size_t pad = (DI_GGUF_DEFAULT_ALIGNMENT - t->n_bytes % DI_GGUF_DEFAULT_ALIGNMENT) %
                     DI_GGUF_DEFAULT_ALIGNMENT;
        if (st == DI_OK && pad) st = emit(ctx, zeros, pad);
    }
    di_free(scr);
    return st;
}

static di_status emit_file(void *ctx, const void *p, size_t n) {
    return fwrite(p, 1, n, (FILE *)ctx) == n ? DI_OK : DI_ERR_IO;
}

static di_status emit_buf(void *ctx, const void *p, size_t n) {
    return di_buf_append((di_buf *)ctx, p, n);
}

di_status di_gguf_writer_write_file(const di_gguf_writer *w, const char *path, di_gguf_fill_fn fill,
                                    void *user) {
    di_buf h;
    di_buf_init(&h);
    di_status st = build_header(w, &h);
    if (st != DI_OK) {
        di_buf_deinit(&h);
        return st;
    }
    FILE *fp = fopen(path, "wb");
    if (!fp) {
        DI_LOG_ERROR("%s: cannot create GGUF file", path);
        di_buf_deinit(&h);
        return DI_ERR_IO;
    }
    st = emit_file(fp, h.data, h.len);
    di_buf_deinit(&h);
    if (st == DI_OK) st = emit_data(w, fill, user, emit_file, fp);
    if (fclose(fp) != 0 && st == DI_OK) st = DI_ERR_IO;
    if (st == DI_ERR_IO) DI_LOG_ERROR("%s: write failed", path);
    return st;
}

di_status di_gguf_writer_write_buf(const di_gguf_writer *w, di_buf *out, di_gguf_fill_fn fill,
                                   void *user) {
    di_status st = build_header(w, out);
    return st == DI_OK ? emit_data(w, fill, user, emit_buf, out) : st;
}
