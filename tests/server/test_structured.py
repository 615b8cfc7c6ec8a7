"""Structured output (docs/structured-output.md) against `deepinfer serve` on the tiny random-weight
model: the grammar, not the weights, makes the answer valid. Chat response_format json_schema
(non-streaming, streaming, the openai SDK's pydantic parse), json_object, Responses text.format,
the regex and grammar extensions, thinking mode (the reasoning stays free), and 400s for invalid
schemas, regexes and grammars."""
import json
import re
from typing import Literal

import openai
import pydantic
import pytest

from conftest import MODEL, post

NO_THINK = {"thinking": {"type": "disabled"}}
U = [{"role": "system", "content": "Reply in JSON."}, {"role": "user", "content": "Describe a person."}]

# Every value is bounded, so a random model always completes the document within max_tokens.
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "ok": {"type": "boolean"},
        "color": {"enum": ["red", "green", "blue"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 3}, "maxItems": 2},
    },
    "required": ["name", "age", "ok"],
    "additionalProperties": False,
}


def check_person(doc):
    """The document satisfies SCHEMA (checked by hand, no validator dependency)."""
    assert isinstance(doc, dict)
    assert set(doc) <= {"name", "age", "ok", "color", "tags"}
    assert {"name", "age", "ok"} <= set(doc)
    assert isinstance(doc["name"], str) and len(doc["name"]) <= 8
    assert isinstance(doc["age"], int) and not isinstance(doc["age"], bool)
    assert 0 <= doc["age"] <= 120
    assert isinstance(doc["ok"], bool)
    if "color" in doc:
        assert doc["color"] in ("red", "green", "blue")
    if "tags" in doc:
        assert isinstance(doc["tags"], list) and len(doc["tags"]) <= 2
        assert all(isinstance(t, str) and len(t) <= 3 for t in doc["tags"])


def rf_schema(strict=True):
    return {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA,
                                                    "strict": strict}}


def test_grammar_cache_shares_a_schema(server):
    """A response format seen before is found compiled (its token sets shared): the second of two
    identical requests is a cache hit and compiles nothing."""
    def ask():
        st, _, r = post(server, "/v1/chat/completions", {
            "model": MODEL, "messages": U, "response_format": rf_schema(), "max_tokens": 400,
            "seed": 7, **NO_THINK})
        assert st == 200, r
        check_person(json.loads(r["choices"][0]["message"]["content"]))
    ask()
    m1 = server.metrics()
    ask()
    m2 = server.metrics()
    assert m2["deepinfer:grammar_cache_hits_total"] == m1["deepinfer:grammar_cache_hits_total"] + 1
    assert m2["deepinfer:grammar_cache_misses_total"] == m1["deepinfer:grammar_cache_misses_total"]
    assert m2["deepinfer:grammar_cache_grammars"] >= 1


@pytest.fixture(scope="module")
def oai(server):
    return openai.OpenAI(base_url=server.base + "/v1", api_key="x", max_retries=0)


@pytest.mark.parametrize("seed", [1, 2])
def test_chat_json_schema_nonstream(server, seed):
    st, _, r = post(server, "/v1/chat/completions", {
        "model": MODEL, "messages": U, "response_format": rf_schema(), "max_tokens": 400,
        "seed": seed, "temperature": 0.8, **NO_THINK})
    assert st == 200, r
    c = r["choices"][0]
    assert c["finish_reason"] == "stop", c
    check_person(json.loads(c["message"]["content"]))


def test_chat_json_schema_stream(oai):
    stream = oai.chat.completions.create(model=MODEL, messages=U, response_format=rf_schema(False),
                                         max_tokens=400, seed=7, stream=True, extra_body=NO_THINK)
    text, finish = "", None
    for chunk in stream:
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
            finish = chunk.choices[0].finish_reason or finish
    assert finish == "stop"
    check_person(json.loads(text))


class Pick(pydantic.BaseModel):
    color: Literal["red", "green", "blue"]
    count: int
    ok: bool


def test_sdk_pydantic_parse(oai):
    parse = getattr(oai.chat.completions, "parse", None) or oai.beta.chat.completions.parse
    r = parse(model=MODEL, messages=U, response_format=Pick, max_tokens=200, seed=3,
              extra_body=NO_THINK)
    p = r.choices[0].message.parsed
    assert isinstance(p, Pick) and p.color in ("red", "green", "blue")


def test_chat_json_object(server):
    st, _, r = post(server, "/v1/chat/completions", {
        "model": MODEL, "messages": U, "response_format": {"type": "json_object"},
        "max_tokens": 60, "seed": 5, **NO_THINK})
    assert st == 200, r
    c = r["choices"][0]
    content = c["message"]["content"]
    assert content.lstrip().startswith("{")  # enforced from the first token
    if c["finish_reason"] == "stop":
        assert isinstance(json.loads(content), dict)


