#!/usr/bin/env bash
# Do llama.cpp and deepinfer compute the same model from the same GGUF file (llama.cpp's deepseek4
# architecture, e.g. written by `deepinfer convert`)? Runs both on the same token ids and compares
# the logits of every position.
#
#   LLAMA_CPP=/path/to/llama.cpp bench/cpu/vs_llamacpp_logits.sh MODEL.gguf [CHECKPOINT_DIR] [TOKENS]
#     CHECKPOINT_DIR  the safetensors checkpoint the GGUF was converted from: deepinfer's fp32
#                     forward on it is the reference (proven against transformers), so its
#                     comparisons separate quantisation error from disagreement
#     TOKENS          comma-separated token ids, or a count N of pseudo-random ids (default 320:
#                     past the sliding window and 2 HCA-128 entries of the tiny-128 preset)
#   environment: LLAMA_CPP (required: a llama.cpp source tree with include/llama.h,
#   ggml/include/ and built libraries in build/bin; this script never builds llama.cpp itself),
#   THREADS (default 2), FA (llama.cpp flash attention auto|on|off, default auto as llama-bench),
#   KV (llama.cpp K/V cache type f32|f16, default f32), SEED (token ids, default 7),
#   DEEPINFER (default build/deepinfer), OUT (default /tmp/vs_llamacpp_logits), DUMP=1 (llama.cpp
#   also writes every F32/I32 graph tensor to $OUT/llamacpp_dump: see llamacpp_logits.c; pair it
#   with DI_DUMP=dir for deepinfer's per-layer dumps)
#
# It compiles bench/cpu/llamacpp_logits.c (llama.cpp's public API only) against $LLAMA_CPP and
# bench/cpu/logits_cmp.c with gcc into $OUT, runs llama.cpp (one batch, logits at every position)
# and `deepinfer logits` (fp32 precision) on the GGUF, and deepinfer on CHECKPOINT_DIR if given,
# and prints per position max|diff|/max|ref|, cosine similarity, argmax agreement and top-5 overlap
# for: deepinfer vs llama.cpp on the GGUF; and, with CHECKPOINT_DIR, the reference vs deepinfer on
# the GGUF (our own quantisation error) and the reference vs llama.cpp on the GGUF. The numbers are
# reported, not gated; the exit status is 1 only when the same-file comparison fails the sanity
# verdict (median cosine below 0.99 or fewer than half of the argmaxes agreeing: different models).
set -euo pipefail

