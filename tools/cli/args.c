#include "cli/args.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "base/log.h"

bool di_args_int_list(const char *s, const char *what, int32_t **out, int32_t *n) {
    size_t cap = 16, cnt = 0;
    int32_t *v = malloc(cap * sizeof *v);
    if (!v) return false;
    const char *p = s;
    while (*p) {
        while (*p == ',' || *p == ' ' || *p == '\n' || *p == '\t') p++;
        if (!*p) break;
        char *end;
        errno = 0;
        long x = strtol(p, &end, 10);
        if (end == p || errno || x < INT32_MIN || x > INT32_MAX ||
            (*end && *end != ',' && *end != ' ' && *end != '\n' && *end != '\t')) {
            fprintf(stderr, "deepinfer: %s: '%s' is not a list of integers\n", what, s);
            free(v);
            return false;
        }
        if (cnt == cap) {
            cap *= 2;
            int32_t *nv = realloc(v, cap * sizeof *v);
            if (!nv) {
                free(v);
                return false;
            }
            v = nv;
        }
        v[cnt++] = (int32_t)x;
        p = end;
    }
    if (cnt == 0) {
        fprintf(stderr, "deepinfer: %s: empty list\n", what);
        free(v);
        return false;
    }
    *out = v;
    *n = (int32_t)cnt;
    return true;
}

bool di_args_int(const char *s, const char *what, long lo, long hi, long *out) {
    char *end;
    errno = 0;
    long x = strtol(s, &end, 10);
    if (end == s || *end || errno || x < lo || x > hi) {
        fprintf(stderr, "deepinfer: %s: '%s' is not an integer in [%ld, %ld]\n", what, s, lo, hi);
        return false;
    }
    *out = x;
    return true;
}

bool di_args_write_npy(const char *path, const float *data, int64_t rows, int64_t cols) {
    FILE *f = fopen(path, "wb");
    if (!f) {
        fprintf(stderr, "deepinfer: cannot write %s: %s\n", path, strerror(errno));
        return false;
    }
    char hdr[256];
    int n = snprintf(hdr, sizeof hdr,
                     "{'descr': '<f4', 'fortran_order': False, 'shape': (%lld, %lld), }",
                     (long long)rows, (long long)cols);
    // Magic (6) + version (2) + header length (2) + header, padded with spaces to a multiple of
    // 64 and ending in a newline.
    int total = 10 + n + 1;
    int pad = (64 - total % 64) % 64;
    unsigned char pre[10] = {0x93, 'N', 'U', 'M', 'P', 'Y', 1, 0, 0, 0};
    uint16_t hl = (uint16_t)(n + pad + 1);
    pre[8] = (unsigned char)(hl & 0xff);
    pre[9] = (unsigned char)(hl >> 8);
    bool ok = fwrite(pre, 1, 10, f) == 10 && fwrite(hdr, 1, (size_t)n, f) == (size_t)n;
    for (int i = 0; ok && i < pad; i++) ok = fputc(' ', f) != EOF;
    ok = ok && fputc('\n', f) != EOF;
    ok = ok && fwrite(data, sizeof(float), (size_t)(rows * cols), f) == (size_t)(rows * cols);
    ok = (fclose(f) == 0) && ok;
    if (!ok) fprintf(stderr, "deepinfer: writing %s failed\n", path);
    return ok;
}

// One ordinal of a device list: digits only, in [0, 1023]; *end after them.
static bool device_ordinal(const char *p, const char **end, int32_t *out) {
    long v = 0;
    const char *q = p;
    while (*q >= '0' && *q <= '9' && v <= 1023) v = v * 10 + (*q++ - '0');
    if (q == p || v > 1023) return false;
    *end = q;
    *out = (int32_t)v;
    return true;
}

bool di_args_device(const char *s, di_device *out) {
    di_device d = {.kind = DI_DEVICE_CPU, .index = 0};
    if (strcmp(s, "cpu") != 0) {
        bool ok = strncmp(s, "cuda", 4) == 0 && (s[4] == 0 || s[4] == ':');
        d.kind = DI_DEVICE_CUDA;
        if (ok && s[4] == ':') { // cuda:N or cuda:N,M,...: the first, then up to 7 more
            const char *p = s + 5;
            ok = device_ordinal(p, &p, &d.index);
            while (ok && *p == ',') {
                ok = d.n_more < DI_DEVICE_MAX_MORE && device_ordinal(p + 1, &p, &d.more[d.n_more]);
                d.n_more += ok;
            }
            ok = ok && *p == 0;
        }
        if (!ok) {
            fprintf(stderr,
                    "deepinfer: --device must be cpu, cuda, cuda:N or a list cuda:N,M,... of at "
                    "most %d ordinals (0 to 1023), not '%s'\n",
                    DI_DEVICE_MAX_MORE + 1, s);
            return false;
        }
    }
    // This build's limits (no CUDA backend) are a usage error: the library logs why.
    if (di_device_check(&d) != DI_OK) return false;
    *out = d;
    return true;
}

