#!/usr/bin/env bash
# CLI test: GGUF (llama.cpp deepseek4) round trip. A synthesised official-layout tiny checkpoint is
# converted to GGUF. The F32 conversion (FP8 -> float exactly, FP4 experts -> F32: no quantised
# tensor) gives logits bit-identical to the safetensors path; the BF16 one (FP4 experts -> MXFP4
# exactly) differs from it only by the 8-bit activations of the MXFP4 experts
# (backend/cpu/gemm.h), within TOL_ACT. Q8_0 and Q4_K files run at every instruction-set level, the
# scalar level (the reference arithmetic, same contract) within TOL_LEVEL of the AVX2 level;
# malformed files and options fail cleanly.
# Usage: test_gguf_cli.sh PATH/TO/deepinfer   (run from the source root by ctest)
source "$(dirname "$0")/lib.sh" "$@" # B, check, fail, T (removed at exit), W, start_worker
# Tolerances, on the median over tokens of max |a - b| / max |b| per token's logits.
# TOL_ACT: MXFP4 experts with 8-bit vs f32 activations (measured median 1.5e-2, 1.2e-2..2.7e-1 per
# token: each activation moves by up to ~0.56 of its block's d = amax/127, and this random model
# amplifies that); a wrong expert layout or scale gives O(1).
# TOL_LEVEL: AVX2 vs scalar level (the reference arithmetic, same contract) on one file. The 8-bit
# matmuls agree bit for bit across levels, the f32 ones (norms, attention, BF16/F32 weights) by FMA
# rounding, ~1e-6; but an 8-bit code is a discontinuous function of its input, so a 1-ulp
# difference upstream can move one code by a step (or flip an expert choice), and from then on
# this random model's logits differ by up to the activation quantisation error (measured on q8_0:
# 2e-7 for the first two tokens, then 5e-3..1e-2). The tight checks of the 8-bit contract are in
# tests/backend/test_ops.c (bit-identity with di_ref_matmul) and below (threads, chunking).
TOL_LEVEL=5e-2
TOL_ACT=5e-2
V=129280
# The median over tokens of max |a - b| / max |b| per token, two float32 [T, V] .npy files
# (128-byte header).
medrel() {
    paste <(od -An -v -f -w4 -j 128 "$1") <(od -An -v -f -w4 -j 128 "$2") |
        awk -v V=$V '{ r = int((NR - 1) / V); d = $1 - $2; if (d < 0) d = -d; if (d > m[r]) m[r] = d
                       b = $2 < 0 ? -$2 : $2; if (b > M[r]) M[r] = b }
             END { T = int(NR / V); if (T == 0) { print "nan"; exit }
                   for (r = 0; r < T; r++) e[r] = M[r] > 0 ? m[r] / M[r] : 1e30
                   for (i = 0; i < T; i++) for (j = i + 1; j < T; j++) if (e[j] < e[i]) { t = e[i]; e[i] = e[j]; e[j] = t }
                   printf "%.3e\n", e[int((T - 1) / 2)] }'
}
within() { # name, value, bound
    echo "     $1: $2 (bound $3)"
    check "$1" "$(awk -v v="$2" -v b="$3" 'BEGIN { print (v != "nan" && v + 0 <= b + 0) ? "yes" : "no" }')" "yes"
}
ids=5,17,300,4000,129000,7,7,7,1,2,3,99,12345,6,60000,21
ids8=5,17,300,4000,129000,7,7,7 # the scalar level is slow
"$B" synth --preset tiny --out "$T/st" 2>/dev/null
check "synth" "$?" "0"
"$B" logits --model "$T/st" --tokens $ids --out "$T/ref.npy" --log-level error
for ty in bf16 f32; do
    "$B" convert --model "$T/st" --out "$T/m-$ty.gguf" --type $ty 2>/dev/null
    check "convert $ty" "$?" "0"
    "$B" logits --model "$T/m-$ty.gguf" --tokens $ids --out "$T/$ty.npy" --log-level error
    check "gguf $ty logits" "$?" "0"
done
# f32 holds no quantised tensor (the file llama.cpp computes in f32: bench/cpu/vs_llamacpp_logits.sh).
check "gguf f32 experts in F32" "$("$B" info --model "$T/m-f32.gguf" --log-level error | grep -c 'experts F32')" "1"
check "gguf f32 logits identical to safetensors" "$(cmp "$T/ref.npy" "$T/f32.npy" && echo same)" "same"
within "gguf bf16 (8-bit activations into MXFP4) vs safetensors" "$(medrel "$T/bf16.npy" "$T/ref.npy")" $TOL_ACT
check "gguf bf16 differs from safetensors (the 8-bit path is used)" "$(cmp -s "$T/ref.npy" "$T/bf16.npy" || echo differs)" "differs"
for ty in q8_0 q4_k; do
    "$B" convert --model "$T/st" --out "$T/m-$ty.gguf" --type $ty 2>/dev/null
    check "convert $ty" "$?" "0"
    "$B" logits --model "$T/m-$ty.gguf" --tokens $ids8 --out "$T/$ty.npy" --log-level error
    check "gguf $ty logits" "$?" "0"
    DI_CPU_ISA=scalar "$B" logits --model "$T/m-$ty.gguf" --tokens $ids8 --out "$T/s-$ty.npy" --log-level error
    check "gguf $ty logits at the scalar level" "$?" "0"
    within "gguf $ty avx2 vs scalar level" "$(medrel "$T/$ty.npy" "$T/s-$ty.npy")" $TOL_LEVEL
done
# The 8-bit path keeps batch and thread invariance: one thread, and the tokens fed in chunks
# through the incremental state, give the same bits.
"$B" logits --model "$T/m-q8_0.gguf" --tokens $ids8 --threads 1 --out "$T/q8-t1.npy" --log-level error
check "gguf q8_0 logits, 1 thread identical" "$(cmp "$T/q8_0.npy" "$T/q8-t1.npy" && echo same)" "same"
"$B" logits --model "$T/m-q8_0.gguf" --tokens $ids8 --chunks 3,1,4 --out "$T/q8-ch.npy" --log-level error
check "gguf q8_0 logits, chunked identical" "$(cmp "$T/q8_0.npy" "$T/q8-ch.npy" && echo same)" "same"
# A directory holding one .gguf (and no config.json) loads it.
mkdir "$T/dir" && ln -s "$T/m-bf16.gguf" "$T/dir/model.gguf"
"$B" logits --model "$T/dir" --tokens $ids --out "$T/d.npy" --log-level error
check "directory with one gguf" "$(cmp "$T/bf16.npy" "$T/d.npy" && echo same)" "same"
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
