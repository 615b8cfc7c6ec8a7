"""The official openai and anthropic SDKs against the server: their typed objects must parse."""
import urllib.request

import anthropic
import openai
import pytest

from conftest import MODEL, post

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}]


@pytest.fixture(scope="module")
def oai(server):
    return openai.OpenAI(base_url=server.base + "/v1", api_key="x", max_retries=0)


@pytest.fixture(scope="module")
def claude(server):
    return anthropic.Anthropic(base_url=server.base, api_key="x", max_retries=0)


def test_health_ready_models(server, oai):
    with urllib.request.urlopen(server.base + "/health") as r:
        assert r.status == 200
    ids = [m.id for m in oai.models.list().data]
    assert ids == [MODEL]
    assert "tiny random-weight" in server.logtext().splitlines()[0]


def test_chat_nonstream(oai):
    r = oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                    max_tokens=6, seed=3, temperature=0.7)
    c = r.choices[0]
    assert r.object == "chat.completion" and c.finish_reason in ("length", "stop")
    assert r.usage.completion_tokens == 6 or c.finish_reason == "stop"
    assert r.usage.prompt_tokens > 0
    assert r.usage.prompt_tokens_details.cached_tokens >= 0
    # thinking mode by default: reasoning_content present
    assert isinstance(c.message.model_extra.get("reasoning_content"), str)


def test_chat_json_mode(oai):
    # response_format json_object (serving.md §1.8): accepted, rendered into the system message,
    # and the answer parsed in JSON mode — nothing but spaces before the first { or [.
    r = oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "json"}],
                                    max_tokens=12, response_format={"type": "json_object"},
                                    extra_body={"thinking": {"type": "disabled"}})
    c = r.choices[0].message.content or ""
    head = c.lstrip(" ")
    assert head == "" or head[0] in "{[", repr(c)
    assert "\n" not in c.split("{")[0].split("[")[0]


def test_chat_seed_is_deterministic_and_n(oai):
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "seed"}], max_tokens=5,
              temperature=1.0, seed=42, n=2)
    a = oai.chat.completions.create(**kw)
    b = oai.chat.completions.create(**kw)
    assert len(a.choices) == 2 and [c.index for c in a.choices] == [0, 1]
    ra = [c.message.model_extra["reasoning_content"] for c in a.choices]
    rb = [c.message.model_extra["reasoning_content"] for c in b.choices]
    assert ra == rb
    # the second identical prompt hits the prefix cache or at least reports the field
    assert b.usage.prompt_tokens_details.cached_tokens >= 0


def test_chat_logprobs(oai):
    r = oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}],
                                    max_tokens=4, logprobs=True, top_logprobs=3,
                                    extra_body={"thinking": {"type": "disabled"}})
    lp = r.choices[0].logprobs.content
    assert len(lp) == 4
    assert all(len(t.top_logprobs) == 3 and t.logprob <= 0 for t in lp)
    assert r.choices[0].message.model_extra.get("reasoning_content") is None
    # logprobs without top_logprobs: each token's own log-probability, a real (negative) one.
    r = oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}],
                                    max_tokens=4, logprobs=True,
                                    extra_body={"thinking": {"type": "disabled"}})
    lp = r.choices[0].logprobs.content
    assert len(lp) == 4 and all(t.logprob < 0 and not t.top_logprobs for t in lp)


def test_chat_stream_with_tools(oai):
    s = oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "w?"}],
                                    tools=TOOLS, max_tokens=8, stream=True,
                                    stream_options={"include_usage": True})
    chunks = list(s)
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and
                c.choices[0].finish_reason]
    assert len(finishes) == 1
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].usage is not None and chunks[-1].choices == []
    assert chunks[-1].usage.completion_tokens == 8 or finishes == ["stop"]


def test_chat_required_tool_stream(oai):
    # tool_choice=required: the prompt opens a DSML block, so the parser starts in ToolCalls;
    # random text never leaks into content
    s = oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "w?"}],
                                    tools=TOOLS, tool_choice="required", max_tokens=8,
                                    stream=True)
    content = "".join(c.choices[0].delta.content or "" for c in s if c.choices)
    assert content == ""


def test_completions(oai):
    r = oai.completions.create(model=MODEL, prompt="Once upon", max_tokens=5)
    assert r.choices[0].finish_reason in ("length", "stop") and r.usage.completion_tokens <= 5
    s = list(oai.completions.create(model=MODEL, prompt="Once", max_tokens=3, stream=True))
    assert s[-1].choices[0].finish_reason in ("length", "stop")


def test_chat_stop_string_ends_with_stop(oai):
    r = oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                    max_tokens=40, stop=["a", "e", "o", " "],
                                    extra_body={"thinking": {"type": "disabled"}})
    c = r.choices[0]
    assert c.finish_reason in ("stop", "length")
    for s in ("a", "e", "o", " "):
        assert s not in (c.message.content or "")


