#!/usr/bin/env bash
# The test command (README; .ci/run calls it): installs dependencies, builds, runs every CPU test
# with ctest, compiles the CUDA backend and its tests for sm_80, sm_90a and sm_100 when nvcc is
# installed (no GPU needed; the tests labelled cuda run only where a GPU is present), then rebuilds
# the library and unit tests with AddressSanitizer + UBSan and runs the CPU tests again (but the
# server test files labelled no-sanitizer: tests/CMakeLists.txt says why). Exits non-zero on any
# failure, a CUDA compile error included.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
jobs=${DI_JOBS:-$(nproc)}
# Each stage's start says the seconds since this script began (where CI's time goes).
stage() { echo "== [${SECONDS}s] $*" >&2; }
"$root/scripts/deps.sh"

stage "release build: all CPU tests"
cmake -S "$root" -B "$root/build" -DCMAKE_BUILD_TYPE=Release -DDI_WERROR=ON >/dev/null
cmake --build "$root/build" -j"$jobs"
stage "release: ctest"
(cd "$root/build" && ctest -L cpu --output-on-failure -j"$jobs" --timeout 900)

# CUDA: configure and compile the library, its tests and the two benchmarks scripts/gpu-check runs
# on the device (no tools, to keep CI short), and gpu-check's own plain build (--build-only).
nvcc=$(command -v nvcc || true)
[[ -z $nvcc && -x /usr/local/cuda/bin/nvcc ]] && nvcc=/usr/local/cuda/bin/nvcc
if [[ -n $nvcc ]]; then
    stage "CUDA build (compile only unless a GPU is present)"
    # sm_80 and sm_100 here; sm_90a (the H200's) in gpu-check --build-only below, warnings as
    # errors too: each architecture compiled once.
    cmake -S "$root" -B "$root/build-cuda" -DCMAKE_BUILD_TYPE=Release -DDI_WERROR=ON -DDI_CUDA=ON \
        -DDI_BUILD_TOOLS=OFF -DDI_CUDA_BENCH=ON -DDI_CUDA_ARCHS="80;100" \
        -DCMAKE_CUDA_COMPILER="$nvcc" >/dev/null
    cmake --build "$root/build-cuda" -j"$jobs" --target di_cuda_tests bench_cuda bench_forward
    stage "gpu-check --build-only (sm_90a)"
    # The device check's own build (plain nvcc/gcc, sm_90a, warnings as errors): what a device
    # session runs first, and CI's sm_90a compile.
    PATH="$(dirname "$nvcc"):$PATH" OUT="$root/build-gpu-check/out" \
        DI_GPU_CHECK_BUILD="$root/build-gpu-check/tree" \
        "$root/scripts/gpu-check" --build-only >/dev/null ||
        { cat "$root/build-gpu-check/out/gpu-check.log" >&2; exit 1; }
    if nvidia-smi -L >/dev/null 2>&1; then
        (cd "$root/build-cuda" && ctest -L cuda --output-on-failure --timeout 900)
    fi
else
    stage "CUDA build skipped: no nvcc"
fi

stage "ASan+UBSan build: the CPU tests again (but the no-sanitizer ones)"
cmake -S "$root" -B "$root/build-asan" -DCMAKE_BUILD_TYPE=RelWithDebInfo -DDI_WERROR=ON \
    -DDI_SANITIZE=address,undefined >/dev/null
cmake --build "$root/build-asan" -j"$jobs"
stage "ASan+UBSan: ctest"
(cd "$root/build-asan" && ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=print_stacktrace=1 \
    ctest -L cpu -LE no-sanitizer --output-on-failure -j"$jobs" --timeout 1800)
stage "done"
