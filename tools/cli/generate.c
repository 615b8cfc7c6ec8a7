// deepinfer generate: greedy or temperature sampling from a prompt, one session, through the
// engine's sampler (sample/sampler.h: the same tokens a seeded server request gets).
#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "cli/args.h"
#include "cli/cli.h"
#include "sample/sampler.h"

static void usage(FILE *f) {
    fprintf(f,
            "usage: deepinfer generate [--model DIR] (--prompt TEXT | --tokens 5,17,...)\n"
            "                          [-n 64] [--temperature 0] [--seed 0] [--threads N]\n"
            "                          [--precision fp32|official] [--device cpu|cuda[:N,...]]\n"
            "                          [--no-stop] [--dspark] [--ep-workers HOST:PORT,...]\n"
            "                          [--ep-placement FILE] [--cp-workers HOST:PORT,...]\n"
            "                          [--cp-min-tokens N] [--device-loss-max 3]\n"
            "                          [--device-loss-window 600]\n"
            "--device-loss-max N, --device-loss-window S (the device-resident forward of\n"
            "--device cuda): a lost device (a sticky CUDA error) is reset, the model's device\n"
            "state rebuilt and the session's tokens replayed, so the output is unchanged (a\n"
            "warning on stderr says so); at most N losses within S seconds (defaults 3, 600).\n"
            "--cp-workers (V4 and V4.1, CPU): prefill calls of at least --cp-min-tokens tokens\n"
            "(default 1024) are split over these prefill workers (deepinfer cp-worker) and this\n"
            "process; the output is identical to one process.\n"
            "--dspark (DeepSeek V4.1, greedy only): speculative decoding with the DSpark draft\n"
            "module; every draft block is verified in one forward and rejected tokens are\n"
            "rolled back, so the output equals plain greedy decoding (acceptance on stderr).\n"
            "--prompt renders TEXT as one user turn of a chat (DeepSeek V4 format, the\n"
            "model's tokenizer) and prints the generated text as it is produced; --tokens\n"
            "takes prompt token ids and prints the generated ids, comma-separated. Temperature\n"
            "0 is greedy (ties to the lowest id); generation stops at the model's EOS token\n"
            "unless --no-stop is given. Without --model, the built-in random-weight tiny model\n"
            "is used (its text is meaningless).\n");
}

// Prints one generated token (text through detok, else the id). Returns false at the end
// (n_gen reached or EOS).
static bool emit(int32_t t, long *n_out, long n_gen, bool stop_at_eos, int32_t eos,
                 di_detok *detok) {
    if (stop_at_eos && t == eos && detok) return false;
    if (detok) {
        const char *text;
        size_t n_text;
        if (di_detok_push(detok, t, &text, &n_text) == DI_OK) fwrite(text, 1, n_text, stdout);
    } else {
        printf("%s%d", *n_out ? "," : "", t);
    }
    fflush(stdout);
    ++*n_out;
    return !(stop_at_eos && t == eos) && *n_out < n_gen;
}

// One warning line per device-loss recovery the session made since the last call (the library
// logs the details; this says what it means for the output).
static void warn_recoveries(const di_session *s, int64_t *n_seen) {
    di_session_stats st;
    di_session_get_stats(s, &st);
    if (st.n_device_recoveries == *n_seen) return;
    *n_seen = st.n_device_recoveries;
    fprintf(stderr,
            "\ndeepinfer generate: warning: the device was lost; recovered (recovery %lld: device "
            "state rebuilt, %lld tokens replayed in all): the output continues unchanged\n",
            (long long)st.n_device_recoveries, (long long)st.n_replayed_tokens);
}

static int32_t argmax(const float *v, int32_t n) {
    int32_t b = 0;
    for (int32_t i = 1; i < n; i++)
        if (v[i] > v[b]) b = i;
    return b;
}

