#!/usr/bin/env bash
# CLI test for DeepSeek V4.1: deepinfer synth --preset v41-tiny, then info / logits (chunked,
# --dspark) / generate on it, and deepinfer bench (the serving engine's V4.1 forward, with and
# without speculative decoding, and its prefix reuse).
# Usage: test_v41_cli.sh PATH/TO/deepinfer   (run from the source root by ctest)
source "$(dirname "$0")/lib.sh" "$@" # B, check, fail, T (removed at exit), W, start_worker
"$B" synth --preset v41-tiny --out "$T/off" --seed 3 2>/dev/null
check "synth official" "$?" "0"
"$B" synth --preset v41-tiny --layout hf --out "$T/hf" --seed 3 2>/dev/null
check "synth hf" "$?" "0"
M=$T/off
check "info arch" "$("$B" info --model $M --log-level error | grep -c 'deepseek_v41')" "1"
check "info layers" "$("$B" info --model $M --log-level error | grep -c 'm0+eg m2+kv+idx+eg m2 m1+kv+idx+cand m1 m1+idx | dspark m0')" "1"
ids=$(seq -s, 5 9 300)   # 33 ids < 512
"$B" logits --model $M --tokens "$ids" --out "$T/a.npy" --log-level error
check "logits exit" "$?" "0"
"$B" logits --model $M --tokens "$ids" --chunks 7,6,1,1,18 --out "$T/b.npy" --dspark "$T/d.json" \
    --dspark-logits "$T/d.npy" --log-level error
check "chunked logits with dspark exit" "$?" "0"
check "chunked logits identical" "$(cmp "$T/a.npy" "$T/b.npy" && echo same)" "same"
check "dspark drafts" "$(grep -c '"position"' "$T/d.json")" "5"
check "dspark logits size" "$(stat -c %s "$T/d.npy")" "$((128 + 5 * 2 * 512 * 4))"
# --prompt renders in the V4.1 format for a V4.1 checkpoint (the committed V4 tokenizer, used
# here for want of the model's own, lacks its special tokens: that is the error, not V4's render).
err=$("$B" generate --model $M --prompt "hi" -n 1 2>&1 >/dev/null)
check "generate --prompt renders V4.1" "$(echo "$err" | grep -c 'DeepSeek V4.1 prompt format')" "1"
g1=$("$B" generate --model $M --tokens 5,17,300 -n 8 --no-stop --log-level error)
check "generate count" "$(echo "$g1" | tr ',' '\n' | wc -l)" "8"
g2=$("$B" generate --model $M --tokens 5,17,300 -n 8 --no-stop --dspark --log-level error 2>/dev/null)
check "greedy with DSpark speculation equals plain greedy" "$g2" "$g1"
"$B" generate --model $M --tokens 5 -n 2 --dspark --temperature 1 2>/dev/null
check "dspark sampling refused" "$?" "2"
"$B" logits --model "$T/hf" --tokens 5,6 --out "$T/x.npy" --dspark "$T/x.json" --log-level error 2>/dev/null
check "dspark without DSpark weights exits 1" "$?" "1"
b=$("$B" bench --model $M --requests 5 --prompt-len 40 --gen-len 6 --max-batch-tokens 32 \
    --no-ratio --threads 2 --log-level error 2>&1)
check "bench exit" "$?" "0"
check "bench: 5 requests" "$(echo "$b" | grep -c '^batch: 5 requests')" "1"
check "bench: no allocation in a step" "$(echo "$b" | grep -c 'step allocations 0$')" "1"
# The speculative row (DSpark, the tiny block of 2 drafts): decode with and without, acceptance.
b=$("$B" bench --model $M --requests 2 --prompt-len 40 --gen-len 12 --max-batch-tokens 32 \
    --no-ratio --threads 2 --spec-tokens 3 --log-level error 2>&1)
check "bench --spec-tokens exit" "$?" "0"
check "bench --spec-tokens: the row" "$(echo "$b" | grep -c '^speculative decoding (--spec-tokens 3, DSpark drafts, confidence cut 0.1), greedy:$')" "1"
check "bench --spec-tokens: speedup" "$(echo "$b" | grep -c '^  1 sequence    decode .*(without: .*x), step allocations 0$')" "1"
check "bench --spec-tokens: acceptance" "$(echo "$b" | grep -Ec '^  [0-9]+ verifies: 2.00 drafts proposed, .* tokens per verify step$')" "1"
"$B" bench --model "$T/hf" --requests 1 --prompt-len 8 --gen-len 4 --no-ratio --threads 2 \
    --spec-tokens 2 --log-level error >/dev/null 2>&1
check "bench --spec-tokens without DSpark weights exits 1" "$?" "1"
# The prefix-reuse row: 3 requests sharing their first 100 of 120 prompt tokens hit 96 cached
# positions each (6 whole blocks of 16), 90 of them replayed (n_layers * (W - 1)).
b=$("$B" bench --model $M --requests 3 --prompt-len 120 --shared-prefix 100 --gen-len 4 \
    --no-ratio --threads 2 --log-level error 2>&1)
check "bench --shared-prefix exit" "$?" "0"
check "bench --shared-prefix: the row" "$(echo "$b" | grep -c '^prefix reuse (--shared-prefix 100 of 120 prompt tokens), 3 requests:$')" "1"
check "bench --shared-prefix: cached and replayed" "$(echo "$b" | grep -c '^  per request: 96.0 prompt tokens from the cache, 90.0 of them computed again by the bounded replay$')" "1"
"$B" bench --model $M --prompt-len 40 --shared-prefix 40 --no-ratio >/dev/null 2>&1
check "bench --shared-prefix not below --prompt-len exits 2" "$?" "2"
exit $fail
