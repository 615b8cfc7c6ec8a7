#!/usr/bin/env bash
# CLI test: deepinfer expert-worker on a free port, and generate / logits with --ep-workers giving
# byte-identical output to the single process; a worker that goes away fails the run with a
# message naming it; bad options are usage errors.
# Usage: test_ep_cli.sh PATH/TO/deepinfer   (run from the source root by ctest)
source "$(dirname "$0")/lib.sh" "$@" # B, check, fail, T (removed at exit), W, start_worker
M=tests/data/fixtures/tiny/official
ids=$(seq -s, 3 7 350) # 50 ids < 512

start_worker expert-worker w1
P1=$PORT
start_worker expert-worker w2
P2=$PORT
EP="127.0.0.1:$P1,127.0.0.1:$P2"
check "workers listening" "$([ -n "$P1" ] && [ -n "$P2" ] && echo yes)" "yes"

g1=$("$B" generate --model $M --tokens 5,17,300 -n 12 --no-stop --threads 1 --log-level error)
g2=$("$B" generate --model $M --tokens 5,17,300 -n 12 --no-stop --threads 1 --log-level error \
    --ep-workers "$EP")
check "generate with 2 workers identical" "$g2" "$g1"
check "generate count" "$(echo "$g2" | tr ',' '\n' | wc -l)" "12"

# --ep-placement: a placement file (the format deepinfer eplb -o writes) for the fixture's 7 MoE
# layers (6 + MTP) x 8 experts over 3 ranks: expert e on rank (e + 1) % 3, expert 0 also on 0.
layer='{"expert":[0,1,2,3,4,5,6,7,0],"rank":[1,2,0,1,2,0,1,2,0]}'
layers=$layer
for _ in 2 3 4 5 6 7; do layers="$layers,$layer"; done
printf '{"format":"deepinfer-ep-placement","version":1,"n_layers":7,"n_expert":8,"n_ranks":3,"n_slots":9,"layers":[%s]}\n' \
    "$layers" >"$T/p.json"
g3=$("$B" generate --model $M --tokens 5,17,300 -n 12 --no-stop --threads 1 --log-level error \
    --ep-workers "$EP" --ep-placement "$T/p.json")
check "generate with a placement file identical" "$g3" "$g1"
sed 's/"n_ranks":3/"n_ranks":2/' "$T/p.json" >"$T/p2.json"
"$B" generate --model $M --tokens 5 -n 1 --ep-workers "$EP" --ep-placement "$T/p2.json" \
    --log-level error >/dev/null 2>"$T/p2.err"
check "placement of another shape exits 1" "$?" "1"
check "placement error says why" "$(grep -c 'placement' "$T/p2.err")" "1"
"$B" generate --model $M --tokens 5 -n 1 --ep-placement "$T/p.json" --log-level error \
    >/dev/null 2>&1
check "placement without workers exits 1" "$?" "1"
"$B" logits --model $M --tokens "$ids" --out "$T/a.npy" --mtp-out "$T/am.npy" --threads 1 \
    --precision official --log-level error
"$B" expert-worker --listen 127.0.0.1:0 --model $M --threads 1 --precision official \
    --log-level error >"$T/w3.out" 2>/dev/null &
W+=($!)
for _ in $(seq 100); do grep -q '^listening' "$T/w3.out" 2>/dev/null && break; sleep 0.05; done
P3=$(sed -n 's/^listening on .*:\([0-9]*\)$/\1/p' "$T/w3.out")
"$B" logits --model $M --tokens "$ids" --out "$T/b.npy" --mtp-out "$T/bm.npy" --threads 1 \
    --precision official --ep-workers "127.0.0.1:$P3" --log-level error
check "official logits with a worker identical" "$(cmp "$T/a.npy" "$T/b.npy" && echo same)" "same"
check "official MTP logits identical" "$(cmp "$T/am.npy" "$T/bm.npy" && echo same)" "same"

# A model mismatch (fp32 front, official worker) is refused, naming both sides.
"$B" generate --model $M --tokens 5,17 -n 2 --ep-workers "127.0.0.1:$P3" --log-level error \
    >/dev/null 2>"$T/mm.err"
check "mismatch exits 1" "$?" "1"
check "mismatch names both sides" "$(grep -c 'model mismatch: the front runs .*fp32.*this worker runs .*official' "$T/mm.err")" "1"

# The worker stops on SIGTERM; a front then cannot start (the worker is named).
kill -TERM "${W[0]}"
wait "${W[0]}"
check "worker exits 0 on SIGTERM" "$?" "0"
"$B" generate --model $M --tokens 5,17 -n 2 --ep-workers "$EP" --log-level error >/dev/null \
    2>"$T/down.err"
check "worker down exits 1" "$?" "1"
check "worker down named" "$(grep -q "worker 127.0.0.1:$P1 (rank 1) is unreachable" "$T/down.err" && echo yes)" "yes"

# Usage errors.
"$B" expert-worker --model $M 2>/dev/null
check "expert-worker without --listen exits 2" "$?" "2"
"$B" expert-worker --listen nonsense --model $M 2>/dev/null
check "malformed --listen exits 2" "$?" "2"
"$B" generate --model $M --tokens 5 -n 1 --ep-workers "no-port" --log-level error 2>/dev/null >/dev/null
check "malformed --ep-workers exits 1" "$?" "1"
exit $fail
