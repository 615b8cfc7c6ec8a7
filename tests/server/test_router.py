"""`deepinfer route` in front of two `deepinfer serve` replicas (the built-in tiny model) on
loopback: same output as direct, prefix affinity, spreading, SSE pass-through, failover when a
replica dies and its return, client-disconnect cancellation, bad input (docs/router.md)."""
import http.client
import json
import signal
import threading
import time
import urllib.request

import pytest

from conftest import MODEL, Router, Server, post, read_metrics


def flat_metrics(server):
    return {k.split("{")[0]: v for k, v in read_metrics(server.base).items()
            if "le=" not in k and "status=" not in k}



@pytest.fixture(scope="module")
def fleet():
    reps = [Server(), Server()]
    router = Router(reps, extra=["--max-body-mib", "1"])
    yield reps, router
    rc, log = router.stop()
    assert rc == 0, log
    assert "INFO  route: stopped" in log
    for s in reps:
        s.stop()


def chat(text, **kw):
    return {"model": MODEL, "messages": [{"role": "user", "content": text}], "max_tokens": 8,
            "temperature": 0, **kw}


def served_by(hdrs):
    return int(hdrs["X-Deepinfer-Replica"])


BODIES = {
    "/v1/chat/completions": chat("Hello through the router"),
    "/v1/completions": {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 8,
                        "temperature": 0},
    "/v1/responses": {"model": MODEL, "input": "Tell me", "max_output_tokens": 8,
                      "temperature": 0},
    "/v1/messages": {"model": MODEL, "max_tokens": 8, "temperature": 0,
                     "messages": [{"role": "user", "content": "Hi Claude"}]},
}


def no_ids(v):
    if isinstance(v, dict):
        return {k: no_ids(x) for k, x in v.items() if k != "id"}
    if isinstance(v, list):
        return [no_ids(x) for x in v]
    return v


def answer(path, body):
    """The generated output of a non-streaming answer, whatever the API (ids left out)."""
    if path == "/v1/chat/completions":
        m = body["choices"][0]["message"]
        return (m.get("reasoning_content"), m.get("content"))
    if path == "/v1/completions":
        return body["choices"][0]["text"]
    if path == "/v1/responses":
        return json.dumps(no_ids(body["output"]), sort_keys=True)
    return json.dumps(no_ids(body["content"]), sort_keys=True)


# (a) the router returns what a replica returns directly (temperature 0), for every API
def test_router_same_output_as_direct(fleet):
    reps, router = fleet
    for path, body in BODIES.items():
        st, hdrs, via = post(router, path, body)
        assert st == 200, via
        i = served_by(hdrs)
        for r in reps:  # the two replicas serve the same model: both agree with the router
            st, _, direct = post(r, path, body)
            assert st == 200, direct
            assert answer(path, via) == answer(path, direct), (path, i)
    st, _, models = urllib.request.urlopen(router.base + "/v1/models", timeout=10).status, None, \
        json.loads(urllib.request.urlopen(router.base + "/v1/models", timeout=10).read())
    assert st == 200 and models["data"][0]["id"] == MODEL
    # Anthropic token counting goes through too, to the same answer as a replica's
    count = {"model": MODEL, "messages": [{"role": "user", "content": "how many tokens?"}]}
    st, _, via = post(router, "/v1/messages/count_tokens", count)
    assert st == 200 and via["input_tokens"] > 0, via
    assert via == post(reps[0], "/v1/messages/count_tokens", count)[2]


def long_prefix(seed):
    return " ".join(f"{seed}-section {k}: the quick brown fox jumps over the lazy dog." for k in
                    range(60))  # ~3,500 bytes: longer than the router's 1,024-byte key


# (b) the same long prefix lands on the same replica, whose prefix cache then hits
def test_router_prefix_affinity(fleet):
    reps, router = fleet
    for seed in range(4):
        system = long_prefix(seed)
        first = {"model": MODEL, "max_tokens": 2, "temperature": 0,
                 "messages": [{"role": "system", "content": system},
                              {"role": "user", "content": "first question"}]}
        second = dict(first, messages=[first["messages"][0],
                                       {"role": "user", "content": "another, different one"}])
        st, h1, _ = post(router, "/v1/chat/completions", first)
        assert st == 200
        i = served_by(h1)
        hits = [flat_metrics(r)["deepinfer:prefix_cache_hit_tokens_total"] for r in reps]
        st, h2, body = post(router, "/v1/chat/completions", second)
        assert st == 200
        assert served_by(h2) == i
        after = [flat_metrics(r)["deepinfer:prefix_cache_hit_tokens_total"] for r in reps]
        assert after[i] - hits[i] > 100, (hits, after)  # the long system prompt was reused
        assert after[1 - i] == hits[1 - i]
        assert body["usage"]["prompt_tokens_details"]["cached_tokens"] > 100
    m = router.metrics()
    # the first request of each pair by the ring, the second by the ring or by its match
    routed = sum(v for k, v in m.items() if 'decision="affine"' in k or 'decision="match"' in k)
    assert routed >= 8


