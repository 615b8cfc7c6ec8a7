"""Request options beyond sampling basics: OpenAI `logit_bias` (added to the logits before
sampling, greedy included, Chat and Completions), per-user prefix-cache namespaces
(`serve --cache-isolation user`: requests share cached prompts only with the same user id, Chat /
Completions / Responses `user_id` or `user`, Messages `metadata.user_id`), and DeepSeek's beta
features: Chat prefix completion (POST /beta/chat/completions, the last assistant message with
`prefix: true`) and FIM (POST /beta/completions with `suffix`, `serve --fim`). The tiny model's
text is meaningless, so the tests look at what the options force: the tokens a +100 bias picks,
the usage's cached tokens, the prompt's ids (against `deepinfer render` and the tokenizer) and
where the continuation lands (reasoning or content)."""
import json
import os
import subprocess
import tempfile
import uuid

import pytest

from conftest import MODEL, Server, post

CHAT, CMPL, MSG = "/v1/chat/completions", "/v1/completions", "/v1/messages"
BETA_CHAT, BETA_CMPL = "/beta/chat/completions", "/beta/completions"


def token_ids(text):
    return subprocess.run([os.environ["DEEPINFER_BIN"], "tokenize", text], check=True,
                          capture_output=True, text=True).stdout.split()


def token_id(text):
    out = token_ids(text)
    assert len(out) == 1, (text, out)
    return out[0]


def rendered_ids(request):
    """The prompt ids `deepinfer render` makes of a Chat request (the renderer's own CLI)."""
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(request, f)
    try:
        out = subprocess.run([os.environ["DEEPINFER_BIN"], "render", "--request", f.name,
                              "--ids-only"], check=True, capture_output=True, text=True).stdout
    finally:
        os.unlink(f.name)
    return out.replace("ids:", " ").replace(",", " ").split()


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


def test_priority_accepted(server):
    """The engine's scheduling order is tested in tests/unit/test_sched.c and test_engine.c
    (priority preemption and aging, token-based fair share); here the field reaches it on every
    API and the counters are exported (u1's fair-share counter is held after its requests)."""
    for path, body in ((CHAT, {"messages": [{"role": "user", "content": "a"}]}),
                       (CMPL, {"prompt": "a"}),
                       ("/v1/responses", {"input": "a", "max_output_tokens": 2}),
                       (MSG, {"messages": [{"role": "user", "content": "a"}]})):
        status, _, got = post(server, path, {"model": MODEL, "max_tokens": 2, "priority": -3,
                                             "user": "u1", **body})
        assert status == 200, (path, got)
    m = server.metrics()
    assert "deepinfer:priority_preemptions_total" in m
    assert m["deepinfer:tenants_tracked"] >= 1
    assert "deepinfer:tenants_backlogged" in m  # 0 or 1: the last request may still retire


def test_shared_cache_by_default(server):
    text = prompt()
    assert chat_cached(server, text, user="alice") == 0
    assert chat_cached(server, text, user="bob") > 100  # one namespace: bob reuses alice's prompt


@pytest.fixture(scope="module")
def isolated():
    # --priority-aging-ms 0 (aging off) rides along: the option is taken.
    s = Server(extra=["--cache-isolation", "user", "--fim", "--priority-aging-ms", "0"])
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


def test_chat_prefix_completion(server):
    z = token_id("Z")
    msgs = [{"role": "user", "content": "Write a line."},
            {"role": "assistant", "content": "Sure: ZZ", "prefix": True}]
    req = {"model": MODEL, "max_tokens": 3, "temperature": 0, "messages": msgs,
           "thinking": {"type": "disabled"}}
    status, _, body = post(server, CHAT, {**req, "logit_bias": {z: 100}})
    assert status == 400 and "/beta" in body["error"]["message"], body
    status, _, body = post(server, BETA_CHAT, {**req, "logit_bias": {z: 100}})
    assert status == 200, body
    m = body["choices"][0]["message"]
    assert m["content"] == "ZZZ" and not m.get("reasoning_content"), body  # the continuation only
    # the prompt ends with the prefix, no EOS and no new assistant header
    assert body["usage"]["prompt_tokens"] == len(rendered_ids(req)), body["usage"]
    # thinking mode, reasoning given and no content: the model continues its reasoning
    req = {"model": MODEL, "max_tokens": 3, "temperature": 0, "logit_bias": {z: 100},
           "messages": [msgs[0], {"role": "assistant", "content": "",
                                  "reasoning_content": "Let me see", "prefix": True}]}
    status, _, body = post(server, BETA_CHAT, req)
    assert status == 200, body
    m = body["choices"][0]["message"]
    assert m["reasoning_content"] == "ZZZ" and m["content"] == "", body
    # prefix only on the last assistant message, and a boolean
    bad = [msgs[0], {"role": "assistant", "content": "a", "prefix": True},
           {"role": "user", "content": "b"}]
    status, _, body = post(server, BETA_CHAT, {"model": MODEL, "messages": bad})
    assert status == 400, body
    status, _, body = post(server, BETA_CHAT, {"model": MODEL, "messages": [
        msgs[0], {"role": "assistant", "content": "a", "prefix": "yes"}]})
    assert status == 400, body


def test_fim_off_by_default(server):
    status, _, body = post(server, BETA_CMPL, {"model": MODEL, "prompt": "a", "suffix": "b"})
    assert status == 400 and "--fim" in body["error"]["message"], body
    status, _, body = post(server, CMPL, {"model": MODEL, "prompt": "a", "suffix": "b"})
    assert status == 400 and "/beta" in body["error"]["message"], body
    # /beta/completions without a suffix is a plain completion
    status, _, body = post(server, BETA_CMPL, {"model": MODEL, "prompt": "a", "max_tokens": 2})
    assert status == 200 and body["usage"]["completion_tokens"] == 2, body


def test_fim(isolated):
    q = token_id("Q")
    prompt, suffix = "def add(a, b):\n    ", "\n    return total\n"
    status, _, body = post(isolated, BETA_CMPL, {"model": MODEL, "prompt": prompt,
                                                 "suffix": suffix, "max_tokens": 3,
                                                 "temperature": 0, "logit_bias": {q: 100}})
    assert status == 200, body
    assert body["choices"][0]["text"] == "QQQ", body
    # BOS <fim_begin> prompt <fim_hole> suffix <fim_end>
    n = 4 + len(token_ids(prompt)) + len(token_ids(suffix))
    assert body["usage"]["prompt_tokens"] == n, body["usage"]
    status, _, body = post(isolated, BETA_CMPL, {"model": MODEL, "prompt": "a", "suffix": "b",
                                                 "max_tokens": 5000})
    assert status == 422, body
    status, _, body = post(isolated, BETA_CMPL, {"model": MODEL, "prompt": "a", "suffix": 3})
    assert status == 400, body
