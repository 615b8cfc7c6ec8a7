#!/usr/bin/env bash
# Installs dependencies and builds deepinfer (release) into build/.
#   scripts/setup.sh            then run build/deepinfer ...
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
"$root/scripts/deps.sh"
cmake -S "$root" -B "$root/build" -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build "$root/build" -j"${DI_JOBS:-$(nproc)}"
