#!/usr/bin/env bash
# CLI test: deepinfer tokenize / detokenize / render (src/tok through the public API).
# Usage: test_tok_cli.sh PATH/TO/deepinfer   (run from the source root by ctest)
source "$(dirname "$0")/lib.sh" "$@" # B, check, fail, T (removed at exit), W, start_worker

check "tokenize plain" "$("$B" tokenize '<｜User｜>hi')" "30 28217 6756 28217 32 6366"
check "special recognised" "$("$B" tokenize --special '<｜User｜>')" "128803"
check "plain text of a special token" "$("$B" tokenize '<｜User｜>' | wc -w)" "5"
printf '"Hello"\n"<think>"\n"a\\u0000b"\n' > "$T/in.jsonl"
check "file mode" "$("$B" tokenize --file "$T/in.jsonl" | head -1)" "[19923]"
check "file mode lines" "$("$B" tokenize --file "$T/in.jsonl" | wc -l)" "3"
ids=$("$B" tokenize 'Round trip: 中文 😀 ñ')
check "detokenize args" "$("$B" detokenize $ids)" "Round trip: 中文 😀 ñ"
check "detokenize stdin" "$(echo "[$ids]" | tr ' ' ',' | "$B" detokenize)" "Round trip: 中文 😀 ñ"
check "skip special" "$("$B" detokenize --skip-special 0 19923 1)" "Hello"
"$B" detokenize 129280 >/dev/null 2>&1; check "bad id exits 1" "$?" "1"
"$B" tokenize $'\xff' >/dev/null 2>&1; check "bad utf-8 exits 1" "$?" "1"
"$B" tokenize >/dev/null 2>&1; check "usage exits 2" "$?" "2"
printf '"ok"\n42\n' > "$T/bad.jsonl"
"$B" tokenize --file "$T/bad.jsonl" >/dev/null 2>&1; check "bad jsonl line exits 1" "$?" "1"

echo '{"messages":[{"role":"system","content":"S"},{"role":"user","content":"hi"}],"thinking":{"type":"disabled"}}' > "$T/chat.json"
check "render chat" "$("$B" render --request "$T/chat.json")" "<｜begin▁of▁sentence｜>S<｜User｜>hi<｜Assistant｜></think>
ids: 0 53 128803 6366 128804 128822"
echo '{"system":"S","messages":[{"role":"user","content":[{"type":"text","text":"hi"}]}],"max_tokens":5}' > "$T/msg.json"
check "render messages" "$("$B" render --api messages --request "$T/msg.json" --ids-only)" "ids: 0 53 128803 6366 128804 128821"
echo '{"instructions":"S","input":"hi","reasoning":{"effort":"high"}}' > "$T/resp.json"
check "render responses" "$("$B" render --api responses --request "$T/resp.json" --ids-only)" "ids: 0 53 128803 6366 128804 128821"
SH=${DI_SHARED_DIR:-../shared}/reference/deepseek-v4-flash/encoding-tests
if [ -f "$SH/test_input_2.json" ]; then
    got=$("$B" render --api raw --official --request "$SH/test_input_2.json" | head -n -1)
    check "render official vector 2" "$got" "$(cat "$SH/test_output_2.txt")"
fi
"$B" render --request /nonexistent.json >/dev/null 2>&1; check "missing request exits 1" "$?" "1"
echo 'not json' > "$T/bad.json"
"$B" render --request "$T/bad.json" >/dev/null 2>&1; check "bad request exits 1" "$?" "1"
"$B" render --encoding dsv41 --request "$T/chat.json" >/dev/null 2>&1
check "dsv41 ids need the V4.1 tokenizer" "$?" "1"
exit $fail
