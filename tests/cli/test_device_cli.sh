#!/usr/bin/env bash
# CLI test: the shared model option --device cpu|cuda[:N[,M...]] (tools/cli/args.c) of logits,
# generate, bench and info: malformed values (device lists included) are usage errors (exit 2);
# --device cpu changes nothing; a build without the CUDA backend refuses --device cuda and device
# lists with exit 2 and says how to get one; a CUDA build on a machine without a GPU fails the
# load with exit 1 and a clear message, never a crash; on a GPU, cuda:0,0 runs two pipeline stages.
# info --stages N on V4 and on V4.1 (synth v41-tiny: any cut, inside kv sources' ranges too).
# generate's device-loss recovery (DI_SESSION_LOSE_DEVICE, the sessions' drill): on the CPU
# forward nothing to rebuild (exit 1, says so); on a GPU the recovered run prints the output of a
# run without the loss and one warning per recovery, and more losses than --device-loss-max fail.
# (The GPU's numbers: tests/backend/cuda/test_cuda_device.c, label cuda.)
# Usage: test_device_cli.sh PATH/TO/deepinfer   (run from the source root by ctest; DI_HAVE_CUDA=1
# in a DI_CUDA build)
source "$(dirname "$0")/lib.sh" "$@" # B, check, fail, T (removed at exit), W, start_worker
M=tests/data/fixtures/tiny/hf
ids=$(seq -s, 3 7 150)

for v in bogus cuda:-1 cuda: cuda:x cuda0 gpu cuda:0, cuda:,1 cuda:0,,1 cuda:0,x cuda:0,-1 \
    cuda:0,1,2,3,4,5,6,7,8 cuda:1024 cuda:0,1024 cpu:0,1; do
    "$B" logits --model $M --tokens "$ids" --out "$T/x.npy" --device "$v" 2>"$T/err"
    check "--device $v exits 2" "$?" "2"
    check "--device $v says why" "$(grep -q -- '--device must be' "$T/err" && echo yes)" "yes"
done
"$B" logits --model $M --tokens "$ids" --out "$T/a.npy" --log-level error
"$B" logits --model $M --tokens "$ids" --out "$T/b.npy" --device cpu --log-level error
check "--device cpu: same logits" "$(cmp "$T/a.npy" "$T/b.npy" && echo same)" "same"
check "info --device cpu" "$("$B" info --model $M --device cpu --log-level error | grep -c '^device  *cpu$')" "1"

# The split into pipeline stages (no device): tiny has 6 layers.
check "info --stages 2" "$("$B" info --model $M --stages 2 --log-level error | grep -c '^stage split')" "2"
"$B" info --model $M --stages 6 --log-level error >"$T/out"
check "info --stages 6: one layer each" "$(grep -c 'layers \[[0-5], [1-6])' "$T/out")" "6"
"$B" info --model $M --stages 7 >/dev/null 2>"$T/err"
check "info --stages 7 on 6 layers exits 1" "$?" "1"
"$B" info --model $M --stages 9 >/dev/null 2>"$T/err"
check "info --stages 9 exits 2" "$?" "2"

# V4.1 (synth v41-tiny: ratios 0 2 2 1 1 1, kv sources 1 and 3, candidate source 3): split at any
# cut, what crosses it handed over (src/model/dsv41_dev.h "Pipeline stages").
M41=$T/v41
mkdir -p "$M41"
"$B" synth --preset v41-tiny --out "$M41" --seed 5 >/dev/null 2>&1
check "synth v41-tiny" "$?" "0"
"$B" info --model "$M41" --stages 2 --log-level error >"$T/out41"
check "v41 info --stages 2" "$(grep -c '^stage split' "$T/out41")" "2"
check "v41 info --stages 2: at cut 3" "$(grep -c 'layers \[0, 3) + embedding\|layers \[3, 6) + head' "$T/out41")" "2"
"$B" info --model "$M41" --stages 3 --log-level error >"$T/out41"
check "v41 info --stages 3: cuts 2 and 5 (inside the kv sources' ranges; DSpark on the last)" \
    "$(grep -c 'layers \[0, 2) + embedding\|layers \[2, 5),\|layers \[5, 6) + head' "$T/out41")" "3"
"$B" info --model "$M41" --stages 6 --log-level error >"$T/out41"
check "v41 info --stages 6: one layer each" "$(grep -c 'layers \[[0-5], [1-6])' "$T/out41")" "6"
"$B" info --model "$M41" --stages 7 >/dev/null 2>"$T/err"
check "v41 info --stages 7 on 6 layers exits 1" "$?" "1"
# The KV-aware split (docs/cuda.md "The split"): a second device of 17 MiB cannot hold the weight
# split's [3, 6) with the default plan's state and one sequence's blocks; the memory moves the cut.
"$B" info --model "$M41" --stages 2 --stage-mem 100,17 --dev-reserve 1 --log-level error >"$T/out41"
check "v41 info --stage-mem: the cut moves" "$(grep -c 'layers \[5, 6) + head' "$T/out41")" "1"
check "v41 info --stage-mem: blocks per stage" "$(grep -c 'MiB for it: [0-9]* blocks' "$T/out41")" "2"
check "v41 info --stage-mem: the blocks every stage holds" \
    "$(grep -c '^split summary .* KV blocks on every stage' "$T/out41")" "1"
"$B" info --model "$M41" --stages 2 --stage-mem 100,15 --dev-reserve 1 >/dev/null 2>"$T/err"
check "v41 info --stage-mem too small exits 1" "$?" "1"
check "v41 info --stage-mem too small names the stage" "$(grep -c 'the best leaves stage 1' "$T/err")" "1"
"$B" info --model "$M41" --stages 2 --stage-mem 100,50,50 >/dev/null 2>"$T/err"
check "v41 info --stage-mem of 3 stages for 2 exits 2" "$?" "2"

