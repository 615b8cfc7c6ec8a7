/*
 * cli — the deepinfer subcommands. Each takes (argc, argv) with argv[0] = the command name and
 * returns the process exit status: 0 success, 1 runtime failure, 2 usage error.
 */
#pragma once

int di_cli_info(int argc, char **argv);
int di_cli_logits(int argc, char **argv);
int di_cli_generate(int argc, char **argv);
int di_cli_tokenize(int argc, char **argv);   // tools/cli/tokenize.c
int di_cli_detokenize(int argc, char **argv); // tools/cli/tokenize.c
int di_cli_render(int argc, char **argv);     // tools/cli/render.c
int di_cli_synth(int argc, char **argv);
int di_cli_convert(int argc, char **argv);
int di_cli_bench(int argc, char **argv);         // tools/cli/bench.c
int di_cli_eplb(int argc, char **argv);          // tools/cli/eplb.c
int di_cli_serve(int argc, char **argv);         // tools/server/main.c
int di_cli_batch(int argc, char **argv);         // tools/server/main.c (batch.c)
int di_cli_route(int argc, char **argv);         // tools/router/main.c
int di_cli_expert_worker(int argc, char **argv); // tools/cli/worker.c
int di_cli_cp_worker(int argc, char **argv);     // tools/cli/worker.c
