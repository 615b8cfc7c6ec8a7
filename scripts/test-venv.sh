#!/usr/bin/env bash
# Creates the Python virtual environment of the server's black-box tests (tests/server/) at
# ${1:-build/test-venv}: pytest and the official openai and anthropic SDKs from PyPI. Idempotent:
# an existing venv that already imports all three is kept. Prints the venv's python path.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
venv=${1:-$root/build/test-venv}
py="$venv/bin/python"
mkdir -p "$(dirname "$venv")"
exec 9>"$venv.lock" # one creator at a time (ctest entries of two build directories)
flock 9
if [[ -x $py ]] && "$py" -c "import openai, anthropic, pytest" 2>/dev/null; then
    echo "$py"
    exit 0
fi
python3 -m venv "$venv" >&2
"$py" -m pip install -q --disable-pip-version-check --upgrade pip >&2
"$py" -m pip install -q --disable-pip-version-check "openai>=1.66" "anthropic>=0.49" "pytest>=7" >&2
"$py" -c "import openai, anthropic, pytest" >&2
echo "$py"
