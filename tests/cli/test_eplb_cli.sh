#!/usr/bin/env bash
# CLI test: deepinfer eplb plans a placement from a load file, keeps it when re-planned against it
# (0 moves), counts the front's shared-expert load on rank 0 by default, refuses bad input with a clear message and exit status, and --bench prints its table.
# Usage: test_eplb_cli.sh PATH/TO/deepinfer   (run from the source root by ctest)
source "$(dirname "$0")/lib.sh" "$@" # B, check, fail, T (removed at exit), W, start_worker

# 2 layers of 8 experts; expert 3 of layer 0 and expert 6 of layer 1 are hot.
cat > "$T/load.json" <<'J'
{"format":"deepinfer-expert-load","version":1,"n_layers":2,"n_expert":8,
 "rows":[500,500],
 "load":[[100,100,100,400,100,100,50,50],[60,60,60,60,60,60,580,60]]}
J
out=$("$B" eplb --load "$T/load.json" --ranks 4 --slots-per-rank 3 --front-shared 0 -o "$T/p.json")
check "plan exits 0" "$?" "0"
check "plan shape line" "$(echo "$out" | grep -c '2 layers, 8 experts, 4 ranks x 3 slots (4 redundant replicas per layer), 2000 routed pairs')" "1"
# contiguous: layer 0 ranks get {200,500,200,100} of 1000 -> 2.0; layer 1 {120,120,120,640} -> 2.56
check "contiguous balance" "$(echo "$out" | grep -o 'contiguous [0-9.]*' | tail -1)" "contiguous 2.2800"
bal=$(echo "$out" | grep -o 'eplb [0-9.]*' | tail -1 | cut -d' ' -f2)
check "eplb balance below 1.1" "$(awk -v b="$bal" 'BEGIN { print (b < 1.1) ? "yes" : "no" }')" "yes"
check "placement written" "$(head -c 63 "$T/p.json")" '{"format":"deepinfer-ep-placement","version":1,"n_layers":2,"n_'
out=$("$B" eplb --load "$T/load.json" --ranks 4 --slots-per-rank 3 --front-shared 0 --current "$T/p.json" -o "$T/q.json")
check "replan exits 0" "$?" "0"
check "replan moves nothing" "$(echo "$out" | grep -c "moves against $T/p.json: 0 of 24 replicas, 0 of 2 layers changed")" "1"
check "replan writes the same placement" "$(cmp "$T/p.json" "$T/q.json" && echo same)" "same"
check "replan not worth applying" "$(echo "$out" | grep -c 'worth applying: no (balance')" "1"
# From the placement without redundant slots to the one with them: worth applying.
"$B" eplb --load "$T/load.json" --ranks 4 --slots-per-rank 2 --front-shared 0 -o "$T/two.json" >/dev/null
out=$("$B" eplb --load "$T/load.json" --ranks 4 --slots-per-rank 3 --front-shared 0 --current "$T/two.json")
check "redundancy worth applying" "$(echo "$out" | grep -c 'worth applying: yes (balance 2.1800 -> ')" "1"
out=$("$B" eplb --load "$T/load.json" --ranks 4 --slots-per-rank 3 --front-shared 0 --current "$T/two.json" --min-gain 5)
check "min gain above the gain" "$(echo "$out" | grep -c 'worth applying: no')" "1"
# The default --front-shared 1: rank 0 (the front) also computes the shared expert of each of the
# 500 rows of a layer. Contiguous: layer 0 {200+500,500,200,100}, layer 1 {120+500,120,120,640},
# mean 375 each -> (700 + 640) / 750 = 1.7867. The plan gives the front its lightest replicas and
# no copy of a hot expert that another rank can take below the front's load.
out=$("$B" eplb --load "$T/load.json" --ranks 4 --slots-per-rank 3 -o "$T/f.json")
check "front plan exits 0" "$?" "0"
check "front contiguous balance" "$(echo "$out" | grep -o 'contiguous [0-9.]*' | tail -1)" "contiguous 1.7867"
check "front eplb balance" "$(echo "$out" | grep -o 'eplb [0-9.]*' | tail -1)" "eplb 1.7733"
check "front holds no hot expert" "$(python3 -c "
import json; p = json.load(open('$T/f.json'))
hot = (3, 6)  # of layer 0, of layer 1
print(sum(e == hot[i] for i, l in enumerate(p['layers']) for e, r in zip(l['expert'], l['rank']) if r == 0))")" "0"
"$B" eplb --load "$T/load.json" --ranks 4 --slots-per-rank 3 --front-shared -1 2>/dev/null; check "bad --front-shared exits 2" "$?" "2"

# bad input: clear message and non-zero status, never a crash
"$B" eplb --ranks 4 --slots-per-rank 3 2>"$T/err"; check "missing --load exits 2" "$?" "2"
check "missing --load says so" "$(grep -c 'are required' "$T/err")" "1"
"$B" eplb --load "$T/load.json" --ranks 2 --slots-per-rank 3 2>"$T/err"; check "too few slots exit 2" "$?" "2"
check "too few slots say so" "$(grep -c 'cannot hold 8 experts' "$T/err")" "1"
"$B" eplb --load "$T/load.json" --ranks 0 --slots-per-rank 3 2>/dev/null; check "bad --ranks exits 2" "$?" "2"
"$B" eplb --load "$T/load.json" --ranks 4 --slots-per-rank 3 --tolerance x 2>/dev/null; check "bad --tolerance exits 2" "$?" "2"
"$B" eplb --load "$T/load.json" --ranks 4 --slots-per-rank 3 --min-gain -1 2>/dev/null; check "bad --min-gain exits 2" "$?" "2"
"$B" eplb --load "$T/load.json" --ranks 4 --slots-per-rank 3 --frobnicate 1 2>/dev/null; check "unknown option exits 2" "$?" "2"
"$B" eplb --load "$T/none.json" --ranks 4 --slots-per-rank 3 2>"$T/err"; check "missing file exits 1" "$?" "1"
check "missing file says so" "$(grep -c 'cannot open' "$T/err")" "1"
sed 's/"rows":\[500,500\]/"rows":[500]/' "$T/load.json" > "$T/bad.json"
"$B" eplb --load "$T/bad.json" --ranks 4 --slots-per-rank 3 2>"$T/err"; check "malformed load exits 1" "$?" "1"
check "malformed load says why" "$(grep -c '"rows" has 1 entries, expected 2' "$T/err")" "1"
echo '{"format":"deepinfer-ep-placement","version":1}' > "$T/badp.json"
"$B" eplb --load "$T/load.json" --ranks 4 --slots-per-rank 3 --current "$T/badp.json" 2>"$T/err"; check "malformed placement exits 1" "$?" "1"
check "malformed placement says why" "$(grep -c '"n_layers" is missing' "$T/err")" "1"
"$B" eplb --load "$T/load.json" --ranks 4 --slots-per-rank 3 -o "$T/no/such/dir.json" >/dev/null 2>"$T/err"; check "unwritable output exits 1" "$?" "1"

out=$("$B" eplb --bench --layers 2 --experts 64)
check "bench exits 0" "$?" "0"
check "bench table" "$(echo "$out" | grep -c '^| 1.0 | 16 | ')" "4"
exit $fail
