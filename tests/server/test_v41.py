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

from conftest import MODEL, Server, post

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


def test_prefix_hit(v41):
    # The same long prompt twice: the second reports the cached positions in its usage (whole
    # 16-position blocks of the V4.1 tiny model below the last prompt token) and gives the same
    # text and log-probabilities; /metrics counts the hit (docs/kv-cache.md, "DeepSeek V4.1").
    prompt = "3 1 2 " * 50  # BOS + 300 BPE ids
    m0 = v41.metrics()
    before = m0["deepinfer:prefix_cache_hit_tokens_total"]
    bodies = [complete(v41, prompt, 10, logprobs=2) for _ in range(2)]
    n = bodies[0]["usage"]["prompt_tokens"]
    assert n == 301
    assert bodies[0]["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert bodies[1]["usage"]["prompt_tokens_details"]["cached_tokens"] == (n - 1) // 16 * 16
    assert bodies[1]["choices"] == bodies[0]["choices"]
    m1 = v41.metrics()
    assert m1["deepinfer:prefix_cache_hit_tokens_total"] - before == (n - 1) // 16 * 16
    # the first request's tail snapshot at its last block boundary (the hit's end) was restored:
    # nothing replayed (docs/kv-cache.md, "Tail snapshots"; without it the bounded replay feeds
    # n_layers * (W - 1) = 90 of the cached positions again)
    assert m1["deepinfer:prefix_cache_replayed_tokens_total"] - \
        m0["deepinfer:prefix_cache_replayed_tokens_total"] == 0
    assert m1["deepinfer:tail_snapshots_restored_total"] - \
        m0["deepinfer:tail_snapshots_restored_total"] == 1


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


@pytest.fixture(scope="module")
def v41_pair():
    """Two servers on one V4.1 tiny checkpoint: without and with speculative decoding (DSpark
    drafts of the tiny block size, 2; no confidence cut, so every verify feeds both drafts)."""
    d = tempfile.mkdtemp(prefix="deepinfer-v41-spec-")
    subprocess.run([os.environ["DEEPINFER_BIN"], "synth", "--preset", "v41-tiny", "--out", d],
                   check=True, capture_output=True)
    common = ("--model", d, "--served-model-name", NAME, "--max-ctx", "512", "--max-seqs", "3",
              "--kv-memory", "64")
    plain = Server(extra=common)
    spec = Server(extra=(*common, "--spec-tokens", "4", "--spec-min-confidence", "-1"))
    yield plain, spec
    logs = []
    for s in (plain, spec):
        rc, log = s.stop()
        assert rc == 0, log
        logs.append(log)
    shutil.rmtree(d, ignore_errors=True)
    assert "speculative decoding" not in logs[0]
    assert "spec_tokens 4 -> 2 (the DSpark block size)" in logs[1]
    assert "speculative decoding with DSpark: up to 2 drafts per verify" in logs[1]


SPEC_REQUESTS = [
    ("1 2 3", 20, {}),
    ("3 2 1 " * 20, 17, {"temperature": 0.9, "seed": 7, "top_p": 0.9}),
    ("2 3 " * 40, 19, {"temperature": 1.2, "seed": 11, "presence_penalty": 0.5,
                       "frequency_penalty": 0.3}),
    ("1 1", 15, {"stop": ["3"]}),
]


def spec_complete(server, prompt, n, kw):
    body = {"model": NAME, "prompt": prompt, "max_tokens": n, "temperature": 0, "logprobs": 2,
            **kw}
    st, _, b = post(server, "/v1/completions", body)
    assert st == 200, b
    c = b["choices"][0]
    return c["text"], c["finish_reason"], c["logprobs"], b["usage"]["completion_tokens"]


def spec_metrics(server):
    m = server.metrics()
    with urllib.request.urlopen(server.base + "/metrics", timeout=10) as r:
        text = r.read().decode()
    hist = {}
    for line in text.splitlines():
        if line.startswith("deepinfer:spec_decode_verifies_by_accepted_total{"):
            name, value = line.rsplit(" ", 1)
            hist[int(name.split('accepted="')[1].split('"')[0])] = float(value)
    return {k.split(":")[1]: v for k, v in m.items() if k.startswith("deepinfer:spec_decode_")
            and "by_accepted" not in k}, hist


def test_spec_equals_plain(v41_pair):
    # Greedy, seeded sampling with nucleus and penalties, a stop string: the same text, finish
    # reason and log-probabilities with speculative decoding, alone and concurrently.
    plain, spec = v41_pair
    want = [spec_complete(plain, p, n, kw) for p, n, kw in SPEC_REQUESTS]
    got = [spec_complete(spec, p, n, kw) for p, n, kw in SPEC_REQUESTS]
    assert got == want
    with concurrent.futures.ThreadPoolExecutor(len(SPEC_REQUESTS)) as ex:
        together = list(ex.map(lambda r: spec_complete(spec, *r), SPEC_REQUESTS))
    assert together == want
    m, hist = spec_metrics(spec)
    assert m["spec_decode_num_verifies_total"] > 0
    assert m["spec_decode_num_draft_tokens_total"] == 2 * m["spec_decode_num_verifies_total"]
    # No cut: every verify feeds both drafts unless max_tokens is one token away.
    assert m["spec_decode_num_verified_tokens_total"] > m["spec_decode_num_verifies_total"]
    assert m["spec_decode_num_accepted_tokens_total"] <= m["spec_decode_num_verified_tokens_total"]
    assert sum(hist.values()) == m["spec_decode_num_verifies_total"]
    assert sum(j * v for j, v in hist.items()) == m["spec_decode_num_accepted_tokens_total"]
    pm, phist = spec_metrics(plain)
    assert all(v == 0 for v in pm.values()) and all(v == 0 for v in phist.values())


def spec_complete_v4(server, prompt, n, kw):
    body = {"model": MODEL, "prompt": prompt, "max_tokens": n, "temperature": 0, "logprobs": 2,
            **kw}
    st, _, b = post(server, "/v1/completions", body)
    assert st == 200, b
    c = b["choices"][0]
    return c["text"], c["finish_reason"], c["logprobs"], b["usage"]["completion_tokens"]


def test_spec_v4_mtp():
    # The built-in model is DeepSeek V4 with its MTP block: with --spec-tokens the MTP block drafts
    # one token per step (capped, logged), and the responses equal those of a server without it.
    common = ("--max-ctx", "512", "--max-seqs", "3", "--kv-memory", "64")
    plain = Server(extra=common)
    spec = Server(extra=(*common, "--spec-tokens", "2"))
    try:
        want = [spec_complete_v4(plain, p, n, kw) for p, n, kw in SPEC_REQUESTS]
        got = [spec_complete_v4(spec, p, n, kw) for p, n, kw in SPEC_REQUESTS]
        assert got == want
        with concurrent.futures.ThreadPoolExecutor(len(SPEC_REQUESTS)) as ex:
            together = list(ex.map(lambda r: spec_complete_v4(spec, *r), SPEC_REQUESTS))
        assert together == want
        m, hist = spec_metrics(spec)
        assert m["spec_decode_num_verifies_total"] > 0
        assert m["spec_decode_num_draft_tokens_total"] == m["spec_decode_num_verifies_total"]
        assert sum(hist.values()) == m["spec_decode_num_verifies_total"]
    finally:
        logs = [s.stop()[1] for s in (plain, spec)]
    assert "speculative decoding" not in logs[0]
    assert "spec_tokens 2 -> 1 (the MTP block drafts one token per step)" in logs[1]
    assert "speculative decoding with the MTP block" in logs[1]

def test_prefix_hit_without_tail_snapshots(tmp_path):
    # --tail-cache-mib 0: the same prompt twice hits as well, continued by the bounded replay (90
    # positions fed again), with the same text; a bad value is refused at start.
    d = str(tmp_path / "v41")
    subprocess.run([os.environ["DEEPINFER_BIN"], "synth", "--preset", "v41-tiny", "--out", d],
                   check=True, capture_output=True)
    s = Server(extra=("--model", d, "--served-model-name", NAME, "--max-ctx", "512",
                      "--max-seqs", "1", "--kv-memory", "64", "--tail-cache-mib", "0"))
    try:
        prompt = "3 1 2 " * 50
        bodies = [complete(s, prompt, 6, logprobs=2) for _ in range(2)]
        assert bodies[1]["choices"] == bodies[0]["choices"]
        assert bodies[1]["usage"]["prompt_tokens_details"]["cached_tokens"] == 288
        m = s.metrics()
        assert m["deepinfer:prefix_cache_replayed_tokens_total"] == 90
        assert m["deepinfer:tail_snapshots_taken_total"] == 0
        assert m["deepinfer:tail_snapshots_restored_total"] == 0
    finally:
        rc, log = s.stop()
    assert rc == 0, log
    r = subprocess.run([os.environ["DEEPINFER_BIN"], "serve", "--model", d, "--tail-cache-mib",
                        "-1"], capture_output=True, text=True, timeout=60)
    assert r.returncode != 0
    assert "--tail-cache-mib" in r.stderr, r.stderr
