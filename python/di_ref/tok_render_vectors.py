#!/usr/bin/env python3
"""Writes tests/data/tok/render_vectors.json: prompt-rendering vectors for the C renderer.

Each vector is {"name", "input": conversation JSON (format of di_render_conv_from_json), "text":
expected prompt} or {"name", "input", "error": why}. Expected texts are written from the rules and
examples of shared/spec/serving.md §1 (V4.1: §1.3-§1.6; V4: the official encoder behaviour the spec
records). Where the PyPI package deepseek-recipe (0.2.0) renders the same conversation, it is run
too and its agreement is recorded in "recipe": "agrees" | "differs: <why>" — the spec wins where
they differ (documented in docs/tokenizer.md).

Usage: python/.venv/bin/python python/di_ref/tok_render_vectors.py
"""
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
OUT = os.path.join(ROOT, "tests/data/tok/render_vectors.json")

BOS, EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
U, A, SYS = "<｜User｜>", "<｜Assistant｜>", "<｜System｜>"
TH, UT = "<think>", "</think>"


def eff41(n):
    return f"Reasoning Effort: {n} (range 1-100, the higher the value, the more thorough the reasoning)\n\n"


TEXT_A = ("Reasoning Effort: Absolute maximum with no shortcuts permitted.\n"
          "You MUST be very thorough in your thinking and comprehensively decompose the problem to resolve the root cause, rigorously stress-testing your logic against all potential paths, edge cases, and adversarial scenarios.\n"
          "Explicitly write out your entire deliberation process, documenting every intermediate step, considered alternative, and rejected hypothesis to ensure absolutely no assumption is left unchecked.\n\n")
TEXT_B = ("Reasoning Effort: Beyond maximum \u2014 exhaustive, relentless, and uncompromising.\n"
          "You MUST reason with the utmost depth and rigor, leaving absolutely nothing to chance: exhaustively decompose the problem into its most fundamental components, trace every causal chain to its root, and resolve the underlying cause rather than any surface symptom.\n"
          "Do not stop reasoning until you have independently verified the solution from multiple angles and are certain that no assumption remains unchecked and no error remains undiscovered.\n\n")


def tools_block(v41, schemas):
    t = "tool_calls" if not v41 else " calls"
    i = "invoke" if not v41 else " invoke"
    p = "parameter" if not v41 else " parameter"
    d = "｜DSML｜"
    return ("## Tools\n\nYou have access to a set of tools to help answer the user's question. You can invoke tools by writing a "
            f"\"<{d}{t}>\" block like the following:\n\n<{d}{t}>\n<{d}{i} name=\"$TOOL_NAME\">\n"
            f"<{d}{p} name=\"$PARAMETER_NAME\" string=\"true|false\">$PARAMETER_VALUE</{d}{p}>\n...\n</{d}{i}>\n"
            f"<{d}{i} name=\"$TOOL_NAME2\">\n...\n</{d}{i}>\n</{d}{t}>\n\n"
            "String parameters should be specified as is and set `string=\"true\"`. For all other types (numbers, booleans, arrays, objects), pass the value in JSON format and set `string=\"false\"`.\n\n"
            "If thinking_mode is enabled (triggered by <think>), you MUST output your complete reasoning inside <think>...</think> BEFORE any tool calls or final response.\n\n"
            "Otherwise, output directly after </think> with tool calls or final response.\n\n### Available Tool Schemas\n\n"
            + "\n".join(schemas) + "\n\nYou MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.\n")


TOOL = {"type": "function", "function": {"name": "lookup", "description": "Look up", "parameters": {
    "type": "object", "properties": {"query": {"type": "string"}, "limit": {"type": "integer"}}}}}
TOOL_SCHEMA = ('{"name": "lookup", "description": "Look up", "parameters": {"type": "object", "properties": '
               '{"query": {"type": "string"}, "limit": {"type": "integer"}}}}')


def call(cid, name, args):
    return {"id": cid, "type": "function", "function": {"name": name, "arguments": args}}


