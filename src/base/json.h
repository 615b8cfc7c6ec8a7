/*
 * json — thin helpers over Debian's jansson (json_t). Callers use jansson's API directly for
 * traversal; these helpers cover loading with a clear error and typed field reads.
 * Thread-safety: jansson values are not shared across threads.
 */
#pragma once

#include <jansson.h>
#include <stdbool.h>
#include <stdint.h>

#include "deepinfer.h" // di_status

// Loads a JSON file; on failure logs "path:line:col: message" and returns DI_ERR_FORMAT (or
// DI_ERR_IO when the file cannot be read). *out is a new reference (json_decref).
di_status di_json_load_file(const char *path, json_t **out);
// Integer field (JSON integer, or a real with an integral value). false if absent or wrong type.
bool di_json_get_int(const json_t *obj, const char *key, int64_t *out);
// Number field (integer or real). false if absent or wrong type.
bool di_json_get_num(const json_t *obj, const char *key, double *out);
bool di_json_get_bool(const json_t *obj, const char *key, bool *out);
// String field; the pointer is borrowed from obj. NULL if absent or not a string.
const char *di_json_get_str(const json_t *obj, const char *key);
