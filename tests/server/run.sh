#!/usr/bin/env bash
# ctest entries of the server's black-box tests: creates/reuses the test venv (openai, anthropic,
# pytest from PyPI) and runs pytest against `deepinfer serve` started on loopback.
#   tests/server/run.sh <path to deepinfer> [--venv-only | pytest file or args...]
# Without arguments after the binary it runs every file in tests/server.
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
bin=$(cd "$(dirname "$1")" && pwd)/$(basename "$1")
shift
py=$("$root/scripts/test-venv.sh") # build/test-venv, shared by every build directory
[[ ${1:-} == --venv-only ]] && exit 0
export DEEPINFER_BIN=$bin
(($#)) || set -- "$root/tests/server"
exec "$py" -m pytest -q -p no:cacheprovider "$@"