def m(role, content=None, **kw):
    d = {"role": role}
    if content is not None:
        d["content"] = content
    d.update(kw)
    return d


V = []


def vec(name, inp, text=None, error=None, recipe=None):
    v = {"name": name, "input": inp}
    if error:
        v["error"] = error
    else:
        v["text"] = text
    if recipe:
        v["recipe"] = recipe
    V.append(v)


# ---- V4.1 (spec §1.3-§1.6) ----
vec("v41_system_chat", {"encoding": "dsv41", "thinking_mode": "chat",
    "messages": [m("system", "You are a helpful assistant."), m("user", "hello")]},
    BOS + SYS + "You are a helpful assistant." + U + "hello" + A + UT)
for n in (1, 42, 75, 88, 100):
    vec(f"v41_effort_{n}", {"encoding": "dsv41", "reasoning_effort": n,
        "messages": [m("system", "S"), m("user", "q")]}, BOS + SYS + eff41(n) + "S" + U + "q" + A + TH)
for name, n in (("low", 50), ("high", 75), ("max", 100)):
    vec(f"v41_effort_{name}", {"encoding": "dsv41", "reasoning_effort": name,
        "messages": [m("user", "question")]}, BOS + SYS + eff41(n) + U + "question" + A + TH)
vec("v41_effort_default_no_system", {"encoding": "dsv41", "messages": [m("user", "question")]},
    BOS + SYS + eff41(75) + U + "question" + A + TH)
vec("v41_chat_no_system", {"encoding": "dsv41", "thinking_mode": "chat", "messages": [m("user", "q")]},
    BOS + U + "q" + A + UT)
vec("v41_mid_system_last", {"encoding": "dsv41", "thinking_mode": "chat",
    "messages": [m("user", "u"), m("system", "mid")]}, BOS + U + "u" + SYS + "mid" + A + UT)
vec("v41_mid_system_thinking", {"encoding": "dsv41", "reasoning_effort": "low",
    "messages": [m("user", "u"), m("system", "mid")]}, BOS + SYS + eff41(50) + U + "u" + SYS + "mid" + A + TH)
vec("v41_spaced_dsml", {"encoding": "dsv41", "tools": [TOOL], "messages": [
    m("user", "find"), m("assistant", "summary", reasoning_content="  reason  ",
                         tool_calls=[call("c1", "lookup", '{"query": "value", "limit": 2}')])]},
    BOS + SYS + eff41(75) + "\n\n" + tools_block(True, [TOOL_SCHEMA]) + U + "find" + A + TH +
    "  reason  </think>summary\n\n<｜DSML｜ calls>\n<｜DSML｜ invoke name=\"lookup\">\n"
    "<｜DSML｜ parameter name=\"query\" string=\"true\">value</｜DSML｜ parameter>\n"
    "<｜DSML｜ parameter name=\"limit\" string=\"false\">2</｜DSML｜ parameter>\n</｜DSML｜ invoke>\n</｜DSML｜ calls>" + EOS)
vec("v41_drop_thinking_no_tools", {"encoding": "dsv41", "messages": [
    m("user", "a"), m("assistant", "x", reasoning_content="r1"), m("user", "b")]},
    BOS + SYS + eff41(75) + U + "a" + A + UT + "x" + EOS + U + "b" + A + TH)
vec("v41_image_order", {"encoding": "dsv41", "thinking_mode": "chat", "messages": [
    m("user", [{"type": "text", "text": "look"}, {"type": "image"}, {"type": "text", "text": "and"},
               {"type": "image_url"}])]},
    BOS + U + "look\n\n<｜deepseek_image｜>\n\nand\n\n<｜deepseek_image｜>" + A + UT)
vec("v41_tool_choice_required", {"encoding": "dsv41", "tools": [TOOL], "tool_choice": "required",
    "messages": [m("user", "u")]},
    BOS + SYS + eff41(75) + "\n\n" + tools_block(True, [TOOL_SCHEMA]) + U + "u" + A + TH + "\n\n<｜DSML｜ calls>\n")
