"""Grammar-enforced tool calls (docs/server.md "Tool calls", docs/structured-output.md) against
`deepinfer serve` on the tiny random-weight model: with random weights only the grammar makes the
calls valid. A named or forced tool_choice returns tool calls whose arguments parse and satisfy
the tool's schema, in Chat, Responses and Anthropic Messages, streaming and not; parallel tool
calls disabled gives exactly one call; a constrained response format together with tools
(tool_choice auto) answers either a valid document or a valid call."""
import json

import anthropic
import openai
import pytest

from conftest import MODEL, post

NO_THINK = {"thinking": {"type": "disabled"}}
U = [{"role": "user", "content": "What is the weather in Paris?"}]

# Bounded parameters (an enum string as raw text, a JSON string with maxLength, an integer range, an
# optional nested object), so a random model closes the block within max_tokens.
WEATHER = {
    "type": "object",
    "properties": {
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        "city": {"type": "string", "maxLength": 8},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
        "opts": {"type": "object", "properties": {"hourly": {"type": "boolean"}},
                 "required": ["hourly"], "additionalProperties": False},
    },
    "required": ["unit", "city", "days"],
    "additionalProperties": False,
}
TIME = {
    "type": "object",
    "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}},
    "required": ["zone"],
}
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
CHAT_TOOLS = [{"type": "function", "function": {"name": n, "parameters": s}}
              for n, s in SCHEMAS.items()]
RESP_TOOLS = [{"type": "function", "name": n, "parameters": s} for n, s in SCHEMAS.items()]
MSG_TOOLS = [{"name": n, "input_schema": s} for n, s in SCHEMAS.items()]


def check_args(name, args):
    """args (a dict) satisfies the schema of tool `name` (checked by hand)."""
    assert name in SCHEMAS, name
    assert isinstance(args, dict), args
    if name == "get_time":
        assert set(args) == {"zone"} and args["zone"] in ("UTC", "CET"), args
        return
    assert {"unit", "city", "days"} <= set(args) <= {"unit", "city", "days", "opts"}, args
    assert args["unit"] in ("celsius", "fahrenheit")
    assert isinstance(args["city"], str) and len(args["city"]) <= 8
    assert isinstance(args["days"], int) and not isinstance(args["days"], bool)
    assert 1 <= args["days"] <= 7
    if "opts" in args:
        assert set(args["opts"]) == {"hourly"} and isinstance(args["opts"]["hourly"], bool)


@pytest.fixture(scope="module")
def oai(server):
    return openai.OpenAI(base_url=server.base + "/v1", api_key="x", max_retries=0)


@pytest.fixture(scope="module")
def ant(server):
    return anthropic.Anthropic(base_url=server.base, api_key="x", max_retries=0)


def chat(server, **kw):
    body = {"model": MODEL, "messages": U, "tools": CHAT_TOOLS, "max_tokens": 600, **kw}
    st, _, r = post(server, "/v1/chat/completions", body)
    assert st == 200, r
    return r["choices"][0]


@pytest.mark.parametrize("seed,think", [(1, False), (2, False), (3, True)])
def test_chat_named(server, seed, think):
    c = chat(server, tool_choice={"type": "function", "function": {"name": "get_weather"}},
             seed=seed, temperature=1.0, **({} if think else NO_THINK))
    assert c["finish_reason"] == "tool_calls", c
    calls = c["message"]["tool_calls"]
    assert len(calls) >= 1
    for k in calls:
        assert k["type"] == "function" and k["function"]["name"] == "get_weather"
        check_args("get_weather", json.loads(k["function"]["arguments"]))
    assert not c["message"].get("content")


@pytest.mark.parametrize("seed", [4, 5, 6])
def test_chat_required_not_parallel(server, seed):
    c = chat(server, tool_choice="required", parallel_tool_calls=False, seed=seed,
             temperature=1.0, **NO_THINK)
    assert c["finish_reason"] == "tool_calls", c
    calls = c["message"]["tool_calls"]
    assert len(calls) == 1, calls  # the grammar ends after the first invoke
    check_args(calls[0]["function"]["name"], json.loads(calls[0]["function"]["arguments"]))


def test_chat_required_parallel(server):
    c = chat(server, tool_choice="required", seed=11, temperature=1.0, max_tokens=1500, **NO_THINK)
    assert c["finish_reason"] == "tool_calls", c
    calls = c["message"]["tool_calls"]
    assert len(calls) >= 1
    assert len({k["id"] for k in calls}) == len(calls)
    for k in calls:
        check_args(k["function"]["name"], json.loads(k["function"]["arguments"]))


def test_chat_named_stream(oai):
    s = oai.chat.completions.create(
        model=MODEL, messages=U, tools=CHAT_TOOLS, max_tokens=600, stream=True, seed=8,
        tool_choice={"type": "function", "function": {"name": "get_time"}},
        parallel_tool_calls=False, extra_body=NO_THINK)
    calls, finish, content = {}, None, ""
    for chunk in s:
        if not chunk.choices:
            continue
        ch = chunk.choices[0]
        content += ch.delta.content or ""
        for tc in ch.delta.tool_calls or []:
            k = calls.setdefault(tc.index, {"name": "", "args": ""})
            if tc.function and tc.function.name:
                k["name"] += tc.function.name
            if tc.function and tc.function.arguments:
                k["args"] += tc.function.arguments
        finish = ch.finish_reason or finish
    assert finish == "tool_calls"
    assert content == ""
    assert list(calls) == [0]
    assert calls[0]["name"] == "get_time"
    check_args("get_time", json.loads(calls[0]["args"]))


