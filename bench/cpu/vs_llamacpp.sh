#!/usr/bin/env bash
# Side-by-side CPU benchmark of deepinfer and llama.cpp on the same GGUF file (llama.cpp's
# deepseek4 architecture, e.g. written by `deepinfer convert --to gguf`).
#
#   LLAMA_BENCH=/path/to/llama-bench bench/cpu/vs_llamacpp.sh MODEL.gguf [THREADS] [CONTEXTS]
#     THREADS   comma list of thread counts (default 1,2)
#     CONTEXTS  comma list of contexts (default 512): prefill of that many tokens (pp), and
#               decode at that depth (tg: TG tokens after a prompt of that length)
#   environment: LLAMA_BENCH (required; this script never builds llama.cpp), BENCH_CPU (default
#   build/bench_cpu), TG (decode tokens per run, default 8), REPS (default 2), BW_MIB (read
#   bandwidth buffer, default 512), OUT (raw logs, default /tmp/vs_llamacpp), LLAMA_ARGS (more
#   llama-bench flags, word-split, e.g. "--repack 0": at llama.cpp 0c1e57098 on an AVX-512 CPU the
#   repacked weight buffers fail its scheduler's GGML_ASSERT(*cur_backend_id != -1) on this model)
#
# For every thread count and context it runs llama-bench (pp C, then tg TG at depth C, -r REPS, no
# warm-up, JSON output) and bench_cpu (--prompt C --decode TG --reps REPS; its prefill is the best
# repetition, its decode rate is reported both best and mean per token), and prints tokens/s of
# both and the ratios ours / llama.cpp, plus our decode roofline ratio against the STREAM-like read
# bandwidth bench_cpu measures in the same run. llama-bench reports the mean over repetitions, so
# the decode ratio uses our mean; the prefill ratio compares our best with its mean (llama-bench's
# standard deviation is printed so the difference can be judged).
set -euo pipefail

model=${1:?usage: LLAMA_BENCH=... $0 MODEL.gguf [THREADS] [CONTEXTS]}
threads=${2:-1,2}
contexts=${3:-512}
: "${LLAMA_BENCH:?set LLAMA_BENCH to a llama-bench binary (this script does not build llama.cpp)}"
root=$(cd "$(dirname "$0")/../.." && pwd)
bench_cpu=${BENCH_CPU:-$root/build/bench_cpu}
tg=${TG:-8}
reps=${REPS:-2}
bw_mib=${BW_MIB:-512}
read -r -a llama_args <<<"${LLAMA_ARGS:-}"
out=${OUT:-/tmp/vs_llamacpp}
mkdir -p "$out"
[[ -x $LLAMA_BENCH ]] || { echo "$0: $LLAMA_BENCH is not executable" >&2; exit 2; }
[[ -x $bench_cpu ]] || { echo "$0: $bench_cpu not built (cmake --build build)" >&2; exit 2; }

echo "model: $model ($(du -h "$model" | cut -f1))"
echo "llama-bench: $LLAMA_BENCH ${LLAMA_ARGS:-}"
"$LLAMA_BENCH" --version 2>&1 | head -2 || true
echo "deepinfer: $(git -C "$root" rev-parse --short HEAD 2>/dev/null || echo '?'), $bench_cpu"
echo "machine: $(nproc) CPUs, load $(cut -d' ' -f1-3 /proc/loadavg)"

# Prints "avg_ts stddev_ts" of the one test in a llama-bench JSON file.
json_ts() {
    python3 -c 'import json,sys; r=json.load(open(sys.argv[1]))[0]; print("%.3f %.3f" % (r["avg_ts"], r["stddev_ts"]))' "$1"
}

printf '\n%-7s %-7s | %-28s | %-44s | %-6s %-6s | %s\n' threads context \
    "llama.cpp pp / tg (tok/s)" "deepinfer pp / tg best / tg mean (tok/s)" "pp" "tg" \
    "roofline (decode GB/s / read GB/s)"
results=()
for t in ${threads//,/ }; do
    for c in ${contexts//,/ }; do
        tag="t${t}_c${c}"
        "$LLAMA_BENCH" -m "$model" -t "$t" -p "$c" -n 0 -r "$reps" --no-warmup -o json \
            "${llama_args[@]}" >"$out/llama_pp_$tag.json" 2>"$out/llama_pp_$tag.log"
        "$LLAMA_BENCH" -m "$model" -t "$t" -p 0 -n "$tg" -d "$c" -r "$reps" --no-warmup -o json \
            "${llama_args[@]}" >"$out/llama_tg_$tag.json" 2>"$out/llama_tg_$tag.log"
        read -r l_pp l_pp_sd < <(json_ts "$out/llama_pp_$tag.json")
        read -r l_tg l_tg_sd < <(json_ts "$out/llama_tg_$tag.json")
        "$bench_cpu" --model "$model" --threads "$t" --prompt "$c" --decode "$tg" --reps "$reps" \
            --bw-mib "$bw_mib" >"$out/ours_$tag.txt" 2>"$out/ours_$tag.log"
        o_pp=$(sed -n 's/.*prefill [0-9]* tokens [0-9.]* s = \([0-9.]*\) tokens\/s.*/\1/p' "$out/ours_$tag.txt")
        o_best=$(sed -n 's/.*best \([0-9.]*\) s\/token (mean \([0-9.]*\)).*/\1/p' "$out/ours_$tag.txt")
        o_mean=$(sed -n 's/.*best \([0-9.]*\) s\/token (mean \([0-9.]*\)).*/\2/p' "$out/ours_$tag.txt")
        bw=$(sed -n 's/^threads [0-9]*: read bandwidth \([0-9.]*\) GB\/s.*/\1/p' "$out/ours_$tag.txt" | head -1)
        roof=$(sed -n 's/.*decode reads .*: \([0-9.]*\) GB\/s = roofline ratio \([0-9.]*\).*/\1 \2/p' "$out/ours_$tag.txt")
        read -r row < <(python3 - "$l_pp" "$l_pp_sd" "$l_tg" "$l_tg_sd" "$o_pp" "$o_best" "$o_mean" "$bw" $roof <<'EOF'
import sys
l_pp, l_pp_sd, l_tg, l_tg_sd, o_pp, o_best, o_mean, bw, dec_gbs, roof = sys.argv[1:11]
o_tg_best, o_tg_mean = 1 / float(o_best), 1 / float(o_mean)
print("%8.2f±%-5.2f / %6.3f±%-5.3f | %8.2f / %6.3f / %6.3f %17s | %6.2f %6.2f | %.2f (%s / %s)" % (
    float(l_pp), float(l_pp_sd), float(l_tg), float(l_tg_sd), float(o_pp), o_tg_best, o_tg_mean,
    "", float(o_pp) / float(l_pp), o_tg_mean / float(l_tg), float(roof), dec_gbs, bw))
EOF
)
        printf '%-7s %-7s | %s\n' "$t" "$c" "$row"
    done
done
echo
echo "pp = deepinfer prefill tok/s / llama.cpp pp tok/s; tg = deepinfer mean decode tok/s / llama.cpp tg tok/s"
echo "raw outputs: $out"