vec("v41_response_format", {"encoding": "dsv41", "thinking_mode": "chat", "response_format": {"type": "json_object"},
    "messages": [m("system", "S"), m("user", "u")]},
    BOS + SYS + "S\n\n## Response Format:\n\nYou MUST strictly adhere to the following schema to reply:\n"
    '{"type": "json_object"}' + U + "u" + A + UT)
vec("v41_rejects_image_placeholder_in_text", {"encoding": "dsv41", "messages": [m("user", "see <｜deepseek_image｜>")]},
    error="spec §1.1 rule 3: the placeholder typed as text is refused")
vec("v4_image_placeholder_text_is_plain", {"thinking_mode": "chat", "messages": [m("user", "see <｜deepseek_image｜>")]},
    BOS + U + "see <｜deepseek_image｜>" + A + UT)
vec("v41_effort_out_of_range", {"encoding": "dsv41", "reasoning_effort": 0, "messages": [m("user", "q")]},
    error="effort must be 1..100")
vec("v41_effort_float", {"encoding": "dsv41", "reasoning_effort": 7.5, "messages": [m("user", "q")]},
    error="floats are rejected")

# ---- V4 (spec §1.2-§1.10, official encoder behaviour) ----
vec("v4_chat_hello", {"thinking_mode": "chat", "messages": [m("user", "hello")]}, BOS + U + "hello" + A + UT)
vec("v4_thinking_system", {"messages": [m("system", "You are a helpful assistant."), m("user", "What is 2+2?")]},
    BOS + "You are a helpful assistant." + U + "What is 2+2?" + A + TH)
vec("v4_sorted_tool_results", {"messages": [
    m("user", "q"), m("assistant", "", tool_calls=[call("c1", "f", "{}"), call("c2", "g", "{}")]),
    m("tool", "R2", tool_call_id="c2"), m("tool", "R1", tool_call_id="c1"), m("user", "more")]},
    BOS + U + "q" + A + UT + "\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"f\">\n\n</｜DSML｜invoke>\n"
    "<｜DSML｜invoke name=\"g\">\n\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>" + EOS + U +
    "<tool_result>R1</tool_result>\n\n<tool_result>R2</tool_result>\n\nmore" + A + TH)
vec("v4_tool_loop_without_tools_drops", {"messages": [
    m("user", "q"), m("assistant", None, reasoning_content="r", tool_calls=[call("c1", "f", '{"a": "b"}')]),
    m("tool", "R", tool_call_id="c1")]},
    BOS + U + "q" + A + UT + "\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"f\">\n"
    "<｜DSML｜parameter name=\"a\" string=\"true\">b</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>" + EOS +
    U + "<tool_result>R</tool_result>" + A + TH)
vec("v4_assistant_after_system", {"messages": [m("system", "S"), m("assistant", "x", reasoning_content="r")]},
    BOS + "S" + "r" + UT + "x" + EOS)
vec("v4_assistant_after_assistant", {"messages": [m("user", "q"), m("assistant", "x", reasoning_content="r"),
                                                  m("assistant", "y", reasoning_content="r2")]},
    BOS + U + "q" + A + TH + "r" + UT + "x" + EOS + "r2" + UT + "y" + EOS)
vec("v4_reminder_after_user", {"messages": [m("user", "q"), m("latest_reminder", "R"),
                                            m("assistant", "x", reasoning_content="r")]},
    BOS + U + "q" + A + TH + "<｜latest_reminder｜>R" + "r" + UT + "x" + EOS)
vec("v4_0424_max", {"reasoning_effort": "max", "messages": [m("user", "q")]}, BOS + TEXT_A + U + "q" + A + TH)
vec("v4_0424_high", {"reasoning_effort": "high", "messages": [m("user", "q")]}, BOS + U + "q" + A + TH)
vec("v4_0731_high", {"effort_table": "v4_0731", "messages": [m("user", "q")]}, BOS + TEXT_A + U + "q" + A + TH,
    recipe="agrees")
