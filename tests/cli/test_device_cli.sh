#!/usr/bin/env bash
# CLI test: the shared model option --device cpu|cuda[:N] (tools/cli/args.c) of logits, generate,
# bench and info: malformed values are usage errors (exit 2); --device cpu changes nothing; a
# build without the CUDA backend refuses --device cuda with exit 2 and says how to get one; a CUDA
# build on a machine without a GPU fails the load with exit 1 and a clear message, never a crash.
# (The GPU's numbers: tests/backend/cuda/test_cuda_device.c, label cuda.)
# Usage: test_device_cli.sh PATH/TO/deepinfer   (run from the source root by ctest; DI_HAVE_CUDA=1
# in a DI_CUDA build)
set -u
B=${1:?path to deepinfer}
fail=0
check() { # name, got, want
    if [ "$2" == "$3" ]; then echo "ok   $1"; else echo "FAIL $1: got [$2] want [$3]"; fail=1; fi
}
T=$(mktemp -d)
trap 'rm -rf "$T"' EXIT
M=tests/data/fixtures/tiny/hf
ids=$(seq -s, 3 7 150)

for v in bogus cuda:-1 cuda: cuda:x cuda0 gpu; do
    "$B" logits --model $M --tokens "$ids" --out "$T/x.npy" --device "$v" 2>"$T/err"
    check "--device $v exits 2" "$?" "2"
    check "--device $v says why" "$(grep -q -- '--device must be' "$T/err" && echo yes)" "yes"
done
"$B" logits --model $M --tokens "$ids" --out "$T/a.npy" --log-level error
"$B" logits --model $M --tokens "$ids" --out "$T/b.npy" --device cpu --log-level error
check "--device cpu: same logits" "$(cmp "$T/a.npy" "$T/b.npy" && echo same)" "same"
check "info --device cpu" "$("$B" info --model $M --device cpu --log-level error | grep -c '^device  *cpu$')" "1"

msg='this build has no CUDA backend: configure with -DDI_CUDA=ON'
if [ "${DI_HAVE_CUDA:-0}" != 1 ]; then
    refused() { # name, command...
        local name=$1
        shift
        timeout 60 "$B" "$@" --device cuda 2>"$T/err" >/dev/null
        check "$name --device cuda without CUDA exits 2" "$?" "2"
        check "$name --device cuda without CUDA says so" "$(grep -c -- "$msg" "$T/err")" "1"
    }
    refused logits logits --model $M --tokens "$ids" --out "$T/x.npy"
    refused generate generate --model $M --tokens 5,17 -n 2
    refused bench bench --model $M --requests 1 --prompt-len 4 --gen-len 2 --no-ratio
    refused info info --model $M
    refused serve serve --model $M
    "$B" logits --model $M --tokens "$ids" --out "$T/x.npy" --device cuda:3 2>"$T/err"
    check "--device cuda:3 without CUDA exits 2" "$?" "2"
elif ! nvidia-smi -L >/dev/null 2>&1; then
    "$B" logits --model $M --tokens "$ids" --out "$T/x.npy" --device cuda 2>"$T/err"
    check "--device cuda without a GPU exits 1" "$?" "1"
    check "--device cuda without a GPU says so" "$(grep -c 'CUDA device 0 requested, 0 present' "$T/err")" "1"
else
    "$B" logits --model $M --tokens "$ids" --out "$T/x.npy" --device cuda 2>"$T/err"
    check "--device cuda on the GPU exits 0" "$?" "0"
    check "--device cuda logs where matmuls run" "$(grep -c 'every matmul on cuda:0' "$T/err")" "1"
fi
exit $fail
