"""Validation matrix: each bad request gets the API's own error shape and the expected 4xx; the
server stays up (checked by /health after every case)."""
import json
import urllib.request

import pytest

from conftest import MODEL, post

U = [{"role": "user", "content": "hi"}]
CHAT, RESP, MSG, CMPL = "/v1/chat/completions", "/v1/responses", "/v1/messages", "/v1/completions"

CASES = [
    # (path, body or raw bytes, status)
    (CHAT, b"{not json", 400),
    (CHAT, b"[1,2]", 400),
    (CHAT, b"", 400),
    (CHAT, b'{"model": "a", "model": "b"}', 400),
    (CHAT, {"messages": U}, 400),
    (CHAT, {"model": 5, "messages": U}, 400),
    (CHAT, {"model": "nope", "messages": U}, 404),
    (CHAT, {"model": MODEL}, 400),
    (CHAT, {"model": MODEL, "messages": []}, 400),
    (CHAT, {"model": MODEL, "messages": "hi"}, 400),
    (CHAT, {"model": MODEL, "messages": [1]}, 400),
    (CHAT, {"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]}, 400),
    (CHAT, {"model": MODEL, "messages": [{"role": "user", "content": 5}]}, 400),
    (CHAT, {"model": MODEL, "messages": [{"role": "user"}]}, 400),
    (CHAT, {"model": MODEL, "messages": [{"role": "user", "content": [{"type": "audio"}]}]}, 400),
    (CHAT, {"model": MODEL, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "x"}}]}]}, 400),
    (CHAT, {"model": MODEL, "messages": U + [{"role": "tool", "content": "r",
                                               "tool_call_id": "c"}]}, 400),
    (CHAT, {"model": MODEL, "messages": U, "temperature": "hot"}, 400),
    (CHAT, {"model": MODEL, "messages": U, "temperature": 3}, 422),
    (CHAT, {"model": MODEL, "messages": U, "top_p": 0}, 422),
    (CHAT, {"model": MODEL, "messages": U, "presence_penalty": 9}, 422),
    (CHAT, {"model": MODEL, "messages": U, "max_tokens": 0}, 422),
    (CHAT, {"model": MODEL, "messages": U, "max_tokens": "10"}, 400),
    (CHAT, {"model": MODEL, "messages": U, "max_tokens": 10**7}, 422),
    (CHAT, {"model": MODEL, "messages": U, "max_tokens": 300000}, 400),  # context overflow
    (CHAT, {"model": MODEL, "messages": U, "n": 9}, 422),
    (CHAT, {"model": MODEL, "messages": U, "stop": 5}, 400),
    (CHAT, {"model": MODEL, "messages": U, "stop": [""]}, 422),
    (CHAT, {"model": MODEL, "messages": U, "stop": ["x"] * 17}, 422),
    (CHAT, {"model": MODEL, "messages": U, "top_logprobs": 3}, 400),
    (CHAT, {"model": MODEL, "messages": U, "logprobs": True, "top_logprobs": 21}, 422),
    (CHAT, {"model": MODEL, "messages": U, "stream": "yes"}, 400),
    (CHAT, {"model": MODEL, "messages": U, "response_format": {"type": "json_object",
                                                               "x": 1}, "n": 0}, 422),
    (CHAT, {"model": MODEL, "messages": U, "response_format": {"type": "json_schema",
                                                               "json_schema": {}}}, 400),
    (CHAT, {"model": MODEL, "messages": U, "reasoning_effort": "extreme"}, 422),
    (CHAT, {"model": MODEL, "messages": U, "thinking": {"type": "maybe"}}, 422),
    (CHAT, {"model": MODEL, "messages": U, "tools": {}}, 400),
    (CHAT, {"model": MODEL, "messages": U, "tools": [{"type": "retrieval"}]}, 400),
    (CHAT, {"model": MODEL, "messages": U, "tools": [{"type": "function",
                                                       "function": {"name": "bad name"}}]}, 400),
    (CHAT, {"model": MODEL, "messages": U, "tools": [{"type": "function", "function": {
        "name": "f", "parameters": [1]}}]}, 400),
    (CHAT, {"model": MODEL, "messages": U, "tool_choice": "required"}, 400),
    (CHAT, {"model": MODEL, "messages": U, "tool_choice": "sometimes"}, 422),
    (CHAT, {"model": MODEL, "messages": U, "tool_choice": 5}, 400),
    (CHAT, {"model": MODEL, "messages": U, "tools": [{"type": "function", "function": {"name": "f"}}],
            "tool_choice": {"type": "function", "function": {"name": "g"}}}, 400),
    (CHAT, {"model": MODEL, "messages": U, "tools": [{"type": "function", "function": {"name": "f"}}],
            "tool_choice": {"type": "function"}}, 400),
    (CHAT, {"model": MODEL, "messages": U, "logit_bias": [1]}, 400),
    (CHAT, {"model": MODEL, "messages": U, "logit_bias": {"x": 5}}, 400),
    (CHAT, {"model": MODEL, "messages": U, "logit_bias": {"-1": 5}}, 400),
    (CHAT, {"model": MODEL, "messages": U, "logit_bias": {"1": "5"}}, 400),
    (CHAT, {"model": MODEL, "messages": U, "logit_bias": {"1": 101}}, 422),
    (CHAT, {"model": MODEL, "messages": U, "logit_bias": {"129280": 1}}, 422),
    (CHAT, {"model": MODEL, "messages": U, "logit_bias": {str(i): 1 for i in range(1025)}}, 422),
    (CMPL, {"model": MODEL, "prompt": "x", "logit_bias": {"99999999999999999999": 1}}, 422),
    (CHAT, {"model": MODEL, "messages": U, "user": 5}, 400),
    (CHAT, {"model": MODEL, "messages": U, "priority": "high"}, 400),
    (CHAT, {"model": MODEL, "messages": U, "priority": 10**7}, 422),
    (MSG, {"model": MODEL, "max_tokens": 4, "messages": U, "priority": 1.5}, 400),
    (CHAT, {"model": MODEL, "messages": U, "user": "u" * 513}, 400),
    (MSG, {"model": MODEL, "max_tokens": 4, "messages": U, "metadata": 3}, 400),
    (MSG, {"model": MODEL, "max_tokens": 4, "messages": U, "metadata": {"user_id": 7}}, 400),
    (CMPL, {"model": MODEL}, 400),
    (CMPL, {"model": MODEL, "prompt": 7}, 400),
    (CMPL, {"model": MODEL, "prompt": "x", "suffix": "y"}, 400),
    (RESP, {"model": MODEL}, 400),
    (RESP, {"model": MODEL, "input": 3}, 400),
    (RESP, {"model": MODEL, "input": "x", "previous_response_id": "resp_1"}, 400),
    (RESP, {"model": MODEL, "input": "x", "max_output_tokens": -1}, 422),
    (RESP, {"model": MODEL, "input": "x", "reasoning": {"effort": "huge"}}, 422),
    (RESP, {"model": MODEL, "input": "x", "text": {"format": {"type": "json_schema"}}}, 400),
    (RESP, {"model": MODEL, "input": [{"type": "bogus"}]}, 400),
    (RESP, {"model": "other", "input": "x"}, 404),
    (RESP, {"model": MODEL, "input": "x", "tool_choice": "required"}, 400),
    (RESP, {"model": MODEL, "input": "x", "tool_choice": "maybe"}, 422),
    (RESP, {"model": MODEL, "input": "x", "tools": [{"type": "function", "name": "f"}],
            "tool_choice": {"type": "function", "name": "g"}}, 400),
    (RESP, {"model": MODEL, "input": "x", "tools": [{"type": "function", "name": "f"}],
            "tool_choice": {"type": "file_search"}}, 400),
    (MSG, {"model": MODEL, "messages": U}, 400),
    (MSG, {"model": MODEL, "max_tokens": "5", "messages": U}, 400),
    (MSG, {"model": MODEL, "max_tokens": 5}, 400),
    (MSG, {"model": MODEL, "max_tokens": 5, "messages": [{"role": "system", "content": "x"}]}, 400),
    (MSG, {"model": MODEL, "max_tokens": 5, "messages": U, "temperature": 1.5}, 422),
    (MSG, {"model": MODEL, "max_tokens": 5, "messages": U,
           "tools": [{"type": "web_search_20250305", "name": "web_search"}]}, 400),
    (MSG, {"model": MODEL, "max_tokens": 5, "messages": U, "thinking": {"type": "sometimes"}}, 400),
    (MSG, {"model": MODEL, "max_tokens": 5, "messages": U, "tool_choice": {"type": "any"}}, 400),
    (MSG, {"model": MODEL, "max_tokens": 5, "messages": U,
           "tools": [{"name": "f", "input_schema": {"type": "object"}}],
           "tool_choice": {"type": "tool", "name": "g"}}, 400),
    (MSG, {"model": MODEL, "max_tokens": 5, "messages": U,
           "tools": [{"name": "f", "input_schema": {"type": "object"}}],
           "tool_choice": {"type": "tool"}}, 400),
    (MSG, {"model": "gpt-4", "max_tokens": 5, "messages": U}, 404),
    (MSG, b"{", 400),
]