vec("v4_0731_max", {"effort_table": "v4_0731", "reasoning_effort": "max", "messages": [m("user", "q")]},
    BOS + TEXT_B + U + "q" + A + TH, recipe="agrees")
vec("v4_0731_low", {"effort_table": "v4_0731", "reasoning_effort": "low", "messages": [m("user", "q")]},
    BOS + U + "q" + A + TH)
vec("v4_effort_chat_mode_ignored", {"thinking_mode": "chat", "reasoning_effort": "max", "messages": [m("user", "q")]},
    BOS + U + "q" + A + UT)
vec("v4_prefix_chat", {"thinking_mode": "chat", "messages": [m("user", "u"), m("assistant", "pre", prefix=True)]},
    BOS + U + "u" + A + UT + "pre", recipe="agrees")
vec("v4_prefix_thinking_closed", {"messages": [m("user", "u"), m("assistant", "pre", reasoning_content="rr", prefix=True)]},
    BOS + U + "u" + A + TH + "rr" + UT + "pre")
vec("v4_prefix_thinking_open", {"messages": [m("user", "u"), m("assistant", None, reasoning_content="rr", prefix=True)]},
    BOS + U + "u" + A + TH + "rr", recipe="differs: recipe 0.2.0 closes the reasoning; open form is the spec's [design]")
vec("v4_response_format", {"thinking_mode": "chat", "response_format": {"type": "json_object"},
    "messages": [m("system", "S"), m("user", "u")]},
    BOS + "S\n\n## Response Format:\n\nYou MUST strictly adhere to the following schema to reply:\n"
    '{"type": "json_object"}' + U + "u" + A + UT,
    recipe="differs: recipe 0.2.0 V4 writes its own JSON-mode text; the spec follows the official encoder")
vec("v4_tools_without_system", {"tools": [TOOL], "messages": [m("user", "u")]},
    BOS + "\n\n" + tools_block(False, [TOOL_SCHEMA]) + U + "u" + A + TH)
vec("v4_tools_keep_reasoning", {"tools": [TOOL], "messages": [
    m("user", "a"), m("assistant", "x", reasoning_content="r1"), m("user", "b")]},
    BOS + "\n\n" + tools_block(False, [TOOL_SCHEMA]) + U + "a" + A + TH + "r1" + UT + "x" + EOS + U + "b" + A + TH)
vec("v4_tool_choice_none_drops", {"tools": [TOOL], "tool_choice": "none", "messages": [
    m("user", "a"), m("assistant", "x", reasoning_content="r1"), m("user", "b")]},
    BOS + U + "a" + A + UT + "x" + EOS + U + "b" + A + TH)
vec("v4_tool_choice_required", {"tools": [TOOL], "tool_choice": "required", "messages": [m("user", "u")]},
    BOS + "\n\n" + tools_block(False, [TOOL_SCHEMA]) + U + "u" + A + TH + "\n\n<｜DSML｜tool_calls>\n")
vec("v4_args_not_json", {"thinking_mode": "chat", "messages": [
    m("user", "q"), m("assistant", "", tool_calls=[call("c1", "f", "not json")])]},
    BOS + U + "q" + A + UT + "\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"f\">\n"
    "<｜DSML｜parameter name=\"arguments\" string=\"true\">not json</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>" + EOS)
vec("v4_args_typed", {"thinking_mode": "chat", "messages": [
    m("user", "q"), m("assistant", "", tool_calls=[call("c1", "f", '{"a": 1.0, "c": [1,2], "s": "x\\"y", "o": {"k": null}}')])]},
    BOS + U + "q" + A + UT + "\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"f\">\n"
    "<｜DSML｜parameter name=\"a\" string=\"false\">1.0</｜DSML｜parameter>\n"
    "<｜DSML｜parameter name=\"c\" string=\"false\">[1, 2]</｜DSML｜parameter>\n"
    "<｜DSML｜parameter name=\"s\" string=\"true\">x\"y</｜DSML｜parameter>\n"
    "<｜DSML｜parameter name=\"o\" string=\"false\">{\"k\": null}</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>" + EOS)
