#!/usr/bin/env bash
# CLI test: GGUF (llama.cpp deepseek4) round trip. A synthesised official-layout tiny checkpoint is
# converted to GGUF; BF16/F32 conversions (FP8 -> float exactly, FP4 experts -> MXFP4 exactly in
# BF16, -> F32 in F32) must give logits bit-identical to the safetensors path; Q8_0 and Q4_K files load and run at every
# instruction-set level; malformed files and options fail cleanly.
# Usage: test_gguf_cli.sh PATH/TO/deepinfer   (run from the source root by ctest)
set -u
B=${1:?path to deepinfer}
fail=0
check() { # name, got, want
    if [ "$2" == "$3" ]; then echo "ok   $1"; else echo "FAIL $1: got [$2] want [$3]"; fail=1; fi
}
T=$(mktemp -d)
trap 'rm -rf "$T"' EXIT
ids=5,17,300,4000,129000,7,7,7,1,2,3,99,12345,6,60000,21
"$B" synth --preset tiny --out "$T/st" 2>/dev/null
check "synth" "$?" "0"
"$B" logits --model "$T/st" --tokens $ids --out "$T/ref.npy" --log-level error
for ty in bf16 f32; do
    "$B" convert --model "$T/st" --out "$T/m-$ty.gguf" --type $ty 2>/dev/null
    check "convert $ty" "$?" "0"
    "$B" logits --model "$T/m-$ty.gguf" --tokens $ids --out "$T/$ty.npy" --log-level error
    check "gguf $ty logits identical to safetensors" "$(cmp "$T/ref.npy" "$T/$ty.npy" && echo same)" "same"
done
# f32 holds no quantised tensor (the file llama.cpp computes in f32: bench/cpu/vs_llamacpp_logits.sh).
check "gguf f32 experts in F32" "$("$B" info --model "$T/m-f32.gguf" --log-level error | grep -c 'experts F32')" "1"
for ty in q8_0 q4_k; do
    "$B" convert --model "$T/st" --out "$T/m-$ty.gguf" --type $ty 2>/dev/null
    check "convert $ty" "$?" "0"
    "$B" logits --model "$T/m-$ty.gguf" --tokens $ids --out "$T/$ty.npy" --log-level error
    check "gguf $ty logits" "$?" "0"
    DI_CPU_ISA=scalar "$B" logits --model "$T/m-$ty.gguf" --tokens 5,17,300 --out "$T/s.npy" --log-level error
    check "gguf $ty logits at the scalar level" "$?" "0"
done
# A directory holding one .gguf (and no config.json) loads it.
mkdir "$T/dir" && ln -s "$T/m-bf16.gguf" "$T/dir/model.gguf"
"$B" logits --model "$T/dir" --tokens $ids --out "$T/d.npy" --log-level error
check "directory with one gguf" "$(cmp "$T/ref.npy" "$T/d.npy" && echo same)" "same"
# Malformed input: a truncated file, a file that is not GGUF, bad options.
head -c 100000 "$T/m-q8_0.gguf" > "$T/trunc.gguf"
"$B" logits --model "$T/trunc.gguf" --tokens 5 --out "$T/x.npy" --log-level error 2>"$T/err"
check "truncated gguf exits 1" "$?" "1"
check "truncated gguf message" "$(grep -c 'beyond the data region\|truncated' "$T/err")" "1"
echo "not a gguf" > "$T/bad.gguf"
"$B" logits --model "$T/bad.gguf" --tokens 5 --out "$T/x.npy" --log-level error 2>/dev/null
check "not gguf exits 1" "$?" "1"
"$B" convert --model "$T/st" --out "$T/x.gguf" --type q5_k 2>/dev/null
check "unknown type exits 2" "$?" "2"
"$B" convert --model "$T/st" 2>/dev/null
check "convert without --out exits 2" "$?" "2"
exit $fail
