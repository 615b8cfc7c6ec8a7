"""Snapshot points through the server (docs/kv-cache.md, "Snapshot points"; docs/server.md,
"Prompt caching"): requests sharing a long system prompt with different user messages continue the
second from the tail snapshot taken at the system prompt's end (cached tokens > 0, replayed less
than a block instead of the bounded replay's 90,
deepinfer:tail_snapshots_restored_total grows) on Chat Completions, Responses and Messages; the
Messages API's cache_control breakpoints are points too, with Anthropic's limit of 4 and its
field checks (400 in the Anthropic error shape)."""
import uuid

import pytest

from conftest import MODEL, post

WORDS = ("the quick brown fox jumps over a lazy dog while seven wizards quietly box "
         "jovial zebras near old stone bridges under pale autumn skies").split()


def system_prompt():
    """About 250 tokens of text no other test sends (a fresh prefix-cache chain)."""
    tag = uuid.uuid4().hex
    return f"Session {tag}. " + " ".join(WORDS[(i * 5) % len(WORDS)] for i in range(230))


def restored(server):
    return server.metrics()["deepinfer:tail_snapshots_restored_total"]


def test_chat_shared_system_prompt(server):
    sys = system_prompt()
    first = None
    for k, question in enumerate(["What is the fox doing?", "Where are the bridges?"]):
        before = restored(server)
        status, _, body = post(server, "/v1/chat/completions", {
            "model": MODEL, "temperature": 0, "max_tokens": 2,
            "messages": [{"role": "system", "content": sys},
                         {"role": "user", "content": question}]})
        assert status == 200, body
        d = body["usage"]["prompt_tokens_details"]
        if k == 0:
            first = body["usage"]
            assert d["cached_tokens"] == 0, body["usage"]
            continue
        # the system prompt's blocks were reused and its tail restored at its end (rounded down
        # to a block of 16): nothing replayed, or the positions up to a block boundary the
        # shared "<｜User｜>" token completes; the bounded replay would be 90
        assert d["cached_tokens"] >= 200, body["usage"]
        assert d["cached_tokens"] < first["prompt_tokens"]
        assert d["replayed_tokens"] < 16, body["usage"]
        assert restored(server) == before + 1


def test_responses_instructions(server):
    sys = system_prompt()
    for k, question in enumerate(["Name a colour.", "Count to three."]):
        before = restored(server)
        status, _, body = post(server, "/v1/responses", {
            "model": MODEL, "temperature": 0, "max_output_tokens": 2,
            "instructions": sys, "input": question})
        assert status == 200, body
        d = body["usage"]["input_tokens_details"]
        if k == 1:
            assert d["cached_tokens"] >= 200, body["usage"]
            assert d["replayed_tokens"] < 16, body["usage"]
            assert restored(server) == before + 1


CC = {"type": "ephemeral"}


def test_messages_cache_control(server):
    sys = system_prompt()
    tools = [{"name": "lookup", "description": "Looks a word up.",
              "input_schema": {"type": "object", "properties": {"word": {"type": "string"}}},
              "cache_control": {"type": "ephemeral", "ttl": "1h"}}]
    history = " ".join(WORDS[(i * 3) % len(WORDS)] for i in range(120))
    for k, question in enumerate(["Define fox.", "Define zebra."]):
        before = restored(server)
        status, _, body = post(server, "/v1/messages", {
            "model": MODEL, "max_tokens": 2, "temperature": 0,
            "system": [{"type": "text", "text": sys, "cache_control": CC},
                       {"type": "text", "text": "Be brief."}],
            "tools": tools,
            "messages": [{"role": "user", "content": [
                {"type": "text", "text": history, "cache_control": CC},
                {"type": "text", "text": question}]}]})
        assert status == 200, body
        u = body["usage"]
        assert u["cache_creation_input_tokens"] == 0
        if k == 1:
            # the history block's point is the deepest shared one: restored there
            assert u["cache_read_input_tokens"] >= 300, u
            assert restored(server) == before + 1
            assert u["input_tokens"] + u["cache_read_input_tokens"] > 350


def cc_request(n, cc=CC):
    return {"model": MODEL, "max_tokens": 1,
            "system": [{"type": "text", "text": f"part {i}", "cache_control": cc}
                       for i in range(n)],
            "messages": [{"role": "user", "content": "hi"}]}


@pytest.mark.parametrize("body,message", [
    (cc_request(5), "A maximum of 4 blocks with cache_control may be provided. Found 5."),
    (cc_request(1, {"type": "persistent"}), "system.0.cache_control.type: Input should be "
                                            "'ephemeral'"),
    (cc_request(1, "yes"), "system.0.cache_control.type: Input should be 'ephemeral'"),
    (cc_request(1, {"type": "ephemeral", "ttl": "2d"}),
     "system.0.cache_control.ttl: Input should be '5m' or '1h'"),
])
def test_messages_cache_control_refused(server, body, message):
    status, _, got = post(server, "/v1/messages", body)
    assert status == 400, got
    assert got["type"] == "error", got
    assert got["error"]["type"] == "invalid_request_error", got
    assert got["error"]["message"] == message, got


def test_messages_four_breakpoints_and_nested(server):
    body = cc_request(3)
    body["messages"] = [{"role": "user", "content": [{"type": "text", "text": "q"}]},
                        {"role": "assistant", "content": [
                            {"type": "tool_use", "id": "t1", "name": "lookup", "input": {}}]},
                        {"role": "user", "content": [
                            {"type": "tool_result", "tool_use_id": "t1",
                             "content": [{"type": "text", "text": "r", "cache_control": CC}]}]}]
    body["tools"] = [{"name": "lookup", "description": "d", "input_schema": {"type": "object"}}]
    status, _, got = post(server, "/v1/messages", body)
    assert status == 200, got
    body["messages"][0]["content"][0]["cache_control"] = CC  # a fifth
    status, _, got = post(server, "/v1/messages", body)
    assert status == 400, got
    assert "Found 5." in got["error"]["message"]
