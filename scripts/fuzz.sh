#!/usr/bin/env bash
# Builds the libFuzzer targets with clang into build-fuzz/ and runs one of them.
#
#   scripts/fuzz.sh <target> [seconds] [extra libFuzzer flags...]
#   scripts/fuzz.sh safetensors 600
#
# Seeds are read from fuzz/corpus/<target>/ (committed, never written); new corpus entries and
# crash artifacts go to $DI_FUZZ_WORK (default /tmp/deepinfer-fuzz/<target>/), outside the repo.
# Exits non-zero when the fuzzer finds a crash; the reproducer's path is printed by libFuzzer.
set -euo pipefail

if [[ $# -lt 1 ]]; then
    echo "usage: $0 <target> [seconds] [libFuzzer flags...]   (targets: fuzz/fuzz_<target>.c)" >&2
    exit 2
fi
target=$1
seconds=${2:-60}
shift $(( $# >= 2 ? 2 : 1 ))

root=$(cd "$(dirname "$0")/.." && pwd)
src="$root/fuzz/fuzz_$target.c"
[[ -f $src ]] || { echo "$0: no fuzz target $src" >&2; exit 2; }

build="$root/build-fuzz"
CC=clang cmake -S "$root" -B "$build" -DDI_FUZZ=ON -DDI_BUILD_TESTS=OFF -DDI_BUILD_TOOLS=OFF \
    -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
cmake --build "$build" -j"${DI_JOBS:-2}" --target "fuzz_$target"

work=${DI_FUZZ_WORK:-/tmp/deepinfer-fuzz/$target}
mkdir -p "$work/corpus" "$work/artifacts"
seeds="$root/fuzz/corpus/$target"
dict=()
[[ -f $root/fuzz/$target.dict ]] && dict=(-dict="$root/fuzz/$target.dict")

# The first corpus directory receives new inputs; the seed directory is only read.
corpora=("$work/corpus")
[[ -d $seeds ]] && corpora+=("$seeds")
exec "$build/fuzz/fuzz_$target" -max_total_time="$seconds" -print_final_stats=1 \
    -artifact_prefix="$work/artifacts/" "${dict[@]}" "$@" "${corpora[@]}"
