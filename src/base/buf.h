/*
 * buf — growable byte buffer and string builder. The buffer owns its bytes; data is always
 * NUL-terminated after a successful append so it can be used as a C string.
 * Thread-safety: one buffer per thread.
 */
#pragma once

#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>

#include "deepinfer.h" // di_status

typedef struct di_buf {
    char *data; // owned; NULL until the first append
    size_t len;
    size_t cap;
} di_buf;

void di_buf_init(di_buf *b);
void di_buf_deinit(di_buf *b);
void di_buf_clear(di_buf *b);
di_status di_buf_reserve(di_buf *b, size_t extra);
di_status di_buf_append(di_buf *b, const void *data, size_t n);
di_status di_buf_append_str(di_buf *b, const char *s);
di_status di_buf_printf(di_buf *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
// Hands the bytes to the caller (free with di_free) and leaves b empty.
char *di_buf_take(di_buf *b);

// ---- checksummed images (session state save/restore) ----

// Appends the FNV-1a of b's bytes and hands them to the caller (*bytes, free with di_free). On
// failure b is freed and nothing is handed out.
di_status di_buf_seal(di_buf *b, void **bytes, size_t *n_bytes);

// Reads an image made by di_buf_seal field by field, bounds-checked.
typedef struct di_reader {
    const unsigned char *p;
    size_t left; // bytes before the checksum not read yet
} di_reader;

// False when the image is shorter than its checksum or the checksum does not match.
bool di_reader_open(di_reader *r, const void *bytes, size_t n_bytes);
// Copies the next n bytes to dst; false (copying nothing) when fewer than n are left.
bool di_reader_get(di_reader *r, void *dst, size_t n);