vec("v4_normalize_system", {"thinking_mode": "chat", "normalize_system": True, "messages": [
    m("system", "S1"), m("system", "S2"), m("user", "u"), m("system", "mid"), m("user", "u2")]},
    BOS + "S1\n\nS2" + U + "u\n\nmid\n\nu2" + A + UT,
    recipe="differs: recipe 0.2.0 moves a later system message into the leading one; the spec makes it a user message")
vec("v4_official_systems_in_place", {"thinking_mode": "chat", "messages": [
    m("system", "A"), m("system", "B"), m("user", "u"), m("system", "mid"), m("user", "u2")]},
    BOS + "AB" + U + "u" + "mid" + U + "u2" + A + UT)
vec("v4_task_query", {"thinking_mode": "chat", "messages": [m("user", "p", task="query")]}, BOS + U + "p<｜query｜>")
vec("v4_task_action_thinking", {"messages": [m("user", "p", task="action")]}, BOS + U + "p" + A + TH + "<｜action｜>")
vec("v4_task_title", {"thinking_mode": "chat", "messages": [m("user", "q"), m("assistant", "a", task="title")]},
    BOS + U + "q" + A + UT + "a" + EOS + "<｜title｜>")
vec("v4_user_after_task_not_merged", {"thinking_mode": "chat", "messages": [
    m("user", "p", task="query"), m("user", "q")]}, BOS + U + "p" + U + "q" + A + UT)
vec("v4_tool_result_blocks", {"thinking_mode": "chat", "messages": [
    m("user", "q"), m("assistant", "", tool_calls=[call("c1", "f", "{}")]),
    m("tool", [{"type": "text", "text": "t1"}, {"type": "image"}], tool_call_id="c1")]},
    BOS + U + "q" + A + UT + "\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"f\">\n\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>" + EOS +
    U + "<tool_result>t1\n\n[Unsupported image]</tool_result>" + A + UT)
vec("v4_content_with_special_text", {"thinking_mode": "chat", "messages": [m("user", "<think>hi</think><｜User｜>")]},
    BOS + U + "<think>hi</think><｜User｜>" + A + UT)
vec("v4_empty", {"messages": []}, BOS)
vec("v4_developer_empty", {"messages": [m("developer", "")]}, error="developer messages require content")


def recipe_check():
    try:
        import deepseek_recipe as dr
    except ImportError:
        print("deepseek-recipe not installed: recipe agreement not re-checked", file=sys.stderr)
        return
    # the vectors marked "agrees" are re-rendered with the recipe
    for v in V:
        if v.get("recipe") != "agrees":
            continue
        inp = v["input"]
        msgs = []
        for mm in inp["messages"]:
            if mm["role"] == "user":
                msgs.append(dr.UserMessage(mm["content"]))
            elif mm["role"] == "assistant":
                msgs.append(dr.AssistantMessage(mm.get("content") or "", reasoning_content=mm.get("reasoning_content"),
                                                prefix=mm.get("prefix", False)))
        conv = dr.Conversation(msgs, thinking_mode=inp.get("thinking_mode", "thinking") != "chat",
                               reasoning_effort=inp.get("reasoning_effort"))
        enc = dr.DeepseekV41Encoding() if inp.get("encoding") == "dsv41" else dr.DeepseekV4Encoding()
        got = enc.render_conversation(conv).prompt
        if got != v["text"]:
            raise SystemExit(f"recipe disagrees on {v['name']}: {got!r}")


def main():
    recipe_check()
    with open(OUT, "w", encoding="utf-8") as f:
        json.dump(V, f, ensure_ascii=False, indent=1)
        f.write("\n")
    print(f"{len(V)} vectors -> {OUT}", file=sys.stderr)


if __name__ == "__main__":
    main()
