/*
 * status — the di_status codes (declared in include/deepinfer.h) and their names.
 * Thread-safety: any thread.
 */
#pragma once

#include "deepinfer.h" // di_status

// Propagates a failing status to the caller's `fail` label.
#define DI_TRY(expr)                                                                               \
    do {                                                                                           \
        st = (expr);                                                                               \
        if (st != DI_OK) goto fail;                                                                \
    } while (0)