# (b2) a shared system prompt shorter than the ring key (so the ring alone would spread the
# requests by their user turns) keeps them on the replica that was sent it: the longest match
def test_router_prefix_match(fleet):
    reps, router = fleet
    system = " ".join(f"rule {k}: answer briefly and politely." for k in range(24))  # ~900 B
    assert 800 < len(system) < 1000
    before = router.metrics()
    served, cached = set(), []
    for k in range(8):
        body = {"model": MODEL, "max_tokens": 2, "temperature": 0,
                "messages": [{"role": "system", "content": system},
                             {"role": "user", "content": f"question {k}: {'why ' * k}now?"}]}
        st, hdrs, out = post(router, "/v1/chat/completions", body)
        assert st == 200, out
        served.add(served_by(hdrs))
        cached.append(out["usage"]["prompt_tokens_details"]["cached_tokens"])
    assert len(served) == 1, served
    assert all(c > 0 for c in cached[1:]), cached  # the system prompt was reused every time
    after = router.metrics()
    match = sum(v - before.get(k, 0) for k, v in after.items() if 'decision="match"' in k)
    assert match >= 7, match


# (c) different prefixes spread over both replicas
def test_router_spreads_prefixes(fleet):
    reps, router = fleet
    before = router.per_replica("deepinfer:router_replica_requests_total")
    seen = set()
    for k in range(16):
        st, hdrs, _ = post(router, "/v1/completions",
                           {"model": MODEL, "prompt": f"{k} distinct prompt number {k}",
                            "max_tokens": 1})
        assert st == 200
        seen.add(served_by(hdrs))
    assert seen == {0, 1}
    after = router.per_replica("deepinfer:router_replica_requests_total")
    assert after[0] > before[0] and after[1] > before[1]
    assert sum(after) - sum(before) == 16


def stream(port, path, body):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
    return conn, conn.getresponse()


# (d) SSE through the router arrives event by event and ends with [DONE]
def test_router_streams_incrementally(fleet):
    reps, router = fleet
    body = chat("Stream a long answer please", max_tokens=120, stream=True)
    conn, r = stream(router.port, "/v1/chat/completions", body)
    assert r.status == 200
    assert r.getheader("Content-Type").startswith("text/event-stream")
    rep = reps[int(r.getheader("X-Deepinfer-Replica"))]
    events, text, running_at_first = [], [], None
    while True:
        line = r.readline()
        if not line:
            break
        line = line.decode().strip()
        if not line.startswith("data: "):
            continue
        events.append(line)
        if running_at_first is None:
            # the first event is here while the replica is still generating the rest
            running_at_first = flat_metrics(rep)["deepinfer:num_http_requests_in_flight"]
        if line != "data: [DONE]":
            for c in json.loads(line[6:])["choices"]:
                text.append(c["delta"].get("reasoning_content") or "")
                text.append(c["delta"].get("content") or "")
    conn.close()
    assert running_at_first == 1
    assert len(events) > 10
    assert events[-1] == "data: [DONE]"
    assert events.count("data: [DONE]") == 1
    st, _, direct = post(rep, "/v1/chat/completions", dict(body, stream=False))
    m = direct["choices"][0]["message"]
    assert "".join(text) == (m.get("reasoning_content") or "") + (m.get("content") or "")


# (f) a client leaving mid-stream cancels the replica's request and frees its KV
def test_router_disconnect_frees_replica(fleet):
    reps, router = fleet
    body = chat("Never finish this", max_tokens=2000, stream=True)
    conn, r = stream(router.port, "/v1/chat/completions", body)
    assert r.status == 200
    rep = reps[int(r.getheader("X-Deepinfer-Replica"))]
    gen_before = flat_metrics(rep)["deepinfer:generation_tokens_total"]
    n = 0
    while n < 3:
        if r.readline().decode().startswith("data: "):
            n += 1
    assert flat_metrics(rep)["deepinfer:num_requests_running"] == 1
    r.close()  # the response holds the socket too
    conn.close()
    deadline = time.time() + 30
    while time.time() < deadline:
        m = flat_metrics(rep)
        if (m["deepinfer:num_requests_running"] == 0 and m["deepinfer:kv_cache_usage_perc"] == 0
                and m["deepinfer:num_http_requests_in_flight"] == 0):
            break
        time.sleep(0.1)
    assert m["deepinfer:num_requests_running"] == 0, m
    assert m["deepinfer:kv_cache_usage_perc"] == 0, m
    assert m["deepinfer:num_http_requests_in_flight"] == 0, m
    assert "(client disconnected)" in rep.logtext()  # cancelled by the replica
    assert m["deepinfer:generation_tokens_total"] - gen_before < 1000  # cut short, not finished
    deadline = time.time() + 10
    while time.time() < deadline and router.metrics()["deepinfer:router_requests_in_flight"]:
        time.sleep(0.1)
    assert router.metrics()["deepinfer:router_requests_in_flight"] == 0
    assert sum(router.per_replica("deepinfer:router_replica_in_flight")) == 0


