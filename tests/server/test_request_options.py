"""Request options beyond sampling basics: OpenAI `logit_bias` (added to the logits before
sampling, greedy included, Chat and Completions) and per-user prefix-cache namespaces
(`serve --cache-isolation user`: requests share cached prompts only with the same user id, Chat /
Completions / Responses `user_id` or `user`, Messages `metadata.user_id`). The tiny model's text is
meaningless, so the tests look at what the options force: the tokens a +100 bias picks, and the
usage's cached tokens."""
import os
import subprocess
import uuid

import pytest

from conftest import MODEL, Server, post

CHAT, CMPL, MSG = "/v1/chat/completions", "/v1/completions", "/v1/messages"


def token_id(text):
    out = subprocess.run([os.environ["DEEPINFER_BIN"], "tokenize", text], check=True,
                         capture_output=True, text=True).stdout.split()
    assert len(out) == 1, (text, out)
    return out[0]


def text_of(body):
    m = body["choices"][0]["message"]  # thinking by default: the text is the reasoning's
    return (m.get("reasoning_content") or "") + (m["content"] or "")


def test_logit_bias_forces_tokens(server):
    z, q = token_id("Z"), token_id("Q")
    for temperature in (0, 1):
        status, _, body = post(server, CHAT, {
            "model": MODEL, "max_tokens": 6, "temperature": temperature, "seed": 3,
            "messages": [{"role": "user", "content": "Say something."}],
            "logit_bias": {z: 100}})
        assert status == 200, body
        assert text_of(body) == "Z" * 6, body
        assert body["usage"]["completion_tokens"] == 6
    # biases add to the logits: -100 takes Z away again, +50 makes Q win
    status, _, body = post(server, CHAT, {
        "model": MODEL, "max_tokens": 4, "temperature": 0,
        "messages": [{"role": "user", "content": "Say something."}],
        "logit_bias": {z: -100, q: 50}})
    assert status == 200, body
    assert text_of(body) == "Q" * 4, body
    status, _, body = post(server, CMPL, {"model": MODEL, "prompt": "Once upon a time",
                                          "max_tokens": 5, "temperature": 0,
                                          "logit_bias": {q: 100}})
    assert status == 200, body
    assert body["choices"][0]["text"] == "Q" * 5, body


def prompt():
    """About 150 tokens no other test sends: several blocks of a fresh prefix-cache chain."""
    return f"Note {uuid.uuid4().hex}: " + " ".join(f"item {i} is blue" for i in range(40))


def chat_cached(server, text, **extra):
    status, _, body = post(server, CHAT, {"model": MODEL, "max_tokens": 1, "temperature": 0,
                                          "messages": [{"role": "user", "content": text}],
                                          **extra})
    assert status == 200, body
    return body["usage"]["prompt_tokens_details"]["cached_tokens"]


def messages_cached(server, text, user):
    status, _, body = post(server, MSG, {"model": MODEL, "max_tokens": 1, "temperature": 0,
                                         "messages": [{"role": "user", "content": text}],
                                         "metadata": {"user_id": user}})
    assert status == 200, body
    return body["usage"]["cache_read_input_tokens"]


def test_shared_cache_by_default(server):
    text = prompt()
    assert chat_cached(server, text, user="alice") == 0
    assert chat_cached(server, text, user="bob") > 100  # one namespace: bob reuses alice's prompt


@pytest.fixture(scope="module")
def isolated():
    s = Server(extra=["--cache-isolation", "user"])
    yield s
    rc, log = s.stop()
    assert rc == 0, log


def test_cache_isolation_user(isolated):
    text = prompt()
    assert chat_cached(isolated, text, user="alice") == 0
    assert chat_cached(isolated, text, user="alice") > 100
    assert chat_cached(isolated, text, user="bob") == 0  # not alice's
    assert chat_cached(isolated, text, user_id="bob") > 100  # user_id is the same namespace
    assert chat_cached(isolated, text) == 0  # anonymous: its own namespace
    assert chat_cached(isolated, text) > 100
    text = prompt()
    assert messages_cached(isolated, text, "carol") == 0
    assert messages_cached(isolated, text, "carol") > 100
    assert messages_cached(isolated, text, "dave") == 0
