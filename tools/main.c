// deepinfer: subcommand dispatch. Each subcommand lives in tools/cli/<name>.c.
#include <stdio.h>
#include <string.h>

#include "cli/cli.h"

static const struct {
    const char *name;
    int (*fn)(int argc, char **argv);
    const char *help;
} k_commands[] = {
    {"info", di_cli_info, "print a checkpoint's configuration and tensor summary"},
    {"logits", di_cli_logits, "run the forward pass on token ids and write logits as .npy"},
    {"generate", di_cli_generate, "generate from a prompt (text or token ids)"},
    {"tokenize", di_cli_tokenize, "text to token ids (HF tokenizer.json)"},
    {"detokenize", di_cli_detokenize, "token ids to text"},
    {"render", di_cli_render, "render an API request as a V4/V4.1 prompt: text and ids"},
    {"bench", di_cli_bench,
     "serving-engine throughput: tokens/s, TTFT/ITL, KV usage, 16-vs-1 ratio"},
    {"serve", di_cli_serve,
     "HTTP server: OpenAI Chat/Completions/Responses and Anthropic Messages"},
    {"batch", di_cli_batch,
     "answer a file of OpenAI Batch requests (JSONL) offline, as serve would"},
    {"route", di_cli_route, "load balancer over serve replicas: prefix affinity, health, failover"},
    {"eplb", di_cli_eplb, "plan an expert-parallel placement (EPLB) from a routing load"},
    {"expert-worker", di_cli_expert_worker,
     "serve a model's routed experts to fronts started with --ep-workers (expert parallelism)"},
    {"cp-worker", di_cli_cp_worker,
     "compute pieces of long prefills for fronts started with --cp-workers (context parallelism)"},
    {"synth", di_cli_synth,
     "write a random-weight V4 or V4.1 checkpoint (tests, benchmarks, default)"},
    {"convert", di_cli_convert, "convert an official-layout checkpoint to GGUF (llama.cpp)"},
};

static void usage(FILE *f) {
    fprintf(f, "usage: deepinfer <command> [options]\n\ncommands:\n");
    for (size_t i = 0; i < sizeof k_commands / sizeof k_commands[0]; i++)
        fprintf(f, "  %-13s %s\n", k_commands[i].name, k_commands[i].help);
    fprintf(f, "\n'deepinfer <command> --help' describes a command's options.\n");
}

int main(int argc, char **argv) {
    if (argc < 2 || strcmp(argv[1], "--help") == 0 || strcmp(argv[1], "-h") == 0) {
        usage(argc < 2 ? stderr : stdout);
        return argc < 2 ? 2 : 0;
    }
    for (size_t i = 0; i < sizeof k_commands / sizeof k_commands[0]; i++)
        if (strcmp(argv[1], k_commands[i].name) == 0) return k_commands[i].fn(argc - 1, argv + 1);
    fprintf(stderr, "deepinfer: unknown command '%s'\n\n", argv[1]);
    usage(stderr);
    return 2;
}