# (g) bad input gets a clear 4xx and the router stays up
def test_router_bad_requests(fleet):
    reps, router = fleet
    # counted from here: the fixture's readiness polls may have met 503 from /ready while the
    # replicas' first health checks were pending
    before = router.metrics()
    st, _, b = post(router, "/v1/nothing", {})
    assert st == 404 and "Unknown path" in b["error"]["message"]
    req = urllib.request.Request(router.base + "/v1/chat/completions", method="GET")
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=10)
    assert e.value.code == 405
    st, _, b = post(router, "/v1/chat/completions", None, raw=b"{not json")
    assert st == 400 and "Invalid JSON" in b["error"]["message"]
    st, _, b = post(router, "/v1/messages", None, raw=b"[1, 2]")
    assert st == 400 and b["type"] == "error" and b["error"]["type"] == "invalid_request_error"
    st, _, b = post(router, "/v1/completions", None, raw=b"x" * (1536 << 10))  # cap: 1 MiB
    assert st == 413, b
    # the replica's own validation errors come back as they are
    st, hdrs, b = post(router, "/v1/chat/completions", {"model": MODEL, "messages": "nope"})
    assert st == 400 and "X-Deepinfer-Replica" in hdrs, b
    assert router.proc.poll() is None
    with urllib.request.urlopen(router.base + "/health", timeout=5) as r:
        assert r.status == 200
    st, _, _ = post(router, "/v1/chat/completions", chat("still fine"))
    assert st == 200
    m = router.metrics()
    d4, d5 = (m[k] - before[k] for k in ('deepinfer:http_responses_total{status="4xx"}',
                                         'deepinfer:http_responses_total{status="5xx"}'))
    assert d4 >= 6 and d5 == 0, (before, m)


def test_router_api_keys_and_timeout():
    rep = Server(["--api-key", "replica-secret"])
    router = Router([rep], extra=["--api-key", "front-secret", "--replica-api-key",
                                  "replica-secret", "--upstream-timeout", "1s"])
    try:
        st, _, _ = post(router, "/v1/chat/completions", chat("hi"))
        assert st == 401
        auth = {"Authorization": "Bearer front-secret"}
        st, _, _ = post(router, "/v1/chat/completions", chat("hi"), headers=auth)
        assert st == 200  # the replica got its own key
        st, _, _ = post(router, "/v1/messages", BODIES["/v1/messages"],
                        headers={"x-api-key": "front-secret"})
        assert st == 200
        # a non-streaming answer that takes longer than --upstream-timeout: 504, not retried
        st, _, b = post(router, "/v1/completions",
                        {"model": MODEL, "prompt": "slow", "max_tokens": 2000}, headers=auth)
        assert st == 504, b
        assert router.metrics()["deepinfer:router_retries_total"] == 0
    finally:
        rc, log = router.stop()
        rep.stop()
    assert rc == 0, log


# (e) a replica dies: /ready stays 200, requests (one in flight on it included) succeed on the
# other, /metrics shows it out of rotation; restarted, it returns to rotation
def test_router_failover_and_return():
    reps = [Server(), Server()]
    router = Router(reps)
    try:
        prompt = chat("Pick my replica", max_tokens=2)
        st, hdrs, _ = post(router, "/v1/chat/completions", prompt)
        assert st == 200
        victim = served_by(hdrs)
        other = 1 - victim
        # the same prompt (same replica) generating long, killed before its first byte
        out = {}

        def slow():
            out["r"] = post(router, "/v1/chat/completions", dict(prompt, max_tokens=200))

        t = threading.Thread(target=slow)
        t.start()
        deadline = time.time() + 30
        while time.time() < deadline:
            if flat_metrics(reps[victim])["deepinfer:num_requests_running"] == 1:
                break
            time.sleep(0.05)
        port = reps[victim].port
        reps[victim].proc.send_signal(signal.SIGKILL)
        reps[victim].proc.wait()
        t.join(timeout=120)
        st, hdrs, body = out["r"]
        assert st == 200, body  # retried on the other replica
        assert served_by(hdrs) == other
        assert body["usage"]["completion_tokens"] == 200
        assert router.metrics()["deepinfer:router_retries_total"] == 1
        assert router.ready() == 200
        for k in range(6):
            st, hdrs, _ = post(router, "/v1/completions",
                               {"model": MODEL, "prompt": f"{k} after the kill", "max_tokens": 1})
            assert st == 200 and served_by(hdrs) == other
        health = router.healthy()
        assert health[victim] == 0 and health[other] == 1
        errors = router.per_replica("deepinfer:router_replica_errors_total")
        assert errors[victim] >= 1 and errors[other] == 0
        reps[victim].stop()
        # back on the same port: in rotation again, and the affine prompt goes there again
        reps[victim] = Server(port=port)
        deadline = time.time() + 30
        while time.time() < deadline and router.healthy()[victim] != 1:
            time.sleep(0.1)
        assert router.healthy()[victim] == 1
        st, hdrs, _ = post(router, "/v1/chat/completions", prompt)
        assert st == 200 and served_by(hdrs) == victim
        assert "out of rotation" in router.logtext()
    finally:
        rc, log = router.stop()
        for s in reps:
            s.stop()
    assert rc == 0, log
