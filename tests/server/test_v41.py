"""`deepinfer serve` on the DeepSeek V4.1 tiny model (`deepinfer synth --preset v41-tiny`): the
engine's V4.1 forward behind the HTTP API.

The tiny model's vocabulary has 512 ids and its directory has no tokenizer.json, so the server uses
the committed V4 tokenizer (129,280 ids, no `<｜System｜>`): chat prompts cannot render in the V4.1
format (500 naming the tokenizer), and only texts whose plain BPE ids are all below 512 (e.g.
"1 2 3" -> 19 223 20 223 21) can be completed. Legacy completions of such a text (BOS + BPE) run
through the engine, streamed and not, alone and concurrently (docs/server.md)."""
import concurrent.futures
import json
import os
import shutil
import subprocess
import tempfile
import urllib.request

import pytest

from conftest import Server, post

NAME = "v41-tiny"


@pytest.fixture(scope="module")
def v41():
    d = tempfile.mkdtemp(prefix="deepinfer-v41-")
    subprocess.run([os.environ["DEEPINFER_BIN"], "synth", "--preset", "v41-tiny", "--out", d],
                   check=True, capture_output=True)
    s = Server(extra=("--model", d, "--served-model-name", NAME, "--max-ctx", "512",
                      "--max-seqs", "3", "--kv-memory", "64"))
    yield s
    rc, log = s.stop()
    shutil.rmtree(d, ignore_errors=True)
    assert rc == 0, log
    assert "engine: the V4.1 forward: 3 slots of up to 512 positions" in log
    assert "prompts render in the V4.1 format" in log


def test_context_from_text_config():
    # V4.1 keeps max_position_embeddings (4096 in the tiny model) in text_config: the server's
    # context is capped by it as the engine's is.
    d = tempfile.mkdtemp(prefix="deepinfer-v41-")
    subprocess.run([os.environ["DEEPINFER_BIN"], "synth", "--preset", "v41-tiny", "--out", d],
                   check=True, capture_output=True)
    s = Server(extra=("--model", d, "--max-seqs", "1", "--kv-memory", "64"))
    rc, log = s.stop()
    shutil.rmtree(d, ignore_errors=True)
    assert rc == 0, log
    assert "context 4096)" in log


def complete(server, prompt, n, **kw):
    st, _, body = post(server, "/v1/completions",
                       {"model": NAME, "prompt": prompt, "max_tokens": n, "temperature": 0, **kw})
    assert st == 200, body
    return body


def stream_text(server, prompt, n):
    req = urllib.request.Request(
        server.base + "/v1/completions",
        data=json.dumps({"model": NAME, "prompt": prompt, "max_tokens": n, "temperature": 0,
                         "stream": True}).encode(),
        method="POST", headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        assert r.status == 200
        recs = r.read().decode().strip().split("\n\n")
    assert recs[-1] == "data: [DONE]"
    chunks = [json.loads(x[len("data: "):]) for x in recs[:-1]]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    return "".join(c["choices"][0]["text"] for c in chunks), len(chunks)


def test_completion(v41):
    b = complete(v41, "1 2 3", 12)
    assert b["choices"][0]["finish_reason"] == "length"
    assert b["usage"]["prompt_tokens"] == 6  # BOS + 5 BPE ids
    assert b["usage"]["completion_tokens"] == 12
    assert complete(v41, "1 2 3", 12)["choices"][0]["text"] == b["choices"][0]["text"]  # greedy


def test_streamed_equals_whole(v41):
    whole = complete(v41, "1 2 3", 10)["choices"][0]["text"]
    text, n_chunks = stream_text(v41, "1 2 3", 10)
    assert text == whole
    assert n_chunks >= 2


def test_concurrent_equals_alone(v41):
    # Five requests on three slots (slots reused), different prompts and lengths: each gives what
    # it gives alone (batch invariance of the V4.1 forward).
    prompts = ["1 2 3", "3 2 1 " * 20, "1 1", "2 3 " * 40, "3"]
    alone = [complete(v41, p, 8 + i)["choices"][0]["text"] for i, p in enumerate(prompts)]
    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as ex:
        together = list(ex.map(lambda a: complete(v41, a[1], 8 + a[0])["choices"][0]["text"],
                               enumerate(prompts)))
    assert together == alone


def test_chat_needs_the_v41_tokenizer(v41):
    st, _, body = post(v41, "/v1/chat/completions",
                       {"model": NAME, "messages": [{"role": "user", "content": "1 2 3"}],
                        "max_tokens": 4})
    assert st == 500
    assert "tokenizer.json" in body["error"]["message"]


def test_ids_outside_the_vocabulary_refused(v41):
    st, _, body = post(v41, "/v1/completions",
                       {"model": NAME, "prompt": "hello", "max_tokens": 4})  # id 33310
    assert st == 400
    assert body["error"]["type"] == "invalid_request_error"
