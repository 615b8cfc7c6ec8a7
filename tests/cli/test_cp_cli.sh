#!/usr/bin/env bash
# CLI test: deepinfer cp-worker on free ports, and generate / logits with --cp-workers (the
# prompt's prefill split over 2 and 3 ranks) giving byte-identical output to the single process,
# MTP logits included, in both precision recipes; the same on DeepSeek V4.1 (synth v41-tiny, with
# DSpark speculative decoding after the split prefill) over 2 and 3 ranks; a model mismatch is refused naming both sides;
# a worker that goes away fails the run with a message naming it; bad options are usage errors.
# Usage: test_cp_cli.sh PATH/TO/deepinfer   (run from the source root by ctest)
source "$(dirname "$0")/lib.sh" "$@" # B, check, fail, T (removed at exit), W, start_worker
M=tests/data/fixtures/tiny/official
ids=$(seq -s, 1 5 500) # 100 ids < 512

start_worker cp-worker w1
P1=$PORT
start_worker cp-worker w2
P2=$PORT
CP="127.0.0.1:$P1,127.0.0.1:$P2"
check "workers listening" "$([ -n "$P1" ] && [ -n "$P2" ] && echo yes)" "yes"

g1=$("$B" generate --model $M --tokens "$ids" -n 8 --no-stop --threads 1 --log-level error)
g2=$("$B" generate --model $M --tokens "$ids" -n 8 --no-stop --threads 1 --log-level info \
    --cp-workers "$CP" --cp-min-tokens 64 2>"$T/g2.err")
check "generate over 3 ranks identical" "$g2" "$g1"
check "generate count" "$(echo "$g2" | tr ',' '\n' | wc -l)" "8"
check "the prefill ran over 3 ranks" "$(grep -c 'cp: prefill of 100 tokens at position 0 over 3 ranks' "$T/g2.err")" "1"

"$B" logits --model $M --tokens "$ids" --out "$T/a.npy" --mtp-out "$T/am.npy" --threads 1 \
    --log-level error
"$B" logits --model $M --tokens "$ids" --out "$T/b.npy" --mtp-out "$T/bm.npy" --threads 1 \
    --cp-workers "127.0.0.1:$P1" --cp-min-tokens 64 --log-level error
check "logits over 2 ranks identical" "$(cmp "$T/a.npy" "$T/b.npy" && echo same)" "same"
check "MTP logits over 2 ranks identical" "$(cmp "$T/am.npy" "$T/bm.npy" && echo same)" "same"
# After a prefix (--chunks: 40 tokens alone, then 60 over the ranks).
"$B" logits --model $M --tokens "$ids" --chunks 40,60 --out "$T/c.npy" --mtp-out "$T/cm.npy" \
    --threads 1 --cp-workers "$CP" --cp-min-tokens 48 --log-level error
check "logits after a prefix identical" "$(cmp "$T/a.npy" "$T/c.npy" && echo same)" "same"
check "MTP logits after a prefix identical" "$(cmp "$T/am.npy" "$T/cm.npy" && echo same)" "same"

start_worker cp-worker w3 --precision official
P3=$PORT
"$B" logits --model $M --tokens "$ids" --out "$T/d.npy" --threads 1 --precision official \
    --log-level error
"$B" logits --model $M --tokens "$ids" --out "$T/e.npy" --threads 1 --precision official \
    --cp-workers "127.0.0.1:$P3" --cp-min-tokens 64 --log-level error
check "official logits over 2 ranks identical" "$(cmp "$T/d.npy" "$T/e.npy" && echo same)" "same"

# A model mismatch (fp32 front, official worker) is refused, naming both sides.
"$B" generate --model $M --tokens 5,17 -n 2 --cp-workers "127.0.0.1:$P3" --log-level error \
    >/dev/null 2>"$T/mm.err"
check "mismatch exits 1" "$?" "1"
check "mismatch names both sides" "$(grep -c 'model mismatch: the front runs .*fp32.*this worker runs .*official' "$T/mm.err")" "1"

# The worker stops on SIGTERM; a front then cannot start (the worker is named).
kill -TERM "${W[0]}"
wait "${W[0]}"
check "worker exits 0 on SIGTERM" "$?" "0"
"$B" generate --model $M --tokens 5,17 -n 2 --cp-workers "$CP" --log-level error >/dev/null \
    2>"$T/down.err"