def test_responses_text_format_json_schema(server):
    fmt = {"type": "json_schema", "name": "person", "schema": SCHEMA, "strict": True}
    st, _, r = post(server, "/v1/responses", {
        "model": MODEL, "input": "Describe a person.", "text": {"format": fmt},
        "max_output_tokens": 400, **NO_THINK})
    assert st == 200, r
    assert r["status"] == "completed", r
    assert r["text"]["format"]["type"] == "json_schema"
    msg = [o for o in r["output"] if o["type"] == "message"][0]
    check_person(json.loads(msg["content"][0]["text"]))


def test_regex_extension(server):
    st, _, r = post(server, "/v1/chat/completions", {
        "model": MODEL, "messages": U, "max_tokens": 40, "seed": 2,
        "response_format": {"type": "regex", "regex": "[0-9]{3}-[a-z]{2}( [A-Z])?"}, **NO_THINK})
    assert st == 200, r
    c = r["choices"][0]
    assert c["finish_reason"] == "stop"
    assert re.fullmatch(r"[0-9]{3}-[a-z]{2}( [A-Z])?", c["message"]["content"])


def test_grammar_extension_stream(server):
    st, _, text = post(server, "/v1/chat/completions", {
        "model": MODEL, "messages": U, "max_tokens": 40, "stream": True,
        "response_format": {"type": "grammar",
                            "grammar": 'root ::= ("yes" | "no") ", " [a-c]{2}'}, **NO_THINK})
    assert st == 200
    content = ""
    for line in text.splitlines():
        if line.startswith("data: {"):
            d = json.loads(line[6:])
            if d["choices"]:
                content += d["choices"][0]["delta"].get("content") or ""
    assert re.fullmatch(r"(yes|no), [a-c]{2}", content), content


def test_thinking_mode_reasoning_is_free(server):
    # Thinking mode (the default): the constraint starts after </think>, so the reasoning is
    # whatever the model writes (a random model does not reach </think> within 12 tokens).
    st, _, r = post(server, "/v1/chat/completions", {
        "model": MODEL, "messages": U, "response_format": rf_schema(), "max_tokens": 12,
        "seed": 4})
    assert st == 200, r
    m = r["choices"][0]["message"]
    assert m.get("reasoning_content")
    assert not m.get("content")
    assert r["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize("fmt,needle", [
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"a": {"not": {}}}}}},
     "keyword 'not' is not supported"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "string", "format": "uri"}}}, "format 'uri' is not supported"),
    ({"type": "json_schema", "json_schema": {"schema": {}}}, "json_schema.name"),
    ({"type": "regex", "regex": "(a"}, "unclosed"),
    ({"type": "regex", "regex": "(a)\\1"}, "backreferences"),
    ({"type": "grammar", "grammar": "root ::= x"}, "undefined rule 'x'"),
    ({"type": "grammar", "grammar": "root ::= root \"a\""}, "left-recursive"),
    ({"type": "yaml"}, "not supported"),
])
def test_invalid_formats_400(server, fmt, needle):
    st, _, r = post(server, "/v1/chat/completions", {
        "model": MODEL, "messages": U, "response_format": fmt, "max_tokens": 5})
    assert st == 400, r
    assert r["error"]["type"] == "invalid_request_error"
    assert r["error"]["param"] == "response_format"
    assert needle in r["error"]["message"], r["error"]["message"]


def test_responses_invalid_format_400(server):
    st, _, r = post(server, "/v1/responses", {
        "model": MODEL, "input": "x", "text": {"format": {
            "type": "json_schema", "name": "x", "schema": {"type": "array", "uniqueItems": True}}}})
    assert st == 400, r
    assert r["error"]["param"] == "text.format"
    assert "uniqueItems" in r["error"]["message"]


def test_tools_with_schema_is_a_document_or_a_call(server):
    # formerly a 400; now the answer is a valid document or a valid tool block (test_tool_grammar)
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    st, _, r = post(server, "/v1/chat/completions", {
        "model": MODEL, "messages": U, "response_format": rf_schema(), "tools": tools,
        "max_tokens": 400, "seed": 3, **NO_THINK})
    assert st == 200, r
    c = r["choices"][0]
    if c["message"].get("tool_calls"):
        assert c["finish_reason"] == "tool_calls"
        assert [k["function"]["name"] for k in c["message"]["tool_calls"]] == ["f"] * len(
            c["message"]["tool_calls"])
    else:
        assert c["finish_reason"] == "stop", c
        check_person(json.loads(c["message"]["content"]))


def test_matcher_limit_is_a_clear_500(server):
    # A grammar that only nests deeper: the matcher's depth limit (512) ends the request.
    st, _, r = post(server, "/v1/chat/completions", {
        "model": MODEL, "messages": U, "max_tokens": 600, "seed": 1,
        "response_format": {"type": "grammar", "grammar": 'root ::= "[" root "]"'}, **NO_THINK})
    assert st == 500, r
    assert "structured-output constraint" in r["error"]["message"]
