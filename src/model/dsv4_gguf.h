/*
 * dsv4_gguf — DeepSeek V4 as GGUF files of llama.cpp's `deepseek4` architecture: the same file runs
 * in deepinfer and in llama.cpp. Loading reads the hyper-parameters from the GGUF metadata
 * (deepseek4.* keys as llama.cpp's converter writes them) and presents the tensors to weights.c as
 * a tensor set renamed to the official layout (blk.N.attn_q_a.weight -> layers.N.attn.wq_a.weight,
 * stacked experts blk.N.ffn_gate_exps.weight -> layers.N.ffn.experts.w1.stacked; shapes in
 * PyTorch order). Writing converts an official-layout safetensors checkpoint into such a file.
 *
 * Owns: nothing; the caller owns the returned file and set. Thread-safety: any thread (no shared
 * state).
 */
#pragma once

#include <stdbool.h>

#include "deepinfer.h"      // di_status
#include "io/gguf.h"        // di_gguf_file
#include "io/safetensors.h" // di_st_set
#include "model/hparams.h"  // di_hparams

// True when path names a .gguf file.
bool di_dsv4_gguf_is_path(const char *path);

// Hyper-parameters from a deepseek4 GGUF's metadata, validated as config.json's are. `what` names
// the file in messages. DI_ERR_FORMAT (missing or invalid key), DI_ERR_UNSUPPORTED (another
// architecture, another gating function, an MTP-only file).
di_status di_dsv4_gguf_hparams(const di_gguf_file *f, const char *what, di_hparams *hp);

// Opens path, reads the hyper-parameters and builds the renamed tensor set (a view into the file:
// close the set before the file). DI_ERR_IO, DI_ERR_FORMAT, DI_ERR_UNSUPPORTED (a tensor type
// without a kernel), DI_ERR_NOMEM.
di_status di_dsv4_gguf_open(const char *path, di_gguf_file **gguf, di_hparams *hp, di_st_set **set);

// Converts the official-layout checkpoint in src_dir to a GGUF file at dst_path. `type` is the
// ggml type of the 2-D weights: "q8_0" writes what llama.cpp's converter writes (FP8 -> Q8_0,
// FP4 experts -> MXFP4 repacked exactly, BF16 and F32 kept); "bf16", "f16" likewise with FP8 ->
// that float type (exact for BF16); "f32" writes every tensor in F32, experts included (exact: no
// quantised tensor, the file llama.cpp computes in f32); "q4_k" quantises every 2-D weight to
// Q4_K, experts included. Norms, biases, sinks, hyper-connection and compressor APE tensors and the
// router stay F32 in every mode; rows whose width is not a multiple of the block fall back to Q8_0,
// then F32. The MTP block is dropped (as llama.cpp's converter does). Tensors are written one at a
// time, so memory stays near one tensor. DI_ERR_INVALID (unknown type, not the official layout),
// DI_ERR_IO, DI_ERR_FORMAT, DI_ERR_NOMEM.
di_status di_dsv4_gguf_convert(const char *src_dir, const char *dst_path, const char *type);