// Greedy speculative decoding with DSpark (spec deepseek-v41.md §3.4): draft a block from the
// anchor, verify anchor + drafts in one forward, accept the drafts that equal the target's
// argmax, roll back the rest; the bonus token is the next anchor. logits holds >= 17 rows.
static bool dspark_loop(di_session *s, const di_model_info *info, float *logits, long n_gen,
                        bool stop_at_eos, di_detok *detok) {
    const int32_t V = info->n_vocab, eos = info->eos_token_id;
    int32_t anchor = argmax(logits, V);
    long n_out = 0, n_drafted = 0, n_accepted = 0, n_verify = 0;
    di_status st;
    while (emit(anchor, &n_out, n_gen, stop_at_eos, eos, detok)) {
        di_draft d;
        if ((st = di_session_draft(s, anchor, &d, NULL)) != DI_OK) {
            fprintf(stderr, "\ndeepinfer generate: --dspark: %s\n", di_status_str(st));
            return false;
        }
        int32_t ver[17];
        ver[0] = anchor;
        memcpy(ver + 1, d.tokens, sizeof(int32_t) * (size_t)d.n);
        di_forward_out fo = {.logits = logits};
        if ((st = di_session_forward(s, ver, d.n + 1, &fo)) != DI_OK) {
            fprintf(stderr, "\ndeepinfer generate: %s\n", di_status_str(st));
            return false;
        }
        int32_t acc = 0;
        while (acc < d.n && d.tokens[acc] == argmax(logits + (size_t)acc * V, V)) acc++;
        n_drafted += d.n, n_accepted += acc, n_verify++;
        if ((st = di_session_rollback(s, d.n - acc)) != DI_OK) return false;
        bool more = true;
        for (int32_t j = 0; j < acc && more; j++)
            more = emit(d.tokens[j], &n_out, n_gen, stop_at_eos, eos, detok);
        if (!more) break;
        anchor = argmax(logits + (size_t)acc * V, V);
    }
    if (detok) {
        const char *text;
        size_t n_text;
        di_detok_flush(detok, &text, &n_text);
        fwrite(text, 1, n_text, stdout);
    }
    printf("\n");
    fflush(stdout);
    fprintf(stderr, "dspark: %ld verify steps, %ld of %ld drafts accepted\n", n_verify, n_accepted,
            n_drafted);
    return true;
}

// Renders text as one user turn (non-thinking) with the model's tokenizer in the checkpoint's
// chat format (DeepSeek V4.1's for a V4.1 checkpoint, else V4's: di_model_read_config); *ids is
// malloc'd. Sets up a streaming detokenizer for the output.
static bool render_prompt(const char *model_dir, const char *text, di_tokenizer **tok,
                          di_detok **detok, int32_t **ids, int32_t *n_ids) {
    di_model_config mc;
    if (di_model_read_config(model_dir, &mc) != DI_OK) {
        fprintf(stderr, "deepinfer generate: cannot read the configuration of %s\n", model_dir);
        return false;
    }
    if (di_tokenizer_load_for_model(model_dir, tok) != DI_OK) {
        fprintf(stderr, "deepinfer generate: no tokenizer for %s\n", model_dir);
        return false;
    }
    json_t *req = json_pack("{s:[{s:s,s:s}]}", "messages", "role", "user", "content", text);
    char *body = req ? json_dumps(req, JSON_COMPACT) : NULL;
    json_decref(req);
    if (!body) {
        fprintf(stderr, "deepinfer generate: --prompt must be UTF-8 text\n");
        return false;
    }
    di_render_options ro = di_render_options_default();
    ro.encoding = mc.v41 ? 1 : 0;
    char *rendered = NULL;
    size_t n_text = 0, n = 0;
    int32_t *rids = NULL;
    di_status st = di_render_request(*tok, body, strlen(body), DI_RENDER_API_CHAT, &ro, &rendered,
                                     &n_text, &rids, &n);
    free(body);
    if (st == DI_ERR_UNSUPPORTED) { // the model's tokenizer, as serve says (docs/server.md)
        fprintf(stderr,
                "deepinfer generate: the tokenizer lacks a special token of the DeepSeek %s "
                "prompt format: the model directory needs its own tokenizer.json\n",
                mc.v41 ? "V4.1" : "V4");
        return false;
    }
    if (st != DI_OK) {
        fprintf(stderr, "deepinfer generate: cannot render the prompt: %s\n", di_status_str(st));
        return false;
    }
    *ids = malloc(sizeof(int32_t) * (n ? n : 1));
    if (*ids) memcpy(*ids, rids, sizeof(int32_t) * n);
    *n_ids = (int32_t)n;
    di_tok_free(rendered);
    di_tok_free(rids);
    return *ids && di_detok_create(*tok, true, detok) == DI_OK;
}

