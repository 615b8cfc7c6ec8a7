"""`deepinfer route`'s admin API (docs/router.md, "Replicas at run time"): serving replicas added,
removed, restored and listed while the router runs and serves, behind --admin-key; wrong keys,
bad bodies and unknown replicas refused; the API off without a key."""
import json
import time
import urllib.error
import urllib.request

from conftest import MODEL, Router, Server, post

KEY = "admin-secret"


def admin(router, method, body=None, key=KEY):
    """A call of /admin/replicas: (status, parsed JSON)."""
    data = json.dumps(body).encode() if body is not None else None
    headers = {"Content-Type": "application/json"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    req = urllib.request.Request(router.base + "/admin/replicas", data=data, method=method,
                                 headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def wait_for(pred, what, timeout=30):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if pred():
            return
        time.sleep(0.1)
    raise AssertionError("timed out waiting for " + what)


def served(router, n, tag):
    """Replicas that served n requests with distinct prompts (no shared prefix: the ring's)."""
    got = []
    for k in range(n):
        body = {"model": MODEL, "max_tokens": 2, "temperature": 0,
                "messages": [{"role": "user", "content": f"{tag} question number {k * 7919}"}]}
        st, hdrs, out = post(router, "/v1/chat/completions", body)
        assert st == 200, out
        got.append(int(hdrs["X-Deepinfer-Replica"]))
    return got


def test_router_admin_replicas():
    a, b = Server(), Server()
    router = Router([a], extra=["--admin-key", KEY])
    try:
        # The key: none, wrong, right.
        assert admin(router, "GET", key=None)[0] == 401
        assert admin(router, "GET", key="wrong")[0] == 401
        st, body = admin(router, "GET")
        assert st == 200 and [r["url"] for r in body["replicas"]] == [a.base], body
        assert body["replicas"][0]["healthy"] and not body["replicas"][0]["removed"]
        # Bad calls change nothing.
        assert admin(router, "POST", {"url": "ftp://127.0.0.1:1"})[0] == 400
        assert admin(router, "POST", {"uri": b.base})[0] == 400
        assert admin(router, "POST", {"url": b.base, "role": "bogus"})[0] == 400
        assert admin(router, "POST", {"url": a.base})[0] == 409  # already there
        assert admin(router, "DELETE", {"url": b.base})[0] == 404  # never added
        assert admin(router, "PUT", {"url": b.base})[0] == 405
        assert len(admin(router, "GET")[1]["replicas"]) == 1

        # Added while serving: polled into rotation, then the ring sends it its share.
        st, body = admin(router, "POST", {"url": b.base + "/"})
        assert st == 201 and body["index"] == 1 and body["url"] == b.base, body
        wait_for(lambda: router.healthy() == [1, 1], "the added replica in rotation")
        assert set(served(router, 12, "spread")) == {0, 1}

        # Removed: no new request reaches it, the other serves everything, /ready stays 200.
        st, body = admin(router, "DELETE", {"url": a.base})
        assert st == 200 and body["status"] == "removed" and body["index"] == 0, body
        assert router.healthy() == [0, 1]
        assert router.per_replica("deepinfer:router_replica_removed") == [1, 0]
        assert set(served(router, 8, "removed")) == {1}
        assert router.ready() == 200
        assert admin(router, "DELETE", {"url": a.base})[0] == 404  # removed already
        listed = {r["url"]: r for r in admin(router, "GET")[1]["replicas"]}
        assert listed[a.base]["removed"] and not listed[a.base]["healthy"]

        # Added back into its old slot: polled again, then served again.
        st, body = admin(router, "POST", {"url": a.base})
        assert st == 200 and body["status"] == "restored" and body["index"] == 0, body
        wait_for(lambda: router.healthy() == [1, 1], "the restored replica in rotation")
        assert set(served(router, 12, "restored")) == {0, 1}

        # Every replica removed: not ready, requests get 503 (no replica), nothing crashes.
        assert admin(router, "DELETE", {"url": a.base})[0] == 200
        assert admin(router, "DELETE", {"url": b.base})[0] == 200
        assert router.ready() == 503
        st, _, out = post(router, "/v1/chat/completions",
                          {"model": MODEL, "max_tokens": 2,
                           "messages": [{"role": "user", "content": "anyone?"}]})
        assert st == 503, out
        assert admin(router, "POST", {"url": b.base})[0] == 200
        wait_for(lambda: router.ready() == 200, "the router ready again")
    finally:
        rc, log = router.stop()
        a.stop()
        b.stop()
    assert rc == 0, log
    assert "admin: serve replica 1 (" + b.base + ") added" in log
    assert "admin: serve replica 0 (" + a.base + ") removed" in log


def test_router_admin_off():
    a = Server()
    router = Router([a])
    try:
        st, body = admin(router, "GET")
        assert st == 404 and "--admin-key" in body["error"]["message"], body
        assert admin(router, "POST", {"url": "http://127.0.0.1:1"})[0] == 404
        assert router.healthy() == [1]
    finally:
        router.stop()
        a.stop()


def long_chat(seed):
    words = ("the quick brown fox jumps over a lazy dog while seven wizards quietly box "
             "jovial zebras near old stone bridges under pale autumn skies").split()
    text = " ".join(words[(i * 7 + seed) % len(words)] for i in range(300))
    return {"model": MODEL, "temperature": 0, "max_tokens": 4,
            "messages": [{"role": "user", "content": text}]}


def test_router_admin_prefill():
    """A prefill replica added at run time turns prefill/decode disaggregation on (the first
    prefill ring made then); removed, requests fall back to the decode replica, same answers."""
    ref, pre, dec = Server(), Server(["--kv-transfer"]), Server(["--kv-transfer"])
    router = Router([dec], extra=["--admin-key", KEY, "--pd-min-bytes", "1000"])
    try:
        def outcome(k):
            return router.metrics().get(f'deepinfer:router_pd_requests_total{{outcome="{k}"}}', 0)

        def same_as_ref(seed):
            body = long_chat(seed)
            st, _, got = post(router, "/v1/chat/completions", body)
            assert st == 200, got
            assert got["choices"] == post(ref, "/v1/chat/completions", body)[2]["choices"]

        same_as_ref(1)  # no prefill replica: one replica serves it whole
        assert outcome("ok") == 0
        st, body = admin(router, "POST", {"url": pre.base, "role": "prefill"})
        assert st == 201 and body["role"] == "prefill" and body["index"] == 0, body
        wait_for(lambda: router.healthy("deepinfer:router_prefill_replica_healthy") == [1],
                 "the prefill replica in rotation")
        same_as_ref(2)
        assert outcome("ok") == 1
        assert dec.metrics()["deepinfer:kv_transfer_imports_total"] == 1
        assert admin(router, "DELETE", {"url": pre.base})[0] == 200
        same_as_ref(3)  # no usable prefill replica: the decode replica computes the prompt
        assert outcome("ok") == 1 and outcome("fallback") == 1
        roles = sorted((r["role"], r["removed"]) for r in admin(router, "GET")[1]["replicas"])
        assert roles == [("prefill", True), ("serve", False)]
    finally:
        router.stop()
        for s in (ref, pre, dec):
            s.stop()
