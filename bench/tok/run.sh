#!/usr/bin/env bash
# Encode-throughput benchmark: deepinfer's tokenizer vs HF tokenizers (Rust), one thread each, on
# the golden corpus texts. Prints both lines and the ratio (C speed / HF speed).
#   bench/tok/run.sh [build-dir] [repetitions] [corpus.jsonl.gz]
# build-dir holds libdeepinfer_core.a; the corpus defaults to tests/data/tok/corpus.jsonl.gz (any
# gzip JSON-lines file whose records have a "t" string works; the first line is skipped).
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
build=${1:-$root/build-tok}
reps=${2:-3}
corpus=${3:-$root/tests/data/tok/corpus.jsonl.gz}
py=${DI_PYTHON:-$root/python/.venv/bin/python}
cmake --build "$build" --target deepinfer_core -j"${DI_JOBS:-2}" >/dev/null
exe="$build/bench_tok_encode"
cc -O2 -std=c17 -D_GNU_SOURCE -I"$root/src" -I"$root/include" "$root/bench/tok/bench_encode.c" \
    "$build/libdeepinfer_core.a" -ljansson -lpcre2-8 -lz -lm -lpthread -o "$exe"
cd "$root"
c=$(taskset -c 0 "$exe" "$corpus" "$reps")
hf=$(taskset -c 0 "$py" "$root/bench/tok/hf_encode.py" "$corpus" "$reps")
echo "$c"
echo "$hf"
c_ids=$(echo "$c" | awk '{print $6}')
hf_ids=$(echo "$hf" | awk '{print $6}')
[ "$c_ids" == "$hf_ids" ] || { echo "id counts differ: $c_ids vs $hf_ids" >&2; exit 1; }
awk -v a="$(echo "$c" | awk '{print $10}')" -v b="$(echo "$hf" | awk '{print $10}')" \
    'BEGIN { printf "ratio (C / HF tokenizers, one thread): %.2fx\n", a / b }'