def test_chat_parallel_tool_calls_must_be_bool(server):
    st, _, r = post(server, "/v1/chat/completions", {
        "model": MODEL, "messages": U, "tools": CHAT_TOOLS, "parallel_tool_calls": "no"})
    assert st == 400 and r["error"]["param"] == "parallel_tool_calls", r


@pytest.mark.parametrize("stream", [False, True])
def test_responses_named(oai, stream):
    kw = dict(model=MODEL, input="Weather in Paris?", tools=RESP_TOOLS, max_output_tokens=600,
              tool_choice={"type": "function", "name": "get_weather"}, parallel_tool_calls=False,
              extra_body=NO_THINK)
    if stream:
        final = None
        for ev in oai.responses.create(stream=True, **kw):
            if ev.type == "response.completed":
                final = ev.response
        assert final is not None
        r = final
    else:
        r = oai.responses.create(**kw)
    assert r.parallel_tool_calls is False  # echoed
    calls = [o for o in r.output if o.type == "function_call"]
    assert len(calls) == 1, r.output
    assert calls[0].name == "get_weather"
    check_args("get_weather", json.loads(calls[0].arguments))
    assert not [o for o in r.output if o.type == "message"]


@pytest.mark.parametrize("choice", [{"type": "tool", "name": "get_weather"},
                                    {"type": "any", "disable_parallel_tool_use": True}])
def test_messages_forced(ant, choice):
    m = ant.messages.create(model=MODEL, max_tokens=600, messages=U, tools=MSG_TOOLS,
                            tool_choice=choice, thinking={"type": "disabled"})
    assert m.stop_reason == "tool_use", m
    uses = [b for b in m.content if b.type == "tool_use"]
    assert len(uses) >= 1
    if choice["type"] == "tool":
        assert all(u.name == "get_weather" for u in uses)
    else:
        assert len(uses) == 1
    for u in uses:
        check_args(u.name, u.input)
    assert not [b for b in m.content if b.type == "text" and b.text]


def test_messages_forced_stream(ant):
    with ant.messages.stream(model=MODEL, max_tokens=600, messages=U, tools=MSG_TOOLS,
                             tool_choice={"type": "tool", "name": "get_time",
                                          "disable_parallel_tool_use": True},
                             thinking={"type": "disabled"}) as s:
        m = s.get_final_message()
    assert m.stop_reason == "tool_use"
    uses = [b for b in m.content if b.type == "tool_use"]
    assert len(uses) == 1 and uses[0].name == "get_time"
    check_args("get_time", uses[0].input)


PERSON = {"type": "object", "properties": {"age": {"type": "integer", "minimum": 0,
                                                   "maximum": 99}},
          "required": ["age"], "additionalProperties": False}


@pytest.mark.parametrize("seed", [1, 2, 3, 4])
def test_chat_auto_with_format_is_a_document_or_a_call(server, seed):
    # tool_choice auto + a constrained format: the answer is a valid document or a valid block
    c = chat(server, response_format={"type": "json_schema", "json_schema": {
        "name": "p", "schema": PERSON, "strict": True}}, seed=seed, temperature=1.0, **NO_THINK)
    if c["message"].get("tool_calls"):
        assert c["finish_reason"] == "tool_calls"
        for k in c["message"]["tool_calls"]:
            check_args(k["function"]["name"], json.loads(k["function"]["arguments"]))
    else:
        assert c["finish_reason"] == "stop", c
        doc = json.loads(c["message"]["content"])
        assert set(doc) == {"age"} and 0 <= doc["age"] <= 99


def test_forced_tool_choice_ignores_format(server):
    # a forced call is the whole answer: the response format has no text to apply to
    c = chat(server, tool_choice="required", parallel_tool_calls=False, seed=9,
             response_format={"type": "json_object"}, **NO_THINK)
    assert c["finish_reason"] == "tool_calls", c
    k = c["message"]["tool_calls"][0]
    check_args(k["function"]["name"], json.loads(k["function"]["arguments"]))


def test_unenforceable_tool_schema_400(server):
    tools = [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"not": {"type": "string"}}}}}}]
    st, _, r = post(server, "/v1/chat/completions", {
        "model": MODEL, "messages": U, "tools": tools, "tool_choice": "required",
        "max_tokens": 5})
    assert st == 400, r
    assert r["error"]["param"] == "tools"
    assert "tools[0] 'f' parameters: JSON Schema at '#/properties/x': keyword 'not'" in \
        r["error"]["message"], r


def test_unenforceable_tool_schema_auto_stays_unconstrained(server):
    tools = [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"not": {"type": "string"}}}}}}]
    st, _, r = post(server, "/v1/chat/completions", {
        "model": MODEL, "messages": U, "tools": tools, "max_tokens": 5, **NO_THINK})
    assert st == 200, r
