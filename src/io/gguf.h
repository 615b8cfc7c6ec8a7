/*
 * gguf — reader and writer for GGUF files (the ggml/llama.cpp container, versions 2 and 3).
 *
 * A file is: magic "GGUF", u32 version, u64 n_tensors, u64 n_kv; n_kv metadata entries (string key,
 * u32 value type, value; arrays are u32 element type, u64 count, elements; strings are u64 length
 * and bytes); n_tensors tensor infos (string name, u32 n_dims, u64 ne[n_dims] with ne[0] the
 * fastest dimension, u32 ggml type, u64 offset); padding to `general.alignment` (default 32); then
 * the data region, in which each tensor's offset is relative to the region's start. All integers
 * are little-endian.
 *
 * The parser checks everything before any tensor is used and never reads outside the image: every
 * count and length against the bytes left, known value and tensor types (removed ggml types are
 * unknown), no nested arrays, booleans 0 or 1, unique keys and tensor names, names without NUL
 * bytes and shorter than 64 bytes (ggml's limit), 1..4 dims, no element count or byte size
 * overflow, ne[0] a multiple of the type's block, a power-of-two alignment, offsets aligned and
 * inside the data region, no two tensors overlapping. A violation is DI_ERR_FORMAT with a message
 * naming the file and the key or tensor.
 *
 * Owns: the mapping (when opened from a path), the key and tensor directory. Values, strings and
 * tensor data are views into the image, valid until close.
 * Thread-safety: immutable after parse; lookups from any thread. The writer: one thread.
 */
#pragma once

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "base/buf.h"  // di_buf
#include "deepinfer.h" // di_status

// ---- types ----

// Metadata value types (gguf_type).
typedef enum di_gguf_vtype {
    DI_GGUF_VTYPE_UINT8 = 0,
    DI_GGUF_VTYPE_INT8 = 1,
    DI_GGUF_VTYPE_UINT16 = 2,
    DI_GGUF_VTYPE_INT16 = 3,
    DI_GGUF_VTYPE_UINT32 = 4,
    DI_GGUF_VTYPE_INT32 = 5,
    DI_GGUF_VTYPE_FLOAT32 = 6,
    DI_GGUF_VTYPE_BOOL = 7,
    DI_GGUF_VTYPE_STRING = 8,
    DI_GGUF_VTYPE_ARRAY = 9,
    DI_GGUF_VTYPE_UINT64 = 10,
    DI_GGUF_VTYPE_INT64 = 11,
    DI_GGUF_VTYPE_FLOAT64 = 12,
    DI_GGUF_VTYPE_COUNT
} di_gguf_vtype;

// ggml tensor types this reader knows (the numbers are ggml's enum ggml_type). Only these are
// accepted; the others (Q4_0, Q5_K, IQ3_S, ...) are DI_ERR_FORMAT "unsupported type".
typedef enum di_ggml_type {
    DI_GGML_TYPE_F32 = 0,
    DI_GGML_TYPE_F16 = 1,
    DI_GGML_TYPE_Q8_0 = 8,
    DI_GGML_TYPE_Q2_K = 10,
    DI_GGML_TYPE_Q4_K = 12,
    DI_GGML_TYPE_IQ2_XXS = 16,
    DI_GGML_TYPE_I8 = 24,
    DI_GGML_TYPE_I16 = 25,
    DI_GGML_TYPE_I32 = 26,
    DI_GGML_TYPE_I64 = 27,
    DI_GGML_TYPE_F64 = 28,
    DI_GGML_TYPE_BF16 = 30,
    DI_GGML_TYPE_MXFP4 = 39,
} di_ggml_type;

// Block size (elements) and bytes per block of a known ggml type; false if unknown.
bool di_ggml_type_info(uint32_t type, int64_t *blck, size_t *block_bytes);
// "q8_0", "q4_K", ... as ggml names them; "?" if unknown.
const char *di_ggml_type_name(uint32_t type);

#define DI_GGUF_MAX_DIMS 4
#define DI_GGUF_NAME_MAX 64 // ggml's GGML_MAX_NAME: tensor names are shorter than this
#define DI_GGUF_DEFAULT_ALIGNMENT 32

typedef struct di_gguf_kv {
    const char *key; // owned by the file (NUL-terminated copy)
    di_gguf_vtype type;
    di_gguf_vtype arr_type; // element type when type == ARRAY
    uint64_t n;             // array length (1 for scalars)
    const uint8_t *data;    // view: the value bytes (for arrays, the first element; strings are
                            // u64 length + bytes each)
    uint64_t str_len;       // STRING: byte length of the value at data + 8
} di_gguf_kv;

typedef struct di_gguf_tensor {
    const char *name; // owned by the file
    uint32_t type;    // di_ggml_type
    int n_dims;
    int64_t ne[DI_GGUF_MAX_DIMS]; // ne[0] fastest; unused dims are 1
    int64_t n_elements;
    uint64_t offset;  // in the data region
    const void *data; // view
    size_t n_bytes;
} di_gguf_tensor;

typedef struct di_gguf_file di_gguf_file;