int di_args_model_option(int argc, char **argv, int *i, di_model_args *ma) {
    const char *a = argv[*i];
    bool has_val = *i + 1 < argc;
    if (strcmp(a, "--model") == 0 || strcmp(a, "--threads") == 0 || strcmp(a, "--precision") == 0 ||
        strcmp(a, "--device") == 0 || strcmp(a, "--log-level") == 0 ||
        strcmp(a, "--ep-workers") == 0 || strcmp(a, "--ep-placement") == 0 ||
        strcmp(a, "--cp-workers") == 0 || strcmp(a, "--cp-min-tokens") == 0 ||
        strcmp(a, "--dev-reserve") == 0) {
        if (!has_val) {
            fprintf(stderr, "deepinfer: %s needs a value\n", a);
            return -1;
        }
        const char *v = argv[++*i];
        if (strcmp(a, "--model") == 0) {
            ma->model = v;
        } else if (strcmp(a, "--ep-workers") == 0) {
            ma->opt.ep_workers = v; // checked (HOST:PORT each) when the model attaches them
        } else if (strcmp(a, "--cp-workers") == 0) {
            ma->opt.cp_workers = v; // checked (HOST:PORT each) when the model attaches them
        } else if (strcmp(a, "--cp-min-tokens") == 0) {
            long n;
            if (!di_args_int(v, "--cp-min-tokens", 1, 1 << 30, &n)) return -1;
            ma->opt.cp_min_tokens = (int32_t)n;
        } else if (strcmp(a, "--dev-reserve") == 0) { // MiB each pipeline stage leaves free
            long n;
            if (!di_args_int(v, "--dev-reserve (MiB)", 1, 1 << 24, &n)) return -1;
            ma->opt.dev_reserve_bytes = (size_t)n << 20;
        } else if (strcmp(a, "--ep-placement") == 0) {
            ma->opt.ep_placement = v; // read and checked against the model at load
        } else if (strcmp(a, "--threads") == 0) {
            long n;
            if (!di_args_int(v, "--threads", 0, 1024, &n)) return -1;
            ma->opt.n_threads = (int)n;
        } else if (strcmp(a, "--device") == 0) {
            if (!di_args_device(v, &ma->opt.device)) return -1;
        } else if (strcmp(a, "--precision") == 0) {
            ma->precision_given = true;
            if (strcmp(v, "fp32") == 0)
                ma->opt.precision = DI_PRECISION_FP32;
            else if (strcmp(v, "official") == 0)
                ma->opt.precision = DI_PRECISION_OFFICIAL;
            else {
                fprintf(stderr, "deepinfer: --precision must be fp32 or official\n");
                return -1;
            }
        } else {
            static const char *lv[] = {"error", "warn", "info", "debug"};
            int k = 0;
            while (k < 4 && strcmp(v, lv[k]) != 0) k++;
            if (k == 4) {
                fprintf(stderr, "deepinfer: --log-level must be error, warn, info or debug\n");
                return -1;
            }
            di_set_log_level(k);
        }
        return 1;
    }
    return 0;
}

void di_args_model_finish(di_model_args *ma) {
    if (ma->precision_given || ma->opt.device.kind != DI_DEVICE_CUDA) return;
    ma->opt.precision = DI_PRECISION_OFFICIAL;
    DI_LOG_INFO("--device cuda: the official precision recipe (FP8 KV, FP8 GEMMs, BF16 tensor "
                "cores); --precision fp32 runs the reference numerics");
}

di_http_args di_args_http_defaults(void) {
    return (di_http_args){.host = "127.0.0.1",
                          .port = 8000,
                          .max_body_bytes = 8u << 20,
                          .timeout_s = 600,
                          .drain_s = 30};
}

int di_args_http_option(int argc, char **argv, int *i, di_http_args *ha) {
    const char *a = argv[*i];
    if (*i + 1 >= argc) return 0;
    const char *s = argv[*i + 1];
    long v;
    if (!strcmp(a, "--host")) {
        ha->host = s;
    } else if (!strcmp(a, "--api-key")) {
        ha->api_key = s;
    } else if (!strcmp(a, "--port")) {
        if (!di_args_int(s, "--port", 0, 65535, &v)) return -1;
        ha->port = (int)v;
    } else if (!strcmp(a, "--max-body-mib")) {
        if (!di_args_int(s, "--max-body-mib", 1, 1024, &v)) return -1;
        ha->max_body_bytes = (size_t)v << 20;
    } else if (!strcmp(a, "--timeout")) {
        if (!di_args_int(s, "--timeout", 1, 86400, &v)) return -1;
        ha->timeout_s = (int)v;
    } else if (!strcmp(a, "--drain-timeout")) {
        if (!di_args_int(s, "--drain-timeout", 0, 3600, &v)) return -1;
        ha->drain_s = (int)v;
    } else {
        return 0;
    }
    ++*i;
    return 1;
}

static bool mkdir_p(const char *path) {
    char tmp[4096];
    snprintf(tmp, sizeof tmp, "%s", path);
    for (char *p = tmp + 1; *p; p++) {
        if (*p != '/') continue;
        *p = 0;
        if (mkdir(tmp, 0755) != 0 && errno != EEXIST) return false;
        *p = '/';
    }
    return mkdir(tmp, 0755) == 0 || errno == EEXIST;
}

const char *di_args_default_model(void) {
    static char dir[4096];
    const char *home = getenv("DEEPINFER_HOME");
    if (home && *home)
        snprintf(dir, sizeof dir, "%s/tiny-v4", home);
    else
        snprintf(dir, sizeof dir, "%s/.cache/deepinfer/tiny-v4",
                 getenv("HOME") ? getenv("HOME") : "/tmp");
    char cfg[4200];
    snprintf(cfg, sizeof cfg, "%s/config.json", dir);
    if (access(cfg, R_OK) != 0) {
        fprintf(stderr,
                "deepinfer: no --model given: writing the built-in tiny random-weight V4 "
                "model to %s (once)\n",
                dir);
        if (!mkdir_p(dir)) {
            fprintf(stderr, "deepinfer: cannot create %s: %s\n", dir, strerror(errno));
            return NULL;
        }
        if (di_synth_checkpoint("tiny", dir, true, 1234) != DI_OK) return NULL;
    }
    fprintf(stderr,
            "deepinfer: using the built-in tiny V4 model with random weights (%s): its "
            "output is meaningless; pass --model DIR for a real checkpoint\n",
            dir);
    return dir;
}
