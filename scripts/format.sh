#!/usr/bin/env bash
# Formats every tracked C and CUDA source and header with clang-format (.clang-format is the only
# authority). --check reports unformatted files and exits non-zero instead of rewriting.
set -euo pipefail
cd "$(dirname "$0")/.."
mapfile -t files < <(git ls-files '*.c' '*.h' '*.cu' '*.cuh' | grep -v 'src/tok/pretok_unicode.h')
if [[ ${1:-} == --check ]]; then
    clang-format --dry-run --Werror "${files[@]}"
else
    clang-format -i "${files[@]}"
fi