# The sessions' device-loss drill and bound options (any build).
DI_SESSION_LOSE_DEVICE=1 "$B" generate --model $M --tokens 5,17 -n 2 >/dev/null 2>"$T/err"
check "generate drill on the CPU forward exits 1" "$?" "1"
check "generate drill on the CPU forward says why" \
    "$(grep -c 'no device state to rebuild' "$T/err")" "1"
for v in 0 -1 x; do
    "$B" generate --model $M --tokens 5,17 -n 2 --device-loss-max "$v" >/dev/null 2>&1
    check "generate --device-loss-max $v exits 2" "$?" "2"
    "$B" generate --model $M --tokens 5,17 -n 2 --device-loss-window "$v" >/dev/null 2>&1
    check "generate --device-loss-window $v exits 2" "$?" "2"
done
"$B" generate --model $M --tokens 5,17 -n 2 --device-loss-max 2 --device-loss-window 60 \
    >/dev/null 2>&1
check "generate --device-loss-max 2 --device-loss-window 60 exits 0" "$?" "0"

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
    # Device lists (pipeline stages) parse, and are refused like one CUDA device.
    for v in cuda:0,1 cuda:0,0 cuda:3,2,1,0 cuda:0,1,2,3,4,5,6,7; do
        for cmd in "logits --model $M --tokens $ids --out $T/x.npy" "info --model $M" \
            "bench --model $M --requests 1 --prompt-len 4 --gen-len 2 --no-ratio" \
            "generate --model $M --tokens 5,17 -n 2"; do
            timeout 60 "$B" $cmd --device "$v" 2>"$T/err" >/dev/null
            check "${cmd%% *} --device $v without CUDA exits 2" "$?" "2"
            check "${cmd%% *} --device $v without CUDA says so" "$(grep -c -- "$msg" "$T/err")" "1"
        done
    done
    # A V4.1 model with a list: the same refusal (no V4.1-specific one any more).
    timeout 60 "$B" info --model "$M41" --device cuda:0,0 2>"$T/err" >/dev/null
    check "v41 info --device cuda:0,0 without CUDA exits 2" "$?" "2"
    check "v41 info --device cuda:0,0 without CUDA says so" "$(grep -c -- "$msg" "$T/err")" "1"
elif ! nvidia-smi -L >/dev/null 2>&1; then
    "$B" logits --model $M --tokens "$ids" --out "$T/x.npy" --device cuda 2>"$T/err"
    check "--device cuda without a GPU exits 1" "$?" "1"
    check "--device cuda without a GPU says so" "$(grep -c 'CUDA device 0 requested, 0 present' "$T/err")" "1"
    "$B" logits --model $M --tokens "$ids" --out "$T/x.npy" --device cuda:0,1 2>"$T/err"
    check "--device cuda:0,1 without a GPU exits 1" "$?" "1"
else
    "$B" logits --model $M --tokens "$ids" --out "$T/x.npy" --device cuda 2>"$T/err"
    check "--device cuda on the GPU exits 0" "$?" "0"
    check "--device cuda logs where matmuls run" "$(grep -c 'every matmul on cuda:0' "$T/err")" "1"
    # Two pipeline stages on the one GPU (their numbers: test_cuda_device).
    "$B" logits --model $M --tokens "$ids" --out "$T/two.npy" --device cuda:0,0 2>"$T/err"
    check "--device cuda:0,0 exits 0" "$?" "0"
    check "--device cuda:0,0 logs its stages" "$(grep -c 'stage 1 of 2' "$T/err")" "1"
    check "info --device cuda:0,0 prints the stages" \
        "$("$B" info --model $M --device cuda:0,0 --log-level error | grep -c '^pipeline stage')" "2"
    check "v41 info --device cuda:0,0 prints the stages" \
        "$("$B" info --model "$M41" --device cuda:0,0 --log-level error | grep -c '^pipeline stage')" "2"
    "$B" info --model "$M41" --device cuda:0,0,0,0,0,0,0 >/dev/null 2>"$T/err"
    check "v41 --device cuda:0,0,0,0,0,0,0 (7 stages, 6 layers) exits 1" "$?" "1"
    # Sessions recover from a lost device (the drill: the calls fail without running; the reset
    # and rebuild are real): the same tokens, one warning per recovery; past the bound, exit 1.
    for mdl in $M "$M41"; do
        "$B" generate --model $mdl --tokens "$ids" -n 8 --device cuda --log-level error \
            >"$T/want" 2>/dev/null
        DI_SESSION_LOSE_DEVICE=2 "$B" generate --model $mdl --tokens "$ids" -n 8 --device cuda \
            >"$T/got" 2>"$T/err"
        check "$mdl: generate recovers from two losses" "$?" "0"
        check "$mdl: the same tokens after the recoveries" "$(cmp "$T/want" "$T/got" && echo same)" "same"
        check "$mdl: a warning per recovery" "$(grep -c 'warning: the device was lost; recovered' "$T/err")" "2"
        DI_SESSION_LOSE_DEVICE=3 "$B" generate --model $mdl --tokens "$ids" -n 8 --device cuda \
            --device-loss-max 2 >/dev/null 2>"$T/err"
        check "$mdl: three losses over --device-loss-max 2 exit 1" "$?" "1"
        check "$mdl: ... and say so" "$(grep -c 'not rebuilding it again' "$T/err")" "1"
    done
fi
exit $fail
