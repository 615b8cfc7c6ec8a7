#include "base/log.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

di_log_level di_log_level_current = DI_LOG_LEVEL_INFO;
static di_log_sink g_sink;
static void *g_sink_user;

void di_log_set_level(di_log_level level) {
    di_log_level_current = level;
}

void di_log_set_sink(di_log_sink sink, void *user) {
    g_sink = sink;
    g_sink_user = user;
}

bool di_log_level_parse(const char *s, di_log_level *out) {
    static const char *names[] = {"error", "warn", "info", "debug"};
    for (int i = 0; i < 4; i++) {
        if (strcmp(s, names[i]) == 0) {
            *out = (di_log_level)i;
            return true;
        }
    }
    return false;
}

void di_log_write(di_log_level level, const char *file, int line, const char *fmt, ...) {
    static const char *tags[] = {"error", "warn", "info", "debug"};
    char msg[2048];
    int n = 0;
    if (level == DI_LOG_LEVEL_DEBUG) {
        const char *base = strrchr(file, '/');
        n = snprintf(msg, sizeof msg, "%s:%d: ", base ? base + 1 : file, line);
    }
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg + n, sizeof msg - (size_t)n, fmt, ap);
    va_end(ap);
    if (g_sink) {
        g_sink(level, msg, g_sink_user);
        return;
    }
    // One fprintf per line so that lines from different threads do not interleave.
    fprintf(stderr, "deepinfer %s: %s\n", tags[level], msg);
}

_Noreturn void di_assert_fail(const char *file, int line, const char *cond) {
    fprintf(stderr, "deepinfer: assertion failed at %s:%d: %s\n", file, line, cond);
    abort();
}
