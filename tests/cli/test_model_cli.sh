#!/usr/bin/env bash
# CLI test: deepinfer info / logits / generate / synth on the committed fixtures and on a
# synthesised checkpoint, including exit codes for bad input.
# Usage: test_model_cli.sh PATH/TO/deepinfer   (run from the source root by ctest)
source "$(dirname "$0")/lib.sh" "$@" # B, check, fail, T (removed at exit), W, start_worker
M=tests/data/fixtures/tiny/hf
ids=$(seq -s, 3 7 350)   # 50 ids < 512

check "info layers" "$("$B" info --model $M --log-level error | grep -c 'SWA/hash CSA/hash HCA CSA HCA SWA | mtp SWA')" "1"
"$B" logits --model $M --tokens "$ids" --out "$T/a.npy" --mtp-out "$T/am.npy" --log-level error
check "logits exit" "$?" "0"
"$B" logits --model $M --tokens "$ids" --chunks 21,1,1,13,14 --out "$T/b.npy" --mtp-out "$T/bm.npy" --log-level error
check "chunked logits identical" "$(cmp "$T/a.npy" "$T/b.npy" && echo same)" "same"
check "chunked mtp identical" "$(cmp "$T/am.npy" "$T/bm.npy" && echo same)" "same"
check "npy size" "$(stat -c %s "$T/a.npy")" "$((128 + 50 * 512 * 4))"
check "mtp npy size" "$(stat -c %s "$T/am.npy")" "$((128 + 49 * 512 * 4))"
"$B" logits --model $M --tokens "$ids" --threads 1 --out "$T/c.npy" --log-level error
check "thread count does not change logits" "$(cmp "$T/a.npy" "$T/c.npy" && echo same)" "same"
g1=$("$B" generate --model $M --tokens 5,17,300 -n 12 --no-stop --log-level error)
g2=$("$B" generate --model $M --tokens 5,17,300 -n 12 --no-stop --threads 1 --log-level error)
check "greedy deterministic" "$g1" "$g2"
check "generate count" "$(echo "$g1" | tr ',' '\n' | wc -l)" "12"
# seeded sampling: a function of (seed, position) only, so thread count and reruns agree
s1=$("$B" generate --model $M --tokens 5,17,300 -n 12 --no-stop --temperature 1.5 --seed 7 --log-level error)
s2=$("$B" generate --model $M --tokens 5,17,300 -n 12 --no-stop --temperature 1.5 --seed 7 --threads 1 --log-level error)
s3=$("$B" generate --model $M --tokens 5,17,300 -n 12 --no-stop --temperature 1.5 --seed 8 --log-level error)
check "seeded sampling deterministic" "$s1" "$s2"
check "another seed draws other tokens" "$([ "$s1" != "$s3" ] && [ "$s1" != "$g1" ] && echo differ)" "differ"

# bad input: clear message and non-zero status, never a crash
"$B" logits --model $M --tokens 5,999 --out "$T/x.npy" --log-level error 2>/dev/null; check "token out of vocab exits 1" "$?" "1"
"$B" logits --model $M --tokens 5,x --out "$T/x.npy" 2>/dev/null; check "malformed tokens exit 2" "$?" "2"
"$B" logits --model $M --tokens 5,6 --chunks 1,2 --out "$T/x.npy" 2>/dev/null; check "chunks mismatch exits 2" "$?" "2"
"$B" info --model "$T/nowhere" 2>/dev/null; check "missing model exits 1" "$?" "1"
"$B" generate --model $M 2>/dev/null; check "generate without prompt exits 2" "$?" "2"
"$B" frobnicate 2>/dev/null; check "unknown command exits 2" "$?" "2"
"$B" logits --model $M --tokens 1 --out /nonexistent/dir/x.npy --log-level error 2>/dev/null; check "unwritable output exits 1" "$?" "1"

# synth in both layouts loads and generates; --prompt streams text through the tokenizer
"$B" synth --out "$T/s" --layout hf 2>/dev/null; check "synth hf" "$?" "0"
check "synth hf loads" "$("$B" info --model "$T/s" --log-level error | grep -c 'hf layout')" "1"
out=$(DEEPINFER_HOME="$T/home" "$B" generate --prompt "Hello" -n 8 --no-stop --log-level error 2>/dev/null)
check "default model prompt produces text" "$([ -n "$out" ] && echo yes)" "yes"
"$B" generate --model $M --prompt "hi" -n 2 --log-level error 2>/dev/null; check "tokenizer larger than model exits 1" "$?" "1"

# bench's speculative row on V4: the MTP block drafts one token per step (spec_tokens capped to 1);
# a checkpoint without the MTP block (the hf layout) is refused.
"$B" synth --out "$T/o" 2>/dev/null; check "synth official" "$?" "0"
b=$("$B" bench --model "$T/o" --requests 2 --prompt-len 40 --gen-len 12 --max-batch-tokens 32 \
    --no-ratio --threads 2 --spec-tokens 1 --log-level error 2>&1)
check "bench --spec-tokens 1 (MTP) exit" "$?" "0"
check "bench --spec-tokens 1 (MTP): the row" "$(echo "$b" | grep -c "^speculative decoding (the MTP block's one draft per verify), greedy:$")" "1"
check "bench --spec-tokens 1 (MTP): speedup" "$(echo "$b" | grep -c '^  1 sequence    decode .*(without: .*x), step allocations 0$')" "1"
check "bench --spec-tokens 1 (MTP): one draft per verify" "$(echo "$b" | grep -Ec '^  [0-9]+ verifies: 1.00 drafts proposed, .* tokens per verify step$')" "1"
"$B" bench --model "$T/s" --requests 1 --prompt-len 8 --gen-len 4 --no-ratio --threads 2 \
    --spec-tokens 1 --log-level error >/dev/null 2>&1
check "bench --spec-tokens without an MTP block exits 1" "$?" "1"

exit $fail
