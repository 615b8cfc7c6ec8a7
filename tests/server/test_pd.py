"""Prefill/decode disaggregation (docs/disaggregation.md): `deepinfer route --prefill --decode` in
front of one prefill and one decode replica (`deepinfer serve --kv-transfer`, the built-in tiny
model) on loopback. A long chat request, non-streaming and streaming, gives the same output as a
plain single replica; the decode replica imported the transfer and took the prompt from its prefix
cache, continuing it from the transferred tail snapshot (nothing replayed); the router counts the
step. A short body skips it. With two prefill replicas a prompt is prefilled again where it is
cached (prefix affinity). With the prefill replica down the router
falls back to the decode replica alone, still with the same output. The same through V4.1
replicas. The internal endpoints refuse
bad input with clear 4xx errors, another model's transfer with 409, and are absent without
--kv-transfer."""
import http.client
import json
import os
import subprocess
import time
import urllib.request

import pytest

from conftest import MODEL, Router, Server, post

WORDS = ("the quick brown fox jumps over a lazy dog while seven wizards quietly box "
         "jovial zebras near old stone bridges under pale autumn skies").split()


def chat(seed, n_words=300, **kw):
    text = " ".join(WORDS[(i * 7 + seed) % len(WORDS)] for i in range(n_words))
    return {"model": MODEL, "temperature": 0, "max_tokens": 8,
            "messages": [{"role": "user", "content": text}], **kw}


@pytest.fixture(scope="module")
def pd():
    ref = Server()  # a plain single replica: the reference outputs
    pre = Server(["--kv-transfer"])
    dec = Server(["--kv-transfer"])
    router = Router([dec], prefill=[pre], extra=["--pd-min-bytes", "1000"])
    yield ref, pre, dec, router
    rc, log = router.stop()
    assert rc == 0, log
    for s in (ref, pre, dec):
        if not s.log.closed:  # the fallback test stops the prefill replica itself
            rc, log = s.stop()
            assert rc == 0, log


def message(body):
    m = body["choices"][0]["message"]
    return (m.get("reasoning_content") or "") + "|" + (m.get("content") or "")


def sse_text(port, body):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    conn.request("POST", "/v1/chat/completions", json.dumps(body),
                 {"Content-Type": "application/json"})
    r = conn.getresponse()
    assert r.status == 200
    assert r.getheader("Content-Type").startswith("text/event-stream")
    reasoning, content, events = [], [], []
    for line in r.read().decode().splitlines():
        if not line.startswith("data: "):
            continue
        events.append(line)
        if line != "data: [DONE]":
            for c in json.loads(line[6:])["choices"]:
                reasoning.append(c["delta"].get("reasoning_content") or "")
                content.append(c["delta"].get("content") or "")
    conn.close()
    assert events[-1] == "data: [DONE]"
    return "".join(reasoning) + "|" + "".join(content)