def test_responses(oai):
    r = oai.responses.create(model=MODEL, input="hello", max_output_tokens=6)
    assert r.status in ("completed", "incomplete")
    assert r.output[0].type == "reasoning"
    assert r.usage.output_tokens <= 6
    events = list(oai.responses.create(model=MODEL, input=[{"role": "user", "content": "hi"}],
                                       max_output_tokens=6, stream=True,
                                       tools=[{"type": "function", "name": "f",
                                               "parameters": {"type": "object"}}]))
    types = [e.type for e in events]
    assert types[0] == "response.created" and types[1] == "response.in_progress"
    assert types[-1] in ("response.completed", "response.incomplete")
    seqs = [e.sequence_number for e in events]
    assert seqs == list(range(len(seqs)))
    assert types.count("response.output_item.added") == types.count("response.output_item.done")


def test_messages(claude):
    m = claude.messages.create(model="claude-sonnet-4-5", max_tokens=6,
                               messages=[{"role": "user", "content": "hi"}],
                               thinking={"type": "enabled", "budget_tokens": 1024})
    assert m.type == "message" and m.content[0].type == "thinking"
    assert m.content[0].signature
    assert m.stop_reason in ("max_tokens", "end_turn")
    assert m.usage.output_tokens == 6 or m.stop_reason == "end_turn"


def test_responses_input_tokens(oai, server):
    # POST /v1/responses/input_tokens (the SDK's responses.input_tokens.count): the prompt as the
    # Responses route renders it, counted without generating (model optional there)
    kw = dict(model=MODEL, instructions="be brief", input="count these tokens, please")
    r = oai.responses.input_tokens.count(**kw)
    assert r.object == "response.input_tokens"
    full = oai.responses.create(max_output_tokens=16, **kw)
    assert r.input_tokens == full.usage.input_tokens > 5
    assert oai.responses.input_tokens.count(input="count these tokens, please").input_tokens < \
        r.input_tokens  # without the instructions
    with pytest.raises(openai.BadRequestError):
        oai.responses.input_tokens.count(model=MODEL, input=[{"role": "nobody", "content": "x"}])


def test_messages_count_tokens(claude, server):
    # POST /v1/messages/count_tokens (the SDK's messages.count_tokens): the prompt as the Messages
    # route renders it, counted without generating; equal to a request's input + cache reads
    kw = dict(model=MODEL, system="be brief",
              messages=[{"role": "user", "content": "count these tokens, please"}],
              tools=[{"name": "get_weather", "description": "Weather of a city",
                      "input_schema": {"type": "object",
                                       "properties": {"city": {"type": "string"}}}}])
    n = claude.messages.count_tokens(**kw).input_tokens
    m = claude.messages.create(max_tokens=2, **kw)
    assert n == m.usage.input_tokens + m.usage.cache_read_input_tokens > 10
    shorter = dict(kw, tools=[])
    assert 0 < claude.messages.count_tokens(**shorter).input_tokens < n
    # the same validation as the route (but max_tokens), and the Anthropic error shape
    with pytest.raises(anthropic.BadRequestError) as ei:
        claude.messages.count_tokens(model=MODEL, messages=[])
    assert ei.value.body["type"] == "error"
    st, _, err = post(server, "/anthropic/v1/messages/count_tokens",
                      {"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                       "max_tokens": 0})
    assert st == 400 and err["error"]["type"] == "invalid_request_error", err


def test_messages_stream_tools(claude):
    tools = [{"name": "get_weather", "description": "w",
              "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}]
    with claude.messages.stream(model=MODEL, max_tokens=8, tools=tools,
                                messages=[{"role": "user", "content": "w?"},
                                          {"role": "assistant", "content": [
                                              {"type": "thinking", "thinking": "t",
                                               "signature": "s"},
                                              {"type": "tool_use", "id": "toolu_1",
                                               "name": "get_weather",
                                               "input": {"city": "Paris"}}]},
                                          {"role": "user", "content": [
                                              {"type": "tool_result", "tool_use_id": "toolu_1",
                                               "content": "sunny"}]}]) as s:
        events = [e.type for e in s]
        final = s.get_final_message()
    assert events[0] == "message_start" and events[-1] == "message_stop"
    assert events.count("content_block_start") == events.count("content_block_stop")
    assert final.stop_reason in ("max_tokens", "end_turn", "tool_use")


def test_messages_thinking_disabled_has_no_thinking_block(claude):
    with claude.messages.stream(model=MODEL, max_tokens=5, thinking={"type": "disabled"},
                                messages=[{"role": "user", "content": "hi"}]) as s:
        final = s.get_final_message()
    assert all(b.type != "thinking" for b in final.content)


def test_sse_keepalive_and_raw_sequence(server):
    # the raw event order of a Messages stream, parsed by hand (spec §2.4)
    st, _, text = post(server, "/v1/messages", {"model": MODEL, "max_tokens": 3, "stream": True,
                                                "messages": [{"role": "user", "content": "x"}]})
    assert st == 200
    names = [l[7:] for l in text.splitlines() if l.startswith("event: ")]
    assert names[0] == "message_start" and names[1] == "content_block_start"
    assert names[-2:] == ["message_delta", "message_stop"]
