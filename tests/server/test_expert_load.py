"""EPLB's load statistics over HTTP (docs/server.md, docs/expert-parallel.md "EPLB"):
GET /internal/expert-load answers the routing load per (MoE layer, expert) behind the API key, and
it grows with the tokens a request feeds; /metrics carries the compact summary."""
import json
import urllib.error
import urllib.request

from conftest import Server, post

KEY = "sekrit"
AUTH = {"Authorization": "Bearer " + KEY}


def get_load(server, headers=None):
    req = urllib.request.Request(server.base + "/internal/expert-load", headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, r.headers.get("Content-Type"), json.loads(r.read().decode())
    except urllib.error.HTTPError as e:
        return e.code, e.headers.get("Content-Type"), json.loads(e.read().decode())


def test_expert_load_endpoint_and_metrics():
    s = Server(extra=["--api-key", KEY])
    try:
        status, _, body = get_load(s)
        assert status == 401, body
        status, _, body = get_load(s, {"Authorization": "Bearer wrong"})
        assert status == 401, body

        status, ctype, before = get_load(s, AUTH)
        assert status == 200
        assert ctype.startswith("application/json")
        assert before["format"] == "deepinfer-expert-load" and before["version"] == 1
        L, E = before["n_layers"], before["n_expert"]
        assert L >= 2 and E >= 2
        assert len(before["rows"]) == L and len(before["load"]) == L
        assert all(len(row) == E for row in before["load"])
        assert all(isinstance(c, int) and c >= 0 for row in before["load"] for c in row)
        total_before = sum(map(sum, before["load"]))

        chat = {"model": "deepinfer-tiny", "max_tokens": 6,
                "messages": [{"role": "user", "content": "Count the experts, please."}]}
        status, _, body = post(s, "/v1/chat/completions", chat, headers=AUTH)
        assert status == 200, body
        status, _, after = get_load(s, AUTH)
        assert status == 200
        # Prompt tokens + generated tokens but the last one went through every main layer.
        fed = body["usage"]["prompt_tokens"] + body["usage"]["completion_tokens"] - 1
        grown = [after["rows"][l] - before["rows"][l] for l in range(L)]
        main = [g for g in grown if g > 0]
        assert main and all(g == fed for g in main), (grown, fed)
        # Every row routes to K experts: each layer's counts grew by rows x K, the same K.
        ks = {(sum(after["load"][l]) - sum(before["load"][l])) // grown[l]
              for l in range(L) if grown[l]}
        assert len(ks) == 1 and ks.pop() >= 1
        for l in range(L):
            assert all(a >= b for a, b in zip(after["load"][l], before["load"][l]))
        total = sum(map(sum, after["load"]))
        assert total > total_before

        m = s.metrics()
        assert m["deepinfer:expert_routed_pairs_total"] == total
        loaded = [row for row in after["load"] if sum(row)]
        want = sum(max(row) * E / sum(row) for row in loaded) / len(loaded)
        assert abs(m["deepinfer:expert_load_imbalance"] - want) < 1e-5
        assert m["deepinfer:expert_load_imbalance"] >= 1.0
    finally:
        rc, log = s.stop()
    assert rc == 0, log
