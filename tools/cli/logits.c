// deepinfer logits: runs the forward pass on token ids and writes float32 .npy logits.
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli/args.h"
#include "cli/cli.h"

static void usage(FILE *f) {
    fprintf(f,
            "usage: deepinfer logits --model DIR --tokens 5,17,300,... --out FILE.npy\n"
            "                        [--chunks 21,1,1,13,...] [--mtp-out FILE.npy]\n"
            "                        [--dspark FILE.json [--dspark-logits FILE.npy]]\n"
            "                        [--precision fp32|official] [--threads N]\n"
            "                        [--device cpu|cuda[:N,...]] [--ep-workers HOST:PORT,...]\n"
            "                        [--ep-placement FILE] [--cp-workers HOST:PORT,...]\n"
            "                        [--cp-min-tokens N]\n"
            "Writes the logits of every position as float32 [T, vocab]. --chunks feeds the\n"
            "tokens through the incremental state in those chunk sizes (default: one call).\n"
            "--mtp-out writes the MTP block's logits [T-1, vocab] (row t predicts t+2).\n"
            "--dspark (DeepSeek V4.1): after every chunk, drafts a DSpark block anchored on the\n"
            "argmax of the chunk's last logits and writes the drafts and confidences as JSON;\n"
            "--dspark-logits writes the Markov-corrected draft logits [chunks * block, vocab].\n");
}