def check_shape(path, body):
    if path == MSG:
        assert body["type"] == "error"
        assert isinstance(body["error"]["type"], str) and body["error"]["message"]
    else:
        assert isinstance(body["error"]["message"], str) and body["error"]["message"]
        assert body["error"]["type"] in ("invalid_request_error", "rate_limit_error", "api_error")


@pytest.mark.parametrize("path,body,status", CASES)
def test_bad_request(server, path, body, status):
    raw = body if isinstance(body, bytes) else None
    st, _, out = post(server, path, None if raw is not None else body, raw=raw)
    assert st == status, out
    check_shape(path, out)
    with urllib.request.urlopen(server.base + "/health") as r:
        assert r.status == 200


def test_matrix_size():
    assert len(CASES) >= 40


def test_context_overflow_message(server):
    st, _, out = post(server, CHAT, {"model": MODEL, "messages": U, "max_tokens": 300000})
    assert st == 400
    assert out["error"]["message"].startswith("This model's maximum context length is 8192 tokens.")


def test_oversized_body_413(server):
    big = b'{"model": "x", "messages": [{"role": "user", "content": "' + b"a" * (9 << 20) + b'"}]}'
    st, _, out = post(server, MSG, None, raw=big)
    assert st == 413 and out["error"]["type"] == "request_too_large"