check "worker down exits 1" "$?" "1"
check "worker down named" "$(grep -c "cp: cannot connect to 127.0.0.1:$P1" "$T/down.err")" "1"

# DeepSeek V4.1 (synth --preset v41-tiny: official layout with the DSpark block).
M41=$T/v41
mkdir -p "$M41"
"$B" synth --out "$M41" --preset v41-tiny >/dev/null 2>&1
M0=$M
M=$M41
start_worker cp-worker v1
Q1=$PORT
start_worker cp-worker v2
Q2=$PORT
CP41="127.0.0.1:$Q1,127.0.0.1:$Q2"
check "V4.1 workers listening" "$([ -n "$Q1" ] && [ -n "$Q2" ] && echo yes)" "yes"
h1=$("$B" generate --model $M --tokens "$ids" -n 8 --no-stop --threads 1 --log-level error)
h2=$("$B" generate --model $M --tokens "$ids" -n 8 --no-stop --threads 1 --log-level info \
    --cp-workers "$CP41" --cp-min-tokens 64 2>"$T/h2.err")
check "V4.1 generate count" "$(echo "$h1" | tr ',' '\n' | wc -l)" "8"
check "V4.1 generate over 3 ranks identical" "$h2" "$h1"
check "V4.1 prefill over 3 ranks" "$(grep -c 'cp: V4.1 prefill of 100 tokens at position 0 over 3 ranks' "$T/h2.err")" "1"
h3=$("$B" generate --model $M --tokens "$ids" -n 8 --no-stop --threads 1 --dspark \
    --log-level error 2>/dev/null)
h4=$("$B" generate --model $M --tokens "$ids" -n 8 --no-stop --threads 1 --dspark \
    --cp-workers "$CP41" --cp-min-tokens 64 --log-level info 2>"$T/h4.err")
check "V4.1 DSpark generate over 3 ranks identical" "$h4" "$h3"
check "V4.1 DSpark prefill over 3 ranks" "$(grep -c 'cp: V4.1 prefill of 100 tokens at position 0 over 3 ranks' "$T/h4.err")" "1"
check "V4.1 DSpark generate matches plain" "$h3" "$h1"
"$B" logits --model $M --tokens "$ids" --out "$T/v_a.npy" --threads 1 --log-level error
"$B" logits --model $M --tokens "$ids" --out "$T/v_b.npy" --threads 1 \
    --cp-workers "127.0.0.1:$Q1" --cp-min-tokens 64 --log-level error
check "V4.1 logits over 2 ranks identical" "$(cmp "$T/v_a.npy" "$T/v_b.npy" && echo same)" "same"
"$B" logits --model $M --tokens "$ids" --chunks 37,63 --out "$T/v_c.npy" --threads 1 \
    --cp-workers "$CP41" --cp-min-tokens 48 --log-level error
check "V4.1 logits after a prefix identical" "$(cmp "$T/v_a.npy" "$T/v_c.npy" && echo same)" "same"
# A V4 front on V4.1 workers: refused, naming both sides.
"$B" generate --model $M0 --tokens 5,17 -n 2 --cp-workers "127.0.0.1:$Q1" --log-level error \
    >/dev/null 2>"$T/mm41.err"
check "V4 front on a V4.1 worker exits 1" "$?" "1"
check "V4 / V4.1 mismatch named" "$(grep -c 'model mismatch' "$T/mm41.err")" "1"
M=$M0

# Usage errors.
"$B" cp-worker --model $M 2>/dev/null
check "cp-worker without --listen exits 2" "$?" "2"
"$B" cp-worker --listen nonsense --model $M 2>/dev/null
check "malformed --listen exits 2" "$?" "2"
"$B" generate --model $M --tokens 5 -n 1 --cp-workers "no-port" --log-level error 2>/dev/null >/dev/null
check "malformed --cp-workers exits 1" "$?" "1"
"$B" generate --model $M --tokens 5 -n 1 --cp-workers "$CP" --cp-min-tokens 0 2>/dev/null >/dev/null
check "--cp-min-tokens 0 exits 2" "$?" "2"
exit $fail
