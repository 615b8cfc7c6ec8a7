/*
 * safetensors — reader for checkpoints as published: one file, or a directory of shards listed by
 * model.safetensors.index.json.
 *
 * A file is an 8-byte little-endian header length N, N bytes of JSON header
 * {"name": {"dtype": "...", "shape": [...], "data_offsets": [begin, end]}, "__metadata__": {...}},
 * then the data region. The parser checks everything before any tensor is used: header length
 * within the file, valid UTF-8 JSON object, known dtypes, non-negative shapes whose byte size
 * (no overflow) equals end - begin, offsets inside the data region, no two tensors overlapping,
 * and duplicate names rejected. A violation is DI_ERR_FORMAT with a message naming the file and the
 * tensor; nothing outside the mapped file is ever read.
 *
 * Owns: the mappings and the tensor directory. Tensor data pointers are views into the mapping,
 * valid until the set is closed.
 * Thread-safety: immutable after open; lookups from any thread.
 */
#pragma once

#include <stddef.h>
#include <stdint.h>

#include "base/buf.h"     // di_buf (in-memory writer)
#include "deepinfer.h"    // di_status
#include "tensor/dtype.h" // di_dtype

#define DI_ST_MAX_DIMS 8
// Largest header accepted, in bytes. The biggest published DeepSeek headers are a few MiB; anything
// far beyond this is a corrupt length field, and rejecting it early bounds the JSON parser's
// memory.
#define DI_ST_HEADER_BYTES_MAX ((uint64_t)100 << 20)

typedef struct di_st_tensor {
    const char *name; // owned by the file/set
    di_dtype dtype;
    int n_dims;
    int64_t shape[DI_ST_MAX_DIMS];
    int64_t n_elements;
    const void *data; // view into the mapping
    size_t n_bytes;
    int shard; // index of the file that holds it (0 for a single file)
} di_st_tensor;

typedef struct di_st_file di_st_file;

// Parses a whole safetensors image held in memory (the fuzz target's entry point). `what` names it
// in errors (NULL: "(memory)"). The tensor data pointers point into `bytes`, which must outlive the
// result; tensor data is not aligned beyond what the file's offsets give. Tensors keep the header's
// order. Zero-element tensors are allowed (n_bytes 0, data points at or one past the region end);
// gaps between tensors and trailing bytes after the last one are allowed.
// Returns DI_ERR_FORMAT (logged with `what` and the tensor name), DI_ERR_NOMEM.
di_status di_st_file_parse(const uint8_t *bytes, size_t n_bytes, const char *what,
                           di_st_file **out);
// Maps and parses one file; the result owns the mapping. DI_ERR_IO, DI_ERR_FORMAT, DI_ERR_NOMEM.
di_status di_st_file_open(const char *path, di_st_file **out);
// Unmaps and frees. NULL does nothing.
void di_st_file_close(di_st_file *f);
int64_t di_st_file_n_tensors(const di_st_file *f);
// Tensor i (0 <= i < n_tensors; asserted). Borrowed from f.
const di_st_tensor *di_st_file_tensor(const di_st_file *f, int64_t i);
// Hash lookup, O(1). NULL if absent. Borrowed from f.
const di_st_tensor *di_st_file_find(const di_st_file *f, const char *name);
// The "__metadata__" string value for key, or NULL. Borrowed from f.
const char *di_st_file_metadata(const di_st_file *f, const char *key);

// ---- a checkpoint: one or more files ----

typedef struct di_st_set di_st_set;

// Opens the checkpoint in dir: model.safetensors.index.json (weight_map: name -> shard file; every
// listed shard must exist and hold exactly the names mapped to it), else every *.safetensors file
// in the directory. Tensor names must be unique across shards.
// Shard file names in the index must be plain names (no '/', '\\' or ".."). Shards are numbered in
// file-name order (di_st_tensor.shard); tensors are listed shard by shard, each in header order.
// Without an index, hidden files (leading '.') are skipped.
// Returns DI_ERR_IO (no index and no *.safetensors file, or a file that cannot be opened),
// DI_ERR_FORMAT (a malformed file or index, an index/shard mismatch, a duplicate name),
// DI_ERR_NOMEM.
di_status di_st_set_open_dir(const char *dir, di_st_set **out);
// A set over tensors held elsewhere (the GGUF loader presents a GGUF file this way): copies the
// array and the names; data pointers stay views into memory the caller keeps alive (and
// unmaps) — the set owns no mapping. Duplicate names are DI_ERR_FORMAT; DI_ERR_NOMEM.
di_status di_st_set_create_view(const di_st_tensor *tensors, int64_t n_tensors, di_st_set **out);
// Closes every shard. NULL does nothing.
void di_st_set_close(di_st_set *s);
int64_t di_st_set_n_tensors(const di_st_set *s);
// Tensor i (0 <= i < n_tensors; asserted). Borrowed from s.
const di_st_tensor *di_st_set_tensor(const di_st_set *s, int64_t i);
// Hash lookup, O(1). NULL if absent.
const di_st_tensor *di_st_set_find(const di_st_set *s, const char *name);
// Total bytes of tensor data in all shards.
size_t di_st_set_data_bytes(const di_st_set *s);

// ---- writing (tools and tests) ----

typedef struct di_st_write_tensor {
    const char *name;
    di_dtype dtype;
    int n_dims;
    int64_t shape[DI_ST_MAX_DIMS];
    const void *data; // n_elements * di_dtype_size(dtype) bytes
} di_st_write_tensor;

// Writes a safetensors file (header padded to 8 bytes, tensors in the given order).
// DI_ERR_IO on write failure, DI_ERR_INVALID for a bad description (empty, duplicate or
// "__metadata__" name, unknown dtype, n_dims outside [0, DI_ST_MAX_DIMS], negative or overflowing
// shape, NULL data for a non-empty tensor), DI_ERR_NOMEM.
di_status di_st_write_file(const char *path, const di_st_write_tensor *tensors, int64_t n_tensors);
// Same, with "__metadata__" written first: meta_kv holds n_meta (key, value) pairs as
// meta_kv[2*i], meta_kv[2*i+1].
di_status di_st_write_file_meta(const char *path, const di_st_write_tensor *tensors,
                                int64_t n_tensors, const char *const *meta_kv, int64_t n_meta);
// Appends the same image to out instead of writing a file (tests and the fuzz corpus).
// DI_ERR_INVALID as above, DI_ERR_NOMEM.
di_status di_st_write_buf(di_buf *out, const di_st_write_tensor *tensors, int64_t n_tensors,
                          const char *const *meta_kv, int64_t n_meta);