def test_unknown_path_and_method(server):
    st, _, out = post(server, "/v1/nothing", {})
    assert st == 404 and "error" in out
    st, _, out = post(server, "/v1/models", {})
    assert st == 405


def test_overload_429_with_retry_after(tmp_path):
    # The in-flight request is a stream the test holds open (it reads the first event, then stops
    # reading), so the 429 window does not depend on how fast the model generates on a loaded
    # machine; closing it afterwards must free the slot (polled with a bounded deadline).
    import http.client
    import time
    from conftest import Server
    s = Server(extra=("--max-inflight", "1"))
    try:
        conn = http.client.HTTPConnection("127.0.0.1", s.port, timeout=120)
        conn.request("POST", CHAT, json.dumps({"model": MODEL, "messages": U, "max_tokens": 4000,
                                               "stream": True}),
                     {"Content-Type": "application/json"})
        r = conn.getresponse()
        assert r.status == 200
        first = r.readline()
        assert first.startswith(b"data: {"), first  # generating: one request in flight
        assert s.metrics()["deepinfer:num_http_requests_in_flight"] == 1
        st, hdrs, out = post(s, CHAT, {"model": MODEL, "messages": U, "max_tokens": 1})
        assert st == 429, (st, out)
        assert hdrs.get("Retry-After") == "1"
        assert out["error"]["type"] == "rate_limit_error"
        conn.sock.close()  # disconnect: the stream is cancelled and its slot freed
        conn.close()
        deadline = time.time() + 120
        while time.time() < deadline:
            if s.metrics()["deepinfer:num_http_requests_in_flight"] == 0:
                break
            time.sleep(0.1)
        st, _, out = post(s, CHAT, {"model": MODEL, "messages": U, "max_tokens": 1})
        assert st == 200, (st, out)
    finally:
        assert s.stop()[0] == 0