usage() {
    echo "usage: LLAMA_CPP=/path/to/llama.cpp $0 MODEL.gguf [CHECKPOINT_DIR] [TOKENS|N]" >&2
    exit 2
}
[[ $# -ge 1 && $# -le 3 ]] || usage
model=$1
ckpt=${2:-}
tokens=${3:-320}
: "${LLAMA_CPP:?set LLAMA_CPP to a llama.cpp tree (include/, ggml/include/, build/bin/)}"
root=$(cd "$(dirname "$0")/../.." && pwd)
deepinfer=${DEEPINFER:-$root/build/deepinfer}
threads=${THREADS:-2}
fa=${FA:-auto}
kv=${KV:-f32}
seed=${SEED:-7}
out=${OUT:-/tmp/vs_llamacpp_logits}

[[ -f $model ]] || { echo "$0: no GGUF file $model" >&2; exit 2; }
[[ -z $ckpt || -f $ckpt/config.json ]] || { echo "$0: $ckpt has no config.json" >&2; exit 2; }
[[ -x $deepinfer ]] || { echo "$0: $deepinfer not built (cmake --build build)" >&2; exit 2; }
[[ -f $LLAMA_CPP/include/llama.h && -d $LLAMA_CPP/ggml/include ]] ||
    { echo "$0: $LLAMA_CPP has no include/llama.h or ggml/include" >&2; exit 2; }
libdir=$LLAMA_CPP/build/bin
[[ -f $libdir/libllama.so ]] || { echo "$0: no $libdir/libllama.so (build llama.cpp)" >&2; exit 2; }
mkdir -p "$out"

gcc -std=c17 -O2 -Wall -Wextra -I"$LLAMA_CPP/include" -I"$LLAMA_CPP/ggml/include" \
    "$root/bench/cpu/llamacpp_logits.c" -o "$out/llamacpp_logits" \
    -L"$libdir" -Wl,-rpath,"$libdir" -lllama -lggml -lggml-base
gcc -std=c17 -O2 -Wall -Wextra "$root/bench/cpu/logits_cmp.c" -o "$out/logits_cmp" -lm

n_vocab=$("$deepinfer" info --model "$model" --log-level error | awk '$1 == "vocab" {print $2}')
[[ $n_vocab =~ ^[0-9]+$ ]] || { echo "$0: cannot read the vocabulary size of $model" >&2; exit 1; }
if [[ $tokens =~ ^[0-9]+$ ]]; then # N pseudo-random ids (Park-Miller, exact in awk doubles), reproducible from SEED (> 0)
    tokens=$(awk -v n="$tokens" -v seed="$seed" -v v="$n_vocab" 'BEGIN {
        s = seed; for (i = 0; i < n; i++) { s = (s * 16807) % 2147483647;
        printf "%s%d", (i ? "," : ""), s % v } }')
elif [[ ! $tokens =~ ^[0-9]+(,[0-9]+)*$ ]]; then
    echo "$0: TOKENS must be a count or comma-separated ids" >&2
    exit 2
fi
n_tok=$(tr ',' '\n' <<<"$tokens" | wc -l)
echo "$tokens" >"$out/tokens.txt"

echo "model: $model ($(du -h "$model" | cut -f1)), $n_tok tokens, vocab $n_vocab"
"$deepinfer" info --model "$model" --log-level error | grep -E '^(layers|dtypes|attention|indexer) '
echo "llama.cpp: $LLAMA_CPP ($(git -C "$LLAMA_CPP" rev-parse --short HEAD 2>/dev/null || echo 'no git metadata')), threads $threads, flash attention $fa, K/V cache $kv"
echo "deepinfer: $(git -C "$root" rev-parse --short HEAD 2>/dev/null || echo '?'), $deepinfer, fp32 precision"

dump=()
[[ ${DUMP:-0} == 1 ]] && dump=(--dump "$out/llamacpp_dump")
"$out/llamacpp_logits" "$model" "$tokens" "$out/llamacpp.f32" --threads "$threads" --fa "$fa" \
    --kv "$kv" "${dump[@]}" >"$out/llamacpp.log" 2>&1 ||
    { echo "$0: llama.cpp failed, see $out/llamacpp.log:" >&2; tail -5 "$out/llamacpp.log" >&2; exit 1; }
"$deepinfer" logits --model "$model" --tokens "$tokens" --out "$out/deepinfer_gguf.npy" \
    --threads "$threads" --log-level error
if [[ -n $ckpt ]]; then
    "$deepinfer" logits --model "$ckpt" --tokens "$tokens" --out "$out/deepinfer_ref.npy" \
        --threads "$threads" --log-level error
fi

# compare LABEL REF TEST: the per-position table, then the summary line.
status=0
summaries=()
compare() {
    echo
    echo "== $1 (reference: $2, test: $3)"
    local rc=0
    "$out/logits_cmp" "$out/$2" "$out/$3" "$n_vocab" "$1" | tee "$out/cmp_$4.txt" || rc=$?
    [[ $rc -le 3 ]] || { echo "$0: logits_cmp failed" >&2; exit 1; }
    summaries+=("$(tail -1 "$out/cmp_$4.txt")")
    return "$rc"
}
compare "same GGUF: llama.cpp vs deepinfer" deepinfer_gguf.npy llamacpp.f32 gguf || status=1
if [[ -n $ckpt ]]; then
    compare "quantisation: reference (checkpoint) vs deepinfer on the GGUF" \
        deepinfer_ref.npy deepinfer_gguf.npy quant || true
    compare "reference (checkpoint) vs llama.cpp on the GGUF" \
        deepinfer_ref.npy llamacpp.f32 ref_llama || true
fi
echo
printf '%s\n' "${summaries[@]}"
echo "raw outputs: $out"
exit $status
