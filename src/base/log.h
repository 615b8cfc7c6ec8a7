/*
 * log — leveled logger writing to one replaceable sink (stderr by default).
 *
 * Owns: the global level and sink (the only mutable globals besides allocator hooks); set them
 * before any other thread starts. Does not: buffer, rotate or format structured records.
 * Thread-safety: logging from any thread; di_log_set_* before start only.
 * Also defines DI_ASSERT, which is for invariants only (never user input): it is always compiled
 * in and aborts with file, line and message.
 */
#pragma once

#include <stdarg.h>
#include <stdbool.h>

typedef enum di_log_level {
    DI_LOG_LEVEL_ERROR = 0,
    DI_LOG_LEVEL_WARN = 1,
    DI_LOG_LEVEL_INFO = 2,
    DI_LOG_LEVEL_DEBUG = 3,
} di_log_level;

typedef void (*di_log_sink)(di_log_level level, const char *msg, void *user);

extern di_log_level di_log_level_current;

// Sets the most verbose level that is emitted. Before start only.
void di_log_set_level(di_log_level level);
// Replaces the sink (NULL restores stderr). Before start only.
void di_log_set_sink(di_log_sink sink, void *user);
// Parses "error|warn|info|debug"; returns false on anything else.
bool di_log_level_parse(const char *s, di_log_level *out);

void di_log_write(di_log_level level, const char *file, int line, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));

#define DI_LOG_AT(lvl, ...)                                                                        \
    do {                                                                                           \
        if ((lvl) <= di_log_level_current) di_log_write((lvl), __FILE__, __LINE__, __VA_ARGS__);   \
    } while (0)
#define DI_LOG_ERROR(...) DI_LOG_AT(DI_LOG_LEVEL_ERROR, __VA_ARGS__)
#define DI_LOG_WARN(...) DI_LOG_AT(DI_LOG_LEVEL_WARN, __VA_ARGS__)
#define DI_LOG_INFO(...) DI_LOG_AT(DI_LOG_LEVEL_INFO, __VA_ARGS__)
#define DI_LOG_DEBUG(...) DI_LOG_AT(DI_LOG_LEVEL_DEBUG, __VA_ARGS__)

_Noreturn void di_assert_fail(const char *file, int line, const char *cond);
#define DI_ASSERT(cond)                                                                            \
    do {                                                                                           \
        if (!(cond)) di_assert_fail(__FILE__, __LINE__, #cond);                                    \
    } while (0)