def test_pd_chat_same_output(pd):
    ref, pre, dec, router = pd
    body = chat(1)
    st, _, want = post(ref, "/v1/chat/completions", body)
    assert st == 200, want
    st, _, got = post(router, "/v1/chat/completions", body)
    assert st == 200, got
    assert message(got) == message(want)
    n_prompt = got["usage"]["prompt_tokens"]
    assert n_prompt > 300
    # the decode replica took the prompt from the imported blocks: every full block but the
    # window suffix's bounded replay
    cached = got["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached >= n_prompt - 32, got["usage"]
    md, mp, mr = dec.metrics(), pre.metrics(), router.metrics()
    assert md["deepinfer:kv_transfer_imports_total"] == 1
    assert md["deepinfer:kv_transfer_import_blocks_total"] == cached // 16
    assert md["deepinfer:prefix_cache_hit_tokens_total"] == cached
    # the transfer carried the prefill replica's tail snapshot at the prompt's last block
    # boundary: the decode replica restored it and replayed nothing (docs/kv-cache.md)
    assert mp["deepinfer:tail_snapshots_taken_total"] == 1
    assert md["deepinfer:tail_snapshots_restored_total"] == 1
    assert md["deepinfer:prefix_cache_replayed_tokens_total"] == 0
    assert mp["deepinfer:kv_transfer_exports_total"] == 1
    assert mp["deepinfer:kv_transfer_export_blocks_total"] == cached // 16
    assert mr['deepinfer:router_pd_requests_total{outcome="ok"}'] == 1
    assert mr['deepinfer:router_pd_requests_total{outcome="fallback"}'] == 0
    assert mr["deepinfer:router_pd_transfer_blocks_total"] == cached // 16
    assert mr["deepinfer:router_pd_transfer_bytes_total"] == \
        mp["deepinfer:kv_transfer_export_bytes_total"] > 0


def test_pd_stream_same_output(pd):
    ref, pre, dec, router = pd
    body = chat(2, stream=True)
    st, _, want = post(ref, "/v1/chat/completions", dict(body, stream=False))
    assert st == 200, want
    before = dec.metrics()["deepinfer:kv_transfer_import_blocks_total"]
    assert sse_text(router.port, body) == message(want)
    assert dec.metrics()["deepinfer:kv_transfer_import_blocks_total"] > before
    assert router.metrics()['deepinfer:router_pd_requests_total{outcome="ok"}'] == 2


def test_pd_short_body_skips_prefill(pd):
    ref, pre, dec, router = pd
    body = chat(3, n_words=20)
    st, _, want = post(ref, "/v1/chat/completions", body)
    st, _, got = post(router, "/v1/chat/completions", body)
    assert st == 200 and message(got) == message(want)
    assert router.metrics()['deepinfer:router_pd_requests_total{outcome="short"}'] == 1


def test_pd_short_prompt_by_tokens(pd):
    # the probe's token count decides too: a prompt of fewer tokens than --pd-min-new-tokens takes
    # no step (counted as short) whatever its body's size
    ref, pre, dec, _ = pd
    router = Router([dec], prefill=[pre],
                    extra=["--pd-min-bytes", "0", "--pd-min-new-tokens", "100000"])
    try:
        exports = pre.metrics()["deepinfer:kv_transfer_exports_total"]
        body = chat(14)
        st, _, want = post(ref, "/v1/chat/completions", body)
        st, _, got = post(router, "/v1/chat/completions", body)
        assert st == 200 and message(got) == message(want)
        m = router.metrics()
        assert m['deepinfer:router_pd_requests_total{outcome="short"}'] == 1
        assert m['deepinfer:router_pd_requests_total{outcome="ok"}'] == 0
        assert pre.metrics()["deepinfer:kv_transfer_exports_total"] == exports
    finally:
        router.stop()


def test_internal_endpoints_refuse_bad_input(pd):
    ref, pre, dec, router = pd
    body = chat(4)
    status, hdrs, x = 0, None, None
    req = urllib.request.Request(
        pre.base + "/internal/prefill?route=/v1/chat/completions",
        data=json.dumps(body).encode(), method="POST",
        headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        status, hdrs, x = r.status, dict(r.headers), r.read()
    assert status == 200 and hdrs["Content-Type"] == "application/octet-stream"
    assert int(hdrs["X-Deepinfer-KV-Blocks"]) > 0
    refused = dec.metrics()["deepinfer:kv_transfer_import_refused_total"]
    for bad in (b"", x[:100], x[:-1], x + b"\0", x[:200] + bytes([x[200] ^ 1]) + x[201:]):
        st, _, err = post(dec, "/internal/kv", None, raw=bad,
                          headers={"Content-Type": "application/octet-stream"})
        assert st == 400, err
        assert err["error"]["code"] == "invalid_kv_transfer", err
    assert dec.metrics()["deepinfer:kv_transfer_import_refused_total"] == refused + 5
    # the request the transfer was made for is not cached there: nothing was inserted
    st, _, got = post(dec, "/v1/chat/completions", body)
    assert got["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    # the prefill endpoint validates like the public route, and needs a generation route
    st, _, err = post(pre, "/internal/prefill?route=/v1/chat/completions", {"model": MODEL})
    assert st == 400, err
    st, _, err = post(pre, "/internal/prefill?route=/v1/models", body)
    assert st == 400 and err["error"]["param"] == "route", err
    # without --kv-transfer the internal endpoints do not exist
    st, _, err = post(ref, "/internal/kv", None, raw=x,
                      headers={"Content-Type": "application/octet-stream"})
    assert st == 404, err
    st, _, err = post(ref, "/internal/prefill?route=/v1/chat/completions", body)
    assert st == 404, err
    st, _, err = post(ref, "/internal/kv/probe?route=/v1/chat/completions", body)
    assert st == 404, err


def test_pd_skipped_when_decode_holds_prompt(pd):
    # the decode replica answers a probe (the request's prompt, rendered as its route would, looked
    # up in its prefix cache); the router skips the prefill step when all but fewer than
    # --pd-min-new-tokens (default 256) of the prompt are cached there: the same request again,
    # and a conversation extended by a short turn, go without a step; a new long prompt takes one
    ref, pre, dec, router = pd
    body = chat(9)
    probe = "/internal/kv/probe?route=/v1/chat/completions"
    st, _, p0 = post(dec, probe, body)
    assert st == 200 and p0["cached_tokens"] == 0 and p0["disk_tokens"] == 0, p0
    assert p0["prompt_tokens"] > 300
    st, _, want = post(ref, "/v1/chat/completions", body)
    m0 = router.metrics()
    st, _, got = post(router, "/v1/chat/completions", body)
    assert st == 200 and message(got) == message(want)
    m1 = router.metrics()
    assert m1['deepinfer:router_pd_requests_total{outcome="ok"}'] == \
        m0['deepinfer:router_pd_requests_total{outcome="ok"}'] + 1
    # now the decode replica holds every whole block of the prompt
    st, _, p1 = post(dec, probe, body)
    assert st == 200 and p1["prompt_tokens"] == p0["prompt_tokens"], p1
    assert p1["cached_tokens"] == p1["prompt_tokens"] // 16 * 16, p1
    exports = pre.metrics()["deepinfer:kv_transfer_exports_total"]
    st, _, again = post(router, "/v1/chat/completions", body)
    assert st == 200 and message(again) == message(want)
    turn = dict(body, messages=body["messages"] + [
        {"role": "assistant", "content": message(want).split("|")[-1]},
        {"role": "user", "content": "and then?"}])
    st, _, want2 = post(ref, "/v1/chat/completions", turn)
    st, _, got2 = post(router, "/v1/chat/completions", turn)
    assert st == 200 and message(got2) == message(want2)
    assert got2["usage"]["prompt_tokens_details"]["cached_tokens"] >= p1["cached_tokens"]
    m2 = router.metrics()
    assert m2['deepinfer:router_pd_requests_total{outcome="cached"}'] == \
        m1['deepinfer:router_pd_requests_total{outcome="cached"}'] + 2
    assert m2['deepinfer:router_pd_requests_total{outcome="ok"}'] == \
        m1['deepinfer:router_pd_requests_total{outcome="ok"}']
    assert pre.metrics()["deepinfer:kv_transfer_exports_total"] == exports  # no step
    assert dec.metrics()["deepinfer:kv_transfer_probes_total"] >= 5
    # a new long prompt is prefilled as before
    st, _, got3 = post(router, "/v1/chat/completions", chat(10))
    assert st == 200
    assert router.metrics()['deepinfer:router_pd_requests_total{outcome="ok"}'] == \
        m2['deepinfer:router_pd_requests_total{outcome="ok"}'] + 1
    # the probe validates like the route, and needs a generation route
    st, _, err = post(dec, probe, {"model": MODEL})
    assert st == 400, err
    st, _, err = post(dec, "/internal/kv/probe?route=/v1/models", body)
    assert st == 400 and err["error"]["param"] == "route", err


def test_other_model_refused(pd, tmp_path):
    ref, pre, dec, router = pd
    # another numerics recipe is another model identity: its transfers are refused with 409
    other = Server(["--kv-transfer", "--precision", "official"])
    try:
        body = chat(5)
        req = urllib.request.Request(
            other.base + "/internal/prefill?route=/v1/chat/completions",
            data=json.dumps(body).encode(), method="POST",
            headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as r:
            x = r.read()
        st, _, err = post(dec, "/internal/kv", None, raw=x,
                          headers={"Content-Type": "application/octet-stream"})
        assert st == 409, err
        assert err["error"]["code"] == "kv_model_mismatch"
        assert "another model" in err["error"]["message"]
    finally:
        other.stop()


def test_pd_client_leaves_during_prefill(pd):
    # the router drops the prefill call (the prefill replica cancels) and does not ask the
    # decode replica at all
    ref, pre, dec, router = pd
    before_dec = dec.metrics()
    before_pre = pre.metrics()["deepinfer:request_failure_total"]
    conn = http.client.HTTPConnection("127.0.0.1", router.port, timeout=60)
    conn.request("POST", "/v1/chat/completions", json.dumps(chat(9, n_words=1500)),
                 {"Content-Type": "application/json"})
    time.sleep(0.05)
    conn.sock.close()
    deadline = time.time() + 60
    while time.time() < deadline:
        m = router.metrics()
        if m["deepinfer:router_requests_in_flight"] == 0 and \
                pre.metrics()["deepinfer:request_failure_total"] > before_pre:
            break
        time.sleep(0.1)
    assert m["deepinfer:router_requests_in_flight"] == 0
    assert pre.metrics()["deepinfer:request_failure_total"] == before_pre + 1  # cancelled
    after_dec = dec.metrics()
    for k in ("deepinfer:kv_transfer_imports_total", "deepinfer:request_success_total",
              "deepinfer:request_failure_total"):
        assert after_dec[k] == before_dec[k], k


def test_pd_fallback_when_prefill_down(pd):
    ref, pre, dec, router = pd
    rc, _ = pre.stop()
    assert rc == 0
    before = router.metrics()['deepinfer:router_pd_requests_total{outcome="fallback"}']
    for seed in (6, 7):  # the first finds it unreachable, the second finds it out of rotation
        body = chat(seed)
        st, _, want = post(ref, "/v1/chat/completions", body)
        st, _, got = post(router, "/v1/chat/completions", body)
        assert st == 200, got
        assert message(got) == message(want)
        assert got["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    m = router.metrics()
    assert m['deepinfer:router_pd_requests_total{outcome="fallback"}'] == before + 2
    assert "computes the prompt itself" in router.logtext()


def test_pd_with_api_keys():
    # the internal endpoints take the API key like the public ones; the router passes its
    # --replica-api-key to both kinds of replica
    pre = Server(["--kv-transfer", "--api-key", "k1"])
    dec = Server(["--kv-transfer", "--api-key", "k1"])
    router = None
    try:
        st, _, err = post(dec, "/internal/kv", None, raw=b"x",
                          headers={"Content-Type": "application/octet-stream"})
        assert st == 401, err
        st, _, err = post(pre, "/internal/prefill?route=/v1/chat/completions", chat(8))
        assert st == 401, err
        router = Router([dec], prefill=[pre],
                        extra=["--replica-api-key", "k1", "--pd-min-bytes", "0"])
        st, _, got = post(router, "/v1/chat/completions", chat(8))
        assert st == 200, got
        assert got["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        assert router.metrics()['deepinfer:router_pd_requests_total{outcome="ok"}'] == 1
        assert dec.metrics()["deepinfer:kv_transfer_probes_total"] == 1  # the key went along
    finally:
        if router:
            router.stop()
        pre.stop()
        dec.stop()


def test_pd_prefill_affinity():
    # two prefill replicas: a request is prefilled on its prefix's ring replica, so the same
    # prompt again is prefilled where it is cached (a prefix-cache hit there; that decision is
    # the prefix match), and the output is still a plain replica's
    pres = [Server(["--kv-transfer"]), Server(["--kv-transfer"])]
    dec = Server(["--kv-transfer"])
    router = None
    try:
        # --pd-min-new-tokens 0: the decode replica holds each prompt the second time, and the
        # prefill step must run anyway for this test
        router = Router([dec], prefill=pres,
                        extra=["--pd-min-bytes", "1000", "--pd-min-new-tokens", "0"])
        first = {}
        for rnd in range(2):
            for seed in (11, 12, 13):
                before = [p.metrics() for p in pres]
                st, _, got = post(router, "/v1/chat/completions", chat(seed))
                assert st == 200, got
                after = [p.metrics() for p in pres]
                served = [i for i in range(2) if after[i]["deepinfer:kv_transfer_exports_total"] >
                          before[i]["deepinfer:kv_transfer_exports_total"]]
                assert len(served) == 1, served
                i = served[0]
                hit = (after[i]["deepinfer:prefix_cache_hit_tokens_total"] -
                       before[i]["deepinfer:prefix_cache_hit_tokens_total"])
                if rnd == 0:
                    first[seed] = i
                else:  # the same replica, which had the whole prompt but its last block cached
                    assert i == first[seed], (seed, first)
                    assert hit >= got["usage"]["prompt_tokens"] - 32, (seed, hit)
        m = router.metrics()
        # round 0 by the ring, round 1 by the prefix each was sent before (the longest match)
        kinds = {k: sum(m[f'deepinfer:router_prefill_decisions_total{{replica="{i}",'
                            f'decision="{k}"}}'] for i in range(2)) for k in ("affine", "match")}
        assert kinds == {"affine": 3, "match": 3}, kinds
        assert m['deepinfer:router_pd_requests_total{outcome="ok"}'] == 6
    finally:
        if router:
            router.stop()
        for s in (*pres, dec):
            s.stop()


def test_pd_v41(tmp_path):
    # V4.1 (the tiny model: legacy completions of ids below 512, as in test_v41.py): the transfer
    # carries its blocks (the pages: entries and index keys) and the tail snapshot; the decode
    # replica's hit replays nothing and gives a plain replica's output
    d = str(tmp_path / "v41")
    subprocess.run([os.environ["DEEPINFER_BIN"], "synth", "--preset", "v41-tiny", "--out", d],
                   check=True, capture_output=True)
    args = ["--model", d, "--served-model-name", "v41", "--max-ctx", "512", "--max-seqs", "2",
            "--kv-memory", "64"]
    ref = Server(args)
    pre = Server(args + ["--kv-transfer"])
    dec = Server(args + ["--kv-transfer"])
    router = None
    try:
        router = Router([dec], prefill=[pre], extra=["--pd-min-bytes", "0"])
        body = {"model": "v41", "prompt": "3 1 2 " * 50, "max_tokens": 8, "temperature": 0,
                "logprobs": 2}
        st, _, want = post(ref, "/v1/completions", body)
        assert st == 200, want
        st, _, got = post(router, "/v1/completions", body)
        assert st == 200, got
        assert got["choices"] == want["choices"]
        n = got["usage"]["prompt_tokens"]
        assert got["usage"]["prompt_tokens_details"]["cached_tokens"] == (n - 1) // 16 * 16
        md = dec.metrics()
        assert md["deepinfer:kv_transfer_import_blocks_total"] == (n - 1) // 16
        assert md["deepinfer:tail_snapshots_restored_total"] == 1
        assert md["deepinfer:prefix_cache_replayed_tokens_total"] == 0
        assert md["deepinfer:tail_snapshots"] == 1
        assert md["deepinfer:tail_snapshot_bytes"] > 0
        assert router.metrics()['deepinfer:router_pd_requests_total{outcome="ok"}'] == 1
    finally:
        if router:
            router.stop()
        for s in (ref, pre, dec):
            s.stop()


def test_route_pd_arguments():
    bin_ = os.environ["DEEPINFER_BIN"]
    for args, msg in ((["--prefill", "http://127.0.0.1:1"], "at least one --replica"),
                      (["--prefill", "ftp://x", "--decode", "http://127.0.0.1:1"],
                       "--prefill takes http://HOST:PORT"),
                      (["--decode", "http://127.0.0.1:1", "--pd-min-bytes", "-1"],
                       "--pd-min-bytes"),
                      (["--decode", "http://127.0.0.1:1", "--pd-min-new-tokens", "x"],
                       "--pd-min-new-tokens"),
                      (["--decode", "http://127.0.0.1:1", "--prefill-timeout", "soon"],
                       "--prefill-timeout takes a duration")):
        r = subprocess.run([bin_, "route", *args], capture_output=True, text=True, timeout=30)
        assert r.returncode == 2 and msg in r.stderr, (args, r.stderr)
