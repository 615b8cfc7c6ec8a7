#!/usr/bin/env bash
# ctest entry of the server's black-box tests: creates/reuses the test venv (openai, anthropic,
# pytest from PyPI) and runs pytest against `deepinfer serve` started on loopback.
#   tests/server/run.sh <path to deepinfer>
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
bin=$(cd "$(dirname "$1")" && pwd)/$(basename "$1")
py=$("$root/scripts/test-venv.sh" "$(dirname "$bin")/test-venv")
export DEEPINFER_BIN=$bin
exec "$py" -m pytest -q -p no:cacheprovider "$root/tests/server"