int di_cli_logits(int argc, char **argv) {
    di_model_args ma = {.opt = di_model_options_default()};
    const char *tokens_s = NULL, *chunks_s = NULL, *out = NULL, *mtp_out = NULL;
    const char *dspark_out = NULL, *dspark_logits = NULL;
    for (int i = 1; i < argc; i++) {
        int r = di_args_model_option(argc, argv, &i, &ma);
        if (r < 0) return 2;
        if (r > 0) continue;
        const char *a = argv[i];
        if (strcmp(a, "--help") == 0) {
            usage(stdout);
            return 0;
        }
        const char **dst = strcmp(a, "--tokens") == 0          ? &tokens_s
                           : strcmp(a, "--chunks") == 0        ? &chunks_s
                           : strcmp(a, "--out") == 0           ? &out
                           : strcmp(a, "--mtp-out") == 0       ? &mtp_out
                           : strcmp(a, "--dspark") == 0        ? &dspark_out
                           : strcmp(a, "--dspark-logits") == 0 ? &dspark_logits
                                                               : NULL;
        if (!dst || i + 1 >= argc) {
            fprintf(stderr, "deepinfer logits: %s '%s'\n",
                    dst ? "missing value for" : "unknown option", a);
            usage(stderr);
            return 2;
        }
        *dst = argv[++i];
    }
    if (!tokens_s || !out || (dspark_logits && !dspark_out) || (dspark_out && mtp_out)) {
        usage(stderr);
        return 2;
    }
    if (!ma.model && !(ma.model = di_args_default_model())) return 1;
    int32_t *tokens = NULL, *chunks = NULL, n_tok = 0, n_chunks = 0;
    if (!di_args_int_list(tokens_s, "--tokens", &tokens, &n_tok)) return 2;
    if (chunks_s) {
        if (!di_args_int_list(chunks_s, "--chunks", &chunks, &n_chunks)) {
            free(tokens);
            return 2;
        }
        int64_t sum = 0;
        for (int32_t c = 0; c < n_chunks; c++) {
            if (chunks[c] < 1) {
                fprintf(stderr, "deepinfer logits: chunk sizes must be >= 1\n");
                free(tokens);
                free(chunks);
                return 2;
            }
            sum += chunks[c];
        }
        if (sum != n_tok) {
            fprintf(stderr, "deepinfer logits: --chunks add up to %lld, but there are %d tokens\n",
                    (long long)sum, n_tok);
            free(tokens);
            free(chunks);
            return 2;
        }
    } else {
        chunks = malloc(sizeof *chunks);
        chunks[0] = n_tok;
        n_chunks = 1;
    }

    int rc = 1;
    di_model *m = NULL;
    di_session *s = NULL;
    float *logits = NULL, *mtp = NULL, *dl = NULL;
    FILE *dj = NULL;
    di_args_model_finish(&ma);
    di_status st = di_model_load(ma.model, &ma.opt, &m);
    if (st != DI_OK) {
        fprintf(stderr, "deepinfer logits: cannot load %s: %s\n", ma.model, di_status_str(st));
        goto done;
    }
    di_model_info info;
    di_model_get_info(m, &info);
    di_session_options so = di_session_options_default();
    so.mtp = mtp_out != NULL || dspark_out != NULL;
    // On a GPU the session's state is sized for its whole context at create (the device-resident
    // forward): these tokens, not the model's maximum.
    if (ma.opt.device.kind == DI_DEVICE_CUDA) so.n_ctx_max = n_tok;
    if ((st = di_session_create(m, &so, &s)) != DI_OK) {
        fprintf(stderr, "deepinfer logits: %s\n", di_status_str(st));
        goto done;
    }
    size_t row = (size_t)info.n_vocab;
    logits = malloc(sizeof(float) * row * (size_t)n_tok);
    if (mtp_out) mtp = malloc(sizeof(float) * row * (size_t)n_tok);
    if (!logits || (mtp_out && !mtp)) {
        fprintf(stderr, "deepinfer logits: out of memory\n");
        goto done;
    }
    if (dspark_out && !(dj = fopen(dspark_out, "w"))) {
        fprintf(stderr, "deepinfer logits: cannot write %s\n", dspark_out);
        goto done;
    }
    if (dspark_logits && !(dl = malloc(sizeof(float) * row * 16 * (size_t)n_chunks))) {
        fprintf(stderr, "deepinfer logits: out of memory\n");
        goto done;
    }
    if (dj) fprintf(dj, "{\"drafts\": [");
    int32_t done_tok = 0, n_mtp_total = 0, n_dl = 0;
    for (int32_t c = 0; c < n_chunks; c++) {
        int32_t n_mtp = 0;
        di_forward_out fo = {.logits = logits + row * (size_t)done_tok,
                             .mtp_logits = mtp ? mtp + row * (size_t)n_mtp_total : NULL,
                             .n_mtp_out = &n_mtp};
        if ((st = di_session_forward(s, tokens + done_tok, chunks[c], &fo)) != DI_OK) {
            fprintf(stderr, "deepinfer logits: forward failed: %s\n", di_status_str(st));
            goto done;
        }
        done_tok += chunks[c];
        n_mtp_total += n_mtp;
        if (dj) { // draft anchored on the greedy token for the next position
            const float *last = logits + row * (size_t)(done_tok - 1);
            int32_t anchor = 0;
            for (int32_t v = 1; v < info.n_vocab; v++)
                if (last[v] > last[anchor]) anchor = v;
            di_draft d;
            if ((st = di_session_draft(s, anchor, &d, dl ? dl + row * (size_t)n_dl : NULL)) !=
                DI_OK) {
                fprintf(stderr, "deepinfer logits: --dspark: %s\n", di_status_str(st));
                goto done;
            }
            n_dl += d.n;
            fprintf(dj, "%s\n  {\"position\": %d, \"anchor\": %d, \"tokens\": [", c ? "," : "",
                    done_tok, anchor);
            for (int j = 0; j < d.n; j++) fprintf(dj, "%s%d", j ? ", " : "", d.tokens[j]);
            fprintf(dj, "], \"confidence\": [");
            for (int j = 0; j < d.n; j++) fprintf(dj, "%s%.9g", j ? ", " : "", d.confidence[j]);
            fprintf(dj, "], \"confidence_logit\": [");
            for (int j = 0; j < d.n; j++) fprintf(dj, "%s%.9g", j ? ", " : "", d.conf_logit[j]);
            fprintf(dj, "]}");
        }
    }
    if (dj) {
        fprintf(dj, "\n]}\n");
        bool ok = fclose(dj) == 0;
        dj = NULL;
        if (!ok) {
            fprintf(stderr, "deepinfer logits: cannot write %s\n", dspark_out);
            goto done;
        }
    }
    if (dl && !di_args_write_npy(dspark_logits, dl, n_dl, info.n_vocab)) goto done;
    if (!di_args_write_npy(out, logits, n_tok, info.n_vocab)) goto done;
    if (mtp_out && !di_args_write_npy(mtp_out, mtp, n_mtp_total, info.n_vocab)) goto done;
    rc = 0;
done:
    if (dj) fclose(dj);
    free(dl);
    free(logits);
    free(mtp);
    free(tokens);
    free(chunks);
    di_session_destroy(s);
    di_model_destroy(m);
    return rc;
}
