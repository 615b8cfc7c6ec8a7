# Sourced by the CLI tests (tests/cli/test_*_cli.sh, run from the source root by ctest) with the
# test's arguments: B is the deepinfer binary ($1); check NAME GOT WANT prints ok / FAIL and sets
# fail=1 on a mismatch (the test ends with `exit $fail`); T is a temporary directory, removed at
# exit together with the background processes whose pids the test appends to W;
# start_worker KIND NAME [options] starts `deepinfer KIND` (cp-worker, expert-worker) on a free
# loopback port over the model $M and puts its port in PORT.
set -u
B=${1:?path to deepinfer}
fail=0
check() { # name, got, want
    if [ "$2" == "$3" ]; then echo "ok   $1"; else echo "FAIL $1: got [$2] want [$3]"; fail=1; fi
}
T=$(mktemp -d)
W=()
cleanup() {
    for p in "${W[@]}"; do kill "$p" 2>/dev/null; wait "$p" 2>/dev/null; done
    rm -rf "$T"
}
trap cleanup EXIT

start_worker() {
    local kind=$1 name=$2
    shift 2
    "$B" "$kind" --listen 127.0.0.1:0 --model "$M" --threads 1 --log-level error "$@" \
        >"$T/$name.out" 2>"$T/$name.err" &
    W+=($!)
    for _ in $(seq 100); do
        grep -q '^listening on' "$T/$name.out" 2>/dev/null && break
        sleep 0.05
    done
    PORT=$(sed -n 's/^listening on .*:\([0-9]*\)$/\1/p' "$T/$name.out")
}
