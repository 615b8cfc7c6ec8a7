/*
 * args — small helpers shared by the subcommands: option matching, integer lists, .npy output.
 */
#pragma once

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "deepinfer.h"

// Parses "5,17,300" (commas or spaces) into a new array (*out, free with free()). false on a
// malformed list (the message is printed to stderr, naming `what`).
bool di_args_int_list(const char *s, const char *what, int32_t **out, int32_t *n);
// Parses a non-negative integer option value; false (with a message) when malformed.
bool di_args_int(const char *s, const char *what, long lo, long hi, long *out);
// Writes a float32 C-order .npy of shape [rows, cols]. false (with a message) on I/O failure.
bool di_args_write_npy(const char *path, const float *data, int64_t rows, int64_t cols);
// The model directory to use when --model is absent: the built-in random-weight tiny V4 model,
// written on first use to $DEEPINFER_HOME/tiny-v4 (default ~/.cache/deepinfer/tiny-v4). Says so
// on stderr. Returns NULL (with a message) if it cannot be created.
const char *di_args_default_model(void);
// Parses --device: "cpu", "cuda" (= cuda:0), "cuda:N" or a list "cuda:N,M,..." of up to 8
// ordinals (pipeline stages: di_device.more). false (with a message) when malformed or when this
// build cannot run it (a CUDA device without the CUDA backend).
bool di_args_device(const char *s, di_device *out);
// Options shared by every model command: --model, --threads, --precision, --device, --log-level,
// --ep-workers HOST:PORT[,HOST:PORT...] (expert workers, docs/expert-parallel.md),
// --cp-workers HOST:PORT[,HOST:PORT...] and --cp-min-tokens N (prefill workers,
// docs/context-parallel.md), --dev-reserve MiB (what each pipeline stage leaves free,
// di_model_options.dev_reserve_bytes; docs/cuda.md "The split").
typedef struct di_model_args {
    const char *model;
    di_model_options opt;
    bool precision_given; // --precision was on the command line
} di_model_args;
// Consumes argv[*i] (and its value) if it is a shared model option; returns 1 if consumed,
// 0 if not a model option, -1 on a malformed value.
int di_args_model_option(int argc, char **argv, int *i, di_model_args *ma);
// After the options: without --precision, --device cuda runs the official recipe (the numerics
// DeepSeek serves with, on the device's fast paths: FP8 KV rows, FP8 GEMMs and BF16 tensor cores;
// docs/cuda.md "Numerics") and the CPU the fp32 recipe (the reference's numerics); logged.
void di_args_model_finish(di_model_args *ma);
// Options shared by the HTTP fronts (serve, route): --host, --port, --api-key, --max-body-mib,
// --timeout (idle connection, seconds) and --drain-timeout (seconds).
typedef struct di_http_args {
    const char *host, *api_key; // borrowed (argv)
    int port, timeout_s, drain_s;
    size_t max_body_bytes;
} di_http_args;
// The defaults: 127.0.0.1:8000, no API key, 8 MiB bodies, 600 s idle timeout, 30 s drain.
di_http_args di_args_http_defaults(void);
// Consumes argv[*i] and its value if it is a shared HTTP option with a value; returns 1 if
// consumed, 0 if not (an HTTP option without a value included), -1 on a malformed value.
int di_args_http_option(int argc, char **argv, int *i, di_http_args *ha);