// ---- reading ----

// Parses a whole GGUF image held in memory (the fuzz target's entry point). `what` names it in
// errors (NULL: "(memory)"); bytes must outlive the result. DI_ERR_FORMAT (logged), DI_ERR_NOMEM.
di_status di_gguf_parse(const uint8_t *bytes, size_t n_bytes, const char *what, di_gguf_file **out);
// Maps and parses one file; the result owns the mapping. DI_ERR_IO, DI_ERR_FORMAT, DI_ERR_NOMEM.
di_status di_gguf_open(const char *path, di_gguf_file **out);
// Unmaps and frees. NULL does nothing.
void di_gguf_close(di_gguf_file *f);

uint32_t di_gguf_version(const di_gguf_file *f);
uint32_t di_gguf_alignment(const di_gguf_file *f);
int64_t di_gguf_n_kv(const di_gguf_file *f);
const di_gguf_kv *di_gguf_kv_at(const di_gguf_file *f, int64_t i); // 0 <= i < n_kv (asserted)
const di_gguf_kv *di_gguf_find_kv(const di_gguf_file *f, const char *key); // NULL if absent
int64_t di_gguf_n_tensors(const di_gguf_file *f);
const di_gguf_tensor *di_gguf_tensor_at(const di_gguf_file *f, int64_t i);          // asserted
const di_gguf_tensor *di_gguf_find_tensor(const di_gguf_file *f, const char *name); // O(1)
// Total bytes of tensor data.
size_t di_gguf_data_bytes(const di_gguf_file *f);

// Typed metadata access. Each returns false (writing nothing) when the key is absent or its type
// does not fit: _int accepts any integer type (and BOOL) whose value fits int64; _num any integer
// or float type; _str a STRING (the result is a view: *len bytes, not NUL-terminated).
bool di_gguf_get_int(const di_gguf_file *f, const char *key, int64_t *out);
bool di_gguf_get_num(const di_gguf_file *f, const char *key, double *out);
bool di_gguf_get_str(const di_gguf_file *f, const char *key, const char **s, size_t *len);
// An integer array (any integer element type) or a single integer (broadcast to every slot):
// writes min(n, cap) values and the array length to *n. False if absent or of another type.
bool di_gguf_get_int_arr(const di_gguf_file *f, const char *key, int64_t *out, int64_t cap,
                         int64_t *n);
// Same for numbers (integer or float elements).
bool di_gguf_get_num_arr(const di_gguf_file *f, const char *key, double *out, int64_t cap,
                         int64_t *n);

// ---- writing (tools, tests, the fuzz corpus) ----

typedef struct di_gguf_writer di_gguf_writer;

// Produces the data of tensor `i` (as added) into dst (n_bytes). Used by writers of files larger
// than memory: each tensor is produced only when written.
typedef di_status (*di_gguf_fill_fn)(void *user, int64_t i, uint8_t *dst, size_t n_bytes);

di_status di_gguf_writer_create(di_gguf_writer **out); // DI_ERR_NOMEM
void di_gguf_writer_destroy(di_gguf_writer *w);        // NULL does nothing
// Metadata, written in the order added. Keys are copied. DI_ERR_NOMEM.
di_status di_gguf_writer_add_u32(di_gguf_writer *w, const char *key, uint32_t v);
di_status di_gguf_writer_add_i32(di_gguf_writer *w, const char *key, int32_t v);
di_status di_gguf_writer_add_f32(di_gguf_writer *w, const char *key, float v);
di_status di_gguf_writer_add_bool(di_gguf_writer *w, const char *key, bool v);
di_status di_gguf_writer_add_str(di_gguf_writer *w, const char *key, const char *v);
// Arrays of n elements of an integer/float type (elements given as raw little-endian values of
// that type), or of strings.
di_status di_gguf_writer_add_arr(di_gguf_writer *w, const char *key, di_gguf_vtype elem,
                                 const void *values, uint64_t n);
di_status di_gguf_writer_add_arr_str(di_gguf_writer *w, const char *key, const char *const *v,
                                     uint64_t n);
// A tensor of ggml `type` and shape ne[0..n_dims) (ne[0] fastest). `data` (borrowed until the
// write) holds its bytes, or is NULL to have `fill` called at write time. DI_ERR_INVALID for an
// unknown type, bad dims, ne[0] not a multiple of the block, a name too long or duplicated.
di_status di_gguf_writer_add_tensor(di_gguf_writer *w, const char *name, uint32_t type, int n_dims,
                                    const int64_t *ne, const void *data);
// Writes the file (alignment 32; the metadata includes whatever was added). `fill` (may be NULL
// when every tensor has data) produces tensors added without data. DI_ERR_IO, DI_ERR_NOMEM, or
// fill's error.
di_status di_gguf_writer_write_file(const di_gguf_writer *w, const char *path, di_gguf_fill_fn fill,
                                    void *user);
// Appends the same image to out. DI_ERR_NOMEM or fill's error.
di_status di_gguf_writer_write_buf(const di_gguf_writer *w, di_buf *out, di_gguf_fill_fn fill,
                                   void *user);