int di_cli_generate(int argc, char **argv) {
    di_model_args ma = {.opt = di_model_options_default()};
    const char *tokens_s = NULL, *prompt_s = NULL;
    long n_gen = 64, seed = 0, loss_max = 0, loss_window = 0;
    double temperature = 0;
    bool stop_at_eos = true, dspark = false, timing = false;
    for (int i = 1; i < argc; i++) {
        int r = di_args_model_option(argc, argv, &i, &ma);
        if (r < 0) return 2;
        if (r > 0) continue;
        const char *a = argv[i];
        if (strcmp(a, "--help") == 0) {
            usage(stdout);
            return 0;
        }
        if (strcmp(a, "--dspark") == 0) {
            dspark = true;
            continue;
        }
        if (strcmp(a, "--timing") == 0) {
            timing = true;
            continue;
        }
        if (strcmp(a, "--no-stop") == 0) {
            stop_at_eos = false;
            continue;
        }
        if (i + 1 >= argc) {
            fprintf(stderr, "deepinfer generate: unknown option or missing value '%s'\n", a);
            return 2;
        }
        const char *v = argv[++i];
        if (strcmp(a, "--tokens") == 0)
            tokens_s = v;
        else if (strcmp(a, "--prompt") == 0)
            prompt_s = v;
        else if (strcmp(a, "-n") == 0) {
            if (!di_args_int(v, "-n", 0, 1 << 24, &n_gen)) return 2;
        } else if (strcmp(a, "--device-loss-max") == 0) {
            if (!di_args_int(v, "--device-loss-max", 1, 1000000, &loss_max)) return 2;
        } else if (strcmp(a, "--device-loss-window") == 0) {
            if (!di_args_int(v, "--device-loss-window", 1, 0x7fffffffL, &loss_window)) return 2;
        } else if (strcmp(a, "--seed") == 0) {
            if (!di_args_int(v, "--seed", 0, 0x7fffffffL, &seed)) return 2;
        } else if (strcmp(a, "--temperature") == 0) {
            char *end;
            temperature = strtod(v, &end);
            if (*end || temperature < 0 || !isfinite(temperature)) {
                fprintf(stderr, "deepinfer generate: --temperature must be a number >= 0\n");
                return 2;
            }
        } else {
            fprintf(stderr, "deepinfer generate: unknown option '%s'\n", a);
            usage(stderr);
            return 2;
        }
    }
    if (dspark && temperature != 0) {
        fprintf(stderr, "deepinfer generate: --dspark decodes greedily (--temperature 0)\n");
        return 2;
    }
    if (!tokens_s == !prompt_s) {
        fprintf(stderr, "deepinfer generate: give exactly one of --prompt and --tokens\n");
        usage(stderr);
        return 2;
    }
    if (!ma.model && !(ma.model = di_args_default_model())) return 1;
    int32_t *prompt = NULL, n_prompt = 0;
    di_tokenizer *tok = NULL;
    di_detok *detok = NULL;
    int rc = 1;
    di_model *m = NULL;
    di_session *s = NULL;
    float *logits = NULL;
    int32_t *history = NULL;
    di_sampler *sampler = NULL;
    di_status st;
    if (tokens_s) {
        if (!di_args_int_list(tokens_s, "--tokens", &prompt, &n_prompt)) return 2;
    } else if (!render_prompt(ma.model, prompt_s, &tok, &detok, &prompt, &n_prompt)) {
        goto done;
    }
    di_args_model_finish(&ma);
    st = di_model_load(ma.model, &ma.opt, &m);
    if (st != DI_OK) {
        fprintf(stderr, "deepinfer generate: cannot load %s: %s\n", ma.model, di_status_str(st));
        goto done;
    }
    di_model_info info;
    di_model_get_info(m, &info);
    if (tok && di_tokenizer_n_vocab(tok) > info.n_vocab) {
        fprintf(stderr,
                "deepinfer generate: the tokenizer has %d tokens but the model only %d; "
                "use --tokens with this model\n",
                di_tokenizer_n_vocab(tok), info.n_vocab);
        goto done;
    }
    di_session_options so = di_session_options_default();
    so.mtp = dspark;
    so.device_loss_max = (int32_t)loss_max;
    so.device_loss_window_s = (int32_t)loss_window;
    // On a GPU the session's state is sized for its whole context at create (the device-resident
    // forward): the prompt, the output and a verified draft block, not the model's maximum.
    if (ma.opt.device.kind == DI_DEVICE_CUDA && (int64_t)n_prompt + n_gen + 17 < INT32_MAX)
        so.n_ctx_max = (int32_t)(n_prompt + n_gen + 17);
    if ((st = di_session_create(m, &so, &s)) != DI_OK) {
        fprintf(stderr, "deepinfer generate: %s\n", di_status_str(st));
        goto done;
    }
    logits = malloc(sizeof(float) * (size_t)info.n_vocab * (dspark ? 17 : 1));
    history = malloc(sizeof(int32_t) * (size_t)(n_prompt + n_gen));
    if (!logits || !history) goto done;
    memcpy(history, prompt, sizeof(int32_t) * (size_t)n_prompt);
    if ((st = di_sampler_create(info.n_vocab, &sampler)) != DI_OK) goto done;
    di_sample_params sp = di_sample_params_default();
    sp.temperature = (float)temperature;
    sp.seed = (uint64_t)seed;
    di_forward_out fo = {.logits = logits, .last_only = true};
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    int64_t n_recovered = 0;
    st = di_session_forward(s, prompt, n_prompt, &fo);
    warn_recoveries(s, &n_recovered);
    if (st != DI_OK) {
        fprintf(stderr, "deepinfer generate: %s\n", di_status_str(st));
        goto done;
    }
    if (timing) {
        clock_gettime(CLOCK_MONOTONIC, &t1);
        const double dt = (double)(t1.tv_sec - t0.tv_sec) + (t1.tv_nsec - t0.tv_nsec) / 1e9;
        di_cp_stats cs;
        fprintf(stderr, "prefill: %d tokens in %.3f s (%.1f tokens/s)", n_prompt, dt,
                n_prompt / dt);
        if (di_model_cp_stats(m, &cs))
            fprintf(stderr, ", context parallel: %lld calls, %lld bytes exchanged (%.0f per token)",
                    (long long)cs.calls, (long long)(cs.bytes_sent + cs.bytes_recv),
                    (double)(cs.bytes_sent + cs.bytes_recv) / n_prompt);
        fprintf(stderr, "\n");
    }
    const int32_t eos = info.eos_token_id;
    if (dspark) {
        rc = dspark_loop(s, &info, logits, n_gen, stop_at_eos, detok) ? 0 : 1;
        goto done;
    }
    for (long i = 0; i < n_gen; i++) {
        di_sample_result res;
        di_sampler_sample(sampler, logits, &sp, history, n_prompt, (int32_t)i, n_prompt + i, &res);
        const int32_t next = res.token;
        history[n_prompt + i] = next;
        if (stop_at_eos && next == eos && detok) break;
        if (detok) {
            const char *text;
            size_t n_text;
            if (di_detok_push(detok, next, &text, &n_text) == DI_OK)
                fwrite(text, 1, n_text, stdout);
        } else {
            printf("%s%d", i ? "," : "", next);
        }
        fflush(stdout);
        if ((stop_at_eos && next == eos) || i + 1 == n_gen) break;
        st = di_session_forward(s, &next, 1, &fo);
        warn_recoveries(s, &n_recovered);
        if (st != DI_OK) {
            fprintf(stderr, "\ndeepinfer generate: %s\n", di_status_str(st));
            goto done;
        }
    }
    if (detok) {
        const char *text;
        size_t n_text;
        di_detok_flush(detok, &text, &n_text);
        fwrite(text, 1, n_text, stdout);
    }
    printf("\n");
    rc = 0;
done:
    di_sampler_destroy(sampler);
    free(history);
    free(logits);
    free(prompt);
    di_detok_destroy(detok);
    di_tokenizer_destroy(tok);
    di_session_destroy(s);
    di_model_destroy(m);
    return rc;
}
