#!/usr/bin/env bash
# The test command (README; .ci/run calls it): installs dependencies, builds, runs every CPU test
# with ctest, then rebuilds the library and unit tests with AddressSanitizer + UBSan and runs the
# unit tests again. Exits non-zero on any failure.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
jobs=${DI_JOBS:-$(nproc)}
"$root/scripts/deps.sh"

echo "== release build: all CPU tests" >&2
cmake -S "$root" -B "$root/build" -DCMAKE_BUILD_TYPE=Release -DDI_WERROR=ON >/dev/null
cmake --build "$root/build" -j"$jobs"
(cd "$root/build" && ctest -L cpu --output-on-failure -j"$jobs" --timeout 900)

echo "== ASan+UBSan build: unit and model tests" >&2
cmake -S "$root" -B "$root/build-asan" -DCMAKE_BUILD_TYPE=RelWithDebInfo -DDI_WERROR=ON \
    -DDI_SANITIZE=address,undefined >/dev/null
cmake --build "$root/build-asan" -j"$jobs"
(cd "$root/build-asan" && ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=print_stacktrace=1 \
    ctest -L cpu --output-on-failure -j"$jobs" --timeout 1800)
